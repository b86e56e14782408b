"""`EngineConfig`: an engine's settings in one object; the old keywords keep working and override a config."""

from __future__ import annotations

from dataclasses import replace

import pytest

import minillm
from minillm.decoding.llm import LLM
from minillm.engine import EngineConfig, LLMEngine
from minillm.sampler.sampling import SamplingParams


@pytest.fixture(scope="module")
def shipped():
    return minillm.load("shakespeare-1m")


def test_a_config_and_its_keywords_build_the_same_engine(shipped):
    model, tok = shipped
    config = EngineConfig(num_blocks=24, block_size=8, max_num_seqs=3, max_num_batched_tokens=40,
                          enable_prefix_caching=False)
    by_config, by_keywords = LLMEngine(model, tok, config), LLMEngine(model, tok, num_blocks=24, block_size=8,
                                                                      max_num_seqs=3, max_num_batched_tokens=40,
                                                                      enable_prefix_caching=False)
    for engine in (by_config, by_keywords):
        assert engine.cache.allocator.num_blocks == 24 and engine.cache.block_size == 8
        assert engine.scheduler.max_num_seqs == 3 and engine.scheduler.max_num_batched_tokens == 40
    assert by_config.config == by_keywords.config == replace(config, async_scheduling=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["ROMEO.\n", "JULIET.\n", "KING HENRY.\n", "ALL.\n"]
    outs = [[o.token_ids for o in LLM(model, tok, cfg).generate(prompts, params, use_tqdm=False)]
            for cfg in (config, None)]
    assert outs[0] == outs[1], "the same settings, by config or by default, give the same greedy tokens"


def test_keywords_beside_a_config_override_its_fields_and_the_engine_fills_in_the_rest(shipped):
    model, tok = shipped
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=2, num_blocks=10), num_blocks=30)
    assert engine.cache.allocator.num_blocks == 30 and engine.scheduler.max_num_seqs == 2
    default = LLMEngine(model, tok, EngineConfig(max_num_seqs=2, block_size=16))
    full_context = -(-model.config.max_seq_len // 16)
    assert default.config.num_blocks == 2 * full_context, "num_blocks left unset: max_num_seqs full contexts"
    assert default.config.async_scheduling is False, "filled in: off on a CPU"


def test_bad_settings_are_clear_errors(shipped):
    model, tok = shipped
    with pytest.raises(TypeError, match=r"unknown engine setting\(s\) \['max_batch'\]; an engine takes: .*max_num_s"):
        LLMEngine(model, tok, max_batch=4)
    with pytest.raises(TypeError, match="config must be an EngineConfig, got int 64.*num_blocks=64"):
        LLMEngine(model, tok, 64)  # the old third positional parameter was num_blocks
    with pytest.raises(ValueError, match="size the KV pool one way"):
        LLMEngine(model, tok, EngineConfig(num_blocks=8, kv_cache_memory_bytes=1e6))
