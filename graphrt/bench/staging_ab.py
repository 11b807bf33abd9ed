"""A/B of run()'s staging modes on the reference model (BENCHMARKS.md §24), on one GPU:

    python -m graphrt.bench.staging_ab --config qwen3-moe-like --layers 4 --experts 64 --bs 1

Both runtimes (``GRAPHRT_GRAPH_STAGING`` ``1`` and ``table``) are captured at the live batch in
one process; 7 alternating rounds, medians. Device µs per ``run()``: 40 calls queued behind a
device sleep, so each step's copies outside the graph count; host µs per ``run()`` on an idle
device. The two runtimes' logits are compared first. Host-only (synchronises)."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def device_us(rt, inputs: dict, calls: int = 40) -> float:
    """Device µs per ``run()`` of ``calls`` queued back to back behind a device sleep."""
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        rt.run(**inputs)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def host_us(rt, inputs: dict, calls: int = 200) -> float:
    """Median host µs of one ``run()`` on an idle device."""
    out = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rt.run(**inputs)
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def main(argv=None) -> int:
    import graphrt
    from graphrt.env import env_override
    from graphrt.moe import MoEModel, preset
    ap = argparse.ArgumentParser(prog="python -m graphrt.bench.staging_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="qwen3-moe-like")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("staging_ab: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    model = MoEModel(preset(args.config, layers=args.layers, experts=args.experts), dev)
    spec = model.spec(max(args.bs, 8))
    rts = {}
    for mode in ("1", "table"):
        with env_override("GRAPHRT_GRAPH_STAGING", mode):
            rts[mode] = graphrt.GraphRuntime(spec, sizes=[args.bs], device=dev, copy_outputs=False,
                                             progress=False).capture()
    inputs = {k: v.to(dev) for k, v in spec.random_inputs(args.bs, generator=torch.Generator().manual_seed(0)).items()}
    logits = {k: rt.run(**inputs)["logits"].clone() for k, rt in rts.items()}
    print("logits bitwise equal:", torch.equal(logits["1"], logits["table"]))
    res = {k: ([], []) for k in rts}
    for _ in range(args.rounds):
        for k, rt in rts.items():
            res[k][0].append(device_us(rt, inputs))
            res[k][1].append(host_us(rt, inputs))
    med = {k: (statistics.median(d), statistics.median(h)) for k, (d, h) in res.items()}
    for k, (d, h) in med.items():
        print(f"{args.config} bs {args.bs} GRAPHRT_GRAPH_STAGING={k}: device µs per run() {d:.1f}, "
              f"host µs per run() {h:.1f}")
    print(f"device ratio table / 1: {med['table'][0] / med['1'][0]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
