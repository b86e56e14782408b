"""The CPU's compiled decode step (`compile_decode=True`): the paged attention it runs in PyTorch, and the
tokens it produces, which must be the eager engine's."""

from __future__ import annotations

import subprocess

import pytest
import torch
from conftest import run_in_own_process

import minillm
from minillm.engine.llm_engine import LLMEngine
from minillm.model import PagedDecode, paged_attention_torch
from minillm.quant.kv import QuantizedPool, quantize_kv


def _pools_and_tables(seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    blocks, size, h_kv, d = 12, 4, 2, 16
    k_pool = torch.randn(blocks, size, h_kv, d, generator=g).to(dtype)
    v_pool = torch.randn(blocks, size, h_kv, d, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:5] for _ in range(3)])  # [3, 5] shuffled blocks
    lengths = torch.tensor([1, 9, 20])  # a row of one key, a partial last block, a full table
    q = torch.randn(3, 8, 1, d, generator=g).to(dtype)  # 8 query heads over 2 KV heads
    return q, k_pool, v_pool, tables, lengths


def attention_row_by_row(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                         lengths: torch.Tensor) -> torch.Tensor:
    """The textbook answer, one row at a time: row b's first lengths[b] keys, in its table's block order, and
    softmax(q k^T / sqrt(d)) v with each query head on its group's K/V head. q [B, H, d] -> [B, H, d]."""
    out = []
    for b in range(q.shape[0]):
        n = int(lengths[b])
        k = k_pool[tables[b]].flatten(0, 1)[:n].float()  # [n, H_kv, d]
        v = v_pool[tables[b]].flatten(0, 1)[:n].float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [n, H, d]
        weights = torch.einsum("hd,nhd->hn", q[b].float(), k) / q.shape[-1] ** 0.5
        out.append(torch.einsum("hn,nhd->hd", weights.softmax(-1), v))
    return torch.stack(out).to(q.dtype)


def test_paged_attention_in_pytorch_matches_the_gather_reference():
    """Fixed key range (max_seq_len), each row masked to its own length: the reference's answer, row by row."""
    q, k_pool, v_pool, tables, lengths = _pools_and_tables(0)
    mask = PagedDecode(tables, lengths, max_seq_len=20)
    got = paged_attention_torch(q, k_pool, v_pool, mask)
    expected = attention_row_by_row(q[:, :, 0], k_pool, v_pool, tables, lengths)
    assert got.shape == (3, 8, 1, 16)
    torch.testing.assert_close(got[:, :, 0], expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_in_pytorch_reads_8_bit_pools():
    q, k_pool, v_pool, tables, lengths = _pools_and_tables(1)
    (k_codes, k_scale), (v_codes, v_scale) = quantize_kv(k_pool, torch.int8), quantize_kv(v_pool, torch.int8)
    mask = PagedDecode(tables, lengths, max_seq_len=20, dtype=torch.float32)
    got = paged_attention_torch(q, QuantizedPool(k_codes, k_scale), QuantizedPool(v_codes, v_scale), mask)
    dequantised = [(codes.float() * scale[..., None]) for codes, scale in ((k_codes, k_scale), (v_codes, v_scale))]
    expected = attention_row_by_row(q[:, :, 0], *dequantised, tables, lengths)
    torch.testing.assert_close(got[:, :, 0], expected, rtol=1e-5, atol=1e-5)


def test_matvec_as_reduction_is_the_product_for_the_dtypes_chosen(monkeypatch):
    from minillm.engine.compiled_step import int8_matvec_as_reduction, matvec_as_reduction, reduction_dtypes

    monkeypatch.setenv("MINILLM_CPU_MATVEC", "auto")
    assert {torch.bfloat16, torch.float16} <= reduction_dtypes()  # 16-bit weights on every CPU

    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(1, 64, generator=g), torch.randn(48, 64, generator=g)
    for dtype in (torch.bfloat16, torch.float16):
        got = matvec_as_reduction(a.to(dtype), w.to(dtype).t())  # aten.mm's operands: x [1, K], weight.T [K, N]
        want = a.to(dtype).float() @ w.to(dtype).float().t()  # the same rounded operands, summed in fp32
        assert got.shape == (1, 48) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    assert matvec_as_reduction(torch.randn(2, 64).bfloat16(), w.bfloat16().t()) is NotImplemented  # two rows
    monkeypatch.setenv("MINILLM_CPU_MATVEC", "reduction")  # every dtype, fp32 and int8 included
    torch.testing.assert_close(matvec_as_reduction(a, w.t()), a @ w.t(), rtol=1e-5, atol=1e-5)
    codes = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8)
    scales = torch.rand(48, generator=g).bfloat16()
    want = (a.bfloat16().float() @ codes.float().t()) * scales.float()
    got = int8_matvec_as_reduction(a.bfloat16(), codes, scales)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-1)
    monkeypatch.setenv("MINILLM_CPU_MATVEC", "library")  # none: PyTorch's kernels
    assert matvec_as_reduction(a.bfloat16(), w.bfloat16().t()) is NotImplemented
    assert int8_matvec_as_reduction(a.bfloat16(), codes, scales) is NotImplemented
    monkeypatch.setenv("MINILLM_CPU_MATVEC", "fastest")
    with pytest.raises(ValueError, match="use auto, reduction or library"):
        reduction_dtypes()


