"""results/README.md, the index of the book's measurements: generated from the results files and what cites them.

    python -m minillm.book.results_index            # writes results/README.md
    python -m minillm.book.results_index --check    # exits 1 if results/README.md is out of date

`results/` holds one folder per script of `benchmarks/` (`benchmarks/roofline.py` -> `results/roofline/`). Its
current files are named `<device>[_<qualifier>].json` (`NAMING` below says how); earlier runs, A/B rounds and
one-off variants sit in its `archive/` under the names they were written with. The index lists, chapter by
chapter (in `book.yml`'s order), the files each chapter cites, the script that writes each, the machine, date and
commit from the file's header, and the claim it backs; then every folder, current files first. A file is marked
*older* when its commit is not a descendant of the last commit that touched the code it measures (the benchmark
script and the minillm modules it imports), so a re-run could give other numbers.

A citation is any of: a path `results/<benchmark>/...` in text or code (`*` and `{a,b}` allowed), a
`load_results("<benchmark>/<file>")` call, or, in a notebook's code, a quoted name `"<benchmark>/<file>"`. In an
f-string, `{side}` stands for the values of the cell's `for side in (...)` loop, any other `{...}` for `*`.
tests/book/test_results_index.py checks that every citation finds a file, that every current file is in the index, and
that the index is up to date.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import functools
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from minillm.book import REPO_ROOT, load_book

RESULTS = REPO_ROOT / "results"
INDEX = RESULTS / "README.md"

NAMING = """\
- `results/<benchmark>/` is the folder of `benchmarks/<benchmark>.py`, the script that wrote every file in it.
- Its current files are `<device>[_<qualifier>].json`. The device is `cpu` or `cuda` (an NVIDIA GPU); a file is
  plainly `<device>.json` when it is the latest run of the script's default command there. A qualifier names what
  else the book keeps for that device: the GPU when the default run is kept from two cards (`cuda_h100`,
  `cuda_h200`), the model or shape measured (`cuda_llama-3-8b`, `cuda_1b`), or the variant a chapter plots
  (`cuda_pdl`, `cuda_d128`; an A/B held in one file, as `engine_throughput_ab/cuda_async`).
- `archive/` keeps everything else under the name it was written with (so its provenance stays readable):
  A/B rounds (`before`/`after`, `_r1`, `_r2`), runs a later one replaced, one-off variants.
- A chapter reads a file with `load_results("<benchmark>/<file>")` (no `.json`), e.g.
  `load_results("roofline/cuda_h100")` or `load_results("roofline/archive/roofline_cuda_b1_ab_after_r1")`;
  a script writes one with `write_results("<benchmark>/<file>", results)` (`benchmarks/common.py`).
