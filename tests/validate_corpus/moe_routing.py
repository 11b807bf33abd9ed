"""Validator corpus: MoE routing and dispatch (vLLM / SGLang / HF Mixtral patterns).

Every ``bad_*`` FUNC builds a step whose hazards are marked on their own line with a
trailing ``# expect: KIND[, KIND]``; every ``safe_*`` FUNC builds a step the validator must
pass with zero findings. ``tests/test_validate_corpus.py`` runs them all.
"""
import torch
import torch.nn.functional as F

import graphrt

H, E, K, CAP = 8, 4, 2, 8  # hidden, num_experts, num_topk, cap (rows per expert)


def _weights(device):
    g = torch.Generator().manual_seed(0)
    wg = torch.randn(E, H, generator=g).to(device)          # [E, H] router
    w1 = torch.randn(E, H, H, generator=g).to(device) / H    # [E, H, H] tiny experts
    return wg, w1


def _spec(fn, **extra):
    inputs = {"x": graphrt.Input((None, H), torch.float32), **extra}
    return graphrt.StepSpec(fn=fn, inputs=inputs, max_batch_size=8)


def _route(x, wg):
    w, ids = torch.topk(torch.softmax(x @ wg.T, dim=-1), K, dim=-1)  # [T, K], [T, K]
    return w / w.sum(-1, keepdim=True), ids


