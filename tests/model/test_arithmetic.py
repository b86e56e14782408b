"""minillm.arithmetic: every formula against a hand-computed case, the live model and the live KV cache."""

from __future__ import annotations

import math
import random

import pytest
import torch

from minillm import arithmetic
from minillm.config import ModelConfig
from minillm.contiguous_cache import KVCache
from minillm.model import Transformer

# Published sizes (model cards, papers), in parameters; param_count must land within 1%.
PUBLISHED = {
    "llama-2-7b": 6.74e9,
    "llama-2-13b": 13.0e9,
    "llama-2-70b": 69.0e9,
    "llama-3-8b": 8.03e9,
    "llama-3-70b": 70.6e9,
    "llama-3.1-405b": 405.9e9,
    "mistral-7b": 7.24e9,
    "qwen2.5-7b": 7.62e9,
    "opt-13b": 12.9e9,
    "starcoder-15b": 15.5e9,  # bigcode/starcoder model card: 15.5B
    "gpt-3-175b": 175e9,
}


def random_config(rng: random.Random) -> ModelConfig:
    n_kv = rng.choice([1, 2, 4])
    n_heads = n_kv * rng.choice([1, 2, 3])
    if rng.random() < 0.5:  # an explicit head_dim, unrelated to dim (as in Qwen3)
        dim, head_dim = rng.choice([16, 24, 32]), rng.choice([8, 12, 16])
    else:
        dim, head_dim = n_heads * rng.choice([4, 8]), None
    return ModelConfig(
        dim=dim, n_layers=rng.randint(1, 3), n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        ffn_dim=rng.choice([20, 48, 64]), vocab_size=rng.choice([50, 97, 128]),
        tie_embeddings=rng.random() < 0.5, qkv_bias=rng.random() < 0.5, o_bias=rng.random() < 0.5,
        mlp_bias=rng.random() < 0.5, qk_norm=rng.random() < 0.5,
    )


# ------------------------------------------------------------------------------------ parameters
def test_task_param_count_equals_live_model_on_random_configs():
    rng = random.Random(0)
    for _ in range(40):
        config = random_config(rng)
        live = sum(p.numel() for p in Transformer(config).parameters())
        assert arithmetic.param_count(config) == live, f"param_count disagrees with Transformer for {config}"


@pytest.mark.parametrize("switch", ["tie_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm"])
def test_param_count_tracks_each_switch(switch):
    base = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40, vocab_size=64)
    flipped = ModelConfig(**{**base.to_dict(), switch: True})
    for config in (base, flipped):
        assert arithmetic.param_count(config) == Transformer(config).num_parameters()


def test_param_count_of_the_shipped_model():
    import minillm

    model, _ = minillm.load("shakespeare-11m")
    assert arithmetic.param_count(model.config) == 10_867_584 == model.num_parameters()


def test_presets_are_exactly_the_documented_ones():
    assert set(arithmetic.PRESETS) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_task_preset_param_count_matches_published_size(name):
    got, want = arithmetic.param_count(name), PUBLISHED[name]
    assert abs(got - want) / want < 0.01, f"{name}: param_count {got / 1e9:.3f}B, published {want / 1e9:.2f}B"


def test_exact_counts_of_hand_computed_presets():
    # Llama-2-7B: 32 x (4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096) + 2 x 32000 x 4096 + 4096
    block = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert arithmetic.param_count("llama-2-7b") == 32 * block + 2 * 32000 * 4096 + 4096 == 6_738_415_616
    # OPT-13B: 4 biased d x d, fc1/fc2 with biases, 2 LayerNorms (weight+bias), tied embedding, 2050 positions
    d, f = 5120, 20480
    block = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d
    assert arithmetic.param_count("opt-13b") == 40 * block + 50272 * d + 2050 * d + 2 * d


def test_preset_returns_a_copy_and_rejects_unknown_names():
    cfg = arithmetic.preset("llama-2-7b")
    cfg.n_layers = 1
    assert arithmetic.PRESETS["llama-2-7b"].n_layers == 32
    with pytest.raises(ValueError, match="unknown preset 'llama-9b'; choose one of"):
        arithmetic.preset("llama-9b")
    with pytest.raises(ValueError, match="unknown preset"):
        arithmetic.kv_cache_bytes("gpt-5", 10)


