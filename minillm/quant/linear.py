"""The quantised linear layer, and the helpers that put it into a model (chapter 06).

`QuantLinear` is an `nn.Linear` whose weight is stored in one of the formats of
`minillm.quant.formats`, so that `generate`, the engine and the CLI (`--quant`) run a quantised model
unchanged. With `act_bits=8` its activations are quantised too and multiplied in integers
(`int8_matmul`, W8A8); LLM.int8()'s outlier split is its `outlier_threshold`.

Weight-only layers multiply the stored codes directly where a kernel reads them: on the CPU, 8-bit
per-channel weights run PyTorch's int8 weight-only matmul (`aten._weight_int8pack_mm`, the kernel
gpt-fast and torchao use): the weights stay int8 in memory and each step streams a quarter of fp32's
bytes. On a CUDA GPU, 4-bit weights run minillm's Triton W4A16 kernel (`minillm.kernels.w4a16`),
which reads the packed weights and dequantises them in registers. Every other case dequantises the
weight and calls `F.linear`: simple and exact, but no faster than the unquantised model.

`block_linears` finds the linears of the transformer blocks (what every method replaces; the
embedding and the tied lm_head stay in the model's dtype, as in most int4 checkpoints), `set_module`
swaps one, and `stored_weight_bytes` counts a model's weights as stored.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from minillm.quant.formats import IntQuantized, Quantized, quantize_per_token


# --------------------------------------------------------------------------------------- W8A8 matmul
def int8_matmul(x: torch.Tensor, w: IntQuantized) -> torch.Tensor:
    """x [..., K] @ w.T with x quantised to int8 per token and w int8 per output channel: [..., N] fp32.

    What an int8 tensor-core GEMM computes: integer products summed exactly (int32 accumulation;
    here in fp32, exact while K * 127^2 < 2^24), then one multiply by the two scales per output.
    """
    if w.bits != 8 or w.zero is not None or w.group_size != w.shape[1]:
        raise ValueError("int8_matmul needs a symmetric 8-bit per-channel weight (quantize_int(w, 8, 'channel')).")
    xq, sx = quantize_per_token(x)
    acc = xq.float() @ w.codes.float().T
    return acc * sx * w.scale.reshape(1, -1)


def int8_weight_only_cpu(x: torch.Tensor, codes: torch.Tensor, scale_bf16: torch.Tensor) -> torch.Tensor:
    """x [..., K] (on the CPU) @ (codes * scale).T for int8 codes [N, K] and bf16 scales [N]: [..., N] in x's dtype.

    The codes are read as int8 by PyTorch's weight-only kernel, which widens each as it multiplies and
    applies the row's scale once at the end: y[n] = scale[n] * sum_k x[k] * codes[n, k]. The kernel's
    vectorised path takes bf16 activations (with fp32 ones it is several times slower than fp32's own
    matmul), so x is rounded to bf16 for the product: 8 bits of mantissa, where llama.cpp's Q8_0 dot
    product rounds activations to 8-bit integers.
    """
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if scale_bf16.dtype != torch.bfloat16:  # the model was cast (model.half() casts every float buffer)
        scale_bf16 = scale_bf16.to(torch.bfloat16)
    y = torch.ops.aten._weight_int8pack_mm(flat, codes, scale_bf16)
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def _int8_per_channel(w: Quantized) -> bool:
    return isinstance(w, IntQuantized) and w.bits == 8 and w.zero is None and w.group_size == w.shape[1]


# ----------------------------------------------------------------------------------------- the layer
class QuantLinear(nn.Module):
    """A linear layer y = x W^T + b whose W [out, in] is stored quantised.

    Options, set by the method that built it:
      input_scale [in]: the layer computes (x / input_scale) W'^T with W' = W * input_scale stored
        quantised (AWQ and SmoothQuant migrate scale between activations and weights; a serving
        engine folds 1 / input_scale into the previous RMSNorm or linear, here it is one multiply).
      act_bits=8: W8A8, activations quantised per token to int8 and multiplied in integers
        (SmoothQuant, LLM.int8()); None: weight-only, activations stay in the model's dtype (W4A16).
      outlier_threshold: LLM.int8()'s decomposition: input features whose magnitude exceeds it in
        any token of the batch are multiplied in full precision (activations as they are, weights
        dequantised from int8, as bitsandbytes does), the rest in int8.
    """

    def __init__(
        self,
        weight: Quantized,
        bias: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
        act_bits: int | None = None,
        outlier_threshold: float | None = None,
    ) -> None:
        super().__init__()
        if act_bits not in (None, 8):
            raise ValueError(f"act_bits must be None (weight-only) or 8 (int8 activations), got {act_bits}.")
        if act_bits == 8 and not isinstance(weight, IntQuantized):
            raise ValueError("int8 activations need an int8 weight (quantize_int(w, 8, 'channel')).")
        self.spec = weight  # the format and its sizes; the tensors below are its buffers, moved by .to()
        self.tensor_fields = [f.name for f in fields(weight) if isinstance(getattr(weight, f.name), torch.Tensor)]
        for name in self.tensor_fields:
            self.register_buffer(name, getattr(weight, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("input_scale", input_scale)
        self.act_bits, self.outlier_threshold = act_bits, outlier_threshold
        self.out_features, self.in_features = self.shape
        self._kernel_weight = None  # on CUDA, a 4-bit weight repacked for the W4A16 kernels (built on first use)
        # symmetric int8 per channel: the CPU kernel reads `codes` with these scales in bf16 (kept, not remade per call)
        self.int8_per_channel = _int8_per_channel(weight)
        self.register_buffer("scale_bf16", weight.scale.reshape(-1).to(torch.bfloat16) if self.int8_per_channel
                             else None, persistent=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.spec.shape if hasattr(self.spec, "shape") else tuple(self.spec.values.shape)

    def quantized(self) -> Quantized:
        """The weight's quantised form, on the layer's current device."""
        return replace(self.spec, **{name: getattr(self, name) for name in self.tensor_fields})

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W' [out, in] as stored (times input_scale when one was migrated into it)."""
        return self.quantized().dequantize(dtype)

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - nn.Module's signature
        self._kernel_weight = None  # new codes: repack them at the next CUDA forward
        super()._load_from_state_dict(*args, **kwargs)
        if self.int8_per_channel:  # new scales: their bf16 copy follows
            self.scale_bf16 = self.scale.reshape(-1).to(torch.bfloat16)

    def nbytes(self) -> int:
        """Bytes of the stored weight (scales included) and of any migrated input scale."""
        extra = 0 if self.input_scale is None else self.input_scale.numel() * self.input_scale.element_size()
        return self.quantized().nbytes() + extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        if self.act_bits == 8:
            y = self._int8_forward(x)
        else:
            y = self._weight_only_forward(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _weight_only_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_per_channel and x.device.type == "cpu" and x.is_floating_point():
            return int8_weight_only_cpu(x, self.codes, self.scale_bf16)
        q = self.quantized()
        if isinstance(q, IntQuantized) and q.bits == 4 and q.zero is not None and x.is_cuda:
            from minillm.kernels.w4a16 import w4a16_linear, w4a16_pack  # the fused kernels, in their own layout

            if self._kernel_weight is None or self._kernel_weight.words.device != x.device:
                self._kernel_weight = w4a16_pack(q)  # once: every fast int4 kernel repacks for its loads
            return w4a16_linear(x, self._kernel_weight)
        return F.linear(x, q.dequantize(x.dtype))

    def _int8_forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized()
        if self.outlier_threshold is None:
            return int8_matmul(x, q).to(x.dtype)
        flat = x.reshape(-1, x.shape[-1])
        outliers = (flat.abs() > self.outlier_threshold).any(0)  # [in]: features with a large value
        regular = torch.where(outliers, torch.zeros_like(flat), flat)
        y = int8_matmul(regular, q)
        if outliers.any():
            cols = outliers.nonzero().flatten()
            y = y + flat[:, cols].float() @ q.dequantize()[:, cols].T
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)

    def extra_repr(self) -> str:
        kind = type(self.spec).__name__
        extras = ("" if self.act_bits is None else f", act_bits={self.act_bits}") + (
            "" if self.outlier_threshold is None else f", outlier_threshold={self.outlier_threshold}")
        return f"in={self.in_features}, out={self.out_features}, {kind}{extras}"


# ------------------------------------------------------------------------------------- in the model
def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears of the transformer blocks, by module name (what `quantize` replaces)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in f".{name}"}


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule called `name` (dotted path) by `module`."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def stored_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: quantised layers at their packed size, the rest as they are.

    Measured on the model itself; chapter 02's `weight_bytes(config, bits)` estimates it from a config.
    """
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.nbytes()
        for p in module.parameters(recurse=False):
            if id(p) not in seen:  # a tied embedding and lm_head count once
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total
