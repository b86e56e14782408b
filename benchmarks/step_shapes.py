"""Every step shape on the GPU: a mixed step, streaming under arriving long prompts, a long prefill, prefill attention.

Issue 53's measurements, one H200 (or any CUDA GPU), Llama-3.2-1B's shape with random bf16 weights (seed 0):

- `mixed`: 32 rows decoding at 512 tokens of context; then four 4,096-token prompts arrive and chunked prefill
  (token budget 512) carries a ~480-token chunk beside the 32 rows in each step. Step wall times (p50) of the
  decode-only steps before, and of the mixed steps; `chunk_matmul_s` is the chunk's matmul FLOPs at the bf16 matmul
  rate measured in the same run (8192^3, `matmul_tflops`). The issue's goal: mixed <= decode-only + 1.5 x chunk.
- `itl`: the same run read as inter-token latency of the 32 streams (each step gives each row one token):
  the p50 of decode-only steps, and the p99 of the steps while the long prompts are chunked in.
- `prefill`: one 4,096-token prompt alone in one step (budget 4,096): seconds, and its FLOPs (the linear layers'
  and causal attention's) over the measured matmul rate.
- `attention`: causal prefill attention at 4k and 8k keys, 32 query and 8 KV heads, head_dim 64 and 128, bf16: the
  paged prefill kernel reading a paged pool (`minillm.kernels.paged_prefill_attention`) and PyTorch's SDPA (the
  best of its flash, efficient and cuDNN backends, on K/V expanded to 32 heads beforehand) in TFLOP/s
  (2 T^2 d H FLOPs for causal attention).
- `throughput_roofline_fraction`: the offline run of `benchmarks/engine_throughput.py` (256 requests, 1B shape,
  minillm only), the step roofline's seconds over the measured ones; `throughput` holds its tok/s and seconds.
- `speculative`: `benchmarks/speculative_controlled.py`'s 8B/1B pair (acceptance built in at alpha 0 and 0.8, k = 4,
  batch 1 and 8) against the plain engine, with chapter 07's prediction from the GPU costs measured in the run.

`--paths` runs the engine's paths for steps with prompt work, in one process, for an A/B in one lease: `graphs` (as
the engine runs: a packed forward replayed as a CUDA graph of its token bucket), `packed` (the same forward, eager)
and `split` (the earlier path: decode rows as their own forward, a prompt chunk's keys gathered then SDPA with a
mask). Writes results/step_shapes/<name>.json (default cuda).

    python benchmarks/step_shapes.py --paths graphs packed split --name cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import engine_throughput
import speculative_controlled
import torch
import torch.nn.functional as F
from common import write_results
from engine_throughput import LLAMA_1B

from minillm import SamplingParams
from minillm.decoding.llm import LLM


def random_llama_1b_8k():  # noqa: ANN201 - minillm.Transformer
    """Llama-3.2-1B's shape with random bf16 weights (seed 0) on the GPU, with an 8,192-token context: room for a
    4,096-token prompt and its answer (engine_throughput.py's model stops at 4,096)."""
    import transformers

    import minillm

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**LLAMA_1B, "max_position_embeddings": 8192})
    return minillm.from_transformers(transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval())


def cuda_time(fn, reps: int = 20) -> float:  # noqa: ANN001
    """Median seconds of fn() over `reps` runs, by CUDA events, after two warm-up runs."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def matmul_tflops() -> float:
    """The bf16 matmul rate this GPU reaches on a large square product (8192^3), TFLOP/s."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / cuda_time(lambda: a @ b) / 1e12


