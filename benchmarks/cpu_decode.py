"""Batch-1 decode on a laptop-class CPU: minillm against llama.cpp, on the same shipped model.

The shipped `shakespeare-11m`, greedy, `--tokens` new tokens after a short prompt, at 1 and 2 threads,
`--repeats` runs of every configuration interleaved (medians reported):

- minillm `generate` in fp32, in bf16, and with `--quant int8` (weights stay int8 on the CPU and are
  multiplied by PyTorch's int8 weight-only kernel, `aten._weight_int8pack_mm`), each eager and with
  `compile_decode=True` (the decode step exported and compiled ahead of time by AOTInductor; its one-time
  compile is done before the timed runs and reported apart);
- llama.cpp (PyPI `llama-cpp-python`) on minillm's own GGUF exports (F32, F16, Q8_0), when
  `llama_cpp` is importable; skipped with a message when it is not (it compiles llama.cpp, ~20 min).

Also one decode step of the model's forward: its wall time, and how many PyTorch ops it runs (counted by
the profiler, whose own overhead per op makes its times useless for splitting the step's time), and for the
compiled configurations the calls one compiled step makes (Inductor's generated loops and the library kernels); and the
model's matrix-vector products alone, in fp32 and bf16: the weight bytes PyTorch's batch-1 kernels stream
per second on one core.

    python benchmarks/cpu_decode.py          # writes results/cpu_decode/cpu.json (--name to name it otherwise)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import write_results

import minillm
from minillm.contiguous_cache import KVCache
from minillm.quant import quantize_by_name

PROMPT = "ROMEO.\nBut soft, what light through yonder window breaks?\n"


def load(config: str) -> tuple[minillm.Transformer, minillm.Tokenizer]:
    """The shipped model as `config` says: "fp32", "bf16" or "int8", with "+compile" for a compiled decode step."""
    model, tokenizer = minillm.load(minillm.DEFAULT_MODEL)
    dtype = config.removesuffix("+compile")
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    elif dtype == "int8":
        quantize_by_name(model, "int8", tokenizer)
    return model.eval(), tokenizer


def minillm_decode_tok_s(model: minillm.Transformer, tokenizer: minillm.Tokenizer, tokens: int,
                         compile_decode: bool = False) -> float:
    """Decode tokens/s of `generate_stream`: tokens after the first over the time after the first."""
    params = minillm.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    chunks = list(minillm.generate_stream(model, PROMPT, params, tokenizer, compile_decode=compile_decode))
    return (len(chunks) - 1) / (chunks[-1].time_s - chunks[0].time_s)


LLAMA_CPP_RUN = """
import sys, time
from llama_cpp import Llama
path, threads, tokens, ids = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(i) for i in sys.argv[4].split(",")]
llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
times = []
for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):
    times.append(time.perf_counter())
    if len(times) == tokens:
        break
