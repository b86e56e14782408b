"""The contiguous KV cache (chapter 02).

Decoding token t needs the keys and values of tokens 0..t-1 in every layer. Recomputing them
costs a whole forward over the prefix at every step (O(n^2) work for n tokens); keeping them
costs memory: per token, 2 (K and V) x n_layers x n_kv_heads x head_dim x bytes.

`KVCache` pre-allocates that memory for `max_len` positions up front, one tensor per layer
shaped [B, n_kv_heads, max_len, head_dim], and fills it left to right. Reserving for the longest
possible sequence is exactly the waste that paging (chapter 04) removes.

`KVCache` answers `minillm.model.CacheView`, the four questions `Transformer.forward` asks of any
cache: `positions`, `attention_mask`, `update` and `advance` (the paged cache of chapter 04,
`minillm.engine.kv_cache`, answers the same four).

With `kv_cache_dtype="int8"` or `"fp8"` (chapter 06, `minillm.quant.kv`) the cache stores keys and
values in 8 bits, with one fp32 scale per (token, head) in `k_scale` / `v_scale` beside them: `update`
quantises what it writes and dequantises what it returns, so the model reads its own dtype.
"""

from __future__ import annotations

import torch

from minillm.config import ModelConfig
from minillm.model import CAUSAL, attention_mask, use_triton_attention
from minillm.quant.kv import allocate_pools, dequantize_kv, kv_storage_dtype, quantize_kv


class KVCache:
    """Pre-allocated keys and values for every layer of a batch of equal-length sequences.

    The model asks `positions(T)` and `attention_mask(...)` once per forward, calls
    `update(layer, k, v)` in each layer, then `advance(T)` (see `minillm.model.CacheView`).

    `dtype` is the model's (what `update` returns); `kv_cache_dtype` what the cache stores: "auto"
    (that same dtype), "int8" or "fp8" (e4m3), the last two with scales `k_scale`, `v_scale`
    [B, n_kv_heads, max_len] fp32 per layer (chapter 06; vLLM's option of the same name).
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if max_len <= 0 or batch_size <= 0:
            raise ValueError(f"batch_size and max_len must be positive, got {batch_size}, {max_len}.")
        storage = kv_storage_dtype(kv_cache_dtype, dtype)
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        # K, V codes of `shape`; fp32 scales [B, n_kv_heads, max_len] per layer, when quantised (None when not)
        self.k, self.v, self.k_scale, self.v_scale = allocate_pools(config.n_layers, shape, storage, device)
        self.max_len = max_len
        self.seq_len = 0  # positions filled so far (the same for every row)

    def positions(self, n: int) -> torch.Tensor:
        """The next n positions, the same for every row: [1, n] int64, seq_len .. seq_len + n - 1."""
        return torch.arange(self.seq_len, self.seq_len + n, device=self.k[0].device)[None]

    def attention_mask(self, positions: torch.Tensor, window: int | None) -> torch.Tensor | str | None:
        """Which of the seq_len + T slots `update` returns each of the T queries may see (chapter 04's interface).

        positions [B, T] (or [1, T]) -> None (one query that sees every slot: a decode step), CAUSAL
        (the plain triangle, when the Triton FlashAttention kernel will apply it itself, chapter 02),
        or a bool mask [B, 1, T, seq_len + T], True = may attend.
        """
        T = positions.shape[-1]
        if T == 1 and (window is None or self.seq_len < window):
            return None  # one query sees every key: nothing to mask
        probe = torch.empty(0, device=self.k[0].device, dtype=self.dtype)  # what attention reads: the model's dtype
        if window is None and use_triton_attention(probe, self.k[0].shape[-1]):
            return CAUSAL  # a CUDA prefill: the FlashAttention kernel applies the causal pattern itself
        keys = torch.arange(self.seq_len + T, device=positions.device).expand(positions.shape[0], -1)
        return attention_mask(positions, keys, window)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, n_kv_heads, T, head_dim] at the next T slots of `layer`.

        Returns views of every filled slot, [B, n_kv_heads, seq_len + T, head_dim]; a quantised cache
        stores codes and scales, and returns every filled slot dequantised to `dtype` (a copy).
        """
        start, end = self.seq_len, self.seq_len + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KV cache overflow: {end} positions needed, {self.max_len} reserved. "
                "Create the cache with a larger max_len."
            )
        if self.k_scale is None:
            self.k[layer][:, :, start:end] = k
            self.v[layer][:, :, start:end] = v
            return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
        out = []
        for codes, scales, new in ((self.k[layer], self.k_scale[layer], k), (self.v[layer], self.v_scale[layer], v)):
            codes[:, :, start:end], scales[:, :, start:end] = quantize_kv(new, codes.dtype)
            out.append(dequantize_kv(codes[:, :, :end], scales[:, :, :end], self.dtype))
        return out[0], out[1]

    def advance(self, n: int) -> None:
        """Mark n more positions as filled (called by the model after all layers wrote them)."""
        self.seq_len += n

    def reset(self) -> None:
        """Forget every position (the memory stays reserved)."""
        self.seq_len = 0

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the cache, filled or not (codes and scales, when quantised)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v + (self.k_scale or []) + (self.v_scale or []))
