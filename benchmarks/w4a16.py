"""W4A16 against bf16 on the linear layers of a Llama-3-8B decode step, by batch (chapter 06).

For every batch size, the 32 layers' four linears (qkv 4096 -> 6144, o 4096 -> 4096, gate_up
4096 -> 28672, down 14336 -> 4096; random weights, 7.0B parameters, 14 GB in bf16) run one after
another, as in one decode step, in three ways:

* bf16: `x @ W.T` (cuBLAS);
* W4A16 fused: minillm's Triton kernels (`minillm.kernels.w4a16`) on int4 weights in groups of 128
  with fp16 scales and zeros, in the kernels' layout (the GEMV and the tiled GEMM are both timed for
  batches up to 4, the GEMM above; each kernel's tile sizes picked per shape and batch from a sweep,
  all reported);
* PyTorch's own int4 kernel (`torch.ops.aten._weight_int4pack_mm`, tinygemm, what torchao and gpt-fast
  use), where this torch has it: a yardstick of what a hand-written CUDA kernel reaches on this GPU;
* W4A16 naive: dequantise each weight to bf16 with PyTorch operations (`w4a16_dequantize`), then the
  bf16 matmul.

All weights of all 32 layers are distinct tensors (about 3.7 GB at int4, 14 GB at bf16), so nothing is
served from the 50 MB L2 cache. Each variant is captured in a CUDA graph and timed with
`triton.testing.do_bench_cudagraph` (median), so that launch overhead is the GPU's, not Python's.
Correctness: each kernel against the fp64 dequantised reference on fresh inputs, as relative error.
The lm_head (4096 x 128256, bf16 in both) and attention are left out: see the chapter for the whole step.

    python benchmarks/w4a16.py       # on a CUDA GPU: results/w4a16/cuda.json
"""

from __future__ import annotations

import argparse

import torch
import triton
from common import write_results
from minillm.kernels.w4a16 import GEMV_MAX_ROWS, w4a16_dequantize, w4a16_gemm, w4a16_gemv, w4a16_pack, w4a16_reference

from minillm.quant import quantize_int

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
GROUP = 128
# block_n * words_per_thread <= 32 words a thread: above, the kernel runs out of registers and spills
# (the sweep of 2026-11-25 over block_n 2-16, words_per_thread 2-8, num_warps 1-8 and split_k 1-2 kept these)
GEMV_CONFIGS = [dict(block_n=bn, words_per_thread=4, num_warps=w, prefetch=pf) for bn, w in
                [(4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)] for pf in (False, True)]
GEMM_CONFIGS = [dict(block_m=bm, block_n=bn, num_warps=w) for bm, bn, w in
                [(16, 16, 1), (16, 32, 1), (16, 32, 2), (16, 64, 4), (16, 128, 4), (64, 64, 4), (64, 128, 4),
                 (128, 128, 8)]]


def int4_weights(n_layers: int) -> dict[str, list[tuple]]:
    """Per shape, n_layers of (W4A16Weight, bf16 copy, tinygemm's packed weight or None) of random weights."""
    out = {}
    for name, (N, K) in SHAPES.items():
        layers = []
        for _ in range(n_layers):
            w = torch.randn(N, K, device="cuda") * 0.02
            q = quantize_int(w, 4, GROUP, symmetric=False)
            layers.append((w4a16_pack(q), w.to(torch.bfloat16), tinygemm_pack(q)))
            del w, q
        out[name] = layers
    return out


def tinygemm_pack(q) -> tuple | None:  # noqa: ANN001
    """PyTorch's int4 kernel's own layout (timing only: its zero convention differs, so the values do too)."""
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack(q.codes, 8)  # uint8 [N, K/2] since torch 2.5
        sz = torch.stack((q.scale, q.zero), -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/G, N, 2]
        return packed, sz
    except (RuntimeError, AttributeError) as e:  # not in this build: the yardstick is left out
        print(f"tinygemm unavailable: {type(e).__name__}: {str(e)[:200]}")
        return None


def time_graph(fn) -> float:  # noqa: ANN001
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def check() -> dict[str, float]:
    """Relative error of each kernel vs the fp64 reference on fresh problems, by batch."""
    errs = {}
    for M in (1, 3, 37):
        for N, K in ((4096, 4096), (4096, 14336)):
            w = torch.randn(N, K, device="cuda") * 0.02
            weight = w4a16_pack(quantize_int(w, 4, GROUP, symmetric=False))
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = w4a16_reference(x.double(), weight)
            for name, out in [("gemv", w4a16_gemv(x, weight, split_k=2)), ("gemm", w4a16_gemm(x, weight))]:
                errs[f"{name} M={M} N={N} K={K}"] = ((out.double() - ref).norm() / ref.norm()).item()
    return errs


