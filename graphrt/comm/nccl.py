"""``NCCLComm``: expert parallelism over plain torch.distributed (NCCL) collectives.

Every rank all-gathers the tokens and routing of all ranks, runs its local experts on the
tokens routed to them (graphrt's EP=1 dispatch/combine kernels on the gathered batch, with
expert ids outside this rank mapped to -1), and a reduce-scatter sums each token's partial
outputs back to the rank that owns it. Collectives need the same shapes on every rank, so
the batch is made uniform: ``uniform_batch = True`` makes ``GraphRuntime`` agree on the
padded size across ranks before picking a graph (``graphrt.coordinator``).

Graph safety: ``dispatch``, ``combine``, ``combine_async`` and the receiver are capturable
(NCCL kernels are captured like any other; warm them up eagerly first, as the capture
manager does); ``__init__`` is host-only.
"""
from __future__ import annotations

import torch

from graphrt.comm.base import Dispatched, Receiver, check_count, ep_group, on_side_stream
from graphrt.comm.local import LocalComm
from graphrt.errors import InputError


class NCCLComm:
    """All-gather -> local experts -> reduce-scatter. Global expert ``e`` lives on rank
    ``e // num_local_experts``.

    Args:
        num_experts, hidden, num_topk: model dims.
        device: this rank's GPU.
        max_tokens: tokens per rank per step (the largest capturable padded batch).
        group: the process group (default WORLD, NCCL).

    Sizes that are not ints >= 1, or experts that do not split evenly over the ranks, are an
    ``InputError`` (``InputTypeError`` for a wrong type); so is a batch above ``max_tokens``.
    """

    uniform_batch = True

    def __init__(self, num_experts: int, hidden: int, num_topk: int, device, *,
                 max_tokens: int = 256, group=None, dtype=torch.bfloat16):
        import torch.distributed as dist
        for name, value in (("num_experts", num_experts), ("hidden", hidden), ("num_topk", num_topk),
                            ("max_tokens", max_tokens)):
            check_count("NCCLComm", name, value)   # before any collective: every rank alike
        self._dist = dist
        self.group, self.rank, self.num_ranks, self.num_local_experts = ep_group(
            group, num_experts, "NCCLComm", error=InputError)
        self.num_experts, self.hidden, self.num_topk = num_experts, hidden, num_topk
        self.device, self.max_tokens = torch.device(device), max_tokens
        R = self.num_ranks
        self.local = LocalComm(self.num_local_experts, hidden, num_topk, self.device,
                               max_tokens=R * max_tokens, dtype=dtype)
        self._stream = torch.cuda.Stream(self.device)
        self._first = self.rank * self.num_local_experts
        ws = self.local.ws
        ws.reserve("g_x", (R * max_tokens, hidden), dtype)
        ws.reserve("g_ids", (R * max_tokens, num_topk), torch.int64)
        ws.reserve("g_w", (R * max_tokens, num_topk), torch.float32)
        ws.reserve("partial", (R * max_tokens, hidden), dtype)
        # The local combine covers every gathered row (ids of other ranks' experts are -1 and
        # add nothing): a live count >= any R * bs, made once rather than filled every call.
        self._all_rows = torch.full((1,), R * max_tokens, dtype=torch.int32, device=self.device)

    def cap_for(self, bs: int) -> int:
        return self.local.cap_for(self.num_ranks * bs)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, n: torch.Tensor, *,
                 topk_weights: torch.Tensor | None = None) -> Dispatched:
        """x bf16 ``[bs, hidden]`` (bs equal on every rank), topk_ids int64 ``[bs, num_topk]``.
        Graph safety: capturable."""
        bs, R = x.shape[0], self.num_ranks
        if bs > self.max_tokens:
            raise InputError(f"NCCLComm.dispatch: {bs} tokens exceed max_tokens={self.max_tokens}; "
                             "build the comm with a larger max_tokens")
        ws = self.local.ws
        g_x = ws.view("g_x", (R * bs, self.hidden))
        g_ids = ws.view("g_ids", (R * bs, self.num_topk))
        self._dist.all_gather_into_tensor(g_x, x.contiguous(), group=self.group)
        self._dist.all_gather_into_tensor(g_ids, topk_ids.contiguous(), group=self.group)
        local_ids = g_ids - self._first  # an id of -1 (padding) stays negative
        local_ids.masked_fill_((local_ids < 0) | (local_ids >= self.num_local_experts), -1)
        d = self.local.dispatch(g_x, local_ids, n)
        from graphrt.kernels.dispatch import expected_m
        em = expected_m(bs, self.num_topk, self.num_local_experts, cap=d.recv_x.shape[1])
        return Dispatched(d.recv_x, d.masked_m, em, handle=(d, local_ids, bs))

    def combine(self, y, topk_ids, topk_weights, d: Dispatched, n, *, out):
        """Local weighted gather-reduce over the gathered batch, then reduce-scatter into out
        ``[bs, hidden]``. Graph safety: capturable."""
        local_d, local_ids, bs = d.handle
        self.local._current(local_d, "NCCLComm.combine")   # before any collective
        R, ws = self.num_ranks, self.local.ws
        g_w = ws.view("g_w", (R * bs, self.num_topk))
        self._dist.all_gather_into_tensor(g_w, topk_weights.contiguous(), group=self.group)
        partial = ws.view("partial", (R * bs, self.hidden))
        self.local.combine(y, local_ids, g_w, local_d, self._all_rows, out=partial)
        self._dist.reduce_scatter_tensor(out, partial, group=self.group)
        return out

    def combine_async(self, y, topk_ids, topk_weights, d: Dispatched, n, *, out) -> Receiver:
        """The combine and its reduce-scatter on a communication stream, joined by event.
        Graph safety: capturable."""
        self.local._current(d.handle[0], "NCCLComm.combine_async")
        return on_side_stream(self._stream,
                              lambda: self.combine(y, topk_ids, topk_weights, d, n, out=out),
                              out, keep=(y, topk_ids, topk_weights, d.handle, n))

    def end_step(self) -> None:
        """Nothing to check (host-only)."""
