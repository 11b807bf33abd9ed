"""In-graph staging: an input's copy into its static buffer captured as a memcpy node at the
head of the graph, re-pointed at the caller's tensor before each replay.

Without it ``run()`` stages the inputs with CUDA calls of their own before ``graph.replay()``:
one ``torch._foreach_copy_`` per dtype of several inputs, one copy (``copy_``, or the raw
``cudaMemcpyAsync`` of ``graphrt.cudart``) for an input alone in its dtype. Here the capture
records the copy from a *shadow* buffer into the static buffer as the graph's first work;
after capture the node is found in the graph by its two addresses, and each step re-points
it (``cudaGraphExecMemcpyNodeSetParams1D``, an edit of the instantiated graph on the host) at
the caller's tensor and the live rows' bytes. The edit applies to later launches only
(replays already queued keep theirs). A source at the address and size the node already
copies needs no edit at all: an engine that hands the same tensors every step stages with no
CUDA call.

How a capture stages (``GRAPHRT_GRAPH_STAGING``, read at capture; BENCHMARKS.md §23-24):

- unset or ``table`` (the default): no memcpy nodes; the staging table of
  ``graphrt.staging_table`` (one small kernel at the graph's head copies every batch and
  fixed input, from a row of addresses the host sends only when a source moved). With the
  reference model it halves ``run()``'s host time and takes 0.3-1.2% less device time per
  ``run()`` than the copies outside the graph;
- ``1``: memcpy nodes for the inputs alone in their dtype, each of which would cost a copy
  call of its own (one node saves 4-5 µs of host time a step and costs ~0.3 µs of device
  time); the others are copied outside the graph;
- ``all``: a memcpy node for every batch and fixed input (offsets inputs stay outside: their
  padding continues the last live offset, which must be written first). Five memcpy nodes
  cost ~2.4 µs more device time a step than two ``_foreach_copy_`` launches;
- ``0``: everything is copied outside the graph.

A node is in one of two states:

- *armed*: when the graph runs it copies from the address of the tensor the last step gave,
  as a copy issued on the stream would. ``run()`` re-points or idles every node before each
  replay, so only a bare ``graph.replay()`` outside ``run()``/``replay()`` reads a past step's
  source again (its tensor must then still exist);
- *idle*: it copies the first bytes of the static buffer into the shadow, harmless. A node is
  idle after capture, and ``idle()`` runs before every replay whose inputs were staged
  another way (zero-copy ``replay(n)``, a source ``copy_`` must take, a call shape that is not
  bound to the node).

Graph safety: host-only (``record`` issues the copies inside a capture, everything else
edits graphs between launches).
"""
from __future__ import annotations

import ctypes
import os

import torch

from graphrt import cudart
from graphrt.errors import EnvError


MODES = ("0", "1", "all", "table")
DEFAULT = "table"


def mode() -> str:
    """``GRAPHRT_GRAPH_STAGING``: ``"table"`` (unset: the default, ``graphrt.staging_table``),
    ``"1"``, ``"all"`` or ``"0"``; ``EnvError`` (a ``ValueError``) for anything else."""
    value = os.environ.get("GRAPHRT_GRAPH_STAGING", DEFAULT).strip().lower() or DEFAULT
    if value not in MODES:
        raise EnvError(f"GRAPHRT_GRAPH_STAGING: expected one of {MODES} (0: off, 1: inputs "
                       f"alone in their dtype, all: every batch and fixed input, table: the "
                       f"staging table), got {value!r}")
    return value


def enabled(device: torch.device) -> bool:
    """Whether captures on ``device`` stage by memcpy nodes: a CUDA device, the raw CUDA
    runtime available and ``GRAPHRT_GRAPH_STAGING`` ``1`` or ``all``."""
    return device.type == "cuda" and mode() in ("1", "all") and cudart.available()


class StagingNode:
    """One input's memcpy node in one instantiated graph (see the module doc).

    ``stage(src, dst, nbytes)`` points it at ``src`` for ``nbytes`` into ``dst`` (a view at
    the start of its static buffer), or, for a source the node cannot take (not contiguous, a
    negative view, no data, overlapping the static buffer), idles it and runs ``dst.copy_(src)``
    instead; ``stager(dst, nbytes)`` is that function of ``src`` alone, its constants converted
    once (``Stager.bind``'s); ``idle()``."""

    __slots__ = ("name", "exec", "node", "dst", "shadow", "idle_bytes", "armed", "_at", "_set",
                 "_what")

    def __init__(self, name: str, graph_exec: int, node: int, dst: torch.Tensor,
                 shadow: torch.Tensor):
        self.name, self.dst, self.shadow = name, dst, shadow
        self.exec, self.node = ctypes.c_void_p(graph_exec), ctypes.c_void_p(node)
        self.idle_bytes = dst[:1].nbytes if dst.dim() else dst.nbytes
        self.armed = False                        # it copies a caller's tensor
        self._at = (0, 0)                         # armed: (its address, bytes)
        self._set = cudart.exec_memcpy_set_fn()
        self._what = f"cudaGraphExecMemcpyNodeSetParams1D staging input {name!r}"
        self._edit_idle()

    def stage(self, src: torch.Tensor, dst: torch.Tensor, nbytes: int,
              span: int | None = None) -> None:
        self.stager(dst, nbytes, span)(src)

    def stager(self, dst: torch.Tensor, nbytes: int, span: int | None = None):
        """``span``: the static buffer's bytes from ``dst`` on (``Stager.span``; default
        ``nbytes``). A source overlapping any of them goes by ``copy_``: the node copies at
        replay, after the padding of rows past the live ones, which it must not read."""
        d = dst.data_ptr()
        span = nbytes if span is None else span
        assert d == self.dst.data_ptr(), "a staging view starts at its static buffer"
        node, edit, what = self, self._set, self._what
        graph_exec, handle, kind = self.exec, self.node, cudart.MEMCPY_D2D

        def stage(src: torch.Tensor) -> None:
            if src.is_contiguous() and not src.is_neg():
                s = src.data_ptr()
                if s and (s + nbytes <= d or d + span <= s):
                    if not node.armed or node._at != (s, nbytes):  # else it copies from there
                        rc = edit(graph_exec, handle, d, s, nbytes, kind)
                        if rc:
                            cudart.check(rc, what)
                        node._at = (s, nbytes)
                    node.armed = True
                    return
            node.idle()
            dst.copy_(src)
        return stage

    def idle(self) -> None:
        """Point the node back at its harmless copy (no edit when it is idle already)."""
        if self.armed:
            self._edit_idle()

    def _edit_idle(self) -> None:
        cudart.check(self._set(self.exec, self.node, self.shadow.data_ptr(), self.dst.data_ptr(),
                               self.idle_bytes, cudart.MEMCPY_D2D), self._what)
        self.armed = False


