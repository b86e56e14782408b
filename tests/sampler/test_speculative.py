"""minillm.sampler.speculative (chapter 07): speculative decoding must not change what the target generates.

At temperature 0 that is checked token for token against plain greedy decoding, through `generate` and
through the batched engine. At a temperature it is a statement about distributions, so it is checked by
a chi-squared test (`minillm.eval.chi_squared_test`, p > 0.01): on random small-vocabulary p and q, and
on the shipped target and draft end to end, where the exact distribution of the first tokens can be
enumerated. Each statistical test is run once more with a wrong rule (accept every draft) and must then
fail, so the test can tell a lossless rule from a lossy one. The rollback leaves the target's cache as a
fresh one computed from the accepted tokens.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import minillm
from minillm.arithmetic import cdiv
from minillm.decoding.llm import LLM
from minillm.engine.draft_model import DraftModelDrafter
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.model_runner import paged_forward
from minillm.eval import chi_squared_test
from minillm.sampler import speculative
from minillm.sampler.sampling import SamplingParams
from minillm.sampler.speculative import (
    Draft,
    NgramDrafter,
    SpeculativeConfig,
    SpeculativeStats,
    residual_distribution,
    verify,
    verify_greedy,
)

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


@pytest.fixture(scope="module")
def target():
    return minillm.load(minillm.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def draft():
    return minillm.load(minillm.DEFAULT_DRAFT)[0]


def accept_always(p, draft_tokens, q=None, generator=None):
    """A wrong rule: keep every draft, then the bonus token. Its output follows q, not p."""
    return list(draft_tokens) + [int(torch.multinomial(p[len(draft_tokens)], 1, generator=generator))]


# ---------------------------------------------------------------- the rule on small distributions
def _simulate(rule, P: torch.Tensor, Q: torch.Tensor,  # noqa: N803 - the target's and draft's tables
               k: int, trials: int, seed: int) -> torch.Tensor:
    """Counts [positions, V] of the tokens emitted at each position by repeated draft-verify steps, where the
    target's distribution at position t is P[t] and the draft's Q[t], whatever came before."""
    n, V = P.shape
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(n, V)
    for _ in range(trials):
        t = 0
        while t < n:
            d = min(k, n - 1 - t)
            drafts = [int(torch.multinomial(Q[t + i], 1, generator=g)) for i in range(d)]
            for token in rule(P[t: t + d + 1], drafts, Q[t: t + d], g):
                counts[t, token] += 1
                t += 1
    return counts


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_samples_follow_the_target_distribution(k):
    g = torch.Generator().manual_seed(k)
    V, n = 6, 4
    P = torch.rand(n, V, generator=g).pow(3).softmax(-1) ** 2
    P = P / P.sum(-1, keepdim=True)
    Q = torch.rand(n, V, generator=g).softmax(-1)
    Q[:, 0] = 0  # the draft never proposes token 0, which the target does: only the residual can emit it
    Q = Q / Q.sum(-1, keepdim=True)
    counts = _simulate(verify, P, Q, k, trials=3000, seed=k)
    for t in range(n):
        _, _, p_value = chi_squared_test(counts[t], P[t])
        assert p_value > 0.01, f"position {t}: speculative samples do not follow p (p-value {p_value:.2g})"
    wrong = _simulate(accept_always, P, Q, k, trials=3000, seed=k)
    worst = min(chi_squared_test(wrong[t], P[t])[2] for t in range(n - 1))
    assert worst < 1e-6, f"accepting every draft must fail the test, yet its lowest p-value is {worst:.2g}"


def test_residual_distribution_and_deterministic_drafts():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(residual_distribution(p, p), p)  # nothing is ever rejected; any answer is safe
    # A deterministic draft (q one-hot) is accepted with probability p(x); on rejection, x is never emitted.
    g = torch.Generator().manual_seed(0)
    P = p.expand(2, 3)
    outs = [tuple(verify(P, [1], None, g)) for _ in range(4000)]
    accepted = sum(o[0] == 1 and len(o) == 2 for o in outs) / len(outs)
    assert abs(accepted - 0.3) < 0.03
    assert all(o[0] != 1 for o in outs if len(o) == 1)


def test_verify_greedy_and_shapes():
    assert verify_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted, plus the bonus
    assert verify_greedy([5, 9, 7], [5, 6]) == [5, 9]  # the first mismatch is replaced by the target's token
    assert verify_greedy([4], []) == [4]
    with pytest.raises(ValueError, match="positions"):
        verify_greedy([1, 2], [1, 2])
    with pytest.raises(ValueError, match="one row per draft token plus one"):
        verify(torch.full((2, 4), 0.25), [1, 2])


def test_stats_per_position():
    s = SpeculativeStats()
    s.record(4, 4)
    s.record(4, 1)
    s.record(2, 0)
    assert s.proposed_at == [3, 3, 2, 2] and s.accepted_at == [2, 1, 1, 1] and s.reached_at == [3, 2, 1, 1]
    assert s.alpha_by_position == [2 / 3, 1 / 2, 1.0, 1.0]
    assert s.num_emitted == 5 + 2 + 1 and s.tokens_per_step == 8 / 3
    assert s.acceptance_rate == 5 / 10 and s.alpha == 5 / 7


# ---------------------------------------------------------------- drafters
def test_ngram_lookup():
    d = NgramDrafter(max_n=3, min_n=1)
    assert d.lookup([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # the trigram 1 2 3 was followed by 9 1 2
    assert d.lookup([1, 2, 3, 4, 7, 2, 3, 5, 2, 3], 2) == [5, 2]  # the latest earlier occurrence wins
    assert d.lookup([1, 2, 3, 4], 4) == []  # nothing repeats
    assert d.lookup([7, 7], 3) == [7]
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(max_n=1, min_n=2)


def test_draft_model_rolls_back_to_the_context(draft):
    ids = minillm.load(minillm.DEFAULT_DRAFT)[1].encode(PROMPT)
    greedy = [SamplingParams(temperature=0)]
    drafter = DraftModelDrafter(draft, num_blocks=32)
    first = drafter.propose(["s"], [ids], greedy, [5], [None])[0]
    assert len(first.tokens) == 5 and first.probs is None
    # The target took two drafts and then something else: the drafter must continue from that context,
    # exactly as a fresh drafter would.
    context = ids + first.tokens[:2] + [(first.tokens[2] + 1) % draft.config.vocab_size]
    again = drafter.propose(["s"], [context], greedy, [4], [None])[0]
    fresh = DraftModelDrafter(draft, num_blocks=32).propose(["s"], [context], greedy, [4], [None])[0]
    assert again.tokens == fresh.tokens
    assert drafter.cache.num_tokens("s") == len(context) + 3  # the context and 3 of its 4 drafts
    drafter.release("s")
    assert drafter.cache.allocator.num_free_blocks == 32


def test_sampled_drafts_carry_their_distribution(draft):
    drafter = DraftModelDrafter(draft, num_blocks=32)
    params = SamplingParams(temperature=0.7, top_k=20)
    out = drafter.propose(["a"], [[1, 2, 3]], [params], [3], [torch.Generator().manual_seed(0)])[0]
    assert out.probs.shape == (3, draft.config.vocab_size)
    assert torch.allclose(out.probs.sum(-1), torch.ones(3))
    assert all(out.probs[i, t] > 0 for i, t in enumerate(out.tokens))
    assert ((out.probs > 0).sum(-1) <= 20).all()  # the row's top-k applies to q


# ---------------------------------------------------------------- the engine, greedy: token for token
@pytest.mark.parametrize("make", [lambda d: DraftModelDrafter(d), lambda d: NgramDrafter()], ids=["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_greedy(target, draft, make, k):
    model, tok = target
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=1, repetition_penalty=1.1)
    plain = minillm.generate(model, PROMPT, params, tok)
    spec = minillm.generate(model, PROMPT, params, tok, speculative=SpeculativeConfig(make(draft), k))
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert torch.allclose(torch.tensor(spec.logprobs), torch.tensor(plain.logprobs), atol=1e-4)
    assert spec.speculative.num_steps > 0 and spec.speculative.tokens_per_step > 1
    assert len(spec.token_times_s) == len(spec.token_ids)


def test_batched_speculation_equals_plain_batch(target, draft):
    model, tok = target
    prompts = [PROMPT, "KING HENRY:\nOnce more unto the breach", "To be, or not to be", "JULIET:\n"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 7, 19, 2)]
    plain = LLM(model, tok).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, tok, speculative=SpeculativeConfig(DraftModelDrafter(draft), 3))
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [len(o.token_ids) for o in spec] == [30, 7, 19, 2]  # never past max_tokens
    engine = llm.engine
    assert engine.cache.allocator.num_free_blocks == engine.cache.allocator.num_blocks
    assert not engine.speculative.drafter.cache.block_tables  # the drafter let go of every sequence


def test_all_greedy_steps_are_judged_in_one_batch(target, draft, monkeypatch):
    """Rows that are all plain greedy are verified from one batched argmax (`ModelRunner._argmax`), not row by row
    through `SpeculativeConfig.accept`: the same tokens as plain greedy decoding, and the chosen tokens'
    log-probabilities within 1e-4 of plain decoding's. A step with one sampled row goes back to the per-row rule."""
    from minillm.engine.model_runner import ModelRunner

    model, tok = target
    prompts = [PROMPT, "KING HENRY:\nOnce more unto the breach", "To be, or not to be"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)  # the chosen tokens' only
    calls = {"batched": 0, "per_row": 0}
    real_argmax, real_accept = ModelRunner._argmax, SpeculativeConfig.accept

    def counted_argmax(logits):
        calls["batched"] += 1
        return real_argmax(logits)

    def counted_accept(self, *args, **kwargs):
        calls["per_row"] += 1
        return real_accept(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "_argmax", staticmethod(counted_argmax))
    monkeypatch.setattr(SpeculativeConfig, "accept", counted_accept)
    plain = LLM(model, tok).generate(prompts, params, use_tqdm=False)
    spec = LLM(model, tok, speculative=SpeculativeConfig(DraftModelDrafter(draft), 3)).generate(
        prompts, params, use_tqdm=False)
    assert calls == {"batched": calls["batched"], "per_row": 0} and calls["batched"] > 0
    for ours, theirs in zip(spec, plain):
        assert ours.token_ids == theirs.token_ids
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-4, rtol=0)
    calls.update(batched=0, per_row=0)
    mixed = [params, SamplingParams(temperature=0.8, max_tokens=24, seed=1), params]
    out = LLM(model, tok, speculative=SpeculativeConfig(DraftModelDrafter(draft), 3)).generate(
        prompts, mixed, use_tqdm=False)
    assert calls["per_row"] > 0 and out[0].token_ids == plain[0].token_ids and out[2].token_ids == plain[2].token_ids


