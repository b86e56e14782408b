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

Design decisions a reader should know:

* The automaton runs over **bytes**, not characters. A byte-level BPE token may hold half of a UTF-8
  character ("é" is 0xC3 0xA9 and the two bytes can sit in different tokens), so only a byte automaton
  can say whether such a token is allowed. Non-ASCII literals become their UTF-8 byte sequences, and
  every character class, `.` and negated classes included, is compiled into the byte sequences of the
  code points it holds (`utf8_sequences`). Hence `.` and `[^"]` match any character except a newline
  or a quote, non-ASCII included, and the automaton only ever accepts valid UTF-8.
* The shorthand classes are ASCII: `\\d` = [0-9], `\\w` = [A-Za-z0-9_], `\\s` = [ \\t\\n\\r\\f\\v], as with
  Python's `re.ASCII` (Python's and Rust's defaults are Unicode-aware).
* Matching is whole-string (`re.fullmatch`). A leading `^` and a trailing `$` are accepted and mean
  nothing more; anchors elsewhere, lookaround, backreferences, lazy or possessive quantifiers and
  inline flags raise ValueError naming the construct and its position.
* EOS is allowed exactly in accepting states: the model may stop only when the text is a full match.
* The token index agrees with outlines-core's (tests/test_constrained.py walks both) except where the
  dialects differ: Rust's \\d \\w \\s are Unicode, its DFA is leftmost-first (in `a|ab` it never
  reaches "ab"), and outlines-core 0.2.14 drops a token read right after a full match whose end is not
  itself a match (after "1", it forbids "." in `[0-9]+(\\.[0-9]+)?`, though "1.5" matches).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer

from minillm.generate import check_one_completion, prepare_prompt
from minillm.model import Transformer
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer

DEAD = -1  # the state of every string that can no longer be completed into a match
MAX_CODE_POINT = 0x10FFFF
MAX_REPEAT = 1000  # the largest {m,n} bound we unroll; larger ones would make huge automata
MAX_DFA_STATES = 20_000

# ====================================================================== character sets and UTF-8
# A character class is a sorted tuple of inclusive code-point ranges ((lo, hi), ...).
CharSet = tuple[tuple[int, int], ...]

DIGIT: CharSet = ((ord("0"), ord("9")),)
WORD: CharSet = ((ord("0"), ord("9")), (ord("A"), ord("Z")), (ord("_"), ord("_")), (ord("a"), ord("z")))
SPACE: CharSet = ((0x09, 0x0D), (0x20, 0x20))  # \t \n \v \f \r and the space


