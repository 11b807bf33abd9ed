"""Which torch calls are graph hazards, at two levels.

``classify_call`` looks at a top-level torch call as the user wrote it (seen by a
``TorchFunctionMode``): it knows the names users recognise (``Tensor.item``, ``one_hot``)
and the safe forms (``one_hot(x, num_classes=E)``, ``repeat_interleave(..., output_size=N)``)
whose CPU implementations happen to read values on the host but whose CUDA ones do not.
Its knowledge is ``RULES``: one ``Rule`` per op, covering every function that is that op
(``torch.nonzero`` and ``Tensor.nonzero``), written once.

``classify_aten`` looks at each ATen op (seen by a ``TorchDispatchMode``) and catches what
the first level cannot name: ops inside library code, syncs reached through other paths.

Both know *where* data lives (``capture.host.HostData``): work on host tensors is no hazard
(``.item()`` of a CPU tensor does not sync), host data going to the device is. The ops
whose host work exists only in their CUDA implementation are in ``capture.rules_cuda``.

Each returns None (not a hazard) or a ``Hit(kind, op, message)``; ``SAFE`` means "a safe
form: suppress the ATen ops inside".
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from graphrt.capture.host import HostData, tensors
from graphrt.errors import InputError, is_int


class Hit(NamedTuple):
    """A classified call: the finding's ``kind``, ``op`` label and ``message``."""

    kind: str
    op: str
    message: str


class Ctx(NamedTuple):
    """What a rule's ``when`` may ask: whether CPU tensors stand in for CUDA ones, and which
    tensors live in host memory."""

    simulate: bool
    host: HostData


SAFE = Hit("safe", "", "")

_SYNC = "host-sync"
_H2D = "host-to-device-copy"
UPLOAD = ("copies host data (a Python list, a NumPy array or a CPU tensor) to the device "
          "on every call: a host-to-device copy that the graph cannot replay. Build the "
          "tensor on the device once in FUNC (device=device) and close over it")

D2H = ("copies device data into a host tensor: a sync. Keep the result on the device (return "
       "it; the engine copies outputs after the replay)")

ELEMENTS = ("reads each device tensor of the list on the host (.item()): a sync, and the "
            "values are frozen into the graph. Keep them on the device: torch.stack([...]) "
            "(or torch.cat)")

MASK_AND_INDEX = ("writes a Python number through a bool mask together with another tensor "
                  "index: not masked_fill_ but index_put_, which runs nonzero(mask) (a sync) "
                  "and uploads the value. Fold the mask into the value: "
                  "x[rows, idx] = torch.where(mask, v, x[rows, idx]), or mask alone")

SCALAR_WRITE = ("writes a Python number (or a host 0-d tensor) into one element of a device "
                "tensor, or at integer-tensor indices: torch uploads the value from host memory "
                "first, a blocking copy that CUDA-graph capture refuses. Write it with a fill "
                "kernel: x[i:i+1] = v, x.index_fill_(dim, idx, v), x.scatter_(dim, idx, v), or "
                "from a device value (x.new_full((), v))")

_F = torch.nn.functional
_T = torch.Tensor


