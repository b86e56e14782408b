"""The host's share of an engine decode step, with the model taken out (issue 30, chapter 05).

On a GPU with async scheduling, a decode step costs the longer of two things: the GPU's kernels, and the host's
Python around them (scheduling, the step's inputs, reading the tokens, stop rules). At batch 256 the host's part
was the longer one on the H200 machine
(`results/engine_throughput_ab/archive/engine_throughput_ab_cuda_capture_*.json`: 0.6 s of 4.7 s waiting for
tokens). This measures that Python on any CPU, without a GPU: the engine (async scheduling on, the decode step run
through `DecodeGraphs` exactly as on a GPU) with its one model call replaced by a stub that returns fixed logits,
so what is timed is the host's work alone.

The requests: `--batch` of them, prompts and outputs of 100..1024 random tokens (as engine_throughput.py), all
prefilled, then `--steps` decode steps timed; each engine stage's share from wrapping its method (from outside:
nothing in minillm changes). The vocabulary is 512 so that the CPU's argmax and log-softmax (a GPU runs them as
kernels) stay small; their time is the "ModelRunner.sample" stage, which on a GPU is two kernel launches.

    python benchmarks/engine_host_step.py       # writes results/engine_host_step/<name>.json (--name, default cpu)

`--device cuda` runs the same stages with the real model on a GPU instead (Llama-3.2-1B's shape, random bf16
weights, captured graphs, the vocabulary of 128,256), to results/engine_host_step/<name>.json (default cuda): there
`read` also holds the wait for the GPU, and the top functions by their own time (cProfile, a separate pass) are
kept. The book keeps only A/B rounds of it, in results/engine_host_step/archive/.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import transformers
from common import write_results
from engine_throughput import make_requests

import minillm
from minillm.engine import LLMEngine, cuda_graphs, kv_cache, llm_engine, model_runner, scheduler, step_inputs
from minillm.sampler.sampling import SamplingParams

STAGES = [(scheduler.Scheduler, "schedule"), (llm_engine.LLMEngine, "_forward"),
          (step_inputs.StepInputBuilder, "decode_rows"), (kv_cache.PagedKVCache, "allocate_slots"),
          (kv_cache.PagedKVCache, "commit"), (llm_engine.LLMEngine, "_sample"), (model_runner.ModelRunner, "sample"),
          (llm_engine.LLMEngine, "_read_inflight"), (model_runner.StepTokens, "read"),
          (llm_engine.LLMEngine, "_append")]


def timed(fn: Callable, label: str, into: dict[str, float]) -> Callable:
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[label] += time.perf_counter() - start
    return wrapper


def host_step(batch: int, steps: int, vocab: int, model=None) -> dict:  # noqa: ANN001
    """model None: a tiny CPU model whose decode call is stubbed out; else that (CUDA) model, run for real."""
    stub = model is None
    if stub:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                          max_position_embeddings=4096)
        model = minillm.from_transformers(transformers.LlamaForCausalLM(config).eval())
    vocab = model.config.vocab_size
    engine = LLMEngine(model, None, num_blocks=batch * 130, max_num_seqs=batch, max_num_batched_tokens=8192,
                       async_scheduling=True)
    if stub:
        graphs = cuda_graphs.DecodeGraphs(model, engine.cache, batch, capture=False)  # the GPU's path, on the CPU
        logits = torch.zeros(graphs.sizes[-1], vocab)
        graphs._step = lambda size: logits[:size]  # the model's one call, taken out
        engine.model_runner.graphs = graphs
    for prompt, n in make_requests(batch, 100, 1024, vocab):
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=n + steps, ignore_eos=True))
    while engine.last_step is None or engine.last_step.num_prefill_tokens:
        engine.step(finished_only=True)
    for _ in range(10):
        engine.step(finished_only=True)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step(finished_only=True)
        seconds.append(time.perf_counter() - start)
    assert engine.last_step.num_decode_tokens == batch, "every row decodes in every timed step"
    by_stage: dict[str, float] = defaultdict(float)  # this step's seconds in each stage
    per_step: dict[str, list[float]] = defaultdict(list)
    saved = [(cls, name, getattr(cls, name)) for cls, name in STAGES]
    for cls, name, fn in saved:
        setattr(cls, name, timed(fn, f"{cls.__name__}.{name}", by_stage))
    try:
        start = time.perf_counter()
        for _ in range(steps):
            by_stage.clear()
            engine.step(finished_only=True)
            for label, spent in by_stage.items():
                per_step[label].append(spent)
        wrapped = (time.perf_counter() - start) / steps
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
    # Medians over the steps: a rare stall (a garbage collection, a new pinned buffer) would move a mean.
    stages = {label: 1e3 * statistics.median(times + [0.0] * (steps - len(times))) for label, times in per_step.items()}
    row = {"batch": batch, "steps": steps, "stub": stub, "median_step_ms": 1e3 * statistics.median(seconds),
           "min_step_ms": 1e3 * min(seconds), "per_row_us": 1e6 * statistics.median(seconds) / batch,
           "wrapped_step_ms": 1e3 * wrapped,
           "stages_ms": dict(sorted(stages.items(), key=lambda kv: -kv[1])), "stages_are": "medians over the steps"}
    if not stub:  # where the host's time goes, function by function
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(lambda: [engine.step(finished_only=True) for _ in range(steps)])
        stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, total s, ...)
        top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]
        row["cprofile_own_ms_per_step"] = {f"{f.split('/')[-1]}:{line}({name})": 1e3 * v[2] / steps
                                           for (f, line, name), v in top}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--name", default=None, help="the results file: results/engine_host_step/<name>.json "
                        "(default: the device)")
    args = parser.parse_args()
    model = None
    if args.device == "cuda":
        from engine_throughput import random_llama_1b

        _, model = random_llama_1b()
    rows = [host_step(b, args.steps, args.vocab, model) for b in args.batches]
    args.name = args.name or args.device
    path = write_results(f"engine_host_step/{args.name}", {
        "benchmark": "the host's Python of an engine decode step (async scheduling, the DecodeGraphs path), "
                     "the model's call stubbed out",
        "settings": vars(args), "rows": rows})
    for r in rows:
        print(f"batch {r['batch']}: {r['median_step_ms']:.2f} ms per step (min {r['min_step_ms']:.2f}), "
              f"{r['per_row_us']:.1f} us per row; median by stage (nested: _forward holds decode_rows, ...):")
        for name, ms in r["stages_ms"].items():
            print(f"    {ms:6.3f} ms  {name}")
        for name, ms in list(r.get("cprofile_own_ms_per_step", {}).items())[:15]:
            print(f"    own {ms:6.3f} ms  {name}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
