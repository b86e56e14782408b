"""One row times a 16-bit weight matrix: the matrix-vector product of batch-1 decode (chapter 05, issue 30).

At batch 1 every linear layer is y = W x with x one row: each weight is read once and used for one
multiply-add, so the layer can take no less than (weight bytes) / (memory bandwidth). cuBLAS picks a
GEMM tile for it (8 rows of x padded, a split K and a second reduction kernel for some shapes); on
an H200 that streamed Llama-3.2-1B's 2048 x 3072 and 2048 x 2048 projections at about 40% of the copy
bandwidth (34-51%) and its MLP's down projection at about 60% with its split-K reduction
(results/roofline/cuda_h200.json, read by matching kernels to layers). A matrix-vector product needs
no tiles of x at all:

    program p owns BLOCK_N outputs (rows of W); its threads spread along K, each meant to hold VEC
    consecutive weights of every one of its rows (the step's BLOCK_K = VEC x 32 x warps inputs is
    sized so that Triton spreads the tile that way: a 16-byte load in bf16), so one value of x serves
    BLOCK_N weights; products accumulate in fp32 per thread and are summed across the threads once,
    at the end. The next step's weights are loaded before this step's multiply (register double
    buffering), so a load is always in flight.

With 4 outputs a program, a 2048-output layer is 512 programs: enough to keep every SM's loads in
flight, the thing a bandwidth-bound kernel needs.

SwiGLU fused in (`swiglu=True`): the MLP's down projection takes silu(gate) * up, which the fused path
computes in its own kernel (`silu_and_mul`) and writes to memory for the matmul to read back. Here each
program computes it from gate_up as it loads x, rounded exactly as `silu_and_mul` rounds (silu to the
dtype, then the product): one launch fewer per layer, and the same x (to the last bit where libdevice's
expf agrees with PyTorch's, as for `silu_and_mul`; the tests run through the interpreter, not on a GPU).

`matvec_reference` is the definition: `F.linear` (on the silu_and_mul of x when swiglu). The kernel sums
in a different order than cuBLAS, so the two agree to fp32 rounding of the sums, then one rounding to
the output dtype. tests/kernels/test_fused_kernels.py checks it through Triton's CPU interpreter (and on a GPU).

Measured (H200, benchmarks/matvec.py, results/matvec/cuda.json): the batch-1 replay of Llama-3.2-1B's
shape 1.13 -> 1.03 ms, of Llama-3-8B's 4.73 -> 4.54 ms, mostly from fewer kernels (chapter 05).
"""

# ruff: noqa: N803, N806 - Triton kernels name compile-time constants and pointers in capitals (BLOCK_N, X)

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .pdl import gdc_launch_dependents, gdc_wait, launch_options, use_pdl
from .swiglu import silu_and_mul_reference

# The kernel's tile by the layer's inputs K: (outputs a program, warps a program, consecutive weights a thread
# loads per row and step; 8 x 2 bytes = one 16-byte load). The first entry whose bound K does not exceed
# applies (None: any K). Chosen inside the engine's batch-1 graph step on an H200 (benchmarks/matvec.py,
# results/matvec/archive/matvec_cuda_by_k.json, confirmed in results/matvec/cuda.json): 4 warps for Llama-3.2-1B's
# layers (K = 2048 and its MLP's 8192), 2 for Llama-3-8B's (4096 and 14336). Other widths take the next bound up;
# the tiles differed by a few percent.
TILES_BY_K: list[tuple[int | None, tuple[int, int, int]]] = [
    (2048, (4, 4, 8)), (4096, (4, 2, 8)), (8192, (4, 4, 8)), (None, (4, 2, 8))]


def tile_for(K: int) -> tuple[int, int, int]:
    """(block_n, num_warps, vec) for a layer of K inputs, from TILES_BY_K."""
    return next(tile for bound, tile in TILES_BY_K if bound is None or K <= bound)


def matvec_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     swiglu: bool = False) -> torch.Tensor:
    """x [..., K] -> x @ weight.T + bias [..., N], weight [N, K] (nn.Linear's layout). swiglu: x is gate_up
    [..., 2K] (gate, then up) and the product is taken with silu(gate) * up, as `MLP` computes it."""
    return F.linear(silu_and_mul_reference(x) if swiglu else x, weight, bias)


