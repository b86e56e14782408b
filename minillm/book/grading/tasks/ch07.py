"""Chapter 07's exercise tasks: the residual distribution, the verify step of speculative sampling, the expected
tokens per target forward, and the number of drafted tokens that maximises the speed-up.

The residual is checked against `minillm.sampler.speculative.residual_distribution` on random pairs of distributions
and on hand-made cases. The verify step is checked in a deterministic form: the reader's function is handed the uniforms
and a `residual_sample` callable instead of a random generator, so each case has one right answer (the tokens
emitted, and the one distribution handed to `residual_sample`). A probe records what it was handed and draws that
distribution's most likely token; the answers are compared with `reference_verify_step`, which mirrors
`minillm.sampler.speculative.verify` (the grader checks the two against each other on steps whose outcome is
certain). Then the reader's rule runs with real random draws, 20,000 steps, and chi-squared tests compare each
emitted position's tokens with the target's row, and the step lengths with what the acceptance rates give: the rule
is lossless or it is not. The two formulas are checked against `minillm.arithmetic.expected_tokens_per_step` and
`minillm.arithmetic.best_speculation_length`.

Each wrong answer is diagnosed by running the common wrong versions on the same cases: the hint names the first
one the reader's answers agree with.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch

from minillm import arithmetic
from minillm.book.grading.probes import as_tokens, record_draws, sample_steps
from minillm.book.grading.registry import (
    MismatchError,
    call_catching,
    call_probed,
    diagnose,
    expect_close,
    is_number,
    register_task,
    short_repr,
)
from minillm.sampler import speculative


def _distributions(gen: torch.Generator, rows: int, vocab: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`rows` random probability rows over `vocab` tokens, some flat and some peaked: softmax(scale x N(0, 1))."""
    scale = 0.5 + 3.0 * torch.rand(rows, 1, generator=gen, dtype=torch.float64)
    return (scale * torch.randn(rows, vocab, generator=gen, dtype=torch.float64)).softmax(-1).to(dtype)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True)


# ---- 07.residual ------------------------------------------------------------------------------------


