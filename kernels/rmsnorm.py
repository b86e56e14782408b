"""Fused residual-add + RMSNorm in Triton, and the unfused PyTorch it replaces (chapter 02).

Every transformer block does, twice:

    residual = x + residual                                        (the residual stream)
    normed   = weight * (residual / sqrt(mean(residual^2) + eps))  (the next sublayer's input)

Both steps are elementwise or a row reduction: a handful of FLOPs per byte, so their speed is
set by memory bandwidth alone. Written as PyTorch operations, each operation is its own kernel
that reads its inputs from GPU memory and writes its output back. For N elements of a 2-byte
dtype, `fused_add_rms_norm_reference` below moves roughly

    add 6N, cast to fp32 6N, square 8N, mean 4N, multiply by 1/rms 8N, cast back 6N, times weight 4N

about 42N bytes, in nine kernel launches (`+ eps` and `rsqrt` on the [rows, 1] statistics are
the two small ones). The fused kernel reads x and residual once and writes the two outputs once:
8N bytes, about five times less traffic for an operation bound by bandwidth, with the same
arithmetic (and one launch instead of nine, which matters for small tensors). The statistics are
computed in fp32 in registers, and the rounding follows minillm's `RMSNorm` step for step (the
sum is rounded to the input dtype, normalised in fp32, rounded again, then scaled by the weight),
so the two agree to the last bit or nearly.

benchmarks/attention.py measures the fused kernel's GB/s against the unfused version;
tests/kernels/test_kernels.py checks it against the reference through Triton's CPU interpreter.
"""

# ruff: noqa: N803 - Triton kernels name compile-time constants and pointers in capitals (BLOCK, X)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import gdc_launch_dependents, gdc_wait, launch_options, use_pdl


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused PyTorch version (chapter 02): (RMSNorm(x + residual), x + residual), as minillm's model does it.

    x, residual [..., dim], weight [dim] -> (normed, new_residual), each [..., dim] in x's dtype.
    """
    h = x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(h.dtype)).to(h.dtype), h


@triton.jit
def _fused_add_rms_norm_kernel(
    X, R, W, OUT, NEW_R,
    stride_x, stride_r, stride_out, stride_new_r,
    dim, eps,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """One program = one row: read x and residual once, write normed and the new residual once. PDL: launched
    with programmatic dependent launch (kernels/pdl.py): the norm's weight loads before the wait."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < dim  # the row padded up to a power of two; the padding reads as 0 and is never stored
    w = tl.load(W + cols, mask=inside, other=0.0)
    if PDL:
        gdc_wait()
    x = tl.load(X + row * stride_x + cols, mask=inside, other=0.0)
    r = tl.load(R + row * stride_r + cols, mask=inside, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded to the input dtype, as x + residual is
    tl.store(NEW_R + row * stride_new_r + cols, h, mask=inside)

    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / dim + eps)  # fp32 statistics (padding adds 0 to the sum)
    normed = (hf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)  # round like `weight * normed.to(dtype)`
    tl.store(OUT + row * stride_out + cols, normed.to(OUT.dtype.element_ty), mask=inside)


def _interpreted() -> bool:
    return not isinstance(_fused_add_rms_norm_kernel, triton.runtime.JITFunction)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) in one Triton kernel (chapter 02).

    x, residual [..., dim] of one dtype (float16, bfloat16 or float32), weight [dim] -> (normed,
    new_residual), each [..., dim] in x's dtype. Rows may be strided; the last dim must be contiguous
    (else it is copied). Equals `fused_add_rms_norm_reference`.
    """
    if not all(isinstance(t, torch.Tensor) for t in (x, residual, weight)):
        raise ValueError("x, residual and weight must be torch tensors.")
    if x.shape != residual.shape or x.dim() == 0:
        raise ValueError(f"x and residual must have one shape [..., dim], got {tuple(x.shape)} and "
                         f"{tuple(residual.shape)}.")
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [dim] = [{dim}], got {tuple(weight.shape)}.")
    if x.dtype != residual.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x and residual must share one dtype among float16, bfloat16, float32; got {x.dtype} "
                         f"and {residual.dtype}.")
    if not (x.device == residual.device == weight.device):
        raise ValueError(f"x, residual and weight must be on one device, got {x.device}, {residual.device}, "
                         f"{weight.device}.")
    if x.device.type != "cuda" and not _interpreted():
        raise ValueError(f"fused_add_rms_norm needs CUDA tensors, got {x.device}. Move them with .cuda(), set "
                         "TRITON_INTERPRET=1 before importing triton, or call fused_add_rms_norm_reference.")
    BLOCK = triton.next_power_of_2(dim)
    if BLOCK > 65536:
        raise ValueError(f"dim {dim} is too large for one row per program (at most 65536).")

    x2, r2 = x.reshape(-1, dim), residual.reshape(-1, dim)  # views where the strides allow
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    rows = x2.shape[0]
    normed = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(normed)
    if rows:
        num_warps = 1 if _interpreted() else min(16, max(1, BLOCK // 256))
        pdl = use_pdl(x2)
        _fused_add_rms_norm_kernel[(rows,)](
            x2, r2, weight, normed, new_residual,
            x2.stride(0), r2.stride(0), normed.stride(0), new_residual.stride(0),
            dim, float(eps), BLOCK=BLOCK, PDL=pdl, num_warps=num_warps, **launch_options(pdl),
        )
    return normed.view(x.shape), new_residual.view(x.shape)
