"""The few small helpers the engine needs on every step: block counts, and copies to the device.

* `cdiv`, `kv_blocks`: how many blocks hold so many tokens. `minillm.arithmetic` is chapter 02's whiteboard
  (bytes, FLOPs, rooflines, costs), 900 lines an engine file has no reason to import; it uses these two from here.
* `to_device`: host-to-device copies that do not make the host wait for the GPU (chapter 05).

`torch.tensor(values, device="cuda")`, or `.to("cuda")` of an ordinary host tensor, copies from pageable
memory, and CUDA makes such a copy wait until every kernel queued before it has finished: the host stops
at each one. An engine that prepares step t + 1 while the GPU runs step t (async scheduling,
`minillm.engine.llm_engine`) must never stop there, so its small per-step inputs go through pinned
(page-locked) host memory, from which the copy is queued like a kernel and the host moves on.

    ids = to_device([3, 1, 4], torch.int64, device)    # [3] on device; on a CPU, just the tensor
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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


def to_device(values: torch.Tensor | Sequence, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
    """`values` (a host tensor, or numbers / nested lists) on `device` as `dtype` (None: keep the tensor's or infer).

    To a CUDA device the copy leaves from pinned memory without blocking the host; the pinned staging
    buffer comes from PyTorch's caching host allocator, which does not reuse it before the copy is done. (Asked for
    with `torch.empty(..., pin_memory=True)`, not `host.pin_memory()`, whose check of the source's memory,
    `is_pinned`, took about 0.36 ms a call on an H200 host in a profile of a mixed step: two calls a step.)
    """
    device = torch.device(device)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    return pinned.copy_(host).to(device, non_blocking=True)
