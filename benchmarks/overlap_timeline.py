"""The host and the GPU on one timeline: the engine's decode steps with async scheduling off and on (chapter 05).

The model: Llama-3.2-1B's shape, random bf16 weights. 64 requests (128-token random prompts, greedy, 48 new
tokens each) run until every row decodes with its graph captured; then `--steps` decode steps run under
torch.profiler. The engine's stages are marked with `record_function` on the host (from outside the engine:
its methods are wrapped here, nothing in minillm changes), and every kernel's interval is read from the GPU's
side of the same trace (Kineto puts both on one clock). Written per mode: the host's marked spans, the GPU's
busy intervals (overlapping kernels merged), and the mean step period and GPU busy share over the profiled steps.

    python benchmarks/overlap_timeline.py     # a CUDA GPU: writes results/overlap_timeline/cuda.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
from common import write_results
from engine_throughput import random_llama_1b

from minillm.engine import LLMEngine, llm_engine, model_runner
from minillm.engine.scheduler import Scheduler
from minillm.sampler.sampling import SamplingParams

MARKS = {  # the host's stages: (class, method) -> the span's name
    (Scheduler, "schedule"): "schedule",
    (llm_engine.LLMEngine, "_forward"): "inputs + launch forward",
    (model_runner.StepTokens, "read"): "wait for tokens",
    (llm_engine.LLMEngine, "_sample"): "launch sampling",
    (llm_engine.LLMEngine, "_append"): "stop rules + outputs",
}


def marked(name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return wrapper


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping or touching intervals joined: when the GPU was busy at all."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def timeline(model, async_scheduling: bool, batch: int, steps: int) -> dict:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    engine = LLMEngine(model, None, num_blocks=batch * 16 + 8, max_num_seqs=batch, max_num_batched_tokens=8192,
                       enable_prefix_caching=False, async_scheduling=async_scheduling)
    g = torch.Generator().manual_seed(0)
    for p in torch.randint(2, model.config.vocab_size, (batch, 128), generator=g).tolist():
        engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=steps + 24, ignore_eos=True))
    for _ in range(8):  # the prompts, then decode steps: graphs captured, every row decoding
        engine.step()
    torch.cuda.synchronize()
    originals = {key: getattr(*key) for key in MARKS}
    for (cls, method), name in MARKS.items():
        setattr(cls, method, marked(name, originals[cls, method]))
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                with torch.profiler.record_function("step"):
                    engine.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        for (cls, method), fn in originals.items():
            setattr(cls, method, fn)
    engine.run()  # finish the requests (unprofiled)
    names = {*MARKS.values(), "step"}
    host, kernels = [], []
    for event in prof.events():
        if event.device_type.name == "CUDA":
            kernels.append((event.time_range.start, event.time_range.end))
        elif event.name in names:
            host.append((event.name, event.time_range.start, event.time_range.end))
    t0 = min(s for name, s, _ in host if name == "step")
    by_start = lambda span: span[1]  # noqa: E731
    busy = merge(kernels)
    steps_spans = sorted((s, e) for name, s, e in host if name == "step")
    period_us = (steps_spans[-1][1] - steps_spans[0][0]) / len(steps_spans)
    window = (steps_spans[0][0], steps_spans[-1][1])
    busy_us = sum(min(e, window[1]) - max(s, window[0]) for s, e in busy if e > window[0] and s < window[1])
    return {"async_scheduling": async_scheduling, "batch": batch, "steps": steps, "wall_s": wall,
            "step_period_ms": period_us / 1e3, "gpu_busy": busy_us / (window[1] - window[0]),
            "host_spans_ms": [(name, (s - t0) / 1e3, (e - t0) / 1e3) for name, s, e in sorted(host, key=by_start)],
            "gpu_busy_ms": [((s - t0) / 1e3, (e - t0) / 1e3) for s, e in busy if e >= t0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/overlap_timeline.py needs a CUDA GPU.")
    hf, model = random_llama_1b()
    del hf
    runs = [timeline(model, mode, args.batch, args.steps) for mode in (False, True, False, True)][2:]  # warm, then kept
    path = write_results("overlap_timeline/cuda", {
        "benchmark": "the engine's decode steps on one timeline, host spans and GPU busy intervals, async scheduling "
                     "off and on; Llama-3.2-1B shape, random bf16 weights, 64 requests of 128 prompt tokens",
        "settings": vars(args), "runs": runs})
    for r in runs:
        print(f"async_scheduling={r['async_scheduling']}: a step every {r['step_period_ms']:.2f} ms under the "
              f"profiler, GPU busy {r['gpu_busy']:.0%}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
