"""The arithmetic of inference: parameters, bytes, FLOPs, the roofline, KV sizing and cost (chapter 02).

Every function here is a formula you can do on a whiteboard, written down once so that the book's
numbers come from code: predictions from a model's shape and a GPU's datasheet, not measurements
(the serving metrics a running engine reports, TTFT, TPOT and throughput, are `minillm.eval.bench`'s and
the server's `/metrics`). Each docstring states its formula and its units. Conventions:

* **Bytes are bytes, and GB means 10^9 bytes** (as GPU datasheets use it). Divide by 2^30 for GiB.
* **A multiply-add is 2 FLOPs.** Matrix multiplies are counted; norms, softmax, activations,
  rotary and residual adds are not (they are a few percent of the total for real models).
* **Peak figures are dense** (no 2:4 sparsity), in BF16, from the vendor datasheet named in each
  `GPUSpec.source`. A time computed from them is a lower bound: real kernels reach a fraction of peak.

`config` arguments take a `minillm.config.ModelConfig` or the name of one of `PRESETS`
(``kv_cache_bytes("llama-2-7b", 4096)``); `gpu` arguments take a `GPUSpec` or a key of `GPU_SPECS`.

    from minillm import arithmetic
    arithmetic.kv_cache_bytes("llama-2-7b", seq_len=4096, batch=8) / 1e9     # 17.18 GB
    arithmetic.decode_step_time("llama-2-7b", "h100-sxm", context_len=1024)  # 4.1 ms, bound='memory'

Later chapters add their own arithmetic here (paging waste, quantisation bits, speculative
speed-up, transfer and parallelism costs); each says which chapter introduces it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from minillm.config import ModelConfig

# The engine's block counts (chapter 04) live in minillm.utils, so no engine file imports this module;
# the book's readers find them here too, as arithmetic.cdiv and arithmetic.kv_blocks.
from minillm.utils import cdiv as cdiv
from minillm.utils import kv_blocks as kv_blocks

# ---------------------------------------------------------------------------------------------
# Model configurations
# ---------------------------------------------------------------------------------------------


@dataclass
class GPTConfig(ModelConfig):
    """A GPT-2 / GPT-3 / OPT-style decoder, for arithmetic only (chapter 02).

    These differ from the Llama family in ways that change the parameter and FLOP counts:

    * learned absolute position embeddings, `n_positions` rows of `dim` (no rotary);
    * LayerNorm with a weight *and* a bias (2 x dim parameters) instead of RMSNorm (dim);
    * a 2-matrix MLP, fc2(act(fc1(x))), with `activation` "gelu" (GPT) or "relu" (OPT),
      instead of SwiGLU's three matrices;
    * a bias on every linear layer (set `qkv_bias`, `o_bias` and `mlp_bias`).

    K/V shapes are the same as in a Llama model, so KV-cache sizing needs nothing new.
    minillm's `Transformer` builds Llama-family models only; do not pass it a `GPTConfig`.

    Introduced in chapter 02.
    """

    n_positions: int = 2048
    activation: str = "gelu"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_positions <= 0:
            raise ValueError(f"n_positions must be a positive integer, got {self.n_positions}.")
        if self.activation not in ("gelu", "relu"):
            raise ValueError(f"activation must be 'gelu' or 'relu', got {self.activation!r}.")


def _llama(**kw: object) -> ModelConfig:
    return ModelConfig(**kw)  # type: ignore[arg-type]


# The published configurations. Numbers from each model's Hugging Face `config.json` (or paper),
# as cited; the parameter counts in the comments are what `param_count` returns.
PRESETS: dict[str, ModelConfig] = {
    # meta-llama/Llama-2-7b-hf config.json; Touvron et al. 2023, Table 1. 6,738,415,616 params.
    "llama-2-7b": _llama(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000,
                         max_seq_len=4096, rope_theta=10000.0, norm_eps=1e-5),
    # meta-llama/Llama-2-13b-hf config.json. 13,015,864,320 params.
    "llama-2-13b": _llama(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, vocab_size=32000,
                          max_seq_len=4096, rope_theta=10000.0, norm_eps=1e-5),
    # meta-llama/Llama-2-70b-hf config.json (GQA, 8 KV heads). 68,976,648,192 params.
    "llama-2-70b": _llama(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=32000,
                          max_seq_len=4096, rope_theta=10000.0, norm_eps=1e-5),
    # meta-llama/Meta-Llama-3-8B config.json (128,256-token vocabulary, GQA). 8,030,261,248 params.
    "llama-3-8b": _llama(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                         max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5),
    # meta-llama/Meta-Llama-3-70B config.json. 70,553,706,496 params.
    "llama-3-70b": _llama(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256,
                          max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5),
    # meta-llama/Llama-3.1-405B config.json; Llama 3 Herd of Models, Table 3. 405,853,388,800 params.
    "llama-3.1-405b": _llama(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                             vocab_size=128256, max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # mistralai/Mistral-7B-v0.1 config.json (GQA, 4,096-token sliding window). 7,241,732,096 params.
    "mistral-7b": _llama(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                         max_seq_len=32768, rope_theta=10000.0, norm_eps=1e-5, sliding_window=4096,
                         architecture="MistralForCausalLM"),
    # Qwen/Qwen2.5-7B config.json (q/k/v biases, 4 KV heads, untied head). 7,615,616,512 params.
    "qwen2.5-7b": _llama(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944, vocab_size=152064,
                         max_seq_len=131072, rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True,
                         architecture="Qwen2ForCausalLM"),
    # facebook/opt-13b config.json; Zhang et al. 2022, Table 1. ReLU MLP, biases, LayerNorm, tied
    # embeddings; OPT's learned position table has 2 extra rows (offset 2): 2048 + 2. 12,853,473,280 params.
    "opt-13b": GPTConfig(dim=5120, n_layers=40, n_heads=40, ffn_dim=20480, vocab_size=50272, max_seq_len=2048,
                         n_positions=2050, activation="relu", tie_embeddings=True, qkv_bias=True, o_bias=True,
                         mlp_bias=True, architecture="OPTForCausalLM"),
    # bigcode/starcoder config.json (multi-query attention: 1 KV head for 48 query heads; learned positions,
    # GELU MLP, biases, LayerNorm, tied embeddings: GPTBigCode); Li et al. 2023. 15,517,456,384 params.
    "starcoder-15b": GPTConfig(dim=6144, n_layers=40, n_heads=48, n_kv_heads=1, ffn_dim=24576, vocab_size=49152,
                               max_seq_len=8192, n_positions=8192, activation="gelu", tie_embeddings=True,
                               qkv_bias=True, o_bias=True, mlp_bias=True, architecture="GPTBigCodeForCausalLM"),
    # GPT-3 175B: Brown et al. 2020, Table 2.1 (96 layers, d_model 12288, 96 heads of 128, context 2048,
    # d_ff = 4 d_model) with GPT-2's 50,257-token vocabulary and tied embeddings. Its alternating
    # locally-banded sparse attention changes no parameter count. 174,604,259,328 params.
    "gpt-3-175b": GPTConfig(dim=12288, n_layers=96, n_heads=96, ffn_dim=49152, vocab_size=50257,
                            max_seq_len=2048, n_positions=2048, activation="gelu", tie_embeddings=True,
                            qkv_bias=True, o_bias=True, mlp_bias=True, architecture="GPT3"),
}


def _check_preset(name: str) -> None:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}.")


def preset(name: str) -> ModelConfig:
    """A copy of the published configuration `PRESETS[name]` (e.g. "llama-2-7b").

    Raises ValueError naming the known presets if `name` is not one of them.
    Introduced in chapter 02.
    """
    _check_preset(name)
    return copy.deepcopy(PRESETS[name])


def _config(config: ModelConfig | str) -> ModelConfig:
    if isinstance(config, str):
        _check_preset(config)
        return PRESETS[config]
    if not isinstance(config, ModelConfig):
        raise ValueError(
            f"config must be a minillm ModelConfig or a preset name ({', '.join(PRESETS)}), "
            f"got {type(config).__name__}."
        )
    return config


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if not ok or (value < 0 if allow_zero else value <= 0):
        want = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {want} number, got {value!r}.")


# ---------------------------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPUSpec:
    """The three numbers of a roofline, from the vendor datasheet.

    Attributes:
        name: marketing name.
        peak_flops: dense BF16 tensor-core peak, FLOP/s (datasheets often print the 2:4-sparse
            figure, twice this, with an asterisk).
        memory_bytes: memory capacity in bytes, the datasheet's GB read as 10^9 bytes.
        memory_bandwidth: peak memory bandwidth, bytes/s.
        source: the datasheet the numbers come from.
    """

    name: str
    peak_flops: float
    memory_bytes: float
    memory_bandwidth: float
    source: str

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte at which the roofline bends: peak_flops / memory_bandwidth."""
        return self.peak_flops / self.memory_bandwidth


