"""Chapter 08's exercise tasks: a tensor-parallel split of a SwiGLU MLP, the time to ship a prompt's KV cache from a
prefill worker to a decode worker, the timeline (and so the bubble) of a pipeline, and the decode worker's decision
to take a prefilled request now or make it wait.

The MLP split is checked rank by rank: the reader returns each rank's partial output (before the all-reduce), which
must equal what rank r computes from `minillm.parallel.tensor.column_shard` / `row_shard`'s slices, and the partials
must sum to the unsplit layer (also the shipped model's layer-0 MLP). The transfer time is checked against
`minillm.arithmetic.kv_transfer_time` on published configurations and against the bytes `minillm.parallel.disagg`
sends. The timeline is compared slot by slot with the schedules of `minillm.parallel.pipeline`, and its idle share with
`bubble_formula` and `ring_bubble_formula`. The admission decision is compared with a live `LLMEngine`'s
`reserve_prefilled`, the method the decode worker of `minillm.parallel.disagg` calls for every offer.

Each wrong answer is diagnosed by running the common wrong versions on the same cases: the hint names the first
one the reader's answers agree with.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minillm import arithmetic
from minillm.arithmetic import cdiv
from minillm.book.grading.registry import (
    MismatchError,
    call_catching,
    diagnose,
    expect_close,
    is_number,
    register_task,
    short_repr,
)

# ---- 08.split_mlp ------------------------------------------------------------------------------------


def _swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The unsplit SwiGLU MLP: (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def reference_mlp_partials(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                           world: int) -> list[torch.Tensor]:
    """Each rank's partial output of a tensor-parallel SwiGLU MLP, before the all-reduce (Megatron-LM's split).

    x [T, dim]; w_gate, w_up [ffn, dim] (nn.Linear's [out, in]); w_down [dim, ffn]. Rank r keeps the contiguous
    slice r of the ffn features: rows r * ffn / world ... of w_gate and w_up (column-parallel), the same columns
    of w_down (row-parallel). Its hidden units depend on x and its own rows only, so the non-linearity runs
    locally; its product with w_down's columns is one term of the sum over the ffn features. Returns `world`
    tensors [T, dim] whose sum is the unsplit MLP.
    """
    parts = zip(w_gate.chunk(world, dim=0), w_up.chunk(world, dim=0), w_down.chunk(world, dim=1))
    return [(F.silu(x @ g.T) * (x @ u.T)) @ d.T for g, u, d in parts]


split_mlp_task = register_task(
    "08.split_mlp",
    "mlp_partials(x: Tensor[T, dim], w_gate: Tensor[ffn, dim], w_up: Tensor[ffn, dim], w_down: Tensor[dim, ffn], "
    "world: int) -> list[Tensor[T, dim]]  (each rank's partial output; their sum is the MLP)",
    reference=reference_mlp_partials,
    forbid=("minillm.parallel.tensor.column_shard", "minillm.parallel.tensor.row_shard",
            "minillm.parallel.tensor.shard_state"),
)

_SPLIT_HOW = ("rank r keeps the contiguous slice r of the ffn features: g = w_gate.chunk(world, 0)[r], "
              "u = w_up.chunk(world, 0)[r], d = w_down.chunk(world, 1)[r]; its partial is "
              "(silu(x @ g.T) * (x @ u.T)) @ d.T.")


def _strided(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
             world: int) -> list[torch.Tensor]:
    return [_swiglu(x, w_gate[r::world], w_up[r::world], w_down[:, r::world]) for r in range(world)]


def _split_input(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                 world: int) -> list[torch.Tensor]:
    parts = zip(x.chunk(world, -1), w_gate.chunk(world, 1), w_up.chunk(world, 1))
    return [(F.silu(xr @ g.T) * (xr @ u.T)) @ w_down.T for xr, g, u in parts]


_SPLIT_SUSPECTS: list[tuple[Callable, str]] = [
    (lambda x, g, u, d, w: [p / w for p in reference_mlp_partials(x, g, u, d, w)],
     "do not divide by world: an all-reduce SUMS the partials. Each rank's product with its columns of w_down is "
     "one term of the sum over the ffn features, already at full scale."),
    (lambda x, g, u, d, w: [_swiglu(x, g, u, d)] * w,
     "each rank computes with its own SLICE of the weights, not the whole layer: every rank returning the full "
     "output makes the all-reduce add it world times. " + _SPLIT_HOW),
    (lambda x, g, u, d, w: [_swiglu(x, g, u, d) / w] * w,
     "the partials must come from the split weights: dividing the whole layer's output by world sums to the right "
     "answer but does none of the split (and reads every weight on every rank). " + _SPLIT_HOW),
    (_strided,
     "take CONTIGUOUS slices in rank order (torch.chunk), not every world-th feature: a strided split sums to the "
     "same output, but rank r's partial differs from what rank r holds in Megatron-LM's and minillm's shards "
     "(column_shard / row_shard), and a checkpoint sharded one way cannot be loaded the other way."),
    (_split_input,
     "the FIRST projections are column-parallel: every rank reads the whole x and keeps its rows of w_gate and "
     "w_up (a slice of the ffn features). Splitting x and the input columns gives partial sums of gate and up, and "
     "silu of a partial sum is not a partial of silu: the result is wrong."),
    (lambda x, g, u, d, w: [(F.silu(x @ gr.T) * (x @ ur.T)) @ d.chunk(w, 1)[r].T
                            for r, (gr, ur) in enumerate(zip(g.chunk(w, 0), u.chunk(w, 0)[::-1]))],
     "take the SAME slice of w_gate and w_up on a rank: hidden unit j is silu(gate_j) * up_j, so gate row j and "
     "up row j must sit on the same rank, with column j of w_down."),
    (lambda x, g, u, d, w: [(F.silu(x @ gr.T) * (x @ ur.T)) @ dr.T for gr, ur, dr in
                            zip(g.chunk(w, 0), u.chunk(w, 0), d.chunk(w, 1)[::-1])],
     "rank r multiplies its hidden units by the MATCHING columns of w_down, slice r (the same features it kept "
     "of w_gate and w_up)."),
    (lambda x, g, u, d, w: [(F.silu(x @ gr.T) * (x @ ur.T)) @ dr.T for gr, ur, dr in
                            zip(u.chunk(w, 0), g.chunk(w, 0), d.chunk(w, 1))],
     "silu goes on the GATE projection: silu(x @ w_gate.T) * (x @ w_up.T), not silu of the up projection."),
]


def _as_partials(got: object, world: int, what: str) -> list[torch.Tensor]:
    if isinstance(got, torch.Tensor) or not isinstance(got, (list, tuple)):
        raise MismatchError(what, f"a list of {world} tensors, one partial output per rank",
                            f"{type(got).__name__} {short_repr(got, 80)}",
                            "return [partial_0, ..., partial_{world-1}], each [T, dim]: what each rank holds BEFORE "
                            "the all-reduce adds them up (do not sum or stack them).")
    if len(got) != world:
        raise MismatchError(what, f"{world} partials (one per rank)", f"{len(got)}",
                            "one partial output per rank: a list of world tensors.")
    if not all(isinstance(p, torch.Tensor) for p in got):
        bad = next(p for p in got if not isinstance(p, torch.Tensor))
        raise MismatchError(what, "every partial a torch.Tensor [T, dim]", f"a {type(bad).__name__}",
                            "compute each partial with torch operations on x and the rank's weight slices.")
    return list(got)


def _same_partials(a: object, b: list[torch.Tensor]) -> bool:
    return (isinstance(a, (list, tuple)) and len(a) == len(b) and all(
        isinstance(p, torch.Tensor) and p.shape == q.shape and torch.allclose(p.double(), q.double(), atol=1e-4,
                                                                              rtol=1e-4) for p, q in zip(a, b)))


def _mlp_case(gen: torch.Generator, tokens: int, dim: int, ffn: int, dtype: torch.dtype = torch.float64
              ) -> tuple[torch.Tensor, ...]:
    x = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    w = [torch.randn(ffn, dim, generator=gen, dtype=torch.float64) / dim ** 0.5 for _ in range(2)]
    w_down = torch.randn(dim, ffn, generator=gen, dtype=torch.float64) / ffn ** 0.5
    return tuple(t.to(dtype) for t in (x, *w, w_down))


def _megatron_slices(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, rank: int, world: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slices as minillm shards the stacked gate_up_proj and down_proj (the grader's own check)."""
    from minillm.parallel.tensor import column_shard, row_shard

    ffn = w_gate.shape[0]
    gate_up = column_shard(torch.cat([w_gate, w_up]), (ffn, ffn), rank, world)
    return (*gate_up.chunk(2, dim=0), row_shard(w_down, rank, world))


def _check_split(fn: Callable, cases: list[tuple], what: str) -> None:
    got = []
    for x, w_gate, w_up, w_down, world in cases:
        g = call_catching(fn, (x.clone(), w_gate.clone(), w_up.clone(), w_down.clone(), world), "RuntimeError",
                          f"{what}: mlp_partials(x {tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, w_up "
                          f"{tuple(w_up.shape)}, w_down {tuple(w_down.shape)}, world={world})",
                          f"{world} partials of shape {tuple(x.shape)}",
                          "mind the shapes: rank r's hidden units h_r are [T, ffn / world] and multiply the "
                          "matching COLUMNS of w_down, w_down.chunk(world, dim=1)[r], of shape [dim, ffn / world]. "
                          "w_gate and w_up are split by ROWS (dim=0): [ffn / world, dim] each.")
        got.append(_as_partials(g, world, f"{what}: mlp_partials(..., world={world})"))
    for g, (x, w_gate, w_up, w_down, world) in zip(got, cases):
        expected = reference_mlp_partials(x, w_gate, w_up, w_down, world)
        for r in range(world):  # the grader's own consistency check against minillm's sharding
            gr, ur, dr = _megatron_slices(w_gate, w_up, w_down, r, world)
            if not torch.allclose(_swiglu(x, gr, ur, dr), expected[r]):
                raise RuntimeError("the reference disagrees with minillm.parallel.tensor's shards")
        if _same_partials(g, expected) and all(p.dtype == x.dtype for p in g):
            continue
        hint = diagnose(got, cases, _SPLIT_SUSPECTS, _SPLIT_HOW, _same_partials)
        total, whole = sum(p.double() for p in g), _swiglu(x, w_gate, w_up, w_down).double()
        if total.shape == whole.shape and torch.allclose(total, whole, atol=1e-4, rtol=1e-4) \
                and not _same_partials(g, expected) and hint == _SPLIT_HOW:
            hint = "the partials sum to the MLP, but rank r's must be what rank r computes from its own slice: " \
                   + _SPLIT_HOW
        r = next((r for r in range(world) if not _same_partials([g[r]], [expected[r]])), 0)
        expect_close(g[r], expected[r], f"{what}: rank {r}'s partial of {world} (x {tuple(x.shape)}, ffn "
                     f"{w_gate.shape[0]})", hint, atol=1e-4, rtol=1e-4)


@split_mlp_task.test("two ranks (dim 8, ffn 12): rank r's partial uses rows r*6..r*6+5 of w_gate and w_up and the same "
                     "columns of w_down, and the two partials sum to the unsplit MLP")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(801)
    x, w_gate, w_up, w_down = _mlp_case(gen, 3, 8, 12)
    _check_split(fn, [(x, w_gate, w_up, w_down, 2)], "the example")
    got = fn(x, w_gate, w_up, w_down, 2)
    expect_close(sum(got), _swiglu(x, w_gate, w_up, w_down), "the all-reduce (a sum) of your two partials",
                 "the sum of the partials must be the unsplit MLP, (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T.",
                 atol=1e-8, rtol=1e-8)


@split_mlp_task.test("world = 1 is the unsplit layer; 3, 4 and 6 ranks on other shapes; one token and many")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(802)
    cases = []
    for tokens, dim, ffn, world in ((1, 6, 12, 1), (5, 6, 12, 3), (1, 16, 24, 4), (7, 10, 24, 6), (4, 4, 8, 2)):
        cases.append((*_mlp_case(gen, tokens, dim, ffn), world))
    _check_split(fn, cases, "a random case")


@split_mlp_task.test("float32 in, float32 out: the shipped model's layer-0 MLP (dim 384, ffn 1024) over 2 and 4 "
                     "ranks sums back to the layer's own output")
def _(fn: Callable) -> None:
    import minillm

    model, _ = minillm.load(minillm.DEFAULT_MODEL)
    mlp = model.layers[0].mlp
    w_gate, w_up = mlp.gate_up_proj.weight.detach().chunk(2, dim=0)
    w_down = mlp.down_proj.weight.detach()
    x = torch.randn(4, model.config.dim, generator=torch.Generator().manual_seed(803))
    with torch.no_grad():
        whole = mlp(x)
    for world in (2, 4):
        _check_split(fn, [(x, w_gate, w_up, w_down, world)], "the shipped model's layer 0")
        got = fn(x, w_gate, w_up, w_down, world)
        expect_close(sum(got), whole, f"the sum of your {world} partials against model.layers[0].mlp(x)",
                     "the partials must add up to the layer's output.", atol=1e-4, rtol=1e-4)


# ---- 08.kv_transfer ----------------------------------------------------------------------------------


def reference_kv_transfer_s(prompt_tokens: int, n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: float,
                            link_gbit_s: float, latency_s: float = 0.0) -> float:
    """Seconds to send a prompt's KV cache from a prefill worker to a decode worker over a link of `link_gbit_s`
    gigabits per second (10^9 bits, as network links are sold), plus the link's fixed latency:

        bytes = 2 (K and V) x n_layers x prompt_tokens x n_kv_heads x head_dim x dtype_bytes
        time  = bytes / (link_gbit_s x 10^9 / 8) + latency_s
    """
    nbytes = 2 * n_layers * prompt_tokens * n_kv_heads * head_dim * dtype_bytes
    return nbytes / (link_gbit_s * 1e9 / 8) + latency_s


kv_transfer_task = register_task(
    "08.kv_transfer",
    "kv_transfer_s(prompt_tokens: int, n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: float, "
    "link_gbit_s: float, latency_s: float = 0.0) -> float  (seconds)",
    reference=reference_kv_transfer_s,
    forbid=("minillm.arithmetic.kv_transfer_time", "minillm.arithmetic.kv_cache_bytes",
            "minillm.arithmetic.kv_cache_bytes_per_token"),
)

_KV_HOW = ("bytes = 2 * n_layers * prompt_tokens * n_kv_heads * head_dim * dtype_bytes (a key AND a value per layer, "
           "token and KV head); the link moves link_gbit_s * 1e9 / 8 bytes a second; seconds = bytes / that + "
           "latency_s.")


def _kv_variant(kv: float = 2, bytes_per_s: Callable[[float], float] = lambda g: g * 1e9 / 8,
                latency: str = "once", scale: float = 1.0) -> Callable[..., float]:
    def kv_transfer_s(tokens: int, layers: int, heads: int, head_dim: int, dtype_bytes: float, gbit: float,
                      latency_s: float = 0.0) -> float:
        nbytes = kv * layers * tokens * heads * head_dim * dtype_bytes
        extra = {"once": latency_s, "none": 0.0, "per_layer": layers * latency_s}[latency]
        return scale * (nbytes / bytes_per_s(gbit) + extra)
    return kv_transfer_s


_KV_SUSPECTS: list[tuple[Callable, str]] = [
    (_kv_variant(kv=1), "count the keys AND the values: 2 x n_layers x tokens x n_kv_heads x head_dim x dtype_bytes."),
    (_kv_variant(bytes_per_s=lambda g: g * 1e9),
     "the link is in giga*bits* per second: 8 bits a byte, so 400 Gb/s moves 50e9 bytes a second "
     "(link_gbit_s * 1e9 / 8)."),
    (_kv_variant(bytes_per_s=lambda g: g * 1e9 * 8),
     "bits to bytes divides by 8: a link of link_gbit_s Gb/s moves link_gbit_s * 1e9 / 8 bytes a second."),
    (_kv_variant(bytes_per_s=lambda g: g * 2 ** 30 / 8),
     "a network's giga is 10^9 (decimal), not 2^30: link_gbit_s * 1e9 / 8 bytes a second."),
    (_kv_variant(latency="none"), "add the link's fixed latency, latency_s, once per transfer."),
    (_kv_variant(latency="per_layer"),
     "the latency is paid once for the whole transfer here (one message), not once per layer."),
    (_kv_variant(scale=1e3), "return seconds, not milliseconds."),
]


def _check_kv(fn: Callable, cases: list[tuple], what: str) -> None:
    got = []
    for case in cases:
        g = call_catching(fn, case, "ZeroDivisionError", f"{what}: kv_transfer_s{case}",
                          f"{reference_kv_transfer_s(*case):.6g} s", "divide by the link's bytes per second, "
                          "link_gbit_s * 1e9 / 8, which is never 0 here.")
        if not is_number(g):
            raise MismatchError(f"{what}: kv_transfer_s{case}", "a float, in seconds", f"{type(g).__name__} "
                                f"{short_repr(g, 80)}", "return the time as a plain number (a float of seconds).")
        got.append(float(g))
    for g, case in zip(got, cases):
        e = reference_kv_transfer_s(*case)
        if not math.isclose(g, e, rel_tol=1e-6, abs_tol=1e-12):
            raise MismatchError(f"{what}: kv_transfer_s{case}", f"{e:.6g} s", f"{g:.6g} s",
                                diagnose(got, cases, _KV_SUSPECTS, _KV_HOW,
                                         lambda a, b: math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)))


