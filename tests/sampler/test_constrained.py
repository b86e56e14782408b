"""Constrained decoding (`minillm.sampler.constrained`): regex -> DFA, JSON schema -> regex, the token index, the
masked generation loop, and a cross-check of the index against outlines-core.

Generation tests use the shipped 1M-parameter Shakespeare model: it has never seen JSON, which is the
point -- whatever it prefers, the mask must keep its output valid.
"""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm
from minillm.decoding.generation import generate_constrained
from minillm.sampler.constrained import (
    DEAD,
    RegexDFA,
    TokenIndex,
    bytes_to_unicode,
    mask_logits,
    schema_to_regex,
    utf8_sequences,
    vocabulary_bytes,
)
from minillm.sampler.sampling import SamplingParams


@pytest.fixture(scope="module")
def model_and_tokenizer():
    model, tokenizer = minillm.load(minillm.DEFAULT_DRAFT)  # shakespeare-1m: fast on a CPU
    return model, tokenizer


@pytest.fixture(scope="module")
def token_bytes(model_and_tokenizer):
    return vocabulary_bytes(model_and_tokenizer[1])


# ====================================================================== UTF-8 and the byte-level DFA
def encodings(sequence: tuple[tuple[int, int], ...]) -> set[bytes]:
    """Every byte string a byte-range sequence matches."""
    return {bytes(p) for p in itertools.product(*(range(lo, hi + 1) for lo, hi in sequence))}


@settings(max_examples=60, deadline=None, database=None)
@given(lo=st.integers(0, 0x10FFFF), span=st.integers(0, 3000))
def test_utf8_sequences_cover_exactly_the_code_points(lo, span):
    """The byte-range sequences of lo..hi match the UTF-8 encodings of lo..hi, no more, no less."""
    hi = min(lo + span, 0x10FFFF)
    expected = {chr(c).encode("utf-8") for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF}
    got = set().union(*(encodings(s) for s in utf8_sequences(lo, hi))) if expected else set()
    assert got == expected, f"U+{lo:04X}..U+{hi:04X}: {len(got ^ expected)} byte strings differ"


def test_utf8_sequences_of_all_code_points_count_every_scalar_value_once():
    """Over 0..10FFFF the sequences hold 1,112,064 encodings (all code points minus 2048 surrogates)."""
    sequences = utf8_sequences(0, 0x10FFFF)
    total = sum(len(list(itertools.product(*(range(lo, hi + 1) for lo, hi in s)))) for s in sequences)
    assert total == 0x110000 - 0x800, f"expected 1112064 scalar values, the sequences hold {total}"


# Patterns compared with Python's re.fullmatch(pattern, text, re.ASCII): \d \w \s are ASCII in both.
PATTERNS = [
    r"-?\d+(\.\d+)?",
    r"[a-z0-9_]+@[a-z]+\.(com|org)",
    r'"[^"]*"',
    r"(ab|cd)*e?",
    r"a{2,4}b{3}c{1,}",
    r"x{,2}y{0}z?",
    r"\w+\s\W?\S\D",
    r".{0,3}é+",
    r"[^a-c\d]{1,2}z?",
    r"(?:ab|a)(?P<tail>b|)c?",
    r"[\]\-^x]+[]a]",
    r"\x41\u00e9[\x00-\x1f]?€",
    r"a|b|",
    r"^(0|[1-9][0-9]*)$",
    r"a{|{}\.[.][*]\(\)",
    r"(😀|[α-ω]){1,3}",
]
ALPHABET = "abcdexyz019_.-@\"é€😀αω \n\t{}()*[]^AZ\\\x00"


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_dfa_agrees_with_python_re(pattern):
    """On random strings and on strings drawn from the pattern itself, matches() == re.fullmatch()."""
    dfa = RegexDFA(pattern)
    python = re.compile(pattern, re.ASCII)

    @settings(max_examples=80, deadline=None, database=None)
    @given(st.one_of(st.from_regex(python, fullmatch=True), st.text(ALPHABET, max_size=10)))
    def check(text):
        expected = python.fullmatch(text) is not None
        assert dfa.matches(text) == expected, f"{pattern!r} on {text!r}: re says {expected}"

    check()


