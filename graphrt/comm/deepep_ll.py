"""``DeepEPLowLatencyComm``: expert parallelism over DeepEP v1 low-latency kernels.

Wraps ``deep_ep.Buffer`` in low-latency mode (the ``tokenspeed-deepep`` wheel named in the
README). Dispatch lands tokens straight in the masked layout DeepGEMM consumes
(``recv_x [num_local_experts, num_ranks * max_tokens, hidden]``, ``masked_m`` = DeepEP's
``recv_count``), in bf16 or fp8 (e4m3 with fp32 per-128-channel scales, column-major as
DeepGEMM's masked fp8 GEMM wants them). ``combine_async`` has both of DeepEP's overlap forms:

- ``mode="hook"``: ``return_recv_hook=True`` issues the send now; the receiver runs the
  receive kernel (the hook) on the current stream after the shared expert.
- ``mode="event"``: ``async_finish=True`` runs the combine on DeepEP's communication stream;
  the receiver does ``EventOverlap.current_stream_wait()`` and holds ``extra_tensors``.

DeepEP's rules are enforced with errors instead of hangs or corruption: supported hidden
sizes and top-k, tokens per rank <= ``max_tokens`` (<= 511 with the default QP depth), an
even number of low-latency calls per step (the buffer parity flips on every call, so a
captured graph must hold an even number of them: ``end_step`` checks), and each combine
must follow its own dispatch with no low-latency call in between (DeepEP keeps two buffers:
at most two low-latency results alive).

Graph safety: ``dispatch``, ``combine``, ``combine_async`` and the receivers are
capturable; ``__init__`` is host-only (collective setup on every rank).
"""
from __future__ import annotations

import torch

from graphrt.comm.base import Dispatched, Receiver, ep_group
from graphrt.errors import InputError

SUPPORTED_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
MAX_TOPK = 11
MAX_TOKENS_PER_RANK = 511  # (max_tokens + 1) * 2 <= NVSHMEM_QP_DEPTH (1024 by default)


class DeepEPRuleError(InputError):
    """A DeepEP low-latency rule would be broken (it would hang or corrupt silently). An
    ``InputError`` (so a ``ValueError``), like every other argument check of graphrt."""


def check_shape(hidden: int, num_topk: int, max_tokens: int) -> None:
    """Raise ``DeepEPRuleError`` unless DeepEP's low-latency kernels take this hidden size,
    top-k and tokens per rank (also what ``graphrt bench`` checks before it starts ranks).
    Host-only; needs no GPU."""
    if hidden not in SUPPORTED_HIDDEN:
        raise DeepEPRuleError(f"DeepEP low-latency kernels support hidden in "
                              f"{SUPPORTED_HIDDEN}; got {hidden}")
    if not 1 <= num_topk <= MAX_TOPK:
        raise DeepEPRuleError(f"DeepEP low-latency kernels support top-k <= {MAX_TOPK}; "
                              f"got {num_topk}")
    if not 1 <= max_tokens <= MAX_TOKENS_PER_RANK:
        raise DeepEPRuleError(f"max_tokens per rank must be in [1, {MAX_TOKENS_PER_RANK}] "
                              f"(NVSHMEM QP depth 1024); got {max_tokens}")


