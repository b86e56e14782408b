"""Sampling (chapter 01): `SamplingParams` validation, the logits processors, `sample`, log-probabilities.

The processors are checked against transformers' warpers and processors on random logits without
ties, and against their contracts (never empty, minimal top-p set, monotone in the parameter, "off"
changes nothing) with hypothesis. The last tests run `generate` on the shipped 1M-parameter model.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import minillm
from minillm import SamplingParams
from minillm.sampler.sampling import (
    SampleOutput,
    apply_penalties,
    apply_repetition_penalty,
    apply_temperature,
    compute_logprobs,
    min_p_filter,
    process_logits,
    sample,
    token_counts,
    top_k_filter,
    top_p_filter,
)

PROPERTY = settings(max_examples=50, deadline=None)
SHAPES = [(1, 7), (4, 50), (3, 1000)]


def random_logits(shape: tuple[int, int], seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    """float32 logits [B, V] with no two equal values in a row (ties make the kept set ambiguous).

    A seed whose draw has a tie (rounding to float32 makes one likely at V = 1000) is skipped for the next.
    """
    g = torch.Generator().manual_seed(seed)
    while True:
        logits = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).float()
        if all(len(row.unique()) == shape[1] for row in logits):
            return logits


def kept(logits: torch.Tensor) -> torch.Tensor:
    """Which tokens a processor left in play: bool [B, V]."""
    return logits > float("-inf")


# ------------------------------------------------------------------ SamplingParams validation
BAD_PARAMS = [
    ({"temperature": -0.5}, r"temperature must be >= 0 \(0 = greedy\), got -0.5"),
    ({"temperature": float("nan")}, r"temperature must be >= 0 \(0 = greedy\), got nan; pass a finite number"),
    ({"temperature": float("inf")}, r"temperature must be >= 0 \(0 = greedy\), got inf; pass a finite number"),
    ({"temperature": True}, r"temperature must be a number >= 0 \(0 = greedy\), got True \(bool\)"),
    ({"temperature": "0.7"}, r"temperature must be a number .*got '0.7' \(str\)"),
    ({"top_k": -1}, r"top_k must be >= 0 \(0 = off\), got -1"),
    ({"top_k": 2.0}, r"top_k must be an int >= 0 \(0 = off\), got 2.0 \(float\)"),
    ({"top_k": True}, r"top_k must be an int >= 0 \(0 = off\), got True \(bool\)"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\] \(1 = off\), got 1.5"),
    ({"top_p": float("nan")}, r"top_p must be in \(0, 1\] \(1 = off\), got nan"),
    ({"top_p": True}, r"top_p must be a number in \(0, 1\] \(1 = off\), got True \(bool\)"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\] \(0 = off\), got -0.1"),
    ({"min_p": 1.1}, r"min_p must be in \[0, 1\] \(0 = off\), got 1.1"),
    ({"min_p": float("nan")}, r"min_p must be in \[0, 1\] \(0 = off\), got nan"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[1e-4, 1e4\] \(1 = off; .*\), got 0.0"),
    ({"repetition_penalty": -1.2}, r"repetition_penalty must be in \[1e-4, 1e4\] .*, got -1.2"),
    ({"repetition_penalty": float("inf")}, r"repetition_penalty must be in \[1e-4, 1e4\] .*, got inf"),
    ({"repetition_penalty": 3e-227}, r"repetition_penalty must be in \[1e-4, 1e4\] .*overflow.*, got 3e-227"),
    ({"frequency_penalty": 2.5}, r"frequency_penalty must be in \[-2, 2\] \(0 = off\), got 2.5"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\] \(0 = off\), got -3"),
    ({"frequency_penalty": float("nan")}, r"frequency_penalty must be in \[-2, 2\] \(0 = off\), got nan"),
    ({"presence_penalty": 2.01}, r"presence_penalty must be in \[-2, 2\] \(0 = off\), got 2.01"),
    ({"presence_penalty": -2.5}, r"presence_penalty must be in \[-2, 2\] \(0 = off\), got -2.5"),
    ({"max_tokens": 0}, r"max_tokens must be >= 1, got 0"),
    ({"max_tokens": 8.0}, r"max_tokens must be an int >= 1, got 8.0 \(float\)"),
    ({"n": 0}, r"n must be >= 1, got 0"),
    ({"n": True}, r"n must be an int >= 1, got True \(bool\)"),
    ({"n": 3, "best_of": 2}, r"best_of must be >= n \(= 3\) or None \(= n\), got 2"),
    ({"best_of": 0}, r"best_of must be >= n \(= 1\) or None \(= n\), got 0"),
    ({"best_of": 2.0}, r"best_of must be an int >= n"),
    ({"logprobs": -1}, r"logprobs must be in \[0, 20\] \(0 = the chosen token only\) or None \(off\), got -1"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\] .*got 21"),
    ({"logprobs": True}, r"logprobs must be an int in \[0, 20\] .*got True \(bool\)"),
    ({"seed": 1.5}, r"seed must be an int or None, got 1.5 \(float\)"),
    ({"seed": False}, r"seed must be an int or None, got False \(bool\)"),
    ({"stop": [""]}, r"stop must be a list of non-empty strings, got \[''\]"),
    ({"stop": ["ok", 3]}, r"stop must be a list of non-empty strings"),
]


@pytest.mark.parametrize(
    "kwargs, message", BAD_PARAMS, ids=[",".join(f"{k}={v!r}" for k, v in kw.items()) for kw, _ in BAD_PARAMS]
)
def test_bad_sampling_params_name_field_range_and_value(kwargs, message):
    """Every field out of range raises ValueError naming the field, its range, its "off" value and the value."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_every_field_has_a_bad_value_tested():
    """The table above covers every validated field of SamplingParams."""
    covered = {k for kwargs, _ in BAD_PARAMS for k in kwargs}
    expected = set(SamplingParams.__dataclass_fields__) - {"ignore_eos"}
    assert expected <= covered, f"no bad value tested for {sorted(expected - covered)}"


