"""GGUF, llama.cpp's file format: write a model in F32, F16, Q8_0 or Q4_0, and read it back (chapter 06).

GGUF is one file: a header of key-value metadata (architecture, sizes, the tokenizer's vocabulary
and merges), a table of tensors (name, shape, type, offset), then the tensors' bytes. Quantised
types store a row in *blocks* of 32 weights, each block self-contained:

    Q8_0  34 bytes = fp16 d + 32 int8 q            w = q * d,        d = max|w| / 127   (8.5 bits/weight)
    Q4_0  18 bytes = fp16 d + 16 bytes of nibbles  w = (q - 8) * d,  d = -m / 8          (4.5 bits/weight)
                     (m: the block's weight of largest magnitude, with its sign, so it lands on code 0 exactly;
                      weights 0-15 in the low nibbles, 16-31 in the high ones)

`q8_0_blocks` and `q4_0_blocks` compute exactly the bytes of ggml's reference quantisers
(`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref` in ggml-quants.c, mirrored in numpy by gguf-py's
`gguf.quants`; tests check them bit for bit): fp32 arithmetic, ggml's round-half-away-from-zero
for Q8_0 and truncation of x/d + 8.5 for Q4_0.

The K-quants (Q4_K, Q5_K, Q6_K, ...) nest this idea: a super-block of 256 weights holds 8 or 16
sub-blocks, each with its own 6-bit scale (and min), and one fp16 scale for the super-block
quantises those scales: about 4.5 bits per weight for Q4_K with better accuracy than Q4_0, the
usual choice for llama.cpp (Q4_K_M mixes Q4_K and Q6_K by tensor). They are not written here.

    write_gguf(model, tokenizer, "model.Q4_0.gguf", "Q4_0")   # block linears in Q4_0, the rest F32
    model2 = read_gguf("model.Q4_0.gguf")                       # a Transformer with the dequantised weights

On the command line: `minillm export --gguf model.gguf --dtype q8_0` (f32, f16, q8_0 or q4_0). The file
also says whether the tokenizer adds `<s>` / `</s>` to a text prompt (`tokenizer.ggml.add_bos_token`),
so llama.cpp tokenises a prompt as minillm does and continues it the same way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from minillm.checkpoints import build_model, to_checkpoint_names
from minillm.formats.gguf_reader import gguf_name, read_gguf_checkpoint, rotary_to_interleaved
from minillm.model import Transformer
from minillm.tokenizer import Tokenizer

BLOCK = 32  # weights per block in Q8_0 and Q4_0


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., n], n a multiple of 32 -> fp32 [n_blocks, 32] (row-major, as ggml walks a tensor)."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"Q8_0/Q4_0 need rows of a multiple of {BLOCK} weights, got {x.shape[-1]}.")
    return x.detach().float().reshape(-1, BLOCK)


def _fp16_bytes(d: torch.Tensor) -> torch.Tensor:
    """fp32 [n, 1] -> its fp16 little-endian bytes, uint8 [n, 2]."""
    return d.half().view(torch.uint8).reshape(-1, 2)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """ggml's roundf in fp32 (halves away from zero), written as gguf-py writes it so the bits agree."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def q8_0_blocks(x: torch.Tensor) -> torch.Tensor:
    """Q8_0 bytes of x [..., n]: uint8 [n_blocks, 34] = fp16 d, then 32 int8 codes."""
    b = _blocks(x)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = round_half_away(b * inv).to(torch.int8)
    return torch.cat((_fp16_bytes(d), q.view(torch.uint8)), dim=-1)


def q4_0_blocks(x: torch.Tensor) -> torch.Tensor:
    """Q4_0 bytes of x [..., n]: uint8 [n_blocks, 18] = fp16 d, then 16 bytes (codes 0-15 low, 16-31 high)."""
    b = _blocks(x)
    m = b.gather(-1, b.abs().argmax(-1, keepdim=True))  # the weight of largest magnitude, sign kept
    d = m / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15).to(torch.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat((_fp16_bytes(d), packed), dim=-1)


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [n_blocks, 34] -> fp32 [n_blocks * 32]."""
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    return (blocks[:, 2:].contiguous().view(torch.int8).float() * d).flatten()


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [n_blocks, 18] -> fp32 [n_blocks * 32]."""
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    packed = blocks[:, 2:]
    q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float() - 8
    return (q * d).flatten()


QUANTISERS = {"Q8_0": q8_0_blocks, "Q4_0": q4_0_blocks}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}
GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_0")

