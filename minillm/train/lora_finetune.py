"""Train a LoRA adapter with the base model frozen, and the shipped one (chapter 08).

LoRA (Hu et al., 2021) learns, for each chosen projection W [out, in], two small matrices

    A [r, in]   small random (PEFT's default: uniform in +-1/sqrt(in))
    B [out, r]  zeros, so that at step 0 the model is exactly the base model

and computes y = x W^T + s * (x A^T) B^T, s = alpha / r. Only A and B get gradients; W never changes, so
the result is a `LoRAAdapter` that `save_adapter` writes in PEFT's format.

Here the update is added by forward hooks on minillm's stacked projections (q|k|v in `qkv_proj`, gate|up in
`gate_up_proj`; `target_rows` says which rows), so the model's code is untouched; the hooks are removed when
training ends.

The shipped adapter `minillm/models/shakespeare-11m-lora-menenius` is Menenius's speeches in Coriolanus, a play
the base model never trained on (it is in the corpus's validation split, of which the package ships the first
80,000 characters: `minillm/data/shakespeare_val.txt`). It is reproduced by

    python -m minillm.train.lora_finetune minillm/models/shakespeare-11m-lora-menenius
"""

from __future__ import annotations

import math
import random
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from minillm.lora.adapter import LoRAAdapter, target_rows

CHARACTER, HELD_OUT, SPLIT_SEED = "MENENIUS", 0.1, 0  # the shipped adapter's data
SHIPPED = "shakespeare-11m-lora-menenius"


def character_speeches(text: str, character: str) -> list[str]:
    """Every speech of `character` in a play's text: a block whose first line is "CHARACTER." (the corpus's
    modern-spelling editions), returned as "CHARACTER.\\n<the speech>" so a prompt "CHARACTER.\\n" cues it."""
    speeches = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").split("\n")
        if len(lines) > 1 and lines[0].strip() == f"{character}.":
            speeches.append("\n".join([f"{character}.", *lines[1:]]))
    return speeches


def split_speeches(speeches: Sequence[str], held_out: float = HELD_OUT, seed: int = SPLIT_SEED
                   ) -> tuple[list[str], list[str]]:
    """(train, held-out): a seeded shuffle, `held_out` of the speeches (at least one) kept aside."""
    order = list(range(len(speeches)))
    random.Random(seed).shuffle(order)
    n = max(1, round(held_out * len(speeches)))
    return [speeches[i] for i in sorted(order[n:])], [speeches[i] for i in sorted(order[:n])]


def shipped_speeches() -> tuple[list[str], list[str]]:
    """(train, held-out) speeches of the shipped adapter: Menenius in the packaged Coriolanus sample."""
    from minillm.quant.calibration import sample_text

    return split_speeches(character_speeches(sample_text("val"), CHARACTER))


