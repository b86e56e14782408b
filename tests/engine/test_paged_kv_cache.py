"""The paged KV cache of chapter 04, `minillm.engine.kv_cache`: allocator, prefix cache, copy-on-write, the model on it.

Tasks:
  1. BlockAllocator: allocate / free / fork with reference counts, copy-on-write, NoFreeBlocksError.
  2. Prefix caching: chained block hashes, shared prompt blocks, hit counts, LRU eviction.
  3. PagedKVCache: slot mapping, gather_kv, and random operations that never lose a block or a value.
  4. The model on a PagedKVCache: the same greedy tokens and logits as on the contiguous KVCache, for
     one sequence, ragged batches, chunked prefill, and block sizes 1, 16 and one dividing nothing.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from minillm.kernels import gather_kv

import minillm
from minillm import SamplingParams
from minillm.config import ModelConfig
from minillm.contiguous_cache import KVCache
from minillm.engine.block_manager import PAD_SLOT, BlockAllocator, NoFreeBlocksError, block_hash, prefix_block_hashes
from minillm.engine.kv_cache import PagedKVCache

# A cache-only config for the tests that drive the cache without a model: 2 layers, 2 KV heads of 2.
TINY = ModelConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=2, ffn_dim=8, vocab_size=8)


# ------------------------------------------------------------------ synthetic keys and values
def chain_values(token_ids: list[int]) -> list[int]:
    """One integer per position that depends on the whole prefix up to it (as a real K/V does)."""
    values, h = [], 17
    for t in token_ids:
        h = (h * 1_000_003 + t + 1) % 4_000_037
        values.append(h)
    return values


def reference_kv(token_ids: list[int], layer: int, config: ModelConfig = TINY) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V [n_kv_heads, len, head_dim] a sequence of these tokens must have in `layer` (exact in fp32)."""
    base = torch.tensor(chain_values(token_ids), dtype=torch.float32)[None, :, None]  # [1, L, 1]
    offset = torch.arange(config.n_kv_heads * config.head_dim, dtype=torch.float32).view(config.n_kv_heads, 1, -1)
    k = base + offset + 100 * layer
    return k, -k


def run_step(cache: PagedKVCache, seq_ids: list, new_tokens: list[list[int]], history: dict) -> None:
    """One forward without a model: prepare, write each row's synthetic K/V in every layer, advance.

    `history[seq_id]` holds the tokens the sequence had before this step. Padding columns carry a huge
    value, so a padding token written anywhere shows up as wrong data.
    """
    view = cache.prepare(seq_ids, new_tokens)
    B, T = view.tokens.shape
    assert view.position_ids.shape == view.slot_mapping.shape == (B, T)
    for layer in range(len(cache.k)):
        k = torch.full((B, TINY.n_kv_heads, T, TINY.head_dim), 1e9)
        v = torch.full_like(k, -1e9)
        for b, (s, new) in enumerate(zip(seq_ids, new_tokens)):
            full_k, full_v = reference_kv(history[s] + new, layer)
            k[b, :, T - len(new):] = full_k[:, len(history[s]):]
            v[b, :, T - len(new):] = full_v[:, len(history[s]):]
        got_k, got_v = view.update(layer, k, v)
        assert got_k.shape == (B, TINY.n_kv_heads, max(view.seq_lens), TINY.head_dim)
    view.advance(T)
    for s, new in zip(seq_ids, new_tokens):
        history[s] = history[s] + new


def snapshot(cache: PagedKVCache) -> tuple:
    """Everything the allocator and the block tables hold, to check that a failed step changed nothing."""
    a = cache.allocator
    tables = {s: (list(t.block_ids), list(t.token_ids), list(t.block_hashes)) for s, t in cache.block_tables.items()}
    return (list(a.ref_counts), list(a.free_blocks), list(a.evictable), dict(a.cached_blocks), dict(a.block_hashes),
            a.hits, a.misses, tables, [p.clone() for p in cache.k + cache.v])


def assert_same_state(before: tuple, after: tuple) -> None:
    *meta_before, pools_before = before
    *meta_after, pools_after = after
    assert meta_before == meta_after, "a failed step must leave the allocator and every block table unchanged"
    assert all(torch.equal(x, y) for x, y in zip(pools_before, pools_after)), "a failed step must not touch the pools"