def test_rollback_leaves_the_cache_as_a_fresh_one(target, draft):
    """Mid-generation, after verify steps that rejected drafts, every cached position holds what a fresh
    cache computed from the accepted tokens holds, and no block is held past them."""
    model, tok = target
    llm = LLM(model, tok, speculative=SpeculativeConfig(DraftModelDrafter(draft), 5), num_blocks=40)
    engine = llm.engine
    rid = engine.add_request(None, PROMPT, SamplingParams(temperature=0, max_tokens=60))
    for _ in range(6):
        engine.step()
    request = engine.scheduler.sequences[rid]
    assert engine.spec_stats.num_proposed > engine.spec_stats.num_accepted  # some drafts were rolled back
    n = request.num_computed_tokens
    table = engine.cache.block_tables[rid]
    assert table.token_ids == request.all_token_ids[:n]
    assert len(table.block_ids) == cdiv(n, engine.cache.block_size)
    fresh = PagedKVCache(model.config, 40, enable_prefix_caching=False)
    fresh.add_sequence("f")
    paged_forward(model, fresh, ["f"], [request.all_token_ids[:n]])
    for layer in range(model.config.n_layers):
        for ours, theirs in zip(engine.cache.gather(rid, layer), fresh.gather("f", layer)):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_truncate_frees_blocks_and_forgets_overwritten_prefix_blocks():
    config = minillm.ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=50)
    cache = PagedKVCache(config, num_blocks=8, block_size=4)
    cache.add_sequence("a")
    cache.prepare(["a"], [list(range(10))]).advance(10)  # blocks: 2 full (named), one with 2 tokens
    assert len(cache.allocator.cached_blocks) == 2
    cache.truncate("a", 6)  # the second full block is now half full: its name must go
    assert len(cache.block_tables["a"].block_ids) == 2 and cache.allocator.num_free_blocks == 6
    assert len(cache.allocator.cached_blocks) == 1
    assert cache.add_sequence("b", list(range(9))) == 4  # only the first block can be reused
    with pytest.raises(ValueError, match="cannot keep"):
        cache.truncate("a", 7)


