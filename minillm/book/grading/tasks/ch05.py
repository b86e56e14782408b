"""Chapter 05's exercise tasks: admission by free KV blocks, one scheduling step of continuous batching, the
goodput of a load test, and static against continuous batching in steps.

Admission and the scheduling step are checked against `minillm.engine.scheduler.Scheduler` itself, driven on a small
`PagedKVCache` with random arrivals (a stand-in forward commits each step's tokens; the model never runs), and on
hand-made edge cases. Goodput is checked against `minillm.eval.bench.goodput` on random request records. The batching
simulation's continuous count is the number of steps minillm's Scheduler takes on the same requests.

Each wrong answer is diagnosed by running the common wrong versions of the rule on the same cases: the hint
names the first one the reader's answers agree with.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterator

from minillm.book.grading.registry import MismatchError, diagnose, register_task, short_repr
from minillm.config import ModelConfig
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Sequence
from minillm.eval import bench
from minillm.sampler.sampling import SamplingParams
from minillm.utils import cdiv


def _tiny_config() -> ModelConfig:
    return ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=50)


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9,
                                                                                              abs_tol=1e-12)
    return a == b


# ---- driving minillm's Scheduler ---------------------------------------------------------------------


def _run_step(scheduler: Scheduler, out) -> None:
    """What the engine does after `schedule()`, without the model: the step's tokens join the cache, a request
    whose tokens are all computed samples one (token 0), and one at its max_tokens finishes."""
    if not out.scheduled:
        return
    cache = scheduler.cache
    chunks = [r.all_token_ids[r.num_computed_tokens: r.num_computed_tokens + n] for r, n in out.scheduled]
    view = cache.prepare([r.request_id for r, _ in out.scheduled], chunks)
    view.advance(view.T)
    for request, n in out.scheduled:
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(0)
            if len(request.output_token_ids) >= request.params.max_tokens:
                scheduler.finish(request, "length")


def _engine_steps(seed: int, num_requests: int, num_blocks: int, block_size: int, budget: int, max_num_seqs: int,
                  watermark: float, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  arrivals_per_step: float) -> Iterator[tuple[tuple, list[tuple[str, int]], bool]]:
    """Run minillm's Scheduler on random requests; for each step: (the step's state as `schedule_step` takes
    it, what the Scheduler scheduled, whether it preempted)."""
    rng = random.Random(seed)
    cache = PagedKVCache(_tiny_config(), num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)
    scheduler = Scheduler(cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, watermark=watermark)
    pending = [Sequence(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(*prompt_range))],
                       SamplingParams(max_tokens=rng.randint(*output_range), ignore_eos=True))
               for i in range(num_requests)]
    for _ in range(10_000):
        while pending and (rng.random() < arrivals_per_step or not scheduler.has_unfinished_requests()):
            scheduler.add(pending.pop(0))
        if not scheduler.has_unfinished_requests():
            return
        state = ([_as_dict(r) for r in scheduler.running], [_as_dict(r) for r in scheduler.waiting], budget,
                 max_num_seqs, cache.allocator.num_free_blocks, block_size, scheduler.watermark_blocks)
        out = scheduler.schedule()
        yield state, [(r.request_id, n) for r, n in out.scheduled], bool(out.preempted)
        _run_step(scheduler, out)
    raise RuntimeError("the scheduler did not finish its requests in 10,000 steps")


def _as_dict(request: Sequence) -> dict:
    return {"id": request.request_id, "num_tokens": request.num_tokens, "num_computed": request.num_computed_tokens}


# ---- 05.admission -----------------------------------------------------------------------------------


def reference_can_admit(prompt_len: int, num_cached_blocks: int, token_budget: int, free_blocks: int,
                        block_size: int, watermark_blocks: int) -> bool:
    """Whether a waiting request can start now: the blocks of its FIRST chunk, plus the watermark, are free.

    Its first `num_cached_blocks` blocks are already in the cache (prefix caching: shared, not taken from the
    free pool), so it computes from token num_cached_blocks x block_size on; the first chunk is what the token
    budget allows of the rest. Its new blocks: ceil((cached + chunk) / block_size) - num_cached_blocks.
    """
    if token_budget <= 0:
        return False
    cached = num_cached_blocks * block_size
    chunk = min(prompt_len - cached, token_budget)
    needed = cdiv(cached + chunk, block_size) - num_cached_blocks
    return needed + watermark_blocks <= free_blocks


admission = register_task(
    "05.admission",
    "can_admit(prompt_len: int, num_cached_blocks: int, token_budget: int, free_blocks: int, block_size: int, "
    "watermark_blocks: int) -> bool",
    reference=reference_can_admit,
    forbid=("minillm.engine.scheduler.Scheduler", "minillm.engine.kv_cache.PagedKVCache",
            "minillm.arithmetic.kv_blocks"),
)

_ADMIT_HOW = ("chunk = min(prompt_len - num_cached_blocks * block_size, token_budget); needed = ceil(chunk / "
              "block_size) new blocks; admit if token_budget > 0 and needed + watermark_blocks <= free_blocks.")


def _admit_variant(no_watermark: bool = False, whole_prompt: bool = False, count_cached: bool = False,
                   floor: bool = False, strict: bool = False, ignore_cached: bool = False) -> Callable[..., bool]:
    def admit(prompt_len: int, cached_blocks: int, budget: int, free: int, bs: int, wm: int) -> bool:
        if budget <= 0:
            return False
        cached = 0 if ignore_cached else cached_blocks * bs
        chunk = prompt_len - cached if whole_prompt else min(prompt_len - cached, budget)
        tokens = cached + chunk if count_cached else chunk
        needed = tokens // bs if floor else cdiv(tokens, bs)
        total = needed + (0 if no_watermark else wm)
        return total < free if strict else total <= free
    return admit


_ADMIT_SUSPECTS: list[tuple[Callable, str]] = [
    (_admit_variant(no_watermark=True), "keep the watermark free: admit only if needed + watermark_blocks <= "
                                        "free_blocks. Those blocks are the running requests' reserve for their next "
                                        "decode tokens; without it a new request can force a preemption at the "
                                        "very next step."),
    (_admit_variant(whole_prompt=True), "count the blocks of the FIRST CHUNK only: with chunked prefill a request "
                                        "starts with min(tokens left, token_budget) tokens and takes the next "
                                        "chunks' blocks in later steps, as a running request."),
    (_admit_variant(count_cached=True), "the cached prefix blocks are already in the cache (shared with the "
                                        "requests that computed them): they take nothing from free_blocks. Count "
                                        "only the new blocks, for the tokens after num_cached_blocks * "
                                        "block_size."),
    (_admit_variant(ignore_cached=True), "the first num_cached_blocks * block_size tokens are in the cache already: "
                                         "the first chunk starts after them, so it is min(prompt_len - cached "
                                         "tokens, token_budget) tokens long."),
    (_admit_variant(floor=True), "round the blocks up: a chunk of 17 tokens in blocks of 16 needs 2 blocks, "
                                 "ceil(n / block_size) = -(-n // block_size)."),
    (_admit_variant(strict=True), "the blocks may use up the free pool down to the watermark exactly: admit when "
                                  "needed + watermark_blocks <= free_blocks (<=, not <)."),
]


def _check_admit(fn: Callable, cases: list[tuple], what: str) -> None:
    got = []
    for case in cases:
        g = fn(*case)
        if not isinstance(g, bool):
            raise MismatchError(f"can_admit{case}", "True or False", short_repr(g),
                                "return a bool: whether the request can be admitted now.")
        got.append(g)
    for g, case in zip(got, cases):
        expected = reference_can_admit(*case)
        if g != expected:
            hint = diagnose(got, cases, _ADMIT_SUSPECTS, _ADMIT_HOW, _same)
            if case[2] <= 0 and g:
                hint = "a step with no token budget left has no room for the request's first chunk: return False."
            prompt_len, cached, budget, free, bs, wm = case
            chunk = min(prompt_len - cached * bs, budget) if budget > 0 else 0
            needed = cdiv(cached * bs + chunk, bs) - cached
            raise MismatchError(f"{what}: can_admit(prompt_len={prompt_len}, num_cached_blocks={cached}, "
                                f"token_budget={budget}, free_blocks={free}, block_size={bs}, "
                                f"watermark_blocks={wm})",
                                f"{expected} (a first chunk of {chunk} tokens needs {needed} new blocks, + {wm} "
                                f"of watermark, {free} free)", g, hint)


@admission.test("a 40-token prompt in blocks of 16 needs 3 blocks: admitted with 3 free, not with 2")
def _(fn: Callable) -> None:
    _check_admit(fn, [(40, 0, 512, 3, 16, 0), (40, 0, 512, 2, 16, 0), (32, 0, 512, 2, 16, 0),
                      (33, 0, 512, 2, 16, 0)], "no cache, no watermark")


@admission.test("the watermark: 3 blocks needed, 1 kept in reserve, so 4 must be free")
def _(fn: Callable) -> None:
    _check_admit(fn, [(40, 0, 512, 3, 16, 1), (40, 0, 512, 4, 16, 1), (10, 0, 512, 5, 16, 5), (32, 0, 512, 2, 16, 1)],
                 "with a watermark")


@admission.test("chunked prefill: a 1,000-token prompt under a 64-token budget needs its first chunk's 4 blocks")
def _(fn: Callable) -> None:
    _check_admit(fn, [(1000, 0, 64, 5, 16, 1), (1000, 0, 64, 4, 16, 1), (1000, 0, 100, 7, 16, 0),
                      (1000, 0, 100, 6, 16, 0)], "a budget shorter than the prompt")


@admission.test("a cached prefix of 4 blocks: a 100-token prompt needs 3 new blocks, not 7")
def _(fn: Callable) -> None:
    _check_admit(fn, [(100, 4, 512, 3, 16, 0), (100, 4, 512, 2, 16, 0), (100, 4, 20, 2, 16, 0),
                      (65, 4, 512, 1, 16, 0), (200, 2, 512, 11, 16, 1), (200, 2, 512, 10, 16, 1)],
                 "a cached prefix")


@admission.test("no token budget left: nobody is admitted, whatever the blocks")
def _(fn: Callable) -> None:
    _check_admit(fn, [(10, 0, 0, 100, 16, 0), (10, 0, 1, 100, 16, 0)], "budget 0 or 1")


def _engine_admits(prompt_len: int, cached_blocks: int, budget: int, free: int, bs: int, watermark: float,
                   num_blocks: int, rng: random.Random) -> tuple[tuple, bool]:
    """Ask minillm's Scheduler: a pool where a running sequence holds a cached system prompt and a filler holds
    blocks so that `free` are free; does the waiting request run in the next step?"""
    cache = PagedKVCache(_tiny_config(), num_blocks=num_blocks, block_size=bs, enable_prefix_caching=True)
    system = [rng.randrange(50) for _ in range(cached_blocks * bs)]
    held = 0
    if system:
        cache.add_sequence("system", system)
        view = cache.prepare(["system"], [system])
        view.advance(view.T)
        held = cached_blocks
    filler = num_blocks - held - free
    if filler:
        cache.add_sequence("filler")
        cache.allocate_slots(["filler"], [filler * bs])
    scheduler = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=budget, watermark=watermark)
    prompt = system + [rng.randrange(50) for _ in range(prompt_len - len(system))]
    scheduler.add(Sequence("new", prompt, SamplingParams(max_tokens=1)))
    out = scheduler.schedule()
    case = (prompt_len, cached_blocks, budget, free, bs, scheduler.watermark_blocks)
    return case, any(r.request_id == "new" for r, _ in out.scheduled)


@admission.test("agrees with minillm's Scheduler on 120 random pools, prompts, cached prefixes and watermarks")
def _(fn: Callable) -> None:
    rng = random.Random(505)
    cases = []
    for _ in range(120):
        bs = rng.choice([1, 4, 16])
        num_blocks = 400 if bs == 1 else 100
        prompt_len = rng.randint(1, 300)
        cached = min(30, rng.randint(0, (prompt_len - 1) // bs)) if rng.random() < 0.5 else 0
        budget = rng.choice([8, 32, 64, 256, 512])
        watermark = rng.choice([0.0, 0.01, 0.05, 0.1])
        chunk = min(prompt_len - cached * bs, budget)
        near = cdiv(chunk, bs) + int(watermark * num_blocks) + rng.randint(-2, 2)  # near the threshold
        free = max(0, min(num_blocks - cached, near if rng.random() < 0.8 else rng.randint(0, num_blocks - cached)))
        case, admitted = _engine_admits(prompt_len, cached, budget, free, bs, watermark, num_blocks, rng)
        if admitted != reference_can_admit(*case):  # the grader's own consistency check
            raise RuntimeError(f"the reference disagrees with minillm's Scheduler on {case}")
        cases.append(case)
    _check_admit(fn, cases, "a random case, as minillm's Scheduler decides it")


# ---- 05.scheduler_step ------------------------------------------------------------------------------


def reference_schedule_step(running: list[dict], waiting: list[dict], token_budget: int, max_num_seqs: int,
                            free_blocks: int, block_size: int, watermark_blocks: int) -> list[tuple[str, int]]:
    """One step of first-come-first-served continuous batching: [(request id, tokens it computes), ...].

    Each request is {"id", "num_tokens", "num_computed"}: num_tokens - num_computed of its tokens still need
    computing (1 for a decode, more for a prompt), and it holds ceil(num_computed / block_size) blocks.

    1. Running requests, in order (oldest first): each gets min(tokens left, budget left) tokens, and the new
       blocks those tokens need come out of the free pool (the caller leaves enough). None when the budget is
       spent (such a request is not listed).
    2. Waiting requests, in order, while the running ones plus those admitted are fewer than max_num_seqs, some
       budget is left, and the blocks of the request's first chunk (min(tokens, budget left)) plus
       watermark_blocks are free. The first that cannot start stops admission: nobody overtakes it.
    """
    budget, free, out = token_budget, free_blocks, []
    for r in running:
        n = min(r["num_tokens"] - r["num_computed"], budget)
        if n == 0:
            continue
        free -= cdiv(r["num_computed"] + n, block_size) - cdiv(r["num_computed"], block_size)
        out.append((r["id"], n))
        budget -= n
    num_seqs = len(running)
    for r in waiting:
        if num_seqs >= max_num_seqs or budget == 0:
            break
        n = min(r["num_tokens"] - r["num_computed"], budget)
        needed = cdiv(r["num_computed"] + n, block_size) - cdiv(r["num_computed"], block_size)
        if needed + watermark_blocks > free:
            break
        out.append((r["id"], n))
        budget, free, num_seqs = budget - n, free - needed, num_seqs + 1
    return out


scheduler_step = register_task(
    "05.scheduler_step",
    "schedule_step(running: list[dict], waiting: list[dict], token_budget: int, max_num_seqs: int, "
    "free_blocks: int, block_size: int, watermark_blocks: int) -> list[tuple[str, int]]",
    reference=reference_schedule_step,
    forbid=("minillm.engine.scheduler.Scheduler", "minillm.engine.kv_cache.PagedKVCache"),
)


def _step_variant(waiting_first: bool = False, overtake: bool = False, no_chunk: bool = False,
                  no_watermark: bool = False, running_blocks_free: bool = False, seqs_admitted_only: bool = False,
                  zero_entries: bool = False, one_token_running: bool = False, decodes_free: bool = False,
                  no_budget_cap: bool = False) -> Callable:
    """reference_schedule_step with one common mistake switched on."""
    def step(running: list[dict], waiting: list[dict], token_budget: int, max_num_seqs: int, free_blocks: int,
             bs: int, wm: int) -> list[tuple[str, int]]:
        state = {"budget": token_budget, "free": free_blocks, "seqs": 0 if seqs_admitted_only else len(running)}
        out: list[tuple[str, int]] = []

        def run_running() -> None:
            for r in running:
                left = r["num_tokens"] - r["num_computed"]
                n = 1 if one_token_running else left
                if not decodes_free:
                    n = min(n, state["budget"])
                if n == 0:
                    if zero_entries:
                        out.append((r["id"], 0))
                    continue
                if not running_blocks_free:
                    state["free"] -= cdiv(r["num_computed"] + n, bs) - cdiv(r["num_computed"], bs)
                out.append((r["id"], n))
                if not decodes_free:
                    state["budget"] -= n

        def run_waiting() -> None:
            for r in waiting:
                if state["seqs"] >= max_num_seqs or state["budget"] <= 0:
                    if overtake:
                        continue
                    break
                left = r["num_tokens"] - r["num_computed"]
                if no_chunk and left > state["budget"]:
                    if overtake:
                        continue
                    break
                n = left if no_budget_cap else min(left, state["budget"])
                needed = cdiv(r["num_computed"] + n, bs) - cdiv(r["num_computed"], bs)
                if needed + (0 if no_watermark else wm) > state["free"]:
                    if overtake:
                        continue
                    break
                out.append((r["id"], n))
                state["budget"] -= n
                state["free"] -= needed
                state["seqs"] += 1

        if waiting_first:
            run_waiting()
            run_running()
        else:
            run_running()
            run_waiting()
        return out
    return step


_STEP_HOW = ("running requests first, in order: n = min(num_tokens - num_computed, budget left), skip it if n "
             "is 0, take its new blocks from the free count, subtract n from the budget. Then waiting requests in "
             "order: stop at the first one that finds max_num_seqs reached (running + admitted), no budget left, "
             "or fewer than blocks(first chunk) + watermark_blocks free; else admit it with min(tokens, budget "
             "left) tokens.")

_STEP_SUSPECTS: list[tuple[Callable, str]] = [
    (_step_variant(waiting_first=True), "schedule the RUNNING requests first: their decode tokens come before any "
                                        "new prompt, or a burst of arrivals stalls every request already "
                                        "generating (its TPOT spikes). Admit waiting requests with what is left."),
    (_step_variant(decodes_free=True), "decode tokens count against the token budget too: every token of the "
                                       "step, running or new, is one of the forward's max_num_batched_tokens."),
    (_step_variant(zero_entries=True), "a running request that gets no tokens (the budget is spent) is not in "
                                       "the step: leave it out instead of listing it with 0 tokens."),
    (_step_variant(one_token_running=True), "a running request may still be prefilling (num_tokens - num_computed "
                                            "> 1, after a first chunk): give it min(tokens left, budget left), not "
                                            "1 token."),
    (_step_variant(overtake=True), "no overtaking: the first waiting request that cannot start stops admission "
                                   "(break, not continue). Letting smaller requests behind it go first can starve "
                                   "a large one forever; first come, first served."),
    (_step_variant(no_chunk=True), "chunked prefill: a waiting prompt longer than the budget left still starts, "
                                   "with a first chunk of min(tokens, budget left) tokens; the rest runs in later "
                                   "steps."),
    (_step_variant(no_chunk=True, overtake=True), "chunked prefill: a waiting prompt longer than the budget left "
                                                  "starts with a chunk of what is left, and nobody behind it runs "
                                                  "first."),
    (_step_variant(no_budget_cap=True), "a new request's first chunk is at most the budget left: min(num_tokens - "
                                        "num_computed, budget left) tokens."),
    (_step_variant(no_watermark=True), "keep the watermark: admit only if the first chunk's blocks + "
                                       "watermark_blocks <= the blocks still free."),
    (_step_variant(running_blocks_free=True), "the running requests' new tokens take blocks first (a decode that "
                                              "starts a new block takes one): subtract them from free_blocks "
                                              "before you admit anyone."),
    (_step_variant(seqs_admitted_only=True), "max_num_seqs bounds every request in the batch: the running ones "
                                             "count, so admit while len(running) + admitted < max_num_seqs."),
]


def _normalise_step(got: object) -> list | None:
    if not isinstance(got, (list, tuple)):
        return None
    out = []
    for item in got:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            return None
        out.append((item[0], item[1]))
    return out


def _check_steps(fn: Callable, cases: list[tuple], what: str, expected: list | None = None) -> None:
    """Run the reader's step on every case; on the first mismatch, a hint from the wrong version that fits."""
    expected = expected or [reference_schedule_step(*case) for case in cases]
    got = []
    for case in cases:
        g = _normalise_step(fn(*_copy_case(case)))
        if g is None:
            raise MismatchError(f"{what}: schedule_step(...)", "a list of (request id, number of tokens) pairs",
                                short_repr(fn(*_copy_case(case))), "return [(id, n), ...]: running ones first, then "
                                "the admitted waiting ones, each in its queue's order.")
        got.append(g)
    for g, e, case in zip(got, expected, cases):
        if g != e:
            hint = diagnose(got, cases, _STEP_SUSPECTS, _STEP_HOW, _same)
            if hint == _STEP_HOW and sorted(map(repr, g)) == sorted(map(repr, e)):
                hint = ("the right requests and counts, in another order: running ones first, in their order, "
                        "then the admitted ones in the waiting queue's order.")
            running, waiting, budget, seqs, free, bs, wm = case
            raise MismatchError(f"{what}: schedule_step(running={short_repr(running, 300)}, waiting="
                                f"{short_repr(waiting, 300)}, token_budget={budget}, max_num_seqs={seqs}, "
                                f"free_blocks={free}, block_size={bs}, watermark_blocks={wm})", e, g, hint)


