"""The scheduler: which requests run in the next forward, and how many of their tokens (chapter 05).

A server holds many requests at once. Each step of the engine runs the model over a batch made of
whatever the scheduler picks: decode tokens of running requests and chunks of prompts, side by side
(continuous batching: a request joins the batch as soon as there is room and leaves it as soon as it
is done, instead of the whole batch waiting for its longest member). The scheduler decides under two
budgets, per step:

* a token budget, `max_num_batched_tokens`: the forward's size, so that a long prompt cannot stall
  every decode behind it. A prompt longer than what is left is cut into chunks that run in
  successive steps (chunked prefill), each next to the running requests' decode tokens;
* the KV cache's free blocks (chapter 04): a request is admitted only if its next chunk's blocks can
  be allocated, keeping a small reserve (`watermark`) for the running requests' next decode tokens.

The policy, first come first served, as vLLM's (v1) scheduler:

1. Running requests first, oldest first: each gets its next token (or its next prompt chunk). If the
   pool has no block for it, the NEWEST running request is preempted (its blocks freed; it goes back to
   the head of the waiting queue and will be recomputed: its prompt and the tokens it already generated
   are prefilled again, often from the prefix cache) until the older one fits.
2. Then waiting requests, in arrival order, while the token budget, `max_num_seqs` and the blocks
   allow. The first one that does not fit stops admission (no overtaking: first come first served).

Every step returns a `SchedulerOutput`, the step's record: who ran with how many tokens, who was
preempted, and why each waiting request waited. Chapter 05 draws the timeline from these records.

    scheduler = Scheduler(cache, max_num_seqs=64, max_num_batched_tokens=256)
    scheduler.add(Request("a", prompt_ids, params))
    out = scheduler.schedule()          # out.scheduled: [(request, num_tokens), ...]
    # ... run the forward on those tokens, then:
    scheduler.finish(request, "stop")   # frees its blocks
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from minillm.paging import PagedKVCache
from minillm.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the queue: not admitted yet, or preempted
    RUNNING = "running"  # in the batch: its blocks are in the cache
    FINISHED = "finished"  # done (stop, length or abort); its blocks are freed


@dataclass(eq=False)
class Request:
    """One request's state as the scheduler and the engine see it (chapter 05).

    The tokens of a request are its prompt followed by what it generated so far; the first
    `num_computed_tokens` of them have their keys and values in the KV cache. So the next forward
    must compute `num_tokens - num_computed_tokens` of them: the rest of the prompt (prefill, maybe in
    chunks), or just the last generated token (decode).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next forwards must still compute before this request can sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Whether its next chunk is (re)computing more than the last token: prompt work, not a decode step."""
        return self.num_uncomputed_tokens > 1 or not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class SchedulerOutput:
    """What one step ran, and why the others did not: the record of a scheduling decision.

    scheduled:    (request, number of its tokens this forward computes), running ones first (the requests
                  are live objects: read their state now, or use the fields below, fixed at this step)
    preempted:    the ids of requests preempted in this step (freed, back to the waiting queue)
    waiting:      {request id: why it did not run}: "token budget", "no free blocks", "max_num_seqs",
                  or "behind <id>" (first come first served: it waits for the request before it)
    """

    step: int
    scheduled: list[tuple[Request, int]]
    preempted: list[str]
    waiting: dict[str, str]
    num_batched_tokens: int
    num_prefill_tokens: int  # tokens of prompts (or of recomputation after a preemption)
    num_used_blocks: int  # after this step's allocations
    num_blocks: int
    prefill_ids: set[str] = field(default_factory=set)  # who ran prompt work (a chunk, or a recomputation)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_batched_tokens - self.num_prefill_tokens


class Scheduler:
    """First-come-first-served continuous batching with chunked prefill and preemption (chapter 05).

    Args:
        cache: the paged KV cache the requests' blocks live in (the scheduler allocates and frees them).
        max_num_seqs: the most requests in one forward (vLLM's default is 256; small models want fewer).
        max_num_batched_tokens: the token budget of one forward.
        enable_chunked_prefill: cut prompts longer than the budget left into chunks. Without it a
            prompt waits until its whole length fits in one step's budget (and a prompt longer than
            the budget itself is refused by `add`).
        watermark: the fraction of the pool that admission leaves free for running requests' decode
            tokens, so that a new request does not cause a preemption at the next step (vLLM: 0.01).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_chunked_prefill: bool = True,
        watermark: float = 0.01,
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
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first
        self.requests: dict[str, Request] = {}  # every unfinished request by id
        self.steps = 0

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        """Queue a request. Refused at once (ValueError) if it could never run: an id in use, or more blocks
        than the whole pool holds, or (without chunked prefill) a prompt longer than the token budget."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use: give each request its own id.")
        final = request.num_tokens + request.params.max_tokens
        blocks = -(-final // self.cache.block_size)
        if blocks > self.cache.allocator.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} may need {final} tokens ({len(request.prompt_token_ids)} of prompt + "
                f"max_tokens {request.params.max_tokens}) = {blocks} blocks, more than the whole KV cache "
                f"({self.cache.allocator.num_blocks} blocks): shorten it, lower max_tokens, or give the cache "
                "more blocks."
            )
        if not self.enable_chunked_prefill and request.num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"request {request.request_id!r} has a {request.num_tokens}-token prompt, more than the token budget "
                f"of one step ({self.max_num_batched_tokens}) and chunked prefill is off: enable it or raise "
                "max_num_batched_tokens."
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, reason: str) -> None:
        """The request is done ("stop", "length" or "abort"): it leaves the queues and its blocks are freed."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.cache.free(request.request_id)
        else:
            self.waiting.remove(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        del self.requests[request.request_id]

    def fork(self, parent: Request, child_id: str) -> Request:
        """A running request's twin that shares its KV blocks (copy-on-write): one more sequence of an
        n > 1 request, started when the parent's prompt is done. From here on it is a request of its own."""
        if child_id in self.requests:
            raise ValueError(f"request id {child_id!r} is already in use.")
        if parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"only a running request can be forked; {parent.request_id!r} is {parent.status.value}.")
        child = Request(child_id, parent.prompt_token_ids, parent.params, parent.arrival_time,
                        list(parent.output_token_ids), parent.num_computed_tokens, RequestStatus.RUNNING)
        self.cache.fork(parent.request_id, child_id)
        self.requests[child_id] = child
        self.running.append(child)
        return child

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Finish these requests now (a client went away); unknown or finished ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self.finish(request, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Choose the next forward's requests and token counts, allocating their blocks (see the module)."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        waiting: dict[str, str] = {}

        # 1. Running requests, oldest first; preempt the newest when a block is missing.
        i = 0
        while i < len(self.running):
            request = self.running[i]
            n = min(request.num_uncomputed_tokens, budget)
            if n == 0:
                waiting[request.request_id] = "token budget"
                i += 1
                continue
            while not self._try_allocate(request, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                waiting[victim.request_id] = "preempted: no free blocks"
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                scheduled.append((request, n))
                budget -= n
                i += 1

        # 2. Waiting requests in arrival order (a preempted one first), while they fit. None after a
        #    preemption: memory is short, and admitting would only preempt again.
        blocked_by = "a preemption in this step" if preempted else None
        for request in list(self.waiting):
            if blocked_by is not None:
                waiting.setdefault(request.request_id, f"behind {blocked_by}")
                continue
            reason = self._admit(request, budget)
            if reason is not None:
                waiting[request.request_id] = reason
                blocked_by = request.request_id
                continue
            n = min(request.num_uncomputed_tokens, budget)
            scheduled.append((request, n))
            budget -= n

        self.steps += 1
        allocator = self.cache.allocator
        prefill_ids = {r.request_id for r, _ in scheduled if r.is_prefill}
        prefill = sum(n for r, n in scheduled if r.request_id in prefill_ids)
        return SchedulerOutput(self.steps, scheduled, preempted, waiting, self.max_num_batched_tokens - budget,
                               prefill, allocator.num_used_blocks, allocator.num_blocks, prefill_ids)

    def _try_allocate(self, request: Request, n: int) -> bool:
        """Allocate the blocks for n more tokens of a running request; False if the pool is short."""
        if self.cache.blocks_needed([request.request_id], [n]) > self.cache.allocator.num_free_blocks:
            return False
        self.cache.allocate_slots([request.request_id], [n])
        return True

    def _admit(self, request: Request, budget: int) -> str | None:
        """Move a waiting request to running with its first chunk's blocks; or say why it must wait."""
        if len(self.running) >= self.max_num_seqs:
            return "max_num_seqs"
        if budget == 0:
            return "token budget"
        # Its blocks: the cached prefix (prefix caching), then blocks for the first chunk.
        request.num_computed_tokens = self.cache.add_sequence(request.request_id, request.all_token_ids)
        n = min(request.num_uncomputed_tokens, budget)
        if not self.enable_chunked_prefill and n < request.num_uncomputed_tokens:
            self.cache.free(request.request_id)
            return "token budget"
        needed = self.cache.blocks_needed([request.request_id], [n])
        if needed + self.watermark_blocks > self.cache.allocator.num_free_blocks:
            self.cache.free(request.request_id)  # let go of the cached prefix blocks it took
            return "no free blocks"
        self.cache.allocate_slots([request.request_id], [n])
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        return None

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it at the head of the queue, to be recomputed."""
        self.running.remove(request)
        self.cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
