"""Prefill/decode disaggregation: prompts on one engine, decoding on another, the KV cache sent between them
over `torch.distributed` (chapter 08).

A prefill is compute-bound: one long forward over the prompt. Decoding is bandwidth-bound: many short steps,
each reading every weight for a few tokens. On one engine they share every step, and interfere: a long prompt
chunk in a step makes every running decode wait for it (inter-token latency spikes), and the decodes take from
each step's token budget (prompts wait longer). DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al.,
ISCA 2024) run the two phases on different GPUs and send each request's KV cache from one to the other.

minillm's version is three processes:

    router (this process) ──request──► prefill worker P: an LLMEngine; prefills, samples the first token
       ▲                                   │ the prompt's KV, [2, n_layers, L, n_kv_heads, head_dim]
       │                                   ▼ torch.distributed isend / irecv (gloo on CPUs, NCCL between GPUs)
       └──────── outputs ──────────── decode worker D: an LLMEngine; takes the request with that KV, decodes

One request's hand-off; the decode worker decides when it can take it, which is the back-pressure:
  1. P's engine finishes the prompt and samples the first token with the request's own params. Before the
     prompt's blocks are freed, P copies its keys and values out of the paged pools into one tensor on its
     device (`read_kv`) and offers the request to D: its tokens, the first token, the seeded generator's state.
  2. When D has the blocks (`LLMEngine.reserve_prefilled`; until then the offer waits while D decodes and
     frees blocks), it posts an `irecv` into a buffer and answers "ready"; P `isend`s the tensor. Neither side
     waits for the transfer: D keeps decoding, P keeps prefilling.
  3. When the transfer completes, D writes the rows into its reserved slots (`write_kv`) and continues the
     request (`LLMEngine.add_prefilled`): its next decode step computes the request's second token.

Only the KV goes over torch.distributed: requests, offers, "ready", aborts and outputs are small Python objects
on multiprocessing pipes and a queue. The bytes sent for a prompt of L tokens are chapter 02's KV size,
2 x n_layers x L x n_kv_heads x head_dim x bytes per value (`minillm.arithmetic.kv_cache_bytes`): the rows of
the prompt's tokens, gathered on the device, not whole blocks.

What a deployment meets, and what happens here: the decode pool full (offers wait, then P's memory holds the
staged KV: back-pressure, no crash); a client that disconnects (`abort_request` goes to P, which aborts the
prompt if it is still there, else passes the abort to D on the pipe its offer took, so D always sees the offer
first: D drops the offer, frees the reservation when the transfer lands, or aborts the running sequence);
a worker that dies (its requests fail with an error naming it, the router stays up and says so to new
requests); a request whose logits come out NaN (it fails alone, with the worker's reason). Not here: several P
or D workers (a router choosing among them), KV sent layer by layer while the prefill runs, quantised KV caches,
n > 1 and constrained decoding across the split.

    engine = DisaggregatedEngine(model, tokenizer)
    outputs = engine.generate(["ROMEO.\\n", "JULIET.\\n"], SamplingParams(max_tokens=32))
    engine.shutdown()

`minillm serve --disaggregate` serves it over the OpenAI API (`minillm.entrypoints.server`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator, Sequence
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minillm.checkpoints import materialize
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.llm_engine import LLMEngine, RequestOutput
from minillm.engine.sequence import Sequence as Seq
from minillm.engine.sequence import prepare_prompt
from minillm.model import Transformer
from minillm.parallel.workers import free_port, stop_workers
from minillm.sampler.sampling import SamplingParams
from minillm.tokenizer import Tokenizer

PREFILL, DECODE = 0, 1  # the two ranks of the KV group
NAN_LOGITS = "got NaN or infinite logits for it, so no token could be sampled (a broken model?)"  # a finish "error"


# ---------------------------------------------------------------------------- the KV hand-off
def read_kv(cache: PagedKVCache, seq_id: str, num_tokens: int) -> torch.Tensor:
    """The keys and values of seq_id's first num_tokens positions, gathered from the paged pools through its
    block table: [2 (k, v), n_layers, num_tokens, n_kv_heads, head_dim], on the cache's device."""
    table = cache.block_tables[seq_id]
    slots = torch.tensor([table.slot(p) for p in range(num_tokens)], device=cache.device)
    return torch.stack([torch.stack([pool.view(-1, *pool.shape[2:]).index_select(0, slots) for pool in pools])
                        for pools in (cache.k, cache.v)])


