"""The decode GEMVs with their weights loaded before the PDL wait (``preload=True``,
kernels._pdl) on the GPU, behind a slow kernel that writes their input: captured in one
graph, launched with PDL (so the GEMV's programs may start while the writer still runs),
replayed with new inputs. The GEMV must read the writer's new rows every replay, and its
output must be bitwise equal to the launch without preload.

The writer spins ~50 µs before it stores: long enough that the GEMV's programs are resident
and waiting (and have issued their weight loads) while it runs."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from graphrt.kernels._pdl import pdl_prologue
from graphrt.kernels._util import pdl_args
from graphrt.kernels.dense_gemv import dense_gemv_rows
from graphrt.kernels.norm_gemv import norm_gemv_rows

pytestmark = pytest.mark.gpu


@triton.jit
def _slow_copy_kernel(src_ptr, dst_ptr, numel, spins, BLOCK: tl.constexpr,
                      USE_GDC: tl.constexpr = False):
    """dst = src after ``spins`` dependent multiply-adds (a delay the compiler cannot drop:
    the stored value depends on it)."""
    pdl_prologue(USE_GDC)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for _ in range(spins):
        acc = acc * 0.5 + 1.0                      # converges to 2.0, never NaN
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    v = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (v + (acc - 2.0)).to(dst_ptr.dtype.element_ty), mask=mask)


def _slow_copy(src, dst, spins=20000):
    n = src.numel()
    _slow_copy_kernel[(triton.cdiv(n, 1024),)](src, dst, n, spins, BLOCK=1024, **pdl_args())


def _t(*shape, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


@pytest.fixture
def pdl(cuda_device):
    if not pdl_args():
        pytest.skip("PDL is off here (pre-Hopper GPU or GRAPHRT_PDL=0)")
    return cuda_device


def _captured(dev, launch):
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        launch()
    torch.cuda.current_stream(dev).wait_stream(s)
    return g


def _replays_read_the_new_rows(dev, src, x, out, launch, eager):
    """Capture the slow writer (``src`` -> ``x``), then ``launch`` (the GEMV with ``preload``,
    reading ``x``); replay with new rows in ``src``: every replay, ``x`` holds them and ``out``
    equals ``eager(src)`` (the GEMV without preload, run eagerly on the new rows)."""
    def step():
        _slow_copy(src, x)
        launch()
    g = _captured(dev, step)
    for i in range(5):
        src.copy_(_t(*src.shape, seed=10 + i))
        out.fill_(float("nan"))
        g.replay()
        want = eager(src)
        torch.cuda.synchronize(dev)
        assert torch.equal(x, src), i
        assert torch.equal(out, want), i


@pytest.mark.parametrize("n, k", [(5120, 2048), (2048, 4096), (9216, 7168)])
def test_rows_gemv_preload_reads_the_writers_rows(pdl, n, k):
    dev = pdl
    w = _t(n, k, seed=1, scale=k ** -0.5)
    src, x = _t(1, k, seed=2), torch.zeros(1, k, dtype=torch.bfloat16, device=dev)
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=dev)
    _replays_read_the_new_rows(
        dev, src, x, out, lambda: dense_gemv_rows(x, w, out=out, preload=True),
        lambda rows: dense_gemv_rows(rows, w, out=torch.empty_like(out)))


@pytest.mark.parametrize("num_deltas", [0, 2])
def test_norm_gemv_preload_reads_the_writers_rows(pdl, num_deltas):
    dev, n, k = pdl, 5120, 2048
    w = _t(n, k, seed=1, scale=k ** -0.5)
    nw = (1 + 0.1 * _t(k, seed=3).float()).to(torch.bfloat16)
    src, x = _t(1, k, seed=2), torch.zeros(1, k, dtype=torch.bfloat16, device=dev)
    deltas = [_t(1, k, seed=4 + i, scale=0.5) for i in range(num_deltas)]
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=dev)

    def gemv(rows, dst, preload=False):
        return norm_gemv_rows(rows, *deltas, norm_weight=nw, eps=1e-6, w=w, out=dst,
                              out_residual=torch.empty_like(rows) if deltas else None,
                              preload=preload)
    _replays_read_the_new_rows(dev, src, x, out, lambda: gemv(x, out, preload=True),
                               lambda rows: gemv(rows, torch.empty_like(out)))
