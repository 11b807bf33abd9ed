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


def test_floor_counts_the_routed_one_row_picks():
    """A planned model's one-row step runs ``Experts.routed`` (no masked_m): the floor still
    counts each layer's picks, exactly ``num_topk`` distinct experts a layer."""
    spec, model = make_step(preset("tiny"), "cpu", max_batch_size=8)
    cfg = model.cfg
    inputs = spec.random_inputs(1, "cpu", torch.Generator().manual_seed(4))
    per_expert = model.layers[0].moe.experts.weight_bytes // cfg.num_experts
    kv = int((inputs["positions"].long() + 1).sum()) * cfg.kv_dim * 4 * cfg.num_layers
    routed = floor_bytes(model, spec, inputs) - model.weight_bytes()["dense"] - kv
    assert routed == cfg.num_layers * cfg.num_topk * per_expert
    assert all(l.moe.last_masked_m is None for l in model.layers)  # the routed path ran


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
                    "rel_err_vs_eager", "rows_off_vs_eager", "idle", "call_us", "call_busy_us",
                    "call_span_us", "run_host_us", "notes"):
            assert key in row, key
        assert row["step_us"]["eager"] > 0 and row["step_us"]["naive"] > 0
        assert row["rel_err_vs_eager"]["naive"] < 3e-2
        assert row["floor_us"] is None and row["idle"] == {} and row["run_host_us"] == {}
        assert row["call_us"] == row["call_busy_us"] == row["call_span_us"] == {}  # GPU only
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
    # only modes that need CUDA, on CPU: refused before any work (it built the model, skipped
    # every mode and exited 1 with a results.md table of mismatched columns)
    assert cli.main([*argv, "--modes", "graph,naive-graph"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--modes graph,naive-graph: each needs a CUDA GPU" in err, err
    assert not out.exists()

    import graphrt.bench.modes as modes_mod

    def broken(b, mode):
        raise RuntimeError("kernel exploded")
    monkeypatch.setitem(modes_mod.RUNNERS, "eager", broken)
    assert cli.main([*argv, "--modes", "eager"]) == 1  # every mode failed
    err = capsys.readouterr().err
    assert "eager: RuntimeError: kernel exploded" in err.splitlines()[-1], err
    assert json.load(open(out / "results.json"))["modes"]["errors"] == {
        "eager": "RuntimeError: kernel exploded"}
    table = (out / "results.md").read_text().split("\n## ")[0].splitlines()[1:4]
    assert table == ["| bs | floor µs |", "|---|---|", "| 1 | - |"], table  # columns agree


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


TORCHRUN = {"LOCAL_RANK": "0", "MASTER_ADDR": "x"}  # what torchrun sets beside RANK, WORLD_SIZE


@pytest.mark.parametrize("env,says", [
    # int() of these raised a traceback
    ({"RANK": "0", "WORLD_SIZE": "x"}, "WORLD_SIZE='x': expected a process count (an int >= 1"),
    ({"RANK": "x", "WORLD_SIZE": "2", **TORCHRUN},
     "RANK='x': expected this process's rank, an int from 0 to 1 (WORLD_SIZE=2)"),
    ({"RANK": "2", "WORLD_SIZE": "2", **TORCHRUN}, "RANK='2': expected this process's rank"),
    # not started by torchrun: rank 1 must say it (no process is rank 0); it exited 2 silently
    ({"RANK": "1", "WORLD_SIZE": "2"},
     "RANK and WORLD_SIZE (set by hand) say 2 processes, but --comm local is one GPU"),
    ({"RANK": "1", "WORLD_SIZE": "2", **TORCHRUN, "LOCAL_RANK": "1"}, None),  # rank 0 says it
])
def test_bench_rank_variables_are_refused_in_one_line(env, says, monkeypatch, capsys, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["bench", "--device", "cpu", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    if says is None:
        assert err == ""
    else:
        assert err.count("\n") == 1 and err.startswith("graphrt bench: ") and says in err, err
    assert not (tmp_path / "o").exists()


def test_bench_refuses_an_empty_out(monkeypatch, capsys, tmp_path):
    """``--out ''`` names no folder; it wrote to bench-out/ unasked."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--device", "cpu", "--sizes", "1", "--modes", "eager",
                     "--out", ""]) == 2
    assert capsys.readouterr().err == ("graphrt bench: --out '': expected a folder for "
                                       "results.json, results.md and plots, e.g. --out bench-out\n")
    assert list(tmp_path.iterdir()) == []


def test_ep_shapes_the_backends_reject_are_refused_before_ranks_start(monkeypatch, tmp_path):
    """What DeepEP and the EP split reject (hidden 128, more than 511 tokens a rank, 63
    experts over 2 ranks) is refused by the plan, exit 2, instead of failing inside every
    rank after NCCL started (exit 1). Two GPUs and DeepEP are pretended."""
    from graphrt.bench.plan import Refusal, plan
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    for argv, match in ((["--comm", "deepep-hook", "--config", "tiny"],
                         "DeepEP low-latency kernels support hidden in"),
                        (["--comm", "deepep-hook", "--max-tokens", "1000", "--sizes", "1,8"],
                         "max_tokens per rank must be in \\[1, 511\\]"),
                        (["--comm", "nccl", "--experts", "63"],
                         "63 experts do not split over 2 ranks")):
        with pytest.raises(Refusal, match=match):
            plan(cli.build_parser().parse_args(["bench", "--out", str(tmp_path / "o"),
                                                "--config", "qwen3-moe-like", *argv]))
    p = plan(cli.build_parser().parse_args(["bench", "--out", str(tmp_path / "o"), "--config",
                                            "qwen3-moe-like", "--comm", "deepep-hook,nccl"]))
    assert p.comms == ["deepep-hook", "nccl"] and p.ranks == 2


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


def test_a_write_that_fails_after_the_check_is_one_line_and_exit_2(tmp_path, capsys,
                                                                   monkeypatch):
    """--out passed the up-front check, then a write failed (a disk that filled, a file
    system that takes no files): one line naming the folder and the error, exit 2, not a
    traceback. A folder where no file can be made is refused up front (as root
    ``os.access`` says yes to /proc)."""
    import errno

    import graphrt.bench.run as run

    def full(folder, name, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(run, "write_file", full)
    assert cli.main(["bench", "--config", "tiny", "--device", "cpu", "--sizes", "1",
                     "--modes", "eager", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "cannot write the results there (OSError: [Errno 28] No space left" in err
    assert "Traceback" not in err
    monkeypatch.undo()
    if os.path.isdir("/proc"):
        assert cli.main(["bench", "--device", "cpu", "--out", "/proc/graphrt-out"]) == 2
        assert "cannot be created" in capsys.readouterr().err


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
                     "idle": {"graph": {"idle_frac": 0.3, "idle_frac_in_span": 0.04},
                              "graph-overlap": {"idle_frac": 0.3, "idle_frac_in_span": 0.02}},
                     "run_host_us": {"graph": 20.0, "graph-overlap": 21.0},
                     "call_us": {"graph": 900.0 * (i + 1), "compile": 1000.0 * (i + 1)},
                     "call_busy_us": {"graph": 800.0 * (i + 1), "compile": 1000.0 * (i + 1)},
                     "call_span_us": {"graph": 810.0 * (i + 1), "compile": 1500.0 * (i + 1)},
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
    # graph over compile on both footings: through the calls and by device busy time
    assert "| bs | compile call µs | compile busy µs | compile span µs | graph call µs | " \
           "graph busy µs | graph span µs | graph / compile, calls | graph / compile, busy |" in md
    assert "| 8 | 2000 | 2000 | 3000 | 1800 | 1600 | 1620 | 0.900 | 0.800 |" in md
    assert "expert GEMMs (W13 / W2)" not in md  # a fixed backend: no per-size table
    res["expert_backend"] = "the per-size plan"
    res["rows"][0]["expert_kernels"] = "swap/bn64 / swap/bn64"
    md = markdown(res)
    assert "experts on the per-size plan bf16" in md
    assert "| 1 | swap/bn64 / swap/bn64 |" in md and "| 64 | - |" in md
    paths = write_plots(res, str(tmp_path))
    assert all(os.path.getsize(p) > 1000 for p in paths.values()), paths


def test_bench_eplb_plans_and_spawns_each_redundancy(monkeypatch, tmp_path, capsys):
    """--suite eplb: refused without an EP --comm or under torchrun; --redundant only with it;
    one spawn per (backend, redundancy), rank 0's rows rendered and saved."""
    from graphrt.bench import run
    from graphrt.bench.plan import Refusal, plan
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


# -- kernel timeline of one replay (graphrt.bench.timeline) -------------------------------------
_DG = "void deep_gemm::sm90_bf16_gemm_impl<0u, 2u, (deep_gemm::GemmType)2>(__nv_bfloat16*, int)"


def _replay_events():
    """One synthetic replay: the host launch at 90 µs, kernels on streams 7 and 9 from 100 µs,
    plus records the timeline must ignore (a wait, a CPU op, another launch API)."""
    return [("cudaGraphLaunch", "cuda_runtime", None, 90.0, 4.0),
            ("cudaLaunchKernel", "cuda_runtime", None, 80.0, 2.0),
            ("aten::mm", "cpu_op", None, 85.0, 1.0),
            {"name": _DG, "kind": "kernel", "stream": 7, "start_us": 100.0, "dur_us": 30.0},
            ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "kernel", 9, 125.0, 10.0),
            ("_attn_split_kernel", "kernel", 7, 132.0, 8.0),
            ("Stream Wait Event", "cuda_sync", 7, 135.0, 15.0),
            ("_add_rmsnorm_kernel", "kernel", 7, 150.0, 2.0),
            ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 9, 160.0, 1.0),
            ("zero", "kernel", 9, 170.0, 0.0)]


@pytest.mark.parametrize("name,cls", [
    (_DG, "expert_gemm"), ("_masked_grouped_gemm_kernel", "expert_gemm"),
    ("_decode_gemm_kernel", "expert_gemm"), ("_decode_reduce_kernel", "expert_gemm"),
    ("_expert_rows_kernel", "expert_gemm"), ("_routed_w13_kernel", "expert_gemm"),
    ("_routed_w2_combine_kernel", "expert_gemm"),  # W2 with the combine in it: a GEMM first
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "dense_gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_execute_kernel__5x_cublas", "dense_gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_64x64_64x4_tn_align8>(Params)",
     "dense_gemm"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, 128, 16, 4, 4, false>(float)", "dense_gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>(float)", "dense_gemm"),
    ("_dense_mma_gemm_kernel", "dense_gemm"), ("_gemv_rows_kernel", "dense_gemm"),
    ("_norm_gemv_rows_kernel", "dense_gemm"), ("_oproj_gate_kernel", "dense_gemm"),
    ("_fold_topk_kernel", "routing"),
    ("_attn_split_kernel", "attention"), ("_attn_merge_kernel", "attention"),
    ("_kv_append_kernel", "attention"), ("attn_split_kernel", "attention"),
    ("attn_fused_kernel", "attention"), ("_add_rmsnorm_kernel", "norm"),
    ("_topk_softmax_kernel", "routing"), ("_grouped_topk_sigmoid_kernel", "routing"),
    ("_dispatch_plan_kernel", "routing"), ("_dispatch_copy_kernel", "routing"),
    ("_combine_masked_kernel", "routing"), ("_map_and_count_kernel", "routing"),
    ("void deep_ep::internode_ll::dispatch<true, 3, 7168>(void*)", "comm"),
    ("void deep_ep::internode_ll::combine<3, 7168, 9>(void*)", "comm"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"),
    ("_silu_and_mul_masked_kernel", "other"),
    ("void at::native::index_elementwise_kernel<128, 4>(long)", "other"),
])
def test_timeline_classifies_kernels_by_name(name, cls):
    from graphrt.bench.timeline import CLASSES, classify
    assert classify(name) == cls and cls in CLASSES
    assert classify(name, "gpu_memcpy") == "other"  # copies and fills are never a GEMM


def test_timeline_short_names():
    from graphrt.bench.timeline import short_name
    assert short_name(_DG) == "deep_gemm::sm90_bf16_gemm_impl"
    assert short_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"
    assert short_name("_attn_split_kernel") == "_attn_split_kernel"
    assert short_name("x" * 100, width=10) == "x" * 9 + "…"


def test_timeline_gaps_union_latency_and_floors():
    from graphrt.bench.timeline import build_timeline
    gbs = 4300.0
    floors = {"expert_gemm": int(15 * gbs * 1e3), "dense_gemm": int(5 * gbs * 1e3),
              "attention": int(2 * gbs * 1e3)}
    tl = build_timeline(_replay_events(), floor_bytes=floors, hbm_gbs=gbs, wall_us=80.0)
    ks = tl["kernels"]
    assert [k["class"] for k in ks] == ["expert_gemm", "dense_gemm", "attention", "norm", "other"]
    assert [k["stream"] for k in ks] == [7, 9, 7, 7, 9]
    assert [k["start_us"] for k in ks] == [0.0, 25.0, 32.0, 50.0, 60.0]  # from the first kernel
    assert [k["gap_stream_us"] for k in ks] == [None, None, 2.0, 10.0, 25.0]
    assert [k["gap_union_us"] for k in ks] == [0.0, 0.0, 0.0, 10.0, 8.0]
    # stages: 100..130; 130..135 (ends after it); 135..140; 140..152; 152..161: the span
    assert [k["stage_us"] for k in ks] == [30.0, 5.0, 5.0, 12.0, 9.0]
    assert ks[0]["short"] == "deep_gemm::sm90_bf16_gemm_impl" and ks[0]["name"] == _DG
    assert tl["launch_latency_us"] == 10.0 and tl["launch_call_us"] == 4.0  # 100 - 90
    assert tl["span_us"] == 61.0 and tl["busy_us"] == 43.0                  # 100..140, 150..152, 160..161
    assert tl["gaps_in_span_us"] == 18.0 == sum(k["gap_union_us"] for k in ks)
    assert sum(k["stage_us"] for k in ks) == tl["span_us"]
    assert tl["gap_frac_in_span"] == pytest.approx(18 / 61)
    assert tl["wall_us"] == 80.0 and tl["outside_span_us"] == 19.0
    assert tl["activities"] == 5 and tl["streams"] == 2                     # zero-length dropped
    c = tl["classes"]
    assert set(c) == {"expert_gemm", "dense_gemm", "attention", "norm", "other"}
    assert c["expert_gemm"]["count"] == 1 and c["expert_gemm"]["busy_us"] == 30.0
    assert c["expert_gemm"]["floor_us"] == pytest.approx(15.0)
    assert c["expert_gemm"]["busy_over_floor"] == pytest.approx(2.0)
    assert c["dense_gemm"]["busy_over_floor"] == pytest.approx(2.0)
    assert c["attention"]["busy_over_floor"] == pytest.approx(4.0)
    assert c["norm"]["floor_us"] is None and c["norm"]["busy_over_floor"] is None
    assert tl["floor_us"] == pytest.approx(22.0)
    # no launch record, no floors, no bandwidth: those figures are None, the rest stands
    bare = build_timeline([e for e in _replay_events() if "Launch" not in str(e[0] if
                                                                            isinstance(e, tuple) else "")])
    assert bare["launch_latency_us"] is None and bare["outside_span_us"] is None
    assert bare["busy_us"] == 43.0 and bare["floor_us"] is None
    assert all(v["floor_us"] is None for v in bare["classes"].values())
    empty = build_timeline([])
    assert empty["span_us"] == 0.0 and empty["gap_frac_in_span"] is None and empty["kernels"] == []


def test_timeline_union_counts_a_class_on_two_streams_once():
    from graphrt.bench.timeline import build_timeline, summarize, top_kernels
    evs = [("_decode_gemm_kernel", "kernel", 1, 0.0, 10.0), ("_decode_gemm_kernel", "kernel", 2, 5.0, 10.0),
           ("_decode_reduce_kernel", "kernel", 1, 20.0, 2.0)]
    tl = build_timeline(evs)
    assert tl["classes"]["expert_gemm"]["busy_us"] == 17.0 and tl["busy_us"] == 17.0
    top = top_kernels(tl["kernels"], 1)
    assert top == [{"name": "_decode_gemm_kernel", "class": "expert_gemm", "calls": 2,
                    "total_us": 20.0, "max_us": 10.0, "mean_us": 10.0}]
    s = summarize(tl)
    assert "kernels" not in s and len(s["top_kernels"]) == 2 and s["busy_us"] == 17.0
    kept = summarize(tl, keep_kernels=True)["kernels"]
    assert [k["name"] for k in kept] == ["_decode_gemm_kernel"] * 2 + ["_decode_reduce_kernel"]
    assert set(kept[0]) == {"name", "class", "stream", "start_us", "dur_us", "gap_stream_us",
                            "gap_union_us", "stage_us"}
    # the second ends after the first (15 > 10): its stage is 5; a kernel inside another's
    # interval would add 0
    assert [k["stage_us"] for k in kept] == [10.0, 5.0, 7.0]
    json.dumps(s)  # results.json takes it as is


def test_trace_events_adapter_feeds_the_timeline():
    from torch.autograd import DeviceType
    from graphrt.bench.profile import trace_events
    from graphrt.bench.timeline import build_timeline

    class Ev:
        def __init__(self, kind, dev, name, start, dur, stream=0):
            self.k, self.d, self.n, self.s, self.u, self.r = kind, dev, name, start, dur, stream
        activity_type = lambda self: self.k  # noqa: E731
        device_type = lambda self: self.d  # noqa: E731
        device_resource_id = lambda self: self.r  # noqa: E731
        name = lambda self: self.n  # noqa: E731
        start_ns = lambda self: self.s  # noqa: E731
        duration_ns = lambda self: self.u  # noqa: E731

    evs = [Ev("cuda_runtime", DeviceType.CPU, "cudaGraphLaunch_v10000", 1000, 3000, 55),
           Ev("cpu_op", DeviceType.CPU, "aten::empty", 0, 500),
           Ev("kernel", DeviceType.CUDA, "_attn_split_kernel", 9000, 2000, 7),
           Ev("gpu_memset", DeviceType.CUDA, "Memset (Device)", 12000, 1000, 9),
           Ev("cuda_sync", DeviceType.CUDA, "Event Sync", 11000, 500, 7)]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: evs)))
    got = trace_events(prof)            # times from the first kept event (the launch)
    assert got == [{"name": "cudaGraphLaunch_v10000", "kind": "cuda_runtime", "stream": None,
                    "start_us": 0.0, "dur_us": 3.0},
                   {"name": "_attn_split_kernel", "kind": "kernel", "stream": 7, "start_us": 8.0,
                    "dur_us": 2.0},
                   {"name": "Memset (Device)", "kind": "gpu_memset", "stream": 9, "start_us": 11.0,
                    "dur_us": 1.0}]
    tl = build_timeline(got)
    assert tl["launch_latency_us"] == 8.0 and tl["span_us"] == 4.0 and tl["busy_us"] == 3.0
    # kineto's epoch nanoseconds (~1.8e18): as float µs every start rounded to 0.25 µs, and a
    # 0.1 µs gap between kernels read 0 or 0.25
    T = 1796424407356189481
    evs[:] = [Ev("cuda_runtime", DeviceType.CPU, "cudaGraphLaunch", T - 3000, 1000),
              Ev("kernel", DeviceType.CUDA, "a", T, 2000), Ev("kernel", DeviceType.CUDA, "b",
                                                             T + 2100, 1000)]
    tl = build_timeline(trace_events(prof))
    assert tl["launch_latency_us"] == 3.0 and abs(tl["gaps_in_span_us"] - 0.1) < 1e-9


