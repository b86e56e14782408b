"""How close decode gets to the memory-bandwidth roofline: minillm eager, minillm with CUDA graphs,
and `transformers`, on Llama-3.2-1B and Llama-3-8B shapes, batch 1 and batched (issue 16).

A decode step must read every weight once and each sequence's KV cache once, so it cannot take less than

    roofline = (weight bytes read + KV bytes read) / copy bandwidth

with the weights counted by `minillm.arithmetic.weight_bytes_read` and the KV cache by `kv_cache_bytes`
at the steps' mean context, and the copy bandwidth measured in this run (`decode_attention.copy_bandwidth`:
a 1 GiB device-to-device copy, bytes read plus written), not the datasheet. Each system's measured time per
decode step is compared with it: fraction of roofline = roofline / measured.

Measured, per shape and batch B (random bf16 weights, the same in both libraries; a prompt of
`--context` random tokens per sequence, then `--steps` decode steps):
- `minillm eager step`: `paged_forward` over the paged cache, one decode step at a time, as PyTorch
  launches it (minillm's Triton kernels included);
- `minillm graph step`: `DecodeGraphs.run`, the step's inputs copied in and its CUDA graph replayed;
  `graph replay` the replay alone (CUDA events), the floor of what the host adds;
- `minillm engine`: `LLMEngine` serving the B requests end to end (scheduling, sampling, stop rules,
  no tokenizer) with its decode graphs: the time per decode step of the whole loop;
- `transformers eager`: `generate` with its default dynamic cache; `transformers static`: with
  `cache_implementation="static"` (which transformers compiles with torch.compile on its first call;
  the compile is a warm-up and not timed). Time per decode step = (time of N + 1 new tokens - time of 1) / N.

A profile (torch.profiler) of the eager and graph steps at each batch sums the GPU's kernel time by kind
(matrix multiplies, attention, the rest) against the wall time: the difference is the GPU waiting for
the host.

    python benchmarks/roofline.py          # a CUDA GPU: writes results/roofline/<name>.json (--name, default cuda)

The book keeps one full run a GPU, named by it: results/roofline/cuda_h100.json and cuda_h200.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
from common import write_results
from decode_attention import copy_bandwidth
from overlap_timeline import merge

import minillm
from minillm import arithmetic
from minillm.engine import LLMEngine
from minillm.engine.cuda_graphs import DecodeGraphs
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.model_runner import paged_forward
from minillm.sampler.sampling import SamplingParams

SHAPES = {
    # meta-llama/Llama-3.2-1B config.json
    "llama-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    # meta-llama/Meta-Llama-3-8B config.json
    "llama-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
}


def timed(fn, repeats: int) -> float:  # noqa: ANN001
    """Median wall seconds of fn() over `repeats` calls, each synchronised."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefilled_cache(model, batch: int, context: int, steps: int, seed: int = 0) -> tuple[PagedKVCache, list[int]]:  # noqa: ANN001
    """A paged cache holding `batch` random prompts of `context` tokens (plus room for `steps` more each, and a
    padding block); returns it and one next token per sequence."""
    g = torch.Generator().manual_seed(seed)
    blocks = batch * arithmetic.kv_blocks(context + steps + 1, 16) + 2
    cache = PagedKVCache(model.config, blocks, 16, device="cuda", dtype=model.dtype, enable_prefix_caching=False)
    prompts = torch.randint(2, model.config.vocab_size, (batch, context), generator=g).tolist()
    for i in range(batch):
        cache.add_sequence(i)
    for i in range(0, batch, 8):  # 8 prompts per forward keeps the activations small
        ids = list(range(i, min(batch, i + 8)))
        paged_forward(model, cache, ids, [prompts[j] for j in ids])
    return cache, torch.randint(2, model.config.vocab_size, (batch,), generator=g).tolist()


def kernel_kind(name: str) -> str:
    name = name.lower()
    if any(k in name for k in ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "splitk", "matmul", "matvec")):
        return "matmul"
    if "decode_split" in name or "combine" in name or "flash" in name or "attention" in name:
        return "attention"
    if "memcpy" in name or "memset" in name:
        return "copies"
    return "other (norms, rotary, activations, casts, adds)"


def profile_steps(fn, n: int = 5) -> dict:  # noqa: ANN001
    """Run fn() n times under torch.profiler: GPU kernel time per step by kind, kernels per step, wall per step.

    gpu_busy: the share of the wall time when any kernel ran. Kernels that overlap (launched with programmatic
    dependent launch, kernels/pdl.py, a kernel counts from its start, waiting included) count once there, but
    each in full in the per-kind and per-kernel times, which may then add up to more than the step. (Results
    before 27 Nov 2026 computed gpu_busy from that sum: the same while no two kernels overlapped.)"""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / n
    kernels = gpu_kernels(prof.events(), n)
    busy = kernels["gpu_busy_us"]
    return {"wall_us": wall * 1e6, "gpu_kernel_us": sum(kernels["by_kind_us"].values()), "gpu_busy_us": busy,
            "gpu_busy": busy / (wall * 1e6) if wall else 0.0, "kernels_per_step": kernels["kernels"],
            "by_kind_us": kernels["by_kind_us"], "top_kernels_us": kernels["top_kernels_us"]}


