"""The staging table (issue 17, ``graphrt.staging_table``, ``graphrt.kernels.staging``): a
graph's first kernel copies the inputs from addresses the host wrote into a ring of rows.

CPU (the kernel on the Triton interpreter, the ring in ordinary memory, each "replay" one
launch of the kernel): the row protocol (draft, commit, a launch with no row of its own copies
nothing, cancel, the lapping guard) and ``Stager.bind``'s table function against eager staging.
GPU (``@pytest.mark.gpu``): captured graphs staging through the table, against eager, with
replays queued behind a device sleep, zero-copy replays and strided sources in between."""
import pytest
import torch

import graphrt
from graphrt.errors import GraphrtError
from graphrt.kernels._util import interpreting
from graphrt.replay_policy import Stager
from graphrt.staging_table import StagingTable, TableGraph, eligible, graph_bytes
from tests.fakes.specs import every_kind_spec, lone_and_grouped_spec

cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


def _table(slots=4):
    bufs = {"a": torch.zeros(8, 3, dtype=torch.float32), "b": torch.zeros(8, dtype=torch.int64)}
    n_dev = torch.zeros(1, dtype=torch.int32)
    return StagingTable(["a", "b"], bufs, n_dev, torch.device("cpu"), slots=slots), bufs, n_dev


def _draft(table, srcs, n_dev_src=None):
    base = table.open()
    for i, src in enumerate(srcs):
        table.words[base + 1 + 2 * i] = src.data_ptr() if src is not None else 0
        table.words[base + 2 + 2 * i] = src.nbytes if src is not None else 0
    last = table.entries - 1
    table.words[base + 1 + 2 * last] = n_dev_src.data_ptr() if n_dev_src is not None else 0
    table.words[base + 2 + 2 * last] = 4 if n_dev_src is not None else 0


@cpu_interpreter
def test_a_committed_row_is_copied_by_the_next_launch_and_only_by_it():
    table, bufs, n_dev = _table()
    a, b, count = torch.randn(5, 3), torch.arange(5) * 7, torch.tensor([5], dtype=torch.int32)
    _draft(table, [a, b], count)
    table.record(bufs["a"].nbytes)                        # before the commit: not its row
    assert not bufs["a"].any() and int(table.counter) == 0
    table.commit()
    table.record(bufs["a"].nbytes)
    assert torch.equal(bufs["a"][:5], a) and not bufs["a"][5:].any()
    assert torch.equal(bufs["b"][:5], b) and not bufs["b"][5:].any()
    assert int(n_dev) == 5 and int(table.counter) == 1 and int(table.ack) == 1
    assert int(table.arrive) == 0
    bufs["a"].zero_()
    table.record(bufs["a"].nbytes)                         # a bare replay: nothing staged
    assert not bufs["a"].any() and int(table.counter) == 1


@cpu_interpreter
def test_an_empty_commit_copies_nothing_and_keeps_host_and_device_in_step():
    table, bufs, _ = _table()
    table.commit()                                          # zero-copy replay: no draft
    table.record(bufs["a"].nbytes)
    assert int(table.counter) == 1 and not bufs["a"].any()
    a = torch.ones(2, 3)
    _draft(table, [a, None])
    table.commit()
    table.record(bufs["a"].nbytes)
    assert int(table.counter) == 2 and torch.equal(bufs["a"][:2], a)


@cpu_interpreter
def test_bytes_past_the_buffer_or_the_launch_chunks_are_never_written():
    table, bufs, _ = _table()
    big = torch.arange(40, dtype=torch.float32).view(10, 4)   # 160 bytes into a 96-byte buffer
    guard = torch.full((4,), 5.0)
    base = table.open()
    table.words[base + 1] = big.data_ptr()
    table.words[base + 2] = big.nbytes
    table.commit()
    table.record(bufs["a"].nbytes)
    assert torch.equal(bufs["a"].flatten(), big.flatten()[:24]) and torch.equal(guard, torch.full((4,), 5.0))


