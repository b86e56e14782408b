"""Beam search: keep the `num_beams` most likely partial sequences at every step (chapter 01).

Greedy decoding commits to the single most likely token at each step. Beam search keeps
`num_beams` running sequences ("beams") and, at each step, extends all of them by every token of
the vocabulary, scores each candidate by its cumulative log-probability, and keeps the best:

    beams [num_beams]  ── one decode step ──►  logprobs [num_beams, V]
    + each beam's sum so far  ──►  candidate sums [num_beams, V] ─ flatten ─► [num_beams * V]
    top 2 * num_beams candidates  (`beam_step`)
      │ a candidate ending in EOS (among the best num_beams) ─► finished hypotheses (keep the best num_beams)
      └ the best num_beams that do not end ─► next beams; their KV cache rows follow their parents

The semantics are those of Hugging Face transformers' `generate(num_beams=..., do_sample=False)`
(v4.50+ / v5 "vectorised" beam search), and the tests check tokens and scores against it:

* Why 2 * num_beams candidates: up to num_beams of them may end in EOS, and there must still be
  num_beams left to continue. With E EOS ids it is max(2, 1 + E) * num_beams.
* Length penalty: a finished hypothesis scores sum_logprob / length ** length_penalty, where
  length counts the generated tokens only (the EOS included, the prompt not). length_penalty > 0
  favours longer sequences (it divides a negative sum by more), < 0 shorter ones, 0 none.
* At max_tokens every one of the best num_beams candidates is finished, EOS or not.
* When to stop early (`early_stopping`): True stops as soon as num_beams hypotheses are finished.
  False (the default) also waits for that, then stops once the best running beam, scored as if it
  ended now (its sum / its current length ** length_penalty), cannot beat the worst finished
  hypothesis. That is exact for length_penalty <= 0 (log-probabilities are <= 0, so the sum only
  falls) but a heuristic for length_penalty > 0, where a longer continuation divides by a larger
  length and could still overtake. "never" uses max_tokens as the length in that case, a true
  upper bound, so it never stops while a better hypothesis is possible (the textbook algorithm).

The KV cache is paged (chapter 04), one sequence per beam. After each step a new beam must hold
its parent's keys and values: it is forked from its parent, sharing every block, and the old beams
are freed. Nothing is copied but the partly filled last block a beam first writes to while a sibling
still shares it (copy-on-write). With a contiguous cache, one row per beam, every step would have to
gather the parents' rows: 2 x n_layers x num_beams x n_kv_heads x length x head_dim elements read
and written, growing with the length (for shakespeare-11m, 4 beams at 200 tokens in fp32, 3.7 MB
each way per step, beside the 43 MB of weights a step reads).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minillm.engine.block_manager import BLOCK_SIZE
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.model_runner import paged_forward
from minillm.engine.sequence import default_eos_ids, prepare_prompt
from minillm.model import Transformer
from minillm.sampler.sampling import SamplingParams
from minillm.tokenizer import Tokenizer
from minillm.utils import kv_blocks

EarlyStopping = bool | str  # True, False or "never"
NO_BEAM = -1e9  # the starting score of beams that are only copies of the prompt (as in transformers)


@dataclass
class BeamHypothesis:
    """One finished sequence of a beam search.

    Attributes:
        token_ids: the generated ids (the prompt excluded), EOS included when it ended on one.
        text: those ids decoded, special tokens dropped (None without a tokenizer).
        sum_logprob: the sum of the tokens' log-probabilities under the model.
        score: sum_logprob / len(token_ids) ** length_penalty, what the beams are ranked by.
        finish_reason: "stop" (ended on EOS) or "length" (reached max_tokens).
    """

    token_ids: list[int]
    text: str | None
    sum_logprob: float
    score: float
    finish_reason: str


# ------------------------------------------------------------------ the pieces
def beam_step(
    logprobs: torch.Tensor, beam_scores: torch.Tensor, num_beams: int, num_candidates: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of beam selection: the best candidates over every (beam, token) pair (chapter 01).

    A candidate is a beam extended by one token; its score is the beam's cumulative
    log-probability plus the token's. All num_beams * V candidates compete together, so a strong
    beam may supply several candidates and a weak one none.

    Args:
        logprobs: [num_beams, V], log-probabilities of the next token for each beam.
        beam_scores: [num_beams], each beam's cumulative log-probability so far.
        num_beams: how many beams the search keeps.
        num_candidates: how many candidates to return; default 2 * num_beams, so that num_beams
            remain even if num_beams of them end in EOS (EOS is filtered by the caller).
    Returns:
        next_scores [K] (best first), parent_idx [K] (the beam each extends), token_idx [K] (the
        token it adds), with K = num_candidates.
    """
    k = num_candidates or 2 * num_beams
    vocab = logprobs.shape[-1]
    candidates = beam_scores[:, None] + logprobs  # [num_beams, V]
    next_scores, flat = candidates.reshape(-1).topk(k)  # over the flattened [num_beams * V]
    return next_scores, flat // vocab, flat % vocab


