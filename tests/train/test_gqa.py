"""minillm.train.gqa: pooling K/V heads (MHA -> GQA -> MQA), saving the result, uptraining it (chapter 03)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TEXT, random_hf_model

import minillm
from minillm import ModelConfig, Transformer
from minillm.checkpoints import SHIPPED_MODELS_DIR, from_transformers
from minillm.train.gqa import convert_kv_heads, uptrain, valid_kv_heads
from minillm.train.loop import TrainSettings, encode_works, evaluate, init_weights


def random_model(seed: int = 0, **overrides) -> Transformer:
    """A small random minillm model (MHA unless told), with norm weights and biases perturbed away from 1 and 0."""
    kwargs = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=16, ffn_dim=96, vocab_size=128,
                  max_seq_len=64, norm_eps=1e-5)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**kwargs))
    init_weights(model, std=0.1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def k_and_v(model: Transformer, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value rows of a layer's stacked qkv_proj, each [n_kv_heads, head_dim, dim]."""
    c = model.config
    w = model.layers[layer].self_attn.qkv_proj.weight
    k, v = w[c.n_heads * c.head_dim :].chunk(2)
    return k.reshape(c.n_kv_heads, c.head_dim, -1), v.reshape(c.n_kv_heads, c.head_dim, -1)


def make_groups_identical(model: Transformer, n_groups: int) -> None:
    """In place: within each of n_groups runs of consecutive K/V heads, copy the run's first head over the others."""
    c = model.config
    r = c.n_kv_heads // n_groups
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    with torch.no_grad():
        for block in model.layers:
            proj = block.self_attn.qkv_proj
            for t in [proj.weight] + ([proj.bias] if proj.bias is not None else []):
                for start in (q, q + kv):  # the K block, then the V block
                    heads = t[start : start + kv].view(c.n_kv_heads, c.head_dim, *t.shape[1:])
                    for g in range(n_groups):
                        heads[g * r + 1 : (g + 1) * r] = heads[g * r]


TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def test_task_1_same_head_count_is_an_identical_copy():
    """n_kv_heads = the current count: a new model (no shared tensors) with bit-identical logits."""
    shipped, tok = minillm.load(minillm.DEFAULT_DRAFT)
    ids = torch.tensor([tok.encode("ROMEO.\nBut soft, what light through yonder window breaks?")])
    for model, x in [(shipped, ids), (random_model(qkv_bias=True), TOKENS)]:
        copy = convert_kv_heads(model, model.config.n_kv_heads)
        assert copy is not model and copy.config == model.config
        assert all(a.data_ptr() != b.data_ptr() for a, b in zip(copy.parameters(), model.parameters())), \
            "the copy must not share weights with the original"
        with torch.no_grad():
            assert torch.equal(copy(x), model(x)), "converting to the same number of K/V heads changed the logits"


def test_task_2_halving_mha_heads_averages_consecutive_pairs():
    """MHA with 8 K/V heads -> 4: new K/V head j is the mean of old heads 2j and 2j+1 (weights and biases)."""
    model = random_model(qkv_bias=True)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    gqa = convert_kv_heads(model, 4)
    assert gqa.config.n_kv_heads == 4 and model.config.n_kv_heads == 8
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), f"convert_kv_heads modified the input model's {name}"
    c = model.config
    q = c.n_heads * c.head_dim
    for i in range(c.n_layers):
        (k_old, v_old), (k_new, v_new) = k_and_v(model, i), k_and_v(gqa, i)
        for old, new, what in [(k_old, k_new, "K"), (v_old, v_new, "V")]:
            for j in range(4):
                torch.testing.assert_close(new[j], (old[2 * j] + old[2 * j + 1]) / 2, msg=(
                    f"layer {i}: new {what} head {j} must be the mean of old heads {2 * j} and {2 * j + 1}"))
        b_old, b_new = model.layers[i].self_attn.qkv_proj.bias, gqa.layers[i].self_attn.qkv_proj.bias
        kb_old, vb_old = b_old[q:].view(2, 8, c.head_dim).unbind(0)
        kb_new, vb_new = b_new[q:].view(2, 4, c.head_dim).unbind(0)
        torch.testing.assert_close(kb_new, (kb_old[0::2] + kb_old[1::2]) / 2, msg="k bias not pair-averaged")
        torch.testing.assert_close(vb_new, (vb_old[0::2] + vb_old[1::2]) / 2, msg="v bias not pair-averaged")
        w_old, w_new = model.layers[i].self_attn.qkv_proj.weight, gqa.layers[i].self_attn.qkv_proj.weight
        assert torch.equal(w_new[:q], w_old[:q]) and torch.equal(b_new[:q], b_old[:q]), "queries must be untouched"
        assert torch.equal(gqa.layers[i].self_attn.o_proj.weight, model.layers[i].self_attn.o_proj.weight)


