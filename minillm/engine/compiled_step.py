"""The CPU's compiled decode step: exported once, compiled ahead of time, called with no Python inside (chapter 02).

`DecodeGraphs(capture=False, compile=True)` runs the decode step as a `CompiledStep`: the step (a module over
the step's input rows and the KV pools) is traced once by `torch.export`, and AOTInductor compiles the traced
graph into a shared library of C++ loops and library calls (`torch._inductor.aoti_compile_and_package`). It is
the CPU's counterpart of a CUDA graph: one call runs the whole step, with nothing in Python between the ~70
loops and matrix products. It is compiled once per model, thread count and KV-cache layout, for batch 1 and
again for larger batches (`DecodeGraphs.compiled_step`), in 14-22 s for the shipped model on this book's CPU.

Why not `torch.compile`, which compiles the same graph with the same Inductor? Because every call of a
`torch.compile`d function first runs Python: Dynamo checks its guards (484 here: is this still the same model,
the same shapes, the same global state?), gathers the ~50 weights and pools the graph takes from the objects
they live on, and wraps the call. Timed ad hoc on this book's 2-core CPU (not in a results file), that was
0.22-0.29 ms of a 1.8-3.0 ms step of the shipped model, and the ahead-of-time step ran faster still (2.34
against 2.79 ms at one thread, for reasons we have not found); the benchmark's A/B is in
`results/cpu_decode_cpu_ab_*.json`. The exported step takes its weights once, as constants (our own tensors,
not copies: `user_managed`), and checks nothing per call. `DecodeGraphs` checks once per engine the weights
(the same tensors), the pools' layout and the thread count; the input sizes are right by construction (it cuts
them from its own buffer), and nothing checks them per call.

One change to how Inductor lowers it: at batch 1 every linear layer is a matrix-vector product, and the time
of a step is the time to stream the weights through it. Inductor hands each product to PyTorch's own kernels
(`aten.mm`), which stream fp32 weights at about 21 GB/s on one core of this book's CPU but bf16 weights at
only about 9 GB/s (`matvec_1_thread` in `results/cpu_decode_cpu.json`): half the bytes, yet slower than fp32.
So for 16-bit weights and one row, we lower the product ourselves, as what it is: for each output, a sum over
the inputs of x[k] * w[n, k], each weight widened to fp32 as it is read. Written as a multiply and a sum,
Inductor generates that loop itself in C++ with vector instructions, reading the weights once in their own 16
bits: on this book's CPU, 1.4x the tokens/s of the bf16 step through `aten.mm`. Larger batches, fp32 weights
and the int8 kernel keep PyTorch's kernels: lowered this way, our fp32 and int8 steps measured slower.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest.mock import patch

import torch

log = logging.getLogger("minillm")
aten = torch.ops.aten
HALF = (torch.bfloat16, torch.float16)


def matvec_as_reduction(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """aten.mm(a [1, K], b [K, N]) for 16-bit b, as sum_k a[0, k] * b[k, n] in fp32 -> [1, N] in a's dtype.

    Returns NotImplemented (Inductor then lowers aten.mm as usual) for anything else: more than one row, a
    batch size not known at compile time, or fp32 weights.
    """
    rows = a.shape[0]
    if out_dtype is not None or not isinstance(rows, int) or rows != 1 or b.dtype not in HALF:
        return NotImplemented
    return (a.float()[:, None, :] * b.t().float()[None]).sum(-1).to(a.dtype)  # [1, N, K] summed over K


@contextmanager
def _matvec_lowering() -> Iterator[None]:
    """Inductor's decompositions, with `aten.mm` lowered by `matvec_as_reduction` where it applies."""
    from torch._inductor import decomposition

    with patch.dict(decomposition.decompositions, {aten.mm.default: matvec_as_reduction}):
        yield


class CompiledStep:
    """`module`'s forward, exported with `torch.export` and compiled ahead of time by AOTInductor.

    Args:
        module: the step; its parameters and buffers become the compiled graph's constants, used in place
            (the compiled step reads the module's own tensors: replace them, and compile again).
        args: example arguments, all tensors (the step's inputs, then the pools).
        dynamic_shapes: for each argument of forward, {dim: torch.export.Dim} of the dimensions that may
            change between calls (a tuple of them for *args); every other size is fixed at its example's.

    Call it with a list of tensors in the order of `args`, of the sizes `dynamic_shapes` allows: nothing
    checks them (a wrong size reads or writes out of bounds), so the caller must. Returns the module's
    output tensor. Compiling takes seconds (14-22 s for the shipped model on this book's CPU).
    """

    compiles = 0  # how many steps this process has compiled (tests count them)

    def __init__(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...],
                 dynamic_shapes: tuple[Any, ...]) -> None:
        start = time.perf_counter()
        configs = {"aot_inductor.package_constants_in_so": False}  # the weights: ours, given below
        if any(t.dtype in HALF for t in module.parameters()):
            # Inductor's on-disk cache of compiled graphs does not tell decompositions apart: for 16-bit
            # weights, whose lowering differs, compile afresh rather than reuse a graph compiled without ours.
            configs["fx_graph_cache"] = False
        with (warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="minillm-step-") as folder,
              _matvec_lowering()):
            # (PyTorch pickles the traced program with a call it has itself deprecated: its warning, not ours)
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            with torch.inference_mode():
                program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
            path = torch._inductor.aoti_compile_and_package(
                program, package_path=os.path.join(folder, "step.pt2"), inductor_configs=configs)
            compiled = torch._inductor.aoti_load_package(path)
        tensors = dict(module.named_parameters(remove_duplicate=False))
        tensors.update(module.named_buffers(remove_duplicate=False))
        compiled.load_constants({name: tensors[name] for name in compiled.get_constant_fqns()},
                                check_full_update=True, user_managed=True)
        self.run = compiled.loader.boxed_run  # [tensors] -> [outputs]; empties the list it is given
        CompiledStep.compiles += 1
        self.seconds = time.perf_counter() - start
        log.info("compiled the decode step ahead of time in %.1f s", self.seconds)

    def __call__(self, args: list[torch.Tensor]) -> torch.Tensor:
        return self.run(list(args))[0]
