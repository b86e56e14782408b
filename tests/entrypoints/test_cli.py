"""The `minillm` command line: `python -m minillm.cli generate ...` in a subprocess, `main()` in-process."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import minillm.cli
from minillm.cli import main

TIMEOUT_S = 120


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m minillm.cli ARGS` in a fresh interpreter, with its output captured as text."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "minillm.cli", *args],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
    )


def assert_one_error_line(stderr: str, *fragments: str) -> None:
    """stderr is exactly one line, `minillm: error: ...`, naming every fragment, with no traceback."""
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got {len(lines)}:\n{stderr}"
    assert lines[0].startswith("minillm: error:"), f"expected 'minillm: error: ...', got {lines[0]!r}"
    assert "Traceback" not in stderr, f"expected no traceback:\n{stderr}"
    for fragment in fragments:
        assert fragment in lines[0], f"expected {fragment!r} in the error line: {lines[0]!r}"


def test_generate_subprocess_streams_text_and_prints_stats(llama_folder):
    """`minillm generate` on a folder exits 0, prints text and a stats line with TTFT and tok/s on stderr."""
    proc = run_cli("generate", "--model", str(llama_folder), "--max-tokens", "8", "--seed", "0", "Hello")
    assert proc.returncode == 0, f"expected exit 0, got {proc.returncode}; stderr:\n{proc.stderr}"
    assert proc.stdout.endswith("\n"), "expected the completion to end with a newline"
    stats = [line for line in proc.stderr.splitlines() if "TTFT" in line]
    assert len(stats) == 1, f"expected one stats line on stderr, got:\n{proc.stderr}"
    assert "tok/s" in stats[0] and "prompt" in stats[0], f"expected prompt size and tok/s in {stats[0]!r}"


def test_generate_subprocess_same_seed_same_output(llama_folder):
    """Two runs with the same --seed print the same completion."""
    args = ("generate", "--model", str(llama_folder), "--max-tokens", "8", "--seed", "3", "Hello")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == second.returncode == 0
    assert first.stdout == second.stdout, f"same seed, different output: {first.stdout!r} vs {second.stdout!r}"


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"]], ids=["top-level", "generate"])
def test_help_exits_zero(args):
    """`--help` at the top level and for `generate` prints usage and exits 0."""
    proc = run_cli(*args)
    assert proc.returncode == 0, f"expected exit 0 for {args}, got {proc.returncode}:\n{proc.stderr}"
    assert proc.stdout.startswith("usage: minillm"), f"expected usage text, got {proc.stdout[:80]!r}"
    assert "generate" in proc.stdout


def test_bad_model_path_subprocess_is_one_error_line(tmp_path):
    """A model path that does not exist: non-zero exit, one `minillm: error:` line, no traceback."""
    missing = tmp_path / "no-such-model"
    proc = run_cli("generate", "--model", str(missing), "--max-tokens", "4", "Hello")
    assert proc.returncode != 0, "expected a non-zero exit for a missing model"
    assert_one_error_line(proc.stderr, str(missing), "does not download")
    assert proc.stdout == "", f"expected nothing on stdout, got {proc.stdout!r}"


def test_negative_temperature_subprocess_is_one_error_line(llama_folder):
    """--temperature -1: non-zero exit, one `minillm: error:` line naming the temperature, no traceback."""
    proc = run_cli("generate", "--model", str(llama_folder), "--temperature", "-1", "Hello")
    assert proc.returncode != 0, "expected a non-zero exit for a negative temperature"
    assert_one_error_line(proc.stderr, "temperature must be >= 0")


# ------------------------------------------------------------------ in-process, through main()
def test_main_generate_in_process(llama_folder, capsys):
    """main([...]) returns 0, writes the completion to stdout and the stats line to stderr."""
    code = main(["generate", "--model", str(llama_folder), "--max-tokens", "5", "--temperature", "0", "Hello"])
    out, err = capsys.readouterr()
    assert code == 0, f"expected 0, got {code}; stderr:\n{err}"
    assert out.endswith("\n")
    assert "TTFT" in err and "tok/s" in err, f"expected a stats line, got {err!r}"
    assert re.search(r"generated [1-5] tokens \((length|stop)\)", err), f"expected the token count and reason: {err!r}"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["generate", "--model", "{missing}", "Hello"], "no such folder"),
        (["generate", "--model", "{folder}", "--temperature", "-1", "Hello"], "temperature must be >= 0"),
        (["generate", "--model", "{folder}", "--max-tokens", "0", "Hello"], "max_tokens must be >= 1"),
        (["generate", "--model", "{folder}", "--max-tokens", "1000", "Hello"], "lower max_tokens"),
        (["generate", "--model", "{folder}", "--device", "cuda:0", "Hello"], "no CUDA GPU"),
    ],
    ids=["missing-model", "temperature=-1", "max-tokens=0", "max-tokens-too-many", "device"],
)
def test_main_errors_in_process_are_one_line(argv, fragment, llama_folder, tmp_path, capsys):
    """main([...]) turns each user error into exit status 1 and one `minillm: error:` line."""
    import torch

    if "cuda:0" in argv and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present, so --device cuda is not an error")
    argv = [a.format(missing=tmp_path / "nope", folder=llama_folder) for a in argv]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 1, f"expected exit status 1 for {argv}, got {code}"
    assert out == "", f"expected nothing on stdout, got {out!r}"
    assert_one_error_line(err, fragment)


def test_main_without_model_and_none_shipped_says_pass_model(monkeypatch, capsys):
    """With no --model and no shipped model, the error tells the user to pass --model."""
    monkeypatch.setattr(minillm.cli, "shipped_models", lambda: [])
    assert main(["generate", "Hello"]) == 1
    assert_one_error_line(capsys.readouterr().err, "--model PATH")


def test_main_without_command_is_a_usage_error(capsys):
    """No subcommand: argparse's usage error (exit status 2), naming the missing COMMAND."""
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize("quant", ["int8", "int4", "nf4"])
def test_main_generate_quantised_equals_generate_on_the_quantised_model(quant, capsys):
    """--quant NAME runs the shipped model with its block linears quantised: the completion is the greedy
    output of minillm.quant.quantize_by_name's model, and (for int8) the same as the unquantised model's."""
    import minillm
    from minillm.quant import quantize_by_name

    argv = ["generate", "--max-tokens", "12", "--temperature", "0", "--quant", quant, "ROMEO."]
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    model, tok = minillm.load(minillm.DEFAULT_MODEL)
    params = minillm.SamplingParams(temperature=0, max_tokens=12)
    plain = minillm.generate(model, "ROMEO.", params, tok).text
    expected = minillm.generate(quantize_by_name(model, quant, tok), "ROMEO.", params, tok).text
    assert out == expected + "\n"
    if quant == "int8":
        assert expected == plain


