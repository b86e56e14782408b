"""The engine: continuous batching of many requests over one paged KV cache (chapter 05).

`LLMEngine` is the loop a server runs. Requests arrive at any time (`add_request`); each `step()`
asks the `Scheduler` which requests run and how many of their tokens, runs the model over all of them
(prompt chunks and decode tokens, on the `PagedKVCache` of chapter 04; decodes and chunks as two
forwards, so that decodes are not padded to a chunk's length: see `_forward`), samples one token for
every request whose prompt is complete, each with its own `SamplingParams`, and returns what each
request gained in this step (a streaming delta):

    step ──► scheduler.schedule()             who runs, how many tokens each (token budget, free blocks)
         ──► cache.prepare(ids, tokens)       the step's block tables and slot mapping
         ──► model(view.tokens, cache=view)   the forward: decodes [D, 1], then prompt chunks [P, T]
         ──► sample each finished prompt's row with its own params and generator
         ──► stop rules (EOS, stop strings, max_tokens); finished requests free their blocks

`LLM(model).generate(prompts, params)` runs the engine to the end over a list of prompts (offline
batch inference, with a progress bar). Names follow vLLM: `LLMEngine.add_request / step /
abort_request / has_unfinished_requests`, `LLM.generate`, `SamplingParams`, `RequestOutput`.

A request may ask for several completions (`SamplingParams(n, best_of)`): its prompt is prefilled
once, then forked into best_of sequences that share the prompt's blocks (copy-on-write, chapter 04),
each an ordinary request of the scheduler from then on, named `<id>#<i>`; their outputs carry the
request's id and their `index`. A request may also carry a constraint (a `TokenIndex` of a regex or
JSON schema, chapter 01): its logits are masked to the tokens the pattern allows at every step.

`minillm.generate` (one request), `minillm.generate_n` (n completions of one prompt) and
`minillm.constrained.generate_constrained` all run on this engine: there is one generation loop.
With `speculative=SpeculativeConfig(drafter, k)` (chapter 07) the decode rows of a step are a variant
of it: the drafter proposes up to k tokens per row, one target forward scores them all, the verify
rule keeps some, and the rejected positions are rolled back in the cache (`_speculative_decode`).
Beam search (`minillm.beam`) keeps its own loop on the same paged cache, because its step is a global
choice among the beams, not one token sampled per request.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minillm.constrained import TokenIndex, mask_logits, masks_for
from minillm.cuda_graphs import DecodeGraphs, graphs_unavailable
from minillm.generate import CompletionState, default_eos_ids, prepare_prompt
from minillm.kv_quant import check_kv_cache_dtype
from minillm.metrics import kv_blocks
from minillm.model import Transformer
from minillm.notebook import tqdm
from minillm.paging import BLOCK_SIZE, NoFreeBlocksError, PagedKVCache, num_blocks_for_memory, paged_forward
from minillm.sampling import SamplingParams, compute_logprobs, sample
from minillm.scheduler import Request, Scheduler, SchedulerOutput
from minillm.speculative import Draft, SpeculativeConfig, SpeculativeStats, target_probabilities, verify, verify_greedy
from minillm.tokenizer import Tokenizer

log = logging.getLogger("minillm")


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
    index: int = 0  # which of the request's best_of sequences (0 unless n > 1); it samples with seed + index
    cumulative_logprob: float = 0.0  # the sum of its tokens' log-probabilities (best_of keeps the n highest)

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] if self.token_times_s else float("nan")


class LLMEngine:
    """Serve many requests at once with continuous batching, chunked prefill and a paged KV cache (chapter 05).

    Args:
        model: the model (its device and dtype are the cache's).
        tokenizer: encodes text prompts, decodes outputs, matches stop strings (optional with token ids).
        num_blocks: KV blocks in the pool; default: as many as kv_cache_memory_bytes holds, else
            max_num_seqs sequences of the model's full context.
        block_size: tokens per block (16, vLLM's default).
        kv_cache_dtype: what the KV cache stores (chapter 06, `minillm.kv_quant`; vLLM's option of the same
            name): "auto" (the model's dtype, the default), "int8" or "fp8" (e4m3), each with one fp32 scale per
            (token, head). 8-bit halves the bytes per token (roughly), so the same memory holds ~2x the blocks.
            On CUDA the paged Triton decode kernel reads the 8-bit codes and their scales directly, CUDA graphs
            included (elsewhere attention reads the cache gathered and dequantised).
        kv_cache_memory_bytes: size the pool to this many bytes instead of giving num_blocks (vLLM's option of
            the same name): `minillm.paging.num_blocks_for_memory` at this block_size and kv_cache_dtype.
        max_num_seqs, max_num_batched_tokens, enable_chunked_prefill: the scheduler's budgets (see
            `minillm.scheduler.Scheduler`).
        enable_prefix_caching: reuse cached full blocks of earlier prompts (chapter 04).
        cuda_graphs: replay decode-only forwards as CUDA graphs (`minillm.cuda_graphs`), captured at the
            first decode step for every batch size up to max_num_seqs. Default: on wherever they can run
            (a CUDA model, Triton, no sliding window); True where they cannot raises a ValueError. If
            capture fails, the engine logs why and runs eagerly. Off with speculative decoding (its verify
            forwards score several tokens per row).
        speculative: draft and verify decode tokens (`minillm.speculative.SpeculativeConfig`, chapter 07);
            `spec_stats` counts what was proposed and accepted.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None = None,
        num_blocks: int | None = None,
        block_size: int = BLOCK_SIZE,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        cuda_graphs: bool | None = None,
        speculative: SpeculativeConfig | None = None,
        kv_cache_dtype: str = "auto",
        kv_cache_memory_bytes: float | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.speculative = speculative
        self.spec_stats = SpeculativeStats()
        check_kv_cache_dtype(kv_cache_dtype)
        reason = graphs_unavailable(model)
        if speculative is not None:
            reason = reason or "speculative decoding is on (its verify forwards are not captured)"
        if cuda_graphs and reason:
            raise ValueError(f"cuda_graphs=True, but {reason}. Leave cuda_graphs unset to run eagerly.")
        self.use_cuda_graphs = reason is None if cuda_graphs is None else cuda_graphs
        self.graphs: DecodeGraphs | None = None  # captured at the first decode step
        if kv_cache_memory_bytes is not None:
            if num_blocks is not None:
                raise ValueError(f"got num_blocks={num_blocks} and kv_cache_memory_bytes={kv_cache_memory_bytes}: "
                                 "size the KV pool one way, in blocks or in bytes.")
            num_blocks = num_blocks_for_memory(model.config, kv_cache_memory_bytes, block_size, model.dtype,
                                               kv_cache_dtype)
        if num_blocks is None:
            num_blocks = max_num_seqs * kv_blocks(model.config.max_seq_len, block_size)
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.device, model.dtype,
                                  enable_prefix_caching, kv_cache_dtype)
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
        self.eos = default_eos_ids(model, tokenizer)
        # Per sequence (a request's id, or <id>#<i> for its i-th extra sequence when n > 1):
        self._completions: dict[str, CompletionState] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._index: dict[str, tuple[str, int]] = {}  # sequence -> (request id, index)
        self._states: dict[str, int] = {}  # sequence -> its DFA state, under a constraint
        # Per request:
        self._sequences: dict[str, list[str]] = {}  # request id -> its sequences' ids
        self._fan_out: dict[str, int] = {}  # request id -> best_of, until its prompt is done and it forks
        self._constraints: dict[str, tuple[TokenIndex, torch.Tensor]] = {}  # request id -> (index, masks [S, V])
        self.last_step: SchedulerOutput | None = None  # the record of the latest step
        self._ids = itertools.count()

    @classmethod
    def for_one_prompt(cls, model: Transformer, tokenizer: Tokenizer | None, prompt_len: int,
                       params: SamplingParams, speculative: SpeculativeConfig | None = None,
                       kv_cache_dtype: str = "auto") -> LLMEngine:
        """An engine for one request of `prompt_len` tokens (what `generate`, `generate_n` and constrained
        decoding run on): the prompt in one step, and a pool of just the blocks its sequences can need
        (the prompt's once, then max_tokens plus a copy-on-write block per sequence), one for the padding
        rows of CUDA graphs, and with `speculative`, the blocks its k draft tokens can spill into.
        `kv_cache_dtype` as for the engine (chapter 06)."""
        best_of = params.best_of or params.n
        blocks = kv_blocks(prompt_len + params.max_tokens, BLOCK_SIZE)
        if best_of > 1:
            blocks = kv_blocks(prompt_len, BLOCK_SIZE) + best_of * (kv_blocks(params.max_tokens, BLOCK_SIZE) + 1)
        num_blocks = blocks + 1
        if speculative is not None:
            num_blocks += best_of * kv_blocks(speculative.num_speculative_tokens, BLOCK_SIZE)
        return cls(model, tokenizer, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=best_of,
                   max_num_batched_tokens=max(prompt_len, best_of), enable_prefix_caching=False,
                   speculative=speculative, kv_cache_dtype=kv_cache_dtype)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, constraint: TokenIndex | None = None) -> str:
        """Queue a request; returns its id (a fresh one if request_id is None).

        Checked now, with a ValueError that says what to change: an empty prompt, ids outside the
        vocabulary, prompt + max_tokens beyond the model's context or the cache, stop strings without a
        tokenizer, a request id in use or containing "#" (the engine names extra sequences <id>#<i>);
        under a constraint, stop strings or ignore_eos (the pattern decides where the output ends).
        """
        params = params or SamplingParams()
        ids = prepare_prompt(self.model, prompt, params, self.tokenizer)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if "#" in request_id:
            raise ValueError(f"request id {request_id!r} contains '#', which the engine keeps for the extra "
                             "sequences of n > 1 requests (<id>#<i>): choose another id.")
        if constraint is not None:
            if params.stop:
                raise ValueError("stop strings would cut a constrained output mid-pattern; end it with the pattern "
                                 "instead.")
            if params.ignore_eos:
                raise ValueError("ignore_eos has no meaning under a constraint: the pattern decides where the output "
                                 "may end.")
            if constraint.is_finished(constraint.start):
                raise ValueError("the constraint allows only the empty string: there is nothing to generate.")
        request = Request(request_id, ids, params)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add(request)  # refuses ids in use and requests larger than the cache
        if constraint is not None:
            masks = masks_for(constraint, self.model.config.vocab_size, self.model.device)
            self._constraints[request_id] = (constraint, masks)
        best_of = params.best_of or params.n
        if best_of > 1:
            self._fan_out[request_id] = best_of
        self._sequences[request_id] = []
        self._start_sequence(request, request_id, 0)
        return request_id

    def _start_sequence(self, request: Request, request_id: str, index: int) -> None:
        """Per-sequence state: its completion, its generator (seeded seed + index), its DFA state."""
        seq_id, params = request.request_id, request.params
        self._sequences[request_id].append(seq_id)
        self._index[seq_id] = (request_id, index)
        self._completions[seq_id] = CompletionState(request.prompt_token_ids, self.tokenizer, params)
        self._generators[seq_id] = (torch.Generator(device=self.model.device).manual_seed(params.seed + index)
                                    if params.seed is not None else None)
        if request_id in self._constraints:
            self._states[seq_id] = self._constraints[request_id][0].start

    def _end_sequence(self, seq_id: str) -> None:
        request_id, _ = self._index.pop(seq_id)
        if self.speculative is not None:
            self.speculative.drafter.release(seq_id)
        for table in (self._completions, self._generators, self._states):
            table.pop(seq_id, None)
        if not any(s in self._index for s in self._sequences[request_id]):  # its last sequence ended
            del self._sequences[request_id]
            self._constraints.pop(request_id, None)
            self._fan_out.pop(request_id, None)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Stop these requests (all their sequences) now and free their blocks; unknown ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            for seq_id in list(self._sequences.get(request_id, [])):
                if seq_id in self._index:
                    self.scheduler.abort(seq_id)
                    self._end_sequence(seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        """Unfinished requests (a request with n > 1 counts once)."""
        return len(self._sequences)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample; the outputs of the sequences that got a token in this step."""
        plan = self.scheduler.schedule()
        self.last_step = plan
        if not plan.scheduled:
            return []
        # Decode rows that speculate get their tokens from the verify step; the rest from one sample each.
        speculating, plain = [], []
        for request, n in plan.scheduled:
            (speculating if self._speculates(request, n) else plain).append((request, n))
        results = self._speculative_decode([r for r, _ in speculating]) if speculating else []
        if plain:
            results = self._sample_plain(plain) + results
        now = time.perf_counter()
        outputs = []
        for request, tokens, logprobs, tops in results:
            seq_id = request.request_id
            completion = self._completions[seq_id]
            text_before = len(completion.text)
            new_ids = []
            for token, logprob, top in zip(tokens, logprobs, tops):
                request.output_token_ids.append(token)
                new_ids.append(token)
                last = len(request.output_token_ids) == request.params.max_tokens
                eos = set() if request.params.ignore_eos else self.eos
                completion.push(token, logprob, top, now - request.arrival_time, eos, last)
                if seq_id in self._states and completion.finish_reason is None and self._advance(seq_id, token):
                    completion.finish_reason = "stop"  # the pattern is complete and nothing may follow
                if completion.finish_reason is not None:  # drafts accepted past the end are dropped
                    self.scheduler.finish(request, completion.finish_reason)
                    break
            outputs.append(self._output(request, completion, new_ids, completion.text[text_before:]))
        for request, *_ in results:
            if request.is_finished:
                self._end_sequence(request.request_id)
        return outputs

    def _sample_plain(self, scheduled: list[tuple[Request, int]]
                      ) -> list[tuple[Request, list[int], list[float], list[dict[int, float]]]]:
        """Run the forward and sample one token for every row whose prompt is done: (row, [token], [logprob],
        [top logprobs]). A row whose prompt just completed and that asks for best_of > 1 forks now, and its new
        sequences sample from the same logits row."""
        requests = [r for r, _ in scheduled]
        logits = self._forward(scheduled)  # [B, V]: each row's last new token
        for request, n in scheduled:
            request.num_computed_tokens += n
        rows, which = [], []
        for i, request in enumerate(requests):
            if request.num_uncomputed_tokens == 0:
                for seq in [request, *self._fork(request)]:
                    rows.append(seq)
                    which.append(i)
        if not rows:
            return []
        logits = logits[which]  # [len(rows), V]
        tokens = sample(self._constrain(rows, logits), [r.params for r in rows],
                        [self._generators[r.request_id] for r in rows],
                        prompt_ids=[r.prompt_token_ids for r in rows], output_ids=[r.output_token_ids for r in rows])
        lp = compute_logprobs(logits, tokens, max((r.params.logprobs or 0) for r in rows))  # of the raw logits
        return [(r, [t], [float(lp.logprobs[j])], [dict(zip(*lp.top_logprobs[j])) if r.params.logprobs else {}])
                for j, (r, t) in enumerate(zip(rows, tokens.tolist()))]

    def _speculates(self, request: Request, n: int) -> bool:
        """Whether this scheduled row drafts: a decode step (not prompt work), unconstrained, with 2+ tokens to go."""
        return (self.speculative is not None and n == 1 and not request.is_prefill
                and request.request_id not in self._states
                and request.params.max_tokens - len(request.output_token_ids) >= 2)

    def _speculative_decode(self, requests: list[Request]
                            ) -> list[tuple[Request, list[int], list[float], list[dict[int, float]]]]:
        """Draft, verify in one target forward, roll back the rejected positions (chapter 07).

        Each row's last token (uncomputed, as in any decode step) and its d <= k drafts go through the model
        together, [B, 1 + max d] left-padded; the logits at those 1 + d positions are p_1 .. p_{d+1}. The verify
        rule keeps a accepted drafts and adds one token; the cache keeps the last token and the a drafts, and
        `PagedKVCache.truncate` returns the rejected ones' slots.
        """
        config = self.speculative
        ids = [r.request_id for r in requests]
        ks = [min(config.num_speculative_tokens, r.params.max_tokens - len(r.output_token_ids) - 1) for r in requests]
        drafts = config.drafter.propose(ids, [r.all_token_ids for r in requests], [r.params for r in requests], ks,
                                        [self._generators[i] for i in ids])
        for i, (seq_id, draft) in enumerate(zip(ids, drafts)):
            if len(draft.tokens) > ks[i]:
                raise ValueError(f"the drafter proposed {len(draft.tokens)} tokens where {ks[i]} were asked for.")
            try:  # the scheduler gave the row room for its last token; the drafts need more
                self.cache.allocate_slots([seq_id], [1 + len(draft.tokens)])
            except NoFreeBlocksError:
                drafts[i] = Draft([])  # no room for drafts: a plain decode step for this row
        view = self.cache.prepare(ids, [[r.all_token_ids[-1], *d.tokens] for r, d in zip(requests, drafts)])
        logits = self.model(view.tokens, cache=view)  # [B, T, V], row b's positions are its last 1 + d_b columns
        results = []
        for b, (request, draft) in enumerate(zip(requests, drafts)):
            raw = logits[b, logits.shape[1] - 1 - len(draft.tokens):]  # [1 + d, V]
            p = target_probabilities(raw, request.params, request.prompt_token_ids, request.output_token_ids,
                                     draft.tokens)
            if request.params.greedy:
                tokens = verify_greedy(p.argmax(dim=-1).tolist(), draft.tokens)
            else:
                tokens = verify(p, draft.tokens, draft.probs, self._generators[request.request_id])
            accepted = len(tokens) - 1
            if draft.tokens:
                self.spec_stats.record(len(draft.tokens), accepted)
            request.num_computed_tokens += 1 + accepted  # the last token and the accepted drafts are in the cache
            self.cache.truncate(request.request_id, request.num_computed_tokens)
            k = request.params.logprobs or 0
            lp = compute_logprobs(raw[: len(tokens)], torch.tensor(tokens, device=raw.device), k)
            tops = [dict(zip(*t)) if request.params.logprobs else {} for t in lp.top_logprobs]
            results.append((request, tokens, lp.logprobs.tolist(), tops))
        return results

    def _forward(self, scheduled: list[tuple[Request, int]]) -> torch.Tensor:
        """The logits of each scheduled request's last new token, [len(scheduled), V].

        The model takes a rectangular batch [B, T], so rows shorter than the longest are padded, and padding
        costs as much compute as a token. A 512-token prompt chunk beside 40 decodes would make 41 x 512
        positions for 552 real tokens. So the rows computing one token (decodes) run as one forward [D, 1],
        and the prompt chunks as another [P, T] (padded only against each other). vLLM avoids padding
        altogether by packing every token of the step into one flat sequence with per-request attention
        ("varlen" kernels); minillm's kernels take rectangular batches, and two forwards keep it simple.
        """
        chunks = [r.all_token_ids[r.num_computed_tokens: r.num_computed_tokens + n] for r, n in scheduled]
        logits: list[torch.Tensor | None] = [None] * len(scheduled)
        decodes = [i for i, c in enumerate(chunks) if len(c) == 1]
        prompts = [i for i, c in enumerate(chunks) if len(c) > 1]
        for group in (decodes, prompts):
            if not group:
                continue
            if group is decodes and self._decode_graphs() is not None:
                rows = self.graphs.run([scheduled[i][0].request_id for i in group], [chunks[i][0] for i in group])
            else:
                rows = paged_forward(self.model, self.cache, [scheduled[i][0].request_id for i in group],
                                 [chunks[i] for i in group])
            for j, i in enumerate(group):
                logits[i] = rows[j]
        return torch.stack(logits)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """The captured decode graphs, capturing them on first use; None when the engine runs eagerly."""
        if self.graphs is None and self.use_cuda_graphs:
            try:
                self.graphs = DecodeGraphs(self.model, self.cache, self.scheduler.max_num_seqs)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as error:  # the model does something capture forbids
                log.warning("CUDA graph capture failed, running decode steps eagerly: %s", error)
                self.use_cuda_graphs = False
        return self.graphs

    def _fork(self, request: Request) -> list[Request]:
        """If this request's prompt just completed and it asks for best_of > 1: its other sequences."""
        best_of = self._fan_out.pop(request.request_id, 1)
        children = []
        for index in range(1, best_of):
            child = self.scheduler.fork(request, f"{request.request_id}#{index}")
            self._start_sequence(child, request.request_id, index)
            children.append(child)
        return children

    def _constrain(self, rows: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """The logits to sample from: each constrained row masked to the tokens its DFA state allows."""
        constrained = [j for j, r in enumerate(rows) if r.request_id in self._states]
        if not constrained:
            return logits
        logits = logits.clone()
        for j in constrained:
            seq_id = rows[j].request_id
            _, masks = self._constraints[self._index[seq_id][0]]
            allowed = masks[self._states[seq_id]]
            if not allowed.any():
                raise ValueError(f"no token of the vocabulary continues the pattern from state {self._states[seq_id]}: "
                                 "the vocabulary lacks the bytes it needs. Use a byte-level BPE tokenizer (it has all "
                                 "256 bytes), or a pattern within the characters this vocabulary can spell.")
            logits[j] = mask_logits(logits[j], allowed)
        return logits

    def _advance(self, seq_id: str, token: int) -> bool:
        """Move a constrained sequence's DFA over its new token; True if the pattern is now finished."""
        index, _ = self._constraints[self._index[seq_id][0]]
        if token in index.eos_token_ids:
            if not index.dfa.is_accepting(self._states[seq_id]):
                raise RuntimeError(f"the sampler picked EOS {token} where the mask forbade it.")
            return True
        self._states[seq_id] = index.advance(self._states[seq_id], token)  # raises if the sampler ignored the mask
        return index.is_finished(self._states[seq_id])

    def _output(self, request: Request, completion: CompletionState, new_ids: list[int],
                new_text: str) -> RequestOutput:
        request_id, index = self._index[request.request_id]
        return RequestOutput(
            request_id=request_id,
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
            index=index,
            cumulative_logprob=sum(completion.logprobs),
        )

    def run(self, use_tqdm: bool = False, total: int | None = None) -> dict[tuple[str, int], RequestOutput]:
        """Step until every request is finished; the final output of each sequence by (request id, index)."""
        finished: dict[tuple[str, int], RequestOutput] = {}
        with tqdm(total=total, desc="requests", disable=not use_tqdm) as bar:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        finished[out.request_id, out.index] = out
                        bar.update(out.index == 0)
        return finished


def best_of_n(outputs: Sequence[RequestOutput], n: int) -> list[RequestOutput]:
    """The n outputs with the highest cumulative log-probability (ties: lower index first), as vLLM's best_of."""
    return sorted(outputs, key=lambda o: (-o.cumulative_logprob, o.index))[:n]


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
        """The finished `RequestOutput`s, prompt by prompt in the prompts' order: params.n of them per prompt
        (one unless n > 1; then the n best of best_of by cumulative log-probability). params: one for all, or
        one per prompt."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts: pass one, or one each.")
        engine = self.engine
        ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        finished = engine.run(use_tqdm, total=len(ids))
        outputs = []
        for request_id, sp in zip(ids, params):
            group = [finished[request_id, i] for i in range(sp.best_of or sp.n)]
            outputs += best_of_n(group, sp.n)
        return outputs
