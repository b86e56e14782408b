"""minillm.train.gguf_export (chapter 06): Q8_0 and Q4_0 blocks bit for bit as gguf-py (llama.cpp's reference
quantisers in numpy) makes them, and a GGUF file that reads back to the model it was written from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import minillm
from minillm.formats.gguf_reader import interleaved_to_rotary, rotary_to_interleaved
from minillm.train.gguf_export import (
    dequantize_q4_0,
    dequantize_q8_0,
    q4_0_blocks,
    q8_0_blocks,
    read_gguf,
    write_gguf,
)

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install gguf) is the reference")
from gguf.quants import dequantize, quantize  # noqa: E402

OURS = {"Q8_0": q8_0_blocks, "Q4_0": q4_0_blocks}


def awkward_matrix(seed: int, scale: float) -> torch.Tensor:
    """Random rows plus the blocks where rounding rules show: zeros, exact halves, ties, one huge value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 128, generator=g) * scale
    x[0, :32] = 0  # an all-zero block: d = 0
    x[1, :32] = torch.tensor([0.5, -0.5, 1.5, -2.5] * 8) * scale  # ties after scaling
    x[2, :32] = torch.linspace(-1, 1, 32) * scale
    x[3, 5] = 1e4 * scale  # one outlier: the rest of its block rounds to 0
    x[4, :32] = -torch.arange(32.0) * scale  # the largest magnitude is negative: Q4_0's d flips sign
    return x


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("seed, scale", [(0, 1.0), (1, 1e-3), (2, 37.0), (3, 1e-7)])
def test_blocks_are_bit_exact_with_gguf_py(qtype, seed, scale):
    x = awkward_matrix(seed, scale)
    expected = quantize(x.numpy(), getattr(gguf.GGMLQuantizationType, qtype)).reshape(-1)
    ours = OURS[qtype](x).numpy().reshape(-1)
    mismatched = np.flatnonzero(expected != ours)
    assert mismatched.size == 0, f"{mismatched.size} bytes differ, first at byte {mismatched[:5]}"


# Q8_0: half a step d = absmax / 127, plus d's fp16 rounding times the largest code (127 * 2^-11 d).
# Q4_0: d = absmax / 8 and a full step where the largest magnitude's opposite lands on code 16, clipped to 15.
BOUNDS = {"Q8_0": (dequantize_q8_0, (0.5 + 127 * 2**-11) / 127), "Q4_0": (dequantize_q4_0, (1 + 8 * 2**-11) / 8)}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_dequantise_matches_gguf_py_and_the_error_bound(qtype):
    dequant, bound = BOUNDS[qtype]
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    blocks = OURS[qtype](x)
    theirs = dequantize(blocks.numpy().reshape(8, -1), getattr(gguf.GGMLQuantizationType, qtype)).reshape(-1)
    ours = dequant(blocks)
    assert np.array_equal(ours.numpy(), theirs)
    absmax = x.reshape(-1, 32).abs().amax(-1, keepdim=True)
    err = (ours.reshape(-1, 32) - x.reshape(-1, 32)).abs()
    assert (err <= absmax * bound).all()


def test_rows_must_fill_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_blocks(torch.zeros(2, 48))


def test_rotary_reordering_round_trips_and_pairs_neighbours():
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)  # 2 heads of head_dim 8, dim 3
    inter = rotary_to_interleaved(w, n_heads=2)
    assert torch.equal(interleaved_to_rotary(inter, n_heads=2), w)
    # head 0: rotate-half pairs rows (0, 4), (1, 5), ...; interleaved puts them at (0, 1), (2, 3), ...
    assert torch.equal(inter[0], w[0]) and torch.equal(inter[1], w[4]) and torch.equal(inter[2], w[1])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_written_file_reads_back_to_the_dequantised_model(qtype, tmp_path):
    model, tok = minillm.load(minillm.DEFAULT_MODEL)
    path = tmp_path / f"m.{qtype}.gguf"
    info = write_gguf(model, tok, path, qtype)
    assert info["quantised_tensors"] == 7 * model.config.n_layers
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == model.config.vocab_size
    back = read_gguf(path)
    w = model.layers[0].mlp.down_proj.weight.detach()
    expected = (dequantize_q8_0 if qtype == "Q8_0" else dequantize_q4_0)(OURS[qtype](w)).reshape(w.shape)
    assert torch.equal(back.layers[0].mlp.down_proj.weight.detach(), expected)
    torch.testing.assert_close(back.embed_tokens.weight, model.embed_tokens.weight)
    ids = torch.tensor([tok.encode("ROMEO.\nBut soft, what light")])
    with torch.no_grad():
        p, q = model(ids)[0, -1].log_softmax(-1), back(ids)[0, -1].log_softmax(-1)
    kl = (p.exp() * (p - q)).sum().item()
    assert kl < (0.01 if qtype == "Q8_0" else 0.1), f"KL(model || {qtype} file) = {kl:.4f}"