@kv_transfer_task.test("Llama-3-8B (32 layers, 8 KV heads of 128), an 8,192-token prompt in bf16 over 400 Gb/s RDMA: "
                       "1.07 GB in 21.5 ms")
def _(fn: Callable) -> None:
    _check_kv(fn, [(8192, 32, 8, 128, 2, 400.0), (8192, 32, 8, 128, 2, 400.0, 0.0)], "the example")


@kv_transfer_task.test("the link's fixed latency is added once; fp32 and 8-bit caches; one token")
def _(fn: Callable) -> None:
    _check_kv(fn, [(1000, 32, 8, 128, 2, 100.0, 20e-6), (512, 6, 2, 64, 4, 8.0, 1e-3), (4096, 80, 8, 128, 1, 400.0,
                                                                                          5e-6),
                   (1, 32, 8, 128, 2, 3200.0, 2e-6)], "latency and dtypes")


@kv_transfer_task.test("agrees with minillm.arithmetic.kv_transfer_time for Llama-2-7B, Llama-3-70B, Qwen2.5-7B and "
                       "Mistral-7B over NVLink (7,200 Gb/s), 400 Gb/s and 100 Gb/s links")
def _(fn: Callable) -> None:
    rng = random.Random(808)
    cases = []
    for name in ("llama-2-7b", "llama-3-70b", "qwen2.5-7b", "mistral-7b"):
        c = arithmetic.preset(name)
        for gbit in (7200.0, 400.0, 100.0):
            tokens, latency, dtype = rng.choice([128, 2048, 32768]), rng.choice([0.0, 1e-5]), rng.choice([1, 2])
            case = (tokens, c.n_layers, c.n_kv_heads, c.head_dim, dtype, gbit, latency)
            expected = arithmetic.kv_transfer_time(c, tokens, gbit * 1e9 / 8, dtype_bytes=dtype, latency_s=latency)
            if not math.isclose(reference_kv_transfer_s(*case), expected, rel_tol=1e-12):  # the grader's own check
                raise RuntimeError(f"the reference disagrees with minillm.arithmetic.kv_transfer_time for {name}")
            cases.append(case)
    _check_kv(fn, cases, "a published model")


