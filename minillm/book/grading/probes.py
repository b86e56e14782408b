"""Probes: the code that watches a reader's function from the inside, run beside it in the grader's sandbox.

A test that must see more than what the reader's function returns (how many token positions it fed the model,
whether it copied K and V, what it handed to a callback, W after an in-place step) passes one of these to
`call_probed(answer, probe, *args)` (`minillm.book.grading.registry`). When grading, the probe runs in the
notebook's process, where the answer lives: this module is imported there by name, and it is the only grading
code there that a test's call brings in.

So nothing here may help an answer: no reference answers, no expected values, no hidden inputs. A probe only
observes and returns plain data (numbers, strings, tensors, lists, dicts); the tests in `tasks/`, which stay in
the grader's process and are not even readable in the sandbox, decide what the data means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from minillm.book.grading.registry import short_repr
from minillm.config import ModelConfig
from minillm.model import Transformer
from minillm.quant import int_grid
from minillm.quant.gptq import inverse_hessian_factor


def describe(x: object) -> str:
    """What came back, in a few words: `Tensor [4, 8] torch.int8`, `tuple of 2: (Tensor ..., float)`."""
    if isinstance(x, torch.Tensor):
        return f"Tensor {list(x.shape)} {x.dtype}"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(describe(v) for v in x[:4]) + (", …" if len(x) > 4 else "")
        return f"{type(x).__name__} of {len(x)}: ({inner})"
    return f"{type(x).__name__} {short_repr(x, 80)}"


# ---- chapter 02: the cache's saving, counted -------------------------------------------------------


def count_embedded_positions(answer: Callable, model: Transformer, prompt: list[int], n_new: int) -> tuple[object, int]:
    """A probe (see `grading.registry.call_probed`): the answer's result, and how many token positions it
    pushed through the model's embedding."""
    seen = [0]

    def count(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen[0] += args[0].numel()

    handle = model.embed_tokens.register_forward_hook(count)
    try:
        got = answer(model, list(prompt), n_new)
    finally:
        handle.remove()
    return got, seen[0]


# ---- chapter 03: K and V read as they are, the config left as it was -----------------------------------------------


# The ops that move or copy data without computing on it: their results still are K or V (a view or a
# copy of it), so the probe keeps watching them. Any other op (matmul, einsum, softmax...) computes.
_DATA_OPS = frozenset({
    "__getitem__", "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "permute",
    "swapaxes", "swapdims", "movedim", "moveaxis", "t", "mT", "T", "mH", "H", "unsqueeze", "squeeze", "narrow",
    "select", "unbind", "chunk", "split", "split_with_sizes", "tensor_split", "expand", "expand_as",
    "broadcast_to", "broadcast_tensors", "contiguous", "clone", "detach", "to", "type", "type_as", "float",
    "double", "half", "bfloat16", "cpu", "as_strided", "repeat", "repeat_interleave", "tile", "index_select",
    "gather", "take_along_dim", "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack",
})
_WATCH: dict[str, list] = {"ops": [], "copies": []}


class WatchedKV(torch.Tensor):
    """K or V handed to the reader by `watch_kv_copies`: records every op applied to it (or to a view or
    copy of it), and which of those made a copy with more elements than K and V hold (see `_DATA_OPS`)."""

    _kv_path = "k"

    @classmethod
    def __torch_function__(cls, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None) or repr(func)
        if name == "__get__":  # a property: .mT, .T, .shape
            name = getattr(getattr(func, "__self__", None), "__name__", "property")
        with torch._C.DisableTorchFunctionSubclass():  # run the op, and look at tensors, without recursing here
            out = func(*args, **kwargs)
            inputs = [t for t in _tensors(args) + _tensors(list(kwargs.values())) if isinstance(t, WatchedKV)]
            path = f"{inputs[0]._kv_path}.{name}" if inputs else name
            _WATCH["ops"].append(path)
            if name not in _DATA_OPS:
                return out
            storages, held = set(), 0  # the elements K and V (or the views handed in) actually hold
            for t in inputs:
                s = t.untyped_storage()
                if s.data_ptr() not in storages:
                    storages.add(s.data_ptr())
                    held += s.nbytes() // max(1, t.element_size())
            for t in _tensors(out if isinstance(out, (list, tuple)) else [out]):
                if t.untyped_storage().data_ptr() not in storages and t.numel() > held:
                    _WATCH["copies"].append(path)
                    break
        return _rewrap(out, path)


def _tensors(xs: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for x in xs if isinstance(xs, (list, tuple)) else [xs]:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            found.extend(_tensors(x))
    return found


def _rewrap(out: Any, path: str) -> Any:
    if isinstance(out, WatchedKV):  # the op handed back its input (k.float() of a float k, an in-place op)
        return out
    if isinstance(out, torch.Tensor):
        out = out.as_subclass(WatchedKV)
        out._kv_path = path
        return out
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap(x, path) for x in out)
    return out


def watch_kv_copies(answer: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[object, list, list]:
    """A probe (see `grading.registry.call_probed`): answer(q, k, v) with k and v watched.

    Returns (the answer's result, every op applied to K/V or views of them as "k.transpose" strings,
    the ops among them that made a copy of K or V larger than K and V themselves).
    """
    _WATCH["ops"], _WATCH["copies"] = [], []
    k, v = k.clone().as_subclass(WatchedKV), v.clone().as_subclass(WatchedKV)
    k._kv_path, v._kv_path = "k", "v"
    got = answer(q, k, v)
    if isinstance(got, torch.Tensor):
        got = torch.Tensor.as_subclass(got.detach(), torch.Tensor).clone()
    return got, list(_WATCH["ops"]), sorted(set(_WATCH["copies"]))


def watch_config(answer: Callable, config: ModelConfig, *args: Any) -> tuple[object, bool]:
    """A probe (see `grading.registry.call_probed`): the answer's result, and whether it left `config` as it was."""
    before = dataclasses.asdict(config)
    got = answer(config, *args)
    return got, dataclasses.asdict(config) == before


# ---- chapter 06: GPTQ's column step, in place ----------------------------------------------------------------------


def run_column(answer: Callable, W: torch.Tensor, U: torch.Tensor, j: int, scale: torch.Tensor,
               zero: torch.Tensor | None, bits: int) -> tuple[object, torch.Tensor]:
    """A probe (see `grading.registry.call_probed`): the answer's result, and W after the call (the step works in
    place, and in the grader's sandbox W is the sandbox's copy)."""
    got = answer(W, U, j, scale, zero, bits)
    return got, W


def gptq_with(answer: Callable, W: torch.Tensor, H: torch.Tensor, bits: int, group_size: int) -> dict:
    """A probe: GPTQ of W [out, n] (inputs' Hessian H) with the answer as its column step, zero points per group,
    each group's grid fitted to its columns as updated so far: `gptq_quantize`'s loop with every correction applied
    at once instead of block by block. Returns {"dequantized": W' [out, n] fp64, "bad": None or what came back
    that is not (codes, err)}."""
    W = W.double().clone()
    U = inverse_hessian_factor(H)
    out, n = W.shape
    result = torch.zeros_like(W)
    scale = zero = None
    for j in range(n):
        if j % group_size == 0:
            s, z = int_grid(W[:, j : j + group_size], bits, symmetric=False)
            scale, zero = s.double(), z.double()
        got = answer(W, U, j, scale, zero, bits)
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[0], torch.Tensor)
                and got[0].numel() == out):
            return {"dequantized": result, "bad": describe(got)}
        result[:, j] = (got[0].double().reshape(-1) - zero) * scale
    return {"dequantized": result, "bad": None}


