"""How far a changed model's next-token distributions moved from a reference model's (chapter 09).

Perplexity and task accuracy average over many tokens and can hide a change that moves individual
predictions. Two direct measures, teacher-forced over the same token windows:

- `top1_agreement`: the share of positions where both models' most likely next token is the same;
- `kl_divergence`: the mean over positions of KL(reference || model) = sum_v p_ref(v) (log p_ref(v) - log p(v)),
  in nats: zero when the distributions are equal, and what a quantised or pruned model loses, token by token.

    scores = agreement(quantised, reference, val_ids)    # {"top1_agreement": 0.97, "kl_divergence": 0.01, ...}
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minillm.model import Transformer
from minillm.train.loop import batches_for_eval


@torch.no_grad()
def agreement(model: Transformer, reference: Transformer, ids: torch.Tensor, seq_len: int = 256,
              max_windows: int = 16, batch_size: int = 8) -> dict[str, float]:
    """top1_agreement and kl_divergence (nats, mean per position) of `model` against `reference` over the first
    `max_windows` windows of `seq_len` tokens of `ids` [n_tokens] (each window scored from its own start)."""
    if model.config.vocab_size != reference.config.vocab_size:
        raise ValueError(f"the models' vocabularies differ ({model.config.vocab_size} and "
                         f"{reference.config.vocab_size} tokens): compare models with the same tokenizer.")
    if len(ids) < seq_len + 1:
        raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, got {len(ids)}; lower seq_len.")
    windows = batches_for_eval(ids, seq_len, max_windows)[:, :-1]
    model.eval()
    reference.eval()
    same, kl, positions = 0, 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size]
        log_p = F.log_softmax(model(w.to(model.device)).float().cpu(), dim=-1)  # [B, T, V]
        log_q = F.log_softmax(reference(w.to(reference.device)).float().cpu(), dim=-1)
        same += (log_p.argmax(-1) == log_q.argmax(-1)).sum().item()
        kl += (log_q.exp() * (log_q - log_p)).sum().item()
        positions += w.numel()
    return {"top1_agreement": same / positions, "kl_divergence": kl / positions, "positions": positions}
