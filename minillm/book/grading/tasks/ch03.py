"""Chapter 03's exercise tasks: grouped-query attention without copying K/V, mean-pooling K/V heads
(MHA -> GQA), MLA's cache against GQA's, and how many sequences each KV-head count fits.

The attention is checked against attention with K/V copied per query head and against minillm's
`grouped_query_attention`, and from the inside, by a probe that watches what is done to K and V;
the pooling against `minillm.train.gqa`; the sizes against `minillm.arithmetic`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

from minillm import arithmetic
from minillm.arithmetic import MLAConfig
from minillm.book.grading.probes import watch_config, watch_kv_copies
from minillm.book.grading.registry import MismatchError, call_probed, expect_close, expect_equal, register_task
from minillm.checkpoints import to_checkpoint_names
from minillm.config import ModelConfig
from minillm.model import Transformer, grouped_query_attention

# ---- 03.group_query_heads ---------------------------------------------------------------------------


def reference_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √D) v where each group of G = H / H_kv query heads shares one K/V head, K/V never copied.

    q [B, H, T, D], k and v [B, H_kv, S, D] -> [B, H, T, D]. Not causal: every query sees all S keys
    (a decode step, or queries that come after the whole cache). Query head h uses K/V head h // G:
    the G heads of a group are consecutive, so q.reshape(B, H_kv, G*T, D) stacks each group's queries
    along the query axis, and each K/V head is attended to once, as it is.
    """
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    scores = q.reshape(B, H_kv, G * T, D) @ k.transpose(-1, -2) * D**-0.5  # [B, H_kv, G*T, S]
    return (scores.softmax(dim=-1) @ v).reshape(B, H, T, D)


group_query_heads = register_task(
    "03.group_query_heads",
    "gqa_attention(q: Tensor[B, H, T, D], k: Tensor[B, H_kv, S, D], v: Tensor[B, H_kv, S, D]) -> Tensor[B, H, T, D]"
    "  (not causal; K and V not copied per query head)",
    reference=reference_gqa_attention,
    forbid=("minillm.model.grouped_query_attention", "minillm.model.Attention",
            "torch.nn.functional.scaled_dot_product_attention",
            "minillm.kernels.flash_attention.flash_attention", "minillm.kernels.flash_attention.attention_reference",
            "minillm.kernels.decode_attention.decode_attention",
            "minillm.kernels.decode_attention.decode_attention_reference"),
)


def _attention_by_copy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mapping: str = "h // G",
                       scale: float | None = None) -> torch.Tensor:
    """The definition, in float64, with K/V copied per query head (the grader's, not an answer):
    query head h uses K/V head h // G ("h // G") or, the classic mistake, h % H_kv ("h % H_kv")."""
    H, H_kv, D = q.shape[1], k.shape[1], q.shape[-1]
    heads = torch.arange(H) // (H // H_kv) if mapping == "h // G" else torch.arange(H) % H_kv
    kh, vh = k.double()[:, heads], v.double()[:, heads]  # [B, H, S, D]
    scores = q.double() @ kh.transpose(-1, -2) * (D**-0.5 if scale is None else scale)
    return (scores.softmax(dim=-1) @ vh).to(q.dtype)


_GQA_HOW = ("group the G = H / H_kv query heads of each KV head: q.reshape(B, H_kv, G*T, D), scores = "
            "q @ k.transpose(-1, -2) / sqrt(D), softmax over the keys (last axis), @ v, then reshape back to "
            "[B, H, T, D].")