@cpu_interpreter
def test_cancel_takes_a_row_back_and_discard_drops_a_draft():
    table, bufs, _ = _table()
    a = torch.ones(3, 3)
    _draft(table, [a, None])
    table.commit()
    table.cancel()                                          # its replay did not launch
    table.record(bufs["a"].nbytes)
    assert not bufs["a"].any() and int(table.counter) == 0 and table.seq == 0
    _draft(table, [a, None])
    table.discard()
    table.commit()                                          # empty: the draft was dropped
    table.record(bufs["a"].nbytes)
    assert not bufs["a"].any() and int(table.counter) == 1


def test_the_host_synchronizes_before_rewriting_a_row_the_device_has_not_read(monkeypatch):
    table, bufs, _ = _table(slots=2)
    synced = []

    def catch_up(device=None):                              # the device consumes both rows
        synced.append(device)
        table.ack[0] = table.seq
    monkeypatch.setattr(torch.cuda, "synchronize", catch_up)
    table.commit()
    table.commit()
    table.open()                                            # row 2 reuses row 0's words
    assert synced and table.waits == 1
    table.commit()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    table.commit()
    with pytest.raises(GraphrtError, match="no replay consumed it"):
        table.open()                                        # committed rows nobody replays


# -- Stager.bind through the table -------------------------------------------------------------
def _table_stager(spec, padded):
    st = Stager(spec, 16, torch.device("cpu"))
    st.table = StagingTable(eligible(st), st.buffers, st.n_dev, st.device)
    st.graph_nodes[padded] = TableGraph(st.table)
    return st


def _replay(st, padded):
    """What ``GraphRuntime._launch`` does around the graph, with the kernel alone as the graph."""
    st.table.commit()
    st.table.record(graph_bytes(st, st.table, padded))


@cpu_interpreter
@pytest.mark.parametrize("n,padded", [(3, 4), (4, 4), (9, 16)])
def test_bind_stages_every_kind_of_input_like_eager_staging(n, padded):
    spec = every_kind_spec(16)
    st, ref = _table_stager(spec, padded), Stager(spec, 16, torch.device("cpu"))
    assert st.table.names == ["x", "ids", "table", "bias"]       # offsets stay outside
    gen = torch.Generator().manual_seed(n)
    for step in range(3):
        live = spec.random_inputs(n, generator=gen)
        names = tuple(live)
        fn = st.bind(names, n, padded, exact=True)
        assert fn.paths == {"x": "table", "ids": "table", "table": "table", "bias": "table",
                            "cu": "copy_"}
        fn(tuple(live.values()))
        _replay(st, padded)
        ref.stage(live, n, padded)
        for k in st.buffers:
            assert torch.equal(st.buffers[k], ref.buffers[k]), (step, k)
        assert int(st.n_dev) == n


@cpu_interpreter
def test_sources_the_kernel_cannot_take_go_by_copy_and_subclasses_by_eager_staging():
    spec = lone_and_grouped_spec(8)
    st = _table_stager(spec, 4)
    live = spec.random_inputs(3, generator=torch.Generator().manual_seed(1))
    live["x"] = live["x"].t().contiguous().t()               # strided: same signature
    fn = st.bind(tuple(live), 3, 4, exact=True)
    fn(tuple(live.values()))
    assert torch.equal(st.buffers["x"][:3], live["x"])        # copied at once
    _replay(st, 4)
    assert all(torch.equal(st.buffers[k][:3], v) for k, v in live.items())
    fn = st.bind(tuple(live), 3, 4, exact=False)              # a subclass in the call shape
    assert set(fn.paths.values()) <= {"copy_", "foreach_copy_", "memcpy"}
    st.table.open()
    fn(tuple(live.values()))
    assert st.table.draft == -1                               # staged here: no draft may run


