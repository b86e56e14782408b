"""Greedy decoding's last step in two small Triton kernels: each row's argmax and its log-probability (issue 30).

A greedy decode step ends with two reductions over the vocabulary: the argmax (the token) and, for the
token's log-probability, a log-softmax. PyTorch runs them as separate kernels, on a float32 copy of the
logits; on an H200 at batch 1 (Llama-3's 128,256 tokens;
results/engine_step_profile/archive/engine_step_profile_cuda.json) the argmax took 28 us and the log-softmax
29 us, 5% of the 1B shape's whole step: far more than reading 0.25 MB needs (our guess: one row's reduction
occupies few of the GPU's processors; not measured).

Here the row is cut into chunks of BLOCK logits, one program each (63 for that vocabulary), and each
program reads its chunk once and writes three numbers: its largest logit m_c, where it is (the first
such), and s_c = sum exp(x - m_c). A second kernel, one program per row, combines them:

    M = max_c m_c,   token = the position of the first chunk's maximum with m_c = M,
    log-probability of the token = x_token - logsumexp(x) = M - (M + log sum_c s_c exp(m_c - M))
                                 = -log sum_c s_c exp(m_c - M).

The token equals `argmax` (the first of equal maxima, as torch.argmax picks); the log-probability equals
`log_softmax(x.float())[token]` up to fp32 rounding in a different order (the top chunk's s_c >= 1, so
the log-probability is <= 0). `greedy_reference` is the
definition. The engine takes this path when every row of a step is greedy, with no penalty, constraint or
top log-probabilities asked (minillm.engine.model_runner). Rows whose logits are all -inf or hold NaN or
+inf are not defined here (a model that produces them is broken).
"""

# ruff: noqa: N803 - Triton kernels name compile-time constants and pointers in capitals (BLOCK, X)

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # logits a program: 63 programs a row for a 128,256-token vocabulary


def greedy_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (argmax [B] int64, its log-probability [B] float32), as the engine computed them before."""
    tokens = logits.argmax(dim=-1)
    return tokens, logits.float().log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


@triton.jit
def _greedy_chunk_kernel(X, M, IDX, S, V, stride_x, n_chunks, BLOCK: tl.constexpr):
    """Program (row b, chunk c): the chunk's max, the first index of it, and sum exp(x - max)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + b * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    first = tl.argmax(x, axis=0, tie_break_left=True)
    s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - m), 0.0), axis=0)  # a chunk all -inf (masked) adds 0
    tl.store(M + b * n_chunks + c, m)
    tl.store(IDX + b * n_chunks + c, c * BLOCK + first)
    tl.store(S + b * n_chunks + c, s)


@triton.jit
def _greedy_combine_kernel(M, IDX, S, TOKENS, LOGPROBS, n_chunks, BLOCK_C: tl.constexpr):
    """Program b: the row's token (the first chunk holding the maximum) and its log-probability."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    inside = c < n_chunks
    m = tl.load(M + b * n_chunks + c, mask=inside, other=float("-inf"))
    s = tl.load(S + b * n_chunks + c, mask=inside, other=0.0)
    best = tl.argmax(m, axis=0, tie_break_left=True)
    top = tl.max(m, axis=0)
    tl.store(TOKENS + b, tl.load(IDX + b * n_chunks + best))
    tl.store(LOGPROBS + b, -tl.log(tl.sum(s * tl.exp(m - top), axis=0)))


def _interpreted() -> bool:
    """True when the kernels were defined under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_greedy_chunk_kernel, triton.runtime.JITFunction)


def greedy_argmax(logits: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (float16, bfloat16 or float32; the last dim contiguous) -> (tokens [B] int64, their
    log-probabilities [B] float32): `greedy_reference` in two launches (see the module docstring)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be a tensor [B, V] with V >= 1, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}.")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"logits must be float16, bfloat16 or float32, got {logits.dtype}.")
    if logits.device.type != "cuda" and not _interpreted():
        raise ValueError(f"greedy_argmax needs a CUDA tensor, got {logits.device}. Move it with .cuda(), set "
                         "TRITON_INTERPRET=1 before importing triton, or call greedy_reference.")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    B, V = logits.shape
    n_chunks = triton.cdiv(V, block)
    m = torch.empty(B, n_chunks, dtype=torch.float32, device=logits.device)
    s, idx = torch.empty_like(m), torch.empty(B, n_chunks, dtype=torch.int64, device=logits.device)
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B:
        _greedy_chunk_kernel[(B, n_chunks)](logits, m, idx, s, V, logits.stride(0), n_chunks, BLOCK=block)
        _greedy_combine_kernel[(B,)](m, idx, s, tokens, logprobs, n_chunks,
                                     BLOCK_C=max(2, triton.next_power_of_2(n_chunks)))
    return tokens, logprobs
