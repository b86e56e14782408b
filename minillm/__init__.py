"""minillm: a small, readable LLM inference engine, the one every chapter of the book imports.

    import minillm
    model, tokenizer = minillm.load(minillm.DEFAULT_MODEL)   # or any local Hugging Face folder
    out = minillm.generate(model, "Once upon a time", minillm.SamplingParams(max_tokens=32), tokenizer)
    print(out.text)
"""

from minillm.beam import beam_search
from minillm.checkpoints import (
    DEFAULT_DRAFT,
    DEFAULT_MODEL,
    from_transformers,
    list_models,
    load,
    save,
    shipped_models,
)
from minillm.config import ModelConfig
from minillm.generate import GenerationOutput, StreamChunk, generate, generate_no_cache, generate_stream
from minillm.kv_cache import KVCache
from minillm.model import Transformer
from minillm.parallel_sampling import generate_n
from minillm.sampling import SamplingParams, sample
from minillm.tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_MODEL",
    "GenerationOutput",
    "KVCache",
    "ModelConfig",
    "SamplingParams",
    "StreamChunk",
    "Tokenizer",
    "Transformer",
    "beam_search",
    "from_transformers",
    "generate",
    "generate_n",
    "generate_no_cache",
    "generate_stream",
    "list_models",
    "load",
    "sample",
    "save",
    "shipped_models",
]