def linear_params(config) -> int:  # noqa: ANN001
    """Weights every token multiplies by in the blocks' linear layers. The LM head is left out: a step computes
    logits for each sequence's last token only (`last_only`), one row of it per sequence, not per token."""
    d, f, L = config.dim, config.ffn_dim, config.n_layers
    qkv = d * (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
    return L * (qkv + config.n_heads * config.head_dim * d + 3 * d * f)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def timed_steps(engine, done) -> list[tuple[float, int]]:  # noqa: ANN001
    """Step the engine until done(engine); each step's wall time and its prompt tokens (from the scheduler). With
    async scheduling a call's wall time is one step's host work plus its wait for the step before: in a steady
    stream, the time between two steps' tokens."""
    out = []
    while not done(engine):
        start = time.perf_counter()
        engine.step(finished_only=True)
        out.append((time.perf_counter() - start, engine.last_step.num_prefill_tokens))
    return out


def prompts_done(engine, request_ids=None) -> bool:  # noqa: ANN001
    """Whether every prompt (of `request_ids`, default all) is computed: no step has prompt work left."""
    return not any(s.is_prefill for s in engine.scheduler.sequences.values()
                   if request_ids is None or s.request_id in request_ids)


PATHS = ("graphs", "packed", "split")


def choose_path(engine, path: str) -> None:  # noqa: ANN001
    """graphs: the engine as it is (mixed steps replayed as CUDA graphs); packed: the same packed forward run
    eagerly; split: the earlier path, a decode forward (its graphs) plus a prompt forward with gathered keys."""
    runner = engine.model_runner
    if path == "graphs" and runner.mixed_graphs is None:
        sys.exit("--paths graphs: no mixed-step graphs were captured (is MINILLM_MIXED_GRAPHS=0 set?).")
    if path != "graphs":
        runner.mixed_graphs = None
    runner.packed_in_place = path != "split"


def mixed_and_itl(model, path: str, rows: int = 32, context: int = 512, long_len: int = 4096,  # noqa: ANN001
                  n_long: int = 4, budget: int = 512, decode_steps: int = 60, max_tokens: int = 2000) -> dict:
    """`rows` rows decoding at `context`, then `n_long` prompts of `long_len` arriving: step times by kind."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    llm = LLM(model, None, max_num_seqs=64, max_num_batched_tokens=budget, num_blocks=rows * 48 + n_long * 300)
    engine = llm.engine
    choose_path(engine, path)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(rows):
        engine.add_request(None, torch.randint(2, vocab, (context - 1,), generator=gen).tolist(), params)
    timed_steps(engine, prompts_done)
    for _ in range(5):  # the first decode steps (async scheduling starting up) are not timed
        engine.step(finished_only=True)
    decode = []
    for _ in range(decode_steps):
        start = time.perf_counter()
        engine.step(finished_only=True)
        decode.append(time.perf_counter() - start)
    long_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    long_ids = {engine.add_request(None, torch.randint(2, vocab, (long_len,), generator=gen).tolist(), long_params)
                for _ in range(n_long)}
    chunked = timed_steps(engine, lambda e: prompts_done(e, long_ids))
    mixed = [t for t, p in chunked if p]
    for rid in {s.request_id for s in engine.scheduler.sequences.values()}:
        engine.abort_request(rid)
    graphs = engine.model_runner.mixed_graphs
    captured = {"capture_s": graphs.capture_seconds, "token_buckets": graphs.sizes} if graphs is not None else {}
    return {**captured, "decode_rows": rows, "context": context, "mixed_steps": len(mixed),
            "chunk_tokens": statistics.median([p for _, p in chunked if p]) if mixed else 0,
            "decode_only_step_s": statistics.median(decode),
            "mixed_step_s": statistics.median(mixed) if mixed else None,
            "mixed_step_max_s": max(mixed) if mixed else None,
            "itl": {"decode_only_p50_s": statistics.median(decode),
                    "chunked_p99_s": percentile([t for t, _ in chunked], 0.99),
                    "chunked_p50_s": statistics.median([t for t, _ in chunked])}}


def prefill(model, path: str, tokens: int = 4096) -> float:  # noqa: ANN001
    """Seconds of one step that prefills a `tokens`-token prompt alone (median of 5, after a warm-up)."""
    llm = LLM(model, None, max_num_seqs=4, max_num_batched_tokens=tokens, num_blocks=tokens // 16 + 8,
              enable_prefix_caching=False)
    engine = llm.engine
    choose_path(engine, path)
    gen = torch.Generator().manual_seed(2)
    times = []
    for i in range(6):
        engine.add_request(None, torch.randint(2, model.config.vocab_size, (tokens,), generator=gen).tolist(),
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step(finished_only=True)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention(seqlen: int, head_dim: int, heads: int = 32, kv_heads: int = 8) -> dict:
    """Causal prefill attention of one sequence: the paged prefill kernel on a paged pool against SDPA's best."""
    from minillm.kernels import paged_prefill_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(seqlen, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    bs = 16
    blocks = torch.randperm(seqlen // bs, device="cuda", generator=g)  # the sequence's blocks, in a shuffled pool
    k_pool = torch.empty(seqlen // bs, bs, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.empty_like(k_pool)
    k_pool[blocks], v_pool[blocks] = k.view(-1, bs, kv_heads, head_dim), v.view(-1, bs, kv_heads, head_dim)
    tables = blocks[None].to(torch.int32)
    starts = torch.tensor([0, seqlen], device="cuda", dtype=torch.int32)
    lens = torch.tensor([seqlen], device="cuda", dtype=torch.int32)
    ours = cuda_time(lambda: paged_prefill_attention(q, k_pool, v_pool, tables, starts, lens, seqlen))
    qh = q.transpose(0, 1)[None]
    kh = k.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)[None].contiguous()
    vh = v.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)[None].contiguous()
    sdpa = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                sdpa[name] = cuda_time(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True))
        except RuntimeError as e:  # a backend this build or GPU lacks
            sdpa[name] = f"unavailable: {str(e).splitlines()[0][:80]}"
    best = min(t for t in sdpa.values() if isinstance(t, float))
    flops = 2 * seqlen**2 * head_dim * heads  # causal: half of 4 T^2 d H
    return {"seqlen": seqlen, "head_dim": head_dim, "causal": True, "heads": heads, "kv_heads": kv_heads,
            "minillm_tflops": flops / ours / 1e12, "sdpa_tflops": flops / best / 1e12,
            "sdpa_backends_s": sdpa, "minillm_s": ours}


SWEEP = [(bm, bn, w, st) for bm, bn in ((64, 64), (128, 32), (128, 64), (128, 128), (256, 64)) for w in (4, 8)
         for st in (2, 3)]


def sweep(seqlen: int, head_dim: int, heads: int = 32, kv_heads: int = 8) -> list[dict]:
    """The paged prefill kernel's tiles (rows, keys, warps, stages) at one causal shape: seconds each (or why not)."""
    from minillm.kernels import paged_prefill_attention

    bs = 16
    q = torch.randn(seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k_pool = torch.randn(seqlen // bs, bs, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(seqlen // bs, device="cuda")[None].to(torch.int32)
    starts = torch.tensor([0, seqlen], device="cuda", dtype=torch.int32)
    lens = torch.tensor([seqlen], device="cuda", dtype=torch.int32)
    out = []
    for bm, bn, w, st in SWEEP:
        tiles = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st}
        try:
            t = cuda_time(lambda t=tiles: paged_prefill_attention(q, k_pool, v_pool, tables, starts, lens, seqlen, **t),
                          reps=10)
            out.append({"block_m": bm, "block_n": bn, "warps": w, "stages": st, "seconds": t,
                        "tflops": 2 * seqlen**2 * head_dim * heads / t / 1e12})
        except Exception as e:  # noqa: BLE001 - tiles too large for shared memory: recorded, not fatal
            out.append({"block_m": bm, "block_n": bn, "warps": w, "stages": st, "error": str(e).splitlines()[0][:80]})
    return out


def speculative(alphas: tuple[float, ...] = (0.0, 0.8), k: int = 4, batches: tuple[int, ...] = (1, 8)) -> list[dict]:
    """Speculative decoding at real sizes, the goal's rows: `benchmarks/speculative_controlled.py`'s pair (an
    8B-shaped target scripted to accept a real 1B draft forward's proposals at a chosen alpha) run in this process,
    against the plain engine. Each row: {shape, k, alpha (set), measured_alpha, batch, speedup, predicted (chapter
    07's formula with the verify and draft costs measured in GPU time)}."""
    out = Path(tempfile.mkdtemp()) / "speculative_controlled"
    speculative_controlled.main(["--alphas", *map(str, alphas), "--ks", str(k), "--adaptive-ks",
                                 "--batches", *map(str, batches), "--name", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    return [{"shape": "llama-3-8B target, llama-3.2-1B draft", "k": r["k"], "alpha": r["alpha"],
             "measured_alpha": r["measured_alpha"], "batch": r["batch"], "speedup": r["speedup"],
             "predicted": r["predicted"], "tokens_equal_plain": r["tokens_equal_plain"]} for r in rows]


def throughput_roofline_fraction(requests: int = 256) -> dict:
    """The offline throughput run of `benchmarks/engine_throughput.py` (256 requests of 100-1,024 tokens in and out,
    the 1B shape, its warm-up and roofline), minillm only: its output tokens/s and the step roofline's share of its
    time."""
    _, model = engine_throughput.random_llama_1b()
    reqs = engine_throughput.make_requests(requests, 100, 1024, LLAMA_1B["vocab_size"])
    run, gpu, roof = engine_throughput.warm_run_with_roofline(model, reqs, 256, 8192)
    return {"requests": requests, "output_tokens_per_s": run["output_tokens_per_s"], "seconds": run["seconds"],
            "roofline_gpu": gpu, "roofline_seconds": roof, "fraction": roof / run["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--name", default="cuda")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also sweep the paged prefill kernel's tiles")
    parser.add_argument("--skip-speculative", action="store_true", help="leave out the 8B/1B speculative rows")
    parser.add_argument("--skip-throughput", action="store_true", help="leave out the offline throughput run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/step_shapes.py needs a CUDA GPU.")
    model = random_llama_1b_8k()
    peak = matmul_tflops()
    per_token = 2 * linear_params(model.config)
    results = {"benchmark": "issue 53's step shapes, Llama-3.2-1B's shape, random bf16 weights",
               "model": {**LLAMA_1B, "max_position_embeddings": 8192},
               "matmul_tflops": peak, "paths": {}}
    for path in args.paths:
        mixed = mixed_and_itl(model, path)
        mixed["chunk_matmul_s"] = per_token * mixed["chunk_tokens"] / (peak * 1e12)
        seconds = prefill(model, path)
        c = model.config
        flops = per_token * 4096 + 2 * 4096**2 * c.head_dim * c.n_heads * c.n_layers
        results["paths"][path] = {"mixed": {k: v for k, v in mixed.items() if k != "itl"}, "itl": mixed["itl"],
                                  "prefill": {"tokens": 4096, "seconds": seconds,
                                              "fraction_of_peak": flops / seconds / (peak * 1e12)}}
        print(path, {k: (round(v * 1e3, 2) if isinstance(v, float) and v < 10 else v) for k, v in mixed.items()
                     if k != "itl"}, "itl", {k: round(v * 1e3, 2) for k, v in mixed["itl"].items()},
              f"prefill {seconds * 1e3:.1f} ms", flush=True)
    if not args.skip_attention:
        results["attention"] = [attention(T, d) for d in (64, 128) for T in (4096, 8192)]
        for a in results["attention"]:
            print(f"attention T={a['seqlen']} d={a['head_dim']}: minillm {a['minillm_tflops']:.0f} TFLOP/s, "
                  f"sdpa best {a['sdpa_tflops']:.0f}", flush=True)
    if args.sweep:
        results["sweep"] = {f"T{T}_d{d}": sweep(T, d) for d in (64, 128) for T in (4096,)}
        for key, rows in results["sweep"].items():
            best = sorted((r for r in rows if "tflops" in r), key=lambda r: -r["tflops"])[:3]
            print("sweep", key, [(r["block_m"], r["block_n"], r["warps"], r["stages"], round(r["tflops"]))
                                 for r in best])
    del model
    torch.cuda.empty_cache()
    if not args.skip_throughput:
        results["throughput"] = throughput_roofline_fraction()
        results["throughput_roofline_fraction"] = results["throughput"]["fraction"]
        print(f"offline throughput: {results['throughput']['output_tokens_per_s']:,.0f} output tok/s, "
              f"{results['throughput_roofline_fraction']:.0%} of the step roofline", flush=True)
        torch.cuda.empty_cache()
    if not args.skip_speculative:
        results["speculative"] = speculative()
        for r in results["speculative"]:
            print(f"speculative k={r['k']} alpha={r['alpha']} batch {r['batch']}: {r['speedup']:.2f}x "
                  f"(predicted {r['predicted'] or float('nan'):.2f}x)", flush=True)
    print(write_results(f"step_shapes/{args.name}", results))


if __name__ == "__main__":
    main()
