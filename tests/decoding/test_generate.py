"""Generation: `minillm.generate`, `generate_stream`, `generate_no_cache`, sampling, stop strings, streaming text.

The model is the random Llama of `llama_folder` (vocabulary 320, context 256) with the tiny byte-level
tokenizer, so its text is gibberish, but gibberish that exercises every path: multi-byte characters split
across tokens, special tokens, repeated tokens.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm
from minillm import SamplingParams
from minillm.engine.sequence import StopStringMatcher
from minillm.tokenizer import IncrementalDecoder

PROMPT = "To be, or not to be"
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_and_tokenizer(llama_folder):
    model, tokenizer = minillm.load(llama_folder)
    assert tokenizer is not None
    return model, tokenizer


@pytest.fixture(scope="module")
def model(model_and_tokenizer):
    return model_and_tokenizer[0]


@pytest.fixture(scope="module")
def tokenizer(model_and_tokenizer):
    return model_and_tokenizer[1]


# ------------------------------------------------------------------ greedy, cache, timing
def test_greedy_with_and_without_cache_agree(model, tokenizer):
    """The KV-cache loop and the recompute-everything loop pick the same greedy tokens and text."""
    params = SamplingParams(max_tokens=20, **GREEDY)
    cached = minillm.generate(model, PROMPT, params, tokenizer)
    uncached = minillm.generate_no_cache(model, PROMPT, params, tokenizer)
    assert cached.token_ids == uncached.token_ids, (
        f"cached {cached.token_ids} != uncached {uncached.token_ids}"
    )
    assert cached.text == uncached.text


def test_length_finish_gives_exactly_max_tokens(model, tokenizer):
    """Without EOS, generation stops at max_tokens with finish_reason "length"."""
    out = minillm.generate(model, PROMPT, SamplingParams(max_tokens=7, **GREEDY), tokenizer)
    assert out.finish_reason == "length", f"expected finish_reason 'length', got {out.finish_reason!r}"
    assert len(out.token_ids) == 7, f"expected exactly 7 tokens, got {len(out.token_ids)}"
    assert out.prompt_token_ids == tokenizer.encode(PROMPT)
    assert out.text == tokenizer.decode(out.token_ids), "expected .text to be the decoded generated ids"


def test_timing_fields_are_positive_and_one_per_token(model, tokenizer):
    """token_times_s has one increasing, positive time per token; TTFT, TPOT and tok/s are positive."""
    out = minillm.generate(model, PROMPT, SamplingParams(max_tokens=6, **GREEDY), tokenizer)
    times = out.token_times_s
    assert len(times) == len(out.token_ids) == 6, f"expected 6 times for 6 tokens, got {len(times)}"
    assert times[0] > 0, "expected a positive time to first token"
    assert all(b > a for a, b in zip(times, times[1:])), f"expected strictly increasing token times: {times}"
    assert out.ttft_s == times[0]
    assert len(out.inter_token_latencies_s) == 5
    assert out.tpot_s > 0 and out.decode_tokens_per_s > 0
    assert out.decode_tokens_per_s == pytest.approx(1 / out.tpot_s)


def test_token_id_prompt_without_tokenizer_gives_ids_and_no_text(model):
    """A token-id prompt works without a tokenizer; the output has ids and text None."""
    out = minillm.generate(model, [0, 5, 9, 33], SamplingParams(max_tokens=4, **GREEDY))
    assert len(out.token_ids) == 4 and out.text is None


# ------------------------------------------------------------------ EOS
@pytest.mark.parametrize("with_tokenizer", [True, False], ids=["tokenizer", "ids-only"])
def test_eos_stops_generation_at_that_token(model, tokenizer, with_tokenizer):
    """When the model's greedy choice at step k is EOS, generation ends there with finish_reason "stop".

    We find the greedy tokens t_0, t_1, ... of the unmodified model, pick a step k whose token appears
    neither earlier nor as EOS, and swap the lm_head rows of t_k and EOS (</s> = 1): steps before k are
    unchanged, and at step k EOS wins.
    """
    eos = 1
    params = SamplingParams(max_tokens=16, **GREEDY)
    greedy = minillm.generate(model, PROMPT, params, tokenizer).token_ids
    k = next((i for i in range(3, len(greedy)) if greedy[i] not in greedy[:i] and eos not in greedy[: i + 1]), None)
    assert k is not None, f"expected a step >= 3 with a first-time, non-EOS greedy token in {greedy}"
    swapped = copy.deepcopy(model)
    with torch.no_grad():
        w = swapped.lm_head.weight
        w[[eos, greedy[k]]] = w[[greedy[k], eos]]

    prompt, tok = (PROMPT, tokenizer) if with_tokenizer else (tokenizer.encode(PROMPT), None)
    out = minillm.generate(swapped, prompt, SamplingParams(max_tokens=16, temperature=0.0), tok)
    assert out.finish_reason == "stop", f"expected finish_reason 'stop' on EOS, got {out.finish_reason!r}"
    assert out.token_ids == greedy[:k] + [eos], f"expected {greedy[:k]} then EOS {eos}, got {out.token_ids}"
    if with_tokenizer:
        assert out.text == tokenizer.decode(greedy[:k]), "expected .text to be the text before EOS"
        assert "</s>" not in out.text, "expected the EOS token's text to stay out of .text"

    ignoring = minillm.generate(swapped, prompt, SamplingParams(max_tokens=16, **GREEDY), tok)
    assert ignoring.finish_reason == "length" and len(ignoring.token_ids) == 16, "ignore_eos should run on"


# ------------------------------------------------------------------ stop strings
def test_stop_string_spanning_tokens_cuts_text_and_stream(model, tokenizer):
    """A stop string that starts mid-text and spans a token boundary ends generation just before it."""
    params = SamplingParams(max_tokens=24, **GREEDY)
    pieces = [c.text for c in minillm.generate_stream(model, PROMPT, params, tokenizer)]
    full = "".join(pieces)
    assert full == minillm.generate(model, PROMPT, params, tokenizer).text

    # Choose the first boundary between two pieces where the last characters of the first (not all of it)
    # and the first characters of the second form a string that does not occur earlier in the text: the
    # stop string starts in the middle of one token's text and ends in the next token's.
    choice = None
    for k in range(len(pieces) - 1):
        if len(pieces[k]) < 2 or not pieces[k + 1]:
            continue
        end = len("".join(pieces[: k + 1]))  # the boundary between piece k and piece k+1
        for left in range(1, len(pieces[k])):
            for right in range(1, len(pieces[k + 1]) + 1):
                stop = full[end - left : end + right]
                if full.find(stop) == end - left:
                    choice = (k, stop, end - left)
                    break
            if choice:
                break
        if choice:
            break
    assert choice is not None, f"found no usable stop string in {pieces}"
    k, stop, start = choice
    assert start > 0, "expected the stop string to begin after some emitted text"

    stop_params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    out = minillm.generate(model, PROMPT, stop_params, tokenizer)
    assert out.finish_reason == "stop", f"expected finish_reason 'stop' on {stop!r}, got {out.finish_reason!r}"
    assert out.text == full[:start], f"expected the text before {stop!r}: {full[:start]!r}, got {out.text!r}"
    assert len(out.token_ids) == k + 2, "expected generation to end on the token that completes the stop string"

    chunks = list(minillm.generate_stream(model, PROMPT, stop_params, tokenizer))
    streamed = "".join(c.text for c in chunks)
    assert streamed == out.text, f"expected the streamed pieces to add up to {out.text!r}, got {streamed!r}"
    assert stop not in streamed, "the stop string must never be streamed"
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]


def test_stop_strings_without_a_hit_change_nothing(model, tokenizer):
    """Stop strings that never appear leave tokens, text and finish_reason as without them.

    One of them begins with the last character of the text, so that character is still held back when
    max_tokens is reached: it must be released, not lost.
    """
    plain = minillm.generate(model, PROMPT, SamplingParams(max_tokens=12, **GREEDY), tokenizer)
    assert plain.text, "expected some generated text"
    stops = SamplingParams(max_tokens=12, stop=["\n\n\n", plain.text[-1] + "\u2603\u2603"], **GREEDY)
    out = minillm.generate(model, PROMPT, stops, tokenizer)
    assert (out.token_ids, out.text, out.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)


def test_stop_matcher_finds_stop_across_pieces():
    """Fed "ab", "c", "de" with stop "cd": emits "ab", holds "c", then reports the stop."""
    m = StopStringMatcher(["cd"])
    assert m.feed("ab") == ("ab", False), "nothing in 'ab' can begin 'cd'"
    assert m.feed("c") == ("", False), "'c' may begin 'cd' and must be held back"
    assert m.feed("de") == ("", True), "'cde' completes 'cd': stop, emitting nothing after it"


def test_stop_matcher_releases_held_prefix_when_continuation_differs():
    """A held partial match is released once the next text shows it is not the stop string."""
    m = StopStringMatcher(["abcd"])
    assert m.feed("xab") == ("x", False), "'ab' may begin 'abcd' and must be held"
    assert m.feed("c") == ("", False), "'abc' may still begin 'abcd'"
    assert m.feed("e") == ("abce", False), "'abce' is not 'abcd': release everything"


def test_stop_matcher_flush_releases_held_text():
    """flush() hands back whatever was held, and leaves nothing pending."""
    m = StopStringMatcher(["cd"])
    assert m.feed("abc") == ("ab", False)
    assert m.flush() == "c", "expected flush to release the held 'c'"
    assert m.flush() == "", "expected nothing left after a flush"


def test_stop_matcher_cuts_at_earliest_stop_and_text_before_it():
    """With several stop strings, the earliest occurrence wins and the text before it is emitted."""
    m = StopStringMatcher(["yz", "bc"])
    assert m.feed("abcxyz") == ("a", True)


# ------------------------------------------------------------------ streaming text never splits a character
def push_all(tokenizer, ids: list[int], prompt_ids: list[int] | None = None) -> list[str]:
    decoder = IncrementalDecoder(tokenizer, prompt_ids)
    return [decoder.push(i) for i in ids]


def test_incremental_decoder_never_emits_half_a_character(tokenizer):
    """Byte-level tokens split "é", "東" and "🙂"; pushed one by one, only whole characters come out."""
    text = "café 東京 🙂 naïve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    alone = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in a for a in alone), f"expected some token to hold part of a character: {alone}"
    pieces = push_all(tokenizer, ids)
    assert not any("\ufffd" in p for p in pieces), f"a piece holds half a character: {pieces}"
    assert "".join(pieces) == tokenizer.decode(ids) == text, f"pieces {pieces} do not add up to {text!r}"


@settings(max_examples=50, deadline=None, database=None)
@given(
    prompt=st.text(st.characters(blacklist_characters="\ufffd", blacklist_categories=("Cs",)), max_size=12),
    text=st.text(st.characters(blacklist_characters="\ufffd", blacklist_categories=("Cs",)), min_size=1, max_size=30),
)
def test_incremental_decoder_on_random_unicode(tokenizer, prompt, text):
    """For any text after any prompt: no piece has U+FFFD and the pieces add up to the decoded ids."""
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = push_all(tokenizer, ids, prompt_ids)
    assert not any("\ufffd" in p for p in pieces), f"a piece holds half a character: {pieces}"
    assert "".join(pieces) == tokenizer.decode(ids), f"pieces {pieces} do not add up to {tokenizer.decode(ids)!r}"


def test_encode_rejects_a_lone_surrogate_with_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="lone surrogate"):
        tokenizer.encode("ab\ud800c")
    with pytest.raises(TypeError, match="decode bytes"):
        tokenizer.encode(b"bytes")


# ------------------------------------------------------------------ errors before any work
@pytest.fixture(scope="module")
def tokenizer_without_bos(tokenizer_file, tmp_path_factory):
    """The tiny tokenizer without its BOS template, so that "" encodes to no ids at all."""
    spec = json.loads(tokenizer_file.read_text())
    spec["post_processor"] = None
    path = tmp_path_factory.mktemp("tok-no-bos") / "tokenizer.json"
    path.write_text(json.dumps(spec))
    tok = minillm.Tokenizer.from_file(path)
    assert tok.encode("") == [], "expected no ids for an empty text without a BOS template"
    return tok


ERROR_CASES = {
    "text-without-tokenizer": (PROMPT, {}, False, "needs a tokenizer"),
    "empty-prompt": ([], {}, True, "prompt is empty"),
    "empty-text-prompt-ids": ("", {}, "no-bos", "prompt is empty"),
    "id-out-of-vocab": ([0, 5, 320], {}, True, r"\[320\] are outside the vocabulary \[0, 320\)"),
    "negative-id": ([-1, 5], {}, True, "outside the vocabulary"),
    "too-long": ([5] * 10, {"max_tokens": 250}, True, "shorten the prompt or lower max_tokens"),
    "stop-without-tokenizer": ([0, 5], {"stop": ["x"]}, False, "stop strings are matched on text"),
}


@pytest.mark.parametrize("case", ERROR_CASES, ids=list(ERROR_CASES))
@pytest.mark.parametrize("entry", ["generate", "generate_stream"])
def test_bad_requests_fail_before_running_the_model(model, tokenizer, tokenizer_without_bos, case, entry):
    """Each bad request raises ValueError with its message before the model runs a single forward."""
    prompt, kwargs, tok, message = ERROR_CASES[case]
    tok = tokenizer_without_bos if tok == "no-bos" else tokenizer if tok else None
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            params = SamplingParams(**kwargs)
            if entry == "generate":
                minillm.generate(model, prompt, params, tok)
            else:
                next(minillm.generate_stream(model, prompt, params, tok))
    finally:
        hook.remove()
    assert not calls, f"expected no forward pass before the error, got {len(calls)}"


# ------------------------------------------------------------------ seeds
def test_same_seed_gives_same_tokens(model, tokenizer):
    """Sampling at temperature 1 with one seed is reproducible."""
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=1234, ignore_eos=True)
    first = minillm.generate(model, PROMPT, params, tokenizer).token_ids
    second = minillm.generate(model, PROMPT, params, tokenizer).token_ids
    assert first == second, f"same seed, different tokens: {first} vs {second}"


def test_different_seeds_give_different_tokens(model, tokenizer):
    """Several seeds at temperature 1 do not all sample the same sequence."""
    runs = {
        tuple(minillm.generate(model, PROMPT, SamplingParams(max_tokens=10, seed=s, ignore_eos=True), tokenizer)
              .token_ids)
        for s in range(4)
    }
    assert len(runs) > 1, f"expected different seeds to give different samples, all gave {runs}"


# ------------------------------------------------------------------ SamplingParams and sample()
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, r"temperature must be >= 0 \(0 = greedy\), got -0.5"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_k": -1}, r"top_k must be >= 0 \(0 = off\), got -1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\] \(1 = off\), got 1.5"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"stop": [""]}, "stop must be a list of non-empty strings"),
    ],
    ids=["temperature<0", "temperature-nan", "top_k<0", "top_p=0", "top_p=1.5", "max_tokens=0", "empty-stop"],
)
def test_sampling_params_validation_messages(kwargs, message):
    """Each out-of-range SamplingParams field raises ValueError saying the allowed range."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_a_single_stop_string():
    """stop="x" is read as ["x"]; no stop is an empty list."""
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams().stop == []


