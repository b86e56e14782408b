"""The scheduler: which sequences run in the next forward, and how many of their tokens (chapter 05).

A server holds many requests at once. Each step of the engine runs the model over a batch made of
whatever the scheduler picks: decode tokens of running sequences and chunks of prompts, side by side
(continuous batching: a sequence joins the batch as soon as there is room and leaves it as soon as it
is done, instead of the whole batch waiting for its longest member). The scheduler decides under two
budgets, per step:

* a token budget, `max_num_batched_tokens`: the forward's size, so that a long prompt cannot stall
  every decode behind it. A prompt longer than what is left is cut into chunks that run in
  successive steps (chunked prefill), each next to the running sequences' decode tokens;
* the KV cache's free blocks (chapter 04): a sequence is admitted only if its next chunk's blocks can
  be allocated, keeping a small reserve (`watermark`) for the running sequences' next decode tokens;
* with LoRA adapters (chapter 08), the device slots: a sequence under an adapter is admitted only if its
  adapter is in a slot or can be loaded into one (`minillm.lora.LoRASlots.acquire`); a running sequence
  pins its adapter's slot until it finishes or is preempted, so that slot is never evicted under it.

The policy, first come first served, as vLLM's (v1) scheduler:

1. Running sequences first, oldest first: each gets its next token (or its next prompt chunk). If the
   pool has no block for it, the NEWEST running sequence is preempted (its blocks freed; it goes back to
   the head of the waiting queue and will be recomputed: its prompt and the tokens it already generated
   are prefilled again, often from the prefix cache) until the older one fits.
2. Then waiting sequences, in arrival order, while the token budget, `max_num_seqs` and the blocks
   allow. The first one that does not fit stops admission (no overtaking: first come first served),
   with one exception: a sequence whose adapter cannot get a LoRA slot lets later ones pass, which then
   run only if their adapter is already resident (or is none). Without it, one request for a missing
   adapter would hold back every request behind it, and with more adapters than slots the batch would
   shrink to the few requests in front (measured in chapter 08: 16x slower on a GPU). vLLM's scheduler
   also skips such requests. The price: while requests for resident adapters keep coming, a skipped one
   may wait long (no slot frees until the adapters' requests finish).

Every step returns a `SchedulerOutput`, the step's record: who ran with how many tokens, who was
preempted, and why each waiting sequence waited. Chapter 05 draws the timeline from these records.

    scheduler = Scheduler(cache, max_num_seqs=64, max_num_batched_tokens=256)
    scheduler.add(Sequence("a", prompt_ids, params))
    out = scheduler.schedule()          # out.scheduled: [(seq, num_tokens), ...]
    # ... run the forward on those tokens, then:
    scheduler.finish(seq, "stop")       # frees its blocks
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from minillm.engine.block_manager import NoFreeBlocksError
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.sequence import Sequence, SequenceStatus
from minillm.utils import cdiv


@dataclass
class SchedulerOutput:
    """What one step ran, and why the others did not: the record of a scheduling decision.

    scheduled:    (seq, number of its tokens this forward computes), running ones first (the sequences
                  are live objects: read their state now, or use the fields below, fixed at this step)
    preempted:    the ids of sequences preempted in this step (freed, back to the waiting queue)
    waiting:      {seq_id: why it did not run}: "token budget", "no free blocks", "max_num_seqs",
                  "no free LoRA slot", or "behind <id>" (first come first served: it waits for the
                  sequence before it)
    """

    step: int
    scheduled: list[tuple[Sequence, int]]
    preempted: list[Hashable]
    waiting: dict[Hashable, str]
    num_batched_tokens: int
    num_prefill_tokens: int  # tokens of prompts (or of recomputation after a preemption)
    num_used_blocks: int  # after this step's allocations
    num_blocks: int
    prefill_ids: set[Hashable] = field(default_factory=set)  # who ran prompt work (a chunk, or a recomputation)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_batched_tokens - self.num_prefill_tokens


class Scheduler:
    """First-come-first-served continuous batching with chunked prefill and preemption (chapter 05).

    Args:
        cache: the paged KV cache the sequences' blocks live in (the scheduler allocates and frees them).
        max_num_seqs: the most sequences in one forward (vLLM's default is 256; small models want fewer).
        max_num_batched_tokens: the token budget of one forward.
        enable_chunked_prefill: cut prompts longer than the budget left into chunks. Without it a
            prompt waits until its whole length fits in one step's budget (and a prompt longer than
            the budget itself is refused by `add`).
        watermark: the fraction of the pool that admission leaves free for running sequences' decode
            tokens, so that a new sequence does not cause a preemption at the next step (vLLM: 0.01).
        lora_slots: the `minillm.lora.LoRASlots` that sequences with a `lora` pin while they run (chapter 08);
            may be set later (`LLMEngine.add_lora`).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_chunked_prefill: bool = True,
        watermark: float = 0.01,
        lora_slots: Any = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs}, "
                             f"{max_num_batched_tokens}.")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark is a fraction of the pool in [0, 1), got {watermark}.")
        self.cache = cache
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.watermark_blocks = int(watermark * cache.allocator.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.sequences: dict[Hashable, Sequence] = {}  # every unfinished sequence by seq_id
        self.steps = 0
        self.lora_slots = lora_slots

    # ------------------------------------------------------------------ sequences
    def add(self, seq: Sequence) -> None:
        """Queue a sequence. Refused at once (ValueError) if it could never run: an id in use, or more blocks
        than the whole pool holds, or (without chunked prefill) a prompt longer than the token budget."""
        if seq.seq_id in self.sequences:
            raise ValueError(f"id {seq.seq_id!r} is already in use: give each request its own id.")
        final = seq.num_tokens + seq.params.max_tokens
        blocks = cdiv(final, self.cache.block_size)
        if blocks > self.cache.allocator.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r} may need {final} tokens ({len(seq.prompt_token_ids)} of prompt + "
                f"max_tokens {seq.params.max_tokens}) = {blocks} blocks, more than the whole KV cache "
                f"({self.cache.allocator.num_blocks} blocks): shorten it, lower max_tokens, or give the cache "
                "more blocks."
            )
        if not self.enable_chunked_prefill and seq.num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"request {seq.request_id!r} has a {seq.num_tokens}-token prompt, more than the token budget "
                f"of one step ({self.max_num_batched_tokens}) and chunked prefill is off: enable it or raise "
                "max_num_batched_tokens."
            )
        seq.status = SequenceStatus.WAITING
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """The sequence is done ("stop", "length", "abort" or "error"): it leaves the queues, its blocks are freed."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.cache.free(seq.seq_id)
            self._release_lora(seq)
        else:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        del self.sequences[seq.seq_id]

    def add_running(self, seq: Sequence) -> None:
        """Run `seq` from the next step: its first `num_computed_tokens` are in the cache already, in blocks its
        engine allocated (a prompt prefilled by another engine, chapter 08's disaggregation)."""
        if seq.seq_id in self.sequences:
            raise ValueError(f"id {seq.seq_id!r} is already in use: give each request its own id.")
        seq.status = SequenceStatus.RUNNING
        self.sequences[seq.seq_id] = seq
        self.running.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child`, a copy of the running `parent` (`Sequence.fork`), sharing its KV blocks (copy-on-write):
        one more sequence of an n > 1 request, started when the parent's prompt is done."""
        child_id = child.seq_id
        if child_id in self.sequences:
            raise ValueError(f"sequence id {child_id!r} is already in use.")
        if parent.status is not SequenceStatus.RUNNING:
            raise ValueError(f"only a running sequence can be forked; {parent.seq_id!r} is {parent.status.value}.")
        if child.lora is not None:
            self.lora_slots.acquire(child.lora)  # resident and pinned by the parent: always succeeds
        child.status = SequenceStatus.RUNNING
        self.cache.fork(parent.seq_id, child_id)
        self.sequences[child_id] = child
        self.running.append(child)

    def abort(self, seq_ids: Hashable | Iterable[Hashable]) -> None:
        """Finish these sequences now (a client went away); unknown or finished ids are ignored."""
        for seq_id in [seq_ids] if isinstance(seq_ids, (str, tuple)) else seq_ids:
            seq = self.sequences.get(seq_id)
            if seq is not None:
                self.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Choose the next forward's sequences and token counts, allocating their blocks (see the module)."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Hashable] = []
        waiting: dict[Hashable, str] = {}
        prefill_ids: set[Hashable] = set()  # the scheduled sequences still in their prompt
        prefill = 0  # and their tokens this step

        # 1. Running sequences, oldest first; preempt the newest when a block is missing.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.awaits_last_token:  # async scheduling: done, its last token not read yet; nothing to compute
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 0:
                waiting[seq.seq_id] = "token budget"
                i += 1
                continue
            while not self._try_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.seq_id)
                waiting[victim.seq_id] = "preempted: no free blocks"
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                if seq.is_prefill:
                    prefill_ids.add(seq.seq_id)
                    prefill += n

        # 2. Waiting sequences in arrival order (a preempted one first), while they fit. None after a
        #    preemption: memory is short, and admitting would only preempt again.
        blocked_by = "a preemption in this step" if preempted else None
        for seq in list(self.waiting):
            if blocked_by is not None:
                waiting.setdefault(seq.seq_id, f"behind {blocked_by}")
                continue
            reason = self._admit(seq, budget)
            if reason is not None:
                waiting[seq.seq_id] = reason
                if reason != "no free LoRA slot":  # a missing slot does not hold back the others (see above)
                    blocked_by = seq.seq_id
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            scheduled.append((seq, n))
            budget -= n
            if seq.is_prefill:
                prefill_ids.add(seq.seq_id)
                prefill += n

        self.steps += 1
        allocator = self.cache.allocator
        return SchedulerOutput(self.steps, scheduled, preempted, waiting, self.max_num_batched_tokens - budget,
                               prefill, allocator.num_used_blocks, allocator.num_blocks, prefill_ids)

    def _try_allocate(self, seq: Sequence, n: int) -> bool:
        """Allocate the blocks for n more tokens of a running sequence; False if the pool is short."""
        if self.cache.has_room(seq.seq_id, n):  # most decode steps: its last block has room, nothing to allocate
            return True
        try:
            self.cache.allocate_slots([seq.seq_id], [n])  # all or nothing
        except NoFreeBlocksError:
            return False
        return True

    def _admit(self, seq: Sequence, budget: int) -> str | None:
        """Move a waiting sequence to running with its first chunk's blocks; or say why it must wait."""
        if len(self.running) >= self.max_num_seqs:
            return "max_num_seqs"
        if budget == 0:
            return "token budget"
        # Its adapter's slot (chapter 08): loaded now if it is not resident, unless every slot is pinned.
        if seq.lora is not None and not self.lora_slots.acquire(seq.lora):
            return "no free LoRA slot"
        # Its blocks: the cached prefix (prefix caching, under its adapter), then blocks for the first chunk.
        seq.num_computed_tokens = self.cache.add_sequence(seq.seq_id, seq.all_token_ids, seq.lora)
        n = min(seq.num_uncomputed_tokens, budget)
        reason = None
        if not self.enable_chunked_prefill and n < seq.num_uncomputed_tokens:
            reason = "token budget"
        elif self.cache.blocks_needed([seq.seq_id], [n]) + self.watermark_blocks > self.cache.allocator.num_free_blocks:
            reason = "no free blocks"
        if reason is not None:
            self.cache.free(seq.seq_id)  # let go of the cached prefix blocks it took
            self._release_lora(seq)
            return reason
        self.cache.allocate_slots([seq.seq_id], [n])
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        return None

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and put it at the head of the queue, to be recomputed."""
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        self._release_lora(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _release_lora(self, seq: Sequence) -> None:
        """The sequence leaves the running batch: it no longer pins its adapter's slot."""
        if seq.lora is not None:
            self.lora_slots.release(seq.lora)