def test_gpt_config_validates():
    with pytest.raises(ValueError, match="activation"):
        arithmetic.GPTConfig(dim=64, n_heads=4, activation="swish")


@pytest.mark.parametrize("bits,gb", [(32, 26.95), (16, 13.48), (8, 6.74), (4, 3.37)])
def test_weight_bytes_by_dtype(bits, gb):
    assert arithmetic.weight_bytes("llama-2-7b", bits) / 1e9 == pytest.approx(gb, rel=1e-3)
    assert arithmetic.weight_bytes(6_738_415_616, bits) == arithmetic.weight_bytes("llama-2-7b", bits)


def test_13b_fp16_does_not_fit_in_24gb():
    assert arithmetic.weight_bytes("llama-2-13b", 16) > 24e9
    assert arithmetic.max_batch_size("llama-2-13b", 24e9, 1024) == 0


# ------------------------------------------------------------------------------------ KV cache
def test_task_kv_bytes_per_token_llama2_7b():
    assert arithmetic.kv_cache_bytes_per_token("llama-2-7b") == 2 * 32 * 32 * 128 * 2 == 524_288
    assert arithmetic.kv_cache_bytes_per_token("llama-2-7b", "fp8") == 262_144
    assert arithmetic.kv_cache_bytes("llama-2-7b", 4096, batch=8) == 524_288 * 4096 * 8


def test_gqa_kv_is_smaller_by_the_group_factor():
    mha = arithmetic.preset("llama-3-70b")
    mha.n_kv_heads = mha.n_heads
    gqa = arithmetic.PRESETS["llama-3-70b"]
    factor = gqa.n_heads // gqa.n_kv_heads
    assert arithmetic.kv_cache_bytes_per_token(mha) == arithmetic.kv_cache_bytes_per_token(gqa) * factor
    assert arithmetic.kv_cache_bytes_per_token(gqa) == 327_680


@pytest.mark.parametrize("dtype,nbytes", [(torch.float16, 2), (torch.float32, 4), (torch.bfloat16, 2)])
def test_task_kv_bytes_agree_with_a_live_kv_cache(dtype, nbytes):
    config = ModelConfig(dim=48, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=10, ffn_dim=64, vocab_size=50)
    cache = KVCache(config, batch_size=3, max_len=17, dtype=dtype)
    assert arithmetic.kv_cache_bytes(config, 17, batch=3, dtype_bytes=nbytes) == cache.nbytes


def test_max_batch_size_worked_case():
    # 80 GB - 13,476,831,232 B of weights = 66,523,168,768 B; / 2,147,483,648 B per 4k sequence = 30.98
    assert arithmetic.max_batch_size("llama-2-7b", 80e9, 4096) == 30
    # Reserve 5 GB and use 90%: (72e9 - 13.48e9 - 5e9) / 2.147e9 = 24.9
    assert arithmetic.max_batch_size("llama-2-7b", 80e9, 4096, reserve_bytes=5e9, memory_utilization=0.9) == 24
    # An FP8 cache doubles it: 66.52e9 / 1.074e9 = 61.9
    assert arithmetic.max_batch_size("llama-2-7b", 80e9, 4096, kv_dtype_bytes=1) == 61


# ------------------------------------------------------------------------------------ FLOPs and the roofline
def test_flops_per_token_hand_case():
    c = ModelConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=12, vocab_size=10)
    # per layer: qkv 8 x (8 + 2 x 4) + o 8 x 8 = 192; MLP 3 x 8 x 12 = 288; head 10 x 8 = 80
    assert arithmetic.matmul_params(c) == 2 * (192 + 288) + 80
    assert arithmetic.flops_per_token(c, 0) == 2 * 1040
    assert arithmetic.flops_per_token(c, 5) == 2 * 1040 + 4 * 2 * 2 * 4 * 5


