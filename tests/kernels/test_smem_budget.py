"""The decode GEMM's shared-memory budget comes from the device (``_util.smem_limits``), not
from an H200's figures: the same stages and grid on an H200, fewer stages on a smaller GPU
instead of a launch that asks for more shared memory than a program may have."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels import grouped_gemm_decode as gd

H200 = (232448, 233472)   # shared_memory_per_block_optin, shared_memory_per_multiprocessor
A100 = (166912, 167936)
L4 = (101376, 102400)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Answer ``smem_budget`` for a CUDA device with the limits given."""
    def use(limits):
        monkeypatch.setattr(gd, "smem_limits", lambda index: limits)
        monkeypatch.setattr(gd, "cuda_index", lambda device: 0)
        monkeypatch.setattr(gd, "sm_count", lambda index: 132)
    return use


def test_an_h200_keeps_the_figures_the_kernel_was_tuned_at(fake_gpu):
    fake_gpu(H200)
    cuda = torch.device("cuda")
    assert gd.smem_budget(cuda) == (200 << 10, 220 << 10)
    assert gd.smem_budget(torch.device("cpu")) == (200 << 10, 220 << 10)
    stage = (16 * 2 + 128 * 2) * 128                   # bf16, block_m 16, block_n 128: 36 KB
    assert gd.pipeline_stages(6, stage, cuda) == 5     # 5 * 36 KB <= 200 KB
    assert gd.num_programs(cuda, 10 ** 6, 5 * stage) == 2 * 1 * 132


@pytest.mark.parametrize("limits", [A100, L4])
def test_a_smaller_gpu_gets_fewer_stages_that_fit(fake_gpu, limits):
    fake_gpu(limits)
    cuda = torch.device("cuda")
    per_program, per_sm = gd.smem_budget(cuda)
    assert per_program < limits[0] and per_sm < limits[1]
    for stage in (4096, 36 << 10, 72 << 10, 300 << 10):
        n = gd.pipeline_stages(8, stage, cuda)
        assert n >= 1
        assert n == 1 or n * stage <= per_program             # never past the program's budget
        assert n == 8 or (n + 1) * stage > per_program or n == 1
    assert gd.pipeline_stages(4, 36 << 10, cuda) < gd.pipeline_stages(4, 36 << 10,
                                                                      torch.device("cpu")) == 4
    progs = gd.num_programs(cuda, 10 ** 6, 64 << 10)
    assert progs == 2 * (per_sm // (64 << 10)) * 132


def test_the_launch_asks_for_the_capped_stages(monkeypatch):
    """On the interpreter (CPU tensors), a launch under an L4's budget runs the kernel with
    the stages that fit, and still gives the reference's output."""
    seen = {}
    kernel = gd._decode_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen["num_stages"] = kw["num_stages"]
                return kernel[grid](*args, **kw)
            return launch
    monkeypatch.setattr(gd, "_decode_gemm_kernel", Spy())
    monkeypatch.setattr(gd, "smem_budget", lambda device: (L4[0] - (27 << 10), L4[1] - (8 << 10)))
    g = torch.Generator().manual_seed(0)
    E, cap, n, k = 2, 4, 256, 256
    a = torch.randn(E, cap, k, generator=g).bfloat16()
    b = (torch.randn(E, n, k, generator=g) * k ** -0.5).bfloat16()
    masked_m = torch.tensor([3, 1], dtype=torch.int32)
    out = torch.zeros(E, cap, n, dtype=torch.bfloat16)
    gd.decode_grouped_gemm(a, b, masked_m, out=out, block_n=128, num_stages=6)
    stage = (16 * 2 + 128 * 2) * 128
    assert seen["num_stages"] == (L4[0] - (27 << 10)) // stage == 2    # not 6
    ref = gd.decode_grouped_gemm_ref(a, b, masked_m)
    for e, m in enumerate(masked_m.tolist()):
        torch.testing.assert_close(out[e, :m].float(), ref[e, :m].float(), rtol=2e-2, atol=2e-2)
