"""Do a chapter's summaries quote the numbers it printed? Its takeaway prose's figures, checked against its outputs.

A chapter ends with a summary, and some of its sections end with a reading of the table above ("What the H200 run
shows (read the numbers off the table above): ..."). Those are the sentences a reader carries away, so every figure
they repeat must be one the notebook printed, or one in a results file it cites: prose written after a run keeps the
run's numbers when a later run changes them (chapter 09 once credited minillm with "14.5x transformers' static
batches" where its own matrix printed 31.2x). This module finds those cells, pulls out the figures they quote, and
looks for each among the notebook's printed outputs and its results files:

    from minillm.book import summary_numbers
    for finding in summary_numbers.check(Path("chapters/09_capstone.ipynb")):
        print(finding.message())

tests/book/test_summary_numbers.py runs it on every chapter. What it checks:

* **Which cells.** Markdown cells in a section headed "Summary", "Takeaways" or "What we measured" (from the
  heading to the next heading of the same level or higher), and cells that open with a reading of a result,
  "What the ... shows" or "What the ... says". A summary printed by a code cell is computed from the run, so only
  prose is checked.
* **Which numbers.** A measurement: a number with a unit (31.2x, 36%, 1.45 ms, 16 GiB, 4,325 tok/s, 0.06 USD), a
  number with decimals (0.80, 2.21 tokens per forward), or one with a thousands separator (42,490). Bare integers
  ("batch 8", "k = 4", "chapter 05", years) are settings and references, and are skipped, as are sizes written
  onto a letter (8B, 128K), compound adjectives (8-bit, 200-document), and numbers inside code spans, LaTeX and
  links. Each end of a range counts (0.61–0.99x is 0.61x and 0.99x).
* **What supports one.** A number printed (stream and text/plain outputs) by the code cells the cell reads, or in a
  results file the cell's own text names (`results/<benchmark>/<file>.json`, `results_index.citations`), that rounds
  to the quoted figure at its precision (1.955 supports "1.96x" and "2.0x", not "1.9x"), in absolute value. A
  summary reads every code cell of the notebook; a reading cell, the code cells of its own section above it. A
  number printed with a unit supports only that unit (or its family: "0.0083 s" supports "8.3 ms"); a bare one, as
  in a table's column, may hold the figure in the unit's usual forms (0.53 for 53%, seconds for milliseconds,
  bytes for GiB). A results file the code loads supports nothing by itself: a figure the prose repeats is printed.
* **Derived figures.** A figure computed from printed ones (a ratio, a share) may show its arithmetic in LaTeX right
  after it, "falls by 44% ($1 - 0.00335 / 0.00600$)": it is supported if every decimal in the arithmetic is
  supported and the arithmetic gives the figure. (Printing the figure is the other way.)
* **How strict that is.** A pool of every number a notebook prints is large, and a one- or two-digit figure (6%,
  0.7x) often finds a neighbour there by chance, so a stale figure of that size can pass; a figure of three
  significant digits (31.2x, 0.022 USD) rarely does. Printing the numbers a reading quotes in the cell it reads
  (not only in a figure) is what makes them checkable.
* **What is exempt.** Figures that are not this notebook's measurements (a constant from a paper, a provider's
  price, a definition) are listed, each with its reason, in an allowlist (`load_allowed`) of phrases: a figure
  inside one of its phrases is not checked.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from minillm.book import REPO_ROOT
from minillm.book.results_index import RESULTS, citations, matches

SUMMARY_HEADING = re.compile(r"^(#{1,6})\s+(?:\d+\.\s+)?(Summary|Takeaways?|What we measured)\b", re.M | re.I)
HEADING = re.compile(r"^(#{1,6})\s", re.M)
# A cell that reads off a result above it: "What the H200 run shows", "What the measurement says".
READING = re.compile(r"\A\s*What the [^\n]{1,60}? (?:shows|says)\b")

# Text whose numbers are not quoted figures: replaced by spaces (so offsets into the cell's text still hold).
HIDDEN = re.compile(r"```.*?```|`[^`\n]*`|\$\$.*?\$\$|\$[^$\n]+\$|\]\([^)\s]*\)|<[^>\n]+>|^#{1,6} [^\n]*$",
                    re.S | re.M)

# A unit after a number: the group names its kind, which says how a source's number may be scaled to match.
UNITS = {
    "percent": r"%",
    "ratio": r"[x×](?![\w])",
    "ms": r"\s?ms\b",
    "us": r"\s?(?:µs|μs|us)\b",
    "ns": r"\s?ns\b",
    "s": r"\ss\b",  # "1.6 s"; "128s" is a plural
    "points": r"\s(?:percentage )?points?\b",  # "2.15 points" of a percentage
    "GiB": r"\s?GiB\b",
    "MiB": r"\s?MiB\b",
    "KiB": r"\s?KiB\b",
    "TB": r"\s?TB\b(?!/)",
    "GB": r"\s?GB\b(?!/)",
    "MB": r"\s?MB\b(?!/)",
    "bandwidth": r"\s?[GT]B/s\b",
    "rate": r"\s?(?:tok|tokens?|requests?|req)/s\b",
    "usd": r"\s?USD\b",
}
# Units of one family convert into each other: a printed "0.0083 s" supports "8.3 ms" (seconds, bytes per unit).
SIZE = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9,
        "TB": 1e12, "GB": 1e9, "MB": 1e6, "GiB": 2.0**30, "MiB": 2.0**20, "KiB": 2.0**10}
FAMILY = {unit: "time" if unit.endswith("s") else "bytes" for unit in SIZE}
# A bare number (a table's column, a results file's field) may hold a quote's figure in another form: the factors.
BARE_SCALES: dict[str, tuple[float, ...]] = {
    "percent": (1.0, 100.0),  # 53% from 0.53
    "points": (1.0, 100.0),  # 2.15 points from 0.0215
    "ms": (1.0, 1e3, 1e-3),  # from seconds or microseconds
    "us": (1.0, 1e6, 1e3),  # from seconds or milliseconds
    "ns": (1.0, 1e9),
    "s": (1.0, 1e-3),  # from milliseconds
    "GiB": (1.0, 2.0**-30),  # from bytes
    "MiB": (1.0, 2.0**-20),
    "KiB": (1.0, 2.0**-10),
    "TB": (1.0, 1e-12),
    "GB": (1.0, 1e-9),
    "MB": (1.0, 1e-6),
}
# The number itself: not inside a word, a name (Llama-3-8B), a path, a version (2.11.0), a reference (#4580, arXiv:).
NUMBER = re.compile(
    r"(?<![\w.,/:#])(?<![A-Za-z]-)(?P<sign>[+\-−](?=\d))?(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
    r"(?![.,]?\d)(?P<unit>" + "|".join(f"(?P<{kind}>{pattern})" for kind, pattern in UNITS.items()) + r")?"
)
SETTING_AFTER = re.compile(r"[A-Za-z]|-[A-Za-z]")  # 8B, 128K, 1st; 8-bit, 200-document: sizes and settings
RANGE_BETWEEN = re.compile(r"\s*(?:–|-|to|and)\s*")  # 0.61–0.99x, 2.9 and 3.5 ms: the first takes the second's unit
# A number in an output: anywhere (a table's cell, "k=4"), with its unit where one follows.
PRINTED = re.compile(r"(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)(?P<unit>"
                     + "|".join(f"(?P<{kind}>{pattern})" for kind, pattern in UNITS.items()) + r")?")


# A derived figure shows its arithmetic right after it, in LaTeX: "44% ($1 - 0.00335 / 0.00600$)".
DERIVATION = re.compile(r"\s*\(\$(?P<expr>(?:[-+*/().\d\s]|\\cdot|\\times)+)\$")
OPERAND = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Quote:
    """One figure a cell's prose quotes: "31.2x" is value 31.2, 1 decimal, unit kind "ratio"."""

    text: str  # as written, e.g. "31.2x", "4,325 tok/s", "0.61" (the first end of "0.61–0.99x")
    value: float
    decimals: int
    unit: str  # a key of UNITS, or "" for a bare number
    start: int  # offsets into the cell's text
    end: int


