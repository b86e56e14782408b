"""A server no tenant can stall or poison (issue 55): what one client sends must not hurt another.

Each test here failed before its fix: an adapter of NaN weights was served (its rows sampled NaN logits, and the
batch's shared draw failed every request beside them), an adapter named like the base model was unreachable, and
the small items below gave a 500, an obscure error or a silent "first one wins".
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

import minillm
from minillm.engine import LLMEngine
from minillm.lora import LoRAAdapter, load_adapter, save_adapter, target_rows

pytest.importorskip("fastapi", reason="the server needs FastAPI")

MODEL = "shakespeare-1m"


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return minillm.load(MODEL)


def small_adapter(config, base_model: str | None = MODEL, rank: int = 2) -> LoRAAdapter:
    """A random rank-2 adapter on q_proj of every layer."""
    torch.manual_seed(0)
    rows = target_rows(config)["q_proj"]
    weights = {(layer, "q_proj"): (0.01 * torch.randn(rank, rows[3]), 0.01 * torch.randn(rows[2], rank))
               for layer in range(config.n_layers)}
    return LoRAAdapter(rank, 2.0 * rank, weights, base_model=base_model)


# ---------------------------------------------------------------------- 1. LoRA adapters that would poison a batch
def test_an_adapter_with_a_nan_weight_is_refused_at_load_naming_the_tensor(model_and_tokenizer, tmp_path):
    config = model_and_tokenizer[0].config
    adapter = small_adapter(config)
    adapter.weights[1, "q_proj"][1][3, 0] = float("nan")  # one value of layer 1's B
    folder = save_adapter(adapter, tmp_path / "nan")
    with pytest.raises(ValueError, match=r"layer 1 q_proj lora_B holds 1 NaN or infinite"):
        load_adapter(folder, config)


def test_an_adapter_with_a_non_finite_alpha_is_refused_at_load(model_and_tokenizer, tmp_path):
    config = model_and_tokenizer[0].config
    folder = save_adapter(small_adapter(config), tmp_path / "alpha")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(cfg | {"lora_alpha": float("inf")}))  # writes Infinity
    with pytest.raises(ValueError, match=r"lora_alpha is inf, not a finite number"):
        load_adapter(folder, config)


def test_an_adapter_built_in_memory_is_checked_when_it_is_registered(model_and_tokenizer):
    """add_lora takes a LoRAAdapter object without load_adapter's checks: registering it checks it too."""
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, max_num_seqs=2)
    bad = small_adapter(model.config)
    bad.weights[0, "q_proj"][0][0, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"'infinite': layer 0 q_proj lora_A holds 1 NaN or infinite"):
        engine.add_lora("infinite", bad)
    wrong = small_adapter(model.config)
    a, b = wrong.weights[0, "q_proj"]
    wrong.weights[0, "q_proj"] = (a[:, :-1], b)  # one input column short: another model's width
    with pytest.raises(ValueError, match=r"'narrow': layer 0 q_proj has A .* this model needs A"):
        engine.add_lora("narrow", wrong)
    assert "infinite" not in engine.lora_modules and "narrow" not in engine.lora_modules


def test_an_adapter_named_like_the_served_model_is_refused(model_and_tokenizer):
    from minillm.entrypoints.server import create_app

    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, max_num_seqs=2, lora_modules={MODEL: small_adapter(model.config)})
    with pytest.raises(ValueError, match=r"has the served model's name, so no request could reach it"):
        create_app(engine, MODEL)


def test_an_adapter_of_another_base_model_is_served_with_a_warning(model_and_tokenizer, caplog):
    from minillm.entrypoints.server import create_app

    model, tokenizer = model_and_tokenizer
    adapters = {"same": small_adapter(model.config, base_model=f"/models/{MODEL}/"),
                "other": small_adapter(model.config, base_model="meta-llama/Llama-3.2-1B")}
    engine = LLMEngine(model, tokenizer, max_num_seqs=2, lora_modules=adapters)
    with caplog.at_level(logging.WARNING, logger="minillm"):
        create_app(engine, MODEL)
    warned = [r.getMessage() for r in caplog.records if "base_model_name_or_path" in r.getMessage()]
    assert len(warned) == 1 and "'other'" in warned[0] and "Llama-3.2-1B" in warned[0], warned


