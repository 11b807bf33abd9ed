"""In-graph staging (issue 17, ``graphrt.graph_staging``): each batch or fixed input is
copied by a memcpy node at the head of the graph, re-pointed per step.

CPU: the node's per-call choices (``StagingNode`` with a stand-in for
``cudaGraphExecMemcpyNodeSetParams1D`` that records its calls), and ``Stager.bind``'s wiring:
which inputs go by the node, that the node is idled before any replay whose inputs were
staged another way (zero-copy ``replay``, a subclass input, a source it cannot take). GPU
(``@pytest.mark.gpu``): the real nodes, found after capture, re-pointed between replays that
are queued back to back, against eager."""
from types import SimpleNamespace

import pytest
import torch

import graphrt
import graphrt.cudart as cudart
import graphrt.graph_staging as gs
from graphrt.cudart import CudaRuntimeError
from graphrt.replay_policy import Stager
from tests.fakes.specs import (assert_queued_runs_read_their_own_inputs, lone_and_grouped_spec, use_fake_capture)

N, PADDED = 3, 4
NAMES = ("x", "ids", "pos", "lens")


_spec = lone_and_grouped_spec


@pytest.fixture(autouse=True)
def node_mode(monkeypatch):
    """These tests are about the memcpy nodes: ``GRAPHRT_GRAPH_STAGING=1`` unless one says
    otherwise (the default is the staging table, tests/test_staging_table.py)."""
    monkeypatch.setenv("GRAPHRT_GRAPH_STAGING", "1")


@pytest.fixture
def set_params(monkeypatch):
    """The SetParams1D stand-in: records ``(dst, src, nbytes, kind)``, returns ``box.rc``, and
    (rc 0) copies the bytes at once, as the node would at the next replay."""
    import ctypes
    box = SimpleNamespace(calls=[], rc=0)

    def set1d(graph_exec, node, dst, src, nbytes, kind):
        box.calls.append((dst, src, nbytes, kind))
        if not box.rc:
            ctypes.memmove(dst, src, nbytes)
        return box.rc

    class Lib:
        def get_last_error(self):
            pass

        def error_string(self, rc):
            return b"invalid argument"
    monkeypatch.setattr(cudart, "exec_memcpy_set_fn", lambda: set1d)
    monkeypatch.setattr(cudart, "_LIB", Lib())
    monkeypatch.setattr(cudart, "_AVAILABLE", True)
    return box


def _node(name="x", rows=8):
    dst, shadow = torch.zeros(rows, 4), torch.zeros(rows, 4)
    return gs.StagingNode(name, 0x10, 0x20, dst, shadow), dst, shadow


def test_a_new_node_is_idle_and_copies_into_its_shadow(set_params):
    node, dst, shadow = _node()
    assert not node.armed
    assert set_params.calls == [(shadow.data_ptr(), dst.data_ptr(), 16, cudart.MEMCPY_D2D)]
    node.idle()                                            # idle already: no call
    assert len(set_params.calls) == 1


def test_a_contiguous_source_re_points_the_node_and_is_kept_alive(set_params):
    node, dst, _ = _node()
    src = torch.randn(N, 4)
    node.stage(src, dst[:N], src.nbytes)
    assert set_params.calls[-1] == (dst.data_ptr(), src.data_ptr(), N * 16, cudart.MEMCPY_D2D)
    assert node.armed and node._at == (src.data_ptr(), N * 16) and torch.equal(dst[:N], src)
    node.idle()
    assert not node.armed and set_params.calls[-1][0] == node.shadow.data_ptr()


def test_an_overlapping_source_idles_the_node_and_raises_what_copy_raises(set_params):
    node, dst, _ = _node()
    node.stage(torch.randn(N, 4), dst[:N], N * 16)         # armed first
    with pytest.raises(RuntimeError, match="single memory location"):
        node.stage(dst[1:N + 1], dst[:N], N * 16)
    assert not node.armed


