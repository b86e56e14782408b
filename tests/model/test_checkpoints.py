"""Loading and saving checkpoints: `minillm.load`, `minillm.save`, `minillm.from_transformers`.

Every checkpoint here is a tiny random `transformers` model built in the test run (see conftest),
so these tests need no network and no downloaded weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import random_hf_model
from safetensors.torch import load_file, save_file

import minillm
from minillm.checkpoints import CheckpointError
from minillm.config import ConfigError, ModelConfig

PROMPT_IDS = [0, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5, 300]


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 logits agree to 1e-4 relative to the largest logit (and at least 1e-4 absolute)."""
    assert actual.shape == expected.shape, f"{what}: logits shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    tol = 1e-4 * max(1.0, expected.abs().max().item())
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff <= tol, f"{what}: max |logit difference| {diff:.3g} exceeds the tolerance {tol:.3g}"


@torch.no_grad()
def hf_logits(hf_model: torch.nn.Module, ids: list[int] = PROMPT_IDS) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits


@torch.no_grad()
def minillm_logits(model: minillm.Transformer, ids: list[int] = PROMPT_IDS) -> torch.Tensor:
    return model(torch.tensor([ids]))


def copy_folder(src: Path, dst: Path) -> Path:
    """A private copy of a (session-scoped) checkpoint folder that a test may break."""
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture
def broken_folder(llama_folder, tmp_path) -> Path:
    """A copy of `llama_folder` a test may damage."""
    return copy_folder(llama_folder, tmp_path / "model")


# ------------------------------------------------------------------ folders saved by transformers
LONG_IDS = list(range(2, 200, 3))  # 66 tokens: past a sliding window, long enough for slow rotary frequencies


@pytest.mark.parametrize(
    "arch, overrides",
    [("llama", {}), ("mistral", {}), ("mistral", {"sliding_window": 8}), ("qwen2", {}), ("qwen3", {})],
    ids=["llama", "mistral", "mistral-window-8", "qwen2", "qwen3"],
)
def test_save_pretrained_folder_loads_with_transformers_logits(arch, overrides, tmp_path):
    """A folder written by `save_pretrained` loads into minillm with the same fp32 logits."""
    hf_model = random_hf_model(arch, **overrides)
    hf_model.save_pretrained(tmp_path)
    model, _ = minillm.load(tmp_path)
    assert model.dtype == torch.float32, f"expected an fp32 model on the CPU by default, got {model.dtype}"
    assert not model.training, "expected load() to return the model in eval mode"
    assert model.config.architecture == type(hf_model).__name__
    if "sliding_window" in overrides:
        assert model.config.sliding_window == overrides["sliding_window"]
    assert_logits_close(
        minillm_logits(model, LONG_IDS), hf_logits(hf_model, LONG_IDS), f"{arch} {overrides} from save_pretrained"
    )


def test_load_returns_tokenizer_when_tokenizer_json_present(llama_folder, tokenizer_file):
    """With tokenizer.json beside the weights, load() returns a working tokenizer with the config's BOS/EOS."""
    _, tokenizer = minillm.load(llama_folder)
    assert tokenizer is not None, "expected a tokenizer: the folder has tokenizer.json"
    assert tokenizer.bos_token_id == 0 and tokenizer.eos_token_ids == [1], (
        f"expected BOS 0 and EOS [1] from config.json, got {tokenizer.bos_token_id}, {tokenizer.eos_token_ids}"
    )
    ids = tokenizer.encode("To be, or not to be")
    assert ids[0] == 0, "expected the tokenizer's template to prepend <s>"
    assert tokenizer.decode(ids) == "To be, or not to be", "expected decode(encode(text)) == text"


def test_load_returns_no_tokenizer_without_tokenizer_json(broken_folder):
    """Without tokenizer.json, load() still loads the model and returns None for the tokenizer."""
    (broken_folder / "tokenizer.json").unlink()
    model, tokenizer = minillm.load(broken_folder)
    assert isinstance(model, minillm.Transformer)
    assert tokenizer is None, f"expected no tokenizer when tokenizer.json is absent, got {tokenizer!r}"


def test_from_transformers_matches_transformers_logits():
    """`from_transformers` converts an in-memory model, keeping dtype and logits."""
    hf_model = random_hf_model("qwen2")
    model = minillm.from_transformers(hf_model)
    assert model.dtype == torch.float32
    assert_logits_close(minillm_logits(model), hf_logits(hf_model), "from_transformers(Qwen2)")


