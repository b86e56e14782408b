"""The minillm half of engine_throughput.py alone (no transformers runs): offline throughput for an A/B of two trees.

Same model (Llama-3.2-1B shape, random bf16 weights, seed 0), same 256 requests, same engine settings as
engine_throughput.py; `benchmarks/ab_trees.sh` runs it in an earlier commit's tree and in this one, alternately:

    bash benchmarks/ab_trees.sh BASELINE_DIR engine_throughput_ab.py engine_throughput_ab/cuda 2

`--modes sync async sync async` runs this tree's engine with async scheduling off and on, alternately, in one
process (one model, one warm-up). It writes results/engine_throughput_ab/<name>.json (`--name`, default cuda).

`--profile-calls 0 10 40 400` then runs the workload once more (untimed, the first mode) with those engine calls
under torch.profiler, each between two device synchronisations (so a call holds its own step's kernels only): the
call's wall time, the GPU's busy time, kernel time by kind and the longest kernels. Where a prompt-heavy step or
a batch-256 decode step spends its time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from common import write_results
from engine_throughput import LLAMA_1B, make_requests, random_llama_1b, roofline_gpu, roofline_seconds, run_minillm
from roofline import gpu_kernels


def profiled_calls(calls: set[int], into: dict[int, dict]):  # noqa: ANN201 - run_minillm's wrap
    """A `run_minillm` wrap that profiles the engine calls numbered in `calls` into `into[i]`."""
    from torch.profiler import ProfilerActivity, profile

    def wrap(i: int, step):  # noqa: ANN001, ANN202
        if i not in calls:
            return step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            outputs = step()
            torch.cuda.synchronize()
            wall_us = (time.perf_counter() - start) * 1e6
        into[i] = {"wall_us": wall_us, **gpu_kernels(prof.events(), top=12)}
        return outputs

    return wrap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=["default", "sync", "async"], default=["default"])
    parser.add_argument("--name", default="cuda", help="the results file: results/engine_throughput_ab/<name>.json")
    parser.add_argument("--full-warmup", action="store_true",
                        help="run the whole workload once, untimed, first: the first full run is often slower (kernels "
                             "compiled for the shapes the 8-request warm-up did not reach)")
    parser.add_argument("--profile-calls", type=int, nargs="*", default=[],
                        help="then profile these engine calls (0-based) of one more, untimed run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/engine_throughput_ab.py needs a CUDA GPU.")
    _, model = random_llama_1b()
    requests = make_requests(256, 100, 1024, LLAMA_1B["vocab_size"])
    if args.full_warmup:
        run_minillm(model, requests, 256, 8192)
    runs = []
    for mode in args.modes:
        flag = {"sync": {"async_scheduling": False}, "async": {"async_scheduling": True}}.get(mode, {})
        run_minillm(model, requests[:8], 8, 2048, **flag)  # warm-up: compile the kernels, allocate
        ours = run_minillm(model, requests, 256, 8192, **flag)
        steps = ours.pop("steps")
        gpu = roofline_gpu()
        roof = roofline_seconds(model.config, steps, gpu)  # as engine_throughput.py computes it
        ours.update(roofline_gpu=gpu, roofline_seconds=roof, fraction_of_roofline=roof / ours["seconds"])
        with_prompts = [s for s in steps if s["prefill_tokens"]]
        ours["roofline_seconds_prompt_steps"] = roofline_seconds(model.config, with_prompts, gpu)
        decode_only = [s for s in steps if not s["prefill_tokens"]]
        # Per decode-only call: its wall time, and the part of it spent in StepTokens.read (waiting for the step
        # before's tokens). A call that hardly waits is host-bound: the GPU finished before the host asked.
        ours["decode_only_calls_ms"] = {q: 1e3 * statistics.quantiles([s["seconds"] for s in decode_only], n=10)[i]
                                        for q, i in (("p10", 0), ("p50", 4), ("p90", 8))}
        ours["decode_only_read_seconds"] = sum(s["read_seconds"] for s in decode_only)
        ours["prompt_step_seconds"] = [round(s["seconds"], 4) for s in with_prompts]
        ours.update(mode=mode, mean_decode_batch=statistics.fmean(s["decode_tokens"] for s in steps),
                    num_steps=len(steps), prefill_steps=len(with_prompts),
                    prefill_steps_seconds=sum(s["seconds"] for s in with_prompts),
                    decode_only_seconds=sum(s["seconds"] for s in steps if not s["prefill_tokens"]))
        print(f"  {len(with_prompts)} steps with prompt tokens took {ours['prefill_steps_seconds']:.2f} s (roofline "
              f"{ours['roofline_seconds_prompt_steps']:.2f} s), the "
              f"{len(steps) - len(with_prompts)} decode-only steps {ours['decode_only_seconds']:.2f} s (of which "
              f"{ours['decode_only_read_seconds']:.2f} s waiting for tokens; per call p10/p50/p90 "
              f"{'/'.join(f'{v:.2f}' for v in ours['decode_only_calls_ms'].values())} ms)", flush=True)
        print("  prompt steps (s): " + " ".join(f"{t:.3f}" for t in ours["prompt_step_seconds"]), flush=True)
        runs.append(ours)
        print(f"minillm ({mode}): {ours['output_tokens_per_s']:.0f} output tok/s ({ours['seconds']:.2f} s, "
              f"{len(steps)} steps), {ours['fraction_of_roofline']:.1%} of the step roofline; CUDA graphs captured "
              f"as the engine started, in {ours['graph_capture_seconds'] or 0:.2f} s", flush=True)
    profiles: dict[int, dict] = {}
    if args.profile_calls:
        flag = {"sync": {"async_scheduling": False}, "async": {"async_scheduling": True}}.get(args.modes[0], {})
        traced = run_minillm(model, requests, 256, 8192, wrap=profiled_calls(set(args.profile_calls), profiles),
                             **flag)
        for i, p in sorted(profiles.items()):
            s = traced["steps"][i]
            p.update(prefill_tokens=s["prefill_tokens"], decode_tokens=s["decode_tokens"],
                     mean_context=s["mean_context"],
                     roofline_us=roofline_seconds(model.config, [s], roofline_gpu()) * 1e6)
            kinds = ", ".join(f"{k.split(' ')[0]} {v / 1e3:.1f}" for k, v in sorted(p["by_kind_us"].items()))
            print(f"call {i}: {s['prefill_tokens']} prompt + {s['decode_tokens']} decode tokens: wall "
                  f"{p['wall_us'] / 1e3:.1f} ms, GPU busy {p['gpu_busy_us'] / 1e3:.1f} ms, roofline "
                  f"{p['roofline_us'] / 1e3:.2f} ms, {p['kernels']:.0f} kernels ({kinds} ms)")
            for name, us in list(p["top_kernels_us"].items())[:6]:
                print(f"      {us / 1e3:7.2f} ms  {name}")
    path = write_results(f"engine_throughput_ab/{args.name}", {
        "benchmark": "minillm LLM.generate, 256 requests 100-1024 in/out, Llama-3.2-1B shape, random bf16 weights",
        "settings": vars(args), "minillm": runs[0], "runs": runs,
        "profiled_calls": {str(i): p for i, p in sorted(profiles.items())}})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
