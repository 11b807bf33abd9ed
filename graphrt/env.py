"""graphrt's on/off environment switches (``GRAPHRT_DEBUG``, ``GRAPHRT_PDL``,
``GRAPHRT_PREFETCH``, ...), read one way: unset or empty is the switch's default; ``0``,
``false``, ``no`` or ``off`` (any case, surrounding spaces ignored) is off; anything else is
on. docs/gpu.md lists the switches and when each is read. Host-only."""
from __future__ import annotations

import contextlib
import os

OFF = ("0", "false", "no", "off")


def flag_value(value: str | None, default: bool) -> bool:
    """The switch a raw environment value sets (None or empty: ``default``)."""
    v = (value or "").strip().lower()
    return default if not v else v not in OFF


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name`` in the environment, now."""
    return flag_value(os.environ.get(name), default)


def env_auto(name: str, default: bool | str = "auto") -> bool | str:
    """A switch whose default is a rule: unset or empty is ``default`` (``"auto"`` unless
    given), ``auto`` is ``"auto"``; any other value reads as ``env_flag`` reads it (``True`` /
    ``False``: forced)."""
    v = (os.environ.get(name) or "").strip().lower()
    if not v:
        return default
    return "auto" if v == "auto" else v not in OFF


@contextlib.contextmanager
def env_override(name: str, value: str):
    """``os.environ[name] = value`` inside the block, put back (or removed) after: for a
    switch read at capture or bind time (A/B benchmarks)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