def _copy_case(case: tuple) -> tuple:
    running, waiting, *rest = case
    return ([dict(r) for r in running], [dict(r) for r in waiting], *rest)


def _req(rid: str, num_tokens: int, num_computed: int = 0) -> dict:
    return {"id": rid, "num_tokens": num_tokens, "num_computed": num_computed}


def _decode(rid: str, num_computed: int) -> dict:
    return _req(rid, num_computed + 1, num_computed)


@scheduler_step.test("decodes first: 3 running decodes and a 10-token prompt share a budget of 8")
def _(fn: Callable) -> None:
    case = ([_decode("a", 20), _decode("b", 33), _decode("c", 7)], [_req("d", 10)], 8, 16, 100, 16, 0)
    _check_steps(fn, [case], "3 decodes, then a prompt chunk of 5")


@scheduler_step.test("the budget spent by decodes: with a budget of 3, the 4th decode and the queue wait")
def _(fn: Callable) -> None:
    case = ([_decode("a", 20), _decode("b", 33), _decode("c", 7), _decode("d", 2)], [_req("e", 4)], 3, 16, 100, 16,
            0)
    _check_steps(fn, [case], "only 3 tokens of budget")


@scheduler_step.test("a prompt exactly equal to the budget left runs whole, and the next one waits")
def _(fn: Callable) -> None:
    case = ([_decode("a", 5)], [_req("b", 7), _req("c", 5)], 8, 16, 100, 16, 0)
    _check_steps(fn, [case], "1 decode + a 7-token prompt fill a budget of 8")


