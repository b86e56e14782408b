"""Rotary embeddings on queries and keys in one Triton kernel, and the PyTorch it replaces (issue 16).

Every attention layer rotates each query and key head by its token's angles (chapter 01):

    angle_i    = position * inv_freq_i                    i < D/2, in fp32
    x_i'       = x_i cos(angle_i) - x_{i+D/2} sin(angle_i)
    x_{i+D/2}' = x_{i+D/2} cos(angle_i) + x_i sin(angle_i)

minillm's model (`RotaryEmbedding`, `apply_rotary`) does this with tables: once per forward pass
it builds cos and sin, each [tokens, D] in the model's dtype (about nine small kernels: the
positions cast to fp32, the product with inv_freq, cos, sin, a negation, two concatenations, two
casts), and then every layer rotates q and k with

    x * cos + cat(x[..., D/2:], x[..., :D/2]) * sin

four kernels per tensor, eight per layer. For n elements of a 2-byte dtype in q or k, those four
move about 18n bytes: the multiply by cos reads x and writes a product (4n), the concatenation
reads and writes a copy (4n), the multiply by sin likewise (4n), the sum reads two products and
writes the result (6n), while the tables themselves are small (one row per token, shared by the
heads). The fused kernel reads q and k once and writes them once, 4n bytes, and computes cos and
sin in registers from the positions and inv_freq (a few bytes a token): about four and a half times
less traffic, and one launch per layer instead of eight. In decode, where n is a few thousand
elements, it is the launches that count.

Rounding. The kernel reproduces the model's PyTorch, operation by operation, rather than computing
in fp32 and rounding once: the angle is float(position) * inv_freq in fp32, exactly as the model
forms it; cos and sin are computed in fp32 (with CUDA's accurate cosf/sinf from libdevice, the
functions PyTorch's own kernels call, not the fast approximate instructions, which lose accuracy for
the large angles of late positions), then rounded to the input dtype, as `cos.to(dtype)` does; each
product is rounded to the dtype, as each PyTorch multiply rounds its output; and the sum of the
two rounded products, taken in fp32, is rounded once more, as PyTorch's add does. Contraction of a
multiply and an add into one fused multiply-add is switched off (`enable_fp_fusion=False`), so
fp32 matches too. On a GPU the kernel and `fused_rotary_reference` should therefore agree to the
last bit, save where libdevice and PyTorch's cos or sin differ (on an H100, with Triton 3.6 and
PyTorch 2.11, they agreed on every element in fp32, fp16 and bf16, positions up to 131071). On the
CPU interpreter NumPy computes cos and sin (possibly a unit in the last fp32 place off) and rounds
fp32 -> bf16 toward zero (tests/kernels/test_kernels.py says more), so bf16 there may differ by an ulp or two.

Layout. q [N, H, D] and k [N, H_kv, D] hold one row per token (the model's [B, T] flattened);
each may be a strided view, such as the query and key columns of the one qkv projection
(`qkv.view(N, -1, D)[:, :H]`), as long as the last dimension is contiguous. One program handles
one token: it computes the token's D/2 angles once, then rotates all H query heads and all H_kv key
heads with them, a tile of heads at a time. For decode (N = the batch size) that is a handful of
programs each moving a few KB, one launch for both tensors, and no table rebuilt per head; for a
prefill of thousands of tokens it is thousands of programs, enough to fill the GPU.

The cache write. In a decode step the rotated keys have one destination, the paged cache (chapter 04),
and the values go there too. Given the layer's pools and each token's slot (`cache=`), the same program
stores the token's rotated key heads and copies its value heads straight to row `slot` of the pools seen
as [slots, H_kv, D], instead of writing k out for two more kernels (`store_kv`, once for keys, once for
values) to copy: a captured decode step of the 1B shape went from 216 to 184 kernels.

tests/kernels/test_fused_kernels.py checks the kernel against `fused_rotary_reference` through Triton's
CPU interpreter (and on a GPU where there is one).
"""

# ruff: noqa: N803 - Triton kernels name compile-time constants and pointers in capitals (BLOCK, Q)

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .pdl import gdc_launch_dependents, gdc_wait, launch_options, use_pdl