"""

# The claim each chapter's citation backs, in a few words: chapter id -> {fnmatch pattern on the path under
# results/ -> claim}; the first pattern that matches wins. A file with no claim here shows a dash.
CLAIMS: dict[str, dict[str, str]] = {
    "01": {"constrained_overhead/cpu.json": "a JSON-schema mask costs a few % of a CPU decode step; its index is "
                                            "built once"},
    "02": {
        "phases/cuda_llama-3-8b.json": "H100, Llama-3-8B shape: decode against batch and context, prefill against "
                                       "length, against the roofline (MBU, MFU)",
        "cpu_decode/cpu.json": "the compiled decode step on a 2-core CPU against eager and llama.cpp",
        "cpu_decode/archive/cpu_decode_cpu_ab_*": "torch.compile against ahead-of-time compilation, one run each",
        "cpu_decode/archive/cpu_decode_cpu_amd_matvec_library.json": "the compiled step with PyTorch's products on "
                                                                    "the AMD CPU: the kernel choice's A/B",
        "cpu_decode/archive/cpu_decode_cpu_amd_0d1fa0c.json": "the same AMD CPU, an earlier run: how much runs vary",
        "attention/cuda.json": "Triton FlashAttention against SDPA and naive attention (H100)",
    },
    "03": {
        "gqa_quality/*": "perplexity after pooling K/V heads, and after a short uptraining",
        "decode_attention/cuda.json": "the split-K decode attention kernel against SDPA, GB/s of the KV read (H100)",
    },
    "04": {
        "paged_generation/cpu.json": "paged against contiguous cache: the same tokens, the decode time",
        "paged_attention/cuda.json": "paged against contiguous decode attention, and block sizes (H100)",
    },
    "05": {
        "engine_throughput/cuda_h100.json": "minillm 4.3x transformers' static batches on an H100, eager steps at 6% "
                                            "of the roofline",
        "engine_throughput/cuda_h200.json": "the final tree on an H200: 46x transformers, 53% of the step roofline",
        "engine_throughput/archive/engine_throughput_cuda_h200.json": "graphs and async scheduling on an H200: 31x "
                                                                      "transformers, 39% of the roofline",
        "engine_throughput/archive/engine_throughput_cuda_h200_host.json": "persistent rows, transformers in the same "
                                                                           "run: 37x, 47% of the roofline",
        "engine_throughput/archive/*": "the record of every engine_throughput.py run",
        "roofline/cuda_h100.json": "the H100 decode step: eager, graphs, engine and transformers against the "
                                   "bandwidth roofline",
        "roofline/cuda_h200.json": "H200 steps with async scheduling: replay, graph step, engine",
        "roofline/archive/roofline_cuda_before_fusion.json": "the step before the fused kernels",
        "roofline/archive/roofline_cuda_rotary_ab_*": "the rotary kernel writes the cache: 216 -> 184 kernels a step "
                                                      "(A/B)",
        "roofline/archive/roofline_cuda_engine_ab_*": "the engine's host work: 1B batch-64 step 6.27 -> 2.98 ms (A/B)",
        "roofline/archive/roofline_cuda_batch144.json": "144 rows at 768 keys: the engine step 1.09x its replay, the "
                                                        "GPU sets the pace",
        "roofline/archive/roofline_cuda_batch144_ab_*": "the full-batch attention launch: kernel 1.37 -> 1.10 ms (A/B)",
        "roofline/archive/roofline_cuda_b1_ab_*": "the matvec kernel in the batch-1 step (A/B, 2 rounds)",
        "roofline/archive/roofline_cuda_b1_greedy_ab_*": "greedy kernels: the 1B batch-1 engine step 1.10 -> 1.04 ms "
                                                         "(A/B)",
        "roofline/archive/roofline_cuda_*_pdl_*": "programmatic dependent launch in the step, batch 1 and 64 (A/B)",
        "roofline/archive/roofline_cuda_attn_*": "where the serving-batch launch costs: 144 rows of 768 keys (A/B)",
        "engine_stages/archive/*": "the engine step by stage, greedy and sampled, before and after (A/B pairs)",
        "overlap_timeline/cuda.json": "the host's and the GPU's lanes on one timeline, async scheduling off and on",
        "engine_throughput_ab/cuda_async.json": "async scheduling: offline throughput up about a quarter (A/B)",
        "engine_throughput_ab/cuda_packed.json": "packed prompt chunks: prompt steps about a quarter faster (A/B)",
        "engine_throughput_ab/cuda_host.json": "three trees in one lease: 3.2x over c2e1d62",
        "engine_throughput_ab/cuda_profile.json": "engine calls under the profiler: where prompt and decode steps "
                                                  "spend their time",
        "engine_throughput_ab/archive/engine_throughput_ab_cuda_varlen.json": "one varlen FlashAttention launch: "
                                                                              "prompt steps 1.97 -> 1.30 s (A/B)",
        "engine_throughput_ab/archive/engine_throughput_ab_cuda_split.json": "eager prompt steps: 1.96 of 8.58 s",
        "engine_throughput_ab/archive/engine_throughput_ab_cuda_fullbatch.json": "the full-batch launch in offline "
                                                                                 "throughput: within the spread",
        "engine_throughput_ab/archive/engine_throughput_ab_cuda_warps8.json": "8 warps: no faster in the engine",
        "engine_throughput_ab/archive/engine_throughput_ab_cuda_base_*": "0913b1b against 0667576: the lease, not the "
                                                                         "code",
        "engine_throughput_ab/archive/engine_throughput_ab_cuda_capture_*": "graphs captured at start: prompt steps "
                                                                            "1.36-2.47 -> 0.78-0.85 s (A/B)",
        "engine_throughput_ab/archive/engine_throughput_ab_cuda_rows_*": "persistent rows on the GPU: 3.83/3.88 -> "
                                                                         "3.63/3.46 s (A/B)",
        "engine_throughput_ab/archive/engine_throughput_ab_cuda_packed2_*": "the packed input copy against whole rows: "
                                                                            "the same within the spread",
        "engine_throughput_ab/archive/engine_throughput_ab_cuda_attn_*": "the serving-batch attention launch in the "
                                                                         "engine: 52-54% of the roofline (A/B)",
        "matvec/cuda.json": "the matvec kernel's tiles against cuBLAS, batch-1 replay",
        "matvec/cuda_pdl.json": "programmatic dependent launch saves about 0.6 us a kernel",
        "matvec/archive/matvec_cuda_norm.json": "RMSNorm folded into the matvec kernel: slower, not kept",
        "decode_key_range/archive/decode_key_range_cuda_combine_loop_*": "a loop in every launch: about 1% slower, "
                                                                         "not kept",
        "decode_key_range/archive/decode_key_range_cuda_combine_*": "the combine kernel reads a row's own chunks (A/B)",
        "decode_key_range/archive/*": "per-row chunks: the 1B replay under the whole-context graph 1.26 -> 1.02 ms",
        "engine_step_profile/archive/engine_step_profile_cuda.json": "PyTorch's argmax and log-softmax: about 28 us "
                                                                     "each at batch 1",
        "engine_step_profile/cuda.json": "greedy tokens from Triton kernels; the GPU idle between kernels",
        "engine_host_step/archive/engine_host_step_cpu_gpuhost_before.json": "an H200 host's step before: 3.8 ms "
                                                                             "against 3.3 ms of GPU work",
        "engine_host_step/archive/engine_host_step_cpu_*": "persistent rows: the host's step 2.6 -> 2.0 ms on the "
                                                           "2-core VM (A/B)",
        "engine_host_step/archive/engine_host_step_cuda_*": "where the host waited for the GPU, before and after "
                                                            "(a hint)",
        "decode_attention_serving/*": "serving-batch launch settings: 1.11-1.30x a call on ragged rows",
    },
    "06": {
        "quant_quality/cpu.json": "perplexity and KL of int8 and int4 weights on the shipped model",
        "quant_quality/cpu_smollm2.json": "SmolLM2-135M from its Q4_1 file: every method on the book's prose, a second "
                                          "rounding of 4-bit weights",
        "w4a16/cuda.json": "the W4A16 kernel against bf16 and tinygemm, by batch (H100)",
        "kv_quant_decode/cuda.json": "int8 / fp8 KV cache: decode attention 1.1-1.3x over bf16 pools (H100)",
        "compression/cpu.json": "pruning to 50% and distilling the draft: perplexity and agreement",
    },
    "07": {
        "speculative_verify_cost/cuda.json": "the verify cost v_k of k + 1 positions, in decode steps (H100)",
        "speculative/cpu.json": "acceptance, tokens per step and speed-up for k = 1..8 on the CPU",
        "speculative/cuda.json": "the same on an H100: speculation does not pay for the 11M target",
        "speculative_ngram/cpu_smollm2.json": "n-gram lookup on SmolLM2: grounded prompts against a story, the "
                                              "formula with steps that draft nothing",
        "speculative_controlled/cuda.json": "8B target, real 1B draft, alpha by construction: speed-up against "
                                            "E / (v_k + k c) by alpha, k, batch; prompt lookup; the DraftGate at "
                                            "k = 4, 0.42x -> 0.85-0.87x at alpha 0 (H200)",
    },
    "08": {
        "tensor_parallel/cpu.json": "TP = 1, 2 on two CPU cores: the step and its all-reduces",
        "tensor_parallel/cuda_1b_2gpu.json": "TP = 1, 2 at the 1B shape on the pipeline run's two GPUs",
        "tensor_parallel/cuda*": "TP on four H200s, 1B and 8B shapes",
        "pipeline_bubble/cpu.json": "the measured bubble against the formula, GPipe and ring (CPU)",
        "pipeline_bubble/cuda.json": "the bubble on two H200s, 1B shape",
        "disagg_interference/cpu.json": "colocated, chunked, two replicas, disaggregated: ITL, TTFT, goodput (CPU)",
        "disagg_interference/cuda.json": "the same on two H200s, the KV over NVLink",
        "lora_throughput/cpu.json": "batches of 1 to 64 adapters: throughput (CPU)",
        "lora_throughput/cuda.json": "the same on an H200, with the add_lora kernel",
    },
    "09": {
        "quality_gates/cpu.json": "the quality gate over the book's changes to the shipped model",
        "quality_gates/cpu_smollm2.json": "the gate on SmolLM2, with JSON success and a needle through the 8-bit KV "
                                          "caches",
        "phases/cuda_llama-3-8b.json": "measured prefill times, for the cost of a long context",
        "long_context/cpu.json": "key-value lookup beyond the training length, with RoPE rescalings",
        "roofline/cuda_h100.json": "the decision matrix's graphs row, and graphs falling back to eager",
        "speculative_controlled/cuda.json": "the decision matrix's speculation row, and speculation at batch 8 "
                                            "(8B target, 1B draft, H200)",
        "constrained_overhead/cpu.json": "the mask's share of a decode step",
        "*": "a row of the decision matrix",
    },
}

# A path under results/, a load_results name, and (notebooks' code) a quoted name of a benchmark's file.
PATH = re.compile(r"(?<![\w$/.-])results/((?:[\w.*/-]|\{[^{}\s]*\})+)")
LOADED = re.compile(r'load_results\(\s*f?"([^"]+)"')


@dataclass(frozen=True)
class Entry:
    """One results file: where it is, what wrote it, and its header."""

    path: str  # under results/, e.g. "roofline/cuda_h100.json"
    benchmark: str
    archived: bool
    machine: str
    date: str
    commit: str  # the header's commit field as written ("542f26f-dirty", "0667576+eager capture", ...)

    @property
    def short_commit(self) -> str:
        """The header's commit hash (7 characters), with "+" when the run's tree had more than that commit."""
        found = re.search(r"\b[0-9a-f]{7,40}\b", self.commit)
        if not found:
            return "?"
        return found[0][:7] + ("" if self.commit == found[0] else "+")


def entries() -> list[Entry]:
    """Every results file under results/<benchmark>/, current files first, by path."""
    found = []
    for path in sorted(RESULTS.glob("*/**/*.json")):
        rel = path.relative_to(RESULTS).as_posix()
        head = json.loads(path.read_text())
        machine = head.get("machine", {})
        found.append(Entry(rel, rel.split("/")[0], "/archive/" in f"/{rel}",
                           str(machine.get("gpu") or machine.get("cpu") or "?").removeprefix("NVIDIA "),
                           str(head.get("date", "?"))[:10], str(head.get("commit", "?"))))
    return sorted(found, key=lambda e: (e.benchmark, e.archived, e.path))


def _loop_values(code: str) -> dict[str, str]:
    """`for side in ("before", "after")` -> {"side": "{before,after}"}: what an f-string's `{side}` stands for."""
    values = {}
    for loop in re.finditer(r"\bfor (\w+) in (\([^()]*\))", code):
        try:
            items = ast.literal_eval(loop[2])
        except (ValueError, SyntaxError):
            continue
        if isinstance(items, tuple) and all(isinstance(i, (str, int)) for i in items):
            values[loop[1]] = "{" + ",".join(str(i) for i in items) + "}"
    return values


