"""The contiguous KV cache (chapter 02).

Decoding token t needs the keys and values of tokens 0..t-1 in every layer. Recomputing them
costs a whole forward over the prefix at every step (O(n^2) work for n tokens); keeping them
costs memory: per token, 2 (K and V) x n_layers x n_kv_heads x head_dim x bytes.

`KVCache` pre-allocates that memory for `max_len` positions up front, one tensor per layer
shaped [B, n_kv_heads, max_len, head_dim], and fills it left to right. Reserving for the longest
possible sequence is exactly the waste that paging (chapter 04) removes.
"""

from __future__ import annotations

import torch

from minillm.config import ModelConfig


class KVCache:
    """Pre-allocated keys and values for every layer of a batch of equal-length sequences.

    The model calls `update(layer, k, v)` in each layer, then `advance(T)` once per forward.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if max_len <= 0 or batch_size <= 0:
            raise ValueError(f"batch_size and max_len must be positive, got {batch_size}, {max_len}.")
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.max_len = max_len
        self.seq_len = 0  # positions filled so far (the same for every row)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, n_kv_heads, T, head_dim] at the next T slots of `layer`.

        Returns views of every filled slot, [B, n_kv_heads, seq_len + T, head_dim].
        """
        start, end = self.seq_len, self.seq_len + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KV cache overflow: {end} positions needed, {self.max_len} reserved. "
                "Create the cache with a larger max_len."
            )
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        """Mark n more positions as filled (called by the model after all layers wrote them)."""
        self.seq_len += n

    def reset(self) -> None:
        """Forget every position (the memory stays reserved)."""
        self.seq_len = 0

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the cache, filled or not."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
