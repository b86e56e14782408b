"""Measuring quality, and gating changes on it (chapters 03, 07 and 09).

    perplexity       exp(mean next-token cross-entropy) over the validation split; a chi-squared test of a sampler
    tasks            log-likelihood multiple choice and exact match over small local task files (lm-eval's conventions)
    agreement        top-1 agreement and KL divergence of a model's next-token distributions against a reference's
    gate             a candidate's results against a baseline's, metric by metric, with tolerances: `minillm eval`
    cached           the same metrics through the engine's (quantised) KV cache; a model with key outliers; the
                     engine's greedy generations against a reference's (what lossy speculative acceptance changes)
    same_outputs     two runs of the same requests: tokens and text exactly, log-probabilities within LOGPROB_ATOL
    make_tasks       builds the book's task files from the validation split of the shipped corpus
"""

from minillm.eval.agreement import agreement
from minillm.eval.cached import (
    ThroughKVCache,
    cached_agreement,
    cached_logits,
    cached_perplexity,
    greedy_agreement,
    greedy_tokens,
    with_key_outliers,
)
from minillm.eval.gate import TOLERANCES, Row, compare, format_table
from minillm.eval.perplexity import chi_squared_test, perplexity
from minillm.eval.same_outputs import LOGPROB_ATOL, assert_same_outputs, output_differences
from minillm.eval.tasks import Task, exact_match, json_success, load_task, loglikelihood, multiple_choice

__all__ = [
    "LOGPROB_ATOL", "TOLERANCES", "Row", "Task", "ThroughKVCache", "agreement", "assert_same_outputs",
    "cached_agreement", "cached_logits", "cached_perplexity", "chi_squared_test", "compare", "exact_match",
    "format_table", "greedy_agreement", "greedy_tokens", "json_success", "load_task", "loglikelihood",
    "multiple_choice", "output_differences", "perplexity", "with_key_outliers",
]
