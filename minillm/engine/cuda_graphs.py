"""Decode steps replayed as CUDA graphs: the GPU fast path (chapter 02 measures why it is needed).

A decode step of a Llama-3.2-1B-shaped model reads 2.5 GB of weights, about 0.8 ms at an H100's
copy bandwidth, but eager PyTorch issues it as several hundred kernels, each launched from Python at
a few microseconds of CPU time, and many of them tiny (a norm, a rotary, an add on one token's
activations). The GPU then waits on the CPU: minillm's eager decode of that model ran at 4% of the
bandwidth roofline (`results/roofline_cuda.json` has the numbers).

A CUDA graph records every kernel of one step, with its arguments, once (`torch.cuda.CUDAGraph`), and
replays the whole recording with one launch. A recording is of fixed pointers and fixed shapes, so:

  * **static shapes**: one graph per batch size. We capture a few sizes (`graph_batch_sizes`: 1, 2, 4,
    then every multiple of 8, as vLLM does) and pad a batch up to the next captured size;
  * **static buffers**: a step's inputs (token, position, slot, length and block table of each row) are
    copied into one fixed buffer before the replay, and the logits are read from a fixed output;
  * **nothing on the host inside the step**: no `.item()` or `.tolist()`, no Python decision that
    depends on a GPU value, no shape that changes from step to step. The paged decode kernel's key
    range is therefore the longest context the graph allows (`max_seq_len`), not this step's longest:
    chunks of keys past a row's length are skipped inside the kernel.

Padding rows attend to one key in a block of their own (`pad_block`, taken from the pool once) and
write their keys there, so they never touch a real sequence. Prefill stays eager: its shapes change
with every prompt, and a long prompt keeps the GPU busy enough that launches do not matter.

    graphs = DecodeGraphs(model, cache, max_batch=64)   # captures one graph per size (a second or so)
    logits = graphs.run(["a", "b"], [17, 4])             # one decode step of sequences a and b: [2, vocab]

The engine's model runner (`minillm.engine.model_runner`, chapter 05) does this for its decode-only forwards
on CUDA; everything else runs eager.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch

from minillm.engine.kv_cache import PagedKVCache, StepInputs, store_kv
from minillm.engine.sequence import swap_inflight
from minillm.model import PagedDecode, Transformer, use_triton_attention
from minillm.quant.kv import kernel_pool
from minillm.utils import cdiv

log = logging.getLogger("minillm")

# Columns of a decode row of the input buffer (`minillm.engine.kv_cache.step_rows` at one token per row): the
# token, its position, the slot its K/V go to, the keys it attends to (its sequence's length with this token),
# then the sequence's block table.
TOKEN, POSITION, SLOT, SEQ_LEN, TABLE = range(5)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, then multiples of 8, up to the first that holds `max_batch`.

    A batch of B rows replays the graph of the smallest size >= B (`padded_batch_size`); the padding
    costs at most 7 rows of wasted compute, which at decode's small batches is nearly free (the step is
    bound by reading the weights, the same for 1 row or 8).
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}.")
    sizes = [1, 2, 4]
    while sizes[-1] < max_batch:
        sizes.append(8 * (len(sizes) - 2))
    return [s for s in sizes if s < max_batch] + [next(s for s in sizes if s >= max_batch)]


def padded_batch_size(batch: int, sizes: Sequence[int]) -> int:
    """The smallest captured size that holds `batch` rows."""
    for size in sizes:
        if size >= batch:
            return size
    raise ValueError(f"a batch of {batch} rows is larger than the largest captured graph ({max(sizes)}): "
                     "create DecodeGraphs with a larger max_batch, or run this step eagerly.")


def graphs_unavailable(model: Transformer) -> str | None:
    """Why decode steps of `model` cannot be captured, or None if they can."""
    if model.device.type != "cuda":
        return f"the model is on {model.device}, and CUDA graphs need a CUDA GPU"
    if model.config.sliding_window is not None:
        return "the model uses a sliding window, which the paged decode kernel does not implement"
    if not use_triton_attention(model.embed_tokens.weight.detach(), model.config.head_dim):
        return "the paged decode kernel is unavailable (no Triton, MINILLM_TRITON=0, or an unsupported head_dim)"
    return None


class GraphDecodeView:
    """The `minillm.model.CacheView` of a captured decode step: every tensor a slice of fixed buffers.

    `inputs` [batch, 4 + max_blocks] int64 holds the rows (`StepInputs` at one token per row: columns TOKEN,
    POSITION, SLOT, SEQ_LEN, then the block table); the view's tensors are made from it once, inside the
    recording, so that each replay reads whatever the buffer holds then. `update` writes the new keys and
    values to their slots and hands the paged kernel the pools (`PagedDecode`); `advance` does nothing, because
    the host-side bookkeeping (the tokens joining their block tables) happens outside the graph, in `DecodeGraphs.run`.
    """

    def __init__(self, cache: PagedKVCache | DecodeStep, inputs: torch.Tensor, max_seq_len: int,
                 in_pytorch: bool = False) -> None:
        self.cache = cache
        step = StepInputs(inputs, T=1)
        self.tokens, self.position_ids = step.tokens, step.position_ids  # [B, 1] each
        self.slots = step.slot_mapping[:, 0].contiguous()  # [B]
        self.mask = PagedDecode(step.block_tables, step.seq_lens, max_seq_len, cache.dtype, in_pytorch)

    def positions(self, n: int) -> torch.Tensor:
        if n != 1:
            raise ValueError(f"a captured decode step takes one token per row, not {n}: run prompt chunks eagerly, "
                             "through minillm.engine.model_runner.paged_forward.")
        return self.position_ids

    def attention_mask(self, positions: torch.Tensor, window: int | None) -> PagedDecode:
        return self.mask

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, n_kv_heads, 1, head_dim] to their slots; return `layer`'s pools for the paged kernel
        (with their scales, as `QuantizedPool`s, for a quantised cache: chapter 06)."""
        for (pool, scale_pool), new in zip(self.cache.layer_pools(layer), (k, v)):
            store_kv(pool, scale_pool, self.slots, new[:, :, 0])
        return self.pools(layer)

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer`'s key and value pools as the paged kernel reads them (`QuantizedPool`s for an 8-bit cache)."""
        (k, k_scale), (v, v_scale) = self.cache.layer_pools(layer)
        return kernel_pool(k, k_scale), kernel_pool(v, v_scale)

    def fused_write_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_pool, v_pool, slots [B]) for the fused rotary kernel to write this step's keys and values itself
        (`minillm.kernels.fused_rotary`'s `cache`); None where it cannot: an 8-bit cache (codes and scales) or
        the compiled CPU step (no Triton)."""
        (k, k_scale), (v, v_scale) = self.cache.layer_pools(layer)
        if k_scale is not None or self.mask.in_pytorch:
            return None
        return k, v, self.slots

    def advance(self, n: int) -> None:
        pass


class DecodeStep(torch.nn.Module):
    """The decode step as a module for `torch.export`: the model over rows `inputs` [B, TABLE + blocks] (one token
    each, as `GraphDecodeView` reads them), with the KV pools as arguments, not as attributes of one cache, so
    that one compiled step serves every cache of the same layout. Returns logits [B, vocab].

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
        view = GraphDecodeView(self, inputs, key_range, in_pytorch=True)  # in PyTorch, for Inductor to fuse
        return self.model(view.tokens, view.position_ids, cache=view, last_only=True)[:, -1]


class DecodeGraphs:
    """Decode steps of `model` over `cache`, captured as one CUDA graph per batch size and replayed.

    Args:
        model: the model, on a CUDA GPU (see `graphs_unavailable`).
        cache: the paged cache the steps read and write. Its pools' addresses are baked into the graphs:
            the graphs serve this cache only.
        max_batch: the largest batch to capture (rounded up to a captured size).
        max_seq_len: the longest sequence a step may hold (default: the model's context, capped by the
            pool). It sets the block tables' width and the decode kernel's key range.
        capture: False runs the same step code eagerly over the same buffers (for tests on a CPU,
            through Triton's interpreter, and to compare eager with replayed).
        compile: with capture=False, run a compiled step instead: the CPU's counterpart of a graph. The step
            (`DecodeStep`) is pure tensor work over the input rows and the pools (the bookkeeping stays outside
            it); `torch.export` traces it once and AOTInductor compiles it to C++ loops and library calls
            (`minillm.engine.compiled_step`), once per process for batch 1 and once for larger batches, shared
            by the model's engines. The block tables' width is a dynamic dimension, so attention reads only the
            keys the step's longest sequence holds. The first step pays the compile.

    Capture takes one block from the pool for the padding rows, for as long as the object lives.
    """

    # Compiled steps (compile=True), per model: {layout: (the model's tensors then, CompiledStep)}. Each is compiled
    # once per process, for batch 1 or for any batch above 1, and shared by every engine of the model (`generate`
    # makes one per call) while the model's weights are the same tensors, the pools of the same layout, and the
    # thread count the same (Inductor's loops are built for the count they were compiled under).
    compiled_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, model: Transformer, cache: PagedKVCache, max_batch: int, max_seq_len: int | None = None,
                 capture: bool = True, compile: bool = False) -> None:
        if capture and (reason := graphs_unavailable(model)):
            raise ValueError(f"cannot capture decode steps as CUDA graphs: {reason}. Use capture=False, or the "
                             "eager path.")
        if capture and compile:
            raise ValueError("compile=True runs a compiled step instead of capturing graphs: pass "
                             "capture=False with it.")
        self.model, self.cache, self.capture, self.compiled = model, cache, capture, compile
        self.sizes = graph_batch_sizes(max_batch)
        bs = cache.block_size
        pool_tokens = (cache.allocator.num_blocks - 1) * bs  # one block goes to the padding rows
        self.max_seq_len = min(max_seq_len or model.config.max_seq_len, model.config.max_seq_len, pool_tokens)
        if compile:  # tables as wide as the model's context whatever the pool, so the compiled step fits every engine
            self.max_seq_len = min(max_seq_len or model.config.max_seq_len, model.config.max_seq_len)
        if self.max_seq_len < 1:
            raise ValueError("the pool is too small: it needs one block for padding rows and one for a sequence.")
        self.max_blocks = cdiv(self.max_seq_len, bs)
        rows = self.sizes[-1]
        device = cache.device
        # A compiled step's rows are this buffer cut to the step's widest table. One spare column keeps the cut
        # narrower than a row at every width: a cut of whole rows is contiguous, which the traced code treats as a
        # case of its own, and torch.export refuses a dynamic width that could reach it ("width != max").
        spare = 1 if compile else 0
        self.inputs = torch.zeros(rows, TABLE + self.max_blocks + spare, dtype=torch.int64, device=device)
        self.staging = torch.zeros_like(self.inputs, device="cpu", pin_memory=device.type == "cuda")
        self.staging_np = self.staging.numpy()  # the same memory, written with numpy's vectorised indexing
        # The rows the staging buffer holds from the last step: seq_id -> (its row, its table's block list, the
        # tokens its table held after that step). `fill_inputs` keeps these rows instead of rewriting them.
        self.kept_rows: dict[Hashable, tuple[int, list[int], int]] = {}
        # A step's used columns, packed contiguously: on the host (pinned), then on the device (see `run`).
        self.packed_host = torch.empty(self.staging.numel(), dtype=torch.int64, pin_memory=device.type == "cuda")
        self.packed = torch.empty(self.staging.numel(), dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # the last copy out of `packed_host`
        self.pad_block = cache.allocator.allocate()
        self.pad_row = [0, 0, self.pad_block * bs, 1, self.pad_block]  # token 0 at position 0 in the pad block
        self.inputs[:, : TABLE + 1] = torch.tensor(self.pad_row)
        self.pools = cache.all_pools()  # a compiled step's inputs, after the rows
        self.steps: dict[bool, Callable[[list[torch.Tensor]], torch.Tensor]] = {}  # batch > 1 -> compiled step
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        if capture:
            try:
                self._capture()
            except BaseException:
                cache.allocator.free(self.pad_block)  # a failed capture leaves the pool as it found it
                raise

    def _step(self, size: int) -> torch.Tensor:
        """The recorded work: the model over the first `size` rows of the buffer -> logits [size, vocab].

        The view is made here, inside the recording, so that its casts of the buffer are replayed too.
        """
        view = GraphDecodeView(self.cache, self.inputs[:size], self.max_blocks * self.cache.block_size)
        return self.model(view.tokens, view.position_ids, cache=view, last_only=True)[:, -1]

    @torch.inference_mode()
    def _capture(self) -> None:
        """Record one graph per size, largest first, all in one memory pool (a smaller graph reuses the
        larger one's scratch memory: only one replays at a time)."""
        from minillm.kernels.pdl import launches

        with launches():  # minillm's kernels start before the one before them ends (chapter 05; kernels/pdl.py)
            self._record()

    def _record(self) -> None:
        """`_capture`'s warm-up and recording."""
        start = time.perf_counter()
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
            for size in self.sizes:
                self._step(size)  # compiles the Triton kernels, creates cuBLAS handles: nothing new during capture
        torch.cuda.current_stream().wait_stream(stream)
        # No garbage collection during capture: collecting a dead object that holds graphs or CUDA memory (another
        # engine's, say) frees them mid-capture, which CUDA forbids, and the capture fails. They wait for later.
        collecting = gc.isenabled()
        gc.disable()
        try:
            for size in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._step(size)
                pool = graph.pool()
                self.graphs[size] = graph
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d decode graphs (batch sizes %s) in %.2f s", len(self.sizes), self.sizes,
                 self.capture_seconds)

    def compiled_step(self, size: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        """The compiled step for a batch of `size` rows (one for batch 1, one for any larger batch): found among
        those compiled for this model, or compiled now (seconds, `minillm.engine.compiled_step`)."""
        many = size > 1
        if many in self.steps:
            return self.steps[many]
        from minillm.engine.compiled_step import CompiledStep

        tensors = [(name, t.data_ptr(), t.dtype, t.shape) for name, t in (*self.model.named_parameters(),
                                                                           *self.model.named_buffers())]
        layout = (many, torch.get_num_threads(), self.cache.block_size, self.inputs.shape[1],
                  tuple((pool.dtype, pool.shape[1:]) for pool in self.pools))
        known = DecodeGraphs.compiled_steps.setdefault(self.model, {})
        if layout not in known or known[layout][0] != tensors:
            rows = 2 if many else 1
            inputs = self.inputs[:rows, : TABLE + 2]
            blocks = torch.export.Dim("blocks", min=2)  # pools vary with the engine (generate sizes its pool)
            rows_shape = {0: torch.export.Dim("batch", min=2)} if many else {}  # 2 .. any: 1 is the other step
            if self.max_blocks > 2:  # the tables' width: the step's longest sequence
                rows_shape[1] = torch.export.Dim("width", min=TABLE + 2, max=TABLE + self.max_blocks)
            shapes = (rows_shape, tuple({0: blocks} for _ in self.pools))  # forward(inputs, *pools)
            step = DecodeStep(self.model, self.cache.block_size, self.cache.dtype, len(self.cache.k),
                              self.cache.quantized)
            known[layout] = (tensors, CompiledStep(step, (inputs, *self.pools), shapes))
        self.steps[many] = known[layout][1]
        return self.steps[many]

    def fill_inputs(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> tuple[int, int]:
        """Write the step's rows into the staging buffer (on the host); returns (padded batch, columns used).

        Row b: token_ids[b], its position (the tokens its sequence holds), its slot, the keys it attends to,
        then its block table. Rows up to the padded size are padding rows; columns past a row's last block
        keep stale values, which no kernel reads (each row reads only the blocks its length covers).

        The buffer keeps its rows from one step to the next (the idea of vLLM's "persistent batch"). A sequence
        that was in the last step with the same block list, and has not grown since but for that step's token,
        keeps its row: the rows move to this step's order in one numpy gather, and only four numbers per row
        change (the token, its position, slot and length) plus the block the new token goes to, which may be new
        (every block_size steps) or a copy (copy-on-write of a shared block). Only a sequence new to the batch
        has its whole table written. At 256 rows of 37 blocks (contexts of about 590 tokens), that writes about
        1,300 numbers a step instead of about 10,800 (`benchmarks/engine_host_step.py` measures the host's time).
        A table's list of blocks changes in place only by appending and by copy-on-write of the block being
        written; `PagedKVCache.truncate` and `add_sequence` make a new list, so that a kept row is never stale.
        Any new code that edits a table's blocks in place must keep to that, or make a new list.
        """
        size = padded_batch_size(len(seq_ids), self.sizes)
        tables = [self.cache.block_tables[seq_id] for seq_id in seq_ids]
        counts = [table.num_tokens for table in tables]  # what each sequence holds before this step's token
        if max(counts) + 1 > self.max_seq_len:
            seq_id, count = max(zip(seq_ids, counts), key=lambda pair: pair[1])
            raise ValueError(f"sequence {seq_id!r} would hold {count + 1} tokens, more than the "
                             f"{self.max_seq_len} these graphs were captured for: create DecodeGraphs with a "
                             "larger max_seq_len.")
        n, bs, staging = len(seq_ids), self.cache.block_size, self.staging_np
        width = TABLE + cdiv(max(counts) + 1, bs)  # the blocks the longest row reads
        source, fresh = [], []  # each row's row in the last step (0 for a fresh one: overwritten below)
        for b, (seq_id, table, count) in enumerate(zip(seq_ids, tables, counts)):
            kept = self.kept_rows.get(seq_id)
            if kept is not None and kept[1] is table.block_ids and kept[2] == count:
                source.append(kept[0])
            else:
                source.append(0)
                fresh.append(b)
        if source != list(range(n)):
            staging[:n, :width] = staging[source, :width]  # the kept rows in this step's order (a copy, then a write)
        for b in fresh:
            blocks = tables[b].block_ids[: cdiv(counts[b] + 1, bs)]
            staging[b, TABLE: TABLE + len(blocks)] = blocks
        count = np.array(counts, dtype=np.int64)
        index = count // bs
        block = np.array([table.block_ids[i] for table, i in zip(tables, index.tolist())], dtype=np.int64)
        rows = np.arange(n)
        staging[rows, TABLE + index] = block  # the new token's block: new, or copied on write
        staging[:n, TOKEN] = token_ids
        staging[:n, POSITION] = count
        staging[:n, SLOT] = block * bs + count % bs
        staging[:n, SEQ_LEN] = count + 1
        staging[n:size, : TABLE + 1] = self.pad_row
        self.kept_rows = {seq_id: (b, table.block_ids, c + 1)
                          for b, (seq_id, table, c) in enumerate(zip(seq_ids, tables, counts))}
        return size, width

    @torch.inference_mode()
    def run(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int],
            previous: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step: token_ids[b] follows what seq_ids[b] holds. Returns logits [len(seq_ids), vocab].

        Allocates the blocks the step needs (as `PagedKVCache.prepare` does), fills and copies the inputs,
        replays the graph of the padded size, and commits the tokens to their block tables. A negative token
        is still on the device (async scheduling): it is taken from `previous`, the step before's sampled
        tokens, on the device, after the copy and before the replay.
        """
        if not seq_ids or len(seq_ids) != len(token_ids):
            raise ValueError(f"give one token per sequence: {len(seq_ids)} ids, {len(token_ids)} tokens.")
        self.cache.allocate_slots(seq_ids, [1] * len(seq_ids))
        size, width = self.fill_inputs(seq_ids, token_ids)
        # The used columns cross to the device as one contiguous block: packed on the host (pinned), one DMA while
        # the host goes on, then spread into the graph's buffer by a copy on the device. staging[:size, :width]
        # itself is not contiguous, and PyTorch would first copy it into ordinary (pageable) memory, a copy that
        # may make the host wait for the GPU's queue; whole rows would be contiguous, but a row is as wide as the
        # longest context the graphs allow (8,197 numbers at 131,072 tokens).
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        host = self.packed_host[: size * width].view(size, width)
        host.numpy()[:] = self.staging_np[:size, :width]
        packed = self.packed[: size * width].view(size, width)
        packed.copy_(host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.inputs[:size, :width].copy_(packed)
        if previous is not None:
            swap_inflight(self.inputs[:size, TOKEN], previous)
        if self.capture:
            self.graphs[size].replay()
            logits = self.outputs[size][: len(seq_ids)].clone()  # the output buffer is rewritten by the next replay
        elif self.compiled:
            # The rows cut to this step's widest table, so that attention reads only the keys it covers. Tables of
            # one block read two (a compiled size of 1 would be fixed, not free): the second column's stale block id
            # is masked.
            inputs = self.inputs[:size, : max(width, TABLE + 2)]
            logits = self.compiled_step(size)([inputs, *self.pools])[: len(seq_ids)]
        else:
            logits = self._step(size)[: len(seq_ids)]
        self.cache.commit([self.cache.block_tables[s] for s in seq_ids], [[int(t)] for t in token_ids])
        return logits
