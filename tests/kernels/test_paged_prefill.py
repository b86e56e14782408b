"""minillm.kernels.paged_prefill_attention: packed queries against keys read through block tables, vs the reference.

As in test_kernels.py, without a GPU the kernel runs through Triton's interpreter (TRITON_INTERPRET=1, set before
the kernels are imported), so the shapes are small and ragged on purpose: every case crosses key tiles, the causal
diagonal and block edges, and mixes decode rows (one query) with prompt chunks after a cached context.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the kernels' import: Triton reads it when @triton.jit decorates them
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="Triton is not installed (pip install triton): the kernels need it")
from minillm.kernels import paged_prefill_attention, paged_prefill_attention_reference  # noqa: E402

PP = sys.modules["minillm.kernels.paged_prefill"]
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and not PP._interpreted():
    pytest.skip("minillm.kernels was imported before TRITON_INTERPRET=1 was set, so its kernels need a GPU; run this "
                "file on its own (pytest tests/kernels/test_paged_prefill.py)", allow_module_level=True)
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def packed_case(spans, H, H_kv, D, dtype, block_size=16, seed=0, quant=None):  # noqa: N803 - shape names
    """Random queries for sequences of (context, new queries) `spans`, and pools holding their keys in shuffled
    blocks. -> q [N, H, D], k_pool, v_pool, block_tables [P, M], q_starts [P + 1], seq_lens [P], scales or None."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in spans]
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 3  # a few blocks no sequence owns
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for m in per_seq:
        tables.append(order[used : used + m] + [0] * (max(per_seq) - m))  # padded with block 0, as the engine does
        used += m
    shape = (num_blocks, block_size, H_kv, D)
    k_pool, v_pool = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    scales = None
    if quant is not None:  # 8-bit codes and one fp32 scale per (slot, head), as minillm.quant.kv stores them
        k_scale = torch.rand(shape[:-1], generator=g) * 0.01 + 0.005  # dequantised values of about unit size
        v_scale = torch.rand(shape[:-1], generator=g) * 0.01 + 0.005
        k_pool = torch.randint(-127, 128, shape, generator=g).to(quant)
        v_pool = torch.randint(-127, 128, shape, generator=g).to(quant)
        scales = (k_scale.to(DEVICE), v_scale.to(DEVICE))
    else:
        k_pool, v_pool = k_pool.to(dtype), v_pool.to(dtype)
    N = sum(n for _, n in spans)
    q = torch.randn(N, H, D, generator=g).to(DEVICE, dtype)
    starts = [0]
    for _, n in spans:
        starts.append(starts[-1] + n)
    ints = {"dtype": torch.int32, "device": DEVICE}
    return (q, k_pool.to(DEVICE), v_pool.to(DEVICE), torch.tensor(tables, **ints), torch.tensor(starts, **ints),
            torch.tensor(lens, **ints), scales)


def check(spans, H, H_kv, D, dtype, quant=None, **kwargs):  # noqa: N803 - shape names
    q, k_pool, v_pool, tables, starts, lens, scales = packed_case(spans, H, H_kv, D, dtype, quant=quant)
    extra = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
    out = paged_prefill_attention(q, k_pool, v_pool, tables, starts, lens, max(n for _, n in spans), **extra, **kwargs)
    assert out.isfinite().all(), "every query row written"
    want = paged_prefill_attention_reference(q, k_pool, v_pool, tables, starts, lens, **extra)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = (out.float() - want.float()).abs().max().item()
    assert err <= ATOL[dtype], f"{spans} H={H}/{H_kv} D={D} {dtype}: max error {err:.2e} > {ATOL[dtype]:.0e}"


# (context already cached, new queries) per sequence: a fresh prompt, a later chunk, decode rows, a chunk that ends
# mid-block, a one-token prompt
MIXED = [(0, 37), (21, 1), (40, 19), (5, 1), (0, 1), (63, 2)]


@pytest.mark.parametrize("heads", [(4, 2), (6, 2), (4, 4)], ids=["gqa2", "gqa3", "mha"])
def test_mixed_step_matches_the_reference(heads):
    """Prompt chunks after cached context, fresh prompts and decode rows in one launch; group sizes 2, 3 and 1."""
    check(MIXED, *heads, D=16, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_queries_and_pools(dtype):
    check([(30, 17), (0, 1), (9, 40)], 4, 2, D=32, dtype=dtype)


def test_small_tiles_cross_every_edge():
    """16-row, 16-key tiles: many query tiles per sequence, and unmasked key tiles before the diagonal."""
    check([(50, 33), (3, 1), (0, 48)], 2, 1, D=16, dtype=torch.float32, block_m=16, block_n=16)


def test_sequences_without_queries_hold_no_tiles():
    """Sequences with no new token (the padding rows of a captured mixed step): they get no tile of the launch's
    list, and the others' outputs are untouched; eight sequences make the search over the list take three steps."""
    check([(0, 21), (1, 0), (12, 1), (1, 0), (30, 9), (1, 0), (4, 1), (1, 0)], 4, 2, D=16, dtype=torch.float32)


def test_int8_pools_dequantised_as_read():
    """A quantised cache (chapter 06): int8 codes with a scale per (slot, head), as the decode kernel reads them."""
    check([(20, 13), (7, 1), (0, 25)], 4, 2, D=16, dtype=torch.float32, quant=torch.int8)


def test_bad_inputs_say_what_to_pass():
    q, k_pool, v_pool, tables, starts, lens, _ = packed_case([(0, 5)], 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"q\[0\].transpose"):
        paged_prefill_attention(q[None], k_pool, v_pool, tables, starts, lens, 5)
    with pytest.raises(ValueError, match="q_starts"):
        paged_prefill_attention(q, k_pool, v_pool, tables, starts[:1], lens, 5)
    with pytest.raises(ValueError, match="scales"):
        paged_prefill_attention(q, k_pool.to(torch.int8), v_pool.to(torch.int8), tables, starts, lens, 5)


@cuda_only
@pytest.mark.parametrize("D", [64, 128])
def test_real_lengths_on_the_gpu(D):  # noqa: N803
    """bf16 at the 1B and 8B shapes' head dims, a mixed step's lengths: 32 decode rows at 512 and a 480-token chunk."""
    spans = [(512, 1)] * 32 + [(1536, 480), (0, 300)]
    check(spans, 32, 8, D=D, dtype=torch.bfloat16)


@cuda_only
def test_fp8_pools_on_the_gpu():
    check([(200, 97), (31, 1), (0, 64)], 32, 8, D=128, dtype=torch.bfloat16, quant=torch.float8_e4m3fn)
