"""CPU tests of the DeepEP v2 (``ElasticBuffer``) and V2.5 (``EPBuffer``) backends.

Both libraries cannot load on our machines, so the backends run against the faithful fake of
their documented API in ``tests/fakes/deep_ep_v2.py`` and are compared with ``LocalComm``
(EP=1, Triton kernels under the interpreter) on the same tokens and expert function.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

import pytest
import torch

import graphrt
from fakes import deep_ep_v2 as fake
from fakes.deep_ep_v2 import FakeElasticBuffer, FakeEPBuffer, FakeWorld
from graphrt.capture.audit import ReceiverLedger
from graphrt.comm.deepep_v2 import DeepEPUnavailable, DeepEPUsageError, DeepEPV2Comm
from graphrt.comm.deepep_v25 import DeepEPV25Comm
from graphrt.comm.local import LocalComm

E, H, K, MAX_TOKENS = 8, 64, 2, 16
BACKENDS = [pytest.param(DeepEPV2Comm, FakeElasticBuffer, id="v2"),
            pytest.param(DeepEPV25Comm, FakeEPBuffer, id="v25")]


def make_comm(comm_cls, buf_cls, *, group=None, max_tokens=MAX_TOKENS, num_experts=E, **kw):
    buf = buf_cls(group, num_max_tokens_per_rank=max_tokens, hidden=H, num_topk=K)
    return comm_cls(num_experts, H, K, "cpu", max_tokens=max_tokens, buffer=buf, **kw), buf


def routed(bs, n_live, seed, num_experts=E):
    """x bf16 [bs, H], distinct expert ids per live row (-1 on padding), weights (0 on padding)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bs, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:K] for _ in range(bs)])
    w = torch.rand(bs, K, generator=g)
    ids[n_live:], w[n_live:] = -1, 0.0
    return x, ids, w, torch.tensor([n_live], dtype=torch.int32)


def experts(recv_x, first_expert=0):
    """y[e] = recv_x[e] * (global expert id + 1), on the masked layout."""
    scale = torch.arange(first_expert + 1, first_expert + recv_x.shape[0] + 1).float()
    return (recv_x.float() * scale[:, None, None]).to(torch.bfloat16)


def expanded_reference(x, ids, w):
    """What a DeepEP expanded-layout combine gives: each row weighted and rounded to bf16, then
    summed in fp32 in top-k order (one more bf16 rounding than LocalComm's weighted sum)."""
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(ids.shape[1]):
        live = ids[:, k] >= 0
        y = (x.float() * (ids[:, k].clamp(min=0) + 1)[:, None].float()).to(torch.bfloat16)
        row = (y.float() * w[:, k:k + 1]).to(torch.bfloat16).float()
        acc += torch.where(live[:, None], row, torch.zeros(()))
    return acc.to(torch.bfloat16)


def local_result(x, ids, w, n):
    local = LocalComm(E, H, K, "cpu", max_tokens=MAX_TOKENS)
    d = local.dispatch(x, ids, n)
    return local.combine(experts(d.recv_x), ids, w, d, n, out=torch.empty_like(x)), d


def token_rows(recv, masked_m, x):
    """Per expert, the sorted token index of every live row (rows matched to x exactly)."""
    out = []
    for e in range(recv.shape[0]):
        rows = recv[e, :int(masked_m[e])]
        out.append(sorted(int((rows[i] == x).all(-1).nonzero()[0]) for i in range(rows.shape[0])))
    return out


