"""The drill bank: interview questions for every chapter, checked by code (all chapters).

Drills live in `minillm/book/grading/drills/NN_<slug>.yaml`, one file per chapter:

    chapter: "02"
    title: The physics of inference and the KV cache
    drills:
      - id: 02.kv-llama2-7b-4k-b8          # "<chapter>." + a lowercase slug, unique in the bank
        chapter: "02"                      # optional; must equal the file's chapter
        level: intermediate                # intermediate | advanced | expert
        kind: numeric                      # numeric | choice | open
        tags: [kv-cache, memory]
        question: How many GB ...?
        answer: 17.18                      # numeric: a number in `unit`
        unit: GB
        tolerance: 0.02                    # relative: |response - answer| <= tolerance x |answer|
        compute:                           # numeric only: the minillm call that produces `answer`
          function: minillm.arithmetic.kv_cache_bytes
          args: {config: llama-2-7b, seq_len: 4096, batch: 8}
          attr: time_s                     # optional: take this attribute (or key) of the result
          scale: 1.0e-9                    # optional: multiply the result (here bytes -> GB)
          divide_by:                       # optional: a second call (function, args, attr, scale)
            function: ...                  #   whose value divides the first: a ratio of two computations
        explanation: 2 x 32 x 32 x 128 x 2 bytes ...

A `choice` drill has `choices` (a list of strings) and `answer` equal to the correct one; an
`open` drill has a model `answer` and `key_points` to self-assess against. `tests/book/test_drills.py`
recomputes every numeric answer from its `compute` entry.

Use from a notebook:

    from minillm.book.grading.drills import drill
    drill("02.kv-llama2-7b-4k-b8")               # the question; the answer behind "Reveal the answer"
    drill("02.kv-llama2-7b-4k-b8").check("17 GB")

and from a terminal: `minillm drill --chapter 02`, or a timed mock interview of drills drawn across
chapters and levels, `minillm drill --mock` (see `add_drill_command`).
"""

from __future__ import annotations

import argparse
import difflib
import html
import importlib
import json
import math
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DRILLS_DIR = Path(__file__).resolve().parent / "drills"
LEVELS = ("intermediate", "advanced", "expert")
KINDS = ("numeric", "choice", "open")
HISTORY_FILE = "drill_history.json"

_FIELDS = {"id", "chapter", "level", "kind", "tags", "question", "answer", "explanation",
           "unit", "tolerance", "choices", "key_points", "compute"}
_COMPUTE_FIELDS = {"function", "args", "attr", "scale", "divide_by"}
_FILE_RE = re.compile(r"^(\d\d)_[a-z0-9_]+\.yaml$")
_TAG_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_FLOAT_TEXT_RE = re.compile(r"^[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class DrillError(ValueError):
    """A malformed drill file, an unknown drill id or filter, or an unusable answers file."""


@dataclass
class Drill:
    """One interview drill, as loaded and validated from its chapter's YAML file.

    `answer` is a float for numeric drills, the text of the correct choice for choice drills and a
    model answer for open drills. `source` is the file it came from; `chapter_title` that file's title.
    """

    id: str
    chapter: str
    level: str
    kind: str
    question: str
    answer: float | str
    explanation: str
    tags: list[str] = field(default_factory=list)
    unit: str | None = None
    tolerance: float | None = None
    choices: list[str] | None = None
    key_points: list[str] | None = None
    compute: dict[str, Any] | None = None
    source: str = ""
    chapter_title: str = ""

    @property
    def answer_letter(self) -> str | None:
        """The letter (A, B, ...) of the correct choice; None unless a choice drill."""
        if self.kind != "choice":
            return None
        return chr(ord("A") + self.choices.index(self.answer))

    def answer_text(self) -> str:
        """The answer as shown to a reader: "17.18 GB", "C. The MLPs", or the model answer."""
        if self.kind == "numeric":
            return f"{_fmt(self.answer)} {self.unit}"
        if self.kind == "choice":
            return f"{self.answer_letter}. {self.answer}"
        return str(self.answer)


# ---------------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------------


def _fail(source: str, drill_id: str | None, fld: str | None, problem: str) -> DrillError:
    where = source
    if drill_id is not None:
        where += f": drill {drill_id!r}"
    if fld is not None:
        where += f": field {fld!r}"
    return DrillError(f"{where}: {problem}")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _str_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v.strip() for v in value)


def _compute_problem(spec: object, nested: bool) -> str | None:
    """What is wrong with a `compute` mapping (or its `divide_by`), or None if it is well formed."""
    keys = _COMPUTE_FIELDS - {"divide_by"} if nested else _COMPUTE_FIELDS
    if not isinstance(spec, dict):
        return "must be a mapping with `function` and `args`."
    extra = set(spec) - keys
    if extra:
        return f"unknown key {sorted(extra)[0]!r}; the keys are {', '.join(sorted(keys))}."
    fn = spec.get("function")
    if not isinstance(fn, str) or not re.fullmatch(r"minillm(\.\w+)+", fn):
        return f"`function` must be a dotted path inside minillm, got {fn!r}."
    if not isinstance(spec.get("args", {}), dict):
        return "`args` must be a mapping of keyword arguments."
    for name, value in spec.get("args", {}).items():
        if isinstance(value, str) and _FLOAT_TEXT_RE.match(value):
            return (f"argument {name}={value!r} was read as text: YAML needs a dot and a signed exponent for a "
                    "float, e.g. 80.0e+9.")
    if "attr" in spec and not isinstance(spec["attr"], str):
        return "`attr` must be an attribute name."
    if "scale" in spec and not _is_number(spec["scale"]):
        return "`scale` must be a number."
    return None


