"""W4A16 against bf16 on the linear layers of a Llama-3-8B decode step, by batch (chapter 06).

For every batch size, the 32 layers' four linears (qkv 4096 -> 6144, o 4096 -> 4096, gate_up
4096 -> 28672, down 14336 -> 4096; random weights, 7.0B parameters, 14 GB in bf16) run one after
another, as in one decode step, in three ways:

* bf16: `x @ W.T` (cuBLAS);
* W4A16 fused: minillm's Triton kernels (`minillm.kernels.w4a16`) on int4 weights in groups of 128
  with fp32 scales and zeros (GEMV up to 4 rows, tiled GEMM above; each kernel's tile sizes picked per
  shape and batch from a small sweep, reported);
* W4A16 naive: dequantise each weight to bf16 with PyTorch operations, then the bf16 matmul.

All weights of all 32 layers are distinct tensors (about 3.7 GB at int4, 14 GB at bf16), so nothing is
served from the 50 MB L2 cache. Each variant is captured in a CUDA graph and timed with
`triton.testing.do_bench_cudagraph` (median), so that launch overhead is the GPU's, not Python's.
Correctness: each kernel against the fp64 dequantised reference on fresh inputs, as relative error.
The lm_head (4096 x 128256, bf16 in both) and attention are left out: see the chapter for the whole step.

    python benchmarks/w4a16.py       # on a CUDA GPU: results/w4a16_cuda.json
"""

from __future__ import annotations

import argparse

import torch
import triton
from common import write_results
from minillm.kernels.w4a16 import w4a16_gemm, w4a16_gemv, w4a16_reference

from minillm.quant import quantize_int

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
GROUP = 128
GEMV_CONFIGS = [dict(block_n=bn, groups_per_block=gpb, split_k=sk) for bn in (8, 16, 32) for gpb in (1, 2)
                for sk in (1, 2, 4)]
GEMM_CONFIGS = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w) for bm, bn, bk, w in
                [(16, 64, 128, 4), (64, 64, 128, 4), (64, 128, 64, 4), (128, 128, 64, 8)]]


def int4_weights(n_layers: int) -> dict[str, list[tuple]]:
    """Per shape, n_layers (packed, scale, zero) and bf16 copies of random weights (std 0.02)."""
    out = {}
    for name, (N, K) in SHAPES.items():
        layers = []
        for _ in range(n_layers):
            w = torch.randn(N, K, device="cuda") * 0.02
            q = quantize_int(w, 4, GROUP, symmetric=False)
            layers.append((q.codes, q.scale, q.zero, w.to(torch.bfloat16)))
            del w
        out[name] = layers
    return out


def time_graph(fn) -> float:  # noqa: ANN001
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def check(M: int) -> dict[str, float]:
    """Relative error of each kernel vs the fp64 reference on a fresh o_proj-sized problem."""
    N, K = 4096, 4096
    w = torch.randn(N, K, device="cuda") * 0.02
    q = quantize_int(w, 4, GROUP, symmetric=False)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ref = w4a16_reference(x.double(), q.codes, q.scale.double(), q.zero.double(), GROUP)
    errs = {}
    for name, fn in [("gemv", lambda: w4a16_gemv(x, q.codes, q.scale, q.zero, GROUP, split_k=4)),
                     ("gemm", lambda: w4a16_gemm(x, q.codes, q.scale, q.zero, GROUP))]:
        out = fn()
        errs[name] = ((out.double() - ref).norm() / ref.norm()).item()
    return errs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    errors = {M: check(M) for M in (1, 3, 37)}
    print("relative error vs fp64:", errors)
    weights = int4_weights(args.layers)
    rows = []
    for M in args.batches:
        xs = {name: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for name, (N, K) in SHAPES.items()}
        chosen, per_shape = {}, {}
        for name in SHAPES:
            x, layers = xs[name], weights[name]
            configs = GEMV_CONFIGS if M <= 4 else GEMM_CONFIGS
            kernel = w4a16_gemv if M <= 4 else w4a16_gemm
            best = None
            for cfg in configs:
                try:
                    t = time_graph(lambda cfg=cfg, k=kernel, x=x, ls=layers:
                                   [k(x, p, s, z, GROUP, **cfg) for p, s, z, _ in ls])
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped
                    print(f"  skip {name} M={M} {cfg}: {type(e).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            t_bf16 = time_graph(lambda x=x, ls=layers: [x @ wb.T for _, _, _, wb in ls])
            t_naive = time_graph(lambda x=x, ls=layers: [x @ w4a16_dequant_bf16(p, s, z).T for p, s, z, _ in ls])
            chosen[name] = best[1]
            per_shape[name] = {"bf16_ms": t_bf16, "w4a16_ms": best[0], "naive_ms": t_naive}
        total = {k: sum(v[k] for v in per_shape.values()) for k in ("bf16_ms", "w4a16_ms", "naive_ms")}
        row = {"batch": M, **total, "speedup_fused": total["bf16_ms"] / total["w4a16_ms"],
               "speedup_naive": total["bf16_ms"] / total["naive_ms"], "per_shape": per_shape, "configs": chosen}
        rows.append(row)
        print(f"batch {M:>4}: bf16 {total['bf16_ms']:.3f} ms, W4A16 {total['w4a16_ms']:.3f} ms "
              f"({row['speedup_fused']:.2f}x), naive {total['naive_ms']:.3f} ms ({row['speedup_naive']:.2f}x)")
    bytes_bf16 = sum(2 * N * K for N, K in SHAPES.values()) * args.layers
    bytes_int4 = sum(N * K // 2 + 2 * 4 * N * K // GROUP for N, K in SHAPES.values()) * args.layers
    path = write_results("w4a16_cuda", {
        "layers": args.layers, "shapes": SHAPES, "group_size": GROUP, "weight_bytes_bf16": bytes_bf16,
        "weight_bytes_w4a16": bytes_int4, "relative_error_vs_fp64": errors, "rows": rows,
    })
    print(f"\nwrote {path}\n{'batch':>5} {'bf16 ms':>8} {'W4A16 ms':>9} {'speed-up':>8} {'naive ms':>9} {'naive x':>7}"
          f" {'bf16 GB/s':>9} {'W4A16 GB/s':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['bf16_ms']:>8.3f} {r['w4a16_ms']:>9.3f} {r['speedup_fused']:>8.2f} "
              f"{r['naive_ms']:>9.3f} {r['speedup_naive']:>7.2f} {bytes_bf16 / r['bf16_ms'] / 1e6:>9.0f} "
              f"{bytes_int4 / r['w4a16_ms'] / 1e6:>10.0f}")
    return 0


def w4a16_dequant_bf16(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The naive path's first step: the whole weight back to bf16 in memory, [N, K]."""
    q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    N, K = q.shape
    w = (q.reshape(N, -1, GROUP).to(torch.bfloat16) - zero.to(torch.bfloat16)[..., None]) * scale.to(
        torch.bfloat16)[..., None]
    return w.reshape(N, K)


if __name__ == "__main__":
    raise SystemExit(main())