@dataclass(frozen=True)
class Rule:
    """One op that can be a graph hazard, and every function that is that op.

    Attributes:
        name: the op as users know it. Findings are labelled ``Tensor.<name>`` for a
            ``torch.Tensor`` method and ``torch.<name>`` otherwise, unless ``op`` is set.
        kind: ``host-sync`` or ``host-to-device-copy``.
        message: what happens on a GPU and the fix (shown to users as is).
        functions: the callables a ``TorchFunctionMode`` sees for this op
            (e.g. ``(torch.nonzero, torch.Tensor.nonzero)``).
        when: None: the op is always a hazard. Else ``when(args, kwargs, ctx)`` (``Ctx``)
            decides for one call: True: a hazard; False: a safe form (the ATen ops inside are
            not flagged either); None: not a hazard, look inside as usual; a ``Hit``: a
            hazard of another kind than ``kind`` (indexing: a sync with a device mask, an
            upload with host indices).
        op: a fixed label for every function of the op (``one_hot``, ``boolean-mask
            indexing``), when the ``torch.``/``Tensor.`` form is not what users wrote.
        host_args_safe: a call whose tensors all live in host memory is no hazard (work on
            host data); False for copies between host and device.
    """

    name: str
    kind: str
    message: str
    functions: tuple = ()
    when: Callable[[tuple, dict, Ctx], "bool | Hit | None"] | None = None
    op: str | None = None
    host_args_safe: bool = True

    def label(self, func) -> str:
        if self.op is not None:
            return self.op
        owner = "Tensor" if getattr(_T, self.name, None) is func else "torch"
        return f"{owner}.{self.name}"


# -- conditions (``Rule.when``) ---------------------------------------------------------------
def _is_bool_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bool


def _has_bool_index(index) -> bool:
    if isinstance(index, (tuple, list)):
        return any(_is_bool_tensor(i) for i in index)
    return _is_bool_tensor(index)


def _copies_to_host(args, kwargs, ctx):
    """``.cpu()`` / ``.numpy()``: a device-to-host copy unless the source is a host tensor
    (when CPU tensors stand in for CUDA ones, only those ``HostData`` knows)."""
    return not ctx.host.is_host(args[0] if args else None)


def _to(args, kwargs, ctx):
    # On CPU stand-ins every device is "cpu": `x.to(device)` / `x.to(y.device)` with the
    # step's own device is a no-op on a GPU, not a copy to the host. HostData says where the
    # result goes (host only when the user wrote cpu: a "cpu" string or a line naming it).
    src = args[0] if args else None
    if not isinstance(src, torch.Tensor):
        return None
    target = ctx.host.target(_T.to, args, kwargs)
    if target is True and not ctx.host.is_host(src):
        return True
    if target is False and ctx.host.is_host(src):  # a 0-d one too: a blocking upload
        return Hit(_H2D, "Tensor.to (host->device)", UPLOAD)
    return None


def _from_data(position: int, name: str, what: str):
    """Factories that take their data at ``args[position]`` (or ``name=``): Python or NumPy
    data is host data baked into the graph (True). A tensor is copied where the call puts
    the result (``device=``; else where the data is, or ``self``'s memory for
    ``new_tensor``): a host tensor to the device uploads it, a device tensor to the host
    syncs; otherwise no copy (None: the ATen ops inside are looked at as usual)."""
    def when(args, kwargs, ctx):
        data = args[position] if len(args) > position else kwargs.get(name)
        if isinstance(data, (list, tuple)) and any(
                isinstance(v, torch.Tensor) and not ctx.host.is_host(v) for v in _leaves(data)):
            return Hit(_SYNC, f"{what} of device tensors", ELEMENTS)
        if not isinstance(data, torch.Tensor):
            return True
        to_host = ctx.host.target(None, (), kwargs)
        if to_host is None:
            if position == 0:
                return None  # stays in its own memory
            to_host = ctx.host.is_host(args[0])
        if to_host is False and ctx.host.is_host(data):
            return Hit(_H2D, f"{what} (host->device)", UPLOAD)
        if to_host is True and not ctx.host.is_host(data):
            return Hit(_SYNC, f"{what} (device->host)", D2H)
        return None
    return when


def _leaves(data):
    """The non-list leaves of nested lists and tuples."""
    for v in data:
        if isinstance(v, (list, tuple)):
            yield from _leaves(v)
        else:
            yield v


def _one_hot_without_classes(args, kwargs, ctx):
    nc = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
    return nc is None or nc < 0


def _repeats_without_output_size(args, kwargs, ctx):
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
    if repeats is None and "repeats" not in kwargs and len(args) + len(kwargs) == 1:
        repeats = args[0] if args else kwargs.get("input")  # repeat_interleave(counts)
    return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None


