"""The CUDA runtime's ``cudaMemcpyAsync``, called through ctypes: the replay path's raw copy.

torch's ``Tensor.copy_`` of a contiguous, same-dtype, same-device CUDA tensor ends in one
``cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, current stream)``, after the
dispatcher, a ``TensorIterator`` and a device guard (~4-5 µs of host time on an H200
machine, issue 17). ``Stager.bind`` stages such inputs with the call itself: ctypes and
the checks below add ~1.2 µs to it (measured on a CPU with a no-op in its place).

The library is the libcudart torch's CUDA build loaded (``libcudart.so.12``/``.13``, maybe
with a hash suffix, in ``torch/lib`` or ``nvidia/*/lib``): found in ``/proc/self/maps``, else
by a soname already loaded, else by the soname of torch's CUDA major. It is looked up on
first use, never at import: ``import graphrt`` loads no CUDA library.

- ``available()``: whether the raw path can be used here (False on a CPU-only or ROCm torch,
  a torch without ``torch._C._cuda_getCurrentRawStream``/``_cuda_getDevice``, or no
  libcudart); never raises, cached.
- ``memcpy_d2d_async(dst_ptr, src_ptr, nbytes, stream)``: one checked copy.
- ``d2d_copier(targets)``: the staging copies of ``Stager.bind``, into fixed destinations,
  exactly what ``copy_`` would do (it falls back to ``copy_`` where a raw copy would not be);
  ``raw_copyable(dst)`` says which destinations it takes.
- ``memcpy_async_fn()``, ``stream_fns()``, ``check(rc, what)``: the parts, for hot loops
  (constant arguments converted once, the return code checked by the caller).
- ``graph_memcpy_nodes(graph)``, ``exec_memcpy_set_fn()``: the memcpy nodes of a captured
  graph and the edit that re-points one in its instantiated graph (``graphrt.graph_staging``).

Errors: ``CudaRuntimeError`` (a ``GraphrtError`` and a ``RuntimeError``, like torch's own
CUDA errors) carries the code and ``cudaGetErrorString``'s text.

Graph safety: host-only (it issues a copy on the stream given; inside a capture that copy
is captured as a memcpy node, as torch's would be).
"""
from __future__ import annotations

import ctypes
import os
from typing import Callable

import torch

from graphrt.env import env_flag
from graphrt.errors import GraphrtError

MEMCPY_H2D = 1          # cudaMemcpyHostToDevice
MEMCPY_D2D = 3          # cudaMemcpyDeviceToDevice
GRAPH_NODE_MEMCPY = 1   # cudaGraphNodeTypeMemcpy
# Stream handles that mean "of the current device": 0 (the legacy default stream, torch's
# default stream), 1 (cudaStreamLegacy), 2 (cudaStreamPerThread).
SPECIAL_STREAMS = 2


class CudaRuntimeError(GraphrtError, RuntimeError):
    """A CUDA runtime call of graphrt's raw path failed: ``code`` (a ``cudaError_t``) and
    the runtime's text for it."""

    def __init__(self, msg: str, code: int = 0):
        self.code = code
        super().__init__(msg)


class _Pos(ctypes.Structure):
    _fields_ = [("x", ctypes.c_size_t), ("y", ctypes.c_size_t), ("z", ctypes.c_size_t)]


class _PitchedPtr(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("pitch", ctypes.c_size_t), ("xsize", ctypes.c_size_t),
                ("ysize", ctypes.c_size_t)]


class _Memcpy3DParms(ctypes.Structure):
    """``struct cudaMemcpy3DParms`` (cuda_runtime_api.h): what a memcpy node copies."""
    _fields_ = [("src_array", ctypes.c_void_p), ("src_pos", _Pos), ("src_ptr", _PitchedPtr),
                ("dst_array", ctypes.c_void_p), ("dst_pos", _Pos), ("dst_ptr", _PitchedPtr),
                ("extent", _Pos), ("kind", ctypes.c_int)]


