"""Speculative decoding: a cheap drafter guesses k tokens, the target checks them all in one forward (chapter 07).

A decode step of a large model is memory-bound: it reads every weight to produce one token, and
scoring k + 1 positions in one forward costs about the same. So a cheap *drafter* proposes k tokens
x_1..x_k, the *target* scores all k + 1 positions at once, and the *verify* step keeps a prefix of
the draft plus one token of the target's own:

    draft      x_1 ~ q_1, ..., x_k ~ q_k             (q_i: the drafter's distribution at position i)
    target     p_1, ..., p_{k+1}                      one forward over [last token, x_1, ..., x_k]
    verify     accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order;
               at the first rejection, emit y ~ norm(max(0, p_i - q_i)) and stop;
               if all k pass, emit a bonus y ~ p_{k+1}.

Every token emitted this way is distributed exactly as the target's own sample would be (Leviathan
et al., 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al., 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling"); chapter 07 proves it and
`tests/sampler/test_speculative.py` checks it with a chi-squared test. At temperature 0 the rule becomes:
accept while the draft equals the target's argmax (`verify_greedy`), so the output is greedy
decoding's, token for token.

The pieces:

* `residual_distribution`, `verify`, `verify_greedy`: the acceptance rule on probability rows.
  `verify_typical` is a LOSSY alternative, Medusa's "typical acceptance" (`SpeculativeConfig(acceptance=
  "typical")`): it accepts any draft the target finds plausible enough, so more drafts pass, but the output is
  no longer the target's own; chapter 09's quality gate (`minillm.eval.cached.greedy_agreement`) catches it.
* `Draft` and the `Drafter` interface: `propose` k tokens for each of a batch of sequences, and
  `release` a finished one. Two drafters:
  - `DraftModelDrafter`: a small model of the same vocabulary (the shipped `DEFAULT_DRAFT`), with
    its own paged KV cache, rolled back to whatever the target accepted. It runs on the engine's cache, so it
    lives in the engine, `minillm.engine.draft_model` (this module stays free of the engine, which imports it);
  - `NgramDrafter`: prompt lookup, no second model: if the last n tokens appeared earlier in the
    context, propose what followed them then.
  A Medusa- or EAGLE-style head is a third kind of drafter: it proposes from the target's own hidden
  state; it plugs into the same interface (chapter 07 draws it).
* `SpeculativeConfig`: a drafter and k, given to `minillm.engine.LLMEngine(speculative=...)`, or to
  `minillm.generate(..., speculative=...)`. The engine's model runner runs the verify forward for its
  decode rows (`ModelRunner.speculative_decode`), `SpeculativeConfig.accept` applies the rule to each row,
  and the rejected positions are rolled back with `PagedKVCache.truncate`.
* `SpeculativeStats`: what was proposed and accepted, per draft position, and tokens per target forward.
* `DraftGate`: with `SpeculativeConfig(adaptive=True)`, sequences whose drafts stop paying decode plainly.

The expected number of tokens per target forward, (1 - alpha^(k+1)) / (1 - alpha), and the speed-up
with a draft of relative cost c are `minillm.arithmetic.expected_tokens_per_step` and
`minillm.arithmetic.speculative_speedup`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from minillm.arithmetic import speculative_speedup, weight_bytes_read
from minillm.config import ModelConfig
from minillm.sampler.sampling import SamplingParams, process_logits


# ------------------------------------------------------------------ the acceptance rule
def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): where the target puts more mass than the drafter, renormalised [..., V].

    Sampling from it after a rejection gives back exactly the mass the acceptance test took away.
    Where p <= q everywhere (only when p == q, and then nothing is ever rejected) it returns p.
    """
    residual = (p - q).clamp(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=torch.finfo(p.dtype).tiny), p)