@kv_transfer_task.test("the shipped model (6 layers, 2 KV heads of 64, fp32): a 512-token prompt is the 2,359,296 "
                       "bytes minillm.parallel.disagg sends (over an 8 Gb/s link, 1 GB/s: 2.36 ms)")
def _(fn: Callable) -> None:
    _check_kv(fn, [(512, 6, 2, 64, 4, 8.0)], "the shipped model")


# ---- 08.pipeline_timeline ----------------------------------------------------------------------------


def reference_pipeline_timeline(p: int, m: int, steps: int = 1, schedule: str = "gpipe") -> list[list[int | None]]:
    """Which micro-batch each of p stages runs in each time slot (None: idle), for m equal micro-batches going
    through `steps` forwards (the prefill, then decode steps), under minillm's two schedules:

    "gpipe": every step is one fill and drain: micro-batch i of step t runs on stage s in slot
             t * (m + p - 1) + s + i; steps * (m + p - 1) slots.
    "ring":  micro-batch i enters stage 0 for step t as soon as its token of step t - 1 is back (p slots after it
             entered the step before) and stage 0 is free: slot t * max(m, p) + i + s on stage s;
             (steps - 1) * max(m, p) + m + p - 1 slots.
    """
    period = m + p - 1 if schedule == "gpipe" else max(m, p)
    slots = (steps - 1) * period + m + p - 1
    grid: list[list[int | None]] = [[None] * slots for _ in range(p)]
    for t in range(steps):
        for i in range(m):
            for s in range(p):
                grid[s][t * period + i + s] = i
    return grid