@pytest.mark.parametrize("what", ["strided", "negative"])
def test_a_source_the_node_cannot_take_idles_it_and_goes_by_copy_(set_params, what):
    node, dst, _ = _node()
    node.stage(torch.randn(N, 4), dst[:N], N * 16)         # armed first
    src = {"strided": torch.randn(4, N).t(), "negative": torch.randn(N, 4)._neg_view()}[what]
    want = src.clone()
    before = len(set_params.calls)
    node.stage(src, dst[:N], N * 16)
    assert not node.armed and len(set_params.calls) == before + 1   # the idle edit only
    assert set_params.calls[-1][0] == node.shadow.data_ptr()
    assert torch.equal(dst[:N], want.resolve_neg())


def test_a_failed_edit_raises_a_typed_error_naming_the_input(set_params):
    node, dst, _ = _node("tokens")
    set_params.rc = 1
    with pytest.raises(CudaRuntimeError, match="staging input 'tokens'.*invalid argument"):
        node.stage(torch.randn(N, 4), dst[:N], N * 16)


def test_off_on_the_cpu_and_with_graphrt_graph_staging_0(monkeypatch):
    st = Stager(_spec(), 8, torch.device("cpu"))
    assert not gs.enabled(torch.device("cpu")) and gs.plan(st, PADDED) == []
    monkeypatch.setattr(cudart, "_AVAILABLE", True)
    monkeypatch.setenv("GRAPHRT_GRAPH_STAGING", "0")
    assert not gs.enabled(torch.device("cuda", 0))


# -- Stager wiring ----------------------------------------------------------------------------
def test_the_default_is_the_staging_table_and_takes_no_memcpy_nodes(monkeypatch):
    monkeypatch.delenv("GRAPHRT_GRAPH_STAGING", raising=False)
    monkeypatch.setattr(cudart, "_AVAILABLE", True)
    assert gs.mode() == "table" and not gs.enabled(torch.device("cuda", 0))


def test_plan_takes_lone_inputs_with_1_and_every_batch_and_fixed_one_with_all(monkeypatch):
    from tests.fakes.specs import every_kind_spec
    st = Stager(every_kind_spec(), 8, torch.device("cpu"))
    monkeypatch.setattr(gs, "enabled", lambda device: True)
    monkeypatch.setattr(cudart, "raw_copyable", lambda view: view.is_contiguous())
    assert [k for k, _, _ in gs.plan(st, PADDED)] == ["ids"]   # x and bias share float32
    monkeypatch.setenv("GRAPHRT_GRAPH_STAGING", "all")
    planned = gs.plan(st, PADDED)
    assert [k for k, _, _ in planned] == ["x", "ids", "table", "bias"]      # not "cu"
    assert all(v.shape == sh.shape == st.buffers[k].shape if k == "bias" else
               v.shape[0] == PADDED and sh.shape == st.buffers[k].shape for k, v, sh in planned)
    assert gs.plan(st, 8)[0][2] is planned[0][2]              # one shadow per input
    monkeypatch.setenv("GRAPHRT_GRAPH_STAGING", "yes")
    with pytest.raises(ValueError, match="GRAPHRT_GRAPH_STAGING: expected one of"):
        gs.mode()


def _with_nodes(st: Stager, padded_bs: int = PADDED, names=("x", "ids")) -> dict:
    """Give ``st`` staging nodes for ``names`` in graph ``padded_bs`` (stand-in edits)."""
    nodes = {k: gs.StagingNode(k, 0x10, 0x20 + i, st.buffers[k], torch.zeros_like(st.buffers[k]))
             for i, k in enumerate(names)}
    st.graph_nodes[padded_bs] = gs.GraphStaging(nodes)
    return nodes


def _live(seed: int, n: int = N) -> dict:
    return _spec().random_inputs(n, generator=torch.Generator().manual_seed(seed))


