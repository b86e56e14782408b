"""A LoRA adapter in PEFT's format: load, check against a model, save, merge and unmerge (chapter 08, issue 32).

LoRA fine-tunes a linear layer W [out, in] by learning a low-rank update instead of W itself:

    W' = W + s * B @ A        A [r, in], B [out, r], r << min(in, out), s = alpha / r (alpha / sqrt(r): rsLoRA)

so an adapter stores r * (in + out) numbers per layer instead of in * out: at r = 16 on a 4096 x 4096
projection, 0.8% of the matrix. PEFT (Hugging Face's library) saves one as a folder of two files:

    adapter_config.json          {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": [...], ...}
    adapter_model.safetensors    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in]
                                 base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out, r]

PEFT names Hugging Face's separate projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj); minillm stacks q|k|v into `qkv_proj` and gate|up into `gate_up_proj` (`minillm.model`). So an
adapter on q_proj updates rows [0, q) of qkv_proj, one on v_proj rows [q + kv, q + 2kv), and so on:
`target_rows` says where each PEFT target lands. An adapter on q_proj and v_proj only touches those slices.

Merged serving adds s * B @ A into the base weights once (`merge_adapter`): the model then runs at the
base model's speed, but serves only that adapter. Unmerged serving (`minillm.lora.slots`) keeps W and adds
x A^T B^T per row, so one batch can mix many adapters.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from minillm.config import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # what minillm adapts
# A PEFT tensor name: ...layers.{layer}.{self_attn|mlp}.{target}.lora_{A|B}[.adapter name].weight
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+?)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_REFUSED = {  # PEFT options minillm does not implement, and what they would need
    "use_dora": "DoRA adapters (use_dora) rescale the weight's columns, which minillm does not implement",
    "modules_to_save": "modules_to_save stores whole fine-tuned layers beside the LoRA, which minillm does not load",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2's transposed Conv1D layers) does not apply to Llama-family models",
}


def target_rows(config: ModelConfig) -> dict[str, tuple[str, int, int, int]]:
    """Where each PEFT target lives in minillm: {target: (module in the block, first row, rows, in_features)}.

    q, k and v are row slices of `self_attn.qkv_proj`, gate and up of `mlp.gate_up_proj`; o_proj and
    down_proj are whole modules.
    """
    q, kv, f, d = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.ffn_dim, config.dim
    return {"q_proj": ("self_attn.qkv_proj", 0, q, d), "k_proj": ("self_attn.qkv_proj", q, kv, d),
            "v_proj": ("self_attn.qkv_proj", q + kv, kv, d), "o_proj": ("self_attn.o_proj", 0, d, q),
            "gate_proj": ("mlp.gate_up_proj", 0, f, d), "up_proj": ("mlp.gate_up_proj", f, f, d),
            "down_proj": ("mlp.down_proj", 0, d, f)}


@dataclass
class LoRAAdapter:
    """One adapter, on the host: its hyper-parameters and (A [r, in], B [out, r]) per (layer, PEFT target), fp32."""

    rank: int
    alpha: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    use_rslora: bool = False
    base_model: str | None = None
    config: dict = field(default_factory=dict, repr=False)  # the rest of adapter_config.json, kept for saving

    @property
    def scale(self) -> float:
        """What B @ A is multiplied by: alpha / r, or alpha / sqrt(r) with rsLoRA (as PEFT computes it)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def targets(self) -> list[str]:
        """The PEFT targets it adapts, in minillm's order."""
        present = {t for _, t in self.weights}
        return [t for t in TARGETS if t in present]

    def delta(self, layer: int, target: str) -> torch.Tensor:
        """The update to one target's weight: scale * B @ A, [out, in] fp32."""
        a, b = self.weights[layer, target]
        return self.scale * (b @ a)