@scheduler_step.test("chunked prefill: the first waiting prompt that does not fit gets the rest of the budget")
def _(fn: Callable) -> None:
    case = ([_decode("a", 9)], [_req("b", 40), _req("c", 3)], 16, 16, 100, 16, 0)
    _check_steps(fn, [case], "a 40-token prompt behind 1 decode, budget 16")


@scheduler_step.test("a running prompt still prefilling continues with its next chunk, beside a decode")
def _(fn: Callable) -> None:
    case = ([_req("a", 50, 16), _decode("b", 12)], [_req("c", 10)], 40, 16, 100, 16, 0)
    _check_steps(fn, [case], "a 50-token prompt with 16 computed, a decode, a waiting prompt")


@scheduler_step.test("no overtaking: the first waiting request lacks blocks, so the small one behind it waits too")
def _(fn: Callable) -> None:
    case = ([_decode("a", 3)], [_req("b", 20), _req("c", 4)], 64, 16, 3, 4, 0)
    _check_steps(fn, [case], "3 free blocks of 4 tokens; b needs 5, c needs 1")


@scheduler_step.test("the watermark: a 12-token prompt needs 3 blocks + 2 of watermark, and only 4 are free")
def _(fn: Callable) -> None:
    cases = [([_decode("a", 3)], [_req("b", 12)], 64, 16, 4, 4, 2),
             ([_decode("a", 3)], [_req("b", 12)], 64, 16, 5, 4, 2)]
    _check_steps(fn, cases, "watermark_blocks=2")