def test_replay_timeline_keeps_the_measurement_when_the_report_fails(monkeypatch):
    import graphrt.bench.profile as profile
    from graphrt.bench.timeline import replay_timeline
    idle = {"wall_us": 80.0, "idle_frac": 0.4}
    monkeypatch.setattr(profile, "replay_profile", lambda replay, trials=3: (idle, _replay_events()))
    got_idle, tl = replay_timeline(None, floor_bytes=None, hbm_gbs=None, keep_kernels=True)
    assert got_idle is idle and tl["outside_span_us"] == 19.0 and len(tl["kernels"]) == 5
    monkeypatch.setattr(profile, "replay_profile", lambda replay, trials=3: (idle, [("k", "kernel")]))
    got_idle, tl = replay_timeline(None, floor_bytes=None, hbm_gbs=None)
    assert got_idle is idle and tl == {"error": "KeyError: 'dur_us'"}


def test_model_floor_bytes_of_the_reference_model(tiny):
    from graphrt.bench.timeline import dense_parts, experts_hit, model_floor_bytes
    spec, model = tiny
    cfg, L = model.cfg, model.cfg.num_layers
    parts = dense_parts(model)
    assert sum(parts.values()) == model.weight_bytes()["dense"] and parts["lm_head"] > 0
    f = model_floor_bytes(model, 3, [5, 9, 2])
    assert f["expert_gemm"] == model.weight_bytes()["experts"]        # every local expert
    assert f["dense_gemm"] == model.weight_bytes()["dense"]
    assert f["attention"] == 2 * 16 * cfg.kv_dim * 2 * L              # K and V, bf16
    assert f["norm"] > 0 and f["routing"] > 0 and "comm" not in f and "other" not in f
    per_expert = model.layers[0].moe.experts.weight_bytes // cfg.num_experts
    assert model_floor_bytes(model, 3, torch.tensor([5, 9, 2]), experts_hit=3)["expert_gemm"] == 3 * per_expert
    # with the experts an eager step hit, the classes add up to the modes suite's floor
    inputs = spec.random_inputs(5, "cpu", torch.Generator().manual_seed(2))
    total = floor_bytes(model, spec, inputs)
    hits = experts_hit(model, spec, inputs)
    assert L * cfg.num_topk <= hits <= L * cfg.num_experts
    assert all(type(l.moe.experts).__name__ == "Experts" for l in model.layers)  # restored
    f = model_floor_bytes(model, 5, inputs["seq_lens"], experts_hit=hits)
    assert f["expert_gemm"] + f["dense_gemm"] + f["attention"] == total


