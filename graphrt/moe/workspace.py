"""Static scratch buffers carved into contiguous views (no allocation on the run path).

The masked layout is large (``[num_local_experts, cap, hidden]`` per intermediate) and its
``cap`` follows the padded batch. Allocating it per call would make every captured size
hold its own copy in the graph pool; instead each intermediate has one flat buffer sized
for the largest batch, and a call takes the first ``prod(shape)`` elements as a contiguous
``shape`` view. Layers run one after another on the compute stream (an overlapped combine
is joined before the next layer starts), so one workspace serves every layer.

Graph safety: ``view`` is capturable (a view, no allocation); ``reserve`` is host-only setup.
"""
from __future__ import annotations

import math

import torch

from graphrt.errors import InputError


class Workspace:
    def __init__(self, device):
        self.device = torch.device(device)
        self._bufs: dict[str, torch.Tensor] = {}

    def reserve(self, name: str, shape: tuple, dtype: torch.dtype) -> None:
        """Make ``name`` hold at least ``prod(shape)`` elements of ``dtype`` (setup only)."""
        numel = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is not None and buf.dtype != dtype:
            raise InputError(f"workspace {name!r} holds {buf.dtype}, asked for {dtype}")
        if buf is None or buf.numel() < numel:
            self._bufs[name] = torch.empty(numel, dtype=dtype, device=self.device)

    def view(self, name: str, shape: tuple) -> torch.Tensor:
        """A contiguous ``shape`` view of the start of ``name``."""
        buf = self._bufs[name]
        numel = math.prod(shape)
        if numel > buf.numel():
            raise InputError(f"workspace {name!r} holds {buf.numel()} elements, a call needs "
                             f"{numel} for shape {tuple(shape)}: reserve for a larger batch")
        return buf[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())