GPU_SPECS: dict[str, GPUSpec] = {
    "a100-40gb": GPUSpec("NVIDIA A100 SXM 40GB", 312e12, 40e9, 1555e9,
                         "NVIDIA A100 Tensor Core GPU datasheet (BF16 312 TFLOPS dense, 1,555 GB/s)"),
    "a100-80gb": GPUSpec("NVIDIA A100 SXM 80GB", 312e12, 80e9, 2039e9,
                         "NVIDIA A100 Tensor Core GPU datasheet (BF16 312 TFLOPS dense, 2,039 GB/s)"),
    "h100-sxm": GPUSpec("NVIDIA H100 SXM 80GB", 989.4e12, 80e9, 3.35e12,
                        "NVIDIA H100 Tensor Core GPU datasheet (BF16 1,979 TFLOPS with sparsity, 3.35 TB/s)"),
    "h100-pcie": GPUSpec("NVIDIA H100 PCIe 80GB", 756.5e12, 80e9, 2.0e12,
                         "NVIDIA H100 Tensor Core GPU datasheet (BF16 1,513 TFLOPS with sparsity, 2 TB/s)"),
    "h200": GPUSpec("NVIDIA H200 SXM 141GB", 989.4e12, 141e9, 4.8e12,
                    "NVIDIA H200 Tensor Core GPU datasheet (BF16 1,979 TFLOPS with sparsity, 4.8 TB/s)"),
    "l4": GPUSpec("NVIDIA L4 24GB", 121e12, 24e9, 300e9,
                  "NVIDIA L4 Tensor Core GPU datasheet (BF16 242 TFLOPS with sparsity, 300 GB/s)"),
    "l40s": GPUSpec("NVIDIA L40S 48GB", 362.05e12, 48e9, 864e9,
                    "NVIDIA L40S GPU datasheet (BF16 362.05 TFLOPS dense, 864 GB/s)"),
    "a10": GPUSpec("NVIDIA A10 24GB", 125e12, 24e9, 600e9,
                   "NVIDIA A10 Tensor Core GPU datasheet (BF16 125 TFLOPS dense, 600 GB/s)"),
    # No NVIDIA datasheet is published for the AWS-only A10G; its memory system is the A10's, and
    # its tensor cores run BF16 with FP32 accumulation at about 70 TFLOPS dense (AWS G5 material).
    "a10g": GPUSpec("NVIDIA A10G 24GB (AWS G5)", 70e12, 24e9, 600e9,
                    "AWS EC2 G5 instance documentation (no NVIDIA datasheet; BF16 ~70 TFLOPS dense, 600 GB/s)"),
    "mi300x": GPUSpec("AMD Instinct MI300X 192GB", 1307.4e12, 192e9, 5.3e12,
                      "AMD Instinct MI300X accelerator data sheet (BF16 1,307.4 TFLOPS dense, 5.3 TB/s)"),
}


