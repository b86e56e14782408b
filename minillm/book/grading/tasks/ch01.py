"""Chapter 01's exercise tasks: the top-p and min-p filters, the repetition penalty, one step of
beam search, and one step of a regex-constrained logits mask.

Each task's tests compare the reader's function with minillm's own (`minillm.sampler.sampling`,
`minillm.decoding.beam`, `minillm.sampler.constrained`) and, on a mismatch, name the likely mistake in the hint.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minillm.book.grading.registry import MismatchError, expect_close, register_task
from minillm.decoding.beam import NO_BEAM, beam_step
from minillm.sampler import sampling
from minillm.sampler.constrained import RegexDFA, TokenIndex, vocabulary_bytes

NEG_INF = float("-inf")


def _logits(seed: int, shape: tuple[int, int], scale: float = 3.0) -> torch.Tensor:
    """Random logits without ties."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _kept(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x)


def _check_filter(fn: Callable, logits: torch.Tensor, param: float, reference: Callable, what: str,
                  hint_for: Callable[[torch.Tensor, torch.Tensor], str]) -> None:
    """Compare the reader's filter with the reference: same tokens kept, kept logits unchanged."""
    got = fn(logits.clone(), param)
    expected = reference(logits, param)
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise MismatchError(what, f"a tensor of shape {tuple(expected.shape)}", shape,
                            "return the logits with removed tokens set to float('-inf'), same shape as the input.")
    got = got.float()
    if got.isnan().any():
        raise MismatchError(what, "no NaN", f"{int(got.isnan().sum())} NaN values",
                            "exp of a large logit overflows: use torch.softmax, which subtracts the row's max first.")
    if not _kept(got).any(dim=-1).all():
        raise MismatchError(what, "at least one token kept in every row", "a row with every logit at -inf",
                            "always keep the most likely token, whatever the parameter.")
    if not torch.equal(_kept(got), _kept(expected)):
        raise MismatchError(what, f"kept per row {_kept(expected).sum(-1).tolist()}",
                            f"{_kept(got).sum(-1).tolist()}", hint_for(_kept(got), _kept(expected)))
    expect_close(torch.where(_kept(got), got, 0.0), torch.where(_kept(expected), expected, 0.0), what,
                 "leave the kept logits unchanged; only set the removed ones to -inf.")


# ---- 01.top_p ---------------------------------------------------------------------------------------


def reference_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: logits [B, V] -> [B, V], keeping the smallest most-likely set whose mass reaches p."""
    return sampling.top_p_filter(logits, p)


top_p = register_task(
    "01.top_p",
    "top_p_filter(logits: Tensor[B, V], p: float) -> Tensor[B, V]  (removed tokens at -inf)",
    reference=reference_top_p,
    forbid=("minillm.sampler.sampling.top_p_filter",),
)


def _top_p_hint(got: torch.Tensor, expected: torch.Tensor) -> str:
    extra = (got & ~expected).any()
    missing = (expected & ~got).any()
    if extra and not missing:
        return ("you keep too many: drop a token once the tokens ranked ABOVE it already hold p "
                "(cumulative sum minus the token's own probability >= p).")
    if missing and not extra:
        return "you keep too few: the token whose probability makes the mass reach p is kept."
    return ("sort each row by probability (descending), decide in sorted order, then put the decision back in "
            "vocabulary order (scatter with the sort's indices).")


@top_p.test("matches minillm on random [4, 50] logits at p = 0.9")
def _(fn: Callable) -> None:
    _check_filter(fn, _logits(1, (4, 50)), 0.9, reference_top_p, "top_p_filter(logits, 0.9)", _top_p_hint)


@top_p.test("a tiny p keeps exactly the most likely token")
def _(fn: Callable) -> None:
    _check_filter(fn, _logits(2, (3, 20)), 1e-4, reference_top_p, "top_p_filter(logits, 1e-4)", _top_p_hint)


@top_p.test("p = 1 keeps every token")
def _(fn: Callable) -> None:
    _check_filter(fn, _logits(3, (2, 30)), 1.0, reference_top_p, "top_p_filter(logits, 1.0)",
                  lambda g, e: "p = 1 means off: the whole distribution has mass 1, so nothing is dropped.")


@top_p.test("a hand-made row: probabilities 0.5, 0.3, 0.15, 0.05 at p = 0.75 keep two tokens")
def _(fn: Callable) -> None:
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()  # the most likely token is not first
    _check_filter(fn, logits, 0.75, reference_top_p, "top_p_filter(log [0.15, 0.5, 0.05, 0.3], 0.75)", _top_p_hint)


# ---- 01.min_p ---------------------------------------------------------------------------------------


def reference_min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Min-p filter: keep tokens with probability >= p x the row's largest probability. [B, V] -> [B, V]."""
    return sampling.min_p_filter(logits, p)