def verify(
    p: torch.Tensor,
    draft_tokens: Sequence[int],
    q: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Speculative sampling's verify step for one sequence: the tokens to emit (accepted drafts + one).

    Args:
        p: [k + 1, V] the target's probabilities at the k draft positions and after the last one.
        draft_tokens: the k proposed ids; draft_tokens[i] was drawn from q[i].
        q: [k, V] the drafter's probabilities, or None for a deterministic drafter (q[i] is one-hot at
            draft_tokens[i]: n-gram lookup, greedy drafting).
        generator: the sequence's random generator (on p's device).

    Returns:
        draft_tokens[:a] + [y]: the a accepted drafts, then y ~ residual(p[a], q[a]) at the first
        rejection, or y ~ p[k] (the bonus token) when all k are accepted. Between 1 and k + 1 tokens.
    """
    k = len(draft_tokens)
    if p.shape[0] != k + 1:
        raise ValueError(f"p must have one row per draft token plus one, {k + 1}, got {p.shape[0]}.")
    if q is not None and q.shape[0] != k:
        raise ValueError(f"q must have one row per draft token, {k}, got {q.shape[0]}.")
    for i, x in enumerate(draft_tokens):
        q_x = 1.0 if q is None else float(q[i, x])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_x < float(p[i, x]):  # u < p(x) / q(x), i.e. accepted with probability min(1, p(x) / q(x))
            continue
        q_i = q[i] if q is not None else torch.nn.functional.one_hot(torch.tensor(x), p.shape[-1]).to(p)
        y = torch.multinomial(residual_distribution(p[i], q_i), 1, generator=generator)
        return [int(t) for t in draft_tokens[:i]] + [int(y)]
    return [int(t) for t in draft_tokens] + [int(torch.multinomial(p[k], 1, generator=generator))]


def verify_greedy(target_tokens: Sequence[int], draft_tokens: Sequence[int]) -> list[int]:
    """The verify step at temperature 0: accept drafts while they equal the target's argmax.

    target_tokens: the target's argmax at each of the k + 1 positions. Returns the accepted drafts,
    then the target's own token at the first mismatch (or the bonus token after all k): exactly what
    greedy decoding would have produced, one token at a time.
    """
    if len(target_tokens) != len(draft_tokens) + 1:
        raise ValueError(f"need the target's token at {len(draft_tokens) + 1} positions, got {len(target_tokens)}.")
    out = []
    for x, y in zip(draft_tokens, target_tokens):
        if x != y:
            break
        out.append(int(x))
    return out + [int(target_tokens[len(out)])]


TYPICAL_EPSILON, TYPICAL_DELTA = 0.09, 0.3  # Medusa's defaults: posterior_threshold, posterior_alpha (its square root)


def verify_typical(p: torch.Tensor, draft_tokens: Sequence[int], greedy: bool, epsilon: float = TYPICAL_EPSILON,
                   delta: float = TYPICAL_DELTA, generator: torch.Generator | None = None) -> list[int]:
    """LOSSY: Medusa's "typical acceptance" (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework
    with Multiple Decoding Heads", section 3.3.1): accept drafts while the target finds them plausible enough.

    Draft x_i is accepted, in order, while

        p_i(x_i) > min(epsilon, delta * exp(-H(p_i)))        H(p_i) = -sum_v p_i(v) log p_i(v), in nats

    a threshold that falls where the target is unsure (high entropy): there, any reasonably likely token passes.
    At the first rejection (or after all k) the target's own token follows: its argmax for a greedy row, a sample
    of p for the others. The drafter's q plays no part.

    This is NOT speculative sampling: the output is no longer distributed as the target's own (`verify` is), and a
    greedy row no longer gets greedy decoding's tokens (`verify_greedy` does). It trades that for more accepted
    drafts per step. With delta < 1 the argmax always passes (max_v p(v) >= exp(-H(p))), so it accepts every draft
    `verify_greedy` accepts, and more. Medusa's reference code falls back to exact matching at temperature 0;
    here a greedy row is judged by p as `target_probabilities` gives it, the untempered distribution (vLLM's v0
    engine offered the rule as spec_decoding_acceptance_method="typical_acceptance_sampler").

    Args:
        p: [k + 1, V] the target's probabilities at the k draft positions and after the last one.
        draft_tokens: the k proposed ids.
        greedy: whether the row decodes greedily (the closing token is p's argmax, else a sample of p).
        epsilon, delta: the hard threshold and the entropy-scaled one; lower accepts more.
        generator: the row's random generator (sampled rows only).

    Returns:
        draft_tokens[:a] + [y], between 1 and k + 1 tokens.
    """
    k = len(draft_tokens)
    if p.shape[0] != k + 1:
        raise ValueError(f"p must have one row per draft token plus one, {k + 1}, got {p.shape[0]}.")
    entropy = -(p * p.clamp(min=torch.finfo(p.dtype).tiny).log()).sum(dim=-1)  # [k + 1] nats
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)  # min(epsilon, delta exp(-H))
    a = 0
    while a < k and float(p[a, draft_tokens[a]]) > float(threshold[a]):
        a += 1
    y = int(p[a].argmax()) if greedy else int(torch.multinomial(p[a], 1, generator=generator))
    return [int(t) for t in draft_tokens[:a]] + [y]


def target_probabilities(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
    draft_tokens: Sequence[int],
) -> torch.Tensor:
    """The target's sampling distribution at each verify position, [k + 1, V] float32.

    Row i is what `minillm.sampler.sampling.sample` would draw from after output_ids + draft_tokens[:i]: every
    processor of chapter 01 applies (penalties, temperature, top-k, top-p, min-p). logits [k + 1, V]
    are the target's raw logits at those positions. Greedy params give rows whose argmax is the token.
    """
    n = logits.shape[0]
    outputs = [list(output_ids) + list(draft_tokens[:i]) for i in range(n)]
    return process_logits(logits, [params] * n, [prompt_ids] * n, outputs).softmax(dim=-1)


# ------------------------------------------------------------------ drafters
@dataclass
class Draft:
    """A drafter's proposal for one sequence: up to k token ids and the distribution each came from.

    probs [len(tokens), V] is q, the drafter's distribution at each position, or None when the drafter
    is deterministic (q is one-hot at each proposed token). An empty draft means a plain decode step.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """What the engine asks of a drafter (a draft model, n-gram lookup, or a Medusa/EAGLE-style head)."""

    def propose(
        self, seq_ids: Sequence[Hashable], contexts: Sequence[list[int]], params: Sequence[SamplingParams],
        num_tokens: Sequence[int], generators: Sequence[torch.Generator | None],
    ) -> list[Draft]:
        """Up to num_tokens[i] tokens to follow contexts[i] (prompt + output so far) of sequence seq_ids[i]."""
        ...

    def release(self, seq_id: Hashable) -> None:
        """The sequence ended: forget anything kept for it."""
        ...


class NgramDrafter:
    """Prompt lookup: propose what followed the latest earlier occurrence of the context's last n tokens.

    Tries n = max_n down to min_n and stops at the first n with a match. No second model, no state:
    it shines where the output repeats its input (code edits, quoting, summaries with copied spans)
    and proposes nothing on free text. Deterministic, so q is one-hot and a draft token x is accepted
    with probability p(x). (As vLLM's "ngram" method, prompt_lookup_max / prompt_lookup_min.)
    """

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}.")
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        L = len(context)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = list(context[L - n:])
            for start in range(L - n - 1, -1, -1):  # latest occurrence first, not the suffix itself
                if list(context[start: start + n]) == suffix:
                    return list(context[start + n: start + n + k])
        return []

    def propose(self, seq_ids, contexts, params, num_tokens, generators) -> list[Draft]:  # noqa: ANN001 - Drafter
        return [Draft(self.lookup(c, k)) for c, k in zip(contexts, num_tokens)]

    def release(self, seq_id: Hashable) -> None:
        pass