def write_gguf(model: Transformer, tokenizer: Tokenizer, path: str | Path, qtype: str = "Q8_0") -> dict[str, int]:
    """Write `model` to a GGUF file: block linears in `qtype` (F32, F16, Q8_0 or Q4_0), norms and embedding in F32.

    Returns {"file_bytes": ..., "quantised_tensors": ...} (the block linears written in `qtype`). The
    tokenizer goes in as a GPT-2-style byte-level BPE (tokens, merges, <s>/</s>), as llama.cpp reads it.
    """
    import gguf  # the reference writer (PyPI `gguf`, from llama.cpp)

    qtype = qtype.upper()
    if qtype not in GGUF_TYPES:
        raise ValueError(f"the GGUF type must be one of {', '.join(GGUF_TYPES)}, got {qtype!r}.")
    c = model.config
    scaling = (c.rope_scaling or {}).get("rope_type", "default")
    if scaling != "default":
        raise ValueError(f"this model scales its rotary frequencies ({scaling!r}), which minillm's GGUF writer does "
                         "not record: llama.cpp would read the file with unscaled frequencies and answer "
                         "differently past the original context. Convert it with llama.cpp's own "
                         "convert_hf_to_gguf.py.")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(c.max_seq_len)
    writer.add_embedding_length(c.dim)
    writer.add_block_count(c.n_layers)
    writer.add_feed_forward_length(c.ffn_dim)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    file_types = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                  "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
    writer.add_file_type(file_types[qtype])
    _add_tokenizer(writer, tokenizer)
    n_block_linears = 0
    for name, t in to_checkpoint_names(model).items():
        if name == "lm_head.weight" and c.tie_embeddings:
            continue
        t = t.detach().float().cpu()
        if name.endswith("q_proj.weight"):
            t = rotary_to_interleaved(t, c.n_heads)
        elif name.endswith("k_proj.weight"):
            t = rotary_to_interleaved(t, c.n_kv_heads)
        if ".layers." in name and name.endswith("proj.weight"):
            if qtype in FLOAT_TYPES:
                writer.add_tensor(gguf_name(name), t.numpy().astype(FLOAT_TYPES[qtype]))
            else:
                blocks = QUANTISERS[qtype](t).reshape(t.shape[0], -1).numpy()
                writer.add_tensor(gguf_name(name), blocks, raw_dtype=getattr(gguf.GGMLQuantizationType, qtype))
            n_block_linears += 1
        else:
            writer.add_tensor(gguf_name(name), t.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"file_bytes": Path(path).stat().st_size, "quantised_tensors": n_block_linears}


def special_tokens_added(tokenizer: Tokenizer) -> tuple[bool, bool]:
    """(adds BOS, adds EOS): what minillm's tokenizer puts around a text prompt, read off an encoding."""
    plain, templated = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a")
    bos = tokenizer.bos_token_id is not None and templated[:1] == [tokenizer.bos_token_id] != plain[:1]
    eos = bool(tokenizer.eos_token_ids) and templated[-1:] == tokenizer.eos_token_ids[:1] != plain[-1:]
    return bos, eos


def _add_tokenizer(writer, tokenizer: Tokenizer) -> None:  # noqa: ANN001 - a gguf.GGUFWriter
    import json

    spec = json.loads(tokenizer.backend.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if i in special else 1 for _, i in vocab])  # 3: control, 1: normal
    writer.add_token_merges(merges)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    if tokenizer.eos_token_ids:
        writer.add_eos_token_id(tokenizer.eos_token_ids[0])
    adds_bos, adds_eos = special_tokens_added(tokenizer)  # else llama.cpp guesses, and may leave <s> out
    writer.add_add_bos_token(adds_bos)
    writer.add_add_eos_token(adds_eos)


def read_gguf(path: str | Path) -> Transformer:
    """A `Transformer` with the dequantised weights of a GGUF file (read by `minillm.formats.gguf_reader`)."""
    config, tensors, _ = read_gguf_checkpoint(path)
    return build_model(config, tensors).eval()
