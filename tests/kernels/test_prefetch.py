"""The L2 prefetch reads every word of the weight exactly once (CPU interpreter + H200)."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.prefetch import BLOCK, l2_prefetch, l2_prefetch_ref


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape, dtype", [((64, 96), torch.bfloat16),       # < one chunk
                                          ((3 * BLOCK + 5,), torch.int32),   # ragged tail
                                          ((7, 1001), torch.bfloat16),       # odd bytes / 4
                                          ((5, 3), torch.uint8)])            # 15 bytes: uint8 words
@pytest.mark.parametrize("programs", [1, 3])
def test_each_program_xors_its_chunks(shape, dtype, programs):
    g = torch.Generator().manual_seed(sum(shape) + programs)
    w = torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int32)
    w = w.to(torch.uint8) if dtype == torch.uint8 else w.to(torch.int16).view(dtype) \
        if dtype == torch.bfloat16 else w
    w = w.to(_device())
    sink = torch.full((programs + 2,), 12345, dtype=torch.int32, device=w.device)
    assert l2_prefetch(w, sink=sink, programs=programs) is sink
    assert torch.equal(sink[:programs].cpu(), l2_prefetch_ref(w, programs))
    assert sink[programs:].tolist() == [12345, 12345], "the sink beyond the grid is untouched"


def test_a_flipped_word_changes_the_checksum():
    w = torch.zeros(2 * BLOCK + 7, dtype=torch.int32, device=_device())
    sink = torch.zeros(2, dtype=torch.int32, device=w.device)
    l2_prefetch(w, sink=sink, programs=2)
    assert sink.tolist() == [0, 0]
    w[-1] = 5                                   # the tail chunk (index 2) belongs to program 0
    l2_prefetch(w, sink=sink, programs=2)
    assert sink.tolist() == [5, 0]


def test_bad_arguments_say_what_was_expected():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sink.shape"):
        l2_prefetch(w, sink=torch.zeros(2, dtype=torch.int32), programs=4)
    with pytest.raises(ValueError, match="sink.dtype"):
        l2_prefetch(w, sink=torch.zeros(4, dtype=torch.int64), programs=4)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(w.t(), sink=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="programs"):
        l2_prefetch(w, sink=torch.zeros(4, dtype=torch.int32), programs=0)


def test_bulk_prefetch_chunks_and_refusals():
    """``bulk_chunks`` counts the 16-byte-rounded bytes in chunks; the bulk prefetch needs a
    CUDA device (inline PTX) and says so, and checks its sink and chunk."""
    from graphrt.kernels.prefetch import bulk_chunks, l2_prefetch_bulk
    assert bulk_chunks(torch.zeros(5120, 2048, dtype=torch.bfloat16)) == 640
    assert bulk_chunks(torch.zeros(7, dtype=torch.bfloat16), chunk=16) == 0  # 14 bytes: none
    assert bulk_chunks(torch.zeros(9, dtype=torch.bfloat16), chunk=16) == 1
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a CUDA device"):
        l2_prefetch_bulk(w, sink=torch.zeros(4, dtype=torch.int32))


def test_attention_prefetch_policy():
    """``Attention.prefetch``: "auto" prefetches at one row only where the bulk kernel runs
    (Hopper or newer: never on the CPU, which has no side stream); True / False at every size
    / none; an unknown kernel name is refused with what was expected."""
    from graphrt.moe import preset
    from graphrt.moe.layers import Attention
    cfg = preset("qwen3-moe-like", layers=1, experts=16, num_slots=8, max_ctx=64)
    attn = Attention(cfg, "cpu", torch.Generator().manual_seed(0))
    assert attn.prefetch == "auto" and attn.prefetch_join == "step"
    assert not attn.prefetches(1) and not attn.prefetches(16)
    attn.prefetch = True
    assert attn.prefetches(1) and attn.prefetches(16)
    attn.prefetch = False
    assert not attn.prefetches(1)
    attn.prefetch, attn.prefetch_kernel = True, "bulky"
    with pytest.raises(ValueError, match="'auto', 'load' or 'bulk'"):
        attn._bulk()
    attn.join_prefetch()  # nothing pending: a no-op