def fused_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embeddings as minillm's model applies them (`RotaryEmbedding`, then `apply_rotary`).

    q [N, H, D], k [N, H_kv, D] of one dtype, positions [N] (integers), inv_freq [D/2] fp32 ->
    (q_out [N, H, D], k_out [N, H_kv, D]) in q's dtype. cos and sin are built in fp32 and rounded
    to the dtype; then `x * cos + rotate_half(x) * sin`, each operation rounding to the dtype.
    """
    angles = positions[:, None].float() * inv_freq  # [N, D/2], fp32
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [N, D]
    cos, sin = cos.to(q.dtype)[:, None], sin.to(q.dtype)[:, None]  # [N, 1, D]: one row for every head

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(
    X, OUT, stride_xh, stride_oh, n_heads, half, c, s,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rotate the n_heads rows of one token (X and OUT point at the token's first head), BLOCK_H at a time.

    c, s [1, BLOCK_HALF]: cos and sin of the token's angles, already rounded to the dtype (held in fp32).
    """
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + heads
        inside = (h < n_heads) & (cols < half)  # padding (heads past the last, columns past D/2) is never stored
        x1_raw = tl.load(X + h * stride_xh + cols, mask=inside, other=0.0)  # first half, x_i
        x2_raw = tl.load(X + h * stride_xh + half + cols, mask=inside, other=0.0)  # second half, x_{i+D/2}
        dtype = x1_raw.dtype
        x1, x2 = x1_raw.to(tl.float32), x2_raw.to(tl.float32)
        # each product rounded to the dtype, as `x * cos` and `rotate_half(x) * sin` round; the model's sin
        # table holds -sin in its first half, so the first product is x_{i+D/2} * (-sin)
        out1 = (x1 * c).to(dtype).to(tl.float32) + (x2 * -s).to(dtype).to(tl.float32)
        out2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
        tl.store(OUT + h * stride_oh + cols, out1.to(dtype), mask=inside)  # the sum rounded, as `+` rounds
        tl.store(OUT + h * stride_oh + half + cols, out2.to(dtype), mask=inside)