print((len(times) - 1) / (times[-1] - times[0]))
"""


def llama_cpp_decode_tok_s(path: Path, prompt_ids: list[int], tokens: int, threads: int) -> float | None:
    """llama.cpp's decode tokens/s on `path`, in a process of its own (None if it crashed: it is C code)."""
    proc = subprocess.run([sys.executable, "-c", LLAMA_CPP_RUN, str(path), str(threads), str(tokens),
                           ",".join(map(str, prompt_ids))], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(f"llama.cpp on {path.name} ended with status {proc.returncode}: {proc.stderr.strip()[-300:]}")
        return None
    return float(proc.stdout.strip().splitlines()[-1])


@torch.inference_mode()
def profile_step(model: minillm.Transformer, tokenizer: minillm.Tokenizer, repeats: int = 50) -> dict[str, float]:
    """One decode step's forward at a context of ~30 tokens: the PyTorch ops it runs and its median wall ms."""
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    cache = KVCache(model.config, 1, ids.shape[1] + repeats + 8, dtype=dtype)
    model(ids, cache=cache)
    token = torch.tensor([[int(ids[0, -1])]])
    for _ in range(3):  # warm-up
        model(token, cache=cache)
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(token, cache=cache)
        walls.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(token, cache=cache)
    top = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    return {"ops_per_step": len(top), "step_ms": statistics.median(walls) * 1e3}


def compiled_step_calls(model: minillm.Transformer, tokenizer: minillm.Tokenizer) -> int:
    """The calls one compiled decode step makes: Inductor's generated C++ loops and the library kernels it
    calls (matrix products), counted by the profiler on one decode step of `generate_stream`. The step is
    compiled afresh with Inductor's `cpp.enable_kernel_profile` on, so that its loops show in the profile (the
    timed runs compile without it: it records every loop, which costs time)."""
    import torch._inductor.config as inductor_config

    from minillm.engine.compiled_step import CompiledDecode

    CompiledDecode.compiled_steps.clear()  # compile afresh, with the profiling on
    inductor_config.cpp.enable_kernel_profile = True
    params = minillm.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    stream = minillm.generate_stream(model, PROMPT, params, tokenizer, compile_decode=True)
    for _ in range(10):  # the prompt, then decode steps: the compile is done by now
        next(stream)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        next(stream)
    names = [e.name for e in prof.events()]
    stream.close()
    inductor_config.cpp.enable_kernel_profile = False
    CompiledDecode.compiled_steps.clear()
    # The C++ wrapper calls the library kernels through PyTorch's C shim (aoti_torch_cpu_mm_out, ...).
    library = {"aten::mm", "aten::bmm", "aten::_weight_int8pack_mm", "aoti_torch_cpu_mm_out",
               "aoti_torch_cpu_bmm_out", "aoti_torch_cpu__weight_int8pack_mm"}
    return sum("cpp_fused" in n for n in names) + sum(n in library for n in names)


@torch.inference_mode()
def matvec_gb_s(model: minillm.Transformer, repeats: int = 30) -> dict[str, float]:
    """The model's own batch-1 matrix-vector products alone (every `nn.Linear` of the layers and the tied
    output head, `F.linear` on one row, as an eager decode step calls them): their median ms per step and
    the weight bytes they stream per second. The floor of a step built on PyTorch's kernels."""
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)] + [model.embed_tokens.weight]
    weights = list({w.data_ptr(): w for w in linears}.values())  # a tied head shares the embedding: once
    rows = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    walls = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(rows[w.shape[1]], w)
        if i >= 3:  # after a warm-up
            walls.append(time.perf_counter() - start)
    wall = statistics.median(walls)
    return {"matmuls": len(weights), "ms": wall * 1e3, "gb_s": nbytes / wall / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--configs", nargs="+",
                        default=["fp32", "bf16", "int8", "fp32+compile", "bf16+compile", "int8+compile"])
    parser.add_argument("--gguf-types", nargs="+", default=["F32", "F16", "Q8_0"], help="llama.cpp's files")
    parser.add_argument("--llama-cpp-build", default="", help="how llama-cpp-python was built, for the results")
    parser.add_argument("--name", default="cpu", help="the results file: results/cpu_decode/<name>.json")
    args = parser.parse_args()
    models = {name: load(name) for name in args.configs}
    compile_s: dict[str, float] = {}
    tokenizer = models[args.configs[0]][1]
    prompt_ids = tokenizer.encode(PROMPT)
    runs: dict[tuple[str, int], list[float]] = {}
    ggufs: dict[str, Path] = {}
    crashed: set[str] = set()
    try:
        import llama_cpp  # noqa: F401

        from minillm.train.gguf_export import write_gguf

        folder = Path(tempfile.mkdtemp(prefix="minillm-gguf-"))
        for qtype in args.gguf_types:
            ggufs[f"llama.cpp {qtype}"] = folder / f"model.{qtype}.gguf"
            write_gguf(models["fp32"][0] if "fp32" in models else load("fp32")[0], tokenizer,
                       ggufs[f"llama.cpp {qtype}"], qtype)
        llama_note = f"llama-cpp-python {llama_cpp.__version__} {args.llama_cpp_build}".strip()
    except ImportError:
        llama_note = "llama_cpp is not installed (pip install llama-cpp-python, ~20 min to compile): skipped"
        print(llama_note)

    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, (model, tok) in models.items():
            if name.endswith("+compile"):  # the one-time compile, at this thread count, before the timed runs
                start = time.perf_counter()
                minillm_decode_tok_s(model, tok, 8, compile_decode=True)
                compile_s[f"{name}, {threads} thread(s)"] = time.perf_counter() - start
                print(f"minillm {name}: compiled in {time.perf_counter() - start:.1f} s", flush=True)
        for repeat in range(args.repeats):
            for name, (model, tok) in models.items():
                rate = minillm_decode_tok_s(model, tok, args.tokens, name.endswith("+compile"))
                runs.setdefault((f"minillm {name}", threads), []).append(rate)
                print(f"repeat {repeat + 1}, {threads} thread(s): minillm {name:<12} {rate:7.1f} tok/s", flush=True)
            for name, path in ggufs.items():
                rate = llama_cpp_decode_tok_s(path, prompt_ids, args.tokens, threads)
                if rate is None:
                    crashed.add(name)
                    continue
                runs.setdefault((name, threads), []).append(rate)
                print(f"repeat {repeat + 1}, {threads} thread(s): {name:<13} {rate:7.1f} tok/s", flush=True)

    torch.set_num_threads(1)
    profiles = {name: profile_step(model, tok) for name, (model, tok) in models.items() if "+" not in name}
    matvecs = {name: matvec_gb_s(model) for name, (model, _) in models.items() if name in ("fp32", "bf16")}
    for name, (model, tok) in models.items():
        if name.endswith("+compile"):
            profiles[name] = {"calls_per_step": compiled_step_calls(model, tok)}
    rows = [{"system": system, "threads": threads, "decode_tok_s": statistics.median(rates), "runs": rates}
            for (system, threads), rates in runs.items()]
    median = {(r["system"], r["threads"]): r["decode_tok_s"] for r in rows}
    ratios = {}
    for threads in args.threads:
        pairs = [(f"minillm {d}{c}", ref) for c in ("", "+compile")
                 for d, ref in (("fp32", "llama.cpp F32"), ("bf16", "llama.cpp F16"), ("int8", "llama.cpp Q8_0"))]
        pairs += [("minillm int8", "minillm fp32"), ("minillm fp32+compile", "minillm fp32")]
        for name, ref in pairs:
            if (name, threads) in median and (ref, threads) in median:
                ratios[f"{name} / {ref}, {threads} thread(s)"] = median[(name, threads)] / median[(ref, threads)]
    write_results(f"cpu_decode/{args.name}", {
        "benchmark": "batch-1 greedy decode on the CPU, minillm against llama.cpp",
        "settings": {"model": minillm.DEFAULT_MODEL, "tokens": args.tokens, "repeats": args.repeats,
                     "threads": args.threads, "prompt": PROMPT},
        "compile_s": compile_s, "llama_cpp": llama_note, "llama_cpp_crashed": sorted(crashed), "rows": rows,
        "ratios": ratios, "step_profile_1_thread": profiles, "matvec_1_thread": matvecs,
    })
    print(f"\n{'system':<22} " + " ".join(f"{t} thread(s)".rjust(12) for t in args.threads))
    for system in dict.fromkeys(s for s, _ in median):
        print(f"{system:<22} " + " ".join(f"{median.get((system, t), float('nan')):12.1f}" for t in args.threads))
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    for name, p in profiles.items():
        if "calls_per_step" in p:
            print(f"minillm {name}: {p['calls_per_step']} calls per step (generated loops and library kernels)")
        else:
            print(f"minillm {name}: {p['ops_per_step']} PyTorch ops per step, {p['step_ms']:.2f} ms a step (1 thread)")
    for name, m in matvecs.items():
        print(f"{name}: the {m['matmuls']} matrix-vector products alone {m['ms']:.2f} ms, "
              f"{m['gb_s']:.1f} GB/s (1 thread)")


if __name__ == "__main__":
    main()
