"""The book's notebook helpers: one set-up call and the small utilities every chapter uses.

This is book machinery, not engine: nothing in the engine imports it, and a reader studying how
inference works can skip it. A chapter's first cell is

    import minillm
    from minillm.book import notebook
    notebook.setup()                          # environment, warnings, plot style, seed
    model, tokenizer = minillm.load(minillm.DEFAULT_MODEL)
    print(notebook.environment())

and later cells time code with `median_time`, read the committed GPU results with `load_results`,
print paths with `repo_relative` (never this machine's absolute path), and show progress with
`tqdm` (import it from here: see below).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

with warnings.catch_warnings():
    # Without ipywidgets, tqdm.auto falls back to text progress bars (fine in a notebook and on the
    # site) and warns once, at import, with a path of this machine: import it here, quietly.
    warnings.filterwarnings("ignore", message="IProgress not found")
    from tqdm.auto import tqdm

__all__ = ["PLOT_STYLE", "REPO_ROOT", "RESULTS_DIR", "count_ops", "cpu_name", "environment", "load_results",
           "median_time", "one_line", "repo_relative", "setup", "token_label", "tqdm"]

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The folder that holds `minillm/`, `chapters/`, `benchmarks/` and `results/`."""

RESULTS_DIR = REPO_ROOT / "results"
"""Benchmark results committed with the repository: results/<benchmark>/<device>[_<qualifier>].json, one folder
per script of benchmarks/, earlier runs in its archive/ (results/README.md is the index)."""

