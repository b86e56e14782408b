"""`minillm grade NOTEBOOK...`: run readers' exercise notebooks and report which tasks pass.

Each notebook runs in its own process (a Jupyter kernel driven by `nbclient`) under a time limit.
Every `check(task_id, answer)` in it appends its verdict to a file named by `MINILLM_GRADE_OUT`;
the grader reads that file back. A task is failed, with the reason, when its check failed, when
it never ran (missing cell, or the notebook crashed or timed out before reaching it), or when the
notebook could not be run at all. The grader itself never crashes on a bad notebook.

    minillm grade exercises/00_the_model.ipynb students/*/00_the_model.ipynb --csv grades.csv

Result per notebook (what `--json` writes, one object per notebook in a list):
    {"notebook": path, "tasks": [{"id", "passed", "reason"}], "passed": int, "total": int}
`total` counts every task the notebook's chapter defines in book.yml.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minillm.grading.check import GRADE_OUT_ENV

DEFAULT_TIMEOUT_S = 600.0
STOP_PREFIX = "minillm-grade-stop: "  # how the worker process tells the grader why a notebook stopped


@dataclass
class TaskGrade:
    id: str
    passed: bool
    reason: str


@dataclass
class NotebookGrade:
    notebook: str
    tasks: list[TaskGrade] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return sum(t.passed for t in self.tasks)

    @property
    def total(self) -> int:
        return len(self.tasks)

    def to_dict(self) -> dict:
        return {"notebook": self.notebook, "tasks": [asdict(t) for t in self.tasks], "passed": self.passed,
                "total": self.total}


def _run_notebook(path: Path, out_file: Path, timeout_s: float) -> str | None:
    """Execute `path` in a fresh process; returns why it stopped early (None if it ran to the end)."""
    env = dict(os.environ, **{GRADE_OUT_ENV: str(out_file)})
    cmd = [sys.executable, "-m", "minillm.grading.grade", "--worker", str(path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and its kernel
        proc.communicate()
        return f"the notebook did not finish within {timeout_s:g} s (time limit)"
    if proc.returncode != 0:
        reasons = [ln[len(STOP_PREFIX):] for ln in stdout.splitlines() if ln.startswith(STOP_PREFIX)]
        if reasons:
            return reasons[-1]
        last = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:]
        return f"the notebook's process exited with status {proc.returncode}" + (f": {last[0]}" if last else "")
    return None


def _worker(path: str) -> int:
    """Run one notebook top to bottom in a kernel (the child process of `_run_notebook`)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb_path = Path(path)
    try:
        nb = nbformat.read(nb_path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        print(f"{STOP_PREFIX}not a readable notebook: {type(exc).__name__}: {exc}")
        return 1
    client = NotebookClient(nb, timeout=None, kernel_name="python3",
                            resources={"metadata": {"path": str(nb_path.parent.resolve())}})
    try:
        client.execute()
    except CellExecutionError as exc:
        code_cells = [c for c in nb.cells if c.cell_type == "code"]
        failed = [i for i, c in enumerate(code_cells, 1) if any(o.get("output_type") == "error" for o in c.outputs)]
        where = f"code cell {failed[0]}" if failed else "a cell"
        print(f"{STOP_PREFIX}the notebook crashed in {where}: {exc.ename}: {exc.evalue}")
        return 1
    except Exception as exc:  # noqa: BLE001 - a kernel that will not start, etc.
        print(f"{STOP_PREFIX}the notebook could not be run: {type(exc).__name__}: {exc}")
        return 1
    return 0


def _read_checks(out_file: Path) -> dict[str, TaskGrade]:
    seen: dict[str, TaskGrade] = {}
    for line in out_file.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            seen[record["id"]] = TaskGrade(record["id"], bool(record["passed"]), str(record["reason"]))
        except (ValueError, KeyError, TypeError):
            continue
    return seen  # a task checked twice keeps its last verdict


def grade_notebook(path: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S, chapter_id: str | None = None,
                   book_path: str | Path | None = None) -> NotebookGrade:
    """Run one notebook and grade every task of its chapter. Never raises for a bad notebook.

    The chapter is `chapter_id` if given, else the book.yml chapter whose notebook has this file
    name, else the chapter of the task ids the notebook checked.
    """
    from minillm.book import load_book

    path = Path(path)
    grade = NotebookGrade(notebook=str(path))
    book = load_book(book_path)
    chapter = book.chapter(chapter_id) if chapter_id else book.chapter_of_notebook(path)
    if not path.is_file():
        tasks = chapter.tasks if chapter else ["?"]
        grade.tasks = [TaskGrade(t, False, f"notebook {path} not found") for t in tasks]
        return grade
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "checks.jsonl"
        out_file.touch()
        stopped = _run_notebook(path, out_file, timeout_s)
        seen = _read_checks(out_file)
    if chapter is None:
        prefixes = {task_id.split(".")[0] for task_id in seen}
        if len(prefixes) == 1:
            chapter = book.chapter(prefixes.pop())
        else:
            why = f"; it stopped early: {stopped}" if stopped else ""
            grade.tasks.append(TaskGrade("?", False, f"cannot tell which chapter {path.name} belongs to (its name is "
                                         f"not in book.yml and it checked tasks {sorted(seen)}{why}); "
                                         "pass --chapter NN."))
            return grade
    for task_id in chapter.tasks:
        if task_id in seen:
            grade.tasks.append(seen[task_id])
        elif stopped:
            grade.tasks.append(TaskGrade(task_id, False, f"not reached: {stopped}"))
        else:
            grade.tasks.append(TaskGrade(task_id, False, f"no check({task_id!r}, ...) cell ran in this notebook"))
    return grade


def write_csv(grades: list[NotebookGrade], path: str) -> None:
    """One row per notebook: notebook, passed, total, then 1/0 per task id."""
    task_ids = sorted({t.id for g in grades for t in g.tasks})
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", "passed", "total", *task_ids])
        for g in grades:
            marks = {t.id: int(t.passed) for t in g.tasks}
            writer.writerow([g.notebook, g.passed, g.total, *(marks.get(t, "") for t in task_ids)])


def format_report(grades: list[NotebookGrade]) -> str:
    lines = []
    for g in grades:
        lines.append(f"{g.notebook}: {g.passed}/{g.total} tasks passed")
        for t in g.tasks:
            lines.append(f"  {'PASS' if t.passed else 'FAIL'}  {t.id:<18} {t.reason}")
    if len(grades) > 1:
        lines.append(f"total: {sum(g.passed for g in grades)}/{sum(g.total for g in grades)} tasks passed "
                     f"in {len(grades)} notebooks")
    return "\n".join(lines)


def cmd_grade(args: argparse.Namespace) -> int:
    from minillm.book import load_book

    if args.chapter:
        load_book().chapter(args.chapter)  # an unknown chapter is a usage error, before any work
    grades = [grade_notebook(nb, timeout_s=args.timeout, chapter_id=args.chapter) for nb in args.notebooks]
    print(format_report(grades))
    if args.csv:
        write_csv(grades, args.csv)
        print(f"wrote {args.csv}")
    if args.json:
        Path(args.json).write_text(json.dumps([g.to_dict() for g in grades], indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def add_grade_command(sub: argparse._SubParsersAction) -> None:
    """Register `minillm grade` on the CLI's subparsers."""
    p = sub.add_parser("grade", help="run exercise notebooks and report which tasks pass",
                       description="Run each notebook in its own process and report per-task pass/fail.")
    p.add_argument("notebooks", nargs="+", metavar="NOTEBOOK", help="exercise notebooks to grade")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds each notebook may run (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--chapter", metavar="NN", help="the chapter the notebooks belong to (default: from file names)")
    p.add_argument("--csv", metavar="FILE", help="also write a gradebook as CSV")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.set_defaults(func=cmd_grade)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2]))
    sys.exit("usage: python -m minillm.grading.grade --worker NOTEBOOK (used by `minillm grade`)")
