"""Prefill/decode interference, and what disaggregation does about it (chapter 08; DistServe, Splitwise).

A Poisson stream of two kinds of requests, as DistServe and Splitwise study: long prompts with short answers
(summaries, RAG) and short chats with longer answers. Four ways to serve it, each measured on the same stream:

    colocated           one LLMEngine, no chunked prefill: a whole long prompt runs in one step, and every
                        running chat waits for it (its inter-token latency spikes)
    colocated_chunked   one LLMEngine, chunked prefill: prompts cut into chunks of the step's token budget
    two_replicas        two LLMEngines (two processes) behind a router sending each request to the one with
                        fewer unfinished requests
    disaggregated       `minillm.parallel.disagg.DisaggregatedEngine`: a prefill worker and a decode worker, the KV sent

Per configuration: TTFT and ITL (inter-token latency) p50 / p99, and goodput: requests per second that met
both SLOs, TTFT <= `ttft_slo` and TPOT (mean time per output token after the first) <= `tpot_slo`; per device
(a CPU core or a GPU) because the replicas and the split use two and the colocated engine one. The SLOs are
set from this machine's own speed (a multiple of an idle long prefill and of an idle decode step), so the
numbers mean the same on any machine; they are in the results file.

Then the KV transfer alone: one request per prompt length through the disaggregated pair, the bytes sent
(= chapter 02's KV size), the seconds from "ready" until the decode worker took the KV (`seconds`, with its share
of that request's TTFT) and until the transfer itself completed (`landed_s`), and the GB/s of each;
against the link's peak measured with one large `send` between two processes.

    python benchmarks/disagg_interference.py       # CPU: shipped model, one core per process
                                                   # 2 GPUs: Llama-3.2-1B shape, random bf16 weights, NCCL
"""

from __future__ import annotations

import argparse
import statistics
import time
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import write_results

import minillm
from minillm.checkpoints import materialize
from minillm.engine.llm_engine import LLMEngine, RequestOutput
from minillm.parallel.disagg import DisaggregatedEngine
from minillm.parallel.workers import free_port
from minillm.sampler.sampling import SamplingParams


# ---------------------------------------------------------------------------- the workload
def make_workload(n: int, rate: float, long_frac: float, long_len: int, long_out: int, chat_len: int,
                  chat_out: int, vocab: int, seed: int = 0) -> list[dict]:
    """n requests with Poisson arrivals at `rate` per second: a `long_frac` share of long prompts (long_len
    tokens in, long_out out), the rest chats (chat_len in, chat_out out); random token ids, seeded."""
    g = torch.Generator().manual_seed(seed)
    gaps = torch.empty(n).exponential_(rate, generator=g).tolist()
    kinds = (torch.rand(n, generator=g) < long_frac).tolist()
    requests, t = [], 0.0
    for i in range(n):
        t += gaps[i]
        length, out = (long_len, long_out) if kinds[i] else (chat_len, chat_out)
        requests.append({"id": f"r{i}", "arrival": t, "kind": "long" if kinds[i] else "chat", "max_tokens": out,
                         "prompt": torch.randint(2, vocab, (length,), generator=g).tolist()})
    return requests


