"""minillm.engine.step_inputs: the one input builder, and the decode rows it keeps from step to step."""

from __future__ import annotations

import random

import pytest
import torch

import minillm
from minillm.engine.cuda_graphs import graph_batch_sizes, padded_batch_size
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.step_inputs import TABLE, StepInputBuilder, rows_to_array, step_rows
from minillm.utils import cdiv


@pytest.fixture(scope="module")
def model():
    model, _ = minillm.load("shakespeare-1m")
    return model


def test_decode_rows_hold_the_columns_of_step_rows(model):
    """Three sequences of different lengths: the builder's decode rows are `step_rows` at one token, column for
    column; the eager inputs of a decode step come from them, and those of a prompt chunk from `step_rows`."""
    cache = PagedKVCache(model.config, 16, 4)
    for i, n in enumerate((1, 6, 9)):
        cache.add_sequence(i)
        cache.allocate_slots([i], [n + 1])
        cache.commit([cache.block_tables[i]], [list(range(2, 2 + n))])
    tables = [cache.block_tables[i] for i in range(3)]
    rows = cache.builder.decode_rows([0, 1, 2], cache.block_tables, [7, 8, 9]).rows
    assert rows.shape == (3, TABLE + cdiv(10, 4))
    want = rows_to_array(step_rows(tables, [[7], [8], [9]], T=1))
    for b, table in enumerate(tables):
        read = TABLE + cdiv(table.num_tokens + 1, 4)
        assert rows[b, :read].tolist() == want[b, :read].tolist()
    inputs = cache.builder.build([0, 1, 2], tables, [[7], [8], [9]], "cpu")
    assert inputs.tokens[:, 0].tolist() == [7, 8, 9] and inputs.seq_lens.tolist() == [2, 7, 10]
    chunk = cache.builder.build([0, 2], [tables[0], tables[2]], [[5, 6], [4]], "cpu")
    assert chunk.T == 2 and chunk.tokens.tolist() == [[5, 6], [0, 4]], "left-padded to the longest"
    assert chunk.data.tolist() == rows_to_array(step_rows([tables[0], tables[2]], [[5, 6], [4]], 2)).tolist()


def test_the_staging_buffer_grows_and_keeps_its_rows():
    """Rows and columns past the first allocation: the buffer doubles and the rows kept in it survive."""
    from minillm.engine.block_manager import BlockTable

    builder = StepInputBuilder(block_size=2)
    tables = [BlockTable(2, list(range(10 * b, 10 * b + 3)), [1] * 5) for b in range(3)]
    builder.decode_rows([0, 1, 2], dict(enumerate(tables)), [1, 2, 3])
    long = BlockTable(2, list(range(100, 140)), [1] * 79)  # 40 blocks: wider than the first buffer
    many = [BlockTable(2, [200 + b], []) for b in range(20)]  # 20 more rows
    by_id = {**dict(enumerate(tables)), "long": long, **{3 + b: t for b, t in enumerate(many)}}
    got = builder.decode_rows([0, 1, 2, "long", *range(3, 23)], by_id, list(range(24))).rows
    assert got.shape == (24, TABLE + 40)
    assert got[3, TABLE: TABLE + 40].tolist() == list(range(100, 140))
    assert got[:3, TABLE: TABLE + 3].tolist() == [t.block_ids for t in tables], "kept rows moved with the growth"