pipeline_task = register_task(
    "08.pipeline_timeline",
    "pipeline_timeline(p: int, m: int, steps: int = 1, schedule: str = 'gpipe') -> list[list[int | None]]  "
    "(p rows, one per stage; per slot the micro-batch run, or None)",
    reference=reference_pipeline_timeline,
    forbid=("minillm.parallel.pipeline.bubble_formula", "minillm.parallel.pipeline.ring_bubble_formula",
            "minillm.parallel.pipeline.pipeline_generate", "minillm.parallel.pipeline.run_pipeline",
            "minillm.arithmetic.pipeline_bubble_fraction"),
)

_PIPE_HOW = ("stage s runs micro-batch i of step t in slot start(t) + i + s, where a step starts every m + p - 1 slots "
             "in gpipe (fill and drain) and every max(m, p) slots in ring (a micro-batch is back at stage 0 p slots "
             "after it entered); the grid ends when the last micro-batch leaves the last stage.")


def _timeline_variant(period: Callable[[int, int, str], int], offset: int = 1, extra: int = 0,
                      order: str = "forward") -> Callable[..., list[list[int | None]]]:
    def timeline(p: int, m: int, steps: int = 1, schedule: str = "gpipe") -> list[list[int | None]]:
        per = period(p, m, schedule)
        slots = (steps - 1) * per + m + (p - 1) * offset + extra
        grid: list[list[int | None]] = [[None] * slots for _ in range(p)]
        for t in range(steps):
            for i in range(m):
                for s in range(p):
                    grid[s][t * per + i + s * offset] = i if order == "forward" else m - 1 - i
        return grid
    return timeline


