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
