"""The paged KV cache: blocks, block tables, slot mapping, prefix caching, copy-on-write (chapter 04).

A contiguous cache (chapter 02) reserves `max_len` positions per sequence before the first token.
A paged cache (PagedAttention, as in vLLM) cuts the memory into a fixed pool of *blocks* of
`block_size` tokens and hands a sequence a block only when its tokens arrive, so a sequence wastes
at most one partly filled block. Its *block table* lists its blocks in order: the token at position
p lives in block `table[p // block_size]` at offset `p % block_size`, that is at the flat *slot*

    slot = table[p // block_size] * block_size + p % block_size

    pools, per layer   K, V [num_blocks, block_size, n_kv_heads, head_dim]   (vLLM's layout)
    sequence "a"       block table [7, 2, 9]   40 tokens: blocks 7 and 2 full, block 9 holds 8
    sequence "b"       block table [7, 2, 4]   forked from "a" at 32 tokens: blocks 7 and 2 shared

The pieces, from the bottom up:

* `BlockAllocator`: which blocks are free and how many block tables hold each (reference counts):
  `allocate`, `free`, `fork` (share), `copy_on_write` (decides when a write needs a private copy of a
  shared block), and `NoFreeBlocksError` when the pool runs dry, the signal on which the scheduler
  of chapter 05 preempts.
* Prefix caching: a FULL block is named by `block_hash(parent_hash, its token ids)`, a chain, so the
  same 16 tokens after different prefixes are different blocks. A new prompt reuses every cached
  full block of its prefix; a freed cached block stays reusable until a new allocation evicts it,
  least recently used first. Hits and misses are counted.
* `BlockTable`: one sequence's blocks, its tokens, and the hashes of its full blocks.
* `PagedKVCache`: the pools and the block tables by sequence id (`add_sequence`, `fork`, `free`),
  and `prepare`, which allocates the blocks one forward needs and returns its `PagedCacheView`.
* `PagedCacheView`: one forward's view of the cache, the per-step context: which sequences, their
  positions, slot mapping and block tables. It answers `minillm.model.CacheView`, so the model's
  one `forward` runs on it exactly as on the contiguous `KVCache`, for sequences of different
  lengths in one batch.
* `gather_kv`: the reference paged read, every sequence's keys (or values) gathered through its
  block table into a dense tensor that attention reads.

KV-cache quantisation (chapter 06, `minillm.kv_quant`). `PagedKVCache(..., kv_cache_dtype="int8")` (or
"fp8", e4m3; "auto", the model's dtype, is the default; vLLM's option of the same name) stores the pools
in 8 bits and, beside them, one fp32 scale per (token, head) in scale pools shaped like the K/V pools
without the head_dim axis:

    per layer   K, V codes [num_blocks, block_size, n_kv_heads, head_dim]   int8 or float8_e4m3fn
                K, V scales [num_blocks, block_size, n_kv_heads]            fp32

A slot's scale sits at the same (block, offset) as its codes, so everything that moves blocks moves the
scales with them: prefix caching and fork share blocks (and so their scales), copy-on-write copies both
(`copy_block`), truncate leaves both to be overwritten. `update` quantises on write and dequantises what
it reads to the model's dtype (or, for the paged kernel on CUDA, hands over codes and scales to read in
place). Bytes per token roughly halve against bf16 (`minillm.kv_quant` says why
that doubles the batch a memory budget holds), so `num_blocks_for_memory` gives ~2x the blocks.

    cache = PagedKVCache(model.config, num_blocks=64)
    cached = cache.add_sequence("a", prompt_ids)             # tokens already in the prefix cache
    view = cache.prepare(["a"], [prompt_ids[cached:]])       # allocates blocks, maps slots
    logits = model(view.tokens, cache=view)                  # writes K/V through the slot mapping
    view = cache.prepare(["a"], [[next_token]])              # a decode step, and so on
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from minillm.config import ModelConfig
from minillm.kv_quant import (
    allocate_pools,
    dequantize_kv,
    kernel_pool,
    kv_bytes_per_token,
    kv_storage_dtype,
    quantize_kv,
)
from minillm.model import PagedDecode, Transformer, attention_mask, use_triton_attention

BLOCK_SIZE = 16  # tokens per KV block: the default of minillm's users, as of vLLM
PAD_SLOT = -1  # the slot of a padding token in `slot_mapping`: nothing is written for it (as in vLLM)


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than a step needs (chapter 04). Nothing was allocated.

    Attributes `requested`, `free` and `num_blocks` give the numbers; the scheduler of chapter 05
    preempts a sequence (frees its blocks) and tries again.
    """

    def __init__(self, requested: int, free: int, num_blocks: int) -> None:
        self.requested, self.free, self.num_blocks = requested, free, num_blocks
        super().__init__(
            f"out of KV cache blocks: {requested} needed, {free} free of {num_blocks}; nothing was allocated. "
            "Free (or preempt) a sequence, or create the cache with more blocks."
        )


