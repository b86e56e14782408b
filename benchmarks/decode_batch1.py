"""Batch-1 decode speed: minillm against `transformers`' generate, side by side, on a CPU or a GPU.

Same checkpoint (random weights: speed does not depend on their values), same prompt, same
number of greedy tokens, same threads. Each engine runs `--repeats` times, interleaved; we report
medians of TTFT and decode tokens/s (tokens after the first over the time after the first).
transformers' per-token times come from a streamer that timestamps every token it is handed.

    python benchmarks/decode_batch1.py                  # CPU: writes results/decode_batch1/cpu.json
    python benchmarks/decode_batch1.py --device cuda    # GPU: writes results/decode_batch1/cuda.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from common import write_results
from transformers.generation.streamers import BaseStreamer

import minillm

SIZES = {
    # ~ the size of the book's shipped draft model: per-token overhead dominates
    "tiny-2M": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=4096),
    # ~ the size of the book's shipped target model
    "small-12M": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096),
    # a GPT-2-small-sized Llama
    "base-110M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, vocab_size=32000),
    # the shape of Llama-3.2-1B (GPU only: too slow to be useful on a 2-core CPU)
    "llama-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
}


class TimingStreamer(BaseStreamer):
    """Records when transformers hands over each new token (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.start = 0.0
        self.seen_prompt = False

    def put(self, value) -> None:  # noqa: ANN001 - transformers' interface
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.times.append(time.perf_counter() - self.start)

    def end(self) -> None:
        pass


def run_transformers(hf, prompt: torch.Tensor, n: int) -> tuple[float, float]:
    streamer = TimingStreamer()
    streamer.start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(prompt, do_sample=False, max_new_tokens=n, min_new_tokens=n, streamer=streamer, pad_token_id=0)
    t = streamer.times
    return t[0], (len(t) - 1) / (t[-1] - t[0])


def run_minillm(model, prompt: torch.Tensor, n: int) -> tuple[float, float]:
    out = minillm.generate(model, prompt[0].tolist(), minillm.SamplingParams(temperature=0, max_tokens=n,
                                                                            ignore_eos=True))
    return out.ttft_s, out.decode_tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens to generate per run")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", nargs="+", default=["tiny-2M", "small-12M", "base-110M"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()

    rows = []
    for name, dtype in [(n, d) for n in args.sizes for d in args.dtypes]:
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES[name], max_position_embeddings=2048))
        hf = hf.to(args.device, getattr(torch, dtype)).eval()
        ours = minillm.from_transformers(hf)
        prompt = torch.randint(2, SIZES[name]["vocab_size"], (1, args.prompt_len), device=args.device)
        run_transformers(hf, prompt, 8)  # warm-up: first-call allocations stay out of the numbers
        run_minillm(ours, prompt, 8)
        hf_runs, our_runs = [], []
        for _ in range(args.repeats):
            hf_runs.append(run_transformers(hf, prompt, args.tokens))
            our_runs.append(run_minillm(ours, prompt, args.tokens))
        row = {
            "model": name,
            "dtype": dtype,
            "params": ours.num_parameters(),
            "weight_mb": ours.num_parameters() * ours.dtype.itemsize / 1e6,
            "transformers_ttft_ms": 1e3 * statistics.median(r[0] for r in hf_runs),
            "transformers_decode_tok_s": statistics.median(r[1] for r in hf_runs),
            "minillm_ttft_ms": 1e3 * statistics.median(r[0] for r in our_runs),
            "minillm_decode_tok_s": statistics.median(r[1] for r in our_runs),
        }
        row["decode_speedup"] = row["minillm_decode_tok_s"] / row["transformers_decode_tok_s"]
        rows.append(row)

    path = write_results(f"decode_batch1/{args.device}", {
        "benchmark": f"batch-1 greedy decode on the {args.device}, minillm vs transformers.generate",
        "settings": vars(args),
        "rows": rows,
    })
    print(f"{'model':<10} {'dtype':<9} {'weights':>8} {'HF tok/s':>9} {'minillm tok/s':>14} {'speed-up':>9} "
          f"{'HF TTFT ms':>11} {'minillm TTFT ms':>16}")
    for r in rows:
        print(f"{r['model']:<10} {r['dtype']:<9} {r['weight_mb']:>6.0f}MB {r['transformers_decode_tok_s']:>9.1f} "
              f"{r['minillm_decode_tok_s']:>14.1f} {r['decode_speedup']:>8.2f}x {r['transformers_ttft_ms']:>11.1f} "
              f"{r['minillm_ttft_ms']:>16.1f}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
