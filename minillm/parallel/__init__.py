"""Scale-out over several processes and GPUs with `torch.distributed` (chapter 08).

    minillm.parallel.tensor     tensor parallelism: every layer split across ranks, two all-reduces a layer
    minillm.parallel.pipeline   pipeline parallelism: the layers split into stages, micro-batches flowing through
    minillm.parallel.workers    where a group's worker processes meet (a free port) and how they are stopped

Import the submodule you need; this package imports nothing itself (torch.distributed stays unloaded until
a parallel engine is built).
"""
