"""The one-row layer launch alone (``graphrt.kernels.decode_layer``): launch options side by
side, and where a layer's time goes.

    python -m graphrt.bench.layer --out bench-out/layer.json
    python -m graphrt.bench.layer --stamps --variant default --variant pipe=0 \\
        --variant programs=132,warps=8,tile=16384 --out layer.json

``--layers`` layers of a preset's shapes (random weights, each its own, so every launch reads
its weights from HBM) run chained in one CUDA graph, one row, context ``--ctx``; a variant is
the launcher's defaults or some of its options (``programs``, ``warps``, ``tile``,
``pipe``). Reported per variant: µs for the layers (median of 5 timings of ``--iters``
replays), µs a layer, the grid and its occupancy (programs an SM, registers, spills, shared
memory), and the last layer's output against the first variant's (relative norm: the
options change only summation orders). With ``--stamps``, one more eager run with the
launch's cycle counters gives layer 1's phases: for each phase the median and the slowest
program's time from leaving the previous barrier to arriving at the next, and the shortest
wait at the barrier (the last arriver's), in µs at ``--clock-mhz``; for attention also the
slowest item's time to its partial stores and a merge's time after them, and for the weight
phases the rate of their bytes over the slowest program's time (``phase_bytes``).

Tooling: synchronizes the device; nothing here runs inside a step.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from graphrt.bench.output import save_doc
from graphrt.errors import InputError

SCHEMA = "graphrt.bench.layer/1"
OPTIONS = {"programs": int, "warps": int, "tile": int, "pipe": int}
PHASES = ("norm + QKV", "attention", "o-projection", "norm + gate", "top-k + W13",
          "W2 + combine")


def parse_variant(text: str) -> dict:
    """``"default"`` -> ``{}``; ``"programs=132,warps=8"`` -> ``{"programs": 132, "warps": 8}``
    (keys of ``OPTIONS``). Raises ``ValueError`` naming what it expected."""
    if text == "default":
        return {}
    out = {}
    for part in text.split(","):
        key, sep, val = part.partition("=")
        if not sep or key not in OPTIONS:
            raise InputError(f"variant {text!r}: expected 'default' or comma-separated "
                             f"key=int with keys {sorted(OPTIONS)}, got {part!r}")
        try:
            out[key] = OPTIONS[key](val)
        except ValueError:
            raise InputError(f"variant {text!r}: {key} needs an int, got {val!r}") from None
    return out


def _layers(cfg, n_layers: int, ctx: int, dev, seed: int):
    """``(weights per layer, caches per layer, x, inputs)``: random bf16 weights scaled by
    fan-in, random caches, one row at position ``ctx - 1`` of a shuffled block table."""
    from graphrt.kernels.decode_layer import LayerWeights
    from graphrt.moe.layers import _randn
    from graphrt.moe.paged_kv import slot_of
    g = torch.Generator(device=dev).manual_seed(seed)
    bf = torch.bfloat16

    def rnd(*shape, fan_in):
        return _randn(g, dev, bf, *shape, fan_in=fan_in)

    h, d, kvh, E, inter = cfg.hidden, cfg.head_dim, cfg.num_kv_heads, cfg.num_experts, cfg.moe_inter
    q_dim, page, blocks = cfg.num_heads * d, cfg.block_size, cfg.max_blocks_per_seq
    weights, caches = [], []
    for _ in range(n_layers):
        weights.append(LayerWeights(
            attn_norm=(1 + 0.1 * torch.randn(h, generator=g, device=dev)).to(bf),
            wqkv=rnd(q_dim + 2 * kvh * d, h, fan_in=h), wo=rnd(h, q_dim, fan_in=q_dim),
            moe_norm=(1 + 0.1 * torch.randn(h, generator=g, device=dev)).to(bf),
            gate=rnd(E, h, fan_in=h) * 4, w13=rnd(E, 2 * inter, h, fan_in=h),
            w2=rnd(E, h, inter, fan_in=inter)))
        caches.append([torch.randn(blocks + 1, page, kvh, d, generator=g, device=dev).to(bf)
                       for _ in range(2)])
    table = torch.randperm(blocks + 1, generator=g, device=dev)[:blocks].to(torch.int32)[None]
    pos = torch.tensor([ctx - 1], device=dev)
    inputs = dict(block_table=table.contiguous(),
                  seq_lens=torch.tensor([ctx], dtype=torch.int32, device=dev),
                  slot_mapping=slot_of(table, pos, page),
                  n=torch.ones(1, dtype=torch.int32, device=dev))
    x = torch.randn(1, h, generator=g, device=dev).to(bf)
    return weights, caches, x, inputs


def phase_bytes(cfg) -> dict:
    """Weight bytes each phase of one layer reads at one row (bf16): QKV, the o-projection,
    the gate, and the ``num_topk`` picked experts' W13 and W2 (one row's picks are distinct
    experts)."""
    h, d, inter, k = cfg.hidden, cfg.head_dim, cfg.moe_inter, cfg.num_topk
    q_dim = cfg.num_heads * d
    return {"norm + QKV": (q_dim + 2 * cfg.num_kv_heads * d) * h * 2,
            "o-projection": h * q_dim * 2, "norm + gate": cfg.num_experts * h * 2,
            "top-k + W13": k * 2 * inter * h * 2, "W2 + combine": k * h * inter * 2}


def _phases(st: torch.Tensor, clock_mhz: float, nbytes: dict | None = None) -> dict:
    """Layer phases from one launch's stamps ``[G, 16]`` (``decode_layer``'s ``stamps``);
    with ``nbytes`` (``phase_bytes``), each weight phase's rate over its slowest program's
    time (``gbs``)."""
    st = st.cpu()
    t = st.double() / clock_mhz  # µs
    out, prev = {}, t[:, 0]
    for b, name in enumerate(PHASES, 1):
        arr = t[:, 2 * b] if b < 6 else t[:, 14]
        work = arr - prev
        row = {"median_us": round(float(work.median()), 2), "max_us": round(float(work.max()), 2)}
        if b < 6:
            lv = t[:, 2 * b + 1]
            row["barrier_us"] = round(float((lv - arr).min()), 2)
            prev = lv
        if nbytes and name in nbytes and work.max() > 0:
            row["gbs"] = round(nbytes[name] / float(work.max()) / 1e3, 1)
        out[name] = row
    items = st[:, 12] > 0
    if items.any():
        att = (t[:, 12] - t[:, 3])[items]
        out["attention"]["item_max_us"] = round(float(att.max()), 2)
    merges = st[:, 13] > 0
    if merges.any():
        out["attention"]["merge_max_us"] = round(float((t[:, 13] - t[:, 12])[merges].max()), 2)
    out["layer_us"] = round(float((t[:, 14] - t[:, 0]).max()), 2)
    return out


def bench(cfg, variants: list[str], *, n_layers: int, ctx: int, iters: int, stamps: bool,
          clock_mhz: float, seed: int = 0, log=print) -> dict:
    """``{"schema", "device", "config", "layers", "ctx", "results": [per variant: {"variant",
    "us", "us_layer", "rel_vs_first", "launch": decode_layer's info, "phases"?}]}``."""
    from graphrt.bench.timing import cuda_time_us
    from graphrt.kernels.decode_layer import decode_layer
    from graphrt.moe.model import layer_workspace
    dev = torch.device("cuda", torch.cuda.current_device())
    weights, caches, x, inputs = _layers(cfg, n_layers, ctx, dev, seed)
    ws = layer_workspace(cfg, dev)
    xs = [x] + [torch.empty_like(x) for _ in range(n_layers)]
    doc = {"schema": SCHEMA, "device": torch.cuda.get_device_name(dev), "config": cfg.name,
           "layers": n_layers, "ctx": ctx, "clock_mhz": clock_mhz, "results": []}
    first = None
    for text in variants:
        opt = parse_variant(text)
        kw = dict(programs=opt.get("programs"), pipe=opt.get("pipe"))
        if "warps" in opt:
            kw["num_warps"] = opt["warps"]
        if "tile" in opt:
            kw["tile"] = opt["tile"]
        info: dict = {}

        def run(st=None, kw=kw, info=info):
            for i, w in enumerate(weights):
                decode_layer(xs[i], w, k_cache=caches[i][0], v_cache=caches[i][1],
                             num_topk=cfg.num_topk, eps=cfg.rms_eps, out=xs[i + 1], workspace=ws,
                             info=info, stamps=None if st is None else st[i], **kw, **inputs)

        try:
            run()
        except ValueError as e:  # e.g. a grid the SMs cannot hold: say so, go on
            log(f"{text}: refused: {e}")
            doc["results"].append({"variant": text, "refused": str(e)})
            continue
        torch.cuda.synchronize()
        out = xs[-1].double()
        first = out if first is None else first
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        us = cuda_time_us(graph.replay, iters=iters, reps=5)
        res = {"variant": text, "us": round(us, 1), "us_layer": round(us / n_layers, 1),
               "rel_vs_first": float((out - first).norm() / first.norm()), "launch": dict(info)}
        if stamps:
            st = torch.zeros(n_layers, info["programs"], 16, dtype=torch.int64, device=dev)
            kw = {**kw, "programs": info["programs"]}
            for _ in range(2):
                run(st, kw)
            torch.cuda.synchronize()
            res["phases"] = _phases(st[min(1, n_layers - 1)], clock_mhz, phase_bytes(cfg))
        doc["results"].append(res)
        log(_row(res))
        del graph
    return doc


def _row(r: dict) -> str:
    if "refused" in r:
        return f"| {r['variant']} | refused | | | |"
    ln = r["launch"]
    occ = (f"{ln['programs']} ({ln.get('per_sm', '?')} an SM), {ln['num_warps']} warps, tile "
           f"{ln['tile']}, pipe {ln['pipe']}; "
           f"{ln.get('regs', '?')} regs, {ln.get('spills', '?')} spills, "
           f"{ln.get('smem', 0) // 1024} KB")
    return f"| {r['variant']} | {r['us']} | {r['us_layer']} | {r['rel_vs_first']:.1e} | {occ} |"


def markdown(doc: dict) -> str:
    """The variants as a table, then each variant's phases (where stamped)."""
    lines = [f"Device {doc['device']}, {doc['config']}, {doc['layers']} layers chained in one "
             f"CUDA graph, one row, context {doc['ctx']}.", "",
             "| variant | µs | µs a layer | output vs the first | launch |",
             "|---|---|---|---|---|"]
    lines += [_row(r) for r in doc["results"]]
    for r in doc["results"]:
        ph = r.get("phases")
        if not ph:
            continue
        lines += ["", f"{r['variant']}: layer 1 {ph['layer_us']} µs (stamps at "
                      f"{doc['clock_mhz']:.0f} MHz)", "",
                  "| phase | median µs | slowest µs | barrier µs | GB/s (slowest) |",
                  "|---|---|---|---|---|"]
        for name in PHASES:
            p = ph[name]
            extra = "".join(f", {k} {p[k]}" for k in ("item_max_us", "merge_max_us") if k in p)
            lines.append(f"| {name}{extra} | {p['median_us']} | {p['max_us']} | "
                         f"{p.get('barrier_us', '')} | {p.get('gbs', '')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from graphrt.moe.config import PRESETS, preset
    p = argparse.ArgumentParser(prog="python -m graphrt.bench.layer",
                                description=__doc__.split("\n")[0])
    p.add_argument("--config", default="qwen3-moe-like", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--ctx", type=int, default=1024,
                   help="positions of the row (the new one included)")
    p.add_argument("--variant", action="append",
                   help="'default' or key=int,... of programs, warps, tile, pipe "
                        "(repeat; default: just 'default')")
    p.add_argument("--iters", type=int, default=50, help="replays per timing sample")
    p.add_argument("--stamps", action="store_true", help="also each variant's phases")
    p.add_argument("--clock-mhz", type=float, default=1980.0,
                   help="SM clock the stamps' cycles divide by (an H200's boost clock)")
    p.add_argument("--out", required=True,
                   help="JSON results path (the table goes to .md beside it)")
    a = p.parse_args(argv)
    variants = a.variant or ["default"]
    why = None
    try:
        for v in variants:
            parse_variant(v)
    except ValueError as e:
        why = str(e)
    try:
        cfg = preset(a.config, layers=a.layers, experts=a.experts)
    except InputError as e:  # --layers 0, --experts 1: the config's own check
        print(f"graphrt.bench.layer: {e}", file=sys.stderr)
        return 2
    if why is None and not torch.cuda.is_available():
        why = "needs a CUDA GPU"
    if why is None and not 1 <= a.ctx <= cfg.max_blocks_per_seq * cfg.block_size:
        why = f"--ctx needs 1..{cfg.max_blocks_per_seq * cfg.block_size}, got {a.ctx}"
    if why is None:
        from graphrt.kernels.decode_layer import layer_fits
        if not layer_fits(hidden=cfg.hidden, q_dim=cfg.q_dim, inter=cfg.moe_inter,
                          head_dim=cfg.head_dim, num_heads=cfg.num_heads,
                          num_kv_heads=cfg.num_kv_heads):
            why = f"{a.config}'s layer does not fit the one-launch layer (decode_layer.layer_fits)"
    if why:
        print(f"graphrt.bench.layer: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    doc = bench(cfg, variants, n_layers=a.layers, ctx=a.ctx, iters=a.iters, stamps=a.stamps,
                clock_mhz=a.clock_mhz, log=lambda s: print(s, flush=True))
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    save_doc(a.out, doc, markdown(doc))
    return 0 if any("us" in r for r in doc["results"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
