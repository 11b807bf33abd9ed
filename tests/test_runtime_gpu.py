"""GPU tests of the foundation: capture at 1..256, replay == eager, padding inert, refusals
at the user's line, stale leases, and 1,000 replays at random sizes with memory flat."""
import gc
import inspect
import weakref

import pytest
import torch

import graphrt
from graphrt.capture import GraphSafetyError

pytestmark = pytest.mark.gpu
H = 256


def _line(fn, marker):
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, l in enumerate(src) if marker in l)


class SideStreamStep:
    """4 layers; each forks a side stream for a second branch and joins it by event."""

    def __init__(self, device, layers=4, join=True):
        g = torch.Generator(device="cpu").manual_seed(0)
        self.w = [(torch.randn(H, H, generator=g) / H ** 0.5).to(device) for _ in range(2 * layers)]
        self.side = torch.cuda.Stream(device)
        self.join = join

    def __call__(self, x, pos, n):
        main = torch.cuda.current_stream()
        live = (torch.arange(x.shape[0], device=x.device) < n).unsqueeze(1)
        for i in range(0, len(self.w), 2):
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                b = torch.tanh(x @ self.w[i + 1])  # SIDE-WORK
            a = torch.relu(x @ self.w[i])
            if self.join:
                main.wait_stream(self.side)
            x = x + a + b
        y = torch.where(live, x * pos.unsqueeze(1).float(), torch.zeros_like(x))
        return {"y": y, "argmax": y.argmax(dim=1)}


def _spec(step, max_bs=256):
    return graphrt.StepSpec(step, {"x": graphrt.Input((None, H), torch.float32),
                                   "pos": graphrt.Input((None,), torch.int32, low=1, high=100)},
                            max_bs, live_count="n")


@pytest.fixture(scope="module")
def rt():
    r = graphrt.GraphRuntime(_spec(SideStreamStep("cuda")), progress=False)
    r.capture()
    return r


def test_captured_all_default_sizes(rt):
    assert sorted(rt.graphs) == graphrt.capture_sizes(256)
    st = rt.stats()
    assert st["pool_bytes"] > 0 and all(v["capture_s"] > 0 for v in st["sizes"].values())


def test_replay_equals_eager_and_padding_inert(rt):
    checks = rt.check_replay(trials=2)
    assert all(c.ok for c in checks)
    assert {c.size for c in checks} == set(rt.sizes)
    assert any(c.n < c.size for c in checks)  # some checks had real padding


def test_run_matches_eager_every_size(rt):
    g = torch.Generator().manual_seed(7)
    for n in (1, 3, 8, 9, 100, 255, 256):
        inputs = rt.spec.random_inputs(n, rt.device, g)
        out = rt.run(**inputs)
        ref = rt.eager(**inputs)
        assert out["y"].shape == (n, H)
        torch.testing.assert_close(out["y"], ref["y"], rtol=1e-4, atol=1e-4)
        assert torch.equal(out["argmax"], out["y"].argmax(dim=1))  # outputs of one replay agree


def test_oversize_eager_and_raise(rt):
    inputs = rt.spec.random_inputs(3, rt.device)
    before = rt.counters["eager"]
    r2 = graphrt.GraphRuntime(rt.spec, sizes=[1, 2], oversize="raise", progress=False).capture()
    with pytest.raises(graphrt.NoGraphForBatch, match="largest captured size is 2"):
        r2.run(**inputs)
    r3 = graphrt.GraphRuntime(rt.spec, sizes=[1, 2], progress=False).capture()
    r3.run(**inputs)
    assert r3.counters["eager"] == 1 and rt.counters["eager"] == before


def test_bad_inputs_are_named(rt):
    x = torch.randn(2, H, device="cuda")
    pos = torch.ones(2, dtype=torch.int32, device="cuda")
    with pytest.raises(graphrt.InputError, match="'x': expected dtype torch.float32"):
        rt.run(x=x.half(), pos=pos)
    with pytest.raises(graphrt.InputError, match="'x': expected device cuda:0, got cpu"):
        rt.run(x=x.cpu(), pos=pos)
    with pytest.raises(graphrt.InputError, match="'pos': expected shape"):
        rt.run(x=x, pos=pos[:, None])


def test_nested_and_overlapping_inputs_are_refused_and_lose_nothing(rt):
    """On the CUDA paths (the staging table by default): a nested input after cached steps
    once aborted the process in torch's guard; an input that is a view of graphrt's own
    static input falls off the table (it overlaps its buffer) to a copy torch refuses. Both
    are InputErrors, and the next step's outputs equal eager's."""
    inputs = rt.spec.random_inputs(4, rt.device)
    want = rt.eager(**inputs)
    for _ in range(3):  # cached: the guarded lookup serves these
        rt.run(**inputs)
    nested = torch.nested.nested_tensor([r for r in inputs["x"]])
    with pytest.raises(graphrt.InputError, match="'x': expected a dense .* nested"):
        rt.run(x=nested, pos=inputs["pos"])
    bufs = rt.input_buffers(4)
    bufs["x"][:4].copy_(inputs["x"])
    with pytest.raises(graphrt.InputError, match="'x': .*shares memory with graphrt's static"):
        rt.run(x=bufs["x"][1:4], pos=inputs["pos"][1:])
    got = rt.run(**inputs)
    torch.testing.assert_close(got["y"], want["y"], rtol=1e-4, atol=1e-4)