@pytest.mark.parametrize("qtype", ["F32", "F16"])
def test_float_files_hold_every_tensor_and_the_tokenizers_bos_rule(qtype, tmp_path):
    """F32 reads back exactly, F16 to fp16 rounding; the tokenizer's tokens, merges, BOS/EOS ids and the
    add-BOS flag (minillm puts <s> before a text prompt, so llama.cpp must too) are in the file."""
    from minillm.checkpoints import to_checkpoint_names
    from minillm.train.gguf_export import gguf_name, special_tokens_added

    model, tok = minillm.load(minillm.DEFAULT_MODEL)
    path = tmp_path / f"m.{qtype}.gguf"
    write_gguf(model, tok, path, qtype.lower())  # the CLI's lower-case names work too
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    expected_names = {gguf_name(n) for n in to_checkpoint_names(model) if n != "lm_head.weight"}
    assert set(tensors) == expected_names
    for name in to_checkpoint_names(model):
        if name == "lm_head.weight":
            continue  # tied to the embedding: llama.cpp reuses token_embd
        stored = tensors[gguf_name(name)]
        block_linear = ".layers." in name and name.endswith("proj.weight")
        assert stored.tensor_type.name == (qtype if block_linear else "F32"), name
    back = read_gguf(path)
    for (name, ours), theirs in zip(to_checkpoint_names(model).items(), to_checkpoint_names(back).values()):
        if qtype == "F32" or not name.endswith("proj.weight"):
            assert torch.equal(ours.float(), theirs), name
        else:
            assert torch.equal(ours.half().float(), theirs), name
    fields = reader.fields
    assert fields["tokenizer.ggml.bos_token_id"].contents() == tok.bos_token_id
    assert fields["tokenizer.ggml.eos_token_id"].contents() == tok.eos_token_ids[0]
    assert (fields["tokenizer.ggml.add_bos_token"].contents(), fields["tokenizer.ggml.add_eos_token"].contents()) \
        == special_tokens_added(tok) == (True, False)
    assert len(fields["tokenizer.ggml.merges"].contents()) > 0


def test_unknown_gguf_type_is_refused(tmp_path):
    model, tok = minillm.load(minillm.DEFAULT_MODEL)
    with pytest.raises(ValueError, match="F32, F16, Q8_0, Q4_0"):
        write_gguf(model, tok, tmp_path / "x.gguf", "Q5_K")


def test_export_command_writes_the_file(tmp_path, capsys):
    from minillm.cli import main

    path = tmp_path / "model.q4_0.gguf"
    assert main(["export", "--gguf", str(path), "--dtype", "q4_0"]) == 0
    assert "42 block linears in Q4_0" in capsys.readouterr().out
    assert gguf.GGUFReader(str(path)).fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_0


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_llama_cpp_continues_a_text_prompt_as_minillm_does(qtype, tmp_path):
    """Where llama-cpp-python is installed (not in CI: it compiles llama.cpp), it runs the export on a text
    prompt, tokenised by llama.cpp itself, and greedy decoding gives minillm's tokens."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it compiles for ~20 min)")
    model, tok = minillm.load(minillm.DEFAULT_MODEL)
    path = tmp_path / f"m.{qtype}.gguf"
    write_gguf(model, tok, path, qtype)
    prompt = "ROMEO.\nBut soft, what light through yonder window breaks?\n"
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False)
    assert llm.tokenize(prompt.encode()) == tok.encode(prompt), "llama.cpp tokenises the prompt differently"
    theirs = llm(prompt, max_tokens=24, temperature=0.0, top_k=1)["choices"][0]["text"]
    source = model if qtype == "F32" else read_gguf(path)  # Q8_0: minillm on the file's own dequantised weights
    ours = minillm.generate(source, prompt, minillm.SamplingParams(temperature=0.0, max_tokens=24), tok).text
    assert theirs == ours
