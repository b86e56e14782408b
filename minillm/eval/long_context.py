"""Why usable context is shorter than advertised, measured on a model small enough to train here (chapter 09).

The task is a key-value lookup hidden in filler, the synthetic kind long-context benchmarks use (passkey
retrieval, Mohtashami and Jaggi 2023; RULER's multi-key needles, Hsieh et al. 2024). A sequence is filler
tokens with `n_pairs` "needles" planted in it, each a marker, a key and its value; at the end, a query
marker and one of the keys; the model must answer that key's value:

    BOS  f f f NEEDLE k1 v1 f f ... f NEEDLE k2 v2 f ... f  QUERY k2  ->  v2

Its own small vocabulary (no text tokenizer): 0 pad, 1 BOS, 2 NEEDLE, 3 QUERY, then `n_keys` keys, `n_keys`
values and the filler tokens. Answering means finding the key's earlier occurrence and copying the token after
it, what an induction head does (Olsson et al., 2022). A two-layer model 64 wide learns it suddenly, after a few
hundred steps of guessing among the values in its context (a phase change, as Olsson et al. describe).

Trained at one length, the model is then measured where a deployment would use it:
- by needle depth at the training length (where in the context the asked-for needle sits);
- at lengths beyond the training length, where the rotary angles of the longer distances were never seen;
- again with the rotary frequencies rescaled at inference, no retraining: linear position interpolation
  (Chen et al., 2023), NTK-aware scaling (a larger base, bloc97 2023), YaRN (Peng et al., 2023) and Llama 3's.

    s = LookupSettings()
    model, log = train_lookup(s)                      # about two minutes on 2 CPU cores
    accuracy(model, s, length=256)                    # share of queries answered right at 4x the training length
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minillm.config import ModelConfig
from minillm.model import Transformer
from minillm.train.loop import TrainSettings, init_weights, lr_at, make_optimizer, optimizer_step

PAD, BOS, NEEDLE, QUERY = 0, 1, 2, 3


@dataclass
class LookupSettings:
    """The task and the model: keys, values and filler tokens; the training length; the model's size. The
    defaults learn the lookup (100% at the training length) in about 600 steps, a minute on 2 CPU cores."""

    n_keys: int = 16
    n_filler: int = 32
    n_pairs: int = 2
    train_len: int = 64
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    steps: int = 1500
    batch_size: int = 64
    lr: float = 2e-3
    rope_theta: float = 10000.0
    seed: int = 0

    @property
    def vocab_size(self) -> int:
        return 4 + 2 * self.n_keys + self.n_filler

    def config(self, max_seq_len: int = 4096) -> ModelConfig:
        return ModelConfig(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_heads,
                           ffn_dim=4 * self.dim, vocab_size=self.vocab_size, max_seq_len=max_seq_len,
                           rope_theta=self.rope_theta, bos_token_id=BOS, eos_token_id=PAD)


def make_batch(s: LookupSettings, batch: int, length: int, generator: torch.Generator,
               depth: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`batch` lookups of `length` tokens. Returns (tokens [B, length], targets [B, length], depths [B]).

    Every needle is queried once at the end, in random order: QUERY k v for all but the last, whose value the
    model must give at the last position. targets holds each queried value at the position that predicts it
    (-100 elsewhere: the filler is noise, nothing to learn); the last column is the asked-for answer. depths:
    where the last-queried needle sits (0 = the start of the filler, 1 = its end); `depth` puts it there."""
    first_key, first_value, first_filler = 4, 4 + s.n_keys, 4 + 2 * s.n_keys
    tail = 3 * s.n_pairs - 1  # QUERY k v ... QUERY k
    body = length - tail  # BOS and the filler with its needles; the queries start here
    slots = (body - 1) // 3  # needle slots of 3 tokens after BOS
    if slots < s.n_pairs:
        raise ValueError(f"length {length} is too short for {s.n_pairs} needles and their queries.")
    tokens = torch.randint(first_filler, first_filler + s.n_filler, (batch, length), generator=generator)
    tokens[:, 0] = BOS
    targets = torch.full((batch, length), -100, dtype=torch.long)
    depths = torch.empty(batch)
    for b in range(batch):
        keys = (first_key + torch.randperm(s.n_keys, generator=generator)[: s.n_pairs]).tolist()
        values = (first_value + torch.randint(0, s.n_keys, (s.n_pairs,), generator=generator)).tolist()
        places = torch.randperm(slots, generator=generator)[: s.n_pairs].tolist()
        order = torch.randperm(s.n_pairs, generator=generator).tolist()  # the queries' order; the last is asked
        if depth is not None:  # the asked-for needle at that depth, the others elsewhere
            target = min(slots - 1, round(depth * (slots - 1)))
            others = [p for p in torch.randperm(slots, generator=generator).tolist() if p != target]
            places = [target if i == order[-1] else others.pop() for i in range(s.n_pairs)]
        for i in range(s.n_pairs):
            at = 1 + 3 * places[i]
            tokens[b, at : at + 3] = torch.tensor([NEEDLE, keys[i], values[i]])
        at = body
        for j, i in enumerate(order):
            tokens[b, at : at + 2] = torch.tensor([QUERY, keys[i]])
            if j < s.n_pairs - 1:
                tokens[b, at + 2] = values[i]
            targets[b, at + 1] = values[i]  # predicted at the key's position
            at += 3
        depths[b] = places[order[-1]] / max(slots - 1, 1)
    return tokens, targets, depths