# ------------------------------------------------------------------ folders saved by minillm
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_writes_folder_transformers_and_minillm_load(tied, tmp_path, tokenizer_file):
    """minillm.save writes a folder that transformers and minillm both load with equal logits."""
    import transformers

    hf_model = random_hf_model("llama", seed=1, tie_word_embeddings=tied)
    model = minillm.from_transformers(hf_model)
    assert model.config.tie_embeddings is tied
    tokenizer = minillm.Tokenizer.from_file(tokenizer_file, 0, [1])
    folder = minillm.save(model, tmp_path / "saved", tokenizer)

    assert (folder / "tokenizer.json").is_file(), "expected save() to write tokenizer.json"
    stored = load_file(folder / "model.safetensors")
    assert ("lm_head.weight" in stored) is not tied, (
        f"expected lm_head.weight stored {'once, as the embedding' if tied else 'separately'}; "
        f"stored names: {sorted(stored)[:4]} ..."
    )
    expected = minillm_logits(model)

    reloaded_hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(reloaded_hf).__name__ == "LlamaForCausalLM"
    assert_logits_close(hf_logits(reloaded_hf), expected, "transformers loading a minillm.save folder")

    reloaded, reloaded_tok = minillm.load(folder)
    assert reloaded.config.tie_embeddings is tied
    if tied:
        assert reloaded.lm_head.weight is reloaded.embed_tokens.weight, "expected the reloaded head to be tied"
    assert_logits_close(minillm_logits(reloaded), expected, "minillm loading a minillm.save folder")
    assert reloaded_tok is not None and reloaded_tok.encode("question") == tokenizer.encode("question")


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    """Shards listed in model.safetensors.index.json load as one model with transformers' logits."""
    hf_model = random_hf_model("llama", seed=2)
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").is_file(), "expected save_pretrained to write an index"
    assert not (tmp_path / "model.safetensors").exists(), "expected no single-file checkpoint beside the shards"
    assert len(shards) > 1, f"expected several shards at max_shard_size=20KB, got {len(shards)}"
    model, _ = minillm.load(tmp_path)
    assert_logits_close(minillm_logits(model), hf_logits(hf_model), "sharded checkpoint")


# ------------------------------------------------------------------ errors, each with its message
def test_nonexistent_path_raises_file_not_found_saying_no_download(tmp_path):
    """A path that is neither a folder nor a shipped model: FileNotFoundError that says minillm does not download."""
    with pytest.raises(FileNotFoundError, match="does not download"):
        minillm.load(tmp_path / "no-such-model")


def test_folder_without_config_json_raises(broken_folder):
    """A folder without config.json is not a Hugging Face model folder."""
    (broken_folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        minillm.load(broken_folder)


def test_unknown_architecture_lists_supported_ones(broken_folder):
    """An architecture minillm does not implement is named, with the list of the ones it does."""
    edit_config(broken_folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="'GPT2LMHeadModel' is not supported") as info:
        minillm.load(broken_folder)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(info.value), f"expected the message to list {arch}: {info.value}"


def test_pickled_weights_only_are_refused(broken_folder):
    """A folder with pytorch_model.bin but no safetensors: refused, saying pickled weights are not read."""
    state = load_file(broken_folder / "model.safetensors")
    (broken_folder / "model.safetensors").unlink()
    torch.save(state, broken_folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="does not read pickled weights") as info:
        minillm.load(broken_folder)
    assert "pytorch_model.bin" in str(info.value), f"expected the message to name the .bin file: {info.value}"


def test_truncated_safetensors_raises_truncated_or_corrupt(broken_folder):
    """A model.safetensors cut in half is reported as truncated or corrupt, not as a low-level error."""
    path = broken_folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        minillm.load(broken_folder)


def test_missing_shard_is_named(tmp_path):
    """A shard the index lists but the folder lacks is named in the error."""
    random_hf_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    lost = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / lost).unlink()
    with pytest.raises(CheckpointError, match=f"shard.*{lost}.*not in the folder"):
        minillm.load(tmp_path)


def test_shape_disagreeing_with_config_names_tensor_and_shapes(broken_folder):
    """config.json's intermediate_size edited: the error names the first bad tensor and both shapes."""
    edit_config(broken_folder, intermediate_size=128)
    with pytest.raises(
        CheckpointError, match=r"layers\.0\.mlp\.gate_proj\.weight' has shape \(160, 64\).*implies \(128, 64\)"
    ):
        minillm.load(broken_folder)


def test_missing_tensor_is_named(broken_folder):
    """A checkpoint without one tensor the config needs: the error names it."""
    path = broken_folder / "model.safetensors"
    state = load_file(path)
    del state["model.layers.1.post_attention_layernorm.weight"]
    save_file(state, path)
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor.*layers\.1\.post_attention_layernorm\.weight"):
        minillm.load(broken_folder)


def test_unexpected_tensor_is_named(broken_folder):
    """A checkpoint with a tensor the config does not use: the error names it."""
    path = broken_folder / "model.safetensors"
    state = load_file(path)
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(state, path)
    with pytest.raises(CheckpointError, match=r"does not use.*layers\.0\.self_attn\.q_norm\.weight"):
        minillm.load(broken_folder)


