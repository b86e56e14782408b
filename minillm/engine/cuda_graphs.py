"""Decode steps replayed as CUDA graphs: the GPU fast path (chapter 02 measures why it is needed).

A decode step of a Llama-3.2-1B-shaped model reads 2.5 GB of weights, about 0.8 ms at an H100's copy bandwidth,
but eager PyTorch issues it as several hundred kernels, each launched from Python at a few microseconds, many of
them tiny (a norm, a rotary, an add): the GPU waits on the CPU, and minillm's eager decode of that model ran at 4%
of the bandwidth roofline (`results/roofline/cuda_h100.json`).

A CUDA graph records every kernel of one step, with its arguments, once (`torch.cuda.CUDAGraph`), and
replays the whole recording with one launch. A recording is of fixed pointers and fixed shapes, so:

  * **static shapes**: one graph per batch size (`graph_batch_sizes`: 1, 2, 4, then multiples of 8, as vLLM);
  * **static buffers**: a step's rows (token, position, slot, length, block table; from the cache's one input
    builder, `minillm.engine.step_inputs`) are copied into one fixed buffer, the logits read from a fixed output;
  * **nothing on the host inside the step**: no `.item()`, no Python decision on a GPU value, no shape that
    changes between steps. The paged decode kernel's key range is the longest context the graph allows
    (`max_seq_len`), not this step's longest: chunks of keys past a row's length are skipped in the kernel.

Padding rows attend to one key in a block of their own (`pad_block`), so they never touch a real sequence.
Prefill stays eager: its shapes change with every prompt, and a long prompt keeps the GPU busy anyway.

    graphs = DecodeGraphs(model, cache, max_batch=64)   # captures one graph per size (a second or so)
    logits = graphs.run(["a", "b"], [17, 4])             # one decode step of sequences a and b: [2, vocab]

The model runner (`minillm.engine.model_runner`, chapter 05) does this for decode-only forwards on CUDA; on a
CPU, `minillm.engine.compiled_step.CompiledDecode` runs the same buffers through a compiled step instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence

import torch

from minillm.engine.block_manager import BlockTable
from minillm.engine.graph_capture import record_graphs
from minillm.engine.kv_cache import PagedCacheView, PagedKVCache
from minillm.engine.sequence import swap_inflight
from minillm.engine.step_inputs import TABLE, TOKEN, RowsToDevice
from minillm.model import Transformer, use_triton_attention
from minillm.utils import cdiv

log = logging.getLogger("minillm")


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, then multiples of 8, up to the first that holds `max_batch`. A batch
    of B rows replays the smallest size >= B (`padded_batch_size`): at most 7 rows of wasted compute, nearly free
    at decode's small batches (the step is bound by reading the weights, the same for 1 row or 8)."""
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


