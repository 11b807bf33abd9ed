"""Every error graphrt raises on purpose derives from ``GraphrtError`` (``graphrt.errors``):
an argument check is an ``InputError`` (also a ``ValueError``), a backend that cannot run
a ``BackendError`` (also a ``RuntimeError``). A review found raw ``ValueError`` /
``TypeError`` / ``RuntimeError`` in 70 places; the scan keeps new ones out."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from graphrt.errors import GraphrtError, InputError

ROOT = Path(__file__).resolve().parents[1]
_RAW = re.compile(r"\braise (ValueError|TypeError|RuntimeError|KeyError|IndexError|TimeoutError)\(")


def test_no_builtin_error_is_raised_on_purpose():
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
            for folder in ("graphrt", "capture", "kernels") for p in sorted((ROOT / folder).rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if _RAW.search(line)]
    assert hits == [], "raise a graphrt.errors type instead:\n" + "\n".join(hits)


def _cases():
    from graphrt.comm.deepep_ll import DeepEPLowLatencyComm, check_shape
    from graphrt.comm.local import LocalComm
    from graphrt.sizes import SizeTable
    from graphrt.watchdog import Watchdog, progress_tensors
    return {
        "sizes with a None": lambda: SizeTable([1, None]),
        "no layers": lambda: progress_tensors(0, "cpu"),
        "zero timeout": lambda: Watchdog(*progress_tensors(2, "cpu"), timeout_s=0),
        "too many tokens": lambda: LocalComm(4, 8, 2, "cpu", max_tokens=4).dispatch(
            torch.zeros(8, 8, dtype=torch.bfloat16), torch.zeros(8, 2, dtype=torch.int64), None),
        "unknown mode": lambda: DeepEPLowLatencyComm(16, 2048, 8, "cpu", mode="x"),
        "DeepEP hidden size": lambda: check_shape(hidden=1000, num_topk=8, max_tokens=16),
    }


@pytest.mark.parametrize("name", sorted(_cases()))
def test_argument_checks_raise_input_error(name):
    with pytest.raises(InputError) as info:
        _cases()[name]()
    assert isinstance(info.value, (GraphrtError, ValueError))