def test_edges_of_every_range_are_accepted_and_numbers_normalised():
    """The closed ends of each range are valid; ints become floats and numpy ints become ints."""
    p = SamplingParams(
        temperature=0,
        top_k=np.int64(5),
        top_p=1,
        min_p=1,
        repetition_penalty=1e-3,
        frequency_penalty=-2,
        presence_penalty=2,
        n=2,
        best_of=2,
        logprobs=20,
        seed=-7,
    )
    assert p.greedy and type(p.temperature) is float and type(p.top_k) is int and p.top_k == 5
    assert SamplingParams(min_p=0, logprobs=0, frequency_penalty=2, presence_penalty=-2).logprobs == 0
    assert SamplingParams(stop="###").stop == ["###"] and SamplingParams().stop == []


def test_temperature_below_threshold_is_greedy():
    """Temperatures under 1e-5 pick the argmax (dividing by them would overflow float32)."""
    logits = random_logits((4, 50), seed=1) * 10
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, SamplingParams(temperature=1e-7), g), logits.argmax(-1))


# ------------------------------------------------------------------ parity with transformers
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", [0.3, 1.0, 2.5])
def test_temperature_matches_transformers(shape, t):
    """apply_temperature == TemperatureLogitsWarper."""
    logits = random_logits(shape)
    torch.testing.assert_close(apply_temperature(logits, t), TemperatureLogitsWarper(t)(None, logits))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k", [1, 3, 10, 2000])
