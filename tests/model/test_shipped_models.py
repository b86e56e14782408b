"""The models that ship with the book: they load in minillm and in transformers, agree, and generate."""

from __future__ import annotations

import json
import math

import pytest
import torch

import minillm
from minillm.checkpoints import SHIPPED_MODELS_DIR


def test_list_models_names_both_with_their_sizes():
    """list_models() gives every shipped folder with the parameter count of its weights, and the installed models."""
    from minillm.shipped import installed_models

    listed = minillm.list_models()
    sizes = {name: listed[name] for name in minillm.shipped_models()}
    assert set(sizes) == {minillm.DEFAULT_MODEL, minillm.DEFAULT_DRAFT}
    assert set(listed) - set(sizes) == set(installed_models())
    assert sizes[minillm.DEFAULT_MODEL] <= 12_000_000, "the target must stay under 12M parameters"
    assert sizes[minillm.DEFAULT_DRAFT] <= 2_000_000, "the draft must stay under 2M parameters"
    total = sum((SHIPPED_MODELS_DIR / n / "model.safetensors").stat().st_size for n in sizes)
    assert total <= 25e6, f"shipped weights are {total / 1e6:.1f} MB, the budget is 25 MB"


@pytest.mark.parametrize("name", [minillm.DEFAULT_MODEL, minillm.DEFAULT_DRAFT])
def test_shipped_model_matches_transformers(name):
    """The same folder loads in transformers and in minillm, with equal fp32 logits."""
    import transformers

    ours, tok = minillm.load(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_MODELS_DIR / name, dtype=torch.float32).eval()
    assert ours.num_parameters() == hf.num_parameters() == minillm.list_models()[name]
    ids = torch.tensor([tok.encode("ROMEO.\nBut soft, what light through yonder window breaks?")])
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    err = (got - expected).abs().max().item()
    assert err <= 1e-4 * max(1.0, expected.abs().max().item()), f"max |Δ logits| = {err:.2e}"


def test_tokenizer_round_trips_text():
    """encode then decode gives the text back, with <s> prepended and dropped again."""
    _, tok = minillm.load(minillm.DEFAULT_MODEL)
    text = "KING LEAR.\nBlow, winds, and crack your cheeks! rage! blow!\n  — naïve café 東京 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 0 and tok.eos_token_ids == [1]
    assert tok.decode(ids) == text
    assert tok.vocab_size == 4096


def test_model_cards_report_the_quality_bar():
    """Each folder has a model card; the target's validation loss is below the draft's."""
    stats = {n: json.loads((SHIPPED_MODELS_DIR / n / "training.json").read_text())
             for n in (minillm.DEFAULT_MODEL, minillm.DEFAULT_DRAFT)}
    assert stats[minillm.DEFAULT_MODEL]["val_loss"] < stats[minillm.DEFAULT_DRAFT]["val_loss"]
    for n in stats:
        card = (SHIPPED_MODELS_DIR / n / "README.md").read_text()
        assert "validation perplexity" in card and "Sample" in card
    assert "agrees with the target" in (SHIPPED_MODELS_DIR / minillm.DEFAULT_DRAFT / "README.md").read_text()


def test_default_model_generates_shakespeare_like_text():
    """Greedy text from the target has a speaker line (an upper-case name ending in '.')."""
    model, tok = minillm.load(minillm.DEFAULT_MODEL)
    params = minillm.SamplingParams(temperature=0, max_tokens=60)
    out = minillm.generate(model, "HAMLET.\nTo be, or not to be", params, tok)
    lines = [line for line in out.text.splitlines() if line.strip()]
    assert any(line.isupper() and line.endswith(".") for line in lines), f"no speaker line in {out.text!r}"
    assert math.isfinite(out.ttft_s)
