"""Decode attention on a GPU: minillm's Triton kernel against PyTorch SDPA and the copy ceiling (chapter 03).

One query token per sequence attends to a bf16 KV cache of L tokens, with the shape of Llama-3-8B's
attention (32 query heads, 8 KV heads, head_dim 128: GQA 8:1), for batch B = 1..64 and L = 1k..32k.
The kernel must read K and V once each: 2 x B x H_kv x L x D x 2 bytes (plus q and the output,
counted too). Its time against those bytes gives GB/s, compared with the device-to-device copy
bandwidth measured in the same run (bytes read + bytes written by a large `clone`).

Compared, on the same inputs:
- `triton`:      minillm.kernels.decode_attention (each KV head read once for its group of 32 / 8 = 4
                 query heads; split along the sequence so that small batches fill the GPU);
- `sdpa_gqa`:    torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True) on the same cache;
- `sdpa_expand`: SDPA on K/V already expanded to 32 heads (what a cache stored per query head costs:
                 4x the bytes; the expansion itself is not timed).
A ragged batch (16 sequences of random lengths up to 32k in a 32k cache) shows what reading only the
filled part of each sequence saves. A small sweep of tile sizes and split counts comes first; the
kernel's defaults are set from it.

Every configuration is checked against the reference before it is timed. Timing replays a CUDA
graph of the calls (so the time is the GPU's, not Python's launch overhead, which an engine also
removes with graphs) over enough distinct input sets to exceed the L2 cache several times (so the
bytes come from HBM), and takes the median of 40 replays, the methods' graphs replayed in turn.

    python benchmarks/decode_attention.py            # writes results/decode_attention/cuda.json
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from common import write_results

from minillm.utils import cdiv

MAX_ERROR = 2e-2  # bf16 outputs of magnitude < 1: a few bf16 ulps


ROTATE_BYTES = 512 * 2**20  # input sets per graph: at least this many bytes in all (the H100's L2 is 50 MB)


def copy_bandwidth() -> tuple[float, float]:
    """Device-to-device copy bandwidth, bytes read + written per second, copying 1 GiB.

    Returns (timed by triton's do_bench: the copy runs as a kernel on the SMs, the ceiling the decode
    kernel is compared with; timed as a CUDA graph, where the copy becomes a memcpy node, which ran
    about 20% slower on an H100: recorded, not used).
    """
    from triton.testing import do_bench

    x = torch.empty(2**29, dtype=torch.int16, device="cuda").random_()
    y = torch.empty_like(x)
    nbytes = 2 * x.numel() * x.element_size()
    kernel_ms = do_bench(lambda: y.copy_(x), warmup=100, rep=500, return_mode="median")
    return nbytes / kernel_ms * 1e3, nbytes / graph_time_ms([lambda: y.copy_(x)] * 10) * 1e3


def start_on_gpu(script: str, on_cpu: str) -> float:
    """Exit saying what runs on a CPU instead (`on_cpu`) unless a CUDA GPU is here; else warm it up, then measure,
    print and return its copy bandwidth (bytes read + written per second, `copy_bandwidth`'s kernel figure)."""
    if not torch.cuda.is_available():
        sys.exit(f"benchmarks/{script} needs a CUDA GPU; on a CPU, {on_cpu}")
    warm_up_gpu()
    copy_gbs, _ = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs / 1e9:.0f} GB/s", flush=True)
    return copy_gbs


def capture(calls: list) -> tuple[torch.cuda.CUDAGraph, int]:
    """The calls captured in one CUDA graph (after running them once outside it to compile and warm up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    return graph, len(calls)


def time_graphs(graphs: dict, reps: int = 40) -> dict[str, float]:
    """Median GPU milliseconds per call of each captured graph, replayed in turn (A B C A B C ...), so that
    a drift of the clocks during the run falls on every method alike."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(reps):
        for name, (graph, n_calls) in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / n_calls)
    return {name: statistics.median(t) for name, t in times.items()}


def warm_up_gpu() -> None:
    """About a second of bf16 matmuls in a CUDA graph, so that timings start at full clocks."""
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    graph_time_ms([lambda: warm @ warm] * 20, reps=50)