def test_top_k_matches_transformers(shape, k):
    """top_k_filter == TopKLogitsWarper (k beyond the vocabulary keeps everything)."""
    logits = random_logits(shape, seed=2)
    ours, theirs = top_k_filter(logits, k), TopKLogitsWarper(k)(None, logits)
    assert kept(ours).sum(-1).tolist() == [min(k, shape[1])] * shape[0], "top_k must keep exactly k tokens"
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99, 1.0])
def test_top_p_matches_transformers(shape, p):
    """top_p_filter == TopPLogitsWarper: both keep the smallest set whose mass reaches p."""
    logits = random_logits(shape, seed=3)
    torch.testing.assert_close(top_p_filter(logits, p), TopPLogitsWarper(p)(None, logits))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_matches_transformers(shape, p):
    """min_p_filter == MinPLogitsWarper: keep tokens with probability >= p * the top probability."""
    logits = random_logits(shape, seed=4)
    torch.testing.assert_close(min_p_filter(logits, p), MinPLogitsWarper(p)(None, logits))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("penalty", [0.7, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(shape, penalty):
    """apply_repetition_penalty on id lists == RepetitionPenaltyLogitsProcessor on the same ids as a tensor."""
    logits = random_logits(shape, seed=5)
    ids = torch.randint(0, shape[1], (shape[0], 12), generator=torch.Generator().manual_seed(5))  # with repeats
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, ids.tolist(), penalty), expected)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
        dict(temperature=1.5, top_k=5, top_p=0.5, min_p=0.2, repetition_penalty=0.8),
        dict(temperature=0.4, top_p=0.95, min_p=0.1),
    ],
)
def test_whole_pipeline_matches_transformers_chain(shape, kwargs):
    """process_logits == transformers' processors in generate()'s order: penalty, T, top-k, top-p, min-p."""
    params = SamplingParams(**kwargs)
    logits = random_logits(shape, seed=6)
    prompt = torch.randint(0, shape[1], (shape[0], 8), generator=torch.Generator().manual_seed(6))
    output = torch.randint(0, shape[1], (shape[0], 4), generator=torch.Generator().manual_seed(7))
    chain = [RepetitionPenaltyLogitsProcessor(params.repetition_penalty), TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        chain.append(TopKLogitsWarper(params.top_k))
    chain += [TopPLogitsWarper(params.top_p), MinPLogitsWarper(params.min_p)]
    expected = LogitsProcessorList(chain)(torch.cat([prompt, output], dim=1), logits.clone())
    got = process_logits(logits, params, prompt.tolist(), output.tolist())
    torch.testing.assert_close(got, expected)


def test_frequency_and_presence_penalties_follow_openai_formula():
    """logit -= count * frequency + (count > 0) * presence, with counts from token_counts, per row."""
    logits = random_logits((3, 20), seed=8)
    output = [[1, 1, 1, 4], [], [19, 0, 19]]
    counts = token_counts(output, 20)
    assert counts.shape == (3, 20) and counts.dtype == torch.int64
    assert counts[0, 1] == 3 and counts[0, 4] == 1 and counts[1].sum() == 0 and counts[2, 19] == 2
    freq, pres = torch.tensor([0.5, 1.0, -0.3]), torch.tensor([0.25, 2.0, 1.5])
    got = apply_penalties(logits, counts, freq, pres)
    expected = logits.clone()
    for b, ids in enumerate(output):
        for t in set(ids):
            expected[b, t] -= ids.count(t) * freq[b] + pres[b]
    torch.testing.assert_close(got, expected)


def test_token_counts_rejects_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 10\), got ids from 0 to 10"):
        token_counts([[0, 10]], 10)


# ------------------------------------------------------------------ properties (hypothesis)
@st.composite
def logits_batches(draw, max_rows: int = 4, max_vocab: int = 24) -> torch.Tensor:
    """float32 logits [B, V], ties allowed (hypothesis likes repeated values such as 0.0)."""
    shape = (draw(st.integers(1, max_rows)), draw(st.integers(1, max_vocab)))
    values = draw(arrays(np.float32, shape, elements=st.floats(-20, 20, width=32)))
    return torch.from_numpy(values)


sampling_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0.05, 5),
    top_k=st.integers(0, 30),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    repetition_penalty=st.floats(0.5, 2.0),
    frequency_penalty=st.floats(-2, 2),
    presence_penalty=st.floats(-2, 2),
)


def histories(draw, rows: int, vocab: int) -> list[list[int]]:
    return [draw(st.lists(st.integers(0, vocab - 1), max_size=10)) for _ in range(rows)]


