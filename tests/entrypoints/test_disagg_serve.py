"""`minillm serve --disaggregate` (chapters 05 and 08): the OpenAI API over a prefill worker and a decode worker.

One server runs as `minillm serve --disaggregate` would (its own process, loopback, a free port), with the
engine flags that both workers must get; the official `openai` client must get the one-process engine's greedy
text, streamed or not. What cannot cross the prefill/decode split is refused by name: at start-up with one line,
per request with a 400. A request a worker fails gets a 500 naming the failure, a client that hangs up is
aborted on both workers, and once a worker has died the server keeps answering, with a 503 that says so.
"""

from __future__ import annotations

import json
import os
import signal
import time
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai", reason="the server tests call it with the official openai client")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from conftest import served_in_thread  # noqa: E402

import minillm  # noqa: E402
import minillm.cli as cli  # noqa: E402
from minillm.decoding.llm import LLM  # noqa: E402
from minillm.entrypoints.server import create_app, serve_in_background  # noqa: E402
from minillm.parallel.disagg import DisaggregatedEngine  # noqa: E402
from minillm.sampler.sampling import SamplingParams  # noqa: E402

MODEL = "shakespeare-1m"
PROMPT = "ROMEO.\nBut soft, what light through yonder window"
NUM_BLOCKS, BLOCK_SIZE = 32, 16  # each worker's pool: 512 tokens, less than the model's context of 1024


@pytest.fixture(scope="module")
def shipped():
    return minillm.load(MODEL)


@pytest.fixture(scope="module")
def server():
    with serve_in_background(MODEL, disaggregate=True, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                             max_num_seqs=8) as url:
        yield SimpleNamespace(url=url, client=openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                                            timeout=60))


def metrics(url: str) -> dict[str, float]:
    """/metrics as {"name{labels}": value}."""
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}


def test_a_greedy_completion_equals_the_one_process_engine(server, shipped):
    model, tokenizer = shipped
    want = LLM(model, tokenizer).generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                   logprobs=2), use_tqdm=False)[0]
    got = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text, "prefilled on one worker and decoded on the other, the same greedy text"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == 20
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-4), "the first token's from P, the rest from D"
    assert all(len(top) == 2 for top in lp.top_logprobs), "logprobs=2: two alternatives for every token"


def test_a_streamed_chat_arrives_in_pieces_and_reassembles(server):
    messages = [{"role": "user", "content": "Who goes there?"}]
    whole = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                  extra_body={"ignore_eos": True})
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                        temperature=0, stream=True, extra_body={"ignore_eos": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(pieces) > 5, f"a stream sends the text as it is decoded, not at the end: {pieces}"
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


@pytest.mark.parametrize("field, extra", [
    ("n", {"n": 2}),
    ("best_of", {"best_of": 2}),
    ("response_format", {"response_format": {"type": "json_object"}}),
])
def test_what_the_split_cannot_serve_gets_a_400_naming_it(server, field, extra):
    with pytest.raises(openai.BadRequestError) as err:
        server.client.completions.create(model=MODEL, prompt="A", max_tokens=4, extra_body=extra)
    error = err.value.body
    assert err.value.status_code == 400 and error["param"] == field and error["code"] == "unsupported_parameter"
    assert "--disaggregate" in error["message"], f"the error must say why this server refuses it: {error}"


@pytest.mark.parametrize("flags, says", [
    (["--speculative-model", "[ngram]"], "speculative decoding"),
    (["--quant", "int8"], "--quant"),
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype int8"),
    (["--tensor-parallel-size", "2"], "tensor parallelism"),
])
def test_flags_the_workers_cannot_honour_end_the_command_with_one_line(flags, says, capsys, monkeypatch):
    monkeypatch.setattr("minillm.entrypoints.server.run_uvicorn", lambda *a, **k: pytest.fail("nothing may be served"))
    assert cli.main(["serve", "--model", MODEL, "--disaggregate", *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("minillm: error: --disaggregate") and says in err and "\n" not in err, err


def test_a_request_a_worker_refuses_gets_a_500_naming_the_failure(server):
    prompt = list(range(10, 10 + NUM_BLOCKS * BLOCK_SIZE))  # fits the context, not the workers' pools
    with pytest.raises(openai.InternalServerError) as err:
        server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert err.value.status_code == 500 and err.value.body["code"] == "engine_error"
    assert "prefill worker refused it" in err.value.body["message"] and "KV cache" in err.value.body["message"]
    stream = httpx.post(server.url + "/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True})
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert "prefill worker refused it" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"


def test_a_client_that_hangs_up_is_aborted_on_both_workers_and_metrics_say_so(server):
    before = metrics(server.url).get('minillm_requests_finished_total{reason="abort"}', 0.0)
    stream = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    for k, _ in enumerate(stream):
        if k == 3:
            break
    stream.close()
    deadline = time.time() + 20
    while time.time() < deadline:  # the abort goes to P, which passes it on to D; D frees the blocks
        m = metrics(server.url)
        if m['minillm_worker_kv_blocks_used{worker="decode"}'] == 0 and m["minillm_requests_running"] == 0:
            break
        time.sleep(0.1)
    assert m['minillm_requests_finished_total{reason="abort"}'] == before + 1
    assert m["minillm_requests_waiting"] == m["minillm_requests_running"] == 0, "the router holds no request"
    assert m['minillm_worker_kv_blocks_used{worker="decode"}'] == 0, "the decode worker freed the request's blocks"
    for worker in ("prefill", "decode"):
        assert m[f'minillm_worker_kv_blocks_total{{worker="{worker}"}}'] == NUM_BLOCKS, "--num-blocks reaches both"
    assert m["minillm_time_to_first_token_seconds_count"] >= 1 and m["minillm_generation_tokens_total"] > 0
    assert server.client.completions.create(model=MODEL, prompt="A", max_tokens=3).usage.completion_tokens == 3


def test_a_dead_worker_fails_its_requests_and_new_ones_get_a_503(shipped):
    model, tokenizer = shipped
    engine = DisaggregatedEngine(model, tokenizer)
    try:
        with served_in_thread(create_app(engine, MODEL), log_level="critical") as url:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "stream": True, "ignore_eos": True}
            events = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 1:  # decoding on D: kill it
                            os.kill(engine.processes[1].pid, signal.SIGKILL)
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_error" and "decode worker died" in error["message"], error
            health = httpx.get(url + "/health")
            assert health.status_code == 503 and "decode worker died" in health.text, health.text
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
            with pytest.raises(openai.InternalServerError) as err:
                client.completions.create(model=MODEL, prompt="A", max_tokens=3)
            assert err.value.status_code == 503 and err.value.body["code"] == "engine_down"
            assert "decode worker died" in err.value.body["message"] and "restart" in err.value.body["message"]
    finally:
        engine.shutdown()
