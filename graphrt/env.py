"""graphrt's on/off environment switches (``GRAPHRT_DEBUG``, ``GRAPHRT_PDL``,
``GRAPHRT_PREFETCH``, ...), read one way: unset or empty is the switch's default; ``0``,
``false``, ``no`` or ``off`` (any case, surrounding spaces ignored) is off; anything else is
on. docs/gpu.md lists the switches and when each is read. Host-only."""
from __future__ import annotations

import os

OFF = ("0", "false", "no", "off")


def flag_value(value: str | None, default: bool) -> bool:
    """The switch a raw environment value sets (None or empty: ``default``)."""
    v = (value or "").strip().lower()
    return default if not v else v not in OFF


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name`` in the environment, now."""
    return flag_value(os.environ.get(name), default)
