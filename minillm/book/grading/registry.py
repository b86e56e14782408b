"""Exercise tasks and their tests: the registry every chapter's task module fills (every chapter).

A *task* is one thing an exercise asks the reader to build ("00.rms_norm": an RMSNorm function).
Each chapter's module in `minillm/book/grading/tasks/` registers its tasks here, with a few *tests*
each; a test calls the reader's object and either returns (pass) or raises
`MismatchError(what, expected, got, hint)`:

    task = register_task("00.rms_norm", "rms_norm(x, weight, eps) -> Tensor", reference=my_rms_norm)

    @task.test("matches minillm's RMSNorm on random inputs")
    def _(rms_norm):
        ...
        expect_close(rms_norm(x, w, 1e-5), reference, what="rms_norm(x, w, 1e-5)", hint="...")

This module holds what a task module needs (the registry, `MismatchError` and the helpers tests are
written with) and imports nothing of the grading package, so the imports point one way: the task
modules import this, and `minillm.book.grading.check`, which runs the tests, imports the task modules
to fill the registry.

A test that must observe the reader's function from the inside (count the tokens it feeds the
model, say) passes a *probe* to `call_probed`: a module-level function `probe(answer, *args)` of
`minillm.book.grading.probes` (which the sandbox imports it from by name; the task modules themselves are not
readable there, and a hidden test's own file cannot hold one) that runs beside the answer, in the notebook's
process when grading, and returns plain data.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DEFAULT_TIME_LIMIT_S = 20.0
_PACKAGE_DIR = str(Path(__file__).resolve().parents[2])  # minillm/: frames there are not the reader's code
TRUSTED_SOURCE_DIRS: set[str] = set()  # nor are an instructor's hidden tests (`minillm grade --extra-tests`)


class MismatchError(AssertionError):
    """A test's verdict on a wrong answer: what was checked, what was expected, what came, and a hint."""

    def __init__(self, what: str, expected: Any, got: Any, hint: str = "") -> None:
        super().__init__(f"{what}: expected {expected}, got {got}")
        self.what, self.expected, self.got, self.hint = what, expected, got, hint


@dataclass
class TaskTest:
    name: str
    run: Callable[[Any], None]
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    hidden: bool = False  # an instructor's test (`minillm grade --extra-tests`), not in the reader's copy


@dataclass
class Task:
    """A registered exercise task: its id, what the reader must write, its tests, and a reference answer.

    `forbid` names the minillm (or torch) functions and classes that already do the task, as dotted
    paths ("minillm.sampler.sampling.top_p_filter"): an answer that is one of them, or calls one, gets no
    credit from `minillm grade`. The reference itself is always forbidden.
    """

    id: str
    signature: str
    reference: Callable[..., Any]
    tests: list[TaskTest] = field(default_factory=list)
    forbid: tuple[str, ...] = ()

    @property
    def answer_name(self) -> str:
        """The name the exercise gives the reader's function: `rms_norm` for "rms_norm(x, ...) -> ..."."""
        return self.signature.split("(")[0].strip()

    @property
    def forbidden(self) -> tuple[str, ...]:
        """Dotted paths of everything that does the task for the reader: `forbid` plus the reference."""
        return (*self.forbid, f"{self.reference.__module__}.{self.reference.__qualname__}")

    def test(self, name: str, time_limit_s: float = DEFAULT_TIME_LIMIT_S, hidden: bool = False) -> Callable:
        """Decorator: register `fn(answer)` as one of this task's tests."""

        def register(fn: Callable[[Any], None]) -> Callable[[Any], None]:
            if any(t.name == name for t in self.tests):
                raise ValueError(f"task {self.id!r} already has a test named {name!r}; test names must be unique.")
            self.tests.append(TaskTest(name, fn, time_limit_s, hidden))
            return fn

        return register


TASKS: dict[str, Task] = {}


def register_task(task_id: str, signature: str, reference: Callable[..., Any], forbid: tuple[str, ...] = ()) -> Task:
    """Create and register a task; `reference` is a correct answer (tests prove it passes).

    forbid: dotted paths of library functions or classes that do the task (see `Task`).
    """
    if task_id in TASKS:
        raise ValueError(f"task {task_id!r} is registered twice; task ids must be unique.")
    TASKS[task_id] = Task(task_id, signature, reference, forbid=tuple(forbid))
    return TASKS[task_id]


