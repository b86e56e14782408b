"""Beam search (`minillm.decoding.beam`): the one-step selection, KV cache reordering, and parity with transformers.

The parity tests run minillm's and transformers' beam search on the shipped shakespeare-11m (a standard
Llama folder that transformers loads offline). Its own EOS (</s>) is almost never generated, so most cases
make the newline token (and in some the comma) the EOS: hypotheses then finish at different lengths, and
the length penalty and the early-stopping rules decide the outcome.
"""

from __future__ import annotations

import pytest
import torch

import minillm
from minillm.arithmetic import cdiv
from minillm.checkpoints import SHIPPED_MODELS_DIR
from minillm.decoding.beam import BeamSearch, beam_search, beam_step

MODEL = "shakespeare-11m"
PROMPTS = {
    "romeo": "ROMEO.\nBut soft, what light",
    "citizen": "FIRST CITIZEN.\nBefore we proceed any further, hear me speak.\n\nALL.\n",
    "henry": "KING HENRY.\n",
}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def shipped():
    return minillm.load(MODEL)


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_MODELS_DIR / MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def special_ids(shipped):
    _, tok = shipped
    newline, comma = tok.encode("\n", add_special_tokens=False), tok.encode(",", add_special_tokens=False)
    assert len(newline) == len(comma) == 1, "expected '\\n' and ',' to be single tokens"
    return {"newline": newline, "newline+comma": newline + comma, "model": None}


# ------------------------------------------------------------------ beam_step
def test_task_1_beam_step_ranks_every_beam_token_pair():
    """2 beams, V = 3: candidates are beam score + token logprob over all 6 pairs, best 2 * 2 = 4 first."""
    logprobs = torch.tensor([[-0.1, -2.0, -3.0], [-0.5, -0.7, -4.0]]).log_softmax(-1)
    beam_scores = torch.tensor([-1.0, -0.2])
    scores, parents, tokens = beam_step(logprobs, beam_scores, num_beams=2)
    total = (beam_scores[:, None] + logprobs).reshape(-1)
    order = total.argsort(descending=True)[:4]
    assert scores.shape == parents.shape == tokens.shape == (4,), "expected 2 * num_beams = 4 candidates"
    assert torch.equal(parents * 3 + tokens, order), (
        f"expected the pairs (beam, token) of the 4 best sums {[(int(i) // 3, int(i) % 3) for i in order]}, "
        f"got {list(zip(parents.tolist(), tokens.tolist()))}"
    )
    assert torch.allclose(scores, total[order]), "next_scores must be beam score + token logprob"
    assert (scores[:-1] >= scores[1:]).all(), "candidates must come best first"


def test_task_1_beam_step_lets_a_strong_beam_supply_every_candidate():
    """A beam far ahead wins all candidates; the other beam supplies none."""
    logprobs = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    scores, parents, tokens = beam_step(logprobs, torch.tensor([0.0, -10.0]), num_beams=2)
    assert parents.tolist() == [0, 0, 0, 0], f"beam 1 is 10 nats behind and should supply nothing, got {parents}"
    assert tokens.tolist() == [0, 1, 2, 3]


def test_beam_step_first_step_uses_only_beam_zero():
    """At the first step every beam is the prompt; beam scores [0, -1e9, ...] keep copies from competing."""
    logprobs = torch.randn(3, 50).log_softmax(-1).expand(3, 50)
    _, parents, tokens = beam_step(logprobs, torch.tensor([0.0, -1e9, -1e9]), num_beams=3)
    assert parents.tolist() == [0] * 6, f"expected all 6 candidates from beam 0, got parents {parents.tolist()}"
    assert len(set(tokens.tolist())) == 6, "expected 6 different tokens, not the same ones from each copy"


def test_beam_step_num_candidates():
    """num_candidates overrides 2 * num_beams (3 * num_beams with two EOS ids, as transformers keeps)."""
    scores, _, _ = beam_step(torch.randn(2, 10).log_softmax(-1), torch.zeros(2), num_beams=2, num_candidates=6)
    assert scores.shape == (6,)