def reference_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): the mass the target puts beyond the drafter, renormalised to sum to 1 (p's dtype).

    It is the distribution a rejected draft's replacement is drawn from; with it the emitted token is distributed
    exactly as p. Where p <= q everywhere (only when p == q, and then nothing is ever rejected) it returns p, as
    minillm does; the tests never ask that case.
    """
    residual = (p - q).clamp(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=torch.finfo(p.dtype).tiny), p)


residual_task = register_task(
    "07.residual",
    "residual(p: Tensor[V], q: Tensor[V]) -> Tensor[V]  (norm(max(0, p - q)), in p's dtype)",
    reference=reference_residual,
    forbid=("minillm.sampler.speculative.residual_distribution",),
)

_RESIDUAL_HOW = ("r = (p - q).clamp(min=0), the target's mass beyond the drafter's; return r / r.sum(), so that it "
                 "sums to 1.")

_RESIDUAL_SUSPECTS: list[tuple[Callable, str]] = [
    (lambda p, q: (p - q).clamp(min=0),
     "renormalise: max(0, p - q) sums to the rejection probability 1 - sum(min(p, q)), not to 1. Divide it by its "
     "sum: r = (p - q).clamp(min=0); r / r.sum()."),
    (lambda p, q: _norm((q - p).clamp(min=0)),
     "it is max(0, p - q), the TARGET minus the drafter: the replacement must land where the target wants more "
     "than the drafter proposed (there the accepted drafts fall short), not where it wants less."),
    (lambda p, q: (q - p).clamp(min=0),
     "it is max(0, p - q), the TARGET minus the drafter, and renormalised to sum to 1."),
    (lambda p, q: p - q,
     "clamp at zero and renormalise: p - q is negative where the drafter over-proposes (accepted drafts already "
     "give those tokens all the mass the target wants), and it sums to 0. norm(max(0, p - q)) = "
     "(p - q).clamp(min=0) / its sum."),
    (lambda p, q: _norm(p - q),
     "clamp at zero BEFORE you normalise: p - q sums to 0 (both sum to 1), so dividing it by its sum gives inf "
     "and nan. r = (p - q).clamp(min=0); r / r.sum()."),
    (lambda p, q: _norm((p - q).abs()),
     "max(0, p - q), not |p - q|: where the drafter over-proposes (q > p) the residual is 0."),
    (lambda p, q: _norm(p * (p > q)),
     "only the excess counts: max(0, p - q), not p itself where p > q. The accepted drafts already give each token "
     "min(p, q); the residual adds what is missing, p - q."),
]


def _same_tensor(a: object, b: object) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-4, equal_nan=True))


def _check_residual(fn: Callable, cases: list[tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
    got = []
    for p, q in cases:
        g = fn(p.clone(), q.clone())
        if not isinstance(g, torch.Tensor):
            raise MismatchError(f"{what}: residual(p, q)", f"a torch.Tensor of shape ({p.shape[0]},)",
                                f"{type(g).__name__} {short_repr(g, 80)}", "return a tensor: (p - q).clamp(min=0) "
                                "renormalised, with torch operations.")
        got.append(g)
    for g, (p, q) in zip(got, cases):
        e = reference_residual(p, q)
        if _same_tensor(g, e) and g.dtype == e.dtype:
            continue
        if _same_tensor(g, e):
            hint = f"keep p's dtype ({p.dtype}): compute with p and q's own tensors, without converting them."
        else:
            hint = diagnose(got, cases, _RESIDUAL_SUSPECTS, _RESIDUAL_HOW, _same_tensor)
        shown = f"p={[round(x, 3) for x in p.tolist()]}, q={[round(x, 3) for x in q.tolist()]}" if p.numel() <= 8 \
            else f"p, q of {p.numel()} tokens ({p.dtype})"
        expect_close(g, e, f"{what}: residual({shown})", hint, atol=1e-5, rtol=1e-4)


@residual_task.test("p = (0.5, 0.3, 0.1, 0.1), q = (0.2, 0.2, 0.4, 0.2): max(0, p - q) = (0.3, 0.1, 0, 0), "
                    "renormalised (0.75, 0.25, 0, 0)")
def _(fn: Callable) -> None:
    p = torch.tensor([0.5, 0.3, 0.1, 0.1])
    q = torch.tensor([0.2, 0.2, 0.4, 0.2])
    _check_residual(fn, [(p, q), (q.flip(0), p.flip(0))], "the example")


@residual_task.test("a deterministic drafter (q one-hot at x, as n-gram lookup): the residual is p without x, "
                    "renormalised")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(701)
    cases = []
    for vocab, x in ((5, 2), (10, 0), (32, 31)):
        p = _distributions(gen, 1, vocab)[0]
        cases.append((p, torch.nn.functional.one_hot(torch.tensor(x), vocab).float()))
    _check_residual(fn, cases, "q one-hot")


@residual_task.test("agrees with minillm.sampler.speculative.residual_distribution on 40 random pairs "
                    "(V from 2 to 1,000, float32 and float64)")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(702)
    rng = random.Random(702)
    cases = []
    for _ in range(40):
        vocab, dtype = rng.choice([2, 3, 7, 50, 1000]), rng.choice([torch.float32, torch.float64])
        p, q = _distributions(gen, 2, vocab, dtype)
        if not torch.allclose(reference_residual(p, q), speculative.residual_distribution(p, q)):
            raise RuntimeError("the reference disagrees with minillm.sampler.speculative.residual_distribution")  # the
            # grader's own consistency check
        cases.append((p, q))
    _check_residual(fn, cases, "a random pair")


@residual_task.test("a drafter that is almost right (p and q 1% apart, float64): the small residual still sums to 1")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(703)
    cases = []
    for vocab in (4, 100):
        q = _distributions(gen, 1, vocab, torch.float64)[0]
        p = _norm(q * (1 + 0.02 * torch.rand(vocab, generator=gen, dtype=torch.float64)))
        cases.append((p, q))
    _check_residual(fn, cases, "p close to q")


# ---- 07.verify_step ---------------------------------------------------------------------------------


def reference_verify_step(p: torch.Tensor, q: torch.Tensor, draft_tokens: Sequence[int], uniforms: Sequence[float],
                          residual_sample: Callable[[torch.Tensor], int]) -> list[int]:
    """Speculative sampling's verify step with its randomness handed in (`minillm.sampler.speculative.verify`'s rule).

    p [k + 1, V]: the target's rows (row i scores draft i, row k is the bonus row); q [k, V]: the drafter's.
    Draft i, x = draft_tokens[i], is accepted iff uniforms[i] * q[i, x] < p[i, x] (u < p/q: probability
    min(1, p(x)/q(x))). At the first rejection, one token y = residual_sample(norm(max(0, p[i] - q[i]))) replaces
    it and the step ends; if all k pass, the bonus y = residual_sample(p[k]). Returns draft_tokens[:i] + [y].
    """
    for i, x in enumerate(draft_tokens):
        if uniforms[i] * float(q[i, x]) < float(p[i, x]):
            continue
        return [int(t) for t in draft_tokens[:i]] + [int(residual_sample(reference_residual(p[i], q[i])))]
    return [int(t) for t in draft_tokens] + [int(residual_sample(p[len(draft_tokens)]))]


verify_step_task = register_task(
    "07.verify_step",
    "verify_step(p: Tensor[k+1, V], q: Tensor[k, V], draft_tokens: list[int], uniforms: list[float], "
    "residual_sample: Callable[[Tensor[V]], int]) -> list[int]  (accepted drafts + one token)",
    reference=reference_verify_step,
    forbid=("minillm.sampler.speculative.verify", "minillm.sampler.speculative.verify_greedy",
            "minillm.sampler.speculative.residual_distribution"),
)


def _verify_variant(accept: str = "rule", resample: str = "residual", keep_rejected: bool = False,
                    bonus: str = "p[k]") -> Callable:
    """reference_verify_step with one common mistake switched on."""
    def verify_step(p: torch.Tensor, q: torch.Tensor, drafts: list[int], uniforms: list[float],
                    residual_sample: Callable) -> list[int]:
        k = len(drafts)
        for i, x in enumerate(drafts):
            u, px, qx = uniforms[i], float(p[i, x]), float(q[i, x])
            ok = {"rule": u * qx < px, "always": True, "p>q": px > qx, "p>=q": px >= qx, "u<p": u < px,
                  "q/p": u * px < qx, "u>=p/q": u * qx >= px}[accept]
            if ok:
                continue
            if resample == "residual":
                dist = reference_residual(p[i], q[i])
            elif resample == "p":
                dist = p[i]
            elif resample == "q":
                dist = q[i]
            elif resample == "unnormalised":
                dist = (p[i] - q[i]).clamp(min=0)
            else:  # "swapped"
                dist = _norm((q[i] - p[i]).clamp(min=0))
            kept = drafts[: i + 1] if keep_rejected else drafts[:i]
            return [int(t) for t in kept] + [int(residual_sample(dist))]
        if bonus == "none":
            return [int(t) for t in drafts]
        return [int(t) for t in drafts] + [int(residual_sample(p[k - 1] if bonus == "p[k-1]" else p[k]))]
    return verify_step


_VERIFY_HOW = ("for i, x in enumerate(draft_tokens): if uniforms[i] * q[i, x] < p[i, x], keep x and go on; else "
               "return draft_tokens[:i] + [residual_sample(residual(p[i], q[i]))]. After the loop (all k accepted): "
               "return draft_tokens + [residual_sample(p[k])]. Use the uniforms given, and draw only with "
               "residual_sample.")

_ACCEPT_RULE = "accept draft i iff uniforms[i] * q[i, x] < p[i, x] (u < p(x) / q(x): probability min(1, p/q))"

_VERIFY_SUSPECTS: list[tuple[Callable, str]] = [
    (_verify_variant(bonus="none"),
     "when all k drafts are accepted, the target's last row p[k] still gives one more token, the bonus: return "
     "draft_tokens + [residual_sample(p[k])]. A step always emits between 1 and k + 1 tokens."),
    (_verify_variant(accept="always"),
     f"a draft is kept only with probability min(1, p(x) / q(x)): {_ACCEPT_RULE}. Keeping every draft emits the "
     "drafter's distribution q, not the target's."),
    (_verify_variant(accept="always", bonus="none"),
     f"a draft is kept only with probability min(1, p(x) / q(x)): {_ACCEPT_RULE}; and when all k pass, the target "
     "adds a bonus token from p[k]."),
    (_verify_variant(accept="p>q"),
     f"the test is random: {_ACCEPT_RULE}. A draft the target likes less than the drafter (p(x) < q(x)) is still "
     "kept with probability p(x)/q(x); rejecting it every time leaves too little mass on it."),
    (_verify_variant(accept="p>=q"),
     f"the test is random: {_ACCEPT_RULE}. A draft the target likes less than the drafter (p(x) < q(x)) is still "
     "kept with probability p(x)/q(x); rejecting it every time leaves too little mass on it."),
    (_verify_variant(accept="u<p"),
     f"divide by the drafter's probability: {_ACCEPT_RULE}. u < p(x) alone is the rule for a deterministic "
     "drafter only (q one-hot, q(x) = 1)."),
    (_verify_variant(resample="p"),
     "after a rejection, draw from the residual norm(max(0, p[i] - q[i])), not from p[i]: the acceptance test "
     "already gives each token min(p, q), and only the rest, max(0, p - q), is missing. Resampling from p counts "
     "the accepted mass twice, and the output is no longer distributed as p."),
    (_verify_variant(accept="u<p", resample="p"),
     f"that rule ignores the drafter: {_ACCEPT_RULE}, and after a rejection draw from the residual "
     "norm(max(0, p[i] - q[i])). Accepting with probability p(x) and resampling from p over-weights every token "
     "the drafter proposes often."),
    (_verify_variant(accept="q/p"),
     f"the ratio is the TARGET's probability over the drafter's, p(x) / q(x), not q/p: {_ACCEPT_RULE}."),
    (_verify_variant(accept="u>=p/q"),
     f"a SMALL uniform accepts: {_ACCEPT_RULE}; u >= p/q is the rejection."),
    (_verify_variant(bonus="p[k-1]"),
     "the bonus comes from p[k], the target's row after the LAST draft (p has k + 1 rows); p[k - 1] is the row the "
     "last draft was checked against."),
    (_verify_variant(resample="q"),
     "after a rejection, draw from the residual norm(max(0, p[i] - q[i])), not from the drafter's q[i]."),
    (_verify_variant(resample="unnormalised"),
     "hand residual_sample a distribution: max(0, p[i] - q[i]) renormalised to sum to 1 (your residual() of task "
     "1)."),
    (_verify_variant(resample="swapped"),
     "the residual is norm(max(0, p[i] - q[i])): the target minus the drafter (your residual(p[i], q[i]))."),
    (_verify_variant(keep_rejected=True),
     "a rejected draft is not emitted: return draft_tokens[:i] (the accepted ones) + [the token drawn from the "
     "residual], which takes its place."),
]


def _recorded(suspects: list[tuple[Callable, str]]) -> list[tuple[Callable, str]]:
    """The wrong versions run through `record_draws`, as the reader's is: each gives (tokens, distributions)."""
    return [(lambda *case, wrong=wrong: record_draws(wrong, *case), hint) for wrong, hint in suspects]


