"""The gradebook: what `minillm grade` records of each notebook, and the files a teacher gets from it.

`NotebookGrade` / `TaskGrade` / `TestGrade` are the records (`grades.json` holds them, `from_dict` reads them
back for `--update`); the writers turn a list of them into the CSV gradebook (book order, chapter subtotals),
a Canvas or Gradescope import, and one Markdown feedback file per student. Nothing here runs a notebook:
`minillm.book.grading.grade` does, and hands its records here.
"""

from __future__ import annotations

import csv
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minillm.book import Book, Chapter, load_book

# C0 and C1 control characters (newlines, tabs and the terminal's escape codes among them), DEL, and the Unicode
# marks that reorder or hide text (bidirectional overrides and isolates, zero-width characters).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]+")


def clean(text: object) -> str:
    """Student-controlled text (a folder name, an exception's message) made safe for a report line: every run of
    control characters becomes one space, so that no newline forges a line and no escape code reaches a terminal."""
    return _CONTROL.sub(" ", str(text)).strip()


def csv_cell(value: object) -> object:
    """A CSV cell that a spreadsheet shows as text: a string that starts like a formula (= + - @, or a tab or a
    carriage return first) gets a leading apostrophe, as OWASP's advice on CSV injection says; numbers pass."""
    if not isinstance(value, str):
        return value
    value = clean(value)
    return "'" + value if value[:1] in ("=", "+", "-", "@") else value


def file_name(student: str) -> str:
    """A student's name as a file name of its own: path separators and anything unusual become `_`."""
    name = re.sub(r"[^\w.-]", "_", clean(student)).lstrip(".")
    return name or "_"


@dataclass
class TestGrade:
    name: str
    passed: bool
    message: str = ""
    hint: str = ""
    hidden: bool = False


@dataclass
class TaskGrade:
    id: str
    points: float  # what the task is worth
    score: float  # what this notebook earned
    reason: str
    tests: list[TestGrade] = field(default_factory=list)
    review: list[str] = field(default_factory=list)  # why the teacher should look at this answer (never scored)

    @property
    def passed(self) -> bool:
        return self.score == self.points


@dataclass
class NotebookGrade:
    notebook: str
    student: str
    chapter: str | None = None
    tasks: list[TaskGrade] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # about the notebook as a whole: errors in its cells, warnings

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tasks)

    @property
    def max_score(self) -> float:
        return sum(t.points for t in self.tasks)

    def to_dict(self) -> dict:
        return {"notebook": self.notebook, "student": self.student, "chapter": self.chapter,
                "score": round(self.score, 4), "max_score": self.max_score, "notes": self.notes,
                "tasks": [asdict(t) | {"score": round(t.score, 4)} for t in self.tasks]}

    @classmethod
    def from_dict(cls, d: dict) -> NotebookGrade:
        """Read back one record of `grades.json` (for `--update`)."""
        tasks = [TaskGrade(t["id"], float(t["points"]), float(t["score"]), t["reason"],
                           [TestGrade(**test) for test in t.get("tests", [])], list(t.get("review", [])))
                 for t in d["tasks"]]
        return cls(d["notebook"], d["student"], d.get("chapter"), tasks, list(d.get("notes", [])))


def _chapters_in_book_order(grades: list[NotebookGrade], book: Book) -> list[Chapter]:
    ids = {g.chapter for g in grades if g.chapter}
    return [c for c in book.chapters if c.id in ids]


def duplicates(grades: list[NotebookGrade]) -> list[str]:
    """One line per (student, chapter) graded more than once, naming the notebooks; [] when there is none."""
    seen: dict[tuple[str, str], list[str]] = {}
    for g in grades:
        seen.setdefault((g.student, g.chapter or "?"), []).append(g.notebook)
    return [f"{clean(student)}, chapter {chapter}: {' and '.join(map(clean, books))}"
            for (student, chapter), books in seen.items() if len(books) > 1]


def _by_student(grades: list[NotebookGrade]) -> dict[str, dict[str, NotebookGrade]]:
    """student -> chapter -> that student's grade. Two grades of one (student, chapter) are an error: which one
    counts is the teacher's decision, never the order the files were found in."""
    twice = duplicates(grades)
    if twice:
        raise ValueError("a student handed in one chapter twice, so the grade would depend on which file came last: "
                         + "; ".join(twice) + ". Keep one notebook per student and chapter, then grade again.")
    table: dict[str, dict[str, NotebookGrade]] = {}
    for g in grades:
        table.setdefault(g.student, {})[g.chapter or "?"] = g
    return dict(sorted(table.items()))