def gpu_spec(gpu: GPUSpec | str) -> GPUSpec:
    """`GPU_SPECS[gpu]` for a name, the spec itself otherwise; ValueError naming the known GPUs.

    Introduced in chapter 02.
    """
    if isinstance(gpu, GPUSpec):
        return gpu
    if isinstance(gpu, str) and gpu in GPU_SPECS:
        return GPU_SPECS[gpu]
    raise ValueError(f"unknown GPU {gpu!r}; pass a GPUSpec or one of: {', '.join(GPU_SPECS)}.")


# Bytes per element of the common number formats.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "float32": 4, "tf32": 4,
    "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
    "fp8": 1, "int8": 1,
    "int4": 0.5, "nf4": 0.5, "fp4": 0.5,
}


def _dtype_bytes(dtype_bytes: float | str) -> float:
    if isinstance(dtype_bytes, str):
        key = dtype_bytes.lower()
        if key not in DTYPE_BYTES:
            raise ValueError(
                f"unknown dtype {dtype_bytes!r}; pass bytes per element or one of: {', '.join(DTYPE_BYTES)}."
            )
        return DTYPE_BYTES[key]
    _positive("dtype_bytes", dtype_bytes)
    return dtype_bytes


# ---------------------------------------------------------------------------------------------
# Parameters and weight memory
# ---------------------------------------------------------------------------------------------


