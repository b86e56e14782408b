"""Chapter 02's exercise tasks: the KV-bytes formula, a KV-cached decode loop, online-softmax
attention, and the largest batch that fits under a memory budget.

The formulas are checked against `minillm.arithmetic`; the decode loop against a loop that
recomputes the whole sequence, and by counting the tokens it pushes through the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from minillm import arithmetic
from minillm.book.grading.probes import count_embedded_positions
from minillm.book.grading.registry import MismatchError, call_probed, expect_close, expect_equal, register_task
from minillm.config import ModelConfig
from minillm.contiguous_cache import KVCache
from minillm.model import Transformer

# ---- 02.kv_bytes ------------------------------------------------------------------------------------


def reference_kv_cache_bytes(config: ModelConfig, seq_len: int, batch: int = 1, dtype_bytes: float = 2) -> float:
    """Bytes of the KV cache: 2 (K and V) x n_layers x n_kv_heads x head_dim x dtype_bytes x seq_len x batch."""
    return arithmetic.kv_cache_bytes(config, seq_len, batch, dtype_bytes)


kv_bytes = register_task(
    "02.kv_bytes",
    "kv_cache_bytes(config: ModelConfig, seq_len: int, batch: int = 1, dtype_bytes: float = 2) -> number of bytes",
    reference=reference_kv_cache_bytes,
    forbid=("minillm.arithmetic.kv_cache_bytes", "minillm.contiguous_cache.KVCache.nbytes"),
)


def _kv_hint(config: ModelConfig, seq_len: int, batch: int, dtype_bytes: float, got: float, expected: float) -> str:
    """Name the factor the reader most likely dropped or added, from the ratio got / expected."""
    ratio = got / expected if expected else float("nan")
    suspects = [
        (0.5, "K and V are two tensors: the cache holds 2 × n_layers × n_kv_heads × head_dim numbers per token."),
        (config.n_heads / config.n_kv_heads, "the cache stores one K and one V per KV head: use n_kv_heads, "
                                             "not n_heads (grouped-query attention shares them)."),
        (1 / config.n_layers, "every layer keeps its own keys and values: multiply by n_layers."),
        (1 / dtype_bytes, "multiply by dtype_bytes (2 for FP16/BF16, 1 for FP8)."),
        (config.dim / (config.n_kv_heads * config.head_dim), "one token's K in one layer is n_kv_heads × head_dim "
                                                             "numbers, which is less than dim with GQA."),
        (1 / seq_len, "every position of the sequence has its own K and V: multiply by seq_len."),
        (1 / batch, "every sequence of the batch has its own cache: multiply by batch."),
        (8.0, "the answer is in bytes, not bits."),
    ]
    for factor, hint in suspects:
        if factor != 1 and math.isclose(ratio, factor, rel_tol=1e-9):
            return hint
    return "bytes = 2 × n_layers × n_kv_heads × head_dim × dtype_bytes × seq_len × batch."


def _check_kv(fn: Callable, config: ModelConfig, seq_len: int, batch: int, dtype_bytes: float, what: str) -> None:
    expected = reference_kv_cache_bytes(config, seq_len, batch, dtype_bytes)
    got = fn(config, seq_len, batch, dtype_bytes)
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise MismatchError(what, f"a number of bytes ({expected:,.0f})", type(got).__name__,
                            "return a Python int or float.")
    if not math.isclose(got, expected, rel_tol=1e-9):
        raise MismatchError(what, f"{expected:,.0f} bytes", f"{got:,.0f}",
                            _kv_hint(config, seq_len, batch, dtype_bytes, got, expected))


@kv_bytes.test("Llama-2-7B (MHA), one 4,096-token sequence in FP16: 2 GiB")
def _(fn: Callable) -> None:
    _check_kv(fn, arithmetic.preset("llama-2-7b"), 4096, 1, 2, "kv_cache_bytes(Llama-2-7B, 4096)")


@kv_bytes.test("Llama-3-70B (GQA, 8 KV heads for 64 query heads), batch 8 at 8k in FP16")
def _(fn: Callable) -> None:
    _check_kv(fn, arithmetic.preset("llama-3-70b"), 8192, 8, 2, "kv_cache_bytes(Llama-3-70B, 8192, batch=8)")


@kv_bytes.test("an FP8 cache (1 byte per number) and a head_dim that is not dim / n_heads")
def _(fn: Callable) -> None:
    config = ModelConfig(dim=96, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=192, vocab_size=50)
    _check_kv(fn, config, 100, 3, 1, "kv_cache_bytes(3 layers, 2 KV heads of 32, 100 tokens, batch 3, fp8)")


@kv_bytes.test("equals the bytes minillm's KVCache actually reserves (fp32, so dtype_bytes = 4)")
def _(fn: Callable) -> None:
    config = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=128, vocab_size=40)
    live = KVCache(config, batch_size=2, max_len=33, dtype=torch.float32).nbytes
    got = fn(config, 33, 2, 4)
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isclose(got, live, rel_tol=1e-9):
        hint = (_kv_hint(config, 33, 2, 4, got, live) if isinstance(got, (int, float)) and not isinstance(got, bool)
                else "return a Python int or float.")
        raise MismatchError("kv_cache_bytes vs KVCache(config, 2, 33).nbytes", f"{live:,} bytes", got, hint)


# ---- 02.cached_decode -------------------------------------------------------------------------------


@torch.inference_mode()
def reference_greedy_decode_cached(model: Transformer, prompt_ids: list[int], n_new: int) -> list[int]:
    """Greedy decoding with a KV cache: one prefill over the prompt, then one token per step.

    Returns the n_new generated ids (no EOS handling: it always generates n_new).
    """
    cache = KVCache(model.config, 1, len(prompt_ids) + n_new, model.device, model.dtype)
    logits = model(torch.tensor([prompt_ids], device=model.device), cache=cache, last_only=True)[:, -1]
    out: list[int] = []
    for step in range(n_new):
        token = int(logits.argmax(dim=-1).item())
        out.append(token)
        if step + 1 < n_new:  # the last token never needs to be fed back
            logits = model(torch.tensor([[token]], device=model.device), cache=cache)[:, -1]
    return out


cached_decode = register_task(
    "02.cached_decode",
    "greedy_decode_cached(model: Transformer, prompt_ids: list[int], n_new: int) -> list[int]  (uses a KVCache)",
    reference=reference_greedy_decode_cached,
    forbid=("minillm.decoding.generation.generate", "minillm.decoding.generation.generate_stream",
            "minillm.decoding.generation.prefill", "minillm.decoding.generation.decode_one_token",
            "minillm.decoding.parallel_sampling.generate_n", "minillm.decoding.beam.beam_search"),
)


@torch.inference_mode()
def _greedy_no_cache(model: Transformer, prompt_ids: list[int], n_new: int) -> list[int]:
    """The reference loop without a cache: the whole sequence through the model at every step."""
    ids = list(prompt_ids)
    for _ in range(n_new):
        ids.append(int(model(torch.tensor([ids]), last_only=True)[0, -1].argmax().item()))
    return ids[len(prompt_ids):]


def _tiny_model(seed: int, n_kv_heads: int = 2) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, ffn_dim=128, vocab_size=97,
                         max_seq_len=128)
    return Transformer(config).eval()


def _run_counting(fn: Callable, model: Transformer, prompt: list[int], n_new: int) -> tuple[object, int]:
    """Call the reader's function; count the token positions that go through the model's embedding."""
    return call_probed(fn, count_embedded_positions, model, prompt, n_new)


def _check_tokens(got: object, expected: list[int], what: str) -> None:
    if isinstance(got, torch.Tensor):
        got = got.flatten().tolist()
    if not isinstance(got, list) or not all(isinstance(t, int) for t in got):
        raise MismatchError(what, f"a list of {len(expected)} ints", type(got).__name__,
                            "return the generated ids as a list of Python ints (int(tensor.item())).")
    if got == expected:
        return
    if len(got) > len(expected) and got[-len(expected):] == expected:
        hint = "return only the n_new generated ids, not the prompt."
    elif len(got) != len(expected):
        hint = f"generate exactly n_new = {len(expected)} tokens."
    else:
        first = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        hint = (f"the first {first} tokens agree, then they differ: after the prefill, feed only the newest token, "
                "with the same KVCache (the model reads its position from cache.seq_len).")
    expect_equal(got, expected, what, hint)


@cached_decode.test("same tokens as recomputing the whole sequence every step (tiny random GQA model)")
def _(fn: Callable) -> None:
    model = _tiny_model(0)
    prompt = [5, 17, 42, 8, 3]
    got, _ = _run_counting(fn, model, prompt, 12)
    _check_tokens(got, _greedy_no_cache(model, prompt, 12), "greedy_decode_cached(tiny model, 5-token prompt, 12)")


@cached_decode.test("uses the cache: each position goes through the model once (prompt + n_new - 1 in all)")
def _(fn: Callable) -> None:
    model = _tiny_model(1)
    prompt, n_new = list(range(10, 30)), 16
    _, processed = _run_counting(fn, model, prompt, n_new)
    needed = len(prompt) + n_new - 1
    if processed > len(prompt) + n_new:
        raise MismatchError("token positions passed through the model", f"{needed} (at most {needed + 1})",
                            processed,
                            "that is the quadratic no-cache loop: prefill the prompt once into a KVCache, then "
                            "call the model on the single newest token [[token]] with cache=cache.")
    if processed < needed:
        raise MismatchError("token positions passed through the model", needed, processed,
                            "every prompt token must go through the model once (the prefill fills the cache).")


@cached_decode.test("a one-token prompt, and a model with as many KV heads as query heads")
def _(fn: Callable) -> None:
    model = _tiny_model(2, n_kv_heads=4)
    got, _ = _run_counting(fn, model, [7], 9)
    _check_tokens(got, _greedy_no_cache(model, [7], 9), "greedy_decode_cached(MHA model, [7], 9)")


@cached_decode.test("n_new = 1 is the prefill alone")
def _(fn: Callable) -> None:
    model = _tiny_model(3)
    got, processed = _run_counting(fn, model, [1, 2, 3], 1)
    _check_tokens(got, _greedy_no_cache(model, [1, 2, 3], 1), "greedy_decode_cached(model, [1, 2, 3], 1)")
    if processed != 3:
        raise MismatchError("token positions passed through the model for n_new = 1", 3, processed,
                            "the first generated token comes from the prefill's logits: no decode step is needed.")


# ---- 02.online_softmax ------------------------------------------------------------------------------


def reference_online_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(d)) v, reading K and V one block of keys at a time.

    q [T_q, d], k [T_k, d], v [T_k, d_v] -> [T_q, d_v]. Keeps per query row a running max `m`,
    a running denominator `l` and an unnormalised output `acc`; when a block raises the max, the
    old `l` and `acc` are rescaled by exp(m_old - m_new). Divides by `l` once at the end.
    """
    scale = q.shape[-1] ** -0.5
    m = torch.full((q.shape[0], 1), float("-inf"), dtype=q.dtype)
    l = torch.zeros(q.shape[0], 1, dtype=q.dtype)  # noqa: E741 - the paper's name
    acc = torch.zeros(q.shape[0], v.shape[-1], dtype=q.dtype)
    for start in range(0, k.shape[0], block_size):
        s = (q @ k[start:start + block_size].T) * scale  # [T_q, block]
        m_new = torch.maximum(m, s.max(dim=-1, keepdim=True).values)
        p = torch.exp(s - m_new)
        correction = torch.exp(m - m_new)
        l = l * correction + p.sum(dim=-1, keepdim=True)  # noqa: E741
        acc = acc * correction + p @ v[start:start + block_size]
        m = m_new
    return acc / l


