"""CPU tests of ``graphrt bench``: the tiny smoke run and its JSON fields, exit 1 when nothing
is measured, refusals (exit 2, one line, before any work) including ``--out``, symlink-safe
writes, the EP launcher (with a fake spawn), the idle-fraction interval union, the naive
peer, plots and the markdown."""
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

import graphrt
from graphrt.cli import main as cli
from graphrt.bench.modes import MODES, floor_bytes, parse_modes
from graphrt.moe import make_step, preset
from graphrt.bench.profile import device_intervals_us, idle_stats, union_us


# -- idle fraction ----------------------------------------------------------------------------
def test_union_counts_overlaps_once():
    assert union_us([]) == 0.0
    assert union_us([(0, 10), (20, 30)]) == 20
    assert union_us([(0, 10), (5, 15)]) == 15                  # two streams overlapping
    assert union_us([(0, 30), (5, 10), (12, 20)]) == 30        # nested
    assert union_us([(20, 30), (0, 10), (10, 20)]) == 30       # unsorted, touching
    assert union_us([(0, 10), (3, 3), (8, 5)]) == 10           # empty and reversed count zero


def test_idle_stats():
    st = idle_stats([(100, 140), (120, 160), (170, 190)], wall_us=100.0)
    assert st["busy_us"] == 80 and st["span_us"] == 90 and st["activities"] == 3
    assert st["idle_frac"] == pytest.approx(0.2)
    assert st["idle_frac_in_span"] == pytest.approx(1 - 80 / 90)
    assert idle_stats([(0, 120)], wall_us=100.0)["idle_frac"] == 0.0  # profiler skew: clamp
    assert idle_stats([], wall_us=10.0)["idle_frac"] == 1.0


def test_device_intervals_keep_only_gpu_work():
    from torch.autograd import DeviceType

    class Ev:
        def __init__(self, kind, dev, name, start, dur):
            self.k, self.d, self.n, self.s, self.u = kind, dev, name, start, dur
        activity_type = lambda self: self.k  # noqa: E731
        device_type = lambda self: self.d  # noqa: E731
        name = lambda self: self.n  # noqa: E731
        start_ns = lambda self: self.s  # noqa: E731
        duration_ns = lambda self: self.u  # noqa: E731

    evs = [Ev("kernel", DeviceType.CUDA, "gemm", 1000, 2000),
           Ev("gpu_memcpy", DeviceType.CUDA, "Memcpy DtoD", 4000, 1000),
           Ev("gpu_user_annotation", DeviceType.CUDA, "step", 0, 9000),
           Ev("cuda_sync", DeviceType.CUDA, "Stream Wait Event", 3000, 1000),
           Ev("cuda_runtime", DeviceType.CPU, "cudaGraphLaunch", 0, 500)]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: evs)))
    assert device_intervals_us(prof) == [(1.0, 3.0), (4.0, 5.0)]


# -- modes, naive peer, floor -------------------------------------------------------------------
def test_parse_modes():
    assert parse_modes("naive,eager") == ["eager", "naive", "naive-compile", "naive-graph"]
    assert parse_modes(["graph-overlap", "compile"]) == ["compile", "graph-overlap"]
    assert parse_modes(list(MODES)) == list(MODES)
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("eager,fast")


@pytest.fixture(scope="module")
def tiny():
    return make_step(preset("tiny"), "cpu", max_batch_size=8, backend="triton")


@pytest.mark.parametrize("routing", ["grouped_sigmoid", "softmax"])
def test_naive_peer_computes_the_same_step(routing):
    from graphrt.bench.naive import NaiveMoE, NaiveTooLarge
    cfg = preset("tiny") if routing == "grouped_sigmoid" else preset("tiny", routing="softmax")
    spec, model = make_step(cfg, "cpu", max_batch_size=8, backend="triton")
    nv = NaiveMoE(model)
    assert nv.layers[0].w1.data_ptr() == model.layers[0].moe.experts.w13.data_ptr()  # borrowed
    inputs = spec.random_inputs(6, "cpu", torch.Generator().manual_seed(0))
    ref = spec.call(inputs)["logits"].float()
    out = nv.step(**inputs)["logits"].float()
    err = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(err.median()) < 3e-2, err  # bf16 near-ties may route one row elsewhere
    nv.max_gather_bytes = nv.gather_bytes(2)
    with pytest.raises(NaiveTooLarge, match="batch 6"):
        nv.step(**inputs)