@dataclass(frozen=True)
class Finding:
    """A quoted figure that neither the notebook's outputs nor its results files support."""

    notebook: str  # relative to the repository
    cell: int
    quote: Quote
    sentence: str
    looked_in: tuple[str, ...]
    note: str = ""  # what was wrong with the figure's derivation, where it shows one

    def message(self) -> str:
        """Where the figure is, the sentence around it, and where it was looked for."""
        files = ", ".join(self.looked_in[1:]) or "no results file"
        note = f"\n    its derivation: {self.note}" if self.note else ""
        return (f"{self.notebook}, cell {self.cell}: {self.quote.text!r} is not printed by the notebook and is in no "
                f"results file it names\n    \"{self.sentence}\"\n    looked in: {self.looked_in[0]}; {files}{note}")


@dataclass(frozen=True)
class Printed:
    """A number the notebook printed (or a results file holds), in absolute value, and its unit ("" when bare)."""

    value: float
    unit: str


@dataclass(frozen=True)
class Allowed:
    """A phrase whose figures are not the notebook's measurements, and why (an entry of the allowlist)."""

    chapter: str  # the notebook's stem's prefix, "09"
    phrase: str
    reason: str


def load_allowed(path: Path) -> list[Allowed]:
    """The allowlist: a YAML list of {chapter, phrase, reason}; raises ValueError on an entry without a reason."""
    entries = yaml.safe_load(path.read_text()) or []
    allowed = []
    for entry in entries:
        fields = ("chapter", "phrase", "reason")
        if not isinstance(entry, dict) or not all(str(entry.get(k, "")).strip() for k in fields):
            raise ValueError(f"{path.name}: every entry needs a chapter, a phrase and a reason, got {entry!r}")
        allowed.append(Allowed(str(entry["chapter"]), str(entry["phrase"]), str(entry["reason"])))
    return allowed


