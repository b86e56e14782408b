"""Mixed steps replayed as CUDA graphs: prompt chunks beside decode rows, packed in one row (chapter 05).

On CUDA a step with prompt work runs as one packed forward (`ModelRunner.forward`): every new token of the step,
decode rows' and prompt chunks' alike, side by side in one row [1, N], attention by the paged prefill kernel reading
the pools in place. Eagerly, that forward is several hundred kernels launched from Python, about 12 ms of the host's
time at Llama-3.2-1B's shape on an H200 for 3 ms of the GPU's (`results/step_shapes/cuda.json`): the mixed step is
host-bound, as the decode step was before its graphs (`minillm.engine.cuda_graphs`).

So mixed steps are captured too, one graph per token bucket (16, 32, 64, ..., up to the engine's token budget): a step
of N tokens replays the smallest bucket that holds them, its N tokens first and padding after. Everything about a
step is in fixed buffers the graph reads:

    vector   [Nmax tokens | Nmax positions | Nmax write slots | P last rows | P + 1 q_starts | P seq_lens]
    tables   [P, blocks of the longest context] each sequence's blocks

with P = the engine's max_num_seqs. Padding tokens belong to no sequence (q_starts ends at N) and write their keys
to a block of their own (`pad_block`); padding sequences have no query, so the kernel gives them no tile. The
paged prefill kernel's list of tiles is computed inside the graph from q_starts, so nothing about a step's lengths is
read on the host inside the replay. vLLM captures its mixed steps piecewise, with attention outside the graphs;
here attention needs no host work, so the whole forward is one graph.

The engine captures them wherever it captures decode steps (MINILLM_MIXED_GRAPHS=0 turns them off). Measured on an
H200 (benchmarks/step_shapes.py, results/step_shapes/cuda.json): 32 decode rows beside a 480-token chunk, 12 ms a
step eager and 3.3 ms replayed. The buffers and the step are also checked on the CPU (`capture=False`, the kernel
through Triton's interpreter, tests/engine/test_mixed_graphs.py).

    graphs = MixedGraphs(model, cache, max_seqs=64, max_tokens=512)
    logits = graphs.run(["a", "b"], [[5, 6, 7], [9]])   # a's chunk of 3 beside b's decode token -> [2, vocab]

With `every_token=True` the graphs return the logits of every new token, not each row's last: the verify step of
speculative decoding (chapter 07), whose rows are [last token, draft 1..d] and need the target's logits at all
1 + d positions (`ModelRunner.speculative_decode`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from minillm.engine.graph_capture import record_graphs
from minillm.engine.kv_cache import PackedCacheView, PagedKVCache
from minillm.engine.sequence import swap_inflight
from minillm.engine.step_inputs import PackedInputs, RowsToDevice
from minillm.model import Transformer
from minillm.utils import cdiv

log = logging.getLogger("minillm")


def token_buckets(max_tokens: int) -> list[int]:
    """The token counts to capture: powers of two from 16, up to the first that holds `max_tokens`. A step of N
    tokens pays for up to 2N positions in the linear layers: at most the padding of one chunk, and a mixed step's
    time is set by the host, not these multiplies, until the GPU is busy anyway."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
    sizes = [16]
    while sizes[-1] < max_tokens:
        sizes.append(2 * sizes[-1])
    return sizes