def _layer_params(c: ModelConfig) -> tuple[int, int]:
    """(matmul weights, other parameters) of one block."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    gpt = isinstance(c, GPTConfig)
    attn_w = c.dim * (q + 2 * kv) + q * c.dim
    mlp_w = (2 if gpt else 3) * c.dim * c.ffn_dim
    other = (q + 2 * kv) * c.qkv_bias + c.dim * c.o_bias
    other += ((c.ffn_dim if gpt else 2 * c.ffn_dim) + c.dim) * c.mlp_bias
    other += 2 * c.dim * (2 if gpt else 1)  # two norms: LayerNorm has weight + bias, RMSNorm weight only
    other += 2 * c.head_dim * c.qk_norm
    return attn_w + mlp_w, other


def matmul_params(config: ModelConfig | str) -> int:
    """Weights that take part in a matrix multiply for every token: the FLOP-relevant count.

        matmul_params = n_layers x (attention + MLP matrices) + vocab_size x dim (the LM head)

    with attention = dim x (q + 2 kv) + q x dim (q = n_heads x head_dim, kv = n_kv_heads x head_dim)
    and MLP = 3 dim x ffn_dim (SwiGLU) or 2 dim x ffn_dim (`GPTConfig`). The LM head counts even
    when tied to the embedding (it is still multiplied); embedding and position lookups, norms and
    biases do not (no multiply-add per weight). Units: parameters.

    Introduced in chapter 02.
    """
    c = _config(config)
    return c.n_layers * _layer_params(c)[0] + c.vocab_size * c.dim


def param_count(config: ModelConfig | str) -> int:
    """The exact number of parameters a config implies (a tied embedding/head counted once).

        per block  = attention (dim x (q + 2 kv) + q x dim) + MLP (3 dim x ffn_dim)
                     + 2 norms (dim each) + biases and q/k norms if the config has them
        total      = n_layers x per block + vocab x dim (embedding) + dim (final norm)
                     + vocab x dim (LM head, unless tie_embeddings)

    A `GPTConfig` has a 2-matrix MLP, LayerNorms of 2 x dim, and adds n_positions x dim learned
    positions. Equals `sum(p.numel() for p in Transformer(config).parameters())`.
    Units: parameters. Introduced in chapter 02.
    """
    c = _config(config)
    weights, other = _layer_params(c)
    total = c.n_layers * (weights + other) + c.vocab_size * c.dim * (1 if c.tie_embeddings else 2)
    if isinstance(c, GPTConfig):
        total += c.n_positions * c.dim + 2 * c.dim  # learned positions, final LayerNorm
    else:
        total += c.dim  # final RMSNorm
    return total


def weight_bytes(config_or_n_params: ModelConfig | str | float, bits: float = 16) -> float:
    """Memory of the weights: n_params x bits / 8 bytes.

    `config_or_n_params` is a config, a preset name or a parameter count. `bits` is bits per
    parameter: 32 (FP32), 16 (FP16/BF16), 8 (INT8/FP8), 4 (INT4/NF4), or a fractional value that
    includes quantisation scales (see `effective_bits`: INT4 with an FP16 scale per 128 weights
    is 4.125). Units: bytes (divide by 1e9 for GB). Introduced in chapter 02.
    """
    _positive("bits", bits)
    if isinstance(config_or_n_params, (ModelConfig, str)):
        n = param_count(config_or_n_params)
    else:
        _positive("n_params", config_or_n_params)
        n = config_or_n_params
    return n * bits / 8


def weight_bytes_read(config: ModelConfig | str, n_tokens: int, bits: float = 16) -> float:
    """Bytes of weights one forward pass over `n_tokens` token rows reads from memory:

        every matrix, norm and bias of the blocks, and the final norm     (read once, whatever n_tokens)
        + vocab x dim       the LM head, read whole: every token's logits need every row
        + n_tokens x dim    the embedding rows of the input tokens, gathered one row per token
        + n_tokens x dim    the learned position rows, for a `GPTConfig` only

    all at `bits` per parameter. The embedding table is *not* read whole: a step gathers only the
    rows of its own tokens (B rows for a decode step of B sequences, B x T for a prefill). With tied
    embeddings the LM head *is* the embedding table, so that matrix is counted once, as the head
    (the gather of the input rows is a separate read before it and is counted too). Hence tying
    saves memory (`weight_bytes`) but not traffic: a tied and an untied model of the same shape read
    the same bytes per step. Activations and the KV cache are not included.
    Units: bytes. Introduced in chapter 02.
    """
    _positive("n_tokens", n_tokens)
    _positive("bits", bits)
    c = _config(config)
    tables = 0 if c.tie_embeddings else c.vocab_size * c.dim  # an untied embedding table, apart from the head
    rows = n_tokens * c.dim  # the gathered embedding rows
    if isinstance(c, GPTConfig):
        tables += c.n_positions * c.dim
        rows += n_tokens * c.dim  # and their position rows
    return (param_count(c) - tables + rows) * bits / 8


# ---------------------------------------------------------------------------------------------
# The KV cache
# ---------------------------------------------------------------------------------------------


def kv_cache_bytes_per_token(config: ModelConfig | str, dtype_bytes: float | str = 2) -> float:
    """KV-cache bytes one token adds: 2 (K and V) x n_layers x n_kv_heads x head_dim x dtype_bytes.

    Llama-2-7B in FP16: 2 x 32 x 32 x 128 x 2 = 524,288 bytes (0.5 MiB) per token. Grouped-query
    attention divides this by n_heads / n_kv_heads. `dtype_bytes` is bytes per element, or a
    name from `DTYPE_BYTES` ("fp16", "fp8", ...). Units: bytes. Introduced in chapter 02.
    """
    c = _config(config)
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * _dtype_bytes(dtype_bytes)


def kv_cache_bytes(config: ModelConfig | str, seq_len: int, batch: int = 1, dtype_bytes: float | str = 2) -> float:
    """KV-cache bytes for `batch` sequences of `seq_len` tokens: per token x seq_len x batch.

        2 x n_layers x n_kv_heads x head_dim x dtype_bytes x seq_len x batch

    Every position counts (as in minillm's `KVCache`, which reserves `seq_len` slots); a
    sliding-window model such as Mistral-7B-v0.1 could keep only its window in a rolling buffer.
    Units: bytes. Introduced in chapter 02.
    """
    _positive("seq_len", seq_len, allow_zero=True)
    _positive("batch", batch)
    return kv_cache_bytes_per_token(config, dtype_bytes) * seq_len * batch


@dataclass(frozen=True)
class MLAConfig:
    """The cache shape of multi-head latent attention (DeepSeek-V2, Liu et al. 2024, arXiv:2405.04434, sec. 2.1).

    Instead of K and V per head, each layer caches per token one latent vector c_KV of
    `kv_lora_rank` numbers, shared by every head (the heads' keys and values are up-projections of
    it, folded into the query and output projections at inference), plus one RoPE key of
    `rope_head_dim` numbers, also shared by every head. Introduced in chapter 03.
    """

    name: str
    n_layers: int
    n_heads: int
    head_dim: int  # per-head value (and non-RoPE key) dimension, for the MHA comparison
    kv_lora_rank: int
    rope_head_dim: int


# deepseek-ai/DeepSeek-V2 and DeepSeek-V3 config.json (num_hidden_layers, num_attention_heads, v_head_dim,
# kv_lora_rank, qk_rope_head_dim).
MLA_PRESETS: dict[str, MLAConfig] = {
    "deepseek-v2": MLAConfig("DeepSeek-V2", n_layers=60, n_heads=128, head_dim=128, kv_lora_rank=512, rope_head_dim=64),
    "deepseek-v3": MLAConfig("DeepSeek-V3", n_layers=61, n_heads=128, head_dim=128, kv_lora_rank=512, rope_head_dim=64),
}


def mla_cache_bytes_per_token(config: MLAConfig | str, dtype_bytes: float | str = 2) -> float:
    """KV-cache bytes one token adds under MLA: n_layers x (kv_lora_rank + rope_head_dim) x dtype_bytes.

    DeepSeek-V2: 60 x (512 + 64) x 2 = 69,120 bytes, against 2 x 60 x 128 x 128 x 2 = 3,932,160 for
    the same 128 heads with plain MHA (57x less). Introduced in chapter 03.
    """
    if isinstance(config, str):
        if config not in MLA_PRESETS:
            raise ValueError(f"unknown MLA preset {config!r}; choose one of: {', '.join(MLA_PRESETS)}.")
        config = MLA_PRESETS[config]
    return config.n_layers * (config.kv_lora_rank + config.rope_head_dim) * _dtype_bytes(dtype_bytes)


def max_batch_size(
    config: ModelConfig | str,
    gpu_memory_bytes: float,
    seq_len: int,
    weight_bits: float = 16,
    kv_dtype_bytes: float | str = 2,
    reserve_bytes: float = 0.0,
    memory_utilization: float = 1.0,
) -> int:
    """How many sequences of `seq_len` tokens fit beside the weights:

        floor((gpu_memory_bytes x memory_utilization - weight_bytes - reserve_bytes)
              / kv_cache_bytes(config, seq_len, 1))

    `reserve_bytes` sets aside memory that is neither weights nor KV: activations of the largest
    forward, the CUDA context and allocator slack (a few GB on a real server; 0 gives the
    theoretical ceiling). `memory_utilization` is the fraction of the card the engine may use
    (vLLM's `gpu_memory_utilization`, 0.9 by default there). Returns 0 when the weights do not
    fit. Units: sequences. Introduced in chapter 02.
    """
    _positive("gpu_memory_bytes", gpu_memory_bytes)
    _positive("seq_len", seq_len)
    _positive("reserve_bytes", reserve_bytes, allow_zero=True)
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}.")
    free = gpu_memory_bytes * memory_utilization - weight_bytes(config, weight_bits) - reserve_bytes
    per_seq = kv_cache_bytes(config, seq_len, 1, kv_dtype_bytes)
    return max(0, math.floor(free / per_seq))


def max_batch_size_with_kv_heads(
    config: ModelConfig | str,
    n_kv_heads: int,
    gpu_memory_bytes: float,
    seq_len: int,
    weight_bits: float = 16,
    kv_dtype_bytes: float | str = 2,
    reserve_bytes: float = 0.0,
) -> int:
    """`max_batch_size` of `config` converted to `n_kv_heads` K/V heads by pooling (MHA -> GQA -> MQA):

        max_batch_size(config with n_kv_heads replaced, gpu_memory_bytes, seq_len, ...)

    Only the K/V heads change. The KV cache per token shrinks by config.n_kv_heads / n_kv_heads, and
    the weights shrink too: each layer's k and v projections lose 2 x dim x (H_kv - n_kv_heads) x
    head_dim weights (and their biases), which become room for cache. Pooling merges equal groups of
    the current heads, so `n_kv_heads` must divide `config.n_kv_heads` (see `minillm.train.gqa`).
    Units: sequences. Introduced in chapter 03.
    """
    c = _config(config)
    valid = [d for d in range(1, c.n_kv_heads + 1) if c.n_kv_heads % d == 0]
    if isinstance(n_kv_heads, bool) or n_kv_heads not in valid:
        raise ValueError(f"n_kv_heads={n_kv_heads!r}: pooling merges equal groups of the config's {c.n_kv_heads} "
                         f"K/V heads, so it must divide {c.n_kv_heads}; valid values are "
                         f"{', '.join(map(str, valid))}.")
    return max_batch_size(replace(c, n_kv_heads=n_kv_heads), gpu_memory_bytes, seq_len, weight_bits,
                          kv_dtype_bytes, reserve_bytes)


# ---------------------------------------------------------------------------------------------
# FLOPs, bytes and the roofline
# ---------------------------------------------------------------------------------------------


def flops_per_token(config: ModelConfig | str, context_len: int) -> float:
    """Forward FLOPs for one token that attends to `context_len` keys (itself included):

        2 x matmul_params(config)                                (weights: one multiply-add each)
        + 4 x n_layers x n_heads x head_dim x context_len         (q.k scores and the weighted sum of v)

    Convention: a multiply-add is 2 FLOPs; norms, softmax, activations and rotary are left out.
    The LM head counts (a generated token needs its logits). `context_len=0` leaves attention
    out, giving the "2N FLOPs per token" rule of thumb. Units: FLOPs. Introduced in chapter 02.
    """
    _positive("context_len", context_len, allow_zero=True)
    c = _config(config)
    return 2 * matmul_params(c) + 4 * c.n_layers * c.n_heads * c.head_dim * context_len


def prefill_flops(config: ModelConfig | str, prompt_len: int) -> float:
    """Forward FLOPs to prefill one prompt of n = `prompt_len` tokens, causally:

        2 x (matmul_params - vocab x dim) x n       (every block matrix, for every prompt token)
        + 2 x vocab x dim                            (logits for the last position only)
        + 4 x n_layers x n_heads x head_dim x n(n+1)/2   (token t attends to t keys)

    Only the last position's logits are computed (as minillm's `forward(last_only=True)` and
    serving engines do), and attention counts only the unmasked half of the n x n scores.
    Units: FLOPs. Introduced in chapter 02.
    """
    _positive("prompt_len", prompt_len)
    c = _config(config)
    head = c.vocab_size * c.dim
    n = prompt_len
    return 2 * (matmul_params(c) - head) * n + 2 * head + 4 * c.n_layers * c.n_heads * c.head_dim * n * (n + 1) // 2


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte of memory traffic: flops / bytes_moved. Units: FLOP/byte.

    Below a GPU's ridge point (peak FLOP/s / bandwidth) a kernel is memory-bound, above it
    compute-bound. Introduced in chapter 02.
    """
    _positive("flops", flops, allow_zero=True)
    _positive("bytes_moved", bytes_moved)
    return flops / bytes_moved


def ridge_point(peak_flops: float, peak_bandwidth: float) -> float:
    """The arithmetic intensity where the roofline bends: peak_flops / peak_bandwidth (FLOP/byte).

    For decode with 16-bit weights the intensity is about the batch size (2 FLOPs per weight per
    sequence, 2 bytes per weight), so this is also roughly the batch at which decode turns
    compute-bound. Introduced in chapter 02.
    """
    _positive("peak_flops", peak_flops)
    _positive("peak_bandwidth", peak_bandwidth)
    return peak_flops / peak_bandwidth


class Roofline(NamedTuple):
    """The roofline estimate of one kernel or step.

    Attributes:
        time_s: max(compute_s, memory_s), seconds.
        bound: "compute" if compute_s >= memory_s, else "memory".
        compute_s: flops / peak_flops, seconds.
        memory_s: bytes_moved / peak_bandwidth, seconds.
        flops: FLOPs of the step.
        bytes_moved: bytes read and written by the step.
    """

    time_s: float
    bound: str
    compute_s: float
    memory_s: float
    flops: float
    bytes_moved: float

    @property
    def intensity(self) -> float:
        """flops / bytes_moved, FLOP/byte."""
        return self.flops / self.bytes_moved


def roofline_time(flops: float, bytes_moved: float, peak_flops: float, peak_bandwidth: float) -> Roofline:
    """Lower bound on the time of a step that does `flops` and moves `bytes_moved`:

        time_s = max(flops / peak_flops, bytes_moved / peak_bandwidth)

    assuming compute and memory traffic overlap perfectly. The larger term names the bound
    (a tie counts as "compute"). Units: FLOPs, bytes, FLOP/s, bytes/s -> seconds.
    Introduced in chapter 02.
    """
    _positive("flops", flops, allow_zero=True)
    _positive("bytes_moved", bytes_moved)
    _positive("peak_flops", peak_flops)
    _positive("peak_bandwidth", peak_bandwidth)
    compute_s, memory_s = flops / peak_flops, bytes_moved / peak_bandwidth
    bound = "compute" if compute_s >= memory_s else "memory"
    return Roofline(max(compute_s, memory_s), bound, compute_s, memory_s, flops, bytes_moved)


def decode_step_time(
    config: ModelConfig | str,
    gpu: GPUSpec | str,
    context_len: int,
    batch: int = 1,
    weight_bits: float = 16,
    kv_dtype_bytes: float | str = 2,
    n_gpus: int = 1,
) -> Roofline:
    """Roofline time of one decode step: `batch` sequences each add one token at `context_len`.

        flops = batch x flops_per_token(config, context_len)
        bytes = weight_bytes_read(config, batch, weight_bits) + batch x kv_cache_bytes(config, context_len)

    Every weight matrix is read once per step whatever the batch (that is why batching decode is
    nearly free until compute catches up), and each sequence reads its own KV cache. Of the
    embedding table only the batch's `batch` rows are read; the LM head's vocab x dim matrix is read
    whole (see `weight_bytes_read`). Activations are ignored. `n_gpus` splits the work ideally
    (tensor parallel with free communication): peak FLOP/s and bandwidth both multiply by n_gpus.
    Tokens/s = batch / time_s. Units: seconds (in `Roofline`). Introduced in chapter 02.
    """
    _positive("batch", batch)
    _positive("n_gpus", n_gpus)
    spec = gpu_spec(gpu)
    flops = batch * flops_per_token(config, context_len)
    moved = weight_bytes_read(config, batch, weight_bits) + kv_cache_bytes(config, context_len, batch, kv_dtype_bytes)
    return roofline_time(flops, moved, spec.peak_flops * n_gpus, spec.memory_bandwidth * n_gpus)


def prefill_time(
    config: ModelConfig | str,
    gpu: GPUSpec | str,
    prompt_len: int,
    batch: int = 1,
    weight_bits: float = 16,
    kv_dtype_bytes: float | str = 2,
    n_gpus: int = 1,
) -> Roofline:
    """Roofline time to prefill `batch` prompts of `prompt_len` tokens (the floor under TTFT).

        flops = batch x prefill_flops(config, prompt_len)
        bytes = weight_bytes_read(config, batch x prompt_len, weight_bits) + kv_cache_bytes(config, prompt_len, batch)

    The weights are read once and reused by every prompt token, so prefill is compute-bound for
    all but the shortest prompts; the KV cache is written once. As in decode, only the prompt
    tokens' embedding rows are read, and the LM head whole. `n_gpus` as in `decode_step_time`.
    Units: seconds (in `Roofline`). Introduced in chapter 02.
    """
    _positive("batch", batch)
    _positive("n_gpus", n_gpus)
    spec = gpu_spec(gpu)
    flops = batch * prefill_flops(config, prompt_len)
    moved = (weight_bytes_read(config, batch * prompt_len, weight_bits)
             + kv_cache_bytes(config, prompt_len, batch, kv_dtype_bytes))
    return roofline_time(flops, moved, spec.peak_flops * n_gpus, spec.memory_bandwidth * n_gpus)


# ---------------------------------------------------------------------------------------------
# Cost
# ---------------------------------------------------------------------------------------------


def cost_per_million_tokens(
    usd_per_gpu_hour: float, tokens_per_second: float, n_gpus: int = 1, utilization: float = 1.0
) -> float:
    """Dollars per million tokens of a deployment:

        usd_per_gpu_hour x n_gpus x 1e6 / (tokens_per_second x 3600 x utilization)

    `tokens_per_second` is the throughput of all `n_gpus` together while busy; `utilization` is
    the fraction of paid hours they are busy (idle hours are still paid). Units: USD per 10^6
    tokens. Introduced in chapter 02.
    """
    _positive("usd_per_gpu_hour", usd_per_gpu_hour, allow_zero=True)
    _positive("tokens_per_second", tokens_per_second)
    _positive("n_gpus", n_gpus)
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1] (the busy fraction of paid time), got {utilization}.")
    return usd_per_gpu_hour * n_gpus * 1e6 / (tokens_per_second * 3600 * utilization)


