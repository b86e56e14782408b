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

