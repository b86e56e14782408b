"""The Llama-family transformer on one page (chapter 00).

    tokens [B, T] ─ embed ─► x [B, T, dim]
        repeat n_layers:  x = x + Attention(RMSNorm(x))     (rotary on q, k; GQA by n_kv_heads)
                          x = x + MLP(RMSNorm(x))           (SwiGLU)
    RMSNorm ─ lm_head ─► logits [B, T, vocab]

One `forward` serves prefill (many tokens), decode (one token per sequence) and anything
between: it takes token ids, their positions and an optional cache, and the cache decides where
keys and values live. Module names follow Hugging Face's (`self_attn.q_proj`, `mlp.gate_proj`,
...), so a checkpoint's tensor names map onto this model by dropping the `model.` prefix; vLLM
uses the same names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minillm.config import ModelConfig
from minillm.kv_cache import KVCache


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back (as Llama does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim], same dtype."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The rotary frequencies theta^(-2i/head_dim), i < head_dim/2, after any scaling. [head_dim/2] fp32.

    Scalings: "linear" divides every frequency by `factor`; "llama3" (Llama 3.1+) divides only
    the low frequencies (wavelengths longer than original_context / low_freq_factor) by
    `factor`, keeps the high ones, and blends smoothly in between.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_mid, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Turns positions into the cos/sin tables that rotate queries and keys."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        # `model.to(torch.bfloat16)` would round the frequencies to bf16 and skew every angle:
        # after any move or cast, recompute them in fp32 on the new device.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inverse_frequencies(self.config).to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin each [B, 1, T, head_dim] in `dtype` (angles in fp32)."""
        angles = positions[..., None].float() * self.inv_freq  # [B, T, head_dim/2]
        angles = torch.cat((angles, angles), dim=-1)  # [B, T, head_dim]
        return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x_i, x_{i+d/2}) pair by its angle. x [B, H, T, d], cos/sin [B, 1, T, d].

    This is the "rotate-half" layout Hugging Face checkpoints use (their q/k weights are
    permuted to match), not the interleaved layout of the original Llama code.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Multi-head attention with `n_kv_heads` key/value heads (MHA, GQA or MQA)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=config.o_bias)
        if config.qk_norm:  # Qwen3: RMSNorm over each head's features, before rotary
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
    ) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]. `mask` [B, 1, T, S] bool (True = may attend) or None."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, head_dim]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # [B, n_kv_heads, S, head_dim], S = past + T
        # Each group of n_heads / n_kv_heads query heads reads the same K/V head; SDPA does the
        # grouping itself (enable_gqa), so K/V are never copied per query head.
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.n_kv_heads != self.n_heads
        )  # [B, n_heads, T, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.ffn_dim, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim] through a [B, T, ffn_dim] hidden layer."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm transformer block: attention then MLP, each added to the residual stream."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, cache):  # noqa: ANN001 - same arguments as Attention
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def attention_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, sliding_window: int | None = None
) -> torch.Tensor:
    """Which keys each query may see: k_pos <= q_pos (and k_pos > q_pos - window).

    q_positions [B, T], k_positions [B, S] -> bool mask [B, 1, T, S], True = attend.
    """
    q, k = q_positions[:, :, None], k_positions[:, None, :]
    allowed = k <= q
    if sliding_window is not None:
        allowed &= k > q - sliding_window
    return allowed[:, None]


class Transformer(nn.Module):
    """A Llama-family causal language model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With `tie_embeddings`, the output head and the embedding share one matrix."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits for `tokens`.

        Args:
            tokens: [B, T] token ids.
            positions: [B, T] (or [T]) their positions; default: the next T positions after
                what `cache` holds (0..T-1 without a cache).
            cache: a `KVCache` to read past keys/values from and append these T to, or None.
            last_only: return logits of the last position only (what decoding needs).

        Returns:
            logits [B, T, vocab] (or [B, 1, vocab] with `last_only`), in the model's dtype.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq_len], got shape {tuple(tokens.shape)}.")
        B, T = tokens.shape
        past = cache.seq_len if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + T, device=tokens.device)
        positions = positions.expand(B, T)
        x = self.embed_tokens(tokens)  # [B, T, dim]
        cos, sin = self.rotary(positions, x.dtype)

        # Keys are this call's tokens (no cache) or every slot the cache holds after appending.
        window = self.config.sliding_window
        if T == 1 and (window is None or past < window):
            mask = None  # one query sees every key: nothing to mask
        else:
            keys = positions if cache is None else torch.arange(past + T, device=tokens.device).expand(B, -1)
            mask = attention_mask(positions, keys, window)

        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))

    def num_parameters(self) -> int:
        """Parameters, counting a tied embedding/head matrix once."""
        return sum(p.numel() for p in self.parameters())
