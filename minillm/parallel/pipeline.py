"""Pipeline parallelism: the layers cut into stages, one process (one device) per stage (chapter 08).

A model too large for one device can be cut by depth. With p stages, stage s holds a contiguous slice of the
layers (`split_layers`); stage 0 also holds the embedding, the last stage the final norm and the output head.
A forward is a relay: stage 0 embeds the tokens and runs its layers, sends the hidden states [b, T, dim] to
stage 1, which runs its layers and sends them on; the last stage turns them into logits and a greedy token [b],
which goes back to stage 0 as the next input. Only activations cross between devices, never weights.

One batch alone would keep one stage busy at a time. So the batch is cut into m micro-batches, each with its
own KV cache on every stage, and each stage works through them in order: while stage 1 runs micro-batch i,
stage 0 already runs i + 1. The time a stage spends waiting is the *bubble*.

Two schedules, both greedy and both exact (each micro-batch sees the same computation as alone):

**"gpipe"**: every step (the prefill, then each decode step) is one GPipe fill and drain. Stage 0 waits for the
tokens of *all* m micro-batches before it starts the next step. With p equal stages and m equal micro-batches,
a step takes m + p - 1 slots (one slot: one stage on one micro-batch) of which each stage is busy for m:

    bubble = (p - 1) / (m + p - 1)                     `bubble_formula(p, m)`

    p = 2, m = 2, one step:    stage 0 | 0 1 . |       (digits: the micro-batch being run, ".": waiting)
                               stage 1 | . 0 1 |       -> 1 slot idle of 3 on each stage: 1/3

**"ring"** (the default): stage 0 starts micro-batch i of step t + 1 as soon as *its* token of step t is back,
without waiting for the others. The micro-batches circulate around the ring of stages, and in decode the ring
never drains between steps. Micro-batch i's token of step t + 1 depends on the last stage's output for it at
step t, so a micro-batch is back at stage 0 p slots after it left; with m >= p there is always another one to
run meanwhile and every stage stays busy. The only bubble is one fill and one drain for the whole generation:

    p = 2, m = 2:  stage 0 | 0 1 0 1 0 1 . |           steps = 3 rounds of 2 micro-batches
                   stage 1 | . 0 1 0 1 0 1 |

    bubble = 1 - steps * m / (steps * max(m, p) + min(m, p) - 1)      `ring_bubble_formula(p, m, steps)`

which is (p - 1) / (steps * m + p - 1) for m >= p (nearly 0), and 1 - m / p for m < p (too few micro-batches
to fill the ring: m = 1 keeps p - 1 stages of p waiting, as the GPipe formula also says).

Both formulas assume equal stages and free communication. Measured bubbles differ for three reasons: the last
stage also runs the output head (for a small model, as costly as a layer or more), stage 0 the embedding; every
message costs latency; and the prefill's slots are longer than the decode steps'. `pipeline_generate` returns
what each stage measured (`PipelineStats`): its wall time split into busy (running its layers) and idle
(everything else: waiting in `recv`, sending), so the two can be compared (`benchmarks/pipeline_bubble.py`).

Running it: `run_pipeline` spawns one process per stage (`torch.multiprocessing`, gloo on the CPU, NCCL on
GPUs) and returns the tokens. Under `torchrun`, each process does what `run_pipeline`'s workers do:

    dist.init_process_group("gloo")                 # rank = stage (NCCL: also torch.cuda.set_device(rank))
    model, _ = minillm.load(minillm.DEFAULT_MODEL)
    stage = PipelineStage(model, dist.get_rank(), dist.get_world_size())  # NCCL: device=f"cuda:{rank}"
    del model                                       # keep only this stage's layers
    out = pipeline_generate(stage, prompts, max_tokens=16, microbatches=2)   # a PipelineOutput on rank 0

Generation is greedy and always runs `max_tokens` steps (EOS does not stop it: every stage must agree on the
number of steps). Prompts may differ in length: a micro-batch's rows are left-padded to its longest prompt and
the padding is masked out (`StageCache`); a micro-batch of equal-length prompts runs unpadded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import queue as queue_module
import time
import traceback
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from minillm.config import ModelConfig
from minillm.contiguous_cache import KVCache
from minillm.model import Transformer, attention_mask
from minillm.parallel.workers import free_port

SCHEDULES = ("ring", "gpipe")


# ------------------------------------------------------------------ how the work is cut
def even_ranges(n: int, parts: int) -> list[range]:
    """0..n-1 cut into `parts` contiguous ranges whose sizes differ by at most one, the larger ones first.

    even_ranges(7, 3) -> [range(0, 3), range(3, 5), range(5, 7)]. Cuts layers into stages and a batch
    into micro-batches.
    """
    size, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (1 if i < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def split_layers(n_layers: int, stages: int) -> list[range]:
    """The layers of each pipeline stage: contiguous, as even as possible, earlier stages one more (chapter 08).

    split_layers(6, 2) -> [range(0, 3), range(3, 6)]; split_layers(7, 3) -> [range(0, 3), range(3, 5), range(5, 7)].
    """
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}.")
    if stages > n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {stages} stages: every stage needs at least one "
                         f"layer; use at most {n_layers} stages.")
    return even_ranges(n_layers, stages)


def bubble_formula(p: int, m: int) -> float:
    """The idle fraction of each stage in one GPipe fill-and-drain of m equal micro-batches over p equal stages:
    (p - 1) / (m + p - 1) (chapter 08; the "gpipe" schedule of `pipeline_generate`, every step)."""
    if p < 1 or m < 1:
        raise ValueError(f"p (stages) and m (micro-batches) must be at least 1, got p={p}, m={m}.")
    return (p - 1) / (m + p - 1)


def ring_bubble_formula(p: int, m: int, steps: int) -> float:
    """The idle fraction of each stage when m equal micro-batches circulate `steps` times through p equal stages
    without a drain between steps (the "ring" schedule of `pipeline_generate`, chapter 08).

    Micro-batch i enters stage 0 for step t at slot t * max(m, p) + i and the last one leaves the last stage
    min(m, p) - 1 + p slots after the last step began: the run takes steps * max(m, p) + min(m, p) - 1 slots,
    of which each stage is busy for steps * m.
    """
    if p < 1 or m < 1 or steps < 1:
        raise ValueError(f"p, m and steps must be at least 1, got p={p}, m={m}, steps={steps}.")
    return 1 - steps * m / (steps * max(m, p) + min(m, p) - 1)


# ------------------------------------------------------------------ one stage's cache and layers
class StageCache:
    """The KV cache of one micro-batch on one stage: only the stage's layers, rows left-padded to one length.

    It answers the model's `CacheView` protocol. Two adaptations of the contiguous `KVCache` (chapter 02):

    - Layers. `Attention` asks for its global `layer_idx` (stage 1 of 2 over 6 layers asks for 3, 4 and 5).
      The simplest cache would be a full-depth `KVCache` with only the stage's layers ever written, but it
      reserves memory for every layer on every stage. Instead the cache is built for a config with just the
      stage's layer count and `update` subtracts the stage's first layer: layer 3 is slot 0.
    - Padding. A `KVCache` holds rows of equal length. A prompt shorter than its micro-batch's longest is
      left-padded (`pads[b]` slots in front): its real tokens get positions 0, 1, ... (the pads position 0),
      and no query sees a pad's key. A pad's query sees only itself, so that its softmax has one finite term.
      Rows without padding take `KVCache`'s own positions and mask unchanged.
    """

    def __init__(self, config: ModelConfig, layers: range, pads: Sequence[int], max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        stage_config = dataclasses.replace(config, n_layers=len(layers))
        self.kv = KVCache(stage_config, len(pads), max_len, device=device, dtype=dtype)
        self.first_layer = layers.start
        self.pads = torch.tensor(list(pads), device=device)  # [B] padding slots in front of each row
        self.padded = any(pads)

    def positions(self, n: int) -> torch.Tensor:
        """The positions of the next n tokens: [1, n] without padding, else [B, n] (a row's pads at position 0)."""
        slots = self.kv.positions(n)  # [1, n]: seq_len .. seq_len + n - 1
        if not self.padded:
            return slots
        return (slots - self.pads[:, None]).clamp(min=0)

    def attention_mask(self, positions: torch.Tensor, window: int | None) -> torch.Tensor | str | None:
        """Which of the seq_len + T slots each of the T new queries sees: [B, 1, T, seq_len + T] bool with padding
        (causal, within the window, never a pad's key; a pad's query sees itself), else `KVCache`'s answer."""
        if not self.padded:
            return self.kv.attention_mask(positions, window)
        B, T = self.pads.shape[0], positions.shape[-1]
        key_slots = torch.arange(self.kv.seq_len + T, device=self.pads.device)  # [S]
        query_slots = key_slots[-T:]  # [T]
        mask = attention_mask(query_slots.expand(B, T), key_slots.expand(B, -1), window)  # [B, 1, T, S]
        mask &= (key_slots[None] >= self.pads[:, None])[:, None, None]  # no pad's key
        return mask | (key_slots[None] == query_slots[:, None])  # a query always sees its own slot

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, n_kv_heads, T, head_dim] of global layer `layer`; every filled slot [B, n_kv_heads, S, d]."""
        return self.kv.update(layer - self.first_layer, k, v)

    def advance(self, n: int) -> None:
        """Mark the n new slots filled (once per forward of the stage, after its last layer)."""
        self.kv.advance(n)


class PipelineStage(nn.Module):
    """One stage of a pipeline: a contiguous slice of a `Transformer`'s layers (chapter 08).

    Stage 0 also holds the embedding, the last stage the final norm and output head. Every stage holds the
    rotary module (it has no weights, only the frequencies). The parts are moved to `device`; the rest of the
    model is not referenced, so deleting the model frees it.
    """

    def __init__(self, model: Transformer, stage: int, n_stages: int, device: torch.device | str | None = None
                 ) -> None:
        super().__init__()
        ranges = split_layers(model.config.n_layers, n_stages)
        if not 0 <= stage < n_stages:
            raise ValueError(f"stage must be in 0..{n_stages - 1}, got {stage}.")
        self.config, self.stage, self.n_stages = model.config, stage, n_stages
        self.layer_range = ranges[stage]
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.embed_tokens = model.embed_tokens if self.first else None
        self.layers = nn.ModuleList(model.layers[i] for i in self.layer_range)
        self.norm = model.norm if self.last else None
        self.lm_head = model.lm_head if self.last else None
        self.rotary = model.rotary
        self.to(device if device is not None else model.device)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, cache: StageCache) -> torch.Tensor:
        """`Transformer.forward` over this stage's layers only (the plain PyTorch path).

        inputs: token ids [B, T] on stage 0, else the previous stage's hidden states [B, T, dim].
        Returns the hidden states [B, T, dim], or on the last stage the logits of each row's last position
        [B, vocab]. Advances `cache` by T.
        """
        x = self.embed_tokens(inputs) if self.first else inputs  # [B, T, dim]
        T = x.shape[1]
        positions = cache.positions(T).expand(x.shape[0], T)  # [B, T]
        rope = self.rotary(positions, x.dtype)  # cos, sin [B, 1, T, head_dim]
        mask = cache.attention_mask(positions, self.config.sliding_window)
        for layer in self.layers:
            x = layer(x, rope, mask, cache)
        cache.advance(T)
        if self.last:
            return self.lm_head(self.norm(x[:, -1]))  # [B, vocab]
        return x


# ------------------------------------------------------------------ what a run measured
@dataclass
class StageStats:
    """One stage's wall time over a `pipeline_generate` call, split in two."""

    stage: int
    layers: tuple[int, int]  # the stage's layers, [start, stop)
    busy_s: float  # running the stage's layers (and embedding / head / argmax)
    idle_s: float  # everything else: waiting in recv, sending

    @property
    def bubble_fraction(self) -> float:
        """idle / (busy + idle)."""
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0


