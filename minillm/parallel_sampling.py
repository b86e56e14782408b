"""Parallel sampling: n completions of one prompt from one prefill, as `SamplingParams(n, best_of)` asks (chapter 01).

Sampling the same prompt several times need not run the prompt several times, nor store it several
times. The prompt is prefilled once into a paged KV cache (chapter 04), forked into best_of
sequences that share its blocks (copy-on-write: only the partly filled last block is copied, when a
row first writes to it), and the rows decode together, one batched step per token:

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
from dataclasses import dataclass

import torch

from minillm.beam import default_eos_ids
from minillm.generate import CompletionState, GenerationOutput, prepare_prompt
from minillm.metrics import kv_blocks
from minillm.model import Transformer
from minillm.paging import PagedKVCache, paged_forward
from minillm.sampling import SamplingParams, compute_logprobs, sample
from minillm.tokenizer import Tokenizer

BLOCK_SIZE = 16  # tokens per KV block (vLLM's default)


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
) -> list[CompletionOutput]:
    """Sample params.best_of completions of `prompt` in one batch; return the params.n most likely (chapter 01).

    Row i draws from its own generator seeded params.seed + i, so it samples exactly the tokens
    `generate(model, prompt, replace(params, seed=seed + i))` samples (up to the last bits of
    batched arithmetic; see tests/test_inference_scaling.py), and results are reproducible. Without a seed
    every row draws from torch's global generator.

    Args:
        model: the model.
        prompt: text (with a tokenizer) or token ids.
        params: sampling parameters; best_of (default n) rows are generated, n returned.
        tokenizer: encodes a text prompt, decodes the completions, matches stop strings.
    Returns:
        n `CompletionOutput`s, highest cumulative log-probability first (ties: lower index first).
    """
    params = params or SamplingParams()
    start = time.perf_counter()
    ids = prepare_prompt(model, prompt, params, tokenizer)
    best_of = params.best_of or params.n
    device = model.device
    eos = set() if params.ignore_eos else default_eos_ids(model, tokenizer)
    rows = [CompletionState(ids, tokenizer, params) for _ in range(best_of)]
    generators = [
        torch.Generator(device=device).manual_seed(params.seed + i) if params.seed is not None else None
        for i in range(best_of)
    ]

    # The prompt's blocks once, and per row its own blocks for max_tokens tokens plus the copy of the
    # shared, partly filled last prompt block.
    num_blocks = kv_blocks(len(ids), BLOCK_SIZE) + best_of * (kv_blocks(params.max_tokens, BLOCK_SIZE) + 1)
    cache = PagedKVCache(model.config, num_blocks, BLOCK_SIZE, device, model.dtype, enable_prefix_caching=False)
    cache.add_sequence(0)
    logits = paged_forward(model, cache, [0], [ids])  # [1, V]
    for i in range(1, best_of):
        cache.fork(0, i)  # row i shares the prompt's blocks: nothing is copied
    logits = logits.expand(best_of, -1)  # [best_of, V]
    running = list(range(best_of))  # which row each batch position holds
    for step in range(1, params.max_tokens + 1):
        tokens = sample(
            logits, params, [generators[r] for r in running],
            prompt_ids=[ids] * len(running), output_ids=[rows[r].token_ids for r in running],
        )  # [len(running)]
        lp = compute_logprobs(logits, tokens, params.logprobs or 0)
        now = time.perf_counter() - start
        for j, r in enumerate(running):
            top = dict(zip(*lp.top_logprobs[j]))
            rows[r].push(int(tokens[j]), float(lp.logprobs[j]), top, now, eos, step == params.max_tokens)
        for r in running:
            if rows[r].finish_reason is not None:
                cache.free(r)  # a finished row leaves the batch and gives its blocks back
        still = [j for j, r in enumerate(running) if rows[r].finish_reason is None]
        if not still:
            break
        running = [running[j] for j in still]
        logits = paged_forward(model, cache, running, [[t] for t in tokens[still].tolist()])

    outputs = [_output(i, row, ids, tokenizer, params) for i, row in enumerate(rows)]
    outputs.sort(key=lambda o: -o.cumulative_logprob)  # a stable sort: ties keep the lower index first
    return outputs[: params.n]


def _output(
    index: int, row: CompletionState, prompt_ids: list[int], tokenizer: Tokenizer | None, params: SamplingParams
) -> CompletionOutput:
    """A finished row as a `CompletionOutput`."""
    return CompletionOutput(
        prompt_token_ids=prompt_ids,
        token_ids=row.token_ids,
        text=row.text if tokenizer is not None else None,
        finish_reason=row.finish_reason or "length",
        token_times_s=row.times,
        logprobs=row.logprobs,
        top_logprobs=row.top_logprobs if params.logprobs is not None else None,
        index=index,
        cumulative_logprob=sum(row.logprobs),
    )
