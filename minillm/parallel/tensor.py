"""Tensor parallelism: every layer split across processes, Megatron-style, over `torch.distributed` (chapter 08).

A decode step reads every weight once. Split each layer's weights across `world` GPUs and each reads 1/world
of them, in parallel: the step's weight traffic per GPU drops by the same factor, at the price of two
all-reduces per layer. The split (Megatron-LM, Shoeybi et al. 2019) is chosen so that no other
communication is needed:

    qkv_proj      column-parallel: rank r keeps the rows of its n_heads/world query heads and of its
                  n_kv_heads/world key/value heads (a slice of q, of k and of v, stacked again)
    attention     on the rank's own heads only, against its own share of the KV cache
    o_proj        row-parallel: the columns of the rank's query heads; each rank has a partial sum of the
                  output, and an all-reduce adds them up                                   (all-reduce 1)
    gate_up_proj  column-parallel: the rank's slice of the gate rows and of the up rows
    down_proj     row-parallel: the matching columns; partial sums, all-reduced            (all-reduce 2)

Each all-reduce carries the activations [tokens, dim] (2 x dim bytes a token in 16 bits), whatever the
model's size. Embeddings, norms and the output head are kept whole on every rank (Megatron splits the
vocabulary as well; minillm does not, to stay short).

How the engine runs it (`minillm.LLM(..., tensor_parallel_size=N)`; vLLM's option of the same name). The front
door starts the group (`start_group`) and hands it to `LLMEngine(..., group=...)`, which runs every forward
through it (`TensorParallel.forward` is its runner's forward): the engine never imports this module. The
calling process is rank 0: it schedules, allocates the KV blocks and samples, exactly as with one process;
its paged pool holds its own KV heads. Ranks 1..N-1 are worker processes (`torch.multiprocessing`, spawned)
that hold their shards and a pool of the same blocks with their heads. Each step, rank 0 sends the step's
inputs (the `StepInputs` rows: tokens, positions, slots, block tables) and any copy-on-write block copies to
every worker over a pipe, then all ranks run the forward together, meeting in the all-reduces. Sampling
happens on rank 0 alone. vLLM's executor works the same way (its scheduler output goes to the workers over a
shared-memory queue); the pipe keeps this short, and a worker whose driver dies sees the pipe close and exits.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import traceback
from collections.abc import Hashable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from minillm.checkpoints import materialize
from minillm.config import ModelConfig
from minillm.engine.engine_config import EngineConfig, check_tensor_parallel
from minillm.engine.kv_cache import PagedCacheView, PagedKVCache
from minillm.engine.step_inputs import StepInputs
from minillm.model import Transformer
from minillm.parallel.workers import free_port, stop_workers


class TensorParallelError(RuntimeError):
    """A worker of a tensor-parallel group failed or is gone; the group cannot run steps any more."""


@dataclasses.dataclass
class StepGate:
    """Whether this rank is inside a step that every rank runs (so that an all-reduce will be met)."""

    in_step: bool = False


# ---------------------------------------------------------------------------- splitting the weights
def check_divisible(config: ModelConfig, world: int) -> None:
    """Raise a ValueError saying what to change unless `world` ranks can split the model's heads and MLP evenly."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world!r}.")
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(config, name) % world:
            raise ValueError(
                f"tensor_parallel_size={world} must divide the model's {name}={getattr(config, name)}: every rank "
                f"holds an equal share of the heads and of the MLP. Use a size that divides n_heads={config.n_heads}, "
                f"n_kv_heads={config.n_kv_heads} and ffn_dim={config.ffn_dim}.")


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's shard: n_heads, n_kv_heads and ffn_dim divided by `world`, everything else kept
    (head_dim written out, so that it does not follow dim / n_heads)."""
    check_divisible(config, world)
    return dataclasses.replace(config, n_heads=config.n_heads // world, n_kv_heads=config.n_kv_heads // world,
                               ffn_dim=config.ffn_dim // world, head_dim=config.head_dim)


def column_shard(weight: torch.Tensor, sizes: Sequence[int], rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s rows of a stacked column-parallel weight [sum(sizes), ...] (or bias [sum(sizes)]).

    The weight stacks several matrices (q, k, v or gate, up) of `sizes` rows; each is split into `world` equal
    slices, and the rank's slices are stacked again in the same order: [sum(sizes) / world, ...].
    """
    parts = weight.split(list(sizes), dim=0)
    return torch.cat([part.chunk(world, dim=0)[rank] for part in parts], dim=0).contiguous()


