"""`EngineConfig`: everything that shapes an engine but the model and its tokenizer, in one object.

The front doors build one (the server from its flags, `LLM` and the tests from keywords) and hand it to
`LLMEngine(model, tokenizer, config)`, which composes its cache, scheduler and runner from it. Keywords still work:
`LLMEngine(model, tokenizer, max_num_seqs=8)` is `LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=8))`, and
keywords given beside a config override its fields. Names follow vLLM's engine arguments where they exist.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from minillm.engine.block_manager import BLOCK_SIZE
from minillm.sampler.speculative import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    """An engine's settings (`LLMEngine`'s docstring says what each does). Frozen: a new setting is a new config,
    `dataclasses.replace(config, max_num_seqs=8)`."""

    num_blocks: int | None = None  # default: what kv_cache_memory_bytes holds, else max_num_seqs contexts (CPU: 2 GiB)
    block_size: int = BLOCK_SIZE
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    cuda_graphs: bool | None = None  # None: wherever they can run
    speculative: SpeculativeConfig | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: float | None = None
    compile_decode: bool | str = False  # True, "background" or False: `LLMEngine`
    tensor_parallel_size: int = 1
    lora_modules: dict[str, str | Path | object] | None = None
    max_loras: int = 4
    max_lora_rank: int | None = None
    async_scheduling: bool | None = None  # None: on for a CUDA model where nothing forbids it

    @classmethod
    def of(cls, config: EngineConfig | None = None, **options: Any) -> EngineConfig:
        """`config` (default: the defaults) with `options` replacing its fields; a clear TypeError for anything else."""
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"LLMEngine(model, tokenizer, config): config must be an EngineConfig, got "
                            f"{type(config).__name__} {config!r}. Give other settings by keyword, e.g. num_blocks=64.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine setting(s) {unknown}; an engine takes: {', '.join(sorted(known))}")
        return replace(config or cls(), **options)


def check_tensor_parallel(config: EngineConfig) -> None:
    """A ValueError for settings tensor parallelism cannot run with (checked before any worker starts)."""
    n = config.tensor_parallel_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}.")
    if n != 1 and (config.speculative is not None or config.compile_decode):
        raise ValueError("tensor_parallel_size > 1 runs plain eager steps: leave speculative and compile_decode off "
                         "with it.")
    if n != 1 and config.async_scheduling:
        raise ValueError("async_scheduling=True runs ahead of the host, which tensor parallelism (its workers get "
                         "the tokens from the host) cannot: leave async_scheduling unset with it.")