def check_invariants(cache: PagedKVCache, history: dict) -> None:
    """No block leaked or double-freed, ref counts exact, prefix cache consistent, every sequence's K/V intact."""
    a = cache.allocator
    holders = Counter(b for t in cache.block_tables.values() for b in t.block_ids)
    for block in range(a.num_blocks):
        assert a.ref_counts[block] == holders[block], (
            f"block {block}: ref count {a.ref_counts[block]}, but {holders[block]} block tables hold it"
        )
    free, evictable, used = set(a.free_blocks), set(a.evictable), set(holders)
    assert len(free) == len(a.free_blocks), f"a block is twice in the free list: {list(a.free_blocks)}"
    assert not (free & evictable or free & used or evictable & used), "a block is in two states at once"
    assert len(free) + len(evictable) + len(used) == a.num_blocks, (
        f"leak: {len(free)} free + {len(evictable)} cached-unreferenced + {len(used)} used != {a.num_blocks}"
    )
    assert a.num_free_blocks + a.num_used_blocks == a.num_blocks
    assert {b: h for h, b in a.cached_blocks.items()} == a.block_hashes, "cached_blocks and block_hashes disagree"
    assert all(block in a.block_hashes for block in evictable), "an evictable block must hold a cached hash"
    assert not any(block in a.block_hashes for block in free), "a block on the free list must hold no cached hash"
    bs = cache.block_size
    for s, table in cache.block_tables.items():
        assert table.token_ids == history[s], f"sequence {s!r}: the table's tokens differ from what was written"
        assert len(table.block_ids) * bs >= table.num_tokens
        if a.enable_prefix_caching:
            assert table.block_hashes == prefix_block_hashes(table.token_ids, bs)
        for layer in range(len(cache.k)):
            k, v = cache.gather(s, layer)
            ref_k, ref_v = reference_kv(history[s], layer)
            assert torch.equal(k, ref_k) and torch.equal(v, ref_v), (
                f"sequence {s!r}, layer {layer}: its keys/values changed (another sequence wrote into its block?)"
            )


# ------------------------------------------------------------------ task 1: the allocator
def test_task_1_allocate_free_and_fork_count_references():
    """allocate gives distinct blocks with ref count 1; fork adds a holder; free removes one; at 0 it is free."""
    a = BlockAllocator(num_blocks=4, block_size=16, enable_prefix_caching=False)
    blocks = [a.allocate() for _ in range(3)]
    assert len(set(blocks)) == 3 and all(a.ref_counts[b] == 1 for b in blocks)
    assert a.num_free_blocks == 1 and a.num_used_blocks == 3
    assert a.fork(blocks[0]) == blocks[0] and a.ref_counts[blocks[0]] == 2, "fork must add one reference"
    a.free(blocks[0])
    assert a.ref_counts[blocks[0]] == 1 and a.num_free_blocks == 1, "a block still held by one table is not free"
    a.free(blocks[0])
    assert a.ref_counts[blocks[0]] == 0 and a.num_free_blocks == 2
    with pytest.raises(ValueError, match="double free"):
        a.free(blocks[0])
    with pytest.raises(ValueError, match="only a block some table holds can be shared"):
        a.fork(blocks[0])


def test_task_1_exhausted_pool_raises_with_the_numbers_and_allocates_nothing():
    """The allocator raises NoFreeBlocksError(1 requested, 0 free); a cache step that needs 3 blocks with 1
    free raises (3, 1), and neither changes any state."""
    a = BlockAllocator(num_blocks=2, block_size=4)
    a.allocate(), a.allocate()
    before = (list(a.ref_counts), list(a.free_blocks))
    with pytest.raises(NoFreeBlocksError, match="1 needed, 0 free of 2") as err:
        a.allocate()
    assert (err.value.requested, err.value.free, err.value.num_blocks) == (1, 0, 2)
    assert (list(a.ref_counts), list(a.free_blocks)) == before

    cache, history = PagedKVCache(TINY, num_blocks=3, block_size=4), {"a": [], "b": []}
    cache.add_sequence("a"), cache.add_sequence("b")
    run_step(cache, ["a"], [[1] * 8], history)  # 2 of the 3 blocks
    before = snapshot(cache)
    with pytest.raises(NoFreeBlocksError, match="3 needed, 1 free of 3") as err:
        cache.prepare(["b"], [[2] * 9])  # 9 tokens need 3 blocks
    assert (err.value.requested, err.value.free) == (3, 1)
    assert_same_state(before, snapshot(cache))
    with pytest.raises(NoFreeBlocksError, match="2 needed, 1 free"):  # "a" fits alone; with "b" the step does not
        cache.prepare(["a", "b"], [[1], [2]])
    assert_same_state(before, snapshot(cache))
    check_invariants(cache, history)


