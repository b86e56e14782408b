"""Every wait of the grader is bounded (issue 55): a notebook that closes its reply channel and sleeps stops its
own grading, not the class's; a task's hung calls spend that task's restarts, not the next task's, and the message
says why the process was stopped.

The sandbox runs without bubblewrap here (`isolate=False`): what is tested is the grader's side of the pipes.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest

from minillm.book.grading.sandbox import Sandbox, SandboxError

CLOSES_AND_SLEEPS = """import os, sys, time
def param_count(config):
    os.close(int(sys.argv[2]))  # the reply channel the grader reads (the sandbox's second argument)
    time.sleep(3600)
def rms_norm(x, weight, eps=1e-5):
    return x
"""


def _notebook(path: Path, source: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nbformat.write(nb, path)
    return path


def test_a_closed_reply_channel_stops_the_call_within_seconds_and_restarts_are_per_task(tmp_path):
    path = _notebook(tmp_path / "sleeper.ipynb", CLOSES_AND_SLEEPS)
    with Sandbox(path, timeout_s=120, restarts=1, isolate=False) as sandbox:
        sandbox.start()
        for _ in range(2):  # the first call, then the one restart this task has
            start = time.monotonic()
            with pytest.raises(SandboxError, match="closed its reply channel"):
                sandbox.call("param_count", (1,), {}, (), time.monotonic() + 60, task="00.param_count")
            assert time.monotonic() - start < 30, "the grader waited on a process that will never answer"
        with pytest.raises(SandboxError, match=r"stopped 2 times during this task's tests \(last: its reply channel"):
            sandbox.call("param_count", (1,), {}, (), time.monotonic() + 60, task="00.param_count")
        value, _ = sandbox.call("rms_norm", (3, 1), {}, (), time.monotonic() + 60, task="00.rms_norm")
        assert value == 3, "the next task starts with restarts of its own"


OWN_PROBE = """from minillm.book.grading import get_task
from minillm.book.grading.registry import call_probed


def count_calls(answer, config):
    return answer(config)


@get_task("00.param_count").test("probed")
def probed(answer):
    call_probed(answer, count_calls, 1)
"""


def test_a_hidden_tests_own_probe_is_refused_at_load_and_never_sent_to_a_sandbox(tmp_path):
    """The sandbox imports probes by name and sees only minillm: a probe written in a hidden test's file would
    crash every notebook's sandbox, with the notebook blamed. It is refused when the file is loaded, and at the
    call, before anything reaches the sandbox."""
    from minillm.book.grading.grade import load_extra_tests
    from minillm.book.grading.sandbox import ProbeError

    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "probe_test.py").write_text(OWN_PROBE)
    with pytest.raises(ValueError, match="passes its own function `count_calls` to call_probed"):
        load_extra_tests(tmp_path / "hidden")

    def local_probe(answer, config):  # noqa: ANN001, ANN202
        return answer(config)

    with Sandbox(_notebook(tmp_path / "n.ipynb", "x = 1"), isolate=False) as sandbox:
        with pytest.raises(ProbeError, match="can only import module-level probes"):
            sandbox.call("x", (1,), {}, (), time.monotonic() + 5, probe=local_probe, task="00.param_count")
        assert sandbox.proc is None, "refused before a sandbox was started"


REMEMBERS_INPUTS = """seen = []
def count_params(config):
    seen.append(str(config)[:60])
    raise ValueError("inputs so far: " + " | ".join(seen))
def rms_norm(x, weight, eps=1e-5):
    raise ValueError("inputs so far: " + " | ".join(seen))
"""

HIDDEN_INPUT = """from minillm.book.grading import get_task

@get_task("00.param_count").test("a secret config")
def _(fn):
    fn("HIDDEN-INPUT-MARKER")
"""


def test_hidden_tests_run_after_every_public_test_in_a_fresh_process(tmp_path):
    """A notebook that remembers every input it is given and repeats them in its errors: the hidden test's
    input must not reach any public test's message (which the student's feedback shows)."""
    from minillm.book.grading import get_task
    from minillm.book.grading.grade import grade_notebook, load_extra_tests
    from minillm.book.grading.gradebook import feedback_text
    from minillm.book.grading.registry import TASKS

    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "secret.py").write_text(HIDDEN_INPUT)
    n_tests = len(get_task("00.param_count").tests)
    path = _notebook(tmp_path / "notebook.ipynb", REMEMBERS_INPUTS)
    try:
        load_extra_tests(tmp_path / "hidden")
        grade = grade_notebook(path, chapter_id="00", isolate=False, timeout_s=120, student="eve")
    finally:
        del TASKS["00.param_count"].tests[n_tests:]
    tests = [t for task in grade.tasks for t in task.tests]
    public = [t for t in tests if not t.hidden]
    assert any(t.hidden and not t.passed for t in tests), "the hidden test ran"
    assert public and not any("HIDDEN-INPUT-MARKER" in t.message for t in public), [t.message for t in public]
    assert "HIDDEN-INPUT-MARKER" not in feedback_text("eve", [grade])
    assert grade.tasks[0].tests[-1].hidden, "a task's hidden tests come after its public ones"


SILENCES_THE_FLAGS = """import os, sys
def honest(x):
    return x + 1
