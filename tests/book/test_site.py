"""The HTML book, checked in a real browser: `minillm.book.site.build_site`, served locally, driven by Chromium.

Two books are built once each (module-scoped fixtures) and served from 127.0.0.1:

- a small fixture book written here (two written chapters, 00 and 01, with math, a matplotlib plot and
  code, their exercises and solutions, and a planned chapter), executed by the build itself (copies,
  in the build folder: the fixture's own notebooks must come out of the build byte for byte as they
  went in), so the whole pipeline is proven even before the real book has a written chapter; its
  drill-bank page shows the real bank's drills for chapters 00 and 01;
- the real book from `book.yml`, built from the committed notebooks (execute=False).

Headless Chromium (Debian's, /usr/bin/chromium, driven by Playwright) then checks that every chapter page
loads with its title, every image decodes, math is typeset by the site's own MathJax, the theme's
"next" link works, the drill answers sit in closed reveals, and no request fails or leaves 127.0.0.1;
and that on every chapter, exercise and solution page, at a laptop's 1366 x 900, no code input is cut,
every diagram is drawn as an SVG by the site's own mermaid, and no section number appears twice; at a
phone's 390 px, the page never scrolls sideways as a whole. A full-page screenshot of each chapter is
saved under `_build/screenshots/`.

Tiny one-chapter books, without a browser, check the rest of the execution story: a second build
re-runs nothing (a cell that appends to a file outside the book counts the runs), a changed code cell
or engine file re-runs, a failing cell fails the build by name and caches nothing, and
`--execute-sources`, the authors' command, does write outputs into the notebooks.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from minillm.book import REPO_ROOT, load_book
from minillm.book.site import MATHJAX_VERSION, MERMAID_VERSION, SiteError, build_site, written_drills

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
SCREENSHOTS = REPO_ROOT / "_build" / "screenshots"
CACHE = REPO_ROOT / "_build" / ".cache"  # MathJax, downloaded once for every test run


def _missing(what: str, how: str) -> None:
    message = f"{what} is needed for the browser test of the HTML book: {how}"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set, so this fails instead of skipping)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def build_tools() -> None:
    """What building the site needs: Jupyter Book, and npm to fetch MathJax and mermaid once."""
    try:
        import jupyter_book  # noqa: F401
    except ImportError:
        _missing("The book extra (jupyter-book, playwright)", "pip install -e '.[book]'")
    cached = [CACHE / f"mathjax-{MATHJAX_VERSION}", CACHE / f"mermaid-{MERMAID_VERSION}"]
    if shutil.which("npm") is None and not all(folder.is_dir() for folder in cached):
        _missing("npm (to fetch MathJax and mermaid once)", "apt-get install -y npm")


@pytest.fixture(scope="module")
def browser(build_tools) -> Iterator:
    if not CHROMIUM.is_file():
        _missing(str(CHROMIUM), "apt-get install -y chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright", "pip install -e '.[book]'")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


# ---------------------------------------------------------------------------------------------------
# The fixture book


def _notebook(cells: list[tuple[str, str]]) -> dict:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
                for kind, src in cells]
    return nb


FIXTURE_CHAPTERS = {
    "00_squares": [
        ("md", "# Sums of squares\n\nThe energy of a vector is\n\n$$\\sum_i x_i^2$$\n\nand its norm is "
               "$\\lVert x \\rVert = \\sqrt{\\sum_i x_i^2}$."),
        ("code", "import numpy as np\nx = np.arange(5.0)\nprint('energy', float((x ** 2).sum()))"),
        ("code", "%matplotlib inline\nimport matplotlib.pyplot as plt\n"
                 "fig, ax = plt.subplots(figsize=(5, 3))\nax.plot(x, x ** 2, marker='o')\n"
                 "ax.set_xlabel('x'); ax.set_ylabel('x squared'); ax.set_title('Squares grow fast')\nplt.show()"),
    ],
    "01_cubes": [
        ("md", "# Cubes\n\nThe next chapter: $$\\sum_{i=1}^n i^3 = \\left(\\frac{n(n+1)}{2}\\right)^2$$"),
        ("code", "n = 10\nprint(sum(i ** 3 for i in range(1, n + 1)), (n * (n + 1) // 2) ** 2)"),
    ],
}
FIXTURE_TITLES = {"00_squares": "Sums of squares", "01_cubes": "Cubes"}


def write_fixture_book(root: Path) -> Path:
    import nbformat

    chapters = []
    for i, (slug, cells) in enumerate(FIXTURE_CHAPTERS.items()):
        for folder, extra in (("chapters", []), ("solutions", [("code", "answer = 42\nprint(answer)")]),
                              ("exercises", [("code", "answer = None  # your turn")])):
            (root / folder).mkdir(exist_ok=True)
            nb = _notebook(cells[:1] + extra if folder != "chapters" else cells)
            if folder == "exercises":  # committed as generated: never executed by the build
                nb.cells[0].source = nb.cells[0].source.replace("# ", "# Exercises: ", 1)
            nbformat.write(nb, root / folder / f"{slug}.ipynb")
        chapters.append({
            "id": f"{i:02d}", "title": FIXTURE_TITLES[slug], "status": "written",
            "notebook": f"chapters/{slug}.ipynb", "solution": f"solutions/{slug}.ipynb",
            "exercise": f"exercises/{slug}.ipynb", "goals": [f"Compute {FIXTURE_TITLES[slug].lower()}."],
        })
    chapters.append({"id": "02", "title": "Fourth powers", "status": "planned", "notebook": "chapters/02_fourth.ipynb",
                     "solution": "solutions/02_fourth.ipynb", "exercise": "exercises/02_fourth.ipynb",
                     "goals": ["Wait for it."]})
    book = {"title": "A fixture book", "author": "The test suite", "chapters": chapters}
    (root / "book.yml").write_text(yaml.safe_dump(book, sort_keys=False), encoding="utf-8")
    return root / "book.yml"


class Site:
    """A built book served over HTTP on 127.0.0.1, and what a browser finds on its pages."""

    def __init__(self, name: str, book_path: Path | None, html: Path, build_s: float) -> None:
        self.name, self.book, self.html, self.build_s = name, load_book(book_path), html, build_s
        self.files_before: dict[str, tuple[bytes, int]] = {}  # the book folder before the build
        self.shot_prefix = "" if name == "book" else f"{name}-"
        handler = functools.partial(_QuietHandler, directory=str(html))
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def page_url(self, repo_path: str) -> str:
        return self.url + str(Path(repo_path).with_suffix(".html"))


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's signature)
        pass


def _build(name: str, book_path: Path | None, out: Path, execute: bool) -> Site:
    start = time.perf_counter()
    html = build_site(book_path, out_dir=out, execute=execute, cache_dir=CACHE)
    build_s = time.perf_counter() - start
    print(f"\n[{name}] build_site(execute={execute}) took {build_s:.1f} s", file=sys.stderr)
    return Site(name, book_path, html, build_s)


def book_files(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of a book's folder outside its build folder: its bytes and modification time (ns)."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] != "_build"
    }


@pytest.fixture(scope="module")
def fixture_site(tmp_path_factory, build_tools) -> Iterator[Site]:
    root = tmp_path_factory.mktemp("fixture_book")
    book_path = write_fixture_book(root)
    before = book_files(root)
    site = _build("fixture", book_path, root / "_build", execute=True)
    site.files_before = before
    yield site
    site.close()


@pytest.fixture(scope="module")
def real_site(tmp_path_factory, browser) -> Iterator[Site]:
    site = _build("book", None, tmp_path_factory.mktemp("real_book"), execute=False)
    yield site
    site.close()


# ---------------------------------------------------------------------------------------------------
# The browser


class Visit:
    """Open one page in a fresh tab, recording every failed, erroring or outside request and JS error."""

    def __init__(self, browser, url: str, viewport: dict | None = None) -> None:
        self.problems: list[str] = []
        self.page = browser.new_page(viewport=viewport or {"width": 1366, "height": 900})  # a common laptop
        self.page.on("request", self._request)
        self.page.on("requestfailed", lambda r: self.problems.append(f"failed: {r.url} ({r.failure})"))
        self.page.on("response", lambda r: r.status >= 400 and self.problems.append(f"HTTP {r.status}: {r.url}"))
        self.page.on("pageerror", lambda e: self.problems.append(f"JavaScript error: {e}"))
        self.goto(url)

    def _request(self, request) -> None:
        url = urlparse(request.url)
        if url.scheme in ("http", "https", "ws", "wss") and url.hostname != "127.0.0.1":
            self.problems.append(f"outside request: {request.url}")

    def goto(self, url: str) -> None:
        self.page.goto(url, wait_until="load")
        self.settle()

    def settle(self) -> None:
        """Wait until the page has loaded, MathJax (if the page loads it) has typeset it, and its fonts and
        images are in. These are the page's own signals; Playwright's "networkidle" is a timing guess
        (no request for 500 ms) that its docs discourage, and it hung here on a page that was done."""
        self.page.wait_for_load_state("load")
        self.page.evaluate("""async () => {
            if (window.MathJax !== undefined) {
                for (let i = 0; i < 100 && !(MathJax.startup && MathJax.startup.promise); i++)
                    await new Promise(r => setTimeout(r, 50));
                await MathJax.startup.promise;
            }
            await document.fonts.ready;
            const pending = Array.from(document.images).filter(i => !i.complete);
            await Promise.all(pending.map(i => new Promise(r => { i.onload = r; i.onerror = r; })));
            if (window.minillmDiagrams !== undefined) await window.minillmDiagrams.catch(() => null);
        }""")

    def images(self) -> list[dict]:
        return self.page.evaluate(
            "() => Array.from(document.images).map(i => ({src: i.src, complete: i.complete, w: i.naturalWidth}))"
        )

    def close(self) -> None:
        self.page.close()


def screenshot(visit: Visit, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    visit.page.screenshot(path=str(SCREENSHOTS / name), full_page=True)


def check_chapter(browser, site: Site, chapter) -> Visit:
    """The checks every chapter page must pass; returns the open visit for further checks."""
    visit = Visit(browser, site.page_url(chapter.notebook))
    h1 = visit.page.locator("article h1, main h1").first.inner_text()
    assert chapter.title.lower() in h1.lower(), f"chapter {chapter.id}: heading {h1!r} lacks {chapter.title!r}"
    assert chapter.title.lower() in visit.page.title().lower()
    broken = [i for i in visit.images() if not i["complete"] or i["w"] == 0]
    assert not broken, f"chapter {chapter.id}: images that do not decode: {broken}"
    source = (site.book.root / chapter.notebook).read_text(encoding="utf-8")
    if "$" in source:  # the chapter has math: the site's MathJax must have typeset it
        assert visit.page.locator("mjx-container").count() > 0, f"chapter {chapter.id}: math is not typeset"
        assert not visit.page.locator("mjx-merror").count(), f"chapter {chapter.id}: MathJax reports a TeX error"
    screenshot(visit, f"{site.shot_prefix}{chapter.slug}.png")
    assert not visit.problems, f"chapter {chapter.id}: " + "\n".join(visit.problems)
    return visit


def check_layout(visit: Visit, page: str) -> None:
    """At 1366 x 900: no code input is cut (every line shows without scrolling sideways), every diagram is
    drawn as an SVG, no image is broken, and no section number appears twice on the page."""
    clipped = visit.page.evaluate("""() => Array.from(document.querySelectorAll('article pre'))
        .filter(pre => !pre.closest('.cell_output, .output') && !pre.classList.contains('mermaid'))
        .map((pre, i) => ({i: i, over: pre.scrollWidth - pre.clientWidth, line: pre.innerText.split('\\n')[0],
                           longest: Math.max(...pre.innerText.split('\\n').map(l => l.length))}))
        .filter(b => b.over > 1)""")
    assert not clipped, f"{page}: code inputs wider than their box at 1366 px: " + "; ".join(
        f"block {b['i']} (longest line {b['longest']} characters) starting {b['line'][:60]!r}" for b in clipped)
    diagrams = visit.page.evaluate("""() => ({
        drawn: document.querySelectorAll('pre.mermaid svg').length,
        blocks: document.querySelectorAll('pre.mermaid').length,
        undrawn: Array.from(document.querySelectorAll('div.highlight-mermaid, pre.mermaid'))
                      .filter(e => !e.querySelector('svg')).map(e => e.innerText.split('\\n')[0])})""")
    assert not diagrams["undrawn"], f"{page}: diagrams left as text, not drawn: {diagrams['undrawn']}"
    assert diagrams["drawn"] == diagrams["blocks"]
    broken = [i["src"] for i in visit.images() if not i["complete"] or i["w"] == 0]
    assert not broken, f"{page}: images that do not decode: {broken}"
    headings = visit.page.evaluate(
        "() => Array.from(document.querySelectorAll('article h2')).map(h => h.innerText.trim())")
    numbers = [h.split(".")[0] for h in headings if h.split(".")[0].isdigit()]
    twice = sorted({n for n in numbers if numbers.count(n) > 1})
    assert not twice, f"{page}: section numbers used twice: {[h for h in headings if h.split('.')[0] in twice]}"
    assert not visit.problems, f"{page}: " + "\n".join(visit.problems)


def check_next_link(browser, site: Site) -> None:
    """The theme's "next" link goes from each written chapter to the one after it."""
    written = site.book.written()
    for here, there in zip(written, written[1:]):
        visit = Visit(browser, site.page_url(here.notebook))
        visit.page.locator("a.right-next").first.click()
        visit.page.wait_for_url(site.page_url(there.notebook))
        visit.settle()
        h1 = visit.page.locator("article h1, main h1").first.inner_text()
        assert there.title.lower() in h1.lower(), f"'next' from {here.id} led to {visit.page.url} ({h1!r})"
        assert not visit.problems, "\n".join(visit.problems)
        visit.close()


