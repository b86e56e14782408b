"""JSON schema -> regular expression: `schema_to_regex` (chapter 01).

Without $ref recursion, a JSON schema describes a regular language, so a schema becomes a pattern
like any other and is compiled the same way (`minillm.sampler.constrained.automata.RegexDFA`). A recursive
schema (a tree, a linked list) describes nesting without bound, which no regular expression can: it is
refused, with the $ref that closes the loop named.
"""

from __future__ import annotations

import json
from collections.abc import Callable

# Whitespace policy: no whitespace anywhere except one optional space after ':' and after ',' --
# so both compact JSON and json.dumps' default output ('{"a": 1, "b": [1, 2]}') match.
COLON, COMMA = ": ?", ", ?"
_UNESCAPED_CHAR = r'[^"\\\x00-\x1f]'  # any character but a quote, a backslash or a control character
_ESCAPED_CHAR = r'\\["\\/bfnrt]|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})'  # no surrogates
STRING_CHAR = f"(?:{_UNESCAPED_CHAR}|{_ESCAPED_CHAR})"  # exactly one character of the decoded string
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_SCALARS = {"boolean": "(?:true|false)", "null": "null", "integer": INTEGER, "number": NUMBER}

_ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "examples", "default", "$defs", "definitions"}
_KEYWORDS = {  # what each type accepts besides "type" and the annotations
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
    "string": {"minLength", "maxLength", "pattern"},
    "integer": set(), "number": set(), "boolean": set(), "null": set(),
}
_PY_TYPES = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float),
             "boolean": bool, "null": type(None)}


JSON_OBJECT_DEPTH = 4  # json_object_regex: objects and arrays nested at most this deep (a regex cannot nest freely)


