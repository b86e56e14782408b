"""The few small helpers the engine needs from arithmetic it does on every step: block counts.

`minillm.arithmetic` is chapter 02's whiteboard (bytes, FLOPs, rooflines, costs), 900 lines an engine file has no
reason to import; it uses these two functions too, from here.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers, ceil(a / b) for b > 0: how many blocks of `b` hold `a` items.

    -(-a // b): floor division of the negation rounds towards minus infinity, so negating it back
    rounds up, exactly (float division, math.ceil(a / b), is off for integers beyond 2^53).
    """
    return -(-a // b)


def kv_blocks(seq_len: int, block_size: int = 16) -> int:
    """KV blocks a sequence of `seq_len` tokens occupies under paging: ceil(seq_len / block_size).

    Units: blocks. Introduced in chapter 04.
    """
    for name, value, allow_zero in (("seq_len", seq_len, True), ("block_size", block_size, False)):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN
        if not ok or (value < 0 if allow_zero else value <= 0):
            want = "a non-negative" if allow_zero else "a positive"
            raise ValueError(f"{name} must be {want} number, got {value!r}.")
    return cdiv(seq_len, block_size)
