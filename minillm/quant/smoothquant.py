"""SmoothQuant: move the activations' outliers into the weights, so both quantise to int8 (chapter 06).

Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large Language
Models" (ICML 2023). With int8 activations *and* weights (W8A8) the matmul runs on int8 tensor
cores, but a few input channels of the activations are 10-100x larger than the rest, and one scale
per token must cover them: the small channels round to nothing. Weights are easy to quantise.
Dividing channel j of X by s_j and multiplying column j of W by s_j leaves X W^T unchanged and
moves difficulty from activations to weights; the paper's choice, per input channel,

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

balances the two at alpha = 0.5 (alpha = 1: the activations' whole range moved into the weights;
alpha = 0: the reverse, the weights' column ranges moved into the activations; plain W8A8, with
no migration, is `QuantLinear(act_bits=8)` without an input scale). Here 1/s rides on `QuantLinear.input_scale`; in the
paper it is folded into the previous LayerNorm or linear, and the activations are quantised per
token (dynamic) and the weights per output channel, as `QuantLinear(act_bits=8)` does.
"""

from __future__ import annotations

import torch
from torch import nn

from minillm.quant.calibration import capture_inputs
from minillm.quant.formats import quantize_int
from minillm.quant.linear import QuantLinear, block_linears, set_module


def smoothing_scales(act_absmax: torch.Tensor, W: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """s [in] = max|X_j|^alpha / max|W_j|^(1-alpha), from each input channel's activation absmax [in], W [out, in]."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}.")
    w_absmax = W.float().abs().amax(0).clamp(min=1e-5)
    return (act_absmax.float().clamp(min=1e-5).pow(alpha) / w_absmax.pow(1 - alpha)).clamp(min=1e-5)


@torch.no_grad()
def activation_absmax(model: nn.Module, calibration: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each block linear's largest input magnitude per channel over the calibration set: {name: [in]}."""
    return capture_inputs(model, calibration, block_linears(model), reduce=lambda x: x.abs().amax(0),
                          combine=torch.maximum)


@torch.no_grad()
def smoothquant_model(model: nn.Module, calibration: torch.Tensor, alpha: float = 0.5) -> nn.Module:
    """Replace every block linear by a W8A8 `QuantLinear` with SmoothQuant's scales for `alpha`."""
    stats = activation_absmax(model, calibration)
    for name, linear in block_linears(model).items():
        s = smoothing_scales(stats[name], linear.weight.data.cpu(), alpha)
        q = quantize_int(linear.weight.data.cpu().float() * s, 8, "channel", symmetric=True)
        set_module(model, name, QuantLinear(q, linear.bias, input_scale=s, act_bits=8).to(linear.weight.device))
    return model
