"""The model runner: the one place a scheduled step becomes model inputs, runs, and is sampled (chapter 05).

The engine's step is schedule -> run -> postprocess. This module is the middle: given which sequences
run and their new tokens, it makes the step's inputs (`PagedKVCache.prepare`, or the CUDA graphs'
buffer: both from the cache's one input builder, `minillm.engine.step_inputs`), runs the model, and turns
logits into tokens:

    forward(seq_ids, token_ids, loras, previous)
                                   the logits of each row's last new token, [B, vocab]:
                                   decode rows (one new token) as one batch, replayed as a CUDA graph
                                   where one was captured, prompt chunks packed in one row, eager;
                                   each row under its LoRA adapter (or none), chapter 08; tokens still
                                   on the device (async scheduling) taken from `previous`
    sample(seqs, logits)           one token per row, each with its own params, generator and constraint,
                                   on the device; `StepTokens.read()` brings them to the host
    speculative_decode(seqs, ...)  chapter 07's step variant: draft, verify in one forward, roll back

`paged_forward` is the eager forward itself, which beam search and the draft model (each with a cache
of its own) call directly; with `packed=True`, prompt chunks side by side in one row (no padding).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from minillm.engine.block_manager import NoFreeBlocksError
from minillm.engine.cuda_graphs import DecodeGraphs, graphs_unavailable
from minillm.engine.kv_cache import PagedKVCache, attention_reads_pools
from minillm.engine.mixed_graphs import MixedGraphs
from minillm.engine.sequence import Sequence as Seq
from minillm.engine.sequence import swap_inflight
from minillm.model import Transformer
from minillm.sampler.constrained import mask_logits
from minillm.sampler.sampling import compute_logprobs, logprob_tensors, sample
from minillm.sampler.speculative import verify_greedy
from minillm.utils import to_device

log = logging.getLogger("minillm")

# The largest verify step captured as a graph, in tokens: its logits buffer is [tokens, vocab] (256 MB at 1,024
# tokens and Llama-3's 128k vocabulary in bf16); a larger step (many rows of long drafts) runs eagerly.
MAX_VERIFY_GRAPH_TOKENS = 1024


class SampledTokens(NamedTuple):
    """What one step gave one sequence: its new tokens (one, or several from a verify step), their
    log-probabilities under the model's raw distribution, and their top alternatives ({} unless asked for)."""

    seq: Seq
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]


class StepTokens:
    """The tokens one step sampled, on the device, and their copy to the host under way.

    `tokens` [B] stays on the device: with async scheduling the next step reads its inputs from it
    (`swap_inflight`). The tokens and their log-probabilities are copied to pinned host memory without
    the host waiting; `read()` waits for that copy alone (not for later work queued on the GPU).
    """

    def __init__(self, seqs: list[Seq], tokens: torch.Tensor, chosen: torch.Tensor, top: Any, k: int) -> None:
        self.seqs, self.tokens, self.k = seqs, tokens, k
        on_gpu = tokens.device.type == "cuda"
        on_device = (tokens, chosen, *((top.indices, top.values) if top is not None else ()))
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in on_device] if on_gpu else []
        self.host = [p.copy_(t, non_blocking=True) for p, t in zip(pinned, on_device)] if on_gpu else list(on_device)
        self.copied = torch.cuda.Event() if on_gpu else None
        if self.copied is not None:
            self.copied.record()

    def read(self) -> Iterator[SampledTokens]:
        """Wait for the copy (now), then each row's token, its log-probability and its top alternatives as wanted,
        row by row as the caller's loop asks for them (so that the caller's pass is the only one)."""
        if self.copied is not None:
            self.copied.synchronize()
        tokens, chosen = self.host[0].tolist(), self.host[1].tolist()
        top_ids, top_values = (self.host[2].tolist(), self.host[3].tolist()) if self.k else ([], [])
        return (SampledTokens(seq, [tokens[j]], [chosen[j]], [self._top(seq, top_ids, top_values, j)])
                for j, seq in enumerate(self.seqs))

    @staticmethod
    def _top(seq: Seq, top_ids: list[list[int]], top_values: list[list[float]], j: int) -> dict[int, float]:
        """Row j's top alternatives, as many as its sequence asked for ({} for none)."""
        k = seq.params.logprobs or 0
        return dict(zip(top_ids[j][:k], top_values[j][:k])) if k else {}


