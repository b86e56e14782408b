"""Blocks and block tables: the bookkeeping of the paged KV cache, without a tensor (chapter 04).

A paged cache (PagedAttention, as in vLLM) cuts the KV memory into a fixed pool of *blocks* of
`block_size` tokens and hands a sequence a block only when its tokens arrive. This module decides
which block holds what; `minillm.engine.kv_cache` holds the tensors (the pools) and moves the data.

* `BlockAllocator`: which blocks are free and how many block tables hold each (reference counts):
  `allocate`, `free`, `fork` (share), `copy_on_write` (decides when a write needs a private copy of a
  shared block), and `NoFreeBlocksError` when the pool runs dry, the signal on which the scheduler
  of chapter 05 preempts.
* Prefix caching: a FULL block is named by `block_hash(parent_hash, its token ids)`, a chain, so the
  same 16 tokens after different prefixes are different blocks. A new prompt reuses every cached
  full block of its prefix; a freed cached block stays reusable until a new allocation evicts it,
  least recently used first. Hits and misses are counted.
* `BlockTable`: one sequence's blocks, its tokens, and the hashes of its full blocks. The token at
  position p lives in block `block_ids[p // block_size]` at offset `p % block_size`, the flat slot

      slot = block_ids[p // block_size] * block_size + p % block_size
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

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


def lora_root_hash(lora: str | None) -> str | None:
    """The parent hash of a sequence's first block: None for the base model, sha256 of the LoRA adapter's name
    otherwise (chapter 08). Every block hash chains from it, so blocks computed under one adapter (their keys and
    values came out of its projections) are never reused for another adapter or for the base model."""
    return None if lora is None else hashlib.sha256(b"lora:" + lora.encode()).hexdigest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, root: str | None = None) -> list[str]:
    """The chain of hashes of the full blocks of `token_ids` (a partial last block has none) (chapter 04);
    `root`: the first block's parent (`lora_root_hash`), None for the base model."""
    hashes: list[str] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(block_hash(hashes[-1] if hashes else root, token_ids[start : start + block_size]))
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
    names of the full blocks, in order (empty without prefix caching). root_hash is the first block's parent
    hash: None, or its LoRA adapter's (`lora_root_hash`, chapter 08).
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[str] = field(default_factory=list)
    root_hash: str | None = None

    @property
    def num_tokens(self) -> int:
        """Positions filled."""
        return len(self.token_ids)

    def slot(self, position: int) -> int:
        """The flat slot of `position`: block_ids[position // block_size] * block_size + position % block_size."""
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def copy(self) -> BlockTable:
        """A table with the same blocks and tokens (the caller updates the blocks' reference counts)."""
        return BlockTable(self.block_size, list(self.block_ids), list(self.token_ids), list(self.block_hashes),
                          self.root_hash)
