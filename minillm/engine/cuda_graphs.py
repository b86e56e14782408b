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
from collections.abc import Callable, Hashable, Sequence

import torch

from minillm.arithmetic import cdiv
from minillm.engine.kv_cache import PagedKVCache, StepInputs, rows_to_tensor, step_rows, store_kv
from minillm.engine.sequence import swap_inflight
from minillm.model import PagedDecode, Transformer, use_triton_attention
from minillm.quant.kv import kernel_pool

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

    def __init__(self, cache: PagedKVCache, inputs: torch.Tensor, max_seq_len: int, in_pytorch: bool = False) -> None:
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
        compile: with capture=False, run the step through `torch.compile` instead: the CPU's counterpart of a
            graph. The step is pure tensor work over fixed buffers (the bookkeeping stays outside it), so it
            compiles once (once more when a second batch size makes its batch axis dynamic); Inductor fuses
            the small ops between the matmuls into generated C++ loops. The block tables' width is a dynamic
            dimension, so attention reads only the keys the step's longest sequence holds. The first step
            pays the compile.

    Capture takes one block from the pool for the padding rows, for as long as the object lives.
    """

    # `_step` through torch.compile (`minillm.engine.compiled_step`), made once per process. It lives on the
    # class: a compiled bound method kept on the object would be a reference cycle, freed only by the garbage
    # collector, at whatever moment it runs; if that is during another object's capture, destroying this one's
    # graphs there makes that capture fail.
    compiled_step: Callable | None = None

    def __init__(self, model: Transformer, cache: PagedKVCache, max_batch: int, max_seq_len: int | None = None,
                 capture: bool = True, compile: bool = False) -> None:
        if capture and (reason := graphs_unavailable(model)):
            raise ValueError(f"cannot capture decode steps as CUDA graphs: {reason}. Use capture=False, or the "
                             "eager path.")
        if capture and compile:
            raise ValueError("compile=True runs the step through torch.compile instead of capturing it: pass "
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
        self.inputs = torch.zeros(rows, TABLE + self.max_blocks, dtype=torch.int64, device=device)
        self.staging = torch.zeros_like(self.inputs, device="cpu", pin_memory=device.type == "cuda")
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # the last copy out of `staging`
        self.pad_block = cache.allocator.allocate()
        self.pad_row = [0, 0, self.pad_block * bs, 1, self.pad_block]  # token 0 at position 0 in the pad block
        self.inputs[:, : TABLE + 1] = torch.tensor(self.pad_row)
        if compile:  # one compile for every pool and table size: they vary with the engine (generate sizes its pool)
            for pool in (*cache.k, *cache.v, *(cache.k_scale or ()), *(cache.v_scale or ())):
                torch._dynamo.mark_dynamic(pool, 0)  # the number of blocks
            if DecodeGraphs.compiled_step is None:
                from minillm.engine.compiled_step import compile_step

                DecodeGraphs.compiled_step = compile_step(DecodeGraphs._step)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        if capture:
            try:
                self._capture()
            except BaseException:
                cache.allocator.free(self.pad_block)  # a failed capture leaves the pool as it found it
                raise

    def _step(self, size: int, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """The recorded work: the model over the first `size` rows of the buffer -> logits [size, vocab].

        The view is made here, inside the recording, so that its casts of the buffer are replayed too.
        A compiled step is handed `inputs`, the buffer's rows cut to this step's widest block table: its
        width is a dynamic dimension of the one compiled graph, so attention reads only the key slots the
        step's longest sequence covers (a captured graph reads `max_seq_len` of them, every step).
        """
        if inputs is None:
            inputs = self.inputs[:size]
        key_range = (inputs.shape[1] - TABLE) * self.cache.block_size
        view = GraphDecodeView(self.cache, inputs, key_range,
                               in_pytorch=self.compiled)  # compiled: attention in PyTorch, which Inductor fuses
        return self.model(view.tokens, view.position_ids, cache=view, last_only=True)[:, -1]

    @torch.inference_mode()
    def _capture(self) -> None:
        """Record one graph per size, largest first, all in one memory pool (a smaller graph reuses the
        larger one's scratch memory: only one replays at a time)."""
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

    def fill_inputs(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> tuple[int, int]:
        """Write the step's rows into the staging buffer (on the host); returns (padded batch, columns used).

        Row b: token_ids[b], its position (the tokens its sequence holds), its slot, the keys it attends to,
        then its block table. Rows up to the padded size are padding rows; columns past the widest table
        keep stale values, which no kernel reads (each row reads only the blocks its length covers).
        """
        size = padded_batch_size(len(seq_ids), self.sizes)
        tables = [self.cache.block_tables[seq_id] for seq_id in seq_ids]
        if max(table.num_tokens for table in tables) + 1 > self.max_seq_len:
            seq_id, table = max(zip(seq_ids, tables), key=lambda pair: pair[1].num_tokens)
            raise ValueError(f"sequence {seq_id!r} would hold {table.num_tokens + 1} tokens, more than the "
                             f"{self.max_seq_len} these graphs were captured for: create DecodeGraphs with a "
                             "larger max_seq_len.")
        rows = step_rows(tables, [[token] for token in token_ids], T=1)
        width = TABLE + max(len(r) - TABLE for r in rows)
        rows += [self.pad_row] * (size - len(rows))
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the staging buffer
        self.staging[:size, :width] = rows_to_tensor(rows, width)
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
        self.inputs[:size, :width].copy_(self.staging[:size, :width], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if previous is not None:
            swap_inflight(self.inputs[:size, TOKEN], previous)
        if self.capture:
            self.graphs[size].replay()
            logits = self.outputs[size][: len(seq_ids)].clone()  # the output buffer is rewritten by the next replay
        elif self.compiled:
            # One compile for every table width. Tables of one block would be compiled apart (torch.compile
            # specialises sizes 0 and 1), so they read two: the second column's stale block id is masked.
            inputs = self.inputs[:size, : max(width, TABLE + 2)]
            torch._dynamo.mark_dynamic(inputs, 1)
            logits = DecodeGraphs.compiled_step(self, size, inputs)[: len(seq_ids)]
        else:
            logits = self._step(size)[: len(seq_ids)]
        self.cache.commit([self.cache.block_tables[s] for s in seq_ids], [[int(t)] for t in token_ids])
        return logits
