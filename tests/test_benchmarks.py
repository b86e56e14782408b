"""The benchmark scripts still run and write what the chapters read (tiny settings, on the CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from minillm import metrics

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def phases(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("phases", None)
    import phases

    return phases


def test_phases_writes_rows_whose_flops_and_bytes_are_the_metrics_formulas(phases, tmp_path, capsys):
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
    assert row["flops"] == pytest.approx(3 * metrics.flops_per_token(model_cfg, 8))
    kv = metrics.kv_cache_bytes(model_cfg, 8, 3, 4)  # fp32: 32-bit weights, 4-byte KV
    assert row["bytes"] == pytest.approx(metrics.weight_bytes_read(model_cfg, 3, 32) + kv)
    assert row["tokens_per_s"] == pytest.approx(3 / (row["step_ms"] / 1e3))
    assert data["prefill_vs_length"][0]["prompt_len"] == 8
    assert data["datasheet"] is None and "gpu_memory" not in data  # no GPU: no datasheet roofline claimed
