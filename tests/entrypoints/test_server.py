"""minillm.entrypoints.server (chapter 05): the OpenAI-compatible server, called with the official `openai` client.

The server runs in a thread on a free port of 127.0.0.1 for this module and is stopped at its end.
Its outputs are compared with `LLM.generate` on the same model (greedy, so exactly), streaming and
not; 32 concurrent streaming clients, a third of which hang up mid-stream, must leave every surviving
request complete and correct, no KV block held, and the server answering; bad requests get OpenAI's
error object with a 4xx status.
"""

from __future__ import annotations

import concurrent.futures
import time
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai", reason="the server tests call it with the official openai client")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from conftest import served_in_thread  # noqa: E402

import minillm  # noqa: E402
from minillm.decoding.llm import LLM  # noqa: E402
from minillm.engine import LLMEngine  # noqa: E402
from minillm.entrypoints.server import create_app  # noqa: E402
from minillm.sampler.sampling import SamplingParams  # noqa: E402
from minillm.tokenizer import apply_chat_template  # noqa: E402

MODEL = "shakespeare-1m"


@pytest.fixture(scope="module")
def server():
    model, tok = minillm.load(MODEL)
    engine = LLMEngine(model, tok, max_num_seqs=16, max_num_batched_tokens=128)
    with served_in_thread(create_app(engine, MODEL, max_queue=64)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield SimpleNamespace(url=url, engine=engine, client=client, offline=LLM(model, tok), tok=tok)


def offline(server, prompt: str, max_tokens: int) -> str:
    """What LLM.generate gives for this prompt, greedy."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return server.offline.generate([prompt], params, use_tqdm=False)[0]


def wait_idle(engine: LLMEngine, seconds: float = 20) -> None:
    deadline = time.time() + seconds
    while engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.05)


def abort_count(url: str) -> float:
    """minillm_requests_finished_total{reason="abort"} from /metrics (0 before any abort)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('minillm_requests_finished_total{reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_completion_equals_llm_generate_streaming_or_not(server):
    prompt = "ROMEO.\nBut soft, what light"
    want = offline(server, prompt, 24)
    got = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == len(want.token_ids)
    stream = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_chat_uses_the_documented_template_and_streams(server):
    messages = [{"role": "system", "content": "You speak in verse."}, {"role": "user", "content": "Who goes there?"}]
    want = offline(server, apply_chat_template(messages, server.tok), 20)
    got = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    stream = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                   stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == want.text


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").text == "ok"
    server.client.completions.create(model=MODEL, prompt="KING.\n", max_tokens=5, temperature=0)
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("minillm_requests_waiting", "minillm_requests_running", "minillm_kv_blocks_used",
                 "minillm_kv_blocks_total", "minillm_generation_tokens_total", "minillm_time_to_first_token_seconds",
                 "minillm_inter_token_latency_seconds_bucket"):
        assert name in metrics, f"/metrics has no {name}"


def test_32_streaming_clients_a_third_hanging_up(server):
    """Every client that stays gets exactly LLM.generate's text; the ones that hang up are aborted: afterwards
    no KV block is held and the server still answers."""
    prompts = [f"{name}.\n" for name in ["ROMEO", "JULIET", "HAMLET", "OTHELLO", "MACBETH", "LEAR", "PUCK", "PORTIA"]]
    prompts = [p + "I" * (i // len(prompts)) for i, p in enumerate(prompts * 4)]  # 32 different prompts
    want = server.offline.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                   use_tqdm=False)

    def client(i: int) -> str | None:
        stream = server.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=40, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})  # vLLM's extension
        text = ""
        for k, chunk in enumerate(stream):
            text += chunk.choices[0].text
            if i % 3 == 0 and k == 3:  # a third of the clients hang up after a few tokens
                stream.close()
                return None
        return text

    aborted_before = abort_count(server.url)
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(client, range(32)))
    for i, text in enumerate(got):
        if i % 3:
            assert text == want[i].text, f"client {i} got {text!r}, LLM.generate gives {want[i].text!r}"
    wait_idle(server.engine)
    aborted = abort_count(server.url) - aborted_before
    print(f"aborted: {aborted}")
    assert aborted == 11, f"11 clients hung up mid-stream, but {aborted} requests were aborted"
    assert not server.engine.has_unfinished_requests(), "aborted requests are still in the engine"
    assert server.engine.cache.allocator.num_used_blocks == 0, "KV blocks are still held after every client left"
    assert httpx.get(server.url + "/health").text == "ok"
    again = server.client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=40, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert again.choices[0].text == want[1].text


def test_n_completions_equal_generate_n_streaming_or_not(server):
    """n=3 from one prefill forked in the engine: the same completions as minillm.generate_n, best first; streamed,
    choice i carries sequence i."""
    prompt, model = "JULIET.\nO Romeo, Romeo", server.offline.engine.model
    params = SamplingParams(max_tokens=12, n=2, best_of=4, seed=7, ignore_eos=True)
    want = minillm.generate_n(model, prompt, params, server.tok)
    got = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, n=2, best_of=4, seed=7,
                                           extra_body={"ignore_eos": True})
    assert [c.text for c in got.choices] == [o.text for o in want] and [c.index for c in got.choices] == [0, 1]
    assert got.usage.completion_tokens == 4 * 12, "all best_of sequences are generated"

    every = minillm.generate_n(model, prompt, SamplingParams(max_tokens=12, n=3, seed=7, ignore_eos=True),
                               server.tok)
    texts = ["", "", ""]
    stream = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, n=3, seed=7, stream=True,
                                              extra_body={"ignore_eos": True})
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [o.text for o in sorted(every, key=lambda o: o.index)]
    wait_idle(server.engine)
    assert server.engine.cache.allocator.num_used_blocks == 0