def _parse_drill(raw: object, index: int, chapter: str, title: str, source: str) -> Drill:
    if not isinstance(raw, dict):
        raise _fail(source, f"#{index + 1}", None, "each entry of `drills` must be a mapping of fields.")
    did = raw.get("id")
    if not isinstance(did, str) or not re.fullmatch(rf"{chapter}\.[a-z0-9][a-z0-9.-]*", did):
        raise _fail(source, str(did) if did is not None else f"#{index + 1}", "id",
                    f"must be a string like '{chapter}.kv-sizing': the chapter id, a dot, a lowercase slug.")

    def fail(fld: str, problem: str) -> DrillError:
        return _fail(source, did, fld, problem)

    unknown = set(raw) - _FIELDS
    if unknown:
        raise fail(sorted(unknown)[0], f"unknown field; the fields are {', '.join(sorted(_FIELDS))}.")
    for fld in ("level", "kind", "question", "answer", "explanation", "tags"):
        if fld not in raw:
            raise fail(fld, "missing (required for every drill).")
    if str(raw.get("chapter", chapter)) != chapter:
        raise fail("chapter", f"is {raw['chapter']!r} but the file holds chapter {chapter!r}.")
    if raw["level"] not in LEVELS:
        raise fail("level", f"must be one of {', '.join(LEVELS)}, got {raw['level']!r}.")
    kind = raw["kind"]
    if kind not in KINDS:
        raise fail("kind", f"must be one of {', '.join(KINDS)}, got {kind!r}.")
    for fld in ("question", "explanation"):
        if not isinstance(raw[fld], str) or not raw[fld].strip():
            raise fail(fld, "must be non-empty text.")
    tags = raw["tags"]
    if not _str_list(tags) or not all(_TAG_RE.match(t) for t in tags):
        raise fail("tags", "must be a non-empty list of lowercase slugs such as [kv-cache, memory].")

    allowed = {"numeric": {"unit", "tolerance", "compute"}, "choice": {"choices"}, "open": {"key_points"}}[kind]
    for fld in ("unit", "tolerance", "compute", "choices", "key_points"):
        if fld in raw and fld not in allowed:
            raise fail(fld, f"does not belong to a {kind} drill (it takes {', '.join(sorted(allowed))}).")
        if fld not in raw and fld in allowed:
            raise fail(fld, f"missing (required for a {kind} drill).")

    answer = raw["answer"]
    compute = None
    if kind == "numeric":
        if not _is_number(answer):
            raise fail("answer", f"a numeric drill's answer must be a number, got {answer!r}.")
        if not isinstance(raw["unit"], str) or not raw["unit"].strip():
            raise fail("unit", "must name the answer's unit, e.g. GB or ms.")
        tol = raw["tolerance"]
        if not _is_number(tol) or not 0 < tol < 1:
            raise fail("tolerance", f"must be a relative tolerance in (0, 1), e.g. 0.02; got {tol!r}.")
        compute = raw["compute"]
        problem = _compute_problem(compute, nested=False)
        if problem is None and "divide_by" in compute:
            inner = _compute_problem(compute["divide_by"], nested=True)
            problem = None if inner is None else f"in `divide_by`: {inner}"
        if problem is not None:
            raise fail("compute", problem)
        answer = float(answer)
    elif kind == "choice":
        choices = raw["choices"]
        if not _str_list(choices) or len(choices) < 2:
            raise fail("choices", "must be a list of at least two non-empty strings.")
        if len({_norm(c) for c in choices}) != len(choices):
            raise fail("choices", "must be distinct.")
        if not isinstance(answer, str) or answer not in choices:
            raise fail("answer", "must be the text of one of the choices, exactly.")
    else:
        if not _str_list(raw["key_points"]):
            raise fail("key_points", "must be a non-empty list of strings.")
        if not isinstance(answer, str) or not answer.strip():
            raise fail("answer", "an open drill's answer is a model answer: non-empty text.")

    return Drill(
        id=did, chapter=chapter, level=raw["level"], kind=kind, question=raw["question"].strip(),
        answer=answer.strip() if isinstance(answer, str) else answer, explanation=raw["explanation"].strip(),
        tags=list(tags), unit=raw.get("unit"), tolerance=raw.get("tolerance"),
        choices=list(raw["choices"]) if "choices" in raw else None,
        key_points=list(raw["key_points"]) if "key_points" in raw else None,
        compute=compute, source=source, chapter_title=title,
    )


