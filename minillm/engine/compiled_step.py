"""The CPU's compiled decode step: `torch.compile` with one change to how Inductor lowers it (chapter 02).

`DecodeGraphs(capture=False, compile=True)` runs the decode step through `torch.compile` (Inductor), the
CPU's counterpart of a CUDA graph. At batch 1 every linear layer is a matrix-vector product, and the time
of a step is the time to stream the weights through it. Inductor hands each product to PyTorch's own
kernels (`aten.mm`), which stream fp32 weights at about 21 GB/s on one core of this book's CPU but
bf16 weights at only about 9 GB/s (`matvec_1_thread` in `results/cpu_decode_cpu.json`): half the
bytes, yet slower than fp32.

So for 16-bit weights and one row, we lower the product ourselves, as what it is: for each output, a sum
over the inputs of x[k] * w[n, k], each weight widened to fp32 as it is read. Written as a multiply and a
sum, Inductor generates that loop itself in C++ with vector instructions, reading the weights once in
their own 16 bits: on this book's CPU, 1.4x the tokens/s of the bf16 step through `aten.mm`. Larger batches,
fp32 weights and the int8 kernel keep PyTorch's kernels: lowered this way, our fp32 and int8 steps measured
slower than through them.

One more setting: Inductor's `cpp_wrapper`. By default the compiled step is a generated Python function that
calls its ~70 loops and library kernels one by one, each call with a few Python lines around it (views of the
buffers, size checks); with `cpp_wrapper` that function is generated in C++ instead. On this book's 2-core CPU
the shipped model's fp32 step gained 7-9% from it, at a few seconds more compile (measured once with an ad-hoc
script, variants alternated in one process; not in a results file).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

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


def _inductor(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> Callable:
    """Inductor, with the matrix-vector products of 16-bit weights lowered by `matvec_as_reduction`."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    decompositions = {**select_decomp_table(), aten.mm.default: matvec_as_reduction}
    half = any(isinstance(t, torch.Tensor) and t.dtype in HALF for t in example_inputs)
    # Inductor's on-disk cache of compiled graphs does not tell decompositions apart: for 16-bit models, whose
    # lowering differs, compile afresh rather than reuse a graph compiled without ours.
    patches = {"cpp_wrapper": True}  # the step's calls made from generated C++, not Python (see above)
    if half:
        patches["fx_graph_cache"] = False
    return compile_fx(gm, example_inputs, decompositions=decompositions, config_patches=patches)


def compile_step(fn: Callable) -> Callable:
    """`fn` through torch.compile with Inductor and `matvec_as_reduction`."""
    return torch.compile(fn, backend=_inductor)
