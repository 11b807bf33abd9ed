"""The compacted ``silu_and_mul_masked`` (``compact=True``): a ``(P, C)`` grid shared by the
live rows of all experts. Bitwise equal to the per-expert kernel (CPU interpreter, sm_90
compile, H200 eager and CUDA-graph replay), rows past masked_m untouched."""
from __future__ import annotations

import textwrap

import pytest
import torch

from graphrt.kernels import activation
from graphrt.kernels._util import interpreting
from graphrt.kernels.activation import silu_and_mul_masked, silu_and_mul_masked_ref

from tests.kernels.sm90 import compile_results

cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")



@pytest.fixture(autouse=True)
def _full_grid(monkeypatch):
    """These tests launch the plan's full grid on CPU too (not ``CPU_ROW_PROGRAMS``)."""
    monkeypatch.setattr(activation, "CPU_ROW_PROGRAMS", None)


_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _masked_m(pattern, E, cap, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(E, dtype=torch.int32)
    if pattern == "one":  # one live expert (decode bs 1 at EP: a single routed expert here)
        m[E // 2] = cap
    elif pattern == "some":  # a few live experts with ragged counts, among idle ones
        live = torch.randperm(E, generator=g)[:max(1, E // 8)]
        m[live] = torch.randint(1, cap + 1, (live.numel(),), generator=g, dtype=torch.int32)
    elif pattern == "full":
        m[:] = cap
    elif pattern == "over":  # counts past cap (clamped) and a negative one (no rows)
        m = torch.randint(0, 2 * cap + 2, (E,), generator=g, dtype=torch.int32)
        m[0], m[-1] = cap + 5, -1 if E > 1 else cap + 5
    return m


def _run_both(u, masked_m, dtype):
    """(compact out, per-expert out), each NaN-poisoned first."""
    E, cap, two_inter = u.shape
    outs = [torch.full((E, cap, two_inter // 2), float("nan"), dtype=dtype, device=u.device)
            for _ in range(2)]
    assert silu_and_mul_masked(u, masked_m, out=outs[0], compact=True) is outs[0]
    silu_and_mul_masked(u, masked_m, out=outs[1], compact=False)
    return outs


def _check(compact, per_expert, u, masked_m):
    bits = _BITS[compact.dtype]  # bitwise, NaN poison included
    assert torch.equal(compact.view(bits), per_expert.view(bits)), "compact != per-expert kernel"
    live = torch.arange(u.shape[1])[None, :] < masked_m.cpu()[:, None]  # [E, cap]
    got = compact.cpu()
    assert torch.isnan(got[~live].float()).all(), "rows past masked_m must not be written"
    ref = silu_and_mul_masked_ref(u, masked_m).to(got.dtype)
    torch.testing.assert_close(got[live], ref[live])


PATTERNS = ("zero", "one", "some", "full", "over")


def _cpu_ms(E, cap, inter, pattern):
    """Rough interpreter time of one case, both kernels (programs ~0.7 ms, rows ~6 ms)."""
    live = {"zero": 0, "one": cap, "some": max(1, E // 8) * cap}.get(pattern, E * cap)
    blocks = -(-inter // 1024)
    return 0.7 * (E * min(cap, 64) + min(E * cap, 256) * min(blocks, 4)) + 6 * live * blocks


# E 1-256 (E_PAD up to 256), cap 1-16, inter 64 (one short block), 768 (a masked tail),
# 2048 (two chunks), 5120 (five blocks over C = 4 chunks: chunk 0 steps); the CPU time of
# the whole list is bounded (< 40 s), so the biggest layouts run their cheaper patterns.
INTERS = {1: (64, 2048), 8: (768, 2048), 64: (64, 768), 256: (64,)}
CASES = [(E, cap, inter, pattern) for E, inters in INTERS.items() for cap in (1, 3, 16)
         for inter in inters for pattern in PATTERNS
         if _cpu_ms(E, cap, inter, pattern) <= 1200 and not (E == 1 and pattern == "one")]
CASES += [(256, 1, 64, "full"), (256, 1, 64, "over"), (256, 16, 64, "one"),
          (64, 16, 64, "some"), (64, 3, 64, "over"), (2, 3, 5120, "full"), (8, 3, 5120, "over")]


@cpu_interpreter
@pytest.mark.parametrize("E,cap,inter,pattern", CASES)
def test_compact_matches_per_expert_kernel_cpu(E, cap, inter, pattern):
    torch.manual_seed(E + cap + inter)
    u32 = torch.randn(E, cap, 2 * inter) * 2
    masked_m = _masked_m(pattern, E, cap, E * cap)
    cheap = _cpu_ms(E, cap, inter, pattern) <= 150
    for dtype in (torch.bfloat16, torch.float32) if cheap else (torch.bfloat16,):
        u = u32.to(dtype)
        _check(*_run_both(u, masked_m, dtype), u, masked_m)


@cpu_interpreter
def test_compact_strided_rows_and_fp16_cpu():
    """Row strides wider than the row (a GEMM output slice) and fp16."""
    E, cap, inter = 6, 5, 96
    base = (torch.randn(E, cap + 2, 2 * inter + 32) * 2).to(torch.float16)
    u = base[:, :cap, :2 * inter]
    masked_m = torch.tensor([5, 0, 2, 9, 1, 0], dtype=torch.int32)
    out = torch.full((E, cap + 1, inter + 16), float("nan"), dtype=torch.float16)[:, :cap, :inter]
    ref = torch.full_like(out, float("nan"))
    silu_and_mul_masked(u, masked_m, out=out, compact=True)
    silu_and_mul_masked(u, masked_m, out=ref, compact=False)
    _check(out, ref, u, masked_m)


@cpu_interpreter
def test_compact_small_cpu_grid_is_bitwise_the_full_grid(monkeypatch):
    """Off CUDA the kernel runs on ``CPU_ROW_PROGRAMS`` row programs and one column chunk
    (grid-stride loops): the same bits as the plan's (256, 4) grid."""
    E, cap, inter = 64, 3, 2048 + 96
    u = (torch.randn(E, cap, 2 * inter, generator=torch.Generator().manual_seed(5)) * 2).to(
        torch.bfloat16)
    masked_m = _masked_m("some", E, cap, seed=5)
    assert activation._compact_plan(E, cap, inter)[0] == (192, 3)
    outs = [torch.full((E, cap, inter), float("nan"), dtype=torch.bfloat16) for _ in range(2)]
    silu_and_mul_masked(u, masked_m, out=outs[0], compact=True)
    monkeypatch.setattr(activation, "CPU_ROW_PROGRAMS", 4)
    silu_and_mul_masked(u, masked_m, out=outs[1], compact=True)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    _check(outs[1], outs[0], u, masked_m)


def test_compact_plan_depends_on_shapes_only():
    plan = activation._compact_plan
    assert plan(8, 1, 2048) == ((8, 2), 8, 1024)  # bs 1 at 8 local experts: 16 programs
    assert plan(256, 64, 2048) == ((256, 2), 256, 1024)
    assert plan(64, 16, 768) == ((256, 1), 64, 1024)  # one chunk covers 768 columns
    assert plan(3, 5, 96) == ((15, 1), 4, 128)
    assert plan(32, 8, 7168) == ((256, 4), 32, 1024)  # 7 blocks of columns over 4 chunks
    assert plan(1024, 1, 64) == ((256, 1), 1024, 64)
    assert plan(1025, 1, 64) is None  # masked_m no longer one vector: per-expert kernel
    assert plan(1024, 2**21, 64) is None  # E * cap >= 2**31


def test_compact_default_comes_from_the_environment(monkeypatch):
    from graphrt.env import env_flag

    assert activation.COMPACT is env_flag("GRAPHRT_ACT_COMPACT", True)
    launched = []

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.name, grid))

    monkeypatch.setattr(activation, "_silu_and_mul_compact_kernel", Spy("compact"))
    monkeypatch.setattr(activation, "_silu_and_mul_masked_kernel", Spy("per-expert"))
    u, m = torch.zeros(4, 2, 64), torch.zeros(4, dtype=torch.int32)
    out = torch.empty(4, 2, 32)
    for default in (False, True):
        monkeypatch.setattr(activation, "COMPACT", default)
        for compact in (None, True, False):
            silu_and_mul_masked(u, m, out=out, compact=compact)
    assert [name for name, _ in launched] == ["per-expert", "compact", "per-expert",
                                              "compact", "compact", "per-expert"]
    assert launched[1][1] == (8, 1)
    launched.clear()
    big = torch.zeros(1025, 1, 64)  # past the one-vector limit: falls back
    silu_and_mul_masked(big, torch.zeros(1025, dtype=torch.int32), out=torch.empty(1025, 1, 32),
                        compact=True)
    assert launched == [("per-expert", (1025, 1))]


SM90 = textwrap.dedent('''
    from graphrt.kernels.activation import _fp8_compact_kernel, _silu_and_mul_compact_kernel

    def facts(p):
        load = p.find("ld.global")
        return {"wait": "griddepcontrol.wait" in p,
                "wait_first": 0 <= p.find("griddepcontrol.wait") < load,
                "store": "st.global" in p, "exp": "ex2.approx" in p, "spill": "ld.local" in p}

    out = {}
    for dt in ("bf16", "fp32"):
        sig = {"u_ptr": f"*{dt}", "masked_m_ptr": "*i32", "out_ptr": f"*{dt}",
               **{k: "i32" for k in ("num_experts inter cap stride_ue stride_um stride_oe "
                                     "stride_om").split()}}
        for e_pad in (1, 8, 256, 1024):
            for gdc in (0, 1, 2):
                out[f"{dt}-{e_pad}-{gdc}"] = facts(ptx(_silu_and_mul_compact_kernel, sig,
                                                       dict(E_PAD=e_pad, BLOCK_N=1024, USE_GDC=gdc)))
    sig = {"u_ptr": "*bf16", "masked_m_ptr": "*i32", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
           **{k: "i32" for k in ("num_experts inter cap stride_ue stride_um stride_qe stride_qm "
                                 "stride_se stride_sm stride_sg").split()}}
    for e_pad in (8, 256, 1024):
        for silu in (True, False):
            for gdc in (0, 2):
                out[f"fp8-{e_pad}-{silu}-{gdc}"] = facts(ptx(
                    _fp8_compact_kernel, sig, dict(E_PAD=e_pad, GROUP=128, GROUPS_PER_STEP=8,
                                                   SILU=silu, USE_GDC=gdc)))
    print(json.dumps(out))
''')


def test_the_compact_kernels_compile_for_sm90():
    """The bf16 kernel (bf16 and fp32, E_PAD 1-1024, USE_GDC 0/1/2) and the fp8 one (E_PAD
    8-1024, with and without the SiLU, PDL off and on) compile; ``griddepcontrol.wait`` is in
    the PTX exactly when ``USE_GDC != 0`` and comes before the first global load; the
    exponential only where there is a SiLU; no spills."""
    res = compile_results(SM90)
    assert len(res) == 36
    for key, found in res.items():
        gdc, silu = not key.endswith("-0"), not key.startswith("fp8-") or "-True-" in key
        assert found == {"wait": gdc, "wait_first": gdc, "store": True, "exp": silu,
                         "spill": False}, key


# ---------------------------------------------------------------- GPU (H200) at real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("E,inter", [(256, 2048), (64, 768), (32, 7168)])
@pytest.mark.parametrize("cap", [1, 8, 64])
def test_compact_gpu(E, inter, cap, cuda_device):
    torch.manual_seed(cap)
    u = (torch.randn(E, cap, 2 * inter, device=cuda_device) * 2).to(torch.bfloat16)
    for pattern in ("zero", "one", "some", "full", "over"):
        masked_m = _masked_m(pattern, E, cap, cap).to(cuda_device)
        _check(*_run_both(u, masked_m, torch.bfloat16), u, masked_m)


@pytest.mark.gpu
def test_compact_cuda_graph_gpu(cuda_device):
    """One capture of both kernels serves any masked_m: replays equal, dead rows untouched."""
    E, cap, inter, dev = 256, 16, 2048, cuda_device
    torch.manual_seed(0)
    u = (torch.randn(E, cap, 2 * inter, device=dev) * 2).to(torch.bfloat16)
    masked_m = torch.zeros(E, dtype=torch.int32, device=dev)
    outs = [torch.empty(E, cap, inter, dtype=torch.bfloat16, device=dev) for _ in range(2)]

    def step():
        silu_and_mul_masked(u, masked_m, out=outs[0], compact=True)
        silu_and_mul_masked(u, masked_m, out=outs[1], compact=False)

    step()  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed, pattern in enumerate(("one", "some", "zero", "full", "over", "some")):
        masked_m.copy_(_masked_m(pattern, E, cap, seed))
        u.copy_((torch.randn(E, cap, 2 * inter, device=dev) * 2).to(torch.bfloat16))
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(outs[0], outs[1], u, masked_m)


# ------------------------------------------------------------------ the fp8 kernels, compacted
@cpu_interpreter
@pytest.mark.parametrize("E,cap,cols,group,pattern", [
    (1, 3, 256, 128, "full"), (8, 3, 1024, 128, "some"), (8, 2, 7168, 128, "over"),
    (64, 1, 256, 128, "one"), (6, 4, 256, 64, "full"), (256, 1, 128, 128, "some")])
def test_fp8_compact_matches_per_expert_kernel_cpu(E, cap, cols, group, pattern, monkeypatch):
    """``silu_and_mul_masked_fp8`` and ``quantize_fp8_masked`` on the compacted grid: the
    per-expert kernel's bits (q and scales, NaN-poisoned rows past masked_m untouched), on
    the full (P, C) grid and on the CPU's reduced one; dsv3-like hidden rows (56 groups,
    7 steps over 8 column programs) included."""
    from graphrt.kernels.activation import quantize_fp8_masked, silu_and_mul_masked_fp8
    g = torch.Generator().manual_seed(E * cap + cols)
    masked_m = _masked_m(pattern, E, cap, seed=E + cols)
    for silu in (True, False):
        src = (torch.randn(E, cap, 2 * cols if silu else cols, generator=g) * 3).to(torch.bfloat16)
        outs = []
        for compact, cpu_rows in ((False, 4), (True, None), (True, 4)):
            monkeypatch.setattr(activation, "CPU_ROW_PROGRAMS", cpu_rows)
            q = torch.full((E, cap, cols), float("nan")).to(torch.float8_e4m3fn)
            s = torch.full((E, cols // group, cap), float("nan")).transpose(1, 2)  # MN-major
            fn = silu_and_mul_masked_fp8 if silu else quantize_fp8_masked
            fn(src, masked_m, out_q=q, out_scale=s, group_size=group, compact=compact)
            outs.append((q.view(torch.uint8), s))
        for q, s in outs[1:]:
            assert torch.equal(q, outs[0][0]), (silu, "q")
            assert torch.equal(s.view(torch.int32), outs[0][1].view(torch.int32)), (silu, "scale")
        live = torch.arange(cap)[None, :] < masked_m[:, None]
        assert torch.isnan(outs[1][1][~live]).all()  # rows past masked_m: untouched


@pytest.mark.gpu
@pytest.mark.parametrize("E,cols", [(256, 2048), (256, 7168), (64, 768)])
@pytest.mark.parametrize("cap", [1, 8, 64])
def test_fp8_compact_gpu(E, cols, cap, cuda_device):
    """The compacted fp8 kernels give the per-expert kernel's bits at real sizes."""
    from graphrt.kernels.activation import quantize_fp8_masked, silu_and_mul_masked_fp8
    torch.manual_seed(cap + cols)
    for silu in (True, False):
        src = (torch.randn(E, cap, 2 * cols if silu else cols, device=cuda_device) * 3).to(
            torch.bfloat16)
        fn = silu_and_mul_masked_fp8 if silu else quantize_fp8_masked
        for pattern in ("zero", "one", "some", "full", "over"):
            masked_m = _masked_m(pattern, E, cap, cap).to(cuda_device)
            outs = []
            for compact in (True, False):
                q = torch.zeros(E, cap, cols, device=cuda_device).to(torch.float8_e4m3fn)
                s = torch.full((E, cols // 128, cap), -1.0, device=cuda_device).transpose(1, 2)
                fn(src, masked_m, out_q=q, out_scale=s, compact=compact)
                outs.append((q.view(torch.uint8), s.view(torch.int32)))
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), \
                (silu, pattern)