# ---- (1) dispatch -> experts -> combine equals LocalComm -----------------------------------
@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
@pytest.mark.parametrize("alignment", [1, 4])
def test_round_trip_matches_local_comm(comm_cls, buf_cls, alignment):
    x, ids, w, n = routed(12, 9, seed=alignment)
    comm, buf = make_comm(comm_cls, buf_cls, expert_alignment=alignment)
    d = comm.dispatch(x, ids, n, topk_weights=w)
    ref, dl = local_result(x, ids, w, n)
    assert d.recv_x.shape == dl.recv_x.shape and d.masked_m.dtype == torch.int32
    assert torch.equal(d.masked_m, dl.masked_m) and d.expected_m == dl.expected_m
    assert int(d.masked_m.sum()) == 9 * K                   # padded rows (id -1) create no rows
    assert token_rows(d.recv_x, d.masked_m, x) == token_rows(dl.recv_x, dl.masked_m, x)
    out = comm.combine(experts(d.recv_x), ids, w, d, n, out=torch.empty_like(x))
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(out, expanded_reference(x, ids, w))  # exact, given DeepEP's extra rounding
    assert (out[9:] == 0).all()
    disp = buf.calls[0]
    assert disp["op"] == "dispatch" and disp["do_expand"] and disp["do_cpu_sync"] is False
    assert disp["topk_weights_given"] and disp["expert_alignment"] == alignment
    assert disp["num_max_tokens_per_rank"] == MAX_TOKENS
    v25 = comm_cls is DeepEPV25Comm   # V2.5: deferred copy epilogue, handle keeps topk_idx by reference
    assert disp["defer_epilogue"] is v25 and disp["async_with_compute_stream"] is v25
    assert disp["do_handle_copy"] is not v25 and disp["event"].num_hook_runs == int(v25)
    assert buf.calls[1]["op"] == "combine" and not buf.calls[1]["topk_weights_given"]


# ---- (2) the join is deferred to the receiver -----------------------------------------------
@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
def test_join_is_deferred_to_the_receiver(comm_cls, buf_cls):
    x, ids, w, n = routed(10, 7, seed=3)
    comm, buf = make_comm(comm_cls, buf_cls)
    d = comm.dispatch(x, ids, n, topk_weights=w)
    y = experts(d.recv_x)
    sync_out = comm.combine(y, ids, w, d, n, out=torch.empty_like(x))
    out = torch.full_like(x, float("nan"))                  # poisoned
    recv = comm.combine_async(y, ids, w, d, n, out=out)
    call = buf.calls[-1]
    assert call["op"] == "combine" and call["async_with_compute_stream"] and call["allocate_on_comm_stream"]
    assert call["defer_epilogue"] is (comm_cls is DeepEPV25Comm)
    ev = call["event"]
    assert not ev.event.waited and ev.num_hook_runs == 0    # nothing joined yet
    assert torch.isnan(out).all()                           # the output buffer is untouched
    assert recv() is out
    assert ev.event.waited and torch.equal(out, sync_out)
    if comm_cls is DeepEPV25Comm:                           # the first wait produced the result
        assert ev.num_hook_runs == 1 and ev.wait() is None and ev.num_hook_runs == 1
    with pytest.raises(Exception, match="already called"):
        recv()


def test_fake_is_falsifiable():
    """Reading an async result before the wait sees NaN; a deferred epilogue runs only once."""
    x, ids, w, n = routed(6, 6, seed=4)
    for buf_cls, kw in ((FakeElasticBuffer, {}), (FakeEPBuffer, {"defer_epilogue": False})):
        buf = buf_cls(None, num_max_tokens_per_rank=8, hidden=H, num_topk=K)
        recv_x, idx, recv_w, h, _ = buf.dispatch(x, topk_idx=ids, topk_weights=w, num_experts=E,
                                                 do_cpu_sync=False, do_expand=True, **kw)
        assert idx is None and recv_w.dim() == 1 and recv_x.shape[0] == recv_w.shape[0]
        assert h.psum_num_recv_tokens_per_expert.dtype == torch.int32
        early, _, ev = buf.combine(recv_x.clone(), handle=h, async_with_compute_stream=True,
                                   allocate_on_comm_stream=True)
        assert torch.isnan(early).all()
        ev.current_stream_wait()
        assert not torch.isnan(early).any()
        with pytest.raises(AssertionError, match="no topk_weights"):
            buf.combine(recv_x, handle=h, topk_weights=recv_w)
    buf = FakeEPBuffer(None, num_max_tokens_per_rank=8, hidden=H, num_topk=K)
    ev = buf.dispatch(x, topk_idx=ids, topk_weights=w, num_experts=E, do_cpu_sync=False,
                      do_expand=True, async_with_compute_stream=True, defer_epilogue=True)
    assert isinstance(ev, fake.FakeEventOverlap) and ev.num_hook_runs == 0
    recv_x, _, _, h = ev.wait()
    assert ev.wait() is None and ev.num_hook_runs == 1
    with pytest.raises(AssertionError, match="requires async_with_compute_stream"):
        buf.combine(recv_x, handle=h, defer_epilogue=True)
    with pytest.raises(AssertionError, match="do_handle_copy"):
        buf.dispatch(x, topk_idx=ids, topk_weights=w, num_experts=E, do_expand=True, do_handle_copy=True)