def _same_record(a: tuple[list[int], list[torch.Tensor]], b: tuple[list[int], list[torch.Tensor]]) -> bool:
    (tokens_a, dists_a), (tokens_b, dists_b) = a, b
    return tokens_a == tokens_b and len(dists_a) == len(dists_b) and all(
        d.shape == e.shape and torch.allclose(d, e.double(), atol=1e-5, rtol=1e-4, equal_nan=True)
        for d, e in zip(dists_a, dists_b))


def _name_distribution(d: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> str:
    """What the reader handed residual_sample, by name where it is one of the usual suspects."""
    k = q.shape[0]
    named = [(reference_residual(p[i], q[i]), f"residual(p[{i}], q[{i}])") for i in range(k)]
    named += [(p[j], f"p[{j}]") for j in range(k + 1)] + [(q[i], f"q[{i}]") for i in range(k)]
    named += [((p[i] - q[i]).clamp(min=0), f"max(0, p[{i}] - q[{i}]) (not renormalised)") for i in range(k)]
    named += [(_norm((q[i] - p[i]).clamp(min=0)), f"norm(max(0, q[{i}] - p[{i}]))") for i in range(k)]
    for candidate, name in named:
        if d.shape == candidate.shape and torch.allclose(d, candidate.double(), atol=1e-5, rtol=1e-4):
            return name
    if d.numel() <= 8:
        return f"[{', '.join(f'{x:.3f}' for x in d.tolist())}]"
    return f"a distribution over {d.numel()} tokens that is none of p[j], q[i], residual(p[i], q[i])"


def _show_record(record: tuple[list[int], list[torch.Tensor]], p: torch.Tensor, q: torch.Tensor) -> str:
    tokens, dists = record
    if not dists:
        return f"{tokens}, without calling residual_sample"
    calls = ", ".join(f"residual_sample({_name_distribution(d, p, q)})" for d in dists)
    return f"{tokens}, after {calls}"


def _describe_step(case: tuple) -> str:
    p, q, drafts, uniforms = case
    text = (f"verify_step(p [{p.shape[0]}, {p.shape[1]}], q [{q.shape[0]}, {q.shape[1]}], draft_tokens={drafts}, "
            f"uniforms=[{', '.join(f'{u:.3f}' for u in uniforms)}])")
    checks = [f"draft {i}: u {uniforms[i]:.3f} vs p/q {float(p[i, x]):.3f}/{float(q[i, x]):.3f}"
              for i, x in enumerate(drafts[:6])]
    return f"{text}; {'; '.join(checks)}"


def _check_steps(fn: Callable, cases: list[tuple], what: str) -> None:
    """Run the reader's verify step on every case through the recording probe; on the first mismatch, a hint
    from the wrong version that fits."""
    records = []
    for p, q, drafts, uniforms in cases:
        got, given = call_probed(fn, record_draws, p.clone(), q.clone(), list(drafts), list(uniforms))
        tokens = as_tokens(got)
        if tokens is None:
            raise MismatchError(f"{what}: {_describe_step((p, q, drafts, uniforms))}",
                                "a list of ints (the accepted drafts, then one token)", short_repr(got),
                                "return a list of Python ints: draft_tokens[:i] + [residual_sample(...)], the "
                                "token residual_sample returned last.")
        records.append((tokens, list(given)))
    for record, case in zip(records, cases):
        expected = record_draws(reference_verify_step, *case)
        if _same_record(record, expected):
            continue
        hint = diagnose(records, cases, _recorded(_VERIFY_SUSPECTS), _VERIFY_HOW, _same_record)
        if hint == _VERIFY_HOW:
            calls = len(record[1])
            if calls > 1:
                hint = ("call residual_sample exactly once per step: with the residual of the first rejected row, "
                        "or with p[k] for the bonus token when every draft is accepted. It returns the drawn "
                        "token.")
            elif calls == 0 and len(record[0]) > 0:
                hint = ("draw the step's last token by calling residual_sample(distribution) (the checker "
                        "controls the draws through it), not with torch.multinomial or a sampler of your own.")
        raise MismatchError(f"{what}: {_describe_step(case)}", _show_record(expected, case[0], case[1]),
                            _show_record(record, case[0], case[1]), hint)


def _uniform_away_from(gen: torch.Generator, px: float, qx: float) -> float:
    """A uniform whose accept/reject outcome does not depend on float rounding: |u * q(x) - p(x)| > 1e-4."""
    while True:
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if abs(u * qx - px) > 1e-4:
            return u


def _random_step(gen: torch.Generator, rng: random.Random, k: int, vocab: int) -> tuple:
    """A random case: target and drafter rows, drafts drawn from q, uniforms away from the accept threshold.
    Some rows are one-hot drafters (n-gram lookup), some targets have tokens at probability 0 (top-k)."""
    p = _distributions(gen, k + 1, vocab)
    if rng.random() < 0.3:  # a target filtered by top-k: most tokens at 0, so drafts of them are always rejected
        keep = max(2, vocab // 3)  # at least two tokens: p is never one-hot, so never equal to a one-hot q
        top = p.topk(keep, dim=-1).indices
        p = _norm(torch.zeros_like(p).scatter(-1, top, p.gather(-1, top)))
    q = _distributions(gen, k, vocab)
    drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
    if rng.random() < 0.2:  # a deterministic drafter: q one-hot at each draft
        q = torch.nn.functional.one_hot(torch.tensor(drafts), vocab).float()
    uniforms = [_uniform_away_from(gen, float(p[i, x]), float(q[i, x])) for i, x in enumerate(drafts)]
    return p, q, drafts, uniforms


def _example_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """The notebook's example: k = 3 drafts over V = 4 tokens."""
    p = torch.tensor([[0.50, 0.20, 0.20, 0.10],
                      [0.30, 0.40, 0.10, 0.20],
                      [0.10, 0.60, 0.20, 0.10],
                      [0.25, 0.15, 0.15, 0.45]])
    q = torch.tensor([[0.40, 0.30, 0.20, 0.10],
                      [0.05, 0.30, 0.50, 0.15],
                      [0.20, 0.30, 0.30, 0.20]])
    return p, q


@verify_step_task.test("k = 3: draft 0 passes (p/q = 1.25), draft 1 is rejected (u = 0.9, p/q = 0.2): emit draft 0, "
                       "then a token drawn from residual(p[1], q[1])")
def _(fn: Callable) -> None:
    p, q = _example_rows()
    _check_steps(fn, [(p, q, [0, 2, 1], [0.7, 0.9, 0.1])], "the example")


@verify_step_task.test("every draft accepted: the k drafts, then the bonus token drawn from p[k]")
def _(fn: Callable) -> None:
    p, q = _example_rows()
    _check_steps(fn, [(p, q, [0, 2, 1], [0.95, 0.15, 0.2]), (p[1:], q[1:], [1, 2], [0.5, 0.6])],
                 "no rejection")


@verify_step_task.test("the first draft rejected: one token, drawn from residual(p[0], q[0]); the drafts after it "
                       "are not looked at")
def _(fn: Callable) -> None:
    p, q = _example_rows()
    _check_steps(fn, [(p[1:], q[1:], [2, 1], [0.5, 0.01]), (p[1:3], q[1:2], [2], [0.3])], "a rejection at once")


@verify_step_task.test("p(x) >= q(x) is accepted whatever u; p(x) = 0 is always rejected; a one-hot drafter is "
                       "accepted iff u < p(x)")
def _(fn: Callable) -> None:
    p, q = _example_rows()
    zero = torch.tensor([[0.0, 0.5, 0.3, 0.2], [0.1, 0.2, 0.3, 0.4]])
    one_hot = torch.nn.functional.one_hot(torch.tensor([1, 3]), 4).float()
    _check_steps(fn, [(p[:2], q[:1], [0], [0.999]), (zero, q[:1], [0], [0.001]),
                      (p[:3], one_hot, [1, 3], [0.15, 0.3]), (p[:3], one_hot, [1, 3], [0.25, 0.3])],
                 "certain and one-hot cases")


def _certain_steps(gen: torch.Generator, n: int) -> list[tuple]:
    """Steps whose outcome does not depend on any draw: each draft has p(x) = q(x) (accepted, u < 1) or p(x) = 0
    (rejected), and the residual or bonus row is one-hot. Used to check the reference against minillm's `verify`."""
    vocab, steps = 6, []
    for _ in range(n):
        k = int(torch.randint(1, 5, (), generator=gen))
        q = _distributions(gen, k, vocab)
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        p = torch.cat([q, torch.zeros(1, vocab)])
        reject = int(torch.randint(0, k + 1, (), generator=gen))  # k: every draft accepted
        others = [t for t in range(vocab) if reject == k or t != drafts[reject]]
        y = others[int(torch.randint(0, len(others), (), generator=gen))]
        p[reject] = torch.nn.functional.one_hot(torch.tensor(y), vocab).float()  # p(x) = 0, residual = y
        steps.append((p, q, drafts, [0.5] * k))
    return steps


@verify_step_task.test("agrees with the rule on 200 random steps (k from 1 to 6, V from 3 to 50, top-k targets, "
                       "one-hot drafters)")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(707)
    for p, q, drafts, uniforms in _certain_steps(gen, 20):  # the grader's own consistency check
        mine = reference_verify_step(p, q, drafts, uniforms, lambda d: int(d.argmax()))
        if mine != speculative.verify(p, drafts, q, generator=torch.Generator().manual_seed(1)):
            raise RuntimeError(f"the reference disagrees with minillm.sampler.speculative.verify on {drafts}, {p}, {q}")
    rng = random.Random(707)
    cases = [_random_step(gen, rng, rng.randint(1, 6), rng.choice([3, 5, 8, 50])) for _ in range(200)]
    _check_steps(fn, cases, "a random step")


# The 0.999 quantiles of the chi-squared distribution (scipy.stats.chi2.ppf(0.999, df), or any table): a test at
# p = 0.001. For even df the tail is exactly exp(-x/2) * sum_{j < df/2} (x/2)^j / j!, which is 0.001 at these x.
_CHI2_CRITICAL_0_001 = {2: 13.816, 4: 18.467}

_STAT_P = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05],
                        [0.10, 0.15, 0.20, 0.25, 0.30],
                        [0.05, 0.15, 0.50, 0.20, 0.10]], dtype=torch.float64)