def _with_timelines(res):
    from graphrt.bench.timeline import build_timeline, summarize
    gbs = res["hbm_gbs"]
    for row in res["rows"]:
        keep = row["bs"] in (res["sizes"][0], res["sizes"][-1])
        tl = build_timeline(_replay_events(), floor_bytes={"expert_gemm": int(15 * gbs * 1e3)},
                            hbm_gbs=gbs, wall_us=80.0)
        row["timeline"] = {"graph": summarize(tl), "graph-overlap": summarize(tl, keep_kernels=keep)}
    res["rows"][1]["timeline"]["graph"] = {"error": "ValueError: boom"}
    return json.loads(json.dumps(res))  # as results.json gives it back


def test_timeline_markdown():
    from graphrt.bench.run import md_modes
    from graphrt.bench.timeline import md_timelines
    res = _with_timelines(_gpu_result())
    md = md_timelines(res)
    assert "| bs | mode | launch µs | span µs | busy µs | gaps in span µs | gaps % of span |" in md
    assert "| 1 | graph-overlap | 10.0 | 61 | 43 | 18.0 | 29.5% | 19 | 5 | 2 |" in md
    assert "| 8 | graph | timeline failed: ValueError: boom |" in md
    assert "| expert GEMM | dense GEMM | attention | norm | elementwise/other |" in md
    assert "| 1 | graph | 30.0 (2.00×) | 10.0 | 8.0 | 2.0 | 1.0 |" in md
    assert "Top kernels, bs 1 graph-overlap" in md and "Top kernels, bs 64 graph-overlap" in md
    assert "Top kernels, bs 8" not in md and "Top kernels, bs 1 graph " not in md
    assert "| `deep_gemm::sm90_bf16_gemm_impl` | expert GEMM | 1 | 30.0 | 30.0 | 69.8% |" in md
    assert "Stages, bs 1 graph-overlap" in md and "Stages, bs 8" not in md
    assert "| 1 | `nvjet_tst_64x8_64x16_4x1_v_bz_TNT` | dense GEMM | 25.00 | 10.00 | 5.00 |" in md
    assert "| 3 | `_add_rmsnorm_kernel` | norm | 50.00 | 2.00 | 12.00 |" in md
    full = md_modes(res)
    assert full.startswith("## modes: dsv3-like") and full.endswith(md) and "×floor" in full
    assert md_timelines(_gpu_result()) == "" and md_modes(_gpu_result()) == md_modes(_gpu_result())
    assert "PDL was on" not in md                      # the fixture's timelines carry no pdl flag
    for row in res["rows"]:
        for t in (row.get("timeline") or {}).values():
            t["pdl"] = True
    assert "PDL was on while these graphs were captured" in md_timelines(res)


