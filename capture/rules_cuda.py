"""CUDA-only host work: ops whose CUDA implementation synchronises or copies host data
although their CPU implementation does neither.

On CPU the analysis sees the ATen op only from the outside (what a kernel does inside is no
dispatch it can watch), and a CPU kernel reads its arguments in place; so every op below
looks harmless on CPU tensors. The rules come from an audit of ATen's CUDA kernels
(``aten/src/ATen/native/cuda/*.cu`` and the per-backend code they share, torch 2.11 era):

- a tensor read as a Python number inside the kernel (``value.item()``): ``masked_fill`` /
  ``index_fill`` with a tensor value, ``linspace``/``logspace`` with tensor bounds,
  ``segment_reduce``'s ``lengths`` checks, ``ctc_loss``'s lengths (copied to the host);
- host data copied to the device inside the op: indexing with a CPU index tensor or a
  Python list (``index``/``index_put_`` move every index to ``self``'s device first);
- copies between host and device memory (``t.to(device)`` / ``t.cuda()`` / ``copy_`` of a
  host tensor, ``host_buf.copy_(t)``).

``full``/``arange``/``narrow`` with a device tensor read it while their arguments are parsed,
which the CPU analysis already sees (``aten._local_scalar_dense``); their rules give the
finding the op's name and its sync-free form.

Audited and sync-free on CUDA (no rule): ``index_put_(accumulate=True)`` (asynchronous
bounds check), ``masked_scatter`` (asynchronous size check), ``embedding_bag`` with
``offsets``, ``max_unpool``, ``searchsorted``/``bucketize``, ``take``/``put_``, ``sort``,
``topk``, ``cumsum``, ``nonzero_static``, ``multinomial`` (its input checks are
``_assert_async`` kernels in the torch versions graphrt runs on, not the ``.item()`` of older
ATen: every argument form runs under sync debug mode "error" and captures on the H200, torch
2.11; ``tests/test_rules_cuda_gpu.py`` proves it in a fresh process); ``tensor_split(x,
tensor)`` refuses a CUDA tensor (an error, not a sync). docs/validate.md lists them all.

Each rule's ``when`` takes ``(args, kwargs, ctx)``; ``ctx.host`` (``capture.host.HostData``)
says which tensors live in host memory, so the same rule decides the same way on CPU
stand-ins and on CUDA tensors.
"""
from __future__ import annotations

import torch

from graphrt.capture.rules import _H2D, _SYNC, D2H, UPLOAD, Hit, Rule, across

_F = torch.nn.functional
_T = torch.Tensor
_A = torch.ops.aten


def _arg(args, kwargs, pos: int, name: str):
    return kwargs[name] if name in kwargs else (args[pos] if len(args) > pos else None)


def _device_tensor(x, ctx) -> bool:
    return isinstance(x, torch.Tensor) and not ctx.host.is_host(x)


def _device_value(pos: int, name: str):
    """A hazard when that argument is a tensor in device memory (CUDA reads it with
    ``.item()``); the safe form when it is a host tensor."""
    def when(args, kwargs, ctx):
        v = _arg(args, kwargs, pos, name)
        if not isinstance(v, torch.Tensor):
            return None
        return _device_tensor(v, ctx)
    return when


def _full_value(args, kwargs, ctx):
    # torch.full(size, v), torch.full_like(x, v), x.new_full(size, v): the value comes last
    v = kwargs.get("fill_value", args[-1] if len(args) > 1 else None)
    return _device_tensor(v, ctx) or None


def _any_device_tensor(args, kwargs, ctx):
    return any(_device_tensor(a, ctx) for a in list(args) + list(kwargs.values())) or None


