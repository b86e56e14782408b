"""Where the engine's decode step spends the GPU's time, kernel by kernel, against its bare graph replay (issue 30).

`LLMEngine` (async scheduling, CUDA graphs) decodes B requests of `--context` random prompt tokens on Llama-3.2-1B's
shape (random bf16 weights, greedy). Once every row decodes with its graph captured, `--steps` engine steps run under
torch.profiler, then as many bare replays of the same graph. Per step, for each:

- the wall time (under the profiler, which slows the host: compare the two, not with other benchmarks),
- the GPU's busy time (kernels and copies, overlapping intervals merged) and its idle time,
- each kernel name's GPU time and count.

The kernels of the engine's step that the bare replay does not run (by name, time beyond the replay's) are the
work around the graph: the input copy, sampling, log-probabilities, the tokens' copy back. The rest of the
difference between the engine's step and the replay is the GPU waiting.

    python benchmarks/engine_step_profile.py     # a CUDA GPU: writes results/engine_step_profile/cuda.json
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch
from common import write_results
from engine_throughput import random_llama_1b
from overlap_timeline import merge

from minillm import arithmetic
from minillm.engine import LLMEngine
from minillm.sampler.sampling import SamplingParams


def profiled(fn, steps: int) -> dict:  # noqa: ANN001
    """fn() `steps` times under torch.profiler: per step, wall and GPU busy microseconds, and each kernel name's
    GPU microseconds and count."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("window"):
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
    events = prof.events()
    window = next(e for e in events if e.name == "window")
    intervals, by_name, counts = [], defaultdict(float), defaultdict(int)
    for e in events:
        if e.device_type.name != "CUDA":
            continue
        intervals.append((e.time_range.start, e.time_range.end))
        name = e.name[:90]
        by_name[name] += e.time_range.elapsed_us() / steps
        counts[name] += 1
    busy = sum(e - s for s, e in merge(intervals))
    wall = window.time_range.elapsed_us()
    return {"wall_us": wall / steps, "gpu_busy_us": busy / steps, "gpu_idle_us": (wall - busy) / steps,
            "kernel_us": dict(sorted(by_name.items(), key=lambda kv: -kv[1])),
            "kernels_per_step": {k: v / steps for k, v in counts.items()}}


def run(model, batch: int, context: int, steps: int) -> dict:  # noqa: ANN001
    engine = LLMEngine(model, None, num_blocks=batch * arithmetic.kv_blocks(context + 4 * steps + 64, 16) + 2,
                       max_num_seqs=batch, max_num_batched_tokens=max(8 * context, batch), enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    for p in torch.randint(2, model.config.vocab_size, (batch, context), generator=g).tolist():
        engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=4 * steps + 48, ignore_eos=True))
    while engine.last_step is None or engine.last_step.num_prefill_tokens or engine.graphs is None:
        engine.step()
    for _ in range(steps):  # warm: every row decoding, graphs captured, the profiler's first-use costs paid
        engine.step()
    step = profiled(engine.step, steps)
    size = min(s for s in engine.graphs.graphs if s >= batch)
    replay = profiled(engine.graphs.graphs[size].replay, steps)
    replay_names = replay["kernel_us"]
    outside = {name: us - replay_names.get(name, 0.0) for name, us in step["kernel_us"].items()}
    outside = {name: us for name, us in sorted(outside.items(), key=lambda kv: -kv[1]) if us > 0.5}
    return {"batch": batch, "context": context, "steps": steps, "engine_step": step, "replay": replay,
            "outside_graph_kernel_us": outside}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--name", default="cuda", help="the results file: results/engine_step_profile/<name>.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/engine_step_profile.py needs a CUDA GPU.")
    _, model = random_llama_1b()
    rows = [run(model, b, args.context, args.steps) for b in args.batches]
    path = write_results(f"engine_step_profile/{args.name}", {
        "benchmark": "engine decode step against its bare graph replay, under torch.profiler; Llama-3.2-1B shape, "
                     "random bf16 weights, greedy",
        "settings": vars(args), "rows": rows})
    for r in rows:
        s, p = r["engine_step"], r["replay"]
        print(f"batch {r['batch']}: engine step {s['wall_us']:.0f} us (GPU busy {s['gpu_busy_us']:.0f}, idle "
              f"{s['gpu_idle_us']:.0f}); replay {p['wall_us']:.0f} us (busy {p['gpu_busy_us']:.0f}, idle "
              f"{p['gpu_idle_us']:.0f}); kernels outside the graph:")
        for name, us in list(r["outside_graph_kernel_us"].items())[:12]:
            print(f"    {us:7.1f} us  x{s['kernels_per_step'].get(name, 0):.0f}  {name}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
