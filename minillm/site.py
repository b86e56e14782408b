"""The book as a static HTML site: `book.yml` -> a Jupyter Book source tree -> `_build/html`.

    python -m minillm.site                # execute the chapters and solutions in place, then build
    python -m minillm.site --no-execute   # build from the outputs committed in the notebooks
    # -> _build/html/index.html

`build_site()` does four things, in order:

1. reads `book.yml` (`minillm.book.load_book`) and checks that every written chapter has its chapter,
   exercise and solution notebooks (planned chapters are listed on the intro page as "coming" and
   skipped everywhere else);
2. with `execute=True`, runs the written chapters' and solutions' notebooks in place in the repository
   with nbclient (exercises are not run: their tasks raise `NotImplementedError` by design);
3. writes a Jupyter Book source tree under `<out_dir>/src/`: an intro page, copies of the notebooks
   (chapters, then exercises, then solutions, keeping their repository paths so links between them
   work), a drill-bank page, and `_config.yml` / `_toc.yml` generated from `book.yml`;
4. builds it with Sphinx (through `jupyter-book config sphinx`, so `_config.yml` stays the one place
   the site is configured) into `<out_dir>/html`, and fails with the builder's messages on any error.

The site works with no network: MathJax is fetched once from the npm registry (`npm pack`), cached
under `<out_dir>/.cache/`, and served from the site's own `_static/`; launch, Thebe, repository and
widget buttons, which would load code from the internet, are switched off.
"""

from __future__ import annotations

import argparse
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

from minillm.book import Book, BookError, Chapter, load_book
from minillm.grading.drills import DRILLS_DIR, Drill, DrillError, load_drills, render_markdown

MATHJAX_VERSION = "3.2.2"
# What tex-chtml.js needs from MathJax's es5/ folder: the combined component itself, the fonts it
# loads (output/), and the components it may load on demand (TeX extensions, menu, accessibility).
# The other combined builds (SVG, MathML input, node) are left out: they are never loaded.
MATHJAX_KEEP = ("tex-chtml.js", "input", "output", "ui", "a11y", "sre", "adaptors")
MATHJAX_ENTRY = "mathjax/tex-chtml.js"  # relative to the site's _static/

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
    execute:   run the written chapters and solutions in place before building (otherwise the
               outputs committed in the notebooks are used as they are).
    cache_dir: where downloads (MathJax) are kept between builds (default: `<out_dir>/.cache`).
    """
    book = load_book(book_path)
    out = Path(out_dir)
    if not out.is_absolute():
        out = book.root / out
    out = out.resolve()
    cache = Path(cache_dir).resolve() if cache_dir is not None else out / ".cache"

    parts = notebook_parts(book)
    if execute:
        for path in [*parts["Chapters"], *parts["Solutions"]]:
            execute_notebook(book.root / path)

    src = out / "src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    for paths in parts.values():
        for path in paths:
            (src / path).parent.mkdir(parents=True, exist_ok=True)
            copy_for_reading(book.root / path, src / path)
    (src / "index.md").write_text(intro_page(book), encoding="utf-8")
    (src / "drills.md").write_text(drill_bank_page(book), encoding="utf-8")
    shutil.copytree(fetch_mathjax(cache), src / "_mathjax" / "mathjax")
    (src / "_config.yml").write_text(yaml.safe_dump(site_config(book), sort_keys=False), encoding="utf-8")
    (src / "_toc.yml").write_text(yaml.safe_dump(site_toc(book, parts), sort_keys=False), encoding="utf-8")

    html = out / "html"
    run_sphinx(src, html, out / ".doctrees")
    return html


def copy_for_reading(source: Path, dest: Path) -> None:
    """Copy a notebook into the site without its test markers (`# NBVAL_...` lines), which mean nothing to a reader."""
    import nbformat

    nb = nbformat.read(source, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = "\n".join(ln for ln in cell.source.split("\n") if not ln.strip().startswith("# NBVAL_"))
    nbformat.write(nb, dest)


def notebook_parts(book: Book) -> dict[str, list[str]]:
    """The written chapters' notebooks by part of the book, as repository-relative paths.

    Raises SiteError when a written chapter's notebook, exercise or solution file is missing.
    """
    parts: dict[str, list[str]] = {"Chapters": [], "Exercises": [], "Solutions": []}
    missing = []
    for ch in book.written():
        for part, path in (("Chapters", ch.notebook), ("Exercises", ch.exercise), ("Solutions", ch.solution)):
            if not (book.root / path).is_file():
                missing.append(f"chapter {ch.id} ({ch.title}): {path}")
            parts[part].append(path)
    if missing:
        raise SiteError(
            "book.yml marks these chapters `status: written`, but their files do not exist:\n  "
            + "\n  ".join(missing)
            + "\nWrite the files, or set the chapter back to `status: planned`."
        )
    return parts


def execute_notebook(path: Path, timeout: int = 900) -> None:
    """Run a notebook top to bottom in its own folder and save it with its new outputs."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    print(f"executing {path}", flush=True)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": path.parent}})
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as err:
        raise SiteError(f"{path} failed to run; the failing cell and its error:\n{err}") from None
    nbformat.write(nb, path)
    print(f"  done in {time.perf_counter() - start:.1f} s", flush=True)


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
    """The drills of the bank (`minillm.grading.drills`) that belong to the book's written chapters."""
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
        "exclude_patterns": ["_build", "_mathjax", "**.ipynb_checkpoints"],
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
                # MathJax from the site itself (see fetch_mathjax), not from a CDN.
                "html_static_path": ["_mathjax"],
                "mathjax_path": MATHJAX_ENTRY,
                # myst-nb loads require.js and the widget manager from a CDN when a notebook saved
                # widget state (tqdm bars do): off; the bars' text output still shows.
                "nb_ipywidgets_js": {},
            }
        },
    }


