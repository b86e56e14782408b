"""Speculative decoding at real sizes with an acceptance rate known by construction (chapter 07, issue 53).

Random weights accept nothing, and the shipped 11M/1M pair is too small to be memory-bound on a GPU. So:

- **The target** has Llama-3-8B's shape and its full cost (every weight read, every matmul run), but its greedy next
  token is a known function of the current one: next(t) = perm[t], for a random permutation `perm` of the
  vocabulary. Construction: every layer's attention output and MLP output projections (o_proj, down_proj) are
  scaled by 1e-3, so the residual stream leaving the last layer is the token's embedding plus a little; the
  embeddings are N(0, 1) in 4,096 dimensions; and the output matrix's row perm[t] is the embedding of t
  (lm_head = embed[perm^-1]). The logit of perm[t] is then about |e_t|^2 / rms(e_t) = 4,096, every other logit about
  N(0, 64^2): a margin of 60 standard deviations, far beyond bf16's rounding. The script checks it: the plain
  engine's greedy output must follow perm.
- **The draft** is a real Llama-3.2-1B-shaped model (random bf16 weights) drafting through the engine's
  `DraftModelDrafter`, so every draft step costs a real 1B forward (its c is measured, not assumed). Its proposals
  are then replaced by the script (`ScriptedDrafter`): draft j is the target's own continuation perm^j[last token],
  kept with probability alpha and otherwise replaced by another token. Each checked draft is therefore accepted
  with probability alpha, independently: the formula's assumption, which the measured alpha checks.

Per alpha in {0, 0.6, 0.8, 0.9}, k in {2, 4, 8}, batch 1 and 8 (128-token random prompts, 256 new tokens each,
greedy, `ignore_eos`): output tokens per second of the engine with speculation and of the same engine without it,
the speed-up, and chapter 07's prediction E[tokens] / (v_k + k c), with c (a draft decode step over a target decode
step) and v_k (the target's packed verify forward over k + 1 tokens a row, as the engine runs it, over its decode
step) measured in GPU kernel time at the same batch (`speculative_verify_cost.forward_ms`, 256 tokens of context,
eager, under torch.profiler): `arithmetic.speculative_speedup(alpha, k, c, v_k)`, with
E = (1 - alpha^(k+1)) / (1 - alpha) at the measured alpha; at k = 4 (`--adaptive-ks`) once more with adaptive
speculation (`DraftGate`: sequences whose drafts stop paying decode plainly, probing now and then). Plus prompt
lookup (`NgramDrafter`: no draft model, c ~ 0) on prompts that walk a 64-token cycle of perm twice, so that the
lookup always finds the target's continuation (alpha ~ 1).

The draft model's cache does not hold the scripted tokens, only its own: after each verify step its catch-up
forward runs the accepted drafts again (1 to k + 1 tokens a row, one forward), where a draft that had proposed them
would run one or two. At batch 1 to 8 that forward is memory-bound: about one decode step.

    python benchmarks/speculative_controlled.py          # on a CUDA GPU: results/speculative_controlled/cuda.json
    python benchmarks/speculative_controlled.py --tiny   # a CPU smoke run of the construction (tests)
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Hashable, Sequence

import torch
from common import write_results

from minillm import arithmetic
from minillm.config import ModelConfig
from minillm.decoding.llm import LLM
from minillm.engine.draft_model import DraftModelDrafter
from minillm.model import Transformer
from minillm.sampler.sampling import SamplingParams
from minillm.sampler.speculative import Draft, NgramDrafter, SpeculativeConfig, SpeculativeStats

SHAPES = {  # (target, draft): Meta-Llama-3-8B's and Llama-3.2-1B's config.json; and a tiny pair for the CPU
    "llama": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
              dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0)),
    "tiny": (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=False),
             dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=2048, tie_word_embeddings=True)),
}
DAMP = 1e-3  # the scale of every layer's output projections in the target
CYCLE = 64  # the length of the cycle of perm that the prompt-lookup rows walk


def build(shape: dict, device: str, dtype: torch.dtype, seed: int) -> Transformer:
    """A Llama-family model of `shape` with random weights (seed), on device in dtype."""
    config = ModelConfig.from_hf({**shape, "max_position_embeddings": 4096, "model_type": "llama",
                                  "architectures": ["LlamaForCausalLM"]})
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = Transformer(config).eval()
    torch.set_default_dtype(default)
    return model


def scripted_permutation(vocab: int, seed: int) -> tuple[list[int], list[int]]:
    """perm (a bijection of the vocabulary: one cycle of CYCLE tokens, one of all the rest) and that short cycle."""
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist()
    perm = [0] * vocab
    for cycle in (order[:CYCLE], order[CYCLE:]):
        for i, t in enumerate(cycle):
            perm[t] = cycle[(i + 1) % len(cycle)]
    return perm, order[:CYCLE]


@torch.no_grad()
def make_target_follow(model: Transformer, perm: list[int], seed: int) -> None:
    """Rewrite `model` in place so that its greedy next token after t is perm[t] (see the module docstring)."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    for layer in model.layers:
        layer.self_attn.o_proj.weight.mul_(DAMP)
        layer.mlp.down_proj.weight.mul_(DAMP)
    embed = model.embed_tokens.weight
    embed.copy_(torch.randn(embed.shape, generator=g, device=embed.device, dtype=torch.float32).to(embed.dtype))
    inverse = torch.empty(len(perm), dtype=torch.long)
    inverse[torch.tensor(perm)] = torch.arange(len(perm))
    model.lm_head.weight.copy_(embed[inverse.to(embed.device)])  # row perm[t] is e_t