def greedy_row(s: Seq) -> bool:
    """Whether a row takes its argmax from raw logits and wants only the chosen token's log-probability."""
    p = s.params
    return (p.greedy and s.constraint is None and not p.logprobs and p.repetition_penalty == 1
            and p.frequency_penalty == 0 and p.presence_penalty == 0)


def greedy_kernels_usable(logits: torch.Tensor) -> bool:
    """Whether minillm's greedy sampling kernels can run on `logits` (a GPU, Triton; MINILLM_TRITON not 0)."""
    from minillm.model import _triton_kernels_run

    return _triton_kernels_run(logits)


def plain_greedy(seqs: list[Seq], logits: torch.Tensor) -> bool:
    """Whether the greedy kernels can sample the whole step: usable on `logits`, and every row a `greedy_row`."""
    return greedy_kernels_usable(logits) and all(map(greedy_row, seqs))


def split_rows(token_ids: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[int]]:
    """(the rows computing one token, the others, the one rows' tokens): how `ModelRunner.forward` groups a step."""
    decodes, prompts, firsts = [], [], []
    for i, t in enumerate(token_ids):
        if len(t) == 1:
            decodes.append(i)
            firsts.append(t[0])
        else:
            prompts.append(i)
    return decodes, prompts, firsts


@torch.inference_mode()
def paged_forward(
    model: Transformer, cache: PagedKVCache, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]],
    previous: torch.Tensor | None = None, packed: bool = False, every_token: bool = False,
) -> torch.Tensor:
    """One eager forward of the model over new tokens of several sequences of `cache` (chapter 04).

    token_ids[i] (one or more ids) follow what seq_ids[i] already holds; prefill, chunks and decode
    tokens may be mixed. Returns the logits of each sequence's last new token, [len(seq_ids), vocab]:
    what chooses its next token. `previous`: the step before's sampled tokens on the device, which
    placeholders among token_ids stand for (async scheduling, `minillm.engine.sequence.inflight_token`).

    packed: the new tokens side by side in one row, [1, sum of lengths], instead of a left-padded batch [B, T]
    (`minillm.engine.kv_cache.PackedCacheView`): no padding in any matrix multiply, the same logits. For prompt
    chunks; not for a model with a sliding window. every_token (packed only): the logits of every new token,
    [sum of lengths, vocab], row b's after rows 0..b-1's (a speculative verify step needs them all).
    """
    if every_token and not packed:
        raise ValueError("every_token=True needs packed=True: the logits of every token come from the packed row.")
    view = cache.prepare(seq_ids, token_ids, packed=packed)
    if previous is not None:
        swap_inflight(view.tokens, previous)
    logits = model(view.tokens, cache=view, last_only=not every_token)  # [B, 1, V], packed [1, P or N, V]
    return logits[0] if packed else logits[:, -1]


