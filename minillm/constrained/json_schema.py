"""JSON schema -> regular expression: `schema_to_regex` (chapter 01).

Without $ref recursion, a JSON schema describes a regular language, so a schema becomes a pattern
like any other and is compiled the same way (`minillm.constrained.automata.RegexDFA`).
"""

from __future__ import annotations

import json

# Whitespace policy: no whitespace anywhere except one optional space after ':' and after ',' --
# so both compact JSON and json.dumps' default output ('{"a": 1, "b": [1, 2]}') match.
COLON, COMMA = ": ?", ", ?"
_UNESCAPED_CHAR = r'[^"\\\x00-\x1f]'  # any character but a quote, a backslash or a control character
_ESCAPED_CHAR = r'\\["\\/bfnrt]|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})'  # no surrogates
STRING_CHAR = f"(?:{_UNESCAPED_CHAR}|{_ESCAPED_CHAR})"  # exactly one character of the decoded string
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_SCALARS = {"boolean": "(?:true|false)", "null": "null", "integer": INTEGER, "number": NUMBER}

_ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "examples", "default"}
_KEYWORDS = {  # what each type accepts besides "type" and the annotations
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
    "string": {"minLength", "maxLength"},
    "integer": set(), "number": set(), "boolean": set(), "null": set(),
}
_PY_TYPES = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float),
             "boolean": bool, "null": type(None)}


def escape_regex(text: str) -> str:
    """A regex matching `text` literally (escapes only the metacharacters, so other engines agree)."""
    return "".join("\\" + c if c in ".^$|?*+()[]{}\\" else c for c in text)


def schema_to_regex(schema: dict | str) -> str:
    """A JSON schema (dict or JSON text) -> a regular expression matching the JSON texts it allows.

    Supported subset: "type" object (every listed property is written, in the order given, whether
    `required` names it or not; no other properties), array ("items" one schema, "minItems",
    "maxItems"), string ("minLength", "maxLength", counted in characters), integer, number, boolean,
    null; "enum" and "const" of any JSON values; nesting. Whitespace: one optional space after ':' and
    ',' only. Anything else (pattern, format, minimum, $ref, anyOf, a list of types...) raises
    ValueError naming the keyword and where it is.

    Example:
        >>> schema_to_regex({"type": "object", "properties": {"ok": {"type": "boolean"}}})
        '\\\\{"ok": ?(?:true|false)\\\\}'
    """
    if isinstance(schema, str):
        schema = json.loads(schema)
    return _value_regex(schema, "#")


def _value_regex(schema: dict, path: str) -> str:
    if not isinstance(schema, dict):
        raise ValueError(f"the schema at {path} must be a JSON object, got {schema!r}.")
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
        return _object_regex(schema, path)
    if kind == "array":
        return _array_regex(schema, path)
    if kind == "string":
        lo, hi = _bounds(schema, "minLength", "maxLength", path)
        return f'"{STRING_CHAR}{_quantifier(lo, hi)}"'
    return _SCALARS[kind]


def _object_regex(schema: dict, path: str) -> str:
    properties = schema.get("properties", {})
    missing = set(schema.get("required", [])) - set(properties)
    if missing:
        raise ValueError(f"'required' at {path} names {sorted(missing)}, which 'properties' does not define.")
    if not isinstance(schema.get("additionalProperties", False), bool):
        raise ValueError(f"'additionalProperties' at {path} must be true or false (no extra properties are written).")
    members = [
        escape_regex(json.dumps(name, ensure_ascii=False)) + COLON + _value_regex(sub, f"{path}/properties/{name}")
        for name, sub in properties.items()
    ]
    return r"\{" + COMMA.join(members) + r"\}"


def _array_regex(schema: dict, path: str) -> str:
    if "items" not in schema:
        raise ValueError(f"the array at {path} needs an 'items' schema.")
    lo, hi = _bounds(schema, "minItems", "maxItems", path)
    if hi == 0:
        return r"\[\]"
    item = _value_regex(schema["items"], f"{path}/items")
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
    if not isinstance(lo, int) or lo < 0 or hi is not None and (not isinstance(hi, int) or hi < lo):
        raise ValueError(f"{lo_key}/{hi_key} at {path} must be integers with 0 <= {lo_key} <= {hi_key}.")
    return lo, hi


def _quantifier(lo: int, hi: int | None) -> str:
    if hi is None:
        return "*" if lo == 0 else f"{{{lo},}}"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"