class ScriptedDrafter:
    """The draft model drafts for real (its forwards are what is timed); its proposals are then replaced by the
    target's own continuation, each kept with probability `alpha`, else another token (a sure rejection)."""

    def __init__(self, inner: DraftModelDrafter, perm: list[int], alpha: float = 0.8, seed: int = 0) -> None:
        self.inner, self.perm, self.alpha, self.rng = inner, perm, alpha, random.Random(seed)

    @property
    def model(self) -> Transformer:
        return self.inner.model

    def propose(self, seq_ids: Sequence[Hashable], contexts: Sequence[Sequence[int]], params: Sequence,
                num_tokens: Sequence[int], generators: Sequence) -> list[Draft]:
        drafted = self.inner.propose(seq_ids, contexts, params, num_tokens, generators)
        vocab, out = len(self.perm), []
        for context, draft in zip(contexts, drafted):
            tokens, t = [], context[-1]
            for _ in draft.tokens:
                t = self.perm[t]
                tokens.append(t if self.rng.random() < self.alpha else (t + 1 + self.rng.randrange(vocab - 1)) % vocab)
            out.append(Draft(tokens))
        return out

    def release(self, seq_id: Hashable) -> None:
        self.inner.release(seq_id)


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, repeats: int) -> dict:
    """Output tokens per second (the median of `repeats` timed runs after one untimed), the tokens, the counts."""
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: kernels compiled, the drafter's graphs captured
    times = []
    for _ in range(repeats):
        llm.engine.spec_stats = SpeculativeStats()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    n = sum(len(o.token_ids) for o in outs)
    return {"tokens": [o.token_ids for o in outs], "seconds": statistics.median(times),
            "tokens_per_s": n / statistics.median(times), "stats": llm.engine.spec_stats}


def follows(prompts: list[list[int]], outputs: list[list[int]], perm: list[int]) -> float:
    """The share of generated tokens that are perm of the token before: 1.0 if the construction holds."""
    hits = total = 0
    for prompt, out in zip(prompts, outputs):
        seq = prompt[-1:] + out
        hits += sum(perm[a] == b for a, b in zip(seq, seq[1:]))
        total += len(out)
    return hits / total


def costs(target: Transformer, draft: Transformer, batch: int, ks: list[int], repeats: int) -> dict:
    """c and v_k in GPU kernel time at `batch` (CUDA only: torch.profiler's kernel times)."""
    from speculative_verify_cost import forward_ms

    t = forward_ms(target, batch, 256, [1] + [k + 1 for k in ks], repeats, packed=True)
    d = forward_ms(draft, batch, 256, [1], repeats)[1]
    return {"target_decode_gpu_ms": t[1]["gpu_ms"], "draft_decode_gpu_ms": d["gpu_ms"],
            "c": d["gpu_ms"] / t[1]["gpu_ms"], "v": {str(k): t[k + 1]["gpu_ms"] / t[1]["gpu_ms"] for k in ks}}


def engine(model: Transformer, speculative: SpeculativeConfig | None, blocks: int) -> LLM:
    return LLM(model, None, speculative=speculative, max_num_seqs=8, num_blocks=blocks)


