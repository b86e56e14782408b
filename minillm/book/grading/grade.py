"""`minillm grade`: grade readers' exercise notebooks without believing anything they say (all chapters).

For each notebook:

1. its text is read here (`minillm.book.grading.forgery`): which function each `check("NN.task", f)`
   hands in, and whether that function is, or uses, something that already does the task (the
   engine's own function, the grader's reference) — such an answer gets no credit, with the reason;
2. it runs top to bottom in a sandbox process, under time and memory limits, with no network and
   no way to start processes or write outside its own folder (`minillm.book.grading.sandbox`);
3. the grader runs every test of every task of the notebook's chapter itself, in this process,
   calling the reader's functions in the sandbox and comparing what comes back, as plain data, with
   its own reference. `check` cells, verdict files and the task registry inside the notebook's
   process are never consulted.

Points per task come from `book.yml` (`points:`); a task scores its points × the share of its tests
that pass. An instructor's hidden tests (`--extra-tests DIR`: Python files that add tests to tasks
with `get_task(id).test(name)`) count like the others and are marked hidden in the report.

    minillm grade submissions/ -j 4 --csv grades.csv --json grades.json
    minillm grade alice/00_the_model.ipynb bob/00_the_model.ipynb --extra-tests hidden_tests/

The student's name is the notebook's folder when the file has its chapter's name
(`alice/00_the_model.ipynb` -> alice), else the file's stem (`alice.ipynb` -> alice).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minillm.book import Book, Chapter, load_book
from minillm.book.grading.check import get_task, run_task
from minillm.book.grading.forgery import NotebookSource, defines, forbidden_use, read_source
from minillm.book.grading.sandbox import DEFAULT_MEMORY_BYTES, RemoteAnswer, Sandbox, SandboxError

DEFAULT_TIMEOUT_S = 600.0


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

    @property
    def passed(self) -> bool:
        return self.score == self.points


@dataclass
class NotebookGrade:
    notebook: str
    student: str
    chapter: str | None = None
    tasks: list[TaskGrade] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # about the notebook as a whole: errors in its cells

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


def student_name(path: Path, book: Book) -> str:
    """alice/00_the_model.ipynb -> "alice"; alice.ipynb -> "alice"."""
    return path.parent.name if book.chapter_of_notebook(path) is not None else path.stem


def grade_notebook(path: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S, chapter_id: str | None = None,
                   memory_bytes: int = DEFAULT_MEMORY_BYTES, book_path: str | Path | None = None) -> NotebookGrade:
    """Run one notebook in a sandbox and grade every task of its chapter. Never raises for a bad notebook.

    The chapter is `chapter_id` if given, else the book.yml chapter whose notebook has this file
    name, else the chapter of the task ids the notebook's `check` calls name.
    """
    import nbformat

    book = load_book(book_path)
    path = Path(path)
    grade = NotebookGrade(notebook=str(path), student=student_name(path, book))
    chapter = book.chapter(chapter_id) if chapter_id else book.chapter_of_notebook(path)
    try:
        nb = nbformat.read(path, as_version=4)
    except FileNotFoundError:
        return _all_failed(grade, chapter, f"notebook {path} not found")
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        return _all_failed(grade, chapter, f"not a readable notebook: {type(exc).__name__}: {exc}")
    src = read_source([c.source for c in nb.cells if c.cell_type == "code"])
    if chapter is None:
        prefixes = {task_id.split(".")[0] for task_id in src.checked}
        if len(prefixes) != 1:
            return _all_failed(grade, None, f"cannot tell which chapter {path.name} belongs to (its name is not in "
                                            f"book.yml and it checks tasks {sorted(src.checked)}); pass --chapter NN.")
        chapter = book.chapter(prefixes.pop())
    grade.chapter = chapter.id
    grade.notes += [f"code cell {n} is not valid Python" for n in src.unparsed]
    with Sandbox(path, timeout_s=timeout_s, memory_bytes=memory_bytes) as sandbox:
        try:
            sandbox.start()
        except SandboxError as exc:
            return _all_failed(grade, chapter, f"the notebook could not be run: {exc}")
        grade.notes += sandbox.cell_errors
        for task_id in chapter.tasks:
            grade.tasks.append(grade_task(task_id, chapter.points[task_id], src, sandbox, sandbox.cell_errors))
    return grade


def _all_failed(grade: NotebookGrade, chapter: Chapter | None, reason: str) -> NotebookGrade:
    grade.chapter = chapter.id if chapter else None
    grade.notes.append(reason)
    tasks = chapter.tasks if chapter else ["?"]
    points = chapter.points if chapter else {"?": 0.0}
    grade.tasks = [TaskGrade(t, points[t], 0.0, reason) for t in tasks]
    return grade


def grade_task(task_id: str, points: float, src: NotebookSource, sandbox: Sandbox,
               cell_errors: list[str]) -> TaskGrade:
    """One task: the source check, then every test run here on the answer that lives in the sandbox."""
    task = get_task(task_id)
    expression = src.checked.get(task_id, task.answer_name)
    if not defines(src, expression):
        why = f"the notebook defines no `{expression}` (the task's function; hand it in with check({task_id!r}, ...))"
        return TaskGrade(task_id, points, 0.0, why)
    misuse = forbidden_use(src, expression, task.forbidden)
    if misuse:
        return TaskGrade(task_id, points, 0.0, f"no credit: `{expression}` is not your own code: {misuse}. "
                                               "Write it yourself.")
    answer = RemoteAnswer(sandbox, expression, task.forbidden)
    result = run_task(task_id, answer)
    hidden = {t.name for t in task.tests if t.hidden}
    tests = [TestGrade(r.name, r.passed, r.message, r.hint, r.name in hidden) for r in result.results]
    if answer.forbidden_calls:
        called = ", ".join(sorted(answer.forbidden_calls))
        return TaskGrade(task_id, points, 0.0, f"no credit: while it was tested, `{expression}` called {called}, "
                                               "which already does the task. Write it yourself.", tests)
    score = points * result.n_passed / len(result.results) if result.results else 0.0
    if result.passed:
        reason = f"all {len(tests)} tests passed"
    else:
        first = next(t for t in tests if not t.passed)
        reason = (f"{len(tests) - result.n_passed} of {len(tests)} tests failed; first: "
                  f"{'(hidden) ' if first.hidden else ''}{first.name}: {first.message}")
        if "NameError" in first.message and cell_errors:
            reason += f" (the notebook had errors: {cell_errors[0]})"
    return TaskGrade(task_id, points, score, reason, tests)


# ---- many notebooks -----------------------------------------------------------------------------


def find_notebooks(paths: list[str]) -> list[Path]:
    """Files as given; folders searched for .ipynb files (checkpoints skipped), sorted."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(f for f in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in f.parts)
        else:
            found.append(p)
    return found