def call_probed(answer: Any, probe: Callable[..., Any], *args: Any) -> Any:
    """`probe(answer, *args)`, run where the answer lives: here, or in the grader's sandbox.

    A probe is a module-level function of `minillm.book.grading.probes` (the sandbox imports it by name) that
    calls the answer and observes it from the inside, returning plain data: numbers, strings, tensors, lists,
    dicts.
    """
    remote = getattr(answer, "call_probed", None)
    if remote is not None:
        return remote(probe, *args)
    return probe(answer, *args)


def diagnose(got: list, cases: list[tuple], suspects: list[tuple[Callable[..., Any], str]], fallback: str,
             same: Callable[[Any, Any], bool] = lambda a, b: a == b) -> str:
    """The hint of the first wrong version (suspects: (function, hint)) that gives exactly the reader's answers
    `got` on every case (`same` compares two answers); `fallback` when none does."""
    for wrong, hint in suspects:
        try:
            if all(same(g, wrong(*case)) for g, case in zip(got, cases)):
                return hint
        except Exception:  # noqa: BLE001 - a wrong version that cannot run a case does not fit
            continue
    return fallback


def call_catching(fn: Callable[..., Any], args: tuple, error: str, what: str, expected: str, hint: str) -> Any:
    """fn(*args); if the reader's code raises `error` (an exception type's name), a MismatchError with a hint
    instead of the bare exception (here, or in the grader's sandbox, where it arrives as a StudentError)."""
    try:
        return fn(*args)
    except Exception as exc:
        text = exc.summary if isinstance(exc, StudentError) else summarise_exception(exc)
        if not text.startswith(error + ":"):
            raise
        raise MismatchError(what, expected, text, hint) from None


# ---- helpers for writing tests ------------------------------------------------------------------


def short_repr(x: object, limit: int = 120) -> str:
    """repr(x), cut to `limit` characters with an ellipsis: what a reader's answer looks like in a message."""
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def is_number(x: object) -> bool:
    """An int or a float, not a bool (True is an int to Python, not an answer to a numeric task)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def expect_close(got: Any, expected: torch.Tensor, what: str, hint: str = "", atol: float = 1e-5,
                 rtol: float = 1e-5) -> None:
    """Raise `MismatchError` unless `got` is a tensor of `expected`'s shape and dtype with close values."""
    if not isinstance(got, torch.Tensor):
        raise MismatchError(what, f"a torch.Tensor of shape {tuple(expected.shape)}", type(got).__name__, hint)
    if got.shape != expected.shape:
        raise MismatchError(what, f"shape {tuple(expected.shape)}", f"shape {tuple(got.shape)}", hint)
    if got.dtype != expected.dtype:
        raise MismatchError(what, f"dtype {expected.dtype}", f"dtype {got.dtype}", hint)
    diff = (got.detach().float() - expected.float()).abs()
    bad = ~(diff <= atol + rtol * expected.float().abs())
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise MismatchError(
            what,
            f"values within {atol:g} (+{rtol:g}·|x|); at index {idx}: {expected[idx].item():.6g}",
            f"{got[idx].item():.6g} (max |Δ| {diff.max().item():.3g}, {int(bad.sum())} of {diff.numel()} off)",
            hint,
        )


def expect_equal(got: Any, expected: Any, what: str, hint: str = "") -> None:
    """Raise `MismatchError` unless `got == expected` (same type family: an int is not a float)."""
    if type(got) is not type(expected) and not (isinstance(got, int) and isinstance(expected, int)):
        raise MismatchError(what, f"{expected!r} ({type(expected).__name__})", f"{got!r} ({type(got).__name__})", hint)
    if got != expected:
        raise MismatchError(what, f"{expected!r}", f"{got!r}", hint)


# ---- the reader's exceptions ---------------------------------------------------------------------


def summarise_exception(exc: BaseException) -> str:
    """`TypeError: msg (your line 7: x = foo(y))`: the type, message and the reader's own line."""
    if isinstance(exc, NotImplementedError):
        return f"not implemented yet: {exc}" if str(exc) else "not implemented yet"
    text = f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if not _is_library_file(f.filename)]
    if own:
        f = own[-1]
        line = (f.line or "").strip()
        text += f" (your line {f.lineno}: {line})" if line else f" (your line {f.lineno})"
    return text


def _is_library_file(filename: str) -> bool:
    if filename.startswith(_PACKAGE_DIR) or any(filename.startswith(d) for d in TRUSTED_SOURCE_DIRS):
        return True
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return any(filename.startswith(p) and ("site-packages" in filename or "/lib/python" in filename)
               for p in prefixes)


class StudentError(Exception):
    """The reader's function raised, in another process; `summary` is what `summarise_exception` made of it."""

    def __init__(self, summary: str) -> None:
        super().__init__(summary)
        self.summary = summary
