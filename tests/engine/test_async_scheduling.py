"""Async scheduling (chapter 05, issue 30): the engine runs one step ahead of the host, and nothing changes.

With `LLMEngine(async_scheduling=True)` a step's sampled tokens stay on the device and feed the next step's
forward there (placeholders in the host's token lists, swapped on the device); the host reads them one step
later, while that next forward runs, and applies the stop rules then. So a sequence that ended may compute
one more row, which is dropped. On a CPU the order changes but nothing overlaps; these tests check there that
every output is what the synchronous engine gives: the same tokens, text and finish reasons, and
log-probabilities within last-bit noise (the GPU run in tests/engine/test_cuda_graphs.py checks it
again on the device, replayed graphs included).
"""

from __future__ import annotations

import pytest
import torch

import minillm
from minillm.decoding.generation import generate
from minillm.engine import LLMEngine
from minillm.engine.block_manager import block_hash
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.sequence import inflight_token, swap_inflight
from minillm.eval.same_outputs import assert_same_outputs
from minillm.sampler.sampling import SamplingParams

TEXT = ("FIRST CITIZEN.\nBefore we proceed any further, hear me speak.\n\nALL.\nSpeak, speak.\n\nFIRST CITIZEN.\n"
        "You are all resolved rather to die than to famish?\n\nALL.\nResolved, resolved.\n")


@pytest.fixture(scope="module")
def shipped():
    return minillm.load("shakespeare-1m")


@pytest.fixture(scope="module")
def text_ids(shipped):
    return shipped[1].encode(TEXT)


def by_request(finished: dict) -> list:
    """A run's outputs in a fixed order (request id, then index); compared with `assert_same_outputs`: tokens, text
    and finish reasons exactly, log-probabilities within `LOGPROB_ATOL` (the two schedules batch rows
    differently, and a different batch shape may sum in a different order: `minillm.eval.same_outputs`)."""
    return sorted(finished.values(), key=lambda o: (int(o.request_id), o.index))


# ------------------------------------------------------------------ the pieces
def test_placeholders_are_swapped_for_the_previous_steps_tokens_on_the_device():
    previous = torch.tensor([40, 41, 42])
    tokens = torch.tensor([[7, inflight_token(2)], [0, inflight_token(0)], [5, 6]])
    swap_inflight(tokens, previous)
    assert tokens.tolist() == [[7, 42], [0, 40], [5, 6]]


def test_a_block_holding_a_token_in_flight_is_named_once_the_token_is_known():
    config = minillm.config.ModelConfig(dim=8, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=8, vocab_size=50)
    cache = PagedKVCache(config, num_blocks=8, block_size=4)
    cache.add_sequence("a")
    cache.allocate_slots(["a"], [4])
    table = cache.block_tables["a"]
    cache.commit([table], [[1, 2, 3, inflight_token(0)]])
    assert table.block_hashes == [], "a block with a placeholder in it must not be named after the placeholder"
    cache.resolve_token("a", 3, 9)
    assert table.token_ids == [1, 2, 3, 9]
    assert table.block_hashes == [block_hash(None, [1, 2, 3, 9])]
    assert cache.allocator.cached_blocks[table.block_hashes[0]] == table.block_ids[0]
    cache.resolve_token("gone", 0, 1)  # a sequence freed meanwhile: nothing to do
    cache.resolve_token("a", 7, 1)  # a position its table does not hold yet: nothing to do


def test_async_scheduling_is_refused_where_the_next_step_needs_the_host(shipped):
    from minillm.sampler.speculative import NgramDrafter, SpeculativeConfig

    model, tok = shipped
    with pytest.raises(ValueError, match="async_scheduling"):
        LLMEngine(model, tok, async_scheduling=True, speculative=SpeculativeConfig(NgramDrafter(), 3))
    assert not LLMEngine(model, tok).async_scheduling, "off by default on a CPU, where nothing would overlap"