def free_gpu_memory() -> None:
    """After the caller has dropped its engine (`del llm`): collect it and give its cached blocks back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny pair on the CPU (a smoke run)")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.6, 0.8, 0.9])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--adaptive-ks", type=int, nargs="*", default=[4],
                        help="k values run again with SpeculativeConfig(adaptive=True) (DraftGate)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--name", default=None,
                        help="results/speculative_controlled/<name>.json (default cuda), or an absolute path, no .json")
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this benchmark measures a GPU: run it where CUDA is available (or pass --tiny).")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    target_shape, draft_shape = SHAPES["tiny" if args.tiny else "llama"]
    target, draft = build(target_shape, device, dtype, 0), build(draft_shape, device, dtype, 1)
    vocab = target.config.vocab_size
    perm, cycle = scripted_permutation(vocab, 2)
    make_target_follow(target, perm, 3)
    rng = random.Random(4)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(max(args.batches))]
    walks = [[cycle[(s + i) % CYCLE] for i in range(2 * CYCLE)] for s in range(0, 8 * max(args.batches), 8)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    blocks = 8 * arithmetic.cdiv(args.prompt_len + args.new_tokens + max(args.ks) + 1, 16) + 64
    name = args.name or ("cpu_tiny" if args.tiny else "cuda")
    results: dict = {"target": "llama-3-8B shape, scripted (module docstring)" if not args.tiny else "tiny",
                     "draft": "llama-3.2-1B shape, random weights" if not args.tiny else "tiny",
                     "dtype": str(dtype).removeprefix("torch."), "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens, "plain": {}, "costs": {}, "rows": [], "ngram": [], "errors": []}

    def save() -> None:
        write_results(name if name.startswith("/") else f"speculative_controlled/{name}", results)

    plain_llm = engine(target, None, blocks)
    plain: dict[tuple[str, int], dict] = {}
    for batch in args.batches:
        for kind, ps in (("draft", prompts[:batch]), ("ngram", walks[:batch])):
            plain[kind, batch] = timed(plain_llm, ps, params, args.repeats)
        results["plain"][str(batch)] = {"tokens_per_s": plain["draft", batch]["tokens_per_s"],
                                        "follows_perm": follows(prompts[:batch], plain["draft", batch]["tokens"], perm),
                                        "ngram_prompts_tokens_per_s": plain["ngram", batch]["tokens_per_s"]}
        print(f"plain batch {batch}: {results['plain'][str(batch)]}", flush=True)
    del plain_llm
    free_gpu_memory()
    if not args.tiny:
        for batch in args.batches:
            results["costs"][str(batch)] = costs(target, draft, batch, args.ks, 10)
            print(f"costs batch {batch}: {results['costs'][str(batch)]}", flush=True)
    save()
    inner = DraftModelDrafter(draft, num_blocks=blocks)
    for k, adaptive in [(k, False) for k in args.ks] + [(k, True) for k in args.adaptive_ks]:
        scripted = ScriptedDrafter(inner, perm, seed=k)
        llm = engine(target, SpeculativeConfig(scripted, k, adaptive=adaptive), blocks)
        graphs = llm.engine.model_runner.verify_graphs is not None
        for alpha in args.alphas:
            scripted.alpha = alpha
            for batch in args.batches:
                try:
                    run = timed(llm, prompts[:batch], params, args.repeats)
                    stats, base = run["stats"], plain["draft", batch]
                    a = stats.alpha
                    cost = results["costs"].get(str(batch)) if a == a else None  # nan: nothing was drafted
                    row = {"k": k, "alpha": alpha, "batch": batch, "adaptive": adaptive, "measured_alpha": a,
                           "tokens_per_step": stats.tokens_per_step, "tokens_per_s": run["tokens_per_s"],
                           "plain_tokens_per_s": base["tokens_per_s"],
                           "speedup": run["tokens_per_s"] / base["tokens_per_s"],
                           "predicted": arithmetic.speculative_speedup(a, k, cost["c"], cost["v"][str(k)])
                           if cost else None,
                           "predicted_unit_verify": arithmetic.speculative_speedup(a, k, cost["c"]) if cost else None,
                           "verify_step_ms": 1e3 * run["seconds"] / stats.num_steps if stats.num_steps else None,
                           "tokens_equal_plain": run["tokens"] == base["tokens"], "verify_graphs": graphs,
                           "draft_graphs": inner.graphs is not None}
                    results["rows"].append(row)
                    print({x: round(y, 3) if isinstance(y, float) else y for x, y in row.items()}, flush=True)
                except Exception as error:  # noqa: BLE001 - a failed configuration is recorded, the rest go on
                    results["errors"].append(f"k={k} alpha={alpha} batch={batch} adaptive={adaptive}: "
                                             f"{type(error).__name__}: {error}")
                    print(results["errors"][-1], flush=True)
        save()
        del llm
        free_gpu_memory()
    for k in args.ks:
        llm = engine(target, SpeculativeConfig(NgramDrafter(), k), blocks)
        for batch in args.batches:
            try:
                run, base = timed(llm, walks[:batch], params, args.repeats), plain["ngram", batch]
                stats = run["stats"]
                row = {"k": k, "batch": batch, "measured_alpha": stats.alpha, "tokens_per_step": stats.tokens_per_step,
                       "tokens_per_s": run["tokens_per_s"], "plain_tokens_per_s": base["tokens_per_s"],
                       "speedup": run["tokens_per_s"] / base["tokens_per_s"],
                       "tokens_equal_plain": run["tokens"] == base["tokens"]}
                results["ngram"].append(row)
                print({x: round(y, 3) if isinstance(y, float) else y for x, y in row.items()}, flush=True)
            except Exception as error:  # noqa: BLE001
                results["errors"].append(f"ngram k={k} batch={batch}: {type(error).__name__}: {error}")
                print(results["errors"][-1], flush=True)
        del llm
        free_gpu_memory()
    save()
    print(f"{'k':>2} {'alpha':>5} {'batch':>5} {'adaptive':>8} {'meas a':>6} {'speedup':>7} {'predicted':>9}")
    for r in results["rows"]:
        pred = f"{r['predicted']:.2f}" if r["predicted"] else "-"
        print(f"{r['k']:>2} {r['alpha']:>5} {r['batch']:>5} {r['adaptive']!s:>8} {r['measured_alpha']:>6.2f} "
              f"{r['speedup']:>7.2f} {pred:>9}")
    for r in results["ngram"]:
        print(f"ngram k={r['k']} batch={r['batch']}: alpha {r['measured_alpha']:.2f}, speedup {r['speedup']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
