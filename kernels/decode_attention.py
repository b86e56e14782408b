"""Decode attention in Triton: one new query per sequence against its KV cache (chapter 03).

A decode step attends one query token per sequence to every key and value the cache holds. The
work is tiny (2 x T x D multiply-adds per head) and the bytes are not: the whole cache of every
layer is read once per step. So this kernel is judged by one number, the bandwidth it reaches on
the bytes it must read, K and V once each, against what the GPU can copy.

Two ideas make it reach that number.

**Grouped-query attention, read once.** With GQA, G = H / H_kv query heads share one key/value
head. A kernel that loops over query heads (or that copies K and V out to H heads first, as
`repeat_interleave` does) reads each KV head G times. Here one program takes one KV head and all
G of its query heads together: the G queries are the rows of a small [G, D] tile, so each K/V tile
that comes in from memory is used by G queries before it is dropped, and `tl.dot` turns the G dot
products into one matrix product (G is padded up to 16, the smallest `tl.dot` tile).

**Split the sequence (flash-decoding).** One program per (sequence, KV head) is only B x H_kv
programs: 8 for one Llama-3-8B sequence, on a GPU with 132 SMs. So the keys are also split into
`num_splits` chunks, each folded by its own program into a partial result with the online softmax
of chapter 02 (a running max m, sum l and output o), and a second, small kernel combines the
partials: with lse_s = m_s + log(l_s) per chunk, out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)
for M = max_s lse_s. (Dao et al., "Flash-Decoding for long-context inference", 2023.)

Ragged batches: `lengths[b]` says how many of the cache's slots sequence b fills; keys beyond it
are never read, so a batch of sequences of different lengths costs the bytes each one holds. The
number of chunks is fixed by the launch (from the longest context it allows: for a CUDA graph, the
model's whole context), but each row's own length is cut into them: a 512-token row under a graph
sized for 131,072 tokens still spreads its keys over many programs instead of filling the first
chunk alone (benchmarks/decode_key_range.py).

Paged caches (chapter 04): `paged_decode_attention` runs the same kernel on a paged cache's pools
[num_blocks, block_size, H_kv, D], finding each key's block in the sequence's block table. Only the
address of a key changes; the loads, the online softmax and the combine are the same code.

Quantised caches (chapter 06): with `k_scale` and `v_scale` the pools hold int8 or fp8 codes and one
fp32 scale per (slot, head), and the kernel dequantises as it reads, for free: a code converts exactly
to the queries' 16-bit dtype, the key scales multiply the scores after the q k^T dot (one scale per
key column), and the value scales multiply the softmax weights before the p v dot (one per value row).
The bytes read per key fall from 2 x D x 2 to 2 x (D + 4) in bf16.

Correctness: `decode_attention_reference` is the definition; tests/kernels/test_kernels.py compares the two
at many shapes on the CPU through Triton's interpreter (TRITON_INTERPRET=1), and
benchmarks/decode_attention.py measures GB/s on a GPU against SDPA and the copy bandwidth.
"""

# ruff: noqa: N803, N806 - Triton kernels name compile-time constants and pointers in capitals

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .paged_kv import gather_kv
from .pdl import gdc_launch_dependents, gdc_wait, launch_options, use_pdl

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def decode_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """One query per sequence attending to its cache, in plain PyTorch, fp32 inside (chapter 03).

    q [B, H, D], k and v [B, H_kv, S, D] (H a multiple of H_kv), lengths [B] (default: all S) ->
    [B, H, D] in q's dtype. Sequence b sees keys 0 .. lengths[b] - 1; query head h uses KV head
    h // (H / H_kv).
    """
    B, H, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    group = H // H_kv
    qg = q.float().reshape(B, H_kv, group, D)  # the G query heads of each KV head, side by side
    scores = torch.einsum("bkgd,bksd->bkgs", qg, k.float()) * scale  # [B, H_kv, G, S]
    v = v.float()
    if lengths is not None:
        beyond = torch.arange(S, device=q.device)[None, :] >= lengths.to(q.device)[:, None]  # [B, S]
        scores = scores.masked_fill(beyond[:, None, None, :], float("-inf"))
        v = v.masked_fill(beyond[:, None, :, None], 0.0)  # unfilled slots may hold anything, even NaN
    out = torch.einsum("bkgs,bksd->bkgd", scores.softmax(dim=-1), v)
    return out.reshape(B, H, D).to(q.dtype)


