"""Offline throughput of minillm's engine against `transformers` generate on the same requests (chapter 05).

The model: Llama-3.2-1B's shape (16 layers, 2048 wide, 32 query / 8 KV heads, vocabulary 128,256,
tied embeddings) with random bf16 weights, the same weights in both engines (minillm converts the
`transformers` model). The requests: 256, prompt and output lengths each uniform in 100..1024
(seeded), random prompt ids, greedy, every request generating exactly its output length.

Compared, on those requests:
- `minillm`: `LLM.generate` on all 256 at once: continuous batching on the paged cache (max_num_seqs
  256, a token budget of 8,192 per step, chunked prefill), eager PyTorch with minillm's Triton kernels;
- `transformers, batch B`: `generate` on the requests in arrival order, B at a time, left-padded,
  each batch running until its longest output is done (static batching; `min_new_tokens` = that
  length, so EOS cannot end it early); only the requested tokens count as output;
- `transformers, batch 1`: one request at a time, timed on the first `--hf-single` requests and
  extrapolated to all 256 by their share of output tokens (running all would take most of an hour).

Throughput is requested output tokens per second of wall time. The roofline: for every engine step,
the `minillm.arithmetic` roofline time of its prefill tokens and of a decode step of its running
requests at their mean context, on the datasheet of the GPU it runs on (H200, H100 PCIe, else H100 SXM);
their sum against the measured time (runs before 27 Nov used the H100 SXM datasheet on every GPU, H200s too).

    python benchmarks/engine_throughput.py        # writes results/engine_throughput/<name>.json (--name, default cuda)

The book keeps one run a GPU, named by it: results/engine_throughput/cuda_h100.json and cuda_h200.json.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import random
import statistics
import sys
import time

import torch
from common import write_results

import minillm
from minillm import arithmetic
from minillm.decoding.llm import LLM
from minillm.engine.model_runner import StepTokens
from minillm.sampler.sampling import SamplingParams

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=4096)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's knobs, shared by the benchmarks that run it: how many requests, their lengths, the engine's
    budgets."""
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)


def random_llama_1b():  # noqa: ANN201 - (transformers.LlamaForCausalLM, minillm.Transformer)
    """Llama-3.2-1B's shape with random bf16 weights (seed 0) on the GPU: the transformers model, and minillm's
    conversion of it (the same weights)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_1B)).to("cuda", torch.bfloat16).eval()
    return hf, minillm.from_transformers(hf)


def make_requests(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi)) for _ in range(n)]


def run_minillm(model, requests, max_num_seqs: int, budget: int, temperature: float = 0.0,  # noqa: ANN001
                async_scheduling: bool | None = None, wrap=None) -> dict:  # noqa: ANN001
    """`LLM.generate`'s engine over the requests, stepped here to record each step; async_scheduling None: the
    engine's default (on, on a GPU). wrap(i, step): called instead of the i-th `step()` (0-based), returning its
    outputs (a profiler around chosen calls: `engine_throughput_ab.py --profile-calls`)."""
    longest = max(len(p) + n for p, n in requests)
    kwargs = {} if async_scheduling is None else {"async_scheduling": async_scheduling}
    llm = LLM(model, None, num_blocks=max_num_seqs * arithmetic.kv_blocks(longest, 16), max_num_seqs=max_num_seqs,
              max_num_batched_tokens=budget, **kwargs)
    engine = llm.engine
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for _, n in requests]
    ids = [engine.add_request(None, p, sp) for (p, _), sp in zip(requests, params)]
    # As LLM.generate steps: outputs only for the finished sequences (trees before that option build every row's).
    step = engine.step
    if "finished_only" in inspect.signature(engine.step).parameters:
        step = functools.partial(engine.step, finished_only=True)
    steps, outputs = [], {}
    waited = [0.0]  # seconds inside StepTokens.read (waiting for a step's tokens, then unpacking them): per call
    read = StepTokens.read

    def timed_read(self):  # noqa: ANN001, ANN202
        begin = time.perf_counter()
        try:
            return read(self)
        finally:
            waited[0] += time.perf_counter() - begin

    StepTokens.read = timed_read
    sync()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        called, waited[0] = time.perf_counter(), 0.0
        for out in (step() if wrap is None else wrap(len(steps), step)):
            if out.finished:
                outputs[out.request_id] = out
        plan = engine.last_step
        if not plan.scheduled:  # async scheduling's last call only reads the step before's tokens
            continue
        contexts = [r.num_computed_tokens for r, _ in plan.scheduled]
        # The call's wall time: with async scheduling it also holds the wait for the step before's tokens, so
        # only a synchronous run splits the time exactly between steps.
        steps.append({"prefill_tokens": plan.num_prefill_tokens, "decode_tokens": plan.num_decode_tokens,
                      "mean_context": statistics.fmean(contexts) if contexts else 0,
                      "seconds": time.perf_counter() - called, "read_seconds": waited[0]})
    sync()
    seconds = time.perf_counter() - start
    StepTokens.read = read
    n_out = sum(len(outputs[i].token_ids) for i in ids)
    assert n_out == sum(n for _, n in requests), "every request must generate exactly its output length"
    # CUDA graphs are captured as the engine starts (since 27 Nov 2026; before, at its first decode step, inside
    # the timed run): the capture's seconds, outside `seconds`, reported beside it.
    capture = engine.graphs.capture_seconds if engine.graphs is not None else None
    return {"seconds": seconds, "output_tokens": n_out, "output_tokens_per_s": n_out / seconds, "steps": steps,
            "graph_capture_seconds": capture, "first_tokens": [outputs[i].token_ids[:8] for i in ids[:4]]}


def roofline_gpu() -> str:
    """The `arithmetic.GPU_SPECS` entry of the GPU this runs on (an H100 SXM's datasheet if it is not listed)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return "h200" if "H200" in name else "h100-pcie" if "H100 PCIe" in name else "h100-sxm"


def roofline_seconds(config, steps: list[dict], gpu: str = "h100-sxm") -> float:  # noqa: ANN001
    total = 0.0
    for s in steps:
        if s["prefill_tokens"]:
            total += arithmetic.prefill_time(config, gpu, s["prefill_tokens"]).time_s
        if s["decode_tokens"]:
            total += arithmetic.decode_step_time(config, gpu, max(1, int(s["mean_context"])),
                                              s["decode_tokens"]).time_s
    return total


def run_hf(hf, requests, batch: int) -> dict:  # noqa: ANN001
    start = time.perf_counter()
    first = []
    with torch.inference_mode():
        for i in range(0, len(requests), batch):
            chunk = requests[i: i + batch]
            width, longest = max(len(p) for p, _ in chunk), max(n for _, n in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long, device=hf.device)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(chunk):  # left padding
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                              min_new_tokens=longest, pad_token_id=0)
            if i == 0:
                first = [out[row, width: width + 8].tolist() for row in range(min(4, len(chunk)))]
    sync()
    seconds = time.perf_counter() - start
    n_out = sum(n for _, n in requests)
    return {"seconds": seconds, "output_tokens": n_out, "output_tokens_per_s": n_out / seconds, "first_tokens": first}


