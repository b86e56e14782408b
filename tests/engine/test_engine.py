"""minillm.engine.scheduler and minillm.engine (chapter 05): continuous batching must not change any request's output.

The engine batches requests of different lengths into one forward per step, cuts prompts into chunks
under a token budget, and preempts (frees and later recomputes) requests when KV blocks run out. None
of that may change what a request generates: greedy outputs must equal `generate`'s, token for token,
whatever else runs beside it. The property test draws random arrival times, prompt lengths, output
lengths, pool sizes and budgets (small ones, so that chunking and preemption happen) and checks that,
then that every block is back in the pool.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minillm
from minillm.arithmetic import cdiv
from minillm.decoding.generation import generate
from minillm.decoding.llm import LLM
from minillm.engine import LLMEngine
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Sequence, SequenceStatus
from minillm.sampler.sampling import SamplingParams

MODEL = "shakespeare-1m"
TEXT = ("FIRST CITIZEN.\nBefore we proceed any further, hear me speak.\n\nALL.\nSpeak, speak.\n\nFIRST CITIZEN.\n"
        "You are all resolved rather to die than to famish?\n\nALL.\nResolved, resolved.\n")


@pytest.fixture(scope="module")
def shipped():
    return minillm.load(MODEL)


@pytest.fixture(scope="module")
def text_ids(shipped):
    return shipped[1].encode(TEXT)


def alone(model, ids: list[int], max_tokens: int) -> list[int]:
    """What `generate` produces for this prompt by itself, greedy, EOS ignored."""
    return generate(model, ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)).token_ids


# ------------------------------------------------------------------ the scheduler on its own
def scheduler_with(num_blocks: int, **kw) -> Scheduler:
    config = minillm.config.ModelConfig(dim=8, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=8, vocab_size=50)
    return Scheduler(PagedKVCache(config, num_blocks, block_size=4), watermark=0.0, **kw)


def run(s: Scheduler, out) -> None:
    """What the engine does with a schedule: the forward writes the tokens' K/V (the cache commits them), and
    every request whose prompt is complete samples a token (here always 1)."""
    for r, n in out.scheduled:
        s.cache.commit([s.cache.block_tables[r.request_id]], [r.all_token_ids[r.num_computed_tokens:
                                                                               r.num_computed_tokens + n]])
        r.num_computed_tokens += n
        if r.num_uncomputed_tokens == 0:
            r.output_token_ids.append(1)


def test_token_budget_chunks_a_long_prompt_beside_the_running_decodes():
    s = scheduler_with(64, max_num_batched_tokens=8)
    s.add(Sequence("short", list(range(3)), SamplingParams(max_tokens=5)))
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 3)]
    run(s, out)
    s.add(Sequence("long", list(range(20)), SamplingParams(max_tokens=5)))
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 1), ("long", 7)], (
        "the running request's decode token comes first, then as much of the long prompt as the budget of 8 allows"
    )
    assert out.num_prefill_tokens == 7 and out.num_decode_tokens == 1 and out.num_batched_tokens == 8


def test_waiting_requests_are_served_in_order_and_say_why_they_wait():
    s = scheduler_with(64, max_num_seqs=1)
    for name in "abc":
        s.add(Sequence(name, [1, 2, 3], SamplingParams(max_tokens=2)))
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
    assert out.waiting == {"b": "max_num_seqs", "c": "behind b"}


def test_preemption_frees_the_newest_request_and_requeues_it_first():
    s = scheduler_with(4, max_num_batched_tokens=64)  # 4 blocks of 4 tokens
    old, new = Sequence("old", list(range(8)), SamplingParams(max_tokens=8)), Sequence("new", list(range(7)),
                                                                                       SamplingParams(max_tokens=8))
    s.add(old)
    s.add(new)
    out = s.schedule()  # old takes 2 blocks, new 2 blocks: the pool is full
    assert [(r.request_id, n) for r, n in out.scheduled] == [("old", 8), ("new", 7)]
    run(s, out)
    out = s.schedule()  # old's 9th token needs a third block: new is preempted
    assert out.preempted == ["new"] and [r.request_id for r, _ in out.scheduled] == ["old"]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert s.waiting[0] is new, "a preempted request goes back to the head of the queue"
    assert new.request_id not in s.cache.block_tables, "its blocks are freed"


def test_add_refuses_requests_that_could_never_run():
    s = scheduler_with(4)  # 16 token slots
    with pytest.raises(ValueError, match="more than the whole KV cache"):
        s.add(Sequence("big", list(range(10)), SamplingParams(max_tokens=10)))
    s.add(Sequence("x", [1], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="already in use"):
        s.add(Sequence("x", [1], SamplingParams(max_tokens=2)))
    no_chunks = scheduler_with(64, max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        no_chunks.add(Sequence("long", list(range(9)), SamplingParams(max_tokens=1)))


# ------------------------------------------------------------------ the engine
def test_llm_generate_greedy_equals_generate_alone(shipped, text_ids):
    model, tok = shipped
    prompts = [text_ids[:5], text_ids[:40], text_ids[:1], text_ids[:23]]
    outs = LLM(model, tok, max_num_seqs=3, max_num_batched_tokens=16).generate(
        prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.finished and out.finish_reason == "length"
        assert out.token_ids == alone(model, p, 20), f"{len(p)}-token prompt: batched output differs from alone"
        assert out.text == tok.decode(out.token_ids)


def test_stop_strings_eos_and_seeded_sampling_match_generate(shipped, text_ids):
    model, tok = shipped
    cases = [
        ("ROMEO.\n", SamplingParams(temperature=0, max_tokens=40, stop=["\n\n"])),
        ("KING HENRY.\n", SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=30)),
        ("ALL.\n", SamplingParams(temperature=1.0, seed=11, max_tokens=25, repetition_penalty=1.3)),
    ]
    llm = LLM(model, tok, max_num_batched_tokens=32)
    outs = llm.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    for (prompt, params), out in zip(cases, outs):
        ref = generate(model, prompt, params, tok)
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason), (
            f"{prompt!r} with {params}: engine {out.text!r} ({out.finish_reason}) vs generate {ref.text!r}")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streaming_deltas_add_up_and_abort_frees_blocks(shipped, text_ids, async_scheduling):
    """Deltas add up to the final output; an aborted request gets no token after the abort, even with async
    scheduling, where a token sampled before the abort is read after it (and must be dropped)."""
    model, tok = shipped
    engine = LLMEngine(model, tok, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    keep = engine.add_request("keep", text_ids[:12], SamplingParams(temperature=0, max_tokens=15))
    drop = engine.add_request("drop", text_ids[:30], SamplingParams(temperature=0, max_tokens=50))
    texts, ids, steps = {keep: "", drop: ""}, {keep: [], drop: []}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.new_text
            ids[out.request_id] += out.new_token_ids
            last = out
        steps += 1
        if steps == 5:
            engine.abort_request(drop)
            dropped_at = len(ids[drop])
    assert last.request_id == keep and last.finished and ids[keep] == last.token_ids and texts[keep] == last.text
    assert len(ids[drop]) == dropped_at < 50, "the aborted request got no token after the abort"
    assert ids[keep] == alone(model, text_ids[:12], 15) or last.finish_reason == "stop"
    assert engine.cache.allocator.num_used_blocks == 0, "every block is back in the pool"


def test_finished_only_steps_give_the_same_final_outputs(shipped):
    """step(finished_only=True), what run() and LLM.generate use, skips the outputs of sequences still running;
    the outputs it does give equal the ones a streaming caller gets at the same step."""
    model, tok = shipped
    params = [SamplingParams(max_tokens=n, temperature=t, seed=7, logprobs=2) for n, t in ((5, 0.0), (12, 0.8),
                                                                                           (20, 1.0))]
    finals = []
    for finished_only in (False, True):
        engine = LLMEngine(model, tok)
        for i, p in enumerate(params):
            engine.add_request(str(i), "KING.\nMy lord,", p)
        got, unfinished_seen = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step(finished_only=finished_only):
                unfinished_seen += not out.finished
                if out.finished:
                    got[out.request_id] = out
        assert (unfinished_seen == 0) == finished_only
        finals.append({k: (o.token_ids, o.text, o.logprobs, o.finish_reason, len(o.token_times_s))
                       for k, o in got.items()})
    assert finals[0] == finals[1] and len(finals[0]) == 3


def test_the_engine_counts_preemptions_as_its_requests_saw_them(shipped):
    model, tok = shipped
    engine = LLMEngine(model, tok, num_blocks=12, block_size=8)  # 96 tokens of KV for 6 requests of ~40
    for i in range(6):
        engine.add_request(str(i), f"KING {i}.\n", SamplingParams(max_tokens=32, ignore_eos=True))
    finished = engine.run()
    assert engine.num_preemptions > 0, "the pool is too small for the load: some sequence was preempted"
    assert engine.num_preemptions == sum(o.num_preemptions for o in finished.values())
    assert all(len(o.token_ids) == 32 for o in finished.values())


def test_bad_requests_are_refused_with_a_clear_error(shipped):
    model, tok = shipped
    engine = LLMEngine(model, tok)
    # Forks are Sequences of their request (keys (id, index)), so no character of an id is reserved: "a#1" beside
    # "a" with n=2 are three sequences that cannot collide.
    engine.add_request("a#1", "A", SamplingParams(max_tokens=2))
    engine.add_request("a", "A", SamplingParams(max_tokens=2, n=2, temperature=1.0, seed=0))
    finished = engine.run()
    assert sorted(finished) == [("a", 0), ("a", 1), ("a#1", 0)]
    with pytest.raises(ValueError, match="in use"):
        engine.add_request("b", "A", SamplingParams(max_tokens=2))
        engine.add_request("b", "A", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="context"):
        engine.add_request(None, "A", SamplingParams(max_tokens=model.config.max_seq_len + 1))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(None, [], SamplingParams())


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_arrivals_under_a_small_pool_give_every_request_its_solo_output(shipped, text_ids, data,
                                                                                async_scheduling):
    """Requests arrive at random steps with random prompt and output lengths; the pool and the token budget are
    small, so prompts are chunked and requests preempted. Each finishes with exactly its solo greedy output,
    and the pool ends empty. With async scheduling too: there a sequence preempted while its token is in flight
    gets the token afterwards and is recomputed with it."""
    model, _ = shipped
    n = data.draw(st.integers(2, 6), label="requests")
    specs = []
    for _ in range(n):
        start = data.draw(st.integers(0, len(text_ids) - 1), label="prompt start")
        specs.append((start, data.draw(st.integers(1, min(40, len(text_ids) - start)), label="prompt length"),
                      data.draw(st.integers(1, 24), label="max_tokens"), data.draw(st.integers(0, 8), label="arrival")))
    budget = data.draw(st.sampled_from([4, 16, 64]), label="max_num_batched_tokens")
    largest = max(kv_len + m for _, kv_len, m, _ in specs)
    num_blocks = data.draw(st.integers(cdiv(largest, 16), cdiv(largest, 16) + 6), label="num_blocks")
    engine = LLMEngine(model, None, num_blocks=num_blocks, max_num_seqs=data.draw(st.integers(1, 4)),
                       max_num_batched_tokens=budget, enable_prefix_caching=data.draw(st.booleans()),
                       async_scheduling=async_scheduling)
    prompts = {str(i): text_ids[s: s + k] for i, (s, k, _, _) in enumerate(specs)}
    finished, step, preemptions = {}, 0, 0
    while len(finished) < n:
        for i, (_, _, m, arrival) in enumerate(specs):
            if arrival == step:
                engine.add_request(str(i), prompts[str(i)], SamplingParams(temperature=0, max_tokens=m,
                                                                             ignore_eos=True))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        preemptions += len(engine.last_step.preempted) if engine.last_step else 0
        step += 1
        assert step < 2000, "the engine made no progress"
    for i, (_, _, m, _) in enumerate(specs):
        assert finished[str(i)].token_ids == alone(model, prompts[str(i)], m), (
            f"request {i} ({len(prompts[str(i)])}-token prompt, {m} tokens, budget {budget}, {num_blocks} blocks, "
            f"{preemptions} preemptions in the run) differs from its solo output")
    assert engine.cache.allocator.num_used_blocks == 0


def test_preempted_requests_are_recomputed_and_still_match_their_solo_output(shipped, text_ids):
    """Four requests in a pool that holds about two of them: some are preempted (freed, recomputed from their
    prompt and the tokens they had), and every output still equals the request's solo greedy output."""
    model, _ = shipped
    engine = LLMEngine(model, None, num_blocks=6, max_num_seqs=4, max_num_batched_tokens=64)
    prompts = [text_ids[i * 10: i * 10 + 20] for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    finished, preempted = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        preempted += len(engine.last_step.preempted)
    assert preempted > 0, "the pool was meant to run out: no request was preempted"
    for i, p in enumerate(prompts):
        assert finished[str(i)].token_ids == alone(model, p, 24), f"request {i} changed after preemption"
    assert engine.cache.allocator.num_used_blocks == 0


# ------------------------------------------------------------------ n > 1 and constraints, beside other requests
def test_n_completions_fork_after_one_prefill_and_match_generate_with_seed_plus_index(shipped, text_ids):
    """A request with n=3 shares the batch with another: its prompt is computed once, then three sequences
    fork from it; sequence i samples what `generate` samples with seed + i, and the other is unchanged."""
    model, tok = shipped
    params = SamplingParams(max_tokens=10, n=3, seed=11, ignore_eos=True)
    engine = LLMEngine(model, tok, num_blocks=40, max_num_batched_tokens=32)
    engine.add_request("other", text_ids[:30], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.add_request("n3", text_ids[5:25], params)
    assert engine.num_unfinished_requests == 2
    finished, prompt_tokens = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id, out.index] = out
        prompt_tokens += engine.last_step.num_prefill_tokens
    assert prompt_tokens == 30 + 20, "each prompt is computed once, not once per completion"
    assert sorted(finished) == [("n3", 0), ("n3", 1), ("n3", 2), ("other", 0)]
    for i in range(3):
        solo = generate(model, text_ids[5:25], replace(params, n=1, seed=11 + i), tok)
        assert finished["n3", i].token_ids == solo.token_ids, f"sequence {i} samples with seed 11 + {i}"
    assert finished["other", 0].token_ids == alone(model, text_ids[:30], 12)
    assert engine.cache.allocator.num_used_blocks == 0 and engine.num_unfinished_requests == 0


def test_aborting_an_n_request_aborts_all_its_sequences(shipped, text_ids):
    model, tok = shipped
    engine = LLMEngine(model, tok)
    engine.add_request("n4", text_ids[:20], SamplingParams(max_tokens=30, n=4, seed=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 4, "forked into four sequences"
    engine.abort_request("n4")
    assert not engine.has_unfinished_requests() and engine.cache.allocator.num_used_blocks == 0


def test_llm_generate_returns_the_n_best_of_best_of_per_prompt(shipped, text_ids):
    model, tok = shipped
    params = SamplingParams(max_tokens=8, n=2, best_of=5, seed=3)
    outs = LLM(model, tok).generate([text_ids[:10], text_ids[20:30]], params, use_tqdm=False)
    assert len(outs) == 4, "n=2 outputs for each of 2 prompts"
    assert outs[0].request_id != outs[2].request_id
    for first, second in (outs[:2], outs[2:]):
        assert first.request_id == second.request_id
        assert first.cumulative_logprob >= second.cumulative_logprob
    every = minillm.generate_n(model, text_ids[:10], replace(params, n=5), tok)
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in every[:2]], "the best 2 of the same 5"


def test_a_constrained_request_batched_with_others_matches_its_solo_run(shipped, text_ids):
    from minillm.decoding.generation import generate_constrained
    from minillm.sampler.constrained import TokenIndex

    model, tok = shipped
    index = TokenIndex.from_constraint(r"(Speak|Resolved), [a-z]+\.", tok, model.config.eos_token_ids)
    params = SamplingParams(max_tokens=12, seed=5)
    solo = generate_constrained(model, tok, "ALL.\n", index, params)
    engine = LLMEngine(model, tok)
    engine.add_request("free", text_ids[:15], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.add_request("json", "ALL.\n", params, constraint=index)
    finished = engine.run()
    assert finished["json", 0].token_ids == solo.token_ids and solo.complete
    assert finished["free", 0].token_ids == alone(model, text_ids[:15], 12), "the mask touches only its own row"
    with pytest.raises(ValueError, match="stop strings"):
        engine.add_request(None, "A", SamplingParams(stop=["x"]), constraint=index)
