"""The CPU's compiled decode step (`compile_decode=True`): the paged attention it runs in PyTorch, and the
tokens it produces, which must be the eager engine's."""

from __future__ import annotations

import pytest
import torch
from minillm.kernels import paged_decode_attention_reference

import minillm
from minillm.engine.llm_engine import LLMEngine
from minillm.model import PagedDecode, paged_attention_torch
from minillm.quant.kv import QuantizedPool, quantize_kv


def _pools_and_tables(seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    blocks, size, h_kv, d = 12, 4, 2, 16
    k_pool = torch.randn(blocks, size, h_kv, d, generator=g).to(dtype)
    v_pool = torch.randn(blocks, size, h_kv, d, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:5] for _ in range(3)])  # [3, 5] shuffled blocks
    lengths = torch.tensor([1, 9, 20])  # a row of one key, a partial last block, a full table
    q = torch.randn(3, 8, 1, d, generator=g).to(dtype)  # 8 query heads over 2 KV heads
    return q, k_pool, v_pool, tables, lengths


def test_paged_attention_in_pytorch_matches_the_gather_reference():
    """Fixed key range (max_seq_len), each row masked to its own length: the reference's answer, row by row."""
    q, k_pool, v_pool, tables, lengths = _pools_and_tables(0)
    mask = PagedDecode(tables, lengths, max_seq_len=20)
    got = paged_attention_torch(q, k_pool, v_pool, mask)
    expected = paged_decode_attention_reference(q[:, :, 0], k_pool, v_pool, tables, lengths)
    assert got.shape == (3, 8, 1, 16)
    torch.testing.assert_close(got[:, :, 0], expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_in_pytorch_reads_8_bit_pools():
    q, k_pool, v_pool, tables, lengths = _pools_and_tables(1)
    (k_codes, k_scale), (v_codes, v_scale) = quantize_kv(k_pool, torch.int8), quantize_kv(v_pool, torch.int8)
    mask = PagedDecode(tables, lengths, max_seq_len=20, dtype=torch.float32)
    got = paged_attention_torch(q, QuantizedPool(k_codes, k_scale), QuantizedPool(v_codes, v_scale), mask)
    expected = paged_decode_attention_reference(q[:, :, 0], k_codes, v_codes, tables, lengths, k_scale=k_scale,
                                                v_scale=v_scale)
    torch.testing.assert_close(got[:, :, 0], expected, rtol=1e-5, atol=1e-5)


def test_compiled_decode_gives_the_eager_engines_tokens():
    """Greedy text of the shipped model through generate, eager and with the decode step compiled: the same
    tokens (one compile, seconds on a CPU; a second prompt reuses it)."""
    model, tok = minillm.load(minillm.DEFAULT_MODEL)
    params = minillm.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for prompt in ("ROMEO.\n", "JULIET.\nO Romeo, Romeo"):
        eager = minillm.generate(model, prompt, params, tok)
        compiled = minillm.generate(model, prompt, params, tok, compile_decode=True)
        assert compiled.token_ids == eager.token_ids, prompt


def test_compile_decode_is_refused_where_it_cannot_run():
    model, tok = minillm.load(minillm.DEFAULT_MODEL)
    params = minillm.SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="use_cache=False runs none"):
        minillm.generate(model, "Hi", params, tok, use_cache=False, compile_decode=True)
    from minillm.speculative import NgramDrafter, SpeculativeConfig

    with pytest.raises(ValueError, match="compile_decode=True, but speculative decoding"):
        LLMEngine(model, tok, speculative=SpeculativeConfig(NgramDrafter(), 2), compile_decode=True)
