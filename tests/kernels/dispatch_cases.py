"""Shared by the dispatch tests (CPU interpreter and GPU): output buffers full of sentinels
and the check of a dispatch's outputs against ``dispatch_masked_ref``."""
from __future__ import annotations

import torch

from graphrt.kernels.dispatch import dispatch_masked_ref

KEYS = ("out_recv_x", "out_masked_m", "out_src_idx", "out_pos")


def sentinel_outs(bs, k, num_experts, cap, hidden, dtype=torch.bfloat16, device="cpu") -> dict:
    """``dispatch_masked``'s output buffers full of sentinels: NaN rows, -7 ints (so unwritten
    entries show)."""
    return dict(
        out_recv_x=torch.full((num_experts, cap, hidden), float("nan"), dtype=dtype, device=device),
        out_masked_m=torch.full((num_experts,), -7, dtype=torch.int32, device=device),
        out_src_idx=torch.full((num_experts, cap), -7, dtype=torch.int32, device=device),
        out_pos=torch.full((bs, k), -7, dtype=torch.int32, device=device),
    )


def check_dispatch(x, ids, outs, cap) -> None:
    """``outs`` equal the torch reference where written and keep their sentinels elsewhere."""
    recv, masked_m, src, pos = (outs[k].cpu() for k in KEYS)
    r_recv, r_m, r_src, r_pos = dispatch_masked_ref(x.cpu(), ids.cpu(), recv.shape[0], cap)
    assert torch.equal(masked_m, r_m)
    assert torch.equal(pos, r_pos)
    live = torch.arange(cap)[None, :] < r_m[:, None]  # [E, cap]
    assert torch.equal(src[live], r_src[live])
    assert (src[~live] == -7).all(), "unfilled src_idx slots must not be written"
    assert torch.equal(recv[live], r_recv[live]), "live rows are exact copies"
    assert torch.isnan(recv[~live].float()).all(), "rows past masked_m must not be written"
