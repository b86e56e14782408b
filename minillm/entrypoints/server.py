"""An OpenAI-compatible HTTP server over the engine (chapter 05): `minillm serve`.

The server is a FastAPI app (served by uvicorn, what vLLM and most Python servers use) around one
`LLMEngine`. One background task steps the engine whenever it has requests; each HTTP request adds
its request to the engine and waits on its own queue for the outputs the steps produce:

    POST /v1/completions ─┐                        ┌─ engine.step() ─ outputs ─► each request's queue
    POST /v1/chat/...    ─┴► engine.add_request ──►│  (one forward for every running request)
                                                   └─ repeat while any request is unfinished

A step runs in the event loop itself, between the handlers' turns, so the engine is only ever touched
by one coroutine at a time (no locks); with minillm's small models a step takes milliseconds. The
endpoints and their shapes follow OpenAI's API, so the official `openai` client and any load tester
that speaks it work unchanged:

    GET  /health                 200 "ok" while the engine loop runs
    GET  /v1/models              the model served, and its LoRA adapters (each with "parent": the model)
    POST /v1/completions         text completion; "stream": true sends server-sent events
    POST /v1/chat/completions    chat: the tokenizer's chat template if it has one, else minillm.tokenizer.CHAT_TEMPLATE
    GET  /metrics                Prometheus text: queue lengths, KV blocks, tokens, TTFT and ITL histograms

LoRA adapters (chapter 08, `minillm serve --lora-modules name=path ...`, as vLLM's flag): a request whose
`model` field names an adapter runs under it, beside requests of other adapters and of the base model in the
same steps; an unknown name is a 404 naming the base model and the adapters; a bad adapter file (one holding a NaN
or an infinity too, or one named like the base model) stops the server at start-up with one line naming the
problem; an adapter trained on another base model (its base_model_name_or_path) is served with a warning.

Several completions per request (`n`, and `best_of` for the completions endpoint) come from one prefill
forked into best_of sequences (see `minillm.engine`); streamed, choice i is sequence i.

`minillm serve --disaggregate` serves a `DisaggregatedEngine` instead (chapter 08, `minillm.parallel.disagg`): prompts
are prefilled in one worker process and decoded in another, the KV cache sent between them; this process only routes.
Its `step(timeout=0)` collects what the workers sent without waiting, so the loop polls it and sleeps a few
milliseconds when nothing came (`DisaggregatedAsyncEngine`, the few methods where the two engines differ); the
endpoints are the same. The engine flags apply to both workers. Refused: at start-up, speculative decoding,
--quant, a quantised KV cache and -tp > 1 (one line, as every impossible combination); per request, n or best_of
> 1 and response_format (a 400 naming the field). A request a worker fails gets a 500 (an error event when
streaming) naming the failure; once a worker has died, /health answers 503 saying so, and every new request gets a
503 naming the dead worker: the server must be restarted. The workers stop with the server.

What OpenAI clients send is implemented or refused by name, never silently ignored: `logprobs` (and chat's
`top_logprobs`) return the engine's log-probabilities in each API's shape; `echo` puts the prompt before the
completion; `response_format` {"type": "json_schema", ...} constrains the output to the schema, and
{"type": "json_object"} to a JSON object nested at most 4 deep, with minillm's constrained decoding (chapter 01;
each schema is compiled once, off the event loop; json_object's automaton as the server starts, so that no request
for it pays that compile or can fail it). `suffix` and `echo` with `logprobs` get a 400 that says so.

No single request can stop the service: parameters are checked against what the engine holds before anything
is queued; a step that raises fails only the requests in it (a 500, or an error event when streaming) and is
logged on the `minillm` logger; a request whose logits come out NaN or infinite (a broken LoRA adapter) fails
alone, its batchmates sampled as usual; bodies over `max_body_bytes` get a 413 before they are read, a prompt longer
than the context could hold a 400 before it is tokenised. What is slow for a big body runs off the event loop, so
that /health and the other streams go on: parsing, validating, templating and tokenising in a pool of
REQUEST_THREADS threads, compiling response_format schemas in a pool of SCHEMA_THREADS of their own (a hostile
schema cannot starve the plain requests). Lists past what any request can use (more token ids or messages than
the context has tokens, more than MAX_STOP stop strings) are a 400 saying the limit before they are validated.
uvicorn closes a connection idle for --timeout-keep-alive seconds and answers 503 past --limit-concurrency open
connections; a log line repeated by a failing client is written a few times, then counted (`RepeatFilter`).

Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a 4xx status: bad
JSON or fields (400), a missing or wrong API key (401), an unknown model (404), a prompt longer than
the context (400), a full queue (429). A client that disconnects aborts its request, and the request's
KV blocks are freed.

With an API key (`minillm serve --api-key KEY`, or the MINILLM_API_KEY environment variable, as vLLM's
--api-key and VLLM_API_KEY), every /v1/ route asks for it the way OpenAI clients send it,
`Authorization: Bearer KEY`, compared in constant time (`hmac.compare_digest`: how long a wrong key takes
to refuse says nothing about how much of it was right); a request with several Authorization headers is refused
(a 401), whichever of them holds the key. The API's description (/docs, /redoc, /openapi.json) asks for the key too,
since it lists what is served (a browser cannot send the header, so read /openapi.json with curl -H there); /health
stays open, and /metrics asks for the key only with --metrics-require-api-key. Strings must be whole characters:
a lone UTF-16 surrogate ("\\ud800", which JSON can spell) is a 400 naming the field, and token ids are strict
integers (true is not 1). `build_engine` turns the command's engine flags into an `LLMEngine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import ipaddress
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from minillm.engine.draft_model import DraftModelDrafter
from minillm.engine.engine_config import EngineConfig
from minillm.engine.llm_engine import LLMEngine, RequestOutput, n_best_by_logprob
from minillm.parallel.tensor import start_group
from minillm.sampler.constrained import RegexDFA, TokenIndex, json_object_regex
from minillm.sampler.sampling import SamplingParams
from minillm.sampler.speculative import NgramDrafter, SpeculativeConfig
from minillm.tokenizer import apply_chat_template

if TYPE_CHECKING:  # imported where --disaggregate builds one: a one-process server never loads it
    from minillm.parallel.disagg import DisaggregatedEngine

try:
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import BaseModel, Field, StrictInt, ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("minillm.entrypoints.server needs FastAPI and uvicorn: "
                      "pip install 'minillm-book[serve]'") from exc

log = logging.getLogger("minillm")

MAX_N = 16  # the most completions (n, best_of) one request may ask for
MAX_STOP = 64  # the most stop strings one request may give: each is looked for after every token
MAX_STOP_CHARS = 1024  # the longest stop string
SHUTDOWN_MARGIN_S = 1.0  # open streams end this long before the shutdown limit, so that their last event gets out
# (a second: on a loaded machine the engine's step and the event loop delay the last chunks)
MAX_SCHEMAS = 64  # compiled response_format schemas kept for the next request that sends the same one
MAX_SCHEMA_CELLS = 2 * 10**8  # ...and their indexes' states x vocabulary cells in all (a mask byte each, and more)
REQUEST_THREADS = 2  # threads parsing, validating and tokenising bodies (under the GIL, more only queue longer)
SCHEMA_THREADS = 2  # threads compiling response_format schemas: apart, so hostile schemas cannot starve the rest
JSON_OBJECT = json_object_regex()  # the pattern of response_format {"type": "json_object"}


@functools.cache
def json_object_dfa() -> RegexDFA:
    """JSON_OBJECT's automaton (663 states, 1-2 s to compile), compiled once per process however many apps start:
    each app builds its token index from it at start-up (`AsyncEngine.start`)."""
    return RegexDFA(JSON_OBJECT)


def lone_surrogate(body: Any) -> str | None:
    """Where in a parsed JSON body a string holds a lone UTF-16 surrogate ("\\ud800" alone), as a dotted path
    ("messages.0.content"), or None. JSON may spell one; Python's json.loads accepts it; but it is no character,
    so no UTF-8 encoder (the tokenizer's, the response's) can take it. Walked with a stack, not recursion: a
    body may nest as deep as the parser allows."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(value, dict):
            stack += [(f"{path}.{k}" if path else str(k), k) for k in value]  # a key may hold one too
            stack += [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value)]
    return None