def test_prefill_flops_is_the_sum_of_per_token_flops_less_unneeded_logits():
    c = arithmetic.PRESETS["llama-2-7b"]
    n = 37
    head = c.vocab_size * c.dim
    per_token = sum(arithmetic.flops_per_token(c, t) for t in range(1, n + 1))
    assert arithmetic.prefill_flops(c, n) == per_token - 2 * head * (n - 1)


def test_arithmetic_intensity_and_ridge_point():
    assert arithmetic.arithmetic_intensity(600, 200) == 3
    assert arithmetic.ridge_point(989.4e12, 3.35e12) == pytest.approx(295.3, rel=1e-3)
    assert arithmetic.GPU_SPECS["h100-sxm"].ridge_point == pytest.approx(295.3, rel=1e-3)


def test_task_roofline_picks_the_binding_resource():
    memory = arithmetic.roofline_time(flops=1e12, bytes_moved=1e12, peak_flops=1e15, peak_bandwidth=1e12)
    assert memory.bound == "memory" and memory.time_s == 1.0 and memory.compute_s == 1e-3
    compute = arithmetic.roofline_time(1e15, 1e9, 1e15, 1e12)
    assert compute.bound == "compute" and compute.time_s == 1.0 and compute.memory_s == 1e-3
    tie = arithmetic.roofline_time(1e12, 1e9, 1e15, 1e12)
    assert tie.bound == "compute" and tie.time_s == 1e-3
    assert memory.intensity == 1.0


def test_decode_is_memory_bound_at_batch_1_and_compute_bound_at_huge_batch():
    step = arithmetic.decode_step_time("llama-2-7b", "h100-sxm", context_len=1024)
    assert step.bound == "memory"
    # All parameters but the 32,000 x 4,096 embedding table, plus the one row the step gathers; KV.
    assert step.bytes_moved == (6_738_415_616 - 32_000 * 4096 + 4096) * 2 + 524_288 * 1024
    assert step.time_s == pytest.approx(step.bytes_moved / 3.35e12)
    assert arithmetic.decode_step_time("llama-2-7b", "h100-sxm", context_len=1, batch=1024).bound == "compute"
    # Ideal 8-way TP: same bytes and FLOPs, eight times the bandwidth.
    tp = arithmetic.decode_step_time("llama-2-7b", "h100-sxm", context_len=1024, n_gpus=8)
    assert tp.time_s == pytest.approx(step.time_s / 8)


def test_task_a_step_reads_the_embedding_rows_of_its_tokens_and_the_lm_head_once():
    # Llama-2-7B untied and the same shape tied: tying saves V x d of memory, not of traffic. A step
    # reads the LM head's V x d matrix whole (for the tied model that matrix *is* the embedding
    # table, counted once) and gathers one embedding row per token.
    untied = arithmetic.preset("llama-2-7b")
    tied = arithmetic.preset("llama-2-7b")
    tied.tie_embeddings = True
    V, d = untied.vocab_size, untied.dim
    assert arithmetic.weight_bytes(untied) - arithmetic.weight_bytes(tied) == V * d * 2
    for batch in (1, 8, 256):
        read = arithmetic.weight_bytes_read(untied, batch)
        assert read == arithmetic.weight_bytes_read(tied, batch), "tied and untied models read the same bytes"
        assert read == arithmetic.weight_bytes(untied) - (V - batch) * d * 2, "the untied embedding table is read whole"
        assert read == arithmetic.weight_bytes(tied) + batch * d * 2, "the tied table must be counted once"
        kv = arithmetic.kv_cache_bytes(untied, 1024, batch)
        for c in (untied, tied):
            assert arithmetic.decode_step_time(c, "h100-sxm", 1024, batch).bytes_moved == read + kv
    # Each extra sequence adds one embedding row, not a table.
    assert arithmetic.weight_bytes_read(untied, 2) - arithmetic.weight_bytes_read(untied, 1) == d * 2
    # Llama-3-8B's 128,256 x 4,096 table is 1.05 GB in BF16: counting it made the roofline 7% slow.
    step = arithmetic.decode_step_time("llama-3-8b", "h100-sxm", 1024)
    assert step.bytes_moved / 1e9 == pytest.approx(15.01 + 0.134, abs=0.005)
    assert arithmetic.weight_bytes("llama-3-8b") / 1e9 == pytest.approx(16.06, abs=0.005)
    # A prefill of B prompts of T tokens gathers B x T rows.
    r = arithmetic.prefill_time("llama-2-7b", "h100-sxm", prompt_len=100, batch=3)
    kv = arithmetic.kv_cache_bytes("llama-2-7b", 100, 3)
    assert r.bytes_moved == arithmetic.weight_bytes_read("llama-2-7b", 300) + kv


