"""W4A16: a matrix multiply that reads 4-bit weights and dequantises them in registers (chapter 06).

Why it speeds up decode. At batch 1 every weight byte is read once per token and used for one
multiply-add: the step is bound by memory bandwidth, so reading 0.5 bytes per weight (+ the group's
scale and zero) instead of 2 makes it up to ~3.8x faster. The dequantisation costs arithmetic,
which a memory-bound kernel has to spare -- if it spends little of it. At large batch the same weight
serves many rows, the matmul is compute-bound, and fewer weight bytes buy little.

Why a naive int4 path is no faster: dequantising the whole matrix to bf16 in one kernel and then
calling the bf16 matmul reads 0.5 bytes, writes 2 and reads 2 again per weight: more traffic than
bf16 alone. The point of a fused kernel is that the 16-bit weights never touch memory.

The kernels' layout (`W4A16Weight`, built once from a `minillm.quant.formats.IntQuantized` by `w4a16_pack`).
Every fast int4 kernel repacks its weights into a layout made for its loads; this is ours:
  words [N, K/8] int32: the G/8 words of group g (G inputs, 128 by default) hold its G codes so that
    nibble c of word p is input g*G + c*G/8 + p (with G = 128: c*16 + p). A thread that holds 4
    consecutive words therefore needs, for each nibble c, 4 consecutive inputs: one small vector load
    instead of 4 scattered ones.
  scale_zero [N, K/G] int32: the group's scale and zero as two fp16 halves (low: scale, high: zero),
    one 4-byte load per group. fp16 is what GPTQ and AWQ checkpoints store; the scale is rounded to
    it (a relative change under 5e-4, far below the 4-bit rounding itself).
  That is 4.25 bits per weight: 0.53 bytes.

Two kernels:
  GEMV (decode, few rows): one program per (row of x, BLOCK_N outputs, K split). The 32 lanes of each
    warp and all the warps spread along K, each thread holding 4 consecutive words of every one of its
    BLOCK_N rows, so one input value serves BLOCK_N weights and every weight load is 16 bytes wide.
    Dequantising and the multiply-add cost 2.5 instructions per weight (see `_nibble`); with addresses,
    inputs and scales the compiled loop runs 3.7-4.2. The group's scale and zero are applied once per
    word, not per weight. With split K, several programs share a row's K and add their parts into an
    fp32 output (atomic adds).
  GEMM (prefill, many rows): tiles of BLOCK_M x BLOCK_N, one group of K per step: the [G/8, BLOCK_N]
    tile of words is unpacked into the [G, BLOCK_N] weight tile (nibble c of word p is row c*G/8 + p,
    the input order), dequantised and fed to one tl.dot in the activations' dtype.

`w4a16_reference` is the definition (dequantise, then matmul). Under Triton's CPU interpreter
(TRITON_INTERPRET=1) use fp32 or fp16 activations: its bf16 tl.dot is not exact.
"""

# ruff: noqa: N803, N806 - Triton kernels name compile-time constants and pointers in capitals (BLOCK_N, X)

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4  # up to this many rows (tokens) the GEMV, above the tiled GEMM (H100: results/w4a16/cuda.json)

# The nibble trick's constants (see `_nibble`), passed to the GEMV as arguments rather than written into
# it: as arguments they sit in the constant bank (a small read-only memory an instruction can name as an
# operand), whereas literal constants were rebuilt in registers before almost every use, since the one
# logic instruction per nibble takes at most one literal (0.5 extra instructions per weight in the
# compiled code).
MASK_12, MASK_16 = 0xF << 12, 0xF << 16  # a nibble at bits 12-15, at bits 16-19
FLOAT_2048, FLOAT_128 = 138 << 23, 134 << 23  # the bits of the floats 2048.0 and 128.0


@dataclass
class W4A16Weight:
    """An int4 weight W [N, K] in the kernels' layout (see the module's docstring)."""

    words: torch.Tensor  # int32 [N, K / 8]
    scale_zero: torch.Tensor  # int32 [N, K / group_size]: fp16 scale (low half), fp16 zero (high half)
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.words.shape[0], self.words.shape[1] * 8


