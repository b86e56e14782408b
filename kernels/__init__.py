"""Triton kernels, installed as `minillm.kernels` (chapter 02 onward).

Each kernel module holds a Triton kernel and a plain PyTorch reference beside it; the engine
dispatches to the kernel on CUDA and to the reference elsewhere. The first kernels (a
FlashAttention forward and a fused RMSNorm) arrive with chapter 02.
"""
