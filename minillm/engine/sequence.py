"""One sequence being generated, and everything the engine knows about it (chapters 01 and 05).

A request asks for one completion of a prompt, or for several (`SamplingParams(n, best_of)`). Each
completion is a `Sequence`: its prompt and the tokens generated so far, how many of them have their
keys and values in the KV cache, its sampling parameters and random generator, its stop rules, its
state under a constraint (chapter 01), its text so far and its timing. The scheduler queues
sequences, the model runner runs them, the engine appends their tokens; nothing about a sequence is
kept anywhere else (its blocks are in the cache's block table of the same id).

A request with best_of > 1 starts as one sequence; when its prompt is done, the engine forks it into
best_of sequences that share the prompt's blocks (copy-on-write, chapter 04). They are Sequences of
one request: the same `request_id`, indices 0 .. best_of - 1. The first keeps the request's id as its
`seq_id` (the key of the scheduler and of the cache); sequence i > 0 has the key (request_id, i).

Also here: the checks a prompt passes before it becomes a sequence (`prepare_prompt`), the ids that end
one (`default_eos_ids`), and the stop-string matcher that cuts its text (`StopStringMatcher`).
"""

from __future__ import annotations

import enum
import numbers
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minillm.model import Transformer
from minillm.sampler.sampling import SamplingParams
from minillm.tokenizer import IncrementalDecoder, Tokenizer

if TYPE_CHECKING:
    from minillm.sampler.constrained.token_index import TokenIndex


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # in the queue: not admitted yet, or preempted
    RUNNING = "running"  # in the batch: its blocks are in the cache
    FINISHED = "finished"  # done (stop, length or abort); its blocks are freed


@dataclass
class Constraint:
    """What a constrained request's sequences share (chapter 01): the pattern's token index, and its
    allowed-token masks [n_states, vocab] bool on the model's device (`minillm.sampler.constrained.masks_for`)."""

    index: TokenIndex
    masks: torch.Tensor


class StopStringMatcher:
    """Finds stop strings in streamed text, across token boundaries.

    Text that might be the start of a stop string is held back until the next tokens show
    whether the stop string completes (then it is cut, with everything after) or not (then it
    is released).
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit now, whether a stop string was found)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0  # the longest tail of `pending` that some stop string begins with
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """Release whatever is held back (generation ended for another reason)."""
        out, self.pending = self.pending, ""
        return out


@dataclass(eq=False)
class Sequence:
    """One sequence's whole state: what the scheduler, the model runner and the engine read and change.

    The tokens of a sequence are its prompt followed by what it generated so far; the first
    `num_computed_tokens` of them have their keys and values in the KV cache. So the next forward
    must compute `num_tokens - num_computed_tokens` of them: the rest of the prompt (prefill, maybe in
    chunks), or just the last generated token (decode).

    The scheduler (chapter 05) needs only the first fields: `Sequence("a", prompt_ids, params)`. The
    engine also fills in the rest: which request it belongs to, its generator, its detokenizer and
    stop matcher (`append_token` applies the stopping rules), its constraint and DFA state.
    """

    seq_id: Hashable  # the scheduler's and the cache's key for it
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    num_preemptions: int = 0
    request_id: str | None = None  # the request it belongs to; None: its seq_id
    index: int = 0  # which of the request's best_of sequences; it samples with seed + index
    generator: torch.Generator | None = field(default=None, repr=False)
    detokenizer: IncrementalDecoder | None = field(default=None, repr=False)
    eos_token_ids: set[int] = field(default_factory=set, repr=False)  # the ids that end it (none with ignore_eos)
    constraint: Constraint | None = field(default=None, repr=False)
    dfa_state: int | None = None  # under a constraint: its state in the pattern's automaton
    # What it generated, beside output_token_ids: each token's log-probability, top alternatives, and time
    # since arrival (filled by append_token); its text so far, stop strings cut.
    logprobs: list[float] = field(default_factory=list, repr=False)
    top_logprobs: list[dict[int, float]] = field(default_factory=list, repr=False)
    token_times: list[float] = field(default_factory=list, repr=False)
    text: str = ""
    cumulative_logprob: float = 0.0  # the sum of `logprobs` (best_of keeps the n highest), kept as they come
    lora: str | None = None  # the LoRA adapter it runs under (chapter 08), None for the base model
    # With async scheduling (`LLMEngine(async_scheduling=True)`): a token sampled on the device whose value the host
    # has not read yet (0 or 1), and its row in that step's tensor of sampled tokens. The next step feeds it to the
    # model straight from the device (`inflight_token`); the host appends it when it reads the step's results.
    num_inflight: int = 0
    inflight_row: int = 0

    def __post_init__(self) -> None:
        if self.request_id is None:
            self.request_id = str(self.seq_id)
        self.stops = StopStringMatcher(self.params.stop)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop], without building the whole list (a decode step asks for one token). A token
        still in flight (async scheduling) is its placeholder, `inflight_token(inflight_row)`."""
        prompt, known = len(self.prompt_token_ids), len(self.prompt_token_ids) + len(self.output_token_ids)
        if start >= prompt:
            tokens = self.output_token_ids[start - prompt : stop - prompt]
        else:
            tokens = self.all_token_ids[start:stop]
        if self.num_inflight and stop > known:
            tokens.append(inflight_token(self.inflight_row))
        return tokens

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens, counting one still in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, counting one still in flight."""
        return len(self.output_token_ids) + self.num_inflight

    @property
    def awaits_last_token(self) -> bool:
        """Its last token (max_tokens reached) is in flight: nothing is left to compute, only to read."""
        return self.num_inflight > 0 and self.num_output_tokens >= self.params.max_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next forwards must still compute before this sequence can sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Whether its next chunk is (re)computing more than the last token: prompt work, not a decode step."""
        return self.num_uncomputed_tokens > 1 or not self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


    def fork(self, seq_id: Hashable, index: int, generator: torch.Generator | None) -> Sequence:
        """Sequence `index` of the same request, a copy of this one so far (its blocks: `PagedKVCache.fork`)."""
        return Sequence(seq_id, self.prompt_token_ids, self.params, self.arrival_time, list(self.output_token_ids),
                        self.num_computed_tokens, self.status, request_id=self.request_id, index=index,
                        generator=generator,
                        detokenizer=(IncrementalDecoder(self.detokenizer.tokenizer, self.prompt_token_ids)
                                     if self.detokenizer is not None else None),
                        eos_token_ids=self.eos_token_ids, constraint=self.constraint, dfa_state=self.dfa_state,
                        lora=self.lora)

    def append_token(self, token_id: int, logprob: float, top: dict[int, float], now: float) -> None:
        """Add one sampled token, with its log-probability, top alternatives and the time (perf_counter) it
        was ready; set `finish_reason` if it ends the sequence: an EOS id, a stop string (cut from the text),
        the pattern of its constraint complete, or max_tokens reached."""
        self.output_token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.cumulative_logprob += logprob
        self.top_logprobs.append(top)
        self.token_times.append(now - self.arrival_time)
        stopped = False
        if self.detokenizer is not None:
            text, stopped = self.stops.feed(self.detokenizer.push(token_id))
            self.text += text
        if stopped or token_id in self.eos_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_token_ids) == self.params.max_tokens:
            self.finish_reason = "length"
        elif self._advance_constraint(token_id):
            self.finish_reason = "stop"  # the pattern is complete and nothing may follow
        if self.finish_reason is not None and not stopped:
            self.text += self.stops.flush()

    def _advance_constraint(self, token_id: int) -> bool:
        """Move the DFA over the new token; True if the pattern is now finished (nothing may follow)."""
        if self.constraint is None:
            return False
        index = self.constraint.index
        if token_id in index.eos_token_ids:
            if not index.dfa.is_accepting(self.dfa_state):
                raise RuntimeError(f"the sampler picked EOS {token_id} where the mask forbade it.")
            return True
        self.dfa_state = index.advance(self.dfa_state, token_id)  # raises if the sampler ignored the mask
        return index.is_finished(self.dfa_state)


