"""Quantisation: store each weight in fewer bits, and run the model from them (chapter 06).

A quantiser maps a tensor onto a small grid of codes and a few scales; a dequantiser maps back:

    int (absmax, symmetric)    q = round(w / s),        s = max|w| / (2^(b-1) - 1),  w ~ q * s
    int (zero point, asym.)    q = round(w / s) + z,    s = (max - min) / (2^b - 1), w ~ (q - z) * s
    NF4 (QLoRA)                q = nearest of 16 normal quantiles to w / max|w|,    w ~ NF4[q] * max|w|
    FP8 (e4m3, e5m2)           q = float8(w / s),       s = max|w| / float8 max,     w ~ q * s

How many weights share a scale is the *granularity*: one per tensor, per output channel (row), or
per group of `group_size` consecutive inputs of a row (128 is the common choice). Smaller groups
follow the weights more closely and cost more scale bytes: int4 with fp16 scales and zeros in
groups of 128 is 4 + 32/128 = 4.25 bits per weight.

`QuantLinear` is an `nn.Linear` whose weight is stored quantised; `quantize(model, method, ...)`
swaps every linear of the transformer blocks for one, so that `generate`, the engine and the CLI
(`--quant`) run the quantised model unchanged. The embedding and the tied lm_head stay in the
model's dtype (as in most int4 checkpoints). Methods that look at activations (GPTQ, AWQ,
SmoothQuant) live in `minillm.gptq`, `minillm.awq` and `minillm.smoothquant`; LLM.int8()'s outlier
split is `QuantLinear`'s `outlier_threshold`.

On the CPU `QuantLinear` dequantises its weight and calls `F.linear`: simple and exact, but no
faster than the unquantised model. On a CUDA GPU, 4-bit weights run minillm's Triton W4A16 kernel
(`minillm.kernels.w4a16`), which reads the packed weights and dequantises them in registers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

Granularity = int | str  # a group size, "channel" (one scale per row) or "tensor" (one scale in all)


# ------------------------------------------------------------------------------------- integer grids
@dataclass
class IntQuantized:
    """A [rows, cols] matrix as b-bit integer codes with one scale (and zero point) per group.

    codes: int8 [rows, cols] in -(2^(b-1)-1) .. 2^(b-1)-1 (symmetric) or uint8 in 0 .. 2^b-1
    (asymmetric); for 4 bits, uint8 [rows, cols/2], two codes per byte (`pack_int4`), symmetric
    codes stored + 8. scale, zero: fp32 [rows, n_groups] ([1, 1] per tensor); zero None when symmetric.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    group_size: int  # columns per group (cols when per channel, rows * cols when per tensor)
    shape: tuple[int, int]

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    def int_codes(self) -> torch.Tensor:
        """The codes unpacked, as int16 [rows, cols] (symmetric: signed; asymmetric: 0 .. 2^b-1)."""
        if self.bits == 4:
            q = unpack_int4(self.codes).to(torch.int16)
            return q - 8 if self.symmetric else q
        return self.codes.to(torch.int16)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix the codes stand for, [rows, cols] in `dtype`: (q - zero) * scale."""
        rows, cols = self.shape
        q = self.int_codes().float().reshape(self.scale.shape[0], self.scale.shape[1], -1)
        zero = 0.0 if self.zero is None else self.zero[..., None]
        return ((q - zero) * self.scale[..., None]).reshape(rows, cols).to(dtype)

    def nbytes(self, scale_bytes: int = 2) -> int:
        """Storage as a checkpoint packs it: `bits` per code, scales and zeros in `scale_bytes` each (fp16: 2).

        (Here 4-bit codes are packed two per byte; 2, 3 and 5-7-bit codes sit one per byte, for simplicity.)
        """
        per_group = 1 if self.zero is None else 2
        return math.ceil(self.bits * math.prod(self.shape) / 8) + self.scale.numel() * per_group * scale_bytes


def _groups(w: torch.Tensor, group_size: Granularity) -> tuple[torch.Tensor, int]:
    """w [rows, cols] -> (view [rows or 1, n_groups, g], g)."""
    if w.dim() != 2:
        raise ValueError(f"expected a [rows, cols] matrix, got shape {tuple(w.shape)}; reshape it first.")
    rows, cols = w.shape
    if group_size == "tensor":
        return w.reshape(1, 1, rows * cols), rows * cols
    if group_size == "channel":
        return w.reshape(rows, 1, cols), cols
    if not isinstance(group_size, int) or group_size <= 0 or cols % group_size:
        raise ValueError(
            f"group_size must be 'tensor', 'channel' or a positive divisor of the {cols} columns, got {group_size!r}."
        )
    return w.reshape(rows, cols // group_size, group_size), group_size


def int_grid(w: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) of each group: w [..., g] -> scale [...] fp32, zero [...] or None.

    Symmetric (absmax): s = max|w| / (2^(b-1) - 1), the grid -qmax .. qmax is centred on 0.
    Asymmetric: the grid 0 .. 2^b - 1 spans [min(w, 0), max(w, 0)], z = round(-min / s).
    An all-zero group gets s = 1, so that it dequantises to zeros instead of NaN.
    """
    w = w.float()
    if symmetric:
        scale = w.abs().amax(-1) / (2 ** (bits - 1) - 1)
        return torch.where(scale > 0, scale, torch.ones_like(scale)), None
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scale = (hi - lo) / (2**bits - 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, torch.round(-lo / scale)


def int_round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The codes of w [..., g] on the grid of `int_grid` (scale, zero [...]), as fp32 integers."""
    if zero is None:
        qmax = 2 ** (bits - 1) - 1
        return torch.clamp(torch.round(w.float() / scale[..., None]), -qmax, qmax)
    return torch.clamp(torch.round(w.float() / scale[..., None]) + zero[..., None], 0, 2**bits - 1)


def quantize_int(
    w: torch.Tensor, bits: int = 8, group_size: Granularity = "channel", symmetric: bool = True
) -> IntQuantized:
    """Round-to-nearest integer quantisation of w [rows, cols] (bits 2..8; 4 bits are packed).

    Every weight lands within half a step of its value: |w - dequantize| <= scale / 2.
    """
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be between 2 and 8, got {bits}.")
    groups, g = _groups(w, group_size)
    scale, zero = int_grid(groups, bits, symmetric)
    q = int_round(groups, scale, zero, bits).reshape(w.shape)
    return int_quantized(q, scale, zero, bits, g)


def int_quantized(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group_size: int
) -> IntQuantized:
    """Store integer-valued codes q [rows, cols] (from `int_round`) with their grid: 4 bits packed, else int8/uint8."""
    if bits == 4:
        codes = pack_int4((q + 8 if zero is None else q).to(torch.uint8))
    else:
        codes = q.to(torch.int8 if zero is None else torch.uint8)
    return IntQuantized(codes, scale, zero, bits, group_size, tuple(q.shape))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: q uint8 [..., n] in 0..15, n even -> uint8 [..., n/2].

    Byte i holds code 2i in its low nibble and code 2i+1 in its high nibble.
    """
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of codes in the last dimension, got {q.shape[-1]}.")
    if q.dtype != torch.uint8 or (q.numel() > 0 and int(q.max()) > 15):
        raise ValueError("pack_int4 takes uint8 codes in 0..15 (add 8 to signed int4 codes first).")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: uint8 [..., n/2] -> uint8 [..., n] in 0..15."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------- NF4
def nf4_codebook() -> torch.Tensor:
    """The 16 values of NormalFloat4 (Dettmers et al., QLoRA, 2023), built as the paper describes. [16] fp32.

    Normally distributed weights, scaled into [-1, 1], are best covered by grid points at the
    normal's quantiles. NF4 takes 8 positive and 7 negative quantiles (so that 0 is exactly
    representable and the grid is asymmetric by one point), each side's outermost quantile at
    probability 0.9677 (a fixed offset, so the extreme points are finite), and scales both to [-1, 1].
    """
    offset = 0.9677083
    normal = torch.distributions.Normal(0.0, 1.0)
    positive = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat((positive, torch.zeros(1, dtype=torch.float64), negative)).sort().values
    return (values / values.abs().max()).float()


NF4_CODEBOOK = nf4_codebook()


@dataclass
class NF4Quantized:
    """A [rows, cols] matrix in NF4: 4-bit indices into `NF4_CODEBOOK`, one absmax per block of `block_size`.

    codes: uint8 [rows * cols / 2], two indices per byte. With double quantisation the block absmaxes
    are themselves stored as int8 (`absmax_codes`, one fp32 scale per 256 of them, after subtracting
    their mean), 8 + 32/256 bits per block instead of 32 (QLoRA's trick; it used FP8 for them).
    """

    codes: torch.Tensor
    absmax: torch.Tensor | None  # fp32 [n_blocks], without double quantisation
    absmax_codes: torch.Tensor | None  # int8 [n_blocks]
    absmax_scale: torch.Tensor | None  # fp32 [ceil(n_blocks / 256)]
    absmax_mean: torch.Tensor | None  # fp32 [] (scalar)
    block_size: int
    shape: tuple[int, int]

    def block_absmax(self) -> torch.Tensor:
        """Each block's absmax, [n_blocks] fp32 (rebuilt from its int8 code under double quantisation)."""
        if self.absmax is not None:
            return self.absmax
        n = self.absmax_codes.numel()
        scale = self.absmax_scale.repeat_interleave(256)[:n]
        return self.absmax_codes.float() * scale + self.absmax_mean

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """NF4[q] * absmax of each block, [rows, cols] in `dtype`."""
        values = NF4_CODEBOOK.to(self.codes.device)[unpack_int4(self.codes).long()]
        w = values.reshape(-1, self.block_size) * self.block_absmax()[:, None]
        return w.reshape(self.shape).to(dtype)

    def nbytes(self) -> int:
        scales = 4 * self.absmax.numel() if self.absmax is not None else (
            self.absmax_codes.numel() + 4 * self.absmax_scale.numel() + 4)
        return self.codes.numel() + scales


def nf4_round(x: torch.Tensor) -> torch.Tensor:
    """Index of the nearest NF4 value for each x in [-1, 1]: uint8, same shape."""
    book = NF4_CODEBOOK.to(x.device)
    midpoints = (book[1:] + book[:-1]) / 2
    return torch.bucketize(x.float().contiguous(), midpoints).to(torch.uint8)


def quantize_nf4(w: torch.Tensor, block_size: int = 64, double_quant: bool = True) -> NF4Quantized:
    """NF4 with one absmax per `block_size` consecutive weights (QLoRA's 64), optionally double-quantised."""
    if w.numel() % block_size or block_size % 2:
        raise ValueError(f"NF4 needs the {w.numel()} weights to split into whole blocks of an even "
                         f"block_size, got block_size={block_size}.")
    blocks = w.float().reshape(-1, block_size)
    absmax = blocks.abs().amax(-1)
    absmax = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes = pack_int4(nf4_round(blocks / absmax[:, None]).flatten())
    if not double_quant:
        return NF4Quantized(codes, absmax, None, None, None, block_size, tuple(w.shape))
    mean = absmax.mean()
    centred = absmax - mean
    pad = (-centred.numel()) % 256
    chunks = F.pad(centred, (0, pad)).reshape(-1, 256)
    scale, _ = int_grid(chunks, 8, symmetric=True)
    q = int_round(chunks, scale, None, 8).flatten()[: centred.numel()].to(torch.int8)
    return NF4Quantized(codes, None, q, scale, mean, block_size, tuple(w.shape))


# ---------------------------------------------------------------------------------------------- FP8
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class FP8Quantized:
    """A matrix as 8-bit floats times one fp32 scale per row (or per tensor).

    e4m3: 4 exponent, 3 mantissa bits, max 448 (more precision: weights, activations);
    e5m2: 5 exponent, 2 mantissa bits, max 57344 (more range: gradients). Rounding is to nearest:
    the relative error of a normal number is at most 2^-4 (e4m3) or 2^-3 (e5m2).
    """

    values: torch.Tensor  # float8 [rows, cols]
    scale: torch.Tensor  # fp32 [rows, 1] or [1, 1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.values.float() * self.scale).to(dtype)

    def nbytes(self, scale_bytes: int = 4) -> int:
        return self.values.numel() + self.scale.numel() * scale_bytes


def quantize_fp8(w: torch.Tensor, fmt: str = "e4m3", per_channel: bool = True) -> FP8Quantized:
    """Scale w [rows, cols] so its absmax is the format's largest value, then cast to float8 (round to nearest)."""
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fmt must be one of {sorted(FP8_DTYPES)}, got {fmt!r}.")
    dtype = FP8_DTYPES[fmt]
    w = w.float()
    absmax = w.abs().amax(-1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
    scale = absmax / torch.finfo(dtype).max
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return FP8Quantized((w / scale).to(dtype), scale)


Quantized = IntQuantized | NF4Quantized | FP8Quantized


def bits_per_weight(q: Quantized) -> float:
    """Storage bits per weight, scales and zeros included (fp16 scales for int, fp32 for FP8 and NF4)."""
    shape = q.shape if hasattr(q, "shape") else tuple(q.values.shape)
    return 8 * q.nbytes() / math.prod(shape)


# --------------------------------------------------------------------------- activations (W8A8, LLM.int8)
def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic int8 absmax per row (token): x [..., K] -> (q int8 [..., K], scale fp32 [..., 1])."""
    scale, _ = int_grid(x, 8, symmetric=True)  # absmax / 127 per row, 1 for an all-zero row
    return int_round(x, scale, None, 8).to(torch.int8), scale[..., None]


def int8_matmul(x: torch.Tensor, w: IntQuantized) -> torch.Tensor:
    """x [..., K] @ w.T with x quantised to int8 per token and w int8 per output channel: [..., N] fp32.

    What an int8 tensor-core GEMM computes: integer products summed exactly (int32 accumulation;
    here in fp32, exact while K * 127^2 < 2^24), then one multiply by the two scales per output.
    """
    if w.bits != 8 or w.zero is not None or w.group_size != w.shape[1]:
        raise ValueError("int8_matmul needs a symmetric 8-bit per-channel weight (quantize_int(w, 8, 'channel')).")
    xq, sx = quantize_per_token(x)
    acc = xq.float() @ w.codes.float().T
    return acc * sx * w.scale.reshape(1, -1)


# ----------------------------------------------------------------------------------------- the layer
class QuantLinear(nn.Module):
    """A linear layer y = x W^T + b whose W [out, in] is stored quantised.

    Options, set by the method that built it:
      input_scale [in]: the layer computes (x / input_scale) W'^T with W' = W * input_scale stored
        quantised (AWQ and SmoothQuant migrate scale between activations and weights; a serving
        engine folds 1 / input_scale into the previous RMSNorm or linear, here it is one multiply).
      act_bits=8: W8A8, activations quantised per token to int8 and multiplied in integers
        (SmoothQuant, LLM.int8()); None: weight-only, activations stay in the model's dtype (W4A16).
      outlier_threshold: LLM.int8()'s decomposition: input features whose magnitude exceeds it in
        any token of the batch are multiplied in full precision (activations as they are, weights
        dequantised from int8, as bitsandbytes does), the rest in int8.
    """

    def __init__(
        self,
        weight: Quantized,
        bias: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
        act_bits: int | None = None,
        outlier_threshold: float | None = None,
    ) -> None:
        super().__init__()
        if act_bits not in (None, 8):
            raise ValueError(f"act_bits must be None (weight-only) or 8 (int8 activations), got {act_bits}.")
        if act_bits == 8 and not isinstance(weight, IntQuantized):
            raise ValueError("int8 activations need an int8 weight (quantize_int(w, 8, 'channel')).")
        self.spec = weight  # the format and its sizes; the tensors below are its buffers, moved by .to()
        self.tensor_fields = [f.name for f in fields(weight) if isinstance(getattr(weight, f.name), torch.Tensor)]
        for name in self.tensor_fields:
            self.register_buffer(name, getattr(weight, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("input_scale", input_scale)
        self.act_bits, self.outlier_threshold = act_bits, outlier_threshold
        self.out_features, self.in_features = self.shape
        self._kernel_weight = None  # on CUDA, a 4-bit weight repacked for the W4A16 kernels (built on first use)

    @property
    def shape(self) -> tuple[int, int]:
        return self.spec.shape if hasattr(self.spec, "shape") else tuple(self.spec.values.shape)

    def quantized(self) -> Quantized:
        """The weight's quantised form, on the layer's current device."""
        return replace(self.spec, **{name: getattr(self, name) for name in self.tensor_fields})

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W' [out, in] as stored (times input_scale when one was migrated into it)."""
        return self.quantized().dequantize(dtype)

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - nn.Module's signature
        self._kernel_weight = None  # new codes: repack them at the next CUDA forward
        super()._load_from_state_dict(*args, **kwargs)

    def nbytes(self) -> int:
        """Bytes of the stored weight (scales included) and of any migrated input scale."""
        extra = 0 if self.input_scale is None else self.input_scale.numel() * self.input_scale.element_size()
        return self.quantized().nbytes() + extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        if self.act_bits == 8:
            y = self._int8_forward(x)
        else:
            y = self._weight_only_forward(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _weight_only_forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized()
        if isinstance(q, IntQuantized) and q.bits == 4 and q.zero is not None and x.is_cuda:
            from minillm.kernels.w4a16 import w4a16_linear, w4a16_pack  # the fused kernels, in their own layout

            if self._kernel_weight is None or self._kernel_weight.words.device != x.device:
                self._kernel_weight = w4a16_pack(q)  # once: every fast int4 kernel repacks for its loads
            return w4a16_linear(x, self._kernel_weight)
        return F.linear(x, q.dequantize(x.dtype))

    def _int8_forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized()
        if self.outlier_threshold is None:
            return int8_matmul(x, q).to(x.dtype)
        flat = x.reshape(-1, x.shape[-1])
        outliers = (flat.abs() > self.outlier_threshold).any(0)  # [in]: features with a large value
        regular = torch.where(outliers, torch.zeros_like(flat), flat)
        y = int8_matmul(regular, q)
        if outliers.any():
            cols = outliers.nonzero().flatten()
            y = y + flat[:, cols].float() @ q.dequantize()[:, cols].T
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)

    def extra_repr(self) -> str:
        kind = type(self.spec).__name__
        extras = ("" if self.act_bits is None else f", act_bits={self.act_bits}") + (
            "" if self.outlier_threshold is None else f", outlier_threshold={self.outlier_threshold}")
        return f"in={self.in_features}, out={self.out_features}, {kind}{extras}"


# -------------------------------------------------------------------------------------- the model
WEIGHT_FORMATS = ("int8", "int4", "nf4", "fp8", "fp8-e5m2")
METHODS = ("rtn", "gptq", "awq", "smoothquant", "llm.int8")


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears of the transformer blocks, by module name (what `quantize` replaces)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in f".{name}"}


def quantize_weight(w: torch.Tensor, fmt: str, group_size: Granularity = 128) -> Quantized:
    """Round-to-nearest in one of `WEIGHT_FORMATS`: int8 symmetric per channel; int4 asymmetric per group
    (`group_size`); nf4 in blocks of 64 with double quantisation; fp8 (e4m3 or e5m2) per channel."""
    if fmt == "int8":
        return quantize_int(w, 8, "channel", symmetric=True)
    if fmt == "int4":
        return quantize_int(w, 4, group_size, symmetric=False)
    if fmt == "nf4":
        return quantize_nf4(w)
    if fmt in ("fp8", "fp8-e4m3"):
        return quantize_fp8(w, "e4m3")
    if fmt == "fp8-e5m2":
        return quantize_fp8(w, "e5m2")
    raise ValueError(f"unknown weight format {fmt!r}; choose one of {WEIGHT_FORMATS}.")


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule called `name` (dotted path) by `module`."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


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
        fmt: for rtn only, a format of `WEIGHT_FORMATS` instead of `bits` ("nf4", "fp8", ...).
        options: method-specific settings (see each method's module).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}.")
    if not 2 <= bits <= 8 and method in ("rtn", "gptq", "awq"):
        raise ValueError(f"bits must be between 2 and 8 for {method}, got {bits}.")
    if method in ("gptq", "awq", "smoothquant") and calibration is None:
        raise ValueError(f"{method} needs calibration token ids [n_seqs, seq_len] from the training split "
                         "(see minillm.calibration.calibration_ids).")
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
        from minillm.gptq import gptq_quantize_model

        gptq_quantize_model(model, calibration, bits, group_size, damp=float(options.get("damp", 0.01)))
    elif method == "awq":
        from minillm.awq import awq_quantize_model

        awq_quantize_model(model, calibration, bits, group_size, grid=int(options.get("grid", 20)))
    else:
        from minillm.smoothquant import smoothquant_model

        smoothquant_model(model, calibration, alpha=float(options.get("alpha", 0.5)))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: quantised layers at their packed size, the rest as they are."""
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.nbytes()
        for p in module.parameters(recurse=False):
            if id(p) not in seen:  # a tied embedding and lm_head count once
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


# ------------------------------------------------------------------------------------ by name (CLI)
QUANT_OPTIONS = ("int8", "int4", "nf4", "fp8", "gptq-int4", "awq-int4", "smoothquant", "llm.int8")


def quantize_by_name(model: nn.Module, name: str, tokenizer=None) -> nn.Module:  # noqa: ANN001 - a Tokenizer
    """`minillm generate --quant NAME` and `minillm serve --quant NAME`: one of `QUANT_OPTIONS`.

    int8 / int4 / nf4 / fp8: round to nearest (int4 in groups of 128). gptq-int4, awq-int4 and
    smoothquant calibrate on 32 windows of 256 tokens of the shipped training sample
    (`minillm.calibration.calibration_ids`), encoded with the model's own tokenizer.
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
    from minillm.calibration import calibration_ids

    calibration = calibration_ids(tokenizer)
    method = name.split("-")[0]
    return quantize(model, method, bits=4, calibration=calibration) if method != "smoothquant" else quantize(
        model, "smoothquant", calibration=calibration)
