"""Chapter 04's exercise tasks: a block allocator with reference counts, the slot mapping, the KV waste of
contiguous and paged allocation, and the prefix-cache names of a prompt's full blocks.

The allocator is checked by its invariants, not against one allocation order: any free block may be
handed out (first in first out, last in first out, lowest id...). The slot mapping is checked against
`PagedKVCache.prepare`; the waste against `minillm.arithmetic`; the hashes against
`minillm.engine.block_manager.prefix_block_hashes`.
"""

from __future__ import annotations

import copy
import hashlib
import math
import random
import struct
from collections import deque
from collections.abc import Callable, Sequence

from minillm import arithmetic
from minillm.book.grading.registry import MismatchError, call_catching, expect_equal, register_task
from minillm.config import ModelConfig
from minillm.engine.block_manager import PAD_SLOT, prefix_block_hashes
from minillm.engine.kv_cache import PagedKVCache


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(x: object, limit: int = 80) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


# ---- 04.block_allocator -----------------------------------------------------------------------------


def reference_replay_allocator(num_blocks: int, ops: list) -> tuple[list, list[int]]:
    """Replay `ops` on a fresh pool of `num_blocks` KV blocks; return (one result per op, final ref counts).

    The pool keeps a free list and a reference count per block (how many block tables hold it):
      "allocate"     a free block, ref count 1; its id is the result. "full" when no block is free
                     (nothing changes).
      ("fork", b)    one more table shares held block b: ref count + 1; the result is b.
      ("free", b)    one table lets go of b: ref count - 1, and at 0 b is free again (allocatable);
                     the result is None.
    Freeing a block nobody holds (a double free), or forking one, results in "error" and changes nothing.
    This pool hands out the block that has been free longest (a FIFO queue); any free block would do.
    """
    free = deque(range(num_blocks))
    ref_counts = [0] * num_blocks
    results: list = []
    for op in ops:
        if op == "allocate":
            if not free:
                results.append("full")
                continue
            block = free.popleft()
            ref_counts[block] = 1
            results.append(block)
            continue
        kind, block = op
        if ref_counts[block] == 0:  # nobody holds it: a double free, or a fork of a free block
            results.append("error")
        elif kind == "fork":
            ref_counts[block] += 1
            results.append(block)
        else:
            ref_counts[block] -= 1
            if ref_counts[block] == 0:
                free.append(block)
            results.append(None)
    return results, ref_counts


block_allocator = register_task(
    "04.block_allocator",
    "replay_allocator(num_blocks: int, ops: list) -> (results: list, ref_counts: list[int])"
    "  (ops: \"allocate\", (\"fork\", b), (\"free\", b))",
    reference=reference_replay_allocator,
    forbid=("minillm.engine.block_manager.BlockAllocator", "minillm.engine.kv_cache.PagedKVCache"),
)

_ALLOCATOR_HOW = ("keep a free list (a deque of block ids) and ref_counts = [0] * num_blocks. allocate: pop a free "
                  "block, set its count to 1 (or 'full' if the list is empty); fork: count + 1; free: count - 1, "
                  "and only at 0 put the block back on the free list. A free or fork of a block whose count is 0 "
                  "appends 'error' and changes nothing.")
_STILL_HELD = ("block {b} still had {k} reference(s) when you handed it out: it was forked, then freed fewer times "
               "than it was shared. Count every fork (ref count + 1) and put a block back on the free list only "
               "when its count reaches 0, or two sequences will write their K/V into the same block.")


class _PoolModel:
    """What the grader knows about the reader's pool: the ref counts implied by the reader's own block ids,
    and what happened to each block (for hints that name the mistake)."""

    def __init__(self, num_blocks: int) -> None:
        self.n = num_blocks
        self.ref = [0] * num_blocks
        self.forked: set[int] = set()  # blocks forked at least once
        self.freed_while_held: set[int] = set()  # blocks freed once while another table still held them
        self.errored: set[int] = set()  # blocks a double free or a fork of a free block named

    def held(self) -> dict[int, int]:
        return {b: c for b, c in enumerate(self.ref) if c > 0}

    def free_ids(self) -> list[int]:
        return [b for b, c in enumerate(self.ref) if c == 0]