def train_lookup(s: LookupSettings, progress: bool = False) -> tuple[Transformer, list[dict]]:
    """Train a model from scratch on lookups of `s.train_len` tokens, the loss on the answer only.
    Returns the model and a log of (step, loss, accuracy on a fresh batch) every 100 steps."""
    torch.manual_seed(s.seed)
    model = Transformer(s.config(max_seq_len=s.train_len))
    init_weights(model)
    settings = TrainSettings(steps=s.steps, batch_size=s.batch_size, seq_len=s.train_len, lr=s.lr,
                             min_lr=s.lr / 10, warmup=100, weight_decay=0.1)
    optimizer = make_optimizer(model, settings)
    g = torch.Generator().manual_seed(s.seed)
    log = []
    for step in range(s.steps):
        tokens, targets, _ = make_batch(s, s.batch_size, s.train_len, g)
        loss = optimizer_step(model, optimizer, lr_at(step, settings), lambda t=tokens, y=targets: F.cross_entropy(
            model(t).float().flatten(0, 1), y.flatten(), ignore_index=-100))
        if (step + 1) % 100 == 0:
            log.append({"step": step + 1, "loss": loss.item(), "accuracy": accuracy(model, s, s.train_len, 256)})
            if progress:
                print(log[-1], flush=True)
    return model.eval(), log


