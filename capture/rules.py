"""Which torch calls are graph hazards, at two levels.

``classify_call`` looks at a top-level torch call as the user wrote it (seen by a
``TorchFunctionMode``): it knows the names users recognise (``Tensor.item``, ``one_hot``)
and the safe forms (``one_hot(x, num_classes=E)``, ``repeat_interleave(..., output_size=N)``)
whose CPU implementations happen to read values on the host but whose CUDA ones do not.

``classify_aten`` looks at each ATen op (seen by a ``TorchDispatchMode``) and catches what
the first level cannot name: ops inside library code, syncs reached through other paths.

Each returns None or ``(kind, op, message)``; ``SAFE`` means "suppress the ops inside".

Graph safety: host-only.
"""
from __future__ import annotations

import torch

SAFE = ("safe", "", "")

_SYNC = "host-sync"
_H2D = "host-to-device-copy"

_F = torch.nn.functional
_T = torch.Tensor

# function -> (op name, message). Each of these always reads device data on the host.
_ALWAYS_SYNC = {
    _T.item: ("Tensor.item", "reads a device value on the host: a sync, and the value is "
              "frozen into the graph. Keep it on the device (pass the tensor on)"),
    _T.__bool__: ("Tensor.__bool__", "`if tensor:` / bool(tensor) reads a device value on the "
                  "host. Use torch.where(cond, a, b) or a mask instead of Python control flow"),
    _T.__int__: ("Tensor.__int__", "int(tensor) reads a device value on the host. Keep the "
                 "value on the device, or compute it before the step"),
    _T.__float__: ("Tensor.__float__", "float(tensor) reads a device value on the host. Keep "
                   "the value on the device"),
    _T.__index__: ("Tensor.__index__", "using a tensor as a Python index reads it on the host. "
                   "Index with the tensor itself (x.index_select / gather)"),
    _T.tolist: ("Tensor.tolist", "copies device data to a Python list: a sync, and anything "
                "built from it is baked into the graph. Keep counts/indices on the device"),
    _T.numpy: ("Tensor.numpy", "copies device data to the host (a sync). Keep it on the device"),
    _T.cpu: ("Tensor.cpu", "device-to-host copy: a sync inside the step. Keep it on the device"),
    _T.nonzero: ("Tensor.nonzero", "output size depends on data: a sync. Use "
                 "torch.nonzero_static(x, size=N) or a mask"),
    torch.nonzero: ("torch.nonzero", "output size depends on data: a sync. Use "
                    "torch.nonzero_static(x, size=N) or a mask"),
    torch.argwhere: ("torch.argwhere", "output size depends on data: a sync. Use "
                     "torch.nonzero_static(x, size=N) or a mask"),
    _T.masked_select: ("Tensor.masked_select", "output size depends on data: a sync. Use "
                       "torch.where(mask, x, 0) and keep the full shape"),
    torch.masked_select: ("torch.masked_select", "output size depends on data: a sync. Use "
                          "torch.where(mask, x, 0) and keep the full shape"),
    torch.unique: ("torch.unique", "output size depends on data: a sync. Count with "
                   "scatter_add_ / bincount into a fixed-size buffer instead"),
    _T.unique: ("Tensor.unique", "output size depends on data: a sync. Count with "
                "scatter_add_ into a fixed-size buffer instead"),
    torch.unique_consecutive: ("torch.unique_consecutive", "output size depends on data: a "
                               "sync. Keep fixed shapes"),
    torch.bincount: ("torch.bincount", "reads max(x) on the host to size its output (a sync on "
                     "CUDA). Use torch.zeros(E).scatter_add_(0, x, ones) with a fixed E"),
    _T.bincount: ("Tensor.bincount", "reads max(x) on the host to size its output (a sync on "
                  "CUDA). Use torch.zeros(E).scatter_add_(0, x, ones) with a fixed E"),
    torch.equal: ("torch.equal", "returns a Python bool: a sync. Compare on the device "
                  "(torch.eq / torch.where)"),
    _T.equal: ("Tensor.equal", "returns a Python bool: a sync. Compare on the device"),
    torch.allclose: ("torch.allclose", "returns a Python bool: a sync. Compare on the device"),
    _T.allclose: ("Tensor.allclose", "returns a Python bool: a sync. Compare on the device"),
    # [validate] printing reads the whole tensor on the host; on CPU the read is a direct
    # data access no ATen op shows (a CUDA repr syncs: measured on the H200, torch 2.11).
    _T.__repr__: ("Tensor.__repr__", "printing a tensor copies it to the host: a sync. "
                  "Remove debug prints from the step"),
    _T.__format__: ("Tensor.__format__", "formatting a tensor (f-string) copies it to the "
                    "host: a sync. Remove it from the step"),
}

