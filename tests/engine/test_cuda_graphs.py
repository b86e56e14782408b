"""minillm.engine.cuda_graphs: decode steps captured as CUDA graphs, and the engine's use of them.

On a CPU the capture itself cannot run, but everything around it can: the choice of batch sizes, the
static input buffer (padding rows, stale columns, reuse across sizes) and the step's code over that
buffer (`DecodeGraphs(capture=False)` runs exactly what a graph records, eagerly), through Triton's
interpreter, since the step reads the cache with the paged decode kernel. TRITON_INTERPRET=1 must be
set before the kernels are imported, so this file sets it first (as tests/kernels/test_kernels.py does).
On CUDA the replayed graphs must give the eager engine's tokens, token for token.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the kernels' import: Triton reads it when @triton.jit decorates them
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="Triton is not installed (pip install triton): the paged decode kernel needs it")
import minillm.kernels  # noqa: E402, F401

import minillm  # noqa: E402
from minillm.engine import LLMEngine  # noqa: E402
from minillm.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes, graphs_unavailable, padded_batch_size  # noqa: E402
from minillm.engine.kv_cache import PagedKVCache  # noqa: E402
from minillm.engine.model_runner import paged_forward  # noqa: E402
from minillm.sampler.sampling import SamplingParams  # noqa: E402

DECODE = sys.modules["minillm.kernels.decode_attention"]
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
interpreter_only = pytest.mark.skipif(CUDA, reason="runs the step eagerly on CPU tensors, through the interpreter")
if not CUDA and not DECODE._interpreted():
    pytest.skip("minillm.kernels was imported before TRITON_INTERPRET=1 was set, so its kernels need a GPU; run this "
                "file on its own (pytest tests/engine/test_cuda_graphs.py)", allow_module_level=True)


@pytest.mark.parametrize("max_batch, sizes", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]), (65, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72]),
])
def test_batch_sizes_cover_every_batch_up_to_the_largest(max_batch, sizes):
    assert graph_batch_sizes(max_batch) == sizes
    for batch in range(1, max_batch + 1):
        padded = padded_batch_size(batch, sizes)
        assert padded in sizes and padded >= batch
        assert all(s < batch for s in sizes if s < padded), "the smallest size that holds the batch"


def test_batch_size_errors():
    with pytest.raises(ValueError, match="at least 1"):
        graph_batch_sizes(0)
    with pytest.raises(ValueError, match="larger max_batch"):
        padded_batch_size(9, [1, 2, 4, 8])


@pytest.fixture(scope="module")
def model():
    model, _ = minillm.load("shakespeare-1m")  # head_dim 32: one the paged kernel compiles for
    return model


def test_cpu_models_run_eagerly(model):
    assert "CUDA" in graphs_unavailable(model)
    assert not LLMEngine(model, num_blocks=8, max_num_seqs=2).use_cuda_graphs
    with pytest.raises(ValueError, match="cuda_graphs=True, but"):
        LLMEngine(model, num_blocks=8, max_num_seqs=2, cuda_graphs=True)
    with pytest.raises(ValueError, match="capture=False"):
        DecodeGraphs(model, PagedKVCache(model.config, 8), max_batch=2)


def prefill(model, cache, prompts):
    """Add each prompt as sequence i and run it; returns each one's greedy next token."""
    for i in range(len(prompts)):
        cache.add_sequence(i)
    logits = paged_forward(model, cache, list(range(len(prompts))), prompts)
    return logits.argmax(-1).tolist()


