"""Replay scheduling policy: the size table, picking, staging and padding.

Plain Python plus a few torch copies; nothing here captures or replays (that is
``graphrt.runtime`` and ``graphrt.capture``), so CPU tests exercise all of it.

- ``capture_sizes``, ``SizeTable`` (``graphrt.sizes``, re-exported here): the default padded
  sizes and the captured ones; ``pick(n)`` is the smallest size ``>= n``.
- ``Stager``: static input buffers of ``max_bs`` rows (``max_bs + 1`` for offsets, the
  declared shape for fixed inputs), allocated once; ``stage(inputs, n, padded_bs)`` copies
  the live inputs in and refills with ``pad_value`` only the padded rows an earlier, larger
  batch may have dirtied (a high-water mark), so a steady-state step costs one
  ``torch._foreach_copy_`` per input dtype (for a dtype with one input a ``copy_``, or on
  CUDA the raw ``cudaMemcpyAsync`` it ends in, ``graphrt.cudart``), the live count riding
  along with the int32 inputs (else filled only when it changed), plus one copy per
  offsets input when the batch is padded. On CUDA the runtime's steady step stages inside
  the graph instead: by default through the staging table (``graphrt.staging_table``: the
  graph's first kernel copies every batch and fixed input from a row of addresses, sent only
  when it changed), or by memcpy nodes re-pointed per step (``graphrt.graph_staging``,
  ``GRAPHRT_GRAPH_STAGING=1``/``all``).

The per-step host path does no work it can cache: ``check_cached`` remembers the verdict
of ``check`` per input signature (``graphrt.step_cache.signature``: names, and per input
type, dtype, shape, device, requires_grad), the live-row views of the static inputs and
their copy groups are built once per ``n``, and ``bind`` specialises ``stage`` to one call
shape (the input order, ``n``, ``padded_bs``, grad, subclasses) once, picking each input's
copy then, so a steady step pays the copies and a few comparisons.

Graph safety: host-only (``stage`` launches copies on the current stream; call it before
``replay()`` on that stream, never inside a capture).
"""
from __future__ import annotations

from operator import itemgetter
from typing import Callable, Mapping

import torch

from graphrt import cudart, staging_table
from graphrt.errors import InputError
from graphrt.sizes import SizeTable, capture_sizes  # noqa: F401 - re-exported
from graphrt.spec import StepSpec, distinct, sentinel
from graphrt.staging_table import TableGraph
from graphrt.step_cache import signature


_foreach_copy_ = torch._foreach_copy_


