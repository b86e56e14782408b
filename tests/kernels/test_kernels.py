"""minillm.kernels: the Triton FlashAttention forward and the fused add + RMSNorm, against their references.

Without a GPU the kernels run on the CPU through Triton's interpreter: TRITON_INTERPRET=1 must be
set before the kernel modules are imported (Triton decides at decoration time), so this file sets it
first (and leaves it set: Triton consults it again at run time). The interpreter executes each
program in NumPy, slowly, so the shapes are small (T <= 80) and ragged on purpose: tile sizes are
32 there, and 16 where a test asks, so every shape crosses tile edges, the causal diagonal and the
ragged end of the keys. Two interpreter quirks with bf16: it computes `tl.dot` on bf16 wrongly (the
kernel upcasts those dots to fp32 there), and it rounds fp32 -> bf16 toward zero rather than to
nearest (so bf16 results there may differ from PyTorch's by one unit in the last place).
The CUDA tests (skipped here) run bf16 at real lengths and the model's dispatch to the kernel.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the kernels' import: Triton reads it when @triton.jit decorates them
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="Triton is not installed (pip install triton): the kernels need it")
import minillm.kernels  # noqa: E402
from minillm.kernels import (  # noqa: E402
    attention_reference,
    attention_varlen_reference,
    decode_attention,
    decode_attention_reference,
    flash_attention,
    flash_attention_varlen,
    fused_add_rms_norm,
)
from minillm.kernels.rmsnorm import fused_add_rms_norm_reference  # noqa: E402

from minillm.arithmetic import cdiv  # noqa: E402

FA = sys.modules["minillm.kernels.flash_attention"]
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and not FA._interpreted():
    pytest.skip(
        "minillm.kernels was imported before TRITON_INTERPRET=1 was set, so its kernels need a GPU; "
        "run this file on its own (pytest tests/kernels/test_kernels.py)",
        allow_module_level=True,
    )
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# tolerances for outputs of magnitude ~1: fp32 dots are exact fp32; fp16/bf16 round the output and P
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def random_qkv(B, H, H_kv, T_q, T_k, D, dtype, seed=0, device=DEVICE):  # noqa: N803 - shape names
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T_q, D, generator=g).to(device, dtype)
    k = torch.randn(B, H_kv, T_k, D, generator=g).to(device, dtype)
    v = torch.randn(B, H_kv, T_k, D, generator=g).to(device, dtype)
    return q, k, v


def sdpa(q, k, v, causal, scale=None):
    """PyTorch's SDPA with K/V repeated per query head and the bottom-right causal mask made explicit."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    T_q, T_k = q.shape[2], k.shape[2]
    mask = None
    if causal:  # SDPA's is_causal aligns top-left; our queries are the last T_q positions
        mask = torch.arange(T_k, device=q.device)[None, :] <= torch.arange(T_k - T_q, T_k, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale).to(q.dtype)


def assert_close(got, expected, dtype, what):
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= ATOL[dtype], f"{what}: max |error| {err:.2e} exceeds {ATOL[dtype]:.0e} for {dtype}"


# (B, H, H_kv, T_q, T_k, D, causal): ragged lengths, prefill chunks (T_q < T_k), decode (T_q = 1),
# GQA 8/2 and MQA 4/1, B = 2, head dims 16..64
SHAPES = [
    (1, 2, 2, 1, 1, 16, True),  # one query, one key
    (2, 4, 4, 37, 37, 64, True),  # MHA, ragged, causal
    (2, 4, 4, 37, 37, 64, False),
    (2, 8, 2, 13, 80, 32, True),  # GQA 8/2: a 13-token chunk after 67 cached positions
    (2, 8, 2, 50, 50, 32, False),
    (1, 4, 1, 1, 50, 16, True),  # MQA 4/1 decode: one query sees all 50 keys
    (2, 4, 1, 1, 33, 64, False),
    (1, 4, 1, 64, 64, 32, True),  # exact multiples of the tile
    (2, 2, 1, 5, 71, 16, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}/{}-Tq{}-Tk{}-D{}-{}".format(
    *s[:6], "causal" if s[6] else "full"))
def test_flash_attention_matches_reference_and_sdpa(shape, dtype):
    """flash_attention equals attention_reference and PyTorch's SDPA (K/V repeated per head) at ragged shapes."""
    B, H, H_kv, T_q, T_k, D, causal = shape
    q, k, v = random_qkv(B, H, H_kv, T_q, T_k, D, dtype, seed=sum(shape[:6]))
    got = flash_attention(q, k, v, causal=causal)
    assert got.shape == (B, H, T_q, D) and got.dtype == dtype, f"output {tuple(got.shape)} {got.dtype}"
    assert_close(got, attention_reference(q, k, v, causal=causal), dtype, f"vs attention_reference at {shape}")
    assert_close(got, sdpa(q, k, v, causal), dtype, f"vs scaled_dot_product_attention at {shape}")