def _right_period(p: int, m: int, schedule: str) -> int:
    return m + p - 1 if schedule == "gpipe" else max(m, p)


_PIPE_SUSPECTS: list[tuple[Callable, str]] = [
    (_timeline_variant(lambda p, m, sc: max(m, p)),
     "gpipe drains between steps: stage 0 starts step t + 1 only when the tokens of ALL m micro-batches of step t "
     "are back, so a step takes m + p - 1 slots and the next one starts after it."),
    (_timeline_variant(lambda p, m, sc: m + p - 1),
     "ring does not drain: micro-batch i re-enters stage 0 as soon as ITS token is back, p slots after it entered "
     "(and stage 0 is free), so steps start every max(m, p) slots."),
    (_timeline_variant(lambda p, m, sc: m if sc == "ring" else m + p - 1),
     "a micro-batch cannot start step t + 1 before its token of step t is back from the last stage, p slots after "
     "it entered stage 0: with m < p stage 0 must wait, so ring steps start every max(m, p) slots, not every m."),
    (_timeline_variant(_right_period, offset=0, extra=0),
     "stage s gets a micro-batch one slot after stage s - 1 ran it: stage s runs micro-batch i in slot i + s "
     "(plus the step's start), and the grid has m + p - 1 slots per gpipe step."),
    (_timeline_variant(_right_period, extra=1),
     "the grid ends when the last micro-batch leaves the last stage: (steps - 1) * period + m + p - 1 slots, "
     "with no idle column after it."),
    (_timeline_variant(_right_period, order="reverse"),
     "micro-batches go through in order 0, 1, ..., m - 1 on every stage."),
]


def _grid_shape(g: object) -> str:
    if isinstance(g, list) and all(isinstance(r, list) for r in g):
        return f"{len(g)} rows of {sorted({len(r) for r in g})} slots"
    return type(g).__name__


def _check_timeline(fn: Callable, cases: list[tuple], what: str) -> None:
    got = []
    for case in cases:
        g = fn(*case)
        ok = isinstance(g, (list, tuple)) and all(isinstance(row, (list, tuple)) for row in g) and all(
            v is None or (isinstance(v, int) and not isinstance(v, bool)) for row in g for v in row)
        if not ok:
            raise MismatchError(f"{what}: pipeline_timeline{case}", "a list of p lists, each holding an int "
                                "(the micro-batch) or None (idle) per slot", short_repr(g, 100),
                                "return one row per stage; put None where the stage waits.")
        got.append([list(row) for row in g])
    for g, case in zip(got, cases):
        expected = reference_pipeline_timeline(*case)
        if g == expected:
            continue
        hint = diagnose(got, cases, _PIPE_SUSPECTS, _PIPE_HOW)
        if len(g) != len(expected) or any(len(r) != len(expected[0]) for r in g):
            raise MismatchError(f"{what}: pipeline_timeline{case}", f"{len(expected)} rows of {len(expected[0])} "
                                "slots", _grid_shape(g), hint)
        s, slot = next((s, j) for s in range(len(g)) for j in range(len(g[s])) if g[s][j] != expected[s][j])
        raise MismatchError(f"{what}: pipeline_timeline{case}, stage {s}, slot {slot}",
                            f"{expected[s][slot]!r} (row {s}: {short_repr(expected[s], 70)})",
                            f"{g[s][slot]!r} (row {s}: {short_repr(g[s], 70)})", hint)


def _bubble(grid: list[list[int | None]]) -> float:
    cells = [v for row in grid for v in row]
    return sum(v is None for v in cells) / len(cells)


@pipeline_task.test("gpipe, p = 2, m = 2, one step: [[0, 1, None], [None, 0, 1]], a bubble of 1/3")
def _(fn: Callable) -> None:
    _check_timeline(fn, [(2, 2, 1, "gpipe"), (2, 2)], "the example")


@pipeline_task.test("gpipe over several steps: a fill and a drain every step, and the idle share is "
                    "bubble_formula(p, m) = (p - 1) / (m + p - 1) for every p <= 4, m <= 8")
def _(fn: Callable) -> None:
    from minillm.parallel.pipeline import bubble_formula

    cases = [(p, m, steps, "gpipe") for p in (1, 2, 3, 4) for m in (1, 2, 3, 5, 8) for steps in (1, 3)]
    for case in cases:  # the grader's own check
        if not math.isclose(_bubble(reference_pipeline_timeline(*case)), bubble_formula(case[0], case[1])):
            raise RuntimeError(f"the reference disagrees with bubble_formula at {case}")
    _check_timeline(fn, cases, "gpipe")


@pipeline_task.test("ring, m >= p: micro-batches circulate without a drain (p = 2, m = 2, 3 steps: "
                    "[[0, 1, 0, 1, 0, 1, None], [None, 0, 1, 0, 1, 0, 1]])")
def _(fn: Callable) -> None:
    _check_timeline(fn, [(2, 2, 3, "ring"), (2, 4, 2, "ring"), (3, 3, 4, "ring"), (3, 7, 3, "ring")], "ring")


@pipeline_task.test("ring, m < p: stage 0 waits for a micro-batch to come back; the idle share is "
                    "ring_bubble_formula(p, m, steps) for every p <= 4, m <= 8, steps <= 5")
def _(fn: Callable) -> None:
    from minillm.parallel.pipeline import ring_bubble_formula

    cases = [(p, m, steps, "ring") for p in (1, 2, 3, 4) for m in (1, 2, 3, 5, 8) for steps in (1, 2, 5)]
    for case in cases:  # the grader's own check
        if not math.isclose(_bubble(reference_pipeline_timeline(*case)), ring_bubble_formula(*case[:3])):
            raise RuntimeError(f"the reference disagrees with ring_bubble_formula at {case}")
    _check_timeline(fn, [c for c in cases if c[1] < c[0]] + cases, "ring")