@scheduler_step.test("max_num_seqs counts the running requests: 2 running, a limit of 3, one admitted")
def _(fn: Callable) -> None:
    case = ([_decode("a", 3), _decode("b", 8)], [_req("c", 2), _req("d", 2), _req("e", 2)], 64, 3, 100, 16, 0)
    _check_steps(fn, [case], "max_num_seqs=3")


@scheduler_step.test("decodes that start a new block take it first: a and b take both free blocks, so d waits")
def _(fn: Callable) -> None:
    case = ([_decode("a", 8), _decode("b", 4), _decode("c", 5)], [_req("d", 4)], 64, 16, 2, 4, 0)
    _check_steps(fn, [case], "blocks of 4: a and b start their 3rd and 2nd blocks")


@scheduler_step.test("agrees with minillm's Scheduler at every step of 4 random workloads (arrivals, small pools, "
                     "small budgets)", time_limit_s=60)
def _(fn: Callable) -> None:
    workloads = [  # seed, requests, blocks, block size, budget, max_num_seqs, watermark, prompts, outputs, arrivals
        (5001, 30, 40, 4, 32, 8, 0.05, (1, 40), (1, 12), 0.5),
        (5002, 30, 64, 16, 64, 6, 0.0, (5, 150), (1, 30), 0.3),
        (5003, 40, 30, 2, 16, 12, 0.1, (1, 20), (1, 8), 0.8),
        (5004, 20, 200, 8, 128, 4, 0.01, (50, 300), (1, 10), 0.6),
    ]
    for workload in workloads:
        cases, expected = [], []
        for state, scheduled, preempted in _engine_steps(*workload):
            if preempted:  # the engine preempted: not part of this task
                continue
            if scheduled != reference_schedule_step(*state):  # the grader's own consistency check
                raise RuntimeError(f"the reference disagrees with minillm's Scheduler on {state}")
            cases.append(state)
            expected.append(scheduled)
        _check_steps(fn, cases, f"a step of minillm's Scheduler (workload seed {workload[0]})", expected)