def test_bind_stages_lone_inputs_by_their_nodes_and_groups_as_before(set_params):
    st = Stager(_spec(), 8, torch.device("cpu"))
    nodes = _with_nodes(st)
    stage = st.bind(NAMES, N, PADDED, False, True)
    assert stage.paths == {"x": "graph", "ids": "graph", "pos": "foreach_copy_",
                           "lens": "foreach_copy_"}
    for seed in range(3):
        live = _live(seed)
        stage(tuple(live[k] for k in NAMES))
        assert all(torch.equal(st.buffers[k][:N], live[k]) for k in NAMES)
        assert nodes["x"]._at[0] == live["x"].data_ptr() and nodes["ids"].armed
        assert int(st.n_dev) == N and st.pad_rows_intact(N, PADDED) == []
    # another graph's call shape has no nodes: the raw/copy_ path, these nodes untouched
    assert st.bind(NAMES, N, 8, False, True).paths["x"] != "graph"


def test_a_source_in_its_own_buffer_past_the_live_rows_idles_the_node(set_params):
    """The node copies at replay, after staging re-pads the rows past the live ones: a
    source lying there (``bufs["x"][5:8]`` for 3 rows) goes by ``copy_`` at once, before the
    padding, instead of arming the node."""
    st = Stager(_spec(), 16, torch.device("cpu"))
    nodes = _with_nodes(st, 16)
    st.stage(_live(0, 10), 10, 16)                         # rows [0, 10) dirty
    stage = st.bind(NAMES, N, 16, False, True)
    first = _live(1)                                       # alive: the stand-in copies on edits
    stage(tuple(first[k] for k in NAMES))                  # arms the node (its own tensor)
    assert nodes["x"].armed
    live = {**_live(2), "x": st.buffers["x"][5:8]}
    want = {k: v.clone() for k, v in live.items()}
    stage(tuple(live[k] for k in NAMES))
    assert not nodes["x"].armed
    assert [k for k in NAMES if not torch.equal(st.buffers[k][:N], want[k])] == []
    assert st.pad_rows_intact(N, 16) == []


@pytest.mark.parametrize("names, int32_path", [
    (("x", "ids", "pos", "lens"), None),                   # every input: the count by fill_
    (("x", "pos"), "foreach_copy_"),                       # lens + the count stay a group
    (("x", "pos", "lens"), None)])                          # only the count left: fill_
def test_nodes_for_grouped_inputs_leave_the_rest_of_their_group(set_params, names, int32_path):
    st, ref = Stager(_spec(), 8, torch.device("cpu")), Stager(_spec(), 8, torch.device("cpu"))
    _with_nodes(st, names=names)
    stage, ref_stage = st.bind(NAMES, N, PADDED, False, True), ref.bind(NAMES, N, PADDED, False)
    assert {k: p for k, p in stage.paths.items() if k in names} == {k: "graph" for k in names}
    assert stage.paths.get("lens", None) == ("graph" if "lens" in names else int32_path)
    for seed in range(3):
        live = _live(seed, N)
        vals = tuple(live[k] for k in NAMES)
        stage(vals)
        ref_stage(vals)
        assert all(torch.equal(st.buffers[k], ref.buffers[k]) for k in NAMES)
        assert int(st.n_dev) == N and st.pad_rows_intact(N, PADDED) == []


def test_a_source_where_the_node_already_copies_from_needs_no_edit(set_params):
    st = Stager(_spec(), 8, torch.device("cpu"))
    _with_nodes(st)
    stage = st.bind(NAMES, N, PADDED, False, True)
    live = _live(0)
    vals = tuple(live[k] for k in NAMES)
    stage(vals)
    edits = len(set_params.calls)
    live["x"].add_(1)                                      # the engine rewrites its own tensors
    stage(vals)
    assert len(set_params.calls) == edits                  # (the node copies at replay)
    stage(tuple(_live(1)[k] for k in NAMES))               # new tensors: one edit each
    assert len(set_params.calls) == edits + 2


def test_a_subclass_call_shape_idles_the_nodes_and_copies(set_params):
    class Sub(torch.Tensor):
        pass
    st = Stager(_spec(), 8, torch.device("cpu"))
    nodes = _with_nodes(st)
    live = _live(0)
    st.bind(NAMES, N, PADDED, False, True)(tuple(live[k] for k in NAMES))
    assert nodes["x"].armed
    live = _live(1)
    live["x"] = live["x"].as_subclass(Sub)
    stage = st.bind(NAMES, N, PADDED, False, False)
    assert stage.paths["x"] == "copy_"
    stage(tuple(live[k] for k in NAMES))
    assert not nodes["x"].armed and not nodes["ids"].armed
    assert torch.equal(st.buffers["x"][:N], live["x"].as_subclass(torch.Tensor))


