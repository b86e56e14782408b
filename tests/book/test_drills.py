"""The drill bank: every drill valid, every numeric answer recomputed, the checker, the notebook card,
the book page, the `minillm drill` quiz and its timed mock interview (`--mock`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

import minillm.book.grading.drills as drills_module
from minillm.book.grading.drills import (
    KINDS,
    LEVELS,
    MOCK_TARGET_S,
    Drill,
    DrillError,
    add_drill_command,
    check_answer,
    compute_answer,
    drill,
    get_drill,
    history_path,
    load_drills,
    load_history,
    mock_selection,
    render_markdown,
)

ALL = load_drills()
NUMERIC = [d for d in ALL if d.kind == "numeric"]
CHAPTERS = [f"{i:02d}" for i in range(10)]
ROOT = Path(__file__).resolve().parents[2]  # tests/<room>/ is two folders below the root


# ------------------------------------------------------------------------------------ the bank
def test_task_bank_size_and_coverage():
    assert len(ALL) >= 150, f"the bank holds {len(ALL)} drills; it needs at least 150"
    per_chapter = {c: sum(d.chapter == c for d in ALL) for c in CHAPTERS}
    thin = {c: n for c, n in per_chapter.items() if n < 4}
    assert not thin, f"every chapter needs at least 4 drills; these have fewer: {thin}"


TWELVE_OR_MORE = CHAPTERS


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_task_every_chapter_has_12_drills_at_every_level_and_kind(chapter):
    mine = [d for d in ALL if d.chapter == chapter]
    if chapter in TWELVE_OR_MORE:
        assert len(mine) >= 12, f"chapter {chapter} has {len(mine)} drills; an interview bank needs at least 12"
    levels = {lv: sum(d.level == lv for d in mine) for lv in LEVELS}
    assert all(levels.values()), f"chapter {chapter} needs drills at every level; it has {levels}"
    kinds = {k: sum(d.kind == k for d in mine) for k in KINDS}
    assert all(kinds.values()), f"chapter {chapter} needs numeric, choice and open drills; it has {kinds}"


def test_task_ids_are_unique_and_prefixed_by_their_chapter():
    ids = [d.id for d in ALL]
    assert len(ids) == len(set(ids))
    for d in ALL:
        assert d.id.startswith(d.chapter + "."), f"{d.id} is in chapter {d.chapter}"
        assert d.source.startswith(d.chapter + "_"), f"{d.id} lives in {d.source}"


@pytest.mark.parametrize("d", ALL, ids=lambda d: d.id)
def test_task_every_drill_has_its_fields(d: Drill):
    assert d.level in LEVELS and d.question and d.explanation and d.tags and d.chapter_title
    if d.kind == "numeric":
        assert d.unit and 0 < d.tolerance < 1 and d.compute and isinstance(d.answer, float)
    elif d.kind == "choice":
        assert len(d.choices) >= 2 and d.answer in d.choices
    else:
        assert d.key_points and isinstance(d.answer, str)


@pytest.mark.parametrize("d", NUMERIC, ids=lambda d: d.id)
def test_task_numeric_answer_equals_its_computation(d: Drill):
    computed = compute_answer(d)
    err = abs(d.answer - computed) / abs(computed)
    limit = min(d.tolerance, 0.005)
    assert err <= limit, (
        f"{d.id}: stored answer {d.answer} {d.unit} but {d.compute['function']} gives {computed:.6g} "
        f"({err:.2%} off; store it to within {limit:.1%})"
    )


def test_book_yml_lists_existing_drills():
    book = ROOT / "book.yml"
    if not book.exists():
        pytest.skip("no book.yml in this checkout")
    ids = {d.id for d in ALL}
    for chapter in yaml.safe_load(book.read_text())["chapters"]:
        for did in chapter.get("drills") or []:
            assert did in ids, f"book.yml chapter {chapter['id']} lists unknown drill {did}"
            assert did.startswith(chapter["id"] + ".")


# ------------------------------------------------------------------------------------ filters
def test_filters():
    assert {d.chapter for d in load_drills(chapter="02")} == {"02"}
    assert load_drills(chapter=2) == load_drills(chapter="02")
    assert all("speculative" in d.tags for d in load_drills(tag="speculative"))
    assert {d.level for d in load_drills(level="expert")} == {"expert"}
    assert load_drills(chapter="00", tag="speculative") == []


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"chapter": "12"}, "no drills for chapter 12; chapters with drills: 00, 01"),
        ({"chapter": "two"}, "chapter must be a number"),
        ({"tag": "kv"}, "unknown tag 'kv'"),
        ({"level": "easy"}, "unknown level 'easy'; the levels are: intermediate, advanced, expert"),
    ],
)
def test_unknown_filters_raise_a_clear_error(kwargs, message):
    with pytest.raises(DrillError, match=message):
        load_drills(**kwargs)


def test_unknown_drill_id_suggests_close_ones():
    with pytest.raises(DrillError, match="did you mean 02.kv-per-token-llama2-7b"):
        get_drill("02.kv-per-token-llama2-7")


# ------------------------------------------------------------------------------------ malformed files
GOOD = {"id": "02.x", "level": "advanced", "kind": "numeric", "tags": ["memory"], "question": "Q?",
        "answer": 1.0, "unit": "GB", "tolerance": 0.02, "explanation": "E.",
        "compute": {"function": "minillm.arithmetic.weight_bytes", "args": {"config_or_n_params": 1e9}}}


def write_bank(folder: Path, drills: list[dict], name: str = "02_kv_cache.yaml", chapter: str = "02") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(yaml.safe_dump({"chapter": chapter, "title": "T", "drills": drills}))
    return folder


@pytest.mark.parametrize(
    "change,field,problem",
    [
        ({"level": "easy"}, "level", "must be one of"),
        ({"kind": "essay"}, "kind", "must be one of"),
        ({"answer": "lots"}, "answer", "must be a number"),
        ({"tolerance": 5}, "tolerance", "relative tolerance"),
        ({"unit": None}, "unit", "missing (required for a numeric drill)"),
        ({"unit": " "}, "unit", "must name"),
        ({"tags": []}, "tags", "non-empty list"),
        ({"chapter": "03"}, "chapter", "the file holds chapter '02'"),
        ({"colour": "red"}, "colour", "unknown field"),
        ({"choices": ["a", "b"]}, "choices", "does not belong to a numeric drill"),
        ({"compute": {"function": "os.system", "args": {}}}, "compute", "dotted path inside minillm"),
        ({"compute": {"function": "minillm.arithmetic.weight_bytes", "args": {"x": "80e9"}}}, "compute", "signed"),
        ({"compute": {**GOOD["compute"], "divide_by": {"function": "os.getcwd"}}}, "compute",
         "in `divide_by`: `function` must be a dotted path inside minillm"),
        ({"compute": {**GOOD["compute"], "divide_by": {**GOOD["compute"], "divide_by": GOOD["compute"]}}},
         "compute", "in `divide_by`: unknown key 'divide_by'"),
        ({"compute": {**GOOD["compute"], "divide_by": 2}}, "compute", "in `divide_by`: must be a mapping"),
    ],
)
def test_task_malformed_drill_names_file_id_and_field(tmp_path, change, field, problem):
    raw = {**GOOD, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    folder = write_bank(tmp_path, [raw])
    with pytest.raises(DrillError) as info:
        load_drills(directory=folder)
    message = str(info.value)
    assert "02_kv_cache.yaml" in message and "'02.x'" in message and f"field {field!r}" in message
    assert problem in message


def test_malformed_files(tmp_path):
    with pytest.raises(DrillError, match="drill '03.x': field 'id'.*the chapter id, a dot"):
        load_drills(directory=write_bank(tmp_path / "a", [{**GOOD, "id": "03.x"}]))
    with pytest.raises(DrillError, match="field 'answer': must be the text of one of the choices"):
        bad = {k: v for k, v in GOOD.items() if k not in ("unit", "tolerance", "compute")}
        load_drills(directory=write_bank(tmp_path / "b", [{**bad, "kind": "choice", "choices": ["x", "y"],
                                                           "answer": "z"}]))
    with pytest.raises(DrillError, match="also used in"):
        folder = write_bank(tmp_path / "c", [GOOD])
        write_bank(folder, [GOOD], name="02_again.yaml")
        load_drills(directory=folder)
    with pytest.raises(DrillError, match="must be '04'"):
        load_drills(directory=write_bank(tmp_path / "d", [GOOD], name="04_paging.yaml"))
    with pytest.raises(DrillError, match="drill files are named NN_<slug>.yaml"):
        load_drills(directory=write_bank(tmp_path / "e", [GOOD], name="kv.yaml"))
    with pytest.raises(DrillError, match="no drill files"):
        load_drills(directory=tmp_path / "empty")


# ------------------------------------------------------------------------------------ checking answers
@pytest.mark.parametrize("d", ALL, ids=lambda d: d.id)
def test_task_check_answer_accepts_right_and_rejects_wrong(d: Drill):
    if d.kind == "numeric":
        assert check_answer(d, d.answer)[0]
        assert check_answer(d, f"{d.answer} {d.unit}")[0]
        assert check_answer(d, str(d.answer * (1 + d.tolerance / 2)))[0]
        ok, message = check_answer(d, d.answer * (1 + 3 * d.tolerance))
        assert not ok and "the answer is" in message
    elif d.kind == "choice":
        assert check_answer(d, d.answer_letter)[0]
        assert check_answer(d, d.answer_letter.lower())[0]
        assert check_answer(d, d.answer)[0]
        wrong = next(c for c in d.choices if c != d.answer)
        ok, message = check_answer(d, wrong)
        assert not ok and d.answer in message
    else:
        ok, message = check_answer(d, "my answer")
        assert ok and all(p in message for p in d.key_points)
        assert not check_answer(d, "  ")[0]


def test_numeric_answers_in_other_forms():
    d = get_drill("02.kv-llama2-7b-4k-b8")  # 17.18 GB
    for response in ("17.18", "17.2 GB", "17.18GB", "17,179,869,184 bytes", "16 GiB", "1.718e1", 17.18):
        assert check_answer(d, response)[0], response
    for response in ("17.18 MB", "8.6", "1.7e10"):
        assert not check_answer(d, response)[0], response
    ok, message = check_answer(d, "about a lot")
    assert not ok and "answer with a number in GB" in message
    assert check_answer(get_drill("02.decode-step-h100"), "0.0042 s")[0]
    assert check_answer(get_drill("02.cost-per-million"), "$0.46")[0]


def test_choice_answers_in_other_forms():
    d = get_drill("01.top-p-min-p-count")  # B. 3 and 4
    for response in ("B", "b", "(b)", "B)", "b.", "3 and 4", "  3 AND 4. "):
        assert check_answer(d, response)[0], response
    ok, message = check_answer(d, "E")
    assert not ok and "there is no choice E; answer with a letter A-D" in message
    ok, message = check_answer(d, "five")
    assert not ok and "a letter A-D or the text of one choice" in message
    ok, message = check_answer(d, "A")
    assert not ok and "the answer is B. 3 and 4 (you chose A)" in message


def test_task_compute_divide_by_is_a_ratio_of_two_calls(tmp_path):
    ratio = {**GOOD, "answer": 2.0, "unit": "x", "compute": {
        "function": "minillm.arithmetic.weight_bytes", "args": {"config_or_n_params": 1e9},
        "divide_by": {"function": "minillm.arithmetic.weight_bytes", "args": {"config_or_n_params": 1e9},
                      "scale": 0.5}}}
    (d,) = load_drills(directory=write_bank(tmp_path, [ratio]))
    assert compute_answer(d) == pytest.approx(2.0)
    page = render_markdown([d])
    assert "(minillm.arithmetic.weight_bytes(config_or_n_params=1000000000.0)) ÷ (" in page and "× 0.5)" in page
    real = get_drill("09.output-vs-input-gpu-time")
    assert "divide_by" in real.compute and "prefill_time" in drill(real.id)._repr_html_()


def test_compute_answer_refuses_other_kinds():
    with pytest.raises(DrillError, match="only numeric drills"):
        compute_answer(get_drill("01.top-p-min-p-count"))


# ------------------------------------------------------------------------------------ notebooks and the book
def test_drill_card_hides_the_answer_behind_a_reveal(capsys):
    card = drill("01.top-p-min-p-count")
    page = card._repr_html_()
    question_part, _, hidden = page.partition("<details><summary>Reveal the answer</summary>")
    assert "top_p = 0.75" in question_part and "<li>3 and 4</li>" in question_part
    assert "Answer:</strong> B. 3 and 4" in hidden and "</details>" in hidden
    assert "Answer:" not in question_part
    assert "B. 3 and 4" in repr(card) and card.drill.explanation[:40] not in repr(card) and "Answer:" not in repr(card)
    card.check("b")
    assert capsys.readouterr().out.startswith("✓ Right: B. 3 and 4")
    card.check("a")
    assert capsys.readouterr().out.startswith("✗ Not quite")
    numeric = drill("02.kv-llama2-7b-4k-b8")._repr_html_()
    assert "Answer in GB" in numeric and "minillm.arithmetic.kv_cache_bytes(config=&#x27;llama-2-7b&#x27;" in numeric


def test_render_markdown_groups_by_chapter_with_reveals():
    page = render_markdown(ALL)
    headings = [line for line in page.splitlines() if line.startswith("## Chapter")]
    assert [h[11:13] for h in headings] == CHAPTERS
    assert "## Chapter 02: The physics of inference and the KV cache" in page
    assert page.count("<details>") == len(ALL) == page.count("</details>")
    assert page.count("<summary>Reveal the answer</summary>") == len(ALL)
    block = page.split("### 02.cost-per-million", 1)[1].split("</details>", 1)[0]
    assert "**Answer:** 0.463 USD" in block.split("<summary>", 1)[1]
    assert "$" not in page.replace("\\$", "")  # no bare dollar signs for MyST's dollarmath


# ------------------------------------------------------------------------------------ the quiz
@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run_drill(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="minillm")
    add_drill_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["drill", *argv])
    return args.func(args)


def test_task_scripted_quiz_scores_persists_and_asks_missed_first(home, tmp_path, capsys):
    answers = tmp_path / "answers.yaml"
    answers.write_text(yaml.safe_dump({
        "01.top-p-min-p-count": "B",             # right
        "02.kv-per-token-llama2-7b": "524288 bytes",  # right
        "03.why-gqa": "A",                         # wrong (the answer is B)
        "03.mqa-risk": True,                       # open: self-assessed as covered
    }))
    assert run_drill(["--answers", str(answers)]) == 0
    out = capsys.readouterr().out
    assert "Score: 3/4 (75%)" in out and "✗ Not quite" in out
    assert history_path() == home / "drill_history.json"
    history = load_history()
    assert history["03.why-gqa"]["last"] == "wrong" and history["01.top-p-min-p-count"]["last"] == "right"
    assert json.loads((home / "drill_history.json").read_text())["version"] == 1

    assert run_drill(["--answers", str(answers), "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "[1/1] 03.why-gqa" in out, "the drill missed last time must be asked first"
    assert load_history()["03.why-gqa"]["attempts"] == 2


def test_scripted_quiz_respects_filters_and_json(home, tmp_path, capsys):
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({"07.best-k": 6, "02.ridge-point-h100": "300"}))
    assert run_drill(["--answers", str(answers), "--chapter", "7"]) == 0
    out = capsys.readouterr().out
    assert "07.best-k" in out and "02.ridge" not in out and "Score: 1/1" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--chapter", "42"], "no drills for chapter 42"),
        (["--tag", "nope"], "unknown tag 'nope'"),
        (["--level", "easy"], "unknown level 'easy'"),
        (["--chapter", "00", "--tag", "speculative"], "no drills match --chapter 00 --tag speculative"),
        (["-n", "0"], "-n must be at least 1"),
        (["--answers", "missing.yaml"], "answers file missing.yaml not found"),
        (["--seed", "3"], "--seed and --report belong to a mock interview; add --mock"),
        (["--mock", "-n", "0"], "-n must be at least 1"),
    ],
)
def test_bad_quiz_options_are_a_one_line_error(home, argv, message, capsys):
    assert run_drill(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("minillm drill: error: ") and message in err and err.count("\n") == 1


def test_answers_file_with_unknown_ids(home, tmp_path, capsys):
    answers = tmp_path / "a.yaml"
    answers.write_text("02.no-such-drill: 3\n")
    assert run_drill(["--answers", str(answers)]) == 1
    assert "unknown drill id(s): 02.no-such-drill" in capsys.readouterr().err


def test_interactive_quiz(home, monkeypatch, capsys):
    replies = iter(["B", "7", "b", "q"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(replies))
    # Chapter 01 in bank order: temperature-limits (C), top-p-min-p-count (B), min-p-idea, ...
    assert run_drill(["--chapter", "01", "-n", "4"]) == 0
    out = capsys.readouterr().out
    assert "[1/4] 01.temperature-limits" in out and "Score: 1/2 (50%)" in out
    history = load_history()
    assert history["01.temperature-limits"]["last"] == "wrong"
    assert history["01.top-p-min-p-count"]["last"] == "right"  # "7" was not a choice: asked again
    assert "01.min-p-idea" not in history  # the quiz stopped at "q"


def test_interactive_open_drill_is_self_assessed(home, monkeypatch, capsys):
    replies = iter(["B", "all heads share one KV head; replicated under TP", "y"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(replies))
    assert run_drill(["--chapter", "03", "--level", "advanced", "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "compare your answer with the key points" in out and "Score: 2/2" in out
    assert load_history()["03.mqa-risk"]["last"] == "right"


def test_interactive_quiz_ends_cleanly_on_eof(home, monkeypatch, capsys):
    def eof(prompt=""):
        raise EOFError

    monkeypatch.setattr("builtins.input", eof)
    assert run_drill(["--chapter", "02"]) == 0
    assert "No drills answered." in capsys.readouterr().out


def test_history_location_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("MINILLM_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert history_path() == tmp_path / "xdg" / "minillm" / "drill_history.json"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert history_path() == tmp_path / "h" / ".local" / "share" / "minillm" / "drill_history.json"


def test_corrupt_history_is_a_clear_error(home, tmp_path, capsys):
    home.mkdir(parents=True)
    (home / "drill_history.json").write_text("{not json")
    answers = tmp_path / "a.yaml"
    answers.write_text("07.best-k: 6\n")
    assert run_drill(["--answers", str(answers)]) == 1
    assert "delete it to start afresh" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ the mock interview
@pytest.mark.parametrize("seed", range(20))
def test_task_mock_selection_spreads_chapters_and_levels(seed):
    picked = mock_selection(ALL, 10, seed=seed)
    assert len({d.id for d in picked}) == 10
    assert len({d.chapter for d in picked}) == 10, "ten questions from a ten-chapter bank must cover every chapter"
    levels = [d.level for d in picked]
    counts = [levels.count(lv) for lv in LEVELS]
    assert max(counts) - min(counts) <= 1, f"the levels must be as even as possible; got {dict(zip(LEVELS, counts))}"
    assert levels == sorted(levels, key=LEVELS.index), "a mock interview asks the easier levels first"
    assert mock_selection(ALL, 10, seed=seed) == picked, "the same seed must give the same interview"


def test_mock_selection_edges():
    assert mock_selection(ALL, 10, seed=0) != mock_selection(ALL, 10, seed=1)
    assert len(mock_selection(ALL[:3], 10, seed=0)) == 3
    with pytest.raises(DrillError, match="at least 1 question"):
        mock_selection(ALL, 0)


def fake_clock(monkeypatch, times):
    ticks = iter(times)
    monkeypatch.setattr(drills_module, "_clock", lambda: next(ticks))


def test_task_mock_interview_from_a_file_reports_by_level_tag_and_time(home, tmp_path, monkeypatch, capsys):
    answers = tmp_path / "answers.yaml"
    answers.write_text(yaml.safe_dump({
        "01.temperature-limits": "C",              # intermediate, right
        "00.weights-llama3-8b-bf16": 16.06,        # intermediate, right
        "03.why-gqa": "A",                         # advanced, wrong
        "01.top-p-min-p-count": "B",               # advanced, right
        "03.tpot-after-gqa": "D",                  # expert, right
        "00.usable-context": False,                # expert, open: self-assessed as missed
    }))
    fake_clock(monkeypatch, [150.0 * i for i in range(12)])  # every answer takes 150 s
    report_file = tmp_path / "report.json"
    assert run_drill(["--mock", "--answers", str(answers), "--seed", "5", "--report", str(report_file)]) == 0
    out = capsys.readouterr().out
    assert "Mock interview: 6 questions from 3 chapters (2 intermediate, 2 advanced, 2 expert), seed 5" in out
    asked = [line.split()[1] for line in out.splitlines() if line.startswith("[") and "/6]" in line]
    assert [get_drill(i).level for i in asked] == ["intermediate"] * 2 + ["advanced"] * 2 + ["expert"] * 2
    assert "Mock interview report: 4/6 right (67%) in 15 min 00 s." in out
    by_level = out.split("By level:")[1].split("By tag")[0]
    assert "intermediate  2/2" in by_level and "advanced      1/2" in by_level and "expert        1/2" in by_level
    by_tag = out.split("By tag (weakest first):")[1].split("By chapter:")[0].strip().splitlines()
    assert by_tag[0].split()[:2] == ["evaluation", "0/1"] and any(t.split()[:2] == ["gqa", "1/2"] for t in by_tag)
    assert out.count("(over the 2 min 00 s target)") == 2, "150 s is over the intermediate target only"
    assert "Practise next: minillm drill --tag evaluation" in out
    assert "Repeat this interview: minillm drill --mock --seed 5 -n 6" in out

    report = json.loads(report_file.read_text())
    assert report["version"] == 1 and report["seed"] == 5 and report["count"] == report["planned"] == 6
    assert report["right"] == 4 and report["seconds"] == pytest.approx(900)
    assert report["by_level"] == {lv: {"asked": 2, "right": r, "seconds": 300.0}
                                  for lv, r in zip(LEVELS, (2, 1, 1))}
    assert report["by_tag"]["sampling"] == {"asked": 2, "right": 2, "seconds": 300.0}
    assert report["by_chapter"]["03"] == {"asked": 2, "right": 1, "seconds": 300.0}
    assert [q["seconds"] for q in report["questions"]] == [150.0] * 6
    assert [q["over_target"] for q in report["questions"]] == [True, True] + [False] * 4
    assert load_history()["03.why-gqa"]["last"] == "wrong", "a mock interview also updates the drill history"


def reply_for(d: Drill) -> list[str]:
    if d.kind == "numeric":
        return [f"{d.answer} {d.unit}"]
    if d.kind == "choice":
        return [d.answer_letter]
    return ["an answer that covers the points", "y"]


def test_task_mock_interview_interactive_times_each_answer(home, monkeypatch, capsys):
    chosen = mock_selection(load_drills(chapter="01"), 3, seed=0)
    replies = iter([r for d in chosen for r in reply_for(d)])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(replies))
    fake_clock(monkeypatch, [0.0, 30.0, 1000.0, 1100.0, 2000.0, 2400.0])  # 30 s, 100 s, 400 s
    assert run_drill(["--mock", "--chapter", "01", "-n", "3", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("[") and "/3]" in line] == \
        [d.id for d in chosen]
    assert "[answered in 30 s]" in out and "[answered in 1 min 40 s]" in out and "[answered in 6 min 40 s]" in out
    assert "Mock interview report: 3/3 right (100%) in 8 min 50 s." in out
    rows = out.split("Questions:")[1].strip().splitlines()[:3]
    target = drills_module._duration(MOCK_TARGET_S[chosen[-1].level])
    assert chosen[-1].id in rows[2] and f"6 min 40 s (over the {target} target)" in rows[2]
    assert "over the" not in rows[0] + rows[1], "30 s and 100 s are within every level's target"
    assert "Practise next" not in out


def test_mock_interview_stops_early_and_reports_what_was_answered(home, monkeypatch, capsys):
    chosen = mock_selection(load_drills(chapter="04"), 4, seed=2)
    replies = iter([*reply_for(chosen[0]), "q"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(replies))
    fake_clock(monkeypatch, [0.0, 12.0, 20.0, 21.0])
    assert run_drill(["--mock", "--chapter", "04", "-n", "4", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert "Mock interview report: 1/1 right (100%) in 12 s; 3 of 4 questions not reached." in out

    def eof(prompt=""):
        raise EOFError

    monkeypatch.setattr("builtins.input", eof)
    fake_clock(monkeypatch, [0.0, 1.0])
    assert run_drill(["--mock", "--seed", "1"]) == 0
    assert "Mock interview: no questions answered." in capsys.readouterr().out