COMPILED_EQUALS_EAGER = """
import torch
from minillm.engine import LLMEngine
from minillm.engine.compiled_step import CompiledStep
import minillm
model, tok = minillm.load(minillm.DEFAULT_MODEL)
params = minillm.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
for prompt in ("ROMEO.\\n", "JULIET.\\nO Romeo, Romeo"):
    eager = minillm.generate(model, prompt, params, tok)
    compiled = minillm.generate(model, prompt, params, tok, compile_decode=True)
    print(prompt.split(".")[0], compiled.token_ids == eager.token_ids, len(eager.token_ids))
print("compiles", CompiledStep.compiles)  # 40 tokens cross blocks: the tables widen, no recompile
prompts = {"a": "ROMEO.\\n", "b": "JULIET.\\nO Romeo, Romeo, wherefore art thou", "c": "HAMLET.\\nTo be"}
outputs = []
for compile_decode in (False, True):  # three rows of different lengths in one batch, as the engine runs them
    engine = LLMEngine(model, tok, compile_decode=compile_decode)
    for name, prompt in prompts.items():
        engine.add_request(name, tok.encode(prompt), params)
    outputs.append({key: out.token_ids for key, out in engine.run().items()})
print("batch", outputs[0] == outputs[1], CompiledStep.compiles)  # one more step: for batches above 1
model = model.to(torch.bfloat16)  # 16-bit weights: the matrix-vector products lowered as reductions
eager = minillm.generate(model, "ROMEO.\\n", params, tok)
print("bf16", minillm.generate(model, "ROMEO.\\n", params, tok, compile_decode=True).token_ids == eager.token_ids,
      CompiledStep.compiles)  # new weights (the model converted): compiled again
from minillm.quant import quantize_by_name
model, tok = minillm.load(minillm.DEFAULT_MODEL)
quantize_by_name(model, "int8", tok)  # int8 weights (buffers of the compiled step) and an 8-bit KV cache (scale pools)
eager = minillm.generate(model, "ROMEO.\\n", params, tok, kv_cache_dtype="int8")
compiled = minillm.generate(model, "ROMEO.\\n", params, tok, kv_cache_dtype="int8", compile_decode=True)
print("int8", compiled.token_ids == eager.token_ids, CompiledStep.compiles)
"""


def test_compiled_decode_gives_the_eager_engines_tokens(tmp_path):
    """Greedy text of the shipped model through generate, eager and with the decode step compiled: the same
    tokens, from one compile (seconds on a CPU) that serves every table width and both prompts; then a batch
    of three rows of different lengths, compiled and eager, the same tokens (one more compile, for batches above
    1); the model in bf16 (compiled again: new weights), and with int8 weights and an 8-bit KV cache, the same
    tokens as eager each. In a process of its own: Inductor
    sets up Triton's drivers, which the Triton interpreter of other test files needs left alone."""
    proc = run_in_own_process(COMPILED_EQUALS_EAGER, tmp_path)
    assert proc.stdout.split() == ["ROMEO", "True", "40", "JULIET", "True", "40", "compiles", "1", "batch", "True", "2",
                                  "bf16", "True", "3", "int8", "True", "4"], \
        proc.stdout
    assert len([entry for entry in tmp_path.iterdir() if not entry.name.startswith(".")]) == 4  # one entry a step


CACHED_STEP = """
import sys
import torch
import minillm
from minillm.engine.compiled_step import CompiledStep
model, tok = minillm.load(minillm.DEFAULT_MODEL)
with torch.no_grad():  # other weights, the same shapes: a cached step reads these, not those it was compiled with
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
params = minillm.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
eager = minillm.generate(model, "ROMEO.\\n", params, tok)
compiled = minillm.generate(model, "ROMEO.\\n", params, tok, compile_decode=True)
print(compiled.token_ids == eager.token_ids, "compiles", CompiledStep.compiles, "loads", CompiledStep.loads,
      "inductor", "torch._inductor" in sys.modules)  # a step loaded from the cache needs no compiler
"""


