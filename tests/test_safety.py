"""CPU tests of the graph-safety analysis API: findings at the user's line, sizes, dedupe,
safe steps with zero findings, receivers, and the refusal error. (The broad hazard corpus
lives in tests/validate_corpus and runs through the validator.)"""
import inspect
import warnings

import pytest
import torch

import graphrt
from graphrt.capture import GraphSafetyError, SafetyAnalyzer, analyze_step
from graphrt.capture.audit import ReceiverLedger, mark_called, register_receiver


def _line(fn, marker):
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, l in enumerate(src) if marker in l)


def _spec(fn, max_bs=16):
    return graphrt.StepSpec(fn, {"x": graphrt.Input((None, 8), torch.float32),
                                 "ids": graphrt.Input((None, 2), torch.int64, high=4)},
                            max_bs, live_count="n")


def hazards(x, ids, n):
    counts = torch.bincount(ids.flatten(), minlength=4)  # H1
    lst = counts.tolist()  # H2
    live = int(n)  # H3
    t = torch.tensor(lst, dtype=torch.float32)  # H4
    y = x[x > 0]  # H5
    return x * live + t.sum() + y.sum()


def safe(x, ids, n):
    oh = torch.nn.functional.one_hot(ids, num_classes=4).sum(1)
    rows = torch.arange(x.shape[0], device=x.device)
    live = (rows < n).unsqueeze(1)
    y = torch.where(live, x, torch.zeros_like(x))
    cnt = torch.zeros(4, dtype=torch.int64, device=x.device).scatter_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
    first = torch.nonzero_static(x[:, 0] > 0, size=x.shape[0], fill_value=-1)
    rep = torch.repeat_interleave(ids[:, 0], 2, output_size=2 * x.shape[0])
    srt, _ = torch.sort(x, dim=1)
    return y + oh[:, :1] + cnt[:1] + srt + first[:, :1] + rep[: x.shape[0], None]


def test_hazards_found_at_their_lines():
    rep = analyze_step(_spec(hazards), [1, 4], "cpu")
    got = {(f.kind, f.line) for f in rep.findings}
    want = {("host-sync", _line(hazards, "# H1")), ("host-sync", _line(hazards, "# H2")),
            ("host-sync", _line(hazards, "# H3")), ("host-to-device-copy", _line(hazards, "# H4")),
            ("host-sync", _line(hazards, "# H5"))}
    assert want <= got, (want - got, rep.table())
    assert all(f.file == __file__ for f in rep.findings)
    assert not rep.safe and all(f.size == 1 for f in rep.findings)  # first size kept on dedupe
    assert len(rep.findings) == len({f.key() for f in rep.findings})


def test_safe_step_has_no_findings():
    rep = analyze_step(_spec(safe), [1, 3, 8], "cpu")
    assert rep.findings == [], rep.table()
    assert rep.safe


def test_size_specific_hazard_names_its_size():
    def step(x, ids, n):
        if x.shape[0] == 8:
            x = x + x.max().item()  # SIZE8
        return x
    rep = analyze_step(_spec(step), [1, 4, 8], "cpu")
    assert [(f.size, f.line) for f in rep.findings] == [(8, _line(step, "# SIZE8"))]


def test_sync_calls_recorded_on_cpu():
    def step(x, ids, n):
        torch.cuda.synchronize()  # SYNC
        return x
    rep = analyze_step(_spec(step), [2], "cpu")
    assert [(f.op, f.line) for f in rep.findings] == [("torch.cuda.synchronize", _line(step, "# SYNC"))]


def test_build_time_work_not_flagged():
    table = torch.tensor([1.0, 2.0, 3.0, 4.0])  # host data built at setup time, closed over

    def step(x, ids, n):
        return x * table[ids[:, 0]].unsqueeze(1)
    assert analyze_step(_spec(step), [1, 4], "cpu").findings == []


def test_data_dependent_shape():
    import itertools
    calls = itertools.count()

    def step(x, ids, n):
        k = next(calls) % 8 + 1  # host state that changes every step
        return x[:, :k].sum(1, keepdim=True).expand(-1, 8)  # DDS
    rep = analyze_step(_spec(step), [4], "cpu", seed=3)
    kinds = {(f.kind, f.line) for f in rep.findings}
    assert ("data-dependent-shape", _line(step, "# DDS")) in kinds


