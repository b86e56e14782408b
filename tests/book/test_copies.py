"""A copy of the grader's reference with its names changed is still a copy (issue 55).

Two looks: the call watcher's fingerprint of code objects (in the sandbox, where a matched call gets no credit)
sets aside local names and the docstring; the grader's source check compares the answer's `def` with the
reference's once names and docstrings are normalised away, and shows the teacher the similarity (a review flag).
"""

from __future__ import annotations

import ast

from minillm.book.grading.forgery import copied_from, normalised, read_source, similarity
from minillm.book.grading.sandbox import code_fingerprint

RENAMED_COPY = '''
import torch

def online_attention(query, keys, values, bs):
    sc = query.shape[-1] ** -0.5
    top = torch.full((query.shape[0], 1), float("-inf"), dtype=query.dtype)
    den = torch.zeros(query.shape[0], 1, dtype=query.dtype)
    out = torch.zeros(query.shape[0], values.shape[-1], dtype=query.dtype)
    for i in range(0, keys.shape[0], bs):
        scores = (query @ keys[i:i + bs].T) * sc
        new_top = torch.maximum(top, scores.max(dim=-1, keepdim=True).values)
        w = torch.exp(scores - new_top)
        fix = torch.exp(top - new_top)
        den = den * fix + w.sum(dim=-1, keepdim=True)
        out = out * fix + w @ values[i:i + bs]
        top = new_top
    return out / den
'''

HONEST = '''
import torch

def online_attention(q, k, v, block_size):
    """My own: two passes over the blocks, the max first."""
    scale = q.shape[-1] ** -0.5
    blocks = [(k[s:s + block_size], v[s:s + block_size]) for s in range(0, k.shape[0], block_size)]
    m = torch.cat([(q @ kb.T * scale).amax(-1, keepdim=True) for kb, _ in blocks], -1).amax(-1, keepdim=True)
    num, den = 0, 0
    for kb, vb in blocks:
        e = torch.exp(q @ kb.T * scale - m)
        num, den = num + e @ vb, den + e.sum(-1, keepdim=True)
    return num / den
'''

FORBIDDEN = ("minillm.book.grading.tasks.ch02.reference_online_attention",)


def test_a_renamed_copy_of_the_reference_is_flagged_with_its_similarity_and_an_own_answer_is_not():
    copy = copied_from(read_source([RENAMED_COPY]), "online_attention", FORBIDDEN)
    assert copy is not None and copy[0] == FORBIDDEN[0] and copy[1] >= 0.95, copy
    assert copied_from(read_source([HONEST]), "online_attention", FORBIDDEN) is None


def test_normalising_sets_aside_names_docstrings_and_annotations_but_not_what_the_code_does():
    a = ast.parse('def f(x: int, y):\n    """doc"""\n    total = x + y\n    return total * 2').body[0]
    b = ast.parse("def g(a, b):\n    s = a + b\n    return s * 2").body[0]
    c = ast.parse("def g(a, b):\n    s = a - b\n    return s * 2").body[0]
    assert normalised(a) == normalised(b)
    assert normalised(b) != normalised(c) and similarity(normalised(b), normalised(c)) < 1.0


def test_the_call_watchers_fingerprint_ignores_local_names_and_the_docstring():
    def scaled(x, factor):
        """Scales."""
        doubled = x * factor
        return doubled + 1

    def renamed(a, b):
        y = a * b
        return y + 1

    def other(a, b):
        y = a * b
        return y + 2

    assert code_fingerprint(scaled.__code__) == code_fingerprint(renamed.__code__)
    assert code_fingerprint(renamed.__code__) != code_fingerprint(other.__code__)
