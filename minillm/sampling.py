"""`SamplingParams` and `sample()`: from logits to the next token (chapter 01).

This is the minimal sampler the generation loop needs: greedy at temperature 0, otherwise
temperature, then optional top-k and top-p truncation, then a draw. Chapter 01 grows it into the
full set of logits processors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        temperature: 0 = greedy (argmax); otherwise logits are divided by it before softmax.
        top_k: keep only the k most likely tokens (0 = off).
        top_p: keep the smallest set of tokens whose probability reaches p (1.0 = off).
        max_tokens: the most tokens to generate.
        stop: strings that end generation when they appear in the output (excluded from it).
        seed: seeds the sampler, so the same seed gives the same tokens.
        ignore_eos: keep generating past the end-of-sequence token (for benchmarks).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}.")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}.")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row. logits [B, V] -> token ids [B] (int64)."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token if the tokens ranked above it already reach top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