# ---------------------------------------------------------------------------------------------
# Later chapters' arithmetic
# ---------------------------------------------------------------------------------------------


def contiguous_kv_waste(lengths: Sequence[int], max_len: int) -> float:
    """Fraction of reserved KV slots left unused when every sequence reserves `max_len` slots:

        1 - sum(lengths) / (len(lengths) x max_len)

    Units: fraction in [0, 1). Introduced in chapter 04.
    """
    _positive("max_len", max_len)
    if not lengths:
        raise ValueError("lengths is empty; pass the token count of each sequence.")
    if max(lengths) > max_len or min(lengths) < 0:
        raise ValueError(f"every length must be in [0, max_len={max_len}], got {min(lengths)}..{max(lengths)}.")
    return 1 - sum(lengths) / (len(lengths) * max_len)


def paged_kv_waste(lengths: Sequence[int], block_size: int = 16) -> float:
    """Fraction of allocated KV slots left unused under paging (only each last block is partial):

        1 - sum(lengths) / (block_size x sum(ceil(l / block_size)))

    Units: fraction in [0, 1). Introduced in chapter 04.
    """
    if not lengths:
        raise ValueError("lengths is empty; pass the token count of each sequence.")
    slots = block_size * sum(kv_blocks(n, block_size) for n in lengths)
    if slots == 0:
        return 0.0
    return 1 - sum(lengths) / slots