# ------------------------------------------------------------------ configuration and statistics
@dataclass
class SpeculativeStats:
    """What speculation did, summed over verify steps (one row of one target forward is one step).

    Per draft position i (0-based): proposed_at[i] steps proposed a token there, reached_at[i] of them
    got to check it (drafts 0..i-1 all accepted), and accepted_at[i] accepted it.
    """

    num_steps: int = 0  # verify steps: a row in a target forward that had drafts to check
    num_emitted: int = 0  # tokens those steps emitted: accepted drafts + one of the target's per step
    proposed_at: list[int] = field(default_factory=list)
    reached_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One verify step: num_proposed drafts, of which the first num_accepted were accepted."""
        for counts in (self.proposed_at, self.reached_at, self.accepted_at):
            counts += [0] * (num_proposed - len(counts))
        for i in range(num_proposed):
            self.proposed_at[i] += 1
            self.reached_at[i] += i <= num_accepted
            self.accepted_at[i] += i < num_accepted
        self.num_steps += 1
        self.num_emitted += num_accepted + 1

    def merge(self, other: SpeculativeStats) -> SpeculativeStats:
        """The counts of both, summed (e.g. over several calls of `generate`)."""
        def add(a: list[int], b: list[int]) -> list[int]:
            n = max(len(a), len(b))
            return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]

        return SpeculativeStats(self.num_steps + other.num_steps, self.num_emitted + other.num_emitted,
                                add(self.proposed_at, other.proposed_at), add(self.reached_at, other.reached_at),
                                add(self.accepted_at, other.accepted_at))

    @property
    def num_proposed(self) -> int:
        return sum(self.proposed_at)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted_at)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts; nan before any."""
        return self.num_accepted / self.num_proposed if self.num_proposed else float("nan")

    @property
    def alpha_by_position(self) -> list[float]:
        """alpha_i = P(draft i accepted | it was checked, i.e. drafts 0..i-1 were accepted); nan where none was."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted_at, self.reached_at)]

    @property
    def alpha(self) -> float:
        """Accepted / checked drafts: the per-token acceptance rate the formula (1 - a^(k+1)) / (1 - a) uses."""
        reached = sum(self.reached_at)
        return self.num_accepted / reached if reached else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verify step (per target forward of one sequence); nan before any."""
        return self.num_emitted / self.num_steps if self.num_steps else float("nan")