def _source(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def summary_cells(cells: list[dict[str, Any]]) -> Iterator[tuple[int, str]]:
    """(index, text) of each markdown cell to check: its text from a summary heading on, or all of a reading cell."""
    level = 0  # the open summary section's heading level, 0 when none is open
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        text = _source(cell)
        if READING.match(text):
            yield index, text
            continue
        start, end = (0 if level else None), len(text)  # the part of the cell inside a summary section
        for heading in HEADING.finditer(text):
            summary = SUMMARY_HEADING.match(text, heading.start())
            if summary:
                if start is None:
                    start = heading.start()
                level, end = len(summary[1]), len(text)
            elif level and len(heading[1]) <= level:
                level, end = 0, heading.start()
        if start is not None and text[start:end].strip():
            yield index, re.sub(r"[^\n]", " ", text[:start]) + text[start:end]  # offsets into the cell still hold


def quoted_numbers(text: str) -> list[Quote]:
    """The figures a markdown text quotes (see the module's docstring for what counts), in order."""
    visible = HIDDEN.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), text)
    found = []
    for m in NUMBER.finditer(visible):
        unit = next((kind for kind in UNITS if m[kind] is not None), "")
        if not unit and SETTING_AFTER.match(visible, m.end()):
            continue
        digits = m["digits"]
        decimals = len(digits.partition(".")[2])
        value = float(digits.replace(",", "")) * (-1 if m["sign"] else 1)
        found.append(Quote(m[0].strip(), value, decimals, unit, m.start(), m.end()))
    quotes = []
    for i, q in enumerate(found):  # a range's first end takes the unit of its second: 93–96%
        after = found[i + 1] if i + 1 < len(found) else None
        if not q.unit and after and after.unit and RANGE_BETWEEN.fullmatch(visible, q.end, after.start):
            q = Quote(q.text, q.value, q.decimals, after.unit, q.start, q.end)
        if q.unit or q.decimals or "," in q.text:  # a bare integer is a setting or a reference
            quotes.append(q)
    return quotes


