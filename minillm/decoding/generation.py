"""The front doors: generate one completion, stream it, or constrain it; and the loops of chapter 02 (chapters 01-02).

    prompt ids ─ prefill ─► logits of the last position ─ sample ─► token 1
    token t    ─ decode_one_token (reads the KV cache) ─► logits ─ sample ─► token t+1
    ... until EOS, a stop string, or max_tokens.

`prefill` and `decode_one_token` are separate named functions (the hot paths) so they can be
timed, profiled and compiled on their own, on chapter 02's contiguous `KVCache`. The generation
loop itself is the engine's step (`minillm.engine.LLMEngine`, chapter 05, on the paged cache of
chapter 04): `generate`, `generate_stream` and `generate_constrained` each run their one request
through an engine sized for it (`LLMEngine.for_one_prompt`), so a single call and a server share one loop.
`generate_no_cache` is the reference loop that recomputes the whole sequence at every step;
chapter 02 measures the two against each other.
`generate_constrained` runs one request whose output must match a regex or a JSON schema
(chapter 01): `minillm.sampler.constrained` builds the token index, the engine masks the logits with it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minillm.contiguous_cache import KVCache
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.sequence import Sequence, default_eos_ids, prepare_prompt
from minillm.model import Transformer
from minillm.sampler.constrained import TokenIndex
from minillm.sampler.sampling import SamplingParams, compute_logprobs, sample
from minillm.tokenizer import IncrementalDecoder, Tokenizer

if TYPE_CHECKING:
    from minillm.sampler.speculative import SpeculativeConfig, SpeculativeStats


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


def check_one_completion(params: SamplingParams) -> None:
    """`generate` returns one completion: refuse n or best_of > 1 rather than drop the others silently."""
    if params.n > 1 or (params.best_of or 1) > 1:
        raise ValueError(
            f"generate returns one completion, but params asks for n={params.n}, best_of={params.best_of}: "
            "use minillm.generate_n for several completions of one prompt."
        )


def generate_stream(
    model: Transformer,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    tokenizer: Tokenizer | None = None,
    use_cache: bool = True,
    speculative: SpeculativeConfig | None = None,
    kv_cache_dtype: str = "auto",
    compile_decode: bool | str = False,
) -> Iterator[StreamChunk]:
    """Generate for one prompt, yielding each token as soon as it is sampled (a verify step of speculative
    decoding may yield several at once).

    With `use_cache=False` every step recomputes the whole sequence (the reference loop). `kv_cache_dtype`
    and `compile_decode` as in `generate`.
    """
    params, ids, engine, start = _begin(model, prompt, params, tokenizer, use_cache, speculative, kv_cache_dtype,
                                        compile_decode)
    return _stream(model, ids, params, tokenizer, engine, start)


def _begin(model: Transformer, prompt: str | list[int], params: SamplingParams | None, tokenizer: Tokenizer | None,
           use_cache: bool, speculative: SpeculativeConfig | None, kv_cache_dtype: str, compile_decode: bool | str
           ) -> tuple[SamplingParams, list[int], LLMEngine | None, float]:
    """What `generate` and `generate_stream` do first: (params, the checked prompt ids, the engine or None, the
    start time every chunk's time counts from)."""
    params = params or SamplingParams()
    check_one_completion(params)
    start = time.perf_counter()
    ids = prepare_prompt(model, prompt, params, tokenizer)
    return params, ids, _engine_for(model, ids, params, tokenizer, use_cache, speculative, kv_cache_dtype,
                                    compile_decode), start


def _engine_for(model: Transformer, ids: list[int], params: SamplingParams, tokenizer: Tokenizer | None,
                use_cache: bool, speculative: SpeculativeConfig | None, kv_cache_dtype: str = "auto",
                compile_decode: bool | str = False) -> LLMEngine | None:
    """The engine of chapter 05 sized for this one request, or None for the reference loop without a cache."""
    if not use_cache:
        if speculative is not None:
            raise ValueError("speculative decoding verifies drafts against the KV cache: drop use_cache=False.")
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} sets how the KV cache is stored, and use_cache=False "
                             "keeps none: drop one of them.")
        if compile_decode:
            raise ValueError("compile_decode compiles the cached decode step, and use_cache=False runs none: drop "
                             "one of them.")
        return None
    return LLMEngine.for_one_prompt(model, tokenizer, len(ids), params, speculative, kv_cache_dtype, compile_decode)


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
    row = Sequence("no-cache", ids, params, arrival_time=start,  # the engine's stopping rules, text, logprobs
                   detokenizer=IncrementalDecoder(tokenizer, ids) if tokenizer is not None else None,
                   eos_token_ids=set() if params.ignore_eos else default_eos_ids(model, tokenizer))
    sequence = torch.tensor([ids], device=device)
    for _ in range(params.max_tokens):
        logits = prefill(model, sequence, None)  # the whole sequence, every step
        token = sample(logits, params, generator, prompt_ids=[ids], output_ids=[row.output_token_ids])  # [1]
        token_id = int(token.item())  # waits for the device: the token is really ready
        lp = compute_logprobs(logits, token, params.logprobs or 0)
        text_before = len(row.text)
        row.append_token(token_id, float(lp.logprobs[0]), dict(zip(*lp.top_logprobs[0])), time.perf_counter())
        wanted = params.logprobs is not None
        yield StreamChunk(token_id, row.text[text_before:], row.token_times[-1], row.finish_reason,
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
    compile_decode: bool | str = False,
) -> GenerationOutput:
    """Generate a completion of `prompt` (text, with a tokenizer, or token ids).

    With `speculative` (`minillm.sampler.speculative.SpeculativeConfig`, chapter 07), a drafter proposes tokens and
    the model verifies them; the output follows the same distribution (at temperature 0: the same tokens),
    and `out.speculative` says how many drafts were accepted. `kv_cache_dtype` ("auto", "int8" or "fp8",
    chapter 06, `minillm.quant.kv`) is how the engine's KV cache stores keys and values. `compile_decode`
    (a CPU only) runs every decode step compiled ahead of time, loaded from the cache of compiled steps or compiled
    at the first decode step (tens of seconds, once per model, thread count and layout; `minillm compile` does it
    ahead); "background" compiles a step the cache lacks in a process of its own and decodes eagerly meanwhile:
    `minillm.engine.model_runner.ModelRunner`.

    Example:
        >>> out = generate(model, "To be", SamplingParams(temperature=0, max_tokens=20), tok)
        >>> out.text, out.finish_reason, out.ttft_s, out.decode_tokens_per_s
    """
    params, ids, engine, start = _begin(model, prompt, params, tokenizer, use_cache, speculative, kv_cache_dtype,
                                        compile_decode)
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