# ---- 05.goodput -------------------------------------------------------------------------------------


def reference_goodput(requests: list[dict], duration_s: float, slo_ttft: float, slo_tpot: float) -> float:
    """Requests per second that met both SLOs, as `minillm.eval.bench.goodput` counts them.

    Each request is {"ttft": s, "tpot": s, "output_tokens": int, "error": str or None}. A request counts if it
    completed (no error, at least one token), its TTFT <= slo_ttft, and its TPOT <= slo_tpot; a one-token answer
    has no TPOT (nan), so only its TTFT is checked.
    """
    good = 0
    for r in requests:
        if r["error"] is not None or r["output_tokens"] < 1:
            continue
        if r["ttft"] <= slo_ttft and (r["output_tokens"] < 2 or r["tpot"] <= slo_tpot):
            good += 1
    return good / duration_s


goodput = register_task(
    "05.goodput",
    "goodput(requests: list[dict], duration_s: float, slo_ttft: float, slo_tpot: float) -> float"
    "  (each request: {'ttft', 'tpot', 'output_tokens', 'error'})",
    reference=reference_goodput,
    forbid=("minillm.eval.bench.goodput", "minillm.eval.bench.meets_slo", "minillm.eval.bench.online"),
)


def _goodput_variant(either: bool = False, count: bool = False, fraction: bool = False, strict: bool = False,
                     one_token_fails: bool = False, errors_count: bool = False, ttft_only: bool = False,
                     tpot_only: bool = False) -> Callable:
    def gp(requests: list[dict], duration: float, slo_ttft: float, slo_tpot: float) -> float:
        good = 0
        for r in requests:
            if (r["error"] is not None and not errors_count) or r["output_tokens"] < 1:
                continue
            ttft_ok = r["ttft"] < slo_ttft if strict else r["ttft"] <= slo_ttft
            tpot_ok = r["tpot"] < slo_tpot if strict else r["tpot"] <= slo_tpot
            if not one_token_fails and r["output_tokens"] < 2:
                tpot_ok = True
            ok = ttft_ok if ttft_only else tpot_ok if tpot_only else (ttft_ok or tpot_ok) if either else \
                ttft_ok and tpot_ok
            good += ok
        if count:
            return float(good)
        if fraction:
            return good / len(requests) if requests else 0.0
        return good / duration
    return gp


_GOODPUT_HOW = ("count the requests with no error, at least one token, ttft <= slo_ttft and (output_tokens < 2 or "
                "tpot <= slo_tpot); divide by duration_s.")

