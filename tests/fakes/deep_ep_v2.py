"""FAKE of DeepEP v2's documented ``ElasticBuffer`` and DeepEP V2.5's ``EPBuffer`` (CPU, in-process).

This is not DeepEP. It is a fake of the documented API, used because DeepEP v2/V2.5 cannot
load on our machines: v2 needs NCCL >= 2.29/2.30 (Gin) and a torch 2.13/2.14 ABI, V2.5 needs
NCCL >= 2.32.3 and CUDA 13.1; the H200 machines have NCCL 2.28.9 and torch 2.11. It follows
the docstrings of ``deep_ep/buffers/elastic.py`` (v2) and ``deep_ep/buffers/ep.py`` (V2.5):
the same call signatures and defaults, the same return tuples, and the expanded layout.

What it models, on CPU tensors:

* ``dispatch(..., do_expand=True)``: rows grouped by local expert; expert ``e`` starts at
  ``align(psum[e-1], expert_alignment)`` and ``psum[e]`` is that start plus its (unaligned)
  count, on the handle as an int32 tensor (``handle.psum_num_recv_tokens_per_expert``).
  ``do_cpu_sync=False`` allocates the documented worst case of rows; ``recv_topk_idx`` is
  None and ``recv_topk_weights`` is 1-D (one weight per row). Rows inside an expert arrive
  in a shuffled order (``shuffle_seed``; real arrival order is not deterministic either),
  and rows that hold no token read NaN (zero with ``do_zero_padding``).
* ``combine(x, handle)``: sums each token's rows (fp32, fixed top-k order) back on its
  source rank. Expanded layout takes no ``topk_weights`` (rows must be weighted already).
* Async: with ``async_with_compute_stream=True`` the outputs hold NaN until
  ``event.current_stream_wait()``; the combine reads its input only then (as late as the real
  kernels could). V2.5 ``defer_epilogue=True`` returns only an ``EventOverlap``: nothing is
  available until ``.wait()``, which runs the epilogue once and returns the results; a second
  ``.wait()`` returns None and redoes nothing (``EventOverlap.num_hook_runs``).
* Several ranks in one process: ``FakeWorld(R).group(r)`` per rank, each rank on its own
  thread (dispatch/combine are collectives, met with a barrier).
* ``buffer.calls``: every call's flags (``do_cpu_sync``, ``allocate_on_comm_stream``, ...) and
  its ``EventOverlap``, for tests to assert on.

Not modelled: fp8 dispatch, cached dispatch (``handle=``), the non-expanded layout, hybrid
(scale-out) mode, ``deterministic``, SM/QP counts, and real streams (CPU has none).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

NUM_MAX_TOPK = 32  # "there are lots of `kNumTopk <= 32` restrictions" (elastic buffer sizing)
_POISON_INT = -(2 ** 30)


def _expect(cond: bool, msg: str) -> None:
    if not cond:  # DeepEP asserts (Python asserts and EP_HOST_ASSERT); kept under python -O
        raise AssertionError(msg)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class FakeWorld:
    """``num_ranks`` in-process ranks; ``group(r)`` stands in for rank r's ProcessGroup."""

    def __init__(self, num_ranks: int = 1, timeout: float = 60.0):
        self.num_ranks = num_ranks
        self._barrier = threading.Barrier(num_ranks, timeout=timeout)
        self._posts: dict[str, list] = {}

    def group(self, rank: int) -> "FakeGroup":
        return FakeGroup(self, rank)

    def abort(self) -> None:
        """A rank failed: release the others from the barrier (they raise BrokenBarrierError)."""
        self._barrier.abort()

    def exchange(self, op: str, rank: int, payload: Any, fn: Callable[[list], Any]) -> Any:
        """Collective: each rank posts ``payload``; ``fn(all posts)`` runs once all have posted."""
        posts = self._posts.setdefault(op, [None] * self.num_ranks)
        posts[rank] = payload
        self._barrier.wait()
        try:
            return fn(list(posts))
        finally:
            self._barrier.wait()  # no rank posts the next round before every rank read this one


