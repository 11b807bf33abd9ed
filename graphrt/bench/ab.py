"""A capture-time switch off and on, in one process: the reference model's step captured twice
(the switch off, then on, while capturing; put back after), replayed alternately, device time
per replay (CUDA events, medians), and the two graphs' logits compared. Switches:

- ``pdl``: programmatic dependent launch of graphrt's Triton kernels (``GRAPHRT_PDL``,
  ``graphrt.kernels._util.pdl_args``);
- ``prefetch``: the attention layers' L2 prefetch of the o-projection weight
  (``Attention.prefetch``, ``graphrt.kernels.prefetch``);
- ``prefetch-qkv``: each layer's L2 prefetch of the next layer's QKV weight beside its MoE
  block (``DecoderLayer.prefetch_next_qkv``);
- ``attn-splits``: decode attention's split size picked per captured size
  (``Attention.split_size = None``, ``kernels.attention.split_size_for``) instead of 256;
- ``pdl-early``: kernels let the next kernel launch before they wait (``GRAPHRT_PDL_EARLY``);
- ``dense-gemv``: the dense projections on graphrt's decode GEMV instead of cuBLAS, up to 16
  rows (``graphrt.moe.layers.DENSE``, ``GRAPHRT_DENSE``); ``dense-auto``: the default
  (the GEMV for one or two rows) instead of cuBLAS; ``rows2`` / ``rows4``: the default's
  rows GEMV for 1-2 / 1-4 rows instead of one row only
  (``graphrt.kernels.dense_gemv.ROWS_AUTO``);
- ``fuse-norm``: the layer-end add + RMSNorm computed by the next layer's QKV projection
  (``DecoderLayer.fuse_norm``, ``graphrt.kernels.norm_gemv``);
- ``fuse-final-norm``: the last layer's add + final RMSNorm computed by the LM head's
  GEMV as well (``DecoderLayer.fuse_final_norm``);
- ``fuse-moe-norm``: the add + RMSNorm after attention computed by the router gate's
  one-row GEMV, which also stores the normed rows (``DecoderLayer.fuse_moe_norm``);
- ``fuse-combine``: the EP=1 combine made by the norm after the MoE block (the next
  layer's ``add_rmsnorm`` or the final norm) instead of its own launch where
  ``DecoderLayer.fuse_combine`` takes it (the default, "auto"; ``layers.PendingCombine``);
  ``fuse-combine-all``: also in the one-row QKV norm GEMV;
- ``fuse-route``: the router's top-k computed by the dispatch launch
  (``kernels.route_dispatch``) where ``MoEBlock.fuse_route`` takes it (the default, "auto":
  one row); ``fuse-route-all``: up to ``route_dispatch.MAX_ROWS`` rows;
- ``moe-norm-rows``: the add + RMSNorm after attention computed by the router gate's GEMV
  up to 16 rows (``layers.GATE_NORM_ROWS``, the default, ``norm_gemv_rows`` on a second grid
  dimension) against one row only; ``gate-4rows``: that GEMV with up to four rows a program
  instead of one (``kernels.norm_gemv.ONE_ROW_N``);
- ``triton-epilogue``: the experts' SiLU-and-mul as the epilogue of W13 where the plan runs
  it on the Triton masked GEMM (``Experts.triton_epilogue``,
  ``masked_grouped_gemm(epilogue="silu_and_mul")``; the plan times W13 with it);
- ``routed-gemv``: one-row steps' routed experts addressed by the top-k's ids and weights,
  W13 with SiLU-and-mul and W2 with the combine, no dispatch and no combine launch
  (``MoEBlock.routed_gemv``, ``Experts.routed``, ``kernels.routed_gemv``);
- ``layer-kernel``: one-row steps' decoder layers each in one persistent launch (grid
  barriers between the phases, each phase's first weight tile loaded before its barrier;
  ``DecoderLayer.layer_kernel``, ``kernels.decode_layer``);
- ``fuse-act``: the experts' SiLU-and-mul computed by the W2 decode GEMM as it loads its
  operand (``Experts.fuse_act``, ``decode_grouped_gemm(act="silu_and_mul")``);
- ``act-compact``: the experts' SiLU-and-mul (and, with ``--fp8``, its quantisation and the
  EP=1 input quantisation) on a grid shared among live rows instead of one per expert
  (``graphrt.kernels.activation.COMPACT``);
- ``fuse-append``: the new K/V written by the attention launch instead of a ``kv_append``
  launch before it (``Attention.fuse_append``, ``decode_attention(k_new=, ...)``);
- ``preload``: the one-row GEMVs load their first weight tile before the PDL wait
  (``graphrt.moe.layers.PRELOAD``, ``dense_gemv_rows(preload=)``, ``norm_gemv_rows(preload=)``);
- ``routing-packed``: the router top-k kernels pick with one max over packed (score, id)
  keys a pick (``graphrt.kernels.routing.PACKED``);
- ``embed-kernel``: the embedding lookup on ``graphrt.kernels.embedding`` instead of
  ``index_select`` (``MoEModel.embed_kernel``);
- ``router-rows``: projections of at most 256 outputs (the router gate) on the rows GEMV up
  to 16 rows instead of cuBLAS (``graphrt.kernels.dense_gemv.ROWS_SMALL_N``);
- ``fuse-dispatch``: the EP=1 dispatch in one launch up to 256 flat (token, k) ids instead of
  plan + copy (``graphrt.kernels.dispatch.FUSED_MAX_FLAT``);
- ``decode-epilogue``: the experts' SiLU-and-mul as the epilogue of W13 on the decode
  kernel, unsplit, where ``Experts.epilogue_for`` takes it (the default, "auto") instead of
  nowhere (``decode_grouped_gemm(epilogue=)``); ``decode-epilogue-all``: at every size;
- ``mma-preload``: ``dense_mma``'s programs load their first weight tile before the PDL
  wait (``graphrt.moe.layers.MMA_PRELOAD``, ``dense_mma(preload=)``);
- ``attn-prefetch``: decode attention's inner loop pipelined by hand, the next step's K/V in
  flight during a step's math, where ``kernels.attention.use_prefetch`` takes it (the
  default, ``PREFETCH = "auto"``) instead of nowhere; ``attn-prefetch-all``: at every split
  size; ``attn-pf-w8``: that loop on 8 warps instead of 4 (``PREFETCH_LAUNCH``);
- ``attn-table``: the split kernel loads its split's block ids once, up front, and runs on
  Triton's own pipeline (``kernels.attention.TABLE_UPFRONT``, the default, on 3 stages;
  ``attn-table-s4``: on 4, ``TABLE_LAUNCH``) instead of the hand-pipelined loop where it is
  on;
- ``attn-fused``: decode attention as one launch whose last program of each (row, kv
  head) merges (``Attention.variant = "fused"``) instead of ``"auto"`` (split + merge past
  one pass);
- ``out-buffers``: the step writes its logits into graphrt's static outputs
  (``MoEModel.out_buffers``, ``StepSpec.out``) instead of each graph copying them there at
  its end;
- ``fold-gate``: a one-row step's router gate folded into the o-projection's launch, its
  norm into the top-k's (``DecoderLayer.fold_gate``, ``kernels.gate_fold``) instead of the
  gate's own norm GEMV; ``fold-e1`` / ``fold-e2`` / ``fold-e8``: 1 / 2 / 8 gate rows a
  numerator program instead of 4 (``kernels.gate_fold.GATE_ROWS``); ``fold-w1``: the top-k
  launch on 1 warp instead of 4;
- ``expert-tma``: the Triton masked GEMM's 16-row config with its weights read by TMA
  (``grouped_gemm.TMA``); ``w13-tma-256x3`` / ``w13-tma-128x3``: W13's (the SiLU epilogue's)
  TMA tile of K 256 on 3 stages / K 128 on 3 stages instead of ``TMA_TILE``
  (``grouped_gemm.TMA_TILE_EPI``);
- ``expert-rows``: the expert plan's choices as measured, the CUDA-core rows kernel included
  (``kernels.grouped_gemv_rows``), against the fastest other kernel of each entry
  (``ExpertPlan.exclude``).

A variant joins switches with ``+`` (``pdl-early+dense-gemv``: both on); ``--switch`` may be
given several times, and every variant is then measured against the one baseline, their
replays alternating. The baseline has every switch any variant names off; a variant has its
own switches on and the others off (so ``pdl`` in the list turns PDL off everywhere else).

    python -m graphrt.bench.ab --switch prefetch --config qwen3-moe-like --experts 64 --layers 4 --sizes 1,16
    python -m graphrt.bench.ab --switch pdl-early --switch dense-gemv --switch pdl-early+dense-gemv

Prints a markdown table and writes ``--out`` (JSON) when given. Needs a CUDA GPU (PDL: Hopper).

Graph safety: host-only (a benchmark driver).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics

import torch

from graphrt.bench.output import ints, json_text
from graphrt.env import env_override
from graphrt.errors import InputError


@contextlib.contextmanager
def _class_attr(module: str, cls: str | None, name: str, value):
    """``module.cls.name = value`` (``module.name`` when ``cls`` is None) inside the block
    (imported when entered), put back after."""
    owner = importlib.import_module(module)
    owner = getattr(owner, cls) if cls is not None else owner
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _w13_tile(tile: tuple[int, int]):
    """A ``w13-tma-*`` switch: ``kernels.grouped_gemm.TMA_TILE_EPI`` = tile (on) or None
    (off: W13 on ``TMA_TILE``)."""
    return lambda on: _class_attr("graphrt.kernels.grouped_gemm", None, "TMA_TILE_EPI",
                                  tile if on else None)


def _gate_rows(rows: int):
    """The ``fold-e<rows>`` switch: ``kernels.gate_fold.GATE_ROWS`` = rows (on) or 4."""
    return lambda on: _class_attr("graphrt.kernels.gate_fold", None, "GATE_ROWS",
                                  rows if on else 4)


# switch -> (on) -> the context a capture runs in
SWITCHES = {"pdl": lambda on: env_override("GRAPHRT_PDL", "1" if on else "0"),
            "prefetch": lambda on: _class_attr("graphrt.moe.layers", "Attention", "prefetch", on),
            "prefetch-qkv": lambda on: _class_attr("graphrt.moe.model", "DecoderLayer",
                                                   "prefetch_next_qkv", on),
            "attn-splits": lambda on: _class_attr("graphrt.moe.layers", "Attention", "split_size",
                                                  None if on else 256),
            "attn-split128": lambda on: _class_attr("graphrt.moe.layers", "Attention",
                                                    "split_size", 128 if on else None),
            "attn-fused": lambda on: _class_attr("graphrt.moe.layers", "Attention", "variant",
                                                 "fused" if on else "auto"),
            "attn-split64": lambda on: _class_attr("graphrt.moe.layers", "Attention",
                                                   "split_size", 64 if on else None),
            "pdl-early": lambda on: env_override("GRAPHRT_PDL_EARLY", "1" if on else "0"),
            "dense-gemv": lambda on: _class_attr("graphrt.moe.layers", None, "DENSE",
                                                 "gemv" if on else "torch"),
            "dense-auto": lambda on: _class_attr("graphrt.moe.layers", None, "DENSE",
                                                 "auto" if on else "torch"),
            "rows2": lambda on: _class_attr("graphrt.kernels.dense_gemv", None, "ROWS_AUTO",
                                            2 if on else 1),
            "rows4": lambda on: _class_attr("graphrt.kernels.dense_gemv", None, "ROWS_AUTO",
                                            4 if on else 1),
            "fuse-norm": lambda on: _class_attr("graphrt.moe.model", "DecoderLayer", "fuse_norm", on),
            "fuse-final-norm": lambda on: _class_attr("graphrt.moe.model", "DecoderLayer",
                                                      "fuse_final_norm", on),
            "fuse-moe-norm": lambda on: _class_attr("graphrt.moe.model", "DecoderLayer",
                                                    "fuse_moe_norm", on),
            "fuse-combine": lambda on: _class_attr("graphrt.moe.model", "DecoderLayer",
                                                   "fuse_combine", "auto" if on else False),
            "fuse-combine-all": lambda on: _class_attr("graphrt.moe.model", "DecoderLayer",
                                                       "fuse_combine", on),
            "fuse-route": lambda on: _class_attr("graphrt.moe.model", "MoEBlock", "fuse_route",
                                                 "auto" if on else False),
            "fuse-route-all": lambda on: _class_attr("graphrt.moe.model", "MoEBlock",
                                                     "fuse_route", on),
            "moe-norm-rows": lambda on: _class_attr("graphrt.moe.layers", None, "GATE_NORM_ROWS",
                                                    16 if on else 1),
            "gate-4rows": lambda on: _class_attr("graphrt.kernels.norm_gemv", None, "ONE_ROW_N",
                                                 0 if on else 256),
            "fuse-act": lambda on: _class_attr("graphrt.moe.experts", "Experts", "fuse_act", on),
            "triton-epilogue": lambda on: _class_attr("graphrt.moe.experts", "Experts",
                                                      "triton_epilogue", on),
            "routed-gemv": lambda on: _class_attr("graphrt.moe.model", "MoEBlock", "routed_gemv",
                                                  on),
            "layer-kernel": lambda on: _class_attr("graphrt.moe.model", "DecoderLayer",
                                                   "layer_kernel", on),
            "out-buffers": lambda on: _class_attr("graphrt.moe.model", "MoEModel",
                                                  "out_buffers", on),
            "fold-gate": lambda on: _class_attr("graphrt.moe.model", "DecoderLayer",
                                                "fold_gate", on),
            **{f"fold-e{rows}": _gate_rows(rows) for rows in (1, 2, 8)},
            "fold-w1": lambda on: _class_attr("graphrt.kernels.gate_fold", None,
                                              "FOLD_TOPK_WARPS", 1 if on else 4),
            "router-fused": lambda on: _class_attr("graphrt.moe.layers", "Router", "fused", on),
            "act-epilogue": lambda on: _class_attr("graphrt.moe.experts", "Experts",
                                                   "act_epilogue", on),
            "decode-epilogue": lambda on: _class_attr("graphrt.moe.experts", "Experts",
                                                      "decode_epilogue",
                                                      "auto" if on else False),
            "decode-epilogue-all": lambda on: _class_attr("graphrt.moe.experts", "Experts",
                                                          "decode_epilogue", on),
            "act-compact": lambda on: _class_attr("graphrt.kernels.activation", None, "COMPACT",
                                                  on),
            "fuse-append": lambda on: _class_attr("graphrt.moe.layers", "Attention", "fuse_append",
                                                  on),
            "mma-min3": lambda on: _class_attr("graphrt.moe.layers", None, "MMA_MIN_ROWS",
                                               3 if on else 2),
            "dense-mma": lambda on: _class_attr("graphrt.moe.layers", None, "DENSE_MMA", on),
            "mma-preload": lambda on: _class_attr("graphrt.moe.layers", None, "MMA_PRELOAD", on),
            "preload": lambda on: _class_attr("graphrt.moe.layers", None, "PRELOAD", on),
            "routing-packed": lambda on: _class_attr("graphrt.kernels.routing", None, "PACKED", on),
            "embed-kernel": lambda on: _class_attr("graphrt.moe.model", "MoEModel", "embed_kernel",
                                                   on),
            "router-rows": lambda on: _class_attr("graphrt.kernels.dense_gemv", None,
                                                  "ROWS_SMALL_N", 256 if on else 0),
            "fuse-dispatch": lambda on: _class_attr("graphrt.kernels.dispatch", None,
                                                    "FUSED_MAX_FLAT", 256 if on else 0),
            "attn-table": lambda on: _class_attr("graphrt.kernels.attention", None,
                                                 "TABLE_UPFRONT", on),
            "attn-table-s4": lambda on: _class_attr("graphrt.kernels.attention", None,
                                                    "TABLE_LAUNCH", {"num_warps": 4,
                                                                     "num_stages": 4 if on else 3}),
            "attn-wide": lambda on: _class_attr("graphrt.kernels.attention", None, "WIDE", on),
            "attn-wide-s2": lambda on: _class_attr("graphrt.kernels.attention", None,
                                                   "WIDE_LAUNCH", {"num_warps": 4,
                                                                   "num_stages": 2 if on else 1}),
            "attn-prefetch": lambda on: _class_attr("graphrt.kernels.attention", None, "PREFETCH",
                                                    "auto" if on else False),
            "attn-prefetch-all": lambda on: _class_attr("graphrt.kernels.attention", None,
                                                        "PREFETCH", on),
            "attn-pf-w8": lambda on: _class_attr("graphrt.kernels.attention", None,
                                                 "PREFETCH_LAUNCH", {"num_warps": 8 if on else 4,
                                                                     "num_stages": 1}),
            "swap-bk256": lambda on: _class_attr("graphrt.kernels.grouped_gemm_decode", None,
                                                 "SWAP_BLOCK_K", 256 if on else 128),
            "expert-swap": lambda on: _class_attr("graphrt.moe.expert_plan", "ExpertPlan",
                                                  "exclude", frozenset() if on else
                                                  frozenset({"swap"})),
            "expert-tma": lambda on: _class_attr("graphrt.kernels.grouped_gemm", None, "TMA", on),
            "w13-tma-256x3": _w13_tile((256, 3)),
            "w13-tma-128x3": _w13_tile((128, 3)),
            "expert-rows": lambda on: _class_attr("graphrt.moe.expert_plan", "ExpertPlan",
                                                  "exclude", frozenset() if on else
                                                  frozenset({"rows"}))}


# Pairs of switches that set one setting to different values when off: a run holding both has
# no single baseline ("every switch off"), and a variant of one would run with the other's
# off value, not the default.
CONFLICTS = (("attn-splits", "attn-split128"), ("attn-splits", "attn-split64"),
             ("expert-swap", "expert-rows"))


def check_variants(variants: list[str]) -> None:
    """``InputError`` unless every variant parses and no two switches of the run conflict
    (``CONFLICTS``). Host-only."""
    used = {s for v in variants for s in parse_variant(v)}
    clash = [f"{a} and {b}" for a, b in CONFLICTS if a in used and b in used]
    if clash:
        raise InputError(f"switches {'; '.join(clash)} set the same setting to different values "
                         "when off, so the run has no one baseline: time them in separate runs")


def parse_variant(variant: str) -> list[str]:
    """The switches of ``variant`` (``a+b`` -> ``[a, b]``); ValueError naming an unknown one."""
    parts = variant.split("+")
    bad = [p for p in parts if p not in SWITCHES]
    if bad or not variant:
        raise InputError(f"switch must be one of {sorted(SWITCHES)}, or several joined by '+'; "
                         f"got {variant!r}")
    return parts


def _capture(model, sizes, switches: list[str], on: list[str]):
    """Capture with every switch in ``switches`` off except those in ``on``. The off ones are
    set first, so a switch that is on wins where two set the same thing (``dense-gemv`` and
    ``dense-auto`` both set ``layers.DENSE``)."""
    from graphrt import GraphRuntime
    with contextlib.ExitStack() as stack:
        for switch in [s for s in switches if s not in on] + list(on):
            stack.enter_context(SWITCHES[switch](switch in on))
        return GraphRuntime(model.spec(max(sizes)), sizes=sizes, progress=False).capture()


def _replay_us(rt, bs: int, iters: int = 50) -> list[float]:
    g = rt.graphs[bs].graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(iters):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return out


def bench_ab(cfg, device, sizes: list[int], rounds: int = 5, switch: str = "pdl",
             fp8: bool = False) -> dict:
    """Per size: median replay µs with ``switch`` (a variant: switches joined by ``+``) off and
    on (rounds alternate the two graphs), their ratio, and the max relative difference of the
    two graphs' logits."""
    res = bench_variants(cfg, device, sizes, [switch], rounds, fp8=fp8)
    rows = [{"bs": r["bs"], "off_us": r["off_us"], **r["variants"][switch]} for r in res["rows"]]
    return {**{k: v for k, v in res.items() if k != "variants"}, "switch": switch, "rows": rows}