def _patterns(raw: str) -> list[str]:
    """A cited path (under results/) as glob patterns: `{a,b}` gives one pattern each, `{name}` becomes `*`."""
    alternatives = re.search(r"\{([^{}]*,[^{}]*)\}", raw)
    if alternatives:
        return [p for choice in alternatives[1].split(",")
                for p in _patterns(raw[:alternatives.start()] + choice + raw[alternatives.end():])]
    return [re.sub(r"\{[^{}]*\}", "*", raw)]


def citations(text: str, notebook_code: bool = False) -> list[str]:
    """The results files a text cites, as glob patterns under results/ ("roofline/cuda_h100.json", "x/archive/y_*").

    Only citations that start with a name count: `results/{name}.json`, built in code, and placeholders such as
    `results/<benchmark>/` are not citations."""
    found = [m[1].rstrip(".,") for m in PATH.finditer(text)]
    found += [f"{m[1]}.json" for m in LOADED.finditer(text)]
    if notebook_code:
        folders = "|".join(re.escape(p.stem) for p in sorted((REPO_ROOT / "benchmarks").glob("*.py")))
        found += [f"{m[1]}.json" for m in re.finditer(rf'"((?:{folders})/[\w.{{}}/-]+)"', text)]
        values = _loop_values(text)  # a loop's f-string names the files its loop walks
        found = [re.sub(r"\{(\w+)\}", lambda m: values.get(m[1], m[0]), f) for f in found]
    patterns = [p for raw in found for p in _patterns(raw)]
    return [p for p in patterns if p and "<" not in p and not p.startswith("*")]


