"""`minillm grade`: grade readers' exercise notebooks without believing anything they say (all chapters).

For each notebook:

1. its text is read here (`minillm.book.grading.forgery`): which function each `check("NN.task", f)`
   hands in, and whether that function is, or uses, something that already does the task (the
   engine's own function, the grader's reference) — such an answer gets no credit, with the reason;
   constructs an honest exercise never needs (`gc`, `ctypes`, `exec`, reading notebooks) are flagged
   for the teacher's review;
2. it runs top to bottom in a sandbox process inside bubblewrap, which sees neither the class folder
   nor the solutions nor the hidden tests, under time limits per cell and per notebook and a memory
   limit (`minillm.book.grading.sandbox`);
3. the grader runs every test of every task of the notebook's chapter itself, in this process,
   calling the reader's functions in the sandbox and comparing what comes back, as plain data, with
   its own reference. `check` cells, verdict files and the task registry inside the notebook's
   process are never consulted.

Points per task come from `book.yml` (`points:`), or `--points TASK=P` / `--points-file FILE`; a task
scores its points × the share of its tests that pass. An instructor's hidden tests (`--extra-tests
DIR`: Python files that add tests to tasks with `get_task(id).test(name)`) count like the others. They run
after every public test of the chapter, in a fresh sandbox process (the notebook run again), so that nothing
their inputs leave behind reaches a public test's message; a student's feedback names them and says pass or
fail, nothing more.

    minillm grade submissions/ -j 4 --csv grades.csv --json grades.json --feedback feedback/
    minillm grade submissions/dave/ --update grades.json --csv grades.csv   # re-grade one student

Whose a notebook is comes from where it sits, never from what it is called: in a class folder, the folder's
top-level entry (`class/alice/00_the_model.ipynb` and `class/alice/late/anything.ipynb` -> alice;
`class/alice.ipynb` -> alice). A notebook given on its own is its folder's when the file has its chapter's name
(`dave/00_the_model.ipynb` -> dave), else its stem's. Symbolic links are refused (a link could hand in a
classmate's file, or any file the teacher can read), one student's chapter handed in twice is an error naming both
files, and student text reaches the reports with its control characters removed (`gradebook.clean`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from minillm.book import Book, Chapter, load_book
from minillm.book.grading.check import TestResult, get_task, run_task
from minillm.book.grading.forgery import NotebookSource, copied_from, defines, forbidden_use, read_source
from minillm.book.grading.gradebook import (
    NotebookGrade,
    TaskGrade,
    TestGrade,
    clean,
    duplicates,
    load_roster,
    merge_into,
    write_csv,
    write_feedback,
    write_lms_csv,
)
from minillm.book.grading.sandbox import (
    DEFAULT_CELL_TIMEOUT_S,
    DEFAULT_MEMORY_BYTES,
    RemoteAnswer,
    Sandbox,
    SandboxError,
    isolation_problem,
    memory_cap,
)

DEFAULT_TIMEOUT_S = 600.0


class Submission(NamedTuple):
    """A notebook to grade, and the student it belongs to (`find_notebooks`)."""

    path: Path
    student: str


def student_name(path: Path, book: Book) -> str:
    """A notebook given on its own: dave/00_the_model.ipynb -> "dave" (its chapter's name); alice.ipynb -> "alice"."""
    return path.parent.name if book.chapter_of_notebook(path) is not None else path.stem


def grade_notebook(path: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S, chapter_id: str | None = None,
                   memory_bytes: int = DEFAULT_MEMORY_BYTES, book_path: str | Path | None = None,
                   cell_timeout_s: float = DEFAULT_CELL_TIMEOUT_S, isolate: bool = True,
                   points: dict[str, float] | None = None, student: str | None = None) -> NotebookGrade:
    """Run one notebook in a sandbox and grade every task of its chapter. Never raises for a bad notebook.

    The chapter is the book.yml chapter whose notebook has this file name (a different `chapter_id` is
    noted as a warning), else `chapter_id`, else the chapter of the task ids the notebook's `check`
    calls name. `points` overrides book.yml's points of some tasks. `student`: whose it is (`find_notebooks`
    says), else `student_name`. A symbolic link is refused, and nothing of an unreadable file is quoted.
    """
    import nbformat

    book = load_book(book_path)
    path = Path(path)
    grade = NotebookGrade(notebook=str(path), student=student or student_name(path, book))
    chapter = book.chapter_of_notebook(path)
    if chapter is not None and chapter_id and chapter.id != chapter_id:
        grade.notes.append(f"warning: {path.name} is chapter {chapter.id}'s notebook, but --chapter {chapter_id} "
                           f"was given; graded as chapter {chapter.id}")
    elif chapter is None and chapter_id:
        chapter = book.chapter(chapter_id)
    if path.is_symlink():
        return _all_failed(grade, chapter, f"refused: {path.name} is a symbolic link, not a notebook; hand in the "
                                           "notebook file itself", points)
    try:
        nb = nbformat.read(path, as_version=4)
    except FileNotFoundError:
        return _all_failed(grade, chapter, f"notebook {path} not found", points)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        # The exception's text can quote the file (a JSON error near its first bytes): only its kind is said.
        return _all_failed(grade, chapter, f"not a readable notebook ({type(exc).__name__}); open it in Jupyter, "
                                           "save it, and hand it in again", points)
    src = read_source([c.source for c in nb.cells if c.cell_type == "code"])
    if chapter is None:
        prefixes = {task_id.split(".")[0] for task_id in src.checked}
        if len(prefixes) != 1:
            return _all_failed(grade, None, f"cannot tell which chapter {path.name} belongs to (its name is not in "
                                            f"book.yml and it checks tasks {sorted(src.checked)}); pass --chapter NN.")
        chapter = book.chapter(prefixes.pop())
    grade.chapter = chapter.id
    grade.notes += [f"code cell {n} has a syntax error ({why}), so it did not run" for n, why in src.unparsed.items()]
    with Sandbox(path, timeout_s=timeout_s, memory_bytes=memory_bytes, cell_timeout_s=cell_timeout_s,
                 isolate=isolate) as sandbox:
        try:
            sandbox.start()
        except SandboxError as exc:
            sandbox.close()
            failed = _all_failed(grade, chapter, f"the notebook could not be run: {exc}", points)
            _add_review_flags(failed, src, sandbox.flags)
            return failed
        grade.notes += sandbox.cell_errors
        by_id = {}
        for task_id in chapter.tasks:  # every task's public tests first, then (below) the hidden ones
            task_points = (points or {}).get(task_id, chapter.points[task_id])
            by_id[task_id] = grade_task(task_id, task_points, src, sandbox, sandbox.cell_errors, hidden=False)
        with_hidden = [t for t in chapter.tasks if by_id[t].tests and any(x.hidden for x in get_task(t).tests)]
        if with_hidden:
            # In a fresh process (the notebook run again): nothing a hidden test's input leaves behind can reach
            # a public test's message, and so the student's feedback, nor the other way round.
            try:
                sandbox.start()
                started = None
            except SandboxError as exc:
                started = f"not run: the notebook could not be run again for them ({exc})"
            for task_id in with_hidden:
                by_id[task_id] = grade_task(task_id, by_id[task_id].points, src, sandbox, sandbox.cell_errors,
                                            hidden=True, before=by_id[task_id], failed=started)
        grade.tasks += by_id.values()
    _add_review_flags(grade, src, sandbox.flags)  # after close: every flag the sandbox wrote has been read
    return grade


def _add_review_flags(grade: NotebookGrade, src: NotebookSource, flags: list[dict]) -> None:
    """The notebook's review flags onto its tasks: one raised while a task was tested goes on that task; one
    from the notebook's text or from running its cells could affect any task, so it goes on each."""
    everywhere = list(src.suspicious) + [f"while its cells ran: {f['flag']}" for f in flags if not f["task"]]
    for task in grade.tasks:
        during = [f["flag"] for f in flags if f["task"] == task.id]
        task.review += everywhere + [f"while it was tested: {why}" for why in during]
        if any("profiler" in why for why in during) and task.score > 0:  # its calls went unwatched
            task.score = 0.0
            task.reason = ("no credit: while it was tested, the answer switched the profiler through which the "
                           "grader watches its calls, so they could not be checked. Remove that code.")


def _all_failed(grade: NotebookGrade, chapter: Chapter | None, reason: str,
                points: dict[str, float] | None = None) -> NotebookGrade:
    grade.chapter = chapter.id if chapter else None
    grade.notes.append(reason)
    tasks = chapter.tasks if chapter else ["?"]
    book_points = chapter.points if chapter else {"?": 0.0}
    grade.tasks = [TaskGrade(t, (points or {}).get(t, book_points[t]), 0.0, reason) for t in tasks]
    return grade


def grade_task(task_id: str, points: float, src: NotebookSource, sandbox: Sandbox, cell_errors: list[str],
               hidden: bool | None = None, before: TaskGrade | None = None, failed: str | None = None) -> TaskGrade:
    """One task: the source check, then its tests (`run_task`'s `hidden`: None all of them) run here on the answer
    that lives in the sandbox. `before`: this task's grade from its public tests, which the hidden tests' results
    join (scored together); `failed`: why the hidden tests could not run (each then fails with it)."""
    task = get_task(task_id)
    expression = src.checked.get(task_id, task.answer_name)
    review: list[str] = []
    if before is None:  # the source checks (with the hidden tests, `before` passed them already)
        if not defines(src, expression):
            why = (f"the notebook defines no `{expression}` (the task's function; hand it in with "
                   f"check({task_id!r}, ...))")
            if src.unparsed:
                cell, error = next(iter(src.unparsed.items()))
                why = f"code cell {cell} has a syntax error ({error}); fix it: until then {why}"
            return TaskGrade(task_id, points, 0.0, why)
        misuse = forbidden_use(src, expression, task.forbidden)
        if misuse:
            return TaskGrade(task_id, points, 0.0, f"no credit: `{expression}` is not your own code: {misuse}. "
                                                   "Write it yourself.")
        copy = copied_from(src, expression, task.forbidden)
        if copy:
            review.append(f"`{expression}` is {copy[1]:.0%} the same code as {copy[0]} once names and docstrings "
                          "are set aside: is it a copy?")
    answer = RemoteAnswer(sandbox, expression, task.forbidden, task=task_id)
    if failed is not None:
        results = [TestResult(t.name, False, failed) for t in task.tests if t.hidden == hidden]
    else:
        results = run_task(task_id, answer, hidden).results
    secret = {t.name for t in task.tests if t.hidden}
    tests = [TestGrade(r.name, r.passed, r.message, r.hint, r.name in secret) for r in results]
    if before is not None:
        tests, review = before.tests + tests, before.review
        if before.reason.startswith("no credit"):  # the public tests caught it: no credit stays
            return TaskGrade(task_id, points, 0.0, before.reason, tests, review)
    if answer.forbidden_calls:
        called = ", ".join(sorted(answer.forbidden_calls))
        return TaskGrade(task_id, points, 0.0, f"no credit: while it was tested, `{expression}` called {called}, "
                                               "which already does the task. Write it yourself.", tests, review)
    n_passed = sum(t.passed for t in tests)
    score = points * n_passed / len(tests) if tests else 0.0
    if n_passed == len(tests):
        reason = f"all {len(tests)} tests passed"
    else:
        first = next(t for t in tests if not t.passed)
        what = f"(hidden) {first.name}" if first.hidden else f"{first.name}: {first.message}"
        reason = f"{len(tests) - n_passed} of {len(tests)} tests failed; first: {what}"
        if "NameError" in first.message and cell_errors:
            reason += f" (the notebook had errors: {cell_errors[0]})"
    return TaskGrade(task_id, points, score, reason, tests, review)


# ---- many notebooks -----------------------------------------------------------------------------


def find_notebooks(paths: list[str], book: Book | None = None) -> list[Submission]:
    """The notebooks to grade and whose each is. A file is taken as given (`student_name`). A folder is searched
    for .ipynb files (checkpoints skipped, sorted) without following links: each belongs to the folder's
    top-level entry under which it sits (alice/..., or alice.ipynb directly there); one directly in the folder
    and named for its chapter is the folder's (a student's own folder, given to grade again). A symbolic link
    there, to a notebook or to a folder, is handed on as it is, so that its student's grade says it was refused."""
    book = book or load_book()
    found: list[Submission] = []
    for root in map(Path, paths):
        if not root.is_dir() or root.is_symlink():
            found.append(Submission(root, student_name(root, book)))
            continue
        here: list[Path] = []
        for folder, dirs, files in os.walk(root):  # does not follow links to folders: they are listed, below
            dirs[:] = sorted(d for d in dirs if d != ".ipynb_checkpoints")
            links = [d for d in dirs if (Path(folder) / d).is_symlink()]
            here += [Path(folder) / name for name in files if name.endswith(".ipynb")]
            here += [Path(folder) / d for d in links]
        for path in sorted(here):
            parts = path.relative_to(root).parts
            if len(parts) > 1:
                student = parts[0]
            elif book.chapter_of_notebook(path) is not None:
                student = root.resolve().name
            else:
                student = path.stem
            found.append(Submission(path, student))
    return found


def probe_defined_in(file: Path) -> str | None:
    """The name of a function defined in `file` that the file passes to `call_probed` as its probe, if any."""
    import ast

    try:
        tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
    except (OSError, SyntaxError, ValueError):
        return None  # loading the file reports it
    defined = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            probe = node.args[1]
            if name == "call_probed" and (isinstance(probe, ast.Lambda) or
                                          isinstance(probe, ast.Name) and probe.id in defined):
                return "lambda" if isinstance(probe, ast.Lambda) else probe.id
    return None


def load_extra_tests(folder: str | Path) -> int:
    """Import every .py file of `folder` (sorted); the tests they add are marked hidden. Returns how many."""
    from minillm.book.grading import registry
    from minillm.book.grading.registry import TASKS

    folder = Path(folder)
    files = sorted(folder.glob("*.py"))
    registry.TRUSTED_SOURCE_DIRS.add(str(folder.resolve()))  # a failing hidden test never quotes its own lines
    if not files:
        raise ValueError(f"--extra-tests {folder}: no .py files there; each file adds tests with "
                         "get_task('NN.task').test('name')(fn).")
    get_task(next(iter(TASKS), "00.param_count"))  # load every chapter's tasks first
    before = {task_id: len(task.tests) for task_id, task in TASKS.items()}
    for file in files:
        own_probe = probe_defined_in(file)
        if own_probe:
            raise ValueError(f"--extra-tests: {file} passes its own function `{own_probe}` to call_probed, but the "
                             "sandbox imports probes by name and cannot see this folder, so every notebook's test "
                             "would fail. Call the answer directly in the test, or use a probe from "
                             "minillm.book.grading.probes.")
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


def grade_all(notebooks: list[Path | Submission], jobs: int = 1, progress: bool = True,
              **kwargs: object) -> list[NotebookGrade]:
    """Grade many notebooks (paths, or `Submission`s that say whose), `jobs` at a time (each in its own
    sandbox), in the order given."""
    from tqdm.auto import tqdm

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool, \
            tqdm(total=len(notebooks), desc="grading", unit="notebook", disable=not progress,
                 file=sys.stderr) as bar:
        futures = [pool.submit(_grade_or_report, *(nb if isinstance(nb, Submission) else (nb, None)), **kwargs)
                   for nb in notebooks]
        for future in futures:
            future.add_done_callback(lambda _: bar.update(1))
        return [f.result() for f in futures]


def _grade_or_report(path: Path, student: str | None = None, **kwargs: object) -> NotebookGrade:
    """grade_notebook; should the grader itself fail on one notebook, that notebook says so and the class goes on."""
    try:
        return grade_notebook(path, student=student, **kwargs)
    except Exception as exc:  # noqa: BLE001 - one notebook must never stop the gradebook
        book = load_book(kwargs.get("book_path"))  # type: ignore[arg-type]
        grade = NotebookGrade(notebook=str(path), student=student or student_name(path, book))
        chapter = book.chapter_of_notebook(path) or (book.chapter(str(kwargs["chapter_id"]))
                                                     if kwargs.get("chapter_id") else None)
        return _all_failed(grade, chapter, f"the grader failed on this notebook ({type(exc).__name__}: {exc}); "
                                           "grade it again, and report it if it fails again",
                           kwargs.get("points"))  # type: ignore[arg-type]


def parse_points(pairs: list[str], file: str | None) -> dict[str, float]:
    """Points per task from `--points-file` (JSON or YAML: {task id: points}) and `--points TASK=P` (which wins)."""
    points: dict[str, object] = {}
    if file:
        import yaml

        try:
            data = yaml.safe_load(Path(file).read_text(encoding="utf-8"))  # JSON is YAML too
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"--points-file {file}: cannot read it ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--points-file {file}: expected a mapping of task id to points, e.g. "
                             "{\"04.allocate\": 3}")
        points.update(data)
    for pair in pairs:
        task_id, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--points {pair}: expected TASK=POINTS, e.g. --points 04.allocate=3")
        points[task_id.strip()] = value.strip()
    out = {}
    for task_id, value in points.items():
        try:
            get_task(str(task_id))
        except KeyError as exc:  # an unknown task id: the message names the known ones
            raise ValueError(f"--points: {exc.args[0]}") from None
        try:
            out[str(task_id)] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"points for {task_id}: {value!r} is not a number") from None
        if not out[str(task_id)] >= 0:
            raise ValueError(f"points for {task_id} must be >= 0, got {value}")
    return out


