"""Chapter 09's exercise tasks: a quality gate's decision, the price of input and output tokens from the roofline,
and a TPOT regression diagnosed from the engine's signals.

The gate is checked against `minillm.eval.compare` (the rule `minillm eval --baseline` applies) on results files
shaped as lm-evaluation-harness writes them. The prices are checked against the roofline times of
`minillm.arithmetic.prefill_time` and `decode_step_time` on published configurations and datasheets. The diagnosis
is checked on snapshots of the signals the engine exports (`/metrics`, the scheduler's records, the profile), one
cause at a time and with several signals moving at once, where the runbook's order decides.

Each wrong answer is diagnosed by running the common wrong versions on the same cases: the hint names the first
one the reader's answers agree with.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from minillm import arithmetic
from minillm.book.grading.registry import MismatchError, call_catching, diagnose, is_number, register_task, short_repr

# ---- 09.gate_decision --------------------------------------------------------------------------------


def reference_gate(results: dict, baseline: dict, tolerances: dict[str, tuple[str, float, bool]],
                   stderr_factor: float = 2.0) -> list[str]:
    """The metrics a change fails, as sorted "task.metric" names.

    results / baseline: {"results": {task: {metric: value, f"{metric}_stderr": se, ...}}} (lm-eval's shape).
    tolerances: {metric: (better, tolerance, relative)}, better "higher" or "lower". A metric of the baseline with a
    tolerance fails when it moved the bad way by more than allowed = tolerance (times |baseline| if relative), widened
    to stderr_factor x the larger of the two standard errors where they are given; one the results lack fails too
    (a gate must not pass by omission). Metrics without a tolerance (counts, standard errors) are not judged.
    """
    return _gate_rule(results, baseline, tolerances, stderr_factor=stderr_factor)


gate_task = register_task(
    "09.gate_decision",
    "gate(results: dict, baseline: dict, tolerances: dict[str, tuple[str, float, bool]]) -> list[str]  "
    "(the failed 'task.metric' names, sorted)",
    reference=reference_gate,
    forbid=("minillm.eval.gate.compare", "minillm.eval.compare", "minillm.book.grading.tasks.ch09._gate_rule"),
)

_GATE_HOW = ("for each task and metric of the BASELINE that has a tolerance (better, tol, relative): allowed = tol "
             "(x |baseline| if relative), then max(allowed, 2 x the larger stderr of the two files, where given); "
             "worse = baseline - value if higher is better, value - baseline if lower is; fail if worse > allowed; "
             "a metric the results lack fails. Return the 'task.metric' names, sorted.")


def _gate_rule(results: dict, baseline: dict, tolerances: dict, *, stderr_factor: float = 2.0, stderr: str = "max",
               direction: bool = True, relative: bool = True, strict: bool = True,
               missing_fails: bool = True) -> list[str]:
    """The gate's rule with each step switchable: every default is `reference_gate`, and each wrong version of
    `_GATE_SUSPECTS` flips one (stderr: "max" of the two files, "base" alone, or "none")."""
    failed = []
    for task, base_metrics in baseline["results"].items():
        ours = results["results"].get(task, {})
        for metric, base in base_metrics.items():
            if metric not in tolerances:
                continue  # counts and standard errors are not judged
            if metric not in ours:
                if missing_fails:
                    failed.append(f"{task}.{metric}")  # a gate must not pass by omission
                continue
            better, tolerance, rel = tolerances[metric]
            allowed = tolerance * abs(base) if (rel and relative) else tolerance
            se_base, se_ours = base_metrics.get(f"{metric}_stderr") or 0.0, ours.get(f"{metric}_stderr") or 0.0
            se = {"max": max(se_base, se_ours), "base": se_base, "none": 0.0}[stderr]
            allowed = max(allowed, stderr_factor * se)
            worse = (base - ours[metric]) if (better == "higher" or not direction) else (ours[metric] - base)
            if (worse > allowed) if strict else (worse >= allowed):
                failed.append(f"{task}.{metric}")
    return sorted(failed)


_GATE_SUSPECTS: list[tuple[Callable, str]] = [
    (lambda r, b, t: _gate_rule(r, b, t, stderr="none"),
     "widen the tolerance by the noise: allowed = max(tolerance, 2 x the larger standard error of the two files). "
     "A share measured on a few hundred documents moves by a few points by chance; a gate that fails on noise gets "
     "ignored."),
    (lambda r, b, t: _gate_rule(r, b, t, stderr_factor=1.0),
     "the noise band is 2 standard errors (about 95% of chance moves), not one: allowed = max(tolerance, 2 x stderr)."),
    (lambda r, b, t: _gate_rule(r, b, t, stderr="base"),
     "take the LARGER standard error of the two files (baseline and candidate), as minillm.eval.compare does: a "
     "candidate measured on fewer documents is noisier."),
    (lambda r, b, t: _gate_rule(r, b, t, direction=False),
     "mind which way is better: for perplexity and kl_divergence LOWER is better (tolerances say 'lower'), so a rise "
     "is the regression: worse = value - baseline for those."),
    (lambda r, b, t: _gate_rule(r, b, t, relative=False),
     "a relative tolerance scales with the baseline: perplexity's 0.02 means 2% of the baseline's perplexity "
     "(allowed = 0.02 x |baseline|), not 0.02 perplexity points."),
    (lambda r, b, t: _gate_rule(r, b, t, strict=False),
     "a change exactly at the tolerance passes: fail only when worse > allowed (strictly)."),
    (lambda r, b, t: _gate_rule(r, b, t, missing_fails=False),
     "a metric the baseline has and the results lack must FAIL: otherwise a change passes by not running the test."),
]


def _res(**tasks: dict) -> dict:
    return {"results": tasks}


def _gate_cases() -> list[tuple[dict, dict, dict]]:
    from minillm.eval.gate import TOLERANCES

    base = _res(perplexity={"perplexity": 50.0},
                next_line={"acc": 0.40, "acc_stderr": 0.02, "acc_norm": 0.45, "acc_norm_stderr": 0.02, "docs": 600},
                agreement={"top1_agreement": 1.0, "kl_divergence": 0.0, "positions": 4096})
    t = dict(TOLERANCES)
    return [
        # int4 per channel: perplexity +1.5% (passes), acc within noise, agreement down 5 points (fails)
        (_res(perplexity={"perplexity": 50.75},
              next_line={"acc": 0.37, "acc_stderr": 0.02, "acc_norm": 0.44, "acc_norm_stderr": 0.02, "docs": 600},
              agreement={"top1_agreement": 0.95, "kl_divergence": 0.015, "positions": 4096}), base, t),
        # perplexity +3% fails; kl 0.03 fails; acc_norm exactly at 2 stderr passes
        (_res(perplexity={"perplexity": 51.5},
              next_line={"acc": 0.40, "acc_stderr": 0.02, "acc_norm": 0.41, "acc_norm_stderr": 0.02, "docs": 600},
              agreement={"top1_agreement": 0.99, "kl_divergence": 0.03, "positions": 4096}), base, t),
        # a noisy candidate (100 docs): acc down 0.07 passes only with the candidate's larger stderr
        (_res(perplexity={"perplexity": 49.0},
              next_line={"acc": 0.33, "acc_stderr": 0.047, "acc_norm": 0.43, "acc_norm_stderr": 0.05, "docs": 100},
              agreement={"top1_agreement": 0.985, "kl_divergence": 0.01, "positions": 4096}), base, t),
        # acc down 0.05 at stderr 0.02: more than 2 stderr, fails; perplexity fell (better): passes
        (_res(perplexity={"perplexity": 45.0},
              next_line={"acc": 0.35, "acc_stderr": 0.02, "acc_norm": 0.45, "acc_norm_stderr": 0.02, "docs": 600},
              agreement={"top1_agreement": 1.0, "kl_divergence": 0.0, "positions": 4096}), base, t),
        # the candidate forgot the agreement task
        (_res(perplexity={"perplexity": 50.0},
              next_line={"acc": 0.40, "acc_stderr": 0.02, "acc_norm": 0.45, "acc_norm_stderr": 0.02, "docs": 600}),
         base, t),
    ]


def _same_list(a: object, b: object) -> bool:
    return isinstance(a, (list, tuple)) and list(a) == list(b)


def _check_gate(fn: Callable, cases: list[tuple[dict, dict, dict]], what: str) -> None:
    import copy

    got = []
    for results, baseline, tolerances in cases:
        g = call_catching(fn, (copy.deepcopy(results), copy.deepcopy(baseline), dict(tolerances)), "KeyError",
                          f"{what}: gate(...)", f"{reference_gate(results, baseline, tolerances)}",
                          "a key is missing: not every metric has a stderr (use .get(f'{metric}_stderr')), not every "
                          "metric has a tolerance (skip those), and the results may lack a task the baseline has "
                          "(that metric fails).")
        if not isinstance(g, (list, tuple)) or not all(isinstance(x, str) for x in g):
            raise MismatchError(f"{what}: gate(...)", "a list of 'task.metric' strings", short_repr(g, 80),
                                "return e.g. ['agreement.top1_agreement', 'perplexity.perplexity'], sorted.")
        got.append(list(g))
    for i, (g, case) in enumerate(zip(got, cases)):
        expected = reference_gate(*case)
        if g == expected:
            continue
        if sorted(g) == expected:
            raise MismatchError(f"{what} {i + 1}", f"{expected} (sorted)", f"{g}", "sort the names: sorted(failed).")
        hint = diagnose(got, cases, _GATE_SUSPECTS, _GATE_HOW, _same_list)
        moved = {f"{t}.{m}": (v, case[0]["results"].get(t, {}).get(m)) for t, ms in case[1]["results"].items()
                 for m, v in ms.items() if m in case[2]}
        raise MismatchError(f"{what} {i + 1} (baseline -> candidate: "
                            + ", ".join(f"{k} {b:g} -> {c if c is None else format(c, 'g')}"
                                        for k, (b, c) in moved.items()) + ")", f"{expected}", f"{g}", hint)


@gate_task.test("the book's tolerances on five changes: 4-bit weights (agreement fails), perplexity +3% and KL "
                "(fail), a noisy 100-document run (passes), accuracy down 2.5 standard errors (fails), a missing task")
def _(fn: Callable) -> None:
    _check_gate(fn, _gate_cases(), "case")


@gate_task.test("agrees with minillm.eval.compare on 200 random candidates (random tolerances and standard errors)")
def _(fn: Callable) -> None:
    from minillm.eval.gate import compare

    rng = random.Random(909)
    cases = []
    for _ in range(200):
        tolerances = {"perplexity": ("lower", rng.choice([0.01, 0.02, 0.05]), True),
                      "acc": ("higher", rng.choice([0.01, 0.02]), False),
                      "kl_divergence": ("lower", rng.choice([0.01, 0.02]), False)}
        base = _res(perplexity={"perplexity": rng.uniform(5, 80)},
                    mc={"acc": rng.uniform(0.2, 0.8), "acc_stderr": rng.choice([0.0, 0.01, 0.03]), "docs": 300},
                    agreement={"kl_divergence": 0.0, "top1_agreement": 1.0})
        cand = _res(perplexity={"perplexity": base["results"]["perplexity"]["perplexity"] * rng.uniform(0.95, 1.08)},
                    mc={"acc": base["results"]["mc"]["acc"] + rng.uniform(-0.1, 0.05),
                        "acc_stderr": rng.choice([0.0, 0.01, 0.04]), "docs": 300},
                    agreement={"kl_divergence": rng.uniform(0, 0.04), "top1_agreement": rng.uniform(0.9, 1.0)})
        cases.append((cand, base, tolerances))
    for case in cases:  # the grader's own consistency check against the engine's gate
        engine = sorted(f"{r.task}.{r.metric}" for r in compare(case[0], case[1], case[2]) if r.failed)
        if engine != reference_gate(*case):
            raise RuntimeError("the reference disagrees with minillm.eval.compare")
    _check_gate(fn, cases, "random case")


@gate_task.test("edge cases: a move exactly at the tolerance passes, metrics only the candidate has are ignored, "
                "a baseline with nothing to judge fails nothing")
def _(fn: Callable) -> None:
    from minillm.eval.gate import TOLERANCES

    t = dict(TOLERANCES)
    base = _res(perplexity={"perplexity": 50.0}, mc={"acc": 0.5, "docs": 100})
    _check_gate(fn, [
        (_res(perplexity={"perplexity": 51.0}, mc={"acc": 0.48, "docs": 100}), base, t),  # both exactly at the limit
        (_res(perplexity={"perplexity": 50.0}, mc={"acc": 0.5, "docs": 100}, extra={"acc": 0.0}), base, t),
        (_res(mc={"docs": 10}), _res(mc={"docs": 100}), t),
    ], "edge case")


# ---- 09.token_prices ---------------------------------------------------------------------------------


def reference_token_prices(config: str, gpu: str, usd_per_gpu_hour: float, prompt_len: int, context_len: int,
                           batch: int, n_gpus: int = 1) -> tuple[float, float]:
    """(input, output) USD per million tokens at the roofline, for a deployment on `n_gpus` GPUs.

    Input: the prompt is prefilled alone (batch 1) in prefill_time(config, gpu, prompt_len, n_gpus=n_gpus); each of
    its prompt_len tokens costs that time's share. Output: a decode step of `batch` sequences at context_len takes
    decode_step_time(config, gpu, context_len, batch, n_gpus=n_gpus) and yields `batch` tokens. Time costs
    usd_per_gpu_hour x n_gpus / 3600 per second.
    """
    return _prices_rule(config, gpu, usd_per_gpu_hour, prompt_len, context_len, batch, n_gpus)


prices_task = register_task(
    "09.token_prices",
    "token_prices(config: str, gpu: str, usd_per_gpu_hour: float, prompt_len: int, context_len: int, batch: int, "
    "n_gpus: int = 1) -> tuple[float, float]  (input and output USD per million tokens)",
    reference=reference_token_prices,
    forbid=("minillm.arithmetic.cost_per_million_tokens", "minillm.book.grading.tasks.ch09._prices_rule"),
)

_PRICES_HOW = ("usd_per_s = usd_per_gpu_hour * n_gpus / 3600; input = usd_per_s * prefill_time(config, gpu, "
               "prompt_len, n_gpus=n_gpus).time_s / prompt_len * 1e6; output = usd_per_s * decode_step_time(config, "
               "gpu, context_len, batch, n_gpus=n_gpus).time_s / batch * 1e6.")


def _prices_rule(config: str, gpu: str, usd: float, prompt_len: int, context_len: int, batch: int, n_gpus: int,
                 *, gpus_paid: bool = True, per_token: bool = True, hours: bool = True, scale: float = 1e6,
                 prefill_as_decode: bool = False, ideal_split: bool = True) -> tuple[float, float]:
    """The prices with each step switchable: every default is `reference_token_prices`, and each wrong version of
    `_PRICES_SUSPECTS` flips one."""
    usd_per_s = usd * (n_gpus if gpus_paid else 1) / (3600 if hours else 1)
    g = n_gpus if ideal_split else 1
    if prefill_as_decode:
        prefill_per_token = arithmetic.decode_step_time(config, gpu, prompt_len, 1, n_gpus=g).time_s
    else:
        prefill_per_token = arithmetic.prefill_time(config, gpu, prompt_len, n_gpus=g).time_s / prompt_len
    decode = arithmetic.decode_step_time(config, gpu, context_len, batch, n_gpus=g).time_s
    return usd_per_s * prefill_per_token * scale, usd_per_s * decode / (batch if per_token else 1) * scale


_PRICES_SUSPECTS: list[tuple[Callable, str]] = [
    (lambda *a: _prices_rule(*a, gpus_paid=False),
     "you pay for every GPU of the deployment: usd_per_s = usd_per_gpu_hour * n_gpus / 3600 (the roofline time with "
     "n_gpus is already the shorter time of all of them working together)."),
    (lambda *a: _prices_rule(*a, ideal_split=False),
     "pass n_gpus to the roofline too (prefill_time(..., n_gpus=n_gpus), decode_step_time(..., n_gpus=n_gpus)): the "
     "work splits across the GPUs, so the step is shorter, and you pay for all of them."),
    (lambda *a: _prices_rule(*a, per_token=False),
     "a decode step of `batch` sequences yields `batch` tokens: divide the step's cost by batch. That division is "
     "why batching makes output cheap."),
    (lambda *a: _prices_rule(*a, hours=False),
     "the price is per GPU-HOUR: divide by 3600 for the cost of a second."),
    (lambda *a: _prices_rule(*a, scale=1e3),
     "prices are per MILLION tokens: cost per token x 1e6."),
    (lambda *a: _prices_rule(*a, prefill_as_decode=True),
     "prompt tokens are not decoded one at a time: the whole prompt runs in ONE forward, prefill_time(config, gpu, "
     "prompt_len), which reads the weights once for all its tokens. Divide that time by prompt_len."),
]


def _check_prices(fn: Callable, cases: list[tuple], what: str) -> None:
    got = []
    for case in cases:
        g = call_catching(fn, case, "TypeError", f"{what}: token_prices{case}", "(input, output) floats",
                          "call minillm.arithmetic.prefill_time(config, gpu, prompt_len, n_gpus=n_gpus) and "
                          "decode_step_time(config, gpu, context_len, batch, n_gpus=n_gpus); each returns a Roofline "
                          "whose .time_s is in seconds.")
        if not (isinstance(g, (tuple, list)) and len(g) == 2 and all(is_number(x) for x in g)):
            raise MismatchError(f"{what}: token_prices{case}", "a pair of numbers (input, output)", short_repr(g, 80),
                                "return (input_usd_per_million, output_usd_per_million) as Python floats.")
        got.append(tuple(float(x) for x in g))
    for g, case in zip(got, cases):
        e = reference_token_prices(*case)
        if all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(g, e)):
            continue
        hint = diagnose(got, cases, _PRICES_SUSPECTS, _PRICES_HOW,
                        lambda a, b: all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(a, b)))
        which = "input" if not math.isclose(g[0], e[0], rel_tol=1e-6) else "output"
        raise MismatchError(f"{what}: token_prices{case}, the {which} price",
                            f"({e[0]:.4g}, {e[1]:.4g}) USD per million", f"({g[0]:.4g}, {g[1]:.4g})", hint)


@prices_task.test("Llama-3-8B on one H100 at 2.50 USD an hour: a 2,048-token prompt, decode at batch 64 and context "
                  "2,048; then on 4 GPUs, and an L4 at batch 8")
def _(fn: Callable) -> None:
    _check_prices(fn, [("llama-3-8b", "h100-sxm", 2.5, 2048, 2048, 64, 1),
                       ("llama-3-8b", "h100-sxm", 2.5, 2048, 2048, 64, 4),
                       ("llama-3-8b", "l4", 0.8, 1024, 1536, 8, 1)], "the example")


@prices_task.test("Llama-3-70B on 4 and 8 H100s and Llama-2-7B on an A100, at several batches and lengths")
def _(fn: Callable) -> None:
    rng = random.Random(919)
    cases = [(rng.choice(["llama-3-70b", "llama-2-7b", "llama-3-8b"]), rng.choice(["h100-sxm", "a100-80gb", "h200"]),
              rng.choice([1.5, 2.5, 4.0]), rng.choice([128, 512, 4096]), rng.choice([512, 4096, 16384]),
              rng.choice([1, 16, 128]), rng.choice([1, 2, 4, 8])) for _ in range(20)]
    _check_prices(fn, cases, "a random case")


@prices_task.test("tensor parallelism: Llama-3-70B on 8 H200s, at batch 1 and 256 (every GPU is paid for)")
def _(fn: Callable) -> None:
    _check_prices(fn, [("llama-3-70b", "h200", 3.5, 8192, 8192, 1, 8),
                       ("llama-3-70b", "h200", 3.5, 8192, 8192, 256, 8)], "8 GPUs")


# ---- 09.diagnose -------------------------------------------------------------------------------------

CAUSES = ("none", "preemptions", "kv fallback", "speculation at high batch", "constrained decoding", "batch grew",
          "unknown")


def reference_diagnose(before: dict, after: dict) -> str:
    """The runbook "TPOT got worse", in order, on two snapshots of the engine's signals.

    Signals: tpot_ms (p50), mean_batch (decode rows per step), preemptions (in the window), attention ("paged
    kernel" or "gather fallback"), speculative (drafting on?), constrained_share (share of requests under a grammar).
    1. TPOT within 10% of before: "none" (no regression to explain).
    2. preemptions rose: "preemptions" (evicted sequences are recomputed inside the decode steps).
    3. attention left the paged kernel: "kv fallback" (the cache is gathered and dequantised every step).
    4. speculation on, at a mean batch of 32 or more: "speculation at high batch" (verify costs compute there).
    5. constrained share up by 0.1 or more: "constrained decoding" (a mask per row per step).
    6. mean batch up by 25% or more: "batch grew".
    7. otherwise "unknown": profile the step.
    """
    return _runbook(before, after)


diagnose_task = register_task(
    "09.diagnose",
    "diagnose(before: dict, after: dict) -> str  (one of: " + ", ".join(repr(c) for c in CAUSES) + ")",
    reference=reference_diagnose,
    forbid=("minillm.book.grading.tasks.ch09._runbook",),
)

_DIAG_HOW = ("follow the runbook in order and stop at the first match: TPOT within 10% -> 'none'; preemptions rose -> "
             "'preemptions'; attention left the 'paged kernel' -> 'kv fallback'; speculative with mean_batch >= 32 -> "
             "'speculation at high batch'; constrained_share up >= 0.1 -> 'constrained decoding'; mean_batch up "
             ">= 25% -> 'batch grew'; else 'unknown'.")


def _snapshot(**kw: object) -> dict:
    s = {"tpot_ms": 20.0, "mean_batch": 16.0, "preemptions": 0, "attention": "paged kernel", "speculative": False,
         "constrained_share": 0.0}
    s.update(kw)
    return s


def _diag_cases() -> list[tuple[dict, dict]]:
    b = _snapshot()
    return [
        (b, _snapshot(tpot_ms=21.0, mean_batch=24.0)),  # batch grew but TPOT within 10%: none
        (b, _snapshot(tpot_ms=30.0, mean_batch=40.0)),  # batch grew
        (b, _snapshot(tpot_ms=35.0, mean_batch=20.0, preemptions=12)),  # preemptions (the batch moved a little too)
        (b, _snapshot(tpot_ms=31.0, mean_batch=28.0, preemptions=3)),  # both moved: preemptions first
        (b, _snapshot(tpot_ms=29.0, attention="gather fallback")),  # kv fallback
        (b, _snapshot(tpot_ms=40.0, mean_batch=48.0, speculative=True)),  # speculation at high batch
        (_snapshot(speculative=True, mean_batch=4.0, tpot_ms=10.0),
         _snapshot(speculative=True, mean_batch=4.5, tpot_ms=12.0)),  # speculation at low batch: unknown
        (b, _snapshot(tpot_ms=26.0, constrained_share=0.5)),  # constrained decoding
        (b, _snapshot(tpot_ms=26.0, constrained_share=0.05, mean_batch=18.0)),  # nothing moved enough: unknown
        (b, _snapshot(tpot_ms=24.0, mean_batch=22.0, constrained_share=0.3, attention="gather fallback")),
    ]


def _runbook(b: dict, a: dict, *, check_none: bool = True, batch_first: bool = False, guess: bool = False,
             spec_any_batch: bool = False) -> str:
    """The runbook with each step switchable: every default is `reference_diagnose`, and each wrong version of
    `_DIAG_SUSPECTS` flips one."""
    if check_none and a["tpot_ms"] <= 1.1 * b["tpot_ms"]:
        return "none"
    if batch_first and a["mean_batch"] >= 1.25 * b["mean_batch"]:
        return "batch grew"
    if a["preemptions"] > b["preemptions"]:
        return "preemptions"
    if b["attention"] == "paged kernel" and a["attention"] != "paged kernel":
        return "kv fallback"
    if a["speculative"] and (spec_any_batch or a["mean_batch"] >= 32):
        return "speculation at high batch"
    if a["constrained_share"] - b["constrained_share"] >= 0.1:
        return "constrained decoding"
    if a["mean_batch"] >= 1.25 * b["mean_batch"]:
        return "batch grew"
    return "batch grew" if guess else "unknown"


_DIAG_SUSPECTS: list[tuple[Callable, str]] = [
    (lambda b, a: _runbook(b, a, check_none=False),
     "first check that TPOT really got worse (more than 10% above before): a batch that grew while TPOT held is not a "
     "regression to explain, it is 'none'."),
    (lambda b, a: _runbook(b, a, batch_first=True),
     "check the batch LAST: preemptions and a kernel fallback also come with a bigger or changing batch, and they are "
     "the cause to fix. The runbook's order: preemptions, kernel fallback, speculation, constraints, then the batch."),
    (lambda b, a: _runbook(b, a, guess=True),
     "when no signal moved enough, say 'unknown' (and profile the step): guessing 'batch grew' sends the on-call "
     "engineer after the wrong fix."),
    (lambda b, a: _runbook(b, a, spec_any_batch=True),
     "blame speculation only at high batch (mean_batch >= 32): there a step is no longer nearly free to widen, and "
     "the verify forward's k + 1 positions per row and its rejected drafts cost real time; at low batch it is what "
     "makes decoding faster."),
]


def _check_diagnose(fn: Callable, cases: list[tuple[dict, dict]], what: str) -> None:
    got = []
    for before, after in cases:
        g = call_catching(fn, (dict(before), dict(after)), "KeyError", f"{what}: diagnose(...)",
                          repr(reference_diagnose(before, after)),
                          "the snapshots hold tpot_ms, mean_batch, preemptions, attention, speculative and "
                          "constrained_share; read those keys.")
        if g not in CAUSES:
            raise MismatchError(f"{what}: diagnose(...)", "one of " + ", ".join(repr(c) for c in CAUSES),
                                short_repr(g, 80), "return one of the cause strings exactly as listed.")
        got.append(g)
    for i, (g, (before, after)) in enumerate(zip(got, cases)):
        expected = reference_diagnose(before, after)
        if g != expected:
            moved = ", ".join(f"{k} {before[k]} -> {after[k]}" for k in before if before[k] != after[k])
            raise MismatchError(f"{what} {i + 1} ({moved or 'nothing moved'})", repr(expected), repr(g),
                                diagnose(got, cases, _DIAG_SUSPECTS, _DIAG_HOW))


@diagnose_task.test("ten pages: each cause alone, a batch that grew without a regression, speculation at low batch, "
                    "nothing that moved enough, and several signals at once")
def _(fn: Callable) -> None:
    _check_diagnose(fn, _diag_cases(), "page")


@diagnose_task.test("no regression: TPOT within 10% of before is 'none', whatever else moved")
def _(fn: Callable) -> None:
    b = _snapshot()
    _check_diagnose(fn, [(b, _snapshot(tpot_ms=22.0, preemptions=4, mean_batch=64.0)),
                         (b, _snapshot(tpot_ms=15.0, attention="gather fallback", speculative=True)),
                         (b, b)], "quiet page")


@diagnose_task.test("200 random pages with several signals moving at once follow the runbook's order")
def _(fn: Callable) -> None:
    rng = random.Random(929)
    cases = []
    for _ in range(200):
        before = _snapshot(tpot_ms=rng.uniform(5, 40), mean_batch=float(rng.choice([2, 8, 16, 40])),
                           preemptions=rng.choice([0, 0, 2]), speculative=rng.random() < 0.3,
                           constrained_share=rng.choice([0.0, 0.1]))
        after = _snapshot(tpot_ms=before["tpot_ms"] * rng.uniform(0.9, 2.0),
                          mean_batch=before["mean_batch"] * rng.choice([1.0, 1.1, 1.5, 3.0]),
                          preemptions=before["preemptions"] + rng.choice([0, 0, 0, 5]),
                          attention=rng.choice(["paged kernel"] * 4 + ["gather fallback"]),
                          speculative=before["speculative"] or rng.random() < 0.2,
                          constrained_share=before["constrained_share"] + rng.choice([0.0, 0.0, 0.05, 0.4]))
        cases.append((before, after))
    _check_diagnose(fn, cases, "random page")