@pytest.mark.parametrize(
    "pattern, states",
    [("(a|b)*abb", 4), (r"-?\d+(\.\d+)?", 5), ("a{3}", 4), (".", 9), ("", 1), ("(yes|no)", 5)],
)
def test_dfa_is_minimal(pattern, states):
    """Known minimal sizes: the Dragon book's (a|b)*abb has 4 states; `.` needs 9 (start, end, and 7 for
    the partial UTF-8 sequences of 2-, 3- and 4-byte characters, with E0/ED/F0/F4 restricting byte 2)."""
    dfa = RegexDFA(pattern)
    assert dfa.n_states == states, f"{pattern!r}: expected a minimal DFA of {states} states, got {dfa.n_states}"


def test_dfa_runs_over_bytes_and_accepts_only_valid_utf8():
    """'é' is two bytes: after 0xC3 the DFA is live but not accepting; stray or truncated bytes are dead."""
    dfa = RegexDFA("é")
    half = dfa.step(dfa.start, 0xC3)
    assert half != DEAD and not dfa.is_accepting(half), "0xC3 begins 'é': live, not yet a match"
    assert dfa.is_accepting(dfa.step(half, 0xA9)), "0xC3 0xA9 is 'é'"
    dot = RegexDFA(".")
    assert dot.matches("é") and dot.matches("😀") and not dot.matches("\n")
    for bad in (b"\xff", b"\xc3", b"\xa9", b"\xed\xa0\x80", b"\xc0\xaf"):  # invalid, truncated, surrogate, overlong
        assert not dot.matches(bad), f"'.' must not match the invalid UTF-8 {bad!r}"


UNSUPPORTED = [
    ("a(?=b)", "lookahead", 1),
    ("(?<=a)b", "lookbehind", 0),
    ("x(?!a)", "negative lookahead", 1),
    (r"(a)\1", "backreference", 3),
    ("a^b", "anchor '^'", 1),
    ("a$b", "anchor '$'", 1),
    (r"\bfoo", "word boundary", 0),
    ("a*?", "lazy quantifier", 2),
    ("a{2}?", "lazy quantifier", 4),
    ("a*+", "possessive quantifier", 2),
    ("a**", "multiple repeat", 2),
    ("(?i)abc", "inline flags", 0),
    ("*a", "nothing to repeat", 0),
    ("(ab", "missing ')'", 3),
    ("ab)", "unbalanced parenthesis", 2),
    ("[abc", "unterminated character class", 4),
    ("[z-a]", "bad range", 2),
    (r"\q", "unknown escape", 0),
    ("a{5,2}", "min > max", 1),
    ("a{2000}", "above 1000", 1),
    ("[[:alpha:]]", "unescaped '['", 1),
    (r"\x4g", "hex digits", 0),
    ("[a&&b]", "set operation", 2),
]


@pytest.mark.parametrize("pattern, construct, position", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_syntax_raises_naming_construct_and_position(pattern, construct, position):
    with pytest.raises(ValueError, match=f"position {position}: .*" + re.escape(construct)):
        RegexDFA(pattern)


def test_pattern_matching_nothing_raises():
    with pytest.raises(ValueError, match="matches no string"):
        RegexDFA(r"a[^\s\S]")


# ====================================================================== JSON schema -> regex
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer"},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "alive"],
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "maxItems": 2,
            "items": {"type": "object", "properties": {"sku": {"enum": ["A1", "B2"]}, "price": {"type": "number"}}},
        },
        "note": {"type": "null"},
        "état": {"const": "ok"},
    },
}