def check_drill_bank(browser, site: Site) -> None:
    """Every drill of a written chapter is on the page, its answer inside a reveal that starts closed."""
    drills = written_drills(site.book)
    visit = Visit(browser, site.url + "drills.html")
    opened = visit.page.evaluate("() => Array.from(document.querySelectorAll('details')).filter(d => d.open).length")
    assert opened == 0, f"{opened} drill reveal(s) are open by default"
    details = visit.page.locator("article details")
    if drills:
        assert details.count() == len(drills), f"{len(drills)} drills but {details.count()} <details> reveals"
        text = visit.page.locator("article").inner_text()
        missing = [d.id for d in drills if d.id not in text]
        assert not missing, f"drills missing from the drill bank page: {missing}"
        answer = details.first.locator(":scope > :not(summary)").first
        assert not answer.is_visible(), "a drill answer is visible before its reveal is opened"
        screenshot(visit, f"{site.shot_prefix}drills.png")
        details.first.locator("summary").click()
        assert answer.is_visible(), "opening a drill's reveal does not show its answer"
    assert not visit.problems, "\n".join(visit.problems)
    visit.close()


def check_intro(browser, site: Site) -> None:
    visit = Visit(browser, site.url + "index.html")
    text = visit.page.locator("article").inner_text().replace("\u2019", "'")  # Sphinx's smart quotes
    assert site.book.title in text
    for ch in site.book.chapters:
        assert ch.title in text, f"the intro page does not list chapter {ch.id}"
        for goal in ch.goals:
            assert goal in text, f"the intro page lacks chapter {ch.id}'s goal {goal!r}"
        if not ch.written:
            assert f"{ch.title} (coming)" in text, f"the intro page does not mark chapter {ch.id} as coming"
    screenshot(visit, f"{site.shot_prefix}index.png")
    assert not visit.problems, "\n".join(visit.problems)
    visit.close()


