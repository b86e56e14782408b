"""Greedy decoding on the CPU with the paged KV cache vs the contiguous one: what paging costs (chapter 04).

The same model decodes the same prompts greedily, once on `minillm.contiguous_cache.KVCache` (chapter 02:
one tensor per layer, written and read as slices) and once on `minillm.engine.kv_cache.PagedKVCache`
(blocks of 16; each step builds a `PagedCacheView`, writes through its slot mapping and gathers
each row's keys through its block table). Both must produce the same tokens (checked); the time per
decode step is compared. On the CPU the paged read is a gather (`index_select`) where the
contiguous one is a slice, and each step builds a few small index tensors, so the cost shows most
on the smallest model, whose step is shortest.

Timing: one torch thread (on a shared 2-core machine two threads oversubscribe), the two caches
run in pairs `--reps` times, which goes first alternating (on a 2-core machine the second run of a
pair was up to 10% slower, whichever it was), the median per-step time of each.

    python benchmarks/paged_generation.py           # writes results/paged_generation/cpu.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from common import write_results

import minillm
from minillm.contiguous_cache import KVCache
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.model_runner import paged_forward
from minillm.utils import kv_blocks

PROMPT = ("FIRST CITIZEN.\nBefore we proceed any further, hear me speak.\n\nALL.\nSpeak, speak.\n\n"
          "FIRST CITIZEN.\nYou are all resolved rather to die than to famish?\n")


@torch.inference_mode()
def contiguous_decode(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], float]:  # noqa: ANN001
    """Greedy `steps` tokens for equal-length prompts on a KVCache; (tokens, seconds per decode step)."""
    cache = KVCache(model.config, len(prompts), len(prompts[0]) + steps + 1, dtype=model.dtype)
    tok = model(torch.tensor(prompts), cache=cache, last_only=True)[:, -1].argmax(-1)  # [B]
    out = [tok]
    start = time.perf_counter()
    for _ in range(steps):
        tok = model(tok[:, None], cache=cache)[:, -1].argmax(-1)
        out.append(tok)
    seconds = (time.perf_counter() - start) / steps
    return torch.stack(out, 1).tolist(), seconds


@torch.inference_mode()
def paged_decode(model, prompts: list[list[int]], steps: int, block_size: int) -> tuple[list[list[int]], float]:  # noqa: ANN001
    """The same on a PagedKVCache; (tokens, seconds per decode step)."""
    num_blocks = len(prompts) * kv_blocks(len(prompts[0]) + steps + 1, block_size)
    cache = PagedKVCache(model.config, num_blocks, block_size, dtype=model.dtype, enable_prefix_caching=False)
    ids = list(range(len(prompts)))
    for i in ids:
        cache.add_sequence(i)
    tok = paged_forward(model, cache, ids, prompts).argmax(-1).tolist()
    out = [tok]
    start = time.perf_counter()
    for _ in range(steps):
        tok = paged_forward(model, cache, ids, [[t] for t in tok]).argmax(-1).tolist()
        out.append(tok)
    seconds = (time.perf_counter() - start) / steps
    return [list(row) for row in zip(*out)], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["shakespeare-1m", "shakespeare-11m"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        model, tok = minillm.load(name)
        prompt = tok.encode(PROMPT)
        for B in args.batches:
            prompts = [prompt] * B
            times = {"contiguous": [], "paged": []}
            for rep in range(args.reps):
                runs = {"contiguous": lambda: contiguous_decode(model, prompts, args.steps),  # noqa: B023
                        "paged": lambda: paged_decode(model, prompts, args.steps, args.block_size)}  # noqa: B023
                order = ["contiguous", "paged"] if rep % 2 == 0 else ["paged", "contiguous"]
                results = {}
                for name_ in order:  # alternating which runs first: the second of a pair ran up to 10% slower
                    gc.collect()
                    results[name_] = runs[name_]()
                (expected, t_contiguous), (got, t_paged) = results["contiguous"], results["paged"]
                if got != expected:
                    raise SystemExit(f"{name} B={B}: paged greedy tokens differ from contiguous ones; fix that first")
                times["contiguous"].append(t_contiguous)
                times["paged"].append(t_paged)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            rows.append({"model": name, "batch": B, "prompt_tokens": len(prompt), "decode_steps": args.steps,
                         "contiguous_ms_per_step": ms["contiguous"], "paged_ms_per_step": ms["paged"],
                         "contiguous_tokens_per_s": B * 1e3 / ms["contiguous"],
                         "paged_tokens_per_s": B * 1e3 / ms["paged"],
                         "paged_over_contiguous_tokens_per_s": ms["contiguous"] / ms["paged"],
                         "all_times_ms": {k: [t * 1e3 for t in v] for k, v in times.items()}})
            r = rows[-1]
            print(f"{name:16} B={B:<2} contiguous {r['contiguous_ms_per_step']:6.2f} ms/step  paged "
                  f"{r['paged_ms_per_step']:6.2f} ms/step  paged tokens/s = "
                  f"{r['paged_over_contiguous_tokens_per_s']:.0%} of contiguous", flush=True)
    path = write_results("paged_generation/cpu", {
        "benchmark": "greedy decode, paged KV cache vs contiguous, same tokens, CPU",
        "settings": vars(args),
        "timing": "torch threads 1; the caches interleaved, median per-step time over reps",
        "rows": rows,
    })
    print(f"written to {path}")


if __name__ == "__main__":
    main()
