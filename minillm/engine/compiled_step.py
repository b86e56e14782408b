"""The CPU's compiled decode step: exported once, compiled ahead of time, called with no Python inside (chapter 02).

`CompiledDecode` runs the decode step as a `CompiledStep`: the step (`DecodeStep`, a module over the step's
input rows and the KV pools) is traced once by `torch.export`, and AOTInductor compiles the traced
graph into a shared library of C++ loops and library calls (`torch._inductor.aoti_compile_and_package`). It is
the CPU's counterpart of a CUDA graph: one call runs the whole step, with nothing in Python between the ~70
loops and matrix products. It is compiled once per model, thread count and KV-cache layout, for batch 1 and
again for larger batches (`CompiledDecode.compiled_step`), in 15-22 s for the shipped model on this book's CPUs,
then kept in the cache of compiled steps for later processes.

Why not `torch.compile`, which compiles the same graph with the same Inductor? Because every call of a
`torch.compile`d function first runs Python: Dynamo checks its guards (484 here: is this still the same model,
the same shapes, the same global state?), gathers the ~50 weights and pools the graph takes from the objects
they live on, and wraps the call. Timed ad hoc on this book's 2-core CPU (not in a results file), that was
0.22-0.29 ms of a 1.8-3.0 ms step of the shipped model, and the ahead-of-time step ran faster still (2.34
against 2.79 ms at one thread, for reasons we have not found); the benchmark's A/B is in
`results/cpu_decode/archive/cpu_decode_cpu_ab_*.json`. The exported step takes its weights once, as constants
(our own tensors, not copies: `user_managed`), and checks nothing per call. `CompiledDecode` checks once per
engine the weights (the same tensors), the pools' layout and the thread count; the input sizes are right by
construction (it cuts them from its own buffer), and nothing checks them per call.

One change to how Inductor lowers it: at batch 1 every linear layer is a matrix-vector product, and the time
of a step is the time to stream the weights through it. Inductor hands each product to PyTorch's own kernels
(`aten.mm`), which stream fp32 weights at about 21 GB/s on one core of this book's Intel CPU but bf16 weights at
only about 9 GB/s (`matvec_1_thread` in `results/cpu_decode/archive/cpu_decode_cpu.json`): half the bytes, yet
slower than fp32. So for 16-bit weights and one row, we lower the product ourselves, as what it is: for each
output, a sum over the inputs of x[k] * w[n, k], each weight widened to fp32 as it is read. Written as a multiply
and a sum, Inductor generates that loop itself in C++ with vector instructions, reading the weights once in
their own 16 bits: on the Intel CPU, 1.4x the tokens/s of the bf16 step through `aten.mm`. Which dtypes are
lowered this way is chosen per CPU type (`reduction_dtypes`): on the book's AMD EPYC, whose MKL streams fp32
weights at about 9-10 GB/s, fp32 is lowered too (compiled fp32 at 0.74x / 0.94x of llama.cpp F32 at one / two
threads in `results/cpu_decode/cpu.json`, 0.37x / 0.32x with MKL's products in
`results/cpu_decode/archive/cpu_decode_cpu_amd_matvec_library.json`); larger batches and the int8 kernel keep
PyTorch's kernels everywhere.

Compiled steps are kept on disk (`minillm.engine.compile_cache`): a later process loads one in milliseconds.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch

import minillm.engine.compile_cache as compile_cache
from minillm.engine.cuda_graphs import DecodeGraphs
from minillm.engine.kv_cache import PagedCacheView, PagedKVCache
from minillm.engine.step_inputs import TABLE
from minillm.model import Transformer

log = logging.getLogger("minillm")
aten = torch.ops.aten
HALF = (torch.bfloat16, torch.float16)


MATVEC_ENV = "MINILLM_CPU_MATVEC"  # auto | reduction | library: how the compiled step runs batch-1 products


def reduction_dtypes() -> frozenset[torch.dtype]:
    """The weight dtypes whose batch-1 products the compiled step lowers as reductions Inductor generates, rather
    than calling PyTorch's library kernels (MKL's sgemv, `aten._weight_int8pack_mm`), chosen by measurement per
    CPU type. On an Intel CPU, 16-bit weights only: there MKL's fp32 product and the int8 kernel were the faster.
    On any other (AMD), fp32 too: MKL's fp32 product streams 9-10 GB/s on this book's AMD EPYC, and the compiled
    fp32 step through it ran at half the tokens/s or less (the module's docstring cites both results files); the
    int8 kernel stays (640 tok/s against 525 lowered, timed ad hoc). `MINILLM_CPU_MATVEC=reduction` (every dtype, int8
    included) or `=library` (none) overrides the choice, for A/B runs."""
    choice = os.environ.get(MATVEC_ENV, "auto").strip().lower()
    everything = frozenset((torch.float32, *HALF, torch.int8))  # what the override "reduction" lowers
    if choice == "reduction":
        return everything
    if choice == "library":
        return frozenset()
    if choice != "auto":
        raise ValueError(f"{MATVEC_ENV}={choice!r}: use auto, reduction or library.")
    return frozenset(HALF) if compile_cache.cpu_vendor() == "GenuineIntel" else frozenset((torch.float32, *HALF))


def matvec_as_reduction(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """aten.mm(a [1, K], b [K, N]) as sum_k a[0, k] * b[k, n] in fp32 -> [1, N] in a's dtype, for weights of a dtype
    `reduction_dtypes()` names.

    Returns NotImplemented (Inductor then lowers aten.mm as usual) for anything else: more than one row, a
    batch size not known at compile time, or weights of another dtype.
    """
    rows = a.shape[0]
    if out_dtype is not None or not isinstance(rows, int) or rows != 1 or b.dtype not in reduction_dtypes():
        return NotImplemented
    return (a.float()[:, None, :] * b.t().float()[None]).sum(-1).to(a.dtype)  # [1, N, K] summed over K


def int8_matvec_as_reduction(a: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """aten._weight_int8pack_mm(a [1, K], codes [N, K] int8, scales [N]) as scales[n] * sum_k a[0, k] * codes[n, k]
    in fp32 -> [1, N] in a's dtype: each code widened as it is read, one byte a weight. NotImplemented (PyTorch's
    kernel) for more than one row or where int8 is not in `reduction_dtypes()`."""
    rows = a.shape[0]
    if not isinstance(rows, int) or rows != 1 or torch.int8 not in reduction_dtypes():
        return NotImplemented
    return ((a.float()[:, None, :] * codes.float()[None]).sum(-1) * scales.float()).to(a.dtype)


@contextmanager
def _matvec_lowering() -> Iterator[None]:
    """Inductor's decompositions, with batch-1 products lowered as reductions where `reduction_dtypes()` says."""
    from torch._inductor import decomposition

    lowered = {aten.mm.default: matvec_as_reduction, aten._weight_int8pack_mm.default: int8_matvec_as_reduction}
    with patch.dict(decomposition.decompositions, lowered):
        yield


