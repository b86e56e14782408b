"""Serving LoRA adapters (issue 32, chapter 08): `minillm serve --lora-modules name=path`, called with openai's client.

The request's `model` field picks the adapter; /v1/models lists the base model and the adapters; an unknown name is
a 404 in OpenAI's shape naming what is served; a bad adapter stops the server at start-up with one line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import minillm
from minillm.decoding.llm import LLM
from minillm.entrypoints.server import serve_in_background
from minillm.lora import LoRAAdapter, save_adapter, target_rows
from minillm.sampler.sampling import SamplingParams
from minillm.shipped import DEFAULT_MODEL

openai = pytest.importorskip("openai")
PROMPT = "ROMEO: But soft, what light"


def random_adapter(config, seed: int, targets: tuple[str, ...], rank: int = 4) -> LoRAAdapter:
    """A random adapter for a model of `config` (B nonzero, large enough to change greedy tokens)."""
    torch.manual_seed(seed)
    rows = target_rows(config)
    weights = {(layer, t): (0.05 * torch.randn(rank, rows[t][3]), 0.05 * torch.randn(rows[t][2], rank))
               for layer in range(config.n_layers) for t in targets}
    return LoRAAdapter(rank, 2.0 * rank, weights, base_model=DEFAULT_MODEL)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    model, tokenizer = minillm.load(DEFAULT_MODEL, dtype=torch.float32)
    root = tmp_path_factory.mktemp("adapters")
    paths = {"romeo": save_adapter(random_adapter(model.config, 1, ("q_proj", "v_proj")), root / "romeo"),
             "juliet": save_adapter(random_adapter(model.config, 2, ("gate_proj", "down_proj")), root / "juliet")}
    return model, tokenizer, {name: str(path) for name, path in paths.items()}


def test_task_1_serve_picks_the_adapter_by_model_name(adapters, one_thread):
    model, tokenizer, paths = adapters
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm = LLM(model, tokenizer, lora_modules=paths, max_loras=1)
    want = {name: llm.generate(PROMPT, params, use_tqdm=False, lora=None if name == DEFAULT_MODEL else name)[0].text
            for name in (DEFAULT_MODEL, "romeo", "juliet")}
    assert len(set(want.values())) == 3, "the two adapters and the base model should continue differently"
    with serve_in_background(DEFAULT_MODEL, lora_modules=[f"{k}={v}" for k, v in paths.items()], max_loras=1) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {DEFAULT_MODEL, "romeo", "juliet"}
        assert listed["romeo"].model_extra["parent"] == DEFAULT_MODEL
        for name, text in want.items():
            out = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
            assert out.choices[0].text == text, f"{name}: the server's text differs from LLM.generate's"
            assert out.model == name
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model="mercutio", prompt=PROMPT, max_tokens=2)
        error = caught.value.body
        assert error["code"] == "model_not_found" and "['juliet', 'romeo']" in error["message"]


def test_task_2_bad_adapter_is_refused_at_start_up(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{broken")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    proc = subprocess.run([sys.executable, "-m", "minillm.cli", "serve", "--model", DEFAULT_MODEL,
                           "--port", "1", "--lora-modules", f"bad={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad: LoRA adapter" in lines[0] and "not valid JSON" in lines[0], proc.stderr
    proc = subprocess.run([sys.executable, "-m", "minillm.cli", "serve", "--lora-modules",
                           "no-equals-sign"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "NAME=PATH" in proc.stderr
