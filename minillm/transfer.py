"""Host-to-device copies that do not make the host wait for the GPU (chapter 05).

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


def to_device(values: torch.Tensor | Sequence, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
    """`values` (a host tensor, or numbers / nested lists) on `device` as `dtype` (None: keep the tensor's or infer).

    To a CUDA device the copy leaves from pinned memory without blocking the host; the pinned staging
    buffer comes from PyTorch's caching host allocator, which does not reuse it before the copy is done.
    """
    device = torch.device(device)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
