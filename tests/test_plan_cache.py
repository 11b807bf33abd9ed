"""Expert plans kept on disk (``graphrt.moe.plan_cache``): the file a fingerprint names, the
round trip of a size's entries (kernel, config, candidates' timings), a size read back only
at its own ``cap``, merging what another process wrote, unusable files and directories
(a warning, then measuring), the default directory and its off switch, and the wiring into
``MoEModel``. GPU: a second model reads every size from the cache and measures nothing."""
from __future__ import annotations

import json
import warnings

import pytest

import graphrt.moe.expert_plan as ep
from graphrt.moe import MoEModel, preset
from graphrt.moe.expert_plan import Choice, ExpertPlan
from graphrt.moe.plan_cache import PlanCache, PlanCacheWarning

FP = {"gpu": "NVIDIA H200", "shapes": ["bf16:64x1536x2048", "bf16:64x2048x768"], "sms": 132}
KEYS = FP["shapes"]


def measured(bs: int, kernel: str = "triton") -> ExpertPlan:
    plan = ExpertPlan()
    plan.record(KEYS[0], bs, Choice(kernel, us=12.5), {kernel: 12.5, "decode/bn16": 20.0})
    plan.record(KEYS[1], bs, Choice("swap", 64, 2, us=8.25), {"swap/bn64/sk2": 8.25,
                                                             "decode/bn32": "RuntimeError: x"})
    return plan


def test_a_size_round_trips_with_its_timings(tmp_path):
    cache = PlanCache(tmp_path)
    path = cache.store(measured(16), FP, 16, 16, KEYS)
    assert path == cache.path(FP) and path.name.startswith("expert_plan-") and path.exists()
    back = ExpertPlan()
    assert cache.load(back, FP, 16, 16, KEYS)
    assert back.choices(16) == {KEYS[0]: Choice("triton"), KEYS[1]: Choice("swap", 64, 2)}
    assert back.choices(16)[KEYS[0]].us == 12.5
    assert back.timings(KEYS[1], 16) == {"swap/bn64/sk2": 8.25, "decode/bn32": "RuntimeError: x"}
    assert not cache.load(ExpertPlan(), FP, 8, 8, KEYS)               # a size never stored


def test_a_size_is_read_back_only_at_its_cap_and_with_every_key(tmp_path):
    cache = PlanCache(tmp_path)
    cache.store(measured(16), FP, 16, 16, KEYS)
    assert not cache.load(ExpertPlan(), FP, 16, 32, KEYS)              # another cap
    assert not cache.load(ExpertPlan(), FP, 16, 16, KEYS + ["bf16:8x16x16"])
    plan = ExpertPlan()
    assert cache.load(plan, FP, 16, 16, KEYS[:1]) and not plan.has(KEYS[1], 16)


def test_another_fingerprint_is_another_file(tmp_path):
    cache = PlanCache(tmp_path)
    other = {**FP, "gpu": "NVIDIA H100 80GB HBM3"}
    assert cache.path(other) != cache.path(FP)
    assert cache.path(dict(reversed(list(FP.items())))) == cache.path(FP)  # key order: same
    cache.store(measured(16), FP, 16, 16, KEYS)
    assert not cache.load(ExpertPlan(), other, 16, 16, KEYS)


def test_stores_merge_what_another_process_wrote(tmp_path):
    a, b = PlanCache(tmp_path), PlanCache(tmp_path)
    a.store(measured(16), FP, 16, 16, KEYS)
    b.store(measured(1, "decode"), FP, 1, 8, KEYS)
    a.store(measured(16, "deepgemm"), FP, 16, 16, KEYS)                # rewrites its own size
    sizes = json.loads(a.path(FP).read_text())["sizes"]
    assert sorted(sizes) == ["1", "16"] and sizes["1"]["cap"] == 8
    assert sizes["16"]["plan"][KEYS[0]]["kernel"] == "deepgemm"
    names = sorted(p.name for p in tmp_path.iterdir())                  # no temporary left
    assert names == [a.path(FP).name, a.path(FP).name + ".lock"]