def _allocate_hint(model: _PoolModel, got: object) -> str:
    n, free = model.n, model.free_ids()
    if got == "full":
        if len(free) == 1:
            return (f"off by one: 'full' only when all {_blocks(n)} are held, and block {free[0]} was still free. "
                    "Test `if not free_list`, not `len(free_list) <= 1`.")
        return (f"'full' only when no block is free, but blocks {free} were free: a block whose ref count drops to "
                "0 goes back on the free list and can be allocated again.")
    if not _is_int(got):
        return "append the id of the block handed out (a Python int), or 'full' when no block is free."
    if not 0 <= got < n:
        return (f"block ids run from 0 to num_blocks - 1 = {n - 1}: there is no block {got}. When all "
                f"{_blocks(n)} are held, append 'full'.")
    if got in model.freed_while_held:
        return _STILL_HELD.format(b=got, k=model.ref[got])
    if got in model.errored:
        return (f"block {got} was freed twice (or forked while free) earlier: that must change nothing. You put "
                "it on the free list again, so it came out twice. Check ref_counts[b] > 0 before you free.")
    if not free:
        return f"all {_blocks(n)} are held: append 'full' and change nothing."
    return f"hand out a block nobody holds: block {got} was held (ref count {model.ref[got]}). " + _ALLOCATOR_HOW


def _fork_hint(model: _PoolModel, block: int, got: object) -> str:
    if model.ref[block] == 0:
        return (f"block {block} is free (its ref count is 0): only a block some table holds can be shared. "
                "Append 'error' and change nothing.")
    if got == "error" and block in model.forked:
        return (f"block {block} is still held (ref count {model.ref[block]}): every fork adds a reference, so a "
                "forked block needs one free per holder before it is free.")
    return f"block {block} is held: fork adds a reference (ref count + 1) and appends the block id itself, {block}."


def _free_hint(model: _PoolModel, block: int, got: object) -> str:
    if model.ref[block] == 0:
        return (f"a double free: block {block} has ref count 0, nobody holds it. Check ref_counts[b] > 0 first; "
                "if not, append 'error' and change nothing (no negative counts, no second copy on the free list).")
    if got == "error" and block in model.forked:
        return (f"count the forks: block {block} was forked, so it still has {model.ref[block]} reference(s) and "
                "this free is legal. fork must do ref_counts[b] += 1.")
    if got == "error":
        return (f"block {block} is held (ref count {model.ref[block]}): drop one reference and append None. Did "
                "allocate set its count to 1?")
    return "a legal free appends None (the result of the op), after dropping one reference."


def _check_replay(fn: Callable, num_blocks: int, ops: list, what: str) -> None:
    """Replay `ops` with the reader's pool and check each result against the invariants, using the reader's ids."""
    got = fn(num_blocks, copy.deepcopy(ops))
    if isinstance(got, list):
        got = tuple(got)
    if not isinstance(got, tuple) or len(got) != 2:
        raise MismatchError(what, "a tuple (results, ref_counts)", _short(got),
                            "return two lists: return results, ref_counts.")
    results, counts = got
    if not isinstance(results, (list, tuple)) or len(results) != len(ops):
        size = f"{len(results)} entries" if isinstance(results, (list, tuple)) else type(results).__name__
        raise MismatchError(f"{what}[0], the results", f"a list of {len(ops)} entries, one per op", size,
                            "append exactly one result per op: a block id or 'full' (allocate), the block id "
                            "(fork), None (free), or 'error'.")
    model = _PoolModel(num_blocks)
    for i, (op, r) in enumerate(zip(ops, results)):
        where = f"{what}[0][{i}], the result of op {i}, {repr(op)}"
        held = model.held()
        state = f"held before it: {held}" if held else "no block held before it"
        if op == "allocate":
            free = model.free_ids()
            if not free:
                if r != "full":
                    raise MismatchError(where, f"'full' (all {_blocks(num_blocks)} held)", _short(r),
                                        _allocate_hint(model, r))
                continue
            if not (_is_int(r) and 0 <= r < num_blocks and model.ref[r] == 0):
                raise MismatchError(where, f"the id of a free block, one of {free} ({state})", _short(r),
                                    _allocate_hint(model, r))
            model.ref[r] = 1
            continue
        kind, block = op
        if model.ref[block] == 0:
            if r != "error":
                hint = _fork_hint(model, block, r) if kind == "fork" else _free_hint(model, block, r)
                raise MismatchError(where, f"'error' (block {block} is not held; {state})", _short(r), hint)
            model.errored.add(block)
        elif kind == "fork":
            if not (_is_int(r) and r == block):
                raise MismatchError(where, f"{block} (ref count {model.ref[block]} -> {model.ref[block] + 1})",
                                    _short(r), _fork_hint(model, block, r))
            model.ref[block] += 1
            model.forked.add(block)
        else:
            if r is not None:
                raise MismatchError(where, f"None (ref count {model.ref[block]} -> {model.ref[block] - 1})",
                                    _short(r), _free_hint(model, block, r))
            model.ref[block] -= 1
            if model.ref[block] > 0:
                model.freed_while_held.add(block)
    what_counts = f"{what}[1], the final ref counts"
    if not isinstance(counts, (list, tuple)) or len(counts) != num_blocks or not all(map(_is_int, counts)):
        raise MismatchError(what_counts, f"a list of {num_blocks} ints", _short(counts),
                            "return ref_counts as a list with one int per block: ref_counts[b] = how many block "
                            "tables hold block b (0 if free).")
    if list(counts) != model.ref:
        b = next(b for b in range(num_blocks) if counts[b] != model.ref[b])
        if counts[b] < 0:
            hint = ("a double free must change nothing: check ref_counts[b] > 0 before you drop a reference, and "
                    "append 'error' if not.")
        elif b in model.forked and counts[b] < model.ref[b]:
            hint = f"count the forks: block {b} was forked, and every fork adds one reference (ref count + 1)."
        else:
            hint = ("each allocate sets the block's count to 1, each fork adds 1, each free drops 1 (and a free or "
                    "fork of a block nobody holds changes nothing).")
        raise MismatchError(what_counts, f"{model.ref} (from your block ids)", _short(list(counts)),
                            f"block {b}: " + hint)


