"""Parallel sampling (`minillm.decoding.parallel_sampling.generate_n`) and test-time scaling
(`minillm.decoding.inference_scaling`).

`generate_n` batches best_of rows after one prefill. Row i must sample the tokens `generate` samples with
seed + i: the generators are the same, and the logits agree to a few 1e-6 (a batched matmul adds in
another order than a one-row one, so they are not bitwise equal), far too little to move a sampled token
here. The tests compare tokens, text and finish reasons exactly, log-probabilities within 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest

import minillm
from minillm import SamplingParams
from minillm.decoding.generation import GenerationOutput
from minillm.decoding.inference_scaling import (
    METHODS,
    NEXT_SPEAKER_EXCERPTS,
    Excerpt,
    best_of_n,
    find_excerpts,
    is_plausible,
    mean_logprob,
    parse_speaker,
    self_consistency,
    success_curve,
)
from minillm.decoding.parallel_sampling import generate_n

PROMPT = "ROMEO.\nBut soft, what light"


@pytest.fixture(scope="module")
def shipped():
    return minillm.load("shakespeare-11m")


def output(text: str = "", logprobs: list[float] | None = None, finish_reason: str = "stop") -> GenerationOutput:
    """A hand-made candidate."""
    return GenerationOutput([0], [5] * len(logprobs or [0]), text, finish_reason, [], logprobs)


# ------------------------------------------------------------------ self-consistency
def test_task_3_self_consistency_majority_and_share():
    """The most common answer wins; its share counts every answer, unparsed ones (None) included."""
    assert self_consistency(["IAGO", "CASSIO", "IAGO"]) == ("IAGO", pytest.approx(2 / 3))
    assert self_consistency(["IAGO", None, None, "CASSIO", "CASSIO"]) == ("CASSIO", 0.4), (
        "None does not vote, even when it is the most common entry, but it counts in the share"
    )
    assert self_consistency([7]) == (7, 1.0)


def test_task_3_self_consistency_ties_go_to_the_first_occurrence():
    """Two answers with two votes each: the one seen first wins."""
    assert self_consistency(["CASSIO", "IAGO", "IAGO", "CASSIO"]) == ("CASSIO", 0.5)
    assert self_consistency(["IAGO", "CASSIO", "CASSIO", "IAGO"]) == ("IAGO", 0.5)
    assert self_consistency([None, "B", "A", "A", "B"]) == ("B", 0.4)


def test_self_consistency_without_votes():
    assert self_consistency([None, None]) == (None, 0.0)
    with pytest.raises(ValueError, match="at least one answer"):
        self_consistency([])


# ------------------------------------------------------------------ best-of-N
def test_task_3_best_of_n_with_mean_logprob():
    """mean_logprob prefers the higher mean, not the higher sum: a long candidate is not penalised for length."""
    short = output("a", [-1.0])  # sum -1, mean -1
    long = output("b", [-0.5, -0.5, -0.5, -0.5])  # sum -2, mean -0.5
    assert mean_logprob(long) == -0.5
    assert best_of_n([short, long], mean_logprob) is long


def test_best_of_n_with_a_verifier_and_ties():
    """A bool verifier picks the first passing candidate (the first overall if none pass); ties keep the first."""
    cands = ["x", "yes-1", "yes-2"]
    assert best_of_n(cands, lambda c: c.startswith("yes")) == "yes-1"
    assert best_of_n(cands, lambda c: False) == "x"
    assert best_of_n(cands, lambda c: 1.0) == "x"
    assert best_of_n(cands, lambda c: (c.startswith("yes"), c.endswith("2"))) == "yes-2", "tuples compare in order"
    with pytest.raises(ValueError, match="at least one candidate"):
        best_of_n([], len)


def test_mean_logprob_needs_logprobs():
    with pytest.raises(ValueError, match="logprobs=0"):
        mean_logprob(output("a", None))


# ------------------------------------------------------------------ generate_n
def test_task_4_generate_n_rows_equal_generate_with_seed_plus_i(shipped):
    """n = best_of = 6: each output is what generate() gives with seed + index, with penalties, top-k and a stop.

    The stop string "\\n" ends rows at different steps, so finished rows leave the batch while others run on.
    """
    model, tok = shipped
    params = SamplingParams(temperature=1.2, top_k=50, repetition_penalty=1.2, max_tokens=20, stop=["\n"],
                            seed=11, n=6, logprobs=2)
    outs = generate_n(model, PROMPT, params, tok)
    assert sorted(o.index for o in outs) == list(range(6)), "n = best_of must return every row once"
    assert len({len(o.token_ids) for o in outs}) > 1, "expected rows to finish at different lengths"
    for o in outs:
        ref = minillm.generate(model, PROMPT, dataclasses.replace(params, seed=11 + o.index, n=1), tok)
        assert o.token_ids == ref.token_ids, (
            f"row {o.index} must sample what generate(seed={11 + o.index}) samples: {ref.token_ids}, got {o.token_ids}"
        )
        assert (o.text, o.finish_reason) == (ref.text, ref.finish_reason)
        assert o.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        assert [sorted(t) for t in o.top_logprobs] == [sorted(t) for t in ref.top_logprobs]
        assert o.cumulative_logprob == pytest.approx(sum(o.logprobs))
        assert len(o.token_times_s) == len(o.token_ids)


def test_task_4_generate_n_orders_by_cumulative_logprob_and_keeps_the_best_n(shipped):
    """best_of=8, n=3: the 3 rows with the highest cumulative log-probability of all 8, best first."""
    model, tok = shipped
    every = generate_n(model, PROMPT, SamplingParams(max_tokens=8, seed=3, n=8), tok)
    cumulative = [o.cumulative_logprob for o in every]
    assert cumulative == sorted(cumulative, reverse=True), f"expected best first, got {cumulative}"
    best = generate_n(model, PROMPT, SamplingParams(max_tokens=8, seed=3, n=3, best_of=8), tok)
    assert [o.index for o in best] == [o.index for o in every[:3]], (
        f"expected the top 3 rows {[o.index for o in every[:3]]} of 8, got {[o.index for o in best]}"
    )
    assert [o.token_ids for o in best] == [o.token_ids for o in every[:3]]
    assert best[0].top_logprobs is None, "top_logprobs only with params.logprobs"


def test_generate_n_seeds(shipped):
    """The same seed gives the same completions; another seed other ones."""
    model, tok = shipped

    def run(seed):
        return [(o.index, o.token_ids) for o in generate_n(model, PROMPT, SamplingParams(max_tokens=6, seed=seed, n=4),
                                                           tok)]

    assert run(5) == run(5)
    assert run(5) != run(6)


# ------------------------------------------------------------------ the next-speaker task
def test_parse_speaker_and_the_rule_verifier():
    """A candidate names a speaker only as "\\nNAME" cut at the stop ".\\n"; the verifier wants a speaker of
    the excerpt other than the last one."""
    excerpt = Excerpt("IAGO.\nHo!\n\nCASSIO.\nWhat?\n\nOTHELLO.\nPeace.\n", "IAGO")
    assert excerpt.speakers == ["IAGO", "CASSIO", "OTHELLO"]
    assert parse_speaker(output("\nIAGO")) == "IAGO"
    assert parse_speaker(output("\nFIRST CITIZEN")) == "FIRST CITIZEN"
    assert parse_speaker(output("\nIAGO", finish_reason="length")) is None, "a name cut by max_tokens is no answer"
    assert parse_speaker(output("\nBut soft")) is None
    assert [is_plausible(excerpt, output(f"\n{n}")) for n in ("IAGO", "CASSIO", "OTHELLO", "ROMEO")] == [
        True, True, False, False,
    ]


def test_shipped_excerpts_are_well_formed():
    """40 excerpts of four turns; the next speaker spoke in the excerpt but not last."""
    assert len(set(NEXT_SPEAKER_EXCERPTS)) == 40
    for e in NEXT_SPEAKER_EXCERPTS:
        assert len(e.speakers) == 4 and e.prompt.endswith("\n") and not e.prompt.endswith("\n\n")
        assert e.speaker in e.speakers and e.speaker != e.speakers[-1], e


def test_find_excerpts_on_a_small_corpus():
    """Only a turn preceded by four speaker turns in the same scene, with three speakers, qualifies."""
    turns = ["AL.\nOne.", "BO.\nTwo.", "CY.\nThree.", "BO.\nFour.", "AL.\nFive.", "[Exit BO.]", "CY.\nSix."]
    corpus = "SCENE I.\n\n" + "\n\n".join(turns) + "\n\nSCENE II.\n\n" + "\n\n".join(turns[:5])
    found = find_excerpts(corpus, count=2)
    assert {e.speaker for e in found} == {"AL"}, "AL (fifth turn) qualifies in each scene; CY follows a stage direction"
    assert found[0].prompt == "AL.\nOne.\n\nBO.\nTwo.\n\nCY.\nThree.\n\nBO.\nFour.\n"


def test_success_curve_small_is_deterministic_and_pass_at_n_grows(shipped):
    """On 3 excerpts with 4 candidates each: the same numbers twice, every method equal at N = 1, and
    pass@N never below any other method or below itself at a smaller N."""
    model, tok = shipped
    curve = success_curve(model, tok, NEXT_SPEAKER_EXCERPTS[:3], ns=(1, 2, 4), pool=4)
    assert curve == success_curve(model, tok, NEXT_SPEAKER_EXCERPTS[:3], ns=(1, 2, 4), pool=4)
    assert set(curve) == set(METHODS)
    assert len({curve[m][1] for m in METHODS}) == 1, f"with one candidate there is nothing to choose: {curve}"
    passes = [curve["pass@N"][n] for n in (1, 2, 4)]
    assert passes == sorted(passes), f"pass@N must not fall as N grows: {passes}"
    assert all(curve["pass@N"][n] >= curve[m][n] for m in METHODS for n in (1, 2, 4))
    with pytest.raises(ValueError, match="every N must be in"):
        success_curve(model, tok, NEXT_SPEAKER_EXCERPTS[:1], ns=(8,), pool=4)


def test_generate_refuses_several_completions(shipped):
    """generate returns one completion: n or best_of > 1 is an error that points to generate_n."""
    model, tok = shipped
    for params in (SamplingParams(n=2), SamplingParams(best_of=3)):
        with pytest.raises(ValueError, match="use minillm.generate_n"):
            minillm.generate(model, PROMPT, params, tok)
        with pytest.raises(ValueError, match="use minillm.generate_n"):
            minillm.generate_stream(model, PROMPT, params, tok)