@dataclass
class PipelineStats:
    """What a `pipeline_generate` call measured on every stage, with the formulas to compare against."""

    stages: list[StageStats]
    microbatches: int
    schedule: str
    batch: int  # prompts
    steps: int  # forwards per micro-batch: the prefill, then max_tokens - 1 decode steps
    total_s: float  # stage 0's wall time, first forward to last token received
    first_token_s: float  # stage 0's wall time until the prefill's tokens of every micro-batch were back

    @property
    def bubble_fraction(self) -> float:
        """The measured idle fraction, averaged over stages."""
        return sum(s.bubble_fraction for s in self.stages) / len(self.stages)

    @property
    def predicted_bubble(self) -> float:
        """The formula for this schedule with equal stages and free messages (see the module docstring)."""
        p, m = len(self.stages), self.microbatches
        return bubble_formula(p, m) if self.schedule == "gpipe" else ring_bubble_formula(p, m, self.steps)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after each prompt's first over the time after the prefill's last token came back (in "ring" a
        little decode work of the first micro-batches overlaps the prefill of the last ones)."""
        decode_s = self.total_s - self.first_token_s
        return self.batch * (self.steps - 1) / decode_s if decode_s > 0 else float("nan")


@dataclass
class PipelineOutput:
    """The result of `pipeline_generate` / `run_pipeline` (on rank 0)."""

    token_ids: list[list[int]]  # the generated ids of each prompt, in the prompts' order
    stats: PipelineStats


# ------------------------------------------------------------------ the run
@dataclass
class MicroBatch:
    """A slice of the prompts: their ids left-padded to one length, and the padding of each row."""

    rows: range  # which prompts
    ids: torch.Tensor  # [b, length]
    pads: list[int]

    @property
    def length(self) -> int:
        return self.ids.shape[1]


def make_microbatches(prompts: Sequence[Sequence[int]], m: int, pad_id: int = 0,
                      device: torch.device | str = "cpu") -> list[MicroBatch]:
    """The prompts cut into m contiguous micro-batches of near-equal size (`even_ranges`), each left-padded."""
    batches = []
    for rows in even_ranges(len(prompts), m):
        length = max(len(prompts[r]) for r in rows)
        pads = [length - len(prompts[r]) for r in rows]
        ids = torch.tensor([[pad_id] * pad + list(prompts[r]) for r, pad in zip(rows, pads)], device=device)
        batches.append(MicroBatch(rows, ids, pads))
    return batches


def check_request(config: ModelConfig, prompts: Sequence[Sequence[int]], max_tokens: int, microbatches: int,
                  schedule: str) -> None:
    """Raise ValueError, saying what to change, for a request a pipeline of this model cannot run."""
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass a list of prompts, each a list of token ids.")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token id; drop the empty ones (or add a BOS token).")
    bad = [t for p in prompts for t in p if not 0 <= int(t) < config.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary 0..{config.vocab_size - 1}: encode the "
                         "prompts with this model's tokenizer.")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
    if not 1 <= microbatches <= len(prompts):
        raise ValueError(f"microbatches must be between 1 and the number of prompts ({len(prompts)}), got "
                         f"{microbatches}: every micro-batch needs at least one prompt.")
    longest = max(len(p) for p in prompts) + max_tokens - 1
    if longest > config.max_seq_len:
        raise ValueError(f"the longest prompt plus max_tokens - 1 is {longest} positions, more than the model's "
                         f"context ({config.max_seq_len}): shorten the prompt or lower max_tokens.")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}.")


class Links:
    """A stage's messages: hidden states to the next stage, greedy tokens from the last stage back to stage 0.

    Messages between two ranks arrive in the order they were sent, so no tags are needed, and a stage knows
    in advance every message it will receive (`incoming`: their shapes, in order).

    Sends are non-blocking (`isend`): a blocking send waits for the receiver to post its receive, and with
    p = 2 stage 0 would wait to hand over micro-batch 1 while stage 1 waits to hand back micro-batch 0's
    token: a deadlock. Before sending a micro-batch's next message, a stage waits for its previous one, which
    keeps at most m messages in flight and never blocks for long: a stage only gets micro-batch i's next input
    after every stage ran micro-batch i's current one, receiving the message included.

    Receives are posted `ahead` messages in advance. With gloo, data moves only once the receiver has posted
    its receive (the sender waits for its "ready"): a receive posted when the data is needed costs a round trip
    on top of the wait, which on this book's CPU machine measured ~4 ms per message, more than a stage's work.
    Posted ahead, it costs nothing. With NCCL the messages between two ranks share one stream, on which a
    receive posted ahead could hold up a send queued behind it: there `ahead` is 0.
    """

    def __init__(self, stage: PipelineStage, incoming: list[tuple[tuple[int, ...], torch.dtype]], ahead: int) -> None:
        self.rank, self.p, self.device = stage.stage, stage.n_stages, stage.device
        self.source = self.rank - 1 if self.rank > 0 else self.p - 1  # stage 0 hears from the last stage
        self.incoming = iter(incoming)  # (shape, dtype) of every message still to post a receive for
        self.posted: deque[tuple[torch.Tensor, dist.Work]] = deque()
        self.ahead = ahead
        self.in_flight: dict[tuple[str, int], dist.Work] = {}
        self._post(ahead)

    def _post(self, n: int) -> None:
        """Post receives for the next n messages (fewer if fewer are left)."""
        for _ in range(n):
            shape_and_dtype = next(self.incoming, None)
            if shape_and_dtype is None:
                return
            buffer = torch.empty(shape_and_dtype[0], dtype=shape_and_dtype[1], device=self.device)
            self.posted.append((buffer, dist.irecv(buffer, self.source)))

    def recv(self) -> torch.Tensor:
        """The next message: hidden states [b, T, dim] from the previous stage, or on stage 0 tokens [b]."""
        if not self.posted:
            self._post(1)
        buffer, work = self.posted.popleft()
        self._post(self.ahead - len(self.posted))  # keep `ahead` receives posted while this one is used
        work.wait()
        return buffer

    def _send(self, tensor: torch.Tensor, dst: int, key: tuple[str, int]) -> None:
        previous = self.in_flight.pop(key, None)
        if previous is not None:
            previous.wait()
        self.in_flight[key] = dist.isend(tensor.contiguous(), dst)

    def send_hidden(self, x: torch.Tensor, microbatch: int) -> None:
        """Hidden states [b, T, dim] to the next stage."""
        self._send(x, self.rank + 1, ("hidden", microbatch))

    def send_tokens(self, tokens: torch.Tensor, microbatch: int) -> None:
        """A micro-batch's new tokens [b] (int64) to stage 0."""
        self._send(tokens, 0, ("tokens", microbatch))

    def finish(self) -> None:
        """Wait for every send still in flight."""
        for work in self.in_flight.values():
            work.wait()
        self.in_flight.clear()