class ModelGroup(Protocol):
    """What the engine needs of a group of processes that run one model together (tensor parallelism, chapter 08):
    `minillm.parallel.tensor.TensorParallel` is one. The front door starts it and hands it to `LLMEngine(group=...)`;
    the engine runs every forward through it, so the engine never imports the floor above it."""

    world: int  # the number of ranks
    model: Transformer  # rank 0's shard, the model this process runs

    def paged_cache(self, config: Any, num_blocks: int, block_size: int, device: torch.device | str,
                    dtype: torch.dtype, enable_prefix_caching: bool, kv_cache_dtype: str) -> PagedKVCache:
        """Rank 0's paged cache, and the same pool of blocks on every other rank."""

    def forward(self, model: Transformer, cache: PagedKVCache, seq_ids: Sequence[Hashable],
                token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """`paged_forward` on every rank at once -> logits [len(seq_ids), vocab]."""

    def shutdown(self) -> None:
        """Stop the other ranks."""


class ModelRunner:
    """Runs `model` over steps of sequences in `cache`: eager, or decode steps replayed as CUDA graphs.

    Args:
        model, cache: the model and the paged KV cache its sequences live in.
        max_num_seqs: the most rows of a step (the largest CUDA graph captured).
        cuda_graphs: replay decode-only forwards as CUDA graphs (`minillm.engine.cuda_graphs`), captured here,
            when the runner is built (about a second at Llama-3.2-1B's shape and 35 batch sizes, paid at
            start-up rather than by the first step that decodes, as vLLM does). None: wherever they can run (a
            CUDA model, Triton, no sliding window); True where they cannot raises a ValueError saying why. If
            capture fails, the runner logs why and runs eagerly.
        no_graphs_reason: a reason of the caller's to run eagerly (the engine's: tensor parallelism).
        compile_decode: on a CPU, run decode-only forwards as a compiled step over the same fixed buffers
            (`minillm.engine.compiled_step.CompiledDecode`): the CPU's counterpart of CUDA graphs, loaded from the
            cache of compiled steps or compiled at the first decode step (tens of seconds), then faster every step.
            "background": a step the cache lacks compiles in a process of its own while decode steps run eagerly.
        tp: a `ModelGroup` (tensor parallelism, chapter 08) whose rank 0 this is (`model` is then rank 0's shard):
            every forward runs on all its ranks through its `forward`.
        max_num_batched_tokens: the scheduler's token budget, the largest step the mixed-step graphs capture
            (`minillm.engine.mixed_graphs`, with CUDA graphs and attention reading the pools in place).
        verify_tokens: with speculative decoding, the most tokens of a verify step (max_num_seqs x (1 + k)): its
            graphs are captured up to that many (at most `MAX_VERIFY_GRAPH_TOKENS`) beside the others.

    `lora`, set by `LLMEngine.add_lora`: the `minillm.lora.LoRASlots` of the model's `LoRALinear` layers, or None.
    A forward whose rows name adapters runs under `lora.rows(...)`, eagerly: CUDA graphs (and the compiled CPU
    decode step) were captured without LoRA, so they replay only steps whose rows all run the base model.
    """

    def __init__(self, model: Transformer, cache: PagedKVCache, max_num_seqs: int, cuda_graphs: bool | None = None,
                 no_graphs_reason: str | None = None, compile_decode: bool | str = False,
                 tp: ModelGroup | None = None, max_num_batched_tokens: int = 512, verify_tokens: int = 0) -> None:
        self.model, self.cache, self.max_num_seqs = model, cache, max_num_seqs
        self.paged_forward = paged_forward if tp is None else tp.forward
        reason = graphs_unavailable(model) or no_graphs_reason
        if cuda_graphs and reason:
            raise ValueError(f"cuda_graphs=True, but {reason}. Leave cuda_graphs unset to run eagerly.")
        if compile_decode not in (False, True, "background"):
            raise ValueError(f"compile_decode={compile_decode!r}: give True, False or \"background\".")
        if compile_decode and (model.device.type != "cpu" or no_graphs_reason):
            why = no_graphs_reason or f"the model is on {model.device}, where decode steps replay as CUDA graphs"
            raise ValueError(f"compile_decode=True, but {why}. compile_decode is the CPU's decode path: leave it off "
                             "here (on a GPU the engine replays decode steps as CUDA graphs by itself).")
        self.compile_decode = compile_decode
        # Prompt chunks packed in one row (`paged_forward(packed=True)`), where the model and the group allow it;
        # where attention reads the pools in place (CUDA), a mixed step's decode rows join them in that one row.
        self.packed_prompts = tp is None and model.config.sliding_window is None
        self.packed_in_place = self.packed_prompts and attention_reads_pools(cache)
        self.use_cuda_graphs = reason is None if cuda_graphs is None else cuda_graphs
        self.graphs: DecodeGraphs | None = None  # CUDA graphs: captured now; the compiled CPU step: at first use
        self.lora: Any = None  # the LoRASlots of the model's LoRALinear layers (chapter 08), once an adapter is added
        # Packed steps with prompt work captured as CUDA graphs too (`minillm.engine.mixed_graphs`): on an H200 a
        # mixed step of 32 decode rows and a 480-token chunk fell from 12 ms eager to 3.3 ms replayed
        # (results/step_shapes/cuda.json). MINILLM_MIXED_GRAPHS=0 runs them eagerly (a comparison, or to save the
        # capture's time and memory).
        self.mixed_graphs: MixedGraphs | None = None
        if self.use_cuda_graphs:
            self._decode_graphs()
        if self.use_cuda_graphs and self.packed_in_place and os.environ.get("MINILLM_MIXED_GRAPHS", "1") != "0":
            try:
                pad = getattr(self.graphs, "pad_block", None)  # one padding block for both kinds of graph
                self.mixed_graphs = MixedGraphs(model, cache, max_num_seqs, max_num_batched_tokens, pad_block=pad)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
                log.warning("capturing mixed steps failed, running them eagerly: %s", error)
        # Speculative verify steps (every row [last token, drafts]) captured too, returning every token's logits.
        self.verify_graphs: MixedGraphs | None = None
        if verify_tokens and self.use_cuda_graphs and self.packed_in_place:
            try:
                pad = getattr(self.graphs, "pad_block", None)
                most = min(verify_tokens, MAX_VERIFY_GRAPH_TOKENS)
                self.verify_graphs = MixedGraphs(model, cache, max_num_seqs, most, pad_block=pad, every_token=True)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
                log.warning("capturing verify steps failed, running them eagerly: %s", error)

    # ------------------------------------------------------------------ running the model
    def forward(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]],
                loras: Sequence[str | None] | None = None, previous: torch.Tensor | None = None,
                allocated: bool = False, split: tuple[list[int], list[int], list[int]] | None = None) -> torch.Tensor:
        """The logits of each row's last new token, [len(seq_ids), V]; token_ids[i] follow what seq_ids[i] holds,
        under LoRA adapter loras[i] (None, or loras None: the base model; chapter 08). A negative id is a token
        still on the device (async scheduling): `previous` [B'] holds the step before's sampled tokens. allocated:
        every row's blocks are allocated already (the scheduler did it), so a decode step skips the check. split:
        `split_rows(token_ids)`, if the caller made it in a pass of its own (the engine's `_forward` does).

        A rectangular batch [B, T] pads the rows shorter than the longest, and padding costs as much compute as a
        token: a 512-token prompt chunk beside 40 decodes would make 41 x 512 positions for 552 real tokens. So
        the rows computing one token (decodes) run as one forward [D, 1], replayed as a CUDA graph where one was
        captured, and the prompt chunks as another, packed side by side in one row [1, sum of their lengths]
        (`paged_forward(packed=True)`: no padding at all) when their lengths differ (chunks of one length pad
        nothing, and the rectangular batch, attention in one call, is then slightly faster). Packing needs per-sequence
        attention, which the decode graphs do not do, hence two forwards. Prompt chunks under LoRA adapters (whose
        batched matmul takes one adapter per row), of a model with a sliding window, or of a tensor-parallel group
        run as a padded batch.

        On CUDA (`packed_in_place`: attention reads the pools in place, `minillm.kernels.paged_prefill_attention`) a
        step with any prompt chunk runs as ONE packed forward, its decode rows too (each a sequence of one token), in
        the step's order, as vLLM's "varlen" forward does: no keys are gathered, and a mixed step costs one forward
        over its tokens rather than a decode step plus a prompt step, replayed as a CUDA graph of its token bucket
        (`minillm.engine.mixed_graphs`). Decode-only steps keep their own CUDA graphs.
        """
        decodes, prompts, firsts = split if split is not None else split_rows(token_ids)
        swap = {"previous": previous} if previous is not None else {}  # every path swaps placeholders alike
        if prompts and self.packed_in_place and not (loras and any(name is not None for name in loras)):
            # One packed forward for the whole step, decode rows and prompt chunks in the step's order: the linear
            # layers over every token at once, attention by the paged prefill kernel reading the pools in place;
            # replayed as a CUDA graph where one holds the step.
            if self.mixed_graphs is not None and self.mixed_graphs.fits(seq_ids, token_ids):
                return self.mixed_graphs.run(seq_ids, token_ids, allocated=allocated, **swap)
            return paged_forward(self.model, self.cache, seq_ids, token_ids, packed=True, **swap)
        results = []
        for group in (decodes, prompts):
            if not group:
                continue
            if len(group) == len(seq_ids):  # the whole step (a decode-only step, most steps): no copies
                ids, tokens, names = seq_ids, token_ids, loras or []
            else:
                ids = [seq_ids[i] for i in group]
                names = [loras[i] for i in group] if loras is not None else []
                tokens = [token_ids[i] for i in group]
            if names and any(name is not None for name in names):  # LoRA rows: eager, each row under its adapter
                with self.lora.rows(names):
                    rows = self.paged_forward(self.model, self.cache, ids, tokens, **swap)
            elif group is decodes and self._decode_graphs() is not None:
                rows = self.graphs.run(ids, firsts, allocated=allocated, **swap)
            elif group is prompts and self.packed_prompts and len({len(t) for t in tokens}) > 1:
                rows = paged_forward(self.model, self.cache, ids, tokens, packed=True, **swap)  # lengths differ
            else:
                rows = self.paged_forward(self.model, self.cache, ids, tokens, **swap)
            results.append(rows)
        if not decodes or not prompts:  # one group: its rows are in the step's order already
            return results[0]
        # Both: decode rows first, then prompt rows; put each back at its place in the step (one gather, not a
        # tensor per row: a step may hold hundreds of rows).
        order = torch.empty(len(seq_ids), dtype=torch.long)
        order[decodes + prompts] = torch.arange(len(seq_ids))
        return torch.cat(results).index_select(0, to_device(order, torch.long, results[0].device))

    def _decode_graphs(self) -> DecodeGraphs | None:
        """The decode graphs, captured (or compiled) on first use; None when the runner runs eagerly."""
        if self.graphs is None and self.compile_decode:
            from minillm.engine.compiled_step import CompiledDecode  # (torch.export and Inductor, when it compiles)

            self.graphs = CompiledDecode(self.model, self.cache, self.max_num_seqs,
                                         background=self.compile_decode == "background")
        if self.graphs is None and self.use_cuda_graphs:
            try:
                self.graphs = DecodeGraphs(self.model, self.cache, self.max_num_seqs)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as error:  # the model does something capture forbids
                log.warning("CUDA graph capture failed, running decode steps eagerly: %s", error)
                self.use_cuda_graphs = False
        return self.graphs

    # ------------------------------------------------------------------ choosing tokens
    def sample(self, seqs: list[Seq], logits: torch.Tensor, plain: bool | None = None) -> StepTokens:
        """One token for each of seqs from its row of logits [len(seqs), V]: each with its own params and
        generator, constrained rows masked to what their pattern allows; log-probabilities of the raw logits.

        Everything stays on the device, and the host does not wait: the result's `read()` brings the whole batch
        over at once (one copy each of the tokens and their log-probabilities; a float(...) per row would make
        the host wait on the GPU once per row). A step of plain greedy rows (no penalty, constraint or top
        log-probabilities) takes its tokens and their log-probabilities from two Triton kernels on a GPU
        (`minillm.kernels.greedy_argmax`: PyTorch's argmax and log-softmax of one long row are slow, chapter 05).
        plain: `plain_greedy(seqs, logits)`, if the caller found it in a pass of its own (the engine's `_sample`)."""
        if plain_greedy(seqs, logits) if plain is None else plain:
            from minillm.kernels import greedy_argmax

            tokens, chosen = greedy_argmax(logits)
            return StepTokens(seqs, tokens, chosen, None, 0)
        tokens = sample(self._constrain(seqs, logits), [s.params for s in seqs], [s.generator for s in seqs],
                        prompt_ids=[s.prompt_token_ids for s in seqs], output_ids=[s.output_token_ids for s in seqs])
        k = max((s.params.logprobs or 0) for s in seqs)
        chosen, top = logprob_tensors(logits, tokens, k)
        return StepTokens(seqs, tokens, chosen, top, k)

    @staticmethod
    def _constrain(seqs: list[Seq], logits: torch.Tensor) -> torch.Tensor:
        """The logits to sample from: each constrained row masked to the tokens its DFA state allows."""
        constrained = [j for j, s in enumerate(seqs) if s.constraint is not None]
        if not constrained:
            return logits
        logits = logits.clone()
        for j in constrained:
            seq = seqs[j]
            allowed = seq.constraint.masks[seq.dfa_state]
            if not allowed.any():
                raise ValueError(f"no token of the vocabulary continues the pattern from state {seq.dfa_state}: "
                                 "the vocabulary lacks the bytes it needs. Use a byte-level BPE tokenizer (it has all "
                                 "256 bytes), or a pattern within the characters this vocabulary can spell.")
            logits[j] = mask_logits(logits[j], allowed)
        return logits

    # ------------------------------------------------------------------ speculative decoding (chapter 07)
    def speculative_decode(self, seqs: list[Seq], speculative: Any, stats: Any, gate: Any = None,
                           drafting: set[Hashable] | None = None) -> list[SampledTokens]:
        """Draft, verify in one target forward, roll back the rejected positions (chapter 07).

        `speculative` is a `minillm.sampler.speculative.SpeculativeConfig` (its drafter proposes, its `accept` is the
        verify rule), `stats` its `SpeculativeStats`, `gate` the engine's `DraftGate` (adaptive) or None, and
        `drafting` the rows that draft this step (None: all; the others join the verify forward with no drafts). Each
        row's last token (uncomputed, as in any decode step) and its d <= k drafts go through the model together
        (`verify_logits`); the logits at those 1 + d positions are p_1 .. p_{d+1}. The verify rule keeps a accepted
        drafts and adds one token; the cache keeps the last token and the a drafts, and `PagedKVCache.truncate`
        returns the rejected ones' slots.

        A step whose rows are all plain greedy (`greedy_row`, exact acceptance) is judged in one batch: the target's
        argmax and its log-probability at every position on the device (`minillm.kernels.greedy_argmax` on a GPU),
        one copy to the host, then `verify_greedy` per row on those ids. Other rows run `SpeculativeConfig.accept`
        (speculative sampling) row by row.
        """
        ids = [s.seq_id for s in seqs]
        ks = [0 if drafting is not None and s.seq_id not in drafting  # adaptive: drafting does not pay for this row
              else min(speculative.num_speculative_tokens, s.params.max_tokens - len(s.output_token_ids) - 1)
              for s in seqs]
        drafts = speculative.drafter.propose(ids, [s.all_token_ids for s in seqs], [s.params for s in seqs], ks,
                                             [s.generator for s in seqs])
        proposed: list[tuple[list[int], torch.Tensor | None]] = []  # each row's (draft tokens, their q or None)
        for seq_id, draft, k in zip(ids, drafts, ks):
            if len(draft.tokens) > k:
                raise ValueError(f"the drafter proposed {len(draft.tokens)} tokens where {k} were asked for.")
            try:  # the scheduler gave the row room for its last token; the drafts need more
                self.cache.allocate_slots([seq_id], [1 + len(draft.tokens)])
                proposed.append((list(draft.tokens), draft.probs))
            except NoFreeBlocksError:
                proposed.append(([], None))  # no room for drafts: a plain decode step for this row
        rows = [[s.all_token_ids[-1], *d] for s, (d, _) in zip(seqs, proposed)]
        logits = self.verify_logits(ids, rows)  # one [1 + d_b, V] per row
        batched = speculative.acceptance == "exact" and all(map(greedy_row, seqs))
        if batched:  # every row greedy: the target's argmax at every position, brought over with one wait
            targets, chosen = self._argmax(torch.cat(logits))
            targets, chosen = targets.tolist(), chosen.tolist()
        results, offset = [], 0
        for seq, (draft, q), raw in zip(seqs, proposed, logits):
            if batched:
                tokens = verify_greedy(targets[offset: offset + len(raw)], draft)
                logprobs = chosen[offset: offset + len(tokens)]  # every emitted token is the argmax at its position
                tops: list[dict[int, float]] = [{} for _ in tokens]
                offset += len(raw)
            elif not bool(torch.isfinite(raw).all()):  # NaN or infinite logits (a broken adapter): this row fails
                results.append(SampledTokens(seq, [0], [math.nan], [{}]))  # alone (`LLMEngine._append`), not the step
                continue
            else:
                tokens = speculative.accept(raw, seq.params, seq.prompt_token_ids, seq.output_token_ids, draft, q,
                                            seq.generator)
                lp = compute_logprobs(raw[: len(tokens)], torch.tensor(tokens, device=raw.device),
                                      seq.params.logprobs or 0)
                logprobs = lp.logprobs.tolist()
                tops = [dict(zip(*t)) if seq.params.logprobs else {} for t in lp.top_logprobs]
            accepted = len(tokens) - 1
            if draft:
                stats.record(len(draft), accepted)
                if gate is not None:  # adaptive speculation: the drafts that reached the rule, and those it kept
                    gate.record(seq.seq_id, min(len(draft), accepted + 1), accepted)
            seq.num_computed_tokens += 1 + accepted  # the last token and the accepted drafts are in the cache
            self.cache.truncate(seq.seq_id, seq.num_computed_tokens)
            results.append(SampledTokens(seq, tokens, logprobs, tops))
        return results

    def verify_logits(self, seq_ids: Sequence[Hashable], rows: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The target over each row's [last token, drafts] (slots already allocated) -> one [len(row), V] per row.

        Packed in one row of every token (no padding), replayed as a CUDA graph of its token bucket where the verify
        graphs hold the step (`MixedGraphs(every_token=True)`, captured when the runner is made for speculation),
        else eager. A model with a sliding window (no packed attention) runs a left-padded batch [B, max len]."""
        lengths = [len(r) for r in rows]
        if self.packed_prompts:
            if self.verify_graphs is not None and self.verify_graphs.fits(seq_ids, rows):
                logits = self.verify_graphs.run(seq_ids, rows, allocated=True)
            else:
                logits = paged_forward(self.model, self.cache, seq_ids, rows, packed=True, every_token=True)
            return list(logits.split(lengths))
        view = self.cache.prepare(seq_ids, rows)
        padded = self.model(view.tokens, cache=view)  # [B, T, V], row b's positions are its last len(row) columns
        return [padded[b, padded.shape[1] - n:] for b, n in enumerate(lengths)]

    @staticmethod
    def _argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`argmax_on_device` (a method, so that a test can count the batched verify steps)."""
        return argmax_on_device(logits)


def argmax_on_device(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (argmax [N], its log-probability [N]), both left on the device: minillm's greedy kernels on a
    GPU (`minillm.kernels.greedy_argmax`), PyTorch elsewhere."""
    if greedy_kernels_usable(logits):
        from minillm.kernels import greedy_argmax

        return greedy_argmax(logits)
    tokens = logits.argmax(dim=-1)
    return tokens, logits.float().log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
