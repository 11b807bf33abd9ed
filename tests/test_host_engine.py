"""The host engine (graphrt/engine.py, examples/host_engine_loop.py).

CPU: slot bookkeeping, admission/retirement/teacher forcing with a toy step whose greedy
sample is a known function of its inputs, idle steps, workload determinism, and the real
``tiny`` model (kernels on the Triton interpreter): two engines built from the same seed,
and the example's CPU mode (one model, KV restored between runs), give identical streams.
``GraphRuntime.capture()`` needs CUDA, so on CPU the engine runs with the eager step.

GPU: graph vs eager token streams identical over 1,000 steps; the 10,000-step soak (memory
flat, sampled replays bitwise equal to eager). Two GPUs: the example's DeepEP mode.
"""
import importlib.util
import os
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from graphrt.testing.engine import (DecodeEngine, KVSnapshot, Request, SlotPool, Workload,
                            compare_graph_eager, eager_step, soak)
from graphrt.errors import GraphrtError, InputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 50


class ToyStep:
    """logits = one_hot((7 token + 3 position + slot) % VOCAB): a greedy sample we can predict.
    Records every call's rows."""

    def __init__(self):
        self.calls = []

    def __call__(self, tokens, positions, slots):
        assert tokens.dtype == torch.int64 and positions.dtype == slots.dtype == torch.int32
        self.calls.append(list(zip(tokens.tolist(), positions.tolist(), slots.tolist())))
        nxt = (7 * tokens + 3 * positions.long() + slots.long()) % VOCAB
        return torch.nn.functional.one_hot(nxt, VOCAB).float()


def test_slot_pool():
    pool = SlotPool(3)
    a, b, c = pool.take(), pool.take(), pool.take()
    assert sorted((a, b, c)) == [0, 1, 2] and len(pool) == 0
    with pytest.raises(GraphrtError, match="no free KV-cache slot"):
        pool.take()
    pool.give(b)
    assert pool.take() == b                        # a retired slot is reused first
    with pytest.raises(GraphrtError, match="double free"):
        pool.give(7)


def test_submit_validates_lengths():
    eng = DecodeEngine(ToyStep(), num_slots=4, max_ctx=8, max_batch_size=4, device="cpu")
    with pytest.raises(InputError, match="exceeds the KV cache"):
        eng.submit(Request(0, [1] * 5, 4))
    with pytest.raises(InputError, match="prompt token"):
        eng.submit(Request(1, [], 2))
    eng.submit(Request(2, [1] * 5, 3))             # 5 + 3 = max_ctx: fits


def test_admission_teacher_forcing_slot_reuse_and_retirement():
    toy = ToyStep()
    eng = DecodeEngine(toy, num_slots=3, max_ctx=32, max_batch_size=2, device="cpu")
    reqs = [Request(i, [10 + i, 20 + i, 30 + i][: 1 + i % 3], 1 + (2 * i) % 5) for i in range(7)]
    eng.submit_all(reqs)
    slot_of, steps = {}, 0
    while eng.live or eng.queue:
        eng.step()
        steps += 1
        assert steps < 100
    by_req = defaultdict(list)
    for call in toy.calls:
        assert 1 <= len(call) <= 2                 # max_batch_size 2 < 3 slots
        slots = [s for _, _, s in call]
        assert len(set(slots)) == len(slots)       # live requests never share a slot
    # Replay the bookkeeping: each request is fed prompt + output[:-1] at positions 0, 1, ...
    for r in reqs:
        assert r.done and len(r.output) == r.max_new and eng.finished[r.rid] is r
        fed = r.prompt + r.output[:-1]
        want_out = []
        for pos, tok in enumerate(fed):
            if pos >= len(r.prompt) - 1:
                want_out.append((7 * tok + 3 * pos + r.slot) % VOCAB)
        assert r.output == want_out, r
        slot_of[r.rid] = r.slot
        by_req[r.slot].append(r.rid)
    rows = [row for call in toy.calls for row in call]
    assert len(rows) == sum(len(r.prompt) + r.max_new - 1 for r in reqs) == eng.stats.rows
    assert eng.stats.tokens == sum(r.max_new for r in reqs) and eng.stats.finished == 7
    assert any(len(v) > 1 for v in by_req.values())  # slots were reused after retirement
    assert len(eng.slots) == 3 and not eng.live
    assert max(eng.stats.batch_sizes) == 2


