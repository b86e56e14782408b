"""A quality gate: does a change move any metric past its tolerance against a baseline? (chapter 09)

A results file (what `minillm eval` writes) holds {"results": {task: {metric: value, ...}, ...}}, as
lm-evaluation-harness's do. `compare` lines a candidate's results up with a baseline's, metric by metric,
and fails a metric that moved the wrong way by more than its tolerance:

    metric            better   tolerance
    perplexity        lower    +2% (relative)
    acc, acc_norm     higher   -0.02 or 2 standard errors, whichever is larger (absolute)
    exact_match       higher   -0.02 or 2 standard errors, whichever is larger
    top1_agreement    higher   -0.02
    kl_divergence     lower    +0.02 nats
    greedy_match      higher   -0.02 or 2 standard errors, whichever is larger
    greedy_prefix     higher   -0.02
    json_valid        higher   -0.02 or 2 standard errors, whichever is larger
    schema_match      higher   -0.02 or 2 standard errors, whichever is larger
    needle_accuracy   higher   -0.02 or 2 standard errors, whichever is larger

json_valid and schema_match (`minillm.eval.tasks.json_success`) are the share of greedy answers that hold a JSON
object, and that also match the asked-for schema: a tool call that does not parse is a failed request, however
little the perplexity moved. needle_accuracy (`minillm.eval.long_context.needle_retrieval`) is the share of
needles a model retrieves from a long context, the check a KV-cache format must pass.

greedy_match and greedy_prefix (`minillm.eval.cached.greedy_agreement`) compare an engine's greedy generations
with the plain engine's: they are for changes meant to be exact (speculative decoding, a new kernel), whose
tolerance is rounding ties alone; any lossy change (quantisation) moves them far more, and is judged by the rest.

A share measured on a few hundred documents moves by a few points from noise alone, hence the standard
errors: a gate that fails on noise gets ignored. Tolerances are arguments; these are the book's defaults.

    rows = compare(candidate, baseline)
    print(format_table(rows)); failed = [r for r in rows if r.failed]
"""

from __future__ import annotations

from dataclasses import dataclass

# metric -> (which way is better, tolerance, relative?)
TOLERANCES: dict[str, tuple[str, float, bool]] = {
    "perplexity": ("lower", 0.02, True),
    "acc": ("higher", 0.02, False),
    "acc_norm": ("higher", 0.02, False),
    "exact_match": ("higher", 0.02, False),
    "top1_agreement": ("higher", 0.02, False),
    "kl_divergence": ("lower", 0.02, False),
    "greedy_match": ("higher", 0.02, False),
    "greedy_prefix": ("higher", 0.02, False),
    "json_valid": ("higher", 0.02, False),
    "schema_match": ("higher", 0.02, False),
    "needle_accuracy": ("higher", 0.02, False),
}


@dataclass
class Row:
    """One metric of one task: the baseline's value, the candidate's, the change allowed and whether it failed."""

    task: str
    metric: str
    baseline: float
    value: float
    allowed: float  # the largest change in the bad direction that passes (absolute)
    failed: bool

    @property
    def change(self) -> float:
        return self.value - self.baseline


def compare(results: dict, baseline: dict, tolerances: dict[str, tuple[str, float, bool]] | None = None,
            stderr_factor: float = 2.0) -> list[Row]:
    """Every metric present in both results files (those with a tolerance), baseline against candidate.

    A metric the baseline has and the candidate lacks is a ValueError (a gate must not pass by omission)."""
    tolerances = TOLERANCES if tolerances is None else tolerances
    rows = []
    for task, base_metrics in baseline["results"].items():
        if task not in results["results"]:
            raise ValueError(f"the baseline has task {task!r}, the results do not: run it too "
                             f"(the results have {sorted(results['results'])}).")
        ours = results["results"][task]
        for metric, base in base_metrics.items():
            if metric not in tolerances:
                continue
            if metric not in ours:
                raise ValueError(f"task {task!r}: the baseline has {metric!r}, the results do not.")
            better, tolerance, relative = tolerances[metric]
            allowed = tolerance * abs(base) if relative else tolerance
            stderr = max(base_metrics.get(f"{metric}_stderr", 0.0) or 0.0, ours.get(f"{metric}_stderr", 0.0) or 0.0)
            if stderr == stderr:  # not NaN
                allowed = max(allowed, stderr_factor * stderr)
            worse = base - ours[metric] if better == "higher" else ours[metric] - base
            rows.append(Row(task, metric, base, ours[metric], allowed, worse > allowed))
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as a text table, failures marked."""
    lines = [f"{'task':<16} {'metric':<16} {'baseline':>10} {'value':>10} {'change':>9} {'allowed':>9}  verdict"]
    for r in rows:
        lines.append(f"{r.task:<16} {r.metric:<16} {r.baseline:>10.4f} {r.value:>10.4f} {r.change:>+9.4f} "
                     f"{r.allowed:>9.4f}  {'FAIL' if r.failed else 'ok'}")
    return "\n".join(lines)