def packed_qkv(chunks: list[tuple[int, int]], H: int, H_kv: int, D: int, dtype: torch.dtype, seed: int = 0):
    """Sequences packed in one row: chunks[i] = (new tokens, keys) of sequence i -> q, k, v, q_starts, k_starts."""
    q_starts = [0]
    k_starts = [0]
    for n_q, n_k in chunks:
        q_starts.append(q_starts[-1] + n_q)
        k_starts.append(k_starts[-1] + n_k)
    q, _, _ = random_qkv(1, H, H_kv, q_starts[-1], 1, D, dtype, seed=seed)
    _, k, v = random_qkv(1, H, H_kv, 1, k_starts[-1], D, dtype, seed=seed + 1)
    return q, k, v, q_starts, k_starts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attention_varlen_matches_each_sequence_alone(dtype):
    """Packed sequences in one launch: each equals its own causal attention (its chunk after a cached prefix, or a
    whole prompt), at ragged lengths that cross tiles (32 here), with GQA; one far longer than the others, so
    most of the shorter sequences' tiles have nothing to do."""
    chunks = [(5, 5), (1, 40), (70, 70), (17, 50), (3, 3)]
    q, k, v, q_starts, k_starts = packed_qkv(chunks, H=4, H_kv=2, D=32, dtype=dtype)
    got = flash_attention_varlen(q, k, v, q_starts, k_starts)
    expected = attention_varlen_reference(q, k, v, q_starts, k_starts)
    assert_close(got, expected, dtype, f"varlen {chunks}")
    alone = flash_attention(q[:, :, 6:76], k[:, :, 45:115], v[:, :, 45:115], causal=True)  # the third sequence
    assert_close(got[:, :, 6:76], alone, dtype, "the third sequence against flash_attention on it alone")


def test_flash_attention_varlen_takes_offsets_already_on_the_device():
    chunks = [(9, 30), (33, 33)]
    q, k, v, q_starts, k_starts = packed_qkv(chunks, H=2, H_kv=1, D=16, dtype=torch.float32, seed=3)
    offsets = torch.tensor(q_starts + k_starts, dtype=torch.int64, device=DEVICE)
    got = flash_attention_varlen(q, k, v, q_starts, k_starts, offsets=offsets)
    assert_close(got, attention_varlen_reference(q, k, v, q_starts, k_starts), torch.float32, "offsets given")


@pytest.mark.parametrize(("q_starts", "k_starts", "says"), [
    ([0, 4, 8], [0, 4], r"P \+ 1 offsets"),
    ([0, 4, 9], [0, 4, 8], "from 0 to the 8 queries"),
    ([0, 5, 8], [0, 4, 8], "no fewer keys than queries"),
    ([0, 0, 8], [0, 0, 8], "at least one query"),
])
def test_flash_attention_varlen_refuses_offsets_that_do_not_fit(q_starts, k_starts, says):
    q, k, v, _, _ = packed_qkv([(4, 4), (4, 4)], H=2, H_kv=1, D=16, dtype=torch.float32)
    with pytest.raises(ValueError, match=says):
        flash_attention_varlen(q, k, v, q_starts, k_starts)