def notebook_citations(path: Path) -> list[str]:
    """The citations of a notebook: its cells' sources and the text of their outputs."""
    found = []
    for cell in json.loads(path.read_text())["cells"]:
        found += citations("".join(cell["source"]), notebook_code=cell["cell_type"] == "code")
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            texts = [output.get("text", ""), *(data.get(k, "") for k in ("text/plain", "text/html", "text/markdown"))]
            found += citations("\n".join("".join(t) for t in texts))
    return found


def citing_files() -> list[Path]:
    """Every file whose citations must hold: notebooks, README.md, ARCHITECTURE.md, the drills, and the Python
    of minillm/, benchmarks/ and kernels/."""
    files = [REPO_ROOT / "README.md", REPO_ROOT / "ARCHITECTURE.md"]
    for folder in ("chapters", "solutions", "exercises"):
        files += sorted((REPO_ROOT / folder).glob("*.ipynb"))
    files += sorted((REPO_ROOT / "minillm" / "book" / "grading" / "drills").glob("*.yaml"))
    for folder in ("minillm", "benchmarks", "kernels"):
        files += sorted((REPO_ROOT / folder).rglob("*.py"))
    return files


def cited_by_file() -> dict[str, list[str]]:
    """Each citing file (relative to the repository) -> its citations, in order, each once."""
    out = {}
    for path in citing_files():
        found = notebook_citations(path) if path.suffix == ".ipynb" else citations(path.read_text())
        if found:
            out[path.relative_to(REPO_ROOT).as_posix()] = list(dict.fromkeys(found))
    return out