class _Recv:
    def __init__(self):
        register_receiver(self, keep=(torch.zeros(1),))  # RECV

    def __call__(self):
        mark_called(self)


def test_receiver_audit_and_keepalive():
    def forgets(x, ids, n):
        _Recv()
        return x

    def joins(x, ids, n):
        r = _Recv()
        r()
        return x
    rep = analyze_step(_spec(forgets), [2], "cpu")
    assert [f.kind for f in rep.findings] == ["unjoined-receiver"]
    assert analyze_step(_spec(joins), [2], "cpu").findings == []
    with ReceiverLedger() as ledger:
        _Recv()
    assert len(ledger.keepalive) == 1 and len(ledger.unjoined()) == 1
    # nested ledgers (a capture's around an analysis's): the inner exit removed the first
    # *equal* ledger (a dataclass compares by value), the outer one
    from graphrt.capture.audit import _ledgers
    with ReceiverLedger() as outer:
        with ReceiverLedger() as inner:
            _Recv()()
        assert _ledgers()[-1] is outer
        _Recv()                                # never joined, in the outer scope only
    assert len(outer.unjoined()) == 1 and len(inner.unjoined()) == 0
    assert _ledgers() == []


def test_user_warnings_pass_through():
    def step(x, ids, n):
        warnings.warn("user warning kept")
        return x
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SafetyAnalyzer("cpu", 1):
            step(torch.zeros(1), None, None)
    assert any("user warning kept" in str(w.message) for w in caught)


def test_graph_safety_error_lists_findings():
    rep = analyze_step(_spec(hazards), [1], "cpu")
    err = GraphSafetyError(rep.errors, "hazards")
    assert "capture refused" in str(err) and str(len(rep.errors)) in str(err)
    assert err.findings == rep.errors
    doc = rep.to_dict(target="t", device="cpu", sizes=[1])
    assert set(doc) == {"target", "device", "safe", "sizes", "findings"}
    assert set(doc["findings"][0]) == {"kind", "severity", "op", "file", "line", "message", "size"}


def test_step_exception_propagates_and_modes_are_removed():
    def boom(x, ids, n):
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        analyze_step(_spec(boom), [1], "cpu")
    # no mode left behind: a plain .item() outside the analysis is not intercepted
    assert torch.ones(1).item() == 1.0
    from torch.overrides import _get_current_function_mode_stack
    assert not _get_current_function_mode_stack()


def _xs_spec(fn):
    return graphrt.StepSpec(fn, {"x": graphrt.Input((None, 4), torch.float32),
                                 "ids": graphrt.Input((None,), torch.int64, high=8)}, 8)


def test_a_host_tensor_meeting_device_tensors_is_a_finding_on_cpu():
    """A tensor made in the step without ``device=`` (host memory on a GPU) in device math:
    on a GPU the op raises ("Expected all tensors to be on the same device"), so the CPU
    analysis must not call the step graph-safe. Host scalars (0-d) stay legal."""
    def mixed(x, ids):
        return x + torch.arange(x.shape[0])[:, None]        # a host [bs, 1] tensor

    def into_host(x, ids):
        buf = torch.zeros(8, dtype=torch.int64)
        buf.index_copy_(0, torch.arange(ids.shape[0], device=x.device), ids)
        return x * 2

    def scalar(x, ids):
        return x * torch.full((), 2.0)                       # a 0-d host tensor: fine

    for fn, op in ((mixed, "aten.add"), (into_host, "aten.index_copy_")):
        rep = analyze_step(_xs_spec(fn), [2], "cpu")
        assert [(f.kind, f.op) for f in rep.findings] == [
            ("host-to-device-copy", f"{op} (host and device tensors)")], rep.table()
        assert "same device" in rep.findings[0].message
    assert analyze_step(_xs_spec(scalar), [2], "cpu").safe


