"""GPU test of the ``modes`` suite on one H200 (a 1-layer qwen3-moe-like model with 16 experts,
sizes 1 and 8, so it compiles in a few minutes): every mode runs and times, torch.compile
takes no graph break and keeps its CUDA graphs, replays match eager, and the profiler sees
the replay's kernels; the hbm bench's read rates; the pdl bench's head starts."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def res():
    from graphrt.bench.modes import MODES, bench_modes
    from graphrt.moe import preset
    cfg = preset("qwen3-moe-like", layers=1, experts=16)
    return bench_modes(cfg, torch.device("cuda", torch.cuda.current_device()), [1, 8], MODES,
                       progress=False)


def test_every_mode_ran(res):
    assert res["errors"] == {} and res["skipped"] == {}, (res["errors"], res["skipped"])
    for row in res["rows"]:
        assert set(row["step_us"]) == set(res["modes"]), row["step_us"]
        assert row["floor_us"] > 0 and set(row["over_floor"]) == set(res["modes"])
        # At these sizes eager is launch-bound: one replay of the whole step beats it.
        assert row["step_us"]["graph"] < row["step_us"]["eager"], row["step_us"]
        # No mode reads the weights it needs faster than the device copies memory (the
        # floor); a step timed wrong or a floor counted wrong breaks this (0.8: spread).
        assert min(row["over_floor"].values()) > 0.8, (row["over_floor"], row["floor_us"])


def test_measured_bandwidth_is_physical(res):
    """The HBM bandwidth every floor divides by (a device-to-device copy, bytes read + written
    per second) is one the GPU can reach: a wrong byte count, unit or timer puts it outside."""
    bw = res["hbm_gbs"]
    if "H200" in torch.cuda.get_device_name():
        assert 1_000 < bw < 5_500, bw          # H200: 4.8 TB/s peak; 4,208-4,270 GB/s measured
    else:
        assert 100 < bw < 10_000, bw


def test_compile_has_no_graph_breaks_and_keeps_cudagraphs(res):
    for mode in ("compile", "naive-compile"):
        c = res["compile"][mode]
        assert c["graph_breaks"] == 0, c["break_reasons"]
        assert c["cudagraph_skips"] == 0, c["cudagraph_skip_reasons"]


def test_outputs_match_eager(res):
    for row in res["rows"]:
        for mode in ("graph", "graph-overlap"):
            assert row["rel_err_vs_eager"][mode] == 0.0, (mode, row["rel_err_vs_eager"])
        for mode, err in row["rel_err_vs_eager"].items():
            assert err < 3e-2, (mode, err)


def test_idle_and_host_cost_measured(res):
    for row in res["rows"]:
        for mode in ("graph", "graph-overlap"):
            idle = row["idle"][mode]
            assert idle["activities"] > 0 and 0 <= idle["idle_frac"] < 1, idle
            assert row["run_host_us"][mode] > 0
    for mode in ("graph", "graph-overlap", "naive-graph"):
        assert res["capture"][mode]["capture_s_total"] > 0


def test_every_call_timed_alike(res):
    """Each mode that has a call of its own is timed through it, back to back, and by the
    busy time and span of one profiled call: busy <= span, a call back to back takes at least
    its device work (5% spread), run() stages the inputs, so it takes at least the bare
    replay's device work, and compile's step time is its call."""
    for row in res["rows"]:
        for mode in ("graph", "graph-overlap", "compile", "naive-compile", "naive-graph"):
            call, busy, span = (row[k][mode] for k in ("call_us", "call_busy_us", "call_span_us"))
            assert 0 < busy <= span * 1.0001 and call >= 0.95 * busy, (mode, call, busy, span)
        for mode in ("graph", "graph-overlap"):
            assert row["call_us"][mode] >= 0.95 * row["idle"][mode]["busy_us"], (mode, row)
        assert row["step_us"]["compile"] == row["call_us"]["compile"]


def test_overlap_region_is_timed_alone():
    """``graphrt.bench.suites.overlap_region_us`` (the per-layer overlap figure of the moe
    suite) times each form of one layer's overlap region from its own graph; every form does
    real work."""
    from graphrt.bench.suites import overlap_region_us
    from graphrt.moe import MoEModel, preset
    dev = torch.device("cuda", torch.cuda.current_device())
    model = MoEModel(preset("dsv3-like", layers=1, experts=16), dev)
    r = overlap_region_us(model, model.layers[0].moe, 8, dev)
    for key in ("shared_us", "combine_us", "sequential_us", "overlapped_us"):
        assert r[key] > 0, r
    # one stream, one after the other: never shorter than the longer part alone (5% spread)
    assert r["sequential_us"] >= 0.95 * max(r["shared_us"], r["combine_us"]), r
    assert r["saved_us"] == pytest.approx(r["sequential_us"] - r["overlapped_us"])
    assert r["saved_frac_of_shorter"] == pytest.approx(
        r["saved_us"] / min(r["shared_us"], r["combine_us"]))


def test_hbm_bench_reads_at_a_physical_rate(tmp_path):
    """Small launches read slower than large ones, and no kind beats the copy bandwidth by
    more than the copy's own read + write count allows."""
    import json
    from graphrt.bench.hbm import main
    assert main(["--sizes", "1,64", "--cold-mb", "256", "--iters", "5",
                 "--out", str(tmp_path / "h.json")]) == 0
    doc = json.loads((tmp_path / "h.json").read_text())
    small, large = doc["results"]
    for r in (small, large):
        for kind in ("stream", "copy"):
            assert r[kind]["us"] > 0 and 0 < r[kind]["frac_hbm"] < (2.2 if kind == "copy" else 1.2)
    assert small["stream"]["gbs"] < large["stream"]["gbs"]


