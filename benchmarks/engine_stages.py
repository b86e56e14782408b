"""Where an engine step's time goes, stage by stage (chapter 05's GPU section; issue: the host gap).

The workload of `engine_throughput.py` (Llama-3.2-1B's shape, random bf16 weights, requests with prompt
and output lengths uniform in `--min-len`..`--max-len`, greedy or sampled at `--temperature`, every request
generating exactly its output length) runs through `LLM`'s engine twice:

- **plain**, as users run it: output tokens/s of the whole run;
- **staged**: each stage of `LLMEngine.step` timed on the host clock, with the GPU synchronised at the
  end of the forward so that the GPU's work is counted in "forward" and not in whichever stage next
  waits for it. The stages: schedule (the scheduler's plan), forward (inputs, the model, the CUDA graph
  replay), sample (logits to token ids on the host), append (stop rules, text, bookkeeping) and output
  (the `RequestOutput`s). Their sum against the step's wall time; the rest is the loop itself.

Also the top functions of the staged run by own time (`cProfile`), which say which Python lines the host
stages are made of. cProfile's overhead inflates the host's share; the staged run's totals are read
from the stage timers, taken in a separate run without cProfile.

    python benchmarks/engine_stages.py     # a CUDA GPU: writes results/engine_stages/cuda.json (--name: another file)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from common import write_results
from engine_throughput import LLAMA_1B, add_workload_arguments, make_requests, random_llama_1b, run_minillm

from minillm import arithmetic
from minillm.decoding.llm import LLM
from minillm.engine import llm_engine, model_runner
from minillm.engine.scheduler import Scheduler
from minillm.sampler.sampling import SamplingParams

STAGES = {  # stage -> (the class, the method) it times
    "schedule": (Scheduler, "schedule"),
    "forward": (model_runner.ModelRunner, "forward"),
    "sample": (model_runner.ModelRunner, "sample"),
    "output": (llm_engine.LLMEngine, "_output"),
}


def timed(totals: dict[str, float], name: str, fn: Callable, sync_after: bool) -> Callable:
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        if sync_after:
            torch.cuda.synchronize()
        totals[name] += time.perf_counter() - start
        return result
    return wrapper


def staged_run(model, requests, max_num_seqs: int, budget: int, profile: bool,  # noqa: ANN001
               temperature: float = 0.0) -> dict:
    """The engine over `requests` with every stage timed (and under cProfile if `profile`)."""
    totals: dict[str, float] = defaultdict(float)
    originals = {name: getattr(cls, method) for name, (cls, method) in STAGES.items()}
    for name, (cls, method) in STAGES.items():
        setattr(cls, method, timed(totals, name, originals[name], sync_after=name == "forward"))
    step = llm_engine.LLMEngine.step
    llm_engine.LLMEngine.step = timed(totals, "step", step, sync_after=False)
    profiler = cProfile.Profile() if profile else None
    try:
        longest = max(len(p) + n for p, n in requests)
        llm = LLM(model, None, num_blocks=max_num_seqs * arithmetic.kv_blocks(longest, 16),  # synchronous: a stage
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,  # timed to its end makes the host wait
                  async_scheduling=False)
        engine = llm.engine
        for p, n in requests:
            engine.add_request(None, p, SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True))
        steps = 0
        torch.cuda.synchronize()
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        if profiler:
            profiler.disable()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        for name, (cls, method) in STAGES.items():
            setattr(cls, method, originals[name])
        llm_engine.LLMEngine.step = step
    out = {"seconds": seconds, "steps": steps, "stage_seconds": dict(totals),
           "step_ms": totals["step"] / steps * 1e3,
           "stage_ms_per_step": {k: v / steps * 1e3 for k, v in totals.items()}}
    # append = the step minus what is timed inside it (schedule, forward, sample, output)
    inside = sum(totals[k] for k in STAGES)
    out["stage_ms_per_step"]["append_and_loop"] = (totals["step"] - inside) / steps * 1e3
    if profiler:
        stats = pstats.Stats(profiler)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:30]  # by own time
        out["cprofile_top"] = [{"function": f"{path.split('/')[-1]}:{line}({fn})", "calls": cc, "own_s": tt,
                                "cumulative_s": ct} for (path, line, fn), (cc, _, tt, ct, _) in rows]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled, unseeded")
    parser.add_argument("--name", default="cuda", help="the results file: results/engine_stages/<name>.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/engine_stages.py needs a CUDA GPU.")
    _, model = random_llama_1b()
    requests = make_requests(args.num_requests, args.min_len, args.max_len, LLAMA_1B["vocab_size"])
    run_minillm(model, requests[:8], 8, 2048)  # warm-up: compile the kernels, allocate
    plain = run_minillm(model, requests, args.max_num_seqs, args.max_num_batched_tokens, args.temperature)
    plain.pop("steps")
    staged = staged_run(model, requests, args.max_num_seqs, args.max_num_batched_tokens, False, args.temperature)
    profiled = staged_run(model, requests, args.max_num_seqs, args.max_num_batched_tokens, True, args.temperature)
    path = write_results(f"engine_stages/{args.name}", {
        "benchmark": "engine step by stage: LLM over engine_throughput.py's requests, Llama-3.2-1B shape, bf16",
        "settings": vars(args),
        "plain": plain,
        "staged": staged,
        "cprofile_top": profiled["cprofile_top"],
    })
    print(f"\nplain run: {plain['output_tokens_per_s']:.0f} output tok/s in {plain['seconds']:.1f} s")
    print(f"staged run: {staged['steps']} steps, {staged['step_ms']:.2f} ms a step; per step:")
    for name, ms in staged["stage_ms_per_step"].items():
        print(f"  {name:<16} {ms:7.2f} ms")
    print("top functions by own time (cProfile):")
    for row in profiled["cprofile_top"][:15]:
        print(f"  {row['own_s']:7.2f} s own {row['cumulative_s']:7.2f} s cum {row['calls']:>8} {row['function']}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