@triton.jit
def _row_chunk(length, num_splits, BLOCK_N: tl.constexpr):
    """Keys per chunk when a row of `length` keys is cut into `num_splits` chunks of whole tiles: the split kernel
    and the combine must agree on it (the combine reads only the chunks that start before the row's end)."""
    return tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_split_kernel(
    Q, K, V, Lengths, BlockTables, O_part, LSE_part, K_Scale, V_Scale,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_tb, stride_tm,
    stride_sb, stride_sn, stride_sh,
    GROUP, CHUNK, S, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LENGTHS: tl.constexpr,
    FINAL: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b, kv_h, s): the G query heads of KV head kv_h of sequence b, over keys of chunk s.

    Writes, per query head, the chunk's normalised output o_s [D] and its log-sum-exp (base 2);
    with FINAL (one chunk per sequence) o_s is the answer, written straight to the output (O_part).

    With PAGED (chapter 04), K and V are pools [num_blocks, PAGE_SIZE, H_kv, D] (stride_kb steps
    one block, stride_kn one slot in it) and key n of sequence b lives in block
    BlockTables[b, n // PAGE_SIZE] at offset n % PAGE_SIZE: one table lookup per key, then the same loads.
    With QUANT (chapter 06, paged only) the pools hold 8-bit codes and K_Scale, V_Scale [num_blocks,
    PAGE_SIZE, H_kv] one fp32 scale per key and value vector: scores = (q . codes) * scale per key, and
    the softmax weights are multiplied by each value's scale before the p v dot.
    PDL: launched with programmatic dependent launch (kernels/pdl.py): it waits before its first read.
    """
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    kv_h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    if HAS_LENGTHS:  # this row's own length cut into the launch's chunks, whole tiles each (CHUNK is cut from S,
        length = tl.load(Lengths + b)  # the longest context the launch allows: a CUDA graph's whole range)
        chunk = _row_chunk(length, tl.num_programs(2), BLOCK_N)
    else:
        length, chunk = S, CHUNK
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    if HAS_LENGTHS and not FINAL:
        if (split > 0) & (start >= length):  # past the row's end: the combine skips this chunk, nothing to write
            return

    offs_g = tl.arange(0, BLOCK_G)  # query heads kv_h * GROUP + g, g < GROUP (the rest is padding)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_h * GROUP + offs_g
    real = offs_g < GROUP
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=real[:, None], other=0.0)  # [BLOCK_G, D]
    if UPCAST:  # bf16 under the CPU interpreter: dots in fp32
        q = q.to(tl.float32)
    if not PAGED:  # sequence b's keys are rows b of K and V, key n at n * stride_kn
        k_ptrs = K + b * stride_kb + kv_h * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
        v_ptrs = V + b * stride_vb + kv_h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    for n in range(start, end, BLOCK_N):
        cols = n + offs_n
        inside = cols < end
        if PAGED:  # where each key lives: its block from the block table, its offset in the block
            blocks = tl.load(BlockTables + b * stride_tb + (cols // PAGE_SIZE) * stride_tm, mask=inside, other=0)
            k_rows = blocks.to(tl.int64) * stride_kb + (cols % PAGE_SIZE) * stride_kn + kv_h * stride_kh
            v_rows = blocks.to(tl.int64) * stride_vb + (cols % PAGE_SIZE) * stride_vn + kv_h * stride_vh
            k_t = tl.load(K + k_rows[None, :] + offs_d[:, None] * stride_kd, mask=inside[None, :], other=0.0)
            v = tl.load(V + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=inside[:, None], other=0.0)
            if QUANT:  # 8-bit codes, exact in q's dtype, and their scales, one per (slot, head)
                s_rows = blocks.to(tl.int64) * stride_sb + (cols % PAGE_SIZE) * stride_sn + kv_h * stride_sh
                k_scale = tl.load(K_Scale + s_rows, mask=inside, other=0.0)  # [BLOCK_N]
                v_scale = tl.load(V_Scale + s_rows, mask=inside, other=0.0)
                k_t, v = k_t.to(q.dtype), v.to(q.dtype)
        else:
            k_t = tl.load(k_ptrs + n * stride_kn, mask=inside[None, :], other=0.0)  # [D, BLOCK_N]
            v = tl.load(v_ptrs + n * stride_vn, mask=inside[:, None], other=0.0)  # [BLOCK_N, D]
        if UPCAST:
            k_t, v = k_t.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N], base-2 scores
        if QUANT:
            s = s * k_scale[None, :]  # (q . codes_n) * scale_n = q . k_n
        s = tl.where(inside[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile of the loop holds a key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            p = p * v_scale[None, :]  # sum_n p_n (codes_n * scale_n) = sum_n (p_n * scale_n) codes_n
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0  # a chunk past this sequence's end: weight 0 in the combine
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_ptrs = O_part + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O_part.dtype.element_ty), mask=real[:, None])
    if not FINAL:
        tl.store(LSE_part + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=real)


@triton.jit
def _combine_kernel(
    O_part, LSE_part, Out,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_b, stride_h, stride_d,
    Lengths, NUM_SPLITS, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LENGTHS: tl.constexpr, ONE_STEP: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b, h): out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s, over the chunks
    that hold keys of row b (with lengths, the split kernel writes nothing for the others). Up to BLOCK_S chunks a
    launch: one step (ONE_STEP); more (a graph captured for a long key range, say), BLOCK_S a step over the row's
    own chunks only. (A loop for every launch measured up to 1% slower under a short range on an H200, about
    the noise between runs: the single tile was kept where it serves, chapter 05.)"""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    used = NUM_SPLITS
    if HAS_LENGTHS:  # the split kernel's chunks of this row: those that start before its end (chunk 0 always)
        length = tl.load(Lengths + b)
        chunk = _row_chunk(length, NUM_SPLITS, BLOCK_N)
        used = tl.minimum(used, tl.maximum(1, tl.cdiv(length, tl.maximum(chunk, 1))))
    lse_ptrs = LSE_part + b * stride_lb + h * stride_lh + offs_s * stride_ls
    o_ptrs = O_part + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :] * stride_od
    if ONE_STEP:  # every chunk of the launch in one tile (NUM_SPLITS <= BLOCK_S): one load each, no loop
        real = offs_s < used
        lse = tl.load(lse_ptrs, mask=real, other=float("-inf"))  # [BLOCK_S]
        weights = tl.exp2(lse - tl.max(lse, axis=0))  # chunk 0 always holds key 0, so the max is finite
        acc = tl.load(o_ptrs, mask=real[:, None], other=0.0) * weights[:, None]  # [BLOCK_S, D]
        total = weights
    else:  # BLOCK_S chunks a step, up to the row's last: the weights kept relative to the largest lse so far, `top`
        # (every entry the same), and rescaled when it grows (the split kernel's online softmax)
        top = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
        acc = tl.zeros([BLOCK_S, HEAD_DIM], dtype=tl.float32)
        total = tl.zeros([BLOCK_S], dtype=tl.float32)
        for s in range(0, used, BLOCK_S):
            real = s + offs_s < used
            lse = tl.load(lse_ptrs + s * stride_ls, mask=real, other=float("-inf"))  # [BLOCK_S]
            o = tl.load(o_ptrs + s * stride_os, mask=real[:, None], other=0.0)  # [BLOCK_S, D]
            new_top = tl.maximum(top, tl.max(lse, axis=0))  # finite: chunk 0 holds key 0
            alpha = tl.exp2(top - new_top)  # 0 at the first step
            weights = tl.exp2(lse - new_top)
            acc = acc * alpha[:, None] + o * weights[:, None]
            total = total * alpha + weights
            top = new_top
    out = tl.sum(acc, axis=0) / tl.sum(total, axis=0)
    tl.store(Out + b * stride_b + h * stride_h + offs_d * stride_d, out.to(Out.dtype.element_ty))


