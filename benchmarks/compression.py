"""Pruning and distillation measured on the shipped models, on the CPU (chapter 06).

Pruning: validation perplexity of the shipped target and draft, dense and with every block linear
pruned to 50% (`minillm.train.pruning.prune`): unstructured and 2:4, scored by magnitude and by Wanda's
|w| * ||x|| (input norms from the shipped training sample). Nothing here is faster: on a CPU the
zeros are multiplied like any other weight (see minillm/train/pruning.py for when they pay).

Distillation: the shipped draft before, after `minillm.train.distill.distill` from the shipped target,
and after the same steps, windows and schedule of plain next-token training (`minillm.train.gqa.uptrain`
with `distill_settings`, the control), each judged by validation perplexity and by greedy agreement
with the target (`minillm.train.loop.greedy_agreement`). Training sees only the shipped training sample.

Perplexity is `minillm.eval.perplexity(model, validation_ids(tokenizer), max_windows=64)`: the
first 64 windows of 256 tokens of the shipped validation sample (the model cards use 256 windows of
the full validation split, so their numbers differ); agreement is over the same 64 windows.

    python benchmarks/compression.py          # writes results/compression/cpu.json
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
from common import write_results

import minillm
from minillm.eval import perplexity
from minillm.quant.calibration import calibration_ids, sample_text, validation_ids
from minillm.train.distill import distill, distill_settings
from minillm.train.gqa import uptrain
from minillm.train.loop import batches_for_eval, greedy_agreement
from minillm.train.pruning import prune, sparsity_of

PRUNINGS = [("unstructured", "magnitude"), ("unstructured", "wanda"), ("2:4", "magnitude"), ("2:4", "wanda")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="distillation (and control) steps")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--eval-windows", type=int, default=64, help="validation windows of 256 tokens")
    parser.add_argument("--calibration-seqs", type=int, default=32, help="Wanda's calibration windows of 256 tokens")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared 2-core machine a second thread stalls behind other jobs)")
    parser.add_argument("--out", default="cpu", help="the results file: results/compression/<out>.json")
    parser.add_argument("--note", default="", help="a sentence stored in the results file")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    load_before = os.getloadavg()
    target, tok = minillm.load(minillm.DEFAULT_MODEL, dtype=torch.float32)
    draft, _ = minillm.load(minillm.DEFAULT_DRAFT, dtype=torch.float32)
    val = validation_ids(tok)
    windows = batches_for_eval(val, 256, args.eval_windows)
    calibration = calibration_ids(tok, n_seqs=args.calibration_seqs, seq_len=256)
    train_ids = torch.tensor(tok.encode(sample_text("train")), dtype=torch.long)

    def ppl(model: minillm.Transformer) -> float:
        return perplexity(model, val, seq_len=256, max_windows=args.eval_windows)

    pruning = []
    for name, model in [(minillm.DEFAULT_MODEL, target), (minillm.DEFAULT_DRAFT, draft)]:
        dense = ppl(model)
        rows = [{"method": "dense", "scores": None, "sparsity": 0.0, "val_ppl": dense, "prune_seconds": 0.0}]
        for method, scores in PRUNINGS:
            pruned = copy.deepcopy(model)
            t0 = time.perf_counter()
            prune(pruned, method, 0.5, calibration if scores == "wanda" else None, scores=scores)
            seconds = time.perf_counter() - t0
            rows.append({"method": method, "scores": scores, "sparsity": sparsity_of(pruned), "val_ppl": ppl(pruned),
                         "prune_seconds": seconds})
            print(f"{name} {method:>12} {scores:>9}: ppl {dense:.2f} dense -> {rows[-1]['val_ppl']:.2f}")
        pruning.append({"model": name, "rows": rows})

    def judge(model: minillm.Transformer) -> dict:
        return {"val_ppl": ppl(model), "greedy_agreement": greedy_agreement(model, target, windows)}

    settings = distill_settings(args.steps, args.lr, args.batch_size, args.seq_len)
    before = judge(draft)
    t0 = time.perf_counter()
    student, kd_losses = distill(draft, target, train_ids, args.steps, args.lr, args.batch_size, args.seq_len,
                                 args.temperature)
    t1 = time.perf_counter()
    control, ce_losses = uptrain(draft, train_ids, args.steps, settings)
    t2 = time.perf_counter()
    distilled, trained = judge(student), judge(control)
    for label, r in [("before", before), ("distilled", distilled), ("control", trained)]:
        print(f"draft {label:>9}: ppl {r['val_ppl']:.2f}, agrees with the target at {100 * r['greedy_agreement']:.1f}%")

    def mean(xs: list[float]) -> float:
        return sum(xs) / max(1, len(xs))

    total = time.perf_counter() - start
    path = write_results(f"compression/{args.out}", {
        "benchmark": "validation perplexity of the shipped models pruned to 50% (minillm.train.pruning), and the "
                     "shipped draft distilled from the shipped target (minillm.train.distill) against plain training "
                     "(control)",
        "data": {"validation": f"shipped sample, first {args.eval_windows} windows of 256 tokens",
                 "calibration": f"{args.calibration_seqs} windows of 256 tokens from the shipped training sample",
                 "train_tokens": len(train_ids)},
        "note": args.note,
        "load_average_at_start": load_before,
        "pruning": pruning,
        "distillation": {
            "student": minillm.DEFAULT_DRAFT, "teacher": minillm.DEFAULT_MODEL,
            "settings": {**settings.__dict__, "temperature": args.temperature},
            "tokens_seen": args.steps * args.batch_size * args.seq_len,
            "epochs_of_the_training_sample": args.steps * args.batch_size * args.seq_len / len(train_ids),
            "target_val_ppl": pruning[0]["rows"][0]["val_ppl"],
            "before": before,
            "distilled": {**distilled, "loss_first_10_steps": mean(kd_losses[:10]),
                          "loss_last_10_steps": mean(kd_losses[-10:]), "seconds": t1 - t0},
            "control_next_token_training": {**trained, "loss_first_10_steps": mean(ce_losses[:10]),
                                            "loss_last_10_steps": mean(ce_losses[-10:]), "seconds": t2 - t1},
        },
        "total_seconds": total,
    })
    print(f"wrote {path} in {total:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