def _type_to_host(args, kwargs, ctx):
    """``x.type(torch.FloatTensor)``: a CPU tensor type moves a device tensor to the host
    (``x.type()`` and ``x.type(torch.float32)`` do not). A type given as a string is not
    judged here: on CPU stand-ins ``y.type(x.type())`` names a CPU type though on a GPU it is
    ``x``'s own; on CUDA the ATen copy's rule sees a real move."""
    t = kwargs.get("dtype", args[1] if len(args) > 1 else None)
    cpu_type = isinstance(t, type) and getattr(t, "__module__", "") == "torch"
    return (cpu_type and _copies_to_host(args, kwargs, ctx)) or None


def _where_one_argument(args, kwargs, ctx):
    return True if len(args) + len(kwargs) == 1 else None


def _indexing_host(args, ctx, what: str) -> Hit | None:
    """Indexing a device tensor with host data uploads the index (``index``/``index_put_``
    move every index to ``self``'s device first; a host bool mask goes through nonzero on
    the host, then up)."""
    if len(args) > 1 and not ctx.host.is_host(args[0]) and ctx.host.host_index(args[1]):
        return Hit(_H2D, f"{what} (host indices)", UPLOAD)
    return None


def _bool_mask_read(args, kwargs, ctx):
    upload = _indexing_host(args, ctx, "indexing")
    if upload is not None:
        return upload
    return True if len(args) > 1 and _has_bool_index(args[1]) else None


def _scalar_write(args, ctx) -> Hit | None:
    """``x[i] = 5.0`` / ``x[idx] = 5.0`` on a device tensor: for a CUDA tensor torch makes the
    value a host 0-d tensor; a 0-d target takes it by ``copy_`` (a blocking upload), integer
    tensor indices by ``index_put_`` (``value.to(device)``). A target of one or more
    dimensions (``x[i:i+1]``, a row) takes it by ``fill_``, and a bool mask by
    ``masked_fill_``: no copy."""
    if len(args) < 3 or ctx.host.is_host(args[0]):
        return None
    value = args[2]
    if isinstance(value, torch.Tensor):
        if value.dim() or not ctx.host.is_host(value):
            return None
    elif not isinstance(value, numbers.Number):       # (a bool and a complex too)
        return None
    parts = args[1] if isinstance(args[1], tuple) else (args[1],)

    def an_int(p):  # a select: a Python int, or a 0-d integer tensor (read as an int)
        if isinstance(p, torch.Tensor):
            return p.dim() == 0 and not p.is_floating_point() and p.dtype != torch.bool
        return is_int(p)
    indices = [p for p in parts if isinstance(p, torch.Tensor) and not an_int(p)]
    if any(_is_bool_tensor(p) for p in indices):
        if len(indices) == 1:
            return None                               # masked_fill_ (the rule below)
        return Hit(_SYNC, "indexed assignment of a host scalar", MASK_AND_INDEX)
    one_element = (all(p is Ellipsis or an_int(p) for p in parts)
                   and sum(an_int(p) for p in parts) == args[0].dim())
    if indices or one_element:
        return Hit(_SYNC, "indexed assignment of a host scalar", SCALAR_WRITE)
    return None


def _bool_mask_write(args, kwargs, ctx):
    upload = _indexing_host(args, ctx, "indexed assignment")
    if upload is not None:
        return upload
    across = _assign_across(args, ctx)
    if across is not None:
        return across
    scalar = _scalar_write(args, ctx)
    if scalar is not None:
        return scalar
    if not (len(args) > 2 and _has_bool_index(args[1])):
        return None
    value = args[2]
    if isinstance(value, (int, float, bool)) or (
            isinstance(value, torch.Tensor) and value.numel() == 1 and ctx.host.is_host(value)):
        return False  # becomes masked_fill_ (a host value only): no sync
    return True