# ---------------------------------------------------------------------- request bodies
class _Sampling(BaseModel):
    """The sampling fields both endpoints take (OpenAI's names; top_k, min_p, repetition_penalty and
    ignore_eos are vLLM's extensions)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_N, description="completions to return")
    best_of: int | None = Field(default=None, ge=1, le=MAX_N, description="completions to generate (>= n); "
                                "the n with the highest cumulative log-probability are returned")
    stream: bool = False
    ignore_eos: bool = False
    user: str | None = None
    # {"type": "text"}; {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}: the output is
    # constrained to the schema (chapter 01); {"type": "json_object"}: to a JSON object (nested at most
    # JSON_OBJECT_DEPTH deep: a regex cannot nest freely).
    response_format: dict | None = None

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs for this request: how many alternatives per token, None for no logprobs."""
        return None

    def output_constraint(self) -> dict | str | None:
        """What the output must follow, from response_format: a JSON schema (dict), the regex of any JSON object
        (str), or None for free text."""
        kind = (self.response_format or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_schema":
            schema = (self.response_format.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(400, 'response_format json_schema needs {"json_schema": {"name": ..., '
                                    '"schema": {...}}}.', param="response_format", code="invalid_value")
            return schema
        if kind == "json_object":
            return JSON_OBJECT
        raise APIError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema.",
                       param="response_format", code="invalid_value")

    def params(self, default_max_tokens: int) -> SamplingParams:
        if self.stream and (self.best_of or self.n) != self.n:
            raise APIError(400, f"best_of ({self.best_of}) must equal n ({self.n}) when streaming: the best are known "
                                "only at the end.", param="best_of", code="invalid_value")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(len(text) > MAX_STOP_CHARS for text in stop):
            longest = max(len(text) for text in stop)
            raise APIError(400, f"a stop string has {longest:,} characters, more than this server's limit of "
                                f"{MAX_STOP_CHARS}: shorten it.", param="stop", code="invalid_value")
        try:
            return SamplingParams(
                max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, min_p=self.min_p, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty, stop=stop,
                seed=self.seed, ignore_eos=self.ignore_eos, n=self.n, best_of=self.best_of,
                logprobs=self.num_logprobs(),
            )
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc


class CompletionRequest(_Sampling):
    prompt: str | list[StrictInt]  # strict: true and false are ints to Python, and no token ids
    logprobs: int | None = Field(default=None, ge=0, le=20, description="log-probabilities of the chosen token "
                                 "and of this many alternatives per token")
    echo: bool = False  # the prompt before the completion, in the response's text
    suffix: str | None = None  # OpenAI's legacy insert mode: not supported, refused by name

    def num_logprobs(self) -> int | None:
        if self.suffix is not None:
            raise APIError(400, "suffix (insert mode) is not supported: leave it out.", param="suffix",
                           code="unsupported_parameter")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs would need the prompt's log-probabilities, which this server "
                                "does not compute: drop one of them.", param="echo", code="unsupported_parameter")
        return self.logprobs


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False  # each output token's log-probability
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="alternatives per token, with logprobs")

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true.", param="top_logprobs", code="invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None


class APIError(Exception):
    """An error the client caused, returned as OpenAI's error object with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class ShutdownError(APIError):
    """The server's shutdown limit came before the request finished (`AsyncEngine.end_all`): a 503, and for a stream
    a last chunk whose finish_reason is "abort" for each choice still open, then [DONE]."""

    def __init__(self) -> None:
        super().__init__(503, "the server is shutting down and ended this request before it finished: retry it.",
                         "server_error", code="server_shutting_down")


def validation_error(errors: list[dict]) -> APIError:
    """A pydantic validation failure as a 400 naming the first field at fault (each error's "loc", a path in the
    body)."""
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ())) or None
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON: send a JSON object of OpenAI's API, UTF-8 "
                             "encoded.", code="invalid_json")
    return APIError(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where, code="invalid_value")


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a UTF-16 surrogate is spelt in JSON (UTF-8 cannot)


def check_lists(data: Any, context: int) -> None:
    """Refuse (400) a list longer than any request could use, before it is validated: more token ids or messages
    than the context has tokens (a message takes one at least), more than MAX_STOP stop strings. pydantic holds the
    GIL while it validates (a second for 3 M token ids), so a long list would stall every thread, the loop's too."""
    if not isinstance(data, dict):
        return  # model_validate says what is wrong with it
    for field, limit, what in (("prompt", context, f"the model's context of {context} tokens could hold"),
                               ("messages", context, f"the model's context of {context} tokens could hold"),
                               ("stop", MAX_STOP, f"this server's limit of {MAX_STOP} stop strings")):
        value = data.get(field)
        if isinstance(value, list) and len(value) > limit:
            raise APIError(400, f"{field} has {len(value):,} items, more than {what}: send fewer.", param=field,
                           code="invalid_value")