@PROPERTY
@given(st.data(), logits_batches())
def test_processors_never_remove_every_token(data, logits):
    """Whatever the parameters, every row keeps a token, and the sampled token is one of those kept."""
    B, V = logits.shape
    params = [data.draw(sampling_params) for _ in range(B)]
    prompt, output = histories(data.draw, B, V), histories(data.draw, B, V)
    processed = process_logits(logits, params, prompt, output)
    assert processed.dtype == torch.float32 and processed.shape == (B, V)
    assert kept(processed).any(-1).all(), f"a row lost every token: {processed}"
    tokens = sample(logits, params, torch.Generator().manual_seed(0), prompt, output)
    assert kept(processed).gather(-1, tokens[:, None]).all(), "sampled a token that was filtered out"


@PROPERTY
@given(logits_batches(), st.floats(0.01, 1.0))
def test_top_p_keep_set_is_sufficient_and_minimal(logits, p):
    """The kept tokens hold >= p of the mass, and without the least likely of them they would not."""
    probs = logits.double().softmax(-1)
    mask = kept(top_p_filter(logits, p))
    for row, keep in zip(probs, mask):
        mass, smallest = row[keep].sum().item(), row[keep].min().item()
        assert mass >= p - 1e-5, f"top_p={p} kept {keep.sum()} tokens with mass {mass:.6f} < p"
        assert mass - smallest < p + 1e-5, (
            f"top_p={p} must keep the smallest set reaching p; without its least likely token ({smallest:.6f}) "
            f"the {keep.sum()} kept tokens still hold {mass - smallest:.6f}"
        )


@PROPERTY
@given(logits_batches(), st.integers(0, 30), st.integers(0, 30))
def test_larger_top_k_keeps_a_superset(logits, k1, k2):
    k1, k2 = sorted((k1, k2))
    small, large = kept(top_k_filter(logits, k1)), kept(top_k_filter(logits, k2))
    if k1 == 0:  # 0 is off: keeps everything
        assert small.all()
    else:
        assert (large | ~small).all(), f"top_k={k2} dropped a token top_k={k1} kept"


@PROPERTY
@given(logits_batches(), st.floats(0.01, 1.0), st.floats(0.01, 1.0))
def test_larger_top_p_keeps_a_superset(logits, p1, p2):
    p1, p2 = sorted((p1, p2))
    small, large = kept(top_p_filter(logits, p1)), kept(top_p_filter(logits, p2))
    assert (large | ~small).all(), f"top_p={p2} dropped a token top_p={p1} kept"


