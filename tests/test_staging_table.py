"""The staging table (issue 17, ``graphrt.staging_table``, ``graphrt.kernels.staging``): a
graph's first kernel copies the inputs from addresses the host sends in one row a step.

CPU (the kernel on the Triton interpreter, the row sent by ``copy_``, each "replay" one launch
of the kernel): the row protocol (draft, commit only when the row changed, idle) and
``Stager.bind``'s table function against eager staging.
GPU (``@pytest.mark.gpu``): captured graphs staging through the table, against eager, with
replays queued behind a device sleep, zero-copy replays and strided sources in between."""
import pytest
import torch

import graphrt
from graphrt.kernels._util import interpreting
from graphrt.replay_policy import Stager
from graphrt.staging_table import StagingTable, TableGraph, eligible, graph_bytes
from tests.fakes.specs import (assert_queued_runs_read_their_own_inputs, every_kind_spec, lone_and_grouped_spec)

cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


def _table():
    bufs = {"a": torch.zeros(8, 3, dtype=torch.float32), "b": torch.zeros(8, dtype=torch.int64)}
    n_dev = torch.zeros(1, dtype=torch.int32)
    return StagingTable(["a", "b"], bufs, n_dev, torch.device("cpu")), bufs, n_dev


def _draft(table, srcs, n_dev_src=None):
    """What a bound step writes: each entry's (address, bytes), 0 bytes for None, valid."""
    for i, src in enumerate(list(srcs) + [n_dev_src]):
        table.words[1 + 2 * i] = src.data_ptr() if src is not None else 0
        table.words[2 + 2 * i] = src.nbytes if src is not None else 0
    table.words[0] = 1
    table.synced = False


@cpu_interpreter
def test_a_committed_row_is_copied_by_every_launch_until_the_table_idles():
    table, bufs, n_dev = _table()
    a, b, count = torch.randn(5, 3), torch.arange(5) * 7, torch.tensor([5], dtype=torch.int32)
    _draft(table, [a, b], count)
    table.record(bufs["a"].nbytes)                        # before the commit: nothing sent
    assert not bufs["a"].any()
    table.commit()
    assert table.synced and table.sends == 1 and int(table.row[0]) == 1
    table.record(bufs["a"].nbytes)
    assert torch.equal(bufs["a"][:5], a) and not bufs["a"][5:].any()
    assert torch.equal(bufs["b"][:5], b) and not bufs["b"][5:].any() and int(n_dev) == 5
    table.commit()                                        # nothing changed: nothing sent
    assert table.sends == 1
    bufs["a"].zero_()
    table.idle()                                          # zero-copy replay: inputs in place
    table.commit()
    table.record(bufs["a"].nbytes)
    assert not bufs["a"].any() and table.sends == 2
    table.idle()
    table.commit()                                        # already idle: nothing sent
    assert table.sends == 2


@cpu_interpreter
def test_bytes_past_the_buffer_are_never_written():
    table, bufs, _ = _table()
    big = torch.arange(40, dtype=torch.float32).view(10, 4)   # 160 bytes into a 96-byte buffer
    _draft(table, [big, None])
    table.commit()
    table.record(bufs["a"].nbytes)
    assert torch.equal(bufs["a"].flatten(), big.flatten()[:24]) and not bufs["b"].any()


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
def test_a_staging_that_raises_midway_leaves_the_row_unsynced():
    """A changed address marks the row unsynced at once: when a later input's copy raises,
    the next call with the same new source must still send the row (else the graph copies
    from the old address)."""
    spec = every_kind_spec(16)
    st = _table_stager(spec, 4)
    gen = torch.Generator().manual_seed(3)
    first = spec.random_inputs(3, generator=gen)
    names = tuple(first)
    fn = st.bind(names, 3, 4, exact=True)
    fn(tuple(first.values()))
    _replay(st, 4)
    assert st.table.synced
    new = {**first, "x": spec.random_inputs(3, generator=gen)["x"]}   # one new address
    bad = {**new, "ids": st.buffers["ids"][1:4]}             # overlaps its buffer: copy_ refuses
    with pytest.raises(RuntimeError, match="single memory location"):
        fn(tuple(bad.values()))
    ok = {**new, "ids": torch.stack([new["ids"], new["ids"]], 1)[:, 0]}   # strided: by copy_
    fn(tuple(ok.values()))
    _replay(st, 4)
    for k in ("x", "ids", "table", "bias"):
        assert torch.equal(st.buffers[k][:3] if k != "bias" else st.buffers[k], new[k]), k


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
    fn(tuple(live.values()))
    assert st.table.words[0] == 0 and not st.table.synced     # staged here: the table idles


@cpu_interpreter
def test_eager_stage_and_pad_only_idle_the_table():
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