def parse_body(raw: bytes, model: type[_Sampling], context: int) -> _Sampling:
    """A request body (bytes) as `model`, or a 400 that says what is wrong: not JSON, a string holding a lone
    surrogate (`lone_surrogate`), a list too long for a model of `context` tokens (`check_lists`), a field out of
    range. Slow for a big body (16 MiB of JSON takes a fraction of a second to parse), so the server calls it off
    the event loop (`AsyncEngine.off_loop`)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested deeper than the parser recurses
        raise validation_error([{"type": "json_invalid"}]) from None
    where = lone_surrogate(data) if SURROGATE_ESCAPE.search(raw) else None  # the walk only when one may be there
    if where is not None:
        raise APIError(400, f"{where} holds a lone UTF-16 surrogate (like \\ud800 without its pair), which is not a "
                            "character: send whole characters (an emoji as its pair, \\ud83d\\ude00, or as UTF-8).",
                       param=where, code="invalid_value")
    check_lists(data, context)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_input=False, include_url=False)) from None


class RepeatFilter(logging.Filter):
    """Let a repeated log line through `first` times, then once every `every` times with the count, so that a client
    repeating a failing request cannot flood the log. Lines are the same when their format string and their
    exception's text are (the request ids in them may differ). Remembers at most `max_lines` distinct lines."""

    def __init__(self, first: int = 5, every: int = 100, max_lines: int = 1024) -> None:
        super().__init__()
        self.first, self.every, self.max_lines = first, every, max_lines
        self.seen: dict[tuple[str, str | None], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        key = (str(record.msg), f"{type(error).__name__}: {error}" if error is not None else None)
        if key not in self.seen and len(self.seen) >= self.max_lines:
            self.seen.clear()  # forget the old lines rather than grow without bound
        count = self.seen[key] = self.seen.get(key, 0) + 1
        if count <= self.first:
            return True
        if count % self.every == 0:
            record.msg = f"{record.msg} [repeated {count} times; logging one in {self.every}]"
            record.exc_info = record.exc_text = None  # the traceback was logged the first times
            return True
        return False


# ---------------------------------------------------------------------- metrics
class Metrics:
    """The server's Prometheus metrics, in their own registry (so several servers in one process do not clash).
    The counters and histograms follow the outputs (`observe`); the gauges are read from the engine at each scrape
    (`AsyncEngine.metrics_text`)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.waiting = Gauge("minillm_requests_waiting", "Requests in the waiting queue.", registry=r)
        self.running = Gauge("minillm_requests_running", "Requests in the running batch.", registry=r)
        self.blocks_used = Gauge("minillm_kv_blocks_used", "KV-cache blocks held by requests.", registry=r)
        self.blocks_total = Gauge("minillm_kv_blocks_total", "KV-cache blocks in the pool.", registry=r)
        self.prompt_tokens = Counter("minillm_prompt_tokens", "Prompt tokens received.", registry=r)
        self.generation_tokens = Counter("minillm_generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter("minillm_requests_finished", "Requests finished, by reason.", ["reason"],
                                registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram("minillm_time_to_first_token_seconds", "Time to first token.", buckets=buckets,
                              registry=r)
        self.itl = Histogram("minillm_inter_token_latency_seconds", "Time between tokens of a request.",
                             buckets=buckets, registry=r)
        # Read from the engine at each scrape (vLLM exports the same counts as prefix_cache_hits/queries and
        # spec_decode_num_draft_tokens/num_accepted_tokens):
        self.prefix_hits = Gauge("minillm_prefix_cache_hits", "Full prompt blocks found in the prefix cache.",
                                 registry=r)
        self.prefix_queries = Gauge("minillm_prefix_cache_queries", "Full prompt blocks looked up in the prefix "
                                    "cache.", registry=r)
        self.draft_tokens = Gauge("minillm_spec_decode_num_draft_tokens", "Draft tokens proposed (speculative "
                                  "decoding, chapter 07).", registry=r)
        self.accepted_tokens = Gauge("minillm_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                     registry=r)
        self.cuda_graphs = Gauge("minillm_cuda_graphs_enabled", "1 if decode steps replay CUDA graphs, 0 if eager.",
                                 registry=r)
        self.preemptions = Gauge("minillm_num_preemptions", "Sequences preempted since the start: their KV blocks "
                                 "freed for older ones, their tokens recomputed later (vLLM: num_preemptions).",
                                 registry=r)

    def observe(self, out: RequestOutput) -> None:
        """Record one step's output of one request."""
        self.generation_tokens.inc(len(out.new_token_ids))
        times = out.token_times_s
        if len(times) == 1 and out.index == 0:  # once per request, also with n > 1
            self.ttft.observe(times[0])
        elif len(times) > 1:
            self.itl.observe(times[-1] - times[-2])
        if out.finished:
            self.finished.labels(out.finish_reason).inc()

    def text(self) -> bytes:
        """Every metric in Prometheus' text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ---------------------------------------------------------------------- the engine loop
@dataclass
class _Waiter:
    queue: asyncio.Queue
    sequences: int = 1  # best_of: the request is done when this many sequences have finished
    prompt_tokens: int = 0  # the prompt's length in tokens (the response's usage)
    finished: int = 0
    error: APIError | None = None  # set when the engine failed on a step of this request

    @property
    def done(self) -> bool:
        return self.finished == self.sequences


class AsyncEngine:
    """Steps the engine in the background while any request is unfinished; routes outputs to their waiters.

    What the loop and the handlers ask of the engine goes through a few methods (`step`, `submit`,
    `check_request`, `requests_of_failed_step`, `problem`, `metrics_text`); `DisaggregatedAsyncEngine`
    overrides them for the prefill/decode split, and the rest of the server is the same for both."""

    poll_interval_s = 0.0  # how long the loop sleeps after a step that gave no output (LLMEngine: not at all)

    def __init__(self, engine: LLMEngine, max_queue: int) -> None:
        self.engine, self.max_queue = engine, max_queue
        # The most characters a prompt can have and still fit the context: the context x the longest token's
        # characters (a byte-level token's string has a character per byte), x 2 for safety. A longer text is
        # refused before it is tokenised: tokenising megabytes only to refuse them would stall the server.
        longest = 1
        if engine.tokenizer is not None:
            longest = max((len(t) for t in engine.tokenizer.backend.get_vocab()), default=1)
        self.max_prompt_chars = 2 * engine.model.config.max_seq_len * longest
        self.constraints: dict[str, TokenIndex] = {}  # compiled response_format schemas, by their JSON
        self.json_object: TokenIndex | None = None  # json_object's, built at start-up (`start`), never dropped
        # Work too slow for the event loop, in bounded pools of its own: bodies (parse, validate, template,
        # tokenise), and schemas (compile) apart from them. `off_loop` refuses work past max_queue waiting.
        self.request_pool = ThreadPoolExecutor(REQUEST_THREADS, thread_name_prefix="minillm-request")
        self.schema_pool = ThreadPoolExecutor(SCHEMA_THREADS, thread_name_prefix="minillm-schema")
        self.pending = 0  # calls in or waiting for the pools
        self.metrics = Metrics()
        self.waiters: dict[str, _Waiter] = {}
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.draining = False  # the graceful shutdown has begun (`drain`): no new request is taken
        self.cut: asyncio.TimerHandle | None = None  # when the open requests will be ended (`end_all`)

    async def off_loop(self, pool: ThreadPoolExecutor, work: Callable[..., Any], *args: Any) -> Any:
        """work(*args) in one of the pools, while the event loop goes on serving (/health, the streams); a 429 when
        max_queue calls are waiting already. Threads share the GIL, but Python switches between them every few
        milliseconds, so the loop gets its turns."""
        if self.pending >= self.max_queue:
            raise APIError(429, f"the server is already reading {self.pending} request bodies (its queue limit); "
                                "retry later.", "rate_limit_exceeded", code="queue_full")
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, work, *args)
        finally:
            self.pending -= 1

    async def start(self) -> None:
        """At start-up, before any request: build json_object's token index off the event loop, so that a request for
        it never pays the compile, and no hostile schema can push it out of the cache (`constraint`). A tokenizer
        constrained decoding cannot use (not byte-level) is served anyway: response_format then gets a 400 saying
        why, as it did."""
        if self.engine.tokenizer is None:
            return
        try:
            self.json_object = await asyncio.get_running_loop().run_in_executor(
                self.schema_pool, TokenIndex.from_constraint, json_object_dfa(), self.engine.tokenizer,
                self.engine.model.config.eos_token_ids)
        except ValueError as exc:
            log.warning("response_format will be refused: constrained decoding cannot use this model (%s)", exc)

    def drain(self, timeout_s: float | None) -> None:
        """The graceful shutdown begins (`run_uvicorn`), and uvicorn will cut what is still open in `timeout_s`
        seconds (None: it waits for every stream to finish). Take no new request, and end the open ones a little
        before that limit (`end_all`), so that every stream gets its last event instead of a cut connection."""
        self.draining = True
        if timeout_s is not None:
            delay = max(0.0, timeout_s - min(SHUTDOWN_MARGIN_S, timeout_s / 4))
            self.cut = asyncio.get_running_loop().call_later(delay, self.end_all)

    def end_all(self) -> None:
        """The shutdown limit is near: abort every unfinished request and end its handler with `ShutdownError`."""
        open_ = [request_id for request_id, waiter in self.waiters.items() if not waiter.done and waiter.error is None]
        if open_:
            log.warning("the shutdown limit is near: ending %d unfinished request(s)", len(open_))
        self.engine.abort_request(open_)
        for request_id in open_:
            waiter = self.waiters[request_id]
            waiter.error = ShutdownError()
            waiter.queue.put_nowait(None)
            self.metrics.finished.labels("abort").inc()

    def close_pools(self) -> None:
        """Stop the threads (at shutdown): what is queued is dropped, what runs finishes."""
        for pool in (self.request_pool, self.schema_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    async def loop(self) -> None:
        """Step while any request is unfinished, else sleep until one comes; route every output."""
        while True:
            if not self.engine.has_unfinished_requests():
                self.wakeup.clear()
                await self.wait_for_requests()
            try:
                outputs = self.step()
            except Exception as exc:  # noqa: BLE001 - one failed step must not stop the service
                self.fail_step(exc)
                await asyncio.sleep(0)
                continue
            self.route(outputs)
            # let the handlers run: read new requests, send what was produced
            await asyncio.sleep(0 if outputs else self.poll_interval_s)

    async def wait_for_requests(self) -> None:
        """Sleep until a handler adds a request (`wakeup`)."""
        await self.wakeup.wait()

    def step(self) -> list[RequestOutput]:
        """One engine step: one forward for every running request, in this process."""
        self.engine.last_step = None  # set by the step's schedule: who ran in it
        return self.engine.step()

    def route(self, outputs: list[RequestOutput]) -> None:
        """Count each output in the metrics and hand it to its request's waiter."""
        for out in outputs:
            if out.finish_reason == "error":  # its logits were not numbers (`LLMEngine._failed_row`)
                self.fail_row(out)
                continue
            self.metrics.observe(out)
            waiter = self.waiters.get(out.request_id)
            if waiter is not None:
                waiter.queue.put_nowait(out)

    def fail_step(self, exc: Exception) -> None:
        """The engine raised in a step: fail the requests of that step with a 500 in OpenAI's shape, free their
        blocks, log it, and keep serving the rest."""
        failed = self.requests_of_failed_step()
        log.error("a step of the engine failed (%s: %s); failing its request(s) %s and serving the others",
                  type(exc).__name__, exc, failed, exc_info=exc)
        self.engine.abort_request(failed)
        for request_id in failed:
            self.fail(request_id, f"the engine failed on this request: {type(exc).__name__}: {exc}")

    def fail_row(self, out: RequestOutput) -> None:
        """The engine finished a sequence with an error: its logits held NaN or infinite values (a broken model or LoRA
        adapter). Fail its request alone (the step's other rows were sampled as usual), its other sequences too."""
        waiter = self.waiters.get(out.request_id)
        if waiter is not None and waiter.error is not None:
            return  # failed already, by another of its sequences
        log.error("the model's logits for request %s were NaN or infinite; failing it and serving the others",
                  out.request_id)
        self.engine.abort_request(out.request_id)
        self.fail(out.request_id, "the engine failed on this request: the model's logits for it were NaN or infinite, "
                                  "so no token could be sampled (a broken model or LoRA adapter).")

    def requests_of_failed_step(self) -> list[str]:
        """The requests in the step that raised: those it scheduled, or every unfinished one if it failed before
        choosing them."""
        plan = self.engine.last_step
        sequences = [s for s, _ in plan.scheduled] if plan else list(self.engine.scheduler.sequences.values())
        return sorted({s.request_id for s in sequences})

    def fail(self, request_id: str, message: str) -> None:
        """End a request with a 500 in OpenAI's shape (an error event when streaming) that says `message`."""
        waiter = self.waiters.get(request_id)
        if waiter is not None:
            waiter.error = APIError(500, message, "server_error", code="engine_error")
            waiter.queue.put_nowait(None)
        self.metrics.finished.labels("error").inc()

    def problem(self) -> str | None:
        """Why the server cannot serve now (what /health answers with a 503), or None while it can."""
        return "engine loop stopped" if self.task is None or self.task.done() else None

    async def metrics_text(self) -> bytes:
        """/metrics: the counters kept as outputs passed, and the engine's gauges read now."""
        m, scheduler, allocator = self.metrics, self.engine.scheduler, self.engine.cache.allocator
        m.waiting.set(len(scheduler.waiting))
        m.running.set(len(scheduler.running))
        m.blocks_used.set(allocator.num_used_blocks)
        m.blocks_total.set(allocator.num_blocks)
        m.prefix_hits.set(allocator.hits)
        m.prefix_queries.set(allocator.hits + allocator.misses)
        m.draft_tokens.set(self.engine.spec_stats.num_proposed)
        m.accepted_tokens.set(self.engine.spec_stats.num_accepted)
        m.cuda_graphs.set(float(self.engine.use_cuda_graphs))
        m.preemptions.set(self.engine.num_preemptions)
        return m.text()

    def check_request(self, params: SamplingParams, schema: dict | str | None) -> None:
        """Refuse (APIError) what this engine cannot serve, before anything is compiled or queued. The one-process
        engine serves every request that got this far."""

    async def constraint(self, schema: dict | str | None) -> TokenIndex | None:
        """The token index of a JSON schema or a regex (chapter 01), built off the event loop and kept for the next
        request with the same one; None for free text. A schema minillm cannot turn into a pattern is a 400."""
        if schema is None:
            return None
        if schema == JSON_OBJECT and self.json_object is not None:  # built at start-up
            return self.json_object
        key = json.dumps(schema, sort_keys=True)
        if key not in self.constraints:
            if self.engine.tokenizer is None:
                raise APIError(400, "response_format needs the model's tokenizer, and this model has none.",
                               param="response_format", code="unsupported_parameter")
            try:
                index = await self.off_loop(self.schema_pool, TokenIndex.from_constraint, schema,
                                            self.engine.tokenizer, self.engine.model.config.eos_token_ids)
            except (ValueError, RecursionError) as exc:
                raise APIError(400, f"response_format json_schema: {exc}", param="response_format",
                               code="invalid_value") from exc
            self.constraints[key] = index
            # a few compiled schemas at most, by count and by size (an index holds states x vocabulary cells): the
            # oldest go first, never the one just built
            while len(self.constraints) > 1 and (len(self.constraints) > MAX_SCHEMAS or sum(
                    c.mask.numel() for c in self.constraints.values()) > MAX_SCHEMA_CELLS):
                self.constraints.pop(next(iter(self.constraints)))
        return self.constraints[key]

    def add(self, prompt: str | list[int], params: SamplingParams,
            constraint: TokenIndex | None = None, lora: str | None = None) -> tuple[str, _Waiter]:
        if self.draining:
            raise APIError(503, "the server is shutting down: send the request to another server, or retry later.",
                           "server_error", code="server_shutting_down")
        if self.engine.num_unfinished_requests >= self.max_queue:
            raise APIError(429, f"the server already holds {self.max_queue} unfinished requests (its queue limit); "
                                "retry later.", "rate_limit_exceeded", code="queue_full")
        request_id = f"cmpl-{uuid.uuid4().hex[:16]}"
        try:
            prompt_tokens = (self.submit(request_id, prompt, params, constraint, lora) if lora is not None
                             else self.submit(request_id, prompt, params, constraint))
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_prompt") from exc
        waiter = self.waiters[request_id] = _Waiter(asyncio.Queue(), params.best_of or params.n, prompt_tokens)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.wakeup.set()
        return request_id, waiter

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               constraint: TokenIndex | None, lora: str | None = None) -> int:
        """Queue the request in the engine (a ValueError if it cannot take it), under LoRA adapter `lora` (None: the
        base model); returns the prompt's tokens."""
        self.engine.add_request(request_id, prompt, params, constraint=constraint, lora=lora)
        return len(self.engine.scheduler.sequences[request_id].prompt_token_ids)

    def release(self, request_id: str) -> None:
        """The handler is done with this request: abort it if unfinished (a client went away)."""
        waiter = self.waiters.pop(request_id, None)
        if waiter is not None and not waiter.done and waiter.error is None:
            self.engine.abort_request(request_id)
            self.metrics.finished.labels("abort").inc()

    async def outputs(self, request_id: str, waiter: _Waiter, http: Request) -> AsyncIterator[RequestOutput]:
        """The request's outputs (of all its sequences) as the engine makes them, until all are finished; the
        caller aborts the request (`release`) if the client disconnects."""
        while True:
            try:
                out = await asyncio.wait_for(waiter.queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                out = None
            if waiter.error is not None:
                raise waiter.error
            if await http.is_disconnected():  # checked at every token, and at least every 0.25 s
                return
            if out is None:
                continue
            waiter.finished += out.finished
            yield out
            if waiter.done:
                return


def one_line(reason: str) -> str:
    """A worker's failure in one line: its first line, and a traceback's last (the exception), if it has one."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0].rstrip(':')}: {lines[-1]}"


class DisaggregatedAsyncEngine(AsyncEngine):
    """`AsyncEngine` over a `DisaggregatedEngine` (`minillm serve --disaggregate`, chapter 08).

    This process only routes: the workers compute in their own processes, and `step` just collects what they sent.
    So the loop calls it with timeout=0 (a wait would block the event loop) and sleeps `poll_interval_s` when
    nothing came, letting the handlers run meanwhile. The router knows each request's phase ("prefill" or
    "decode"), not the workers' queues: /metrics shows those phases as waiting and running, and the workers' KV
    blocks when both answer within `metrics_wait_s`. A worker that dies fails the requests it held; the router
    notices it at its next look (within `idle_check_s` when idle), and from then on refuses every request."""

    engine: DisaggregatedEngine
    poll_interval_s = 0.002
    idle_check_s = 0.5  # with no request, still look this often, so that a dead worker is noticed (/health)
    metrics_wait_s = 0.5  # how long /metrics waits for the workers' block counts

    def __init__(self, engine: DisaggregatedEngine, max_queue: int) -> None:
        super().__init__(engine, max_queue)  # it has what the base reads: model, tokenizer, the request calls
        from prometheus_client import Gauge

        self.worker_blocks_used = Gauge("minillm_worker_kv_blocks_used", "KV-cache blocks held, per worker.",
                                        ["worker"], registry=self.metrics.registry)
        self.worker_blocks_total = Gauge("minillm_worker_kv_blocks_total", "KV-cache blocks in each worker's pool.",
                                         ["worker"], registry=self.metrics.registry)
        self.logged_down = False

    async def start(self) -> None:
        """Nothing to build: response_format does not cross the prefill/decode split (`check_request` refuses it)."""

    async def wait_for_requests(self) -> None:
        """Sleep until a handler adds a request, or `idle_check_s` has passed."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wakeup.wait(), timeout=self.idle_check_s)

    def step(self) -> list[RequestOutput]:
        """The outputs the workers sent since the last look, without waiting; a request that failed in a worker
        is failed here, with the worker's reason."""
        outputs = []
        for out in self.engine.step(timeout=0):
            if out.finish_reason == "error":
                self.fail(out.request_id, "the disaggregated engine failed on this request: "
                          + one_line(self.engine.errors.pop(out.request_id, "unknown")))
            else:
                outputs.append(out)
        if self.engine.down and not self.logged_down:
            self.logged_down = True
            log.error("the disaggregated engine cannot serve any more: %s", self.engine.down)
        return outputs

    def requests_of_failed_step(self) -> list[str]:
        """Every unfinished request: the router cannot tell which ones a failed look concerned."""
        return sorted(self.engine.requests)

    def down_error(self) -> APIError:
        """The 503 every request gets once a worker has died."""
        why = one_line(self.engine.down or "a worker stopped answering")
        return APIError(503, f"{why}: this server cannot serve requests any more; restart it.", "server_error",
                        code="engine_down")

    def problem(self) -> str | None:
        """The base's problem, or the dead worker."""
        return super().problem() or (self.down_error().message if self.engine.down else None)

    def check_request(self, params: SamplingParams, schema: dict | str | None) -> None:
        """Refuse, before anything is compiled or tokenised: every request once a worker has died (503); n or
        best_of > 1 and response_format, which do not cross the prefill/decode split (400)."""
        if self.engine.down:
            raise self.down_error()
        if (params.best_of or params.n) > 1:
            field = "n" if params.n > 1 else "best_of"
            raise APIError(400, f"{field} > 1 is not supported with --disaggregate (one sequence per request crosses "
                                f"the prefill/decode split): send {params.best_of or params.n} requests instead.",
                           param=field, code="unsupported_parameter")
        if schema is not None:
            raise APIError(400, "response_format (constrained decoding) is not supported with --disaggregate: ask "
                                "for free text, or serve without --disaggregate.", param="response_format",
                           code="unsupported_parameter")

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               constraint: TokenIndex | None) -> int:
        """Queue the request at the prefill worker (constraint is None: `check_request` refused the others)."""
        try:
            self.engine.add_request(request_id, prompt, params)
        except (RuntimeError, OSError) as exc:  # a worker died since the loop last looked (a broken pipe)
            self.route(self.step())  # notices it, and fails what the workers held
            raise self.down_error() from exc
        return len(prompt) if isinstance(prompt, list) else len(self.engine.tokenizer.encode(prompt))

    async def metrics_text(self) -> bytes:
        """What the router knows (each request's phase, tokens, TTFT, ITL), and the workers' KV blocks if both
        answer within `metrics_wait_s` (else the last ones they sent)."""
        if not self.engine.down:
            with contextlib.suppress(OSError):
                self.engine.ask_stats()
                deadline = time.monotonic() + self.metrics_wait_s
                while len(self.engine.stats) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                    self.route(self.step())  # the answers come in with the outputs
        m, phases = self.metrics, list(self.engine.requests.values())
        m.waiting.set(phases.count("prefill"))
        m.running.set(phases.count("decode"))
        for rank, name in enumerate(("prefill", "decode")):
            if rank in self.engine.stats:
                self.worker_blocks_used.labels(name).set(self.engine.stats[rank]["used_blocks"])
                self.worker_blocks_total.labels(name).set(self.engine.stats[rank]["num_blocks"])
        m.blocks_used.set(sum(s["used_blocks"] for s in self.engine.stats.values()))
        m.blocks_total.set(sum(s["num_blocks"] for s in self.engine.stats.values()))
        return m.text()