# ---------------------------------------------------------------------------------------------------
# The tests


def test_written_chapter_with_missing_file_is_a_clear_error(tmp_path):
    book = {"title": "t", "author": "a", "chapters": [{
        "id": "00", "title": "Ghost", "status": "written", "notebook": "chapters/00_ghost.ipynb",
        "solution": "solutions/00_ghost.ipynb", "exercise": "exercises/00_ghost.ipynb"}]}
    (tmp_path / "book.yml").write_text(yaml.safe_dump(book), encoding="utf-8")
    with pytest.raises(SiteError, match=r"chapter 00 \(Ghost\): chapters/00_ghost.ipynb") as err:
        build_site(tmp_path / "book.yml", out_dir=tmp_path / "_build")
    assert "status: planned" in str(err.value)


def test_build_error_fails_loudly(tmp_path, build_tools):
    """A chapter Sphinx cannot render stops the build, naming the file and the error."""
    import nbformat

    book = {"title": "t", "author": "a", "chapters": [{
        "id": "00", "title": "Broken", "status": "written", "notebook": "chapters/00_broken.ipynb",
        "solution": "solutions/00_broken.ipynb", "exercise": "exercises/00_broken.ipynb"}]}
    for folder in ("chapters", "solutions", "exercises"):
        (tmp_path / folder).mkdir()
        cells = [("md", "# Broken\n\n```{eval-rst}\n.. no-such-directive::\n```")] if folder == "chapters" else []
        nbformat.write(_notebook(cells or [("md", "# Fine")]), tmp_path / folder / "00_broken.ipynb")
    (tmp_path / "book.yml").write_text(yaml.safe_dump(book), encoding="utf-8")
    with pytest.raises(SiteError, match=r"chapters/00_broken.ipynb:\d+: ERROR: Unknown directive type"):
        build_site(tmp_path / "book.yml", out_dir=tmp_path / "_build", cache_dir=CACHE)


