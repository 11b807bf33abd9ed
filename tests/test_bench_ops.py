"""CPU tests of ``graphrt.kernels.ops`` (kernels on the Triton interpreter): each custom op matches
its launcher bitwise, declares exactly what it mutates (``torch.library.opcheck``), has a
fake implementation, and the reference step traces through the ops with no graph break."""
import subprocess
import sys

import pytest
import torch

import graphrt.kernels.ops as gops
from graphrt.moe import make_step, preset

OPS = torch.ops.graphrt


def _rand(*shape, dtype=torch.bfloat16, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype)


def _cases():
    """(op name, launcher module, positional args, the launcher's keyword outputs) per op."""
    g = torch.Generator().manual_seed(0)
    bs, E, k, H, cap, inter = 6, 8, 2, 64, 16, 128
    bf16, i32, i64 = torch.bfloat16, torch.int32, torch.int64
    n = torch.tensor([4], dtype=i32)
    logits = _rand(bs, E, gen=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(bs)])
    ids[4:] = -1
    masked_m = torch.tensor([3, 0, 16, 1, 2, 5, 0, 7], dtype=i32)
    # paged KV cache: 9 blocks of 8 positions, block 8 is scratch; rows 4, 5 are padding
    block_table = torch.tensor([[3, 0], [5, 8], [1, 7], [2, 8], [8, 8], [8, 8]], dtype=i32)
    seq_lens = torch.tensor([13, 1, 10, 4, 0, 0], dtype=i32)
    slot_mapping = torch.tensor([0 * 8 + 4, 5 * 8, 7 * 8 + 1, 2 * 8 + 3, 64, 64], dtype=i64)
    cache = lambda: _rand(9, 8, 2, 32, gen=g)  # noqa: E731 - [num_blocks, block_size, kv heads, d]
    from graphrt.kernels.attention import attention_workspace_shape
    o_shape, lse_shape = attention_workspace_shape(bs, 4, 32, 16)
    routed = dict(out_weights=torch.zeros(bs, k), out_ids=torch.zeros(bs, k, dtype=i64))
    return [
        ("topk_softmax", "routing", (logits, n, k), routed),
        ("grouped_topk_sigmoid", "routing", (logits, torch.rand(E, generator=g), n, k, 4, 2), routed),
        ("dispatch_masked", "dispatch", (_rand(bs, H, gen=g), ids),
         dict(out_recv_x=torch.zeros(E, cap, H, dtype=bf16), out_masked_m=torch.zeros(E, dtype=i32),
              out_src_idx=torch.zeros(E, cap, dtype=i32), out_pos=torch.zeros(bs, k, dtype=i32))),
        ("combine_masked", "combine",
         (_rand(E, cap, H, gen=g), ids, torch.rand(bs, k, generator=g),
          torch.randint(0, cap, (bs, k), generator=g, dtype=i32), n),
         dict(out=torch.zeros(bs, H, dtype=bf16))),
        ("silu_and_mul_masked", "activation", (_rand(E, cap, 2 * inter, gen=g), masked_m),
         dict(out=torch.zeros(E, cap, inter, dtype=bf16))),
        ("silu_and_mul_masked_fp8", "activation", (_rand(E, cap, 2 * inter, gen=g), masked_m),
         dict(out_q=torch.zeros(E, cap, inter, dtype=torch.float8_e4m3fn),
              out_scale=torch.zeros(E, cap, inter // 128))),
        ("masked_grouped_gemm", "grouped_gemm",
         (_rand(E, cap, H, gen=g), _rand(E, 32, H, gen=g), masked_m),
         dict(out=torch.zeros(E, cap, 32, dtype=bf16), expected_m=4)),
        ("routed_w13", "routed_gemv",
         (_rand(1, H, gen=g), ids[:1].clone(), n[:1].clone(), _rand(E, 2 * inter, H, gen=g)),
         dict(out=torch.zeros(k, inter, dtype=bf16))),
        ("routed_w2_combine", "routed_gemv",
         (_rand(k, inter, gen=g), ids[:1].clone(), torch.rand(1, k, generator=g), n[:1].clone(),
          _rand(E, H, inter, gen=g)),
         dict(out=torch.zeros(1, H, dtype=bf16))),
        ("kv_append", "attention",
         (_rand(bs, 2, 32, gen=g), _rand(bs, 2, 32, gen=g), slot_mapping, n),
         dict(k_cache=cache(), v_cache=cache())),
        ("decode_attention", "attention",
         (_rand(bs, 4, 32, gen=g), cache(), cache(), block_table, seq_lens, n),
         dict(out=torch.zeros(bs, 4, 32, dtype=bf16), workspace_o=torch.zeros(o_shape),
              workspace_lse=torch.zeros(lse_shape))),
        ("silu_and_mul", "activation", (_rand(bs, 2 * inter, gen=g),),
         dict(out=torch.zeros(bs, inter, dtype=bf16))),
        ("embedding_rows", "embedding", (_rand(40, H, gen=g), torch.tensor([3, 39, 0, 3, 7, -1])),
         dict(out=torch.zeros(bs, H, dtype=bf16))),
    ]


def _clone(kw):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


@pytest.mark.parametrize("name,module,args,kw", _cases(), ids=[c[0] for c in _cases()])
def test_op_matches_launcher_and_passes_opcheck(name, module, args, kw):
    import importlib
    launcher = getattr(importlib.import_module(f"graphrt.kernels.{module}"), name)
    want, got = _clone(kw), _clone(kw)
    launcher(*args, **want)
    assert getattr(OPS, name)(*args, **got) is None
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    for key, t in want.items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(bits(t), bits(got[key])), key
    # positional call, the launcher's argument order
    pos = _clone(kw)
    getattr(OPS, name)(*args, *pos.values())
    fp8 = any(getattr(v, "dtype", None) == torch.float8_e4m3fn for v in kw.values())
    utils = ("test_faketensor",) if fp8 else ("test_schema", "test_faketensor")  # opcheck can't diff fp8
    torch.library.opcheck(getattr(OPS, name).default, args, _clone(kw), test_utils=utils)


@pytest.mark.parametrize("num_add", [0, 1, 2])
def test_add_rmsnorm_op_matches_launcher(num_add):
    from graphrt.kernels.norm import add_rmsnorm
    g = torch.Generator().manual_seed(1)
    x, w = _rand(6, 64, gen=g), _rand(64, gen=g)
    deltas = [_rand(6, 64, gen=g) for _ in range(num_add)]
    want_out, want_res = torch.zeros_like(x), torch.zeros_like(x) if num_add else None
    add_rmsnorm(x, *deltas, weight=w, eps=1e-6, out=want_out, out_residual=want_res)
    d1, d2 = (deltas + [None, None])[:2]
    out, res = torch.zeros_like(x), torch.zeros_like(x) if num_add else None
    assert OPS.add_rmsnorm(x, d1, d2, w, 1e-6, out, res) is None
    assert torch.equal(out, want_out) and (res is None or torch.equal(res, want_res))
    torch.library.opcheck(OPS.add_rmsnorm.default, (x, d1, d2, w, 1e-6, torch.zeros_like(x),
                                                    torch.zeros_like(x) if num_add else None))
    with gops.launchers_as_ops():  # the launcher-shaped wrapper routes through the op
        import graphrt.kernels.norm as norm
        out2 = torch.zeros_like(x)
        res2 = torch.zeros_like(x) if num_add else None
        assert norm.add_rmsnorm(x, *deltas, weight=w, eps=1e-6, out=out2, out_residual=res2) is out2
    assert torch.equal(out2, want_out)


@pytest.mark.parametrize("normed", [False, True])
def test_norm_gemv_rows_op_matches_launcher(normed):
    """The fused norm + GEMV op with and without ``out_normed`` (the normed rows stored too,
    as the router's fused norm asks): bitwise its launcher, directly and through the
    launcher-shaped wrapper."""
    from graphrt.kernels.norm_gemv import norm_gemv_rows
    g = torch.Generator().manual_seed(2)
    x, d, nw, w = _rand(2, 64, gen=g), _rand(2, 64, gen=g), _rand(64, gen=g), _rand(24, 64, gen=g)
    want = [torch.zeros(2, 24, dtype=torch.bfloat16), torch.zeros_like(x), torch.zeros_like(x)]
    norm_gemv_rows(x, d, norm_weight=nw, eps=1e-6, w=w, out=want[0], out_residual=want[1],
                   out_normed=want[2] if normed else None)
    got = [torch.zeros_like(t) for t in want]
    assert OPS.norm_gemv_rows(x, d, None, nw, 1e-6, w, got[0], got[1],
                              out_normed=got[2] if normed else None) is None
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    torch.library.opcheck(OPS.norm_gemv_rows.default,
                          (x, d, None, nw, 1e-6, w, *[torch.zeros_like(t) for t in want[:2]]),
                          dict(out_normed=torch.zeros_like(x) if normed else None))
    with gops.launchers_as_ops():
        import graphrt.kernels.norm_gemv as ng
        again = [torch.zeros_like(t) for t in want]
        ng.norm_gemv_rows(x, d, norm_weight=nw, eps=1e-6, w=w, out=again[0],
                          out_residual=again[1], out_normed=again[2] if normed else None)
    assert all(torch.equal(a, b) for a, b in zip(want, again))


def test_deepgemm_ops_have_fakes_and_import_nothing():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a = torch.empty(4, 8, 128, dtype=torch.bfloat16)
        b = torch.empty(4, 256, 128, dtype=torch.bfloat16)
        d, m = torch.empty(4, 8, 256, dtype=torch.bfloat16), torch.empty(4, dtype=torch.int32)
        assert OPS.deepgemm_masked_bf16(a, b, d, m, 2) is None
        q = torch.empty(4, 8, 128, dtype=torch.float8_e4m3fn)
        assert OPS.deepgemm_masked_fp8(q, torch.empty(4, 8, 1), q.new_empty(4, 256, 128),
                                       torch.empty(4, 2, 1), d, m, 2) is None
    assert "deep_gemm" not in sys.modules
    schema = str(OPS.deepgemm_masked_fp8.default._schema)
    assert "Tensor(a4!) d" in schema and schema.endswith("-> ()"), schema


def test_importing_ops_stays_light():
    code = ("import sys, torch, graphrt.kernels.ops; "
            "assert hasattr(torch.ops.graphrt, 'dispatch_masked'); "
            "print(sorted(m for m in ('triton', 'deep_gemm', 'deep_ep') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_launchers_as_ops_patches_and_restores():
    import graphrt.kernels.dispatch as disp
    orig = disp.dispatch_masked
    with gops.launchers_as_ops():
        assert disp.dispatch_masked is not orig
        assert gops._launcher("graphrt.kernels.dispatch", "dispatch_masked") is orig
        with pytest.raises(RuntimeError, match="not re-entrant"):
            with gops.launchers_as_ops():
                pass
    assert disp.dispatch_masked is orig and not gops._originals


def test_each_wrapper_takes_every_keyword_of_its_launcher():
    """Inside ``launchers_as_ops`` a wrapper stands in for its launcher wherever the launcher
    is called, so a keyword the launcher gained (``preload=``) and the wrapper lacks would
    raise only under torch.compile, on a GPU. Every parameter name must match."""
    import importlib
    import inspect
    for (module, name), wrapper in gops._wrappers().items():
        if module == "deep_gemm":
            continue                       # positional C++ entry points, absent on the CPU
        launcher = getattr(importlib.import_module(module), name)
        want = list(inspect.signature(launcher).parameters)
        got = list(inspect.signature(wrapper).parameters)
        assert got == want, f"{module}.{name}: the wrapper takes {got}, the launcher {want}"


@pytest.fixture(scope="module")
def tiny():
    return make_step(preset("tiny"), "cpu", max_batch_size=8, backend="triton")


def _compiled_through_ops(spec, model, rows: int, live: int, seed: int):
    """The eager logits of one step of ``rows`` (``live`` of them live) and those of the step
    compiled fullgraph under ``launchers_as_ops`` (aot_eager); the overlap off for both."""
    inputs = spec.random_inputs(rows, "cpu", torch.Generator().manual_seed(seed))
    n = torch.tensor([live], dtype=torch.int32)
    model.overlap = False
    try:
        ref = model.step(**inputs, n=n)["logits"]
        torch._dynamo.reset()
        with gops.launchers_as_ops():
            step = torch.compile(model.step, backend="aot_eager", fullgraph=True, dynamic=False)
            return ref, step(**inputs, n=n)["logits"]
    finally:
        model.overlap = True
        torch._dynamo.reset()


def test_reference_step_traces_through_ops_without_graph_breaks(tiny):
    """fullgraph=True raises on any graph break; aot_eager also runs functionalization over
    the ops' mutations (auto_functionalized), so the fake impls and schemas are exercised."""
    spec, model = tiny
    ref, out = _compiled_through_ops(spec, model, 4, 3, seed=3)
    assert torch.equal(out, ref)


def test_one_row_routed_step_traces_through_ops_without_graph_breaks():
    """The planned tiny model at one row runs the routed experts (``Experts.routed``): under
    ``launchers_as_ops`` it compiles fullgraph through ``graphrt::routed_w13`` and
    ``graphrt::routed_w2_combine`` and gives the eager logits bitwise."""
    spec, model = make_step(preset("tiny"), "cpu", max_batch_size=8)
    ref, out = _compiled_through_ops(spec, model, 1, 1, seed=5)
    assert all(l.moe.last_masked_m is None for l in model.layers)  # the routed path ran
    assert torch.equal(out, ref)


# ---- graphrt.bench.layer (the one-row layer launch alone) --------------------------------

def test_layer_bench_variants_parse_and_say_what_they_expect():
    from graphrt.bench.layer import parse_variant
    assert parse_variant("default") == {}
    assert parse_variant("programs=132,warps=8,tile=16384,pipe=3") == dict(
        programs=132, warps=8, tile=16384, pipe=3)
    for bad, said in (("grid=2", "keys"), ("pipe", "keys"), ("pipe=x", "needs an int")):
        with pytest.raises(ValueError, match=said):
            parse_variant(bad)


def test_layer_bench_phases_from_stamps():
    """Two programs' cycle counters at 1000 MHz (1 cycle = 1 ns): each phase's median and
    slowest time, the last arriver's wait, the attention item and merge."""
    import torch
    from graphrt.bench.layer import PHASES, _phases, markdown
    st = torch.zeros(2, 16, dtype=torch.int64)
    # program 0: phases of 1000 ns each, barrier waits of 500; program 1 arrives last at
    # every barrier (phases 1500 ns) and waits 100
    for p, (work, wait) in enumerate(((1000, 500), (1500, 100))):
        t = 0
        for b in range(1, 6):
            t += work
            st[p, 2 * b] = t
            t += wait
            st[p, 2 * b + 1] = t
        st[p, 14] = t + work
    st[1, 12] = st[1, 3] + 700  # program 1 holds an attention item and merges
    st[1, 13] = st[1, 12] + 300
    ph = _phases(st, 1000.0, {"norm + QKV": 3_000_000})
    # torch.median: the lower of the two middle values
    assert ph["norm + QKV"] == {"median_us": 1.0, "max_us": 1.5, "barrier_us": 0.1,
                                "gbs": 2000.0}  # 3 MB in the slowest program's 1.5 us
    assert "gbs" not in ph["attention"]
    # phase 2 starts when each program leaves barrier 1: 1.5 (program 0) and 1.6 (program 1)
    assert ph["attention"]["max_us"] == 1.5 and ph["attention"]["item_max_us"] == 0.7
    assert ph["attention"]["merge_max_us"] == 0.3
    assert "barrier_us" not in ph["W2 + combine"] and ph["W2 + combine"]["max_us"] == 1.5
    assert ph["layer_us"] == 5 * 1.6 + 1.5
    doc = {"device": "H200", "config": "qwen3-moe-like", "layers": 4, "ctx": 1024,
           "clock_mhz": 1000.0, "results": [
               {"variant": "default", "us": 200.0, "us_layer": 50.0, "rel_vs_first": 0.0,
                "launch": {"programs": 264, "per_sm": 2, "num_warps": 4, "tile": 8192,
                           "pipe": 3, "regs": 240, "spills": 0,
                           "smem": 71680}, "phases": ph},
               {"variant": "programs=999", "refused": "programs: expected at most 264"}]}
    md = markdown(doc)
    assert "| default | 200.0 | 50.0 | 0.0e+00 | 264 (2 an SM), 4 warps" in md
    assert "| programs=999 | refused |" in md
    assert all(f"| {name}" in md for name in PHASES)
    assert "| norm + QKV | 1.0 | 1.5 | 0.1 | 2000.0 |" in md


def test_layer_bench_phase_bytes_are_the_weights_a_row_reads():
    from graphrt.bench.layer import phase_bytes
    from graphrt.moe import preset
    b = phase_bytes(preset("qwen3-moe-like", layers=4, experts=64))
    mib = {k: v / 2 ** 20 for k, v in b.items()}
    # BENCHMARKS.md §39-§40's per-phase bytes: QKV 20, wo 16, W13 48, W2 24 MiB; gate 256 KB
    assert mib == {"norm + QKV": 20.0, "o-projection": 16.0, "norm + gate": 0.25,
                   "top-k + W13": 48.0, "W2 + combine": 24.0}


def test_layer_bench_refuses_what_it_cannot_run(capsys):
    from graphrt.bench.layer import main
    assert main(["--variant", "warps=four", "--out", "unused.json"]) == 2
    assert "warps needs an int" in capsys.readouterr().err
    assert main(["--config", "dsv3-like", "--out", "unused.json"]) == 2
    err = capsys.readouterr().err
    assert "CUDA" in err or "does not fit" in err


def test_the_switchs_own_module_imports_first():
    """README and docs/architecture.md name kernels/ops_launchers.py as the home of
    ``launchers_as_ops``: importing it before ``graphrt.kernels.ops`` failed (a circular
    import)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "from graphrt.kernels.ops_launchers import "
                        "launchers_as_ops; from graphrt.kernels.ops import launchers_as_ops as b; "
                        "assert launchers_as_ops is b"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_the_compiled_model_step_compiles_once():
    """``torch.compile(model.step, dynamic=False)`` (the bench's compile mode) recompiled on
    every call: LocalComm's dispatch counter, a host int, was a guard (read even when not
    counted: an eager step between compiled ones recompiled). Under compilation it is neither
    counted nor read (the eager path still refuses a stale combine)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    from graphrt.moe import MoEModel, preset
    model = MoEModel(preset("tiny"), "cpu")
    model.overlap = False
    inputs = model.example_inputs(2, "cpu", torch.Generator().manual_seed(0))
    n = torch.tensor([2], dtype=torch.int32)
    torch._dynamo.reset()
    counter = CompileCounter()
    step = torch.compile(model.step, backend=counter, dynamic=False)
    with gops.launchers_as_ops(), torch.no_grad():
        for _ in range(3):
            step(**inputs, n=n)
            model.step(**inputs, n=n)                 # an eager check between
    assert counter.frame_count == 1
    torch._dynamo.reset()
