"""Chapter 06's exercise tasks: absmax int8 per output channel, group-wise int4 with zero points and packing, the
NF4 code lookup, one GPTQ column step, and the shipped model's perplexity after the reader's int4 round trip.

Each task is checked against minillm's own quantisers (`minillm.quant.quantize_int`, `nf4_round`,
`minillm.quant.gptq.quantize_column`, `minillm.quant.quantize`): on hand-made cases whose answer the task's text works
out, on cases built to catch one mistake each (a row whose largest weight is negative, a group of positive weights,
a weight that lands on a half step, weights beyond the grid), and on random matrices shaped like a model's weights
(row scales spread over two decades, a few outliers). Codes may differ from the reference by one where the value to
round is within 0.001 of a half step, so that a different but exact order of operations is not failed for a
rounding tie; the tests that are about ties use values that are exact in binary.

The GPTQ step works in place on W: a probe (see `grading.registry.call_probed`) returns W after the call as well as
the result, so the check sees the update also when the reader's function runs in the grader's sandbox. Its last
test runs the reader's step as GPTQ's inner loop on a whole layer and compares the layer's output error with
`minillm.quant.gptq.gptq_quantize`'s. The last task puts the reader's round trip into every block linear of the shipped
model and compares the validation perplexity with minillm's round-to-nearest int4.

Each wrong answer is diagnosed by running the common wrong versions on the same cases: the hint names the first
one the reader's answers agree with.
"""

from __future__ import annotations

import copy
import functools
import math
import random
from collections.abc import Callable

import torch

from minillm.book.grading.probes import describe, gptq_with, run_column
from minillm.book.grading.registry import MismatchError, call_probed, diagnose, register_task
from minillm.quant import NF4_CODEBOOK, int_grid, nf4_round, quantize_int, unpack_int4
from minillm.quant.gptq import gptq_quantize, hessian, inverse_hessian_factor, quantize_column

TIE_MARGIN = 1e-3  # a value within this of a half step may round either way


def _parts(got: object, names: tuple[str, ...], what: str, hint: str) -> tuple[torch.Tensor, ...]:
    """The reader's result as a tuple of len(names) tensors, or a MismatchError that says what came instead."""
    if isinstance(got, (tuple, list)) and len(got) == len(names) and all(isinstance(t, torch.Tensor) for t in got):
        return tuple(got)
    raise MismatchError(what, f"a tuple of {len(names)} tensors ({', '.join(names)})", describe(got), hint)


def _near_tie(v: torch.Tensor) -> torch.Tensor:
    """Where v, a value about to be rounded, is within TIE_MARGIN of a half step (either neighbour is fair)."""
    return ((v - v.floor()) - 0.5).abs() < TIE_MARGIN


def _codes_agree(got: torch.Tensor, expected: torch.Tensor, loose: torch.Tensor | None) -> torch.Tensor:
    """Per entry: the codes are equal, or whole codes one apart where `loose` says the value sat on a half step."""
    g = got.double()
    diff = (g - expected.double()).abs()
    ok = diff == 0
    return ok if loose is None else ok | (loose & (diff == 1))


def _mostly_equal(a: object, b: object, atol: float = 0.0, rtol: float = 0.0) -> bool:
    """Same shape, and at most 0.2% of the entries differ (by at most one code, or beyond the tolerance for
    floats): two answers that agree up to rounding ties. Small tensors must agree everywhere."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    x, y = a.detach().double(), b.detach().double()
    if a.dtype.is_floating_point or b.dtype.is_floating_point:
        off = ~((x - y).abs() <= atol + rtol * y.abs())
    else:
        if bool(((x - y).abs() > 1).any()):
            return False
        off = x != y
    return int(off.sum()) <= int(0.002 * a.numel())


def _same_parts(atols: tuple[float, ...]) -> Callable[[object, object], bool]:
    """`same` for diagnose: two tuples of tensors that agree part by part (scales to rtol 1e-5, codes up to ties)."""
    def same(a: object, b: object) -> bool:
        if not (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b) == len(atols)):
            return False
        for x, y, atol in zip(a, b, atols):
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.numel() == y.numel():
                x, y = x.reshape(y.shape), y
            if not _mostly_equal(x, y, atol, 1e-5):
                return False
        return True
    return same


def _weights(gen: torch.Generator, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A matrix shaped like a model's weights: normal rows whose scales spread over two decades, and about one
    weight in 200 an outlier 10 to 30 times its row's typical size."""
    row_scale = 10 ** (-2 + 2 * torch.rand(rows, 1, generator=gen))
    w = torch.randn(rows, cols, generator=gen) * row_scale
    outliers = torch.rand(rows, cols, generator=gen) < 0.005
    w = torch.where(outliers, w * (10 + 20 * torch.rand(rows, cols, generator=gen)), w)
    return w.to(dtype)


# ---- 06.absmax_int8 ---------------------------------------------------------------------------------


def reference_absmax_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 per output channel (row) of w [rows, cols]: (codes int8 [rows, cols], scale fp32
    [rows, 1]) with scale = max|w_row| / 127 (1 for an all-zero row) and codes = round(w / scale), so that
    w ~ codes * scale. minillm's `quantize_int(w, 8, "channel")`."""
    q = quantize_int(w, 8, "channel", symmetric=True)
    return q.codes, q.scale


absmax_task = register_task(
    "06.absmax_int8",
    "absmax_int8(w: Tensor[rows, cols]) -> tuple[Tensor, Tensor]  (codes int8 [rows, cols], scale fp32 [rows, 1]; "
    "w ~ codes * scale)",
    reference=reference_absmax_int8,
    forbid=("minillm.quant.quantize_int", "minillm.quant.int_grid", "minillm.quant.int_round",
            "minillm.quant.quantize_per_token", "minillm.quant.quantize_weight", "minillm.quant.IntQuantized",
            "torch.quantize_per_channel", "torch.ao.quantization.observer.PerChannelMinMaxObserver"),
)

_ABSMAX_HOW = ("per row: scale = w.abs().amax(dim=1, keepdim=True) / 127 (1 where that is 0), computed in fp32; "
               "codes = torch.round(w / scale).clamp(-127, 127).to(torch.int8).")


def _absmax_variant(reduce: str = "row", stat: str = "absmax", qmax: float = 127, rounding: str = "round",
                    clamp: tuple[int, int] | None = (-127, 127), invert: bool = False,
                    low_precision: bool = False) -> Callable:
    """reference_absmax_int8 with one common mistake switched on."""
    def absmax_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = w if low_precision else w.float()
        size = x.abs() if stat == "absmax" else x
        if reduce == "row":
            top = size.amax(dim=1, keepdim=True)
        else:  # one scale for the whole matrix
            top = size.amax().reshape(1, 1).expand(x.shape[0], 1)
        scale = top / qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
        v = x.float() / scale
        q = {"round": torch.round, "trunc": torch.trunc, "floor": torch.floor,
             "half_up": lambda t: torch.floor(t + 0.5),
             "half_away": lambda t: torch.sign(t) * torch.floor(t.abs() + 0.5)}[rounding](v)
        if clamp is not None:
            q = q.clamp(*clamp)
        return q.to(torch.int8), (1 / scale if invert else scale)
    return absmax_int8


_NOT_128 = ("divide by 127 = 2^7 - 1, not 128: the symmetric grid is -127..127, so that +max|w| and -max|w| both map "
            "to a code. With 128, max|w| maps to 128, which int8 cannot hold.")