def format_report(grades: list[NotebookGrade]) -> str:
    lines = []
    for g in grades:  # student text (names, paths, exception messages) cleaned of control characters
        lines.append(f"{clean(g.student)} ({clean(g.notebook)}): {g.score:g}/{g.max_score:g} points")
        lines += [f"  {clean(note)}" for note in g.notes if note.startswith("warning:")]
        for t in g.tasks:
            mark = "PASS" if t.passed else ("PART" if t.score > 0 else "FAIL")
            lines.append(f"  {mark}  {t.id:<22} {t.score:>5.3g}/{t.points:<4g} {clean(t.reason)}")
            lines += [f"        REVIEW: {clean(why)}" for why in t.review]
    if len(grades) > 1:
        lines.append(f"total: {sum(g.score for g in grades):g}/{sum(g.max_score for g in grades):g} points "
                     f"in {len(grades)} notebooks")
    return "\n".join(lines)


def _refuse_twice(grades: list[NotebookGrade], after: str) -> None:
    """A ValueError naming every student who hands in one chapter twice; `after` ends its message."""
    twice = duplicates(grades)
    if twice:
        raise ValueError("a student hands in one chapter twice: " + "; ".join(twice) + ". Keep one notebook per "
                         f"student and chapter (which one counts is yours to decide), then grade again{after}.")


