"""Validating your own decode step: a MoE routing + dispatch step, hazardous and fixed.

Both FUNCs build the same math (router -> top-k -> per-expert rows -> tiny SwiGLU experts ->
weighted combine) as a ``graphrt.StepSpec``; pure torch, so it runs on a CPU.

``make_hazardous_step`` has the two classic hazards of eager MoE code:

- ``num_live = n.item()``: the live count read on the host (a sync; the value is frozen);
- ``counts = torch.bincount(...).tolist()`` then ``torch.split(rows, counts)``: per-expert
  counts read on the host (a sync) and used as shapes (frozen at capture).

``make_fixed_step`` keeps everything on the device: padded rows get expert id -1, slots come
from a cumulative one-hot over a fixed ``[E]``, tokens go to a fixed-capacity masked layout
``recv [E, CAP, H]`` and come back with a gather: no host reads, no data-dependent shapes.

    $ graphrt validate examples/validate_step.py:make_hazardous_step --device cpu
    kind                  where                         op                     size  message
    host-sync             examples/validate_step.py:65  Tensor.item            1     reads a device value on the host: a sync, and the value is frozen into the graph. Keep it on the device (pass the tensor on)
    host-sync             examples/validate_step.py:71  torch.bincount         1     reads max(x) on the host to size its output (a sync on CUDA). Use torch.zeros(E).scatter_add_(0, x, ones) with a fixed E
    host-sync             examples/validate_step.py:71  Tensor.tolist          1     copies device data to a Python list: a sync, and anything built from it is baked into the graph. Keep counts/indices on the device
    data-dependent-shape  examples/validate_step.py:72  aten.split_with_sizes  1     same batch size, different data, different shapes (output shape [(0, 64), (1, 64), (0, 64), (1, 64), (0, 64), (0, 64), (0, 64), (0, 64)] vs [(0, 64), (0, 64), (1, 64), (0, 64), (0, 64), (1, 64), (0, 64), (0, 64)]); a graph freezes shapes at capture. Pad to a fixed bound (e.g. nonzero_static, a capacity) and carry the live count on the device
    examples/validate_step.py:make_hazardous_step on cpu, sizes 1,8,64: NOT graph-safe: 4 error finding(s)
    $ echo $?
    1
    $ graphrt validate examples/validate_step.py:make_fixed_step --device cpu
    no findings: the step is graph-safe at every size checked
    examples/validate_step.py:make_fixed_step on cpu, sizes 1,8,64: graph-safe

``--device cuda`` (measured on an H200) reports the same four findings and, for the fixed
step, also captures every size and replays it equal to eager. ``python
examples/validate_step.py`` checks that both steps agree (within 1e-5; exit 1 if not).
"""
import torch
import torch.nn.functional as F

import graphrt

H, FFN, E, K = 64, 32, 8, 2  # hidden, expert intermediate size, num_experts, num_topk
MAX_BS = 64
CAP = MAX_BS                 # rows per expert: enough for every token, so nothing drops


def _weights(device):
    g = torch.Generator().manual_seed(0)
    wg = torch.randn(E, H, generator=g) / H ** 0.5               # [E, H] router
    w13 = torch.randn(E, 2 * FFN, H, generator=g) / H ** 0.5     # [E, 2*FFN, H] gate+up
    w2 = torch.randn(E, H, FFN, generator=g) / FFN ** 0.5        # [E, H, FFN] down
    return wg.to(device), w13.to(device), w2.to(device)


def _swiglu(u):
    return F.silu(u[..., :FFN]) * u[..., FFN:]


def _spec(step, name):
    return graphrt.StepSpec(fn=step, inputs={"x": graphrt.Input((None, H), torch.float32)},
                            max_batch_size=MAX_BS, name=name, live_count="n")


def make_hazardous_step(device: torch.device) -> graphrt.StepSpec:
    """Eager-style MoE: host-side live count and per-expert counts. Not graph-safe."""
    wg, w13, w2 = _weights(device)

    def step(x, n):                                              # x [T, H], n [1] int32
        num_live = n.item()                                      # hazard: host read
        h = x[:num_live]                                         # [n, H]
        w, ids = torch.topk(torch.softmax(h @ wg.T, -1), K)      # [n, K], [n, K]
        w = w / w.sum(-1, keepdim=True)
        flat = ids.flatten()                                     # [n*K]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=E).tolist()      # hazard: host-side counts
        chunks = torch.split(h[order // K], counts)              # shapes follow the counts
        ys = torch.cat([_swiglu(c @ w13[e].T) @ w2[e].T for e, c in enumerate(chunks)])
        out = torch.zeros_like(x)
        out.index_add_(0, order // K, ys * w.flatten()[order, None])
        return out

    return _spec(step, "hazardous_moe_step")


def make_fixed_step(device: torch.device) -> graphrt.StepSpec:
    """The same MoE with a fixed-capacity masked layout and device-side counts. Graph-safe."""
    wg, w13, w2 = _weights(device)

    def step(x, n):                                              # x [T, H], n [1] int32
        t = x.shape[0]
        live = torch.arange(t, device=x.device) < n              # [T]
        w, ids = torch.topk(torch.softmax(x @ wg.T, -1), K)      # [T, K], [T, K]
        w = torch.where(live[:, None], w / w.sum(-1, keepdim=True), 0.0)
        ids = torch.where(live[:, None], ids, -1)                # padding: expert -1
        flat = ids.flatten()                                     # [T*K]
        valid, e = flat >= 0, flat.clamp(min=0)
        onehot = F.one_hot(e, num_classes=E) * valid[:, None]    # [T*K, E]
        pos = (torch.cumsum(onehot, 0) - onehot).gather(1, e[:, None]).squeeze(1)
        keep = valid & (pos < CAP)
        slot = torch.where(keep, e * CAP + pos, E * CAP)         # E*CAP: a trash row
        recv = x.new_zeros(E * CAP + 1, H).index_copy_(0, slot, x.repeat_interleave(K, dim=0))
        u = torch.bmm(recv[:-1].view(E, CAP, H), w13.transpose(1, 2))      # [E, CAP, 2*FFN]
        y = torch.bmm(_swiglu(u), w2.transpose(1, 2)).view(E * CAP, H)     # [E*CAP, H]
        y = torch.cat([y, y.new_zeros(1, H)])[slot].view(t, K, H)          # back per slot
        return (y * (w * keep.view(t, K))[..., None]).sum(1)               # [T, H]

    return _spec(step, "fixed_moe_step")


if __name__ == "__main__":
    dev = torch.device("cpu")
    bad, good = make_hazardous_step(dev), make_fixed_step(dev)
    x = torch.randn(MAX_BS, H)
    worst = 0.0
    for live in (1, 5, MAX_BS):
        n = torch.tensor([live], dtype=torch.int32)
        diff = (bad.fn(x=x, n=n)[:live] - good.fn(x=x, n=n)[:live]).abs().max().item()
        worst = max(worst, diff)
        print(f"live {live:3d}: max |hazardous - fixed| = {diff:.2e}")
    same = worst <= 1e-5  # the same math in another order (fp32)
    print("the two steps agree" if same else "the two steps DIFFER")
    raise SystemExit(0 if same else 1)