def row_shard(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s columns of a row-parallel weight [out, in] -> [out, in / world]."""
    return weight.chunk(world, dim=1)[rank].contiguous()


def shard_state(model: Transformer, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s share of `model`'s weights, by the names of a `Transformer` built from `shard_config`.

    Row-parallel biases (o_proj, down_proj) stay whole: `RowParallelLinear` adds them once, after its all-reduce.
    """
    config = model.config
    q, kv, ffn = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.ffn_dim
    state = {}
    for name, tensor in model.state_dict().items():
        if ".qkv_proj." in name:
            tensor = column_shard(tensor, (q, kv, kv), rank, world)
        elif ".gate_up_proj." in name:
            tensor = column_shard(tensor, (ffn, ffn), rank, world)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor = row_shard(tensor, rank, world)
        state[name] = tensor
    return state


class RowParallelLinear(nn.Linear):
    """A row-parallel linear layer: x [..., in / world] @ weight.T -> partial sums, all-reduced -> [..., out].

    It holds its rank's columns of the full weight; each rank's product is one term of the full product's
    sum over the input features, so an all-reduce (sum) across the group gives every rank the full output.
    The bias is whole on every rank and added once, after the sum.

    It runs only inside a step of the `TensorParallel` group that owns it (the other ranks must reach the same
    all-reduce): called anywhere else, it raises instead of waiting forever.
    """

    gate: StepGate | None = None  # set by whoever builds the shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None or not self.gate.in_step:
            raise TensorParallelError(
                "this layer is one rank's shard of a tensor-parallel model, and the other ranks are not running it: "
                "run the model through the engine that owns it (LLMEngine or LLM with tensor_parallel_size=N), "
                "not directly.")
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


def build_shard(config: ModelConfig, state: dict[str, torch.Tensor], world: int, device: torch.device | str,
                dtype: torch.dtype, gate: StepGate) -> Transformer:
    """The `Transformer` of one rank: `shard_config(config)` with o_proj and down_proj row-parallel (their all-reduces
    allowed while `gate.in_step`), holding `state` (from `shard_state`), on `device` in `dtype`."""
    local = shard_config(config, world)
    with torch.device("meta"):
        model = Transformer(local)
        for block in model.layers:
            for owner, name in ((block.self_attn, "o_proj"), (block.mlp, "down_proj")):
                linear = getattr(owner, name)
                row = RowParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None)
                row.gate = gate
                setattr(owner, name, row)
    return materialize(model, state, device, dtype)


