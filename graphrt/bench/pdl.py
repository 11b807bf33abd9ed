"""Programmatic dependent launch (PDL) on and off, in one process: the reference model's step
captured twice (``GRAPHRT_PDL=0`` then ``=1`` while capturing, the variable restored after; ``graphrt.kernels._util.
pdl_args``), replayed alternately, device time per replay (CUDA events, medians), and the
two graphs' logits compared.

    python -m graphrt.bench.pdl --config qwen3-moe-like --experts 64 --layers 4 --sizes 1,16

Prints a markdown table and writes ``--out`` (JSON) when given. Needs a Hopper GPU.

Graph safety: host-only (a benchmark driver).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch


def _capture(model, sizes, pdl: bool):
    from graphrt import GraphRuntime
    before = os.environ.get("GRAPHRT_PDL")
    os.environ["GRAPHRT_PDL"] = "1" if pdl else "0"
    try:
        return GraphRuntime(model.spec(max(sizes)), sizes=sizes, progress=False).capture()
    finally:
        if before is None:
            os.environ.pop("GRAPHRT_PDL")
        else:
            os.environ["GRAPHRT_PDL"] = before


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


def bench_pdl(cfg, device, sizes: list[int], rounds: int = 5) -> dict:
    """Per size: median replay µs with PDL off and on (rounds alternate the two graphs),
    their ratio, and the max relative difference of the two graphs' logits."""
    from graphrt.moe import MoEModel
    model = MoEModel(cfg, device)
    for bs in sizes:           # measure the expert plan first, so both captures bake the same
        model.prepare(bs)
    off, on = _capture(model, sizes, False), _capture(model, sizes, True)
    rows = []
    for bs in sizes:
        x = model.example_inputs(bs, device, torch.Generator().manual_seed(bs))
        a, b = off.run(**x)["logits"].float(), on.run(**x)["logits"].float()
        diff = float(((a - b).norm(dim=-1) / a.norm(dim=-1)).max())
        t_off, t_on = [], []
        for _ in range(rounds):
            t_off += _replay_us(off, bs)
            t_on += _replay_us(on, bs)
        m_off, m_on = statistics.median(t_off), statistics.median(t_on)
        rows.append({"bs": bs, "off_us": m_off, "on_us": m_on, "on_over_off": m_on / m_off,
                     "max_row_rel_diff": diff})
    return {"config": cfg.name, "layers": cfg.num_layers, "experts": cfg.num_experts,
            "gpu": torch.cuda.get_device_name(device), "rows": rows}


def md_pdl(res: dict) -> str:
    lines = [f"PDL off vs on: {res['config']} {res['layers']}L {res['experts']} experts, {res['gpu']}",
             "", "| bs | off µs | on µs | on/off | max row rel diff |", "|---|---|---|---|---|"]
    lines += [f"| {r['bs']} | {r['off_us']:.1f} | {r['on_us']:.1f} | {r['on_over_off']:.3f} | "
              f"{r['max_row_rel_diff']:.1e} |" for r in res["rows"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    from graphrt.moe import preset
    p = argparse.ArgumentParser(prog="python -m graphrt.bench.pdl", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3-moe-like")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--sizes", default="1,16")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (PDL is a Hopper feature)")
    device = torch.device("cuda", torch.cuda.current_device())
    res = bench_pdl(preset(a.config, layers=a.layers, experts=a.experts), device,
                    [int(s) for s in a.sizes.split(",")])
    print(md_pdl(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