@interpreter_only
@pytest.mark.parametrize("kv_cache_dtype, fused", [("auto", False), ("int8", False), ("auto", True)])
def test_the_static_buffer_step_equals_the_eager_step(model, kv_cache_dtype, fused, monkeypatch):
    """Three sequences of different lengths, decoded by the recorded step's code (eagerly, on a buffer
    padded to 4 rows) and by paged_forward on a twin cache: the same logits at every step, then a smaller
    batch (2 rows) reusing the buffer with stale columns from the larger one. With an int8 cache (chapter 06)
    the step's paged kernel reads codes and scales, the twin dequantises and runs PyTorch attention. With the
    GPU's fused kernels (forced here, through the interpreter), the step's rotary kernel also writes the keys
    and values to the cache, where the twin's eager step writes them apart."""
    import minillm.model as M
    from minillm.engine.kv_cache import PagedCacheView

    monkeypatch.setattr(M, "use_fused_kernels", lambda x: fused)
    fused_writes = []  # layers whose keys and values the rotary kernel wrote
    target = PagedCacheView.fused_write_target

    def spy(self: PagedCacheView, layer: int) -> object:
        found = target(self, layer)
        if found is not None:
            fused_writes.append(layer)
        return found

    monkeypatch.setattr(PagedCacheView, "fused_write_target", spy)
    rng = random.Random(0)
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in (5, 37, 20)]  # 1, 3 and 2 blocks of 16
    caches = [PagedKVCache(model.config, 24, 16, kv_cache_dtype=kv_cache_dtype) for _ in range(2)]
    graphs = DecodeGraphs(model, caches[0], max_batch=4, capture=False)
    assert caches[0].allocator.num_free_blocks == 23, "one block is taken for the padding rows"
    tokens = [prefill(model, c, prompts) for c in caches]
    assert tokens[0] == tokens[1]
    nxt = tokens[0]
    for step in range(3):
        ids = [0, 1, 2] if step < 2 else [2, 0]
        feed = [nxt[i] for i in ids]
        got = graphs.run(ids, feed)
        want = paged_forward(model, caches[1], ids, [[t] for t in feed])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {step}, rows {ids}")
        for i, row in zip(ids, got.argmax(-1).tolist()):
            nxt[i] = row
    for i in range(3):
        assert caches[0].block_tables[i].token_ids == caches[1].block_tables[i].token_ids
        for layer in range(model.config.n_layers):  # every key the sequences hold is the same in both pools
            for a, b in zip(caches[0].gather(i, layer), caches[1].gather(i, layer)):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert caches[0].builder.staging[3, 4] == graphs.pad_block, "the padding row points at the padding block"
    assert len(fused_writes) == (3 * model.config.n_layers if fused else 0)


@interpreter_only
def test_a_sequence_longer_than_the_graphs_is_refused(model):
    cache = PagedKVCache(model.config, 8, 16)
    graphs = DecodeGraphs(model, cache, max_batch=1, max_seq_len=20, capture=False)
    assert graphs.max_blocks == 2
    (token,) = prefill(model, cache, [list(range(20))])
    with pytest.raises(ValueError, match="larger max_seq_len"):
        graphs.run([0], [token])


# ------------------------------------------------------------------ CUDA: replayed graphs vs eager
def engine_tokens(model, prompts, cuda_graphs, max_num_seqs=8, kv_cache_dtype="auto", async_scheduling=None,
                  **params):
    engine = LLMEngine(model, num_blocks=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                       cuda_graphs=cuda_graphs, kv_cache_dtype=kv_cache_dtype, async_scheduling=async_scheduling)
    assert (engine.graphs is not None) == cuda_graphs, "graphs are captured as the engine starts, before any step"
    sp = SamplingParams(**{"temperature": 0, "max_tokens": 24, "ignore_eos": True, **params})
    ids = [engine.add_request(None, p, sp) for p in prompts]
    finished = engine.run()
    assert (engine.graphs is not None) == cuda_graphs
    return [finished[i, 0].token_ids for i in ids]


@cuda_only
def test_graphs_give_the_eager_tokens_on_a_quantised_cache():
    """An int8 KV cache (chapter 06) is captured too: the paged kernel reads its codes and scales in the graph."""
    model, _ = minillm.load("shakespeare-1m", device="cuda", dtype=torch.bfloat16)
    rng = random.Random(2)
    prompts = [[rng.randrange(4096) for _ in range(rng.randrange(3, 60))] for _ in range(5)]
    assert (engine_tokens(model, prompts, True, 8, kv_cache_dtype="int8")
            == engine_tokens(model, prompts, False, 8, kv_cache_dtype="int8"))


@interpreter_only
def test_a_step_fed_from_the_device_equals_a_step_fed_from_the_host(model):
    """Async scheduling: rows whose token is still on the device carry a placeholder (`inflight_token`), which the
    step swaps for the step before's sampled token after copying its inputs. Same logits, same block tables (the
    placeholders committed, then resolved) as feeding the tokens from the host."""
    from minillm.engine.sequence import inflight_token

    rng = random.Random(3)
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in (16, 9)]  # the first fills its block exactly
    caches = [PagedKVCache(model.config, 16, 16) for _ in range(2)]
    graphs = [DecodeGraphs(model, c, max_batch=2, capture=False) for c in caches]
    nxt = [prefill(model, c, prompts) for c in caches][0]
    previous = torch.tensor([99, nxt[1], nxt[0]])  # the step before's tokens; row 2 is sequence 0's, row 1 is 1's
    want = graphs[0].run([0, 1], nxt)
    got = graphs[1].run([0, 1], [inflight_token(2), inflight_token(1)], previous=previous)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert caches[1].block_tables[0].token_ids[-1] == inflight_token(2)
    for i, token in enumerate(nxt):
        caches[1].resolve_token(i, len(prompts[i]), token)
    for i in range(2):
        assert caches[1].block_tables[i].token_ids == caches[0].block_tables[i].token_ids