class FakeGroup:
    def __init__(self, world: FakeWorld, rank: int):
        self.world, self._rank = world, rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.world.num_ranks


class FakeEventHandle:
    """deep_ep ``EventHandle``: work still "on the comm stream" runs when a stream waits on it."""

    def __init__(self):
        self._pending: list[Callable[[], Any]] = []
        self.num_waits = 0

    @property
    def waited(self) -> bool:
        return self.num_waits > 0

    def current_stream_wait(self) -> None:
        self.num_waits += 1
        pending, self._pending = self._pending, []
        for fn in pending:
            fn()


class FakeEventOverlap:
    """deep_ep ``EventOverlap`` (utils/event.py): wait, then run the hook once and return its value."""

    def __init__(self, event: Optional[FakeEventHandle] = None, extra_tensors=None):
        self.event, self.extra_tensors = event, extra_tensors
        self.hook_after_wait: Optional[Callable[[], Any]] = None
        self.num_hook_runs = 0
        self._release_handle_by_call = False

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        _expect(self.event is not None, "EventOverlap has no event: the call was not "
                "async_with_compute_stream=True, so there is nothing to wait for")
        self.event.current_stream_wait()
        result = None
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            result = hook()
            self.num_hook_runs += 1
        if release_handle:
            self.event = None
        return result

    def wait(self) -> Any:
        return self.current_stream_wait()

    def register_hook_after_wait(self, hook: Callable[[], Any]) -> None:
        _expect(self.hook_after_wait is None, "A hook is already registered on this `EventOverlap`")
        self.hook_after_wait = hook

    def __call__(self, release_handle: bool = False) -> "FakeEventOverlap":
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


class FakeEPHandle:
    """``EPHandle``: the documented attributes. ``dst_buffer_slot_idx[t, k]`` is, in this fake,
    the row of (token t, choice k) in its destination rank's expanded layout (-1 = none)."""

    def __init__(self, **kw):
        self.token_metadata_at_forward = self.channel_linked_list = None
        self.__dict__.update(kw)