def test_fixture_book_chapters(browser, fixture_site):
    for ch in fixture_site.book.written():
        visit = check_chapter(browser, fixture_site, ch)
        if ch.id == "00":  # the fixture's plot and its math, and the executed output
            assert len(visit.images()) >= 1, "the matplotlib figure is missing from the page"
            assert visit.page.locator("mjx-container[display='true']").count() >= 1, "display math not typeset"
            assert "energy 30.0" in visit.page.locator("article").inner_text(), "the executed output is missing"
        visit.close()


def test_fixture_book_navigation_intro_and_drills(browser, fixture_site):
    check_next_link(browser, fixture_site)
    check_intro(browser, fixture_site)
    check_drill_bank(browser, fixture_site)


def test_fixture_book_exercises_and_solutions(browser, fixture_site):
    for ch in fixture_site.book.written():
        for path, word in ((ch.exercise, "Exercises"), (ch.solution, "")):
            visit = Visit(browser, fixture_site.page_url(path))
            text = visit.page.locator("article").inner_text()
            assert word in text
            if path == ch.solution:
                assert "42" in text, f"{path}: the build did not execute the solution"
            assert not visit.problems, "\n".join(visit.problems)
            visit.close()


def test_real_book(browser, real_site):
    written = real_site.book.written()
    for ch in written:
        check_chapter(browser, real_site, ch).close()
        for path in (ch.notebook, ch.exercise, ch.solution):
            visit = Visit(browser, real_site.page_url(path))
            check_layout(visit, path)
            visit.close()
    check_next_link(browser, real_site)
    check_intro(browser, real_site)
    check_drill_bank(browser, real_site)
    if not written:
        pytest.skip("book.yml has no written chapter yet: only the intro and drill-bank pages were checked")


