"""Small helpers shared by the kernel launchers (no triton import at module load)."""
from __future__ import annotations

import functools
import os

import torch

from graphrt.env import env_flag, flag_value, triton_interpret
from graphrt.errors import InputError, InputTypeError


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``).

    The interpreter computes bf16 arithmetic wrongly (NaN), so kernels pass this as a
    ``tl.constexpr`` and upcast to fp32 before arithmetic when it is set.
    """
    return triton_interpret(os.environ.get("TRITON_INTERPRET"))


def check(cond: bool, what: str, expected: object, got: object) -> None:
    """Raise ``ValueError`` stating what was expected and what came, unless ``cond``."""
    if not cond:
        raise InputError(f"{what}: expected {expected}, got {got}")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may share memory: the same storage and intersecting byte spans
    (conservative for interleaved views, e.g. two columns of one matrix). Host-only."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def check_apart(out: torch.Tensor, name: str, others: dict, why: str) -> None:
    """Raise ``ValueError`` when ``out`` (a launcher's output, named ``name``) shares memory
    with one of ``others`` (``{name: tensor or None}``): ``why`` says what would go wrong
    (programs read them while others write ``out``). Host-only."""
    for other, t in others.items():
        if t is not None and overlaps(out, t):
            raise InputError(f"{name}: expected a tensor apart from {other} ({why}), got one "
                             f"that shares its memory; pass a separate buffer")


def is_pow2(v) -> bool:
    """True for an int (not a bool) that is a power of two: a launcher's block size."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0


def check_tensor(t: torch.Tensor, name: str, *, shape=None, dtype=None, device=None,
                 contiguous: bool = False) -> None:
    """Validate a launcher argument; ``shape`` entries may be ``None`` (any size)."""
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        dtypes = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
        check(t.dtype in dtypes, f"{name}.dtype", " or ".join(map(str, dtypes)), t.dtype)
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
        check(ok, f"{name}.shape", tuple("*" if s is None else s for s in shape), tuple(t.shape))
    if device is not None:
        check(t.device == device, f"{name}.device", device, t.device)
    if contiguous:
        check(t.is_contiguous(), f"{name}", "a contiguous tensor", f"strides {t.stride()}")


@functools.lru_cache(maxsize=None)
def hopper_or_newer(index: int) -> bool:
    """Whether CUDA device ``index`` has compute capability >= 9.0 (cached). Host-only."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_requested() -> bool:
    """What ``GRAPHRT_PDL`` asks for: on unless it is ``0``, ``false``, ``no`` or ``off``
    (unset: on)."""
    return env_flag("GRAPHRT_PDL", True)


def pdl_enabled() -> bool:
    """True when graphrt's Triton kernels launch with programmatic dependent launch (PDL):
    not turned off (``GRAPHRT_PDL=0``), a CUDA GPU of compute capability >= 9.0 (Hopper) and
    not the interpreter. On by default since the whole GPU suite passed with it and it is
    1-2.4% faster with bitwise-equal outputs (BENCHMARKS.md §13)."""
    return _pdl_enabled(os.environ.get("GRAPHRT_PDL"), os.environ.get("TRITON_INTERPRET", "0"))


@functools.lru_cache(maxsize=None)
def _pdl_enabled(pdl_env: str | None, interpret_env: str) -> bool:
    """``pdl_enabled`` per value of the two variables: every launch asks, so the answer (and
    the CUDA queries behind it) is computed once per setting."""
    if not flag_value(pdl_env, True) or triton_interpret(interpret_env):
        return False
    return torch.cuda.is_available() and hopper_or_newer(torch.cuda.current_device())


def pdl_args() -> dict:
    """Launch keywords for a kernel with a ``USE_GDC`` constexpr (its first call is
    ``kernels._pdl.pdl_prologue(USE_GDC)``): with PDL on,
    ``launch_pdl=True`` (the launch may start while the previous kernel in the stream still
    runs) and ``USE_GDC=1`` (the kernel's first instructions wait for that kernel's writes,
    ``griddepcontrol.wait``, then let the next kernel start launching) with
    ``GRAPHRT_PDL_EARLY=0``, else ``USE_GDC=2`` (let the next kernel launch, then wait; the
    default); ``{}`` otherwise.
    Under CUDA graph capture the launch attribute becomes a programmatic dependency edge.
    Correctness does not depend on it: the wait precedes every read and write."""
    return dict(_pdl_args(os.environ.get("GRAPHRT_PDL"), os.environ.get("GRAPHRT_PDL_EARLY"),
                          os.environ.get("TRITON_INTERPRET", "0")))


@functools.lru_cache(maxsize=None)
def _pdl_args(pdl_env: str | None, early_env: str | None, interpret_env: str) -> tuple:
    """``pdl_args`` per value of the three variables (every launch asks), as items.
    ``GRAPHRT_PDL_EARLY`` (default on) picks trigger-first: 0.985-0.992x the step time of
    wait-first at qwen3-like bs 1-16, bitwise equal outputs (BENCHMARKS.md §22)."""
    if not _pdl_enabled(pdl_env, interpret_env):
        return ()
    return (("launch_pdl", True), ("USE_GDC", 2 if flag_value(early_env, True) else 1))


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (cached; 132 on an H200).
    The one place the launchers and the expert plan ask. Host-only."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def l2_bytes(device_index: int) -> int:
    """L2 cache bytes of CUDA device ``device_index`` (cached, as ``sm_count``; 50 MiB where
    torch does not report it). Host-only."""
    return int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size",
                       50 << 20))


@functools.cache
def smem_limits(device_index: int) -> tuple[int, int]:
    """``(per_program, per_sm)``: the shared memory bytes one program may opt in to and one SM
    holds, of CUDA device ``device_index`` (cached, as ``sm_count``; 227 KB and 228 KB on an
    H200; 163 / 164 KB on an A100). Host-only."""
    p = torch.cuda.get_device_properties(device_index)
    per_sm = int(p.shared_memory_per_multiprocessor)
    # a torch without the opt-in figure: an SM's less the 1 KB CUDA keeps a block (sm_80-90)
    return int(getattr(p, "shared_memory_per_block_optin", per_sm - 1024)), per_sm


def cuda_index(device: torch.device) -> int:
    """``device``'s CUDA index, the current device's when it names none. Host-only."""
    return device.index if device.index is not None else torch.cuda.current_device()
