"""Chapter 00's exercise tasks: count parameters, RMSNorm, rotary embeddings.

Each task's tests compare the reader's function with minillm's own implementation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minillm import arithmetic
from minillm.book.grading.registry import MismatchError, expect_close, expect_equal, register_task
from minillm.config import ModelConfig
from minillm.model import RMSNorm, RotaryEmbedding, Transformer, apply_rotary

# ---- 00.param_count ---------------------------------------------------------------------------------


def reference_param_count(config: ModelConfig) -> int:
    """Parameters of a Llama-family model (the exercise's configs have no biases or q/k-norm)."""
    return arithmetic.param_count(config)


param_count = register_task(
    "00.param_count",
    "count_params(config: ModelConfig) -> int  (Llama-family, no biases, no q/k-norm)",
    reference=reference_param_count,
    forbid=("minillm.arithmetic.param_count", "minillm.model.Transformer.num_parameters"),
)

# Published shapes (Hugging Face config.json of each model).
LLAMA_2_7B = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000)
LLAMA_3_8B = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)


def _count_hint(config: ModelConfig, got: object, expected: int) -> str:
    if not isinstance(got, int):
        return "return a Python int (use int(...) if you computed with floats or tensors)."
    diff = expected - got
    d = config.dim
    if diff == config.vocab_size * d:
        return "an untied model has a separate output head of vocab_size × dim."
    if -diff == config.vocab_size * d:
        return "with tie_embeddings the output head IS the embedding matrix: count it once."
    if diff % d == 0 and 0 < diff // d <= 2 * config.n_layers + 1:
        return "each block has two RMSNorm weights of size dim, and there is one final norm."
    kv_part = 2 * d * (config.n_heads - config.n_kv_heads) * config.head_dim * config.n_layers
    if kv_part and -diff == kv_part:
        return "k_proj and v_proj have n_kv_heads × head_dim outputs, not n_heads × head_dim (GQA)."
    return "per block: q, k, v, o projections + three MLP matrices (gate, up, down) + two norms."


def _check_count(count_params: Callable[[ModelConfig], int], config: ModelConfig, what: str) -> None:
    expected = reference_param_count(config)
    got = count_params(config)
    expect_equal(got, expected, what, _count_hint(config, got, expected))


@param_count.test("a small GQA model with tied embeddings matches the live tensors")
def _(count_params: Callable) -> None:
    config = ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=160, vocab_size=300,
                         tie_embeddings=True)
    live = Transformer(config).num_parameters()
    got = count_params(config)
    expect_equal(got, live, "count_params(tiny tied GQA config)", _count_hint(config, got, live))


@param_count.test("Llama-2-7B (MHA, untied head): 6,738,415,616")
def _(count_params: Callable) -> None:
    _check_count(count_params, LLAMA_2_7B, "count_params(Llama-2-7B config)")


@param_count.test("Llama-3-8B (GQA 32/8, 128k vocabulary): 8,030,261,248")
def _(count_params: Callable) -> None:
    _check_count(count_params, LLAMA_3_8B, "count_params(Llama-3-8B config)")


@param_count.test("an explicit head_dim that is not dim / n_heads")
def _(count_params: Callable) -> None:
    config = ModelConfig(dim=48, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96, vocab_size=100)
    _check_count(count_params, config, "count_params(head_dim=32 with dim=48, 4 heads)")


# ---- 00.rms_norm ------------------------------------------------------------------------------------


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """minillm's RMSNorm as a function. x [..., dim], weight [dim] -> [..., dim] in x's dtype."""
    norm = RMSNorm(weight.shape[0], eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm.to(weight.dtype)(x)


rms_norm = register_task(
    "00.rms_norm",
    "rms_norm(x: Tensor[..., dim], weight: Tensor[dim], eps: float) -> Tensor[..., dim]",
    reference=reference_rms_norm,
    forbid=("minillm.model.RMSNorm", "torch.nn.functional.rms_norm", "torch.rms_norm", "torch.nn.RMSNorm"),
)


def _check_norm(fn: Callable, x: torch.Tensor, weight: torch.Tensor, eps: float, what: str, atol: float = 1e-5,
                hint: str = "divide x by sqrt(mean(x², over the last axis) + eps), then multiply by weight.") -> None:
    with torch.no_grad():
        got = fn(x.clone(), weight.clone(), eps)
    expect_close(got, reference_rms_norm(x, weight, eps), what, hint, atol=atol, rtol=atol)


@rms_norm.test("matches minillm's RMSNorm on random [2, 7, 64] fp32 input")
def _(fn: Callable) -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 7, 64, generator=g) * 3, torch.rand(64, generator=g) + 0.5
    _check_norm(fn, x, w, 1e-5, "rms_norm(x, weight, 1e-5)")