@torch.no_grad()
def accuracy(model: Transformer, s: LookupSettings, length: int, n: int = 256, depth: float | None = None,
             seed: int = 1234, batch: int = 64) -> float:
    """Share of `n` fresh lookups of `length` tokens answered right (greedy), the needle at `depth` if given."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    right = 0
    for start in range(0, n, batch):
        tokens, targets, _ = make_batch(s, min(batch, n - start), length, g, depth)
        right += (model(tokens)[:, -1].argmax(-1) == targets[:, -1]).sum().item()
    return right / n


def rescaled(model: Transformer, kind: str, factor: float) -> Transformer:
    """The same weights with the rotary frequencies rescaled for a context `factor` times the training one,
    without retraining: "linear", "ntk" (base x factor^(d/(d-2))), "yarn" or "llama3" (as config.json sets them,
    read by `ModelConfig`), or "none". A new module with a copy of the weights."""
    c = model.config
    old = c.max_seq_len
    if kind == "none":
        config = dataclasses.replace(c, max_seq_len=int(old * factor))
    elif kind == "ntk":
        d = c.head_dim
        config = dataclasses.replace(c, rope_theta=c.rope_theta * factor ** (d / (d - 2)),
                                     max_seq_len=int(old * factor))
    else:
        scaling = {"rope_type": kind, "factor": factor, "original_max_position_embeddings": old}
        if kind == "llama3":
            scaling |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        config = dataclasses.replace(c, rope_scaling=scaling, max_seq_len=int(old * factor))
    out = Transformer(config)
    out.load_state_dict(model.state_dict())
    return out.eval()


def context_table(model: Transformer, s: LookupSettings, lengths: list[int], kinds: list[str], n: int = 256
                  ) -> dict[str, dict[int, float]]:
    """Accuracy at each length for each rescaling, the factor being length / training length (at least 1)."""
    return {kind: {L: accuracy(rescaled(model, kind, max(1.0, L / s.train_len)), s, L, n) for L in lengths}
            for kind in kinds}


# ------------------------------------------------------------------ a needle in a haystack, on a real chat model
NEEDLE_SENTENCE = "The secret number is {number}."
NEEDLE_QUESTION = "What is the secret number in the text above?"
NEEDLE_ANSWER_PREFIX = "The secret number is"  # the answer's start, given, so the number is its next tokens


def needle_prompts(tokenizer: object, haystack: str, lengths: list[int], depths: list[float], seed: int = 0
                   ) -> list[dict]:
    """One retrieval prompt per (length, depth): whole lines of `haystack` (`length` tokens of them, about), with
    NEEDLE_SENTENCE and a random 5-digit number inserted between the lines at `depth` (0: the first line, 1: after
    the last, next to the question), then NEEDLE_QUESTION, in the model's chat template, the assistant's answer
    begun with NEEDLE_ANSWER_PREFIX. Returns dicts of length, depth, number, context, continuation (" 12345")."""
    from minillm.tokenizer import apply_chat_template

    lines = haystack.splitlines()
    counts = [len(tokenizer.encode(line + "\n")) for line in lines]
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for length in lengths:
        n, total = 0, 0
        while n < len(lines) and total + counts[n] <= length:
            total += counts[n]
            n += 1
        if total < length // 2:
            raise ValueError(f"the haystack holds {sum(counts)} tokens: too few for a context of {length}.")
        for depth in depths:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"a depth is a share of the context, 0 to 1; got {depth}.")
            number = str(int(torch.randint(10_000, 100_000, (1,), generator=g)))
            body = lines[:n]
            body.insert(round(depth * n), NEEDLE_SENTENCE.format(number=number))
            message = "\n".join(body) + "\n\n" + NEEDLE_QUESTION
            context = apply_chat_template([{"role": "user", "content": message}], tokenizer) + NEEDLE_ANSWER_PREFIX
            prompts.append({"length": length, "depth": depth, "number": number, "context": context,
                            "continuation": " " + number})
    return prompts


def needle_retrieval(model: Transformer, tokenizer: object, prompts: list[dict]) -> dict:
    """needle_accuracy: the share of `prompts` (`needle_prompts`) whose number greedy decoding would write after the
    answer's prefix, every digit (`minillm.eval.loglikelihood`'s is_greedy), with its standard error; and the
    accuracy by length and by depth. Pass `ThroughKVCache(model, "int8")` to read the context back from a quantised
    KV cache, as the engine would."""
    from minillm.eval.tasks import loglikelihood, share_with_stderr

    scores = loglikelihood(model, tokenizer, [(p["context"], p["continuation"]) for p in prompts], batch_size=1)
    hits = [greedy for _, greedy in scores]
    p, err = share_with_stderr(hits)

    def by(key: str) -> dict[str, float]:
        groups: dict[str, list[bool]] = {}
        for prompt, hit in zip(prompts, hits):
            groups.setdefault(str(prompt[key]), []).append(hit)
        return {k: sum(v) / len(v) for k, v in groups.items()}

    return {"needle_accuracy": p, "needle_accuracy_stderr": err, "prompts": len(hits), "by_length": by("length"),
            "by_depth": by("depth")}
