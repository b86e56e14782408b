"""n-gram prompt lookup on a real chat model: input-grounded prompts against free text (chapter 07, issue 57).

The target is SmolLM2-135M-Instruct (`minillm.load("smollm2-135m-instruct")`), the drafter `NgramDrafter()`
(prompt lookup: no second model), greedy, so the output must be the target's own: every speculative run is
checked token for token against the plain engine's. Five chat prompts: four whose answer copies its input (fix
the typos of a sentence, add a docstring to a function, summarise and quote a paragraph, turn a sentence into
JSON) and a story, whose answer copies nothing.

Per prompt and k: the decode forwards of the target (plain: one per output token after the first; speculative:
the verify steps, `SpeculativeStats.num_steps`, plus the steps with no draft to check, which decode one token
each), how often a step had a draft (proposal rate f = verify steps / decode forwards), alpha (accepted / checked
drafts), tokens per verify step against (1 - alpha^(k+1)) / (1 - alpha), once at k and once at the length each
step really drafted (lookup often finds fewer than k tokens to copy), tokens per decode forward against
f E + (1 - f), and output tokens per second with and without speculation (the median of `--repeats` runs).

    python benchmarks/speculative_ngram.py    # ~4 min on 2 idle cores: results/speculative_ngram/cpu_smollm2.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from common import write_results

import minillm
from minillm import arithmetic
from minillm.decoding.llm import LLM
from minillm.sampler.sampling import SamplingParams
from minillm.sampler.speculative import NgramDrafter, SpeculativeConfig, SpeculativeStats
from minillm.tokenizer import apply_chat_template

MODEL = "smollm2-135m-instruct"
PARAGRAPH = ("The city council met on Tuesday to discuss the new bus routes. After two hours of debate, the council "
             "voted to extend the number 12 line to the hospital, starting in March. Residents had asked for the "
             "change for years, because the nearest stop was a twenty-minute walk away.")
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(values)\n")
PROMPTS = {  # name -> (kind, the user's message)
    "fix typos": ("grounded", "Fix the spelling mistakes in this sentence and reply with the corrected sentence "
                  "only: 'Teh quick brown fox jumpd over the lazzy dog becuase it was boared and tierd.'"),
    "docstring": ("grounded", f"Rewrite this Python function with a docstring; keep its code unchanged:\n\n{CODE}"),
    "summarise + quote": ("grounded", f"Summarise this paragraph in one sentence, then quote its key sentence "
                          f"exactly:\n\n{PARAGRAPH}"),
    "to JSON": ("grounded", "Convert to a JSON list of objects with keys name, age and city: 'Alice is 31 years "
                "old and lives in Lisbon. Bob is 45 years old and lives in Oslo. Carol is 27 years old and lives "
                "in Rome.'"),
    "story": ("free text", "Write a short story about a dragon who learns to bake bread."),
}


def timed(llm: LLM, prompt: str, params: SamplingParams, repeats: int) -> tuple[list[int], float, SpeculativeStats]:
    """The output's token ids, the median wall time of `repeats` runs, and the speculative counts of one run."""
    times, stats = [], None
    for _ in range(repeats):
        llm.engine.spec_stats = SpeculativeStats()
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        times.append(time.perf_counter() - start)
        stats = llm.engine.spec_stats
    return out.token_ids, statistics.median(times), stats


def row(stats: SpeculativeStats, n_out: int, k: int) -> dict:
    """The counts of one speculative run, the formula's predictions, and how the proposals were accounted for."""
    plain_steps = max(0, n_out - 1 - stats.num_emitted)  # decode steps that had no draft: one token each
    forwards = stats.num_steps + plain_steps
    f = stats.num_steps / forwards if forwards else float("nan")
    a = stats.alpha
    # steps that drafted exactly j tokens: proposed_at[j-1] - proposed_at[j]
    p = stats.proposed_at + [0]
    lengths = {j: p[j - 1] - p[j] for j in range(1, len(p)) if p[j - 1] - p[j]}
    e_k = arithmetic.expected_tokens_per_step(a, k) if a == a else float("nan")
    e_len = (sum(n * arithmetic.expected_tokens_per_step(a, j) for j, n in lengths.items()) / stats.num_steps
             if stats.num_steps and a == a else float("nan"))
    return {"output_tokens": n_out, "decode_forwards": forwards, "verify_steps": stats.num_steps,
            "proposal_rate": f, "drafts_proposed": stats.num_proposed, "draft_lengths": lengths,
            "alpha": a, "alpha_by_position": stats.alpha_by_position, "acceptance_rate": stats.acceptance_rate,
            "tokens_per_verify_step": stats.tokens_per_step, "formula_at_k": e_k, "formula_at_draft_lengths": e_len,
            "tokens_per_decode_forward": (n_out - 1) / forwards if forwards else float("nan"),
            "predicted_tokens_per_decode_forward": f * e_len + (1 - f) if f == f and e_len == e_len else 1.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[4])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each (median); each engine's first "
                        "run prefills the prompt, so plain and speculative pay the same prefill")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the prompts to run")
    parser.add_argument("--out", default="cpu_smollm2", help="results/speculative_ngram/<out>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    model, tok = minillm.load(MODEL)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    plain = LLM(model, tok, num_blocks=256)
    spec = {k: LLM(model, tok, num_blocks=256, speculative=SpeculativeConfig(NgramDrafter(), num_speculative_tokens=k))
            for k in args.ks}
    rows = []
    for name, (kind, message) in list(PROMPTS.items())[: args.prompts]:
        prompt = apply_chat_template([{"role": "user", "content": message}], tok)
        ids, plain_s, _ = timed(plain, prompt, params, args.repeats)
        for k, llm in spec.items():
            spec_ids, spec_s, stats = timed(llm, prompt, params, args.repeats)
            r = {"prompt": name, "kind": kind, "k": k, "same_as_plain": spec_ids == ids,
                 "plain_tokens_per_s": len(ids) / plain_s, "speculative_tokens_per_s": len(spec_ids) / spec_s,
                 "speedup": plain_s / spec_s * len(spec_ids) / len(ids), **row(stats, len(spec_ids), k)}
            rows.append(r)
            print(f"{name:<18} k={k}: same {r['same_as_plain']}, proposed {r['proposal_rate']:.2f} of steps, "
                  f"alpha {r['alpha']:.2f}, {r['tokens_per_verify_step']:.2f} tok/verify step (formula "
                  f"{r['formula_at_k']:.2f} at k, {r['formula_at_draft_lengths']:.2f} at the drafted lengths), "
                  f"{r['tokens_per_decode_forward']:.2f} tok/forward (predicted "
                  f"{r['predicted_tokens_per_decode_forward']:.2f}); {r['plain_tokens_per_s']:.1f} -> "
                  f"{r['speculative_tokens_per_s']:.1f} tok/s", flush=True)
        rows[-1]["text"] = tok.decode(ids)
    path = write_results(f"speculative_ngram/{args.out}", {
        "benchmark": "n-gram prompt lookup on a real chat model: input-grounded prompts against free text",
        "settings": {"model": MODEL, "drafter": "NgramDrafter(max_n=3, min_n=1)", "ks": args.ks,
                     "max_tokens": args.max_tokens, "temperature": 0.0, "repeats": args.repeats, "batch": 1,
                     "load_average_1min_at_end": os.getloadavg()[0]},
        "prompts": {name: message for name, (_, message) in PROMPTS.items()},
        "rows": rows})
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