def normalise(ranges: Iterable[tuple[int, int]]) -> CharSet:
    """Sort ranges and merge the ones that overlap or touch: ((5,9),(0,3),(4,4)) -> ((0,9),)."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


def complement(ranges: CharSet) -> CharSet:
    """Every code point not in `ranges` (surrogates included here; `utf8_sequences` skips them)."""
    out, start = [], 0
    for lo, hi in normalise(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return tuple(out)


# Where the UTF-8 encoding changes length, and the surrogates D800-DFFF, which have no encoding.
_UTF8_BLOCKS = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, MAX_CODE_POINT))


def utf8_sequences(lo: int, hi: int) -> list[tuple[tuple[int, int], ...]]:
    """The UTF-8 encodings of code points lo..hi as byte-range sequences.

    Each sequence ((b1_lo, b1_hi), (b2_lo, b2_hi), ...) matches exactly the byte strings whose i-th byte
    lies in the i-th range, and the union of the sequences is exactly the encodings of lo..hi.
    Example: U+00E0..U+00FF (à..ÿ) -> [((0xC3, 0xC3), (0xA0, 0xBF))].

    A range of same-length code points is a product of byte ranges only when it is aligned: its low
    end starts a block of continuation bytes (trailing payload bits all 0) and its high end finishes one
    (all 1). `_split_aligned` cuts a range at block edges until every piece is aligned.
    """
    out: list[tuple[tuple[int, int], ...]] = []
    for block_lo, block_hi in _UTF8_BLOCKS:
        a, b = max(lo, block_lo), min(hi, block_hi)
        if a <= b:
            _split_aligned(a, b, out)
    return out


def _split_aligned(lo: int, hi: int, out: list) -> None:
    """Append the byte-range sequences of lo..hi (same encoded length, no surrogates) to `out`."""
    n_bytes = len(chr(lo).encode("utf-8"))
    for i in range(1, n_bytes):  # i = how many trailing continuation bytes we look at
        payload = (1 << (6 * i)) - 1  # the bits those i bytes carry
        if lo & ~payload == hi & ~payload:
            continue  # lo and hi agree above these bytes: nothing to cut at this level
        if lo & payload != 0:  # lo starts inside a block: its partial block is one piece
            _split_aligned(lo, lo | payload, out)
            _split_aligned((lo | payload) + 1, hi, out)
            return
        if hi & payload != payload:  # hi ends inside a block
            _split_aligned(lo, (hi & ~payload) - 1, out)
            _split_aligned(hi & ~payload, hi, out)
            return
    out.append(tuple(zip(chr(lo).encode("utf-8"), chr(hi).encode("utf-8"))))


# ====================================================================== parsing: pattern -> syntax tree
@dataclass(frozen=True)
class Chars:
    """One character from a set of code-point ranges (a literal is a set of one)."""

    ranges: CharSet


@dataclass(frozen=True)
class Concat:
    """The parts one after another; Concat(()) matches the empty string."""

    parts: tuple


@dataclass(frozen=True)
class Alt:
    """Any one of the options."""

    options: tuple


@dataclass(frozen=True)
class Repeat:
    """`node` between `lo` and `hi` times (hi None = unbounded)."""

    node: object
    lo: int
    hi: int | None


EMPTY = Concat(())
Node = Chars | Concat | Alt | Repeat

_SHORTHANDS = {"d": DIGIT, "w": WORD, "s": SPACE}
_CONTROL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
_UNSUPPORTED_ESCAPES = {
    "b": "word boundary \\b", "B": "non-word-boundary \\B", "A": "anchor \\A", "Z": "anchor \\Z",
    "z": "anchor \\z", "G": "anchor \\G", "g": "named backreference \\g", "k": "named backreference \\k",
    "p": "Unicode property \\p", "P": "Unicode property \\P",
}
_UNSUPPORTED_GROUPS = {
    "?=": "lookahead (?=...)", "?!": "negative lookahead (?!...)", "?<=": "lookbehind (?<=...)",
    "?<!": "negative lookbehind (?<!...)", "?P=": "backreference (?P=name)", "?#": "comment group (?#...)",
    "?(": "conditional group (?(...)...)", "?>": "atomic group (?>...)",
}


class RegexParser:
    """Recursive descent over the grammar

        alternation := concat ('|' concat)*
        concat      := repeat*
        repeat      := atom ('*' | '+' | '?' | '{m}' | '{m,}' | '{,n}' | '{m,n}')?
        atom        := '(' ['?:' | '?P<name>'] alternation ')' | '[' class ']' | '.' | '\\' escape | char
    """

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.pos = 0

    def parse(self) -> Node:
        """The whole pattern -> its syntax tree; ValueError on syntax we do not support."""
        node = self.alternation()
        if self.pos < len(self.pattern):  # only an unmatched ')' stops `alternation` early
            self.invalid("unbalanced parenthesis ')'")
        return node

    # ------------------------------------------------------------------ helpers
    def peek(self, n: int = 1) -> str:
        return self.pattern[self.pos : self.pos + n]

    def take(self) -> str:
        if self.pos >= len(self.pattern):
            self.invalid("unexpected end of pattern")
        c = self.pattern[self.pos]
        self.pos += 1
        return c

    def invalid(self, problem: str, pos: int | None = None) -> None:
        """Raise for a malformed pattern."""
        pos = self.pos if pos is None else pos
        raise ValueError(f"regex {self.pattern!r}, position {pos}: {problem}.")

    def unsupported(self, construct: str, pos: int | None = None) -> None:
        """Raise for valid syntax that a finite automaton cannot (or we do not) implement."""
        self.invalid(f"{construct} is not supported (only regular, whole-string patterns compile to a DFA)", pos)

    # ------------------------------------------------------------------ structure
    def alternation(self) -> Node:
        options = [self.concat()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.concat())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def concat(self) -> Node:
        parts = []
        while self.pos < len(self.pattern) and self.peek() not in "|)":
            parts.append(self.repeat())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def repeat(self) -> Node:
        start = self.pos
        node = self.atom()
        bounds = self.quantifier()
        if bounds is None:
            return node
        if node is EMPTY and start in (0, len(self.pattern) - 1):
            self.unsupported("a quantifier on an anchor", start)
        if self.peek() == "?":
            self.unsupported("lazy quantifier (*?, +?, ??, {m,n}?)")
        if self.peek() == "+":
            self.unsupported("possessive quantifier (*+, ++, ?+)")
        if self.quantifier_ahead():
            self.invalid("multiple repeat (a quantifier right after a quantifier)")
        return Repeat(node, *bounds)

    def quantifier_ahead(self) -> bool:
        return self.peek() in ("*", "+", "?") or self.brace_bounds(self.pos) is not None

    def quantifier(self) -> tuple[int, int | None] | None:
        """Read `*`, `+`, `?` or a `{...}` bound after an atom; None if none follows."""
        c = self.peek()
        if c in ("*", "+", "?"):
            self.pos += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        brace = self.brace_bounds(self.pos)
        if brace is None:
            return None
        (lo, hi), self.pos = brace
        return lo, hi

    def brace_bounds(self, at: int) -> tuple[tuple[int, int | None], int] | None:
        """Parse `{m}`, `{m,}`, `{,n}`, `{m,n}` at `at` -> ((lo, hi), position after). None if it is no
        quantifier: like Python, a `{` that does not start one is a literal brace."""
        end = self.pattern.find("}", at)
        if self.pattern[at : at + 1] != "{" or end < 0:
            return None
        body = self.pattern[at + 1 : end]
        lo_text, comma, hi_text = body.partition(",")
        if not all(t == "" or t.isascii() and t.isdigit() for t in (lo_text, hi_text)) or not (comma or lo_text):
            return None
        lo = int(lo_text) if lo_text else 0
        hi = (int(hi_text) if hi_text else None) if comma else lo
        if hi is not None and hi < lo:
            self.invalid(f"repeat bounds {{{body}}} have min > max", at)
        if max(lo, hi or 0) > MAX_REPEAT:
            self.unsupported(f"a repeat bound {{{body}}} above {MAX_REPEAT}", at)
        return (lo, hi), end + 1

    # ------------------------------------------------------------------ atoms
    def atom(self) -> Node:
        start = self.pos
        c = self.take()
        if c == "(":
            return self.group(start)
        if c == "[":
            return self.char_class(start)
        if c == ".":
            return Chars(complement(((ord("\n"), ord("\n")),)))  # any character but a newline
        if c == "\\":
            return self.escape(in_class=False)
        if c in ("*", "+", "?") or (c == "{" and self.brace_bounds(start) is not None):
            self.invalid(f"nothing to repeat before {c!r}", start)
        if c == "^" and start == 0 or c == "$" and start == len(self.pattern) - 1:
            return EMPTY  # whole-string matching already anchors both ends
        if c in ("^", "$"):
            self.unsupported(f"anchor {c!r} inside the pattern (only a leading ^ and a trailing $ are accepted)", start)
        return Chars(((ord(c), ord(c)),))

    def group(self, start: int) -> Node:
        if self.peek() == "?":
            for prefix, what in _UNSUPPORTED_GROUPS.items():
                if self.peek(len(prefix)) == prefix:
                    self.unsupported(what, start)
            if self.peek(2) == "?:":
                self.pos += 2
            elif self.peek(3) == "?P<" or self.peek(2) == "?<":
                close = self.pattern.find(">", self.pos)
                if close < 0:
                    self.invalid("unterminated group name", start)
                self.pos = close + 1  # a named group matches like a plain one
            else:
                self.unsupported("inline flags (?...)", start)
        node = self.alternation()
        if self.peek() != ")":
            self.invalid(f"missing ')' to close the group opened at position {start}")
        self.pos += 1
        return node

    def escape(self, in_class: bool) -> Node:
        """After a backslash: a shorthand class, a control character, a hex code point or a literal."""
        at = self.pos - 1
        if self.pos >= len(self.pattern):
            self.invalid("trailing backslash", at)
        c = self.take()
        if c.lower() in _SHORTHANDS:
            ranges = _SHORTHANDS[c.lower()]
            return Chars(ranges if c.islower() else complement(ranges))
        if c in _CONTROL_ESCAPES:
            return Chars(((ord(_CONTROL_ESCAPES[c]),) * 2,))
        if c == "b" and in_class:
            return Chars(((8, 8),))  # inside a class, \b is the backspace character
        if c in ("x", "u", "U"):
            return Chars(((self.hex_code_point(c, at),) * 2,))
        if c in _UNSUPPORTED_ESCAPES:
            self.unsupported(_UNSUPPORTED_ESCAPES[c], at)
        if c.isdigit():
            self.unsupported(f"backreference or octal escape \\{c}", at)
        if c.isascii() and c.isalpha():
            self.invalid(f"unknown escape \\{c}", at)
        return Chars(((ord(c), ord(c)),))  # an escaped punctuation mark (or any other char) is itself

    def hex_code_point(self, kind: str, at: int) -> int:
        digits = {"x": 2, "u": 4, "U": 8}[kind]
        text = self.pattern[self.pos : self.pos + digits]
        if len(text) != digits or any(ch not in "0123456789abcdefABCDEF" for ch in text):
            self.invalid(f"escape \\{kind} needs {digits} hex digits", at)
        self.pos += digits
        value = int(text, 16)
        if value > MAX_CODE_POINT:
            self.invalid(f"code point \\{kind}{text} above U+10FFFF", at)
        return value

    def char_class(self, start: int) -> Node:
        """`[...]` or `[^...]` -> Chars. A `]` right after the opening bracket is a literal."""
        negate = self.peek() == "^"
        self.pos += negate
        ranges: list[tuple[int, int]] = []
        first = True
        while first or self.peek() != "]":
            if self.pos >= len(self.pattern):
                self.invalid(f"unterminated character class (opened at position {start})")
            for op in ("&&", "--", "~~"):
                if self.peek(2) == op:
                    self.unsupported(f"set operation {op!r} in a class (escape the characters if you mean them)")
            first = False
            lo_set = self.class_item()
            if self.peek() == "-" and self.peek(2) != "-]" and len(self.peek(2)) == 2:
                dash = self.pos
                self.pos += 1
                hi_set = self.class_item()
                if not (_single(lo_set) and _single(hi_set)):
                    self.invalid("a range whose end is a class such as \\d", dash)
                if lo_set[0][0] > hi_set[0][0]:
                    self.invalid(f"bad range {chr(lo_set[0][0])!r}-{chr(hi_set[0][0])!r}", dash)
                ranges.append((lo_set[0][0], hi_set[0][0]))
            else:
                ranges.extend(lo_set)
        self.pos += 1  # the closing ]
        return Chars(complement(ranges) if negate else normalise(ranges))

    def class_item(self) -> CharSet:
        """One character inside a class, or a shorthand set such as \\d."""
        c = self.take()
        if c == "\\":
            return self.escape(in_class=True).ranges
        if c == "[":
            self.unsupported("an unescaped '[' inside a class (write \\[: other engines read a set)", self.pos - 1)
        return ((ord(c), ord(c)),)


def _single(ranges: CharSet) -> bool:
    return len(ranges) == 1 and ranges[0][0] == ranges[0][1]


def parse_regex(pattern: str) -> Node:
    """Pattern -> syntax tree (Chars, Concat, Alt, Repeat). ValueError names unsupported constructs."""
    return RegexParser(pattern).parse()


# ====================================================================== Thompson: syntax tree -> NFA over bytes
class NFA:
    """A nondeterministic automaton over bytes with one start and one accepting state.

    `edges[s]` holds (lo, hi, target): from s, any byte in lo..hi leads to target. `eps[s]` lists the
    states s reaches without reading a byte. Thompson's construction gives every node a fragment
    (start, end) and glues fragments with epsilon edges.
    """

    def __init__(self, tree: Node) -> None:
        self.edges: list[list[tuple[int, int, int]]] = []
        self.eps: list[list[int]] = []
        self.start, self.accept = self.build(tree)

    def new_state(self) -> int:
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def build(self, node: Node) -> tuple[int, int]:
        """Add the fragment of `node`; return its (start, end) states."""
        if isinstance(node, Chars):
            return self.build_chars(node)
        if isinstance(node, Concat):
            return self.build_concat([self.build(part) for part in node.parts])
        if isinstance(node, Alt):
            start, end = self.new_state(), self.new_state()
            for option in node.options:
                s, e = self.build(option)
                self.eps[start].append(s)
                self.eps[e].append(end)
            return start, end
        return self.build_repeat(node)

    def build_chars(self, node: Chars) -> tuple[int, int]:
        """One code point of the set = one of its UTF-8 byte-range sequences, a chain of edges each."""
        start, end = self.new_state(), self.new_state()
        for lo, hi in node.ranges:
            for sequence in utf8_sequences(lo, hi):
                state = start
                for i, (b_lo, b_hi) in enumerate(sequence):
                    target = end if i == len(sequence) - 1 else self.new_state()
                    self.edges[state].append((b_lo, b_hi, target))
                    state = target
        return start, end

    def build_concat(self, fragments: list[tuple[int, int]]) -> tuple[int, int]:
        if not fragments:
            state = self.new_state()
            return state, state
        for (_, end), (start, _) in zip(fragments, fragments[1:]):
            self.eps[end].append(start)
        return fragments[0][0], fragments[-1][1]

    def build_repeat(self, node: Repeat) -> tuple[int, int]:
        """x{m,n} = m copies of x, then n-m optional copies (each may skip to the end); x{m,} ends in x*."""
        fragments = [self.build(node.node) for _ in range(node.lo)]
        start, end = self.build_concat(fragments)
        exit_ = self.new_state()
        if node.hi is None:  # a loop: x* after the mandatory copies
            s, e = self.build(node.node)
            self.eps[end].extend([s, exit_])
            self.eps[e].extend([s, exit_])
            return start, exit_
        for _ in range(node.hi - node.lo):
            s, e = self.build(node.node)
            self.eps[end].extend([s, exit_])
            end = e
        self.eps[end].append(exit_)
        return start, exit_

    def closure(self, states: Iterable[int]) -> frozenset[int]:
        """Every state reachable from `states` by epsilon edges alone."""
        seen, stack = set(states), list(states)
        while stack:
            for t in self.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)

    def byte_classes(self) -> np.ndarray:
        """class_of[b] for the 256 bytes: bytes no edge tells apart share a class. [256] int."""
        cuts = {0, 256}
        for edges in self.edges:
            for lo, hi, _ in edges:
                cuts.update((lo, hi + 1))
        return np.searchsorted(np.array(sorted(cuts)), np.arange(256), side="right") - 1


# ====================================================================== subset construction: NFA -> DFA
def determinise(nfa: NFA) -> tuple[np.ndarray, np.ndarray]:
    """Subset construction. Returns transitions [S, 256] (DEAD where no NFA state survives) and
    accepting [S] bool; DFA state 0 is the start. Each DFA state is a set of NFA states."""
    class_of = nfa.byte_classes()
    n_classes = int(class_of.max()) + 1
    start = nfa.closure([nfa.start])
    ids = {start: 0}
    todo, rows = [start], []
    while todo:
        subset = todo.pop()
        targets: list[set[int]] = [set() for _ in range(n_classes)]
        for s in subset:
            for lo, hi, t in nfa.edges[s]:
                for c in range(class_of[lo], class_of[hi] + 1):
                    targets[c].add(t)
        row = []
        for moved in targets:
            nxt = nfa.closure(moved) if moved else None
            if nxt is not None and nxt not in ids:
                if len(ids) >= MAX_DFA_STATES:
                    raise ValueError(f"the pattern's DFA exceeds {MAX_DFA_STATES} states; simplify it.")
                ids[nxt] = len(ids)
                todo.append(nxt)
            row.append(DEAD if nxt is None else ids[nxt])
        rows.append((ids[subset], row))
    table = np.full((len(ids), n_classes), DEAD, dtype=np.int64)
    for state, row in rows:
        table[state] = row
    accepting = np.zeros(len(ids), dtype=bool)
    for subset, state in ids.items():
        accepting[state] = nfa.accept in subset
    return table[:, class_of], accepting


def prune_dead(table: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Send every state that cannot reach an accepting state to DEAD and drop it; renumber in
    breadth-first order from the start (state 0). After this, DEAD is the only dead end."""
    src, byte = np.nonzero(table >= 0)
    predecessors: list[set[int]] = [set() for _ in range(len(table))]
    for s, t in zip(src.tolist(), table[src, byte].tolist()):
        predecessors[t].add(s)
    live = accepting.copy()
    stack = np.flatnonzero(accepting).tolist()
    while stack:  # walk the edges backwards from the accepting states
        for s in predecessors[stack.pop()]:
            if not live[s]:
                live[s] = True
                stack.append(s)
    if not live[0]:
        raise ValueError("the pattern matches no string at all (e.g. an empty class like [^\\s\\S]).")
    table = np.where((table >= 0) & live[np.maximum(table, 0)], table, DEAD)
    return renumber(table, accepting)


