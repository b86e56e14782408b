"""Compiled decode steps made ahead of time: what `minillm compile MODEL` runs (chapter 02).

The engine compiles the CPU's decode step at its first decode step (`minillm.engine.compiled_step`), tens of
seconds; `compile_ahead` does it before any request, through the engine itself, so that the steps land in the
cache of compiled steps (`minillm.engine.compile_cache`) exactly as `generate --compile` and the engine look for
them, and later processes load them in milliseconds.
"""

from __future__ import annotations

from minillm.engine.compiled_step import CompiledStep
from minillm.engine.llm_engine import LLMEngine
from minillm.model import Transformer
from minillm.sampler.sampling import SamplingParams


def compile_ahead(model: Transformer, kv_cache_dtype: str = "auto") -> dict[str, CompiledStep]:
    """Compile now, at this process's thread count, the decode steps `generate` and the engine would compile at
    their first decode step on `model` (one for batch 1, one for larger batches), or find them in the cache of
    compiled steps: what `minillm compile` runs, so that later processes load them in milliseconds. Returns
    {"batch 1" | "batch 2+": the step} (each says how long it took and whether it came from the cache)."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # a prompt step, then a decode step
    steps = {}
    for rows, label in ((1, "batch 1"), (2, "batch 2+")):
        engine = LLMEngine(model, None, compile_decode=True, kv_cache_dtype=kv_cache_dtype)
        for row in range(rows):
            engine.add_request(f"warm-up {row}", [0], params)
        engine.run()
        steps[label] = engine.graphs.steps[rows > 1]
    return steps


def run_job(path: str) -> None:
    """A background compile (`minillm.engine.compiled_step.BackgroundCompile`): the step saved at `path`, compiled
    at the thread count it was saved with, into the cache of compiled steps; the job's file is removed after."""
    import os
    import shutil
    from pathlib import Path

    import torch

    from minillm.engine.compiled_step import decode_step_shapes

    # At the lowest priority, and one compile worker: the process that started this one is decoding meanwhile,
    # and on a small CPU a compiler at equal priority slowed its eager steps 20x (OpenMP threads waiting for cores).
    os.nice(19)
    torch._inductor.config.compile_threads = 1
    job = torch.load(path, weights_only=False)  # our own file, written by the process that started this one
    torch.set_num_threads(job["threads"])  # (the step's loops are built for the thread count it will run at)
    args = job["args"]
    CompiledStep(job["step"], args, decode_step_shapes(job["many"], job["max_blocks"], len(args) - 1))
    shutil.rmtree(Path(path).parent, ignore_errors=True)  # the job and its log: the step is in the cache now


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Compile a decode step saved by a background compile.")
    parser.add_argument("--job", required=True, help="the job's file (torch.save'd by BackgroundCompile)")
    run_job(parser.parse_args().job)