# ------------------------------------------------------------------ the KV cache rows
def test_beams_share_their_common_blocks_through_the_paged_cache(shipped):
    """The beams fork the prompt's blocks and each other's: far fewer blocks than a copy per beam, and a
    finished search leaves exactly the blocks its last beams hold (none leaked)."""
    model, tok = shipped
    ids = tok.encode(PROMPTS["citizen"])  # 20 tokens: a full block of 16 and a partial one
    search = BeamSearch(model, ids, num_beams=4, max_tokens=MAX_TOKENS)
    allocator, bs = search.cache.allocator, search.cache.block_size
    copied = 4 * cdiv(len(ids), bs)  # a contiguous cache holds the prompt once per beam
    assert allocator.num_used_blocks == cdiv(len(ids), bs), "after the prefill the 4 beams share one prompt"
    while search.step():
        used = allocator.num_used_blocks
        unique = {b for i in search.beam_ids for b in search.cache.block_tables[i].block_ids}
        assert used == len(unique), f"{used} blocks in use but the beams' tables hold {len(unique)}: a leak"
        assert used < copied, f"{used} blocks for 4 beams: the prompt's blocks should be shared, not copied"
        for i in search.beam_ids:  # every table holds a count of the blocks it refers to
            assert all(allocator.ref_counts[b] >= 1 for b in search.cache.block_tables[i].block_ids)


def test_cache_reordering_keeps_each_beam_logits_equal_to_a_fresh_forward(shipped, special_ids):
    """At every step, each running beam's next-token logits equal a no-cache forward of prompt + its tokens.

    With newline as EOS, beams end and get replaced, so the new beams' parents are not 0, 1, 2, 3 in order:
    the cache rows really move.
    """
    model, tok = shipped
    ids = tok.encode(PROMPTS["romeo"])
    search = BeamSearch(model, ids, num_beams=4, max_tokens=MAX_TOKENS, eos=special_ids["newline"])
    moved, steps, going = False, 0, True
    while going:
        with torch.inference_mode():
            for i, beam in enumerate(search.beams):
                fresh = model(torch.tensor([ids + beam]))[0, -1]
                assert torch.allclose(search.logits[i], fresh, atol=1e-4), (
                    f"step {steps}, beam {i}: cached logits differ from a fresh forward by "
                    f"{(search.logits[i] - fresh).abs().max():.2e}; were the cache rows reordered to the parents?"
                )
        before = [list(b) for b in search.beams]
        going = search.step()
        steps += 1
        if going:
            moved |= any(b[:-1] != before[i] for i, b in enumerate(search.beams))
    assert moved, "expected at least one step where a beam continues a different row than its own"
    assert steps >= 3


# ------------------------------------------------------------------ parity with transformers
def hf_beam_search(hf_model, ids, num_beams, length_penalty, early_stopping, n, eos):
    """transformers' beam search: the generated ids of each returned sequence (cut after EOS) and their scores."""
    x = torch.tensor([ids])
    kwargs = {"eos_token_id": eos, "pad_token_id": eos[0]} if eos else {"pad_token_id": 1}
    out = hf_model.generate(
        x, attention_mask=torch.ones_like(x), num_beams=num_beams, do_sample=False, max_new_tokens=MAX_TOKENS,
        length_penalty=length_penalty, early_stopping=early_stopping, num_return_sequences=n,
        output_scores=True, return_dict_in_generate=True, **kwargs,
    )
    ends = set(eos or [1])
    sequences = []
    for seq in out.sequences[:, len(ids):].tolist():
        cut = next((i + 1 for i, t in enumerate(seq) if t in ends), len(seq))
        sequences.append(seq[:cut])
    return sequences, out.sequences_scores.tolist()


