"""Load generation and serving metrics (chapter 05): `minillm bench offline` and `minillm bench online`.

Two ways to measure a serving engine, as vLLM's own benchmarks do:

* offline: every request is given at once to `LLM.generate`; the result is throughput, tokens per
  second of the whole batch (what a batch job sees);
* online: requests arrive one by one at random times (a Poisson process of `request_rate` per second,
  the usual model of independent users) at any OpenAI-compatible server, this one or another, and
  stream their answers back. Per request we record

      TTFT  time to first token: from sending the request to its first streamed token
      TPOT  time per output token after the first: (end - first token) / (tokens - 1)
      ITL   inter-token latencies: the gaps between consecutive streamed tokens

  and report their p50/p90/p99, the throughput, and the *goodput*: requests per second that met the
  service-level objectives (TTFT <= slo_ttft and TPOT <= slo_tpot). Raising the rate raises the
  throughput until the server saturates; past that "knee", queues grow and latency explodes.

Prompts are made of the shipped model's training text, cut to the requested number of tokens with its
tokenizer; `ignore_eos` makes each request generate exactly its max_tokens (vLLM's extension of the API,
which most OpenAI-compatible servers accept). Every run is bounded in requests and in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SHAKESPEARE = ("FIRST CITIZEN. Before we proceed any further, hear me speak. ALL. Speak, speak. FIRST CITIZEN. You "
               "are all resolved rather to die than to famish? ALL. Resolved, resolved. FIRST CITIZEN. First, you know "
               "Caius Marcius is chief enemy to the people. ALL. We know't, we know't. FIRST CITIZEN. Let us kill him, "
               "and we'll have corn at our own price. Is't a verdict? ALL. No more talking on't; let it be done. Away, "
               "away! SECOND CITIZEN. One word, good citizens. ")


def make_requests(num: int, input_range: tuple[int, int], output_range: tuple[int, int], tokenizer: Any,
                  seed: int = 0) -> list[tuple[list[int], int]]:
    """`num` (prompt token ids, max_tokens) pairs, lengths uniform in the ranges (inclusive), reproducible."""
    rng = random.Random(seed)
    text_ids = tokenizer.encode(SHAKESPEARE * 40)
    requests = []
    for _ in range(num):
        n_in, n_out = rng.randint(*input_range), rng.randint(*output_range)
        start = rng.randrange(0, len(text_ids) - n_in)
        requests.append((text_ids[start: start + n_in], n_out))
    return requests


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and the mean of `values` (nan when empty)."""
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def p(q: float) -> float:  # nearest rank
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"mean": statistics.fmean(values), "p50": p(0.50), "p90": p(0.90), "p99": p(0.99)}


# ---------------------------------------------------------------------- offline
def offline(llm: Any, requests: list[tuple[list[int], int]], use_tqdm: bool = True) -> dict[str, Any]:
    """Throughput of `llm.generate` on all requests at once (greedy, exact lengths)."""
    from minillm.sampler.sampling import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=use_tqdm)
    seconds = time.perf_counter() - start
    n_in, n_out = sum(len(p) for p, _ in requests), sum(len(o.token_ids) for o in outs)
    return {"requests": len(requests), "seconds": seconds, "prompt_tokens": n_in, "output_tokens": n_out,
            "requests_per_s": len(requests) / seconds, "output_tokens_per_s": n_out / seconds,
            "total_tokens_per_s": (n_in + n_out) / seconds}


# ---------------------------------------------------------------------- online
@dataclass
class RequestResult:
    prompt_tokens: int
    max_tokens: int
    sent: float  # seconds since the run began
    token_times: list[float] = field(default_factory=list)  # when each streamed chunk with text arrived
    output_tokens: int = 0  # chunks received (one per token for minillm and vLLM)
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent if self.token_times else math.nan

    @property
    def tpot(self) -> float:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else math.nan

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


async def _one(client: Any, url: str, model: str, prompt: list[int] | str, max_tokens: int, start: float,
               result: RequestResult) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    result.sent = time.perf_counter() - start
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    result.token_times.append(time.perf_counter() - start)
                    result.output_tokens += 1
    except Exception as exc:  # noqa: BLE001 - a failed request is recorded, not fatal to the run
        result.error = f"{type(exc).__name__}: {exc}"