def test_schema_regex_accepts_compact_and_default_json_dumps():
    """Both '{"a":1}' and json.dumps' default '{"a": 1}' match; other whitespace or shapes do not."""
    person = RegexDFA(schema_to_regex(PERSON))
    good = {"name": "Kent \"é\" \\", "age": -40, "alive": False}
    assert person.matches(json.dumps(good)) and person.matches(json.dumps(good, separators=(",", ":")))
    assert person.matches(json.dumps(good, ensure_ascii=True)), "\\u escapes are JSON characters too"
    bad = [
        {"name": "Kent", "age": 40},  # missing property
        {"age": 40, "name": "Kent", "alive": True},  # other order
        {"name": "Kent", "age": 4.5, "alive": True},  # number, not integer
        {"name": "", "age": 4, "alive": True},  # minLength
        {"name": "x" * 11, "age": 4, "alive": True},  # maxLength
    ]
    for instance in bad:
        assert not person.matches(json.dumps(instance)), f"{instance} must not match"
    assert not person.matches('{"name": "K",  "age": 4, "alive": true}'), "two spaces are outside the policy"
    order = RegexDFA(schema_to_regex(ORDER))
    for n_items in range(3):
        value = {"items": [{"sku": "B2", "price": 1.5e-3}] * n_items, "note": None, "état": "ok"}
        assert order.matches(json.dumps(value, ensure_ascii=False)), f"{value} must match"
    assert not order.matches(json.dumps({"items": [{"sku": "C3", "price": 1}], "note": None, "état": "ok"}))


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "string", "format": "date"}, "'format' at #"),
        ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}, "'minimum' at #/properties/n"),
        ({"anyOf": {"type": "string"}}, "non-empty list of schemas"),  # anyOf itself compiles (issue 28)
        ({"type": ["string", "null"]}, "lists of types"),
        ({"$ref": "#/defs/x"}, "only local references to #/$defs/NAME"),  # local $refs compile (issue 28)
        ({"type": "object", "properties": {}, "required": ["x"]}, "'required' at # names"),
        ({"type": "array"}, "needs an 'items'"),
        ({"type": "string", "minLength": 3, "maxLength": 2}, "minLength/maxLength"),
        ({"type": "integer", "enum": [1, "a"]}, "not of type 'integer'"),
    ],
)
def test_unsupported_schema_raises(schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        schema_to_regex(schema)


# ====================================================================== vocabulary bytes and the index
def test_bytes_to_unicode_is_gpt2s_byte_alphabet():
    mapping = bytes_to_unicode()
    assert len(set(mapping.values())) == 256, "expected 256 distinct symbols"
    assert mapping[ord(" ")] == "Ġ" and mapping[ord("\n")] == "Ċ" and mapping[ord("a")] == "a"


def test_vocabulary_bytes_decode_like_the_tokenizer(model_and_tokenizer, token_bytes):
    """Each token's bytes, decoded, equal tokenizer.decode([id]); special tokens have no bytes."""
    _, tokenizer = model_and_tokenizer
    assert token_bytes[0] is None and token_bytes[1] is None, "<s> and </s> are not text"
    assert {b for b in token_bytes if b is not None and len(b) == 1} == {bytes([i]) for i in range(256)}
    for token_id, data in enumerate(token_bytes):
        if data is not None:
            assert data.decode("utf-8", errors="replace") == tokenizer.decode([token_id]), f"token {token_id}"


TOY_VOCAB = [b"a", b"b", b"ab", b"ba", b"c", b"abc", b"\xc3", b"\xa9", b"\xc3\xa9", b"\xa9a", b"x", b"ca", b"cc", None]
TOY_EOS = 13  # the special token (None) at the end of TOY_VOCAB


def language(pattern: str, alphabet: str = "abcéx", max_len: int = 6) -> set[bytes]:
    """Every string of up to max_len characters of `alphabet` that fully matches (finite patterns only)."""
    return {
        "".join(w).encode("utf-8")
        for n in range(max_len + 1)
        for w in itertools.product(alphabet, repeat=n)
        if re.fullmatch(pattern, "".join(w))
    }


@pytest.mark.parametrize("pattern", ["(ab|c){0,2}é?", "a?b?c?", "[abc]{1,3}", "(a|é)b{0,2}", "é{2}|a[^b]"])
def test_index_on_toy_vocabulary_matches_brute_force(pattern):
    """Brute force without any automaton: after a byte prefix p, token t is allowed iff p + t is a prefix of
    some string of the (finite) language, and EOS iff p itself is in the language."""
    words = language(pattern)
    prefixes = {w[:i] for w in words for i in range(len(w) + 1)}
    dfa = RegexDFA(pattern)
    index = TokenIndex(dfa, TOY_VOCAB, [TOY_EOS])
    for prefix in prefixes:
        state = dfa.walk(dfa.start, prefix)
        expected = {i for i, t in enumerate(TOY_VOCAB) if t is not None and prefix + t in prefixes}
        expected |= {TOY_EOS} if prefix in words else set()
        got = set(index.allowed_ids(state).tolist())
        assert got == expected, f"{pattern!r} after {prefix!r}: allowed {sorted(got)}, brute force {sorted(expected)}"
        for token_id in expected - {TOY_EOS}:
            assert index.advance(state, token_id) == dfa.walk(state, TOY_VOCAB[token_id])


def test_mask_logits_keeps_allowed_and_sets_the_rest_to_minus_inf():
    logits = torch.randn(2, 10)
    allowed = torch.tensor([1, 4, 7])
    keep = torch.zeros(10, dtype=torch.bool)
    keep[allowed] = True
    masked = mask_logits(logits, keep)
    assert torch.equal(masked[:, keep], logits[:, keep]), "allowed logits must be unchanged"
    assert torch.isneginf(masked[:, ~keep]).all(), "every other logit must be -inf"
    assert torch.equal(mask_logits(logits, allowed), masked), "token ids and a bool mask must agree"
    assert torch.equal(mask_logits(logits[0], keep), masked[0]), "a [V] vector works too"


def test_index_mask_and_transitions_agree(token_bytes):
    """mask[state] is True exactly for next_state's tokens, plus EOS in accepting states."""
    index = TokenIndex(RegexDFA(schema_to_regex(PERSON)), token_bytes, [1])
    for state in range(index.dfa.n_states):
        expected = set(index.next_state[state]) | ({1} if index.dfa.is_accepting(state) else set())
        assert set(index.allowed_ids(state).tolist()) == expected, f"state {state}"
        assert expected, f"state {state} is live, so some token (or EOS) must be allowed"


# ====================================================================== generation
def replay(index: TokenIndex, token_ids: list[int]) -> None:
    """Assert each generated token was allowed in the state it was generated in."""
    state = index.start
    for t in token_ids:
        assert t in index.allowed_ids(state).tolist(), f"token {t} was not allowed in state {state}"
        if t not in index.eos_token_ids:
            state = index.advance(state, t)


def test_generated_json_validates_against_the_schema(model_and_tokenizer):
    """With the Shakespeare model, 30 sampled outputs for PERSON are all complete and valid under jsonschema."""
    jsonschema = pytest.importorskip("jsonschema")  # a test dependency (dev extra), not a runtime one
    model, tokenizer = model_and_tokenizer
    index = TokenIndex.from_constraint(PERSON, tokenizer)
    for seed in range(30):
        params = SamplingParams(temperature=1.0, max_tokens=96, seed=seed)
        out = generate_constrained(model, tokenizer, "KING LEAR:\n", index, params)
        assert out.complete, f"seed {seed}: incomplete after {len(out.token_ids)} tokens: {out.text!r}"
        jsonschema.validate(json.loads(out.text), PERSON)
        replay(index, out.token_ids)


def test_unbounded_numbers_can_run_out_of_tokens_and_say_so(model_and_tokenizer):
    """ORDER's numbers have no length limit, and a model that never saw JSON sometimes keeps writing digits:
    such outputs end with finish_reason "length" and complete=False. Every complete one validates."""
    jsonschema = pytest.importorskip("jsonschema")
    model, tokenizer = model_and_tokenizer
    index = TokenIndex.from_constraint(ORDER, tokenizer)
    n_complete = 0
    for seed in range(30):
        out = generate_constrained(model, tokenizer, "KING LEAR:\n", index, SamplingParams(max_tokens=128, seed=seed))
        replay(index, out.token_ids)
        if out.complete:
            n_complete += 1
            jsonschema.validate(json.loads(out.text), ORDER)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 128, f"seed {seed}: {out}"
    assert n_complete >= 25, f"expected most outputs to finish within 128 tokens, {n_complete}/30 did"


@pytest.mark.parametrize("pattern", [r"(yes|no)", r"[A-Z][a-z]{1,8}( [a-z]{1,8}){0,2}\.", r"\d{1,2}:\d{2} (am|pm)"])
def test_generated_text_fullmatches_the_regex(model_and_tokenizer, pattern):
    model, tokenizer = model_and_tokenizer
    for seed in range(4):
        out = generate_constrained(model, tokenizer, "To be", pattern, SamplingParams(max_tokens=64, seed=seed))
        assert out.complete and re.fullmatch(pattern, out.text), f"seed {seed}: {out.text!r} vs {pattern!r}"


def test_mask_overrides_a_model_that_wants_a_forbidden_token(model_and_tokenizer, token_bytes):
    """Push every token holding a newline to +1000: unconstrained greedy emits only those; under PERSON
    (a newline is neither JSON whitespace here nor allowed raw in a string) none ever appears."""
    jsonschema = pytest.importorskip("jsonschema")
    model, tokenizer = model_and_tokenizer
    forced = [i for i, data in enumerate(token_bytes) if data is not None and b"\n" in data]

    def bias(_module, _inputs, logits):
        logits[..., forced] += 1000.0
        return logits

    hook = model.lm_head.register_forward_hook(bias)
    try:
        free = minillm.generate(model, "To be", SamplingParams(temperature=0, max_tokens=4), tokenizer)
        assert set(free.token_ids) <= set(forced), "the bias should make the free model emit only forced tokens"
        index = TokenIndex.from_constraint(PERSON, tokenizer)
        out = generate_constrained(model, tokenizer, "To be", index, SamplingParams(temperature=0, max_tokens=96))
    finally:
        hook.remove()
    assert not set(out.token_ids) & set(forced), f"a forbidden token was emitted: {out.token_ids}"
    assert out.complete, f"expected a complete output, got {out.text!r}"
    jsonschema.validate(json.loads(out.text), PERSON)
    replay(index, out.token_ids)


def test_max_tokens_in_a_non_accepting_state_reports_incomplete(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    out = generate_constrained(model, tokenizer, "To be", "[a-z]{30}", SamplingParams(max_tokens=2, seed=0))
    assert (out.finish_reason, out.complete) == ("length", False), "a cut-short output must say so"
    assert len(out.token_ids) == 2


def test_accepting_state_without_continuation_stops_without_eos(model_and_tokenizer):
    """After 'yes' nothing may follow: generation ends there, no EOS sampled; '' ends before any token."""
    model, tokenizer = model_and_tokenizer
    out = generate_constrained(model, tokenizer, "To be", "yes", SamplingParams(max_tokens=8, seed=0))
    assert (out.text, out.finish_reason, out.complete) == ("yes", "stop", True)
    assert 1 not in out.token_ids, "no EOS token should be sampled when nothing else was allowed"
    empty = generate_constrained(model, tokenizer, "To be", "", SamplingParams(max_tokens=8))
    assert (empty.text, empty.token_ids, empty.complete) == ("", [], True)


def test_stop_strings_and_ignore_eos_are_refused(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="stop strings"):
        generate_constrained(model, tokenizer, "To be", "a+", SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="ignore_eos"):
        generate_constrained(model, tokenizer, "To be", "a+", SamplingParams(ignore_eos=True))


# ====================================================================== parity with outlines-core
def delayed_match_tokens(dfa: RegexDFA, index: TokenIndex, state: int) -> set[int]:
    """Tokens outlines-core 0.2.x leaves out: its DFA (regex-automata) flags a match one byte late, and its
    Index drops a token whose last byte is read right after a full match (accepting after all bytes but the
    last) unless the whole token also ends in a match. Example: after '1' in -?(0|[1-9][0-9]*)(\\.[0-9]+)?,
    the token '.' is dropped although '1.5' matches."""
    return {
        t for t, end in index.next_state[state].items()
        if dfa.is_accepting(dfa.walk(state, index.token_bytes[t][:-1])) and not dfa.is_accepting(end)
    }


PERSON_SMALL = {
    "type": "object",
    "properties": {
        "n": {"type": "string", "maxLength": 6},
        "k": {"type": "integer"},
        "t": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
}
PARITY_PATTERNS = [
    r"[a-z]+",
    r"(true|false|null)",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    r"[A-Z][a-z]{2,5} [0-9]{1,3}",
    r'"([^"\\]|\\["\\/bfnrt])*"',
    r"(ab|cd)*e?",
    r".{0,6}",
    r"[^a-z]{1,3}x",
    r"é+|ü?[0-9]",
    schema_to_regex(PERSON_SMALL),
]


@pytest.fixture(scope="module")
def outlines_vocabulary(token_bytes):
    outlines_core = pytest.importorskip("outlines_core")
    by_bytes: dict[bytes, list[int]] = {}
    for token_id, data in enumerate(token_bytes):
        if data is not None:
            by_bytes.setdefault(data, []).append(token_id)
    return outlines_core.Vocabulary(1, by_bytes)  # raw bytes: outlines-core walks them as we do


@pytest.mark.parametrize("pattern", [*PARITY_PATTERNS, "outlines-schema-regex"])
def test_index_matches_outlines_core_along_random_walks(pattern, token_bytes, outlines_vocabulary):
    """Walk the same random token sequences in both indexes; in every state reached, outlines-core's allowed
    set must equal ours minus the delayed-match tokens (usually none), and final states must agree.
    "outlines-schema-regex" is outlines-core's own regex for PERSON_SMALL, parsed by our compiler."""
    outlines_core = pytest.importorskip("outlines_core")
    if pattern == "outlines-schema-regex":
        pattern = outlines_core.json_schema.build_regex_from_schema(json.dumps(PERSON_SMALL))
    dfa = RegexDFA(pattern)
    ours = TokenIndex(dfa, token_bytes, [1])
    theirs = outlines_core.Index(pattern, outlines_vocabulary)
    rng = random.Random(0)
    for _ in range(6):
        state, their_state = dfa.start, theirs.get_initial_state()
        for _ in range(40):
            allowed = set(ours.allowed_ids(state).tolist())
            their_allowed = set(theirs.get_allowed_tokens(their_state))
            expected = allowed - delayed_match_tokens(dfa, ours, state)
            assert their_allowed == expected, (
                f"{pattern!r}: outlines-core allows {len(their_allowed)} tokens, we {len(allowed)}; "
                f"only theirs {sorted(their_allowed - expected)[:8]}, only ours {sorted(expected - their_allowed)[:8]}"
            )
            assert dfa.is_accepting(state) == theirs.is_final_state(their_state)
            choices = sorted(their_allowed - {1})
            if not choices:
                break
            token = rng.choice(choices)
            state, their_state = ours.advance(state, token), theirs.get_next_state(their_state, token)


def test_outlines_core_differences_are_the_documented_ones(token_bytes, outlines_vocabulary):
    """Three known differences, each pinned here so a change in either library is noticed."""
    outlines_core = pytest.importorskip("outlines_core")
    vocab_ids = {data: i for i, data in enumerate(token_bytes) if data is not None}

    def both(pattern: str, prefix: bytes) -> tuple[set[int], set[int]]:
        dfa = RegexDFA(pattern)
        ours, theirs = TokenIndex(dfa, token_bytes, [1]), outlines_core.Index(pattern, outlines_vocabulary)
        state, their_state = dfa.start, theirs.get_initial_state()
        for byte in prefix:
            token = vocab_ids[bytes([byte])]
            state, their_state = ours.advance(state, token), theirs.get_next_state(their_state, token)
        return set(ours.allowed_ids(state).tolist()), set(theirs.get_allowed_tokens(their_state))

    # 1. The delayed match: after "1", "." starts the optional fraction; outlines-core 0.2.14 drops it.
    ours, theirs = both(r"[0-9]+(\.[0-9]+)?", b"1")
    assert vocab_ids[b"."] in ours and ours - theirs == {vocab_ids[b"."]}
    # 2. Leftmost-first alternation: for a|ab outlines-core's DFA stops at the first option, so "ab" is unreachable.
    ours, theirs = both("a|ab", b"")
    assert vocab_ids[b"ab"] in ours and vocab_ids[b"ab"] not in theirs
    # 3. Rust's \d is Unicode (e.g. Arabic-Indic digits, lead byte 0xD9); ours is ASCII like re.ASCII.
    ours, theirs = both(r"\d", b"")
    assert vocab_ids[b"\xd9"] in theirs - ours
