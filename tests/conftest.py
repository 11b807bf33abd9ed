"""Shared pytest fixtures and the hardware split: ``gpu`` / ``multigpu`` tests skip without CUDA.

Markers (registered in pyproject.toml): ``gpu`` (one CUDA GPU), ``multigpu`` (two or more),
``slow`` (subprocesses, the host engine, rank coordination: ``-m "not slow"`` skips them).
"""
from __future__ import annotations

import os

import pytest
import torch

# Kernels run on the Triton CPU interpreter wherever no GPU is present.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {n_gpus}")
    # The CPU tests launch Triton kernels on CPU tensors, which only the interpreter runs; the
    # interpreter is chosen per process (when @triton.jit runs), so on a CUDA machine they
    # need a separate `TRITON_INTERPRET=1 python -m pytest -m "not gpu and not multigpu" tests`.
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    skip_cpu = pytest.mark.skip(reason="a CPU test on a CUDA machine: run the CPU tests with "
                                       "TRITON_INTERPRET=1 -m 'not gpu and not multigpu'")
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)
        if n_gpus and not interpreting and not ({"gpu", "multigpu"} & set(item.keywords)):
            item.add_marker(skip_cpu)


@pytest.fixture
def cuda_device():
    return torch.device("cuda", torch.cuda.current_device())