def test_stale_lease_raises():
    r = graphrt.GraphRuntime(_spec(SideStreamStep("cuda", layers=1), 8), sizes=[4, 8],
                             copy_outputs=False, progress=False, debug=True).capture()
    a = r.run(**r.spec.random_inputs(3, r.device))
    y = a["y"]
    kept = y.clone()
    assert y.shape == (3, H)
    r.run(**r.spec.random_inputs(3, r.device))
    with pytest.raises(graphrt.StaleOutputError):
        y.sum()
    assert torch.isfinite(kept).all()


def test_unjoined_side_stream_refused_at_user_line():
    step = SideStreamStep("cuda", layers=1, join=False)
    with pytest.raises(GraphSafetyError) as ei:
        graphrt.GraphRuntime(_spec(step, 8), sizes=[8], progress=False).capture()
    f = [f for f in ei.value.findings if f.kind == "unjoined-stream"]
    assert f and f[0].file == __file__
    assert f[0].line == _line(SideStreamStep.__call__, "# SIDE-WORK")


def test_host_sync_refused_at_user_line():
    def step(x, pos, n):
        scale = x.abs().max().item()  # SYNC-HERE
        return x / scale
    with pytest.raises(GraphSafetyError) as ei:
        graphrt.GraphRuntime(_spec(step, 8), sizes=[8], progress=False).capture()
    assert [(f.kind, f.line) for f in ei.value.findings][:1] == [("host-sync", _line(step, "# SYNC-HERE"))]
    assert not torch.cuda.is_current_stream_capturing()


def test_thousand_replays_memory_flat(rt):
    g = torch.Generator().manual_seed(11)
    pool = {n: rt.spec.random_inputs(n, rt.device, g) for n in (1, 5, 17, 64, 130, 256)}
    sizes = list(pool)
    for i in range(50):                       # warm the copy-out allocations
        rt.run(**pool[sizes[i % len(sizes)]])
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    picks = torch.randint(0, len(sizes), (1000,), generator=g).tolist()
    for i in picks:
        out = rt.run(**pool[sizes[i]])
        del out
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= base  # flat: 1,000 replays allocate nothing that stays


def test_zero_copy_staging_matches_run(rt):
    g = torch.Generator().manual_seed(21)
    for n in (5, 200, 3):
        inputs = rt.spec.random_inputs(n, rt.device, g)
        want = rt.run(**inputs)
        for k, buf in rt.input_buffers(n).items():
            buf.copy_(inputs[k])                      # the engine writes in place
        got = rt.replay(n)
        assert torch.equal(got["y"], want["y"]) and torch.equal(got["argmax"], want["argmax"])
    with pytest.raises(graphrt.NoGraphForBatch):
        rt.input_buffers(257)


class ReceiverStep:
    """Hands a tensor made inside the step to a ``Receiver`` and to nothing else, as an
    overlapped combine does with its in-flight buffers; remembers it weakly per batch size."""

    def __init__(self):
        self.held: dict[int, weakref.ref] = {}

    def __call__(self, x, pos, n):
        from graphrt.comm.base import Receiver
        scratch = x * 2.0                          # only the receiver keeps this one
        self.held[x.shape[0]] = weakref.ref(scratch)
        out = torch.empty_like(x)
        recv = Receiver(lambda s=scratch: out.copy_(s), out, keep=(scratch,))
        del scratch
        return {"y": recv() + pos.unsqueeze(1).float()}


def test_receiver_held_tensor_lives_as_long_as_its_graph():
    """The graph keeps what a receiver created during its capture holds (not only its input
    views): the tensor outlives the step's references and dies with the runtime."""
    step = ReceiverStep()
    r = graphrt.GraphRuntime(_spec(step, 16), sizes=[4, 16], progress=False).capture()
    gc.collect()
    for size, g in r.graphs.items():
        held = step.held[size]()                   # the tensor made while capturing `size`
        assert held is not None, f"batch {size}: the receiver's tensor died after capture"
        assert any(t is held for t in g.keepalive), f"batch {size}: not in the graph's keepalive"
        del held, g
    x = torch.randn(3, H, device="cuda")
    pos = torch.randint(1, 100, (3,), dtype=torch.int32, device="cuda")
    junk = [torch.full((1 << 16,), float("nan"), device="cuda") for _ in range(64)]
    for _ in range(10):
        y = r.run(x=x, pos=pos)["y"]
    torch.testing.assert_close(y, x * 2.0 + pos.unsqueeze(1).float())
    del junk, y, r
    gc.collect()
    assert all(ref() is None for ref in step.held.values()), "kept alive past its graph"
