"""Which changes would a quality gate stop? The book's gate (`minillm eval --baseline`) over the changes the
book makes to the shipped model (chapter 09, issue 33).

The baseline is the shipped model itself: validation perplexity (64 windows), `next_line` (200 multiple-choice
documents) and `last_word` (200 exact-match documents, generated through the engine), and, against the
unchanged model, top-1 agreement and KL divergence. Each change is measured the same way and compared with
`minillm.eval.compare` at the book's tolerances:

- weights: int8, fp8, nf4, int4 in groups of 128 and per channel, GPTQ and AWQ int4, int3 and int2 (groups of 128)
- the KV cache in int8 and fp8 (only exact match, which generates through the engine, can see it: the other
  metrics run full forwards without a cache)

    python benchmarks/quality_gates.py       # ~10 min on 2 cores; writes results/quality_gates_cpu.json
"""

from __future__ import annotations

import copy

import torch
from common import write_results

import minillm
from minillm.engine import LLM
from minillm.eval import agreement, compare, exact_match, load_task, multiple_choice, perplexity
from minillm.quant import quantize, quantize_by_name
from minillm.quant.calibration import validation_ids

WINDOWS = 64


def measure(model, tokenizer, reference, val_ids, kv_cache_dtype: str = "auto") -> dict:  # noqa: ANN001
    """The gate's metrics for one model (and KV cache dtype)."""
    return {"results": {
        "perplexity": {"perplexity": perplexity(model, val_ids, max_windows=WINDOWS)},
        "next_line": multiple_choice(model, tokenizer, load_task("next_line")),
        "last_word": exact_match(LLM(model, tokenizer, kv_cache_dtype=kv_cache_dtype), load_task("last_word")),
        "agreement": agreement(model, reference, val_ids, max_windows=16)}}


def main() -> None:
    torch.set_num_threads(2)
    reference, tokenizer = minillm.load(minillm.DEFAULT_MODEL)
    val_ids = validation_ids(tokenizer)
    baseline = measure(reference, tokenizer, reference, val_ids)
    changes = {
        "int8": lambda m: quantize_by_name(m, "int8"),
        "fp8": lambda m: quantize_by_name(m, "fp8"),
        "nf4": lambda m: quantize_by_name(m, "nf4"),
        "int4 g128": lambda m: quantize_by_name(m, "int4"),
        "int4 per channel": lambda m: quantize(m, "rtn", bits=4, group_size="channel"),
        "gptq-int4": lambda m: quantize_by_name(m, "gptq-int4", tokenizer),
        "awq-int4": lambda m: quantize_by_name(m, "awq-int4", tokenizer),
        "int3 g128": lambda m: quantize(m, "rtn", bits=3),
        "int2 g128": lambda m: quantize(m, "rtn", bits=2),
        "kv int8": None,
        "kv fp8": None,
    }
    rows = {}
    for name, change in changes.items():
        model = copy.deepcopy(reference)
        if change is not None:
            change(model)
        kv = name.split()[1] if name.startswith("kv ") else "auto"
        results = measure(model, tokenizer, reference, val_ids, kv)
        verdicts = compare(results, baseline)
        failed = [f"{r.task}.{r.metric}" for r in verdicts if r.failed]
        rows[name] = {"results": results["results"], "failed": failed}
        m = results["results"]
        print(f"{name:<17} ppl {m['perplexity']['perplexity']:6.2f}  next_line {m['next_line']['acc']:.3f}  "
              f"last_word {m['last_word']['exact_match']:.3f}  top-1 {m['agreement']['top1_agreement']:.3f}  "
              f"KL {m['agreement']['kl_divergence']:.4f}  -> {'FAIL ' + ', '.join(failed) if failed else 'pass'}",
              flush=True)
    path = write_results("quality_gates_cpu", {
        "benchmark": "the book's quality gate over the book's changes to the shipped model",
        "settings": {"model": minillm.DEFAULT_MODEL, "perplexity_windows": WINDOWS, "agreement_windows": 16},
        "baseline": baseline["results"], "changes": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