def test_bad_configuration_is_refused(target, draft):
    model, tok = target
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(NgramDrafter(), 0)
    with pytest.raises(ValueError, match="use_cache"):
        minillm.generate(model, PROMPT, SamplingParams(max_tokens=4), tok, use_cache=False,
                         speculative=SpeculativeConfig(NgramDrafter(), 2))


class _TooMany:
    def propose(self, seq_ids, contexts, params, num_tokens, generators):
        return [Draft([1] * (k + 1)) for k in num_tokens]

    def release(self, seq_id):
        pass


def test_a_drafter_that_overshoots_is_caught(target):
    model, tok = target
    with pytest.raises(ValueError, match="proposed"):
        minillm.generate(model, PROMPT, SamplingParams(max_tokens=5), tok, speculative=SpeculativeConfig(_TooMany(), 2))


# ---------------------------------------------------------------- the shipped models, at a temperature
def _pair_distribution(model, ids: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """The exact distribution of the first two generated tokens under params (top-k keeps it enumerable)."""
    def probs(context):
        with torch.inference_mode():
            logits = model(torch.tensor([context]))[0, -1:]
        return speculative.target_probabilities(logits, params, ids, context[len(ids):], [])[0]

    first = probs(ids)
    out = {}
    for t1 in first.nonzero().flatten().tolist():
        second = probs(ids + [t1])
        for t2 in second.nonzero().flatten().tolist():
            out[t1, t2] = float(first[t1] * second[t2])
    return out


def _engine_pairs(model, tok, draft, ids, params, trials):
    llm = LLM(model, tok, max_num_seqs=64, speculative=SpeculativeConfig(DraftModelDrafter(draft), 1))
    runs = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(trials)]
    outs = llm.generate([ids] * trials, runs, use_tqdm=False)
    assert llm.engine.spec_stats.num_steps == trials  # the second token came from a verify step every time
    return [tuple(o.token_ids[:2]) for o in outs]