def test_continuous_batching_admits_while_others_run():
    toy = ToyStep()
    eng = DecodeEngine(toy, num_slots=8, max_ctx=32, max_batch_size=8, device="cpu")
    eng.submit(Request(0, [1, 2, 3], 10))
    eng.step()
    eng.step()
    eng.submit(Request(1, [4], 1))                 # arrives mid-flight, admitted next step
    eng.step()
    assert toy.calls[:2] == [[(1, 0, 0)], [(2, 1, 0)]]
    assert toy.calls[2] == [(3, 2, 0), (4, 0, 1)]
    assert 1 in eng.finished and eng.live[0].rid == 0 and eng.slots.take() == 1  # slot 1 is back


def test_idle_steps():
    toy = ToyStep()
    eng = DecodeEngine(toy, num_slots=4, max_ctx=8, max_batch_size=4, device="cpu")
    assert eng.step() == 0 and toy.calls == []     # nothing live: no model call
    eng = DecodeEngine(toy, num_slots=4, max_ctx=8, max_batch_size=4, device="cpu",
                       keep_stepping=True)
    assert eng.step() == 0 and toy.calls == [[(0, 0, 4)]]  # EP: a row on the scratch slot
    assert eng.stats.rows == 0 and eng.stats.model_calls == 1


def test_workload_is_deterministic_and_fits():
    a = Workload(5, vocab=100, max_ctx=20, prompt=(1, 12), output=(1, 30), rate=2.0)
    b = Workload(5, vocab=100, max_ctx=20, prompt=(1, 12), output=(1, 30), rate=2.0)
    ra = [r for i in range(200) for r in a.arrivals(i)]
    rb = [r for i in range(200) for r in b.arrivals(i)]
    assert [(r.rid, r.prompt, r.max_new, r.arrival) for r in ra] == \
           [(r.rid, r.prompt, r.max_new, r.arrival) for r in rb]
    assert len(ra) > 100 and all(len(r.prompt) + r.max_new <= 20 for r in ra)
    assert all(0 < t < 100 for r in ra for t in r.prompt)


def _tiny(seed=0):
    from graphrt.moe import make_step, preset
    cfg = preset("tiny", layers=1, experts=4, n_group=2, topk_group=1)
    return make_step(cfg, "cpu", max_batch_size=4, backend="triton", seed=seed)


def _run_tiny(spec, model, steps):
    eng = DecodeEngine(eager_step(spec, [1, 2, 4]), num_slots=model.cfg.num_slots,
                       max_ctx=model.cfg.max_ctx, max_batch_size=4, device="cpu")
    eng.run(steps, Workload(1, vocab=model.cfg.vocab_size, max_ctx=model.cfg.max_ctx,
                            prompt=(1, 3), output=(1, 4), rate=1.5, phase=4))
    return eng


def test_two_eager_engines_same_seed_identical_streams():
    (sa, ma), (sb, mb) = _tiny(), _tiny()
    a, b = _run_tiny(sa, ma, 8), _run_tiny(sb, mb, 8)
    assert a.stats.tokens >= 5 and a.stats.finished >= 2 and max(a.stats.batch_sizes) >= 2
    assert a.streams() == b.streams()
    for la, lb in zip(ma.layers, mb.layers):     # and the same KV history
        assert torch.equal(la.attn.k_cache, lb.attn.k_cache)


