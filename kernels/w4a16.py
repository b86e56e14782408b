"""W4A16: a matrix multiply that reads 4-bit weights and dequantises them in registers (chapter 06).

The weight W [N, K] is stored as `minillm.quant.IntQuantized` with bits=4, asymmetric, in groups of
G inputs (128): packed uint8 [N, K/2] (byte i of a row holds code 2i in its low nibble, 2i+1 in its
high one), scale and zero [N, K/G] fp32, w = (q - z) * s. Activations stay in 16 bits (bf16/fp16).

Why it speeds up decode. At batch 1 every weight byte is read once per token and used for one
multiply-add: the step is bound by memory bandwidth, so reading 0.5 bytes per weight (+ the group's
scale and zero) instead of 2 makes it up to ~3.5x faster. The dequantisation costs arithmetic,
which a memory-bound kernel has to spare. At large batch the same weight serves many rows, the
matmul is compute-bound, and fewer weight bytes buy little: the tensor cores still multiply in 16 bits.

Why a naive int4 path is no faster: dequantising the whole matrix to bf16 in one kernel and then
calling the bf16 matmul reads 0.5 bytes, writes 2 and reads 2 again per weight: more traffic than
bf16 alone, plus a launch. The point of a fused kernel is that the 16-bit weights never touch memory.

Two kernels:
  GEMV (decode, few rows): each program owns BLOCK_N output features of one row and walks K a few
    groups at a time, reading the packed codes as int32 words (8 codes each); a group's scale factors
    out of its dot product, so per group it computes s * (sum(q * x) - z * sum(x)), with no per-weight
    multiply by s. K may be split over SPLIT_K programs (fp32 atomic adds) so that a narrow layer still
    fills the GPU.
  GEMM (prefill, many rows): tiles of BLOCK_M x BLOCK_N; each step unpacks a tile of words into the
    dequantised [BLOCK_K, BLOCK_N] weight tile, fed to tl.dot in the activations' dtype.

`w4a16_reference` is the definition (dequantise, then matmul). Under Triton's CPU interpreter
(TRITON_INTERPRET=1) use fp32 or fp16 activations: its bf16 tl.dot is not exact.
"""

# ruff: noqa: N803 - Triton kernels name compile-time constants and pointers in capitals (BLOCK_N, X)

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 1  # up to this many rows (tokens), the GEMV kernel; above, the tiled GEMM (faster on an H100)


def w4a16_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """x [M, K] @ dequantised(W)^T -> [M, N] in x's dtype (summed in fp32, or fp64 for fp64 scales)."""
    low, high = packed & 0x0F, packed >> 4
    q = torch.stack((low, high), dim=-1).flatten(-2).to(scale.dtype)  # [N, K]
    w = (q.reshape(q.shape[0], -1, group_size) - zero[..., None]) * scale[..., None]
    return (x.to(w.dtype) @ w.reshape(q.shape).T).to(x.dtype)