def matches(pattern: str) -> list[str]:
    """The paths under results/ a citation names (a folder ending in "/" names itself)."""
    if pattern.endswith("/"):
        return [pattern] if (RESULTS / pattern).is_dir() else []
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.glob(pattern) if p.is_file())


def missing_citations() -> list[tuple[str, str]]:
    """(file, citation) for every citation that finds no file."""
    return [(f, c) for f, cited in cited_by_file().items() for c in cited if not matches(c)]


def claim(chapter: str, path: str) -> str:
    """The claim CLAIMS records for a chapter's citation of a file, or a dash."""
    return next((text for pattern, text in CLAIMS.get(chapter, {}).items() if fnmatch.fnmatch(path, pattern)), "—")


def _git(*args: str) -> str | None:
    """A git command's output in the repository, or None where git or the history is missing."""
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def measured_code(benchmark: str) -> list[str]:
    """The files a benchmark measures: its script and the minillm modules it imports (a package as its folder)."""
    script = REPO_ROOT / "benchmarks" / f"{benchmark}.py"
    paths = [script]
    for node in ast.walk(ast.parse(script.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] != "minillm" or len(parts) == 1:
                continue
            base = REPO_ROOT / "kernels" if parts[1] == "kernels" else REPO_ROOT / "minillm" / parts[1]
            where = base.joinpath(*parts[2:])
            if where.with_suffix(".py").is_file():
                paths.append(where.with_suffix(".py"))
            elif where.is_dir():
                paths.append(where)
    return sorted({p.relative_to(REPO_ROOT).as_posix() for p in paths})


@functools.cache
def last_change(benchmark: str) -> str | None:
    """The last commit that touched the code a benchmark measures (None without git)."""
    return _git("log", "-1", "--format=%H", "--", *measured_code(benchmark)) or None


@functools.cache
def _descends(commit: str, ancestor: str) -> bool | None:
    """Whether `commit` has `ancestor` in its history (None if git does not know `commit`)."""
    if _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}") is None:
        return None
    done = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, commit], cwd=REPO_ROOT,
                          capture_output=True)
    return done.returncode == 0


def older(entry: Entry) -> str:
    """"older" if the code it measures changed after the file's commit, "" if not, "?" where git cannot say."""
    last = last_change(entry.benchmark)
    commit = entry.short_commit.rstrip("+")
    fresh = _descends(commit, last) if last and commit != "?" else None
    return "?" if fresh is None else ("" if fresh else "older")


