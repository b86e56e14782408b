"""A draft model for speculative decoding, on a paged KV cache of its own (chapter 07).

`minillm.sampler.speculative` holds the acceptance rule, the `Drafter` interface and the prompt-lookup drafter, none of
which needs the engine; this drafter runs a second model on the engine's `PagedKVCache`, so it lives here, and
`minillm.sampler.speculative` stays free of the engine (the engine imports it).

    from minillm.engine.draft_model import DraftModelDrafter
    config = SpeculativeConfig(DraftModelDrafter(draft_model), num_speculative_tokens=4)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable, Sequence

import torch

from minillm.engine.block_manager import BLOCK_SIZE, NoFreeBlocksError
from minillm.engine.cuda_graphs import DecodeGraphs, graphs_unavailable
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.mixed_graphs import MixedGraphs
from minillm.engine.model_runner import argmax_on_device, paged_forward
from minillm.engine.sequence import inflight_token
from minillm.model import Transformer
from minillm.sampler.sampling import SamplingParams, process_logits
from minillm.sampler.speculative import Draft
from minillm.utils import kv_blocks

log = logging.getLogger("minillm")
# The catch-up forwards the drafter captures, in tokens (after a verify step a row feeds 1 to k + 1 tokens; a new
# sequence its whole prompt, which runs eagerly).
CATCH_UP_GRAPH_TOKENS = 256


class DraftModelDrafter:
    """A small model of the target's vocabulary drafts k tokens autoregressively, on its own paged KV cache.

    Each `propose` rolls the draft's cache back to the longest prefix it shares with the context (the
    target may have rejected some of the last drafts), runs the rest of the context in one forward,
    then k - 1 decode steps: k forwards for k drafts. Greedy rows draft the argmax (q one-hot); the
    others sample from q, the draft's logits under the row's temperature, top-k, top-p and min-p.
    Penalties are left out of q: any q keeps the output exact, a closer q only raises acceptance.

    On a GPU, a step whose rows are all greedy takes the fast path (`propose_greedy`): the catch-up forward and the
    k - 1 decode steps replay CUDA graphs of the draft over its own cache (`DecodeGraphs`, `MixedGraphs`, captured
    at the first such step), each step's argmax stays on the device and feeds the next step there, and the host
    reads the k drafts of every row in one copy at the end: one wait per `propose` instead of one per draft.

    Args:
        model: the draft model; its vocabulary must be the target's.
        num_blocks: blocks in the draft's KV pool (default: 64 sequences of its full context). A row the
            pool cannot hold gets an empty draft (a plain decode step) instead of an error.
        cuda_graphs: the fast path for greedy rows. None: wherever CUDA graphs can run (`graphs_unavailable`);
            True where they cannot raises a ValueError.
        max_batch: the most rows the fast path's graphs hold; a larger step drafts eagerly.
        capture: False runs the fast path's fixed buffers eagerly, without graphs (a CPU test of that path,
            through Triton's interpreter; with cuda_graphs=True).
    """

    def __init__(self, model: Transformer, num_blocks: int | None = None, block_size: int = BLOCK_SIZE,
                 cuda_graphs: bool | None = None, max_batch: int = 64, capture: bool = True) -> None:
        self.model = model
        if num_blocks is None:
            num_blocks = 64 * kv_blocks(model.config.max_seq_len, block_size)
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.device, model.dtype,
                                  enable_prefix_caching=False)
        if cuda_graphs:  # without capture (a test), only what the fixed buffers themselves need
            reason = graphs_unavailable(model) if capture else (
                "the model uses a sliding window" if model.config.sliding_window is not None else None)
            if reason:
                raise ValueError(f"cuda_graphs=True, but {reason}. Leave cuda_graphs unset to draft eagerly.")
        self.fast = graphs_unavailable(model) is None if cuda_graphs is None else cuda_graphs
        self.max_batch, self.capture = max_batch, capture
        self.graphs: DecodeGraphs | None = None  # the fast path's decode steps, captured at its first use
        self.catch_up_graphs: MixedGraphs | None = None  # ... and its catch-up forwards (rows of 1 to 256 tokens)

    def release(self, seq_id: Hashable) -> None:
        if seq_id in self.cache.block_tables:
            self.cache.free(seq_id)

    def _catch_up(self, seq_id: Hashable, context: list[int]) -> list[int]:
        """Roll the cache back to its longest common prefix with context[:-1]; the tokens left to run."""
        if seq_id not in self.cache.block_tables:
            self.cache.add_sequence(seq_id)
        cached = self.cache.block_tables[seq_id].token_ids
        limit = min(len(cached), len(context) - 1)  # at least the last token runs: its logits draft x_1
        # The two differ near the end (the drafts the target rejected): compare the long shared start in one go.
        keep = max(0, limit - 64)
        if cached[:keep] != context[:keep]:
            keep = 0
        while keep < limit and cached[keep] == context[keep]:
            keep += 1
        self.cache.truncate(seq_id, keep)
        return context[keep:]

    @torch.inference_mode()
    def propose(self, seq_ids, contexts, params, num_tokens, generators) -> list[Draft]:  # noqa: ANN001 - Drafter
        if any(len(c) + k > self.model.config.max_seq_len for c, k in zip(contexts, num_tokens)):
            raise ValueError(f"the draft model's context is {self.model.config.max_seq_len} tokens, shorter than "
                             "a sequence to draft for: use a draft model with the target's context length.")
        if self.fast and all(p.greedy for p, k in zip(params, num_tokens) if k > 0):
            drafted = self.propose_greedy(seq_ids, contexts, num_tokens)
            if drafted is not None:
                return [Draft(t) for t in drafted]
        tokens: list[list[int]] = [[] for _ in seq_ids]
        q_rows: list[list[torch.Tensor]] = [[] for _ in seq_ids]  # q at each draft of a sampled row
        rows = [i for i, k in enumerate(num_tokens) if k > 0]
        feed = {i: self._catch_up(seq_ids[i], list(contexts[i])) for i in rows}
        while rows:
            try:
                logits = paged_forward(self.model, self.cache, [seq_ids[i] for i in rows], [feed[i] for i in rows])
            except NoFreeBlocksError:  # the draft's pool is full: draft nothing for the longest of these rows
                drop = max(rows, key=lambda i: len(contexts[i]))
                self.release(seq_ids[drop])
                tokens[drop], q_rows[drop] = [], []
                rows.remove(drop)
                continue
            row_params = [_without_penalties(params[i]) for i in rows]
            q = process_logits(logits, row_params).softmax(dim=-1)  # [len(rows), V]
            for j, i in enumerate(rows):
                if row_params[j].greedy:
                    token = int(q[j].argmax())
                else:
                    token = int(torch.multinomial(q[j], 1, generator=generators[i]))
                    q_rows[i].append(q[j])
                tokens[i].append(token)
                feed[i] = [token]
            rows = [i for i in rows if len(tokens[i]) < num_tokens[i]]
        # Greedy rows drafted deterministically: q is one-hot, given as None.
        return [Draft(t, torch.stack(q) if q else None) for t, q in zip(tokens, q_rows)]


    def _fixed_buffers(self) -> tuple[DecodeGraphs, MixedGraphs] | None:
        """The fast path's graphs, captured at its first step; None (drafting eagerly from then on) if capture fails."""
        if self.graphs is None:
            try:
                graphs = DecodeGraphs(self.model, self.cache, self.max_batch, capture=self.capture)
                self.catch_up_graphs = MixedGraphs(self.model, self.cache, self.max_batch, CATCH_UP_GRAPH_TOKENS,
                                                   capture=self.capture, pad_block=graphs.pad_block)
                self.graphs = graphs
            except (RuntimeError, ValueError, torch.cuda.OutOfMemoryError) as error:
                log.warning("capturing the draft model's steps failed, drafting eagerly: %s", error)
                self.fast = False
                return None
        return self.graphs, self.catch_up_graphs

    @torch.inference_mode()
    def propose_greedy(self, seq_ids: Sequence[Hashable], contexts: Sequence[Sequence[int]],
                       num_tokens: Sequence[int]) -> list[list[int]] | None:
        """Greedy drafts of num_tokens[i] tokens after contexts[i], for rows that are all greedy, on fixed buffers.

        One catch-up forward (the decode graphs if every row feeds one token, the catch-up graphs if the step fits
        them, else eager and packed), then one decode step per further draft, fed on the device with the step
        before's argmax (placeholders `inflight_token(row)`, as async scheduling feeds them). The host waits once,
        for all drafts [rows, k] together, and writes the real tokens over the placeholders in the draft's tables.
        Returns None, having changed nothing the eager path cannot redo, where the step does not fit (more rows
        than `max_batch`, a sequence longer than the graphs' tables, or no room in the pool for every row's drafts):
        `propose` then drafts eagerly.
        """
        rows = [i for i, k in enumerate(num_tokens) if k > 0]
        buffers = self._fixed_buffers() if 0 < len(rows) <= self.max_batch else None
        if buffers is None:
            return None if rows else [[] for _ in seq_ids]
        graphs, catch_up = buffers
        ids = [seq_ids[i] for i in rows]
        feeds = [self._catch_up(seq_ids[i], list(contexts[i])) for i in rows]
        tables = self.cache.block_tables
        if any(tables[s].num_tokens + len(f) + num_tokens[i] - 1 > graphs.max_seq_len
               for s, f, i in zip(ids, feeds, rows)):
            return None  # longer than the graphs' block tables (a small pool)
        try:  # every slot the drafts will write, at once: the decode steps below then allocate nothing
            self.cache.allocate_slots(ids, [len(f) + num_tokens[i] - 1 for f, i in zip(feeds, rows)])
        except NoFreeBlocksError:
            return None
        if all(len(f) == 1 for f in feeds):
            logits = graphs.run(ids, [f[0] for f in feeds], allocated=True)
        elif catch_up.fits(ids, feeds):
            logits = catch_up.run(ids, feeds, allocated=True)
        else:
            logits = paged_forward(self.model, self.cache, ids, feeds, packed=True)
        steps = [argmax_on_device(logits)[0]]  # steps[s][j]: draft s of row order[s][j]
        order = [list(range(len(rows)))]  # order[s]: the rows (positions in `rows`) that draft an s-th token
        for s in range(1, max(num_tokens[i] for i in rows)):
            before = {m: j for j, m in enumerate(order[-1])}  # where each row's draft s - 1 sits in steps[-1]
            order.append([m for m in order[-1] if num_tokens[rows[m]] > s])
            fed = [inflight_token(before[m]) for m in order[-1]]  # each row's draft s - 1, still on the device
            logits = graphs.run([ids[m] for m in order[-1]], fed, previous=steps[-1], allocated=True)
            steps.append(argmax_on_device(logits)[0])
        on_host = torch.cat(steps).tolist()  # the one wait
        drafts: list[list[int]] = [[] for _ in seq_ids]
        offset = 0
        for members in order:
            for j, m in enumerate(members):
                drafts[rows[m]].append(on_host[offset + j])
            offset += len(members)
        for i in rows:  # drafts 0 .. k - 2 went into the table as placeholders; the last was never fed
            table, k = self.cache.block_tables[seq_ids[i]], num_tokens[i]
            if k > 1:
                table.token_ids[-(k - 1):] = drafts[i][: k - 1]
        return drafts


def _without_penalties(params: SamplingParams) -> SamplingParams:
    """The draft's q uses the row's temperature and filters, not its penalties (they need the output so far)."""
    if params.repetition_penalty == 1 and params.frequency_penalty == 0 and params.presence_penalty == 0:
        return params
    return dataclasses.replace(params, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
