"""FlashAttention forward in Triton, and the plain PyTorch attention it must equal (chapter 02).

Attention for one head is softmax(q k^T * scale) v. Done the obvious way, in three kernels,
it writes the [T_q, T_k] score matrix S = q k^T to GPU memory (HBM), reads it back for the
softmax, writes the probabilities P, and reads them again for P v: O(T^2) bytes of traffic for
a sequence of T tokens, although the inputs and the output are only O(T d). At T = 8k that
matrix is 64M entries per head, and the GPU spends its time moving it, not multiplying.

FlashAttention (Dao et al., 2022; FlashAttention-2, Dao 2023) never materialises S or P. Each
program takes a tile of BLOCK_M queries, keeps it in on-chip SRAM (registers and shared memory),
and streams over the keys and values BLOCK_N at a time. For each key tile it computes the
BLOCK_M x BLOCK_N scores, turns them into probabilities, and adds their weighted values into an
fp32 accumulator, all on-chip. The catch is that softmax needs the maximum and the sum over *all*
keys before any probability is known; the *online softmax*
(Milakov & Gimelshein, 2018) removes that need by keeping, per query row,

    m   the largest score seen so far,
    l   the sum of exp(score - m) over the keys seen so far,
    acc the sum of exp(score - m) * v over the keys seen so far,

and rescaling l and acc by exp(m_old - m_new) whenever a new tile raises the maximum. After the
last tile, acc / l is exactly softmax(S) v. The FLOPs are the same (the two matmuls, 4 T_q T_k d
per head); what changes is memory. Nothing of size T^2 is ever stored, and HBM traffic drops from
O(T^2) (scores and probabilities written and read back) to O(T d): q is read once, o written once,
and K and V are streamed once per query tile, re-reads that the GPU's L2 cache mostly serves
because consecutive programs work on the same head. The kernel becomes bound by the tensor cores
instead of by memory bandwidth.

This kernel supports grouped-query attention without copying K/V: program (b, h) reads key/value
head h // (H / H_kv). With `causal=True` and T_q < T_k the queries are the *last* T_q
positions (query i sits at position T_k - T_q + i and sees keys 0..T_k - T_q + i): the layout
of a prefill chunk appended to a KV cache.

Chapter 05 packs the prompt chunks of one engine step side by side in one row, with no padding between them:
`flash_attention_varlen` runs this same kernel over such a row, each program finding its sequence's queries
and keys through per-sequence offsets ("varlen" attention, as vLLM and FlashAttention's own API call it),
so that one launch serves every sequence of the step.

Correctness: `attention_reference` below is the definition; tests/kernels/test_kernels.py compares
the two on random inputs (on the CPU through Triton's interpreter, `TRITON_INTERPRET=1`), and
benchmarks/attention.py measures TFLOP/s on a GPU against PyTorch's SDPA and naive attention.
"""

