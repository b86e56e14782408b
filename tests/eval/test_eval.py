"""minillm.eval: perplexity is e^(mean next-token cross-entropy) over windows of the token stream."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minillm import ModelConfig, Transformer
from minillm.eval import perplexity


def test_perplexity_is_exp_of_the_mean_cross_entropy_of_its_windows():
    """Two windows of 16 + 1 tokens from the start of the stream, scored independently."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, ffn_dim=64, vocab_size=50)).eval()
    ids = torch.randint(0, 50, (100,))
    windows = torch.stack([ids[0:17], ids[16:33]])
    with torch.no_grad():
        logits = model(windows[:, :-1])
    expected = math.exp(F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item())
    assert perplexity(model, ids, seq_len=16, max_windows=2) == pytest.approx(expected, rel=1e-5)


def test_a_model_that_knows_nothing_has_the_vocabulary_size_as_perplexity():
    """Uniform next-token probabilities 1/V give perplexity V: zero output head, zero logits."""
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, ffn_dim=64, vocab_size=50)).eval()
    torch.nn.init.zeros_(model.lm_head.weight)
    assert perplexity(model, torch.randint(0, 50, (65,)), seq_len=16) == pytest.approx(50, rel=1e-5)
    with pytest.raises(ValueError, match="at least seq_len"):
        perplexity(model, torch.arange(10), seq_len=16)
