"""Triton kernels, installed as `minillm.kernels` (chapter 02 onward).

Each kernel module holds a Triton kernel and a plain PyTorch reference beside it; the engine
dispatches to the kernel on CUDA and to the reference elsewhere. The first kernels arrive with
chapter 02:

    flash_attention(q, k, v, causal, scale)       FlashAttention forward: tiles, online softmax, GQA in place
    attention_reference(q, k, v, causal, scale)   the same attention in plain PyTorch (the definition)
    fused_add_rms_norm(x, residual, weight, eps)  residual add + RMSNorm in one pass over memory
    fused_add_rms_norm_reference(...)             the same as separate PyTorch operations

and chapter 05 packs prompt chunks in one row ("varlen"), attended by the same kernel:

    flash_attention_varlen(q, k, v, q_starts, k_starts)  one launch for every sequence, each on its own keys
    attention_varlen_reference(...)                       sequence by sequence in plain PyTorch

and reads the paged cache in place for prompt chunks and decode rows together (a mixed step, issue 53):

    paged_prefill_attention(q, k_pool, v_pool, block_tables, q_starts, seq_lens, max_queries)
    paged_prefill_attention_reference(...)              each sequence's keys gathered, then the reference

and chapter 03 adds the decode kernel:

    decode_attention(q, k, v, lengths, scale)     one query per sequence vs its KV cache: each KV head read
                                                  once for its query heads, the sequence split across programs
    decode_attention_reference(...)               the same in plain PyTorch

and chapter 04 the paged decode kernel, the same kernel reading K and V through block tables:

    paged_decode_attention(q, k_pool, v_pool, block_tables, lengths)
    paged_decode_attention_reference(...)         gather_kv through the tables, then the reference
    gather_kv(pool, block_tables, length)         the paged read in plain PyTorch: each sequence's K or V,
                                                  dense (the engine's reference read too; needs no Triton)

and the GPU fast path (issue 16) adds two small fused kernels for the decode step:

    fused_rotary(q, k, positions, inv_freq)       rotary on q and k in one launch, cos/sin computed in place
                                                  (cache=...: also writes k and v to the paged cache)
    fused_rotary_reference(...)                   RotaryEmbedding's tables and apply_rotary, in PyTorch
    silu_and_mul(gate_up)                         SwiGLU's silu(gate) * up in one pass over memory
    silu_and_mul_reference(gate_up)               F.silu(gate) * up, as MLP computes it

and the batch-1 step (issue 30) its matrix-vector product, which the fused path uses for one row:

    matvec(x, weight, bias, swiglu)               one row through a 16-bit linear layer, weights streamed
                                                  once (swiglu: silu(gate) * up computed as x is loaded)
    matvec_reference(...)                         F.linear (on silu_and_mul_reference(x) when swiglu)
    greedy_argmax(logits)                         each row's argmax and its log-probability, the vocabulary cut
                                                  into chunks (two launches, not PyTorch's four)
    greedy_reference(logits)                      argmax, and log_softmax at it, in PyTorch

and chapter 06 the int4-weight matmul, dequantising in registers (`minillm.quant.linear.QuantLinear` calls it on CUDA):

    w4a16_pack(q)                                 an IntQuantized int4 weight repacked for the kernels, once
    w4a16_matmul(x, weight)                       GEMV for a few rows (decode), tiled GEMM above (prefill)
    w4a16_reference(x, weight)                    dequantise to a full matrix, then matmul

and chapter 08 the batched LoRA matmul, many adapters in one batch (`minillm.lora` calls it on CUDA):

    add_lora(y, x, lora_a, lora_b, slot_ids)      y[n] += B[s] A[s] x[n], s = slot_ids[n]: shrink, then expand
    add_lora_reference(...)                       the same, one pass per adapter present (needs no Triton)
    add_lora_gathered(...)                        the same, every row gathering its own matrices (BGMV in PyTorch)

`import minillm.kernels` works on a machine without Triton: the names are then missing (all but
`gather_kv` and the LoRA references), and
asking for one raises an ImportError that says so. `minillm.model` reaches for
`flash_attention` (prefill) and `decode_attention` (decode) only on CUDA (see
`minillm.model.use_triton_attention`).
To run the kernels on a CPU, through Triton's interpreter, set TRITON_INTERPRET=1 before anything
imports triton.

The functions `flash_attention` and `decode_attention` shadow their modules of the same name here:
`import minillm.kernels.flash_attention as m` gives the function. Reach the module's other names with
`from minillm.kernels.flash_attention import ...` (or `sys.modules`).
"""

from __future__ import annotations

import importlib.util

from .lora_reference import add_lora_gathered, add_lora_reference
from .paged_kv import gather_kv

__all__ = ["add_lora", "add_lora_gathered", "add_lora_reference",
           "attention_reference", "attention_varlen_reference", "decode_attention", "decode_attention_reference",
           "flash_attention", "flash_attention_varlen", "fused_add_rms_norm", "fused_add_rms_norm_reference",
           "fused_rotary", "fused_rotary_reference", "gather_kv", "greedy_argmax", "greedy_reference", "matvec",
           "matvec_reference", "paged_decode_attention", "paged_decode_attention_reference", "paged_prefill_attention",
           "paged_prefill_attention_reference", "silu_and_mul",
           "silu_and_mul_reference", "w4a16_matmul", "w4a16_pack", "w4a16_reference"]

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None

if TRITON_AVAILABLE:
    from .decode_attention import (
        decode_attention,
        decode_attention_reference,
        paged_decode_attention,
        paged_decode_attention_reference,
    )
    from .flash_attention import (
        attention_reference,
        attention_varlen_reference,
        flash_attention,
        flash_attention_varlen,
    )
    from .greedy import greedy_argmax, greedy_reference
    from .lora import add_lora
    from .matvec import matvec, matvec_reference
    from .paged_prefill import paged_prefill_attention, paged_prefill_attention_reference
    from .rmsnorm import fused_add_rms_norm, fused_add_rms_norm_reference
    from .rotary import fused_rotary, fused_rotary_reference
    from .swiglu import silu_and_mul, silu_and_mul_reference
    from .w4a16 import w4a16_matmul, w4a16_pack, w4a16_reference
else:

    def __getattr__(name: str) -> object:
        if name in __all__:
            raise ImportError(
                f"minillm.kernels.{name} needs Triton, which is not installed: `pip install triton` "
                "(Linux; its CPU interpreter runs with TRITON_INTERPRET=1). minillm runs without it, in PyTorch."
            )
        raise AttributeError(f"module 'minillm.kernels' has no attribute {name!r}")