def _padded(seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [B, T], targets [B, T]) for next-token prediction; targets past a sequence's end are -100."""
    T = max(len(s) for s in seqs) - 1
    inputs = torch.zeros(len(seqs), T, dtype=torch.long)
    targets = torch.full((len(seqs), T), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        inputs[i, : len(s) - 1] = torch.tensor(s[:-1])
        targets[i, : len(s) - 1] = torch.tensor(s[1:])
    return inputs, targets


@torch.no_grad()
def sequence_perplexity(model: nn.Module, seqs: Sequence[Sequence[int]], batch_size: int = 16) -> float:
    """exp(mean next-token cross-entropy) over every predicted token of `seqs` (lists of ids, each with its BOS)."""
    total, count = 0.0, 0
    for i in range(0, len(seqs), batch_size):
        inputs, targets = _padded(seqs[i : i + batch_size])
        logits = model(inputs.to(model.device)).float()
        total += F.cross_entropy(logits.flatten(0, 1), targets.to(logits.device).flatten(), reduction="sum").item()
        count += int((targets != -100).sum())
    return math.exp(total / count)


def _hook(first: int, n: int, a: torch.Tensor, b: torch.Tensor, scale: float):  # noqa: ANN202 - a forward hook
    def add_update(module: nn.Module, inputs: tuple[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        update = scale * (inputs[0] @ a.T) @ b.T  # [B, T, n]: this target's rows of the output
        return out + F.pad(update, (first, out.shape[-1] - first - n))
    return add_update


def train_lora(model: nn.Module, seqs: Sequence[Sequence[int]], targets: Sequence[str] = ("q_proj", "v_proj"),
               rank: int = 8, alpha: float = 16, steps: int = 60, lr: float = 1e-3, batch_size: int = 8,
               weight_decay: float = 0.0, seed: int = 0, base_model: str | None = None) -> LoRAAdapter:
    """Train a LoRA adapter on token sequences `seqs` (lists of ids) with `model` frozen (chapter 08).

    Every layer gets A [rank, in] (uniform in +-1/sqrt(in), as PEFT initialises it) and B [out, rank] = 0 for each
    PEFT target in `targets`; AdamW minimises next-token cross-entropy over random batches of `batch_size`
    sequences, with a cosine learning rate. Seeded (initialisation and batch order). Returns the adapter, fp32,
    for `save_adapter` (PEFT's format) or `merge_adapter`.
    """
    from minillm.train.loop import pytorch_attention

    gen = torch.Generator().manual_seed(seed)
    rows, device = target_rows(model.config), model.device
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(model.config.n_layers):
        for target in targets:
            _, _, n, d_in = rows[target]
            a = ((torch.rand(rank, d_in, generator=gen) * 2 - 1) / math.sqrt(d_in)).to(device).requires_grad_()
            weights[layer, target] = (a, torch.zeros(n, rank, device=device, requires_grad=True))
    scale = alpha / rank
    handles = []
    for (layer, target), (a, b) in weights.items():
        name, first, n, _ = rows[target]
        module = model.layers[layer].get_submodule(name)
        handles.append(module.register_forward_hook(_hook(first, n, a, b, scale)))
    frozen = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    params = [t for pair in weights.values() for t in pair]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    try:
        model.train()
        with pytorch_attention():
            for step in range(steps):
                for group in optimizer.param_groups:
                    group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
                pick = torch.randint(len(seqs), (batch_size,), generator=gen).tolist()
                inputs, tgt = _padded([seqs[i] for i in pick])
                logits = model(inputs.to(device)).float()
                loss = F.cross_entropy(logits.flatten(0, 1), tgt.to(device).flatten())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    finally:
        for handle in handles:
            handle.remove()
        for p, grad in zip(model.parameters(), frozen):
            p.requires_grad_(grad)
        model.eval()
    return LoRAAdapter(rank, float(alpha), {k: (a.detach().cpu(), b.detach().cpu()) for k, (a, b) in weights.items()},
                       base_model=base_model, config={"lora_dropout": 0.0})


def train_shipped(out: str | Path) -> dict:
    """Train the shipped Menenius adapter and write it (PEFT's format) to `out`; returns the measured numbers."""
    import minillm
    from minillm.lora.adapter import merge_adapter, save_adapter, unmerge_adapter

    torch.manual_seed(0)
    model, tokenizer = minillm.load(minillm.DEFAULT_MODEL, dtype=torch.float32)
    train_text, held_text = shipped_speeches()
    train_ids, held_ids = ([tokenizer.encode(s) for s in part] for part in (train_text, held_text))
    start = time.perf_counter()
    adapter = train_lora(model, train_ids, base_model=minillm.DEFAULT_MODEL, **SETTINGS)
    seconds = time.perf_counter() - start
    base_ppl = sequence_perplexity(model, held_ids)
    merge_adapter(model, adapter)
    lora_ppl, train_ppl = sequence_perplexity(model, held_ids), sequence_perplexity(model, train_ids)
    unmerge_adapter(model, adapter)
    save_adapter(adapter, out)
    return {"train_speeches": len(train_ids), "held_out_speeches": len(held_ids),
            "train_tokens": sum(map(len, train_ids)), "held_out_tokens": sum(map(len, held_ids)),
            "seconds": round(seconds, 1), "held_out_ppl_base": round(base_ppl, 2),
            "held_out_ppl_lora": round(lora_ppl, 2), "train_ppl_lora": round(train_ppl, 2), **SETTINGS}


SETTINGS = {"targets": ("q_proj", "v_proj"), "rank": 8, "alpha": 16, "steps": 60, "lr": 1e-3, "batch_size": 8,
            "seed": 0}

if __name__ == "__main__":
    torch.set_num_threads(2)
    print(train_shipped(sys.argv[1] if len(sys.argv) > 1 else SHIPPED))
