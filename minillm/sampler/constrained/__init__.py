"""Constrained (structured) decoding: every generated token keeps the output inside a regular language (chapter 01).

A model left alone may write anything; an application that parses the output (JSON for an API, a date,
a choice among labels) needs text of a known shape. Constrained decoding guarantees the shape by
forbidding, at every step, each token that would make the shape impossible to finish:

    pattern or JSON schema
        │ schema_to_regex              (without $ref recursion, a JSON schema describes a regular language)
        ▼
    regular expression ─ parse ─► syntax tree ─ Thompson ─► NFA over bytes ─ subsets ─► DFA ─ minimise ─► RegexDFA
        │                                                                                   │
        │         each vocabulary token's bytes, walked from every DFA state                │
        ▼                                                                                   ▼
    TokenIndex: state -> (allowed-token mask, state after each token)  ─── built once per (pattern, tokenizer)
        │
        ▼  at every decode step
    logits ─ mask_logits (disallowed -> -inf) ─ sample ─► token ─ advance the DFA by its bytes ─► next state

The modules, in the order the picture runs:

    json_schema   schema_to_regex: the supported JSON schema subset as a regular expression
    regex         character sets and their UTF-8 byte ranges; the syntax tree and its parser (the dialect)
    automata      Thompson's NFA over bytes, subset construction, minimisation: RegexDFA
    token_index   the vocabulary as bytes, TokenIndex, and the logits mask (mask_logits, masks_for)

The package knows nothing of models or the engine: `minillm.decoding.generation.generate_constrained` runs one
constrained request, and the engine masks each step's logits with the request's TokenIndex.
"""

from minillm.sampler.constrained.automata import DEAD, RegexDFA
from minillm.sampler.constrained.json_schema import json_object_regex, schema_to_regex
from minillm.sampler.constrained.regex import utf8_sequences
from minillm.sampler.constrained.token_index import (
           TokenIndex,
           bytes_to_unicode,
           mask_logits,
           masks_for,
           vocabulary_bytes,
)

__all__ = ["DEAD", "RegexDFA", "TokenIndex", "bytes_to_unicode", "json_object_regex", "mask_logits", "masks_for",
           "schema_to_regex", "utf8_sequences", "vocabulary_bytes"]
