"""The exercise machinery: check(), the registered tasks, exercise generation and `minillm grade`."""

from __future__ import annotations

import json
import time

import nbformat
import pytest
import torch

from minillm.book import load_book
from minillm.cli import main
from minillm.grading import TASKS, check, get_task, register_task, run_task
from minillm.grading.check import GRADE_OUT_ENV, MismatchError, summarise_exception
from minillm.grading.exercises import ExerciseError, blank_source, exercise_text, make_exercise
from minillm.grading.grade import grade_notebook
from minillm.grading.tasks import ch00


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


def test_check_prints_one_line_per_test_and_records_for_the_grader(tmp_path, monkeypatch, capsys):
    out = tmp_path / "checks.jsonl"
    monkeypatch.setenv(GRADE_OUT_ENV, str(out))
    check("00.rms_norm", ch00.reference_rms_norm)
    check("00.rotary", _blank)
    text = capsys.readouterr().out
    assert "00.rms_norm: 4/4 tests passed" in text and text.count("PASS") == 4
    assert "00.rotary: 0/4 tests passed" in text and text.count("FAIL") == 4
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["passed"]) for r in records] == [("00.rms_norm", True), ("00.rotary", False)]
    html = run_task("00.rotary", _blank)._repr_html_()
    assert "#cf222e" in html and "<table>" in html and "not implemented yet" in html


def test_unknown_task_id_names_the_known_ones():
    with pytest.raises(KeyError, match="00.rms_norm"):
        run_task("00.rmsnorm", _blank)


def test_summarise_exception_of_not_implemented():
    assert summarise_exception(NotImplementedError("do X")) == "not implemented yet: do X"


def test_expect_helpers_report_shape_and_type():
    from minillm.grading.check import expect_close, expect_equal

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
    for chapter in book.written():
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


# ---- minillm grade ----------------------------------------------------------------------------------


def _notebook(path, *sources):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


IMPORTS = "from minillm.grading import check\nfrom minillm.grading.tasks import ch00"


def test_grade_reports_crash_missing_task_and_partial_credit(tmp_path):
    crashed = _notebook(
        tmp_path / "alice.ipynb",
        IMPORTS,
        'check("00.param_count", ch00.reference_param_count)',
        "1 / 0",
        'check("00.rms_norm", ch00.reference_rms_norm)',
    )
    grade = grade_notebook(crashed, timeout_s=120, chapter_id="00")
    result = {t.id: t for t in grade.tasks}
    assert result["00.param_count"].passed
    assert not result["00.rms_norm"].passed and "ZeroDivisionError" in result["00.rms_norm"].reason
    assert "not reached" in result["00.rotary"].reason
    assert (grade.passed, grade.total) == (1, 3)

    partial = _notebook(tmp_path / "00_the_model.ipynb", IMPORTS, 'check("00.rotary", ch00.reference_apply_rope)',
                        'check("00.rms_norm", lambda x, w, eps: x)')
    grade = grade_notebook(partial, timeout_s=120)  # the chapter comes from the file name
    result = {t.id: t for t in grade.tasks}
    assert result["00.rotary"].passed and not result["00.rms_norm"].passed
    assert "no check('00.param_count'" in result["00.param_count"].reason


def test_grade_survives_a_hang_garbage_and_a_missing_file(tmp_path):
    hang = _notebook(tmp_path / "hang.ipynb", IMPORTS, 'check("00.rotary", ch00.reference_apply_rope)',
                     "import time\ntime.sleep(600)")
    start = time.perf_counter()
    grade = grade_notebook(hang, timeout_s=15, chapter_id="00")
    assert time.perf_counter() - start < 60
    result = {t.id: t for t in grade.tasks}
    assert result["00.rotary"].passed  # checked before the hang
    assert "time limit" in result["00.rms_norm"].reason

    garbage = tmp_path / "garbage.ipynb"
    garbage.write_text("{ this is not json")
    grade = grade_notebook(garbage, timeout_s=60, chapter_id="00")
    assert grade.total == 3 and grade.passed == 0 and "not a readable notebook" in grade.tasks[0].reason

    missing = grade_notebook(tmp_path / "nope.ipynb", chapter_id="00")
    assert missing.total == 3 and "not found" in missing.tasks[0].reason

    unknown = _notebook(tmp_path / "mystery.ipynb", "x = 1")
    grade = grade_notebook(unknown, timeout_s=60)
    assert grade.passed == 0 and "--chapter" in grade.tasks[0].reason


def test_grade_command_grades_the_solution_and_the_blank_exercise(tmp_path, capsys):
    book = load_book()
    chapter = book.chapter("00")
    exercise = tmp_path / "00_the_model.ipynb"
    nbformat.write(make_exercise(book.root / chapter.solution), exercise)
    out_json, out_csv = tmp_path / "grades.json", tmp_path / "grades.csv"
    code = main(["grade", str(book.root / chapter.solution), str(exercise), "--json", str(out_json),
                 "--csv", str(out_csv)])
    assert code == 0
    grades = json.loads(out_json.read_text())
    assert [g["passed"] for g in grades] == [3, 0] and [g["total"] for g in grades] == [3, 3]
    assert set(grades[0]) == {"notebook", "tasks", "passed", "total"}
    assert set(grades[0]["tasks"][0]) == {"id", "passed", "reason"}
    assert all("not implemented yet" in t["reason"] for t in grades[1]["tasks"])
    rows = out_csv.read_text().splitlines()
    assert rows[0] == "notebook,passed,total,00.param_count,00.rms_norm,00.rotary"
    assert rows[1].endswith(",3,3,1,1,1") and rows[2].endswith(",0,3,0,0,0")
    assert "total: 3/6 tasks passed in 2 notebooks" in capsys.readouterr().out


def test_grade_command_rejects_an_unknown_chapter(capsys):
    assert main(["grade", "x.ipynb", "--chapter", "42"]) == 1
    assert "no chapter '42'" in capsys.readouterr().err
