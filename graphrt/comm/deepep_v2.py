"""``DeepEPV2Comm``: expert parallelism over DeepEP v2's ``ElasticBuffer`` (expanded layout).

**Untested on hardware here.** DeepEP v2 needs NCCL >= 2.29/2.30 (Gin) and a torch 2.13/2.14
ABI; the H200 machines have NCCL 2.28.9 and torch 2.11, where it does not load. This backend
is written against the documented API (``deep_ep/buffers/elastic.py``) and tested on CPU
against a faithful fake of it (``tests/fakes/deep_ep_v2.py``). ``DeepEPV25Comm``
(``deepep_v25.py``) is the V2.5 ``EPBuffer`` variant.

Per MoE layer (E = num_local_experts, A = expert_alignment, rows = DeepEP's worst-case
expanded row count, fixed by ``max_tokens``)::

    dispatch: buffer.dispatch(x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank=max_tokens,
                              expert_alignment=A, do_cpu_sync=False, do_expand=True)
        -> recv_x [rows, hidden], recv_w fp32 [rows] (one weight per row),
           psum = handle.psum_num_recv_tokens_per_expert int32 [E] (device)
        start[e] = align(psum[e-1], A), start[0] = 0;  count[e] = psum[e] - start[e]
        masked recv_x[e, r] = recv_x[min(start[e] + r, rows - 1)]   [E, cap, hidden] (index_select)
        masked_m = min(count, cap)
    combine:  y [E, cap, hidden] -> y_exp[j] = y[e(j), j - start[e(j)]] * recv_w[j]   [rows, hidden]
              buffer.combine(y_exp, handle) sums each token's rows on its source rank -> out

All device-side with fixed shapes (no host sync). DeepEP's expanded-layout combine takes no
weights (rows are weighted before it), so ``dispatch`` needs ``topk_weights=`` (the
``EPComm`` protocol's optional argument, which the model always passes). ``combine_async`` runs the combine with
``async_with_compute_stream=True, allocate_on_comm_stream=True``; its ``Receiver`` waits on
DeepEP's event and copies the result into ``out``. ``sync_combine=True`` (or ``sync=True`` per
call) combines synchronously and returns an already-joined receiver (dual-batch overlap). One
async combine may be in flight per comm (it reads this comm's static expanded buffer); a
receiver whose join raised releases it (its result is lost; the error carries a note). ``out``
must be bf16 ``[bs, hidden]`` on the dispatch's device: a wrong one is an ``InputError`` before
anything is launched.

Glossary: bs, hidden, num_experts, num_local_experts, num_topk, num_ranks, cap.

Graph safety: capturable (dispatch, combine, combine_async, the receiver); construction is
host-only; ``do_cpu_sync=True`` (eager debugging) is refused while a stream captures.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from graphrt.comm.base import Dispatched, Receiver, check_count, check_out, round_up
from graphrt.errors import GraphrtError, InputError
from graphrt.moe.workspace import Workspace

MAX_TOPK = 32              # DeepEP v2: "lots of `kNumTopk <= 32` restrictions"
MAX_EXPERTS = 2048         # DeepEP v2.x workspace: at most 2048 experts in all ...
MAX_LOCAL_EXPERTS = 512    # ... and 512 per rank


class DeepEPUnavailable(GraphrtError, ImportError):
    """``deep_ep`` does not import here, or lacks the buffer class this backend needs."""


class DeepEPUsageError(InputError):
    """An argument breaks a documented DeepEP limit or this backend's contract. An
    ``InputError`` (so a ``ValueError``), like every other argument check of graphrt."""


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise DeepEPUsageError(msg)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def load_buffer_class(name: str, requirement: str):
    """``deep_ep.<name>``, imported on first use; clear errors when it cannot be. Host-only."""
    try:
        import deep_ep
    except Exception as e:  # noqa: BLE001 - ImportError, or NCCL/ABI load failures at import
        raise DeepEPUnavailable(f"cannot import deep_ep ({type(e).__name__}: {e}). This backend needs "
                                f"{requirement}. Install it, or use LocalComm / DeepEPLowLatencyComm "
                                "(DeepEP v1)") from e
    cls = getattr(deep_ep, name, None)
    if cls is None:
        version = getattr(deep_ep, "__version__", "unknown version")
        raise DeepEPUnavailable(f"the installed deep_ep ({version}) has no {name}: this backend "
                                f"needs {requirement}. DeepEP v1 builds (tokenspeed-deepep 1.2.x) "
                                "only have Buffer: use DeepEPLowLatencyComm with them")
    return cls


@dataclass
class _Expanded:
    """What the combine needs: DeepEP's handle, row weights, row -> masked slot (``src`` [rows])."""

    ep_handle: Any
    recv_w: torch.Tensor
    src: torch.Tensor
    rows: int
    cap: int
    bs: int        # rows the dispatch sent: the combine's out is [bs, hidden]