def test_timeline_plots_and_their_names(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from graphrt.bench.plots import plot_names, write_timeline_plots
    names = plot_names("nccl")
    assert names["timeline_smallest"] == "timeline_smallest-nccl.png"
    assert plot_names()["timeline_largest"] == "timeline_largest.png"
    res = _with_timelines(_gpu_result())
    paths = write_timeline_plots(res, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths.values()) == ["timeline_largest.png",
                                                                   "timeline_smallest.png"]
    assert all(os.path.getsize(p) > 5000 for p in paths.values())
    for row in res["rows"][1:]:  # one plotted size: the smallest only
        row["timeline"]["graph-overlap"].pop("kernels", None)
    assert write_timeline_plots(res, str(tmp_path / "one"))["timeline_largest"] is None
    assert write_timeline_plots(_gpu_result(), str(tmp_path / "none")) == {
        "timeline_smallest": None, "timeline_largest": None}
    assert not (tmp_path / "none").exists()
    # the plan checks the timeline files too: a symlink planted there is refused up front
    (tmp_path / "out").mkdir()
    os.symlink(tmp_path / "elsewhere.png", tmp_path / "out" / "timeline_largest.png")
    assert cli.main(["bench", "--device", "cpu", "--out", str(tmp_path / "out")]) == 2
    assert "timeline_largest.png there is a symbolic link" in capsys.readouterr().err


def test_a_rerun_into_the_same_folder_removes_the_plots_it_did_not_make(tmp_path):
    """A GPU run's timeline and over-floor plots stayed beside a later CPU run's results
    (which say they are null), unlisted."""
    pytest.importorskip("matplotlib")
    from graphrt.bench.plots import write_plots, write_timeline_plots
    res = _with_timelines(_gpu_result())
    write_plots(res, str(tmp_path))
    write_timeline_plots(res, str(tmp_path))
    assert len(list(tmp_path.glob("*.png"))) == 4
    assert cli.main(["bench", "--device", "cpu", "--sizes", "1", "--modes", "eager",
                     "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    made = {v for v in doc["modes"]["plots"].values() if v}
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(made) == ["step_time.png"]


# -- the loop suite under expert parallelism ---------------------------------------------------
def _ep_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)


def test_bench_plan_refuses_modes_the_suite_would_only_skip(monkeypatch, tmp_path):
    """Under EP naive and compile are skipped, so is naive with --fp8 (no bf16 expert
    weights): the plan took them, the run spawned ranks, built the model and exited 1 with
    'nothing was measured'. A mix with a measurable mode still runs."""
    from graphrt.bench.plan import Refusal, plan
    _ep_machine(monkeypatch)
    parse = lambda *a: cli.build_parser().parse_args(["bench", "--out", str(tmp_path / "o"), *a])  # noqa: E731
    for argv, match in ((["--comm", "nccl", "--suite", "modes", "--modes", "naive"], "single-GPU only"),
                        (["--comm", "nccl", "--suite", "modes", "--modes", "compile"], "single-GPU only"),
                        (["--suite", "modes", "--fp8", "--modes", "naive"], "bf16 expert weights")):
        with pytest.raises(Refusal, match=match):
            plan(parse(*argv))
    assert plan(parse("--comm", "nccl", "--suite", "modes", "--modes", "eager,compile")).modes


def test_bench_plan_takes_the_loop_suite_under_ep(monkeypatch, tmp_path):
    """--suite loop runs under EP now (with ep/modes too); runtime and moe stay single-GPU and
    the refusal names the EP suites; on the CPU loop still needs a GPU."""
    from graphrt.bench.plan import Refusal, plan
    _ep_machine(monkeypatch)
    parse = lambda *a: cli.build_parser().parse_args(["bench", "--out", str(tmp_path / "o"), *a])  # noqa: E731
    p = plan(parse("--ranks", "2", "--comm", "deepep-hook", "--suite", "loop", "--config",
                   "qwen3-moe-like", "--experts", "64", "--layers", "4", "--sizes", "1,8,64"))
    assert (p.suites, p.comms, p.ranks, p.sizes, p.max_tokens, p.ep) == (
        ["loop"], ["deepep-hook"], 2, [1, 8, 64], 64, True)
    assert (p.cfg.name, p.cfg.num_experts, p.cfg.num_layers) == ("qwen3-moe-like", 64, 4)
    p = plan(parse("--comm", "deepep-hook,nccl", "--suite", "ep,loop", "--config", "dsv3-like"))
    assert p.suites == ["ep", "loop"] and p.sizes == [1, 8, 32, 128] and p.cfg.num_experts == 256
    for argv, match in ((["--comm", "nccl", "--suite", "loop,moe"],
                         "suite moe is single-GPU: run it without --comm/--ranks, or pick from "
                         "--suite ep,modes,loop,eplb"),
                        (["--comm", "nccl", "--suite", "runtime"], "suite runtime is single-GPU"),
                        (["--comm", "nccl", "--suite", "loop", "--modes", "eager"],
                         "--modes applies to the modes suite"),
                        (["--comm", "nccl", "--suite", "loop", "--max-tokens", "8", "--sizes", "64"],
                         "--max-tokens 8 is below the largest --sizes 64")):
        with pytest.raises(Refusal, match=match):
            plan(parse(*argv))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Refusal, match="suite loop needs a CUDA GPU"):
        plan(parse("--device", "cpu", "--suite", "loop"))


def _loop_v(tps, busy, *, replay=360.0):
    return {"tokens_per_s": tps, "output_tokens_per_s": tps * 0.9, "steps_per_s": tps,
            "step_us": 1e6 / tps, "replay_us_median": replay, "gpu_busy": busy,
            "host_us_median": 100.0, "wait_s": 0.1, "mean_batch": 1.0, "timed_replays": 1000,
            "staging_waits": 0, "stream_busy": min(1.0, busy + 0.05), "idle_us_per_step": 5.0,
            "idle_us_median": 4.0, "device_bound_step_us": replay, "vs_device_bound": 0.97}


def _rank_rows(rank):
    """One rank's loop rows at bs 1: rank 1 is 10% slower and busier."""
    f = 1.0 if rank == 0 else 0.9
    loops = {"sync": _loop_v(2000.0 * f, 0.70 + 0.1 * rank),
             "async": _loop_v(2600.0 * f, 0.90 + 0.05 * rank)}
    return [{"bs": 1, "loops": loops, "identical": rank == 0,
             "speedup_vs_sync": {k: v["tokens_per_s"] / loops["sync"]["tokens_per_s"]
                                 for k, v in loops.items()}}]


def test_loop_merge_ranks_sums_tokens_and_keeps_the_lowest_busy():
    from graphrt.bench.loop import merge_ranks, rank_summary
    every = [rank_summary(_rank_rows(r)) for r in (0, 1)]
    assert set(every[1][0]["loops"]["sync"]) == {"tokens_per_s", "gpu_busy", "stream_busy", "step_us"}
    row = merge_ranks(_rank_rows(0), every)[0]
    a = row["loops"]["async"]
    assert a["tokens_per_s"] == 2600.0 and a["global_tokens_per_s"] == pytest.approx(2600 + 2340)
    assert a["gpu_busy"] == 0.90 and a["gpu_busy_min"] == 0.90                 # rank 0 the lower
    assert row["loops"]["sync"]["gpu_busy_min"] == 0.70
    assert a["per_rank"]["gpu_busy"] == pytest.approx([0.90, 0.95])
    assert a["per_rank"]["tokens_per_s"] == pytest.approx([2600.0, 2340.0])
    assert row["identical_per_rank"] == [True, False] and row["identical"] is False
    other = _rank_rows(1)
    other[0]["bs"] = 8
    with pytest.raises(ValueError, match="ranks ran different rows at bs 1"):
        merge_ranks(_rank_rows(0), [every[0], rank_summary(other)])


def _ep_loop_result(comm, loops=("sync", "async"), skipped=None):
    from graphrt.bench.loop import merge_ranks, rank_summary
    rows = [{**r, "loops": {k: v for k, v in r["loops"].items() if k in loops}}
            for r in _rank_rows(0)]
    every = [rank_summary(_rank_rows(r)) for r in (0, 1)]
    every = [[{**s, "identical": True, "loops": {k: v for k, v in s["loops"].items() if k in loops}}
              for s in e] for e in every]
    return {"config": "qwen3-moe-like", "layers": 4, "experts": 64, "hidden": 2048,
            "device": "cuda:0", "comm": comm, "ranks": 2, "rank": 0, "steps": 1000,
            "warmup": 50, "sizes": [1], "loops": list(loops), "skipped": skipped or {},
            "rows": merge_ranks(rows, every)}


def test_bench_ep_loop_lands_under_each_backend(monkeypatch, tmp_path, capsys):
    """--suite loop under EP: run_rank is spawned per backend with the loop suite; rank 0's
    result lands under ep[comm].loop and is rendered with the all-ranks columns; NCCL's
    skipped loops are named."""
    import graphrt.testing.launch as launch
    from graphrt.bench import run
    _ep_machine(monkeypatch)
    calls = []

    def fake_spawn(fn, world, comm, opts, timeout_s=600):
        calls.append((fn.__name__, world, comm, opts["sizes"], opts["suites"], opts["cfg"].name))
        if comm == "nccl":
            loop = _ep_loop_result(comm, ("sync",), {"async": "a uniform-batch backend (NCCL)"})
        else:
            loop = _ep_loop_result(comm)
        return [{"rank": 0, "ok": True, "loop": loop}, {"rank": 1, "ok": True}]
    monkeypatch.setattr(launch, "spawn", fake_spawn)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "FakeGPU")
    args = cli.build_parser().parse_args(
        ["bench", "--out", str(tmp_path / "o"), "--ranks", "2", "--comm", "deepep-hook,nccl",
         "--suite", "loop", "--config", "qwen3-moe-like", "--experts", "64", "--sizes", "1"])
    assert run.main(args) == 0
    assert calls == [("run_rank", 2, "deepep-hook", [1], ["loop"], "qwen3-moe-like"),
                     ("run_rank", 2, "nccl", [1], ["loop"], "qwen3-moe-like")]
    res = json.load(open(tmp_path / "o" / "results.json"))
    assert res["measured"] and res["suites"] == ["loop"] and "loop" not in res
    hook = res["ep"]["deepep-hook"]["loop"]
    assert hook["ranks"] == 2 and hook["rows"][0]["loops"]["async"]["gpu_busy_min"] == 0.90
    assert res["ep"]["nccl"]["loop"]["loops"] == ["sync"]
    out = capsys.readouterr().out
    assert "## loop over deepep-hook" in out and "over 2 ranks (deepep-hook)" in out
    assert "| bs/rank | loop | tokens/s rank 0 | tokens/s all ranks | ×sync |" in out
    assert ("| 1 | async | 2600 | 4940 | 1.30 | 384.6 | 360.0 | 90.0% | 90.0% | 95.0% | 0.970 | "
            "100.0 | identical |") in out
    assert ("| 1 | sync | 2000 | 3800 | 1.00 | 500.0 | 360.0 | 70.0% | 70.0% | 75.0% | 0.970 | "
            "100.0 | identical |") in out
    assert "async: skipped (a uniform-batch backend (NCCL))" in out
    md = (tmp_path / "o" / "results.md").read_text()
    assert "## loop over nccl" in md and "| 1 | async |" in md