_GOODPUT_SUSPECTS: list[tuple[Callable, str]] = [
    (_goodput_variant(either=True), "a request is good only if it meets BOTH SLOs: a fast first token followed by "
                                    "a slow stream (or the reverse) is a user served badly. Use `and`."),
    (_goodput_variant(ttft_only=True), "check the TPOT too: a request is good if TTFT <= slo_ttft AND TPOT <= "
                                       "slo_tpot."),
    (_goodput_variant(tpot_only=True), "check the TTFT too: a request is good if TTFT <= slo_ttft AND TPOT <= "
                                       "slo_tpot."),
    (_goodput_variant(one_token_fails=True), "a one-token answer has no TPOT (nan: there is no gap after its first "
                                             "token), and nan <= slo is False. bench.py's rule: check the TPOT only "
                                             "when output_tokens >= 2, so a one-token answer counts on its TTFT."),
    (_goodput_variant(errors_count=True), "a request that ended in an error (refused, cut off at the time limit) "
                                          "was not served, whatever its latencies so far: skip it."),
    (_goodput_variant(strict=True), "meeting an SLO means at most the bound: TTFT <= slo_ttft and TPOT <= "
                                    "slo_tpot (<=, not <)."),
    (_goodput_variant(count=True), "goodput is a rate: divide the number of good requests by duration_s."),
    (_goodput_variant(fraction=True), "goodput is requests per SECOND: divide by duration_s, not by the number of "
                                      "requests (that is the SLO attainment, a fraction)."),
]


def _record(ttft: float, tpot: float, n: int, error: str | None = None) -> dict:
    return {"ttft": ttft, "tpot": tpot if n > 1 else math.nan, "output_tokens": n, "error": error}


def _check_goodput(fn: Callable, cases: list[tuple], what: str, expected: list[float] | None = None) -> None:
    expected = expected or [reference_goodput(*case) for case in cases]
    got = []
    for case in cases:
        g = fn([dict(r) for r in case[0]], *case[1:])
        if isinstance(g, bool) or not isinstance(g, (int, float)):
            raise MismatchError(f"{what}: goodput(...)", "a number (requests per second)", short_repr(g),
                                "return a Python float: good requests / duration_s.")
        got.append(float(g))
    for g, e, case in zip(got, expected, cases):
        if not math.isclose(g, e, rel_tol=1e-9, abs_tol=1e-12):
            requests, duration, slo_ttft, slo_tpot = case
            raise MismatchError(f"{what}: goodput({len(requests)} requests, duration_s={duration}, "
                                f"slo_ttft={slo_ttft}, slo_tpot={slo_tpot})",
                                f"{e:.6g} requests/s ({round(e * duration)} good)", f"{g:.6g}",
                                diagnose(got, cases, _GOODPUT_SUSPECTS, _GOODPUT_HOW, _same))


@goodput.test("5 requests in 10 s: 3 meet both SLOs, one misses the TTFT, one the TPOT -> 0.3 requests/s")
def _(fn: Callable) -> None:
    requests = [_record(0.2, 0.05, 100), _record(0.9, 0.08, 40), _record(1.5, 0.02, 80), _record(0.3, 0.2, 60),
                _record(0.1, 0.01, 10)]
    _check_goodput(fn, [(requests, 10.0, 1.0, 0.1)], "the example")


@goodput.test("no request meets the SLOs: goodput 0, while the throughput is 0.4 requests/s")
def _(fn: Callable) -> None:
    requests = [_record(2.0, 0.05, 100), _record(0.5, 0.3, 40), _record(3.0, 0.5, 80), _record(0.1, 0.11, 60)]
    _check_goodput(fn, [(requests, 10.0, 1.0, 0.1)], "every request late")


@goodput.test("a one-token answer has no TPOT (nan): it counts on its TTFT alone")
def _(fn: Callable) -> None:
    requests = [_record(0.2, math.nan, 1), _record(0.4, math.nan, 1), _record(0.3, 0.05, 20), _record(1.2, math.nan, 1)]
    _check_goodput(fn, [(requests, 4.0, 1.0, 0.1)], "three one-token answers")


@goodput.test("a request that ended in an error does not count, even with good latencies so far")
def _(fn: Callable) -> None:
    requests = [_record(0.2, 0.05, 30, "unfinished at the run's time limit"), _record(math.nan, math.nan, 0,
                                                                                      "HTTP 429: b'queue full'"),
                _record(0.3, 0.05, 20), _record(0.25, 0.04, 12)]
    _check_goodput(fn, [(requests, 2.0, 1.0, 0.1)], "two failed requests")


@goodput.test("at the bound exactly: TTFT = slo_ttft and TPOT = slo_tpot meet the SLOs")
def _(fn: Callable) -> None:
    requests = [_record(0.5, 0.05, 30), _record(0.25, 0.0625, 12), _record(0.5, 0.0625, 2), _record(0.75, 0.01, 5)]
    _check_goodput(fn, [(requests, 8.0, 0.5, 0.0625)], "latencies on the bounds")


def _random_results(rng: random.Random, n: int) -> list[bench.RequestResult]:
    results = []
    for _ in range(n):
        max_tokens = rng.choice([1, 1, 2, 5, 20, 100])
        r = bench.RequestResult(prompt_tokens=rng.randint(16, 128), max_tokens=max_tokens, sent=rng.uniform(0, 20))
        u = rng.random()
        if u < 0.08:
            r.error = "HTTP 429: b'queue full'"
        else:
            t = r.sent + rng.lognormvariate(-1.0, 0.8)
            for _ in range(max_tokens):
                r.token_times.append(t)
                r.output_tokens += 1
                t += rng.lognormvariate(-3.0, 0.6)
            if u < 0.15:
                r.error = "unfinished at the run's time limit"
        results.append(r)
    return results


