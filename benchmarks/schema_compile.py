"""Compile time of JSON schemas, minillm against outlines-core, on the shapes real requests send (chapter 01).

A structured-output request pays once for its schema: schema -> regex -> DFA -> the token index (every
vocabulary token walked from every state). This script times that on a suite of schemas in the shapes of
function-calling arguments and JSON-mode replies (enums, nested objects, arrays, anyOf, $ref, pattern), over
the shipped model's vocabulary, for minillm (`schema_to_regex`, `RegexDFA`, `TokenIndex`) and for
outlines-core (`build_regex_from_schema`, `Index`) in the same run. Every property is required, so both write
the same objects (outlines-core makes the others optional).

    python benchmarks/schema_compile.py        # writes results/schema_compile/cpu.json

Medians of --repeats runs; a shared CPU is noisy, so compare numbers from one run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json

from common import write_results

import minillm
from minillm.book.notebook import median_time  # one definition, shared with the chapters (as common.py)
from minillm.sampler.constrained import RegexDFA, TokenIndex, schema_to_regex, vocabulary_bytes


def required(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties)}


SCHEMAS = {
    "weather tool call": required({"location": {"type": "string", "maxLength": 40},
                                   "unit": {"enum": ["celsius", "fahrenheit"]},
                                   "days": {"type": "integer"}}),
    "person with enums": required({"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                   "role": {"enum": ["admin", "editor", "viewer"]}, "active": {"type": "boolean"}}),
    "order with items": required({"id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                                  "items": {"type": "array", "maxItems": 5, "items": required(
                                      {"sku": {"type": "string", "maxLength": 12},
                                       "qty": {"type": "integer"}})}}),
    "nested address": required({"name": {"type": "string", "maxLength": 20}, "address": required(
        {"street": {"type": "string", "maxLength": 30}, "city": {"type": "string", "maxLength": 20},
         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    "anyOf id": required({"id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 16}]},
                          "note": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]}}),
    "$ref to $defs": {"$defs": {"point": required({"x": {"type": "number"}, "y": {"type": "number"}})},
                      **required({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=minillm.DEFAULT_MODEL, help="the shipped model whose vocabulary is used")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = minillm.load(args.model)
    token_bytes = vocabulary_bytes(tokenizer)
    eos = set(model.config.eos_token_ids) | set(tokenizer.eos_token_ids)
    try:
        import outlines_core
    except ImportError:
        outlines_core = None
    if outlines_core is not None:
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(token_bytes):
            if data is not None:
                by_bytes.setdefault(data, []).append(token_id)
        vocabulary = outlines_core.Vocabulary(min(eos), by_bytes)
    rows = []
    for name, schema in SCHEMAS.items():
        pattern = schema_to_regex(schema)
        dfa = RegexDFA(pattern)
        row = {"schema": name, "dfa_states": dfa.n_states,
               "minillm_s": median_time(
                   lambda s=schema: TokenIndex(RegexDFA(schema_to_regex(s)), token_bytes, eos), args.repeats,
                   warmup=0)}
        if outlines_core is not None:
            text = json.dumps(schema)
            row["outlines_core_s"] = median_time(
                lambda t=text: outlines_core.Index(outlines_core.json_schema.build_regex_from_schema(t), vocabulary),
                args.repeats, warmup=0)
        rows.append(row)
        print(f"{name:20} {row['dfa_states']:>6} states  minillm {row['minillm_s'] * 1e3:8.1f} ms"
              + (f"  outlines-core {row['outlines_core_s'] * 1e3:8.1f} ms" if "outlines_core_s" in row else ""),
              flush=True)
    path = write_results("schema_compile/cpu", {
        "benchmark": "schema -> token index compile time over the shipped vocabulary, minillm vs outlines-core",
        "model": args.model, "vocab_size": len(token_bytes), "repeats": args.repeats,
        "outlines_core": importlib.metadata.version("outlines-core") if outlines_core else None, "rows": rows})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
