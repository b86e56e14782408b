"""minillm.eval.long_context (chapter 09): the key-value lookup's sequences are what its docstring says, and RoPE
rescaling at inference changes nothing at factor 1 and only the rotary frequencies otherwise."""

from __future__ import annotations

import torch

from minillm.eval.long_context import NEEDLE, QUERY, LookupSettings, make_batch, rescaled
from minillm.model import Transformer


def test_a_lookup_plants_every_needle_and_queries_each_once():
    s = LookupSettings(n_pairs=3)
    tokens, targets, depths = make_batch(s, 8, 70, torch.Generator().manual_seed(0))
    assert tokens.shape == targets.shape == (8, 70) and tokens[:, 0].eq(1).all()
    for b in range(8):
        row = tokens[b].tolist()
        needles = {row[i + 1]: row[i + 2] for i, t in enumerate(row[:-2]) if t == NEEDLE}
        queries = [row[i + 1] for i, t in enumerate(row[:-1]) if t == QUERY]
        assert len(needles) == 3 and sorted(queries) == sorted(needles), "each planted key is queried once"
        assert row[-2] == QUERY and targets[b, -1].item() == needles[row[-1]], "the last column is the answer"
        answered = [(i, v) for i, v in enumerate(targets[b].tolist()) if v != -100]
        assert [v for _, v in answered] == [needles[row[i]] for i, _ in answered], "each target follows its key"
        assert 0.0 <= depths[b] <= 1.0


def test_the_asked_needle_sits_at_the_requested_depth():
    s = LookupSettings()
    for depth, where in ((0.0, 1), (1.0, None)):
        tokens, _, depths = make_batch(s, 4, 64, torch.Generator().manual_seed(1), depth=depth)
        for b in range(4):
            row = tokens[b].tolist()
            at = row.index(row[-1])  # the asked-for key's first occurrence: its needle
            assert row[at - 1] == NEEDLE and depths[b].item() == depth
            if where is not None:
                assert at - 1 == where
    try:
        make_batch(s, 1, 8, torch.Generator())
    except ValueError as e:
        assert "too short" in str(e)
    else:
        raise AssertionError("a length with no room for the needles must be refused")


def test_rescaling_is_the_identity_at_factor_one_and_only_moves_rotary_otherwise():
    s = LookupSettings()
    torch.manual_seed(0)
    model = Transformer(s.config(max_seq_len=s.train_len)).eval()
    tokens, _, _ = make_batch(s, 2, 64, torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = model(tokens)
        for kind in ("none", "linear", "ntk", "yarn", "llama3"):
            torch.testing.assert_close(rescaled(model, kind, 1.0)(tokens), base, rtol=1e-5, atol=1e-5)
        stretched = rescaled(model, "linear", 4.0)
        assert stretched.config.max_seq_len == 4 * s.train_len
        assert not torch.allclose(stretched(tokens), base), "a factor of 4 must change the rotary angles"
        assert torch.equal(stretched.embed_tokens.weight, model.embed_tokens.weight), "the weights are shared"