def write_kv(cache: PagedKVCache, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Write `kv` [2, n_layers, len(slots), n_kv_heads, head_dim] (from `read_kv`) to `slots` of every layer."""
    for pools, rows in zip((cache.k, cache.v), kv):
        for pool, layer_rows in zip(pools, rows):
            pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, layer_rows)


@dataclasses.dataclass
class Offer:
    """P to D: a prefilled request, and the shape of the KV tensor that will follow once D says "ready"."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token: int
    first_logprob: float
    first_top: dict[int, float]
    generator_state: torch.Tensor | None  # the seeded generator after the first token (None without a seed)
    arrival_time: float
    shape: tuple[int, ...]
    dtype: torch.dtype
    prefilled_at: float  # perf_counter when P finished the prompt


@dataclasses.dataclass
class Transfer:
    """What one request's KV hand-off cost, as D measured it, from the moment it said "ready": `landed_s` until the
    transfer completed (the link and the two sides' transport), `seconds` until D's loop took it, which adds the
    wait for D's step in progress (what the request's TTFT pays).

    The hand-off's moments, as `time.perf_counter()` values (one clock for all processes of a Linux machine, so
    they compare with the router's): P finished the prompt (`prefilled_at`), D said "ready" (`ready_at`), D had
    written the KV into its pool (`taken_at`). A request's TTFT is then: arrival to `prefilled_at` (queue and
    prefill on P), to `ready_at` (the offer's trip and D's wait for blocks or its step), `seconds` (transfer and
    write), and from `taken_at` to the router (the first output's trip back)."""

    nbytes: int
    seconds: float
    prompt_tokens: int
    landed_s: float
    prefilled_at: float = 0.0
    ready_at: float = 0.0
    taken_at: float = 0.0


class Landed:
    """Whether a torch.distributed `isend`/`irecv` has completed (`is_set()`), and when (`at`, perf_counter).

    A thread watches it, so that neither worker's loop waits: gloo's `Work.is_completed()` turns true only after
    `wait()`, so the thread waits; NCCL's `wait()` only orders the current CUDA stream after the transfer, so the
    thread polls `is_completed()` instead. The bytes move in gloo's or NCCL's own threads either way."""

    def __init__(self, work: Any) -> None:
        self.at: float | None = None
        self._done = threading.Event()
        threading.Thread(target=self._watch, args=(work,), daemon=True).start()

    def _watch(self, work: Any) -> None:
        if dist.get_backend() == "nccl":
            while not work.is_completed():
                time.sleep(20e-6)
        else:
            work.wait()
        self.at = time.perf_counter()
        self._done.set()

    def is_set(self) -> bool:
        return self._done.is_set()


# ---------------------------------------------------------------------------- the workers
def _start_worker(rank: int, init_method: str, device: str, config: Any, state: dict[str, torch.Tensor],
                  dtype: torch.dtype, tokenizer: Tokenizer | None, engine_kwargs: dict) -> LLMEngine:
    """Join the KV group and build this worker's engine."""
    # Ctrl-C in a terminal reaches the whole process group; a worker stops when its router says so (`shutdown`),
    # so that a server drains its open requests first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=init_method, rank=rank,
                            world_size=2, timeout=timedelta(minutes=10))
    # NCCL creates the pair's communicator at its first send/recv, blocking until both ranks are in it: do it now,
    # while both are starting, not at the first hand-off (where D would wait in irecv before saying "ready").
    probe = torch.zeros(1, device=device)
    dist.send(probe, dst=DECODE) if rank == PREFILL else dist.recv(probe, src=PREFILL)
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # the probe is done on the device before the engine captures its CUDA graphs
    with torch.device("meta"):
        model = Transformer(config)
    return LLMEngine(materialize(model, state, device, dtype), tokenizer, **engine_kwargs)