_STAT_Q = torch.tensor([[0.10, 0.20, 0.40, 0.20, 0.10],
                        [0.30, 0.25, 0.20, 0.15, 0.10]], dtype=torch.float64)
_STAT_TRIALS, _STAT_SEED = 20_000, 7070


def _chi_squared(observed: list[int], probs: list[float]) -> float:
    n = sum(observed)
    if n == 0:  # no step got there: as far from the expected frequencies as can be
        return math.inf
    return sum((o - n * e) ** 2 / (n * e) for o, e in zip(observed, probs))


def _fmt(values: Sequence[float]) -> str:
    return "(" + ", ".join(f"{v:.3f}" for v in values) + ")"


@verify_step_task.test("lossless: 20,000 steps with real random draws (V = 5, k = 2); each emitted position's "
                       "tokens follow the target's row, and the step lengths the acceptance rates (chi-squared, "
                       "p = 0.001)", time_limit_s=90)
def _(fn: Callable) -> None:
    p, q = _STAT_P.float(), _STAT_Q.float()
    out = call_probed(fn, sample_steps, p, q, _STAT_TRIALS, _STAT_SEED)
    if out["bad"] is not None:
        raise MismatchError("verify_step with random drafts and uniforms", "1 to k + 1 = 3 token ids in 0..4",
                            out["bad"], "return draft_tokens[:i] + [the token residual_sample returned].")
    alphas = [float(torch.minimum(_STAT_P[i], _STAT_Q[i]).sum()) for i in range(2)]  # P(accept) = sum min(p, q)
    length_probs = [1 - alphas[0], alphas[0] * (1 - alphas[1]), alphas[0] * alphas[1]]
    checks = [(f"the tokens emitted at position {pos}, over {sum(out['counts'][pos]):,} steps that reached it",
               out["counts"][pos], _STAT_P[pos].tolist(), f"p[{pos}]") for pos in range(3)]
    checks.append((f"the number of tokens per step over {_STAT_TRIALS:,} steps", out["lengths"][1:],
                   length_probs, "1 - a0, a0 (1 - a1), a0 a1 (a_i = sum min(p[i], q[i]))"))
    for what, observed, probs, name in checks:
        stat, df = _chi_squared(observed, probs), len(probs) - 1
        if stat > _CHI2_CRITICAL_0_001[df]:
            n = max(sum(observed), 1)
            gen, rng = torch.Generator().manual_seed(7071), random.Random(7071)
            cases = [_random_step(gen, rng, rng.randint(1, 4), 5) for _ in range(60)]
            records = [(as_tokens(got) or [], list(given)) for got, given in
                       (call_probed(fn, record_draws, *case) for case in cases)]
            hint = diagnose(records, cases, _recorded(_VERIFY_SUSPECTS), "", _same_record) or (
                "each token a step emits must be distributed exactly as the target's row at its position: "
                f"{_VERIFY_HOW}")
            shown = _fmt([o / n for o in observed]) if sum(observed) else "no step emitted a token there"
            raise MismatchError(what, f"frequencies close to {name} = {_fmt(probs)}",
                                f"{shown}: chi-squared {stat:.1f} > "
                                f"{_CHI2_CRITICAL_0_001[df]} (df {df}), p < 0.001", hint)