def describe_inputs(args: tuple[torch.Tensor, ...], dynamic_shapes: tuple[Any, ...]) -> list[list[Any]]:
    """Each argument's dtype, shape and strides, a size that may change written as "name[min, max]" (its
    `torch.export.Dim`): what a compiled step was compiled for. `dynamic_shapes` as for `CompiledStep`."""

    def per_argument(shapes: Any) -> list[dict[int, Any]]:  # one {dim: Dim} per tensor, in the order of args
        if isinstance(shapes, (tuple, list)):
            return [dims for part in shapes for dims in per_argument(part)]
        return [shapes or {}]

    described = []
    for t, dims in zip(args, per_argument(dynamic_shapes), strict=True):
        shape = [f"{dims[i].__name__}[{dims[i].min}, {dims[i].max}]" if i in dims else n for i, n in enumerate(t.shape)]
        described.append([str(t.dtype), shape, list(t.stride())])
    return described


class NotCachedError(LookupError):
    """`CompiledStep(..., cached_only=True)` found no usable entry in the cache of compiled steps."""


class CompiledStep:
    """`module`'s forward, exported with `torch.export` and compiled ahead of time by AOTInductor, or loaded from
    the cache of compiled steps (`minillm.engine.compile_cache`) when an earlier process compiled the same step.

    Args:
        module: the step; its parameters and buffers become the compiled graph's constants, used in place
            (the compiled step reads the module's own tensors: replace them, and compile again).
        args: example arguments, all tensors (the step's inputs, then the pools).
        dynamic_shapes: for each argument of forward, {dim: torch.export.Dim} of the dimensions that may
            change between calls (a tuple of them for *args); every other size is fixed at its example's.

    cached_only: load the step from the cache or raise `NotCachedError`; never compile (the engine's background
    compile looks with it while the compile runs elsewhere).

    Call it with a list of tensors in the order of `args`, of the sizes `dynamic_shapes` allows: nothing
    checks them (a wrong size reads or writes out of bounds), so the caller must. Returns the module's
    output tensor. Compiling takes tens of seconds (15-24 s for the shipped model on this book's CPUs, `compile_s`
    in results/cpu_decode/cpu.json); loading a cached step, milliseconds (`cache_load_s`). `seconds` says how
    long this one took, and `from_cache` whether it was loaded.
    """

    compiles = 0  # how many steps this process has compiled (tests count them)
    loads = 0  # how many it has loaded from the cache

    def __init__(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...],
                 dynamic_shapes: tuple[Any, ...], cached_only: bool = False) -> None:
        start = time.perf_counter()
        configs: dict[str, Any] = {"aot_inductor.package_constants_in_so": False}  # the weights: ours, given below
        lowered = reduction_dtypes()
        if lowered:
            # Inductor's on-disk cache of compiled graphs does not tell decompositions apart: where our lowering
            # applies, compile afresh rather than reuse a graph compiled without it.
            configs["fx_graph_cache"] = False
        root = compile_cache.cache_root()
        description = compile_cache.describe_step(module, describe_inputs(args, dynamic_shapes), configs)
        description["matvec_reductions"] = sorted(str(dtype) for dtype in lowered)
        name = compile_cache.entry_name(description)
        run = compile_cache.load_entry(root, name, module, description) if root is not None else None
        self.from_cache = run is not None
        if run is None and cached_only:
            raise NotCachedError(name)
        if run is None:
            run = self.compile(module, args, dynamic_shapes, configs, root, name, description, start)
        else:
            CompiledStep.loads += 1
        self.run = run  # [tensors] -> [outputs]; empties the list it is given
        self.seconds = time.perf_counter() - start
        log.info("%s the decode step in %.1f s", "loaded" if self.from_cache else "compiled", self.seconds)

    @staticmethod
    def compile(module: torch.nn.Module, args: tuple[torch.Tensor, ...], dynamic_shapes: tuple[Any, ...],
                configs: dict[str, Any], root: Path | None, name: str, description: dict[str, Any],
                start: float) -> compile_cache.Runner:
        """Export and compile the step now, keep it in the cache (when there is one), and bind it to `module`."""
        with (warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="minillm-step-") as folder,
              _matvec_lowering()):
            # (PyTorch pickles the traced program with a call it has itself deprecated: its warning, not ours)
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            with torch.inference_mode():
                program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
            path = torch._inductor.aoti_compile_and_package(
                program, package_path=os.path.join(folder, compile_cache.PACKAGE), inductor_configs=configs)
            CompiledStep.compiles += 1
            if root is not None:
                compile_cache.store_entry(root, name, Path(path), description, time.perf_counter() - start)
            return compile_cache.bind(Path(path), module)

    def __call__(self, args: list[torch.Tensor]) -> torch.Tensor:
        return self.run(list(args))[0]


