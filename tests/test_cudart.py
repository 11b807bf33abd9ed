"""The raw staging copy (issue 17, ``graphrt.cudart``): the library lookup, the copy each
single input takes (``Stager.bind``'s ``paths``), and that it is exactly ``copy_``.

CPU: the lookup says "unavailable" cleanly on a CPU-only torch; bind picks ``copy_`` on CPU;
with a stand-in for libcudart (``ctypes.memmove``) the raw path's per-call choices (strides,
negative views, overlap, default streams of another device, errors) are exercised and
compared with ``copy_`` byte for byte. GPU (``@pytest.mark.gpu``): the real call is taken
for contiguous CUDA inputs, is bitwise ``copy_``, falls back for strided sources and runs on
the current (non-default) stream."""
import ctypes
from types import SimpleNamespace

import pytest
import torch

import graphrt
import graphrt.cudart as cudart
from graphrt.errors import GraphrtError
from graphrt.replay_policy import Stager
from tests.fakes.specs import lone_and_grouped_spec, use_fake_capture

N, PADDED = 3, 4


_spec = lone_and_grouped_spec


NAMES = ("x", "ids", "pos", "lens")
RAW = {"x": "memcpy", "ids": "memcpy", "pos": "foreach_copy_", "lens": "foreach_copy_"}


class _Sub(torch.Tensor):
    pass


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _staged(st: Stager, n: int = N) -> dict:
    return {k: v.clone() for k, v in st.live_views(n).items()}


# -- the lookup ------------------------------------------------------------------------------
@pytest.mark.skipif(bool(torch.version.cuda), reason="a CUDA build of torch")
def test_unavailable_on_a_cpu_only_torch_without_raising():
    assert cudart.available() is False and cudart.available() is False     # cached
    assert cudart.library_path() is None
    with pytest.raises(cudart.CudaRuntimeError, match="not available") as exc:
        cudart.memcpy_d2d_async(0, 0, 4, 0)
    assert isinstance(exc.value, GraphrtError) and isinstance(exc.value, RuntimeError)


def test_lookup_without_a_libcudart_is_unavailable_cleanly(monkeypatch):
    """A CUDA torch (pretended) whose libcudart is nowhere: every try fails quietly."""
    def no_lib(name, *a, **kw):
        if "libcudart" in str(name):
            raise OSError(f"{name}: cannot open shared object file")
        return real(name, *a, **kw)
    real = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(cudart, "_AVAILABLE", None)
    monkeypatch.setattr(cudart, "_LIB", None)
    monkeypatch.setattr(cudart, "_mapped", lambda: ["libc.so.6"])    # mapped, not a libcudart
    assert cudart.available() is False and cudart._LIB is None
    assert cudart.library_path() is None


def test_the_mapped_libcudart_is_found_by_its_path(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /venv/torch/lib/libcudart-9f8e7d6c.so.12\n"
        "7f01-7f02 r--p 00001000 08:01 1 /venv/torch/lib/libcudart-9f8e7d6c.so.12\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /venv/nvidia/cuda_runtime/lib/libcudart.so.12\n"
        "7f03-7f04 r-xp 00000000 08:01 3 /venv/lib/libcudart_helper.py.txt\n"
        "7f04-7f05 rw-p 00000000 00:00 0 \n")
    assert cudart._mapped(str(maps)) == ["/venv/torch/lib/libcudart-9f8e7d6c.so.12",
                                         "/venv/nvidia/cuda_runtime/lib/libcudart.so.12"]
    assert cudart._mapped(str(tmp_path / "missing")) == []


def test_bind_picks_copy_on_cpu():
    st = Stager(_spec(), 8, torch.device("cpu"))
    stage = st.bind(NAMES, N, PADDED, False, True)
    assert stage.paths == {**RAW, "x": "copy_", "ids": "copy_"}
    live = _spec().random_inputs(N)
    stage(tuple(live[k] for k in NAMES))
    assert all(torch.equal(st.buffers[k][:N], live[k]) for k in NAMES)


