"""KV-cache quantisation: keys and values stored in 8 bits, one scale per (token, head) (chapter 06).

Why it buys batch. A decode step at batch B keeps B x context tokens of keys and values, and the
memory left beside the weights, divided by the bytes one token's K and V take, is how many tokens,
so how many sequences, fit (`minillm.arithmetic.max_batch_size`). Per token the cache holds

    2 (K and V) x n_layers x n_kv_heads x (head_dim x bytes per element + bytes per scale)

bf16 pays 2 bytes per element; int8 and fp8 pay 1, plus one fp32 scale per (token, head). For the
shipped model (head_dim 48) a (token, head) takes 96 bytes in bf16 and 48 + 4 = 52 in int8: the
same memory holds 1.85x the tokens (2x as head_dim grows and the scale matters less; 3.7x against
fp32). Every decode step also reads the whole cache, so a kernel that reads the 8-bit codes moves
about half the bytes too: on CUDA minillm's paged Triton decode kernel does (`paged_decode_attention`
with `k_scale`, `v_scale`: the pools come to it as `QuantizedPool`s); elsewhere, the CPU above all,
a quantised cache dequantises what attention reads (see `minillm.engine.kv_cache.PagedCacheView`).

Weight quantisation (the rest of `minillm.quant`) does not shrink the KV cache. int4 weights free
memory once, a fixed amount; but the keys and values are activations: the (de-quantised) projections
compute them in the model's dtype, and the cache stores them at that width. The cache grows with batch x
context while the weights stay put, so at long contexts and large batches the KV cache, not the
weights, is what runs out, and only quantising the cache itself (or fewer K/V heads, chapter 03)
shrinks it. The two are independent knobs; servers often turn both (vLLM: `quantization=` and
`kv_cache_dtype=`).

The scheme: dynamic absmax per (token, head), computed at write time from the vector being
written, over its head_dim numbers:

    int8   s = max|x| / 127,   q = round(x / s) in [-127, 127],   x ~ q s,   |x - q s| <= s / 2
    fp8    s = max|x| / 448,   q = float8_e4m3(x / s),            x ~ q s,   |x - q s| <= 2^-4 |x|
                                                                   (x / s in e4m3's normal range, >= 2^-6)

A per-(token, head) scale costs 4 bytes per head_dim elements, and it follows each vector's own
range, so one outlier token does not coarsen the grid of every other (the per-tensor failure mode
of chapter 06). vLLM names this option `kv_cache_dtype` ("auto" = the model's dtype, "fp8",
"fp8_e4m3", "fp8_e5m2"; docs.vllm.ai, Engine Arguments and features/quantization/quantized_kvcache),
with per-tensor scales (1.0 unless calibrated) or per-head calibrated ones; minillm's values are
"auto", "int8" and "fp8" (e4m3), with dynamic scales, so that no calibration is needed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minillm.config import ModelConfig

KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # the values of `kv_cache_dtype`, as in vLLM ("auto" = the model's dtype)
SCALE_DTYPE = torch.float32  # one scale per (token, head), beside the codes
_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_INT8_MAX = 127


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """`kv_cache_dtype` if it is one of `KV_CACHE_DTYPES`, else a ValueError listing them (chapter 06)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not a KV cache dtype; choose one of "
                         f"{', '.join(repr(d) for d in KV_CACHE_DTYPES)} ('auto' stores the model's dtype).")
    return kv_cache_dtype


def kv_storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache's K/V tensors hold: `dtype` (the model's) for "auto", int8, or float8_e4m3fn (chapter 06)."""
    return _STORAGE.get(check_kv_cache_dtype(kv_cache_dtype), dtype)


def is_quantized_dtype(storage: torch.dtype) -> bool:
    """Whether K/V stored as `storage` carry scales (int8, float8), as opposed to a float the model computes in."""
    return storage in _STORAGE.values()


Pools = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor] | None]


class QuantizedPool(NamedTuple):
    """One layer's K (or V) pool of a quantised paged cache with its scales: what `PagedCacheView.update` hands
    the paged decode kernel, which dequantises as it reads (`minillm.kernels.paged_decode_attention`)."""

    codes: torch.Tensor  # [num_blocks, block_size, n_kv_heads, head_dim] int8 or float8_e4m3fn
    scale: torch.Tensor  # [num_blocks, block_size, n_kv_heads] fp32


def kernel_pool(pool: torch.Tensor, scale_pool: torch.Tensor | None) -> torch.Tensor | QuantizedPool:
    """What the paged decode kernel reads for one layer's K or V: the pool itself, or its codes with their scales."""
    return pool if scale_pool is None else QuantizedPool(pool, scale_pool)


def allocate_pools(n_layers: int, shape: tuple[int, ...], storage: torch.dtype, device: torch.device | str) -> Pools:
    """(k, v, k_scale, v_scale): per layer, zeroed K and V of `shape` in `storage`, and, when `storage` is an 8-bit
    code dtype, zeroed fp32 scales of shape[:-1] (one per head vector); the scales are None otherwise.
    The one allocation both caches share (`KVCache`: [B, H_kv, T, d]; `PagedKVCache`: [blocks, block_size, H_kv, d])."""
    def zeros(s: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.zeros(s, device=device, dtype=dtype) for _ in range(n_layers)]

    scales = is_quantized_dtype(storage)
    return (zeros(shape, storage), zeros(shape, storage),
            zeros(shape[:-1], SCALE_DTYPE) if scales else None, zeros(shape[:-1], SCALE_DTYPE) if scales else None)


def quantize_kv(x: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values x [..., head_dim] -> (codes [..., head_dim] in `storage`, scales [...] fp32) (chapter 06).

    One absmax scale per vector over its last axis (a (token, head) of K or V): int8 rounds x / s to
    the nearest integer in [-127, 127]; fp8 casts x / s, within +-448, to float8_e4m3fn (round to
    nearest). An all-zero vector gets scale 1 and zero codes.
    """
    x = x.float()
    qmax = _INT8_MAX if storage == torch.int8 else torch.finfo(storage).max
    scale = x.abs().amax(-1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (x / scale[..., None]).clamp(-qmax, qmax)
    codes = y.round().to(storage) if storage == torch.int8 else y.to(storage)
    return codes, scale.to(SCALE_DTYPE)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., head_dim] x scale [...] -> [..., head_dim] in `dtype` (the model's): what attention reads."""
    return (codes.float() * scale[..., None].float()).to(dtype)


def kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str = "auto", dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one token takes in minillm's KV caches, scales included (chapter 06):

        2 x n_layers x n_kv_heads x (head_dim x element bytes + scale bytes)

    element bytes: `dtype`'s for "auto" (no scale), 1 for "int8" and "fp8" (4-byte fp32 scale). The
    shipped model: 2 x 6 x 2 x 96 = 2,304 bytes in bf16, 2 x 6 x 2 x 52 = 1,248 in int8. What
    `PagedKVCache.nbytes` is, divided by num_blocks x block_size.
    """
    storage = kv_storage_dtype(kv_cache_dtype, dtype)
    per_head = config.head_dim * storage.itemsize
    if is_quantized_dtype(storage):
        per_head += SCALE_DTYPE.itemsize
    return 2 * config.n_layers * config.n_kv_heads * per_head