@goodput.test("agrees with minillm.eval.bench.goodput on 6 random load tests (errors, one-token answers, 3 SLO pairs)")
def _(fn: Callable) -> None:
    rng = random.Random(5050)
    cases, expected = [], []
    for slo_ttft, slo_tpot in ((1.0, 0.1), (0.3, 0.05), (2.0, 0.03)):
        for _ in range(2):
            results = _random_results(rng, 200)
            duration = max((r.token_times[-1] for r in results if r.token_times), default=1.0)
            records = [{"ttft": r.ttft, "tpot": r.tpot, "output_tokens": r.output_tokens, "error": r.error}
                       for r in results]
            cases.append((records, duration, slo_ttft, slo_tpot))
            expected.append(bench.goodput(results, duration, slo_ttft, slo_tpot))
    _check_goodput(fn, cases, "a random load test, vs minillm.eval.bench.goodput", expected)


# ---- 05.static_vs_continuous ------------------------------------------------------------------------


def reference_batching_steps(output_lengths: list[int], batch_size: int) -> tuple[int, int]:
    """(steps of static batching, steps of continuous batching) to generate every request's tokens.

    All requests are there at step 0, in order; each step gives every request in the batch one token.
    Static: batches of batch_size requests in order, each running until its longest member is done.
    Continuous: batch_size slots; a request takes the first slot that frees, at the step after its holder's
    last token. So each request starts when the earliest slot frees, and the total is the last finish.
    """
    static = sum(max(output_lengths[i: i + batch_size]) for i in range(0, len(output_lengths), batch_size))
    slots = [0] * min(batch_size, len(output_lengths))
    for length in output_lengths:
        heapq.heapreplace(slots, slots[0] + length)
    return static, max(slots)


batching_steps = register_task(
    "05.static_vs_continuous",
    "batching_steps(output_lengths: list[int], batch_size: int) -> (static steps, continuous steps)",
    reference=reference_batching_steps,
    forbid=("minillm.engine.scheduler.Scheduler", "minillm.arithmetic.static_batch_utilization"),
)


def _static_wrong(kind: str) -> Callable[[list[int], int], int]:
    def static(lengths: list[int], b: int) -> int:
        if kind == "ideal":
            return cdiv(sum(lengths), b)
        if kind == "sum":
            return sum(lengths)
        if kind == "longest":
            return max(lengths)
        if kind == "sorted":
            ordered = sorted(lengths)
            return sum(max(ordered[i: i + b]) for i in range(0, len(ordered), b))
        return sum(max(lengths[i: i + b]) for i in range(0, len(lengths), b))
    return static


def _continuous_wrong(kind: str) -> Callable[[list[int], int], int]:
    def continuous(lengths: list[int], b: int) -> int:
        if kind == "ideal":
            return cdiv(sum(lengths), b)
        if kind == "round_robin":
            per_slot = [0] * b
            for i, n in enumerate(lengths):
                per_slot[i % b] += n
            return max(per_slot)
        if kind == "longest":
            return max(lengths)
        if kind == "off_by_one":
            return reference_batching_steps(lengths, b)[1] + len(lengths) - min(b, len(lengths))
        return reference_batching_steps(lengths, b)[1]
    return continuous


_BATCH_SUSPECTS: list[tuple[Callable, str]] = [
    (lambda ls, b: (reference_batching_steps(ls, b)[1], reference_batching_steps(ls, b)[0]),
     "return (static, continuous), in that order."),
    (lambda ls, b: (_static_wrong("ideal")(ls, b), reference_batching_steps(ls, b)[1]),
     "a static batch runs until its LONGEST member is done: sum over the batches of max(lengths in it), not "
     "ceil(sum / batch_size) (that is a perfect packing, which static batching is not)."),
    (lambda ls, b: (_static_wrong("sorted")(ls, b), reference_batching_steps(ls, b)[1]),
     "static batches take the requests in arrival order: nobody knows the output lengths in advance, so they "
     "cannot be sorted by them."),
    (lambda ls, b: (_static_wrong("sum")(ls, b), reference_batching_steps(ls, b)[1]),
     "the requests of a static batch run side by side: each batch takes max(lengths in it) steps, not their sum."),
    (lambda ls, b: (reference_batching_steps(ls, b)[0], _continuous_wrong("ideal")(ls, b)),
     "a request cannot be split across slots: in continuous batching a request takes the first slot that frees "
     "and holds it for all its tokens. Simulate the slots (a heap of the steps at which each frees); "
     "ceil(sum / batch_size) is only a lower bound."),
    (lambda ls, b: (reference_batching_steps(ls, b)[0], _continuous_wrong("round_robin")(ls, b)),
     "a waiting request takes the slot that frees FIRST, not slot i % batch_size: keep the slots' free times in "
     "a heap and pop the smallest."),
    (lambda ls, b: (reference_batching_steps(ls, b)[0], _continuous_wrong("longest")(ls, b)),
     "with more requests than slots, the waiting ones start only when a slot frees: simulate the slots."),
    (lambda ls, b: (reference_batching_steps(ls, b)[0], _continuous_wrong("off_by_one")(ls, b)),
     "a waiting request takes a freed slot at the very next step: no step is lost between two requests."),
]

_BATCH_HOW = ("static = sum(max(lengths[i:i + B]) for i in range(0, n, B)); continuous: slots = [0] * B, and for "
              "each length in order: start = the smallest slot time (heapq.heappop), push start + length; the "
              "answer is the largest slot time at the end.")


def _check_batching(fn: Callable, cases: list[tuple], what: str, expected: list | None = None) -> None:
    expected = expected or [reference_batching_steps(*case) for case in cases]
    got = []
    for case in cases:
        g = fn(list(case[0]), case[1])
        if isinstance(g, list):
            g = tuple(g)
        if not isinstance(g, tuple) or len(g) != 2:
            raise MismatchError(f"{what}: batching_steps(...)", "a tuple (static steps, continuous steps)",
                                short_repr(g), "return two ints: return static, continuous.")
        got.append(g)
    for g, e, case in zip(got, expected, cases):
        if g != e:
            raise MismatchError(f"{what}: batching_steps({short_repr(case[0], 200)}, batch_size={case[1]})", e, g,
                                diagnose(got, cases, _BATCH_SUSPECTS, _BATCH_HOW, _same))