@block_allocator.test("a pool of 4 hands out 4 different blocks, then says 'full'")
def _(fn: Callable) -> None:
    _check_replay(fn, 4, ["allocate"] * 5, "replay_allocator(4, ['allocate'] * 5)")


@block_allocator.test("a freed block can be allocated again (2 blocks: allocate, allocate, free 0, allocate)")
def _(fn: Callable) -> None:
    ops = ["allocate", "allocate", ("free", 0), "allocate", "allocate", ("free", 1), ("free", 0), "allocate"]
    _check_replay(fn, 2, ops, f"replay_allocator(2, {ops})")


@block_allocator.test("a forked block stays held until every holder frees it (fork, free once, the pool is still full)")
def _(fn: Callable) -> None:
    ops = ["allocate", "allocate", "allocate", ("fork", 1), ("fork", 1), ("free", 1), "allocate", ("free", 1),
           "allocate", ("free", 1), "allocate", "allocate"]
    _check_replay(fn, 3, ops, f"replay_allocator(3, {ops})")


@block_allocator.test("a double free, or a fork of a free block, gives 'error' and changes nothing")
def _(fn: Callable) -> None:
    ops = ["allocate", ("free", 0), ("free", 1), ("free", 2), ("fork", 0), ("fork", 1), ("fork", 2), "allocate",
           "allocate", ("free", 0), ("free", 0), "allocate", "allocate"]
    _check_replay(fn, 3, ops, f"replay_allocator(3, {ops})")


@block_allocator.test("a pool of one block: 'full' at the second allocate; forked, it is free only after two frees")
def _(fn: Callable) -> None:
    ops = ["allocate", "allocate", ("fork", 0), ("free", 0), "allocate", ("free", 0), ("free", 0), "allocate"]
    _check_replay(fn, 1, ops, f"replay_allocator(1, {ops})")


def _random_ops(num_blocks: int, n: int, seed: int) -> list:
    """n random ops on ids 0..num_blocks-1 (seeded): allocations, forks and frees, some of them of free blocks."""
    rng = random.Random(seed)
    ops: list = []
    for _ in range(n):
        r = rng.random()
        if r < 0.42:
            ops.append("allocate")
        else:
            ops.append(("fork" if r < 0.62 else "free", rng.randrange(num_blocks)))
    return ops


@block_allocator.test("400 random operations (seeded) on pools of 3 and 8 blocks keep every invariant")
def _(fn: Callable) -> None:
    for num_blocks, n, seed in ((8, 300, 401), (3, 100, 402)):
        _check_replay(fn, num_blocks, _random_ops(num_blocks, n, seed),
                      f"replay_allocator({num_blocks}, {n} random ops, seed {seed})")


# ---- 04.slot_mapping --------------------------------------------------------------------------------


