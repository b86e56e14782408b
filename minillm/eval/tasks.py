"""Scored tasks over small local files: log-likelihood multiple choice, exact match and JSON answers (chapter 09).

The conventions are lm-evaluation-harness's (Gao et al., EleutherAI), so the numbers read the same way:

- a `loglikelihood` request is a (context, continuation) pair; it returns the continuation's summed
  log-probability given the context, and whether greedy decoding would have produced it (`is_greedy`).
  The continuation's tokens are those of encode(context + continuation) past encode(context), so a word
  split across the boundary is scored as the tokenizer really splits it;
- a multiple-choice document scores every choice that way: `acc` is the share of documents whose gold
  choice has the highest log-likelihood, `acc_norm` the same after dividing each log-likelihood by the
  choice's length in bytes (long choices are not penalised for having more tokens);
- a `generate_until` request generates greedily from the context until one of its stop strings;
  `exact_match` is the share of documents whose generation, cut to as many words as the answer has, equals
  the answer (lm-eval reaches the same with a "take the first match" filter). A context should not end in a
  space: a byte-level BPE tokenizer puts a word's space in front of it, so the model continues " word".

- a JSON document asks, in one chat message, for a JSON object with given keys (a tool call's arguments, a form);
  `json_success` answers it greedily through the model's chat template and checks the answer: `json_valid` is the
  share whose answer holds a JSON object (the first `{` onwards, parsed by `json.JSONDecoder.raw_decode`, so a
  code fence or a sentence around it is forgiven, as tool-call parsers forgive it), `schema_match` the share whose
  object also validates against the document's JSON Schema (`jsonschema`, draft 2020-12).

Every metric comes with its standard error, sqrt(p (1 - p) / (n - 1)) for a share, as lm-eval reports it:
a gate (`minillm.eval.gate`) should not fail a change for moving a metric by less than its noise.

A task file is JSON lines, one document a line:

    {"context": "...", "choices": ["...", "..."], "gold": 0}       multiple choice
    {"context": "...", "answer": "...", "until": ["\\n"]}           exact match
    {"context": "...", "schema": {"type": "object", ...}}          a JSON answer (`json_success`)

    task = load_task("minillm/data/tasks/next_line.jsonl")
    scores = multiple_choice(model, tokenizer, task)    # {"acc": ..., "acc_stderr": ..., "acc_norm": ...}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from minillm.model import Transformer
from minillm.tokenizer import Tokenizer

TASKS_DIR = Path(__file__).resolve().parent.parent / "data" / "tasks"


@dataclass
class Task:
    """A named list of documents of one kind: "multiple_choice" or "exact_match"."""

    name: str
    kind: str
    docs: list[dict]


def load_task(path: str | Path) -> Task:
    """Read a task file (JSON lines; see the module); a ValueError names the line and what is wrong with it.

    A bare name (e.g. "next_line") is looked up among the book's tasks in minillm/data/tasks/."""
    path = Path(path)
    if not path.suffix and not path.exists():
        path = TASKS_DIR / f"{path}.jsonl"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TASKS_DIR.glob("*.jsonl")))
        raise FileNotFoundError(f"no task file {path}; the book's tasks are: {known}.")
    docs, kinds = [], set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path.name}, line {number}: not JSON ({e.msg}); each line is one document.") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("context"), str):
            raise ValueError(f"{path.name}, line {number}: a document needs a string 'context'.")
        if "choices" in doc:
            choices, gold = doc["choices"], doc.get("gold")
            if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
                raise ValueError(f"{path.name}, line {number}: 'choices' must be a list of at least 2 strings.")
            if not isinstance(gold, int) or not 0 <= gold < len(choices):
                raise ValueError(f"{path.name}, line {number}: 'gold' must be the index of the right choice, "
                                 f"0..{len(choices) - 1}; got {gold!r}.")
            kinds.add("multiple_choice")
        elif isinstance(doc.get("answer"), str):
            until = doc.setdefault("until", ["\n"])
            if not isinstance(until, list) or not all(isinstance(u, str) and u for u in until):
                raise ValueError(f"{path.name}, line {number}: 'until' must be a list of non-empty stop strings.")
            kinds.add("exact_match")
        elif isinstance(doc.get("schema"), dict):
            kinds.add("json_schema")
        else:
            raise ValueError(f"{path.name}, line {number}: a document needs 'choices' and 'gold' (multiple choice), "
                             "'answer' (exact match) or 'schema' (a JSON answer).")
        docs.append(doc)
    if not docs:
        raise ValueError(f"{path.name} holds no documents.")
    if len(kinds) > 1:
        raise ValueError(f"{path.name} mixes kinds of documents ({', '.join(sorted(kinds))}): keep one kind per file.")
    return Task(path.stem, kinds.pop(), docs)


def share_with_stderr(hits: list[bool]) -> tuple[float, float]:
    """The share of True in `hits` and its standard error, sqrt(p (1 - p) / (n - 1))."""
    n = len(hits)
    p = sum(hits) / n
    return p, math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")


