"""Does the batch change the answer? SmolLM2's greedy answers in bf16 and fp32 on one GPU, four ways (chapters 07, 09).

The same 48 held-out chat prompts (benchmarks/distill_draft.py's, from chapters 06-09), greedy, 128 tokens, answered:
with CUDA graphs at up to 64 sequences a step (the reference); eagerly at 64; eagerly one prompt at a time; and with
n-gram speculation (k = 4). Greedy decoding is deterministic, so any difference comes from arithmetic: a matrix
product of another shape (one row against 64, a verify forward over k + 1 tokens) may be computed by another kernel
or tiling, whose sums round differently, and where the top two logits are within that rounding, the argmax flips
and the rest of the answer follows another path. Reported: answers equal to the reference, and the first token
where each differing answer departs.

    python benchmarks/batch_invariance.py        # results/batch_invariance/cuda.json (about 4 minutes on one H200)
"""

from __future__ import annotations

import argparse

import torch
from common import write_results
from distill_draft import conversations

import minillm
from minillm.decoding.llm import LLM
from minillm.sampler.sampling import SamplingParams
from minillm.sampler.speculative import NgramDrafter, SpeculativeConfig
from minillm.shipped import CHAT_MODEL


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter's length if one is a prefix), or None."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--name", default=None, help="results/batch_invariance/<name>.json (default: the device)")
    args = parser.parse_args(argv)
    chats = conversations(["06", "07", "08", "09"])[: args.prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    ngram = SpeculativeConfig(NgramDrafter(), num_speculative_tokens=4)
    ways = {"graphs, 64 a step (reference)": {"max_num_seqs": 64},
            "eager, 64 a step": {"max_num_seqs": 64, "cuda_graphs": False},
            "eager, one at a time": {"max_num_seqs": 1, "cuda_graphs": False},
            "n-gram speculation, 64 a step": {"max_num_seqs": 64, "speculative": ngram}}
    if args.device == "cpu":
        for options in ways.values():
            options.pop("cuda_graphs", None)
    results: dict = {}
    for dtype in args.dtypes:
        model, tok = minillm.load(CHAT_MODEL, device=args.device, dtype=dtype)
        answers = {way: [o.token_ids for o in LLM(model, tok, num_blocks=4096, **options).chat(chats, params,
                                                                                                 use_tqdm=False)]
                   for way, options in ways.items()}
        reference = next(iter(answers.values()))
        rows = {}
        for way, got in answers.items():
            firsts = [first_difference(a, b) for a, b in zip(got, reference)]
            rows[way] = {"same_as_reference": sum(f is None for f in firsts), "answers": len(got),
                         "first_difference_at": sorted(f for f in firsts if f is not None)}
            print(f"{dtype:9} {way:32} same {rows[way]['same_as_reference']:2}/{len(got)}  first differences at "
                  f"{rows[way]['first_difference_at'][:8]}", flush=True)
        results[dtype] = rows
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    name = args.name or args.device
    write_results(f"batch_invariance/{name}", {
        "benchmark": "benchmarks/batch_invariance.py: SmolLM2-135M-Instruct's greedy answers to 48 held-out chat "
                     "prompts, four ways (graphs at 64 a step, eager at 64, eager one at a time, n-gram speculation), "
                     "in bf16 and fp32: how many equal the reference, and where the others depart",
        "settings": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
