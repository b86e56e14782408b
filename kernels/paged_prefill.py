"""Prefill attention that reads the paged cache in place: prompt chunks and decode rows in one launch (chapter 05).

A chunked prompt's later chunks, a prompt whose first blocks came from the prefix cache, and every decode row of a
mixed step attend to keys that are already in the paged pools. Gathering them first (`gather_kv`, then attention
over the dense copy with a mask) copies every row's whole context each layer, and the mask's shape changes with
every chunk. This kernel reads the keys where they are, through each sequence's block table, as the paged decode
kernel does (chapter 04), with FlashAttention's tiles and online softmax (chapter 02) for many queries at once.

The queries of P sequences are packed side by side without padding ("varlen"), q [N, H, D]: sequence b's are rows
q_starts[b] .. q_starts[b + 1] - 1, and they are the LAST n_q of its seq_lens[b] keys (query i sits at position
seq_lens[b] - n_q + i, and sees keys 0 .. that position). A decode row is a sequence with one query, so one launch
serves a whole mixed step: prompt chunks and decode rows alike.

    program (i, kv_h): the i-th tile of the step's query tiles, rows r = t * G + g of its sequence b,
                       query t of query head kv_h * G + g

Grouped-query attention, read once: the G query heads of one KV head share a program, their queries stacked as the
rows of one tile (a decode row's G heads fill G rows), so each key tile loaded from the pools serves all of them.
Causal work is skipped by whole tiles: key tiles every row of a query tile sees need no mask; beyond the tile's last
query nothing is read. Later query tiles see more keys, so they are launched first. An 8-bit cache (chapter 06)
gives codes and one fp32 scale per (slot, head); as in the decode kernel, the key scales multiply the scores and
the value scales the softmax weights.

Correctness: `paged_prefill_attention_reference` (each sequence's keys gathered, then `attention_reference`) is the
definition; tests/kernels/test_paged_prefill.py compares the two on the CPU through Triton's interpreter, and
benchmarks/step_shapes.py measures the kernel on a GPU against PyTorch's SDPA.
"""

# ruff: noqa: N803, N806 - Triton kernels name compile-time constants and pointers in capitals

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .decode_attention import _check_scales
from .flash_attention import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, attention_reference
from .paged_kv import gather_kv


