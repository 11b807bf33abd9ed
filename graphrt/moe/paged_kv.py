"""The paged KV cache's per-step metadata, as engines pass it (vLLM / SGLang style).

Per layer the model keeps ``k_cache``/``v_cache`` bf16 ``[kv_blocks, block_size,
num_kv_heads, head_dim]`` (``MoEConfig``). A step gets, per row (glossary: ``bs`` rows)::

    slot_mapping  int64 [bs]                      flat slot of the new token: block * block_size + offset
    block_table   int32 [bs, max_blocks_per_seq]  the row's blocks in order (unused entries: anything)
    seq_lens      int32 [bs]                      positions to attend over, the new token included

Padding is inert by sentinel: padded rows carry ``slot_mapping = scratch_slot``,
``block_table = scratch_block`` and ``seq_lens = 0`` (the kernels write nothing and
output zeros for rows ``>= n``; the sentinels keep every index in bounds for code that does
not look at ``n``, e.g. the naive peer, which writes its padded rows into the scratch block).

``step_inputs(cfg)`` declares them as ``graphrt.Input``s whose independent random draws are
in bounds (block ids below the scratch block, distinct slots, lengths in ``[1, max_ctx]``);
``example_inputs(cfg, bs, ...)`` draws a mutually consistent batch (distinct requests own
distinct blocks, ``positions = seq_lens - 1``, the slot of that position through the table).

Graph safety: host-only (declarations and example data, drawn on the CPU).
"""
from __future__ import annotations

import torch

from graphrt.errors import InputError
from graphrt.moe.config import MoEConfig
from graphrt.spec import Input


def step_inputs(cfg: MoEConfig) -> dict[str, Input]:
    """``{"positions", "slot_mapping", "block_table", "seq_lens"}`` declarations for ``cfg``."""
    return {
        "positions": Input((None,), torch.int32, high=cfg.max_ctx),
        "slot_mapping": Input((None,), torch.int64, high=cfg.scratch_slot, unique=True,
                              pad_value=cfg.scratch_slot),
        "block_table": Input((None, cfg.max_blocks_per_seq), torch.int32, high=cfg.scratch_block,
                             pad_value=cfg.scratch_block),
        "seq_lens": Input((None,), torch.int32, low=1, high=cfg.max_ctx + 1, pad_value=0),
    }


def slot_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 ``[bs]``: the flat slot of ``positions[b]`` through row b's ``block_table``.
    Graph safety: capturable (device gather, no sync)."""
    pos = positions.long()
    blk = block_table.long().gather(1, (pos // block_size)[:, None])[:, 0]
    return blk * block_size + pos % block_size


def example_inputs(cfg: MoEConfig, bs: int, device, generator: torch.Generator | None = None
                   ) -> dict[str, torch.Tensor]:
    """A consistent batch of ``bs`` requests: ``tokens`` int64 ``[bs]`` plus the metadata above.

    Each request draws ``seq_lens`` in ``[1, max_ctx]`` (fewer when the cache cannot give
    every row ``max_blocks_per_seq`` blocks) and owns ``ceil(seq_len / block_size)`` distinct
    blocks from a shuffle of the non-scratch blocks; unused table entries hold the scratch
    block. Drawn on the CPU with ``generator``, then moved to ``device``.
    """
    B, scratch = cfg.block_size, cfg.scratch_block
    per_row = min(cfg.max_blocks_per_seq, scratch // max(bs, 1))
    if per_row < 1:
        raise InputError(f"{cfg.name}: {bs} requests cannot each own a block: the KV cache has "
                         f"{scratch} blocks besides the scratch block")
    max_len = min(cfg.max_ctx, per_row * B)
    seq_lens = torch.randint(1, max_len + 1, (bs,), generator=generator, dtype=torch.int32)
    need = (seq_lens + B - 1) // B                                          # [bs] blocks owned
    table = torch.full((bs, cfg.max_blocks_per_seq), scratch, dtype=torch.int32)
    owned = torch.arange(cfg.max_blocks_per_seq)[None, :] < need[:, None]   # [bs, max_blocks]
    blocks = torch.randperm(scratch, generator=generator)[:int(need.sum())]
    table[owned] = blocks.to(torch.int32)                                   # row-major: row b's run
    positions = seq_lens - 1
    tokens = torch.randint(0, cfg.vocab_size, (bs,), generator=generator, dtype=torch.int64)
    out = {"tokens": tokens, "positions": positions, "slot_mapping": slot_of(table, positions, B),
           "block_table": table, "seq_lens": seq_lens}
    return {k: t.to(device) for k, t in out.items()}
