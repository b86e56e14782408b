"""Programmatic dependent launch (PDL): a kernel starts while the kernel before it finishes (chapter 05, issue 30).

A CUDA graph takes the CPU out of the decode step, but the GPU still runs its kernels one after the other: the
next kernel's programs are placed on the SMs only once the last program of the one before has exited and its
writes are flushed. Each kernel starts with its first loads in flight and nothing else to do, and ends with its
last programs finishing while most SMs wait. In the batch-1 graph of Llama-3.2-1B's shape (152 kernels a step),
an H200 under torch.profiler sat idle for about 1.1 us between kernels (results/engine_step_profile/cuda.json).

Hopper (sm_90) and later GPUs let a kernel launched with the PDL attribute (Triton: `launch_pdl=True`) begin
as soon as every program of the kernel before it has called `gdc_launch_dependents` (or exited), before that
kernel has finished. Such a kernel must call `gdc_wait` before it reads anything an earlier kernel wrote, and
before it writes anything an earlier kernel may still read: the wait returns once the kernel before has finished
and its writes are visible (and, every program of every such kernel waiting before it exits, every kernel before
that one too). What it does before the wait must depend on nothing earlier kernels write, such as loading weights.

minillm's kernels of the decode step (`matvec`, `fused_add_rms_norm`, `fused_rotary`, and the decode
attention's two) each take `PDL` as a compile-time flag and, with it, signal their dependents first thing, then
wait before their first read of activations (the matrix-vector kernel's first weights, the norm's weight and
rotary's frequencies load before the wait; decode attention's two wait at once). A kernel launched after one
that never signals (cuBLAS, PyTorch's) simply starts when that one ends, as without PDL.

Measured (H200, results/matvec/cuda_pdl.json, benchmarks/matvec.py --sweep pdl): the batch-1 replay 1.000 ->
0.908 ms at Llama-3.2-1B's shape and 4.482 -> 4.305 ms at Llama-3-8B's, about 0.6 us per kernel at both.

Only inside `launches()`, which `minillm.engine.cuda_graphs.DecodeGraphs` wraps around its warm-up and capture.
A kernel's loads before its wait are safe only if the kernel launched just before it cannot be writing what they
read. In the model's decode step that holds: the kernel before one of ours is a kernel of the step (embedding,
cuBLAS, ours), and none of them writes weights, norm scales or frequencies. A kernel called on its own, right
after the weights were made on the GPU (`torch.randn(..., device="cuda").bfloat16()` in a test, say), could race
with that conversion; outside `launches()` our kernels launch as before.

`use_pdl(t)`: launch with PDL on t's device? Inside `launches()`, CUDA, compute capability 9 or more, a Triton
that has the instructions, and not MINILLM_PDL=0.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator

import torch

try:  # a Triton with the griddepcontrol instructions (3.6 and 3.9 have them)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton: no PDL (kernels read these names only under PDL=True)
    gdc_launch_dependents = gdc_wait = None

__all__ = ["gdc_launch_dependents", "gdc_wait", "launch_options", "launches", "use_pdl"]

_state = threading.local()  # .depth: how many `launches()` this thread is inside


@contextlib.contextmanager
def launches() -> Iterator[None]:
    """Within: minillm's kernels launch with PDL where `use_pdl` allows (see the module docstring for why only here)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether minillm's kernels on t's device launch with programmatic dependent launch (see the module)."""
    return (getattr(_state, "depth", 0) > 0 and t.is_cuda and gdc_wait is not None
            and os.environ.get("MINILLM_PDL", "1") != "0"
            and _capable(t.device.index if t.device.index is not None else torch.cuda.current_device()))


def launch_options(pdl: bool) -> dict:
    """The launch keywords for a kernel launched with (or without) PDL."""
    return {"launch_pdl": True} if pdl else {}