def run_stream(engine: Any, requests: list[dict], step_kwargs: dict) -> dict[str, RequestOutput]:
    """Submit each request at its arrival time and step the engine until all are done; the final outputs."""
    start, pending, done = time.perf_counter(), list(requests), {}
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0]["arrival"] <= now:
            r = pending.pop(0)
            engine.add_request(r["id"], r["prompt"], SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                                     ignore_eos=True), start + r["arrival"])
        if engine.has_unfinished_requests():
            for out in engine.step(**step_kwargs):
                if out.finished:
                    done[out.request_id] = out
        elif pending:
            time.sleep(max(0.0, min(0.005, pending[0]["arrival"] - now)))
    return done


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarise(done: dict[str, RequestOutput], requests: list[dict], ttft_slo: float, tpot_slo: float,
              devices: int) -> dict:
    """TTFT and ITL percentiles (overall and by kind), goodput under the SLOs, per device."""
    ttft, itl, met, span = [], [], 0, 0.0
    by_kind: dict[str, dict[str, list[float]]] = {"long": {"ttft": [], "itl": []}, "chat": {"ttft": [], "itl": []}}
    for r in requests:
        out = done[r["id"]]
        if out.finish_reason == "error":
            continue
        times = out.token_times_s
        gaps = [b - a for a, b in zip(times, times[1:])]
        ttft.append(times[0])
        itl += gaps
        by_kind[r["kind"]]["ttft"].append(times[0])
        by_kind[r["kind"]]["itl"] += gaps
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        met += times[0] <= ttft_slo and tpot <= tpot_slo
        span = max(span, r["arrival"] + times[-1])
    return {"ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99),
            "chat_itl_p99_s": percentile(by_kind["chat"]["itl"], 0.99),
            "long_ttft_p50_s": percentile(by_kind["long"]["ttft"], 0.5),
            "chat_ttft_p50_s": percentile(by_kind["chat"]["ttft"], 0.5),
            "slo_met": met, "requests": len(requests), "duration_s": span, "goodput_req_s": met / span,
            "devices": devices, "goodput_per_device": met / span / devices}


# ---------------------------------------------------------------------------- two replicas behind a router
def _replica(model_state: tuple, device: str, engine_kwargs: dict, inbox: Any, results: Any) -> None:
    """One replica: an LLMEngine stepping whatever the router sends it."""
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # Triton launches on the current device
    config, state, dtype = model_state
    with torch.device("meta"):
        model = minillm.Transformer(config)
    engine = LLMEngine(materialize(model, state, device, dtype), None, **engine_kwargs)
    results.put(("ready", None))
    while True:
        for _ in wait([inbox], timeout=0 if engine.has_unfinished_requests() else 0.01):
            message = inbox.recv()
            if message[0] == "stop":
                return
            engine.add_request(*message[1:])
        if engine.has_unfinished_requests():
            for out in engine.step():
                results.put(("output", out))


class Replicas:
    """`n` LLMEngine replicas in their own processes; each request goes to the one with the fewest unfinished."""

    def __init__(self, model: minillm.Transformer, n: int, devices: list[str], engine_kwargs: dict) -> None:
        context = mp.get_context("spawn")
        self.results = context.Queue()
        state = (model.config, {k: v.cpu() for k, v in model.state_dict().items()}, model.dtype)
        self.inboxes, self.processes, self.load, self.where = [], [], [0] * n, {}
        for i in range(n):
            mine, theirs = context.Pipe()
            p = context.Process(target=_replica, args=(state, devices[i], engine_kwargs, theirs, self.results),
                                daemon=True)
            p.start()
            self.inboxes.append(mine)
            self.processes.append(p)
        for _ in range(n):
            self.results.get(timeout=600)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, arrival: float) -> None:
        i = self.load.index(min(self.load))
        self.load[i] += 1
        self.where[request_id] = i
        self.inboxes[i].send(("request", request_id, prompt, params, arrival))

    def has_unfinished_requests(self) -> bool:
        return bool(self.where)

    def step(self, timeout: float = 0.005) -> list[RequestOutput]:
        outputs = []
        try:
            outputs.append(self.results.get(timeout=timeout)[1])
            while True:
                outputs.append(self.results.get_nowait()[1])
        except Exception:  # noqa: BLE001 - queue.Empty
            pass
        for out in outputs:
            if out.finished:
                self.load[self.where.pop(out.request_id)] -= 1
        return outputs

    def shutdown(self) -> None:
        for inbox in self.inboxes:
            inbox.send(("stop",))
        for p in self.processes:
            p.join(timeout=10)


# ---------------------------------------------------------------------------- the link
def _p2p_rank(rank: int, port: int, nbytes: int, cuda: bool, queue: Any) -> None:
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    times = []
    for i in range(6):
        dist.barrier()
        start = time.perf_counter()
        dist.send(x, dst=1) if rank == 0 else dist.recv(x, src=0)
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    if rank == 1:
        queue.put(statistics.median(times))
    dist.destroy_process_group()