# ---------------------------------------------------------------------- a served app, with an API key
KEY = "sesame"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(model_and_tokenizer):
    from types import SimpleNamespace

    from conftest import served_in_thread

    from minillm.entrypoints.server import create_app

    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, max_num_seqs=8, max_num_batched_tokens=128)
    app = create_app(engine, MODEL, max_queue=32, api_key=KEY)
    with served_in_thread(app, log_level="critical") as url:
        yield SimpleNamespace(url=url, engine=engine, state=app.state.engine)


def post(server, body: dict, endpoint: str = "completions", **kwargs):
    import httpx

    headers = [*kwargs.pop("headers", AUTH.items()), ("content-type", "application/json")]
    # json.dumps writes "\ud800" as its escape, as any client may (httpx's json= would refuse to encode it)
    return httpx.post(f"{server.url}/v1/{endpoint}", content=json.dumps(body), headers=headers, timeout=60, **kwargs)


def error_of(response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, response.text[:500]
    return error


def assert_still_serving(server) -> None:
    import time

    import httpx

    deadline = time.time() + 20
    while server.engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").status_code == 200
    assert not server.engine.has_unfinished_requests() and server.engine.cache.allocator.num_used_blocks == 0
    done = post(server, {"model": MODEL, "prompt": "ROMEO.\n", "max_tokens": 3, "temperature": 0})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3, done.text


# ---------------------------------------------------------------------- 2. small items
@pytest.mark.parametrize("endpoint, body, where", [
    ("completions", {"prompt": "ROMEO \ud800"}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "A"}, {"role": "user", "content": "\udfff x"}]},
     "messages.1.content"),
    ("completions", {"prompt": "A", "stop": ["\ud83d"]}, "stop.0"),
    ("completions", {"prompt": "A", "model": "\ud800"}, "model"),  # it would be echoed in the 404's message
])
def test_a_lone_surrogate_is_a_400_naming_where_it_is(server, endpoint, body, where):
    error = error_of(post(server, {"model": MODEL, "max_tokens": 2, **body}, endpoint), 400)
    assert f"{where} holds a lone UTF-16 surrogate" in error["message"] and "whole characters" in error["message"]
    assert_still_serving(server)


@pytest.mark.parametrize("prompt", [[True], [1, False, 2]])
def test_booleans_are_not_token_ids(server, prompt):
    error = error_of(post(server, {"model": MODEL, "prompt": prompt, "max_tokens": 2}), 400)
    assert "prompt" in error["message"], error
    assert_still_serving(server)


@pytest.mark.parametrize("keys", [(KEY, "wrong"), ("wrong", KEY), (KEY, KEY)])
def test_two_authorization_headers_are_refused_whichever_comes_first(server, keys):
    headers = [("authorization", f"Bearer {k}") for k in keys]
    error = error_of(post(server, {"model": MODEL, "prompt": "A", "max_tokens": 2}, headers=headers), 401)
    assert "several Authorization headers" in error["message"] and "exactly one" in error["message"]


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_the_api_description_asks_for_the_key(server, path):
    import httpx

    assert "no API key" in error_of(httpx.get(server.url + path), 401)["message"]
    assert httpx.get(server.url + path, headers=AUTH).status_code == 200


def test_eval_limit_must_be_positive(capsys):
    from minillm.cli import main

    for bad in ("-1", "0"):
        with pytest.raises(SystemExit) as exit_:
            main(["eval", "--limit", bad])
        assert exit_.value.code == 2
        assert "--limit: must be positive" in capsys.readouterr().err


def test_regex_dfa_asks_for_a_pattern_string():
    from minillm.sampler.constrained import RegexDFA

    with pytest.raises(TypeError, match=r"a regular expression is a pattern string.*not int 5"):
        RegexDFA(5)


# ---------------------------------------------------------------------- 3. big bodies do not stall the event loop
def hostile_bodies() -> list[tuple[str, bytes]]:
    """Bodies under the 16 MiB limit that took the event loop seconds to parse, validate and template."""
    ids = json.dumps({"model": MODEL, "prompt": [5] * 3_000_000})  # 3 M token ids, 9 MB
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "A"}] * 400_000})  # 12 MB
    stops = json.dumps({"model": MODEL, "prompt": "A", "stop": [f"s{i}" for i in range(100_000)]})
    return [("completions", ids.encode()), ("chat/completions", chat.encode()), ("completions", stops.encode())]