# ------------------------------------------------------------------ the search
class BeamSearch:
    """The state of one beam search: the running beams, their paged KV cache, the finished hypotheses.

    `beam_search` runs it to the end; driving `step()` yourself lets you look at the beams and their
    next-token logits between steps (the tests check them against a forward without a cache).

    Attributes:
        beams: the generated ids of each running beam, best first.
        beam_ids: their sequence ids in `cache`, a `PagedKVCache` (chapter 04).
        beam_scores: [num_beams] float32, their cumulative log-probabilities.
        logits: [num_beams, V], each running beam's next-token logits.
        length: how many tokens each running beam has generated.
    """

    def __init__(
        self,
        model: Transformer,
        prompt_ids: list[int],
        num_beams: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = False,
        eos: Sequence[int] = (),
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model, self.num_beams, self.max_tokens = model, num_beams, max_tokens
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.eos = set(eos)
        self.num_candidates = max(2, 1 + len(self.eos)) * num_beams
        self.finished: list[tuple[float, int, BeamHypothesis]] = []  # min-heap on score: [0] is the worst
        self._order = itertools.count()  # breaks score ties in the heap

        device = model.device
        # The prompt's blocks once; each beam's own blocks for max_tokens tokens plus a copied last prompt block.
        per_beam = kv_blocks(max_tokens, BLOCK_SIZE) + 1
        num_blocks = kv_blocks(len(prompt_ids), BLOCK_SIZE) + num_beams * per_beam
        self.cache = PagedKVCache(model.config, num_blocks, BLOCK_SIZE, device, model.dtype,
                                  enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
        self._ids = itertools.count()  # a fresh sequence id for every beam ever made
        self.beam_ids = [next(self._ids)]
        self.cache.add_sequence(self.beam_ids[0])
        logits = paged_forward(model, self.cache, self.beam_ids, [prompt_ids])  # [1, V]
        self.beam_ids = self._fork([self.beam_ids[0]] * num_beams)  # every beam shares the prompt's blocks
        self.logits = logits.expand(num_beams, -1)  # [num_beams, V]
        self.beams: list[list[int]] = [[] for _ in range(num_beams)]
        # Every beam is the prompt for now: let only beam 0's candidates count, or the first step
        # would pick the same tokens num_beams times.
        self.beam_scores = torch.full((num_beams,), NO_BEAM, device=device)
        self.beam_scores[0] = 0.0
        self.length = 0

    def step(self) -> bool:
        """Extend the beams by one token; False when the search is over."""
        self.length += 1
        logprobs = self.logits.float().log_softmax(dim=-1)  # [num_beams, V]
        scores, parents, tokens = beam_step(logprobs, self.beam_scores, self.num_beams, self.num_candidates)
        at_limit = self.length == self.max_tokens
        ends = [at_limit or t in self.eos for t in tokens.tolist()]
        for rank in range(self.num_beams):  # only the best num_beams candidates may finish
            if ends[rank]:
                self._finish(self.beams[int(parents[rank])] + [int(tokens[rank])], scores[rank])
        if at_limit:
            return False

        keep = torch.tensor([r for r, e in enumerate(ends) if not e][: self.num_beams], device=scores.device)
        parents, tokens = parents[keep], tokens[keep]
        self.beams = [self.beams[p] + [t] for p, t in zip(parents.tolist(), tokens.tolist())]
        self.beam_scores = scores[keep]
        if self._is_done():
            return False
        self.beam_ids = self._fork([self.beam_ids[p] for p in parents.tolist()])  # each continues its parent
        self.logits = paged_forward(self.model, self.cache, self.beam_ids, [[t] for t in tokens.tolist()])
        return True

    def _fork(self, parents: list[int]) -> list[int]:
        """New beams, one forked from each of `parents` (sequence ids, repeats allowed); the old beams are freed.

        Forking shares blocks (reference counts + 1) and freeing drops the old references, so a block
        only some new beam still needs stays, and a parent nobody continues gives its own blocks back.
        """
        children = []
        for parent in parents:
            children.append(next(self._ids))
            self.cache.fork(parent, children[-1])
        for old in self.beam_ids:
            self.cache.free(old)
        return children

    def _finish(self, token_ids: list[int], sum_logprob: torch.Tensor) -> None:
        """Offer a hypothesis to the heap of the best num_beams finished ones."""
        score = float(sum_logprob / len(token_ids) ** self.length_penalty)  # in float32, as transformers
        reason = "stop" if token_ids[-1] in self.eos else "length"
        entry = (score, next(self._order), BeamHypothesis(token_ids, None, float(sum_logprob), score, reason))
        if len(self.finished) < self.num_beams:
            heapq.heappush(self.finished, entry)
        elif score > self.finished[0][0]:
            heapq.heapreplace(self.finished, entry)

    def _is_done(self) -> bool:
        """Whether no running beam can still improve the finished ones (see the module docstring)."""
        if len(self.finished) < self.num_beams:
            return False
        if self.early_stopping is True:
            return True
        best_length = self.length
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_length = self.max_tokens  # a longer beam is divided by more: the most it can reach
        best_running = float(self.beam_scores[0] / best_length**self.length_penalty)
        return best_running <= self.finished[0][0]

    def results(self, n: int, tokenizer: Tokenizer | None = None) -> list[BeamHypothesis]:
        """The n best finished hypotheses, best first, with their text decoded."""
        best = [h for _, _, h in sorted(self.finished, key=lambda e: (-e[0], e[1]))][:n]
        for h in best:
            h.text = tokenizer.decode(h.token_ids) if tokenizer is not None else None
        return best


def _check_arguments(num_beams: int, max_tokens: int, n: int, early_stopping: EarlyStopping,
                     length_penalty: float = 1.0) -> None:
    """ValueError naming the argument, its allowed values and what was given."""
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) \
            or not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number (1 = average log-probability, 0 = sum), got "
                         f"{length_penalty!r}.")
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}.")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}.")
    if not 1 <= n <= num_beams:
        raise ValueError(f"n must be in [1, num_beams] = [1, {num_beams}], got {n}; raise num_beams to return more.")
    if not (early_stopping is True or early_stopping is False or early_stopping == "never"):
        raise ValueError(f'early_stopping must be True, False or "never", got {early_stopping!r}.')


