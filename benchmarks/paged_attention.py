"""Paged decode attention on a GPU: the kernel reading K/V through block tables vs the contiguous one (chapter 04).

The same split-K Triton kernel (minillm.kernels.decode_attention, chapter 03) runs twice on the same
keys and values, bf16, Llama-3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128):

- `contiguous`: the cache [B, H_kv, L, D], each sequence's keys in one piece;
- `paged`:      the same keys in pools [num_blocks, block_size, H_kv, D], each sequence's blocks
                scattered at random through the pool (a shuffled block table: the worst case for
                locality, what a long-running server's free list looks like), read through the table.

Reported: GB/s on the bytes that must be read (K and V once each, plus q and the output) for each,
the paged kernel's speed as a fraction of the contiguous one's, and both as fractions of the
device-to-device copy bandwidth measured in the same run. A sweep of block sizes (8..256) at one
shape shows the kernel side of the block-size trade-off (the memory side, the waste, is in the
chapter). Timing as in benchmarks/decode_attention.py: CUDA graphs over enough input sets to exceed
L2, median of 40 replays, the two methods replayed in turn. Every configuration is checked against
the reference first.

    python benchmarks/paged_attention.py            # writes results/paged_attention/cuda.json
"""

from __future__ import annotations

import argparse

import torch
from common import write_results
from decode_attention import ROTATE_BYTES, capture, check, must_read, start_on_gpu, time_graphs

from minillm.utils import cdiv


def paged_copy(k: torch.Tensor, v: torch.Tensor, block_size: int, seed: int):  # noqa: ANN201
    """k, v [B, H_kv, L, D] copied into pools [num_blocks, block_size, H_kv, D] at randomly placed blocks.

    Returns (k_pool, v_pool, block_tables [B, L / block_size] int32).
    """
    B, H_kv, L, D = k.shape
    M = L // block_size
    g = torch.Generator(device="cuda").manual_seed(seed)
    tables = torch.randperm(B * M, device="cuda", generator=g).reshape(B, M).to(torch.int32)
    pools = []
    for dense in (k, v):
        pool = torch.empty(B * M, block_size, H_kv, D, device="cuda", dtype=dense.dtype)
        pool[tables.long()] = dense.transpose(1, 2).reshape(B, M, block_size, H_kv, D)
        pools.append(pool)
    return pools[0], pools[1], tables


def make_sets(B: int, H: int, H_kv: int, L: int, D: int, block_size: int) -> list:  # noqa: N803
    """Input sets (q, k, v, k_pool, v_pool, tables, lengths), enough to exceed L2 per pass."""
    n = max(1, min(64, cdiv(ROTATE_BYTES, must_read(B, H, H_kv, L, D))))
    sets = []
    for i in range(n):
        g = torch.Generator(device="cuda").manual_seed(i)
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, H_kv, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, H_kv, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k_pool, v_pool, tables = paged_copy(k, v, block_size, seed=i)
        sets.append((q, k, v, k_pool, v_pool, tables, torch.full((B,), L, device="cuda", dtype=torch.int32)))
    return sets


def compare(B: int, L: int, block_size: int, args: argparse.Namespace, copy_gbs: float) -> dict:  # noqa: N803
    """Contiguous vs paged kernel on the same keys at one shape and block size."""
    from minillm.kernels import decode_attention, decode_attention_reference, paged_decode_attention

    H, H_kv, D = args.heads, args.kv_heads, args.head_dim
    sets = make_sets(B, H, H_kv, L, D, block_size)
    q, k, v, k_pool, v_pool, tables, lengths = sets[0]
    expected = decode_attention_reference(q[:1], k[:1], v[:1])  # one sequence in fp32 (memory)
    err = check(paged_decode_attention(q, k_pool, v_pool, tables, lengths, max_len=L)[:1], expected,
                f"paged B={B} L={L} P={block_size}")
    check(decode_attention(q, k, v, lengths)[:1], expected, f"contiguous B={B} L={L}")
    graphs = {
        "contiguous": capture([lambda s=s: decode_attention(s[0], s[1], s[2], s[6]) for s in sets]),
        "paged": capture([lambda s=s: paged_decode_attention(s[0], s[3], s[4], s[5], s[6], max_len=L)
                          for s in sets]),
    }
    times = time_graphs(graphs)
    nbytes = must_read(B, H, H_kv, L, D)
    row = {"batch": B, "seq_len": L, "block_size": block_size, "bytes": nbytes, "input_sets": len(sets),
           "max_abs_error": err}
    for name, ms in times.items():
        row[f"{name}_ms"] = ms
        row[f"{name}_gbs"] = nbytes / ms / 1e6
        row[f"{name}_fraction_of_copy"] = nbytes / ms * 1e3 / copy_gbs
    row["paged_over_contiguous"] = times["contiguous"] / times["paged"]
    graphs = sets = q = k = v = k_pool = v_pool = None  # free the GPU memory before the next shape
    torch.cuda.empty_cache()
    return row


def decode_shapes_parser(description: str) -> argparse.ArgumentParser:
    """The shape flags of the paged decode benchmarks: lengths, batches, and Llama-3-8B's heads by default."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    return parser


def main() -> None:
    parser = decode_shapes_parser(__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    args = parser.parse_args()
    copy_gbs = start_on_gpu("paged_attention.py",
                            "tests/kernels/test_kernels.py runs the paged kernel through Triton's interpreter.")
    rows = []
    for L in args.seqlens:
        for B in args.batches:
            rows.append(compare(B, L, 16, args, copy_gbs))
            r = rows[-1]
            print(f"  B={B:<3} L={L:<6} contiguous {r['contiguous_gbs']:5.0f} GB/s  paged {r['paged_gbs']:5.0f} GB/s "
                  f"({r['paged_over_contiguous']:.0%}, {r['paged_fraction_of_copy']:.0%} of copy)", flush=True)
    block_rows = [compare(16, 4096, P, args, copy_gbs) for P in args.block_sizes]
    path = write_results("paged_attention/cuda", {
        "benchmark": "paged vs contiguous decode attention: one Triton kernel, K/V read through shuffled block "
                     "tables or in one piece",
        "settings": vars(args),
        "timing": "CUDA graph of the calls over enough input sets to exceed L2 (512 MiB); median of 40 replays, "
                  "contiguous and paged replayed in turn",
        "bytes_counted": "2 bytes x (2 x B x H_kv x L x D for K and V + 2 x B x H x D for q and the output)",
        "copy_bandwidth_gbs": copy_gbs / 1e9,
        "block_size_16": rows,
        "block_sizes_at_b16_l4096": block_rows,
    })
    print(f"\npaged vs contiguous decode attention, block size 16 (GB/s; copy {copy_gbs / 1e9:.0f})")
    print(f"{'B':>3} {'L':>6} {'contig':>7} {'paged':>7} {'paged/contig':>12} {'paged %copy':>11}")
    for r in rows:
        print(f"{r['batch']:>3} {r['seq_len']:>6} {r['contiguous_gbs']:7.0f} {r['paged_gbs']:7.0f} "
              f"{r['paged_over_contiguous']:12.0%} {r['paged_fraction_of_copy']:11.0%}")
    print("block size at B=16, L=4096: " + ", ".join(
        f"{r['block_size']} -> {r['paged_gbs']:.0f} GB/s ({r['paged_over_contiguous']:.0%})" for r in block_rows))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
