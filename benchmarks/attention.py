"""Attention and fusion on a GPU: minillm's Triton kernels against PyTorch (chapter 02). GPU only.

1. Attention, bf16, multi-head (H == H_kv), B * H = 64 query rows of work per position:
   minillm's Triton FlashAttention vs `torch.nn.functional.scaled_dot_product_attention` (PyTorch's
   own fused kernels) vs naive attention (q @ k^T, softmax, @ v, materialising the [T, T] scores),
   for head_dim 64 and 128, causal and not, T = 512 .. 16k. FLOPs counted as 4 B H T_q T_k D (two
   matmuls), halved when causal; naive runs that exhaust GPU memory are recorded as null.
2. Fused residual-add + RMSNorm vs the same as separate PyTorch operations, in GB/s, counting for
   both the bytes the fused kernel must move (read x, residual, weight; write two outputs).

Every configuration is checked before it is timed (max |error| against SDPA, recorded beside the
time). Timing is `triton.testing.do_bench` (median of repeated runs with an L2 flush between them).

    python benchmarks/attention.py                   # writes results/attention/cuda.json
    python benchmarks/attention.py --seqlens 512 1024 --head-dims 64   # a quick subset
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from common import write_results

from minillm.arithmetic import GPU_SPECS, GPUSpec

MAX_ERROR = {"flash": 2e-2, "naive": 3e-2}  # bf16 outputs of magnitude < 1 vs SDPA: a few bf16 ulps


def datasheet(name: str, memory_bytes: int) -> GPUSpec | None:
    """The datasheet roofline of the GPU called `name`, where minillm.arithmetic knows it."""
    n = name.lower()
    for key, needle in [("h200", "h200"), ("h100-pcie", "h100 pcie"), ("h100-sxm", "h100"), ("l40s", "l40s"),
                        ("a10g", "a10g"), ("l4", "l4"), ("a10", "a10")]:
        if needle in n:
            return GPU_SPECS[key]
    if "a100" in n:
        return GPU_SPECS["a100-80gb" if memory_bytes > 50e9 else "a100-40gb"]
    return None


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """What a first implementation writes: three kernels, the [B, H, T, T] scores in memory twice."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


def bench_attention(args: argparse.Namespace, flash_attention, do_bench) -> list[dict]:  # noqa: ANN001
    rows = []
    dtype = getattr(torch, args.dtype)
    for D in args.head_dims:
        H = args.heads
        for T in args.seqlens:
            for causal in (False, True):
                B = args.batch
                torch.manual_seed(0)
                q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype) for _ in range(3))
                flops = 4 * B * H * T * T * D / (2 if causal else 1)
                row = {"head_dim": D, "seq_len": T, "causal": causal, "batch": B, "heads": H, "flop": flops}
                expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                got = flash_attention(q, k, v, causal=causal)
                row["flash_max_abs_error"] = (got.float() - expected.float()).abs().max().item()
                if row["flash_max_abs_error"] > MAX_ERROR["flash"]:
                    raise SystemExit(f"Triton kernel wrong at {row}: fix it before timing it")
                del got
                methods = {
                    "flash": lambda: flash_attention(q, k, v, causal=causal),  # noqa: B023 - used at once
                    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),  # noqa: B023
                }
                for name, fn in methods.items():
                    ms = do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
                    row[f"{name}_ms"], row[f"{name}_tflops"] = ms, flops / ms / 1e9
                row["naive_ms"] = row["naive_tflops"] = row["naive_max_abs_error"] = None
                if T <= args.naive_max_seqlen:
                    try:
                        mask = torch.ones(T, T, device="cuda", dtype=torch.bool).triu(1) if causal else None
                        got = naive_attention(q, k, v, mask)
                        row["naive_max_abs_error"] = (got.float() - expected.float()).abs().max().item()
                        del got
                        ms = do_bench(lambda: naive_attention(q, k, v, mask), warmup=args.warmup_ms,  # noqa: B023
                                      rep=args.rep_ms, return_mode="median")
                        row["naive_ms"], row["naive_tflops"] = ms, flops / ms / 1e9
                    except torch.OutOfMemoryError:
                        row["naive_note"] = "out of GPU memory"
                    mask = None
                torch.cuda.empty_cache()
                rows.append(row)
                naive = f"{row['naive_tflops']:6.1f}" if row["naive_tflops"] else "  null"
                print(f"  D={D:<3} T={T:<6} causal={causal!s:<5}  flash {row['flash_tflops']:6.1f}  "
                      f"sdpa {row['sdpa_tflops']:6.1f}  naive {naive} TFLOP/s", flush=True)
    return rows