def test_a_compiled_step_is_kept_on_disk_and_checked_before_it_is_used(tmp_path):
    """`minillm compile` compiles the shipped model's two decode steps (batch 1, larger batches) into the cache; a
    process on a model of the same shapes with other weights loads the batch-1 step (no compile) and gives that
    model's eager tokens, so the package holds no weights of its own. A package cut short is found out by its
    SHA-256: the next process removes the entry, warns, compiles again and keeps a good entry, which
    `minillm compile` then finds with the other."""
    compile_command = "import sys; from minillm.cli import run; sys.argv[1:] = ['compile', '--threads', '1']; run()"

    def compile_reports(proc: subprocess.CompletedProcess) -> list[str]:  # "batch 1, 1 thread(s): compiled in 20.1 s"
        return [line.split(": ")[1].rsplit(" in ", 1)[0] for line in proc.stdout.splitlines()[:2]]

    first = run_in_own_process(compile_command, tmp_path)
    assert compile_reports(first) == ["compiled", "compiled"], first.stdout
    entries = [e for e in tmp_path.iterdir() if not e.name.startswith(".")]
    assert len(entries) == 2 and all(sorted(f.name for f in e.iterdir()) == ["entry.json", "step.pt2"] for e in entries)
    second = run_in_own_process(CACHED_STEP, tmp_path)
    assert second.stdout.split() == ["True", "compiles", "0", "loads", "1", "inductor", "False"], second.stdout
    for entry in entries:  # cut both packages short
        package = entry / "step.pt2"
        package.write_bytes(package.read_bytes()[: package.stat().st_size // 2])
    third = run_in_own_process(CACHED_STEP, tmp_path)
    assert third.stdout.split() == ["True", "compiles", "1", "loads", "0", "inductor", "True"], third.stdout
    assert "unusable" in third.stderr and "SHA-256" in third.stderr, third.stderr[-2000:]
    fourth = run_in_own_process(CACHED_STEP, tmp_path)
    assert fourth.stdout.split() == ["True", "compiles", "0", "loads", "1", "inductor", "False"], fourth.stdout
    fifth = run_in_own_process(compile_command, tmp_path)  # batch 1 as rebuilt; the larger batches' cut entry redone
    assert compile_reports(fifth) == ["found in the cache, loaded", "compiled"], fifth.stdout


BACKGROUND = """
import minillm
from minillm.engine.compiled_step import BackgroundCompile, CompiledDecode, CompiledStep
model, tok = minillm.load(minillm.DEFAULT_MODEL)
params = minillm.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
eager = minillm.generate(model, "ROMEO.\\n", params, tok)
first = minillm.generate(model, "ROMEO.\\n", params, tok, compile_decode="background")  # eager: no waiting
(job,) = CompiledDecode.background_jobs[model].values()
print(first.token_ids == eager.token_ids, "started", BackgroundCompile.started, "done", job.done(),
      "compiles", CompiledStep.compiles)
job.process.wait(timeout=300)
second = minillm.generate(model, "ROMEO.\\n", params, tok, compile_decode="background")
print(second.token_ids == eager.token_ids, "exit", job.process.returncode, "loads", CompiledStep.loads,
      "started", BackgroundCompile.started, "compiles", CompiledStep.compiles)
"""


def test_a_background_compile_decodes_eagerly_until_the_step_is_in_the_cache(tmp_path):
    """compile_decode="background" on an empty cache: the first request decodes eagerly (the eager engine's tokens)
    while a process of its own compiles the step (still running when the request is done: a compile takes tens of
    seconds, 40 eager tokens well under one); once that process has ended, the next request loads the step from
    the cache and decodes compiled, the same tokens, with no compile in this process."""
    proc = run_in_own_process(BACKGROUND, tmp_path)
    assert proc.stdout.split() == ["True", "started", "1", "done", "False", "compiles", "0",
                                   "True", "exit", "0", "loads", "1", "started", "1", "compiles", "0"], proc.stdout
    assert len([e for e in tmp_path.iterdir() if not e.name.startswith(".")]) == 1


def test_the_cache_key_names_what_decides_a_compiled_step():
    """Another dtype, thread count, static input size or dynamic range is another entry; the same step, or one whose
    inputs differ only in a size that may change (the pool's blocks), is the same entry."""
    from minillm.engine import compile_cache
    from minillm.engine.compiled_step import describe_inputs

    module = torch.nn.Linear(4, 3)
    blocks = torch.export.Dim("blocks", min=2)

    def name(m: torch.nn.Module = module, rows: int = 5, width: int = 4, dims: dict | None = None) -> str:
        inputs = describe_inputs((torch.zeros(rows, width),), ({0: blocks} if dims is None else dims,))
        return compile_cache.entry_name(compile_cache.describe_step(m, inputs, {}))

    same = name()
    assert name() == same and name(rows=9) == same  # the dynamic size may change
    assert name(torch.nn.Linear(4, 3).to(torch.bfloat16)) != same
    assert name(width=6) != same
    assert name(dims={0: torch.export.Dim("blocks", min=3)}) != same
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert name() != same
    finally:
        torch.set_num_threads(threads)


def test_compile_decode_is_refused_where_it_cannot_run():
    model, tok = minillm.load(minillm.DEFAULT_MODEL)
    params = minillm.SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="use_cache=False runs none"):
        minillm.generate(model, "Hi", params, tok, use_cache=False, compile_decode=True)
    from minillm.sampler.speculative import NgramDrafter, SpeculativeConfig

    with pytest.raises(ValueError, match="compile_decode=True, but speculative decoding"):
        LLMEngine(model, tok, speculative=SpeculativeConfig(NgramDrafter(), 2), compile_decode=True)
