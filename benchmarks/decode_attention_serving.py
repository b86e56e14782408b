"""Paged decode attention at a serving batch: the launch settings of the kernel where a throughput run spends its
attention time (chapter 05).

A throughput run's decode steps hold up to 256 sequences of uneven lengths, and the engine's CUDA graphs launch the
decode kernel for the longest context they allow (the key range), not for the step's own longest row. This runs
`paged_decode_attention` as the engine's graph step does, on Llama-3.2-1B's attention shape by default (32 query
heads, 8 KV heads, head_dim 64), 16-token blocks scattered through the pool, block tables as int64 columns of a
wider buffer (the graph's input rows), lengths drawn uniformly from --lengths, and sweeps keys per tile x warps x
pipeline stages x chunks per row. The kernel's own choice ("auto") is timed beside them.

Reported per batch: GPU microseconds per call, and GB/s on the bytes the call must move (each row's K and V once,
plus q and the output), against the device-to-device copy bandwidth measured in the same run. Timing as in
benchmarks/decode_attention.py: CUDA graphs over enough input sets to exceed L2, median of replays, the
configurations replayed in turn. Every configuration is checked against the reference first.

    python benchmarks/decode_attention_serving.py     # writes results/decode_attention_serving/cuda.json
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
from common import write_results
from decode_attention import ROTATE_BYTES, capture, check, start_on_gpu, time_graphs

from minillm.utils import cdiv

BLOCK_SIZE = 16
TABLE_OFFSET = 4  # the graph's input rows hold 4 columns (token, position, slot, length) before the block table


def make_set(B: int, H: int, H_kv: int, D: int, key_range: int, lengths: tuple[int, int], seed: int):  # noqa: N803, ANN201
    """(q, k_pool, v_pool, tables, lens): B rows of lengths uniform in `lengths`, blocks shuffled through a pool
    sized to hold them; tables [B, key_range / 16] int64, a column slice of a wider buffer as in the engine."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1] + 1, (B,), generator=g)
    blocks = [cdiv(int(n), BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks)
    order = torch.randperm(num_blocks, generator=g)
    rows = torch.zeros(B, TABLE_OFFSET + key_range // BLOCK_SIZE, dtype=torch.int64)
    start = 0
    for b, n in enumerate(blocks):
        rows[b, TABLE_OFFSET:TABLE_OFFSET + n] = order[start:start + n]
        start += n
    gd = torch.Generator(device="cuda").manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, H_kv, D)
    k_pool = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gd)
    v_pool = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gd)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=gd)
    return q, k_pool, v_pool, rows.cuda()[:, TABLE_OFFSET:], lens.to("cuda", torch.int32)


def must_move(q: torch.Tensor, k_pool: torch.Tensor, lens: torch.Tensor) -> int:
    """Bytes: each row's keys and values once (bf16), q read and the output written."""
    _, _, H_kv, D = k_pool.shape
    return 2 * (2 * int(lens.sum()) * H_kv * D + 2 * q.numel())


def configs(args: argparse.Namespace) -> list[tuple]:
    """(block_n, warps, stages, splits) for every combination swept, after (None, None, None, None): the kernel's
    own choice."""
    return [(None, None, None, None), *itertools.product(args.block_n, args.warps, args.stages, args.splits)]


def sweep_batch(B: int, args: argparse.Namespace) -> list[dict]:  # noqa: N803
    from minillm.kernels import paged_decode_attention, paged_decode_attention_reference

    kernel_module = sys.modules["minillm.kernels.decode_attention"]  # its launch settings are patched below
    defaults = kernel_module.GPU_WARPS, kernel_module.GPU_STAGES
    first = make_set(B, args.heads, args.kv_heads, args.head_dim, args.key_range, args.lengths, seed=0)
    per_set = must_move(*first[:2], first[4])
    sets = [first] + [make_set(B, args.heads, args.kv_heads, args.head_dim, args.key_range, args.lengths, seed=i)
                      for i in range(1, max(1, cdiv(ROTATE_BYTES, per_set)))]
    nbytes = sum(must_move(s[0], s[1], s[4]) for s in sets) / len(sets)
    q, k_pool, v_pool, tables, lens = first
    expected = paged_decode_attention_reference(q[:8], k_pool, v_pool, tables[:8], lens[:8])
    graphs, rows = {}, {}
    for block_n, warps, stages, splits in configs(args):
        name = "auto" if block_n is None else f"{block_n}/{warps}/{stages}/{splits}"
        rows[name] = {"batch": B, "block_n": block_n, "warps": warps, "stages": stages, "splits": splits,
                      "input_sets": len(sets), "bytes": nbytes}
        kernel_module.GPU_WARPS, kernel_module.GPU_STAGES = (warps, stages) if warps else defaults

        def call(s: tuple, block_n: int | None = block_n, splits: int | None = splits) -> torch.Tensor:
            return paged_decode_attention(s[0], s[1], s[2], s[3], s[4], max_len=args.key_range, num_splits=splits,
                                          block_n=block_n)
        try:
            check(call(first)[:8], expected, f"B={B} {name}")
            graphs[name] = capture([lambda s=s, c=call: c(s) for s in sets])
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: recorded, not fatal
            rows[name]["error"] = str(exc)[:200]
    kernel_module.GPU_WARPS, kernel_module.GPU_STAGES = defaults
    for name, ms in time_graphs(graphs, reps=args.reps).items():
        rows[name].update({"us": ms * 1e3, "gbs": nbytes / ms / 1e6})
    return [dict(config=name, **row) for name, row in rows.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 144, 256])
    parser.add_argument("--lengths", type=int, nargs=2, default=[100, 2048], help="row lengths, uniform in [lo, hi]")
    parser.add_argument("--key-range", type=int, default=131072, help="the graphs' key range (the model's context)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--name", default="cuda", help="the results file: results/decode_attention_serving/<name>.json")
    args = parser.parse_args()
    copy_gbs = start_on_gpu("decode_attention_serving.py",
                            "tests/kernels/test_kernels.py runs the paged kernel through Triton's interpreter.")
    results = []
    for B in args.batches:
        rows = sweep_batch(B, args)
        results += rows
        timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        auto = next(r for r in rows if r["config"] == "auto")
        print(f"B={B}: auto {auto.get('us', float('nan')):.1f} us ({auto.get('gbs', 0):.0f} GB/s, "
              f"{auto.get('gbs', 0) * 1e9 / copy_gbs:.0%} of copy); best (block_n/warps/stages/splits):", flush=True)
        for r in timed[:6]:
            print(f"    {r['config']:>12} {r['us']:7.1f} us {r['gbs']:6.0f} GB/s {r['gbs'] * 1e9 / copy_gbs:5.0%}")
    path = write_results(f"decode_attention_serving/{args.name}", {
        "benchmark": "paged decode attention at serving batches: launch settings swept, the engine's call shape "
                     "(key range of the graphs, int64 table columns, ragged rows)",
        "settings": vars(args),
        "timing": "CUDA graph of the calls over enough input sets to exceed L2 (512 MiB); median of --reps replays, "
                  "the configurations replayed in turn",
        "bytes_counted": "2 bytes x (2 x sum(lengths) x H_kv x D for K and V + 2 x B x H x D for q and the output)",
        "copy_bandwidth_gbs": copy_gbs / 1e9,
        "rows": results,
    })
    print(f"written to {path}")


if __name__ == "__main__":
    main()