class DecodeGraphs:
    """Decode steps of `model` over `cache`, captured as one CUDA graph per batch size and replayed.

    Args:
        model, cache: the model, on a CUDA GPU (`graphs_unavailable`), and the paged cache the steps read and
            write, whose pools' addresses are baked into the graphs: they serve this cache only.
        max_batch: the largest batch to capture (rounded up to a captured size).
        max_seq_len: the longest sequence a step may hold (default: the model's context, capped by the pool):
            the block tables' width and the decode kernel's key range.
        capture: False runs the same step code eagerly over the same buffers (tests on a CPU, through
            Triton's interpreter; eager against replayed).

    Capture takes one block from the pool for the padding rows, for as long as the object lives.
    """

    spare_columns = 0  # columns past the widest table (the compiled CPU step needs one)
    capture_seconds = 0.0  # how long the capture took

    def __init__(self, model: Transformer, cache: PagedKVCache, max_batch: int, max_seq_len: int | None = None,
                 capture: bool = True) -> None:
        if capture and (reason := graphs_unavailable(model)):
            raise ValueError(f"cannot capture decode steps as CUDA graphs: {reason}. Use capture=False, or the "
                             "eager path.")
        self.model, self.cache, self.capture = model, cache, capture
        self.sizes = graph_batch_sizes(max_batch)
        self.max_seq_len = self.longest_sequence(max_seq_len)
        if self.max_seq_len < 1:
            raise ValueError("the pool is too small: it needs one block for padding rows and one for a sequence.")
        self.max_blocks = cdiv(self.max_seq_len, cache.block_size)
        columns = TABLE + self.max_blocks + self.spare_columns
        self.inputs = torch.zeros(self.sizes[-1], columns, dtype=torch.int64, device=cache.device)
        self.upload = RowsToDevice(self.inputs.numel(), cache.device)
        self.pad_block = cache.allocator.allocate()
        self.pad_row = [0, 0, self.pad_block * cache.block_size, 1, self.pad_block]  # token 0 at position 0 there
        self.inputs[:, : TABLE + 1] = torch.tensor(self.pad_row)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            try:
                self._capture()
            except BaseException:
                cache.allocator.free(self.pad_block)  # a failed capture leaves the pool as it found it
                raise

    def longest_sequence(self, max_seq_len: int | None) -> int:
        """The model's context, capped by `max_seq_len` and by the pool (less the padding rows' block)."""
        ctx, cache = self.model.config.max_seq_len, self.cache
        return min(max_seq_len or ctx, ctx, (cache.allocator.num_blocks - 1) * cache.block_size)

    def _step(self, size: int) -> torch.Tensor:
        """The recorded work: the model over the first `size` rows of the buffer -> logits [size, vocab].
        The view is made here, inside the recording, so that its casts of the buffer are replayed too."""
        view = PagedCacheView.of_decode_rows(self.cache, self.inputs[:size], self.max_blocks * self.cache.block_size)
        return self.model(view.tokens, view.position_ids, cache=view, last_only=True)[:, -1]

    @torch.inference_mode()
    def _capture(self) -> None:
        """Record one graph per size, largest first, in one memory pool (only one replays at a time)."""
        from minillm.kernels.pdl import launches

        start = time.perf_counter()
        with launches():  # minillm's kernels start before the one before them ends (chapter 05; kernels/pdl.py)
            self.graphs, self.outputs = record_graphs(self.sizes, self._step)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d decode graphs (batch sizes %s) in %.2f s", len(self.sizes), self.sizes,
                 self.capture_seconds)

    def load(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int], previous: torch.Tensor | None = None,
             allocated: bool = False) -> tuple[int, int, list[BlockTable]]:
        """Put a decode step's rows into the fixed buffer -> (padded batch, columns used, the step's tables, for
        the commit after the replay). Allocates the step's blocks (unless `allocated`: the engine's scheduler did),
        takes the rows from the cache's input builder and copies them (`RowsToDevice`: the host does not wait). A
        negative token is still on the device (async scheduling): it is taken from `previous`, the step before's
        sampled tokens."""
        if not seq_ids or len(seq_ids) != len(token_ids):
            raise ValueError(f"give one token per sequence: {len(seq_ids)} ids, {len(token_ids)} tokens.")
        cache, size = self.cache, padded_batch_size(len(seq_ids), self.sizes)
        if not allocated:
            cache.allocate_slots(seq_ids, [1] * len(seq_ids))
        rows, _, tables = cache.builder.decode_rows(seq_ids, cache.block_tables, token_ids, size, self.pad_row,
                                                    max_len=self.max_seq_len)
        width = rows.shape[1]
        self.upload(rows, self.inputs[:size, :width])
        if previous is not None:
            swap_inflight(self.inputs[:size, TOKEN], previous)
        return size, width, tables

    def replay(self, size: int, width: int, n: int) -> torch.Tensor:
        """The graph of `size` rows replayed (without capture, its code run eagerly) -> the first n rows' logits."""
        if not self.capture:
            return self._step(size)[:n]
        self.graphs[size].replay()
        return self.outputs[size][:n].clone()  # the output buffer is rewritten by the next replay

    @torch.inference_mode()
    def run(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int], previous: torch.Tensor | None = None,
            allocated: bool = False) -> torch.Tensor:
        """One decode step, token_ids[b] after seq_ids[b] -> logits [len(seq_ids), vocab]: `load`, replay, and the
        commit of the tokens to their tables, after the launch (the host's work there overlaps the GPU's)."""
        size, width, tables = self.load(seq_ids, token_ids, previous, allocated)
        logits = self.replay(size, width, len(seq_ids))
        self.cache.commit_decode(tables, token_ids)
        return logits
