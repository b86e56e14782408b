"""Pruning: set some weights to exactly zero, and see what it costs (chapter 06, in brief).

    pruned, mask = magnitude_prune(w, sparsity=0.5)     # unstructured: any half of each row
    pruned, mask = prune_2_4(w)                         # semi-structured: 2 of every 4 consecutive inputs
    prune(model, "2:4", scores="wanda", calibration=calibration_ids(tokenizer))   # every block linear
    sparsity_of(model)                                  # fraction of block-linear weights that are 0

What to remove is decided by a *score* per weight, lowest first:

    magnitude   |W_ij|                       the classic choice (Han et al., 2015)
    wanda       |W_ij| * ||X_j||_2           Sun et al., 2023, "A Simple and Effective Pruning
                                             Approach for Large Language Models" (arXiv:2306.11695)

where ||X_j|| is the L2 norm of input feature j over the calibration tokens. A weight's share of an
output is W_ij x_j, so a small weight on a feature that is always large can matter more than a larger
weight on a feature that is nearly silent; Wanda's score is a cheap estimate of that share, needing only
forward passes over calibration text (here one per block, see `prune`) and no weight update (unlike
SparseGPT, which repairs the kept weights the way GPTQ repairs rounding).

Which weights compete with which. Here every output row is its own comparison group: each row of W
loses the same fraction of its weights. That is the grouping Wanda found best for LLMs (a per-matrix
ranking can strip one output neuron almost bare while another keeps everything), and it is the
grouping 2:4 imposes anyway (its groups of 4 lie within a row), so the methods below differ only in
score and pattern, not in how the budget is spread.

Why 2:4 and not "any 50%". NVIDIA's sparse tensor cores, introduced with Ampere (the "NVIDIA A100
Tensor Core GPU Architecture" whitepaper, 2020; Mishra et al., 2021, "Accelerating Sparse Deep Neural
Networks", arXiv:2104.08378), accept a weight matrix in which each run of 4 consecutive values along
the reduction dimension has at most 2 non-zeros. Such a matrix is stored compressed: the 2 surviving
values of each group plus a 2-bit position for each, so a 16-bit weight takes 16/2 + 2/2 = 9 bits per
original entry instead of 16. The tensor core uses the positions to pick the matching 2 of the 4
activations and multiplies only those, so the same hardware does twice the useful math per cycle:
up to 2x on the matrix multiply itself (end-to-end gains are smaller: attention, norms and the
unpruned embedding stay as they were). Unstructured zeros at 50% buy nothing on a dense GPU kernel,
which multiplies zeros as fast as anything else; to skip them a kernel needs per-element indices and
irregular gathers, and general sparse kernels tend to beat a dense GEMM only at far higher sparsity
(90% and more is the usual rule of thumb), or in memory-bound decoding with kernels written for it.
On a CPU, as here, `prune` only zeroes weights in place: the model becomes no faster, only worse.

Measured (benchmarks/compression.py, results/compression/cpu.json; validation perplexity, 64
windows of the shipped sample). The 11M target barely notices half its block weights gone: 50.5
dense, 51.0 (magnitude) and 51.3 (Wanda) unstructured, 51.6 and 51.3 in 2:4 (presumably because
11M parameters are more than its 1.5M-token corpus needs). The 0.9M draft has none: 53.6 dense, 68.1 and 64.7
unstructured, 96.9 and 79.7 in 2:4. There Wanda's score pays, and 2:4 costs more than free choice.
Wanda's paper reports its gains on billion-parameter models, whose inputs have a few very large
feature channels; on the target it does no better than magnitude.
"""

from __future__ import annotations

import torch
from torch import nn

from minillm.quant.calibration import blocks_in_order, capture_inputs
from minillm.quant.linear import block_linears

METHODS = ("unstructured", "2:4")
SCORES = ("magnitude", "wanda")


