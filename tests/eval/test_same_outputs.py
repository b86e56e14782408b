"""`minillm.eval.same_outputs`: tokens and text compared exactly, log-probabilities within a stated tolerance."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from minillm.eval.same_outputs import LOGPROB_ATOL, assert_same_outputs, output_differences


@dataclass
class Out:
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    cumulative_logprob: float


BASE = Out([5, 9, 2], "abc", "length", [-0.5, -1.25, -2.0], [{5: -0.5, 7: -1.0}, {9: -1.25}, {2: -2.0}], -3.75)


def test_last_bit_noise_is_not_a_difference():
    noisy = replace(BASE, logprobs=[x + 5e-7 for x in BASE.logprobs],
                    top_logprobs=[{k: v - 5e-7 for k, v in t.items()} for t in BASE.top_logprobs],
                    cumulative_logprob=BASE.cumulative_logprob + 1.5e-6)
    assert output_differences(BASE, noisy) == []
    assert_same_outputs([BASE], [noisy])


@pytest.mark.parametrize("change, field", [
    (dict(token_ids=[5, 9, 3]), "token_ids"),
    (dict(text="abd"), "text"),
    (dict(finish_reason="stop"), "finish_reason"),
    (dict(logprobs=[-0.5, -1.25 + 10 * LOGPROB_ATOL, -2.0]), "logprobs[1]"),
    (dict(logprobs=None), "logprobs"),
    (dict(top_logprobs=[{5: -0.5, 8: -1.0}, {9: -1.25}, {2: -2.0}]), "top_logprobs[0]: ids"),
    (dict(top_logprobs=[{5: -0.5, 7: -1.01}, {9: -1.25}, {2: -2.0}]), "top_logprobs[0]"),
    (dict(cumulative_logprob=-3.8), "cumulative_logprob"),
])
def test_a_real_difference_is_named(change, field):
    found = output_differences(BASE, replace(BASE, **change))
    assert found and found[0].startswith(field), found
    with pytest.raises(AssertionError, match=r"output 0: " + field.split("[")[0]):
        assert_same_outputs([BASE], [replace(BASE, **change)])


def test_a_missing_output_is_a_difference():
    with pytest.raises(AssertionError, match="2 outputs in the first run, 1 in the second"):
        assert_same_outputs([BASE, BASE], [BASE])


def test_greedy_runs_may_part_only_where_the_reference_ties():
    """A bf16 tie broken the other way by another kernel is not a bug; any other difference of tokens is."""
    from types import SimpleNamespace

    from minillm.eval.same_outputs import tie_breaks_apart

    ref = SimpleNamespace(token_ids=[1, 2, 3], top_logprobs=[{1: -0.1, 9: -3.0}, {2: -2.14, 7: -2.14},
                                                             {3: -0.2, 4: -4.0}])
    assert tie_breaks_apart(ref, SimpleNamespace(token_ids=[1, 2, 3]), 0.1) is None
    assert tie_breaks_apart(ref, SimpleNamespace(token_ids=[1, 7, 5]), 0.1) is None  # parted at the tie
    assert "token 0" in tie_breaks_apart(ref, SimpleNamespace(token_ids=[9, 2, 3]), 0.1)  # 2.9 nats apart
    assert "token 1" in tie_breaks_apart(ref, SimpleNamespace(token_ids=[1, 8, 3]), 0.1)  # not a candidate
    assert "stops" in tie_breaks_apart(ref, SimpleNamespace(token_ids=[1, 2]), 0.1)