def test_task_1_copy_on_write_gives_a_private_block_only_when_shared():
    """copy_on_write keeps a block held once; a shared block gives a fresh one and loses one reference."""
    a = BlockAllocator(num_blocks=3, block_size=4)
    block = a.allocate()
    assert a.copy_on_write(block) == block, "a block this table alone holds is written in place"
    a.fork(block)
    fresh = a.copy_on_write(block)
    assert fresh != block and a.ref_counts[fresh] == 1 and a.ref_counts[block] == 1


def test_task_1_forked_sequences_copy_the_shared_partial_block_on_write():
    """After a fork at 6 tokens (block size 4), each sibling's next token leaves the other's data intact; two
    siblings writing in one step need ONE copy (the last holder writes in place), so one free block suffices."""
    cache, history = PagedKVCache(TINY, num_blocks=3, block_size=4), {"a": []}
    cache.add_sequence("a")
    run_step(cache, ["a"], [[1, 2, 3, 4, 5, 6]], history)
    cache.fork("a", "b")
    history["b"] = list(history["a"])
    shared = cache.block_tables["a"].block_ids
    assert cache.block_tables["b"].block_ids == shared and all(cache.allocator.ref_counts[b] == 2 for b in shared)
    assert cache.allocator.num_free_blocks == 1
    run_step(cache, ["a", "b"], [[7], [0]], history)  # both write into the shared second block
    check_invariants(cache, history)
    a_blocks, b_blocks = cache.block_tables["a"].block_ids, cache.block_tables["b"].block_ids
    assert a_blocks[0] == b_blocks[0], "the full first block stays shared"
    assert a_blocks[1] != b_blocks[1], "the written partial block must now be private to each sibling"


# ------------------------------------------------------------------ task 2: prefix caching
def test_task_2_block_hash_is_a_sha256_chain_over_token_bytes():
    """block_hash = sha256(parent digest + token ids as little-endian int64): fixed across processes, and the
    same tokens after different prefixes hash differently."""
    assert block_hash(None, [1, 2]) == hashlib.sha256(struct.pack("<2q", 1, 2)).hexdigest()
    parent = block_hash(None, [5, 6])
    assert block_hash(parent, [1, 2]) == hashlib.sha256(bytes.fromhex(parent) + struct.pack("<2q", 1, 2)).hexdigest()
    assert block_hash(parent, [1, 2]) != block_hash(block_hash(None, [7, 8]), [1, 2]), "the parent must count"
    assert prefix_block_hashes(list(range(10)), 4) == [
        block_hash(None, [0, 1, 2, 3]), block_hash(block_hash(None, [0, 1, 2, 3]), [4, 5, 6, 7])
    ], "two full blocks of 4 in 10 tokens; the partial third has no hash"


def test_task_2_shared_40_token_prefix_shares_two_blocks_and_counts_hits():
    """Block size 16: "a" has a 40-token prompt, "b" the same 40 tokens then 10 more. "b" reuses exactly the
    2 full blocks (not the partial third), and the counts are exact: a 2 misses, b 2 hits + 1 miss."""
    rng = random.Random(0)
    prefix = [rng.randrange(8) for _ in range(40)]
    cache, history = PagedKVCache(TINY, num_blocks=16, block_size=16), {}
    assert cache.add_sequence("a", prefix) == 0, "a cold cache has nothing to reuse"
    history["a"] = []
    run_step(cache, ["a"], [prefix], history)
    assert (cache.allocator.hits, cache.allocator.misses) == (0, 2), "a's prompt: 39 // 16 = 2 blocks looked up"

    prompt_b = prefix + [rng.randrange(8) for _ in range(10)]
    cached = cache.add_sequence("b", prompt_b)
    assert cached == 32, f"b must reuse 2 blocks (32 tokens), got {cached} tokens"
    history["b"] = prompt_b[:32]
    a_blocks, b_blocks = cache.block_tables["a"].block_ids, cache.block_tables["b"].block_ids
    assert b_blocks == a_blocks[:2] and all(cache.allocator.ref_counts[x] == 2 for x in a_blocks[:2])
    assert (cache.allocator.hits, cache.allocator.misses) == (2, 3), "b: 49 // 16 = 3 blocks, 2 found"
    assert cache.allocator.hit_rate == pytest.approx(2 / 5)
    run_step(cache, ["b"], [prompt_b[32:]], history)
    assert cache.block_tables["b"].block_ids[2] != a_blocks[2], "the partial third block is never shared"
    check_invariants(cache, history)


