"""Bad input to the engine, the loader and the CLI gets a clear error that says what to change (issue 28).

Each case used to end in something else: an IndexError deep in speculative decoding (a draft of another
vocabulary), a bare `Exception` from `tokenizers` (a garbage tokenizer.json), a raw TypeError (a config value
that is not a number), a model that loaded and failed only when it generated (max_position_embeddings 0), a
silent truncation (float token ids), or a traceback (`minillm generate ... | head`).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minillm
from minillm.config import ConfigError
from minillm.engine import LLMEngine
from minillm.engine.draft_model import DraftModelDrafter
from minillm.sampler.constrained import TokenIndex
from minillm.sampler.sampling import SamplingParams
from minillm.sampler.speculative import SpeculativeConfig

MODEL = "shakespeare-1m"


@pytest.fixture(scope="module")
def shipped():
    return minillm.load(MODEL)


@pytest.fixture()
def folder(tmp_path, shipped):
    """A copy of the shipped model as a Hugging Face folder, to spoil."""
    model, tokenizer = shipped
    minillm.save(model, tmp_path / "model", tokenizer)
    return tmp_path / "model"


def test_a_draft_of_another_vocabulary_is_refused_when_the_engine_is_made(shipped):
    model, tokenizer = shipped
    other = minillm.Transformer(minillm.ModelConfig(dim=32, n_layers=1, n_heads=2, ffn_dim=64, vocab_size=123))
    spec = SpeculativeConfig(DraftModelDrafter(other), 2)
    with pytest.raises(ValueError, match="vocabulary has 123 tokens"):
        LLMEngine(model, tokenizer, speculative=spec)
    with pytest.raises(ValueError, match="same family, or an NgramDrafter"):
        minillm.generate(model, "ROMEO.\n", SamplingParams(max_tokens=4), tokenizer, speculative=spec)


@pytest.mark.parametrize("prompt, says", [
    ([5.7, 9.2], "must be ints"),
    ([True, 3], "must be ints"),
    (torch.tensor([[5, 9]]), "1-D"),
    (torch.tensor([5.0, 9.0]), "integer token ids"),
])
def test_prompt_ids_that_are_not_ints_are_refused_not_truncated(shipped, prompt, says):
    model, tokenizer = shipped
    with pytest.raises(ValueError, match=says):
        minillm.generate(model, prompt, SamplingParams(max_tokens=2), tokenizer)


def test_a_1d_integer_tensor_is_a_prompt(shipped):
    model, tokenizer = shipped
    ids = tokenizer.encode("ROMEO.\n")
    params = SamplingParams(max_tokens=4, temperature=0)
    out = minillm.generate(model, torch.tensor(ids), params, tokenizer)
    assert out.token_ids == minillm.generate(model, ids, params, tokenizer).token_ids


def test_beam_search_refuses_a_length_penalty_that_is_not_a_finite_number(shipped):
    model, tokenizer = shipped
    for bad in (math.nan, math.inf, "1"):
        with pytest.raises(ValueError, match="length_penalty must be a finite number"):
            minillm.beam_search(model, "ROMEO.\n", num_beams=2, max_tokens=3, tokenizer=tokenizer, length_penalty=bad)


def test_a_constraint_that_is_neither_a_regex_nor_a_schema_is_a_clear_error(shipped):
    _, tokenizer = shipped
    with pytest.raises(TypeError, match=r"a regex \(str\) or a JSON schema \(dict\), got int"):
        TokenIndex.from_constraint(123, tokenizer)


def test_a_garbage_tokenizer_json_names_the_file(folder):
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": "nonsense"')
    with pytest.raises(ValueError, match=r"is not a tokenizer\.json the `tokenizers` library can read"):
        minillm.load(folder)


@pytest.mark.parametrize("field, value, says", [
    ("hidden_size", "big", "dim must be a positive integer, got 'big'"),
    ("max_position_embeddings", 0, "max_seq_len must be a positive integer, got 0"),
    ("rms_norm_eps", "tiny", "norm_eps must be a positive number"),
    ("num_hidden_layers", 2.5, "n_layers must be a positive integer"),
])
def test_a_config_value_of_the_wrong_kind_is_refused_at_load_naming_the_field(folder, field, value, says):
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=says) as err:
        minillm.load(folder)
    assert field in str(err.value), "the message names config.json's own field"


def test_the_cli_prints_one_line_for_a_bad_model_folder(folder):
    (folder / "tokenizer.json").write_text("not json at all")
    run = subprocess.run([sys.executable, "-m", "minillm.cli", "generate", "A", "--model", str(folder)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.startswith("minillm: error:") and len(run.stderr.strip().splitlines()) == 1, run.stderr


@pytest.mark.skipif(shutil.which("head") is None, reason="needs the `head` command")
def test_generate_into_a_pipe_that_closes_ends_without_a_traceback():
    command = (f"{sys.executable} -m minillm.cli generate 'ROMEO.' --model {MODEL} --max-tokens 400 "
               "| head -c 3")
    run = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120)
    assert len(run.stdout) == 3
    assert "Traceback" not in run.stderr and "BrokenPipeError" not in run.stderr, run.stderr


def test_more_completions_than_the_engine_runs_at_once_are_refused_when_added(shipped):
    """A request's best_of sequences run side by side once its prompt is done: more than max_num_seqs could never
    run, and were once accepted and forked (hypothesis found best_of = 4,225,393: a 69 GB allocation)."""
    model, tokenizer = shipped
    engine = LLMEngine(model, tokenizer, max_num_seqs=8, num_blocks=64)
    with pytest.raises(ValueError, match="best_of=9 completions.*max_num_seqs=8"):
        engine.add_request("r", "ROMEO.\n", SamplingParams(max_tokens=3, n=2, best_of=9))
    assert not engine.has_unfinished_requests()
    engine.add_request("r", "ROMEO.\n", SamplingParams(max_tokens=3, best_of=8, ignore_eos=True))
    assert len(engine.run()) == 8


# ---------------------------------------------------------------------- random SamplingParams (hypothesis)

NUMBERS = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                    st.none(), st.text(max_size=3))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(kwargs=st.fixed_dictionaries({}, optional={
    name: NUMBERS for name in ("temperature", "top_k", "top_p", "min_p", "seed", "n", "best_of", "logprobs",
                               "repetition_penalty", "frequency_penalty", "presence_penalty")}))
def test_random_sampling_params_are_refused_clearly_or_run_to_the_end(shipped, kwargs):
    """Any SamplingParams is refused with a ValueError when made, or the engine runs it to the end and lets go
    of every block: no parameter reaches a step the engine cannot take."""
    model, tokenizer = shipped
    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True, **kwargs)
    except ValueError as err:
        assert str(err), "the error says what is wrong"
        return
    engine = LLMEngine(model, tokenizer, max_num_seqs=8, num_blocks=64)
    try:
        engine.add_request("r", "ROMEO.\n", params)
    except ValueError:
        return  # e.g. more sequences than the pool holds: refused when added, nothing queued
    finished = engine.run()
    assert len(finished) == (params.best_of or params.n)
    assert all(len(out.token_ids) == 3 for out in finished.values())
    assert engine.cache.allocator.num_used_blocks == 0
