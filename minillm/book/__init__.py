"""The book's machinery, apart from the engine, and `book.yml` read into Python (every chapter's tooling).

`minillm.book` holds what teaches rather than serves, and nothing in the engine imports it:
`minillm.book.notebook` (the helpers every chapter calls), `minillm.book.site` (the HTML book) and
`minillm.book.grading` (the exercises' `check`, `minillm grade` and the drill bank). This module reads
`book.yml`: the chapters, their notebooks, tasks and drills, and the appendices (a chapter's record kept
beside it, in a notebook of its own that the chapter links to).

    from minillm.book import load_book
    book = load_book()                 # finds book.yml at the repository root
    for ch in book.written():          # chapters with status: written
        print(ch.id, ch.title, ch.notebook)

Everything that walks the book (tests, `make book`, `minillm book`, `minillm grade`, the README's
table of contents) goes through this module, so `book.yml` stays the single source of truth. From a
shell, `python -m minillm.book notebooks` lists the written chapters' notebooks and
`python -m minillm.book contents` prints the README's table of contents.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

STATUSES = ("written", "planned")
REPO_ROOT = Path(__file__).resolve().parents[2]  # minillm/book/__init__.py -> the repository


class BookError(ValueError):
    """`book.yml` is missing or malformed; the message names the chapter and the field to fix."""


@dataclass(frozen=True)
class Chapter:
    """One entry of `book.yml`. Paths are relative to the repository root."""

    id: str
    title: str
    status: str
    notebook: str
    solution: str
    exercise: str
    goals: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    drills: list[str] = field(default_factory=list)
    points: dict[str, float] = field(default_factory=dict)  # task id -> points (every task listed)

    @property
    def written(self) -> bool:
        return self.status == "written"

    @property
    def slug(self) -> str:
        """The notebook's file stem, e.g. `00_the_model`."""
        return Path(self.notebook).stem


@dataclass(frozen=True)
class Appendix:
    """One entry of `book.yml`'s `appendices`: a notebook that extends one chapter (its record, round by round).

    It has no exercises, tasks or drills of its own; the site lists it after the chapters, and its chapter links
    to it. Its id is the chapter's id and a letter ("05b")."""

    id: str
    chapter: str
    title: str
    notebook: str

    @property
    def slug(self) -> str:
        return Path(self.notebook).stem


@dataclass(frozen=True)
class Book:
    title: str
    author: str
    chapters: list[Chapter]
    root: Path
    appendices: list[Appendix] = field(default_factory=list)

    def written(self) -> list[Chapter]:
        """The chapters with `status: written`, in book order."""
        return [c for c in self.chapters if c.written]

    def chapter(self, chapter_id: str) -> Chapter:
        for c in self.chapters:
            if c.id == chapter_id:
                return c
        raise BookError(f"no chapter {chapter_id!r} in book.yml; the ids are {[c.id for c in self.chapters]}.")

    def appendices_of(self, chapter_id: str) -> list[Appendix]:
        """The appendices that extend this chapter, in book order."""
        return [a for a in self.appendices if a.chapter == chapter_id]

    def written_appendices(self) -> list[Appendix]:
        """The appendices of the written chapters, in book order."""
        written = {c.id for c in self.written()}
        return [a for a in self.appendices if a.chapter in written]

    def chapter_of_notebook(self, path: str | Path) -> Chapter | None:
        """The chapter whose chapter, solution or exercise notebook has this file name (None if none)."""
        name = Path(path).name
        for c in self.chapters:
            if name in (Path(c.notebook).name, Path(c.solution).name, Path(c.exercise).name):
                return c
        return None