def test_task_2_freed_cached_blocks_survive_until_evicted_least_recently_used_first():
    """Blocks of a freed prompt stay reusable; when the free list runs dry, the least recently freed cached
    block is evicted first (a prompt's tail before its head), and a reused block becomes recent again."""
    cache, history = PagedKVCache(TINY, num_blocks=6, block_size=2), {}
    prompt_a, prompt_b = [1, 1, 2, 2, 3], [4, 4, 5, 5, 6]  # 2 full blocks + 1 partial each
    for s, p in (("a", prompt_a), ("b", prompt_b)):
        cache.add_sequence(s, p)
        history[s] = []
        run_step(cache, [s], [p], history)
    a_full, b_full = cache.block_tables["a"].block_ids[:2], cache.block_tables["b"].block_ids[:2]
    cache.free("a"), cache.free("b")
    del history["a"], history["b"]
    alloc = cache.allocator
    assert alloc.num_free_blocks == 6 and len(alloc.evictable) == 4, "4 cached full blocks, unreferenced"
    assert list(alloc.evictable) == [a_full[1], a_full[0], b_full[1], b_full[0]], "LRU order: a's tail first"

    assert cache.add_sequence("a2", prompt_a) == 4, "a's blocks survived a's free"
    history["a2"] = prompt_a[:4]
    assert cache.block_tables["a2"].block_ids == a_full
    cache.free("a2")
    del history["a2"]
    assert list(alloc.evictable) == [b_full[1], b_full[0], a_full[1], a_full[0]], "reuse made a's blocks recent"

    cache.add_sequence("c")
    history["c"] = []
    run_step(cache, ["c"], [[7] * 6], history)  # 3 blocks: the 2 plain free ones, then evict b's tail
    assert b_full[1] in cache.block_tables["c"].block_ids, "the least recently used cached block is evicted first"
    assert list(alloc.evictable) == [b_full[0], a_full[1], a_full[0]]
    assert cache.add_sequence("b2", prompt_b) == 2, "b lost its second block: only the first is reused"
    history["b2"] = prompt_b[:2]
    check_invariants(cache, history)


