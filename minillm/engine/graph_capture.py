"""Recording CUDA graphs, one per size, for the graph runners of decode and mixed steps (chapter 05).

`minillm.engine.cuda_graphs.DecodeGraphs` (a batch size per graph) and `minillm.engine.mixed_graphs.MixedGraphs` (a
token count per graph) record their steps the same way: each size once for warm-up, then every size captured,
largest first, into one shared memory pool, with the garbage collector held off.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence

import torch


def record_graphs(sizes: Sequence[int], step: Callable[[int], torch.Tensor]
                  ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
    """One CUDA graph of step(size) per size, largest first, in one memory pool (only one replays at a time) ->
    (graphs, their output tensors) by size. Each size runs once first, off the default stream as capture requires:
    that compiles the Triton kernels and creates cuBLAS's handles, so that nothing new happens inside a capture."""
    graphs, outputs, pool, stream = {}, {}, None, torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for size in sizes:
            step(size)
    torch.cuda.current_stream().wait_stream(stream)
    # No garbage collection during capture: collecting a dead object that holds graphs or CUDA memory
    # (another engine's, say) frees them mid-capture, which CUDA forbids. They wait for later.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for size in reversed(sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[size] = step(size)
            pool = graph.pool()
            graphs[size] = graph
    finally:
        if collecting:
            gc.enable()
    return graphs, outputs
