"""Decode attention when a graph's key range is far longer than the rows' contexts (issue 30).

A CUDA graph fixes its launch grid at capture, so the decode attention kernel's chunks (chapter 03) are counted
from the longest context the graph allows, not from this step's rows. For a real checkpoint served with a large
pool that is the model's whole context: Llama-3.2's 131,072 tokens. Cut into chunks of equal, fixed size, a
chunk was 1,024 keys, and a 512-token context fit in one: 8 programs (one per KV head) did all of batch 1's
attention while the other programs found nothing to do. The kernel now cuts each row's own length into the
launch's chunks.

Measured: the batch-1 graph replay and its attention kernels' GPU time (one profiled step), on Llama-3.2-1B's
and Llama-3-8B's shapes (random bf16 weights, a `--context`-token context), with the graphs captured for key
ranges of `--ranges` tokens (the pool sized to hold the longest).

    python benchmarks/decode_key_range.py     # a CUDA GPU: results/decode_key_range/<name>.json (--name, default cuda)

The book keeps only A/B rounds of it, in results/decode_key_range/archive/.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from common import write_results
from matvec import alternated_replays, random_model
from roofline import SHAPES, prefilled_cache, profile_steps

from minillm.engine.cuda_graphs import DecodeGraphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--ranges", type=int, nargs="+", default=[640, 8192, 131072])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--name", default="cuda", help="the results file: results/decode_key_range/<name>.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_key_range.py needs a CUDA GPU.")
    rows = []
    for shape in args.shapes:
        model = random_model(shape, max(args.ranges))
        cache, tokens = prefilled_cache(model, 1, args.context, max(args.ranges))
        graphs = {}
        for key_range in args.ranges:
            graphs[key_range] = DecodeGraphs(model, cache, max_batch=1, max_seq_len=key_range)
            graphs[key_range].run([0], tokens)  # inputs in place: replays rewrite the same slot
        times = alternated_replays(graphs, args.rounds, args.steps)
        for key_range, g in graphs.items():
            profile = profile_steps(lambda g=g, t=tokens: g.run([0], t))
            replay = statistics.median(times[key_range])
            rows.append({"shape": shape, "batch": 1, "context": args.context, "key_range": key_range,
                         "graph_max_seq_len": g.max_seq_len, "replay_s": replay, "replay_s_rounds": times[key_range],
                         "attention_us": profile["by_kind_us"].get("attention", 0.0),
                         "top_kernels_us": profile["top_kernels_us"]})
            print(f"{shape} key range {g.max_seq_len:>6}: replay {replay * 1e3:.3f} ms, attention "
                  f"{rows[-1]['attention_us']:.0f} us", flush=True)
        del graphs, model, cache
        torch.cuda.empty_cache()
    path = write_results(f"decode_key_range/{args.name}", {
        "benchmark": "batch-1 decode graphs captured for key ranges past the context",
        "settings": vars(args), "rows": rows})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
