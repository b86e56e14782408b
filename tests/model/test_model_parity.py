"""minillm equals `transformers` on random-initialised Llama / Mistral / Qwen2 / Qwen3 models.

Each case builds a small model with `transformers` itself, converts it with
`minillm.from_transformers`, and checks: full-forward logits (fp32), cached step-by-step decode
against the full forward, and 32-token greedy continuations against `generate(do_sample=False)`.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_hf_model

import minillm
from minillm import KVCache, SamplingParams

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so the scaling bends frequencies we use
}

YARN_ROPE = {  # Qwen2.5's long-context setting, with an original context small enough to bend frequencies we use
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN_MSCALE_ROPE = {  # DeepSeek's form: the attention factor from mscale / mscale_all_dim, the ramp untruncated
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
    "beta_fast": 16,
    "beta_slow": 2,
    "truncate": False,
}

CASES = {
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa2": ("llama", dict(num_key_value_heads=2)),
    "llama-gqa4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "llama-head-dim": ("llama", dict(head_dim=32)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama3-rope": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "llama-yarn-rope": ("llama", dict(rope_parameters=YARN_ROPE)),
    "qwen2-yarn-mscale": ("qwen2", dict(rope_parameters=YARN_MSCALE_ROPE)),
    "mistral": ("mistral", dict(sliding_window=None)),
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=32, num_attention_heads=8, num_key_value_heads=2)),
}


def tolerance(reference: torch.Tensor) -> float:
    """1e-4, relative to the logit scale when logits exceed 1."""
    return 1e-4 * max(1.0, reference.abs().max().item())


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request):
    arch, overrides = CASES[request.param]
    hf = random_hf_model(arch, **overrides)
    return hf, minillm.from_transformers(hf)


def test_config_is_read_faithfully(pair):
    """The converted config has the shape switches of the original."""
    hf, ours = pair
    c, h = ours.config, hf.config
    head_dim = getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (h.num_attention_heads, h.num_key_value_heads, head_dim)
    assert c.tie_embeddings == h.tie_word_embeddings
    assert ours.num_parameters() == hf.num_parameters(), "parameter counts differ (a tied matrix counts once)"


def test_full_forward_logits_match(pair):
    """fp32 logits of a full forward agree with transformers' .logits to 1e-4 (relative to scale)."""
    hf, ours = pair
    tokens = torch.randint(0, hf.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == expected.shape == (3, 24, hf.config.vocab_size)
    err = (got - expected).abs().max().item()
    assert err <= tolerance(expected), f"max |Δ logits| = {err:.2e}, allowed {tolerance(expected):.2e}"


def test_cached_decode_matches_full_forward(pair):
    """Prefill 5 tokens, then decode one token at a time through the KV cache: every position's
    logits equal the full forward's, and a multi-token chunk after the prefill does too."""
    _, ours = pair
    tokens = torch.randint(0, ours.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = ours(tokens)
        cache = KVCache(ours.config, batch_size=2, max_len=20)
        steps = [ours(tokens[:, :5], cache=cache)]
        steps.append(ours(tokens[:, 5:9], cache=cache))  # a chunk of 4 after the prefill
        for t in range(9, 20):
            steps.append(ours(tokens[:, t : t + 1], cache=cache))
    stepped = torch.cat(steps, dim=1)
    err = (stepped - full).abs().max().item()
    assert cache.seq_len == 20
    assert err <= tolerance(full), f"cached decode differs from the full forward by {err:.2e}"


def test_greedy_32_tokens_match_transformers_generate(pair):
    """Greedy continuations of 32 tokens are token-for-token identical to generate(do_sample=False)."""
    hf, ours = pair
    prompt = torch.randint(2, hf.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    expected = hf.generate(
        prompt, do_sample=False, max_new_tokens=32, min_new_tokens=32, pad_token_id=0
    )[0, 7:].tolist()
    out = minillm.generate(ours, prompt[0].tolist(), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert out.token_ids == expected, f"first difference at step {_first_diff(out.token_ids, expected)}"


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_fp32(dtype):
    """bf16 / fp16 models run and stay close to the fp32 logits (their rounding, not a bug)."""
    hf = random_hf_model("llama")
    ours32 = minillm.from_transformers(hf)
    ours = minillm.from_transformers(hf.to(dtype))
    assert ours.dtype == dtype and ours.rotary.inv_freq.dtype == torch.float32
    tokens = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref, got = ours32(tokens), ours(tokens).float()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 3e-2, f"{dtype} logits differ from fp32 by {rel:.3f} (relative L2)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_transformers(dtype):
    """On a GPU, minillm and transformers agree in fp32 (tightly) and bf16 (to bf16 rounding),
    and greedy generation runs."""
    hf = random_hf_model("llama", num_attention_heads=8, num_key_value_heads=2).to("cuda", dtype)
    ours = minillm.from_transformers(hf)
    tokens = torch.randint(0, 320, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    with torch.no_grad():
        expected, got = hf(tokens).logits.float(), ours(tokens).float()
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < (1e-4 if dtype == torch.float32 else 2e-2), f"relative error {rel:.2e} on cuda {dtype}"
    out = minillm.generate(ours, [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out.token_ids) == 8


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                                  YARN_ROPE, YARN_MSCALE_ROPE, dict(YARN_ROPE, attention_factor=1.3)])
def test_rope_frequencies_equal_transformers(rope):
    """Scaled rotary frequencies (and YaRN's attention factor) equal transformers' own computation."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minillm.model import rope_attention_factor, rope_inverse_frequencies

    hf_config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=dict(rope))
    expected, expected_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    d = hf_config.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    config = minillm.ModelConfig.from_hf(d)
    torch.testing.assert_close(rope_inverse_frequencies(config), expected, rtol=1e-6, atol=0)
    assert rope_attention_factor(config) == pytest.approx(expected_factor, rel=1e-9)