class _FakeBufferBase:
    is_v25 = False

    def __init__(self, group, num_bytes, num_max_tokens_per_rank, hidden, num_topk,
                 use_fp8_dispatch, explicitly_destroy, shuffle_seed):
        if group is None:
            group = FakeWorld(1).group(0)
        _expect(num_bytes is not None or (num_max_tokens_per_rank > 0 and hidden > 0),
                "buffer sizing needs num_bytes, or num_max_tokens_per_rank > 0 and hidden > 0")
        _expect(not use_fp8_dispatch, "fake: fp8 dispatch is not modelled")
        self.group, self.world = group, group.world
        self.rank_idx, self.num_ranks = group.rank(), group.size()
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = num_max_tokens_per_rank, hidden, num_topk
        self.explicitly_destroy, self.destroyed = explicitly_destroy, False
        self._gen = None if shuffle_seed is None else torch.Generator().manual_seed(shuffle_seed + self.rank_idx)
        self.calls: list[dict] = []

    def destroy(self) -> None:
        _expect(self.explicitly_destroy, "destroy() needs explicitly_destroy=True at construction")
        self.destroyed = True

    # ---- dispatch -------------------------------------------------------------------------
    def _dispatch(self, x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                  expert_alignment, previous_event, async_with_compute_stream,
                  allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync, do_expand,
                  do_zero_padding, defer_epilogue, extra):
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        num_max_tokens_per_rank = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        expert_alignment = expert_alignment or 1
        rec = dict(op="dispatch", async_with_compute_stream=async_with_compute_stream,
                   allocate_on_comm_stream=allocate_on_comm_stream, do_cpu_sync=do_cpu_sync,
                   do_expand=do_expand, do_handle_copy=do_handle_copy, defer_epilogue=defer_epilogue,
                   expert_alignment=expert_alignment, num_experts=num_experts,
                   num_max_tokens_per_rank=num_max_tokens_per_rank,
                   topk_weights_given=topk_weights is not None, event=None, **extra)
        self.calls.append(rec)
        _expect(not self.destroyed, "buffer was destroyed")
        _expect(handle is None, "fake: cached dispatch (handle=) is not modelled")
        _expect(not isinstance(x, tuple), "fake: fp8 dispatch is not modelled")
        _expect(do_expand, "fake: only the expanded layout (do_expand=True) is modelled")
        _expect(not do_zero_padding or do_expand, "do_zero_padding is only valid with do_expand")
        _expect(previous_event is None or allocate_on_comm_stream,
                "previous_event is set: allocate_on_comm_stream must also be True")
        _expect(not (do_cpu_sync and _capturing()), "do_cpu_sync=True while a CUDA stream captures")
        _expect(x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous(),
                f"x must be a contiguous bf16 [num_tokens, hidden]; got {x.dtype} {tuple(x.shape)}")
        num_tokens, hidden = x.shape
        _expect(hidden * x.element_size() % 16 == 0, "hidden bytes must be a multiple of 16 (int4)")
        _expect(num_tokens <= num_max_tokens_per_rank,
                f"num_tokens {num_tokens} > num_max_tokens_per_rank {num_max_tokens_per_rank}")
        _expect(num_max_tokens_per_rank <= self.num_max_tokens_per_rank and hidden <= self.hidden,
                "buffer too small for this call (check buffer size)")
        _expect(topk_idx is not None and topk_idx.dim() == 2 and topk_idx.shape[0] == num_tokens
                and topk_idx.dtype == torch.int64 and topk_idx.is_contiguous(),
                "topk_idx must be contiguous int64 [num_tokens, num_topk]")
        num_topk = topk_idx.shape[1]
        _expect(num_topk <= NUM_MAX_TOPK and (self.num_topk == 0 or num_topk <= self.num_topk),
                f"num_topk {num_topk} exceeds the buffer's {self.num_topk or NUM_MAX_TOPK}")
        if topk_weights is not None:
            _expect(tuple(topk_weights.shape) == (num_tokens, num_topk) and topk_weights.dtype
                    == torch.float32 and topk_weights.is_contiguous(),
                    "topk_weights must be contiguous fp32 [num_tokens, num_topk]")
        _expect(num_experts is not None and num_experts % self.num_ranks == 0,
                f"num_experts {num_experts} must be a multiple of num_ranks {self.num_ranks}")

        layout = self.world.exchange("dispatch", self.rank_idx, (x, topk_idx, topk_weights),
                                     lambda posts: self._receive(posts, num_experts, expert_alignment,
                                                                 num_max_tokens_per_rank, do_cpu_sync,
                                                                 do_zero_padding))
        slots = self.world.exchange("dispatch_slots", self.rank_idx, layout["placed"],
                                    lambda posts: self._my_slots(posts, num_tokens, num_topk,
                                                                 x.device))
        recv_x, recv_w = layout["recv_x"], layout["recv_w"]
        psum = torch.tensor(layout["psum"], dtype=torch.int32, device=x.device)
        h = FakeEPHandle(
            do_expand=True, num_experts=num_experts, expert_alignment=expert_alignment,
            num_max_tokens_per_rank=num_max_tokens_per_rank, num_sms=0,
            topk_idx=topk_idx.clone() if do_handle_copy else topk_idx,
            num_recv_tokens=layout["num_recv_tokens"], num_expanded_tokens=recv_x.shape[0],
            num_recv_tokens_per_expert_list=layout["aligned_counts"] if do_cpu_sync else [],
            psum_num_recv_tokens_per_scaleup_rank=layout["psum_rank"],
            psum_num_recv_tokens_per_expert=psum,
            num_unaligned_recv_tokens_per_expert=torch.tensor(layout["counts"], dtype=torch.int32,
                                                              device=x.device),
            recv_src_metadata=layout["src_metadata"], dst_buffer_slot_idx=slots,
            _owner=self, _topk_idx_version=topk_idx._version)
        if defer_epilogue:  # V2.5: nothing is returned until .wait() runs the copy epilogue
            ev = FakeEventOverlap(FakeEventHandle())
            ev.register_hook_after_wait(lambda: (recv_x, None, recv_w, h))
            rec["event"] = ev
            return ev
        if not async_with_compute_stream:
            ev = FakeEventOverlap(None)
            rec["event"] = ev
            return recv_x, None, recv_w, h, ev
        # async: what the comm stream writes is garbage until the current stream waits
        event, outs = FakeEventHandle(), []
        for t in (recv_x, recv_w, h.psum_num_recv_tokens_per_expert):
            if t is not None:
                shown = torch.full_like(t, float("nan") if t.is_floating_point() else _POISON_INT)
                event._pending.append(lambda s=shown, t=t: s.copy_(t))
            outs.append(shown if t is not None else None)
        h.psum_num_recv_tokens_per_expert = outs[2]
        ev = FakeEventOverlap(event)
        rec["event"] = ev
        return outs[0], None, outs[1], h, ev

    def _receive(self, posts, num_experts, align, max_tokens, do_cpu_sync, do_zero_padding):
        R, r = self.num_ranks, self.rank_idx
        E = num_experts // R
        hidden, num_topk = posts[r][0].shape[1], posts[r][1].shape[1]
        with_w = posts[r][2] is not None
        dev = posts[r][0].device  # DeepEP's outputs live where its inputs do
        per_expert = []
        for e in range(E):
            sel = []
            for src, (_, ids, _) in enumerate(posts):
                t, k = (ids == r * E + e).nonzero(as_tuple=True)
                sel += [(src, int(a), int(b)) for a, b in zip(t.tolist(), k.tolist())]
            if self._gen is not None and sel:
                sel = [sel[i] for i in torch.randperm(len(sel), generator=self._gen).tolist()]
            per_expert.append(sel)
        counts = [len(s) for s in per_expert]
        starts, psum, end = [], [], 0
        for c in counts:
            starts.append(_align(end, align))
            end = starts[-1] + c
            psum.append(end)
        if do_cpu_sync:
            rows = _align(end, align)
        else:  # the documented worst case, so shapes never depend on the routing
            rows = _align(R * max_tokens * min(num_topk, E) + (align - 1) * E, align)
        _expect(end <= rows, "internal: expanded rows overflow")
        recv_x = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device=dev)
        recv_w = torch.full((rows,), float("nan"), dtype=torch.float32, device=dev) if with_w else None
        if do_zero_padding:
            for e in range(E):
                recv_x[psum[e]:_align(psum[e], align)] = 0
                if with_w:
                    recv_w[psum[e]:_align(psum[e], align)] = 0
        placed = {}  # (src, t, k) -> row here
        for e, sel in enumerate(per_expert):
            for j, (src, t, k) in enumerate(sel):
                row = starts[e] + j
                recv_x[row] = posts[src][0][t]
                if with_w:
                    recv_w[row] = posts[src][2][t, k]
                placed[(src, t, k)] = row
        tokens = sorted({(s, t) for s, t, _ in placed})
        n_recv = len(tokens) if do_cpu_sync else R * max_tokens
        meta = torch.full((n_recv, num_topk + 2), -1, dtype=torch.int32, device=dev)
        for i, (s, t) in enumerate(tokens):
            meta[i, 0], meta[i, 1] = s * max_tokens + t, s
            for k in range(num_topk):
                meta[i, 2 + k] = placed.get((s, t, k), -1)
        per_rank = [sum(1 for s, _ in tokens if s == src) for src in range(R)]
        return dict(recv_x=recv_x, recv_w=recv_w, psum=psum, counts=counts, placed=placed,
                    aligned_counts=[_align(c, align) for c in counts], num_recv_tokens=n_recv,
                    psum_rank=torch.tensor(per_rank, dtype=torch.int32, device=dev).cumsum(
                        0, dtype=torch.int32),
                    src_metadata=meta)

    def _my_slots(self, posts, num_tokens, num_topk, device):
        slots = torch.full((num_tokens, num_topk), -1, dtype=torch.int32, device=device)
        for placed in posts:
            for (src, t, k), row in placed.items():
                if src == self.rank_idx:
                    slots[t, k] = row
        return slots

    # ---- combine --------------------------------------------------------------------------
    def _combine(self, x, handle, topk_weights, bias, previous_event, async_with_compute_stream,
                 allocate_on_comm_stream, defer_epilogue, extra):
        rec = dict(op="combine", async_with_compute_stream=async_with_compute_stream,
                   allocate_on_comm_stream=allocate_on_comm_stream, defer_epilogue=defer_epilogue,
                   topk_weights_given=topk_weights is not None, event=None, **extra)
        self.calls.append(rec)
        _expect(not self.destroyed, "buffer was destroyed")
        _expect(getattr(handle, "_owner", None) is self, "handle does not come from this buffer's dispatch")
        _expect(x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous(),
                f"x must be a contiguous bf16 [num_tokens, hidden]; got {x.dtype} {tuple(x.shape)}")
        _expect(x.shape[1] * x.element_size() % 16 == 0, "hidden bytes must be a multiple of 16")
        _expect(x.shape[0] == handle.num_expanded_tokens,
                f"fake: x must hold the dispatch's {handle.num_expanded_tokens} expanded rows; got {x.shape[0]}")
        _expect(not (handle.do_expand and topk_weights is not None),
                "expanded layout: combine takes no topk_weights (reduction should be done with SwiGLU)")
        _expect(previous_event is None or allocate_on_comm_stream,
                "previous_event is set: allocate_on_comm_stream must also be True")
        if self.is_v25:
            _expect(handle.topk_idx._version == handle._topk_idx_version,
                    "`topk_idx` must not be modified while the EP handle is in use")
        ids, slots = handle.topk_idx, handle.dst_buffer_slot_idx
        num_tokens, hidden = ids.shape[0], x.shape[1]
        E = handle.num_experts // self.num_ranks
        biases = [b for b in (bias if isinstance(bias, tuple) else (bias,)) if b is not None]
        for b in biases:
            _expect(tuple(b.shape) == (num_tokens, hidden) and b.dtype == x.dtype, "bad bias")

        def reduce(posts):
            acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
            for k in range(ids.shape[1]):  # fixed top-k order, fp32
                for d in range(self.num_ranks):
                    m = (slots[:, k] >= 0) & (ids[:, k] // E == d)
                    acc[m] += posts[d][slots[m, k].long()].float()
            for b in biases:
                acc += b.float()
            return acc.to(torch.bfloat16)

        def run():  # reads x now: the kernel may read it as late as the wait
            return self.world.exchange("combine", self.rank_idx, x, reduce)

        if defer_epilogue:
            ev = FakeEventOverlap(FakeEventHandle())
            ev.register_hook_after_wait(lambda: (run(), None))
            rec["event"] = ev
            return ev
        if not async_with_compute_stream:
            ev = FakeEventOverlap(None)
            rec["event"] = ev
            return run(), None, ev
        combined = torch.full((num_tokens, hidden), float("nan"), dtype=torch.bfloat16,
                              device=x.device)
        event = FakeEventHandle()
        event._pending.append(lambda: combined.copy_(run()))
        ev = FakeEventOverlap(event)
        rec["event"] = ev
        return combined, None, ev


class FakeElasticBuffer(_FakeBufferBase):
    """``deep_ep.ElasticBuffer`` (v2). ``shuffle_seed`` (fake only): None keeps source order."""

    def __init__(self, group=None, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0,
                 hidden=0, num_topk=0, use_fp8_dispatch=False, deterministic=False,
                 allow_hybrid_mode=True, allow_multiple_reduction=True,
                 prefer_overlap_with_compute=True, sl_idx=3, num_allocated_qps=0,
                 num_cpu_timeout_secs=300, num_gpu_timeout_secs=100, explicitly_destroy=False,
                 *, shuffle_seed: Optional[int] = 0):
        super().__init__(group, num_bytes, num_max_tokens_per_rank, hidden, num_topk,
                         use_fp8_dispatch, explicitly_destroy, shuffle_seed)

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None,
                 num_sms=0, num_qps=0, previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream=False, allocate_on_comm_stream=False, handle=None,
                 do_handle_copy=True, do_cpu_sync=None, do_expand=False, do_zero_padding=False,
                 use_tma_aligned_col_major_sf=False):
        return self._dispatch(x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                              expert_alignment, previous_event, async_with_compute_stream,
                              allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync,
                              do_expand, do_zero_padding, False, dict(num_sms=num_sms))

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0,
                previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream=False, allocate_on_comm_stream=False):
        return self._combine(x, handle, topk_weights, bias, previous_event, async_with_compute_stream,
                             allocate_on_comm_stream, False, dict(num_sms=num_sms))


