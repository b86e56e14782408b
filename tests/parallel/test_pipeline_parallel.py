"""Pipeline parallelism (chapter 08): `minillm.parallel.pipeline` on the shipped model, on the CPU.

Tasks:
  1. split_layers: contiguous, as even as possible, earlier stages one layer more; impossible splits refused.
  2. bubble_formula and ring_bubble_formula: the idle fractions of the two schedules.
  3. In one process: stages chained by hand give the model's logits; a single stage its greedy tokens.
  4. run_pipeline, one process per stage over gloo: the single-process greedy tokens exactly, for 1, 2 and 4
     micro-batches, both schedules, prompts of different lengths, 2 and 3 stages; the stats it returns are sane.
  5. Bad requests raise ValueError saying what to change; a worker's failure is raised in the caller,
     naming its stage.

Timing is never asserted: the bubble measured against the formulas is benchmarks/pipeline_bubble.py's job.
"""

from __future__ import annotations

import json

import pytest
import torch

import minillm
from minillm.contiguous_cache import KVCache
from minillm.parallel.pipeline import (
    PipelineStage,
    StageCache,
    bubble_formula,
    pipeline_generate,
    ring_bubble_formula,
    run_pipeline,
    split_layers,
)

TEXTS = ["ROMEO.\nBut soft, what light", "JULIET.\nO Romeo, Romeo, wherefore", "HAMLET.\nTo be, or not",
         "KING LEAR.\nNothing will come"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return minillm.load(minillm.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def model(model_and_tokenizer):
    return model_and_tokenizer[0]


@pytest.fixture(scope="module")
def ragged_prompts(model_and_tokenizer):
    """Four prompts of different lengths."""
    prompts = [model_and_tokenizer[1].encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) > 1, "the ragged prompts should differ in length"
    return prompts


@pytest.fixture(scope="module")
def equal_prompts(ragged_prompts):
    """The same four prompts cut to one length (so that no micro-batch needs padding)."""
    n = min(len(p) for p in ragged_prompts)
    return [p[:n] for p in ragged_prompts]


def greedy_alone(model: minillm.Transformer, prompt: list[int], n: int) -> list[int]:
    """The reference: one prompt alone, the whole model's forward on a contiguous KV cache, greedy."""
    cache = KVCache(model.config, 1, len(prompt) + n, dtype=model.dtype)
    x, out = torch.tensor([prompt]), []
    with torch.inference_mode():
        for _ in range(n):
            token = model(x, cache=cache, last_only=True)[:, -1].argmax(-1)  # [1]
            out.append(int(token))
            x = token[:, None]
    return out


@pytest.fixture(scope="module")
def references(model, equal_prompts, ragged_prompts):
    return {"equal": [greedy_alone(model, p, NEW_TOKENS) for p in equal_prompts],
            "ragged": [greedy_alone(model, p, NEW_TOKENS) for p in ragged_prompts]}


# ------------------------------------------------------------------ 1. split_layers
@pytest.mark.parametrize("n_layers, stages, sizes", [
    (6, 1, [6]), (6, 2, [3, 3]), (6, 4, [2, 2, 1, 1]), (7, 3, [3, 2, 2]), (5, 5, [1, 1, 1, 1, 1]),
    (32, 3, [11, 11, 10]),
])
def test_task_1_split_layers_is_contiguous_and_as_even_as_possible(n_layers, stages, sizes):
    ranges = split_layers(n_layers, stages)
    assert [len(r) for r in ranges] == sizes, (
        f"{n_layers} layers over {stages} stages should give sizes {sizes} (earlier stages take the extra "
        f"layers), got {[len(r) for r in ranges]}")
    assert [i for r in ranges for i in r] == list(range(n_layers)), "every layer once, in order"


@pytest.mark.parametrize("n_layers, stages, match", [(6, 7, "at most 6 stages"), (6, 0, "at least 1")])
def test_task_1_split_layers_refuses_impossible_splits(n_layers, stages, match):
    with pytest.raises(ValueError, match=match):
        split_layers(n_layers, stages)


# ------------------------------------------------------------------ 2. the formulas
@pytest.mark.parametrize("p, m, expected", [(1, 1, 0.0), (2, 1, 0.5), (2, 2, 1 / 3), (2, 8, 1 / 9), (4, 4, 3 / 7)])
def test_task_2_bubble_formula(p, m, expected):
    assert bubble_formula(p, m) == pytest.approx(expected), f"(p - 1) / (m + p - 1) for p={p}, m={m} is {expected}"


def test_task_2_ring_bubble_formula():
    """One step is one fill and drain (the GPipe formula); many steps with m >= p leave almost no bubble, and
    m < p leaves 1 - m/p of each stage idle however many steps."""
    assert ring_bubble_formula(2, 2, 1) == pytest.approx(bubble_formula(2, 2))
    assert ring_bubble_formula(4, 8, 1) == pytest.approx(bubble_formula(4, 8))
    assert ring_bubble_formula(2, 4, 100) == pytest.approx(1 / 401)
    assert ring_bubble_formula(4, 1, 10_000) == pytest.approx(0.75, abs=1e-3)
    with pytest.raises(ValueError, match="at least 1"):
        ring_bubble_formula(2, 0, 5)


# ------------------------------------------------------------------ 3. stages in one process
def test_task_3_stages_chained_by_hand_give_the_models_logits(model, ragged_prompts):
    """Three stages of two layers, each with its own cache of two layers, relayed by hand: the model's logits,
    for a padded micro-batch too (prefill, then two decode steps)."""
    stages = [PipelineStage(model, s, 3) for s in range(3)]
    assert [list(s.layer_range) for s in stages] == [[0, 1], [2, 3], [4, 5]]
    assert stages[0].embed_tokens is not None and stages[1].embed_tokens is None and stages[1].lm_head is None
    prompts = ragged_prompts[:2]
    length = max(map(len, prompts))
    pads = [length - len(p) for p in prompts]
    ids = torch.tensor([[0] * pad + p for pad, p in zip(pads, prompts)])
    caches = [StageCache(model.config, s.layer_range, pads, length + 2) for s in stages]
    alone = [KVCache(model.config, 1, length + 2) for _ in prompts]
    with torch.inference_mode():
        tokens = [torch.tensor([p]) for p in prompts]
        for step in range(3):
            x = ids
            for stage, cache in zip(stages, caches):
                x = stage(x, cache)
            expected = torch.cat([model(t, cache=c, last_only=True)[:, -1] for t, c in zip(tokens, alone)])
            torch.testing.assert_close(x, expected, rtol=1e-4, atol=1e-4,
                                       msg=f"step {step}: the chained stages must give the model's logits")
            ids = x.argmax(-1)[:, None]
            tokens = list(ids[:, None])


@pytest.mark.parametrize("microbatches", [1, 3])
def test_task_3_a_single_stage_generates_the_greedy_tokens(model, ragged_prompts, references, microbatches):
    out = pipeline_generate(PipelineStage(model, 0, 1), ragged_prompts[:3], NEW_TOKENS, microbatches)
    assert out.token_ids == references["ragged"][:3], (
        f"one stage holding every layer must generate what the model does alone, with m={microbatches}")
    assert out.stats.stages[0].busy_s > 0 and len(out.stats.stages) == 1


# ------------------------------------------------------------------ 4. one process per stage
def check_stats(stats, stages: int, microbatches: int, schedule: str) -> None:
    assert len(stats.stages) == stages and [s.stage for s in stats.stages] == list(range(stages))
    assert [list(range(*s.layers)) for s in stats.stages] == [list(r) for r in split_layers(6, stages)]
    for s in stats.stages:
        assert s.busy_s > 0 and s.idle_s >= 0, f"stage {s.stage}: busy {s.busy_s} s, idle {s.idle_s} s"
        assert 0 <= s.bubble_fraction <= 1
    assert 0 <= stats.bubble_fraction <= 1
    assert (stats.microbatches, stats.schedule, stats.steps) == (microbatches, schedule, NEW_TOKENS)
    formula = bubble_formula(stages, microbatches) if schedule == "gpipe" else ring_bubble_formula(
        stages, microbatches, NEW_TOKENS)
    assert stats.predicted_bubble == pytest.approx(formula)
    assert 0 <= stats.first_token_s <= stats.total_s and stats.decode_tokens_per_s > 0


@pytest.mark.parametrize("stages, microbatches, schedule, prompts", [
    (2, 1, "ring", "equal"), (2, 2, "ring", "equal"), (2, 4, "gpipe", "equal"), (3, 2, "ring", "ragged"),
])
def test_task_4_processes_generate_the_single_process_tokens(stages, microbatches, schedule, prompts, references,
                                                              equal_prompts, ragged_prompts):
    inputs = equal_prompts if prompts == "equal" else ragged_prompts
    out = run_pipeline(minillm.DEFAULT_MODEL, inputs, NEW_TOKENS, stages=stages, microbatches=microbatches,
                       schedule=schedule)
    assert out.token_ids == references[prompts], (
        f"{stages} stages, {microbatches} micro-batches ({schedule}, {prompts} prompts) must generate exactly the "
        f"greedy tokens of each prompt alone: got {out.token_ids}, expected {references[prompts]}")
    check_stats(out.stats, stages, microbatches, schedule)


# ------------------------------------------------------------------ 5. errors
@pytest.mark.parametrize("kwargs, match", [
    (dict(stages=7), "at most 6 stages"),
    (dict(microbatches=0), "between 1 and the number of prompts"),
    (dict(microbatches=5), "between 1 and the number of prompts"),
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(max_tokens=2000), "context"),
    (dict(schedule="1f1b"), "unknown schedule"),
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[1, 2], []]), "at least one token id"),
    (dict(prompts=[[1, 99999]]), "outside the vocabulary"),
])
def test_task_5_bad_requests_raise_before_any_process_starts(equal_prompts, kwargs, match):
    args = dict(prompts=equal_prompts, max_tokens=4, stages=2, microbatches=2) | kwargs
    with pytest.raises(ValueError, match=match):
        run_pipeline(minillm.DEFAULT_MODEL, **args)


def test_task_5_a_stage_of_a_different_size_than_the_group_is_refused(model, equal_prompts):
    with pytest.raises(ValueError, match="torch.distributed"):
        pipeline_generate(PipelineStage(model, 0, 2), equal_prompts, 4)


def test_task_5_a_failing_worker_is_raised_naming_its_stage(tmp_path, equal_prompts):
    """A folder whose config.json is fine but whose weights are missing: the check before the spawn passes,
    every worker fails to load, and the caller gets a RuntimeError naming a stage and the cause, not a hang."""
    from minillm.checkpoints import find_model_folder

    config = json.loads((find_model_folder(minillm.DEFAULT_MODEL) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match=r"pipeline stage \d \(rank \d\) failed: .*safetensors"):
        run_pipeline(tmp_path, equal_prompts, 4, stages=2, microbatches=2, timeout_s=60)