def load_extra_tests(folder: str | Path) -> int:
    """Import every .py file of `folder` (sorted); the tests they add are marked hidden. Returns how many."""
    from minillm.book.grading.registry import TASKS

    folder = Path(folder)
    files = sorted(folder.glob("*.py"))
    if not files:
        raise ValueError(f"--extra-tests {folder}: no .py files there; each file adds tests with "
                         "get_task('NN.task').test('name')(fn).")
    get_task(next(iter(TASKS), "00.param_count"))  # load every chapter's tasks first
    before = {task_id: len(task.tests) for task_id, task in TASKS.items()}
    for file in files:
        spec = importlib.util.spec_from_file_location(f"minillm_extra_tests.{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise ValueError(f"--extra-tests: {file} failed to load: {type(exc).__name__}: {exc}") from None
    added = 0
    for task_id, task in TASKS.items():
        for test in task.tests[before.get(task_id, 0):]:
            test.hidden = True
            added += 1
    return added


def grade_all(notebooks: list[Path], jobs: int = 1, progress: bool = True, **kwargs: object) -> list[NotebookGrade]:
    """Grade many notebooks, `jobs` at a time (each in its own sandbox), in the order given."""
    from tqdm.auto import tqdm

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool, \
            tqdm(total=len(notebooks), desc="grading", unit="notebook", disable=not progress,
                 file=sys.stderr) as bar:
        futures = [pool.submit(grade_notebook, nb, **kwargs) for nb in notebooks]
        for future in futures:
            future.add_done_callback(lambda _: bar.update(1))
        return [f.result() for f in futures]


def write_csv(grades: list[NotebookGrade], path: str | Path) -> None:
    """The gradebook: one row per student, a column of points per task, then total and maximum."""
    task_ids = sorted({t.id for g in grades for t in g.tasks if t.id != "?"})
    rows: dict[str, dict[str, float]] = {}
    maxima: dict[str, float] = {}
    for g in grades:
        row = rows.setdefault(g.student, {})
        for t in g.tasks:
            row[t.id] = t.score
            maxima[t.id] = t.points
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["student", *task_ids, "total", "max"])
        for student, row in sorted(rows.items()):
            scores = [round(row[t], 4) if t in row else "" for t in task_ids]
            total = sum(row.get(t, 0.0) for t in task_ids)
            writer.writerow([student, *scores, round(total, 4), sum(maxima[t] for t in task_ids)])


def format_report(grades: list[NotebookGrade]) -> str:
    lines = []
    for g in grades:
        lines.append(f"{g.student} ({g.notebook}): {g.score:g}/{g.max_score:g} points")
        for t in g.tasks:
            mark = "PASS" if t.passed else ("PART" if t.score > 0 else "FAIL")
            lines.append(f"  {mark}  {t.id:<22} {t.score:>5.3g}/{t.points:<4g} {t.reason}")
    if len(grades) > 1:
        lines.append(f"total: {sum(g.score for g in grades):g}/{sum(g.max_score for g in grades):g} points "
                     f"in {len(grades)} notebooks")
    return "\n".join(lines)


def cmd_grade(args: argparse.Namespace) -> int:
    if args.chapter:
        load_book().chapter(args.chapter)  # an unknown chapter is a usage error, before any work
    if args.extra_tests:
        added = load_extra_tests(args.extra_tests)
        print(f"loaded {added} hidden tests from {args.extra_tests}", file=sys.stderr)
    notebooks = find_notebooks(args.notebooks)
    if not notebooks:
        raise ValueError(f"no notebooks found in {' '.join(args.notebooks)}")
    grades = grade_all(notebooks, jobs=args.jobs, progress=not args.no_progress, timeout_s=args.timeout,
                       chapter_id=args.chapter, memory_bytes=int(args.memory_gb * 2**30))
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
    p = sub.add_parser("grade", help="grade exercise notebooks (each run in a sandbox; tests run by the grader)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="+", metavar="PATH", help="exercise notebooks, or folders of them")
    p.add_argument("-j", "--jobs", type=int, default=1, help="notebooks graded at once (default 1)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds each notebook may run (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--memory-gb", type=float, default=DEFAULT_MEMORY_BYTES / 2**30,
                   help="memory each notebook may use, GiB (default %(default)g)")
    p.add_argument("--chapter", metavar="NN", help="the chapter the notebooks belong to (default: from file names)")
    p.add_argument("--extra-tests", metavar="DIR", help="a folder of .py files adding hidden tests to tasks")
    p.add_argument("--csv", metavar="FILE", help="also write the gradebook as CSV (a row per student)")
    p.add_argument("--json", metavar="FILE", help="also write every result, with reasons, as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_grade)