def estimated_draft_cost(draft: ModelConfig, target: ModelConfig) -> float:
    """c before it is measured: a decode step reads every weight, so the draft's weight bytes over the target's
    (`minillm.arithmetic.weight_bytes_read`; 0.16 for Llama-3.2-1B drafting for Llama-3-8B, where an H200 measured
    0.23: a small model's step is further from the bandwidth roof)."""
    return weight_bytes_read(draft, 1) / weight_bytes_read(target, 1)


class DraftGate:
    """Adaptive speculation (`SpeculativeConfig(adaptive=True)`): whether drafting still pays, sequence by sequence.

    A draft that the target keeps rejecting makes every step cost a verify forward and k draft forwards for one
    token: at alpha = 0 an 8B target with a 1B draft ran at 0.42x of plain decoding (k = 4, one H200,
    results/speculative_controlled/cuda.json), and with the gate at 0.87x (batch 1) and 0.85x (batch 8): probes
    still draft and verify, and a gated row still joins its batch's verify step. Where drafts are good the gate costs
    6-12% (alpha = 0.9: 1.55x against 1.75x at batch 1), and at alpha = 0.6 and batch 8 it lost (0.57x against
    0.87x): rows turned off and on leave steps in which a few rows draft and the batch pays the verify. The gate
    keeps a decayed count of each sequence's checked and accepted drafts (each verify step multiplies the old counts
    by `DECAY`: about the last ten steps count) and predicts its next step's speed-up,
    `minillm.arithmetic.speculative_speedup(alpha, k, draft_cost)`. Below 1, once `MIN_STEPS` verify steps have
    been seen (one unlucky step is not evidence: at alpha = 0.8 a step accepts nothing one time in five), the
    sequence decodes plainly and drafts again only to probe: after 4 plain steps, then 8, 16, up to 64 while the
    probes fail; a probe that pays lets it draft every step again. Plain steps are exact, so the
    output is the same with or without the gate; only the speed changes.
    """

    DECAY = 0.9
    MIN_STEPS = 4
    FIRST_WAIT, LONGEST_WAIT = 4, 64

    @dataclass
    class Row:
        """One sequence's record: decayed counts, the plain steps it still waits, the wait after its next failure."""

        checked: float = 0.0
        accepted: float = 0.0
        wait: int = 0
        next_wait: int = 0
        steps: int = 0  # verify steps seen

    def __init__(self, k: int, draft_cost: float) -> None:
        self.k, self.draft_cost = k, draft_cost
        self.rows: dict[Hashable, DraftGate.Row] = {}

    def drafts(self, seq_id: Hashable) -> bool:
        """Whether this sequence drafts this step (call once per step it could): False while it waits."""
        row = self.rows.get(seq_id)
        if row is None or row.wait <= 0:
            return True
        row.wait -= 1
        return False

    def record(self, seq_id: Hashable, checked: int, accepted: int) -> None:
        """After a verify step: `checked` drafts reached the rule (the accepted ones and the first rejected; the
        drafts after a rejection are never looked at), `accepted` were kept."""
        row = self.rows.setdefault(seq_id, DraftGate.Row())
        row.checked = self.DECAY * row.checked + checked
        row.accepted = self.DECAY * row.accepted + accepted
        row.steps += 1
        alpha = min(1.0, row.accepted / row.checked) if row.checked else 1.0
        if row.steps < self.MIN_STEPS or speculative_speedup(alpha, self.k, self.draft_cost) >= 1:
            row.wait = row.next_wait = 0
        else:
            row.wait = row.next_wait or self.FIRST_WAIT
            row.next_wait = min(2 * row.wait, self.LONGEST_WAIT)

    def release(self, seq_id: Hashable) -> None:
        self.rows.pop(seq_id, None)