# ---- 07.expected_tokens -----------------------------------------------------------------------------


def reference_expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per target forward with k drafts, each accepted with probability alpha independently:
    1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha), and k + 1 at alpha = 1."""
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


expected_tokens_task = register_task(
    "07.expected_tokens",
    "expected_tokens(alpha: float, k: int) -> float  (tokens per target forward)",
    reference=reference_expected_tokens,
    forbid=("minillm.arithmetic.expected_tokens_per_step", "minillm.arithmetic.speculative_speedup"),
)

_EXPECTED_HOW = ("the step emits at least j tokens when the first j - 1 drafts pass (probability alpha^(j-1)), for "
                 "j = 1..k+1: E = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha), and k + 1 when "
                 "alpha == 1.")

_ALPHA_ONE = ("at alpha = 1 every draft passes: k + 1 tokens. The closed form is 0/0 there: return k + 1 when "
              "alpha == 1 (the limit of 1 + alpha + ... + alpha^k).")

def _geometric(alpha: float, n: int) -> float:
    """1 + alpha + ... + alpha^(n-1), n at alpha = 1: the wrong versions' sums, with their limit at alpha = 1."""
    return float(n) if alpha == 1 else (1 - alpha ** n) / (1 - alpha)


_EXPECTED_SUSPECTS: list[tuple[Callable, str]] = [
    (lambda a, k: _geometric(a, k),
     "the sum has k + 1 terms, 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha): the (k+1)-th token is "
     "the bonus, emitted when all k drafts pass (probability alpha^k). (1 - alpha^k) / (1 - alpha) stops one "
     "term short."),
    (lambda a, k: a * k,
     "drafts are checked in order and the step stops at the first rejection: draft j counts only if drafts 1..j "
     "all pass (probability alpha^j), and the target always adds one token of its own. alpha * k counts each draft "
     "as if the ones before it did not matter. E = 1 + alpha + ... + alpha^k."),
    (lambda a, k: a * k + 1,
     "draft j is emitted only if drafts 1..j ALL pass, probability alpha^j, not alpha: E = 1 + alpha + alpha^2 + "
     "... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)."),
    (lambda a, k: a * _geometric(a, k),
     "count the target's own token too: every step ends with one, the replacement at the first rejection or the "
     "bonus after k acceptances. E = 1 + alpha + ... + alpha^k."),
    (lambda a, k: 1 / (1 - a),
     "the run is capped at k drafts: 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha); 1 / (1 - alpha) "
     "is the k -> infinity limit."),
    (lambda a, k: float(k + 1),
     "k + 1 is the best case, when every draft passes (alpha = 1); a draft fails with probability 1 - alpha and "
     "ends the step. E = (1 - alpha^(k+1)) / (1 - alpha)."),
]