def _interpreted() -> bool:
    """True when the kernels were defined under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_decode_split_kernel, triton.runtime.JITFunction)


# GPU launch settings: keys per tile, warps, pipeline stages; chosen by the sweep in
# benchmarks/decode_attention.py on an H100 (bf16, head_dim 128, GQA 8:1).
GPU_BLOCK_N, GPU_WARPS, GPU_STAGES = 64, 4, 2
# A paged batch of serving size (B x H_kv >= SERVING_PROGRAMS, about half a wave of TARGET_PROGRAMS; bf16/fp16,
# head_dim <= 128): a tile of head_dim keys and head_dim / 32 warps (one warp per 32 keys of the tile).
# Swept where a throughput run spends its attention time (benchmarks/decode_attention_serving.py, H200, rows of
# 100-2048 keys drawn uniformly, a graph's 131,072-key range, results/decode_attention_serving/cuda*.json): with
# head_dim 64 (Llama-3.2-1B) 55.7 -> 50.4 us a call at B=64, 127.6 -> 99.0 at B=144, 205.2 -> 164.3 at B=256; with
# head_dim 128 (Llama-3-8B) 103.9 -> 88.4, 217.9 -> 167.6 and 341.8 -> 277.8 (the largest tile swept at each size).
# It replaced 64 keys and 4 warps from SERVING_PROGRAMS, and 32 keys and 2 warps from TARGET_PROGRAMS, chosen at one
# point where every row held 768 keys (roofline.py's batch 144). In a sweep of the same session with 768 keys each,
# 32 keys stay ahead there (65.6 against 73.0 us at 144 rows; behind at 256). Serving batches are ragged.
SERVING_PROGRAMS = 512
INTERPRETER_BLOCK_N = 32
TARGET_PROGRAMS = 1056  # eight 4-warp programs per SM of an H100 (132 SMs): one full wave of loads in flight
# A chunk holds at least this many tiles of keys. It binds only where B x H_kv is far from filling the GPU and the
# keys are few (batch 1, short contexts): there a tile a chunk cut the kernels' time at batch 1 in the engine's graph
# step (H200, context 512, a 660-key range; an ad-hoc sweep) from 110 to 81 us a step on Llama-3.2-1B's shape and
# from 290 to 215 us on Llama-3-8B's, against 2 tiles (an earlier H100 guess: fewer, and the combine costs more).
# The A/B of 647a34c in one lease agrees: 108 -> 82 and 281 -> 215 us
# (results/roofline/archive/roofline_cuda_b1_ab_*.json).
MIN_CHUNK_TILES = 1
MAX_SPLITS = 128
COMBINE_BLOCK_S = 16  # chunks the combine kernel reads a step (a row's used chunks only, in steps of this many)


def choose_num_splits(batch: int, kv_heads: int, max_len: int, block_n: int) -> int:
    """How many chunks to cut each sequence into so that B x H_kv x splits programs fill the GPU.

    Rounded down, so that the programs fit in one wave of TARGET_PROGRAMS (on an H100, B=64 ran
    about 7% faster with 2 splits, 1,024 programs, than with 1; B=16 about 6% slower with 5 splits
    than with 4).
    """
    wanted = TARGET_PROGRAMS // (batch * kv_heads)
    most = max(1, triton.cdiv(max_len, MIN_CHUNK_TILES * block_n))
    return max(1, min(wanted, most, MAX_SPLITS))


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"q must be [batch, heads, head_dim] and k, v [batch, kv_heads, seq_len, head_dim] of one shape; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}. For q [B, H, 1, D] pass q[:, :, 0]."
        )
    (B, H, D), (B_kv, H_kv, S, D_kv) = q.shape, k.shape
    if B != B_kv or D != D_kv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch size and head_dim.")
    if H_kv == 0 or H % H_kv:
        raise ValueError(f"q's {H} heads must be a multiple of k/v's {H_kv} heads (grouped-query attention).")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported (one of {SUPPORTED_HEAD_DIMS}); use "
                         "decode_attention_reference instead.")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q, k, v must share one dtype among float16, bfloat16, float32; got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}.")
    if q.device.type != "cuda" and not _interpreted():
        raise ValueError(f"decode_attention needs CUDA tensors, got {q.device}; set TRITON_INTERPRET=1 before "
                         "importing triton to run it on the CPU (slowly), or call decode_attention_reference.")
    if S == 0:
        raise ValueError("k and v hold no keys: a decode step attends to at least its own token.")
    if lengths is not None and (lengths.shape != (B,) or lengths.dtype.is_floating_point):
        raise ValueError(f"lengths must be an integer tensor of shape [{B}], got {lengths.dtype} "
                         f"{tuple(lengths.shape)}.")


def _check_paged_inputs(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor
) -> None:
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(
            f"q must be [batch, heads, head_dim] and k_pool, v_pool [num_blocks, block_size, kv_heads, head_dim] "
            f"of one shape; got q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}."
        )
    # The pools seen as a [num_blocks, H_kv, block_size, D] cache pass the dense checks (heads, dims, dtypes).
    _check_inputs(q[:0], k_pool[:0].transpose(1, 2), v_pool[:0].transpose(1, 2), None)
    B = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.dtype.is_floating_point:
        raise ValueError(f"block_tables must be an integer tensor [{B}, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}.")
    if lengths.shape != (B,) or lengths.dtype.is_floating_point:
        raise ValueError(f"lengths must be an integer tensor of shape [{B}], got {lengths.dtype} "
                         f"{tuple(lengths.shape)}.")
    if block_tables.device != q.device or k_pool.device != q.device:
        raise ValueError(f"q ({q.device}), the pools ({k_pool.device}) and block_tables ({block_tables.device}) "
                         "must be on one device.")


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None = None,
    scale: float | None = None, *, num_splits: int | None = None, block_n: int | None = None,
) -> torch.Tensor:
    """One query per sequence against its KV cache, by the Triton split-K kernel (chapter 03).

    q [B, H, D], k and v [B, H_kv, S, D] (any strides; H a multiple of H_kv), lengths [B] int
    (keys each sequence fills, 1..S; default all S) -> [B, H, D] in q's dtype, fp32 inside.
    Each KV head is read once for its H / H_kv query heads. `num_splits` (chunks per sequence) and
    `block_n` (keys per tile) override the defaults; lengths are not checked against S on the GPU
    (that would cost a host sync): a length beyond S reads past the cache.
    """
    _check_inputs(q, k, v, lengths)
    # Sequence b's key n is at b * k.stride(0) + n * k.stride(2): strides in the kernel's (b, h, n, d) order.
    return _launch(q, k, v, k.stride(), v.stride(), lengths, None, k.shape[2], scale, num_splits, block_n)


def _launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_strides: tuple[int, ...], v_strides: tuple[int, ...],
    lengths: torch.Tensor | None, block_tables: torch.Tensor | None, S: int, scale: float | None,
    num_splits: int | None, block_n: int | None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run the split kernel (and the combine kernel) for contiguous or paged K/V; strides in (b, h, n, d) order."""
    B, H, D = q.shape
    H_kv = k.shape[2] if block_tables is not None else k.shape[1]
    out = torch.empty_like(q)
    if B == 0 or H == 0:
        return out
    if lengths is not None:
        lengths = lengths.to(device=q.device, dtype=torch.int32)
    scale = D**-0.5 if scale is None else float(scale)
    group = H // H_kv
    # a paged bf16/fp16 batch of serving size: head_dim keys a tile, head_dim / 32 warps (as measured: SERVING_*)
    serving = (B * H_kv >= SERVING_PROGRAMS and block_tables is not None and kv_scales is None and block_n is None
               and num_splits is None and D <= 128 and not _interpreted())
    BLOCK_N = block_n or (INTERPRETER_BLOCK_N if _interpreted() else max(32, D) if serving else GPU_BLOCK_N)
    if kv_scales is not None and not block_n and not _interpreted() and B * H_kv * S >= 16384:
        # 8-bit codes: twice the keys per tile moves the bytes per load of 16 bits. H100, Llama-3-8B heads
        # (results/kv_quant_decode/cuda.json, int8): 1.11-1.25x over bf16 pools from B=16 or L=4096 on, against
        # 0.99-1.20x with 64 keys; but for one sequence of 1k keys 0.84x against 0.99x: small caches keep 64.
        BLOCK_N *= 2
    if BLOCK_N < 16 or BLOCK_N & (BLOCK_N - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {BLOCK_N}.")
    splits = num_splits or choose_num_splits(B, H_kv, S, BLOCK_N)
    chunk = triton.cdiv(triton.cdiv(S, splits), BLOCK_N) * BLOCK_N  # whole tiles per chunk
    splits = triton.cdiv(S, chunk)
    upcast = _interpreted() and q.dtype == torch.bfloat16  # (8-bit codes are converted to q's dtype in the kernel)
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    warps = max(1, D // 32) if serving else GPU_WARPS
    pdl = use_pdl(q)
    launch = {} if _interpreted() else {"num_warps": warps, "num_stages": GPU_STAGES, **launch_options(pdl)}

    final = splits == 1  # one chunk per sequence: no partial results, no combine kernel
    if final:
        o_part, lse_part = out[:, :, None], out[:, :, :1]  # [B, H, 1, D]; lse_part is never written
    else:
        o_part = torch.empty((B, H, splits, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, H, splits), dtype=torch.float32, device=q.device)
    paged = block_tables is not None
    k_scale, v_scale = kv_scales if kv_scales is not None else (q, q)  # (unused without scales)
    _decode_split_kernel[(B, H_kv, splits)](
        q, k, v, lengths if lengths is not None else q, block_tables if paged else q, o_part, lse_part,
        k_scale, v_scale,
        *q.stride(), *k_strides, *v_strides, *o_part.stride(), *lse_part.stride(),
        *(block_tables.stride() if paged else (0, 0)),
        *(k_scale.stride() if kv_scales is not None else (0, 0, 0)),  # (block, slot, head)
        group, chunk, S, scale * math.log2(math.e),
        HEAD_DIM=D, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N,
        HAS_LENGTHS=lengths is not None, FINAL=final, UPCAST=upcast, DOT_PRECISION=precision,
        PAGED=paged, PAGE_SIZE=k.shape[1] if paged else 1, QUANT=kv_scales is not None, PDL=pdl, **launch,
    )
    if final:
        return out
    _combine_kernel[(B, H)](
        o_part, lse_part, out,
        *o_part.stride(), *lse_part.stride(), *out.stride(),
        lengths if lengths is not None else q, splits, HEAD_DIM=D,
        BLOCK_S=max(2, min(COMBINE_BLOCK_S, triton.next_power_of_2(splits))), BLOCK_N=BLOCK_N,
        HAS_LENGTHS=lengths is not None, ONE_STEP=splits <= COMBINE_BLOCK_S, PDL=pdl, **launch_options(pdl),
    )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor,
    scale: float | None = None, *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention in plain PyTorch: gather each sequence's keys through its block table, then
    `decode_attention_reference` (chapter 04).

    q [B, H, D], k_pool and v_pool [num_blocks, block_size, H_kv, D], block_tables [B, M] int,
    lengths [B] int (1 .. M * block_size) -> [B, H, D]. With k_scale, v_scale [num_blocks, block_size, H_kv]
    the pools are 8-bit codes (chapter 06), dequantised first (codes x scale, in q's dtype).
    """
    if k_scale is not None:  # codes x scale, as minillm.quant.kv.dequantize_kv
        k_pool = (k_pool.float() * k_scale[..., None].float()).to(q.dtype)
        v_pool = (v_pool.float() * v_scale[..., None].float()).to(q.dtype)
    S = int(lengths.max())
    k, v = gather_kv(k_pool, block_tables.long(), S), gather_kv(v_pool, block_tables.long(), S)
    return decode_attention_reference(q, k, v, lengths, scale)


def paged_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor,
    max_len: int | None = None, scale: float | None = None, *, num_splits: int | None = None,
    block_n: int | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention that reads K and V through block tables: the kernel above, PAGED (chapter 04).

    q [B, H, D]; k_pool and v_pool [num_blocks, block_size, H_kv, D], the paged cache's pools for one
    layer (`minillm.engine.kv_cache.PagedKVCache.k[layer]`); block_tables [B, M] int (sequence b's key n is in
    block block_tables[b, n // block_size] at offset n % block_size); lengths [B] int, the keys each
    sequence holds (>= 1) -> [B, H, D] in q's dtype, fp32 inside. `max_len`, the largest length, sizes
    the split (pass it when you know it: reading it from a GPU tensor costs a host sync); default
    M * block_size. The block size may be any positive number; 16 is vLLM's default and ours.
    With k_scale and v_scale [num_blocks, block_size, H_kv] fp32 (a `PagedKVCache` with kv_cache_dtype
    "int8" or "fp8", chapter 06), the pools hold int8 / float8_e4m3fn codes, dequantised as they are read.
    """
    kv_scales = _check_scales(q, k_pool, v_pool, k_scale, v_scale)
    if kv_scales is None:
        _check_paged_inputs(q, k_pool, v_pool, block_tables, lengths)
    else:  # the same checks on empty pools of q's dtype (the codes' dtype is checked above)
        _check_paged_inputs(q, k_pool[:0].to(q.dtype), v_pool[:0].to(q.dtype), block_tables, lengths)
    S = max_len if max_len is not None else block_tables.shape[1] * k_pool.shape[1]
    # Key n of sequence b is at block_tables[b, n // P] * stride(0) + (n % P) * stride(1): the pool's
    # strides in the kernel's (block, head, slot-in-block, d) order.
    ks, vs = k_pool.stride(), v_pool.stride()
    return _launch(q, k_pool, v_pool, (ks[0], ks[2], ks[1], ks[3]), (vs[0], vs[2], vs[1], vs[3]),
                   lengths, block_tables, S, scale, num_splits, block_n, kv_scales)


CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)  # what a quantised cache's pools hold (minillm.quant.kv)


def _check_scales(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(k_scale, v_scale) for 8-bit pools, None for pools in q's dtype; a clear error for any mix-up."""
    if k_scale is None and v_scale is None:
        if k_pool.dtype in CODE_DTYPES:
            raise ValueError(f"the pools hold {k_pool.dtype} codes: pass their scales (k_scale, v_scale), e.g. "
                             "PagedKVCache.k_scale[layer] and v_scale[layer].")
        return None
    if k_scale is None or v_scale is None:
        raise ValueError("pass both k_scale and v_scale, or neither.")
    if k_pool.dtype not in CODE_DTYPES or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"with scales the pools must hold int8 or float8_e4m3fn codes, got {k_pool.dtype} and "
                         f"{v_pool.dtype}.")
    if k_scale.shape != k_pool.shape[:-1] or v_scale.shape != k_scale.shape or k_scale.dtype != torch.float32 \
            or v_scale.dtype != torch.float32 or k_scale.stride() != v_scale.stride():
        raise ValueError(f"k_scale and v_scale must be fp32 of the pools' shape without head_dim, "
                         f"{tuple(k_pool.shape[:-1])}, laid out alike; got {k_scale.dtype} {tuple(k_scale.shape)} "
                         f"and {v_scale.dtype} {tuple(v_scale.shape)}.")
    return k_scale, v_scale
