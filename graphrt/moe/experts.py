"""Routed experts in the masked layout: two masked grouped GEMMs around SiLU-and-mul.

``gemm13``: ``[num_local_experts, cap, hidden] -> [num_local_experts, cap, 2 * moe_inter]``;
``act``: SiLU(gate) * up on live rows only (optionally quantized to fp8 e4m3 with fp32
per-token 128-group scales); ``gemm2``: ``-> [num_local_experts, cap, hidden]``. With
``Experts.fuse_act`` (``GRAPHRT_FUSE_ACT=1``) and the decode kernel on W2, ``act`` runs
inside ``gemm2``'s A load (``decode_grouped_gemm(..., act="silu_and_mul")``, bitwise the
same result) and its launch disappears. With ``Experts.act_epilogue``
(``GRAPHRT_ACT_EPILOGUE``) and the ``rows`` kernel on W13, ``act`` is W13's epilogue instead
(``expert_gemv_rows(..., act="silu_and_mul")``: gate and up columns in one work item, bitwise
the same result, no ``u`` round trip); with ``Experts.decode_epilogue`` (by default at bs 1) and
the decode kernel on W13, unsplit, likewise there (``decode_grouped_gemm(...,
epilogue="silu_and_mul")``), and with ``Experts.triton_epilogue`` on the Triton masked GEMM
(``masked_grouped_gemm(..., epilogue="silu_and_mul")``). With fp8 the
dispatched tokens are quantized too: by DeepEP's fp8 dispatch in its send kernel, or (EP=1)
here by ``kernels.activation.quantize_fp8_masked`` over the live rows.

Each GEMM is one of four kernels (``Choice.kernel``): DeepGEMM's ``m_grouped_bf16_gemm_nt_masked``
(or ``m_grouped_fp8_gemm_nt_masked`` with the quantized activation and 128x128 block-scaled
fp8 weights) when ``deep_gemm`` imports on a Hopper GPU; graphrt's row-tiled Triton masked
GEMM (``kernels.grouped_gemm``, bf16); the decode kernel (``kernels.grouped_gemm_decode``:
each live expert's weights streamed once, bf16 and fp8); or its CUDA-core sibling for 1-4
rows an expert (``rows``: ``kernels.grouped_gemv_rows``, bf16, wherever the decode kernel
runs). With ``backend="auto"`` an
``ExpertPlan`` (``graphrt.moe.expert_plan``) picks per padded batch size, measured at capture
time; otherwise ``backend`` is used throughout. DeepGEMM compiles per shape and
``expected_m`` on first call, so every padded size is warmed before capture (the capture
manager's warm-up and the plan's timing do it).

Graph safety: capturable (every call; weights are allocated in ``__init__``).
"""
from __future__ import annotations

import functools

import torch