@pytest.mark.parametrize("wrong", [False, True], ids=["exact-rule", "accept-always"])
def test_shipped_models_speculative_distribution(target, draft, monkeypatch, wrong):
    """End to end through the engine: the first token is sampled after the prefill, the second by a verify
    step of the shipped draft against the shipped target. Their joint distribution, over top_k = 4, must be
    the target's own; with the accept-always rule the second token follows the draft and the test fails."""
    model, tok = target
    ids = tok.encode(PROMPT)
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    exact = _pair_distribution(model, ids, params)
    if wrong:
        monkeypatch.setattr("minillm.sampler.speculative.verify", accept_always)
    pairs = _engine_pairs(model, tok, draft, ids, params, trials=1200)
    support = sorted(exact)
    index = {pair: i for i, pair in enumerate(support)}
    counts = torch.zeros(len(support) + 1)
    for pair in pairs:
        counts[index.get(pair, len(support))] += 1
    probs = torch.tensor([exact[pair] for pair in support] + [0.0])
    _, _, p_value = chi_squared_test(counts, probs)
    if wrong:
        assert p_value < 1e-4, f"the accept-always rule passed the test (p-value {p_value:.2g}): it has no power"
    else:
        assert p_value > 0.01, f"speculative samples of the shipped models do not follow the target (p {p_value:.2g})"


