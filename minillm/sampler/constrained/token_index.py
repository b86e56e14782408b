"""The vocabulary walked through a DFA: which tokens each state allows, and the logits mask (chapter 01).

    each vocabulary token's bytes (`vocabulary_bytes`), walked from every DFA state (`walk_all_tokens`)
        │
        ▼
    TokenIndex: state -> (allowed-token mask, state after each token)  ─── built once per (pattern, tokenizer)
        │
        ▼  at every decode step (the engine, via `masks_for`)
    logits ─ mask_logits (disallowed -> -inf) ─ sample ─► token ─ advance the DFA by its bytes ─► next state

* EOS is allowed exactly in accepting states: the model may stop only when the text is a full match.
* The token index agrees with outlines-core's (tests/sampler/test_constrained.py walks both) except where the
  dialects differ: Rust's \\d \\w \\s are Unicode, its DFA is leftmost-first (in `a|ab` it never
  reaches "ab"), and outlines-core 0.2.14 drops a token read right after a full match whose end is not
  itself a match (after "1", it forbids "." in `[0-9]+(\\.[0-9]+)?`, though "1.5" matches).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer

from minillm.sampler.constrained.automata import DEAD, RegexDFA
from minillm.sampler.constrained.json_schema import schema_to_regex
from minillm.tokenizer import Tokenizer


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
# States x vocabulary cells one index may hold: its build holds int64 ends and a bool mask, 9 bytes a cell, so this
# is about 0.8 GiB. json_object_regex()'s 663 states over Llama-3's 128,256 tokens take 85 M; a pattern such as
# (a|b)*a(a|b){12} takes 8,192 states, a billion cells (9 GiB) over the same vocabulary, and is refused.
MAX_INDEX_CELLS = 100_000_000


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
        cells = dfa.n_states * len(token_bytes)
        if cells > MAX_INDEX_CELLS:  # the walk holds [S, V] int64 ends, then the mask: refuse before allocating
            raise ValueError(f"the constraint's automaton has {dfa.n_states:,} states, so its index over this "
                             f"{len(token_bytes):,}-token vocabulary would hold {cells:,} cells, past the budget of "
                             f"{MAX_INDEX_CELLS:,} (about {MAX_INDEX_CELLS * 9 / 2**30:.1f} GiB while it is built). "
                             "Simplify the pattern or the schema: fewer optional parts and shorter counted repeats "
                             "(a{12}, maxLength) make fewer states.")
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
        cls, constraint: str | dict | RegexDFA, tokenizer: Tokenizer, eos_token_ids: Iterable[int] = ()
    ) -> TokenIndex:
        """A regex (str), a JSON schema (dict) or a compiled `RegexDFA` -> its index over `tokenizer`'s vocabulary;
        EOS is any of `eos_token_ids` and the tokenizer's own."""
        if not isinstance(constraint, (str, dict, RegexDFA)):
            raise TypeError(f"a constraint is a regex (str) or a JSON schema (dict), got {type(constraint).__name__} "
                            f"{constraint!r}.")
        eos = set(eos_token_ids) | set(tokenizer.eos_token_ids)
        if not eos:
            raise ValueError("constrained decoding needs an EOS token id to end on; pass eos_token_ids=...")
        if isinstance(constraint, RegexDFA):
            return cls(constraint, vocabulary_bytes(tokenizer), eos)
        pattern = schema_to_regex(constraint) if isinstance(constraint, dict) else constraint
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


# ====================================================================== masking the logits
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


def masks_for(index: TokenIndex, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The index's masks on the logits' device, padded with False if the model has extra (unused) rows."""
    masks = index.mask
    if vocab_size > masks.shape[1]:
        masks = torch.cat([masks, masks.new_zeros(masks.shape[0], vocab_size - masks.shape[1])], dim=1)
    return masks[:, :vocab_size].to(device)
