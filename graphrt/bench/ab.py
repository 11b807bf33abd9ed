"""A capture-time switch off and on, in one process: the reference model's step captured twice
(the switch off, then on, while capturing; put back after), replayed alternately, device time
per replay (CUDA events, medians), and the two graphs' logits compared. Switches:

- ``pdl``: programmatic dependent launch of graphrt's Triton kernels (``GRAPHRT_PDL``,
  ``graphrt.kernels._util.pdl_args``);
- ``prefetch``: the attention layers' L2 prefetch of the o-projection weight
  (``Attention.prefetch``, ``graphrt.kernels.prefetch``);
- ``prefetch-qkv``: each layer's L2 prefetch of the next layer's QKV weight beside its MoE
  block (``DecoderLayer.prefetch_next_qkv``).

    python -m graphrt.bench.ab --switch prefetch --config qwen3-moe-like --experts 64 --layers 4 --sizes 1,16

Prints a markdown table and writes ``--out`` (JSON) when given. Needs a CUDA GPU (PDL: Hopper).

Graph safety: host-only (a benchmark driver).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics

import torch


@contextlib.contextmanager
def _env(name: str, value: str):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def _class_attr(module: str, cls: str, name: str, value):
    """``module.cls.name = value`` inside the block (imported when entered), put back after."""
    owner = getattr(importlib.import_module(module), cls)
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


# switch -> (on) -> the context a capture runs in
SWITCHES = {"pdl": lambda on: _env("GRAPHRT_PDL", "1" if on else "0"),
            "prefetch": lambda on: _class_attr("graphrt.moe.layers", "Attention", "prefetch", on),
            "prefetch-qkv": lambda on: _class_attr("graphrt.moe.model", "DecoderLayer",
                                                   "prefetch_next_qkv", on)}


def _capture(model, sizes, switch: str, on: bool):
    from graphrt import GraphRuntime
    with SWITCHES[switch](on):
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


def bench_ab(cfg, device, sizes: list[int], rounds: int = 5, switch: str = "pdl") -> dict:
    """Per size: median replay µs with ``switch`` off and on (rounds alternate the two
    graphs), their ratio, and the max relative difference of the two graphs' logits."""
    if switch not in SWITCHES:
        raise ValueError(f"switch must be one of {sorted(SWITCHES)}; got {switch!r}")
    from graphrt.moe import MoEModel
    model = MoEModel(cfg, device)
    for bs in sizes:           # measure the expert plan first, so both captures bake the same
        model.prepare(bs)
    off, on = _capture(model, sizes, switch, False), _capture(model, sizes, switch, True)
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
    return {"switch": switch, "config": cfg.name, "layers": cfg.num_layers, "experts": cfg.num_experts,
            "gpu": torch.cuda.get_device_name(device), "rows": rows}


def md_ab(res: dict) -> str:
    lines = [f"{res['switch']} off vs on: {res['config']} {res['layers']}L {res['experts']} experts, {res['gpu']}",
             "", "| bs | off µs | on µs | on/off | max row rel diff |", "|---|---|---|---|---|"]
    lines += [f"| {r['bs']} | {r['off_us']:.1f} | {r['on_us']:.1f} | {r['on_over_off']:.3f} | "
              f"{r['max_row_rel_diff']:.1e} |" for r in res["rows"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    from graphrt.moe import preset
    p = argparse.ArgumentParser(prog="python -m graphrt.bench.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--switch", choices=sorted(SWITCHES), default="pdl")
    p.add_argument("--config", default="qwen3-moe-like")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--sizes", default="1,16")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    res = bench_ab(preset(a.config, layers=a.layers, experts=a.experts), device,
                   [int(s) for s in a.sizes.split(",")], switch=a.switch)
    print(md_ab(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
