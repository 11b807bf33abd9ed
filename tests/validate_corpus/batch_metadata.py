"""Validator corpus: per-step batch metadata (sequence lengths, block tables, positions,
live tokens) as vLLM / SGLang / gpt-fast attention backends build it.

``bad_*`` FUNCs mark each hazard with ``# expect: KIND``; ``safe_*`` FUNCs have none.
"""
import numpy as np
import torch

import graphrt

H, BLOCK, MAX_BLOCKS, NUM_BLOCKS, MAX_LEN = 8, 4, 4, 32, 16  # MAX_LEN = BLOCK * MAX_BLOCKS
EOS = 2


def _spec(fn, live_count=None, **extra):
    inputs = {"x": graphrt.Input((None, H), torch.float32),
              "seq_lens": graphrt.Input((None,), torch.int32, low=1, high=MAX_LEN, pad_value=1),
              **extra}
    return graphrt.StepSpec(fn=fn, inputs=inputs, max_batch_size=8, live_count=live_count)


def _cache(device):
    g = torch.Generator().manual_seed(1)
    return torch.randn(NUM_BLOCKS * BLOCK, H, generator=g).to(device)      # [slots, H] K=V cache


_TABLE = graphrt.Input((None, MAX_BLOCKS), torch.int32, high=NUM_BLOCKS)


# -- hazardous ---------------------------------------------------------------------------------
def bad_max_seq_len_item(device):
    """FlashAttention-style metadata: max_seqlen read on the host, then used to slice."""
    kv = _cache(device)

    def step(x, seq_lens, block_table):
        max_len = seq_lens.max().item()  # expect: host-sync
        pos = torch.arange(MAX_LEN, device=x.device)
        slots = block_table.long().repeat_interleave(BLOCK, dim=1) * BLOCK + pos % BLOCK
        k = kv[slots[:, :max_len]]  # expect: data-dependent-shape
        return torch.softmax(torch.einsum("th,tlh->tl", x, k), -1) @ kv[:k.shape[1]]

    return _spec(step, block_table=_TABLE)


def bad_host_lens_tensor(device):
    """cu_seqlens built from a host-side list of lengths inside the step."""
    host_lens = [3, 5, 7, 9, 11, 13, 15, 16]  # the engine's per-request lengths

    def step(x, seq_lens):
        lens = torch.tensor(host_lens[:x.shape[0]], dtype=torch.int32, device=x.device)  # expect: host-to-device-copy
        cu = torch.cumsum(lens, 0)
        return x + cu[-1].to(x.dtype)

    return _spec(step)