def _same_number(a: object, b: object) -> bool:
    return is_number(a) and is_number(b) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _check_expected(fn: Callable, cases: list[tuple[float, int]], what: str) -> None:
    got = []
    for alpha, k in cases:
        g = call_catching(fn, (alpha, k), "ZeroDivisionError", f"{what}: expected_tokens({alpha}, {k})",
                           f"{reference_expected_tokens(alpha, k):.6g}", _ALPHA_ONE)
        if not is_number(g):
            raise MismatchError(f"{what}: expected_tokens({alpha}, {k})", "a number (tokens per target forward)",
                                f"{type(g).__name__} {short_repr(g, 80)}", "return a Python float (float(x) for a "
                                "tensor or numpy value).")
        got.append(g)
    for g, (alpha, k) in zip(got, cases):
        e = reference_expected_tokens(alpha, k)
        if not _same_number(g, e):
            hint = _ALPHA_ONE if alpha == 1 and not math.isfinite(g) else \
                diagnose(got, cases, _EXPECTED_SUSPECTS, _EXPECTED_HOW, _same_number)
            raise MismatchError(f"{what}: expected_tokens(alpha={alpha}, k={k})", f"{e:.6g}", f"{g:.6g}", hint)


@expected_tokens_task.test("alpha = 0.8, k = 4: 3.3616 tokens per target forward; alpha = 0.5, k = 1: 1.5; "
                           "alpha = 0.6, k = 3: 2.176")