def test_real_book_on_a_phone(browser, real_site):
    """The theme's narrow layout: the page never scrolls sideways as a whole (wide code scrolls in its own box),
    and a diagram is drawn there too."""
    written = real_site.book.written()
    if not written:
        pytest.skip("book.yml has no written chapter yet")
    for ch in written:
        visit = Visit(browser, real_site.page_url(ch.notebook), viewport={"width": 390, "height": 844})
        wide = visit.page.evaluate("() => document.scrollingElement.scrollWidth - window.innerWidth")
        assert wide <= 1, f"{ch.notebook}: at 390 px the page is {wide} px wider than the screen"
        undrawn = visit.page.locator("pre.mermaid:not(:has(svg)), div.highlight-mermaid").count()
        assert not undrawn, f"{ch.notebook}: {undrawn} diagram(s) not drawn on a narrow screen"
        assert not visit.problems, "\n".join(visit.problems)
        visit.close()


def test_site_names_no_outside_script(fixture_site):
    """No page of the built site refers to a script or stylesheet outside it (CDN, fonts, thebe)."""
    import re

    outside = re.compile(r"""<(?:script|link)[^>]+(?:src|href)=["'](?:https?:)?//""")
    offenders = [p.name for p in fixture_site.html.rglob("*.html") if outside.search(p.read_text(encoding="utf-8"))]
    assert not offenders, f"pages that load from outside the site: {offenders}"


def test_pages_show_no_test_markers(real_site):
    """nbval's `# NBVAL_CHECK_OUTPUT` markers are for the test suite; the site leaves them out."""
    shown = [p.name for p in real_site.html.rglob("*.html") if "NBVAL_" in p.read_text(encoding="utf-8")]
    assert not shown, f"pages showing nbval markers: {shown}"


def test_build_executes_copies_and_leaves_the_book_untouched(fixture_site):
    """The build showed fresh outputs, made in the build folder: not a byte or mtime of the book changed."""
    import nbformat

    root = fixture_site.book.root
    assert book_files(root) == fixture_site.files_before, "the build wrote into the book's folder"
    source = nbformat.read(root / "chapters" / "00_squares.ipynb", as_version=4)
    assert not any(cell.get("outputs") for cell in source.cells), "the fixture's source notebook has outputs"
    page = (fixture_site.html / "chapters" / "00_squares.html").read_text(encoding="utf-8")
    assert "energy 30.0" in page, "the chapter's page lacks the executed output"
    assert "42" in (fixture_site.html / "solutions" / "00_squares.html").read_text(encoding="utf-8")
    runs = sorted(p.parent.relative_to(root / "_build" / ".cache" / "executed").as_posix()
                  for p in (root / "_build" / ".cache" / "executed").rglob("*.ipynb"))
    assert runs == ["chapters/00_squares", "chapters/01_cubes", "solutions/00_squares", "solutions/01_cubes"]