def beam_search(
    model: Transformer,
    prompt: str | list[int],
    num_beams: int,
    max_tokens: int,
    length_penalty: float = 1.0,
    early_stopping: EarlyStopping = False,
    n: int = 1,
    tokenizer: Tokenizer | None = None,
    eos_token_ids: Sequence[int] | None = None,
    kv_cache_dtype: str = "auto",
) -> list[BeamHypothesis]:
    """Beam search from `prompt`; the n best finished hypotheses, best score first (chapter 01).

    Matches transformers' `generate(num_beams=num_beams, do_sample=False, length_penalty=...,
    early_stopping=..., num_return_sequences=n, max_new_tokens=max_tokens)`: the same tokens, and
    `score` is its `sequences_scores`.

    Args:
        model: the model; one paged KV cache is allocated for the search, the beams sharing blocks.
        prompt: text (with a tokenizer) or token ids.
        num_beams: how many running sequences to keep.
        max_tokens: the most tokens to generate.
        length_penalty: scores are sum_logprob / generated_length ** length_penalty.
        early_stopping: True, False or "never" (see the module docstring).
        n: how many hypotheses to return, at most num_beams.
        tokenizer: encodes a text prompt and decodes the results.
        eos_token_ids: the ids that end a hypothesis; default the model's and the tokenizer's EOS,
            [] for none.
        kv_cache_dtype: what the beams' KV cache stores: "auto" (the model's dtype), "int8" or "fp8" (chapter 06).

    Example:
        >>> best = beam_search(model, "ROMEO.\\n", num_beams=4, max_tokens=20, tokenizer=tok)[0]
        >>> best.text, best.score
    """
    _check_arguments(num_beams, max_tokens, n, early_stopping, length_penalty)
    ids = prepare_prompt(model, prompt, SamplingParams(max_tokens=max_tokens), tokenizer)
    eos = eos_token_ids if eos_token_ids is not None else default_eos_ids(model, tokenizer)
    search = BeamSearch(model, ids, num_beams, max_tokens, length_penalty, early_stopping, eos, kv_cache_dtype)
    while search.step():
        pass
    return search.results(n, tokenizer)