_HOST_DATA = "builds a tensor from host data inside the step; its values are baked into the " \
             "graph at capture. Build it once outside the step (at setup) and close over it"
_FACTORIES = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor",
              torch.from_numpy: "torch.from_numpy",
              # [validate] same hazard, missed before (the CPU copy shows no ATen op);
              # x.new_tensor([..]) on CUDA fails capture (measured on the H200, torch 2.11).
              torch.asarray: "torch.asarray", _T.new_tensor: "Tensor.new_tensor"}


def _is_bool_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bool


def _has_bool_index(index) -> bool:
    if isinstance(index, (tuple, list)):
        return any(_is_bool_tensor(i) for i in index)
    return _is_bool_tensor(index)


def _wants_cpu_str(args, kwargs) -> bool:
    return any(isinstance(a, str) and a.split(":")[0] == "cpu"
               for a in list(args[1:]) + [kwargs.get("device")])


def _wants_cpu(args, kwargs) -> bool:
    targets = list(args[1:]) + [kwargs.get("device")]
    for a in targets:
        if isinstance(a, torch.device) and a.type == "cpu":
            return True
        if isinstance(a, str) and a.split(":")[0] == "cpu":
            return True
    return False


def _line_names_cpu() -> bool:
    """[validate] Whether the user's source line of the current call mentions ``cpu``."""
    import linecache

    from graphrt.capture.sites import user_site
    file, line = user_site(2)
    return "cpu" in linecache.getline(file, line)