# ---- (3) sync_combine falls back to a synchronous combine ----------------------------------
@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
@pytest.mark.parametrize("how", ["constructor", "per_call"])
def test_sync_combine_fallback(comm_cls, buf_cls, how):
    x, ids, w, n = routed(8, 8, seed=5)
    comm, buf = make_comm(comm_cls, buf_cls, sync_combine=how == "constructor")
    d = comm.dispatch(x, ids, n, topk_weights=w)
    out = torch.full_like(x, float("nan"))
    kw = {"sync": True} if how == "per_call" else {}
    recv = comm.combine_async(experts(d.recv_x), ids, w, d, n, out=out, **kw)
    call = buf.calls[-1]
    assert call["op"] == "combine" and call["async_with_compute_stream"] is False
    assert call["defer_epilogue"] is False and call["event"].event is None
    assert torch.equal(out, expanded_reference(x, ids, w))  # correct before the receiver runs
    assert recv() is out


# ---- (4) the synchronous path copies in place ----------------------------------------------
@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
def test_sync_combine_copies_in_place(comm_cls, buf_cls):
    x, ids, w, n = routed(5, 4, seed=6)
    comm, buf = make_comm(comm_cls, buf_cls)
    d = comm.dispatch(x, ids, n, topk_weights=w)
    out = torch.full_like(x, float("nan"))
    ptr = out.data_ptr()
    assert comm.combine(experts(d.recv_x), ids, w, d, n, out=out) is out
    assert out.data_ptr() == ptr and torch.equal(out, expanded_reference(x, ids, w))
    assert buf.calls[-1]["async_with_compute_stream"] is False


# ---- (5) receivers register with the capture audit -----------------------------------------
@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
def test_receivers_register_with_the_ledger(comm_cls, buf_cls):
    x, ids, w, n = routed(6, 6, seed=7)
    comm, buf = make_comm(comm_cls, buf_cls)
    with ReceiverLedger() as ledger:
        d = comm.dispatch(x, ids, n, topk_weights=w)
        comm.combine_async(experts(d.recv_x), ids, w, d, n, out=torch.empty_like(x))()
        assert ledger.unjoined() == []
        d = comm.dispatch(x, ids, n, topk_weights=w)
        pending = comm.combine_async(experts(d.recv_x), ids, w, d, n, out=torch.empty_like(x))
        findings = ledger.unjoined()
        assert [f.kind for f in findings] == ["unjoined-receiver"]
        assert any(obj is buf.calls[-1]["event"] for obj in ledger.keepalive)  # kept for the graph
        with pytest.raises(DeepEPUsageError, match="never called"):  # one combine in flight
            comm.combine_async(experts(d.recv_x), ids, w, d, n, out=torch.empty_like(x))
        pending()
        assert ledger.unjoined() == []