def across(dst: torch.Tensor, src: torch.Tensor, ctx: Ctx, what: str,
           scalars: bool = False) -> Hit | None:
    """A copy of ``src`` into ``dst`` between host and device memory (``Tensor.copy_``, and
    the ``copy_`` that ``dst[i] = src`` ends in): device data into a host tensor syncs; a host
    tensor into a device one uploads: one of one or more dimensions, or, ``scalars``
    (``copy_`` itself), a 0-d one too (``dst[i] = src`` takes a 0-d host value by a fill
    kernel, or by an upload that ``_scalar_write`` names). None within one memory."""
    if ctx.host.is_host(dst) and not ctx.host.is_host(src):
        return Hit(_SYNC, f"{what} (device->host)", D2H)
    if not ctx.host.is_host(dst) and ctx.host.is_host(src) and (scalars or src.dim() > 0):
        return Hit(_H2D, f"{what} (host->device)", UPLOAD)
    return None


def _assign_across(args, ctx) -> Hit | None:
    if len(args) < 3 or not isinstance(args[2], torch.Tensor):
        return None
    return across(args[0], args[2], ctx, "indexed assignment")


def _histc_default_range(args, kwargs, ctx):
    # measured: CUDA histc syncs when min == max
    lo = kwargs.get("min", args[2] if len(args) > 2 else 0)
    hi = kwargs.get("max", args[3] if len(args) > 3 else 0)
    return lo == hi


def _never(args, kwargs, ctx):
    return False


# -- the rules ------------------------------------------------------------------------------
_DATA_SIZED = "output size depends on data: a sync. "
_NONZERO_FIX = _DATA_SIZED + "Use torch.nonzero_static(x, size=N) or a mask"
_MASK_FIX = _DATA_SIZED + "Use torch.where(mask, x, 0) and keep the full shape"
_BINCOUNT = ("reads max(x) on the host to size its output (a sync on CUDA). Use "
             "torch.zeros(E).scatter_add_(0, x, ones) with a fixed E")
_HOST_DATA = "builds a tensor from host data inside the step; its values are baked into the " \
             "graph at capture. Build it once outside the step (at setup) and close over it"


def _sync(name, message, *functions, when=None, op=None, host_args_safe=True) -> Rule:
    return Rule(name, _SYNC, message, functions, when, op, host_args_safe)


def _h2d(name, *functions, when=None, op=None, host_args_safe=True) -> Rule:
    return Rule(name, _H2D, _HOST_DATA, functions, when, op, host_args_safe)


