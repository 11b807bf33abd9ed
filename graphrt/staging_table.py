"""The staging table: a step's inputs copied in by the graph's first kernel, from addresses
the host writes into pinned memory, so ``run()`` stages any number of inputs, of any dtypes,
new tensors or the same, with no CUDA call at all (``GRAPHRT_GRAPH_STAGING=table``).

One table per ``Stager`` (so per runtime), shared by all its graphs. Each graph captures, as
its first work, one launch of ``graphrt.kernels.staging.stage_table`` (the device side and
the exact layout are documented there). The host side, per step:

1. *draft* (``open`` + the bound step's writes): the next row of a ring in pinned memory
   gets each input's source address and live bytes, and the live-count entry the address of
   the constant ``n``. Inputs the table cannot take (offsets inputs, whose padding continues
   the last live offset; a source that is not contiguous) get 0 bytes and are copied before
   the replay as usual.
2. *commit* (``GraphRuntime._launch``, right before ``graph.replay()``): the row's ``seq``
   word is written last. ``commit`` with no draft commits an empty row (a zero-copy
   ``replay(n)``: nothing to copy), so every replay through the runtime consumes exactly one
   row and the device counter stays in step with the host's.
3. The kernel of the replay finds row ``counter % slots`` with ``seq == counter``, copies,
   and moves the counter (and ``ack``, in pinned memory, for the host) on.

Rules that keep it exact:

- the draft is dropped (``discard``) by every staging that does not use it (``Stager.stage``,
  ``pad_only``, a call shape outside the table), so a draft can only be committed by the
  replay it was made for; a replay that fails to launch takes its row back (``cancel``);
- the host never rewrites a row the device may still read: before drafting row ``q`` it
  checks ``q - ack < slots`` and otherwise synchronizes the device first (a host that runs
  ``slots`` steps ahead of the GPU; never in a loop that reads each step's output);
- a bare ``graph.replay()`` outside the runtime stages nothing, unless it runs after a row
  was committed and before that row's own replay: then it takes the row's inputs early
  (the later replay still reads them, as the static buffers keep them);
- sources are read when the graph runs: a caller that frees an input and writes its memory
  on another stream before the step ran races with it, as with any asynchronous copy.

Host cost: a few stores into pinned memory per input; device cost: one small kernel at the
head of the graph reading the row over PCIe (BENCHMARKS.md §24).

Graph safety: host-only (``record`` launches the kernel inside a capture; everything else
runs between launches).
"""
from __future__ import annotations

import torch

from graphrt.errors import GraphrtError

SLOTS = 64  # rows in the ring: how far the host may run ahead of the device