def warm_run_with_roofline(model, requests, max_num_seqs: int, budget: int) -> tuple[dict, str, float]:  # noqa: ANN001
    """`run_minillm` timed after a warm-up on the whole workload, and the step roofline's seconds for its steps:
    (the run, the GPU the roofline is for, roofline seconds). The warm-up is the whole workload because after one
    on 8 requests the first full run was about 25% slower than later ones (kernels compiled for shapes the small
    warm-up did not reach; results/engine_throughput_ab/cuda_async.json), and
    results/engine_throughput/archive/engine_throughput_cuda_h200.json was measured that way."""
    run_minillm(model, requests, max_num_seqs, budget)
    ours = run_minillm(model, requests, max_num_seqs, budget)
    gpu = roofline_gpu()
    return ours, gpu, roofline_seconds(model.config, ours["steps"], gpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument("--hf-batches", type=int, nargs="+", default=[64])
    parser.add_argument("--hf-single", type=int, default=4, help="requests timed at batch 1 (then extrapolated)")
    parser.add_argument("--name", default="cuda", help="the results file: results/engine_throughput/<name>.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/engine_throughput.py needs a CUDA GPU.")
    hf, model = random_llama_1b()
    requests = make_requests(args.num_requests, args.min_len, args.max_len, LLAMA_1B["vocab_size"])
    ours, gpu, roof = warm_run_with_roofline(model, requests, args.max_num_seqs, args.max_num_batched_tokens)
    print(f"minillm: {ours['output_tokens_per_s']:.0f} output tok/s ({ours['seconds']:.1f} s, {len(ours['steps'])} "
          f"steps); roofline {roof:.1f} s = {roof / ours['seconds']:.0%} of the measured time", flush=True)
    hf_rows = {}
    for b in args.hf_batches:
        hf_rows[f"batch_{b}"] = run_hf(hf, requests, b)
        print(f"transformers batch {b}: {hf_rows[f'batch_{b}']['output_tokens_per_s']:.0f} output tok/s "
              f"({hf_rows[f'batch_{b}']['seconds']:.1f} s)", flush=True)
    single = run_hf(hf, requests[: args.hf_single], 1)
    share = sum(n for _, n in requests[: args.hf_single]) / sum(n for _, n in requests)
    single["extrapolated_seconds_for_all"] = single["seconds"] / share
    single["output_tokens_per_s"] = single["output_tokens"] / single["seconds"]
    hf_rows["batch_1"] = single
    print(f"transformers batch 1: {single['output_tokens_per_s']:.0f} output tok/s (on {args.hf_single} requests)")
    ours["steps_summary"] = {"steps": len(ours["steps"]),
                             "mean_decode_batch": statistics.fmean(s["decode_tokens"] for s in ours["steps"])}
    steps = ours.pop("steps")
    path = write_results(f"engine_throughput/{args.name}", {
        "benchmark": "offline throughput: minillm LLM.generate (continuous batching, paged cache) vs transformers "
                     "generate (static batches, left-padded), Llama-3.2-1B shape, random bf16 weights",
        "settings": vars(args),
        "requests": {"count": len(requests), "prompt_tokens": sum(len(p) for p, _ in requests),
                     "output_tokens": sum(n for _, n in requests)},
        "minillm": ours,
        "roofline_gpu": gpu, "roofline_seconds": roof,
        "minillm_fraction_of_roofline": roof / ours["seconds"],
        "transformers": hf_rows,
        "speedup": {k: ours["output_tokens_per_s"] / v["output_tokens_per_s"] for k, v in hf_rows.items()},
        "step_trace_sample": steps[:: max(1, len(steps) // 200)],
    })
    print("\nmodel Llama-3.2-1B shape, bf16; output tokens/s and minillm's speed-up")
    print(f"  minillm (continuous batching)   {ours['output_tokens_per_s']:8.0f}")
    for k, v in hf_rows.items():
        speedup = ours["output_tokens_per_s"] / v["output_tokens_per_s"]
        print(f"  transformers {k:<18} {v['output_tokens_per_s']:8.0f}   minillm {speedup:.1f}x")
    print(f"  roofline share of minillm's time: {roof / ours['seconds']:.0%} (the {gpu} datasheet's roofline)")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
