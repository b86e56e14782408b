"""`check(task_id, obj)`: run an exercise task's tests against the reader's answer (every chapter).

`check` runs every test of a task (see `minillm.book.grading.registry`, where the tasks and their
tests are registered) with a time limit and shows one line per test: pass, or fail with what was
expected, what came and a hint. An exception in the reader's code is summarised as its type,
message and the reader's own line — never a traceback.

    from minillm.book.grading import check
    check("00.rms_norm", rms_norm)        # in a notebook: a small coloured table

The tasks of every chapter (`minillm/book/grading/tasks/`) are imported on first use (`get_task`),
which registers them; they import only the registry, never this module.

`check` is for the reader's own feedback. `minillm grade` never believes it: it runs the notebook in
a sandbox process, then runs these same tests itself, in its own process, on the reader's functions
(see `minillm.book.grading.sandbox` and `minillm.book.grading.grade`). While it grades, `check` does nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import Any

from minillm.book.grading.registry import TASKS, MismatchError, StudentError, Task, summarise_exception

GRADING = False  # set inside the grader's sandbox: check() then leaves the tests to the grader


def get_task(task_id: str) -> Task:
    """The registered task `task_id` (tasks of every chapter are loaded on first use)."""
    import minillm.book.grading.tasks  # noqa: F401 - importing registers every chapter's tasks

    if task_id not in TASKS:
        known = ", ".join(sorted(TASKS)) or "none"
        raise KeyError(f"no exercise task {task_id!r}; check the id in the notebook. Known tasks: {known}.")
    return TASKS[task_id]


# ---- running --------------------------------------------------------------------------------------


@dataclass
class TestResult:
    name: str
    passed: bool
    message: str = ""  # on failure: expected / got, or the summarised exception
    hint: str = ""


@dataclass
class TaskResult:
    task_id: str
    results: list[TestResult]

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def n_passed(self) -> int:
        return sum(r.passed for r in self.results)

    def summary(self) -> str:
        """One line: all passed, or how many failed and the first failure."""
        if self.passed:
            return f"all {len(self.results)} tests passed"
        first = next(r for r in self.results if not r.passed)
        return f"{len(self.results) - self.n_passed} of {len(self.results)} tests failed; first: {first.name}: " \
               f"{first.message}"

    def __repr__(self) -> str:
        lines = [f"{self.task_id}: {self.n_passed}/{len(self.results)} tests passed"]
        for r in self.results:
            lines.append(f"  {'PASS' if r.passed else 'FAIL'}  {r.name}")
            if not r.passed:
                lines.append(f"        {r.message}")
                if r.hint:
                    lines.append(f"        hint: {r.hint}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        colour = "#1a7f37" if self.passed else "#cf222e"
        rows = []
        for r in self.results:
            mark = '<span style="color:#1a7f37">&#10004; pass</span>' if r.passed else \
                '<span style="color:#cf222e">&#10008; fail</span>'
            detail = "" if r.passed else escape(r.message) + (
                f"<br><i>hint:</i> {escape(r.hint)}" if r.hint else "")
            rows.append(f"<tr><td style='text-align:left'>{mark}</td><td style='text-align:left'>{escape(r.name)}"
                        f"</td><td style='text-align:left'>{detail}</td></tr>")
        return (f"<div><b style='color:{colour}'>{escape(self.task_id)}: {self.n_passed}/{len(self.results)} "
                f"tests passed</b><table>{''.join(rows)}</table></div>")


class _TimeLimitError(Exception):
    """A test ran past its time limit; `late_s`: how long after it the answer still returned (None: it was stopped)."""

    def __init__(self, late_s: float | None = None) -> None:
        super().__init__()
        self.late_s = late_s


def _run_with_time_limit(fn: Callable[[], None], seconds: float) -> None:
    """Run fn, raising `_TimeLimitError` after `seconds` (a SIGALRM in the main thread, else a watcher thread)."""
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        def on_alarm(signum: int, frame: Any) -> None:
            raise _TimeLimitError()

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        return
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            outcome.append(exc)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    if not outcome:
        raise _TimeLimitError()
    if outcome[0] is not None:
        raise outcome[0]


def run_task(task_id: str, answer: Any, hidden: bool | None = None) -> TaskResult:
    """Run every test of `task_id` on `answer`; never raises for a wrong or broken answer.

    `answer` is the reader's object, or the grader's stand-in for one that lives in its sandbox
    (which keeps its own time: it has a `set_deadline` method). `hidden`: None runs every test, False only
    the public ones, True only an instructor's hidden ones (`minillm grade` runs those apart, later).
    """
    task = get_task(task_id)
    results = []
    for t in task.tests:
        if hidden is not None and t.hidden != hidden:
            continue
        try:
            if hasattr(answer, "set_deadline"):
                answer.set_deadline(t.time_limit_s)
                t.run(answer)
            else:
                _run_with_time_limit(lambda t=t: t.run(answer), t.time_limit_s)
            results.append(TestResult(t.name, True))
        except MismatchError as m:
            results.append(TestResult(t.name, False, f"{m.what}: expected {m.expected}; got {m.got}", m.hint))
        except _TimeLimitError as exc:
            late = "" if exc.late_s is None else f" (it returned {exc.late_s:.1f} s after that)"
            results.append(TestResult(t.name, False, f"took longer than {t.time_limit_s:g} s{late}: "
                                      "look for a loop that never ends or one over every element"))
        except StudentError as exc:
            results.append(TestResult(t.name, False, exc.summary))
        except Exception as exc:  # noqa: BLE001 - a reader's bug is reported, not raised
            results.append(TestResult(t.name, False, summarise_exception(exc)))
    return TaskResult(task_id, results)


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def check(task_id: str, answer: Any) -> None:
    """Run task `task_id`'s tests on the reader's `answer` and show one line per test.

    In Jupyter the result is a small coloured table; elsewhere it is printed as text.
    """
    if GRADING:
        print(f"{task_id}: checked by the grader, in its own process")
        return
    result = run_task(task_id, answer)
    if _in_notebook():
        from IPython.display import display

        display(result)
    else:
        print(repr(result))
