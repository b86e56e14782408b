"""The Llama-family transformer on one page (chapter 00).

    tokens [B, T] ─ embed ─► x [B, T, dim]
        repeat n_layers:  x = x + Attention(RMSNorm(x))     (rotary on q, k; GQA by n_kv_heads)
                          x = x + MLP(RMSNorm(x))           (SwiGLU)
    RMSNorm ─ lm_head ─► logits [B, T, vocab]

One `forward` serves prefill (many tokens), decode (one token per sequence) and anything
between: it takes token ids, their positions and an optional cache, and the cache decides where
keys and values live: `CacheView` is all the forward asks of it (the contiguous `KVCache` of
chapter 02 and the paged cache of chapter 04 both answer it).

Module names follow vLLM's, which follow Hugging Face's, except that the q/k/v projections are
stacked into one `qkv_proj` and the MLP's gate/up into one `gate_up_proj`: one large matmul
instead of several small ones, the layout every serving engine uses.
`minillm.checkpoints` stacks the checkpoint's separate matrices on load and splits them on save.
On a CUDA GPU, prefill attention runs minillm's Triton FlashAttention kernel (chapter 02; see
`use_triton_attention`, and MINILLM_TRITON=0 to turn it off), decode attention its decode kernels
(chapters 03-04), and the small steps between the matrix multiplies run fused (`use_fused_kernels`:
residual add + RMSNorm, rotary, silu * up, each one Triton kernel instead of several PyTorch ones);
everywhere else, the CPU above all, the model runs in PyTorch, as written below.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minillm.config import ModelConfig
from minillm.quant.kv import QuantizedPool


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
    `factor`, keeps the high ones, and blends smoothly in between; "yarn" (Peng et al., 2023) does the
    same by how many turns a frequency makes over the original context: frequencies that turn more than
    `beta_fast` times are kept, those that turn fewer than `beta_slow` times are divided by `factor`, with a
    linear ramp over the dimensions between (its attention factor is `rope_attention_factor`).
    """
    d = config.head_dim
    # On the CPU, even inside `with torch.device("meta")` (where loaders build a model's shapes): arithmetic on meta
    # tensors imports torch's compiler (1.3 s), and RotaryEmbedding._apply computes them again on the model's device.
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
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
    elif kind == "yarn":
        factor, old_len = _yarn_factor(config), scaling["original_max_position_embeddings"]

        def dim_turning(turns: float) -> float:  # the (fractional) dimension whose frequency turns `turns` times
            return d * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(config.rope_theta))

        low, high = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / max(high - low, 1e-3)).clamp(0, 1)
        inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)  # ramp 0: kept, 1: interpolated
    return inv_freq


def _yarn_factor(config: ModelConfig) -> float:
    """YaRN's context factor: `factor`, or (DeepSeek's configs leave it out) max context / original context."""
    scaling = config.rope_scaling
    return scaling.get("factor") or config.max_seq_len / scaling["original_max_position_embeddings"]


