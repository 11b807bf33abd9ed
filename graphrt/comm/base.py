"""The expert-parallel communication protocol (``EPComm``) and the ``Receiver``.

A backend moves routed tokens to the ranks that hold their experts (``dispatch``) and the
expert outputs back, weighted and summed per token (``combine``). ``combine_async`` starts
the combine and returns a ``Receiver``: calling it makes the *current* stream wait on the
combine by a device-side event wait (or a DeepEP receive hook) — never a host sync — and
returns the output buffer. Work issued between the two (the shared expert) overlaps the
combine, inside the captured graph.

Receiver contract (docs/architecture.md): a receiver created during capture registers with the
capture (``graphrt.capture.audit``); the capture fails if one is never called, and the
graph keeps the receiver's tensors alive for as long as it exists.

Glossary: bs (rows this rank sends), hidden, num_experts, num_local_experts, num_topk,
cap (rows per local expert in the masked layout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from graphrt.capture.audit import mark_called, register_receiver
from graphrt.errors import GraphrtError, InputError, InputTypeError


@dataclass
class Dispatched:
    """What ``dispatch`` hands the experts (the masked layout DeepGEMM consumes).

    Attributes:
        recv_x: ``[num_local_experts, cap, hidden]`` bf16 (or fp8 e4m3 with ``recv_scale``).
        recv_scale: fp32 ``[num_local_experts, cap, hidden // 128]`` scales, or None.
        masked_m: int32 ``[num_local_experts]``: live rows per local expert.
        expected_m: host int, the GEMM tile hint for this padded size.
        handle: backend state the combine needs (inverse map, layout, DeepEP handle).
        gen: which of the comm's dispatches made it (backends whose combine reads static
            buffers the next dispatch rewrites refuse an older one); None under
            ``torch.compile`` (not checked there).

    ``recv_x`` (and, per backend, ``masked_m`` and the handle) lives in the comm's static
    buffers until its next dispatch: run the experts on it before dispatching again.
    """

    recv_x: torch.Tensor
    masked_m: torch.Tensor
    expected_m: int
    handle: Any
    recv_scale: torch.Tensor | None = None
    gen: int | None = 0


class Receiver:
    """Joins an asynchronous combine into the current stream; call exactly once.

    Args:
        join: device-side wait (event wait / DeepEP receive hook); must not sync the host.
        out: the output buffer the combine lands in, returned by the call.
        keep: tensors/events the in-flight combine still uses (kept alive until joined, and
            by the graph for its whole life when created during capture).

    Graph safety: capturable.
    """

    def __init__(self, join: Callable[[], Any], out: torch.Tensor, keep: tuple = ()):
        self._join, self.out, self._keep = join, out, tuple(keep)
        self.called = False
        self._joined_for_analysis = False
        register_receiver(self, self._keep + (out,))

    def __call__(self) -> torch.Tensor:
        if self.called:
            if self._joined_for_analysis:  # the step's own (late) join: already done
                self._joined_for_analysis = False
                return self.out
            raise GraphrtError("this receiver was already called: each combine_async() is "
                               "joined exactly once")
        self._join()
        self.called = True
        mark_called(self)
        self._keep = ()  # joined: the current stream now orders after the combine
        return self.out

    def join_for_analysis(self) -> None:
        """Join it on the validator's behalf, which reported it never called in its step:
        what it holds is released before the next run, and the step's own later call (a
        combine joined in the next step) returns ``out`` once without joining twice."""
        self()
        self._joined_for_analysis = True


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m`` (host-only)."""
    return (x + m - 1) // m * m


def check_count(who: str, name: str, value, minimum: int = 1) -> int:
    """``value`` when it is an int >= ``minimum``; else ``InputTypeError`` (not an int: a float,
    a bool, a tensor) or ``InputError`` (too small). For a constructor's sizes. Host-only."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{who}: {name} must be an int >= {minimum}; got {value!r} "
                             f"({type(value).__name__})")
    if value < minimum:
        raise InputError(f"{who}: {name} must be an int >= {minimum}; got {value}")
    return value


def check_out(who: str, out, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ``InputError`` unless ``out`` is a tensor of ``shape``/``dtype`` on ``device`` (an
    ``out=`` buffer checked before a combine starts). Metadata reads only: capturable."""
    if not isinstance(out, torch.Tensor):
        raise InputTypeError(f"{who}: out= must be a {dtype} tensor {list(shape)} on {device}; got "
                             f"{type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise InputError(f"{who}: out= must be {dtype} {list(shape)} on {device} (the dispatched "
                         f"batch, hidden); got {out.dtype} {list(out.shape)} on {out.device}. Pass "
                         "a buffer like torch.empty_like(x) of the dispatched x")


def ep_group(group, num_experts: int, who: str, error=GraphrtError) -> tuple:
    """``(group, rank, num_ranks, num_local_experts)`` for an expert-parallel backend; raises
    ``error`` when torch.distributed is not initialised or the experts do not split evenly.
    Host-only."""
    import torch.distributed as dist
    if not dist.is_initialized():
        raise GraphrtError(f"{who} needs torch.distributed initialised "
                           "(init_process_group('nccl')) on every rank")
    group = group or dist.group.WORLD
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    if num_experts % num_ranks:
        raise error(f"{who}: {num_experts} experts do not split over {num_ranks} ranks; use a "
                    f"multiple of {num_ranks} experts (or another rank count)")
    return group, rank, num_ranks, num_experts // num_ranks


def on_side_stream(stream, fn: Callable[[], Any], out: torch.Tensor, keep: tuple = ()) -> Receiver:
    """Fork ``stream`` from the current stream, run ``fn()`` there, and return a ``Receiver``
    that joins it back by an event wait: the captured fork/join of an overlapped combine.
    ``keep``: what ``fn`` reads (held until joined, and by the graph when captured).
    Graph safety: capturable."""
    main = torch.cuda.current_stream(stream.device)
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        fn()
        done = torch.cuda.Event()
        done.record(stream)
    return Receiver(lambda: main.wait_event(done), out, keep=(*keep, done))


@runtime_checkable
class EPComm(Protocol):
    """What the MoE layer needs from an expert-parallel backend.

    Attributes: ``rank``, ``num_ranks``, ``num_experts``, ``num_local_experts``, and
    ``uniform_batch`` (True when every rank must replay the same padded size, e.g. NCCL).
    """

    rank: int
    num_ranks: int
    num_experts: int
    num_local_experts: int
    uniform_batch: bool

    def cap_for(self, bs: int) -> int:
        """Rows per local expert in the masked layout for a padded batch of ``bs`` (host-only)."""
        ...

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, n: torch.Tensor, *,
                 topk_weights: torch.Tensor | None = None) -> Dispatched:
        """x ``[bs, hidden]`` bf16, topk_ids int64 ``[bs, num_topk]`` (-1 = none), n int32 ``[1]``,
        topk_weights fp32 ``[bs, num_topk]`` (needed by layouts that carry the weights with the
        tokens, DeepEP v2's expanded one; the others ignore it). Graph safety: capturable."""
        ...

    def combine(self, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                d: Dispatched, n: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        """y ``[num_local_experts, cap, hidden]`` bf16 -> out ``[bs, hidden]`` bf16 (synchronous
        on the current stream). Graph safety: capturable."""
        ...

    def combine_async(self, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      d: Dispatched, n: torch.Tensor, *, out: torch.Tensor) -> Receiver:
        """Start the combine; the returned ``Receiver`` joins it. Graph safety: capturable."""
        ...

    def end_step(self) -> None:
        """Called by the model after each step; backends check per-step rules (host-only)."""
        ...