class DeepEPV2Comm:
    """Expert parallelism over ``deep_ep.ElasticBuffer``: ``num_experts / num_ranks`` experts on
    this rank, masked layout for the experts, DeepEP's expanded layout on the wire.

    Args:
        num_experts, hidden, num_topk: model dims (bf16 activations).
        device: this rank's device.
        max_tokens: most tokens this rank sends per step (DeepEP's ``num_max_tokens_per_rank``;
            every rank must use the same value).
        group: the EP ``torch.distributed`` ProcessGroup (default: WORLD) when ``buffer`` is None.
        buffer: an ``ElasticBuffer`` (or a test fake) to use instead of building one.
        sync_combine: ``combine_async`` combines synchronously (dual-batch overlap).
        expert_alignment: DeepEP's per-expert row alignment in the expanded layout.
        cap_align: the masked layout's ``cap`` is rounded up to it.
        num_sms: SMs for DeepEP's kernels (0: DeepEP picks).
        do_cpu_sync: exact-size outputs via a host sync (eager debugging only; never captured).
        buffer_kwargs: extra ``ElasticBuffer(...)`` arguments (``allow_hybrid_mode``, ...).

    ``cap`` rows per local expert: ``bs`` rounded up when ``num_ranks == 1``, else
    ``num_ranks * max_tokens`` rounded up (ranks replay different sizes: ``uniform_batch`` is
    False), so no row is ever dropped.
    """

    uniform_batch = False
    api_name = "ElasticBuffer"
    requirement = ("DeepEP v2 (deep_ep.ElasticBuffer): NCCL >= 2.29 with Gin and a torch 2.13/2.14 "
                   "build (the H200 machines have NCCL 2.28.9 and torch 2.11, where it does not load)")

    def __init__(self, num_experts: int, hidden: int, num_topk: int, device: torch.device | str, *,
                 max_tokens: int, group=None, buffer=None, sync_combine: bool = False,
                 expert_alignment: int = 1, cap_align: int = 64, num_sms: int = 0,
                 do_cpu_sync: bool = False, buffer_kwargs: dict | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        def need(ok: bool, msg: str) -> None:
            _need(ok, f"{type(self).__name__}: {msg}")
        who = type(self).__name__
        for name, value in (("num_experts", num_experts), ("hidden", hidden), ("num_topk", num_topk),
                            ("max_tokens", max_tokens), ("expert_alignment", expert_alignment),
                            ("cap_align", cap_align)):
            check_count(who, name, value)   # InputTypeError / InputError, before any buffer
        need(dtype == torch.bfloat16, f"DeepEP v2 dispatch/combine carry bf16; got dtype={dtype}")
        need(hidden > 0 and hidden * 2 % 16 == 0, "hidden * 2 bytes must be a positive multiple of "
             f"16 (DeepEP moves rows in 16-byte units); got hidden={hidden}")
        need(1 <= num_topk <= MAX_TOPK, f"num_topk must be in [1, {MAX_TOPK}]; got {num_topk}")
        self.hidden, self.num_topk, self.max_tokens = hidden, num_topk, max_tokens
        self.expert_alignment, self.cap_align, self.num_sms = expert_alignment, cap_align, num_sms
        self.sync_combine, self.do_cpu_sync = sync_combine, do_cpu_sync
        self.device, self.dtype = torch.device(device), dtype
        self.buffer = buffer if buffer is not None else self._build_buffer(group, buffer_kwargs or {})
        self.rank = int(getattr(self.buffer, "rank_idx", 0))
        self.num_ranks = R = int(getattr(self.buffer, "num_ranks", 1))
        need(num_experts % R == 0 and num_experts <= MAX_EXPERTS, "num_experts must be a multiple "
             f"of num_ranks ({R}) and <= {MAX_EXPERTS}; got {num_experts}")
        self.num_experts, self.num_local_experts = num_experts, num_experts // R
        need(self.num_local_experts <= MAX_LOCAL_EXPERTS, f"at most {MAX_LOCAL_EXPERTS} experts per "
             f"rank; got {self.num_local_experts} ({num_experts} over {R} ranks)")
        buf_max = int(getattr(self.buffer, "num_max_tokens_per_rank", 0) or 0)
        need(not buf_max or buf_max >= max_tokens, f"the buffer holds {buf_max} tokens per rank, "
             f"max_tokens is {max_tokens}; build it with num_max_tokens_per_rank >= {max_tokens}")
        E, A = self.num_local_experts, expert_alignment
        # DeepEP's worst-case expanded rows with do_cpu_sync=False (fixed by max_tokens).
        self.rows = round_up(R * max_tokens * min(num_topk, E) + (A - 1) * E, A)
        cap = self.cap_for(max_tokens)
        self.ws = Workspace(self.device)
        self.ws.reserve("recv", (E, cap, hidden), dtype)  # the masked recv_x
        self.ws.reserve("y_exp", (self.rows, hidden), dtype)  # the weighted expanded rows
        self._ar = torch.arange(max(cap, self.rows), device=self.device)
        self.pending_receiver: Receiver | None = None  # the last async combine's, until called

    def _build_buffer(self, group, kwargs: dict):
        cls = load_buffer_class(self.api_name, self.requirement)
        if group is None:
            import torch.distributed as dist
            if not dist.is_initialized():
                raise DeepEPUsageError(f"{type(self).__name__}: pass group= (the EP ProcessGroup) or "
                                       "buffer=; torch.distributed is not initialized")
            group = dist.group.WORLD
        # Inside CUDA graphs DeepEP must keep its tensors on the event, not record_stream them.
        os.environ.setdefault("EP_AVOID_RECORD_STREAM", "1")
        return cls(group, num_max_tokens_per_rank=self.max_tokens, hidden=self.hidden,
                   num_topk=self.num_topk, **kwargs)

    def cap_for(self, bs: int) -> int:
        """Rows per local expert in the masked layout for a padded batch of ``bs``. Host-only."""
        rows = bs if self.num_ranks == 1 else self.num_ranks * self.max_tokens
        return round_up(max(rows, 1), self.cap_align)

    # ---- the calls DeepEP makes (V2.5 overrides these three) -------------------------------
    def _dispatch_call(self, x, topk_ids, topk_weights):
        recv_x, _, recv_w, handle, _ = self.buffer.dispatch(
            x, topk_idx=topk_ids, topk_weights=topk_weights, num_experts=self.num_experts,
            num_max_tokens_per_rank=self.max_tokens, expert_alignment=self.expert_alignment,
            num_sms=self.num_sms, async_with_compute_stream=False, allocate_on_comm_stream=False,
            do_handle_copy=True, do_cpu_sync=self.do_cpu_sync, do_expand=True)
        return recv_x, recv_w, handle

    def _combine_sync(self, y_exp, handle) -> torch.Tensor:
        combined_x, _, _ = self.buffer.combine(y_exp, handle=handle, topk_weights=None,
                                               num_sms=self.num_sms, async_with_compute_stream=False,
                                               allocate_on_comm_stream=False)
        return combined_x

    def _combine_start(self, y_exp, handle, out) -> tuple[Callable[[], Any], tuple]:
        combined_x, _, event = self.buffer.combine(y_exp, handle=handle, topk_weights=None,
                                                   num_sms=self.num_sms, async_with_compute_stream=True,
                                                   allocate_on_comm_stream=True)

        def join():  # combined_x must not be read before the current stream waits on the event
            event.current_stream_wait()
            out.copy_(combined_x)
        return join, (combined_x, event)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, n: torch.Tensor, *,
                 topk_weights: torch.Tensor | None = None) -> Dispatched:
        """x ``[bs, hidden]`` bf16, topk_ids int64 ``[bs, num_topk]`` (-1 = none: padded rows
        send nothing), topk_weights fp32 ``[bs, num_topk]`` (required), n int32 ``[1]`` (unused:
        padding is marked by -1 ids). Returns recv_x ``[num_local_experts, cap, hidden]`` and
        masked_m int32 ``[num_local_experts]``. Graph safety: capturable."""
        from graphrt.kernels.dispatch import expected_m
        name, bs = type(self).__name__, x.shape[0]
        _need(bs <= self.max_tokens, f"{name}.dispatch: {bs} tokens exceed max_tokens={self.max_tokens} "
              "(DeepEP's num_max_tokens_per_rank); build the comm with a larger max_tokens")
        _need(topk_weights is not None, f"{name}.dispatch needs topk_weights= (fp32 [bs, num_topk]): "
              "in DeepEP's expanded layout rows are weighted before the combine, so the weights "
              "travel with the dispatch")
        _need(x.dtype == self.dtype and tuple(x.shape) == (bs, self.hidden) and tuple(topk_ids.shape)
              == tuple(topk_weights.shape) == (bs, self.num_topk),
              f"{name}.dispatch: expected x {self.dtype} [{bs}, {self.hidden}], topk_ids/topk_weights "
              f"[{bs}, {self.num_topk}]; got x {x.dtype} {tuple(x.shape)}, {tuple(topk_ids.shape)}, "
              f"{tuple(topk_weights.shape)}")
        _need(not (self.do_cpu_sync and _capturing()), f"{name}: do_cpu_sync=True waits on the host "
              "for DeepEP's counts and cannot run while a CUDA stream captures; use do_cpu_sync=False "
              "(the default) for captured steps")
        recv_x, recv_w, handle = self._dispatch_call(
            x.contiguous(), topk_ids.to(torch.int64).contiguous(),
            topk_weights.to(torch.float32).contiguous())
        E, H, A, cap = self.num_local_experts, self.hidden, self.expert_alignment, self.cap_for(bs)
        rows = recv_x.shape[0]
        if rows > self.rows:  # a DeepEP build whose worst case differs from the documented one
            _need(not _capturing(), f"{name}: DeepEP returned {rows} expanded rows, {self.rows} "
                  "reserved; run the step once eagerly before capture")
            self.rows = rows
            self.ws.reserve("y_exp", (rows, H), self.dtype)
            # every later size indexes it up to its own cap: the largest one's at most
            self._ar = torch.arange(max(self.cap_for(self.max_tokens), rows), device=self.device)
        psum = handle.psum_num_recv_tokens_per_expert.to(torch.int64)         # [E]
        prev = torch.cat([psum.new_zeros(1), psum[:-1]])
        start = (prev + (A - 1)) // A * A                                      # [E] first row
        count = psum - start                                                   # [E] live rows
        idx = (start[:, None] + self._ar[None, :cap]).clamp_(max=max(rows - 1, 0))  # [E, cap]
        recv = self.ws.view("recv", (E, cap, H))
        if rows:  # (0 only with do_cpu_sync=True when nothing reached this rank)
            torch.index_select(recv_x, 0, idx.view(-1), out=recv.view(E * cap, H))
        masked_m = count.clamp(0, cap).to(torch.int32)                         # [E]
        j = self._ar[:rows]                                                    # expanded row ids
        e_of = torch.bucketize(j, start[1:], right=True)                       # [rows] its expert
        src = e_of * cap + (j - start[e_of]).clamp_(0, cap - 1)                # [rows] masked slot
        em = expected_m(bs, self.num_topk, E, cap=cap)
        return Dispatched(recv, masked_m, em, handle=_Expanded(handle, recv_w, src, rows, cap, bs))

    def _expanded(self, y: torch.Tensor, d: Dispatched, out) -> tuple[torch.Tensor, _Expanded]:
        """Check the combine's arguments (metadata only) and fill the weighted expanded rows.
        Every check runs before anything is launched: a refused call changes nothing."""
        ex: _Expanded = d.handle
        E, H = self.num_local_experts, self.hidden
        prev = self.pending_receiver
        _need(prev is None or prev.called, f"{type(self).__name__}.combine: the previous "
              "combine_async's receiver was never called and its combine may still read this "
              "comm's expanded buffer, which this combine rewrites; call it first (it is "
              "comm.pending_receiver if you no longer hold it), or use sync_combine=True for "
              "dual-batch overlap")
        _need(tuple(y.shape) == (E, ex.cap, H) and y.dtype == self.dtype,
              f"{type(self).__name__}.combine: expected y {self.dtype} [{E}, {ex.cap}, {H}] (the "
              f"dispatch's masked layout); got {y.dtype} {tuple(y.shape)}")
        check_out(f"{type(self).__name__}.combine", out, (ex.bs, H), self.dtype, ex.recv_w.device)
        y_exp = self.ws.view("y_exp", (ex.rows, H))                            # [rows, hidden]
        torch.index_select(y.reshape(E * ex.cap, H), 0, ex.src, out=y_exp)
        y_exp.mul_(ex.recv_w.unsqueeze(1))     # weight each row (fp32 math, one bf16 rounding)
        return y_exp, ex

    def combine(self, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                d: Dispatched, n: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        """y ``[num_local_experts, cap, hidden]`` bf16 -> ``out`` ``[bs, hidden]`` bf16, written in
        place on the current stream (topk_ids/topk_weights unused: the weights came with the
        dispatch; ``bs`` is the dispatch's). Returns ``out``. A wrong ``out`` is an ``InputError``
        before anything starts. Graph safety: capturable."""
        y_exp, ex = self._expanded(y, d, out)
        out.copy_(self._combine_sync(y_exp, ex.ep_handle))
        return out

    def combine_async(self, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      d: Dispatched, n: torch.Tensor, *, out: torch.Tensor,
                      sync: bool | None = None) -> Receiver:
        """Start the combine on DeepEP's communication stream; the returned ``Receiver`` makes the
        current stream wait on its event and copies the result into ``out``. ``sync`` (default:
        the comm's ``sync_combine``) combines synchronously and returns an already-joined
        receiver. Graph safety: capturable."""
        if self.sync_combine if sync is None else sync:
            self.combine(y, topk_ids, topk_weights, d, n, out=out)
            return Receiver(lambda: None, out)
        y_exp, ex = self._expanded(y, d, out)
        join, keep = self._combine_start(y_exp, ex.ep_handle, out)
        # weak references: no comm <-> receiver cycle (the receiver holds out and DeepEP's tensors)
        comm_ref, recv_ref, name = weakref.ref(self), None, type(self).__name__

        def guarded_join():
            try:
                join()
            except Exception as exc:
                # A join that raised must not hold the comm forever (every later combine
                # would be refused as "never called"): this combine is abandoned, the next
                # one may rewrite the expanded buffer. Its error goes up with a note.
                comm = comm_ref()
                if comm is not None and comm.pending_receiver is recv_ref():
                    comm.pending_receiver = None
                exc.add_note(f"graphrt: {name}: this combine's receiver failed; its result is "
                             "lost and the comm no longer waits for it (the next combine may run)")
                raise
        recv = Receiver(guarded_join, out, keep=(y_exp, ex.ep_handle, ex.recv_w, *keep))
        recv_ref = weakref.ref(recv)
        self.pending_receiver = recv  # held: a receiver dropped uncalled still counts
        return recv

    def end_step(self) -> None:
        """Nothing to check per step (host-only): DeepEP v2 has no buffer parity, and a receiver
        left uncalled is reported by the capture's receiver audit."""