# ------------------------------------------------------------------ task 3: slot mapping, gather, random ops
def test_task_3_slot_mapping_and_gather_follow_the_block_table():
    """slot = block * block_size + offset for every written position (-1 for padding), and gather_kv reads
    positions back in order through the block table."""
    cache, history = PagedKVCache(TINY, num_blocks=8, block_size=3), {"x": [], "y": []}
    cache.add_sequence("x"), cache.add_sequence("y")
    run_step(cache, ["y"], [[3, 3]], history)  # y takes a block first, so x's blocks are not 0, 1, 2
    view = cache.prepare(["x", "y"], [[1, 2, 3, 4, 5], [6]])
    table_x, table_y = cache.block_tables["x"].block_ids, cache.block_tables["y"].block_ids
    expected_x = [table_x[p // 3] * 3 + p % 3 for p in range(5)]
    assert view.slot_mapping.tolist() == [expected_x, [PAD_SLOT] * 4 + [table_y[0] * 3 + 2]]
    assert view.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 2]], "left padding at position 0"
    assert view.tokens.tolist() == [[1, 2, 3, 4, 5], [0, 0, 0, 0, 6]]

    pool = torch.arange(8 * 3 * 2 * 2, dtype=torch.float32).view(8, 3, 2, 2)
    tables = torch.tensor([[5, 1], [2, 0]])
    got = gather_kv(pool, tables, 4)
    assert got.shape == (2, 2, 4, 2), "[B, n_kv_heads, length, head_dim]"
    flat = pool.view(-1, 2, 2)
    for b in range(2):
        for p in range(4):
            slot = int(tables[b, p // 3]) * 3 + p % 3
            assert torch.equal(got[b, :, p], flat[slot]), f"row {b} position {p} must come from slot {slot}"


@settings(max_examples=200, deadline=None, database=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(3, 12),
       prefix_caching=st.booleans())
def test_task_3_random_operations_never_leak_blocks_or_corrupt_data(data, block_size, num_blocks, prefix_caching):
    """Random add (with prefix reuse) / append (ragged batches) / fork / free on a small pool. After every
    operation: free + cached-unreferenced + used == num_blocks, ref counts equal the number of tables holding
    each block, and every sequence's gathered K/V equals its own reference (copy-on-write protected it). A step
    that does not fit raises NoFreeBlocksError and changes nothing."""
    cache = PagedKVCache(TINY, num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix_caching)
    history: dict[int, list[int]] = {}
    tokens = st.integers(0, 1)  # a two-token vocabulary: prompts share prefixes often
    next_id = 0
    operations = st.sampled_from(["add", "append", "append", "fork", "free"])  # appends twice as often
    for op in data.draw(st.lists(operations, min_size=8, max_size=30)):
        live = sorted(history)
        if op == "add":
            prompt = data.draw(st.lists(tokens, min_size=1, max_size=3 * block_size + 2))
            cached = cache.add_sequence(next_id, prompt)
            assert cached % block_size == 0 and (cached < len(prompt) or cached == 0)
            history[next_id] = prompt[:cached]
            if prompt[cached:]:
                before = snapshot(cache)
                try:
                    run_step(cache, [next_id], [prompt[cached:]], history)
                except NoFreeBlocksError:
                    assert_same_state(before, snapshot(cache))
            next_id += 1
        elif op == "append" and live:
            ids = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
            new = [data.draw(st.lists(tokens, min_size=1, max_size=2 * block_size + 1)) for _ in ids]
            before = snapshot(cache)
            try:
                run_step(cache, ids, new, history)
            except NoFreeBlocksError as err:
                assert err.requested > err.free
                assert_same_state(before, snapshot(cache))
        elif op == "fork" and live:
            parent = data.draw(st.sampled_from(live))
            cache.fork(parent, next_id)
            history[next_id] = list(history[parent])
            next_id += 1
        elif op == "free" and live:
            victim = data.draw(st.sampled_from(live))
            cache.free(victim)
            del history[victim]
        check_invariants(cache, history)
    for s in list(history):
        cache.free(s)
    assert cache.allocator.num_free_blocks == num_blocks, "every block must come back once all sequences are freed"


# ------------------------------------------------------------------ task 4: the model on a paged cache
@pytest.fixture(scope="module")
def model():
    model, _ = minillm.load("shakespeare-1m")
    return model


def paged_greedy(model, prompts: list[list[int]], max_tokens: int, block_size: int, rng: random.Random | None = None,
                 num_blocks: int = 256) -> list[list[int]]:
    """Greedy continuations of all prompts, decoded together in ragged batches on one PagedKVCache.

    With `rng`, prompts are fed in random chunks, so steps mix prefill chunks of some sequences with decode
    tokens of others; the chunk's last logits are used only once a prompt is complete.
    """
    cache = PagedKVCache(model.config, num_blocks, block_size)
    pending = {i: list(p) for i, p in enumerate(prompts)}  # tokens to feed next
    outputs: dict[int, list[int]] = {i: [] for i in pending}
    for i in pending:
        cache.add_sequence(i)
    with torch.inference_mode():
        while pending:
            ids = sorted(pending)
            feeds = []
            for i in ids:
                n = rng.randint(1, len(pending[i])) if rng else len(pending[i])
                feeds.append(pending[i][:n])
                pending[i] = pending[i][n:]
            view = cache.prepare(ids, feeds)
            logits = model(view.tokens, cache=view, last_only=True)[:, -1]  # left padding: column -1 is each row's last
            for row, i in enumerate(ids):
                if pending[i]:
                    continue  # mid-prompt
                outputs[i].append(int(logits[row].argmax()))
                if len(outputs[i]) == max_tokens:
                    del pending[i]
                    cache.free(i)
                else:
                    pending[i] = [outputs[i][-1]]
    assert cache.allocator.num_free_blocks == num_blocks
    return [outputs[i] for i in range(len(prompts))]


def contiguous_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return minillm.generate(model, prompt, params).token_ids


def random_prompts(seed: int, n: int, vocab: int, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


BLOCK_SIZES = pytest.mark.parametrize("block_size", [1, 16, 7], ids=["bs1", "bs16", "bs7"])


@BLOCK_SIZES
def test_task_4_greedy_single_sequence_paged_equals_contiguous(model, block_size):
    """One sequence, 24 greedy tokens: the same ids with the paged cache as with `generate`'s KVCache."""
    prompt = random_prompts(1, 1, model.config.vocab_size)[0]
    expected = contiguous_greedy(model, prompt, 24)
    got = paged_greedy(model, [prompt], 24, block_size)[0]
    assert got == expected, f"block size {block_size}: paged {got} != contiguous {expected}"


@BLOCK_SIZES
def test_task_4_greedy_ragged_batch_paged_equals_contiguous(model, block_size):
    """Five prompts of random lengths prefilled in ONE forward and decoded together: each sequence's tokens equal
    its own contiguous-cache generation."""
    prompts = random_prompts(2 + block_size, 5, model.config.vocab_size)
    got = paged_greedy(model, prompts, 16, block_size)
    for i, p in enumerate(prompts):
        expected = contiguous_greedy(model, p, 16)
        assert got[i] == expected, f"sequence {i} (prompt of {len(p)}), block size {block_size}: {got[i]} != {expected}"


@BLOCK_SIZES
def test_task_4_greedy_chunked_prefill_with_random_chunks_equals_contiguous(model, block_size):
    """Prompts fed in random chunks, mixed in each step with other sequences' decode tokens: same greedy ids."""
    prompts = random_prompts(10 + block_size, 4, model.config.vocab_size)
    got = paged_greedy(model, prompts, 12, block_size, rng=random.Random(block_size))
    for i, p in enumerate(prompts):
        expected = contiguous_greedy(model, p, 12)
        assert got[i] == expected, f"sequence {i}, block size {block_size}: {got[i]} != {expected}"


def test_task_4_logits_paged_close_to_contiguous(model):
    """fp32 logits. One sequence fed in chunks then decoded, paged vs KVCache on the same chunks: within atol 1e-5
    (the same shapes: in fact bit-identical). A ragged paged batch (prefill, then a decode step) vs each sequence
    on its own KVCache: within atol 1e-5 + rtol 1e-5, since batching alone changes the matmuls' summation order
    (measured: up to 1.5e-5, about 8 fp32 ulps, at |logit| ~ 18)."""
    prompts = random_prompts(3, 3, model.config.vocab_size, max_len=40)
    with torch.no_grad():
        rng = random.Random(5)
        tokens = [rng.randrange(model.config.vocab_size) for _ in range(30)]
        paged, contiguous = PagedKVCache(model.config, 64, 16), KVCache(model.config, 1, len(tokens))
        paged.add_sequence("s")
        start = 0
        for n in (7, 20, 1, 1, 1):
            view = paged.prepare(["s"], [tokens[start : start + n]])
            got = model(view.tokens, cache=view)
            expected = model(torch.tensor([tokens[start : start + n]]), cache=contiguous)
            err = (got - expected).abs().max().item()
            assert err <= 1e-5, f"tokens {start}..{start + n - 1}: paged and contiguous logits differ by {err:.2e}"
            start += n

        cache = PagedKVCache(model.config, 64, 16)
        for i in range(3):
            cache.add_sequence(i)
        view = cache.prepare([0, 1, 2], prompts)
        paged_prefill = model(view.tokens, cache=view)
        view = cache.prepare([0, 1, 2], [[5], [6], [7]])
        paged_decode = model(view.tokens, cache=view)[:, -1]
        for i, p in enumerate(prompts):
            kv = KVCache(model.config, 1, len(p) + 1)
            prefill = model(torch.tensor([p]), cache=kv)[0]
            decode = model(torch.tensor([[5 + i]]), cache=kv)[0, -1]
            torch.testing.assert_close(paged_prefill[i, -len(p):], prefill, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, i=i: f"sequence {i}, prefill in a ragged batch: {m}")
            torch.testing.assert_close(paged_decode[i], decode, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, i=i: f"sequence {i}, decode in a ragged batch: {m}")


def test_task_4_prefix_cache_hit_gives_the_logits_of_a_cold_run(model):
    """A prompt whose first 32 tokens hit the prefix cache (left by a freed sequence) gives, for its remaining
    tokens, the logits of a cold run that computes all of it."""
    rng = random.Random(4)
    shared = [rng.randrange(model.config.vocab_size) for _ in range(40)]
    prompt = shared + [rng.randrange(model.config.vocab_size) for _ in range(10)]
    warm = PagedKVCache(model.config, 32, 16)
    cold = PagedKVCache(model.config, 32, 16, enable_prefix_caching=False)
    with torch.no_grad():
        warm.add_sequence("first", shared)
        view = warm.prepare(["first"], [shared])
        model(view.tokens, cache=view)
        warm.free("first")

        cached = warm.add_sequence("second", prompt)
        assert cached == 32 and warm.allocator.hits == 2, f"expected 2 blocks from the cache, got {cached} tokens"
        view = warm.prepare(["second"], [prompt[cached:]])
        hit = model(view.tokens, cache=view)[0]

        assert cold.add_sequence("second", prompt) == 0
        view = cold.prepare(["second"], [prompt])
        full = model(view.tokens, cache=view)[0, cached:]
    err = (hit - full).abs().max().item()
    assert err <= 1e-5, f"prefix-cache hit logits differ from a cold run by {err:.2e}"
    assert (hit.argmax(-1) == full.argmax(-1)).all()


def test_task_4_view_refuses_misuse_with_clear_messages(model):
    """A step runs once; the forward must pass the view's own T; unknown ids and empty rows are refused."""
    cache = PagedKVCache(model.config, 8, 4)
    cache.add_sequence("a")
    with pytest.raises(KeyError, match="add_sequence or fork it first"):
        cache.prepare(["nope"], [[1]])
    with pytest.raises(ValueError, match="at least one new token"):
        cache.prepare(["a"], [[]])
    view = cache.prepare(["a"], [[1, 2, 3]])
    with pytest.raises(ValueError, match="prepared for 3 tokens per row"):
        model(torch.tensor([[1, 2]]), cache=view)
    with torch.no_grad():
        model(view.tokens, cache=view)
    with pytest.raises(RuntimeError, match="already run"):
        view.advance(3)
    assert cache.num_tokens("a") == 3


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_task_4_packed_prompt_chunks_give_the_padded_batchs_logits_and_cache(model, kv_cache_dtype):
    """Prompt chunks packed side by side in one row (`paged_forward(packed=True)`, chapter 05) against the same
    chunks as a left-padded batch (`paged_forward`): three sequences of different lengths, then a second chunk of
    each, whose queries are the last of keys the cache already holds. Each sequence's last logits agree within 1e-5 (the
    matmuls see a different shape, [1, N] against [B, T], so the summation order may differ), and every layer
    holds the same keys and values (an int8 cache: the same codes and scales)."""
    from minillm.engine.model_runner import paged_forward

    rng = random.Random(7)
    vocab = model.config.vocab_size
    chunks = [[[rng.randrange(vocab) for _ in range(n)] for n in lengths] for lengths in ((20, 5, 33), (9, 17, 2))]
    caches = [PagedKVCache(model.config, 64, 16, kv_cache_dtype=kv_cache_dtype) for _ in range(2)]
    for cache in caches:
        for i in range(3):
            cache.add_sequence(i)
    for step, new in enumerate(chunks):
        padded = paged_forward(model, caches[0], [0, 1, 2], new)
        packed = paged_forward(model, caches[1], [0, 1, 2], new, packed=True)
        assert packed.shape == padded.shape == (3, vocab)
        torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5, msg=lambda m, s=step: f"chunk {s}: {m}")
    for i in range(3):
        assert caches[1].block_tables[i].token_ids == caches[0].block_tables[i].token_ids
        for layer in range(model.config.n_layers):
            for a, b in zip(caches[1].gather(i, layer), caches[0].gather(i, layer)):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_task_4_the_engine_packs_prompt_chunks_and_generates_what_it_did_padded(model, monkeypatch):
    """The engine's prompt chunks go through `paged_forward(packed=True)` (one row, no padding); greedy outputs are
    those of the same engine with packing off. A model with a sliding window is not packed (a packed step attends
    causally within each sequence, without a window), and a packed view refuses a window."""
    from minillm.decoding.llm import LLM
    from minillm.engine import LLMEngine, model_runner
    from minillm.model import Transformer

    calls = []
    real = model_runner.paged_forward

    def spy(m, c, ids, toks, packed=False, **k):  # noqa: ANN001, ANN003, ANN202
        if packed:
            calls.append(len(ids))
        return real(m, c, ids, toks, packed=packed, **k)

    monkeypatch.setattr(model_runner, "paged_forward", spy)
    prompts = random_prompts(11, 6, model.config.vocab_size, max_len=60)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for packed in (True, False):
        llm = LLM(model, None, max_num_batched_tokens=64)
        llm.engine.model_runner.packed_prompts = packed
        outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
    assert calls and max(calls) > 1, "steps with several prompt chunks ran packed"
    windowed = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64,
                                       sliding_window=8))
    assert not LLMEngine(windowed, num_blocks=8).model_runner.packed_prompts
    cache = PagedKVCache(windowed.config, 8, 16)
    cache.add_sequence("s")
    with pytest.raises(ValueError, match="sliding window"):
        cache.prepare(["s"], [[1, 2, 3]], packed=True).attention_mask(None, 8)


