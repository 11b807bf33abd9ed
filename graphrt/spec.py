"""What a decode step takes: ``Input`` (one batch-major tensor) and ``StepSpec`` (the step).

A ``StepSpec`` is everything graphrt needs to capture a step per padded batch size: the
function, a description of each input (so graphrt can allocate static buffers, draw valid
random data for warm-up and checks, and fill padded rows) and the largest batch.

    spec = graphrt.StepSpec(
        fn=step,                                   # step(x=..., ids=..., n=...) -> tensor | tuple | dict
        inputs={"x": graphrt.Input((None, 2048), torch.bfloat16),
                "ids": graphrt.Input((None,), torch.int64, high=32000)},
        max_batch_size=256, live_count="n")

Graph safety: host-only (plain data; nothing here launches device work except ``random``/``pad``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from graphrt.errors import InputError


@dataclass(frozen=True)
class Input:
    """One input of a step: a tensor whose first dimension is the batch.

    Args:
        shape: the shape with exactly one ``None``, the first entry, standing for the batch
            (``(None, hidden)``, ``(None,)``, ``(None, num_topk)``).
        dtype: the torch dtype of the tensor.
        low, high: the range of valid random values. Integer inputs draw uniformly from
            ``[low, high)`` and need ``high``; floating inputs draw from ``N(0, 1)`` when
            ``high`` is None, else uniformly from ``[low, high)``; bool inputs draw fair coins.
        pad_value: the value padded rows carry (must be a valid value for the step: e.g. a
            scratch KV-cache slot, a context length of 0, token id 0).
        unique: integer inputs only: random rows draw distinct values (KV-cache slots: two
            live requests never share a slot).
    """

    shape: tuple
    dtype: torch.dtype
    low: float = 0
    high: float | None = None
    pad_value: float = 0
    unique: bool = False

    def __post_init__(self):
        shape = tuple(self.shape)
        object.__setattr__(self, "shape", shape)
        if not shape or shape[0] is not None or any(d is None for d in shape[1:]):
            raise InputError(
                f"Input shape must have exactly one None, as its first entry (the batch), "
                f"e.g. (None, 2048); got {shape}")
        if any(not isinstance(d, int) or d < 0 for d in shape[1:]):
            raise InputError(f"Input trailing dims must be non-negative ints; got {shape}")
        if not isinstance(self.dtype, torch.dtype):
            raise InputError(f"Input dtype must be a torch.dtype; got {self.dtype!r}")
        integral = not (self.dtype.is_floating_point or self.dtype.is_complex or self.dtype == torch.bool)
        if integral and self.high is None:
            raise InputError(
                f"integer Input of dtype {self.dtype} needs high= (exclusive upper bound of "
                "valid values) so graphrt can draw valid random data")
        if self.high is not None and self.high <= self.low:
            raise InputError(f"Input needs low < high; got low={self.low}, high={self.high}")
        if self.unique and (not integral or len(shape) != 1):
            raise InputError("Input(unique=True) needs an integer dtype and shape (None,)")

    @property
    def trailing(self) -> tuple[int, ...]:
        """The shape after the batch dimension."""
        return self.shape[1:]

    def shape_for(self, bs: int) -> tuple[int, ...]:
        """The concrete shape for ``bs`` rows."""
        return (bs, *self.shape[1:])

    def random(self, bs: int, device: torch.device | str = "cpu",
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Valid random data for ``bs`` rows: ``[bs, *trailing]`` of ``dtype`` on ``device``.

        Drawn on the CPU (so a ``generator`` seeds it identically everywhere), then moved.
        """
        shape = self.shape_for(bs)
        if self.dtype == torch.bool:
            t = torch.rand(shape, generator=generator) < 0.5
        elif self.dtype.is_floating_point:
            if self.high is None:
                t = torch.randn(shape, generator=generator)
            else:
                t = torch.rand(shape, generator=generator) * (self.high - self.low) + self.low
        elif self.unique:
            span = int(self.high) - int(self.low)
            if bs > span:
                raise InputError(f"Input(unique=True) cannot draw {bs} distinct values from "
                                 f"[{self.low}, {self.high})")
            t = torch.randperm(span, generator=generator)[:bs] + int(self.low)
        else:
            t = torch.randint(int(self.low), int(self.high), shape, generator=generator)
        return t.to(device=device, dtype=self.dtype)

    def pad(self, bs: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``bs`` rows of ``pad_value``: ``[bs, *trailing]`` of ``dtype`` on ``device``."""
        return torch.full(self.shape_for(bs), self.pad_value, dtype=self.dtype, device=device)


@dataclass(frozen=True)
class StepSpec:
    """A decode step as graphrt captures it.

    Args:
        fn: ``fn(**tensors)`` returning a tensor, a tuple or a dict of tensors, each with the
            batch as its first dimension. It must not write into its inputs.
        inputs: ``{name: Input}``, the batch-major tensors ``fn`` takes by keyword.
        max_batch_size: the largest batch the step will be captured for.
        name: a label for reports (defaults to ``fn.__qualname__``).
        live_count: when set (e.g. ``"n"``), ``fn`` also receives that keyword: an int32
            device tensor of shape ``[1]`` holding the number of live rows; rows at index
            ``>= n`` are padding, so kernels can make them inert without a host sync.
    """

    fn: Callable[..., Any]
    inputs: Mapping[str, Input]
    max_batch_size: int
    name: str | None = None
    live_count: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not callable(self.fn):
            raise InputError(f"StepSpec.fn must be callable; got {type(self.fn).__name__}")
        if not isinstance(self.inputs, Mapping) or not self.inputs:
            raise InputError("StepSpec.inputs must be a non-empty dict {name: graphrt.Input}")
        for key, inp in self.inputs.items():
            if not isinstance(inp, Input):
                raise InputError(f"StepSpec.inputs[{key!r}] must be a graphrt.Input; got "
                                 f"{type(inp).__name__}")
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise InputError(f"StepSpec.max_batch_size must be an int >= 1; got {self.max_batch_size!r}")
        if self.live_count is not None:
            if not isinstance(self.live_count, str) or not self.live_count.isidentifier():
                raise InputError(f"StepSpec.live_count must be a keyword name like 'n'; got {self.live_count!r}")
            if self.live_count in self.inputs:
                raise InputError(f"StepSpec.live_count {self.live_count!r} collides with an input name")
        if self.name is None:
            object.__setattr__(self, "name", getattr(self.fn, "__qualname__", repr(self.fn)))

    def random_inputs(self, bs: int, device: torch.device | str = "cpu",
                      generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Valid random inputs for ``bs`` rows, ``{name: [bs, *trailing]}``."""
        return {k: inp.random(bs, device, generator) for k, inp in self.inputs.items()}

    def live_count_tensor(self, n: int, device: torch.device | str) -> torch.Tensor:
        """A fresh int32 ``[1]`` device tensor holding ``n`` (eager calls; graphs use a static one)."""
        return torch.full((1,), n, dtype=torch.int32, device=device)

    def call_padded(self, inputs: Mapping[str, torch.Tensor], padded_bs: int) -> Any:
        """Run ``fn`` eagerly as a graph of ``padded_bs`` rows would: the live rows of
        ``inputs`` followed by ``pad_value`` rows, the live count on the device; returns the
        outputs trimmed to the live rows (bitwise what that graph's replay computes)."""
        from graphrt.outputs import OutputLayout
        first = next(iter(inputs.values()))
        n, device = first.shape[0], first.device
        if padded_bs > n:
            inputs = {k: torch.cat([t, self.inputs[k].pad(padded_bs - n, device)])
                      for k, t in inputs.items()}
        out = self.call(inputs, self.live_count_tensor(n, device))
        layout, flat = OutputLayout.flatten(out, max(padded_bs, n), where=self.name)
        return layout.build([o[:n] for o in flat])

    def call(self, inputs: Mapping[str, torch.Tensor], n: torch.Tensor | None = None) -> Any:
        """Run ``fn`` eagerly on ``inputs`` (passing the live count when the spec wants it)."""
        kwargs = dict(inputs)
        if self.live_count is not None:
            if n is None:
                bs = next(iter(inputs.values())).shape[0]
                n = self.live_count_tensor(bs, next(iter(inputs.values())).device)
            kwargs[self.live_count] = n
        return self.fn(**kwargs)