@PROPERTY
@given(logits_batches(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_larger_min_p_keeps_a_subset(logits, p1, p2):
    p1, p2 = sorted((p1, p2))
    loose, strict = kept(min_p_filter(logits, p1)), kept(min_p_filter(logits, p2))
    assert (loose | ~strict).all(), f"min_p={p2} kept a token min_p={p1} dropped"


@PROPERTY
@given(logits_batches(), st.data())
def test_off_parameters_leave_logits_unchanged(logits, data):
    """Each processor at its "off" value returns the logits as they were (as float32)."""
    B, V = logits.shape
    seen = histories(data.draw, B, V)
    for name, out in [
        ("temperature=1", apply_temperature(logits, 1.0)),
        ("temperature=0", apply_temperature(logits, 0.0)),
        ("top_k=0", top_k_filter(logits, 0)),
        ("top_p=1", top_p_filter(logits, 1.0)),
        ("min_p=0", min_p_filter(logits, 0.0)),
        ("repetition_penalty=1", apply_repetition_penalty(logits, seen, 1.0)),
        ("frequency=presence=0", apply_penalties(logits, token_counts(seen, V), 0.0, 0.0)),
        ("default SamplingParams", process_logits(logits, SamplingParams(), seen, seen)),
    ]:
        assert torch.equal(out, logits), f"{name} is off but changed the logits"


@PROPERTY
@given(logits_batches(), st.data())
def test_per_row_params_in_one_batch_equal_row_by_row(logits, data):
    """One call with per-row SamplingParams and generators == each row processed and sampled on its own."""
    B, V = logits.shape
    params = [data.draw(sampling_params) for _ in range(B)]
    prompt, output = histories(data.draw, B, V), histories(data.draw, B, V)
    seeds = data.draw(st.lists(st.integers(0, 2**31), min_size=B, max_size=B))
    batched = process_logits(logits, params, prompt, output)
    tokens = sample(logits, params, [torch.Generator().manual_seed(s) for s in seeds], prompt, output)
    for i in range(B):
        alone = process_logits(logits[i : i + 1], params[i], prompt[i : i + 1], output[i : i + 1])
        assert torch.equal(batched[i : i + 1], alone), f"row {i} processed differently in a batch"
        token = sample(
            logits[i : i + 1], params[i], torch.Generator().manual_seed(seeds[i]), prompt[i : i + 1], output[i : i + 1]
        )
        assert tokens[i] == token[0], f"row {i} with seed {seeds[i]}: {tokens[i]} in the batch, {token[0]} alone"


# ------------------------------------------------------------------ sample(): greedy, seeds, frequencies
def test_legacy_call_returns_int64_ids():
    """sample(logits, params, generator) still works and returns LongTensor [B]."""
    logits = random_logits((5, 30), seed=9)
    tokens = sample(logits, SamplingParams(top_k=5), torch.Generator().manual_seed(0))
    assert tokens.dtype == torch.int64 and tokens.shape == (5,)
    assert minillm.sample is sample


def test_greedy_is_argmax_of_the_penalised_logits():
    """Temperature 0 picks the argmax whatever the seed; with a penalty, the argmax after the penalty."""
    logits = random_logits((4, 50), seed=10)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        assert torch.equal(sample(logits, SamplingParams(temperature=0), g), logits.argmax(-1))
    top = logits.argmax(-1)
    seen = [[int(t)] for t in top]  # each row has already produced its favourite token
    penalised = sample(logits, SamplingParams(temperature=0, repetition_penalty=1e3), None, [[]] * 4, seen)
    assert (penalised != top).all(), "a huge repetition penalty must move greedy off the repeated token"
    assert torch.equal(penalised, apply_repetition_penalty(logits, seen, 1e3).argmax(-1))


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = random_logits((4, 50), seed=11)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.5),
    ]
    for seed in range(5):
        tokens = sample(logits, params, torch.Generator().manual_seed(seed))
        assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_same_seed_same_tokens():
    logits = random_logits((8, 100), seed=12)
    params = SamplingParams(temperature=1.2, top_p=0.95)
    first = sample(logits, params, torch.Generator().manual_seed(42))
    assert torch.equal(first, sample(logits, params, torch.Generator().manual_seed(42)))
    others = {tuple(sample(logits, params, torch.Generator().manual_seed(s)).tolist()) for s in range(5)}
    assert len(others) > 1, "different seeds all drew the same tokens"


def test_row_seed_is_independent_of_batch_composition():
    """With one generator per row, a row sampled alone with seed s == that row in any batch with seed s."""
    target = random_logits((1, 64), seed=13)
    params = SamplingParams(temperature=1.5, min_p=0.01)
    alone = [int(sample(target, params, [torch.Generator().manual_seed(s)])) for s in range(20)]
    for seed, (others, position) in enumerate([(1, 0), (3, 2), (5, 5)]):
        neighbours = random_logits((others, 64), seed=100 + seed)
        batch = torch.cat([neighbours[:position], target, neighbours[position:]])
        neighbour_params = [SamplingParams(temperature=0.5, top_k=3)] * others
        rows = neighbour_params[:position] + [params] + neighbour_params[position:]
        for s in range(20):
            gens = [torch.Generator().manual_seed(1000 + j) for j in range(others + 1)]
            gens[position] = torch.Generator().manual_seed(s)
            got = int(sample(batch, rows, gens)[position])
            assert got == alone[s], f"seed {s}: {alone[s]} alone, {got} at row {position} of {others + 1}"


def test_sampling_frequencies_follow_the_processed_distribution():
    """20,000 draws from a 5-token distribution at T=0.8, top_k=4 land within 0.03 of the processed probabilities.

    Each frequency is a mean of 20,000 independent 0/1 draws, so by Hoeffding's inequality
    P(|freq - p| >= 0.03) <= 2 exp(-2 * 20000 * 0.03^2) = 2e^-36 ~ 5e-16 per token, under 3e-15 for
    all five: a correct sampler fails this test essentially never.
    """
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 20_000
    tokens = sample(
        probs.log().expand(n, 5), SamplingParams(temperature=0.8, top_k=4), torch.Generator().manual_seed(0)
    )
    freq = torch.bincount(tokens, minlength=5).double() / n
    expected = probs.double()[:4] ** (1 / 0.8)
    expected = torch.cat([expected / expected.sum(), torch.zeros(1, dtype=torch.float64)])
    assert freq[4] == 0, "top_k=4 must never draw the least likely token"
    assert (freq - expected).abs().max() < 0.03, f"frequencies {freq.tolist()} vs expected {expected.tolist()}"