class Stager:
    """Owns the static input buffers and the live-count scalar every graph reads.

    Args:
        spec: the step; its ``inputs`` give names, kinds, dtypes, shapes and pad values.
        max_bs: rows to allocate (the largest captured size).
        device: where the buffers live.

    Buffers: batch inputs ``[max_bs, *trailing]``, offsets ``[max_bs + 1]``, fixed inputs
    their shape. ``views(padded_bs)`` is what graph ``padded_bs`` was captured on; ``n_dev``
    is the int32 ``[1]`` device tensor holding the live count.
    """

    def __init__(self, spec: StepSpec, max_bs: int, device: torch.device):
        self.spec, self.max_bs, self.device = spec, max_bs, device
        with torch.inference_mode(False):  # written outside inference mode too
            self.buffers = {k: inp.pad(max_bs, device) for k, inp in spec.inputs.items()}
            self.n_dev = torch.full((1,), max_bs, dtype=torch.int32, device=device)
            self._counts = torch.arange(max_bs + 1, dtype=torch.int32, device=device)  # n_dev sources
        # (value, version counter) of n_dev after our last write: any later in-place write
        # (capture, checks, a user) bumps the version, so the next pad_only fills again.
        self._n_written = (None, -1)
        self._batch = [k for k, inp in spec.inputs.items() if inp.rows == "batch"]
        self._offsets = [k for k, inp in spec.inputs.items() if inp.rows == "offsets"]
        self._pad_values = {k: spec.inputs[k].pad_value for k in self._batch}
        # (name, kind, dtype, shape after the batch or whole, rank): read once per run()
        self._checks = [(k, inp.rows, inp.dtype, inp.trailing, len(inp.shape))
                        for k, inp in spec.inputs.items()]
        self._kind = {k: inp.rows for k, inp in spec.inputs.items()}
        self._names = tuple(spec.inputs)
        # Rows [0, _dirty) of the batch inputs may hold something other than pad_value.
        self._dirty = 0
        self._live: list = [None] * (max_bs + 1)   # n -> _Staging, built on first use
        self._offset_pads: dict = {}                # (n, padded_bs) -> [(dst, src)] views
        self._verdicts: dict = {}                   # input signature -> n (check passed)
        self._max_verdicts = 4 * max_bs + 64        # bounded: oversize batches vary freely
        self._bound: dict = {}                      # bind()'s key -> its function
        # In-graph staging (graphrt.graph_staging): padded_bs -> GraphStaging of that graph,
        # and the shadow buffers its nodes copy from at capture; set by the capture.
        self.graph_nodes: dict = {}
        self.shadows: dict[str, torch.Tensor] = {}
        self.table = None  # graphrt.staging_table.StagingTable, made by a table-mode capture

    def single_names(self, padded_bs: int) -> list[str]:
        """The inputs staged one copy each (alone in their dtype) for graph ``padded_bs``."""
        return [k for k, _ in self._staging(padded_bs).singles]

    def reset_graph_staging(self) -> None:
        """Forget every graph's staging nodes and the staging functions bound to them (a
        capture starts over)."""
        self.graph_nodes = {}
        self._bound.clear()

    def views(self, padded_bs: int) -> dict[str, torch.Tensor]:
        """The static inputs a graph of ``padded_bs`` rows reads (``shape_for(padded_bs)`` each)."""
        return {k: self._view(k, padded_bs) for k in self.buffers}

    def live_views(self, n: int) -> dict[str, torch.Tensor]:
        """The static inputs' live part for ``n <= max_bs`` rows (batch ``[n, ...]``, offsets
        ``[n + 1]``, fixed whole), built once per ``n``: the same dict and tensors every call,
        so the caller must not mutate either (``GraphRuntime.input_buffers`` hands out a copy
        of the dict)."""
        return self._staging(n).views

    def hand_out(self, n: int) -> dict[str, torch.Tensor]:
        """``live_views(n)`` (a fresh dict) for a caller to write rows ``[0, n)`` in place
        (``input_buffers``): those rows count as dirty at once, so a smaller batch staged
        next re-pads them whether or not a replay of ``n`` came between."""
        views = self._staging(n).views.copy()
        if self._dirty < n:
            self._dirty = n
        return views

    def _staging(self, n: int) -> "_Staging":
        if not 0 < n <= self.max_bs:
            raise InputError(f"{n} live rows: the static inputs hold 1 to {self.max_bs}")
        st = self._live[n]
        if st is None:
            st = self._live[n] = _Staging({k: self._view(k, n) for k in self.buffers},
                                          self.n_dev, self._counts[n:n + 1])
        return st

    def _view(self, k: str, bs: int) -> torch.Tensor:
        rows = self._kind[k]
        b = self.buffers[k]
        return b if rows == "fixed" else b[:bs + 1] if rows == "offsets" else b[:bs]

    def check_cached(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """``check(inputs)``, its verdict cached per ``signature(inputs)``. A repeat signature
        costs building and hashing that key (no per-input comparisons); a new one runs
        ``check`` (which raises the same errors) and is remembered only when it passes."""
        try:
            key = signature(inputs)
            n = self._verdicts.get(key)
        except (AttributeError, TypeError, RuntimeError):  # not tensors, or a nested one
            return self.check(inputs)                       # (no sizes): check() names it
        if n is None:
            n = self.check(inputs)
            if len(self._verdicts) >= self._max_verdicts:
                self._verdicts.clear()
            self._verdicts[key] = n
        return n

    def check(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Validate names, types, dtypes, shapes, devices and a common batch; return the batch."""
        if len(inputs) != len(self._checks) or inputs.keys() != self.buffers.keys():
            missing = sorted(self.buffers.keys() - inputs.keys())
            extra = sorted(inputs.keys() - self.buffers.keys())
            raise InputError(f"inputs of step {self.spec.name!r}: expected {sorted(self.buffers)}; "
                             f"missing {missing}, unexpected {extra}")
        n = first = None
        for k, rows, dtype, trailing, rank in self._checks:
            t = inputs[k]
            if not isinstance(t, torch.Tensor):
                raise InputError(f"input {k!r}: expected a torch.Tensor, got {type(t).__name__}")
            if t.is_nested:  # before any shape read: a nested tensor has no sizes
                raise InputError(f"input {k!r}: expected a dense (strided) tensor, got a nested "
                                 f"tensor (layout {t.layout}); pad its rows into one tensor, e.g. "
                                 "t.to_padded_tensor(0) or torch.stack(rows)")
            if t.layout is not torch.strided:
                raise InputError(f"input {k!r}: expected a dense (strided) tensor, got layout "
                                 f"{t.layout}; convert it with .to_dense()")
            if t.dtype != dtype:
                raise InputError(f"input {k!r}: expected dtype {dtype}, got {t.dtype}; convert "
                                 f"with .to({dtype})")
            shape = t.shape
            if rows == "fixed":
                if shape != trailing:
                    raise InputError(f"input {k!r}: expected the fixed shape {trailing}, got "
                                     f"{tuple(shape)}")
            elif len(shape) != rank or shape[1:] != trailing:
                lead = "bs + 1" if rows == "offsets" else "bs"
                raise InputError(f"input {k!r}: expected shape ({', '.join([lead, *map(str, trailing)])}"
                                 f"{',' if not trailing else ''}), got {tuple(shape)}")
            if t.device != self.device:
                raise InputError(f"input {k!r}: expected device {self.device}, got {t.device}; move "
                                 f"it with .to({str(self.device)!r})")
            if rows == "fixed":
                continue
            live = shape[0] - 1 if rows == "offsets" else shape[0]
            if n is None:
                n, first = live, k
            elif live != n:
                raise InputError(f"input {k!r} holds a batch of {live} but input {first!r} one of "
                                 f"{n}; all inputs share the batch (offsets inputs have bs + 1 entries)")
        if n < 1:
            raise InputError(f"run() needs at least one live row; got a batch of {n}")
        return n

    def stage(self, inputs: Mapping[str, torch.Tensor], n: int, padded_bs: int,
              eager: bool = True) -> None:
        """Copy the live inputs in, make rows ``[n, padded_bs)`` padding, set the live count.
        Staging records no autograd history (inputs that require grad are read as data).

        The inputs of one dtype go in one ``torch._foreach_copy_`` (one launch on CUDA), and
        the live count rides along with the int32 ones (a copy from a constant table), so a
        step with int64 and int32 inputs costs two launches whatever their number; an input
        alone in its dtype is one ``cudaMemcpyAsync`` on CUDA (see ``bind``). Runs the
        ``bind`` of this call shape (what ``GraphRuntime.run`` runs in its steady state);
        ``eager=False``: exactly that, the staging table or memcpy nodes of graph
        ``padded_bs`` copying at its replay (``check_replay``)."""
        names = self._names
        vals = tuple(map(inputs.__getitem__, names))
        self.bind(names, n, padded_bs, any(t.requires_grad for t in vals),
                  all(type(t) is torch.Tensor for t in vals), eager=eager)(vals)

    def bind(self, names: tuple, n: int, padded_bs: int, detach: bool = False,
             exact: bool = False, eager: bool = False) -> Callable:
        """``stage`` for one call shape, built once: a function of the inputs as a tuple in
        ``names`` order (any order of the spec's names) that stages them for ``n`` live rows
        in graph ``padded_bs``, exactly as ``stage`` does. ``detach``: some input requires
        grad (each one that does is read through ``detach()``); without it none may.
        ``exact``: every input is a plain ``torch.Tensor`` (no subclass).

        Each input's copy is picked here, once; the function's ``paths`` says which (name ->
        ``"foreach_copy_"``, ``"copy_"``, ``"memcpy"`` or ``"graph"``). ``"graph"``: an ``exact``
        input with a staging node in graph ``padded_bs`` (``graphrt.graph_staging``), re-pointed
        at the source (or idled, with ``copy_``, for a source it cannot take). ``"memcpy"`` (an ``exact`` input
        alone in its dtype, ``cudart.raw_copyable``): the ``cudaMemcpyAsync`` that ``copy_`` ends
        in, on the device's current stream, without torch's dispatch; per call it falls
        back to ``copy_`` for a source that is not contiguous (strides are free in a
        signature), is a negative view, has no data or overlaps the buffer, and while the
        current stream is a default stream (0-2) of another current device. ``"table"``: graph
        ``padded_bs`` stages through the stager's table (``graphrt.staging_table``): the
        function drafts a row that the runtime commits right before the replay; ``eager``
        copies now instead (``stage``: the static inputs hold the inputs once it returns)."""
        key = (names, n, padded_bs, detach, exact, eager)
        fn = self._bound.get(key)
        if fn is None:
            if exact and not eager and isinstance(self.graph_nodes.get(padded_bs), TableGraph):
                fn = staging_table.bind(self, names, n, padded_bs, detach)
            else:
                fn = self._bind(names, n, padded_bs, detach, exact)
            if len(self._bound) >= self._max_verdicts:
                self._bound.clear()
            self._bound[key] = fn
        return fn

    def _bind(self, names: tuple, n: int, padded_bs: int, detach: bool, exact: bool) -> Callable:
        st = self._staging(n)
        at = {k: i for i, k in enumerate(names)}
        gs = self.graph_nodes.get(padded_bs)
        every_node = gs.nodes if gs is not None else {}
        nodes = {k: v for k, v in every_node.items() if k in at} if exact else {}
        in_graph = tuple((at[k], node.stager(st.views[k], st.views[k].nbytes,  # (pos, stage)
                                             self.span(k)))
                         for k, node in nodes.items())
        paths = {k: "graph" for k in nodes}
        singles, raw = [], []                     # (position, dst); raw ones + the name
        groups = []                               # (getter of the sources, destinations)
        counted = False
        for ks, dsts, src in st.groups:           # the inputs without a node, by dtype
            rest = [(k, d) for k, d in zip(ks, dsts) if k not in nodes]
            if len(rest) + (src is not None) >= 2:
                pos = [at[k] for k, _ in rest] + ([len(names)] if src is not None else [])
                groups.append((itemgetter(*pos), [d for _, d in rest] + dsts[len(ks):]))
                paths.update((k, "foreach_copy_") for k, _ in rest)
                counted |= src is not None
            elif rest:
                singles.append((at[rest[0][0]], rest[0][1]))
                paths[rest[0][0]] = "copy_"
        tail = (st.count,) if counted else ()     # the live-count source, after the inputs
        for k, dst in st.singles:
            if k in nodes:
                continue
            if exact and cudart.raw_copyable(dst):
                raw.append((at[k], dst, k))
                paths[k] = "memcpy"
            else:
                singles.append((at[k], dst))
                paths[k] = "copy_"
        copy_raw = cudart.d2d_copier(raw) if raw else None
        pads = self._offset_pad(n, padded_bs) if self._offsets and padded_bs > n else ()
        nd, stager = self.n_dev, self
        unused = tuple(node for k, node in every_node.items() if k not in nodes)

        def stage(vals: tuple) -> None:
            repad = stager._dirty != n
            if stager._dirty < n:                 # first: the mark covers rows [0, n), so a
                stager._dirty = n                 # copy that raises leaves it true
            if stager.table is not None:          # staged here: the table must copy nothing
                stager.table.idle()
            if detach:
                vals = tuple([t.detach() if t.requires_grad else t for t in vals])
            for node in unused:                   # copied another way: the node must not
                node.idle()
            for i, stage_one in in_graph:
                stage_one(vals[i])
            if copy_raw is not None:
                copy_raw(vals)
            for i, dst in singles:
                dst.copy_(vals[i])
            if groups:
                vals += tail
                for get, dsts in groups:  # >= 2 sources each: get() returns a tuple
                    _foreach_copy_(dsts, get(vals))
            if repad:                             # after the copies: a source in the
                stager._repad(n, padded_bs)       # rows it pads is read before they are
            for dst, src in pads:
                dst.copy_(src)
            if counted:
                stager._n_written = (n, nd._version)
            elif stager._n_written != (n, nd._version):
                nd.fill_(n)
                stager._n_written = (n, nd._version)
        stage.paths = paths
        return stage

    def refuse_overlap(self, inputs: Mapping[str, torch.Tensor], exc: BaseException) -> None:
        """After staging ``inputs`` raised ``exc``: raise ``InputError`` (from ``exc``) when an
        input shares memory with a static input buffer (a view of ``input_buffers(n)``, whose
        rows a staging copy would overwrite while reading them: torch refuses such a copy);
        return otherwise, for the caller to re-raise ``exc``. Only a failed step pays for it:
        the steady path does no overlap check. Host-only."""
        mine = {storage_key(b): k for k, b in self.buffers.items()}
        mine.pop(None, None)                       # a buffer without data overlaps nothing
        for k, t in inputs.items():
            name = mine.get(storage_key(t)) if isinstance(t, torch.Tensor) else None
            if name is not None:
                why = (str(exc).strip() or type(exc).__name__).splitlines()[0]
                raise InputError(
                    f"input {k!r}: expected a tensor of your own, got one that shares memory "
                    f"with graphrt's static input {name!r} (a view of rt.input_buffers(n)): "
                    "staging copies into that buffer while it reads from it. Pass a copy "
                    f"({k}=t.clone()), or write the rows through input_buffers(n) and call "
                    f"replay(n). (torch: {why})") from exc

    def pad_only(self, n: int, padded_bs: int) -> None:
        """The live rows are in place: pad rows ``[n, padded_bs)``, set the live count.

        Batch inputs are refilled with ``pad_value`` only where an earlier, larger batch may
        have dirtied them (a high-water mark); offsets inputs continue their last live
        offset on the device (no host read). The live count is filled only when it differs
        from our last fill or anything wrote ``n_dev`` since (its version counter moved)."""
        gs = self.graph_nodes.get(padded_bs)
        if gs is not None:                        # the inputs are in place: no node (nor the
            gs.idle()                             # staging table of a TableGraph) copies
        if self._dirty != n:
            self._repad(n, padded_bs)
        if self._offsets and padded_bs > n:
            for dst, src in self._offset_pad(n, padded_bs):
                dst.copy_(src)
        nd = self.n_dev
        if self._n_written != (n, nd._version):
            nd.fill_(n)
            self._n_written = (n, nd._version)

    def _repad(self, n: int, padded_bs: int) -> None:
        """Refill the batch inputs' rows ``[n, padded_bs)`` that may be dirty and move the
        high-water mark (a no-op when it is ``n``)."""
        dirty = self._dirty
        if dirty > n and padded_bs > n:
            stop = dirty if dirty < padded_bs else padded_bs
            for k in self._batch:
                self.buffers[k][n:stop].fill_(self._pad_values[k])
        self._dirty = dirty if dirty > padded_bs else n

    def span(self, k: str) -> int:
        """Bytes from input ``k``'s static buffer's first byte to the end of its memory: a
        source that an in-graph copy reads (a staging node, the staging table) must lie
        outside all of it, since padding before the replay rewrites rows past the live ones."""
        b = self.buffers[k]
        storage = b.untyped_storage()
        return storage.nbytes() - (b.data_ptr() - storage.data_ptr())

    def _offset_pad(self, n: int, padded_bs: int) -> list:
        """``[(dst, src)]`` per offsets input: rows ``[n + 1, padded_bs + 1)`` continue offset ``n``."""
        pads = self._offset_pads.get((n, padded_bs))
        if pads is None:
            pads = self._offset_pads[(n, padded_bs)] = [
                (b[n + 1:padded_bs + 1], b[n:n + 1].expand(padded_bs - n))
                for b in (self.buffers[k] for k in self._offsets)]
        return pads

    @torch.no_grad()
    def poison(self, n: int, padded_bs: int, generator: torch.Generator) -> None:
        """Fill padded rows ``[n, padded_bs)`` with garbage (NaN for floats, random valid
        values otherwise; offsets grow by random valid increments) to prove live rows never
        depend on them (``check_replay``). A ``unique`` input's padded rows get values no live
        row holds (a KV slot of a live request would be a collision the real batch cannot
        have; the spec's unique span covers ``max_batch_size``). An integer input whose
        ``pad_value`` lies outside ``[low, high)`` keeps it: a sentinel the step may test for
        (vLLM's slot -1 skips the KV write; ``run()`` always pads with it), where a valid
        value wrote a slot a live request reads. Host-only (syncs)."""
        if padded_bs <= n:
            return
        for k in self._batch:
            inp, buf = self.spec.inputs[k], self.buffers[k]
            if sentinel(inp):
                continue
            if inp.dtype.is_floating_point:
                buf[n:padded_bs].fill_(float("nan"))
            elif inp.unique:                      # enough values: StepSpec checks the span
                free = distinct(int(inp.low), int(inp.high), padded_bs - n, generator,
                                exclude=buf[:n].tolist())
                buf[n:padded_bs].copy_(free)
            else:
                buf[n:padded_bs].copy_(inp.random(padded_bs - n, self.device, generator))
        for k in self._offsets:
            grow = self.spec.inputs[k].random(padded_bs - n, self.device, generator)[1:]  # prefix sums
            b = self.buffers[k]
            b[n + 1:padded_bs + 1].copy_(b[n:n + 1] + grow)
        self._dirty = max(self._dirty, padded_bs)

    def pad_rows_intact(self, n: int, padded_bs: int) -> list[str]:
        """Names of inputs whose padded rows no longer hold their padding (a step that writes
        its inputs breaks padding); host-only (syncs), used by checks."""
        bad = []
        for k in self._batch:
            rows = self.buffers[k][n:padded_bs]
            if rows.numel() and not bool((rows == self._pad_values[k]).all()):
                bad.append(k)
        for k in self._offsets:
            b = self.buffers[k]
            if padded_bs > n and not bool((b[n + 1:padded_bs + 1] == b[n]).all()):
                bad.append(k)
        return bad


def clone_shared(out, tensors, where: str):
    """``out`` (a step's outputs: a tensor, tuple or dict) with a clone of each output that
    shares memory with one of ``tensors`` (the declared state, inputs, static buffers), so
    a caller never holds memory the next step rewrites; the others as they are. Host-only."""
    from graphrt.outputs import OutputLayout

    def memory(t):  # a tensor without data or storage is only itself
        return storage_key(t) or id(t)
    held = {memory(t) for t in tensors}
    layout, flat = OutputLayout.flatten(out, where=where)
    return layout.build([t.clone() if memory(t) in held else t for t in flat])


def storage_key(t: torch.Tensor) -> tuple | None:
    """``(device, storage address)`` of ``t`` (views of one storage alike), None for one
    without data or a storage. Host-only."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (t.device, ptr) if ptr else None


# dtypes torch._foreach_copy_ handles on CUDA in one launch; others get a copy_ each.
_FOREACH_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}


class _Staging:
    """The staging of ``n`` live rows, built once per ``n``: ``views`` (name -> live view of
    the static input); ``groups``: per dtype of two or more copies ``(names, destination
    views, count)``, where ``count`` is the live-count source that joins the int32 group
    (destination ``n_dev``; ``counted`` says whether one did, ``count`` is that source);
    ``singles``: ``(name, view)`` for an input alone in its dtype (a plain ``copy_``)."""

    __slots__ = ("views", "groups", "singles", "counted", "count")

    def __init__(self, views: dict, n_dev: torch.Tensor, count: torch.Tensor):
        by_dtype: dict = {}
        for k, v in views.items():
            by_dtype.setdefault(v.dtype if v.dtype in _FOREACH_DTYPES else k, []).append(k)
        self.views, self.groups, self.singles, self.counted = views, [], [], False
        self.count = count
        for dtype, names in by_dtype.items():
            dsts = [views[k] for k in names]
            src = None
            if dtype is n_dev.dtype:
                dsts.append(n_dev)
                src, self.counted = count, True
            if len(dsts) == 1:
                self.singles.append((names[0], dsts[0]))
            else:
                self.groups.append((tuple(names), dsts, src))