@triton.jit
def _copy_heads(X, OUT, stride_xh, stride_oh, n_heads, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Copy the n_heads rows of one token (X and OUT point at the token's first head), BLOCK_H at a time."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + heads
        inside = (h < n_heads) & (cols < D)
        tl.store(OUT + h * stride_oh + cols, tl.load(X + h * stride_xh + cols, mask=inside), mask=inside)


@triton.jit
def _fused_rotary_kernel(
    Q, K, POS, INV_FREQ, Q_OUT, K_OUT, V, V_OUT, SLOTS,
    stride_qn, stride_qh, stride_kn, stride_kh,
    stride_qon, stride_qoh, stride_kon, stride_koh,
    stride_vn, stride_vh, stride_von, stride_voh,
    n_q_heads, n_k_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, LIBDEVICE: tl.constexpr, TO_CACHE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program = one token: its angles once, then every query head and every key head.

    With TO_CACHE, K_OUT and V_OUT are a layer's key and value pools seen as [slots, H_kv, D]: the token's
    rotated keys and its values go straight to row SLOTS[token] of each (the paged cache's write, chapter 04).
    PDL: launched with programmatic dependent launch (kernels/pdl.py): the frequencies load before the wait."""
    if PDL:
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    inv_freq = tl.load(INV_FREQ + cols, mask=cols < half, other=0.0)
    if PDL:
        gdc_wait()
    angle = tl.load(POS + token).to(tl.float32) * inv_freq  # fp32, as `positions.float() * inv_freq`
    if LIBDEVICE:  # CUDA's accurate cosf/sinf, as PyTorch's kernels use (tl.cos may be a fast approximation)
        c, s = libdevice.cos(angle), libdevice.sin(angle)
    else:  # the CPU interpreter, which has no libdevice: NumPy's fp32 cos and sin
        c, s = tl.cos(angle), tl.sin(angle)
    dtype = Q.dtype.element_ty
    c, s = c.to(dtype).to(tl.float32), s.to(dtype).to(tl.float32)  # rounded, as `cos.to(dtype)` rounds
    _rotate_heads(Q + token * stride_qn, Q_OUT + token * stride_qon, stride_qh, stride_qoh, n_q_heads, half, c, s,
                  BLOCK_H, BLOCK_HALF)
    row = token
    if TO_CACHE:
        row = tl.load(SLOTS + token).to(tl.int64)
    _rotate_heads(K + token * stride_kn, K_OUT + row * stride_kon, stride_kh, stride_koh, n_k_heads, half, c, s,
                  BLOCK_H, BLOCK_HALF)
    if TO_CACHE:
        _copy_heads(V + token * stride_vn, V_OUT + row * stride_von, stride_vh, stride_voh, n_k_heads, 2 * half,
                    BLOCK_H, 2 * BLOCK_HALF)


def _interpreted() -> bool:
    """True when the kernel was defined under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_fused_rotary_kernel, triton.runtime.JITFunction)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def fused_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate queries and keys by their positions' angles in one Triton kernel (issue 16).

    q [N, H, D] and k [N, H_kv, D] of one dtype (float16, bfloat16 or float32), positions [N] int32 or
    int64, inv_freq [D/2] float32 (`RotaryEmbedding.inv_freq`) -> (q_out [N, H, D], k_out [N, H_kv, D]),
    new contiguous tensors in q's dtype. q and k may be strided views (of one qkv matrix, say): any
    strides for tokens and heads, the last dim contiguous (else it is copied first). Equals
    `fused_rotary_reference`, rounding for rounding (see the module docstring).

    With `cache` = (v [N, H_kv, D], k_pool, v_pool, slots [N]), the same launch also writes the paged cache
    (chapter 04): token n's rotated keys and its values go to slot slots[n] of the layer's pools
    [num_blocks, block_size, H_kv, D] (contiguous, q's dtype), as `store_kv` would write them, and k_out is
    None. A decode step then needs one launch per layer for rotary and the cache write, not three.
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, positions, inv_freq)):
        raise ValueError("q, k, positions and inv_freq must be torch tensors.")
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q must be [N, H, D] and k [N, H_kv, D] (flatten batch and time into N first), got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}.")
    N, H, D = q.shape
    H_kv = k.shape[1]
    if k.shape[0] != N or k.shape[2] != D:
        raise ValueError(f"q [N, H, D] = {tuple(q.shape)} and k [N, H_kv, D] = {tuple(k.shape)} must agree on N "
                         "(tokens) and D (head dim).")
    if D == 0 or D % 2:
        raise ValueError(f"the head dim D must be even (rotary pairs x_i with x_(i+D/2)), got D = {D}.")
    if positions.shape != (N,):
        raise ValueError(f"positions must be [N] = [{N}], one position per token, got {tuple(positions.shape)}.")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}.")
    if inv_freq.shape != (D // 2,):
        raise ValueError(f"inv_freq must be [D/2] = [{D // 2}] (RotaryEmbedding.inv_freq), got "
                         f"{tuple(inv_freq.shape)}.")
    if inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be float32 (rounding it skews every angle), got {inv_freq.dtype}; "
                         "pass RotaryEmbedding.inv_freq, which stays fp32.")
    if q.dtype != k.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q and k must share one dtype among float16, bfloat16, float32; got {q.dtype} and "
                         f"{k.dtype}.")
    if not (q.device == k.device == positions.device == inv_freq.device):
        raise ValueError(f"q, k, positions and inv_freq must be on one device, got {q.device}, {k.device}, "
                         f"{positions.device}, {inv_freq.device}.")
    if q.device.type != "cuda" and not _interpreted():
        raise ValueError(f"fused_rotary needs CUDA tensors, got {q.device}. Move them with .cuda(), set "
                         "TRITON_INTERPRET=1 before importing triton, or call fused_rotary_reference.")

    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()
    q_out = torch.empty((N, H, D), dtype=q.dtype, device=q.device)
    if cache is None:
        k_out = torch.empty((N, H_kv, D), dtype=k.dtype, device=k.device)
        v = v_out = slots = k_out  # never read or written without a cache (TO_CACHE=False): any pointer will do
    else:
        v, k_pool, v_pool, slots = cache
        for pool in (k_pool, v_pool):
            if pool.dim() != 4 or tuple(pool.shape[2:]) != (H_kv, D) or not pool.is_contiguous() \
                    or pool.dtype != q.dtype or pool.device != q.device:
                raise ValueError(f"the cache's pools must be contiguous [num_blocks, block_size, H_kv, D] = "
                                 f"[., ., {H_kv}, {D}] in {q.dtype} on {q.device}, got {tuple(pool.shape)} "
                                 f"{pool.dtype} on {pool.device}.")
        if tuple(v.shape) != (N, H_kv, D) or v.dtype != q.dtype or slots.shape != (N,):
            raise ValueError(f"v must be [N, H_kv, D] = [{N}, {H_kv}, {D}] in {q.dtype} and slots [N], got "
                             f"{tuple(v.shape)} {v.dtype} and {tuple(slots.shape)}.")
        v, slots = _last_dim_contiguous(v), slots.contiguous()
        k_out, v_out = k_pool.view(-1, H_kv, D), v_pool.view(-1, H_kv, D)  # slot s is row s
    if N == 0:
        return q_out, None if cache is not None else k_out
    half = D // 2
    BLOCK_HALF = triton.next_power_of_2(half)
    # a tile of at most 2048 elements per half (32 heads of D = 128): few loop trips, no register spills
    BLOCK_H = max(1, min(triton.next_power_of_2(max(H, H_kv, 1)), 2048 // BLOCK_HALF))
    interpreted = _interpreted()
    pdl = use_pdl(q)
    options = {} if interpreted else {"num_warps": 4, "enable_fp_fusion": False,  # no fma: round like PyTorch
                                      **launch_options(pdl)}
    _fused_rotary_kernel[(N,)](
        q, k, positions, inv_freq, q_out, k_out, v, v_out, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        v.stride(0), v.stride(1), v_out.stride(0), v_out.stride(1),
        H, H_kv, half,
        BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, LIBDEVICE=not interpreted, TO_CACHE=cache is not None, PDL=pdl,
        **options,
    )
    return q_out, None if cache is not None else k_out