def w4a16_pack(q) -> W4A16Weight:  # noqa: ANN001 - a minillm.quant.formats.IntQuantized
    """Repack a 4-bit asymmetric grouped `IntQuantized` into the kernels' layout (once, at load time)."""
    if q.bits != 4 or q.zero is None:
        raise ValueError("W4A16 needs an asymmetric 4-bit weight: quantize_int(w, 4, group_size, symmetric=False).")
    N, K = q.shape
    G = q.group_size
    if G < 16 or G & (G - 1) or K % G:  # the kernels' tiles are powers of two, and a group is a whole tile row
        raise ValueError(f"W4A16 needs groups of a power of two inputs, a multiple of 16, that divide K = {K}; "
                         f"got {G}: quantize with group_size=128 (or 64, 32).")
    codes = q.int_codes().long().reshape(N, K // G, 8, G // 8)  # [N, groups, nibble c, word p]
    words = (codes << (4 * torch.arange(8, device=codes.device))[:, None]).sum(2)  # 0 .. 2^32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, as int32
    if not torch.isfinite(q.scale.half()).all() or ((q.scale.half() == 0) & (q.scale != 0)).any():
        raise ValueError("a group's scale is outside fp16's range (6e-8 .. 65504): rescale the weight first.")
    scale_zero = torch.stack((q.scale.half(), q.zero.half()), dim=-1).view(torch.int32).squeeze(-1)
    return W4A16Weight(words.reshape(N, K // 8).contiguous(), scale_zero.contiguous(), G)


def w4a16_dequantize(weight: W4A16Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix a `W4A16Weight` stands for, [N, K] in `dtype`: (q - zero) * scale per group."""
    N, K = weight.shape
    G = weight.group_size
    shifts = 4 * torch.arange(8, device=weight.words.device, dtype=torch.int32)
    words = weight.words.reshape(N, K // G, 1, G // 8)
    q = ((words >> shifts[:, None]) & 0xF).reshape(N, K // G, G)  # input c*16 + p of the group at [c, p]
    sz = weight.scale_zero.unsqueeze(-1).view(torch.float16)  # [N, groups, 2]
    scale, zero = sz[..., 0].to(dtype), sz[..., 1].to(dtype)
    return ((q.to(dtype) - zero[..., None]) * scale[..., None]).reshape(N, K)


def w4a16_reference(x: torch.Tensor, weight: W4A16Weight) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N], the definition: dequantise in x's dtype (fp64 for an exact reference), matmul."""
    return x @ w4a16_dequantize(weight, x.dtype).T


@triton.jit
def _nibble(w, c: tl.constexpr, MASK_12, MASK_16, FLOAT_2048, FLOAT_128):
    """Nibble c of each int32 word w as a float, 2048 + q (nibbles 0, 2, 3, 6) or 128 + q (1, 4, 5, 7).

    No int-to-float conversion: the word is shifted so that the nibble sits at bits 12-15 (or 16-19) of
    the mantissa, masked, and ORed with the bits of 2048.0 (128.0). The mantissa's lowest bit is then
    worth 2048 / 2^23 = 1/4096, so bits 12-15 hold q in units of exactly 1: the float is 2048 + q.
    One shift per two nibbles, one LOP3 (the GPU's three-input logic instruction: mask and OR at once)
    per nibble. The caller multiplies by the input
    as is and subtracts 2048 (or 128) times the input once per word, for all rows at once; fp32
    keeps q * x to 2^-24 * 2048, about 1e-4 of x: far below bf16's rounding.
    """
    if c == 0:
        b = w << 12  # nibble 0: bits 0-3 -> 12-15
    elif c == 1:
        b = w << 12  # nibble 1: bits 4-7 -> 16-19
    elif c == 2:
        b = w << 4  # 8-11 -> 12-15
    elif c == 3:
        b = w  # 12-15
    elif c == 4:
        b = w  # 16-19
    elif c == 5:
        b = w >> 4  # 20-23 -> 16-19
    elif c == 6:
        b = w >> 12  # 24-27 -> 12-15
    else:
        b = w >> 12  # 28-31 -> 16-19
    if c == 1 or c == 4 or c == 5 or c == 7:
        return ((b & MASK_16) | FLOAT_128).to(tl.float32, bitcast=True)
    return ((b & MASK_12) | FLOAT_2048).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_kernel(X, WORDS, SZ, OUT, N, K_WORDS, N_GROUPS, stride_xm, stride_om,
                 MASK_12, MASK_16, FLOAT_2048, FLOAT_128,
                 GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT_K: tl.constexpr,
                 PREFETCH: tl.constexpr):
    """Program (row m, n-block, k-split): BLOCK_N outputs of row m over K / SPLIT_K inputs, BLOCK_W words a step.

    Per word p of group g: sum_c (q_c - z) s x_c = s (sum_c (M_c + q_c) x_c - sum_c M_c x_c - z sum_c x_c),
    where M_c + q_c is `_nibble`'s float; the two sums over x alone are shared by the BLOCK_N rows.
    """
    m, pid_n, pid_k = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    WG: tl.constexpr = GROUP // 8  # words per group
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows[:, None] < N
    j = tl.arange(0, BLOCK_W)  # word of the step
    w_ptrs = WORDS + rows[:, None].to(tl.int64) * K_WORDS + j[None, :]  # [BLOCK_N, BLOCK_W]
    sz_ptrs = SZ + rows[:, None] * N_GROUPS + (j // WG)[None, :]  # each word's group
    x_ptrs = X + m * stride_xm + (j // WG) * GROUP + j % WG  # [BLOCK_W]: the input of nibble 0 of each word
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    kw_len = K_WORDS // SPLIT_K
    k_end = (pid_k + 1) * kw_len
    if PREFETCH:
        w_next = tl.load(w_ptrs + pid_k * kw_len, mask=row_ok, other=0)
        sz_next = tl.load(sz_ptrs + pid_k * kw_len // WG, mask=row_ok, other=0)
    for kw in range(pid_k * kw_len, k_end, BLOCK_W):
        if PREFETCH:  # issue the next step's loads now, so they travel while this step computes
            w, sz = w_next, sz_next
            more = row_ok & (kw + BLOCK_W + tl.zeros([1, BLOCK_W], dtype=tl.int32) < k_end)  # not past the end
            w_next = tl.load(w_ptrs + kw + BLOCK_W, mask=more, other=0)
            sz_next = tl.load(sz_ptrs + (kw + BLOCK_W) // WG, mask=more, other=0)
        else:
            w = tl.load(w_ptrs + kw, mask=row_ok, other=0)
            sz = tl.load(sz_ptrs + kw // WG, mask=row_ok, other=0)
        qx = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)  # sum_c (M_c + q_c) x_c, per row and word
        x_sum = tl.zeros([BLOCK_W], dtype=tl.float32)  # sum_c x_c
        mx_sum = tl.zeros([BLOCK_W], dtype=tl.float32)  # sum_c M_c x_c
        for c in tl.static_range(8):
            x_c = tl.load(x_ptrs + kw * 8 + c * WG).to(tl.float32)  # input c*16 + p of each word's group
            qx += _nibble(w, c, MASK_12, MASK_16, FLOAT_2048, FLOAT_128) * x_c[None, :]
            x_sum += x_c
            mx_sum += (128.0 if c == 1 or c == 4 or c == 5 or c == 7 else 2048.0) * x_c
        scale = (sz & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        zero = (sz >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        acc += scale * (qx - (mx_sum[None, :] + zero * x_sum[None, :]))
    out = tl.sum(acc, axis=1)
    rows_ok = rows < N
    if SPLIT_K == 1:
        tl.store(OUT + m * stride_om + rows, out.to(OUT.dtype.element_ty), mask=rows_ok)
    else:
        tl.atomic_add(OUT + m * stride_om + rows, out, mask=rows_ok)


@triton.jit
def _gemm_kernel(X, WORDS, SZ, OUT, M, N, K, stride_xm, stride_om, n_groups,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Program (m-block, n-block): a BLOCK_M x BLOCK_N output tile, one group of K per step. The [GROUP / 8,
    BLOCK_N] tile of words unpacks into [8, GROUP / 8, BLOCK_N] (nibble c of word p at [c, p]), which in
    that order is the [GROUP, BLOCK_N] tile of inputs; dequantised, it feeds one tl.dot."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    WG: tl.constexpr = GROUP // 8
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    shifts = 4 * tl.arange(0, 8)
    for g in range(0, n_groups):
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + g * GROUP + tl.arange(0, GROUP)[None, :],
                    mask=m_ok[:, None], other=0.0)  # [BLOCK_M, GROUP]
        w = tl.load(WORDS + rn[None, :].to(tl.int64) * (K // 8) + g * WG + tl.arange(0, WG)[:, None],
                    mask=n_ok[None, :], other=0)  # [WG, BLOCK_N] int32
        sz = tl.load(SZ + rn * n_groups + g, mask=n_ok, other=0)
        scale = (sz & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[None, :]
        zero_magic = (sz >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[None, :] + 8388608.0
        q = (w[None, :, :] >> shifts[:, None, None]) & 0xF  # [8, WG, BLOCK_N]: input c * WG + p at [c, p]
        # int -> float without a conversion instruction: q ORed into the mantissa of 2^23 is the float 2^23 + q
        q_magic = tl.reshape(q | 0x4B000000, [GROUP, BLOCK_N]).to(tl.float32, bitcast=True)
        acc += tl.dot(x, ((q_magic - zero_magic) * scale).to(x.dtype), input_precision=PRECISION)
    tl.store(OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(OUT.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, weight: W4A16Weight) -> tuple[int, int, int]:
    if not isinstance(weight, W4A16Weight):
        raise TypeError(f"expected a W4A16Weight (w4a16_pack(quantize_int(w, 4, 128, symmetric=False))), "
                        f"got {type(weight).__name__}.")
    N, K = weight.shape
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"shapes disagree: x {tuple(x.shape)} against a weight of {N} outputs x {K} inputs; "
                         "x must be [M, K] with the K the weight was quantised with.")
    return x.shape[0], N, K


def gemv_config(M: int, K: int) -> dict:
    """The GEMV's tile for M rows of K inputs: the fastest in the H100 sweep (results/w4a16/cuda.json).
    One row: 4 outputs a program on one warp; for a long K (down_proj) 8 outputs on 2 warps. A few rows:
    8 outputs on one warp, no prefetch (each row is its own program; the weights come from L2)."""
    if M > 1:
        return dict(block_n=8, num_warps=1, prefetch=False)
    return dict(block_n=8, num_warps=2, prefetch=True) if K >= 8192 else dict(block_n=4, num_warps=1, prefetch=True)


def w4a16_gemv(x: torch.Tensor, weight: W4A16Weight, block_n: int | None = None, words_per_thread: int = 4,
               num_warps: int | None = None, split_k: int = 1, prefetch: bool | None = None) -> torch.Tensor:
    """x [M, K] (M small) @ W^T -> [M, N] in x's dtype. Each step covers words_per_thread * 32 * num_warps
    words of block_n rows (fewer when that does not divide a K split); K may be split over `split_k` programs;
    `prefetch` loads each step's words during the step before (register double-buffering). Unset tile
    arguments come from `gemv_config`."""
    M, N, K = _check(x, weight)
    default = gemv_config(M, K)
    block_n = default["block_n"] if block_n is None else block_n
    num_warps = default["num_warps"] if num_warps is None else num_warps
    prefetch = default["prefetch"] if prefetch is None else prefetch
    k_words, group_words = K // 8, weight.group_size // 8
    if k_words % split_k or (k_words // split_k) % group_words:
        raise ValueError(f"split_k = {split_k} must divide K = {K} into whole groups of {weight.group_size}.")
    block_w = max(words_per_thread * 32 * num_warps, group_words)  # a step holds whole groups (powers of two)
    while (k_words // split_k) % block_w:
        block_w //= 2  # a K split that is not a multiple of the step: smaller steps, down to one group
    x = x.contiguous()
    out = torch.empty(M, N, device=x.device, dtype=x.dtype) if split_k == 1 else torch.zeros(
        M, N, device=x.device, dtype=torch.float32)  # split K: the programs add their parts
    grid = (M, triton.cdiv(N, block_n), split_k)
    _gemv_kernel[grid](x, weight.words, weight.scale_zero, out, N, k_words, K // weight.group_size,
                       x.stride(0), out.stride(0), MASK_12, MASK_16, FLOAT_2048, FLOAT_128,
                       GROUP=weight.group_size, BLOCK_N=block_n, BLOCK_W=block_w, SPLIT_K=split_k,
                       PREFETCH=prefetch, num_warps=num_warps)
    return out.to(x.dtype)


def w4a16_gemm(x: torch.Tensor, weight: W4A16Weight, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
               num_stages: int = 3) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, tiled for many rows (prefill), one group of K per step."""
    M, N, K = _check(x, weight)
    x = x.contiguous()
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _gemm_kernel[grid](x, weight.words, weight.scale_zero, out, M, N, K, x.stride(0), out.stride(0),
                       K // weight.group_size, GROUP=weight.group_size, BLOCK_M=block_m, BLOCK_N=block_n,
                       PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 exact; 16-bit: ignored
                       num_warps=num_warps, num_stages=num_stages)
    return out


def gemm_config(M: int) -> dict:
    """The GEMM's tile for M rows, from the H100 sweeps (benchmarks/w4a16_notes.md). Up to 16 rows, 16 x 16
    tiles on one warp: a narrow tile makes many programs (384 for a 6144-wide layer, against 96 with 64-wide
    tiles on 132 SMs), and at batch 16 the step took 6.2 ms instead of 7.8. Above, 64 x 64 on 4 warps."""
    return dict(block_m=16, block_n=16, num_warps=1) if M <= 16 else dict(block_m=64, block_n=64, num_warps=4)


def w4a16_matmul(x: torch.Tensor, weight: W4A16Weight) -> torch.Tensor:
    """x [M, K] @ W^T: the GEMV kernel for up to GEMV_MAX_ROWS rows, the GEMM kernel above."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return w4a16_gemv(x, weight)
    return w4a16_gemm(x, weight, **gemm_config(x.shape[0]))


def w4a16_linear(x: torch.Tensor, weight: W4A16Weight) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype."""
    y = w4a16_matmul(x.reshape(-1, x.shape[-1]), weight)
    return y.reshape(*x.shape[:-1], -1)