def test_big_bodies_are_parsed_off_the_event_loop(server):
    """While three hostile bodies are parsed and refused, /health keeps answering within a second."""
    import threading
    import time

    import httpx

    bodies = hostile_bodies()
    answers: list[httpx.Response] = []

    def send(endpoint: str, body: bytes) -> None:
        answers.append(httpx.post(f"{server.url}/v1/{endpoint}", content=body, timeout=120,
                                  headers={**AUTH, "content-type": "application/json"}))

    threads = [threading.Thread(target=send, args=b) for b in bodies]
    for t in threads:
        t.start()
    slowest = 0.0
    polls = 0
    while any(t.is_alive() for t in threads):
        start = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        slowest = max(slowest, time.perf_counter() - start)
        polls += 1
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert slowest < 1.0, f"/health took {slowest:.2f} s while big bodies were in flight ({polls} polls)"
    for response in answers:  # each one refused with what to do, none a 500
        error_of(response, 400)
    assert_still_serving(server)


@pytest.mark.parametrize("field, value, says", [
    ("stop", [f"s{i}" for i in range(65)], "stop has 65 items, more than this server's limit of 64 stop strings"),
    ("stop", ["x" * 1025], "a stop string has 1,025 characters, more than this server's limit of 1024"),
    ("prompt", [5] * 100_000, "prompt has 100,000 items, more than the model's context of"),
    ("messages", [{"role": "user", "content": "A"}] * 100_000, "messages has 100,000 items, more than the model's"),
])
def test_lists_past_what_a_request_can_use_are_refused_saying_the_limit(server, field, value, says):
    endpoint = "chat/completions" if field == "messages" else "completions"
    body = {"model": MODEL, "max_tokens": 2, "prompt": "A", "messages": [{"role": "user", "content": "A"}]}
    error = error_of(post(server, body | {field: value}, endpoint), 400)
    assert says in error["message"] and error["param"] == field, error


# ---------------------------------------------------------------------- 4. timeouts, a connection cap, a quiet log
def test_serve_closes_idle_connections_and_caps_them(monkeypatch):
    from minillm.entrypoints.server import serve

    seen = {}
    # no socket is opened
    monkeypatch.setattr("minillm.entrypoints.server.run_uvicorn", lambda app, **kwargs: seen.update(kwargs))
    serve(MODEL)
    assert seen["timeout_keep_alive"] == 5 and seen["limit_concurrency"] == 1024, seen
    serve(MODEL, timeout_keep_alive=2.5, limit_concurrency=None)
    assert seen["timeout_keep_alive"] == 2.5 and seen["limit_concurrency"] is None


def test_the_serve_command_passes_its_timeout_and_cap_flags(monkeypatch):
    import minillm.entrypoints.server as server_module
    from minillm.cli import main

    seen = {}
    monkeypatch.setattr(server_module, "serve", lambda *args, **kwargs: seen.update(kwargs))
    assert main(["serve", "--timeout-keep-alive", "2", "--limit-concurrency", "0"]) == 0
    assert seen["timeout_keep_alive"] == 2 and seen["limit_concurrency"] is None, "0 means no limit"
    assert main(["serve"]) == 0
    assert seen["timeout_keep_alive"] == 5 and seen["limit_concurrency"] == 1024


def test_a_repeated_error_line_is_logged_a_few_times_then_counted():
    from minillm.entrypoints.server import RepeatFilter

    records = []
    logger = logging.getLogger("minillm.test_repeat_filter")
    logger.propagate = False
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    logger.addFilter(RepeatFilter(first=3, every=10))
    try:
        for i in range(25):
            try:
                raise RuntimeError("poisoned step")
            except RuntimeError as exc:
                logger.error("a step failed (%s); failing request %s", exc, f"cmpl-{i}", exc_info=exc)
        logger.error("another line")
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records]
    assert len(lines) == 3 + 2 + 1, lines  # the first 3, the 10th and 20th with their count, the other line
    assert lines[3].endswith("[repeated 10 times; logging one in 10]") and records[3].exc_info is None
    assert lines[-1] == "another line"


# ---------------------------------------------------------------------- 5. json_object compiled once, at start-up
def index_builds(monkeypatch) -> list[str]:
    """The patterns of every TokenIndex built from now on (TokenIndex.__init__ wrapped), in order."""
    from minillm.sampler.constrained import TokenIndex

    built: list[str] = []
    original = TokenIndex.__init__

    def counting(index: TokenIndex, dfa, *args, **kwargs) -> None:
        built.append(dfa.pattern)
        original(index, dfa, *args, **kwargs)

    monkeypatch.setattr(TokenIndex, "__init__", counting)
    return built