# ruff: noqa: N803 - Triton kernels name compile-time constants and pointers in capitals (BLOCK_M, Q)

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale) v in plain PyTorch, fp32 inside, the definition the kernel must meet (chapter 02).

    q [B, H, T_q, D], k and v [B, H_kv, T_k, D] with H a multiple of H_kv -> [B, H, T_q, D] in q's dtype.
    With `causal`, query i sits at position T_k - T_q + i and sees keys 0..T_k - T_q + i.
    Materialises the whole [T_q, T_k] score matrix: O(T^2) memory, which is the point of the contrast.
    """
    B, H, T_q, D = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    group = H // H_kv
    k = k.float().repeat_interleave(group, dim=1)  # query head h uses key/value head h // group
    v = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ k.transpose(-1, -2)) * scale  # [B, H, T_q, T_k]
    if causal:
        q_pos = torch.arange(T_k - T_q, T_k, device=q.device)[:, None]
        k_pos = torch.arange(T_k, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return (scores.softmax(dim=-1) @ v).to(q.dtype)


@triton.jit
def _attend_to_key_tiles(
    acc, l_i, m_i, q,  # running state of this query tile, and the tile itself
    k_ptrs, v_ptrs, stride_kn, stride_vn,  # pointers to the first key/value tile of this head
    q_pos, offs_n, start_n, end_n, T_k, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold key/value tiles [start_n, end_n) into (acc, l_i, m_i). MASKED tiles may cross the causal
    diagonal or the ragged end of the keys; the others are known to be fully visible (no masking work)."""
    for n in range(start_n, end_n, BLOCK_N):
        cols = n + offs_n  # [BLOCK_N] key indices of this tile
        if MASKED:
            k_t = tl.load(k_ptrs + n * stride_kn, mask=cols[None, :] < T_k, other=0.0)  # [D, BLOCK_N]
            v = tl.load(v_ptrs + n * stride_vn, mask=cols[:, None] < T_k, other=0.0)  # [BLOCK_N, D]
        else:
            k_t = tl.load(k_ptrs + n * stride_kn)
            v = tl.load(v_ptrs + n * stride_vn)
        if UPCAST:  # bf16 under the CPU interpreter: do the dots in fp32 (see _dot_settings)
            k_t, v = k_t.to(tl.float32), v.to(tl.float32)

        # Scores in base 2: qk_scale = scale * log2(e), so exp2(s) == exp(scale * q.k).
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
        if MASKED:
            visible = cols[None, :] < T_k
            if CAUSAL:
                visible = visible & (cols[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))

        # Online softmax. The new running maximum m_new >= m_i; the sums so far were taken relative
        # to m_i, so they are rescaled by alpha = 2^(m_i - m_new) <= 1 before this tile is added.
        # (The first tile always holds key 0, which every query sees, so m_new is finite from the
        # first tile on, and alpha = 2^(-inf) = 0 there wipes the empty initial state harmlessly.)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_M]
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N], unnormalised probabilities in [0, 1]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # acc += p @ v, [BLOCK_M, D]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_attention_kernel(
    Q, K, V, O, Q_STARTS, K_STARTS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, T_q, T_k, GROUP, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
):
    """One program = one tile of BLOCK_M queries of one (batch, head); it streams over all the keys it may see.

    VARLEN: the "batch" is P sequences packed side by side in one row (`flash_attention_varlen`): sequence b's
    queries are rows Q_STARTS[b] .. Q_STARTS[b + 1] - 1 and its keys K_STARTS[b] .. K_STARTS[b + 1] - 1, and
    T_q is the longest sequence's query count (the grid's size); the others' surplus tiles return at once.
    """
    # A 1-D grid of cdiv(T_q, BLOCK_M) * B * H programs. Consecutive programs share one (batch, head),
    # so its K/V tiles are reused from L2. Causally, later query tiles see more keys: launch them first
    # so the short ones fill in at the end instead of leaving a long one alone on the GPU.
    num_m = tl.cdiv(T_q, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = num_m - 1 - pid % num_m if CAUSAL else pid % num_m
    bh = pid // num_m
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    kv_h = h // GROUP  # grouped-query attention: GROUP query heads share one key/value head, read in place

    start_m = pid_m * BLOCK_M
    if VARLEN:  # this sequence's rows of the packed row: move the base pointers there, and take its own lengths
        q_first, k_first = tl.load(Q_STARTS + b), tl.load(K_STARTS + b)
        T_q = (tl.load(Q_STARTS + b + 1) - q_first).to(tl.int32)
        T_k = (tl.load(K_STARTS + b + 1) - k_first).to(tl.int32)
        if start_m >= T_q:  # a shorter sequence than the longest: nothing for this tile
            return
        Q += q_first * stride_qm
        O += q_first * stride_om
        K += k_first * stride_kn
        V += k_first * stride_vn
        b = b * 0  # every sequence lives in the row's one batch entry
    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows of this tile
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N] key offsets within a tile
    offs_d = tl.arange(0, HEAD_DIM)
    offset = T_k - T_q  # causal: query i sits at position offset + i
    q_pos = offset + offs_m

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=offs_m[:, None] < T_q, other=0.0)  # [BLOCK_M, D], stays on-chip throughout
    if UPCAST:
        q = q.to(tl.float32)
    # K is read transposed, [D, BLOCK_N], so that q @ k_t is a plain matrix product.
    k_ptrs = K + b * stride_kb + kv_h * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
    v_ptrs = V + b * stride_vb + kv_h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row maximum (base-2 scores)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of 2^(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of 2^(s - m_i) * v

    # Key tiles [0, full_end) are visible to every query of this tile: no masks. Tiles [full_end, end)
    # cross the causal diagonal or the ragged end of the keys and are masked; beyond `end` no query looks.
    if CAUSAL:
        end = tl.minimum(offset + start_m + BLOCK_M, T_k)
        full_end = tl.minimum((offset + start_m + 1) // BLOCK_N * BLOCK_N, T_k // BLOCK_N * BLOCK_N)
    else:
        end = T_k
        full_end = T_k // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _attend_to_key_tiles(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, q_pos, offs_n,
                                         0, full_end, T_k, qk_scale,
                                         BLOCK_N, False, CAUSAL, UPCAST, DOT_PRECISION)
    acc, l_i, m_i = _attend_to_key_tiles(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, q_pos, offs_n,
                                         full_end, end, T_k, qk_scale,
                                         BLOCK_N, True, CAUSAL, UPCAST, DOT_PRECISION)

    out = acc / l_i[:, None]  # the softmax's normalisation, once, at the end
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_m[:, None] < T_q)