min_p = register_task(
    "01.min_p",
    "min_p_filter(logits: Tensor[B, V], p: float) -> Tensor[B, V]  (removed tokens at -inf)",
    reference=reference_min_p,
    forbid=("minillm.sampler.sampling.min_p_filter",),
)


def _min_p_hint(got: torch.Tensor, expected: torch.Tensor) -> str:
    return ("compare probabilities (softmax of the row), not logits: keep a token when its probability is at "
            "least p times the row's LARGEST probability.")


@min_p.test("matches minillm on random [4, 50] logits at p = 0.1")
def _(fn: Callable) -> None:
    _check_filter(fn, _logits(4, (4, 50)), 0.1, reference_min_p, "min_p_filter(logits, 0.1)", _min_p_hint)


@min_p.test("the threshold scales with the top probability: a confident row keeps fewer tokens")
def _(fn: Callable) -> None:
    flat = torch.zeros(1, 10)
    peaked = torch.tensor([[6.0, 2, 1.5, 1, 0.5, 0, -0.5, -1, -1.5, -2]])
    _check_filter(fn, torch.cat([flat + torch.linspace(0, 0.5, 10), peaked]), 0.05, reference_min_p,
                  "min_p_filter([flat row, peaked row], 0.05)", _min_p_hint)


@min_p.test("p = 0 keeps every token, p = 1 only the most likely")
def _(fn: Callable) -> None:
    logits = _logits(5, (3, 25))
    _check_filter(fn, logits, 0.0, reference_min_p, "min_p_filter(logits, 0.0)",
                  lambda g, e: "p = 0 means off: every probability is >= 0 x the maximum.")
    _check_filter(fn, logits, 1.0, reference_min_p, "min_p_filter(logits, 1.0)",
                  lambda g, e: "p = 1 keeps only tokens as likely as the most likely one.")


@min_p.test("large logits (up to 300) do not overflow")
def _(fn: Callable) -> None:
    _check_filter(fn, _logits(6, (2, 40), scale=100.0), 0.01, reference_min_p, "min_p_filter(100 x logits, 0.01)",
                  _min_p_hint)


# ---- 01.repetition_penalty --------------------------------------------------------------------------


def reference_repetition_penalty(logits: torch.Tensor, token_ids: list[list[int]], penalty: float) -> torch.Tensor:
    """Seen tokens: positive logits / penalty, negative logits x penalty. logits [B, V], B lists of ids."""
    return sampling.apply_repetition_penalty(logits, token_ids, penalty)


repetition_penalty = register_task(
    "01.repetition_penalty",
    "apply_repetition_penalty(logits: Tensor[B, V], token_ids: list[list[int]], penalty: float) -> Tensor[B, V]",
    reference=reference_repetition_penalty,
    forbid=("minillm.sampler.sampling.apply_repetition_penalty",),
)


