"""Every figure a chapter's summary or reading repeats is one the chapter printed (minillm.book.summary_numbers).

The mechanism is tested on small notebooks built here, among them chapter 09's summary as it stood before f8d220e,
which credited minillm with 14.5x transformers' static batches while the matrix above it printed 31.2x; then every
written chapter is checked, with the figures that are not measurements listed in summary_numbers_allowed.yaml.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minillm.book import REPO_ROOT, load_book, summary_numbers
from minillm.book.summary_numbers import Allowed, Printed, Quote

ALLOWED = Path(__file__).with_name("summary_numbers_allowed.yaml")
CHAPTERS = [REPO_ROOT / ch.notebook for ch in load_book().written()]

# Chapter 09's decision-matrix output and the summary bullet that quoted a stale run (cell 67 at f8d220e~1).
MATRIX_OUTPUT = ("a generic generate loop, static batches  a serving engine: continuous batching, paging, graphs "
                 "(ch 04-05) minillm 31.2x transformers' static batches of 64 (two engines: all effects together; "
                 "1B shape, H200)  [engine_throughput/archive/engine_throughput_cuda_h200]\n"
                 "host time between kernels, small batch   CUDA graphs + fused kernels (ch 05)        1B batch 1: "
                 "19.4 -> 2.2 ms per engine step  [roofline/cuda_h100]\n")
OLD_SUMMARY = ("## 10. Summary\n\n"
               "- **Choose by bottleneck, measured:** minillm 14.5x `transformers`' static batches (H200), CUDA "
               "graphs\n  from 19.4 to 2.2 ms per step at batch 1.\n")


def notebook(tmp_path: Path, cells: list[tuple[str, str, str]], name: str = "09_capstone.ipynb") -> Path:
    """A notebook file of (cell type, source, printed output) cells."""
    def cell(kind: str, source: str, output: str) -> dict:
        if kind == "markdown":
            return {"cell_type": "markdown", "metadata": {}, "source": source}
        outputs = [{"output_type": "stream", "name": "stdout", "text": output}] if output else []
        return {"cell_type": "code", "metadata": {}, "source": source, "outputs": outputs, "execution_count": 1}

    path = tmp_path / name
    path.write_text(json.dumps({"cells": [cell(*c) for c in cells], "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}))
    return path


def test_quoted_numbers_are_measurements_not_settings():
    text = ("At batch 8, k = 4, Llama-3-8B and an 8-bit cache (chapter 05, 2024) reached 31.2x, 36%, 1.45 ms, "
            "4,325 tok/s and 0.80x; the range 0.61–0.99x, `1.23x` in code, $c = 0.23$ in LaTeX, a 128K context, "
            "[a link](https://example.com/1.5x), arXiv:2309.06180 and torch 2.11.0 are not figures; -0.1% is.")
    quotes = summary_numbers.quoted_numbers(text)
    assert [q.text for q in quotes] == ["31.2x", "36%", "1.45 ms", "4,325 tok/s", "0.80x", "0.61", "0.99x", "-0.1%"]
    assert [(q.value, q.decimals, q.unit) for q in quotes[:4]] == [
        (31.2, 1, "ratio"), (36.0, 0, "percent"), (1.45, 2, "ms"), (4325.0, 0, "rate")]
    assert quotes[5].unit == "ratio", "a range's first end takes the unit of its second"
    assert quotes[-1].value == -0.1


def test_a_figure_is_supported_at_its_precision_and_in_its_units_forms():
    def quote(text: str) -> Quote:
        return summary_numbers.quoted_numbers(text)[0]

    printed = [Printed(1.955, "ratio"), Printed(0.531, ""), Printed(0.0083, "s"), Printed(17179869184.0, "")]
    assert summary_numbers.supports(quote("1.96x"), printed)
    assert summary_numbers.supports(quote("2.0x"), printed)
    assert not summary_numbers.supports(quote("1.9x"), printed), "1.955 does not round to 1.9"
    assert summary_numbers.supports(quote("53%"), printed), "a bare fraction supports a percentage"
    assert summary_numbers.supports(quote("8.3 ms"), printed), "seconds support milliseconds"
    assert summary_numbers.supports(quote("16 GiB"), printed), "bytes support GiB"
    assert not summary_numbers.supports(quote("1.955 ms"), printed), "a ratio does not support a time"


def test_chapter_09s_old_summary_fails_on_its_stale_figure(tmp_path):
    path = notebook(tmp_path, [("code", "print(matrix)", MATRIX_OUTPUT), ("markdown", OLD_SUMMARY, "")])
    findings = summary_numbers.check(path)
    assert [(f.cell, f.quote.text) for f in findings] == [(1, "14.5x")]
    message = findings[0].message()
    assert "09_capstone.ipynb, cell 1: '14.5x'" in message
    assert "minillm 14.5x `transformers`' static batches (H200)" in message, "the sentence around the figure"
    assert "looked in: the outputs of every code cell" in message
    fixed = notebook(tmp_path, [("code", "print(matrix)", MATRIX_OUTPUT),
                                ("markdown", OLD_SUMMARY.replace("14.5x", "31.2x"), "")])
    assert summary_numbers.check(fixed) == []


def test_a_reading_reads_its_own_section_and_the_files_it_names(tmp_path):
    cells = [("markdown", "## 1. Earlier", ""), ("code", "", "a speed-up of 2.71x"),
             ("markdown", "### Measured", ""), ("code", "", "speed-up 1.75x"),
             ("markdown", "What the run shows: 1.75x, and 2.71x from earlier.", "")]
    findings = summary_numbers.check(notebook(tmp_path, cells))
    assert [f.quote.text for f in findings] == ["2.71x"], "a reading checks against the code cells of its section"
    assert "looked in: the outputs of cell 3" in findings[0].message()
    cells[-1] = ("markdown", "What the run shows: 1.75x, and c = 0.2252 in results/speculative_controlled/cuda.json.",
                 "")
    assert summary_numbers.check(notebook(tmp_path, cells)) == [], "a results file the cell names supports it"


def test_a_derived_figure_is_supported_by_its_arithmetic_from_printed_numbers(tmp_path):
    table = ("code", "", "KL: RTN 0.00600, GPTQ 0.00335")
    right = ("markdown", "## Summary\n\nGPTQ cuts KL by 44% ($1 - 0.00335 / 0.00600$).", "")
    assert summary_numbers.check(notebook(tmp_path, [table, right])) == []
    wrong = ("markdown", "## Summary\n\nGPTQ cuts KL by 40% ($1 - 0.00335 / 0.00600$).", "")
    [finding] = summary_numbers.check(notebook(tmp_path, [table, wrong]))
    assert "its derivation: $1 - 0.00335 / 0.00600$ = 0.4417, not 40%" in finding.message()
    unprinted = ("markdown", "## Summary\n\nGPTQ cuts KL by 44% ($1 - 0.00335 / 0.00601$).", "")
    [finding] = summary_numbers.check(notebook(tmp_path, [table, unprinted]))
    assert "0.00601 is not printed" in finding.message()


def test_summary_sections_end_at_the_next_heading_and_the_allowlist_exempts_phrases(tmp_path):
    cells = [("markdown", "## 9. Pitfalls\n\nA 3.3x slip.\n\n## 10. Summary\n\n- The engine 4.4x; a paper's 7.7x.", ""),
             ("markdown", "More summary: 5.5 ms.\n\n## 11. Appendix\n\n6.6x is not the summary's.", ""),
             ("code", "", "4.4x 5.5 ms")]
    path = notebook(tmp_path, cells)
    assert [f.quote.text for f in summary_numbers.check(path)] == ["7.7x"]
    allowed = [Allowed("09", "a paper's 7.7x", "a paper's figure"), Allowed("03", "nothing", "another chapter's")]
    assert summary_numbers.check(path, allowed) == []
    assert summary_numbers.unused_allowed([path], allowed) == [allowed[1]]


def test_the_allowlist_gives_a_reason_for_every_entry_and_each_is_still_used():
    allowed = summary_numbers.load_allowed(ALLOWED)
    assert allowed, "the allowlist is read"
    stale = summary_numbers.unused_allowed(CHAPTERS, allowed)
    assert not stale, f"{ALLOWED.name}: phrases no chapter's summary or reading contains any more: {stale}"


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_summaries_quote_the_figures_their_chapter_printed(path):
    findings = summary_numbers.check(path, summary_numbers.load_allowed(ALLOWED))
    assert not findings, (
        "figures in a summary or a reading that the chapter does not print (print them in the cell the prose reads, "
        f"correct the prose to the printed figure, or, for a figure that is not a measurement, add it to "
        f"tests/book/{ALLOWED.name} with its source):\n" + "\n".join(f.message() for f in findings))
