"""Reading GGUF, llama.cpp's one-file format, into minillm (chapters 00 and 06).

A GGUF file holds three things, in order: key-value metadata (the architecture's numbers under
`<arch>.*`, the tokenizer under `tokenizer.ggml.*`, the chat template), a table of tensors (name,
shape, type, offset), then the tensors' bytes, many of them quantised in blocks (Q8_0, Q4_1, Q4_K, ...).

    config, tensors, tokenizer = read_gguf_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf")
    model, tokenizer = minillm.load("SmolLM2-135M-Instruct.Q4_1.gguf")   # the same, as a model

What this module undoes, beside the quantisation (dequantised by gguf-py's reference code, `gguf.quants`):
- **llama.cpp's names**: `blk.3.ffn_up.weight` is Hugging Face's `model.layers.3.mlp.up_proj.weight`;
- **the rotary order of Llama's q/k rows**: llama.cpp rotates adjacent pairs (2i, 2i+1) where Hugging Face
  rotates (i, i + d/2), so its converter permutes the rows of `attn_q` and `attn_k` (Qwen2/Qwen3 files are
  not permuted: llama.cpp runs them in the "NeoX" order, which is Hugging Face's);
- **the tokenizer**: a GPT-2-style byte-level BPE stored as lists (tokens, merges, token types), rebuilt here
  as a `tokenizers` BPE with the pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre`.
Every weight is dequantised to floats: the quantised bytes are not kept (minillm's own formats are chapter 06's).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minillm.config import ConfigError, ModelConfig
from minillm.tokenizer import Tokenizer


class GGUFError(ValueError):
    """A GGUF file minillm cannot load; the message names what is missing or unsupported."""


# GGUF's `general.architecture` -> the Hugging Face class minillm builds, and whether llama.cpp's converter
# permuted the q/k rows into adjacent-pair rotary order.
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

# The tensor types gguf-py dequantises that this loader accepts (gguf.GGMLQuantizationType names).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "Q8_K")

# Hugging Face names (per layer, after `model.layers.N.`) -> llama.cpp's (after `blk.N.`).
BLOCK_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
_FROM_GGUF = {v: k for k, v in TOP_NAMES.items()}

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp) by `tokenizer.ggml.pre`, as `tokenizers` pre-tokenizers.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "qwen2")


def gguf_name(hf_name: str) -> str:
    """'model.layers.3.mlp.up_proj.weight' -> 'blk.3.ffn_up.weight'."""
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    _, _, rest = hf_name.partition("model.layers.")
    index, _, name = rest.partition(".")
    return f"blk.{index}.{BLOCK_NAMES[name]}"


def hf_name(name: str) -> str | None:
    """'blk.3.ffn_up.weight' -> 'model.layers.3.mlp.up_proj.weight'; None for a tensor minillm has no use for."""
    if name in _FROM_GGUF:
        return _FROM_GGUF[name]
    block, _, rest = name.partition(".")
    index, _, leaf = rest.partition(".")
    if block != "blk" or not index.isdigit():
        return None
    for hf, ours in BLOCK_NAMES.items():
        if ours == leaf:
            return f"model.layers.{index}.{hf}"
    return None


def interleaved_to_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q/k projection rows [n_heads * d, ...] from adjacent rotary pairs (2i, 2i+1), llama.cpp's order, back to
    Hugging Face's rotate-half pairs (i, i + d/2). Works on a bias [n_heads * d] too."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rotary_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `interleaved_to_rotary`: what llama.cpp's converter does to a Llama checkpoint."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# GGUF's value types: id -> struct format (little-endian); 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass
class TensorInfo:
    """One entry of a GGUF file's tensor table."""

    name: str
    shape: tuple[int, ...]  # PyTorch's order, outermost first (the file lists dimensions innermost first)
    kind: str  # the storage type, a gguf.GGMLQuantizationType name: F32, Q8_0, Q4_K, ...
    offset: int  # where its bytes start, from the start of the file
    nbytes: int


