"""SwiGLU's activation, silu(gate) * up, in one Triton kernel, and the PyTorch it replaces (issue 16).

minillm's `MLP` computes one matrix product for gate and up together, [..., 2F], then

    gate, up = gate_up.chunk(2, dim=-1)       two views: no kernel, no copy
    hidden   = F.silu(gate) * up              silu(g) = g * sigmoid(g) = g / (1 + exp(-g))

which is two elementwise kernels. For R rows of a 2-byte dtype, `F.silu` reads the gate and writes
a temporary (4RF bytes) and the multiply reads the temporary and up and writes the result (6RF):
10RF bytes, two launches and a temporary the size of the output. The fused kernel reads gate and up
once and writes the result once: 6RF bytes, 40% less traffic, one launch and no temporary. Like
every elementwise step its speed is set by memory bandwidth (and, in decode, by the launch).

Rounding. The kernel reproduces PyTorch's two operations rather than computing in fp32 and rounding
once: silu is computed in fp32 as g / (1 + exp(-g)), with an exactly rounded division and CUDA's
accurate expf from libdevice (PyTorch's silu kernel computes that same formula in fp32; Triton's
plain `/` and `tl.exp` are faster approximations), then rounded to the input dtype as `F.silu`
rounds its output; the product of that rounded value and up is taken in fp32 and rounded once, as
PyTorch's multiply rounds. On a GPU the kernel and `silu_and_mul_reference` should agree to the last
bit, or within an ulp where libdevice's expf and PyTorch's exp differ (on an H100, with Triton 3.6
and PyTorch 2.11, they agreed on every element in fp32, fp16 and bf16). Under the CPU interpreter
NumPy computes exp, and fp32 -> bf16 rounds toward zero, so bf16 there may differ by an ulp or two.

One program handles one row's block of BLOCK output columns; rows may be strided (a slice of a wider
matrix), the last dim contiguous (else it is copied first). tests/kernels/test_fused_kernels.py checks the
kernel against the reference through Triton's CPU interpreter (and on a GPU where there is one).
"""

# ruff: noqa: N803 - Triton kernels name compile-time constants and pointers in capitals (BLOCK, GATE_UP)

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation as minillm's `MLP` computes it: gate_up [..., 2F] -> silu(gate) * up [..., F].

    gate is the first F columns and up the last F (`chunk(2, dim=-1)`); the result is in gate_up's dtype.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(
    GATE_UP, OUT, stride_in, stride_out, n_cols,
    BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """One program = BLOCK columns of one row: read gate and up once, write silu(gate) * up once."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    gate_raw = tl.load(GATE_UP + row * stride_in + cols, mask=inside, other=0.0)
    up = tl.load(GATE_UP + row * stride_in + n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    g = gate_raw.to(tl.float32)
    if LIBDEVICE:  # exactly rounded division and accurate expf, as PyTorch's CUDA silu computes
        silu = libdevice.div_rn(g, 1.0 + libdevice.exp(-g))
    else:  # the CPU interpreter: NumPy's fp32 exp and division
        silu = g / (1.0 + tl.exp(-g))
    silu = silu.to(gate_raw.dtype).to(tl.float32)  # rounded, as F.silu's output is
    tl.store(OUT + row * stride_out + cols, (silu * up).to(gate_raw.dtype), mask=inside)  # the product, rounded


def _interpreted() -> bool:
    """True when the kernel was defined under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_silu_and_mul_kernel, triton.runtime.JITFunction)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one Triton kernel (issue 16): gate_up [..., 2F] -> [..., F], a new contiguous tensor.

    gate is the first F columns and up the last F, as `MLP` splits them; float16, bfloat16 or float32,
    the result in the same dtype. Rows may be strided; the last dim must be contiguous (else it is
    copied). Equals `silu_and_mul_reference`, rounding for rounding (see the module docstring).
    """
    if not isinstance(gate_up, torch.Tensor):
        raise ValueError("gate_up must be a torch tensor.")
    if gate_up.dim() == 0 or gate_up.shape[-1] == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2F], gate then up along the last dim (an even, nonzero width), "
                         f"got {tuple(gate_up.shape)}.")
    if gate_up.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"gate_up must be float16, bfloat16 or float32, got {gate_up.dtype}.")
    if gate_up.device.type != "cuda" and not _interpreted():
        raise ValueError(f"silu_and_mul needs a CUDA tensor, got {gate_up.device}. Move it with .cuda(), set "
                         "TRITON_INTERPRET=1 before importing triton, or call silu_and_mul_reference.")

    n_cols = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * n_cols)  # a view where the strides allow
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows = x.shape[0]
    out = torch.empty((rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        BLOCK = min(1024, triton.next_power_of_2(n_cols))  # 8 columns per thread of 4 warps (16 bytes in bf16)
        interpreted = _interpreted()
        options = {} if interpreted else {"num_warps": 4}
        _silu_and_mul_kernel[(rows, triton.cdiv(n_cols, BLOCK))](
            x, out, x.stride(0), out.stride(0), n_cols,
            BLOCK=BLOCK, LIBDEVICE=not interpreted, **options,
        )
    return out.view(*gate_up.shape[:-1], n_cols)
