"""Constrained decoding has a bounded cost for any pattern, and the JSON-schema keywords users send (issue 28).

At c2e1d62 `(x{1,1000}){1,1000}` ran past 120 s and 5.6 GB, `[^x]{1000}` took 54 s, 200 nested groups or a
self-referential schema raised RecursionError, `maxLength: true` built a pattern for the text "a{0,True}", and
`anyOf`, `oneOf`, `$ref` and `pattern` were refused. Now the construction budget (automaton states and work, not
seconds: issue 55) is enforced while the automaton is built, with an error that names the part or the limit;
nesting is bounded with a clear error; keywords are type-checked; and the combinators and local references
compile, checked against outlines-core's own regex for the same schema.
"""

from __future__ import annotations

import itertools
import json
import re
import time

import pytest

from minillm.sampler.constrained import RegexDFA, automata, json_object_regex, schema_to_regex


def test_a_repeat_past_the_budget_is_refused_before_it_is_built_naming_the_repeat():
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"a repeat \{1,1000\} of a part that takes 2,001 automaton states"):
        RegexDFA("(x{1,1000}){1,1000}")
    assert time.perf_counter() - start < 5, "refused from the size of one copy, not after building them all"


def test_the_budget_counts_work_not_seconds(monkeypatch):
    """The budget was 10 s of wall clock, so json_object could fail to compile on a loaded machine. With the clock
    jumping an hour at every reading, json_object compiles, well inside the budget, and `[^x]{1000}` (266 M cells
    to minimise) is refused by the work it would take, whatever the clock says."""
    clock = itertools.count(start=time.perf_counter(), step=3600.0)
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    dfa = RegexDFA(json_object_regex())
    assert dfa.matches('{"a": [1, {"b": null}], "c": "d"}') and not dfa.matches('{"a": }')
    assert 4 * dfa.work.refine_cells < automata.MAX_REFINE_CELLS, dfa.work  # 6.0 M of 30 M
    assert 10 * dfa.work.subset_steps < automata.MAX_SUBSET_STEPS, dfa.work  # 0.87 M of 10 M
    monkeypatch.setattr(automata, "MAX_REFINE_CELLS", 2_000_000)  # the same refusal, 15x sooner
    with pytest.raises(ValueError, match=r"too large to compile: minimising its DFA passed 2,000,000 table cells "
                                         r"\(19,001 states, 7 rounds .*Simplify the pattern or the schema"):
        RegexDFA("[^x]{1000}")


def test_the_subset_construction_has_a_work_budget_too(monkeypatch):
    """(a|b)*a(a|b){12} is a pattern of 83 NFA states whose DFA remembers the last 13 letters: 8,193 states, and
    0.74 M steps to find them. Under a lower budget it is refused, saying the limit; a small pattern is not. The
    states of the DFA are a limit of their own."""
    with pytest.raises(ValueError, match=r"its DFA passes 20,000 states .* Simplify the pattern or the schema"):
        RegexDFA(json_object_regex(5))  # 51,185 states before minimising
    monkeypatch.setattr(automata, "MAX_SUBSET_STEPS", 100_000)
    with pytest.raises(ValueError, match=r"the subset construction passed 100,000 steps \([\d,]+ DFA states so far\)"
                                         r"\. Simplify the pattern or the schema"):
        RegexDFA("(a|b)*a(a|b){12}")
    assert RegexDFA("[^x]{3}").matches("abc"), "a small pattern is unaffected"


def test_deep_nesting_is_a_clear_error_not_a_recursion_error():
    with pytest.raises(ValueError, match="groups nest more than 50 deep"):
        RegexDFA("(" * 200 + "a" + ")" * 200)
    assert RegexDFA("(" * 40 + "a" + ")" * 40).matches("a")
    deep: dict = {"type": "integer"}
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nests deeper than 32 levels"):
        schema_to_regex(deep)