@batching_steps.test("8 requests of 50..400 tokens in batches of 4: static 600 steps, continuous 400")
def _(fn: Callable) -> None:
    _check_batching(fn, [([50, 120, 80, 400, 60, 200, 90, 100], 4)], "chapter 05's example")


@batching_steps.test("a waiting request takes the first slot that frees: short ones queue on one slot beside a "
                     "long one")
def _(fn: Callable) -> None:
    _check_batching(fn, [([10, 2, 3, 3, 3], 2), ([1, 9, 1, 1, 1, 1], 2)], "short requests behind a long one")


@batching_steps.test("fewer requests than slots, equal lengths, and a batch of one: both ways agree")
def _(fn: Callable) -> None:
    _check_batching(fn, [([5, 17, 3], 8), ([20] * 6, 3), ([4, 9, 1, 6], 1)], "no waiting")


def _engine_batching_steps(output_lengths: list[int], batch_size: int) -> int:
    """Steps minillm's Scheduler takes for one-token prompts generating output_lengths tokens, max_num_seqs B."""
    total = sum(output_lengths) + 1
    cache = PagedKVCache(_tiny_config(), num_blocks=total, block_size=1, enable_prefix_caching=False)
    scheduler = Scheduler(cache, max_num_seqs=batch_size, max_num_batched_tokens=max(batch_size, 1), watermark=0.0)
    for i, n in enumerate(output_lengths):
        scheduler.add(Sequence(f"r{i}", [1], SamplingParams(max_tokens=n, ignore_eos=True)))
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        _run_step(scheduler, out)
        steps += 1
    return steps


@batching_steps.test("continuous steps equal those of minillm's Scheduler on 6 random workloads", time_limit_s=40)
def _(fn: Callable) -> None:
    rng = random.Random(55)
    cases, expected = [], []
    for _ in range(6):
        lengths = [rng.choice([rng.randint(1, 8), rng.randint(20, 60)]) for _ in range(rng.randint(5, 14))]
        batch = rng.randint(2, 5)
        engine = _engine_batching_steps(lengths, batch)
        ref = reference_batching_steps(lengths, batch)
        if engine != ref[1]:  # the grader's own consistency check
            raise RuntimeError(f"the reference disagrees with minillm's Scheduler on {lengths}, {batch}")
        cases.append((lengths, batch))
        expected.append(ref)
    _check_batching(fn, cases, "random lengths (short and long mixed)", expected)


# ---- for the drills ---------------------------------------------------------------------------------


def scheduler_prefill_steps(prompt_len: int, num_decodes: int, max_num_batched_tokens: int) -> int:
    """Steps minillm's Scheduler takes to prefill a `prompt_len`-token prompt that arrives while `num_decodes`
    requests are decoding, under a token budget of `max_num_batched_tokens` (chunked prefill; blocks plenty).

    Counted from the step the prompt is first scheduled to the step that computes its last prompt token (the
    one that samples its first output token). Drill 05.chunked-prefill-steps computes its answer with it.
    """
    if num_decodes >= max_num_batched_tokens:
        raise ValueError(f"{num_decodes} decodes fill the whole budget of {max_num_batched_tokens} tokens: the prompt "
                         "would never run. Use fewer decodes or a larger budget.")
    block_size = 16
    num_blocks = cdiv(prompt_len + 1, block_size) + num_decodes * cdiv(prompt_len + 2, block_size) + 1
    cache = PagedKVCache(_tiny_config(), num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)
    scheduler = Scheduler(cache, max_num_seqs=num_decodes + 1, max_num_batched_tokens=max_num_batched_tokens,
                          watermark=0.0)
    for i in range(num_decodes):  # one-token prompts that generate for longer than the prompt's prefill takes
        scheduler.add(Sequence(f"decode{i}", [1], SamplingParams(max_tokens=prompt_len + 1, ignore_eos=True)))
    while any(r.num_uncomputed_tokens != 1 or not r.output_token_ids for r in scheduler.sequences.values()):
        _run_step(scheduler, scheduler.schedule())  # until every one of them is decoding
    prompt = Sequence("prompt", [1] * prompt_len, SamplingParams(max_tokens=1))
    scheduler.add(prompt)
    steps = 0
    while prompt.num_computed_tokens < prompt_len:
        out = scheduler.schedule()
        if out.preempted or any(r.request_id != "prompt" and n != 1 for r, n in out.scheduled):
            raise RuntimeError("a decode did not run as one token per step; this helper assumes it does")
        steps += any(r is prompt for r, _ in out.scheduled)
        _run_step(scheduler, out)
    return steps


def launch_bound_roofline_fraction(bytes_moved: float, bandwidth: float, n_kernels: int, launch_s: float,
                                   kernel_s: float) -> float:
    """Fraction of the bandwidth roofline that a decode step issued as `n_kernels` separate launches reaches.

    The roofline step takes bytes_moved / bandwidth. Each kernel costs the host `launch_s` to launch and the GPU
    `kernel_s` to run; launches are asynchronous, but the host never gets ahead of the GPU, so kernel k runs while
    kernel k+1 is being launched: a two-stage pipeline of n_kernels items, n x max(launch_s, kernel_s) +
    min(launch_s, kernel_s). The step can never beat the roofline itself. Drill 05.cuda-graph-launch-bound
    computes its answer with it.
    """
    if min(bytes_moved, bandwidth, n_kernels, launch_s, kernel_s) <= 0:
        raise ValueError("bytes_moved, bandwidth, n_kernels, launch_s and kernel_s must all be positive.")
    roofline_s = bytes_moved / bandwidth
    step_s = n_kernels * max(launch_s, kernel_s) + min(launch_s, kernel_s)
    return roofline_s / max(step_s, roofline_s)
