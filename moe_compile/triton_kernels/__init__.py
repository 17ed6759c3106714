"""Triton kernels for encode/decode and quantization, one module per kernel (issue: compression)."""
