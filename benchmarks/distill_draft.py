"""A draft model for SmolLM2-135M-Instruct, distilled from it: acceptance before and after, beside n-gram lookup
(chapter 07).

The draft is the target's own first L layers, with its final norm and its tied embedding and head: the same
tokenizer by construction, and a start that already agrees with the target on easy tokens (an "early exit" draft).
`minillm.train.distill` then trains it on the target's next-token distributions (token-level KL, T = 1) over chat
transcripts the target wrote itself: prompts made of the book's own prose from chapters 00-05 under four
instructions (summarise, explain, ask, rewrite), answers sampled from the target at temperature 0.7. Everything
is measured on prompts made the same way from chapters 06-09, which training never saw, greedy, k drafts a step:

* alpha (accepted / checked drafts), tokens per verify step and the formula (1 - alpha^(k+1)) / (1 - alpha), for the
  undistilled draft, the distilled one, and n-gram prompt lookup (no draft model);
* whether speculation kept the target's tokens (on a GPU in bf16 a verify forward over k + 1 tokens and a decode step
  round differently, so a near-tie can flip: counted, not assumed);
* the draft's cost c as parameters read per token (a batch-1 step reads every weight once) and the wall-clock
  output tokens per second at batch 1, with and without speculation.

    python benchmarks/distill_draft.py --device cuda       # results/distill_draft/cuda.json (minutes on one H200)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from pathlib import Path

import torch
from common import write_results

import minillm
from minillm.checkpoints import materialize
from minillm.decoding.llm import LLM
from minillm.engine.draft_model import DraftModelDrafter
from minillm.model import Transformer
from minillm.sampler.sampling import SamplingParams
from minillm.sampler.speculative import NgramDrafter, SpeculativeConfig
from minillm.shipped import CHAT_MODEL
from minillm.train.distill import distill

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 128  # per held-out answer (main's --answer-tokens sets it)
INSTRUCTIONS = ["Summarise this paragraph in one sentence:\n\n{p}", "Explain the main idea of this text to a beginner:"
                "\n\n{p}", "Write two questions a student could ask about this text:\n\n{p}",
                "Rewrite this text in plain words:\n\n{p}"]


def paragraphs(chapters: list[str]) -> list[str]:
    """Prose paragraphs (200-900 characters, no code, tables or display maths) of the chapters' markdown cells."""
    out = []
    for name in chapters:
        path = next((ROOT / "chapters").glob(f"{name}_*.ipynb"))
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            for para in "".join(cell["source"]).split("\n\n"):
                para = para.strip()
                if 200 <= len(para) <= 900 and not re.match(r"[#|>`$\-*\d]", para) and "```" not in para:
                    out.append(para)
    return out


def conversations(chapters: list[str]) -> list[list[dict[str, str]]]:
    paras = paragraphs(chapters)
    return [[{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)].format(p=p)}] for i, p in enumerate(paras)]


def early_exit_draft(target: Transformer, n_layers: int) -> Transformer:
    """The target's first n_layers blocks, its final norm and its tied embedding/head, in fp32 (a copy)."""
    config = dataclasses.replace(target.config, n_layers=n_layers)
    with torch.device("meta"):
        draft = Transformer(config)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers}
    return materialize(draft, state, target.device, torch.float32)