def _example():
    spec = importlib.util.spec_from_file_location("host_engine_loop",
                                                  os.path.join(ROOT, "examples", "host_engine_loop.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_cpu_mode():
    assert _example().main(["--device", "cpu", "--steps", "6", "--layers", "1", "--experts", "4",
                            "--max-bs", "4"]) == 0


class FakeRuntime:
    """What ``compare_graph_eager``/``soak`` use of a ``GraphRuntime``, on CPU: ``run`` is the
    padded eager step and returns leases like ``copy_outputs=False`` (capture needs CUDA)."""

    def __init__(self, spec, sizes):
        from graphrt.outputs import LeaseClock
        from graphrt.replay_policy import SizeTable
        self.spec, self.sizes, self.table, self.device = spec, sizes, SizeTable(sizes), torch.device("cpu")
        self._step, self._clock = eager_step(spec, sizes), LeaseClock()

    def run(self, **inputs):
        from graphrt.outputs import LeasedTensor
        self._clock.bump()
        return {"logits": LeasedTensor.lease(self._step(**inputs), self._clock)}


def test_compare_and_soak_drivers_on_cpu(monkeypatch):
    spec, model = _tiny()
    rt, kw = FakeRuntime(spec, [1, 2, 4]), dict(prompt=(1, 3), output=(1, 4), rate=1.5, phase=4)
    r = compare_graph_eager(rt, model, steps=5, **kw)
    assert r["identical"] and r["tokens"] > 0 and r["largest_batch"] >= 2, r
    assert "identical: yes" in _example().summary(r)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 20)
    r = soak(rt, model, steps=5, check_every=2, warmup=2, **kw)
    assert r["checks"] >= 2 and not r["mismatches"] and r["mem_growth"] == 0, r


# -- GPU -------------------------------------------------------------------------------------
def _captured(layers, experts, max_bs=64):
    import graphrt
    from graphrt.moe import MoEModel, preset
    cfg = preset("dsv3-like", layers=layers, experts=experts, num_slots=max_bs, max_ctx=512)
    model = MoEModel(cfg, "cuda")
    rt = graphrt.GraphRuntime(model.spec(max_bs), progress=False, copy_outputs=False).capture()
    return rt, model


@pytest.mark.gpu
def test_graph_engine_matches_eager_engine_1000_steps():
    rt, model = _captured(layers=2, experts=16)
    r = compare_graph_eager(rt, model, steps=1000, seed=0)
    print(r)
    assert r["identical"], r
    assert r["tokens"] > 5000 and r["finished"] > 100 and r["largest_batch"] >= 32
    assert rt.counters["eager"] == 0


@pytest.fixture(scope="module")
def one_layer():
    return _captured(layers=1, experts=16)


@pytest.mark.gpu
def test_kv_snapshot_restores(one_layer):
    rt, model = one_layer
    snap = KVSnapshot(model)
    k0 = model.layers[0].attn.k_cache.clone()
    rt.run(**rt.spec.random_inputs(8, "cuda", torch.Generator().manual_seed(0)))
    assert not torch.equal(model.layers[0].attn.k_cache, k0)
    snap.restore()
    assert torch.equal(model.layers[0].attn.k_cache, k0)


@pytest.mark.gpu
def test_soak_10000_steps_memory_flat_and_bitwise(one_layer):
    rt, model = one_layer
    r = soak(rt, model, steps=10_000, check_every=100)
    print(r)
    assert not r["mismatches"], r["mismatches"]
    assert r["checks"] >= 50 and r["distinct_batch_sizes"] >= 32, r
    assert r["mem_growth"] <= 0, f"memory_allocated grew by {r['mem_growth']} bytes: {r}"


@pytest.mark.multigpu
def test_example_two_ranks_deepep_identical():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "host_engine_loop.py"),
                          "--ranks", "2", "--steps", "300", "--layers", "2", "--experts", "16"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    print(out.stdout, out.stderr[-4000:])
    assert out.returncode == 0 and "identical on every rank: yes" in out.stdout
