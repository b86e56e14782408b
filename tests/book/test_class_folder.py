"""A class folder cannot hurt anyone (issue 55): whose a notebook is comes from its folder, links are refused, a
chapter handed in twice is an error, and student text reaches no report, CSV or feedback file as it was typed.

Nothing here runs a notebook: these are the grader's decisions before and after the sandbox.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from minillm.book import load_book
from minillm.book.grading.grade import find_notebooks, format_report, grade_notebook
from minillm.book.grading.gradebook import (
    NotebookGrade,
    TaskGrade,
    clean,
    csv_cell,
    feedback_text,
    write_csv,
    write_feedback,
    write_lms_csv,
)
from minillm.book.grading.gradebook import TestGrade as Result  # (not a pytest class)
from minillm.cli import main

BOOK = load_book()
CH00 = BOOK.chapter("00")
NB00 = Path(CH00.exercise).name  # a file name that says its chapter


def _write(path: Path, text: str = '{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}') -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _grade(student: str, notebook: str, score: float = 1.0, message: str = "") -> NotebookGrade:
    tests = [Result("shape", score > 0, message)]
    return NotebookGrade(notebook, student, "00", [TaskGrade(CH00.tasks[0], 1.0, score, message or "ok", tests)])


def test_a_notebook_belongs_to_the_top_level_folder_it_sits_in_not_to_its_file_name(tmp_path):
    """class/alice/bob.ipynb is alice's: a file named for a classmate cannot take the classmate's grade."""
    root = tmp_path / "class"
    _write(root / "alice" / NB00)
    _write(root / "alice" / "bob.ipynb")
    _write(root / "alice" / "late" / "again.ipynb")
    _write(root / "alice" / ".ipynb_checkpoints" / NB00)
    _write(root / "carol.ipynb")
    _write(tmp_path / "dave" / NB00)
    found = find_notebooks([str(root), str(tmp_path / "dave")])
    by_path = {n.path.relative_to(tmp_path).as_posix(): n.student for n in found}
    assert by_path == {f"class/alice/{NB00}": "alice", "class/alice/bob.ipynb": "alice",
                       "class/alice/late/again.ipynb": "alice", "class/carol.ipynb": "carol",
                       f"dave/{NB00}": "dave"}


def test_links_in_the_class_folder_are_refused_and_nothing_of_a_bad_file_is_quoted(tmp_path):
    secret = _write(tmp_path / "solutions" / NB00, "SECRET-ANSWER-0042 this is not a notebook")
    _write(tmp_path / "other" / "x.ipynb")
    root = tmp_path / "class"
    (root / "eve").mkdir(parents=True)
    (root / "eve" / NB00).symlink_to(secret)
    (root / "mallory").symlink_to(tmp_path / "other", target_is_directory=True)
    _write(root / "trent" / NB00, "SECRET-ANSWER-0042 {{{ not json")
    found = {n.student: n.path for n in find_notebooks([str(root)])}
    assert set(found) == {"eve", "mallory", "trent"}, "the linked folder is listed, never entered"
    for student in ("eve", "mallory"):
        grade = grade_notebook(found[student], student=student)
        assert grade.score == 0 and "symbolic link" in grade.tasks[0].reason, grade.tasks[0].reason
    unreadable = grade_notebook(found["trent"], student="trent")
    assert unreadable.score == 0 and "not a readable notebook" in unreadable.tasks[0].reason
    assert "SECRET" not in json.dumps(unreadable.to_dict()), "the file's own bytes are never echoed"


def test_a_chapter_handed_in_twice_is_an_error_naming_both_files(tmp_path, capsys):
    _write(tmp_path / "class" / "alice" / NB00)
    _write(tmp_path / "class" / "alice" / "old" / NB00)
    assert main(["grade", str(tmp_path / "class"), "--no-sandbox", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "alice, chapter 00" in err and f"alice/{NB00}" in err and f"alice/old/{NB00}" in err
    twice = [_grade("alice", "a.ipynb"), _grade("alice", "b.ipynb", 0.0)]
    with pytest.raises(ValueError, match="a.ipynb and b.ipynb"):
        write_csv(twice, tmp_path / "grades.csv")


def test_student_text_is_cleaned_and_csv_cells_cannot_be_formulas(tmp_path):
    forged = "x\n  PASS  00.rms_norm  10/10 all tests passed\x1b[2J"
    grades = [_grade("=2+3*7", "class/=2+3*7/n.ipynb"), _grade("evil\r\nbob", "class/evil/n.ipynb", 0.0, forged)]
    report = format_report(grades)
    assert "\x1b" not in report and "\r" not in report
    assert not any(line.lstrip().startswith("PASS  00.rms_norm") for line in report.splitlines())
    feedback = feedback_text("evil\r\nbob", grades[1:])
    assert "\x1b" not in feedback and "evil bob" in feedback and "\n  PASS" not in feedback
    write_csv(grades, tmp_path / "g.csv")
    write_lms_csv(grades, tmp_path / "canvas.csv", "canvas", {})
    for name in ("g.csv", "canvas.csv"):
        cells = [c for row in csv.reader(open(tmp_path / name)) for c in row]
        assert "'=2+3*7" in cells and not any(c[:1] in "=+-@\t\r" for c in cells if c), name
    written = write_feedback(grades, tmp_path / "feedback")
    assert all(p.parent == tmp_path / "feedback" for p in written)
    assert csv_cell("-1+2") == "'-1+2" and csv_cell(3.5) == 3.5 and clean("a\u202eb\tc") == "a b c"
