"""book.yml is the single source of truth: the files it names exist, chapters import their modules,
committed notebooks are executed in order, and the README's contents table is generated from it."""

from __future__ import annotations

import ast
import re

import nbformat
import pytest

from minillm.book import BookError, load_book, readme_contents
from minillm.book.grading import get_task

BOOK = load_book()
WRITTEN = BOOK.written()


def test_book_lists_the_ten_chapters_in_order():
    assert [c.id for c in BOOK.chapters] == [f"{i:02d}" for i in range(10)]
    for c in BOOK.chapters:
        assert c.notebook == f"chapters/{c.slug}.ipynb"
        assert c.solution == f"solutions/{c.slug}.ipynb" and c.exercise == f"exercises/{c.slug}.ipynb"
        assert c.goals, f"chapter {c.id} has no learning goals"


@pytest.mark.parametrize("chapter", WRITTEN, ids=lambda c: c.id)
def test_every_file_a_written_chapter_names_exists(chapter):
    for path in (chapter.notebook, chapter.solution, chapter.exercise):
        assert (BOOK.root / path).is_file(), f"book.yml names {path} for chapter {chapter.id}, but it does not exist"
    for task_id in chapter.tasks:
        get_task(task_id)
    assert chapter.tasks, f"chapter {chapter.id} is written but lists no exercise tasks"


def test_every_drill_id_exists():
    from minillm.book.grading import load_drills

    ids = {d.id for d in load_drills()}
    for chapter in BOOK.chapters:
        missing = [d for d in chapter.drills if d not in ids]
        assert not missing, f"chapter {chapter.id} lists drills that the bank does not have: {missing}"


def _imported_modules(nb: nbformat.NotebookNode) -> set[str]:
    found = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        source = "\n".join(ln for ln in cell.source.splitlines() if not ln.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("chapter", WRITTEN, ids=lambda c: c.id)
def test_chapter_imports_the_modules_it_introduces(chapter):
    nb = nbformat.read(BOOK.root / chapter.notebook, as_version=4)
    imported = _imported_modules(nb)
    missing = [m for m in chapter.modules if m not in imported]
    assert not missing, f"{chapter.notebook} introduces {missing} (book.yml) but never imports them"


@pytest.mark.parametrize("path", [p for c in WRITTEN for p in (c.notebook, c.solution)]
                         + [a.notebook for a in BOOK.written_appendices()])
def test_committed_notebook_is_executed_in_order_with_outputs(path):
    nb = nbformat.read(BOOK.root / path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    counts = [c.execution_count for c in code]
    assert None not in counts, f"{path}: some cells were never run; Restart & Run All, then commit"
    assert counts == list(range(1, len(code) + 1)), f"{path}: cells ran out of order {counts}; Restart & Run All"
    assert any(c.outputs for c in code), f"{path} has no outputs committed"
    for cell in code:
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert not errors, f"{path}: a committed cell shows an error: {errors[0].ename}"


def test_readme_contents_table_is_generated_from_book_yml():
    readme = (BOOK.root / "README.md").read_text(encoding="utf-8")
    assert readme_contents(BOOK) in readme, "README's contents table is stale: paste `python -m minillm.book contents`"


def test_book_yml_errors_name_the_field(tmp_path):
    bad = tmp_path / "book.yml"
    bad.write_text("title: t\nchapters:\n  - id: '00'\n    title: x\n    status: done\n    notebook: a\n"
                   "    solution: b\n    exercise: c\n")
    with pytest.raises(BookError, match=re.escape("status must be one of")):
        load_book(bad)
    with pytest.raises(BookError, match="not found"):
        load_book(tmp_path / "missing.yml")


def test_appendix_05b_is_in_the_book_and_linked_both_ways():
    """Chapter 05 tells the GPU fast path as a story; its round-by-round record is appendix 05b (issue 56)."""
    from minillm.book.site import notebook_parts, site_toc

    (appendix,) = BOOK.appendices_of("05")
    assert appendix.id == "05b" and appendix.notebook == f"chapters/{appendix.slug}.ipynb"
    assert (BOOK.root / appendix.notebook).is_file()
    parts = notebook_parts(BOOK)
    assert parts["Appendices"] == [appendix.notebook]
    toc = {e["file"]: e["title"] for part in site_toc(BOOK, parts)["parts"] for e in part["chapters"]}
    assert toc[appendix.notebook.removesuffix(".ipynb")].startswith("05b")
    assert f"| 05b | appendix: [{appendix.title}]({appendix.notebook}) | |" in readme_contents(BOOK)

    def links(path: str) -> set[str]:
        nb = nbformat.read(BOOK.root / path, as_version=4)
        return {m for c in nb.cells if c.cell_type == "markdown" for m in re.findall(r"\]\(([^)#]+\.ipynb)", c.source)}

    assert f"{appendix.slug}.ipynb" in links(BOOK.chapter("05").notebook), "chapter 05 must link to its appendix"
    assert "05_batching.ipynb" in links(appendix.notebook), "the appendix must link back to chapter 05"


def test_an_appendix_needs_its_chapter_and_an_id_made_from_it(tmp_path):
    head = ("title: t\nchapters:\n  - id: '05'\n    title: x\n    status: planned\n    notebook: a\n"
            "    solution: b\n    exercise: c\n")
    bad = tmp_path / "book.yml"
    bad.write_text(head + "appendices:\n  - {id: '06b', chapter: '05', title: r, notebook: n}\n")
    with pytest.raises(BookError, match="chapter's id and a letter"):
        load_book(bad)
    bad.write_text(head + "appendices:\n  - {id: '07b', chapter: '07', title: r, notebook: n}\n")
    with pytest.raises(BookError, match="is not a chapter"):
        load_book(bad)
    bad.write_text(head + "appendices:\n  - {id: '05b', chapter: '05', title: r, notebook: n}\n")
    assert [a.id for a in load_book(bad).appendices] == ["05b"]