def static_batch_utilization(output_lengths: Sequence[int]) -> float:
    """Useful fraction of decode slots in a static batch that runs until its longest member ends:

        sum(output_lengths) / (len(output_lengths) x max(output_lengths))

    Continuous batching refills a finished slot at the next step, so it approaches 1.
    Units: fraction in (0, 1]. Introduced in chapter 05.
    """
    if not output_lengths or min(output_lengths) < 0 or max(output_lengths) == 0:
        raise ValueError("output_lengths must be non-negative token counts, at least one of them positive.")
    return sum(output_lengths) / (len(output_lengths) * max(output_lengths))


def effective_bits(bits: float, group_size: int | None = None, scale_bits: float = 16, zero_bits: float = 0) -> float:
    """Bits per weight once the quantisation scales are paid for:

        bits + (scale_bits + zero_bits) / group_size      (group_size None = per-tensor: just bits)

    INT4 with one FP16 scale per group of 128: 4 + 16/128 = 4.125. Add `zero_bits` for an
    asymmetric format's zero point. Units: bits per weight. Introduced in chapter 06.
    """
    _positive("bits", bits)
    if group_size is None:
        return float(bits)
    _positive("group_size", group_size)
    return bits + (scale_bits + zero_bits) / group_size


def quant_step(absmax: float, bits: int = 8) -> float:
    """Step between representable values of symmetric integer quantisation:

        scale = absmax / (2^(bits-1) - 1)        (127 levels each side for INT8, 7 for INT4)

    A value is stored as round(x / scale); the rounding error is at most scale / 2. One outlier
    sets `absmax` for the whole tensor under per-tensor scaling. Units: the units of x.
    Introduced in chapter 06.
    """
    _positive("absmax", absmax)
    if not isinstance(bits, int) or bits < 2:
        raise ValueError(f"bits must be an integer >= 2, got {bits!r}.")
    return absmax / (2 ** (bits - 1) - 1)


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens one target pass yields with k drafted tokens, each accepted with prob. alpha:

        (1 - alpha^(k+1)) / (1 - alpha)          (= k + 1 when alpha = 1)

    The accepted run has length j < k with probability alpha^j (1 - alpha), and the target adds
    one token of its own (the correction, or a bonus token when all k pass). Assumes acceptances
    are independent with a fixed rate. Units: tokens per target forward. Introduced in chapter 07.
    """
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha is a probability, so must be in [0, 1]; got {alpha}.")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k (tokens drafted per step) must be a non-negative integer, got {k!r}.")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def speculative_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Expected wall-time speed-up of speculative decoding over plain decoding:

        expected_tokens_per_step(alpha, k) / (verify_cost + k x draft_cost)

    `draft_cost` is c, the time of one draft forward relative to one target decode step; a step costs
    k draft forwards and one verify forward. `verify_cost` is v_k, the verify forward over k + 1
    positions in decode steps: 1 (the default) takes it at the price of one, which holds while decode
    is memory-bound; a measured v_k gives the prediction to compare a measurement with. Below 1 it is a
    slow-down. Units: ratio. Introduced in chapter 07.
    """
    _positive("draft_cost", draft_cost, allow_zero=True)
    _positive("verify_cost", verify_cost)
    return expected_tokens_per_step(alpha, k) / (verify_cost + k * draft_cost)