def inflight_token(row: int) -> int:
    """The placeholder id of a token still on the device, row `row` of the step's sampled tokens: negative, so it is
    never a real id. The model runner swaps it for the token on the device (`minillm.engine.model_runner`)."""
    return -1 - row


def swap_inflight(tokens: torch.Tensor, previous: torch.Tensor) -> None:
    """Replace, in place and on the device, every placeholder in a step's input tokens (any shape) by the token it
    stands for: placeholder `inflight_token(row)` becomes previous[row], previous being the step before's sampled
    tokens [B']. No host round trip: the tokens never leave the GPU between the two steps."""
    rows = (-1 - tokens).clamp(min=0)  # a placeholder's row; 0 for real ids (then ignored)
    tokens.copy_(torch.where(tokens < 0, previous[rows], tokens))


def prepare_prompt(
    model: Transformer, prompt: str | list[int] | torch.Tensor, params: SamplingParams, tokenizer: Tokenizer | None
) -> list[int]:
    """Prompt (text, int ids, or a 1-D integer tensor) -> ids, checked: ints (no float or bool), not empty, in the
    vocabulary, and room for max_tokens."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass tokenizer=..., or pass token ids.")
        ids = tokenizer.encode(prompt)
    else:
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.is_floating_point() or prompt.dtype == torch.bool:
                raise ValueError(f"a prompt tensor must hold one sequence of integer token ids (1-D), got shape "
                                 f"{list(prompt.shape)} of {prompt.dtype}: pass prompt[0] for a batch of one.")
            prompt = prompt.tolist()
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise ValueError(f"prompt token ids must be ints, got {bad[:3]!r} ({type(bad[0]).__name__}): pass a text "
                             "prompt, or a list of int ids (a float is never rounded to an id for you).")
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty: give at least one token.")
    vocab = model.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}).")
    limit = model.config.max_seq_len
    if len(ids) + params.max_tokens > limit:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
            f"{len(ids) + params.max_tokens} exceeds the model's context of {limit} tokens; "
            "shorten the prompt or lower max_tokens."
        )
    if params.stop and tokenizer is None:
        raise ValueError("stop strings are matched on text: pass a tokenizer, or drop stop=.")
    return ids


def default_eos_ids(model: Transformer, tokenizer: Tokenizer | None) -> set[int]:
    """The ids that end a sequence: the model config's and the tokenizer's."""
    return set(model.config.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else [])
