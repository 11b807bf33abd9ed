"""Shared pytest fixtures and the hardware split: ``gpu`` / ``multigpu`` tests skip without CUDA."""
from __future__ import annotations

import os

import pytest
import torch

# Kernels run on the Triton CPU interpreter wherever no GPU is present.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with the device tool on an H200)")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {n_gpus}")
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def cuda_device():
    return torch.device("cuda", torch.cuda.current_device())