# ---- (6) errors ----------------------------------------------------------------------------
@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
def test_usage_errors(comm_cls, buf_cls, monkeypatch):
    comm, _ = make_comm(comm_cls, buf_cls, max_tokens=4)
    x, ids, w, n = routed(5, 5, seed=8)
    with pytest.raises(graphrt.InputError, match="5 tokens exceed max_tokens=4") as info:
        comm.dispatch(x, ids, n, topk_weights=w)  # an argument check: an InputError like all
    assert isinstance(info.value, DeepEPUsageError)
    x, ids, w, n = routed(4, 4, seed=8)
    with pytest.raises(DeepEPUsageError, match="needs topk_weights="):
        comm.dispatch(x, ids, n)
    with pytest.raises(DeepEPUsageError, match="expected x"):
        comm.dispatch(x.float(), ids, n, topk_weights=w)

    def build(num_experts=E, hidden=H, num_topk=K, **kw):
        return comm_cls(num_experts, hidden, num_topk, "cpu", max_tokens=4,
                        buffer=buf_cls(None, num_max_tokens_per_rank=4, hidden=H, num_topk=K), **kw)
    for bad, match in [(dict(hidden=100), "multiple of 16"), (dict(num_topk=33), r"\[1, 32\]"),
                       (dict(num_experts=4096), "<= 2048"), (dict(dtype=torch.float16), "bf16")]:
        with pytest.raises(DeepEPUsageError, match=match):
            build(**bad)
    with pytest.raises(DeepEPUsageError, match="num_max_tokens_per_rank >= 8"):
        comm_cls(E, H, K, "cpu", max_tokens=8,
                 buffer=buf_cls(None, num_max_tokens_per_rank=4, hidden=H, num_topk=K))
    with pytest.raises(DeepEPUsageError, match="multiple of num_ranks"):
        comm_cls(7, H, K, "cpu", max_tokens=4,
                 buffer=buf_cls(FakeWorld(2).group(0), num_max_tokens_per_rank=4, hidden=H))
    # do_cpu_sync=True (exact-size outputs) works eagerly, and is refused while a CUDA stream
    # captures (simulated on CPU)
    dbg, dbg_buf = make_comm(comm_cls, buf_cls, max_tokens=4, do_cpu_sync=True)
    d = dbg.dispatch(x, ids, n, topk_weights=w)
    assert dbg_buf.calls[-1]["do_cpu_sync"] is True
    out = dbg.combine(experts(d.recv_x), ids, w, d, n, out=torch.empty_like(x))
    assert torch.equal(out, expanded_reference(x, ids, w))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(DeepEPUsageError, match="do_cpu_sync=True"):
        dbg.dispatch(x, ids, n, topk_weights=w)
    d = comm.dispatch(x, ids, n, topk_weights=w)           # do_cpu_sync=False captures fine
    assert d.recv_x.shape[1] == comm.cap_for(4)


@pytest.mark.parametrize("comm_cls,name,requirement", [(DeepEPV2Comm, "ElasticBuffer", "NCCL >= 2.29"),
                                                       (DeepEPV25Comm, "EPBuffer", "NCCL >= 2.32.3")])
def test_missing_deep_ep_is_a_clear_error(comm_cls, name, requirement, monkeypatch):
    old = types.ModuleType("deep_ep")
    old.__version__, old.Buffer = "1.2.1", object
    monkeypatch.setitem(sys.modules, "deep_ep", old)
    with pytest.raises(DeepEPUnavailable, match=f"has no {name}.*{requirement}") as e:
        comm_cls(E, H, K, "cpu", max_tokens=4, group=FakeWorld(1).group(0))
    assert isinstance(e.value, ImportError)
    monkeypatch.setitem(sys.modules, "deep_ep", None)       # not installed
    with pytest.raises(DeepEPUnavailable, match=f"cannot import deep_ep.*{requirement}"):
        comm_cls(E, H, K, "cpu", max_tokens=4, group=FakeWorld(1).group(0))