def sentence_at(text: str, start: int, end: int) -> str:
    """The sentence (or bullet) of `text` around [start, end), on one line."""
    before = max(text.rfind(". ", 0, start), text.rfind("\n- ", 0, start), text.rfind("\n\n", 0, start))
    stops = [i for i in (text.find(". ", end), text.find("\n- ", end), text.find("\n\n", end)) if i >= 0]
    after = min(stops) + 1 if stops else len(text)
    return " ".join(text[before + 1 if before >= 0 else 0:after].split()).removeprefix("- ")


def output_text(cells: list[dict[str, Any]]) -> str:
    """What the given cells printed: their stream and text/plain outputs."""
    parts = []
    for cell in cells:
        for output in cell.get("outputs", []):
            for text in (output.get("text", ""), output.get("data", {}).get("text/plain", "")):
                parts.append("".join(text) if isinstance(text, list) else text)
    return "\n".join(parts)


def printed_numbers(text: str) -> list[Printed]:
    """Every number an output prints ("1,473,846", "0.80x", "1.9e-05", "2.6 ms"), with its unit where it has one."""
    found = []
    for m in PRINTED.finditer(text):
        unit = next((kind for kind in UNITS if m[kind] is not None), "")
        found.append(Printed(abs(float(m["digits"].replace(",", ""))), unit))
    return found


def numbers_in_json(data: Any) -> Iterator[float]:
    """Every number in a parsed JSON document (booleans are not numbers)."""
    if isinstance(data, dict):
        for value in data.values():
            yield from numbers_in_json(value)
    elif isinstance(data, list):
        for value in data:
            yield from numbers_in_json(value)
    elif isinstance(data, (int, float)) and not isinstance(data, bool) and math.isfinite(data):
        yield float(data)


def named_results(text: str) -> list[str]:
    """The results files (under results/) a cell's text names, each once, in order."""
    return list(dict.fromkeys(f for pattern in citations(text) for f in matches(pattern) if f.endswith(".json")))


def supports(quote: Quote, printed: Iterable[Printed]) -> bool:
    """Whether a printed number, in one of the quote's unit's forms, rounds to the quoted figure at its precision.

    A number printed with a unit supports a quote in the same unit, or in one of its family (seconds for
    milliseconds); a bare one (a table's column, a results file's field) may also hold the figure scaled
    (`BARE_SCALES`: a fraction for a percentage). A quote without a unit takes any printed number.
    """
    tolerance = 0.5 * 10.0 ** -quote.decimals * (1 + 1e-9) + 1e-12
    target = abs(quote.value)
    for p in printed:
        if not p.unit or not quote.unit:
            scales = BARE_SCALES.get(quote.unit, (1.0,)) if not p.unit else (1.0,)
        elif p.unit == quote.unit:
            scales = (1.0,)
        elif FAMILY.get(p.unit, p.unit) == FAMILY.get(quote.unit, quote.unit):
            scales = (SIZE[p.unit] / SIZE[quote.unit],)
        else:
            continue
        if any(abs(p.value * s - target) <= tolerance for s in scales):
            return True
    return False