def test_factories_under_set_default_device_make_device_tensors():
    """``torch.set_default_device(device)`` (gpt-fast's setup) puts torch's device context
    at the bottom of the mode stack, so factories reach the analysis without ``device=``:
    they are device tensors, not host ones (a missed sync and a false copy before)."""
    def sync(x, ids):
        counts = torch.zeros(8, dtype=torch.int64)
        counts.index_add_(0, ids, torch.ones_like(ids))
        return x * counts.max().item()

    cache = torch.zeros(16, 4)

    def copy(x, ids):
        buf = torch.zeros(8, 4)
        buf[: x.shape[0]].copy_(x)
        cache[: x.shape[0]] = buf[: x.shape[0]]
        return cache[: x.shape[0]] * 2

    torch.set_default_device("cpu")
    try:
        found = analyze_step(_xs_spec(sync), [2], "cpu").findings
        assert [(f.kind, f.op) for f in found] == [("host-sync", "Tensor.item")]
        assert analyze_step(_xs_spec(copy), [2], "cpu").safe
    finally:
        torch.set_default_device(None)


def test_a_sync_warning_outside_any_op_is_a_finding_at_its_line():
    """CUDA's sync debug mode warns at the user's line for ``torch.Stream.synchronize()``,
    outside any ATen op, where no check looked: the analysis dropped it. Now a loose sync
    warning at a user line is a host-sync there (once; not for library lines, other warnings
    or lines already reported)."""
    a = SafetyAnalyzer("cpu", size=4)

    def msg(text, line, file=__file__):
        return warnings.WarningMessage(UserWarning(text), UserWarning, file, line)
    sync = "called a synchronizing CUDA operation"
    a.warnings = [msg(sync, 10), msg("something else", 11), msg(sync, 12, torch.__file__)]
    a.loose_sync_warnings()
    a.warnings.append(msg(sync, 10))  # the same line again
    a.loose_sync_warnings()
    assert [(f.kind, f.file, f.line, f.size) for f in a.findings] == [("host-sync", __file__, 10, 4)]


_KERNEL_SYNC = {}
# A C++ kernel's sync (c10's stream_synchronize) warns from torch's innermost frame, not the
# user's: a warning raised by code compiled under torch/_ops.py's name stands in for it.
exec(compile("import warnings\ndef kernel_sync():\n    warnings.warn('called a synchronizing "
             "CUDA operation')\n", torch._ops.__file__, "exec"), _KERNEL_SYNC)


@torch.library.custom_op("graphrt_test::fused_sync", mutates_args=())
def _fused_sync(x: torch.Tensor) -> torch.Tensor:
    _KERNEL_SYNC["kernel_sync"]()
    return x.clone()


