"""The staging table: a step's inputs copied in by the graph's first kernel, from addresses
the host keeps in a small row on the device, so ``run()`` stages any number of inputs, of
any dtypes, with at most one CUDA call (``GRAPHRT_GRAPH_STAGING=table``), and none when the
engine hands the same tensors as the step before.

One table per ``Stager`` (so per runtime), shared by all its graphs. Each graph captures, as
its first work, one launch of ``graphrt.kernels.staging.stage_table`` (the device side and
the exact layout are documented there). The host keeps the row's next value in ordinary
(pageable) memory:

- *draft* (the bound step of ``run()``): each input's source address and live bytes, the
  live count's constant ``n``, ``valid`` = 1. Inputs the table cannot take (offsets inputs,
  whose padding continues the last live offset; a source that is not contiguous) get 0
  bytes and are copied before the replay as usual;
- *idle* (a zero-copy ``replay(n)``, ``Stager.stage``, a call shape outside the table):
  ``valid`` = 0, so the kernel copies nothing over inputs that are already in place;
- *commit* (``GraphRuntime._launch``, right before ``graph.replay()``): when the row differs
  from what the device holds, one ``cudaMemcpyAsync`` sends it on the current stream. From
  pageable memory the runtime stages the bytes before the call returns, so the next step
  may rewrite the row at once and replays queued back to back each copy their own sources.

Like an armed memcpy node of ``graphrt.graph_staging``, the device row keeps the last
step's sources: a bare ``graph.replay()`` outside the runtime copies them again (their
tensors must still exist). Sources are read when the graph runs: a caller that frees an
input and writes its memory on another stream before the step ran races with it, as with
any asynchronous copy.

Costs (BENCHMARKS.md §24): host, a few stores a step and one raw copy call when a source
moved; device, that small copy before the graph and one small kernel at its head.

Graph safety: host-only (``record`` launches the kernel inside a capture; everything else
runs between launches).
"""
from __future__ import annotations

import ctypes
from types import MappingProxyType

import torch

from graphrt import cudart


class StagingTable:
    """The row and entries of one ``Stager`` (module doc).

    ``names``: the inputs with an entry (in entry order); the live count ``n_dev`` is the last
    entry. ``buffers``: their static buffers (whole). ``words``: the host row (int64 words);
    ``synced``: whether the device row holds them; ``sends``: commits that sent a row."""

    def __init__(self, names: list[str], buffers: dict[str, torch.Tensor], n_dev: torch.Tensor,
                 device: torch.device):
        self.names, self.device = list(names), device
        self.index = {k: i for i, k in enumerate(self.names)}
        targets = [buffers[k] for k in self.names] + [n_dev]
        self.entries = len(targets)
        with torch.inference_mode(False):
            self.host = torch.zeros(1 + 2 * self.entries, dtype=torch.int64)   # pageable
            self.row = torch.zeros(1 + 2 * self.entries, dtype=torch.int64, device=device)
            self.dsts = torch.tensor([t.data_ptr() for t in targets], dtype=torch.int64, device=device)
            self.caps = torch.tensor([t.nbytes for t in targets], dtype=torch.int64, device=device)
        self.words = memoryview(self.host.numpy()).cast("B").cast("q")  # writable, no copy
        self.synced = True                                         # both rows all zeros
        self.sends = 0
        self._send = self._sender()

    def _sender(self):
        """The commit's copy: the raw ``cudaMemcpyAsync`` host -> device on the current stream
        on CUDA, a ``copy_`` elsewhere (CPU tests)."""
        if self.device.type != "cuda":
            return lambda: self.row.copy_(self.host)
        memcpy, current_stream = cudart.memcpy_async_fn(), cudart.stream_fns()[0]
        dst, src = ctypes.c_void_p(self.row.data_ptr()), ctypes.c_void_p(self.host.data_ptr())
        nbytes, kind = ctypes.c_size_t(self.host.nbytes), ctypes.c_int(cudart.MEMCPY_H2D)
        dev = self.device.index

        def send() -> None:
            rc = memcpy(dst, src, nbytes, kind, current_stream(dev))
            if rc:
                cudart.check(rc, "cudaMemcpyAsync of the staging table's row")
        return send

    def keepalive(self) -> tuple:
        """The tensors a graph with this table's kernel reads (keep them while it exists)."""
        return (self.row, self.dsts, self.caps)

    def commit(self) -> None:
        """Send the host row if the device does not hold it yet."""
        if not self.synced:
            self._send()
            self.synced = True
            self.sends += 1

    def idle(self) -> None:
        """The next replay's inputs are in place: its kernel must copy nothing."""
        if self.words[0]:
            self.words[0] = 0
            self.synced = False

    def record(self, nbytes: int) -> None:
        """Inside a capture: the table kernel, with programs for ``nbytes`` per entry (the
        graph's largest static view). Also before capture, once, to compile it (the row is
        idle then: the launch copies nothing). Graph safety: capturable."""
        from graphrt.kernels.staging import chunks_for, stage_table
        stage_table(self.row, self.dsts, self.caps, chunks_for(nbytes))


