"""What verifying k drafts costs on a GPU, by batch size: the assumption under the speed-up formula (chapter 07).

The formula E[tokens] / (1 + k c) takes one target forward over k + 1 tokens per sequence to cost
one decode step. That holds while the step is memory-bound (the weights are read once, whatever the
token count) and fails as the batch grows and the forward becomes compute-bound. Here, on Llama-3-8B
(target) and Llama-3.2-1B (draft) shapes with random bf16 weights, each sequence with a 512-token
context in minillm's paged cache, we time:

* the target's forward over n = 1, 2, 3, 5, 9 new tokens per sequence (k = n - 1 drafts), as the engine
  runs them (n = 1: `paged_forward`, the decode path; n > 1: the verify forward with every position's
  logits), each rolled back with `PagedKVCache.truncate` and timed as the median of `--repeats`;
* the draft's decode step, so that c = draft step / target step at the same batch.

v_k = verify(k) / decode step, from GPU kernel time (torch.profiler), which is what a CUDA-graph replay
approaches; eager wall times are kept too, but at small batch they measure the host, not the GPU.
Random weights say nothing about acceptance: chapter 07 combines these costs with the alpha
measured on the shipped models.

    python benchmarks/speculative_verify_cost.py     # on a CUDA GPU: results/speculative_verify_cost/cuda.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import write_results
from roofline import SHAPES, profile_steps

from minillm.config import ModelConfig
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.model_runner import paged_forward
from minillm.model import Transformer
from minillm.utils import cdiv


def build(shape: str) -> Transformer:
    config = ModelConfig.from_hf({**SHAPES[shape], "max_position_embeddings": 4096, "model_type": "llama",
                                  "architectures": ["LlamaForCausalLM"]})
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Transformer(config).eval()
    torch.set_default_dtype(default)
    return model


@torch.inference_mode()
def forward_ms(model: Transformer, batch: int, context: int, news: list[int], repeats: int,
               packed: bool = False) -> dict[int, dict]:
    """One forward over n new tokens per sequence, for each n in news, at `context` cached tokens: the median wall
    ms of the eager forward (host-bound for small batches) and its GPU kernel ms (torch.profiler: the time a
    CUDA-graph replay approaches). packed: the verify forward as the engine now runs it (`ModelRunner.verify_logits`:
    every row's tokens in one packed row, attention reading the pools), else a left-padded batch [B, n]."""
    blocks = batch * cdiv(context + max(news), 16) + 1
    cache = PagedKVCache(model.config, blocks, 16, "cuda", model.dtype, enable_prefix_caching=False)
    ids = [f"s{b}" for b in range(batch)]
    g = torch.Generator().manual_seed(0)
    for seq in ids:
        cache.add_sequence(seq)
        prompt = torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
        paged_forward(model, cache, [seq], [prompt])
    out = {}
    for n in news:
        def run(n: int = n) -> None:
            if n == 1:
                paged_forward(model, cache, ids, [[1]] * batch)
            elif packed:
                paged_forward(model, cache, ids, [[1] * n] * batch, packed=True, every_token=True)
            else:
                view = cache.prepare(ids, [[1] * n] * batch)
                model(view.tokens, cache=view)  # every position's logits, as the verify forward
            for seq in ids:
                cache.truncate(seq, context)

        for _ in range(3):
            run()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        gpu_ms = profile_steps(run, n=repeats)["gpu_kernel_us"] / 1e3
        out[n] = {"wall_ms": statistics.median(times), "gpu_ms": gpu_ms}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--news", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark measures a GPU: run it where CUDA is available.")
    target, draft = build("llama-8B"), build("llama-1B")
    rows = []
    for batch in args.batches:
        t = forward_ms(target, batch, args.context, args.news, args.repeats)
        d = forward_ms(draft, batch, args.context, [1], args.repeats)[1]
        row = {"batch": batch, "target": {str(n): ms for n, ms in t.items()}, "draft_step": d}
        for clock in ("gpu_ms", "wall_ms"):
            row[f"c_{clock[:-3]}"] = d[clock] / t[1][clock]
            row[f"v_{clock[:-3]}"] = {str(n - 1): ms[clock] / t[1][clock] for n, ms in t.items() if n > 1}
        rows.append(row)
        print(f"batch {batch:3d}: decode {t[1]['gpu_ms']:.2f} ms GPU ({t[1]['wall_ms']:.2f} wall), draft "
              f"{d['gpu_ms']:.2f} ms GPU (c = {row['c_gpu']:.3f}); verify cost v_k (GPU): "
              + ", ".join(f"k={k}: {v:.2f}" for k, v in row["v_gpu"].items()), flush=True)
        torch.cuda.empty_cache()
    path = write_results("speculative_verify_cost/cuda", {
        "target": "llama-8B", "draft": "llama-1B", "dtype": "bfloat16", "context": args.context,
        "weights": "random (costs only)", "rows": rows,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
