"""minillm.engine.mixed_graphs: a packed step's fixed buffers give the eager packed forward's logits and cache.

The graphs themselves need a GPU (the CUDA test below); on the CPU `capture=False` runs the same step code over the
same fixed buffers, the paged prefill kernel through Triton's interpreter (TRITON_INTERPRET=1, set before the
kernels are imported), against `paged_forward(packed=True)`, whose packed attention gathers each sequence's keys.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the kernels' import: Triton reads it when @triton.jit decorates them
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="Triton is not installed (pip install triton): the kernels need it")
import minillm  # noqa: E402
from minillm.engine.kv_cache import PagedKVCache  # noqa: E402
from minillm.engine.mixed_graphs import MixedGraphs, token_buckets  # noqa: E402
from minillm.engine.model_runner import paged_forward  # noqa: E402

PP = __import__("sys").modules.get("minillm.kernels.paged_prefill")
if not CUDA and PP is not None and not PP._interpreted():
    pytest.skip("minillm.kernels was imported before TRITON_INTERPRET=1 was set; run this file on its own "
                "(pytest tests/engine/test_mixed_graphs.py)", allow_module_level=True)


def test_token_buckets_are_powers_of_two_up_to_the_budget():
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(500)[-1] == 512 and token_buckets(1) == [16]
    with pytest.raises(ValueError, match="at least 1"):
        token_buckets(0)


@torch.inference_mode()
def test_fixed_buffers_give_the_eager_packed_steps_logits_and_cache():
    """Three steps of mixed rows (fresh prompts, a later chunk, decode rows, a placeholder token from the step before)
    through MixedGraphs(capture=False) and through the eager packed forward, each on its own cache: the same logits
    (fp32, within 1e-4: the attention is another kernel), the same tokens committed, the same keys in every layer.
    On a GPU both run on it (the kernel compiled, the graphs not captured); elsewhere on the CPU, in the interpreter."""
    device = "cuda" if CUDA else "cpu"
    model, _ = minillm.load("shakespeare-1m", device=device, dtype=torch.float32)
    rng = random.Random(3)
    vocab = model.config.vocab_size
    caches = [PagedKVCache(model.config, 48, 16, device=device) for _ in range(2)]
    graphs = MixedGraphs(model, caches[0], max_seqs=4, max_tokens=64, capture=False)
    for cache in caches:
        for i in range(3):
            cache.add_sequence(i)
    steps = [([0, 1], [[rng.randrange(vocab) for _ in range(n)] for n in (20, 9)]),
             ([0, 1, 2], [[7], [rng.randrange(vocab) for _ in range(30)], [rng.randrange(vocab) for _ in range(5)]]),
             ([2, 0, 1], [[-1], [4], [11]])]  # -1: the token sampled in row 0 of the step before, still on the device
    previous = torch.tensor([13, 2], device=device)
    for ids, new in steps:
        swap = {"previous": previous} if any(t < 0 for row in new for t in row) else {}
        fixed = graphs.run(ids, new, **swap)
        eager = paged_forward(model, caches[1], ids, new, packed=True, **swap)
        assert fixed.shape == eager.shape == (len(ids), vocab)
        torch.testing.assert_close(fixed, eager, atol=1e-4, rtol=1e-4)
    for i in range(3):
        assert caches[0].block_tables[i].token_ids == caches[1].block_tables[i].token_ids
        for layer in range(model.config.n_layers):
            for a, b in zip(caches[0].gather(i, layer), caches[1].gather(i, layer)):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="eagerly"):
        graphs.run([0, 1, 2], [[1] * 30, [1] * 30, [1] * 30])


@torch.inference_mode()
def test_every_token_buffers_give_the_eager_packed_logits_of_every_token():
    """The verify step of speculative decoding (`every_token=True`): rows [last token, drafts] of lengths 1..5 after
    prompts of different lengths, through the fixed buffers and through `paged_forward(packed=True,
    every_token=True)`: one logits row per new token, equal within 1e-4 (fp32), the same tokens committed."""
    device = "cuda" if CUDA else "cpu"
    model, _ = minillm.load("shakespeare-1m", device=device, dtype=torch.float32)
    rng = random.Random(4)
    vocab = model.config.vocab_size
    caches = [PagedKVCache(model.config, 48, 16, device=device) for _ in range(2)]
    graphs = MixedGraphs(model, caches[0], max_seqs=4, max_tokens=32, capture=False, every_token=True)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (17, 3, 40)]
    for cache in caches:
        for i, prompt in enumerate(prompts):
            cache.add_sequence(i)
            paged_forward(model, cache, [i], [prompt])
    for lengths in ((5, 1, 3), (2, 4, 1)):
        rows = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
        fixed = graphs.run([0, 1, 2], rows)
        eager = paged_forward(model, caches[1], [0, 1, 2], rows, packed=True, every_token=True)
        assert fixed.shape == eager.shape == (sum(lengths), vocab)
        torch.testing.assert_close(fixed, eager, atol=1e-4, rtol=1e-4)
    for i in range(3):
        assert caches[0].block_tables[i].token_ids == caches[1].block_tables[i].token_ids
    with pytest.raises(ValueError, match="needs packed=True"):
        paged_forward(model, caches[1], [0], [[1, 2]], every_token=True)


@torch.inference_mode()
def test_the_draft_models_fixed_buffer_path_drafts_what_the_eager_path_drafts():
    """`DraftModelDrafter.propose_greedy` (the catch-up forward and the decode steps on fixed buffers, each draft fed
    on the device) against the eager drafter, over rounds of a simulated verify step: three rows of different k,
    prompts (one past the catch-up graphs' 256 tokens, so eager), then rows that accepted some drafts and feed
    1 to k + 1 tokens (the catch-up graphs), then rows that all feed one (the decode graphs). The same drafts, the
    same tokens in the draft's tables (no placeholder left)."""
    from minillm.engine.draft_model import DraftModelDrafter

    device = "cuda" if CUDA else "cpu"
    model, _ = minillm.load("shakespeare-1m", device=device, dtype=torch.float32)
    rng = random.Random(6)
    vocab = model.config.vocab_size
    fast = DraftModelDrafter(model, num_blocks=64, cuda_graphs=True, max_batch=4, capture=CUDA)
    eager = DraftModelDrafter(model, num_blocks=64, cuda_graphs=False)
    contexts = [[rng.randrange(vocab) for _ in range(n)] for n in (300, 9, 40)]
    greedy = [minillm.SamplingParams(temperature=0)] * 3
    used = []
    real = fast.propose_greedy
    fast.propose_greedy = lambda *a: used.append(1) or real(*a)
    for ks in ([3, 1, 4], [4, 2, 4], [2, 4, 1], [4, 4, 4]):
        ours = fast.propose([0, 1, 2], contexts, greedy, ks, [None] * 3)
        theirs = eager.propose([0, 1, 2], contexts, greedy, ks, [None] * 3)
        assert [d.tokens for d in ours] == [d.tokens for d in theirs]
        assert [len(d.tokens) for d in ours] == ks and all(d.probs is None for d in ours)
        for i in range(3):
            assert fast.cache.block_tables[i].token_ids == eager.cache.block_tables[i].token_ids
            assert min(fast.cache.block_tables[i].token_ids) >= 0
            # the target kept some drafts, then added a token of its own; none in the third round, so that every row
            # of the fourth feeds one token (its catch-up is a decode step)
            accepted = 0 if ks == [2, 4, 1] else rng.randint(0, ks[i])
            contexts[i] = contexts[i] + list(ours[i].tokens[:accepted]) + [rng.randrange(vocab)]
    assert len(used) == 4 and fast.graphs is not None


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_engine_replays_mixed_steps_and_generates_what_it_did_eagerly(monkeypatch):
    """On a GPU the engine captures mixed steps (`ModelRunner.mixed_graphs`) and replays them: fp32, chunked prefill
    with a small budget so that many steps are mixed, greedy tokens equal to the same engine with the mixed steps
    run eagerly (packed) and with the split path (a decode forward plus a prompt forward)."""
    from minillm.decoding.llm import LLM
    from minillm.sampler.sampling import SamplingParams

    monkeypatch.delenv("MINILLM_MIXED_GRAPHS", raising=False)  # captured by default
    gpu_model, _ = minillm.load("shakespeare-1m", device="cuda", dtype=torch.float32)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, gpu_model.config.vocab_size) for _ in range(rng.randint(5, 90))] for _ in range(10)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, replays = [], []
    for mode in ("graphs", "eager", "split"):
        llm = LLM(gpu_model, None, max_num_batched_tokens=48, max_num_seqs=8)
        runner = llm.engine.model_runner
        assert runner.mixed_graphs is not None and runner.mixed_graphs.sizes == [16, 32, 64]
        graphs, calls = runner.mixed_graphs, []

        def counted(*args, real=graphs.run, calls=calls, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls.append(1)
            return real(*args, **kwargs)

        graphs.run = counted
        if mode != "graphs":
            runner.mixed_graphs = None
        runner.packed_in_place = mode != "split"
        outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        replays.append(len(calls))
    assert replays[0] > 0 and replays[1:] == [0, 0], "only the first engine replayed mixed steps"
    assert outs[0] == outs[1] == outs[2]
