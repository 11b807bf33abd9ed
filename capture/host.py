"""Where a tensor would live on a GPU: device memory or host memory.

A graph hazard often depends on *where* data lives: indexing a CUDA tensor with a CPU index
tensor (or a Python list) uploads the index every call, ``host_buf.copy_(t)`` is a
device-to-host copy, and ``.item()`` on a CPU tensor is no sync at all. On CUDA the device
says it (``t.device``); when the analysis runs on CPU tensors standing in for CUDA ones
("simulate CUDA"), every tensor says ``cpu``, so ``HostData`` remembers which tensors would be
in host memory on a GPU:

- factories called without ``device=`` (and no ``torch.set_default_device``) or with
  ``device="cpu"``: ``torch.arange(n)``, ``torch.tensor(lst)``, ``torch.randperm(n)``;
  ``torch.from_numpy(a)`` (seen as ``aten.lift_fresh``, which reaches a
  ``TorchFunctionMode`` only while a dispatch mode is active: ``track()`` enters one);
- ``t.cpu()``, ``t.to("cpu")``, ``t.pin_memory()``;
- the results of calls whose tensor arguments all live on the host (``host_t % 4``, views).

``t.to(device)`` / ``t.cuda()`` / a factory with ``device=device`` give a device tensor: on
CPU stand-ins a device (a ``torch.device``, a string such as ``str(device)``, the default
device) that is ``cpu`` means the step's own device unless the line making the call names
the CPU (a ``"cpu"`` string, a name ``cpu``: ``names_cpu``). The
step's inputs and anything created outside tracking count as device tensors (no finding is
made on a guess). ``track()`` is a ``TorchFunctionMode`` for build time (FUNC); the safety
analyzer calls ``note`` for every call of the step.

Graph safety: host-only bookkeeping for the analysis.
"""
from __future__ import annotations

import ast
import contextlib
import io
import linecache
import numbers
import threading
import tokenize
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

_T = torch.Tensor
# aten.lift_fresh reaches the function mode only from calls it does not see itself
# (torch.from_numpy, legacy constructors such as torch.LongTensor(list)): CPU tensors.
_TO_HOST = (_T.cpu, _T.pin_memory, torch.ops.aten.lift_fresh.default)
_TO_DEVICE = (_T.cuda,)


def tensors(*trees) -> list[torch.Tensor]:
    """Every tensor among the leaves of ``trees`` (args, kwargs, outputs)."""
    return [t for tree in trees for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _line_names_cpu() -> bool:
    """Whether the source line that made the current torch call names the CPU: the
    innermost frame outside torch and the capture machinery (``sites.calling_lines``), in the
    user's code or in graphrt's. Not the user's own outermost line: a library line such as
    ``torch.empty(..., device=x.device)`` called from ``analyze_step(spec, [2], "cpu")`` means
    the step's device."""
    from graphrt.capture.sites import calling_lines
    file, first, last = calling_lines()
    return names_cpu("".join(linecache.getline(file, n) for n in range(first, last + 1)))


def names_cpu(source: str) -> bool:
    """Whether a line of code names the CPU: a string ``"cpu"`` / ``"cpu:N"``, a name or
    attribute ``cpu`` (``device=cpu``, ``x.to(self.cpu)``, ``.cpu()``); not a comment, not a
    longer name (``num_cpu_blocks``), not an object called cpu whose attributes or items are
    read (``self.cpu.to(device)``, vLLM's ``CpuGpuBuffer``; ``cpu[:n]``). A line that does
    not tokenize on its own (part of a longer statement) is read up to where it stops."""
    if "cpu" not in source:
        return False
    toks = _tokens(source)
    for k, tok in enumerate(toks):
        if tok.type == tokenize.NAME and tok.string == "cpu":
            after = toks[k + 1].string if k + 1 < len(toks) else ""
            if after not in (".", "["):  # cpu, x.cpu(), self.cpu as a value: not cpu.to(...)
                return True
        if tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, str) and value.split(":")[0] == "cpu":
                return True
    return False


def _tokens(source: str) -> list[tokenize.TokenInfo]:
    """The line's tokens, without comments and line ends; for a line that does not tokenize
    on its own (an open bracket or string), the tokens read before it stopped."""
    toks: list[tokenize.TokenInfo] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
                toks.append(tok)
    except (tokenize.TokenError, SyntaxError):
        pass
    return toks