def test_loop_md_names_the_ranks_whose_streams_differ():
    from graphrt.bench.loop import md_loop, merge_ranks, rank_summary
    res = _ep_loop_result("deepep-hook")
    res["rows"] = merge_ranks(_rank_rows(0), [rank_summary(_rank_rows(r)) for r in (0, 1)])
    assert "| DIFFER (rank 1) |" in md_loop(res)


@pytest.mark.slow
def test_bench_loop_keeps_only_sync_under_a_uniform_coordinator():
    from graphrt.bench.loop import LOOPS, bench_loop, runnable_loops
    assert runnable_loops(LOOPS, None) == (list(LOOPS), {})
    assert runnable_loops(LOOPS, SimpleNamespace(uniform=False)) == (list(LOOPS), {})
    cfg = preset("tiny", layers=1, experts=4, n_group=2, topk_group=1)
    res = bench_loop(cfg, "cpu", [2], steps=2, warmup=1, coordinator=SimpleNamespace(uniform=True))
    assert res["loops"] == ["sync"] and list(res["rows"][0]["loops"]) == ["sync"]
    assert set(res["skipped"]) == {"sync-zero-copy", "async", "async-fused"}
    assert all("input_buffers()" in why and "NCCL" in why for why in res["skipped"].values())
    assert (res["comm"], res["ranks"], res["rank"]) == ("local", 1, 0)
    assert res["rows"][0]["identical"] and "identical_per_rank" not in res["rows"][0]