def test_flash_attention_at_random_shapes():
    """Twelve shapes drawn at random (seeded): any T_q <= T_k <= 80, groups 1..4, D 16..64, either mask."""
    rng = torch.Generator().manual_seed(2024)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=rng))

    for i in range(12):
        T_k = draw(1, 80)
        T_q, D, H_kv, group, B = draw(1, T_k), 2 ** draw(4, 6), draw(1, 2), draw(1, 4), draw(1, 2)
        causal, dtype = bool(i % 2), (torch.float32, torch.float16)[i // 2 % 2]
        q, k, v = random_qkv(B, H_kv * group, H_kv, T_q, T_k, D, dtype, seed=i)
        shape = f"B={B} H={H_kv * group}/{H_kv} T_q={T_q} T_k={T_k} D={D} causal={causal} {dtype}"
        assert_close(flash_attention(q, k, v, causal=causal), attention_reference(q, k, v, causal=causal), dtype, shape)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_small_tiles_cross_many_tile_edges(causal):
    """16x16 tiles: many fully visible tiles, diagonal tiles and a ragged last tile in one call."""
    q, k, v = random_qkv(2, 4, 2, 45, 77, 32, torch.float32, seed=7)
    got = flash_attention(q, k, v, causal=causal, block_m=16, block_n=16)
    assert_close(got, attention_reference(q, k, v, causal=causal), torch.float32, "16x16 tiles")


def test_bf16_through_the_interpreter_upcast():
    """bf16 in, bf16 out (the interpreter's dots upcast to fp32; on a GPU they are bf16 tensor-core dots)."""
    q, k, v = random_qkv(2, 4, 2, 21, 40, 64, torch.bfloat16, seed=3)
    got = flash_attention(q, k, v, causal=True)
    assert got.dtype == torch.bfloat16
    assert_close(got, attention_reference(q, k, v, causal=True), torch.bfloat16, "bf16")


def test_strided_inputs_and_custom_scale():
    """Views straight out of a fused [B, T, heads, D] projection (non-contiguous) and a non-default scale."""
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(2, 29, 4 + 2 + 2, 32, generator=g).to(DEVICE)  # [B, T, H + 2 H_kv, D]
    q, k, v = (t.transpose(1, 2) for t in qkv.split([4, 2, 2], dim=2))  # [B, heads, T, D], strided
    assert not q.is_contiguous() and not k.is_contiguous()
    for causal in (True, False):
        got = flash_attention(q, k, v, causal=causal, scale=0.3)
        assert_close(got, attention_reference(q, k, v, causal=causal, scale=0.3), torch.float32, "strided")
        assert_close(got, sdpa(q, k, v, causal, scale=0.3), torch.float32, "strided vs SDPA")


def test_reference_is_softmax_attention():
    """attention_reference itself, on one head by hand: row t is the softmax-weighted mean of v[:t+1]."""
    q, k, v = random_qkv(1, 1, 1, 4, 4, 16, torch.float64, device="cpu")
    out = attention_reference(q, k, v, causal=True)
    for t in range(4):
        w = torch.softmax(q[0, 0, t] @ k[0, 0, : t + 1].T / 4.0, dim=0)
        torch.testing.assert_close(out[0, 0, t], w @ v[0, 0, : t + 1])


def bad_inputs(case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = random_qkv(1, 4, 2, 4, 4, 16, torch.float32)
    if case == "rank":
        return q[0], k, v  # q without its batch dim
    if case == "heads":
        return random_qkv(1, 6, 4, 4, 4, 16, torch.float32)  # 6 query heads over 4 kv heads
    if case == "mismatched-D":
        return random_qkv(1, 4, 2, 4, 4, 32, torch.float32)[0], k, v
    if case == "D48":
        return random_qkv(1, 4, 2, 4, 4, 48, torch.float32)
    if case == "dtype":
        return q.half(), k, v
    if case == "Tq>Tk":
        return random_qkv(1, 4, 2, 9, 4, 16, torch.float32)  # causal: the first queries would see nothing
    raise AssertionError(case)


@pytest.mark.parametrize("case, message", [("rank", "4-D"), ("heads", "multiple"), ("mismatched-D", "head_dim"),
                                           ("D48", "not supported"), ("dtype", "dtype"), ("Tq>Tk", "more queries")])
def test_bad_inputs_raise_value_error_saying_what_to_do(case, message):
    with pytest.raises(ValueError, match=message):
        flash_attention(*bad_inputs(case), causal=True)


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    """Compiled for a GPU (no TRITON_INTERPRET), CPU tensors get a ValueError naming the ways out."""
    monkeypatch.setattr(FA, "_interpreted", lambda: False)
    q, k, v = random_qkv(1, 2, 2, 4, 4, 16, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        flash_attention(q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [(3, 7, 33), (5, 64), (1, 1000)], ids=str)
def test_fused_add_rms_norm_matches_unfused(shape, dtype):
    """One kernel gives what add, then RMSNorm in fp32, gives: the sum exactly, the norm to a rounding."""
    g = torch.Generator().manual_seed(sum(shape))
    x, residual = (torch.randn(shape, generator=g).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    assert normed.shape == new_residual.shape == x.shape and normed.dtype == dtype
    if dtype == torch.bfloat16 and not CUDA:  # the interpreter rounds fp32 -> bf16 toward zero: one ulp
        torch.testing.assert_close(new_residual, ref_residual, rtol=2**-7, atol=0)
    else:
        assert torch.equal(new_residual, ref_residual), "x + residual must be exact: it is the residual stream"
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]  # one rounding of the output
    if dtype == torch.bfloat16 and not CUDA:
        tol = 3 * 2**-7  # three roundings toward zero in the interpreter (sum, normalised, output): 3 ulps
    torch.testing.assert_close(normed, ref_normed, rtol=tol, atol=tol, msg=lambda m: f"normed differs: {m}")


def test_fused_add_rms_norm_strided_rows_and_errors():
    """Rows with a stride (a slice of a wider tensor) work; mismatched shapes raise ValueError."""
    wide = torch.randn(6, 100).to(DEVICE)
    x, residual, weight = wide[:, :40], wide[:, 50:90], torch.rand(40).to(DEVICE)
    got, ref = fused_add_rms_norm(x, residual, weight), fused_add_rms_norm_reference(x, residual, weight)
    torch.testing.assert_close(got, ref)
    with pytest.raises(ValueError, match="same shape|one shape"):
        fused_add_rms_norm(x, residual[:, :20], weight)
    with pytest.raises(ValueError, match="weight"):
        fused_add_rms_norm(x, residual, weight[:10])


def test_model_keeps_pytorch_attention_on_cpu(monkeypatch):
    """On the CPU the model never dispatches to Triton; the CAUSAL fallback equals the explicit mask."""
    from minillm.model import CAUSAL, attention_mask, grouped_query_attention, use_triton_attention

    q, k, v = random_qkv(2, 4, 2, 6, 10, 16, torch.float32, device="cpu")
    assert not use_triton_attention(q, 16), "CPU tensors must take the PyTorch path"
    mask = attention_mask(torch.arange(4, 10).expand(2, -1), torch.arange(10).expand(2, -1))
    torch.testing.assert_close(grouped_query_attention(q, k, v, CAUSAL), grouped_query_attention(q, k, v, mask))
    monkeypatch.setattr(minillm.kernels, "flash_attention", lambda *a, **kw: pytest.fail("kernel called on CPU"))
    torch.testing.assert_close(grouped_query_attention(q, k, v, CAUSAL), attention_reference(q, k, v), atol=1e-5,
                               rtol=1e-5)


# ---------------------------------------------------------------- the decode kernel (chapter 03)


def random_decode(B, H, H_kv, S, D, dtype, seed=0, device=DEVICE):  # noqa: N803 - shape names
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g).to(device, dtype)
    k = torch.randn(B, H_kv, S, D, generator=g).to(device, dtype)
    v = torch.randn(B, H_kv, S, D, generator=g).to(device, dtype)
    return q, k, v


# (B, H, H_kv, lengths, D): MHA, GQA 2/4/8, MQA; one key up to 4k; a batch of different lengths
DECODE_SHAPES = [
    (1, 4, 4, [1], 16),  # MHA, a single key
    (2, 4, 4, [37, 5], 64),  # MHA, ragged
    (2, 4, 2, [80, 33], 32),  # GQA 2
    (3, 8, 2, [100, 1, 64], 64),  # GQA 4, one sequence of one token
    (1, 16, 2, [300], 128),  # GQA 8, head_dim 128
    (2, 8, 1, [129, 70], 32),  # MQA
    (1, 8, 1, [4096], 16),  # MQA at 4k keys: many chunks
    (2, 8, 2, [2500, 900], 16),  # GQA 4, long and ragged
]


def _decode_id(s):
    return "B{}-H{}/{}-L{}-D{}".format(s[0], s[1], s[2], "_".join(map(str, s[3])), s[4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=_decode_id)
def test_decode_attention_matches_reference(shape, dtype):
    """decode_attention equals the reference (and SDPA with K/V repeated) for ragged GQA/MQA/MHA batches."""
    B, H, H_kv, lens, D = shape
    S = max(lens) + 3  # the cache holds a few slots nobody filled: they must not be read
    q, k, v = random_decode(B, H, H_kv, S, D, dtype, seed=sum(lens) + H)
    k[:, :, max(lens):] = float("nan")  # reading an unfilled slot would poison the output
    lengths = torch.tensor(lens, device=DEVICE)
    got = decode_attention(q, k, v, lengths)
    assert got.shape == (B, H, D) and got.dtype == dtype and torch.isfinite(got).all()
    assert_close(got, decode_attention_reference(q, k, v, lengths), dtype, f"vs reference at {shape}")
    for b, n in enumerate(lens):  # each sequence alone, through SDPA
        expected = sdpa(q[b:b + 1, :, None], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal=False)[:, :, 0]
        assert_close(got[b:b + 1], expected, dtype, f"sequence {b} (length {n}) vs SDPA at {shape}")


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_decode_attention_any_number_of_splits_gives_the_same_answer(num_splits):
    """The split count only changes how the keys are shared out, never the result (ragged, GQA 4)."""
    q, k, v = random_decode(2, 8, 2, 700, 32, torch.float32, seed=3)
    lengths = torch.tensor([700, 450], device=DEVICE)
    got = decode_attention(q, k, v, lengths, num_splits=num_splits)
    assert_close(got, decode_attention_reference(q, k, v, lengths), torch.float32, f"{num_splits} splits")


def test_decode_attention_bf16_strided_cache_and_scale():
    """A view into a larger cache (the model's layout), bf16 (upcast under the interpreter), custom scale."""
    q, k, v = random_decode(2, 4, 2, 96, 64, torch.bfloat16, seed=4)
    k, v = k[:, :, :61], v[:, :, :61]  # non-contiguous: the filled part of a bigger cache
    got = decode_attention(q, k, v, scale=0.2)
    assert_close(got, decode_attention_reference(q, k, v, scale=0.2), torch.bfloat16, "bf16 strided")


def test_decode_split_heuristic_fills_the_gpu_and_respects_short_sequences():
    from minillm.kernels.decode_attention import MAX_SPLITS, TARGET_PROGRAMS, choose_num_splits

    assert choose_num_splits(1, 8, 32768, 64) == min(MAX_SPLITS, TARGET_PROGRAMS // 8)  # one long sequence
    assert choose_num_splits(256, 8, 32768, 64) == 1  # 2,048 programs already fill the GPU
    assert choose_num_splits(64, 8, 32768, 64) * 64 * 8 < 2 * TARGET_PROGRAMS  # no more than needed
    assert choose_num_splits(1, 8, 64, 64) == 1  # one tile of keys: nothing to split
    assert choose_num_splits(1, 8, 100, 64) == 2  # chunks of at least MIN_CHUNK_TILES (1) tile
    assert choose_num_splits(1, 1, 10**6, 64) == MAX_SPLITS


@pytest.mark.parametrize("case, message", [
    ("q4d", "q must be"), ("heads", "multiple"), ("head_dim", "head_dim 24"), ("dtype", "share one dtype"),
    ("lengths", "lengths must be"),
])
def test_decode_attention_bad_inputs_say_what_to_do(case, message):
    q, k, v = random_decode(1, 4, 2, 8, 16, torch.float32)
    lengths = None
    if case == "q4d":
        q = q[:, :, None]
    elif case == "heads":
        k = v = torch.randn(1, 3, 8, 16, device=DEVICE)
    elif case == "head_dim":
        q, k, v = random_decode(1, 4, 2, 8, 24, torch.float32)
    elif case == "dtype":
        k = k.half()
        v = v.half()
    elif case == "lengths":
        lengths = torch.tensor([3.0], device=DEVICE)
    with pytest.raises(ValueError, match=message):
        decode_attention(q, k, v, lengths)


# ---------------------------------------------------------------- the paged decode kernel (chapter 04)


def scatter_into_pool(k, v, lengths, block_size, spare_blocks=3, seed=0):
    """A dense cache k, v [B, H_kv, S, D] written into pools [num_blocks, block_size, H_kv, D] at random,
    non-contiguous blocks (spare blocks left full of NaN, so reading a wrong block poisons the output);
    returns the pools and the block tables [B, M] int32."""
    B, H_kv, S, D = k.shape
    M = cdiv(S, block_size)
    num_blocks = B * M + spare_blocks
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = order[: B * M].reshape(B, M).to(DEVICE, torch.int32)
    pools = []
    for dense in (k, v):
        pool = torch.full((num_blocks, block_size, H_kv, D), float("nan"), dtype=dense.dtype, device=DEVICE)
        padded = torch.zeros(B, H_kv, M * block_size, D, dtype=dense.dtype, device=DEVICE)
        padded[:, :, :S] = dense
        pool[tables.long()] = padded.transpose(1, 2).reshape(B, M, block_size, H_kv, D)
        for b, n in enumerate(lengths):  # the slots past a sequence's end hold NaN: they must not be read
            blocks = tables[b].long()
            flat = pool[blocks].reshape(M * block_size, H_kv, D)
            flat[n:] = float("nan")
            pool[blocks] = flat.reshape(M, block_size, H_kv, D)
        pools.append(pool)
    return pools[0], pools[1], tables


# (B, H, H_kv, lengths, D, block_size): block 16 (the default), small and large blocks, one that is no
# power of two, a block larger than the kernel's tile
PAGED_SHAPES = [
    (2, 8, 2, [37, 5], 32, 16),
    (3, 4, 4, [1, 64, 50], 16, 16),  # MHA; one sequence of one token; one exactly 4 blocks
    (1, 16, 2, [300], 64, 16),  # GQA 8
    (2, 8, 1, [129, 70], 32, 8),  # MQA, small blocks
    (2, 8, 2, [90, 33], 16, 5),  # a block size that is not a power of two
    (2, 4, 2, [200, 130], 16, 64),  # blocks larger than the interpreter's 32-key tile
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", PAGED_SHAPES, ids=lambda s: _decode_id(s[:5]) + f"-P{s[5]}")
def test_paged_decode_attention_matches_the_dense_kernel(shape, dtype):
    """Through block tables the kernel reads exactly the keys the dense cache holds: it equals the dense
    reference on the same keys, and the paged reference (gather_kv, then the reference)."""
    from minillm.kernels import paged_decode_attention, paged_decode_attention_reference

    B, H, H_kv, lens, D, P = shape
    q, k, v = random_decode(B, H, H_kv, max(lens), D, dtype, seed=sum(lens) + P)
    lengths = torch.tensor(lens, device=DEVICE)
    k_pool, v_pool, tables = scatter_into_pool(k, v, lens, P, seed=P)
    got = paged_decode_attention(q, k_pool, v_pool, tables, lengths, max_len=max(lens))
    assert got.shape == (B, H, D) and got.dtype == dtype and torch.isfinite(got).all()
    assert_close(got, decode_attention_reference(q, k, v, lengths), dtype, f"paged vs dense reference at {shape}")
    assert_close(paged_decode_attention_reference(q, k_pool, v_pool, tables, lengths),
                 decode_attention_reference(q, k, v, lengths), dtype, "the paged reference vs the dense one")
    default_max = paged_decode_attention(q, k_pool, v_pool, tables, lengths)  # max_len from the table's width
    assert_close(default_max, got, dtype, "max_len left to its default")


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [PAGED_SHAPES[0], PAGED_SHAPES[2], PAGED_SHAPES[4]],
                         ids=lambda s: _decode_id(s[:5]) + f"-P{s[5]}")
def test_paged_decode_attention_reads_8_bit_codes_with_their_scales(shape, dtype, kv_dtype):
    """Pools of int8 / fp8 codes with one scale per (slot, head) (chapter 06): the kernel equals attention over
    the dequantised keys and values. The slots past each sequence's end get NaN scales: reading one poisons."""
    from minillm.kernels import paged_decode_attention, paged_decode_attention_reference

    from minillm.quant.kv import dequantize_kv, quantize_kv

    B, H, H_kv, lens, D, P = shape
    q, k, v = random_decode(B, H, H_kv, max(lens), D, dtype, seed=sum(lens) + P + 1)
    lengths = torch.tensor(lens, device=DEVICE)
    k_pool, v_pool, tables = scatter_into_pool(k, v, lens, P, seed=P)
    (kc, ks), (vc, vs) = quantize_kv(k_pool, kv_dtype), quantize_kv(v_pool, kv_dtype)
    unwritten = torch.isnan(k_pool).any(-1)  # [num_blocks, P, H_kv]: slots no sequence holds
    ks[unwritten], vs[unwritten] = float("nan"), float("nan")  # poison: reading one turns the output NaN
    got = paged_decode_attention(q, kc, vc, tables, lengths, max_len=max(lens), k_scale=ks, v_scale=vs)
    assert got.shape == (B, H, D) and got.dtype == dtype and torch.isfinite(got).all()
    k_deq = dequantize_kv(*quantize_kv(k, kv_dtype), dtype)  # the same vectors, quantised the same way
    v_deq = dequantize_kv(*quantize_kv(v, kv_dtype), dtype)
    assert_close(got, decode_attention_reference(q, k_deq, v_deq, lengths), dtype, f"{kv_dtype} pools at {shape}")
    assert_close(paged_decode_attention_reference(q, kc, vc, tables, lengths, k_scale=ks, v_scale=vs),
                 decode_attention_reference(q, k_deq, v_deq, lengths), dtype, "the paged reference with scales")


def test_paged_decode_attention_scale_mistakes_are_clear_errors():
    from minillm.kernels import paged_decode_attention

    from minillm.quant.kv import quantize_kv

    q, k, v = random_decode(1, 4, 2, 20, 16, torch.float32, seed=3)
    k_pool, v_pool, tables = scatter_into_pool(k, v, [20], 16)
    (kc, ks), (vc, vs) = quantize_kv(k_pool, torch.int8), quantize_kv(v_pool, torch.int8)
    lengths = torch.tensor([20], device=DEVICE)
    with pytest.raises(ValueError, match="pass their scales"):
        paged_decode_attention(q, kc, vc, tables, lengths)
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        paged_decode_attention(q, kc, vc, tables, lengths, k_scale=ks)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn codes"):
        paged_decode_attention(q, k_pool, v_pool, tables, lengths, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="fp32 of the pools' shape"):
        paged_decode_attention(q, kc, vc, tables, lengths, k_scale=ks[..., :1], v_scale=vs[..., :1])


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_paged_decode_attention_shared_blocks_and_any_split(num_splits):
    """Two sequences sharing their first blocks (a forked prompt) read them correctly; splits do not matter."""
    from minillm.kernels import paged_decode_attention

    q, k, v = random_decode(2, 8, 2, 100, 32, torch.float32, seed=9)
    k[1, :, :64], v[1, :, :64] = k[0, :, :64], v[0, :, :64]  # a common prefix of 4 blocks
    k_pool, v_pool, tables = scatter_into_pool(k, v, [100, 90], 16, seed=1)
    tables[1, :4] = tables[0, :4]  # sequence 1 points at sequence 0's prefix blocks: shared, not copied
    lengths = torch.tensor([100, 90], device=DEVICE)
    got = paged_decode_attention(q, k_pool, v_pool, tables, lengths, num_splits=num_splits)
    assert_close(got, decode_attention_reference(q, k, v, lengths), torch.float32, f"{num_splits} splits, shared")


@pytest.mark.parametrize("combine_block_s", [16, 2])
def test_paged_decode_attention_cuts_each_rows_own_length_into_the_chunks(combine_block_s, monkeypatch):
    """Chunks are cut from each row's length, not from the launch's key range: block tables far wider than the rows
    (a CUDA graph's range: 1,024 keys), their extra columns pointing at a block full of NaN, many splits, rows of
    70, 33 and 1 keys. Every key is read once and no key past a row's end is read. The combine reads a row's chunks
    only, COMBINE_BLOCK_S a step: 2 makes it take several steps."""
    from minillm.kernels import paged_decode_attention

    monkeypatch.setattr(sys.modules["minillm.kernels.decode_attention"], "COMBINE_BLOCK_S", combine_block_s)

    q, k, v = random_decode(3, 4, 2, 70, 32, torch.float32, seed=11)
    lengths = [70, 33, 1]
    k_pool, v_pool, tables = scatter_into_pool(k, v, lengths, 16, seed=2)
    wide = torch.full((3, 64), k_pool.shape[0] - 1, dtype=tables.dtype, device=DEVICE)  # a spare block: NaN
    wide[:, : tables.shape[1]] = tables
    for splits in (3, 16, 64):
        got = paged_decode_attention(q, k_pool, v_pool, wide, torch.tensor(lengths, device=DEVICE), num_splits=splits)
        assert_close(got, decode_attention_reference(q, k, v, torch.tensor(lengths, device=DEVICE)), torch.float32,
                     f"{splits} splits over a 1,024-key range")


def test_paged_decode_attention_bf16_through_the_interpreter():
    from minillm.kernels import paged_decode_attention

    q, k, v = random_decode(2, 4, 2, 70, 64, torch.bfloat16, seed=5)
    k_pool, v_pool, tables = scatter_into_pool(k, v, [70, 41], 16)
    lengths = torch.tensor([70, 41], device=DEVICE)
    got = paged_decode_attention(q, k_pool, v_pool, tables, lengths, scale=0.3)
    assert_close(got, decode_attention_reference(q, k, v, lengths, scale=0.3), torch.bfloat16, "bf16 paged")


@pytest.mark.parametrize("case, message", [
    ("pool3d", "k_pool, v_pool"), ("table_float", "block_tables must be"), ("table_batch", "block_tables must be"),
    ("lengths", "lengths must be"), ("heads", "multiple"),
])
def test_paged_decode_attention_bad_inputs_say_what_to_do(case, message):
    from minillm.kernels import paged_decode_attention

    q = torch.randn(2, 4, 16, device=DEVICE)
    k_pool = v_pool = torch.randn(6, 16, 2, 16, device=DEVICE)
    tables, lengths = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE), torch.tensor([5, 9], device=DEVICE)
    if case == "pool3d":
        k_pool = v_pool = k_pool[0]
    elif case == "table_float":
        tables = tables.float()
    elif case == "table_batch":
        tables = tables[:1]
    elif case == "lengths":
        lengths = lengths[:1]
    elif case == "heads":
        k_pool = v_pool = torch.randn(6, 16, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(q, k_pool, v_pool, tables, lengths)


def paged_decode_logits(model, prompts, device):
    """Prefill `prompts` (ragged) into a PagedKVCache, then one decode step for all: its logits [B, V]."""
    from minillm.engine.kv_cache import PagedKVCache

    cache = PagedKVCache(model.config, num_blocks=32, block_size=16, device=device, dtype=model.dtype)
    for i, p in enumerate(prompts):
        cache.add_sequence(i, p[:-1])
    ids = list(range(len(prompts)))
    with torch.no_grad():
        prefill = cache.prepare(ids, [p[:-1] for p in prompts])
        model(prefill.tokens, cache=prefill)
        step = cache.prepare(ids, [p[-1:] for p in prompts])
        return model(step.tokens, cache=step)[:, -1].float(), step


@pytest.mark.skipif(CUDA, reason="forces the kernel onto CPU tensors, which needs the interpreter; on CUDA the "
                    "dispatch test below runs it for real")
def test_model_decode_on_a_paged_cache_runs_the_paged_kernel(monkeypatch):
    """The model's decode step on a PagedKVCache, with the paged kernel forced on (as on CUDA): the kernel
    runs once per layer, reads the pools (nothing gathered), and gives the logits of PyTorch attention."""
    from conftest import random_hf_model

    import minillm
    import minillm.engine.kv_cache

    model = minillm.from_transformers(random_hf_model("llama", hidden_size=64, num_attention_heads=4,
                                                      num_key_value_heads=2))  # head_dim 16, GQA 2
    prompts = [list(range(5, 45)), list(range(50, 57)), list(range(100, 120))]  # 40, 7 and 20 tokens
    expected, view = paged_decode_logits(model, prompts, "cpu")  # PyTorch attention: gathers through the tables
    assert not view.read_pools
    calls = []
    kernel = minillm.kernels.paged_decode_attention
    monkeypatch.setattr(minillm.kernels, "paged_decode_attention", lambda *a, **kw: calls.append(a) or kernel(*a, **kw))
    monkeypatch.setattr(minillm.engine.kv_cache, "use_triton_attention", lambda x, d: True)  # as on CUDA
    got, view = paged_decode_logits(model, prompts, "cpu")
    assert view.read_pools and len(calls) == model.config.n_layers, f"paged kernel ran {len(calls)} times"
    assert calls[0][1].shape == (32, 16, 2, 16), "the kernel must get the layer's pool, not gathered keys"
    assert_close(got, expected, torch.float32, "logits with the paged kernel vs PyTorch attention")




# ---------------------------------------------------------------- CUDA only: real lengths, bf16, dispatch


@cuda_only
@pytest.mark.parametrize("T_q, T_k, D, H, H_kv", [(1000, 1000, 64, 8, 2), (4096, 4096, 128, 4, 4),
                                                  (300, 1000, 128, 8, 1), (1000, 1000, 16, 2, 2),
                                                  (777, 777, 256, 4, 2), (1, 4096, 64, 8, 2)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cuda_bf16_long_sequences_match_sdpa(T_q, T_k, D, H, H_kv, causal):  # noqa: N803
    """bf16 on the GPU's tensor cores, at T = 1000 and 4096, against SDPA in fp32."""
    q, k, v = random_qkv(2, H, H_kv, T_q, T_k, D, torch.bfloat16, device="cuda")
    got = flash_attention(q, k, v, causal=causal)
    assert_close(got, sdpa(q, k, v, causal), torch.bfloat16, f"bf16 T_q={T_q} T_k={T_k} D={D}")


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_cuda_fp32_fp16(dtype):
    q, k, v = random_qkv(2, 8, 2, 333, 1000, 64, dtype, device="cuda")
    assert_close(flash_attention(q, k, v), sdpa(q, k, v, True), dtype, f"cuda {dtype}")


@cuda_only
def test_model_prefill_dispatches_to_triton_on_cuda(monkeypatch):
    """Transformer prefill on CUDA runs the kernel (one call per layer) and agrees with MINILLM_TRITON=0,
    for a whole prompt and for a chunk appended to a KV cache."""
    from conftest import random_hf_model

    import minillm
    from minillm import KVCache

    hf = random_hf_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)  # head_dim 32
    model = minillm.from_transformers(hf).to("cuda", torch.bfloat16)
    tokens = torch.randint(0, 320, (2, 100), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    calls = []
    kernel = minillm.kernels.flash_attention
    monkeypatch.setattr(minillm.kernels, "flash_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))

    def run(chunked: bool) -> torch.Tensor:
        with torch.no_grad():
            if not chunked:
                return model(tokens).float()
            cache = KVCache(model.config, 2, 128, device="cuda", dtype=torch.bfloat16)
            return torch.cat([model(tokens[:, :60], cache=cache), model(tokens[:, 60:], cache=cache)], 1).float()

    for chunked in (False, True):
        calls.clear()
        monkeypatch.delenv("MINILLM_TRITON", raising=False)
        got = run(chunked)
        assert len(calls) == model.config.n_layers * (2 if chunked else 1), f"kernel ran {len(calls)} times"
        monkeypatch.setenv("MINILLM_TRITON", "0")
        calls.clear()
        expected = run(chunked)
        assert not calls, "MINILLM_TRITON=0 must keep the PyTorch path"
        rel = ((got - expected).norm() / expected.norm()).item()
        assert rel < 2e-2, f"Triton vs PyTorch attention logits differ by {rel:.2e} (relative L2), chunked={chunked}"


@cuda_only
@pytest.mark.parametrize("B, H, H_kv, S", [(1, 32, 8, 32768), (16, 32, 8, 4096), (64, 32, 8, 1024), (4, 16, 16, 2000),
                                         (8, 32, 1, 5000)])
def test_cuda_decode_attention_bf16_at_real_lengths(B, H, H_kv, S):  # noqa: N803
    q, k, v = random_decode(B, H, H_kv, S, 128, torch.bfloat16, device="cuda")
    lengths = torch.randint(1, S + 1, (B,), generator=torch.Generator().manual_seed(B)).cuda()
    lengths[0] = S
    got = decode_attention(q, k, v, lengths)
    assert_close(got, decode_attention_reference(q, k, v, lengths), torch.bfloat16, f"B={B} S={S} {H}/{H_kv}")


@cuda_only
def test_model_decode_dispatches_to_the_decode_kernel_on_cuda(monkeypatch):
    """A cached decode step on CUDA runs decode_attention once per layer and agrees with MINILLM_TRITON=0."""
    from conftest import random_hf_model

    import minillm
    from minillm import KVCache

    hf = random_hf_model("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2)  # head_dim 32
    model = minillm.from_transformers(hf).to("cuda", torch.bfloat16)
    tokens = torch.randint(0, 320, (2, 41), device="cuda", generator=torch.Generator("cuda").manual_seed(6))
    calls = []
    kernel = minillm.kernels.decode_attention
    monkeypatch.setattr(minillm.kernels, "decode_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))

    def decode_last() -> torch.Tensor:
        cache = KVCache(model.config, 2, 64, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            model(tokens[:, :40], cache=cache)
            return model(tokens[:, 40:], cache=cache).float()

    monkeypatch.delenv("MINILLM_TRITON", raising=False)
    got = decode_last()
    assert len(calls) == model.config.n_layers, f"decode kernel ran {len(calls)} times"
    monkeypatch.setenv("MINILLM_TRITON", "0")
    calls.clear()
    expected = decode_last()
    assert not calls
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < 2e-2, f"decode kernel vs PyTorch logits differ by {rel:.2e} (relative L2)"


@cuda_only
def test_model_decode_on_a_paged_cache_dispatches_to_the_paged_kernel_on_cuda(monkeypatch):
    """On CUDA a paged decode step runs paged_decode_attention once per layer and agrees with MINILLM_TRITON=0."""
    from conftest import random_hf_model

    import minillm

    hf = random_hf_model("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2)  # head_dim 32
    model = minillm.from_transformers(hf).to("cuda", torch.bfloat16)
    prompts = [list(range(5, 45)), list(range(50, 57)), list(range(100, 170))]
    calls = []
    kernel = minillm.kernels.paged_decode_attention
    monkeypatch.setattr(minillm.kernels, "paged_decode_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    monkeypatch.delenv("MINILLM_TRITON", raising=False)
    got, _ = paged_decode_logits(model, prompts, "cuda")
    assert len(calls) == model.config.n_layers, f"paged kernel ran {len(calls)} times"
    monkeypatch.setenv("MINILLM_TRITON", "0")
    calls.clear()
    expected, _ = paged_decode_logits(model, prompts, "cuda")
    assert not calls
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < 2e-2, f"paged kernel vs PyTorch logits differ by {rel:.2e} (relative L2)"


@cuda_only
def test_cuda_paged_decode_attention_bf16_at_real_lengths():
    from minillm.kernels import paged_decode_attention

    B, H, H_kv, S = 16, 32, 8, 4096
    q, k, v = random_decode(B, H, H_kv, S, 128, torch.bfloat16, device="cuda")
    lengths = torch.randint(1, S + 1, (B,), generator=torch.Generator().manual_seed(B)).tolist()
    lengths[0] = S
    k_pool, v_pool, tables = scatter_into_pool(k, v, lengths, 16)
    lengths = torch.tensor(lengths, device="cuda")
    got = paged_decode_attention(q, k_pool, v_pool, tables, lengths, max_len=S)
    assert_close(got, decode_attention_reference(q, k, v, lengths), torch.bfloat16, "paged bf16 at 4k")


@cuda_only
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_paged_decode_attention_at_a_serving_batch(head_dim):
    """144 sequences x 8 KV heads: a serving batch, launched with head_dim keys a tile and head_dim / 32 warps
    (`SERVING_PROGRAMS`); lengths from 1 key to past 768, with a key range far past them all, as the engine's
    graphs give it."""
    from minillm.kernels import paged_decode_attention

    decode_module = sys.modules["minillm.kernels.decode_attention"]  # (the package's name of it is its function)
    B, H, H_kv, S = 144, 32, 8, 800
    assert B * H_kv >= decode_module.SERVING_PROGRAMS  # the case under test
    q, k, v = random_decode(B, H, H_kv, S, head_dim, torch.bfloat16, device="cuda")
    lengths = torch.randint(1, S + 1, (B,), generator=torch.Generator().manual_seed(B)).tolist()
    lengths[:2] = [1, S]
    k_pool, v_pool, tables = scatter_into_pool(k, v, lengths, 16)
    lengths = torch.tensor(lengths, device="cuda")
    got = paged_decode_attention(q, k_pool, v_pool, tables, lengths, max_len=8192)
    assert_close(got, decode_attention_reference(q, k, v, lengths), torch.bfloat16, "paged bf16, a full batch")


@cuda_only
def test_model_trains_and_autocasts_through_pytorch_attention_on_cuda():
    """The Triton kernels have no backward pass: a training forward on CUDA must take PyTorch attention
    (every qkv_proj gets a gradient), and bf16 autocast (q, k in fp32 after rotary, v in bf16) must not
    reach a kernel that needs one dtype."""
    from conftest import random_hf_model

    import minillm

    hf = random_hf_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)  # head_dim 32
    model = minillm.from_transformers(hf).to("cuda")
    tokens = torch.randint(0, 320, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    model(tokens).float().logsumexp(-1).mean().backward()
    for layer in model.layers:
        grad = layer.self_attn.qkv_proj.weight.grad
        assert grad is not None and grad.abs().sum() > 0, "attention got no gradient on CUDA"
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens)
    with torch.no_grad():
        expected = model(tokens)
    rel = ((logits.float() - expected.float()).norm() / expected.float().norm()).item()
    assert rel < 3e-2, f"bf16 autocast logits differ from fp32 by {rel:.2e}"
