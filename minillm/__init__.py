"""minillm: a small, readable LLM inference engine, the one every chapter of the book imports.

    import minillm
    model, tokenizer = minillm.load(minillm.DEFAULT_MODEL)   # or any local Hugging Face folder
    out = minillm.generate(model, "Once upon a time", minillm.SamplingParams(max_tokens=32), tokenizer)
    print(out.text)

The names below are imported on first use (PEP 562's module `__getattr__`), not when the package is:
`import minillm.cli` then costs milliseconds instead of PyTorch's start-up, so `minillm --help` answers
at once and a Ctrl-C while the command starts ends it quietly (the CLI catches it; an import at the top
of this file would have run before the CLI could).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "beam_search": "minillm.decoding.beam",
    "DEFAULT_DRAFT": "minillm.shipped",
    "DEFAULT_MODEL": "minillm.shipped",
    "from_transformers": "minillm.checkpoints",
    "list_models": "minillm.checkpoints",
    "load": "minillm.checkpoints",
    "save": "minillm.checkpoints",
    "shipped_models": "minillm.shipped",
    "ModelConfig": "minillm.config",
    "GenerationOutput": "minillm.decoding.generation",
    "StreamChunk": "minillm.decoding.generation",
    "generate": "minillm.decoding.generation",
    "generate_no_cache": "minillm.decoding.generation",
    "generate_stream": "minillm.decoding.generation",
    "KVCache": "minillm.contiguous_cache",
    "Transformer": "minillm.model",
    "generate_n": "minillm.decoding.parallel_sampling",
    "LLM": "minillm.decoding.llm",
    "SamplingParams": "minillm.sampler.sampling",
    "sample": "minillm.sampler.sampling",
    "Tokenizer": "minillm.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import `minillm.<name>` from its module the first time it is asked for, then keep it here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'minillm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