@cuda_only
def test_the_async_engine_never_makes_the_host_wait_for_the_gpu():
    """Between its first decode steps (graph capture) and the end, an async engine's steps run under CUDA's sync
    debug mode: any operation that blocks the host until the GPU catches up (a `.item()`, a copy from pageable
    memory, a `.tolist()` of a device tensor) raises, and the failure names where. The one wait allowed is on the
    event after the step before's tokens reach pinned memory, which is not such an operation. Greedy and sampled
    (seeded, with logprobs) rows."""
    import traceback

    model, _ = minillm.load("shakespeare-1m", device="cuda", dtype=torch.bfloat16)
    rng = random.Random(4)
    prompts = [[rng.randrange(4096) for _ in range(rng.randrange(3, 60))] for _ in range(6)]
    for params in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, top_k=50, seed=3, logprobs=2)):
        engine = LLMEngine(model, num_blocks=64, max_num_seqs=8, async_scheduling=True)
        assert engine.async_scheduling
        for p in prompts:
            engine.add_request(None, p, SamplingParams(max_tokens=40, ignore_eos=True, **params))
        for _ in range(4):  # the prompts, then the first decode steps, which capture the graphs
            engine.step()
        assert engine.graphs is not None
        for p in prompts[:2]:  # arrivals in the watched steps: prompt work (eager, prefix cache hits) beside decodes
            engine.add_request(None, p + [7] * 20, SamplingParams(max_tokens=10, ignore_eos=True, **params))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.run()
        except RuntimeError as error:
            frames = [f"{f.filename.split('minillm/')[-1]}:{f.lineno} {f.line}"
                      for f in traceback.extract_tb(error.__traceback__) if "minillm" in f.filename]
            pytest.fail(f"{params}: the host waited for the GPU ({error}) at:\n" + "\n".join(frames))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not engine.has_unfinished_requests()


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphs_give_the_eager_tokens(dtype):
    """Nine requests of different lengths (batches 9 down to 1: padded sizes 16, 8, 4, 2, 1), greedy and
    seeded sampling: the same tokens with the graphs as without, and one step ahead (async scheduling, where the
    graph's input tokens come from the step before's sampled tokens on the device) as synchronously."""
    model, _ = minillm.load("shakespeare-1m", device="cuda", dtype=dtype)
    rng = random.Random(1)
    prompts = [[rng.randrange(4096) for _ in range(rng.randrange(3, 60))] for _ in range(9)]
    for params in ({}, dict(temperature=0.8, top_p=0.9, seed=3)):
        want = engine_tokens(model, prompts, False, 16, async_scheduling=False, **params)
        for graphs, ahead in ((True, False), (True, True), (False, True)):
            assert engine_tokens(model, prompts, graphs, 16, async_scheduling=ahead, **params) == want, (
                f"cuda_graphs={graphs}, async_scheduling={ahead}, {params or 'greedy'}")


@cuda_only
def test_kernels_launched_with_pdl_give_the_same_logits(monkeypatch):
    """Programmatic dependent launch (kernels/pdl.py) lets a kernel start before the one before it ends; each of ours
    waits before reading that one's output. Only DecodeGraphs' warm-up and capture ask for it. A kernel that read
    too early would race with the one writing its input: graphs captured with PDL (where the GPU has it) must give
    the logits of graphs captured without, bit for bit, at batch 1 (the matrix-vector kernels) and 3, step after
    step."""
    pdl = sys.modules["minillm.kernels.pdl"]
    t = torch.zeros(1, device="cuda")
    assert not pdl.use_pdl(t), "outside DecodeGraphs' warm-up and capture (`launches()`): no PDL"
    with pdl.launches():
        assert pdl.use_pdl(t) == (torch.cuda.get_device_capability()[0] >= 9 and pdl.gdc_wait is not None)
        assert not pdl.use_pdl(t.cpu())
        monkeypatch.setenv("MINILLM_PDL", "0")
        assert not pdl.use_pdl(t)
    monkeypatch.delenv("MINILLM_PDL")
    model, _ = minillm.load("shakespeare-1m", device="cuda", dtype=torch.bfloat16)
    prompts = [list(range(3, 3 + n)) for n in (7, 30, 16)]
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("MINILLM_PDL", flag)
        cache = PagedKVCache(model.config, 64, 16, device="cuda", dtype=model.dtype)
        graphs = DecodeGraphs(model, cache, max_batch=4)
        nxt, logits = prefill(model, cache, prompts), []
        for rows in ([0], [0], [0, 1, 2], [0, 1, 2], [1]):
            logits.append(graphs.run(rows, [nxt[i] for i in rows]))
            for i, token in zip(rows, logits[-1].argmax(-1).tolist()):
                nxt[i] = token
        runs.append(logits)
    for step, (with_pdl, without) in enumerate(zip(*runs)):
        assert torch.equal(with_pdl, without), f"step {step}"