def test_json_object_is_built_at_start_up_and_never_again(model_and_tokenizer, monkeypatch):
    """response_format json_object compiled its pattern at the first request that asked (1-2 s, under a time budget
    that a loaded machine could fail), and 64 other schemas pushed it out of the cache. Now the app builds its token
    index as it starts, before answering anything, and no request builds it again."""
    from types import SimpleNamespace

    from conftest import served_in_thread

    from minillm.entrypoints.server import JSON_OBJECT, create_app
    from minillm.sampler.constrained import schema_to_regex

    built = index_builds(monkeypatch)
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, max_num_seqs=4)
    app = create_app(engine, MODEL, api_key=KEY)
    assert built == [], "nothing is compiled before the app starts"
    with served_in_thread(app, log_level="critical") as url:
        assert built == [JSON_OBJECT], "the start-up built json_object's index"
        served = SimpleNamespace(url=url)
        for seed in range(2):
            chat = post(served, {"model": MODEL, "messages": [{"role": "user", "content": "Speak."}], "seed": seed,
                                 "max_tokens": 12, "response_format": {"type": "json_object"}}, "chat/completions")
            assert chat.status_code == 200, chat.text
            assert chat.json()["choices"][0]["message"]["content"].startswith("{"), chat.text
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
        response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        done = post(served, {"model": MODEL, "prompt": "A", "max_tokens": 8, "response_format": response_format})
        assert done.status_code == 200, done.text
    assert built == [JSON_OBJECT, schema_to_regex(schema)], "json_object was not compiled again; the schema was"


def test_the_compiled_schemas_are_kept_within_a_size_not_only_a_count(model_and_tokenizer, monkeypatch):
    """An index holds states x vocabulary cells, so 64 kept schemas could hold gigabytes: past MAX_SCHEMA_CELLS the
    oldest are dropped (and compiled again if asked again), never the one just built."""
    from types import SimpleNamespace

    from conftest import served_in_thread

    import minillm.entrypoints.server as server

    built = index_builds(monkeypatch)
    monkeypatch.setattr(server, "MAX_SCHEMA_CELLS", 1)  # room for the newest index alone
    model, tokenizer = model_and_tokenizer
    app = server.create_app(LLMEngine(model, tokenizer, max_num_seqs=4), MODEL, api_key=KEY)
    schemas = [{"type": "object", "properties": {name: {"type": "boolean"}}} for name in ("a", "b", "a")]
    with served_in_thread(app, log_level="critical") as url:
        for schema in schemas:
            response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            done = post(SimpleNamespace(url=url), {"model": MODEL, "prompt": "A", "max_tokens": 4,
                                                   "response_format": response_format})
            assert done.status_code == 200, done.text
    assert len(built) == 1 + 3, "json_object at start-up, then a, b, and a again (dropped for b)"


# ---------------------------------------------------------------------- 6. streams end with an event at shutdown
def test_a_stream_open_at_the_shutdown_limit_gets_a_last_event(tmp_path):
    """`minillm serve --shutdown-timeout 2` and SIGTERM while a long stream runs: uvicorn used to cancel the stream at
    the limit mid-chunk (no finish_reason, no [DONE]: a client cannot tell a cut from a network fault). Now the app
    ends it just before the limit: a last chunk with finish_reason "abort" for each choice, then [DONE], and the
    process exits. The 11M model, because 1m's 1,000 tokens can come within the limit on an idle machine."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "minillm.cli", "serve", "--model", minillm.DEFAULT_MODEL,
                             "--port", str(port), "--shutdown-timeout", "2"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while not _answers(url + "/health"):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()[-2000:]
            time.sleep(0.2)
        body = {"model": minillm.DEFAULT_MODEL, "prompt": "ROMEO.\n", "max_tokens": 1000, "ignore_eos": True,
                "n": 2, "stream": True}
        events, cut, signalled = [], None, None
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                    if len(events) == 4 and signalled is None:
                        proc.send_signal(signal.SIGTERM)
                        signalled = time.perf_counter()
        except httpx.HTTPError as exc:  # the stream was cut
            cut = exc
        ended_after = time.perf_counter() - signalled
        assert cut is None, f"the stream was cut after {len(events)} events, {ended_after:.1f} s after SIGTERM: {cut!r}"
        assert events[-1] == "[DONE]", events[-3:]
        last = [json.loads(e)["choices"][0] for e in events[-3:-1]]
        assert [(c["index"], c["finish_reason"], c["text"]) for c in last] == [(0, "abort", ""), (1, "abort", "")], last
        streamed = [json.loads(e)["choices"][0] for e in events[:-3]]
        assert all(c["finish_reason"] is None for c in streamed) and len(streamed) < 2000, "it ended before its end"
        # it ran on until the margin before the 2 s limit (1.5 s), not ending at once; late is fine (a loaded
        # machine), a cut is not
        assert ended_after > 1.0, f"it ended {ended_after:.2f} s after SIGTERM, long before the 2 s limit"
        assert proc.wait(timeout=30) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False


# ---------------------------------------------------------------------- 7. a NaN row fails only its own request
def poisoned_engine(model_and_tokenizer, **kwargs) -> LLMEngine:
    """An engine serving the LoRA adapter "poison", made NaN in memory after registration checked it (what a bug or a
    bit flip could do): its rows' logits are NaN."""
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, lora_modules={"poison": small_adapter(model.config)}, **kwargs)
    engine.lora_slots.adapters["poison"].weights[0, "q_proj"][1].fill_(float("nan"))
    return engine