def test_an_unreadable_or_foreign_file_warns_then_is_rewritten(tmp_path):
    cache = PlanCache(tmp_path)
    cache.path(FP).write_text("{not json")
    with pytest.warns(PlanCacheWarning, match="unreadable expert plan cache"):
        assert not cache.load(ExpertPlan(), FP, 16, 16, KEYS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                  # warned once a cache
        cache.store(measured(16), FP, 16, 16, KEYS)
    assert PlanCache(tmp_path).load(ExpertPlan(), FP, 16, 16, KEYS)
    data = json.loads(cache.path(FP).read_text())
    cache.path(FP).write_text(json.dumps({**data, "fingerprint": {"gpu": "else"}}))
    with pytest.warns(PlanCacheWarning, match="not an expert plan cache of format 1"):
        assert not PlanCache(tmp_path).load(ExpertPlan(), FP, 16, 16, KEYS)
    bad = dict(data)
    bad["sizes"]["16"]["plan"][KEYS[0]]["kernel"] = "cublas"
    cache.path(FP).write_text(json.dumps(bad))
    with pytest.warns(PlanCacheWarning, match="size 16 is not a plan entry"):
        assert not PlanCache(tmp_path).load(ExpertPlan(), FP, 16, 16, KEYS)
    # well formed but not a launch the kernels take (hand-edited, another kernel set): it
    # would fail at the step; it is measured again instead
    for field, value in (("block_n", 7), ("num_warps", 3)):
        bad = json.loads(json.dumps(data))
        bad["sizes"]["16"]["plan"][KEYS[0]].update(kernel="decode", **{field: value})
        cache.path(FP).write_text(json.dumps(bad))
        with pytest.warns(PlanCacheWarning, match=f"size 16 is not a plan entry.*{field}"):
            assert not PlanCache(tmp_path).load(ExpertPlan(), FP, 16, 16, KEYS)


def test_an_unwritable_directory_warns_and_keeps_the_plan(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = PlanCache(blocker / "sub")
    plan = measured(16)
    with pytest.warns(PlanCacheWarning, match="cannot write the expert plan cache"):
        assert cache.store(plan, FP, 16, 16, KEYS) is None
    assert plan.choices(16)[KEYS[0]] == Choice("triton")


def test_store_refuses_a_size_the_plan_lacks(tmp_path):
    with pytest.raises(ValueError, match="no entry for batch 8 of every key"):
        PlanCache(tmp_path).store(measured(16), FP, 8, 8, KEYS)


def test_default_directory_and_its_off_switch(monkeypatch, tmp_path):
    monkeypatch.delenv("GRAPHRT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert PlanCache.default().dir == tmp_path / "graphrt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert PlanCache.default().dir == tmp_path / "home" / ".cache" / "graphrt"
    monkeypatch.setenv("GRAPHRT_CACHE_DIR", str(tmp_path / "mine"))
    assert PlanCache.default().dir == tmp_path / "mine"
    for off in ("off", "0", "", "None"):
        monkeypatch.setenv("GRAPHRT_CACHE_DIR", off)
        assert PlanCache.default() is None and PlanCache.from_setting(off) is None
    assert PlanCache.from_setting(str(tmp_path / "d")).dir == tmp_path / "d"
    assert PlanCache.from_setting(None) is None              # None: the default (off here)


def test_model_wiring_on_cpu(tmp_path):
    """A CPU model keeps no cache (nothing is timed there) and says its sizes are untimed; a
    fixed backend refuses a cache; a given table's sizes are 'given'."""
    model = MoEModel(preset("tiny"), "cpu", plan_cache=tmp_path)
    assert model.plan_cache is None
    model.prepare(4)
    assert model.plan_origin == {4: "untimed"} and not list(tmp_path.iterdir())
    assert model.compiled_ahead == (0, 0, 0.0)  # nothing built ahead where nothing is timed
    with pytest.raises(ValueError, match="plan_cache= needs backend='auto'"):
        MoEModel(preset("tiny"), "cpu", backend="triton", plan_cache=tmp_path)
    given = MoEModel(preset("tiny"), "cpu", expert_plan=model.expert_plan())
    given.prepare(4)
    given.prepare(2)
    assert given.plan_origin == {4: "given", 2: "untimed"}


# ------------------------------------------------------------------------------- GPU (H200)
@pytest.mark.gpu
def test_gpu_second_model_reads_every_size_and_measures_nothing(tmp_path):
    import torch

    import graphrt
    from graphrt.moe import make_step
    from graphrt.moe.plan_cache import fingerprint
    cfg = preset("qwen3-moe-like", layers=1, experts=16)
    sizes = [1, 4, 16]
    spec, first = make_step(cfg, "cuda", max_batch_size=16, plan_cache=tmp_path)
    graphrt.GraphRuntime(spec, sizes=sizes, progress=False).capture()
    assert first.plan_origin == {s: "measured" for s in sizes}
    files = [f for f in tmp_path.iterdir() if f.suffix != ".lock"]   # (the writers' lock file)
    fp = fingerprint(first.layers[0].moe.experts, num_topk=cfg.num_topk,
                     num_experts=cfg.num_experts, num_ranks=1)
    assert files == [PlanCache(tmp_path).path(fp)]
    assert fp["gpu"] == torch.cuda.get_device_name() and fp["local_experts"] == 16
    from graphrt.moe.experts import deep_gemm_available
    if deep_gemm_available():  # a DeepGEMM upgrade is another fingerprint
        import deep_gemm
        assert fp["deep_gemm"] == deep_gemm.__version__ is not None

    real = ep._graph_us
    ep._graph_us = lambda *a, **k: pytest.fail("a cached size was measured again")
    try:
        spec2, second = make_step(cfg, "cuda", max_batch_size=16, plan_cache=PlanCache(tmp_path))
        rt = graphrt.GraphRuntime(spec2, sizes=sizes, progress=False).capture()
    finally:
        ep._graph_us = real
    assert second.plan_origin == {s: "cache" for s in sizes}
    assert second.expert_plan() == first.expert_plan()
    checks = rt.check_replay(trials=1)
    assert all(c.ok for c in checks), [str(c) for c in checks if not c.ok]


def test_deep_gemm_version_comes_from_the_module(monkeypatch):
    """The fingerprint's DeepGEMM version is the importable module's: our wheels are named
    ``tokenspeed-deepgemm``, so asking for a ``deep_gemm`` distribution found none."""
    import sys
    import types

    from graphrt.moe import experts, plan_cache
    monkeypatch.setattr(experts, "deep_gemm_available", lambda: False)
    assert plan_cache._deep_gemm_version() is None
    monkeypatch.setitem(sys.modules, "deep_gemm",
                        types.SimpleNamespace(__version__="2.5.0.post20260424"))
    monkeypatch.setattr(experts, "deep_gemm_available", lambda: True)
    assert plan_cache._deep_gemm_version() == "2.5.0.post20260424"


def test_stores_at_the_same_time_lose_no_size(tmp_path, monkeypatch):
    """Two writers (threads here; EP ranks of one host share the file) each read the file,
    added their size and replaced it: a size another wrote between the read and the replace
    was lost (38 of 60 sizes survived two processes). The read-merge-write is now locked."""
    import threading
    import time
    import graphrt.moe.plan_cache as pc
    real = pc.tempfile.mkstemp

    def slow_mkstemp(*args, **kw):  # widen the window between the read and the replace
        time.sleep(0.01)
        return real(*args, **kw)

    monkeypatch.setattr(pc.tempfile, "mkstemp", slow_mkstemp)

    def writer(first):
        cache = PlanCache(tmp_path)
        for bs in range(first, 40, 2):
            cache.store(measured(bs), FP, bs, bs, KEYS)

    threads = [threading.Thread(target=writer, args=(first,)) for first in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    sizes = json.loads(PlanCache(tmp_path).path(FP).read_text())["sizes"]
    assert sorted(map(int, sizes)) == list(range(40))


@pytest.mark.parametrize("field,text", [("block_n", "1e400"), ("num_warps", "Infinity"),
                                        ("split_k", "-1e999")])
def test_an_out_of_range_number_warns_and_measures(field, text, tmp_path):
    """``int(inf)`` raised OverflowError out of ``load`` (and on CUDA out of
    ``MoEModel.prepare``) where any other bad entry is a warning and a measurement."""
    cache = PlanCache(tmp_path)
    entry = '{"kernel": "decode", "%s": %s}' % (field, text)
    cache.path(FP).write_text('{"format": 1, "fingerprint": %s, "sizes": {"16": {"cap": 16, '
                              '"plan": {"%s": %s, "%s": %s}}}}'
                              % (json.dumps(FP), KEYS[0], entry, KEYS[1], entry))
    with pytest.warns(PlanCacheWarning, match="not a plan entry"):
        assert cache.load(ExpertPlan(), FP, 16, 16, KEYS) is False


@pytest.mark.parametrize("switch", ["grouped_gemm.TMA", "grouped_gemm_decode.FP8_MMA",
                                    "activation.COMPACT", "_util.pdl_enabled"])
def test_a_kernel_switch_is_another_file(monkeypatch, switch):
    """``GRAPHRT_EXPERT_TMA``, ``GRAPHRT_FP8_MMA``, ``GRAPHRT_ACT_COMPACT`` and ``GRAPHRT_PDL``
    change the kernels a plan times; a plan measured under one was read back under another
    (one file for both). The CUDA device properties are stubbed: the fingerprint reads them."""
    import types

    import torch

    import importlib
    from pathlib import Path

    from graphrt.moe.plan_cache import fingerprint
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(
        name="NVIDIA H200", multi_processor_count=132, major=9, minor=0))
    experts = MoEModel(preset("tiny"), "cpu").layers[0].moe.experts
    module, name = switch.split(".")
    mod = importlib.import_module(f"graphrt.kernels.{module}")

    def path(on: bool) -> Path:
        monkeypatch.setattr(mod, name, (lambda: on) if name == "pdl_enabled" else on)
        return PlanCache(Path("/nonexistent")).path(
            fingerprint(experts, num_topk=2, num_experts=8, num_ranks=1))
    assert path(True) != path(False)
