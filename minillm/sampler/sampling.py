"""`SamplingParams` and `sample()`: from logits to the next token (chapter 01, "Decoding").

The model gives one row of logits per sequence, a score for every token of the vocabulary. Picking
the next token is a short pipeline; every stage is a plain function on a batch of logits [B, V]:

    raw logits [B, V]                                   (log-probabilities come from here)
      │ apply_repetition_penalty   tokens already in the prompt or output: positive / r, negative * r
      │ apply_penalties            OpenAI's frequency and presence penalties, over the output only
      │ apply_temperature          logits / T: T < 1 sharpens, T > 1 flattens (T = 0 is greedy)
      │ top_k_filter               keep the k largest logits
      │ top_p_filter               keep the smallest set of most likely tokens whose mass reaches p
      │ min_p_filter               keep tokens at least min_p times as likely as the most likely one
      ▼
    processed logits ─ softmax ─► probabilities ─ draw (or argmax when T = 0) ─► token [B]

A filter removes a token by setting its logit to -inf (probability 0 after softmax); every filter
keeps at least the most likely token, so a row never runs out of candidates. Each processor takes
its parameter as a number or as a tensor [B] with one value per row, and a row whose parameter
means "off" comes back unchanged; that is how one `sample()` call serves a batch in which every
sequence asked for something different.

The order is transformers' (its `generate()` builds its processors in this order), which lets the
tests check the whole chain against transformers. Penalties go first because they adjust the
model's scores, and the filters after temperature so that they cut the distribution actually
sampled. vLLM's v0 sampler used this order too; its v1 sampler applies min-p before top-k and
top-p. Min-p and top-k commute, since both cut at a logit threshold, but top-p does not: top-p
after min-p measures mass in the already cut distribution, so vLLM v1 can keep a smaller set.

`sample` draws with `torch.multinomial`, from one generator or one per row (so a seeded row gives
the same tokens whatever else is in the batch). `compute_logprobs` reports log-probabilities of
the raw logits, before any processor, as vLLM does by default.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minillm.utils import to_device

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (as in vLLM): dividing logits by them would overflow float32."""

TokenIds = Sequence[Sequence[int]]  # one list of token ids per row; rows may differ in length


# ------------------------------------------------------------------ SamplingParams
def _check_real(name: str, value: object, ok: Callable[[float], bool], rule: str) -> float:
    """`value` as a float, or ValueError naming the field, its allowed range and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number {rule}, got {value!r} ({type(value).__name__}).")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be {rule}, got {value!r}; pass a finite number.")
    if not ok(value):
        raise ValueError(f"{name} must be {rule}, got {value!r}.")
    return float(value)


def _check_int(name: str, value: object, ok: Callable[[int], bool], rule: str) -> int:
    """`value` as an int (a bool is refused), or ValueError naming the field, its allowed range and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int {rule}, got {value!r} ({type(value).__name__}).")
    if not ok(value):
        raise ValueError(f"{name} must be {rule}, got {value!r}.")
    return int(value)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (chapter 01). Every field's "off" value is its default.

    Attributes:
        temperature: logits are divided by it before softmax; 0 = greedy (argmax). Must be finite, >= 0.
        top_k: keep only the k most likely tokens (0 = off).
        top_p: keep the smallest set of most likely tokens whose probability reaches p, in (0, 1] (1 = off).
        min_p: keep tokens with probability >= min_p * the top token's, in [0, 1] (0 = off).
        repetition_penalty: in [1e-4, 1e4]; tokens already in the prompt or the output get positive logits divided
            by it and negative ones multiplied (1 = off, > 1 discourages repeats, < 1 encourages them). Further
            from 1, float32 logits overflow (a logit of 5 divided by 1e-38 is infinite) and sampling breaks.
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time it was generated (0 = off).
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token generated so far (0 = off).
        max_tokens: the most tokens to generate, >= 1.
        stop: strings that end generation when they appear in the output (excluded from it).
        seed: seeds the sampler, so the same seed gives the same tokens.
        n: how many completions to return for the prompt, >= 1.
        best_of: how many completions to generate, of which the n best are returned (None = n).
        logprobs: also return the log-probabilities of this many most likely tokens at each step
            (0 = only the chosen token's; None = none), at most 20.
        ignore_eos: keep generating past the end-of-sequence token (for benchmarks).

    Raises:
        ValueError: a field is out of its range; the message names the field, the range and the value.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    seed: int | None = None
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.temperature = _check_real("temperature", self.temperature, lambda v: v >= 0, ">= 0 (0 = greedy)")
        self.top_k = _check_int("top_k", self.top_k, lambda v: v >= 0, ">= 0 (0 = off)")
        if self.top_k >= 2**31:  # the engine holds it in a tensor; any k past the vocabulary keeps every token
            raise ValueError(f"top_k must be below 2**31, got {self.top_k}; any k past the vocabulary keeps every "
                             "token, so pass the vocabulary size, or 0 for off.")
        self.top_p = _check_real("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1] (1 = off)")
        self.min_p = _check_real("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)")
        self.repetition_penalty = _check_real(
            "repetition_penalty", self.repetition_penalty, lambda v: 1e-4 <= v <= 1e4,
            "in [1e-4, 1e4] (1 = off; beyond, float32 logits overflow)"
        )
        for name in ("frequency_penalty", "presence_penalty"):
            setattr(self, name, _check_real(name, getattr(self, name), lambda v: -2 <= v <= 2, "in [-2, 2] (0 = off)"))
        self.max_tokens = _check_int("max_tokens", self.max_tokens, lambda v: v >= 1, ">= 1")
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, lambda v: True, "or None")
            if not -(2**63) <= self.seed < 2**63:  # torch's generators take [-2**63, 2**64); sequence i uses seed + i
                raise ValueError(f"seed must be in [-2**63, 2**63), got {self.seed}.")
        self.n = _check_int("n", self.n, lambda v: v >= 1, ">= 1")
        if self.best_of is not None:
            self.best_of = _check_int(
                "best_of", self.best_of, lambda v: v >= self.n, f">= n (= {self.n}) or None (= n)"
            )
        if self.logprobs is not None:
            self.logprobs = _check_int(
                "logprobs",
                self.logprobs,
                lambda v: 0 <= v <= 20,
                "in [0, 20] (0 = the chosen token only) or None (off)",
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}.")

    @property
    def greedy(self) -> bool:
        """Whether these parameters pick the argmax (temperature 0, or below GREEDY_BELOW)."""
        return self.temperature < GREEDY_BELOW


