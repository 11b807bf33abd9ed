"""The weight-resident GEMV (``kernels.gemv_resident``) on the GPU: against the fp32 reference
at the qwen3-like o-proj shape for 1-16 rows, and small enough in registers that a program
fits on an SM beside a decode-attention program (the point: to be resident while attention
runs)."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.dense_gemv import dense_gemv_ref, num_sms
from graphrt.kernels.gemv_resident import _gemv_resident_kernel, dense_gemv_resident, resident_config

pytestmark = pytest.mark.gpu


def _t(*shape, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 2, 16])
@pytest.mark.parametrize("n, k", [(2048, 4096), (1000, 2050), (64, 2048)])
def test_matches_ref_on_the_gpu(cuda_device, m, n, k):
    x, w = _t(m, k, seed=m), _t(n, k, seed=7, scale=k ** -0.5)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=cuda_device)
    dense_gemv_resident(x, w, out=out)
    ref = x.double() @ w.double().t()
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < 8e-3, rel                                    # bf16 output rounding
    assert torch.equal(out, dense_gemv_resident(x, w, out=torch.empty_like(out)))
    assert float((dense_gemv_ref(x, w).double() - ref).norm() / ref.norm()) < 8e-3


@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
def test_a_program_fits_beside_an_attention_program(cuda_device, chunks):
    """The o-proj config compiles to at most 104 registers a thread at 16 warps (52 K of the
    SM's 64 K), so a decode-attention split program (88 x 128 = 11 K) fits beside it, in
    one round or in ``chunks`` fenced ones."""
    n, k = 2048, 4096
    cfg = resident_config(n, k, num_sms(cuda_device))
    x, w = _t(1, k, seed=1), _t(n, k, seed=2)
    out = torch.empty(1, n, dtype=torch.bfloat16, device=cuda_device)
    ck = _gemv_resident_kernel[(cfg["programs"],)](
        x.view(torch.int32), w.view(torch.int32), out, 1, n, k // 2, M_MAX=1,
        BLOCK_N=cfg["block_n"], BLOCK_K2=cfg["block_k2"], CHUNKS=chunks, FENCE=True,
        num_warps=cfg["num_warps"])
    print(f"resident GEMV o-proj, {chunks} rounds: {ck.n_regs} registers a thread, "
          f"{ck.n_spills} spills, {cfg['num_warps']} warps")
    assert ck.n_regs * 32 * cfg["num_warps"] + 88 * 128 <= 65536, ck.n_regs
    assert ck.n_spills == 0
