"""The EP=1 combine made by the norm that adds it to the residual (``combine=`` of
``kernels.norm.add_rmsnorm`` and ``kernels.norm_gemv.norm_gemv_rows``): bitwise the combine's
own launch followed by the norm, on the CPU interpreter and on the GPU (eager and replayed),
with padded rows, dropped and skipped picks and expert rows past ``masked_m`` full of NaN
that must not be read; and errors that say what to do."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels._util import interpreting
from graphrt.kernels.combine import combine_masked
from graphrt.kernels.dispatch import dispatch_masked
from graphrt.kernels.norm import add_rmsnorm
from graphrt.kernels.norm_gemv import norm_gemv_rows
from tests.kernels.dispatch_cases import sentinel_outs

cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


def _case(rows, n_live, E, k, cap, hidden, device, seed):
    """A routed step: ``(x, extra delta, combine args)``. The experts' output ``y`` is the
    dispatched rows scaled per expert; rows past ``masked_m`` stay NaN (never read)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 2).to(torch.bfloat16).to(device)
    d = torch.randn(rows, hidden, generator=g).to(torch.bfloat16).to(device)
    ids = torch.rand(rows, E, generator=g).argsort(dim=1)[:, :k].to(torch.int64)
    ids[n_live:] = -1
    if n_live >= 2:
        ids[0, -1] = -1  # a live row that skips a pick
    w = torch.rand(rows, k, generator=g) + 0.1
    ids, w = ids.to(device).contiguous(), w.to(device)
    outs = sentinel_outs(rows, k, E, cap, hidden, torch.bfloat16, device)
    dispatch_masked(x, ids, **outs)
    scale = (torch.rand(E, 1, 1, generator=g) + 0.5).to(device)
    y = (outs["out_recv_x"].float() * scale).to(torch.bfloat16).contiguous()
    n = torch.tensor([n_live], dtype=torch.int32, device=device)
    return x, d, (y, ids, w, outs["out_pos"], n)


def _combined(combine, like):
    out = torch.full_like(like, float("nan"))
    return combine_masked(*combine, out=out)


def _norm_both(x, d, combine, nw, extra):
    """(fused, unfused) ``(out, residual)`` of add_rmsnorm with the combine first."""
    deltas = (d,) if extra else ()
    out, res = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    add_rmsnorm(x, *deltas, weight=nw, eps=1e-6, out=out, out_residual=res, combine=combine)
    want, want_res = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    add_rmsnorm(x, _combined(combine, x), *deltas, weight=nw, eps=1e-6, out=want,
                out_residual=want_res)
    return (out, res), (want, want_res)


def _gemv_both(x, d, combine, nw, w, extra):
    """(fused, unfused) ``(out, residual, normed)`` of norm_gemv_rows with the combine first."""
    deltas = (d,) if extra else ()
    got = [torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device),
           torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))]
    norm_gemv_rows(x, *deltas, norm_weight=nw, eps=1e-6, w=w, out=got[0], out_residual=got[1],
                   out_normed=got[2], combine=combine)
    want = [torch.full_like(t, float("nan")) for t in got]
    norm_gemv_rows(x, _combined(combine, x), *deltas, norm_weight=nw, eps=1e-6, w=w, out=want[0],
                   out_residual=want[1], out_normed=want[2])
    return got, want


@cpu_interpreter
@pytest.mark.parametrize("rows, n_live, E, k, cap, hidden", [
    (1, 1, 8, 2, 4, 64), (4, 3, 16, 4, 3, 96), (6, 6, 32, 8, 6, 128)])
@pytest.mark.parametrize("extra", [False, True])
def test_add_rmsnorm_with_the_combine_is_the_two_launches_bitwise(rows, n_live, E, k, cap,
                                                                   hidden, extra):
    x, d, combine = _case(rows, n_live, E, k, cap, hidden, "cpu", seed=rows + E)
    nw = (torch.rand(hidden) + 0.5).to(torch.bfloat16)
    (out, res), (want, want_res) = _norm_both(x, d, combine, nw, extra)
    assert torch.equal(out, want) and torch.equal(res, want_res)
    assert not out.isnan().any()