def _refuse(path: Path, problem: str, what_to_do: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {problem}; {what_to_do}")


def _read_config(path: Path) -> dict:
    """adapter_config.json as a dict, checked for what minillm can serve (ValueError naming the problem)."""
    if not path.is_dir():
        raise _refuse(path, "no such folder", f"give a folder holding {CONFIG_FILE} and {WEIGHTS_FILE} "
                                              "(PEFT's save_pretrained writes both).")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            hint = (" (found adapter_model.bin: save it again with safe_serialization=True)"
                    if name == WEIGHTS_FILE and (path / "adapter_model.bin").is_file() else "")
            raise _refuse(path, f"{name} is missing{hint}", "save the adapter with PEFT's save_pretrained, or "
                                                            "minillm.lora.save_adapter.")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise _refuse(path, f"{CONFIG_FILE} is not valid JSON ({exc})", "the file is corrupt: save it again.") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type is {config['peft_type']!r}", "minillm serves LoRA adapters only.")
    for key, problem in _REFUSED.items():
        if config.get(key):
            raise _refuse(path, problem, f"train the adapter without {key}.")
    if config.get("bias", "none") != "none":
        raise _refuse(path, f"bias={config['bias']!r} trains the layers' biases too", "train with bias='none'.")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise _refuse(path, f"unknown target module(s) {unknown}",
                          f"minillm adapts the attention and MLP projections {list(TARGETS)}: retrain on those.")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if (not isinstance(r, int) or isinstance(r, bool) or r < 1
            or not isinstance(alpha, (int, float)) or isinstance(alpha, bool)):
        raise _refuse(path, f"r={r!r}, lora_alpha={alpha!r}",
                      "the config needs a positive integer r and a number lora_alpha.")
    if not math.isfinite(alpha):  # json.loads reads NaN and Infinity: every output would be NaN
        raise _refuse(path, f"lora_alpha is {alpha!r}, not a finite number",
                      "set lora_alpha in adapter_config.json to the value the adapter was trained with.")
    return config


def check_finite(adapter: LoRAAdapter, name: str) -> None:
    """Refuse (ValueError naming the tensor) an adapter holding a NaN or an infinity, or whose alpha is not finite:
    its rows would sample from NaN logits. Checked when an adapter is loaded and when it is registered for serving."""
    if not math.isfinite(adapter.alpha):
        raise ValueError(f"LoRA adapter {name!r}: lora_alpha is {adapter.alpha!r}, not a finite number; set it to the "
                         "value the adapter was trained with.")
    for (layer, target), (a, b) in sorted(adapter.weights.items()):
        for half, tensor in (("A", a), ("B", b)):
            if not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {target} lora_{half} holds {bad} NaN or "
                                 "infinite value(s); the training diverged or the file is corrupt: use a checkpoint "
                                 "from before the divergence, or save the adapter again.")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _refuse(path, f"{WEIGHTS_FILE} cannot be read ({exc})", "the file is corrupt: save it again.") from None


