"""The pipeline bubble, measured against its formulas: the shipped model over p processes (chapter 08).

`shakespeare-11m` (6 layers) cut into `--stages` stages (default 2, three layers each), one process per stage,
one thread each, gloo between them (`minillm.parallel.pipeline.run_pipeline`). A batch of `--batch` prompts of
equal length generates `--tokens` greedy tokens, cut into m micro-batches for each m of `--microbatches`,
under both schedules:

- "gpipe": every step one fill and drain; the formula is (p - 1) / (m + p - 1);
- "ring": micro-batches circulate without a drain between decode steps; the formula
  1 - steps * m / (steps * max(m, p) + min(m, p) - 1) is ~0 for m >= p and 1 - m/p below.

Per (schedule, m), medians over `--repeats` runs (interleaved): the idle fraction each stage measured
(idle = its wall time minus the time it ran its layers), their mean, the formula's, and decode tokens/s.
Baselines, in this process with no messages: the whole model at 1 and 2 threads, on the same micro-batches
run one after the other (m = 1 is plain batched decoding). Decode tokens/s counts the tokens after each prompt's
first over the time after the prefill's last token was back (`PipelineStats.decode_tokens_per_s`).

    python benchmarks/pipeline_bubble.py        # writes results/pipeline_bubble/cpu.json (~1.5 min on 2 cores)
    python benchmarks/pipeline_bubble.py --shape llama-1B --batch 64   # 2 GPUs, NCCL: results/pipeline_bubble/cuda.json

With `--shape llama-1B` the model is the Llama-3.2-1B shape with random bf16 weights (16 layers, eight a stage),
saved to a temporary folder that every stage loads; the one-process baselines then run on one GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

import torch
from common import write_results

import minillm
from minillm.parallel.pipeline import PipelineStage, pipeline_generate, run_pipeline

TEXT = ("ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
        "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.")


def make_prompts(tokenizer: minillm.Tokenizer, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of `length` tokens: windows of one passage (repeated as often as needed), each starting
    one token later."""
    ids = tokenizer.encode(TEXT)
    ids = ids * -(-(batch + length) // len(ids))
    return [ids[i:i + length] for i in range(batch)]


def random_model_folder(shape: str, folder: str) -> str:
    """Save a random bf16 model of a `roofline.SHAPES` shape (e.g. llama-1B) to `folder`; returns the folder."""
    from roofline import SHAPES

    from minillm.checkpoints import save
    from minillm.config import ModelConfig

    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192,
                                  "rms_norm_eps": 1e-5, **SHAPES[shape]})
    torch.manual_seed(0)
    save(minillm.Transformer(config).to(torch.bfloat16).eval(), folder)
    return folder


def single_process_tok_s(model: minillm.Transformer, prompts: list[list[int]], tokens: int, microbatches: int,
                         threads: int) -> float:
    """Decode tokens/s of the whole model in this process (one stage, no messages), the micro-batches in turn."""
    torch.set_num_threads(threads)
    try:
        out = pipeline_generate(PipelineStage(model, 0, 1, model.device), prompts, tokens, microbatches)
    finally:
        torch.set_num_threads(1)
    return out.stats.decode_tokens_per_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=["ring", "gpipe"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shape", default=None, help="a roofline shape (llama-1B) with random bf16 weights, "
                        "instead of the shipped model")
    parser.add_argument("--out", default=None, help="the results file: results/pipeline_bubble/<out>.json "
                        "(default: the device)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    on_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= args.stages  # as run_pipeline decides
    _, tokenizer = minillm.load(minillm.DEFAULT_MODEL)
    prompts = make_prompts(tokenizer, args.batch, args.prompt_len)
    scratch = tempfile.TemporaryDirectory()
    source = random_model_folder(args.shape, scratch.name) if args.shape else minillm.DEFAULT_MODEL
    model, _ = minillm.load(source, device="cuda:0" if on_gpus else "cpu")

    runs: dict[tuple[str, int], list] = {}
    baseline: dict[tuple[int, int], list[float]] = {}
    for repeat in range(args.repeats):
        for m in args.microbatches:
            for threads in (1, 2):
                baseline.setdefault((m, threads), []).append(
                    single_process_tok_s(model, prompts, args.tokens, m, threads))
            for schedule in args.schedules:
                stats = run_pipeline(source, prompts, args.tokens, stages=args.stages, microbatches=m,
                                     schedule=schedule).stats
                runs.setdefault((schedule, m), []).append(stats)
                print(f"repeat {repeat + 1}: {schedule:<5} m={m}: bubble {stats.bubble_fraction:.3f} "
                      f"(formula {stats.predicted_bubble:.3f}), {stats.decode_tokens_per_s:.0f} tok/s", flush=True)

    rows = []
    for (schedule, m), stats in runs.items():
        median = statistics.median
        rows.append({
            "schedule": schedule,
            "microbatches": m,
            "microbatch_size": args.batch // m,
            "bubble_measured": median(s.bubble_fraction for s in stats),
            "bubble_per_stage": [median(s.stages[i].bubble_fraction for s in stats) for i in range(args.stages)],
            "busy_s_per_stage": [median(s.stages[i].busy_s for s in stats) for i in range(args.stages)],
            "bubble_formula": stats[0].predicted_bubble,
            "decode_tokens_per_s": median(s.decode_tokens_per_s for s in stats),
            "single_process_1_thread_tokens_per_s": median(baseline[(m, 1)]),
            "single_process_2_threads_tokens_per_s": median(baseline[(m, 2)]),
        })

    print(f"\n{args.stages} stages, batch {args.batch}, {args.tokens} tokens, medians of {args.repeats}; "
          "tok/s = decode tokens/s")
    print(f"{'schedule':<8} {'m':>2} {'bubble':>7} {'per stage':>13} {'formula':>8} {'tok/s':>7} "
          f"{'1 proc 1 thr':>13} {'1 proc 2 thr':>13}")
    for r in rows:
        per_stage = " ".join(f"{b:.2f}" for b in r["bubble_per_stage"])
        print(f"{r['schedule']:<8} {r['microbatches']:>2} {r['bubble_measured']:>7.3f} {per_stage:>13} "
              f"{r['bubble_formula']:>8.3f} {r['decode_tokens_per_s']:>7.0f} "
              f"{r['single_process_1_thread_tokens_per_s']:>13.0f} {r['single_process_2_threads_tokens_per_s']:>13.0f}")

    path = write_results(f"pipeline_bubble/{args.out or ('cuda' if on_gpus else 'cpu')}", {
        "benchmark": "pipeline parallelism: measured bubble vs formula, greedy decode",
        "settings": {"model": f"{args.shape} shape, random bf16" if args.shape else minillm.DEFAULT_MODEL,
                     "gpu": torch.cuda.get_device_name(0) if on_gpus else None,
                     "stages": args.stages, "batch": args.batch,
                     "prompt_len": args.prompt_len, "tokens": args.tokens, "repeats": args.repeats,
                     "backend": "nccl" if on_gpus else "gloo", "threads_per_stage": 1},
        "timing": "bubble = a stage's wall time minus its compute time, over its wall time (prefill included); "
                  "decode tok/s after the prefill's last token; medians over repeats, configurations interleaved",
        "rows": rows,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
