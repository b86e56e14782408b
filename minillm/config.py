"""`ModelConfig`: every number that fixes the shape of a Llama-family model (chapter 00).

One dataclass describes Llama 2/3, Mistral, Qwen2 and Qwen3. The differences between them are
a handful of switches: `n_kv_heads` (MHA / GQA / MQA), an explicit `head_dim`, `qkv_bias`
(Qwen2), `qk_norm` (Qwen3), `tie_embeddings`, the rotary base and its scaling.

`ModelConfig.from_hf(config_dict)` reads a Hugging Face `config.json`, in both the older layout
(`rope_theta`, `rope_scaling`) and the newer one (`rope_parameters`); `to_hf()` writes one back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Hugging Face architecture name -> the switches that architecture turns on.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# Rotary scalings this engine implements (see `model.rope_inverse_frequencies`).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# The Hugging Face config.json name of each field, for error messages.
HF_NAMES = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
            "n_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size",
            "max_seq_len": "max_position_embeddings", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps"}


class ConfigError(ValueError):
    """A config that minillm cannot build a model from; the message says what to change."""


@dataclass
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder.

    Attributes:
        dim: width of the residual stream (HF `hidden_size`).
        n_layers: number of transformer blocks.
        n_heads: query heads per layer.
        n_kv_heads: key/value heads; `n_heads` = MHA, 1 = MQA, anything between (dividing
            `n_heads`) = GQA.
        head_dim: width of one head. Usually `dim // n_heads`, but Qwen3 and others set it.
        ffn_dim: hidden width of the SwiGLU MLP (HF `intermediate_size`).
        vocab_size: rows of the embedding table.
        max_seq_len: longest context the model was trained for (HF `max_position_embeddings`).
        rope_theta: base of the rotary frequencies.
        rope_scaling: None, or a dict with `rope_type` in `SUPPORTED_ROPE_TYPES` and its fields.
        norm_eps: epsilon of every RMSNorm.
        tie_embeddings: the output head reuses the embedding matrix.
        qkv_bias: q/k/v projections carry a bias (Qwen2).
        o_bias: the output projection carries a bias (Llama's `attention_bias` sets both).
        mlp_bias: the MLP projections carry a bias.
        qk_norm: RMSNorm over each query and key head before rotary (Qwen3).
        sliding_window: if set, a token attends only to the last `sliding_window` positions
            (Mistral v0.1).
        architecture: the HF class name this config came from or will be saved as.
        bos_token_id, eos_token_id: special tokens, as in the checkpoint (eos may be a list).
    """

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_dim: int = 688
    vocab_size: int = 4096
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(
                    f"dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                    "set head_dim explicitly."
                )
            self.head_dim = self.dim // self.n_heads
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}: fix config.json "
                                  f"({HF_NAMES.get(name, name)}).")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a positive number, got {value!r}: fix config.json "
                                  f"({HF_NAMES.get(name, name)}).")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                "(each KV head serves an equal group of query heads)."
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings.")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope scaling type {rope_type!r} is not supported; minillm implements "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}."
            )

    @property
    def n_groups(self) -> int:
        """Query heads per KV head (1 for MHA, n_heads for MQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence ids as a list (a checkpoint may name one or several)."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    # ---------------------------------------------------------------- Hugging Face interop
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build a config from a Hugging Face `config.json` dict.

        Accepts `rope_theta` / `rope_scaling` (older `transformers`, most published checkpoints)
        and `rope_parameters` (newer `transformers`). Raises `ConfigError` naming the problem.
        """
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architecture {arch!r} is not supported; minillm loads "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size", "vocab_size") if k not in hf]
        if missing:
            raise ConfigError(f"config.json lacks required field(s) {missing}.")

        # Rotary: newer files nest theta inside rope_parameters; older ones keep it top-level.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        if rope and all(isinstance(v, dict) for v in rope.values()):
            raise ConfigError("per-layer-type rope_parameters are not supported by minillm.")
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
        if "type" in rope and "rope_type" not in rope:  # the oldest spelling
            rope["rope_type"] = rope.pop("type")
        rope_type = rope.get("rope_type", "default")
        if rope_type in ("llama3", "yarn"):
            rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        scaling = None if rope_type == "default" else rope

        sliding = None
        if family == "mistral":
            sliding = hf.get("sliding_window")
        elif family in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            raise ConfigError(
                f"{arch} with use_sliding_window=true uses per-layer windows, which minillm does not "
                "implement; use a checkpoint with use_sliding_window=false."
            )
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            ffn_dim=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=theta if isinstance(theta, bool) or not isinstance(theta, (int, float)) else float(theta),
            rope_scaling=scaling,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if family == "llama" else False,
            qk_norm=family == "qwen3",
            sliding_window=sliding,
            architecture=arch,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict `transformers` reads back into the same architecture."""
        family = SUPPORTED_ARCHITECTURES.get(self.architecture)
        if family is None:
            raise ConfigError(f"cannot save architecture {self.architecture!r}.")
        if family in ("llama", "qwen3") and self.qkv_bias != self.o_bias:
            raise ConfigError(f"a {self.architecture} has one attention_bias switch for q/k/v and o.")
        if family == "qwen2" and not (self.qkv_bias and not self.o_bias):
            raise ConfigError("a Qwen2ForCausalLM has q/k/v bias and no o bias.")
        if family != "qwen3" and self.qk_norm:
            raise ConfigError("qk_norm needs architecture Qwen3ForCausalLM.")
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": family,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_seq_len,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if family in ("llama", "qwen3"):
            hf["attention_bias"] = self.qkv_bias
        if family == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if family == "mistral":
            hf["sliding_window"] = self.sliding_window
        if family in ("qwen2", "qwen3"):
            hf["use_sliding_window"] = False
        return hf

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (for printing and results files)."""
        return asdict(self)
