"""Two runs of the same requests, compared: tokens, text and finish reasons exactly, floats within a tolerance.

Two ways of computing the same completion (one request alone or in a batch, in turns or one step ahead,
eager or compiled, on a CPU with AVX-512 or with AVX2 kernels) add the same numbers in different orders.
Floating-point addition is not associative, so the logits, and the log-probabilities read from them,
differ in their last bits: fp32 keeps 24 bits, a relative step of 6e-8, and a forward pass sums hundreds
of products per dot product through every layer. On the book's 11M model such runs differ by 1e-6 or
less in a log-probability (measured: 1.4e-6 at most, chapter 05's sync and async schedules under
`ATEN_CPU_CAPABILITY=default`). A bug (a wrong position, a stale KV row, a missing penalty) moves a
log-probability by 1e-2 or more, or changes a token. So a tolerance of `LOGPROB_ATOL` = 1e-4 separates
the two by two orders of magnitude on each side.

Tokens are compared exactly: a last-bit difference changes a token only where two candidates tie to
within it, which the book's tests and chapters do not meet (each row samples with its own seeded generator,
so both runs draw the same random numbers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

LOGPROB_ATOL = 1e-4  # see the module docstring: last-bit noise is ~1e-6, a real error ~1e-2

EXACT_FIELDS = ("request_id", "index", "token_ids", "text", "finish_reason")


def output_differences(a: Any, b: Any, atol: float = LOGPROB_ATOL) -> list[str]:
    """How output `b` differs from output `a`; empty when they agree.

    a, b: any two outputs with some of the fields `token_ids`, `text`, `finish_reason`, `request_id`,
    `index` (compared exactly), `logprobs` ([T] floats), `top_logprobs` ([T] dicts id -> logprob: the
    same ids, each logprob within atol) and `cumulative_logprob` (within atol per token).
    """
    found = []
    for name in EXACT_FIELDS:
        if hasattr(a, name) and getattr(a, name) != getattr(b, name, None):
            found.append(f"{name}: {getattr(a, name)!r} != {getattr(b, name, None)!r}")
    if found:  # the floats of different tokens say nothing more
        return found
    lp_a, lp_b = getattr(a, "logprobs", None), getattr(b, "logprobs", None)
    if (lp_a is None) != (lp_b is None):
        found.append(f"logprobs: one run has them and the other not ({lp_a is None} / {lp_b is None})")
    elif lp_a is not None:
        for t, (x, y) in enumerate(zip(lp_a, lp_b)):
            if not math.isclose(x, y, rel_tol=0.0, abs_tol=atol):
                found.append(f"logprobs[{t}]: {x!r} != {y!r} (by {abs(x - y):.2e} > {atol:g})")
    top_a, top_b = getattr(a, "top_logprobs", None), getattr(b, "top_logprobs", None)
    if (top_a is None) != (top_b is None):
        found.append("top_logprobs: one run has them and the other not")
    elif top_a is not None:
        for t, (x, y) in enumerate(zip(top_a, top_b)):
            if set(x) != set(y):
                found.append(f"top_logprobs[{t}]: ids {sorted(x)} != {sorted(y)}")
            elif any(not math.isclose(x[i], y[i], rel_tol=0.0, abs_tol=atol) for i in x):
                found.append(f"top_logprobs[{t}]: {x} != {y} (beyond {atol:g})")
    if hasattr(a, "cumulative_logprob"):
        x, y = a.cumulative_logprob, getattr(b, "cumulative_logprob", float("nan"))
        allowed = atol * max(1, len(getattr(a, "token_ids", ())))
        if not math.isclose(x, y, rel_tol=0.0, abs_tol=allowed):
            found.append(f"cumulative_logprob: {x!r} != {y!r} (by {abs(x - y):.2e} > {allowed:g})")
    return found


def tie_breaks_apart(reference: Any, other: Any, atol: float) -> str | None:
    """Why `other`'s greedy tokens are not `reference`'s, or None if they are, or if they part only where the
    reference's two best candidates tie to within `atol` (after which both continue from different tokens).

    In bf16 on a GPU two logits can be exactly equal, and two kernels that sum in other orders (a matmul of
    another shape) then break the tie apart: a real model meets this where the 11M model does not (SmolLM2's
    chat answers on an H200 met an exact tie at token 15 of 32). reference needs `top_logprobs` with at least
    two candidates per token (SamplingParams(logprobs=2)).
    """
    a, b = list(reference.token_ids), list(other.token_ids)
    if a == b:
        return None
    j = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if j >= min(len(a), len(b)):
        return f"one run stops at token {j}, the other goes on"
    top = reference.top_logprobs[j]
    best = sorted(top.values(), reverse=True)[:2]
    if b[j] in top and len(best) == 2 and best[0] - best[1] <= atol and best[0] - top[b[j]] <= atol:
        return None
    return f"token {j}: {b[j]} where the reference has {a[j]} (its top candidates there: {top})"


def max_logprob_difference(a: Sequence[Any], b: Sequence[Any]) -> float:
    """The largest |logprob difference| over paired outputs' tokens (0.0 where none has logprobs)."""
    return max((abs(x - y) for oa, ob in zip(a, b) if oa.logprobs and ob.logprobs
                for x, y in zip(oa.logprobs, ob.logprobs)), default=0.0)


def assert_same_outputs(a: Sequence[Any], b: Sequence[Any], atol: float = LOGPROB_ATOL) -> None:
    """Raise AssertionError naming every output of `b` that differs from its partner in `a` (see
    `output_differences`), and any difference in how many there are."""
    if len(a) != len(b):
        raise AssertionError(f"{len(a)} outputs in the first run, {len(b)} in the second")
    problems = [f"output {i}: " + "; ".join(d) for i, (x, y) in enumerate(zip(a, b))
                if (d := output_differences(x, y, atol))]
    if problems:
        raise AssertionError("the two runs differ beyond floating-point noise:\n" + "\n".join(problems))