@triton.jit
def _matvec_kernel(X, W, BIAS, OUT, N, K, stride_wn,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                   SWIGLU: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    """Program p: outputs [p * BLOCK_N, (p + 1) * BLOCK_N) of y = W x, BLOCK_K inputs a step.
    EVEN: N a multiple of BLOCK_N and K of BLOCK_K (no masks). SWIGLU: x = silu(X[:K]) * X[K:2K].
    PDL: launched with programmatic dependent launch (kernels/pdl.py): the first weights load before the wait."""
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]  # [BLOCK_N, BLOCK_K]
    row_ok = rows[:, None] < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if EVEN:
        w_next = tl.load(w_ptrs)
    else:
        w_next = tl.load(w_ptrs, mask=row_ok & (cols[None, :] < K), other=0.0)
    if PDL:  # x is the kernel before's output
        gdc_wait()
    for k in range(0, K, BLOCK_K):
        w = w_next
        if EVEN:  # the next step's weights travel while this step multiplies (none past the end)
            w_next = tl.load(w_ptrs + k + BLOCK_K, mask=k + BLOCK_K + tl.zeros([1, BLOCK_K], tl.int32) < K, other=0.0)
        else:
            w_next = tl.load(w_ptrs + k + BLOCK_K, mask=row_ok & (k + BLOCK_K + cols[None, :] < K), other=0.0)
        k_ok = k + cols < K
        if SWIGLU:
            gate_raw = tl.load(X + k + cols, mask=k_ok, other=0.0)
            g = gate_raw.to(tl.float32)
            up = tl.load(X + K + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            if LIBDEVICE:  # as silu_and_mul computes it: exactly rounded division, accurate expf
                silu = libdevice.div_rn(g, 1.0 + libdevice.exp(-g))
            else:  # the CPU interpreter
                silu = g / (1.0 + tl.exp(-g))
            x = (silu.to(gate_raw.dtype).to(tl.float32) * up).to(gate_raw.dtype).to(tl.float32)
        else:
            x = tl.load(X + k + cols, mask=k_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]: the one reduction across threads
    if HAS_BIAS:
        y += tl.load(BIAS + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(OUT + rows, y.to(OUT.dtype.element_ty), mask=rows < N)


def _interpreted() -> bool:
    """True when the kernel was defined under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_matvec_kernel, triton.runtime.JITFunction)


def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False,
           block_n: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """One row through a linear layer in one Triton kernel: x [..., K] holding a single row -> [..., N].

    weight [N, K] (nn.Linear's layout, rows contiguous), bias [N] or None; x, weight and bias in one 16-bit
    or fp32 dtype, the result in it too. swiglu: x is gate_up [..., 2K] and the layer reads silu(gate) * up
    (see the module docstring). block_n and num_warps override the tile of `tile_for` (for sweeps).
    """
    width = 2 * weight.shape[-1] if swiglu and weight.dim() == 2 else weight.shape[-1]
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("matvec takes a tensor x [..., K] and a weight [N, K] (nn.Linear's layout).")
    if x.dim() == 0 or x.numel() != x.shape[-1] or x.shape[-1] != width:
        raise ValueError(f"matvec multiplies one row: x must be [..., {width}] with every other dim 1 "
                         f"(weight {tuple(weight.shape)}{', swiglu: gate then up' if swiglu else ''}), "
                         f"got {tuple(x.shape)}. Use F.linear (or matvec_reference) for several rows.")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype) or x.dtype not in (
            torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x, weight and bias must share one dtype of float16, bfloat16 or float32, got "
                         f"{x.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}.")
    if x.device.type != "cuda" and not _interpreted():
        raise ValueError(f"matvec needs CUDA tensors, got {x.device}. Move them with .cuda(), set "
                         "TRITON_INTERPRET=1 before importing triton, or call matvec_reference.")
    N, K = weight.shape
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    row = x.reshape(-1)
    row = row if row.stride(0) == 1 else row.contiguous()
    out = torch.empty(N, dtype=x.dtype, device=x.device)
    default_n, default_warps, vec = tile_for(K)
    block_n = default_n if block_n is None else block_n
    num_warps = default_warps if num_warps is None else num_warps
    block_k = min(vec * 32 * num_warps, triton.next_power_of_2(K))
    pdl = use_pdl(row)
    options = {} if _interpreted() else {"num_warps": num_warps, **launch_options(pdl)}
    _matvec_kernel[(triton.cdiv(N, block_n),)](
        row, weight, weight if bias is None else bias, out, N, K, weight.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN=N % block_n == 0 and K % block_k == 0, HAS_BIAS=bias is not None,
        SWIGLU=swiglu, LIBDEVICE=not _interpreted(), PDL=pdl, **options,
    )
    return out.view(*x.shape[:-1], N)