def link_gb_s(nbytes: int, cuda: bool) -> float:
    """GB/s of one `send` of nbytes between two fresh processes (gloo on the CPU, NCCL between two GPUs)."""
    context = mp.get_context("spawn")
    queue, port = context.Queue(), free_port()
    procs = [context.Process(target=_p2p_rank, args=(r, port, nbytes, cuda, queue)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = queue.get(timeout=300)
    for p in procs:
        p.join()
    return nbytes / seconds / 1e9


# ---------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second (default: from calibration)")
    parser.add_argument("--long-frac", type=float, default=0.25)
    parser.add_argument("--budget", type=int, default=None,
                        help="chunked prefill's token budget per step (default 64 on the CPU, 512 on GPUs)")
    parser.add_argument("--configs", nargs="+", default=["colocated", "colocated_chunked", "two_replicas",
                                                          "disaggregated"], help="which configurations to run")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.device_count() >= 2
    torch.set_num_threads(1)
    if cuda:
        from roofline import SHAPES

        from minillm.config import ModelConfig
        config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192,
                                      "rms_norm_eps": 1e-5, **SHAPES["llama-1B"]})
        torch.manual_seed(0)
        with torch.device("cuda:0"):
            model = minillm.Transformer(config).to(torch.bfloat16).eval()
        shape = dict(long_len=4096, long_out=16, chat_len=128, chat_out=128)
        devices = ["cuda:0", "cuda:1"]
    else:
        model, _ = minillm.load(minillm.DEFAULT_MODEL)
        shape = dict(long_len=512, long_out=16, chat_len=16, chat_out=64)
        devices = ["cpu", "cpu"]
    args.budget = args.budget or (512 if cuda else 64)
    vocab, max_len = model.config.vocab_size, shape["long_len"] + shape["long_out"]
    blocks = 64 * (max_len // 16 + 2)
    base = dict(num_blocks=blocks, max_num_seqs=64, enable_prefix_caching=False)
    budget_all = shape["long_len"] + 64  # without chunking, the budget must hold a whole prompt

    # calibration, one engine idle: a long prompt's prefill and a decode step
    engine = LLMEngine(model, None, **base, max_num_batched_tokens=budget_all, enable_chunked_prefill=False)
    long_req = make_workload(1, 1.0, 1.0, **shape, vocab=vocab, seed=99)[0]
    run_stream(engine, [dict(long_req, id="warm-up", arrival=0.0, max_tokens=4)], {})  # compiles kernels, graphs
    out = run_stream(engine, [dict(long_req, arrival=0.0, max_tokens=32)], {})[long_req["id"]]
    prefill_s = out.token_times_s[0]
    decode_s = statistics.median(b - a for a, b in zip(out.token_times_s, out.token_times_s[1:]))
    ttft_slo, tpot_slo = 4 * prefill_s, 3 * decode_s
    # a rate that keeps one engine busy about 60% of the time
    mean_work = args.long_frac * (prefill_s + shape["long_out"] * decode_s) + (1 - args.long_frac) * (
        shape["chat_out"] * decode_s / 4)  # chats decode in batches: ~4 at a time share a step
    rate = args.rate or round(0.6 / mean_work, 2)
    requests = make_workload(args.requests, rate, args.long_frac, **shape, vocab=vocab)
    print(f"idle prefill of {shape['long_len']} tokens {prefill_s * 1e3:.1f} ms, decode step {decode_s * 1e3:.2f} ms; "
          f"SLOs: TTFT {ttft_slo * 1e3:.0f} ms, TPOT {tpot_slo * 1e3:.1f} ms; rate {rate}/s", flush=True)

    configs = {}
    warm_up = make_workload(4, 1.0, 0.5, **shape, vocab=vocab, seed=98)  # two of each kind, usually
    for name in args.configs:
        if name == "colocated":
            eng, kw, n = LLMEngine(model, None, **base, max_num_batched_tokens=budget_all,
                                   enable_chunked_prefill=False), {}, 1
        elif name == "colocated_chunked":
            eng, kw, n = LLMEngine(model, None, **base, max_num_batched_tokens=args.budget), {}, 1
        elif name == "two_replicas":
            eng, kw, n = Replicas(model, 2, devices, dict(base, max_num_batched_tokens=args.budget)), {}, 2
        else:
            eng = DisaggregatedEngine(model, None, prefill=dict(base, max_num_batched_tokens=budget_all,
                                                                enable_chunked_prefill=False),
                                      decode=dict(base, max_num_batched_tokens=args.budget), devices=devices)
            kw, n = {"timeout": 0.005}, 2
        # warm-up, unmeasured: a fresh engine or process compiles its kernels at its first prompts and mixed steps
        run_stream(eng, [dict(r, id=f"warm-{r['id']}", arrival=0.0, max_tokens=4) for r in warm_up], kw)
        done = run_stream(eng, requests, kw)
        configs[name] = summarise(done, requests, ttft_slo, tpot_slo, n)
        if hasattr(eng, "shutdown"):
            eng.shutdown()
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in configs[name].items()}, flush=True)

    # the KV transfer alone, by prompt length
    transfers = []
    eng = DisaggregatedEngine(model, None, prefill=dict(base, max_num_batched_tokens=budget_all,
                                                        enable_chunked_prefill=False),
                              decode=dict(base, max_num_batched_tokens=args.budget), devices=devices)
    g = torch.Generator().manual_seed(5)
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    lengths = [n for n in (16, 64, 256, 512, 1024, 2048, 4096) if n <= shape["long_len"]]
    for length in lengths:  # warm-up: the first prompt of each length in a fresh pair compiles kernels
        eng.generate([torch.randint(2, vocab, (length,), generator=g).tolist()], two)
    for length in lengths:
        prompt = torch.randint(2, vocab, (length,), generator=g).tolist()
        submitted, received, out = time.perf_counter(), None, None
        request_id = eng.add_request(None, prompt, two, submitted)
        while out is None or not out.finished:
            for out in eng.step():  # noqa: B007 - the last output tells when the request is finished
                received = received or time.perf_counter()  # the first output's arrival at the router
        t = eng.transfers[request_id]
        transfers.append({"prompt_tokens": length, "bytes": t.nbytes, "seconds": t.seconds,
                          "gb_s": t.nbytes / t.seconds / 1e9, "ttft_s": out.token_times_s[0],
                          "share_of_ttft": t.seconds / out.token_times_s[0], "landed_s": t.landed_s,
                          "landed_gb_s": t.nbytes / t.landed_s / 1e9,
                          # where the TTFT went (one clock for all processes): P's queue and prefill, the offer's
                          # trip and D's reaction, the transfer and write, the first output's trip to the router
                          "ttft_parts_s": {"prefill_on_p": t.prefilled_at - submitted,
                                           "offer_to_ready": t.ready_at - t.prefilled_at,
                                           "transfer_and_write": t.taken_at - t.ready_at,
                                           "back_to_router": received - t.taken_at}})
        print(transfers[-1], flush=True)
    eng.shutdown()
    peak = link_gb_s(64 * 2**20, cuda)

    name = f"disagg_interference/{'cuda' if cuda else 'cpu'}" + (f"_{args.name}" if args.name else "")
    path = write_results(name, {
        "benchmark": "prefill/decode interference: colocated, chunked, two replicas, disaggregated",
        "settings": {"model": "llama-1B shape, random bf16" if cuda else minillm.DEFAULT_MODEL, **shape,
                     "requests": args.requests, "rate_per_s": rate, "long_frac": args.long_frac,
                     "chunk_budget": args.budget, "devices": devices,
                     "gpu": torch.cuda.get_device_name(0) if cuda else None},
        "calibration": {"idle_long_prefill_s": prefill_s, "idle_decode_step_s": decode_s,
                        "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo},
        "configs": configs, "kv_transfer": transfers, "link_peak_gb_s": peak})
    print(f"\nwrote {path}\n\n{'config':<18} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'goodput/dev':>11}")
    for name, c in configs.items():
        print(f"{name:<18} {c['ttft_p50_s'] * 1e3:8.0f}m {c['ttft_p99_s'] * 1e3:8.0f}m {c['itl_p50_s'] * 1e3:7.1f}m "
              f"{c['itl_p99_s'] * 1e3:7.1f}m {c['goodput_per_device']:11.2f}")
    print(f"link peak {peak:.2f} GB/s")


if __name__ == "__main__":
    main()