def test_task_4_a_mixed_step_as_one_packed_forward_generates_what_two_forwards_did(model):
    """The runner's one-forward mixed step (`packed_in_place`, on by itself where attention reads the pools in
    place: CUDA), turned on here on the CPU, where a packed step gathers each sequence's keys: decode rows run as
    sequences of one token beside the prompt chunks, in the step's order, and greedy outputs are those of the
    runner's two forwards (decode rows, then prompt chunks)."""
    from minillm.decoding.llm import LLM

    prompts = random_prompts(13, 7, model.config.vocab_size, max_len=70)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = []
    for in_place in (True, False):
        llm = LLM(model, None, max_num_batched_tokens=40, max_num_seqs=4)
        assert not llm.engine.model_runner.packed_in_place, "on the CPU attention gathers the keys"
        llm.engine.model_runner.packed_in_place = in_place
        outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_task_4_packed_prompt_chunks_on_the_gpu_match_the_padded_batch(monkeypatch):
    """On a GPU the packed sequences attend through one launch per layer of the paged prefill kernel, which reads
    each sequence's keys from the pools through its block table (`paged_prefill_attention`); the padded batch
    through PyTorch's attention with a mask over gathered keys: bf16 logits within bf16's rounding."""
    import minillm.kernels

    from minillm.engine.model_runner import paged_forward

    kernel, calls = minillm.kernels.paged_prefill_attention, []
    monkeypatch.setattr(minillm.kernels, "paged_prefill_attention",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))

    gpu_model, _ = minillm.load("shakespeare-1m", device="cuda", dtype=torch.bfloat16)
    rng = random.Random(8)
    vocab = gpu_model.config.vocab_size
    chunks = [[[rng.randrange(vocab) for _ in range(n)] for n in lengths] for lengths in ((40, 7, 120), (33, 2, 64))]
    caches = [PagedKVCache(gpu_model.config, 64, 16, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    for cache in caches:
        for i in range(3):
            cache.add_sequence(i)
    for new in chunks:
        padded = paged_forward(gpu_model, caches[0], [0, 1, 2], new).float()
        packed = paged_forward(gpu_model, caches[1], [0, 1, 2], new, packed=True).float()
        torch.testing.assert_close(packed, padded, atol=0.1, rtol=0.05)
        assert (packed.argmax(-1) == padded.argmax(-1)).float().mean() >= 2 / 3
    assert len(calls) == 2 * gpu_model.config.n_layers  # one launch per layer and forward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_task_4_mixed_steps_run_as_one_packed_forward_on_the_gpu(kv_cache_dtype, monkeypatch):
    """On a GPU a step with prompt chunks beside decode rows runs as ONE packed forward (decode rows are sequences
    of one token; attention reads the pools in place). fp32 on the GPU, chunked prefill with a small token budget so
    that many steps are mixed: the greedy tokens equal those of the same engine running each step as a decode
    forward plus a prompt forward (`packed_in_place` off), with async scheduling and CUDA graphs on in both."""
    from minillm.decoding.llm import LLM
    from minillm.engine import model_runner

    mixed, real = [], model_runner.paged_forward

    def spy(m, c, ids, toks, packed=False, **k):  # noqa: ANN001, ANN003, ANN202
        if packed and min(map(len, toks)) == 1 < max(map(len, toks)):
            mixed.append(len(ids))
        return real(m, c, ids, toks, packed=packed, **k)

    monkeypatch.setattr(model_runner, "paged_forward", spy)
    monkeypatch.setenv("MINILLM_MIXED_GRAPHS", "0")  # the eager forward; test_mixed_graphs.py checks the replays
    gpu_model, _ = minillm.load("shakespeare-1m", device="cuda", dtype=torch.float32)
    prompts = random_prompts(12, 10, gpu_model.config.vocab_size, max_len=90)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for in_place in (True, False):
        llm = LLM(gpu_model, None, max_num_batched_tokens=48, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
        runner = llm.engine.model_runner
        assert runner.packed_in_place and runner.use_cuda_graphs, "on CUDA: graphs, and attention reads the pools"
        runner.packed_in_place = in_place
        outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if in_place:
            assert mixed, "some steps held decode rows beside prompt chunks, in one packed forward"
    assert outs[0] == outs[1]
