"""``DeepEPV25Comm``: expert parallelism over DeepEP V2.5's ``EPBuffer`` with deferred epilogues.

**Untested on hardware here.** DeepEP V2.5 needs NCCL >= 2.32.3 and CUDA 13.1; it does not
load on the H200 machines (NCCL 2.28.9, torch 2.11). Written against the documented API
(``deep_ep/buffers/ep.py``) and tested on CPU against a faithful fake of it
(``tests/fakes/deep_ep_v2.py``).

Same layout mapping as ``DeepEPV2Comm`` (``deepep_v2.py``); only the calls differ. V2.5's
``dispatch``/``combine`` take ``defer_epilogue=True`` (with ``async_with_compute_stream=True``):
the call launches the communication kernel and returns only an ``EventOverlap``; its
``.wait()`` makes the current stream wait, runs the copy/reduce epilogue *on the current
stream* and returns the results (the first wait produces them; a second returns None).

* dispatch: ``defer_epilogue=True``, ``do_cpu_sync=False``, ``do_handle_copy=False`` (V2.5 keeps
  ``topk_idx`` by reference; the router's ids are not touched before the combine), then
  ``.wait()`` at once: the experts need the rows now, and the epilogue lands on the compute
  stream inside the captured graph.
* combine_async: ``defer_epilogue=True, allocate_on_comm_stream=True``; the receiver calls
  ``.wait()`` (the epilogue runs where the step joins, after the shared expert) and copies
  ``combined_x`` into ``out``.
* combine: synchronous (no deferral), copied into ``out`` in place.

Glossary: bs, hidden, num_experts, num_local_experts, num_topk, num_ranks, cap.

Graph safety: capturable (dispatch, combine, combine_async, the receiver); construction is
host-only.
"""
from __future__ import annotations

from typing import Any, Callable

from graphrt.comm.deepep_v2 import DeepEPUnavailable, DeepEPUsageError, DeepEPV2Comm

__all__ = ["DeepEPUnavailable", "DeepEPUsageError", "DeepEPV25Comm"]


class DeepEPV25Comm(DeepEPV2Comm):
    """``DeepEPV2Comm`` over ``deep_ep.EPBuffer`` (V2.5); same arguments (``buffer_kwargs`` go to
    ``EPBuffer(...)``)."""

    api_name = "EPBuffer"
    requirement = ("DeepEP V2.5 (deep_ep.EPBuffer): NCCL >= 2.32.3 and CUDA 13.1 (the H200 machines "
                   "have NCCL 2.28.9 and torch 2.11, where it does not load)")

    def _dispatch_call(self, x, topk_ids, topk_weights):
        event = self.buffer.dispatch(
            x, topk_idx=topk_ids, topk_weights=topk_weights, num_experts=self.num_experts,
            num_max_tokens_per_rank=self.max_tokens, expert_alignment=self.expert_alignment,
            num_sms=self.num_sms, async_with_compute_stream=True, allocate_on_comm_stream=False,
            do_handle_copy=False, do_cpu_sync=self.do_cpu_sync, do_expand=True, defer_epilogue=True)
        result = event.wait()  # runs the copy epilogue on the current stream; keep the result
        if result is None:
            raise DeepEPUsageError("EPBuffer.dispatch(defer_epilogue=True): the event's first wait "
                                   "returned None (was it waited before?)")
        recv_x, _, recv_w, handle = result
        return recv_x, recv_w, handle

    def _combine_sync(self, y_exp, handle):
        combined_x, _, _ = self.buffer.combine(y_exp, handle=handle, topk_weights=None,
                                               num_sms=self.num_sms, async_with_compute_stream=False,
                                               allocate_on_comm_stream=False, defer_epilogue=False)
        return combined_x

    def _combine_start(self, y_exp, handle, out) -> tuple[Callable[[], Any], tuple]:
        event = self.buffer.combine(y_exp, handle=handle, topk_weights=None, num_sms=self.num_sms,
                                    async_with_compute_stream=True, allocate_on_comm_stream=True,
                                    defer_epilogue=True)

        def join():  # the first wait runs the reduce epilogue here and returns the result
            result = event.wait()
            if result is None:
                raise DeepEPUsageError("EPBuffer.combine(defer_epilogue=True): the event was already "
                                       "waited elsewhere; only the receiver may wait on it")
            out.copy_(result[0])
        return join, (event,)
