"""Prefill vs decode on real hardware, against the roofline of `minillm.arithmetic` (chapter 02).

A Llama-shaped model with random weights (the timing of a forward pass does not depend on the
values) runs three sweeps:

1. decode step time vs batch size at a fixed context: every weight is read once per step
   whatever the batch, so the step barely slows down until compute catches up;
2. decode step time vs context length at batch 1 and a larger batch: the KV cache read grows;
3. prefill time vs prompt length at batch 1: tokens/s and the fraction of peak FLOP/s reached.

Each row carries the roofline prediction (`arithmetic.decode_step_time` / `prefill_time`) and the
fraction of the datasheet bandwidth (MBU) or FLOP/s (MFU) the measured time implies. Decode
steps run against a cache whose first `context` positions are marked filled (their values do
not change the time). Times are medians of repeated runs after a warm-up, synchronised on CUDA.

On CUDA each step is timed twice: run eagerly from Python, and replayed as a CUDA graph. The
graph time (`step_ms`, `prefill_ms`) is the GPU's own time for the work, the number the roofline
predicts; the eager time (`eager_step_ms`) adds the host's cost of launching ~15 kernels per
layer one by one, which on a fast GPU can exceed the work itself.

    python benchmarks/phases.py --device cuda              # llama-3-8b, bf16 -> results/phases/cuda_llama-3-8b.json
    python benchmarks/phases.py --device cpu --model shipped --batches 1 2 4 --contexts 64 128 \
        --prompt-lens 64 128 --decode-context 64         # a quick CPU run of the shipped model
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from attention import datasheet  # the GPU name -> GPUSpec lookup lives beside the kernel benchmark
from common import results_name, write_results

from minillm import arithmetic
from minillm.checkpoints import load
from minillm.contiguous_cache import KVCache
from minillm.decoding.generation import decode_one_token, prefill
from minillm.model import Transformer


def build_model(name: str, device: torch.device, dtype: torch.dtype, max_len: int) -> Transformer:
    """The shipped model, or a random-weight model of an `arithmetic.PRESETS` shape, on `device`."""
    if name == "shipped":
        model, _ = load("shakespeare-11m", device=device, dtype=dtype)
        return model
    config = arithmetic.preset(name)
    config.max_seq_len = max(config.max_seq_len, max_len)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(config)
    return model.to(dtype).eval()


def median_time(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` over `repeats` runs (after `warmup`), synchronising on CUDA."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def graph_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of one replay of `fn` captured as a CUDA graph: the GPU's time for the work,
    without the Python and kernel-launch overhead of running it eagerly (what serving engines do)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (allocations, autotuning)
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    seconds = median_time(graph.replay, torch.device("cuda"), repeats)
    del graph
    return seconds


def measured_ceilings(device: torch.device, dtype: torch.dtype) -> dict:
    """The two roofs as this machine reaches them: a large matrix product and a large copy.

    FLOP/s from an [n, n] x [n, n] product (2 n^3 FLOPs); bytes/s from copying a 1 GiB tensor
    (bytes read + bytes written over the time). Inputs are random, never zeros.
    """
    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    mm = median_time(lambda: a @ b, device, repeats=10)
    numel = (2**30 if device.type == "cuda" else 2**26) // torch.finfo(dtype).bits * 8
    src = torch.randn(numel, device=device).to(dtype)
    dst = torch.empty_like(src)
    cp = median_time(lambda: dst.copy_(src), device, repeats=10)
    return {"matmul_n": n, "matmul_tflops": 2 * n**3 / mm / 1e12,
            "copy_bytes": 2 * src.numel() * src.element_size(),
            "copy_gbs": 2 * src.numel() * src.element_size() / cp / 1e9}


def decode_step_seconds(model: Transformer, batch: int, context: int, repeats: int) -> tuple[float, float | None]:
    """Median time of one decode step for `batch` sequences that each hold `context` tokens:
    (run eagerly, replayed as a CUDA graph or None on the CPU)."""
    cache = KVCache(model.config, batch, context + 1, model.device, model.dtype)
    token = torch.zeros(batch, 1, dtype=torch.long, device=model.device)

    def step() -> None:
        cache.seq_len = context  # the same position every time: a cache of `context` tokens
        decode_one_token(model, token, cache)

    eager = median_time(step, model.device, repeats)
    return eager, graph_time(step, repeats) if model.device.type == "cuda" else None


def prefill_seconds(model: Transformer, prompt_len: int, repeats: int) -> tuple[float, float | None]:
    """Median time to prefill one prompt of `prompt_len` tokens into a fresh cache: (eager, graph or None)."""
    cache = KVCache(model.config, 1, prompt_len, model.device, model.dtype)
    tokens = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=model.device,
                           generator=torch.Generator(model.device).manual_seed(0))

    def run() -> None:
        cache.reset()
        prefill(model, tokens, cache)

    eager = median_time(run, model.device, repeats)
    return eager, graph_time(run, repeats) if model.device.type == "cuda" else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="llama-3-8b", help="an arithmetic.PRESETS key, or 'shipped'")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--decode-context", type=int, default=1024, help="context of the batch sweep")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--context-batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 64, 128, 256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="the results file: results/phases/<out>.json "
                        "(default <device>_<model>)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    max_len = max(args.contexts + args.prompt_lens + [args.decode_context]) + 1
    model = build_model(args.model, device, dtype, max_len)
    config = model.config
    dtype_bytes = torch.finfo(dtype).bits // 8
    spec = datasheet(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory) \
        if device.type == "cuda" else None

    def roofline(step: arithmetic.Roofline, seconds: float) -> dict:
        row = {"roofline_ms": step.time_s * 1e3 if spec else None, "bound": step.bound if spec else None,
               "flops": step.flops, "bytes": step.bytes_moved}
        row["achieved_tflops"] = step.flops / seconds / 1e12
        row["achieved_gbs"] = step.bytes_moved / seconds / 1e9
        if spec:
            row["mfu"] = step.flops / seconds / spec.peak_flops
            row["mbu"] = step.bytes_moved / seconds / spec.memory_bandwidth
        return row

    ceilings = measured_ceilings(device, dtype)
    print(f"measured ceilings: {ceilings['matmul_tflops']:.1f} TFLOP/s (matmul), "
          f"{ceilings['copy_gbs']:.0f} GB/s (copy)", flush=True)
    gpu = spec or arithmetic.GPU_SPECS["h100-sxm"]  # the CPU rows still record flops and bytes
    bits = dtype_bytes * 8
    batch_rows = []
    for batch in args.batches:
        eager, graph = decode_step_seconds(model, batch, args.decode_context, args.repeats)
        s = graph or eager
        step = arithmetic.decode_step_time(config, gpu, args.decode_context, batch, bits, dtype_bytes)
        batch_rows.append({"batch": batch, "context": args.decode_context, "step_ms": s * 1e3,
                           "eager_step_ms": eager * 1e3, "tokens_per_s": batch / s, **roofline(step, s)})
        print(f"decode  batch {batch:>4} ctx {args.decode_context:>5}: {s * 1e3:8.2f} ms/step "
              f"(eager {eager * 1e3:6.2f}) {batch / s:>10,.0f} tok/s", flush=True)
    context_rows = []
    for batch in args.context_batches:
        for context in args.contexts:
            eager, graph = decode_step_seconds(model, batch, context, args.repeats)
            s = graph or eager
            step = arithmetic.decode_step_time(config, gpu, context, batch, bits, dtype_bytes)
            context_rows.append({"batch": batch, "context": context, "step_ms": s * 1e3, "eager_step_ms": eager * 1e3,
                                 **roofline(step, s)})
            print(f"decode  batch {batch:>4} ctx {context:>5}: {s * 1e3:8.2f} ms/step (eager {eager * 1e3:6.2f})",
                  flush=True)
    prefill_rows = []
    for n in args.prompt_lens:
        eager, graph = prefill_seconds(model, n, max(3, args.repeats // 2))
        s = graph or eager
        step = arithmetic.prefill_time(config, gpu, n, 1, bits, dtype_bytes)
        prefill_rows.append({"prompt_len": n, "prefill_ms": s * 1e3, "eager_prefill_ms": eager * 1e3,
                             "tokens_per_s": n / s, **roofline(step, s)})
        print(f"prefill {n:>5} tokens: {s * 1e3:8.2f} ms (eager {eager * 1e3:6.2f}) {n / s:>10,.0f} tok/s", flush=True)

    results = {
        "benchmark": "prefill vs decode: step time vs batch, context and prompt length, against the roofline",
        "settings": {"model": args.model, "params": arithmetic.param_count(config), "dtype": str(dtype).split(".")[-1],
                     "device": device.type, "repeats": args.repeats,
                     "weights": "random (timing does not depend on the values)" if args.model != "shipped"
                     else "the shipped checkpoint"},
        "datasheet": None if spec is None else {"key": next(k for k, v in arithmetic.GPU_SPECS.items() if v is spec),
                                                "name": spec.name, "peak_tflops": spec.peak_flops / 1e12,
                                                "bandwidth_gbs": spec.memory_bandwidth / 1e9,
                                                "memory_gb": spec.memory_bytes / 1e9},
        "measured_ceilings": ceilings,
        "decode_vs_batch": batch_rows,
        "decode_vs_context": context_rows,
        "prefill_vs_length": prefill_rows,
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        results["gpu_memory"] = {"total_bytes": total, "total_gib": total / 2**30, "total_gb": total / 1e9,
                                 "datasheet_gb": spec.memory_bytes / 1e9 if spec else None}
    path = write_results(results_name("phases", args.out, f"{device.type}_{args.model}"), results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