def test_pdl_bench_head_starts_are_physical(tmp_path):
    """With PDL on, a probe behind a primary of one program an SM starts at once (its head
    start is most of the primary); no head start is negative or longer than its primary."""
    import json
    from graphrt.bench.pdl import main
    from graphrt.kernels._util import pdl_args
    if not pdl_args():
        pytest.skip("PDL is off here (pre-Hopper GPU or GRAPHRT_PDL=0)")
    assert main(["--replays", "5", "--out", str(tmp_path / "p.json")]) == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    rows = {r["primary"]: r for r in doc["results"]}
    assert len(rows) == 5
    spin = rows["spin-1-per-sm"]
    assert spin["min_us"] > 0.5 * spin["primary_us"], spin
    for r in rows.values():
        assert 0 <= r["min_us"] <= r["median_us"] <= r["max_us"] <= 1.2 * r["primary_us"] + 2, r
        # the spins time their edge: the probe wakes after the primary's last program ended
        assert (r["wake_us"] is None) == ("spin" not in r["primary"]), r
        assert r["wake_us"] is None or 0 < r["wake_us"] < 20, r


def test_contention_bench_is_physical(tmp_path):
    """Without a flood an HBM hop is slower than an L2 hop; every flood reads at a positive
    rate below 1.2x the copy bandwidth, with each chase inside it; a flood never makes a hop
    faster than idle (beyond 10% noise)."""
    import json
    from graphrt.bench.contention import main
    assert main(["--depths", "16,128", "--reps", "2", "--hops", "100",
                 "--out", str(tmp_path / "c.json")]) == 0
    doc = json.loads((tmp_path / "c.json").read_text())
    idle, *floods = doc["results"]
    assert idle["depth_kb"] is None and 0 < idle["l2_chase_ns"] < idle["hbm_chase_ns"], idle
    assert len(floods) == 2
    for r in floods:
        assert 0 < r["flood_gbs"] < 1.2 * doc["hbm_gbs"] and r["inside"], r
        assert r["hbm_chase_ns"] > 0.9 * idle["hbm_chase_ns"], r