def test_main_generate_kv_cache_dtype_runs_the_quantised_cache(capsys):
    """--kv-cache-dtype int8 streams what generate(kv_cache_dtype="int8") returns."""
    import minillm

    argv = ["generate", "--max-tokens", "12", "--temperature", "0", "--kv-cache-dtype", "int8", "JULIET."]
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    model, tok = minillm.load(minillm.DEFAULT_MODEL)
    params = minillm.SamplingParams(temperature=0, max_tokens=12)
    assert out == minillm.generate(model, "JULIET.", params, tok, kv_cache_dtype="int8").text + "\n"


def test_main_generate_unknown_kv_cache_dtype_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--kv-cache-dtype", "int4", "Hello"])
    assert "invalid choice" in capsys.readouterr().err


def test_cli_choices_match_the_library():
    """The CLI writes its choices out (so that --help stays light); they must be the library's."""
    from minillm.quant import QUANT_OPTIONS
    from minillm.quant.kv import KV_CACHE_DTYPES

    assert minillm.cli.QUANT_CHOICES == QUANT_OPTIONS
    assert minillm.cli.KV_CACHE_DTYPES == KV_CACHE_DTYPES


def test_main_generate_unknown_quant_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--quant", "int3", "Hello"])
    assert "invalid choice" in capsys.readouterr().err


def test_cli_does_not_import_torch_before_it_is_needed():
    """`import minillm.cli` (what the `minillm` command runs first) stays light: no PyTorch, no model."""
    code = ("import sys, minillm.cli; "
            "print(sorted(m for m in ('torch', 'minillm.model') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.stdout.strip() == "[]", (f"importing minillm.cli loaded {proc.stdout.strip()}; "
                                         "keep those imports lazy")


def test_generate_loads_and_runs_without_torchs_compiler():
    """What `minillm generate` runs (loading the shipped model, decoding eagerly) never imports torch._dynamo or
    torch._inductor: their import alone is 1.3-2.5 s on this book's CPU. (Arithmetic on the "meta" tensors a loader
    builds its model from imported them; a compiled step loaded from the cache does not either:
    tests/engine/test_compiled_decode.py.)"""
    code = ("import sys, torch, minillm; m, t = minillm.load(minillm.DEFAULT_MODEL); "
            "minillm.generate(m, 'To be', minillm.SamplingParams(temperature=0, max_tokens=3), t); "
            "print(sorted(k for k in ('torch._dynamo', 'torch._inductor') if k in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"loading and generating imported {proc.stdout.strip()}"


@pytest.mark.parametrize("delay_s", [0.3, 1.0])
def test_ctrl_c_during_start_up_prints_no_traceback(llama_folder, delay_s):
    """Ctrl-C while `minillm generate` is still importing PyTorch or loading the model ends it quietly (status 130)."""
    import signal
    import time

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "minillm.cli", "generate", "--model", str(llama_folder),
         "--max-tokens", "4000", "Hi"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    time.sleep(delay_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert "Traceback" not in err, f"Ctrl-C after {delay_s} s printed a traceback:\n{err}"
    assert proc.returncode in (130, -signal.SIGINT), f"exit status {proc.returncode}; stderr:\n{err}"
