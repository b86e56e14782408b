"""minillm.eval.cached (chapter 09): teacher-forced scoring through the engine's quantised KV cache, a model with
key outliers that computes the same function, greedy agreement through the engine; and the lossy "typical"
acceptance rule of minillm.sampler.speculative that the gate should catch."""

from __future__ import annotations

import pytest
import torch

import minillm
from minillm.decoding.llm import LLM
from minillm.engine.draft_model import DraftModelDrafter
from minillm.eval import ThroughKVCache, agreement, cached_logits, greedy_agreement, greedy_tokens, with_key_outliers
from minillm.sampler.sampling import SamplingParams
from minillm.sampler.speculative import SpeculativeConfig, verify_greedy, verify_typical

PROMPTS = ["ROMEO.\nBut soft, what light", "KING HENRY.\nOnce more unto the breach", "JULIET.\n"]


@pytest.fixture(scope="module")
def shipped():
    return minillm.load(minillm.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def windows(shipped):
    _, tok = shipped
    text = ("ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
            "HAMLET.\nTo be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n") * 4
    ids = torch.tensor(tok.encode(text))
    return torch.stack([ids[:48], ids[10:58]])  # [2, 48]


def test_cached_scoring_with_auto_dtype_is_the_full_forward(shipped, windows):
    model, _ = shipped
    full = model(windows)
    for chunk in (None, 5):  # one prefill, or ten chunks of a prefill and its decode steps
        assert torch.allclose(cached_logits(model, windows, "auto", chunk=chunk), full, atol=1e-4)
    assert torch.allclose(ThroughKVCache(model)(windows), full, atol=1e-4)
    # int8 reads rounded keys and values back: the logits move, and chunking does not change what is read
    int8 = cached_logits(model, windows, "int8")
    assert (int8 - full).abs().max() > 1e-3
    assert (cached_logits(model, windows, "int8", chunk=7) - int8).abs().mean() < 1e-3


@pytest.mark.parametrize(("factor", "channels"), [(16.0, (0,)), (10.0, (3, 20))])
def test_key_outliers_keep_the_function(shipped, windows, factor, channels):
    model, _ = shipped
    before = model.layers[0].self_attn.qkv_proj.weight.clone()
    outliers = with_key_outliers(model, factor, channels)
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, before)  # a copy: the model is untouched
    assert torch.allclose(outliers(windows), model(windows), atol=1e-4)
    # ... but the keys now carry channels `factor` times larger
    cfg = model.config
    k_rows = slice(cfg.n_heads * cfg.head_dim, (cfg.n_heads + 1) * cfg.head_dim)
    old, new = before[k_rows], outliers.layers[0].self_attn.qkv_proj.weight[k_rows]
    assert torch.allclose(new[channels[0]], factor * old[channels[0]])
    assert torch.allclose(new[channels[0] + cfg.head_dim // 2], factor * old[channels[0] + cfg.head_dim // 2])
    with pytest.raises(ValueError, match="rotary pairs"):
        with_key_outliers(model, factor, (cfg.head_dim // 2,))


def test_int8_kv_hurts_the_model_with_key_outliers_more(shipped, windows):
    model, _ = shipped
    outliers = with_key_outliers(model, 16.0)
    full = model(windows)

    def error(m):
        return (cached_logits(m, windows, "int8") - full).abs().mean().item()

    assert error(outliers) > 3 * error(model)
    # fp8 keeps its relative precision whatever the scale: the outliers hardly matter to it
    fp8 = [(cached_logits(m, windows, "fp8") - full).abs().mean().item() for m in (model, outliers)]
    assert fp8[1] < 1.5 * fp8[0]
    # the same through a metric: agreement against the unchanged model, read through the quantised cache
    ids = windows.flatten()
    plain = agreement(ThroughKVCache(model, "int8"), model, ids, seq_len=32, max_windows=2)
    hurt = agreement(ThroughKVCache(outliers, "int8"), model, ids, seq_len=32, max_windows=2)
    assert hurt["kl_divergence"] > plain["kl_divergence"]


def test_typical_acceptance_accepts_what_exact_greedy_rejects():
    # the target's argmax is token 0 (0.5); the draft proposes token 1 (0.3): exact greedy rejects it
    p = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.1, 0.1, 0.7, 0.1]])
    assert verify_greedy(p.argmax(-1).tolist(), [1]) == [0]
    assert verify_typical(p, [1], greedy=True) == [1, 2]  # accepted, then the target's argmax after it
    assert verify_typical(p, [3], greedy=True) == [3, 2]  # 0.1 > min(0.09, 0.3 exp(-H)): plausible enough
    assert verify_typical(p, [3], greedy=True, epsilon=0.2, delta=0.5) == [0]  # stricter thresholds reject it
    assert verify_typical(p, [0], greedy=True) == [0, 2]  # the argmax always passes


def test_speculative_config_defaults_to_exact_acceptance():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    exact = SpeculativeConfig(drafter=None)
    assert exact.acceptance == "exact"
    assert exact.accept(logits, greedy, [], [], [1], None, None) == [0]  # the greedy rule: the draft is not the argmax
    typical = SpeculativeConfig(drafter=None, acceptance="typical")
    assert typical.accept(logits, greedy, [], [], [1], None, None) == [1, 2]
    with pytest.raises(ValueError, match="acceptance"):
        SpeculativeConfig(drafter=None, acceptance="lenient")
    with pytest.raises(ValueError, match="typical_delta"):
        SpeculativeConfig(drafter=None, acceptance="typical", typical_delta=1.0)


def test_greedy_agreement_sees_typical_acceptance_and_not_exact(shipped):
    model, tok = shipped
    draft, _ = minillm.load(minillm.DEFAULT_DRAFT)
    reference = greedy_tokens(LLM(model, tok), PROMPTS, 16)
    assert greedy_agreement(LLM(model, tok), reference, PROMPTS, 16)["greedy_match"] == 1.0

    def spec(acceptance):
        return LLM(model, tok, speculative=SpeculativeConfig(DraftModelDrafter(draft), 4, acceptance=acceptance))

    exact = greedy_agreement(spec("exact"), reference, PROMPTS, 16)
    assert exact["greedy_match"] == 1.0 and exact["greedy_prefix"] == 1.0
    typical = greedy_agreement(spec("typical"), reference, PROMPTS, 16)
    assert typical["greedy_match"] < 1.0 and typical["greedy_prefix"] < 1.0