def test_chi_squared_test_pools_small_bins_and_detects_impossible_draws():
    probs = torch.tensor([0.5, 0.3, 0.199, 0.001])
    stat, dof, p = chi_squared_test(torch.tensor([50.0, 30.0, 20.0, 0.0]), probs)
    assert dof == 2 and stat < 0.01 and p > 0.99  # the 0.001 bin (0.1 expected) is pooled with its neighbour
    assert chi_squared_test(torch.tensor([1.0, 0, 0, 0, 5]), torch.tensor([0.2, 0.2, 0.3, 0.3, 0.0]))[2] == 0.0
    assert chi_squared_test(torch.tensor([90.0, 10.0]), torch.tensor([0.5, 0.5]))[2] < 1e-10


def test_all_pairs_enumerated_sum_to_one(target):
    model, tok = target
    exact = _pair_distribution(model, tok.encode(PROMPT), SamplingParams(temperature=1.0, top_k=3))
    assert len(exact) == 9 and abs(sum(exact.values()) - 1) < 1e-5
    assert len(set(itertools.chain(*exact))) >= 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_speculative_on_cuda(dtype):
    """On the GPU the verify forward (k + 1 tokens a row) and the decode step take different kernels, and the draft
    (head_dim 32) drafts on its fast path, replayed graphs:
    in fp32 the greedy output must still be plain greedy's; in bf16 it must agree at least until the first
    near-tie, which we allow to differ only after the first 16 tokens."""
    model, tok = minillm.load(minillm.DEFAULT_MODEL, device="cuda", dtype=dtype)
    draft, _ = minillm.load(minillm.DEFAULT_DRAFT, device="cuda", dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = minillm.generate(model, PROMPT, params, tok)
    llm = LLM(model, tok, speculative=SpeculativeConfig(DraftModelDrafter(draft), 4))
    spec = llm.generate([PROMPT], params, use_tqdm=False)[0]
    if dtype == torch.float32:
        assert spec.token_ids == plain.token_ids
    else:
        assert spec.token_ids[:16] == plain.token_ids[:16]
    assert llm.engine.spec_stats.tokens_per_step > 1
    assert llm.engine.speculative.drafter.graphs is not None, "the greedy drafts took the draft's fast path"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("make", [lambda d: DraftModelDrafter(d), lambda d: NgramDrafter()], ids=["draft", "ngram"])
def test_verify_steps_replay_their_graphs_on_cuda(make):
    """A target whose attention runs minillm's kernels (shakespeare-1m, head_dim 32; the 11M model's 48 has none)
    captures its verify steps (`ModelRunner.verify_graphs`) and replays them: fp32, greedy, a batch of prompts
    that repeat themselves (prompt lookup finds drafts), the tokens of plain greedy decoding."""
    model, tok = minillm.load(minillm.DEFAULT_DRAFT, device="cuda", dtype=torch.float32)
    prompts = [PROMPT * 3, "To be, or not to be, that is the question. To be, or not to be"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model, tok).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, tok, speculative=SpeculativeConfig(make(model), 4))
    verify_graphs = llm.engine.model_runner.verify_graphs
    assert verify_graphs is not None, "speculation on a GPU captures its verify steps"
    replays = []
    real_run = verify_graphs.run
    verify_graphs.run = lambda *a, **kw: replays.append(1) or real_run(*a, **kw)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert replays, "the verify steps replayed their graphs"
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.spec_stats.tokens_per_step > 1