def _check_matrix(weight: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
    """The scores to rank by, fp32 [rows, cols]: |weight| unless given."""
    if weight.dim() != 2:
        raise ValueError(f"expected a [rows, cols] weight matrix, got shape {tuple(weight.shape)}.")
    if scores is None:
        return weight.detach().float().abs()
    if scores.shape != weight.shape:
        raise ValueError(f"scores must have the weight's shape {tuple(weight.shape)}, got {tuple(scores.shape)}.")
    return scores.detach().float()


def magnitude_prune(
    weight: torch.Tensor, sparsity: float, scores: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unstructured pruning of weight [rows, cols]: zero the lowest-scoring `sparsity` of each row (chapter 06).

    Each row loses exactly round(sparsity * cols) weights, those with the smallest score (|w| by
    default; pass `wanda_scores(...)` for Wanda). Ties are broken by position, deterministically.

    Returns:
        (pruned weight, same dtype and shape as `weight`; mask, bool [rows, cols], True = kept).
    """
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1) (the fraction of each row set to zero), got {sparsity}.")
    s = _check_matrix(weight, scores)
    cols = s.shape[1]
    n_zero = round(sparsity * cols)
    mask = torch.ones_like(s, dtype=torch.bool)
    if n_zero:
        lowest = torch.topk(s, n_zero, dim=1, largest=False).indices  # [rows, n_zero]
        mask.scatter_(1, lowest, False)
    return weight * mask, mask


def prune_2_4(weight: torch.Tensor, scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Semi-structured 2:4 pruning of weight [rows, cols]: in every 4 consecutive inputs of a row keep the top 2.

    The pattern of Ampere's sparse tensor cores: the groups run along the input (reduction)
    dimension, so cols must be a multiple of 4. Ranked by |w| unless `scores` are given.

    Returns:
        (pruned weight, same dtype and shape; mask, bool [rows, cols], True = kept, 2 per group of 4).
    """
    s = _check_matrix(weight, scores)
    rows, cols = s.shape
    if cols % 4:
        raise ValueError(f"2:4 groups run along the {cols} input columns, which must be a multiple of 4.")
    groups = s.reshape(rows, cols // 4, 4)
    keep = torch.topk(groups, 2, dim=-1).indices  # [rows, cols / 4, 2]
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True).reshape(rows, cols)
    return weight * mask, mask


def wanda_scores(weight: torch.Tensor, input_norms: torch.Tensor) -> torch.Tensor:
    """Wanda's score |W_ij| * ||X_j||_2 (Sun et al., 2023): weight [out, in], input_norms [in] -> fp32 [out, in]."""
    if input_norms.shape != (weight.shape[1],):
        raise ValueError(f"need one input norm per input column ({weight.shape[1]}), got {tuple(input_norms.shape)}.")
    return weight.detach().float().abs() * input_norms.float().to(weight.device)[None, :]


def _prune_weight(weight: torch.Tensor, method: str, sparsity: float, scores: torch.Tensor | None) -> torch.Tensor:
    if method == "2:4":
        return prune_2_4(weight, scores)[0]
    return magnitude_prune(weight, sparsity, scores)[0]


@torch.no_grad()
def prune(
    model: nn.Module,
    method: str = "unstructured",
    sparsity: float = 0.5,
    calibration: torch.Tensor | None = None,
    scores: str = "magnitude",
) -> nn.Module:
    """Prune every linear of the transformer blocks in place, and return the model (chapter 06).

    The embedding, the (tied) lm_head and the norms are left as they are, as in Wanda and
    SparseGPT; so `sparsity_of(model)` counts the block linears only.

    Args:
        method: "unstructured" (each row loses `sparsity` of its weights) or "2:4" (2 of every 4
            consecutive inputs; `sparsity` must then be 0.5).
        sparsity: fraction of each row's weights to zero, in [0, 1).
        calibration: token ids [n_seqs, seq_len] from the *training* split (see
            `minillm.quant.calibration.calibration_ids`); needed for scores="wanda".
        scores: "magnitude" (|w|) or "wanda" (|w| times the L2 norm of its input feature). With
            Wanda the blocks are pruned first to last, each block's input norms measured on the model
            whose earlier blocks are already pruned (as Wanda's reference code does), so that
            a later layer is scored on the inputs it will really receive.
    """
    if method not in METHODS:
        raise ValueError(f"unknown pruning method {method!r}; choose one of {METHODS}.")
    if scores not in SCORES:
        raise ValueError(f"unknown score {scores!r}; choose one of {SCORES}.")
    if method == "2:4" and sparsity != 0.5:
        raise ValueError(f"2:4 pruning removes exactly half of the weights; got sparsity={sparsity} (pass 0.5).")
    if scores == "wanda" and calibration is None:
        raise ValueError("scores='wanda' needs calibration token ids [n_seqs, seq_len] from the training split "
                         "(see minillm.quant.calibration.calibration_ids).")
    if not block_linears(model):
        raise ValueError("this model has no nn.Linear in its blocks to prune (already quantised? prune first, "
                         "then quantise).")
    if scores == "magnitude":
        for linear in block_linears(model).values():
            linear.weight.copy_(_prune_weight(linear.weight, method, sparsity, None))
        return model

    def sum_of_squares(x: torch.Tensor) -> torch.Tensor:  # x [tokens, in] -> [in]
        return x.pow(2).sum(0)

    for block in blocks_in_order(model):
        squares = capture_inputs(model, calibration, block, reduce=sum_of_squares)
        for name, linear in block.items():
            s = wanda_scores(linear.weight, squares[name].sqrt())
            linear.weight.copy_(_prune_weight(linear.weight, method, sparsity, s))
    return model


def sparsity_of(model: nn.Module) -> float:
    """Fraction of the block linears' weights that are exactly zero (embedding and lm_head not counted)."""
    linears = block_linears(model).values()
    total = sum(linear.weight.numel() for linear in linears)
    if total == 0:
        raise ValueError("this model has no nn.Linear in its blocks.")
    return sum(int((linear.weight == 0).sum()) for linear in linears) / total