def _cell(text: str) -> str:
    """Text for a Markdown table cell."""
    return text.replace("|", "\\|")


def render() -> str:
    """The text of results/README.md."""
    files = entries()
    by_path = {e.path: e for e in files}
    cited = cited_by_file()
    users: dict[str, list[str]] = {}
    for source, patterns in cited.items():
        for path in {p for c in patterns for p in matches(c)}:
            users.setdefault(path, []).append(source)
    book = load_book()
    chapter_of = {ch.notebook: f"ch {ch.id}" for ch in book.chapters}
    chapter_of.update({ap.notebook: f"ch {ap.id}" for ap in book.appendices})
    # an appendix's citations back its chapter's claims (CLAIMS is keyed by chapter id), in a table of its own
    sections = [(ch.id, ch.id, ch.title, ch.notebook) for ch in book.chapters]
    for ap in reversed(book.appendices):
        at = next(i for i, s in enumerate(sections) if s[0] == ap.chapter) + 1
        sections.insert(at, (ap.id, ap.chapter, f"appendix: {ap.title}", ap.notebook))

    def where(path: str) -> str:
        names = [chapter_of.get(u, u) for u in sorted(users.get(path, []))]
        return ", ".join(n if n.startswith("ch ") else f"`{n}`" for n in names) or "—"

    lines = ["# results/: the book's measurements", "",
             "Generated by `python -m minillm.book.results_index` from the files' headers, the citations in the",
             "chapters and code, and git; do not edit it by hand (`tests/book/test_results_index.py` checks it is",
             "current).",
             "", "## How the files are named", "", NAMING,
             "Columns: *machine*, *date* and *commit* come from the file's header (`+`: the run's tree had changes",
             "beyond that commit; the header says which). *older* means the code the file measures (its benchmark",
             "script and the minillm modules that script imports) changed after that commit, so a re-run could",
             "differ; it is as current as the last run of the generator (the test checks every other column).",
             "", "## By chapter", ""]
    for section_id, claims_of, title, notebook_path in sections:
        notebook = REPO_ROOT / notebook_path
        if not notebook.is_file():
            continue
        paths = sorted({p for c in cited.get(notebook_path, []) for p in matches(c) if p in by_path},
                       key=lambda p: (by_path[p].benchmark, by_path[p].archived, p))
        lines += [f"### {section_id} {title} (`{notebook_path}`)", ""]
        if not paths:
            lines += ["No results files.", ""]
            continue
        lines += ["| file | written by | machine | date | commit | backs | older |", "|---|---|---|---|---|---|---|"]
        for p in paths:
            e = by_path[p]
            lines.append(f"| `{p}` | `benchmarks/{e.benchmark}.py` | {_cell(e.machine)} | {e.date} | "
                         f"{e.short_commit} | {_cell(claim(claims_of, p))} | {older(e)} |")
        lines.append("")
    lines += ["## By benchmark", ""]
    for benchmark in sorted({e.benchmark for e in files}):
        mine = [e for e in files if e.benchmark == benchmark]
        lines += [f"### `{benchmark}/`: `benchmarks/{benchmark}.py`", ""]
        current = [e for e in mine if not e.archived]
        if current:
            lines += ["| file | machine | date | commit | cited by | older |", "|---|---|---|---|---|---|"]
            lines += [f"| `{e.path}` | {_cell(e.machine)} | {e.date} | {e.short_commit} | {where(e.path)} | "
                      f"{older(e)} |" for e in current]
            lines.append("")
        else:
            lines += ["No current file: the book keeps only A/B rounds of this benchmark.", ""]
        archived = [e for e in mine if e.archived]
        if archived:
            lines += [f"`{benchmark}/archive/`, {len(archived)} file{'s' if len(archived) > 1 else ''}:", ""]
            lines += [f"- `{e.path.split('/archive/')[1]}`: {e.machine}, {e.date}, {e.short_commit}; "
                      f"cited by {where(e.path)}" for e in archived]
            lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if results/README.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not INDEX.is_file() or INDEX.read_text() != text:
            print("results/README.md is out of date: run python -m minillm.book.results_index", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(text)
    print(f"wrote results/README.md: {len(entries())} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
