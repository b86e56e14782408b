"""The batched LoRA matmul in plain PyTorch: the references of `minillm.kernels.lora` (chapter 08, issue 32).

Needs no Triton, so the engine runs `add_lora_reference` on every device but CUDA (as `gather_kv` beside the
paged kernel). The shapes and the contract are in `minillm.kernels.lora`'s docstring:

    y[n] += lora_b[s] @ (lora_a[s] @ x[n])       for every row n with s = slot_ids[n] >= 0
"""

from __future__ import annotations

import torch


def _check(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
           slot_ids: torch.Tensor) -> None:
    """ValueError unless y [N, out], x [N, in], lora_a [S, r, in], lora_b [S, out, r], slot_ids [N]."""
    if x.dim() != 2 or y.dim() != 2 or lora_a.dim() != 3 or lora_b.dim() != 3 or slot_ids.dim() != 1:
        raise ValueError(f"expected y [N, out], x [N, in], lora_a [S, r, in], lora_b [S, out, r], slot_ids [N]; got "
                         f"{tuple(y.shape)}, {tuple(x.shape)}, {tuple(lora_a.shape)}, {tuple(lora_b.shape)}, "
                         f"{tuple(slot_ids.shape)}.")
    (N, d_in), (S, r, _), out = x.shape, lora_a.shape, y.shape[1]
    if (y.shape[0], slot_ids.shape[0], lora_a.shape[2], tuple(lora_b.shape)) != (N, N, d_in, (S, out, r)):
        raise ValueError(f"shapes disagree: y {tuple(y.shape)}, x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, "
                         f"lora_b {tuple(lora_b.shape)}, slot_ids {tuple(slot_ids.shape)}.")


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       slot_ids: torch.Tensor) -> torch.Tensor:
    """y[n] += lora_b[s] @ lora_a[s] @ x[n] for each row n with s = slot_ids[n] >= 0, in place; returns y.

    y [N, out] (may be a column slice of a wider tensor), x [N, in], lora_a [S, r, in], lora_b [S, out, r],
    slot_ids [N] int. One pass per adapter present in the batch: its rows gathered, two small matmuls, added
    back (`index_add_`). Costs one host read of the distinct slots (fine on a CPU, where this runs).
    """
    _check(y, x, lora_a, lora_b, slot_ids)
    for s in torch.unique(slot_ids).tolist():
        if s < 0:
            continue  # rows of the base model
        rows = (slot_ids == s).nonzero().squeeze(1)  # [n_s]
        shrunk = x.index_select(0, rows) @ lora_a[s].T  # [n_s, r]
        y.index_add_(0, rows, (shrunk @ lora_b[s].T).to(y.dtype))  # [n_s, out]
    return y


def add_lora_gathered(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      slot_ids: torch.Tensor) -> torch.Tensor:
    """The same as `add_lora_reference`, as every row gathering its own matrices: lora_a[slot_ids] [N, r, in]
    and lora_b[slot_ids] [N, out, r], then two batched matmuls (rows with slot -1 masked out). In place; returns y.

    The plainest statement of BGMV, but it copies N x r x (in + out) weights: fine for a decode batch,
    wasteful for a long prompt (where `add_lora_reference`, one pass per adapter, reads each adapter once).
    """
    _check(y, x, lora_a, lora_b, slot_ids)
    keep = (slot_ids >= 0).to(x.dtype)[:, None]  # [N, 1]
    safe = slot_ids.clamp(min=0).long()
    shrunk = torch.bmm(lora_a[safe], x[:, :, None])  # [N, r, 1]
    y += (torch.bmm(lora_b[safe], shrunk)[:, :, 0] * keep).to(y.dtype)  # [N, out]
    return y