def graph_time_ms(calls: list, reps: int = 40) -> float:
    """Median GPU milliseconds per call: the calls captured in one CUDA graph, replayed `reps` times."""
    return time_graphs({"x": capture(calls)}, reps)["x"]


def inputs(B: int, H: int, H_kv: int, L: int, D: int, seed: int = 0):  # noqa: N803, ANN201
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, H_kv, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, H_kv, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def input_sets(B: int, H: int, H_kv: int, L: int, D: int) -> list:  # noqa: N803
    """Enough independent (q, k, v) sets that one pass over them does not fit in L2."""
    n = max(1, min(64, cdiv(ROTATE_BYTES, must_read(B, H, H_kv, L, D))))
    return [inputs(B, H, H_kv, L, D, seed=i) for i in range(n)]


def must_read(B: int, H: int, H_kv: int, L: int, D: int) -> int:  # noqa: N803
    """K and V once each, q read and the output written, in bf16."""
    return 2 * (2 * B * H_kv * L * D + 2 * B * H * D)


def check(got: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    err = (got.float() - expected.float()).abs().max().item()
    if not err <= MAX_ERROR:
        raise SystemExit(f"{what}: max |error| {err:.3g} against the reference; fix the kernel before timing it")
    return err


def sweep(args: argparse.Namespace, decode_attention) -> list[dict]:  # noqa: ANN001
    """Tile size x warps x stages x splits, at three shapes; the defaults are chosen from this."""
    kernel_module = sys.modules["minillm.kernels.decode_attention"]  # its launch settings are patched below
    rows = []
    for B, L in [(1, 32768), (1, 4096), (4, 16384), (16, 4096), (64, 1024)]:
        sets = input_sets(B, args.heads, args.kv_heads, L, args.head_dim)
        q, k, v = sets[0]
        expected = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
        nbytes = must_read(B, args.heads, args.kv_heads, L, args.head_dim)
        graphs, configs = {}, {}
        for block_n in (32, 64, 128):
            for warps, stages in ((4, 2), (4, 3), (8, 2)):
                for splits in (None, 8, 32, 128):
                    kernel_module.GPU_WARPS, kernel_module.GPU_STAGES = warps, stages
                    name = f"{block_n}/{warps}/{stages}/{splits or 'auto'}"
                    configs[name] = {"batch": B, "seq_len": L, "block_n": block_n, "warps": warps, "stages": stages,
                                     "splits": splits or "auto"}
                    try:
                        check(decode_attention(q, k, v, num_splits=splits, block_n=block_n), expected, "sweep")
                        graphs[name] = capture([lambda s=s: decode_attention(*s, num_splits=splits,  # noqa: B023
                                                                             block_n=block_n)  # noqa: B023
                                                for s in sets])
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: recorded, not fatal
                        configs[name]["error"] = str(exc)[:200]
        for name, ms in time_graphs(graphs, reps=20).items():
            configs[name].update({"ms": ms, "gbs": nbytes / ms / 1e6})
        rows += configs.values()
        graphs = None
        sets = q = k = v = None  # free the GPU memory before the next shape
        torch.cuda.empty_cache()
    kernel_module.GPU_WARPS, kernel_module.GPU_STAGES = args.default_launch
    return rows


def bench(args: argparse.Namespace, decode_attention, decode_attention_reference, copy_gbs: float) -> list[dict]:  # noqa: ANN001
    rows = []
    H, H_kv, D = args.heads, args.kv_heads, args.head_dim
    for L in args.seqlens:
        for B in args.batches:
            sets = input_sets(B, H, H_kv, L, D)
            q, k, v = sets[0]
            nbytes = must_read(B, H, H_kv, L, D)
            expected = decode_attention_reference(q[:1], k[:1], v[:1])  # one sequence in fp32 (memory)
            row = {"batch": B, "seq_len": L, "bytes": nbytes, "input_sets": len(sets),
                   "max_abs_error": check(decode_attention(q, k, v)[:1], expected, f"B={B} L={L}")}
            check(F.scaled_dot_product_attention(q[:1, :, None], k[:1], v[:1], enable_gqa=True)[:, :, 0], expected,
                  "sdpa enable_gqa")
            graphs = {
                "triton": capture([lambda s=s: decode_attention(*s) for s in sets]),
                "sdpa_gqa": capture([lambda s=s: F.scaled_dot_product_attention(
                    s[0][:, :, None], s[1], s[2], enable_gqa=True) for s in sets]),
            }
            row.update({f"{name}_ms": ms for name, ms in time_graphs(graphs).items()})
            graphs = None
            row["sdpa_expand_ms"] = None
            try:
                expanded = [(s[0][:, :, None], s[1].repeat_interleave(H // H_kv, dim=1),
                             s[2].repeat_interleave(H // H_kv, dim=1)) for s in sets]
                check(F.scaled_dot_product_attention(*(t[:1] for t in expanded[0]))[:, :, 0], expected, "sdpa")
                row["sdpa_expand_ms"] = graph_time_ms([lambda e=e: F.scaled_dot_product_attention(*e)
                                                       for e in expanded])
            except torch.OutOfMemoryError:
                row["sdpa_expand_note"] = "out of GPU memory"
            expanded = None
            for name in ("triton", "sdpa_gqa", "sdpa_expand"):
                ms = row[f"{name}_ms"]
                row[f"{name}_gbs"] = nbytes / ms / 1e6 if ms else None
            row["triton_fraction_of_copy"] = row["triton_gbs"] * 1e9 / copy_gbs
            rows.append(row)
            print(f"  B={B:<3} L={L:<6} triton {row['triton_gbs']:6.0f} GB/s ({row['triton_fraction_of_copy']:.0%} "
                  f"of copy)  sdpa_gqa {row['sdpa_gqa_gbs']:6.0f}", flush=True)
            sets = q = k = v = None  # free the GPU memory before the next shape
            torch.cuda.empty_cache()
    return rows


def ragged(args: argparse.Namespace, decode_attention) -> dict:  # noqa: ANN001
    """16 sequences of random lengths in a 32k cache: the kernel reads only what each one holds."""
    B, L, H, H_kv, D = 16, 32768, args.heads, args.kv_heads, args.head_dim
    q, k, v = inputs(B, H, H_kv, L, D, seed=7)
    lengths = torch.randint(1, L + 1, (B,), generator=torch.Generator().manual_seed(7)).cuda()
    needed = 2 * (2 * int(lengths.sum()) * H_kv * D + 2 * B * H * D)
    mask = (torch.arange(L, device="cuda")[None, :] < lengths[:, None])[:, None, None]  # [B, 1, 1, L]
    ms_ragged = graph_time_ms([lambda: decode_attention(q, k, v, lengths)])
    ms_full = graph_time_ms([lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask,
                                                                     enable_gqa=True)])
    return {"batch": B, "cache_len": L, "mean_len": float(lengths.float().mean()), "bytes_needed": needed,
            "triton_ms": ms_ragged, "triton_gbs_of_needed": needed / ms_ragged / 1e6,
            "sdpa_masked_ms": ms_full, "sdpa_masked_gbs_of_needed": needed / ms_full / 1e6}


def by_kv_heads(args: argparse.Namespace, decode_attention) -> list[dict]:  # noqa: ANN001
    """The same 32 query heads at B=16, L=8k with 32 (MHA), 8, 4 and 1 (MQA) KV heads: time follows bytes."""
    rows = []
    B, L, H, D = 16, 8192, args.heads, args.head_dim
    for H_kv in (32, 8, 4, 1):
        sets = input_sets(B, H, H_kv, L, D)
        q, k, v = sets[0]
        check(decode_attention(q, k, v), F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0],
              f"H_kv={H_kv}")
        graphs = {"triton": capture([lambda s=s: decode_attention(*s) for s in sets]),
                  "sdpa_gqa": capture([lambda s=s: F.scaled_dot_product_attention(s[0][:, :, None], s[1], s[2],
                                                                                  enable_gqa=True) for s in sets])}
        times = time_graphs(graphs)
        nbytes = must_read(B, H, H_kv, L, D)
        rows.append({"batch": B, "seq_len": L, "heads": H, "kv_heads": H_kv, "bytes": nbytes,
                     "triton_ms": times["triton"], "sdpa_gqa_ms": times["sdpa_gqa"],
                     "triton_gbs": nbytes / times["triton"] / 1e6})
        sets = q = k = v = graphs = None  # free the GPU memory before the next shape
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-settings sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_attention.py needs a CUDA GPU; on a CPU, tests/kernels/test_kernels.py runs the "
                 "kernel through Triton's interpreter.")
    from minillm.kernels import decode_attention, decode_attention_reference
    from minillm.kernels.decode_attention import GPU_STAGES, GPU_WARPS

    args.default_launch = (GPU_WARPS, GPU_STAGES)
    warm_up_gpu()
    copy_gbs, copy_graph_gbs = copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(f"{name}: copy bandwidth {copy_gbs / 1e9:.0f} GB/s; decode attention bf16, {args.heads} query / "
          f"{args.kv_heads} KV heads of {args.head_dim}", flush=True)
    sweep_rows = [] if args.no_sweep else sweep(args, decode_attention)
    rows = bench(args, decode_attention, decode_attention_reference, copy_gbs)
    ragged_row = ragged(args, decode_attention)
    kv_rows = by_kv_heads(args, decode_attention)
    path = write_results("decode_attention/cuda", {
        "benchmark": "decode attention, one query per sequence vs a bf16 KV cache: Triton kernel vs SDPA",
        "settings": {k: v for k, v in vars(args).items() if k != "default_launch"},
        "timing": "CUDA graph of the calls over enough input sets to exceed L2 (512 MiB); median of 40 replays, "
                  "the methods replayed in turn",
        "launch": {"warps_stages": list(args.default_launch)},
        "bytes_counted": "2 bytes x (2 x B x H_kv x L x D for K and V + 2 x B x H x D for q and the output)",
        "copy_bandwidth_gbs": copy_gbs / 1e9,
        "copy_bandwidth_as_graph_memcpy_gbs": copy_graph_gbs / 1e9,
        "sweep": sweep_rows,
        "decode": rows,
        "ragged": ragged_row,
        "by_kv_heads": kv_rows,
    })
    if sweep_rows:
        print("\nsweep (GB/s): B, L, block_n, warps, stages, splits")
        best = {}
        for r in sweep_rows:
            key = (r["batch"], r["seq_len"])
            if "gbs" in r and r["gbs"] > best.get(key, {}).get("gbs", 0):
                best[key] = r
        for r in best.values():
            print(f"  best at B={r['batch']} L={r['seq_len']}: block_n {r['block_n']} warps {r['warps']} "
                  f"stages {r['stages']} splits {r['splits']}: {r['gbs']:.0f} GB/s")
    print(f"\ndecode attention GB/s on the bytes it must read; copy {copy_gbs / 1e9:.0f} GB/s")
    print(f"{'B':>3} {'L':>6} {'triton':>7} {'%copy':>6} {'sdpa_gqa':>9} {'sdpa_exp':>9} {'vs best sdpa':>12}")
    for r in rows:
        exp = f"{r['sdpa_expand_gbs']:9.0f}" if r["sdpa_expand_gbs"] else "      oom"
        best_sdpa = max(r["sdpa_gqa_gbs"], r["sdpa_expand_gbs"] or 0)
        print(f"{r['batch']:>3} {r['seq_len']:>6} {r['triton_gbs']:7.0f} {r['triton_fraction_of_copy']:6.0%} "
              f"{r['sdpa_gqa_gbs']:9.0f} {exp} {r['triton_gbs'] / best_sdpa:11.2f}x")
    g = ragged_row
    print(f"ragged B=16 in a 32k cache (mean length {g['mean_len']:.0f}): triton {g['triton_ms'] * 1e3:.0f} us, "
          f"SDPA with a mask {g['sdpa_masked_ms'] * 1e3:.0f} us")
    print("by KV heads, B=16, L=8k, 32 query heads: " + ", ".join(
        f"{r['kv_heads']} -> {r['triton_ms'] * 1e3:.0f} us (sdpa {r['sdpa_gqa_ms'] * 1e3:.0f})" for r in kv_rows))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
