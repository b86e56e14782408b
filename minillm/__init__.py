"""minillm: a small, readable LLM inference engine, the one every chapter of the book imports.

    import minillm
    model, tokenizer = minillm.load("path/to/hf-folder")
    out = minillm.generate(model, "Once upon a time", minillm.SamplingParams(max_tokens=32), tokenizer)
    print(out.text)
"""

from minillm.checkpoints import from_transformers, load, save, shipped_models
from minillm.config import ModelConfig
from minillm.generate import GenerationOutput, StreamChunk, generate, generate_no_cache, generate_stream
from minillm.kv_cache import KVCache
from minillm.model import Transformer
from minillm.sampling import SamplingParams, sample
from minillm.tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "GenerationOutput",
    "KVCache",
    "ModelConfig",
    "SamplingParams",
    "StreamChunk",
    "Tokenizer",
    "Transformer",
    "from_transformers",
    "generate",
    "generate_no_cache",
    "generate_stream",
    "load",
    "sample",
    "save",
    "shipped_models",
]