# ---------------------------------------------------------------------- the body limit
class BodyLimit:
    """ASGI middleware: a request body larger than `max_body_bytes` gets a 413 in OpenAI's shape. By its
    Content-Length before anything is read; a chunked body, which has none, as soon as what was read passes the
    limit (the reading is stopped, and whatever the app would have answered is replaced by the 413)."""

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes

    def refusal(self, size: str) -> JSONResponse:
        return APIError(413, f"the request body ({size}) is larger than this server's limit of "
                             f"{self.max_body_bytes:,} bytes: send a shorter prompt.", code="body_too_large").response()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await self.refusal(f"{length.decode(errors='replace')} bytes")(scope, receive, send)
        seen, refusal, sent = 0, None, False

        async def counted() -> dict:
            nonlocal seen, refusal
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes and refusal is None:
                refusal = self.refusal(f"over {seen:,} bytes so far")
                raise HTTPException(413, "the request body is too large")  # stops the app reading it
            return message

        async def send_or_refuse(message: dict) -> None:
            nonlocal sent
            if refusal is None:
                await send(message)
            elif message["type"] == "http.response.start" and not sent:  # the app's answer to the stopped read
                sent = True
                await refusal(scope, receive, send)  # ours instead

        try:
            await self.app(scope, counted, send_or_refuse)
        except Exception:
            if refusal is None:
                raise
        if refusal is not None and not sent:
            await refusal(scope, receive, send)


