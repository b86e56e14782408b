"""minillm as a model of lm-evaluation-harness (minillm.eval.harness): lm-eval, run offline on the book's task
YAMLs, gives the numbers minillm.eval gives, and its three request types are answered as a direct computation."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")  # in the dev extras

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

import minillm  # noqa: E402
from minillm.decoding.llm import LLM  # noqa: E402
from minillm.eval import Task, exact_match, load_task, loglikelihood, multiple_choice  # noqa: E402
from minillm.eval.harness import YAML_DIR, MinillmLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]  # tests/<room>/ is two folders below the root
LIMIT = 40  # documents of each task


def go_offline(mp: pytest.MonkeyPatch) -> None:
    """The hub's offline switches on, and any internet connection fails the test: the tasks must be local."""
    import datasets

    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # datasets reads the variable when it is imported
    real_connect = socket.socket.connect

    def connect(sock: socket.socket, address: object) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"an offline evaluation connected to {address}")
        real_connect(sock, address)

    mp.setattr(socket.socket, "connect", connect)


@pytest.fixture(scope="module")
def lm() -> MinillmLM:
    return MinillmLM(minillm.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def results(lm: MinillmLM) -> dict:
    """lm-eval's results for the book's two tasks, first LIMIT documents each, run offline."""
    with pytest.MonkeyPatch.context() as mp:
        go_offline(mp)
        manager = TaskManager(include_path=str(YAML_DIR), include_defaults=False)
        return lm_eval.simple_evaluate(model=lm, tasks=["minillm_next_line", "minillm_last_word"],
                                       task_manager=manager, limit=LIMIT)


def first_docs(name: str) -> Task:
    task = load_task(name)
    return Task(task.name, task.kind, task.docs[:LIMIT])


def test_multiple_choice_matches_minillm_eval(lm: MinillmLM, results: dict) -> None:
    ours = multiple_choice(lm.model, lm.tokenizer, first_docs("next_line"))
    theirs = results["results"]["minillm_next_line"]
    assert theirs["sample_len"] == LIMIT
    assert (theirs["acc,none"], theirs["acc_norm,none"]) == (ours["acc"], ours["acc_norm"])
    assert theirs["acc_stderr,none"] == pytest.approx(ours["acc_stderr"], abs=1e-9)
    assert theirs["acc_norm_stderr,none"] == pytest.approx(ours["acc_norm_stderr"], abs=1e-9)
    # lm-eval asked for (context, choice) with nothing between them (target_delimiter: ""), as the book does
    sample = results["samples"]["minillm_next_line"][0]
    doc = first_docs("next_line").docs[0]
    assert [tuple(a) for a in sample["arguments"]] == [(doc["context"], c) for c in doc["choices"]]


def test_exact_match_matches_minillm_eval(lm: MinillmLM, results: dict) -> None:
    ours = exact_match(LLM(lm.model, lm.tokenizer), first_docs("last_word"))
    theirs = results["results"]["minillm_last_word"]
    assert theirs["sample_len"] == LIMIT
    assert theirs["exact_match,first_word"] == ours["exact_match"]
    assert theirs["exact_match_stderr,first_word"] == pytest.approx(ours["exact_match_stderr"], abs=1e-9)
    assert 0 < ours["exact_match"] < 1  # some words found, some not: a comparison that can fail


def request(kind: str, *args: object) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@torch.no_grad()
def test_loglikelihood_is_the_direct_sum(lm: MinillmLM) -> None:
    model, tok = lm.model, lm.tokenizer
    context = "ROMEO:\nBut soft, what light through yonder window bre"
    logprobs = F.log_softmax(model(torch.tensor([tok.encode(context)])).float()[0, -1], dim=-1)
    greedy = tok.decode([int(logprobs.argmax())])
    for continuation in ("aks?\nIt is the east", greedy):  # the first splits a word across the boundary
        ids = tok.encode(context + continuation)
        n = len(ids) - len(tok.encode(context))
        rows = F.log_softmax(model(torch.tensor([ids[:-1]])).float()[0, -n:], dim=-1)
        target = torch.tensor(ids[-n:])
        want = rows.gather(-1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all())
        (got,) = lm.loglikelihood([request("loglikelihood", context, continuation)])
        assert got[0] == pytest.approx(want[0], abs=1e-4) and got[1] == want[1]
    assert got[1]  # the greedy token is greedy


@torch.no_grad()
def test_loglikelihood_rolling_predicts_each_token_once(lm: MinillmLM) -> None:
    model, tok = lm.model, lm.tokenizer
    short = "Now is the winter of our discontent\nMade glorious summer by this sun of York;"
    (got,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", short)])
    assert got == pytest.approx(loglikelihood(model, tok, [("", short)])[0][0], abs=1e-4)  # one window, after BOS

    text = (ROOT / "minillm" / "data" / "shakespeare_val.txt").read_text()[:6000]
    ids = tok.encode(text, add_special_tokens=False)
    L = model.config.max_seq_len
    assert L < len(ids) < 2 * L  # two windows, the second partly new: it must see a full context
    want = 0.0
    for context, predicted in map(make_disjoint_window, get_rolling_token_windows(ids, tok.bos_token_id, L, 1)):
        inputs = torch.tensor([context + predicted[:-1]])
        rows = F.log_softmax(model(inputs).float()[0, -len(predicted) :], dim=-1)
        want += rows.gather(-1, torch.tensor(predicted)[:, None]).sum().item()
    (got,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    assert got == pytest.approx(want, abs=1e-3)


def test_generate_until_stops_before_the_stop_string(lm: MinillmLM) -> None:
    (text,) = lm.generate_until([request("generate_until", "KING RICHARD III:\nNow is the winter",
                                         {"until": ["\n"], "max_gen_toks": 32})])
    assert text and "\n" not in text
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until([request("generate_until", "Now", {"do_sample": True, "temperature": 1.0})])


def run_python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_minillm_does_not_need_lm_eval() -> None:
    code = ("import sys; sys.modules['lm_eval'] = None  # as if it were not installed\n"
            "import minillm.eval\n"
            "try:\n    import minillm.eval.harness\nexcept ImportError as e:\n    print(e)")
    out = run_python("-c", code)
    assert out.returncode == 0, out.stderr
    assert "pip install lm-eval" in out.stdout


def test_command_line(tmp_path: Path) -> None:
    """`python -m minillm.eval.harness` is lm-eval's command line with the model registered once."""
    out = run_python("-m", "minillm.eval.harness", "run", "--model", "minillm", "--tasks", "minillm_next_line",
                     "--include_path", str(YAML_DIR), "--limit", "4", "--output_path", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "minillm_next_line" in out.stdout and "acc_norm" in out.stdout