def test_graphrt_raw_copy_0_turns_the_raw_path_off(monkeypatch):
    """``raw_copyable`` (asked when a step is bound) says no under ``GRAPHRT_RAW_COPY=0``."""
    dst = SimpleNamespace(is_cuda=True, is_contiguous=lambda: True, is_complex=lambda: False,
                          numel=lambda: 4)
    monkeypatch.setattr(cudart, "_AVAILABLE", True)
    monkeypatch.delenv("GRAPHRT_RAW_COPY", raising=False)
    assert cudart.raw_copyable(dst)
    monkeypatch.setenv("GRAPHRT_RAW_COPY", "0")
    assert not cudart.raw_copyable(dst)


# -- the raw path's choices, on a stand-in -----------------------------------------------------
@pytest.fixture
def stand_in(monkeypatch):
    """libcudart on the CPU: ``ctypes.memmove`` for ``cudaMemcpyAsync`` (each call recorded;
    ``rc`` is what it returns), a settable current stream and device, CPU tensors copyable."""
    box = SimpleNamespace(calls=[], rc=0, stream=0x5000, device=None)   # a CPU index is None

    def memcpy(dst, src, nbytes, kind, stream):
        box.calls.append((dst.value, src, nbytes.value, kind.value, stream))
        if not box.rc:
            ctypes.memmove(dst.value, src, nbytes.value)
        return box.rc

    class Lib:
        def get_last_error(self):
            box.cleared = True

        def error_string(self, rc):
            return b"an illegal memory access was encountered"
    monkeypatch.setattr(cudart, "memcpy_async_fn", lambda: memcpy)
    monkeypatch.setattr(cudart, "stream_fns", lambda: (lambda dev: box.stream, lambda: box.device))
    monkeypatch.setattr(cudart, "_AVAILABLE", True)
    monkeypatch.setattr(cudart, "_LIB", Lib())
    monkeypatch.setattr(cudart, "raw_copyable", lambda dst: dst.is_contiguous() and dst.numel() > 0)
    return box


def _pair(n: int = N):
    """A stager staging by the stand-in and one staging by ``copy_`` alone (``exact=False``)."""
    spec = _spec()
    raw, ref = Stager(spec, 8, torch.device("cpu")), Stager(spec, 8, torch.device("cpu"))
    return raw.bind(NAMES, n, PADDED, False, True), raw, ref.bind(NAMES, n, PADDED, False), ref


def test_contiguous_inputs_go_by_one_memcpy_each_bitwise_equal_to_copy_(stand_in):
    stage, st, ref_stage, ref = _pair()
    assert stage.paths == RAW and ref_stage.paths == {**RAW, "x": "copy_", "ids": "copy_"}
    for seed in range(3):
        live = _spec().random_inputs(N, generator=torch.Generator().manual_seed(seed))
        vals = tuple(live[k] for k in NAMES)
        stage(vals)
        ref_stage(vals)
        got, want = _staged(st), _staged(ref)
        assert all(torch.equal(_bytes(got[k]), _bytes(want[k])) for k in NAMES)
        assert int(st.n_dev) == N and st.pad_rows_intact(N, PADDED) == []
    assert len(stand_in.calls) == 6
    dst, _, nbytes, kind, stream = stand_in.calls[0]
    x = st.live_views(N)["x"]
    assert (dst, nbytes, kind, stream) == (x.data_ptr(), N * 4 * 4, cudart.MEMCPY_D2D, 0x5000)


@pytest.mark.parametrize("what", ["transposed", "strided slice", "negative view", "no data",
                                  "subclass", "the buffer itself"])