def _device_spec(max_bs: int = 16) -> graphrt.StepSpec:
    """Every kind of input again (float, int64 and int32 rows, offsets, a fixed bias), on the
    device of its inputs."""
    def step(x, ids, table, cu, bias, n):
        live = (torch.arange(x.shape[0], device=x.device) < n).to(x.dtype)[:, None]
        seq = (cu[1:] - cu[:-1]).to(x.dtype)[:, None]
        return (x + ids[:, None] + table.sum(-1, keepdim=True) + seq + bias[ids % 8]) * live
    inputs = {"x": graphrt.Input((None, 4), torch.float32, pad_value=-1.0),
              "ids": graphrt.Input((None,), torch.int64, high=100, pad_value=7),
              "table": graphrt.Input((None, 3), torch.int32, high=50, pad_value=49),
              "cu": graphrt.Input((None,), torch.int32, low=0, high=4, offsets=True),
              "bias": graphrt.Input((8, 4), torch.float32)}
    return graphrt.StepSpec(step, inputs, max_bs, live_count="n")


@pytest.mark.gpu
def test_graphs_stage_through_the_table_and_match_eager(cuda_device, table_mode):
    spec = _device_spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device=cuda_device, progress=False).capture()
    assert rt.stager.table is not None and rt.stager.graph_nodes[4].table is rt.stager.table
    gen = torch.Generator().manual_seed(1)
    for n in (3, 3, 9, 3, 16, 1, 4):
        live = _cuda_live(spec, n, gen, cuda_device)
        assert torch.equal(rt.run(**live), spec.call_padded(live, rt.table.pick(n), None)), n
    assert rt._steps.lookup(live, tuple(live.values()))[0].paths == {
        "x": "table", "ids": "table", "table": "table", "bias": "table", "cu": "copy_"}
    rt.check_replay()


@pytest.mark.gpu
def test_replays_queued_behind_a_sleep_each_read_their_own_row(cuda_device, table_mode):
    """Every run() is queued behind a long device sleep, so the host rewrites its row for
    every step before the first replay runs: each must still copy its own run's tensors."""
    spec = lone_and_grouped_spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device=cuda_device, progress=False).capture()
    gen = torch.Generator().manual_seed(2)
    lives = [_cuda_live(spec, n, gen, cuda_device) for n in (3, 4, 3, 2, 9) * 8]
    assert_queued_runs_read_their_own_inputs(rt, spec, lives)


@pytest.mark.gpu
def test_zero_copy_replay_bare_replays_and_strided_sources_between_table_runs(cuda_device,
                                                                             table_mode):
    spec = lone_and_grouped_spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device=cuda_device, progress=False).capture()
    gen = torch.Generator().manual_seed(3)
    first, engine = _cuda_live(spec, 3, gen, cuda_device), _cuda_live(spec, 3, gen, cuda_device)
    torch.cuda._sleep(20_000_000)          # everything below is queued before it runs
    rt.run(**first)
    bufs = rt.input_buffers(3)
    for k, v in engine.items():
        bufs[k].copy_(v)
    out = rt.replay(3).clone()
    rt.graphs[4].graph.replay()                                  # bare: stages nothing
    assert torch.equal(out, spec.call_padded(engine, 4, None))
    assert torch.equal(rt.graphs[4].outputs[0][:3], out)
    live = _cuda_live(spec, 3, gen, cuda_device)
    live["x"] = live["x"].t().contiguous().t()                   # same signature, strided
    assert torch.equal(rt.run(**live), spec.call_padded(live, 4, None))
    assert rt._steps.lookup(live, tuple(live.values()))[0].paths["x"] == "table"


@pytest.mark.gpu
def test_an_engine_handing_the_same_tensors_sends_no_row(cuda_device, table_mode):
    spec = lone_and_grouped_spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4], device=cuda_device, progress=False).capture()
    live = _cuda_live(spec, 3, torch.Generator().manual_seed(6), cuda_device)
    rt.run(**live)                                   # checked and staged eagerly
    rt.run(**live)                                   # bound: the row is sent once
    sends = rt.stager.table.sends
    assert sends == 1
    for step in range(3):
        live["x"].add_(1)                            # the engine writes its rows in place
        live["pos"].random_(0, 9)
        assert torch.equal(rt.run(**live), spec.call_padded(live, 4, None)), step
    assert rt.stager.table.sends == sends


@cpu_interpreter
def test_a_source_in_its_own_buffer_past_the_live_rows_goes_by_copy():
    """The kernel copies at replay, after staging re-pads rows past the live ones: a source
    lying in those rows of its own buffer must be copied at once (0 bytes in the row), else
    the graph would read the padding."""
    spec = lone_and_grouped_spec(16)
    st = _table_stager(spec, 16)
    gen = torch.Generator().manual_seed(2)
    st.stage(spec.random_inputs(10, generator=gen), 10, 16)   # rows [0, 10) dirty
    live = spec.random_inputs(3, generator=gen)
    live["x"] = st.buffers["x"][5:8]
    want = {k: v.clone() for k, v in live.items()}
    fn = st.bind(tuple(live), 3, 16, exact=True)
    fn(tuple(live.values()))
    x_entry = st.table.index["x"]
    assert st.table.words[2 + 2 * x_entry] == 0               # not sent through the table
    _replay(st, 16)
    assert all(torch.equal(st.buffers[k][:3], v) for k, v in want.items())
    assert st.pad_rows_intact(3, 16) == []
