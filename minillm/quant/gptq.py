"""GPTQ: round the weights one input column at a time; the columns not yet rounded absorb the error (chapter 06).

Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers" (ICLR 2023), after Optimal Brain Quantization. For one linear layer with inputs
X [n, in] and weight W [out, in], find the quantised W' minimising the output error
||X W'^T - X W^T||^2. Its Hessian in each row of W is H = 2 X^T X / n [in, in] (the same for
every row). Rounding column j moves the output by (w_j - q_j) x_j; the least-squares best
correction to the columns after j is

    W[:, j+1:] -= (w_j - q_j) / [H^-1]_jj * [H^-1]_{j, j+1:}

with H^-1 the inverse Hessian *of the columns not yet rounded*. The paper's trick: those inverses
are all rows of one upper Cholesky factor U of H^-1 (U^T U = H^-1), so the loop needs U once:
the error is (w_j - q_j) / U_jj and the correction row is U_{j, j+1:}. Updates are applied to a
block of 128 columns at a time and to the rest in one matrix multiply ("lazy batch updates").
A damping of 1% of H's mean diagonal keeps H invertible.

Group scales are fitted on the *updated* columns when a group starts, as the reference
implementation does. Layers are quantised block by block, each block's inputs computed by the
blocks before it already quantised (the errors of earlier blocks are seen and compensated).
"""

from __future__ import annotations

import torch
from torch import nn

from minillm.quant.calibration import BlockByBlock, blocks_in_order
from minillm.quant.formats import Granularity, IntQuantized, int_grid, int_quantized, int_round
from minillm.quant.linear import QuantLinear, set_module


def hessian(x: torch.Tensor) -> torch.Tensor:
    """H = 2 X^T X / n for inputs x [n, in]: [in, in] fp64."""
    x = x.double()
    return 2 * x.T @ x / x.shape[0]


def inverse_hessian_factor(H: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """U, upper triangular with U^T U = (H + damp * mean(diag H) * I)^-1. [in, in] fp64.

    Row j of U, from the diagonal on, is the (scaled) inverse Hessian row of the columns j.. that
    GPTQ still has to round when it reaches column j.
    """
    H = H.double().clone()
    H += damp * H.diagonal().mean() * torch.eye(len(H), dtype=H.dtype, device=H.device)
    H_inv = torch.cholesky_inverse(torch.linalg.cholesky(H))
    return torch.linalg.cholesky(H_inv, upper=True)


def quantize_column(
    W: torch.Tensor, U: torch.Tensor, j: int, scale: torch.Tensor, zero: torch.Tensor | None, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round column j of W [out, n] and push its error onto columns j+1.. (in place). One GPTQ step.

    U [n, n] is the inverse Hessian's upper Cholesky factor for these n columns; scale, zero [out]
    the grid of column j's group. Returns (codes [out] as fp32 integers, scaled error [out]).
    """
    w = W[:, j]
    q = int_round(w[:, None], scale, zero, bits)[:, 0]
    dequantized = (q - (0 if zero is None else zero)) * scale
    err = (w - dequantized) / U[j, j]
    W[:, j + 1 :] -= err[:, None] * U[j, j + 1 :][None, :]
    return q, err


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    bits: int = 4,
    group_size: Granularity = 128,
    symmetric: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
) -> IntQuantized:
    """GPTQ one weight W [out, in] with its inputs' Hessian H [in, in] (see `hessian`)."""
    out_features, cols = W.shape
    W = W.double().clone()
    H = H.double().clone()
    dead = H.diagonal() == 0  # inputs that were always 0: their weights never matter
    H[dead, dead] = 1
    W[:, dead] = 0
    U = inverse_hessian_factor(H, damp)
    if group_size != "channel" and not isinstance(group_size, int):
        raise ValueError(f"GPTQ takes group_size 'channel' or a number of columns, got {group_size!r} "
                         "(a per-tensor grid would be fitted before any column is updated: use round-to-nearest).")
    g = cols if group_size == "channel" else group_size
    if g <= 0 or cols % g:
        raise ValueError(f"group_size {group_size} must divide the {cols} input columns.")
    block_size = g * max(1, block_size // g) if g < cols else block_size
    n_groups = cols // g
    scale = torch.zeros(out_features, n_groups, dtype=torch.float64)
    zero = None if symmetric else torch.zeros(out_features, n_groups, dtype=torch.float64)
    Q = torch.zeros_like(W)
    if g == cols:  # per channel: one grid per row, fitted to the weights before any update
        s, z = int_grid(W, bits, symmetric)
        scale[:, 0] = s
        if zero is not None:
            zero[:, 0] = z
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        E = torch.zeros_like(W1)
        for j in range(i2 - i1):
            col = i1 + j
            if g < cols and col % g == 0:  # a new group: fit its grid to the columns as updated so far
                s, z = int_grid(W1[:, j : j + g], bits, symmetric)
                scale[:, col // g] = s
                if zero is not None:
                    zero[:, col // g] = z
            z = None if zero is None else zero[:, col // g]
            Q[:, col], E[:, j] = quantize_column(W1, U1, j, scale[:, col // g], z, bits)
        W[:, i2:] -= E @ U[i1:i2, i2:]  # the block's errors, pushed onto every later column at once
    return int_quantized(Q.float(), scale.float(), None if zero is None else zero.float(), bits, g)


@torch.no_grad()
def gptq_quantize_model(
    model: nn.Module, calibration: torch.Tensor, bits: int = 4, group_size: Granularity = 128, damp: float = 0.01
) -> nn.Module:
    """Replace every block linear by its GPTQ `QuantLinear`, block by block (see the module docstring)."""
    symmetric = bits == 8  # as round-to-nearest: int8 symmetric per channel, fewer bits asymmetric per group
    runner = BlockByBlock(model, calibration)
    for block in blocks_in_order(model):
        Hs = runner.capture(block, reduce=lambda x: 2 * x.double().T @ x.double())
        n_tokens = calibration.numel()
        for name, linear in block.items():
            q = gptq_quantize(linear.weight.data.cpu(), Hs[name] / n_tokens, bits,
                              "channel" if bits == 8 else group_size, symmetric, damp)
            layer = QuantLinear(q, linear.bias).to(linear.weight.device)
            set_module(model, name, layer)
        runner.advance()
    return model
