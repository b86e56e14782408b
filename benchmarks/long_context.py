"""Usable context, measured: a model trained at one length asked at longer ones, with and without RoPE rescaling
(chapter 09, `minillm.eval.long_context`).

Trains the key-value lookup model (`LookupSettings()`: 2 layers, 64 wide, sequences of 64 tokens with 2 needles),
then measures the share of lookups answered right:
- at the training length, by the depth of the asked-for needle (0 = the start of the context, 1 = its end);
- at 1, 2, 4, 8 and 16 times the training length, with the rotary frequencies as trained ("none") and rescaled
  at inference for the longer context: linear interpolation, NTK-aware, YaRN and Llama 3's (factor = length /
  training length; no retraining);
- at every length and depth, unchanged and with the two rescalings of `DEPTH_KINDS`: where in a long context
  the lookups that fail had their needle (is the middle lost once the context outgrows training?).

Longer contexts also hold more filler around the same two needles, so the drop mixes two effects: positions
never seen in training, and more distractors. The rescalings change only the first.

    python benchmarks/long_context.py        # ~5 min on 2 cores; writes results/long_context/cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from common import write_results

from minillm.eval.long_context import LookupSettings, accuracy, context_table, rescaled, train_lookup

KINDS = ["none", "linear", "ntk", "yarn", "llama3"]
DEPTH_KINDS = ["none", "linear", "yarn"]
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=LookupSettings.steps)
    parser.add_argument("--n", type=int, default=256, help="lookups per measurement")
    args = parser.parse_args()
    torch.set_num_threads(2)
    s = dataclasses.replace(LookupSettings(), steps=args.steps)
    start = time.perf_counter()
    model, log = train_lookup(s)
    train_s = time.perf_counter() - start
    print(f"trained {s.steps} steps in {train_s:.0f} s; accuracy at {s.train_len} tokens: {log[-1]['accuracy']:.3f}")
    depths = {d: accuracy(model, s, s.train_len, args.n, depth=d) for d in DEPTHS}
    lengths = [s.train_len * m for m in (1, 2, 4, 8, 16)]
    table = context_table(model, s, lengths, KINDS, args.n)
    print(f"{'rescaling':<8}" + "".join(f"{L:>8}" for L in lengths))
    for kind, row in table.items():
        print(f"{kind:<8}" + "".join(f"{row[L]:>8.3f}" for L in lengths))
    print("by depth at the training length:", {d: round(a, 3) for d, a in depths.items()})
    by_depth_and_length = {}
    for kind in DEPTH_KINDS:
        by_depth_and_length[kind] = {}
        for L in lengths:
            m = rescaled(model, kind, max(1.0, L / s.train_len))
            by_depth_and_length[kind][str(L)] = {str(d): accuracy(m, s, L, args.n, depth=d) for d in DEPTHS}
            print(f"{kind:<8} {L:>5} by depth: " + " ".join(f"{a:.2f}" for a in by_depth_and_length[kind][str(L)]
                                                          .values()))
    path = write_results("long_context/cpu", {
        "benchmark": "key-value lookup beyond the training length, with RoPE rescalings at inference",
        "settings": dataclasses.asdict(s) | {"lookups_per_measurement": args.n, "train_seconds": round(train_s, 1)},
        "training_log": log, "by_depth": depths,
        "by_length": {kind: {str(L): a for L, a in row.items()} for kind, row in table.items()},
        "by_depth_and_length": by_depth_and_length})
    print("wrote", path)


if __name__ == "__main__":
    main()