def classify_call(func, args, kwargs, simulate_cuda: bool):
    """Classify a top-level torch call; ``simulate_cuda``: the tensors are CPU stand-ins."""
    kwargs = kwargs or {}
    hit = _ALWAYS_SYNC.get(func)
    if hit is not None:
        if func in (_T.cpu, _T.numpy):
            src = args[0] if args else None
            if not simulate_cuda and isinstance(src, torch.Tensor) and src.device.type == "cpu":
                return SAFE
        return (_SYNC, *hit)
    if func in _FACTORIES:
        data = args[0] if args else kwargs.get("data")
        if func is _T.new_tensor:  # x.new_tensor(data): the data is the second argument
            data = args[1] if len(args) > 1 else kwargs.get("data")
        if func in (torch.as_tensor, torch.asarray, _T.new_tensor) and isinstance(data, torch.Tensor):
            return None
        return (_H2D, _FACTORIES[func], _HOST_DATA)
    if isinstance(func, torch._ops.OpOverload) and func.overloadpacket is torch.ops.aten.lift_fresh:
        return (_H2D, "torch.from_numpy", _HOST_DATA)  # from_numpy surfaces as lift_fresh
    if func is _T.to:
        src = args[0] if args else None
        # [validate] On CPU stand-ins every device is "cpu": `x.to(device)` / `x.to(y.device)`
        # with the step's own device is a no-op on a GPU, not a copy to the host. Flag it
        # there only when the user wrote cpu: a "cpu" string or a line that names cpu.
        real_d2h = isinstance(src, torch.Tensor) and src.device.type != "cpu"
        simulated = simulate_cuda and isinstance(src, torch.Tensor) and (
            _wants_cpu_str(args, kwargs) or _line_names_cpu())
        if _wants_cpu(args, kwargs) and (real_d2h or simulated):
            return (_SYNC, "Tensor.to('cpu')", "device-to-host copy: a sync inside the step. "
                    "Keep it on the device")
        return None
    if func is _F.one_hot:
        nc = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
        if nc is None or nc < 0:
            return (_SYNC, "one_hot", "without num_classes it reads max(x) on the host. Pass "
                    "num_classes=E")
        return SAFE
    if func in (torch.repeat_interleave, _T.repeat_interleave):
        repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            return (_SYNC, "repeat_interleave", "with tensor repeats and no output_size it "
                    "reads sum(repeats) on the host. Pass output_size=N")
        return SAFE
    if func is torch.where and len(args) + len(kwargs) == 1:
        return (_SYNC, "torch.where(cond)", "the one-argument form is nonzero(): a sync. Use "
                "torch.where(cond, a, b) or nonzero_static")
    if func is _T.__getitem__ and len(args) > 1 and _has_bool_index(args[1]):
        return (_SYNC, "boolean-mask indexing", "x[mask] has a data-dependent size: a sync. "
                "Use torch.where(mask, x, 0) and keep the full shape")
    if func is _T.__setitem__ and len(args) > 2 and _has_bool_index(args[1]):
        value = args[2]
        if isinstance(value, (int, float, bool)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
            return SAFE  # becomes masked_fill_: no sync
        return (_SYNC, "boolean-mask assignment", "x[mask] = values needs nonzero(mask): a sync. "
                "Use torch.where(mask, values, x) with full-shape values")
    if func is torch.nonzero_static or func is getattr(_T, "nonzero_static", None):
        return SAFE
    if func in (torch.histc, _T.histc):  # [validate] measured: CUDA histc syncs when min == max
        lo = kwargs.get("min", args[2] if len(args) > 2 else 0)
        hi = kwargs.get("max", args[3] if len(args) > 3 else 0)
        if lo == hi:
            return (_SYNC, "histc", "with min == max (the default) it reads min(x)/max(x) on the "
                    "host (a sync on CUDA). Pass fixed min= and max=")
        return SAFE
    return None


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


def classify_aten(func, args, kwargs, cuda: bool):
    """Classify one ATen op; ``cuda``: real CUDA tensors (copies across devices are visible)."""
    packet = func.overloadpacket
    msg = _ATEN_SYNC.get(packet)
    if msg is not None:
        return (_SYNC, f"aten.{packet.__name__}", msg + ". Keep shapes fixed and values on the device")
    if packet is _A.repeat_interleave and func is _A.repeat_interleave.Tensor:
        if (kwargs or {}).get("output_size") is None:
            return (_SYNC, "aten.repeat_interleave", "reads sum(repeats) on the host. Pass output_size=N")
    if packet in (_A.index, _A.index_put, _A.index_put_):
        indices = args[1] if len(args) > 1 else ()
        if any(_is_bool_tensor(i) for i in indices or ()):
            return (_SYNC, f"aten.{packet.__name__} (bool mask)", "boolean-mask indexing needs "
                    "nonzero(mask): a sync. Use torch.where(mask, a, b)")
    if cuda and packet in (_A._to_copy, _A.copy_):
        if packet is _A.copy_:
            dst, src = args[0], args[1]
            dst_dev, src_dev = dst.device.type, src.device.type
        else:
            src = args[0]
            dev = (kwargs or {}).get("device")
            src_dev = src.device.type
            dst_dev = torch.device(dev).type if dev is not None else src_dev
        if src_dev == "cuda" and dst_dev == "cpu":
            return (_SYNC, f"aten.{packet.__name__} (device->host)", "device-to-host copy: a "
                    "sync inside the step. Keep it on the device")
        if src_dev == "cpu" and dst_dev == "cuda" and src.dim() > 0:
            return (_H2D, f"aten.{packet.__name__} (host->device)", _HOST_DATA)
    return None