def test_a_sync_inside_a_custom_ops_kernel_is_the_ops_at_its_call():
    """Since custom ops' bodies are analyzed, a sync warning no ATen op of the body claimed
    (a C++ kernel's) was dropped as not on a user line; the opaque op used to report it."""
    a = SafetyAnalyzer("cpu", size=2, trace=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with a:
            a.cuda, a.warnings = True, rec  # CUDA mode's sync bookkeeping, by hand
            _fused_sync(torch.ones(2, 4)) + 1  # the call's line
            a.loose_sync_warnings()
    line = inspect.currentframe().f_lineno - 2
    assert [(f.kind, f.op, f.line) for f in a.findings] == [
        ("host-sync", "graphrt_test.fused_sync", line)]


@torch.library.custom_op("graphrt_test::scale_cpu", mutates_args=(), device_types="cpu")
def _scale_cpu(s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _RAN.append("cpu kernel")
    return x * s


@_scale_cpu.register_fake
def _(s, x):
    _RAN.append("fake kernel")
    return torch.empty_like(x)


_RAN: list = []


def test_a_custom_op_runs_the_kernel_the_dispatcher_picks():
    """The key came from the first tensor's device: a host scalar before meta data ran the
    CPU kernel on meta tensors, where the dispatcher runs the meta (fake) one."""
    from graphrt.capture.safety import _custom_body_key
    s, x = torch.tensor(2.0), torch.empty(4, 4, device="meta")
    op = torch.ops.graphrt_test.scale_cpu.default
    assert _custom_body_key(op, (s, x), {}) is None
    assert _custom_body_key(op, (s, torch.ones(2)), {}) == "CPU"
    _RAN.clear()
    with SafetyAnalyzer("cpu", size=4, trace=False):
        _scale_cpu(s, x)
    assert _RAN == ["fake kernel"]


# A torch-level call whose C++ binding warns when it returns to Python (``Tensor.item``,
# ``torch.tensor(list, device="cuda")``): the sync debug warning surfaces in the function
# mode's frame after the ATen ops under it ran, so no op claimed it. Code compiled under
# torch/_ops.py's name stands in for the binding.
exec(compile("import warnings, torch\n"
             "from torch.overrides import has_torch_function, handle_torch_function\n"
             "def binding_sync(x):\n"
             "    if has_torch_function((x,)):\n"
             "        return handle_torch_function(binding_sync, (x,), x)\n"
             "    y = x + 0\n"
             "    warnings.warn('called a synchronizing CUDA operation')\n"
             "    return y\n", torch._ops.__file__, "exec"), _KERNEL_SYNC)


def _body_binding_sync_fn(x: torch.Tensor) -> torch.Tensor:
    return _KERNEL_SYNC["binding_sync"](x)  # the body's line


_body_binding_sync = torch.library.custom_op("graphrt_test::body_binding_sync",
                                             _body_binding_sync_fn, mutates_args=())


def _cuda_bookkeeping(fn, monkeypatch=None, hit=None):
    """Run ``fn`` under a CPU analyzer with CUDA mode's sync bookkeeping set by hand."""
    if hit is not None:
        import graphrt.capture.safety as safety
        real = safety.classify_call
        monkeypatch.setattr(safety, "classify_call", lambda func, *a, **k: hit
                            if func is _KERNEL_SYNC["binding_sync"] else real(func, *a, **k))
    a = SafetyAnalyzer("cpu", size=2, trace=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with a:
            a.cuda, a.warnings = True, rec
            fn()
            a.loose_sync_warnings()
    return a.findings


def test_a_sync_warning_a_call_raises_on_return_is_a_finding_at_its_line():
    """Such a warning surfaced from graphrt's own frame: outside custom ops it was dropped
    as not on a user line (an unclassified syncing call went unreported)."""
    found = _cuda_bookkeeping(lambda: _KERNEL_SYNC["binding_sync"](torch.ones(2)))
    line = inspect.currentframe().f_lineno - 1
    assert [(f.kind, f.op, f.line) for f in found] == [("host-sync", "binding_sync", line)]


def test_a_reported_calls_own_sync_warning_is_not_reported_again_at_a_custom_ops_call():
    """On the GPU, a custom op whose body calls ``.item()`` was reported twice: the body's
    ``Tensor.item`` at its line, and its sync warning (surfacing after the ATen op, from
    graphrt's frame) once more as the op's, at the op's call. A reported call owns the
    warnings it raises; an unreported one inside a body is a finding at the body's line."""
    from graphrt.capture.rules import Hit
    hit = Hit("host-sync", "binding_sync", "reads a device value on the host")
    pytest_mp = pytest.MonkeyPatch()
    try:
        found = _cuda_bookkeeping(lambda: _body_binding_sync(torch.ones(2)), pytest_mp, hit)
    finally:
        pytest_mp.undo()
    body_line = inspect.getsourcelines(_body_binding_sync_fn)[1] + 1
    assert [(f.kind, f.op, f.line) for f in found] == [("host-sync", "binding_sync", body_line)]
    found = _cuda_bookkeeping(lambda: _body_binding_sync(torch.ones(2)))
    assert [(f.kind, f.op, f.line) for f in found] == [("host-sync", "binding_sync", body_line)]


@pytest.mark.parametrize("source,names", [
    ("h = x.cpu()", True), ("t.to(device=cpu)", True), ('t.to("cpu:0")', True),
    ("z = f(cpu)", True), ('torch.zeros(3, device="cpu",', True),
    ("self.gpu = self.cpu.to(device)", False),  # vLLM's CpuGpuBuffer: an attribute named cpu
    ("y = buf.cpu[:n]", False), ("y = cpu[:n]", False), ("counts.to(self.cpu)", True),
    ("num_cpu_blocks = 3", False), ("x.to(device)  # not the cpu", False),
])
def test_a_line_names_the_cpu_only_as_a_place(source, names):
    """An object called ``cpu`` whose attributes or items are read (``self.cpu.to(device)``)
    named the CPU: its device copy was taken for host memory (a false finding). An attribute
    ``cpu`` used as a value (``x.to(self.cpu)``, a ``torch.device``) still does."""
    from graphrt.capture.host import names_cpu
    assert names_cpu(source) is names


def test_a_numpy_operand_converts_the_tensor_on_the_host():
    """``x + ndarray`` ends in ``ndarray.__radd__``, which converts ``x`` with
    ``Tensor.__array__``: a copy to the host (on a CUDA tensor it raises)."""
    import numpy as np
    bias = np.arange(4, dtype=np.float32)

    def step(x):
        return x + bias

    spec = graphrt.StepSpec(fn=step, inputs={"x": graphrt.Input((None, 4), torch.float32)},
                            max_batch_size=4)
    found = analyze_step(spec, [2], "cpu").findings
    line = inspect.getsourcelines(step)[1] + 1
    assert {(f.kind, f.op, f.line) for f in found} == {
        ("host-sync", "Tensor.__array__ (NumPy conversion)", line)}


def test_a_barrier_in_the_step_is_a_host_sync():
    """torch.distributed.barrier blocks the host outside the device's work: a graph replays
    without it (and NCCL's wait refuses capture). It went unreported; every rank still makes
    the call under the analysis, so none is left waiting. Every spelling is one ATen op:
    ``from torch.distributed import barrier`` and a process group's own ``barrier()`` went
    unseen while only ``torch.distributed.barrier`` was patched."""
    import tempfile
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    fresh = not dist.is_initialized()
    if fresh:
        store = dist.FileStore(tempfile.mktemp(), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        from torch.distributed import barrier as imported_barrier
        from torch.distributed.distributed_c10d import _get_default_group

        def step(x, ids, n):
            dist.barrier()
            imported_barrier()
            _get_default_group().barrier()
            dist.monitored_barrier()
            return x * 2
        rep = analyze_step(_spec(step), [2], "cpu")
        first = inspect.getsourcelines(step)[1] + 1
        assert [(f.kind, f.op, f.line - first) for f in rep.findings] == [
            ("host-sync", "torch.distributed.barrier", 0),
            ("host-sync", "torch.distributed.barrier", 1),
            ("host-sync", "torch.distributed.barrier", 2),
            ("host-sync", "torch.distributed.monitored_barrier", 3)]
    finally:
        if fresh:
            dist.destroy_process_group()


def test_a_compiled_step_is_analysed_and_still_compiles_after():
    """torch refuses to compile under a dispatch mode and remembers the frame as skipped:
    after the analysis a ``torch.compile``'d step never compiled (capture() captured it
    eager), and ``fullgraph=True`` raised as the step's own error. The analysis runs
    compiled code's Python eagerly; a hazard in it is still found at its line."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    w = torch.randn(8, 8)

    def mlp(x, ids, n):
        return torch.relu(x @ w) * 2
    torch._dynamo.reset()
    counter = CompileCounter()
    fn = torch.compile(mlp, backend=counter, fullgraph=True, dynamic=False)
    spec = _spec(fn)
    assert analyze_step(spec, [2, 4], "cpu").findings == []
    fn(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int64), 4)
    assert counter.frame_count == 1                   # compiled after the analysis

    def syncs(x, ids, n):
        return x * float(x.sum())                     # a host read in compiled code
    line = inspect.getsourcelines(syncs)[1] + 1
    found = analyze_step(_spec(torch.compile(syncs, backend=CompileCounter())), [2], "cpu")
    assert {(f.kind, f.line) for f in found.findings} == {("host-sync", line)}
    torch._dynamo.reset()


def test_overlapping_analyses_put_torch_compile_back():
    """torch's compile stance is process-wide: two analyses on two threads that ended out of
    order (A in, B in, A out, B out) left it at force_eager, and torch.compile stayed off for
    the process. The first sets it, the last puts back what was there."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    from graphrt.capture.host import compiled_run_eagerly
    a, b = compiled_run_eagerly(), compiled_run_eagerly()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    inside = CompileCounter()
    torch.compile(lambda x: x * 2, backend=inside)(torch.ones(2))
    b.__exit__(None, None, None)
    torch._dynamo.reset()
    after = CompileCounter()
    torch.compile(lambda x: x * 3, backend=after)(torch.ones(2))
    assert (inside.frame_count, after.frame_count) == (0, 1)
    torch._dynamo.reset()