# ---------------------------------------------------------------------- the app
def create_app(engine: LLMEngine | DisaggregatedEngine, model_name: str, max_queue: int = 256,
               default_max_tokens: int = 16, api_key: str | None = None, metrics_require_api_key: bool = False,
               max_body_bytes: int = 16 * 2**20) -> FastAPI:
    """The FastAPI app serving `engine` (one `LLMEngine`, or a `DisaggregatedEngine` and its workers) as
    `model_name` (see the module docstring). With `api_key`, every /v1/ route (and /metrics, with
    metrics_require_api_key) answers 401 unless the request carries `Authorization: Bearer <api_key>`. The app
    owns the engine: it calls `engine.shutdown()` when it shuts down."""
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty: give a key, or none to serve without one.")
    if metrics_require_api_key and api_key is None:
        raise ValueError("--metrics-require-api-key needs an API key (--api-key or MINILLM_API_KEY).")
    if isinstance(engine, LLMEngine):
        state = AsyncEngine(engine, max_queue)
    else:  # a DisaggregatedEngine (`minillm serve --disaggregate`)
        state = DisaggregatedAsyncEngine(engine, max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()  # json_object's automaton, before the first request
        state.task = asyncio.create_task(state.loop())  # the engine loop runs as long as the server
        yield
        if state.cut is not None:
            state.cut.cancel()
        state.task.cancel()
        state.close_pools()
        engine.shutdown()  # its worker processes, if it has any (--disaggregate, --tensor-parallel-size)

    app = FastAPI(title="minillm", description="An OpenAI-compatible server over minillm's engine (chapter 05).",
                  lifespan=lifespan)
    app.state.engine = state
    if not any(isinstance(f, RepeatFilter) for f in log.filters):  # one for the process, however many apps
        log.addFilter(RepeatFilter())

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(http: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes, wrong methods, bodies that do not parse (invalid UTF-8, nesting too deep): OpenAI's shape."""
        if exc.status_code == 404:
            message = (f"no route {http.url.path}: this server answers /v1/models, /v1/completions, "
                       "/v1/chat/completions, /health and /metrics.")
        elif exc.status_code == 413:
            message = str(exc.detail)
        else:
            message = f"{exc.detail}: send a JSON body of OpenAI's API, UTF-8 encoded."
        return APIError(exc.status_code, message, code={404: "not_found", 405: "method_not_allowed",
                                                        413: "body_too_large"}.get(exc.status_code,
                                                                                   "invalid_request")).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.error("request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        return APIError(500, f"the server failed on this request: {type(exc).__name__}", "server_error",
                        code="internal_error").response()

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()
        # The API's own description (/docs, /redoc, /openapi.json) asks for the key too: it lists what is served.
        protected = ("/v1/", "/docs", "/redoc", "/openapi.json") + (("/metrics",) if metrics_require_api_key else ())

        @app.middleware("http")
        async def require_api_key(http: Request, call_next: Any) -> Any:
            if http.url.path.startswith(protected):
                if len(http.headers.getlist("authorization")) > 1:  # which one would count? neither
                    return APIError(401, "the request has several Authorization headers: send exactly one, "
                                         "'Authorization: Bearer KEY'.", code="invalid_api_key").response()
                sent = http.headers.get("authorization", "").encode()
                if not hmac.compare_digest(sent, expected):  # constant time: no timing hint about the key
                    why = "a wrong API key" if sent else "no API key"
                    return APIError(401, f"{why} was sent: send the server's key as 'Authorization: Bearer KEY' "
                                         "(the openai client's api_key).", code="invalid_api_key").response()
            return await call_next(http)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's own validation (of query parameters, say): OpenAI's shape, as parse_body's."""
        errors = [e | {"loc": tuple(e.get("loc", ()))[1:]} for e in exc.errors()]  # without FastAPI's "body"
        return validation_error(errors).response()

    adapters: dict[str, str] = dict(getattr(engine, "lora_modules", {}))  # LoRA adapters by name (chapter 08)
    check_adapter_names(engine, model_name)

    def check_model(name: str) -> str | None:
        """The LoRA adapter a request's model field names (None: the base model); a 404 naming what is served."""
        if name == model_name:
            return None
        if name in adapters:
            return name
        served = f"{model_name!r}" + (f" and the LoRA adapters {sorted(adapters)}" if adapters else "")
        raise APIError(404, f"the model {name!r} does not exist here; this server serves {served} "
                            "(see GET /v1/models).", param="model", code="model_not_found")

    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)  # last added: the outermost layer

    @app.get("/health")
    async def health() -> PlainTextResponse:
        problem = state.problem()
        return PlainTextResponse(problem or "ok", status_code=503 if problem else 200)

    @app.get("/v1/models")
    async def models() -> dict:
        base = {"id": model_name, "object": "model", "created": 0, "owned_by": "minillm",
                "max_model_len": engine.model.config.max_seq_len}
        loras = [base | {"id": name, "root": path, "parent": model_name} for name, path in adapters.items()]
        return {"object": "list", "data": [base, *loras]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(await state.metrics_text(), media_type="text/plain; version=0.0.4")

    context = engine.model.config.max_seq_len

    def too_long(what: str, size: int, unit: str) -> APIError:
        return APIError(400, f"{what} has {size:,} {unit}, more than the model's context of {context} tokens could "
                             "hold: shorten it.", param="prompt" if what == "the prompt" else what,
                        code="invalid_prompt")

    def prompt_of(body: _Sampling, chat: bool) -> tuple[str | list[int], str]:
        """The request's prompt as token ids (a text one tokenised; a chat templated first) and as text (for echo).
        Refuses, before the slow part, a prompt of more characters than `max_prompt_chars` (it could not fit the
        context). Run off the loop."""
        if chat:
            messages = body.messages
            if sum(len(m.content) for m in messages) > state.max_prompt_chars:
                raise too_long("messages", sum(len(m.content) for m in messages), "characters of content")
            prompt = apply_chat_template([m.model_dump() for m in messages], engine.tokenizer)
        else:
            prompt = body.prompt
        if not isinstance(prompt, str):  # token ids, no more than the context (`check_lists`)
            echo = getattr(body, "echo", False) and engine.tokenizer is not None
            return prompt, engine.tokenizer.decode(prompt) if echo else ""
        if len(prompt) > state.max_prompt_chars:
            raise too_long("the prompt", len(prompt), "characters")
        return (engine.tokenizer.encode(prompt) if engine.tokenizer is not None else prompt), prompt

    async def run(model: type[_Sampling], http: Request, chat: bool) -> Any:
        """Serve one request. What is slow for a big body (parsing it, validating it, templating and tokenising the
        prompt) runs in the request pool, compiling a schema in the schema pool: the event loop goes on serving."""
        body = await state.off_loop(state.request_pool, parse_body, await http.body(), model, context)
        lora = check_model(body.model)
        params = body.params(default_max_tokens)
        schema = body.output_constraint()
        state.check_request(params, schema)
        constraint = await state.constraint(schema)
        echo = getattr(body, "echo", False)
        prompt, prompt_text = await state.off_loop(state.request_pool, prompt_of, body, chat)
        request_id, waiter = state.add(prompt, params, constraint, lora)
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        n_prompt = waiter.prompt_tokens
        wanted = params.logprobs is not None

        def logprobs_of(out: RequestOutput, first: int, offset: int) -> dict | None:
            """The logprobs object of out's tokens from index `first` on (chat's or completions' shape)."""
            if not wanted:
                return None
            ids, lps, tops = out.token_ids[first:], out.logprobs[first:], out.top_logprobs[first:]
            if chat:
                return chat_logprobs(engine.tokenizer, ids, lps, tops)
            return completion_logprobs(engine.tokenizer, ids, lps, tops, offset)

        if not body.stream:
            finals: list[RequestOutput] = []
            try:
                async for out in state.outputs(request_id, waiter, http):
                    if out.finished:
                        finals.append(out)
            finally:
                state.release(request_id)
            if not waiter.done:
                return JSONResponse({}, status_code=499)  # the client went away: nobody reads this
            choices = []
            for i, out in enumerate(n_best_by_logprob(finals, params.n)):
                if chat:
                    choice = {"index": i, "message": {"role": "assistant", "content": out.text}}
                    choice |= {"logprobs": logprobs_of(out, 0, 0)} if wanted else {}
                else:
                    text = prompt_text + out.text if echo else out.text
                    choice = {"index": i, "text": text, "logprobs": logprobs_of(out, 0, 0)}
                choices.append(choice | {"finish_reason": out.finish_reason})
            generated = sum(len(out.token_ids) for out in finals)  # all best_of sequences were computed
            return {"id": request_id, "object": kind, "created": created, "model": body.model, "choices": choices,
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": generated,
                              "total_tokens": n_prompt + generated}}

        async def events() -> AsyncIterator[str]:
            chunk_kind = kind + (".chunk" if chat else "")
            offsets = dict.fromkeys(range(params.n), 0)  # completions' text_offset, per choice
            ended: set[int] = set()  # the choices whose last chunk was sent
            try:
                for i in range(params.n):  # chat's first chunk names the role, as OpenAI's does; echo's is the prompt
                    if chat:
                        yield _sse(request_id, chunk_kind, created, body.model,
                                   {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
                    elif echo:
                        yield _sse(request_id, chunk_kind, created, body.model,
                                   {"index": i, "text": prompt_text, "logprobs": None, "finish_reason": None})
                async for out in state.outputs(request_id, waiter, http):  # choice i: the request's sequence i
                    if out.new_text or out.finished or (wanted and out.new_token_ids):
                        first = len(out.token_ids) - len(out.new_token_ids)
                        lp = logprobs_of(out, first, offsets.get(out.index, 0))
                        offsets[out.index] = offsets.get(out.index, 0) + len(out.new_text)
                        if chat:
                            choice = {"index": out.index, "delta": {"content": out.new_text}}
                            choice |= {"logprobs": lp} if wanted else {}
                        else:
                            choice = {"index": out.index, "text": out.new_text, "logprobs": lp}
                        yield _sse(request_id, chunk_kind, created, body.model,
                                   choice | {"finish_reason": out.finish_reason if out.finished else None})
                    if out.finished:
                        ended.add(out.index)
                yield "data: [DONE]\n\n"
            except ShutdownError:  # the shutdown limit (`AsyncEngine.end_all`): open choices end "abort", as vLLM's
                for i in sorted(set(range(params.n)) - ended):
                    empty = {"delta": {}} if chat else {"text": "", "logprobs": None}
                    yield _sse(request_id, chunk_kind, created, body.model,
                               {"index": i, **empty, "finish_reason": "abort"})
                yield "data: [DONE]\n\n"
            except APIError as exc:  # the engine failed on this request: say so in the stream, then end it
                yield f"data: {json.dumps(exc.body())}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # also when the client disconnects mid-stream (the generator is closed)
                state.release(request_id)

        return StreamingResponse(events(), media_type="text/event-stream")

    def described(model: type[BaseModel]) -> dict:
        """The body's schema for /docs: the handlers read the body themselves (off the loop), so FastAPI cannot
        see it in their signatures."""
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema(
            ref_template="#/components/schemas/{model}")}}}}

    @app.post("/v1/completions", openapi_extra=described(CompletionRequest))
    async def completions(http: Request) -> Any:
        return await run(CompletionRequest, http, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=described(ChatCompletionRequest))
    async def chat_completions(http: Request) -> Any:
        return await run(ChatCompletionRequest, http, chat=True)

    return app


