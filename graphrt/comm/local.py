"""``LocalComm``: EP=1 (every expert on this GPU) with the combine on a communication stream.

dispatch: the fused Triton count/scan/scatter into the masked layout
(``graphrt.kernels.dispatch``); combine: the weighted gather-reduce
(``graphrt.kernels.combine``). ``combine_async`` forks a communication stream from the
current stream with an event, runs the combine there, records a done-event, and returns a
``Receiver`` whose call makes the current stream wait on it: the shared expert issued in
between overlaps the combine, and the whole fork/join is captured.

Graph safety: capturable (dispatch, combine, combine_async and the receiver).
"""
from __future__ import annotations

import torch

from graphrt.comm.base import Dispatched, Receiver, check_count, on_side_stream, round_up
from graphrt.errors import InputError


class LocalComm:
    """All ``num_experts`` experts local. ``cap`` rows per expert are ``bs`` rounded up to
    ``cap_align`` (a token picks an expert at most once, so nothing is ever dropped). The
    masked layout lives in static buffers sized for ``max_tokens`` (see ``moe.workspace``).

    ``num_experts``, ``hidden``, ``num_topk``, ``max_tokens`` and ``cap_align`` are ints >= 1
    (``InputTypeError`` / ``InputError`` otherwise, before anything is allocated)."""

    uniform_batch = False

    def __init__(self, num_experts: int, hidden: int, num_topk: int, device: torch.device | str,
                 *, max_tokens: int = 256, cap_align: int = 64,
                 comm_stream: "torch.cuda.Stream | None" = None, dtype=torch.bfloat16):
        from graphrt.moe.workspace import Workspace
        for name, value in (("num_experts", num_experts), ("hidden", hidden), ("num_topk", num_topk),
                            ("max_tokens", max_tokens), ("cap_align", cap_align)):
            check_count("LocalComm", name, value)
        self.rank, self.num_ranks = 0, 1
        self.num_experts = self.num_local_experts = num_experts
        self.hidden, self.num_topk, self.cap_align = hidden, num_topk, cap_align
        self.device, self.max_tokens = torch.device(device), max_tokens
        self._stream = comm_stream
        if self._stream is None and self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)
        cap = self.cap_for(max_tokens)
        self.ws = Workspace(self.device)       # static: one copy serves every size and layer
        self.ws.reserve("recv_x", (num_experts, cap, hidden), dtype)
        self.ws.reserve("src_idx", (num_experts, cap), torch.int32)
        self.ws.reserve("pos", (max_tokens, num_topk), torch.int32)
        self.masked_m = torch.empty(num_experts, dtype=torch.int32, device=self.device)
        self._gen = 0                          # dispatches made: a Dispatched's must be the last

    def cap_for(self, bs: int) -> int:
        return round_up(bs, self.cap_align)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, n: torch.Tensor, *,
                 topk_weights: torch.Tensor | None = None) -> Dispatched:
        """x ``[bs, hidden]`` bf16, topk_ids int64 ``[bs, num_topk]``. Padded rows carry id -1
        (the router's job), so they create no slots. Graph safety: capturable."""
        from graphrt.kernels.dispatch import dispatch_masked
        bs = x.shape[0]
        if bs > self.max_tokens:
            raise InputError(f"LocalComm.dispatch: {bs} tokens exceed max_tokens={self.max_tokens}; "
                             "build the comm with a larger max_tokens")
        outs, d = self._layout(bs, topk_ids.shape[1])
        dispatch_masked(x, topk_ids, **outs)
        return d

    def combine(self, y, topk_ids, topk_weights, d: Dispatched, n, *, out):
        """Weighted gather-reduce on the current stream. Graph safety: capturable."""
        from graphrt.kernels.combine import combine_masked
        self._current(d, "LocalComm.combine")
        return combine_masked(y, topk_ids, topk_weights, d.handle, n, out=out)

    def route_dispatch(self, x: torch.Tensor, logits: torch.Tensor, n: torch.Tensor,
                       num_topk: int, topk: dict) -> tuple:
        """The router's top-k of ``logits`` ``[bs, num_experts]`` and :meth:`dispatch` by it
        in one launch (``kernels.route_dispatch``; ``bs <= route_dispatch.MAX_ROWS``):
        ``(weights fp32, ids int64 [bs, num_topk], Dispatched)``, bitwise the top-k launch
        followed by :meth:`dispatch`. ``topk``: the router's ``topk_args()``. Graph safety:
        capturable."""
        from graphrt.kernels.route_dispatch import route_dispatch
        bs = x.shape[0]
        w = torch.empty(bs, num_topk, dtype=torch.float32, device=x.device)
        ids = torch.empty(bs, num_topk, dtype=torch.int64, device=x.device)
        outs, d = self._layout(bs, num_topk)
        route_dispatch(x, logits, n, num_topk, out_weights=w, out_ids=ids, **outs, **topk)
        return w, ids, d

    def _layout(self, bs: int, num_topk: int) -> tuple[dict, Dispatched]:
        """The static buffers a dispatch of ``bs`` rows writes, as ``dispatch_masked``'s
        ``out_*`` keywords, and the ``Dispatched`` that hands them on. Host-only."""
        from graphrt.kernels.dispatch import expected_m
        E, cap = self.num_local_experts, self.cap_for(bs)
        outs = dict(out_recv_x=self.ws.view("recv_x", (E, cap, self.hidden)),
                    out_masked_m=self.masked_m, out_src_idx=self.ws.view("src_idx", (E, cap)),
                    out_pos=self.ws.view("pos", (bs, num_topk)))
        em = expected_m(bs, num_topk, E, cap=cap)
        gen = None                              # under torch.compile: no host int to read,
        if not torch.compiler.is_compiling():   # which dynamo would guard on (a recompile
            self._gen += 1                      # after every eager step)
            gen = self._gen
        return outs, Dispatched(outs["out_recv_x"], self.masked_m, em, handle=outs["out_pos"],
                                gen=gen)

    def _current(self, d: Dispatched, what: str) -> None:
        """Refuse a combine of a dispatch a later one overwrote (its slots live in the
        static ``pos`` buffer: the combine would gather another batch's rows). Host-only."""
        if torch.compiler.is_compiling() or d.gen is None:
            return
        if d.gen != self._gen:
            raise InputError(f"{what}: {self._gen - d.gen} later dispatch(es) rewrote "
                             "this dispatch's layout (the comm's static buffers hold one at a "
                             "time); combine each dispatch before the next one")

    def combine_args(self, y, topk_ids, topk_weights, d: Dispatched, n) -> tuple:
        """The arguments of this comm's combine, ``kernels.combine.combine_masked(*args,
        out=)``, for a consumer that makes the combine itself (the norm after the MoE block:
        ``graphrt.moe.layers.PendingCombine``). ``d.handle`` (the slots) and ``y`` live in
        buffers that the next dispatch and expert GEMMs reuse: consume them before those.
        Host-only (launches nothing)."""
        self._current(d, "LocalComm.combine_args")
        return y, topk_ids, topk_weights, d.handle, n

    def combine_async(self, y, topk_ids, topk_weights, d: Dispatched, n, *, out) -> Receiver:
        """The combine on the communication stream, joined by the receiver's event wait.
        Graph safety: capturable."""
        self._current(d, "LocalComm.combine_async")
        if self._stream is None:  # CPU: nothing runs asynchronously
            self.combine(y, topk_ids, topk_weights, d, n, out=out)
            return Receiver(lambda: None, out)
        return on_side_stream(self._stream,
                              lambda: self.combine(y, topk_ids, topk_weights, d, n, out=out),
                              out, keep=(y, topk_ids, topk_weights, d.handle, n))

    def end_step(self) -> None:
        """Nothing to check for EP=1 (host-only)."""
