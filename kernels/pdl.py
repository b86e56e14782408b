"""Programmatic dependent launch (PDL): a kernel starts while the kernel before it finishes (chapter 05, issue 30).

A CUDA graph takes the CPU out of the decode step, but the GPU still runs its kernels one after the other: the
next kernel's programs are placed on the SMs only once the last program of the one before has exited and its
writes are flushed. Measured in the batch-1 graph of Llama-3.2-1B's shape on an H200 (152 kernels a step,
results/engine_step_profile_cuda_greedy.json), the GPU sat idle for about 1.1 us between kernels: 169 of the
step's 1,200 us. Each kernel also starts with its first loads in flight and nothing else to do.

Hopper (sm_90) and later GPUs let a kernel launched with the PDL attribute (Triton: `launch_pdl=True`) begin
as soon as every program of the kernel before it has called `gdc_launch_dependents` (or exited), before that
kernel has finished. Such a kernel must call `gdc_wait` before it reads anything the kernel before wrote, or
writes anything that kernel reads: the wait returns once the kernel before has finished and its writes are
visible. What it does before the wait must depend on nothing earlier kernels write, such as loading weights.

minillm's kernels of the batch-1 decode step (`matvec`, `fused_add_rms_norm`, `fused_rotary`, and the decode
attention's two) each take `PDL` as a compile-time flag and, with it, signal their dependents first thing, then
wait before their first read of activations (the matrix-vector kernel starts its first weight loads before it
waits). A kernel launched after one that never signals (cuBLAS, PyTorch's) simply starts when that one ends,
as without PDL.

`use_pdl(t)`: launch with PDL on t's device? CUDA, compute capability 9 or more, a Triton that has the
instructions, and not MINILLM_PDL=0 (benchmarks/matvec.py --sweep pdl measures it both ways).
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton 3.4+: the griddepcontrol instructions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton: no PDL (kernels read these names only under PDL=True)
    gdc_launch_dependents = gdc_wait = None

__all__ = ["gdc_launch_dependents", "gdc_wait", "launch_options", "use_pdl"]


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether minillm's kernels on t's device launch with programmatic dependent launch (see the module)."""
    return (t.is_cuda and gdc_wait is not None and os.environ.get("MINILLM_PDL", "1") != "0"
            and _capable(t.device.index if t.device.index is not None else torch.cuda.current_device()))


def launch_options(pdl: bool) -> dict:
    """The launch keywords for a kernel launched with (or without) PDL."""
    return {"launch_pdl": True} if pdl else {}