def _(fn: Callable) -> None:
    _check_expected(fn, [(0.8, 4), (0.5, 1), (0.6, 3)], "the examples")


@expected_tokens_task.test("alpha = 1: every draft passes, k + 1 tokens (no division by zero)")
def _(fn: Callable) -> None:
    _check_expected(fn, [(1.0, 4), (1.0, 7), (1.0, 0)], "a perfect drafter")


@expected_tokens_task.test("alpha = 0 or k = 0: one token, the target's own")
def _(fn: Callable) -> None:
    _check_expected(fn, [(0.0, 5), (0.7, 0), (0.0, 0), (0.0, 1)], "nothing accepted")


@expected_tokens_task.test("agrees with minillm.arithmetic.expected_tokens_per_step on 100 random (alpha, k)")
def _(fn: Callable) -> None:
    rng = random.Random(717)
    cases = [(round(rng.uniform(0.0, 0.999), 4), rng.randint(0, 16)) for _ in range(100)]
    for alpha, k in cases:  # the grader's own consistency check
        if not math.isclose(reference_expected_tokens(alpha, k), arithmetic.expected_tokens_per_step(alpha, k),
                            rel_tol=1e-12):
            raise RuntimeError("the reference disagrees with minillm.arithmetic.expected_tokens_per_step at "
                               f"{alpha}, {k}")
    _check_expected(fn, cases, "a random case")


# ---- 07.best_k --------------------------------------------------------------------------------------


def reference_best_k(alpha: float, draft_cost: float, max_k: int = 16) -> int:
    """The k in 1..max_k with the largest speed-up expected_tokens(alpha, k) / (1 + k * draft_cost); the smallest
    such k on a tie. draft_cost: one draft forward's time relative to one target forward."""
    return max(range(1, max_k + 1), key=lambda k: reference_expected_tokens(alpha, k) / (1 + k * draft_cost))


best_k_task = register_task(
    "07.best_k",
    "best_k(alpha: float, draft_cost: float, max_k: int = 16) -> int  (the k in 1..max_k with the largest "
    "speed-up)",
    reference=reference_best_k,
    forbid=("minillm.arithmetic.best_speculation_length", "minillm.arithmetic.speculative_speedup",
            "minillm.arithmetic.expected_tokens_per_step"),
)


def _argmax_k(score: Callable[[float, float, int], float], first: int = 1, last_offset: int = 0,
              lowest: bool = False) -> Callable[..., int]:
    def best(alpha: float, c: float, max_k: int = 16) -> int:
        ks = range(first, max_k + 1 + last_offset)
        return (min if lowest else max)(ks, key=lambda k: score(alpha, c, k))
    return best


def _speedup(alpha: float, c: float, k: int) -> float:
    return reference_expected_tokens(alpha, k) / (1 + k * c)


_BEST_HOW = ("return the k in range(1, max_k + 1) with the largest expected_tokens(alpha, k) / (1 + k * draft_cost): "
             "max(range(1, max_k + 1), key=...).")

_NO_COST = ("the draft is not free: each drafted token costs a draft forward, c of a target forward, so the "
            "speed-up is expected_tokens(alpha, k) / (1 + k * c). The expected tokens alone always grow with k; "
            "divided by the cost, they rise, peak and fall.")

