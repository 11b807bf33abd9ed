"""Replay scheduling policy: the size table, picking, staging and padding.

Plain Python plus a few torch copies; nothing here captures or replays (that is
``graphrt.runtime`` and ``graphrt.capture``), so CPU tests exercise all of it.

- ``capture_sizes(max_bs)``: the default padded sizes, dense where decode batches live.
- ``SizeTable``: the captured sizes; ``pick(n)`` is the smallest size ``>= n`` (bisect).
- ``Stager``: static input buffers of ``max_bs`` rows, allocated once; ``stage(inputs, n,
  padded_bs)`` copies the live rows in and refills with ``pad_value`` only the padded rows
  an earlier, larger batch may have dirtied (a high-water mark), so a steady-state step
  costs one copy per input.

Graph safety: host-only (``stage`` launches copies on the current stream; call it before
``replay()`` on that stream, never inside a capture).
"""
from __future__ import annotations

import bisect
from typing import Iterable, Mapping

import torch

from graphrt.errors import InputError
from graphrt.spec import StepSpec


def capture_sizes(max_bs: int) -> list[int]:
    """Default padded batch sizes up to ``max_bs``: 1, 2, 4, 8, then steps of 8 up to 64,
    16 up to 128, 32 beyond; ``max_bs`` itself is always included.

    For ``max_bs=256``: 1 2 4 8 16 24 32 40 48 56 64 80 96 112 128 160 192 224 256.
    """
    if not isinstance(max_bs, int) or max_bs < 1:
        raise InputError(f"capture_sizes needs max_bs >= 1; got {max_bs!r}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    s = 8
    while s < max_bs:
        s += 8 if s < 64 else 16 if s < 128 else 32
        sizes.append(min(s, max_bs))
    return sorted(set(sizes) | {max_bs})


class SizeTable:
    """Sorted, distinct padded sizes; ``pick(n)`` returns the smallest size ``>= n`` or None."""

    def __init__(self, sizes: Iterable[int]):
        sizes = sorted(set(sizes))
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise InputError(f"sizes must be a non-empty list of ints >= 1; got {sizes!r}")
        self.sizes: list[int] = sizes

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def pick(self, n: int) -> int | None:
        """Smallest captured size ``>= n`` (``n >= 1``), or None when ``n`` exceeds them all."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def __iter__(self):
        return iter(self.sizes)

    def __len__(self):
        return len(self.sizes)


class Stager:
    """Owns the static input buffers (``[max_bs, *trailing]`` each) and the live-count scalar.

    Args:
        spec: the step; its ``inputs`` give names, dtypes, trailing shapes and pad values.
        max_bs: rows to allocate (the largest captured size).
        device: where the buffers live.

    ``buffers[name][:padded_bs]`` is what graph ``padded_bs`` was captured on; ``n_dev`` is
    the int32 ``[1]`` device tensor holding the live count that every graph reads.
    """

    def __init__(self, spec: StepSpec, max_bs: int, device: torch.device):
        self.spec, self.max_bs, self.device = spec, max_bs, device
        self.buffers = {k: inp.pad(max_bs, device) for k, inp in spec.inputs.items()}
        self.n_dev = torch.full((1,), max_bs, dtype=torch.int32, device=device)
        self._pad_values = {k: inp.pad_value for k, inp in spec.inputs.items()}
        # Rows [0, _dirty) may hold something other than pad_value.
        self._dirty = 0
        self._expect = {k: (inp.dtype, inp.trailing) for k, inp in spec.inputs.items()}

    def views(self, padded_bs: int) -> dict[str, torch.Tensor]:
        """The static inputs a graph of ``padded_bs`` rows reads: ``{name: buffer[:padded_bs]}``."""
        return {k: b[:padded_bs] for k, b in self.buffers.items()}

    def check(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Validate names, types, dtypes, trailing shapes, devices and a common batch; return it."""
        if inputs.keys() != self._expect.keys():
            missing = sorted(self._expect.keys() - inputs.keys())
            extra = sorted(inputs.keys() - self._expect.keys())
            raise InputError(f"inputs of step {self.spec.name!r}: expected {sorted(self._expect)}; "
                             f"missing {missing}, unexpected {extra}")
        n = None
        for k, t in inputs.items():
            dtype, trailing = self._expect[k]
            if not isinstance(t, torch.Tensor):
                raise InputError(f"input {k!r}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise InputError(f"input {k!r}: expected dtype {dtype}, got {t.dtype}; convert "
                                 f"with .to({dtype})")
            if t.dim() != len(trailing) + 1 or tuple(t.shape[1:]) != trailing:
                raise InputError(f"input {k!r}: expected shape (bs, {', '.join(map(str, trailing))})"
                                 f"{'' if trailing else ''}, got {tuple(t.shape)}")
            if t.device != self.device:
                raise InputError(f"input {k!r}: expected device {self.device}, got {t.device}; move "
                                 f"it with .to({str(self.device)!r})")
            if n is None:
                n = t.shape[0]
            elif t.shape[0] != n:
                raise InputError(f"input {k!r} has {t.shape[0]} rows but an earlier input has {n}; "
                                 "all inputs share the batch dimension")
        if n < 1:
            raise InputError("run() needs at least one live row; got a batch of 0")
        return n

    def stage(self, inputs: Mapping[str, torch.Tensor], n: int, padded_bs: int) -> None:
        """Copy rows ``[0, n)`` in, make rows ``[n, padded_bs)`` padding, set the live count."""
        for k, buf in self.buffers.items():
            buf[:n].copy_(inputs[k], non_blocking=True)
        self.pad_only(n, padded_bs)

    def pad_only(self, n: int, padded_bs: int) -> None:
        """Rows ``[0, n)`` are already in place: pad rows ``[n, padded_bs)``, set the live count."""
        stop = min(self._dirty, padded_bs)
        if stop > n:
            for k, buf in self.buffers.items():
                buf[n:stop].fill_(self._pad_values[k])
        self._dirty = self._dirty if self._dirty > padded_bs else n
        self.n_dev.fill_(n)

    def poison(self, n: int, padded_bs: int, generator: torch.Generator) -> None:
        """Fill rows ``[n, padded_bs)`` with garbage (NaN for floats, random valid values
        otherwise) to prove live rows never depend on them (``check_replay``)."""
        if padded_bs <= n:
            return
        for k, buf in self.buffers.items():
            inp = self.spec.inputs[k]
            if inp.dtype.is_floating_point:
                buf[n:padded_bs].fill_(float("nan"))
            else:
                buf[n:padded_bs].copy_(inp.random(padded_bs - n, self.device, generator))
        self._dirty = max(self._dirty, padded_bs)

    def pad_rows_intact(self, n: int, padded_bs: int) -> list[str]:
        """Names of inputs whose rows ``[n, padded_bs)`` no longer hold ``pad_value`` (a step
        that writes its inputs breaks padding); host-only (syncs), used by checks."""
        bad = []
        for k, buf in self.buffers.items():
            rows = buf[n:padded_bs]
            if rows.numel() and not bool((rows == self._pad_values[k]).all()):
                bad.append(k)
        return bad