def _loop_rank(rank, world, port, out_dir):
    """One gloo rank of bench_loop's EP path on the CPU: a LocalComm posing as rank ``rank``
    of ``world`` (its experts are all local; only the lockstep, the barrier and the gather
    across ranks are under test)."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from graphrt.bench.loop import bench_loop
        from graphrt.comm.local import LocalComm
        from graphrt.coordinator import RankCoordinator
        cfg = preset("tiny", layers=1, experts=4, n_group=2, topk_group=1)
        comm = LocalComm(cfg.num_experts, cfg.hidden, cfg.num_topk, torch.device("cpu"),
                         max_tokens=cfg.num_slots)
        comm.rank, comm.num_ranks = rank, world
        res = bench_loop(cfg, "cpu", [2], steps=2, warmup=1, loops=("sync", "async"), comm=comm,
                         comm_name="fake", coordinator=RankCoordinator(uniform=False))
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_bench_loop_gathers_every_rank_over_gloo(tmp_path):
    import torch.multiprocessing as mp
    from graphrt.testing.launch import free_port
    mp.start_processes(_loop_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    r0, r1 = (json.load(open(tmp_path / f"{r}.json")) for r in (0, 1))
    assert (r0["rank"], r1["rank"], r0["ranks"], r0["comm"]) == (0, 1, 2, "fake")
    for res in (r0, r1):
        row = res["rows"][0]
        assert row["identical"] and row["identical_per_rank"] == [True, True]
        for v in row["loops"].values():
            assert v["mean_batch"] == 2 and v["timed_replays"] == 2
            assert len(v["per_rank"]["gpu_busy"]) == 2
            assert v["global_tokens_per_s"] == pytest.approx(sum(v["per_rank"]["tokens_per_s"]))
            assert v["gpu_busy_min"] == min(v["per_rank"]["gpu_busy"])
    assert r0["rows"][0]["loops"]["async"]["per_rank"] == r1["rows"][0]["loops"]["async"]["per_rank"]


def test_dense_bench_markdown_has_the_mma_columns():
    from graphrt.bench.dense import markdown
    impl = {"us": 8.0, "gbs": 2600.0, "frac_hbm": 0.61, "max_rel_err": 1.7e-3}
    row = {"shape": "qwen3-qkv", "n": 5120, "k": 2048, "m": 4, "copies": 13, "ratio": 1.4,
           "config": {"block_n": 16, "split_k": 1}, "cublas": impl, "gemv": dict(impl, us=11.4),
           "rows": dict(impl, us=11.5), "mma": dict(impl, us=7.9),
           "mma_best": {"config": "64x256x1s3", "us": 7.9}}
    md = markdown({"device": "H200", "num_sms": 132, "hbm_gbs": 4270.0, "cold_mb": 256,
                   "results": [row]})
    assert "| mma µs | mma / cuBLAS |" in md and "| 7.9 | 0.99 |" in md
    assert "mma 64x256x1s3 7.9" in md and md.count("\n| qwen3-qkv |") == 1


def test_hbm_bench_markdown_and_arguments(capsys):
    from graphrt.bench.hbm import main, markdown
    kind = {"us": 16.1, "gbs": 3256.0, "frac_hbm": 0.763}
    row = {"mb": 50, "copies": 11, "stream": kind, "copy": dict(kind, gbs=6100.0, frac_hbm=1.43)}
    md = markdown({"device": "H200", "hbm_gbs": 4268.0, "cold_mb": 512, "results": [row]})
    assert "| MiB a launch | stream µs | stream GB/s | stream / 4 GB copy |" in md
    assert "| 50 | 16.1 | 3256 | 76% | 16.1 | 6100 | 143% |" in md
    assert main(["--sizes", "4,x", "--out", "unused.json"]) == 2
    assert "--sizes needs comma-separated MiB >= 1, got '4,x'" in capsys.readouterr().err
    assert main(["--sizes", "0", "--out", "unused.json"]) == 2


def test_pdl_bench_summary_markdown_and_arguments(capsys):
    from graphrt.bench.pdl import main, markdown, summarize
    # two replays of three probe programs: per replay min / median / max, then medians
    assert summarize([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]]) == {
        "min_us": 2.0, "median_us": 3.0, "max_us": 7.0}
    row = {"primary": "o GEMV, 1 row (2048x4096)", "primary_us": 6.41, "min_us": 1.2,
           "median_us": 1.31, "max_us": 1.4}
    md = markdown({"device": "H200", "pdl": {"launch_pdl": True, "USE_GDC": 2},
                   "probe_programs": 128, "cold_mb": 256, "results": [row]})
    assert "PDL on (USE_GDC=2); probe of 128 programs" in md and ">= 256 MiB" in md
    assert "| primary | primary µs | probe head start µs: min | median | max | wake µs |" in md
    assert "| o GEMV, 1 row (2048x4096) | 6.41 | 1.2 | 1.31 | 1.4 | — |" in md
    spin = dict(row, primary="spin-1-per-sm", wake_us=0.84)
    assert "| spin-1-per-sm | 6.41 | 1.2 | 1.31 | 1.4 | 0.84 |" in markdown(
        {"device": "H200", "pdl": {}, "probe_programs": 128, "cold_mb": 256, "results": [spin]})
    assert "PDL off" in markdown({"device": "H200", "pdl": {}, "probe_programs": 128,
                                  "cold_mb": 256, "results": []})
    assert main(["--replays", "0", "--out", "unused.json"]) == 2
    assert "--replays needs >= 1, got 0" in capsys.readouterr().err
    assert main(["--cold-mb", "0", "--out", "unused.json"]) == 2
    assert "--cold-mb needs >= 1, got 0" in capsys.readouterr().err


def test_contention_bench_rule_markdown_and_arguments(capsys):
    from graphrt.bench.contention import main, markdown, round_elems
    assert round_elems(128, 4) == 8192 and round_elems(4, 4) == 256 and round_elems(16, 1) == 4096
    for depth, pps in ((3, 4), (1, 16), (24, 4), (128, 1)):  # 192, 16, 1536, 32768 fp32
        with pytest.raises(ValueError, match="power-of-two round"):
            round_elems(depth, pps)
    doc = {"device": "H200", "hbm_gbs": 4200.0, "programs_per_sm": 4, "hops": 200,
           "results": [{"depth_kb": None, "in_flight_mib": None, "flood_gbs": None,
                        "inside": True, "hbm_chase_ns": 812.5, "l2_chase_ns": 301.0},
                       {"depth_kb": 128, "in_flight_mib": 16.5, "flood_gbs": 3990.0,
                        "inside": False, "hbm_chase_ns": 4100.0, "l2_chase_ns": 2600.0}]}
    md = markdown(doc)
    assert "flood of 4 programs an SM" in md and "chase of 200 dependent hops" in md
    assert "| no flood | 0 | — | — | 812.5 | 301.0 | — |" in md
    assert "| 128 | 16.5 | 3990 | 95% | 4100.0 | 2600.0 | NO |" in md
    assert main(["--depths", "4,x", "--out", "unused.json"]) == 2
    assert "--depths needs comma-separated KB >= 1, got '4,x'" in capsys.readouterr().err
    assert main(["--depths", "24", "--out", "unused.json"]) == 2
    assert "power-of-two round" in capsys.readouterr().err
    assert main(["--hops", "0", "--out", "unused.json"]) == 2
    assert "--hops needs >= 1, got 0" in capsys.readouterr().err


def test_the_json_the_bench_writes_is_strict():
    """An all-NaN mode's rel_err_vs_eager is inf: results.json held a bare Infinity, which
    is no JSON (a browser's JSON.parse refuses it, jq reads 1.797e308)."""
    from graphrt.bench.output import json_text
    doc = {"rel_err_vs_eager": float("inf"), "rows": [{"x": float("nan"), "y": 1.5}],
           "t": (float("-inf"), 2)}
    text = json_text(doc)
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == {
        "rel_err_vs_eager": None, "rows": [{"x": None, "y": 1.5}], "t": [None, 2]}


@pytest.mark.parametrize("module,argv,says", [
    ("dense", ["--rows", "a"], "argument --rows: expected comma-separated ints in 1..16"),
    ("kernels", ["--live", "0"], "argument --live: expected comma-separated ints >= 1"),
    ("kernels", ["--rotations", "0"], "argument --rotations: expected an int >= 1"),
    ("attention", ["--bs", "1,x"], "argument --bs: expected comma-separated ints >= 1"),
    ("layer", ["--layers", "0"], "must be > 0"),
    ("layer", ["--experts", "1"], "num_topk must be in [1, num_experts]"),
    ("ab", ["--sizes", "a"], "argument --sizes: expected comma-separated ints >= 1"),
    ("ab", ["--switch", "expert-swap", "--switch", "expert-rows"],
     "switches expert-swap and expert-rows set the same setting"),
    ("ab", ["--switch", "attn-splits+attn-split64"], "attn-splits and attn-split64"),
])
def test_standalone_benches_refuse_bad_flags_in_one_line(module, argv, says, capsys):
    """README: every command checks its flags before any work and exits 2 with one line. dense
    and layer died with a traceback; kernels' --live 0 divided by zero on the GPU; ab mixed
    two switches' off values into one baseline."""
    import importlib
    main = importlib.import_module(f"graphrt.bench.{module}").main
    needs = [] if module == "ab" else ["--out", "x.json"]
    try:
        rc = main([*argv, *needs])
    except SystemExit as exc:                      # argparse's own error
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and says in err, err
    assert "Traceback" not in err


def test_without_matplotlib_an_earlier_runs_plots_are_removed_too(tmp_path, monkeypatch, capsys):
    import graphrt.bench.plots as plots
    (tmp_path / "step_time.png").write_bytes(b"an earlier run's plot")

    def no_matplotlib(*a, **k):
        raise ImportError("No module named 'matplotlib'")
    monkeypatch.setattr(plots, "write_plots", no_matplotlib)
    assert cli.main(["bench", "--device", "cpu", "--sizes", "1", "--modes", "eager",
                     "--out", str(tmp_path)]) == 0
    assert not list(tmp_path.glob("*.png")) and "no plots" in capsys.readouterr().err