def test_weight_bytes_read_of_gpt_models_gathers_position_rows_too():
    opt = arithmetic.preset("opt-13b")  # tied embeddings, 2,050 learned positions
    assert arithmetic.weight_bytes_read(opt, 4, bits=16) == (
        arithmetic.param_count(opt) - opt.n_positions * opt.dim + 2 * 4 * opt.dim
    ) * 2
    with pytest.raises(ValueError, match="n_tokens must be a positive"):
        arithmetic.weight_bytes_read(opt, 0)


def test_prefill_is_compute_bound():
    r = arithmetic.prefill_time("llama-2-7b", "h100-sxm", prompt_len=2048)
    assert r.bound == "compute"
    assert r.time_s == pytest.approx(arithmetic.prefill_flops("llama-2-7b", 2048) / 989.4e12)


def test_gpu_specs_are_dense_and_sourced():
    for key in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "l4", "l40s", "a10g", "mi300x"):
        spec = arithmetic.GPU_SPECS[key]
        assert spec.source and spec.peak_flops > 0 and spec.memory_bytes > 0 and spec.memory_bandwidth > 0
    assert arithmetic.GPU_SPECS["h100-sxm"].peak_flops == 989.4e12  # 1,979 TFLOPS is the 2:4-sparse figure
    assert arithmetic.GPU_SPECS["a100-80gb"].peak_flops == 312e12
    with pytest.raises(ValueError, match="unknown GPU 'h900'; pass a GPUSpec or one of"):
        arithmetic.decode_step_time("llama-2-7b", "h900", 10)


# ------------------------------------------------------------------------------------ cost
def test_task_cost_per_million_tokens():
    # 8 GPUs x 2.50 USD = 20 USD/h; 20,000 tok/s x 3600 s x 0.6 = 43.2M tokens per paid hour.
    assert arithmetic.cost_per_million_tokens(2.5, 20_000, n_gpus=8, utilization=0.6) == pytest.approx(20 / 43.2)
    assert arithmetic.cost_per_million_tokens(3.6, 1000) == pytest.approx(1.0)