def gpu_kernels(events, n: int = 1, top: int = 10) -> dict:  # noqa: ANN001 - torch.profiler's events
    """The GPU side of a profile of n steps, per step: kernels, busy microseconds (overlapping intervals counted
    once), microseconds by kind (`kernel_kind`) and the `top` kernels by name (names cut to 80 characters)."""
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    intervals = []
    for event in events:
        if event.device_type.name != "CUDA":
            continue
        us = event.device_time if hasattr(event, "device_time") else event.cuda_time
        by_kind[kernel_kind(event.name)] += us / n
        by_name[event.name[:80]] += us / n
        intervals.append((event.time_range.start, event.time_range.end))
    return {"kernels": len(intervals) / n, "gpu_busy_us": sum(end - begin for begin, end in merge(intervals)) / n,
            "by_kind_us": dict(by_kind), "top_kernels_us": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:top])}


def eager_steps(model, batch: int, context: int, steps: int) -> dict:  # noqa: ANN001
    """Per-step seconds of `paged_forward` decode steps on a prefilled cache, and their profile."""
    cache, tokens = prefilled_cache(model, batch, context, 2 * steps + 20)
    ids = list(range(batch))

    def step() -> None:
        paged_forward(model, cache, ids, [[t] for t in tokens])

    step()
    return {"eager_step_s": timed(step, steps), "eager_profile": profile_steps(step)}


def graph_steps(model, batch: int, context: int, steps: int, fused: bool = True) -> dict:  # noqa: ANN001
    """Per-step seconds of `DecodeGraphs.run` and of the bare replay on a prefilled cache, and the profile.

    With fused=False the graphs are captured with MINILLM_FUSED=0: the norms, rotary and activation as
    PyTorch operations (the attention kernels stay): the step before this issue's fused kernels.
    """
    cache, tokens = prefilled_cache(model, batch, context, 2 * steps + 20)
    os.environ["MINILLM_FUSED"] = "1" if fused else "0"
    try:
        graphs = DecodeGraphs(model, cache, max_batch=batch, max_seq_len=context + 2 * steps + 20)
    finally:
        os.environ.pop("MINILLM_FUSED")
    ids = list(range(batch))

    def step() -> None:
        graphs.run(ids, tokens)

    step()
    out = {"capture_s": graphs.capture_seconds, "graph_step_s": timed(step, steps)}
    if not fused:
        return {"unfused_graph_step_s": out["graph_step_s"]}
    graph = graphs.graphs[min(s for s in graphs.graphs if s >= batch)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):  # the last step's inputs again: it rewrites the same slots
        graph.replay()
    end.record()
    end.synchronize()
    out["graph_replay_s"] = start.elapsed_time(end) / 1e3 / steps
    out["graph_profile"] = profile_steps(step)
    return out


