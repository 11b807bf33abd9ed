"""The decode step's row unpacking and greedy sampling on the GPU: ``greedy_sample`` equals
``torch.argmax`` (CUDA) index for index on random bf16 logits at bs 1, 8, 64 and vocab 32768
and 151936 with deliberate ties, -inf masks, all -inf rows and NaN; ``unpack_rows`` equals its
torch reference; both captured in one CUDA graph (PDL on and off) and replayed with new rows
and logits, outputs poisoned before each replay, give the eager answers."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.decode_io import (greedy_sample, greedy_sample_ref, unpack_rows,
                                       unpack_rows_ref)

pytestmark = pytest.mark.gpu

NAN, INF = float("nan"), float("inf")
KW = dict(vocab=151936, max_ctx=4096, scratch_slot=65535 * 16, scratch_block=65535)


def _logits(bs, vocab, seed, device, dtype=torch.bfloat16):
    """Random logits (bf16 rounding makes natural ties near the top); then by row: two equal
    planted maxima far apart, a top-50 style -inf mask with a tied pair, a fully masked row,
    a NaN, or nothing planted."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(bs, vocab, generator=g) * 3).to(dtype)
    for r in range(bs):
        a = int(torch.randint(0, vocab // 2, (1,), generator=g))
        b = int(torch.randint(vocab // 2, vocab, (1,), generator=g))
        case = r % 6
        if case == 0:
            x[r, a] = x[r, b] = 40
        elif case == 1:
            keep = torch.randperm(vocab, generator=g)[:50]
            row = torch.full((vocab,), -INF, dtype=dtype)
            row[keep] = x[r, keep]
            row[a], row[b] = 50, 50
            x[r] = row
        elif case == 2 and bs > 1:
            x[r] = -INF
        elif case == 3:
            x[r, b] = NAN
    return x.to(device)


@pytest.mark.parametrize("vocab", [32768, 151936])
@pytest.mark.parametrize("bs", [1, 8, 64])
def test_gpu_greedy_sample_bitwise_equals_torch_argmax(cuda_device, bs, vocab):
    sampled = torch.full((128,), -7, dtype=torch.int64, device=cuda_device)
    for seed in range(4):
        x = _logits(bs, vocab, seed * 100 + bs, cuda_device)
        ids = torch.full((bs,), -5, dtype=torch.int64, device=cuda_device)
        greedy_sample(x, out_ids=ids, out_sampled=sampled)
        want = torch.argmax(x, dim=-1)
        assert torch.equal(ids, want), (seed, (ids != want).nonzero().flatten().tolist())
        assert torch.equal(sampled[:bs], want) and bool((sampled[bs:] == -7).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_greedy_sample_other_dtypes(cuda_device, dtype):
    x = _logits(16, 50000, 5, cuda_device, dtype)
    ids = torch.empty(16, dtype=torch.int64, device=cuda_device)
    assert torch.equal(greedy_sample(x, out_ids=ids), greedy_sample_ref(x))


def _rows(bs, max_blocks, seed, device):
    """Live rows in range, a few out of range, src into a 64-row sampled buffer (some past
    it), padded rows (-1 throughout) at the end."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 70000, (bs, 5 + max_blocks), generator=g, dtype=torch.int32)
    rows[:, 1] = torch.randint(-1, 70, (bs,), generator=g, dtype=torch.int32)
    rows[:, 3] = torch.randint(-2, 65535 * 16 + 9, (bs,), generator=g, dtype=torch.int32)
    rows[::7, 5:] = -1
    rows[::5, 0] = 2**31 - 1
    rows[bs - bs // 4:] = -1
    return rows.to(device)


def _outs(bs, max_blocks, device):
    i32, i64 = torch.int32, torch.int64
    return dict(out_tokens=torch.full((bs,), -9, dtype=i64, device=device),
                out_positions=torch.full((bs,), -9, dtype=i32, device=device),
                out_slots=torch.full((bs,), -9, dtype=i64, device=device),
                out_block_table=torch.full((bs, max_blocks), -9, dtype=i32, device=device),
                out_seq_lens=torch.full((bs,), -9, dtype=i32, device=device))


@pytest.mark.parametrize("bs, max_blocks", [(1, 8), (64, 256), (256, 2048)])
def test_gpu_unpack_rows_matches_ref(cuda_device, bs, max_blocks):
    rows = _rows(bs, max_blocks, bs, cuda_device)
    sampled = torch.randint(0, 151936, (64,), device=cuda_device)
    outs = _outs(bs, max_blocks, cuda_device)
    unpack_rows(rows, sampled, **KW, **outs)
    for (name, got), want in zip(outs.items(), unpack_rows_ref(rows, sampled, **KW)):
        assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("pdl", ["1", "0"])
def test_gpu_graph_replay_follows_new_rows_and_logits(cuda_device, monkeypatch, pdl):
    """unpack_rows then greedy_sample into the persistent ``sampled`` buffer, as the fused
    step does, captured once; each replay reads the ids the previous one wrote."""
    monkeypatch.setenv("GRAPHRT_PDL", pdl)
    bs, max_blocks, vocab = 32, 64, 32768
    rows = _rows(bs, max_blocks, 0, cuda_device)
    logits = _logits(bs, vocab, 0, cuda_device)
    sampled = torch.zeros(64, dtype=torch.int64, device=cuda_device)
    ids = torch.empty(bs, dtype=torch.int64, device=cuda_device)
    outs = _outs(bs, max_blocks, cuda_device)

    def step():
        unpack_rows(rows, sampled, **KW, **outs)
        greedy_sample(logits, out_ids=ids, out_sampled=sampled)

    step()                                                           # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(1, 5):
        rows.copy_(_rows(bs, max_blocks, seed, cuda_device))
        logits.copy_(_logits(bs, vocab, seed, cuda_device))
        if seed == 4:
            logits[3] = -INF                                         # an all -inf row: 0
            logits[5, 7] = logits[5, 9] = 1e4                        # a tie: 7
        sampled[bs:].fill_(-7)                                       # rows with src >= bs read it
        before = sampled.clone()
        want_unpacked = unpack_rows_ref(rows, before, **KW)
        for t in list(outs.values()) + [ids]:
            t.fill_(-3)
        graph.replay()
        torch.cuda.synchronize()
        for (name, got), want in zip(outs.items(), want_unpacked):
            assert torch.equal(got, want), (seed, name)
        want = torch.argmax(logits, dim=-1)
        assert torch.equal(ids, want) and torch.equal(sampled[:bs], want), seed
        assert bool((sampled[bs:] == -7).all())
        if seed == 4:
            assert ids[3].item() == 0 and ids[5].item() == 7
