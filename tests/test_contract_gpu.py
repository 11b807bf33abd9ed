"""The engine-facing step contract on real CUDA graphs (H200): offsets and fixed-shape
inputs, fixed-shape outputs, an in-graph counter kept out of padding, -inf masks, declared
state, pre-replay planning, a shared pool, an engine's capture stream and context, and
warm-up/capture under inference mode."""
import contextlib

import pytest
import torch

import graphrt

E = 16


def _engine_step(device, seen):
    load = torch.zeros(E, dtype=torch.int64, device=device)
    w = torch.randn(64, 64, device=device) / 8
    plan = torch.zeros(1, dtype=torch.int32, device=device)   # planned metadata the graph reads

    def step(x, cu_seqlens, expert, bias, n):
        seen.append(torch.is_inference_mode_enabled())
        live = torch.arange(x.shape[0], device=x.device) < n                    # [bs]
        seq = (cu_seqlens[1:] - cu_seqlens[:-1]).to(x.dtype)                    # [bs]
        planned = torch.arange(x.shape[0], device=x.device) < plan              # [bs] from the plan
        logits = (x @ w + bias[expert][:, None] + seq[:, None]) * planned[:, None]  # [bs, 64]
        logits = torch.where(logits > 0, logits, float("-inf"))                 # -inf masks
        load.scatter_add_(0, expert, live.to(torch.int64))                      # live rows only
        return {"logits": logits, "load": load.clone(), "any_long": (seq > 3).any()}

    def before_replay(padded_bs, n):
        plan.fill_(n)                   # host planning: a stale plan would zero live rows

    spec = graphrt.StepSpec(step, {
        "x": graphrt.Input((None, 64), torch.float32),
        "cu_seqlens": graphrt.Input((None,), torch.int32, low=0, high=6, offsets=True),
        "expert": graphrt.Input((None,), torch.int64, high=E),
        "bias": graphrt.Input((E,), torch.float32)},
        max_batch_size=64, live_count="n", state=[load], before_replay=before_replay)
    spec.meta["plan"] = plan
    return spec, load


def _plan(spec):
    return spec.meta["plan"]


@pytest.mark.gpu
def test_engine_shaped_step_on_real_graphs(cuda_device):
    seen = []
    spec, load = _engine_step(cuda_device, seen)
    entered = []

    @contextlib.contextmanager
    def engine_capture_context():
        entered.append(torch.cuda.is_current_stream_capturing())
        yield

    stream = torch.cuda.Stream(cuda_device)
    rt = graphrt.GraphRuntime(spec, sizes=[1, 4, 16, 64], progress=False, capture_stream=stream,
                              capture_context=engine_capture_context).capture()
    assert entered == [False] and seen and all(seen)      # warm-up and capture in inference mode
    assert int(load.sum()) == 0                           # capture left the counters as found
    assert rt.manager.signature.rows == ("batch", "fixed", "fixed")
    checks = rt.check_replay()
    assert all(c.ok for c in checks) and any(c.what == "state-graph-vs-eager" for c in checks)
    assert int(load.sum()) == 0
    gen = torch.Generator().manual_seed(5)
    total, saw_inf = 0, False
    for n in (1, 3, 16, 50, 64):
        inputs = spec.random_inputs(n, cuda_device, gen)
        out = rt.run(**inputs)
        total += n
        assert out["logits"].shape == (n, 64) and out["load"].shape == (E,) and out["any_long"].shape == ()
        assert int(load.sum()) == total                   # padded rows counted nothing
        assert int(spec.state[0].sum()) == total and int(_plan(spec)) == n   # planned for n
        assert torch.equal(out["load"], load)
        # eager on the same padded batch: -inf entries equal, everything else bitwise
        load.sub_(torch.bincount(inputs["expert"], minlength=E))
        spec.before_replay(rt.table.pick(n), n)
        want = spec.call_padded(inputs, rt.table.pick(n), {"logits": "batch", "load": "fixed", "any_long": "fixed"})
        assert torch.equal(out["logits"], want["logits"]) and torch.equal(out["load"], want["load"])
        saw_inf |= bool(torch.isinf(out["logits"]).any())

    assert saw_inf                                        # -inf entries were compared too

    # a second runtime in the same pool (draft and target), on the same capture stream
    spec2, load2 = _engine_step(cuda_device, [])
    rt2 = graphrt.GraphRuntime(spec2, sizes=[4, 16], progress=False, pool=rt.pool,
                               capture_stream=stream).capture()
    assert rt2.pool == rt.pool
    inputs = spec.random_inputs(7, cuda_device, gen)
    a, b = rt.run(**inputs)["logits"], rt2.run(**inputs)["logits"]
    assert a.shape == b.shape == (7, 64)
    assert all(c.ok for c in rt2.check_replay(trials=1)) and all(c.ok for c in rt.check_replay(trials=1))


@pytest.mark.gpu
def test_grad_inputs_leave_no_history_on_cuda(cuda_device):
    w = torch.randn(32, 32, device=cuda_device, requires_grad=True)
    spec = graphrt.StepSpec(lambda x: x @ w, {"x": graphrt.Input((None, 32), torch.float32)}, 8)
    rt = graphrt.GraphRuntime(spec, sizes=[8], progress=False).capture()
    before = torch.cuda.memory_allocated(cuda_device)
    for _ in range(50):
        out = rt.run(x=torch.randn(5, 32, device=cuda_device, requires_grad=True))
        assert out.grad_fn is None and not out.requires_grad
        del out
    assert torch.cuda.memory_allocated(cuda_device) - before < 64 * 1024


@pytest.mark.gpu
@pytest.mark.slow
def test_graphrt_captures_a_compiled_step(cuda_device):
    """A step compiled with torch.compile (no cudagraphs of its own), its Triton kernels
    routed through the graphrt:: ops, captured by graphrt: replays equal the compiled step
    run eagerly on the same padded batch."""
    import dataclasses

    from graphrt.kernels.ops import launchers_as_ops
    from graphrt.moe import make_step, preset
    spec, model = make_step(preset("tiny"), cuda_device, max_batch_size=16)
    model.overlap = False
    with launchers_as_ops():
        compiled = torch.compile(model.step, dynamic=False)
        cspec = dataclasses.replace(spec, fn=compiled)
        rt = graphrt.GraphRuntime(cspec, sizes=[1, 4, 16], progress=False).capture()
        checks = rt.check_replay(trials=1)
        assert all(c.ok for c in checks), [str(c) for c in checks if not c.ok]
        gen = torch.Generator().manual_seed(3)
        inputs = cspec.random_inputs(3, cuda_device, gen)
        out = rt.run(**inputs)["logits"]
        with torch.inference_mode():
            want = cspec.call_padded(inputs, 4)["logits"]
    assert torch.equal(out, want)