def _gqa_hint(got: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """Name the mistake: the h % H_kv head mapping, a missing or wrong scale; else how to do it."""
    if not isinstance(got, torch.Tensor) or got.shape != q.shape:
        return "return one output per query head: shape [B, H, T, D], the shape of q. " + _GQA_HOW
    got = got.detach().double()
    if k.shape[1] not in (1, q.shape[1]) and torch.allclose(got, _attention_by_copy(q, k, v, "h % H_kv").double(),
                                                           atol=1e-4, rtol=1e-4):
        return ("query head h must read KV head h // G (the G heads of a group are consecutive: heads 0..G-1 share "
                "KV head 0), but yours reads KV head h % H_kv. Reshape q to [B, H_kv, G, T, D] (or "
                "[B, H_kv, G*T, D]), not [B, G, H_kv, T, D]; and k.repeat tiles the heads where repeat_interleave "
                "would have copied them in order.")
    for scale in (1.0, 1.0 / q.shape[-1]):
        if torch.allclose(got, _attention_by_copy(q, k, v, scale=scale).double(), atol=1e-4, rtol=1e-4):
            return "scale the scores by 1 / sqrt(D), D = head_dim = q.shape[-1], before the softmax."
    return _GQA_HOW


def _check_gqa(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str) -> None:
    got = fn(q.clone(), k.clone(), v.clone())
    expect_close(got, _attention_by_copy(q, k, v), what, _gqa_hint(got, q, k, v), atol=1e-5, rtol=1e-4)


def _qkv(seed: int, b: int, h: int, h_kv: int, t: int, s: int, d: int) -> tuple[torch.Tensor, ...]:
    """Random q [b, h, t, d], k and v [b, h_kv, s, d]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, t, d, generator=g), torch.randn(b, h_kv, s, d, generator=g),
            torch.randn(b, h_kv, s, d, generator=g))


@group_query_heads.test("MHA (4 query heads, 4 KV heads) is plain multi-head attention")
def _(fn: Callable) -> None:
    q, k, v = _qkv(30, 2, 4, 4, 3, 6, 8)
    _check_gqa(fn, q, k, v, "gqa_attention(q[2,4,3,8], k[2,4,6,8], v[2,4,6,8])")


@group_query_heads.test("GQA (8 query heads, 2 KV heads) matches repeat_interleave and minillm's attention")
def _(fn: Callable) -> None:
    q, k, v = _qkv(31, 2, 8, 2, 5, 9, 16)
    what = "gqa_attention(q[2,8,5,16], k[2,2,9,16], v[2,2,9,16])"
    _check_gqa(fn, q, k, v, what)
    got = fn(q.clone(), k.clone(), v.clone())
    expect_close(got, grouped_query_attention(q, k, v, None), what + " vs minillm.model.grouped_query_attention",
                 _GQA_HOW, atol=1e-5, rtol=1e-4)


@group_query_heads.test("MQA decode step: one query position, 6 query heads share 1 KV head")
def _(fn: Callable) -> None:
    q, k, v = _qkv(32, 3, 6, 1, 1, 11, 8)
    _check_gqa(fn, q, k, v, "gqa_attention(q[3,6,1,8], k[3,1,11,8], v[3,1,11,8])")


@group_query_heads.test("query head h reads KV head h // G (3 KV heads with very different values, G = 2)")
def _(fn: Callable) -> None:
    q, k, v = _qkv(33, 1, 6, 3, 2, 5, 8)
    v = v * 0.01 + torch.tensor([0.0, 10.0, 20.0])[None, :, None, None]  # KV head j's values are all near 10 j
    _check_gqa(fn, q, k, v, "gqa_attention(q[1,6,2,8], k[1,3,5,8], v[1,3,5,8] with head j's values near 10 j)")


_NO_COPY = ("group the queries instead of copying K and V: q.reshape(B, H_kv, G*T, D) puts the G query heads "
            "of each KV head side by side, so q @ k.transpose(-1, -2) reads each KV head once, as it is. "
            "repeat_interleave (or expand + reshape, cat, index_select) makes G copies of the cache: exactly the "
            "memory traffic GQA exists to save.")


@group_query_heads.test("K and V are not copied per query head (no repeat_interleave, repeat, expand + reshape, cat)")
def _(fn: Callable) -> None:
    q, k, v = _qkv(34, 2, 8, 2, 2, 16, 8)
    got, ops, copies = call_probed(fn, watch_kv_copies, q, k, v)
    expect_close(got, _attention_by_copy(q, k, v), "gqa_attention(q[2,8,2,8], k[2,2,16,8], v[2,2,16,8])",
                 _gqa_hint(got, q, k, v), atol=1e-5, rtol=1e-4)
    if copies:
        raise MismatchError("ops that copied K or V into a larger tensor", "none (each KV head read as it is)",
                            ", ".join(copies), _NO_COPY)


# ---- 03.mean_pool_kv --------------------------------------------------------------------------------


def reference_mean_pool_kv(w: torch.Tensor, n_kv_heads: int, new_kv_heads: int) -> torch.Tensor:
    """Pool a K (or V) projection's heads into `new_kv_heads`, each the mean of r = n_kv_heads / new_kv_heads
    consecutive heads.

    w [n_kv_heads * head_dim, dim] (a weight) or [n_kv_heads * head_dim] (a bias); head j is rows
    j*head_dim .. (j+1)*head_dim - 1. Returns [new_kv_heads * head_dim, ...] in w's dtype (averaged in fp32).
    """
    head_dim, r = w.shape[0] // n_kv_heads, n_kv_heads // new_kv_heads
    groups = w.float().reshape(new_kv_heads, r, head_dim, *w.shape[1:])  # [new, r, head_dim, (dim)]
    return groups.mean(dim=1).reshape(new_kv_heads * head_dim, *w.shape[1:]).to(w.dtype)


mean_pool_kv = register_task(
    "03.mean_pool_kv",
    "mean_pool_kv(w: Tensor[n_kv_heads*head_dim, dim] or Tensor[n_kv_heads*head_dim], n_kv_heads: int, "
    "new_kv_heads: int) -> Tensor[new_kv_heads*head_dim, ...]",
    reference=reference_mean_pool_kv,
    forbid=("minillm.train.gqa.pool_heads", "minillm.train.gqa.convert_kv_heads"),
)


def _gqa() -> ModuleType:
    """minillm.train.gqa, imported on first use: it imports minillm.train.loop, whose `tqdm.auto` warns "IProgress not
    found" at import, and that warning would land in the first `check` cell of every chapter's notebook."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        from minillm.train import gqa
    return gqa


def _pool_expected(w: torch.Tensor, n: int, new: int) -> torch.Tensor:
    return _gqa().pool_heads(w.reshape(n, w.shape[0] // n, *w.shape[1:]), new).reshape(-1, *w.shape[1:])


def _pool_hint(got: object, w: torch.Tensor, n: int, new: int) -> str:
    head_dim, r = w.shape[0] // n, n // new
    want = (new * head_dim, *w.shape[1:])
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != want:
        return (f"keep head_dim = {head_dim} rows per head: {new} head(s) make a tensor of shape {want}. Split the "
                "rows by head (reshape to [n_kv_heads, head_dim, ...]) and average whole heads, not rows.")
    heads = w.double().reshape(n, head_dim, *w.shape[1:])
    got = got.detach().double()
    expected = heads.reshape(new, r, *heads.shape[1:]).mean(1).reshape(want)
    strided = heads.reshape(r, new, *heads.shape[1:]).mean(0).reshape(want)
    first = heads.reshape(new, r, *heads.shape[1:])[:, 0].reshape(want)

    tol = 1e-3 if w.dtype in (torch.float32, torch.float64) else 3e-2  # bf16 / fp16 round to ~3 digits

    def near(x: torch.Tensor) -> bool:
        return torch.allclose(got, x, atol=tol, rtol=tol)

    if r > 1 and near(strided):
        return (f"pool CONSECUTIVE heads: new head i is the mean of old heads i*r .. i*r + r - 1 (r = {r}), because "
                "query head h reads KV head h // G and the G query heads of a group are consecutive. You pooled "
                f"heads i, i + {new}, i + {2 * new}, ... (strided): reshape to [new_kv_heads, r, head_dim, ...] and "
                "average over the r axis, not [r, new_kv_heads, ...].")
    if r > 1 and near(expected * r):
        return "average, do not sum: divide by r = n_kv_heads / new_kv_heads, so the pooled head stays on the scale " \
               "of the heads it replaces."
    if r > 1 and near(first):
        return ("average every head of the group: keeping one head (the first) throws the others away. Ainslie et "
                "al. (2023) found mean-pooling the group better than picking a head.")
    return ("split the rows by head, [n_kv_heads, head_dim, ...] -> [new_kv_heads, r, head_dim, ...], average over "
            "r, and merge back to [new_kv_heads * head_dim, ...].")


def _check_pool(fn: Callable, w: torch.Tensor, n: int, new: int, what: str, atol: float = 1e-6) -> None:
    got = fn(w.clone(), n, new)
    expected = _pool_expected(w, n, new)
    hint = _pool_hint(got, w, n, new)
    if isinstance(got, torch.Tensor) and got.dtype != w.dtype:
        hint = f"return the weight's dtype ({w.dtype}): average in float32 if you like, then .to(w.dtype)."
    expect_close(got, expected, what, hint, atol=atol, rtol=atol)


@mean_pool_kv.test("8 K heads of 4 rows into 2: each new head the mean of 4 consecutive heads (weight [32, 24])")
def _(fn: Callable) -> None:
    w = torch.randn(32, 24, generator=torch.Generator().manual_seed(40))
    _check_pool(fn, w, 8, 2, "mean_pool_kv(w[32, 24], 8, 2)")


@mean_pool_kv.test("consecutive heads, not strided: 6 heads whose rows hold 0..5 pooled into 2 give 1 and 4")
def _(fn: Callable) -> None:
    w = torch.arange(6.0).repeat_interleave(3)[:, None].expand(18, 5).contiguous()  # head j's rows are all j
    _check_pool(fn, w, 6, 2, "mean_pool_kv(head j's rows = j, 6 heads of 3 rows, into 2)")


@mean_pool_kv.test("a bias vector (Qwen2's k and v biases) pools the same way: [6*5] -> [3*5]")
def _(fn: Callable) -> None:
    b = torch.randn(30, generator=torch.Generator().manual_seed(41))
    _check_pool(fn, b, 6, 3, "mean_pool_kv(bias[30], 6, 3)")


@mean_pool_kv.test("groups of one (new_kv_heads = n_kv_heads) return the weight unchanged")
def _(fn: Callable) -> None:
    w = torch.randn(12, 10, generator=torch.Generator().manual_seed(42))
    _check_pool(fn, w, 4, 4, "mean_pool_kv(w[12, 10], 4, 4)")


@mean_pool_kv.test("MQA: new_kv_heads = 1 averages every head into one")
def _(fn: Callable) -> None:
    w = torch.randn(40, 16, generator=torch.Generator().manual_seed(43))
    _check_pool(fn, w, 5, 1, "mean_pool_kv(w[40, 16], 5, 1)")


@mean_pool_kv.test("a bf16 checkpoint stays bf16")
def _(fn: Callable) -> None:
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(44)).bfloat16()
    _check_pool(fn, w, 4, 2, "mean_pool_kv(bf16 w[16, 8], 4, 2)", atol=1e-2)


@mean_pool_kv.test("a real model's k/v weights and biases pool to minillm.train.gqa.convert_kv_heads's "
                   "(MHA 4 -> GQA 2)")
def _(fn: Callable) -> None:
    torch.manual_seed(45)
    config = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=96, vocab_size=50, qkv_bias=True)
    model = Transformer(config).eval()
    before, after = to_checkpoint_names(model), to_checkpoint_names(_gqa().convert_kv_heads(model, 2))
    for name, t in before.items():
        if ".k_proj." in name or ".v_proj." in name:
            got = fn(t.clone(), 4, 2)
            expect_close(got, after[name], f"mean_pool_kv({name} [{', '.join(map(str, t.shape))}], 4, 2)",
                         _pool_hint(got, t, 4, 2), atol=1e-6, rtol=1e-6)


# ---- 03.mla_bytes -----------------------------------------------------------------------------------


def reference_mla_vs_gqa(mla: MLAConfig, head_dim: int, dtype_bytes: float = 2) -> tuple[float, float]:
    """(MLA's KV-cache bytes per token, the KV heads of width `head_dim` a GQA model needs for the same cache).

    MLA caches per layer one latent c_KV of kv_lora_rank numbers and one RoPE key of rope_head_dim,
    both shared by every head: n_layers x (kv_lora_rank + rope_head_dim) x dtype_bytes. A GQA KV
    head caches a key and a value, 2 x head_dim numbers per layer, so the same cache holds
    (kv_lora_rank + rope_head_dim) / (2 x head_dim) KV heads (2.25 for DeepSeek-V2 at head_dim 128).
    """
    per_layer = mla.kv_lora_rank + mla.rope_head_dim
    return mla.n_layers * per_layer * dtype_bytes, per_layer / (2 * head_dim)


mla_bytes = register_task(
    "03.mla_bytes",
    "mla_vs_gqa(mla: MLAConfig, head_dim: int, dtype_bytes: float = 2) -> (bytes per token, equivalent KV heads)",
    reference=reference_mla_vs_gqa,
    forbid=("minillm.arithmetic.mla_cache_bytes_per_token",),
)


def _mla_bytes_hint(mla: MLAConfig, head_dim: int, dtype_bytes: float, got: float) -> str:
    L, r, dr, H, b = mla.n_layers, mla.kv_lora_rank, mla.rope_head_dim, mla.n_heads, dtype_bytes
    suspects = [
        (L * (r + dr) * b * H, "c_KV and the RoPE key are shared by every head: cache them once per layer, "
                               "not once per head (that sharing is the whole saving)."),
        (L * (r + H * dr) * b, "the decoupled RoPE key k^R is one vector shared by all heads (only the queries "
                               "have a RoPE part per head): rope_head_dim numbers per layer."),
        (L * (2 * r + dr) * b, "keys and values are both up-projected from the same latent c_KV: it is cached "
                               "once, not once for K and once for V."),
        (2 * L * (r + dr) * b, "keys and values are both up-projected from the same latent c_KV, and the RoPE key "
                               "is one vector: nothing is cached twice."),
        (L * r * b, "add the RoPE key: besides the latent, each layer caches rope_head_dim numbers for rotary."),
        ((r + dr) * b, "every layer caches its own latent and RoPE key: multiply by n_layers."),
        (L * (r + dr), "multiply by dtype_bytes (2 for BF16, 1 for FP8)."),
        (2 * L * H * mla.head_dim * b, "that is the MHA cache (2 x n_layers x n_heads x head_dim). MLA caches "
                                       "the latent and the RoPE key instead."),
    ]
    for value, hint in suspects:
        if math.isclose(got, value, rel_tol=1e-9):
            return hint
    return "bytes per token = n_layers x (kv_lora_rank + rope_head_dim) x dtype_bytes."


def _mla_heads_hint(mla: MLAConfig, head_dim: int, dtype_bytes: float, got: float) -> str:
    r, dr, L = mla.kv_lora_rank, mla.rope_head_dim, mla.n_layers
    suspects = [
        ((r + dr) / head_dim, "a GQA KV head caches a key AND a value: 2 x head_dim numbers per layer."),
        (r / (2 * head_dim), "count the RoPE key too: MLA caches kv_lora_rank + rope_head_dim numbers per layer."),
        ((r + dr) / (2 * mla.head_dim), "compare with KV heads of the head_dim you are given, not mla.head_dim."),
        (L * (r + dr) / (2 * head_dim), "compare per layer (or both over all layers): divide by n_layers."),
        (L * (r + dr) * dtype_bytes / (2 * head_dim), "compare numbers per layer per token: the bytes include "
                                                     "n_layers and dtype_bytes, a head's 2 x head_dim does not."),
    ]
    for value, hint in suspects:
        if math.isclose(got, value, rel_tol=1e-9):
            return hint
    return "equivalent KV heads = (kv_lora_rank + rope_head_dim) / (2 x head_dim): the cache of one GQA KV head " \
           "per layer is a key and a value of head_dim each."


def _check_mla(fn: Callable, mla: MLAConfig, head_dim: int, dtype_bytes: float, what: str) -> None:
    expected = reference_mla_vs_gqa(mla, head_dim, dtype_bytes)
    got = fn(mla, head_dim, dtype_bytes)
    if isinstance(got, list):
        got = tuple(got)
    if not isinstance(got, tuple) or len(got) != 2:
        raise MismatchError(what, "a tuple (bytes per token, equivalent KV heads)", repr(got)[:80],
                            "return two numbers: return bytes_per_token, kv_heads.")
    got = tuple(x.item() if isinstance(x, torch.Tensor) and x.numel() == 1 else x for x in got)
    for i, (g, e, name) in enumerate(zip(got, expected, ("bytes per token", "equivalent KV heads"))):
        if isinstance(g, bool) or not isinstance(g, (int, float)):
            raise MismatchError(f"{what}[{i}], {name}", f"a number ({e:g})", type(g).__name__,
                                "return Python numbers (int or float).")
        if not math.isclose(g, e, rel_tol=1e-9):
            hint = (_mla_bytes_hint if i == 0 else _mla_heads_hint)(mla, head_dim, dtype_bytes, g)
            raise MismatchError(f"{what}[{i}], {name}", f"{e:,.6g}", f"{g:,.6g}", hint)


@mla_bytes.test("DeepSeek-V2 in BF16: 69,120 bytes per token, the cache of 2.25 KV heads of 128 (the paper's figure)")
def _(fn: Callable) -> None:
    _check_mla(fn, arithmetic.MLA_PRESETS["deepseek-v2"], 128, 2, "mla_vs_gqa(DeepSeek-V2, 128, 2)")


@mla_bytes.test("DeepSeek-V3 with an FP8 cache (1 byte per number)")
def _(fn: Callable) -> None:
    _check_mla(fn, arithmetic.MLA_PRESETS["deepseek-v3"], 128, 1, "mla_vs_gqa(DeepSeek-V3, 128, 1)")


@mla_bytes.test("compared with heads of the head_dim given (64), not mla.head_dim (128), in FP32")
def _(fn: Callable) -> None:
    mla = MLAConfig("test", n_layers=7, n_heads=16, head_dim=128, kv_lora_rank=512, rope_head_dim=64)
    _check_mla(fn, mla, 64, 4, "mla_vs_gqa(7 layers, rank 512, rope 64, head_dim=64, fp32)")


@mla_bytes.test("the equivalent heads are a real GQA cache: 2 KV heads of 128 hold what rank 448 + rope 64 does")
def _(fn: Callable) -> None:
    mla = MLAConfig("test", n_layers=12, n_heads=16, head_dim=96, kv_lora_rank=448, rope_head_dim=64)
    what = "mla_vs_gqa(12 layers, rank 448, rope 64, head_dim=128)"
    _check_mla(fn, mla, 128, 2, what)
    got_bytes, heads = fn(mla, 128, 2)[:2]
    gqa_config = ModelConfig(dim=1024, n_layers=12, n_heads=16, n_kv_heads=round(heads), head_dim=128, ffn_dim=64,
                             vocab_size=10)
    expect_equal(float(got_bytes), float(arithmetic.kv_cache_bytes_per_token(gqa_config, 2)),
                 what + "'s bytes vs kv_cache_bytes_per_token(GQA with that many KV heads of 128)",
                 "the equivalent head count must give a GQA cache of the same bytes per token.")


# ---- 03.max_batch_gqa -------------------------------------------------------------------------------


def reference_max_batch_by_kv_heads(config: ModelConfig, gpu_memory_bytes: float, seq_len: int,
                                    kv_heads: list[int], weight_bits: float = 16,
                                    kv_dtype_bytes: float = 2) -> dict[int, int]:
    """{h: the largest batch of seq_len-token sequences that fits, with config converted to h KV heads}.

    The converted model is config with n_kv_heads = h: its KV cache per token shrinks, and so do its
    weights (k and v projections of h heads instead of config.n_kv_heads). 0 when the weights do not fit.
    """
    return {h: arithmetic.max_batch_size_with_kv_heads(config, h, gpu_memory_bytes, seq_len, weight_bits,
                                                    kv_dtype_bytes) for h in kv_heads}


max_batch_gqa = register_task(
    "03.max_batch_gqa",
    "max_batch_by_kv_heads(config, gpu_memory_bytes, seq_len, kv_heads: list[int], weight_bits=16, "
    "kv_dtype_bytes=2) -> dict[int, int]",
    reference=reference_max_batch_by_kv_heads,
    forbid=("minillm.arithmetic.max_batch_size", "minillm.arithmetic.max_batch_size_with_kv_heads"),
)


def _batch_hint(config: ModelConfig, memory: float, seq_len: int, h: int, got: object, expected: int,
                weight_bits: float, kv_dtype_bytes: float) -> str:
    if isinstance(got, float) and got.is_integer():
        return "return ints: a batch is a whole number of sequences (math.floor)."
    converted = dataclasses.replace(config, n_kv_heads=h)
    per_seq = arithmetic.kv_cache_bytes(converted, seq_len, 1, kv_dtype_bytes)
    old_weights = arithmetic.weight_bytes(config, weight_bits)
    if isinstance(got, int) and got == max(0, math.floor((memory - old_weights) / per_seq)) and got != expected:
        return ("the converted model's weights are smaller too: with h KV heads, k_proj and v_proj have h x head_dim "
                "rows instead of n_kv_heads x head_dim, so count param_count(config with n_kv_heads = h) weights; "
                "the freed bytes hold more sequences.")
    if isinstance(got, int) and got < 0:
        return "when the weights do not fit, no sequence does: return 0, never a negative batch."
    return ("for each h: converted = dataclasses.replace(config, n_kv_heads=h); free = memory - weight bytes of "
            "converted; batch = floor(free / KV bytes of one sequence of converted), and 0 if negative.")


def _check_batches(fn: Callable, config: ModelConfig, memory: float, seq_len: int, kv_heads: list[int],
                   weight_bits: float, kv_dtype_bytes: float, what: str) -> None:
    expected = reference_max_batch_by_kv_heads(config, memory, seq_len, kv_heads, weight_bits, kv_dtype_bytes)
    got, untouched = call_probed(fn, watch_config, copy.deepcopy(config), memory, seq_len, list(kv_heads),
                                 weight_bits, kv_dtype_bytes)
    if not isinstance(got, dict):
        raise MismatchError(what, f"a dict {{n_kv_heads: batch}} such as {expected}", type(got).__name__,
                            "return a dict keyed by the head counts asked for: {h: batch for h in kv_heads}.")
    if set(got) != set(expected):
        raise MismatchError(what + ".keys()", sorted(expected), sorted(got, key=str),
                            "one entry per head count of kv_heads, keyed by the int itself (not a string).")
    for h in kv_heads:
        hint = _batch_hint(config, memory, seq_len, h, got[h], expected[h], weight_bits, kv_dtype_bytes)
        expect_equal(got[h], expected[h], f"{what}[{h}]", hint)
    if not untouched:
        raise MismatchError(f"the config passed to {what.split('(')[0]}", "left unchanged", "modified",
                            "build a new config per head count with dataclasses.replace(config, n_kv_heads=h); "
                            "setting config.n_kv_heads changes the caller's config (and its model's).")


@max_batch_gqa.test("Llama-2-7B (32 KV heads) on 80 GB at 4,096 tokens, as MHA, GQA-8, GQA-4 and MQA")
def _(fn: Callable) -> None:
    _check_batches(fn, arithmetic.preset("llama-2-7b"), 80e9, 4096, [32, 8, 4, 1], 16, 2,
                   "max_batch_by_kv_heads(Llama-2-7B, 80e9, 4096, [32, 8, 4, 1])")


@max_batch_gqa.test("the converted weights shrink too: a 7B MHA model pooled to 2 and 1 KV heads, 40 GB, 8k context")
def _(fn: Callable) -> None:
    config = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000)
    _check_batches(fn, config, 40e9, 8192, [2, 1], 16, 2, "max_batch_by_kv_heads(7B MHA, 40e9, 8192, [2, 1])")


@max_batch_gqa.test("a GQA model pools further: Llama-3-70B, 4-bit weights, FP8 cache, 8k context, [8, 4, 2, 1]")
def _(fn: Callable) -> None:
    _check_batches(fn, arithmetic.preset("llama-3-70b"), 80e9, 8192, [8, 4, 2, 1], 4, 1,
                   "max_batch_by_kv_heads(Llama-3-70B, 80e9, 8192, [8, 4, 2, 1], weight_bits=4, kv_dtype_bytes=1)")


@max_batch_gqa.test("weights that do not fit give 0 for every head count (Llama-2-70B in BF16 on 80 GB)")
def _(fn: Callable) -> None:
    _check_batches(fn, arithmetic.preset("llama-2-70b"), 80e9, 2048, [8, 1], 16, 2,
                   "max_batch_by_kv_heads(Llama-2-70B, 80e9, 2048, [8, 1])")
