"""`minillm serve` as vLLM users expect it: an API key, the engine's features as flags, refusals at start-up.

One server runs as `minillm serve` would (its own process, loopback, a free port) with an API key from the
environment and most flags set; the official `openai` client must be refused without the key or with a wrong
one, and served with it. Each flag is checked where it lands: in the engine `build_engine` makes, and, for the
running server, in /v1/models and /metrics. Impossible combinations end the command with one line, not a
traceback.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

openai = pytest.importorskip("openai", reason="the server tests call it with the official openai client")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import minillm.cli as cli  # noqa: E402
from minillm.entrypoints.server import build_engine, is_loopback, serve, serve_in_background  # noqa: E402
from minillm.sampler.speculative import NgramDrafter  # noqa: E402

MODEL = "shakespeare-1m"
KEY = "sesame-open"
PROMPT = "ROMEO.\nBut soft, what light through yonder window breaks?\n\n" * 3  # repeats: the n-gram drafter finds them


@pytest.fixture(scope="module")
def server():
    with serve_in_background(MODEL, env={"MINILLM_API_KEY": KEY}, served_model_name="bard", block_size=8,
                             speculative_model="[ngram]", num_speculative_tokens=3, enforce_eager=True,
                             metrics_require_api_key=True, max_num_seqs=8) as url:
        yield url


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def test_without_the_key_or_with_a_wrong_one_every_v1_route_answers_401(server):
    c = client(server, "sesame-opem")  # a wrong key (the openai client refuses to send none)
    with pytest.raises(openai.AuthenticationError) as err:
        c.models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        c.completions.create(model="bard", prompt="A", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(model="bard", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    body = {"model": "bard", "prompt": "A", "messages": [{"role": "user", "content": "Hi"}]}
    for method, route in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                          ("GET", "/v1/no-such-route")]:  # no Authorization header at all
        raw = httpx.request(method, server + route, json=body if method == "POST" else None)
        assert raw.status_code == 401, (route, raw.status_code)
        assert set(raw.json()["error"]) == {"message", "type", "param", "code"}, "OpenAI's error shape"
        assert "Authorization: Bearer" in raw.json()["error"]["message"], "the error says how to send the key"


def test_with_the_key_completions_chat_streaming_and_models_are_served(server):
    c = client(server, KEY)
    assert [m.id for m in c.models.list().data] == ["bard"], "--served-model-name is the name /v1/models lists"
    done = c.completions.create(model="bard", prompt="ROMEO.\n", max_tokens=8, temperature=0)
    assert done.usage.completion_tokens == 8
    chat = c.chat.completions.create(model="bard", messages=[{"role": "user", "content": "Speak."}], max_tokens=6,
                                     temperature=0)
    assert chat.choices[0].message.content
    streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(
        model="bard", prompt="ROMEO.\n", max_tokens=8, temperature=0, stream=True))
    assert streamed == done.choices[0].text, "streamed or not, the same greedy text"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model=MODEL, prompt="A", max_tokens=2)  # the model's own name is not the served one


def test_health_is_open_and_metrics_follow_their_flag(server):
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/metrics").status_code == 401, "--metrics-require-api-key"
    assert metric(server, "minillm_cuda_graphs_enabled") == 0


def test_prefix_caching_and_ngram_speculation_reach_the_engine(server):
    c = client(server, KEY)
    hits = metric(server, "minillm_prefix_cache_hits")
    for _ in range(2):  # the second time, the prompt's full blocks of 8 tokens come from the prefix cache
        c.completions.create(model="bard", prompt=PROMPT, max_tokens=16, temperature=0)
    assert metric(server, "minillm_prefix_cache_hits") > hits
    assert metric(server, "minillm_prefix_cache_queries") >= metric(server, "minillm_prefix_cache_hits")
    drafted = metric(server, "minillm_spec_decode_num_draft_tokens")
    assert drafted > 0, "the n-gram drafter proposed tokens on a prompt that repeats itself"
    assert 0 <= metric(server, "minillm_spec_decode_num_accepted_tokens") <= drafted


def test_a_kv_pool_too_small_for_the_load_shows_in_the_preemption_count():
    """Eight concurrent requests of 60 tokens on a pool of 24 blocks of 8 (192 tokens): the scheduler preempts
    running sequences to let older ones grow, and /metrics counts them (chapter 09's "TPOT got worse" runbook)."""
    from concurrent.futures import ThreadPoolExecutor

    with serve_in_background(MODEL, env={"MINILLM_API_KEY": KEY}, block_size=8, num_blocks=24, max_num_seqs=8,
                             enforce_eager=True) as url:
        assert metric(url, "minillm_num_preemptions") == 0
        c = client(url, KEY)

        def ask(i: int):  # noqa: ANN202
            return c.completions.create(model=MODEL, prompt=f"KING {i}.\n", max_tokens=60, temperature=0,
                                        extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        assert all(a.usage.completion_tokens == 60 for a in answers), "every request still gets all its tokens"
        assert metric(url, "minillm_num_preemptions") > 0
        assert metric(url, "minillm_kv_blocks_total") == 24


def test_build_engine_turns_each_flag_into_the_engine_setting(monkeypatch):
    monkeypatch.setattr("minillm.engine.model_runner.graphs_unavailable", lambda model: None)  # as on a CUDA GPU
    from minillm.engine import cuda_graphs, model_runner

    # The engine captures as it starts: here its buffers are built, without a GPU to record on.
    monkeypatch.setattr(model_runner, "DecodeGraphs", lambda *a, **k: cuda_graphs.DecodeGraphs(*a, **k, capture=False))
    engine = build_engine(MODEL)
    assert engine.use_cuda_graphs and engine.graphs is not None, "by default decode steps are captured"
    assert not build_engine(MODEL, enforce_eager=True).use_cuda_graphs, "--enforce-eager"
    engine = build_engine(MODEL, dtype="bfloat16", block_size=8, enable_prefix_caching=False, max_num_seqs=4,
                          kv_cache_memory_bytes=2**20, speculative_model="[ngram]", num_speculative_tokens=2)
    assert engine.model.dtype == torch.bfloat16 and engine.cache.block_size == 8
    assert not engine.cache.allocator.enable_prefix_caching and engine.scheduler.max_num_seqs == 4
    assert engine.cache.nbytes <= 2**20 < engine.cache.nbytes + engine.cache.nbytes // engine.cache.allocator.num_blocks
    assert isinstance(engine.speculative.drafter, NgramDrafter) and engine.speculative.num_speculative_tokens == 2
    draft = build_engine(MODEL, speculative_model=MODEL)  # the model drafting for itself: same vocabulary
    assert draft.speculative.num_speculative_tokens == 4


@pytest.fixture(scope="module")
def other_vocabulary(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("draft")
    config = transformers.LlamaConfig(vocab_size=123, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("flags, says", [
    (["--num-speculative-tokens", "3"], "needs --speculative-model"),
    (["--num-blocks", "10", "--kv-cache-memory-bytes", "1e6"], "one way"),
    (["--metrics-require-api-key"], "needs an API key"),
    (["--speculative-model", "OTHER"], "vocabulary has 123 tokens"),
])
def test_impossible_combinations_end_with_one_line(flags, says, other_vocabulary, capsys, monkeypatch):
    monkeypatch.delenv("MINILLM_API_KEY", raising=False)
    monkeypatch.setattr("minillm.entrypoints.server.run_uvicorn", lambda *a, **k: pytest.fail("nothing may be served"))
    flags = [str(other_vocabulary) if f == "OTHER" else f for f in flags]
    assert cli.main(["serve", "--model", MODEL, *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("minillm: error:") and says in err and "\n" not in err, err


def test_a_bad_combination_prints_no_traceback_from_the_command_line():
    run = subprocess.run([sys.executable, "-m", "minillm.cli", "serve", "--model", MODEL,
                          "--num-speculative-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [run.stderr.strip()], run.stderr


def test_serving_beyond_loopback_without_a_key_warns(monkeypatch, caplog):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4") and not is_loopback("example.org")
    served = []
    # no socket is opened
    monkeypatch.setattr("minillm.entrypoints.server.run_uvicorn", lambda app, host, port, **_: served.append(host))
    with caplog.at_level(logging.WARNING, logger="minillm"):
        serve(MODEL, host="0.0.0.0", port=8123)
        assert "without an API key" in caplog.text and "--api-key" in caplog.text
        caplog.clear()
        serve(MODEL, host="0.0.0.0", port=8123, api_key=KEY)
        serve(MODEL, host="127.0.0.1", port=8123)
        assert "without an API key" not in caplog.text
    assert served == ["0.0.0.0", "0.0.0.0", "127.0.0.1"]
