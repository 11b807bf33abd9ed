"""Validator corpus: layers wrapped as ``torch.library`` custom ops (how vLLM and SGLang hand
attention and MoE to ``torch.compile``). The analysis runs a custom op's kernel with its modes
on, so a hazard inside the op's body is named at the body's line, on CPU stand-ins and on a
GPU alike; an op with no kernel for the tensors' device stays one op.

The ops are registered once per process (``_op``): ``graphrt validate`` may load this file
more than once, and the first registration's body has the same lines.
"""
import torch

import graphrt

H, BLOCK, PAGES = 8, 4, 16


def _op(name, fn, mutates_args=()):
    """Register ``graphrt_corpus::name`` on first use; the registered op afterwards."""
    ns = torch.ops.graphrt_corpus
    if hasattr(ns, name):
        return getattr(ns, name)
    return torch.library.custom_op(f"graphrt_corpus::{name}", fn, mutates_args=mutates_args)


def _spec(fn, **extra):
    inputs = {"x": graphrt.Input((None, H), torch.float32), **extra}
    return graphrt.StepSpec(fn=fn, inputs=inputs, max_batch_size=8)


def _seq_lens():
    return {"seq_lens": graphrt.Input((None,), torch.int32, low=1, high=BLOCK * 4)}


def bad_attention_op_reads_max_seq_len(device):
    """A paged-attention op whose body sizes its loop from the batch's longest sequence."""
    kv = torch.randn(PAGES * BLOCK, H, generator=torch.Generator().manual_seed(1)).to(device)

    def paged_attention(q: torch.Tensor, kv: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        longest = int(seq_lens.max().item())  # expect: host-sync
        scores = q @ kv[:longest].T  # expect: data-dependent-shape
        return torch.softmax(scores, -1) @ kv[:longest]

    attn = _op("paged_attention_bad", paged_attention)

    def step(x, seq_lens):
        return attn(x, kv, seq_lens)

    return _spec(step, **_seq_lens())


def bad_moe_op_branches_on_a_device_value(device):
    """A fused-MoE op whose body skips the shared expert when no token is routed to it."""
    w = torch.randn(H, H, generator=torch.Generator().manual_seed(2)).to(device) / H

    def fused_moe(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x @ w
        if (y > 0).any():  # expect: host-sync
            y = y + 1
        return y

    moe = _op("fused_moe_bad", fused_moe)

    def step(x):
        return moe(x, w)

    return _spec(step)


def bad_op_builds_its_table_from_a_list(device):
    """An op that builds its block table from a Python list on every call."""

    def gather_blocks(x: torch.Tensor) -> torch.Tensor:
        table = torch.tensor([0, 1, 2, 3], device=x.device)  # expect: host-to-device-copy
        return x[:, table]

    gather = _op("gather_blocks_bad", gather_blocks)

    def step(x):
        return gather(x)

    return _spec(step)


def safe_attention_op_masks_with_inf(device):
    """The sync-free paged attention: a fixed bound, positions past each row's length masked
    to -inf on the device."""
    kv = torch.randn(PAGES * BLOCK, H, generator=torch.Generator().manual_seed(3)).to(device)
    bound = BLOCK * 4

    def masked_attention(q: torch.Tensor, kv: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        scores = q @ kv[:bound].T                                          # [T, bound]
        pos = torch.arange(bound, device=q.device)
        scores = torch.where(pos[None, :] < seq_lens[:, None], scores, float("-inf"))
        return torch.softmax(scores, -1) @ kv[:bound]

    attn = _op("masked_attention", masked_attention)

    def step(x, seq_lens):
        return attn(x, kv, seq_lens)

    return _spec(step, **_seq_lens())


def safe_op_writes_its_cache(device):
    """An op that appends each row's K to a paged cache it declares as mutated; padded rows
    write the scratch slot past the live ones (slot 0 is a live request's)."""
    cache = torch.zeros(PAGES * BLOCK + 1, H, device=device)

    def append_kv(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        cache.index_copy_(0, slots, x)

    append = _op("append_kv", append_kv, mutates_args=("cache",))

    def step(x, slots):
        append(cache, x, slots)
        return cache[slots] * 2

    return _spec(step, slots=graphrt.Input((None,), torch.int64, high=PAGES * BLOCK, unique=True,
                                           pad_value=PAGES * BLOCK))
