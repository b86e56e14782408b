"""Which changes would a quality gate stop? The book's gate (`minillm eval --baseline`) over the changes the
book makes to the shipped model (chapter 09, issue 33).

The baseline is the shipped model itself: validation perplexity (64 windows), `next_line` (200 multiple-choice
documents) and `last_word` (200 exact-match documents, generated through the engine), and, against the
unchanged model, top-1 agreement and KL divergence. Each change is measured the same way and compared with
`minillm.eval.compare` at the book's tolerances:

- weights: int8, fp8, nf4, int4 in groups of 128 and per channel, GPTQ and AWQ int4, int3 and int2 (groups of 128)
- the KV cache in int8 and fp8: the teacher-forced metrics read every key and value back from the engine's
  quantised cache (`minillm.eval.ThroughKVCache`; a full forward keeps no cache and cannot see it), exact match
  generates through the engine with it
- the same KV caches on a "sensitive" model: the shipped model with key outlier channels planted (`with_key_outliers`,
  the same function, keys scaled up by KEY_OUTLIER_FACTOR in one rotary pair per head, queries scaled down), against
  its own baseline (that model, its cache in the model's dtype)
- speculative decoding (the shipped draft model, k = 4) with the exact acceptance rule and with Medusa's lossy
  "typical acceptance": teacher-forced metrics cannot see the verify rule (the model is unchanged), so these rows
  are judged by what the engine generates, against the plain engine: exact match, and greedy agreement
  (`greedy_agreement`: 200 prompts, 32 tokens each)

A row compared with a baseline other than the shipped model's names it ("baseline": "baseline_key_outliers" or
"baseline_engine"), beside the file's "baseline".

    python benchmarks/quality_gates.py       # ~12 min on 2 cores; writes results/quality_gates/cpu.json

With `--model smollm2-135m-instruct` (a real chat model, above chance on the tasks) the gate runs on fewer
documents (CPU time: each forward costs about 12x the shipped model's) and adds two metrics a real deployment
gates on: `json_objects`, the share of greedy chat answers that parse as a JSON object and match the asked-for
schema (`minillm.eval.json_success`), and `needle`, retrieval of a number hidden in 512-2048 tokens of text
(`minillm.eval.long_context.needle_retrieval`), measured for the baseline and the KV-cache rows, through the
quantised cache. Rows: int8 and int4 (groups of 64: 576 columns) weights, the KV cache in int8 and fp8.

    python benchmarks/quality_gates.py --model smollm2-135m-instruct   # ~25 min; results/quality_gates/cpu_smollm2.json
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from common import write_results

import minillm
from minillm.decoding.llm import LLM
from minillm.engine.draft_model import DraftModelDrafter
from minillm.eval import (
    ThroughKVCache,
    agreement,
    compare,
    exact_match,
    greedy_agreement,
    greedy_tokens,
    json_success,
    load_task,
    multiple_choice,
    perplexity,
    with_key_outliers,
)
from minillm.eval.long_context import needle_prompts, needle_retrieval
from minillm.quant import quantize, quantize_by_name
from minillm.quant.calibration import validation_ids
from minillm.sampler.speculative import SpeculativeConfig

WINDOWS = 64
KEY_OUTLIER_FACTOR = 16.0  # the smallest power of two whose int8 KV fails top-1 agreement (a sweep of factors 1-64)
KEY_OUTLIER_CHANNELS = (0,)  # one rotary pair per K/V head: channels 0 and head_dim / 2
GREEDY_TOKENS = 32
SPECULATIVE_TOKENS = 4


def measure(model, tokenizer, reference, val_ids, kv_cache_dtype: str = "auto",  # noqa: ANN001
            through_cache: bool = False) -> dict:
    """The gate's metrics for one model (and KV cache dtype); through_cache: score teacher-forced metrics through
    the engine's KV cache, so that its dtype counts (`ThroughKVCache`)."""
    scored = ThroughKVCache(model, kv_cache_dtype) if through_cache else model
    return {"results": {
        "perplexity": {"perplexity": perplexity(scored, val_ids, max_windows=WINDOWS)},
        "next_line": multiple_choice(scored, tokenizer, load_task("next_line")),
        "last_word": exact_match(LLM(model, tokenizer, kv_cache_dtype=kv_cache_dtype), load_task("last_word")),
        "agreement": agreement(scored, reference, val_ids, max_windows=16)}}