# ---- chapter 07: the verify step's draws ---------------------------------------------------------------------------


def _as_distribution(dist: object) -> torch.Tensor:
    try:
        d = torch.as_tensor(dist.detach() if isinstance(dist, torch.Tensor) else dist)
    except Exception:  # noqa: BLE001 - a message the reader can act on instead
        raise TypeError(f"residual_sample takes a distribution (a tensor of V probabilities), got "
                        f"{type(dist).__name__}") from None
    return d.to(torch.float64).reshape(-1).clone()


def record_draws(answer: Callable, p: torch.Tensor, q: torch.Tensor, draft_tokens: list[int],
                 uniforms: list[float]) -> tuple[object, list[torch.Tensor]]:
    """A probe (see `grading.registry.call_probed`): the answer's result, and every distribution it handed to
    `residual_sample`, which "draws" that distribution's most likely token, so that each case has one answer."""
    given: list[torch.Tensor] = []

    def residual_sample(dist: torch.Tensor) -> int:
        d = _as_distribution(dist)
        given.append(d)
        return int(d.argmax())

    got = answer(p, q, list(draft_tokens), list(uniforms), residual_sample)
    return got, given


def sample_steps(answer: Callable, p: torch.Tensor, q: torch.Tensor, trials: int, seed: int) -> dict:
    """A probe: the answer run as `trials` real verify steps, drafts drawn from q's rows, the uniforms from a seeded
    generator, and residual_sample drawing with torch.multinomial.

    Returns {"counts": counts[position][token] of the emitted tokens, "lengths": steps per number of tokens emitted,
    "bad": None, or the first result that is not 1 to k + 1 token ids}.
    """
    gen = torch.Generator().manual_seed(seed)
    k, vocab = q.shape
    drafts = torch.stack([torch.multinomial(q[i], trials, replacement=True, generator=gen) for i in range(k)],
                         dim=1).tolist()
    uniforms = torch.rand(trials, k, generator=gen, dtype=torch.float64).tolist()
    counts = [[0] * vocab for _ in range(k + 1)]
    lengths = [0] * (k + 2)

    def residual_sample(dist: torch.Tensor) -> int:
        d = _as_distribution(dist)
        if d.numel() != vocab or not bool(torch.isfinite(d).all()) or bool((d < 0).any()) or float(d.sum()) <= 0:
            raise ValueError(f"residual_sample needs a distribution over the {vocab} tokens: finite, non-negative "
                             f"values with a positive sum; got {short_repr([round(x, 4) for x in d.tolist()], 100)}")
        return int(torch.multinomial(d, 1, generator=gen))

    for t in range(trials):
        got = answer(p, q, list(drafts[t]), list(uniforms[t]), residual_sample)
        tokens = as_tokens(got)
        if tokens is None or not 1 <= len(tokens) <= k + 1 or not all(0 <= x < vocab for x in tokens):
            return {"counts": counts, "lengths": lengths, "bad": short_repr(got)}
        lengths[len(tokens)] += 1
        for position, token in enumerate(tokens):
            counts[position][token] += 1
    return {"counts": counts, "lengths": lengths, "bad": None}


def as_tokens(got: object) -> list[int] | None:
    """The reader's result as a list of ints (a list of ints or of one-element int tensors, or a 1-D int tensor)."""
    if isinstance(got, torch.Tensor):
        if got.dim() != 1 or got.dtype.is_floating_point or got.dtype == torch.bool:
            return None
        return [int(t) for t in got.tolist()]
    if not isinstance(got, (list, tuple)):
        return None
    out = []
    for t in got:
        if isinstance(t, torch.Tensor) and t.numel() == 1 and not t.dtype.is_floating_point and t.dtype != torch.bool:
            t = int(t.item())
        if not isinstance(t, int) or isinstance(t, bool):
            return None
        out.append(t)
    return out