_ABSMAX_SUSPECTS: list[tuple[Callable, str]] = [
    (_absmax_variant(reduce="tensor"),
     "one scale per OUTPUT CHANNEL, i.e. per row of w [out, in]: reduce over the columns, w.abs().amax(dim=1, "
     "keepdim=True). One scale for the whole matrix lets the largest row set the step of every row, and the small "
     "rows lose their precision."),
    (_absmax_variant(stat="max"),
     "the scale comes from the largest MAGNITUDE, max|w| = w.abs().amax(...), not from max(w): a row's most "
     "negative weight may be its largest, and it must still map inside -127..127."),
    (_absmax_variant(stat="max", clamp=None),
     "the scale comes from the largest MAGNITUDE, max|w| = w.abs().amax(...), not from max(w): a row's most "
     "negative weight may be its largest, and beyond -127 it does not fit in int8 (it wraps around)."),
    (_absmax_variant(qmax=128, clamp=(-128, 127)),
     _NOT_128),
    (_absmax_variant(qmax=128),
     _NOT_128),
    (_absmax_variant(qmax=128, clamp=None),
     "divide by 127 = 2^7 - 1, not 128: with 128, a row's largest weight maps to 128, which does not fit in int8 "
     "and wraps around to -128."),
    (_absmax_variant(qmax=255),
     "the symmetric int8 grid is -127..127: scale = max|w| / 127. 255 steps is the unsigned (asymmetric) range, "
     "and with it only half the codes are used."),
    (_absmax_variant(qmax=255, clamp=None),
     "the symmetric int8 grid is -127..127: scale = max|w| / 127. 255 steps is the unsigned (asymmetric) range."),
    (_absmax_variant(rounding="trunc"),
     "round to the nearest code with torch.round before casting: .to(torch.int8) alone truncates towards zero, "
     "up to a whole step off instead of half a step."),
    (_absmax_variant(rounding="floor"),
     "round to the NEAREST code (torch.round), not down: floor is up to a whole step off, and always the same way."),
    (_absmax_variant(rounding="half_up"),
     "a value exactly halfway between two codes rounds to the EVEN one, as torch.round does (2.5 -> 2, 3.5 -> 4, "
     "-0.5 -> 0): floor(x + 0.5) always rounds halves up. Use torch.round."),
    (_absmax_variant(rounding="half_away"),
     "a value exactly halfway between two codes rounds to the EVEN one, as torch.round does (2.5 -> 2, 3.5 -> 4, "
     "-2.5 -> -2): rounding halves away from zero, as C's round() does, biases the codes outwards. Use "
     "torch.round."),
    (_absmax_variant(invert=True),
     "return the step size, scale = max|w| / 127, so that w ~ codes * scale; you returned its inverse, "
     "127 / max|w|."),
    (_absmax_variant(low_precision=True),
     "compute in fp32 (w = w.float() first): the scale must be exact in fp32 whatever w's dtype, and a bf16 or "
     "fp16 max|w| / 127 is rounded to 8 or 11 bits."),
]