def _check_penalty(fn: Callable, logits: torch.Tensor, ids: list[list[int]], penalty: float, what: str) -> None:
    got = fn(logits.clone(), [list(r) for r in ids], penalty)
    expected = reference_repetition_penalty(logits, ids, penalty)
    hint = "for each token in the row's history: logit / penalty if the logit > 0, logit x penalty otherwise."
    if isinstance(got, torch.Tensor) and got.shape == expected.shape:
        got_f = got.float()
        unseen = ~(sampling.token_counts(ids, logits.shape[-1]) > 0)
        if not torch.allclose(got_f[unseen], expected[unseen]):
            hint = "only tokens that occur in the row's own history change; leave every other logit as it is."
        elif torch.allclose(got_f, torch.where(unseen, logits, logits / penalty)):
            hint = ("dividing a NEGATIVE logit by the penalty raises it (makes the token more likely): multiply "
                    "negative logits instead.")
        elif len(set(ids[0])) < len(ids[0]):
            hint = "apply the penalty once per distinct token, however many times it occurred."
    expect_close(got, expected, what, hint)


@repetition_penalty.test("positive logits are divided, negative ones multiplied")
def _(fn: Callable) -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    _check_penalty(fn, logits, [[0, 1, 3]], 2.0, "apply_repetition_penalty([2, -1, .5, -3, 1], [[0, 1, 3]], 2.0)")


@repetition_penalty.test("once per token, however often it repeats; other tokens untouched")
def _(fn: Callable) -> None:
    _check_penalty(fn, _logits(7, (1, 30)), [[4, 4, 4, 9, 4]], 1.3,
                   "apply_repetition_penalty(logits, [[4, 4, 4, 9, 4]], 1.3)")


@repetition_penalty.test("each row uses its own history (rows of different lengths)")
def _(fn: Callable) -> None:
    _check_penalty(fn, _logits(8, (3, 40)), [[1, 2, 3], [], [39, 0]], 1.5,
                   "apply_repetition_penalty(logits [3, 40], [[1,2,3], [], [39,0]], 1.5)")


@repetition_penalty.test("penalty 1 changes nothing")
def _(fn: Callable) -> None:
    _check_penalty(fn, _logits(9, (2, 16)), [[1, 5], [2]], 1.0, "apply_repetition_penalty(logits, ..., 1.0)")


# ---- 01.beam_step -----------------------------------------------------------------------------------