def _load_file(path: Path) -> list[Drill]:
    source = path.name
    m = _FILE_RE.match(source)
    if not m:
        raise _fail(source, None, None, "drill files are named NN_<slug>.yaml, e.g. 02_kv_cache.yaml.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise _fail(source, None, None, f"is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise _fail(source, None, None, "must be a mapping with keys chapter, title and drills.")
    chapter = str(data.get("chapter", ""))
    if chapter != m.group(1):
        raise _fail(source, None, "chapter", f"must be {m.group(1)!r} (quoted), as in the file name; got {chapter!r}.")
    title = data.get("title")
    if not isinstance(title, str) or not title.strip():
        raise _fail(source, None, "title", "must be the chapter's title.")
    raw = data.get("drills")
    if not isinstance(raw, list) or not raw:
        raise _fail(source, None, "drills", "must be a non-empty list of drills.")
    extra = set(data) - {"chapter", "title", "drills"}
    if extra:
        raise _fail(source, None, sorted(extra)[0], "unknown top-level key; the keys are chapter, title, drills.")
    return [_parse_drill(d, i, chapter, title.strip(), source) for i, d in enumerate(raw)]


def _load_all(directory: str | Path | None = None) -> list[Drill]:
    folder = Path(directory) if directory is not None else DRILLS_DIR
    files = sorted(folder.glob("*.yaml"))
    if not files:
        raise DrillError(f"no drill files (*.yaml) found in {folder}.")
    drills: list[Drill] = []
    seen: dict[str, str] = {}
    for path in files:
        for d in _load_file(path):
            if d.id in seen:
                raise _fail(d.source, d.id, "id", f"is also used in {seen[d.id]}; drill ids must be unique.")
            seen[d.id] = d.source
            drills.append(d)
    return drills


def _chapter_id(chapter: int | str) -> str:
    text = str(chapter).strip()
    if not text.isdigit():
        raise DrillError(f"chapter must be a number such as 02, got {chapter!r}.")
    return f"{int(text):02d}"


def load_drills(
    chapter: int | str | None = None,
    tag: str | None = None,
    level: str | None = None,
    directory: str | Path | None = None,
) -> list[Drill]:
    """Every drill of the bank (validated), in chapter and file order, optionally filtered.

    `chapter` ("02", "2" or 2), `tag` and `level` must each name something that exists in the bank;
    an unknown one raises DrillError (a ValueError) listing the valid values. A valid combination
    that matches nothing returns []. Any malformed drill raises DrillError naming file, id and field.
    `directory` reads another folder of drill files (for tests).
    """
    every = _load_all(directory)
    drills = every
    if chapter is not None:
        cid = _chapter_id(chapter)
        chapters = sorted({d.chapter for d in every})
        if cid not in chapters:
            raise DrillError(f"no drills for chapter {cid}; chapters with drills: {', '.join(chapters)}.")
        drills = [d for d in drills if d.chapter == cid]
    if tag is not None:
        tags = sorted({t for d in every for t in d.tags})
        if tag not in tags:
            close = difflib.get_close_matches(tag, tags, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise DrillError(f"unknown tag {tag!r}{hint}; the tags are: {', '.join(tags)}.")
        drills = [d for d in drills if tag in d.tags]
    if level is not None:
        if level not in LEVELS:
            raise DrillError(f"unknown level {level!r}; the levels are: {', '.join(LEVELS)}.")
        drills = [d for d in drills if d.level == level]
    return drills


def get_drill(drill_id: str, directory: str | Path | None = None) -> Drill:
    """The drill with this id; DrillError with the closest ids if there is none."""
    drills = _load_all(directory)
    for d in drills:
        if d.id == drill_id:
            return d
    close = difflib.get_close_matches(str(drill_id), [d.id for d in drills], n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else "; list them with load_drills()."
    raise DrillError(f"unknown drill id {drill_id!r}{hint}")


# ---------------------------------------------------------------------------------------------
# Computing and checking answers
# ---------------------------------------------------------------------------------------------


def _evaluate(drill_id: str, spec: dict[str, Any]) -> float:
    module_name, _, name = spec["function"].rpartition(".")
    try:
        func = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise DrillError(f"drill {drill_id!r}: cannot find {spec['function']}: {e}") from None
    result = func(**spec.get("args", {}))
    if "attr" in spec:
        attr = spec["attr"]
        result = result[attr] if isinstance(result, dict) else getattr(result, attr)
    return float(result) * float(spec.get("scale", 1.0))


def compute_answer(drill: Drill) -> float:
    """Evaluate a numeric drill's `compute` entry: function(**args), then .attr, then x scale; divided by
    the same evaluation of its `divide_by` entry when it has one (a ratio of two computations)."""
    if drill.compute is None:
        raise DrillError(f"drill {drill.id!r} is a {drill.kind} drill; only numeric drills have a computation.")
    value = _evaluate(drill.id, drill.compute)
    if "divide_by" in drill.compute:
        value /= _evaluate(drill.id, drill.compute["divide_by"])
    return value


def _fmt(x: float | str) -> str:
    if isinstance(x, str):
        return x
    if float(x).is_integer() and abs(x) < 1e15:
        return f"{int(x):,}"
    return f"{x:,.6g}" if abs(x) >= 1e-3 else f"{x:.4g}"


def _pct(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def _norm(text: str) -> str:
    return " ".join(str(text).casefold().replace("–", "-").replace("—", "-").split()).rstrip(".")


# Units a numeric answer may be given in, converted to the drill's unit when both are in one family.
_UNIT_SCALE: dict[str, tuple[str, float]] = {
    "b": ("bytes", 1), "byte": ("bytes", 1), "bytes": ("bytes", 1),
    "kb": ("bytes", 1e3), "mb": ("bytes", 1e6), "gb": ("bytes", 1e9), "tb": ("bytes", 1e12),
    "kib": ("bytes", 2**10), "mib": ("bytes", 2**20), "gib": ("bytes", 2**30), "tib": ("bytes", 2**40),
    "s": ("time", 1), "sec": ("time", 1), "second": ("time", 1), "seconds": ("time", 1),
    "ms": ("time", 1e-3), "us": ("time", 1e-6), "µs": ("time", 1e-6), "ns": ("time", 1e-9),
}
_NUMBER_RE = re.compile(r"^\s*(?:usd|\$)?\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*(.*?)\s*$", re.IGNORECASE)


def _parse_number(response: str | float) -> tuple[float, str] | None:
    """(value, unit text) from "2.1", "2.1 GB", "17,179,869,184 bytes", "$0.46", "1.5e9"; None if no number."""
    if isinstance(response, bool):
        return None
    if isinstance(response, (int, float)):
        return float(response), ""
    text = re.sub(r"(?<=\d)[,_\u2009\u202f](?=\d{3}\b)", "", str(response))
    m = _NUMBER_RE.match(text)
    if not m:
        return None
    return float(m.group(1)), m.group(2)


def _unit_key(unit: str) -> str:
    return unit.strip().split(" ")[0].casefold() if unit.strip() else ""


def _unreadable(drill: Drill, response: str | float) -> str | None:
    """Why `response` cannot be graded at all (no number, no such choice), or None if it can."""
    if drill.kind == "numeric" and _parse_number(response) is None:
        return f"could not read a number from {response!r}; answer with a number in {drill.unit}."
    if drill.kind == "choice":
        letters = f"A-{chr(ord('A') + len(drill.choices) - 1)}"
        text = str(response).strip()
        m = re.fullmatch(r"\(?([A-Za-z])[).:]?", text)
        if m and ord(m.group(1).upper()) - ord("A") >= len(drill.choices):
            return f"there is no choice {m.group(1).upper()}; answer with a letter {letters}."
        if not m and not any(_norm(c) == _norm(text) for c in drill.choices):
            return f"answer with a letter {letters} or the text of one choice; got {text!r}."
    return None


def check_answer(drill: Drill, response: str | float) -> tuple[bool, str]:
    """Check a response: (right?, a one-line verdict that gives the answer).

    numeric: a number within the drill's relative tolerance; "2.1", "2.1 GB", "2,100 MB" and
        "$0.46" are read (bytes and time units are converted to the drill's unit).
    choice: the letter (A, "b", "(c)") or the text of a choice.
    open: cannot be machine-graded: any non-empty response counts, and the message lists the key
        points to compare it with (the terminal quiz asks the reader to self-assess).
    """
    problem = _unreadable(drill, response)
    if problem is not None:
        return False, problem
    if drill.kind == "numeric":
        value, unit = _parse_number(response)
        want_unit, got_unit = _UNIT_SCALE.get(_unit_key(drill.unit)), _UNIT_SCALE.get(_unit_key(unit))
        if want_unit and got_unit and want_unit[0] == got_unit[0]:
            value = value * got_unit[1] / want_unit[1]
        answer = float(drill.answer)
        err = abs(value - answer) / abs(answer) if answer else abs(value)
        yours = f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
        if err <= drill.tolerance:
            return True, f"Right: {drill.answer_text()} (yours: {yours} {drill.unit}, within {_pct(drill.tolerance)})."
        off = f"{err:.0%} off" if answer else "off"
        return False, (f"Not quite: the answer is {drill.answer_text()}; yours, {yours} {drill.unit}, "
                       f"is {off} (within {_pct(drill.tolerance)} counts).")
    if drill.kind == "choice":
        text = str(response).strip()
        m = re.fullmatch(r"\(?([A-Za-z])[).:]?", text)
        if m:
            chosen = drill.choices[ord(m.group(1).upper()) - ord("A")]
        else:
            chosen = next(c for c in drill.choices if _norm(c) == _norm(text))
        if chosen == drill.answer:
            return True, f"Right: {drill.answer_text()}"
        mine = chr(ord("A") + drill.choices.index(chosen))
        return False, f"Not quite: the answer is {drill.answer_text()} (you chose {mine})."
    points = "\n".join(f"  - {p}" for p in drill.key_points)
    if not str(response).strip():
        return False, f"No answer given. The key points:\n{points}"
    return True, f"Self-assessed: compare your answer with the key points:\n{points}"


# ---------------------------------------------------------------------------------------------
# Notebooks and the book
# ---------------------------------------------------------------------------------------------


def _compute_call(drill: Drill) -> str:
    def one(spec: dict[str, Any]) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in spec.get("args", {}).items())
        call = f"{spec['function']}({args})"
        if "attr" in spec:
            call += f".{spec['attr']}"
        if "scale" in spec:
            call += f" × {spec['scale']:g}"
        return call

    spec = drill.compute or {}
    if "divide_by" not in spec:
        return one(spec)
    return f"({one(spec)}) ÷ ({one(spec['divide_by'])})"


class DrillCard:
    """A drill shown in a notebook: the question, with the answer hidden behind a reveal."""

    def __init__(self, drill: Drill) -> None:
        self.drill = drill

    def _repr_html_(self) -> str:
        d, e = self.drill, html.escape
        meta = f"{e(d.level)} · {e(', '.join(d.tags))}"
        parts = [
            '<div class="minillm-drill" style="border-left:4px solid #7a8aa0;padding:0.3em 0.9em;margin:0.6em 0">',
            f"<p><strong>Drill {e(d.id)}</strong> <small>({meta})</small></p>",
            f"<p>{_html_text(d.question)}</p>",
        ]
        if d.kind == "choice":
            parts.append('<ol type="A">' + "".join(f"<li>{e(c)}</li>" for c in d.choices) + "</ol>")
        elif d.kind == "numeric":
            parts.append(f"<p><em>Answer in {e(d.unit)}; within {_pct(d.tolerance)} counts.</em></p>")
        parts.append("<details><summary>Reveal the answer</summary>")
        parts.append(f"<p><strong>Answer:</strong> {_html_text(d.answer_text())}</p>")
        if d.kind == "open":
            parts.append("<p>Key points:</p><ul>" + "".join(f"<li>{e(p)}</li>" for p in d.key_points) + "</ul>")
        parts.append(f"<p>{_html_text(d.explanation)}</p>")
        if d.compute:
            parts.append(f"<p><small>Computed by <code>{e(_compute_call(d))}</code></small></p>")
        parts.append("</details>")
        parts.append(f'<p><small>Check yourself: <code>drill("{e(d.id)}").check(...)</code></small></p></div>')
        return "\n".join(parts)

    def __repr__(self) -> str:
        d = self.drill
        lines = [f"Drill {d.id} ({d.level}; {', '.join(d.tags)})", d.question]
        if d.kind == "choice":
            lines += [f"  {chr(ord('A') + i)}. {c}" for i, c in enumerate(d.choices)]
        elif d.kind == "numeric":
            lines.append(f"(answer in {d.unit}; within {_pct(d.tolerance)} counts)")
        lines.append("Answer hidden: call .check(response) or .reveal().")
        return "\n".join(lines)

    def check(self, response: str | float) -> None:
        """Print a right/wrong line for `response` (and the answer)."""
        ok, message = check_answer(self.drill, response)
        print(("✓ " if ok else "✗ ") + message)

    def reveal(self) -> None:
        """Print the answer and its explanation."""
        d = self.drill
        print(f"Answer: {d.answer_text()}")
        if d.key_points:
            print("Key points:\n" + "\n".join(f"  - {p}" for p in d.key_points))
        print(d.explanation)


def _html_text(text: str) -> str:
    return "<br>".join(html.escape(line) for line in text.splitlines())


def drill(drill_id: str) -> DrillCard:
    """The drill `drill_id` for a notebook: displays the question with the answer behind a reveal."""
    return DrillCard(get_drill(drill_id))


_MD_SPECIAL = re.compile(r"([\\`*_$<>\[\]|#])")


def _md(text: str) -> str:
    return _MD_SPECIAL.sub(r"\\\1", text)


def render_markdown(drills: Iterable[Drill]) -> str:
    """A MyST-Markdown page body of `drills`, grouped by chapter, each answer inside <details>."""
    by_chapter: dict[str, list[Drill]] = {}
    for d in drills:
        by_chapter.setdefault(d.chapter, []).append(d)
    out: list[str] = []
    for chapter in sorted(by_chapter):
        group = by_chapter[chapter]
        title = group[0].chapter_title or f"Chapter {chapter}"
        out += [f"## Chapter {chapter}: {_md(title)}", ""]
        for d in group:
            out += [f"### {d.id}", "", f"*{d.level} · {_md(', '.join(d.tags))}*", "", _md(d.question), ""]
            if d.kind == "choice":
                out += [f"- **{chr(ord('A') + i)}.** {_md(c)}" for i, c in enumerate(d.choices)] + [""]
            elif d.kind == "numeric":
                out += [f"Answer in {_md(d.unit)} (within {_pct(d.tolerance)}).", ""]
            out += ["<details>", "<summary>Reveal the answer</summary>", ""]
            out += [f"**Answer:** {_md(d.answer_text())}", ""]
            if d.kind == "open":
                out += ["Key points:", ""] + [f"- {_md(p)}" for p in d.key_points] + [""]
            out += [_md(d.explanation), ""]
            if d.compute:
                out += [f"Computed by `{_compute_call(d)}`.", ""]
            out += ["</details>", ""]
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------
# The terminal quiz: `minillm drill`
# ---------------------------------------------------------------------------------------------


def minillm_home() -> Path:
    """Where minillm keeps user state: $MINILLM_HOME, else $XDG_DATA_HOME/minillm, else ~/.local/share/minillm."""
    if os.environ.get("MINILLM_HOME"):
        return Path(os.environ["MINILLM_HOME"]).expanduser()
    if os.environ.get("XDG_DATA_HOME"):
        return Path(os.environ["XDG_DATA_HOME"]).expanduser() / "minillm"
    return Path.home() / ".local" / "share" / "minillm"


def history_path() -> Path:
    """The quiz history file, `minillm_home() / "drill_history.json"`."""
    return minillm_home() / HISTORY_FILE


def load_history(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """Past results, drill id -> {"attempts", "right", "last" ("right"/"wrong"), "last_time"}."""
    path = path or history_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return dict(data["drills"])
    except (ValueError, KeyError, TypeError):
        raise DrillError(f"cannot read the drill history {path}; delete it to start afresh.") from None


def save_history(history: dict[str, dict[str, Any]], path: Path | None = None) -> None:
    path = path or history_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": 1, "drills": history}, indent=1, sort_keys=True), encoding="utf-8")
    tmp.replace(path)


def quiz_order(drills: list[Drill], history: dict[str, dict[str, Any]]) -> list[Drill]:
    """Drills last answered wrong first, then never-asked ones (bank order), then the rest (oldest first)."""
    def key(item: tuple[int, Drill]) -> tuple[int, float, int]:
        i, d = item
        h = history.get(d.id)
        if h is None:
            return (1, 0.0, i)
        return (0 if h.get("last") == "wrong" else 2, float(h.get("last_time", 0)), i)

    return [d for _, d in sorted(enumerate(drills), key=key)]


def _read_answers(path: str, known: list[Drill]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise DrillError(f"answers file {path} not found.")
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise DrillError(f"cannot parse answers file {path}: {e}".splitlines()[0]) from None
    if not isinstance(data, dict) or not data:
        raise DrillError(f"answers file {path} must map drill ids to answers, e.g. {{'02.kv-per-token': 524288}}.")
    ids = {d.id for d in known}
    unknown = [str(k) for k in data if str(k) not in ids]
    if unknown:
        raise DrillError(f"answers file {path} names unknown drill id(s): {', '.join(unknown[:5])}.")
    return {str(k): v for k, v in data.items()}


def _ask(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


def _clock() -> float:
    """Seconds on a monotonic clock: how the mock interview times an answer (tests replace it)."""
    return time.monotonic()


def _score_open(drill: Drill, response: Any, interactive: bool) -> tuple[bool, str] | None:
    if isinstance(response, bool):  # an answers file may give the self-assessment directly
        points = "\n".join(f"  - {p}" for p in drill.key_points)
        verdict = "covered" if response else "missed"
        return response, f"Self-assessed as {verdict} (from the answers file). The key points:\n{points}"
    ok, message = check_answer(drill, response)
    if ok and interactive:
        print(message)
        reply = _ask("Did your answer cover these points? [y/N] ")
        if reply is None:
            return None
        return reply.strip().lower() in ("y", "yes"), "(self-assessed)"
    return ok, message


def _show(drill: Drill, i: int, total: int, note: str = "") -> None:
    print(f"\n[{i}/{total}] {drill.id} ({drill.level}; {', '.join(drill.tags)}){note}")
    print(drill.question)
    if drill.kind == "choice":
        for j, c in enumerate(drill.choices):
            print(f"  {chr(ord('A') + j)}. {c}")


def _is_quit(response: str) -> bool:
    return response.strip().lower() in ("q", "quit")


def _response(drill: Drill, answers: dict[str, Any] | None) -> Any | None:
    """The reader's answer to `drill`: from the answers file, else typed (asked again until it can be
    graded). None when the reader stops (q, or the end of input)."""
    if answers is not None:
        print(f"> {answers[drill.id]}")
        return answers[drill.id]
    hint = {"numeric": f"in {drill.unit}", "choice": "a letter", "open": "a sentence or two"}[drill.kind]
    response = _ask(f"Your answer ({hint}; q to stop): ")
    while response is not None and not _is_quit(response):
        problem = _unreadable(drill, response) if response.strip() else None
        if problem is None:
            return response
        response = _ask(f"{problem[0].upper()}{problem[1:]} Try again: ")
    print()
    return None


def _grade(drill: Drill, response: Any, interactive: bool) -> bool | None:
    """Check `response`, print the verdict and the explanation; None if the reader stopped mid-way."""
    if drill.kind == "open":
        scored = _score_open(drill, response, interactive)
        if scored is None:
            return None
        ok, message = scored
    else:
        ok, message = check_answer(drill, response)
    print(("✓ " if ok else "✗ ") + message)
    print(drill.explanation)
    return ok


def _remember(history: dict[str, dict[str, Any]], path: Path, drill: Drill, ok: bool) -> None:
    h = history.setdefault(drill.id, {"attempts": 0, "right": 0})
    h["attempts"] += 1
    h["right"] += int(ok)
    h["last"] = "right" if ok else "wrong"
    h["last_time"] = time.time()
    save_history(history, path)


def _quiz_drills(args: argparse.Namespace) -> tuple[list[Drill], dict[str, Any] | None]:
    """The drills the options select and the answers file's answers (None without one); DrillError if none."""
    drills = load_drills(chapter=args.chapter, tag=args.tag, level=args.level)
    if not drills:
        given = " ".join(f"--{k} {v}" for k, v in (("chapter", args.chapter), ("tag", args.tag),
                                                  ("level", args.level)) if v is not None)
        raise DrillError(f"no drills match {given}; loosen the filters.")
    if args.n is not None and args.n < 1:
        raise DrillError(f"-n must be at least 1, got {args.n}.")
    if not args.mock and (args.seed is not None or args.report):
        raise DrillError("--seed and --report belong to a mock interview; add --mock.")
    answers = None
    if args.answers:
        answers = _read_answers(args.answers, load_drills())
        drills = [d for d in drills if d.id in answers]
        if not drills:
            raise DrillError(f"none of the drills in {args.answers} match the filters given.")
    return drills, answers


def cmd_drill(args: argparse.Namespace) -> int:
    """The `minillm drill` handler: quiz, score, explain, and remember the results. Returns an exit code."""
    try:
        drills, answers = _quiz_drills(args)
        path = history_path()
        history = load_history(path)
    except DrillError as e:
        print(f"minillm drill: error: {e}", file=sys.stderr)
        return 1
    if args.mock:
        return _mock_interview(args, drills, answers, history, path)

    selected = quiz_order(drills, history)
    limit = args.n if args.n is not None else (len(selected) if answers is not None else 10)
    selected = selected[:limit]
    asked = right = 0
    for i, d in enumerate(selected, 1):
        _show(d, i, len(selected))
        response = _response(d, answers)
        ok = None if response is None else _grade(d, response, interactive=answers is None)
        if ok is None:
            break
        asked += 1
        right += ok
        _remember(history, path, d, ok)

    if asked:
        print(f"\nScore: {right}/{asked} ({right / asked:.0%}). History: {path}")
    else:
        print("\nNo drills answered.")
    return 0


# ---------------------------------------------------------------------------------------------
# The mock interview: `minillm drill --mock`
# ---------------------------------------------------------------------------------------------

# The time an interviewer would allow an answer, by level; a mock interview flags answers that take longer.
MOCK_TARGET_S = {"intermediate": 120.0, "advanced": 240.0, "expert": 360.0}


@dataclass
class MockAnswer:
    """One answered question of a mock interview: the drill, whether it was right, and the seconds it took."""

    drill: Drill
    right: bool
    seconds: float


def mock_selection(drills: list[Drill], n: int = 10, seed: int = 0) -> list[Drill]:
    """`n` drills for a mock interview, the same for the same `seed`: spread over chapters first, then levels.

    The drills are shuffled with `seed`; each pick is the first drill, in that order, of a chapter asked
    least so far and, among those, of a level asked least so far. So ten picks from a bank of ten chapters
    cover all ten, with the levels as even as the chapters allow. Returned easiest level first (a warm-up,
    as interviews go), in pick order within a level. Fewer than `n` drills give all of them.
    """
    if n < 1:
        raise DrillError(f"a mock interview needs at least 1 question, got {n}.")
    pool = list(drills)
    random.Random(seed).shuffle(pool)
    per_chapter: Counter[str] = Counter()
    per_level: Counter[str] = Counter()
    picked: list[Drill] = []
    while pool and len(picked) < n:
        d = min(pool, key=lambda x: (per_chapter[x.chapter], per_level[x.level]))  # first of the least asked
        pool.remove(d)
        picked.append(d)
        per_chapter[d.chapter] += 1
        per_level[d.level] += 1
    return sorted(picked, key=lambda d: LEVELS.index(d.level))


def _tally(answers: list[MockAnswer], keys: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for a in answers:
        for key in keys(a.drill):
            g = out.setdefault(key, {"asked": 0, "right": 0, "seconds": 0.0})
            g["asked"] += 1
            g["right"] += int(a.right)
            g["seconds"] += a.seconds
    return out


def mock_report(answers: list[MockAnswer], planned: int | None = None, seed: int | None = None) -> dict[str, Any]:
    """The score of a mock interview, as a JSON-ready mapping.

    count, right and seconds overall; `planned` questions (answered or not) and the `seed`; by_level
    (in LEVELS order), by_tag and by_chapter, each name -> {"asked", "right", "seconds"}; and questions,
    one entry per answer: id, chapter, level, kind, tags, right, seconds, target_s and over_target
    (seconds beyond `MOCK_TARGET_S` for its level).
    """
    by_level = _tally(answers, lambda d: [d.level])
    return {
        "seed": seed,
        "planned": len(answers) if planned is None else planned,
        "count": len(answers),
        "right": sum(a.right for a in answers),
        "seconds": sum(a.seconds for a in answers),
        "by_level": {lv: by_level[lv] for lv in LEVELS if lv in by_level},
        "by_tag": dict(sorted(_tally(answers, lambda d: d.tags).items())),
        "by_chapter": dict(sorted(_tally(answers, lambda d: [d.chapter]).items())),
        "questions": [
            {"id": a.drill.id, "chapter": a.drill.chapter, "level": a.drill.level, "kind": a.drill.kind,
             "tags": list(a.drill.tags), "right": a.right, "seconds": a.seconds,
             "target_s": MOCK_TARGET_S[a.drill.level], "over_target": a.seconds > MOCK_TARGET_S[a.drill.level]}
            for a in answers
        ],
    }


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"


def _score_line(name: str, g: dict[str, Any], width: int) -> str:
    per = g["seconds"] / g["asked"]
    return (f"  {name:<{width}} {g['right']:>2}/{g['asked']:<2} {g['right'] / g['asked']:>5.0%}"
            f"   {_duration(g['seconds']):>12} in all, {_duration(per)} each")


def format_mock_report(report: dict[str, Any]) -> str:
    """The end-of-interview report printed by `minillm drill --mock`: totals, then scores by level, tag
    (weakest first) and chapter, then every question with its time."""
    n, right = report["count"], report["right"]
    if not n:
        return "Mock interview: no questions answered."
    skipped = report["planned"] - n
    lines = [f"Mock interview report: {right}/{n} right ({right / n:.0%}) in {_duration(report['seconds'])}"
             + (f"; {skipped} of {report['planned']} questions not reached." if skipped else ".")]
    lines += ["", "By level:"] + [_score_line(k, g, 12) for k, g in report["by_level"].items()]
    tags = sorted(report["by_tag"].items(), key=lambda kv: (kv[1]["right"] / kv[1]["asked"], -kv[1]["asked"], kv[0]))
    width = max(len(t) for t, _ in tags)
    lines += ["", "By tag (weakest first):"] + [_score_line(t, g, width) for t, g in tags]
    lines += ["", "By chapter:"] + [_score_line(c, g, 2) for c, g in report["by_chapter"].items()]
    lines += ["", "Questions:"]
    for i, q in enumerate(report["questions"], 1):
        over = f" (over the {_duration(q['target_s'])} target)" if q["over_target"] else ""
        lines.append(f"  {i:>2}. {'✓' if q['right'] else '✗'} {q['id']:<34} {q['level']:<12} "
                     f"{_duration(q['seconds'])}{over}")
    weakest, g = tags[0]
    if g["right"] < g["asked"]:
        lines += ["", f"Practise next: minillm drill --tag {weakest}"]
    if report["seed"] is not None:
        lines.append(f"Repeat this interview: minillm drill --mock --seed {report['seed']} -n {report['planned']}")
    return "\n".join(lines)


def _mock_interview(args: argparse.Namespace, drills: list[Drill], answers: dict[str, Any] | None,
                    history: dict[str, dict[str, Any]], path: Path) -> int:
    """Ask `mock_selection(...)` one question at a time, timing each answer; print the report at the end."""
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1_000_000)
    chosen = mock_selection(drills, args.n if args.n is not None else 10, seed)
    levels = Counter(d.level for d in chosen)
    mix = ", ".join(f"{levels[lv]} {lv}" for lv in LEVELS if levels[lv])
    print(f"Mock interview: {len(chosen)} questions from {len({d.chapter for d in chosen})} chapters ({mix}), "
          f"seed {seed}. Each answer is timed against a target per level; q stops early.")
    done: list[MockAnswer] = []
    for i, d in enumerate(chosen, 1):
        _show(d, i, len(chosen), f" · target {_duration(MOCK_TARGET_S[d.level])}")
        start = _clock()
        response = _response(d, answers)
        seconds = _clock() - start
        ok = None if response is None else _grade(d, response, interactive=answers is None)
        if ok is None:
            break
        print(f"[answered in {_duration(seconds)}]")
        done.append(MockAnswer(d, ok, seconds))
        _remember(history, path, d, ok)
    report = mock_report(done, planned=len(chosen), seed=seed)
    print("\n" + format_mock_report(report))
    if args.report:
        out = Path(args.report)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"version": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), **report}, indent=1),
                       encoding="utf-8")
        print(f"Report written to {out}")
    return 0


def add_drill_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register `minillm drill [--chapter N] [--tag T] [--level L] [-n K] [--answers FILE] [--mock [--seed S]
    [--report FILE]]` on an argparse subparsers object; the handler (`cmd_drill`) is set as `func` and returns
    an exit code."""
    p = subparsers.add_parser(
        "drill",
        help="quiz yourself on the book's interview drills, or sit a timed mock interview",
        description="Ask the book's interview drills, check and explain each answer, and keep score. Drills you "
                    "missed last time come first. With --mock, a timed mock interview: K drills (default 10) "
                    "drawn with a seed across chapters and levels, each answer timed, and a report by level, "
                    "tag and chapter at the end. Results are kept in $MINILLM_HOME/drill_history.json.",
    )
    p.add_argument("--chapter", help="only this chapter, e.g. 02")
    p.add_argument("--tag", help="only drills with this tag, e.g. kv-cache")
    p.add_argument("--level", help=f"only this level: {', '.join(LEVELS)}")
    p.add_argument("-n", type=int, default=None, metavar="K",
                   help="ask at most K drills (default 10; with --answers and no --mock, every drill in the file)")
    p.add_argument("--answers", metavar="FILE",
                   help="answer from a YAML or JSON file mapping drill id -> answer, without a terminal "
                        "(for an open drill, true/false records your self-assessment)")
    p.add_argument("--mock", action="store_true",
                   help="a timed mock interview: drills mixed across chapters and levels, scored at the end")
    p.add_argument("--seed", type=int, default=None,
                   help="with --mock: the seed that picks the questions (printed, so an interview can be repeated)")
    p.add_argument("--report", metavar="FILE", help="with --mock: also write the report as JSON to FILE")
    p.set_defaults(func=cmd_drill)
    return p


__all__ = [
    "DRILLS_DIR",
    "KINDS",
    "LEVELS",
    "MOCK_TARGET_S",
    "Drill",
    "DrillCard",
    "DrillError",
    "MockAnswer",
    "add_drill_command",
    "check_answer",
    "cmd_drill",
    "compute_answer",
    "drill",
    "format_mock_report",
    "get_drill",
    "history_path",
    "load_drills",
    "load_history",
    "minillm_home",
    "mock_report",
    "mock_selection",
    "quiz_order",
    "render_markdown",
    "save_history",
]