def rope_attention_factor(config: ModelConfig) -> float:
    """YaRN's scale on cos and sin (so on every attention logit, squared): `attention_factor` if the config sets
    it, else 0.1 ln(factor) + 1 (or DeepSeek's ratio of two such terms with `mscale`, `mscale_all_dim`); 1.0 for
    every other scaling."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(config)

    def m(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return m(scaling["mscale"]) / m(scaling["mscale_all_dim"])
    return m(1.0)


class RotaryEmbedding(nn.Module):
    """Turns positions into the cos/sin tables that rotate queries and keys."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        default_device = torch.empty(0).device  # the model is built on it ("meta" in the loaders)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config).to(default_device), persistent=False)
        self.attention_factor = rope_attention_factor(config)  # 1.0 except for YaRN

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        # `model.to(torch.bfloat16)` would round the frequencies to bf16 and skew every angle:
        # after any move or cast, recompute them in fp32 on the new device.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inverse_frequencies(self.config).to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin each [B, 1, T, head_dim] in `dtype` (angles in fp32).

        Both tables repeat the head_dim/2 angles twice; `sin` carries the rotation's sign,
        [-sin, +sin], so that `apply_rotary` is two multiplies and an add.
        """
        angles = positions[..., None].float() * self.inv_freq  # [B, T, head_dim/2]
        cos, sin = angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [B, T, head_dim]
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+d/2}) by its position's angle. x [B, H, T, d], cos/sin [B, 1, T, d].

        x_i'       = x_i cos - x_{i+d/2} sin
        x_{i+d/2}' = x_{i+d/2} cos + x_i sin

    Swapping the two halves of x and multiplying by `sin` = [-sin, +sin] gives the second
    terms. This is the "rotate-half" pairing of Hugging Face checkpoints (their q/k weights are
    permuted to match), not the interleaved pairs (x_{2i}, x_{2i+1}) of Meta's original code.
    """
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass(frozen=True)
class RotaryPositions:
    """What the layers get instead of the (cos, sin) tables on the fused path (CUDA, `use_fused_kernels`):
    the positions, from which `minillm.kernels.fused_rotary` computes each angle inside its one kernel."""

    positions: torch.Tensor  # [B * T] int: the position of each token, row by row
    inv_freq: torch.Tensor  # [head_dim / 2] fp32: `RotaryEmbedding.inv_freq`


Rope = tuple[torch.Tensor, torch.Tensor] | RotaryPositions  # (cos, sin) [B, 1, T, head_dim] each, or the positions


class Attention(nn.Module):
    """Multi-head attention with `n_kv_heads` key/value heads (MHA, GQA or MQA)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        # q, k and v projections stacked into one matrix: one matmul reads all three (as in vLLM).
        # Rows [0, q) make queries, [q, q+kv) keys, [q+kv, q+2kv) values.
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.dim, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.dim, bias=config.o_bias)
        if config.qk_norm:  # Qwen3: RMSNorm over each head's features, before rotary
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | str | None,
                cache: CacheView | None) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]. `rope`: the (cos, sin) tables [B, 1, T, head_dim] or, on the fused path,
        the positions (`RotaryPositions`). `mask` [B, 1, T, S] bool (True = may attend), None or CAUSAL."""
        B, T, _ = x.shape
        q, k, v = linear(self.qkv_proj, x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        target = None  # where the rotary kernel writes k and v itself, if it does
        if isinstance(rope, RotaryPositions):  # one Triton kernel rotates q and k, angles computed in place
            from minillm.kernels import fused_rotary

            # In a captured decode step the same launch also writes k and v to their cache slots (1 launch, not 3)
            target = getattr(cache, "fused_write_target", lambda layer: None)(self.layer_idx)
            q, k = fused_rotary(q.reshape(B * T, self.n_heads, self.head_dim),
                                k.reshape(B * T, self.n_kv_heads, self.head_dim), rope.positions, rope.inv_freq,
                                cache=None if target is None else
                                (v.reshape(B * T, self.n_kv_heads, self.head_dim), *target))
            q = q.view(B, T, self.n_heads, self.head_dim)
        q = q.transpose(1, 2)  # [B, heads, T, head_dim]
        if target is not None:  # k and v are in the cache already: the pools are what the paged kernel reads
            k, v = cache.pools(self.layer_idx)
        else:
            k, v = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2), v.transpose(1, 2)
            if not isinstance(rope, RotaryPositions):
                q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
            if cache is not None:
                k, v = cache.update(self.layer_idx, k, v)  # [B, n_kv_heads, S, head_dim]: every key to attend to
        out = grouped_query_attention(q, k, v, mask)  # [B, n_heads, T, head_dim]
        return linear(self.o_proj, out.transpose(1, 2).reshape(B, T, self.q_size))


# The mask value meaning "plain causal": the T queries are the last T of the S key positions, and
# query t sees keys 0..S-T+t. `Transformer.forward` passes it instead of a mask tensor when the
# Triton FlashAttention kernel will run, which computes this pattern itself (chapter 02).
CAUSAL = "causal"
FLASH_HEAD_DIMS = (16, 32, 64, 128, 256)  # the head dims minillm.kernels.flash_attention compiles for