class FakeEPBuffer(_FakeBufferBase):
    """``deep_ep.EPBuffer`` (V2.5): ``defer_epilogue=`` on dispatch/combine; ``do_handle_copy``
    must be False and the handle keeps ``topk_idx`` by reference (modifying it is an error)."""

    is_v25 = True

    def __init__(self, group=None, num_bytes=None, num_max_tokens_per_rank=0, hidden=0, num_topk=0,
                 use_fp8_dispatch=False, lb_allocation_plan_or_num_bytes=0, deterministic=False,
                 allow_hybrid_mode=True, allow_multiple_reduction=True,
                 prefer_overlap_with_compute=True, sl_idx=None, num_allocated_qps=0,
                 num_cpu_timeout_secs=300, num_gpu_timeout_secs=100, explicitly_destroy=False,
                 *, shuffle_seed: Optional[int] = 0):
        super().__init__(group, num_bytes, num_max_tokens_per_rank, hidden, num_topk,
                         use_fp8_dispatch, explicitly_destroy, shuffle_seed)

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None,
                 num_sms=0, num_qps=0, previous_event=None, async_with_compute_stream=False,
                 allocate_on_comm_stream=False, handle=None, do_handle_copy=False, do_cpu_sync=None,
                 do_expand=False, do_zero_padding=False, use_tma_aligned_col_major_sf=False,
                 defer_epilogue=False):
        _expect(not do_handle_copy, "`do_handle_copy` must be False; handle copying is no longer supported")
        _expect(not defer_epilogue or async_with_compute_stream,
                "defer_epilogue requires async_with_compute_stream=True")
        return self._dispatch(x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                              expert_alignment, previous_event, async_with_compute_stream,
                              allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync,
                              do_expand, do_zero_padding, defer_epilogue, dict(num_sms=num_sms))

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0,
                previous_event=None, async_with_compute_stream=False, allocate_on_comm_stream=False,
                defer_epilogue=False):
        _expect(not defer_epilogue or async_with_compute_stream,
                "defer_epilogue requires async_with_compute_stream=True")
        return self._combine(x, handle, topk_weights, bias, previous_event, async_with_compute_stream,
                             allocate_on_comm_stream, defer_epilogue, dict(num_sms=num_sms))


# Module-level names as in `deep_ep`, so this module can stand in for it in sys.modules.
ElasticBuffer, EPBuffer = FakeElasticBuffer, FakeEPBuffer
EventOverlap, EventHandle, EPHandle = FakeEventOverlap, FakeEventHandle, FakeEPHandle