@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
def test_builds_the_buffer_through_deep_ep(comm_cls, buf_cls, monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    monkeypatch.delenv("EP_AVOID_RECORD_STREAM", raising=False)
    comm = comm_cls(E, H, K, "cpu", max_tokens=4, group=FakeWorld(1).group(0),
                    buffer_kwargs={"allow_hybrid_mode": False})
    assert type(comm.buffer) is buf_cls and os.environ["EP_AVOID_RECORD_STREAM"] == "1"
    assert (comm.buffer.num_max_tokens_per_rank, comm.buffer.hidden, comm.buffer.num_topk) == (4, H, K)


def test_importing_graphrt_never_imports_deep_ep():
    code = ("import sys, graphrt, graphrt.comm, graphrt.comm.deepep_v2, graphrt.comm.deepep_v25; "
            "assert 'deep_ep' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- several ranks in one process ----------------------------------------------------------
@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
def test_two_ranks_with_different_batches_match_local_comm(comm_cls, buf_cls):
    R, E_local, max_tokens = 2, E // 2, 8
    world = FakeWorld(R, timeout=30)
    comms = [make_comm(comm_cls, buf_cls, group=world.group(r), max_tokens=max_tokens)[0] for r in range(R)]
    inputs = [routed(6, 5, seed=10), routed(3, 3, seed=11)]   # ranks replay different sizes
    results, errors = [None] * R, []

    def rank_main(r):
        try:
            comm, (x, ids, w, n) = comms[r], inputs[r]
            d = comm.dispatch(x, ids, n, topk_weights=w)
            recv = comm.combine_async(experts(d.recv_x, first_expert=r * E_local), ids, w, d, n,
                                      out=torch.empty_like(x))
            results[r] = (d.masked_m.clone(), recv().clone())
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            world.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    all_ids = torch.cat([ids for _, ids, _, _ in inputs])
    for r, (x, ids, w, n) in enumerate(inputs):
        masked_m, out = results[r]
        assert comms[r].num_local_experts == E_local and comms[r].cap_for(1) == 64
        want = torch.stack([(all_ids == r * E_local + e).sum() for e in range(E_local)]).int()
        assert torch.equal(masked_m, want)
        assert torch.equal(out, expanded_reference(x, ids, w))
        ref, _ = local_result(x, ids, w, n)
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


# ---- the reference model -------------------------------------------------------------------
def _model(comm_cls, buf_cls, **comm_kw):
    from graphrt.moe import MoEModel, preset
    cfg = preset("tiny")
    buf = buf_cls(None, num_max_tokens_per_rank=cfg.num_slots, hidden=cfg.hidden, num_topk=cfg.num_topk)
    comm = comm_cls(cfg.num_experts, cfg.hidden, cfg.num_topk, "cpu", max_tokens=cfg.num_slots,
                    buffer=buf, **comm_kw)
    return MoEModel(cfg, "cpu", comm=comm, backend="triton", seed=0), comm


@pytest.fixture(scope="module")
def local_logits():
    """The same model (same seed) with LocalComm; overlap on/off agree bitwise (test_moe_cpu)."""
    from graphrt.moe import MoEModel, preset
    return _step(MoEModel(preset("tiny"), "cpu", backend="triton", seed=0))


def _step(model, bs=5):
    spec = model.spec(8)
    inputs = spec.random_inputs(bs, "cpu", torch.Generator().manual_seed(0))
    return spec.call(inputs)["logits"]


def _assert_close_logits(a, b):
    rel = (a.float() - b.float()).norm() / b.float().norm()
    assert rel < 2e-2, rel


@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
def test_model_step_matches_local_comm(comm_cls, buf_cls, local_logits):
    model, _ = _model(comm_cls, buf_cls)
    _assert_close_logits(_step(model), local_logits)


@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
@pytest.mark.parametrize("overlap,sync_combine", [(True, False), (False, False), (True, True)])
def test_model_step_overlap_and_sync_fallback(comm_cls, buf_cls, overlap, sync_combine,
                                              local_logits):
    model, comm = _model(comm_cls, buf_cls, sync_combine=sync_combine)
    model.overlap = overlap
    _assert_close_logits(_step(model), local_logits)
    assert all(int(layer.moe.last_masked_m.sum()) == 5 * model.cfg.num_topk for layer in model.layers)
    combines = [c for c in comm.buffer.calls if c["op"] == "combine"]
    assert len(combines) == model.cfg.num_layers
    assert all(c["async_with_compute_stream"] is (overlap and not sync_combine) for c in combines)


@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
def test_model_step_is_graph_safe_outside_the_fake(comm_cls, buf_cls):
    """The backend's own ops (index maps, gathers, weighting) are sync-free with fixed shapes;
    the only findings come from the fake, which stands in for DeepEP's device kernels."""
    from graphrt.capture import analyze_step
    model, comm = _model(comm_cls, buf_cls)
    findings = analyze_step(model.spec(8), [3], "cpu").findings
    assert findings and all("/tests/fakes/" in f.file for f in findings), findings


# ---- (7) one combine in flight, whatever path the next one takes ---------------------------
@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
def test_a_synchronous_combine_is_refused_while_an_async_one_reads_the_buffer(comm_cls, buf_cls):
    """combine() rewrites the expanded buffer an uncalled combine_async still reads: refused
    (it returned micro-batch A wrong, no error), and A comes back right once called."""
    comm, _ = make_comm(comm_cls, buf_cls)
    xa, ia, wa, n = routed(4, 4, seed=11)
    xb, ib, wb, _ = routed(4, 4, seed=12)
    da = comm.dispatch(xa, ia, n, topk_weights=wa)
    ra = comm.combine_async(experts(da.recv_x), ia, wa, da, n, out=torch.empty_like(xa))
    db = comm.dispatch(xb, ib, n, topk_weights=wb)
    with pytest.raises(DeepEPUsageError, match="never called"):
        comm.combine(experts(db.recv_x), ib, wb, db, n, out=torch.empty_like(xb))
    with pytest.raises(DeepEPUsageError, match="never called"):
        comm.combine_async(experts(db.recv_x), ib, wb, db, n, out=torch.empty_like(xb), sync=True)
    assert torch.equal(ra(), expanded_reference(xa, ia, wa))
    out = comm.combine(experts(db.recv_x), ib, wb, db, n, out=torch.empty_like(xb))
    assert torch.equal(out, expanded_reference(xb, ib, wb))


@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
def test_a_receiver_dropped_uncalled_still_holds_the_buffer(comm_cls, buf_cls):
    """Dropping the receiver does not end its combine (the guard held a weak reference and
    let the next combine in); the comm keeps it, and calling it releases the buffer."""
    comm, buf = make_comm(comm_cls, buf_cls)
    x, ids, w, n = routed(4, 4, seed=13)
    d = comm.dispatch(x, ids, n, topk_weights=w)
    comm.combine_async(experts(d.recv_x), ids, w, d, n, out=torch.empty_like(x))  # dropped
    d = comm.dispatch(x, ids, n, topk_weights=w)
    with pytest.raises(DeepEPUsageError, match="comm.pending_receiver"):
        comm.combine_async(experts(d.recv_x), ids, w, d, n, out=torch.empty_like(x))
    assert torch.equal(comm.pending_receiver(), expanded_reference(x, ids, w))
    comm.combine_async(experts(d.recv_x), ids, w, d, n, out=torch.empty_like(x))()


class _MoreRows(FakeElasticBuffer):
    """A DeepEP build whose worst case is 10 rows over the documented one (NaN rows at the
    end): the case dispatch()'s re-reservation exists for."""

    def dispatch(self, *a, **kw):
        recv_x, idx, recv_w, h, ev = super().dispatch(*a, **kw)
        recv_x = torch.cat([recv_x, torch.full((10, recv_x.shape[1]), float("nan"),
                                               dtype=recv_x.dtype)])
        recv_w = torch.cat([recv_w, torch.full((10,), float("nan"))])
        h.num_expanded_tokens = recv_x.shape[0]
        return recv_x, idx, recv_w, h, ev


def test_more_rows_than_reserved_keeps_every_size_in_place():
    """After a small step re-reserved for DeepEP's extra rows, the row index was as long as
    that step's cap, and the largest size's rows landed shifted (18 NaN rows in expert 1)."""
    mt = 100
    buf = _MoreRows(None, num_max_tokens_per_rank=mt, hidden=H, num_topk=1, shuffle_seed=None)
    comm = DeepEPV2Comm(E, H, 1, "cpu", max_tokens=mt, buffer=buf)

    def batch(bs):
        x = torch.randn(bs, H, generator=torch.Generator().manual_seed(bs)).to(torch.bfloat16)
        ids = torch.ones(bs, 1, dtype=torch.int64)  # every token to expert 1
        return x, ids, torch.ones(bs, 1), torch.tensor([bs], dtype=torch.int32)

    x, ids, w, n = batch(10)
    comm.dispatch(x, ids, n, topk_weights=w)
    x, ids, w, n = batch(mt)
    d = comm.dispatch(x, ids, n, topk_weights=w)
    assert int(d.masked_m[1]) == mt and torch.equal(d.recv_x[1, :mt], x)


def test_an_unjoined_receiver_is_a_finding_not_a_crash_of_the_analysis():
    """The analysis runs the step twice: the first run's uncalled receiver held the comm, and
    the second run's combine raised DeepEPUsageError; the ledger now joins what it reported."""
    import graphrt
    from graphrt.capture.safety import analyze_step
    comm, _ = make_comm(DeepEPV2Comm, FakeElasticBuffer)
    out = torch.empty(MAX_TOKENS, H, dtype=torch.bfloat16)

    def step(x, ids, w):
        n = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
        d = comm.dispatch(x, ids, n, topk_weights=w)
        comm.combine_async(experts(d.recv_x), ids, w, d, n, out=out[: x.shape[0]])  # never called
        return out[: x.shape[0]] * 1
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, H), torch.bfloat16),
                                   "ids": graphrt.Input((None, K), torch.int64, high=E),
                                   "w": graphrt.Input((None, K), torch.float32)}, MAX_TOKENS)
    report = analyze_step(spec, [4], "cpu")  # (the CPU fake itself is not sync-free)
    unjoined = [f for f in report.findings if f.kind == "unjoined-receiver"]
    assert len(unjoined) == 1 and unjoined[0].file == __file__, report.table()
    assert comm.pending_receiver.called


