"""Quantisation: store each weight (and the KV cache) in fewer bits, and run the model from them (chapter 06).

The modules, each importing only those above it:

    formats      the number formats and their quantisers: int (absmax, zero point, groups), NF4, FP8,
                 int4 packing, int8 activations per token; tensors only
    linear       QuantLinear (a linear layer run from a quantised weight, W8A8 or weight-only, the
                 Triton W4A16 kernel on CUDA), int8_matmul, and the helpers that find and swap a
                 model's block linears
    calibration  the shipped text samples, and the activations they produce in each linear
    smoothquant, awq, gptq
                 the methods that look at those activations to quantise better
    methods      quantize(model, method, ...) over all of them, and the CLI's --quant names
    kv           the KV cache in int8 or fp8 (kv_cache_dtype): codes, scales and pools; on its own

    from minillm.quant import quantize, stored_weight_bytes
    quantize(model, "gptq", bits=4, group_size=128, calibration=ids)   # in place
    print(stored_weight_bytes(model))

This package re-exports the names of formats, linear and methods; the other modules are imported
by name (`from minillm.quant.gptq import gptq_quantize`).
"""

from minillm.quant.formats import (
    FP8_DTYPES,
    NF4_CODEBOOK,
    WEIGHT_FORMATS,
    FP8Quantized,
    Granularity,
    IntQuantized,
    NF4Quantized,
    Quantized,
    bits_per_weight,
    int_grid,
    int_quantized,
    int_round,
    nf4_codebook,
    nf4_round,
    pack_int4,
    quantize_fp8,
    quantize_int,
    quantize_nf4,
    quantize_per_token,
    quantize_weight,
    unpack_int4,
)
from minillm.quant.linear import QuantLinear, block_linears, int8_matmul, set_module, stored_weight_bytes
from minillm.quant.methods import METHODS, QUANT_OPTIONS, quantize, quantize_by_name

__all__ = [
    "FP8_DTYPES",
    "METHODS",
    "NF4_CODEBOOK",
    "QUANT_OPTIONS",
    "WEIGHT_FORMATS",
    "FP8Quantized",
    "Granularity",
    "IntQuantized",
    "NF4Quantized",
    "QuantLinear",
    "Quantized",
    "bits_per_weight",
    "block_linears",
    "int8_matmul",
    "int_grid",
    "int_quantized",
    "int_round",
    "nf4_codebook",
    "nf4_round",
    "pack_int4",
    "quantize",
    "quantize_by_name",
    "quantize_fp8",
    "quantize_int",
    "quantize_nf4",
    "quantize_per_token",
    "quantize_weight",
    "set_module",
    "stored_weight_bytes",
    "unpack_int4",
]