PLOT_STYLE: dict[str, Any] = {"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "axes.axisbelow": True}
"""matplotlib rcParams every chapter's figures share."""


def setup(seed: int = 0, *, threads: int | None = None, triton_interpret: bool = False) -> None:
    """Prepare a notebook: call once, at the top of a chapter, before loading a model.

    * `TOKENIZERS_PARALLELISM=false` (unless already set): no fork warnings from the Rust tokenizer.
    * Silences tqdm's "IProgress not found" warning (libraries such as `transformers` import
      `tqdm.auto` too): without ipywidgets it falls back to text bars, which is fine, and the
      warning would print a path of this machine. Import the chapter's own progress bar as
      `from minillm.book.notebook import tqdm`, which is `tqdm.auto.tqdm` imported without the warning.
    * matplotlib's style: `PLOT_STYLE`.
    * `torch.manual_seed(seed)`, and `torch.set_num_threads(threads)` if `threads` is given.
    * `triton_interpret=True` and no CUDA: sets `TRITON_INTERPRET=1`, so that Triton kernels run on the
      CPU through Triton's interpreter. Triton reads it when it is imported (loading a model imports
      it), so this raises RuntimeError if triton was imported before without it. On a GPU the kernels
      are compiled for real and the option does nothing.

    Introduced in chapter 00.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", message="IProgress not found")
    if triton_interpret and not torch.cuda.is_available():
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "triton was imported before notebook.setup(triton_interpret=True), so its kernels were "
                "defined for a GPU; call setup first (before minillm.load), or restart the kernel."
            )
        os.environ["TRITON_INTERPRET"] = "1"
    import matplotlib.pyplot as plt

    plt.rcParams.update(PLOT_STYLE)
    torch.manual_seed(seed)
    if threads is not None:
        torch.set_num_threads(threads)


def environment() -> str:
    """One line naming what the page ran on: "minillm 0.1.0, torch 2.13.0+cpu, 2 CPU threads".

    Introduced in chapter 00.
    """
    from minillm import __version__

    return f"minillm {__version__}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads"


def cpu_name() -> str:
    """The CPU's model name: Linux's /proc/cpuinfo, else what `platform` knows. Introduced in chapter 00."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def repo_relative(path: str | os.PathLike[str]) -> str:
    """`path` relative to the repository root, as a POSIX string ("minillm/models/shakespeare-11m").

    Notebooks print this instead of an absolute path, which would name this machine's folders.
    Raises ValueError if `path` is outside the repository. Introduced in chapter 00.
    """
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        raise ValueError(f"{Path(path).name!r} is not inside the minillm repository; pass a path under it.") from None


def median_time(fn: Callable[[], object], repeats: int = 7, warmup: int = 1) -> float:
    """Median wall-clock seconds of `fn()` over `repeats` calls, after `warmup` untimed calls.

    The median ignores the occasional call slowed by the rest of the machine. For CPU code only:
    a GPU runs asynchronously, so GPU timings need a device synchronisation around each call
    (as `benchmarks/phases.py` does). Introduced in chapter 02.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}.")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _benchmark_for(name: str) -> str:
    """Which script writes results/<name>.json, and where.

    The name is BENCHMARK/DEVICE[_QUALIFIER] (e.g. "phases/cuda_llama-3-8b"), or BENCHMARK/archive/OLD_NAME for an
    earlier run kept under the flat name it was written with (e.g. "roofline/archive/roofline_cuda_b1_ab_after_r1").
    """
    script, _, file = name.partition("/")
    archived = file.startswith("archive/")
    file = file.removeprefix("archive/").removeprefix(f"{script}_")  # an old name repeats the script's
    device, _, qualifier = file.partition("_")
    text = f"benchmarks/{script}.py"
    if device in ("cpu", "cuda"):
        text += " on a machine with an NVIDIA GPU" if device == "cuda" else " on a CPU"
    if qualifier:
        text += f", for {qualifier!r}"
    return text + (" (an earlier run, kept in the archive)" if archived else "")


def load_results(name: str) -> dict[str, Any]:
    """The committed results file results/<name>.json, after printing where and when it was measured.

    The name is the file's path under results/ without ".json": "attention/cuda", "phases/cuda_llama-3-8b",
    or "roofline/archive/roofline_cuda_b1_ab_after_r1" for an earlier run (results/README.md lists them all).
    Prints one line, e.g. "loaded results/attention/cuda.json: NVIDIA H100 80GB HBM3, torch 2.11.0,
    commit 89d5220, 2026-11-22", from the provenance header every benchmark writes. Raises
    FileNotFoundError naming the benchmark script (and device, and variant) that produces a missing
    file, without this machine's absolute path.
    Introduced in chapter 02.
    """
    if "/" not in name:
        raise ValueError(f"load_results({name!r}): results are named BENCHMARK/FILE, e.g. 'attention/cuda' "
                         "(results/README.md lists every file)")
    path = RESULTS_DIR / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"results/{name}.json is missing: it is written by {_benchmark_for(name)} "
            "(the script's docstring gives the command)."
        )
    data = json.loads(path.read_text())
    machine, versions = data["machine"], data["versions"]
    commit = str(data["commit"])
    if commit.endswith("-dirty"):  # measured from a tree with uncommitted changes: say so in words
        commit = f"{commit.removesuffix('-dirty')} with uncommitted changes"
    print(f"loaded results/{name}.json: {machine.get('gpu', machine['cpu'])}, torch {versions['torch']}, "
          f"commit {commit}, {data['date'][:10]}")
    return data


def count_ops(fn: Callable[[], object]) -> Counter[str]:
    """The ATen operations `fn()` runs that produce or overwrite data, by name: {"mul": 57, ...}.

    Views (reshape, transpose, slicing) and casts to the dtype a tensor already has are left out,
    since they move no data. On a GPU each counted operation is at least one kernel launch, so this
    counts the launches an eager PyTorch step makes; it works the same on the CPU.
    Introduced in chapter 02.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Counter[str] = Counter()

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            outputs = out if isinstance(out, (tuple, list)) else [out]
            new = any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs for o in outputs)
            writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
            if new or writes:
                counts[func.overloadpacket.__name__] += 1
            return out

    with _Count():
        fn()
    return counts


def token_label(tokenizer: Any, token_id: int) -> str:
    """A token as a readable label: spaces as '␣', newlines as '⏎'. Introduced in chapter 01."""
    return tokenizer.decode([token_id]).replace(" ", "␣").replace("\n", "⏎")


def one_line(text: str, width: int = 110) -> str:
    """`text` on one line for a table: newlines as '⏎', cut to `width` characters with '…'.

    Introduced in chapter 01.
    """
    if width < 2:
        raise ValueError(f"width must be at least 2 characters, got {width}.")
    flat = text.replace("\n", "⏎")
    return flat if len(flat) <= width else flat[: width - 1] + "…"
