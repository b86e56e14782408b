"""Parallel sampling: n completions of one prompt from one prefill, as `SamplingParams(n, best_of)` asks (chapter 01).

Sampling the same prompt several times need not run the prompt several times, nor store it several
times. The prompt is prefilled once into a paged KV cache (chapter 04), forked into best_of
sequences that share its blocks (copy-on-write: only the partly filled last block is copied, when a
row first writes to it), and the rows decode together, one batched step per token. This is one
request of the engine (chapter 05) with `SamplingParams(n, best_of)`; the engine does the forking:

    prompt ─ prefill (1 sequence) ─► logits ─ fork it into best_of sequences sharing the prompt's blocks
    repeat: sample one token per row (row i with its own generator, seeded seed + i)
            rows that finish (EOS, stop string, max_tokens) leave the batch and free their blocks
            one decode step on the rows still running
    rank the best_of completions by cumulative log-probability, return the n best

This is vLLM's `best_of` (in its v0 engine and the OpenAI completions API): best_of sequences are
generated, the n with the highest cumulative log-probability are returned. The log-probabilities
are those `compute_logprobs` reports, log_softmax of the raw logits before temperature, top-k/p or
penalties: how likely the model found each token, not how likely the sampler was to pick it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from minillm.decoding.generation import GenerationOutput
from minillm.engine.llm_engine import LLMEngine, RequestOutput, n_best_by_logprob
from minillm.engine.sequence import prepare_prompt
from minillm.model import Transformer
from minillm.sampler.sampling import SamplingParams
from minillm.tokenizer import Tokenizer


@dataclass
class CompletionOutput(GenerationOutput):
    """One of the completions `generate_n` returns: a `GenerationOutput` plus vLLM's two extra fields.

    `logprobs` is always filled (the ranking needs it); `top_logprobs` only with `params.logprobs`.
    """

    index: int = 0  # the row that generated it; row i samples with seed + i
    cumulative_logprob: float = 0.0  # the sum of `logprobs`


def generate_n(
    model: Transformer,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    tokenizer: Tokenizer | None = None,
    kv_cache_dtype: str = "auto",
) -> list[CompletionOutput]:
    """Sample params.best_of completions of `prompt` in one batch; return the params.n most likely (chapter 01).

    Row i draws from its own generator seeded params.seed + i, so it samples exactly the tokens
    `generate(model, prompt, replace(params, seed=seed + i))` samples (up to the last bits of
    batched arithmetic; see tests/decoding/test_inference_scaling.py), and results are reproducible. Without a seed
    every row draws from torch's global generator.

    Args:
        model: the model.
        prompt: text (with a tokenizer) or token ids.
        params: sampling parameters; best_of (default n) rows are generated, n returned.
        tokenizer: encodes a text prompt, decodes the completions, matches stop strings.
        kv_cache_dtype: what the KV cache stores: "auto" (the model's dtype), "int8" or "fp8" (chapter 06).
    Returns:
        n `CompletionOutput`s, highest cumulative log-probability first (ties: lower index first).
    """
    params = params or SamplingParams()
    start = time.perf_counter()
    ids = prepare_prompt(model, prompt, params, tokenizer)
    best_of = params.best_of or params.n
    engine = LLMEngine.for_one_prompt(model, tokenizer, len(ids), params, kv_cache_dtype=kv_cache_dtype)
    # logprobs=0: each token's log-probability, which the ranking needs, and no top alternatives
    engine.add_request("n", ids, params if params.logprobs is not None else replace(params, logprobs=0),
                       arrival_time=start)
    finished = engine.run()
    return [_output(out, params) for out in n_best_by_logprob([finished["n", i] for i in range(best_of)], params.n)]


def _output(out: RequestOutput, params: SamplingParams) -> CompletionOutput:
    """A finished sequence of the engine as a `CompletionOutput` (logprobs always filled)."""
    return CompletionOutput(
        prompt_token_ids=out.prompt_token_ids,
        token_ids=out.token_ids,
        text=out.text,
        finish_reason=out.finish_reason or "length",
        token_times_s=out.token_times_s,
        logprobs=out.logprobs or [],
        top_logprobs=out.top_logprobs if params.logprobs is not None else None,
        index=out.index,
        cumulative_logprob=out.cumulative_logprob,
    )
