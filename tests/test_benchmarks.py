"""The benchmark scripts still run and write what the chapters read (tiny settings, on the CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from minillm import arithmetic

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def phases(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("phases", None)
    import phases

    return phases


def test_phases_writes_rows_whose_flops_and_bytes_are_the_arithmetic_formulas(phases, tmp_path, capsys):
    out = tmp_path / "phases_test"
    assert phases.main(["--device", "cpu", "--model", "shipped", "--batches", "1", "3", "--contexts", "8", "16",
                        "--context-batches", "2", "--prompt-lens", "8", "--decode-context", "8", "--repeats", "1",
                        "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert {"date", "commit", "machine", "versions"} <= data.keys()
    assert [r["batch"] for r in data["decode_vs_batch"]] == [1, 3]
    assert [(r["batch"], r["context"]) for r in data["decode_vs_context"]] == [(2, 8), (2, 16)]
    model_cfg = phases.build_model("shipped", phases.torch.device("cpu"), phases.torch.float32, 16).config
    row = data["decode_vs_batch"][1]
    assert row["flops"] == pytest.approx(3 * arithmetic.flops_per_token(model_cfg, 8))
    kv = arithmetic.kv_cache_bytes(model_cfg, 8, 3, 4)  # fp32: 32-bit weights, 4-byte KV
    assert row["bytes"] == pytest.approx(arithmetic.weight_bytes_read(model_cfg, 3, 32) + kv)
    assert row["tokens_per_s"] == pytest.approx(3 / (row["step_ms"] / 1e3))
    assert data["prefill_vs_length"][0]["prompt_len"] == 8
    assert data["datasheet"] is None and "gpu_memory" not in data  # no GPU: no datasheet roofline claimed


def test_gqa_quality_writes_a_row_per_kv_head_count(monkeypatch, tmp_path):
    """The chapter 03 quality script on fake token ids: one row per divisor of the target's K/V heads,
    the unconverted count marked as the control, the uptraining budget stated against pre-training."""
    import torch
    from safetensors.torch import save_file

    import minillm
    from minillm.checkpoints import SHIPPED_MODELS_DIR

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("gqa_quality", None)
    import gqa_quality

    data = tmp_path / "data"
    data.mkdir()
    (data / "tokenizer.json").write_bytes((SHIPPED_MODELS_DIR / minillm.DEFAULT_MODEL / "tokenizer.json").read_bytes())
    ids = torch.randint(2, 4096, (2, 600), generator=torch.Generator().manual_seed(0))
    save_file({"train": ids[0].contiguous(), "val": ids[1].contiguous()}, str(data / "tokens.safetensors"))
    out = tmp_path / "gqa_quality_test"
    assert gqa_quality.main(["--data", str(data), "--steps", "2", "--batch-size", "1", "--seq-len", "32",
                             "--eval-windows", "1", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert {"date", "commit", "machine", "versions"} <= result.keys()
    assert [r["n_kv_heads"] for r in result["rows"]] == [2, 1]
    assert [r["control"] for r in result["rows"]] == [True, False]
    assert result["rows"][0]["val_ppl_converted"] == result["shipped_val_ppl"]
    assert result["rows"][1]["kv_cache_bytes_per_token_bf16"] * 2 == result["rows"][0]["kv_cache_bytes_per_token_bf16"]
    assert result["uptraining_vs_pretraining"]["uptrain_tokens"] == 2 * 1 * 32


def test_quant_quality_on_the_real_model_scores_both_texts_against_the_q4_1_reference(monkeypatch, tmp_path):
    """Chapter 06's table on SmolLM2 at tiny settings: the reference row has KL 0 and the file's 5 bits; a KV-cache
    row keeps the weights; int8 weights move perplexity little; the Q4_1 grid has at most 16 values a block."""
    from minillm.shipped import CHAT_MODEL, installed_models

    if CHAT_MODEL not in installed_models():
        pytest.skip(f"{CHAT_MODEL} is not installed (make setup)")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("quant_quality", None)
    import quant_quality

    with pytest.raises(SystemExit, match="starting with fp32"):
        quant_quality.main(["--model", CHAT_MODEL, "--rows", "int8"])
    out = tmp_path / "quant_quality_test"
    assert quant_quality.main(["--model", CHAT_MODEL, "--seq-len", "16", "--eval-windows", "2", "--calib-seqs", "1",
                               "--rows", "fp32,int8,kv-fp8", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert {"date", "commit", "machine", "versions"} <= result.keys()
    fp32, int8, kv = result["rows"]
    assert [r["key"] for r in result["rows"]] == ["fp32", "int8", "kv-fp8"]
    assert fp32["book_kl"] == fp32["shakespeare_kl"] == 0 and fp32["block_bits_per_weight"] == 5.0
    assert kv["block_bits_per_weight"] == 5.0 and kv["weight_rel_error"] == 0 and kv["book_kl"] > 0
    assert 8 < int8["block_bits_per_weight"] < 8.1 and 0 < int8["weight_rel_error"] < 0.02
    assert abs(int8["book_ppl_change"]) < 0.05
    grid = result["q4_1_grid"]
    assert grid["max_distinct_per_block"] <= 16
    assert grid["blocks"] * 32 == 30 * 576 * (960 + 576 + 3072 + 1536)  # 30 blocks: qkv, o, gate_up, down


def test_busy_time_counts_overlapping_kernels_once(monkeypatch):
    """The profiles' GPU busy time (roofline.py, engine_step_profile.py, overlap_timeline.py) is the union of the
    kernels' intervals: kernels that overlap, as under programmatic dependent launch, count once."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("overlap_timeline", None)
    from overlap_timeline import merge

    spans = [(5.0, 9.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0), (6.0, 7.0)]
    assert merge(spans) == [(0.0, 4.0), (5.0, 9.0)]
    assert sum(end - start for start, end in merge(spans)) == 8.0  # against 11 summed kernel by kernel
    assert merge([]) == []