def write_counting_book(root: Path, counter: Path, prose: str = "First words.", solution_code: str = "") -> Path:
    """A one-chapter book whose chapter and solution append a line to `counter` each time they run."""
    import nbformat

    def count(who: str) -> str:
        return f"with open({str(counter)!r}, 'a') as f:\n    f.write({who!r} + '\\n')\nprint('ran the {who}')"

    for folder, cells in (("chapters", [("md", f"# Counting\n\n{prose}"), ("code", count("chapter"))]),
                          ("solutions", [("md", "# Counting: solutions"), ("code", count("solution") + solution_code)]),
                          ("exercises", [("md", "# Counting: exercises"), ("code", "answer = None")])):
        (root / folder).mkdir(parents=True, exist_ok=True)
        nbformat.write(_notebook(cells), root / folder / "00_counting.ipynb")
    book = {"title": "Counting", "author": "The test suite", "chapters": [{
        "id": "00", "title": "Counting", "status": "written", "notebook": "chapters/00_counting.ipynb",
        "solution": "solutions/00_counting.ipynb", "exercise": "exercises/00_counting.ipynb"}]}
    (root / "book.yml").write_text(yaml.safe_dump(book), encoding="utf-8")
    return root / "book.yml"


def runs_of(counter: Path) -> list[str]:
    return counter.read_text().split() if counter.exists() else []


@pytest.fixture
def engine(tmp_path, monkeypatch) -> Path:
    """A stand-in for the engine's files (`minillm.book.site.ENGINE`), which only the test changes."""
    from minillm.book import site

    folder = tmp_path / "engine"
    (folder / "__pycache__").mkdir(parents=True)
    (folder / "model.py").write_text("WIDTH = 1\n")
    monkeypatch.setattr(site, "ENGINE", [folder])
    return folder


def test_second_build_reruns_only_what_changed(tmp_path, build_tools, engine):
    """Between two builds the chapter's prose changes (its run is reused) and the solution's code
    changes (it runs again); the pages show the new prose and the new output."""
    counter = tmp_path / "runs.txt"  # outside the book: the cache never sees it
    book = write_counting_book(tmp_path / "book", counter)
    html = tmp_path / "book" / "_build" / "html"

    build_site(book, execute=True, cache_dir=CACHE)
    assert runs_of(counter) == ["chapter", "solution"]
    assert "ran the chapter" in (html / "chapters" / "00_counting.html").read_text(encoding="utf-8")

    write_counting_book(tmp_path / "book", counter, prose="Second edition.", solution_code="\nprint('a new line')")
    build_site(book, execute=True, cache_dir=CACHE)
    assert runs_of(counter) == ["chapter", "solution", "solution"], "only the solution's code changed"
    chapter = (html / "chapters" / "00_counting.html").read_text(encoding="utf-8")
    assert "Second edition." in chapter, "the cached chapter does not show its new prose"
    assert "ran the chapter" in chapter, "the cached chapter lost its outputs"
    assert "a new line" in (html / "solutions" / "00_counting.html").read_text(encoding="utf-8")


def test_engine_change_reruns(tmp_path, engine):
    """A notebook re-runs when a file of the engine changes, not when Python writes bytecode beside it."""
    from minillm.book import site

    counter = tmp_path / "runs.txt"
    write_counting_book(tmp_path / "book", counter)
    cache = tmp_path / "cache"

    site.executed_copy(tmp_path / "book", "chapters/00_counting.ipynb", cache)
    (engine / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"bytecode")
    site.executed_copy(tmp_path / "book", "chapters/00_counting.ipynb", cache)
    assert runs_of(counter) == ["chapter"]
    (engine / "model.py").write_text("WIDTH = 2\n")
    nb = site.executed_copy(tmp_path / "book", "chapters/00_counting.ipynb", cache)
    assert runs_of(counter) == ["chapter", "chapter"]
    assert "ran the chapter" in nb.cells[1].outputs[0]["text"]
    assert len(list(cache.rglob("*.ipynb"))) == 1, "the cache keeps only the latest run of a notebook"