def _default_device() -> torch.device | None:
    """The device of an active ``torch.set_default_device`` / ``with torch.device(...)``
    (torch keeps it as a ``DeviceContext`` function mode), or None when none is set."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return torch.device(mode.device)
    ctx = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    return torch.device(ctx.device) if ctx is not None else None


class HostData:
    """Which tensors live (or, simulating CUDA, would live) in host memory.

    Args:
        simulate: the tensors are CPU stand-ins for CUDA ones: remember host tensors as they
            are made. Otherwise a tensor is on the host when ``t.device.type == "cpu"``.
    """

    def __init__(self, simulate: bool):
        self.simulate = simulate
        self._host = WeakIdKeyDictionary()

    def is_host(self, x: Any) -> bool:
        """A tensor in host memory (a CPU tensor on a GPU machine)."""
        if not isinstance(x, torch.Tensor):
            return False
        if not self.simulate:
            return x.device.type == "cpu"
        return x in self._host

    def all_host(self, args, kwargs=None) -> bool:
        """Some tensor among ``args``/``kwargs``, and every one in host memory."""
        ts = tensors(args, kwargs or {})
        return bool(ts) and all(self.is_host(t) for t in ts)

    def host_index(self, index: Any) -> bool:
        """An index that is host data: a Python list of ints (NumPy ints too) or a ``range``,
        a NumPy array, or a host
        tensor with at least one dimension (alone or inside a tuple index). Indexing a
        device tensor with it copies it to the device first."""
        for i in index if isinstance(index, tuple) else (index,):
            if isinstance(i, torch.Tensor):
                if i.dim() > 0 and self.is_host(i):
                    return True
            elif isinstance(i, range):
                if len(i):
                    return True
            elif isinstance(i, list):
                if i and all(isinstance(v, (numbers.Integral, list)) for v in i):
                    return True
            elif hasattr(i, "__array__") and getattr(i, "ndim", 0) > 0:
                return True
        return False

    # -- bookkeeping (simulating CUDA only) --------------------------------------------------
    def mark(self, outs, host: bool) -> None:
        for t in tensors(outs):
            if host:
                self._host[t] = True
            else:
                self._host.pop(t, None)

    def target(self, func, args, kwargs) -> bool | None:
        """Where the call puts its result: True host, False device, None not said. On CPU
        stand-ins a ``torch.device("cpu")`` is the step's own device unless the line making
        the call names cpu (``_line_names_cpu``)."""
        if func in _TO_HOST:
            return True
        if func in _TO_DEVICE:
            return False
        places = list(args[1:]) if func is _T.to else []
        places.append(kwargs.get("device"))
        for p in places:
            if isinstance(p, torch.Tensor):
                return self.is_host(p)
            if isinstance(p, (str, torch.device)):  # a string too: str(device), device.type
                try:
                    kind = torch.device(p).type
                except RuntimeError:                 # not a device: the call itself says so
                    return None
                return kind == "cpu" and (not self.simulate or _line_names_cpu())
        return None

    def note(self, func, args, kwargs, out):
        """Record where the result of ``func(*args, **kwargs)`` lives (simulating CUDA), and
        return it: a distinct copy where a move of a host tensor to the device returned that
        very tensor (on CPU stand-ins ``t.to(device)`` is ``t``; on a GPU it is a new device
        tensor, and the host one stays on the host: vLLM's ``x_cpu`` beside ``x``)."""
        if self.simulate:
            try:
                kwargs = kwargs or {}
                if (isinstance(out, torch.Tensor) and any(out is a for a in args)
                        and self.is_host(out) and self.target(func, args, kwargs) is False):
                    with torch._C.DisableTorchFunctionSubclass():
                        out = out.clone()
                self._note(func, args, kwargs, out)
            except Exception:  # noqa: BLE001 - bookkeeping must never break the user's code
                pass
        return out

    def _note(self, func, args, kwargs, out) -> None:
        outs = tensors(out)
        if not outs:
            return
        target = self.target(func, args, kwargs)
        if target is not None:
            self.mark(outs, target)
        elif not tensors(args, kwargs):  # a factory without device=: the default device's
            dev = _default_device()      # memory (host memory unless one is set)
            self.mark(outs, dev is None or (dev.type == "cpu" and _line_names_cpu()))
        elif self.all_host(args, kwargs):
            self.mark(outs, True)

    def track(self) -> "_Track":
        """A context manager that notes every torch call (build time): a ``TorchFunctionMode``,
        with a pass-through ``TorchDispatchMode`` inside it so that ``torch.from_numpy``
        reaches it (as ``aten.lift_fresh``), as it does in the analysis of the step."""
        return _Track(self)


_EAGER_LOCK = threading.Lock()
_eager = {"depth": 0, "stance": None}   # analyses inside; the stance the first one set


@contextlib.contextmanager
def compiled_run_eagerly():
    """A context in which ``torch.compile``'d functions run their Python eagerly
    (``torch.compiler.set_stance("force_eager")``): torch refuses to compile under a
    dispatch mode and remembers the frame as skipped, so an analysis or FUNC's tracking left
    the step uncompiled for good (``fullgraph=True`` raised). The analysis sees the step's
    ops as the compiled code would run them; the warm-up after it compiles.

    The stance is torch's, process-wide: analyses on several threads share it (the first
    sets it, the last puts back what was there), and another thread's compiled code runs
    eagerly while one is under way."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:
        yield
        return
    with _EAGER_LOCK:
        if _eager["depth"] == 0:
            stance = set_stance("force_eager")
            stance.__enter__()
            _eager["stance"] = stance
        _eager["depth"] += 1
    try:
        yield
    finally:
        with _EAGER_LOCK:
            _eager["depth"] -= 1
            if _eager["depth"] == 0:
                stance, _eager["stance"] = _eager["stance"], None
                stance.__exit__(None, None, None)


class _Track(TorchFunctionMode):
    def __init__(self, host: HostData):
        super().__init__()
        self.host = host
        self._inner = _PassThrough()
        self._stance = None

    def __enter__(self):
        self._stance = compiled_run_eagerly()
        self._stance.__enter__()
        try:
            super().__enter__()
            try:
                self._inner.__enter__()
            except BaseException:
                super().__exit__(None, None, None)
                raise
        except BaseException:
            self._stance.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            try:
                self._inner.__exit__(*exc)
            finally:
                super().__exit__(*exc)
        finally:
            self._stance.__exit__(None, None, None)
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        return self.host.note(func, args, kwargs, out)


class _PassThrough(TorchDispatchMode):
    """Runs every ATen op as is; its calls from Python let the function mode see the ops that
    no torch function wraps (``aten.lift_fresh`` of ``torch.from_numpy``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