online_softmax = register_task(
    "02.online_softmax",
    "online_attention(q: Tensor[T_q, d], k: Tensor[T_k, d], v: Tensor[T_k, d_v], block_size: int) -> Tensor[T_q, d_v]",
    reference=reference_online_attention,
    forbid=("torch.nn.functional.scaled_dot_product_attention", "minillm.model.grouped_query_attention"),
)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.softmax((q.double() @ k.double().T) * q.shape[-1] ** -0.5, dim=-1).to(q.dtype) @ v


def _check_attention(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, what: str,
                     hint: str) -> None:
    got = fn(q.clone(), k.clone(), v.clone(), block)
    if isinstance(got, torch.Tensor) and not torch.isfinite(got).all():
        hint = ("the output has inf/NaN: exp of a large score overflows. Subtract the running maximum "
                "before exp, and start the maximum at -inf.")
    expect_close(got, _attention(q, k, v), what, hint, atol=1e-4, rtol=1e-4)


_RESCALE = ("with several blocks, rescale the running sum l and the accumulator by exp(m_old - m_new) "
            "whenever a block raises the maximum, and divide acc by l only at the end.")


@online_softmax.test("one block that holds every key equals softmax(q kᵀ / √d) v")
def _(fn: Callable) -> None:
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(4, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(24, 8, generator=g))
    _check_attention(fn, q, k, v, 64, "online_attention(q[4,16], k[24,16], v[24,8], block_size=64)",
                     "scores = q @ k.T / sqrt(d) (d = q's last dim); out = softmax(scores, dim=-1) @ v.")