# -- hazardous ---------------------------------------------------------------------------------
def bad_align_block_size_counts_on_host(device):
    """vLLM's python moe_align_block_size: expert counts read on the host, then a split."""
    wg, w1 = _weights(device)

    def step(x):
        w, ids = _route(x, wg)
        flat = ids.flatten()                                                   # [T*K]
        order = flat.argsort(stable=True)
        xs = x[order // K]                                                     # [T*K, H]
        counts = torch.bincount(flat, minlength=E).tolist()  # expect: host-sync
        chunks = torch.split(xs, counts)  # expect: data-dependent-shape
        ys = torch.cat([c @ w1[e] for e, c in enumerate(chunks)])
        out = torch.zeros_like(x).index_add_(0, order // K, ys * w.flatten()[order, None])
        return out

    return _spec(step)


def bad_sentinel_any(device):
    """SGLang EP: skip work when every slot is the padding sentinel -1."""
    wg, w1 = _weights(device)

    def step(x, topk_ids):
        if (topk_ids == -1).any():  # expect: host-sync
            x = x * 0
        return x @ w1[0]

    return _spec(step, topk_ids=graphrt.Input((None, K), torch.int64, low=-1, high=E))


def bad_unique_active_experts(device):
    """Loop only over the experts that got tokens."""
    wg, w1 = _weights(device)

    def step(x):
        w, ids = _route(x, wg)
        out = torch.zeros_like(x)
        active = torch.unique(ids)  # expect: host-sync
        for e in active.tolist():  # expect: host-sync
            hit = (ids == e).to(x.dtype) * w                                   # [T, K]
            out += hit.sum(-1, keepdim=True) * (x @ w1[e])
        return out

    return _spec(step)


def bad_one_hot_where_loop(device):
    """HF Mixtral's expert loop with one_hot lacking num_classes and one-argument where."""
    wg, w1 = _weights(device)

    def step(x):
        w, ids = _route(x, wg)
        mask = F.one_hot(ids).permute(2, 1, 0)  # expect: host-sync
        out = torch.zeros_like(x)
        for e in range(mask.shape[0]):
            slot, tok = torch.where(mask[e])  # expect: host-sync
            out.index_add_(0, tok, (x[tok] @ w1[e]) * w[tok, slot, None])
        return out

    return _spec(step)


def bad_repeat_interleave_no_output_size(device):
    """Replicate each token once per live top-k slot (tensor repeats, no output_size)."""
    wg, w1 = _weights(device)

    def step(x, topk_ids):
        per_token = (topk_ids >= 0).sum(-1)                                   # [T]
        rep = x.repeat_interleave(per_token, dim=0)  # expect: host-sync
        return rep.sum(0, keepdim=True).expand_as(x) @ w1[0]

    return _spec(step, topk_ids=graphrt.Input((None, K), torch.int64, low=-1, high=E))


def bad_bool_mask_assignments(device):
    """Gather the (token, slot) pairs routed to a live expert with a boolean mask."""
    wg, w1 = _weights(device)

    def step(x, topk_ids):
        valid = topk_ids >= 0                                                  # [T, K]
        tok = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(topk_ids)
        live_tok = tok[valid]  # expect: host-sync
        y = torch.zeros_like(x).index_add_(0, live_tok, x[live_tok] @ w1[1])
        return y

    return _spec(step, topk_ids=graphrt.Input((None, K), torch.int64, low=-1, high=E))


def bad_item_renormalize(device):
    """`.item()` in routing: a routed-scaling factor read back to the host."""
    wg, w1 = _weights(device)

    def step(x):
        w, ids = _route(x, wg)
        scale = 1.0 / w.sum(-1).max().item()  # expect: host-sync
        return (x @ w1[0]) * scale

    return _spec(step)


def bad_expert_load_stats(device):
    """EPLB-style load statistics copied to the host and histc with its default range."""
    wg, w1 = _weights(device)
    history = []

    def step(x):
        w, ids = _route(x, wg)
        load = torch.histc(ids.float(), bins=E)  # expect: host-sync
        history.append(load.cpu())  # expect: host-sync
        return x @ w1[0]

    return _spec(step)


def bad_numpy_offsets(device):
    """Expert offsets computed with numpy from device counts."""
    import numpy as np
    wg, w1 = _weights(device)

    def step(x):
        w, ids = _route(x, wg)
        counts = torch.zeros(E, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
        offsets = np.cumsum(counts.cpu().numpy())  # expect: host-sync
        start = torch.from_numpy(offsets)  # expect: host-to-device-copy
        return x + start[-1].to(x.dtype)

    return _spec(step)


def bad_int_max_load(device):
    """Scale by the busiest expert's load, read with int() (the value is baked in)."""
    wg, w1 = _weights(device)

    def step(x):
        w, ids = _route(x, wg)
        counts = torch.zeros(E, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
        max_load = int(counts.max())  # expect: host-sync
        return x * min(max_load, CAP) / CAP

    return _spec(step)


# -- safe --------------------------------------------------------------------------------------
def safe_scatter_add_counts(device):
    """Counts and offsets on the device: scatter_add_ into a fixed [E], cumsum; padded rows
    (expert id -1) count nothing."""
    wg, w1 = _weights(device)

    def step(x, n):
        w, ids = _route(x, wg)
        live = torch.arange(x.shape[0], device=x.device) < n                  # [T]
        flat = torch.where(live[:, None], ids, -1).flatten()                   # [T*K]
        counts = torch.zeros(E, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, flat.clamp(min=0), (flat >= 0).long())          # [E]
        offsets = torch.cumsum(counts, 0) - counts                             # [E]
        return x + offsets[ids].sum(-1, keepdim=True).to(x.dtype)

    return graphrt.StepSpec(fn=step, inputs={"x": graphrt.Input((None, H), torch.float32)},
                            max_batch_size=8, live_count="n")


def safe_one_hot_dense(device):
    """Dense MoE: one_hot with num_classes, every expert on every token, weighted."""
    wg, w1 = _weights(device)

    def step(x):
        w, ids = _route(x, wg)
        gate = (F.one_hot(ids, num_classes=E) * w[..., None]).sum(1)           # [T, E]
        ys = torch.einsum("th,ehk->tek", x, w1)                                # [T, E, H]
        return (gate[..., None] * ys).sum(1)

    return _spec(step)


def safe_repeat_interleave_output_size(device):
    """Replicate tokens per slot with a fixed output size (x.shape[0] * K)."""
    wg, w1 = _weights(device)

    def step(x):
        w, ids = _route(x, wg)
        reps = torch.full((x.shape[0],), K, dtype=torch.long, device=x.device)
        xr = x.repeat_interleave(reps, dim=0, output_size=x.shape[0] * K)     # [T*K, H]
        xk = x.repeat_interleave(K, dim=0)                                    # int repeats
        ys = torch.bmm(xr.unsqueeze(1), w1[ids.flatten()]).squeeze(1) + xk   # [T*K, H]
        return (ys.view(-1, K, H) * w[..., None]).sum(1)

    return _spec(step)


def safe_masked_layout_dispatch(device):
    """Fixed-capacity masked layout: recv [E, CAP, H], masked_m [E]; overflow dropped."""
    wg, w1 = _weights(device)

    def step(x, n):
        w, ids = _route(x, wg)
        live = torch.arange(x.shape[0], device=x.device) < n                  # [T]
        ids = torch.where(live[:, None], ids, -1)                              # pad rows -> -1
        flat = ids.flatten()
        onehot = F.one_hot(flat.clamp(min=0), num_classes=E) * (flat >= 0)[:, None]
        pos = (torch.cumsum(onehot, 0) - onehot).gather(1, flat.clamp(min=0)[:, None]).squeeze(1)
        ok = (flat >= 0) & (pos < CAP)
        slot = torch.where(ok, flat.clamp(min=0) * CAP + pos, E * CAP)        # E*CAP: trash row
        recv = x.new_zeros(E * CAP + 1, H).index_copy_(0, slot, x.repeat_interleave(K, dim=0))
        y = torch.bmm(recv[:-1].view(E, CAP, H), w1).view(E * CAP, H)
        y = torch.cat([y, y.new_zeros(1, H)])[slot].view(-1, K, H)
        masked_m = onehot.sum(0).clamp(max=CAP)                                # [E]
        return (y * (w * ok.view(-1, K))[..., None]).sum(1), masked_m.repeat(x.shape[0], 1)

    return graphrt.StepSpec(fn=step, inputs={"x": graphrt.Input((None, H), torch.float32)},
                            max_batch_size=8, live_count="n")


def safe_sort_topk_routing(device):
    """Grouped top-k with bias (DeepSeek-style) and a stable sort of each row's experts."""
    wg, w1 = _weights(device)
    bias = torch.linspace(-0.1, 0.1, E, device=device)

    def step(x):
        scores = torch.sigmoid(x @ wg.T)                                      # [T, E]
        groups = (scores + bias).view(-1, 2, E // 2).topk(1, dim=-1).values.sum(-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(1, dim=-1).indices, 1.0)
        masked = (scores + bias).masked_fill(keep.repeat_interleave(E // 2, dim=1) == 0, float("-inf"))
        ids, perm = masked.topk(K, dim=-1).indices.sort(dim=-1, stable=True)
        w = scores.gather(1, ids)                                              # [T, K]
        return torch.einsum("tk,tkh->th", w, torch.einsum("th,tkhj->tkj", x, w1[ids]))

    return _spec(step)


def safe_histc_fixed_range(device):
    """histc with a fixed range does not read min/max on the host (padded rows: id -1, out
    of range, not counted)."""
    wg, w1 = _weights(device)

    def step(x, n):
        w, ids = _route(x, wg)
        live = torch.arange(x.shape[0], device=x.device) < n
        load = torch.histc(torch.where(live[:, None], ids, -1).float(), bins=E, min=0, max=E)
        return x + load[ids].sum(-1, keepdim=True)

    return graphrt.StepSpec(fn=step, inputs={"x": graphrt.Input((None, H), torch.float32)},
                            max_batch_size=8, live_count="n")


def safe_expert_load_counter_output(device):
    """Engine-style load recorder: a persistent per-expert counter updated in the graph
    (padded rows count nothing), returned whole beside the batch-major hidden state."""
    wg, w1 = _weights(device)
    load = torch.zeros(E, dtype=torch.long, device=device)                    # persistent [E]

    def step(x, n):
        w, ids = _route(x, wg)
        live = torch.arange(x.shape[0], device=x.device) < n                  # [T]
        flat = torch.where(live[:, None], ids, -1).flatten()                   # [T*K]
        load.scatter_add_(0, flat.clamp(min=0), (flat >= 0).long())            # [E], in place
        return {"hidden": x * 2, "expert_load": load.clone(), "overflow": (load > 1000).any()}

    return graphrt.StepSpec(fn=step, inputs={"x": graphrt.Input((None, H), torch.float32)},
                            max_batch_size=8, live_count="n", state=[load])
