"""What crosses the sandbox's boundary: values, never objects (every chapter's grading).

`minillm grade` runs a reader's notebook in a sandbox process and its tests in its own (see
`minillm.book.grading.sandbox`). A test's call of the reader's function crosses between the two twice,
and both ways it travels as *plain data*, written with `torch.save` and read with
`torch.load(weights_only=True)`, which builds tensors and Python's plain containers and refuses every
other class. So neither side runs code of the other's making when it reads a message:

    grader -> sandbox   encode(args)   tensors, numbers, strings, bytes, lists, tuples, dicts, dtypes,
                                       and the few objects the tests hand to answers, by their fields:
                                       a ModelConfig or MLAConfig, a RegexDFA, a Transformer (its config
                                       and weights)
    sandbox -> grader   to_data(result)  the same plain data; any other object becomes an `Opaque`
                                         stand-in that only says what it was

`decode` (in the sandbox) rebuilds the objects with minillm's own classes. A test that hands an answer
anything else gets a `WireError` naming it: the test's fault, said before any sandbox runs the call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

MAX_DEPTH = 20
_SCALARS = (bool, int, float, complex, str)


def _bytes(x: bytes) -> dict:
    """bytes as {"__bytes__": latin-1 text}: pickle's protocol 2 writes b"" as a call of `bytes`, which
    `weights_only` refuses, so every bytes value travels as text, one character per byte."""
    return {"__bytes__": x.decode("latin-1")}


def _is_bytes(x: dict) -> bool:
    return set(x) == {"__bytes__"} and isinstance(x["__bytes__"], str)


class WireError(TypeError):
    """A test handed the answer something that cannot cross to the sandbox as a value."""


def _by_fields() -> dict[str, type]:
    """The dataclasses sent by their fields: minillm's configurations, rebuilt as they were."""
    from minillm.arithmetic import MLAConfig
    from minillm.config import ModelConfig

    return {cls.__name__: cls for cls in (ModelConfig, MLAConfig)}




def _plain_tensor(x: torch.Tensor) -> torch.Tensor:
    """x as a tensor of the plain class, on the CPU; views stay views (torch.save keeps shared storage)."""
    plain = torch.Tensor.as_subclass(x.detach(), torch.Tensor).cpu()
    return plain.requires_grad_() if x.requires_grad and x.is_leaf else plain


def encode(x: Any, depth: int = 0) -> Any:
    """x as plain data for the sandbox; raises `WireError` for what cannot be sent by value."""
    from minillm.model import Transformer

    if depth > MAX_DEPTH:
        raise WireError(f"the test's arguments are nested more than {MAX_DEPTH} deep")
    if x is None or type(x) in _SCALARS or type(x) in (torch.dtype, torch.Size):
        return x
    if type(x) is bytes:
        return _bytes(x)
    if isinstance(x, torch.Tensor):
        return _plain_tensor(x)
    if type(x) in (list, tuple):
        return type(x)(encode(v, depth + 1) for v in x)
    if type(x) is dict and all(type(k) in (str, int) for k in x) and not {"__value__", "__bytes__"} & set(x):
        return {k: encode(v, depth + 1) for k, v in x.items()}
    from minillm.sampler.constrained import RegexDFA

    if type(x) is RegexDFA:  # its pattern and tables (numpy arrays, sent as tensors); the rest is derived from them
        tables = {name: torch.from_numpy(getattr(x, name).copy()) for name in ("transitions", "accepting")}
        return {"__value__": "RegexDFA", "pattern": str(x.pattern), "start": int(x.start), **tables}
    if type(x) is Transformer:
        state = {name: _plain_tensor(t) for name, t in x.state_dict().items()}
        return {"__value__": "Transformer", "config": encode(x.config, depth + 1), "state": state,
                "training": x.training}
    cls = _by_fields().get(type(x).__name__)
    if cls is type(x):
        fields = {f.name: encode(getattr(x, f.name), depth + 1) for f in dataclasses.fields(x)}
        return {"__value__": cls.__name__, "fields": fields}
    raise WireError(f"a test hands the answer a {type(x).__module__}.{type(x).__qualname__}, which cannot be sent "
                    "to the sandbox as a value; pass tensors, numbers, strings, lists, dicts or one of "
                    f"Transformer, RegexDFA, {', '.join(_by_fields())}")


def decode(x: Any) -> Any:
    """Undo `encode`: minillm's objects rebuilt from their values (in the sandbox)."""
    if isinstance(x, dict):
        if _is_bytes(x):
            return x["__bytes__"].encode("latin-1")
        kind = x.get("__value__")
        if kind == "Transformer":
            from minillm.model import Transformer

            model = Transformer(decode(x["config"]))
            dtypes = [t.dtype for t in x["state"].values() if t.is_floating_point()]
            model = model.to(dtypes[0]) if dtypes else model
            model.load_state_dict(x["state"], strict=True)
            return model.train(bool(x["training"]))
        if kind == "RegexDFA":
            from minillm.sampler.constrained import RegexDFA

            dfa = RegexDFA.__new__(RegexDFA)  # the grader's tables as they are: its state numbers hold here too
            dfa.pattern, dfa.start = x["pattern"], x["start"]
            dfa.transitions, dfa.accepting = x["transitions"].numpy(), x["accepting"].numpy()
            dfa._rows = dfa.transitions.tolist()
            return dfa
        cls = _by_fields().get(kind) if isinstance(kind, str) else None
        if cls is not None:
            obj = cls.__new__(cls)
            for name, value in x["fields"].items():
                object.__setattr__(obj, name, decode(value))  # as it was, frozen dataclasses too
            return obj
        return {k: decode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(decode(v) for v in x)
    return x


# ---- the way back: the answer's result --------------------------------------------------------------


class Opaque:
    """Stands in, on the grader's side, for a returned object that is not plain data.

    Its class is named after the original's (`type(x).__name__` says `ndarray`), so the tests'
    messages ("expected a torch.Tensor, got ndarray") read as they would for the real object.
    """

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def to_data(x: Any, depth: int = 0) -> Any:
    """x as plain data: tensors (plain class, on the CPU), numbers, strings, bytes, lists, tuples, dicts."""
    if depth > MAX_DEPTH:
        return {"__opaque__": type(x).__name__, "repr": "(nested too deeply)"}
    if x is None or type(x) in _SCALARS:
        return x
    if type(x) is bytes:
        return _bytes(x)
    if isinstance(x, torch.Tensor):
        return torch.Tensor.as_subclass(x.detach(), torch.Tensor).cpu().clone()
    if type(x) in (torch.dtype, torch.Size):
        return x
    if type(x) in (list, tuple):
        return type(x)(to_data(v, depth + 1) for v in x)
    if type(x) is dict and all(type(k) in (str, int) for k in x):
        return {k: to_data(v, depth + 1) for k, v in x.items()}
    return {"__opaque__": type(x).__name__, "repr": _short_repr(x)}


def from_data(x: Any) -> Any:
    """Undo `to_data`'s marking of objects that were not plain data (see `Opaque`)."""
    if isinstance(x, dict):
        if _is_bytes(x):
            return x["__bytes__"].encode("latin-1")
        if set(x) == {"__opaque__", "repr"} and isinstance(x["__opaque__"], str):
            cls = type(x["__opaque__"], (Opaque,), {})
            return cls(str(x["repr"]))
        return {k: from_data(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(from_data(v) for v in x)
    return x


def _short_repr(x: Any) -> str:
    try:
        text = repr(x)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not break the reply
        text = f"<{type(x).__name__}>"
    return text if len(text) <= 200 else text[:199] + "…"
