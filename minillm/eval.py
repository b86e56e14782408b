"""Quality gates: how much a change to the model (fewer KV heads, fewer bits) costs in quality (chapter 03).

    ppl = perplexity(model, val_ids)    # exp(mean next-token cross-entropy), lower is better

Perplexity is e^(loss): the number of equally likely tokens the model is, on average, choosing
between. It is measured exactly as the shipped models' cards measure it (`minillm.train`): the
first `max_windows` non-overlapping windows of `seq_len` + 1 tokens of the validation split, each
window scored from its own start (no context carried across windows).
"""

from __future__ import annotations

import math

import torch

from minillm.model import Transformer
from minillm.train import batches_for_eval, evaluate


def perplexity(
    model: Transformer, ids: torch.Tensor, seq_len: int = 256, max_windows: int = 256, batch_size: int = 32
) -> float:
    """exp(mean next-token cross-entropy) of `model` over token ids [n_tokens] (chapter 03).

    Scores the first min(max_windows, (n_tokens - 1) // seq_len) windows of seq_len + 1 tokens of
    `ids`, in fp32 on a CPU (bf16 autocast on CUDA). With the defaults and the validation split of
    `python -m minillm.train prepare`, this is the number in the shipped models' cards
    (65,536 scored tokens). Pass the validation split: perplexity on training text flatters.
    """
    if len(ids) < seq_len + 1:
        raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, got {len(ids)}; lower seq_len.")
    return math.exp(evaluate(model, batches_for_eval(ids, seq_len, max_windows), batch_size))