RULES: tuple[Rule, ...] = (
    # Reads of device data on the host.
    _sync("item", "reads a device value on the host: a sync, and the value is frozen into the "
          "graph. Keep it on the device (pass the tensor on)", _T.item),
    _sync("__bool__", "`if tensor:` / bool(tensor) reads a device value on the host. Use "
          "torch.where(cond, a, b) or a mask instead of Python control flow", _T.__bool__),
    _sync("__int__", "int(tensor) reads a device value on the host. Keep the value on the "
          "device, or compute it before the step", _T.__int__),
    _sync("__float__", "float(tensor) reads a device value on the host. Keep the value on the "
          "device", _T.__float__),
    _sync("__index__", "using a tensor as a Python index reads it on the host. Index with the "
          "tensor itself (x.index_select / gather)", _T.__index__),
    _sync("tolist", "copies device data to a Python list: a sync, and anything built from it "
          "is baked into the graph. Keep counts/indices on the device", _T.tolist),
    _sync("numpy", "copies device data to the host (a sync). Keep it on the device", _T.numpy,
          when=_copies_to_host),
    _sync("cpu", "device-to-host copy: a sync inside the step. Keep it on the device", _T.cpu,
          when=_copies_to_host),
    _sync("__array__", "converts the tensor to a NumPy array (np.asarray(t), or a NumPy "
          "operand in t + array): a device-to-host copy, a sync (on a CUDA tensor it raises). "
          "Keep it on the device; make NumPy constants tensors on the device once in FUNC",
          _T.__array__, when=_copies_to_host, op="Tensor.__array__ (NumPy conversion)"),
    _sync("type", "device-to-host copy: a sync inside the step. Keep it on the device", _T.type,
          when=_type_to_host, op="Tensor.type (a CPU tensor type)"),
    _sync("to", "device-to-host copy: a sync inside the step. Keep it on the device", _T.to,
          when=_to, op="Tensor.to('cpu')", host_args_safe=False),
    # Printing reads the whole tensor on the host; on CPU the read is a direct data access
    # that no ATen op shows (a CUDA repr syncs: measured on the H200, torch 2.11).
    _sync("__repr__", "printing a tensor copies it to the host: a sync. Remove debug prints "
          "from the step", _T.__repr__),
    _sync("__format__", "formatting a tensor (f-string) copies it to the host: a sync. Remove "
          "it from the step", _T.__format__),
    # Python values computed from device data.
    _sync("equal", "returns a Python bool: a sync. Compare on the device (torch.eq / "
          "torch.where)", torch.equal, _T.equal),
    _sync("allclose", "returns a Python bool: a sync. Compare on the device (torch.isclose, "
          "then keep the mask on the device)", torch.allclose, _T.allclose),
    # Outputs whose size depends on data.
    _sync("nonzero", _NONZERO_FIX, torch.nonzero, _T.nonzero),
    _sync("argwhere", _NONZERO_FIX, torch.argwhere),
    _sync("where", "the one-argument form is nonzero(): a sync. Use torch.where(cond, a, b) or "
          "nonzero_static", torch.where, when=_where_one_argument, op="torch.where(cond)"),
    _sync("masked_select", _MASK_FIX, torch.masked_select, _T.masked_select),
    _sync("__getitem__", "x[mask] has a data-dependent size: a sync. Use torch.where(mask, x, 0) "
          "and keep the full shape", _T.__getitem__, when=_bool_mask_read,
          op="boolean-mask indexing"),
    _sync("__setitem__", "x[mask] = values needs nonzero(mask): a sync. Use torch.where(mask, "
          "values, x) with full-shape values", _T.__setitem__, when=_bool_mask_write,
          op="boolean-mask assignment"),
    _sync("unique", _DATA_SIZED + "Count with scatter_add_ into a fixed-size buffer instead",
          torch.unique, _T.unique),
    _sync("unique_consecutive", _DATA_SIZED + "Keep fixed shapes", torch.unique_consecutive),
    _sync("bincount", _BINCOUNT, torch.bincount, _T.bincount),
    _sync("histc", "with min == max (the default) it reads min(x)/max(x) on the host (a sync "
          "on CUDA). Pass fixed min= and max=", torch.histc, _T.histc,
          when=_histc_default_range, op="histc"),
    _sync("one_hot", "without num_classes it reads max(x) on the host. Pass num_classes=E",
          _F.one_hot, when=_one_hot_without_classes, op="one_hot"),
    _sync("repeat_interleave", "with tensor repeats and no output_size it reads sum(repeats) "
          "on the host. Pass output_size=N", torch.repeat_interleave, _T.repeat_interleave,
          when=_repeats_without_output_size, op="repeat_interleave"),
    # Safe forms whose CPU implementations read values on the host (never flagged).
    _sync("nonzero_static", "", *(f for f in (torch.nonzero_static, getattr(_T, "nonzero_static", None))
                                  if f is not None), when=_never),
    # Host data baked into the graph.
    # A host tensor given to them with device= (new_tensor: self's memory) is an upload; on a
    # GPU the copy inside runs with the dispatch modes off, so only this level sees it.
    _h2d("tensor", torch.tensor, when=_from_data(0, "data", "torch.tensor"),
         host_args_safe=False),
    _h2d("as_tensor", torch.as_tensor, when=_from_data(0, "data", "torch.as_tensor"),
         host_args_safe=False),
    # The same hazard through other names (the CPU copy shows no ATen op); x.new_tensor([..])
    # on CUDA fails capture (measured on the H200, torch 2.11).
    _h2d("asarray", torch.asarray, when=_from_data(0, "obj", "torch.asarray"),
         host_args_safe=False),
    _h2d("new_tensor", _T.new_tensor, when=_from_data(1, "data", "Tensor.new_tensor"),
         host_args_safe=False),
    # torch.from_numpy is no function a TorchFunctionMode sees: it surfaces as
    # aten.lift_fresh(t), once the dispatch mode calls it from Python (torch 2.11 and 2.13).
    # `t` is the array's fresh CPU tensor: a real host tensor on CUDA, one the analysis has not
    # seen yet on CPU stand-ins. So "work on host data" must not excuse it
    # (host_args_safe=False), or CUDA mode alone would call it safe.
    _h2d("from_numpy", torch.from_numpy, torch.ops.aten.lift_fresh.default,
         op="torch.from_numpy", host_args_safe=False),
)


