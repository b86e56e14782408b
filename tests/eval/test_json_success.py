"""The gate's JSON metric (`json_success`: does a greedy answer parse, and match its schema?) and the needle prompts
of `minillm.eval.long_context` (chapter 09)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from jsonschema import Draft202012Validator

import minillm
from minillm.eval import Task, compare, json_success, load_task
from minillm.eval.long_context import NEEDLE_ANSWER_PREFIX, NEEDLE_SENTENCE, needle_prompts
from minillm.eval.tasks import parse_json_object

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


class CannedLLM:
    """Answers each conversation with the next canned text; records what it was asked."""

    def __init__(self, answers: list[str]) -> None:
        self.answers, self.asked = answers, []

    def chat(self, conversations, params, use_tqdm=False):  # noqa: ANN001
        self.asked.append((conversations, params))
        return [SimpleNamespace(text=a) for a in self.answers]


def test_parse_json_object_takes_the_first_object_and_forgives_fences_and_words_around_it():
    assert parse_json_object('{"a": 1}') == {"a": 1}
    assert parse_json_object('Sure! ```json\n{"a": [1, 2]}\n``` Hope that helps.') == {"a": [1, 2]}
    assert parse_json_object('{"a": 1} {"b": 2}') == {"a": 1}
    assert parse_json_object('{"a": 1') is None, "an object cut before it closes does not parse"
    assert parse_json_object("no braces here") is None
    assert parse_json_object("[1, 2]") is None, "a list is not an object"


def test_json_success_counts_parsed_answers_and_schema_matches_separately():
    task = Task("t", "json_schema", [{"context": f"question {i}", "schema": SCHEMA} for i in range(4)])
    answers = ['{"name": "Ann", "age": 3}',  # valid, matches
               '{"name": "Ann", "age": "3"}',  # valid JSON, wrong type
               '{"name": "Ann"',  # cut off: not JSON
               'Here: {"name": "Bo", "age": 40, "city": "Oslo"}']  # valid, an extra key the schema forbids
    llm = CannedLLM(answers)
    scores = json_success(llm, task, max_tokens=7)
    assert scores["json_valid"] == pytest.approx(3 / 4)
    assert scores["schema_match"] == pytest.approx(1 / 4)
    assert scores["docs"] == 4 and scores["schema_match_stderr"] > 0
    (conversations, params), = llm.asked
    assert conversations[1] == [{"role": "user", "content": "question 1"}]
    assert params.temperature == 0.0 and params.max_tokens == 7


def test_json_success_refuses_other_tasks_and_bad_schemas():
    with pytest.raises(ValueError, match="not a JSON task"):
        json_success(CannedLLM([]), load_task("next_line"))
    bad = Task("t", "json_schema", [{"context": "q", "schema": {"type": 12}}])
    with pytest.raises(Exception, match="12"):
        Draft202012Validator.check_schema(bad.docs[0]["schema"])


def test_the_books_json_task_loads_with_valid_schemas_that_require_every_key():
    task = load_task("json_objects")
    assert task.kind == "json_schema" and len(task.docs) >= 20
    for doc in task.docs:
        Draft202012Validator.check_schema(doc["schema"])
        assert set(doc["schema"]["required"]) == set(doc["schema"]["properties"])
        for key in doc["schema"]["properties"]:
            assert f'"{key}"' in doc["context"], f"the prompt must name the key {key!r} it asks for"


def test_the_gate_fails_a_drop_in_schema_match_beyond_its_noise():
    base = {"results": {"json_objects": {"json_valid": 0.9, "json_valid_stderr": 0.02, "schema_match": 0.8,
                                         "schema_match_stderr": 0.03}}}
    small = {"results": {"json_objects": {"json_valid": 0.9, "json_valid_stderr": 0.02, "schema_match": 0.75,
                                          "schema_match_stderr": 0.03}}}
    large = {"results": {"json_objects": {"json_valid": 0.9, "json_valid_stderr": 0.02, "schema_match": 0.6,
                                          "schema_match_stderr": 0.03}}}
    assert not any(r.failed for r in compare(small, base)), "0.05 is within 2 standard errors (0.06)"
    failed = [(r.task, r.metric) for r in compare(large, base) if r.failed]
    assert failed == [("json_objects", "schema_match")]


def test_needle_prompts_hide_one_number_at_the_asked_depth():
    _, tok = minillm.load(minillm.DEFAULT_MODEL)
    haystack = "\n".join(f"line {i} of the filler text" for i in range(400))
    prompts = needle_prompts(tok, haystack, [128, 256], [0.0, 1.0], seed=3)
    assert [(p["length"], p["depth"]) for p in prompts] == [(128, 0.0), (128, 1.0), (256, 0.0), (256, 1.0)]
    for p in prompts:
        needle = NEEDLE_SENTENCE.format(number=p["number"])
        assert p["context"].count(p["number"]) == 1 and needle in p["context"]
        assert p["context"].endswith(NEEDLE_ANSWER_PREFIX) and p["continuation"] == " " + p["number"]
        body = p["context"].split(needle)
        before = body[0].count("line ")
        assert before == 0 if p["depth"] == 0.0 else body[1].count("line ") == 0, "depth 1: after the last line"
        assert p["length"] // 2 <= len(tok.encode(p["context"])) <= p["length"] + 80
    assert len({p["number"] for p in prompts}) == 4
    with pytest.raises(ValueError, match="too few"):
        needle_prompts(tok, "one short line", [512], [0.5])
    with pytest.raises(ValueError, match="depth"):
        needle_prompts(tok, haystack, [128], [1.5])