def test_rows_without_a_generator_draw_together(monkeypatch):
    """Per-row generators where most rows have none (a server's unseeded requests): those rows are drawn in one
    call, each from its own processed distribution (Hoeffding as above, 0.03 over 20,000 draws per row); a
    seeded row keeps a call of its own, so its tokens still depend on its generator alone."""
    calls = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: calls.append(a[0].shape[0]) or multinomial(*a, **k))
    probs = torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05], [0.05, 0.1, 0.2, 0.25, 0.4]])
    n = 20_000
    logits = probs.log().repeat(n, 1)  # rows alternate between the two distributions
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)] * n
    generators = [None] * (2 * n)
    generators[0] = torch.Generator().manual_seed(7)  # one seeded row
    torch.manual_seed(0)
    tokens = sample(logits, params, generators)
    assert calls == [2 * n - 1, 1], f"expected one draw for the unseeded rows and one for the seeded: {calls}"
    for row, expected in enumerate(probs.double()):
        freq = torch.bincount(tokens[row::2], minlength=5).double() / n
        assert (freq - expected).abs().max() < 0.03, f"row kind {row}: {freq.tolist()} vs {expected.tolist()}"
    calls.clear()
    alone = sample(logits[:1], params[:1], [torch.Generator().manual_seed(7)])
    assert alone[0] == tokens[0], "the seeded row draws as it would alone"


def test_mismatched_per_row_arguments_raise():
    logits = random_logits((3, 10), seed=14)
    with pytest.raises(ValueError, match="got 2 SamplingParams for 3 rows"):
        sample(logits, [SamplingParams()] * 2)
    with pytest.raises(ValueError, match="got 2 generators for 3 rows"):
        sample(logits, SamplingParams(), [torch.Generator(), torch.Generator()])
    with pytest.raises(ValueError, match="expected a number or one value per row"):
        top_k_filter(logits, torch.tensor([1, 2]))


def test_penalties_without_history_raise():
    logits = random_logits((1, 10), seed=15)
    with pytest.raises(ValueError, match="repetition_penalty needs the tokens seen so far"):
        sample(logits, SamplingParams(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="frequency_penalty and presence_penalty need the generated tokens"):
        sample(logits, SamplingParams(presence_penalty=0.5), prompt_ids=[[1]])


# ------------------------------------------------------------------ penalties lower what appeared
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(repetition_penalty=1.5),
        dict(frequency_penalty=0.5),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.3, presence_penalty=0.3, repetition_penalty=1.1),
    ],
)
@pytest.mark.parametrize("token", [0, 7, 19])  # the largest, a middling and the smallest logit
def test_a_token_that_appeared_becomes_less_likely(kwargs, token):
    """A penalty lowers the probability of the one token that was generated (positive or negative logit)."""
    logits = torch.linspace(3, -3, 20)[None]  # token 0 most likely, 19 least; 0 and 19 have opposite signs
    before = logits.softmax(-1)[0, token]
    after = process_logits(logits, SamplingParams(**kwargs), [[]], [[token]]).softmax(-1)[0, token]
    assert after < before, f"{kwargs}: p(token {token}) went from {before:.4f} to {after:.4f}, expected lower"


def test_repeats_cost_more_under_frequency_penalty_only():
    """Frequency penalty grows with the count; presence and repetition penalties are paid once."""
    logits = torch.zeros(1, 5)
    once, thrice = [[2]], [[2, 2, 2]]
    for kwargs, grows in [
        (dict(frequency_penalty=0.5), True),
        (dict(presence_penalty=0.5), False),
        (dict(repetition_penalty=2.0), False),
    ]:
        a = process_logits(logits - 1, SamplingParams(**kwargs), [[]], once)[0, 2]
        b = process_logits(logits - 1, SamplingParams(**kwargs), [[]], thrice)[0, 2]
        assert (b < a) == grows, f"{kwargs}: logit after one repeat {a}, after three {b}"