def silencer(x):
    os.close(int(sys.argv[3]))  # the flag pipe (the sandbox's third argument): no flag could reach the grader
    return x + 1
"""


def test_a_silenced_flag_channel_is_itself_a_flag():
    """Each call carries a nonce that the flag pipe must echo when the call ends; an honest call is acknowledged,
    and one after which the pipe went quiet gets a review flag on its task."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = _notebook(Path(folder) / "n.ipynb", SILENCES_THE_FLAGS)
        with Sandbox(path, timeout_s=120, isolate=False) as sandbox:
            sandbox.start()
            assert sandbox.call("honest", (1,), {}, (), time.monotonic() + 30, task="00.rms_norm")[0] == 2
            assert not sandbox.flags, sandbox.flags
            assert sandbox.call("silencer", (1,), {}, (), time.monotonic() + 30, task="00.rotary")[0] == 2
            assert [f["task"] for f in sandbox.flags if "did not acknowledge" in f["flag"]] == ["00.rotary"]


STARTS_A_THREAD = """import threading, time
def _loop():
    while True:
        time.sleep(0.05)
threading.Thread(target=_loop, daemon=True).start()
def answer(x):
    return x * 2
"""


def test_a_thread_running_before_the_call_is_watched_or_flagged(tmp_path):
    """The profiler that watches a call's calls reaches the threads the call starts; one the notebook started
    earlier is reached only on Python 3.12 (threading.setprofile_all_threads), and flagged where it is not."""
    import sys

    path = _notebook(tmp_path / "n.ipynb", STARTS_A_THREAD)
    with Sandbox(path, timeout_s=120, isolate=False) as sandbox:
        sandbox.start()
        assert sandbox.call("answer", (2,), {}, (), time.monotonic() + 30, task="00.rms_norm")[0] == 4
        flagged = [f for f in sandbox.flags if "thread(s) the notebook started" in f["flag"]]
        assert len(flagged) == (0 if sys.version_info >= (3, 12) else 1), sandbox.flags


SLOW_FIRST_CALL = """import time
warm = []
def answer(x):
    if not warm:  # a first call that pays a warm-up (a compile, a cache) in every new process
        time.sleep(3)
        warm.append(True)
    return x
def hangs(x):
    time.sleep(3600)
"""


def test_one_slow_first_call_fails_its_test_only_and_a_hung_one_costs_a_restart(tmp_path, monkeypatch):
    """A call that returns late (within LATE_GRACE_S) fails its test and keeps the warm process, so the task's
    other tests run; one that hangs is stopped, and the next call starts the notebook again, its re-run not
    counted against the test's time."""
    import minillm.book.grading.sandbox as sandbox_module
    from minillm.book.grading.check import _TimeLimitError
    from minillm.book.grading.sandbox import RemoteAnswer

    monkeypatch.setattr(sandbox_module, "LATE_GRACE_S", 5.0)
    path = _notebook(tmp_path / "slow.ipynb", SLOW_FIRST_CALL)
    with Sandbox(path, timeout_s=120, restarts=1, isolate=False) as sandbox:
        sandbox.start()
        pid, answer = sandbox.proc.pid, RemoteAnswer(sandbox, "answer", (), task="00.rms_norm")
        answer.set_deadline(1.0)
        with pytest.raises(_TimeLimitError) as slow:
            answer(1)
        assert slow.value.late_s is not None and 1.0 < slow.value.late_s < 5.0
        answer.set_deadline(1.0)
        assert answer(2) == 2 and sandbox.proc.pid == pid and sandbox.restarts_left == 1, "the same, warm process"

        hung = RemoteAnswer(sandbox, "hangs", (), task="00.rotary")
        hung.set_deadline(0.5)
        start = time.monotonic()
        with pytest.raises(_TimeLimitError) as stopped:
            hung(1)
        assert stopped.value.late_s is None and time.monotonic() - start < 0.5 + 5.0 + 10
        again = RemoteAnswer(sandbox, "answer", (), task="00.rotary")
        again.set_deadline(1.0)  # the restart re-runs the notebook first; the warm-up is then paid again, late
        with pytest.raises(_TimeLimitError):
            again(3)
        assert sandbox.proc.pid != pid and sandbox.restarts_left == 0
        again.set_deadline(1.0)
        assert again(4) == 4
