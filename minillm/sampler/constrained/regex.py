"""Regular expressions, parsed: character sets, their UTF-8 byte ranges, and the syntax tree (chapter 01).

    pattern ─ RegexParser ─► syntax tree of Chars, Concat, Alt, Repeat        (`parse_regex`)

`minillm.sampler.constrained.automata` compiles the tree into an automaton. The dialect, and why:

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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MAX_CODE_POINT = 0x10FFFF
MAX_REPEAT = 1000  # the largest {m,n} bound we unroll; larger ones would make huge automata
MAX_NESTING = 50  # groups within groups: the parser and the NFA builder recurse once per level


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
        if not isinstance(pattern, str):
            raise TypeError(f"a regular expression is a pattern string, like r'-?\\d+', not "
                            f"{type(pattern).__name__} {pattern!r}: pass the pattern as a str.")
        self.pattern = pattern
        self.pos = 0
        self.depth = 0  # groups open at pos

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
        self.depth += 1
        if self.depth > MAX_NESTING:  # a clear error long before Python's recursion limit
            self.invalid(f"groups nest more than {MAX_NESTING} deep; flatten the pattern", start)
        node = self.alternation()
        self.depth -= 1
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
