"""Shared fixtures: tiny tokenizers and random `transformers` checkpoints built offline in the test run."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The tests and notebooks that compare two ways of computing the same result: one request alone and in a
# batch, in turns and one step ahead, eager and compiled or graphed, paged and contiguous, chunked and whole,
# one process and several ranks. They compare tokens and text exactly and floats within a stated tolerance
# (`minillm.eval.same_outputs`), because a different batch shape or kernel adds in a different order. `make test`
# runs them a second time on another of PyTorch's CPU code paths (ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU):
# a comparison that holds bit for bit on one CPU only fails there. Marked `compares_paths` below.
COMPARES_PATHS = {
    "test_async_scheduling.py", "test_beam.py", "test_compiled_decode.py", "test_constrained.py",
    "test_disagg.py", "test_engine.py", "test_eval_cached.py", "test_fused_kernels.py", "test_generate.py",
    "test_inference_scaling.py", "test_kv_quant.py", "test_lora.py", "test_model_parity.py", "test_paged_kv_cache.py",
    "test_pipeline_parallel.py", "test_smollm2.py", "test_speculative.py", "test_tensor_parallel.py",
    "04_paging.ipynb", "05_batching.ipynb", "07_speculative.ipynb", "08_disaggregation.ipynb",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "compares_paths: compares two ways of computing one result (COMPARES_PATHS)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in COMPARES_PATHS and (item.path.suffix == ".py" or item.path.parent.name == "chapters"):
            item.add_marker(pytest.mark.compares_paths)

TEXT = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. "
    "Café, naïve, jalapeño, façade — résumé! 東京 and 北京 are cities. Emoji: 🙂 🚀 ✨. "
) * 4


def train_tokenizer(path: Path, vocab_size: int = 320) -> Path:
    """A byte-level BPE with BOS <s> (prepended by the template) and EOS </s>, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path))
    return path


@pytest.fixture
def one_thread():
    """Small models on a shared 2-core machine: a second OpenMP thread only adds synchronisation, and while
    another process keeps a core busy it stalls (measured 20-50x slower). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def random_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A small random-initialised `transformers` causal LM of the given family, in eval mode."""
    import transformers

    kwargs = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
    )
    kwargs.update(overrides)
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    config = cls[0](**kwargs)
    model = cls[1](config).eval()
    # Random init leaves norms at 1 and biases at 0: perturb them so those paths are really tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory, tokenizer_file) -> Path:
    """A random Llama checkpoint saved by `save_pretrained`, with the tiny tokenizer beside it."""
    folder = tmp_path_factory.mktemp("llama")
    random_hf_model("llama").save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    return folder


@contextlib.contextmanager
def served_in_thread(app: object, log_level: str = "warning") -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a thread on a free port of 127.0.0.1; yield its URL, stop it at the end."""
    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def needs_bwrap() -> None:
    """The grader's sandbox (bubblewrap) works here; else skip, or fail where CI is set (CI installs it)."""
    from minillm.book.grading.sandbox import isolation_problem

    problem = isolation_problem()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem + " (CI is set, so this fails instead of skipping)")
        pytest.skip(problem)


# An honest answer to chapter 00's rotary task, for notebooks the grader tests build (tests/book/test_grading*.py)
GRADER_IMPORTS = "import torch\nfrom minillm.book.grading import check"
OWN_ROPE = """def apply_rope(x, positions, theta=10000.0):
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2).float() / d)
    ang = positions.float()[:, None] * freqs
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)"""


def run_in_own_process(script: str, cache: os.PathLike) -> subprocess.CompletedProcess:
    """`script` in a fresh Python process at one thread, with `cache` as its cache of compiled steps. In a process
    of its own: Inductor sets up Triton's drivers, which the Triton interpreter of other test files needs left
    alone."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "MINILLM_COMPILE_CACHE": str(cache)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