# ------------------------------------------------------------------------------------ later chapters
def test_cdiv_rounds_up_exactly():
    assert [arithmetic.cdiv(a, 4) for a in range(9)] == [0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert arithmetic.cdiv(2**60 + 1, 2) == 2**59 + 1  # exact where float division is not


def test_paging_arithmetic():
    assert arithmetic.kv_blocks(1000, 16) == 63 and arithmetic.kv_blocks(1024, 16) == 64
    assert arithmetic.kv_blocks(0) == 0
    assert arithmetic.contiguous_kv_waste([512, 1024], 1024) == 0.25
    assert arithmetic.paged_kv_waste([17], 16) == pytest.approx(1 - 17 / 32)
    assert arithmetic.static_batch_utilization([1, 3]) == pytest.approx(4 / 6)


def test_quantisation_arithmetic():
    assert arithmetic.effective_bits(4, 128) == 4.125
    assert arithmetic.effective_bits(4, 64, 16, 16) == 4.5
    assert arithmetic.effective_bits(8) == 8.0
    assert arithmetic.quant_step(127, 8) == 1.0 and arithmetic.quant_step(7, 4) == 1.0


def test_speculative_arithmetic():
    assert arithmetic.expected_tokens_per_step(0.0, 5) == 1.0
    assert arithmetic.expected_tokens_per_step(1.0, 5) == 6.0
    assert arithmetic.expected_tokens_per_step(0.8, 4) == pytest.approx(sum(0.8**i for i in range(5)))
    assert arithmetic.speculative_speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    assert arithmetic.speculative_speedup(0.3, 5, 0.2) < 1
    assert arithmetic.best_speculation_length(0.8, 0.1) == 6
    assert arithmetic.best_speculation_length(0.3, 0.2) == 1


def test_transfer_and_parallelism_arithmetic():
    assert arithmetic.kv_transfer_time("llama-3-8b", 8192, 50e9) == pytest.approx(131_072 * 8192 / 50e9)
    assert arithmetic.kv_transfer_time("llama-3-8b", 1, 1e9, latency_s=0.5) == pytest.approx(0.5 + 131_072 / 1e9)
    assert arithmetic.ring_allreduce_bytes(800, 8) == 1400 and arithmetic.ring_allreduce_bytes(800, 1) == 0
    assert arithmetic.pipeline_bubble_fraction(4, 12) == 0.2 and arithmetic.pipeline_bubble_fraction(1, 3) == 0


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: arithmetic.kv_cache_bytes("llama-2-7b", -1), "seq_len must be a non-negative number"),
        (lambda: arithmetic.kv_cache_bytes("llama-2-7b", 10, batch=0), "batch must be a positive number"),
        (lambda: arithmetic.kv_cache_bytes_per_token("llama-2-7b", "fp3"), "unknown dtype 'fp3'; pass bytes"),
        (lambda: arithmetic.flops_per_token("llama-2-7b", -5), "context_len must be a non-negative"),
        (lambda: arithmetic.max_batch_size("llama-2-7b", 80e9, 0), "seq_len must be a positive"),
        (lambda: arithmetic.max_batch_size("llama-2-7b", 80e9, 10, memory_utilization=1.5), r"in \(0, 1\]"),
        (lambda: arithmetic.cost_per_million_tokens(2.0, 0), "tokens_per_second must be a positive"),
        (lambda: arithmetic.cost_per_million_tokens(2.0, 10, utilization=0), "busy fraction"),
        (lambda: arithmetic.expected_tokens_per_step(1.5, 3), "alpha is a probability"),
        (lambda: arithmetic.expected_tokens_per_step(0.5, -1), "non-negative integer"),
        (lambda: arithmetic.weight_bytes("llama-2-7b", bits=0), "bits must be a positive"),
        (lambda: arithmetic.param_count(42), "config must be a minillm ModelConfig or a preset name"),
        (lambda: arithmetic.roofline_time(1, 0, 1, 1), "bytes_moved must be a positive"),
        (lambda: arithmetic.contiguous_kv_waste([5000], 4096), "every length must be in"),
        (lambda: arithmetic.pipeline_bubble_fraction(0, 4), "n_stages must be a positive integer"),
        (lambda: arithmetic.quant_step(1.0, bits=1), "bits must be an integer >= 2"),
    ],
)
def test_bad_input_raises_a_value_error_that_says_what_to_do(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_nan_is_rejected():
    with pytest.raises(ValueError):
        arithmetic.cost_per_million_tokens(math.nan, 10)


def test_mla_cache_is_one_latent_and_one_rope_key_per_layer():
    """DeepSeek-V2 (arXiv:2405.04434, Table 1): (d_c + d_h^R) x layers elements per token, d_c = 4 d_h,
    d_h^R = d_h / 2, i.e. 4.5 d_h x layers, against 2 n_h d_h x layers for MHA."""
    v2 = arithmetic.MLA_PRESETS["deepseek-v2"]
    per_token = arithmetic.mla_cache_bytes_per_token("deepseek-v2", "bf16")
    assert per_token == 60 * (512 + 64) * 2 == 4.5 * v2.head_dim * v2.n_layers * 2
    mha = 2 * v2.n_layers * v2.n_heads * v2.head_dim * 2
    assert round(mha / per_token, 1) == 56.9
    assert arithmetic.mla_cache_bytes_per_token(v2, 1) == per_token / 2
    with pytest.raises(ValueError, match="unknown MLA preset"):
        arithmetic.mla_cache_bytes_per_token("deepseek-v9")


def test_mqa_preset_has_one_kv_head():
    assert arithmetic.kv_cache_bytes_per_token("starcoder-15b") == 2 * 40 * 1 * 128 * 2
