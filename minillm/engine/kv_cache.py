"""The paged KV cache: pools of blocks, slot mapping, one forward's inputs and view (chapter 04).

A contiguous cache (chapter 02) reserves `max_len` positions per sequence before the first token.
A paged cache (PagedAttention, as in vLLM) cuts the memory into a fixed pool of *blocks* of
`block_size` tokens and hands a sequence a block only when its tokens arrive, so a sequence wastes
at most one partly filled block. Its *block table* lists its blocks in order: the token at position
p lives in block `table[p // block_size]` at offset `p % block_size`, that is at the flat *slot*

    slot = table[p // block_size] * block_size + p % block_size

    pools, per layer   K, V [num_blocks, block_size, n_kv_heads, head_dim]   (vLLM's layout)
    sequence "a"       block table [7, 2, 9]   40 tokens: blocks 7 and 2 full, block 9 holds 8
    sequence "b"       block table [7, 2, 4]   forked from "a" at 32 tokens: blocks 7 and 2 shared

The bookkeeping (which block holds what: `BlockAllocator`, `BlockTable`, prefix-cache hashes) is
`minillm.engine.block_manager`, with no tensor in it. This module holds the tensors:

* `PagedKVCache`: the pools and the block tables by sequence id (`add_sequence`, `fork`, `free`,
  `truncate`), and `prepare`, which allocates the blocks one forward needs and returns its `PagedCacheView`.
* `cache.builder`, the cache's `minillm.engine.step_inputs.StepInputBuilder`: the ONE input builder. Every
  forward's inputs (tokens, positions, slots, context lengths, block tables) come from it as one int64 tensor
  copied to the device once: the eager forward, the CUDA graphs' replay (`minillm.engine.cuda_graphs`), the
  compiled CPU step, speculative verification, beam search and the drafter.
* `PagedCacheView`: one forward's view of the cache, the per-step context. It answers
  `minillm.model.CacheView`, so the model's one `forward` runs on it exactly as on the contiguous
  `KVCache`, for sequences of different lengths in one batch; `PagedCacheView.of_decode_rows` is the same
  view over a captured (or compiled) decode step's fixed buffer.
* `store_kv` writes keys and values to their slots; the reference paged read, every sequence's keys
  (or values) gathered through its block table into a dense tensor, is `minillm.kernels.gather_kv`,
  beside the paged decode kernel it is the reference of.

KV-cache quantisation (chapter 06, `minillm.quant.kv`). `PagedKVCache(..., kv_cache_dtype="int8")` (or
"fp8", e4m3; "auto", the model's dtype, is the default; vLLM's option of the same name) stores the pools
in 8 bits and, beside them, one fp32 scale per (token, head) in scale pools shaped like the K/V pools
without the head_dim axis:

    per layer   K, V codes [num_blocks, block_size, n_kv_heads, head_dim]   int8 or float8_e4m3fn
                K, V scales [num_blocks, block_size, n_kv_heads]            fp32

A slot's scale sits at the same (block, offset) as its codes, so everything that moves blocks moves the
scales with them: prefix caching and fork share blocks (and so their scales), copy-on-write copies both
(`copy_block`), truncate leaves both to be overwritten. `update` quantises on write and dequantises what
it reads to the model's dtype (or, for the paged kernel on CUDA, hands over codes and scales to read in
place). Bytes per token roughly halve against bf16 (`minillm.quant.kv` says why
that doubles the batch a memory budget holds), so `num_blocks_for_memory` gives ~2x the blocks.

    cache = PagedKVCache(model.config, num_blocks=64)
    cached = cache.add_sequence("a", prompt_ids)             # tokens already in the prefix cache
    view = cache.prepare(["a"], [prompt_ids[cached:]])       # allocates blocks, maps slots
    logits = model(view.tokens, cache=view)                  # writes K/V through the slot mapping
    view = cache.prepare(["a"], [[next_token]])              # a decode step, and so on
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import torch

from minillm.config import ModelConfig
from minillm.engine.block_manager import (
    BLOCK_SIZE,
    BlockAllocator,
    BlockTable,
    NoFreeBlocksError,
    block_hash,
    lora_root_hash,
    prefix_block_hashes,
)
from minillm.engine.step_inputs import PackedInputs, StepInputBuilder, StepInputs
from minillm.model import PackedPrefill, PagedDecode, PagedPrefill, attention_mask, use_triton_attention
from minillm.quant.kv import (
    allocate_pools,
    dequantize_kv,
    kernel_pool,
    kv_bytes_per_token,
    kv_storage_dtype,
    quantize_kv,
)
from minillm.utils import cdiv, to_device


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
    [num_blocks, block_size, n_kv_heads] per layer (see the module's docstring and `minillm.quant.kv`).
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
        self.builder = StepInputBuilder(block_size)  # every forward's inputs over this cache (decode rows kept)

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def quantized(self) -> bool:
        """Whether the pools hold 8-bit codes with scales (kv_cache_dtype "int8" or "fp8"), chapter 06."""
        return self.k_scale is not None

    def all_pools(self) -> list[torch.Tensor]:
        """Every pool, in one order: each layer's K pool, each layer's V pool, then (quantised) each layer's K
        scales and V scales. A compiled decode step takes them as arguments in this order (`DecodeStep`)."""
        return [*self.k, *self.v, *(self.k_scale or ()), *(self.v_scale or ())]

    @property
    def nbytes(self) -> int:
        """Bytes of the pools, used or not: K and V, and their scales when quantised."""
        return sum(t.numel() * t.element_size() for t in self.all_pools())

    def num_tokens(self, seq_id: Hashable) -> int:
        """Positions of `seq_id` filled so far."""
        return self._table(seq_id).num_tokens

    def _table(self, seq_id: Hashable) -> BlockTable:
        if seq_id not in self.block_tables:
            raise KeyError(f"no sequence {seq_id!r} in the cache: add_sequence or fork it first.")
        return self.block_tables[seq_id]

    # ---------------------------------------------------------------- sequences
    def add_sequence(self, seq_id: Hashable, prompt_token_ids: Sequence[int] = (), lora: str | None = None) -> int:
        """Start sequence `seq_id`; with prefix caching, reuse the cached full blocks its prompt begins with.

        Returns how many prompt tokens are already in the cache (a multiple of block_size): run the
        model on prompt_token_ids[returned:] only. At least the last prompt token is always left to
        compute, since its logits choose the next token. `lora`: the LoRA adapter the sequence runs under
        (chapter 08); its blocks are named under it, so only sequences of the same adapter share them.
        """
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} is already in the cache: free it first, or use another id.")
        table = BlockTable(self.block_size, root_hash=lora_root_hash(lora))
        if self.allocator.enable_prefix_caching and prompt_token_ids:
            reusable = list(prompt_token_ids[: (len(prompt_token_ids) - 1) // self.block_size * self.block_size])
            hashes = prefix_block_hashes(reusable, self.block_size, table.root_hash)
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
        keep_blocks = cdiv(num_tokens, bs)
        for block in reversed(table.block_ids[keep_blocks:]):
            self.allocator.free(block)
        table.block_ids = table.block_ids[:keep_blocks]  # a new list: the input builder rewrites its row
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
        for pool in self.all_pools():
            pool[dst] = pool[src]

    def layer_pools(self, layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """`layer`'s (K pool, its scales) and (V pool, its scales); the scales are None unless quantised."""
        if not self.quantized:
            return (self.k[layer], None), (self.v[layer], None)
        return (self.k[layer], self.k_scale[layer]), (self.v[layer], self.v_scale[layer])

    def gather(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of `seq_id` in `layer`, each [n_kv_heads, num_tokens, head_dim] (dequantised to
        the model's dtype when the cache is quantised)."""
        from minillm.kernels import gather_kv  # the reference paged read (plain PyTorch), beside the paged kernel

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
            needed += max(0, cdiv(table.num_tokens + n, bs) - len(table.block_ids))
        return needed

    def has_room(self, seq_id: Hashable, n: int) -> bool:
        """Whether n more tokens of seq_id fit its blocks as they are: no new block, no copy-on-write."""
        table = self._table(seq_id)
        c, bs = table.num_tokens, self.block_size
        return c + n <= len(table.block_ids) * bs and (
            n == 0 or c % bs == 0 or self.allocator.ref_counts[table.block_ids[c // bs]] == 1)

    def allocate_slots(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> None:
        """Give each seq_ids[i] the blocks for num_new_tokens[i] more tokens, copying a shared partly filled
        last block first (copy-on-write). All or nothing: raises `NoFreeBlocksError`, changing nothing, if
        the pool cannot supply them. The scheduler (chapter 05) calls it request by request as it fills a
        step; `prepare` calls it too, and finds nothing left to do for blocks already allocated."""
        if all(self.has_room(seq_id, n) for seq_id, n in zip(seq_ids, num_new_tokens)):
            return  # the common case in decode: the last block has room and is this sequence's alone
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

    def prepare(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]],
                packed: bool = False) -> PagedCacheView:
        """Make room for token_ids[i] after what seq_ids[i] holds, and return the view the model runs on.

        Allocates every block the step needs, and copies a shared, partly filled last block before
        it is written (copy-on-write), all or nothing: if the pool cannot supply them, raises
        `NoFreeBlocksError` with nothing changed. The lists may have different lengths (a ragged
        batch: prompts, chunks of prompts and decode tokens together): left-padded to the longest as
        a batch [B, T], or with `packed` side by side in one row [1, sum of lengths] (`PackedCacheView`).
        """
        if len(seq_ids) != len(token_ids) or not seq_ids:
            raise ValueError(f"give one list of new tokens per sequence: {len(seq_ids)} ids, {len(token_ids)} lists.")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one step: {list(seq_ids)}.")
        if any(len(new) == 0 for new in token_ids):
            raise ValueError("every sequence in a step needs at least one new token.")
        self.allocate_slots(seq_ids, [len(new) for new in token_ids])
        tables = [self._table(s) for s in seq_ids]
        view = PackedCacheView if packed else PagedCacheView
        return view.of_tables(self, list(seq_ids), tables, [[int(t) for t in new] for new in token_ids])

    def commit(self, tables: Sequence[BlockTable], token_ids: Sequence[Sequence[int]]) -> None:
        """The new tokens' keys and values are written: add them to their tables, and name every block they
        filled in the prefix cache (called by `PagedCacheView.advance`)."""
        for table, new in zip(tables, token_ids):
            table.token_ids.extend(new)
            self._name_full_blocks(table)

    def commit_decode(self, tables: Sequence[BlockTable], token_ids: Sequence[int]) -> None:
        """`commit` for one new token per table (a decode step), in one pass: a table is looked at for the prefix
        cache only when its token fills a block (a block left waiting for a token in flight is named by
        `resolve_token`)."""
        bs = self.block_size
        for table, token in zip(tables, token_ids):
            table.token_ids.append(int(token))
            if table.num_tokens % bs == 0:
                self._name_full_blocks(table)

    def _name_full_blocks(self, table: BlockTable) -> None:
        """Name each full block of `table` not yet named, in order, in the prefix cache. A block holding a token
        still in flight (a negative placeholder, async scheduling) waits, and the blocks after it, until
        `resolve_token` gives the token its value: a block's name is the hash of its real tokens."""
        if not self.allocator.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(table.block_hashes), table.num_tokens // bs):
            tokens = table.token_ids[i * bs : (i + 1) * bs]
            if min(tokens) < 0:
                return
            table.block_hashes.append(block_hash(table.block_hashes[-1] if i else table.root_hash, tokens))
            self.allocator.cache_block(table.block_ids[i], table.block_hashes[-1])

    def resolve_token(self, seq_id: Hashable, position: int, token: int) -> None:
        """Async scheduling: the token at `position` of seq_id, committed as a placeholder while it was on the
        device, is now known. Sets it in the table (if the sequence still holds one that far: it may have been
        freed, or not run since) and names the blocks that are now complete."""
        table = self.block_tables.get(seq_id)
        if table is None or table.num_tokens <= position:
            return
        table.token_ids[position] = token
        self._name_full_blocks(table)


def attention_reads_pools(cache: PagedKVCache) -> bool:
    """Whether attention over `cache` runs the paged Triton kernels, which read the pools in place through the block
    tables (CUDA, `minillm.model.use_triton_attention`): the decode kernel for one new token a row, the paged prefill
    kernel for a packed step. Elsewhere (the CPU) every row's keys are gathered for PyTorch's attention."""
    pool = cache.k[0]
    # what attention computes in: the pool's dtype, or the model's for a quantised cache's 8-bit codes
    computed = pool if not cache.quantized else pool.new_empty(0, dtype=cache.dtype)
    return use_triton_attention(computed, pool.shape[-1])


class PagedCacheView:
    """One forward over a batch of sequences of a `PagedKVCache`: the per-step context (chapter 04).

    Made by `PagedKVCache.prepare`. Row b of the batch holds sequence seq_ids[b]: context_lens[b]
    tokens already cached and num_new[b] new ones, LEFT-padded to T = max(num_new), so that column
    T - 1 is every row's last new token (the one whose logits choose the next token). Its inputs are
    a `StepInputs`:

        tokens        [B, T] the new token ids, 0 in padding
        position_ids  [B, T] their positions, context_lens[b] ..; 0 in padding (a padding query sees key 0)
        slot_mapping  [B, T] the flat slot each new token's K/V is written to, PAD_SLOT (-1) in padding
        block_tables  [B, M] each sequence's blocks, padded with block 0
        seq_lens      context_lens + num_new (a list): the keys each row attends to

    It answers `minillm.model.CacheView`: `update` writes the new K/V through the slot mapping and
    returns every row's keys and values gathered through its block table ([B, n_kv_heads, S, d],
    S = max(seq_lens)); `attention_mask` is causal by position, which also hides the keys past a
    row's own length.
    """

    def __init__(self, cache: PagedKVCache, inputs: StepInputs, context_lens: list[int] | None = None,
                 num_new: list[int] | None = None, *, key_range: int | None = None, in_pytorch: bool = False,
                 tables: Sequence[BlockTable] = (), token_ids: Sequence[list[int]] = ()) -> None:
        """The one constructor, for every path.

        With each row's cached and new token counts (`context_lens`, `num_new`, known on the host), the view
        of an eager step: `of_tables` makes it from the engine's block tables, and a tensor-parallel worker,
        which holds no tables, from rank 0's inputs alone (chapter 08). Without them, the view of a captured (or
        compiled) decode step over fixed rows: one new token per row, nothing read on the host, attention
        through the tables over `key_range` keys (`of_decode_rows`). `advance` commits `token_ids` to `tables`,
        if the view was given them.
        """
        self.cache, self.inputs, self.T = cache, inputs, inputs.T
        self.tables, self.token_ids = list(tables), list(token_ids)  # what `advance` commits
        self.tokens, self.position_ids = inputs.tokens, inputs.position_ids
        self.slot_mapping, self.block_tables = inputs.slot_mapping, inputs.block_tables
        self.padded, self.write_rows = False, None  # with padding: the flat indices of the real tokens in [B * T]
        self.read_pools = False  # set by attention_mask when the paged kernel reads the pools directly
        self._read_slots: torch.Tensor | None = None
        self.fixed: PagedDecode | None = None  # a captured decode step's attention
        self.done = False
        if context_lens is None or num_new is None:  # a fixed decode step: slices of `rows`, read when it runs
            if key_range is None or self.T != 1:
                raise ValueError("a view without host lengths is a fixed decode step: T = 1, and key_range given")
            self.write_slots = self.slot_mapping[:, 0].contiguous()  # [B]
            self.max_seq_len, self.read_pools = key_range, True
            self.fixed = PagedDecode(self.block_tables, inputs.seq_lens, key_range, cache.dtype, in_pytorch)
            return
        self.context_lens, self.num_new = context_lens, num_new
        self.seq_lens = [c + n for c, n in zip(context_lens, num_new)]
        self.max_seq_len = max(self.seq_lens)
        self.padded = min(num_new) < self.T  # whether some rows are left-padded
        # Where the new keys and values go: every new token's slot, padding left out.
        self.write_slots = self.slot_mapping.reshape(-1)
        if self.padded:
            rows = [b * self.T + j for b, n in enumerate(num_new) for j in range(self.T - n, self.T)]
            self.write_rows = to_device(rows, torch.int64, cache.device)
            self.write_slots = self.write_slots.index_select(0, self.write_rows)

    @classmethod
    def of_tables(cls, cache: PagedKVCache, seq_ids: list[Hashable], tables: list[BlockTable],
                  token_ids: list[list[int]]) -> PagedCacheView:
        """An eager step over the engine's sequences: row b runs token_ids[b] after the tokens tables[b] holds."""
        inputs = cache.builder.build(seq_ids, tables, token_ids, cache.device)
        return cls(cache, inputs, [t.num_tokens for t in tables], [len(new) for new in token_ids],
                   tables=tables, token_ids=token_ids)

    @classmethod
    def of_decode_rows(cls, cache: PagedKVCache, rows: torch.Tensor, key_range: int,
                       in_pytorch: bool = False) -> PagedCacheView:
        """The view of a captured (or compiled) decode step over fixed rows [B, TABLE + blocks] (columns of
        `minillm.engine.step_inputs`), whatever they hold when the step runs.

        Nothing in it is read on the host: its tensors are slices of `rows`, made once, inside the recording, so
        that each replay reads the buffer as it is then. Attention always reads the pools through the tables
        (`PagedDecode`) over `key_range` keys, the longest context the step allows (chunks of keys past a row's
        length are skipped inside the kernel); `in_pytorch` reads them in PyTorch instead of the Triton kernel
        (the compiled CPU step). The fused rotary kernel may write the new keys and values itself
        (`fused_write_target`). `advance` has nothing to commit: the runner commits the tokens outside the step.
        `cache` may be any object with `layer_pools` and `dtype` (the compiled step passes its own pools).
        """
        return cls(cache, StepInputs(rows, T=1), key_range=key_range, in_pytorch=in_pytorch)

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
        if self.fixed is not None:
            return self.fixed
        if self.T == 1 and window is None and attention_reads_pools(self.cache):
            self.read_pools = True
            return PagedDecode(self.block_tables, self.inputs.seq_lens, self.max_seq_len, self.cache.dtype)
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

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer`'s key and value pools as the paged kernel reads them (`QuantizedPool`s for an 8-bit cache)."""
        (k, k_scale), (v, v_scale) = self.cache.layer_pools(layer)
        return kernel_pool(k, k_scale), kernel_pool(v, v_scale)

    def fused_write_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_pool, v_pool, slots [B]) for the fused rotary kernel to write a captured decode step's keys and values
        itself (`minillm.kernels.fused_rotary`'s `cache`; attention then reads `pools`); None where it does not: an
        eager step (its `update` writes them), an 8-bit cache (codes and scales), the compiled CPU step (no Triton)."""
        if self.fixed is None or self.fixed.in_pytorch:
            return None
        (k, k_scale), (v, _) = self.cache.layer_pools(layer)
        return None if k_scale is not None else (k, v, self.write_slots)

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
        if self.tables:  # a captured step's runner and a tensor-parallel worker commit nothing here
            self.cache.commit(self.tables, self.token_ids)


class PackedCacheView(PagedCacheView):
    """One forward over the new tokens of several sequences packed side by side in ONE row, [1, N] (chapter 05).

    A batch [B, T] pads every row to the longest: prompt chunks of 100 and 1,000 tokens in one step cost
    2,000 positions of compute for 1,100 tokens. Packed, the N = sum of the chunks' lengths tokens run
    through every matrix multiply once, with no padding; only attention must keep the sequences apart.
    Each token has its own position and slot (its keys and values go to its own sequence's blocks).

    * On CUDA (`attention_reads_pools`), `update` hands back the pools and `attention_mask` a
      `minillm.model.PagedPrefill`: one launch of `minillm.kernels.paged_prefill_attention` reads every sequence's
      keys in place, through its block table. A decode row is a sequence of one new token, so the engine runs a
      mixed step (prompt chunks beside decode rows) as ONE packed forward (`ModelRunner.forward`).
    * Elsewhere `update` returns the keys of every sequence one after another, [1, H_kv, S, d] with S = sum of the
      sequences' lengths (each read through its block table), `attention_mask` a `minillm.model.PackedPrefill`
      with both sets of offsets, and attention runs sequence by sequence.

    `last_rows` [P] are the positions of each sequence's last new token in the row, whose logits the
    model returns (`minillm.model.last_positions`). vLLM calls the packed layout "varlen". The inputs cross to the
    device as one int64 tensor (`StepInputBuilder.packed`).
    """

    def __init__(self, cache: PagedKVCache, packed: PackedInputs, tables: list[BlockTable],
                 token_ids: list[list[int]], max_queries: int | None = None) -> None:
        """From the engine's tables and new tokens (`of_tables`), or, with `max_queries` and no tables, the view of
        a captured mixed step over fixed buffers (`minillm.engine.mixed_graphs`): nothing read on the host, the
        paged prefill kernel's tiles chosen for up to `max_queries` queries a sequence, nothing committed."""
        self.cache, self.tables, self.token_ids = cache, tables, token_ids
        self.context_lens = [t.num_tokens for t in tables]
        self.num_new = [len(new) for new in token_ids]
        self.seq_lens = [c + n for c, n in zip(self.context_lens, self.num_new)]
        self.T = packed.tokens.shape[1]
        self.tokens, self.position_ids = packed.tokens, packed.position_ids  # [1, N] each
        self.write_slots, self._read_slots, self.last_rows = packed.write_slots, packed.read_slots, packed.last_rows
        self.padded, self.write_rows, self.fixed, self.done = False, None, None, False
        self.read_pools = packed.block_tables is not None  # the paged prefill kernel reads the pools in place
        if self.read_pools:
            self.max_seq_len = max(self.seq_lens, default=0)
            self.mask = PagedPrefill(packed.block_tables, packed.offsets, packed.seq_lens,
                                     max_queries or max(self.num_new), cache.dtype)
        else:
            self.max_seq_len = packed.read_slots.shape[0]  # `update` reads S keys for its one row
            self.mask = PackedPrefill(packed.q_starts, packed.k_starts, packed.offsets)

    @classmethod
    def of_tables(cls, cache: PagedKVCache, seq_ids: list[Hashable], tables: list[BlockTable],
                  token_ids: list[list[int]]) -> PackedCacheView:
        """The packed step over the engine's sequences (`PagedKVCache.prepare(..., packed=True)`): attention reads
        the pools through the tables where the paged prefill kernel runs (`attention_reads_pools`), else each
        sequence's keys gathered."""
        paged = attention_reads_pools(cache)
        return cls(cache, cache.builder.packed(tables, token_ids, cache.device, paged=paged), tables, token_ids)

    def attention_mask(self, positions: torch.Tensor, window: int | None) -> PackedPrefill | PagedPrefill:
        if window is not None:
            raise ValueError("a packed step attends causally within each sequence, without a sliding window: run "
                             "models with a window unpacked (PagedKVCache.prepare without packed).")
        return self.mask

    def read_slots(self) -> torch.Tensor:
        """[1, S] the slots of every sequence's positions, one sequence after another: where `update` reads."""
        return self._read_slots[None]