def isin_uniques(elements, test, assume_unique, on_device) -> bool:
    """Whether ``isin`` takes ATen's sorting path and calls ``_unique`` there (a sync on
    CUDA: its output size follows the data): both tensors, some on the device, no
    ``assume_unique``, and ``test.numel() >= int(10 * elements.numel() ** 0.145)`` (NumPy's
    heuristic, ``isin_Tensor_Tensor_out``, shared by CPU and CUDA). A Python number as
    ``elements`` is one element on the test set's device (``isin.Scalar_Tensor`` wraps it)."""
    if not isinstance(test, torch.Tensor):
        return False
    if isinstance(elements, (int, float, bool)):
        elements = test.new_empty(())
    if not isinstance(elements, torch.Tensor):
        return False
    if assume_unique or elements.numel() == 0 or not (on_device(elements) or on_device(test)):
        return False
    return test.numel() >= int(10.0 * float(elements.numel()) ** 0.145)


def _isin_sorts(args, kwargs, ctx):
    return isin_uniques(_arg(args, kwargs, 0, "elements"), _arg(args, kwargs, 1, "test_elements"),
                        bool(kwargs.get("assume_unique", False)),
                        lambda t: not ctx.host.is_host(t)) or None


def _segment_lengths_checked(args, kwargs, ctx):
    return kwargs.get("lengths") is not None and not kwargs.get("unsafe", False)


def _index_put_host(args, kwargs, ctx):
    indices = _arg(args, kwargs, 1, "indices")
    if ctx.host.is_host(_arg(args, kwargs, 0, "input")) or not isinstance(indices, (tuple, list)):
        return None
    if ctx.host.host_index(tuple(indices)):
        return Hit(_H2D, "index_put (host indices)", UPLOAD)
    values = _arg(args, kwargs, 2, "values")          # ATen moves a host one: value.to(device)
    if isinstance(values, torch.Tensor) and ctx.host.is_host(values):
        return Hit(_H2D, "index_put (host values)", UPLOAD)
    return None


def _to_device_copy(args, kwargs, ctx):
    src = args[0] if args else None
    return bool(ctx.host.is_host(src)) or None  # a 0-d one too: a blocking upload


def _copy_across(args, kwargs, ctx):
    dst, src = _arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "src")
    if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)):
        return None
    return across(dst, src, ctx, "Tensor.copy_", scalars=True)


def _sync(name, message, *functions, when=None, op=None, host_args_safe=True) -> Rule:
    return Rule(name, _SYNC, message, functions, when, op, host_args_safe)


_READS_VALUE = "with a tensor {what} in device memory CUDA reads it on the host (.item()): a sync, " \
               "and the value is frozen into the graph. "

CUDA_RULES: tuple[Rule, ...] = (
    _sync("masked_fill", _READS_VALUE.format(what="value") + "Use torch.where(mask, value, x) "
          "(no sync) or a Python number", torch.masked_fill, _T.masked_fill, _T.masked_fill_,
          when=_device_value(2, "value")),
    _sync("index_fill", _READS_VALUE.format(what="value") + "Pass a Python number, or "
          "index_copy/scatter a value.expand(...) in", torch.index_fill, _T.index_fill,
          _T.index_fill_, when=_device_value(3, "value")),
    _sync("full", _READS_VALUE.format(what="fill value") + "Use value.expand(size).clone() "
          "or torch.empty(size, device=d).copy_(value.expand(size))", torch.full,
          torch.full_like, _T.new_full, when=_full_value, op="torch.full(size, tensor)"),
    _sync("linspace", _READS_VALUE.format(what="start or end") + "Use start + (end - start) * "
          "torch.arange(steps, device=d) / (steps - 1)", torch.linspace, torch.logspace,
          when=_any_device_tensor, op="linspace/logspace(tensor bounds)"),
    _sync("arange", _READS_VALUE.format(what="bound") + "Its length follows the data too. "
          "Use torch.arange(MAX, device=d) and a mask (< bound)", torch.arange,
          when=_any_device_tensor, op="torch.arange(tensor)"),
    _sync("narrow", _READS_VALUE.format(what="start") + "Gather the rows instead: "
          "x.index_select(dim, start + torch.arange(length, device=d))", torch.narrow,
          _T.narrow, when=_device_value(2, "start")),
    _sync("segment_reduce", "with lengths= it checks them on the host (.item() of min/sum): a "
          "sync. Pass unsafe=True or offsets=, or index_add_ rows into a fixed [segments] "
          "buffer by segment id", torch.segment_reduce, when=_segment_lengths_checked),
    _sync("isin", "with a test set of many values (test.numel() >= 10 * elements.numel() "
          "** 0.145) ATen sorts and calls _unique, whose size follows the data: a sync on "
          "CUDA. Compare directly: (x[..., None] == test).any(-1) (or assume_unique=True, "
          "only when both the values and the test set are distinct)", torch.isin,
          when=_isin_sorts, op="torch.isin"),
    _sync("ctc_loss", "copies the lengths to the host (and uploads batch offsets) on CUDA, "
          "outside cuDNN's path: a sync. Keep CTC out of the captured step",
          torch.ctc_loss, _F.ctc_loss, op="ctc_loss"),
    # Copies between host and device memory.
    Rule("index_put", _H2D, UPLOAD, (torch.index_put, torch.index_put_, _T.index_put,
                                     _T.index_put_), _index_put_host, None, False),
    Rule("cuda", _H2D, UPLOAD, (_T.cuda,), _to_device_copy, "Tensor.cuda (host->device)", False),
    _sync("copy_", D2H, _T.copy_, when=_copy_across, op="Tensor.copy_ (device->host)",
          host_args_safe=False),
)