@online_softmax.test("many blocks, a ragged last one (37 keys in blocks of 8)")
def _(fn: Callable) -> None:
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(5, 32, generator=g), torch.randn(37, 32, generator=g), torch.randn(37, 32, generator=g))
    _check_attention(fn, q, k, v, 8, "online_attention(q[5,32], k[37,32], v[37,32], block_size=8)", _RESCALE)


@online_softmax.test("large scores (up to ~10^3) do not overflow, with blocks of one key")
def _(fn: Callable) -> None:
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(3, 16, generator=g) * 40, torch.randn(20, 16, generator=g) * 40,
               torch.randn(20, 4, generator=g))
    _check_attention(fn, q, k, v, 1, "online_attention(large scores, block_size=1)", _RESCALE)


@online_softmax.test("the largest score arrives in the last block (the max must be updated late)")
def _(fn: Callable) -> None:
    g = torch.Generator().manual_seed(13)
    q = torch.randn(2, 8, generator=g)
    k = torch.randn(30, 8, generator=g) * 0.1
    k[-1] = q[0] * 6  # a dominant key at the end for row 0
    v = torch.randn(30, 6, generator=g)
    _check_attention(fn, q, k, v, 7, "online_attention(dominant last key, block_size=7)", _RESCALE)


# ---- 02.max_batch -----------------------------------------------------------------------------------