@triton.jit
def _fold_key_tiles(
    acc, l_i, m_i, q, q_pos, K, V, K_Scale, V_Scale, table_row, kv_h,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tm, stride_sb, stride_ss, stride_sh,
    start_n, end_n, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    QUANT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold the key tiles [start_n, end_n) of one sequence's paged keys into (acc, l_i, m_i). MASKED tiles may cross
    the causal diagonal (query row r sees keys up to q_pos[r]); the others are visible to every row."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for n in range(start_n, end_n, BLOCK_N):
        cols = n + offs_n  # [BLOCK_N] key positions of this tile
        inside = cols < end_n
        # where each key lives: its block from the block table, its offset in the block
        blocks = tl.load(table_row + (cols // PAGE_SIZE) * stride_tm, mask=inside, other=0).to(tl.int64)
        slots = cols % PAGE_SIZE
        k_rows = blocks * stride_kb + slots * stride_ks + kv_h * stride_kh
        v_rows = blocks * stride_vb + slots * stride_vs + kv_h * stride_vh
        k_t = tl.load(K + k_rows[None, :] + offs_d[:, None] * stride_kd, mask=inside[None, :], other=0.0)  # [D, N]
        v = tl.load(V + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=inside[:, None], other=0.0)  # [N, D]
        if QUANT:  # 8-bit codes, exact in q's dtype, and their scales, one per (slot, head)
            s_rows = blocks * stride_sb + slots * stride_ss + kv_h * stride_sh
            k_scale = tl.load(K_Scale + s_rows, mask=inside, other=0.0)  # [BLOCK_N]
            v_scale = tl.load(V_Scale + s_rows, mask=inside, other=0.0)
            k_t, v = k_t.to(q.dtype), v.to(q.dtype)
        if UPCAST:  # bf16 under the CPU interpreter: dots in fp32
            k_t, v = k_t.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], base-2 scores
        if QUANT:
            s = s * k_scale[None, :]  # (q . codes_n) * scale_n = q . k_n
        if MASKED:
            s = tl.where(inside[None, :] & (cols[None, :] <= q_pos[:, None]), s, float("-inf"))
        # Online softmax (chapter 02). Every row sees key 0, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            p = p * v_scale[None, :]  # sum_n p_n (codes_n * scale_n) = sum_n (p_n * scale_n) codes_n
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["P", "search_steps", "stride_tb"])  # one compiled kernel for any step's batch
def _paged_prefill_kernel(
    Q, K, V, O, QStarts, SeqLens, BlockTables, K_Scale, V_Scale, TileStarts, P, search_steps,
    stride_qn, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od,
    stride_tb, stride_tm,
    stride_sb, stride_ss, stride_sh,
    GROUP, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (i, kv_h): the i-th query tile of the step's list, BLOCK_M rows (query t, head g) of one sequence, KV
    head kv_h, over the keys they see. TileStarts [P + 1]: where each sequence's tiles begin in the list (the grid
    holds at least as many programs as tiles; the rest return at once)."""
    i = tl.program_id(0)
    kv_h = tl.program_id(1).to(tl.int64)
    if i >= tl.load(TileStarts + P):
        return
    # Whose tile is i: the last sequence whose tiles begin at or before it (a binary search over TileStarts).
    lo = i * 0  # int32 tensors from the start: loop-carried values keep one type
    hi = lo + P - 1
    for _ in range(search_steps):  # ceil(log2 P) halvings
        mid = (lo + hi + 1) // 2
        after = tl.load(TileStarts + mid) <= i
        lo, hi = tl.where(after, mid, lo), tl.where(after, hi, mid - 1)
    b = lo.to(tl.int64)
    tile = tl.load(TileStarts + b + 1) - 1 - i  # the sequence's tiles last first: later tiles see more keys
    q_first = tl.load(QStarts + b)
    n_q = (tl.load(QStarts + b + 1) - q_first).to(tl.int32)
    start_r = tile * BLOCK_M
    context = tl.load(SeqLens + b) - n_q  # keys before this sequence's first query
    offs_r = start_r + tl.arange(0, BLOCK_M)
    t = offs_r // GROUP  # [BLOCK_M] each row's query ...
    heads = kv_h * GROUP + offs_r % GROUP  # ... and its query head
    real = t < n_q
    q_pos = context + t  # the position of each row's query: it sees keys 0 .. q_pos
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_first + t).to(tl.int64) * stride_qn + heads * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=real[:, None], other=0.0)  # [BLOCK_M, D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Keys [0, full_end) are seen by every row of the tile (whole tiles, no mask); [full_end, end) cross the diagonal.
    first_t = start_r // GROUP
    last_t = tl.minimum((start_r + BLOCK_M - 1) // GROUP, n_q - 1)
    end = context + last_t + 1
    full_end = (context + first_t + 1) // BLOCK_N * BLOCK_N
    table_row = BlockTables + b * stride_tb
    acc, l_i, m_i = _fold_key_tiles(acc, l_i, m_i, q, q_pos, K, V, K_Scale, V_Scale, table_row, kv_h,
                                    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
                                    stride_vd, stride_tm, stride_sb, stride_ss, stride_sh, 0, full_end, qk_scale,
                                    HEAD_DIM, BLOCK_N, PAGE_SIZE, False, QUANT, UPCAST, DOT_PRECISION)
    acc, l_i, m_i = _fold_key_tiles(acc, l_i, m_i, q, q_pos, K, V, K_Scale, V_Scale, table_row, kv_h,
                                    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
                                    stride_vd, stride_tm, stride_sb, stride_ss, stride_sh, full_end, end, qk_scale,
                                    HEAD_DIM, BLOCK_N, PAGE_SIZE, True, QUANT, UPCAST, DOT_PRECISION)
    out = acc / l_i[:, None]
    o_rows = (q_first + t).to(tl.int64) * stride_on + heads * stride_oh
    tl.store(O + o_rows[:, None] + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty), mask=real[:, None])


def _interpreted() -> bool:
    """True when the kernel was defined under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_paged_prefill_kernel, triton.runtime.JITFunction)