def test_zero_copy_replay_idles_the_nodes_of_its_graph_only(set_params):
    st = Stager(_spec(), 8, torch.device("cpu"))
    nodes, other = _with_nodes(st), _with_nodes(Stager(_spec(), 8, torch.device("cpu")), 8)
    st.graph_nodes[8] = gs.GraphStaging(other)
    live = _live(0)
    st.bind(NAMES, N, PADDED, False, True)(tuple(live[k] for k in NAMES))
    other["x"].armed = True                                 # pretend graph 8 is armed too
    st.pad_only(N, PADDED)
    assert not nodes["x"].armed and not nodes["ids"].armed and other["x"].armed
    st.reset_graph_staging()
    assert st.graph_nodes == {} and st.bind(NAMES, N, PADDED, False, True).paths["x"] != "graph"


def test_the_runtime_steady_state_stages_by_the_nodes(set_params, monkeypatch):
    """The fake capture makes no nodes; given some, run() re-points them and replay() idles
    them, and the outputs are what eager computes."""
    use_fake_capture(monkeypatch)
    spec = _spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device="cpu", copy_outputs=False,
                              progress=False).capture()
    nodes = _with_nodes(rt.stager)
    for seed in range(3):
        live = spec.random_inputs(N, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(rt.run(**live), spec.call_padded(live, 4, None))
        assert nodes["x"].armed and nodes["x"]._at[0] == live["x"].data_ptr()
    stage = rt._steps.lookup(live, tuple(live.values()))[0]
    assert stage.paths["x"] == "graph"
    bufs = rt.input_buffers(N)
    for k, v in live.items():
        bufs[k].copy_(v)
    assert torch.equal(rt.replay(N), spec.call_padded(live, 4, None))
    assert not nodes["x"].armed


# -- on a GPU ----------------------------------------------------------------------------------
def _cuda_live(spec, n: int, gen, device) -> dict:
    return {k: v.to(device) for k, v in spec.random_inputs(n, generator=gen).items()}


@pytest.mark.gpu
def test_the_nodes_are_found_and_replays_match_eager(cuda_device):
    spec = _spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device=cuda_device, progress=False).capture()
    assert sorted(rt.stager.graph_nodes) == [4, 16]
    assert all(sorted(g.nodes) == ["ids", "x"] and not any(nd.armed for nd in g.nodes.values())
               for g in rt.stager.graph_nodes.values())
    gen = torch.Generator().manual_seed(1)
    for n in (3, 3, 9, 3, 16, 1, 4):
        live = _cuda_live(spec, n, gen, cuda_device)
        assert torch.equal(rt.run(**live), spec.call_padded(live, rt.table.pick(n), None)), n
    stage = rt._steps.lookup(live, tuple(live.values()))[0]
    assert stage.paths == {"x": "graph", "ids": "graph", "pos": "foreach_copy_",
                           "lens": "foreach_copy_"}
    assert rt.stager.graph_nodes[4].nodes["x"]._at[0] == live["x"].data_ptr()


@pytest.mark.gpu
def test_graphrt_graph_staging_all_stages_every_input_in_the_graph(cuda_device, monkeypatch):
    monkeypatch.setenv("GRAPHRT_GRAPH_STAGING", "all")
    spec = _spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device=cuda_device, progress=False).capture()
    assert sorted(rt.stager.graph_nodes[4].nodes) == sorted(NAMES)
    gen = torch.Generator().manual_seed(7)
    for n in (3, 3, 9, 1, 16):
        live = _cuda_live(spec, n, gen, cuda_device)
        assert torch.equal(rt.run(**live), spec.call_padded(live, rt.table.pick(n), None)), n
    assert rt._steps.lookup(live, tuple(live.values()))[0].paths == {k: "graph" for k in NAMES}