def derivation_fault(text: str, quote: Quote, printed: list[Printed]) -> str | None:
    """Check a figure's derivation, the LaTeX arithmetic right after it: None if it gives the figure from supported
    numbers, else what is wrong ("" when there is no derivation). Integers in it (1 - a / b) are constants."""
    found = DERIVATION.match(text, quote.end)
    if not found:
        return ""
    expr = found["expr"].replace("\\cdot", "*").replace("\\times", "*")
    for operand in OPERAND.finditer(expr):
        number = Quote(operand[0], float(operand[0]), len(operand[0].partition(".")[2]), "", 0, 0)
        if number.decimals and not supports(number, printed):
            return f"${found['expr']}$: {operand[0]} is not printed"
    try:
        value = _evaluate(ast.parse(expr, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return f"${found['expr']}$ is not arithmetic"
    if not supports(quote, [Printed(abs(value), "")]):
        return f"${found['expr']}$ = {value:.4g}, not {quote.text}"
    return None


def _evaluate(node: ast.expr) -> float:
    """The value of an arithmetic expression's tree: numbers, + - * /, and signs."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return -_evaluate(node.operand) if isinstance(node.op, ast.USub) else _evaluate(node.operand)
    operators = {ast.Add: float.__add__, ast.Sub: float.__sub__, ast.Mult: float.__mul__, ast.Div: float.__truediv__}
    if isinstance(node, ast.BinOp) and type(node.op) in operators:
        return operators[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("not arithmetic")


def section_code_cells(cells: list[dict[str, Any]], index: int) -> list[int]:
    """The code cells a reading cell reads: those after the last heading above it."""
    first = 0
    for i in range(index - 1, -1, -1):
        if cells[i]["cell_type"] == "markdown" and HEADING.search(_source(cells[i])):
            first = i
            break
    return [i for i in range(first, index) if cells[i]["cell_type"] == "code"]


def check(path: Path, allowed: Iterable[Allowed] = ()) -> list[Finding]:
    """The figures a notebook's summary and reading cells quote that what they read does not support.

    A summary cell reads every output of the notebook; a reading cell ("What the ... shows") the outputs of the
    code cells of its own section, above it. Both read the results files their own text names. `allowed` exempts
    the figures inside its phrases, for the entries whose chapter is the notebook's prefix.
    """
    cells = json.loads(path.read_text())["cells"]
    everything = [i for i, cell in enumerate(cells) if cell["cell_type"] == "code"]
    rel = path.resolve().relative_to(REPO_ROOT).as_posix() if path.resolve().is_relative_to(REPO_ROOT) else path.name
    phrases = [a.phrase for a in allowed if path.name.startswith(a.chapter)]
    findings = []
    for index, text in summary_cells(cells):
        reads = section_code_cells(cells, index) if READING.match(text) else everything
        files = named_results(text)
        printed = printed_numbers(output_text([cells[i] for i in reads]))
        printed += [Printed(abs(v), "") for f in files for v in numbers_in_json(json.loads((RESULTS / f).read_text()))]
        where = (f"the outputs of {'every code cell' if reads is everything else _cells(reads)}",
                 *(f"results/{f} (named in the cell)" for f in files))
        exempt = [(m.start(), m.end()) for p in phrases for m in re.finditer(_phrase(p), text)]
        for quote in quoted_numbers(text):
            if any(a <= quote.start and quote.end <= b for a, b in exempt) or supports(quote, printed):
                continue
            fault = derivation_fault(text, quote, printed)
            if fault is not None:
                findings.append(Finding(rel, index, quote, sentence_at(text, quote.start, quote.end), where, fault))
    return findings


def _phrase(phrase: str) -> str:
    """A regular expression for an allowlist's phrase that lets its spaces be any run of white space (line breaks)."""
    return r"\s+".join(re.escape(word) for word in phrase.split())


def _cells(indices: list[int]) -> str:
    return ("cell " if len(indices) == 1 else "cells ") + ", ".join(map(str, indices)) if indices else "no cell"


def unused_allowed(paths: Iterable[Path], allowed: Iterable[Allowed]) -> list[Allowed]:
    """The allowlist's entries whose phrase no checked cell of their chapter contains: stale, to be removed."""
    texts: dict[str, list[str]] = {}
    for path in paths:
        cells = json.loads(path.read_text())["cells"]
        texts[path.name] = [text for _, text in summary_cells(cells)]
    return [a for a in allowed
            if not any(re.search(_phrase(a.phrase), t) for name, ts in texts.items() if name.startswith(a.chapter)
                       for t in ts)]
