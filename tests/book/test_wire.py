"""The sandbox's boundary carries values, never objects (issue 55): what a test hands an answer is rebuilt from
plain data in the sandbox, read with `weights_only`, and anything else is the test's error, said in the grader."""

from __future__ import annotations

import io

import pytest
import torch

from minillm.arithmetic import MLAConfig
from minillm.book.grading.wire import WireError, decode, encode, from_data, to_data
from minillm.config import ModelConfig
from minillm.model import Transformer
from minillm.sampler.constrained import RegexDFA


def through_the_pipe(x: object) -> object:
    """encode, torch.save, torch.load(weights_only=True), decode: what the sandbox receives."""
    buffer = io.BytesIO()
    torch.save(encode(x), buffer)
    buffer.seek(0)
    return decode(torch.load(buffer, weights_only=True))


def test_a_model_a_config_and_an_automaton_arrive_as_themselves():
    torch.manual_seed(0)
    config = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=32,
                         tie_embeddings=True)
    model = Transformer(config).to(torch.bfloat16).eval()
    dfa = RegexDFA("[0-9]{2}-[a-z]+")
    mla = MLAConfig("tiny", n_layers=4, n_heads=8, head_dim=16, kv_lora_rank=64, rope_head_dim=16)
    got_model, got_config, got_dfa, got_mla, small = through_the_pipe((model, config, dfa, mla, [b"", b"\xff", "é"]))
    assert type(got_model) is Transformer and not got_model.training and got_model.dtype == torch.bfloat16
    assert got_model.lm_head.weight is got_model.embed_tokens.weight  # tied, as the original
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(got_model(tokens), model(tokens))
    assert got_config == config and got_mla == mla and small == [b"", b"\xff", "é"]
    assert got_dfa.walk(got_dfa.start, b"12-") == dfa.walk(dfa.start, b"12-") and got_dfa.matches("12-ab")
    assert not got_dfa.matches("1-ab") and got_dfa.n_states == dfa.n_states


def test_views_stay_views_and_plain_tensors_stay_plain():
    class Marked(torch.Tensor):
        pass

    base = torch.arange(6.0)
    view, marked = base[2:], torch.ones(2).as_subclass(Marked)
    got_base, got_view, got_marked = through_the_pipe((base, view, marked))
    got_view[0] = -1.0  # an answer that writes through a view writes the base, as it would have here
    assert got_base[2] == -1.0 and type(got_marked) is torch.Tensor


def test_anything_else_is_the_tests_error_named_in_the_grader():
    with pytest.raises(WireError, match="cannot be sent to the sandbox as a value"):
        encode({"fn": print})
    with pytest.raises(WireError, match="numpy"):
        encode([__import__("numpy").zeros(2)])


def test_what_comes_back_is_plain_data_and_bytes_survive():
    assert from_data(to_data({"b": b"", "t": (1, 2.5)})) == {"b": b"", "t": (1, 2.5)}
