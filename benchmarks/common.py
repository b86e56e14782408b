"""What every results file records beside its numbers: machine, versions, commit, date."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from minillm.book.notebook import cpu_name  # one definition, shared with the chapters

RESULTS = Path(__file__).resolve().parent.parent / "results"


def git_commit() -> str:
    """The checked-out commit (+"-dirty" with uncommitted changes); $MINILLM_COMMIT where there is no git."""
    if os.environ.get("MINILLM_COMMIT"):
        return os.environ["MINILLM_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance() -> dict[str, Any]:
    """Machine, library versions, commit and date, for the header of a results file."""
    import transformers

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    if torch.cuda.is_available():
        info["machine"]["gpu"] = torch.cuda.get_device_name()
        info["versions"]["cuda"] = torch.version.cuda
        try:
            import triton

            info["versions"]["triton"] = triton.__version__
        except ImportError:
            pass
    return info


def results_name(benchmark: str, out: str | None, default: str) -> str:
    """The `write_results` name of a script's --out: BENCHMARK/OUT (BENCHMARK/DEFAULT without one), or OUT itself
    when it is an absolute path (a file outside results/, as the tests write)."""
    if out and Path(out).is_absolute():
        return out
    return f"{benchmark}/{out or default}"


def write_results(name: str, results: dict[str, Any]) -> Path:
    """Write results/<name>.json with the provenance header; return the path.

    The name is BENCHMARK/FILE: the script's own name, then the device and an optional qualifier, e.g.
    "attention/cuda" or "phases/cuda_llama-3-8b" (the rule is in results/README.md). A chapter reads the
    file back with `load_results(name)`; `python -m minillm.book.results_index` then updates the index.
    An absolute name is a file outside results/ (the tests' temporary files): `results_name`.
    """
    path = Path(f"{name}.json") if Path(name).is_absolute() else RESULTS / f"{name}.json"
    header = provenance()
    text = json.dumps({**header, **results}, indent=2) + "\n"
    if header["commit"].endswith("-dirty") and path.is_relative_to(RESULTS) and not os.environ.get(
            "MINILLM_ALLOW_DIRTY"):
        # A committed results file names the commit that measured it; "-dirty" names none a reader can check out.
        kept = Path(tempfile.mkstemp(prefix=f"{path.stem}_", suffix=".json")[1])
        kept.write_text(text)
        raise RuntimeError(f"not writing results/{name}.json from a tree with uncommitted changes ({header['commit']}):"
                           f" commit them and run again, so that the file names a commit. This run's results are "
                           f"in {kept}; MINILLM_ALLOW_DIRTY=1 writes such a file anyway (a trial, not for the book).")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