def renumber(table: np.ndarray, accepting: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Keep the states reachable from `start`, numbered in breadth-first order (start becomes 0)."""
    order, index = [start], {start: 0}
    for state in order:
        for t in table[state].tolist():
            if t >= 0 and t not in index:
                index[t] = len(order)
                order.append(t)
    mapping = np.full(len(table) + 1, DEAD, dtype=np.int64)  # mapping[DEAD] stays DEAD
    for old, new in index.items():
        mapping[old] = new
    return mapping[table[order]], accepting[order]


def minimise(table: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Moore's partition refinement: merge states no input string can tell apart.

    Start from two blocks (accepting or not); split a block whenever two of its states move, on some
    byte, into different blocks. When no block splits, each block is one state of the minimal DFA.
    Bytes that every state treats alike (the same column of the table) need checking only once.
    """
    columns = np.unique(table, axis=1)  # [S, distinct bytes]
    block = accepting.astype(np.int64)
    n_blocks = len(set(block.tolist()))
    while True:
        moved = np.where(columns >= 0, block[np.maximum(columns, 0)], DEAD)  # the block each byte leads to
        signatures: dict[tuple, int] = {}  # (own block, target blocks) -> new block id
        rows = np.concatenate([block[:, None], moved], axis=1).tolist()
        block = np.array([signatures.setdefault(tuple(row), len(signatures)) for row in rows])
        if len(signatures) == n_blocks:  # refining only splits blocks: same count = nothing split
            break
        n_blocks = len(signatures)
    first = np.unique(block, return_index=True)[1]  # one representative state per block
    merged = np.where(table[first] >= 0, block[np.maximum(table[first], 0)], DEAD)  # [blocks, 256]
    return renumber(merged, accepting[first], start=int(block[0]))


class RegexDFA:
    """A regular expression compiled to a minimal DFA over bytes (full-match semantics).

    transitions: [n_states, 256] int64, the next state for each byte, DEAD (-1) when the string can no
    longer become a match; accepting: [n_states] bool. Every non-DEAD state can still reach a match.

    Example:
        >>> dfa = RegexDFA(r"-?\\d+(\\.\\d+)?")
        >>> dfa.matches("-3.14"), dfa.matches("3."), dfa.n_states
        (True, False, 5)
    """

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        table, accepting = determinise(NFA(parse_regex(pattern)))
        self.transitions, self.accepting = minimise(*prune_dead(table, accepting))
        self._rows = self.transitions.tolist()  # plain lists: fast stepping from Python
        self.start = 0

    @property
    def n_states(self) -> int:
        return len(self.transitions)

    def step(self, state: int, byte: int) -> int:
        """The state after reading one byte (DEAD stays DEAD)."""
        return DEAD if state == DEAD else self._rows[state][byte]

    def walk(self, state: int, data: bytes) -> int:
        """The state after reading `data` from `state`; DEAD as soon as no match is possible."""
        for byte in data:
            state = self._rows[state][byte]
            if state == DEAD:
                break
        return state

    def is_accepting(self, state: int) -> bool:
        return state != DEAD and bool(self.accepting[state])

    def matches(self, text: str | bytes) -> bool:
        """Whether the whole of `text` (a str is encoded as UTF-8) matches the pattern."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        return self.is_accepting(self.walk(self.start, data))


# ====================================================================== JSON schema -> regex
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


# ====================================================================== the vocabulary as bytes
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each of the 256 bytes as one printable character.

    Printable Latin-1 bytes stand for themselves ('!' is '!'); the others (control characters, the
    space, ...) are shifted to U+0100 onwards in byte order, so the space 0x20 becomes 'Ġ' (U+0120).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def vocabulary_bytes(tokenizer: Tokenizer | HFTokenizer) -> list[bytes | None]:
    """The raw bytes of every token id of a byte-level BPE tokenizer; None for special tokens.

    A byte-level vocabulary stores 'Ġthe' for b' the'; we map each symbol back to its byte. Special
    tokens (<s>, </s>) are control signals, not text, so they never match a pattern.
    """
    hf = tokenizer.backend if isinstance(tokenizer, Tokenizer) else tokenizer  # or a `tokenizers.Tokenizer`
    if type(hf.decoder).__name__ != "ByteLevel":
        raise ValueError(f"constrained decoding needs a byte-level BPE tokenizer; this one decodes with {hf.decoder}.")
    to_byte = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
    added = hf.get_added_tokens_decoder()
    out: list[bytes | None] = []
    for token_id in range(hf.get_vocab_size()):
        if token_id in added:  # added tokens hold plain text, not byte symbols
            out.append(None if added[token_id].special else added[token_id].content.encode("utf-8"))
            continue
        piece = hf.id_to_token(token_id)
        if piece is None or any(c not in to_byte for c in piece):
            raise ValueError(f"token {token_id} ({piece!r}) is not made of byte-level symbols.")
        out.append(bytes(to_byte[c] for c in piece))
    return out


# ====================================================================== the token index
class TokenIndex:
    """For every DFA state, the tokens whose bytes keep a match possible, and where each one leads.

    mask: [n_states, V] bool, True where the token is allowed; the EOS columns are True exactly in
        accepting states. One row is what `mask_logits` needs at a decode step.
    next_state[state]: {token id: the state after its bytes} for the allowed non-EOS tokens.
    Built once per (pattern, tokenizer); `build_time_s` says how long that took.

    The dense mask costs n_states x V bytes (here at most a few MB). With 128k-token vocabularies and
    large grammars, engines pack it into bits (8x smaller than these one-byte bools) or compute rows on demand.
    """

    def __init__(self, dfa: RegexDFA, token_bytes: Sequence[bytes | None], eos_token_ids: Iterable[int]) -> None:
        start_time = time.perf_counter()
        self.dfa = dfa
        self.token_bytes = list(token_bytes)
        self.eos_token_ids = sorted(set(eos_token_ids))
        if any(not 0 <= t < len(self.token_bytes) for t in self.eos_token_ids):
            raise ValueError(f"EOS ids {self.eos_token_ids} must lie in the vocabulary [0, {len(self.token_bytes)}).")
        ends = walk_all_tokens(dfa, self.token_bytes)  # [S, V] state after each token, DEAD if not allowed
        self.mask = torch.from_numpy(ends != DEAD)  # [S, V]
        self.mask[:, self.eos_token_ids] = torch.from_numpy(dfa.accepting)[:, None]
        self.next_state: list[dict[int, int]] = []
        for state in range(dfa.n_states):
            ids = np.flatnonzero(ends[state] != DEAD)
            self.next_state.append(dict(zip(ids.tolist(), ends[state, ids].tolist())))
        self.build_time_s = time.perf_counter() - start_time

    def allowed_ids(self, state: int) -> torch.Tensor:
        """The allowed token ids of `state`, EOS included where accepting: [n] int64, sorted."""
        return self.mask[state].nonzero().squeeze(1)

    @classmethod
    def from_constraint(
        cls, constraint: str | dict, tokenizer: Tokenizer, eos_token_ids: Iterable[int] = ()
    ) -> TokenIndex:
        """A regex (str) or a JSON schema (dict) -> its index over `tokenizer`'s vocabulary; EOS is any
        of `eos_token_ids` and the tokenizer's own."""
        pattern = schema_to_regex(constraint) if isinstance(constraint, dict) else constraint
        eos = set(eos_token_ids) | set(tokenizer.eos_token_ids)
        if not eos:
            raise ValueError("constrained decoding needs an EOS token id to end on; pass eos_token_ids=...")
        return cls(RegexDFA(pattern), vocabulary_bytes(tokenizer), eos)

    @property
    def start(self) -> int:
        return self.dfa.start

    def is_finished(self, state: int) -> bool:
        """Accepting with no token to go on with: the output is complete and nothing may follow."""
        return self.dfa.is_accepting(state) and not self.next_state[state]

    def advance(self, state: int, token_id: int) -> int:
        """The state after `token_id`; ValueError if the token is not allowed in `state`."""
        if token_id not in self.next_state[state]:
            raise ValueError(f"token {token_id} ({self.token_bytes[token_id]!r}) is not allowed in state {state}.")
        return self.next_state[state][token_id]


def walk_all_tokens(dfa: RegexDFA, token_bytes: Sequence[bytes | None], chunk: int = 1 << 21) -> np.ndarray:
    """Walk every token's bytes from every DFA state at once: ends [S, V], the state where each
    token ends (DEAD if it leaves the live states, or it has no bytes).

    Tokens are sorted longest first, so at byte position j the tokens still walking are a prefix
    of that order: one vectorised table lookup per position, for a block of states at a time.
    """
    lengths = np.array([len(b) if b else 0 for b in token_bytes])
    order = np.argsort(-lengths, kind="stable")  # longest first
    width = int(lengths.max(initial=0))
    padded = np.zeros((len(order), width), dtype=np.int64)  # [V, L] byte j of the k-th longest token
    for row, token in enumerate(order):
        padded[row, : lengths[token]] = np.frombuffer(token_bytes[token] or b"", dtype=np.uint8)
    sink = dfa.n_states  # DEAD as a real row that loops to itself, so lookups need no branches
    table = np.vstack([np.where(dfa.transitions >= 0, dfa.transitions, sink), np.full((1, 256), sink)])
    still_walking = [(lengths[order] > j).sum() for j in range(width)]
    ends = np.empty((dfa.n_states, len(order)), dtype=np.int64)
    block = max(1, chunk // max(len(order), 1))
    for first in range(0, dfa.n_states, block):
        states = np.arange(first, min(first + block, dfa.n_states))
        current = np.repeat(states[:, None], len(order), axis=1)  # [C, V]
        for j, n in enumerate(still_walking):
            current[:, :n] = table[current[:, :n], padded[:n, j]]
        current[current == sink] = DEAD
        current[:, lengths[order] == 0] = DEAD  # special tokens and empty pieces never match
        ends[states[:, None], order[None, :]] = current
    return ends


# ====================================================================== masking and the generation loop
def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Keep the logits of allowed tokens, set every other one to -inf.

    logits [..., V]; allowed: a bool mask [V] (True = allowed) or allowed token ids [n] -> [..., V].
    After this, softmax gives disallowed tokens probability 0 and argmax cannot pick them, whatever
    temperature, top-k or top-p do next.
    """
    if allowed.dtype != torch.bool:
        ids = allowed
        allowed = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        allowed[ids] = True
    return logits.masked_fill(~allowed, float("-inf"))


@dataclass
class ConstrainedOutput:
    """What `generate_constrained` returns.

    finish_reason: "stop" (EOS in an accepting state, or an accepting state nothing can follow) or
    "length" (max_tokens). complete: the text fully matches the pattern / validates against the
    schema; False only when max_tokens cut it short, and then `text` must not be trusted.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids, including a sampled EOS
    text: str  # the generated text (EOS excluded)
    finish_reason: str
    complete: bool
    state: int  # the DFA state at the end


def generate_constrained(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str | list[int],
    constraint: str | dict | TokenIndex,
    params: SamplingParams | None = None,
    kv_cache_dtype: str = "auto",
) -> ConstrainedOutput:
    """Generate a completion of `prompt` whose text matches a regex (str) or a JSON schema (dict) (chapter 01).

    Pass a prebuilt `TokenIndex` to reuse it across calls; a str or dict builds one each call.
    It runs as one request of the engine (`LLMEngine.add_request(..., constraint=index)`), which at every
    step masks the logits to the state's allowed tokens, samples, and advances the DFA. `kv_cache_dtype`:
    what its KV cache stores, "auto" (the model's dtype), "int8" or "fp8" (chapter 06).

    Example:
        >>> out = generate_constrained(model, tok, "Age: ", r"[1-9][0-9]?", SamplingParams(max_tokens=4))
        >>> out.text, out.complete
        ('42', True)
    """
    from minillm.engine import LLMEngine  # the engine imports this module

    params = params or SamplingParams()
    check_one_completion(params)

    start = time.perf_counter()
    ids = prepare_prompt(model, prompt, params, tokenizer)
    index = constraint
    if not isinstance(index, TokenIndex):
        index = TokenIndex.from_constraint(constraint, tokenizer, model.config.eos_token_ids)
    if index.is_finished(index.start):  # the pattern allows only the empty string
        return _output(index, ids, [], "stop", index.start)
    engine = LLMEngine.for_one_prompt(model, tokenizer, len(ids), params, kv_cache_dtype=kv_cache_dtype)
    engine.add_request("constrained", ids, params, arrival_time=start, constraint=index)
    out = engine.run()["constrained", 0]
    state = index.start
    for token in out.token_ids:  # the DFA state the output ends in
        if token not in index.eos_token_ids:
            state = index.advance(state, token)
    return _output(index, ids, out.token_ids, out.finish_reason or "length", state)


def masks_for(index: TokenIndex, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The index's masks on the logits' device, padded with False if the model has extra (unused) rows."""
    masks = index.mask
    if vocab_size > masks.shape[1]:
        masks = torch.cat([masks, masks.new_zeros(masks.shape[0], vocab_size - masks.shape[1])], dim=1)
    return masks[:, :vocab_size].to(device)


def _output(
    index: TokenIndex, prompt_ids: list[int], generated: list[int], finish: str, state: int
) -> ConstrainedOutput:
    pieces = [index.token_bytes[t] for t in generated if t not in index.eos_token_ids]
    return ConstrainedOutput(
        prompt_token_ids=prompt_ids,
        token_ids=generated,
        text=b"".join(pieces).decode("utf-8", errors="replace"),  # valid UTF-8 whenever complete
        finish_reason=finish,
        complete=index.dfa.is_accepting(state),
        state=state,
    )