class GraphStaging:
    """The staging nodes of one captured graph, by input name (``nodes``)."""

    def __init__(self, nodes: dict[str, StagingNode]):
        self.nodes = nodes

    def idle(self) -> None:
        for node in self.nodes.values():
            node.idle()


def plan(stager, size: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, static view, shadow)`` of each input graph ``size`` stages in the graph: those
    ``mode()`` names (``1``: inputs alone in their dtype; ``all``: every batch or fixed
    input) whose static view is raw-copyable (``cudart.raw_copyable``: contiguous, some bytes,
    not complex); [] under the default mode ``table`` (the staging table stages instead), under
    ``0``, and when ``enabled`` is False. Offsets inputs are never taken: their padding
    continues the last live offset, which a copy before the graph must read after the live
    entries were written. Shadows (one per
    input, the static buffer's shape, outside any graph pool) are made once per stager, and
    the side streams ``record`` forks onto once per device. Host-only."""
    if not enabled(stager.device):
        return []
    out = []
    take = set(stager.views(size)) if mode() == "all" else set(stager.single_names(size))
    for name, view in stager.views(size).items():
        if name in take and stager.spec.inputs[name].rows != "offsets" \
                and cudart.raw_copyable(view):
            shadow = stager.shadows.get(name)
            if shadow is None:
                with torch.inference_mode(False):
                    shadow = stager.shadows[name] = torch.zeros_like(stager.buffers[name])
            out.append((name, view, shadow))
    if len(out) > 1 and stager.device.type == "cuda":
        index = stager.device.index
        index = torch.cuda.current_device() if index is None else index
        sides = _SIDE_STREAMS.setdefault(index, [])
        while len(sides) < len(out):
            sides.append(torch.cuda.Stream(index))
    return out


_SIDE_STREAMS: dict = {}   # device index -> side streams the copies fork onto (made once)


def record(planned: list, stream: torch.cuda.Stream) -> None:
    """Inside a capture on ``stream``: one ``cudaMemcpyAsync`` shadow -> static view per
    planned input, the memcpy nodes ``locate`` finds. With several, each is issued on a side
    stream forked from ``stream`` and joined back, so the graph holds them as parallel roots
    rather than a chain (in a chain each added about a microsecond of device time to the
    step's start, BENCHMARKS.md §23). Graph safety: capture-only."""
    if len(planned) < 2:
        for name, view, shadow in planned:
            cudart.memcpy_d2d_async(view.data_ptr(), shadow.data_ptr(), view.nbytes,
                                    stream.cuda_stream)
        return
    sides = _SIDE_STREAMS[stream.device.index]   # made by plan(), outside the capture
    for (name, view, shadow), side in zip(planned, sides):
        side.wait_stream(stream)
        cudart.memcpy_d2d_async(view.data_ptr(), shadow.data_ptr(), view.nbytes,
                                side.cuda_stream)
    for side in sides[:len(planned)]:
        stream.wait_stream(side)


def locate(graph: "torch.cuda.CUDAGraph", planned: list) -> GraphStaging:
    """After capture (``graph`` kept with ``keep_graph=True``): instantiate it, find each
    planned input's memcpy node by its addresses and idle it. Raises ``GraphrtError`` when
    a node is missing (set ``GRAPHRT_GRAPH_STAGING=0``). Host-only."""
    from graphrt.errors import GraphrtError
    graph.instantiate()
    found = {(dst, src): node for node, dst, src, _ in cudart.graph_memcpy_nodes(graph.raw_cuda_graph())}
    graph_exec, nodes = graph.raw_cuda_graph_exec(), {}
    for name, view, shadow in planned:
        node = found.get((view.data_ptr(), shadow.data_ptr()))
        if node is None:
            raise GraphrtError(f"in-graph staging: the captured copy of input {name!r} is not "
                               "a memcpy node of the graph (this torch or driver captured it "
                               "otherwise); set GRAPHRT_GRAPH_STAGING=0 to stage outside the graph")
        nodes[name] = StagingNode(name, graph_exec, node, view, shadow)
    return GraphStaging(nodes)