def reference_slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """The flat KV slots of positions start .. start + num_tokens - 1 of one sequence.

    Position p lives in block block_table[p // block_size] at offset p % block_size, so at slot
    block_table[p // block_size] * block_size + p % block_size of a pool viewed as
    [num_blocks * block_size, ...].
    """
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


slot_mapping = register_task(
    "04.slot_mapping",
    "slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]",
    reference=reference_slot_mapping,
    forbid=("minillm.engine.block_manager.BlockTable", "minillm.engine.kv_cache.PagedKVCache",
            "minillm.engine.kv_cache.PagedCacheView"),
)

_SLOT_HOW = ("for each position p in range(start, start + num_tokens): "
             "slot = block_table[p // block_size] * block_size + p % block_size.")


def _slot_hint(table: list[int], start: int, n: int, bs: int, got: object) -> str:
    """Name the mistake by recomputing the common wrong slot mappings."""
    if not isinstance(got, list):
        return "return a Python list of ints (one slot per position); a tensor's .tolist() gives one."
    positions = range(start, start + n)

    def mapping(f: Callable[[int], int], ps: Sequence[int] = positions) -> list[int] | None:
        try:
            return [f(p) for p in ps]
        except IndexError:
            return None

    suspects = [
        (list(positions), "you returned the positions themselves: (p // block_size) is the LOGICAL block, the "
                          "sequence's own numbering. Look it up in the table: block_table[p // block_size] is "
                          "the physical block in the pool."),
        (mapping(lambda p: table[p % bs] * bs + p // bs), "// and % are swapped: the block is p // block_size "
                                                          "(its index in the table), the offset inside it "
                                                          "p % block_size."),
        (mapping(lambda p: table[p // bs] + p % bs), "multiply the block id by block_size: block b starts at slot "
                                                     "b * block_size, and the offset p % block_size is added to "
                                                     "that."),
        (mapping(lambda p: table[p // bs] * bs + p), "add the offset inside the block, p % block_size, not the "
                                                     "position p."),
        (mapping(lambda p: table[p // bs] * bs + p % bs, range(start, n)), "num_tokens is how many positions, not "
                                                                         "the last one: range(start, start + "
                                                                         "num_tokens)."),
        (mapping(lambda p: table[p // bs] * bs + p % bs, range(n)), "the positions start at `start` (the tokens "
                                                                   "already cached come first): range(start, "
                                                                   "start + num_tokens)."),
        (mapping(lambda p: table[p // bs] * bs + p % bs, range(start + 1, start + n + 1)),
         "off by one: the first new token is at position start itself."),
    ]
    for wrong, hint in suspects:
        if wrong is not None and got == wrong:
            return hint
    if len(got) != n:
        return f"one slot per new token: {n} of them. " + _SLOT_HOW
    return _SLOT_HOW


def _check_slots(fn: Callable, table: list[int], start: int, n: int, bs: int, expected: list[int] | None = None,
                 what: str | None = None) -> None:
    if expected is None:
        expected = reference_slot_mapping(table, start, n, bs)
    what = what or f"slot_mapping({table}, start={start}, num_tokens={n}, block_size={bs})"
    got = call_catching(fn, (list(table), start, n, bs), "IndexError", what, f"the slots {expected}",
                         f"the table has {len(table)} entries, one per block of the sequence: index it with the "
                         "block number p // block_size, and add the offset p % block_size (swapped, p % block_size "
                         "runs past the table).")
    expect_equal(got, expected, what, _slot_hint(table, start, n, bs, got))


@slot_mapping.test("a 10-token prefill from position 0, block size 4, block table [7, 2, 9]")
def _(fn: Callable) -> None:
    _check_slots(fn, [7, 2, 9], 0, 10, 4)


@slot_mapping.test("a decode step: one token at position 21, in the middle of its block of 16")
def _(fn: Callable) -> None:
    _check_slots(fn, [3, 11, 5], 21, 1, 16)


@slot_mapping.test("a chunk of 12 tokens from position 8 crosses block boundaries (block size 5, unsorted table)")
def _(fn: Callable) -> None:
    _check_slots(fn, [12, 4, 30, 0, 17], 8, 12, 5)


@slot_mapping.test("block size 1: each position is a block of its own, so the slots are the table itself")
def _(fn: Callable) -> None:
    table = [9, 3, 14, 0, 6, 1]
    _check_slots(fn, table, 0, 6, 1)
    _check_slots(fn, table, 4, 2, 1)


def _tiny_config() -> ModelConfig:
    return ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=50)


@slot_mapping.test("the slots minillm's PagedKVCache writes: ragged prefill, a chunk, two decode steps, shuffled pool")
def _(fn: Callable) -> None:
    bs, rng = 4, random.Random(404)
    cache = PagedKVCache(_tiny_config(), num_blocks=24, block_size=bs, enable_prefix_caching=False)
    held = [cache.allocator.allocate() for _ in range(24)]
    rng.shuffle(held)
    for block in held:  # the free list now hands blocks out in a shuffled order, as after a while of serving
        cache.allocator.free(block)
    for seq in "abc":
        cache.add_sequence(seq)
    steps = [(["a", "b", "c"], [5, 3, 9]), (["b", "a", "c"], [6, 1, 7]), (["a", "b", "c"], [1, 1, 1]),
             (["c", "a"], [1, 1])]
    for seq_ids, counts in steps:
        view = cache.prepare(seq_ids, [[rng.randrange(50) for _ in range(k)] for k in counts])
        for row, seq in enumerate(seq_ids):
            table, start, n = list(view.tables[row].block_ids), view.context_lens[row], view.num_new[row]
            expected = [s for s in view.slot_mapping[row].tolist() if s != PAD_SLOT]
            _check_slots(fn, table, start, n, bs, expected,
                         f"slot_mapping({table}, start={start}, num_tokens={n}, block_size={bs}) for sequence "
                         f"{seq!r}, vs PagedKVCache.prepare(...).slot_mapping")
        view.advance(view.T)


# ---- 04.kv_waste ------------------------------------------------------------------------------------


def reference_kv_waste(lengths: list[int], max_len: int, block_size: int) -> tuple[float, float]:
    """(the fraction of reserved KV slots unused when each sequence reserves max_len contiguous slots,
    the fraction of allocated slots unused under paging with blocks of block_size tokens).

        contiguous = 1 - sum(lengths) / (len(lengths) * max_len)
        paged      = 1 - sum(lengths) / (block_size * sum(ceil(l / block_size)))   (0 if nothing is allocated)
    """
    used = sum(lengths)
    contiguous = 1 - used / (len(lengths) * max_len)
    allocated = block_size * sum(arithmetic.cdiv(n, block_size) for n in lengths)
    paged = 1 - used / allocated if allocated else 0.0
    return contiguous, paged


kv_waste = register_task(
    "04.kv_waste",
    "kv_waste(lengths: list[int], max_len: int, block_size: int) -> (contiguous waste, paged waste)",
    reference=reference_kv_waste,
    forbid=(
        "minillm.arithmetic.contiguous_kv_waste", "minillm.arithmetic.paged_kv_waste", "minillm.arithmetic.kv_blocks"
    ),
)


def _near(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _contiguous_hint(lengths: list[int], max_len: int, got: float, expected: float) -> str:
    used, reserved = sum(lengths), len(lengths) * max_len
    suspects = [
        ((reserved - used) / used, "waste is a fraction of what was reserved: 1 - used / reserved, not "
                                   "(reserved - used) / used."),
        (used / reserved, "that is the fraction used: the waste is 1 minus it."),
        (1 - used / (len(lengths) * max(lengths)), "every sequence reserves max_len slots up front, not the "
                                                   "longest length of this batch (which no one knows in advance)."),
        (100 * expected, "return a fraction in [0, 1), not a percentage."),
    ]
    for value, hint in suspects:
        if _near(got, value):
            return hint
    return "contiguous waste = 1 - sum(lengths) / (len(lengths) * max_len)."


def _paged_hint(lengths: list[int], block_size: int, got: float, expected: float) -> str:
    used, bs = sum(lengths), block_size
    allocated = bs * sum(arithmetic.cdiv(n, bs) for n in lengths)
    floor_slots, plus_one = bs * sum(n // bs for n in lengths), bs * sum(n // bs + 1 for n in lengths)
    per_seq = sum(1 - n / (bs * arithmetic.cdiv(n, bs)) for n in lengths if n) / len(lengths)
    suspects = [
        (1 - used / floor_slots if floor_slots else None,
         "round the blocks up: a sequence of l tokens holds ceil(l / block_size) blocks, its last one partly filled; "
         "l // block_size drops that block."),
        (1 - used / plus_one, "a length that is a multiple of block_size fills its last block exactly: it holds "
                              "l / block_size blocks, not l // block_size + 1. Use -(-l // block_size) or "
                              "math.ceil(l / block_size)."),
        ((allocated - used) / used, "waste is a fraction of the slots allocated: 1 - used / allocated, not "
                                    "(allocated - used) / used."),
        (used / allocated, "that is the fraction used: the waste is 1 minus it."),
        (per_seq, "weigh by slots: total unused slots / total allocated slots over all sequences, not the mean of "
                  "each sequence's fraction."),
        (100 * expected, "return a fraction in [0, 1), not a percentage."),
    ]
    for value, hint in suspects:
        if value is not None and _near(got, value):
            return hint
    return "paged waste = 1 - sum(lengths) / (block_size * sum(ceil(l / block_size)))."


def _check_waste(fn: Callable, lengths: list[int], max_len: int, block_size: int, what: str) -> None:
    expected = (arithmetic.contiguous_kv_waste(lengths, max_len), arithmetic.paged_kv_waste(lengths, block_size))
    got = call_catching(fn, (list(lengths), max_len, block_size), "ZeroDivisionError", what,
                         f"({expected[0]:.6g}, {expected[1]:.6g})",
                         "round the blocks up: a sequence shorter than a block still holds one block, "
                         "ceil(l / block_size) = -(-l // block_size); l // block_size gives 0 blocks, and no slots "
                         "to divide by.")
    if isinstance(got, list):
        got = tuple(got)
    if not isinstance(got, tuple) or len(got) != 2:
        raise MismatchError(what, "a tuple (contiguous waste, paged waste)", _short(got),
                            "return two fractions: return contiguous, paged.")
    for i, (g, name) in enumerate(zip(got, ("contiguous waste", "paged waste"))):
        if isinstance(g, bool) or not isinstance(g, (int, float)):
            raise MismatchError(f"{what}[{i}], {name}", f"a number ({expected[i]:.6g})", type(g).__name__,
                                "return Python floats (a tensor's .item() gives one).")
    if not (_near(got[0], expected[0]) and _near(got[1], expected[1])) and _near(got[0], expected[1]) \
            and _near(got[1], expected[0]):
        raise MismatchError(what, f"({expected[0]:.6g}, {expected[1]:.6g})", f"({got[0]:.6g}, {got[1]:.6g})",
                            "return (contiguous, paged), in that order.")
    if not _near(got[0], expected[0]):
        raise MismatchError(f"{what}[0], contiguous waste", f"{expected[0]:.6g}", f"{got[0]:.6g}",
                            _contiguous_hint(lengths, max_len, got[0], expected[0]))
    if not _near(got[1], expected[1]):
        raise MismatchError(f"{what}[1], paged waste", f"{expected[1]:.6g}", f"{got[1]:.6g}",
                            _paged_hint(lengths, block_size, got[1], expected[1]))


@kv_waste.test("four requests of 1, 37, 100 and 500 tokens at max_len 512, blocks of 16")
def _(fn: Callable) -> None:
    _check_waste(fn, [1, 37, 100, 500], 512, 16, "kv_waste([1, 37, 100, 500], 512, 16)")


@kv_waste.test("lengths on a block boundary (16, 32, 160) fill their last block: paged waste 0")
def _(fn: Callable) -> None:
    _check_waste(fn, [16, 32, 160], 256, 16, "kv_waste([16, 32, 160], 256, 16)")


@kv_waste.test("block size 1: paging wastes nothing, whatever the lengths")
def _(fn: Callable) -> None:
    _check_waste(fn, [5, 17, 300, 2], 1024, 1, "kv_waste([5, 17, 300, 2], 1024, 1)")


@kv_waste.test("one-token sequences: 15 of each block's 16 slots unused, 2,047 of 2,048 reserved")
def _(fn: Callable) -> None:
    _check_waste(fn, [1, 1, 1], 2048, 16, "kv_waste([1, 1, 1], 2048, 16)")


@kv_waste.test("sequences at max_len waste nothing contiguous; a mix with block size 5 and a ragged tail")
def _(fn: Callable) -> None:
    _check_waste(fn, [64, 64], 64, 16, "kv_waste([64, 64], 64, 16)")
    _check_waste(fn, [3, 10, 11, 49, 50], 50, 5, "kv_waste([3, 10, 11, 49, 50], 50, 5)")


@kv_waste.test("1,000 chat-like lengths (seeded, 20 to 4,096 tokens) at max_len 4,096, blocks of 16 and 128")
def _(fn: Callable) -> None:
    rng = random.Random(4096)
    lengths = [min(4096, max(20, round(rng.lognormvariate(6.0, 1.0)))) for _ in range(1000)]
    for bs in (16, 128):
        _check_waste(fn, lengths, 4096, bs, f"kv_waste(1,000 lengths from 20 to 4,096, 4096, {bs})")


# ---- 04.prefix_hashes -------------------------------------------------------------------------------


def reference_prefix_hashes(token_ids: list[int], block_size: int) -> list[str]:
    """The prefix-cache names of the FULL blocks of a prompt (a partial last block has none), as hex.

    Block i's name is sha256(digest of block i - 1 + its token ids packed as 8-byte little-endian
    signed ints); block 0 has no parent bytes. The chain makes a name stand for the whole prefix.
    """
    hashes: list[str] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.sha256(parent + struct.pack(f"<{len(block)}q", *block)).digest()
        hashes.append(digest.hex())
        parent = digest
    return hashes


prefix_hashes = register_task(
    "04.prefix_hashes",
    "prefix_hashes(token_ids: list[int], block_size: int) -> list[str]  (sha256 hex of each full block, chained)",
    reference=reference_prefix_hashes,
    forbid=("minillm.engine.block_manager.block_hash", "minillm.engine.block_manager.prefix_block_hashes",
            "minillm.engine.kv_cache.PagedKVCache", "minillm.engine.block_manager.BlockAllocator"),
)


def _pack_q(ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(ids)}q", *ids)


def _chain(token_ids: list[int], bs: int, pack: Callable[[Sequence[int]], bytes] = _pack_q,
           parent: str = "digest") -> list[str]:
    """The chain of full-block hashes, right (parent "digest") or built one of the common wrong ways:
    "none" (each block alone), "hex" (the parent's hex string as bytes), "after" (the parent after the
    ids), "prefix" (all tokens up to the block's end, no parent)."""
    out: list[str] = []
    previous: bytes | None = None
    for start in range(0, len(token_ids) - bs + 1, bs):
        ids = pack(token_ids[start : start + bs])
        if parent == "prefix":
            data = pack(token_ids[: start + bs])
        elif parent == "none" or previous is None:
            data = ids
        elif parent == "hex":
            data = previous.hex().encode() + ids
        elif parent == "after":
            data = ids + previous
        else:
            data = previous + ids
        previous = hashlib.sha256(data).digest()
        out.append(previous.hex())
    return out


_PACKINGS: list[tuple[Callable[[Sequence[int]], bytes], str]] = [
    (lambda ids: struct.pack(f">{len(ids)}q", *ids), "big-endian"),
    (lambda ids: struct.pack(f"<{len(ids)}i", *ids), "4-byte ints"),
    (lambda ids: str(list(ids)).encode(), "the text of the list"),
    (lambda ids: ",".join(map(str, ids)).encode(), "the ids as text"),
]
_HASH_HOW = ("h = hashlib.sha256(parent_digest + struct.pack(f'<{len(ids)}q', *ids)), with parent_digest = b'' for "
             "the first block and the previous block's h.digest() after that; append h.hexdigest().")


def _hash_hint(token_ids: list[int], bs: int, got: object) -> str:
    """Name the mistake by recomputing the common wrong chains."""
    full = len(token_ids) // bs
    if not isinstance(got, list):
        return "return a list of hex strings, one per full block."
    if any(isinstance(h, int) for h in got):
        return ("use hashlib.sha256(...).hexdigest(), not Python's hash(): hash() of str and bytes is randomised "
                "per process (PYTHONHASHSEED), so a name would not survive a restart or match another server's, "
                "and 64 bits collide sooner. " + _HASH_HOW)
    if any(isinstance(h, bytes) for h in got):
        return "return hex strings: .hexdigest() for the name (chain the raw .digest() bytes into the next block)."
    if len(got) == full + 1:
        return ("a partial last block has no hash: only a FULL block can be shared, since its tokens are final; "
                f"{len(token_ids)} tokens in blocks of {bs} make {full} full block(s).")
    if len(got) != full:
        return f"one hash per full block: len(token_ids) // block_size = {full} of them. " + _HASH_HOW
    suspects = [
        (_chain(token_ids, bs, parent="none"), "chain the blocks: hash the parent block's digest, then this block's "
                                               "ids. Hashed alone, the same 16 tokens get the same name after any "
                                               "prefix, and a prompt would reuse K/V computed after other tokens "
                                               "(K/V depend on every earlier token)."),
        (_chain(token_ids, bs, parent="hex"), "feed the parent in as its 32 digest bytes (.digest(), or "
                                              "bytes.fromhex(parent_hex)), not as the 64-character hex string."),
        (_chain(token_ids, bs, parent="after"), "the parent's digest comes first, then this block's ids."),
        (_chain(token_ids, bs, parent="prefix"), "hash the parent's digest and this block's ids, not every token "
                                                 "from the start: the chain gives the same guarantee in "
                                                 "O(block_size) per block."),
    ]
    for pack, name in _PACKINGS:
        suspects.append((_chain(token_ids, bs, pack=pack), f"pack the ids as 8-byte little-endian signed ints "
                                                           f"(struct.pack(f'<{{n}}q', *ids)), not {name}."))
    for wrong, hint in suspects:
        if got == wrong:
            return hint
    return _HASH_HOW


def _check_hashes(fn: Callable, token_ids: list[int], bs: int, what: str) -> list[str]:
    expected = prefix_block_hashes(token_ids, bs)
    got = fn(list(token_ids), bs)
    hint = "" if got == expected else _hash_hint(token_ids, bs, got)
    if not isinstance(got, list):
        raise MismatchError(what, f"a list of {len(expected)} hex strings", _short(got), hint)
    if len(got) != len(expected):
        raise MismatchError(what, f"{len(expected)} hashes (one per full block)", f"{len(got)}: {_short(got)}", hint)
    for i, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            raise MismatchError(f"{what}[{i}], the name of block {i}", e, g if isinstance(g, str) else _short(g), hint)
    return got


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(150_000) for _ in range(n)]


@prefix_hashes.test("the first block has no parent: sha256 of its 16 ids packed as 8-byte little-endian ints")
def _(fn: Callable) -> None:
    ids = list(range(1000, 1016))
    got = _check_hashes(fn, ids, 16, "prefix_hashes(list(range(1000, 1016)), 16)")
    expect_equal(got, [hashlib.sha256(_pack_q(ids)).hexdigest()], "prefix_hashes(list(range(1000, 1016)), 16)",
                 _HASH_HOW)


@prefix_hashes.test("equals minillm's chain of block hashes on random prompts (block sizes 16, 4 and 1)")
def _(fn: Callable) -> None:
    rng = random.Random(40)
    for bs, n in ((16, 100), (16, 64), (4, 37), (1, 9), (16, 5)):
        _check_hashes(fn, _prompt(rng, n), bs, f"prefix_hashes(a random {n}-token prompt, {bs})")


@prefix_hashes.test("a partial last block has no hash: 40 tokens in blocks of 16 give 2, 15 tokens give none")
def _(fn: Callable) -> None:
    rng = random.Random(41)
    _check_hashes(fn, _prompt(rng, 40), 16, "prefix_hashes(a 40-token prompt, 16)")
    _check_hashes(fn, _prompt(rng, 15), 16, "prefix_hashes(a 15-token prompt, 16)")


@prefix_hashes.test("the same 16 tokens after different prefixes get different hashes (the chain)")
def _(fn: Callable) -> None:
    rng = random.Random(42)
    shared = _prompt(rng, 16)
    a = _check_hashes(fn, _prompt(rng, 16) + shared, 16, "prefix_hashes(prefix A + X, 16)")
    b = _check_hashes(fn, _prompt(rng, 16) + shared, 16, "prefix_hashes(prefix B + X, 16)")
    if a[1] == b[1]:
        raise MismatchError("the names of X (the same 16 tokens) after prefixes A and B", "different", "equal",
                            "chain each block to its parent's digest.")


@prefix_hashes.test("two 64-token prompts sharing their first 40 tokens share exactly 2 hashes at block size 16")
def _(fn: Callable) -> None:
    rng = random.Random(43)
    a = _prompt(rng, 64)
    b = a[:40] + _prompt(rng, 8) + a[48:]  # tokens 40..47 differ; block 3 (48..63) holds the same tokens in both
    ha = _check_hashes(fn, a, 16, "prefix_hashes(prompt A, 16)")
    hb = _check_hashes(fn, b, 16, "prefix_hashes(prompt B, 16)")
    shared = sum(x == y for x, y in zip(ha, hb))
    if shared != 2:
        raise MismatchError("hashes prompts A and B share", 2, shared,
                            "blocks 0 and 1 (tokens 0..31) are the same prefix; block 2 differs, and block 3 holds "
                            "the same tokens after a different prefix, so it must differ too: chain the hashes.")
