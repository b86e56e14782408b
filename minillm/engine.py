"""The engine: continuous batching of many requests over one paged KV cache (chapter 05).

`LLMEngine` is the loop a server runs. Requests arrive at any time (`add_request`); each `step()`
asks the `Scheduler` which requests run and how many of their tokens, runs ONE forward of the model
over all of them (prompt chunks and decode tokens in one ragged batch on the `PagedKVCache` of
chapter 04), samples one token for every request whose prompt is complete, each with its own
`SamplingParams`, and returns what each request gained in this step (a streaming delta):

    step ──► scheduler.schedule()             who runs, how many tokens each (token budget, free blocks)
         ──► cache.prepare(ids, tokens)       the step's block tables and slot mapping
         ──► model(view.tokens, cache=view)   one forward for prefill chunks and decodes together
         ──► sample each finished prompt's row with its own params and generator
         ──► stop rules (EOS, stop strings, max_tokens); finished requests free their blocks

`LLM(model).generate(prompts, params)` runs the engine to the end over a list of prompts (offline
batch inference, with a progress bar). Names follow vLLM: `LLMEngine.add_request / step /
abort_request / has_unfinished_requests`, `LLM.generate`, `SamplingParams`, `RequestOutput`.

`minillm.generate` (one request) runs on this engine. Not here yet: n > 1 completions per request
(`minillm.generate_n` forks a paged cache itself), beam search (`minillm.beam`, the same) and
constrained decoding, which keep their own loops for now.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minillm.generate import CompletionState, prepare_prompt
from minillm.metrics import kv_blocks
from minillm.model import Transformer
from minillm.notebook import tqdm
from minillm.paging import PagedKVCache
from minillm.sampling import SamplingParams, compute_logprobs, sample
from minillm.scheduler import Request, Scheduler, SchedulerOutput
from minillm.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    """A request's output after a step: everything generated so far, and what this step added.

    new_token_ids / new_text are the step's delta (what a streaming server sends); token_ids / text
    the whole completion so far. text is None without a tokenizer. token_times_s count from the
    request's arrival: token_times_s[0] is its time to first token.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    token_times_s: list[float] = field(repr=False, default_factory=list)
    logprobs: list[float] | None = None  # with params.logprobs: each generated token's log-probability
    top_logprobs: list[dict[int, float]] | None = None  # with params.logprobs: {id: logprob} of the most likely
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] if self.token_times_s else float("nan")


class LLMEngine:
    """Serve many requests at once with continuous batching, chunked prefill and a paged KV cache (chapter 05).

    Args:
        model: the model (its device and dtype are the cache's).
        tokenizer: encodes text prompts, decodes outputs, matches stop strings (optional with token ids).
        num_blocks: KV blocks in the pool; default: max_num_seqs sequences of the model's full context.
        block_size: tokens per block (16, vLLM's default).
        max_num_seqs, max_num_batched_tokens, enable_chunked_prefill: the scheduler's budgets (see
            `minillm.scheduler.Scheduler`).
        enable_prefix_caching: reuse cached full blocks of earlier prompts (chapter 04).
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        if num_blocks is None:
            num_blocks = max_num_seqs * kv_blocks(model.config.max_seq_len, block_size)
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.device, model.dtype,
                                  enable_prefix_caching)
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
        self.eos = set(model.config.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else [])
        self._completions: dict[str, CompletionState] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self.last_step: SchedulerOutput | None = None  # the record of the latest step
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request; returns its id (a fresh one if request_id is None).

        Checked now, with a ValueError that says what to change: an empty prompt, ids outside the
        vocabulary, prompt + max_tokens beyond the model's context or the cache, stop strings without a
        tokenizer, n or best_of > 1 (use `minillm.generate_n`).
        """
        params = params or SamplingParams()
        if params.n > 1 or (params.best_of or 1) > 1:
            raise ValueError(f"the engine returns one completion per request, but params asks for n={params.n}, "
                             f"best_of={params.best_of}: use minillm.generate_n for several completions of one prompt.")
        ids = prepare_prompt(self.model, prompt, params, self.tokenizer)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        request = Request(request_id, ids, params)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add(request)  # refuses ids in use and requests larger than the cache
        self._completions[request_id] = CompletionState(ids, self.tokenizer, params)
        device = self.model.device
        self._generators[request_id] = (torch.Generator(device=device).manual_seed(params.seed)
                                        if params.seed is not None else None)
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Stop these requests now and free their blocks (a client disconnected); unknown ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.scheduler.abort(request_id)
            self._completions.pop(request_id, None)
            self._generators.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; the outputs of the requests that got a token in this step."""
        plan = self.scheduler.schedule()
        self.last_step = plan
        if not plan.scheduled:
            return []
        requests = [r for r, _ in plan.scheduled]
        chunks = [r.all_token_ids[r.num_computed_tokens: r.num_computed_tokens + n] for r, n in plan.scheduled]
        view = self.cache.prepare([r.request_id for r in requests], chunks)
        logits = self.model(view.tokens, cache=view, last_only=True)[:, -1]  # [B, V]: each row's last new token
        for request, n in plan.scheduled:
            request.num_computed_tokens += n

        ready = [i for i, r in enumerate(requests) if r.num_uncomputed_tokens == 0]  # prompt done: sample
        if not ready:
            return []
        rows = [requests[i] for i in ready]
        logits = logits[ready]
        tokens = sample(logits, [r.params for r in rows], [self._generators[r.request_id] for r in rows],
                        prompt_ids=[r.prompt_token_ids for r in rows], output_ids=[r.output_token_ids for r in rows])
        lp = compute_logprobs(logits, tokens, max((r.params.logprobs or 0) for r in rows))
        now = time.perf_counter()
        outputs = []
        for j, (request, token) in enumerate(zip(rows, tokens.tolist())):
            completion = self._completions[request.request_id]
            text_before = len(completion.text)
            request.output_token_ids.append(token)
            last = len(request.output_token_ids) == request.params.max_tokens
            top = dict(zip(*lp.top_logprobs[j])) if request.params.logprobs else {}
            completion.push(token, float(lp.logprobs[j]), top, now - request.arrival_time,
                            set() if request.params.ignore_eos else self.eos, last)
            if completion.finish_reason is not None:
                self.scheduler.finish(request, completion.finish_reason)
            outputs.append(self._output(request, completion, [token], completion.text[text_before:]))
        for request in rows:
            if request.is_finished:
                del self._completions[request.request_id], self._generators[request.request_id]
        return outputs

    def _output(self, request: Request, completion: CompletionState, new_ids: list[int],
                new_text: str) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(completion.token_ids),
            text=completion.text if self.tokenizer is not None else None,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            token_times_s=list(completion.times),
            logprobs=list(completion.logprobs) if request.params.logprobs is not None else None,
            top_logprobs=list(completion.top_logprobs) if request.params.logprobs is not None else None,
            num_preemptions=request.num_preemptions,
        )


class LLM:
    """Offline batch inference: `LLM(model, tokenizer).generate(prompts, params)` (chapter 05).

    Builds an `LLMEngine` (keyword arguments go to it), adds every prompt, and steps until all are done.
    """

    def __init__(self, model: Transformer | str, tokenizer: Tokenizer | None = None, **engine_kwargs: object) -> None:
        if isinstance(model, str):
            from minillm import load

            model, tokenizer = load(model)
        self.engine = LLMEngine(model, tokenizer, **engine_kwargs)  # type: ignore[arg-type]

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished `RequestOutput` per prompt, in the prompts' order (params: one for all, or one each)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts: pass one, or one each.")
        engine = self.engine
        ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="requests", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]
