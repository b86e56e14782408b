"""Decode attention over an 8-bit KV cache on a GPU: the paged kernel reading int8 / fp8 codes (chapter 06).

The paged split-K Triton kernel (minillm.kernels.paged_decode_attention) runs on the same keys and values
stored three ways, Llama-3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128), blocks of 16
scattered through the pool:

- `bf16`: the pools as the model computes them;
- `int8`: int8 codes and one fp32 scale per (token, head) (`minillm.quant.kv.quantize_kv`), dequantised
  by the kernel as it reads;
- `fp8`:  float8 e4m3 codes with the same scales.

A decode step reads the whole cache, so its attention time should follow the bytes: per key and value
vector 2 x 128 = 256 bytes in bf16, 128 + 4 = 132 in 8 bits, so at most 1.94x faster. Reported: ms, GB/s on
the bytes each must read, the speed-up over bf16, and each output's largest difference from the bf16
kernel's (the quantisation error, not a bug: the kernel's own correctness is checked against the reference
on the dequantised cache first). Timing as in benchmarks/paged_attention.py: CUDA graphs over enough input
sets to exceed L2, median of 40 replays, the three replayed in turn.

    python benchmarks/kv_quant_decode.py            # writes results/kv_quant_decode/cuda.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import write_results
from decode_attention import capture, check, copy_bandwidth, time_graphs, warm_up_gpu
from paged_attention import decode_shapes_parser, make_sets

KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def must_read(B: int, H: int, H_kv: int, L: int, D: int, code_bytes: int | None) -> int:  # noqa: N803
    """K and V once each (codes and fp32 scales, or bf16), q read and the output written in bf16."""
    per_vector = 2 * D if code_bytes is None else code_bytes * D + 4
    return 2 * B * H_kv * L * per_vector + 2 * 2 * B * H * D


def compare(B: int, L: int, args: argparse.Namespace) -> dict:  # noqa: N803
    from minillm.kernels import paged_decode_attention, paged_decode_attention_reference

    from minillm.quant.kv import quantize_kv

    H, H_kv, D = args.heads, args.kv_heads, args.head_dim
    sets = make_sets(B, H, H_kv, L, D, 16)
    quantised = {name: [(quantize_kv(s[3], dt), quantize_kv(s[4], dt)) for s in sets] for name, dt in KV_DTYPES.items()}
    q, _, _, k_pool, v_pool, tables, lengths = sets[0]
    bf16_out = paged_decode_attention(q, k_pool, v_pool, tables, lengths, max_len=L)
    row = {"batch": B, "seq_len": L, "input_sets": len(sets)}
    for name, pools in quantised.items():
        (kc, ks), (vc, vs) = pools[0]
        got = paged_decode_attention(q, kc, vc, tables, lengths, max_len=L, k_scale=ks, v_scale=vs)
        ref = paged_decode_attention_reference(q[:1].float(), kc, vc, tables[:1], lengths[:1], k_scale=ks, v_scale=vs)
        row[f"{name}_max_abs_error_vs_reference"] = check(got[:1], ref, f"{name} B={B} L={L}")
        row[f"{name}_max_abs_change_vs_bf16"] = (got.float() - bf16_out.float()).abs().max().item()
    graphs = {"bf16": capture([lambda s=s: paged_decode_attention(s[0], s[3], s[4], s[5], s[6], max_len=L)
                               for s in sets])}
    for name, pools in quantised.items():
        graphs[name] = capture([lambda s=s, p=p: paged_decode_attention(s[0], p[0][0], p[1][0], s[5], s[6], max_len=L,
                                                                         k_scale=p[0][1], v_scale=p[1][1])
                                for s, p in zip(sets, pools)])
    times = time_graphs(graphs)
    for name, ms in times.items():
        nbytes = must_read(B, H, H_kv, L, D, None if name == "bf16" else 1)
        row[f"{name}_ms"], row[f"{name}_bytes"], row[f"{name}_gbs"] = ms, nbytes, nbytes / ms / 1e6
        row[f"{name}_speedup"] = times["bf16"] / ms
    graphs = sets = quantised = None  # free the GPU memory before the next shape
    torch.cuda.empty_cache()
    return row


def main() -> None:
    args = decode_shapes_parser(__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kv_quant_decode.py needs a CUDA GPU; on a CPU, tests/kernels/test_kernels.py runs the "
                 "kernel on 8-bit pools through Triton's interpreter.")
    warm_up_gpu()
    copy_gbs, _ = copy_bandwidth()
    rows = []
    for L in args.seqlens:
        for B in args.batches:
            rows.append(compare(B, L, args))
            r = rows[-1]
            print(f"  B={B:<3} L={L:<6} bf16 {r['bf16_ms']:.3f} ms, int8 {r['int8_ms']:.3f} ms "
                  f"({r['int8_speedup']:.2f}x), fp8 {r['fp8_ms']:.3f} ms ({r['fp8_speedup']:.2f}x)", flush=True)
    path = write_results("kv_quant_decode/cuda", {
        "benchmark": "paged decode attention on bf16 pools vs int8 / fp8 codes with fp32 scales per (token, head)",
        "settings": vars(args) | {"block_size": 16},
        "timing": "CUDA graph of the calls over enough input sets to exceed L2 (512 MiB); median of 40 replays, "
                  "bf16, int8 and fp8 replayed in turn",
        "bytes_counted": "K and V: 2 bytes x D (bf16) or 1 x D + a 4-byte scale (8 bits) per (token, head); "
                         "q and the output in bf16",
        "copy_bandwidth_gbs": copy_gbs / 1e9,
        "rows": rows,
    })
    print(f"\n8-bit KV cache, paged decode attention (copy bandwidth {copy_gbs / 1e9:.0f} GB/s)")
    print(f"{'B':>3} {'L':>6} {'bf16 ms':>8} {'int8 ms':>8} {'int8 x':>7} {'fp8 ms':>8} {'fp8 x':>6} "
          f"{'bf16 GB/s':>9} {'int8 GB/s':>9}")
    for r in rows:
        print(f"{r['batch']:>3} {r['seq_len']:>6} {r['bf16_ms']:8.3f} {r['int8_ms']:8.3f} {r['int8_speedup']:7.2f} "
              f"{r['fp8_ms']:8.3f} {r['fp8_speedup']:6.2f} {r['bf16_gbs']:9.0f} {r['int8_gbs']:9.0f}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