# ---------------------------------------------------------------------------- the workers
class ShardedKVCache(PagedKVCache):
    """Rank 0's paged cache in a tensor-parallel engine: a `PagedKVCache` over its own KV heads that also notes
    every copy-on-write block copy, for the workers to repeat on their pools before the next forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending_copies: list[tuple[int, int]] = []

    def copy_block(self, src: int, dst: int) -> None:
        super().copy_block(src, dst)
        self.pending_copies.append((src, dst))


def _worker(rank: int, world: int, init_method: str, device: str, config: ModelConfig,
            state: dict[str, torch.Tensor], dtype: torch.dtype, conn: Any) -> None:
    """A worker process: join the group, build the shard, then run every step rank 0 sends until told to stop
    (or until the pipe closes: the driver is gone)."""
    try:
        conn.send(("started", None))
        torch.set_num_threads(1)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=init_method,
                                rank=rank, world_size=world, timeout=timedelta(seconds=120))
        model = build_shard(config, state, world, device, dtype, StepGate(in_step=True))  # a worker only runs steps
        del state
        cache = None
        conn.send(("ready", None))
        with torch.inference_mode():
            while True:
                try:
                    message = conn.recv()
                except EOFError:  # the driver is gone
                    break
                kind = message[0]
                if kind == "stop":
                    break
                if kind == "cache":
                    cache = PagedKVCache(model.config, device=device, dtype=dtype, enable_prefix_caching=False,
                                         **message[1])
                elif kind == "step":
                    _, copies, rows, T, context_lens, num_new = message
                    for src, dst in copies:
                        cache.copy_block(src, dst)
                    inputs = StepInputs(torch.from_numpy(rows).to(device), T)
                    view = PagedCacheView(cache, inputs, context_lens, num_new)  # no tables: nothing to commit
                    model(view.tokens, cache=view, last_only=True)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to rank 0, which raises it
        try:
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        finally:
            os._exit(1)


def start_group(model: Transformer, config: EngineConfig) -> TensorParallel | None:
    """The tensor-parallel group an engine of `config` runs on, started now (None for tensor_parallel_size 1):
    what a front door (`minillm.LLM`, the server) hands to `LLMEngine(model, tokenizer, config, group=...)`. The
    config is checked first, so that a setting the group cannot run with starts no worker."""
    check_tensor_parallel(config)
    return TensorParallel(model, config.tensor_parallel_size) if config.tensor_parallel_size != 1 else None


class TensorParallel:
    """Rank 0's side of a tensor-parallel group: starts the workers, holds rank 0's shard, runs steps.

    Args:
        model: the whole model (its device and dtype are rank 0's; on CUDA, rank r runs on cuda:r).
        world: the number of ranks (tensor_parallel_size), dividing n_heads, n_kv_heads and ffn_dim.

    After construction `model` is rank 0's shard. One group at a time per process (torch.distributed has one
    default group); `shutdown` ends it.
    """

    def __init__(self, model: Transformer, world: int) -> None:
        check_divisible(model.config, world)
        plain = (nn.Linear, RowParallelLinear)
        if any(type(module) not in plain for block in model.layers for module in
               (block.self_attn.qkv_proj, block.self_attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj)):
            raise ValueError("tensor parallelism splits plain nn.Linear weights; this model's layers are quantised "
                             "or replaced. Split the unquantised model (quantised shards are not implemented).")
        if world == 1:
            raise ValueError("tensor_parallel_size=1 needs no group: build the engine without it.")
        if dist.is_initialized():
            raise ValueError("torch.distributed already has a process group in this process; minillm starts its own "
                             "for tensor parallelism: shut the other engine down first (LLMEngine.shutdown()).")
        self.world, self.gate, self.broken = world, StepGate(), None
        config, dtype, device = model.config, model.dtype, model.device
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs, one per rank; "
                             f"this machine has {torch.cuda.device_count()}.")
        devices = [f"cuda:{r}" for r in range(world)] if device.type == "cuda" else ["cpu"] * world
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = mp.get_context("spawn")
        self.processes, self.conns = [], []
        for rank in range(1, world):
            state = {k: v.cpu() for k, v in shard_state(model, rank, world).items()}  # shared memory to the worker
            parent, child = context.Pipe()
            process = context.Process(target=_worker, name=f"minillm-tp-{rank}", daemon=True,
                                      args=(rank, world, init_method, devices[rank], config, state, dtype, child))
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        for rank, conn in enumerate(self.conns, start=1):  # each worker is up before we wait in the rendezvous
            self._receive(rank, conn, "started", timeout=120)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=0,
                                world_size=world, timeout=timedelta(seconds=120))
        self.model = build_shard(config, shard_state(model, 0, world), world, device, dtype, self.gate)
        for rank, conn in enumerate(self.conns, start=1):
            self._receive(rank, conn, "ready", timeout=600)
        atexit.register(self.shutdown)

    def _receive(self, rank: int, conn: Any, expected: str, timeout: float) -> None:
        """Wait for worker `rank` to say `expected`; raise its error (or its death) as a `TensorParallelError`."""
        process, waited = self.processes[rank - 1], 0.0
        while not conn.poll(0.1):
            waited += 0.1
            if not process.is_alive() or waited > timeout:
                process.join(timeout=1)
                self._fail(f"worker rank {rank} exited (code {process.exitcode}) before saying {expected!r}. In a "
                           "script, build the engine under `if __name__ == \"__main__\":` (the workers are spawned, "
                           "and import the script's main module)" if not process.is_alive() else
                           f"worker rank {rank} did not say {expected!r} within {timeout:.0f} s")
        try:
            kind, detail = conn.recv()
        except EOFError:
            kind, detail = "error", f"rank {rank} exited (code {process.exitcode})"
        if kind == "error":
            self._fail(f"worker {detail}")

    def _fail(self, reason: str) -> None:
        """Mark the group broken, stop what is left of it, and raise."""
        self.broken = reason
        self.shutdown()
        raise TensorParallelError(f"tensor parallelism failed: {reason}. Its requests cannot continue; start a new "
                                  "engine.")

    def _worker_error(self) -> str:
        """What went wrong on the workers, after a failed step: a worker's traceback, or which one died."""
        for rank, (conn, process) in enumerate(zip(self.conns, self.processes), start=1):
            try:
                if conn.poll(1.0):
                    kind, detail = conn.recv()
                    if kind == "error":
                        return f"worker {detail}"
            except (EOFError, OSError):
                pass
            if not process.is_alive():
                return f"worker rank {rank} died (exit code {process.exitcode})"
        return "a collective failed"

    def paged_cache(self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device | str,
                    dtype: torch.dtype, enable_prefix_caching: bool, kv_cache_dtype: str) -> ShardedKVCache:
        """Rank 0's paged cache (`config` is rank 0's shard's), and the same pool of blocks on every worker."""
        self._send(("cache", {"num_blocks": num_blocks, "block_size": block_size, "kv_cache_dtype": kv_cache_dtype}))
        return ShardedKVCache(config, num_blocks, block_size, device, dtype, enable_prefix_caching, kv_cache_dtype)

    def _send(self, message: tuple) -> None:
        for rank, (conn, process) in enumerate(zip(self.conns, self.processes), start=1):
            if not process.is_alive():
                self._fail(self._worker_error())
            try:
                conn.send(message)
            except (BrokenPipeError, OSError):
                self._fail(f"worker rank {rank} is gone ({self._worker_error()})")

    @torch.inference_mode()
    def forward(self, model: Transformer, cache: ShardedKVCache, seq_ids: Sequence[Hashable],
                token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """`paged_forward` on every rank at once: the logits of each row's last new token, [len(seq_ids), vocab].

        Rank 0 prepares the step (allocating its blocks), sends the workers its inputs and the block copies made
        since the last step, then runs its own shard; the all-reduces inside make the ranks wait for each other.
        """
        if self.broken:
            raise TensorParallelError(f"this tensor-parallel group failed earlier ({self.broken}): start a new engine.")
        view = cache.prepare(seq_ids, token_ids)
        copies, cache.pending_copies = cache.pending_copies, []
        self._send(("step", copies, view.inputs.data.cpu().numpy(), view.T, view.context_lens, view.num_new))
        self.gate.in_step = True
        try:
            return model(view.tokens, cache=view, last_only=True)[:, -1]
        except RuntimeError as error:  # a collective failed: a worker is gone
            if isinstance(error, TensorParallelError):
                raise
            self._fail(f"{self._worker_error()} ({error})")
        finally:
            self.gate.in_step = False

    def shutdown(self) -> None:
        """Stop the workers and end the process group (idempotent; also run at exit)."""
        atexit.unregister(self.shutdown)
        stop_workers(self.conns, self.processes)
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []
        if dist.is_initialized():
            dist.destroy_process_group()
