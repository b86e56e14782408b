"""Quality measured through the engine's own paths: its quantised KV cache, and its greedy generations (chapter 09).

The metrics of `minillm.eval.perplexity`, `agreement` and `tasks.loglikelihood` run the model's full forward,
which keeps no KV cache: a change to the cache (`kv_cache_dtype="int8"`, chapter 06) is invisible to them.
`ThroughKVCache` wraps a model so that its forward runs the way the engine runs a prompt: the tokens go into a
`minillm.engine.kv_cache.PagedKVCache` and attention reads every key and value back from it, quantised on write
and dequantised on read (`PagedCacheView.update`, the engine's own code). Every metric that calls the model
then measures the cache too:

    perplexity(ThroughKVCache(model, "int8"), val_ids)          # or cached_perplexity(model, val_ids, "int8")
    agreement(ThroughKVCache(model, "int8"), reference, val_ids)

Why one prefill is enough. The cache keeps one scale per (token, head), computed from that vector alone
(`minillm.quant.kv`), and a prefill's queries read the keys of their own forward back from the cache, so
position t sees exactly the quantised keys and values a token-by-token decode would have left there. Feeding a
window in chunks (`chunk=`) changes nothing but rounding; the tests check it.

Two more pieces make the changes the gate should catch:

- `with_key_outliers`: the same function as the model, with a few key channels scaled up by a large factor (as
  real LLMs' keys have; KVQuant, Hooper et al. 2024): a model on which a per-(token, head) int8 KV cache loses
  precision;
- `greedy_agreement`: the engine's greedy generations against a reference's, token for token: what a lossy
  speculative acceptance rule (`SpeculativeConfig(acceptance="typical")`, chapter 07) changes, and
  teacher-forced metrics cannot see (the target scores every position itself).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from minillm.decoding.llm import LLM
from minillm.engine.kv_cache import PagedKVCache
from minillm.eval.agreement import agreement
from minillm.eval.perplexity import perplexity
from minillm.eval.tasks import share_with_stderr
from minillm.model import Transformer
from minillm.quant.kv import check_kv_cache_dtype
from minillm.sampler.sampling import SamplingParams
from minillm.utils import cdiv


@torch.inference_mode()
def cached_logits(model: Transformer, ids: torch.Tensor, kv_cache_dtype: str = "auto", chunk: int | None = None,
                  block_size: int = 16) -> torch.Tensor:
    """Teacher-forced logits of ids [B, T] computed through a paged KV cache of `kv_cache_dtype` -> [B, T, V].

    Each row is a sequence of a fresh `PagedKVCache` (the engine's); its tokens go in `chunk` at a time (default:
    all T in one prefill), and every position attends to the keys and values read back from the cache. With
    "auto" this is the full forward's answer, up to rounding; with "int8" or "fp8", what the engine computes.
    """
    check_kv_cache_dtype(kv_cache_dtype)
    B, T = ids.shape
    chunk = chunk or T
    cache = PagedKVCache(model.config, B * cdiv(T, block_size), block_size, model.device, model.dtype,
                         enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    rows = list(range(B))
    for row in rows:
        cache.add_sequence(row)
    out = []
    for start in range(0, T, chunk):
        view = cache.prepare(rows, ids[:, start : start + chunk].tolist())
        out.append(model(view.tokens, cache=view))  # [B, chunk, V]
    return torch.cat(out, dim=1)


class ThroughKVCache(nn.Module):
    """`model`, with its forward run through the engine's KV cache in `kv_cache_dtype` (see `cached_logits`).

    It answers what the eval functions ask of a model (`config`, `device`, `eval()`, `model(tokens [B, T])` ->
    logits [B, T, V]), so `perplexity`, `agreement`, `multiple_choice` and `loglikelihood` take it as they are.
    """

    def __init__(self, model: Transformer, kv_cache_dtype: str = "auto", chunk: int | None = None) -> None:
        super().__init__()
        self.model, self.kv_cache_dtype, self.chunk = model, check_kv_cache_dtype(kv_cache_dtype), chunk
        self.config = model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V], every position reading K/V back from the cache."""
        return cached_logits(self.model, tokens, self.kv_cache_dtype, self.chunk)


def cached_perplexity(model: Transformer, ids: torch.Tensor, kv_cache_dtype: str = "auto", seq_len: int = 256,
                      max_windows: int = 256, batch_size: int = 32) -> float:
    """`minillm.eval.perplexity` over ids [n_tokens], computed through a KV cache of `kv_cache_dtype`."""
    return perplexity(ThroughKVCache(model, kv_cache_dtype), ids, seq_len, max_windows, batch_size)


