"""The engine's CPU paths in two source trees, alternated: did a change make anything slower on a CPU? (chapter 05)

Measured in each tree, on the shipped model (fp32, `--threads` threads), in a fresh process per tree and round:
- `continuous_tok_s`: `LLM.generate` on chapter 05's workload (32 requests, heavy-tailed outputs, max_num_seqs 8);
- `mixed_step_ms`: the engine step that runs 8 decodes beside a newly arrived 900-token prompt (budget 1,024);
- `decode_step_ms`: the engine's decode steps of those 9 requests that follow it;
- `ragged_prompts_ms`: one step of four prompt chunks of 40, 300, 120 and 600 tokens;
- `generate_tok_s`: `minillm.generate` at batch 1, 128 new tokens (what `benchmarks/decode_batch1.py` times).
Medians of 3 inside each process. Only public APIs are used, so an older tree runs the same code.

    python benchmarks/engine_paths.py --trees BASELINE_DIR . --labels before after   # results/engine_paths/cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(threads: int) -> dict:
    """Run in the tree on PYTHONPATH: the five figures, one JSON line."""
    import numpy as np
    import torch

    import minillm
    from minillm.decoding.llm import LLM
    from minillm.engine import LLMEngine
    from minillm.eval.bench import SHAKESPEARE
    from minillm.sampler.sampling import SamplingParams

    torch.set_num_threads(threads)
    model, tok = minillm.load(minillm.DEFAULT_MODEL)
    ids = tok.encode(SHAKESPEARE * 20)
    rng = np.random.default_rng(0)
    out_lens = np.clip(rng.lognormal(math.log(40), 0.8, 32), 4, 200).astype(int).tolist()
    prompts = [ids[i * 7: i * 7 + n] for i, n in enumerate(rng.integers(16, 65, 32).tolist())]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    res: dict = {}
    llm = LLM(model, tok, max_num_seqs=8)
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    res["continuous_tok_s"] = statistics.median(runs)
    mixed, decode, ragged = [], [], []
    for _ in range(3):
        engine = LLMEngine(model, tok, max_num_seqs=16, max_num_batched_tokens=1024)
        for i in range(8):
            engine.add_request(str(i), ids[i * 13: i * 13 + 16], SamplingParams(temperature=0, max_tokens=50,
                                                                                ignore_eos=True))
        for _ in range(3):
            engine.step()
        engine.add_request("long", ids[200:1100], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        start = time.perf_counter()
        engine.step()
        mixed.append(time.perf_counter() - start)
        for _ in range(4):
            start = time.perf_counter()
            engine.step()
            decode.append(time.perf_counter() - start)
        engine = LLMEngine(model, tok, max_num_seqs=16, max_num_batched_tokens=2048)
        for i, n in enumerate((40, 300, 120, 600)):
            engine.add_request(f"p{i}", ids[300 * i: 300 * i + n], SamplingParams(max_tokens=1))
        start = time.perf_counter()
        engine.step()
        ragged.append(time.perf_counter() - start)
    res["mixed_step_ms"] = 1e3 * statistics.median(mixed)
    res["decode_step_ms"] = 1e3 * statistics.median(decode)
    res["ragged_prompts_ms"] = 1e3 * statistics.median(ragged)
    gen = []
    for _ in range(3):
        out = minillm.generate(model, "ROMEO.\n", SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), tok)
        gen.append(out.decode_tokens_per_s)
    res["generate_tok_s"] = statistics.median(gen)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=["."], help="source trees (each with minillm/ and kernels/)")
    parser.add_argument("--labels", nargs="+", help="a name for each tree in the results (default: its folder's name)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child process's part
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.threads)))
        return
    from common import write_results

    labels = args.labels or [Path(tree).resolve().name for tree in args.trees]
    if len(labels) != len(args.trees):
        sys.exit(f"give one label per tree: {len(args.trees)} trees, {len(labels)} labels.")
    rows: dict[str, list[dict]] = {label: [] for label in labels}
    for round_ in range(args.rounds):
        for tree, label in zip(args.trees, labels):
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve()), "OMP_NUM_THREADS": str(args.threads)}
            done = subprocess.run([sys.executable, __file__, "--measure", "--threads", str(args.threads)], env=env,
                                  capture_output=True, text=True, check=True)
            rows[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {round_ + 1}, {label}: {rows[label][-1]}", flush=True)
    medians = {label: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for label, runs in rows.items()}
    path = write_results("engine_paths/cpu", {"benchmark": "the engine's CPU paths in several source trees, "
                                              "alternated (fresh process per tree and round)",
                         "settings": {k: v for k, v in vars(args).items() if k not in ("trees", "measure")},
                         "runs": rows, "medians": medians})
    for label, m in medians.items():
        print(f"{label}: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