# ---------------------------------------------------------------- adaptive speculation
def test_draft_gate_backs_off_a_sequence_whose_drafts_fail_and_lets_a_good_one_draft():
    from minillm.sampler.speculative import DraftGate

    gate = DraftGate(k=4, draft_cost=0.2)
    assert gate.drafts("a")  # nothing known yet: draft
    for _ in range(DraftGate.MIN_STEPS - 1):  # alpha 0 (1 token for 1 + 4 x 0.2 steps), but too few steps to judge
        gate.record("a", 1, 0)  # the first draft was checked and rejected: the rest never reached the rule
        assert gate.drafts("a")
    gate.record("a", 1, 0)
    assert [gate.drafts("a") for _ in range(5)] == [False] * 4 + [True]  # 4 plain steps, then a probe
    gate.record("a", 1, 0)
    assert [gate.drafts("a") for _ in range(9)] == [False] * 8 + [True]  # the wait doubles while probes fail
    for _ in range(30):  # now every draft is accepted: the decayed alpha climbs back above break-even
        gate.record("a", 4, 4)
    assert all(gate.drafts("a") for _ in range(10))
    for _ in range(2 * DraftGate.MIN_STEPS):  # alpha 0.6, counted right: 2 of 3 checked each step (not 2 of 4)
        gate.record("b", 3, 2)
    assert all(gate.drafts("b") for _ in range(10))  # E(0.67, 4) = 2.6 tokens for 1.8 steps
    free = DraftGate(k=4, draft_cost=0.0)
    for _ in range(2 * DraftGate.MIN_STEPS):
        free.record("c", 1, 0)
    assert free.drafts("c")  # a drafter that costs nothing never loses (E >= 1)
    gate.release("a")
    assert "a" not in gate.rows
    with pytest.raises(ValueError, match="draft_cost"):
        SpeculativeConfig(NgramDrafter(), 4, draft_cost=-1)


class _Script:
    """Drafts from a known continuation: the target's own tokens, the first `right` of each draft (None: all), the
    rest each plus one (wrong)."""

    def __init__(self, prompt_len: int, continuation: list[int], right: int | None, vocab: int) -> None:
        self.prompt_len, self.continuation, self.right, self.vocab = prompt_len, continuation, right, vocab

    def propose(self, seq_ids, contexts, params, num_tokens, generators):
        drafts = []
        for context, k in zip(contexts, num_tokens):
            done = len(context) - self.prompt_len
            tokens = self.continuation[done: done + k]
            right = len(tokens) if self.right is None else self.right
            drafts.append(Draft([t if i < right else (t + 1) % self.vocab for i, t in enumerate(tokens)]))
        return drafts

    def release(self, seq_id):
        pass


def test_adaptive_speculation_stops_drafting_what_fails_and_keeps_what_pays(target):
    """Greedy, a drafter that is always wrong: with adaptive=True most steps decode plainly (a probe now and then),
    without it every step verifies; a drafter that is always right drafts every step either way, and so does one
    right once then wrong (alpha = 1/2 of the drafts checked: just above break-even at c = 0.2; counting all four
    drafts proposed as checked would make it 1/4, and gate it). The tokens are plain greedy's in every case."""
    model, tok = target
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ids = tok.encode(PROMPT)
    plain = minillm.generate(model, PROMPT, params, tok).token_ids
    steps = {}
    for wrong in (True, False, "once"):
        for adaptive in (False, True):
            right = {True: 0, False: None, "once": 1}[wrong]
            drafter = _Script(len(ids), plain, right, model.config.vocab_size)
            spec = SpeculativeConfig(drafter, 4, adaptive=adaptive, draft_cost=0.2)
            llm = LLM(model, tok, speculative=spec)
            assert llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids == plain
            steps[wrong, adaptive] = llm.engine.spec_stats.num_steps
            assert not llm.engine.draft_gate or not llm.engine.draft_gate.rows  # released at the end
    assert steps[True, False] == 46  # every decode step verified a wrong draft (but the last, with one token to go)
    assert steps[True, True] <= 12  # MIN_STEPS, then probes after 4, 8, 16 plain steps
    assert steps[False, True] == steps[False, False] < 12  # right drafts: 5 tokens a step, every step
    assert steps["once", True] == steps["once", False]  # 2 tokens a step: it pays (barely), so it drafts on