@pytest.mark.gpu
def test_offsets_inputs_are_staged_before_the_graph_and_padded_right(cuda_device):
    inputs = {"x": graphrt.Input((None, 4), torch.float32, pad_value=0.0),
              "cu": graphrt.Input((None,), torch.int32, low=0, high=5, offsets=True),
              "ids": graphrt.Input((None,), torch.int64, high=50, pad_value=0)}

    def step(x, cu, ids, n):
        return x * (cu[1:] - cu[:-1]).to(x.dtype)[:, None] + ids[:, None] + cu[-1]
    spec = graphrt.StepSpec(step, inputs, 16, live_count="n")
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device=cuda_device, progress=False).capture()
    assert sorted(rt.stager.graph_nodes[16].nodes) == ["ids", "x"]
    gen = torch.Generator().manual_seed(5)
    for n in (3, 9, 2, 9, 16):
        live = _cuda_live(spec, n, gen, cuda_device)
        assert torch.equal(rt.run(**live), spec.call_padded(live, rt.table.pick(n), None)), n


@pytest.mark.gpu
def test_an_engine_handing_the_same_tensors_stages_with_no_edit(cuda_device, monkeypatch):
    spec = _spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4], device=cuda_device, progress=False).capture()
    live = _cuda_live(spec, N, torch.Generator().manual_seed(6), cuda_device)
    rt.run(**live)
    edits, real = [], cudart.exec_memcpy_set_fn()
    for node in rt.stager.graph_nodes[4].nodes.values():
        node._set = lambda *a, _real=real: edits.append(a) or _real(*a)
    for step in range(3):
        live["x"].add_(1)                            # the engine writes its rows in place
        live["ids"].random_(0, 50)
        assert torch.equal(rt.run(**live), spec.call_padded(live, 4, None)), step
    assert edits == []


@pytest.mark.gpu
def test_replays_queued_back_to_back_each_read_their_own_source(cuda_device):
    """Every run() is queued behind a long device sleep, so all edits happen before the first
    replay executes: each replay must still copy the tensor its own run() was given."""
    spec = _spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device=cuda_device, progress=False).capture()
    gen = torch.Generator().manual_seed(2)
    lives = [_cuda_live(spec, n, gen, cuda_device) for n in (3, 4, 3, 2, 3)]
    assert_queued_runs_read_their_own_inputs(rt, spec, lives)


@pytest.mark.gpu
def test_zero_copy_replay_and_strided_sources_after_an_armed_node(cuda_device):
    spec = _spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device=cuda_device, progress=False).capture()
    gen = torch.Generator().manual_seed(3)
    first, engine = _cuda_live(spec, N, gen, cuda_device), _cuda_live(spec, N, gen, cuda_device)
    rt.run(**first)
    bufs = rt.input_buffers(N)                 # the engine writes its rows in place
    for k, v in engine.items():
        bufs[k].copy_(v)
    assert torch.equal(rt.replay(N), spec.call_padded(engine, 4, None))
    node = rt.stager.graph_nodes[4].nodes["x"]
    assert not node.armed
    live = _cuda_live(spec, N, gen, cuda_device)
    live["x"] = live["x"].t().contiguous().t()                   # same signature, strided
    assert torch.equal(rt.run(**live), spec.call_padded(live, 4, None))
    assert not node.armed and rt.stager.graph_nodes[4].nodes["ids"].armed


@pytest.mark.gpu
def test_graphrt_graph_staging_0_captures_without_nodes(cuda_device, monkeypatch):
    monkeypatch.setenv("GRAPHRT_GRAPH_STAGING", "0")
    spec = _spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4], device=cuda_device, progress=False).capture()
    assert rt.stager.graph_nodes == {}
    live = _cuda_live(spec, N, torch.Generator().manual_seed(4), cuda_device)
    assert torch.equal(rt.run(**live), spec.call_padded(live, 4, None))
    assert rt._steps.lookup(live, tuple(live.values()))[0].paths["x"] == "memcpy"