# ---- (8) a wrong out= or a failed join loses nothing: the next good step works ------------
@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
@pytest.mark.parametrize("how", ["combine", "combine_async", "sync"])
def test_a_wrong_out_is_an_input_error_before_the_combine_starts(comm_cls, buf_cls, how):
    """out= was not checked: a wrong one failed inside the receiver with torch's RuntimeError,
    the receiver stayed pending, and every later combine raised "never called"."""
    from graphrt.errors import InputError, InputTypeError
    comm, buf = make_comm(comm_cls, buf_cls)
    x, ids, w, n = routed(4, 4, seed=14)

    def call(out):
        d = comm.dispatch(x, ids, n, topk_weights=w)
        if how == "combine":
            return comm.combine(experts(d.recv_x), ids, w, d, n, out=out)
        recv = comm.combine_async(experts(d.recv_x), ids, w, d, n, out=out, sync=how == "sync")
        return recv()
    for bad, match in [(torch.empty(5, H, dtype=torch.bfloat16), r"\[5, 64\]"),
                       (torch.empty(4, H), "torch.float32"),
                       (torch.empty(4, H, dtype=torch.bfloat16, device="meta"), "on meta")]:
        combines = len([c for c in buf.calls if c.get("op") == "combine"])
        with pytest.raises(InputError, match=rf"out= must be torch.bfloat16 \[4, 64\] on cpu.*{match}"):
            call(bad)
        assert comm.pending_receiver is None
        assert len([c for c in buf.calls if c.get("op") == "combine"]) == combines  # none started
    with pytest.raises(InputTypeError, match="out= must be"):
        call([[0.0] * H] * 4)
    assert torch.equal(call(torch.empty_like(x)), expanded_reference(x, ids, w))  # next one works