def _has_zero_group(w: torch.Tensor, group_size: int) -> bool:
    """Whether some group of `group_size` consecutive columns of a row of w is all zeros."""
    rows, cols = w.shape
    return bool((w.float().reshape(rows, cols // group_size, group_size).abs().amax(-1) == 0).any())


def _without_zero_groups(got: list, cases: list[tuple], group_size: Callable[[tuple], int]) -> tuple[list, list]:
    """The (answer, case) pairs whose matrix has no all-zero group (where any positive scale is right, so that the
    wrong versions' guards need not match the reader's); all of them if every case has one."""
    kept = [(g, c) for g, c in zip(got, cases) if not _has_zero_group(c[0], group_size(c))]
    return ([g for g, _ in kept], [c for _, c in kept]) if kept else (got, cases)


def _check_absmax(fn: Callable, cases: list[torch.Tensor], what: str, exact_ties: bool = False) -> None:
    """absmax_int8 on every case, then each answer against the reference (codes one apart are accepted where
    w / scale is within TIE_MARGIN of a half step, unless `exact_ties`)."""
    got = []
    for w in cases:
        rows, cols = w.shape
        call = f"{what}: absmax_int8(w [{rows}, {cols}] {w.dtype})"
        codes, scale = _parts(fn(w.clone()), ("codes", "scale"), call,
                              "return (codes, scale): codes = round(w / scale) as int8, scale = max|w| / 127 per row.")
        if codes.shape != w.shape:
            raise MismatchError(f"{call}: codes", f"shape {list(w.shape)}, one code per weight",
                                f"shape {list(codes.shape)}", "return a code for every weight, in w's shape.")
        if codes.dtype != torch.int8:
            raise MismatchError(f"{call}: codes", "dtype torch.int8", f"dtype {codes.dtype}",
                                "int8 is the point: store the rounded codes with .to(torch.int8) (they lie in "
                                "-127..127).")
        if scale.numel() != rows:
            raise MismatchError(f"{call}: scale", f"{rows} values, one per output channel (row), shape [{rows}, 1]",
                                f"shape {list(scale.shape)}",
                                "one scale per row of w [out, in]: w.abs().amax(dim=1, keepdim=True) / 127. The rows "
                                "are the output channels; a scale per column would follow the inputs instead.")
        if scale.dtype != torch.float32:
            raise MismatchError(f"{call}: scale", "dtype torch.float32", f"dtype {scale.dtype}",
                                "compute in fp32 (w.float()): the scale is fp32 whatever w's dtype.")
        got.append((codes, scale))
    for (codes, scale), w in zip(got, cases):
        e_codes, e_scale = reference_absmax_int8(w)
        zero_row = w.abs().amax(dim=1) == 0
        s = scale.reshape(-1).double()
        bad_zero = zero_row & ~(torch.isfinite(s) & (s > 0))
        if bool(bad_zero.any()) or bool((codes[zero_row] != 0).any()):
            r = int((bad_zero | (codes != 0).any(1) & zero_row).nonzero()[0])
            raise MismatchError(f"{what}: absmax_int8(w) for the all-zero row {r}",
                                "codes 0 and a finite, positive scale (minillm uses 1)",
                                f"scale {float(s[r]):.4g}, codes {codes[r, :6].tolist()}",
                                "an all-zero row has max|w| = 0: use a scale of 1 there (torch.where(scale > 0, "
                                "scale, 1)), or w / scale divides 0 by 0 and gives NaN.")
        scale_ok = zero_row | torch.isclose(s, e_scale.reshape(-1).double(), rtol=1e-5, atol=0)
        if not bool(scale_ok.all()):
            r = int((~scale_ok).nonzero()[0])
            hint = diagnose(*_without_zero_groups(got, [(x,) for x in cases], lambda c: c[0].shape[1]),
                            _ABSMAX_SUSPECTS, _ABSMAX_HOW, _same_parts((0.0, 0.0)))
            raise MismatchError(f"{what}: absmax_int8(w [{w.shape[0]}, {w.shape[1]}] {w.dtype}): scale of row {r} "
                                f"(max|w| = {float(w[r].float().abs().max()):.6g})",
                                f"{float(e_scale[r]):.6g}", f"{float(s[r]):.6g}", hint)
        loose = None if exact_ties else _near_tie(w.float() / e_scale)
        ok = _codes_agree(codes, e_codes, loose) | zero_row[:, None]
        if not bool(ok.all()):
            r, c = (int(i) for i in (~ok).nonzero()[0])
            hint = diagnose(*_without_zero_groups(got, [(x,) for x in cases], lambda c: c[0].shape[1]),
                            _ABSMAX_SUSPECTS, _ABSMAX_HOW, _same_parts((0.0, 0.0)))
            raise MismatchError(f"{what}: absmax_int8(w [{w.shape[0]}, {w.shape[1]}] {w.dtype}): codes[{r}, {c}] "
                                f"for w = {float(w[r, c]):.6g} (scale {float(e_scale[r]):.6g}, w / scale = "
                                f"{float(w[r, c].float() / e_scale[r]):.4f})",
                                f"{int(e_codes[r, c])}", f"{int(codes[r, c])}", hint)


@absmax_task.test("rows (0.5, -1.27, 0.1, 1) and (2.54, 0, -0.3, 0.66): scales 0.01 and 0.02, codes "
                  "(50, -127, 10, 100) and (127, 0, -15, 33)")
def _(fn: Callable) -> None:
    w = torch.tensor([[0.5, -1.27, 0.1, 1.0], [2.54, 0.0, -0.3, 0.66]])
    _check_absmax(fn, [w], "the example")


@absmax_task.test("one scale per output channel: rows whose sizes differ 1,000-fold each keep their own precision, "
                  "and a row whose largest magnitude is negative maps it to -127")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(601)
    w = torch.randn(6, 40, generator=gen) * torch.tensor([[1e-3], [1e-2], [0.1], [1.0], [0.5], [0.02]])
    w[4, 7] = -3.0  # the largest magnitude of row 4 is negative
    w[5, 0] = -0.2
    _check_absmax(fn, [w, w[:, :8].T.contiguous()], "per channel")


@absmax_task.test("ties round to even, as torch.round: with scale 1, the weights 2.5, 3.5, -0.5, -2.5, 0.5, 1.5 and "
                  "-126.5 give the codes 2, 4, 0, -2, 0, 2 and -126")
def _(fn: Callable) -> None:
    w = torch.tensor([[127.0, 2.5, 3.5, -0.5, -2.5, 0.5, 1.5, -126.5]])
    _check_absmax(fn, [w, 2 * w], "ties", exact_ties=True)


@absmax_task.test("an all-zero row gets codes 0 and a finite scale (no 0 / 0)")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(602)
    w = torch.randn(4, 16, generator=gen)
    w[1] = 0.0
    _check_absmax(fn, [w, torch.zeros(2, 8)], "zero row")


@absmax_task.test("agrees with minillm.quant.quantize_int(w, 8, 'channel') on 20 random matrices (1 to 300 rows, 1 to "
                  "700 columns, outliers; fp32, and bf16 and fp16 inputs, computed in fp32)")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(603)
    rng = random.Random(603)
    cases = []
    for i in range(20):
        rows, cols = rng.choice([1, 3, 64, 300]), rng.choice([1, 5, 128, 700])
        dtype = torch.float32 if i < 14 else rng.choice([torch.bfloat16, torch.float16])
        cases.append(_weights(gen, rows, cols, dtype))
    _check_absmax(fn, cases, "a random matrix")


# ---- 06.int4_pack -----------------------------------------------------------------------------------


def reference_int4_quantize(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group_size` consecutive columns of each row, packed two codes per byte.

    Per group: lo = min(w, 0), hi = max(w, 0), scale s = (hi - lo) / 15 (1 where that is 0), zero point
    z = round(-lo / s), codes q = clamp(round(w / s) + z, 0, 15), so that w ~ (q - z) * s; byte i of a row holds
    code 2i in its low nibble and code 2i + 1 in its high one. Returns (packed uint8 [rows, cols / 2], scale fp32
    [rows, cols / group_size], zero fp32 [rows, cols / group_size]). minillm's
    `quantize_int(w, 4, group_size, symmetric=False)`.
    """
    q = quantize_int(w, 4, group_size, symmetric=False)
    return q.codes, q.scale, q.zero


int4_task = register_task(
    "06.int4_pack",
    "int4_quantize(w: Tensor[rows, cols], group_size: int = 128) -> tuple[Tensor, Tensor, Tensor]  (packed uint8 "
    "[rows, cols / 2], scale fp32 [rows, cols / group_size], zero [rows, cols / group_size])",
    reference=reference_int4_quantize,
    forbid=("minillm.quant.quantize_int", "minillm.quant.int_grid", "minillm.quant.int_round",
            "minillm.quant.int_quantized", "minillm.quant.pack_int4", "minillm.quant.quantize_weight",
            "minillm.quant.IntQuantized"),
)

_INT4_HOW = ("per group of group_size consecutive columns of a row: lo = min(w, 0), hi = max(w, 0), s = (hi - lo) / 15 "
             "(1 where that is 0), z = round(-lo / s), q = clamp(round(w / s) + z, 0, 15); then pack each row's "
             "codes two per byte, q[:, 0::2] | (q[:, 1::2] << 4), as uint8.")


def _pack(q: torch.Tensor, order: str) -> torch.Tensor:
    """Codes q [rows, cols] (integers, maybe out of range) packed two per byte the way a version does it."""
    q = q.to(torch.int64).to(torch.uint8)
    half = q.shape[1] // 2
    if order == "high_even":
        return (q[:, 0::2] << 4) | q[:, 1::2]
    if order == "halves":
        return q[:, :half] | (q[:, half:] << 4)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _int4_codes(w: torch.Tensor, group_size: int = 128, with_zero: bool = True, levels: int = 15, zero: str = "round",
                codes: str = "add", clamp: bool = True,
                symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked codes [rows, cols], scale and zero [rows, n_groups] of the int4 quantiser, with one mistake on."""
    w = w.float()
    rows, cols = w.shape
    g = w.reshape(rows, cols // group_size, group_size)
    if symmetric:
        s = g.abs().amax(-1) / 7
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(g / s[..., None]).clamp(-7, 7) + 8
        return q.reshape(rows, cols), s, torch.full_like(s, 8.0)
    lo, hi = g.amin(-1), g.amax(-1)
    if with_zero:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    s = (hi - lo) / levels
    s = torch.where(s > 0, s, torch.ones_like(s))
    z = {"round": torch.round(-lo / s), "float": -lo / s, "negative": torch.round(lo / s)}[zero]
    if codes == "add":
        q = torch.round(g / s[..., None]) + z[..., None]
    elif codes == "subtract":
        q = torch.round(g / s[..., None]) - z[..., None]
    else:  # "shifted": round((w - lo) / s)
        q = torch.round((g - lo[..., None]) / s[..., None])
    if clamp:
        q = q.clamp(0, 15)
    return q.reshape(rows, cols), s, z


def _int4_variant(pack: str = "low_even", **options: object) -> Callable:
    """reference_int4_quantize with one common mistake switched on."""
    def int4_quantize(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, s, z = _int4_codes(w, group_size, **options)
        return _pack(q, pack), s, z
    return int4_quantize


_NO_CLAMP = ("clamp the codes to 0..15: when the zero point was rounded up, round(w / s) + z reaches 16 for the "
             "largest weight (here it sits exactly on a half step), and 16 does not fit in a nibble: it spills into "
             "the neighbouring code, or out of the byte.")

_INT4_SUSPECTS: list[tuple[Callable, str]] = [
    (_int4_variant(pack="high_even"),
     "the even-indexed code goes in the LOW nibble: byte i = q[2i] | (q[2i + 1] << 4). You put it in the high one "
     "(minillm's unpack_int4 reads the low nibble first)."),
    (_int4_variant(pack="halves"),
     "pack neighbours: byte i of a row holds codes 2i and 2i + 1 (q[:, 0::2] | (q[:, 1::2] << 4)), not codes i and "
     "i + cols / 2."),
    (_int4_variant(clamp=False), _NO_CLAMP),
    (_int4_variant(with_zero=False),
     "the grid must contain 0.0 exactly: take lo = min(min(w), 0) and hi = max(max(w), 0). For a group of "
     "all-positive weights, lo = min(w) > 0 gives a negative zero point, which no code 0..15 can hold (and an "
     "all-negative group a zero point above 15)."),
    (_int4_variant(with_zero=False, clamp=False),
     "the grid must contain 0.0 exactly: lo = min(min(w), 0), hi = max(max(w), 0); and clamp the codes to 0..15."),
    (_int4_variant(levels=16),
     "16 codes are 15 steps apart end to end: s = (hi - lo) / 15 (2^4 - 1), not / 16, or the largest weight "
     "is never reached."),
    (_int4_variant(zero="float"),
     "round the zero point to a whole code: z = round(-lo / s). It is the code that stands for 0.0, so it must be "
     "an integer for 0.0 to be exact ((z - z) * s = 0) and to be stored in 4 bits."),
    (_int4_variant(zero="negative"),
     "z = round(-lo / s), with a minus: lo <= 0, so the zero point is positive (the code of 0.0 lies above the "
     "codes of the negative weights)."),
    (_int4_variant(zero="negative", codes="subtract"),
     "z = round(-lo / s) is positive, and it is ADDED: q = round(w / s) + z, so that w ~ (q - z) * s."),
    (_int4_variant(codes="subtract"),
     "add the zero point: q = round(w / s) + z, so that w ~ (q - z) * s (z is the code of 0.0)."),
    (_int4_variant(codes="shifted"),
     "round w / s first, then add the integer zero point: q = round(w / s) + z. The grid is the multiples of s, "
     "and round((w - lo) / s) can land one step off the nearest of them once z has been rounded."),
    (_int4_variant(symmetric=True),
     "this grid is asymmetric, with a zero point: it spans [min(w, 0), max(w, 0)], s = (hi - lo) / 15, "
     "z = round(-lo / s). A symmetric absmax grid wastes codes when a group's weights lean to one side."),
]


def _same_int4(a: object, b: object) -> bool:
    """`same` for diagnose: (packed, scale, zero) that agree up to rounding ties, compared code by code."""
    try:
        (pa, sa, za), (pb, sb, zb) = a, b
        unpacked = (unpack_int4(pa), sa, za), (unpack_int4(pb), sb, zb)
    except (TypeError, ValueError, RuntimeError):
        return False
    return _same_parts((0.0, 0.0, 1e-4))(*unpacked)


def _check_int4(fn: Callable, cases: list[tuple[torch.Tensor, int | None]], what: str) -> None:
    got = []
    for w, g in cases:
        rows, cols = w.shape
        n_groups = cols // (g or 128)
        call = f"{what}: int4_quantize(w [{rows}, {cols}]" + (f", group_size={g})" if g else ")")
        args = (w.clone(),) if g is None else (w.clone(), g)
        packed, scale, zero = _parts(fn(*args), ("packed", "scale", "zero"), call,
                                     "return (packed, scale, zero): the codes packed two per byte, and each group's "
                                     "scale and zero point.")
        if packed.shape != (rows, cols // 2):
            raise MismatchError(f"{call}: packed", f"shape [{rows}, {cols // 2}], two codes per byte",
                                f"shape {list(packed.shape)}",
                                "pack each row's codes two per byte: q[:, 0::2] | (q[:, 1::2] << 4) has half as many "
                                "columns." if packed.shape == (rows, cols) else
                                "one byte per pair of neighbouring codes of a row: [rows, cols / 2].")
        if packed.dtype != torch.uint8:
            raise MismatchError(f"{call}: packed", "dtype torch.uint8", f"dtype {packed.dtype}",
                                "store the bytes as torch.uint8: a byte holds two codes of 0..15, values 0..255 "
                                "(int8 would read the high nibble's top bit as a sign).")
        for name, t in (("scale", scale), ("zero", zero)):
            if t.shape != (rows, n_groups):
                raise MismatchError(f"{call}: {name}", f"shape [{rows}, {n_groups}], one per group of {g or 128} "
                                    "columns of a row", f"shape {list(t.shape)}",
                                    "a group is group_size consecutive columns of one row (inputs that one output "
                                    "sums over): view w as [rows, cols // group_size, group_size] and reduce the last "
                                    "dimension." + (" group_size defaults to 128." if g is None else ""))
        if scale.dtype != torch.float32:
            raise MismatchError(f"{call}: scale", "dtype torch.float32", f"dtype {scale.dtype}",
                                "compute the scales in fp32 (w.float()).")
        got.append((packed, scale, zero))
    for (packed, scale, zero), (w, g) in zip(got, cases):
        g = g or 128
        e_packed, e_scale, e_zero = reference_int4_quantize(w, g)
        rows, cols = w.shape
        groups = w.float().reshape(rows, cols // g, g)
        zero_group = groups.abs().amax(-1) == 0
        label = f"{what}: int4_quantize(w [{rows}, {cols}], group_size={g})"
        s = scale.double()
        codes = unpack_int4(packed).double()
        if bool(zero_group.any()):  # any positive scale is right there; the codes must equal the zero point
            z_rep = zero.double().repeat_interleave(g, dim=1).reshape(rows, -1, g)
            fine = (torch.isfinite(s) & (s > 0) & (zero >= 0) & (zero <= 15)
                    & (codes.reshape(rows, -1, g) == z_rep).all(-1))
            bad = zero_group & ~fine
            if bool(bad.any()):
                r, k = (int(i) for i in bad.nonzero()[0])
                raise MismatchError(f"{label}: the all-zero group {k} of row {r}",
                                    "a finite, positive scale (minillm uses 1) and every code equal to the zero point "
                                    "(0)", f"scale {float(s[r, k]):.4g}, zero point {float(zero[r, k]):g}, codes "
                                    f"{codes[r, k * g: k * g + 6].long().tolist()}",
                                    "an all-zero group has lo = hi = 0: use a scale of 1 there (torch.where(s > 0, s, "
                                    "1)), or -lo / s and w / s divide 0 by 0 (NaN).")
        z_loose = _near_tie(-groups.amin(-1).clamp(max=0) / e_scale)
        scale_ok = zero_group | torch.isclose(s, e_scale.double(), rtol=1e-5, atol=0)
        zero_ok = zero_group | _codes_agree(zero, e_zero, z_loose)
        e_codes = unpack_int4(e_packed).double()
        v = (groups / e_scale[..., None]).reshape(rows, cols)
        loose = _near_tie(v) | z_loose.repeat_interleave(g, dim=1)
        codes_ok = _codes_agree(codes, e_codes, loose) | zero_group.repeat_interleave(g, dim=1)
        if bool(scale_ok.all()) and bool(zero_ok.all()) and bool(codes_ok.all()):
            continue
        hint = diagnose(*_without_zero_groups(got, cases, lambda c: c[1] or 128),
                        [(lambda w_, g_, f=f: f(w_, g_ or 128), h) for f, h in _INT4_SUSPECTS], _INT4_HOW, _same_int4)
        if not bool(scale_ok.all()):
            r, k = (int(i) for i in (~scale_ok).nonzero()[0])
            part = groups[r, k]
            raise MismatchError(f"{label}: scale of row {r}, group {k} (weights {float(part.min()):.4g} .. "
                                f"{float(part.max()):.4g})", f"{float(e_scale[r, k]):.6g}", f"{float(s[r, k]):.6g}",
                                hint)
        if not bool(zero_ok.all()):
            r, k = (int(i) for i in (~zero_ok).nonzero()[0])
            part = groups[r, k]
            raise MismatchError(f"{label}: zero point of row {r}, group {k} (weights {float(part.min()):.4g} .. "
                                f"{float(part.max()):.4g}, scale {float(e_scale[r, k]):.4g})",
                                f"{float(e_zero[r, k]):g}", f"{float(zero[r, k]):g}", hint)
        r, c = (int(i) for i in (~codes_ok).nonzero()[0])
        nibble = "low" if c % 2 == 0 else "high"
        raise MismatchError(f"{label}: the code of w[{r}, {c}] = {float(w[r, c]):.5g} (byte [{r}, {c // 2}], "
                            f"{nibble} nibble; scale {float(e_scale[r, c // g]):.4g}, zero point "
                            f"{float(e_zero[r, c // g]):g})",
                            f"{int(e_codes[r, c])} (byte 0x{int(e_packed[r, c // 2]):02x})",
                            f"{int(codes[r, c])} (byte 0x{int(packed[r, c // 2]):02x})", hint)


@int4_task.test("one group of 8 (group_size=8): (-0.3, 0, 0.44, 1.2, -0.04, 0.7, 0.3, 0.9) has scale 0.1, zero point "
                "3, codes (0, 3, 7, 15, 3, 10, 6, 12) and bytes (0x30, 0xf7, 0xa3, 0xc6)")
def _(fn: Callable) -> None:
    w = torch.tensor([[-0.3, 0.0, 0.44, 1.2, -0.04, 0.7, 0.3, 0.9]])
    _check_int4(fn, [(w, 8), (torch.cat([w, -2 * w]), 8)], "the example")


@int4_task.test("the grid always holds 0.0: a group of positive weights gets zero point 0, one of negative weights 15, "
                "an all-zero one codes equal to its zero point")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(611)
    w = torch.randn(4, 64, generator=gen)
    w[0, :32] = w[0, :32].abs() + 0.5  # all positive
    w[1, 32:] = -w[1, 32:].abs() - 0.2  # all negative
    with_zeros = torch.randn(3, 64, generator=gen)
    with_zeros[1, :32] = 0.0  # all zero
    _check_int4(fn, [(w, 32), (with_zeros, 32)], "one-sided groups")


@int4_task.test("codes stay in 0..15: a group whose extremes sit on half steps (-0.875, 2.875: scale 0.25, zero point "
                "round(3.5) = 4) rounds 2.875 to 12 + 4 = 16, clamped to 15")
def _(fn: Callable) -> None:
    w = torch.tensor([[-0.875, 2.875, 0.0, 1.0, 0.6, -0.3, 2.0, 0.1]])
    _check_int4(fn, [(w, 8)], "a tie at the top")


@int4_task.test("agrees with minillm.quant.quantize_int(w, 4, group_size, symmetric=False) on 16 random matrices: "
                "group_size 128 (the default), 64, 32 and a whole row; 1 to 300 rows")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(612)
    rng = random.Random(612)
    cases: list[tuple[torch.Tensor, int | None]] = []
    for i in range(16):
        rows = rng.choice([1, 7, 64, 300])
        g = [None, 128, 64, 32][i % 4]
        cols = (g or 128) * rng.choice([1, 2, 3, 6])
        if i == 15:
            g, cols = 256, 256  # one group spans the row
        cases.append((_weights(gen, rows, cols), g))
    _check_int4(fn, cases, "a random matrix")


# ---- 06.nf4_lookup ----------------------------------------------------------------------------------


def reference_nf4_index(x: torch.Tensor) -> torch.Tensor:
    """The index 0..15 of the NF4 value nearest each x in [-1, 1] (ties to the lower one): uint8, x's shape.
    minillm's `nf4_round`."""
    return nf4_round(x)


nf4_task = register_task(
    "06.nf4_lookup",
    "nf4_index(x: Tensor) -> Tensor  (uint8 of x's shape: the index 0..15 of the nearest value of NF4_CODEBOOK)",
    reference=reference_nf4_index,
    forbid=("minillm.quant.nf4_round", "minillm.quant.quantize_nf4", "minillm.quant.NF4Quantized"),
)

_NF4_HOW = ("the NF4 values are NF4_CODEBOOK (16 of them, sorted, not evenly spaced): the index of the nearest is "
            "(x[..., None] - NF4_CODEBOOK).abs().argmin(-1), as uint8.")

_MIDPOINTS = (NF4_CODEBOOK[1:] + NF4_CODEBOOK[:-1]) / 2


def _nf4_variant(kind: str) -> Callable:
    def nf4_index(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if kind == "linear":
            idx = torch.round((x + 1) * 7.5)
        elif kind == "int4":
            idx = torch.round(x * 7) + 8
        elif kind == "ceil":
            idx = torch.bucketize(x, NF4_CODEBOOK)
        elif kind == "floor":
            idx = torch.bucketize(x, NF4_CODEBOOK, right=True) - 1
        elif kind == "no_abs":
            idx = (x[..., None] - NF4_CODEBOOK).argmin(-1)
        else:  # "rescaled": divided by its own absmax again
            idx = torch.bucketize(x / x.abs().max(), _MIDPOINTS)
        return idx.clamp(0, 15).to(torch.uint8)
    return nf4_index


_NF4_SUSPECTS: list[tuple[Callable, str]] = [
    (_nf4_variant("linear"),
     "NF4's 16 values are not evenly spaced: they are quantiles of a normal distribution, dense near 0 and sparse "
     "near +-1. Compare x with the values of NF4_CODEBOOK and take the nearest, instead of rounding onto a linear "
     "grid."),
    (_nf4_variant("int4"),
     "NF4 is not the int4 grid round(7x) + 8: its 16 values are NF4_CODEBOOK, quantiles of a normal distribution. "
     "Take the index of the nearest of them."),
    (_nf4_variant("ceil"),
     "the NEAREST value, not the next one up: bucketize against the codebook itself gives the first value >= x. "
     "Compare with the midpoints between neighbouring values, or take argmin |x - NF4_CODEBOOK|."),
    (_nf4_variant("floor"),
     "the NEAREST value, not the one below: take argmin |x - NF4_CODEBOOK|, or bucketize against the midpoints "
     "between neighbouring values."),
    (_nf4_variant("no_abs"),
     "the nearest value minimises the DISTANCE |x - code|: argmin of x - code without abs() always picks the "
     "largest code."),
    (_nf4_variant("rescaled"),
     "x is already scaled into [-1, 1] (divided by its block's absmax before this step): look it up as it is, "
     "without dividing by its largest magnitude again."),
]


def _check_nf4(fn: Callable, cases: list[torch.Tensor], what: str) -> None:
    got = []
    for x in cases:
        call = f"{what}: nf4_index(x {list(x.shape)} {x.dtype})"
        g = fn(x.clone())
        if not isinstance(g, torch.Tensor):
            raise MismatchError(call, f"a uint8 tensor of shape {list(x.shape)}", describe(g),
                                "return a tensor of indices, one per element of x.")
        if g.shape != x.shape:
            raise MismatchError(call, f"shape {list(x.shape)}", f"shape {list(g.shape)}",
                                "one index per element of x, in x's shape: compare x[..., None] with the 16 values "
                                "and reduce the last dimension.")
        if g.dtype.is_floating_point:
            raise MismatchError(call, "indices 0..15 as torch.uint8", f"dtype {g.dtype}",
                                "return the INDEX of the nearest NF4 value (0..15, what is stored in 4 bits), not the "
                                "value itself: argmin gives it.")
        if g.dtype != torch.uint8:
            raise MismatchError(call, "dtype torch.uint8", f"dtype {g.dtype}",
                                "indices are stored in 4 bits: return them as .to(torch.uint8), ready for packing.")
        got.append(g)
    for g, x in zip(got, cases):
        e = reference_nf4_index(x)
        xf = x.float()
        loose = ((xf[..., None] - _MIDPOINTS).abs() < 1e-6).any(-1)  # on a midpoint: either neighbour
        ok = _codes_agree(g, e, loose)
        if bool(ok.all()):
            continue
        i = tuple(int(t) for t in (~ok).nonzero()[0])
        hint = diagnose(got, [(c,) for c in cases], _NF4_SUSPECTS, _NF4_HOW, lambda a, b: _mostly_equal(a, b))
        e_i, g_i = int(e[i]), int(g[i])
        shown = f"{g_i} (NF4 value {float(NF4_CODEBOOK[g_i]):.4f})" if 0 <= g_i < 16 else f"{g_i}"
        raise MismatchError(f"{what}: nf4_index(x)[{', '.join(map(str, i))}] for x = {float(xf[i]):.5f}",
                            f"{e_i} (NF4 value {float(NF4_CODEBOOK[e_i]):.4f})", shown, hint)


@nf4_task.test("each of the 16 NF4 values maps to its own index: -1 -> 0, 0 -> 7, 1 -> 15")
def _(fn: Callable) -> None:
    _check_nf4(fn, [NF4_CODEBOOK.clone(), torch.tensor([-1.0, 0.0, 1.0])], "the code values")


@nf4_task.test("just below and just above each midpoint between neighbouring values: the nearer value wins (30 "
               "values, 1e-4 from the midpoints)")
def _(fn: Callable) -> None:
    x = torch.stack([_MIDPOINTS - 1e-4, _MIDPOINTS + 1e-4], dim=-1).flatten()
    _check_nf4(fn, [x], "near the midpoints")


@nf4_task.test("values that use only part of [-1, 1] (|x| <= 0.3) are looked up as they are, not rescaled")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(621)
    _check_nf4(fn, [0.6 * torch.rand(200, generator=gen) - 0.3], "|x| <= 0.3")


@nf4_task.test("agrees with minillm.quant.nf4_round on blocks of 64 normal weights scaled by their absmax (QLoRA's "
               "blocks): shapes [4096], [64, 64] and [2, 3, 64]; fp32, bf16 and fp64")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(622)
    cases = []
    for shape, dtype in (((4096,), torch.float32), ((64, 64), torch.bfloat16), ((2, 3, 64), torch.float64)):
        w = torch.randn(*shape, generator=gen).reshape(-1, 64)
        cases.append((w / w.abs().amax(-1, keepdim=True)).reshape(shape).to(dtype))
    _check_nf4(fn, cases, "normal blocks")


# ---- 06.gptq_column ---------------------------------------------------------------------------------


def reference_gptq_column(W: torch.Tensor, U: torch.Tensor, j: int, scale: torch.Tensor, zero: torch.Tensor | None,
                          bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One GPTQ step (minillm's `gptq.quantize_column`): round column j of W [out, n] on its grid (scale, zero [out];
    zero None: symmetric), then push the error err = (w_j - dequantised) / U[j, j] onto the columns after j:
    W[:, j+1:] -= err[:, None] * U[j, j+1:] (in place). Returns (codes [out], err [out])."""
    return quantize_column(W, U, j, scale, zero, bits)


gptq_task = register_task(
    "06.gptq_column",
    "gptq_column(W: Tensor[out, n], U: Tensor[n, n], j: int, scale: Tensor[out], zero: Tensor[out] | None, "
    "bits: int) -> tuple[Tensor, Tensor]  (codes [out], scaled error [out]; W[:, j+1:] updated in place)",
    reference=reference_gptq_column,
    forbid=("minillm.quant.gptq.quantize_column", "minillm.quant.gptq.gptq_quantize",
            "minillm.quant.gptq.gptq_quantize_model"),
)

_GPTQ_HOW = ("q = clamp(round(W[:, j] / scale) (+ zero), grid); dequantised = (q - zero) * scale (q * scale without a "
             "zero point); err = (W[:, j] - dequantised) / U[j, j]; W[:, j+1:] -= err[:, None] * U[j, j+1:][None, :]; "
             "return q, err.")


def _column_variant(divide: str = "by", sign: float = -1.0, start: str = "after", use_row: bool = True,
                    dequant: str = "q-z", err: str = "scaled", clamp: str = "grid", in_place: bool = True) -> Callable:
    """reference_gptq_column with one common mistake switched on."""
    def gptq_column(W: torch.Tensor, U: torch.Tensor, j: int, scale: torch.Tensor, zero: torch.Tensor | None,
                    bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = W[:, j].clone()
        z = 0.0 if zero is None else zero
        q = torch.round(w / scale) + z
        if zero is None:
            qmax = 2 ** (bits - 1) - 1
            low = -qmax - 1 if clamp == "pow2" else -qmax
        else:
            low, qmax = 0, 2**bits - 1
        if clamp != "none":
            q = q.clamp(low, qmax)
        deq = {"q-z": (q - z) * scale, "q+z": (q + z) * scale, "q": q * scale, "codes": q}[dequant]
        e = w - deq
        scaled = {"by": e / U[j, j], "none": e, "times": e * U[j, j]}[divide]
        first = j + 1 if start == "after" else j
        row = U[j, first:] if use_row else U[first:, j]
        target = W if in_place else W.clone()
        target[:, first:] += sign * scaled[:, None] * row[None, :]
        return q, (scaled if err == "scaled" else e)
    return gptq_column


_GPTQ_SUSPECTS: list[tuple[Callable, str]] = [
    (_column_variant(in_place=False),
     "update W in place (W[:, j+1:] -= ...): GPTQ's loop reads the later columns back from W, so a correction "
     "made to a copy is lost. (W = W - ... or W.clone() makes a new tensor.)"),
    (_column_variant(divide="none"),
     "divide the error by U[j, j]: err = (W[:, j] - dequantised) / U[j, j]. The least-squares correction of the "
     "later columns is err * U[j, j+1:]; without the division it is U[j, j] times too small."),
    (_column_variant(divide="none", err="raw"),
     "divide the error by U[j, j]: err = (W[:, j] - dequantised) / U[j, j], then W[:, j+1:] -= err[:, None] * "
     "U[j, j+1:]."),
    (_column_variant(divide="times"),
     "DIVIDE the error by U[j, j] (err = (w - dequantised) / U[j, j]), do not multiply it."),
    (_column_variant(err="raw"),
     "return the SCALED error, (W[:, j] - dequantised) / U[j, j]: the number each U[j, j+1:] was multiplied by. "
     "gptq_quantize collects them to correct the later blocks in one matrix multiply (E @ U[block, later])."),
    (_column_variant(sign=1.0),
     "SUBTRACT the correction: W[:, j+1:] -= err[:, None] * U[j, j+1:]. Adding it pushes the later columns the "
     "wrong way, doubling the output error instead of cancelling it."),
    (_column_variant(start="from_j"),
     "leave column j as it was: it is rounded (its codes are q), and the correction goes to the columns not yet "
     "rounded, W[:, j+1:]. W[:, j:] -= ... also overwrites column j."),
    (_column_variant(use_row=False),
     "use ROW j of U, U[j, j+1:]: U is upper triangular, so its column below the diagonal, U[j+1:, j], is all "
     "zeros and nothing moves."),
    (_column_variant(use_row=False, start="from_j"),
     "use ROW j of U from j + 1 on, U[j, j+1:] (U is upper triangular: its column below the diagonal is zeros), "
     "and leave column j itself alone."),
    (_column_variant(dequant="q+z"),
     "the rounded weight is (q - zero) * scale: SUBTRACT the zero point (the code that stands for 0.0)."),
    (_column_variant(dequant="q"),
     "subtract the zero point before scaling: the rounded weight is (q - zero) * scale, so the error is "
     "W[:, j] - (q - zero) * scale."),
    (_column_variant(dequant="codes"),
     "the error is in weights, not codes: W[:, j] minus the DEQUANTISED value (q - zero) * scale (q * scale "
     "without a zero point)."),
    (_column_variant(clamp="none"),
     "clamp the codes to the grid: -(2^(b-1) - 1)..2^(b-1) - 1 without a zero point, 0..2^b - 1 with one. After "
     "the corrections from earlier columns a weight can lie beyond the grid fitted to its group; its code must "
     "still fit in b bits."),
    (_column_variant(clamp="pow2"),
     "the symmetric grid is -(2^(b-1) - 1)..2^(b-1) - 1 (-7..7 for 4 bits), as the absmax scale assumes: clamp at "
     "-qmax, not -2^(b-1)."),
]


def _recorded_columns(suspects: list[tuple[Callable, str]]) -> list[tuple[Callable, str]]:
    """The wrong versions run through `run_column` on copies, as the reader's is: each gives (result, W after)."""
    def wrap(wrong: Callable) -> Callable:
        return lambda W, U, j, scale, zero, bits: run_column(wrong, W.clone(), U.clone(), j, scale.clone(),
                                                             None if zero is None else zero.clone(), bits)
    return [(wrap(wrong), hint) for wrong, hint in suspects]


def _same_column(a: object, b: object) -> bool:
    try:
        (ga, Wa), (gb, Wb) = a, b
        qa, ea = ga
        qb, eb = gb
    except (TypeError, ValueError):
        return False
    tensors = (qa, ea, qb, eb, Wa, Wb)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or qa.numel() != qb.numel() or ea.numel() != eb.numel():
        return False
    return (torch.equal(qa.double().reshape(-1), qb.double().reshape(-1))
            and torch.allclose(ea.double().reshape(-1), eb.double().reshape(-1), rtol=1e-6, atol=1e-9)
            and Wa.shape == Wb.shape and torch.allclose(Wa.double(), Wb.double(), rtol=1e-6, atol=1e-9))


def _correlated_inputs(gen: torch.Generator, n_samples: int, n: int) -> torch.Tensor:
    """Inputs [n_samples, n] whose channels are correlated and of sizes spread over two decades, as a layer's are."""
    mix = torch.eye(n, dtype=torch.float64) + 0.6 * torch.randn(n, n, generator=gen, dtype=torch.float64) / n**0.5
    sizes = 10 ** (-1 + 2 * torch.rand(n, generator=gen, dtype=torch.float64))
    return (torch.randn(n_samples, n, generator=gen, dtype=torch.float64) @ mix) * sizes


def _column_case(gen: torch.Generator, out: int, n: int, j: int, bits: int, symmetric: bool) -> tuple:
    """(W [out, n], U [n, n], j, scale, zero, bits) in fp64, as gptq_quantize hands them over. Each row's grid is
    fitted to 0.85 times the row, so that its largest weights lie beyond it (they must be clamped), as weights
    corrected by earlier columns can; column j has no value on a half step."""
    U = inverse_hessian_factor(hessian(_correlated_inputs(gen, 4 * n, n)))
    while True:
        W = torch.randn(out, n, generator=gen, dtype=torch.float64) * 0.05
        s, z = int_grid(0.85 * W, bits, symmetric)
        scale = s.double()
        zero = None if z is None else z.double()
        if not bool(_near_tie(W[:, j].float() / scale).any()):
            return W, U, j, scale, zero, bits


def _check_columns(fn: Callable, cases: list[tuple], what: str) -> None:
    records = []
    for W, U, j, scale, zero, bits in cases:
        out, n = W.shape
        call = (f"{what}: gptq_column(W [{out}, {n}], U, j={j}, scale, zero={'None' if zero is None else '[…]'}, "
                f"bits={bits})")
        got, W_after = call_probed(fn, run_column, W.clone(), U.clone(), j, scale.clone(),
                                   None if zero is None else zero.clone(), bits)
        q, err = _parts(got, ("codes", "err"), call, "return (q, err): column j's codes and its scaled error "
                        "(W[:, j] - dequantised) / U[j, j]; W itself is updated in place, not returned.")
        for name, t in (("codes", q), ("err", err)):
            if t.numel() != out:
                raise MismatchError(f"{call}: {name}", f"{out} values, one per row of W", f"shape {list(t.shape)}",
                                    "work on column j, W[:, j] (one value per output row).")
        records.append(((q, err), W_after))
    for ((q, err), W_after), case in zip(records, cases):
        W, U, j, scale, zero, bits = case
        W_ref = W.clone()
        e_q, e_err = reference_gptq_column(W_ref, U, j, scale, zero, bits)
        if _same_column(((q, err), W_after), ((e_q, e_err), W_ref)):
            continue
        hint = diagnose(records, cases, _recorded_columns(_GPTQ_SUSPECTS), _GPTQ_HOW, _same_column)
        out, n = W.shape
        grid = "symmetric" if zero is None else "zero point"
        label = f"{what}: gptq_column(W [{out}, {n}], U, j={j}, {bits} bits, {grid})"
        qd, ed = q.double().reshape(-1), err.double().reshape(-1)
        bad = (qd != e_q.double()).nonzero()
        if len(bad):
            r = int(bad[0])
            shown_zero = "" if zero is None else f", zero {float(zero[r]):g}"
            raise MismatchError(f"{label}: code of W[{r}, {j}] = {float(W[r, j]):.5g} (scale {float(scale[r]):.4g}"
                                f"{shown_zero})", f"{float(e_q[r]):g}", f"{float(qd[r]):g}", hint)
        bad = (~torch.isclose(ed, e_err.double(), rtol=1e-6, atol=1e-9)).nonzero()
        if len(bad):
            r = int(bad[0])
            raise MismatchError(f"{label}: err[{r}] (U[j, j] = {float(U[j, j]):.4g})", f"{float(e_err[r]):.6g}",
                                f"{float(ed[r]):.6g}", hint)
        if W_after.shape != W.shape:
            raise MismatchError(f"{label}: W after the call", f"shape {list(W.shape)}", f"shape {list(W_after.shape)}",
                                hint)
        kept = torch.equal(W_after[:, : j + 1].double(), W[:, : j + 1])
        if not kept:
            c = int((W_after[:, : j + 1].double() != W[:, : j + 1]).any(0).nonzero()[0])
            raise MismatchError(f"{label}: W[:, {c}] after the call (column {c} <= j)", "unchanged",
                                "changed", hint)
        diff = ~torch.isclose(W_after.double(), W_ref, rtol=1e-6, atol=1e-9)
        r, c = (int(i) for i in diff.nonzero()[0])
        untouched = torch.equal(W_after.double(), W)
        raise MismatchError(f"{label}: W[{r}, {c}] after the call (was {float(W[r, c]):.6g})",
                            f"{float(W_ref[r, c]):.6g}", f"{float(W_after[r, c]):.6g}"
                            + (" (W was not changed at all)" if untouched else ""), hint)


@gptq_task.test("W = [[0.33, 1, 2], [-0.52, 0, 1]], U row 0 = (2, 0.5, -1), scale 0.1, 4 bits symmetric, j = 0: codes "
                "(3, -5), err (0.015, -0.01), columns 1 and 2 become (0.9925, 2.015) and (0.005, 0.99)")
def _(fn: Callable) -> None:
    W = torch.tensor([[0.33, 1.0, 2.0], [-0.52, 0.0, 1.0]], dtype=torch.float64)
    U = torch.tensor([[2.0, 0.5, -1.0], [0.0, 1.0, 0.25], [0.0, 0.0, 0.5]], dtype=torch.float64)
    scale = torch.tensor([0.1, 0.1], dtype=torch.float64)
    _check_columns(fn, [(W, U, 0, scale, None, 4)], "the example")


@gptq_task.test("agrees with minillm.quant.gptq.quantize_column on 24 random steps: 2, 3, 4 and 8 bits, symmetric "
                "and with zero points, j first, in the middle and last; some weights beyond the grid are clamped")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(631)
    rng = random.Random(631)
    cases = []
    for i in range(24):
        n = rng.choice([8, 16, 48])
        j = [0, n // 2, n - 1, rng.randrange(n)][i % 4]
        cases.append(_column_case(gen, rng.choice([4, 32]), n, j, [2, 3, 4, 8][i % 4 if i < 8 else rng.randrange(4)],
                                  symmetric=i % 2 == 0))
    _check_columns(fn, cases, "a random step")


@gptq_task.test("W is changed in place, and only in the columns after j: columns 0..j keep their values")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(632)
    cases = [_column_case(gen, 16, 12, j, 4, symmetric) for j, symmetric in ((5, False), (0, True), (10, False))]
    _check_columns(fn, cases, "in place")


def _output_error(W_q: torch.Tensor, W: torch.Tensor, H: torch.Tensor) -> float:
    """Mean squared error of the layer's outputs, ||x W_q^T - x W^T||^2 averaged over its inputs: tr(D H D^T) / 2."""
    D = (W_q.double() - W.double())
    return float(((D @ H) * D).sum() / 2)


@functools.cache
def _loop_layer() -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The loop test's layer: W [64, 256], H, and the output errors of round-to-nearest and of minillm's GPTQ."""
    gen = torch.Generator().manual_seed(633)
    n = 256
    H = hessian(_correlated_inputs(gen, 4 * n, n))
    W = torch.randn(64, n, generator=gen, dtype=torch.float64) * 0.05
    rtn = _output_error(quantize_int(W.float(), 4, 64, symmetric=False).dequantize(torch.float64), W, H)
    ref = _output_error(gptq_quantize(W, H, 4, 64, symmetric=False).dequantize(torch.float64), W, H)
    mine = _output_error(gptq_with(reference_gptq_column, W, H, 4, 64)["dequantized"], W, H)
    if not math.isclose(mine, ref, rel_tol=1e-3):  # the grader's own consistency check
        raise RuntimeError(f"the probe's GPTQ loop ({mine:.6g}) disagrees with "
                           f"minillm.quant.gptq.gptq_quantize ({ref:.6g})")
    return W, H, rtn, ref


@gptq_task.test("your step as GPTQ's inner loop on a 64 x 256 layer with correlated inputs (4 bits, groups of 64): "
                "the layer's output error matches minillm.quant.gptq.gptq_quantize's, far below round-to-nearest's")
def _(fn: Callable) -> None:
    W, H, rtn, ref = _loop_layer()
    out = call_probed(fn, gptq_with, W.clone(), H.clone(), 4, 64)
    what = "GPTQ with your gptq_column on a 64 x 256 layer: the output error (mean squared, over the inputs)"
    if out["bad"] is not None:
        raise MismatchError(what, "a loop that runs (gptq_column returning (codes [64], err [64]))", out["bad"],
                            "return (q, err): column j's codes and its scaled error.")
    mine = _output_error(out["dequantized"], W, H)
    if mine <= ref * 1.01:
        return
    gen = torch.Generator().manual_seed(634)
    cases = [_column_case(gen, 16, 12, j, 4, j % 2 == 0) for j in (0, 3, 6, 11)]
    records = [call_probed(fn, run_column, W_.clone(), U.clone(), j, s.clone(), None if z is None else z.clone(), b)
               for W_, U, j, s, z, b in cases]
    hint = diagnose(records, cases, _recorded_columns(_GPTQ_SUSPECTS), "", _same_column) or (
        f"the loop is right only if each step is: {_GPTQ_HOW}")
    raise MismatchError(what, f"at most {ref * 1.01:.4g} (minillm's GPTQ: {ref:.4g}; round-to-nearest: {rtn:.4g})",
                        f"{mine:.4g} ({mine / rtn:.0%} of round-to-nearest's)", hint)


# ---- 06.quantized_ppl -------------------------------------------------------------------------------

PPL_WINDOWS = 16  # of 256 tokens, from the start of the shipped validation sample
PPL_RTOL = 2e-4  # the same quantiser up to rounding ties agrees far closer; any other int4 recipe tried is further


def reference_rtn_int4(w: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """w [rows, cols] through asymmetric int4 per group of `group_size` and back, (q - z) * s, fp32: round-to-nearest
    int4 as minillm's `quantize(model, "rtn", bits=4)` stores each block linear (its QuantLinear computes with this
    same dequantised weight on a CPU)."""
    return quantize_int(w, 4, group_size, symmetric=False).dequantize(torch.float32)


ppl_task = register_task(
    "06.quantized_ppl",
    "rtn_int4(w: Tensor[rows, cols], group_size: int = 128) -> Tensor[rows, cols]  (w quantised to asymmetric int4 "
    "per group, then dequantised: (q - z) * s, fp32)",
    reference=reference_rtn_int4,
    forbid=("minillm.quant.quantize_int", "minillm.quant.quantize", "minillm.quant.quantize_weight",
            "minillm.quant.IntQuantized", "minillm.quant.QuantLinear", "minillm.quant.int_grid",
            "minillm.quant.int_round", "minillm.quant.unpack_int4", "minillm.quant.gptq.gptq_quantize"),
)

_RTN_HOW = ("quantise w with your int4_quantize (task 2), unpack the bytes (low nibble = even column), then "
            "(q - z) * s with each group's scale and zero point repeated over its group_size columns "
            "(repeat_interleave(group_size, dim=1)).")


def _rtn_variant(expand: str = "interleave", dequant: str = "q-z", unpack: str = "low_even", per_row: bool = False,
                 **int4_options: object) -> Callable:
    """reference_rtn_int4 with one common mistake switched on."""
    def rtn_int4(w: torch.Tensor, group_size: int = 128) -> torch.Tensor:
        group_size = w.shape[1] if per_row else group_size
        q, s, z = _int4_codes(w, group_size, **int4_options)
        if unpack == "swapped":
            q = q.reshape(q.shape[0], -1, 2).flip(-1).reshape(q.shape)
        if expand == "tile":
            S, Z = s.repeat(1, group_size), z.repeat(1, group_size)
        else:
            S, Z = s.repeat_interleave(group_size, dim=1), z.repeat_interleave(group_size, dim=1)
        return {"q-z": (q - Z) * S, "q+z": (q + Z) * S, "q": q * S}[dequant]
    return rtn_int4


_RTN_SUSPECTS: list[tuple[Callable, str]] = [
    (lambda w, group_size=128: w.float().clone(),
     "round each weight to its group's grid: the round trip returns (q - z) * s, at most 16 distinct values per "
     "group, not w itself."),
    (_rtn_variant(per_row=True),
     "one scale and zero point per GROUP of group_size consecutive columns (128 by default), not one per row: "
     "small groups follow the weights' local range."),
    (_rtn_variant(expand="tile"),
     "each group's scale and zero point cover group_size CONSECUTIVE columns: expand them with "
     "repeat_interleave(group_size, dim=1) (or view the codes as [rows, n_groups, group_size] and broadcast). "
     ".repeat(1, group_size) tiles them, so column c gets group c % n_groups's scale instead of c // group_size's."),
    (_rtn_variant(dequant="q+z"),
     "dequantise with (q - z) * s: the zero point z is the code that stands for 0.0, so SUBTRACT it."),
    (_rtn_variant(dequant="q"),
     "subtract the zero point before scaling: w ~ (q - z) * s. q * s alone shifts every weight of the group by "
     "z * s."),
    (_rtn_variant(unpack="swapped"),
     "unpack in the order the codes were packed: the low nibble (byte & 0x0F) is the even column, the high nibble "
     "(byte >> 4) the odd one."),
    (_rtn_variant(with_zero=False),
     "the grid must contain 0.0: lo = min(min(w), 0), hi = max(max(w), 0) (see task 2)."),
    (_rtn_variant(levels=16), "16 codes are 15 steps: s = (hi - lo) / 15 (see task 2)."),
    (_rtn_variant(codes="shifted"),
     "round w / s first, then add the integer zero point: q = round(w / s) + z (see task 2)."),
    (_rtn_variant(symmetric=True),
     "this is the asymmetric grid of task 2, with a zero point: s = (hi - lo) / 15, z = round(-lo / s)."),
    (_rtn_variant(clamp=False), _NO_CLAMP),
]


def _check_rtn(fn: Callable, cases: list[tuple[torch.Tensor, int | None]], what: str) -> None:
    got = []
    for w, g in cases:
        rows, cols = w.shape
        call = f"{what}: rtn_int4(w [{rows}, {cols}]" + (f", group_size={g})" if g else ")")
        out = fn(*((w.clone(),) if g is None else (w.clone(), g)))
        if not isinstance(out, torch.Tensor):
            raise MismatchError(call, f"a tensor [{rows}, {cols}], w after the round trip", describe(out),
                                "return the dequantised weight (q - z) * s, one value per weight (not the codes, "
                                "scales and zero points).")
        if out.shape != w.shape:
            raise MismatchError(call, f"shape {list(w.shape)}", f"shape {list(out.shape)}",
                                "unpack both nibbles of every byte (two codes per byte) and return w's shape.")
        if out.dtype != torch.float32:
            raise MismatchError(call, "dtype torch.float32", f"dtype {out.dtype}",
                                "return (q - z) * s in fp32: the codes are integers, the weights they stand for are "
                                "not.")
        got.append(out)
    for out, (w, g) in zip(got, cases):
        g = g or 128
        e = reference_rtn_int4(w, g)
        rows, cols = w.shape
        q = quantize_int(w, 4, g, symmetric=False)
        step = q.scale.repeat_interleave(g, dim=1).double()
        groups = w.float().reshape(rows, cols // g, g)
        loose = (_near_tie(groups / q.scale[..., None]).reshape(rows, cols)
                 | _near_tie(-groups.amin(-1).clamp(max=0) / q.scale).repeat_interleave(g, dim=1))
        diff = (out.double() - e.double()).abs()
        ok = (diff <= 1e-4 * step) | (loose & (diff <= step * (1 + 1e-4)))
        if bool(ok.all()):
            continue
        r, c = (int(i) for i in (~ok).nonzero()[0])
        hint = diagnose(got, cases, [(lambda w_, g_, f=f: f(w_, g_ or 128), h) for f, h in _RTN_SUSPECTS], _RTN_HOW,
                        lambda a, b: _mostly_equal(a, b, atol=1e-6, rtol=1e-4))
        raise MismatchError(f"{what}: rtn_int4(w [{rows}, {cols}], group_size={g})[{r}, {c}] for w = "
                            f"{float(w[r, c]):.5g} (scale {float(q.scale[r, c // g]):.4g}, zero point "
                            f"{float(q.zero[r, c // g]):g})", f"{float(e[r, c]):.6g}", f"{float(out[r, c]):.6g}", hint)


@ppl_task.test("task 2's example group comes back as (-0.3, 0, 0.4, 1.2, 0, 0.7, 0.3, 0.9); two groups of very "
               "different sizes each keep their own scale")
def _(fn: Callable) -> None:
    w = torch.tensor([[-0.3, 0.0, 0.44, 1.2, -0.04, 0.7, 0.3, 0.9]])
    _check_rtn(fn, [(w, 8), (torch.cat([w, 20 * w.flip(1)], dim=1).repeat(3, 1), 8)], "the example")


@ppl_task.test("agrees with minillm.quant.quantize_int(w, 4, group_size, symmetric=False).dequantize() on 12 random "
               "matrices: group_size 128 (the default), 64 and 32")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(641)
    rng = random.Random(641)
    cases: list[tuple[torch.Tensor, int | None]] = []
    for i in range(12):
        g = [None, 64, 32][i % 3]
        cases.append((_weights(gen, rng.choice([1, 16, 200]), (g or 128) * rng.choice([1, 2, 3, 5])), g))
    _check_rtn(fn, cases, "a random matrix")


@functools.cache
def _shipped() -> tuple[torch.nn.Module, torch.Tensor]:
    """The shipped model (fp32, CPU) and the shipped validation sample's token ids, loaded once."""
    import minillm
    from minillm.quant.calibration import validation_ids

    model, tokenizer = minillm.load(minillm.DEFAULT_MODEL)
    return model, validation_ids(tokenizer)


def _perplexity_with(weight_fn: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """Validation perplexity (PPL_WINDOWS windows of 256) of the shipped model with each block linear's weight
    replaced by weight_fn(weight)."""
    from minillm.eval import perplexity
    from minillm.quant import block_linears

    model, ids = _shipped()
    model = copy.deepcopy(model)
    for linear in block_linears(model).values():
        linear.weight.data = weight_fn(linear.weight.data)
    return perplexity(model, ids, max_windows=PPL_WINDOWS)


@functools.cache
def _reference_perplexity(quantized: bool = True) -> float:
    """The shipped model's validation perplexity with minillm's round-to-nearest int4 (or, quantized=False, fp32)."""
    return _perplexity_with(reference_rtn_int4 if quantized else lambda w: w)


@ppl_task.test("the shipped model's layers.0 attention (qkv_proj, 576 x 384) and MLP (down_proj, 384 x 1024) weights "
               "come back as minillm's")
def _(fn: Callable) -> None:
    from minillm.quant import block_linears

    model, _ = _shipped()
    linears = block_linears(model)
    cases = [(linears[name].weight.data.clone(), None)
             for name in ("layers.0.self_attn.qkv_proj", "layers.0.mlp.down_proj")]
    _check_rtn(fn, cases, "a shipped weight")


@ppl_task.test("the shipped model with all its block linears through your rtn_int4: validation perplexity (16 windows "
               "of 256 tokens) within 0.02% of minillm's quantize(model, 'rtn', bits=4)")
def _(fn: Callable) -> None:
    problems: list[MismatchError] = []

    def through_answer(w: torch.Tensor) -> torch.Tensor:
        out = fn(w.clone())
        if not isinstance(out, torch.Tensor) or out.shape != w.shape or not out.dtype.is_floating_point:
            problems.append(MismatchError(f"rtn_int4(w [{w.shape[0]}, {w.shape[1]}]) on a block linear",
                                          f"a float tensor of shape {list(w.shape)}", describe(out),
                                          "return the dequantised weight (q - z) * s in w's shape, fp32."))
            return w
        return out.float()

    got = _perplexity_with(through_answer)
    if problems:
        raise problems[0]
    expected = _reference_perplexity()
    what = "validation perplexity of the shipped model with your int4 weights (16 windows of 256 tokens)"
    if not math.isfinite(got):
        raise MismatchError(what, f"{expected:.3f}", f"{got}", "a weight came back NaN or inf: guard the all-zero "
                            "group (scale 1 where hi = lo = 0).")
    if abs(got - expected) <= PPL_RTOL * expected:
        return
    fp32 = _reference_perplexity(quantized=False)
    if abs(got - fp32) <= PPL_RTOL * fp32:
        hint = ("your weights are (nearly) the unquantised ones: each must be rounded to its group's grid, "
                "(q - z) * s with q = clamp(round(w / s) + z, 0, 15).")
    else:
        gen = torch.Generator().manual_seed(642)
        cases: list[tuple[torch.Tensor, int | None]] = [(_weights(gen, 8, 128 * k), None) for k in (1, 3)]
        outs = [fn(w.clone()) for w, _ in cases]
        hint = diagnose(outs, cases, [(lambda w_, g_, f=f: f(w_, g_ or 128), h) for f, h in _RTN_SUSPECTS],
                        _RTN_HOW, lambda a, b: _mostly_equal(a, b, atol=1e-6, rtol=1e-4))
    raise MismatchError(what, f"{expected:.3f} +- {PPL_RTOL * expected:.3f} (minillm's int4; fp32: {fp32:.3f})",
                        f"{got:.3f}", hint)