def test_a_source_a_memcpy_cannot_copy_falls_back_to_copy_(stand_in, what):
    stage, st, _, _ = _pair()
    live = _spec().random_inputs(N)
    x = live["x"]
    live["x"] = {"transposed": x.t().contiguous().t(),
                 "strided slice": torch.stack([x, x], 1)[:, 0],
                 "negative view": torch._neg_view(x),
                 "no data": torch._efficientzerotensor(N, 4),
                 "subclass": x.as_subclass(_Sub),
                 "the buffer itself": st.live_views(N)["x"]}[what]
    want = {"negative view": -x, "no data": torch.zeros(N, 4),
            "the buffer itself": st.live_views(N)["x"].clone()}.get(what, x)
    if what == "subclass":                          # a subclass binds copy_ at bind time
        stage = st.bind(NAMES, N, PADDED, False, False)
        assert stage.paths["x"] == "copy_"
    stage(tuple(live[k] for k in NAMES))
    assert [c[2] for c in stand_in.calls] == ([] if what == "subclass" else [N * 8])  # ids
    assert torch.equal(_bytes(st.buffers["x"][:N]), _bytes(want))


def test_an_overlapping_source_raises_what_copy_raises(stand_in):
    stage, st, ref_stage, ref = _pair()
    live = _spec().random_inputs(N)
    for s, stager in ((stage, st), (ref_stage, ref)):
        live["x"] = stager.buffers["x"][1:N + 1]                # rows 1..N onto rows 0..N-1
        with pytest.raises(RuntimeError, match="single memory location"):
            s(tuple(live[k] for k in NAMES))
    assert all(c[2] != N * 16 for c in stand_in.calls)


def test_a_default_stream_of_another_current_device_falls_back(stand_in):
    stage, st, _, _ = _pair()
    live = _spec().random_inputs(N)
    vals = tuple(live[k] for k in NAMES)
    for stream, device, raw in ((0, None, True), (0, 1, False), (2, 1, False), (0x5000, 1, True)):
        stand_in.stream, stand_in.device, stand_in.calls[:] = stream, device, []
        st.buffers["x"].zero_()
        stage(vals)
        assert len(stand_in.calls) == (2 if raw else 0), (stream, device)
        assert torch.equal(st.buffers["x"][:N], live["x"])


def test_grad_inputs_are_copied_raw_and_leave_no_history(stand_in):
    st = Stager(_spec(), 8, torch.device("cpu"))
    stage = st.bind(NAMES, N, PADDED, True, True)
    live = _spec().random_inputs(N)
    live["x"].requires_grad_(True)
    stage(tuple(live[k] for k in NAMES))
    assert stage.paths == RAW and len(stand_in.calls) == 2
    assert torch.equal(st.buffers["x"][:N], live["x"].detach())
    assert st.buffers["x"].grad_fn is None and not st.buffers["x"].requires_grad


def test_a_failed_memcpy_raises_a_typed_error_naming_the_input(stand_in):
    stage, _, _, _ = _pair()
    stand_in.rc = 700
    live = _spec().random_inputs(N)
    with pytest.raises(cudart.CudaRuntimeError, match=r"input 'x'.*error 700: an illegal "
                                                      r"memory access") as exc:
        stage(tuple(live[k] for k in NAMES))
    assert exc.value.code == 700 and stand_in.cleared


def test_the_runtime_steady_state_stages_through_the_raw_path(stand_in, monkeypatch):
    use_fake_capture(monkeypatch)
    spec = _spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device="cpu", copy_outputs=False,
                              progress=False).capture()
    for seed in range(3):
        live = spec.random_inputs(N, generator=torch.Generator().manual_seed(seed))
        out = rt.run(**live)
        assert torch.equal(out, spec.call_padded(live, 4, None))
    stage = rt._steps.lookup(live, tuple(live.values()))[0]
    assert stage.paths == RAW and len(stand_in.calls) == 6
    live["x"] = live["x"].t().contiguous().t()                # strides are free: same step
    assert torch.equal(rt.run(**live), spec.call_padded(live, 4, None))
    assert len(stand_in.calls) == 7 and len(rt._steps) == 1


# -- on a GPU ----------------------------------------------------------------------------------
def _count_memcpy(monkeypatch) -> list:
    calls, real = [], cudart.memcpy_async_fn()

    def counted(*args):
        calls.append(args)
        return real(*args)
    monkeypatch.setattr(cudart, "memcpy_async_fn", lambda: counted)
    return calls


