"""minillm.kernels.w4a16, the int4-weight matmul kernels (chapter 06), against their PyTorch reference.

Without a GPU the kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1 set before the
kernel module is imported), on small shapes: a few dozen programs each. The interpreter's bf16 tl.dot
is not exact, so the GEMM is checked there in fp32 and fp16; the GEMV sums in fp32 whatever the input.
With CUDA the same tests run on the GPU, plus bf16 and a quantised model's forward through QuantLinear.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the kernels' import: Triton reads it when @triton.jit decorates them
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="Triton is not installed (pip install triton): the kernels need it")
from minillm.kernels.w4a16 import (  # noqa: E402
    W4A16Weight,
    w4a16_dequantize,
    w4a16_gemm,
    w4a16_gemv,
    w4a16_linear,
    w4a16_matmul,
    w4a16_pack,
    w4a16_reference,
)

from minillm.quant import IntQuantized, QuantLinear, pack_int4, quantize_int  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def problem(M: int, N: int, K: int, group: int, seed: int, dtype: torch.dtype = torch.float32):
    """x [M, K] and a random int4 weight [N, K] in the kernels' layout, with the IntQuantized it came from."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(M, K, generator=g).to(dtype)
    q = quantize_int(w, 4, group, symmetric=False)
    weight = w4a16_pack(q)
    weight = W4A16Weight(weight.words.to(DEVICE), weight.scale_zero.to(DEVICE), group)
    return x.to(DEVICE), weight, q


# The GEMV multiplies each input by 2048 + q (the nibble trick) and subtracts 2048 x later: in fp32 that
# leaves ~3e-5 of relative error, far below bf16's 4e-3 but above a plain fp32 sum's 1e-6.
GEMV_FP32_BOUND = 1e-4


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_packing_keeps_every_code_and_rounds_only_the_scale_to_fp16():
    _, weight, q = problem(1, 48, 256, 64, seed=0)
    with_fp16_scales = IntQuantized(q.codes, q.scale.half().float(), q.zero, 4, 64, q.shape)
    torch.testing.assert_close(w4a16_dequantize(weight).cpu(), with_fp16_scales.dequantize(), rtol=0, atol=0)
    step_change = (q.scale.half().float() - q.scale).abs() / q.scale
    assert step_change.max() < 5e-4  # fp16 keeps 11 significant bits


def test_packing_layout_nibble_c_of_word_p_is_input_16c_plus_p():
    codes = torch.arange(128) // 16  # input 16c + p of the group has code c
    q = IntQuantized(pack_int4(codes[None].to(torch.uint8)), torch.ones(1, 1), torch.zeros(1, 1), 4, 128, (1, 128))
    words = w4a16_pack(q).words[0]  # 16 words
    for p in range(16):
        word = words[p].item() & 0xFFFFFFFF
        assert [(word >> (4 * c)) & 0xF for c in range(8)] == list(range(8))


def test_reference_is_the_dequantised_matmul():
    x, weight, _ = problem(3, 48, 256, 64, seed=0)
    expected = x.cpu().double() @ w4a16_dequantize(weight).cpu().double().T
    torch.testing.assert_close(w4a16_reference(x.double(), weight).cpu(), expected)


@pytest.mark.parametrize("M, N, K, group, block_n, words_per_thread, num_warps, split_k, prefetch", [
    (1, 96, 256, 128, 4, 1, 1, 1, True),    # decode: one row, the whole K in one step
    (1, 40, 512, 128, 8, 1, 1, 2, True),    # N not a multiple of the block (masked rows), K split in 2
    (3, 64, 512, 64, 2, 1, 1, 4, False),    # several rows, smaller groups, 4-way split of K
    (2, 16, 1024, 128, 4, 1, 2, 1, True),   # two warps: 64 words a step, 2 steps, the second prefetched
    (2, 16, 1024, 128, 4, 1, 2, 1, False),  # the same without prefetching
    (1, 8, 768, 32, 1, 1, 1, 1, True),      # groups of 32; K / 8 = 96 words: the step shrinks to 32 words
])
def test_gemv_matches_reference(M, N, K, group, block_n, words_per_thread, num_warps, split_k, prefetch):
    x, weight, _ = problem(M, N, K, group, seed=M + N)
    ref = w4a16_reference(x.double(), weight)
    out = w4a16_gemv(x, weight, block_n=block_n, words_per_thread=words_per_thread, num_warps=num_warps,
                     split_k=split_k, prefetch=prefetch)
    assert out.shape == (M, N) and out.dtype == x.dtype
    assert rel_err(out, ref) < GEMV_FP32_BOUND


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("M, N", [(20, 70), (5, 32)])  # ragged tiles in both M and N
def test_gemm_matches_reference(M, N, dtype, bound):
    x, weight, _ = problem(M, N, 256, 128, seed=M * N, dtype=dtype)
    ref = w4a16_reference(x.double(), weight)
    out = w4a16_gemm(x, weight, block_m=16, block_n=32)
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_err(out, ref) < bound


def test_matmul_dispatch_and_linear_shapes():
    x, weight, _ = problem(6, 32, 256, 128, seed=3)
    y = w4a16_linear(x.reshape(2, 3, 256), weight)
    assert y.shape == (2, 3, 32)
    ref = w4a16_reference(x.double(), weight)
    assert rel_err(y.reshape(6, 32), ref) < 1e-5  # six rows: the GEMM
    assert rel_err(w4a16_matmul(x[:1], weight), ref[:1]) < GEMV_FP32_BOUND  # one row: the GEMV


def test_bad_input_raises_clear_errors():
    x, weight, q = problem(1, 32, 256, 128, seed=4)
    with pytest.raises(ValueError, match="shapes disagree"):
        w4a16_gemv(x[:, :128], weight)
    with pytest.raises(ValueError, match="whole groups"):
        w4a16_gemv(x, weight, split_k=4)
    with pytest.raises(TypeError, match="W4A16Weight"):
        w4a16_gemv(x, q)
    with pytest.raises(ValueError, match="asymmetric 4-bit"):
        w4a16_pack(quantize_int(torch.randn(32, 256), 4, 128, symmetric=True))
    with pytest.raises(ValueError, match="multiple of 16"):
        w4a16_pack(quantize_int(torch.randn(32, 256), 4, 8, symmetric=False))
    with pytest.raises(ValueError, match="fp16's range"):
        w4a16_pack(quantize_int(torch.randn(32, 256) * 1e7, 4, 128, symmetric=False))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 4, 8, 33])  # GEMV, GEMV, GEMM on 16x16 tiles, GEMM on 64x64
def test_bf16_on_gpu(M):
    x, weight, _ = problem(M, 256, 1024, 128, seed=M, dtype=torch.bfloat16)
    ref = w4a16_reference(x.double(), weight)
    assert rel_err(w4a16_matmul(x, weight), ref) < 1e-2
    assert rel_err(w4a16_gemv(x, weight), ref) < 1e-2


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_quant_linear_uses_the_kernel_on_gpu():
    w = torch.randn(512, 384) * 0.05
    layer = QuantLinear(quantize_int(w, 4, 128, symmetric=False)).to("cuda")
    x = torch.randn(2, 5, 384, device="cuda", dtype=torch.bfloat16)
    expected = x.double() @ layer.dequantized_weight().double().T
    assert rel_err(layer(x), expected) < 1e-2