# ---- 08.can_take -------------------------------------------------------------------------------------


def reference_can_take(prompt_tokens: int, free_blocks: int, block_size: int, num_running: int, max_num_seqs: int,
                       watermark_blocks: int = 0) -> bool:
    """Whether a decode worker can take a prefilled request now (`LLMEngine.reserve_prefilled`'s rule).

    It needs a row (fewer than max_num_seqs sequences running or reserved) and blocks for the prompt's whole KV
    cache, which arrives at once, ceil(prompt_tokens / block_size), while leaving the watermark free for the
    running sequences' next tokens. Otherwise the offer waits: back-pressure.
    """
    if num_running >= max_num_seqs:
        return False
    return cdiv(prompt_tokens, block_size) + watermark_blocks <= free_blocks


can_take_task = register_task(
    "08.can_take",
    "can_take(prompt_tokens: int, free_blocks: int, block_size: int, num_running: int, max_num_seqs: int, "
    "watermark_blocks: int = 0) -> bool",
    reference=reference_can_take,
    forbid=("minillm.engine.llm_engine.LLMEngine", "minillm.engine.scheduler.Scheduler",
            "minillm.arithmetic.kv_blocks"),
)

_TAKE_HOW = ("take it only if num_running < max_num_seqs and ceil(prompt_tokens / block_size) + watermark_blocks <= "
             "free_blocks.")


def _take_variant(seats: str = "right", rounding: str = "ceil", watermark: bool = True, compare: str = "<=",
                  extra_token: bool = False) -> Callable[..., bool]:
    def can_take(tokens: int, free: int, bs: int, running: int, max_seqs: int, wm: int = 0) -> bool:
        if seats == "right" and running >= max_seqs or seats == "off_by_one" and running > max_seqs:
            return False
        n = tokens + (1 if extra_token else 0)
        needed = cdiv(n, bs) if rounding == "ceil" else n // bs
        total = needed + (wm if watermark else 0)
        return total <= free if compare == "<=" else total < free
    return can_take


_TAKE_SUSPECTS: list[tuple[Callable, str]] = [
    (_take_variant(seats="off_by_one"),
     "max_num_seqs is the number of rows: with num_running == max_num_seqs every row is taken (num_running < "
     "max_num_seqs to take one more)."),
    (_take_variant(seats="ignored"),
     "a full decode worker takes nothing: with num_running >= max_num_seqs (running or reserved) the offer waits, "
     "however few blocks it needs."),
    (_take_variant(rounding="floor"),
     "round the blocks UP: 17 tokens in blocks of 16 need 2 blocks, ceil(n / block_size) = -(-n // block_size)."),
    (_take_variant(watermark=False),
     "keep the watermark free: needed + watermark_blocks <= free_blocks. Those blocks are the running sequences' "
     "reserve for their next tokens; without it a transfer can force a preemption on the decode worker."),
    (_take_variant(compare="<"),
     "the blocks may use the pool down to the watermark exactly: needed + watermark_blocks <= free_blocks (<=, not "
     "<)."),
    (_take_variant(extra_token=True),
     "reserve the prompt's blocks only: its KV is prompt_tokens rows. The next token's slot comes at the next "
     "decode step, from the pool like every running sequence's (that is what the watermark protects)."),
]


def _check_take(fn: Callable, cases: list[tuple], what: str) -> None:
    got = []
    for case in cases:
        g = fn(*case)
        if not isinstance(g, bool):
            raise MismatchError(f"{what}: can_take{case}", "True or False", short_repr(g),
                                "return a bool: whether the decode worker takes the request now.")
        got.append(g)
    for g, case in zip(got, cases):
        expected = reference_can_take(*case)
        if g != expected:
            raise MismatchError(f"{what}: can_take{case}", f"{expected}", f"{g}",
                                diagnose(got, cases, _TAKE_SUSPECTS, _TAKE_HOW))


@can_take_task.test("the examples: a 1,000-token prompt needs 63 blocks of 16; with 65 free and a watermark of 2 "
                    "it is taken, with 64 free it waits")
def _(fn: Callable) -> None:
    _check_take(fn, [(1000, 65, 16, 10, 64, 2), (1000, 64, 16, 10, 64, 2), (1000, 63, 16, 10, 64),
                     (1000, 62, 16, 10, 64)], "the example")


@can_take_task.test("every row taken: num_running (running or reserved) = max_num_seqs refuses even a 1-token prompt")
def _(fn: Callable) -> None:
    _check_take(fn, [(1, 500, 16, 8, 8, 0), (16, 500, 16, 7, 8, 0), (1, 500, 16, 9, 8, 1), (1, 500, 16, 0, 1, 0),
                     (1, 500, 16, 1, 1, 0)], "max_num_seqs")


@can_take_task.test("boundaries: 16, 17 and 32 tokens in blocks of 16; a pool used down to the watermark exactly")
def _(fn: Callable) -> None:
    _check_take(fn, [(16, 1, 16, 0, 4), (17, 1, 16, 0, 4), (17, 2, 16, 0, 4), (32, 2, 16, 0, 4), (32, 4, 16, 0, 4, 2),
                     (33, 4, 16, 0, 4, 2), (5, 3, 4, 2, 4, 1), (8, 3, 4, 2, 4, 1), (9, 3, 4, 2, 4, 1)],
                "a boundary")


@functools.lru_cache(maxsize=4)
def _tiny_model() -> torch.nn.Module:
    from minillm.config import ModelConfig
    from minillm.model import Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=32,
                                   max_seq_len=8192)).eval()


