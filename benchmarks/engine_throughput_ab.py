"""The minillm half of engine_throughput.py alone (no transformers runs): offline throughput for an A/B of two trees.

Same model (Llama-3.2-1B shape, random bf16 weights, seed 0), same 256 requests, same engine settings as
engine_throughput.py; `benchmarks/ab_trees.sh` runs it in an earlier commit's tree and in this one, alternately:

    bash benchmarks/ab_trees.sh BASELINE_DIR engine_throughput_ab.py engine_throughput_ab 2

`--modes sync async sync async` runs this tree's engine with async scheduling off and on, alternately, in one
process (one model, one warm-up), to `--name` (default engine_throughput_ab).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from common import write_results
from engine_throughput import LLAMA_1B, make_requests, random_llama_1b, roofline_gpu, roofline_seconds, run_minillm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=["default", "sync", "async"], default=["default"])
    parser.add_argument("--name", default="engine_throughput_ab")
    parser.add_argument("--full-warmup", action="store_true",
                        help="run the whole workload once, untimed, first: the first full run is often slower (kernels "
                             "compiled for the shapes the 8-request warm-up did not reach)")
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
        ours.update(mode=mode, mean_decode_batch=statistics.fmean(s["decode_tokens"] for s in steps),
                    num_steps=len(steps), prefill_steps=len(with_prompts),
                    prefill_steps_seconds=sum(s["seconds"] for s in with_prompts),
                    decode_only_seconds=sum(s["seconds"] for s in steps if not s["prefill_tokens"]))
        print(f"  {len(with_prompts)} steps with prompt tokens took {ours['prefill_steps_seconds']:.2f} s, the "
              f"{len(steps) - len(with_prompts)} decode-only steps {ours['decode_only_seconds']:.2f} s", flush=True)
        runs.append(ours)
        print(f"minillm ({mode}): {ours['output_tokens_per_s']:.0f} output tok/s ({ours['seconds']:.2f} s, "
              f"{len(steps)} steps), {ours['fraction_of_roofline']:.1%} of the step roofline", flush=True)
    path = write_results(args.name, {"benchmark": "minillm LLM.generate, 256 requests 100-1024 in/out, "
                                     "Llama-3.2-1B shape, random bf16 weights", "settings": vars(args),
                                     "minillm": runs[0], "runs": runs})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