def bench_variants(cfg, device, sizes: list[int], variants: list[str], rounds: int = 5,
                   fp8: bool = False) -> dict:
    """``bench_ab`` for several variants against one baseline (every switch they name off): per
    size and variant ``on_us``, ``on_over_off`` and ``max_row_rel_diff``; replays alternate.
    ``fp8``: the model's experts in fp8 (DeepGEMM's block-scaled layout)."""
    check_variants(variants)
    mentioned = list(dict.fromkeys(sw for v in variants for sw in parse_variant(v)))
    from graphrt.moe import MoEModel
    model = MoEModel(cfg, device, fp8=fp8)
    for bs in sizes:           # measure the expert plan first, so every capture bakes the same
        model.prepare(bs)
    off = _capture(model, sizes, mentioned, [])
    ons = {v: _capture(model, sizes, mentioned, parse_variant(v)) for v in variants}
    rows = []
    for bs in sizes:
        x = model.example_inputs(bs, device, torch.Generator().manual_seed(bs))
        a = off.run(**x)["logits"].float()
        diffs = {}
        for v, rt in ons.items():
            b = rt.run(**x)["logits"].float()
            diffs[v] = float(((a - b).norm(dim=-1) / a.norm(dim=-1)).max())
        t_off, t_on = [], {v: [] for v in variants}
        for _ in range(rounds):
            t_off += _replay_us(off, bs)
            for v, rt in ons.items():
                t_on[v] += _replay_us(rt, bs)
        m_off = statistics.median(t_off)
        rows.append({"bs": bs, "off_us": m_off, "variants": {
            v: {"on_us": statistics.median(t_on[v]),
                "on_over_off": statistics.median(t_on[v]) / m_off,
                "max_row_rel_diff": diffs[v]} for v in variants}})
    return {"variants": variants, "config": cfg.name, "layers": cfg.num_layers,
            "experts": cfg.num_experts, "fp8": fp8, "gpu": torch.cuda.get_device_name(device),
            "rows": rows}


