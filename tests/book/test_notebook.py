"""minillm.book.notebook, the chapters' helper module: set-up, timing, results files, paths, op counts."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from minillm.book import notebook


def test_median_time_returns_the_median_of_the_timed_calls(monkeypatch):
    # perf_counter is read twice per timed call: durations 5, 1, 9, 3, 7 seconds -> median 5.
    ticks = iter([0, 5, 10, 11, 20, 29, 30, 33, 40, 47])
    monkeypatch.setattr(notebook.time, "perf_counter", lambda: next(ticks))
    calls = []
    assert notebook.median_time(lambda: calls.append(1), repeats=5, warmup=2) == 5
    assert len(calls) == 7, "2 warm-up calls (untimed) and 5 timed ones"


def test_median_time_rejects_no_repeats():
    with pytest.raises(ValueError, match="repeats >= 1"):
        notebook.median_time(lambda: None, repeats=0)


def _write_results(folder, name, **extra):
    data = {"date": "2026-11-22T07:42:57Z", "commit": "d146f18",
            "machine": {"cpu": "Some CPU", "gpu": "NVIDIA H100 80GB HBM3"},
            "versions": {"torch": "2.11.0+cu130"}, **extra}
    path = folder / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_load_results_prints_where_and_when_it_was_measured(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(notebook, "RESULTS_DIR", tmp_path)
    _write_results(tmp_path, "phases/cuda_llama-3-8b", rows=[1, 2])
    data = notebook.load_results("phases/cuda_llama-3-8b")
    assert data["rows"] == [1, 2]
    assert capsys.readouterr().out == (
        "loaded results/phases/cuda_llama-3-8b.json: NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, "
        "commit d146f18, 2026-11-22\n"
    )


@pytest.mark.parametrize("name, names", [
    ("phases/cuda_llama-3-8b", ["benchmarks/phases.py", "NVIDIA GPU", "llama-3-8b"]),
    ("attention/cuda", ["benchmarks/attention.py", "NVIDIA GPU"]),
    ("constrained_overhead/cpu", ["benchmarks/constrained_overhead.py", "on a CPU"]),
    ("roofline/archive/roofline_cuda_b1_ab_after_r1", ["benchmarks/roofline.py", "NVIDIA GPU", "b1_ab_after_r1",
                                                      "archive"]),
])
def test_load_results_names_the_benchmark_that_writes_a_missing_file(tmp_path, monkeypatch, name, names):
    monkeypatch.setattr(notebook, "RESULTS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        notebook.load_results(name)
    message = str(err.value)
    assert f"results/{name}.json is missing" in message
    for part in names:
        assert part in message, f"the message should name {part!r}: {message}"
    assert str(tmp_path) not in message, "the message must not show this machine's absolute path"


def test_load_results_asks_for_the_folder_of_a_flat_name():
    with pytest.raises(ValueError, match="BENCHMARK/FILE, e.g. 'attention/cuda'"):
        notebook.load_results("attention_cuda")


def test_every_committed_results_file_names_an_existing_benchmark():
    paths = sorted(notebook.RESULTS_DIR.rglob("*.json"))
    assert paths, "results/ holds the committed results"
    for path in paths:
        name = path.relative_to(notebook.RESULTS_DIR).with_suffix("").as_posix()
        script = notebook._benchmark_for(name).split()[0]
        assert (notebook.REPO_ROOT / script).is_file(), f"results/{name}.json points to {script}, which does not exist"


def test_repo_relative_gives_a_posix_path_inside_the_repository_and_refuses_outside(tmp_path):
    assert notebook.repo_relative(notebook.REPO_ROOT / "minillm" / "book" / "notebook.py") == "minillm/book/notebook.py"
    assert notebook.repo_relative(notebook.REPO_ROOT / "minillm" / ".." / "book.yml") == "book.yml"
    with pytest.raises(ValueError, match="not inside the minillm repository"):
        notebook.repo_relative(tmp_path / "elsewhere.txt")


def test_setup_sets_the_environment_seed_and_plot_style(monkeypatch):
    import matplotlib.pyplot as plt

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    threads = torch.get_num_threads()
    try:
        notebook.setup(seed=3, threads=1)
        assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
        assert torch.get_num_threads() == 1
        assert plt.rcParams["figure.dpi"] == notebook.PLOT_STYLE["figure.dpi"]
        first = torch.rand(3)
        notebook.setup(seed=3)
        assert torch.equal(torch.rand(3), first), "setup(seed) must seed torch"
    finally:
        torch.set_num_threads(threads)


def test_setup_refuses_triton_interpret_after_triton_was_imported(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("on a GPU triton_interpret does nothing")
    monkeypatch.setitem(sys.modules, "triton", object())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="before minillm.load"):
        notebook.setup(triton_interpret=True)
    monkeypatch.delitem(sys.modules, "triton")
    notebook.setup(triton_interpret=True)
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_count_ops_counts_operations_that_move_data_not_views():
    x = torch.randn(4, 8)
    counts = notebook.count_ops(lambda: (x.view(8, 4).t() * 2 + 1).float().sum())
    assert counts == {"mul": 1, "add": 1, "sum": 1}, counts
    y = torch.zeros(3)
    assert notebook.count_ops(lambda: y.copy_(torch.ones(3))) == {"ones": 1, "copy_": 1}


def test_count_ops_finds_the_nine_kernels_of_unfused_add_rmsnorm():
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x + residual
        hf = h.float()
        return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)

    x, r, w = (torch.randn(2, 16, dtype=torch.bfloat16) for _ in range(3))
    assert sum(notebook.count_ops(lambda: add_rms_norm(x, r, w[0])).values()) == 9


def test_token_label_and_one_line():
    class Tok:
        def decode(self, ids: list[int]) -> str:
            return {1: " the", 2: "\n"}[ids[0]]

    assert notebook.token_label(Tok(), 1) == "␣the" and notebook.token_label(Tok(), 2) == "⏎"
    assert notebook.one_line("a\nb", 10) == "a⏎b"
    assert notebook.one_line("abcdefghij", 5) == "abcd…" and len(notebook.one_line("x" * 50, 20)) == 20
    with pytest.raises(ValueError, match="width"):
        notebook.one_line("abc", 1)


def test_tqdm_is_tqdm_auto_imported_without_the_ipywidgets_warning():
    from tqdm.auto import tqdm as auto_tqdm

    assert notebook.tqdm is auto_tqdm
