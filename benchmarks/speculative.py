"""Speculative decoding measured on the shipped models: acceptance, tokens per step, speed-up, batch (chapter 07).

The target is `minillm.DEFAULT_MODEL`, the draft `minillm.DEFAULT_DRAFT` (same tokenizer). Measured:

* costs: the target's and the draft's decode step (one token, batch 1), and the target's verify forward
  over k + 1 tokens, each the median of `--repeats` timed runs on a paged cache rolled back after each run;
  c = draft step / target step, v_k = verify(k) / target step.
* for each temperature and k = 1..8: alpha per draft position and overall, tokens per verify step
  against (1 - alpha^(k+1)) / (1 - alpha) at the measured alpha, and the wall-time speed-up over plain
  decoding of the same prompts, against two predictions at the measured alpha: the textbook one,
  E[tokens] / (1 + k c), which takes a verify forward to cost one decode step, and the one with the
  measured verify cost, E[tokens] / (k c + v_k).
* n-gram drafting (prompt lookup, no draft model) on a prompt whose continuation repeats it and on free text.
* batch: output tokens per second of the engine over B prompts, plain against speculative (k = 4, greedy).

    python benchmarks/speculative.py                     # CPU: results/speculative/cpu.json
    python benchmarks/speculative.py --device cuda       # results/speculative/cuda.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import write_results

import minillm
from minillm import arithmetic
from minillm.decoding.llm import LLM
from minillm.engine.draft_model import DraftModelDrafter
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.model_runner import paged_forward
from minillm.sampler.sampling import SamplingParams
from minillm.sampler.speculative import NgramDrafter, SpeculativeConfig

PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?\n",
    "KING HENRY:\nOnce more unto the breach, dear friends, once more;\n",
    "HAMLET:\nTo be, or not to be, that is the question:\n",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
]
# Dialogue that repeats itself: the target's continuation keeps reusing its lines, so prompt lookup finds them.
REPETITIVE = "KING.\nI am glad to see you.\n\nQUEEN.\nI am glad to see you.\n\nKING.\nI am glad to see you.\n\n"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward_costs(target, draft, ids: list[int], ks: list[int], repeats: int) -> dict:  # noqa: ANN001
    """Seconds of one decode step of each model and of the target's verify forward over k + 1 tokens."""
    device = target.device

    def step_time(model, n_new: int) -> float:  # noqa: ANN001
        cache = PagedKVCache(model.config, 64, device=device, dtype=model.dtype, enable_prefix_caching=False)
        cache.add_sequence("s")
        paged_forward(model, cache, ["s"], [ids])
        new = [1] * n_new

        def run() -> None:
            paged_forward(model, cache, ["s"], [new])
            cache.truncate("s", len(ids))  # back to the prompt: every run sees the same context

        return median_s(run, device, repeats)

    target_step, draft_step = step_time(target, 1), step_time(draft, 1)
    verify = {k: step_time(target, k + 1) for k in ks}
    return {"target_step_ms": 1e3 * target_step, "draft_step_ms": 1e3 * draft_step,
            "c": draft_step / target_step,
            "verify_ms": {str(k): 1e3 * t for k, t in verify.items()},
            "v": {str(k): t / target_step for k, t in verify.items()}}


def run_prompts(target, tok, prompts: list[str], params: SamplingParams, spec: SpeculativeConfig | None):  # noqa: ANN001
    """Generate for each prompt in turn (batch 1); (seconds, tokens, merged stats)."""
    t0 = time.perf_counter()
    tokens, stats = 0, None
    for i, prompt in enumerate(prompts):
        p = SamplingParams(**{**params.__dict__, "seed": i})
        out = minillm.generate(target, prompt, p, tok, speculative=spec)
        tokens += len(out.token_ids)
        if spec is not None:
            stats = out.speculative if stats is None else stats.merge(out.speculative)
    sync(target.device)
    return time.perf_counter() - t0, tokens, stats


