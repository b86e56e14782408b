"""No single request can take `minillm serve` down, and every error it returns is in OpenAI's shape (issue 28).

Each probe was a way to stop the service at c2e1d62: a parameter the engine cannot hold (top_k or seed of 2**70)
killed the engine's background loop, a 47 MB prompt blocked the event loop while it was tokenised, and some
errors came back as FastAPI's {"detail": ...}. After each probe here the server must answer /health, hold no
request and no KV block, and serve the next request.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai", reason="the server tests call it with the official openai client")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from conftest import served_in_thread  # noqa: E402

import minillm  # noqa: E402
from minillm.engine import LLMEngine  # noqa: E402
from minillm.entrypoints.server import create_app, serve  # noqa: E402

MODEL = "shakespeare-1m"
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server():
    model, tok = minillm.load(MODEL)
    engine = LLMEngine(model, tok, max_num_seqs=8, max_num_batched_tokens=128)
    app = create_app(engine, MODEL, max_queue=32, max_body_bytes=BODY_LIMIT)
    with served_in_thread(app, log_level="critical") as url:
        yield SimpleNamespace(url=url, engine=engine, state=app.state.engine,
                              client=openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60))


def assert_still_serving(server) -> None:
    """The server answers /health, holds no request and no KV block, and completes a request."""
    deadline = time.time() + 20
    while server.engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").status_code == 200, "the engine loop stopped"
    assert not server.engine.has_unfinished_requests() and server.engine.cache.allocator.num_used_blocks == 0
    done = server.client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, f"not OpenAI's error shape: {response.text}"
    if param is not None:
        assert error["param"] == param or param in error["message"], error
    return error


@pytest.mark.parametrize("field", ["top_k", "seed"])
def test_a_parameter_the_engine_cannot_hold_is_refused_before_anything_is_queued(server, field):
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "A", field: 2**70})
    error = assert_openai_error(response, 400)
    assert field in error["message"], f"the error must name {field}: {error['message']}"
    assert_still_serving(server)


@pytest.mark.parametrize("body, content_type", [
    (b'{"model": "shakespeare-1m", "prompt": "\xff\xfe"}', "application/json"),  # not UTF-8
    (b"[" * 10_000 + b"]" * 10_000, "application/json"),  # nested deeper than a parser's recursion
    (b"not json", "application/json"),
])
def test_bodies_that_do_not_parse_get_a_400_in_openais_shape(server, body, content_type):
    response = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": content_type})
    assert_openai_error(response, 400)
    assert_still_serving(server)


def test_unknown_routes_and_methods_get_openais_shape(server):
    assert "no route" in assert_openai_error(httpx.get(server.url + "/v1/embeddings"), 404)["message"]
    assert_openai_error(httpx.get(server.url + "/v1/completions"), 405)


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    prompt = "ROMEO. " * (BODY_LIMIT // 7 + 10)
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert "limit" in assert_openai_error(response, 413)["message"]
    assert_still_serving(server)


def test_a_prompt_longer_than_the_context_could_hold_is_refused_before_tokenising(server, monkeypatch):
    tokenizer = server.engine.tokenizer
    lengths = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: lengths.append(len(text)) or encode(text, *a, **k))
    prompt = "x" * (server.state.max_prompt_chars + 1)  # under the body limit: refused by its length alone
    assert len(prompt) < BODY_LIMIT
    error = assert_openai_error(httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt}),
                                400, "prompt")
    assert "context" in error["message"] and len(prompt) not in lengths, "refused without tokenising it"
    assert_still_serving(server)


@pytest.mark.parametrize("endpoint, field, value", [
    ("completions", "suffix", "END"),
    ("completions", "response_format", {"type": "json_schema"}),
    ("completions", "response_format", {"type": "xml"}),
    ("chat/completions", "top_logprobs", 3),  # without logprobs: true
])
def test_openai_fields_not_implemented_are_refused_by_name_not_ignored(server, endpoint, field, value):
    body = {"model": MODEL, "prompt": "A", "messages": [{"role": "user", "content": "A"}], field: value}
    response = httpx.post(server.url + f"/v1/{endpoint}", json=body)
    assert assert_openai_error(response, 400)["param"] == field
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "A", "echo": True,
                                                                 "logprobs": 1})
    assert "echo" in assert_openai_error(response, 400)["message"], "echo needs the prompt's logprobs: refused"


def test_logprobs_are_the_engines_in_openais_shapes_streaming_or_not(server):
    from minillm.sampler.sampling import SamplingParams

    offline = minillm.LLM(server.engine.model, server.engine.tokenizer).generate(
        "ROMEO.\n", SamplingParams(max_tokens=6, temperature=0, logprobs=2), use_tqdm=False)[0]
    done = server.client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=6, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(offline.logprobs, abs=1e-4)
    assert len(lp.tokens) == 6 and all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == done.choices[0].text
    streamed = [c.choices[0].logprobs for c in server.client.completions.create(
        model=MODEL, prompt="ROMEO.\n", max_tokens=6, temperature=0, logprobs=2, stream=True) if c.choices[0].logprobs]
    assert [x for c in streamed for x in c.token_logprobs] == pytest.approx(offline.logprobs, abs=1e-4)
    chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak."}],
                                                 max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-5), "greedy: top-1 chosen"
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_echo_puts_the_prompt_before_the_completion(server):
    done = server.client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=5, temperature=0, echo=True)
    plain = server.client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=5, temperature=0)
    assert done.choices[0].text == "ROMEO.\n" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(
        model=MODEL, prompt="ROMEO.\n", max_tokens=5, temperature=0, echo=True, stream=True))
    assert streamed == done.choices[0].text


def test_response_format_json_object_gives_a_json_object(server):
    import json

    from minillm.sampler.constrained import RegexDFA, json_object_regex

    dfa = RegexDFA(json_object_regex())
    for seed in range(3):
        chat = server.client.chat.completions.create(model=MODEL, max_tokens=48, temperature=1.0, seed=seed,
                                                     messages=[{"role": "user", "content": "Speak."}],
                                                     response_format={"type": "json_object"})
        text, finish = chat.choices[0].message.content, chat.choices[0].finish_reason
        assert text.startswith("{") and dfa.walk(dfa.start, text.encode()) >= 0, f"not a JSON object's start: {text}"
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
    assert_still_serving(server)


def test_response_format_json_schema_constrains_the_output(server):
    import json

    schema = {"type": "object", "properties": {"mood": {"enum": ["merry", "sad"]}, "loud": {"type": "boolean"}},
              "required": ["mood", "loud"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "mood", "schema": schema}}
    compiled = []
    for _ in range(2):  # the second request reuses the compiled schema
        chat = server.client.chat.completions.create(model=MODEL, max_tokens=40, temperature=1.0, seed=3,
                                                     messages=[{"role": "user", "content": "How art thou?"}],
                                                     response_format=response_format)
        value = json.loads(chat.choices[0].message.content)
        assert value["mood"] in ("merry", "sad") and isinstance(value["loud"], bool)
        assert chat.choices[0].finish_reason == "stop"
        compiled.append(len(server.state.constraints))
    assert compiled[0] == compiled[1], "the second request compiled nothing new"
    assert_still_serving(server)


def test_a_step_that_fails_fails_its_requests_only_and_the_server_goes_on(server, monkeypatch, caplog):
    """A request whose step raises (here: seed 13 makes the sampler fail) gets a 500 in OpenAI's shape, or an error
    event when streaming; a request beside it is unharmed, the failure is logged, and the loop keeps serving."""
    runner = server.engine.model_runner
    sample = runner.sample

    def poisoned(seqs, logits, plain=None):
        if any(s.params.seed == 13 for s in seqs):
            raise RuntimeError("poisoned step")
        return sample(seqs, logits, plain)

    monkeypatch.setattr(runner, "sample", poisoned)
    with pytest.raises(openai.InternalServerError) as err:
        server.client.completions.create(model=MODEL, prompt="A", max_tokens=4, seed=13)
    assert err.value.body["code"] == "engine_error" and "poisoned step" in err.value.body["message"]
    stream = httpx.post(server.url + "/v1/completions",
                        json={"model": MODEL, "prompt": "A", "max_tokens": 4, "seed": 13, "stream": True})
    assert '"engine_error"' in stream.text and stream.text.rstrip().endswith("data: [DONE]")
    assert "poisoned step" in caplog.text, "the failure is logged on the minillm logger"
    assert_still_serving(server)


def test_shutdown_timeout_bounds_the_drain(monkeypatch):
    seen = {}
    # no socket is opened
    monkeypatch.setattr("minillm.entrypoints.server.run_uvicorn", lambda app, **kwargs: seen.update(kwargs))
    serve(MODEL, shutdown_timeout=2.5)
    assert seen["timeout_graceful_shutdown"] == 2.5 and seen["host"] == "127.0.0.1"


# ---------------------------------------------------------------------- random bodies (hypothesis)

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "stop", "seed", "n", "best_of", "stream", "ignore_eos", "logprobs", "echo",
          "response_format", "prompt", "messages", "model", "top_logprobs"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=8),
       endpoint=st.sampled_from(["completions", "chat/completions"]), small=st.booleans())
def test_random_bodies_get_a_2xx_or_a_4xx_in_openais_shape_and_leave_nothing_behind(server, body, endpoint, small):
    """Whatever JSON a client sends, the answer is a 2xx or a 4xx with OpenAI's error object, and afterwards the
    engine holds no request and no KV block. `small` keeps most generations short, so that bounded time suffices."""
    body.setdefault("model", MODEL)
    if small:
        body.update(prompt="A", messages=[{"role": "user", "content": "A"}], max_tokens=2)
    response = httpx.post(server.url + f"/v1/{endpoint}", json=body, timeout=120)
    assert response.status_code < 500, (body, response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text[:300]
    deadline = time.time() + 60
    while server.engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.02)
    assert not server.engine.has_unfinished_requests() and server.engine.cache.allocator.num_used_blocks == 0
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_chunked_body_over_the_limit_is_refused_too(server):
    """A body sent in chunks has no Content-Length: it is counted as it is read."""
    chunk = b'{"model": "shakespeare-1m", "prompt": "' + b"A" * (BODY_LIMIT + 10) + b'"}'

    def pieces():
        for i in range(0, len(chunk), 4096):
            yield chunk[i: i + 4096]

    response = httpx.post(server.url + "/v1/completions", content=pieces(),
                          headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers, "the test must send a chunked body"
    assert "limit" in assert_openai_error(response, 413)["message"]
    assert_still_serving(server)