def block_hash(parent_hash: str | None, token_ids: Sequence[int]) -> str:
    """The name of a full block for prefix caching: sha256(parent's hash, token ids), hex (chapter 04).

    The parent's hash chains in the whole prefix, so equal tokens after different prefixes get
    different names. hashlib, not Python's `hash()`, which is randomised per process for bytes/str.
    """
    h = hashlib.sha256(bytes.fromhex(parent_hash) if parent_hash is not None else b"")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.hexdigest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[str]:
    """The chain of hashes of the full blocks of `token_ids` (a partial last block has none) (chapter 04)."""
    hashes: list[str] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(block_hash(hashes[-1] if hashes else None, token_ids[start : start + block_size]))
    return hashes


class BlockAllocator:
    """A fixed pool of `num_blocks` KV blocks: free list, reference counts, prefix cache (chapter 04).

    Every block is in exactly one of three states:
      * used: ref_counts[block] block tables hold it (>= 1);
      * cached and evictable: no table holds it, but it holds a full block a later prompt may reuse;
        `evictable` keeps these least recently used first;
      * free: in `free_blocks`, holding nothing worth keeping.
    So `num_free_blocks` (free + evictable) + the used blocks = num_blocks.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}.")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.cached_blocks: dict[str, int] = {}  # block hash -> the block holding it
        self.block_hashes: dict[int, str] = {}  # block -> its hash, for cached blocks only
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no table holds, LRU first
        self.hits = 0  # full prompt blocks found in the prefix cache
        self.misses = 0  # full prompt blocks that had to be computed

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: the free list plus the evictable cached blocks."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one block table."""
        return self.num_blocks - self.num_free_blocks

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hits / (hits + misses) over the full prompt blocks looked up; nan before any."""
        total = self.hits + self.misses
        return self.hits / total if total else float("nan")

    def can_allocate(self, n: int) -> bool:
        """Whether n blocks can be allocated now."""
        return n <= self.num_free_blocks

    def allocate(self) -> int:
        """A block for one block table (ref count 1): from the free list, else by evicting the least
        recently used cached block. Raises `NoFreeBlocksError` when there is none."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached_blocks[self.block_hashes.pop(block)]
        else:
            raise NoFreeBlocksError(1, 0, self.num_blocks)
        self.ref_counts[block] = 1
        return block

    def free(self, block: int) -> None:
        """One block table lets go of `block`. At ref count 0 it becomes free, or evictable if cached."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is not held by any block table: a double free.")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.block_hashes:
                self.evictable[block] = None  # the most recently used end
            else:
                self.free_blocks.append(block)

    def fork(self, block: int) -> int:
        """One more block table shares `block` (ref count + 1); no data moves. Returns `block`."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is free: only a block some table holds can be shared.")
        self.ref_counts[block] += 1
        return block

    def copy_on_write(self, block: int) -> int:
        """The block a table may write into in place of `block`.

        `block` itself if this table is its only holder; otherwise a fresh block (ref count 1) and
        this table's reference to `block` is dropped. The caller copies the data (the cache owns it)
        and puts the returned block in its table.
        """
        if self.ref_counts[block] == 1:
            return block
        fresh = self.allocate()
        self.free(block)
        return fresh

    def uncache(self, block: int) -> None:
        """`block` is about to be overwritten in place: it no longer holds its named full block."""
        block_hash = self.block_hashes.pop(block, None)
        if block_hash is not None and self.cached_blocks.get(block_hash) == block:
            del self.cached_blocks[block_hash]

    def match_prefix(self, hashes: Sequence[str]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (a chain), each now held by one more table.

        Counts len(result) hits and the rest misses.
        """
        blocks: list[int] = []
        for h in hashes if self.enable_prefix_caching else ():
            block = self.cached_blocks.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
            blocks.append(block)
        self.hits += len(blocks)
        self.misses += len(hashes) - len(blocks)
        return blocks

    def cache_block(self, block: int, block_hash: str) -> None:
        """Record that `block`, now full, holds the block named `block_hash`, for later prompts to reuse.

        If another block already holds that hash (two sequences computed the same prefix), the
        first stays the cached one and `block` is freed normally when its tables let go of it.
        """
        if self.enable_prefix_caching and block_hash not in self.cached_blocks:
            self.cached_blocks[block_hash] = block
            self.block_hashes[block] = block_hash


@dataclass
class BlockTable:
    """One sequence's place in the paged cache (chapter 04).

    block_ids[i] holds positions i * block_size .. (i + 1) * block_size - 1. token_ids are the tokens
    whose keys and values are in the blocks (so num_tokens of them), and block_hashes the prefix-cache
    names of the full blocks, in order (empty without prefix caching).
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Positions filled."""
        return len(self.token_ids)

    def slot(self, position: int) -> int:
        """The flat slot of `position`: block_ids[position // block_size] * block_size + position % block_size."""
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def copy(self) -> BlockTable:
        """A table with the same blocks and tokens (the caller updates the blocks' reference counts)."""
        return BlockTable(self.block_size, list(self.block_ids), list(self.token_ids), list(self.block_hashes))


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


def num_blocks_for_memory(config: ModelConfig, memory_bytes: float, block_size: int = BLOCK_SIZE,
                          dtype: torch.dtype = torch.bfloat16, kv_cache_dtype: str = "auto") -> int:
    """How many blocks a KV budget of `memory_bytes` holds (chapters 04, 06):

        floor(memory_bytes / (block_size x kv_bytes_per_token(config, kv_cache_dtype, dtype)))

    exactly what `PagedKVCache(config, n, block_size, dtype=dtype, kv_cache_dtype=...).nbytes` fits in
    (scales included). The same budget holds ~2x the blocks in "int8" or "fp8" as in bf16.
    `LLMEngine(kv_cache_memory_bytes=...)` sizes its pool with it. Raises a ValueError below one block.
    """
    block_bytes = block_size * kv_bytes_per_token(config, kv_cache_dtype, dtype)
    if memory_bytes < block_bytes:
        raise ValueError(f"{memory_bytes:,.0f} bytes hold no KV block: one block of {block_size} tokens takes "
                         f"{block_bytes:,} bytes ({kv_cache_dtype}); give a larger budget or smaller blocks.")
    return int(memory_bytes // block_bytes)


def store_kv(pool: torch.Tensor, scale_pool: torch.Tensor | None, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write rows [n, n_kv_heads, head_dim] of keys or values to `slots` [n] of one layer's pool
    [num_blocks, block_size, n_kv_heads, head_dim] (slot s = block s // block_size, offset s % block_size);
    for a quantised pool (chapter 06), their 8-bit codes, and their scales to `scale_pool`."""
    flat = pool.view(-1, *pool.shape[2:])  # [num_blocks * block_size, H, d]: slot s is row s
    if scale_pool is None:
        flat.index_copy_(0, slots, rows.to(pool.dtype))
        return
    codes, scales = quantize_kv(rows, pool.dtype)  # codes moved as raw bytes: PyTorch lacks index_copy_ for
    flat.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))  # float8 on some devices
    scale_pool.view(-1, pool.shape[2]).index_copy_(0, slots, scales)


class PagedKVCache:
    """Keys and values of many sequences in one pool of blocks (chapter 04).

    Per layer, K and V pools [num_blocks, block_size, n_kv_heads, head_dim]; per sequence id, a
    `BlockTable`. Sequences are added (reusing cached prefix blocks), forked (sharing every block)
    and freed by id; `prepare(seq_ids, token_ids)` allocates the blocks the next forward needs and
    returns the `PagedCacheView` to pass to the model as its cache.

    `dtype` is the model's; `kv_cache_dtype` what the pools store (chapter 06): "auto" (that same
    dtype), or "int8" / "fp8" (e4m3) codes with fp32 scale pools `k_scale`, `v_scale`
    [num_blocks, block_size, n_kv_heads] per layer (see the module's docstring and `minillm.kv_quant`).
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
    ) -> None:
        storage = kv_storage_dtype(kv_cache_dtype, dtype)  # checks the name first
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype
        shape = (num_blocks, block_size, config.n_kv_heads, config.head_dim)
        # K, V codes of `shape`; fp32 scales [num_blocks, block_size, n_kv_heads] per layer when quantised, else None
        self.k, self.v, self.k_scale, self.v_scale = allocate_pools(config.n_layers, shape, storage, device)
        self.block_tables: dict[Hashable, BlockTable] = {}

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def quantized(self) -> bool:
        """Whether the pools hold 8-bit codes with scales (kv_cache_dtype "int8" or "fp8"), chapter 06."""
        return self.k_scale is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the pools, used or not: K and V, and their scales when quantised."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v + (self.k_scale or []) + (self.v_scale or []))

    def num_tokens(self, seq_id: Hashable) -> int:
        """Positions of `seq_id` filled so far."""
        return self._table(seq_id).num_tokens

    def _table(self, seq_id: Hashable) -> BlockTable:
        if seq_id not in self.block_tables:
            raise KeyError(f"no sequence {seq_id!r} in the cache: add_sequence or fork it first.")
        return self.block_tables[seq_id]

    # ---------------------------------------------------------------- sequences
    def add_sequence(self, seq_id: Hashable, prompt_token_ids: Sequence[int] = ()) -> int:
        """Start sequence `seq_id`; with prefix caching, reuse the cached full blocks its prompt begins with.

        Returns how many prompt tokens are already in the cache (a multiple of block_size): run the
        model on prompt_token_ids[returned:] only. At least the last prompt token is always left to
        compute, since its logits choose the next token.
        """
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} is already in the cache: free it first, or use another id.")
        table = BlockTable(self.block_size)
        if self.allocator.enable_prefix_caching and prompt_token_ids:
            reusable = list(prompt_token_ids[: (len(prompt_token_ids) - 1) // self.block_size * self.block_size])
            hashes = prefix_block_hashes(reusable, self.block_size)
            table.block_ids = self.allocator.match_prefix(hashes)
            table.block_hashes = hashes[: len(table.block_ids)]
            table.token_ids = reusable[: len(table.block_ids) * self.block_size]
        self.block_tables[seq_id] = table
        return table.num_tokens

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start `child_id` as a copy of `parent_id` that shares all its blocks (parallel sampling, beams).

        No data is copied now; the first write into a shared, partly filled block copies that block.
        """
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id!r} is already in the cache.")
        table = self._table(parent_id).copy()
        for block in table.block_ids:
            self.allocator.fork(block)
        self.block_tables[child_id] = table

    def free(self, seq_id: Hashable) -> None:
        """Forget `seq_id`; its blocks go back to the pool (cached ones stay reusable until evicted).

        Last block first, so that among cached blocks a prompt's tail is evicted before its head,
        which more prompts share.
        """
        table = self.block_tables.pop(seq_id, None)
        if table is None:
            raise KeyError(f"no sequence {seq_id!r} in the cache to free.")
        for block in reversed(table.block_ids):
            self.allocator.free(block)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the first `num_tokens` positions of `seq_id`: the rollback of speculative decoding (chapter 07).

        The target wrote keys and values for every draft token it checked; those it rejected must go.
        Blocks past the kept positions return to the pool. If the last kept block was full and named in
        the prefix cache, and this sequence alone holds it, it leaves the prefix cache, because the next
        tokens will overwrite its tail in place (a shared one is copied before the write instead).
        """
        table = self._table(seq_id)
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(f"sequence {seq_id!r} holds {table.num_tokens} tokens: cannot keep {num_tokens}; "
                             f"pass a count from 0 to {table.num_tokens}.")
        bs = self.block_size
        keep_blocks = -(-num_tokens // bs)
        for block in reversed(table.block_ids[keep_blocks:]):
            self.allocator.free(block)
        del table.block_ids[keep_blocks:]
        del table.token_ids[num_tokens:]
        full = num_tokens // bs
        if len(table.block_hashes) > full:
            del table.block_hashes[full:]
            last = table.block_ids[full] if full < len(table.block_ids) else None
            if last is not None and self.allocator.ref_counts[last] == 1:
                self.allocator.uncache(last)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src`'s keys and values (and their scales, when quantised) into block `dst`, in every
        layer (copy-on-write)."""
        for pools in (self.k, self.v, self.k_scale or [], self.v_scale or []):
            for pool in pools:
                pool[dst] = pool[src]

    def layer_pools(self, layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """`layer`'s (K pool, its scales) and (V pool, its scales); the scales are None unless quantised."""
        if not self.quantized:
            return (self.k[layer], None), (self.v[layer], None)
        return (self.k[layer], self.k_scale[layer]), (self.v[layer], self.v_scale[layer])

    def gather(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of `seq_id` in `layer`, each [n_kv_heads, num_tokens, head_dim] (dequantised to
        the model's dtype when the cache is quantised)."""
        table = self._table(seq_id)
        blocks = torch.tensor([table.block_ids or [0]], device=self.device)
        out = []
        for pool, scales in self.layer_pools(layer):
            codes = gather_kv(pool, blocks, table.num_tokens)[0]
            if scales is not None:  # the scale pool as a pool of head_dim 1
                codes = dequantize_kv(codes, gather_kv(scales[..., None], blocks, table.num_tokens)[0, ..., 0],
                                      self.dtype)
            out.append(codes)
        return out[0], out[1]

    # ---------------------------------------------------------------- one forward
    def blocks_needed(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> int:
        """Blocks the pool must supply for num_new_tokens[i] more tokens of each seq_ids[i]: new blocks,
        plus one private copy where a sequence's partly filled last block is shared (copy-on-write; of
        the holders writing in one step, the last keeps the original)."""
        bs, allocator = self.block_size, self.allocator
        needed, copies_planned = 0, Counter()
        for seq_id, n in zip(seq_ids, num_new_tokens):
            table = self._table(seq_id)
            if table.num_tokens % bs and n > 0:
                last = table.block_ids[table.num_tokens // bs]
                if allocator.ref_counts[last] - copies_planned[last] > 1:
                    needed, copies_planned[last] = needed + 1, copies_planned[last] + 1
            needed += max(0, -(-(table.num_tokens + n) // bs) - len(table.block_ids))
        return needed

    def allocate_slots(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> None:
        """Give each seq_ids[i] the blocks for num_new_tokens[i] more tokens, copying a shared partly filled
        last block first (copy-on-write). All or nothing: raises `NoFreeBlocksError`, changing nothing, if
        the pool cannot supply them. The scheduler (chapter 05) calls it request by request as it fills a
        step; `prepare` calls it too, and finds nothing left to do for blocks already allocated."""
        needed = self.blocks_needed(seq_ids, num_new_tokens)
        if not self.allocator.can_allocate(needed):
            raise NoFreeBlocksError(needed, self.allocator.num_free_blocks, self.allocator.num_blocks)
        bs, allocator = self.block_size, self.allocator
        for seq_id, n in zip(seq_ids, num_new_tokens):
            table = self._table(seq_id)
            if table.num_tokens % bs and n > 0:  # the first new token goes into a partly filled block: ours alone?
                i = table.num_tokens // bs
                block = allocator.copy_on_write(table.block_ids[i])
                if block != table.block_ids[i]:
                    self.copy_block(table.block_ids[i], block)
                    table.block_ids[i] = block
            while len(table.block_ids) * bs < table.num_tokens + n:
                table.block_ids.append(allocator.allocate())

    def prepare(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]]) -> PagedCacheView:
        """Make room for token_ids[i] after what seq_ids[i] holds, and return the view the model runs on.

        Allocates every block the step needs, and copies a shared, partly filled last block before
        it is written (copy-on-write), all or nothing: if the pool cannot supply them, raises
        `NoFreeBlocksError` with nothing changed. The lists may have different lengths (a ragged
        batch: prompts, chunks of prompts and decode tokens together).
        """
        if len(seq_ids) != len(token_ids) or not seq_ids:
            raise ValueError(f"give one list of new tokens per sequence: {len(seq_ids)} ids, {len(token_ids)} lists.")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one step: {list(seq_ids)}.")
        if any(len(new) == 0 for new in token_ids):
            raise ValueError("every sequence in a step needs at least one new token.")
        self.allocate_slots(seq_ids, [len(new) for new in token_ids])
        tables = [self._table(s) for s in seq_ids]
        return PagedCacheView(self, list(seq_ids), tables, [[int(t) for t in new] for new in token_ids])

    def commit(self, tables: Sequence[BlockTable], token_ids: Sequence[Sequence[int]]) -> None:
        """The new tokens' keys and values are written: add them to their tables, and name every block they
        filled in the prefix cache (called by `PagedCacheView.advance`)."""
        for table, new in zip(tables, token_ids):
            table.token_ids.extend(new)
            if not self.allocator.enable_prefix_caching:
                continue
            for i in range(len(table.block_hashes), table.num_tokens // self.block_size):
                tokens = table.token_ids[i * self.block_size : (i + 1) * self.block_size]
                table.block_hashes.append(block_hash(table.block_hashes[-1] if i else None, tokens))
                self.allocator.cache_block(table.block_ids[i], table.block_hashes[-1])


@torch.inference_mode()
def paged_forward(
    model: Transformer, cache: PagedKVCache, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]]
) -> torch.Tensor:
    """One forward of the model over new tokens of several sequences of `cache` (chapter 04).

    token_ids[i] (one or more ids) follow what seq_ids[i] already holds; prefill, chunks and decode
    tokens may be mixed. Returns the logits of each sequence's last new token, [len(seq_ids), vocab]:
    what chooses its next token.
    """
    view = cache.prepare(seq_ids, token_ids)
    return model(view.tokens, cache=view, last_only=True)[:, -1]


class PagedCacheView:
    """One forward over a batch of sequences of a `PagedKVCache`: the per-step context (chapter 04).

    Made by `PagedKVCache.prepare`. Row b of the batch holds sequence seq_ids[b]: context_lens[b]
    tokens already cached and num_new[b] new ones, LEFT-padded to T = max(num_new), so that column
    T - 1 is every row's last new token (the one whose logits choose the next token):

        tokens        [B, T] the new token ids, 0 in padding
        position_ids  [B, T] their positions, context_lens[b] ..; 0 in padding (a padding query sees key 0)
        slot_mapping  [B, T] the flat slot each new token's K/V is written to, PAD_SLOT (-1) in padding
        block_tables  [B, M] each sequence's blocks, padded with block 0
        seq_lens      context_lens + num_new: the keys each row attends to

    It answers `minillm.model.CacheView`: `update` writes the new K/V through the slot mapping and
    returns every row's keys and values gathered through its block table ([B, n_kv_heads, S, d],
    S = max(seq_lens)); `attention_mask` is causal by position, which also hides the keys past a
    row's own length.
    """

    def __init__(
        self, cache: PagedKVCache, seq_ids: list[Hashable], tables: list[BlockTable], token_ids: list[list[int]]
    ) -> None:
        self.cache, self.seq_ids, self.tables, self.token_ids = cache, seq_ids, tables, token_ids
        self.context_lens = [t.num_tokens for t in tables]
        self.num_new = [len(new) for new in token_ids]
        self.seq_lens = [c + n for c, n in zip(self.context_lens, self.num_new)]
        T = self.T = max(self.num_new)
        self.max_seq_len = max(self.seq_lens)
        tokens, positions, slots = [], [], []
        write_rows, write_slots = [], []  # flat indices into the [B * T] new tokens, and their slots
        for b, (table, c, new) in enumerate(zip(tables, self.context_lens, token_ids)):
            pad = T - len(new)
            tokens.append([0] * pad + new)
            positions.append([0] * pad + list(range(c, c + len(new))))
            row_slots = [table.slot(p) for p in range(c, c + len(new))]
            slots.append([PAD_SLOT] * pad + row_slots)
            write_rows += range(b * T + pad, (b + 1) * T)
            write_slots += row_slots
        device = cache.device
        self.tokens = torch.tensor(tokens, device=device)
        self.position_ids = torch.tensor(positions, device=device)
        self.slot_mapping = torch.tensor(slots, device=device)
        width = max(len(t.block_ids) for t in tables)
        self.block_tables = torch.tensor([t.block_ids + [0] * (width - len(t.block_ids)) for t in tables],
                                         device=device)
        self.write_rows = torch.tensor(write_rows, device=device)
        self.write_slots = torch.tensor(write_slots, device=device)
        self.padded = min(self.num_new) < T  # whether some rows are left-padded
        self.read_pools = False  # set by attention_mask when the paged kernel reads the pools directly
        self._read_slots: torch.Tensor | None = None
        self.done = False

    # ---------------------------------------------------------------- the CacheView interface
    def positions(self, n: int) -> torch.Tensor:
        """The new tokens' positions [B, T] (n must be T, the padded number of new tokens per row)."""
        if n != self.T:
            raise ValueError(f"this step was prepared for {self.T} tokens per row (left-padded), not {n}: "
                             "pass view.tokens to the model.")
        return self.position_ids

    def attention_mask(self, positions: torch.Tensor, window: int | None) -> torch.Tensor | PagedDecode:
        """[B, 1, T, S] bool: key position <= query position (and within `window`).

        The keys `update` returns are positions 0..S-1 of each row, and a row's real queries sit
        below its own length, so the causal rule alone hides the keys past a shorter row's end.
        A decode step (one new token per row) on CUDA gets a `PagedDecode` instead: attention then
        reads the pools through the block tables with the paged Triton kernel, and nothing is gathered;
        a quantised cache's 8-bit pools too, with their scales (chapter 06): the kernel dequantises as it reads.
        """
        pool = self.cache.k[0]
        # what attention computes in: the pool's dtype, or the model's for a quantised cache's 8-bit codes
        computed = pool if not self.cache.quantized else pool.new_empty(0, dtype=self.cache.dtype)
        if self.T == 1 and window is None and use_triton_attention(computed, pool.shape[-1]):
            self.read_pools = True
            seq_lens = torch.tensor(self.seq_lens, device=pool.device, dtype=torch.int32)
            return PagedDecode(self.block_tables, seq_lens, self.max_seq_len, self.cache.dtype)
        if self.T == 1 and window is None and min(self.seq_lens) == self.max_seq_len:
            return None  # one query per row and every row as long as the longest: each query sees every key
        keys = torch.arange(self.max_seq_len, device=positions.device).expand(positions.shape[0], -1)
        return attention_mask(positions, keys, window)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, n_kv_heads, T, head_dim] (padding skipped) to their slots in `layer`'s pools;
        return every row's keys and values, [B, n_kv_heads, max(seq_lens), head_dim], or, for the
        paged kernel (see `attention_mask`), the pools themselves.

        A quantised cache (chapter 06) writes each slot's 8-bit codes and its scale (one per head), and
        returns what it reads dequantised to the model's dtype."""
        cache, out = self.cache, []
        for (pool, scale_pool), new in zip(cache.layer_pools(layer), (k, v)):
            B, H, T, d = new.shape
            flat = pool.view(-1, H, d)  # [num_blocks * block_size, H, d]: slot s is row s
            rows = new.transpose(1, 2).reshape(B * T, H, d)
            if self.padded:
                rows = rows.index_select(0, self.write_rows)  # padding tokens are not written
            store_kv(pool, scale_pool, self.write_slots, rows)
            if self.read_pools:  # the paged kernel reads the pool (and its scales) in place
                out.append(kernel_pool(pool, scale_pool))
                continue
            # the reference paged read, every row's positions 0..S-1 through its block table
            S, slots = self.max_seq_len, self.read_slots().view(-1)
            if scale_pool is None:
                read = flat.index_select(0, slots)
            else:
                codes = flat.view(torch.uint8).index_select(0, slots).view(pool.dtype)
                read = dequantize_kv(codes, scale_pool.view(-1, H).index_select(0, slots), cache.dtype)
            out.append(read.view(B, S, H, d).transpose(1, 2))
        return out[0], out[1]

    def read_slots(self) -> torch.Tensor:
        """[B, S] the flat slot of each row's positions 0..S-1 (S = max(seq_lens)): where `update` reads.

        `gather_kv` with the block tables, as slots: block_tables[b, p // block_size] * block_size +
        p % block_size. Made once per step; every layer reads the same slots.
        """
        if self._read_slots is None:
            bs = self.cache.block_size
            p = torch.arange(self.max_seq_len, device=self.block_tables.device)
            self._read_slots = self.block_tables[:, p // bs] * bs + p % bs
        return self._read_slots

    def advance(self, n: int) -> None:
        """The forward wrote every layer: the new tokens join their block tables (and the prefix cache)."""
        if self.done:
            raise RuntimeError("this step was already run: prepare a new one for the next forward.")
        self.done = True
        self.cache.commit(self.tables, self.token_ids)