class TableGraph:
    """A captured graph that stages through ``table`` (``Stager.graph_nodes[size]``): it has
    no memcpy nodes; ``idle()`` (before a replay whose inputs are in place) idles the row."""

    nodes = MappingProxyType({})   # what Stager.bind reads of a graph's memcpy nodes: none

    def __init__(self, table: StagingTable):
        self.table = table

    def idle(self) -> None:
        self.table.idle()


def eligible(stager) -> list[str]:
    """The inputs a table of ``stager`` takes: batch and fixed ones (offsets inputs' padding
    continues their last live offset, written first) whose static buffer is contiguous, has
    bytes and is not complex."""
    return [k for k, b in stager.buffers.items()
            if stager.spec.inputs[k].rows != "offsets" and b.is_contiguous() and b.numel() > 0
            and not b.is_complex()]


def for_capture(stager) -> StagingTable | None:
    """The table the stager's graphs stage through (made on its first capture and compiled
    by one launch that copies nothing), or None: ``GRAPHRT_GRAPH_STAGING`` is not ``table``
    or the device is not CUDA. Host-only (call outside the capture)."""
    from graphrt import graph_staging
    if stager.device.type != "cuda" or graph_staging.mode() != "table":
        return None
    table = stager.table
    if table is None:
        table = stager.table = StagingTable(eligible(stager), stager.buffers, stager.n_dev,
                                            stager.device)
        table.record(1)
    return table


def graph_bytes(stager, table: StagingTable, size: int) -> int:
    """The most bytes one entry of graph ``size`` copies (its programs per entry)."""
    views = stager.views(size)
    return max([views[k].nbytes for k in table.names] + [4])


def bind(stager, names: tuple, n: int, padded_bs: int, detach: bool):
    """``Stager.bind`` for a graph that stages through the stager's table: a function of the
    inputs (a tuple in ``names`` order) that drafts the row (each table input's address and
    live bytes, the live count's constant; the device's copy goes stale only if a word
    changed) and copies the rest before the replay; the runtime commits the row right
    before ``graph.replay()``. ``paths``: name -> ``"table"``
    or ``"copy_"``. A source the kernel cannot take (not contiguous, a negative view, no data,
    overlapping its static buffer anywhere) gets 0 bytes and a ``copy_`` instead, per call. Only for
    ``exact`` call shapes (plain tensors; ``Stager.bind`` stages the others itself)."""
    table = stager.table
    st = stager._staging(n)
    at = {k: i for i, k in enumerate(names)}
    entries, others, paths = [], [], {}
    for k, view in st.views.items():
        i = table.index.get(k)
        if i is None:
            others.append((at[k], view))
            paths[k] = "copy_"
        else:
            entries.append((at[k], 1 + 2 * i, 2 + 2 * i, view.nbytes, view.data_ptr(),
                            stager.span(k), view))
            paths[k] = "table"
    count_word, count_addr = 2 * table.entries - 1, st.count.data_ptr()
    pads = stager._offset_pad(n, padded_bs) if stager._offsets and padded_bs > n else ()
    words = table.words

    def stage(vals: tuple) -> None:
        repad = stager._dirty != n
        if stager._dirty < n:                     # first: the mark covers rows [0, n), so a
            stager._dirty = n                     # copy that raises leaves it true
        if detach:
            vals = tuple([t.detach() if t.requires_grad else t for t in vals])
        if words[0] != 1 or words[count_word] != count_addr:
            words[0], words[count_word], words[count_word + 1] = 1, count_addr, 4
            table.synced = False
        # A changed word marks the row unsynced at once, so a copy that raises further on
        # cannot leave a later call believing the device row current.
        for pos, w_src, w_bytes, nb, d, span, dst in entries:
            src = vals[pos]
            if src.is_contiguous() and not src.is_neg():
                s = src.data_ptr()   # outside the whole buffer: the kernel reads it after
                if s and (s + nb <= d or d + span <= s):  # the padding below

                    if words[w_src] != s or words[w_bytes] != nb:
                        words[w_src], words[w_bytes] = s, nb
                        table.synced = False
                    continue
            if words[w_bytes]:
                words[w_bytes] = 0
                table.synced = False
            dst.copy_(src)
        for pos, dst in others:
            dst.copy_(vals[pos])
        if repad:                                 # after the copies: a source in the rows
            stager._repad(n, padded_bs)           # it pads is read before they are
        for dst, src in pads:
            dst.copy_(src)
        stager._n_written = (None, -1)  # n_dev is written by the graph, not by a fill
    stage.paths = paths
    return stage