def test_a_request_of_nan_logits_gets_an_error_and_the_stream_beside_it_completes(model_and_tokenizer):
    """The server's side of tests/engine/test_nan_rows.py: the step failed, so the stream beside the poisoned request
    got an error event too. Now the poisoned request gets a 500 saying why, and the stream runs to its end."""
    import threading
    import time

    import httpx
    from conftest import served_in_thread

    from minillm.entrypoints.server import create_app

    engine = poisoned_engine(model_and_tokenizer, max_num_seqs=4)
    with served_in_thread(create_app(engine, MODEL), log_level="critical") as url:
        lines: list[str] = []

        def stream() -> None:
            body = {"model": MODEL, "prompt": "ROMEO.\n", "max_tokens": 64, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                lines.extend(line for line in response.iter_lines() if line.startswith("data: "))

        healthy = threading.Thread(target=stream)
        healthy.start()
        while not lines and healthy.is_alive():  # the stream runs: the poisoned request joins its steps
            time.sleep(0.01)
        poisoned = httpx.post(url + "/v1/completions", json={"model": "poison", "prompt": "JULIET.\n",
                                                             "max_tokens": 16}, timeout=60)
        healthy.join()
        assert lines[-1] == "data: [DONE]", lines[-3:]
        chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        assert all("error" not in c for c in chunks), f"the healthy stream failed too: {chunks[-1]}"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and len(chunks) == 64, "every token came"
        error = error_of(poisoned, 500)
        assert error["code"] == "engine_error" and "NaN or infinite" in error["message"], error
        assert not engine.has_unfinished_requests() and engine.cache.allocator.num_used_blocks == 0


def test_a_tokenizer_constrained_decoding_cannot_use_still_serves(model_and_tokenizer, monkeypatch, caplog):
    """json_object's start-up build must not stop a server whose tokenizer is not byte-level: it serves, warns once,
    and response_format gets the 400 it got before."""
    from types import SimpleNamespace

    from conftest import served_in_thread

    from minillm.entrypoints.server import create_app
    from minillm.sampler.constrained import token_index

    def not_byte_level(tokenizer):
        raise ValueError("constrained decoding needs a byte-level BPE tokenizer; this one decodes with Metaspace.")

    monkeypatch.setattr(token_index, "vocabulary_bytes", not_byte_level)
    model, tokenizer = model_and_tokenizer
    with caplog.at_level(logging.WARNING, logger="minillm"):
        with served_in_thread(create_app(LLMEngine(model, tokenizer, max_num_seqs=2), MODEL, api_key=KEY),
                              log_level="critical") as url:
            served = SimpleNamespace(url=url)
            error = error_of(post(served, {"model": MODEL, "prompt": "A", "max_tokens": 4,
                                           "response_format": {"type": "json_object"}}), 400)
            assert "byte-level BPE tokenizer" in error["message"] and error["param"] == "response_format", error
            done = post(served, {"model": MODEL, "prompt": "A", "max_tokens": 4})
            assert done.status_code == 200, done.text
    assert "response_format will be refused" in caplog.text
