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
    w4a16_gemm,
    w4a16_gemv,
    w4a16_linear,
    w4a16_matmul,
    w4a16_reference,
)

from minillm.quant import QuantLinear, quantize_int  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def problem(M: int, N: int, K: int, group: int, seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(M, K, generator=g).to(dtype)
    q = quantize_int(w, 4, group, symmetric=False)
    return x.to(DEVICE), q.codes.to(DEVICE), q.scale.to(DEVICE), q.zero.to(DEVICE), q


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_reference_is_the_dequantised_matmul():
    x, p, s, z, q = problem(3, 48, 256, 64, seed=0)
    expected = x.cpu() @ q.dequantize().T
    torch.testing.assert_close(w4a16_reference(x, p, s, z, 64).cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M, N, K, group, block_n, groups_per_block, split_k", [
    (1, 96, 256, 128, 32, 1, 1),   # decode: one row, one group per step
    (1, 40, 512, 128, 16, 2, 2),   # N not a multiple of the block (masked rows), 2 groups per step, K split in 2
    (3, 64, 512, 64, 64, 2, 4),    # several rows, smaller groups, 4-way split of K
])
def test_gemv_matches_reference(M, N, K, group, block_n, groups_per_block, split_k):
    x, p, s, z, _ = problem(M, N, K, group, seed=M + N)
    ref = w4a16_reference(x.double(), p, s.double(), z.double(), group)
    out = w4a16_gemv(x, p, s, z, group, block_n=block_n, groups_per_block=groups_per_block, split_k=split_k)
    assert out.shape == (M, N) and out.dtype == x.dtype
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("M, N", [(20, 70), (5, 32)])  # ragged tiles in both M and N
def test_gemm_matches_reference(M, N, dtype, bound):
    x, p, s, z, _ = problem(M, N, 256, 128, seed=M * N, dtype=dtype)
    ref = w4a16_reference(x.double(), p, s.double(), z.double(), 128)
    out = w4a16_gemm(x, p, s, z, 128, block_m=16, block_n=32, block_k=128)
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_err(out, ref) < bound


def test_matmul_dispatch_and_linear_shapes():
    x, p, s, z, q = problem(6, 32, 256, 128, seed=3)
    q = type(q)(p, s, z, 4, 128, q.shape)
    y = w4a16_linear(x.reshape(2, 3, 256), q)
    assert y.shape == (2, 3, 32)
    ref = w4a16_reference(x.double(), p, s.double(), z.double(), 128)
    assert rel_err(y.reshape(6, 32), ref) < 1e-5
    assert rel_err(w4a16_matmul(x[:1], p, s, z, 128), ref[:1]) < 1e-5  # one row: the GEMV


def test_bad_shapes_raise_clear_errors():
    x, p, s, z, _ = problem(1, 32, 256, 128, seed=4)
    with pytest.raises(ValueError, match="shapes disagree"):
        w4a16_gemv(x[:, :128], p, s, z, 128)
    with pytest.raises(ValueError, match="divide group_size"):
        w4a16_gemm(x, p, s, z, 128, block_k=96)
    with pytest.raises(ValueError, match="must divide K"):
        w4a16_gemv(x, p, s, z, 128, split_k=4)
    with pytest.raises(ValueError, match="asymmetric 4-bit"):
        w4a16_linear(x, quantize_int(torch.randn(32, 256), 4, 128, symmetric=True))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 4, 33])
def test_bf16_on_gpu(M):
    x, p, s, z, _ = problem(M, 256, 1024, 128, seed=M, dtype=torch.bfloat16)
    ref = w4a16_reference(x.double(), p, s.double(), z.double(), 128)
    assert rel_err(w4a16_matmul(x, p, s, z, 128), ref) < 1e-2


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_quant_linear_uses_the_kernel_on_gpu():
    w = torch.randn(512, 384) * 0.05
    layer = QuantLinear(quantize_int(w, 4, 128, symmetric=False)).to("cuda")
    x = torch.randn(2, 5, 384, device="cuda", dtype=torch.bfloat16)
    expected = x.double() @ layer.dequantized_weight().double().T
    assert rel_err(layer(x), expected) < 1e-2