@pytest.mark.gpu
def test_the_raw_copy_is_taken_on_cuda_and_is_bitwise_copy_(cuda_device, monkeypatch):
    assert cudart.available() and cudart.library_path()
    assert len(cudart._mapped()) <= 1, f"a second libcudart was loaded: {cudart._mapped()}"
    calls = _count_memcpy(monkeypatch)
    spec = _spec()
    st, ref = Stager(spec, 8, cuda_device), Stager(spec, 8, cuda_device)
    stage, ref_stage = st.bind(NAMES, N, PADDED, False, True), ref.bind(NAMES, N, PADDED, False)
    assert stage.paths == RAW and ref_stage.paths["x"] == "copy_"
    gen = torch.Generator().manual_seed(0)
    for strided in (False, True, False):
        live = {k: v.to(cuda_device) for k, v in spec.random_inputs(N, generator=gen).items()}
        if strided:   # transposed, and every other row: the same shape, not contiguous
            live["x"] = live["x"].t().contiguous().t()
            live["ids"] = torch.stack([live["ids"], live["ids"]], 1)[:, 0]
        before = len(calls)
        vals = tuple(live[k] for k in NAMES)
        stage(vals)
        ref_stage(vals)
        torch.cuda.synchronize()
        assert len(calls) - before == (0 if strided else 2)
        got, want = _staged(st), _staged(ref)
        assert all(torch.equal(_bytes(got[k]), _bytes(want[k])) for k in NAMES)
        assert all(torch.equal(got[k], live[k]) for k in NAMES) and int(st.n_dev) == N


@pytest.mark.gpu
def test_the_raw_copy_runs_on_the_current_non_default_stream(cuda_device, monkeypatch):
    """The source is written on a side stream after a long device sleep; a copy on any other
    stream (torch's streams do not wait for the legacy default one) would read it early."""
    calls = _count_memcpy(monkeypatch)
    st = Stager(_spec(), 8, cuda_device)
    stage = st.bind(NAMES, N, PADDED, False, True)
    live = {k: v.to(cuda_device) for k, v in _spec().random_inputs(N).items()}
    want = live["x"].clone()
    live["x"] = torch.zeros_like(want)
    torch.cuda.synchronize()
    side = torch.cuda.Stream(cuda_device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)                        # ~0.1 s of device time on `side`
        live["x"].copy_(want)
        stage(tuple(live[k] for k in NAMES))
        assert len(calls) == 2 and calls[0][-1] == side.cuda_stream
    side.synchronize()
    assert torch.equal(st.buffers["x"][:N], want)


@pytest.mark.gpu
def test_the_runtime_replays_on_raw_staged_inputs(cuda_device, monkeypatch):
    monkeypatch.setenv("GRAPHRT_GRAPH_STAGING", "0")          # (in-graph staging: its own tests)
    calls = _count_memcpy(monkeypatch)
    spec = _spec(16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device=cuda_device, progress=False).capture()
    gen = torch.Generator().manual_seed(1)
    for n in (3, 3, 9, 3):
        live = {k: v.to(cuda_device) for k, v in spec.random_inputs(n, generator=gen).items()}
        assert torch.equal(rt.run(**live), spec.call_padded(live, rt.table.pick(n), None))
    stage = rt._steps.lookup(live, tuple(live.values()))[0]
    assert stage.paths == RAW and len(calls) >= 2
    live["x"] = live["x"].t().contiguous().t()
    before = len(calls)
    assert torch.equal(rt.run(**live), spec.call_padded(live, 4, None))
    assert len(calls) - before == 1                            # ids only: x fell back


@pytest.mark.multigpu
def test_the_default_stream_of_another_current_device_falls_back_on_cuda(monkeypatch):
    calls = _count_memcpy(monkeypatch)
    dev0 = torch.device("cuda", 0)
    st = Stager(_spec(), 8, dev0)
    stage = st.bind(NAMES, N, PADDED, False, True)
    live = {k: v.to(dev0) for k, v in _spec().random_inputs(N).items()}
    with torch.cuda.device(1):
        stage(tuple(live[k] for k in NAMES))
    torch.cuda.synchronize(dev0)
    assert calls == [] and torch.equal(st.buffers["x"][:N], live["x"])