def parameters_read(model: Transformer) -> int:
    """Weights a batch-1 decode step reads: every parameter once (the tied embedding/head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def speculate(target, tok, drafter, chats, k: int, plain: list[list[int]]) -> dict:  # noqa: ANN001
    """Greedy answers with speculation: alpha, tokens per verify step, the formula, and tokens kept."""
    llm = LLM(target, tok, speculative=SpeculativeConfig(drafter, num_speculative_tokens=k), num_blocks=4096,
              max_num_seqs=64)
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    s = llm.engine.spec_stats
    alpha = s.alpha
    same = sum(o.token_ids == p for o, p in zip(outs, plain))
    return {"alpha": alpha, "alpha_by_position": s.alpha_by_position, "acceptance_rate": s.acceptance_rate,
            "tokens_per_step": s.num_emitted / s.num_steps if s.num_steps else float("nan"),
            "formula_tokens_per_step": (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1,
            "verify_steps": s.num_steps, "same_tokens_as_plain": f"{same}/{len(plain)}"}


def batch1_rate(target, tok, chats, drafter=None, k: int = 4) -> float:  # noqa: ANN001
    """Output tokens per second answering the chats one at a time (batch 1), with or without a drafter."""
    spec = SpeculativeConfig(drafter, num_speculative_tokens=k) if drafter is not None else None
    llm = LLM(target, tok, speculative=spec, num_blocks=512, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    llm.chat(chats[:1], params, use_tqdm=False)  # warm-up: graphs captured, kernels compiled
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    start, tokens = time.perf_counter(), 0
    for chat in chats:
        tokens += len(llm.chat([chat], params, use_tqdm=False)[0].token_ids)
    return tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=4, help="blocks the draft keeps of the target's 30")
    parser.add_argument("--steps", type=int, default=600, help="distillation steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--k", type=int, default=4, help="drafts per step")
    parser.add_argument("--eval-prompts", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=160, help="most tokens per answer (training and held out)")
    parser.add_argument("--train-prompts", type=int, default=0, help="0: every training paragraph")
    parser.add_argument("--name", default=None, help="results/distill_draft/<name>.json (default: the device)")
    args = parser.parse_args(argv)
    global MAX_TOKENS
    MAX_TOKENS = args.answer_tokens
    device = torch.device(args.device)
    target, tok = minillm.load(CHAT_MODEL, device=device)

    train_chats = conversations(["00", "01", "02", "03", "04", "05"])
    if args.train_prompts:
        train_chats = train_chats[: args.train_prompts]
    eval_chats = conversations(["06", "07", "08", "09"])[: args.eval_prompts]
    start = time.perf_counter()
    writer = LLM(target, tok, num_blocks=8192, max_num_seqs=256)
    params = [SamplingParams(temperature=0.7, max_tokens=args.answer_tokens, seed=i) for i in range(len(train_chats))]
    transcripts = writer.chat(train_chats, params, use_tqdm=False)
    ids = torch.tensor([t for o in transcripts for t in o.prompt_token_ids + o.token_ids + tok.eos_token_ids[:1]])
    generate_s = time.perf_counter() - start
    del writer

    plain = [o.token_ids for o in LLM(target, tok, num_blocks=4096, max_num_seqs=64).chat(
        eval_chats, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)]
    draft0 = early_exit_draft(target, args.layers)
    start = time.perf_counter()
    draft, losses = distill(draft0, target, ids, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                            seq_len=args.seq_len)
    distill_s = time.perf_counter() - start
    dtype = target.dtype
    drafters = {"ngram": NgramDrafter(),
                f"first {args.layers} layers, undistilled": DraftModelDrafter(draft0.to(dtype)),
                f"first {args.layers} layers, distilled": DraftModelDrafter(draft.to(dtype))}
    rows = {label: speculate(target, tok, d, eval_chats, args.k, plain) for label, d in drafters.items()}
    timed = eval_chats[:8]
    rates = {"plain": batch1_rate(target, tok, timed)}
    rates.update({label: batch1_rate(target, tok, timed, d, args.k) for label, d in drafters.items()})
    results = {
        "benchmark": "benchmarks/distill_draft.py: an early-exit draft of SmolLM2-135M-Instruct distilled from it, "
                     "alpha and tokens per verify step on held-out chat prompts (greedy), beside n-gram lookup",
        "settings": {**vars(args), "dtype": str(dtype), "train_conversations": len(train_chats),
                     "train_tokens": len(ids), "eval_conversations": len(eval_chats)},
        "draft_cost_c": parameters_read(draft) / parameters_read(target),
        "draft_parameters": parameters_read(draft), "target_parameters": parameters_read(target),
        "generate_transcripts_s": generate_s, "distill_s": distill_s,
        "loss_every_50_steps": losses[::50] + losses[-1:],
        "speculation": rows,
        "batch1_output_tokens_per_s": rates,
    }
    name = args.name or device.type
    path = write_results(name if Path(name).is_absolute() else f"distill_draft/{name}", results)
    print(f"{'drafter':36} {'alpha':>6} {'tok/step':>8} {'formula':>8} {'same':>6} {'batch-1 tok/s':>13}")
    for label, row in rows.items():
        print(f"{label:36} {row['alpha']:6.3f} {row['tokens_per_step']:8.2f} {row['formula_tokens_per_step']:8.2f} "
              f"{row['same_tokens_as_plain']:>6} {rates[label]:13.1f}")
    print(f"{'plain':36} {'':6} {'':8} {'':8} {'':6} {rates['plain']:13.1f}")
    print(f"c = {results['draft_cost_c']:.3f}; {len(ids):,} training tokens written in {generate_s:.0f} s; "
          f"distilled in {distill_s:.0f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}; {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