def incoming_messages(stage: PipelineStage, batches: list[MicroBatch], max_tokens: int
                      ) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every message `stage` receives, in order: per step, per micro-batch, the tokens [b]
    (stage 0, from the last stage) or the hidden states [b, T, dim] (T: the prompt's length, then 1)."""
    if stage.n_stages == 1:
        return []
    if stage.first:
        return [((len(mb.rows),), torch.int64) for _ in range(max_tokens) for mb in batches]
    return [((len(mb.rows), mb.length if step == 0 else 1, stage.config.dim), stage.dtype)
            for step in range(max_tokens) for mb in batches]


class Clock:
    """Sums the wall time a stage spends computing; on a GPU it synchronises so that the time is the kernels'."""

    def __init__(self, device: torch.device) -> None:
        self.busy_s = 0.0
        self.cuda = device.type == "cuda"
        self.start = time.perf_counter()

    def now(self) -> float:
        """Seconds since the clock started, after the device finished what it was given."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - self.start

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Count the block's time as busy."""
        start = self.now()
        yield
        self.busy_s += self.now() - start


def _check_group(stage: PipelineStage) -> None:
    """The process group must have one rank per stage, rank = stage (a single stage may run without one)."""
    if stage.n_stages == 1 and not dist.is_initialized():
        return
    if not dist.is_initialized():
        raise ValueError(f"a {stage.n_stages}-stage pipeline needs torch.distributed: call "
                         "dist.init_process_group first (or use run_pipeline, which does).")
    if dist.get_world_size() != stage.n_stages or dist.get_rank() != stage.stage:
        raise ValueError(f"this is stage {stage.stage} of {stage.n_stages}, but the process is rank "
                         f"{dist.get_rank()} of {dist.get_world_size()}: build stage = rank, n_stages = world size.")


@torch.inference_mode()
def pipeline_generate(stage: PipelineStage, prompts: Sequence[Sequence[int]], max_tokens: int,
                      microbatches: int = 1, schedule: str = "ring", pad_id: int = 0) -> PipelineOutput | None:
    """Greedy generation of `max_tokens` tokens per prompt through a pipeline of stages (chapter 08).

    Every rank calls it with the same arguments, rank s with stage s. The prompts (lists of token ids, any
    lengths) are cut into `microbatches` micro-batches that flow through the stages in order, scheduled as
    `schedule` says ("ring" or "gpipe", see the module docstring).

    Returns, on rank 0, the generated ids of every prompt and what every stage measured; None on other ranks.
    """
    check_request(stage.config, prompts, max_tokens, microbatches, schedule)
    _check_group(stage)
    batches = make_microbatches(prompts, microbatches, pad_id, stage.device)
    caches = [StageCache(stage.config, stage.layer_range, mb.pads, mb.length + max_tokens - 1, stage.device,
                         stage.dtype) for mb in batches]
    ahead = len(batches) if dist.is_initialized() and dist.get_backend() == "gloo" else 0  # see `Links`
    links = Links(stage, incoming_messages(stage, batches, max_tokens), ahead)
    tokens: list[list[torch.Tensor]] = [[] for _ in batches]  # stage 0: each micro-batch's new tokens [b], by step
    first_token_s = 0.0
    if dist.is_initialized():
        dist.barrier()  # every stage starts its clock together
    clock = Clock(stage.device)

    def keep_tokens(i: int, new: torch.Tensor) -> None:
        """Stage 0: micro-batch i's tokens [b] of its next step are in."""
        nonlocal first_token_s
        tokens[i].append(new)
        if len(tokens[i]) == 1 and i == len(batches) - 1:  # the prefill's tokens are all in
            first_token_s = clock.now()

    def wait_for_tokens(i: int, steps: int) -> None:
        """Stage 0: receive micro-batch i's tokens until it has those of `steps` steps."""
        while len(tokens[i]) < steps:
            keep_tokens(i, links.recv())

    for step in range(max_tokens):  # step 0: the prefill; then one decode step per new token
        if stage.first and schedule == "gpipe":
            for i in range(len(batches)):  # fill and drain: every micro-batch's token back before the next step
                wait_for_tokens(i, step)
        for i, mb in enumerate(batches):
            if stage.first:
                wait_for_tokens(i, step)
                x = mb.ids if step == 0 else tokens[i][-1][:, None]  # [b, T] token ids
            else:
                x = links.recv()  # [b, T, dim]
            with clock.busy():
                out = stage(x, caches[i])
                if stage.last:
                    out = out.argmax(dim=-1)  # [b]: the greedy tokens
            if not stage.last:
                links.send_hidden(out, i)
            elif stage.first:  # a single stage: the tokens are already where they are needed
                keep_tokens(i, out)
            else:
                links.send_tokens(out, i)
    if stage.first:
        for i in range(len(batches)):
            wait_for_tokens(i, max_tokens)
    links.finish()
    return _gather_output(stage, clock, batches, tokens, len(prompts), max_tokens, microbatches, schedule,
                          first_token_s)


def _gather_output(stage: PipelineStage, clock: Clock, batches: list[MicroBatch], tokens: list[list[torch.Tensor]],
                   batch: int, max_tokens: int, microbatches: int, schedule: str, first_token_s: float
                   ) -> PipelineOutput | None:
    """Every stage's `StageStats` to rank 0; there, the tokens in the prompts' order and the `PipelineStats`."""
    total_s = clock.now()
    mine = StageStats(stage.stage, (stage.layer_range.start, stage.layer_range.stop), clock.busy_s,
                      total_s - clock.busy_s)
    every = [mine]
    if dist.is_initialized():
        every = [None] * stage.n_stages if stage.first else None
        dist.gather_object(mine, every, dst=0)
    if not stage.first:
        return None
    token_ids: list[list[int]] = [[] for _ in range(batch)]
    for mb, steps in zip(batches, tokens):
        columns = torch.stack(steps, dim=1).tolist()  # [b, max_tokens]
        for row, ids in zip(mb.rows, columns):
            token_ids[row] = ids
    stats = PipelineStats(every, microbatches, schedule, batch, max_tokens, total_s, first_token_s)
    return PipelineOutput(token_ids, stats)


# ------------------------------------------------------------------ the launcher: one process per stage
def _read_model_config(model_source: str | Path) -> tuple[ModelConfig, str | None]:
    """The config of a shipped model name or model folder, and the checkpoint's dtype, without its weights."""
    from minillm.checkpoints import find_model_folder

    hf = json.loads((find_model_folder(model_source) / "config.json").read_text())
    return ModelConfig.from_hf(hf), hf.get("dtype") or hf.get("torch_dtype")


@dataclass
class _Job:
    """What every worker process gets (pickled to it by the spawn)."""

    world: int
    port: int
    backend: str
    model_source: str
    dtype: torch.dtype
    prompts: list[list[int]]
    max_tokens: int
    microbatches: int
    schedule: str
    pad_id: int
    timeout_s: float


def _worker(rank: int, job: _Job, results: queue_module.Queue) -> None:
    """One pipeline stage in its own process: join the group, load the model, keep stage `rank`, generate.

    Puts ("ok", rank, PipelineOutput or None) on `results`, or ("error", rank, message) and exits with 1.
    """
    import minillm

    try:
        torch.set_num_threads(1)
        device = torch.device(f"cuda:{rank}" if job.backend == "nccl" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(job.backend, init_method=f"tcp://127.0.0.1:{job.port}", rank=rank,
                                world_size=job.world, timeout=datetime.timedelta(seconds=job.timeout_s))
        model, _ = minillm.load(job.model_source, device="cpu", dtype=job.dtype)  # on the host: move one stage only
        stage = PipelineStage(model, rank, job.world, device)
        del model
        out = pipeline_generate(stage, job.prompts, job.max_tokens, job.microbatches, job.schedule, job.pad_id)
        results.put(("ok", rank, out))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the caller, not hang it
        results.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _next_report(results: queue_module.Queue, timeout_s: float) -> tuple[str, int, object] | None:
    """A worker's (kind, rank, payload), or None if none came within timeout_s."""
    try:
        return results.get(timeout=timeout_s)
    except queue_module.Empty:
        return None


def _collect(processes: list, results: queue_module.Queue, timeout_s: float) -> PipelineOutput:
    """Wait for every worker's report; raise naming the stage if one failed, died or the run timed out."""
    deadline = time.monotonic() + timeout_s
    reported: dict[int, PipelineOutput | None] = {}
    while len(reported) < len(processes):
        report = _next_report(results, 0.5)
        if report is None:
            dead = [r for r, p in enumerate(processes) if r not in reported and p.exitcode not in (None, 0)]
            if dead:
                report = _next_report(results, 2.0)  # its own report may be just arriving
                if report is None:
                    raise RuntimeError(f"pipeline stage {dead[0]} (rank {dead[0]}) exited with code "
                                       f"{processes[dead[0]].exitcode} without a report (killed, out of memory?).")
            elif time.monotonic() > deadline:
                waiting = [r for r in range(len(processes)) if r not in reported]
                raise TimeoutError(f"the pipeline did not finish in {timeout_s:.0f} s; stages {waiting} never "
                                   "reported. Raise timeout_s for long runs.")
            else:
                continue
        kind, rank, payload = report
        if kind == "error":  # name the stages that died silently too: the reporter may only have lost its peer
            dead = [f"stage {r} exited with code {p.exitcode} without a report"
                    for r, p in enumerate(processes) if r != rank and p.exitcode not in (None, 0)]
            raise RuntimeError(f"pipeline stage {rank} (rank {rank}) failed"
                               f"{' (' + '; '.join(dead) + ')' if dead else ''}: {payload}")
        reported[rank] = payload
    return reported[0]


def run_pipeline(model_source: str | Path, prompts: Sequence[Sequence[int]], max_tokens: int, stages: int = 2,
                 microbatches: int = 1, schedule: str = "ring", pad_id: int = 0, dtype: torch.dtype | str | None = None,
                 timeout_s: float = 300.0) -> PipelineOutput:
    """Greedy generation through a pipeline of `stages` processes, one stage each (chapter 08).

    Spawns the workers (`torch.multiprocessing`, spawn), which rendezvous on a free local port with gloo on the
    CPU (or NCCL, one GPU each, when there are that many), each load `model_source` (a shipped model name or a
    model folder), keep their stage and run `pipeline_generate`. Returns rank 0's `PipelineOutput`. The workers
    are always joined; a worker's error is raised here as a RuntimeError naming its stage.
    """
    from minillm.checkpoints import resolve_dtype

    config, checkpoint_dtype = _read_model_config(model_source)
    split_layers(config.n_layers, stages)  # a ValueError if the model has too few layers
    check_request(config, prompts, max_tokens, microbatches, schedule)
    on_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= stages
    job = _Job(stages, free_port(), "nccl" if on_gpus else "gloo", str(model_source),
               resolve_dtype(dtype, torch.device("cuda" if on_gpus else "cpu"), checkpoint_dtype),
               [[int(t) for t in p] for p in prompts], max_tokens, microbatches, schedule, pad_id, timeout_s)
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_worker, args=(rank, job, results), daemon=True) for rank in range(stages)]
    started, finished = [], False
    try:
        for p in processes:
            p.start()
            started.append(p)
        output = _collect(processes, results, timeout_s)
        finished = True
        return output
    finally:  # after a success the workers are exiting: give them time; after a failure, stop them now
        for p in started:
            p.join(timeout=30 if finished else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