# ------------------------------------------------------------------ logits processors
def _per_row(value: float | torch.Tensor, logits: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A processor's parameter, a number or one value per row [B], as a column [B, 1] to broadcast over V."""
    column = torch.as_tensor(value, dtype=dtype, device=logits.device).reshape(-1, 1)
    if column.shape[0] not in (1, logits.shape[0]):
        raise ValueError(f"expected a number or one value per row ({logits.shape[0]}), got {column.shape[0]} values.")
    return column.expand(logits.shape[0], 1)


def token_counts(token_ids: TokenIds, vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """How often each token occurs in each row: token_ids (B lists of ids) -> counts [B, V] (int64)."""
    ids = [int(t) for row in token_ids for t in row]
    if ids and not 0 <= min(ids) <= max(ids) < vocab_size:  # checked on the host: no wait for the device
        raise ValueError(f"token ids must be in [0, {vocab_size}), got ids from {min(ids)} to {max(ids)}.")
    device = torch.device(device or "cpu")
    flat = to_device(ids, torch.long, device)
    lengths = to_device([len(row) for row in token_ids], torch.long, device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths)  # row of each id
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.long, device=device)
    return counts.index_put_((rows, flat), torch.ones_like(flat), accumulate=True)


def apply_repetition_penalty(logits: torch.Tensor, token_ids: TokenIds, penalty: float | torch.Tensor) -> torch.Tensor:
    """Penalise every token that occurs in `token_ids` (chapter 01); the CTRL paper's rule, as in transformers.

    A seen token's logit is divided by `penalty` if positive and multiplied by it if negative, so
    penalty > 1 always lowers it. Once per token, however often it occurred. penalty = 1 is off.

    Args:
        logits: [B, V].
        token_ids: B lists of ids, the tokens each row has seen (lists may differ in length).
        penalty: a number or [B], > 0.
    Returns:
        logits [B, V], float32.
    """
    logits = logits.float()
    penalty = _per_row(penalty, logits)
    seen = token_counts(token_ids, logits.shape[-1], logits.device) > 0  # [B, V]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    frequency_penalty: float | torch.Tensor,
    presence_penalty: float | torch.Tensor,
) -> torch.Tensor:
    """OpenAI's frequency and presence penalties (chapter 01): logit -= count * frequency + (count > 0) * presence.

    The frequency penalty grows with every repeat; the presence penalty is paid once by any token
    that occurred. Negative values encourage repeats instead. Both 0 is off.

    Args:
        logits: [B, V].
        counts: [B, V], how often each token occurred in each row (see `token_counts`).
        frequency_penalty, presence_penalty: numbers or [B].
    Returns:
        logits [B, V], float32.
    """
    logits = logits.float()
    counts = counts.to(device=logits.device, dtype=torch.float32)
    frequency = _per_row(frequency_penalty, logits)
    presence = _per_row(presence_penalty, logits)
    return logits - counts * frequency - (counts > 0).float() * presence