async def _online(url: str, model: str, requests: list[tuple[list[int], int]], rate: float, max_seconds: float,
                  seed: int, use_tqdm: bool, api_key: str | None = None) -> tuple[list[RequestResult], float]:
    import httpx
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    results = [RequestResult(len(p), n, math.nan) for p, n in requests]
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=len(requests) + 1)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(max_seconds), limits=limits, headers=headers) as client:
        tasks: dict[asyncio.Task, RequestResult] = {}
        arrival = 0.0
        bar = tqdm(total=len(requests), desc=f"requests at {rate:g}/s", disable=not use_tqdm)
        for (prompt, n), result in zip(requests, results):
            if math.isfinite(rate):
                arrival += rng.expovariate(rate)  # Poisson arrivals: exponential gaps of mean 1 / rate
                delay = arrival - (time.perf_counter() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
            if time.perf_counter() - start > max_seconds:
                result.error = "not sent: the run's time limit was reached"
                continue
            task = asyncio.create_task(_one(client, url, model, prompt, n, start, result))
            task.add_done_callback(lambda _: bar.update(1))
            tasks[task] = result
        left = max_seconds - (time.perf_counter() - start)
        _, pending = await asyncio.wait(tasks, timeout=max(left, 0.0)) if tasks else (set(), set())
        for task in pending:  # still streaming at the time limit: stop, and say so
            task.cancel()
            tasks[task].error = "unfinished at the run's time limit"
        await asyncio.gather(*pending, return_exceptions=True)
        bar.close()
    return results, time.perf_counter() - start


def meets_slo(result: RequestResult, slo_ttft: float, slo_tpot: float) -> bool:
    """Whether one request met both SLOs: it completed (no error, at least one token), TTFT <= slo_ttft, and
    TPOT <= slo_tpot. A one-token answer has no TPOT (no gap after its first token): only its TTFT counts."""
    if result.error is not None or not result.token_times:
        return False
    return result.ttft <= slo_ttft and (result.output_tokens < 2 or result.tpot <= slo_tpot)


def goodput(results: list[RequestResult], seconds: float, slo_ttft: float, slo_tpot: float) -> float:
    """Requests per second that met both SLOs (`meets_slo`) over a run of `seconds`: the rate a user would
    call served well, where throughput counts every request however late (chapter 05)."""
    return sum(meets_slo(r, slo_ttft, slo_tpot) for r in results) / seconds


def online(url: str, model: str, requests: list[tuple[list[int], int]], rate: float, max_seconds: float = 600,
           slo_ttft: float = 1.0, slo_tpot: float = 0.1, seed: int = 0, use_tqdm: bool = True,
           api_key: str | None = None) -> dict[str, Any]:
    """Send `requests` to an OpenAI-compatible server at Poisson rate `rate` (inf: all at once); the metrics.
    api_key: sent as 'Authorization: Bearer KEY', for a server started with one."""
    run = _online(url.rstrip("/"), model, requests, rate, max_seconds, seed, use_tqdm, api_key)
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no event loop here: the usual case
        results, seconds = asyncio.run(run)
    else:  # called from a running loop (a Jupyter cell): run ours in a thread of its own
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            results, seconds = pool.submit(asyncio.run, run).result()
    ok = [r for r in results if r.error is None and r.token_times]
    return {
        "url": url, "model": model, "request_rate": rate, "requests": len(requests), "completed": len(ok),
        "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:5],
        "seconds": seconds, "output_tokens": sum(r.output_tokens for r in ok),
        "requests_per_s": len(ok) / seconds, "output_tokens_per_s": sum(r.output_tokens for r in ok) / seconds,
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "goodput_requests_per_s": goodput(results, seconds, slo_ttft, slo_tpot),
        "ttft_s": percentiles([r.ttft for r in ok]), "tpot_s": percentiles([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_s": percentiles([x for r in ok for x in r.itls]),
        "per_request": [asdict(r) | {"ttft": r.ttft, "tpot": r.tpot} for r in results],
    }


# ---------------------------------------------------------------------- the command
def add_bench_command(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure throughput (offline) or latency under load (online)",
                           description=__doc__.splitlines()[0])
    modes = bench.add_subparsers(dest="bench_mode", metavar="MODE")
    modes.required = True
    for mode in ("offline", "online"):
        p = modes.add_parser(mode, help="LLM.generate on every request at once" if mode == "offline"
                             else "Poisson arrivals against an OpenAI-compatible URL")
        p.add_argument("--model", default=None, help="offline: the model to load; online: the served model's name "
                                                     "(default: the shipped default)")
        p.add_argument("--tokenizer", default=None, help="the shipped model whose tokenizer sizes the prompts")
        p.add_argument("--num-requests", type=int, default=64)
        p.add_argument("--input-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
        p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--output", type=Path, default=None, help="write the JSON result here")
        if mode == "online":
            p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
            p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: all "
                                                                                     "at once)")
            p.add_argument("--max-seconds", type=float, default=600, help="stop the run after this long")
            p.add_argument("--slo-ttft", type=float, default=1.0, help="goodput: the most TTFT, seconds")
            p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput: the most TPOT, seconds")
            p.add_argument("--api-key", default=None, help="the server's API key (default: $MINILLM_API_KEY)")
        else:
            p.add_argument("--device", default="cpu")
            p.add_argument("--max-num-seqs", type=int, default=64)
            p.add_argument("--max-num-batched-tokens", type=int, default=512)
        p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from minillm import DEFAULT_MODEL, load
    from minillm.decoding.llm import LLM

    model_name = args.model or DEFAULT_MODEL
    _, tokenizer = load(args.tokenizer or (model_name if args.bench_mode == "offline" else DEFAULT_MODEL))
    requests = make_requests(args.num_requests, tuple(args.input_len), tuple(args.output_len), tokenizer, args.seed)
    if args.bench_mode == "offline":
        model, tokenizer = load(model_name, device=args.device)
        llm = LLM(model, tokenizer, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
        result = offline(llm, requests)
        print(f"{result['requests']} requests in {result['seconds']:.1f} s: {result['output_tokens_per_s']:.0f} "
              f"output tokens/s, {result['total_tokens_per_s']:.0f} tokens/s in all")
    else:
        import os

        api_key = args.api_key if args.api_key is not None else os.environ.get("MINILLM_API_KEY")
        result = online(args.url, model_name, requests, args.request_rate, args.max_seconds, args.slo_ttft,
                        args.slo_tpot, args.seed, api_key=api_key)
        print(f"{result['completed']}/{result['requests']} completed in {result['seconds']:.1f} s at "
              f"{args.request_rate:g} req/s: TTFT p50 {result['ttft_s']['p50'] * 1e3:.0f} ms p99 "
              f"{result['ttft_s']['p99'] * 1e3:.0f} ms, TPOT p50 {result['tpot_s']['p50'] * 1e3:.1f} ms, "
              f"{result['output_tokens_per_s']:.0f} tokens/s, goodput {result['goodput_requests_per_s']:.2f} req/s")
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        print(f"written to {args.output}")
    return 0