def best_speculation_length(alpha: float, draft_cost: float, max_k: int = 16) -> int:
    """The k in 1..max_k that maximises `speculative_speedup(alpha, k, draft_cost)`.

    Units: tokens. Introduced in chapter 07.
    """
    if not isinstance(max_k, int) or max_k < 1:
        raise ValueError(f"max_k must be a positive integer, got {max_k!r}.")
    return max(range(1, max_k + 1), key=lambda k: speculative_speedup(alpha, k, draft_cost))


def kv_transfer_time(
    config: ModelConfig | str,
    seq_len: int,
    link_bandwidth: float,
    batch: int = 1,
    dtype_bytes: float | str = 2,
    latency_s: float = 0.0,
) -> float:
    """Time to ship a prefilled KV cache from a prefill worker to a decode worker:

        kv_cache_bytes(config, seq_len, batch, dtype_bytes) / link_bandwidth + latency_s

    `link_bandwidth` in bytes/s: a 400 Gb/s NIC is 50e9 bytes/s; NVLink 4 is 900e9 bytes/s per
    GPU (both directions together). Transfers can overlap prefill layer by layer; this is the
    time if they do not. Units: seconds. Introduced in chapter 08.
    """
    _positive("link_bandwidth", link_bandwidth)
    _positive("latency_s", latency_s, allow_zero=True)
    return kv_cache_bytes(config, seq_len, batch, dtype_bytes) / link_bandwidth + latency_s