@pytest.fixture
def logits():
    torch.manual_seed(0)
    return torch.randn(6, 50) * 3


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1), SamplingParams(top_p=1e-6)],
    ids=["greedy", "top_k=1", "top_p-tiny"],
)
def test_degenerate_sampling_equals_argmax(logits, params):
    """Greedy, top_k=1 and a tiny top_p all leave only the argmax, whatever the seed."""
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        picked = minillm.sample(logits, params, g)
        assert picked.dtype == torch.int64 and picked.shape == (6,)
        assert torch.equal(picked, logits.argmax(-1)), f"{params}: expected argmax, got {picked.tolist()}"


def test_top_k_samples_only_the_k_most_likely(logits):
    """With top_k=3 every sampled id is among each row's three largest logits."""
    allowed = logits.topk(3, dim=-1).indices
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        picked = minillm.sample(logits, SamplingParams(temperature=2.0, top_k=3), g)
        assert (allowed == picked[:, None]).any(-1).all(), f"sampled outside the top 3: {picked.tolist()}"


def test_top_p_keeps_smallest_set_reaching_p():
    """probs (0.5, 0.3, 0.15, 0.05), top_p=0.7: only ids 0 and 1 can be drawn, and both are."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    g = torch.Generator().manual_seed(0)
    seen = {int(minillm.sample(logits, SamplingParams(top_p=0.7), g)) for _ in range(200)}
    assert seen == {0, 1}, f"expected exactly ids {{0, 1}} under top_p=0.7, saw {seen}"
