"""The minillm half of engine_throughput.py alone (no transformers runs): offline throughput for an A/B of two trees.

Same model (Llama-3.2-1B shape, random bf16 weights, seed 0), same 256 requests, same engine settings as
engine_throughput.py; `benchmarks/ab_trees.sh` runs it in an earlier commit's tree and in this one, alternately:

    bash benchmarks/ab_trees.sh BASELINE_DIR engine_throughput_ab.py engine_throughput_ab 2
"""

from __future__ import annotations

import statistics
import sys

import torch
from common import write_results
from engine_throughput import LLAMA_1B, make_requests, random_llama_1b, run_minillm


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/engine_throughput_ab.py needs a CUDA GPU.")
    _, model = random_llama_1b()
    requests = make_requests(256, 100, 1024, LLAMA_1B["vocab_size"])
    run_minillm(model, requests[:8], 8, 2048)  # warm-up: compile the kernels, allocate
    ours = run_minillm(model, requests, 256, 8192)
    steps = ours.pop("steps")
    ours["mean_decode_batch"] = statistics.fmean(s["decode_tokens"] for s in steps)
    ours["num_steps"] = len(steps)
    path = write_results("engine_throughput_ab", {"benchmark": "minillm LLM.generate, 256 requests 100-1024 in/out, "
                                                  "Llama-3.2-1B shape, random bf16 weights", "minillm": ours})
    print(f"minillm: {ours['output_tokens_per_s']:.0f} output tok/s ({ours['seconds']:.2f} s, {len(steps)} steps); "
          f"written to {path}")


if __name__ == "__main__":
    main()
