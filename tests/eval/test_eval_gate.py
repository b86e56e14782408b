"""minillm.eval's tasks and gate (chapter 09): lm-eval-style log-likelihood requests, multiple choice and exact
match over local task files, agreement with a reference model, and `minillm eval --baseline` failing on a
regression and passing a harmless change."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

import minillm
from minillm.checkpoints import save
from minillm.cli import main as cli_main
from minillm.decoding.llm import LLM
from minillm.eval import Task, agreement, compare, exact_match, format_table, load_task, loglikelihood, multiple_choice
from minillm.sampler.sampling import SamplingParams


@pytest.fixture(scope="module")
def shipped():
    torch.manual_seed(0)
    return minillm.load(minillm.DEFAULT_MODEL)


def test_loglikelihood_is_the_sum_of_the_continuations_token_logprobs(shipped):
    model, tok = shipped
    context, continuation = "ROMEO.\nBut soft, what light", " through yonder window breaks"
    [(ll, greedy)] = loglikelihood(model, tok, [(context, continuation)])
    ids = tok.encode(context + continuation)
    n_context = len(tok.encode(context))
    logprobs = F.log_softmax(model(torch.tensor([ids[:-1]])).float(), dim=-1)[0]
    by_hand = sum(logprobs[i - 1, ids[i]].item() for i in range(n_context, len(ids)))
    assert ll == pytest.approx(by_hand, abs=1e-4)
    assert greedy == all(logprobs[i - 1].argmax().item() == ids[i] for i in range(n_context, len(ids)))
    # batching and padding change nothing: the same request beside a longer one
    [(again, _), _] = loglikelihood(model, tok, [(context, continuation), ("KING." * 30, " Ay")], batch_size=2)
    assert again == pytest.approx(ll, abs=1e-4)


def test_loglikelihood_is_greedy_for_what_greedy_decoding_produces(shipped):
    model, tok = shipped
    out = LLM(model, tok).generate(["JULIET.\n"], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    [(_, greedy)] = loglikelihood(model, tok, [("JULIET.\n", out.text)])
    assert greedy, "the greedy continuation must score as greedy"


def test_multiple_choice_prefers_the_true_line_to_noise(shipped, tmp_path):
    model, tok = shipped
    docs = [{"context": "ROMEO.\nBut soft, what light through yonder window breaks?\n",
             "choices": ["zq xj vvk qqq", "It is the east, and Juliet is the sun."], "gold": 1},
            {"context": "HAMLET.\nTo be, or not to be, that is the question:\n",
             "choices": ["Whether 'tis nobler in the mind to suffer", "kkk zzzz xq jjj"], "gold": 0}]
    path = tmp_path / "mini.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    scores = multiple_choice(model, tok, load_task(path))
    assert scores["acc"] == 1.0 and scores["acc_norm"] == 1.0 and scores["docs"] == 2
    flipped = Task("flipped", "multiple_choice", [dict(d, gold=1 - d["gold"]) for d in docs])
    assert multiple_choice(model, tok, flipped)["acc"] == 0.0


def test_exact_match_scores_the_first_words_of_the_engines_greedy_text(shipped):
    model, tok = shipped
    llm = LLM(model, tok)
    context = "KING HENRY.\nOnce more unto the breach, dear friends, once"
    text = llm.generate([context], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].text
    word = text.split()[0]
    docs = [{"context": context, "answer": word, "until": ["\n"]},
            {"context": context, "answer": word + "xyz", "until": ["\n"]},
            {"context": context, "answer": " ".join(text.split()[:2]), "until": ["\n"]}]
    scores = exact_match(llm, Task("em", "exact_match", docs), max_tokens=6)
    assert scores["exact_match"] == pytest.approx(2 / 3)
    assert scores["exact_match_stderr"] == pytest.approx(math.sqrt(2 / 9 / 2))


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1: not JSON"),
    ('{"context": "a", "choices": ["x", "y"], "gold": 2}', "'gold' must be the index of the right choice, 0..1"),
    ('{"context": "a", "choices": ["x"], "gold": 0}', "at least 2 strings"),
    ('{"context": "a"}', "needs 'choices' and 'gold'"),
    ('{"context": "a", "answer": "b", "until": [""]}', "non-empty stop strings"),
])
def test_a_bad_task_file_names_the_line_and_the_problem(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_task(path)
    with pytest.raises(FileNotFoundError, match="the book's tasks are: json_objects, last_word, next_line"):
        load_task("no_such_task")


def test_the_book_tasks_load(shipped):
    mc, em = load_task("next_line"), load_task("last_word")
    assert (mc.kind, em.kind, len(mc.docs), len(em.docs)) == ("multiple_choice", "exact_match", 200, 200)


def test_agreement_is_perfect_against_itself_and_drops_for_a_damaged_copy(shipped):
    model, tok = shipped
    ids = torch.tensor(tok.encode("ROMEO.\nBut soft, what light through yonder window breaks? " * 12))
    same = agreement(model, model, ids, seq_len=64, max_windows=2)
    assert same["top1_agreement"] == 1.0 and same["kl_divergence"] == pytest.approx(0.0, abs=1e-6)
    damaged = copy.deepcopy(model)
    with torch.no_grad():
        for layer in damaged.layers:
            layer.mlp.down_proj.weight.mul_(0.3)
    moved = agreement(damaged, model, ids, seq_len=64, max_windows=2)
    assert moved["top1_agreement"] < 1.0 and moved["kl_divergence"] > 0.01


def results(acc: float, ppl: float, stderr: float = 0.0) -> dict:
    return {"results": {"next_line": {"acc": acc, "acc_stderr": stderr}, "perplexity": {"perplexity": ppl}}}


def test_compare_fails_only_what_moved_past_its_tolerance():
    rows = compare(results(0.50, 47.0), results(0.55, 46.0))
    verdict = {(r.task, r.metric): r.failed for r in rows}
    assert verdict == {("next_line", "acc"): True, ("perplexity", "perplexity"): True}
    assert not any(r.failed for r in compare(results(0.54, 46.5), results(0.55, 46.0)))
    # a noisy metric: two standard errors of 0.03 allow a drop of 0.06
    assert not any(r.failed for r in compare(results(0.50, 46.0, 0.03), results(0.55, 46.0, 0.03)))
    assert "FAIL" in format_table(rows) and "next_line" in format_table(rows)
    with pytest.raises(ValueError, match="the baseline has task 'other'"):
        compare(results(0.5, 46.0), {"results": {"other": {"acc": 0.5}}})


def test_minillm_eval_gate_passes_the_model_and_fails_a_damaged_checkpoint(shipped, tmp_path, capsys):
    """The gate on the shipped model against itself passes; a copy with its MLP outputs scaled down fails it."""
    model, tok = shipped
    base = tmp_path / "base.json"
    tasks = ["--tasks", "perplexity", "next_line", "--limit", "40"]
    assert cli_main(["eval", *tasks, "--out", str(base)]) == 0
    saved = json.loads(base.read_text())
    assert set(saved["results"]) == {"perplexity", "next_line"} and saved["results"]["next_line"]["docs"] == 40
    capsys.readouterr()
    assert cli_main(["eval", *tasks, "--quant", "int8", "--baseline", str(base)]) == 0
    assert "passed: 3 metric(s)" in capsys.readouterr().out
    damaged = copy.deepcopy(model)
    with torch.no_grad():
        for layer in damaged.layers:
            layer.mlp.down_proj.weight.mul_(0.5)
    save(damaged, tmp_path / "damaged", tok)
    code = cli_main(["eval", "--model", str(tmp_path / "damaged"), *tasks, "--baseline", str(base)])
    out = capsys.readouterr().out
    assert code == 1 and "FAIL" in out and "perplexity" in out
    assert cli_main(["eval", *tasks, "--group-size", "channel"]) == 1
    assert "--group-size sets int4's groups: use it with --quant int4" in capsys.readouterr().err