def _interpreted() -> bool:
    """True when the kernel was defined under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_flash_attention_kernel, triton.runtime.JITFunction)


# GPU launch settings by head dimension: (BLOCK_M, BLOCK_N, num_warps, num_stages). Larger head dims
# hold more of q, k, v and acc on-chip per row; the tiles below were the fastest of a small sweep on
# an H100 (bf16, B*H = 64, T = 1k-4k). A GPU with less shared memory that cannot fit one falls back
# to SMALL_BLOCKS (see flash_attention). benchmarks/attention.py measures the result.
GPU_BLOCKS = {
    16: (64, 64, 4, 3),
    32: (64, 64, 4, 3),
    64: (64, 64, 4, 3),
    128: (128, 64, 8, 3),
    256: (128, 64, 8, 2),
}
SMALL_BLOCKS = (64, 32, 4, 1)
INTERPRETER_BLOCKS = (32, 32)  # the CPU interpreter: few, moderately large programs are fastest


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a 4-D tensor [batch, heads, seq_len, head_dim], got {shape}; "
                "from [batch, seq_len, heads, head_dim] use .transpose(1, 2)."
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    (B, H, T_q, D), (B_kv, H_kv, T_k, D_kv) = q.shape, k.shape
    if B != B_kv or D != D_kv:
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in batch size and head_dim "
            "(dims 0 and 3)."
        )
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(
            f"q's {H} heads must be a multiple of k/v's {H_kv} heads (grouped-query attention shares "
            "each key/value head among H / H_kv query heads)."
        )
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim {D} is not supported by the Triton kernel (one of {SUPPORTED_HEAD_DIMS}); "
            "use attention_reference or torch.nn.functional.scaled_dot_product_attention instead."
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q, k and v must share one dtype among float16, bfloat16, float32; got {q.dtype}, {k.dtype}, "
            f"{v.dtype}. Cast them with .to(dtype)."
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}.")
    if q.device.type != "cuda" and not _interpreted():
        raise ValueError(
            f"flash_attention needs CUDA tensors, got {q.device}. Move them with .cuda(), set "
            "TRITON_INTERPRET=1 before importing triton to run the kernel on the CPU (slowly), "
            "or call attention_reference."
        )
    if T_k == 0:
        raise ValueError("k and v hold no keys (seq_len 0): attention over nothing is undefined.")
    if causal and T_q > T_k:
        raise ValueError(
            f"causal attention with more queries ({T_q}) than keys ({T_k}) leaves the first queries nothing "
            "to attend to; the queries are the last T_q of the T_k positions."
        )


def _launch_settings(q: torch.Tensor, T_q: int) -> tuple[int, int, int, int, bool, str]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, upcast, dot precision) for queries like q [..., D], T_q of them."""
    if _interpreted():
        (BLOCK_M, BLOCK_N), num_warps, num_stages = INTERPRETER_BLOCKS, 4, 1
    else:
        BLOCK_M, BLOCK_N, num_warps, num_stages = GPU_BLOCKS[q.shape[-1]]
    # Few queries (decode, short chunks): a smaller query tile wastes less work on masked rows.
    BLOCK_M = min(BLOCK_M, max(16, triton.next_power_of_2(T_q)))
    # The CPU interpreter computes bf16 tl.dot wrongly; there we upcast the dot operands to fp32.
    # fp32 inputs get exact fp32 dots ("ieee"), not TF32, so fp32 results match PyTorch closely.
    upcast = _interpreted() and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"  # "tf32" is unused for 16-bit inputs
    return BLOCK_M, BLOCK_N, num_warps, num_stages, upcast, precision


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v by the Triton FlashAttention kernel (chapter 02).

    q [B, H, T_q, D], k and v [B, H_kv, T_k, D] (H a multiple of H_kv; any strides) -> [B, H, T_q, D]
    in q's dtype, accumulated in fp32. `scale` defaults to 1/sqrt(D). With `causal`, query i sits at
    position T_k - T_q + i (the queries are the last T_q positions) and sees keys up to that position.
    D must be 16, 32, 64, 128 or 256; dtypes float16, bfloat16 or float32 (fp32 dots are exact fp32,
    not TF32). `block_m` / `block_n` override the tile sizes (powers of two, at least 16).
    """
    _check_inputs(q, k, v, causal)
    B, H, T_q, D = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    out = torch.empty((B, H, T_q, D), dtype=q.dtype, device=q.device)
    if T_q == 0 or B == 0 or H == 0:
        return out
    scale = D**-0.5 if scale is None else float(scale)

    BLOCK_M, BLOCK_N, num_warps, num_stages, upcast, precision = _launch_settings(q, T_q)
    BLOCK_M, BLOCK_N = block_m or BLOCK_M, block_n or BLOCK_N
    for name, size in (("block_m", BLOCK_M), ("block_n", BLOCK_N)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {size}.")

    def launch(BLOCK_M: int, BLOCK_N: int, num_warps: int, num_stages: int) -> None:
        grid = (triton.cdiv(T_q, BLOCK_M) * B * H,)
        _flash_attention_kernel[grid](
            q, k, v, out, q, q,  # (no offsets: the last two pointers are unused placeholders)
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            H, T_q, T_k, H // H_kv, scale * math.log2(math.e),
            HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=bool(causal), UPCAST=upcast,
            DOT_PRECISION=precision, VARLEN=False, num_warps=num_warps, num_stages=num_stages,
        )

    try:
        launch(BLOCK_M, BLOCK_N, num_warps, num_stages)
    except triton.runtime.OutOfResources:  # tiles too large for this GPU's shared memory
        if block_m or block_n:
            raise
        launch(min(BLOCK_M, SMALL_BLOCKS[0]), *SMALL_BLOCKS[1:])
    return out


def attention_varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_starts: Sequence[int],
                               k_starts: Sequence[int]) -> torch.Tensor:
    """Causal attention of sequences packed in one row, one sequence at a time in plain PyTorch (the definition).

    q [1, H, N, D] holds sequence i's queries in columns q_starts[i] .. q_starts[i + 1] - 1, and k, v
    [1, H_kv, S, D] its keys in k_starts[i] .. k_starts[i + 1] - 1; its queries are the last of its keys (a prompt
    chunk after what the cache holds). -> [1, H, N, D]: each sequence attends only to its own keys.
    """
    spans = zip(zip(q_starts, q_starts[1:]), zip(k_starts, k_starts[1:]))
    return torch.cat([attention_reference(q[:, :, a:b], k[:, :, c:e], v[:, :, c:e], causal=True)
                      for (a, b), (c, e) in spans], dim=2)


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_starts: Sequence[int],
                           k_starts: Sequence[int], offsets: torch.Tensor | None = None) -> torch.Tensor:
    """`attention_varlen_reference` in one launch of the FlashAttention kernel ("varlen", as vLLM calls it).

    Packed prompt chunks (`minillm.engine.kv_cache.PackedCacheView`) run every matrix multiply over the N tokens of
    all sequences at once; only attention must keep them apart. One program per (sequence, head, query tile) of
    the longest sequence; tiles past a shorter sequence's end return at once. q [1, H, N, D], k and v [1, H_kv, S, D];
    q_starts and k_starts the P + 1 offsets, on the host; `offsets`, the same 2(P + 1) numbers already on q's device
    (q_starts then k_starts, int64), saves copying them there. Causal within each sequence -> [1, H, N, D].
    """
    _check_inputs(q, k, v, causal=False)  # causality is per sequence here: its lengths are checked below
    P = len(q_starts) - 1
    if q.shape[0] != 1 or len(k_starts) != P + 1 or P < 1:
        raise ValueError(f"packed attention takes one row (batch 1, got {q.shape[0]}) and P + 1 offsets for q and "
                         f"for k (got {len(q_starts)} and {len(k_starts)}).")
    lengths = [(b - a, e - c) for a, b, c, e in zip(q_starts, q_starts[1:], k_starts, k_starts[1:])]
    if q_starts[0] or k_starts[0] or q_starts[-1] != q.shape[2] or k_starts[-1] != k.shape[2] or any(
            not 0 < n_q <= n_k for n_q, n_k in lengths):
        raise ValueError(f"the offsets must run from 0 to the {q.shape[2]} queries and {k.shape[2]} keys, each "
                         f"sequence with at least one query and no fewer keys than queries; got {list(q_starts)} "
                         f"and {list(k_starts)}.")
    H, D = q.shape[1], q.shape[3]
    out = torch.empty_like(q)
    if offsets is None:
        offsets = torch.tensor([*q_starts, *k_starts], dtype=torch.int64).to(q.device)
    longest = max(n_q for n_q, _ in lengths)
    BLOCK_M, BLOCK_N, num_warps, num_stages, upcast, precision = _launch_settings(q, longest)

    def launch(BLOCK_M: int, BLOCK_N: int, num_warps: int, num_stages: int) -> None:
        grid = (triton.cdiv(longest, BLOCK_M) * P * H,)
        _flash_attention_kernel[grid](
            q, k, v, out, offsets, offsets[P + 1:],
            0, *q.stride()[1:], 0, *k.stride()[1:], 0, *v.stride()[1:], 0, *out.stride()[1:],
            H, longest, k.shape[2], H // k.shape[1], D**-0.5 * math.log2(math.e),
            HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=True, UPCAST=upcast,
            DOT_PRECISION=precision, VARLEN=True, num_warps=num_warps, num_stages=num_stages,
        )

    try:
        launch(BLOCK_M, BLOCK_N, num_warps, num_stages)
    except triton.runtime.OutOfResources:  # tiles too large for this GPU's shared memory
        launch(min(BLOCK_M, SMALL_BLOCKS[0]), *SMALL_BLOCKS[1:])
    return out