def cmd_grade(args: argparse.Namespace) -> int:
    if args.chapter:
        load_book().chapter(args.chapter)  # an unknown chapter is a usage error, before any work
    if not args.no_sandbox and isolation_problem() is not None:
        raise ValueError(isolation_problem())
    if not args.no_sandbox:
        print(memory_cap(int(args.memory_gb * 2**30)), file=sys.stderr)
    points = parse_points(args.points or [], args.points_file)
    roster = load_roster(args.roster) if args.roster else {}
    previous: list[NotebookGrade] = []
    if args.update:
        try:
            previous = [NotebookGrade.from_dict(d) for d in json.loads(Path(args.update).read_text(encoding="utf-8"))]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--update {args.update}: not a grades.json written by `minillm grade` ({exc})") from None
    if args.extra_tests:
        added = load_extra_tests(args.extra_tests)
        print(f"loaded {added} hidden tests from {args.extra_tests}", file=sys.stderr)
    notebooks = find_notebooks(args.notebooks)
    if not notebooks:
        raise ValueError(f"no notebooks found in {' '.join(args.notebooks)}")
    book = load_book()
    by_name = [NotebookGrade(str(n.path), n.student, getattr(book.chapter_of_notebook(n.path), "id", None))
               for n in notebooks]
    _refuse_twice([g for g in by_name if g.chapter], "")  # by file name now; after grading, by their checks too
    grades = grade_all(notebooks, jobs=args.jobs, progress=not args.no_progress, timeout_s=args.timeout,
                       chapter_id=args.chapter, memory_bytes=int(args.memory_gb * 2**30),
                       cell_timeout_s=args.cell_timeout, isolate=not args.no_sandbox, points=points)
    print(format_report(grades))
    for g in grades:
        for note in g.notes:
            if note.startswith("warning:"):
                print(f"{clean(g.notebook)}: {clean(note)}", file=sys.stderr)
    _refuse_twice(grades, "; nothing was written")
    gradebook = merge_into(previous, grades)
    json_path = args.json or args.update
    if json_path:
        Path(json_path).write_text(json.dumps([g.to_dict() for g in gradebook], indent=2) + "\n", encoding="utf-8")
        print(f"wrote {json_path}" + (f" ({len(grades)} notebooks graded again)" if previous else ""))
    if args.csv:
        write_csv(gradebook, args.csv)
        print(f"wrote {args.csv}")
    for lms in ("canvas", "gradescope"):
        if getattr(args, lms):
            write_lms_csv(gradebook, getattr(args, lms), lms, roster)
            print(f"wrote {getattr(args, lms)} ({lms} import)")
    if args.feedback:
        written = write_feedback(gradebook, args.feedback, show_hidden=args.show_hidden)
        print(f"wrote {len(written)} feedback files to {args.feedback}")
    return 0


