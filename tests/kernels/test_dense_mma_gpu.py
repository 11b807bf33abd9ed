"""The tensor-core decode GEMM (``kernels/dense_mma.py``) on the GPU at the real dense shapes:
within bf16 rounding of the fp32 reference for 2-16 rows with the config rule's pick and
with forced split-K, bitwise equal from eager to CUDA-graph replay and replay to replay
(the in-launch split-K reduction is deterministic), the semaphore zero after every launch,
one graph following new x and W; ``preload=True`` bitwise the plain launch."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.dense_gemv import num_sms
from graphrt.kernels.dense_mma import (
    dense_mma,
    dense_mma_config,
    dense_mma_ref,
    dense_mma_semaphore_shape,
    dense_mma_workspace_shape,
)

from dense_cases import SHAPES as CASES, TOL, rel_err as _rel_err, weights as dense_weights, \
    x_rows as _x

pytestmark = pytest.mark.gpu

SHAPES = {**CASES, "ragged": (1000, 1000)}
ROWS = (2, 3, 8, 16)


@pytest.fixture(scope="module", params=list(SHAPES))
def weights(request):
    return dense_weights(*SHAPES[request.param])


def _configs(m, n, k):
    auto = dense_mma_config(m, n, k, num_sms(torch.device("cuda")))
    return [auto, {**auto, "split_k": 4}, {**auto, "block_n": 128, "block_k": 64, "split_k": 1},
            {**auto, "block_k": 256, "split_k": 3, "num_stages": 3}]


@pytest.mark.parametrize("m", ROWS)
def test_gpu_matches_ref_and_replays_bitwise(weights, m):
    n, k = weights.shape
    sem = torch.zeros(dense_mma_semaphore_shape(n), dtype=torch.int32, device="cuda")
    for cfg in _configs(m, n, k):
        x = _x(m, k, seed=m)
        ws = torch.full(dense_mma_workspace_shape(m, n, cfg["split_k"]), float("nan"),
                        device="cuda")
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        dense_mma(x, weights, out=out, workspace=ws, semaphore=sem, **cfg)
        assert _rel_err(out, dense_mma_ref(x, weights)) < TOL, cfg
        assert not sem.any(), cfg
        eager = out.clone()
        out.fill_(float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dense_mma(x, weights, out=out, workspace=ws, semaphore=sem, **cfg)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), cfg
            assert not sem.any(), cfg
        x.copy_(_x(m, k, seed=m + 100))  # the same graph on new rows
        graph.replay()
        assert _rel_err(out, dense_mma_ref(x, weights)) < TOL, cfg


@pytest.mark.parametrize("m", (2, 16))
def test_gpu_preload_is_bitwise_the_plain_launch(weights, m):
    """``preload=True`` (the first weight tile loaded before the PDL wait): the same bits as
    without it, eager and replayed, unsplit and split."""
    n, k = weights.shape
    sem = torch.zeros(dense_mma_semaphore_shape(n), dtype=torch.int32, device="cuda")
    x = _x(m, k, seed=m + 7)
    for cfg in _configs(m, n, k)[:2]:
        ws = torch.empty(dense_mma_workspace_shape(m, n, cfg["split_k"]), device="cuda")
        plain = dense_mma(x, weights, out=torch.empty(m, n, dtype=torch.bfloat16, device="cuda"),
                          workspace=ws, semaphore=sem, **cfg)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        graph = torch.cuda.CUDAGraph()
        dense_mma(x, weights, out=out, workspace=ws, semaphore=sem, preload=True, **cfg)
        assert torch.equal(out, plain), cfg
        with torch.cuda.graph(graph):
            dense_mma(x, weights, out=out, workspace=ws, semaphore=sem, preload=True, **cfg)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain) and not sem.any(), cfg


def test_gpu_many_launches_share_one_semaphore():
    """64 split-K launches back to back on one semaphore (as the weights of successive
    layers would) in one graph: each result right, the semaphore zero at the end."""
    n, k, m = 2048, 4096, 16
    g = torch.Generator(device="cuda").manual_seed(1)
    ws_ = [(torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)
           for _ in range(8)]
    xs = [_x(m, k, seed=i) for i in range(8)]
    outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(8)]
    cfg = {**dense_mma_config(m, n, k, num_sms(torch.device("cuda"))), "split_k": 8}
    sem = torch.zeros(dense_mma_semaphore_shape(n), dtype=torch.int32, device="cuda")
    ws = torch.empty(dense_mma_workspace_shape(m, n, 8), device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(8):
            for x, w, out in zip(xs, ws_, outs):
                dense_mma(x, w, out=out, workspace=ws, semaphore=sem, **cfg)
    for _ in range(2):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for x, w, out in zip(xs, ws_, outs):
            assert _rel_err(out, dense_mma_ref(x, w)) < TOL
        assert not sem.any()