class StagingTable:
    """The ring, counters and entries of one ``Stager`` (module doc).

    ``names``: the inputs with an entry (in entry order); the live count ``n_dev`` is the last
    entry. ``buffers``: their static buffers (whole). Allocates pinned host memory on CUDA."""

    def __init__(self, names: list[str], buffers: dict[str, torch.Tensor], n_dev: torch.Tensor,
                 device: torch.device, slots: int = SLOTS):
        self.names, self.device, self.slots = list(names), device, slots
        self.index = {k: i for i, k in enumerate(self.names)}
        targets = [buffers[k] for k in self.names] + [n_dev]
        self.entries = len(targets)
        self.row_words = 1 + 2 * self.entries
        pin = device.type == "cuda"
        with torch.inference_mode(False):
            self.ring = torch.full((slots, self.row_words), -1, dtype=torch.int64, pin_memory=pin)
            self.ack = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
            self.counter = torch.zeros(1, dtype=torch.int64, device=device)
            self.arrive = torch.zeros(1, dtype=torch.int32, device=device)
            self.dsts = torch.tensor([t.data_ptr() for t in targets], dtype=torch.int64, device=device)
            self.caps = torch.tensor([t.nbytes for t in targets], dtype=torch.int64, device=device)
        self._targets = targets
        self.words = memoryview(self.ring.numpy()).cast("B").cast("q")  # flat, writable
        self._ack = self.ack.numpy()
        self.seq = 0            # the seq of the next row to commit
        self.draft = -1         # the drafted row's first word, or -1
        self.waits = 0          # times the host ran ``slots`` rows ahead and synchronized

    def keepalive(self) -> tuple:
        """The tensors a graph with this table's kernel reads (keep them while it exists)."""
        return (self.ring, self.ack, self.counter, self.arrive, self.dsts, self.caps)

    def open(self) -> int:
        """Start the draft of the next row; returns its first word (its ``seq`` word, written
        by ``commit``). The caller writes ``(address, bytes)`` of every entry at ``base + 1 +
        2 * i`` / ``base + 2 + 2 * i``."""
        q = self.seq
        if q - int(self._ack[0]) >= self.slots:
            self._wait(q)
        base = self.draft = (q % self.slots) * self.row_words
        return base

    def _wait(self, q: int) -> None:
        self.waits += 1
        torch.cuda.synchronize(self.device)
        if q - int(self._ack[0]) >= self.slots:
            raise GraphrtError(
                f"staging table: row {q - self.slots} was committed but no replay consumed it "
                f"(the device is at row {int(self._ack[0])} after a synchronize). A replay was "
                "committed without launching; set GRAPHRT_GRAPH_STAGING=1 and report this")

    def commit(self) -> None:
        """Make the draft (or, with none, an empty row) the next replay's row."""
        base = self.draft
        if base < 0:
            base = self.open()
            words = self.words
            for i in range(self.entries):
                words[base + 2 + 2 * i] = 0
        self.words[base] = self.seq
        self.seq += 1
        self.draft = -1

    def cancel(self) -> None:
        """Take back the row of the last ``commit`` (its replay did not launch)."""
        self.seq -= 1
        self.words[(self.seq % self.slots) * self.row_words] = -1

    def discard(self) -> None:
        """Drop the draft: the inputs were staged another way."""
        self.draft = -1

    def record(self, nbytes: int) -> None:
        """Inside a capture: the table kernel, with programs for ``nbytes`` per entry (the
        graph's largest static view). Also before capture, once, to compile it (a launch
        that finds no row of its own copies nothing). Graph safety: capturable."""
        from graphrt.kernels.staging import chunks_for, stage_table
        stage_table(self.ring, self.counter, self.arrive, self.ack, self.dsts, self.caps,
                    chunks_for(nbytes))


class TableGraph:
    """A captured graph that stages through ``table`` (``Stager.graph_nodes[size]``): it has
    no memcpy nodes; ``idle()`` (before a replay whose inputs are in place) drops the draft."""

    nodes: dict = {}

    def __init__(self, table: StagingTable):
        self.table = table

    def idle(self) -> None:
        self.table.discard()


def eligible(stager) -> list[str]:
    """The inputs a table of ``stager`` takes: batch and fixed ones (offsets inputs' padding
    continues their last live offset, written first) whose static buffer is contiguous, has
    bytes and is not complex."""
    return [k for k, b in stager.buffers.items()
            if stager.spec.inputs[k].rows != "offsets" and b.is_contiguous() and b.numel() > 0
            and not b.is_complex()]


def for_capture(stager, size: int) -> StagingTable | None:
    """The table graph ``size`` stages through (made on the stager's first capture and compiled
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
    inputs (a tuple in ``names`` order) that drafts the next row (each table input's address
    and live bytes, the live count's constant) and copies the rest before the replay; the
    runtime commits the row right before ``graph.replay()``. ``paths``: name -> ``"table"``
    or ``"copy_"``. A source the kernel cannot take (not contiguous, a negative view, no data,
    overlapping its buffer) gets 0 bytes and a ``copy_`` instead, per call. Only for
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
            entries.append((at[k], 1 + 2 * i, 2 + 2 * i, view.nbytes, view.data_ptr(), view))
            paths[k] = "table"
    count_word, count_addr = 2 * table.entries - 1, st.count.data_ptr()
    pads = stager._offset_pad(n, padded_bs) if stager._offsets and padded_bs > n else ()
    words = table.words

    def stage(vals: tuple) -> None:
        if detach:
            vals = tuple([t.detach() if t.requires_grad else t for t in vals])
        base = table.open()
        for pos, w_src, w_bytes, nb, d, dst in entries:
            src = vals[pos]
            if src.is_contiguous() and not src.is_neg():
                s = src.data_ptr()
                if s and (s + nb <= d or d + nb <= s):
                    words[base + w_src] = s
                    words[base + w_bytes] = nb
                    continue
            words[base + w_bytes] = 0
            dst.copy_(src)
        words[base + count_word] = count_addr
        words[base + count_word + 1] = 4
        for pos, dst in others:
            dst.copy_(vals[pos])
        if stager._dirty != n:
            stager._repad(n, padded_bs)
        for dst, src in pads:
            dst.copy_(src)
        stager._n_written = (None, -1)  # n_dev is written by the graph, not by a fill
    stage.paths = paths
    return stage
