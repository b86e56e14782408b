"""Many LoRA adapters in one batch: what they cost against the base model and a merged adapter (chapter 08, issue 32).

The model: the shipped model (fp32 on a CPU, bf16 on a GPU). The adapters: random, rank 16, on all seven
projections (q, k, v, o, gate, up, down), so each is the most expensive kind. Measured:

1. Engine throughput (`LLM.generate`, greedy, every request generating exactly its max_tokens) for a batch of
   `--batch` requests: the base model alone; one adapter merged into the weights; and unmerged with 1, 4, 16
   and 64 distinct adapters spread over the batch (max_loras = that number, so no request waits for a slot).
2. The batched LoRA op on one target for `--batch` token rows: the per-adapter loop (the engine's PyTorch
   path), every row gathering its own matrices (BGMV in PyTorch), the Triton kernel (CUDA only), and the
   target's base matmul it rides on; with the bytes the op must move, as GB/s against the device's copy
   bandwidth. On a GPU also at two Llama-3.2-1B targets (q_proj 2048 -> 2048, gate_proj 2048 -> 8192).
3. The cost of loading one adapter into a slot (host -> device), and slot thrashing: 16 adapters in the batch
   with 4 slots, where requests wait for slots and adapters are evicted and loaded again, against 16 slots.

On a 2-core CPU the batch is 64 with 24-token prompts and 24 new tokens (a few seconds per run); on a GPU the
defaults are larger. Writes results/lora_throughput/{cpu,cuda}.json.

    python benchmarks/lora_throughput.py
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from common import write_results
from minillm.kernels import add_lora_gathered, add_lora_reference

import minillm
from minillm.config import ModelConfig
from minillm.decoding.llm import LLM
from minillm.lora import LoRAAdapter, LoRASlots, merge_adapter, target_rows, unmerge_adapter
from minillm.sampler.sampling import SamplingParams


def random_adapter(config: ModelConfig, seed: int, rank: int) -> LoRAAdapter:
    """A random rank-`rank` adapter on all seven projections."""
    g = torch.Generator().manual_seed(seed)
    rows = target_rows(config)
    weights = {(layer, t): (0.02 * torch.randn(rank, d_in, generator=g), 0.02 * torch.randn(n, rank, generator=g))
               for layer in range(config.n_layers) for t, (_, _, n, d_in) in rows.items()}
    return LoRAAdapter(rank, 2.0 * rank, weights)


def timed(fn, repeats: int) -> float:  # noqa: ANN001 - any callable
    """Median seconds of fn() over `repeats` runs, after one warm-up (synchronising on CUDA)."""
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def engine_throughput(model, tokenizer, adapters: dict, distinct: int | None, args, max_loras: int | None = None,
                      merged: bool = False) -> dict:  # noqa: ANN001
    """Output tokens / s of one batch; distinct: how many adapters the batch's requests cycle through (None: base)."""
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    prompts = [[(7 * i + j) % 4000 + 2 for j in range(args.prompt_len)] for i in range(args.batch)]
    if merged:
        merge_adapter(model, adapters["lora0"])
    modules = {} if distinct is None else {f"lora{i}": adapters[f"lora{i}"] for i in range(distinct)}
    blocks = args.batch * (-(-(args.prompt_len + args.new_tokens) // 16) + 1)  # what the batch needs, not more
    llm = LLM(model, tokenizer, num_blocks=blocks, max_num_seqs=args.batch,
              max_num_batched_tokens=args.batch * args.prompt_len,
              lora_modules=modules or None, max_loras=max_loras or max(distinct or 1, 1))
    loras = None if distinct is None else [f"lora{i % distinct}" for i in range(args.batch)]
    # warm-up: the whole batch for two tokens (compiles the kernels for the prefill's shapes and loads the adapters)
    llm.generate(prompts, dataclasses.replace(params, max_tokens=2), use_tqdm=False, lora=loras)
    slots = llm.engine.lora_slots
    loads, evictions = (slots.loads, slots.evictions) if slots else (0, 0)
    runs = []
    for _ in range(args.runs):  # the median of a few runs: one is short enough for a hiccup to move it
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora=loras)
        runs.append(time.perf_counter() - start)
    seconds = statistics.median(runs)
    if merged:
        unmerge_adapter(model, adapters["lora0"])
    tokens = sum(len(o.token_ids) for o in outs)
    if slots:  # per timed run
        loads, evictions = (slots.loads - loads) // args.runs, (slots.evictions - evictions) // args.runs
    return {"seconds": round(seconds, 3), "output_tokens": tokens, "tok_per_s": round(tokens / seconds, 1),
            "slot_loads": loads, "evictions": evictions}


def copy_gb_s(device: torch.device) -> float:
    """The device's copy bandwidth: GB/s read plus written by one large tensor copy (256 MiB)."""
    src = torch.empty(2**28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), 10) / 1e9