def apply_temperature(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (chapter 01): logits [B, V], temperature a number or [B] -> [B, V].

    T < 1 sharpens the distribution, T > 1 flattens it, T = 1 is off. Rows with T = 0 come back
    unchanged: temperature 0 means greedy, and `sample` takes those rows' argmax instead of dividing by 0.
    """
    temperature = _per_row(temperature, logits)
    return logits.float() / torch.where(temperature > 0, temperature, 1.0)


def top_k_filter(logits: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits of each row, the rest -> -inf (chapter 01). k = 0 is off.

    Args:
        logits: [B, V].
        k: a number or [B]; k >= V keeps everything. Ties with the k-th largest logit are kept too.
    Returns:
        logits [B, V], float32.
    """
    logits = logits.float()
    k = _per_row(k, logits, torch.long).clamp(max=logits.shape[-1])  # [B, 1]
    descending = logits.sort(dim=-1, descending=True).values
    kth_largest = descending.gather(-1, (k - 1).clamp(min=0))  # [B, 1]
    drop = (logits < kth_largest) & (k > 0)
    return logits.masked_fill(drop, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Nucleus sampling (chapter 01): keep the smallest set of most likely tokens whose mass reaches p.

    Going down the tokens from most to least likely, a token is kept while the tokens above it
    hold less than p of the probability; the first one always is. p = 1 is off.

    Args:
        logits: [B, V].
        p: a number or [B], in (0, 1].
    Returns:
        logits [B, V], float32.
    """
    logits = logits.float()
    p = _per_row(p, logits)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)  # [B, V], largest first
    mass_above = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # mass of the tokens ranked above
    drop_sorted = (mass_above >= p) & (p < 1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Keep the tokens at least p times as likely as the row's most likely token (chapter 01). p = 0 is off.

    Unlike top-p the cut follows the model's confidence: a peaked distribution keeps few tokens, a
    flat one many. p <= 1, so the most likely token always stays.

    Args:
        logits: [B, V].
        p: a number or [B], in [0, 1].
    Returns:
        logits [B, V], float32.
    """
    logits = logits.float()
    probs = logits.softmax(dim=-1)
    threshold = _per_row(p, logits) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


# ------------------------------------------------------------------ the pipeline
def _rows(params: SamplingParams | Sequence[SamplingParams], batch: int) -> list[SamplingParams]:
    """One SamplingParams per row: a single one is shared by all rows."""
    if isinstance(params, SamplingParams):
        return [params] * batch
    rows = list(params)
    if len(rows) != batch:
        raise ValueError(f"got {len(rows)} SamplingParams for {batch} rows of logits: pass one, or one per row.")
    return rows


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    prompt_ids: TokenIds | None = None,
    output_ids: TokenIds | None = None,
) -> torch.Tensor:
    """Run every logits processor in the module's order (chapter 01): logits [B, V] -> float32 [B, V].

    As in vLLM, the repetition penalty looks at the prompt and the output, the frequency and presence
    penalties at the output only. Processors that are off in every row are skipped, so with nothing
    to do the float32 input itself comes back. Greedy rows (temperature below GREEDY_BELOW) are not
    divided by their temperature; their argmax is the token to pick.

    Args:
        logits: [B, V], the model's raw logits.
        params: one SamplingParams for all rows, or one per row.
        prompt_ids, output_ids: B lists of token ids, each row's prompt and generated tokens so far;
            needed only when a penalty is on.
    """
    rows = _rows(params, logits.shape[0])
    logits = logits.float()

    def column(name: str, values: list | None = None) -> torch.Tensor:  # one value per row [B], copied without a wait
        values = [getattr(r, name) for r in rows] if values is None else values
        return to_device(values, torch.long if name == "top_k" else torch.float32, logits.device)

    if any(r.repetition_penalty != 1 for r in rows):
        if prompt_ids is None and output_ids is None:
            raise ValueError("repetition_penalty needs the tokens seen so far: pass prompt_ids and output_ids.")
        empty = [[] for _ in rows]
        seen = [list(a) + list(b) for a, b in zip(prompt_ids or empty, output_ids or empty)]
        logits = apply_repetition_penalty(logits, seen, column("repetition_penalty"))
    if any(r.frequency_penalty != 0 or r.presence_penalty != 0 for r in rows):
        if output_ids is None:
            raise ValueError("frequency_penalty and presence_penalty need the generated tokens: pass output_ids.")
        counts = token_counts(output_ids, logits.shape[-1], logits.device)
        logits = apply_penalties(logits, counts, column("frequency_penalty"), column("presence_penalty"))
    if any(not r.greedy and r.temperature != 1 for r in rows):
        logits = apply_temperature(logits, column("temperature", [0.0 if r.greedy else r.temperature for r in rows]))
    if any(r.top_k > 0 for r in rows):
        logits = top_k_filter(logits, column("top_k"))
    if any(r.top_p < 1 for r in rows):
        logits = top_p_filter(logits, column("top_p"))
    if any(r.min_p > 0 for r in rows):
        logits = min_p_filter(logits, column("min_p"))
    return logits


def sample(
    logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
    prompt_ids: TokenIds | None = None,
    output_ids: TokenIds | None = None,
) -> torch.Tensor:
    """Pick one token per row (chapter 01): logits [B, V] -> token ids [B] (int64).

    The logits go through `process_logits`; greedy rows (temperature 0) take the argmax, the others
    draw from the softmax of their processed logits.

    Args:
        logits: [B, V], the model's raw logits.
        params: one SamplingParams for all rows, or one per row.
        generator: one torch.Generator drawing for the whole batch, or one per row (None entries use
            torch's global one, in one draw for all of them). With one per row, a row's tokens depend only
            on its own generator, not on which other rows share the batch.
        prompt_ids, output_ids: B lists of ids, the prompt and the tokens generated so far; needed
            when a penalty is on (see `process_logits`).
    """
    rows = _rows(params, logits.shape[0])
    logits = process_logits(logits, rows, prompt_ids, output_ids)
    tokens = logits.argmax(dim=-1)
    if all(r.greedy for r in rows):
        return tokens
    probs = logits.softmax(dim=-1)  # [B, V]
    # A row holding NaN or +inf, or no finite logit (a broken model or LoRA adapter), is no distribution: its
    # probabilities are NaN, and torch.multinomial would fail the whole draw, every other row with it. It is drawn
    # from a uniform one instead; its token's log-probability (of the raw logits) is NaN, and the engine finishes
    # such a row with an error, never using its token (`minillm.engine.llm_engine.LLMEngine._append`).
    probs = probs.masked_fill(probs.isnan().any(dim=-1, keepdim=True), 1.0 / probs.shape[-1])
    if generator is None or isinstance(generator, torch.Generator):
        drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    else:
        generators = list(generator)
        if len(generators) != len(rows):
            raise ValueError(f"got {len(generators)} generators for {len(rows)} rows: pass one, or one per row.")
        drawn = tokens.clone()
        shared = [i for i, (g, r) in enumerate(zip(generators, rows)) if g is None and not r.greedy]
        if shared:  # rows without a generator of their own: one draw for all of them, from torch's global one
            which = to_device(shared, torch.long, logits.device)
            drawn[which] = torch.multinomial(probs[which], 1).squeeze(-1)
        for i, (g, r) in enumerate(zip(generators, rows)):
            if g is not None and not r.greedy:  # a seeded row: the same call as drawing for this row alone
                drawn[i] = torch.multinomial(probs[i : i + 1], 1, generator=g)[0, 0]
    greedy = to_device([r.greedy for r in rows], torch.bool, logits.device)
    return torch.where(greedy, tokens, drawn)


# ------------------------------------------------------------------ log-probabilities
@dataclass
class SampleOutput:
    """Sampled tokens with their log-probabilities (chapter 01).

    Attributes:
        tokens: [B] int64, the chosen tokens.
        logprobs: [B] float32, each chosen token's log-probability.
        top_logprobs: per row, (ids, logprobs) of its k most likely tokens, most likely first.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_logprobs: list[tuple[list[int], list[float]]]


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int = 0) -> SampleOutput:
    """Log-probabilities of the chosen tokens and of each row's k most likely (chapter 01).

    They are those of the model's raw distribution, log_softmax of the logits before any penalty,
    temperature or filter, which is what vLLM returns by default: they say how likely the model
    found the token, not how likely the sampler was to pick it.

    Args:
        logits: [B, V], the raw logits `sample` was given.
        tokens: [B], the tokens picked.
        k: how many most likely tokens to list per row (0 = none).
    """
    chosen, top = logprob_tensors(logits, tokens, k)
    top_logprobs = [([], [])] * logits.shape[0]
    if top is not None:
        top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))  # one copy to the host for all rows
    return SampleOutput(tokens, chosen, top_logprobs)


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, k: int = 0) -> tuple[torch.Tensor, object | None]:
    """`compute_logprobs` left on the device: the chosen tokens' log-probabilities [B] (float32), and each row's k
    most likely tokens (`torch.topk`'s values and indices, [B, k]; None when k is 0)."""
    logprobs = logits.float().log_softmax(dim=-1)  # [B, V]
    chosen = logprobs.gather(-1, tokens.reshape(-1, 1)).squeeze(-1)  # [B]
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1) if k > 0 else None
    return chosen, top