class GGUFFile:
    """A GGUF file's header, read here by hand (it is a short format), and its tensors' bytes, memory-mapped.

    Layout (little-endian): b"GGUF", version (u32, 2 or 3), tensor count (u64), key-value count (u64); then each
    key-value pair (a string key, a u32 type, the value: a scalar, a string = u64 length + UTF-8 bytes, or an array =
    u32 element type + u64 count + elements); then each tensor's name, u32 dimension count, u64 dimensions, u32 type
    and u64 offset; then the tensors' bytes, starting at the next multiple of `general.alignment` (32 by default).
    """

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file.")
        self.path = path
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        self.pos = 0
        if bytes(self.data[:4]) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (it starts with {bytes(self.data[:4])!r}, not b'GGUF').")
        try:
            self._read_header()
        except (struct.error, ValueError, KeyError, UnicodeDecodeError) as e:
            raise GGUFError(f"{path}: its header cannot be read ({type(e).__name__}: {e}); the file is truncated or "
                            "corrupt: download it again.") from e

    def _read_header(self) -> None:
        import gguf  # PyPI `gguf`, llama.cpp's own Python package: the block sizes of each storage type

        self.pos = 4
        version, n_tensors, n_fields = self._unpack("<IQQ")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version}; minillm reads versions 2 and 3 (little-endian).")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I")[0])
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, dims, kind, offset))
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self.pos // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        for name, dims, kind, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(kind)
            except ValueError:
                raise GGUFError(f"tensor {name!r} has storage type {kind}, which gguf-py does not know.") from None
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(dims)) // block * block_bytes
            info = TensorInfo(name, tuple(int(d) for d in reversed(dims)), qtype.name, start + offset, nbytes)
            if info.offset + nbytes > len(self.data):
                raise GGUFError(f"{self.path}: tensor {name!r} ends at byte {info.offset + nbytes:,}, past the end of "
                                f"the file ({len(self.data):,} bytes); the file is truncated: download it again.")
            self.tensors.append(info)

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        text = bytes(self.data[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            element, count = self._unpack("<IQ")
            if element in _SCALARS:  # numbers: one read for the whole array
                values = self._unpack(f"<{count}{_SCALARS[element]}")
                return list(values)
            return [self._value(element) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown value type {kind}")
        return self._unpack("<" + _SCALARS[kind])[0]

    def raw(self, tensor: TensorInfo) -> np.ndarray:
        """A tensor's bytes as uint8 [rows, bytes per row] (rows: every dimension but the innermost)."""
        flat = self.data[tensor.offset:tensor.offset + tensor.nbytes]
        return flat.reshape(int(np.prod(tensor.shape[:-1])), -1)


def metadata(reader: GGUFFile) -> dict[str, Any]:
    """Every key-value field of the file except the tokenizer's long lists."""
    long = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    return {k: v for k, v in reader.fields.items() if k not in long}


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str], vocab_size: int) -> ModelConfig:
    """The `ModelConfig` a GGUF file's metadata describes (its numbers live under `<architecture>.`)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; minillm reads {', '.join(ARCHITECTURES)} "
                        "(Mistral files say 'llama').")
    hf_arch, _ = ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"the file's metadata lacks {arch}.{key}, which minillm needs to build the model.")
        return value

    n_heads, dim = int(get("attention.head_count")), int(get("embedding_length"))
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError("the file scales its rotary frequencies by a rope_freqs tensor (Llama 3.1's scaling), "
                        "which minillm's GGUF reader does not read; load the Hugging Face folder instead.")
    scaling = None
    rope_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_type not in ("none", "linear", "yarn"):
        raise GGUFError(f"rotary scaling {rope_type!r} is not supported; minillm reads none, linear and yarn.")
    if rope_type != "none":
        scaling = {"rope_type": rope_type, "factor": float(get("rope.scaling.factor"))}
        if rope_type == "yarn":
            scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    head_count_kv = meta.get(f"{arch}.attention.head_count_kv", n_heads)
    if not isinstance(head_count_kv, int):
        raise GGUFError(f"{arch}.attention.head_count_kv varies by layer ({head_count_kv!r}); minillm needs one.")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    try:
        return ModelConfig(
            dim=dim, n_layers=int(get("block_count")), n_heads=n_heads, n_kv_heads=int(head_count_kv),
            head_dim=int(meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count",
                                                                          dim // n_heads))),
            ffn_dim=int(get("feed_forward_length")), vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_size)),
            max_seq_len=int(get("context_length")), rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling, norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            tie_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names, o_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            sliding_window=meta.get(f"{arch}.attention.sliding_window"),
            architecture=hf_arch, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=None if eos is None else int(eos),
        )
    except ConfigError as e:
        raise GGUFError(f"the file's metadata describes a model minillm cannot build: {e}") from e


def dequantize(reader: GGUFFile, tensor: TensorInfo) -> torch.Tensor:
    """One tensor of the file -> fp32 in its PyTorch shape, dequantised by gguf-py's reference code."""
    import gguf

    if tensor.kind not in TENSOR_TYPES:
        raise GGUFError(f"tensor {tensor.name!r} is stored as {tensor.kind}, which minillm does not read; it reads "
                        f"{', '.join(TENSOR_TYPES)}.")
    values = gguf.quants.dequantize(reader.raw(tensor), gguf.GGMLQuantizationType[tensor.kind])
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(tensor.shape)  # a copy: F32 is the file's map


def read_tensors(reader: GGUFFile, config: ModelConfig, permuted: bool) -> dict[str, torch.Tensor]:
    """The file's tensors under Hugging Face's names, dequantised to fp32, q/k rows in Hugging Face's order."""
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise GGUFError(f"the file has a tensor {t.name!r} that minillm has no place for (a {config.architecture} "
                            "has none); it may be another architecture than general.architecture says.")
        w = dequantize(reader, t)
        if permuted and (".q_proj." in name or ".k_proj." in name):
            w = interleaved_to_rotary(w, config.n_heads if ".q_proj." in name else config.n_kv_heads)
        tensors[name] = w
    return tensors


def tokenizer_from_metadata(reader: GGUFFile, meta: dict[str, Any], config: ModelConfig) -> Tokenizer:
    """A `tokenizers` byte-level BPE rebuilt from `tokenizer.ggml.*` (tokens, merges, token types, BOS/EOS), with
    control and user-defined tokens as special added tokens (a chat template's `<|im_start|>` is one token)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"the file's tokenizer is {kind!r}; minillm rebuilds GPT-2-style byte-level BPE ('gpt2') "
                        "only (a SentencePiece 'llama' vocabulary is not read).")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"the file's pre-tokenizer {pre!r} is not one minillm knows ({', '.join(PRE_TOKENIZERS)}); "
                        "without its regex the text would split into different tokens than the model was trained on.")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    types = reader.fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in reader.fields.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre == "llama-bpe"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in ("default", "gpt2", "smollm"))
    if pre == "smollm":  # digits one by one first, then GPT-2's regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "qwen2"):
        pattern = LLAMA3_PATTERN if pre == "llama-bpe" else QWEN2_PATTERN
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=types[i] == 3, normalized=False)
               for i in range(len(tokens)) if types[i] in (3, 4)]  # 3: control, 4: user-defined
    tok.add_special_tokens([t for t in special if t.special])
    tok.add_tokens([t for t in special if not t.special])
    bos = config.bos_token_id
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], bos)])
    tokenizer = Tokenizer(tok, bos, config.eos_token_ids)
    tokenizer.chat_template = meta.get("tokenizer.chat_template")
    return tokenizer


def _config(reader: GGUFFile) -> tuple[ModelConfig, dict[str, Any]]:
    meta = metadata(reader)
    names = {t.name for t in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise GGUFError("the file has no token_embd.weight (the embedding table); it is not a whole model.")
    return config_from_metadata(meta, names, int(embedding.shape[0])), meta


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The config a GGUF file describes, read from its header alone (the weights stay on disk)."""
    return _config(GGUFFile(Path(path)))[0]


def read_gguf_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """A GGUF file -> (its config, its tensors under Hugging Face's names in fp32, its tokenizer or None).

    The tokenizer is None when the file carries none (`tokenizer.ggml.tokens` absent)."""
    reader = GGUFFile(Path(path))
    config, meta = _config(reader)
    _, permuted = ARCHITECTURES[meta["general.architecture"]]
    tensors = read_tensors(reader, config, permuted)
    has_vocab = "tokenizer.ggml.tokens" in reader.fields
    tokenizer = tokenizer_from_metadata(reader, meta, config) if has_vocab else None
    return config, tensors, tokenizer