# GPU launch settings by head dimension: (rows a tile, keys a tile, warps, stages). Rows are (query, head) pairs of
# one KV head's group. head_dim 64 and 128: the fastest of `benchmarks/step_shapes.py --sweep` on an H200 (one causal
# 4,096-token sequence, 32 query and 8 KV heads, bf16; results/step_shapes/cuda.json): 216 and 266 TFLOP/s, against
# 181 and 257 for chapter 02's FlashAttention tiles, the first choice. Fewer rows a tile at head_dim 64 also make
# more programs for one long chunk beside decode rows (a mixed step). The others: unswept, small ones of the same kind.
GPU_BLOCKS = {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 128: (128, 128, 8, 3),
              256: (64, 32, 4, 1)}
INTERPRETER_BLOCKS = (32, 32)


def prefill_tile_starts(q_starts: torch.Tensor, group: int, block_m: int) -> torch.Tensor:
    """[P + 1] int32 on q_starts' device: where each sequence's query tiles begin in a launch's list of tiles.
    Sequence b has cdiv(n_b x group, block_m) tiles (n_b its queries; a sequence with none has none). Device
    operations only, so nothing waits and a CUDA graph records them."""
    counts = (torch.diff(q_starts) * group + block_m - 1) // block_m
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def paged_prefill_attention_reference(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, q_starts: torch.Tensor,
    seq_lens: torch.Tensor, scale: float | None = None, *, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The definition, in plain PyTorch: each sequence's keys gathered through its block table, then causal attention
    of its queries (the last of its keys) by `attention_reference`. Shapes as `paged_prefill_attention`."""
    if k_scale is not None:  # codes x scale, as minillm.quant.kv.dequantize_kv
        k_pool = (k_pool.float() * k_scale[..., None].float()).to(q.dtype)
        v_pool = (v_pool.float() * v_scale[..., None].float()).to(q.dtype)
    starts, lens = q_starts.tolist(), seq_lens.tolist()
    out = []
    for b, (a, e) in enumerate(zip(starts, starts[1:])):
        table = block_tables[b : b + 1].long()
        k, v = gather_kv(k_pool, table, lens[b]), gather_kv(v_pool, table, lens[b])  # [1, H_kv, S, D]
        out.append(attention_reference(q[a:e].transpose(0, 1)[None], k, v, causal=True, scale=scale)[0])
    return torch.cat(out, dim=1).transpose(0, 1)  # [N, H, D]


def _check_inputs(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                  q_starts: torch.Tensor, seq_lens: torch.Tensor) -> None:
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"q must be [tokens, heads, head_dim] and k_pool, v_pool [num_blocks, block_size, kv_heads, "
                         f"head_dim] of one shape; got q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool "
                         f"{tuple(v_pool.shape)}. From the model's [1, H, N, D] pass q[0].transpose(0, 1).")
    (_, H, D), (_, _, H_kv, D_kv) = q.shape, k_pool.shape
    if D != D_kv or H_kv == 0 or H % H_kv:
        raise ValueError(f"q {tuple(q.shape)} and the pools {tuple(k_pool.shape)} must agree in head_dim, and q's "
                         f"heads must be a multiple of the pools' (grouped-query attention).")
    if D not in SUPPORTED_HEAD_DIMS or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"head_dim {D} in {q.dtype}: the kernel takes head_dim in {SUPPORTED_HEAD_DIMS} and "
                         "float16, bfloat16 or float32; use paged_prefill_attention_reference instead.")
    P = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if (P < 1 or q_starts.shape != (P + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != P
            or any(t.dtype.is_floating_point for t in (q_starts, seq_lens, block_tables))):
        raise ValueError(f"for P sequences pass integer q_starts [P + 1], seq_lens [P] and block_tables [P, M]; got "
                         f"{tuple(q_starts.shape)}, {tuple(seq_lens.shape)} and {tuple(block_tables.shape)}.")
    if any(t.device != q.device for t in (k_pool, v_pool, block_tables, q_starts, seq_lens)):
        raise ValueError("q, the pools, block_tables, q_starts and seq_lens must be on one device.")
    if q.device.type != "cuda" and not _interpreted():
        raise ValueError(f"paged_prefill_attention needs CUDA tensors, got {q.device}; set TRITON_INTERPRET=1 before "
                         "importing triton to run it on the CPU (slowly), or call paged_prefill_attention_reference.")


def paged_prefill_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, q_starts: torch.Tensor,
    seq_lens: torch.Tensor, max_queries: int, scale: float | None = None, *, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, plan: dict | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries to their sequences' keys in a paged cache, read in place (chapter 05).

    q [N, H, D] (any strides): sequence b's queries are rows q_starts[b] .. q_starts[b + 1] - 1, the last of its
    seq_lens[b] keys. k_pool, v_pool [num_blocks, block_size, H_kv, D], one layer's pools; block_tables [P, M] int
    (sequence b's key p in block block_tables[b, p // block_size], offset p % block_size); q_starts [P + 1] and
    seq_lens [P] int, on the device. `max_queries`, the most queries of one sequence, sizes the grid (known on the
    host; reading it from the GPU would cost a sync); q_starts and seq_lens are not checked on the GPU either: a
    sequence needs at least one query and no more queries than keys. With k_scale, v_scale [num_blocks, block_size,
    H_kv] fp32 the pools hold int8 / float8_e4m3fn codes (chapter 06). -> [N, H, D] in q's dtype, fp32 inside.
    block_m (rows a tile), block_n (keys a tile), num_warps and num_stages override `GPU_BLOCKS` (a sweep's knobs).

    The launch is a list of query tiles, not a grid over the longest sequence: a mixed step's decode rows hold one
    tile each beside a chunk's many (`prefill_tile_starts`; the grid, cdiv(N x group, block_m) + P programs per KV
    head, fixed by the shapes). `plan`: a dict the caller keeps for one step, where the tile list is kept for the
    step's other layers (the model's `PagedPrefill` mask holds one), so that it is computed once a step.
    """
    kv_scales = _check_scales(q, k_pool, v_pool, k_scale, v_scale)
    _check_inputs(q, k_pool if kv_scales is None else k_pool[:0].to(q.dtype),
                  v_pool if kv_scales is None else v_pool[:0].to(q.dtype), block_tables, q_starts, seq_lens)
    N, H, D = q.shape
    H_kv, page = k_pool.shape[2], k_pool.shape[1]
    group, P = H // H_kv, seq_lens.shape[0]
    out = torch.empty((N, H, D), dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    if _interpreted():
        (BLOCK_M, BLOCK_N), warps, stages = INTERPRETER_BLOCKS, 4, 1
    else:
        BLOCK_M, BLOCK_N, warps, stages = GPU_BLOCKS[D]
    BLOCK_M = block_m or min(BLOCK_M, max(16, triton.next_power_of_2(max_queries * group)))
    BLOCK_N, warps, stages = block_n or BLOCK_N, num_warps or warps, num_stages or stages
    for name, size in (("block_m", BLOCK_M), ("block_n", BLOCK_N)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {size}.")
    upcast = _interpreted() and q.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong: fp32 dots
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"  # exact fp32 dots for fp32 inputs
    scale = D**-0.5 if scale is None else float(scale)
    k_scale, v_scale = kv_scales if kv_scales is not None else (q, q)  # (unused without scales)
    plan = {} if plan is None else plan
    tile_starts = plan.get((group, BLOCK_M))
    if tile_starts is None:
        tile_starts = plan[group, BLOCK_M] = prefill_tile_starts(q_starts, group, BLOCK_M)
    grid = (triton.cdiv(N * group, BLOCK_M) + P, H_kv)  # at least every sequence's tiles (each rounds up once)
    launch = {} if _interpreted() else {"num_warps": warps, "num_stages": stages}
    _paged_prefill_kernel[grid](
        q, k_pool, v_pool, out, q_starts, seq_lens, block_tables, k_scale, v_scale, tile_starts, P,
        max(1, (P - 1).bit_length()),
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *out.stride(), *block_tables.stride(),
        *(k_scale.stride() if kv_scales is not None else (0, 0, 0)),
        group, scale * math.log2(math.e),
        HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PAGE_SIZE=page, QUANT=kv_scales is not None, UPCAST=upcast,
        DOT_PRECISION=precision, **launch,
    )
    return out
