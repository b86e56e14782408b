"""Issue 52's probe: one tree's host step on a GPU, with what the process looks like around it.

The hall's A/B rounds (`benchmarks/hall_session.sh ab`) once found the tree after the restructuring 25-60% slower in
every stage of the host's step, stages whose code had not changed among them. A slower *process* (a busy host, a
thread, more objects for the collector) would look like that; slower *code* would not slow unchanged stages. So
this probe runs one tree's own `benchmarks/engine_host_step.host_step` (Llama-3.2-1B's shape, random bf16 weights,
CUDA graphs, async scheduling; batch 256, 60 timed steps) in a fresh process and records beside it: a fixed pure
Python loop timed before and after loading the model and after the steps (the host's speed, code aside), the
process's native and Python threads, its loaded modules, the collector's tracked objects and its collections
during the steps. One JSON line to stdout:

    python benchmarks/hall_probe.py ab_163b7a9 before >> runs.jsonl     # a tree made with git archive
    python benchmarks/hall_probe.py --collect runs.jsonl --name cuda_hall4   # -> results/hall_probe/<name>.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time


def python_loop_ms() -> float:
    """The best of 5 timings of 300,000 iterations of a plain Python loop, in ms: the host's speed at pure Python."""
    best = float("inf")
    for _ in range(5):
        start, x = time.perf_counter(), 0
        for i in range(300_000):
            x += i * i
        best = min(best, time.perf_counter() - start)
    return round(best * 1e3, 2)


def probe(tree: str, label: str, batch: int = 256, steps: int = 60) -> dict:
    """Run `tree`'s host step (its own minillm and benchmarks) in this process -> the row."""
    tree = os.path.abspath(tree)
    sys.path[:0] = [tree, os.path.join(tree, "benchmarks")]
    os.chdir(tree)
    out = {"label": label, "tree": os.path.basename(tree), "batch": batch, "python_loop_ms_start": python_loop_ms()}
    import engine_host_step
    from engine_throughput import random_llama_1b

    _, model = random_llama_1b()
    out["python_loop_ms_loaded"] = python_loop_ms()
    out.update(native_threads=len(os.listdir("/proc/self/task")), python_threads=threading.active_count(),
               modules=len(sys.modules), gc_objects=len(gc.get_objects()))
    collections = [s["collections"] for s in gc.get_stats()]
    row = engine_host_step.host_step(batch, steps, 512, model)
    out["gc_collections"] = [s["collections"] - c for s, c in zip(gc.get_stats(), collections)]
    out["python_loop_ms_after"] = python_loop_ms()
    out.update({k: round(row[k], 3) for k in ("median_step_ms", "min_step_ms", "wrapped_step_ms")})
    out["stages_ms"] = {k.split(".")[-1]: round(v, 3) for k, v in row["stages_ms"].items()}
    from common import provenance  # the tree's own (every tree since issue 30 has it)

    out["provenance"] = {k: v for k, v in provenance().items() if k in ("machine", "versions")}
    return out


def collect(path: str, name: str) -> str:
    """The runs of a JSON-lines file, with their medians by label, to results/hall_probe/<name>.json."""
    from common import write_results

    runs = [json.loads(line) for line in open(path) if line.startswith("{")]
    measured_on = runs[0].pop("provenance", None)  # the GPU machine's, in place of this one's
    for r in runs[1:]:
        r.pop("provenance", None)
    summary = {}
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = [r for r in runs if r["label"] == label]
        summary[label] = {"runs": len(mine), "median_step_ms": statistics.median(r["median_step_ms"] for r in mine),
                          "stages_ms": {k: statistics.median(r["stages_ms"].get(k, 0.0) for r in mine)
                                        for k in mine[0]["stages_ms"]}}
    measured = {k: measured_on[k] for k in ("machine", "versions")} if measured_on else {}
    return write_results(f"hall_probe/{name}", {**measured, "measured_on_note": (measured_on or {}).get("note"),
        "benchmark": "benchmarks/hall_probe.py: one tree's host step at batch 256 on a GPU, in a fresh process each "
                     "run, alternated with the other tree", "runs": runs, "summary": summary})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", nargs="?")
    parser.add_argument("label", nargs="?")
    parser.add_argument("--collect", metavar="RUNS_JSONL")
    parser.add_argument("--name", default="cuda")
    args = parser.parse_args()
    if args.collect:
        print(collect(args.collect, args.name))
    elif args.tree and args.label:
        print(json.dumps(probe(args.tree, args.label)), flush=True)
    else:
        parser.error("give TREE LABEL (one run), or --collect RUNS_JSONL")


if __name__ == "__main__":
    main()