_BEST_SUSPECTS: list[tuple[Callable, str]] = [
    (lambda a, c, m=16: m, _NO_COST),
    (_argmax_k(lambda a, c, k: reference_expected_tokens(a, k)), _NO_COST),
    (_argmax_k(lambda a, c, k: reference_expected_tokens(a, k) / (1 + c)),
     "each of the k drafts costs a draft forward: a step costs 1 + k * c target forwards, not 1 + c."),
    (_argmax_k(lambda a, c, k: reference_expected_tokens(a, k) / (k * c)),
     "a step costs the k draft forwards AND the target's forward: 1 + k * c, not k * c."),
    (_argmax_k(lambda a, c, k: _geometric(a, k) / (1 + k * c)),
     "the tokens per step are (1 - alpha^(k+1)) / (1 - alpha) (task 3), counting the target's own token; "
     "(1 - alpha^k) / (1 - alpha) leaves it out."),
    (_argmax_k(lambda a, c, k: a * k / (1 + k * c)),
     "the tokens per step are (1 - alpha^(k+1)) / (1 - alpha) (task 3): draft j counts only if drafts 1..j all "
     "pass, and the target adds one of its own."),
    (_argmax_k(_speedup, first=0),
     "k runs from 1 to max_k: k = 0 is plain decoding, not a length to draft. Even when no k pays (every speed-up "
     "is below 1) the answer is the best k among 1..max_k."),
    (_argmax_k(_speedup, last_offset=-1),
     "max_k itself is allowed: range(1, max_k + 1)."),
    (_argmax_k(_speedup, lowest=True), "take the k with the LARGEST speed-up (max, not min)."),
]


def _check_best(fn: Callable, cases: list[tuple], what: str) -> None:
    got = []
    for case in cases:
        g = call_catching(fn, case, "ZeroDivisionError", f"{what}: best_k{case}", f"{reference_best_k(*case)}",
                           "expected_tokens(alpha, k) must handle alpha = 1 (k + 1 tokens), and the cost 1 + k * c "
                           "is never 0.")
        if not isinstance(g, int) or isinstance(g, bool):
            raise MismatchError(f"{what}: best_k{case}", "an int, the number of drafted tokens",
                                f"{type(g).__name__} {short_repr(g, 80)}",
                                "return k itself, as an int (not the speed-up).")
        got.append(g)
    for g, case in zip(got, cases):
        e = reference_best_k(*case)
        if g != e:
            alpha, c, max_k = (*case, 16)[:3]
            raise MismatchError(f"{what}: best_k(alpha={alpha}, draft_cost={c}, max_k={max_k})",
                                f"{e} (speed-up {_speedup(alpha, c, e):.4f})",
                                f"{g}" + (f" (speed-up {_speedup(alpha, c, g):.4f})" if g >= 0 else ""),
                                diagnose(got, cases, _BEST_SUSPECTS, _BEST_HOW, lambda a, b: a == b))


@best_k_task.test("alpha = 0.8, a draft at 0.1 of the target's cost: k = 6 (speed-up 2.47); alpha = 0.6, c = 0.05: "
                  "k = 4; max_k defaults to 16")
def _(fn: Callable) -> None:
    _check_best(fn, [(0.8, 0.1, 16), (0.6, 0.05, 16), (0.9, 0.05, 16)], "the examples")
    _check_best(fn, [(0.8, 0.1)], "without max_k")


@best_k_task.test("a poor or costly draft: k = 1, also when no k pays (alpha = 0.1, c = 0.5: a speed-up of 0.73)")
def _(fn: Callable) -> None:
    _check_best(fn, [(0.3, 0.2, 16), (0.1, 0.5, 16), (0.4, 0.3, 8)], "a poor draft")


@best_k_task.test("a free draft (c = 0) or a perfect one (alpha = 1): the longest allowed, max_k")
def _(fn: Callable) -> None:
    _check_best(fn, [(0.7, 0.0, 16), (0.7, 0.0, 5), (1.0, 0.05, 10)], "a free or perfect draft")


@best_k_task.test("max_k is honoured and included: alpha = 0.95, c = 0.02 gives 4, 8 and 16 up to those, and 31 "
                  "below 64")
def _(fn: Callable) -> None:
    _check_best(fn, [(0.95, 0.02, 4), (0.95, 0.02, 8), (0.95, 0.02, 16), (0.95, 0.02, 64)], "max_k")


@best_k_task.test("agrees with minillm.arithmetic.best_speculation_length on 200 random (alpha, c, max_k)")
def _(fn: Callable) -> None:
    rng = random.Random(727)
    cases = []
    while len(cases) < 200:
        case = (round(rng.uniform(0.05, 0.99), 3), round(rng.choice([0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5])
                                                         * rng.uniform(0.5, 1.5), 4), rng.choice([4, 8, 16, 32]))
        alpha, c, max_k = case
        top = sorted((_speedup(alpha, c, k) for k in range(1, max_k + 1)), reverse=True)
        if top[0] - top[1] < 1e-9 * top[0]:  # a near-tie: the answer would depend on float rounding
            continue
        if reference_best_k(*case) != arithmetic.best_speculation_length(alpha, c, max_k):  # the grader's own check
            raise RuntimeError(f"the reference disagrees with minillm.arithmetic.best_speculation_length on {case}")
        cases.append(case)
    _check_best(fn, cases, "a random case")
