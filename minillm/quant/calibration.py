"""Calibration data and the activations it produces, for the quantisation methods of chapter 06.

GPTQ, AWQ and SmoothQuant look at what flows *into* each linear layer on real text: GPTQ at the
inputs' second moments (the Hessian of the layer's squared error), AWQ and SmoothQuant at each
input channel's typical and largest magnitude. That text is the *calibration set*. It must come
from the training split: calibrating on the validation text and then measuring perplexity on it
would let the method fit the test.

Two samples of the shipped models' corpus travel with the package, so that chapter 06 runs offline:

    minillm/data/shakespeare_train.txt   40 passages of ~3,000 characters, evenly spaced through the
                                         training split (39k tokens): the calibration set
    minillm/data/shakespeare_val.txt     the first 80,000 characters of the validation split (27k
                                         tokens): its first 64 windows of 256 tokens are the first 64
                                         of the 256 the model cards score

    ids = calibration_ids(tokenizer, n_seqs=32, seq_len=256)   # [32, 256] from the training sample
    val = validation_ids(tokenizer)                            # [n_tokens] for minillm.eval.perplexity
    xs = capture_inputs(model, ids, {"layers.0.mlp.down_proj": ...})   # {name: [n_tokens, in]}

The layer-by-layer methods see block i's inputs as the already quantised blocks before it produce them.
`BlockByBlock` walks the blocks in that order and runs each one once, on the hidden states the block
before it returned, where `capture_inputs` would run the whole model again for every block (30 forwards
of the calibration set for a 30-block model; about 2 this way).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from minillm.quant.linear import block_linears
from minillm.tokenizer import Tokenizer

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
SPLITS = {"train": "shakespeare_train.txt", "val": "shakespeare_val.txt"}


def sample_text(split: str) -> str:
    """The shipped sample of the corpus's "train" or "val" split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}.")
    return (DATA_DIR / SPLITS[split]).read_text()


def validation_ids(tokenizer: Tokenizer) -> torch.Tensor:
    """The validation sample as one stream of token ids, [n_tokens] int64 (for `minillm.eval.perplexity`)."""
    return torch.tensor(tokenizer.encode(sample_text("val")), dtype=torch.long)


def calibration_ids(tokenizer: Tokenizer, n_seqs: int = 32, seq_len: int = 256, seed: int = 0) -> torch.Tensor:
    """`n_seqs` windows of `seq_len` tokens at random places of the *training* sample, [n_seqs, seq_len] int64."""
    ids = torch.tensor(tokenizer.encode(sample_text("train")), dtype=torch.long)
    if seq_len >= len(ids):
        raise ValueError(f"seq_len must be below the training sample's {len(ids)} tokens, got {seq_len}.")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len, (n_seqs,), generator=g)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