@dataclass(frozen=True)
class PagedDecode:
    """The `mask` of a decode step that reads keys and values straight from a paged cache (chapter 04).

    A `minillm.engine.kv_cache.PagedCacheView` returns it from `attention_mask` when every row has one new
    token and the paged Triton kernel will run (CUDA). Its `update` then hands back the layer's
    pools [num_blocks, block_size, n_kv_heads, head_dim] instead of gathering each row's keys, and
    `grouped_query_attention` runs `minillm.kernels.paged_decode_attention` with these tables.
    """

    block_tables: torch.Tensor  # [B, M] int: row b's blocks, in order
    seq_lens: torch.Tensor  # [B] int: the keys row b attends to, its new token's included
    max_seq_len: int  # max(seq_lens), known on the host (reading it from the GPU would cost a sync)
    dtype: torch.dtype | None = None  # the cache's model dtype (what a quantised cache's codes stand for)
    in_pytorch: bool = False  # read the pools with `paged_attention_torch` instead of the kernel (a compiled CPU step)


@dataclass(frozen=True)
class PackedPrefill:
    """The `mask` of a packed step (chapter 05): the new tokens of several sequences side by side in one row.

    A `minillm.engine.kv_cache.PackedCacheView` returns it. The queries are [1, H, N, d], sequence i's the columns
    q_starts[i] .. q_starts[i + 1] - 1; `update` returns every sequence's keys one after another, [1, H_kv, S, d],
    sequence i's the columns k_starts[i] .. k_starts[i + 1] - 1. Its queries are the last of its keys (a prompt
    chunk after what the cache holds), so causal attention within each sequence is all a query may see:
    `grouped_query_attention` attends sequence by sequence, or on CUDA all of them in one launch of the Triton
    FlashAttention kernel (`minillm.kernels.flash_attention_varlen`). No token is padding.
    """

    q_starts: tuple[int, ...]  # P + 1 offsets into the N new tokens (known on the host)
    k_starts: tuple[int, ...]  # P + 1 offsets into the S keys
    offsets: torch.Tensor | None = None  # q_starts then k_starts, int64, on the device (None: copied when needed)


@dataclass(frozen=True)
class PagedPrefill:
    """The `mask` of a packed step whose keys are read from the paged pools in place (a mixed step, chapter 05).

    A `minillm.engine.kv_cache.PackedCacheView` returns it on CUDA, where the paged prefill kernel runs: the queries
    are [1, H, N, d], sequence b's the columns q_starts[b] .. q_starts[b + 1] - 1 and the last of its seq_lens[b]
    keys; `update` hands back the layer's pools, and `grouped_query_attention` runs
    `minillm.kernels.paged_prefill_attention`, which reads each sequence's keys through its block table. Prompt
    chunks and decode rows (one query each) alike: nothing is gathered, and nothing about it is known only on the GPU.
    """

    block_tables: torch.Tensor  # [P, M] int: sequence b's blocks, in order
    q_starts: torch.Tensor  # [P + 1] int: offsets into the N new tokens, on the device
    seq_lens: torch.Tensor  # [P] int: the keys sequence b attends to, its new tokens' included
    max_queries: int  # the most new tokens of one sequence (host-known: it chooses the kernel's tile)
    dtype: torch.dtype | None = None  # the cache's model dtype (what a quantised cache's codes stand for)
    plan: dict = field(default_factory=dict, compare=False)  # the kernel's list of tiles, made at the first layer


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_kernels_run(x: torch.Tensor) -> bool:
    """Whether minillm's Triton kernels may take activations like `x`: a CUDA tensor of float16/bfloat16/float32
    that autograd does not track (the kernels have no backward pass: training runs in PyTorch), Triton
    installed, and not MINILLM_TRITON=0 in the environment."""
    return (
        x.is_cuda
        and not x.requires_grad
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and os.environ.get("MINILLM_TRITON", "1") != "0"
        and _triton_installed()
    )


