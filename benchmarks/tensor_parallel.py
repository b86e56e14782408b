"""Tensor parallelism, measured (chapter 08): the decode step at TP = 1, 2 (, 4), what its all-reduces cost, and
whether the split is exact on the device.

For each TP size p (one CPU core or one GPU per rank):
- `all_reduce_us`: the median time of one all-reduce of the activations [B, dim] in the model's dtype, in a group
  of p processes by itself (gloo on the CPU, NCCL on GPUs). A decode step makes 2 per layer. `bus_gb_s` is
  NCCL's "bus bandwidth" convention, 2 (p - 1) / p x bytes / time: what each link carried per second.
- `step_ms`: the median decode-only step of `LLMEngine(..., tensor_parallel_size=p)` at batch B, eager (the
  engine's TP steps are not captured as CUDA graphs, so TP = 1 runs eagerly too, for a like-for-like pair);
  on CUDA, `step_ms_graphs` is TP = 1 with its CUDA graphs, the engine as it runs alone.
- `check`: the greedy tokens of TP = p against TP = 1 (the first `--tokens`), and the largest difference of the
  prompt's last logits.

    python benchmarks/tensor_parallel.py                      # CPU: the shipped model, TP 1 and 2 (2 cores)
    python benchmarks/tensor_parallel.py --shape llama-8B     # GPUs: writes results/tensor_parallel/cuda.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import write_results
from roofline import SHAPES

import minillm
from minillm.config import ModelConfig
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.model_runner import paged_forward
from minillm.model import Transformer
from minillm.parallel.tensor import start_group
from minillm.parallel.workers import free_port
from minillm.sampler.sampling import SamplingParams


def _all_reduce_rank(rank: int, world: int, port: int, shapes: list[tuple[int, int]], dtype: torch.dtype,
                     cuda: bool, repeats: int, queue) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    medians = []
    for shape in shapes:
        x = torch.ones(shape, dtype=dtype, device=device)
        times = []
        for i in range(repeats + 5):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            dist.all_reduce(x)
            if cuda:
                torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    if rank == 0:
        queue.put(medians)
    dist.destroy_process_group()


def all_reduce_seconds(world: int, shapes: list[tuple[int, int]], dtype: torch.dtype, cuda: bool,
                       repeats: int = 50) -> list[float]:
    """Median seconds of one all-reduce of each of `shapes`, in a group of `world` fresh processes."""
    context = mp.get_context("spawn")
    queue, port = context.Queue(), free_port()
    procs = [context.Process(target=_all_reduce_rank, args=(r, world, port, shapes, dtype, cuda, repeats, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join()
    return result


def build_model(shape: str, device: str) -> tuple[Transformer, object]:
    """The shipped model (fp32, CPU) or a random model of a Llama shape in bf16 on `device`."""
    if shape == "shipped":
        model, tokenizer = minillm.load(minillm.DEFAULT_MODEL)
        return model.to(device), tokenizer
    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192,
                                  "rms_norm_eps": 1e-5, **SHAPES[shape]})
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Transformer(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval(), None


def decode_step_seconds(engine: LLMEngine, batch: int, context: int, steps: int, seed: int = 1) -> float:
    """Median seconds of the engine's decode-only steps over `batch` requests of `context` random tokens."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for p in torch.randint(2, engine.model.config.vocab_size, (batch, context), generator=g).tolist():
        engine.add_request(None, p, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()  # ends on the host reading the sampled tokens: synchronised
        seconds = time.perf_counter() - start
        plan = engine.last_step
        if plan.num_prefill_tokens == 0 and plan.num_decode_tokens == batch:
            times.append(seconds)
    return statistics.median(times[1:])


def engine_for(model: Transformer, tokenizer: object, tp: int, batch: int, context: int, steps: int,
               graphs: bool = False) -> LLMEngine:
    blocks = batch * (context + steps + 18) // 16 + 4
    config = EngineConfig(num_blocks=blocks, max_num_seqs=batch, max_num_batched_tokens=max(8 * context, batch),
                          enable_prefix_caching=False, cuda_graphs=None if graphs else False, tensor_parallel_size=tp)
    return LLMEngine(model, tokenizer, config, group=start_group(model, config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, help="shipped (CPU default), llama-1B or llama-8B (GPU default)")
    parser.add_argument("--tp", type=int, nargs="+", default=None, help="TP sizes (default: 1, 2 and 4 if the GPUs)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared against TP = 1")
    parser.add_argument("--name", default=None, help="results file suffix")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shape = args.shape or ("llama-8B" if cuda else "shipped")
    sizes = args.tp or ([p for p in (1, 2, 4) if p <= torch.cuda.device_count()] if cuda else [1, 2])
    torch.set_num_threads(1)
    model, tokenizer = build_model(shape, device)
    config = model.config
    print(f"{shape} on {device}: TP sizes {sizes}, batches {args.batch}", flush=True)

    # the check: greedy tokens and the prompt's logits, TP = p against TP = 1
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, config.vocab_size, (args.context,), generator=g).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    one = PagedKVCache(config, args.context // 16 + 2, 16, model.device, model.dtype)
    one.add_sequence("s")
    reference_logits = paged_forward(model, one, ["s"], [prompt]).float()
    del one
    rows = []
    for p in sizes:
        for batch in args.batch:
            row = {"tp": p, "batch": batch}
            layer_bytes = batch * config.dim * model.dtype.itemsize
            if p > 1:
                [seconds] = all_reduce_seconds(p, [(batch, config.dim)], model.dtype, cuda)
                row |= {"all_reduce_us": seconds * 1e6, "all_reduce_bytes": layer_bytes,
                        "bus_gb_s": 2 * (p - 1) / p * layer_bytes / seconds / 1e9,
                        "all_reduces_per_step": 2 * config.n_layers,
                        "all_reduce_ms_per_step": 2 * config.n_layers * seconds * 1e3}
            engine = engine_for(model, tokenizer, p, batch, args.context, args.steps)
            try:
                row["step_ms"] = decode_step_seconds(engine, batch, args.context, args.steps) * 1e3
                if batch == args.batch[0]:
                    out = engine.add_request("check", prompt, greedy)
                    tokens = None
                    while engine.has_unfinished_requests():
                        for o in engine.step():
                            if o.request_id == out and o.finished:
                                tokens = o.token_ids
                    engine.cache.add_sequence("logits")
                    logits = engine.model_runner.forward(["logits"], [prompt]).float()
                    row["greedy_tokens"] = tokens
                    row["max_abs_logit_diff"] = float((logits - reference_logits).abs().max())
            finally:
                engine.shutdown()
            if cuda and p == 1:
                engine = engine_for(model, tokenizer, 1, batch, args.context, args.steps, graphs=True)
                row["step_ms_graphs"] = decode_step_seconds(engine, batch, args.context, args.steps) * 1e3
            rows.append(row)
            print({k: v for k, v in row.items() if k != "greedy_tokens"}, flush=True)

    base = {r["batch"]: r for r in rows if r["tp"] == 1}
    for r in rows:
        if "greedy_tokens" in r and r["batch"] in base and "greedy_tokens" in base[r["batch"]]:
            ref = base[r["batch"]]["greedy_tokens"]
            r["same_tokens_as_tp1"] = next((i for i, (a, b) in enumerate(zip(r["greedy_tokens"], ref)) if a != b),
                                           len(ref))
        if r["batch"] in base:
            r["speedup_over_tp1"] = base[r["batch"]]["step_ms"] / r["step_ms"]
    name = f"tensor_parallel/{device}" + (f"_{args.name}" if args.name else "")
    path = write_results(name, {
        "benchmark": "decode step under tensor parallelism, and its all-reduces",
        "settings": {"shape": shape, "config": {k: getattr(config, k) for k in (
            "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")}, "dtype": str(model.dtype),
            "context": args.context, "steps": args.steps, "tokens": args.tokens,
            "gpus": torch.cuda.device_count() if cuda else 0,
            "gpu": torch.cuda.get_device_name(0) if cuda else None},
        "rows": rows})
    print(f"\nwrote {path}\n")
    print(f"{'TP':>3} {'batch':>5} {'step ms':>9} {'x TP1':>6} {'AR us':>8} {'AR ms/step':>10} {'same tokens':>11}")
    for r in rows:
        print(f"{r['tp']:>3} {r['batch']:>5} {r['step_ms']:9.2f} {r.get('speedup_over_tp1', 1):6.2f} "
              f"{r.get('all_reduce_us', 0):8.1f} {r.get('all_reduce_ms_per_step', 0):10.2f} "
              f"{str(r.get('same_tokens_as_tp1', '')):>11}")


if __name__ == "__main__":
    main()
