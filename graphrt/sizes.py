"""The padded batch sizes: the default list and the table of captured ones (pure Python).

- ``capture_sizes(max_bs)``: the default padded sizes, dense where decode batches live.
- ``SizeTable``: the captured sizes; ``pick(n)`` is the smallest size ``>= n`` (bisect).

Graph safety: host-only.
"""
from __future__ import annotations

import bisect
from typing import Iterable

from graphrt.errors import InputError, InputTypeError, is_int


def capture_sizes(max_bs: int) -> list[int]:
    """Default padded batch sizes up to ``max_bs``: 1, 2, 4, 8, then steps of 8 up to 64,
    16 up to 128, 32 beyond; ``max_bs`` itself is always included.

    For ``max_bs=256``: 1 2 4 8 16 24 32 40 48 56 64 80 96 112 128 160 192 224 256.
    """
    if not is_int(max_bs) or max_bs < 1:
        raise InputError(f"capture_sizes needs max_bs >= 1; got {max_bs!r}")
    max_bs = int(max_bs)
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    s = 8
    while s < max_bs:
        s += 8 if s < 64 else 16 if s < 128 else 32
        sizes.append(min(s, max_bs))
    return sorted(set(sizes) | {max_bs})


class SizeTable:
    """Sorted, distinct padded sizes; ``pick(n)`` returns the smallest size ``>= n`` or None."""

    def __init__(self, sizes: Iterable[int]):
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
            raise InputTypeError(f"sizes must be a list of ints >= 1, e.g. [1, 2, 4, 8] (or "
                                 f"[{sizes!r}] for that one size); got {sizes!r} "
                                 f"({type(sizes).__name__})")
        given = list(sizes)
        if not given or any(not is_int(s) or s < 1 for s in given):
            raise InputError(f"sizes must be a non-empty list of ints >= 1; got {given!r}")
        sizes = sorted({int(s) for s in given})  # numpy ints become ints
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
