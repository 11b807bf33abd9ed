"""graphrt's on/off environment switches (``GRAPHRT_DEBUG``, ``GRAPHRT_PDL``,
``GRAPHRT_PREFETCH``, ...), read one way: unset or empty is the switch's default; ``0``,
``false``, ``no`` or ``off`` (any case, surrounding spaces ignored) is off; anything else is
on. docs/gpu.md lists the switches and when each is read. Host-only."""
from __future__ import annotations

import contextlib
import os

from graphrt.errors import EnvError

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


def env_int(name: str, default: int, lo: int = 0, hi: int | None = None) -> int:
    """An integer setting: unset or empty is ``default``; otherwise an int in ``[lo, hi]``
    (surrounding spaces ignored), or a ``ValueError`` naming the variable, what it takes and
    what it holds (``EnvError``)."""
    return int_value(name, os.environ.get(name), default, lo, hi)


def int_value(name: str, raw: str | None, default: int, lo: int = 0, hi: int | None = None,
              why: str = "") -> int:
    """``env_int`` of a raw value ``raw`` of the variable ``name`` (``why``: what the range
    means, added to the error)."""
    v = (raw or "").strip()
    try:
        n = int(v) if v else default
    except ValueError:
        n = None
    if n is None or n < lo or (hi is not None and n > hi):
        span = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise EnvError(f"{name}: expected {span}{why} (unset: {default}), got {raw!r}")
    return n


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """A setting with named values: unset or empty is ``default``; otherwise one of
    ``choices`` (any case, spaces ignored), or a ``ValueError`` naming them."""
    raw = os.environ.get(name)
    v = (raw or "").strip().lower() or default
    if v not in choices:
        raise EnvError(f"{name}: expected one of {', '.join(choices)} (unset: {default}), "
                         f"got {raw!r}")
    return v


# How Triton reads TRITON_INTERPRET (its C++ getenv_bool: these words, any case; anything
# else, "2" and " 1" among them, is off): graphrt must agree with it, or on a GPU it would
# pick the interpreter's kernel branches while Triton compiles for the device.
TRITON_TRUE = ("1", "true", "on", "yes", "y")


def triton_interpret(value: str | None = None) -> bool:
    """Whether ``TRITON_INTERPRET`` (or ``value``) turns Triton's CPU interpreter on, read
    as Triton reads it."""
    if value is None:
        value = os.environ.get("TRITON_INTERPRET")
    return (value or "").lower() in TRITON_TRUE


def interpret_on_cpu() -> str | None:
    """Make Triton run kernels on its CPU interpreter, the only way they run without CUDA:
    ``TRITON_INTERPRET=1`` unless it already reads as on. Returns a note for the user when
    it replaced a value that turned the interpreter off (say a GPU machine's
    ``TRITON_INTERPRET=0``), else None. Call before any kernel runs."""
    before = os.environ.get("TRITON_INTERPRET")
    if triton_interpret(before):
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    if before is None or not before.strip():
        return None
    return (f"TRITON_INTERPRET={before} turns Triton's interpreter off, but without CUDA the "
            "kernels can only run on it: using TRITON_INTERPRET=1")


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