# -- the same knowledge at the ATen level (ops reached through library code) -----------------
def _aten_value(pos):
    def check(func, args, kwargs, host):
        v = args[pos] if len(args) > pos else None
        return isinstance(v, torch.Tensor) and not host.is_host(v)
    return check


def _aten_any_tensor(func, args, kwargs, host):
    return any(isinstance(a, torch.Tensor) and not host.is_host(a) for a in args[:2])


def _aten_isin(func, args, kwargs, host):
    return isin_uniques(args[0] if args else None, args[1] if len(args) > 1 else None,
                        bool(kwargs.get("assume_unique", args[2] if len(args) > 2 else False)),
                        lambda t: not host.is_host(t))


_ATEN_READS = "reads a tensor argument on the host (.item() in the CUDA kernel): a sync"
ATEN_CUDA = {
    _A.isin: (_aten_isin, "sorts and calls _unique for a large test set: a sync on CUDA. "
              "Compare with (x[..., None] == test).any(-1)"),
    _A.masked_fill: (_aten_value(2), _ATEN_READS + ". Use torch.where(mask, value, x)"),
    _A.masked_fill_: (_aten_value(2), _ATEN_READS + ". Use torch.where(mask, value, x)"),
    _A.index_fill: (_aten_value(3), _ATEN_READS + ". Pass a Python number"),
    _A.index_fill_: (_aten_value(3), _ATEN_READS + ". Pass a Python number"),
    _A.linspace: (_aten_any_tensor, _ATEN_READS + ". Build it from torch.arange on the device"),
    _A.logspace: (_aten_any_tensor, _ATEN_READS + ". Build it from torch.arange on the device"),
}
_INDEX_OPS = (_A.index, _A.index_put, _A.index_put_, _A._index_put_impl_)


def classify_aten_cuda(func, args, kwargs, host) -> Hit | None:
    """The CUDA-only rules for one ATen op (``host``: ``HostData``)."""
    packet = func.overloadpacket
    if packet in _INDEX_OPS and len(args) > 1 and not host.is_host(args[0]):
        if any(isinstance(i, torch.Tensor) and i.dim() > 0 and host.is_host(i)
               for i in args[1] or ()):
            return Hit(_H2D, f"aten.{packet.__name__} (host index)", UPLOAD)
    found = ATEN_CUDA.get(packet)
    if found is not None and found[0](func, args, kwargs or {}, host):
        return Hit(_SYNC, f"aten.{packet.__name__}", found[1])
    return None