def _stats(engine: LLMEngine) -> dict[str, int]:
    """What a worker's engine holds now: its requests and its pool's used blocks."""
    allocator = engine.cache.allocator
    return {"unfinished": engine.num_unfinished_requests, "reserved": len(engine.reserved),
            "used_blocks": allocator.num_used_blocks, "num_blocks": allocator.num_blocks}


def _messages(conns: list[Any], busy: bool) -> Iterator[tuple]:
    """The messages waiting on a worker's pipes (the router's and the other worker's): at once when the worker has
    work of its own, else after waiting up to 10 ms for one."""
    for conn in wait(conns, timeout=0 if busy else 0.01):
        yield conn.recv()


def _die(results: Any, rank: int) -> None:
    """Tell the router why this worker fails (the traceback), make sure the message is out, and exit."""
    results.put(("died", rank, traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(1)


def _prefill_worker(init_method: str, device: str, config: Any, state: dict, dtype: torch.dtype,
                    tokenizer: Tokenizer | None, engine_kwargs: dict, inbox: Any, peer: Any, results: Any) -> None:
    """Rank 0: prefill each request, stage its KV, offer it to D, send it when D is ready."""
    try:
        engine = _start_worker(PREFILL, init_method, device, config, state, dtype, tokenizer, engine_kwargs)
        del state
        params_of: dict[str, SamplingParams] = {}  # each request's own params (its engine runs max_tokens=1)
        staged: dict[str, torch.Tensor] = {}  # offered, waiting for D's "ready" (or "drop")
        sending: list[tuple[Landed, torch.Tensor]] = []  # isends in flight, and the tensors they read

        def offer(seq: Seq) -> None:  # the engine calls it as the prompt finishes, before freeing its blocks
            kv = read_kv(engine.cache, seq.seq_id, len(seq.prompt_token_ids))
            staged[seq.request_id] = kv
            state = seq.generator.get_state() if seq.generator is not None else None
            peer.send(("offer", Offer(seq.request_id, seq.prompt_token_ids, params_of.pop(seq.request_id),
                                      seq.output_token_ids[0], seq.logprobs[0], seq.top_logprobs[0], state,
                                      seq.arrival_time, tuple(kv.shape), kv.dtype, time.perf_counter())))

        engine.on_finish = offer
        results.put(("ready", PREFILL))
        while True:
            busy = engine.has_unfinished_requests() or sending
            for message in _messages([inbox, peer], busy):
                kind = message[0]
                if kind == "stop":
                    return
                if kind == "request":
                    _, request_id, ids, params, arrival = message
                    try:  # P samples the first token only; D continues with the request's own params
                        engine.add_request(request_id, ids, dataclasses.replace(params, max_tokens=1),
                                           arrival_time=arrival)
                        params_of[request_id] = params
                    except ValueError as error:
                        results.put(("error", request_id, f"the prefill worker refused it: {error}"))
                elif kind == "abort":  # still ours: abort it here; else pass it on, after the offer on the same pipe
                    if params_of.pop(message[1], None) is not None:
                        engine.abort_request(message[1])
                    else:
                        peer.send(message)
                elif kind == "ready":
                    kv = staged.pop(message[1])
                    sending.append((Landed(dist.isend(kv, dst=DECODE)), kv))
                elif kind == "drop":
                    staged.pop(message[1], None)
                elif kind == "stats":
                    results.put(("stats", PREFILL, _stats(engine) | {"staged": len(staged)}))
            sending = [(done, kv) for done, kv in sending if not done.is_set()]
            if engine.has_unfinished_requests():
                for out in engine.step():  # the prompts that finished are offered (`offer`); a failed one is not
                    if out.finish_reason == "error":
                        params_of.pop(out.request_id, None)
                        results.put(("error", out.request_id, f"the prefill worker {NAN_LOGITS}"))
    except (EOFError, ConnectionError):  # the other worker (or the router) is gone: nothing left to do here
        return
    except Exception:  # noqa: BLE001 - reported to the router
        _die(results, PREFILL)


def _decode_worker(init_method: str, device: str, config: Any, state: dict, dtype: torch.dtype,
                   tokenizer: Tokenizer | None, engine_kwargs: dict, inbox: Any, peer: Any, results: Any) -> None:
    """Rank 1: take offered requests when there are blocks for them, receive their KV, decode them."""
    try:
        engine = _start_worker(DECODE, init_method, device, config, state, dtype, tokenizer, engine_kwargs)
        del state
        offers: deque[Offer] = deque()
        arriving: list[tuple[Offer, torch.Tensor, torch.Tensor, Landed, float]] = []  # ..., done, t0
        aborted: set[str] = set()
        held_back: set[str] = set()  # offers that had to wait for blocks or a free row
        results.put(("ready", DECODE))
        while True:
            busy = engine.has_unfinished_requests() or arriving
            for message in _messages([inbox, peer], busy):
                kind = message[0]
                if kind == "stop":
                    return
                if kind == "offer":
                    offers.append(message[1])
                elif kind == "abort":
                    request_id = message[1]
                    waiting = [o for o in offers if o.request_id == request_id]
                    if waiting:
                        offers.remove(waiting[0])
                        peer.send(("drop", request_id))
                    elif any(a[0].request_id == request_id for a in arriving):
                        aborted.add(request_id)  # its blocks are freed when the transfer lands
                    else:
                        engine.abort_request(request_id)
                elif kind == "stats":
                    results.put(("stats", DECODE, _stats(engine) | {"offers": len(offers), "arriving": len(arriving),
                                                             "held_back": len(held_back)}))
            while offers:  # in arrival order, while there are blocks (else they wait: back-pressure)
                o = offers[0]
                slots = engine.reserve_prefilled(o.request_id, o.shape[2])
                if slots is None:
                    held_back.add(o.request_id)
                    break
                offers.popleft()
                buffer = torch.empty(o.shape, dtype=o.dtype, device=engine.cache.device)
                start = time.perf_counter()  # before the irecv: the transfer may land before the next line runs
                done = Landed(dist.irecv(buffer, src=PREFILL))
                peer.send(("ready", o.request_id))
                arriving.append((o, slots, buffer, done, start))
            while arriving and arriving[0][3].is_set():  # transfers complete in the order they were posted
                o, slots, buffer, done, start = arriving.pop(0)
                if o.request_id in aborted:
                    aborted.discard(o.request_id)
                    engine.release_prefilled(o.request_id)
                    continue
                write_kv(engine.cache, slots, buffer)
                taken = time.perf_counter()
                results.put(("transfer", o.request_id, Transfer(
                    buffer.numel() * buffer.element_size(), taken - start, len(o.prompt_token_ids), done.at - start,
                    o.prefilled_at, start, taken)))
                results.put(("output", engine.add_prefilled(
                    o.request_id, o.prompt_token_ids, o.params, o.first_token, o.first_logprob, o.first_top,
                    o.generator_state, o.arrival_time)))
            if engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finish_reason == "error":  # `LLMEngine._failed_row`: the router fails it with the reason
                        results.put(("error", out.request_id, f"the decode worker {NAN_LOGITS}"))
                    else:
                        results.put(("output", out))
    except (EOFError, ConnectionError):  # the other worker (or the router) is gone: nothing left to do here
        return
    except Exception:  # noqa: BLE001 - reported to the router
        _die(results, DECODE)


# ---------------------------------------------------------------------------- the router
class DisaggregatedEngine:
    """A prefill worker and a decode worker behind one engine-like front: add_request / step / abort_request.

    Args:
        model: the model both workers run (each process builds its own copy from its weights).
        tokenizer: for text prompts and outputs (as `LLMEngine`).
        prefill, decode: keyword arguments of each worker's `LLMEngine` (num_blocks, max_num_seqs,
            max_num_batched_tokens, ...). The decode worker's pool is what back-pressure protects.
        devices: the workers' devices; default "cpu" and "cpu" for a CPU model, "cuda:0" and "cuda:1" for a CUDA
            one (NCCL wants a GPU each).
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, prefill: dict | None = None,
                 decode: dict | None = None, devices: Sequence[str] | None = None) -> None:
        for kwargs in (prefill or {}, decode or {}):
            bad = {"speculative", "tensor_parallel_size", "kv_cache_dtype", "compile_decode"} & set(kwargs)
            if bad:
                raise ValueError(f"disaggregated workers run plain engines: {sorted(bad)} are not supported here.")
        if devices is None:
            devices = ("cuda:0", "cuda:1") if model.device.type == "cuda" else ("cpu", "cpu")
        if any(d.startswith("cuda") for d in devices) and len(set(devices)) < 2:
            raise ValueError("NCCL needs the two workers on two different GPUs, e.g. devices=('cuda:0', 'cuda:1').")
        self.model, self.tokenizer = model, tokenizer
        self.requests: dict[str, str] = {}  # unfinished request id -> "prefill" or "decode"
        self.errors: dict[str, str] = {}  # request id -> why it failed
        self.transfers: dict[str, Transfer] = {}
        self.down: str | None = None  # why new requests are refused, once a worker died
        self.stats: dict[int, dict[str, int]] = {}  # the latest `worker_stats` of each rank
        self._held: list[RequestOutput] = []  # outputs read while waiting for something else, for the next step
        self._ids = 0
        context = mp.get_context("spawn")
        self.results = context.Queue()
        state = {k: v.cpu() for k, v in model.state_dict().items()}
        init_method = f"tcp://127.0.0.1:{free_port()}"
        p_side, d_side = context.Pipe()
        self.inboxes, self.processes = [], []
        for rank, (target, peer, kwargs) in enumerate(((_prefill_worker, p_side, prefill or {}),
                                                       (_decode_worker, d_side, decode or {}))):
            mine, theirs = context.Pipe()
            process = context.Process(target=target, name=("minillm-prefill", "minillm-decode")[rank], daemon=True,
                                      args=(init_method, devices[rank], model.config, state, model.dtype, tokenizer,
                                            kwargs, theirs, peer, self.results))
            process.start()
            self.inboxes.append(mine)
            self.processes.append(process)
        ready, deadline = set(), time.time() + 600
        while ready != {PREFILL, DECODE}:
            self._check_workers()
            if self.down or time.time() > deadline:
                self.shutdown()
                raise RuntimeError(f"the disaggregated workers did not start: {self.down or 'timed out'}. In a "
                                   "script, build the engine under `if __name__ == \"__main__\":` (the workers "
                                   "are spawned, and import the script's main module).")
            try:
                message = self.results.get(timeout=0.1)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            if message[0] == "ready":
                ready.add(message[1])
            elif message[0] == "died":
                self.down = f"the {('prefill', 'decode')[message[1]]} worker failed:\n{message[2]}"

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request at the prefill worker; returns its id. Checked here as `LLMEngine.add_request` checks."""
        if self.down:
            raise RuntimeError(f"this disaggregated engine cannot take requests: {self.down}")
        params = params or SamplingParams()
        if (params.best_of or params.n) > 1:
            raise ValueError("n > 1 is not supported across the prefill/decode split: send n requests.")
        ids = prepare_prompt(self.model, prompt, params, self.tokenizer)
        if request_id is None:
            request_id, self._ids = f"d{self._ids}", self._ids + 1
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"id {request_id!r} is already in use: give each request its own id.")
        self.requests[request_id] = "prefill"
        self.inboxes[PREFILL].send(("request", request_id, ids, params,
                                    time.perf_counter() if arrival_time is None else arrival_time))
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Stop these requests wherever they are, freeing their blocks on both workers."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.requests.pop(str(request_id), None) is not None:  # P aborts it or passes it on to D
                self.inboxes[PREFILL].send(("abort", str(request_id)))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self, timeout: float = 0.05) -> list[RequestOutput]:
        """The outputs the workers produced since the last call (waiting up to `timeout` s for the first one).

        A request that failed comes out finished, with finish_reason "error" and the reason in `errors`."""
        self._check_workers()
        outputs, block = self._held, self.has_unfinished_requests() and not self._held
        self._held = []
        while True:
            try:
                message = self.results.get(timeout=timeout) if block else self.results.get_nowait()
            except Exception:  # noqa: BLE001 - queue.Empty
                break
            block = False
            kind = message[0]
            if kind == "output":
                out = message[1]
                if out.request_id not in self.requests:
                    continue  # aborted meanwhile
                self.requests[out.request_id] = "decode"
                if out.finished:
                    del self.requests[out.request_id]
                outputs.append(out)
            elif kind == "transfer":
                self.transfers[message[1]] = message[2]
            elif kind == "stats":
                self.stats[message[1]] = message[2]
            elif kind == "error":
                outputs += self._fail([message[1]], message[2])
            elif kind == "died":
                self.down = f"the {('prefill', 'decode')[message[1]]} worker failed:\n{message[2]}"
        self._check_workers()
        if self.down:
            outputs += self._fail(list(self.requests), self.down)
        return outputs

    def ask_stats(self) -> None:
        """Ask both workers what they hold now, without waiting: `step` files their answers in `stats` as they come
        (a server's /metrics polls for them; `worker_stats` waits for them)."""
        self.stats = {}
        for inbox in self.inboxes:
            inbox.send(("stats",))

    def worker_stats(self, timeout: float = 10) -> dict[str, dict[str, int]]:
        """Ask both workers what they hold now: {"prefill": {...}, "decode": {...}} with each engine's unfinished
        requests, reserved requests and used blocks (and P's staged KV tensors, D's waiting and arriving offers)."""
        self.ask_stats()
        deadline = time.time() + timeout
        while len(self.stats) < 2 and not self.down and time.time() < deadline:
            self._held += self.step(timeout=0.05)
            time.sleep(0.005)
        if len(self.stats) < 2:
            raise RuntimeError(f"the workers did not report: {self.down or 'timed out'}")
        return {"prefill": self.stats[PREFILL], "decode": self.stats[DECODE]}

    def _check_workers(self) -> None:
        """Mark the engine down if a worker is gone, naming the one that failed (a worker whose peer died exits
        quietly, with code 0, after it)."""
        dead = [(name, p.exitcode) for name, p in zip(("prefill", "decode"), self.processes) if not p.is_alive()]
        if dead and self.down is None:
            name, code = next((d for d in dead if d[1] != 0), dead[0])
            self.down = f"the {name} worker died (exit code {code})"

    def _fail(self, request_ids: list[str], reason: str) -> list[RequestOutput]:
        failed = []
        for request_id in request_ids:
            if self.requests.pop(request_id, None) is None:
                continue
            self.errors[request_id] = reason
            failed.append(RequestOutput(request_id, [], [], None, [], "", True, "error"))
        return failed

    def generate(self, prompts: Sequence[str | list[int]], params: SamplingParams | None = None
                 ) -> list[RequestOutput]:
        """Every prompt to the end, outputs in the prompts' order (`LLM.generate`'s loop); raises if any failed."""
        ids = [self.add_request(None, p, params) for p in prompts]
        finished: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
        failed = {i: self.errors[i] for i in ids if i in self.errors}
        if failed:
            raise RuntimeError(f"{len(failed)} request(s) failed: {failed}")
        return [finished[i] for i in ids]

    def shutdown(self) -> None:
        """Stop both workers (idempotent)."""
        stop_workers(self.inboxes, self.processes)
        self.processes = [p for p in self.processes if p.is_alive()]
