"""The exercise machinery: check(), the registered tasks, exercise generation and `minillm grade`."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import nbformat
import pytest
import torch
from conftest import GRADER_IMPORTS, OWN_ROPE

from minillm.arithmetic import cdiv
from minillm.book import load_book
from minillm.book.grading import TASKS, check, get_task, register_task, run_task
from minillm.book.grading.exercises import ExerciseError, blank_source, exercise_text, make_exercise
from minillm.book.grading.registry import MismatchError, summarise_exception
from minillm.book.grading.tasks import ch00
from minillm.cli import main
from minillm.quant import NF4_CODEBOOK


def _blank(*args, **kwargs):
    raise NotImplementedError("write it")


def _all_tasks() -> list[str]:
    get_task("00.param_count")  # loads every chapter's tasks
    return sorted(t for t in TASKS if not t.startswith("test."))


@pytest.mark.parametrize("task_id", _all_tasks())
def test_every_task_passes_its_reference_and_fails_its_blank(task_id):
    task = get_task(task_id)
    assert len(task.tests) >= 3, f"{task_id} should have at least three tests"
    good = run_task(task_id, task.reference)
    assert good.passed, repr(good)
    blank = run_task(task_id, _blank)
    assert not any(r.passed for r in blank.results), repr(blank)
    assert all("not implemented yet" in r.message for r in blank.results)


def test_every_task_of_the_book_is_registered():
    for chapter in load_book().chapters:
        for task_id in chapter.tasks:
            assert task_id.startswith(chapter.id + "."), f"{task_id} listed under chapter {chapter.id}"
            get_task(task_id)  # raises with the known ids if missing


def test_wrong_answers_fail_with_a_hint_that_fits_the_mistake():
    def forgot_untied_head(config):
        return ch00.reference_param_count(config) - (0 if config.tie_embeddings else config.vocab_size * config.dim)

    result = run_task("00.param_count", forgot_untied_head)
    failed = [r for r in result.results if not r.passed]
    assert failed and all("untied" in r.hint for r in failed)
    assert "6738415616" in failed[0].message  # what was expected is stated

    def no_eps(x, weight, eps=1e-5):
        return weight * (x / x.pow(2).mean(-1, keepdim=True).sqrt())

    result = run_task("00.rms_norm", no_eps)
    by_name = {r.name: r for r in result.results}
    zero = by_name["eps goes inside the square root: an all-zero row gives zeros, not NaN"]
    assert not zero.passed and "nan" in zero.message and "eps" in zero.hint

    def interleaved_pairs(x, positions, theta=10000.0):  # Meta's pairing, not rotate-half
        d = x.shape[-1]
        freqs = theta ** (-torch.arange(d // 2).float() * 2 / d)
        ang = positions.float()[:, None] * freqs
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), dim=-1)
        return out.flatten(-2)

    result = run_task("00.rotary", interleaved_pairs)
    assert not result.passed and result.results[0].passed  # position 0 is the identity either way


def test_beam_step_mistakes_get_hints_that_fit_them():
    def per_beam_top_k(logprobs, beam_scores, num_beams, num_candidates=None):  # each beam supplies k / num_beams
        k = num_candidates or 2 * num_beams
        values, tokens = (beam_scores[:, None] + logprobs).topk(k // num_beams, dim=-1)
        parents = torch.arange(num_beams)[:, None].expand_as(tokens)
        scores, order = values.flatten().sort(descending=True)
        return scores, parents.flatten()[order], tokens.flatten()[order]

    def no_cumulative_score(logprobs, beam_scores, num_beams, num_candidates=None):
        scores, flat = logprobs.flatten().topk(num_candidates or 2 * num_beams)
        return scores, flat // logprobs.shape[-1], flat % logprobs.shape[-1]

    def index_by_num_beams(logprobs, beam_scores, num_beams, num_candidates=None):
        scores, flat = (beam_scores[:, None] + logprobs).flatten().topk(num_candidates or 2 * num_beams)
        return scores, flat % num_beams, flat // num_beams

    def only_num_beams(logprobs, beam_scores, num_beams, num_candidates=None):
        scores, flat = (beam_scores[:, None] + logprobs).flatten().topk(num_beams)
        return scores, flat // logprobs.shape[-1], flat % logprobs.shape[-1]

    def worst_first(logprobs, beam_scores, num_beams, num_candidates=None):
        scores, flat = (beam_scores[:, None] + logprobs).flatten().topk(num_candidates or 2 * num_beams)
        return scores.flip(0), flat.flip(0) // logprobs.shape[-1], flat.flip(0) % logprobs.shape[-1]

    for wrong, words in [(per_beam_top_k, "flatten"), (no_cumulative_score, "beam_scores[b] + logprobs[b, t]"),
                         (index_by_num_beams, "parent = flat // V"), (only_num_beams, "2 * num_beams"),
                         (worst_first, "best first")]:
        result = run_task("01.beam_step", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed, wrong.__name__
        assert all(words in r.hint for r in failed), (wrong.__name__, repr(result))
    by_name = {r.name: r for r in run_task("01.beam_step", no_cumulative_score).results}
    first = by_name["the first step: every beam is the prompt, scores [0, -1e9, -1e9]"]
    assert "-1e9" in first.hint and "copy of the prompt" in first.hint


def test_a_crash_in_the_readers_code_is_summarised_with_their_line():
    def reader(config):
        total = config.dim * config.n_layers
        return total + config.no_such_field  # the bug

    result = run_task("00.param_count", reader)
    message = result.results[0].message
    assert message.startswith("AttributeError:") and "no_such_field" in message
    assert "your line" in message and "return total + config.no_such_field" in message
    assert "Traceback" not in repr(result)


def test_a_test_that_runs_too_long_fails_with_a_time_limit():
    task = register_task("test.slow", "f() -> None", reference=lambda: None)
    try:
        @task.test("returns quickly", time_limit_s=0.5)
        def _(fn):
            fn()

        start = time.perf_counter()
        result = run_task("test.slow", lambda: time.sleep(5))
        assert time.perf_counter() - start < 3
        assert not result.passed and "longer than 0.5 s" in result.results[0].message
        assert run_task("test.slow", lambda: None).passed
    finally:
        del TASKS["test.slow"]


def test_check_prints_one_line_per_test(capsys):
    check("00.rms_norm", ch00.reference_rms_norm)
    check("00.rotary", _blank)
    text = capsys.readouterr().out
    assert "00.rms_norm: 4/4 tests passed" in text and text.count("PASS") == 4
    assert "00.rotary: 0/4 tests passed" in text and text.count("FAIL") == 4
    html = run_task("00.rotary", _blank)._repr_html_()
    assert "#cf222e" in html and "<table>" in html and "not implemented yet" in html


def test_check_leaves_the_tests_to_the_grader_inside_its_sandbox(monkeypatch, capsys):
    import importlib

    monkeypatch.setattr(importlib.import_module("minillm.book.grading.check"), "GRADING", True)
    check("00.rotary", _blank)
    assert "checked by the grader" in capsys.readouterr().out


def test_unknown_task_id_names_the_known_ones():
    with pytest.raises(KeyError, match="00.rms_norm"):
        run_task("00.rmsnorm", _blank)


def test_summarise_exception_of_not_implemented():
    assert summarise_exception(NotImplementedError("do X")) == "not implemented yet: do X"


def test_expect_helpers_report_shape_and_type():
    from minillm.book.grading.registry import expect_close, expect_equal

    with pytest.raises(MismatchError, match=r"shape \(2, 3\)"):
        expect_close(torch.zeros(3, 2), torch.zeros(2, 3), "f(x)")
    with pytest.raises(MismatchError, match="float"):
        expect_equal(3.0, 3, "count")


# ---- exercise generation ----------------------------------------------------------------------------


def test_blank_source_replaces_regions_at_their_indentation():
    source = "def f(x):\n    y = 1\n    # BEGIN SOLUTION: return x + y\n    z = x + y\n    return z\n" \
             "    # END SOLUTION\n"
    blanked, n = blank_source(source)
    assert n == 1
    assert blanked == "def f(x):\n    y = 1\n    raise NotImplementedError('return x + y')\n"
    default, _ = blank_source("def g():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION")
    assert "NotImplementedError('write this part" in default


def test_a_long_hint_continues_on_comment_lines_and_its_raise_is_cut_to_fit_120_characters():
    hint = "accept draft i iff u[i] * q[i, x] < p[i, x]; at the first rejection sample the residual and stop; " \
           "after all k drafts, sample one more token from p[k]"
    cut = hint.rindex(" ", 0, 90)  # the BEGIN line holds the hint up to here, a "#   " line the rest
    source = ("def verify(p, q):\n        # BEGIN SOLUTION: " + hint[:cut] + "\n        #   " + hint[cut + 1:]
              + "\n        # a comment of the answer itself\n        return p\n        # END SOLUTION\n")
    blanked, _ = blank_source(source)
    assert all(len(line) <= 120 for line in blanked.splitlines()), blanked
    assert "a comment of the answer" not in blanked, "only '#   ' lines continue the hint; the answer is gone"
    namespace: dict = {}
    exec(blanked, namespace)
    with pytest.raises(NotImplementedError) as err:
        namespace["verify"](None, None)
    assert str(err.value) == hint, "the message is the whole hint, rejoined"


@pytest.mark.parametrize(
    "source, error",
    [
        ("# BEGIN SOLUTION\nx = 1\n# END SOLUTION", "indented inside a function"),
        ("def f():\n    # BEGIN SOLUTION\n    return 1\n", "no '# END SOLUTION'"),
        ("def f():\n    return 1\n    # END SOLUTION", "without a '# BEGIN SOLUTION'"),
        ("def f():\n    # BEGIN SOLUTION\n    # BEGIN SOLUTION\n    # END SOLUTION", "cannot nest"),
    ],
)
def test_blank_source_rejects_malformed_markers(source, error):
    with pytest.raises(ExerciseError, match=error):
        blank_source(source)


def test_exercise_notebooks_are_in_sync_with_their_solutions():
    book = load_book()
    for chapter in book.chapters:  # written ones, and those whose exercises come before the chapter is done
        if not chapter.written and not (book.root / chapter.solution).is_file():
            continue
        exercise = book.root / chapter.exercise
        assert exercise.is_file(), f"{chapter.exercise} missing: run `minillm book exercises`"
        expected = exercise_text(book.root / chapter.solution, chapter.solution)
        assert exercise.read_text(encoding="utf-8") == expected, (
            f"{chapter.exercise} is out of date with {chapter.solution}: run `minillm book exercises`"
        )


def test_generated_exercise_has_no_answers_and_no_outputs():
    book = load_book()
    chapter = book.chapter("00")
    nb = make_exercise(book.root / chapter.solution)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert sum("raise NotImplementedError(" in c.source for c in code) == len(chapter.tasks)
    assert not any("BEGIN SOLUTION" in c.source or "NBVAL_CHECK_OUTPUT" in c.source for c in code)
    for task_id in chapter.tasks:
        assert any(f'check("{task_id}"' in c.source for c in code), f"no check cell for {task_id}"


# ---- minillm grade: the source check (no sandbox) ----------------------------------------------------

FORBID_RMS = get_task("00.rms_norm").forbidden


def _misuse(*cells: str, answer: str = "rms_norm") -> str | None:
    from minillm.book.grading.forgery import forbidden_use, read_source

    return forbidden_use(read_source(list(cells)), answer, FORBID_RMS)


OWN_RMS = "def rms_norm(x, w, eps=1e-5):\n    return w * x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()"


def test_source_check_accepts_the_readers_own_code():
    assert _misuse("import torch\nfrom minillm.model import RMSNorm", OWN_RMS) is None
    # a top-level name used in a test cell does not leak into the function's own local of that name
    assert _misuse("from minillm.model import RMSNorm\nexpected = RMSNorm(8)",
                   "def rms_norm(x, w, eps=1e-5):\n    expected = x.pow(2).mean(-1, keepdim=True)\n"
                   "    return w * x / (expected + eps).sqrt()") is None


@pytest.mark.parametrize("cells, words", [
    (["from minillm.book.grading.tasks.ch00 import reference_rms_norm as rms_norm"], "belongs to the grader"),
    (["import minillm.book.grading.tasks.ch00 as t", "rms_norm = t.reference_rms_norm"], "belongs to the grader"),
    (["from minillm import model as M",
      "def helper(x, w, eps):\n    n = M.RMSNorm(x.shape[-1], eps)\n    return n(x)",
      "def rms_norm(x, w, eps=1e-5):\n    return helper(x, w, eps)"], "minillm.model.RMSNorm"),
    (["import torch.nn.functional as F", "rms_norm = lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps)"],
     "torch.nn.functional.rms_norm"),
    (["def rms_norm(x, w, eps=1e-5):\n    from minillm.model import RMSNorm\n    return RMSNorm(4)(x)"],
     "minillm.model.RMSNorm"),
])
def test_source_check_finds_an_answer_that_uses_what_already_does_the_task(cells, words):
    reason = _misuse(*cells)
    assert reason is not None and words in reason, reason


def test_plain_data_crosses_back_and_nothing_else():
    import numpy as np

    from minillm.book.grading.sandbox import _receive, _send
    from minillm.book.grading.wire import from_data, to_data

    class Sneaky(torch.Tensor):
        def __eq__(self, other):  # would make every comparison pass
            return True

    value = from_data(to_data({"t": torch.ones(2).as_subclass(Sneaky), "xs": [1, 2.5, "s", b"b", None],
                               "arr": np.zeros(3), "pair": (torch.float16, torch.Size([2]))}))
    assert type(value["t"]) is torch.Tensor and value["xs"] == [1, 2.5, "s", b"b", None]
    assert type(value["arr"]).__name__ == "ndarray" and "array" in repr(value["arr"])
    assert value["pair"] == (torch.float16, torch.Size([2]))
    read, write = __import__("os").pipe()
    _send(write, {"kind": "result", "value": Path("/etc")})  # an arbitrary object, pickled
    with pytest.raises(Exception, match="(?i)unpickl|weights_only"):
        _receive(read, None)


# ---- minillm grade: notebooks in the sandbox ----------------------------------------------------------


def _notebook(path, *sources):
    path.parent.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


IMPORTS = GRADER_IMPORTS
OWN_COUNT = "from minillm import arithmetic\ndef count_params(config):\n    return arithmetic.weight_bytes(config, 8)"
BLANK_RMS = "def rms_norm(x, weight, eps=1e-5):\n    raise NotImplementedError('write it')"

# Each route a notebook might take to a grade it did not earn; the forged task is 00.rms_norm, whose
# function is blank or not the reader's own, while 00.rotary is honestly solved in every notebook.
FORGERIES = {
    "writes_a_verdict_file": [BLANK_RMS, "import os, json\nfor name in ('MINILLM_GRADE_OUT', 'grade.jsonl'):\n"
                              "    path = os.environ.get(name, name)\n    with open(path, 'a') as f:\n"
                              "        f.write(json.dumps({'id': '00.rms_norm', 'passed': True, 'reason': 'ok'}))\n"
                              "print('00.rms_norm: 4/4 tests passed')"],
    "redefines_check": [BLANK_RMS, "def check(task_id, answer):\n    print(f'{task_id}: all tests passed')",
                        "check('00.rms_norm', rms_norm)"],
    "patches_the_registry": [BLANK_RMS, "import minillm.book.grading.check as c\n"
                             "from minillm.book.grading import get_task\nget_task('00.rms_norm').tests.clear()\n"
                             "c.run_task = lambda *a: None\nc.MismatchError = type('M', (Exception,), {})"],
    "returns_the_reference": ["from minillm.book.grading.tasks.ch00 import reference_rms_norm",
                              "check('00.rms_norm', reference_rms_norm)"],
    "wraps_the_engine": ["from minillm.model import RMSNorm\ndef rms_norm(x, weight, eps=1e-5):\n"
                         "    norm = RMSNorm(x.shape[-1], eps)\n    norm.weight.data = weight.float()\n"
                         "    return norm.to(weight.dtype)(x)"],
    "hides_the_engine_call": ["import importlib\ndef rms_norm(x, weight, eps=1e-5):\n"
                              "    mod = importlib.import_module('minillm.' + 'mo' + 'del')\n"
                              "    norm = getattr(mod, 'RMS' + 'Norm')(x.shape[-1], eps)\n"
                              "    norm.weight.data = weight.float()\n    return norm.to(weight.dtype)(x)"],
}


def test_every_forging_route_gets_zero_for_the_forged_task_with_a_reason(tmp_path, needs_bwrap):
    from minillm.book.grading.grade import grade_all

    paths = [_notebook(tmp_path / route / "00_the_model.ipynb", IMPORTS, OWN_ROPE, *cells,
                       "check('00.rotary', apply_rope)") for route, cells in FORGERIES.items()]
    grades = grade_all(paths, jobs=2, progress=False, timeout_s=120)
    expected_reason = {
        "writes_a_verdict_file": "not implemented yet", "redefines_check": "not implemented yet",
        "patches_the_registry": "not implemented yet", "returns_the_reference": "belongs to the grader",
        "wraps_the_engine": "minillm.model.RMSNorm", "hides_the_engine_call": "called minillm.model.RMSNorm",
    }
    for grade in grades:
        tasks = {t.id: t for t in grade.tasks}
        assert grade.student in FORGERIES
        assert tasks["00.rms_norm"].score == 0, (grade.student, tasks["00.rms_norm"])
        assert expected_reason[grade.student] in tasks["00.rms_norm"].reason, (grade.student,
                                                                                tasks["00.rms_norm"].reason)
        assert tasks["00.rotary"].passed, (grade.student, tasks["00.rotary"].reason)  # the honest task counts
        assert "defines no `count_params`" in tasks["00.param_count"].reason


def test_a_broken_notebook_never_stops_the_gradebook(tmp_path, monkeypatch, needs_bwrap):
    from minillm.book.grading.grade import grade_all

    for test in get_task("00.param_count").tests:  # a hung answer should cost seconds here, not minutes
        monkeypatch.setattr(test, "time_limit_s", 2.0)
    honest = ["check('00.rotary', apply_rope)"]
    paths = {
        "crashes": _notebook(tmp_path / "crashes.ipynb", IMPORTS, OWN_ROPE, "1 / 0", *honest),
        "hangs": _notebook(tmp_path / "hangs.ipynb", IMPORTS, OWN_ROPE, *honest, "import time\ntime.sleep(600)"),
        "forks": _notebook(tmp_path / "forks.ipynb", IMPORTS, OWN_ROPE,
                           "import os\nfor _ in range(8):  # 256 processes at most, should the guard fail\n"
                           "    os.fork()", *honest),
        "floods": _notebook(tmp_path / "floods.ipynb", IMPORTS, OWN_ROPE, "for _ in range(20_000):\n"
                            "    print('x' * 1000)\nimport sys\nsys.stderr.write('y' * 10**6)", *honest),
        "hogs_memory_and_net": _notebook(
            tmp_path / "hogs_memory_and_net.ipynb", IMPORTS, OWN_ROPE, "big = bytearray(64 * 2**30)",
            "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
            "open('/tmp/minillm-grade-escape.txt', 'w').write('x')", *honest),
        "hangs_in_its_answer": _notebook(tmp_path / "hangs_in_its_answer.ipynb", IMPORTS, OWN_ROPE,
                                         "def count_params(config):\n    while True:\n        pass", *honest),
        "exits": _notebook(tmp_path / "exits.ipynb", IMPORTS, "import os\nos._exit(3)"),
    }
    garbage = tmp_path / "garbage.ipynb"
    garbage.write_text("{ this is not json")
    start = time.perf_counter()
    grades = grade_all([*paths.values(), garbage, tmp_path / "missing.ipynb"], jobs=2, progress=False,
                       timeout_s=15, chapter_id="00", memory_bytes=2 * 2**30)
    assert time.perf_counter() - start < 150
    by_student = {g.student: g for g in grades}
    rotary = {name: {t.id: t for t in g.tasks}["00.rotary"] for name, g in by_student.items()}
    for name in ("crashes", "forks", "floods", "hogs_memory_and_net", "hangs_in_its_answer"):
        assert rotary[name].passed, (name, rotary[name].reason, by_student[name].notes)
    assert any("ZeroDivisionError" in n for n in by_student["crashes"].notes)
    assert any("starting processes is not allowed" in n for n in by_student["forks"].notes)
    hog_notes = " ".join(by_student["hogs_memory_and_net"].notes)
    assert "MemoryError" in hog_notes and "network access is not allowed" in hog_notes
    assert "writing /tmp/minillm-grade-escape.txt is not allowed" in hog_notes
    assert not Path("/tmp/minillm-grade-escape.txt").exists()
    hung = {t.id: t for t in by_student["hangs_in_its_answer"].tasks}["00.param_count"]
    assert hung.score == 0 and "took longer than 2 s" in hung.tests[0].message
    stopped = "stopped 3 times during this task's tests (last: the call ran past the test's time limit)"
    assert all("took longer than 2 s" in t.message for t in hung.tests[:3])  # each after a restart of its own
    assert all(stopped in t.message for t in hung.tests[3:]), [t.message for t in hung.tests]
    assert all("did not finish within 15 s" in t.reason for t in by_student["hangs"].tasks)
    assert all("exit status 3" in t.reason for t in by_student["exits"].tasks)
    assert all("not a readable notebook" in t.reason for t in by_student["garbage"].tasks)
    assert all("not found" in t.reason for t in by_student["missing"].tasks)


def test_grade_command_hidden_tests_partial_credit_and_the_gradebook(tmp_path, capsys, needs_bwrap):
    from minillm.book.grading.registry import TASKS

    book = load_book()
    chapter = book.chapter("00")
    solution = book.root / chapter.solution
    exercise = tmp_path / "class" / "bob" / "00_the_model.ipynb"
    exercise.parent.mkdir(parents=True)
    nbformat.write(make_exercise(solution), exercise)
    _notebook(tmp_path / "class" / "carol.ipynb", IMPORTS, OWN_ROPE, "check('00.rotary', apply_rope)",
              "def rms_norm(x, weight, eps=1e-5):  # forgets eps\n    xf = x.float()\n"
              "    return (xf / xf.pow(2).mean(-1, keepdim=True).sqrt()).to(x.dtype) * weight",
              "check('00.rms_norm', rms_norm)")
    (tmp_path / "class" / "alice").mkdir()
    (tmp_path / "class" / "alice" / "00_the_model.ipynb").write_bytes(solution.read_bytes())
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "rotary_fp64.py").write_text(
        "import torch\nfrom minillm.book.grading import get_task\n"
        "from minillm.book.grading.registry import expect_close\n"
        "from minillm.book.grading.tasks.ch00 import reference_apply_rope\n\n"
        "@get_task('00.rotary').test('keeps float64 input in float64')\n"
        "def _(fn):\n    x = torch.randn(1, 1, 3, 8, dtype=torch.float64)\n"
        "    expect_close(fn(x, torch.arange(3), 10000.0), reference_apply_rope(x, torch.arange(3)), 'fp64 rope')\n")
    out_json, out_csv = tmp_path / "grades.json", tmp_path / "grades.csv"
    n_tests = len(get_task("00.rotary").tests)
    try:
        code = main(["grade", str(tmp_path / "class"), "-j", "2", "--extra-tests", str(hidden), "--json",
                     str(out_json), "--csv", str(out_csv)])
    finally:
        del TASKS["00.rotary"].tests[n_tests:]
    assert code == 0
    grades = {g["student"]: g for g in json.loads(out_json.read_text())}
    assert set(grades) == {"alice", "bob", "carol"}
    assert grades["alice"]["score"] == grades["alice"]["max_score"] == 7
    assert grades["bob"]["score"] == 0
    carol = {t["id"]: t for t in grades["carol"]["tasks"]}
    assert carol["00.rotary"]["score"] == 3  # OWN_ROPE keeps the dtype, so it passes the hidden test too
    hidden_test = [t for t in carol["00.rotary"]["tests"] if t["hidden"]]
    assert [t["name"] for t in hidden_test] == ["keeps float64 input in float64"] and hidden_test[0]["passed"]
    assert 0 < carol["00.rms_norm"]["score"] < 2  # no eps: the all-zero row gives NaN, the rest pass
    assert "eps" in " ".join(t["hint"] for t in carol["00.rms_norm"]["tests"])
    rows = out_csv.read_text().splitlines()
    assert rows[0] == "student,00.param_count,00.rms_norm,00.rotary,00 total,total,max,to review"
    assert rows[1] == "alice,2.0,2.0,3.0,7.0,7.0,7.0,0" and rows[2].startswith("bob,0.0,0.0,0.0,0.0,0.0,7.0")
    assert rows[3] == "carol,0.0,1.5,3.0,4.5,4.5,7.0,0"
    assert "total: 11.5/21 points in 3 notebooks" in capsys.readouterr().out


def test_grade_command_rejects_an_unknown_chapter(capsys):
    assert main(["grade", "x.ipynb", "--chapter", "42"]) == 1
    assert "no chapter '42'" in capsys.readouterr().err


def test_chapter_03_mistakes_get_hints_that_fit_them():
    import dataclasses
    import math

    from minillm import arithmetic

    def copies_kv(q, k, v):  # right numbers, but G copies of the cache
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v

    def expands_kv(q, k, v):
        b, h, t, d = q.shape
        h_kv, s = k.shape[1], k.shape[2]
        k = k[:, :, None].expand(b, h_kv, h // h_kv, s, d).reshape(b, h, s, d)
        v = v[:, :, None].expand(b, h_kv, h // h_kv, s, d).reshape(b, h, s, d)
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1) @ v

    def modulo_heads(q, k, v):  # query head h reads KV head h % H_kv
        b, h, t, d = q.shape
        h_kv = k.shape[1]
        qg = q.reshape(b, h // h_kv, h_kv, t, d).transpose(1, 2)  # [b, h_kv, G, t, d]
        out = torch.softmax(qg @ k[:, :, None].transpose(-1, -2) / math.sqrt(d), dim=-1) @ v[:, :, None]
        return out.transpose(1, 2).reshape(b, h, t, d)

    def loop_over_kv_heads(q, k, v):  # reads each KV head once: allowed
        g = q.shape[1] // k.shape[1]
        outs = [torch.softmax(q[:, j * g:(j + 1) * g] @ k[:, j:j + 1].mT / math.sqrt(q.shape[-1]), dim=-1)
                @ v[:, j:j + 1] for j in range(k.shape[1])]
        return torch.cat(outs, dim=1)

    copy_test = "K and V are not copied per query head (no repeat_interleave, repeat, expand + reshape, cat)"
    for wrong, copy_op in [(copies_kv, "k.repeat_interleave"), (expands_kv, "expand.reshape")]:
        by_name = {r.name: r for r in run_task("03.group_query_heads", wrong).results}
        assert [n for n, r in by_name.items() if not r.passed] == [copy_test], wrong.__name__
        assert copy_op in by_name[copy_test].message
        assert "group the queries instead of copying K and V" in by_name[copy_test].hint
    result = run_task("03.group_query_heads", modulo_heads)
    failed = [r for r in result.results if not r.passed]
    assert failed and all("h // G" in r.hint and "h % H_kv" in r.hint for r in failed), repr(result)
    by_name = {r.name: r for r in result.results}
    assert not by_name["query head h reads KV head h // G (3 KV heads with very different values, G = 2)"].passed
    assert run_task("03.group_query_heads", loop_over_kv_heads).passed

    def strided(w, n, new):  # heads j, j + new, j + 2 new, ... pooled together
        head_dim = w.shape[0] // n
        return w.reshape(n // new, new, head_dim, *w.shape[1:]).mean(0).reshape(new * head_dim, *w.shape[1:])

    def summed(w, n, new):
        head_dim = w.shape[0] // n
        return w.reshape(new, n // new, head_dim, *w.shape[1:]).sum(1).reshape(new * head_dim, *w.shape[1:])

    for wrong, words in [(strided, "CONSECUTIVE"), (summed, "do not sum")]:
        result = run_task("03.mean_pool_kv", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), (wrong.__name__, repr(result))
    by_name = {r.name: r for r in run_task("03.mean_pool_kv", strided).results}
    assert by_name["groups of one (new_kv_heads = n_kv_heads) return the weight unchanged"].passed

    def latent_per_head(mla, head_dim, dtype_bytes=2):
        per_layer = mla.kv_lora_rank + mla.rope_head_dim
        return mla.n_layers * per_layer * dtype_bytes * mla.n_heads, per_layer / (2 * head_dim)

    def key_only_heads(mla, head_dim, dtype_bytes=2):
        per_layer = mla.kv_lora_rank + mla.rope_head_dim
        return mla.n_layers * per_layer * dtype_bytes, per_layer / head_dim

    for wrong, words in [(latent_per_head, "shared by every head"), (key_only_heads, "a key AND a value")]:
        result = run_task("03.mla_bytes", wrong)
        failed = [r for r in result.results if not r.passed]
        assert len(failed) == len(result.results) and all(words in r.hint for r in failed), repr(result)
    assert "69,120" in run_task("03.mla_bytes", latent_per_head).results[0].message

    def same_weights(config, gpu_memory_bytes, seq_len, kv_heads, weight_bits=16, kv_dtype_bytes=2):
        free = gpu_memory_bytes - arithmetic.param_count(config) * weight_bits / 8  # the MHA model's weights
        return {h: max(0, math.floor(free / arithmetic.kv_cache_bytes(dataclasses.replace(config, n_kv_heads=h),
                                                                   seq_len, 1, kv_dtype_bytes))) for h in kv_heads}

    def sets_the_callers_config(config, gpu_memory_bytes, seq_len, kv_heads, weight_bits=16, kv_dtype_bytes=2):
        out = {}
        for h in kv_heads:
            config.n_kv_heads = h
            free = gpu_memory_bytes - arithmetic.param_count(config) * weight_bits / 8
            out[h] = max(0, math.floor(free / arithmetic.kv_cache_bytes(config, seq_len, 1, kv_dtype_bytes)))
        return out

    by_name = {r.name: r for r in run_task("03.max_batch_gqa", same_weights).results}
    shrink = by_name["the converted weights shrink too: a 7B MHA model pooled to 2 and 1 KV heads, 40 GB, 8k context"]
    assert not shrink.passed and "weights are smaller too" in shrink.hint
    first = by_name["Llama-2-7B (32 KV heads) on 80 GB at 4,096 tokens, as MHA, GQA-8, GQA-4 and MQA"]
    assert "expected 126; got 123" in first.message  # GQA-8: 126 with the smaller k/v projections, 123 without
    result = run_task("03.max_batch_gqa", sets_the_callers_config)
    assert not any(r.passed for r in result.results)
    assert all("dataclasses.replace" in r.hint for r in result.results)


def test_chapter_04_mistakes_get_hints_that_fit_them():
    import hashlib
    import random
    import struct

    def allocator(pick, count_forks=True, free_at_zero=True, check_held=True, full_when=0):
        def replay(num_blocks, ops):
            free, ref, out = list(range(num_blocks)), [0] * num_blocks, []
            for op in ops:
                if op == "allocate":
                    if len(free) <= full_when:
                        out.append("full")
                        continue
                    block = pick(free)
                    free.remove(block)
                    ref[block] = 1
                    out.append(block)
                    continue
                kind, block = op
                if check_held and ref[block] == 0:
                    out.append("error")
                elif kind == "fork":
                    ref[block] += count_forks
                    out.append(block)
                else:
                    ref[block] -= 1
                    if (ref[block] == 0 or not free_at_zero) and block not in free:
                        free.append(block)
                    out.append(None)
            return out, ref
        return replay

    rng = random.Random(0)
    for pick in (lambda f: f[0], lambda f: f[-1], min, rng.choice):  # FIFO, LIFO, lowest id, any: all fine
        assert run_task("04.block_allocator", allocator(pick)).passed
    for wrong, words in [(allocator(min, count_forks=False), "fork"), (allocator(min, free_at_zero=False), "fork"),
                         (allocator(min, check_held=False), "change nothing"),
                         (allocator(min, full_when=1), "off by one")]:
        result = run_task("04.block_allocator", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)

    def slots(f):
        return lambda table, start, n, bs: [f(table, p, bs) for p in range(start, start + n)]

    for wrong, words in [(slots(lambda t, p, bs: p), "LOGICAL block"), (slots(lambda t, p, bs: t[p // bs] + p % bs),
                         "multiply the block id by block_size"), (slots(lambda t, p, bs: t[p % bs] * bs + p // bs),
                                                                   "swapped")]:
        result = run_task("04.slot_mapping", wrong)
        failed = [r for r in result.results if not r.passed]
        assert len(failed) >= 4 and all(words in r.hint for r in failed), repr(result)

    def waste(blocks, over_used=False):
        def kv_waste(lengths, max_len, bs):
            used, slots = sum(lengths), bs * sum(blocks(n, bs) for n in lengths)
            return 1 - used / (len(lengths) * max_len), (slots - used) / used if over_used else 1 - used / slots
        return kv_waste

    for wrong, words in [(waste(lambda n, bs: n // bs), "round the blocks up"),
                         (waste(lambda n, bs: n // bs + 1), "multiple of block_size"),
                         (waste(cdiv, over_used=True), "not (allocated - used) / used")]:
        result = run_task("04.kv_waste", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)
    by_name = {r.name: r for r in run_task("04.kv_waste", waste(lambda n, bs: n // bs + 1)).results}
    assert not by_name["lengths on a block boundary (16, 32, 160) fill their last block: paged waste 0"].passed

    def hashes(parent_bytes, full_only=True):
        def prefix_hashes(ids, bs):
            out, parent = [], None
            for start in range(0, len(ids) - (bs - 1 if full_only else 0), bs):
                block = ids[start:start + bs]
                h = hashlib.sha256((parent_bytes(parent) if parent else b"") + struct.pack(f"<{len(block)}q", *block))
                out.append(h.hexdigest())
                parent = h
            return out
        return prefix_hashes

    for wrong, words in [(hashes(lambda h: b""), "chain the blocks"), (hashes(lambda h: h.hexdigest().encode()),
                         "32 digest bytes"), (hashes(lambda h: h.digest(), full_only=False), "partial last block")]:
        result = run_task("04.prefix_hashes", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)
    assert run_task("04.prefix_hashes", hashes(lambda h: h.digest())).passed
    python_hash = lambda ids, bs: [hash(tuple(ids[i:i + bs])) for i in range(0, len(ids) - bs + 1, bs)]  # noqa: E731
    result = run_task("04.prefix_hashes", python_hash)
    assert not any(r.passed for r in result.results) and all("hash()" in r.hint for r in result.results)


def test_chapter_05_mistakes_get_hints_that_fit_them():
    import math

    def step(waiting_first=False, overtake=False, chunk=True, watermark=True, running_blocks=True, count_running=True,
             list_zero=False):
        def schedule_step(running, waiting, token_budget, max_num_seqs, free_blocks, block_size, watermark_blocks):
            state = {"budget": token_budget, "free": free_blocks, "seqs": len(running) if count_running else 0}
            out = []

            def run():
                for r in running:
                    n = min(r["num_tokens"] - r["num_computed"], state["budget"])
                    if n == 0:
                        if list_zero:
                            out.append((r["id"], 0))
                        continue
                    if running_blocks:
                        state["free"] -= (cdiv(r["num_computed"] + n, block_size)
                                          - cdiv(r["num_computed"], block_size))
                    out.append((r["id"], n))
                    state["budget"] -= n

            def admit():
                for r in waiting:
                    n = min(r["num_tokens"], state["budget"])
                    needed = cdiv(n, block_size) + (watermark_blocks if watermark else 0)
                    fits = (state["seqs"] < max_num_seqs and n > 0 and needed <= state["free"]
                            and (chunk or n == r["num_tokens"]))
                    if not fits:
                        if overtake:
                            continue
                        break
                    out.append((r["id"], n))
                    state["budget"] -= n
                    state["free"] -= cdiv(n, block_size)
                    state["seqs"] += 1

            for part in ((admit, run) if waiting_first else (run, admit)):
                part()
            return out
        return schedule_step

    assert run_task("05.scheduler_step", step()).passed
    for wrong, words in [(step(waiting_first=True), "RUNNING requests first"), (step(overtake=True), "no overtaking"),
                         (step(chunk=False), "chunked prefill"), (step(watermark=False), "keep the watermark"),
                         (step(running_blocks=False), "subtract them from free_blocks"),
                         (step(count_running=False), "the running ones count"),
                         (step(list_zero=True), "not in the step")]:
        result = run_task("05.scheduler_step", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)
    by_name = {r.name: r for r in run_task("05.scheduler_step", step(overtake=True)).results}
    assert not by_name["no overtaking: the first waiting request lacks blocks, so the small one behind it waits "
                       "too"].passed
    assert "expected [('a', 1)]; got [('a', 1), ('c', 4)]" in by_name[
        "no overtaking: the first waiting request lacks blocks, so the small one behind it waits too"].message

    def admit(watermark=True, first_chunk=True, skip_cached=True, round_up=True):
        def can_admit(prompt_len, num_cached_blocks, token_budget, free_blocks, block_size, watermark_blocks):
            if token_budget <= 0:
                return False
            cached = num_cached_blocks * block_size
            tokens = prompt_len - cached
            if first_chunk:
                tokens = min(tokens, token_budget)
            if not skip_cached:
                tokens += cached
            needed = cdiv(tokens, block_size) if round_up else tokens // block_size
            return needed + (watermark_blocks if watermark else 0) <= free_blocks
        return can_admit

    assert run_task("05.admission", admit()).passed
    for wrong, words in [(admit(watermark=False), "keep the watermark free"), (admit(first_chunk=False), "FIRST CHUNK"),
                         (admit(skip_cached=False), "take nothing from free_blocks"),
                         (admit(round_up=False), "round the blocks up")]:
        result = run_task("05.admission", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)

    def good(either=False, naive_tpot=False, count_errors=False, per_request=False):
        def goodput(requests, duration_s, slo_ttft, slo_tpot):
            n = 0
            for r in requests:
                if r["output_tokens"] < 1 or (r["error"] is not None and not count_errors):
                    continue
                tpot_ok = r["tpot"] <= slo_tpot or (r["output_tokens"] < 2 and not naive_tpot)
                n += (r["ttft"] <= slo_ttft or tpot_ok) if either else (r["ttft"] <= slo_ttft and tpot_ok)
            return n / (len(requests) if per_request else duration_s)
        return goodput

    assert run_task("05.goodput", good()).passed
    for wrong, words in [(good(either=True), "BOTH SLOs"), (good(naive_tpot=True), "one-token answer has no TPOT"),
                         (good(count_errors=True), "ended in an error"), (good(per_request=True), "per SECOND")]:
        result = run_task("05.goodput", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)
    message = {r.name: r for r in run_task("05.goodput", good(either=True)).results}[
        "5 requests in 10 s: 3 meet both SLOs, one misses the TTFT, one the TPOT -> 0.3 requests/s"].message
    assert "expected 0.3 requests/s (3 good); got 0.5" in message

    def steps(static_ideal=False, round_robin=False):
        def batching_steps(lengths, b):
            static = (cdiv(sum(lengths), b) if static_ideal
                      else sum(max(lengths[i:i + b]) for i in range(0, len(lengths), b)))
            slots = [0] * b
            for i, n in enumerate(lengths):
                j = i % b if round_robin else slots.index(min(slots))
                slots[j] += n
            return static, max(slots)
        return batching_steps

    assert run_task("05.static_vs_continuous", steps()).passed
    for wrong, words in [(steps(static_ideal=True), "LONGEST member"), (steps(round_robin=True), "frees FIRST")]:
        result = run_task("05.static_vs_continuous", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)
    assert math.isclose(get_task("05.goodput").reference([], 1.0, 1.0, 0.1), 0.0)


def test_chapter_06_mistakes_get_hints_that_fit_them():
    def failed_hints_say(task_id, wrong, words, skip=()):
        result = run_task(task_id, wrong)
        failed = [r for r in result.results if not r.passed and r.name not in skip]
        assert failed and all(words in r.hint for r in failed), repr(result)
        return result

    def absmax(stat="absmax", qmax=127, rounding="round", guard=True, per_tensor=False):
        def absmax_int8(w):
            w = w.float()
            size = w.abs() if stat == "absmax" else w
            top = size.amax().expand(w.shape[0], 1) if per_tensor else size.amax(dim=1, keepdim=True)
            scale = top / qmax
            if guard:
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            v = w / scale
            q = torch.floor(v + 0.5) if rounding == "half_up" else torch.round(v)
            return q.clamp(-127, 127).to(torch.int8), scale
        return absmax_int8

    assert run_task("06.absmax_int8", absmax()).passed
    failed_hints_say("06.absmax_int8", absmax(stat="max"), "largest MAGNITUDE")
    failed_hints_say("06.absmax_int8", absmax(qmax=128), "not 128")
    failed_hints_say("06.absmax_int8", absmax(per_tensor=True), "OUTPUT CHANNEL",
                     skip=("an all-zero row gets codes 0 and a finite scale (no 0 / 0)",))
    result = failed_hints_say("06.absmax_int8", absmax(rounding="half_up"), "rounds to the EVEN one")
    assert sum(not r.passed for r in result.results) == 1  # only the ties differ
    result = failed_hints_say("06.absmax_int8", absmax(guard=False), "all-zero row")
    assert "got scale 0" in result.results[3].message

    def int4(lo_with_zero=True, levels=15, clamp=True, pack="low_even", round_zero=True):
        def int4_quantize(w, group_size=128):
            rows, cols = w.shape
            g = w.float().reshape(rows, cols // group_size, group_size)
            lo, hi = g.amin(-1), g.amax(-1)
            if lo_with_zero:
                lo, hi = lo.clamp(max=0), hi.clamp(min=0)
            s = (hi - lo) / levels
            s = torch.where(s > 0, s, torch.ones_like(s))
            z = torch.round(-lo / s) if round_zero else -lo / s
            q = torch.round(g / s[..., None]) + z[..., None]
            if clamp:
                q = q.clamp(0, 15)
            q = q.reshape(rows, cols).to(torch.uint8)
            low, high = (q[:, 0::2], q[:, 1::2]) if pack == "low_even" else (q[:, 1::2], q[:, 0::2])
            return low | (high << 4), s, z
        return int4_quantize

    assert run_task("06.int4_pack", int4()).passed
    failed_hints_say("06.int4_pack", int4(pack="high_even"), "LOW nibble")
    failed_hints_say("06.int4_pack", int4(levels=16), "15 steps")
    failed_hints_say("06.int4_pack", int4(round_zero=False), "round the zero point")
    result = failed_hints_say("06.int4_pack", int4(clamp=False), "clamp the codes to 0..15")
    assert [r.passed for r in result.results] == [True, True, False, True]  # only the tie at the top reaches 16
    result = failed_hints_say("06.int4_pack", int4(lo_with_zero=False), "contain 0.0 exactly")
    assert "scale of row 0, group 0" in result.results[1].message

    book = NF4_CODEBOOK

    def nf4(kind="nearest"):
        def nf4_index(x):
            x = x.float()
            if kind == "linear":
                return torch.round((x + 1) * 7.5).to(torch.uint8)
            if kind == "next_up":
                return torch.bucketize(x, book).to(torch.uint8)
            nearest = (x[..., None] - book).abs().argmin(-1)  # int64
            return nearest if kind == "int64" else nearest.to(torch.uint8)
        return nf4_index

    assert run_task("06.nf4_lookup", nf4()).passed
    failed_hints_say("06.nf4_lookup", nf4("linear"), "not evenly spaced")
    failed_hints_say("06.nf4_lookup", nf4("next_up"), "not the next one up")
    failed_hints_say("06.nf4_lookup", nf4("int64"), "torch.uint8")

    def column(divide=True, from_j=False, in_place=True, sign=-1):
        def gptq_column(W, U, j, scale, zero, bits):
            w = W[:, j].clone()
            if zero is None:
                qmax = 2 ** (bits - 1) - 1
                q = torch.round(w / scale).clamp(-qmax, qmax)
                dequantized = q * scale
            else:
                q = (torch.round(w / scale) + zero).clamp(0, 2**bits - 1)
                dequantized = (q - zero) * scale
            err = (w - dequantized) / (U[j, j] if divide else 1)
            target, first = (W if in_place else W.clone()), (j if from_j else j + 1)
            target[:, first:] += sign * err[:, None] * U[j, first:]
            return q, err
        return gptq_column

    assert run_task("06.gptq_column", column()).passed
    loop = ("your step as GPTQ's inner loop on a 64 x 256 layer with correlated inputs (4 bits, groups of 64): the "
            "layer's output error matches minillm.quant.gptq.gptq_quantize's, far below round-to-nearest's")
    for wrong, words in [(column(divide=False), "divide the error by U[j, j]"), (column(sign=1), "SUBTRACT"),
                         (column(in_place=False), "in place")]:
        result = failed_hints_say("06.gptq_column", wrong, words)
        assert loop in [r.name for r in result.results if not r.passed], repr(result)
    result = failed_hints_say("06.gptq_column", column(from_j=True), "leave column j as it was")
    assert result.results[3].passed  # harmless in the loop: column j is not read again

    def rtn(expand="interleave", dequant="q-z"):
        int4_quantize = int4()

        def rtn_int4(w, group_size=128):
            packed, scale, zero = int4_quantize(w, group_size)
            q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).float()
            if expand == "tile":
                s, z = scale.repeat(1, group_size), zero.repeat(1, group_size)
            else:
                s, z = scale.repeat_interleave(group_size, dim=1), zero.repeat_interleave(group_size, dim=1)
            return (q + z) * s if dequant == "q+z" else (q - z) * s
        return rtn_int4

    assert run_task("06.quantized_ppl", rtn()).passed
    result = failed_hints_say("06.quantized_ppl", rtn(expand="tile"), "repeat_interleave")
    assert "expected 46.559 +- 0.009 (minillm's int4; fp32: 46.345); got 49.630" in result.results[3].message
    failed_hints_say("06.quantized_ppl", rtn(dequant="q+z"), "SUBTRACT")
    result = failed_hints_say("06.quantized_ppl", lambda w, group_size=128: w.clone(), "(nearly) the unquantised",
                              skip=[r.name for r in get_task("06.quantized_ppl").tests[:3]])
    example = torch.tensor([[-0.3, 0.0, 0.44, 1.2, -0.04, 0.7, 0.3, 0.9]])
    assert torch.equal(get_task("06.int4_pack").reference(example, 8)[0],
                       torch.tensor([[0x30, 0xF7, 0xA3, 0xC6]], dtype=torch.uint8))


def test_chapter_07_mistakes_get_hints_that_fit_them():
    def res(normalise=True, swapped=False, clamp=True):
        def residual(p, q):
            r = q - p if swapped else p - q
            if clamp:
                r = r.clamp(min=0)
            return r / r.sum() if normalise else r
        return residual

    assert run_task("07.residual", res()).passed
    for wrong, words in [(res(normalise=False), "renormalise"), (res(swapped=True), "TARGET minus the drafter"),
                         (res(clamp=False, normalise=False), "clamp at zero"),
                         (res(clamp=False), "clamp at zero BEFORE")]:
        result = run_task("07.residual", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)

    def verify(accept="rule", bonus=True, resample="residual"):
        def verify_step(p, q, draft_tokens, uniforms, residual_sample):
            for i, x in enumerate(draft_tokens):
                ok = {"rule": uniforms[i] < p[i, x] / q[i, x], "always": True, "p>q": p[i, x] > q[i, x]}[accept]
                if not ok:
                    r = (p[i] - q[i]).clamp(min=0)
                    dist = r / r.sum() if resample == "residual" else p[i]
                    return list(draft_tokens[:i]) + [residual_sample(dist)]
            return list(draft_tokens) + ([residual_sample(p[len(draft_tokens)])] if bonus else [])
        return verify_step

    assert run_task("07.verify_step", verify()).passed
    lossless = "lossless: 20,000 steps with real random draws (V = 5, k = 2); each emitted position's tokens follow " \
               "the target's row, and the step lengths the acceptance rates (chi-squared, p = 0.001)"
    for wrong, words in [(verify(accept="always"), "Keeping every draft"), (verify(accept="p>q"), "the test is random"),
                         (verify(bonus=False), "the bonus"), (verify(resample="p"), "not from p[i]")]:
        result = run_task("07.verify_step", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)
        assert lossless in [r.name for r in failed], repr(result)
        if words == "not from p[i]":
            assert "expected [0, 0], after residual_sample(residual(p[1], q[1])); got [0, 1], after " \
                   "residual_sample(p[1])" in failed[0].message

    def tokens(kind="right"):
        def expected_tokens(alpha, k):
            if kind == "no_plus_one":
                return (1 - alpha ** k) / (1 - alpha) if alpha != 1 else float(k)
            if kind == "linear":
                return alpha * k
            if kind == "no_special_case":
                return (1 - alpha ** (k + 1)) / (1 - alpha)
            return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        return expected_tokens

    assert run_task("07.expected_tokens", tokens()).passed
    for wrong, words in [(tokens("no_plus_one"), "k + 1 terms"), (tokens("linear"), "stops at the first rejection")]:
        result = run_task("07.expected_tokens", wrong)
        failed = [r for r in result.results if not r.passed and not r.name.startswith("alpha = 1:")]  # both give k
        assert failed and all(words in r.hint for r in failed), repr(result)
    by_name = {r.name: r for r in run_task("07.expected_tokens", tokens("no_special_case")).results}
    alpha_one = by_name["alpha = 1: every draft passes, k + 1 tokens (no division by zero)"]
    assert not alpha_one.passed and "ZeroDivisionError" in alpha_one.message and "0/0" in alpha_one.hint
    assert sum(not r.passed for r in by_name.values()) == 1

    def best(kind="right"):
        def best_k(alpha, draft_cost, max_k=16):
            e = tokens()
            if kind == "max":
                return max_k
            if kind == "no_cost":
                return max(range(1, max_k + 1), key=lambda k: e(alpha, k))
            return max(range(1, max_k + 1), key=lambda k: e(alpha, k) / (1 + k * draft_cost))
        return best_k

    assert run_task("07.best_k", best()).passed
    for wrong in (best("max"), best("no_cost")):
        result = run_task("07.best_k", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all("the draft is not free" in r.hint for r in failed), repr(result)
    assert math.isclose(get_task("07.expected_tokens").reference(0.8, 4), 3.3616)
    assert torch.allclose(get_task("07.residual").reference(torch.tensor([0.5, 0.3, 0.1, 0.1]),
                                                            torch.tensor([0.2, 0.2, 0.4, 0.2])),
                          torch.tensor([0.75, 0.25, 0.0, 0.0]))


def test_chapter_08_mistakes_get_hints_that_fit_them():
    import torch.nn.functional as F

    def partials(kind="right"):
        def mlp_partials(x, w_gate, w_up, w_down, world):
            gates, ups = w_gate.chunk(world, 0), w_up.chunk(world, 0)
            downs = w_down.chunk(world, 0 if kind == "down_rows" else 1)
            if kind == "strided":
                gates, ups = [w_gate[r::world] for r in range(world)], [w_up[r::world] for r in range(world)]
                downs = [w_down[:, r::world] for r in range(world)]
            out = [(F.silu(x @ g.T) * (x @ u.T)) @ d.T for g, u, d in zip(gates, ups, downs)]
            if kind == "summed":
                return sum(out)
            return [p / world for p in out] if kind == "averaged" else out
        return mlp_partials

    assert run_task("08.split_mlp", partials()).passed
    for wrong, words in [(partials("averaged"), "do not divide by world"), (partials("strided"), "CONTIGUOUS"),
                         (partials("down_rows"), "matching COLUMNS of w_down"), (partials("summed"), "BEFORE")]:
        result = run_task("08.split_mlp", wrong)
        failed = [r for r in result.results if not r.passed]
        assert len(failed) == len(result.results) and all(words in r.hint for r in failed), repr(result)

    def transfer(kind="right"):
        def kv_transfer_s(tokens, layers, heads, head_dim, dtype_bytes, gbit, latency_s=0.0):
            kv = (1 if kind == "no_values" else 2) * layers * tokens * heads * head_dim * dtype_bytes
            return kv / (gbit * 1e9 / (1 if kind == "bits_as_bytes" else 8)) + latency_s
        return kv_transfer_s

    assert run_task("08.kv_transfer", transfer()).passed
    for wrong, words in [(transfer("no_values"), "keys AND the values"), (transfer("bits_as_bytes"), "giga*bits*")]:
        result = run_task("08.kv_transfer", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)
    assert math.isclose(get_task("08.kv_transfer").reference(8192, 32, 8, 128, 2, 400.0), 0.021474836, rel_tol=1e-6)

    def timeline(period_of):
        def pipeline_timeline(p, m, steps=1, schedule="gpipe"):
            period = period_of(p, m, schedule)
            grid = [[None] * ((steps - 1) * period + m + p - 1) for _ in range(p)]
            for t in range(steps):
                for i in range(m):
                    for s in range(p):
                        grid[s][t * period + i + s] = i
            return grid
        return pipeline_timeline

    assert run_task("08.pipeline_timeline", timeline(lambda p, m, sc: m + p - 1 if sc == "gpipe" else max(m, p))).passed
    assert get_task("08.pipeline_timeline").reference(2, 2) == [[0, 1, None], [None, 0, 1]]
    for wrong, words in [(timeline(lambda p, m, sc: max(m, p)), "gpipe drains between steps"),
                         (timeline(lambda p, m, sc: m + p - 1), "ring does not drain"),
                         (timeline(lambda p, m, sc: m if sc == "ring" else m + p - 1), "with m < p stage 0 must wait")]:
        result = run_task("08.pipeline_timeline", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)

    def take(kind="right"):
        def can_take(tokens, free, block_size, running, max_seqs, watermark=0):
            if kind != "no_rows" and running >= max_seqs:
                return False
            needed = tokens // block_size if kind == "floor" else -(-tokens // block_size)
            return needed + (0 if kind == "no_watermark" else watermark) <= free
        return can_take

    assert run_task("08.can_take", take()).passed
    for wrong, words in [(take("floor"), "round the blocks UP"), (take("no_watermark"), "keep the watermark free"),
                         (take("no_rows"), "num_running")]:
        result = run_task("08.can_take", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)


def test_chapter_09_mistakes_get_hints_that_fit_them():
    def gate(kind="right"):
        def fn(results, baseline, tolerances):
            failed = []
            for task, metrics in baseline["results"].items():
                ours = results["results"].get(task, {})
                for metric, base in metrics.items():
                    if metric not in tolerances:
                        continue
                    if metric not in ours:
                        if kind != "skip_missing":
                            failed.append(f"{task}.{metric}")
                        continue
                    better, tol, rel = tolerances[metric]
                    allowed = tol * abs(base) if rel else tol
                    if kind != "no_noise":
                        se = max(metrics.get(f"{metric}_stderr") or 0.0, ours.get(f"{metric}_stderr") or 0.0)
                        allowed = max(allowed, 2 * se)
                    worse = base - ours[metric] if (better == "higher" or kind == "one_way") else ours[metric] - base
                    if worse > allowed:
                        failed.append(f"{task}.{metric}")
            return sorted(failed)
        return fn

    assert run_task("09.gate_decision", gate()).passed
    for wrong, words in [(gate("no_noise"), "widen the tolerance by the noise"),
                         (gate("skip_missing"), "must FAIL"), (gate("one_way"), "LOWER is better")]:
        result = run_task("09.gate_decision", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)

    from minillm import arithmetic

    def prices(kind="right"):
        def token_prices(config, gpu, usd, prompt_len, context_len, batch, n_gpus=1):
            per_s = usd * (1 if kind == "one_gpu_paid" else n_gpus) / 3600
            pre = arithmetic.prefill_time(config, gpu, prompt_len, n_gpus=n_gpus).time_s / prompt_len
            dec = arithmetic.decode_step_time(config, gpu, context_len, batch, n_gpus=n_gpus).time_s
            return per_s * pre * 1e6, per_s * dec / (1 if kind == "per_step" else batch) * 1e6
        return token_prices

    assert run_task("09.token_prices", prices()).passed
    ref = get_task("09.token_prices").reference("llama-3-8b", "h100-sxm", 2.5, 2048, 2048, 64, 1)
    assert 5 < ref[1] / ref[0] < 20, ref  # output costs several times input at batch 64, from the roofline alone
    for wrong, words in [(prices("one_gpu_paid"), "pay for every GPU"), (prices("per_step"), "divide the step's cost")]:
        result = run_task("09.token_prices", wrong)
        failed = [r for r in result.results if not r.passed]
        assert failed and all(words in r.hint for r in failed), repr(result)

    def runbook(order):
        def diagnose(before, after):
            if after["tpot_ms"] <= 1.1 * before["tpot_ms"]:
                return "none"
            checks = {"preemptions": after["preemptions"] > before["preemptions"],
                      "kv fallback": before["attention"] == "paged kernel" and after["attention"] != "paged kernel",
                      "speculation at high batch": after["speculative"] and after["mean_batch"] >= 32,
                      "constrained decoding": after["constrained_share"] - before["constrained_share"] >= 0.1,
                      "batch grew": after["mean_batch"] >= 1.25 * before["mean_batch"]}
            return next((cause for cause in order if checks[cause]), "unknown")
        return diagnose

    right = ["preemptions", "kv fallback", "speculation at high batch", "constrained decoding", "batch grew"]
    assert run_task("09.diagnose", runbook(right)).passed
    result = run_task("09.diagnose", runbook(["batch grew"] + right[:-1]))
    failed = [r for r in result.results if not r.passed]
    assert failed and all("check the batch LAST" in r.hint for r in failed), repr(result)