def op_times(d_in: int, d_out: int, device: torch.device, dtype: torch.dtype, args) -> dict:  # noqa: ANN001
    """The batched LoRA op for one target (y [batch, d_out] += B A x, rank `args.rank`, 64 slots) by distinct
    adapters in the batch, against the target's own base matmul; with the bytes each way must read and write."""
    g = torch.Generator(device=device).manual_seed(0)
    a = 0.02 * torch.randn(64, args.rank, d_in, device=device, dtype=dtype, generator=g)
    b = 0.02 * torch.randn(64, d_out, args.rank, device=device, dtype=dtype, generator=g)
    x = torch.randn(args.batch, d_in, device=device, dtype=dtype, generator=g)
    w = 0.02 * torch.randn(d_out, d_in, device=device, dtype=dtype, generator=g)
    y = x @ w.T
    size = torch.finfo(dtype).bits // 8
    out: dict = {"d_in": d_in, "d_out": d_out, "base_matmul_ms": round(1e3 * timed(lambda: x @ w.T, args.repeats), 4),
                 "base_matmul_bytes": size * (d_out * d_in + args.batch * (d_in + d_out)), "by_distinct": {}}
    kernels = {"per_adapter_loop_ms": add_lora_reference, "bgmv_gathered_ms": add_lora_gathered}
    if device.type == "cuda":
        from minillm.kernels import add_lora

        kernels["triton_kernel_ms"] = add_lora
    for distinct in (1, 4, 16, 64):
        ids = torch.arange(args.batch, device=device) % distinct
        row = {name: round(1e3 * timed(lambda f=fn, i=ids: f(y, x, a, b, i), args.repeats), 4)
               for name, fn in kernels.items()}
        # the least a kernel must move: x, y read and written, and each distinct adapter's A and B once
        row["bytes"] = size * (args.batch * (d_in + 2 * d_out) + min(distinct, args.batch) * args.rank * (d_in + d_out))
        fastest = min(v for k, v in row.items() if k.endswith("_ms"))
        row["fastest_gb_s"] = round(row["bytes"] / (fastest / 1e3) / 1e9, 2)
        out["by_distinct"][distinct] = row
    return out


def load_cost(model, adapters: dict, args) -> dict:  # noqa: ANN001
    """Seconds to copy one adapter from host memory into a device slot, and its bytes."""
    slots = LoRASlots(model, 1, args.rank)
    slots.register("a", adapters["lora0"])
    seconds = timed(lambda: slots._load("a", 0), args.repeats)
    nbytes = sum(t.numel() * model.dtype.itemsize for pair in adapters["lora0"].weights.values() for t in pair)
    return {"load_ms": round(1e3 * seconds, 3), "adapter_bytes": nbytes, "slot_bytes_all_slots": slots.nbytes,
            "GB_per_s": round(nbytes / seconds / 1e9, 3)}


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128 if cuda else 24)
    parser.add_argument("--new-tokens", type=int, default=128 if cuda else 24)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls of each op (median)")
    parser.add_argument("--runs", type=int, default=3, help="timed generate calls of each engine (median)")
    args = parser.parse_args()
    device = "cuda" if cuda else "cpu"
    model, tokenizer = minillm.load(minillm.DEFAULT_MODEL, device=device,
                                    dtype=torch.bfloat16 if cuda else torch.float32)
    adapters = {f"lora{i}": random_adapter(model.config, i, args.rank) for i in range(64)}
    results: dict = {"model": minillm.DEFAULT_MODEL, "dtype": str(model.dtype), "device": device,
                     "gpu": torch.cuda.get_device_name(0) if cuda else None, "engine_runs": args.runs,
                     "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "rank": args.rank, "targets": "q,k,v,o,gate,up,down"}
    # Unmeasured: the process's first engine compiles kernels. A base engine, because an engine with adapters wraps
    # the model's projections in LoRALinear layers, and base and merged are measured on the plain model first.
    engine_throughput(model, tokenizer, adapters, None, args)
    throughput = {"base": engine_throughput(model, tokenizer, adapters, None, args),
                  "merged_1": engine_throughput(model, tokenizer, adapters, None, args, merged=True)}
    for distinct in (1, 4, 16, 64):
        throughput[f"unmerged_{distinct}"] = engine_throughput(model, tokenizer, adapters, distinct, args)
        print(f"unmerged, {distinct} adapters: {throughput[f'unmerged_{distinct}']}", flush=True)
    throughput["thrash_16_adapters_4_slots"] = engine_throughput(model, tokenizer, adapters, 16, args, max_loras=4)
    results["throughput"] = throughput
    config, dtype = model.config, model.dtype
    results["op"] = {"note": f"one target, y [batch, d_out] += B A x, rank {args.rank}; the engine runs 7 a layer",
                     "shipped_q_proj": op_times(config.dim, target_rows(config)["q_proj"][2], model.device, dtype,
                                                args)}
    if cuda:  # a target of a size where bytes, not launches, should set the time
        results["op"]["llama-1B_q_proj"] = op_times(2048, 2048, model.device, dtype, args)
        results["op"]["llama-1B_gate_proj"] = op_times(2048, 8192, model.device, dtype, args)
    results["op"]["copy_gb_s"] = round(copy_gb_s(model.device), 1)
    results["adapter_load"] = load_cost(model, adapters, args)
    for name, row in throughput.items():
        print(f"{name:28s} {row['tok_per_s']:>9.1f} tok/s  loads {row['slot_loads']:>3d}  evictions {row['evictions']}")
    print(results["op"])
    print(results["adapter_load"])
    print("wrote", write_results(f"lora_throughput/{'cuda' if cuda else 'cpu'}", results))


if __name__ == "__main__":
    main()