@rms_norm.test("eps goes inside the square root: an all-zero row gives zeros, not NaN")
def _(fn: Callable) -> None:
    x, w = torch.zeros(3, 16), torch.ones(16)
    _check_norm(fn, x, w, 1e-6, "rms_norm(zeros, ones, 1e-6)",
                hint="sqrt(mean(x²) + eps) — adding eps after the square root, or not at all, divides by 0.")


@rms_norm.test("normalises over the last axis only, for any leading shape")
def _(fn: Callable) -> None:
    g = torch.Generator().manual_seed(1)
    for shape in [(5, 32), (1, 1, 3, 16)]:
        x, w = torch.randn(*shape, generator=g), torch.randn(shape[-1], generator=g)
        _check_norm(fn, x, w, 1e-5, f"rms_norm on shape {shape}",
                    hint="take the mean over dim=-1 with keepdim=True so it broadcasts back.")


@rms_norm.test("bf16 input: computed in fp32, returned in bf16")
def _(fn: Callable) -> None:
    g = torch.Generator().manual_seed(2)
    x, w = (torch.randn(4, 128, generator=g) * 20).bfloat16(), (torch.rand(128, generator=g) + 0.5).bfloat16()
    _check_norm(fn, x, w, 1e-5, "rms_norm(bf16 x, bf16 weight)", atol=2e-2,
                hint="cast x to float32 for the mean and rsqrt, then cast back to x.dtype before the weight.")


# ---- 00.rotary --------------------------------------------------------------------------------------


def reference_apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """minillm's rotary as a function. x [B, H, T, D], positions [T] (int) -> [B, H, T, D]."""
    config = ModelConfig(dim=x.shape[-1], n_heads=1, rope_theta=theta)
    cos, sin = RotaryEmbedding(config)(positions[None], torch.float32)  # [1, 1, T, D]
    return apply_rotary(x.float(), cos, sin).to(x.dtype)


rotary = register_task(
    "00.rotary",
    "apply_rope(x: Tensor[B, H, T, D], positions: Tensor[T] (int), theta: float) -> Tensor[B, H, T, D]",
    reference=reference_apply_rope,
    forbid=("minillm.model.apply_rotary", "minillm.model.RotaryEmbedding"),
)

_ROPE_HINT = ("pair x[..., i] with x[..., i + D/2] (rotate-half), angle = position × theta^(-2i/D); "
              "x_i' = x_i cos − x_{i+D/2} sin, x_{i+D/2}' = x_{i+D/2} cos + x_i sin.")


def _check_rope(fn: Callable, x: torch.Tensor, positions: torch.Tensor, theta: float, what: str,
                hint: str = _ROPE_HINT) -> None:
    with torch.no_grad():
        got = fn(x.clone(), positions.clone(), theta)
    expect_close(got, reference_apply_rope(x, positions, theta), what, hint, atol=1e-4, rtol=1e-4)


@rotary.test("position 0 leaves the vector unchanged")
def _(fn: Callable) -> None:
    x = torch.randn(1, 2, 1, 8, generator=torch.Generator().manual_seed(3))
    _check_rope(fn, x, torch.zeros(1, dtype=torch.long), 10000.0, "apply_rope(x, positions=[0])",
                hint="at position 0 every angle is 0: cos = 1, sin = 0.")


@rotary.test("matches minillm's rotary for positions 0..T-1 ([2, 4, 6, 16])")
def _(fn: Callable) -> None:
    x = torch.randn(2, 4, 6, 16, generator=torch.Generator().manual_seed(4))
    _check_rope(fn, x, torch.arange(6), 10000.0, "apply_rope(x, arange(6), 10000)")


@rotary.test("arbitrary positions (a decode step at position 1000) and another theta")
def _(fn: Callable) -> None:
    x = torch.randn(1, 3, 2, 32, generator=torch.Generator().manual_seed(5))
    _check_rope(fn, x, torch.tensor([1000, 7]), 500000.0, "apply_rope(x, [1000, 7], theta=500000)",
                hint="use the positions you are given (not 0..T-1) and the theta argument. " + _ROPE_HINT)


@rotary.test("rotation keeps every vector's length")
def _(fn: Callable) -> None:
    x = torch.randn(1, 1, 5, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = fn(x.clone(), torch.arange(5) * 37, 10000.0)
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        raise MismatchError("apply_rope(x, ...)", f"a tensor of shape {tuple(x.shape)}",
                       type(got).__name__ if not isinstance(got, torch.Tensor) else tuple(got.shape))
    expect_close(got.norm(dim=-1), x.norm(dim=-1), "‖apply_rope(x)‖ per position", atol=1e-4, rtol=1e-4,
                 hint="a rotation never changes length: each pair must get cos and sin of the same angle.")