def test_failing_notebook_fails_the_build_by_name_and_caches_nothing(tmp_path, capsys):
    """A reader sees a few lines, not a traceback: the notebook, the cell and its first line, the error's last
    line, where the whole traceback is, and the command that runs that notebook alone, which works."""
    import nbformat

    from minillm.book.site import main

    book = write_counting_book(tmp_path, tmp_path / "runs.txt")
    chapter = tmp_path / "chapters" / "00_counting.ipynb"
    nbformat.write(_notebook([("md", "# Counting"), ("code", "x = 1"), ("code", "# divide\nx / 0"),
                              ("code", "print('never')")]), chapter)
    before = book_files(tmp_path)
    with pytest.raises(SiteError) as err:
        build_site(book, out_dir=tmp_path / "_build", execute=True, cache_dir=CACHE)
    message = str(err.value)
    assert message.startswith("chapters/00_counting.ipynb failed to run at cell 3 of 4"), message
    assert "which begins\n    # divide\n" in message and "  ZeroDivisionError: division by zero\n" in message
    assert "Traceback" not in message and "x / 0" not in message, "the message is a summary, not the traceback"
    assert "\x1b[" not in message, "the message keeps the traceback's terminal colour codes"
    log = tmp_path / "_build" / "logs" / "chapters" / "00_counting.log"
    assert str(log.name) in message and "x / 0" in log.read_text() and "ZeroDivisionError" in log.read_text()
    assert "-m minillm.book.site --run chapters/00_counting.ipynb" in message
    cached = [p for p in (tmp_path / "_build" / ".cache").rglob("*") if p.is_file()]
    assert not cached, f"a failed run left files in the cache: {cached}"
    assert book_files(tmp_path) == before

    # the command it names: fails the same way (exit status 1, the same lines on stderr) ...
    run = ["--book", str(book), "--out", str(tmp_path / "_build"), "--run", "chapters/00_counting.ipynb"]
    assert main(run) == 1
    assert "ZeroDivisionError: division by zero" in capsys.readouterr().err
    # ... then, mended, runs the notebook alone and keeps its run for the next build; the log is gone
    nbformat.write(_notebook([("md", "# Counting"), ("code", "x = 1"), ("code", "print(x / 2)")]), chapter)
    assert main(run) == 0
    assert "Ran 1 notebook(s)" in capsys.readouterr().out
    assert len(list((tmp_path / "_build" / ".cache" / "executed").rglob("*.ipynb"))) == 1 and not log.exists()
    assert main([*run[:-1], "chapters/nothing.ipynb"]) == 1
    assert "is not a chapter or solution notebook of the book" in capsys.readouterr().err


def test_execute_sources_saves_outputs_in_place(tmp_path, capsys):
    """The authors' command: `python -m minillm.book.site --execute-sources` runs the chapters and solutions
    in place and saves their outputs; exercises are left alone, and no site is built."""
    import nbformat

    from minillm.book.site import main

    counter = tmp_path / "runs.txt"
    book = write_counting_book(tmp_path, counter)
    exercise = (tmp_path / "exercises" / "00_counting.ipynb").read_bytes()
    assert main(["--book", str(book), "--execute-sources"]) == 0
    assert runs_of(counter) == ["chapter", "solution"]
    for folder, who in (("chapters", "chapter"), ("solutions", "solution")):
        nb = nbformat.read(tmp_path / folder / "00_counting.ipynb", as_version=4)
        assert nb.cells[1].outputs[0]["text"] == f"ran the {who}\n", f"{folder}: the outputs were not saved"
    assert (tmp_path / "exercises" / "00_counting.ipynb").read_bytes() == exercise
    assert not (tmp_path / "_build").exists()
    assert "Saved the outputs of 2 notebook(s)" in capsys.readouterr().out


def test_mathjax_is_cached(tmp_path, fixture_site, monkeypatch):
    """A second fetch finds MathJax in the cache and does not call npm."""
    from minillm.book import site

    monkeypatch.setattr(site.shutil, "which", lambda *a, **k: pytest.fail("npm was called with MathJax cached"))
    assert (site.fetch_mathjax(CACHE) / "tex-chtml.js").is_file()
    assert (fixture_site.html / "_static" / site.MATHJAX_ENTRY).is_file()

