"""AWQ: scale up the weights of the input channels that carry large activations before rounding (chapter 06).

Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration"
(MLSys 2024). A few input channels carry much larger activations than the rest; the weights
they multiply matter most, yet round-to-nearest treats every weight alike. Multiplying input
channel i's weights by s_i > 1 (and dividing its activation by s_i, which leaves the product
unchanged) makes those weights' *relative* rounding error smaller, while the group's scale barely
moves. The scales come from the activations alone, s = mean|x|^alpha (normalised), and the
exponent alpha in [0, 1) is found by grid search on the calibration set, minimising the layer's
output error ||(X / s) Q(W * s)^T - X W^T||^2 (s multiplies W's columns, divides X's).
No weight is kept in higher precision, and no backpropagation or Hessian is needed.

Here the 1/s rides on `QuantLinear.input_scale`; the paper folds it into the previous operator
(the RMSNorm weight before qkv_proj and gate_up_proj, v_proj before o_proj, up_proj before down_proj),
so that it costs nothing at run time. The paper's second step, a search for clipping the weight
range, is left out.
"""

from __future__ import annotations

import torch
from torch import nn

from minillm.quant.calibration import BlockByBlock, blocks_in_order
from minillm.quant.formats import Granularity, quantize_int
from minillm.quant.linear import QuantLinear, set_module


def awq_scale_search(
    W: torch.Tensor, X: torch.Tensor, bits: int = 4, group_size: Granularity = 128, grid: int = 20
) -> tuple[torch.Tensor, float, list[float]]:
    """The best per-input-channel scales for W [out, in] given calibration inputs X [n, in].

    Returns (s [in], best alpha, output error for each alpha of the grid 0, 1/grid, ..., (grid-1)/grid).
    alpha = 0 is plain round-to-nearest (s = 1).
    """
    W, X = W.float(), X.float()
    reference = X @ W.T
    mean_abs = X.abs().mean(0).clamp(min=1e-5)
    best, errors = None, []
    for i in range(grid):
        alpha = i / grid
        s = mean_abs.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 (the paper's normalisation)
        W_q = quantize_int(W * s, bits, group_size, symmetric=False).dequantize() / s
        err = (X @ W_q.T - reference).pow(2).mean().item()
        errors.append(err)
        if best is None or err < best[1]:
            best = (s, err, alpha)
    return best[0], best[2], errors


@torch.no_grad()
def awq_quantize_model(
    model: nn.Module, calibration: torch.Tensor, bits: int = 4, group_size: Granularity = 128, grid: int = 20,
    max_tokens: int = 4096,
) -> dict[str, float]:
    """Replace every block linear by its AWQ `QuantLinear`, block by block. Returns {layer: chosen alpha}.

    At most `max_tokens` calibration tokens per layer enter the search (the error is a mean).
    """
    if bits == 8:
        group_size = "channel"
    alphas = {}
    runner = BlockByBlock(model, calibration)
    for block in blocks_in_order(model):
        inputs = runner.capture(block)
        for name, linear in block.items():
            X = inputs[name][:max_tokens]
            s, alphas[name], _ = awq_scale_search(linear.weight.data.cpu(), X, bits, group_size, grid)
            q = quantize_int(linear.weight.data.cpu().float() * s, bits, group_size, symmetric=False)
            layer = QuantLinear(q, linear.bias, input_scale=s).to(linear.weight.device)
            set_module(model, name, layer)
        runner.advance()
    return alphas