def cached_agreement(model: Transformer, reference: Transformer, ids: torch.Tensor, kv_cache_dtype: str = "auto",
                     seq_len: int = 256, max_windows: int = 16, batch_size: int = 8) -> dict[str, float]:
    """`minillm.eval.agreement` of `model` read through a KV cache of `kv_cache_dtype` against `reference`'s full
    forward (no cache), over ids [n_tokens]: top1_agreement, kl_divergence, positions."""
    return agreement(ThroughKVCache(model, kv_cache_dtype), reference, ids, seq_len, max_windows, batch_size)


@torch.no_grad()
def with_key_outliers(model: Transformer, factor: float = 16.0, channels: Sequence[int] = (0,)) -> Transformer:
    """A copy of `model` computing the same function, whose keys have outlier channels: a stress test for KV
    quantisation (chapters 06, 09).

    Real LLMs' keys carry a few channels far larger than the rest, in the same channels at every token (KVQuant,
    Hooper et al. 2024, finds them before rotary). The small shipped models have none, so this makes them: in
    every layer and every K/V head, the key projection's rows of rotary pair c = channels[i], that is head
    channels c and c + head_dim/2 (minillm's rotate-half pairing, `minillm.model.apply_rotary`), are multiplied
    by `factor`, and the query rows of the same channels, in every query head that reads this K/V head (GQA:
    heads h*G .. h*G + G - 1), are divided by it.

    Why the function is unchanged: rotary turns each pair (x_c, x_{c+d/2}) by an angle, a linear map that
    commutes with scaling both members by one number, so the rotated key's pair is `factor` times the old one
    and the rotated query's is 1/`factor` times; their products, and so every q . k and every attention weight,
    are unchanged: exactly so for a power-of-two factor (scaling by 2^n only moves the floating-point exponent),
    up to rounding for others. Values, outputs and the MLP are untouched.

    Why int8 KV suffers: `quantize_kv` gives each (token, head) key vector one absmax scale, max|k| / 127. The
    outlier channel now sets that max, so the step is up to `factor` times coarser for every other channel, whose
    queries are not scaled down: their part of q . k is rounded up to `factor` times more roughly. fp8 (e4m3)
    keeps about 2^-4 relative precision per element whatever the scale, until small elements fall below its
    normal range, so it is far less sensitive (the benchmark measures both).
    """
    config = model.config
    if config.qk_norm:
        raise ValueError("the model normalises q and k per head (qk_norm), which would undo the scaling: "
                         "key outliers cannot be planted this way.")
    d, half = config.head_dim, config.head_dim // 2
    if not channels or not all(0 <= c < half for c in channels):
        raise ValueError(f"channels are rotary pairs, 0 .. head_dim / 2 - 1 = {half - 1}; got {list(channels)}.")
    pair = [c + offset for c in channels for offset in (0, half)]  # both members of each rotary pair
    q_rows = [h * d + c for h in range(config.n_heads) for c in pair]
    k_rows = [config.n_heads * d + h * d + c for h in range(config.n_kv_heads) for c in pair]
    outliers = copy.deepcopy(model)
    for layer in outliers.layers:
        qkv = layer.self_attn.qkv_proj
        for param in (qkv.weight, qkv.bias) if qkv.bias is not None else (qkv.weight,):
            param[q_rows] /= factor  # every query head: each reads its group's K/V head through these channels
            param[k_rows] *= factor
    return outliers


def greedy_agreement(llm: LLM, reference: LLM | Sequence[Sequence[int]], prompts: Sequence[str | list[int]],
                     max_tokens: int = 32) -> dict[str, float]:
    """How closely the greedy generations of `llm` follow `reference`'s over `prompts`.

    reference: another `LLM`, or the token ids it generated for each prompt (`greedy_tokens`, to reuse them).
    Returns greedy_match, the share of prompts whose max_tokens greedy tokens are all the reference's (with
    its standard error, as a task's share), greedy_prefix, the mean share of the reference's tokens matched before
    the first difference, and prompts. An exact engine change (speculative decoding with exact acceptance) keeps
    both at 1.0 up to rounding ties; a lossy one lowers them.
    """
    ours = greedy_tokens(llm, prompts, max_tokens)
    theirs = greedy_tokens(reference, prompts, max_tokens) if isinstance(reference, LLM) else reference
    if len(theirs) != len(ours):
        raise ValueError(f"the reference has {len(theirs)} generations for {len(ours)} prompts: give one each.")
    match, prefix = [], []
    for a, b in zip(ours, theirs):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        match.append(list(a) == list(b))
        prefix.append(common / max(len(b), 1))
    p, stderr = share_with_stderr(match)  # a share with its standard error, as the tasks report theirs
    return {"greedy_match": p, "greedy_match_stderr": stderr, "greedy_prefix": sum(prefix) / len(prefix),
            "prompts": len(match)}


def greedy_tokens(llm: LLM, prompts: Sequence[str | list[int]], max_tokens: int = 32) -> list[list[int]]:
    """The token ids `llm` generates greedily for each prompt, up to max_tokens (or EOS)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.token_ids for o in llm.generate(list(prompts), params, use_tqdm=False)]