@cpu_interpreter
def test_eager_stage_and_pad_only_drop_a_draft():
    spec = lone_and_grouped_spec(8)
    st = _table_stager(spec, 4)
    gen = torch.Generator().manual_seed(2)
    old, new = (spec.random_inputs(3, generator=gen) for _ in range(2))
    st.bind(tuple(old), 3, 4, exact=True)(tuple(old.values()))   # drafted, never replayed
    st.stage(new, 3, 4)
    _replay(st, 4)
    assert all(torch.equal(st.buffers[k][:3], v) for k, v in new.items())
    st.bind(tuple(old), 3, 4, exact=True)(tuple(old.values()))
    st.pad_only(3, 4)
    _replay(st, 4)
    assert all(torch.equal(st.buffers[k][:3], v) for k, v in new.items())


# -- on a GPU ----------------------------------------------------------------------------------
def _cuda_live(spec, n: int, gen, device) -> dict:
    return {k: v.to(device) for k, v in spec.random_inputs(n, generator=gen).items()}


@pytest.fixture
def table_mode(monkeypatch):
    monkeypatch.setenv("GRAPHRT_GRAPH_STAGING", "table")


@pytest.mark.gpu
def test_graphs_stage_through_the_table_and_match_eager(cuda_device, table_mode):
    spec = every_kind_spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device=cuda_device, progress=False).capture()
    assert rt.stager.table is not None and rt.stager.graph_nodes[4].table is rt.stager.table
    assert rt.stager.table.ring.is_pinned()
    gen = torch.Generator().manual_seed(1)
    for n in (3, 3, 9, 3, 16, 1, 4):
        live = _cuda_live(spec, n, gen, cuda_device)
        want = spec.call_padded(live, rt.table.pick(n), None)
        got = rt.run(**live)
        assert torch.equal(got["y"], want["y"]) and torch.equal(got["total"], want["total"]), n
    assert rt._steps.lookup(live, tuple(live.values()))[0].paths["x"] == "table"
    rt.check_replay()


@pytest.mark.gpu
def test_replays_queued_behind_a_sleep_each_read_their_own_row(cuda_device, table_mode):
    """More runs than the ring has rows, all queued behind a device sleep: the host waits for
    the device once it is a ring ahead, and every replay copies its own run's tensors."""
    spec = lone_and_grouped_spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device=cuda_device, progress=False).capture()
    gen = torch.Generator().manual_seed(2)
    lives = [_cuda_live(spec, n, gen, cuda_device) for n in (3, 4, 3, 2, 9) * 16]
    rt.run(**lives[0])
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    outs = [rt.run(**live) for live in lives]                    # copy-out: queued clones
    torch.cuda.synchronize()
    assert rt.stager.table.waits >= 1
    for live, out in zip(lives, outs):
        assert torch.equal(out, spec.call_padded(live, rt.table.pick(live["x"].shape[0]), None))


@pytest.mark.gpu
def test_zero_copy_replay_and_strided_sources_between_table_runs(cuda_device, table_mode):
    spec = lone_and_grouped_spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device=cuda_device, progress=False).capture()
    gen = torch.Generator().manual_seed(3)
    first, engine = _cuda_live(spec, 3, gen, cuda_device), _cuda_live(spec, 3, gen, cuda_device)
    torch.cuda._sleep(20_000_000)          # the run's row is committed before anything runs
    rt.run(**first)
    bufs = rt.input_buffers(3)
    for k, v in engine.items():
        bufs[k].copy_(v)
    assert torch.equal(rt.replay(3), spec.call_padded(engine, 4, None))
    live = _cuda_live(spec, 3, gen, cuda_device)
    live["x"] = live["x"].t().contiguous().t()                   # same signature, strided
    assert torch.equal(rt.run(**live), spec.call_padded(live, 4, None))
    assert rt.stager.table.seq == int(rt.stager.table.counter)