def ring_allreduce_bytes(message_bytes: float, n_gpus: int) -> float:
    """Bytes each GPU sends (and receives) in a ring all-reduce of a `message_bytes` tensor:

        2 x (n_gpus - 1) / n_gpus x message_bytes      (reduce-scatter, then all-gather)

    Tensor parallelism runs two of these per transformer block (after attention and after the
    MLP), each over the activations [tokens, dim]. Units: bytes. Introduced in chapter 08.
    """
    _positive("message_bytes", message_bytes, allow_zero=True)
    if not isinstance(n_gpus, int) or n_gpus < 1:
        raise ValueError(f"n_gpus must be a positive integer, got {n_gpus!r}.")
    return 2 * (n_gpus - 1) / n_gpus * message_bytes


def pipeline_bubble_fraction(n_stages: int, n_microbatches: int) -> float:
    """Idle fraction of a GPipe-style pipeline: (p - 1) / (m + p - 1) for p stages, m micro-batches.

    Each stage waits p - 1 slots to fill and drain the pipeline out of m + p - 1.
    Units: fraction in [0, 1). Introduced in chapter 08.
    """
    for name, v in (("n_stages", n_stages), ("n_microbatches", n_microbatches)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}.")
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_params(config: ModelConfig | str, rank: int, targets: Sequence[str] = ("q_proj", "v_proj")) -> int:
    """Parameters of a LoRA adapter: rank x (in + out) per adapted projection and layer (A [r, in], B [out, r]).

    `targets` are PEFT's names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj). A full fine-tune
    of the same projections changes in x out numbers each. Introduced in chapter 08.
    """
    c = _config(config)
    _positive("rank", rank)
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {"q_proj": (c.dim, q), "k_proj": (c.dim, kv), "v_proj": (c.dim, kv), "o_proj": (q, c.dim),
              "gate_proj": (c.dim, c.ffn_dim), "up_proj": (c.dim, c.ffn_dim), "down_proj": (c.ffn_dim, c.dim)}
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {unknown}: use PEFT's names {list(LORA_TARGETS)}.")
    return c.n_layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)


def lora_bytes(config: ModelConfig | str, rank: int, targets: Sequence[str] = ("q_proj", "v_proj"),
               dtype_bytes: float | str = 2) -> float:
    """Bytes of a LoRA adapter's weights: lora_params(...) x dtype_bytes (bf16: 2). Introduced in chapter 08."""
    return lora_params(config, rank, targets) * _dtype_bytes(dtype_bytes)