def load_adapter(path: str | Path, config: ModelConfig) -> LoRAAdapter:
    """Load a PEFT LoRA adapter folder and check it fits a model of `config` (chapter 08).

    Raises a ValueError that names the problem and what to do: a missing or corrupt file, a PEFT option minillm
    does not implement (DoRA, biases, modules_to_save, per-module ranks), an unknown target module, a rank that
    differs from the config's `r`, shapes of another model size (a layer it lacks, other widths), or a NaN or an
    infinity in a tensor or in lora_alpha (`check_finite`).
    Dropout is ignored (it only acts in training).
    """
    path = Path(path)
    cfg = _read_config(path)
    tensors = _read_tensors(path)
    rank, rows = cfg["r"], target_rows(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in TARGETS:
            raise _refuse(path, f"tensor {key!r} is not a LoRA matrix of {list(TARGETS)}",
                          "minillm adapts the attention and MLP projections only (no embeddings or lm_head).")
        layer, target, half = int(match.group(1)), match.group(2), match.group(3)
        if layer >= config.n_layers:
            raise _refuse(path, f"it has layer {layer}, the model {config.n_layers} layers",
                          "this adapter was made for another model size: use one trained on this base model.")
        halves.setdefault((layer, target), {})[half] = tensor.float()
    if not halves:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA matrices", "save the adapter again.")
    weights = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise _refuse(path, f"layer {layer} {target} has lora_{''.join(pair)} without its pair",
                          "the file is incomplete: save it again.")
        a, b = pair["A"], pair["B"]
        _, _, out, d_in = rows[target]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise _refuse(path, f"layer {layer} {target} has rank {a.shape[0]} (A) / {b.shape[1]} (B) but the config "
                                f"says r={rank}", "fix r in adapter_config.json, or save the adapter again.")
        if tuple(a.shape) != (rank, d_in) or tuple(b.shape) != (out, rank):
            raise _refuse(path, f"layer {layer} {target} has A {tuple(a.shape)} and B {tuple(b.shape)}, this model "
                                f"needs A ({rank}, {d_in}) and B ({out}, {rank})",
                          "this adapter was made for another model size: use one trained on this base model.")
        weights[layer, target] = (a, b)
    adapter = LoRAAdapter(rank, float(cfg["lora_alpha"]), weights, bool(cfg.get("use_rslora", False)),
                          cfg.get("base_model_name_or_path"), cfg)
    check_finite(adapter, str(path))
    return adapter


def save_adapter(adapter: LoRAAdapter, path: str | Path) -> Path:
    """Write `adapter` as PEFT writes one (adapter_config.json + adapter_model.safetensors); `PeftModel.from_pretrained`
    loads it over the Hugging Face model. Returns the folder."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"lora_dropout": 0.0, "task_type": "CAUSAL_LM", "bias": "none", "inference_mode": True,
              "fan_in_fan_out": False, "init_lora_weights": True, **adapter.config,
              "peft_type": "LORA", "r": adapter.rank, "lora_alpha": adapter.alpha, "use_rslora": adapter.use_rslora,
              "target_modules": adapter.targets, "base_model_name_or_path": adapter.base_model}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {}
    for (layer, target), (a, b) in adapter.weights.items():
        where = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{where}.{target}"
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a.contiguous(), b.contiguous()
    save_file(tensors, str(path / WEIGHTS_FILE))
    return path


def _module(model: nn.Module, layer: int, name: str) -> nn.Module:
    """model.layers[layer].<name> ("self_attn.qkv_proj", ...), through a `LoRALinear` wrapper to its base."""
    module = model.layers[layer].get_submodule(name)
    return getattr(module, "base", module)


@torch.no_grad()
def _add_to_weights(model: nn.Module, adapter: LoRAAdapter, sign: float) -> None:
    rows = target_rows(model.config)
    for (layer, target), _ in adapter.weights.items():
        name, first, n, _ = rows[target]
        linear = _module(model, layer, name)
        if not isinstance(getattr(linear, "weight", None), torch.Tensor) or not linear.weight.is_floating_point():
            raise ValueError(f"{name} of layer {layer} is not a plain floating-point linear layer (quantised?): merge "
                             "the adapter before quantising, or serve it unmerged (LLM(..., lora_modules=...)).")
        weight = linear.weight  # [out, in]
        weight[first : first + n] += (sign * adapter.delta(layer, target)).to(weight.device, weight.dtype)


def merge_adapter(model: nn.Module, adapter: LoRAAdapter) -> None:
    """Add the adapter into the base weights, W += s B A, in place: the model is now the fine-tuned one, at the base
    model's speed (merged serving, one adapter). `unmerge_adapter` takes it out again."""
    _add_to_weights(model, adapter, 1.0)


def unmerge_adapter(model: nn.Module, adapter: LoRAAdapter) -> None:
    """Subtract a merged adapter, W -= s B A. Exact up to rounding: in bf16 a merge then unmerge can move a weight
    by an ulp (keep a copy of the base weights where that matters)."""
    _add_to_weights(model, adapter, -1.0)
