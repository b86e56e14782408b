"""The engine: continuous batching of many requests over one paged KV cache (chapter 05).

`LLMEngine` is the loop a server runs. Requests arrive at any time (`add_request`); each `step()`
asks the `Scheduler` which sequences run and how many of their tokens, has the `ModelRunner` run the
model over all of them (prompt chunks and decode tokens, on the `PagedKVCache` of chapter 04) and
sample one token for every sequence whose prompt is complete, each with its own `SamplingParams`,
then applies the stop rules and returns what each sequence gained in this step (a streaming delta):

    step ──► scheduler.schedule()              who runs, how many tokens each (token budget, free blocks)
         ──► model_runner.forward(ids, tokens) the step's inputs (block tables, slots), the forward:
                                               decodes [D, 1] (a CUDA graph on the GPU), prompt chunks packed [1, N]
         ──► model_runner.sample(seqs, logits) each row with its own params, generator and constraint
         ──► seq.append_token(...)             stop rules (EOS, stop strings, the pattern, max_tokens);
                                               finished sequences free their blocks

Everything about one sequence (tokens, params, generator, text, stop and DFA state) is its
`minillm.engine.sequence.Sequence`; the engine keeps no other per-sequence state.

Async scheduling (`async_scheduling=True`, the default on a GPU; vLLM's option of the same name, SGLang's
"overlap scheduler"). Run in that order, the host and the GPU take turns: the GPU idles while the host
schedules, builds the inputs, reads the tokens and applies the stop rules, and the host idles while the
GPU computes. So a step's sampled tokens stay on the device, and the host runs one step ahead:

    step t:  schedule t ─► launch forward t ─► read t-1's tokens, stop rules, t-1's outputs ─► launch sampling t
             (a row whose token from t-1 is still on the device feeds a placeholder, swapped there for it)

The read waits only for step t-1's tokens, while forward t runs. Sampling t comes after it, so that a
constrained row's automaton and a penalised row's counts include t-1's token, and a row that t-1 ended
is not sampled: a finished sequence computes at most one more row, which is dropped, never emitted. A
sequence whose last token (max_tokens) is in flight is not scheduled again. The block tables hold the
placeholder until the read, and a block is named in the prefix cache only once its tokens are known.

`LLM(model).generate(prompts, params)` runs the engine to the end over a list of prompts (offline
batch inference, with a progress bar). Names follow vLLM: `LLMEngine.add_request / step /
abort_request / has_unfinished_requests`, `LLM.generate`, `SamplingParams`, `RequestOutput`.

A request may ask for several completions (`SamplingParams(n, best_of)`): its prompt is prefilled
once, then forked into best_of sequences that share the prompt's blocks (copy-on-write, chapter 04):
Sequences of one request, indices 0 .. best_of - 1; their outputs carry the request's id and their
`index`. A request may also carry a constraint (a `TokenIndex` of a regex or JSON schema, chapter 01):
its logits are masked to the tokens the pattern allows at every step.

`minillm.generate` (one request), `minillm.generate_n` (n completions of one prompt) and
`minillm.decoding.generation.generate_constrained` all run on this engine: there is one generation loop.
With `speculative=SpeculativeConfig(drafter, k)` (chapter 07) the decode rows of a step are a variant
of it: the drafter proposes up to k tokens per row, one target forward scores them all, the verify
rule keeps some, and the rejected positions are rolled back in the cache
(`ModelRunner.speculative_decode`). With LoRA adapters (chapter 08: `lora_modules=`, `add_lora`), each
request may name one (`add_request(..., lora="name")`): one step mixes rows of different adapters and of
the base model, the base matmul once for all, each row's low-rank update by the batched LoRA matmul
(`minillm.lora`). Beam search (`minillm.decoding.beam`) keeps its own loop on the same paged
cache and forward, because its step is a global choice among the beams, not one token sampled per request.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from minillm.engine.block_manager import BLOCK_SIZE
from minillm.engine.cuda_graphs import DecodeGraphs
from minillm.engine.engine_config import EngineConfig, check_tensor_parallel
from minillm.engine.kv_cache import PagedKVCache, num_blocks_for_memory
from minillm.engine.model_runner import (
    ModelGroup,
    ModelRunner,
    SampledTokens,
    StepTokens,
    greedy_kernels_usable,
    greedy_row,
)
from minillm.engine.scheduler import Scheduler, SchedulerOutput
from minillm.engine.sequence import Constraint, default_eos_ids, prepare_prompt
from minillm.engine.sequence import Sequence as Seq
from minillm.model import Transformer
from minillm.quant.kv import check_kv_cache_dtype
from minillm.sampler.constrained import TokenIndex, masks_for
from minillm.sampler.sampling import SamplingParams
from minillm.sampler.speculative import DraftGate, SpeculativeConfig, SpeculativeStats, estimated_draft_cost
from minillm.tokenizer import IncrementalDecoder, Tokenizer
from minillm.utils import kv_blocks, to_device

# The KV pool's default ceiling on a CPU, where it shares the machine's memory with everything else: SmolLM2-135M's
# 64 full contexts (max_num_seqs x 8,192 tokens, fp32) would take 24 GiB; 2 GiB holds 45k of its tokens.
CPU_KV_CACHE_BYTES = 2 * 1024**3


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
    finish_reason: str | None  # "stop", "length", "abort" or "error" (`LLMEngine._failed_row`) once finished
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

    `LLMEngine(model, tokenizer, config)` with an `EngineConfig` (`minillm.engine.engine_config`), or with its fields
    as keywords, `LLMEngine(model, tokenizer, max_num_seqs=8)`; keywords beside a config override its fields.
    `engine.config` is the config as built (num_blocks and async_scheduling filled in).

    Args:
        model: the model (its device and dtype are the cache's).
        tokenizer: encodes text prompts, decodes outputs, matches stop strings (optional with token ids).
        config: an `EngineConfig`; its fields (or the keywords of the same names):
        num_blocks: KV blocks in the pool; default: as many as kv_cache_memory_bytes holds, else
            max_num_seqs sequences of the model's full context (on a CPU, at most CPU_KV_CACHE_BYTES of them).
        block_size: tokens per block (16, vLLM's default).
        kv_cache_dtype: what the KV cache stores (chapter 06, `minillm.quant.kv`; vLLM's option of the same
            name): "auto" (the model's dtype, the default), "int8" or "fp8" (e4m3), each with one fp32 scale per
            (token, head). 8-bit halves the bytes per token (roughly), so the same memory holds ~2x the blocks.
            On CUDA the paged Triton decode kernel reads the 8-bit codes and their scales directly, CUDA graphs
            included (elsewhere attention reads the cache gathered and dequantised).
        kv_cache_memory_bytes: size the pool to this many bytes instead of giving num_blocks (vLLM's option of
            the same name): `minillm.engine.kv_cache.num_blocks_for_memory` at this block_size and kv_cache_dtype.
        max_num_seqs, max_num_batched_tokens, enable_chunked_prefill: the scheduler's budgets (see
            `minillm.engine.scheduler.Scheduler`).
        enable_prefix_caching: reuse cached full blocks of earlier prompts (chapter 04).
        cuda_graphs: replay decode-only forwards as CUDA graphs (`minillm.engine.cuda_graphs`), captured here,
            as the engine starts, for every batch size up to max_num_seqs. Default: on wherever they can run
            (a CUDA model, Triton, no sliding window); True where they cannot raises a ValueError. If
            capture fails, the engine logs why and runs eagerly. With speculative decoding the verify steps are
            captured too, by token bucket (`ModelRunner.verify_logits`).
        speculative: draft and verify decode tokens (`minillm.sampler.speculative.SpeculativeConfig`, chapter 07);
            `spec_stats` counts what was proposed and accepted.
        compile_decode: on a CPU, run every decode step compiled ahead of time (`torch.export` and AOTInductor,
            see `ModelRunner`): loaded from the cache of compiled steps (`minillm compile` fills it), else compiled
            at the first decode step (tens of seconds) and kept there. "background": where the cache lacks the
            step, compile it in a process of its own and decode eagerly until it is ready. Off by default.
        tensor_parallel_size: the ranks every layer is split across (`minillm.parallel.tensor`, chapter 08;
            vLLM's option of the same name), this process rank 0, on the CPU (gloo) or one GPU each (NCCL). The
            engine runs the group it is given as `group` and starts none: `minillm.LLM` and the server start it
            (`minillm.parallel.tensor.start_group(model, config)`). Its decode steps run eagerly (no CUDA graphs),
            without speculation. Call `shutdown()` to stop the workers (they also stop when this process exits).
    group: the started tensor-parallel group (`ModelGroup`), with tensor_parallel_size its number of ranks.
        lora_modules: LoRA adapters to serve, {name: PEFT folder (or a `minillm.lora.LoRAAdapter`)}, checked now
            (a ValueError names a bad one); more with `add_lora`. A request picks one by name (chapter 08).
        max_loras: device slots for adapters (vLLM's option of the same name): at most this many distinct adapters
            run in one step; others wait for a slot (loaded on demand, least recently used evicted).
        max_lora_rank: the slots' rank (smaller adapters are padded with zeros); default: the largest rank of
            lora_modules, or 16 (vLLM's default) when adapters only come later through `add_lora`.
        async_scheduling: overlap the host with the GPU (vLLM's option of the same name): a step's sampled tokens
            stay on the device and feed the next step's forward there; the host reads them (stop rules, text,
            outputs) while that next forward runs, so each `step()` returns the previous step's outputs. Default:
            on for a CUDA model (off with speculative decoding or tensor parallelism, which need the tokens on the
            host before the next forward); on a CPU it changes nothing but the order, and is off.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, config: EngineConfig | None = None,
                 group: ModelGroup | None = None, **options: Any) -> None:
        c = EngineConfig.of(config, **options)  # keywords still work, and override a config's fields
        check_tensor_parallel(c)
        num_blocks, async_scheduling = c.num_blocks, c.async_scheduling  # filled in below where left to the engine
        if async_scheduling is None:  # on where the host and the GPU can overlap, and nothing forbids it
            async_scheduling = model.device.type == "cuda" and c.speculative is None and c.tensor_parallel_size == 1
        if async_scheduling and c.speculative is not None:  # (with tensor parallelism: check_tensor_parallel)
            raise ValueError("async_scheduling=True runs ahead of the host, which a speculative step (its drafts come "
                             "from the tokens so far) cannot: leave async_scheduling unset with speculative.")
        self.async_scheduling = async_scheduling
        self.inflight: StepTokens | None = None  # with async scheduling: the latest step's tokens, not read yet
        self.tp = group  # a tensor-parallel group the front door started (it plugs in as the runner's forward)
        if (group.world if group is not None else 1) != c.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={c.tensor_parallel_size} with " + (f"a group of {group.world} ranks" if group
                else "no group") + ": the engine runs the tensor-parallel group it is given and starts none. Use "
                "minillm.LLM(model, tokenizer, tensor_parallel_size=N), which starts it, or pass "
                "group=minillm.parallel.tensor.start_group(model, config) with the same config.")
        if group is not None:
            model = group.model  # rank 0's shard: its heads, its slice of the MLP
        self.model, self.tokenizer = model, tokenizer
        draft = getattr(c.speculative.drafter, "model", None) if c.speculative is not None else None
        if draft is not None and draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary has {draft.config.vocab_size} tokens and the target's "
                             f"{model.config.vocab_size}: a draft must share the target's tokenizer (its proposals "
                             "are the target's token ids). Use a draft of the same family, or an NgramDrafter.")
        self.speculative = c.speculative
        self.spec_stats = SpeculativeStats()
        self.draft_gate = None  # with SpeculativeConfig(adaptive=True): which sequences still draft (DraftGate)
        if c.speculative is not None and c.speculative.adaptive:
            cost = c.speculative.draft_cost
            if cost is None:
                cost = estimated_draft_cost(draft.config, model.config) if draft is not None else 0.0
            self.draft_gate = DraftGate(c.speculative.num_speculative_tokens, cost)
        check_kv_cache_dtype(c.kv_cache_dtype)
        if c.kv_cache_memory_bytes is not None:
            if num_blocks is not None:
                raise ValueError(f"got num_blocks={num_blocks} and kv_cache_memory_bytes={c.kv_cache_memory_bytes}: "
                                 "size the KV pool one way, in blocks or in bytes.")
            num_blocks = num_blocks_for_memory(model.config, c.kv_cache_memory_bytes, c.block_size, model.dtype,
                                               c.kv_cache_dtype)
        if num_blocks is None:
            num_blocks = c.max_num_seqs * kv_blocks(model.config.max_seq_len, c.block_size)
            if model.device.type == "cpu":  # a real model's full contexts would not fit a laptop: 64 x 8k tokens
                num_blocks = min(num_blocks, num_blocks_for_memory(model.config, CPU_KV_CACHE_BYTES, c.block_size,
                                                                   model.dtype, c.kv_cache_dtype))
        cache_args = (model.config, num_blocks, c.block_size, model.device, model.dtype, c.enable_prefix_caching,
                      c.kv_cache_dtype)  # with tensor parallelism, rank 0's heads (each rank's pool holds its own)
        self.cache = self.tp.paged_cache(*cache_args) if self.tp else PagedKVCache(*cache_args)
        self.scheduler = Scheduler(self.cache, c.max_num_seqs, c.max_num_batched_tokens, c.enable_chunked_prefill)
        no_graphs = "tensor parallelism is on (its steps run eagerly)" if self.tp else None
        if c.compile_decode and c.speculative is not None:  # the compiled CPU step is decode-only: no verify steps
            raise ValueError("compile_decode=True, but speculative decoding is on (the compiled CPU step runs decode "
                             "rows only, and speculation turns them into verify steps). Drop one of the two.")
        verify_tokens = c.max_num_seqs * (1 + c.speculative.num_speculative_tokens) if c.speculative else 0
        self.model_runner = ModelRunner(model, self.cache, c.max_num_seqs, c.cuda_graphs, no_graphs, c.compile_decode,
                                        self.tp, c.max_num_batched_tokens, verify_tokens)
        self.eos = default_eos_ids(model, tokenizer)
        self.last_step: SchedulerOutput | None = None  # the record of the latest step
        self.num_preemptions = 0  # sequences preempted since the start (the server's /metrics reports it)
        # Called with each sequence that finishes in a step, before its blocks are freed: a prefill worker reads
        # the prompt's KV there to send it on (`minillm.parallel.disagg`, chapter 08). Not called for aborts.
        self.on_finish: Callable[[Seq], None] | None = None
        self.reserved: set[str] = set()  # requests whose KV another engine is sending (`reserve_prefilled`)
        self._ids = itertools.count()
        self.max_loras, self.max_lora_rank = c.max_loras, c.max_lora_rank
        self.lora_slots = None  # minillm.lora.LoRASlots, made at the first adapter (`add_lora`)
        self.lora_modules: dict[str, str] = {}  # each adapter's name -> where it came from (a folder)
        adapters = {name: self._read_adapter(name, source) for name, source in (c.lora_modules or {}).items()}
        if adapters and c.max_lora_rank is None:
            self.max_lora_rank = max(a.rank for a in adapters.values())
        for name, adapter in adapters.items():
            source = (c.lora_modules or {})[name]
            self.add_lora(name, adapter, str(source) if isinstance(source, (str, Path)) else None)
        self.config = replace(c, num_blocks=num_blocks, async_scheduling=async_scheduling)  # as built

    @property
    def use_cuda_graphs(self) -> bool:
        """Whether decode steps run as CUDA graphs (see `ModelRunner`)."""
        return self.model_runner.use_cuda_graphs

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The captured decode graphs (`minillm.engine.cuda_graphs.DecodeGraphs`, captured as the engine starts),
        or the compiled CPU step (None until the first decode step), or None when running eagerly."""
        return self.model_runner.graphs

    @classmethod
    def for_one_prompt(cls, model: Transformer, tokenizer: Tokenizer | None, prompt_len: int,
                       params: SamplingParams, speculative: SpeculativeConfig | None = None,
                       kv_cache_dtype: str = "auto", compile_decode: bool | str = False) -> LLMEngine:
        """An engine for one request of `prompt_len` tokens (what `generate`, `generate_n` and constrained
        decoding run on): the prompt in one step, and a pool of just the blocks its sequences can need
        (the prompt's once, then max_tokens plus a copy-on-write block per sequence), one for the padding
        rows of CUDA graphs, and with `speculative`, the blocks its k draft tokens can spill into.
        `kv_cache_dtype` and `compile_decode` as for the engine."""
        best_of = params.best_of or params.n
        blocks = kv_blocks(prompt_len + params.max_tokens, BLOCK_SIZE)
        if best_of > 1:
            blocks = kv_blocks(prompt_len, BLOCK_SIZE) + best_of * (kv_blocks(params.max_tokens, BLOCK_SIZE) + 1)
        num_blocks = blocks + 1
        if speculative is not None:
            num_blocks += best_of * kv_blocks(speculative.num_speculative_tokens, BLOCK_SIZE)
        return cls(model, tokenizer, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=best_of,
                   max_num_batched_tokens=max(prompt_len, best_of), enable_prefix_caching=False,
                   speculative=speculative, kv_cache_dtype=kv_cache_dtype, compile_decode=compile_decode)

    # ------------------------------------------------------------------ LoRA adapters (chapter 08)
    def _read_adapter(self, name: str, source: object) -> object:
        """A `LoRAAdapter` from a PEFT folder (checked against the model: a ValueError naming the problem), or as
        given."""
        from minillm.lora import LoRAAdapter, load_adapter

        if isinstance(source, LoRAAdapter):
            return source
        try:
            return load_adapter(source, self.model.config)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None

    def add_lora(self, name: str, adapter: str | Path | object, source: str | None = None) -> None:
        """Serve a LoRA adapter as `name`: a PEFT folder or a `minillm.lora.LoRAAdapter` (chapter 08). It stays in
        host memory until a request names it; then the scheduler loads it into one of `max_loras` device slots.
        The first adapter wraps the model's projections in `minillm.lora.LoRALinear` (base rows run as before)."""
        from minillm.lora import LoRASlots, attach_lora

        if self.tp is not None or self.speculative is not None:
            raise ValueError("LoRA adapters are served by the one-process engine without speculative decoding: "
                             "drop tensor_parallel_size / speculative, or the adapters.")
        adapter = self._read_adapter(name, adapter)
        if self.lora_slots is None:
            rank = self.max_lora_rank or max(16, adapter.rank)
            self.lora_slots = LoRASlots(self.model, self.max_loras, rank)
            attach_lora(self.model, self.lora_slots)
            self.scheduler.lora_slots = self.model_runner.lora = self.lora_slots
        self.lora_slots.register(name, adapter)
        self.lora_modules[name] = source or (str(adapter) if isinstance(adapter, (str, Path)) else name)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, constraint: TokenIndex | None = None,
                    lora: str | None = None) -> str:
        """Queue a request; returns its id (a fresh one if request_id is None). `lora`: the name of a LoRA adapter
        to run it under (`add_lora`; chapter 08), None for the base model.

        Checked now, with a ValueError that says what to change: an empty prompt, ids outside the
        vocabulary, prompt + max_tokens beyond the model's context or the cache, stop strings without a
        tokenizer, a request id in use, an unknown adapter, best_of (or n) above max_num_seqs; under a constraint,
        stop strings or ignore_eos (the pattern decides where the output ends).
        """
        if lora is not None and lora not in self.lora_modules:
            known = sorted(self.lora_modules) or "none"
            raise ValueError(f"unknown LoRA adapter {lora!r}; this engine serves {known}: register it with "
                             "lora_modules= (--lora-modules) or add_lora.")
        params = params or SamplingParams()
        best_of = params.best_of or params.n
        if best_of > self.scheduler.max_num_seqs:  # its sequences all run at once, from the fork on
            raise ValueError(f"the request asks for best_of={best_of} completions, which run side by side, but this "
                             f"engine runs at most max_num_seqs={self.scheduler.max_num_seqs} sequences at once: "
                             "lower n / best_of, or raise max_num_seqs.")
        ids = prepare_prompt(self.model, prompt, params, self.tokenizer)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if constraint is not None:
            if params.stop:
                raise ValueError("stop strings would cut a constrained output mid-pattern; end it with the pattern "
                                 "instead.")
            if params.ignore_eos:
                raise ValueError("ignore_eos has no meaning under a constraint: the pattern decides where the output "
                                 "may end.")
            if constraint.is_finished(constraint.start):
                raise ValueError("the constraint allows only the empty string: there is nothing to generate.")
        seq = self._new_sequence(request_id, ids, params, arrival_time)
        seq.lora = lora
        if constraint is not None:  # everything that can fail comes before the scheduler takes the sequence
            seq.constraint = Constraint(constraint, masks_for(constraint, self.model.config.vocab_size,
                                                              self.model.device))
            seq.dfa_state = constraint.start
        self.scheduler.add(seq)  # refuses ids in use and requests larger than the cache; last, so a refusal leaves
        return request_id  # nothing behind

    # ------------------------------------------------------------------ prompts prefilled elsewhere (chapter 08)
    def reserve_prefilled(self, request_id: str, num_tokens: int) -> torch.Tensor | None:
        """Blocks for the keys and values of a request's `num_tokens` prompt tokens, computed by another engine (a
        prefill worker, `minillm.parallel.disagg`): the flat slots to write them to [num_tokens] (`write_kv`), or None
        if the request must wait: max_num_seqs sequences already run (or are arriving), or the pool is short of
        blocks (keeping the scheduler's reserve for running sequences). Then `add_prefilled` continues it."""
        scheduler, cache = self.scheduler, self.cache
        if request_id in scheduler.sequences or request_id in self.reserved:
            raise ValueError(f"id {request_id!r} is already in use: give each request its own id.")
        if len(scheduler.running) + len(self.reserved) >= scheduler.max_num_seqs:
            return None
        needed = kv_blocks(num_tokens, cache.block_size)
        if needed + scheduler.watermark_blocks > cache.allocator.num_free_blocks:
            return None
        cache.add_sequence(request_id)
        cache.allocate_slots([request_id], [num_tokens])
        self.reserved.add(request_id)
        table = cache.block_tables[request_id]
        return torch.tensor([table.slot(p) for p in range(num_tokens)], device=cache.device)

    def release_prefilled(self, request_id: str) -> None:
        """Give back a reservation whose request will not continue here (aborted while its KV was on the way)."""
        if request_id in self.reserved:
            self.reserved.discard(request_id)
            self.cache.free(request_id)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, first_token: int,
                      first_logprob: float, first_top: dict[int, float], generator_state: torch.Tensor | None = None,
                      arrival_time: float | None = None) -> RequestOutput:
        """Continue a request reserved by `reserve_prefilled`, whose prompt's keys and values are now in its blocks
        and whose first token another engine sampled: it runs from its next decode step, as if this engine had
        prefilled it. `generator_state`: the seeded generator's state after the first token, so that a seeded
        request draws what it would have drawn in one engine. Returns the output of the first token."""
        if request_id not in self.reserved:
            raise ValueError(f"request {request_id!r} has no reserved blocks: call reserve_prefilled first.")
        self.reserved.discard(request_id)
        seq = self._new_sequence(request_id, list(prompt_token_ids), params, arrival_time)
        if generator_state is not None and seq.generator is not None:
            seq.generator.set_state(generator_state)
        self.cache.commit([self.cache.block_tables[request_id]], [seq.prompt_token_ids])  # the tokens join its table
        seq.num_computed_tokens = len(prompt_token_ids)
        self.scheduler.add_running(seq)
        seq.append_token(first_token, first_logprob, first_top, time.perf_counter())
        if seq.finish_reason is not None:
            self.scheduler.finish(seq, seq.finish_reason)
        return self._output(seq, [first_token], seq.text)

    def _new_sequence(self, request_id: str, ids: list[int], params: SamplingParams,
                      arrival_time: float | None) -> Seq:
        """A request's first sequence: its generator, detokenizer and end-of-sequence ids."""
        seq = Seq(request_id, ids, params, request_id=request_id, generator=self._generator(params, 0),
                  detokenizer=IncrementalDecoder(self.tokenizer, ids) if self.tokenizer is not None else None,
                  eos_token_ids=set() if params.ignore_eos else self.eos)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        return seq

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Sequence `index`'s random generator, seeded seed + index (None without a seed)."""
        if params.seed is None:
            return None
        return torch.Generator(device=self.model.device).manual_seed(params.seed + index)

    def _sequences_of(self, request_id: str) -> list[Seq]:
        """The unfinished sequences of a request."""
        return [s for s in self.scheduler.sequences.values() if s.request_id == request_id]

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Stop these requests (all their sequences) now and free their blocks; unknown ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            for seq in self._sequences_of(str(request_id)):
                self.scheduler.finish(seq, "abort")
                self._release(seq)

    def _release(self, seq: Seq) -> None:
        """A finished sequence lets go of what lives outside the scheduler: the drafter's copy of it."""
        if self.speculative is not None:
            self.speculative.drafter.release(seq.seq_id)
        if self.draft_gate is not None:
            self.draft_gate.release(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.inflight is not None

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (nothing to do for a one-process engine)."""
        if self.tp is not None:
            self.tp.shutdown()

    @property
    def num_unfinished_requests(self) -> int:
        """Unfinished requests (a request with n > 1 counts once)."""
        return len({s.request_id for s in self.scheduler.sequences.values()})

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Schedule, run the model, sample; the outputs of the sequences that got a token.

        With async scheduling the tokens a step samples stay on the device and are read by the next call, while
        that call's forward runs: each call returns the previous step's outputs (see the module docstring).

        finished_only: return outputs only for the sequences that finished. An output carries the whole completion
        so far (its tokens, their times and log-probabilities), so building one for every running sequence at
        every step copies O(length) per token: quadratic in the output length. A caller that waits for the end
        (`run`, `LLM.generate`) skips that; a streaming server needs every step's delta and keeps it.
        """
        plan = self.scheduler.schedule()
        self.last_step = plan
        self.num_preemptions += len(plan.preempted)
        if not plan.scheduled and self.inflight is None:
            return []
        # Decode rows that speculate get their tokens from the verify step; the rest from one sample each.
        speculating, plain = [], plan.scheduled
        if self.speculative is not None:
            plain = []
            for seq, n in plan.scheduled:
                (speculating if self._speculates(seq, n) else plain).append((seq, n))
        drafting = None  # with adaptive speculation: the rows whose drafts still pay (the others join with none)
        if speculating and self.draft_gate is not None:
            drafting = {s.seq_id for s, _ in speculating if self.draft_gate.drafts(s.seq_id)}
            if not drafting:  # nobody drafts: a plain decode step (its graphs, its sampling), not a verify step
                plain, speculating = plan.scheduled, []
        verified = []
        if speculating:
            verified = self.model_runner.speculative_decode([s for s, _ in speculating], self.speculative,
                                                            self.spec_stats, self.draft_gate, drafting)
        logits = self._forward(plain) if plain else None  # queued on the device; the host goes on
        outputs = []
        if self.inflight is not None:  # the step before's tokens, read while this step's forward runs
            outputs = self._append(self._read_inflight(), finished_only, inflight=True)
        sampled = self._sample(plain, logits) if plain else None  # after that read: it may have finished rows
        if sampled is not None and self.async_scheduling:  # its rows' tokens stay in flight until the next step
            self.inflight = sampled
            return outputs
        return outputs + self._append([*(sampled.read() if sampled is not None else ()), *verified], finished_only)

    def _forward(self, scheduled: list[tuple[Seq, int]]) -> torch.Tensor:
        """Run the model over the scheduled rows' new tokens: logits [B, V] of each row's last one (on the device).
        A row's token still in flight is a placeholder, taken from the step before's tokens on the device."""
        ids, chunks, loras, decodes, prompts, firsts = [], [], [], [], [], []
        for i, (seq, n) in enumerate(scheduled):  # one pass: each row's id, new tokens, adapter and group
            start = seq.num_computed_tokens
            new = seq.token_slice(start, start + n)
            ids.append(seq.seq_id)
            chunks.append(new)
            loras.append(seq.lora)
            if n == 1:  # the runner's groups (`split_rows`): decode rows apart from prompt chunks
                decodes.append(i)
                firsts.append(new[0])
            else:
                prompts.append(i)
            seq.num_computed_tokens = start + n  # they count as computed
        previous = self.inflight.tokens if self.inflight is not None else None
        return self.model_runner.forward(ids, chunks, loras if self.lora_slots is not None else None, previous,
                                         allocated=True,  # [B, V]: each row's last new token; blocks: `schedule`
                                         split=(decodes, prompts, firsts))

    def _sample(self, scheduled: list[tuple[Seq, int]], logits: torch.Tensor) -> StepTokens | None:
        """Sample one token for every row whose prompt is done (and that did not finish meanwhile). A row whose prompt
        just completed and that asks for best_of > 1 forks now, and its new sequences sample from the same row."""
        rows, which, reordered = [], [], False
        greedy = greedy_kernels_usable(logits)  # then: is every row plain greedy? (`plain_greedy`, in this pass)
        for i, (seq, _) in enumerate(scheduled):
            if seq.num_uncomputed_tokens == 0 and not seq.is_finished:
                family = [seq, *self._fork(seq)] if not seq.num_output_tokens else [seq]  # prompt done: best_of forks
                for member in family:
                    reordered |= i != len(which)
                    if self.async_scheduling:  # its token stays on the device until the next step reads it
                        member.num_inflight, member.inflight_row = 1, len(rows)
                    rows.append(member)
                    which.append(i)
                    greedy = greedy and greedy_row(member)
        if not rows:
            return None
        if reordered or len(which) != len(logits):  # (indexing by a list would copy it from pageable memory)
            logits = logits.index_select(0, to_device(which, torch.long, logits.device))
        return self.model_runner.sample(rows, logits, plain=greedy)

    def _read_inflight(self) -> Iterator[SampledTokens]:
        """Async scheduling: wait for the step before's tokens; its rows, for `_append(..., inflight=True)`."""
        sampled, self.inflight = self.inflight, None
        return sampled.read()

    def _append(self, results: Iterable[SampledTokens], finished_only: bool,
                inflight: bool = False) -> list[RequestOutput]:
        """Give each sequence its new tokens (stop rules applied: a finished sequence frees its blocks), and return
        the outputs the caller asked for. inflight: the tokens were on the device (async scheduling): each takes
        its place in its block table (where it was a placeholder), and rows of sequences finished meanwhile are
        dropped. One pass over the rows."""
        now = time.perf_counter()
        outputs = []
        for seq, tokens, logprobs, tops in results:
            if inflight:
                seq.num_inflight = 0
                if seq.is_finished:  # aborted, or finished by a token read before this one
                    continue
            if not all(map(math.isfinite, logprobs)):  # its logits were NaN or infinite: its tokens mean nothing
                outputs.append(self._failed_row(seq))
                continue
            if inflight:
                self.cache.resolve_token(seq.seq_id, seq.num_tokens, tokens[0])
            text_before = len(seq.text)
            new_ids = []
            for token, logprob, top in zip(tokens, logprobs, tops):
                new_ids.append(token)
                seq.append_token(token, logprob, top, now)
                if seq.finish_reason is not None:  # drafts accepted past the end are dropped
                    if self.on_finish is not None:
                        self.on_finish(seq)
                    self.scheduler.finish(seq, seq.finish_reason)
                    self._release(seq)
                    break
            if seq.finish_reason is not None or not finished_only:
                outputs.append(self._output(seq, new_ids, seq.text[text_before:]))
        return outputs

    def _failed_row(self, seq: Seq) -> RequestOutput:
        """Finish `seq` with finish_reason "error", without its token: the step's logits for it held NaN or +inf, or
        no finite value (a broken model or LoRA adapter), so its token's log-probability is not a number. The other
        rows of the step were sampled as if it were not there; the server turns this into an error for this request
        alone."""
        self.scheduler.finish(seq, "error")
        self._release(seq)
        return self._output(seq, [], "")

    def _speculates(self, seq: Seq, n: int) -> bool:
        """Whether this scheduled row goes to the verify step: a decode step (not prompt work), unconstrained, with 2+
        tokens to go. (With adaptive speculation a row whose drafts do not pay joins it with no drafts: one forward
        for the whole step, not a verify forward and a decode forward.)"""
        return (self.speculative is not None and n == 1 and not seq.is_prefill and seq.constraint is None
                and seq.params.max_tokens - seq.num_output_tokens >= 2)

    def _fork(self, seq: Seq) -> list[Seq]:
        """If this is a request's first sequence, its prompt just completed and it asks for best_of > 1: the
        request's other sequences, forked from it (sharing its blocks) and running from now on."""
        best_of = seq.params.best_of or seq.params.n
        if seq.index != 0 or best_of == 1 or seq.num_output_tokens:
            return []
        children = []
        for index in range(1, best_of):
            child = seq.fork((seq.request_id, index), index, self._generator(seq.params, index))
            self.scheduler.fork(seq, child)
            children.append(child)
        return children

    def _output(self, seq: Seq, new_ids: list[int], new_text: str) -> RequestOutput:
        wanted = seq.params.logprobs is not None
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=seq.text if self.tokenizer is not None else None,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            token_times_s=list(seq.token_times),
            logprobs=list(seq.logprobs) if wanted else None,
            top_logprobs=list(seq.top_logprobs) if wanted else None,
            num_preemptions=seq.num_preemptions,
            index=seq.index,
            cumulative_logprob=seq.cumulative_logprob,
        )

    def run(self, use_tqdm: bool = False, total: int | None = None) -> dict[tuple[str, int], RequestOutput]:
        """Step until every request is finished; the final output of each sequence by (request id, index)."""
        from tqdm.auto import tqdm  # here, not at import: in a notebook, after minillm.book.notebook.setup()
        finished: dict[tuple[str, int], RequestOutput] = {}
        with tqdm(total=total, desc="requests", disable=not use_tqdm) as bar:
            while self.has_unfinished_requests():
                for out in self.step(finished_only=True):
                    if out.finished:
                        finished[out.request_id, out.index] = out
                        bar.update(out.index == 0)
        return finished


def n_best_by_logprob(outputs: Sequence[RequestOutput], n: int) -> list[RequestOutput]:
    """The n outputs with the highest cumulative log-probability (ties: lower index first), as vLLM's best_of."""
    return sorted(outputs, key=lambda o: (-o.cumulative_logprob, o.index))[:n]