class _Cudart:
    """The bound functions of one libcudart."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        self.memcpy_async = lib.cudaMemcpyAsync   # CDLL: the GIL is released during the call
        self.memcpy_async.restype = ctypes.c_int
        self.memcpy_async.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                      ctypes.c_int, ctypes.c_void_p]
        self.error_string = lib.cudaGetErrorString
        self.error_string.restype = ctypes.c_char_p
        self.error_string.argtypes = [ctypes.c_int]
        self.get_last_error = lib.cudaGetLastError
        self.get_last_error.restype = ctypes.c_int
        self.get_last_error.argtypes = []
        P, S, I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int  # noqa: E741
        self.graph_get_nodes = lib.cudaGraphGetNodes
        self.graph_get_nodes.restype, self.graph_get_nodes.argtypes = I, [P, P, ctypes.POINTER(S)]
        self.node_get_type = lib.cudaGraphNodeGetType
        self.node_get_type.restype, self.node_get_type.argtypes = I, [P, ctypes.POINTER(I)]
        self.memcpy_node_params = lib.cudaGraphMemcpyNodeGetParams
        self.memcpy_node_params.restype = I
        self.memcpy_node_params.argtypes = [P, ctypes.POINTER(_Memcpy3DParms)]
        self.exec_memcpy_set_1d = lib.cudaGraphExecMemcpyNodeSetParams1D
        self.exec_memcpy_set_1d.restype = I
        self.exec_memcpy_set_1d.argtypes = [P, P, P, P, S, I]


_LIB: _Cudart | None = None
_AVAILABLE: bool | None = None   # None: not probed yet


def available() -> bool:
    """Whether ``cudaMemcpyAsync`` can be called here: a CUDA build of torch with the stream
    helpers, and its libcudart found. Probed once (it loads nothing new when torch's
    libcudart is already in the process); never raises. Host-only."""
    global _AVAILABLE, _LIB
    if _AVAILABLE is None:
        lib = None
        if torch.version.cuda and not getattr(torch.version, "hip", None) \
                and all(hasattr(torch._C, f) for f in ("_cuda_getCurrentRawStream", "_cuda_getDevice")):
            lib = _load()
        _LIB, _AVAILABLE = lib, lib is not None
    return _AVAILABLE


def library_path() -> str | None:
    """The path (or soname) of the libcudart in use, or None when ``available()`` is False."""
    return _LIB.path if available() else None


def memcpy_async_fn():
    """The ctypes ``cudaMemcpyAsync(dst, src, nbytes, kind, stream) -> cudaError_t`` (ints or
    ctypes values; kind ``MEMCPY_D2D``). The caller checks the code (``check``). Raises
    ``CudaRuntimeError`` when ``available()`` is False."""
    return _lib().memcpy_async


def stream_fns():
    """``(current_raw_stream, current_device)``: torch's C helpers ``(device_index) -> int``
    (the ``cudaStream_t`` of that device's current stream) and ``() -> int``."""
    _lib()
    return torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice


def check(rc: int, what: str) -> None:
    """Raise ``CudaRuntimeError`` for a nonzero ``cudaError_t`` ``rc`` of the call ``what``,
    with the runtime's text; the error is cleared first (``cudaGetLastError``), as torch
    does, so a later kernel-launch check does not report it again."""
    if rc:
        lib = _lib()
        lib.get_last_error()
        text = (lib.error_string(rc) or b"unknown error").decode(errors="replace")
        raise CudaRuntimeError(
            f"{what} failed with CUDA error {rc}: {text}. An error from an earlier kernel (an "
            "illegal address, a device assert) leaves the context unusable; rerun with "
            "CUDA_LAUNCH_BLOCKING=1 to find the call that caused it", rc)


def memcpy_d2d_async(dst_ptr: int, src_ptr: int, nbytes: int, stream: int) -> None:
    """Copy ``nbytes`` bytes from device address ``src_ptr`` to ``dst_ptr`` on ``stream`` (a
    ``cudaStream_t`` as an int; 0 is the current device's default stream), asynchronously;
    the ranges must not overlap. Raises ``CudaRuntimeError`` with the CUDA error text.
    Graph safety: host-only."""
    check(_lib().memcpy_async(dst_ptr, src_ptr, nbytes, MEMCPY_D2D, stream),
          f"cudaMemcpyAsync({dst_ptr:#x} <- {src_ptr:#x}, {nbytes} bytes, stream {stream:#x})")


def graph_memcpy_nodes(graph: int) -> list[tuple[int, int, int, int]]:
    """The memcpy nodes of a ``cudaGraph_t`` (``torch.cuda.CUDAGraph.raw_cuda_graph()``, an
    int): ``(node, dst address, src address, bytes)`` each, for 1-D copies (no arrays, one
    row). Raises ``CudaRuntimeError``. Host-only."""
    lib = _lib()
    count = ctypes.c_size_t(0)
    check(lib.graph_get_nodes(graph, None, ctypes.byref(count)), "cudaGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    check(lib.graph_get_nodes(graph, nodes, ctypes.byref(count)), "cudaGraphGetNodes")
    out, kind = [], ctypes.c_int(0)
    for node in nodes[:count.value]:
        check(lib.node_get_type(node, ctypes.byref(kind)), "cudaGraphNodeGetType")
        if kind.value != GRAPH_NODE_MEMCPY:
            continue
        p = _Memcpy3DParms()
        check(lib.memcpy_node_params(node, ctypes.byref(p)), "cudaGraphMemcpyNodeGetParams")
        if p.src_array or p.dst_array or p.extent.y != 1 or p.extent.z != 1:
            continue
        out.append((node, p.dst_ptr.ptr or 0, p.src_ptr.ptr or 0, p.extent.x))
    return out


def exec_memcpy_set_fn():
    """The ctypes ``cudaGraphExecMemcpyNodeSetParams1D(exec, node, dst, src, nbytes, kind)
    -> cudaError_t``: re-point a 1-D memcpy node of an instantiated graph for its *later*
    launches (those already queued keep what they had). The caller checks the code."""
    return _lib().exec_memcpy_set_1d


def raw_copyable(dst: torch.Tensor) -> bool:
    """Whether ``d2d_copier`` may copy into ``dst``: a contiguous CUDA tensor of some bytes,
    not complex (a conjugate view needs ``copy_``), with ``available()``, unless
    ``GRAPHRT_RAW_COPY=0`` (read when a step is bound: staging then uses ``copy_``)."""
    return dst.is_cuda and dst.is_contiguous() and not dst.is_complex() and dst.numel() > 0 \
        and env_flag("GRAPHRT_RAW_COPY", True) and available()


def d2d_copier(targets: list[tuple[int, torch.Tensor, str]]) -> Callable[[tuple], None]:
    """A function ``copy(vals)`` that copies ``vals[i]`` into ``dst`` for each ``(i, dst,
    name)`` of ``targets`` (each ``raw_copyable``; ``vals[i]`` has ``dst``'s dtype, shape and
    device, and is a plain ``torch.Tensor``) as ``dst.copy_(vals[i])`` would: one
    ``cudaMemcpyAsync`` on the current stream of ``dst``'s device. It calls ``dst.copy_``
    instead (which then does what it always does) for a source that is not contiguous, is a
    negative view, has no data (address 0) or overlaps ``dst`` (``copy_``: a no-op or an
    error), and while the current stream is a default stream (handles 0-2, which name the
    *current* device's) and the current device is another one. Raises ``CudaRuntimeError``
    naming the input. Graph safety: host-only."""
    memcpy, kind = memcpy_async_fn(), ctypes.c_int(MEMCPY_D2D)
    current_stream, current_device = stream_fns()
    dev = targets[0][1].device.index
    assert all(dst.device.index == dev for _, dst, _ in targets), "one device per copier"
    # (position, dst, its address, bytes; the two as ctypes values, converted once; the call)
    todo = tuple((i, dst, dst.data_ptr(), dst.nbytes, ctypes.c_void_p(dst.data_ptr()),
                  ctypes.c_size_t(dst.nbytes), f"cudaMemcpyAsync staging input {name!r}")
                 for i, dst, name in targets)

    def copy(vals: tuple) -> None:
        stream = current_stream(dev)
        if stream <= SPECIAL_STREAMS and current_device() != dev:
            stream = None                 # it would be the current device's default stream
        for i, dst, d, nb, c_d, c_nb, what in todo:
            src = vals[i]
            if stream is not None and src.is_contiguous() and not src.is_neg():
                s = src.data_ptr()
                if s and (s + nb <= d or d + nb <= s):
                    rc = memcpy(c_d, s, c_nb, kind, stream)
                    if rc:
                        check(rc, what)
                    continue
            dst.copy_(src)
    return copy


def _lib() -> _Cudart:
    if not available():
        raise CudaRuntimeError(f"the raw CUDA copy is not available here (torch "
                               f"{torch.__version__}: needs a CUDA build and its libcudart); "
                               "use Tensor.copy_")
    return _LIB


def _load() -> _Cudart | None:
    """torch's libcudart: the one mapped into this process, else one already loaded under a
    usual soname, else the soname of torch's CUDA major (loaded now). None if none binds."""
    major = (torch.version.cuda or "").split(".")[0]
    sonames = [f"libcudart.so.{v}" for v in dict.fromkeys((major, "13", "12")) if v]
    tries = [(p, 0) for p in _mapped()] + [(s, os.RTLD_NOLOAD | os.RTLD_NOW) for s in sonames]
    tries += [(f"libcudart.so.{major}", 0)] if major else []
    for name, mode in tries:
        try:
            return _Cudart(ctypes.CDLL(name, mode=mode) if mode else ctypes.CDLL(name), name)
        except (OSError, AttributeError):   # not there, or not a libcudart
            continue
    return None


def _mapped(maps: str = "/proc/self/maps") -> list[str]:
    """Paths of the libcudart shared objects mapped into this process (Linux)."""
    try:
        with open(maps) as f:
            paths = [line.split(None, 5)[5].strip() for line in f if "libcudart" in line]
    except (OSError, IndexError):
        return []
    return [p for p in dict.fromkeys(paths) if os.path.basename(p).startswith("libcudart")
            and ".so" in os.path.basename(p)]
