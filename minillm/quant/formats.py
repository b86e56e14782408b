"""Number formats: a tensor as a few codes and scales, and back (chapter 06).

A quantiser maps a tensor onto a small grid of codes and a few scales; a dequantiser maps back:

    int (absmax, symmetric)    q = round(w / s),        s = max|w| / (2^(b-1) - 1),  w ~ q * s
    int (zero point, asym.)    q = round(w / s) + z,    s = (max - min) / (2^b - 1), w ~ (q - z) * s
    NF4 (QLoRA)                q = nearest of 16 normal quantiles to w / max|w|,    w ~ NF4[q] * max|w|
    FP8 (e4m3, e5m2)           q = float8(w / s),       s = max|w| / float8 max,     w ~ q * s

How many weights share a scale is the *granularity*: one per tensor, per output channel (row), or
per group of `group_size` consecutive inputs of a row (128 is the common choice). Smaller groups
follow the weights more closely and cost more scale bytes: int4 with fp16 scales and zeros in
groups of 128 is 4 + 32/128 = 4.25 bits per weight.

Each format is a dataclass (`IntQuantized`, `NF4Quantized`, `FP8Quantized`) with `dequantize()` and
`nbytes()`; `quantize_weight(w, fmt)` picks one by name. `quantize_per_token` is the int8 format of
activations (W8A8). This module knows only tensors: the layer that runs from these formats is
`minillm.quant.linear.QuantLinear`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


# ---------------------------------------------------------------------------------------- by name
WEIGHT_FORMATS = ("int8", "int4", "nf4", "fp8", "fp8-e5m2")


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