def check_adapter_names(engine: Any, model_name: str) -> None:
    """Refuse (ValueError) a LoRA adapter named like the served model: a request naming it would get the base model,
    so the adapter could never be reached. Warn when an adapter says it was trained on another base model
    (adapter_config.json's base_model_name_or_path): names differ legitimately (a local folder, a renamed copy), so
    it is served anyway, but a wrong base model gives fluent nonsense rather than an error."""
    if model_name in getattr(engine, "lora_modules", {}):
        raise ValueError(f"the LoRA adapter {model_name!r} has the served model's name, so no request could reach "
                         "it (that name picks the base model): give the adapter another name in --lora-modules.")
    slots = getattr(engine, "lora_slots", None)
    for name, adapter in (slots.adapters.items() if slots is not None else ()):
        base = adapter.base_model
        if base and model_name not in (base, str(base).rstrip("/").split("/")[-1]):
            log.warning("LoRA adapter %r was trained on %r (its base_model_name_or_path), and this server serves %r: "
                        "if that is another model, its outputs will be nonsense.", name, base, model_name)


def token_strings(tokenizer: Any, ids: list[int]) -> list[str]:
    """How each token reads on its own (OpenAI's "token"): a byte-level piece may be half a character (then it
    shows as U+FFFD); without a tokenizer, the id."""
    if tokenizer is None:
        return [str(i) for i in ids]
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def completion_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float], tops: list[dict[int, float]],
                        offset: int) -> dict:
    """The completions API's logprobs object: tokens, token_logprobs, top_logprobs ({token: logprob}, the most
    likely first), text_offset (each token's start in the choice's text, from `offset`)."""
    tokens = token_strings(tokenizer, ids)
    starts = [offset + sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": logprobs, "text_offset": starts,
            "top_logprobs": [dict(zip(token_strings(tokenizer, list(top)), top.values())) for top in tops]}