# ------------------------------------------------------------------ config.json layouts
BASE_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}
LLAMA3_FIELDS = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_llama3_rope_old_and_new_config_layouts_agree():
    """Top-level rope_theta + rope_scaling (older transformers) and rope_parameters (newer) give one ModelConfig."""
    old = ModelConfig.from_hf(
        {**BASE_HF_CONFIG, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_FIELDS}}
    )
    new = ModelConfig.from_hf(
        {**BASE_HF_CONFIG, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", **LLAMA3_FIELDS}}
    )
    assert old.rope_theta == new.rope_theta == 500000.0, f"rope_theta: old {old.rope_theta}, new {new.rope_theta}"
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "llama3", **LLAMA3_FIELDS}, (
        f"rope_scaling: old {old.rope_scaling}, new {new.rope_scaling}"
    )
    assert old == new, "expected the two layouts to produce equal ModelConfigs"


def test_linear_rope_oldest_type_spelling_agrees_with_newer_layouts():
    """The oldest `{"type": "linear", "factor": 2}` reads like rope_type in rope_scaling and in rope_parameters."""
    oldest = ModelConfig.from_hf({**BASE_HF_CONFIG, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2}})
    old = ModelConfig.from_hf(
        {**BASE_HF_CONFIG, "rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 2}}
    )
    new = ModelConfig.from_hf(
        {**BASE_HF_CONFIG, "rope_parameters": {"rope_theta": 1e6, "rope_type": "linear", "factor": 2}}
    )
    assert oldest.rope_scaling == old.rope_scaling == new.rope_scaling == {"rope_type": "linear", "factor": 2}, (
        f"rope_scaling: oldest {oldest.rope_scaling}, old {old.rope_scaling}, new {new.rope_scaling}"
    )
    assert oldest.rope_theta == old.rope_theta == new.rope_theta == 1e6
    assert oldest == old == new


def test_default_rope_layouts_give_no_scaling():
    """rope_type "default" in either layout means no scaling, and the theta is kept."""
    old = ModelConfig.from_hf({**BASE_HF_CONFIG, "rope_theta": 20000.0})
    new = ModelConfig.from_hf({**BASE_HF_CONFIG, "rope_parameters": {"rope_theta": 20000.0, "rope_type": "default"}})
    assert old.rope_scaling is None and new.rope_scaling is None
    assert old.rope_theta == new.rope_theta == 20000.0
    assert old == new


def test_llama3_rope_checkpoint_matches_transformers_in_both_layouts(tmp_path):
    """A llama3-scaled checkpoint gives transformers' logits, whether config.json uses the new or the old layout.

    minillm.save writes the old layout; transformers must read it back with the same scaling.
    """
    import transformers

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_FIELDS}
    hf_model = random_hf_model("llama", seed=3, rope_parameters=rope)
    ids = LONG_IDS  # long enough for the scaled low frequencies to matter
    expected = hf_logits(hf_model, ids)
    hf_model.save_pretrained(tmp_path)

    new_layout, _ = minillm.load(tmp_path)
    assert new_layout.config.rope_scaling == {"rope_type": "llama3", **LLAMA3_FIELDS}
    assert_logits_close(minillm_logits(new_layout, ids), expected, "llama3 rope, rope_parameters layout")

    config = json.loads((tmp_path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(config))
    old_layout, _ = minillm.load(tmp_path)
    assert old_layout.config == new_layout.config, "expected the old layout to give the same ModelConfig"
    assert_logits_close(minillm_logits(old_layout, ids), expected, "llama3 rope, rope_theta + rope_scaling layout")

    resaved = minillm.save(old_layout, tmp_path / "resaved")
    reloaded_hf = transformers.AutoModelForCausalLM.from_pretrained(resaved).eval()
    assert_logits_close(hf_logits(reloaded_hf, ids), expected, "transformers loading minillm.save of a llama3 model")


# ------------------------------------------------------------------ dtypes
def test_load_in_bf16(llama_folder):
    """dtype="bf16" gives a bf16 model whose logits stay close to the fp32 ones."""
    model, _ = minillm.load(llama_folder, dtype="bf16")
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.bfloat16}, f"expected every parameter in bf16, got {dtypes}"
    assert model.rotary.inv_freq.dtype == torch.float32, "expected the rotary frequencies to stay fp32"
    logits = minillm_logits(model)
    assert logits.dtype == torch.bfloat16
    reference = minillm_logits(minillm.load(llama_folder)[0])
    err = (logits.float() - reference).abs().max().item()
    assert err < 0.05 * max(1.0, reference.abs().max().item()), f"bf16 logits stray {err:.3g} from fp32"


def test_unknown_dtype_name_lists_valid_ones(llama_folder):
    """A dtype name minillm does not know raises ValueError listing the valid names."""
    with pytest.raises(ValueError, match="unknown dtype 'bf32'") as info:
        minillm.load(llama_folder, dtype="bf32")
    for name in ("float32", "bf16", "fp16"):
        assert name in str(info.value), f"expected the message to list {name!r}: {info.value}"