def add_grade_command(sub: argparse._SubParsersAction) -> None:
    """Register `minillm grade` on the CLI's subparsers."""
    p = sub.add_parser("grade", help="grade exercise notebooks (each run in a sandbox; tests run by the grader)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="+", metavar="PATH", help="exercise notebooks, or folders of them")
    p.add_argument("-j", "--jobs", type=int, default=1, help="notebooks graded at once (default 1)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds each notebook may run (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT_S,
                   help=f"seconds one code cell may run before it is interrupted and the next one runs "
                        f"(default {DEFAULT_CELL_TIMEOUT_S:g})")
    p.add_argument("--memory-gb", type=float, default=DEFAULT_MEMORY_BYTES / 2**30,
                   help="memory each notebook may use, GiB (default %(default)g)")
    p.add_argument("--chapter", metavar="NN", help="the chapter of notebooks whose file name does not say it")
    p.add_argument("--extra-tests", metavar="DIR", help="a folder of .py files adding hidden tests to tasks")
    p.add_argument("--points", action="append", metavar="TASK=P", help="a task's points (repeat; overrides book.yml)")
    p.add_argument("--points-file", metavar="FILE", help="points per task, a JSON or YAML mapping {task id: points}")
    p.add_argument("--csv", metavar="FILE", help="the gradebook as CSV: a row per student, columns in book order")
    p.add_argument("--json", metavar="FILE", help="every result, with reasons and review flags, as JSON (the "
                                                  "teacher's record: hidden tests' messages included)")
    p.add_argument("--update", metavar="FILE", help="an existing grades.json: the notebooks graded now replace "
                                                    "their student's earlier grade for that chapter, the rest stay")
    p.add_argument("--feedback", metavar="DIR", help="write a Markdown feedback file per student into DIR")
    p.add_argument("--show-hidden", action="store_true", help="feedback files show hidden tests' messages too")
    p.add_argument("--canvas", metavar="FILE", help="also write the scores as a Canvas gradebook import CSV")
    p.add_argument("--gradescope", metavar="FILE", help="also write the scores as a Gradescope import CSV")
    p.add_argument("--roster", metavar="FILE", help="CSV mapping `student` to name, email, sid, sis_user_id, ...")
    p.add_argument("--no-sandbox", action="store_true",
                   help="run notebooks without bubblewrap (in-process limits only): for grading your own work")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_grade)