def _index(rules) -> dict[Any, tuple[Rule, str]]:
    table: dict[Any, tuple[Rule, str]] = {}
    for rule in rules:
        for fn in rule.functions:
            if fn in table:
                raise InputError(f"{fn} has two rules: {table[fn][0].name!r} and {rule.name!r}")
            table[fn] = (rule, rule.label(fn))
    return table


def classify_call(func, args, kwargs, simulate_cuda: bool, host: HostData | None = None) -> Hit | None:
    """Classify a top-level torch call; ``simulate_cuda``: the tensors are CPU stand-ins;
    ``host``: which tensors live in host memory (default: none known on CPU stand-ins)."""
    found = _BY_FUNCTION.get(func)
    if found is None:
        return None
    rule, label = found
    kwargs = kwargs or {}
    ctx = Ctx(simulate_cuda, host if host is not None else HostData(simulate_cuda))
    if rule.host_args_safe and ctx.host.all_host(args, kwargs):
        return SAFE  # host work on host data: no sync, nothing to copy
    verdict = True if rule.when is None else rule.when(args, kwargs, ctx)
    if verdict is None:
        return None
    if isinstance(verdict, Hit):
        return verdict
    return Hit(rule.kind, label, rule.message) if verdict else SAFE


_A = torch.ops.aten
_ATEN_SYNC = {
    _A._local_scalar_dense: "reads a device value on the host (a sync)",
    _A.nonzero: "output size depends on data: a sync",
    _A.masked_select: "output size depends on data: a sync",
    _A._unique: "output size depends on data: a sync",
    _A._unique2: "output size depends on data: a sync",
    _A.unique_dim: "output size depends on data: a sync",
    _A.unique_consecutive: "output size depends on data: a sync",
    _A.unique_dim_consecutive: "output size depends on data: a sync",
    _A.bincount: "reads max(x) on the host to size its output (a sync on CUDA)",
    _A.equal: "returns a Python bool (a sync)",
    _A.is_nonzero: "returns a Python bool (a sync)",
}


# ATen ops that take tensors of both memories on CUDA: copies, and indexing with host indices
# (an upload: the function-level rules name it). Any other op given a host tensor of one or
# more dimensions beside device tensors raises on a GPU ("Expected all tensors to be on the
# same device"): on CPU stand-ins that is a finding, so the CPU analysis does not pass a step
# that cannot run on a GPU.
_MOVES_DATA = {_A.copy_, _A._to_copy, _A.lift_fresh, _A.lift_fresh_copy, _A.index, _A.index_put,
               _A.index_put_, _A._index_put_impl_, _A._unsafe_index, _A._unsafe_index_put}