def _chapter(entry: Any, index: int) -> Chapter:
    if not isinstance(entry, dict):
        raise BookError(f"book.yml: chapter #{index} must be a mapping of fields, got {entry!r}.")
    where = f"book.yml: chapter {entry.get('id', f'#{index}')!r}"
    for key in ("id", "title", "status", "notebook", "solution", "exercise"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise BookError(f"{where} needs a non-empty string field {key!r} (quote ids: id: \"00\").")
    if entry["status"] not in STATUSES:
        raise BookError(f"{where}: status must be one of {STATUSES}, got {entry['status']!r}.")
    lists = {}
    for key in ("goals", "modules", "tasks", "drills"):
        value = entry.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise BookError(f"{where}: {key} must be a list of strings, got {value!r}.")
        lists[key] = value
    unknown = set(entry) - {"id", "title", "status", "notebook", "solution", "exercise", "points", *lists}
    if unknown:
        raise BookError(f"{where}: unknown field(s) {sorted(unknown)}; see the comment at the top of book.yml.")
    points = _points(entry.get("points"), lists["tasks"], where)
    return Chapter(**{k: entry[k] for k in ("id", "title", "status", "notebook", "solution", "exercise")}, **lists,
                   points=points)


def _appendix(entry: Any, index: int, chapter_ids: list[str]) -> Appendix:
    if not isinstance(entry, dict):
        raise BookError(f"book.yml: appendix #{index} must be a mapping of fields, got {entry!r}.")
    where = f"book.yml: appendix {entry.get('id', f'#{index}')!r}"
    keys = ("id", "chapter", "title", "notebook")
    for key in keys:
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise BookError(f"{where} needs a non-empty string field {key!r} (quote ids: id: \"05b\").")
    unknown = set(entry) - set(keys)
    if unknown:
        raise BookError(f"{where}: unknown field(s) {sorted(unknown)}; see the comment at the top of book.yml.")
    if entry["chapter"] not in chapter_ids:
        raise BookError(f"{where}: chapter {entry['chapter']!r} is not a chapter of book.yml ({chapter_ids}).")
    if not re.fullmatch(rf"{re.escape(entry['chapter'])}[a-z]", entry["id"]):
        raise BookError(f"{where}: an appendix's id is its chapter's id and a letter, e.g. \"05b\".")
    return Appendix(**{k: entry[k] for k in keys})


def _points(value: Any, tasks: list[str], where: str) -> dict[str, float]:
    """`points: {task id: number}` checked against `tasks`; a chapter without it gives every task 1 point."""
    if value is None:
        return {t: 1.0 for t in tasks}
    if not isinstance(value, dict):
        raise BookError(f"{where}: points must map each task id to its points, e.g. {{\"00.rms_norm\": 2}}.")
    missing, extra = [t for t in tasks if t not in value], [t for t in value if t not in tasks]
    if missing or extra:
        raise BookError(f"{where}: points must list exactly the chapter's tasks; missing {missing}, not tasks "
                        f"{extra}.")
    bad = {t: v for t, v in value.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0}
    if bad:
        raise BookError(f"{where}: points must be positive numbers, got {bad}.")
    return {t: float(value[t]) for t in tasks}


def load_book(path: str | Path | None = None) -> Book:
    """Read and validate `book.yml` (default: the one at the repository root)."""
    path = Path(path) if path is not None else REPO_ROOT / "book.yml"
    if not path.is_file():
        raise BookError(
            f"{path} not found: book.yml lives at the root of a minillm-book checkout; "
            "run this from a clone of the repository (pip-installed minillm has no book)."
        )
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("chapters"), list):
        raise BookError(f"{path}: expected a mapping with title, author and a list `chapters`.")
    chapters = [_chapter(e, i) for i, e in enumerate(data["chapters"])]
    ids = [c.id for c in chapters]
    if len(set(ids)) != len(ids):
        raise BookError(f"{path}: chapter ids repeat: {ids}.")
    raw = data.get("appendices") or []
    if not isinstance(raw, list):
        raise BookError(f"{path}: `appendices` must be a list of entries (id, chapter, title, notebook).")
    appendices = [_appendix(e, i, ids) for i, e in enumerate(raw)]
    every = ids + [a.id for a in appendices]
    if len(set(every)) != len(every):
        raise BookError(f"{path}: chapter and appendix ids repeat: {every}.")
    return Book(title=str(data.get("title", "")), author=str(data.get("author", "")), chapters=chapters,
                root=path.resolve().parent, appendices=appendices)


def notebooks(book: Book) -> list[str]:
    """Every notebook of the written chapters (chapter, solution, exercise) and their appendices, relative to the
    book's root."""
    return [p for c in book.written() for p in (c.notebook, c.solution, c.exercise)] + [
        a.notebook for a in book.written_appendices()]


def readme_contents(book: Book) -> str:
    """The README's table of contents, generated from book.yml (written chapters link to their notebook)."""
    rows = ["| # | chapter | exercises |", "|---|---|---|"]
    for c in book.chapters:
        if c.written:
            rows.append(f"| {c.id} | [{c.title}]({c.notebook}) | [exercises]({c.exercise}) · "
                        f"[solutions]({c.solution}) |")
        else:
            rows.append(f"| {c.id} | {c.title} *(coming)* | |")
        if c.written:
            rows += [f"| {a.id} | appendix: [{a.title}]({a.notebook}) | |" for a in book.appendices_of(c.id)]
    return "\n".join(rows)

