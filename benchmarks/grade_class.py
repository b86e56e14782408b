"""What isolation costs a teacher: `minillm grade` on a class, with bubblewrap, without, and an earlier grader.

A class of `--per-chapter` notebooks for each of chapters 04-07 (solved notebooks, and two blank
exercises per chapter), graded with `-j --jobs` by the command line, in rounds that alternate:

- `sandbox`:     this tree's grader, each notebook inside bubblewrap (the default);
- `no-sandbox`:  this tree's grader with `--no-sandbox` (the in-process limits only);
- `before`:      an earlier commit's grader, run by `--baseline-python`: an interpreter whose `minillm` is
                 that commit's (its sandbox process must import the same tree, so PYTHONPATH will not do).

Also the cost of bubblewrap alone: starting Python inside it against starting it plainly.

    # a baseline interpreter: the earlier tree first, then this venv's packages (not its editable minillm)
    mkdir /tmp/base && git archive COMMIT minillm book.yml | tar -x -C /tmp/base
    python3 -m venv /tmp/basevenv && SP=$(echo /tmp/basevenv/lib/python3*/site-packages)
    echo /tmp/base > $SP/a_tree.pth && echo $PWD/.venv/lib/python3*/site-packages > $SP/b_deps.pth
    python benchmarks/grade_class.py --baseline-python /tmp/basevenv/bin/python   # results/grade_class/cpu.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import write_results

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ("04_paging", "05_batching", "06_quantization", "07_speculative")


def make_class(folder: Path, per_chapter: int) -> int:
    """`folder/<student>/<chapter>.ipynb`: all but two students hand in the solution, two the blank exercise."""
    count = 0
    for chapter in CHAPTERS:
        for i in range(per_chapter):
            source = ROOT / ("exercises" if i >= per_chapter - 2 else "solutions") / f"{chapter}.ipynb"
            target = folder / f"student{i:02d}" / f"{chapter}.ipynb"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, target)
            count += 1
    return count


def grade_once(python: str, class_dir: Path, jobs: int, extra: list[str]) -> float:
    """Wall seconds of `minillm grade` run by the interpreter `python` (from an empty folder)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        proc = subprocess.run([python, "-m", "minillm.cli", "grade", str(class_dir), "-j", str(jobs),
                               "--no-progress", "--json", f"{out}/grades.json", *extra],
                              capture_output=True, text=True, env=env, cwd=out)
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"grading with {python} failed:\n{proc.stderr[-2000:]}")
    return seconds


def python_start_cost(repeats: int) -> dict[str, float]:
    """Median seconds to start Python and import the sandbox's harness, plainly and inside bubblewrap."""
    from minillm.book.grading.sandbox import bwrap_command

    code = "import minillm.book.grading.sandbox"
    times: dict[str, list[float]] = {"plain_s": [], "bwrap_s": []}
    with tempfile.TemporaryDirectory() as home:
        for _ in range(repeats):
            for key, prefix in (("plain_s", []), ("bwrap_s", bwrap_command(home))):
                start = time.perf_counter()
                subprocess.run([*prefix, sys.executable, "-c", code], check=True, capture_output=True)
                times[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-chapter", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline-python", help="an interpreter whose minillm is an earlier commit's (see above)")
    args = parser.parse_args()

    configs = {"sandbox": (sys.executable, []), "no-sandbox": (sys.executable, ["--no-sandbox"])}
    if args.baseline_python:
        configs["before"] = (args.baseline_python, [])
    times: dict[str, list[float]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        n = make_class(Path(tmp) / "class", args.per_chapter)
        for round_ in range(args.rounds):
            for name, (python, extra) in configs.items():
                seconds = grade_once(python, Path(tmp) / "class", args.jobs, extra)
                times[name].append(seconds)
                print(f"round {round_ + 1}: {name:<11} {seconds:6.1f} s for {n} notebooks", flush=True)
    start_cost = python_start_cost(repeats=5)
    median = {name: statistics.median(t) for name, t in times.items()}
    results = {
        "notebooks": n, "chapters": list(CHAPTERS), "jobs": args.jobs, "rounds": args.rounds,
        "baseline_python": args.baseline_python,
        "wall_s": times, "median_wall_s": median,
        "per_notebook_s": {name: m / n * args.jobs for name, m in median.items()},
        "python_start": start_cost,
        "bwrap_start_overhead_s": start_cost["bwrap_s"] - start_cost["plain_s"],
    }
    if "before" in median:
        results["sandbox_vs_before"] = median["sandbox"] / median["before"]
    write_results("grade_class/cpu", results)
    print(f"\n{'grader':<11} {'median s':>9} {'s/notebook (x jobs)':>20}")
    for name, m in median.items():
        print(f"{name:<11} {m:9.1f} {m / n * args.jobs:20.2f}")
    print(f"bubblewrap start: {start_cost['bwrap_s'] * 1e3:.0f} ms vs plain {start_cost['plain_s'] * 1e3:.0f} ms")
    if "before" in median:
        print(f"sandbox / before: {results['sandbox_vs_before']:.2f}x")


if __name__ == "__main__":
    main()
