"""A row of NaN logits fails only its own request (issue 55).

A sequence whose logits come out NaN (here a LoRA adapter poisoned in memory after registration checked it, as a
bug or a bit flip could) used to fail the step's shared draw (torch.multinomial refuses NaN probabilities), and so
every request in the step; a greedy one took the argmax of NaN as its token. Now its row finishes with
finish_reason "error" and no token, and the other rows are sampled as if it were not there.
"""

from __future__ import annotations

import pytest
import torch

import minillm
from minillm.engine import LLMEngine
from minillm.lora import LoRAAdapter, target_rows
from minillm.sampler.sampling import SamplingParams

MODEL = "shakespeare-1m"


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return minillm.load(MODEL)


def poisoned_engine(model_and_tokenizer, **kwargs) -> LLMEngine:
    """An engine serving the rank-2 LoRA adapter "poison" on q_proj, whose layer-0 B is made NaN after registration:
    its rows' logits are NaN, the base model's are not."""
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(0)
    rows = target_rows(model.config)["q_proj"]
    weights = {(layer, "q_proj"): (0.01 * torch.randn(2, rows[3]), 0.01 * torch.randn(rows[2], 2))
               for layer in range(model.config.n_layers)}
    engine = LLMEngine(model, tokenizer, lora_modules={"poison": LoRAAdapter(2, 4.0, weights)}, **kwargs)
    engine.lora_slots.adapters["poison"].weights[0, "q_proj"][1].fill_(float("nan"))
    return engine


@pytest.mark.parametrize("poisoned", [SamplingParams(temperature=1.0, max_tokens=12),  # the batch's shared draw
                                      SamplingParams(temperature=0.0, max_tokens=12)])
@pytest.mark.parametrize("async_scheduling", [False, True])  # True: the row's token is read a step later
def test_a_row_of_nan_logits_finishes_its_request_with_an_error_and_no_other(model_and_tokenizer, poisoned,
                                                                             async_scheduling):
    """A sampled row of NaN logits made torch.multinomial fail the step's draw, so every request in the step failed;
    a greedy one took the argmax of NaN as its token. Now the row finishes "error", without a token, and its
    batchmate's tokens are those it gets alone."""
    healthy = SamplingParams(temperature=0.8, seed=7, max_tokens=12)
    engine = poisoned_engine(model_and_tokenizer, max_num_seqs=4, async_scheduling=async_scheduling)
    engine.add_request("healthy", "ROMEO.\n", healthy)
    engine.add_request("poisoned", "JULIET.\n", poisoned, lora="poison")
    outputs = {request: out for (request, _), out in engine.run().items()}
    assert outputs["poisoned"].finish_reason == "error" and outputs["poisoned"].token_ids == [], outputs["poisoned"]
    alone = poisoned_engine(model_and_tokenizer, max_num_seqs=4)
    alone.add_request("healthy", "ROMEO.\n", healthy)
    assert outputs["healthy"].token_ids == alone.run()["healthy", 0].token_ids
    assert outputs["healthy"].finish_reason == "length"
    assert engine.cache.allocator.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_a_row_of_nan_logits_in_a_sampled_verify_step_fails_alone(model_and_tokenizer):
    """With speculation a sampled row runs the exact rule on its own probabilities, and a NaN row's draw raised and
    failed the whole step. LoRA adapters are not served with speculation, so the NaN is put into one row's verify
    logits directly (the runner's verify_logits wrapped), once the verify steps have begun."""
    from minillm.sampler.speculative import NgramDrafter, SpeculativeConfig

    model, tokenizer = model_and_tokenizer
    prompts = {"healthy": ("ROMEO.\nROMEO.\n", SamplingParams(temperature=0.8, seed=7, max_tokens=16)),
               "poisoned": ("JULIET.\nJULIET.\n", SamplingParams(temperature=1.0, seed=3, max_tokens=16))}

    def run(names: list[str]) -> dict:
        engine = LLMEngine(model, tokenizer, max_num_seqs=4,
                           speculative=SpeculativeConfig(NgramDrafter(), num_speculative_tokens=2))
        runner, steps = engine.model_runner, [0]
        real = runner.verify_logits
        poisoned_ids = set()

        def verify_logits(seq_ids, rows):
            logits = real(seq_ids, rows)
            steps[0] += 1
            if steps[0] >= 2:  # the poisoned request's row from its second verify step on
                logits = [x.clone().fill_(float("nan")) if i in poisoned_ids else x for i, x in zip(seq_ids, logits)]
            return logits

        runner.verify_logits = verify_logits
        for name in names:
            engine.add_request(name, *prompts[name])
        poisoned_ids.update(s.seq_id for s in engine.scheduler.waiting if s.request_id == "poisoned")
        outputs = {request: out for (request, _), out in engine.run().items()}
        assert engine.cache.allocator.num_used_blocks == 0 and steps[0] >= 2, steps
        return outputs

    both, alone = run(["healthy", "poisoned"]), run(["healthy"])
    assert both["poisoned"].finish_reason == "error", both["poisoned"]
    assert both["healthy"].finish_reason == "length" and both["healthy"].token_ids == alone["healthy"].token_ids