def reference_max_batch_size(config: ModelConfig, gpu_memory_bytes: float, seq_len: int, weight_bits: float = 16,
                             kv_dtype_bytes: float = 2, reserve_bytes: float = 0.0) -> int:
    """floor((memory - weights - reserve) / KV bytes of one sequence of seq_len), and 0 if the weights do not fit."""
    return arithmetic.max_batch_size(config, gpu_memory_bytes, seq_len, weight_bits, kv_dtype_bytes, reserve_bytes)


max_batch = register_task(
    "02.max_batch",
    "max_batch_size(config, gpu_memory_bytes, seq_len, weight_bits=16, kv_dtype_bytes=2, reserve_bytes=0) -> int",
    reference=reference_max_batch_size,
    forbid=("minillm.arithmetic.max_batch_size",),
)


def _check_batch(fn: Callable, args: tuple, what: str) -> None:
    expected = reference_max_batch_size(*args)
    got = fn(*args)
    config, memory, seq_len = args[:3]
    if isinstance(got, float) and got.is_integer():
        hint = "return an int: a batch is a whole number of sequences (math.floor, or int() of a positive number)."
        raise MismatchError(what, f"{expected} (int)", f"{got!r} (float)", hint)
    hint = "free = memory - weight bytes - reserve; batch = floor(free / KV bytes of ONE sequence of seq_len)."
    if isinstance(got, (int, float)) and not isinstance(got, bool):
        if got < 0:
            hint = "when the weights do not fit, no sequence does: return 0, never a negative batch."
        elif isinstance(got, float):
            hint = "round down: a fraction of a sequence does not fit (math.floor)."
        elif expected and got == expected + 1:
            hint = "round down, not up: the last sequence must fit whole."
        else:
            per_seq = arithmetic.kv_cache_bytes(config, seq_len, 1, args[4] if len(args) > 4 else 2)
            if got == math.floor(memory / per_seq):
                hint = "subtract the weights (n_params × weight_bits / 8 bytes) before dividing."
    expect_equal(got, expected, what, hint)


@max_batch.test("Llama-2-7B in BF16 on an 80 GB card at 4,096 tokens")
def _(fn: Callable) -> None:
    _check_batch(fn, (arithmetic.preset("llama-2-7b"), 80e9, 4096), "max_batch_size(Llama-2-7B, 80e9, 4096)")


@max_batch.test("Llama-3-70B at 4-bit weights, FP8 KV cache, 8k context, 2 GB reserved, 80 GB")
def _(fn: Callable) -> None:
    _check_batch(fn, (arithmetic.preset("llama-3-70b"), 80e9, 8192, 4, 1, 2e9),
                 "max_batch_size(Llama-3-70B, 80e9, 8192, weight_bits=4, kv_dtype_bytes=1, reserve_bytes=2e9)")


@max_batch.test("weights that do not fit give 0 (Llama-2-70B in BF16 on 80 GB)")
def _(fn: Callable) -> None:
    _check_batch(fn, (arithmetic.preset("llama-2-70b"), 80e9, 2048), "max_batch_size(Llama-2-70B, 80e9, 2048)")


@max_batch.test("a budget that is not a whole number of sequences rounds down")
def _(fn: Callable) -> None:
    config = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100)
    per_seq = arithmetic.kv_cache_bytes(config, 10, 1, 2)
    memory = arithmetic.weight_bytes(config, 16) + 3.7 * per_seq
    _check_batch(fn, (config, memory, 10), "max_batch_size(tiny model, weights + 3.7 sequences of KV, 10)")
