"""The host engine (graphrt/testing/engine.py, examples/host_engine_loop.py) over a paged KV cache.

CPU: block bookkeeping (reservations, lazy growth, reuse, waiting for blocks), admission/
retirement/teacher forcing with a toy step whose greedy sample is a known function of its
inputs and which checks every row's paged metadata, idle steps, workload determinism, and the
real ``tiny`` model (kernels on the Triton interpreter): two engines built from the same
seed, two engines placing the same requests in different blocks, and the example's CPU mode
(one model, KV restored between runs), give identical streams.
``GraphRuntime.capture()`` needs CUDA, so on CPU the engine runs with the eager step.

GPU: graph vs eager token streams identical over 1,000 steps; the 10,000-step soak (memory
flat, sampled replays bitwise equal to eager). Two GPUs: the example's DeepEP mode.
"""
import os
import random
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from graphrt.testing.engine import (BlockPool, DecodeEngine, KVSnapshot, Request, Workload,
                                    compare_graph_eager, eager_step, soak)
from graphrt.errors import GraphrtError, InputError
from tests.examples import load_example

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 50


class ToyStep:
    """logits = one_hot((7 token + 3 position) % VOCAB): a greedy sample we can predict. Checks
    each row's paged metadata against ``block_size``/``scratch`` and records every call's rows
    as (token, position, slot, owned blocks)."""

    def __init__(self, block_size=4, scratch=None):
        self.calls, self.block_size, self.scratch = [], block_size, scratch

    def __call__(self, tokens, positions, slot_mapping, block_table, seq_lens):
        assert tokens.dtype == slot_mapping.dtype == torch.int64
        assert positions.dtype == block_table.dtype == seq_lens.dtype == torch.int32
        B, rows = self.block_size, []
        for tok, pos, slot, table, L in zip(tokens.tolist(), positions.tolist(),
                                            slot_mapping.tolist(), block_table.tolist(), seq_lens.tolist()):
            owned = -(-L // B)
            assert L == pos + 1 and slot == table[pos // B] * B + pos % B
            if self.scratch is not None:
                assert all(b == self.scratch for b in table[owned:])   # unused entries: scratch
            rows.append((tok, pos, slot, tuple(table[:owned])))
        self.calls.append(rows)
        nxt = (7 * tokens + 3 * positions.long()) % VOCAB
        return torch.nn.functional.one_hot(nxt, VOCAB).float()


def _toy_engine(toy, **kw):
    kw = dict(num_slots=4, max_ctx=32, max_batch_size=4, device="cpu", block_size=toy.block_size) | kw
    eng = DecodeEngine(toy, **kw)
    toy.scratch = eng.scratch_block
    return eng


def test_block_pool():
    pool = BlockPool(3)
    assert pool.reserve(2) and not pool.reserve(2) and pool.available == 1
    a, b = pool.take(), pool.take()
    assert (a, b) == (0, 1) and len(pool) == 1 and pool.reserved == 0
    with pytest.raises(GraphrtError, match="without a reservation"):
        pool.take()
    assert pool.reserve(1)
    pool.give([b], unreserve=1)                    # a finished request gives back its promise too
    assert pool.available == 2 and pool.reserve(1) and pool.take() == b  # freed block reused first
    with pytest.raises(GraphrtError, match="double free"):
        pool.give([7])


def test_submit_validates_lengths():
    eng = DecodeEngine(ToyStep(), num_slots=4, max_ctx=8, max_batch_size=4, device="cpu")
    with pytest.raises(InputError, match="exceeds the KV cache"):
        eng.submit(Request(0, [1] * 5, 4))
    with pytest.raises(InputError, match="prompt token"):
        eng.submit(Request(1, [], 2))
    eng.submit(Request(2, [1] * 5, 3))             # 5 + 3 = max_ctx: fits
    small = DecodeEngine(ToyStep(), num_slots=4, max_ctx=32, max_batch_size=4, device="cpu",
                         block_size=4, num_blocks=3)
    with pytest.raises(InputError, match="needs 3 KV blocks, the cache has 2"):
        small.submit(Request(3, [1] * 6, 4))       # 9 positions: 3 blocks of 4


def test_admission_teacher_forcing_block_reuse_and_retirement():
    toy = ToyStep(block_size=2)
    eng = _toy_engine(toy, num_slots=3, max_batch_size=2)
    reqs = [Request(i, [10 + i, 20 + i, 30 + i][: 1 + i % 3], 1 + (2 * i) % 5) for i in range(7)]
    eng.submit_all(reqs)
    steps, owner = 0, {}
    while eng.live or eng.queue:
        eng.step()
        steps += 1
        assert steps < 100
    for call in toy.calls:
        assert 1 <= len(call) <= 2                 # max_batch_size 2 < 3 slots
        blocks = [b for *_, owned in call for b in owned]
        assert len(set(blocks)) == len(blocks)     # live requests never share a block
    # Replay the bookkeeping: each request is fed prompt + output[:-1] at positions 0, 1, ...
    by_req = defaultdict(list)
    rows = [row for call in toy.calls for row in call]
    for r in reqs:
        assert r.done and len(r.output) == r.max_new and eng.finished[r.rid] is r
        fed = r.prompt + r.output[:-1]
        assert r.output == [(7 * tok + 3 * pos) % VOCAB for pos, tok in enumerate(fed)
                            if pos >= len(r.prompt) - 1], r
        assert not r.blocks and r.reserved == 0    # everything went back
    for tok, pos, slot, owned in rows:
        assert len(owned) == pos // 2 + 1          # a block is taken when the context enters it
        by_req[owned[0]].append(owned)
        owner.setdefault(owned, tok)
    assert len(rows) == sum(len(r.prompt) + r.max_new - 1 for r in reqs) == eng.stats.rows
    assert eng.stats.tokens == sum(r.max_new for r in reqs) and eng.stats.finished == 7
    assert len(by_req) < len(reqs)                 # first blocks were reused after retirement
    assert len(eng.blocks) == eng.blocks.num_blocks and eng.blocks.reserved == 0 and not eng.live
    assert max(eng.stats.batch_sizes) == 2


def test_a_request_waits_for_blocks_without_preemption():
    toy = ToyStep(block_size=2)
    eng = _toy_engine(toy, num_blocks=5)           # 4 blocks + scratch
    eng.submit(Request(0, [1, 2, 3], 4))           # 6 positions: 3 blocks, taken one by one
    eng.submit(Request(1, [4], 4))                 # 4 positions: 2 blocks > 1 left: waits
    eng.submit(Request(2, [5], 1))                 # behind it in the queue (FIFO): waits too
    eng.step()
    assert [r.rid for r in eng.live] == [0] and len(eng.queue) == 2
    assert eng.live[0].blocks == [0] and eng.live[0].reserved == 2 and eng.blocks.available == 1
    while 0 not in eng.finished:
        assert [r.rid for r in eng.live] == [0]
        eng.step()
    assert toy.calls[5][0][3] == (0, 1, 2)         # position 5 in its third block
    eng.step()                                      # request 0 retired: 1 and 2 admitted
    assert [row[0] for row in toy.calls[6]] == [4, 5]
    assert toy.calls[6][0][3] == (2,) and toy.calls[6][1][3] == (1,)   # LIFO reuse


def test_continuous_batching_admits_while_others_run():
    toy = ToyStep(block_size=2)
    eng = _toy_engine(toy, num_slots=8, max_batch_size=8)
    eng.submit(Request(0, [1, 2, 3], 10))
    eng.step()
    eng.step()
    eng.submit(Request(1, [4], 1))                 # arrives mid-flight, admitted next step
    eng.step()
    assert toy.calls[:2] == [[(1, 0, 0, (0,))], [(2, 1, 1, (0,))]]
    assert toy.calls[2] == [(3, 2, 2, (0, 1)), (4, 0, 4, (2,))]
    assert 1 in eng.finished and eng.live[0].rid == 0
    assert eng.blocks.reserve(1) and eng.blocks.take() == 2       # request 1's block is back


def test_idle_steps():
    toy = ToyStep()
    eng = _toy_engine(toy)
    assert eng.step() == 0 and toy.calls == []     # nothing live: no model call
    eng = _toy_engine(toy, keep_stepping=True)
    s = eng.scratch_block
    assert s == 4 * 8                              # num_slots 4 x ceil(32 / 4) blocks, then scratch
    assert eng.step() == 0 and toy.calls == [[(0, 0, s * 4, (s,))]]  # EP: a row on the scratch block
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
    # prompts that reach max_ctx: max_new went to 0 or below (and long_requests' p + 1
    # past max_ctx), which submit() refuses mid-run
    from graphrt.testing.requests import long_requests
    small = [r for i in range(200) for r in Workload(5, vocab=100, max_ctx=12, rate=2.0).arrivals(i)]
    longs = long_requests(50, 3, vocab=100, max_ctx=12)
    for r in small + longs:
        assert len(r.prompt) >= 1 and r.max_new >= 1 and len(r.prompt) + r.max_new <= 12, r


def _tiny(seed=0):
    from graphrt.moe import make_step, preset
    cfg = preset("tiny", layers=1, experts=4, n_group=2, topk_group=1, block_size=2)  # short
    return make_step(cfg, "cpu", max_batch_size=4, backend="triton", seed=seed)   # requests cross pages


def _run_tiny(spec, model, steps, shuffle_blocks=None):
    eng = DecodeEngine.for_config(eager_step(spec, [1, 2, 4]), model.cfg, max_batch_size=4, device="cpu")
    if shuffle_blocks is not None:  # another placement of the same requests' pages
        random.Random(shuffle_blocks).shuffle(eng.blocks._free)
    eng.run(steps, Workload(1, vocab=model.cfg.vocab_size, max_ctx=model.cfg.max_ctx,
                            prompt=(1, 3), output=(1, 4), rate=1.5, phase=4))
    return eng


@pytest.mark.slow
def test_two_eager_engines_same_seed_identical_streams():
    (sa, ma), (sb, mb) = _tiny(), _tiny()
    a, b = _run_tiny(sa, ma, 8), _run_tiny(sb, mb, 8)
    assert a.stats.tokens >= 5 and a.stats.finished >= 2 and max(a.stats.batch_sizes) >= 2
    assert a.streams() == b.streams()
    for la, lb in zip(ma.layers, mb.layers):     # and the same KV history
        assert torch.equal(la.attn.k_cache, lb.attn.k_cache)


@pytest.mark.slow
def test_block_placement_does_not_change_streams():
    """The same workload with the pool's free list shuffled: other blocks, same tokens."""
    spec, model = _tiny()
    snap = KVSnapshot(model)
    a = _run_tiny(spec, model, 8)
    snap.restore()
    b = _run_tiny(spec, model, 8, shuffle_blocks=3)
    assert a.stats.tokens >= 5 and a.streams() == b.streams()


def _example():
    return load_example("host_engine_loop")


@pytest.mark.slow
def test_example_cpu_mode(monkeypatch, capsys):
    """With TRITON_INTERPRET=0 (a GPU machine's setting) the CPU run kept it and died in
    Triton ("0 active drivers"); it turns the interpreter on and says so, as the demo does."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _example().main(["--device", "cpu", "--steps", "6", "--layers", "1", "--experts", "4",
                            "--max-bs", "4"]) == 0
    assert "TRITON_INTERPRET=0 turns Triton's interpreter off" in capsys.readouterr().err


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


@pytest.mark.slow
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
    # a soak shorter than its warm-up and its check interval: it had no memory baseline
    # (the example printed GREW and exited 1) and compared no replay (0 checks, reported
    # as 0 mismatches)
    r = soak(rt, model, steps=6, **kw)
    assert r["mem_before"] is not None and r["mem_growth"] == 0, r
    assert r["checks"] == 1 and not r["mismatches"], r


# -- GPU -------------------------------------------------------------------------------------
def _captured(layers, experts, max_bs=64):
    import graphrt
    from graphrt.moe import MoEModel, preset
    cfg = preset("dsv3-like", layers=layers, experts=experts, num_slots=max_bs, max_ctx=512)
    model = MoEModel(cfg, "cuda")
    rt = graphrt.GraphRuntime(model.spec(max_bs), progress=False, copy_outputs=False).capture()
    return rt, model


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.gpu
def test_soak_10000_steps_memory_flat_and_bitwise(one_layer):
    rt, model = one_layer
    r = soak(rt, model, steps=10_000, check_every=100)
    print(r)
    assert not r["mismatches"], r["mismatches"]
    assert r["checks"] >= 50 and r["distinct_batch_sizes"] >= 32, r
    assert r["mem_growth"] <= 0, f"memory_allocated grew by {r['mem_growth']} bytes: {r}"


@pytest.mark.slow
@pytest.mark.multigpu
def test_example_two_ranks_deepep_identical():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "host_engine_loop.py"),
                          "--ranks", "2", "--steps", "300", "--layers", "2", "--experts", "16"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    print(out.stdout, out.stderr[-4000:])
    assert out.returncode == 0 and "identical on every rank: yes" in out.stdout