@pytest.mark.parametrize("overrides, n_kv_heads", [
    (dict(), 2),                                                           # Llama MHA 8 -> GQA 2
    (dict(), 1),                                                           # MHA -> MQA
    (dict(n_kv_heads=4), 2),                                               # GQA 4 -> 2
    (dict(qkv_bias=True, architecture="Qwen2ForCausalLM"), 4),             # q/k/v biases
    (dict(qk_norm=True, architecture="Qwen3ForCausalLM"), 2),              # per-head q/k RMSNorm
], ids=["mha8-to-2", "mha8-to-1", "gqa4-to-2", "qwen2-bias-8-to-4", "qwen3-qknorm-8-to-2"])
def test_task_3_groups_of_identical_heads_convert_with_unchanged_logits(overrides, n_kv_heads):
    """If the K/V heads of every group are already equal, pooling loses nothing: logits must not move.

    This checks the group <-> head mapping: pooling heads {0, 2} instead of {0, 1}, or putting the pools
    in another order, would average different heads or hand a query head another group's K/V."""
    model = random_model(**overrides)
    make_groups_identical(model, n_kv_heads)
    gqa = convert_kv_heads(model, n_kv_heads)
    with torch.no_grad():
        expected, got = model(TOKENS), gqa(TOKENS)
    err = (got - expected).abs().max().item()
    assert err < 1e-5, (f"{model.config.n_kv_heads} -> {n_kv_heads} K/V heads with identical groups: "
                        f"max |Δ logits| {err:.2e}")
    # ...and the same model with its groups NOT identical does change: the test above can fail.
    other = convert_kv_heads(random_model(**overrides), n_kv_heads)
    with torch.no_grad():
        assert (other(TOKENS) - random_model(**overrides)(TOKENS)).abs().max() > 1e-3


def test_task_4_mha_to_gqa_to_mqa_chain_equals_direct_conversion():
    """8 -> 4 -> 2 -> 1 pools means of equal-sized groups, so it equals 8 -> 2 and 8 -> 1 done at once."""
    model = random_model(qkv_bias=True)
    chain = [model]
    for n in (4, 2, 1):
        chain.append(convert_kv_heads(chain[-1], n))
        assert chain[-1].config.n_kv_heads == n and chain[-1].config.n_heads == 8
    for step, n in [(2, 2), (3, 1)]:
        direct = convert_kv_heads(model, n)
        for (name, a), (_, b) in zip(chain[step].state_dict().items(), direct.state_dict().items()):
            torch.testing.assert_close(a, b, msg=f"8 -> ... -> {n} differs from 8 -> {n} in {name}")
    with torch.no_grad():
        assert torch.isfinite(chain[-1](TOKENS)).all()


def test_task_5_bad_head_counts_raise_naming_the_valid_ones():
    """Not a divisor, more heads than now, zero: ValueError listing what would work."""
    assert valid_kv_heads(8) == [1, 2, 4, 8] and valid_kv_heads(6) == [1, 2, 3, 6]
    mha = random_model()
    for bad in (3, 5, 16, 0, -2):
        with pytest.raises(ValueError, match="valid values are 1, 2, 4, 8"):
            convert_kv_heads(mha, bad)
    with pytest.raises(ValueError, match="cannot add heads"):
        convert_kv_heads(mha, 16)
    gqa = random_model(n_kv_heads=2)
    with pytest.raises(ValueError, match="must divide 2; valid values are 1, 2"):
        convert_kv_heads(gqa, 4)


def test_task_6_saved_converted_model_loads_in_transformers_and_minillm(tmp_path):
    """The shipped target pooled to MQA saves as a HF folder: num_key_value_heads = 1, transformers and
    minillm.load give the converted model's logits; a Qwen2 model with q/k/v biases likewise."""
    import transformers

    target, tok = minillm.load(minillm.DEFAULT_MODEL)
    qwen2 = from_transformers(random_hf_model("qwen2", num_key_value_heads=4)).float()
    ids = torch.tensor([tok.encode("HAMLET.\nTo be, or not to be, that is the question.")])
    for name, model, n_kv, x, tokenizer in [("target-mqa", target, 1, ids, tok),
                                            ("qwen2-gqa", qwen2, 2, ids % 320, None)]:
        converted = convert_kv_heads(model, n_kv)
        folder = minillm.save(converted, tmp_path / name, tokenizer)
        assert json.loads((folder / "config.json").read_text())["num_key_value_heads"] == n_kv
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert hf.config.num_key_value_heads == n_kv
        loaded, loaded_tok = minillm.load(folder)
        with torch.no_grad():
            expected = converted(x)
            err = (hf(x).logits - expected).abs().max().item()
            assert err <= 1e-4 * max(1.0, expected.abs().max().item()), f"{name}: transformers max |Δ logits| {err:.2e}"
            assert torch.equal(loaded(x), expected), f"{name}: minillm.load gave other logits"
    target_tokenizer = (SHIPPED_MODELS_DIR / minillm.DEFAULT_MODEL / "tokenizer.json").read_bytes()
    assert (tmp_path / "target-mqa" / "tokenizer.json").read_bytes() == target_tokenizer


def test_task_7_uptraining_lowers_the_training_loss_deterministically():
    """A few steps of uptraining the draft pooled to MQA lower the loss on a fixed batch; same seed, same weights."""
    model, tok = minillm.load(minillm.DEFAULT_DRAFT)
    mqa = convert_kv_heads(model, 1)
    train_ids = encode_works(tok, [TEXT])
    fixed = train_ids[: 4 * 65].view(4, 65)
    settings = TrainSettings(batch_size=4, seq_len=64, lr=1e-3, warmup=2, seed=3)
    reference = {name: t.clone() for name, t in mqa.state_dict().items()}
    trained, losses = uptrain(mqa, train_ids, n_steps=12, settings=settings)
    again, losses_again = uptrain(mqa, train_ids, n_steps=12, settings=settings)
    assert len(losses) == 12 and losses == losses_again, "uptraining with the same seed must repeat exactly"
    for (name, a), (_, b) in zip(trained.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), f"same seed, different {name}"
    for name, t in mqa.state_dict().items():
        assert torch.equal(t, reference[name]), f"uptrain modified its input's {name}"
    before, after = evaluate(mqa, fixed), evaluate(trained, fixed)
    assert after < before - 0.1, f"loss on a fixed training batch went {before:.3f} -> {after:.3f}"
    assert trained.config.n_kv_heads == 1 and not trained.training and not trained._forward_hooks