class DecodeStep(torch.nn.Module):
    """The decode step as a module for `torch.export`: the model over rows `inputs` [B, TABLE + blocks] (one token
    each, as `PagedCacheView.of_decode_rows` reads them), with the KV pools as arguments, not as attributes of one
    cache, so that one compiled step serves every cache of the same layout. Returns logits [B, vocab].

    `pools`: `PagedKVCache.all_pools()`: every layer's K pool, then every layer's V pool, then (8-bit caches) the K
    and V scale pools.
    """

    def __init__(self, model: Transformer, block_size: int, dtype: torch.dtype, n_layers: int,
                 quantized: bool) -> None:
        super().__init__()
        self.model, self.block_size, self.dtype, self.n_layers, self.quantized = (model, block_size, dtype,
                                                                                  n_layers, quantized)

    def layer_pools(self, layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """What `PagedKVCache.layer_pools` gives, from the pools of this call."""
        k, v = self._pools[layer], self._pools[self.n_layers + layer]
        if not self.quantized:
            return (k, None), (v, None)
        return (k, self._pools[2 * self.n_layers + layer]), (v, self._pools[3 * self.n_layers + layer])

    def forward(self, inputs: torch.Tensor, *pools: torch.Tensor) -> torch.Tensor:
        self._pools = pools
        key_range = (inputs.shape[1] - TABLE) * self.block_size
        view = PagedCacheView.of_decode_rows(self, inputs, key_range, in_pytorch=True)  # PyTorch, for Inductor to fuse
        return self.model(view.tokens, view.position_ids, cache=view, last_only=True)[:, -1]


def decode_step_shapes(many: bool, max_blocks: int, n_pools: int) -> tuple[Any, ...]:
    """`dynamic_shapes` of `DecodeStep.forward(inputs, *pools)`: the pools' block count always; the rows' count for
    the step of batches above 1; the tables' width where a table can span more than two blocks."""
    blocks = torch.export.Dim("blocks", min=2)  # pools vary with the engine (generate sizes its pool)
    rows_shape = {0: torch.export.Dim("batch", min=2)} if many else {}  # 2 .. any: 1 is the other step
    if max_blocks > 2:  # the tables' width: the step's longest sequence
        rows_shape[1] = torch.export.Dim("width", min=TABLE + 2, max=TABLE + max_blocks)
    return rows_shape, tuple({0: blocks} for _ in range(n_pools))


STANDIN_BLOCKS = 7  # the pools' block count in a background compile's example inputs


class BackgroundCompile:
    """A decode step compiled by a process of its own (`python -m minillm.engine.compile_ahead --job FILE`) into the
    cache of compiled steps, while this process decodes eagerly. The job (the step, with the model, and its example
    inputs) is saved to a file the process reads; the process runs in a session of its own, so that it finishes
    and keeps the step for later processes even if this one exits or is interrupted first."""

    started = 0  # how many this process has started (tests and the CLI read it)

    def __init__(self, step: DecodeStep, args: tuple[torch.Tensor, ...], many: bool, max_blocks: int) -> None:
        import subprocess
        import sys

        folder = Path(tempfile.mkdtemp(prefix="minillm-compile-job-"))
        self.job, self.log = folder / "job.pt", folder / "compile.log"
        # The pools' block count is a dynamic size: the job gets pools of a few blocks (their shape beyond it and
        # their dtype are what the step is compiled for), not copies of this engine's whole cache. (7: a count
        # no other example size shares, which torch.export would take for the same size.)
        inputs, pools = args[0], args[1:]
        standins = tuple(pool.new_zeros((STANDIN_BLOCKS, *pool.shape[1:])) for pool in pools)
        torch.save({"step": step, "args": (inputs, *standins), "many": many, "max_blocks": max_blocks,
                    "threads": torch.get_num_threads()}, self.job)
        with open(self.log, "wb") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "minillm.engine.compile_ahead", "--job", str(self.job)],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        BackgroundCompile.started += 1
        log.info("compiling the decode step in the background (process %d); decoding eagerly until it is done",
                 self.process.pid)

    def done(self) -> bool:
        """Whether the process has ended (a wait of no time: called once a decode step)."""
        return self.process.poll() is not None

    def failure(self) -> str | None:
        """None if the process succeeded, else its exit status and the end of its log."""
        if self.process.returncode == 0:
            return None
        return f"status {self.process.returncode}: {self.log.read_text(errors='replace')[-1500:]}"