def sweep(kernel, configs, x, layers) -> tuple[float, dict, list]:  # noqa: ANN001
    """The fastest config of `kernel` on all layers of one shape: (ms, config, every config's ms)."""
    best, tried = None, []
    for cfg in configs:
        try:
            t = time_graph(lambda cfg=cfg: [kernel(x, wt, **cfg) for wt, _, _ in layers])
        except (ValueError, RuntimeError, triton.CompilationError) as e:  # a config that does not fit this shape
            tried.append({**cfg, "error": f"{type(e).__name__}: {str(e)[:80]}"})
            continue
        tried.append({**cfg, "ms": t})
        if best is None or t < best[0]:
            best = (t, cfg)
    return best[0], best[1], tried


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 16, 64, 256])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    errors = check()
    print("relative error vs fp64:", {k: f"{v:.1e}" for k, v in errors.items()})
    weights = int4_weights(args.layers)
    has_tinygemm = all(t is not None for layers in weights.values() for _, _, t in layers)
    rows = []
    for M in args.batches:
        xs = {name: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for name, (N, K) in SHAPES.items()}
        per_shape = {}
        for name in SHAPES:
            x, layers = xs[name], weights[name]
            r = {"bf16_ms": time_graph(lambda x=x, ls=layers: [x @ wb.T for _, wb, _ in ls]),
                 "naive_ms": time_graph(lambda x=x, ls=layers: [x @ w4a16_dequantize(wt, torch.bfloat16).T
                                                                for wt, _, _ in ls])}
            r["gemm_ms"], r["gemm_config"], r["gemm_sweep"] = sweep(w4a16_gemm, GEMM_CONFIGS, x, layers)
            if M <= GEMV_MAX_ROWS:
                r["gemv_ms"], r["gemv_config"], r["gemv_sweep"] = sweep(w4a16_gemv, GEMV_CONFIGS, x, layers)
            r["w4a16_ms"] = min(r["gemm_ms"], r.get("gemv_ms", float("inf")))
            if has_tinygemm:
                xt = x.to(torch.bfloat16)
                r["tinygemm_ms"] = time_graph(lambda xt=xt, ls=layers: [
                    torch.ops.aten._weight_int4pack_mm(xt, t[0], GROUP, t[1]) for _, _, t in ls])
            per_shape[name] = r
            print(f"  batch {M} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k.endswith("_ms")))
        keys = ["bf16_ms", "w4a16_ms", "gemm_ms", "naive_ms"] + (["gemv_ms"] if M <= GEMV_MAX_ROWS else []) + (
            ["tinygemm_ms"] if has_tinygemm else [])
        total = {k: sum(v[k] for v in per_shape.values()) for k in keys}
        row = {"batch": M, **total, "speedup_fused": total["bf16_ms"] / total["w4a16_ms"],
               "speedup_naive": total["bf16_ms"] / total["naive_ms"], "per_shape": per_shape}
        if has_tinygemm:
            row["speedup_tinygemm"] = total["bf16_ms"] / total["tinygemm_ms"]
        rows.append(row)
        print(f"batch {M:>4}: bf16 {total['bf16_ms']:.3f} ms, W4A16 {total['w4a16_ms']:.3f} ms "
              f"({row['speedup_fused']:.2f}x), naive {total['naive_ms']:.3f} ms ({row['speedup_naive']:.2f}x)"
              + (f", tinygemm {total['tinygemm_ms']:.3f} ms ({row['speedup_tinygemm']:.2f}x)" if has_tinygemm else ""))
    bytes_bf16 = sum(2 * N * K for N, K in SHAPES.values()) * args.layers
    bytes_int4 = sum(N * K // 2 + 4 * N * K // GROUP for N, K in SHAPES.values()) * args.layers
    path = write_results("w4a16/cuda", {
        "layers": args.layers, "shapes": SHAPES, "group_size": GROUP, "weight_bytes_bf16": bytes_bf16,
        "weight_bytes_w4a16": bytes_int4, "relative_error_vs_fp64": errors, "rows": rows,
    })
    print(f"\nwrote {path}\n{'batch':>5} {'bf16 ms':>8} {'W4A16 ms':>9} {'speed-up':>8} {'naive ms':>9} {'naive x':>7}"
          f" {'tinygemm x':>10} {'bf16 GB/s':>9} {'W4A16 GB/s':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['bf16_ms']:>8.3f} {r['w4a16_ms']:>9.3f} {r['speedup_fused']:>8.2f} "
              f"{r['naive_ms']:>9.3f} {r['speedup_naive']:>7.2f} {r.get('speedup_tinygemm', float('nan')):>10.2f} "
              f"{bytes_bf16 / r['bf16_ms'] / 1e6:>9.0f} {bytes_int4 / r['w4a16_ms'] / 1e6:>10.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