@torch.inference_mode()
def test_kept_rows_equal_rows_written_afresh(model):
    """`decode_rows` keeps each sequence's row from one step to the next and writes only what changed. Over a random
    walk of decode steps (rows leaving, joining and changing order; blocks filling up; forks whose shared block is
    copied on write; tables grown outside the graphs, truncated, truncated and grown back to the same length on
    other blocks; an id started again, at the same length, on other blocks), every row must hold what `step_rows`
    computes afresh, in every column a kernel reads, and every padding row must be the padding row."""
    rng = random.Random(0)
    cache = PagedKVCache(model.config, 2000, 4)  # blocks of 4 tokens: a new block every 4 steps
    pad_row = [0, 0, 4 * 1999, 1, 1999]
    live: list[int] = []
    ids = iter(range(10**6))

    def grow(seq_id: int, n: int) -> None:  # n tokens added outside the graphs (a prompt chunk, an eager step)
        cache.allocate_slots([seq_id], [n])
        cache.commit([cache.block_tables[seq_id]], [[rng.randrange(2, 100) for _ in range(n)]])

    def start(seq_id: int, length: int) -> None:
        cache.add_sequence(seq_id, [rng.randrange(2, 100) for _ in range(length)])  # no prefix: random tokens
        grow(seq_id, length)
        live.append(seq_id)

    def filler() -> None:  # a new sequence, which takes the blocks freed last (so they are not handed back)
        start(next(ids), 12)

    for _ in range(8):
        start(next(ids), rng.randint(1, 30))
    events = []
    for step in range(300):
        event, seq_id = rng.choice(["fork", "grow", "truncate", "regrow", "restart"] + ["none"] * 10), rng.choice(live)
        count = cache.num_tokens(seq_id)
        if event == "fork" and len(live) < 10:  # a fork shares its parent's blocks, the partly filled one too
            child = next(ids)
            cache.fork(seq_id, child)
            live.append(child)
        elif event == "grow":
            grow(seq_id, rng.randint(2, 9))
        elif event == "truncate" and count > 8:  # as a rejected speculation does
            cache.truncate(seq_id, count - rng.randint(1, 6))
        elif event == "regrow" and count > 8:  # the same length again, on other blocks
            cache.truncate(seq_id, count - 8)
            filler()
            grow(seq_id, 8)
        elif event == "restart":  # the id ends and starts again at the same length, on other blocks
            cache.free(seq_id)
            live.remove(seq_id)
            filler()
            start(seq_id, count)
        events.append(event)
        while len(live) > 10:  # the oldest leave
            cache.free(live.pop(0))
        rows = rng.sample(live, rng.randint(1, len(live)))  # this step's rows, in any order
        tokens = [rng.choice([rng.randrange(2, 100), -1 - rng.randrange(12)]) for _ in rows]  # ids, placeholders
        cache.allocate_slots(rows, [1] * len(rows))
        tables = [cache.block_tables[i] for i in rows]
        size = padded_batch_size(len(rows), graph_batch_sizes(12))
        got, longest, step_tables = cache.builder.decode_rows(rows, cache.block_tables, tokens, size, pad_row)
        assert step_tables == tables and longest == max(t.num_tokens for t in tables) + 1
        assert got.shape[0] == size
        want = step_rows(tables, [[t] for t in tokens], T=1)
        for b, (row, table) in enumerate(zip(want, tables)):
            read = TABLE + cdiv(table.num_tokens + 1, cache.block_size)  # the columns the kernels read
            assert got.shape[1] >= read
            assert got[b, :read].tolist() == row[:read], f"step {step}, row {b} (after {events[-3:]})"
        for b in range(len(rows), size):
            assert got[b, : TABLE + 1].tolist() == pad_row, f"step {step}: padding row {b}"
        if step % 2:  # the graph runner's commit, and the eager one: the same tables
            cache.commit_decode(tables, tokens)
        else:
            cache.commit(tables, [[t] for t in tokens])
    assert {"fork", "grow", "truncate", "regrow", "restart"} <= set(events)




def test_a_decode_step_too_long_for_its_graphs_is_refused(model):
    """`decode_rows(max_len=...)`: a row over the limit raises ValueError naming what to do; at the limit it runs."""
    cache = PagedKVCache(model.config, 16, 4)
    for i, n in enumerate((3, 8, 2)):
        cache.add_sequence(i)
        cache.allocate_slots([i], [n + 1])
        cache.commit([cache.block_tables[i]], [list(range(2, 2 + n))])
    with pytest.raises(ValueError, match="larger max_seq_len"):
        cache.builder.decode_rows([0, 2, 1], cache.block_tables, [5, 6, 7], max_len=8)
    rows, longest, tables = cache.builder.decode_rows([0, 2, 1], cache.block_tables, [5, 6, 7], max_len=9)
    assert longest == 9 and tables == [cache.block_tables[i] for i in (0, 2, 1)]


def test_packed_inputs_for_the_paged_kernel_hold_what_the_gathered_ones_do(model):
    """A mixed step packed for the paged prefill kernel (`packed(..., paged=True)`, numpy): the same tokens,
    positions, write slots and last rows as the gathered packing computes token by token, and, instead of every
    key's read slot, each sequence's blocks and length, from which those read slots follow."""
    cache = PagedKVCache(model.config, 64, 4)
    held = (0, 6, 9, 3)  # tokens each sequence holds before the step
    new = [[5, 6, 7, 8, 9], [3], [-1], [4, 4]]  # a fresh prompt, two decode rows (one a placeholder), a chunk
    for i, (n, ids) in enumerate(zip(held, new)):
        cache.add_sequence(i)
        cache.allocate_slots([i], [n + len(ids)])
        cache.commit([cache.block_tables[i]], [list(range(2, 2 + n))])
    tables = [cache.block_tables[i] for i in range(4)]
    gathered = cache.builder.packed(tables, new, "cpu")
    paged = cache.builder.packed(tables, new, "cpu", paged=True)
    for name in ("tokens", "position_ids", "write_slots", "last_rows"):
        assert getattr(paged, name).tolist() == getattr(gathered, name).tolist(), name
    assert paged.q_starts == gathered.q_starts and paged.offsets.tolist() == list(gathered.q_starts)
    assert paged.read_slots.numel() == 0 and gathered.block_tables is None
    lens = [n + len(ids) for n, ids in zip(held, new)]
    assert paged.seq_lens.tolist() == lens
    read = [t * 4 + p % 4 for b, n in enumerate(lens) for p in range(n) for t in [paged.block_tables[b, p // 4]]]
    assert read == gathered.read_slots.tolist(), "the tables give every key's slot"