def write_csv(grades: list[NotebookGrade], path: str | Path, book: Book | None = None) -> None:
    """The gradebook: a row per student; per chapter, in book order, a column per task and the chapter's
    subtotal; then the total and maximum over the chapters graded, and the number of answers to review."""
    book = book or load_book()
    chapters = _chapters_in_book_order(grades, book)
    points = {t.id: t.points for g in grades for t in g.tasks}
    header = ["student"]
    for c in chapters:
        header += [*c.tasks, f"{c.id} total"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([*header, "total", "max", "to review"])
        for student, by_chapter in _by_student(grades).items():
            row, total, maximum, review = [csv_cell(student)], 0.0, 0.0, 0
            for c in chapters:
                g = by_chapter.get(c.id)
                scores = {t.id: t.score for t in g.tasks} if g else {}
                row += [round(scores[t], 4) if t in scores else "" for t in c.tasks]
                row.append(round(sum(scores.values()), 4) if g else "")
                total += sum(scores.values())
                maximum += sum(points.get(t, c.points[t]) for t in c.tasks)
                review += sum(bool(t.review) for t in g.tasks) if g else 0
            writer.writerow([*row, round(total, 4), maximum, review])


def load_roster(path: str | Path) -> dict[str, dict[str, str]]:
    """A class roster CSV: a `student` column (the folder or file name) and any of name, email, sid,
    canvas_id, sis_user_id, section. Returns student -> that row."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows or "student" not in rows[0]:
        raise ValueError(f"--roster {path}: expected a CSV with a header row naming a `student` column (the "
                         "submission's folder or file name), plus any of name, email, sid, canvas_id, "
                         "sis_user_id, section")
    return {r["student"]: r for r in rows}


def write_lms_csv(grades: list[NotebookGrade], path: str | Path, lms: str, roster: dict[str, dict[str, str]],
                  book: Book | None = None) -> None:
    """The gradebook in the shape an LMS imports, a score column per chapter ("minillm NN: title").

    canvas:     Canvas's gradebook import: Student, ID, SIS User ID, SIS Login ID, Section, then the
                assignments, with a "Points Possible" row first. Students are matched on SIS Login ID
                (the roster's sis_user_id / canvas_id fill the other columns when given).
    gradescope: Name, SID, Email, then the assignments: Gradescope matches students by email or SID.
    """
    book = book or load_book()
    chapters = _chapters_in_book_order(grades, book)
    titles = [f"minillm {c.id}: {c.title}" for c in chapters]
    table = _by_student(grades)
    maxima = []
    for c in chapters:
        g = next(g for g in grades if g.chapter == c.id)
        maxima.append(g.max_score)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if lms == "canvas":
            writer.writerow(["Student", "ID", "SIS User ID", "SIS Login ID", "Section", *titles])
            writer.writerow(["Points Possible", "", "", "", "", *maxima])
        else:
            writer.writerow(["Name", "SID", "Email", *titles])
        for student, by_chapter in table.items():
            who = roster.get(student, {})
            scores = [round(by_chapter[c.id].score, 4) if c.id in by_chapter else "" for c in chapters]
            if lms == "canvas":
                cells = [who.get("name") or student, who.get("canvas_id", ""), who.get("sis_user_id", ""),
                         who.get("sis_login_id") or student, who.get("section", "")]
            else:
                cells = [who.get("name") or student, who.get("sid") or student, who.get("email", "")]
            writer.writerow([*map(csv_cell, cells), *scores])


def feedback_text(student: str, grades: list[NotebookGrade], show_hidden: bool = False) -> str:
    """A student's feedback, in Markdown: per chapter and task, the score, each test's name and result,
    what went wrong and the hint. Hidden tests are named with pass or fail only (unless `show_hidden`)."""
    lines = [f"# Feedback for {clean(student)}", ""]
    for g in grades:
        lines += [f"## Chapter {g.chapter}: {g.score:g} / {g.max_score:g} points", "",
                  f"Notebook: `{clean(Path(g.notebook).name)}`", ""]
        lines += [f"- {clean(note)}" for note in g.notes if not note.startswith("warning:")] + ([""] if g.notes else [])
        for t in g.tasks:
            lines += [f"### {t.id}: {t.score:.3g} / {t.points:g}", ""]
            if not t.tests:
                lines += [clean(t.reason), ""]
                continue
            if t.reason.startswith("no credit"):
                lines += [clean(t.reason), ""]
            for test in t.tests:
                mark = "pass" if test.passed else "FAIL"
                if test.hidden and not show_hidden:
                    lines.append(f"- {mark}: {test.name} (a hidden test)")
                    continue
                lines.append(f"- {mark}: {test.name}" + (" (a hidden test)" if test.hidden else ""))
                if not test.passed:
                    lines.append(f"  - {clean(test.message)}")
                    if test.hint:
                        lines.append(f"  - hint: {clean(test.hint)}")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_feedback(grades: list[NotebookGrade], folder: str | Path, show_hidden: bool = False) -> list[Path]:
    """One Markdown file per student, `folder/<student>.md` (the name made safe as a file name: `file_name`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    table = _by_student(grades)
    names = [file_name(student) for student in table]
    if len(set(names)) < len(names):
        raise ValueError(f"two students' names give one feedback file name among {sorted(table)}: rename one folder")
    for (student, by_chapter), name in zip(table.items(), names):
        path = folder / f"{name}.md"
        path.write_text(feedback_text(student, list(by_chapter.values()), show_hidden), encoding="utf-8")
        written.append(path)
    return written


def merge_into(previous: list[NotebookGrade], new: list[NotebookGrade]) -> list[NotebookGrade]:
    """The gradebook `previous` with each (student, chapter) graded again replaced by its new grade."""
    fresh = {(g.student, g.chapter) for g in new}
    return [g for g in previous if (g.student, g.chapter) not in fresh] + new