class DeepEPLowLatencyComm:
    """EP over ``deep_ep.Buffer`` (low-latency mode); global expert ``e`` lives on rank
    ``e // num_local_experts``.

    Args:
        num_experts, hidden, num_topk: model dims (hidden and top-k as DeepEP supports).
        device: this rank's GPU.
        max_tokens: tokens per rank per step (all ranks must use the same value); also the
            largest batch graphrt may capture on this rank.
        group: the process group (default: WORLD; NCCL must be initialised).
        fp8: dispatch in fp8 (scales for DeepGEMM's masked fp8 GEMM).
        mode: ``"hook"`` or ``"event"`` (see the module docstring).
    """

    uniform_batch = False

    def __init__(self, num_experts: int, hidden: int, num_topk: int, device, *,
                 max_tokens: int = 128, group=None, fp8: bool = False, mode: str = "hook"):
        check_shape(hidden, num_topk, max_tokens)
        if mode not in ("hook", "event"):
            raise InputError(f"mode must be 'hook' or 'event'; got {mode!r}")
        self.group, self.rank, self.num_ranks, self.num_local_experts = ep_group(
            group, num_experts, "DeepEPLowLatencyComm", error=DeepEPRuleError)
        import deep_ep
        self.num_experts, self.hidden, self.num_topk = num_experts, hidden, num_topk
        self.device, self.max_tokens, self.fp8, self.mode = torch.device(device), max_tokens, fp8, mode
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, self.num_ranks,
                                                              num_experts)
        self.buffer = deep_ep.Buffer(self.group, num_nvl_bytes=0, num_rdma_bytes=rdma,
                                     low_latency_mode=True,
                                     num_qps_per_rank=self.num_local_experts)
        self.calls = 0          # low-latency calls issued (parity = calls % 2)
        self._step_start = 0
        self.pending_receiver: Receiver | None = None  # the last hook-mode combine's

    def cap_for(self, bs: int) -> int:
        """DeepEP's masked layout has ``num_ranks * max_tokens`` rows per local expert."""
        return self.num_ranks * self.max_tokens

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, n: torch.Tensor, *,
                 topk_weights: torch.Tensor | None = None) -> Dispatched:
        """x bf16 ``[bs, hidden]``, topk_ids int64 ``[bs, num_topk]`` (-1: padding, no traffic).
        Graph safety: capturable."""
        from graphrt.kernels.dispatch import expected_m
        self._check_no_hook("dispatch")
        bs = x.shape[0]
        if bs > self.max_tokens:
            raise DeepEPRuleError(f"{bs} tokens on rank {self.rank} exceed max_tokens="
                                  f"{self.max_tokens} (DeepEP's dispatch cap); capture sizes <= "
                                  "max_tokens or build the comm with a larger max_tokens")
        if topk_ids.dtype != torch.int64 or x.dtype != torch.bfloat16:
            raise DeepEPRuleError(f"DeepEP needs bf16 x and int64 topk_ids; got {x.dtype}, {topk_ids.dtype}")
        recv, count, handle, _, _ = self.buffer.low_latency_dispatch(
            x, topk_ids, self.max_tokens, self.num_experts, use_fp8=self.fp8,
            async_finish=False, return_recv_hook=False)
        self.calls += 1
        recv_x, scale = recv if self.fp8 else (recv, None)
        # each local expert expects bs * num_topk / num_local_experts rows (from all ranks)
        em = expected_m(bs, self.num_topk, self.num_local_experts, cap=self.cap_for(bs))
        return Dispatched(recv_x, count, em, handle=(handle, self.calls), recv_scale=scale)

    def _check_no_hook(self, what: str) -> None:
        """Refuse a call while a hook-mode combine's receive hook has not run: that combine
        still owns a buffer of DeepEP's two, which this call would clean or reuse (a hang or
        silent corruption). Host-only."""
        held = getattr(self, "pending_receiver", None)
        if held is not None and not held.called:
            raise DeepEPRuleError(
                f"DeepEPLowLatencyComm.{what}: the last combine_async's receive hook has not "
                "run, and its combine still owns one of DeepEP's two low-latency buffers, which "
                f"this {what} would reuse; call that receiver first (it is "
                "comm.pending_receiver if you no longer hold it, e.g. after a step raised)")

    def _check_fresh(self, d: Dispatched) -> object:
        self._check_no_hook("combine")
        handle, gen = d.handle
        if gen != self.calls:
            raise DeepEPRuleError(
                f"{self.calls - gen} low-latency call(s) happened between this dispatch and its "
                "combine: DeepEP keeps two buffers, so at most two low-latency results may be "
                "alive. Combine each dispatch before the next dispatch")
        return handle

    def combine(self, y, topk_ids, topk_weights, d: Dispatched, n, *, out):
        """y bf16 ``[num_local_experts, cap, hidden]`` -> out bf16 ``[bs, hidden]`` (weighted sum,
        on the current stream). Graph safety: capturable."""
        handle = self._check_fresh(d)
        self.buffer.low_latency_combine(y, topk_ids, topk_weights, handle, out=out)
        self.calls += 1
        return out

    def combine_async(self, y, topk_ids, topk_weights, d: Dispatched, n, *, out) -> Receiver:
        """Start the combine; the receiver joins it (hook: receive kernel; event: stream wait).
        Graph safety: capturable."""
        handle = self._check_fresh(d)
        if self.mode == "hook":
            _, _, hook = self.buffer.low_latency_combine(y, topk_ids, topk_weights, handle,
                                                         return_recv_hook=True, out=out)
            self.calls += 1
            self.pending_receiver = Receiver(hook, out, keep=(y, topk_ids, topk_weights, handle))
            return self.pending_receiver
        _, ev, _ = self.buffer.low_latency_combine(y, topk_ids, topk_weights, handle,
                                                   async_finish=True, out=out)
        self.calls += 1
        return Receiver(ev.current_stream_wait, out, keep=(ev, *(ev.extra_tensors or ())))

    def end_step(self) -> None:
        """Called by the model at the end of a step (host-only, no device work): the step must
        have issued an even number of low-latency calls, or a captured graph would replay
        with the buffer parity flipped every other time."""
        made = self.calls - self._step_start
        self._step_start = self.calls
        if self.calls % 2 == 0:   # the total: a raised step flips it for good
            return
        raise DeepEPRuleError(
            f"{made} DeepEP low-latency call(s) since the last completed step leave the buffer "
            f"parity odd ({self.calls} in all): a step must issue an even number (dispatch + "
            "combine per MoE layer), and one that raised after a dispatch counts here too. "
            "Graphs captured at even parity would replay on the other buffer; DeepEP keeps the "
            "parity on the host and graphrt cannot turn it back: build the comm and capture again")