def bad_block_table_tolist(device):
    """Slot mapping built in Python from the block table (tolist), then copied back."""
    kv = _cache(device)

    def step(x, seq_lens, block_table):
        slots = []
        for row, n in zip(block_table.tolist(), seq_lens.tolist()):  # expect: host-sync
            slots.append(row[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK)
        slot = torch.tensor(slots, device=x.device)  # expect: host-to-device-copy
        return x + kv[slot]

    return _spec(step, block_table=_TABLE)


def bad_live_token_gather(device):
    """Gather live tokens (seq_len > 0) with a boolean mask, compute, scatter back."""

    def step(x, seq_lens):
        live = seq_lens > 0
        h = x[live]  # expect: host-sync
        out = torch.zeros_like(x)
        out[live] = h * 2  # expect: host-sync
        return out

    return _spec(step, seq_lens=graphrt.Input((None,), torch.int32, low=0, high=MAX_LEN))


def bad_finished_nonzero(device):
    """Find finished requests with nonzero and reset their lengths."""

    def step(x, seq_lens, next_tok):
        done = torch.nonzero(next_tok == EOS).squeeze(-1)  # expect: host-sync
        return seq_lens.index_fill(0, done, 0), x

    return _spec(step, next_tok=graphrt.Input((None,), torch.int64, high=4))


def bad_seq_lens_cpu(device):
    """Copy the sequence lengths to the host for a scheduler-side decision."""

    def step(x, seq_lens):
        lens_host = seq_lens.cpu()  # expect: host-sync
        return x * 2, lens_host

    return _spec(step)


def bad_range_live_count(device):
    """Loop over the live rows with range(n): n is a device tensor."""

    def step(x, seq_lens, n):
        rows = []
        for i in range(n):  # expect: host-sync
            rows.append(x[i] * seq_lens[i])
        return torch.stack(rows)

    return _spec(step, live_count="n")


def bad_numpy_slot_mapping(device):
    """Slot mapping computed with numpy inside the step, then uploaded."""

    def step(x, seq_lens):
        slots = np.arange(x.shape[0]) * BLOCK
        slot_t = torch.from_numpy(slots).to(x.device, x.dtype)  # expect: host-to-device-copy
        return x + slot_t[:, None]

    return _spec(step)


def bad_new_tensor_positions(device):
    """Positions written out as a Python list and uploaded with new_tensor."""

    def step(x, seq_lens):
        pos = x.new_tensor([float(i) for i in range(x.shape[0])])  # expect: host-to-device-copy
        return x + pos[:, None]

    return _spec(step)


def bad_to_cpu_string(device):
    """Non-blocking copy of sampled lengths to the host (still a sync point in a graph)."""

    def step(x, seq_lens):
        host = seq_lens.to("cpu", non_blocking=True)  # expect: host-sync
        return x + 1, host

    return _spec(step)


# -- safe --------------------------------------------------------------------------------------
def safe_cumsum_positions(device):
    """Positions and cu_seqlens on the device (cumsum), new lengths = lens + 1."""

    def step(x, seq_lens):
        cu = torch.cumsum(seq_lens, 0, dtype=torch.int32)                     # [T]
        start = cu - seq_lens
        pos = (seq_lens - 1).clamp(min=0).long()
        return x + (start + pos).to(x.dtype)[:, None], seq_lens + 1

    return _spec(step)


def safe_build_time_tensors(device):
    """Host data turned into tensors in FUNC, once, and closed over by the step."""
    host_lens = [3, 5, 7, 9, 11, 13, 15, 16]
    lens = torch.tensor(host_lens, dtype=torch.int32, device=device)     # build time: fine
    scale = float(torch.tensor(host_lens).float().mean().item())         # build time: fine
    counts = torch.bincount(torch.tensor(host_lens) % 4).tolist()         # build time: fine

    def step(x, seq_lens):
        extra = lens[:x.shape[0]]
        return x * scale + (seq_lens + extra).to(x.dtype)[:, None] + counts[0]

    return _spec(step)


def safe_live_mask_where(device):
    """Padded rows made inert with the live count: arange < n, where, masked_fill."""

    def step(x, seq_lens, n):
        live = torch.arange(x.shape[0], device=x.device) < n                  # [T]
        h = torch.where(live[:, None], x, 0.0)
        lens = seq_lens.masked_fill(~live, 0)
        return h * 2, lens

    return _spec(step, live_count="n")


def safe_nonzero_static_finished(device):
    """Finished live requests as a fixed-size index list padded with -1."""

    def step(x, seq_lens, next_tok, n):
        live = torch.arange(x.shape[0], device=x.device) < n
        done = torch.nonzero_static((next_tok == EOS) & live, size=x.shape[0], fill_value=-1)
        return x, done.squeeze(-1)                                             # [T]

    return _spec(step, live_count="n", next_tok=graphrt.Input((None,), torch.int64, high=4))


def safe_block_table_gather(device):
    """Slot mapping from the block table with gather: no host round trip."""
    kv = _cache(device)

    def step(x, seq_lens, block_table):
        pos = (seq_lens - 1).long()                                           # [T]
        block = block_table.long().gather(1, (pos // BLOCK)[:, None]).squeeze(1)
        slot = block * BLOCK + pos % BLOCK                                    # [T]
        return x + kv.index_select(0, slot)

    return _spec(step, block_table=_TABLE)


def safe_static_cache_attention(device):
    """gpt-fast-style decode attention over the whole static cache with a length mask."""
    kv = _cache(device)

    def step(x, seq_lens, block_table):
        pos = torch.arange(MAX_LEN, device=x.device)                         # [L]
        slots = block_table.long().repeat_interleave(BLOCK, dim=1) * BLOCK + pos % BLOCK
        k = kv[slots]                                                         # [T, L, H]
        s = torch.einsum("th,tlh->tl", x, k) / H ** 0.5
        s = s.masked_fill(pos[None, :] >= seq_lens[:, None], float("-inf"))
        return torch.einsum("tl,tlh->th", torch.softmax(s, -1), k)

    return _spec(step, block_table=_TABLE)


def safe_shape_arithmetic(device):
    """Buffers sized from shapes (x.shape[0] * k) and views."""

    def step(x, seq_lens):
        t = x.shape[0]
        buf = x.new_zeros(t * 2, H)
        buf[:t] = x
        buf[t:] = x * 2
        return buf.view(2, t, H).sum(0), seq_lens.view(x.size(0), -1)

    return _spec(step)


def safe_to_own_device(device):
    """`.to(device)` / `.to(x.device)` of tensors already there is not a host copy."""
    bias = torch.ones(H, device=device)                                  # already there

    def step(x, seq_lens):
        lens = seq_lens.to(x.device, torch.float32)
        return x + lens[:, None] + bias.to(device)

    return _spec(step)


def safe_query_start_loc_offsets(device):
    """vLLM-style ``query_start_loc`` ([bs + 1] offsets) and a fixed-size device table: per
    request token counts read on the device; padding continues the last offset."""
    scale = torch.linspace(0.5, 1.5, H).to(device)                            # [H]

    def step(x, seq_lens, query_start_loc, head_scale):
        q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(x.dtype)     # [bs]
        return x * head_scale * q_lens[:, None] + seq_lens[:, None].to(x.dtype) + scale

    return _spec(step, query_start_loc=graphrt.Input((None,), torch.int32, low=1, high=2,
                                                     offsets=True),
                 head_scale=graphrt.Input((H,), torch.float32))
