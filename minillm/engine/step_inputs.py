"""A step's inputs, computed in one place for every path: eager, CUDA graphs, compiled (chapters 04, 05).

Every forward of the paged engine reads the same few numbers per new token: the token id, its position, the
slot its keys and values are written to, how many keys its row attends to, and its sequence's block table.
`StepInputBuilder` computes them on the host as rows of one int64 array, which crosses to the device in one
copy (`StepInputs` then views it as tokens, positions, slots, lengths and tables):

    row b, T new tokens    [0, T) tokens | [T, 2T) positions | [2T, 3T) slots | 3T seq_len | 3T + 1 ... block table

A decode row (T = 1) is therefore   TOKEN, POSITION, SLOT, SEQ_LEN, then the table from column TABLE = 4.

Decode steps, the hot path, keep their rows from one step to the next (the idea of vLLM's "persistent batch"):
a sequence that was in the last decode step with the same list of blocks keeps its row, and only four numbers
(token, position, slot, length) and the block its new token goes to change. Each `PagedKVCache` owns one builder
(`cache.builder`); the eager forward (`PagedKVCache.prepare`), the CUDA graphs' replay and the compiled CPU step
(`minillm.engine.cuda_graphs`, `minillm.engine.compiled_step`) all take a decode step's rows from it, and
prompt chunks' rows from `step_rows`, its other half.

    builder = StepInputBuilder(block_size=16)
    rows = builder.decode_rows(["a", "b"], {"a": table_a, "b": table_b}, [17, 4]).rows  # [2, TABLE + blocks] int64
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from minillm.engine.block_manager import PAD_SLOT, BlockTable
from minillm.utils import cdiv, to_device

# The columns of a decode row (one new token): the token, its position, the slot its K/V go to, the keys it
# attends to (its sequence's length with this token), then the sequence's block table.
TOKEN, POSITION, SLOT, SEQ_LEN, TABLE = range(5)


def step_rows(tables: Sequence[BlockTable], token_ids: Sequence[Sequence[int]], T: int) -> list[list[int]]:
    """The rows of one forward's inputs, on the host, for new tokens of any length (chapter 04).

    Row b is for the sequence whose block table is tables[b], with token_ids[b] new tokens after the
    table's num_tokens cached ones, LEFT-padded to T columns (so column T - 1 is every row's last new
    token, the one whose logits choose the next token). Its columns:

        [0, T)           the new token ids, 0 in padding
        [T, 2T)          their positions (context_len, context_len + 1, ...), 0 in padding
        [2T, 3T)         their slots: where their keys and values are written, PAD_SLOT (-1) in padding
        3T               the keys the row attends to: context_len + its number of new tokens
        3T + 1 ...       its block table (rows differ in length: `rows_to_array` pads them with block 0)

    The blocks for the new tokens must be allocated already (`PagedKVCache.allocate_slots`). At T = 1 these are
    the columns `StepInputBuilder.decode_rows` writes (and keeps from step to step).
    """
    rows = []
    for table, new in zip(tables, token_ids):
        c, pad = table.num_tokens, T - len(new)
        positions = range(c, c + len(new))
        rows.append([0] * pad + [int(t) for t in new] + [0] * pad + list(positions)
                    + [PAD_SLOT] * pad + [table.slot(p) for p in positions] + [c + len(new)] + table.block_ids)
    return rows


def rows_to_array(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """Ragged rows of ints, each padded with 0 to the longest, as one int64 array [len(rows), width].

    Through numpy: `torch.tensor` on nested lists converts them element by element, about 6x slower (for a
    step of 256 rows with their block tables, about 1.9 ms against 0.3 on this book's CPU).
    """
    width = max(len(r) for r in rows)
    return np.array([list(r) + [0] * (width - len(r)) for r in rows], dtype=np.int64)


class StepInputs:
    """One forward's inputs on the device: views of one int64 tensor [B, 3T + 1 + M] (columns: `step_rows`).

        tokens        [B, T] the new token ids          position_ids  [B, T] their positions
        slot_mapping  [B, T] their slots                seq_lens      [B] int32, the keys each row attends to
        block_tables  [B, M] each row's blocks

    One tensor, so one host-to-device copy per step, however many inputs the step has. The CUDA graphs keep one
    such tensor at a fixed address and copy each step's rows into it.
    """

    def __init__(self, data: torch.Tensor, T: int) -> None:
        self.data, self.T = data, T
        self.tokens = data[:, :T]
        self.position_ids = data[:, T : 2 * T]
        self.slot_mapping = data[:, 2 * T : 3 * T]
        self.block_tables = data[:, 3 * T + 1 :]

    @property
    def seq_lens(self) -> torch.Tensor:
        """[B] int32, the keys each row attends to: only the paged kernel reads it, so it is cast when asked for
        (inside a CUDA graph's recording, the cast is recorded with the step)."""
        return self.data[:, 3 * self.T].to(torch.int32)


class PackedInputs(NamedTuple):
    """A packed step's inputs on the device (chapter 05): the new tokens of P sequences side by side in one row.
    All are views of one int64 tensor, copied once. N = the new tokens, S = the keys read (every sequence's)."""

    tokens: torch.Tensor  # [1, N] the new token ids, sequence after sequence
    position_ids: torch.Tensor  # [1, N] their positions
    write_slots: torch.Tensor  # [N] where their keys and values are written
    read_slots: torch.Tensor  # [S] the slots of every sequence's positions 0 .. its length - 1, one after another
    last_rows: torch.Tensor  # [P] where each sequence's last new token sits in the row
    offsets: torch.Tensor  # [2 (P + 1)] q_starts then k_starts, for the FlashAttention kernel
    q_starts: tuple[int, ...]  # P + 1 offsets into the N new tokens (on the host)
    k_starts: tuple[int, ...]  # P + 1 offsets into the S keys
    # read in place (`packed(..., paged=True)`): no read slots (S = 0), and instead what the paged kernel reads
    block_tables: torch.Tensor | None = None  # [P, M] each sequence's blocks (those its keys fill)
    seq_lens: torch.Tensor | None = None  # [P] the keys each sequence attends to, its new tokens' included


class PackedArrays(NamedTuple):
    """A packed step's inputs for the paged prefill kernel, on the host (`StepInputBuilder.packed_arrays`), int64."""

    tokens: np.ndarray  # [N] the new token ids, sequence after sequence
    positions: np.ndarray  # [N] their positions
    write_slots: np.ndarray  # [N] where their keys and values are written
    last_rows: np.ndarray  # [P] where each sequence's last new token sits in the row
    q_starts: np.ndarray  # [P + 1] offsets of each sequence's new tokens
    seq_lens: np.ndarray  # [P] the keys each sequence attends to, its new tokens' included
    block_tables: np.ndarray  # [P, M] each sequence's blocks (those its keys fill), padded with block 0


class DecodeRows(NamedTuple):
    """What `StepInputBuilder.decode_rows` returns."""

    rows: np.ndarray  # [max(n, pad_to), TABLE + blocks] int64: a view of the builder's staging buffer
    longest: int  # the longest row's keys, its new token's included
    tables: list[BlockTable]  # the step's tables, row by row (for the commit after the forward)


class StepInputBuilder:
    """The one input builder of one paged cache: each step's rows, decode rows kept from step to step.

    `decode_rows` writes a decode step into `staging` [rows, width] int64 (grown as needed) and returns the used
    part; `build` gives any step's inputs on the device. Kept rows: `kept[seq_id]` = (its row in the last decode
    step, the block list its table had then, the tokens it held after that step). A kept row is reused only if
    the table still has that same list object and has grown by that step's token alone. A table's list changes
    in place only by appending and by copy-on-write of the block being written; `PagedKVCache.truncate` and
    `add_sequence` make a new list, so a kept row is never stale. New code that edits a table's blocks in place
    must keep to that, or make a new list.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.staging = np.zeros((8, TABLE + 8), dtype=np.int64)
        self.kept: dict[Hashable, tuple[int, list[int], int]] = {}

    def _make_room(self, rows: int, width: int) -> None:
        """Grow `staging` to hold `rows` rows of `width` columns (doubling), keeping what it holds."""
        have_rows, have_width = self.staging.shape
        if rows <= have_rows and width <= have_width:
            return
        grown = np.zeros((max(rows, 2 * have_rows if rows > have_rows else have_rows),
                          max(width, 2 * have_width if width > have_width else have_width)), dtype=np.int64)
        grown[:have_rows, :have_width] = self.staging
        self.staging = grown

    def decode_rows(self, seq_ids: Sequence[Hashable], tables: Mapping[Hashable, BlockTable],
                    token_ids: Sequence[int], pad_to: int = 0, pad_row: Sequence[int] = (),
                    max_len: int | None = None) -> DecodeRows:
        """A decode step's rows: token_ids[b] after what tables[seq_ids[b]] holds (tables: the cache's block
        tables, by sequence id). Returns `DecodeRows`: staging[:max(n, pad_to), :width] (a view: copy it before the
        next step), width = TABLE + the blocks the longest row reads; rows n .. pad_to - 1 start with `pad_row`
        (token, position, slot, length, block).

        It also returns the step's tables, looked up in the same pass, for the commit after the forward
        (`PagedKVCache.commit_decode`: after the graph's launch, where the host's work overlaps the GPU's). max_len:
        a row may hold at most this many tokens with its new one; a longer one raises ValueError.

        Kept rows move to this step's order in one numpy gather; only a sequence new to the batch (or whose
        table changed) has its whole table written. At 256 rows of 37 blocks (contexts of about 590 tokens), that
        writes about 1,300 numbers a step instead of about 10,800 (`benchmarks/engine_host_step.py` times it).
        Columns past a row's last block keep stale values, which no kernel reads (a row reads only the blocks
        its length covers).
        """
        n, bs = len(seq_ids), self.block_size
        counts = np.empty(n, dtype=np.int64)  # what each sequence holds before this step's token
        blocks = np.empty(n, dtype=np.int64)  # the block the new token goes to
        source, fresh, kept, step_tables = [], [], {}, []
        for b, seq_id in enumerate(seq_ids):  # the one pass over the rows
            table = tables[seq_id]
            step_tables.append(table)
            count, ids = table.num_tokens, table.block_ids
            if max_len is not None and count >= max_len:
                raise ValueError(f"sequence {seq_id!r} would hold {count + 1} tokens, more than the {max_len} this "
                                 "step allows: create DecodeGraphs with a larger max_seq_len.")
            counts[b], blocks[b] = count, ids[count // bs]
            was = self.kept.get(seq_id)
            if was is not None and was[1] is ids and was[2] == count:
                source.append(was[0])
            else:
                source.append(0)  # overwritten below
                fresh.append((b, table))
            kept[seq_id] = (b, ids, count + 1)
        longest = int(counts.max()) + 1  # the longest row's keys, its new token's included
        width = TABLE + cdiv(longest, bs)  # the blocks the longest row reads
        size = max(n, pad_to)
        self._make_room(size, width)
        staging = self.staging
        if source != list(range(n)):
            staging[:n, :width] = staging[source, :width]  # the kept rows in this step's order (a copy, then a write)
        for b, table in fresh:
            ids = table.block_ids[: cdiv(int(counts[b]) + 1, bs)]
            staging[b, TABLE : TABLE + len(ids)] = ids
        staging[np.arange(n), TABLE + counts // bs] = blocks  # the new token's block: new, or copied on write
        staging[:n, TOKEN] = token_ids
        staging[:n, POSITION] = counts
        staging[:n, SLOT] = blocks * bs + counts % bs
        staging[:n, SEQ_LEN] = counts + 1
        if size > n:
            staging[n:size, : len(pad_row)] = pad_row
        self.kept = kept
        return DecodeRows(staging[:size, :width], longest, step_tables)

    def build(self, seq_ids: Sequence[Hashable], tables: Sequence[BlockTable], token_ids: Sequence[Sequence[int]],
              device: torch.device | str) -> StepInputs:
        """The inputs of a forward of token_ids[b] after what tables[b] holds, on `device` (the host does not wait):
        a decode step's rows from `decode_rows`, any other step's from `step_rows`."""
        T = max(len(new) for new in token_ids)
        if T == 1:
            by_id = dict(zip(seq_ids, tables))
            rows = self.decode_rows(seq_ids, by_id, [new[0] for new in token_ids]).rows.copy()
        else:
            rows = rows_to_array(step_rows(tables, token_ids, T))
        return StepInputs(to_device(torch.from_numpy(rows), None, device), T)

    def packed(self, tables: Sequence[BlockTable], token_ids: Sequence[Sequence[int]],
               device: torch.device | str, paged: bool = False) -> PackedInputs:
        """The inputs of a packed forward (`minillm.engine.kv_cache.PackedCacheView`) of token_ids[i] after what
        tables[i] holds, on `device`: one row [1, N] of every sequence's new tokens, no padding.

        paged: attention reads the pools through the block tables (`minillm.kernels.paged_prefill_attention`), so
        the inputs carry the tables [P, M] and lengths [P] instead of the slot of every key each sequence reads
        (S numbers, a mixed step's whole context: 16,000 at 32 rows of 512). Computed in numpy, a few operations per
        step, not per token."""
        if paged:
            return self._packed_paged(tables, token_ids, device)
        num_new = [len(new) for new in token_ids]
        context = [t.num_tokens for t in tables]
        positions = [p for c, n in zip(context, num_new) for p in range(c, c + n)]
        write = [t.slot(p) for t, c, n in zip(tables, context, num_new) for p in range(c, c + n)]
        read = [t.slot(p) for t, c, n in zip(tables, context, num_new) for p in range(c + n)]
        q_starts = tuple(itertools.accumulate(num_new, initial=0))
        k_starts = tuple(itertools.accumulate((c + n for c, n in zip(context, num_new)), initial=0))
        data = to_device([t for new in token_ids for t in new] + positions + write + read
                         + [q - 1 for q in q_starts[1:]] + list(q_starts + k_starts), torch.int64, device)
        N, S, P = len(positions), len(read), len(token_ids)
        return PackedInputs(data[:N][None], data[N: 2 * N][None], data[2 * N: 3 * N], data[3 * N: 3 * N + S],
                            data[3 * N + S: 3 * N + S + P], data[3 * N + S + P:], q_starts, k_starts)

    def _packed_paged(self, tables: Sequence[BlockTable], token_ids: Sequence[Sequence[int]],
                      device: torch.device | str) -> PackedInputs:
        """`packed(..., paged=True)`. One int64 tensor crosses to the device:

            N tokens | N positions | N write slots | P last rows | P + 1 q_starts | P seq_lens | P x M block tables
        """
        a = self.packed_arrays(tables, token_ids)
        N, P = len(a.tokens), len(tables)
        data = to_device(torch.from_numpy(np.concatenate(
            [a.tokens, a.positions, a.write_slots, a.last_rows, a.q_starts, a.seq_lens, a.block_tables.reshape(-1)])),
            None, device)
        last, starts, lens, table = 3 * N, 3 * N + P, 3 * N + 2 * P + 1, 3 * N + 3 * P + 1  # where each part begins
        return PackedInputs(data[:N][None], data[N: 2 * N][None], data[2 * N: last], data[:0], data[last: starts],
                            data[starts: lens], tuple(a.q_starts.tolist()), (), data[table:].view(P, -1),
                            data[lens: table])

    def packed_arrays(self, tables: Sequence[BlockTable], token_ids: Sequence[Sequence[int]]) -> PackedArrays:
        """A packed step's inputs for the paged prefill kernel, on the host, in numpy (a few operations per step, not
        per token): token_ids[i] after what tables[i] holds. The captured mixed steps copy them into their fixed
        buffers (`minillm.engine.mixed_graphs`); `packed(..., paged=True)` sends them as they are."""
        bs, P = self.block_size, len(tables)
        num_new = np.fromiter(map(len, token_ids), dtype=np.int64, count=P)
        context = np.fromiter((t.num_tokens for t in tables), dtype=np.int64, count=P)
        seq_lens = context + num_new
        q_starts = np.zeros(P + 1, dtype=np.int64)
        np.cumsum(num_new, out=q_starts[1:])
        N = int(q_starts[-1])
        block_rows = rows_to_array([t.block_ids[: cdiv(int(n), bs)] for t, n in zip(tables, seq_lens)])  # [P, M]
        owner = np.repeat(np.arange(P), num_new)  # each new token's sequence
        positions = np.arange(N) - np.repeat(q_starts[:-1] - context, num_new)  # c, c + 1, ... in each sequence
        write = block_rows[owner, positions // bs] * bs + positions % bs
        tokens = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=N)
        return PackedArrays(tokens, positions, write, q_starts[1:] - 1, q_starts, seq_lens, block_rows)


class RowsToDevice:
    """Copies rows [size, width] (numpy, any strides) into a slice of a fixed device buffer without the host waiting.

    The rows cross as one contiguous block: packed on the host into pinned memory, one DMA queued while the host
    goes on, then spread into the buffer by a copy on the device. The rows themselves are a slice of a wider array,
    not contiguous, and PyTorch would first copy them into ordinary (pageable) memory, a copy that may make the host
    wait for the GPU's queue; whole rows would be contiguous, but a row is as wide as the longest context a buffer
    allows (8,197 numbers at 131,072 tokens). `numel`: the most numbers one call copies.
    """

    def __init__(self, numel: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.host = torch.empty(numel, dtype=torch.int64, pin_memory=pinned)
        self.device = torch.empty(numel, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event() if pinned else None  # the last copy out of `host`

    def __call__(self, rows: np.ndarray, out: torch.Tensor) -> None:
        """out[...] = rows, for `out` [size, width] on the device."""
        n = rows.size
        if self.copied is not None:
            self.copied.synchronize()  # the previous call's copy has left the pinned buffer
        host = self.host[:n].view(rows.shape)
        host.numpy()[:] = rows
        packed = self.device[:n].view(rows.shape)
        packed.copy_(host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        out.copy_(packed)
