"""minillm.kernels' fused rotary and SwiGLU kernels (issue 16) and the batch-1 matrix-vector kernel (issue 30),
against their PyTorch references.

Without a GPU the kernels run on the CPU through Triton's interpreter: TRITON_INTERPRET=1 must be
set before the kernel modules are imported (Triton decides at decoration time), so this file sets it
first, as tests/kernels/test_kernels.py does. The interpreter runs each program in NumPy, slowly, so the
shapes are small: both kernels launch one program per token (rotary) or per row and 1024 columns
(SwiGLU), a few dozen programs at most here.

What "agree" means. Both kernels round like the PyTorch they replace, operation by operation (see
their module docstrings), so on a GPU they should match the references to the last bit, or within
an ulp where libdevice's cos, sin or exp and PyTorch's differ in the last fp32 place. Under the
interpreter NumPy computes cos, sin and exp (an fp32 ulp or two from PyTorch's), fp16 rounds as on a
GPU, but fp32 -> bf16 rounds toward zero rather than to nearest (tests/kernels/test_kernels.py's docstring),
so bf16 results there may differ by an ulp or two for each rounding. Each test states its bound in
ulps of the dtype, measured against the size of the terms that were rounded.
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
from minillm.kernels import (  # noqa: E402
    fused_rotary,
    fused_rotary_reference,
    greedy_argmax,
    greedy_reference,
    matvec,
    matvec_reference,
    silu_and_mul,
    silu_and_mul_reference,
)

from minillm import model as model_module  # noqa: E402
from minillm.config import ModelConfig  # noqa: E402
from minillm.model import MLP, RotaryEmbedding, apply_rotary, rope_inverse_frequencies  # noqa: E402

ROTARY = sys.modules["minillm.kernels.rotary"]
SWIGLU = sys.modules["minillm.kernels.swiglu"]
MATVEC = sys.modules["minillm.kernels.matvec"]
GREEDY = sys.modules["minillm.kernels.greedy"]
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and not all(m._interpreted() for m in (ROTARY, SWIGLU, MATVEC, GREEDY)):
    pytest.skip(
        "minillm.kernels was imported before TRITON_INTERPRET=1 was set, so its kernels need a GPU; "
        "run this file on its own (pytest tests/kernels/test_fused_kernels.py)",
        allow_module_level=True,
    )
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # one ulp, relative to 1.0
# the bound, in ulps, for each dtype: on a GPU the two should agree but for a last-place difference
# in fp32 cos/sin/exp; under the interpreter bf16 rounds toward zero: each of three roundings (cos or sin,
# product, sum) may land an ulp off, and 2.9 was the worst seen in a few dozen cases
ULPS = {torch.float32: 4, torch.float16: 1, torch.bfloat16: 1 if CUDA else 4}


def inverse_frequencies(D: int, theta: float = 10000.0) -> torch.Tensor:  # noqa: N803 - the head dim
    """The model's own rotary frequencies for head dim D (fp32, on DEVICE)."""
    return rope_inverse_frequencies(ModelConfig(dim=64, n_heads=1, head_dim=D, rope_theta=theta)).to(DEVICE)


def qkv_views(N, H, H_kv, D, dtype, seed=0):  # noqa: N803 - shape names
    """q [N, H, D] and k [N, H_kv, D] as views of one qkv matrix [N, (H + 2 H_kv) D], as the model slices them."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(N, (H + 2 * H_kv) * D, generator=g).to(DEVICE, dtype)
    heads = qkv.view(N, H + 2 * H_kv, D)
    return heads[:, :H], heads[:, H:H + H_kv]


def rotary_scale(x, positions, inv_freq):
    """|x cos| + |rotate_half(x) sin| in fp32: the size of the two products each output element sums."""
    angles = positions[:, None].float() * inv_freq
    cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
    xf = x.float()
    half = x.shape[-1] // 2
    return (xf * cos).abs() + (torch.cat((xf[..., half:], xf[..., :half]), dim=-1) * sin).abs()


def assert_within_ulps(got, expected, scale, dtype, what, ulps=None):
    """|got - expected| <= ulps * eps(dtype) * scale, elementwise (scale: the size of what was rounded)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype == dtype, what
    ulps = ULPS[dtype] if ulps is None else ulps
    err = (got.float() - expected.float()).abs()
    bound = ulps * EPS[dtype] * scale.float() + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: an error of {worst:.2f} times the bound of {ulps} ulps for {dtype}"


