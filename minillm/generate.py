"""The generation loop: prefill once, then decode one token at a time (chapters 01-02).

    prompt ids ─ prefill ─► logits of the last position ─ sample ─► token 1
    token t    ─ decode_one_token (reads the KV cache) ─► logits ─ sample ─► token t+1
    ... until EOS, a stop string, or max_tokens.

`prefill` and `decode_one_token` are separate named functions (the hot paths) so they can be
timed, profiled and compiled on their own, on chapter 02's contiguous `KVCache`. `generate` itself
runs its one request through the engine of chapter 05 (`minillm.engine.LLMEngine`, on the paged
cache of chapter 04): one generation loop serves a single call and a server alike.
`generate_no_cache` is the reference loop that recomputes the whole sequence at every step;
chapter 02 measures the two against each other.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minillm.kv_cache import KVCache
from minillm.model import Transformer
from minillm.sampling import SamplingParams, compute_logprobs, sample
from minillm.tokenizer import IncrementalDecoder, Tokenizer

if TYPE_CHECKING:
    from minillm.engine import LLMEngine
    from minillm.speculative import SpeculativeConfig, SpeculativeStats


@dataclass
class StreamChunk:
    """One generated token, as `generate_stream` yields it.

    `text` is the text this token completes ('' when it ends mid-character, when the text is
    held back because it may begin a stop string, or without a tokenizer). `finish_reason` is
    set on the last chunk only: "stop" (EOS or a stop string) or "length" (max_tokens). With
    `params.logprobs` set, `logprob` is the token's log-probability under the model's raw distribution
    and `top_logprobs` maps the `params.logprobs` most likely ids to theirs.
    """

    token_id: int
    text: str
    time_s: float  # seconds since the call started
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass
class GenerationOutput:
    """What `generate` returns: the generated ids and text, why it stopped, and its timing."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only, including an EOS or stop-string tokens
    text: str | None  # generated text, stop string excluded (None without a tokenizer)
    finish_reason: str  # "stop" or "length"
    token_times_s: list[float] = field(repr=False)  # when each token was ready, since the call began
    logprobs: list[float] | None = None  # with params.logprobs: each generated token's log-probability
    top_logprobs: list[dict[int, float]] | None = None  # with params.logprobs: {id: logprob} of the most likely
    speculative: SpeculativeStats | None = None  # with speculative=...: what was drafted and accepted (chapter 07)

    @property
    def ttft_s(self) -> float:
        """Time to first token: the prefill plus the first sample."""
        return self.token_times_s[0]

    @property
    def inter_token_latencies_s(self) -> list[float]:
        """Seconds between consecutive tokens (one decode step each)."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (mean decode step); nan with one token."""
        itl = self.inter_token_latencies_s
        return sum(itl) / len(itl) if itl else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode speed: tokens after the first, per second of decoding."""
        return 1.0 / self.tpot_s if self.inter_token_latencies_s else float("nan")


@torch.inference_mode()
def prefill(model: Transformer, tokens: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """Run the prompt tokens [B, T] through the model; logits of the last position [B, vocab]."""
    return model(tokens, cache=cache, last_only=True)[:, -1]


@torch.inference_mode()
def decode_one_token(model: Transformer, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One decode step: token [B, 1] attends to the cache; logits [B, vocab]."""
    return model(token, cache=cache)[:, -1]