@triton.jit
def _gemv_kernel(X, WORDS, SCALE, ZERO, OUT, N, K, stride_xm, stride_om, n_groups,
                 GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """Program (n-block, row m, k-split): BLOCK_N outputs of row m over K / SPLIT_K inputs.

    The packed bytes are read as int32 words of 8 codes (code c of word j = bits 4c..4c+3 = input
    8j + c), a [BLOCK_N, BLOCK_K / 8] tile per step. Code c of every word is multiplied by input
    8j + c; per word, (q - z) s x summed over its 8 codes is s (sum(q x) - z sum(x)).
    """
    pid_n, m, pid_k = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    words = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    k_len = K // SPLIT_K
    for k0 in range(pid_k * k_len, (pid_k + 1) * k_len, BLOCK_K):
        w = tl.load(WORDS + rows[:, None].to(tl.int64) * (K // 8) + k0 // 8 + words[None, :],
                    mask=row_ok[:, None], other=0)  # [BLOCK_N, BLOCK_K / 8] int32
        group = (k0 + 8 * words) // GROUP  # each word's group
        s = tl.load(SCALE + rows[:, None] * n_groups + group[None, :], mask=row_ok[:, None], other=0.0)
        z = tl.load(ZERO + rows[:, None] * n_groups + group[None, :], mask=row_ok[:, None], other=0.0)
        z_magic = z + 8388608.0  # 2^23 + z: see the bit trick below
        qx = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        for c in tl.static_range(8):
            x_c = tl.load(X + m * stride_xm + k0 + 8 * words + c).to(tl.float32)  # inputs 8j + c
            # int -> float without a (slow) conversion instruction: a 4-bit q ORed into the mantissa of
            # 2^23 is the float 2^23 + q exactly; subtracting 2^23 + z leaves q - z.
            q_magic = (((w >> (4 * c)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
            qx += (q_magic - z_magic) * x_c[None, :]
        acc += s * qx  # the group's scale, once per word instead of once per weight
    out = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(OUT + m * stride_om + rows, out.to(OUT.dtype.element_ty), mask=row_ok)
    else:
        tl.atomic_add(OUT + m * stride_om + rows, out, mask=row_ok)


@triton.jit
def _gemm_kernel(X, WORDS, SCALE, ZERO, OUT, M, N, K, stride_xm, stride_om, n_groups,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Program (m-block, n-block): a BLOCK_M x BLOCK_N output tile. Per step, the [BLOCK_K / 8, BLOCK_N]
    tile of words is unpacked into the [BLOCK_K, BLOCK_N] weight tile (word j's code c is input 8j + c),
    dequantised and fed to one tl.dot. BLOCK_K <= GROUP: one scale per output per step."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    words = tl.arange(0, BLOCK_K // 8)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    shifts = 4 * tl.arange(0, 8)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + k0 + tl.arange(0, BLOCK_K)[None, :],
                    mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(WORDS + rn[None, :].to(tl.int64) * (K // 8) + k0 // 8 + words[:, None],
                    mask=n_ok[None, :], other=0)  # [BLOCK_K / 8, BLOCK_N] int32
        s = tl.load(SCALE + rn * n_groups + k0 // GROUP, mask=n_ok, other=0.0)[None, :]
        z_magic = tl.load(ZERO + rn * n_groups + k0 // GROUP, mask=n_ok, other=0.0)[None, :] + 8388608.0
        q = (w[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]: input 8j + c at [j, c]
        q_magic = tl.reshape(q | 0x4B000000, [BLOCK_K, BLOCK_N]).to(tl.float32, bitcast=True)  # 2^23 + q
        acc += tl.dot(x, ((q_magic - z_magic) * s).to(x.dtype), input_precision=PRECISION)
    tl.store(OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(OUT.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
           block_k: int) -> tuple[int, int, int]:
    if x.dim() != 2 or packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"expected x [M, K] and packed uint8 [N, K/2], got {tuple(x.shape)} and "
                         f"{tuple(packed.shape)} {packed.dtype}.")
    M, K = x.shape
    N = packed.shape[0]
    if packed.shape[1] * 2 != K or K % group_size or scale.shape != (N, K // group_size) or zero.shape != scale.shape:
        raise ValueError(f"shapes disagree: x [{M}, {K}], packed {tuple(packed.shape)}, scale {tuple(scale.shape)}, "
                         f"zero {tuple(zero.shape)}, group_size {group_size}; build the weight of x's width K with "
                         "minillm.quant.quantize_int(w, 4, group_size, symmetric=False) (its codes, scale, zero).")
    if group_size % block_k or block_k % 8:
        raise ValueError(f"block_k ({block_k}) must be a multiple of 8 and divide group_size ({group_size}).")
    return M, N, K


def w4a16_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
               block_n: int = 8, groups_per_block: int = 2, split_k: int = 1, num_warps: int = 4) -> torch.Tensor:
    """x [M, K] (M small) @ W^T -> [M, N] in x's dtype; one program per (block_n outputs, row, K split),
    each step over `groups_per_block` groups of inputs."""
    M, N, K = _check(x, packed, scale, zero, group_size, 8)
    while groups_per_block > 1 and K % (split_k * group_size * groups_per_block):
        groups_per_block //= 2  # a narrow layer: fewer groups per step
    block_k = group_size * groups_per_block
    if K % (split_k * block_k):
        raise ValueError(f"split_k * group_size * groups_per_block ({split_k} * {group_size} * {groups_per_block}) "
                         f"must divide K = {K}, and group_size must be a multiple of 8.")
    x = x.contiguous()
    out = torch.zeros(M, N, device=x.device, dtype=torch.float32 if split_k > 1 else x.dtype)
    grid = (triton.cdiv(N, block_n), M, split_k)
    words = packed.contiguous().view(torch.int32)  # [N, K/8]: 8 codes per word, little-endian = input order
    _gemv_kernel[grid](x, words, scale, zero, out, N, K, x.stride(0), out.stride(0), K // group_size,
                       GROUP=group_size, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=num_warps)
    return out.to(x.dtype)


def w4a16_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
               block_m: int = 64, block_n: int = 64, block_k: int = 128, num_warps: int = 4,
               num_stages: int = 3) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, tiled for many rows (prefill). block_k divides group_size."""
    M, N, K = _check(x, packed, scale, zero, group_size, block_k)
    x = x.contiguous()
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    words = packed.contiguous().view(torch.int32)  # [N, K/8]
    _gemm_kernel[grid](x, words, scale, zero, out, M, N, K, x.stride(0), out.stride(0), K // group_size,
                       GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                       PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 exact; 16-bit: ignored
                       num_warps=num_warps, num_stages=num_stages)
    return out


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """x [M, K] @ W^T: the GEMV kernel for up to GEMV_MAX_ROWS rows, the GEMM kernel above."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return w4a16_gemv(x, packed, scale, zero, group_size)
    block_k = 128 if group_size % 128 == 0 else group_size  # the tiles the H100 sweep picked (results/w4a16_cuda.json)
    return w4a16_gemm(x, packed, scale, zero, group_size, block_m=16 if x.shape[0] <= 16 else 64, block_k=block_k)


def w4a16_linear(x: torch.Tensor, q) -> torch.Tensor:  # noqa: ANN001 - a minillm.quant.IntQuantized
    """x [..., K] @ W^T for a 4-bit asymmetric grouped `IntQuantized` W [N, K] -> [..., N] in x's dtype."""
    if q.bits != 4 or q.zero is None:
        raise ValueError("w4a16_linear needs an asymmetric 4-bit weight (quantize_int(w, 4, group, symmetric=False)).")
    y = w4a16_matmul(x.reshape(-1, x.shape[-1]), q.codes, q.scale, q.zero, q.group_size)
    return y.reshape(*x.shape[:-1], -1)