@dataclass
class ConstrainedOutput:
    """What `generate_constrained` returns.

    finish_reason: "stop" (EOS in an accepting state, or an accepting state nothing can follow) or
    "length" (max_tokens). complete: the text fully matches the pattern / validates against the
    schema; False only when max_tokens cut it short, and then `text` must not be trusted.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids, including a sampled EOS
    text: str  # the generated text (EOS excluded)
    finish_reason: str
    complete: bool
    state: int  # the DFA state at the end


def generate_constrained(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str | list[int],
    constraint: str | dict | TokenIndex,
    params: SamplingParams | None = None,
    kv_cache_dtype: str = "auto",
) -> ConstrainedOutput:
    """Generate a completion of `prompt` whose text matches a regex (str) or a JSON schema (dict) (chapter 01).

    Pass a prebuilt `TokenIndex` to reuse it across calls; a str or dict builds one each call.
    It runs as one request of the engine (`LLMEngine.add_request(..., constraint=index)`), which at every
    step masks the logits to the state's allowed tokens, samples, and advances the DFA. `kv_cache_dtype`:
    what its KV cache stores, "auto" (the model's dtype), "int8" or "fp8" (chapter 06).

    Example:
        >>> out = generate_constrained(model, tok, "Age: ", r"[1-9][0-9]?", SamplingParams(max_tokens=4))
        >>> out.text, out.complete
        ('42', True)
    """
    params = params or SamplingParams()
    check_one_completion(params)

    start = time.perf_counter()
    ids = prepare_prompt(model, prompt, params, tokenizer)
    index = constraint
    if not isinstance(index, TokenIndex):
        index = TokenIndex.from_constraint(constraint, tokenizer, model.config.eos_token_ids)
    if index.is_finished(index.start):  # the pattern allows only the empty string
        return _output(index, ids, [], "stop", index.start)
    engine = LLMEngine.for_one_prompt(model, tokenizer, len(ids), params, kv_cache_dtype=kv_cache_dtype)
    engine.add_request("constrained", ids, params, arrival_time=start, constraint=index)
    out = engine.run()["constrained", 0]
    state = index.start
    for token in out.token_ids:  # the DFA state the output ends in
        if token not in index.eos_token_ids:
            state = index.advance(state, token)
    return _output(index, ids, out.token_ids, out.finish_reason or "length", state)


def _output(
    index: TokenIndex, prompt_ids: list[int], generated: list[int], finish: str, state: int
) -> ConstrainedOutput:
    pieces = [index.token_bytes[t] for t in generated if t not in index.eos_token_ids]
    return ConstrainedOutput(
        prompt_token_ids=prompt_ids,
        token_ids=generated,
        text=b"".join(pieces).decode("utf-8", errors="replace"),  # valid UTF-8 whenever complete
        finish_reason=finish,
        complete=index.dfa.is_accepting(state),
        state=state,
    )
