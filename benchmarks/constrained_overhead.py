"""What constrained decoding costs: building the token index once, then masking at every token.

For each constraint (JSON schemas and regexes) we report the one-off costs -- compiling the pattern to
a DFA and walking every vocabulary token from every state -- and the per-token cost of the mask: look up
the state's allowed ids, set every other logit to -inf, advance the DFA by the sampled token. We put the
mask next to what it rides on, one unconstrained decode step (`decode_one_token` + `sample`) of each
shipped model, and also time whole generations, constrained and not, per token.

    python benchmarks/constrained_overhead.py        # writes results/constrained_overhead/cpu.json

Timings on a shared CPU are noisy: compare numbers from one run, not across runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from common import write_results

import minillm
from minillm.contiguous_cache import KVCache
from minillm.decoding.generation import decode_one_token, generate_constrained, prefill
from minillm.sampler.constrained import (
    RegexDFA,
    TokenIndex,
    mask_logits,
    schema_to_regex,
    vocabulary_bytes,
)

CONSTRAINTS = {
    "json_person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
            "alive": {"type": "boolean"},
        },
    },
    "json_order": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {"type": "object", "properties": {"sku": {"enum": ["A1", "B2"]}, "qty": {"type": "integer"}}},
            },
            "note": {"type": "string", "maxLength": 40},
        },
    },
    "regex_date": r"\d{4}-\d{2}-\d{2}",
    "regex_line": r"[^\n]{1,120}\n",  # nearly the whole vocabulary is allowed in most states
}


def build(constraint, tokenizer) -> tuple[TokenIndex, float]:
    """The index, and the seconds the pattern took to compile to a DFA (the index build is timed inside)."""
    pattern = constraint if isinstance(constraint, str) else schema_to_regex(constraint)
    start = time.perf_counter()
    dfa = RegexDFA(pattern)
    compile_s = time.perf_counter() - start
    index = TokenIndex(dfa, vocabulary_bytes(tokenizer), tokenizer.eos_token_ids)
    return index, compile_s


def visited_states(index: TokenIndex, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(state, token) pairs along random walks through the index: what a generation would look up."""
    rng, pairs, state = random.Random(seed), [], index.start
    while len(pairs) < n:
        choices = list(index.next_state[state])
        if not choices:
            state = index.start
            continue
        token = rng.choice(choices)
        pairs.append((state, token))
        state = index.advance(state, token)
    return pairs


def mask_step_us(index: TokenIndex, vocab_size: int, n: int) -> float:
    """Microseconds per token for: the state's mask row + mask_logits on [1, V] logits + DFA advance."""
    pairs = visited_states(index, n)
    logits = torch.randn(1, vocab_size)
    start = time.perf_counter()
    for state, token in pairs:
        mask_logits(logits, index.mask[state])
        index.advance(state, token)
    return 1e6 * (time.perf_counter() - start) / n


def decode_step_us(model, params: minillm.SamplingParams, n: int, chunk: int = 256) -> float:
    """Microseconds per unconstrained step: decode_one_token + sample, in runs of `chunk` tokens after a
    16-token prompt (so the context stays short and inside the model's window)."""
    generator = torch.Generator().manual_seed(0)
    total_s, done = 0.0, 0
    while done < n:
        steps = min(chunk, n - done)
        cache = KVCache(model.config, 1, 16 + steps, model.device, model.dtype)
        logits = prefill(model, torch.randint(2, model.config.vocab_size, (1, 16)), cache)
        start = time.perf_counter()
        for _ in range(steps):
            token = minillm.sample(logits, params, generator)
            logits = decode_one_token(model, token[:, None], cache)
        total_s += time.perf_counter() - start
        done += steps
    return 1e6 * total_s / n


def generation_ms_per_token(model, tokenizer, index: TokenIndex, seeds: int) -> tuple[float, float, float]:
    """Whole generations: ms per token constrained, ms per token unconstrained (same lengths), mean length."""
    constrained_s, free_s, n_tokens = 0.0, 0.0, 0
    for seed in range(seeds):
        params = minillm.SamplingParams(max_tokens=128, seed=seed)
        start = time.perf_counter()
        out = generate_constrained(model, tokenizer, "KING LEAR:\n", index, params)
        constrained_s += time.perf_counter() - start
        same_length = minillm.SamplingParams(max_tokens=len(out.token_ids), seed=seed, ignore_eos=True)
        start = time.perf_counter()
        minillm.generate(model, "KING LEAR:\n", same_length, tokenizer)
        free_s += time.perf_counter() - start
        n_tokens += len(out.token_ids)
    return 1e3 * constrained_s / n_tokens, 1e3 * free_s / n_tokens, n_tokens / seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[minillm.DEFAULT_DRAFT, minillm.DEFAULT_MODEL])
    parser.add_argument("--constraints", nargs="+", default=list(CONSTRAINTS))
    parser.add_argument("--steps", type=int, default=2000, help="tokens per per-step timing")
    parser.add_argument("--seeds", type=int, default=10, help="generations per (model, constraint)")
    parser.add_argument("--repeats", type=int, default=3, help="index builds timed (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded = {name: minillm.load(name) for name in args.models}
    tokenizer = loaded[args.models[0]][1]
    params = minillm.SamplingParams(temperature=1.0)
    decode_us = {name: decode_step_us(model, params, args.steps) for name, (model, _) in loaded.items()}

    rows = []
    for name in args.constraints:
        index, compile_s = build(CONSTRAINTS[name], tokenizer)
        build_s = statistics.median(
            TokenIndex(index.dfa, index.token_bytes, index.eos_token_ids).build_time_s for _ in range(args.repeats)
        )
        mask_us = mask_step_us(index, tokenizer.vocab_size, args.steps)
        row = {
            "constraint": name,
            "pattern_chars": len(index.dfa.pattern),
            "dfa_states": index.dfa.n_states,
            "mean_allowed_tokens": index.mask.sum(dim=1).float().mean().item(),
            "dfa_compile_ms": 1e3 * compile_s,
            "index_build_ms": 1e3 * build_s,
            "mask_step_us": mask_us,
            "models": {},
        }
        for model_name, (model, tok) in loaded.items():
            constrained_ms, free_ms, mean_len = generation_ms_per_token(model, tok, index, args.seeds)
            row["models"][model_name] = {
                "decode_step_us": decode_us[model_name],
                "mask_overhead_pct_of_decode_step": 100 * mask_us / decode_us[model_name],
                "generation_ms_per_token_constrained": constrained_ms,
                "generation_ms_per_token_unconstrained": free_ms,
                "mean_tokens_generated": mean_len,
            }
        rows.append(row)

    path = write_results("constrained_overhead/cpu", {
        "benchmark": "constrained decoding: index build (once) and per-token mask overhead, on the CPU",
        "settings": vars(args),
        "vocab_size": tokenizer.vocab_size,
        "rows": rows,
    })
    print(f"{'constraint':<12} {'states':>6} {'allowed':>8} {'DFA ms':>7} {'index ms':>9} {'mask us':>8}  "
          + "  ".join(f"{m + ' step us / +%':>26}" for m in args.models))
    for r in rows:
        per_model = "  ".join(
            f"{r['models'][m]['decode_step_us']:>17.0f} / {r['models'][m]['mask_overhead_pct_of_decode_step']:>5.1f}%"
            for m in args.models
        )
        print(f"{r['constraint']:<12} {r['dfa_states']:>6} {r['mean_allowed_tokens']:>8.0f} "
              f"{r['dfa_compile_ms']:>7.1f} {r['index_build_ms']:>9.1f} {r['mask_step_us']:>8.1f}  {per_model}")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
