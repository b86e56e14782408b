"""Perplexity, and a chi-squared test of a sampler (chapters 03 and 07).

    ppl = perplexity(model, val_ids)    # exp(mean next-token cross-entropy), lower is better
    chi_squared_test(counts, probs)     # (statistic, degrees of freedom, p-value): do the counts fit probs?

Perplexity is e^(loss): the number of equally likely tokens the model is, on average, choosing
between. It is measured exactly as the shipped models' cards measure it (`minillm.train.loop`): the
first `max_windows` non-overlapping windows of `seq_len` + 1 tokens of the validation split, each
window scored from its own start (no context carried across windows).
"""

from __future__ import annotations

import math

import torch

from minillm.model import Transformer
from minillm.train.loop import batches_for_eval, evaluate


def perplexity(
    model: Transformer, ids: torch.Tensor, seq_len: int = 256, max_windows: int = 256, batch_size: int = 32
) -> float:
    """exp(mean next-token cross-entropy) of `model` over token ids [n_tokens] (chapter 03).

    Scores the first min(max_windows, (n_tokens - 1) // seq_len) windows of seq_len + 1 tokens of
    `ids`, in fp32 on a CPU (bf16 autocast on CUDA). With the defaults and the validation split of
    `python -m minillm.train.loop prepare`, this is the number in the shipped models' cards
    (65,536 scored tokens). Pass the validation split: perplexity on training text flatters.
    """
    if len(ids) < seq_len + 1:
        raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, got {len(ids)}; lower seq_len.")
    return math.exp(evaluate(model, batches_for_eval(ids, seq_len, max_windows), batch_size))


def chi_squared_test(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's chi-squared goodness-of-fit test: are `counts` [V] plausibly draws from `probs` [V]? (chapter 07)

    The bins expected to hold the fewest draws are pooled into one until it expects `min_expected`
    (the usual condition for the chi-squared approximation to hold). Then
    statistic = sum (observed - expected)^2 / expected over the bins, with bins - 1 degrees of freedom,
    and p-value = P(chi2 >= statistic) = Q(dof / 2, statistic / 2),
    the regularised upper incomplete gamma function. A small p-value (say < 0.01) says the counts do
    not come from probs. A draw in a bin of probability 0 makes the p-value 0.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if counts.shape != probs.shape:
        raise ValueError(f"counts and probs need one entry per outcome: got {counts.numel()} and {probs.numel()}.")
    n = counts.sum()
    if n <= 0:
        raise ValueError("no draws to test: counts sum to 0.")
    if (counts[probs == 0] > 0).any():
        return float("inf"), 0, 0.0
    expected = probs / probs.sum() * n
    order = expected.argsort()  # the smallest bins first: pool them until the pool expects min_expected draws
    expected, counts = expected[order], counts[order]
    m = int((expected < min_expected).sum())
    while 0 < m < len(expected) and expected[:m].sum() < min_expected:
        m += 1
    if m > 1:
        expected = torch.cat([expected[:m].sum()[None], expected[m:]])
        counts = torch.cat([counts[:m].sum()[None], counts[m:]])
    keep = expected > 0
    observed, expected = counts[keep], expected[keep]
    dof = observed.numel() - 1
    if dof < 1:
        raise ValueError("fewer than two bins with draws expected: draw more samples.")
    statistic = float(((observed - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, dof, p_value