def linear(layer: nn.Module, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    """layer(x) (layer(silu(gate) * up) with swiglu, x then being gate_up [..., 2F]): x [..., K] -> [..., N].

    A single row of 16-bit x on the fused path (`use_fused_kernels`) through a plain `nn.Linear` runs as one
    matrix-vector kernel, `minillm.kernels.matvec`: fewer kernels than cuBLAS's tiles at batch 1 (no split-K
    reductions) and silu(gate) * up computed as it loads x (chapter 05); MINILLM_MATVEC=0 turns it off.
    Anything else (several rows, quantised or LoRA layers, hooks, the CPU) runs as written.
    """
    if (x.dtype in (torch.float16, torch.bfloat16) and x.numel() == x.shape[-1] and type(layer) is nn.Linear
            and layer.weight.dtype == x.dtype and not layer._forward_hooks and not layer._forward_pre_hooks
            and use_fused_kernels(x) and os.environ.get("MINILLM_MATVEC", "1") != "0"):
        from minillm.kernels import matvec

        return matvec(x, layer.weight, layer.bias, swiglu=swiglu)
    if swiglu:  # only `Block.forward_fused` asks for it: the fused kernel
        from minillm.kernels import silu_and_mul

        x = silu_and_mul(x)
    return layer(x)


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Whether the small steps between the matrix multiplies run as fused Triton kernels (the GPU fast path):
    each residual add fused into the next RMSNorm, rotary on q and k in one kernel, silu(gate) * up in one.

    Yes wherever the Triton kernels run (see `use_triton_attention`), outside autocast, unless MINILLM_FUSED=0,
    which keeps them in PyTorch (benchmarks/roofline.py measures the difference). Everywhere else, the CPU above all,
    the model runs in PyTorch, as written.
    """
    return (_triton_kernels_run(x) and os.environ.get("MINILLM_FUSED", "1") != "0"
            and not torch.is_autocast_enabled("cuda"))  # autocast mixes dtypes in the residual stream


def use_triton_attention(x: torch.Tensor, head_dim: int) -> bool:
    """Whether attention over activations like `x` runs minillm's Triton kernels: FlashAttention for prefill
    (chapter 02), the decode kernels for one query per row (chapters 03-04).

    Yes where the Triton kernels may run (`_triton_kernels_run`: CUDA, no autograd, Triton, not
    MINILLM_TRITON=0) and `head_dim` is one the kernels compile for. Everywhere else (the CPU above all)
    attention runs in PyTorch, `F.scaled_dot_product_attention`.
    """
    return _triton_kernels_run(x) and head_dim in FLASH_HEAD_DIMS


def grouped_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    mask: torch.Tensor | str | PagedDecode | PackedPrefill | PagedPrefill | None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, where each group of G = H / H_kv query heads shares one K/V head.

    q [B, H, T, d], k and v [B, H_kv, S, d], mask [B, 1, T, S] bool, None or CAUSAL -> [B, H, T, d].
    Query heads h*G .. h*G+G-1 use K/V head h, so we fold each group's G heads into the query
    axis, [B, H_kv, G*T, d], and attend once per K/V head: K and V are never copied per query head.
    With mask=CAUSAL the Triton FlashAttention kernel runs where it can (it maps each query head to
    its K/V head itself); elsewhere CAUSAL becomes an explicit mask. A decode step (T = 1, no mask)
    on CUDA runs the Triton decode kernel, which reads each K/V head once for its G query heads
    (chapter 03). With mask a `PagedDecode`, k and v are a paged cache's pools and the paged decode
    kernel reads them through the block tables (chapter 04); for a quantised cache (chapter 06) k and v are
    `minillm.quant.kv.QuantizedPool`s, 8-bit codes with their scales, which the kernel dequantises as it reads.
    With mask a `PackedPrefill` the sequences packed in one row attend each to its own gathered keys; with a
    `PagedPrefill`, to the pools, through the tables (a mixed step of prompt chunks and decode rows, chapter 05).
    """
    B, H, T, d = q.shape
    if isinstance(mask, PagedPrefill):  # packed queries; k and v are the paged pools, read through the tables
        from minillm.kernels import paged_prefill_attention

        (k, k_scale), (v, v_scale) = (k, v) if isinstance(k, QuantizedPool) else ((k, None), (v, None))
        dtype = mask.dtype if k_scale is not None else k.dtype
        out = paged_prefill_attention(q[0].transpose(0, 1).to(dtype), k, v, mask.block_tables, mask.q_starts,
                                      mask.seq_lens, mask.max_queries, k_scale=k_scale, v_scale=v_scale,
                                      plan=mask.plan)
        return out.to(q.dtype).transpose(0, 1)[None]  # [1, H, N, d]
    if isinstance(mask, PackedPrefill):  # sequences packed in one row: each attends to its own keys, causally
        if q.dtype == k.dtype == v.dtype and use_triton_attention(q, d):
            from minillm.kernels import flash_attention_varlen

            return flash_attention_varlen(q, k, v, mask.q_starts, mask.k_starts, mask.offsets)
        spans = zip(zip(mask.q_starts, mask.q_starts[1:]), zip(mask.k_starts, mask.k_starts[1:]))
        return torch.cat([grouped_query_attention(q[:, :, a:b], k[:, :, c:e], v[:, :, c:e], CAUSAL)
                          for (a, b), (c, e) in spans], dim=2)
    if isinstance(mask, PagedDecode) and mask.in_pytorch:  # the pools, read through the tables in PyTorch
        return paged_attention_torch(q, k, v, mask)
    if isinstance(mask, PagedDecode):  # k and v are a paged cache's pools (chapter 04)
        from minillm.kernels import paged_decode_attention

        if isinstance(k, QuantizedPool):  # 8-bit codes with their scales: attention computes in the model's dtype
            (k, k_scale), (v, v_scale) = k, v
            dtype = mask.dtype
        else:
            k_scale = v_scale = None
            dtype = k.dtype
        out = paged_decode_attention(q[:, :, 0].to(dtype), k, v, mask.block_tables, mask.seq_lens, mask.max_seq_len,
                                     k_scale=k_scale, v_scale=v_scale)
        return out.to(q.dtype)[:, :, None]
    same_dtype = q.dtype == k.dtype == v.dtype  # under autocast, rotary leaves q and k in fp32 beside a bf16 v
    if T == 1 and mask is None and same_dtype and use_triton_attention(q, d):
        from minillm.kernels import decode_attention

        return decode_attention(q[:, :, 0], k, v)[:, :, None]
    if isinstance(mask, str):  # CAUSAL
        if same_dtype and use_triton_attention(q, d):
            from minillm.kernels import flash_attention

            return flash_attention(q, k, v, causal=True)
        S = k.shape[2]
        mask = attention_mask(torch.arange(S - T, S, device=q.device)[None], torch.arange(S, device=q.device)[None])
    G = H // k.shape[1]
    q = q.reshape(B, k.shape[1], G * T, d)
    if mask is not None:
        mask = mask.repeat(1, 1, G, 1)  # row g*T + t is query t of the g-th head in the group
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.reshape(B, H, T, d)


def paged_attention_torch(q: torch.Tensor, k: torch.Tensor | QuantizedPool, v: torch.Tensor | QuantizedPool,
                          mask: PagedDecode) -> torch.Tensor:
    """A decode step's attention over a paged cache's pools, in plain PyTorch with fixed shapes (the CPU's path).

    q [B, H, 1, d]; k, v [num_blocks, block_size, H_kv, d] (or 8-bit `QuantizedPool`s) -> [B, H, 1, d].
    Every row reads the first `max_seq_len` key slots its block table covers and masks those past its
    length, so the shapes do not change from step to step (what a compiled decode step needs,
    `minillm.engine.cuda_graphs.DecodeGraphs`).
    """
    if isinstance(k, QuantizedPool):  # codes x scales
        k = k[0].float() * k[1][..., None]
        v = v[0].float() * v[1][..., None]
    B, H, _, d = q.shape
    tables = mask.block_tables.long()  # [B, M]
    S = min(mask.max_seq_len, tables.shape[1] * k.shape[1])
    # The keys and values read in fp32, whatever the pools store: one query's products are small, and PyTorch's
    # 16-bit batched products of this size are slow on a CPU (0.46 ms of a 2.6 ms compiled bf16 step of the
    # shipped model, against 0.08 ms in fp32, on this book's AMD CPU; profiled ad hoc); a compiled step fuses
    # the widening into the gather. fp32 sums are also what a GPU's attention kernels keep.
    keys = k[tables].flatten(1, 2)[:, :S].transpose(1, 2).float()  # [B, H_kv, S, d]
    values = v[tables].flatten(1, 2)[:, :S].transpose(1, 2).float()
    visible = torch.arange(S, device=q.device)[None, :] < mask.seq_lens.long()[:, None]  # [B, S]
    # One query per row: the G query heads of each K/V head share one product with its keys (no SDPA call,
    # whose set-up costs more than this whole product; Inductor fuses the mask and softmax around it).
    H_kv, dtype = keys.shape[1], q.dtype
    grouped = q.float().reshape(B, H_kv, H // H_kv, d)  # [B, H_kv, G, d]
    scores = (grouped @ keys.transpose(2, 3)) * d**-0.5  # [B, H_kv, G, S]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values  # [B, H_kv, G, d]
    return out.reshape(B, H, 1, d).to(dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up stacked into one matrix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.dim, 2 * config.ffn_dim, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim] through a [B, T, ffn_dim] hidden layer."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """One pre-norm transformer block: attention then MLP, each added to the residual stream."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | str | None,
                cache: CacheView | None) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]; the other arguments pass through to `Attention`."""
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, delta: torch.Tensor, residual: torch.Tensor, rope: Rope, mask: torch.Tensor | str | None,
                      cache: CacheView | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with each residual add fused into the norm that follows it (CUDA, `use_fused_kernels`).

        The block's input is residual + delta [B, T, dim] each, not yet added; so is its output, returned
        as (delta, residual): the MLP's output and the stream before it. One kernel adds and normalises
        (`minillm.kernels.fused_add_rms_norm`), where `forward` reads and writes the stream in several; and the
        MLP's silu(gate) * up is one kernel (`minillm.kernels.silu_and_mul`) instead of two, or for a single
        row none: the down projection's matrix-vector kernel computes it as it reads it (`linear`).
        """
        from minillm.kernels import fused_add_rms_norm

        h, residual = fused_add_rms_norm(delta, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        delta = self.self_attn(h, rope, mask, cache)
        h, residual = fused_add_rms_norm(delta, residual, self.post_attention_layernorm.weight,
                                         self.post_attention_layernorm.eps)
        mlp = self.mlp  # silu(gate) * up: one kernel of its own, or computed inside a single row's down projection
        return linear(mlp.down_proj, linear(mlp.gate_up_proj, h), swiglu=True), residual


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


class CacheView(Protocol):
    """What `Transformer.forward` asks of a KV cache during one forward over a batch [B, T] (chapter 04).

    The forward never learns where keys and values live. It asks the cache four things:

        positions = cache.positions(T)                  [B or 1, T]: where the T new tokens of each row go
        mask = cache.attention_mask(positions, window)  which of the keys `update` returns each query sees
        k, v = cache.update(layer, k, v)                in every layer: store the new K/V, get all K/V to read
        cache.advance(T)                                after the last layer: the new tokens are filled

    The contiguous `minillm.contiguous_cache.KVCache` (chapter 02) answers for a batch of equal-length rows;
    a `minillm.engine.kv_cache.PagedCacheView` (chapter 04) answers for one step of a paged cache, whose rows
    may hold sequences of different lengths.

    A cache may also offer two more, which only a captured decode step's view uses
    (`minillm.engine.kv_cache.PagedCacheView.of_decode_rows`): `fused_write_target(layer)`, the (k_pool,
    v_pool, slots) the fused rotary kernel may write the new keys and values to itself (or None), and
    `pools(layer)`, what attention then reads in place of `update`'s answer.
    """

    def positions(self, n: int) -> torch.Tensor:
        """The positions of the next n tokens of each row, [B, n] or [1, n] (int64)."""
        ...

    def attention_mask(self, positions: torch.Tensor, window: int | None) -> torch.Tensor | str | None:
        """Which keys each query may see: [B, 1, T, S] bool over the S keys `update` returns, CAUSAL or None.

        None means every query sees every key; CAUSAL the plain triangle (the T queries are the
        last T of the S keys). `window` is the model's sliding window, or None.
        """
        ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, n_kv_heads, T, head_dim] of `layer`; return the keys and values to attend to,
        each [B, n_kv_heads, S, head_dim]."""
        ...

    def advance(self, n: int) -> None:
        """Mark the n new tokens of each row as filled (once per forward, after every layer wrote them)."""
        ...


def last_positions(x: torch.Tensor, cache: CacheView | None) -> torch.Tensor:
    """x [B, T, dim] -> the positions whose logits choose each sequence's next token: the last of each row [B, 1, dim],
    or, for sequences packed in one row (a `PackedCacheView`, chapter 05), the last of each sequence [1, P, dim]."""
    rows = getattr(cache, "last_rows", None)
    return x[:, -1:] if rows is None else x[:, rows]


class Transformer(nn.Module):
    """A Llama-family causal language model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Given its matrix, nn.Embedding skips its random init; fill it here, except on the "meta" device (where
        # loaders build the model's shapes first): there is nothing to fill, and torch's normal_ on meta
        # tensors imports its compiler, 1.3-1.7 s of every `minillm generate` on this book's CPU.
        weight = torch.empty(config.vocab_size, config.dim)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim, _weight=weight)
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
        cache: CacheView | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits for `tokens`.

        Args:
            tokens: [B, T] token ids.
            positions: [B, T] (or [T]) their positions; default: the next T positions after
                what `cache` holds (0..T-1 without a cache).
            cache: a `CacheView` to read past keys/values from and append these T to (a `KVCache`,
                or one step of a `PagedKVCache`, chapter 04), or None.
            last_only: return logits of the last position only (what decoding needs).

        Returns:
            logits [B, T, vocab] (or [B, 1, vocab] with `last_only`), in the model's dtype.
        """
        if tokens.dim() != 2:
            raise ValueError(
                f"tokens must be [batch, seq_len], got shape {tuple(tokens.shape)}; "
                "for one sequence pass tokens[None]."
            )
        B, T = tokens.shape
        default_positions = positions is None
        if positions is None:
            positions = torch.arange(T, device=tokens.device) if cache is None else cache.positions(T)
        positions = positions.expand(B, T)
        x = self.embed_tokens(tokens)  # [B, T, dim]
        fused = use_fused_kernels(x)
        if fused and self.rotary.attention_factor == 1.0:  # the fused kernel computes its angles from positions
            rope: Rope = RotaryPositions(positions.reshape(-1), self.rotary.inv_freq)
        else:
            rope = self.rotary(positions, x.dtype)

        # Which keys each query may see. With a cache, the keys are whatever its `update` returns
        # (every position it holds, or each sequence's own in a ragged batch), so the cache says.
        window = self.config.sliding_window
        if cache is not None:
            mask = cache.attention_mask(positions, window)
        elif window is None and default_positions and use_triton_attention(x, self.config.head_dim):
            mask = CAUSAL  # a CUDA prefill: the FlashAttention kernel applies the causal pattern itself
        else:
            mask = attention_mask(positions, positions, window)

        if fused:  # the same blocks, each residual add fused into the next norm (`Block.forward_fused`)
            from minillm.kernels import fused_add_rms_norm

            delta, residual = x, torch.zeros_like(x)
            for layer in self.layers:
                delta, residual = layer.forward_fused(delta, residual, rope, mask, cache)
            if last_only:
                delta, residual = last_positions(delta, cache), last_positions(residual, cache)
            x, _ = fused_add_rms_norm(delta, residual, self.norm.weight, self.norm.eps)
        else:
            for layer in self.layers:
                x = layer(x, rope, mask, cache)
            if last_only:
                x = last_positions(x, cache)
            x = self.norm(x)
        if cache is not None:
            cache.advance(T)
        return self.lm_head(x)

    def num_parameters(self) -> int:
        """Parameters, counting a tied embedding/head matrix once."""
        return sum(p.numel() for p in self.parameters())
