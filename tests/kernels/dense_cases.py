"""Shared helpers of the dense GEMM GPU tests (test_dense_gemv_gpu.py, test_dense_mma_gpu.py):
the reference models' dense shapes, random weights and rows on the GPU, the error measure
and its tolerance."""
from __future__ import annotations

import torch

SHAPES = {  # (n, k) of W [n, k]
    "qwen3-qkv": (5120, 2048), "qwen3-o": (2048, 4096), "qwen3-lm_head": (32768, 2048),
    "qwen3-router": (128, 2048), "dsv3-qkv": (9216, 7168), "dsv3-o": (7168, 8192),
    "dsv3-shared-w13": (4096, 7168), "dsv3-shared-w2": (7168, 2048),
}
TOL = 4e-3  # relative (norm) error vs the fp32 reference: bf16 output rounding is ~1e-3


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """bf16 ``[n, k]`` on the GPU, scaled so a row of ``x @ W.T`` is O(1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)


def x_rows(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())
