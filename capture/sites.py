"""Find the user's own ``file:line`` on the Python stack.

Findings must point at the line the user wrote, never at a torch, triton or graphrt frame.
``user_site()`` walks outward from the caller and returns the first frame outside those
packages and the standard library; if every frame is inside graphrt (the reference model),
it falls back to the innermost frame outside torch, triton and the standard library.
"""
from __future__ import annotations

import itertools
import os
import sys
import sysconfig
from functools import lru_cache

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    import graphrt  # local: graphrt imports this package
    graphrt_dirs = {os.path.dirname(os.path.abspath(graphrt.__file__)), _HERE,
                    os.path.join(os.path.dirname(_HERE), "kernels")}
    try:
        import graphrt.kernels as gk
        graphrt_dirs.add(os.path.dirname(os.path.abspath(gk.__file__)))
    except ImportError:  # pragma: no cover
        pass
    lib_dirs = {os.path.dirname(os.path.abspath(torch.__file__))}
    for key in ("stdlib", "platstdlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            lib_dirs.add(os.path.abspath(p))
    triton = sys.modules.get("triton")
    if triton is not None and getattr(triton, "__file__", None):
        lib_dirs.add(os.path.dirname(os.path.abspath(triton.__file__)))
    for name in ("pluggy", "_pytest"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            lib_dirs.add(os.path.dirname(os.path.abspath(mod.__file__)))
    return tuple(d + os.sep for d in graphrt_dirs), tuple(d + os.sep for d in lib_dirs)


@lru_cache(maxsize=4096)
def _classify(filename: str) -> int:
    """0: user code; 1: graphrt; 2: torch / triton / stdlib / frozen, and graphrt's own
    capture machinery (never a useful place to point a finding at, even as a fallback)."""
    if filename.startswith("<"):
        return 2
    path = os.path.abspath(filename)
    if path.startswith(_HERE + os.sep):
        return 2
    graphrt_dirs, lib_dirs = _dirs()
    if path.startswith(lib_dirs) and not path.startswith(graphrt_dirs):
        # stdlib contains site-packages; anything under site-packages that is not a known
        # library is still user code (e.g. an installed engine).
        if "site-packages" in path and not path.startswith(
                tuple(d for d in lib_dirs if "site-packages" in d)):
            return 0
        return 2
    if path.startswith(graphrt_dirs):
        return 1
    return 0


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's code (not torch, triton, the standard library or
    graphrt)."""
    return _classify(filename) == 0


def calling_lines(skip: int = 1) -> tuple[str, int, int]:
    """``(file, first, last)`` of the innermost frame outside torch, triton, the standard
    library and graphrt's capture machinery: the lines of the call expression that made the
    current torch call (all of them for a call written over several lines), in the user's
    code or in graphrt's own (the reference model, a kernel launcher)."""
    frame = sys._getframe(skip)
    while frame is not None and _classify(frame.f_code.co_filename) >= 2:
        frame = frame.f_back
    if frame is None:
        return "<unknown>", 0, 0
    return (frame.f_code.co_filename, *frame_lines(frame))


def frame_lines(frame) -> tuple[int, int]:
    """``(first, last)`` line of the expression ``frame`` is executing (its positions table
    entry); ``(f_lineno, f_lineno)`` where there is no span."""
    first = last = frame.f_lineno
    try:
        pos = next(itertools.islice(frame.f_code.co_positions(), frame.f_lasti // 2, None))
        if pos[0] is not None and pos[1] is not None and pos[0] <= first <= pos[1]:
            first, last = pos[0], pos[1]
    except (StopIteration, AttributeError, TypeError):
        pass
    return first, last


def user_site(skip: int = 1) -> tuple[str, int]:
    """``(file, line)`` of the innermost user frame on the current stack."""
    frame = sys._getframe(skip)
    fallback = None
    while frame is not None:
        kind = _classify(frame.f_code.co_filename)
        if kind == 0:
            return frame.f_code.co_filename, frame.f_lineno
        if kind == 1 and fallback is None:
            fallback = (frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return fallback or ("<unknown>", 0)