def test_a_recursive_schema_is_refused_naming_the_ref():
    tree = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items":
                                                                         {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    with pytest.raises(ValueError, match=r"'\$ref' '#/\$defs/node' .* refers back into itself"):
        schema_to_regex(tree)


@pytest.mark.parametrize("schema, says", [
    ({"type": "string", "maxLength": True}, "maxLength"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": True}, "minItems"),
    ({"type": "string", "minLength": 2.5}, "minLength"),
    ({"type": "integer", "minimum": 3}, "'minimum'"),
    ({"allOf": [{"type": "integer"}]}, "'allOf'"),
    ({"$ref": "https://example.com/s.json"}, "only local references"),
    ({"$ref": "#/$defs/missing"}, "names no definition"),
    ({"anyOf": []}, "non-empty list"),
    ({"type": "string", "pattern": 5}, "'pattern'"),
])
def test_keywords_of_the_wrong_kind_or_unsupported_are_refused_by_name(schema, says):
    with pytest.raises(ValueError, match=re.escape(says) if "'" in says else says):
        schema_to_regex(schema)


# Schemas with the keywords users send (function calling, JSON mode), every property required (outlines-core
# makes the others optional; minillm writes every listed property), and texts each must accept or refuse.
SCHEMAS = {
    "anyOf": ({"type": "object", "properties": {"id": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
               "required": ["id"]},
              ['{"id":7}', '{"id":"x7"}'], ['{"id":true}', '{"id":7.5}']),
    "oneOf, const": ({"oneOf": [{"const": "yes"}, {"const": "no"}, {"type": "null"}]},
                     ['"yes"', '"no"', "null"], ['"maybe"', "true"]),
    "$ref to $defs": ({"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                            "y": {"type": "integer"}},
                                           "required": ["x", "y"]}},
                       "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
                       "required": ["a", "b"]},
                      ['{"a":{"x":1,"y":2},"b":{"x":-3,"y":0}}'], ['{"a":{"x":1},"b":{"x":1,"y":2}}']),
    "pattern": ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                 "required": ["code"]},
                ['{"code":"ABC-12"}'], ['{"code":"AB-12"}', '{"code":"abc-12"}']),
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_combinators_refs_and_patterns_accept_what_outlines_core_accepts(name):
    schema, good, bad = SCHEMAS[name]
    ours = RegexDFA(schema_to_regex(schema))
    for text in good:
        assert ours.matches(text), f"{name}: should accept {text}"
    for text in bad:
        assert not ours.matches(text), f"{name}: should refuse {text}"
    outlines_core = pytest.importorskip("outlines_core")
    theirs = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
    for text in good + bad:
        assert ours.matches(text) == bool(re.fullmatch(theirs, text)), f"{name}: outlines-core disagrees on {text}"


def test_json_object_regex_takes_json_objects_nested_up_to_its_depth():
    import json

    from minillm.sampler.constrained import json_object_regex

    dfa = RegexDFA(json_object_regex(depth=3))
    good = [{}, {"a": 1}, {"a": [1, "x", None], "b": {"c": True}}, {"k": {"l": [1, 2]}}, {"s": 'é " q'}]
    for value in good:
        for text in (json.dumps(value), json.dumps(value, separators=(",", ":"))):
            assert dfa.matches(text), text
    for text in ['[1]', '"a"', '{"a": 1,}', '{a: 1}', json.dumps({"a": {"b": {"c": {"d": 1}}}})]:
        assert not dfa.matches(text), f"{text}: not an object, not JSON, or nested past depth 3"
    with pytest.raises(ValueError, match="depth"):
        json_object_regex(0)


def test_an_index_too_large_for_memory_is_refused_before_it_is_built(monkeypatch):
    """A small pattern can have many states ((a|b)*a(a|b){k}: 2^(k+1)), and the token index holds states x vocabulary
    cells: past MAX_INDEX_CELLS it is refused with the numbers, before the walk allocates them; json_object's
    automaton fits it even over a 128k-token vocabulary."""
    from minillm.sampler.constrained import token_index
    from minillm.sampler.constrained.json_schema import json_object_regex
    from minillm.sampler.constrained.token_index import MAX_INDEX_CELLS, TokenIndex

    dfa = RegexDFA("(a|b)*a(a|b){9}")  # 1,024 states
    assert dfa.n_states == 1024
    vocab = [bytes([c]) for c in range(256)]
    monkeypatch.setattr(token_index, "MAX_INDEX_CELLS", 1024 * 256 - 1)
    with pytest.raises(ValueError, match=r"1,024 states.*262,144 cells, past the budget of 262,143.*Simplify"):
        TokenIndex(dfa, vocab, [0])
    monkeypatch.setattr(token_index, "MAX_INDEX_CELLS", 1024 * 256)
    assert TokenIndex(dfa, vocab, [0]).mask.shape == (1024, 256)
    assert RegexDFA(json_object_regex()).n_states * 128_256 <= MAX_INDEX_CELLS