def stats_row(stats) -> dict:  # noqa: ANN001
    return {"alpha": stats.alpha, "alpha_by_position": stats.alpha_by_position,
            "acceptance_rate": stats.acceptance_rate, "tokens_per_step": stats.tokens_per_step,
            "verify_steps": stats.num_steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ks", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4, help="how many of the built-in prompts to run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--out", default=None, help="the results file: results/speculative/<out>.json "
                        "(default: the device)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    target, tok = minillm.load(minillm.DEFAULT_MODEL, device=device)
    draft, _ = minillm.load(minillm.DEFAULT_DRAFT, device=device)
    prompts = PROMPTS[: args.prompts]

    costs = forward_costs(target, draft, tok.encode(prompts[0]), args.ks, args.repeats)
    print(f"target step {costs['target_step_ms']:.2f} ms, draft step {costs['draft_step_ms']:.2f} ms, "
          f"c = {costs['c']:.3f}")

    sweep = []
    for temperature in args.temperatures:
        params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True)
        plain_s = statistics.median(run_prompts(target, tok, prompts, params, None)[0] for _ in range(args.repeats))
        plain_tokens = len(prompts) * args.max_tokens
        for k in args.ks:
            spec = SpeculativeConfig(DraftModelDrafter(draft), k)
            runs = [run_prompts(target, tok, prompts, params, spec) for _ in range(args.repeats)]
            seconds = statistics.median(r[0] for r in runs)
            stats = runs[0][2]
            alpha = stats.alpha
            row = {"temperature": temperature, "k": k, **stats_row(stats),
                   "expected_tokens_per_step": arithmetic.expected_tokens_per_step(min(alpha, 1.0), k),
                   "speedup": (plain_s / plain_tokens) / (seconds / plain_tokens),
                   "predicted_speedup": arithmetic.speculative_speedup(alpha, k, costs["c"]),
                   "predicted_speedup_measured_verify": arithmetic.expected_tokens_per_step(alpha, k)
                   / (k * costs["c"] + costs["v"][str(k)]),
                   "plain_ms_per_token": 1e3 * plain_s / plain_tokens,
                   "spec_ms_per_token": 1e3 * seconds / plain_tokens}
            sweep.append(row)
            print(f"T={temperature} k={k}: alpha {alpha:.3f}, tokens/step {row['tokens_per_step']:.2f} "
                  f"(formula {row['expected_tokens_per_step']:.2f}), speed-up {row['speedup']:.2f}x "
                  f"(predicted {row['predicted_speedup']:.2f}x, with measured verify "
                  f"{row['predicted_speedup_measured_verify']:.2f}x)")

    ngram = []
    for temperature in args.temperatures:
        params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True)
        for name, prompt in (("repetitive", REPETITIVE), ("free text", prompts[0])):
            plain_s = statistics.median(run_prompts(target, tok, [prompt], params, None)[0]
                                        for _ in range(args.repeats))
            spec = SpeculativeConfig(NgramDrafter(max_n=3), 4)
            runs = [run_prompts(target, tok, [prompt], params, spec) for _ in range(args.repeats)]
            seconds, stats = statistics.median(r[0] for r in runs), runs[0][2]
            ngram.append({"text": name, "temperature": temperature, "k": 4, **stats_row(stats),
                          "proposed": stats.num_proposed, "speedup": plain_s / seconds})
            print(f"n-gram on {name}, T={temperature}: {stats.num_proposed} drafts, alpha {stats.alpha:.2f}, "
                  f"tokens/step {stats.tokens_per_step:.2f}, speed-up {plain_s / seconds:.2f}x")

    batch = []
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for B in args.batches:
        batch_prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(B)]
        row = {"batch": B}
        for name, spec in (("plain", None), ("speculative", SpeculativeConfig(DraftModelDrafter(draft), 4))):
            def run(spec=spec, B=B, batch_prompts=batch_prompts) -> int:  # noqa: ANN001, N803
                llm = LLM(target, tok, max_num_seqs=B, speculative=spec)
                outs = llm.generate(batch_prompts, greedy, use_tqdm=False)
                return sum(len(o.token_ids) for o in outs)
            tokens = run()
            row[f"{name}_tokens_per_s"] = tokens / median_s(run, device, args.repeats)
        row["speedup"] = row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]
        batch.append(row)
        print(f"batch {B}: plain {row['plain_tokens_per_s']:.0f} tok/s, speculative "
              f"{row['speculative_tokens_per_s']:.0f} tok/s, {row['speedup']:.2f}x")

    path = write_results(f"speculative/{args.out or device.type}", {
        "target": minillm.DEFAULT_MODEL, "draft": minillm.DEFAULT_DRAFT, "dtype": str(target.dtype),
        "max_tokens": args.max_tokens, "prompts": len(prompts), "repeats": args.repeats,
        "costs": costs, "sweep": sweep, "ngram": ngram, "batch": batch,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