def engine_decode(model, batch: int, context: int, steps: int, async_scheduling: bool = True) -> dict:  # noqa: ANN001
    """`LLMEngine` on `batch` requests: seconds per decode-only step (its graphs captured at the first). With async
    scheduling a step() returns once the step before's tokens are read and this one's are queued, so in the steady
    state the time between two calls is the period of the loop: the slower of the host's work and the GPU's."""
    blocks = batch * arithmetic.kv_blocks(context + steps + 1, 16) + 2
    engine = LLMEngine(model, None, num_blocks=blocks, max_num_seqs=batch,
                       max_num_batched_tokens=max(8 * context, batch), enable_prefix_caching=False,
                       async_scheduling=async_scheduling)
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for p in torch.randint(2, model.config.vocab_size, (batch, context), generator=g).tolist():
        engine.add_request(None, p, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start  # ends reading sampled tokens: this step's, or (async) the last's
        plan = engine.last_step
        if plan.num_prefill_tokens == 0 and plan.num_decode_tokens == batch:
            times.append(seconds)
    capture = engine.graphs.capture_seconds if engine.graphs else None
    key = "engine_step_s" if async_scheduling else "engine_sync_step_s"
    return {key: statistics.median(times[1:]), "engine_capture_s": capture, "engine_graphs": engine.graphs is not None}


def hf_decode(hf, batch: int, context: int, steps: int, static: bool) -> dict:  # noqa: ANN001
    """transformers generate: seconds per decode step, (t(steps + 1 tokens) - t(1 token)) / steps."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, hf.config.vocab_size, (batch, context), generator=g).cuda()
    extra = {"cache_implementation": "static"} if static else {}

    def run(n: int) -> None:
        hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                    pad_token_id=0, **extra)

    start = time.perf_counter()
    with torch.inference_mode():
        run(steps + 1)  # warm-up (and, with a static cache, compilation)
        warm = time.perf_counter() - start
        one = timed(lambda: run(1), 3)
        many = timed(lambda: run(steps + 1), 3)
    return {"step_s": (many - one) / steps, "warmup_s": warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--hf", choices=["none", "eager", "both"], default="both")
    parser.add_argument("--name", default="cuda", help="the results file: results/roofline/<name>.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/roofline.py needs a CUDA GPU.")
    import transformers

    bandwidth, _ = copy_bandwidth()  # the copy kernel's rate, read + written, as chapter 03's benchmarks use
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for shape in args.shapes:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=4096)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            hf = transformers.LlamaForCausalLM(config).eval()
        torch.set_default_dtype(default)
        model = minillm.from_transformers(hf)
        for batch in args.batches:
            mean_context = args.context + args.steps // 2
            bytes_read = (arithmetic.weight_bytes_read(model.config, batch)
                          + arithmetic.kv_cache_bytes(model.config, mean_context, batch))
            row = {"shape": shape, "batch": batch, "context": args.context, "bytes_per_step": bytes_read,
                   "roofline_step_s": bytes_read / bandwidth}
            row.update(eager_steps(model, batch, args.context, args.steps))
            row.update(graph_steps(model, batch, args.context, args.steps))
            row.update(graph_steps(model, batch, args.context, args.steps, fused=False))
            torch.cuda.empty_cache()
            row.update(engine_decode(model, batch, args.context, args.steps, async_scheduling=False))
            row.update(engine_decode(model, batch, args.context, args.steps, async_scheduling=True))
            if args.hf != "none":
                row["hf_eager"] = hf_decode(hf, batch, args.context, args.steps, static=False)
                if args.hf == "both" and batch == 1:
                    try:
                        row["hf_static"] = hf_decode(hf, batch, args.context, args.steps, static=True)
                    except Exception as error:  # noqa: BLE001 - report why, keep the rest of the run
                        row["hf_static"] = {"error": f"{type(error).__name__}: {error}"[:400]}
            roof = row["roofline_step_s"]
            for key in ("eager_step_s", "unfused_graph_step_s", "graph_step_s", "graph_replay_s", "engine_sync_step_s",
                        "engine_step_s"):
                row[key[:-2] + "_fraction"] = roof / row[key]
            for key in ("hf_eager", "hf_static"):
                if key in row and "step_s" in row[key]:
                    row[key]["fraction"] = roof / row[key]["step_s"]
            rows.append(row)
            print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()
                   if not isinstance(v, dict)}, flush=True)
        del hf, model
        torch.cuda.empty_cache()

    path = write_results(f"roofline/{args.name}", {"copy_bandwidth_bytes_per_s": bandwidth, "context": args.context,
                                     "steps": args.steps, "rows": rows})
    print(f"\nwrote {path}\n")
    columns = ["eager", "unfused graph", "graph step", "replay", "engine sync", "engine", "|", "hf eager", "hf static"]
    print(f"{'shape':9} {'B':>3} {'roofline':>9} | " + " ".join(c if c == "|" else f"{c:>13}" for c in columns))

    def cell(seconds: float | None) -> str:
        return f"{seconds * 1e3:6.2f}ms {row['roofline_step_s'] / seconds:4.0%}" if seconds else f"{'-':>13}"

    for row in rows:
        hf_static = row.get("hf_static", {}).get("step_s")
        print(f"{row['shape']:9} {row['batch']:>3} {row['roofline_step_s'] * 1e3:7.2f}ms | "
              + " ".join(cell(row[k]) for k in ("eager_step_s", "unfused_graph_step_s", "graph_step_s",
                                                   "graph_replay_s", "engine_sync_step_s", "engine_step_s"))
              + f" | {cell(row.get('hf_eager', {}).get('step_s'))} {cell(hf_static)}")
    for row in rows:
        for key in ("eager_profile", "graph_profile"):
            p = row[key]
            kinds = ", ".join(f"{k.split(' ')[0]} {v:.0f}" for k, v in p["by_kind_us"].items())
            print(f"{row['shape']} B={row['batch']} {key[:-8]:5}: wall {p['wall_us']:.0f} us, GPU busy "
                  f"{p['gpu_busy']:.0%}, {p['kernels_per_step']:.0f} kernels/step; us: {kinds}")


if __name__ == "__main__":
    main()