from graphrt.env import env_auto, env_flag
from graphrt.errors import BackendError, InputError
from graphrt.moe.expert_plan import MAX_SPLIT, SPLIT_ROWS, Choice, shape_key


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
        raise InputError(f"fp8 weights need N and K multiples of {block}; got {tuple(w.shape)}")
    q = torch.empty(G, N, K, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(G, N // block, K // block, dtype=torch.float32, device=w.device)
    for g in range(G):  # one expert at a time: an fp32 copy of all experts would not fit
        blocks = w[g].float().view(N // block, block, K // block, block)
        scale[g] = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-10) / 448.0
        q[g] = (blocks / scale[g][:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(N, K)
    return q, scale


def expert_weights(seed: int, expert: int, hidden: int, inter: int, device,
                   dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference weights of logical expert ``expert`` of the layer seeded ``seed``:
    (w13 ``[2 * inter, hidden]``, w2 ``[hidden, inter]``), random but deterministic, the same
    on every rank and for every replica. Host-only (setup)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + expert)
    w13 = torch.randn(2 * inter, hidden, generator=gen, device=device, dtype=dtype) * hidden ** -0.5
    w2 = torch.randn(hidden, inter, generator=gen, device=device, dtype=dtype) * inter ** -0.5
    return w13, w2


class Experts:
    """``num_local_experts`` SwiGLU experts. Weights are random but deterministic from ``seed``.

    Args:
        hidden, inter: model and expert dims.
        num_local_experts: experts held on this device.
        backend: the expert GEMM when no plan entry says otherwise: ``"auto"`` (DeepGEMM on
            Hopper when importable, else the Triton masked GEMM, or the decode kernel for
            fp8), ``"deepgemm"``, ``"triton"`` (the row-tiled masked GEMM, bf16) or
            ``"decode"`` (``kernels.grouped_gemm_decode``) or ``"rows"``
            (``kernels.grouped_gemv_rows``, bf16, its config's tile; meant for 1-4 rows an
            expert). Only ``"auto"`` lets a ``plan`` pick per padded size (the rows kernel
            among the candidates for bf16).
        fp8: fp8 e4m3 weights and activations (DeepGEMM's layout; DeepGEMM or decode kernel).
        quantize_input: with fp8, tokens arrive in bf16 and are quantized here (EP=1); False
            when the dispatch delivers them quantized (DeepEP's fp8 dispatch) with scales.
        expert_ids: the logical expert of each local slot (EPLB's physical slots, replicas
            included); default ``first_expert, first_expert + 1, ...``.
        plan: an ``ExpertPlan`` shared by the model's layers (``graphrt.moe.expert_plan``);
            ``None``: always ``backend``.
    """

    # Fuse SiLU-and-mul (and, with fp8, its quantization) into the W2 GEMM's A load when the
    # decode kernel runs W2: one launch fewer a layer, bitwise equal outputs, but measured
    # slower on an H200 (BENCHMARKS.md §23: 1.18x the step time at qwen3-like bs 1, 1.27x at
    # dsv3-like bs 1; the activation math sits in the weight-streaming K loop). Off; kept for
    # comparison (GRAPHRT_FUSE_ACT=1 at import).
    fuse_act = env_flag("GRAPHRT_FUSE_ACT", False)
    # SiLU-and-mul as the epilogue of W13 on the rows kernel (1-4 rows an expert): one launch
    # fewer a layer, bitwise equal outputs. GRAPHRT_ACT_EPILOGUE at import (A/B: the
    # act-epilogue switch sets it before capture).
    act_epilogue = env_flag("GRAPHRT_ACT_EPILOGUE", False)
    # SiLU-and-mul as the epilogue of W13 on the decode kernel (either operand order, unsplit,
    # bf16): one launch fewer a layer, bitwise equal outputs, but half the work items (a work
    # item holds gate and up tiles), so the expert plan times W13 with its activation at those
    # sizes (expert_plan.plan_size, w13_act). "auto" (the default): for padded batches of at
    # most EPILOGUE_MAX_BS rows, where it made the step 0.983x-0.989x (qwen3-like) and 0.993x
    # (dsv3-like) at bs 1 but 1.011x at bs 2 and 1.009x at qwen3-like bs 16 (BENCHMARKS.md
    # §27); True / False: always / never. GRAPHRT_DECODE_EPILOGUE=1 or 0 at import forces it
    # (A/B: the decode-epilogue and decode-epilogue-all switches).
    decode_epilogue: bool | str = env_auto("GRAPHRT_DECODE_EPILOGUE")
    EPILOGUE_MAX_BS = 1
    # The same epilogue on the Triton masked GEMM (``masked_grouped_gemm(epilogue=...)``): a
    # program reduces half its columns from gate rows and half from up rows, so the work
    # items and the bytes each reads stay as without it. On (the default), the plan times
    # every W13 candidate with its activation (act_in_w13, w13_act) and picks the Triton
    # kernel with it at qwen3-like bs 2-16: the step 0.975x-0.987x, bitwise equal logits
    # (BENCHMARKS.md §35). GRAPHRT_TRITON_EPILOGUE=0 at import turns it off (A/B: the
    # triton-epilogue switch).
    triton_epilogue = env_flag("GRAPHRT_TRITON_EPILOGUE", True)

    def __init__(self, hidden: int, inter: int, num_local_experts: int, device, *, seed: int = 0,
                 first_expert: int = 0, backend: str = "auto", fp8: bool = False,
                 dtype=torch.bfloat16, max_cap: int = 256, workspace=None,
                 quantize_input: bool = True, plan=None, expert_ids=None):
        on_cuda = torch.device(device).type == "cuda"
        self.planned = backend == "auto"
        if backend == "auto":
            backend = ("deepgemm" if deep_gemm_available() and on_cuda
                       else "decode" if fp8 else "triton")
        if backend not in ("deepgemm", "triton", "decode", "rows"):
            raise InputError(f"backend must be auto, deepgemm, triton, decode or rows; "
                             f"got {backend!r}")
        if backend == "deepgemm" and not deep_gemm_available():
            raise BackendError("backend='deepgemm' but deep_gemm does not import on a Hopper GPU here")
        if fp8 and backend in ("triton", "rows"):
            which = "the row-tiled Triton GEMM" if backend == "triton" else "the rows kernel"
            raise InputError("fp8 experts need DeepGEMM or the decode kernel (backend='deepgemm', "
                             f"'decode' or 'auto'); {which} is bf16 only")
        self.hidden, self.inter, self.E = hidden, inter, num_local_experts
        self.backend, self.fp8, self.dtype = backend, fp8, dtype
        self.device = torch.device(device)
        self.plan = plan if self.planned else None
        self._fixed = Choice(backend, block_n=0) if backend == "rows" else Choice(backend)
        self._keys = (shape_key(num_local_experts, 2 * inter, hidden, fp8),
                      shape_key(num_local_experts, hidden, inter, fp8))
        # Kernels a plan may pick from: the decode kernel always; the rows kernel (the decode
        # family's 1-4-row member) and the row-tiled one for bf16.
        self.kernels = tuple(k for k in ("decode", "rows", "triton", "deepgemm")
                             if not (k in ("rows", "triton") and fp8)
                             and not (k == "deepgemm" and not (deep_gemm_available() and on_cuda)))
        # Each expert's weights come from its own seed (layer seed, global expert id), so a
        # rank holding experts [first_expert, first_expert + E) has exactly EP=1's weights.
        # ``expert_ids`` (EPLB) names the logical expert of each slot instead; replicas of one
        # expert get identical weights.
        self.seed = seed
        self.expert_ids = (list(range(first_expert, first_expert + self.E)) if expert_ids is None
                           else [int(e) for e in expert_ids])
        if len(self.expert_ids) != self.E:
            raise InputError(f"expert_ids names {len(self.expert_ids)} experts for "
                             f"{self.E} local slots")
        self.w13 = torch.empty(self.E, 2 * inter, hidden, device=device, dtype=dtype)
        self.w2 = torch.empty(self.E, hidden, inter, device=device, dtype=dtype)
        for slot, e in enumerate(self.expert_ids):
            self.w13[slot], self.w2[slot] = expert_weights(seed, e, hidden, inter, device, dtype)
        if fp8:
            self.w13_q = quantize_weight_fp8(self.w13)
            self.w2_q = quantize_weight_fp8(self.w2)
            del self.w13, self.w2  # the fp8 copies are what the GEMMs read
        from graphrt.moe.workspace import Workspace
        self.ws = workspace if workspace is not None else Workspace(device)
        E = self.E
        self.ws.reserve("u", (E, max_cap, 2 * inter), dtype)
        self.ws.reserve("y", (E, max_cap, hidden), dtype)
        if self.planned or backend == "decode":  # split-K partials of the decode kernel
            self.ws.reserve("gemm_partials", (MAX_SPLIT, SPLIT_ROWS, max(2 * inter, hidden)),
                            torch.float32)
        if fp8:
            self.ws.reserve("a_q", (E, max_cap, inter), torch.float8_e4m3fn)
            self.ws.reserve("a_s", (E, max_cap, inter // 128), torch.float32)
            if quantize_input:  # EP=1: tokens arrive in bf16 and are quantized here
                self.ws.reserve("x_q", (E, max_cap, hidden), torch.float8_e4m3fn)
                self.ws.reserve("x_s", (E, max_cap, hidden // 128), torch.float32)
        else:
            self.ws.reserve("a", (E, max_cap, inter), dtype)

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """The per-slot weight tensors, each ``[num_local_experts, ...]`` (bf16 ``w13``/``w2``,
        or fp8 ``w13_q``/``w2_q`` with fp32 block scales ``w13_s``/``w2_s``): what a
        rebalance rewrites in place, slot by slot (``graphrt.eplb``). Host-only."""
        if self.fp8:
            return {"w13_q": self.w13_q[0], "w13_s": self.w13_q[1],
                    "w2_q": self.w2_q[0], "w2_s": self.w2_q[1]}
        return {"w13": self.w13, "w2": self.w2}

    @property
    def weight_bytes(self) -> int:
        """Bytes of expert weights (what a step reads when every expert is hit)."""
        if self.fp8:
            return sum(t.numel() * t.element_size() for p in (self.w13_q, self.w2_q) for t in p)
        return (self.w13.numel() + self.w2.numel()) * self.w13.element_size()

    def gemm_shapes(self) -> dict[str, tuple[str, int, int]]:
        """``{"w13" | "w2": (plan key, n, k)}`` of the two GEMMs. Host-only."""
        h, i = self.hidden, self.inter
        return {"w13": (self._keys[0], 2 * i, h), "w2": (self._keys[1], h, i)}

    def choices(self, bs: int | None = None) -> tuple[Choice, Choice]:
        """The (W13, W2) kernels for padded batch ``bs`` (None: the plan's current size):
        the plan's entries, else ``backend``. Host-only (a dict lookup)."""
        sel = None
        if self.plan is not None:
            sel = self.plan.current if bs is None else self.plan.choices(bs)
        if not sel:
            return self._fixed, self._fixed
        return sel.get(self._keys[0], self._fixed), sel.get(self._keys[1], self._fixed)

    def epilogue_for(self, bs: int | None) -> bool:
        """Whether W13 on the decode kernel applies SiLU-and-mul itself at padded batch
        ``bs`` (``decode_epilogue``: forced, or "auto": ``bs <= EPILOGUE_MAX_BS``).
        Host-only."""
        if isinstance(self.decode_epilogue, bool):
            return self.decode_epilogue
        return bs is not None and bs <= self.EPILOGUE_MAX_BS

    def gemm(self, which: str, a, masked_m, expected_m: int, out, choice: Choice, a_scale=None,
             act: str | None = None, epilogue: str | None = None):
        """``out = a @ W.T`` on live rows with ``choice``'s kernel; ``which`` is ``"w13"`` or
        ``"w2"``; ``a`` [E, cap, k] bf16 (or fp8 with ``a_scale`` [E, cap, k // 128]),
        ``out`` [E, cap, n] bf16 (the ``rows`` kernel: bf16 only, ValueError with fp8
        experts). ``act="silu_and_mul"``: with the decode kernel on W2, ``a`` is
        ``u = [gate | up]`` bf16 [E, cap, 2 * k] and the kernel applies SiLU-and-mul (fp8:
        and the activation quantization) as it loads A, no ``a_scale``; with the rows kernel
        on W13, ``out`` is [E, cap, inter] and SiLU-and-mul is the GEMM's epilogue; so with
        ``epilogue="silu_and_mul"`` and the decode kernel (``decode`` or ``swap``, unsplit) or
        the Triton masked GEMM on W13. Graph safety: capturable."""
        if epilogue is not None and (which != "w13" or choice.split_k != 1 or choice.kernel
                                     not in ("decode", "swap", "triton")):
            raise InputError(f"epilogue={epilogue!r} on {which}: expected the unsplit decode "
                             f"kernel or the Triton kernel on w13, got {choice.name}")
        if act is not None and (choice.kernel, which) not in (("decode", "w2"), ("rows", "w13")):
            raise InputError(f"act={act!r} on {which}: expected the decode kernel on w2 or the "
                             f"rows kernel on w13 (the GEMMs with a fused activation), got "
                             f"{choice.kernel!r}")
        w = (self.w13_q if which == "w13" else self.w2_q) if self.fp8 else \
            (self.w13 if which == "w13" else self.w2)
        if choice.kernel == "deepgemm":
            import deep_gemm
            if self.fp8:
                deep_gemm.m_grouped_fp8_gemm_nt_masked((a, a_scale), w, out, masked_m, expected_m)
            else:
                deep_gemm.m_grouped_bf16_gemm_nt_masked(a, w, out, masked_m, expected_m)
        elif choice.kernel == "rows":
            if self.fp8:
                raise InputError("choice.kernel 'rows': expected bf16 experts (the rows kernel "
                                 "has no fp8 path), got fp8; use the decode kernel")
            from graphrt.kernels.grouped_gemv_rows import expert_gemv_rows
            expert_gemv_rows(a, w, masked_m, out=out, block_n=choice.block_n or None,
                             num_warps=choice.num_warps, act=act)
        elif choice.kernel == "triton":
            from graphrt.kernels.grouped_gemm import masked_grouped_gemm
            masked_grouped_gemm(a, w, masked_m, out=out, expected_m=expected_m,
                                epilogue=epilogue)
        else:  # "decode", or "swap": the decode kernel with the weights as the MMA's M side
            from graphrt.kernels.grouped_gemm_decode import decode_grouped_gemm
            n = out.shape[2]
            ws = (self.ws.view("gemm_partials", (choice.split_k, SPLIT_ROWS, n))
                  if choice.split_k > 1 else None)
            w, b_scale = w if self.fp8 else (w, None)
            decode_grouped_gemm(a, w, masked_m, out=out, expected_m=expected_m,
                                block_n=choice.block_n, split_k=choice.split_k, workspace=ws,
                                a_scale=a_scale, b_scale=b_scale, num_warps=choice.num_warps,
                                act=act, swap=choice.kernel == "swap", epilogue=epilogue)
        return out

    def synthetic_io(self, which: str, cap: int):
        """``(a, a_scale, out)`` for timing ``which`` at ``cap`` rows an expert: views of this
        layer's workspace filled with random finite values (scratch between steps).
        Host-only setup (launches fills)."""
        E, h, i = self.E, self.hidden, self.inter
        k, n, out_name = (h, 2 * i, "u") if which == "w13" else (i, h, "y")
        out = self.ws.view(out_name, (E, cap, n))
        if not self.fp8:
            a = self.ws.view("y" if which == "w13" else "a", (E, cap, k))
            return a.normal_(), None, out
        names = ("x_q", "x_s") if which == "w13" else ("a_q", "a_s")
        try:
            a, s = (self.ws.view(names[0], (E, cap, k)), self.ws.view(names[1], (E, cap, k // 128)))
        except KeyError:  # the dispatch quantizes (no x_q here): a scratch copy for timing
            a = torch.empty(E, cap, k, dtype=torch.float8_e4m3fn, device=self.device)
            s = torch.empty(E, cap, k // 128, dtype=torch.float32, device=self.device)
        a.view(torch.uint8).random_(0, 0x77)  # positive finite e4m3 values
        return a, s.fill_(1e-2), out

    def routed(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               n: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        """One row's routed experts addressed by its picks, combined: ``out`` ``[1, hidden]``
        = ``sum_k topk_weights[0, k] * expert_{topk_ids[0, k]}(x)``, in two launches
        (``kernels.routed_gemv``: W13 with SiLU-and-mul, then W2 with the combine) and no
        masked layout. ``x`` bf16 ``[1, hidden]``; ``topk_ids`` int64 ``[1, K]`` (-1: none);
        ``topk_weights`` fp32 ``[1, K]``; ``n`` int32 ``[1]``. bf16 experts only
        (ValueError with fp8). Graph safety: capturable."""
        if self.fp8:
            raise InputError("Experts.routed: expected bf16 experts (the routed one-row kernels "
                             "have no fp8 path), got fp8; use the masked path (__call__)")
        from graphrt.kernels.routed_gemv import routed_w13, routed_w2_combine
        act = self.ws.view("a", (topk_ids.shape[1], self.inter))
        routed_w13(x, topk_ids, n, self.w13, out=act)
        return routed_w2_combine(act, topk_ids, topk_weights, n, self.w2, out=out)

    def __call__(self, recv_x: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
                 recv_scale: torch.Tensor | None = None, bs: int | None = None) -> torch.Tensor:
        """recv_x ``[E, cap, hidden]`` (bf16, or fp8 with ``recv_scale``) -> ``[E, cap, hidden]``
        bf16; rows past ``masked_m`` are not computed. ``bs``: the padded batch, whose plan
        entry picks the kernels (None: the size the plan last selected). With ``fuse_act``
        and W2 on the decode kernel, W2 reads ``u`` and applies the activation itself (no
        ``silu_and_mul_masked[_fp8]`` launch; bitwise the same output). Graph safety:
        capturable."""
        from graphrt.kernels.activation import quantize_fp8_masked, silu_and_mul_masked_fp8
        c13, c2 = self.choices(bs)
        E, cap = recv_x.shape[0], recv_x.shape[1]
        u = self.ws.view("u", (E, cap, 2 * self.inter))
        y = self.ws.view("y", (E, cap, self.hidden))
        fused = self.fuse_act and c2.kernel == "decode"
        if self.fp8:
            if recv_scale is None:  # EP=1: quantize live rows after dispatch (DeepEP's fp8
                # dispatch quantizes in its send kernel)
                x_q = self.ws.view("x_q", (E, cap, self.hidden))
                x_s = self.ws.view("x_s", (E, cap, self.hidden // 128))
                recv_x, recv_scale = quantize_fp8_masked(recv_x, masked_m, out_q=x_q, out_scale=x_s)
            self.gemm("w13", recv_x, masked_m, expected_m, u, c13, recv_scale)
            if fused:  # W2 quantizes silu(gate) * up itself
                return self.gemm("w2", u, masked_m, expected_m, y, c2, act="silu_and_mul")
            a_q = self.ws.view("a_q", (E, cap, self.inter))
            a_s = self.ws.view("a_s", (E, cap, self.inter // 128))
            silu_and_mul_masked_fp8(u, masked_m, out_q=a_q, out_scale=a_s)
            return self.gemm("w2", a_q, masked_m, expected_m, y, c2, a_s)
        a = self.ws.view("a", (E, cap, self.inter))
        if self.act_epilogue and c13.kernel == "rows" and not fused:  # W13 writes a itself
            self.gemm("w13", recv_x, masked_m, expected_m, a, c13, act="silu_and_mul")
            return self.gemm("w2", a, masked_m, expected_m, y, c2)
        if fused:
            self.gemm("w13", recv_x, masked_m, expected_m, u, c13)
            return self.gemm("w2", u, masked_m, expected_m, y, c2, act="silu_and_mul")
        self.w13_act(recv_x, masked_m, expected_m, u, a, c13, bs)
        return self.gemm("w2", a, masked_m, expected_m, y, c2)

    def act_in_w13(self, bs: int | None) -> bool:
        """Whether some W13 kernel at padded batch ``bs`` applies SiLU-and-mul itself (bf16;
        ``epilogue_for(bs)`` or ``triton_epilogue``): the expert plan then times every W13
        candidate with its activation. Host-only."""
        return not self.fp8 and (self.epilogue_for(bs) or self.triton_epilogue)

    def takes_epilogue(self, choice: Choice, bs: int | None) -> bool:
        """Whether W13 with ``choice`` at padded batch ``bs`` applies SiLU-and-mul itself:
        bf16 and unsplit, on the decode kernel (either operand order) where
        ``epilogue_for(bs)``, on the Triton masked GEMM where ``triton_epilogue``.
        Host-only."""
        if self.fp8 or choice.split_k != 1:
            return False
        if choice.kernel in ("decode", "swap"):
            return self.epilogue_for(bs)
        return choice.kernel == "triton" and self.triton_epilogue

    def w13_act(self, x, masked_m, expected_m: int, u, a, choice: Choice, bs: int | None):
        """``a = silu_and_mul(x @ W13.T)`` on live rows (bf16), as a step at padded batch
        ``bs`` runs it: W13's epilogue where ``takes_epilogue``, else W13 into ``u`` and the
        activation launch. The expert plan times W13 candidates through this where the
        epilogue applies. Graph safety: capturable."""
        from graphrt.kernels.activation import silu_and_mul_masked
        if self.takes_epilogue(choice, bs):
            return self.gemm("w13", x, masked_m, expected_m, a, choice, epilogue="silu_and_mul")
        self.gemm("w13", x, masked_m, expected_m, u, choice)
        return silu_and_mul_masked(u, masked_m, out=a)