class CompiledDecode(DecodeGraphs):
    """Decode steps on a CPU, run as a step compiled ahead of time over `DecodeGraphs`' fixed buffers (chapter 02).

    The CPU's counterpart of a CUDA graph. The step (`DecodeStep`) is pure tensor work over the input rows and the
    pools (the bookkeeping stays outside it); `torch.export` traces it once and AOTInductor compiles it to C++
    loops and library calls (`CompiledStep`), once for batch 1 and once for larger batches, shared by the model's
    engines, and kept in the cache of compiled steps for later processes. The block tables' width is a dynamic
    dimension, so attention reads only the keys the step's longest sequence holds. Same arguments as
    `DecodeGraphs`, without `capture`, and:

    background: where the cache lacks a step, compile it in a process of its own (`BackgroundCompile`) and run
        the same step eagerly (`DecodeStep` itself, over the same buffers) until the compiled one is in the cache;
        without it, the first decode step waits for the compile (tens of seconds).
    """

    # Compiled steps, per model: {layout: (the model's tensors then, CompiledStep)}. Each is compiled (or loaded)
    # once per process, for batch 1 or for any batch above 1, and shared by every engine of the model (`generate`
    # makes one per call) while the model's weights are the same tensors, the pools of the same layout, and the
    # thread count the same (Inductor's loops are built for the count they were compiled under).
    compiled_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    # Background compiles under way, per model: {layout: BackgroundCompile}.
    background_jobs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    # The rows are the buffer cut to the step's widest table. One spare column keeps the cut narrower than a row at
    # every width: a cut of whole rows is contiguous, which the traced code treats as a case of its own, and
    # torch.export refuses a dynamic width that could reach it ("width != max").
    spare_columns = 1

    def __init__(self, model: Transformer, cache: PagedKVCache, max_batch: int,
                 max_seq_len: int | None = None, background: bool = False) -> None:
        super().__init__(model, cache, max_batch, max_seq_len, capture=False)
        self.pools = cache.all_pools()  # the compiled step's inputs, after the rows
        self.steps: dict[bool, Callable[[list[torch.Tensor]], torch.Tensor]] = {}  # batch > 1 -> compiled step
        self.background = background and compile_cache.cache_root() is not None  # (a job needs the cache)
        self.eager = self.decode_step()  # the step uncompiled, while a background compile runs
        self.waiting: dict[bool, BackgroundCompile] = {}  # batch > 1 -> the background compile it waits for

    def decode_step(self) -> DecodeStep:
        return DecodeStep(self.model, self.cache.block_size, self.cache.dtype, len(self.cache.k), self.cache.quantized)

    def longest_sequence(self, max_seq_len: int | None) -> int:
        """Tables as wide as the model's context whatever the pool, so that the compiled step fits every engine."""
        ctx = self.model.config.max_seq_len
        return min(max_seq_len or ctx, ctx)

    def compiled_step(self, size: int) -> Callable[[list[torch.Tensor]], torch.Tensor] | None:
        """The compiled step for a batch of `size` rows (one for batch 1, one for any larger batch): found among
        those this process holds for the model, or loaded from the cache, or compiled now (tens of seconds). With
        `background`, None while the step compiles in a process of its own."""
        many = size > 1
        if many in self.steps:
            return self.steps[many]
        waiting = self.waiting.get(many)
        if waiting is not None and not waiting.done():  # decode steps while it compiles: nothing more to look up
            return None
        tensors = [(name, t.data_ptr(), t.dtype, t.shape) for name, t in (*self.model.named_parameters(),
                                                                           *self.model.named_buffers())]
        layout = (many, torch.get_num_threads(), self.cache.block_size, self.inputs.shape[1],
                  tuple((pool.dtype, pool.shape[1:]) for pool in self.pools))
        known = CompiledDecode.compiled_steps.setdefault(self.model, {})
        if layout not in known or known[layout][0] != tensors:
            args = (self.inputs[: 2 if many else 1, : TABLE + 2], *self.pools)
            shapes = decode_step_shapes(many, self.max_blocks, len(self.pools))
            step = self.step_in_background(layout, args, shapes) if self.background else None
            if step is None and self.background:
                return None
            known[layout] = (tensors, step or CompiledStep(self.decode_step(), args, shapes))
        self.steps[many] = known[layout][1]
        return self.steps[many]

    def step_in_background(self, layout: tuple, args: tuple[torch.Tensor, ...], shapes: tuple[Any, ...]
                           ) -> CompiledStep | None:
        """The step from the cache if it is there, else None, with a background compile of it started (or still
        running). A compile that failed is logged, and the background given up: the caller compiles here."""
        jobs = CompiledDecode.background_jobs.setdefault(self.model, {})
        job = jobs.get(layout)
        if job is not None and not job.done():
            self.waiting[layout[0]] = job
            return None
        try:
            return CompiledStep(self.decode_step(), args, shapes, cached_only=True)
        except NotCachedError:
            if job is None:
                jobs[layout] = self.waiting[layout[0]] = BackgroundCompile(self.decode_step(), args, layout[0],
                                                                            self.max_blocks)
                return None
            log.warning("the background compile of the decode step did not give a cached step (%s); compiling "
                        "it in this process", job.failure() or "its entry is not in the cache")
            self.background = False
            return None

    def replay(self, size: int, width: int, n: int) -> torch.Tensor:
        """The compiled step over the rows cut to this step's widest table, so that attention reads only the keys
        it covers. Tables of one block read two (a compiled size of 1 would be fixed, not free): the second
        column's stale block id is masked. While the step compiles in the background, the same step eagerly."""
        inputs = self.inputs[:size, : max(width, TABLE + 2)]
        step = self.compiled_step(size)
        if step is None:
            with leave_a_core():
                return self.eager(inputs, *self.pools)[:n]
        return step([inputs, *self.pools])[:n]


@contextmanager
def leave_a_core() -> Iterator[None]:
    """PyTorch at one thread fewer (not below one) inside, for eager steps beside a background compile: on this
    book's 2-core CPU, two OpenMP threads beside the compiler slowed an eager step 20x (5-8 tok/s; a thread that
    waits for a busy core stalls the whole matmul), one thread kept it at 125-142 tok/s of 145."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))
    try:
        yield
    finally:
        torch.set_num_threads(threads)