def measure_engine(llm: LLM, prompts: list[str], reference: list[list[int]]) -> dict:
    """The metrics an engine change can move when the model is unchanged: exact match and greedy agreement."""
    return {"results": {"last_word": exact_match(llm, load_task("last_word")),
                        "greedy": greedy_agreement(llm, reference, prompts, GREEDY_TOKENS)}}


def report(name: str, results: dict, baseline: dict) -> dict:
    """Compare, print one line, and return the row for the results file."""
    verdicts = compare(results, baseline)
    failed = [f"{r.task}.{r.metric}" for r in verdicts if r.failed]
    m = results["results"]
    shown = [("ppl", "perplexity", "perplexity", "6.2f"), ("next_line", "next_line", "acc", ".3f"),
             ("last_word", "last_word", "exact_match", ".3f"), ("top-1", "agreement", "top1_agreement", ".3f"),
             ("KL", "agreement", "kl_divergence", ".4f"), ("greedy", "greedy", "greedy_match", ".3f"),
             ("prefix", "greedy", "greedy_prefix", ".3f")]
    shown += [("json", "json_objects", "json_valid", ".3f"), ("schema", "json_objects", "schema_match", ".3f"),
              ("needle", "needle", "needle_accuracy", ".3f")]
    cells = [f"{label} {m[task][metric]:{fmt}}" for label, task, metric, fmt in shown if task in m]
    print(f"{name:<24} {'  '.join(cells)}  -> {'FAIL ' + ', '.join(failed) if failed else 'pass'}", flush=True)
    return {"results": results["results"], "failed": failed}


def measure_real(model, tokenizer, reference, val_ids, s: dict, kv_cache_dtype: str = "auto",  # noqa: ANN001
                 needles: list[dict] | None = None) -> dict:
    """The gate's metrics for a real chat model, at the settings `s`; the teacher-forced ones (and the needle)
    through the engine's KV cache when kv_cache_dtype is not "auto"."""
    scored = ThroughKVCache(model, kv_cache_dtype) if kv_cache_dtype != "auto" else model
    task = load_task("next_line")
    task.docs = task.docs[: s["next_line_docs"]]
    json_task = load_task("json_objects")
    json_task.docs = json_task.docs[: s["json_docs"]]
    llm = LLM(model, tokenizer, kv_cache_dtype=kv_cache_dtype, num_blocks=256)
    results = {
        "perplexity": {"perplexity": perplexity(scored, val_ids, max_windows=s["perplexity_windows"])},
        "next_line": multiple_choice(scored, tokenizer, task),
        "json_objects": json_success(llm, json_task, max_tokens=s["json_max_tokens"]),
        "agreement": agreement(scored, reference, val_ids, max_windows=s["agreement_windows"])}
    if needles is not None:
        results["needle"] = needle_retrieval(scored, tokenizer, needles)
    return {"results": results}