# (N, H, H_kv, D): one token, GQA 4/2, MQA 8/1, MHA; head dims 16..128
ROTARY_SHAPES = [(1, 4, 2, 16), (3, 8, 1, 64), (7, 4, 2, 128), (3, 2, 2, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=str)
def test_fused_rotary_matches_reference(shape, dtype):
    """Strided q and k (views of one qkv matrix) rotate as the model's tables and apply_rotary rotate them."""
    N, H, H_kv, D = shape
    q, k = qkv_views(N, H, H_kv, D, dtype, seed=sum(shape))
    positions = torch.tensor([0, 1, 17, 100, 511, 2047, 4096][:N], device=DEVICE)
    inv_freq = inverse_frequencies(D)
    q_out, k_out = fused_rotary(q, k, positions, inv_freq)
    q_ref, k_ref = fused_rotary_reference(q, k, positions, inv_freq)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert_within_ulps(q_out, q_ref, rotary_scale(q, positions, inv_freq), dtype, "q")
    assert_within_ulps(k_out, k_ref, rotary_scale(k, positions, inv_freq), dtype, "k")
    if dtype == torch.float16 and not CUDA:  # NumPy rounds fp32 -> fp16 to nearest: most elements are exact
        assert (q_out == q_ref).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_rotary_large_positions_and_int32(dtype):
    """Late positions (angles of thousands of radians, where fp32 matters) and int32 positions.

    Kernel and reference both form the angle as float(position) * inv_freq in fp32, so they agree as
    closely there as at position 0; int32 and int64 positions give the same bits.
    """
    N, H, H_kv, D = 3, 4, 2, 64
    q, k = qkv_views(N, H, H_kv, D, dtype, seed=5)
    positions = torch.tensor([5000, 32767, 131071], device=DEVICE)
    inv_freq = inverse_frequencies(D, theta=500000.0)
    q_out, k_out = fused_rotary(q, k, positions, inv_freq)
    q_ref, k_ref = fused_rotary_reference(q, k, positions, inv_freq)
    assert_within_ulps(q_out, q_ref, rotary_scale(q, positions, inv_freq), dtype, "q at late positions")
    assert_within_ulps(k_out, k_ref, rotary_scale(k, positions, inv_freq), dtype, "k at late positions")
    q32, k32 = fused_rotary(q, k, positions.int(), inv_freq)
    assert torch.equal(q32, q_out) and torch.equal(k32, k_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_rotary_writes_the_paged_cache(dtype):
    """With `cache`, the launch writes each token's rotated keys and its values to its slot of the layer's pools,
    as the unfused path (rotary, then `store_kv`) writes them, and leaves every other slot as it was."""
    from minillm.engine.kv_cache import store_kv

    N, H, H_kv, D, blocks, block_size = 3, 4, 2, 16, 4, 4
    q, k = qkv_views(N, H, H_kv, D, dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    v = torch.randn(N, H_kv, D, generator=g).to(DEVICE, dtype)
    positions, inv_freq = torch.tensor([5, 0, 13], device=DEVICE), inverse_frequencies(D)
    slots = torch.tensor([9, 2, 14], device=DEVICE)  # scattered over the pool's 16 slots
    pools = [torch.randn(blocks, block_size, H_kv, D, generator=g).to(DEVICE, dtype) for _ in range(2)]
    expected = [p.clone() for p in pools]
    q_ref, k_rotated = fused_rotary(q, k, positions, inv_freq)  # the unfused path: rotary, then the writes
    store_kv(expected[0], None, slots, k_rotated)
    store_kv(expected[1], None, slots, v)
    q_out, k_out = fused_rotary(q, k, positions, inv_freq, cache=(v, *pools, slots))
    assert k_out is None
    assert torch.equal(q_out, q_ref)
    assert torch.equal(pools[0], expected[0]) and torch.equal(pools[1], expected[1])
    with pytest.raises(ValueError, match="pools must be contiguous"):
        fused_rotary(q, k, positions, inv_freq, cache=(v, pools[0].to(torch.float16), pools[1], slots))


def test_fused_rotary_other_strides_and_empty():
    """Heads with a stride other than D, tokens after heads in memory, a non-contiguous last dim; N = 0."""
    N, H, H_kv, D = 3, 4, 2, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(N, H, 2 * D, generator=g).to(DEVICE)[:, :, D:]  # head stride 2D
    k = torch.randn(H_kv, N, D, generator=g).to(DEVICE).transpose(0, 1)  # token stride D, head stride N D
    positions, inv_freq = torch.tensor([3, 9, 27], device=DEVICE), inverse_frequencies(D)
    refs = fused_rotary_reference(q, k, positions, inv_freq)
    for got, ref, x in zip(fused_rotary(q, k, positions, inv_freq), refs, (q, k)):
        assert_within_ulps(got, ref, rotary_scale(x, positions, inv_freq), torch.float32, "strided")
    k_cols = torch.randn(N, H_kv, D, generator=g).to(DEVICE).transpose(1, 2).contiguous().transpose(1, 2)
    assert k_cols.stride(-1) != 1  # copied first, then rotated
    got = fused_rotary(q, k_cols, positions, inv_freq)[1]
    ref = fused_rotary_reference(q, k_cols, positions, inv_freq)[1]
    assert_within_ulps(got, ref, rotary_scale(k_cols, positions, inv_freq), torch.float32, "last dim strided")
    empty_q, empty_k = fused_rotary(q[:0], k[:0], positions[:0], inv_freq)
    assert empty_q.shape == (0, H, D) and empty_k.shape == (0, H_kv, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_rotary_reference_is_the_models_rotary(dtype):
    """The reference gives, bit for bit, what RotaryEmbedding's tables and apply_rotary give in the model."""
    config = ModelConfig(dim=64, n_heads=4, n_kv_heads=2, rope_scaling={"rope_type": "linear", "factor": 2.0})
    B, T, D = 2, 3, config.head_dim
    rotary = RotaryEmbedding(config).to(DEVICE)
    positions = torch.tensor([[0, 1, 2], [40, 41, 42]], device=DEVICE)
    cos, sin = rotary(positions, dtype)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, config.n_heads, T, D, generator=g).to(DEVICE, dtype)  # the model's [B, heads, T, D]
    k = torch.randn(B, config.n_kv_heads, T, D, generator=g).to(DEVICE, dtype)

    def tokens(x):  # [B, heads, T, D] -> [B T, heads, D]
        return x.transpose(1, 2).reshape(B * T, x.shape[1], D)

    q_ref, k_ref = fused_rotary_reference(tokens(q), tokens(k), positions.reshape(-1), rotary.inv_freq)
    assert torch.equal(q_ref, tokens(apply_rotary(q, cos, sin)))
    assert torch.equal(k_ref, tokens(apply_rotary(k, cos, sin)))


def test_fused_rotary_rejects_bad_inputs(monkeypatch):
    """Wrong shapes, an odd head dim, wrong dtypes and mixed devices raise ValueErrors that say which."""
    q, k = qkv_views(2, 4, 2, 16, torch.float32)
    positions, inv_freq = torch.tensor([0, 1], device=DEVICE), inverse_frequencies(16)
    cases = [
        ((q[0], k, positions, inv_freq), "q must be \\[N, H, D\\]"),
        ((q, k[:1], positions, inv_freq), "agree on N"),
        ((q, k[..., :8], positions, inv_freq), "agree on N"),
        ((q[..., :15], k[..., :15], positions, inv_freq[:7]), "must be even"),
        ((q, k, positions[:1], inv_freq), "positions must be \\[N\\]"),
        ((q, k, positions.float(), inv_freq), "int32 or int64"),
        ((q, k, positions, inv_freq[:4]), "inv_freq must be \\[D/2\\] = \\[8\\]"),
        ((q, k, positions, inv_freq.to(torch.bfloat16)), "inv_freq must be float32"),
        ((q, k.double(), positions, inv_freq), "one dtype"),
        ((q.half(), k.half().bfloat16(), positions, inv_freq), "one dtype"),
        ((q.int(), k.int(), positions, inv_freq), "one dtype"),
        ((q, k, torch.empty(2, dtype=torch.int64, device="meta"), inv_freq), "one device"),
        ((q, k, positions, None), "torch tensors"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            fused_rotary(*args)
    if not CUDA:  # CPU tensors without the interpreter: the error says what to do
        monkeypatch.setattr(ROTARY, "_interpreted", lambda: False)
        with pytest.raises(ValueError, match="needs CUDA tensors.*fused_rotary_reference"):
            fused_rotary(q, k, positions, inv_freq)


# gate_up shapes [..., 2F]: one row, ragged F, a 3-d batch, F past one 1024-column block
SWIGLU_SHAPES = [(1, 32), (3, 200), (2, 3, 80), (2, 3000)]


def silu_mul_scale(gate_up):
    """|silu(gate) * up| in fp32: the size of the product each output element rounds."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).abs()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=str)
def test_silu_and_mul_matches_reference(shape, dtype):
    """silu(gate) * up in one kernel, rounded as F.silu then the multiply round."""
    g = torch.Generator().manual_seed(sum(shape))
    gate_up = (2 * torch.randn(shape, generator=g)).to(DEVICE, dtype)
    got, ref = silu_and_mul(gate_up), silu_and_mul_reference(gate_up)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.is_contiguous()
    # two roundings (silu, then the product): in ulps of the product, as many as either may differ by
    assert_within_ulps(got, ref, silu_mul_scale(gate_up), dtype, "silu(gate) * up", ulps=2 * ULPS[dtype])
    if dtype == torch.float16 and not CUDA:  # NumPy rounds fp32 -> fp16 to nearest: most elements are exact
        assert (got == ref).float().mean() > 0.99


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # NumPy's, under the interpreter
def test_silu_and_mul_strided_rows_extremes_and_the_models_mlp():
    """Rows sliced from a wider matrix, a transposed (copied) input, large |gate|; the reference is MLP's."""
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(5, 300, generator=g).to(DEVICE)
    gate_up = wide[:, 50:250]  # row stride 300
    got, ref = silu_and_mul(gate_up), silu_and_mul_reference(gate_up)
    assert_within_ulps(got, ref, silu_mul_scale(gate_up), torch.float32, "strided rows", ulps=8)
    transposed = wide.t()[:40]  # [40, 5]: an odd width
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(transposed)
    transposed = wide.t()[:40, :4]  # last dim stride 300: copied first
    assert_within_ulps(silu_and_mul(transposed), silu_and_mul_reference(transposed),
                       silu_mul_scale(transposed), torch.float32, "transposed", ulps=8)
    extremes = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0, 1.0, 1.0, 1.0, 1.0, 1.0]], device=DEVICE)
    got, ref = silu_and_mul(extremes), silu_and_mul_reference(extremes)  # exp(-g) overflows to inf for g = -100
    assert torch.isfinite(got).all() and got[0, 0] == 0 and got[0, 4] == 100  # silu(-100) = 0, silu(100) = 100
    assert_within_ulps(got, ref, silu_mul_scale(extremes), torch.float32, "extremes", ulps=8)

    config = ModelConfig(dim=32, n_heads=2, ffn_dim=48)
    torch.manual_seed(0)
    mlp = MLP(config).to(DEVICE)
    x = torch.randn(2, 3, config.dim, generator=g).to(DEVICE)
    with torch.no_grad():
        assert torch.equal(mlp.down_proj(silu_and_mul_reference(mlp.gate_up_proj(x))), mlp(x))


def test_silu_and_mul_rejects_bad_inputs(monkeypatch):
    """An odd or empty width, a 0-d tensor, an integer dtype raise ValueErrors that say which."""
    x = torch.randn(2, 8, device=DEVICE)
    for bad, message in [(x[:, :7], "even"), (x[:, :0], "even"), (x[0, 0], "\\[..., 2F\\]"),
                         (x.int(), "float16, bfloat16 or float32"), (x.tolist(), "torch tensor")]:
        with pytest.raises(ValueError, match=message):
            silu_and_mul(bad)
    assert silu_and_mul(x[:0]).shape == (0, 4)
    if not CUDA:
        monkeypatch.setattr(SWIGLU, "_interpreted", lambda: False)
        with pytest.raises(ValueError, match="needs a CUDA tensor.*silu_and_mul_reference"):
            silu_and_mul(x)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fused_kernels_at_decode_sizes_on_cuda(dtype):
    """Llama-8B-like decode shapes on a GPU: bf16 and fp16 agree with PyTorch to the last bit, or nearly."""
    N, H, H_kv, D = 16, 32, 8, 128
    q, k = qkv_views(N, H, H_kv, D, dtype, seed=1)
    positions = torch.randint(0, 131072, (N,), device=DEVICE)
    inv_freq = inverse_frequencies(D, theta=500000.0)
    refs = fused_rotary_reference(q, k, positions, inv_freq)
    for got, ref, x in zip(fused_rotary(q, k, positions, inv_freq), refs, (q, k)):
        assert (got == ref).float().mean() > 0.999
        assert_within_ulps(got, ref, rotary_scale(x, positions, inv_freq), dtype, "rotary")
    gate_up = torch.randn(N, 2 * 14336, device=DEVICE).to(dtype)
    got, ref = silu_and_mul(gate_up), silu_and_mul_reference(gate_up)
    assert (got == ref).float().mean() > 0.999
    assert_within_ulps(got, ref, silu_mul_scale(gate_up), dtype, "silu_and_mul", ulps=1)


def assert_matvec_close(got, x, weight, bias, swiglu, dtype, what):
    """got against W h + b computed in float64 from h = x (or silu_and_mul_reference(x), rounded as the
    layer rounds it): within 2 ulps of the dtype of |y| (the one rounding of the output; the interpreter
    rounds bf16 toward zero), plus fp32 summation error and, for swiglu under the interpreter, an ulp of
    each hidden value (its bf16 rounding may differ), both relative to sum |w h|. A wrong row, column,
    stride or half of gate_up is off by about sum |w h| itself."""
    h = silu_and_mul_reference(x) if swiglu else x
    h64, w64 = h.double().reshape(-1), weight.double()
    y = w64 @ h64 + (0 if bias is None else bias.double())
    size = w64.abs() @ h64.abs()
    hidden_ulps = EPS[dtype] if swiglu and not CUDA else 0.0
    bound = 2 * EPS[dtype] * y.abs() + (weight.shape[1] * 2.0**-22 + hidden_ulps) * size + 1e-30
    assert got.dtype == dtype and got.shape == (*x.shape[:-1], weight.shape[0]), what
    worst = ((got.double().reshape(-1) - y).abs() / bound).max().item()
    assert worst <= 1.0, f"{what}: an error of {worst:.2f} times the bound for {dtype}"


# (N, K): masked tails in both (7 x 100), one program's 4 rows, the 2048-wide steps of 2 warps, several steps
MATVEC_SHAPES = [(7, 100), (4, 512), (12, 2048), (20, 4096)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", MATVEC_SHAPES, ids=str)
def test_matvec_matches_reference(shape, dtype):
    """One row times a [N, K] weight, with and without bias and the SwiGLU prologue, as F.linear computes it."""
    N, K = shape
    g = torch.Generator().manual_seed(N * K)
    weight = (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE, dtype)
    bias = torch.randn(N, generator=g).to(DEVICE, dtype)
    x = torch.randn(1, 1, K, generator=g).to(DEVICE, dtype)
    assert_matvec_close(matvec(x, weight), x, weight, None, False, dtype, "plain")
    assert_matvec_close(matvec(x, weight, bias), x, weight, bias, False, dtype, "with bias")
    gate_up = (2 * torch.randn(1, 2 * K, generator=g)).to(DEVICE, dtype)
    got = matvec(gate_up, weight, swiglu=True)
    assert_matvec_close(got, gate_up, weight, None, True, dtype, "swiglu")
    ref = matvec_reference(gate_up, weight, swiglu=True)
    assert got.shape == ref.shape == (1, N)


def test_matvec_strided_weight_tiles_and_a_layer():
    """A weight sliced from a wider matrix (row stride > K) and a transposed one (copied), tiles other than the
    default; and `minillm.model.linear` taking the kernel only for one row of a plain 16-bit nn.Linear."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(24, 300, generator=g).to(DEVICE)
    x = torch.randn(256, generator=g).to(DEVICE)
    assert_matvec_close(matvec(x, wide[:, 20:276]), x, wide[:, 20:276], None, False, torch.float32, "row stride")
    square = wide[:, :24]
    assert_matvec_close(matvec(x[:24], square.t()), x[:24], square.t(), None, False, torch.float32, "transposed")
    for block_n, num_warps in [(1, 1), (8, 4), (16, 1)]:
        got = matvec(x, wide[:, :256], block_n=block_n, num_warps=num_warps)
        assert_matvec_close(got, x, wide[:, :256], None, False, torch.float32, f"tile {block_n} x {num_warps}")


def test_linear_takes_the_kernel_for_one_row_only(monkeypatch):
    """`linear` (the fused path's layer call): the kernel for one 16-bit row of a plain nn.Linear without hooks
    and not with MINILLM_MATVEC=0; several rows, fp32, a subclass or a hooked layer run the layer as written."""
    calls = []
    kernels = sys.modules["minillm.kernels"]
    monkeypatch.setattr(kernels, "matvec", lambda *a, **k: calls.append(k) or matvec(*a, **k))
    monkeypatch.setattr(model_module, "use_fused_kernels", lambda x: True)  # as on a GPU
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 24, bias=True).to(DEVICE, torch.float16)
    one, three = torch.randn(1, 1, 64).to(DEVICE, torch.float16), torch.randn(1, 3, 64).to(DEVICE, torch.float16)
    with torch.no_grad():
        assert_matvec_close(model_module.linear(layer, one), one, layer.weight, layer.bias, False,
                            torch.float16, "linear, one row")
        assert len(calls) == 1
        for x, module, why in [(three, layer, "3 rows"), (one.float(), torch.nn.Linear(64, 24).to(DEVICE), "fp32"),
                               (one, type("Sub", (torch.nn.Linear,), {})(64, 24).to(DEVICE, torch.float16), "sub")]:
            assert torch.equal(model_module.linear(module, x), module(x)), why
        handle = layer.register_forward_hook(lambda m, i, o: o * 2)
        assert torch.equal(model_module.linear(layer, one), layer(one))
        handle.remove()
        monkeypatch.setenv("MINILLM_MATVEC", "0")
        assert torch.equal(model_module.linear(layer, one), layer(one))
    assert len(calls) == 1


def test_matvec_rejects_bad_inputs(monkeypatch):
    """Several rows, a width that does not match, mixed dtypes and a CPU tensor without the interpreter raise
    ValueErrors that say what to do."""
    weight, x = torch.randn(8, 16, device=DEVICE), torch.randn(1, 16, device=DEVICE)
    for args, kwargs, message in [((torch.randn(2, 16, device=DEVICE), weight), {}, "one row.*F.linear"),
                                  ((x[:, :15], weight), {}, "\\[..., 16\\]"),
                                  ((x, weight), {"swiglu": True}, "\\[..., 32\\].*gate then up"),
                                  ((x.half(), weight), {}, "share one dtype"),
                                  ((x, weight[0]), {}, "weight \\[N, K\\]")]:
        with pytest.raises(ValueError, match=message):
            matvec(*args, **kwargs)
    if not CUDA:
        monkeypatch.setattr(MATVEC, "_interpreted", lambda: False)
        with pytest.raises(ValueError, match="needs CUDA tensors.*matvec_reference"):
            matvec(x, weight)


def test_pdl_is_asked_for_on_cuda_only_and_can_be_turned_off(monkeypatch):
    """kernels/pdl.py: no programmatic dependent launch for CPU tensors (the interpreter) or with MINILLM_PDL=0, even
    inside `launches()`, and the launch keyword only when asked for. (On a GPU, tests/engine/test_cuda_graphs.py checks
    that only graphs use it, and the logits with and without.)"""
    pdl = sys.modules["minillm.kernels.pdl"]
    with pdl.launches():
        assert not pdl.use_pdl(torch.zeros(2)), "CPU tensors: never"
        with pdl.launches():
            pass
        if CUDA:
            monkeypatch.setenv("MINILLM_PDL", "0")
            assert not pdl.use_pdl(torch.zeros(2, device="cuda"))
    assert pdl._state.depth == 0, "launches() undoes itself, nested too"
    assert pdl.launch_options(True) == {"launch_pdl": True} and pdl.launch_options(False) == {}


@cuda_only
@pytest.mark.parametrize("shape", [(3072, 2048), (2048, 8192), (6144, 4096), (128256, 2048)], ids=str)
def test_matvec_at_llama_shapes_on_cuda(shape):
    """Llama-3.2-1B and 8B projections (and the 1B head) in bf16 on a GPU, plain and with SwiGLU."""
    N, K = shape
    weight = (torch.randn(N, K, device=DEVICE) / K**0.5).bfloat16()
    x = torch.randn(1, 1, K, device=DEVICE).bfloat16()
    assert_matvec_close(matvec(x, weight), x, weight, None, False, torch.bfloat16, "plain")
    gate_up = torch.randn(1, 1, 2 * K, device=DEVICE).bfloat16()
    assert_matvec_close(matvec(gate_up, weight, swiglu=True), gate_up, weight, None, True, torch.bfloat16, "swiglu")


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")  # NumPy's -inf - -inf, interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_greedy_argmax_match_argmax_and_log_softmax(dtype):
    """Each row's argmax (the first of equal maxima, even across chunks) and log_softmax at it; a vocabulary that
    is not a multiple of the chunk; masked (-inf) logits; a row whose maximum sits in the last, partial chunk."""
    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(5, 1000, generator=g)).to(DEVICE, dtype)
    logits[0, 700] = logits[0, 100] = 20.0  # a tie in two chunks: the first wins
    logits[1, 640:] = float("-inf")
    logits[2, 999] = 30.0  # in the partial last chunk
    logits[3, 128] = logits[3, 129] = 25.0  # a tie within one chunk
    tokens, logprobs = greedy_argmax(logits, block=128)
    ref_tokens, ref_logprobs = greedy_reference(logits)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert tokens.tolist() == ref_tokens.tolist() and tokens[0] == 100 and tokens[2] == 999 and tokens[3] == 128
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)
    one, one_lp = greedy_argmax(logits[4:5])  # the default chunk: one partial chunk of the 1,000
    assert one.tolist() == ref_tokens[4:5].tolist()
    torch.testing.assert_close(one_lp, ref_logprobs[4:5], rtol=1e-5, atol=1e-5)


def test_greedy_argmax_rejects_bad_inputs(monkeypatch):
    """A 1-d or empty vocabulary, integer logits, a CPU tensor without the interpreter: errors that say what to do."""
    x = torch.randn(2, 8, device=DEVICE)
    for bad, message in [(x[0], "\\[B, V\\]"), (x[:, :0], "V >= 1"), (x.int(), "float16, bfloat16 or float32")]:
        with pytest.raises(ValueError, match=message):
            greedy_argmax(bad)
    if not CUDA:
        monkeypatch.setattr(GREEDY, "_interpreted", lambda: False)
        with pytest.raises(ValueError, match="needs a CUDA tensor.*greedy_reference"):
            greedy_argmax(x)


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")
def test_the_engine_samples_plain_greedy_steps_through_the_kernels(monkeypatch):
    """`ModelRunner.sample`: a step of plain greedy rows gives the same tokens and log-probabilities through the
    kernels as through PyTorch; a penalty, top log-probabilities, a constraint or a sampled row keep PyTorch."""
    from types import SimpleNamespace

    from minillm.engine import model_runner
    from minillm.sampler.sampling import SamplingParams

    def seq(**params):
        return SimpleNamespace(params=SamplingParams(**params), constraint=None, generator=None,
                               prompt_token_ids=[1, 2], output_token_ids=[3])

    g = torch.Generator().manual_seed(2)
    logits = (3 * torch.randn(3, 3000, generator=g)).to(DEVICE, torch.bfloat16)
    seqs = [seq(temperature=0), seq(temperature=0, logprobs=0), seq(temperature=0, top_k=5)]
    monkeypatch.setattr(model_module, "_triton_kernels_run", lambda x: True)  # as on a GPU
    assert model_runner.plain_greedy(seqs, logits)
    for other in [seq(temperature=0, repetition_penalty=1.2), seq(temperature=0, logprobs=2), seq(temperature=0.8),
                  seq(temperature=0, presence_penalty=0.5)]:
        assert not model_runner.plain_greedy([*seqs[:2], other], logits)
    constrained = seq(temperature=0)
    constrained.constraint = object()
    assert not model_runner.plain_greedy([constrained], logits)
    runner = SimpleNamespace(_constrain=model_runner.ModelRunner._constrain)  # sample() needs nothing else
    fast = list(model_runner.ModelRunner.sample(runner, seqs, logits).read())
    monkeypatch.setattr(model_module, "_triton_kernels_run", lambda x: False)  # PyTorch, as before
    slow = list(model_runner.ModelRunner.sample(runner, seqs, logits).read())
    assert [r.token_ids for r in fast] == [r.token_ids for r in slow]
    for f, s in zip(fast, slow):
        assert f.logprobs == pytest.approx(s.logprobs, abs=1e-5) and f.top_logprobs == s.top_logprobs == [{}]


@cuda_only
def test_greedy_argmax_at_llama3s_vocabulary_on_cuda():
    """128,256 bf16 logits at batch 1 and 64: argmax exactly, log-probabilities to fp32 rounding."""
    for batch in (1, 64):
        logits = (4 * torch.randn(batch, 128256, device=DEVICE)).bfloat16()
        tokens, logprobs = greedy_argmax(logits)
        ref_tokens, ref_logprobs = greedy_reference(logits)
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)
