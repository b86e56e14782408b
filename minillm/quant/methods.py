"""Quantise a whole model by method name: `quantize(model, method, ...)` and the CLI's `--quant` names (chapter 06).

`quantize` swaps every linear of the transformer blocks for a `QuantLinear`, by one of `METHODS`:
round to nearest (any format of `minillm.quant.formats`), LLM.int8() (W8A8 with full-precision
outliers), or a method that looks at activations on calibration text: GPTQ, AWQ and SmoothQuant
(`minillm.quant.gptq`, `minillm.quant.awq`, `minillm.quant.smoothquant`). `quantize_by_name` maps
the CLI's `QUANT_OPTIONS` (`minillm generate --quant int4`) onto it.
"""

from __future__ import annotations

import torch
from torch import nn

from minillm.quant.awq import awq_quantize_model
from minillm.quant.calibration import calibration_ids
from minillm.quant.formats import Granularity, quantize_int, quantize_weight
from minillm.quant.gptq import gptq_quantize_model
from minillm.quant.linear import QuantLinear, block_linears, set_module
from minillm.quant.smoothquant import smoothquant_model
from minillm.tokenizer import Tokenizer

METHODS = ("rtn", "gptq", "awq", "smoothquant", "llm.int8")


def quantize(
    model: nn.Module,
    method: str = "rtn",
    bits: int = 4,
    group_size: Granularity = 128,
    calibration: torch.Tensor | None = None,
    fmt: str | None = None,
    **options: float,
) -> nn.Module:
    """Quantise `model`'s block linears in place and return it.

    Args:
        method: "rtn" (round to nearest), "gptq", "awq" (weight-only, int4 or int8), "smoothquant"
            (W8A8, option alpha=0.5) or "llm.int8" (W8A8 with full-precision outliers, option
            threshold=6.0).
        bits: for the weight-only methods: 8 is symmetric per channel, 2 to 7 asymmetric per group
            (AWQ's grids are asymmetric at every width).
        group_size: inputs per scale below 8 bits (128), or "channel".
        calibration: token ids [n_seqs, seq_len] from the *training* split, for gptq, awq and smoothquant.
        fmt: for rtn only, a format of `minillm.quant.formats.WEIGHT_FORMATS` instead of `bits` ("nf4", "fp8", ...).
        options: method-specific settings (see each method's module).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}.")
    if not 2 <= bits <= 8 and method in ("rtn", "gptq", "awq"):
        raise ValueError(f"bits must be between 2 and 8 for {method}, got {bits}.")
    if method in ("gptq", "awq", "smoothquant") and calibration is None:
        raise ValueError(f"{method} needs calibration token ids [n_seqs, seq_len] from the training split "
                         "(see minillm.quant.calibration.calibration_ids).")
    unknown = set(options) - {"alpha", "threshold", "damp", "grid"}
    if unknown:
        raise ValueError(f"unknown options {sorted(unknown)} for quantize.")
    if method == "rtn":
        for name, linear in block_linears(model).items():
            w = linear.weight.data
            q = quantize_weight(w, fmt, group_size) if fmt else quantize_int(
                w, bits, "channel" if bits == 8 else group_size, symmetric=bits == 8)
            set_module(model, name, QuantLinear(q, linear.bias))
    elif method == "llm.int8":
        threshold = float(options.get("threshold", 6.0))
        for name, linear in block_linears(model).items():
            set_module(model, name, QuantLinear(quantize_int(linear.weight.data, 8, "channel"), linear.bias,
                                                act_bits=8, outlier_threshold=threshold))
    elif method == "gptq":
        gptq_quantize_model(model, calibration, bits, group_size, damp=float(options.get("damp", 0.01)))
    elif method == "awq":
        awq_quantize_model(model, calibration, bits, group_size, grid=int(options.get("grid", 20)))
    else:
        smoothquant_model(model, calibration, alpha=float(options.get("alpha", 0.5)))
    return model


# ------------------------------------------------------------------------------------ by name (CLI)
QUANT_OPTIONS = ("int8", "int4", "nf4", "fp8", "gptq-int4", "awq-int4", "smoothquant", "llm.int8")


def quantize_by_name(model: nn.Module, name: str, tokenizer: Tokenizer | None = None) -> nn.Module:
    """`minillm generate --quant NAME` and `minillm serve --quant NAME`: one of `QUANT_OPTIONS`.

    int8 / int4 / nf4 / fp8: round to nearest (int4 in groups of 128). gptq-int4, awq-int4 and
    smoothquant calibrate on 32 windows of 256 tokens of the shipped training sample
    (`minillm.quant.calibration.calibration_ids`), encoded with the model's own tokenizer.
    """
    if name not in QUANT_OPTIONS:
        raise ValueError(f"unknown quantisation {name!r}; choose one of {', '.join(QUANT_OPTIONS)}.")
    if name in ("int8", "int4"):
        return quantize(model, "rtn", bits=int(name[3:]))
    if name in ("nf4", "fp8"):
        return quantize(model, "rtn", fmt=name)
    if name == "llm.int8":
        return quantize(model, "llm.int8")
    if tokenizer is None:
        raise ValueError(f"{name} calibrates on text, so it needs the model's tokenizer.")
    calibration = calibration_ids(tokenizer)
    method = name.split("-")[0]
    return quantize(model, method, bits=4, calibration=calibration) if method != "smoothquant" else quantize(
        model, "smoothquant", calibration=calibration)