@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
def test_a_receiver_whose_join_raised_does_not_hold_the_comm(comm_cls, buf_cls, monkeypatch):
    """The comm held a receiver whose join raised as pending forever: every later combine was
    refused ("never called"). Now its error goes up with a note and the next step runs."""
    comm, _ = make_comm(comm_cls, buf_cls)
    x, ids, w, n = routed(4, 4, seed=15)
    start = comm._combine_start

    def failing_start(y_exp, handle, out):
        join, keep = start(y_exp, handle, out)

        def join_then_fail():
            join()
            raise RuntimeError("the receive hook failed")
        return join_then_fail, keep
    monkeypatch.setattr(comm, "_combine_start", failing_start)
    d = comm.dispatch(x, ids, n, topk_weights=w)
    recv = comm.combine_async(experts(d.recv_x), ids, w, d, n, out=torch.empty_like(x))
    with pytest.raises(RuntimeError, match="the receive hook failed") as info:
        recv()
    assert comm.pending_receiver is None
    assert any("no longer waits for it" in note for note in info.value.__notes__)
    monkeypatch.setattr(comm, "_combine_start", start)
    d = comm.dispatch(x, ids, n, topk_weights=w)
    out = comm.combine_async(experts(d.recv_x), ids, w, d, n, out=torch.empty_like(x))()
    assert torch.equal(out, expanded_reference(x, ids, w))


# ---- (9) constructor arguments of the comms: typed errors, before anything is allocated ----
@pytest.mark.parametrize("kw,err,match", [
    (dict(cap_align=0), "InputError", "cap_align must be an int >= 1; got 0"),          # was ZeroDivisionError
    (dict(num_experts=-1), "InputError", "num_experts must be an int >= 1; got -1"),   # was RuntimeError
    (dict(num_experts=0), "InputError", "num_experts must be an int >= 1; got 0"),     # was accepted
    (dict(max_tokens=0), "InputError", "max_tokens must be an int >= 1; got 0"),
    (dict(max_tokens=16.0), "InputTypeError", r"max_tokens must be an int >= 1; got 16.0 \(float\)"),
    (dict(hidden=True), "InputTypeError", r"hidden must be an int >= 1; got True \(bool\)"),
])
def test_local_comm_refuses_bad_sizes(kw, err, match):
    from graphrt import errors
    args = dict(num_experts=E, hidden=H, num_topk=K, device="cpu") | kw
    with pytest.raises(getattr(errors, err), match=f"LocalComm: {match}"):
        LocalComm(**args)
    LocalComm(E, H, K, "cpu", max_tokens=16, cap_align=16)   # the next good call works