def chat_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float], tops: list[dict[int, float]]) -> dict:
    """The chat API's logprobs object: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}, ...]}, ...]}."""
    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [entry(text, lp) | {"top_logprobs": [entry(t, v) for t, v in zip(token_strings(
        tokenizer, list(top)), top.values())]} for text, lp, top in zip(token_strings(tokenizer, ids), logprobs, tops)]}


def _sse(request_id: str, kind: str, created: int, model: str, choice: dict) -> str:
    """One server-sent event carrying one chunk."""
    chunk = {"id": request_id, "object": kind, "created": created, "model": model, "choices": [choice]}
    return f"data: {json.dumps(chunk)}\n\n"


def build_engine(model: str, device: str = "cpu", dtype: str = "auto", quant: str | None = None,
                 speculative_model: str | None = None, num_speculative_tokens: int | None = None,
                 enforce_eager: bool = False, disaggregate: bool = False,
                 **engine_kwargs: Any) -> LLMEngine | DisaggregatedEngine:
    """The engine `minillm serve` runs, from its flags: `model` (a shipped name or a folder) in `dtype` ("auto":
    fp32 on a CPU, the checkpoint's dtype on a GPU), quantised by `quant` (chapter 06); speculative decoding with
    `speculative_model` (a model of the same vocabulary, or "[ngram]" for prompt lookup, chapter 07) and
    `num_speculative_tokens` drafts a step; `enforce_eager` turns CUDA graphs off; the rest goes to
    `LLMEngine` (block_size, enable_prefix_caching, kv_cache_memory_bytes, ...). With `disaggregate`, a
    `DisaggregatedEngine` (chapter 08) whose prefill and decode workers both get those engine settings.
    Impossible combinations raise a ValueError that says why, before anything is served."""
    from minillm.checkpoints import load

    if num_speculative_tokens is not None and speculative_model is None:
        raise ValueError("--num-speculative-tokens needs --speculative-model (a draft model, or [ngram]).")
    if disaggregate:
        check_disaggregate(device, quant, speculative_model, engine_kwargs)
    llm, tokenizer = load(model, device=device, dtype=None if dtype == "auto" else dtype)
    if disaggregate:  # tensor_parallel_size and kv_cache_dtype are checked to be the defaults
        from minillm.parallel.disagg import DisaggregatedEngine

        worker = {k: v for k, v in engine_kwargs.items()
                  if k not in ("tensor_parallel_size", "kv_cache_dtype", "lora_modules", "max_loras", "max_lora_rank")}
        worker |= {"cuda_graphs": False} if enforce_eager else {}
        return DisaggregatedEngine(llm, tokenizer, prefill=worker, decode=dict(worker))
    if quant:
        from minillm.quant import quantize_by_name

        quantize_by_name(llm, quant, tokenizer)
    speculative = None
    if speculative_model is not None:
        k = 4 if num_speculative_tokens is None else num_speculative_tokens
        if speculative_model == "[ngram]":
            drafter = NgramDrafter()
        else:
            draft, _ = load(speculative_model, device=device, dtype=llm.dtype)
            drafter = DraftModelDrafter(draft)  # LLMEngine refuses a draft of another vocabulary
        speculative = SpeculativeConfig(drafter, k)
    cuda_graphs = False if enforce_eager else None
    config = EngineConfig(speculative=speculative, cuda_graphs=cuda_graphs, **engine_kwargs)
    return LLMEngine(llm, tokenizer, config, group=start_group(llm, config))  # a tensor-parallel group, if asked


