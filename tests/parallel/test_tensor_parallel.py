"""Tensor parallelism (minillm.parallel.tensor, chapter 08): the split is exact, and an engine of 2 processes
(gloo, on the CPU) gives the one-process engine's tokens and logits."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.nn.functional as F

import minillm
from minillm.config import ModelConfig
from minillm.decoding.llm import LLM
from minillm.engine.engine_config import EngineConfig
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.model_runner import paged_forward
from minillm.model import Transformer
from minillm.parallel.tensor import (
    TensorParallelError,
    column_shard,
    row_shard,
    shard_config,
    start_group,
)
from minillm.sampler.sampling import SamplingParams
from minillm.sampler.speculative import NgramDrafter, SpeculativeConfig

PROMPTS = ["ROMEO.\nBut soft", "JULIET.\nO Romeo, Romeo", "HAMLET.\nTo be, or not to be"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def shipped():
    return minillm.load(minillm.DEFAULT_MODEL)


def random_model(seed: int = 0) -> Transformer:
    """A random Llama-shape model with GQA and every bias (so that the bias handling is checked too)."""
    torch.manual_seed(seed)
    config = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=128,
                         qkv_bias=True, o_bias=True, mlp_bias=True)
    return Transformer(config).eval()


def test_the_mlp_split_adds_up_to_the_whole_mlp() -> None:
    """Column-parallel gate/up and row-parallel down: the ranks' partial outputs sum to the unsplit MLP's."""
    torch.manual_seed(0)
    dim, ffn, world = 16, 24, 2
    gate_up, down = torch.randn(2 * ffn, dim), torch.randn(dim, ffn)
    x = torch.randn(5, dim)
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    whole = F.linear(F.silu(gate) * up, down)
    partial = []
    for rank in range(world):
        g, u = F.linear(x, column_shard(gate_up, (ffn, ffn), rank, world)).chunk(2, dim=-1)
        partial.append(F.linear(F.silu(g) * u, row_shard(down, rank, world)))
    torch.testing.assert_close(sum(partial), whole, rtol=1e-5, atol=1e-5)


def test_the_qkv_split_keeps_whole_heads() -> None:
    """Each rank's stacked qkv rows are its own query heads, then its KV heads' keys, then their values."""
    q, kv, world = 8, 4, 2
    weight = torch.arange(q + 2 * kv).float()[:, None].expand(-1, 3)
    shard = column_shard(weight, (q, kv, kv), 1, world)[:, 0].tolist()
    assert shard == [4, 5, 6, 7, 10, 11, 14, 15]


def test_a_size_that_does_not_divide_the_heads_is_refused() -> None:
    config = ModelConfig(dim=96, n_layers=1, n_heads=6, n_kv_heads=2, ffn_dim=96)
    with pytest.raises(ValueError, match="must divide the model's n_kv_heads=2"):
        shard_config(config, 3)
    assert shard_config(config, 2).n_heads == 3 and shard_config(config, 2).head_dim == 16


def test_tensor_parallelism_refuses_speculation(shipped) -> None:
    model, tokenizer = shipped
    with pytest.raises(ValueError, match="leave speculative and compile_decode off"):
        LLMEngine(model, tokenizer, tensor_parallel_size=2, speculative=SpeculativeConfig(NgramDrafter(), 2))
    with pytest.raises(ValueError, match="leave speculative and compile_decode off"):  # before any worker starts
        LLM(model, tokenizer, tensor_parallel_size=2, speculative=SpeculativeConfig(NgramDrafter(), 2))


def test_the_engine_runs_the_group_it_is_given_and_starts_none(shipped) -> None:
    """Building an engine flows down: the front door starts the group (`start_group`) and passes it in; the engine
    alone, asked for ranks it was not given, says how to build it (and a group of another size is refused)."""
    model, tokenizer = shipped
    with pytest.raises(ValueError, match="starts none. Use minillm.LLM"):
        LLMEngine(model, tokenizer, tensor_parallel_size=2)
    assert start_group(model, EngineConfig()) is None
    with pytest.raises(ValueError, match="positive integer"):
        start_group(model, EngineConfig(tensor_parallel_size=0))
    group = start_group(model, EngineConfig(tensor_parallel_size=2))
    try:
        with pytest.raises(ValueError, match="tensor_parallel_size=1 with a group of 2 ranks"):
            LLMEngine(model, tokenizer, group=group)
        engine = LLMEngine(model, tokenizer, EngineConfig(tensor_parallel_size=2), group=group)
        assert engine.model is group.model and engine.model_runner.paged_forward == group.forward
    finally:
        group.shutdown()


def test_two_ranks_give_the_one_process_engine_tokens_and_logits(shipped) -> None:
    model, tokenizer = shipped
    expected = LLM(model, tokenizer).generate(PROMPTS, GREEDY, use_tqdm=False)
    # n > 1 forks a prompt's blocks and copies a shared last block before writing it: the workers must copy too
    forked = SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=7)
    expected_forked = LLM(model, tokenizer).generate(PROMPTS[:1], forked, use_tqdm=False)
    ids = tokenizer.encode(PROMPTS[2])
    one = PagedKVCache(model.config, 8, 16)
    one.add_sequence("s")
    expected_logits = paged_forward(model, one, ["s"], [ids])

    llm = LLM(model, tokenizer, tensor_parallel_size=2)
    try:
        engine = llm.engine
        assert engine.model.config.n_kv_heads == 1 and engine.cache.k[0].shape[2] == 1  # rank 0 holds half the heads
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        copies, copy_block = [], engine.cache.copy_block
        engine.cache.copy_block = lambda src, dst: (copies.append(src), copy_block(src, dst))
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], forked, use_tqdm=False)] == \
            [o.token_ids for o in expected_forked]
        assert copies, "the forks should have copied their shared last block"
        engine.cache.add_sequence("s")
        logits = engine.model_runner.forward(["s"], [ids])
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
        with pytest.raises(TensorParallelError, match="run the model through the engine"):
            engine.model(torch.tensor([ids]))  # rank 0's shard alone would wait for rank 1 forever
    finally:
        llm.shutdown()


def test_a_random_model_with_biases_and_gqa_splits_exactly() -> None:
    model = random_model()
    prompts = [[3, 17, 9, 44, 5], [8, 2, 99, 31, 64, 12, 7]]
    expected = LLM(model).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(model, tensor_parallel_size=2)
    try:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    finally:
        llm.shutdown()


def test_a_dead_worker_is_a_clear_error_not_a_hang(shipped) -> None:
    model, tokenizer = shipped
    llm = LLM(model, tokenizer, tensor_parallel_size=2)
    try:
        worker = llm.engine.tp.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        with pytest.raises(TensorParallelError, match="worker rank 1"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        with pytest.raises(TensorParallelError, match="failed earlier"):  # and it stays failed, saying so
            llm.engine.tp.forward(llm.engine.model, llm.engine.cache, ["x"], [[1, 2]])
    finally:
        llm.shutdown()


def test_minillm_serve_with_two_ranks_answers_as_one_process_does() -> None:
    """`minillm serve --tensor-parallel-size 2`, asked with the official openai client, gives the greedy text of
    the one-process engine."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from minillm.entrypoints.server import serve_in_background

    model, tokenizer = minillm.load("shakespeare-1m")
    expected = LLM(model, tokenizer).generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].text
    with serve_in_background("shakespeare-1m", timeout_s=120, tensor_parallel_size=2) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(model="shakespeare-1m", prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert reply.choices[0].text == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL, one per rank)")
def test_two_gpus_over_nccl_give_one_gpu_tokens_and_logits() -> None:
    model = random_model().cuda()
    prompts = [[3, 17, 9, 44, 5], [8, 2, 99, 31, 64, 12, 7]]
    expected = LLM(model, cuda_graphs=False).generate(prompts, GREEDY, use_tqdm=False)
    one = PagedKVCache(model.config, 8, 16, "cuda")
    one.add_sequence("s")
    expected_logits = paged_forward(model, one, ["s"], [prompts[1]])
    llm = LLM(model, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
            [o.token_ids for o in expected]
        llm.engine.cache.add_sequence("s")
        torch.testing.assert_close(llm.engine.model_runner.forward(["s"], [prompts[1]]), expected_logits,
                                   rtol=1e-4, atol=1e-4)
    finally:
        llm.shutdown()