def reference_beam_step(logprobs: torch.Tensor, beam_scores: torch.Tensor, num_beams: int,
                        num_candidates: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best candidates over every (beam, token) pair, scored beam_scores[b] + logprobs[b, t]:
    (next_scores [K] best first, parent_idx [K], token_idx [K]), K = num_candidates or 2 x num_beams."""
    return beam_step(logprobs, beam_scores, num_beams, num_candidates)


beam = register_task(
    "01.beam_step",
    "beam_step(logprobs: Tensor[num_beams, V], beam_scores: Tensor[num_beams], num_beams: int, "
    "num_candidates: int | None = None) -> (next_scores[K], parent_idx[K], token_idx[K])",
    reference=reference_beam_step,
    forbid=("minillm.decoding.beam.beam_step",),
)

FLATTEN_HINT = ("rank all num_beams x V candidates together: add beam_scores[:, None] to logprobs, flatten to "
                "[num_beams * V] and take the topk of that. The top tokens of each beam taken separately miss the "
                "best candidates when one strong beam should supply most (or all) of them.")
INDEX_HINT = ("in the flattened [num_beams * V] candidates, (beam b, token t) sits at b * V + t, so parent = flat // V "
              "and token = flat % V, with V = logprobs.shape[-1], the vocabulary size (not num_beams).")
CUMULATIVE_HINT = ("a candidate's score is its beam's cumulative log-probability plus the token's: "
                   "beam_scores[b] + logprobs[b, t]. The next token's log-probability alone forgets the past.")
FIRST_STEP_NOTE = (" At the first step every beam is a copy of the prompt; the others start at -1e9 so that adding "
                   "their score keeps their candidates, the same tokens as beam 0's, out of the top.")


def _logprobs(seed: int, shape: tuple[int, int], scale: float = 2.0) -> torch.Tensor:
    """Random next-token log-probabilities, one row per beam (no ties)."""
    return _logits(seed, shape, scale).log_softmax(dim=-1)


def _rounded(x: torch.Tensor) -> str:
    return str([round(v, 3) for v in x.tolist()])


def _candidates(parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor) -> str:
    shown = [f"(beam {p}, token {t}: {s:.3f})" for p, t, s in zip(parents.tolist(), tokens.tolist(), scores.tolist())]
    return ", ".join(shown[:4]) + (" ..." if len(shown) > 4 else "")


def _check_beam_step(fn: Callable, logprobs: torch.Tensor, beam_scores: torch.Tensor, num_beams: int,
                     num_candidates: int | None, what: str, first_step: bool = False) -> None:
    """Compare the reader's beam_step with the reference and name the likely mistake on a mismatch."""
    note = FIRST_STEP_NOTE if first_step else ""
    args = (logprobs.clone(), beam_scores.clone(), num_beams) + (() if num_candidates is None else (num_candidates,))
    got = fn(*args)
    exp_scores, exp_parents, exp_tokens = reference_beam_step(logprobs, beam_scores, num_beams, num_candidates)
    k = len(exp_scores)
    if not (isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(x, torch.Tensor) for x in got)):
        came = f"a {type(got).__name__}"
        if isinstance(got, (tuple, list)):
            came += f" of {len(got)}: " + ", ".join(type(x).__name__ for x in got)
        raise MismatchError(what, "a tuple of three tensors (next_scores, parent_idx, token_idx)", came,
                            "return the three as torch tensors; topk's values and indices give all of them.")
    scores, parents, tokens = (x.detach() for x in got)
    if any(x.shape != (k,) for x in (scores, parents, tokens)):
        shapes = ", ".join(str(tuple(x.shape)) for x in (scores, parents, tokens))
        raise MismatchError(what, f"three tensors of shape ({k},)", f"shapes {shapes}",
                            "return num_candidates candidates, 2 * num_beams when it is None: up to num_beams of "
                            "them may end in EOS, and num_beams must still be left to continue.")
    if parents.is_floating_point() or tokens.is_floating_point():
        raise MismatchError(what, "integer parent_idx and token_idx", f"dtypes {parents.dtype}, {tokens.dtype}",
                            "use integer division, flat // V: flat / V gives floats. " + INDEX_HINT)
    scores, parents, tokens = scores.float(), parents.long(), tokens.long()
    indices_right = torch.equal(parents, exp_parents) and torch.equal(tokens, exp_tokens)
    if torch.allclose(scores, exp_scores, atol=1e-5, rtol=1e-5) and not indices_right:
        raise MismatchError(what, f"(parent, token) pairs {_candidates(exp_parents, exp_tokens, exp_scores)}",
                            _candidates(parents, tokens, scores), "the scores are right but not the indices: " +
                            INDEX_HINT)
    num_rows, vocab = logprobs.shape
    if not (0 <= parents.min() and parents.max() < num_rows and 0 <= tokens.min() and tokens.max() < vocab):
        raise MismatchError(what, f"parents in [0, {num_rows}) and tokens in [0, {vocab})",
                            f"parents {parents.tolist()}, tokens {tokens.tolist()}", INDEX_HINT)
    own = beam_scores[parents] + logprobs[parents, tokens]  # what each returned candidate should score
    if not torch.allclose(scores, own, atol=1e-5, rtol=1e-5):
        if torch.allclose(scores, logprobs[parents, tokens], atol=1e-5, rtol=1e-5):
            hint = CUMULATIVE_HINT + note
        else:
            hint = "next_scores[i] must be beam_scores[parent_idx[i]] + logprobs[parent_idx[i], token_idx[i]]." + note
        raise MismatchError(what, f"for your own (parent, token) pairs, scores {_rounded(own)}", _rounded(scores),
                            hint)
    mine = set(zip(parents.tolist(), tokens.tolist()))
    missed = [i for i, pair in enumerate(zip(exp_parents.tolist(), exp_tokens.tolist())) if pair not in mine]
    if missed:
        i = missed[0]
        by_token_alone = logprobs.reshape(-1).topk(k).indices
        if mine == set(zip((by_token_alone // vocab).tolist(), (by_token_alone % vocab).tolist())):
            hint = "you ranked the candidates by the next token's log-probability alone: " + CUMULATIVE_HINT + note
        else:
            hint = FLATTEN_HINT + note
        raise MismatchError(what, f"beam {int(exp_parents[i])}, token {int(exp_tokens[i])} (score "
                                  f"{float(exp_scores[i]):.3f}) among the best {k}",
                            f"candidates without it (your worst score: {float(scores.min()):.3f})", hint)
    if not bool((scores[:-1] >= scores[1:]).all()):
        raise MismatchError(what, f"scores best first {_rounded(exp_scores)}", _rounded(scores),
                            "the right candidates in the wrong order: sort them best first (topk does, by default); "
                            "the caller takes the first num_beams that do not end.")
    expect_close(scores, exp_scores, what, "return the scores best first.")


@beam.test("matches minillm on 4 beams over 50 tokens (2 x num_beams candidates by default)")
def _(fn: Callable) -> None:
    _check_beam_step(fn, _logprobs(10, (4, 50)), torch.tensor([-2.1, -2.6, -3.4, -5.0]), 4, None,
                     "beam_step(logprobs [4, 50], beam_scores, num_beams=4)")


@beam.test("a strong beam supplies every candidate: beam scores -1, -40, -45")
def _(fn: Callable) -> None:
    _check_beam_step(fn, _logprobs(11, (3, 20)), torch.tensor([-1.0, -40.0, -45.0]), 3, None,
                     "beam_step(logprobs [3, 20], [-1, -40, -45], num_beams=3)")


@beam.test("the cumulative score decides: a weak beam's confident token loses to a strong beam's")
def _(fn: Callable) -> None:
    logprobs = torch.stack([(_logits(12, (1, 12))[0] * 0.1).log_softmax(-1),  # beam 0: flat, about -2.5 each
                            torch.tensor([6.0] + [-2.0] * 11).log_softmax(-1),  # beam 1: token 0 at about -0.004
                            _logprobs(13, (1, 12))[0]])
    _check_beam_step(fn, logprobs, torch.tensor([-0.5, -6.0, -3.0]), 3, None,
                     "beam_step(logprobs [3, 12], [-0.5, -6, -3], num_beams=3)")


@beam.test("the first step: every beam is the prompt, scores [0, -1e9, -1e9]")
def _(fn: Callable) -> None:
    logprobs = _logprobs(14, (1, 30)).expand(3, -1).contiguous()  # three copies of the prompt's distribution
    _check_beam_step(fn, logprobs, torch.tensor([0.0, NO_BEAM, NO_BEAM]), 3, None,
                     "beam_step(the prompt's logprobs x 3, [0, -1e9, -1e9], num_beams=3)", first_step=True)


@beam.test("num_candidates = 3 x num_beams (as with two EOS ids), over a 7-token vocabulary")
def _(fn: Callable) -> None:
    _check_beam_step(fn, _logprobs(15, (2, 7)), torch.tensor([-1.2, -1.5]), 2, 6,
                     "beam_step(logprobs [2, 7], [-1.2, -1.5], num_beams=2, num_candidates=6)")


# ---- 01.regex_mask ----------------------------------------------------------------------------------


def reference_allowed_tokens(dfa: RegexDFA, state: int, token_bytes: list[bytes | None]) -> torch.Tensor:
    """Which tokens may come next in DFA state `state`: bool [V], True where walking the token's bytes
    never reaches the dead state (special tokens, given as None, and empty tokens never)."""
    return TokenIndex(dfa, token_bytes, eos_token_ids=()).mask[state].clone()


regex_mask = register_task(
    "01.regex_mask",
    "allowed_tokens(dfa: RegexDFA, state: int, token_bytes: list[bytes | None]) -> BoolTensor[V]",
    reference=reference_allowed_tokens,
    forbid=("minillm.sampler.constrained.TokenIndex",),
)

TOY_VOCAB: list[bytes | None] = [None, b"1", b"12", b"2-", b"-", b"-ab", b"a", b"ab", b"abc", b"9x", b"x",
                                 b"", b"123", b"3-a", b"\xc3", b"\xa9", b"\xc3\xa9", None]


def _check_mask(fn: Callable, pattern: str, prefix: bytes, vocab: list[bytes | None], what: str) -> None:
    dfa = RegexDFA(pattern)
    state = dfa.walk(dfa.start, prefix)
    got = fn(dfa, state, list(vocab))
    expected = reference_allowed_tokens(dfa, state, vocab)
    if isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == torch.bool:
        if torch.equal(got, expected):
            return
        wrong = [i for i in range(len(vocab)) if bool(got[i]) != bool(expected[i])]
        i = wrong[0]
        piece = vocab[i]
        if piece is None:
            hint = "special tokens (None) are control signals, not text: never allow them."
        elif piece == b"":
            hint = "an empty token (no bytes) is never allowed: it would not move the text forward."
        elif expected[i]:
            hint = (f"token {i} ({piece!r}) should be allowed: a token may end in the middle of the pattern; it "
                    "only has to avoid the dead state (DEAD = -1) at every byte.")
        else:
            hint = (f"token {i} ({piece!r}) must be refused: walk EVERY byte of it with dfa.step and refuse it as "
                    "soon as one step returns DEAD.")

        def ids(mask: torch.Tensor) -> str:
            allowed = mask.nonzero().flatten().tolist()
            return f"{len(allowed)} allowed: {allowed[:8]}{' ...' if len(allowed) > 8 else ''}"

        raise MismatchError(what, ids(expected), f"{ids(got)}; {len(wrong)} tokens differ", hint)
    expect_close(got, expected, what, "return a torch.bool tensor with one entry per vocabulary token.")


@regex_mask.test("at the start of [0-9]{2}-[a-z]+ (toy vocabulary)")
def _(fn: Callable) -> None:
    _check_mask(fn, "[0-9]{2}-[a-z]+", b"", TOY_VOCAB, "allowed_tokens(dfa('[0-9]{2}-[a-z]+'), start)")


@regex_mask.test("mid-pattern: after '12' only tokens that begin with '-' fit")
def _(fn: Callable) -> None:
    _check_mask(fn, "[0-9]{2}-[a-z]+", b"12", TOY_VOCAB, "allowed_tokens(dfa, state after '12')")


@regex_mask.test("multi-byte characters: a token may hold half of 'é'")
def _(fn: Callable) -> None:
    _check_mask(fn, "(é|a)+", b"a", TOY_VOCAB, "allowed_tokens(dfa('(é|a)+'), state after 'a')")


@regex_mask.test("the shipped tokenizer's 4,096 tokens, after '\"name\": \"' in a JSON-like pattern")
def _(fn: Callable) -> None:
    from minillm.checkpoints import find_model_folder
    from minillm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(find_model_folder("shakespeare-1m") / "tokenizer.json")
    _check_mask(fn, '\\{"name": "[A-Z][a-z]{1,12}"\\}', b'{"name": "', vocabulary_bytes(tokenizer),
                "allowed_tokens(JSON-like pattern, after '{\"name\": \"', shipped vocabulary)")