@pytest.mark.parametrize("comm_cls,buf_cls", BACKENDS)
@pytest.mark.parametrize("kw,err,match", [
    (dict(num_experts=0), "InputError", "num_experts must be an int >= 1; got 0"),     # was accepted
    (dict(num_experts=-8), "InputError", "num_experts must be an int >= 1; got -8"),   # was RuntimeError
    (dict(num_experts=8.0), "InputTypeError", r"num_experts must be an int >= 1; got 8.0"),
    (dict(max_tokens=0), "InputError", "max_tokens must be an int >= 1; got 0"),
    (dict(cap_align=2.5), "InputTypeError", "cap_align must be an int >= 1; got 2.5"),
])
def test_deepep_v2_comm_refuses_bad_sizes(comm_cls, buf_cls, kw, err, match):
    from graphrt import errors
    kw = dict(num_experts=E, max_tokens=MAX_TOKENS) | kw
    buf = buf_cls(None, num_max_tokens_per_rank=MAX_TOKENS, hidden=H, num_topk=K)
    with pytest.raises(getattr(errors, err), match=f"{comm_cls.__name__}: {match}"):
        comm_cls(kw.pop("num_experts"), H, K, "cpu", buffer=buf, **kw)


def test_nccl_comm_argument_errors_are_input_errors(monkeypatch):
    """Experts that do not split over the ranks and a batch above max_tokens were bare
    GraphrtErrors; LocalComm's batch check is an InputError. (Two ranks faked: no GPU here.)"""
    import torch.distributed as dist

    from graphrt.comm.nccl import NCCLComm
    from graphrt.errors import GraphrtError, InputError
    with pytest.raises(InputError, match="NCCLComm: num_experts must be an int >= 1; got 0"):
        NCCLComm(0, H, K, "cpu")                      # before torch.distributed is asked
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(InputError, match="NCCLComm: 7 experts do not split over 2 ranks") as info:
        NCCLComm(7, H, K, "cpu", group=object())
    assert isinstance(info.value, GraphrtError)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    comm = NCCLComm(E, H, K, "cpu", max_tokens=4, group=object())
    x, ids, w, n = routed(5, 5, seed=16)
    with pytest.raises(InputError, match="NCCLComm.dispatch: 5 tokens exceed max_tokens=4"):
        comm.dispatch(x, ids, n)                      # refused before any collective


def test_local_comm_refuses_a_combine_of_a_dispatch_a_later_one_overwrote():
    """Dispatch A, dispatch B, combine A: A's slots live in the static ``pos`` buffer B
    rewrote, and the combine gathered B's rows (NaN or wrong numbers, no error)."""
    from graphrt.errors import InputError
    local = LocalComm(E, H, K, "cpu", max_tokens=MAX_TOKENS)
    xa, ida, wa, na = routed(6, 6, 1)
    xb, idb, wb, nb = routed(6, 4, 2)
    da = local.dispatch(xa, ida, na)
    ya = experts(da.recv_x)                           # A's experts ran: only the combine is left
    db = local.dispatch(xb, idb, nb)
    out = torch.full_like(xa, 7.0)
    for call in (lambda: local.combine(ya, ida, wa, da, na, out=out),
                 lambda: local.combine_async(ya, ida, wa, da, na, out=out),
                 lambda: local.combine_args(ya, ida, wa, da, na)):
        with pytest.raises(InputError, match="1 later dispatch.* rewrote this dispatch's layout"):
            call()
    assert bool((out == 7.0).all())                   # refused before anything ran
    got = local.combine(experts(db.recv_x), idb, wb, db, nb, out=torch.empty_like(xb))
    want, _ = local_result(xb, idb, wb, nb)
    assert torch.equal(got[:4], want[:4])