def test_repetition_penalty_sees_the_prompt_frequency_penalty_does_not():
    """As in vLLM: repetition penalty over prompt + output, frequency and presence over the output only."""
    logits = torch.ones(1, 6)
    prompt, output = [[3]], [[]]
    rep = process_logits(logits, SamplingParams(repetition_penalty=2.0), prompt, output)
    freq = process_logits(logits, SamplingParams(frequency_penalty=1.0, presence_penalty=1.0), prompt, output)
    assert rep[0, 3] == 0.5, "a prompt token must be hit by the repetition penalty"
    assert torch.equal(freq, logits), "a token only in the prompt must not be hit by frequency/presence penalties"


# ------------------------------------------------------------------ log-probabilities
def test_logprobs_are_those_of_the_raw_distribution():
    """compute_logprobs gives log_softmax of the unprocessed logits, at the chosen token and the top k."""
    logits = random_logits((4, 50), seed=16)
    params = SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5)
    tokens = sample(logits, params, torch.Generator().manual_seed(0), [[1, 2]] * 4, [[]] * 4)
    out = compute_logprobs(logits, tokens, k=5)
    raw = logits.log_softmax(-1)
    assert isinstance(out, SampleOutput) and torch.equal(out.tokens, tokens)
    torch.testing.assert_close(out.logprobs, raw.gather(-1, tokens[:, None])[:, 0])
    top = raw.topk(5, dim=-1)
    for b, (ids, lps) in enumerate(out.top_logprobs):
        assert ids == top.indices[b].tolist(), "top_logprobs must list the most likely ids first"
        assert lps == pytest.approx(top.values[b].tolist())
    assert compute_logprobs(logits, tokens, k=0).top_logprobs == [([], [])] * 4


# ------------------------------------------------------------------ generate() on the shipped model
PROMPT = "HAMLET.\nTo be, or not to be"


@pytest.fixture(scope="module")
def shakespeare():
    return minillm.load("shakespeare-1m")


def repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


@pytest.mark.parametrize(
    "kwargs", [dict(repetition_penalty=1.3), dict(frequency_penalty=1.0), dict(presence_penalty=1.5)]
)
def test_generate_with_a_penalty_repeats_less(shakespeare, kwargs):
    """Greedy text loops ("KING HENRY. I am glad to be a king." over and over); a penalty breaks the loop."""
    model, tok = shakespeare
    plain = minillm.generate(model, PROMPT, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), tok)
    penalised = minillm.generate(
        model, PROMPT, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, **kwargs), tok
    )
    assert repeats(penalised.token_ids) <= 0.6 * repeats(plain.token_ids), (
        f"{kwargs}: {repeats(penalised.token_ids)} repeated tokens in 100, without it {repeats(plain.token_ids)}"
    )


def test_generate_returns_logprobs_when_asked(shakespeare):
    """logprobs=3: one log-probability per token, equal to the model's own; top 3 per step; greedy picks the top."""
    model, tok = shakespeare
    out = minillm.generate(model, PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=3), tok)
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 3 and max(top, key=top.get) == token and top[token] == lp and lp <= 0
    with torch.no_grad():
        first = model(torch.tensor([out.prompt_token_ids]))[0, -1].float().log_softmax(-1)
    assert out.logprobs[0] == pytest.approx(first[out.token_ids[0]].item(), abs=1e-5)
    plain = minillm.generate(model, PROMPT, SamplingParams(temperature=0, max_tokens=8), tok)
    assert plain.logprobs is None and plain.top_logprobs is None and plain.token_ids == out.token_ids
    chunk = next(iter(minillm.generate_stream(model, PROMPT, SamplingParams(max_tokens=2, logprobs=0, seed=0), tok)))
    assert math.isfinite(chunk.logprob) and chunk.top_logprobs == {}