def main_real(name: str, limit: float = 1.0) -> None:
    """The gate on a real chat model (see the module); `limit` scales the document counts (tests run it tiny)."""
    torch.set_num_threads(2)
    reference, tokenizer = minillm.load(name)
    val_ids = validation_ids(tokenizer)
    n_json = len(load_task("json_objects").docs)
    s = {"model": name, "perplexity_windows": max(1, round(4 * limit)), "agreement_windows": max(1, round(2 * limit)),
         "next_line_docs": max(2, round(24 * limit)), "json_docs": max(2, round(n_json * min(limit, 1.0))),
         "json_max_tokens": 48, "needle_lengths": [512, 2048] if limit >= 1 else [64],
         "needle_depths": [0.0, 0.5, 1.0] if limit >= 1 else [0.0]}
    haystack = (Path(minillm.__file__).parent / "data" / "shakespeare_val.txt").read_text()
    needles = needle_prompts(tokenizer, haystack, s["needle_lengths"], s["needle_depths"])
    task = load_task("next_line")
    chance = sum(1 / len(d["choices"]) for d in task.docs[: s["next_line_docs"]]) / s["next_line_docs"]
    baseline = measure_real(reference, tokenizer, reference, val_ids, s, needles=needles)
    report("baseline", baseline, baseline)
    changes = {"int8": (lambda m: quantize_by_name(m, "int8"), "auto"),
               "int4 g64": (lambda m: quantize(m, "rtn", bits=4, group_size=64), "auto"),  # 576 columns: not 128
               "kv int8": (None, "int8"), "kv fp8": (None, "fp8")}
    rows = {}
    for row, (weights, kv) in changes.items():
        model = copy.deepcopy(reference)
        if weights is not None:
            weights(model)
        through_cache = kv != "auto"  # the needle reads a long context back from the cache: the KV rows' check
        results = measure_real(model, tokenizer, reference, val_ids, s, kv, needles if through_cache else None)
        base = baseline if through_cache else {"results": {k: v for k, v in baseline["results"].items()
                                                            if k != "needle"}}
        rows[row] = report(row, results, base)
    out = "quality_gates/cpu_" + name.split("-")[0]
    path = write_results(out, {
        "benchmark": f"the book's quality gate on a real chat model, {name}",
        "settings": s | {"next_line_chance": chance, "kv_rows_scored_through_cache": True,
                         "needle_only_on_kv_rows": True},
        "baseline": baseline["results"], "changes": rows})
    print("wrote", path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=minillm.DEFAULT_MODEL, help="the shipped model (default) or "
                        "smollm2-135m-instruct: a real chat model, with the JSON and needle checks")
    parser.add_argument("--limit", type=float, default=1.0, help="scale the real model's document counts")
    args = parser.parse_args(argv)
    if args.model != minillm.DEFAULT_MODEL:
        return main_real(args.model, args.limit)
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
        results = measure(model, tokenizer, reference, val_ids, kv, through_cache=kv != "auto")
        rows[name] = report(name, results, baseline)

    # The sensitive model: the same function, keys with outlier channels; its own baseline, its cache unquantised.
    outliers = with_key_outliers(reference, KEY_OUTLIER_FACTOR, KEY_OUTLIER_CHANNELS)
    outlier_baseline = measure(outliers, tokenizer, reference, val_ids, "auto", through_cache=True)
    report("key outliers, kv auto", outlier_baseline, baseline)
    for kv in ("int8", "fp8"):
        results = measure(outliers, tokenizer, reference, val_ids, kv, through_cache=True)
        rows[f"kv {kv} (key outliers)"] = report(f"kv {kv} (key outliers)", results, outlier_baseline) | {
            "baseline": "baseline_key_outliers"}

    # Speculative decoding: the model is unchanged, the engine's verify rule is what changes.
    drafter_model, _ = minillm.load(minillm.DEFAULT_DRAFT)
    prompts = [d["context"] for d in load_task("last_word").docs]
    plain = LLM(reference, tokenizer)
    reference_tokens = greedy_tokens(plain, prompts, GREEDY_TOKENS)
    # The plain engine again: its prefix cache now holds the prompts, so it computes them in other shapes, and one
    # prompt whose top two logits tie (to ~1e-6) turns the other way: greedy agreement's noise floor, 0.995 here.
    engine_baseline = measure_engine(plain, prompts, reference_tokens)
    for acceptance in ("exact", "typical"):
        spec = SpeculativeConfig(DraftModelDrafter(drafter_model), SPECULATIVE_TOKENS, acceptance=acceptance)
        llm = LLM(reference, tokenizer, speculative=spec)
        results = measure_engine(llm, prompts, reference_tokens)
        stats = llm.engine.spec_stats
        results["results"]["speculative"] = {"acceptance_rate": stats.acceptance_rate,
                                             "tokens_per_step": stats.tokens_per_step}
        name = f"speculative {acceptance}"
        rows[name] = report(name, results, engine_baseline) | {"baseline": "baseline_engine"}
        print(f"{'':<24} acceptance rate {stats.acceptance_rate:.3f}, {stats.tokens_per_step:.2f} tokens per "
              "target forward", flush=True)

    path = write_results("quality_gates/cpu", {
        "benchmark": "the book's quality gate over the book's changes to the shipped model",
        "settings": {"model": minillm.DEFAULT_MODEL, "perplexity_windows": WINDOWS, "agreement_windows": 16,
                     "kv_rows_scored_through_cache": True, "key_outlier_factor": KEY_OUTLIER_FACTOR,
                     "key_outlier_channels": list(KEY_OUTLIER_CHANNELS), "draft_model": minillm.DEFAULT_DRAFT,
                     "num_speculative_tokens": SPECULATIVE_TOKENS, "greedy_prompts": len(prompts),
                     "greedy_max_tokens": GREEDY_TOKENS},
        "baseline": baseline["results"],
        "baseline_key_outliers": outlier_baseline["results"],
        "baseline_engine": engine_baseline["results"],
        "changes": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