@contextmanager
def recording_inputs(
    modules: dict[str, nn.Module],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.add,
) -> Iterator[dict[str, torch.Tensor]]:
    """While inside, record what enters each of `modules` (forward pre-hooks); on exit the yielded dict holds
    {name: inputs [n_rows, in_features] fp32}, or reduce(inputs of one call) combined over calls by `combine`."""
    found: dict[str, list[torch.Tensor] | torch.Tensor] = {name: [] for name in modules}

    def hook_for(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().float().reshape(-1, args[0].shape[-1]).cpu()
            if reduce is None:
                found[name].append(x)
            else:
                value = reduce(x)
                found[name] = value if isinstance(found[name], list) else combine(found[name], value)

        return hook

    result: dict[str, torch.Tensor] = {}
    handles = [module.register_forward_pre_hook(hook_for(name)) for name, module in modules.items()]
    try:
        yield result
    finally:
        for handle in handles:
            handle.remove()
    result.update({name: torch.cat(v) if isinstance(v, list) else v for name, v in found.items()})


@torch.no_grad()
def capture_inputs(
    model: nn.Module,
    ids: torch.Tensor,
    modules: dict[str, nn.Module],
    batch_size: int = 8,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.add,
) -> dict[str, torch.Tensor]:
    """Run `model` over ids [n_seqs, seq_len] and record what enters each of `modules`.

    Returns {name: inputs [n_seqs * seq_len, in_features] fp32}, or, with `reduce`, reduce(inputs of
    one batch) combined over batches by `combine` (default: summed; e.g. X^T X for GPTQ, so that the
    inputs never all sit in memory; or the per-channel absmax with combine=torch.maximum).
    """
    device = next(model.parameters()).device
    with recording_inputs(modules, reduce, combine) as found:
        for start in range(0, len(ids), batch_size):
            model(ids[start : start + batch_size].to(device))
    return found


def blocks_in_order(model: nn.Module) -> list[dict[str, nn.Linear]]:
    """The block linears grouped by transformer block, first block first (for layer-by-layer methods)."""
    by_block: dict[int, dict[str, nn.Linear]] = {}
    for name, linear in block_linears(model).items():
        index = int(name.split("layers.")[1].split(".")[0])
        by_block.setdefault(index, {})[name] = linear
    return [by_block[i] for i in sorted(by_block)]


class _StopForwardError(Exception):
    """Raised by a hook to end a forward once it has what it came for."""


@contextmanager
def _plain_blocks() -> Iterator[None]:
    """Run the blocks through their plain forward (the fused CUDA path calls `forward_fused`, which hooks miss)."""
    before = os.environ.get("MINILLM_FUSED")
    os.environ["MINILLM_FUSED"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MINILLM_FUSED", None)
        else:
            os.environ["MINILLM_FUSED"] = before


class BlockByBlock:
    """The calibration set's hidden states entering one transformer block after another (chapter 06).

        runner = BlockByBlock(model, ids)
        for block in blocks_in_order(model):
            xs = runner.capture(block)      # as capture_inputs(model, ids, block), same arguments
            ...                             # quantise the block's linears in place
            runner.advance()                # run the (now quantised) block: the next block's inputs

    Each block runs twice in all (once hooked, once to advance), on the states the previous block
    returned, so a pass over every block costs about two forwards of the calibration set.
    """

    def __init__(self, model: nn.Module, ids: torch.Tensor, batch_size: int = 8) -> None:
        layers = getattr(model, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise ValueError("BlockByBlock needs a model whose transformer blocks are `model.layers` "
                             "(an nn.ModuleList); use capture_inputs for others.")
        self.layers, self.index = layers, 0
        self.states: list[tuple[torch.Tensor, tuple]] = []  # per batch: (hidden [B, T, dim], the other arguments)

        def record(module: nn.Module, args: tuple) -> None:
            self.states.append((args[0], args[1:]))
            raise _StopForwardError

        handle = layers[0].register_forward_pre_hook(record)
        device = next(model.parameters()).device
        try:
            with torch.no_grad(), _plain_blocks():
                for start in range(0, len(ids), batch_size):
                    try:
                        model(ids[start : start + batch_size].to(device))
                    except _StopForwardError:
                        pass
        finally:
            handle.remove()

    def capture(
        self,
        modules: dict[str, nn.Module],
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.add,
    ) -> dict[str, torch.Tensor]:
        """What enters each of `modules` (all in the current block) when it runs; as `capture_inputs` returns it."""
        layer = self.layers[self.index]
        inside = {id(m) for m in layer.modules()}
        outside = [name for name, m in modules.items() if id(m) not in inside]
        if outside:
            raise ValueError(f"{outside} are not in block {self.index}, the block this runner is at.")
        with recording_inputs(modules, reduce, combine) as found, torch.no_grad(), _plain_blocks():
            for x, rest in self.states:
                layer(x, *rest)
        return found

    def advance(self) -> None:
        """Run the current block (as it is now, quantised or not) on its inputs: they become the next block's."""
        layer = self.layers[self.index]
        with torch.no_grad(), _plain_blocks():
            self.states = [(layer(x, *rest), rest) for x, rest in self.states]
        self.index += 1