_MIXED = ("a tensor in host memory (made in the step without device=, or by .cpu()) meets "
          "device tensors: on a GPU this op raises 'Expected all tensors to be on the same "
          "device'. Make it on the device (device=x.device), once in FUNC if it is constant")


def _host_among_device(args, kwargs, host: HostData) -> bool:
    """Whether an op's tensor arguments hold a host tensor of one or more dimensions and
    some tensor in device memory."""
    ts = tensors(args, kwargs)
    return (any(t.dim() > 0 and host.is_host(t) for t in ts)
            and any(not host.is_host(t) for t in ts))


# torch.distributed's host barriers, however called (``dist.barrier``, ``from
# torch.distributed import barrier``, a process group's own ``barrier()``): ATen op -> name
_BARRIERS = {"barrier": "barrier", "monitored_barrier_": "monitored_barrier"}


def classify_aten(func, args, kwargs, cuda: bool, host: HostData | None = None) -> Hit | None:
    """Classify one ATen op; ``cuda``: real CUDA tensors (copies across devices are visible);
    ``host``: which tensors live in host memory (default: by device on CUDA, none on CPU)."""
    kwargs = kwargs or {}
    host = host if host is not None else HostData(not cuda)
    packet = func.overloadpacket
    if cuda and packet in (_A._to_copy, _A.copy_):
        if packet is _A.copy_:
            dst, src = args[0], args[1]
            dst_dev, src_dev = dst.device.type, src.device.type
        else:
            src = args[0]
            dev = kwargs.get("device")
            src_dev = src.device.type
            dst_dev = torch.device(dev).type if dev is not None else src_dev
        if src_dev == "cuda" and dst_dev == "cpu":
            return Hit(_SYNC, f"aten.{packet.__name__} (device->host)", "device-to-host copy: a "
                       "sync inside the step. Keep it on the device")
        if src_dev == "cpu" and dst_dev == "cuda" and src.dim() > 0:
            return Hit(_H2D, f"aten.{packet.__name__} (host->device)", _HOST_DATA)
        return None
    if func.namespace == "c10d" and packet.__name__ in _BARRIERS:
        return Hit(_SYNC, f"torch.distributed.{_BARRIERS[packet.__name__]}", "blocks the host "
                   "until every rank arrives, outside the device's work: a graph replays "
                   "without it (NCCL's waits on the device, which capture refuses). Order ranks "
                   "by the collectives the step makes")
    if host.all_host(args, kwargs):
        return None  # host work on host data
    msg = _ATEN_SYNC.get(packet)
    if msg is not None:
        return Hit(_SYNC, f"aten.{packet.__name__}", msg + ". Keep shapes fixed and values on the device")
    if packet is _A.repeat_interleave and func is _A.repeat_interleave.Tensor:
        if kwargs.get("output_size") is None:
            return Hit(_SYNC, "aten.repeat_interleave", "reads sum(repeats) on the host. Pass output_size=N")
    hit = classify_aten_cuda(func, args, kwargs, host)
    if hit is not None:
        return hit
    if packet in (_A.index, _A.index_put, _A.index_put_):
        indices = args[1] if len(args) > 1 else ()
        if any(_is_bool_tensor(i) for i in indices or ()):
            return Hit(_SYNC, f"aten.{packet.__name__} (bool mask)", "boolean-mask indexing needs "
                       "nonzero(mask): a sync. Use torch.where(mask, a, b)")
    if not cuda and packet not in _MOVES_DATA and _host_among_device(args, kwargs, host):
        return Hit(_H2D, f"aten.{packet.__name__} (host and device tensors)", _MIXED)
    return None


# The CUDA-only rules need Rule/Hit from this module: imported once both exist.
from graphrt.capture.rules_cuda import CUDA_RULES, classify_aten_cuda  # noqa: E402

_BY_FUNCTION = _index(RULES + CUDA_RULES)