def test_speculative_ngram_accounts_for_steps_that_drafted_nothing_or_fewer_than_k(monkeypatch):
    """Chapter 07's n-gram benchmark: the formula applied at each step's own draft length, and the steps
    without a draft counted as one-token decode steps."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("speculative_ngram", None)
    import speculative_ngram

    from minillm.sampler.speculative import SpeculativeStats

    stats = SpeculativeStats()
    stats.record(4, 4)  # all four drafts kept: 5 tokens
    stats.record(2, 0)  # lookup found 2 tokens, the first rejected: 1 token
    r = speculative_ngram.row(stats, n_out=10, k=4)  # 1 from prefill, 6 from the verify steps, 3 plain steps
    assert r["decode_forwards"] == 5 and r["verify_steps"] == 2
    assert r["proposal_rate"] == pytest.approx(2 / 5)
    assert r["alpha"] == pytest.approx(4 / 5)  # 4 accepted of 5 checked
    assert r["draft_lengths"] == {4: 1, 2: 1}
    e = lambda j: arithmetic.expected_tokens_per_step(0.8, j)  # noqa: E731
    assert r["formula_at_k"] == pytest.approx(e(4))
    assert r["formula_at_draft_lengths"] == pytest.approx((e(4) + e(2)) / 2)
    assert r["tokens_per_decode_forward"] == pytest.approx(9 / 5)
    assert r["predicted_tokens_per_decode_forward"] == pytest.approx(0.4 * (e(4) + e(2)) / 2 + 0.6)


def test_speculative_controlled_construction_gives_the_acceptance_it_was_built_for(monkeypatch, tmp_path):
    """The controlled-acceptance pair (tiny, CPU): the scripted target's greedy output follows its permutation, the
    speculative engine gives the plain engine's tokens, and the measured alpha is near the one the script asked for
    (0 exactly at 0; the prompt-lookup rows on the cycle accept every draft)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("speculative_controlled", None)
    import speculative_controlled

    out = tmp_path / "controlled"
    assert speculative_controlled.main(["--tiny", "--alphas", "0", "0.8", "--ks", "4", "--batches", "1", "3",
                                        "--prompt-len", "32", "--new-tokens", "64", "--repeats", "1",
                                        "--name", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert all(p["follows_perm"] == 1.0 for p in data["plain"].values())
    assert not data["errors"] and len(data["rows"]) == 8 and len(data["ngram"]) == 2
    assert [r["adaptive"] for r in data["rows"]] == [False] * 4 + [True] * 4  # k = 4 again, with the DraftGate
    for row in data["rows"]:
        assert row["tokens_equal_plain"]
        assert row["measured_alpha"] == 0 if row["alpha"] == 0 else abs(row["measured_alpha"] - 0.8) < 0.15
    assert all(r["tokens_equal_plain"] and r["measured_alpha"] == 1.0 for r in data["ngram"])


def test_a_results_file_names_a_commit_a_reader_can_check_out(monkeypatch, tmp_path):
    """From a tree with uncommitted changes, write_results refuses to write into results/ (its commit would read
    "-dirty", no commit anyone can check out) and keeps the run's numbers in a file it names; MINILLM_ALLOW_DIRTY
    writes one anyway, and a file outside results/ (a test's) is written either way."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import common

    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setenv("MINILLM_COMMIT", "abc1234-dirty")
    monkeypatch.delenv("MINILLM_ALLOW_DIRTY", raising=False)
    with pytest.raises(RuntimeError, match="uncommitted changes") as refused:
        common.write_results("toy/cpu", {"tokens_per_s": 123.0})
    kept = Path(str(refused.value).split("results are in ")[1].split(";")[0])
    assert json.loads(kept.read_text())["tokens_per_s"] == 123.0 and not (tmp_path / "results").exists()
    assert common.write_results(str(tmp_path / "elsewhere"), {"x": 1}).is_file()
    monkeypatch.setenv("MINILLM_ALLOW_DIRTY", "1")
    assert json.loads(common.write_results("toy/cpu", {"x": 2}).read_text())["commit"] == "abc1234-dirty"
    monkeypatch.setenv("MINILLM_COMMIT", "abc1234")
    monkeypatch.delenv("MINILLM_ALLOW_DIRTY")
    assert json.loads(common.write_results("toy/cpu", {"x": 3}).read_text())["x"] == 3
