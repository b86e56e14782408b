"""Prefill/decode disaggregation (minillm.parallel.disagg, chapter 08): two worker processes with the KV cache sent
between them over torch.distributed (gloo) give the one-engine outputs, send chapter 02's KV bytes, hold back
when the decode pool is full, free blocks on both sides when a client goes away, and fail clearly when a
worker dies."""

from __future__ import annotations

import os
import signal
import time

import pytest

import minillm
from minillm.arithmetic import kv_cache_bytes
from minillm.decoding.llm import LLM
from minillm.parallel.disagg import DisaggregatedEngine
from minillm.sampler.sampling import SamplingParams

PROMPTS = ["ROMEO.\nBut soft", "JULIET.\nO Romeo, Romeo", "HAMLET.\nTo be, or not to be", "KING LEAR.\nNothing"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def shipped():
    return minillm.load(minillm.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def engine(shipped):
    model, tokenizer = shipped
    # a decode worker that runs 2 sequences at a time: the other prefilled requests wait for it (back-pressure)
    engine = DisaggregatedEngine(model, tokenizer, decode={"num_blocks": 6, "max_num_seqs": 2})
    yield engine
    engine.shutdown()


def test_the_split_gives_one_engine_tokens_and_sends_chapter_02_bytes(shipped, engine) -> None:
    model, tokenizer = shipped
    expected = LLM(model, tokenizer).generate(PROMPTS, GREEDY, use_tqdm=False)
    got = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    for out in got:
        sent = engine.transfers[out.request_id]
        assert sent.prompt_tokens == len(out.prompt_token_ids)
        assert sent.nbytes == kv_cache_bytes(model.config, sent.prompt_tokens, dtype_bytes=4)  # fp32 on the CPU
        assert 0 < sent.landed_s <= sent.seconds  # the transfer completes before D's loop takes it
    stats = engine.worker_stats()  # everything finished: no block held on either side
    # 4 requests, 2 rows: offers waited, and still came through. How many waited depends on the two processes'
    # timing (on a loaded 2-core machine the prefill worker can fall behind, and only one offer finds both rows busy)
    assert stats["decode"]["held_back"] >= 1
    assert stats["decode"]["used_blocks"] == 0 and stats["decode"]["reserved"] == 0
    assert stats["prefill"]["staged"] == 0 and stats["prefill"]["unfinished"] == 0


def test_seeded_sampling_continues_the_prefill_workers_generator(shipped, engine) -> None:
    model, tokenizer = shipped
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=11, logprobs=2)
    expected = LLM(model, tokenizer).generate(PROMPTS[:2], params, use_tqdm=False)
    got = engine.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for g, e in zip(got, expected):
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)


def test_a_client_that_goes_away_frees_its_blocks_on_both_workers(engine) -> None:
    ids = [engine.add_request(None, p, SamplingParams(max_tokens=200, ignore_eos=True)) for p in PROMPTS[:3]]
    deadline = time.time() + 30
    while not any(o.new_token_ids for o in engine.step()) and time.time() < deadline:
        pass
    engine.abort_request(ids)
    assert not engine.has_unfinished_requests()
    deadline = time.time() + 30
    while time.time() < deadline:  # the workers get the aborts; a transfer in flight lands, then is freed
        stats = engine.worker_stats()
        if stats["decode"]["used_blocks"] == 0 and stats["decode"]["reserved"] == 0 and stats["prefill"][
                "staged"] == 0 and stats["prefill"]["unfinished"] == 0 and stats["decode"]["unfinished"] == 0:
            break
    assert stats["decode"]["used_blocks"] == 0 and stats["prefill"]["used_blocks"] >= 0
    assert stats["decode"]["unfinished"] == 0 and stats["prefill"]["staged"] == 0, stats


def test_bad_requests_are_refused_before_they_reach_a_worker(engine) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(None, [1, 99999], GREEDY)
    with pytest.raises(ValueError, match="n > 1 is not supported"):
        engine.add_request(None, "A", SamplingParams(n=2))
    with pytest.raises(ValueError, match="not supported here"):
        DisaggregatedEngine(None, decode={"speculative": object()})


def test_a_dead_decode_worker_fails_its_requests_clearly_and_refuses_new_ones(shipped) -> None:
    model, tokenizer = shipped
    engine = DisaggregatedEngine(model, tokenizer)
    try:
        request = engine.add_request(None, PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True))
        os.kill(engine.processes[1].pid, signal.SIGKILL)
        engine.processes[1].join(timeout=10)
        outputs = []
        deadline = time.time() + 30
        while engine.has_unfinished_requests() and time.time() < deadline:
            outputs += engine.step()
        assert outputs[-1].request_id == request and outputs[-1].finish_reason == "error"
        assert "decode worker died" in engine.errors[request]
        with pytest.raises(RuntimeError, match="decode worker died"):
            engine.add_request(None, PROMPTS[1], GREEDY)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, max_tokens=4)])
def test_a_request_of_nan_logits_fails_with_the_reason_and_does_not_hang(shipped, params) -> None:
    """Issue 55: the engine finishes a row of NaN logits with finish_reason "error" and no token. The prefill worker
    offered only finished prompts, so such a request was never offered nor failed: the router waited for ever (and
    before that, a sampled one failed the worker's step and killed it). Now the worker reports it."""
    import copy

    import torch

    model, tokenizer = shipped
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.norm.weight[0] = float("nan")  # the final norm: every logit of every row is NaN
    engine = DisaggregatedEngine(broken, tokenizer)
    try:
        ids = [engine.add_request(None, prompt, params) for prompt in PROMPTS[:2]]
        outputs, deadline = [], time.time() + 30
        while engine.has_unfinished_requests() and time.time() < deadline:
            outputs += engine.step()
        assert not engine.has_unfinished_requests(), "the requests were neither finished nor failed"
        assert sorted(o.request_id for o in outputs if o.finish_reason == "error") == sorted(ids)
        assert all("prefill worker got NaN or infinite logits for it" in engine.errors[i] for i in ids), engine.errors
        assert not engine.down, "the workers stay up"
        assert engine.worker_stats()["prefill"]["unfinished"] == 0
    finally:
        engine.shutdown()


@pytest.mark.skipif(__import__("torch").cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL, one per worker)")
def test_two_gpus_over_nccl_give_one_gpu_tokens() -> None:
    import torch

    from minillm.config import ModelConfig
    from minillm.model import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=256,
                                    max_seq_len=256)).cuda().eval()
    prompts = [[3, 17, 9, 44, 5] * 8, [8, 2, 99, 31, 64, 12, 7]]
    expected = LLM(model).generate(prompts, GREEDY, use_tqdm=False)
    engine = DisaggregatedEngine(model)
    try:
        got = engine.generate(prompts, GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert all(engine.transfers[o.request_id].nbytes == kv_cache_bytes(model.config, len(p), dtype_bytes=4)
                   for o, p in zip(got, prompts))
    finally:
        engine.shutdown()