def site_toc(book: Book, parts: dict[str, list[str]]) -> dict[str, Any]:
    """Jupyter Book's `_toc.yml`: intro, then the parts Chapters, Exercises, Solutions, Drill bank."""
    by_path: dict[str, Chapter] = {}
    for ch in book.written():
        by_path.update({ch.notebook: ch, ch.exercise: ch, ch.solution: ch})
    suffix = {"Chapters": "", "Exercises": ": exercises", "Solutions": ": solutions"}
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
    """MathJax's browser files (the parts of `es5/` in MATHJAX_KEEP), downloaded once and cached.

    Fetched with `npm pack mathjax@VERSION` from the npm registry into `cache/mathjax-VERSION/`; a
    later build finds them there and downloads nothing. Returns the folder holding `tex-chtml.js`.
    """
    target = cache / f"mathjax-{version}"
    if (target / "tex-chtml.js").is_file():
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise SiteError(
            "npm not found: the site serves its own copy of MathJax, fetched once from the npm registry. "
            "Install Node.js and npm (apt-get install -y npm), or unpack MathJax's es5/ folder into "
            f"{target}."
        )
    cache.mkdir(parents=True, exist_ok=True)
    print(f"fetching mathjax@{version} from the npm registry into {target}", flush=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        done = subprocess.run(
            [npm, "pack", f"mathjax@{version}", "--silent"], cwd=tmp, capture_output=True, text=True
        )
        tarballs = list(Path(tmp).glob("mathjax-*.tgz"))
        if done.returncode != 0 or not tarballs:
            raise SiteError(f"`npm pack mathjax@{version}` failed:\n{done.stdout}{done.stderr}")
        with tarfile.open(tarballs[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith("package/es5/")]
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, members=members, **safe)
        es5 = Path(tmp) / "package" / "es5"
        staging = Path(tmp) / "keep"
        staging.mkdir()
        for name in MATHJAX_KEEP:
            copy = shutil.copytree if (es5 / name).is_dir() else shutil.copy2
            copy(es5 / name, staging / name)
        try:
            staging.rename(target)  # last, so an interrupted download leaves no half-filled cache
        except OSError:
            if not (target / "tex-chtml.js").is_file():  # not a build beside this one that got there first
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
    """`python -m minillm.site [--no-execute] [--out DIR] [--book BOOK_YML]`: build the HTML book."""
    parser = argparse.ArgumentParser(prog="python -m minillm.site", description=__doc__.splitlines()[0])
    parser.add_argument("--no-execute", action="store_true", help="use the outputs committed in the notebooks")
    parser.add_argument("--out", default=None, help="build folder (default: _build at the repository root)")
    parser.add_argument("--book", default=None, help="the book.yml to build (default: the repository's)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve() if args.out else "_build"
    try:
        html = build_site(args.book, out_dir=out, execute=not args.no_execute)
    except (SiteError, BookError, DrillError) as err:
        print(f"minillm.site: error: {err}", file=sys.stderr)
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