def test_floor_counts_experts_hit_per_layer(tiny):
    spec, model = tiny
    cfg = model.cfg
    inputs = spec.random_inputs(5, "cpu", torch.Generator().manual_seed(2))
    per_expert = model.layers[0].moe.experts.weight_bytes // cfg.num_experts
    kv = int((inputs["positions"].long() + 1).sum()) * cfg.kv_dim * 4 * cfg.num_layers
    routed = floor_bytes(model, spec, inputs) - model.weight_bytes()["dense"] - kv
    assert routed % per_expert == 0
    assert cfg.num_layers * cfg.num_topk <= routed // per_expert <= cfg.num_layers * cfg.num_experts
    assert all(type(l.moe.experts).__name__ == "Experts" for l in model.layers)  # restored


# -- the CLI --------------------------------------------------------------------------------------
def test_bench_cpu_smoke(tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the smoke run checks the plot it writes
    out = tmp_path / "o"
    assert cli.main(["bench", "--config", "tiny", "--device", "cpu", "--sizes", "1,2",
                     "--out", str(out)]) == 0
    res = json.load(open(out / "results.json"))
    assert res["schema_version"] == 1 and res["graphrt_version"] == graphrt.__version__
    assert res["device"] == "cpu" and res["suites"] == ["modes"] and res["measured"] is True
    assert res["comms"] == ["local"] and res["ranks"] == 1
    m = res["modes"]
    for key in ("config", "layers", "experts", "hidden", "num_topk", "moe_inter", "fp8", "device",
                "comm", "num_ranks", "sizes", "modes", "expert_backend", "hbm_gbs", "skipped",
                "errors", "capture", "compile", "plots", "rows"):
        assert key in m, key
    assert m["config"] == "tiny" and m["sizes"] == [1, 2] and m["modes"] == list(MODES)
    assert m["errors"] == {} and m["hbm_gbs"] is None
    assert set(m["skipped"]) == {"compile", "graph", "graph-overlap", "naive-compile", "naive-graph"}
    assert all("CUDA" in why for why in m["skipped"].values())
    assert m["compile"]["compile"]["graph_breaks"] == 0, m["compile"]
    assert m["plots"]["step_time"] == "step_time.png" and m["plots"]["over_floor"] is None
    assert os.path.getsize(out / "step_time.png") > 1000
    for row in m["rows"]:
        for key in ("bs", "step_us", "floor_us", "over_floor", "speedup_vs_eager",
                    "rel_err_vs_eager", "rows_off_vs_eager", "idle", "run_host_us", "notes"):
            assert key in row, key
        assert row["step_us"]["eager"] > 0 and row["step_us"]["naive"] > 0
        assert row["rel_err_vs_eager"]["naive"] < 3e-2
        assert row["floor_us"] is None and row["idle"] == {} and row["run_host_us"] == {}
    assert m["rows"][0]["rel_err_vs_eager"]["compile"] == 0.0
    md = (out / "results.md").read_text()
    assert "| bs | eager µs | naive µs | floor µs |" in md and "graph: skipped" in md
    stdout = capsys.readouterr().out
    assert "eager µs" in stdout  # the tables, as markdown (no terminal)
    assert stdout.splitlines()[-1] == (f"graphrt bench: wrote results.json, results.md, "
                                       f"step_time.png in {out}")  # where the files went
    assert not [p for p in os.listdir(out) if p.startswith(".")]  # no temporary files left


def test_bench_nothing_measured_exits_1(tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"
    argv = ["bench", "--device", "cpu", "--sizes", "1", "--out", str(out)]
    assert cli.main([*argv, "--modes", "graph,naive-graph"]) == 1  # every mode skipped on CPU
    err = capsys.readouterr().err
    assert "nothing was measured (graph: CUDA graphs need a CUDA GPU" in err, err
    assert json.load(open(out / "results.json"))["measured"] is False

    import graphrt.bench.modes as modes_mod

    def broken(b, mode):
        raise RuntimeError("kernel exploded")
    monkeypatch.setitem(modes_mod.RUNNERS, "eager", broken)
    assert cli.main([*argv, "--modes", "eager"]) == 1  # every mode failed
    err = capsys.readouterr().err
    assert "eager: RuntimeError: kernel exploded" in err.splitlines()[-1], err
    assert json.load(open(out / "results.json"))["modes"]["errors"] == {
        "eager": "RuntimeError: kernel exploded"}


@pytest.mark.parametrize("argv,match", [
    (["--device", "cpu", "--config", "dsv3-like"], "only the smoke mode"),
    (["--device", "cpu", "--suite", "runtime"], "suite runtime needs a CUDA GPU"),
    (["--device", "cpu", "--suite", "modes,moe"], "suite moe needs a CUDA GPU"),
    (["--device", "cpu", "--suite", "ep"], "suite ep needs an expert-parallel --comm"),
    (["--device", "cpu", "--sizes", "1,64"], "KV-cache slots"),
    (["--device", "cpu", "--fp8"], "--fp8 needs DeepGEMM on a CUDA GPU"),
    (["--device", "cpu", "--max-tokens", "8"], "--max-tokens sizes the expert-parallel buffers"),
    (["--device", "cpu", "--experts", "1"], "num_topk must be in [1, num_experts]"),
    (["--device", "cuda"], "torch sees no CUDA GPU here"),
    (["--ranks", "2"], "--ranks 2 needs an expert-parallel --comm"),
    (["--comm", "local,nccl"], "--comm local is one GPU"),
    (["--comm", "nccl", "--ranks", "1"], "needs --ranks 2 or more, got 1"),
    (["--comm", "nccl"], "runs one process per CUDA GPU; torch sees none"),
    (["--comm", "deepep-hook"], "cannot be imported here"),
    (["--layers", "0"], "argument --layers: expected an int >= 1, got '0'"),
    (["--comm", "deepep"], "expected comma-separated backends from local, deepep-hook"),
    (["--modes", "eager,warp"], "expected comma-separated modes from eager"),
    (["--suite", "modes,fast"], "expected comma-separated suites from runtime"),
    (["--config", "nope"], "invalid choice: 'nope' (choose from 'dsv3-like', 'qwen3-moe-like'"),
])
def test_bench_refuses_in_one_line(argv, match, monkeypatch, capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the refusals of a machine without CUDA")
    monkeypatch.setitem(sys.modules, "graphrt.comm.deepep_ll", None)  # as if not written yet
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["bench", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("graphrt bench: ") and match in err, err
    assert not (tmp_path / "o").exists()


def test_bench_under_torchrun_takes_one_backend(monkeypatch, capsys, tmp_path):
    from graphrt.bench.plan import Refusal, plan
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = cli.build_parser().parse_args(["bench", "--out", str(tmp_path / "o"), "--comm", "nccl"])
    p = plan(args)
    assert (p.ranks, p.torchrun, p.suites, p.sizes, p.max_tokens) == (2, True, ["ep"], [1, 8, 32, 128], 128)
    for argv, match in ((["--comm", "nccl,deepep-hook"], "under torchrun one --comm per run"),
                        (["--comm", "nccl", "--ranks", "4"], "torchrun started 2 processes"),
                        (["--comm", "nccl", "--suite", "runtime"], "suite runtime is single-GPU"),
                        (["--comm", "nccl", "--device", "cuda:1"], "put rank r on cuda:r"),
                        (["--comm", "nccl", "--max-tokens", "64"], "below the largest --sizes 128"),
                        (["--comm", "nccl", "--suite", "ep", "--modes", "eager"],
                         "--modes applies to the modes suite"),
                        ([], "torchrun started 2 processes, but --comm local is one GPU")):
        with pytest.raises(Refusal, match=match):
            plan(cli.build_parser().parse_args(["bench", "--out", str(tmp_path / "o"), *argv]))


def test_bench_ep_spawns_each_backend(monkeypatch, tmp_path, capsys):
    """One launcher: each --comm runs in its own spawned ranks; rank 0's results land under
    ep[comm]; a backend failing on a rank is recorded and makes the exit code 1."""
    import graphrt.testing.launch as launch
    from graphrt.bench import run
    from graphrt.bench.plan import Plan
    calls = []

    def fake_spawn(fn, world, comm, opts, timeout_s=600):
        calls.append((fn.__name__, world, comm, opts["sizes"], opts["suites"]))
        if comm == "nccl":
            return [{"rank": 0, "ok": True}, {"rank": 1, "ok": False, "error": "RuntimeError: NCCL",
                                              "traceback": "Traceback ..."}]
        row = {"bs": 8, "eager_us": 900.0, "replay_us": 300.0, "replay_no_overlap_us": 320.0,
               "comm_only_us": 40.0, "raw_deepep_us": 38.0, "overhead_vs_deepep": 40 / 38 - 1,
               "speedup_vs_eager": 3.0}
        ep = {"comm": comm, "config": "dsv3-like", "layers": 4, "experts": 256, "ranks": world,
              "max_tokens": 8, "rows": [row]}
        return [{"rank": 0, "ok": True, "ep": ep}, {"rank": 1, "ok": True}]
    monkeypatch.setattr(launch, "spawn", fake_spawn)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "FakeGPU")
    p = Plan(suites=["ep"], cfg=preset("dsv3-like"), sizes=[8], modes=list(MODES),
             comms=["deepep-hook", "nccl"], ranks=2, torchrun=False, device="cuda",
             out=str(tmp_path / "o"), fp8=False, max_tokens=8)
    assert run._run_ep(p) == 1
    assert calls == [("run_rank", 2, "deepep-hook", [8], ["ep"]), ("run_rank", 2, "nccl", [8], ["ep"])]
    res = json.load(open(tmp_path / "o" / "results.json"))
    assert res["comms"] == ["deepep-hook", "nccl"] and res["ranks"] == 2 and res["measured"]
    assert res["ep"]["deepep-hook"]["ep"]["rows"][0]["raw_deepep_us"] == 38.0
    assert res["ep"]["nccl"] == {"error": "rank 1: RuntimeError: NCCL"}
    out, err = capsys.readouterr()
    assert "| 8 | 900 | 300 | 3.00 | 320 | 40.0 | 38.0 | +5.3% |" in out
    assert "--comm nccl failed on rank 1: RuntimeError: NCCL" in err


def test_out_is_checked_before_any_work(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    os.symlink(tmp_path / "elsewhere.json", tmp_path / "dir" / "results.json")
    (tmp_path / "dir2").mkdir()
    (tmp_path / "dir2" / "results.md").mkdir()
    for out, match in ((tmp_path / "file", "is a file, expected a folder"),
                       (tmp_path / "file" / "sub", "cannot be created"),
                       (tmp_path / "dir", "results.json there is a symbolic link"),
                       (tmp_path / "dir2", "results.md there is not a regular file")):
        assert cli.main(["bench", "--device", "cpu", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err, err
    assert not (tmp_path / "elsewhere.json").exists()


def test_write_file_replaces_a_symlink_instead_of_following_it(tmp_path):
    from graphrt.bench.output import write_file
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.symlink(victim, tmp_path / "results.json")  # planted after the up-front check
    path = write_file(str(tmp_path), "results.json", '{"a": 1}\n')
    assert victim.read_text() == "keep me"
    assert not os.path.islink(path) and open(path).read() == '{"a": 1}\n'
    assert write_file(str(tmp_path / "new"), "results.md", b"x") == str(tmp_path / "new" / "results.md")
    assert sorted(os.listdir(tmp_path)) == ["new", "results.json", "victim.txt"]  # no temp files


def test_cli_names_match_their_sources():
    """graphrt.cli.main spells the preset, mode, suite and backend names (it imports none of
    their modules); they must stay equal to the sources."""
    from graphrt.bench.ep import BACKENDS
    from graphrt.bench.plan import SUITES
    from graphrt.moe.config import PRESETS
    assert cli.PRESETS == tuple(sorted(PRESETS)) and cli.MODES == MODES
    assert cli.SUITES == SUITES and cli.BACKENDS == BACKENDS
    import inspect
    from graphrt.comm.deepep_ll import DeepEPLowLatencyComm
    src = inspect.getsource(DeepEPLowLatencyComm.__init__)  # deepep-<mode> -> mode=<mode>
    assert all(f'"{b.split("-", 1)[1]}"' in src for b in BACKENDS if b.startswith("deepep-"))


# -- rendering of a GPU-shaped result ----------------------------------------------------------
def _gpu_result():
    modes = ["eager", "compile", "graph", "graph-overlap", "naive", "naive-compile", "naive-graph"]
    rows = []
    for i, bs in enumerate([1, 8, 64]):
        step = {m: 1000.0 * (j + 1) * (i + 1) for j, m in enumerate(modes)}
        step["naive"] = None if bs == 64 else step["naive"]
        floor = 400.0 * (i + 1)
        rows.append({"bs": bs, "step_us": step, "floor_us": floor,
                     "over_floor": {m: t / floor for m, t in step.items() if t},
                     "speedup_vs_eager": {m: step["eager"] / t for m, t in step.items() if t},
                     "rel_err_vs_eager": {}, "rows_off_vs_eager": {},
                     "idle": {"graph": {"idle_frac": 0.04}, "graph-overlap": {"idle_frac": 0.02}},
                     "run_host_us": {"graph": 20.0, "graph-overlap": 21.0},
                     "notes": {"naive": "too large"} if bs == 64 else {}})
    per_graph = {bs: {"capture_s": 0.5, "pool_bytes": 3 << 20} for bs in (1, 8, 64)}
    return {"config": "dsv3-like", "layers": 4, "experts": 64, "hidden": 7168, "num_topk": 8,
            "moe_inter": 2048, "fp8": False, "device": "cuda:0", "comm": "LocalComm",
            "num_ranks": 1, "sizes": [1, 8, 64], "modes": modes, "expert_backend": "deepgemm",
            "hbm_gbs": 4300.0, "skipped": {}, "errors": {"naive-graph": "OutOfMemoryError: x"},
            "capture": {"graph": {"per_graph": per_graph}, "graph-overlap": {"per_graph": per_graph}},
            "compile": {"compile": {"mode": "reduce-overhead", "graph_breaks": 1, "unique_graphs": 2,
                                    "cudagraph_skips": 0, "compile_s": {1: 30.0},
                                    "break_reasons": {"some reason": 1}}},
            "rows": rows}


def test_markdown_and_plots_of_a_gpu_result(tmp_path):
    pytest.importorskip("matplotlib")
    from graphrt.bench.plots import markdown, write_plots
    res = _gpu_result()
    md = markdown(res)
    assert "| bs | eager µs | compile µs |" in md and "graph-overlap ×floor" in md
    assert "| 64 |" in md and "4.0%" in md and "2.0%" in md and "1 graph break(s)" in md
    assert "naive-graph: FAILED" in md and "naive at bs 64: too large" in md
    paths = write_plots(res, str(tmp_path))
    assert all(os.path.getsize(p) > 1000 for p in paths.values()), paths


def test_bench_eplb_plans_and_spawns_each_redundancy(monkeypatch, tmp_path, capsys):
    """--suite eplb: refused without an EP --comm or under torchrun; --redundant only with it;
    one spawn per (backend, redundancy), rank 0's rows rendered and saved."""
    from graphrt.bench import run
    from graphrt.bench.plan import Plan, Refusal, plan
    import graphrt.testing.launch as launch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    parse = lambda *a: cli.build_parser().parse_args(["bench", "--out", str(tmp_path / "o"), *a])  # noqa: E731
    p = plan(parse("--comm", "nccl", "--suite", "eplb", "--sizes", "64,128", "--redundant", "0,8"))
    assert (p.suites, p.redundant, p.sizes) == (["eplb"], (0, 8), [64, 128])
    for argv, match in ((["--suite", "eplb"], "suite eplb needs an expert-parallel --comm"),
                        (["--comm", "nccl", "--suite", "ep", "--redundant", "4"],
                         "--redundant applies to the eplb suite")):
        with pytest.raises(Refusal, match=match):
            plan(parse(*argv))
    calls = []

    def fake_spawn(fn, world, comm, opts, timeout_s=600):
        calls.append((fn.__name__, comm, opts["redundant"]))
        if opts["redundant"] == 8:
            return [{"rank": 0, "ok": False, "error": "RuntimeError: boom"}, {"rank": 1, "ok": True}]
        row = {"bs": 64, "redundant": 0, "step_us_before": 500.0, "step_us_after": 400.0,
               "gain": 1.25, "slot_max_mean_before": 3.0, "slot_max_mean_after": 1.5,
               "rank_max_mean_before": 1.8, "rank_max_mean_after": 1.05, "rows_off": 0,
               "rows": 64, "median_row_err": 0.004, "nan": False, "outputs_ok": True}
        res = {"comm": comm, "config": "qwen3-moe-like", "layers": 4, "experts": 64,
               "ranks": world, "redundant": 0, "zipf_s": 1.2, "loop_steps": 300,
               "interval": 100, "rebalanced_at_steps": [101], "slot_copies": 40,
               "same_graphs": True, "sync_free_loop": True, "store_gb": 2.4, "rows": [row]}
        return [{"rank": 0, "ok": True, **res}, {"rank": 1, "ok": True}]
    monkeypatch.setattr(launch, "spawn", fake_spawn)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "FakeGPU")
    rc = run.main(parse("--comm", "nccl", "--suite", "eplb", "--sizes", "64", "--redundant", "0,8"))
    assert rc == 1 and calls == [("bench_eplb_rank", "nccl", 0), ("bench_eplb_rank", "nccl", 8)]
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    assert [e.get("error") for e in doc["eplb"]] == [None, "rank 0: RuntimeError: boom"]
    md = (tmp_path / "o" / "results.md").read_text()
    assert "| nccl | 0 | 64 | 500 → 400 | 1.25× | 3.00 → 1.50 | 1.80 → 1.05 | 0 / 64 | yes |" in md