def check_disaggregate(device: str, quant: str | None, speculative_model: str | None, engine_kwargs: dict) -> None:
    """Refuse (one ValueError) the flags `--disaggregate` cannot honour: each worker runs a plain `LLMEngine` that
    rebuilds the model from its weights, and on CUDA the two workers need a GPU each."""
    refused = {
        "speculative decoding (--speculative-model)": speculative_model is not None,
        "quantised weights (--quant)": quant is not None,
        "tensor parallelism (--tensor-parallel-size > 1)": engine_kwargs.get("tensor_parallel_size", 1) != 1,
        "LoRA adapters (--lora-modules)": bool(engine_kwargs.get("lora_modules")),
        f"a quantised KV cache (--kv-cache-dtype {engine_kwargs.get('kv_cache_dtype')})":
            engine_kwargs.get("kv_cache_dtype", "auto") != "auto",
    }
    bad = [what for what, asked in refused.items() if asked]
    if bad:
        raise ValueError(f"--disaggregate runs a plain engine in each of its two workers, without {' or '.join(bad)}: "
                         f"drop {'it' if len(bad) == 1 else 'them'}, or serve without --disaggregate.")
    if device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < 2:
            raise ValueError(f"--disaggregate on CUDA needs two GPUs (prefill on cuda:0, decode on cuda:1), and "
                             f"PyTorch sees {torch.cuda.device_count()}: serve without it, or with --device cpu.")


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it may be reachable from elsewhere
        return False


def serve(model: str = "shakespeare-11m", host: str = "127.0.0.1", port: int = 8000, max_queue: int = 256,
          api_key: str | None = None, served_model_name: str | None = None,
          metrics_require_api_key: bool = False, shutdown_timeout: float | None = 30,
          max_body_bytes: int = 16 * 2**20, timeout_keep_alive: float = 5, limit_concurrency: int | None = 1024,
          **engine_options: Any) -> None:
    """Serve `model` (a shipped name or a folder) until interrupted (`minillm serve`): the engine from
    `build_engine(model, **engine_options)`, as `served_model_name` (default: the folder's name), asking
    for `api_key` on /v1/ routes if given. Warns when a non-loopback address is served without a key. On SIGTERM
    (or Ctrl-C) the open streams get `shutdown_timeout` seconds to finish (None: as long as they take), and those still
    open then end with a last chunk whose finish_reason is "abort" (`AsyncEngine.drain`). An idle
    connection is closed after `timeout_keep_alive` seconds; past `limit_concurrency` open connections and tasks,
    uvicorn answers 503 at once (None: no limit), so that idle or slow clients cannot hold every socket."""
    engine = build_engine(model, **engine_options)
    try:
        name = served_model_name or str(model).rstrip("/").split("/")[-1]
        app = create_app(engine, name, max_queue, api_key=api_key, metrics_require_api_key=metrics_require_api_key,
                         max_body_bytes=max_body_bytes)
        if api_key is None and not is_loopback(host):
            log.warning(
                "serving on %s without an API key: anyone who can reach port %d can generate. Set --api-key (or "
                "MINILLM_API_KEY), or serve on 127.0.0.1.", host, port)
        # On SIGTERM, open streams get shutdown_timeout seconds to finish; then they end with finish_reason "abort".
        run_uvicorn(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=shutdown_timeout,
                    timeout_keep_alive=timeout_keep_alive, limit_concurrency=limit_concurrency)
    finally:
        # The app's shutdown stops the engine's workers (after it uvicorn raises a SIGTERM again, so no code runs
        # here then); this stops them when the server never started (a port in use, an empty API key).
        engine.shutdown()


def run_uvicorn(app: FastAPI, **options: Any) -> None:
    """Serve `app` as `uvicorn.run(app, **options)` does, except that the graceful shutdown (SIGTERM, Ctrl-C) tells the
    app as it begins (`AsyncEngine.drain`): uvicorn waits timeout_graceful_shutdown seconds for the open responses,
    then cancels them mid-stream, and only then runs the app's own shutdown, too late for a last event."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: list | None = None) -> None:
            app.state.engine.drain(self.config.timeout_graceful_shutdown)
            await super().shutdown(sockets)

    server = DrainingServer(uvicorn.Config(app, **options))
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(3)  # as uvicorn.run: the server could not start (a port in use, say), and uvicorn logged why


@contextlib.contextmanager
def serve_in_background(model: str = "shakespeare-11m", timeout_s: float = 60, env: dict[str, str] | None = None,
                        **options: Any) -> Iterator[str]:
    """Run `minillm serve` in its own process on a free port of 127.0.0.1; yield its URL once /health answers,
    and stop it (SIGTERM) when the block ends. options: the command's flags, e.g. max_num_seqs=16 for
    --max-num-seqs=16, enforce_eager=True for --enforce-eager, enable_prefix_caching=False for
    --no-enable-prefix-caching, a list for a flag of several values (lora_modules=["a=path"]); env: environment
    variables to add (e.g. MINILLM_API_KEY).

        with serve_in_background("shakespeare-1m", max_num_seqs=16) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    """
    import socket
    import subprocess

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flags = []
    for key, value in options.items():
        flag = key.replace("_", "-")
        if isinstance(value, (list, tuple)):  # a flag of several values: lora_modules=["a=path", ...]
            flags += [f"--{flag}", *map(str, value)]
        else:
            flags.append(f"--{flag}" if value is True else f"--no-{flag}" if value is False else f"--{flag}={value}")
    command = [sys.executable, "-m", "minillm.cli", "serve", "--model", model, "--port", str(port), *flags]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).text == "ok":
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"minillm serve did not answer /health within {timeout_s:g} s; its output:\n"
                                   + proc.communicate()[0][-2000:])
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
