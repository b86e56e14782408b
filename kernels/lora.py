"""The batched LoRA matmul: many adapters in one batch, each row with its own (chapter 08, issue 32).

A LoRA adapter adds a low-rank update to a linear layer: y = x W^T + (x A^T) B^T, with A [r, in] and
B [out, r] (the scale alpha / r already folded into B). When the rows of one batch belong to different
adapters, the base matmul x W^T still runs once for all of them; only the low-rank part differs by row.
Row n uses the adapter in slot `slot_ids[n]` of stacked tensors (-1: no adapter, the base model):

    lora_a [S, r, in]    lora_b [S, out, r]    slot_ids [N]    x [N, in]    y [N, out]
    y[n] += lora_b[s] @ (lora_a[s] @ x[n])       for every n with s = slot_ids[n] >= 0

This is the idea of Punica's BGMV ("batched gather matrix-vector"): each row gathers its own two small
matrices. Three ways to compute it live here:

    add_lora_reference(y, x, a, b, ids)   a loop over the adapters present: each one's rows, two matmuls
                                          (what the engine runs off the GPU; S-LoRA/Punica's SGMV, by segment)
    add_lora_gathered(y, x, a, b, ids)    every row gathers its matrices, then two batched matmuls
                                          (the definition, written as one line of math; memory N x r x in)
    add_lora(y, x, a, b, ids)             the Triton kernels: `shrink` (x -> [N, r] through each row's A)
                                          then `expand` (-> [N, out] through each row's B, added into y)

One shrink program computes all r values of one row (a matrix-vector product, elementwise multiply and
sum: no `tl.dot`, which needs 16 rows); one expand program computes BLOCK_OUT outputs of one row. A row
with no adapter returns at once. Rows may be a column slice of a wider output (y strided), which is how
minillm adds q's, k's and v's updates into their slices of the stacked qkv_proj output. Ranks must be
equal across slots: smaller ones are padded with zeros (they add exactly zero).
tests/lora/test_lora.py checks the kernel against the references through Triton's CPU interpreter.
"""

# ruff: noqa: N803 - Triton kernels name compile-time constants and pointers in capitals (BLOCK_R, X)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lora_reference import _check, add_lora_gathered, add_lora_reference

__all__ = ["add_lora", "add_lora_gathered", "add_lora_reference"]


@triton.jit
def _shrink_kernel(X, A, SLOTS, V, d_in, rank, stride_x, stride_as, stride_ar,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program = one row n: V[n, :r] = A[slot] @ X[n], in fp32 (skipped for a row without an adapter)."""
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + n).to(tl.int64)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, d_in, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + n * stride_x + k, mask=k < d_in, other=0.0).to(tl.float32)  # [BLOCK_K]
            a = tl.load(A + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                        mask=(r[:, None] < rank) & (k[None, :] < d_in), other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_K]
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(V + n * BLOCK_R + r, acc)


@triton.jit
def _expand_kernel(V, B, SLOTS, Y, d_out, rank, stride_y, stride_bs, stride_bo,
                   BLOCK_R: tl.constexpr, BLOCK_OUT: tl.constexpr):
    """One program = BLOCK_OUT outputs of row n: Y[n, o] += B[slot, o, :r] @ V[n, :r] (skipped without an adapter)."""
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + n).to(tl.int64)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        o = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        v = tl.load(V + n * BLOCK_R + r)  # [BLOCK_R] fp32
        b = tl.load(B + slot * stride_bs + o[:, None] * stride_bo + r[None, :],
                    mask=(o[:, None] < d_out) & (r[None, :] < rank), other=0.0).to(tl.float32)  # [BLOCK_OUT, BLOCK_R]
        delta = tl.sum(b * v[None, :], axis=1)  # [BLOCK_OUT]
        y_ptr = Y + n * stride_y + o
        y = tl.load(y_ptr, mask=o < d_out, other=0.0)
        tl.store(y_ptr, (y.to(tl.float32) + delta).to(y.dtype), mask=o < d_out)


def _interpreted() -> bool:
    """True when the kernels were defined under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_shrink_kernel, triton.runtime.JITFunction)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             slot_ids: torch.Tensor) -> torch.Tensor:
    """`add_lora_reference` as two Triton launches (shrink, then expand), in place; returns y.

    y [N, out] (rows may be strided: a column slice of the stacked output), x [N, in], lora_a [S, r, in],
    lora_b [S, out, r], slot_ids [N] int (-1: no adapter). Accumulates in fp32; y keeps its dtype.
    """
    _check(y, x, lora_a, lora_b, slot_ids)
    if x.device.type != "cuda" and not _interpreted():
        raise ValueError(f"add_lora needs CUDA tensors, got {x.device}: set TRITON_INTERPRET=1 before importing "
                         "triton, or call add_lora_reference.")
    N, d_in = x.shape
    S, rank, _ = lora_a.shape
    d_out = y.shape[1]
    if N == 0 or rank == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    if y.stride(1) != 1:
        raise ValueError("y's last dim must be contiguous (a column slice of a row-major matrix is).")
    lora_a, lora_b, slot_ids = lora_a.contiguous(), lora_b.contiguous(), slot_ids.contiguous()
    BLOCK_R = max(16, triton.next_power_of_2(rank))
    BLOCK_K = min(256, triton.next_power_of_2(d_in))
    BLOCK_OUT = min(128, triton.next_power_of_2(d_out))
    shrunk = torch.empty((N, BLOCK_R), dtype=torch.float32, device=x.device)  # [N, BLOCK_R]: x through each A
    _shrink_kernel[(N,)](x, lora_a, slot_ids, shrunk, d_in, rank, x.stride(0), lora_a.stride(0), lora_a.stride(1),
                         BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    _expand_kernel[(N, triton.cdiv(d_out, BLOCK_OUT))](
        shrunk, lora_b, slot_ids, y, d_out, rank, y.stride(0), lora_b.stride(0), lora_b.stride(1),
        BLOCK_R=BLOCK_R, BLOCK_OUT=BLOCK_OUT)
    return y
