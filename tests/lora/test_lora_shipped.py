"""The shipped LoRA adapter (models/shakespeare-11m-lora-menenius) and `minillm.lora.train_lora` (chapter 08)."""

from __future__ import annotations

import os

import pytest
import torch

import minillm
from minillm.lora import LoRAAdapter, load_adapter, merge_adapter, save_adapter
from minillm.train.lora_finetune import SHIPPED, sequence_perplexity, shipped_speeches, train_lora

FOLDER = os.path.join(os.path.dirname(minillm.__file__), "models", SHIPPED)


@pytest.fixture
def shipped():
    """A fresh shipped model (fp32), its tokenizer and the shipped adapter."""
    torch.manual_seed(0)
    model, tokenizer = minillm.load(minillm.DEFAULT_MODEL, dtype=torch.float32)
    return model, tokenizer, load_adapter(FOLDER, model.config)


def test_task_1_shipped_adapter_is_small_and_lowers_held_out_perplexity(shipped, one_thread):
    model, tokenizer, adapter = shipped
    assert adapter.base_model == minillm.DEFAULT_MODEL and adapter.rank == 8 and adapter.targets == ["q_proj", "v_proj"]
    size = sum(os.path.getsize(os.path.join(FOLDER, f)) for f in os.listdir(FOLDER))
    assert size < 1_000_000, f"the shipped adapter folder is {size:,} bytes: keep it under 1 MB"
    _, held_out = shipped_speeches()
    ids = [tokenizer.encode(s) for s in held_out]
    base = sequence_perplexity(model, ids)
    merge_adapter(model, adapter)
    tuned = sequence_perplexity(model, ids)
    assert tuned < 0.85 * base, (f"held-out Menenius perplexity {tuned:.1f} with the adapter, {base:.1f} without: the "
                                 "adapter should lower it by more than 15% (its card says 78.8 -> 54.7)")


def test_task_2_peft_loads_the_shipped_adapter_and_agrees(shipped, one_thread):
    peft = pytest.importorskip("peft")
    import transformers

    model, tokenizer, adapter = shipped
    base_folder = os.path.join(os.path.dirname(minillm.__file__), "models", minillm.DEFAULT_MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_folder, torch_dtype=torch.float32).eval()
    peft_model = peft.PeftModel.from_pretrained(hf, FOLDER).eval()
    prompt = torch.tensor([tokenizer.encode("MENENIUS.\nThe good")])
    with torch.no_grad():
        want = peft_model(prompt).logits[0]
        merge_adapter(model, adapter)
        got = model(prompt)[0]
    torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-4)


def test_task_3_train_lora_trains_only_a_and_b(shipped, tmp_path, one_thread):
    model, tokenizer, _ = shipped
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seqs = [tokenizer.encode("MENENIUS.\nI tell you, friends, most charitable care")] * 4
    adapter = train_lora(model, seqs, targets=("q_proj", "down_proj"), rank=4, alpha=8, steps=3, lr=1e-2,
                         batch_size=2, base_model="x")
    assert isinstance(adapter, LoRAAdapter) and adapter.targets == ["q_proj", "down_proj"]
    a, b = adapter.weights[0, "q_proj"]
    assert a.shape == (4, model.config.dim) and b.shape == (model.config.dim, 4) and b.abs().sum() > 0, \
        "B starts at zero and must move after training"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"train_lora changed the frozen base weight {k}"
    assert all(p.requires_grad for p in model.parameters()), "train_lora must restore requires_grad"
    again = load_adapter(save_adapter(adapter, tmp_path / "a"), model.config)
    torch.testing.assert_close(again.delta(0, "down_proj"), adapter.delta(0, "down_proj"))