def _engine_states(rng: random.Random, n: int) -> list[tuple[tuple, bool]]:
    """(case, what a live LLMEngine.reserve_prefilled answered) for n random decode-worker states."""
    from minillm.engine.llm_engine import LLMEngine

    states = []
    for k in range(n):
        block_size = rng.choice([4, 16])
        num_blocks, max_seqs = rng.choice([20, 60, 250, 400]), rng.choice([1, 2, 4, 8])
        engine = LLMEngine(_tiny_model(), None, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_seqs,
                           enable_prefix_caching=False)
        running = rng.randint(0, max_seqs)
        for j in range(running):  # occupy rows and blocks with requests whose KV is on its way
            blocks = rng.randint(0, max(0, (num_blocks - engine.scheduler.watermark_blocks) // (max_seqs + 1)))
            if engine.reserve_prefilled(f"held{j}", max(1, blocks * block_size)) is None:
                break
        free = engine.cache.allocator.num_free_blocks
        tokens = rng.choice([1, block_size, block_size + 1, max(1, free * block_size - rng.randint(0, block_size)),
                             free * block_size + 1, rng.randint(1, 3 * block_size)])
        case = (tokens, free, block_size, len(engine.reserved), max_seqs, engine.scheduler.watermark_blocks)
        states.append((case, engine.reserve_prefilled(f"offer{k}", tokens) is not None))
    return states


@can_take_task.test("agrees with a live LLMEngine.reserve_prefilled (the decode worker of minillm.parallel.disagg) "
                    "in 60 random states")
def _(fn: Callable) -> None:
    states = _engine_states(random.Random(880), 60)
    for case, took in states:  # the grader's own check
        if reference_can_take(*case) != took:
            raise RuntimeError(f"the reference disagrees with LLMEngine.reserve_prefilled on {case}")
    _check_take(fn, [case for case, _ in states], "an engine's state")


# ---- 08.mixed_lora -----------------------------------------------------------------------------------


def reference_mixed_lora(x: torch.Tensor, w: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                         scales: torch.Tensor, adapter_ids: torch.Tensor) -> torch.Tensor:
    """A batch whose rows use different LoRA adapters (unmerged serving, Punica's SGMV idea, in PyTorch).

    x [N, in]; w [out, in] (the base projection, nn.Linear's layout); lora_a [S, r, in] and lora_b [S, out, r] (S
    adapters stacked); scales [S] (alpha / r of each); adapter_ids [N] long, -1 for a row of the base model.
    Row n: x[n] @ w.T + scales[s] * (x[n] @ A_s.T) @ B_s.T with s = adapter_ids[n] (no update where s = -1).
    The base matmul runs once for the whole batch; each adapted row gathers its own A and B.
    """
    y = x @ w.T
    keep = adapter_ids >= 0
    ids = adapter_ids[keep]
    h = torch.bmm(lora_a[ids], x[keep].unsqueeze(-1))  # [n, r, 1]
    upd = torch.bmm(lora_b[ids], h).squeeze(-1) * torch.as_tensor(scales, dtype=x.dtype)[ids].unsqueeze(-1)
    y[keep] += upd.to(y.dtype)
    return y


mixed_lora_task = register_task(
    "08.mixed_lora",
    "mixed_lora(x: Tensor[N, in], w: Tensor[out, in], lora_a: Tensor[S, r, in], lora_b: Tensor[S, out, r], "
    "scales: Tensor[S], adapter_ids: Tensor[N] (long, -1: no adapter)) -> Tensor[N, out]",
    reference=reference_mixed_lora,
    forbid=("minillm.kernels.add_lora_reference", "minillm.kernels.add_lora_gathered", "minillm.kernels.add_lora",
            "minillm.lora.lora_matmul", "minillm.lora.slots.lora_matmul"),
)

_LORA_HOW = ("row n is x[n] @ w.T, plus, when s = adapter_ids[n] >= 0, scales[s] * (x[n] @ lora_a[s].T) @ lora_b[s].T: "
             "select the rows with an adapter (adapter_ids >= 0), gather their A and B (lora_a[ids], lora_b[ids]), and "
             "torch.bmm the shrink (to rank r) then the expand.")


def _lora_one_row(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                  ids: torch.Tensor, n: int) -> torch.Tensor:
    """Row n computed alone (the contract)."""
    y = x[n] @ w.T
    s = int(ids[n])
    return y if s < 0 else y + scales[s] * (b[s] @ (a[s] @ x[n]))


def _lora_variant(negative_is_last: bool = False, no_scale: bool = False, first_adapter: bool = False) -> Callable:
    def wrong(x, w, a, b, scales, ids):  # noqa: ANN001, ANN202
        out = x @ w.T
        for n in range(x.shape[0]):
            s = int(ids[n])
            if s < 0 and not negative_is_last:
                continue
            s = 0 if first_adapter else s
            upd = b[s] @ (a[s] @ x[n])
            out[n] = out[n] + (upd if no_scale else scales[s] * upd)
        return out
    return wrong


_LORA_SUSPECTS = [
    (_lora_variant(negative_is_last=True),
     "the base rows (adapter_ids = -1) got an update: in PyTorch, lora_a[-1] is the LAST adapter, not 'none'. Select "
     "the rows with adapter_ids >= 0 first, and leave the others at x @ w.T."),
    (_lora_variant(no_scale=True),
     "the update is missing its scale: multiply each row's (x A^T) B^T by scales[s] of its own adapter (alpha / r)."),
    (_lora_variant(first_adapter=True),
     "every adapted row used adapter 0: gather each row's own matrices, lora_a[adapter_ids] and lora_b[adapter_ids]."),
]


def _lora_case(gen: torch.Generator, n: int, d_in: int, d_out: int, S: int, r: int, ids: list[int],
               dtype: torch.dtype = torch.float64) -> tuple:
    x = torch.randn(n, d_in, generator=gen, dtype=torch.float64)
    w = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64) / d_in ** 0.5
    a = torch.randn(S, r, d_in, generator=gen, dtype=torch.float64) / d_in ** 0.5
    b = torch.randn(S, d_out, r, generator=gen, dtype=torch.float64)
    scales = torch.rand(S, generator=gen, dtype=torch.float64) * 3 + 0.5
    return (*(t.to(dtype) for t in (x, w, a, b, scales)), torch.tensor(ids, dtype=torch.long))


def _same_lora(a: object, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=1e-5,
                                                                                  rtol=1e-5)


def _check_lora(fn: Callable, cases: list[tuple], what: str, atol: float = 1e-8) -> None:
    got = []
    for x, w, a, b, scales, ids in cases:
        g = call_catching(fn, (x.clone(), w.clone(), a.clone(), b.clone(), scales.clone(), ids.clone()), "RuntimeError",
                          f"{what}: mixed_lora(x {tuple(x.shape)}, w {tuple(w.shape)}, lora_a {tuple(a.shape)}, "
                          f"lora_b {tuple(b.shape)}, scales {tuple(scales.shape)}, adapter_ids {ids.tolist()})",
                          f"a tensor of shape ({x.shape[0]}, {w.shape[0]})",
                          "mind the shapes: lora_a[s] is [r, in] and lora_b[s] is [out, r], so a row's update is "
                          "lora_b[s] @ (lora_a[s] @ x[n]); gathered over rows, torch.bmm(lora_a[ids], "
                          "x_rows.unsqueeze(-1)) is [n, r, 1].")
        if not isinstance(g, torch.Tensor):
            raise MismatchError(what, f"a torch.Tensor of shape ({x.shape[0]}, {w.shape[0]})", type(g).__name__,
                                "return the batch's outputs as one tensor [N, out].")
        got.append(g)
    for g, (x, w, a, b, scales, ids) in zip(got, cases):
        expected = reference_mixed_lora(x, w, a, b, scales, ids)
        for n in range(x.shape[0]):  # the grader's own check: the reference is each row computed alone
            if not torch.allclose(_lora_one_row(x, w, a, b, scales, ids, n), expected[n], atol=1e-4, rtol=1e-4):
                raise RuntimeError("the reference disagrees with the row computed alone")
        if _same_lora(g, expected) and g.dtype == x.dtype:
            continue
        hint = diagnose(got, cases, _LORA_SUSPECTS, _LORA_HOW, _same_lora)
        bad = next((n for n in range(x.shape[0]) if g.shape != expected.shape or not _same_lora(g[n], expected[n])), 0)
        if g.shape == expected.shape:
            kind = "the base model" if int(ids[bad]) < 0 else f"adapter {int(ids[bad])}"
            expect_close(g[bad], expected[bad], f"{what}: row {bad} (under {kind}; adapter_ids {ids.tolist()})",
                         hint, atol=atol, rtol=atol)
        expect_close(g, expected, f"{what}: mixed_lora(..., adapter_ids={ids.tolist()})", hint, atol=atol, rtol=atol)


@mixed_lora_task.test("the example: 5 rows, adapters [0, -1, 1, 0, -1] (two base rows), in 8, out 6, rank 2; each row "
                      "equals the row computed alone")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(881)
    _check_lora(fn, [_lora_case(gen, 5, 8, 6, 2, 2, [0, -1, 1, 0, -1])], "the example")


@mixed_lora_task.test("all rows base (no update at all), all one adapter, one row, 8 adapters over 20 rows, rank 1")
def _(fn: Callable) -> None:
    gen = torch.Generator().manual_seed(882)
    ids20 = [int(i) for i in torch.randint(-1, 8, (20,), generator=gen)]
    cases = [_lora_case(gen, 4, 6, 5, 3, 2, [-1, -1, -1, -1]), _lora_case(gen, 4, 6, 5, 3, 2, [2, 2, 2, 2]),
             _lora_case(gen, 1, 7, 3, 2, 4, [1]), _lora_case(gen, 20, 12, 10, 8, 3, ids20),
             _lora_case(gen, 6, 5, 9, 4, 1, [3, -1, 0, 3, 2, 1])]
    _check_lora(fn, cases, "a random batch")


@mixed_lora_task.test("float32 in, float32 out: the shipped Menenius adapter on layer 0's q_proj of the shipped model, "
                      "beside the base rows, equals the merged weight W + s B A on its rows")
def _(fn: Callable) -> None:
    from pathlib import Path

    import minillm
    from minillm.lora import load_adapter
    from minillm.train.lora_finetune import SHIPPED

    model, _ = minillm.load(minillm.DEFAULT_MODEL, dtype=torch.float32)
    adapter = load_adapter(Path(minillm.__file__).parent / "models" / SHIPPED, model.config)
    q = model.config.n_heads * model.config.head_dim
    w = model.layers[0].self_attn.qkv_proj.weight.detach()[:q]
    a, b = adapter.weights[0, "q_proj"]
    gen = torch.Generator().manual_seed(883)
    x = torch.randn(6, w.shape[1], generator=gen)
    ids = torch.tensor([0, -1, 0, 0, -1, 0])
    scales = torch.tensor([adapter.scale])
    _check_lora(fn, [(x, w, a[None], b[None], scales, ids)], "the shipped adapter", atol=1e-4)
    got = fn(x, w, a[None], b[None], scales, ids)
    merged = x @ (w + adapter.delta(0, "q_proj")).T
    expect_close(got[ids >= 0], merged[ids >= 0], "the adapted rows against the merged weight W + s B A",
                 "unmerged and merged serving must agree: " + _LORA_HOW, atol=1e-4, rtol=1e-4)