@torch.no_grad()
def loglikelihood(model: Transformer, tokenizer: Tokenizer, requests: list[tuple[str, str]],
                  batch_size: int = 16) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), is_greedy) for each (context, continuation) request.

    Each request's tokens [T] are encode(context + continuation); its continuation is the tokens past
    encode(context) (at least the last one). The model runs teacher-forced over tokens[:-1], keeping the
    last max_seq_len (lm-eval truncates on the left too); rows are padded on the right, which a causal
    model never reads.
    """
    model.eval()
    items = []
    for context, continuation in requests:
        if not continuation:
            raise ValueError(f"an empty continuation after {context[-40:]!r}: there is nothing to score.")
        whole = tokenizer.encode(context + continuation)
        n_continuation = len(whole) - min(len(tokenizer.encode(context)), len(whole) - 1)  # at least one token
        whole = whole[-(model.config.max_seq_len + 1):]
        if len(whole) - n_continuation < 1:
            raise ValueError(f"a continuation of {n_continuation} tokens does not fit the model's context "
                             f"({model.config.max_seq_len}) with a token before it: shorten it.")
        items.append((whole, len(whole) - n_continuation))  # (tokens, index of the continuation's first)
    out = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        width = max(len(ids) - 1 for ids, _ in chunk)
        tokens = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, (ids, _) in enumerate(chunk):
            tokens[row, : len(ids) - 1] = torch.tensor(ids[:-1])
        logprobs = F.log_softmax(model(tokens.to(model.device)).float(), dim=-1).cpu()  # [B, width, V]
        for row, (ids, first) in enumerate(chunk):
            target = torch.tensor(ids[first:])  # the continuation's tokens, predicted from positions first-1..
            rows = logprobs[row, first - 1 : len(ids) - 1]  # [n, V]
            out.append((rows.gather(-1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all())))
    return out


def multiple_choice(model: Transformer, tokenizer: Tokenizer, task: Task, batch_size: int = 16) -> dict[str, float]:
    """acc, acc_norm and their standard errors over a multiple-choice task (see the module)."""
    if task.kind != "multiple_choice":
        raise ValueError(f"task {task.name!r} is {task.kind}, not multiple choice: score it with exact_match.")
    requests = [(d["context"], c) for d in task.docs for c in d["choices"]]
    scores = iter(loglikelihood(model, tokenizer, requests, batch_size))
    acc, acc_norm = [], []
    for d in task.docs:
        lls = [next(scores)[0] for _ in d["choices"]]
        normed = [ll / len(c.encode("utf-8")) for ll, c in zip(lls, d["choices"])]
        acc.append(max(range(len(lls)), key=lls.__getitem__) == d["gold"])
        acc_norm.append(max(range(len(normed)), key=normed.__getitem__) == d["gold"])
    (a, a_err), (n, n_err) = share_with_stderr(acc), share_with_stderr(acc_norm)
    return {"acc": a, "acc_stderr": a_err, "acc_norm": n, "acc_norm_stderr": n_err, "docs": len(task.docs)}


def exact_match(llm: object, task: Task, max_tokens: int = 16) -> dict[str, float]:
    """exact_match and its standard error: greedy generation from each context until its stop strings, through
    `llm` (a `minillm.LLM`, so the engine's options, e.g. a quantised KV cache, are what is measured)."""
    from minillm.sampler.sampling import SamplingParams

    if task.kind != "exact_match":
        raise ValueError(f"task {task.name!r} is {task.kind}, not exact match: score it with multiple_choice.")
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=d["until"]) for d in task.docs]
    outs = llm.generate([d["context"] for d in task.docs], params, use_tqdm=False)
    hits = [" ".join(o.text.split()[: len(d["answer"].split())]) == d["answer"].strip()
            for o, d in zip(outs, task.docs)]
    p, err = share_with_stderr(hits)
    return {"exact_match": p, "exact_match_stderr": err, "docs": len(task.docs)}


def parse_json_object(text: str) -> dict | None:
    """The JSON object an answer holds: parsed from its first `{` (what follows the object is ignored), or None."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        obj, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def json_success(llm: object, task: Task, max_tokens: int = 64, chat: bool = True) -> dict[str, float]:
    """json_valid and schema_match, with their standard errors, over a task of JSON documents (see the module).

    Each document's context is sent greedily through `llm` (a `minillm.LLM`): as one user message through the
    model's chat template (`LLM.chat`) when chat, else as a raw prompt. An answer cut by max_tokens before its
    object closes does not parse, and counts as a failure, as it would for a tool call."""
    try:
        from jsonschema import Draft202012Validator
    except ImportError:
        raise ImportError("json_success checks answers with jsonschema: pip install jsonschema") from None
    from minillm.sampler.sampling import SamplingParams

    if task.kind != "json_schema":
        raise ValueError(f"task {task.name!r} is {task.kind}, not a JSON task: its documents need a 'schema'.")
    validators = [Draft202012Validator(d["schema"]) for d in task.docs]  # a bad schema fails here, before generating
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if chat:
        outs = llm.chat([[{"role": "user", "content": d["context"]}] for d in task.docs], params, use_tqdm=False)
    else:
        outs = llm.generate([d["context"] for d in task.docs], params, use_tqdm=False)
    objects = [parse_json_object(o.text) for o in outs]
    valid = [obj is not None for obj in objects]
    match = [obj is not None and v.is_valid(obj) for obj, v in zip(objects, validators)]
    (v, v_err), (m, m_err) = share_with_stderr(valid), share_with_stderr(match)
    return {"json_valid": v, "json_valid_stderr": v_err, "schema_match": m, "schema_match_stderr": m_err,
            "docs": len(task.docs)}