@pytest.mark.parametrize("body, status, code", [
    ("{not json", 400, "invalid_json"),
    ({"model": MODEL, "prompt": "A", "max_tokens": "many"}, 400, "invalid_value"),
    ({"model": MODEL, "prompt": "A", "max_tokens": -3}, 400, "invalid_value"),
    ({"model": MODEL, "prompt": 42}, 400, "invalid_value"),
    ({"model": "gpt-4", "prompt": "A"}, 404, "model_not_found"),
    ({"model": MODEL, "prompt": "A " * 5000}, 400, "invalid_prompt"),
    ({"model": MODEL, "prompt": "A", "n": 17}, 400, "invalid_value"),
    ({"model": MODEL, "prompt": "A", "n": 3, "best_of": 2}, 400, "invalid_value"),
    ({"model": MODEL, "prompt": "A", "n": 2, "best_of": 4, "stream": True}, 400, "invalid_value"),
])
def test_bad_requests_get_the_openai_error_shape_and_a_4xx(server, body, status, code):
    if isinstance(body, str):
        response = httpx.post(server.url + "/v1/completions", content=body,
                              headers={"content-type": "application/json"})
    else:
        response = httpx.post(server.url + "/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    assert httpx.get(server.url + "/health").text == "ok"


def test_minillm_serve_command_starts_a_server_on_loopback():
    """`minillm serve` in its own process (through serve_in_background): it answers /health and /v1/models on
    127.0.0.1, with the flags it was given (here an int8 KV cache, chapter 06), and is stopped when the block ends."""
    import minillm
    from minillm.entrypoints.server import serve_in_background

    with serve_in_background(MODEL, max_num_seqs=4, kv_cache_dtype="int8") as url:
        assert url.startswith("http://127.0.0.1:")
        models = httpx.get(url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        metrics = httpx.get(url + "/metrics").text
        assert "minillm_kv_blocks_total 256.0" in metrics, "4 sequences of 1,024 tokens in blocks of 16"
        body = {"model": MODEL, "prompt": "JULIET.", "max_tokens": 12, "temperature": 0}
        text = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        model, tok = minillm.load(MODEL)
        params = minillm.SamplingParams(temperature=0, max_tokens=12)
        assert text == minillm.generate(model, "JULIET.", params, tok, kv_cache_dtype="int8").text
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=1)


# ---------------------------------------------------------------------- the load generator (minillm.eval.bench)
def test_percentiles_by_nearest_rank():
    from minillm.eval.bench import percentiles

    got = percentiles([float(x) for x in range(1, 101)])
    assert (got["p50"], got["p90"], got["p99"], got["mean"]) == (50.0, 90.0, 99.0, 50.5)


def test_online_bench_against_the_live_server(server):
    """A bounded Poisson run on loopback: every request completes with exactly its max_tokens streamed, the
    latencies are ordered and the goodput is at most the throughput."""
    from minillm.eval.bench import make_requests, online

    requests = make_requests(8, (4, 20), (3, 12), server.tok, seed=1)
    result = online(server.url, MODEL, requests, rate=40.0, max_seconds=60, slo_ttft=10.0, slo_tpot=1.0,
                    use_tqdm=False)
    assert result["completed"] == 8 and result["failed"] == 0, result["errors"]
    assert [r["output_tokens"] for r in result["per_request"]] == [n for _, n in requests], (
        "each request streams exactly max_tokens tokens (ignore_eos)")
    assert 0 < result["ttft_s"]["p50"] <= result["ttft_s"]["p99"] < 60
    assert result["goodput_requests_per_s"] <= result["requests_per_s"]
    strict = online(server.url, MODEL, requests[:2], rate=float("inf"), max_seconds=60, slo_ttft=1e-9,
                    use_tqdm=False)
    assert strict["completed"] == 2 and strict["goodput_requests_per_s"] == 0, "no request meets a 1 ns TTFT"


def test_online_bench_reports_a_server_that_refuses(server):
    from minillm.eval.bench import make_requests, online

    result = online(server.url, "no-such-model", make_requests(2, (4, 8), (2, 4), server.tok), rate=float("inf"),
                    max_seconds=30, use_tqdm=False)
    assert result["completed"] == 0 and result["failed"] == 2 and "HTTP 404" in result["errors"][0]


def test_offline_bench_counts_every_token(server):
    from minillm.eval.bench import make_requests, offline

    requests = make_requests(6, (4, 30), (2, 10), server.tok, seed=2)
    result = offline(server.offline, requests, use_tqdm=False)
    assert result["output_tokens"] == sum(n for _, n in requests)
    assert result["prompt_tokens"] == sum(len(p) for p, _ in requests) and result["output_tokens_per_s"] > 0


def test_a_real_chat_model_answers_through_its_own_template():
    """SmolLM2-135M-Instruct (installed by the set-up): its chat template, its end-of-turn token as the stop."""
    from minillm.shipped import CHAT_MODEL

    model, tok = minillm.load(CHAT_MODEL)
    engine = LLMEngine(model, tok, max_num_seqs=4, num_blocks=64)
    with served_in_thread(create_app(engine, CHAT_MODEL)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        got = client.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=32, temperature=0)
        assert got.choices[0].message.content == "The capital of France is Paris."
        assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == 8  # 7 + <|im_end|>
        stream = client.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=32, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == "The capital of France is Paris."
