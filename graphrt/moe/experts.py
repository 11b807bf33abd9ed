"""Routed experts in the masked layout: two masked grouped GEMMs around SiLU-and-mul.

``gemm13``: ``[num_local_experts, cap, hidden] -> [num_local_experts, cap, 2 * moe_inter]``;
``act``: SiLU(gate) * up on live rows only (optionally quantized to fp8 e4m3 with fp32
per-token 128-group scales); ``gemm2``: ``-> [num_local_experts, cap, hidden]``. With fp8 the
dispatched tokens are quantized too: by DeepEP's fp8 dispatch in its send kernel, or (EP=1)
here by ``kernels.activation.quantize_fp8_masked`` over the live rows.

The GEMM is DeepGEMM's ``m_grouped_bf16_gemm_nt_masked`` (or ``m_grouped_fp8_gemm_nt_masked``
with the quantized activation and 128x128 block-scaled fp8 weights) when ``deep_gemm``
imports on a Hopper GPU, else graphrt's Triton fallback. DeepGEMM compiles per shape and
``expected_m`` on first call, so every padded size is warmed before capture (the capture
manager's warm-up does it).

Graph safety: capturable (every call; weights are allocated in ``__init__``).
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def deep_gemm_available() -> bool:
    """True when ``deep_gemm`` imports and the current GPU is Hopper (sm90)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        import deep_gemm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def quantize_weight_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled fp8: w ``[G, N, K]`` bf16 -> (fp8 ``[G, N, K]``, fp32 ``[G, N/128, K/128]``).
    Host-only (setup)."""
    G, N, K = w.shape
    if N % block or K % block:
        raise ValueError(f"fp8 weights need N and K multiples of {block}; got {tuple(w.shape)}")
    q = torch.empty(G, N, K, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(G, N // block, K // block, dtype=torch.float32, device=w.device)
    for g in range(G):  # one expert at a time: an fp32 copy of all experts would not fit
        blocks = w[g].float().view(N // block, block, K // block, block)
        scale[g] = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-10) / 448.0
        q[g] = (blocks / scale[g][:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(N, K)
    return q, scale


class Experts:
    """``num_local_experts`` SwiGLU experts. Weights are random but deterministic from ``seed``.

    Args:
        hidden, inter: model and expert dims.
        num_local_experts: experts held on this device.
        backend: ``"auto"`` (DeepGEMM on Hopper when importable, else Triton), ``"deepgemm"``
            or ``"triton"``.
        fp8: fp8 e4m3 weights and activations (DeepGEMM only).
        quantize_input: with fp8, tokens arrive in bf16 and are quantized here (EP=1); False
            when the dispatch delivers them quantized (DeepEP's fp8 dispatch) with scales.
    """

    def __init__(self, hidden: int, inter: int, num_local_experts: int, device, *, seed: int = 0,
                 first_expert: int = 0, backend: str = "auto", fp8: bool = False,
                 dtype=torch.bfloat16, max_cap: int = 256, workspace=None,
                 quantize_input: bool = True):
        if backend == "auto":
            backend = "deepgemm" if deep_gemm_available() and torch.device(device).type == "cuda" else "triton"
        if backend not in ("deepgemm", "triton"):
            raise ValueError(f"backend must be auto, deepgemm or triton; got {backend!r}")
        if backend == "deepgemm" and not deep_gemm_available():
            raise RuntimeError("backend='deepgemm' but deep_gemm does not import on a Hopper GPU here")
        if fp8 and backend != "deepgemm":
            raise ValueError("fp8 experts need DeepGEMM (backend='deepgemm' on Hopper)")
        self.hidden, self.inter, self.E = hidden, inter, num_local_experts
        self.backend, self.fp8, self.dtype = backend, fp8, dtype
        # Each expert's weights come from its own seed (layer seed, global expert id), so a
        # rank holding experts [first_expert, first_expert + E) has exactly EP=1's weights.
        self.w13 = torch.empty(self.E, 2 * inter, hidden, device=device, dtype=dtype)
        self.w2 = torch.empty(self.E, hidden, inter, device=device, dtype=dtype)
        gen = torch.Generator(device=device)
        for e in range(self.E):
            gen.manual_seed(seed * 1_000_003 + first_expert + e)
            self.w13[e] = torch.randn(2 * inter, hidden, generator=gen, device=device, dtype=dtype) * hidden ** -0.5
            self.w2[e] = torch.randn(hidden, inter, generator=gen, device=device, dtype=dtype) * inter ** -0.5
        if fp8:
            self.w13_q = quantize_weight_fp8(self.w13)
            self.w2_q = quantize_weight_fp8(self.w2)
            del self.w13, self.w2  # the fp8 copies are what the GEMMs read
        from graphrt.moe.workspace import Workspace
        self.ws = workspace if workspace is not None else Workspace(device)
        E = self.E
        self.ws.reserve("u", (E, max_cap, 2 * inter), dtype)
        self.ws.reserve("y", (E, max_cap, hidden), dtype)
        if fp8:
            self.ws.reserve("a_q", (E, max_cap, inter), torch.float8_e4m3fn)
            self.ws.reserve("a_s", (E, max_cap, inter // 128), torch.float32)
            if quantize_input:  # EP=1: tokens arrive in bf16 and are quantized here
                self.ws.reserve("x_q", (E, max_cap, hidden), torch.float8_e4m3fn)
                self.ws.reserve("x_s", (E, max_cap, hidden // 128), torch.float32)
        else:
            self.ws.reserve("a", (E, max_cap, inter), dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes of expert weights (what a step reads when every expert is hit)."""
        if self.fp8:
            return sum(t.numel() * t.element_size() for p in (self.w13_q, self.w2_q) for t in p)
        return (self.w13.numel() + self.w2.numel()) * self.w13.element_size()

    def _gemm(self, a, b, masked_m, expected_m, out, a_scale=None, b_scaled=None):
        if self.backend == "deepgemm":
            import deep_gemm
            if a_scale is not None:
                deep_gemm.m_grouped_fp8_gemm_nt_masked((a, a_scale), b_scaled, out, masked_m, expected_m)
            else:
                deep_gemm.m_grouped_bf16_gemm_nt_masked(a, b, out, masked_m, expected_m)
        else:
            from graphrt.kernels.grouped_gemm import masked_grouped_gemm
            masked_grouped_gemm(a, b, masked_m, out=out, expected_m=expected_m)
        return out

    def __call__(self, recv_x: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
                 recv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """recv_x ``[E, cap, hidden]`` (bf16, or fp8 with ``recv_scale``) -> ``[E, cap, hidden]``
        bf16; rows past ``masked_m`` are not computed. Graph safety: capturable."""
        from graphrt.kernels.activation import (quantize_fp8_masked, silu_and_mul_masked,
                                                silu_and_mul_masked_fp8)
        E, cap = recv_x.shape[0], recv_x.shape[1]
        u = self.ws.view("u", (E, cap, 2 * self.inter))
        y = self.ws.view("y", (E, cap, self.hidden))
        if self.fp8:
            if recv_scale is None:  # EP=1: quantize live rows after dispatch (DeepEP's fp8
                # dispatch quantizes in its send kernel)
                x_q = self.ws.view("x_q", (E, cap, self.hidden))
                x_s = self.ws.view("x_s", (E, cap, self.hidden // 128))
                recv_x, recv_scale = quantize_fp8_masked(recv_x, masked_m, out_q=x_q, out_scale=x_s)
            self._gemm(recv_x, None, masked_m, expected_m, u, recv_scale, self.w13_q)
            a_q = self.ws.view("a_q", (E, cap, self.inter))
            a_s = self.ws.view("a_s", (E, cap, self.inter // 128))
            silu_and_mul_masked_fp8(u, masked_m, out_q=a_q, out_scale=a_s)
            return self._gemm(a_q, None, masked_m, expected_m, y, a_s, self.w2_q)
        self._gemm(recv_x, self.w13, masked_m, expected_m, u)
        a = self.ws.view("a", (E, cap, self.inter))
        silu_and_mul_masked(u, masked_m, out=a)
        return self._gemm(a, self.w2, masked_m, expected_m, y)