PARITY_CASES = [  # prompt, num_beams, eos, length_penalty, early_stopping, n
    ("romeo", 4, "newline", 1.0, False, 4),
    ("romeo", 4, "newline", 1.0, True, 4),
    ("romeo", 4, "newline", 1.0, "never", 4),
    ("romeo", 4, "newline", 2.0, True, 2),
    ("romeo", 2, "newline", 2.0, "never", 2),
    ("citizen", 4, "newline+comma", 1.0, False, 4),
    ("citizen", 4, "newline+comma", 1.0, True, 4),
    ("citizen", 4, "newline+comma", 1.0, "never", 3),
    ("henry", 4, "newline", -1.0, False, 4),
    ("henry", 2, "model", 1.0, False, 2),
    ("henry", 4, "model", 0.0, False, 1),
]


@pytest.mark.parametrize(
    "prompt, num_beams, eos, length_penalty, early_stopping, n",
    PARITY_CASES,
    ids=[f"{p}-beams{b}-eos_{e}-lp{lp}-es_{es}-n{n}" for p, b, e, lp, es, n in PARITY_CASES],
)
def test_task_2_beam_search_matches_transformers(
    shipped, hf_model, special_ids, prompt, num_beams, eos, length_penalty, early_stopping, n
):
    """Same hypotheses, in the same order, as transformers' generate(num_beams=...); scores within 1e-4."""
    model, tok = shipped
    ids = tok.encode(PROMPTS[prompt])
    eos_ids = special_ids[eos]
    expected, expected_scores = hf_beam_search(hf_model, ids, num_beams, length_penalty, early_stopping, n, eos_ids)
    got = beam_search(model, ids, num_beams, MAX_TOKENS, length_penalty, early_stopping, n, tok, eos_ids)
    assert [h.token_ids for h in got] == expected, (
        f"transformers returned {expected}, minillm {[h.token_ids for h in got]}"
    )
    scores = [h.score for h in got]
    assert scores == pytest.approx(expected_scores, abs=1e-4), (
        f"scores {scores} differ from transformers' sequences_scores {expected_scores}"
    )
    if eos != "model":  # the cases that make EOS reachable must really finish some hypothesis on it
        assert any(h.finish_reason == "stop" for h in got), "expected some hypothesis to end on EOS"


def test_n_best_are_ordered_and_scored_by_the_length_penalty(shipped, special_ids):
    """n hypotheses, best score first; score = sum_logprob / generated_length ** length_penalty; text decoded."""
    model, tok = shipped
    hyps = beam_search(model, PROMPTS["romeo"], 4, MAX_TOKENS, 1.5, False, 3, tok, special_ids["newline"])
    assert len(hyps) == 3
    scores = [h.score for h in hyps]
    assert scores == sorted(scores, reverse=True), f"expected the best score first, got {scores}"
    for h in hyps:
        assert h.score == pytest.approx(h.sum_logprob / len(h.token_ids) ** 1.5, rel=1e-6)
        assert h.text == tok.decode(h.token_ids)
        assert h.finish_reason == ("stop" if h.token_ids[-1] in special_ids["newline"] else "length")
    assert len({h.score for h in hyps}) > 1 or len({len(h.token_ids) for h in hyps}) > 1


def test_one_beam_without_eos_is_greedy(shipped):
    """num_beams=1 keeps the single best continuation: greedy decoding."""
    model, tok = shipped
    greedy = minillm.generate(model, PROMPTS["henry"], minillm.SamplingParams(temperature=0, max_tokens=10,
                                                                                ignore_eos=True), tok)
    (beam,) = beam_search(model, PROMPTS["henry"], 1, 10, tokenizer=tok, eos_token_ids=[])
    assert beam.token_ids == greedy.token_ids, f"1 beam {beam.token_ids} != greedy {greedy.token_ids}"
    assert beam.sum_logprob <= 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_beams": 0}, "num_beams must be >= 1"),
        ({"n": 5}, r"n must be in \[1, num_beams\] = \[1, 4\]"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"early_stopping": "sometimes"}, 'early_stopping must be True, False or "never"'),
    ],
)
def test_bad_arguments_are_refused_with_a_message(shipped, kwargs, message):
    model, tok = shipped
    args = {"num_beams": 4, "max_tokens": 4, "n": 1, "early_stopping": False} | kwargs
    with pytest.raises(ValueError, match=message):
        beam_search(model, "ROMEO.\n", tokenizer=tok, **args)
