"""Shared helpers of the paged-attention kernel tests (test_attention.py, test_attention_gpu.py):
random paged caches, shuffled block tables, slots through a table, a NaN-poisoned launch and
the output check."""
from __future__ import annotations

import torch

from graphrt.kernels.attention import attention_semaphore, attention_workspace, decode_attention


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def i32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def paged_cache(num_blocks, block_size, num_kv_heads, head_dim, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=g, device=device).to(torch.bfloat16),
            torch.randn(shape, generator=g, device=device).to(torch.bfloat16))


def randn_bf16(*shape, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device).to(torch.bfloat16)


def block_table_for(seq_lens, block_size, max_blocks, num_blocks, seed=0):
    """int32 [bs, max_blocks]: each row owns ceil(seq_len / block_size) distinct blocks drawn
    from a shuffle of 0..num_blocks-2 (the last block is scratch); unused entries = scratch."""
    scratch = num_blocks - 1
    perm = torch.randperm(scratch, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(seq_lens), max_blocks), scratch, dtype=torch.int32)
    for b, L in enumerate(seq_lens):
        need = min(-(-max(L, 0) // block_size), max_blocks)
        table[b, :need] = torch.tensor(perm[:need], dtype=torch.int32)
        perm = perm[need:]
    return table


def slots_of(block_table, positions, block_size):
    """int64 [bs]: the flat slot of ``positions[b]`` through row b's block table."""
    pos = positions.long()
    blk = block_table.long().gather(1, (pos // block_size)[:, None])[:, 0]
    return blk * block_size + pos % block_size


def run_attention(q, k_cache, v_cache, block_table, seq_lens, n, split_size, sm_scale=None,
                  variant="split", semaphore=None):
    """Launch with NaN-poisoned out and workspaces; returns out. With ``variant`` other than
    ``"split"`` the launch runs twice (poisoned again in between) on one semaphore: both outputs
    must be bitwise equal and the semaphore all zero after each (it resets itself)."""
    bs, num_heads, head_dim = q.shape
    max_ctx = block_table.shape[1] * k_cache.shape[1]
    wo, wl = attention_workspace(bs, num_heads, head_dim, max_ctx, q.device, split_size=split_size)
    if semaphore is None:
        semaphore = attention_semaphore(bs, k_cache.shape[2], q.device)
    outs = []
    for _ in range(1 if variant == "split" else 2):
        wo.fill_(float("nan"))
        wl.fill_(float("nan"))
        out = torch.full_like(q, float("nan"))
        res = decode_attention(q, k_cache, v_cache, block_table, seq_lens, n, out=out,
                               workspace_o=wo, workspace_lse=wl, sm_scale=sm_scale,
                               semaphore=semaphore, variant=variant)
        assert res is out
        assert not semaphore.any(), f"semaphore not reset: {semaphore.tolist()}"
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), "a repeated launch changed the output"
    return outs[0]


def check_attention(out, ref, n_live, tol=1e-2):
    assert not torch.isnan(out.float()).any(), "NaN in out (unwritten row or stale workspace read)"
    assert (out[n_live:] == 0).all(), "padded rows must be zeros"
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.3e}"


def paged_batch(seq_lens, n_live, block_size, max_blocks, seed=0, device="cpu"):
    """A decode step of ``len(seq_lens)`` rows, ``n_live`` live: block table, int64 slots and
    the cache size. Live rows own distinct shuffled blocks; a live row's slot is its position
    ``seq_len - 1``, or a block of its own outside the table when ``seq_len`` is ``<= 0`` or
    past the reach. Padded rows carry the scratch block in their table; their slots aim at
    the scratch block and at a live row's context (both must stay unwritten)."""
    bs = len(seq_lens)
    need = [min(-(-max(L, 0) // block_size), max_blocks) for L in seq_lens[:n_live]]
    extra = [b for b, L in enumerate(seq_lens[:n_live]) if L <= 0 or L > max_blocks * block_size]
    num_blocks = sum(need) + len(extra) + 2 + 1  # two spare, the scratch (last)
    scratch = num_blocks - 1
    perm = torch.randperm(scratch, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((bs, max_blocks), scratch, dtype=torch.int32)
    for b, k in enumerate(need):
        table[b, :k] = torch.tensor(perm[:k], dtype=torch.int32)
        perm = perm[k:]
    pos = torch.tensor([max(L, 1) - 1 for L in seq_lens]).clamp(max=max_blocks * block_size - 1)
    slots = slots_of(table, pos, block_size)
    for b in extra:                                   # an own block no table holds
        slots[b] = perm.pop() * block_size + 3
    slots[n_live:] = scratch * block_size             # padding: the scratch slot ...
    if bs - n_live >= 2:  # ... or position 0 of a live row (row 1's: not its new token)
        slots[n_live + 1] = slots_of(table[min(1, n_live - 1)][None], i32([0]), block_size)[0]
    return table.to(device), slots.to(device), num_blocks
