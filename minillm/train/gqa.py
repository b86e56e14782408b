"""From multi-head to grouped-query attention: pool a checkpoint's K/V heads, then uptrain (chapter 03).

    gqa = convert_kv_heads(model, n_kv_heads=2)            # mean-pool each group of K/V heads into one
    gqa, losses = uptrain(gqa, train_ids, n_steps=40)       # recover quality with a little training
    minillm.save(gqa, "folder", tokenizer)                  # config.json says num_key_value_heads = 2

The recipe is Ainslie et al., 2023, "GQA: Training Generalized Multi-Query Transformer Models from
Multi-Head Checkpoints" (arXiv:2305.13245), section 2.1: the key and value projection matrices of
each group of heads are mean-pooled into one, then the model is pre-trained a little longer (the
paper uses 5% of the original pre-training steps) so that it adapts to the shared heads.

Where the heads live. minillm stacks the q, k and v projections into one `qkv_proj` of
n_heads + 2 n_kv_heads blocks of head_dim rows, [q heads | k heads | v heads]; inside the k (and v)
block, head j is rows j*head_dim .. (j+1)*head_dim - 1. Query head i reads K/V head i // G with
G = n_heads // n_kv_heads (`model.grouped_query_attention`), so the query heads of a group are
consecutive, and so are the K/V heads that a coarser grouping merges: going from H_kv to h_kv heads
pools r = H_kv / h_kv consecutive heads, and query head i, which read old head i // G, now reads new
head i // (G r) = (i // G) // r, the pool its old head went into. MHA is the case H_kv = n_heads.

Measured on the shipped target (8 query heads, 2 K/V heads; benchmarks/gqa_quality.py): pooling to
MQA raises validation perplexity from 45.7 to 88.6; the default uptraining (0.1% of pre-training's
tokens) brings it to 53.1, the paper's 5% to 43.6, while the same training of the unconverted model
gives 44.7 and 44.2 (results/gqa_quality/cpu.json, results/gqa_quality/cuda.json).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from minillm.checkpoints import build_model, to_checkpoint_names
from minillm.model import Transformer
from minillm.train.loop import TrainSettings, add_dropout, lr_at, make_optimizer, sample_batch, train_step

# Uptraining defaults, sized to run in about a minute on a 2-core CPU: 40 steps of 4 x 256 tokens
# = 40,960 tokens. The shipped target (minillm/models/shakespeare-11m/training.json) was trained
# for 5000 steps of 32 x 256 tokens (41.0M tokens) and kept the weights of step 1900 (15.6M tokens),
# so the default is 0.8% of its steps but, with an 8x smaller batch, 0.1% of its scheduled tokens
# and 0.26% of the tokens its weights saw -- far below the paper's 5%. The small batch wants a small
# learning rate: 1e-4 (3e-4 suits batches of 32; results/gqa_quality/*.json hold both runs).
UPTRAIN_STEPS = 40
UPTRAIN_SETTINGS = TrainSettings(steps=UPTRAIN_STEPS, batch_size=4, seq_len=256, lr=1e-4, min_lr=1e-5,
                                 warmup=10, weight_decay=0.1, dropout=0.0, seed=0)


def valid_kv_heads(n_kv_heads: int) -> list[int]:
    """Head counts that `n_kv_heads` K/V heads can be pooled into: its divisors, ascending (chapter 03).

    Every divisor of the current n_kv_heads also divides n_heads, since n_kv_heads does.
    """
    return [d for d in range(1, n_kv_heads + 1) if n_kv_heads % d == 0]


def pool_heads(x: torch.Tensor, n_out: int) -> torch.Tensor:
    """Mean of each run of consecutive heads along dim 0 (chapter 03).

    x [n_in, head_dim, ...] (a projection's rows or bias, split by head) -> [n_out, head_dim, ...],
    where out[j] = mean(x[j*r : (j+1)*r]) with r = n_in // n_out. Averaged in fp32, returned in x's dtype.
    """
    n_in = x.shape[0]
    if n_in % n_out:
        raise ValueError(f"cannot pool {n_in} heads into {n_out}: {n_out} does not divide {n_in}.")
    return x.float().reshape(n_out, n_in // n_out, *x.shape[1:]).mean(1).to(x.dtype)


def convert_kv_heads(model: Transformer, n_kv_heads: int) -> Transformer:
    """A copy of `model` whose attention has `n_kv_heads` K/V heads, each the mean of a group (chapter 03).

    The K heads of every layer, H_kv of them in `model`, are split into n_kv_heads groups of
    r = H_kv / n_kv_heads consecutive heads, and each group's rows of the key projection
    (a [r, head_dim, dim] block of weights) are averaged into one head's [head_dim, dim]; the
    same for V, and for the k and v biases when the model has them (qkv_bias, Qwen2). Queries,
    o_proj, MLPs, norms and embeddings are copied unchanged. `model` is not modified; the copy
    is on the same device, in the same dtype, in eval mode. n_kv_heads equal to the current count
    returns an identical copy; a GQA model converts to fewer heads the same way (4 -> 2 -> 1).

    Why pooling the weights is pooling the heads: without qk_norm, a K head is k_j = W_j x + b_j
    and the mean of the group's heads is (mean W_j) x + mean b_j, exactly what the pooled
    projection computes; and rotary embedding then rotates every head by the same position-
    dependent matrix R(pos), a linear map, so R(pos) mean(k_j) = mean(R(pos) k_j): pooling
    commutes with RoPE. The pooled key is the mean of the group's rotated keys; the pooled value
    is the mean of the group's values.

    qk_norm (Qwen3): `k_norm` is one RMSNorm weight [head_dim] shared by all K heads (as in
    `transformers`), so it is kept as it is, with no per-head weights to pool. RMSNorm divides
    each head by its own RMS, which is not linear, so with qk_norm the pooled head computes
    k_norm(mean W_j x), not mean(k_norm(W_j x)): exact when a group's heads are identical,
    an approximation otherwise, which uptraining then repairs like the rest of the pooling error.

    Args:
        model: a minillm `Transformer` with H_kv = model.config.n_kv_heads K/V heads.
        n_kv_heads: the K/V heads wanted; must divide H_kv (see `valid_kv_heads`).

    Returns:
        a new `Transformer` whose config differs only in n_kv_heads.
    """
    c = model.config
    valid = valid_kv_heads(c.n_kv_heads)
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads not in valid:
        more = " Pooling cannot add heads." if isinstance(n_kv_heads, int) and n_kv_heads > c.n_kv_heads else ""
        raise ValueError(
            f"n_kv_heads={n_kv_heads!r}: this model has {c.n_kv_heads} K/V heads for {c.n_heads} query heads, "
            f"and pooling merges equal groups of them, so n_kv_heads must divide {c.n_kv_heads}; "
            f"valid values are {', '.join(map(str, valid))}.{more}"
        )
    config = dataclasses.replace(c, n_kv_heads=n_kv_heads)
    tensors = to_checkpoint_names(model)  # q_proj / k_proj / v_proj as separate [out, dim] matrices
    for name, t in tensors.items():
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                          "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
            heads = t.reshape(c.n_kv_heads, c.head_dim, *t.shape[1:])  # [H_kv, head_dim, (dim)]
            tensors[name] = pool_heads(heads, n_kv_heads).reshape(n_kv_heads * c.head_dim, *t.shape[1:])
    return build_model(config, tensors, model.device, model.dtype)


def uptrain(
    model: Transformer,
    train_ids: torch.Tensor,
    n_steps: int = UPTRAIN_STEPS,
    settings: TrainSettings | None = None,
    progress: bool = False,
) -> tuple[Transformer, list[float]]:
    """Continue training a copy of `model` on training tokens for `n_steps` steps (chapter 03).

    The short "uptraining" of Ainslie et al. (2023) that lets a converted model adapt to its
    pooled K/V heads. It is `minillm.train.loop`'s loop: random windows of the token stream
    (`sample_batch`), AdamW with decay on matrices (`make_optimizer`), linear warm-up then cosine
    decay (`lr_at`), gradient clipping (`train_step`), optional dropout (`add_dropout`). Seeded:
    on a CPU the same arguments give the same weights. `model` is not modified: a copy is trained
    in fp32 on the model's device (bf16 autocast on CUDA) and returned in eval mode, in fp32.

    Args:
        model: the model to start from (typically the output of `convert_kv_heads`).
        train_ids: [n_tokens] int64, the TRAINING split of the corpus. Never pass validation
            tokens: the perplexity that judges the conversion is measured on them.
        n_steps: optimiser steps (overrides `settings.steps`); the default, `UPTRAIN_STEPS` = 40,
            is 0.8% of the shipped target's 5000 pre-training steps and, with an 8x smaller batch,
            0.1% of its pre-training tokens (the paper uptrains for 5%; see `UPTRAIN_SETTINGS`).
        settings: batch size, sequence length, learning-rate schedule, weight decay, dropout and
            seed; default `UPTRAIN_SETTINGS`.
        progress: show a progress bar.

    Returns:
        (trained copy, the training loss of each step's batch before its update [n_steps]).
    """
    from tqdm.auto import tqdm

    s = dataclasses.replace(settings or UPTRAIN_SETTINGS, steps=n_steps)
    if n_steps < 0:
        raise ValueError(f"n_steps must be >= 0, got {n_steps}.")
    if len(train_ids) < s.seq_len + 2:
        raise ValueError(f"train_ids has {len(train_ids)} tokens; a window needs seq_len + 2 = {s.seq_len + 2}.")
    torch.manual_seed(s.seed)
    model = copy.deepcopy(model).float()
    hooks = add_dropout(model, s.dropout) if s.dropout > 0 else []
    optimizer = make_optimizer(model, s)
    gen = torch.Generator().manual_seed(s.seed)
    losses = []
    for step in tqdm(range(n_steps), desc="uptraining", disable=not progress):
        losses.append(train_step(model, optimizer, sample_batch(train_ids, s, gen), lr_at(step, s)))
    for h in hooks:
        h.remove()
    return model.eval(), [loss.item() for loss in losses]