def md_ab(res: dict) -> str:
    variants = res["variants"]
    lines = [f"every switch off vs {', '.join(variants)}: {res['config']} {res['layers']}L "
             f"{res['experts']} experts{' fp8' if res.get('fp8') else ''}, {res['gpu']}", "",
             "| bs | off µs | " + " | ".join(f"{v} µs | on/off | max row rel diff" for v in variants) + " |",
             "|---|---|" + "---|---|---|" * len(variants)]
    for r in res["rows"]:
        cells = [f"{r['variants'][v]['on_us']:.1f} | {r['variants'][v]['on_over_off']:.3f} | "
                 f"{r['variants'][v]['max_row_rel_diff']:.1e}" for v in variants]
        lines.append(f"| {r['bs']} | {r['off_us']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from graphrt.moe import preset
    p = argparse.ArgumentParser(prog="python -m graphrt.bench.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--switch", action="append", default=None,
                   help=f"a variant: one of {sorted(SWITCHES)}, or several joined by '+' "
                        "(repeat --switch to measure several against one baseline; default pdl)")
    p.add_argument("--config", default="qwen3-moe-like")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--sizes", default="1,16", type=ints(1))
    p.add_argument("--fp8", action="store_true", help="fp8 experts (DeepGEMM's block-scaled layout)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    variants = a.switch or ["pdl"]
    try:
        check_variants(variants)
        cfg = preset(a.config, layers=a.layers, experts=a.experts)
    except ValueError as e:
        p.error(str(e))
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    res = bench_variants(cfg, device, a.sizes, variants, fp8=a.fp8)
    print(md_ab(res))
    if a.out:
        with open(a.out, "w") as f:
            f.write(json_text(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
