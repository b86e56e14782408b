"""minillm/train/loop.py runs end to end on a tiny setting, and its loss goes down."""

from __future__ import annotations

import torch
from conftest import TEXT

from minillm import ModelConfig
from minillm.checkpoints import load, save
from minillm.train.loop import TrainSettings, encode_works, fit, greedy_agreement, lr_at, train_tokenizer


def test_tiny_training_run_lowers_the_loss(tmp_path):
    """Tokenizer + 60 steps of a tiny model on CPU: validation loss falls; the result saves and loads."""
    tok = train_tokenizer([TEXT], vocab_size=300)
    ids = encode_works(tok, [TEXT] * 3)
    config = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=tok.vocab_size,
                         max_seq_len=128, tie_embeddings=True, bos_token_id=0, eos_token_id=1)
    settings = TrainSettings(steps=60, batch_size=8, seq_len=32, lr=3e-3, warmup=5, eval_every=20, dropout=0.1)
    model, log = fit(config, ids, ids, settings, progress=False)
    assert len(log) == 3
    assert log[-1]["val_loss"] < log[0]["val_loss"] - 0.3, f"loss did not fall: {log}"
    assert not model._forward_hooks and not model.embed_tokens._forward_hooks, "dropout hooks must be removed"
    save(model, tmp_path / "m", tok)
    loaded, loaded_tok = load(tmp_path / "m")
    w = ids[:33][None]
    torch.testing.assert_close(loaded(w), model(w))
    assert greedy_agreement(loaded, model, w) == 1.0


def test_learning_rate_schedule_warms_up_then_decays():
    s = TrainSettings(steps=100, lr=1e-3, min_lr=1e-4, warmup=10)
    assert lr_at(0, s) < lr_at(9, s) == 1e-3
    assert abs(lr_at(99, s) - 1e-4) < 1e-5
