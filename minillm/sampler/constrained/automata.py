"""A regular expression compiled to a minimal DFA over bytes: `RegexDFA` (chapter 01).

    syntax tree ─ Thompson ─► NFA over bytes ─ subsets ─► DFA ─ prune dead states, minimise ─► RegexDFA

The syntax tree comes from `minillm.sampler.constrained.regex`. A RegexDFA is a table [states, 256] of the next
state for every byte; DEAD marks the strings that can no longer be completed into a match.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from minillm.sampler.constrained.regex import Alt, Chars, Concat, Node, Repeat, parse_regex, utf8_sequences

DEAD = -1  # the state of every string that can no longer be completed into a match
# The construction budget, enforced while the automaton is built (not after): a pattern past it gets a
# ValueError that says which limit it hit, instead of minutes of work and gigabytes of memory. It counts work, not
# seconds, so whether a pattern compiles does not depend on the machine or on how loaded it is. json_object_regex()
# takes 12,785 DFA states, 0.9 M subset steps and 6 M refinement cells; `[^x]{1000}` would take 266 M cells.
MAX_NFA_STATES = 200_000
MAX_DFA_STATES = 20_000
MAX_SUBSET_STEPS = 10_000_000  # determinise: byte classes moved plus states reached by closures, over all subsets
MAX_REFINE_CELLS = 30_000_000  # minimise: table cells grouped (states x distinct columns), over all rounds


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
        if len(self.edges) >= MAX_NFA_STATES:
            raise ValueError(f"the pattern's automaton passes {MAX_NFA_STATES:,} states; simplify it.")
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
        """x{m,n} = m copies of x, then n-m optional copies (each may skip to the end); x{m,} ends in x*.

        The first copy's size tells what all of them will take: past the budget, the error names the repeat."""
        before = len(self.edges)
        first = self.build(node.node)
        copies = max(node.lo, 1) + (1 if node.hi is None else node.hi - max(node.lo, 1))
        need = (len(self.edges) - before) * copies
        if before + need > MAX_NFA_STATES:
            bounds = f"{{{node.lo},{'' if node.hi is None else node.hi}}}"
            raise ValueError(f"a repeat {bounds} of a part that takes {len(self.edges) - before:,} automaton states "
                             f"would take about {need:,}, past the budget of {MAX_NFA_STATES:,}: lower the repeat "
                             "count, or narrow what it repeats.")
        fragments = [first] if node.lo else []
        fragments += [self.build(node.node) for _ in range(node.lo - len(fragments))]
        start, end = self.build_concat(fragments)
        exit_ = self.new_state()
        if node.hi is None:  # a loop: x* after the mandatory copies
            s, e = first if not node.lo else self.build(node.node)
            self.eps[end].extend([s, exit_])
            self.eps[e].extend([s, exit_])
            return start, exit_
        for k in range(node.hi - node.lo):
            s, e = first if (k == 0 and not node.lo) else self.build(node.node)
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
@dataclass
class Work:
    """What building one automaton cost, in the construction budget's units (`RegexDFA.work`): steps of the subset
    construction (MAX_SUBSET_STEPS) and table cells of the minimisation (MAX_REFINE_CELLS)."""

    subset_steps: int = 0
    refine_cells: int = 0


def over_budget(limit: str, detail: str) -> ValueError:
    """The construction budget's error: which `limit` the pattern passed, where (`detail`), and what to do."""
    return ValueError(f"the pattern is too large to compile: {limit} ({detail}). Simplify the pattern or the schema: "
                      "long repeats of wide character classes (like [^x]{1000}, or a long maxLength) and many "
                      "nested optional parts are the usual cause.")


def determinise(nfa: NFA, work: Work | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Subset construction. Returns transitions [S, 256] (DEAD where no NFA state survives) and
    accepting [S] bool; DFA state 0 is the start. Each DFA state is a set of NFA states. Raises a
    ValueError (`over_budget`) past MAX_DFA_STATES states or MAX_SUBSET_STEPS steps: a step is one byte
    class of one NFA state's edge moved, or one state reached by a closure; `work` (if given) counts them."""
    class_of = nfa.byte_classes()
    n_classes, first_class = int(class_of.max()) + 1, class_of.tolist()  # a list: fast indexing from Python
    start = nfa.closure([nfa.start])
    ids = {start: 0}
    todo, rows = [start], []
    steps = 0
    while todo:
        if steps > MAX_SUBSET_STEPS:
            raise over_budget(f"the subset construction passed {MAX_SUBSET_STEPS:,} steps",
                              f"{len(ids):,} DFA states so far")
        subset = todo.pop()
        targets: list[set[int]] = [set() for _ in range(n_classes)]
        for s in subset:
            for lo, hi, t in nfa.edges[s]:
                steps += first_class[hi] - first_class[lo] + 1
                for c in range(first_class[lo], first_class[hi] + 1):
                    targets[c].add(t)
        row = []
        for moved in targets:
            nxt = nfa.closure(moved) if moved else None
            steps += len(nxt) if nxt is not None else 0
            if nxt is not None and nxt not in ids:
                if len(ids) >= MAX_DFA_STATES:
                    raise over_budget(f"its DFA passes {MAX_DFA_STATES:,} states", "before minimising")
                ids[nxt] = len(ids)
                todo.append(nxt)
            row.append(DEAD if nxt is None else ids[nxt])
        rows.append((ids[subset], row))
    if work is not None:
        work.subset_steps = steps
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


def minimise(table: np.ndarray, accepting: np.ndarray, work: Work | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Moore's partition refinement: merge states no input string can tell apart.

    Start from two blocks (accepting or not); split a block whenever two of its states move, on some
    byte, into different blocks. When no block splits, each block is one state of the minimal DFA.
    Bytes that every state treats alike (the same column of the table) need checking only once. Each round
    groups the states by their signature rows with one `np.unique` (a sort), not a Python dict of tuples.
    A round costs a cell per state and column, and a chain of n states takes n rounds: past MAX_REFINE_CELLS
    cells in all, a ValueError (`over_budget`); `work` (if given) counts them.
    """
    columns = np.unique(table, axis=1)  # [S, distinct bytes]
    block = accepting.astype(np.int64)
    n_blocks = len(np.unique(block))
    cells, rounds = 0, 0
    while True:
        cells, rounds = cells + columns.size + len(table), rounds + 1  # this round's signatures [S, 1 + columns]
        if cells > MAX_REFINE_CELLS:
            raise over_budget(f"minimising its DFA passed {MAX_REFINE_CELLS:,} table cells",
                              f"{len(table):,} states, {rounds - 1} rounds of refinement so far")
        moved = np.where(columns >= 0, block[np.maximum(columns, 0)], DEAD)  # the block each byte leads to
        signatures = np.concatenate([block[:, None], moved], axis=1)  # (own block, target blocks) per state
        _, block = np.unique(signatures, axis=0, return_inverse=True)
        block = block.reshape(-1)
        if block.max() + 1 == n_blocks:  # refining only splits blocks: same count = nothing split
            break
        n_blocks = int(block.max()) + 1
    if work is not None:
        work.refine_cells = cells
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
        self.work = Work()  # what it cost, within the construction budget (MAX_SUBSET_STEPS, MAX_REFINE_CELLS)
        table, accepting = determinise(NFA(parse_regex(pattern)), self.work)
        self.transitions, self.accepting = minimise(*prune_dead(table, accepting), self.work)
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