@cpu_interpreter
@pytest.mark.parametrize("m, n_live", [(1, 1), (2, 1), (4, 4)])
@pytest.mark.parametrize("extra", [False, True])
def test_norm_gemv_with_the_combine_is_the_two_launches_bitwise(m, n_live, extra):
    x, d, combine = _case(m, n_live, 16, 4, 4, 200, "cpu", seed=m)
    nw = (torch.rand(200) + 0.5).to(torch.bfloat16)
    w = (torch.randn(40, 200) / 14).to(torch.bfloat16)
    got, want = _gemv_both(x, d, combine, nw, w, extra)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_combine_arguments_are_checked():
    x, d, combine = _case(2, 2, 8, 2, 2, 64, "cpu", seed=0)
    nw = torch.ones(64, dtype=torch.bfloat16)
    out, res = torch.empty_like(x), torch.empty_like(x)
    with pytest.raises(ValueError, match=r"number of deltas \(the combine included\)"):
        add_rmsnorm(x, d, d, weight=nw, eps=1e-6, out=out, out_residual=res, combine=combine)
    with pytest.raises(ValueError, match=r"\(y, topk_ids, topk_weights, pos, n\)"):
        add_rmsnorm(x, weight=nw, eps=1e-6, out=out, out_residual=res, combine=combine[:4])
    with pytest.raises(ValueError, match=r"combine topk_ids\.shape"):
        add_rmsnorm(x[:1], weight=nw, eps=1e-6, out=out[:1], out_residual=res[:1],
                    combine=combine)
    with pytest.raises(ValueError, match="out_residual is required"):
        add_rmsnorm(x, weight=nw, eps=1e-6, out=out, combine=combine)
    w = torch.ones(8, 64, dtype=torch.bfloat16)
    y = torch.empty(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="combine's y"):
        norm_gemv_rows(x, norm_weight=nw, eps=1e-6, w=w, out=y, out_residual=combine[0][0, :2],
                       combine=combine)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, n_live", [(1, 1), (16, 13), (64, 64)])
@pytest.mark.parametrize("hidden", [2048, 7168])
def test_gpu_add_rmsnorm_with_the_combine_bitwise_eager_and_replayed(cuda_device, rows, n_live,
                                                                     hidden):
    dev = cuda_device
    x, d, combine = _case(rows, n_live, 64, 8, rows, hidden, dev, seed=rows)
    nw = (torch.rand(hidden, device=dev) + 0.5).to(torch.bfloat16)
    for extra in (False, True):
        (out, res), (want, want_res) = _norm_both(x, d, combine, nw, extra)
        assert torch.equal(out, want) and torch.equal(res, want_res)
    out, res = torch.empty_like(x), torch.empty_like(x)

    def launch():
        add_rmsnorm(x, d, weight=nw, eps=1e-6, out=out, out_residual=res, combine=combine)
    launch()
    eager = out.clone(), res.clone()
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        launch()
    torch.cuda.current_stream(dev).wait_stream(s)
    out.fill_(float("nan")), res.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize(dev)
    assert torch.equal(out, eager[0]) and torch.equal(res, eager[1])


@pytest.mark.gpu
@pytest.mark.parametrize("n_live", [1, 0])
def test_gpu_norm_gemv_with_the_combine_bitwise_at_the_qkv_shape(cuda_device, n_live):
    """qwen3-like: 64 experts top-8, hidden 2048, the QKV's 5120 outputs; n = 0 too (a
    padded row combines to zeros)."""
    dev = cuda_device
    x, d, combine = _case(1, n_live, 64, 8, 64, 2048, dev, seed=7)
    nw = (torch.rand(2048, device=dev) + 0.5).to(torch.bfloat16)
    w = (torch.randn(5120, 2048, device=dev) / 45).to(torch.bfloat16)
    for extra in (False, True):
        got, want = _gemv_both(x, d, combine, nw, w, extra)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


NORM_SM90 = '''
    from graphrt.kernels.norm import _add_rmsnorm_kernel

    sig = dict(x_ptr="*bf16", d1_ptr="*bf16", d2_ptr="*bf16", w_ptr="*bf16", res_ptr="*bf16",
               out_ptr="*bf16", hidden="i32", eps="fp32", stride_x="i32", stride_d1="i32",
               stride_d2="i32", stride_res="i32", stride_out="i32", cy_ptr="*bf16",
               cids_ptr="*i64", cw_ptr="*fp32", cpos_ptr="*i32", cn_ptr="*i32", cap="i32",
               num_experts="i32")
    out = {}
    for block, warps in ((2048, 4), (8192, 16)):
        for na in (1, 2):
            p = ptx(_add_rmsnorm_kernel, sig, dict(NUM_ADD=na, BLOCK=block, COMBINE=True,
                    NUM_TOPK=8, USE_GDC=2), num_warps=warps)
            wait, load = p.find("griddepcontrol.wait"), p.find("ld.global")
            out[f"{block}-{na}"] = [wait >= 0, 0 <= load < wait]
    print(json.dumps(out))
'''


def test_add_rmsnorm_with_the_combine_compiles_for_sm90():
    """The real compiler (sm_90 PTX, on the CPU) at the qwen3-like and dsv3-like hidden
    sizes: it compiles and reads nothing before its PDL wait (y, ids and pos are the kernels'
    before it). The norm GEMV's variant: tests/kernels/test_compile_sm90.py."""
    from tests.kernels.sm90 import compile_results
    res = compile_results(NORM_SM90)
    assert len(res) == 4
    for key, (waits, load_first) in res.items():
        assert waits and not load_first, key
