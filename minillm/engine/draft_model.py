"""A draft model for speculative decoding, on a paged KV cache of its own (chapter 07).

`minillm.sampler.speculative` holds the acceptance rule, the `Drafter` interface and the prompt-lookup drafter, none of
which needs the engine; this drafter runs a second model on the engine's `PagedKVCache`, so it lives here, and
`minillm.sampler.speculative` stays free of the engine (the engine imports it).

    from minillm.engine.draft_model import DraftModelDrafter
    config = SpeculativeConfig(DraftModelDrafter(draft_model), num_speculative_tokens=4)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import torch

from minillm.engine.block_manager import BLOCK_SIZE, NoFreeBlocksError
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.model_runner import paged_forward
from minillm.model import Transformer
from minillm.sampler.sampling import SamplingParams, process_logits
from minillm.sampler.speculative import Draft
from minillm.utils import kv_blocks


class DraftModelDrafter:
    """A small model of the target's vocabulary drafts k tokens autoregressively, on its own paged KV cache.

    Each `propose` rolls the draft's cache back to the longest prefix it shares with the context (the
    target may have rejected some of the last drafts), runs the rest of the context in one forward,
    then k - 1 decode steps: k forwards for k drafts. Greedy rows draft the argmax (q one-hot); the
    others sample from q, the draft's logits under the row's temperature, top-k, top-p and min-p.
    Penalties are left out of q: any q keeps the output exact, a closer q only raises acceptance.

    Args:
        model: the draft model; its vocabulary must be the target's.
        num_blocks: blocks in the draft's KV pool (default: 64 sequences of its full context). A row the
            pool cannot hold gets an empty draft (a plain decode step) instead of an error.
    """

    def __init__(self, model: Transformer, num_blocks: int | None = None, block_size: int = BLOCK_SIZE) -> None:
        self.model = model
        if num_blocks is None:
            num_blocks = 64 * kv_blocks(model.config.max_seq_len, block_size)
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.device, model.dtype,
                                  enable_prefix_caching=False)

    def release(self, seq_id: Hashable) -> None:
        if seq_id in self.cache.block_tables:
            self.cache.free(seq_id)

    def _catch_up(self, seq_id: Hashable, context: list[int]) -> list[int]:
        """Roll the cache back to its longest common prefix with context[:-1]; the tokens left to run."""
        if seq_id not in self.cache.block_tables:
            self.cache.add_sequence(seq_id)
        cached = self.cache.block_tables[seq_id].token_ids
        keep = 0
        limit = min(len(cached), len(context) - 1)  # at least the last token runs: its logits draft x_1
        while keep < limit and cached[keep] == context[keep]:
            keep += 1
        self.cache.truncate(seq_id, keep)
        return context[keep:]

    @torch.inference_mode()
    def propose(self, seq_ids, contexts, params, num_tokens, generators) -> list[Draft]:  # noqa: ANN001 - Drafter
        if any(len(c) + k > self.model.config.max_seq_len for c, k in zip(contexts, num_tokens)):
            raise ValueError(f"the draft model's context is {self.model.config.max_seq_len} tokens, shorter than "
                             "a sequence to draft for: use a draft model with the target's context length.")
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


def _without_penalties(params: SamplingParams) -> SamplingParams:
    """The draft's q uses the row's temperature and filters, not its penalties (they need the output so far)."""
    if params.repetition_penalty == 1 and params.frequency_penalty == 0 and params.presence_penalty == 0:
        return params
    return dataclasses.replace(params, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