def prepare_prompt(
    model: Transformer, prompt: str | list[int], params: SamplingParams, tokenizer: Tokenizer | None
) -> list[int]:
    """Prompt -> ids, checked: not empty, ids in the vocabulary, and room for max_tokens."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass tokenizer=..., or pass token ids.")
        ids = tokenizer.encode(prompt)
    else:
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


def check_one_completion(params: SamplingParams) -> None:
    """`generate` returns one completion: refuse n or best_of > 1 rather than drop the others silently."""
    if params.n > 1 or (params.best_of or 1) > 1:
        raise ValueError(
            f"generate returns one completion, but params asks for n={params.n}, best_of={params.best_of}: "
            "use minillm.generate_n for several completions of one prompt."
        )


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


class CompletionState:
    """One completion being generated: its tokens, text, log-probabilities and times so far, and why it
    ended (`generate_n`'s rows, the engine's requests). `push` applies `generate`'s stopping rules:
    EOS, a stop string (cut from the text), or the last allowed token."""

    def __init__(self, prompt_ids: list[int], tokenizer: Tokenizer | None, params: SamplingParams) -> None:
        self.decoder = IncrementalDecoder(tokenizer, prompt_ids) if tokenizer is not None else None
        self.stops = StopStringMatcher(params.stop)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.times: list[float] = []
        self.text = ""
        self.finish_reason: str | None = None

    def push(self, token_id: int, logprob: float, top: dict[int, float], time_s: float, eos: set[int],
             last: bool) -> None:
        """Add one sampled token; set `finish_reason` if it ends the row (the rules of `generate`)."""
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.times.append(time_s)
        stopped = False
        if self.decoder is not None:
            text, stopped = self.stops.feed(self.decoder.push(token_id))
            self.text += text
        if stopped or token_id in eos:
            self.finish_reason = "stop"
        elif last:
            self.finish_reason = "length"
        if self.finish_reason is not None and not stopped:
            self.text += self.stops.flush()


def generate_stream(
    model: Transformer,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    tokenizer: Tokenizer | None = None,
    use_cache: bool = True,
    speculative: SpeculativeConfig | None = None,
    kv_cache_dtype: str = "auto",
) -> Iterator[StreamChunk]:
    """Generate for one prompt, yielding each token as soon as it is sampled (a verify step of speculative
    decoding may yield several at once).

    With `use_cache=False` every step recomputes the whole sequence (the reference loop). `kv_cache_dtype`
    as in `generate`.
    """
    params = params or SamplingParams()
    check_one_completion(params)
    start = time.perf_counter()
    ids = prepare_prompt(model, prompt, params, tokenizer)
    engine = _engine_for(model, ids, params, tokenizer, use_cache, speculative, kv_cache_dtype)
    return _stream(model, ids, params, tokenizer, engine, start)


def _engine_for(model: Transformer, ids: list[int], params: SamplingParams, tokenizer: Tokenizer | None,
                use_cache: bool, speculative: SpeculativeConfig | None, kv_cache_dtype: str = "auto"
                ) -> LLMEngine | None:
    """The engine of chapter 05 sized for this one request, or None for the reference loop without a cache."""
    if not use_cache:
        if speculative is not None:
            raise ValueError("speculative decoding verifies drafts against the KV cache: drop use_cache=False.")
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} sets how the KV cache is stored, and use_cache=False "
                             "keeps none: drop one of them.")
        return None
    from minillm.engine import LLMEngine

    return LLMEngine.for_one_prompt(model, tokenizer, len(ids), params, speculative, kv_cache_dtype)


def _stream(
    model: Transformer, ids: list[int], params: SamplingParams, tokenizer: Tokenizer | None,
    engine: LLMEngine | None, start: float,
) -> Iterator[StreamChunk]:
    """The loop, on prompt ids `prepare_prompt` already checked; times count from `start`.

    With an engine, this is the engine's loop (chapter 05) serving one request: a paged KV cache of
    just the blocks this request needs, the whole prompt prefilled in one step, then one decode step
    per token (or per verify step). Without, the reference loop below recomputes the whole sequence
    every step.
    """
    if engine is not None:
        yield from _stream_on_engine(engine, ids, params, start)
        return
    device = model.device
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    eos = set() if params.ignore_eos else default_eos_ids(model, tokenizer)
    row = CompletionState(ids, tokenizer, params)  # the engine's stopping rules, text and log-probabilities
    sequence = torch.tensor([ids], device=device)
    for n in range(1, params.max_tokens + 1):
        logits = prefill(model, sequence, None)  # the whole sequence, every step
        token = sample(logits, params, generator, prompt_ids=[ids], output_ids=[row.token_ids])  # [1]
        token_id = int(token.item())  # waits for the device: the token is really ready
        lp = compute_logprobs(logits, token, params.logprobs or 0)
        text_before = len(row.text)
        row.push(token_id, float(lp.logprobs[0]), dict(zip(*lp.top_logprobs[0])), time.perf_counter() - start, eos,
                 n == params.max_tokens)
        wanted = params.logprobs is not None
        yield StreamChunk(token_id, row.text[text_before:], row.times[-1], row.finish_reason,
                          row.logprobs[-1] if wanted else None, row.top_logprobs[-1] if wanted else None)
        if row.finish_reason is not None:
            return
        sequence = torch.cat([sequence, token[:, None]], dim=1)


def _stream_on_engine(engine: LLMEngine, ids: list[int], params: SamplingParams, start: float
                      ) -> Iterator[StreamChunk]:
    """One request through `minillm.engine.LLMEngine`, its outputs as StreamChunks, one per token.

    A step's new text comes whole with its last token (a verify step of chapter 07 may add several).
    """
    request_id = engine.add_request("generate", ids, params, arrival_time=start)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.new_token_ids)
                for j, token in enumerate(out.new_token_ids):
                    i = len(out.token_ids) - n + j  # its index in the completion
                    final = j == n - 1
                    yield StreamChunk(
                        token, out.new_text if final else "", out.token_times_s[i],
                        out.finish_reason if out.finished and final else None,
                        out.logprobs[i] if out.logprobs is not None else None,
                        out.top_logprobs[i] if out.top_logprobs is not None else None,
                    )
    finally:  # the caller stopped reading early: free the request
        engine.abort_request(request_id)


def generate(
    model: Transformer,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    tokenizer: Tokenizer | None = None,
    use_cache: bool = True,
    speculative: SpeculativeConfig | None = None,
    kv_cache_dtype: str = "auto",
) -> GenerationOutput:
    """Generate a completion of `prompt` (text, with a tokenizer, or token ids).

    With `speculative` (`minillm.speculative.SpeculativeConfig`, chapter 07), a drafter proposes tokens and
    the model verifies them; the output follows the same distribution (at temperature 0: the same tokens),
    and `out.speculative` says how many drafts were accepted. `kv_cache_dtype` ("auto", "int8" or "fp8",
    chapter 06, `minillm.kv_quant`) is how the engine's KV cache stores keys and values.

    Example:
        >>> out = generate(model, "To be", SamplingParams(temperature=0, max_tokens=20), tok)
        >>> out.text, out.finish_reason, out.ttft_s, out.decode_tokens_per_s
    """
    params = params or SamplingParams()
    check_one_completion(params)
    start = time.perf_counter()
    ids = prepare_prompt(model, prompt, params, tokenizer)
    engine = _engine_for(model, ids, params, tokenizer, use_cache, speculative, kv_cache_dtype)
    chunks = list(_stream(model, ids, params, tokenizer, engine, start))
    return GenerationOutput(
        prompt_token_ids=ids,
        token_ids=[c.token_id for c in chunks],
        text="".join(c.text for c in chunks) if tokenizer is not None else None,
        finish_reason=chunks[-1].finish_reason or "length",
        token_times_s=[c.time_s for c in chunks],
        logprobs=[c.logprob for c in chunks] if params.logprobs is not None else None,
        top_logprobs=[c.top_logprobs for c in chunks] if params.logprobs is not None else None,
        speculative=engine.spec_stats if speculative is not None else None,
    )


def generate_no_cache(
    model: Transformer,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    tokenizer: Tokenizer | None = None,
) -> GenerationOutput:
    """The reference loop without a KV cache: each step runs the whole sequence again."""
    return generate(model, prompt, params, tokenizer, use_cache=False)