class MixedGraphs:
    """Packed steps of `model` over `cache` (any mix of prompt chunks and decode rows), one CUDA graph per token
    bucket (`token_buckets`), for steps of at most `max_seqs` sequences and `max_tokens` new tokens.

    The pools' addresses are baked into the graphs: they serve this cache only. The padding tokens write to
    `pad_block` (the engine passes its decode graphs'), else to a block capture takes from the pool for as long as the
    object lives. `capture=False` runs the same code over the same buffers
    eagerly (a test of the buffers without a graph). `every_token`: `run` returns the logits of every new token
    [N, vocab], in the step's order (speculative verify), instead of each row's last [rows, vocab].
    """

    capture_seconds = 0.0

    def __init__(self, model: Transformer, cache: PagedKVCache, max_seqs: int, max_tokens: int,
                 capture: bool = True, pad_block: int | None = None, every_token: bool = False) -> None:
        self.model, self.cache, self.capture, self.P = model, cache, capture, max_seqs
        self.every_token = every_token
        self.sizes = token_buckets(max_tokens)
        bs, n = cache.block_size, self.sizes[-1]
        self.max_seq_len = min(model.config.max_seq_len, (cache.allocator.num_blocks - 1) * bs)
        self.max_blocks = cdiv(self.max_seq_len, bs)
        device, P = cache.device, max_seqs
        # the vector's parts: tokens, positions, slots (n each), last rows (P), q_starts (P + 1), seq_lens (P)
        self.parts = np.cumsum([0, n, n, n, P, P + 1, P])
        self.vector = torch.zeros(int(self.parts[-1]), dtype=torch.int64, device=device)
        self.tables = torch.zeros(P, self.max_blocks, dtype=torch.int64, device=device)
        self.host = np.zeros(int(self.parts[-1]), dtype=np.int64)
        self.send_vector = RowsToDevice(self.vector.numel(), device)
        self.send_tables = RowsToDevice(self.tables.numel(), device)
        # Padding tokens write their keys to a block no sequence reads; the decode graphs' padding block serves
        # (what is written there is never used), so that a pool sized for its sequences loses one block, not two.
        self.owns_pad = pad_block is None
        self.pad_block = cache.allocator.allocate() if pad_block is None else pad_block
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            try:
                self._capture()
            except BaseException:
                if self.owns_pad:
                    cache.allocator.free(self.pad_block)  # a failed capture leaves the pool as it found it
                raise

    def part(self, i: int, size: int | None = None) -> torch.Tensor:
        """Part i of the vector (0 tokens, 1 positions, 2 slots, 3 last rows, 4 q_starts, 5 seq_lens), its first
        `size` entries for the per-token parts."""
        start, end = int(self.parts[i]), int(self.parts[i + 1])
        return self.vector[start: start + size if size is not None else end]

    def _step(self, size: int) -> torch.Tensor:
        """The recorded work: the model over the bucket's `size` tokens -> logits [P, vocab], row b the last new
        token of sequence b (padding sequences' rows are garbage); with `every_token`, [size, vocab], one row per
        token. The view is made inside the recording."""
        packed = PackedInputs(self.part(0, size)[None], self.part(1, size)[None], self.part(2, size),
                              self.vector[:0], self.part(3), self.part(4), (), (), self.tables, self.part(5))
        view = PackedCacheView(self.cache, packed, [], [], max_queries=size)
        return self.model(view.tokens, view.position_ids, cache=view, last_only=not self.every_token)[0]

    @torch.inference_mode()
    def _capture(self) -> None:
        """Record one graph per bucket, largest first, in one memory pool (only one replays at a time)."""
        start = time.perf_counter()
        self.host[:] = 0
        self.host[int(self.parts[2]): int(self.parts[3])] = self.pad_block * self.cache.block_size
        self.host[int(self.parts[5]): int(self.parts[6])] = 1  # padding sequences: one key, no query
        self.vector.copy_(torch.from_numpy(self.host))
        self.tables.fill_(self.pad_block)
        self.graphs, self.outputs = record_graphs(self.sizes, self._step)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d mixed-step graphs (tokens %s) in %.2f s", len(self.sizes), self.sizes,
                 self.capture_seconds)

    def fits(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]]) -> bool:
        """Whether a step of these rows fits a captured bucket (else it runs eagerly)."""
        return len(seq_ids) <= self.P and sum(map(len, token_ids)) <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]],
            previous: torch.Tensor | None = None, allocated: bool = False) -> torch.Tensor:
        """One packed step, token_ids[b] after seq_ids[b] -> logits [len(seq_ids), vocab] (with `every_token`:
        [N, vocab] for the step's N tokens, row b's at N_0 + ... + N_(b-1) onwards): fill the buffers, replay
        the smallest bucket that holds the step, then commit the tokens to their tables (after the launch). A
        negative token is still on the device (async scheduling): it is taken from `previous`."""
        if not self.fits(seq_ids, token_ids):
            raise ValueError(f"{len(seq_ids)} rows of {sum(map(len, token_ids))} tokens: more than the captured "
                             f"{self.P} rows or {self.sizes[-1]} tokens; run this step eagerly.")
        cache, n_rows = self.cache, len(seq_ids)
        if not allocated:
            cache.allocate_slots(seq_ids, [len(t) for t in token_ids])
        tables = [cache.block_tables[s] for s in seq_ids]
        a = cache.builder.packed_arrays(tables, token_ids)
        if a.block_tables.shape[1] > self.max_blocks:
            raise ValueError(f"a sequence holds more than the {self.max_seq_len} tokens the graphs were made for: run "
                             "this step eagerly (paged_forward(..., packed=True)).")
        n = len(a.tokens)
        size = next(s for s in self.sizes if s >= n)
        host, parts, pad_slot = self.host, self.parts, self.pad_block * cache.block_size
        for i, values, pad in ((0, a.tokens, 0), (1, a.positions, 0), (2, a.write_slots, pad_slot)):
            host[parts[i]: parts[i] + n] = values
            host[parts[i] + n: parts[i] + size] = pad  # this bucket's padding tokens
        for i, values, pad in ((3, a.last_rows, 0), (4, a.q_starts, n), (5, a.seq_lens, 1)):
            k = len(values)
            host[parts[i]: parts[i] + k] = values
            host[parts[i] + k: parts[i + 1]] = pad  # padding sequences: no query, one key
        self.send_vector(host[None], self.vector[None])
        self.send_tables(a.block_tables, self.tables[:n_rows, : a.block_tables.shape[1]])
        if previous is not None:
            swap_inflight(self.part(0, size), previous)
        rows = n if self.every_token else n_rows
        if self.capture:
            self.graphs[size].replay()
            logits = self.outputs[size][:rows].clone()  # the output buffer is rewritten by the next replay
        else:
            logits = self._step(size)[:rows]
        cache.commit(tables, [list(t) for t in token_ids])
        return logits