@dataclass
class SpeculativeConfig:
    """Speculative decoding for an engine: a drafter, and k = num_speculative_tokens drafts per step (vLLM's name).

    A row drafts at most k tokens, fewer near its max_tokens. `acceptance` is the verify rule: "exact" (the
    default) keeps the target's output distribution (greedy: its tokens); "typical" is Medusa's lossy rule
    (`verify_typical`, thresholds typical_epsilon and typical_delta), an approximation some engines offer. Example:
        >>> spec = SpeculativeConfig(DraftModelDrafter(draft_model), num_speculative_tokens=4)
        >>> out = minillm.generate(target, "To be", params, tokenizer, speculative=spec)
        >>> out.speculative.acceptance_rate, out.speculative.tokens_per_step
    """

    drafter: Drafter
    num_speculative_tokens: int = 4
    # "exact" (the default): speculative sampling, `verify` / `verify_greedy`; the output is the target's own.
    # "typical": LOSSY, Medusa's typical acceptance (`verify_typical`): more drafts accepted, different output.
    acceptance: str = "exact"
    typical_epsilon: float = TYPICAL_EPSILON
    typical_delta: float = TYPICAL_DELTA
    # adaptive: a sequence whose drafts stop paying decodes plainly, probing now and then (`DraftGate`).
    # draft_cost: c for that prediction, a draft forward over a target decode step; None: the engine estimates it
    # from the two models' weights (a decode step reads them all), 0 for a drafter without a model.
    adaptive: bool = False
    draft_cost: float | None = None

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {k!r}.")
        if self.acceptance not in ("exact", "typical"):
            raise ValueError(f"acceptance={self.acceptance!r}: choose 'exact' (the target's own output) or 'typical' "
                             "(Medusa's typical acceptance: lossy, faster).")
        if self.draft_cost is not None and not (isinstance(self.draft_cost, (int, float)) and self.draft_cost >= 0):
            raise ValueError(f"draft_cost is c, a draft forward's time over a target step: a number >= 0, got "
                             f"{self.draft_cost!r} (or None, to let the engine estimate it).")
        if not (0 < self.typical_epsilon <= 1 and 0 < self.typical_delta < 1):
            raise ValueError(f"typical acceptance needs 0 < typical_epsilon <= 1 and 0 < typical_delta < 1, got "
                             f"{self.typical_epsilon} and {self.typical_delta}.")

    def accept(self, logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
               draft_tokens: list[int], draft_probs: torch.Tensor | None,
               generator: torch.Generator | None) -> list[int]:
        """The verify rule on one row: the tokens it emits (the accepted drafts, then one of the target's).

        logits [d + 1, V] are the target's raw logits at the d draft positions and after the last one;
        draft_probs [d, V] the drafter's q (None: deterministic drafts, q one-hot). Greedy rows accept
        while the draft is the argmax (`verify_greedy`); the others run speculative sampling (`verify`).
        With acceptance="typical", every row runs `verify_typical` instead (lossy).
        """
        p = target_probabilities(logits, params, prompt_ids, output_ids, draft_tokens)
        if self.acceptance == "typical":
            return verify_typical(p, draft_tokens, params.greedy, self.typical_epsilon, self.typical_delta, generator)
        if params.greedy:
            return verify_greedy(p.argmax(dim=-1).tolist(), draft_tokens)
        return verify(p, draft_tokens, draft_probs, generator)