# ------------------------------------------------------------------ the engine, against itself synchronous
def test_every_kind_of_request_gives_the_same_outputs_one_step_ahead(shipped, text_ids):
    """Greedy, seeded sampling with filters, penalties (which read the tokens so far), stop strings, logprobs,
    n > 1 and best_of (which fork when the prompt completes), a constraint (its automaton follows each token),
    max_tokens 1, and a prompt chunked under a small token budget: all in one batch, all unchanged."""
    from minillm.sampler.constrained import TokenIndex

    model, tok = shipped
    index = TokenIndex.from_constraint(r"(Speak|Resolved), [a-z]+\.", tok, model.config.eos_token_ids)
    requests = [
        (text_ids[:5], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), None),
        (text_ids[:70], SamplingParams(temperature=0, max_tokens=9), None),
        ("ROMEO.\n", SamplingParams(temperature=0, max_tokens=40, stop=["\n\n"]), None),
        ("KING HENRY.\n", SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=30,
                                         logprobs=3), None),
        ("ALL.\n", SamplingParams(temperature=1.0, seed=11, max_tokens=25, repetition_penalty=1.3), None),
        ("ALL.\n", SamplingParams(temperature=0.7, seed=2, max_tokens=25, frequency_penalty=0.5,
                                  presence_penalty=0.3, min_p=0.05), None),
        (text_ids[3:20], SamplingParams(max_tokens=10, n=3, seed=11, ignore_eos=True), None),
        (text_ids[:10], SamplingParams(max_tokens=8, n=2, best_of=4, seed=3), None),
        ("ALL.\n", SamplingParams(max_tokens=12, seed=5), index),
        (text_ids[:9], SamplingParams(temperature=0, max_tokens=1), None),
    ]
    results = []
    for async_scheduling in (False, True):
        engine = LLMEngine(model, tok, max_num_batched_tokens=32, async_scheduling=async_scheduling)
        for i, (prompt, params, constraint) in enumerate(requests):
            engine.add_request(str(i), prompt, params, constraint=constraint)
        finished = engine.run()
        assert engine.cache.allocator.num_used_blocks == 0 and engine.inflight is None
        results.append(by_request(finished))
    assert len(results[1]) == len(results[0]) == 15  # n=3 and best_of=4 add 2 + 3 sequences
    assert all(o.logprobs for o in results[0] if o.request_id == "3"), "the request with logprobs=3 must have them"
    assert_same_outputs(results[0], results[1])


def test_the_same_rows_are_computed_and_the_same_blocks_named(shipped, text_ids):
    """A request that ends by max_tokens is not computed past its last token (the scheduler knows it is done while
    that token is still in flight), so every step computes what the synchronous engine computes; and the prefix
    cache names the same blocks, each from its real tokens."""
    model, _ = shipped
    prompts = [text_ids[i: i + 18 + 7 * i] for i in range(5)]
    runs = []
    for async_scheduling in (False, True):
        engine = LLMEngine(model, None, max_num_batched_tokens=24, async_scheduling=async_scheduling)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=11 + 5 * i, ignore_eos=True))
        tokens, outs = [], {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] = out.token_ids
            if engine.last_step is not None:
                tokens.append(engine.last_step.num_batched_tokens)
        runs.append((outs, sum(tokens), set(engine.cache.allocator.cached_blocks)))
    assert runs[1][0] == runs[0][0]
    assert runs[1][1] == runs[0][1], "async scheduling computed rows the synchronous engine did not"
    assert runs[1][2] == runs[0][2] and runs[0][2], "the prefix cache names different blocks"


def test_each_step_returns_the_step_befores_tokens(shipped, text_ids):
    """The first step's tokens are still on the device when it returns; every later call returns the call before's
    (tests/engine/test_engine.py checks deltas, aborts and random arrivals with async scheduling on and off)."""
    model, tok = shipped
    engine = LLMEngine(model, tok, async_scheduling=True)
    engine.add_request("a", text_ids[:12], SamplingParams(temperature=0, max_tokens=3))
    engine.add_request("b", text_ids[:30], SamplingParams(temperature=0, max_tokens=3))
    assert engine.step() == [], "the first step's tokens are still on their way"
    assert {s.seq_id for s in engine.inflight.seqs} == {"a", "b"}
    assert all(s.token_slice(s.num_tokens - 1, s.num_tokens)[0] < 0 for s in engine.inflight.seqs), "placeholders"
    got = {"a": [], "b": []}
    calls = 1
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        calls += 1
    assert calls == 4, "3 tokens each: the prompts, 2 decode steps, then a call that only reads the last tokens"
    assert engine.last_step.scheduled == [], "the last call computed nothing: max_tokens was reached in flight"
    for rid, n in (("a", 12), ("b", 30)):
        assert got[rid] == generate(model, text_ids[:n], SamplingParams(temperature=0, max_tokens=3)).token_ids
    assert engine.cache.allocator.num_used_blocks == 0