def bench_rmsnorm(args: argparse.Namespace, fused, reference, do_bench) -> list[dict]:  # noqa: ANN001
    rows = []
    dtype = getattr(torch, args.dtype)
    for n_rows, dim in args.norm_sizes:
        torch.manual_seed(0)
        x, residual = (torch.randn(n_rows, dim, device="cuda", dtype=dtype) for _ in range(2))
        weight = torch.randn(dim, device="cuda", dtype=dtype)
        (a, b), (c, d) = fused(x, residual, weight, 1e-6), reference(x, residual, weight, 1e-6)
        err = max((a.float() - c.float()).abs().max().item(), (b.float() - d.float()).abs().max().item())
        if err > 0.05 * c.float().abs().max().item():
            raise SystemExit(f"fused add+RMSNorm wrong at {n_rows}x{dim}: max |error| {err}")
        nbytes = (4 * n_rows * dim + dim) * x.element_size()
        row = {"rows": n_rows, "dim": dim, "bytes": nbytes, "max_abs_error": err}
        for name, fn in {"fused": fused, "unfused": reference}.items():
            ms = do_bench(lambda: fn(x, residual, weight, 1e-6), warmup=args.warmup_ms, rep=args.rep_ms,  # noqa: B023
                          return_mode="median")
            row[f"{name}_ms"], row[f"{name}_gbs"] = ms, nbytes / ms / 1e6
        row["speedup"] = row["unfused_ms"] / row["fused_ms"]
        rows.append(row)
        print(f"  {n_rows}x{dim}: fused {row['fused_gbs']:.0f} GB/s, unfused {row['unfused_gbs']:.0f} GB/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16, help="query heads = key/value heads (MHA)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--naive-max-seqlen", type=int, default=16384, help="skip naive attention above this")
    parser.add_argument("--norm-sizes", type=lambda s: tuple(int(x) for x in s.split("x")), nargs="+",
                        default=[(4096, 2048), (4096, 4096), (16384, 4096), (8192, 8192)], metavar="ROWSxDIM")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    args = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA GPU (the Triton kernels compile for one); none was found. "
                 "On a CPU, tests/kernels/test_kernels.py runs the kernels through Triton's interpreter.")
    try:
        from triton.testing import do_bench
    except ImportError:
        sys.exit("benchmarks/attention.py needs Triton: pip install triton")
    from minillm.kernels import flash_attention, fused_add_rms_norm
    from minillm.kernels.rmsnorm import fused_add_rms_norm_reference

    # Raise the clocks before the first timing (an idle GPU starts slow): about a second of matmuls.
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    do_bench(lambda: warm @ warm, warmup=250, rep=1000)

    props = torch.cuda.get_device_properties(0)
    spec = datasheet(props.name, props.total_memory)
    print(f"{props.name}: attention, {args.dtype}, B={args.batch} H={args.heads}", flush=True)
    attention_rows = bench_attention(args, flash_attention, do_bench)
    print("fused add + RMSNorm", flush=True)
    norm_rows = bench_rmsnorm(args, fused_add_rms_norm, fused_add_rms_norm_reference, do_bench)

    path = write_results("attention/cuda", {
        "benchmark": "attention forward (Triton FlashAttention vs PyTorch SDPA vs naive) and fused add+RMSNorm",
        "settings": {k: (list(map(list, v)) if k == "norm_sizes" else v) for k, v in vars(args).items()},
        "flop_count": "4*B*H*T_q*T_k*D, halved for causal",
        "norm_bytes": "(4*rows*dim + dim) * element size: read x, residual, weight; write normed, new residual",
        "datasheet": None if spec is None else {"name": spec.name, "peak_tflops": spec.peak_flops / 1e12,
                                                 "bandwidth_gbs": spec.memory_bandwidth / 1e9},
        "attention": attention_rows,
        "rmsnorm": norm_rows,
    })

    peak = f" (datasheet dense peak {spec.peak_flops / 1e12:.0f} TFLOP/s)" if spec else ""
    print(f"\nattention TFLOP/s, {args.dtype}, B={args.batch}, H={args.heads}{peak}")
    print(f"{'D':>4} {'T':>6} {'causal':>6} {'triton':>7} {'sdpa':>7} {'naive':>7} {'triton/sdpa':>11} {'err':>8}")
    for r in attention_rows:
        naive = f"{r['naive_tflops']:7.1f}" if r["naive_tflops"] else "   null"
        print(f"{r['head_dim']:>4} {r['seq_len']:>6} {r['causal']!s:>6} {r['flash_tflops']:7.1f} "
              f"{r['sdpa_tflops']:7.1f} {naive} {r['flash_tflops'] / r['sdpa_tflops']:10.2f}x "
              f"{r['flash_max_abs_error']:8.1e}")
    bw = f" (datasheet {spec.memory_bandwidth / 1e9:.0f} GB/s)" if spec else ""
    print(f"\nfused add + RMSNorm, GB/s of the minimal traffic{bw}")
    print(f"{'rows x dim':>12} {'fused':>7} {'unfused':>8} {'speed-up':>9}")
    for r in norm_rows:
        print(f"{r['rows']:>6}x{r['dim']:<5} {r['fused_gbs']:7.0f} {r['unfused_gbs']:8.0f} {r['speedup']:8.2f}x")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