def json_object_regex(depth: int = JSON_OBJECT_DEPTH) -> str:
    """A regex for any JSON object whose objects and arrays nest at most `depth` levels (the object itself is
    level 1): OpenAI's `response_format: {"type": "json_object"}`. JSON nests without bound, which no regular
    expression can describe, so the depth is capped; 4 levels compile to a DFA of 663 states in about 1.6 s."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}.")
    string = f'"{STRING_CHAR}*"'
    scalar = f"(?:{string}|{NUMBER}|true|false|null)"

    def obj(value: str) -> str:
        member = f"{string}{COLON}{value}"
        return r"\{" + f"(?:{member}(?:{COMMA}{member})*)?" + r"\}"

    def arr(value: str) -> str:
        return r"\[" + f"(?:{value}(?:{COMMA}{value})*)?" + r"\]"

    value = scalar
    for _ in range(depth - 1):
        value = f"(?:{scalar}|{obj(value)}|{arr(value)})"
    return obj(value)


def escape_regex(text: str) -> str:
    """A regex matching `text` literally (escapes only the metacharacters, so other engines agree)."""
    return "".join("\\" + c if c in ".^$|?*+()[]{}\\" else c for c in text)


def schema_to_regex(schema: dict | str) -> str:
    """A JSON schema (dict or JSON text) -> a regular expression matching the JSON texts it allows.

    Supported subset: "type" object (every listed property is written, in the order given, whether
    `required` names it or not; no other properties), array ("items" one schema, "minItems",
    "maxItems"), string ("minLength", "maxLength", counted in characters, or "pattern", a regex for the
    string's content, as outlines-core reads it), integer, number, boolean, null; "enum" and "const" of
    any JSON values; "anyOf" and "oneOf" (any one of the schemas: oneOf's "exactly one" is not checked,
    as in outlines-core); "$ref" to the schema's own "$defs" or "definitions" (not recursive); nesting up
    to MAX_DEPTH levels. Whitespace: one optional space after ':' and ',' only. Anything else (format,
    minimum, a list of types, allOf...) raises ValueError naming the keyword and where it is.

    Example:
        >>> schema_to_regex({"type": "object", "properties": {"ok": {"type": "boolean"}}})
        '\\\\{"ok": ?(?:true|false)\\\\}'
    """
    if isinstance(schema, str):
        schema = json.loads(schema)
    return _Translator(schema).value(schema, "#", ())


MAX_DEPTH = 32  # schemas nested within schemas (each level is a call of _Translator.value)


class _Translator:
    """Walks one schema, with its root at hand for "$ref"; each call of `value` is one nesting level."""

    def __init__(self, root: dict) -> None:
        self.root = root

    def value(self, schema: dict, path: str, refs: tuple[str, ...]) -> str:
        """The regex of `schema` at `path`; refs: the $refs being expanded around it (a loop = recursion)."""
        if path.count("/") > MAX_DEPTH * 2 or len(refs) > MAX_DEPTH:
            raise ValueError(f"the schema nests deeper than {MAX_DEPTH} levels at {path[:80]}...: flatten it.")
        if not isinstance(schema, dict):
            raise ValueError(f"the schema at {path} must be a JSON object, got {schema!r}.")
        if "$ref" in schema:
            return self.ref(schema, path, refs)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.any_of(schema, key, path, refs)
        if "allOf" in schema or "not" in schema or "if" in schema:
            what = next(k for k in ("allOf", "not", "if") if k in schema)
            raise ValueError(f"keyword {what!r} at {path} is not supported (supported combinators: anyOf, oneOf).")
        return _value_regex(schema, path, lambda sub, where: self.value(sub, where, refs))

    def ref(self, schema: dict, path: str, refs: tuple[str, ...]) -> str:
        target = schema["$ref"]
        extra = set(schema) - {"$ref"} - _ANNOTATIONS
        if extra:
            raise ValueError(f"'$ref' at {path} has sibling keyword(s) {sorted(extra)}; put them in the target.")
        if not isinstance(target, str) or not target.startswith(("#/$defs/", "#/definitions/")):
            raise ValueError(f"'$ref' {target!r} at {path}: only local references to #/$defs/NAME or "
                             "#/definitions/NAME are supported.")
        if target in refs:
            raise ValueError(f"'$ref' {target!r} at {path} refers back into itself: a recursive schema allows "
                             "unbounded nesting, which no regular expression can describe. Write out the levels "
                             "you need instead.")
        section, name = target[2:].split("/", 1)
        definitions = self.root.get(section)
        if not isinstance(definitions, dict) or name not in definitions:
            raise ValueError(f"'$ref' {target!r} at {path} names no definition: the schema has no {section}/{name}.")
        return self.value(definitions[name], target, (*refs, target))

    def any_of(self, schema: dict, key: str, path: str, refs: tuple[str, ...]) -> str:
        options = schema[key]
        extra = set(schema) - {key} - _ANNOTATIONS
        if extra:
            raise ValueError(f"'{key}' at {path} has sibling keyword(s) {sorted(extra)}; move them into each option.")
        if not isinstance(options, list) or not options:
            raise ValueError(f"'{key}' at {path} must be a non-empty list of schemas, got {options!r}.")
        return "(?:" + "|".join(self.value(o, f"{path}/{key}/{i}", refs) for i, o in enumerate(options)) + ")"


def _value_regex(schema: dict, path: str, sub: Callable[[dict, str], str]) -> str:
    """The regex of one schema with a "type" (or "enum"/"const"); sub(schema, path) translates the schemas
    inside it (properties, items)."""
    if "enum" in schema or "const" in schema:
        return _enum_regex(schema, path)
    kind = schema.get("type")
    if not isinstance(kind, str) or kind not in _KEYWORDS:
        raise ValueError(
            f"the schema at {path} needs a 'type' among {sorted(_KEYWORDS)} (or 'enum'/'const'), got {kind!r}; "
            "lists of types are not supported."
        )
    unknown = set(schema) - _KEYWORDS[kind] - _ANNOTATIONS - {"type"}
    if unknown:
        raise ValueError(
            f"keyword {sorted(unknown)[0]!r} at {path} is not supported for type {kind!r} "
            f"(supported: {sorted(_KEYWORDS[kind]) or 'none'})."
        )
    if kind == "object":
        return _object_regex(schema, path, sub)
    if kind == "array":
        return _array_regex(schema, path, sub)
    if kind == "string":
        if "pattern" in schema:
            return _pattern_regex(schema, path)
        lo, hi = _bounds(schema, "minLength", "maxLength", path)
        return f'"{STRING_CHAR}{_quantifier(lo, hi)}"'
    return _SCALARS[kind]


def _pattern_regex(schema: dict, path: str) -> str:
    """A string whose content matches `pattern` (anchors ^ and $ implied, as outlines-core reads it)."""
    pattern = schema["pattern"]
    if not isinstance(pattern, str):
        raise ValueError(f"'pattern' at {path} must be a string (a regular expression), got {pattern!r}.")
    if "minLength" in schema or "maxLength" in schema:
        raise ValueError(f"'pattern' at {path} with minLength/maxLength is not supported: put the length in the "
                         "pattern, e.g. [a-z]{2,8}.")
    inner = pattern[1:] if pattern.startswith("^") else pattern
    inner = inner[:-1] if inner.endswith("$") and not inner.endswith("\\$") else inner
    return f'"(?:{inner})"'


def _object_regex(schema: dict, path: str, sub: Callable[[dict, str], str]) -> str:
    properties = schema.get("properties", {})
    missing = set(schema.get("required", [])) - set(properties)
    if missing:
        raise ValueError(f"'required' at {path} names {sorted(missing)}, which 'properties' does not define.")
    if not isinstance(schema.get("additionalProperties", False), bool):
        raise ValueError(f"'additionalProperties' at {path} must be true or false (no extra properties are written).")
    members = [
        escape_regex(json.dumps(name, ensure_ascii=False)) + COLON + sub(member, f"{path}/properties/{name}")
        for name, member in properties.items()
    ]
    return r"\{" + COMMA.join(members) + r"\}"


def _array_regex(schema: dict, path: str, sub: Callable[[dict, str], str]) -> str:
    if "items" not in schema:
        raise ValueError(f"the array at {path} needs an 'items' schema.")
    lo, hi = _bounds(schema, "minItems", "maxItems", path)
    if hi == 0:
        return r"\[\]"
    item = sub(schema["items"], f"{path}/items")
    body = f"{item}(?:{COMMA}{item}){_quantifier(max(lo - 1, 0), None if hi is None else hi - 1)}"
    return r"\[" + (body if lo > 0 else f"(?:{body})?") + r"\]"


def _enum_regex(schema: dict, path: str) -> str:
    values = schema["enum"] if "enum" in schema else [schema["const"]]
    extra = set(schema) - {"enum", "const", "type"} - _ANNOTATIONS
    if extra or not isinstance(values, list) or not values:
        raise ValueError(f"'enum'/'const' at {path}: needs a non-empty list and no keyword besides 'type'.")
    kind = schema.get("type")
    for v in values:
        if kind is not None and not _has_type(v, kind):
            raise ValueError(f"enum value {v!r} at {path} is not of type {kind!r}.")
    literals = [escape_regex(json.dumps(v, ensure_ascii=False)) for v in values]
    return "(?:" + "|".join(literals) + ")"


def _has_type(value: object, kind: str) -> bool:
    if kind not in _PY_TYPES:
        return False
    if isinstance(value, bool) and kind not in ("boolean",):
        return False
    return isinstance(value, _PY_TYPES[kind])


def _bounds(schema: dict, lo_key: str, hi_key: str, path: str) -> tuple[int, int | None]:
    lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
    if not _is_count(lo) or hi is not None and (not _is_count(hi) or hi < lo):
        raise ValueError(f"{lo_key}/{hi_key} at {path} must be integers with 0 <= {lo_key} <= {hi_key}, got "
                         f"{lo!r} and {hi!r}.")
    return lo, hi


def _is_count(value: object) -> bool:
    """An int >= 0, and not a bool: True is an int in Python, not in JSON schema."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _quantifier(lo: int, hi: int | None) -> str:
    if hi is None:
        return "*" if lo == 0 else f"{{{lo},}}"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"
