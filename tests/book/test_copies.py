"""A copy of the grader's reference with its names changed is still a copy (issue 55).

Two looks: the call watcher's fingerprint of code objects (in the sandbox, where a matched call gets no credit)
sets aside local names and the docstring; the grader's source check compares the answer's `def` with the
reference's once names and docstrings are normalised away, and shows the teacher the similarity (a review flag).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time

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


def test_the_sandbox_knows_a_renamed_copy_by_a_digest_and_never_receives_the_reference(tmp_path, needs_bwrap):
    """The watcher runs in the sandbox on digests the grader sent (fingerprints and references stay here), and
    knows a copy compiled in a notebook cell (where `torch.full` is a method load, not an attribute load); the
    task modules are an empty folder there, so the notebook cannot read the reference it would need to copy."""
    import nbformat
    import torch

    from minillm.book.grading.sandbox import Sandbox, watch_list

    digests = watch_list(FORBIDDEN)["codes"]
    assert list(digests.values()) == [FORBIDDEN[0]] and all(len(d) == 64 for d in digests)
    path = tmp_path / "copy.ipynb"
    reads = ("import pathlib, minillm\ntasks = pathlib.Path(minillm.__file__).parent / 'book' / 'grading' / 'tasks'\n"
             "seen = sorted(p.name for p in tasks.iterdir())")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(RENAMED_COPY),
                                                   nbformat.v4.new_code_cell(reads)]), path)
    q, k, v = torch.randn(3, 8), torch.randn(10, 8), torch.randn(10, 8)
    with Sandbox(path, timeout_s=120) as box:
        box.start()
        got, forbidden = box.call("online_attention", (q, k, v, 4), {}, FORBIDDEN, time.monotonic() + 60,
                                  task="02.online_softmax")
        seen, _ = box.call("lambda: seen", (), {}, (), time.monotonic() + 30)
    assert forbidden == []  # not a call of the reference (it is not there to call), but a copy of it: a flag
    assert {"flag": f"ran a copy of {FORBIDDEN[0]}: the same instructions once names and docstrings are set aside",
            "task": "02.online_softmax"} in box.flags, box.flags
    assert torch.allclose(got, torch.softmax(q @ k.T * 8 ** -0.5, -1) @ v, atol=1e-5)
    assert seen == [], seen


def test_a_fingerprints_digest_is_the_same_in_every_process():
    """A set constant's repr follows string hashing, which differs per process (PYTHONHASHSEED): the digest the
    grader computes must still be the one the sandbox computes."""
    code = ("from minillm.book.grading.sandbox import fingerprint_digest\n"
            "def f(mode):\n    return mode in {'alpha', 'beta', 'gamma', 'delta', 'epsilon'}\n"
            "print(fingerprint_digest(f.__code__))")
    digests = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(seed)},
                              capture_output=True, text=True, check=True).stdout for seed in (1, 2, 3)}
    assert len(digests) == 1, digests
