"""A paged KV cache's pools read in plain PyTorch: `gather_kv`, the reference paged read (chapter 04).

A paged cache keeps each layer's keys (and values) in a pool of fixed-size blocks,
[num_blocks, block_size, n_kv_heads, head_dim], and each sequence's block table lists its blocks in
order. `gather_kv` copies every sequence's positions out of the pool into the dense tensor that
attention reads. It is the reference `paged_decode_attention_reference` is built on, and how the
engine's `PagedKVCache.gather` reads a sequence back; the paged decode kernel reads the pools in
place instead, without this copy. Plain PyTorch: it runs without Triton.
"""

from __future__ import annotations

import torch


def gather_kv(pool: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Read positions 0..length-1 of each sequence through its block table: the reference paged read (chapter 04).

    pool [num_blocks, block_size, n_kv_heads, head_dim] (one layer's K or V), block_tables [B, M]
    int64 with M * block_size >= length -> [B, n_kv_heads, length, head_dim], what attention reads.
    Row b's position p comes from block block_tables[b, p // block_size], offset p % block_size.
    Positions past a sequence's own length read whatever its padding blocks hold: mask them.
    """
    B, M = block_tables.shape
    _, block_size, n_kv_heads, head_dim = pool.shape
    if M * block_size < length:
        raise ValueError(f"{M} blocks of {block_size} hold {M * block_size} positions, fewer than length {length}.")
    blocks = pool[block_tables]  # [B, M, block_size, n_kv_heads, head_dim]
    return blocks.reshape(B, M * block_size, n_kv_heads, head_dim)[:, :length].transpose(1, 2)