@cuda_only
def test_graph_replay_matches_the_eager_step_and_generate_uses_it(monkeypatch):
    model, tok = minillm.load("shakespeare-1m", device="cuda", dtype=torch.float32)
    cache = PagedKVCache(model.config, 64, 16, device="cuda", dtype=model.dtype)
    twin = PagedKVCache(model.config, 64, 16, device="cuda", dtype=model.dtype)
    graphs = DecodeGraphs(model, cache, max_batch=8)
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and graphs.capture_seconds > 0
    prompts = [list(range(3, 3 + n)) for n in (7, 30, 16)]
    nxt = prefill(model, cache, prompts)
    assert prefill(model, twin, prompts) == nxt
    for _ in range(4):
        got = graphs.run([0, 1, 2], nxt)
        want = paged_forward(model, twin, [0, 1, 2], [[t] for t in nxt])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        nxt = got.argmax(-1).tolist()

    replays = []
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, *a, **k: replays.append(len(a[0])) or run(self, *a, **k))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    fast = minillm.generate(model, "ROMEO:", params, tok)
    assert replays == [1] * 29, "generate's 29 decode steps replay the batch-1 graph"
    monkeypatch.setenv("MINILLM_TRITON", "0")  # graphs_unavailable: the engine runs eagerly, in PyTorch
    assert minillm.generate(model, "ROMEO:", params, tok).token_ids == fast.token_ids
    assert len(replays) == 29


@cuda_only
def test_capture_survives_garbage_collection_of_another_engines_graphs():
    """Dead graphs in a reference cycle (an old engine's, say) are freed by the garbage collector whenever it runs;
    if it ran during another capture, the freeing would make that capture fail (and the engine run eagerly).
    Capture keeps the collector off, so it must succeed even with the collector eager to run."""
    import gc

    model, _ = minillm.load("shakespeare-1m", device="cuda", dtype=torch.float32)

    class Holder:  # a cycle that owns captured graphs, as a dead engine may
        pass

    old = Holder()
    old.self, old.graphs = old, DecodeGraphs(model, PagedKVCache(model.config, 32, 16, device="cuda",
                                                                 dtype=model.dtype), max_batch=4)
    del old
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # a collection at nearly every allocation
    try:
        graphs = DecodeGraphs(model, PagedKVCache(model.config, 32, 16, device="cuda", dtype=model.dtype),
                              max_batch=4)
    finally:
        gc.set_threshold(*threshold)
    assert sorted(graphs.graphs) == [1, 2, 4]
    assert gc.isenabled()


@interpreter_only
def test_the_fused_forward_equals_the_pytorch_forward(model, monkeypatch):
    """The CUDA path's fused kernels (add + RMSNorm, rotary, silu * up), forced onto CPU tensors through the
    interpreter, give the PyTorch path's logits: a prefill without a cache, then a ragged paged step."""
    import minillm.model as M

    tokens = torch.randint(0, 4096, (2, 21), generator=torch.Generator().manual_seed(0))
    runs = []
    for fused in (False, True):
        monkeypatch.setattr(M, "use_fused_kernels", lambda x, fused=fused: fused)
        cache = PagedKVCache(model.config, 16, 16)
        for i in range(2):
            cache.add_sequence(i)
        with torch.inference_mode():
            full = model(tokens)
            paged = paged_forward(model, cache, [0, 1], [tokens[0].tolist(), tokens[1, :9].tolist()])
            step = paged_forward(model, cache, [0, 1], [[5], tokens[1, 9:].tolist()])
        runs.append((full, paged, step))
    for name, eager, fused in zip(("no cache", "paged prefill", "paged mixed step"), *runs):
        torch.testing.assert_close(fused, eager, atol=1e-4, rtol=1e-4, msg=name)
