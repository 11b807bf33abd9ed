"""The expert plan's timing shortcuts against exhaustive timing, on one GPU (BENCHMARKS.md §53):

    python -m graphrt.bench.plan_check --config dsv3-like --layers 4 --experts 64 --max-bs 256

Plans every size of ``capture_sizes(--max-bs)`` (largest first, as capture does) for the
reference model's experts three times in one process, each time into an empty plan: with
the shortcuts (``plan_size`` as it runs at capture; this pass also compiles the kernels),
exhaustively (``expert_plan.exhaustive_timing``: 7 samples of 5 replays a candidate, none
given up, listed order, 4 routings a graph), and with the shortcuts again (compiled). Prints
each pass's seconds and, for each pass with shortcuts, how many (shape, size) picks equal
the exhaustive ones; where one differs, the exhaustive pass's own time of the shortcut's
pick over its best (1.000: a tie). ``--out FILE.json`` writes the three tables and the
comparison. Host-only (synchronizes)."""
from __future__ import annotations

import argparse
import sys
import time

from graphrt.bench.output import json_text

SCHEMA = "graphrt.bench.plan_check/1"


def compare(reference: dict, table: dict) -> tuple[int, list[dict]]:
    """``(same, differing)`` picks of ``table`` against ``reference`` (both
    ``ExpertPlan.to_json()["plan"]``: ``{key: {bs: entry}}``), over the reference's entries.
    Each differing one: ``{"key", "bs", "reference", "pick", "ratio"}``, ``ratio`` the
    reference's time of ``pick`` over its best (None where the reference has no time for
    it). Pure Python."""
    from graphrt.moe.expert_plan import Choice

    def name(e: dict) -> str:
        return Choice(e["kernel"], int(e.get("block_n", 32)), int(e.get("split_k", 1)), None,
                      int(e.get("num_warps", 4))).name
    same, differing = 0, []
    for key, sizes in reference.items():
        for bs, ref in sizes.items():
            pick = name(table[key][bs])
            if pick == name(ref):
                same += 1
                continue
            t = ref.get("candidates", {}).get(pick)
            differing.append({"key": key, "bs": int(bs), "reference": name(ref), "pick": pick,
                              "ratio": round(t / ref["us"], 4) if isinstance(t, float) else None})
    return same, differing


def _plan_all(experts, sizes: list[int], model) -> tuple[dict, float]:
    """A fresh plan of ``sizes`` for ``experts``: (its table, seconds)."""
    import torch

    from graphrt.moe.expert_plan import ExpertPlan, plan_size
    plan = ExpertPlan()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for bs in sizes:
        plan_size(plan, experts, bs, cap=model.comm.cap_for(bs), num_topk=model.cfg.num_topk,
                  num_experts=model.cfg.num_experts, num_ranks=model.comm.num_ranks)
    torch.cuda.synchronize()
    return plan.to_json()["plan"], time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphrt.bench.plan_check",
                                description=__doc__.split("\n")[0])
    p.add_argument("--config", default="dsv3-like")
    p.add_argument("--layers", type=int, default=1, help="layers built (the plan is shared; "
                   "default 1)")
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--max-bs", type=int, default=256)
    p.add_argument("--out", default=None, metavar="FILE.json")
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("plan_check: needs a CUDA GPU (the plan is measured with CUDA graphs and events)",
              file=sys.stderr)
        return 2
    from graphrt.moe import MoEModel, preset
    from graphrt.moe.expert_plan import exhaustive_timing
    from graphrt.sizes import capture_sizes
    cfg = preset(args.config, layers=args.layers, experts=args.experts)
    model = MoEModel(cfg, "cuda")
    experts = model.layers[0].moe.experts
    sizes = sorted(capture_sizes(min(args.max_bs, cfg.num_slots)), reverse=True)
    fast_cold, t_cold = _plan_all(experts, sizes, model)
    with exhaustive_timing():
        reference, t_ref = _plan_all(experts, sizes, model)
    fast, t_fast = _plan_all(experts, sizes, model)
    entries = sum(len(v) for v in reference.values())
    print(f"{cfg.name}, {cfg.num_experts} experts, {len(sizes)} sizes x {len(reference)} "
          f"shapes: plan {t_cold:.1f} s (first pass, compiles), exhaustive {t_ref:.1f} s, "
          f"plan {t_fast:.1f} s (compiled): {t_ref / t_fast:.1f}x faster")
    out = {"schema": SCHEMA, "config": cfg.name, "experts": cfg.num_experts, "sizes": sizes,
           "seconds": {"first": round(t_cold, 2), "exhaustive": round(t_ref, 2),
                       "compiled": round(t_fast, 2)},
           "tables": {"first": fast_cold, "exhaustive": reference, "compiled": fast}}
    for tag, table in (("first", fast_cold), ("compiled", fast)):
        same, differing = compare(reference, table)
        ratios = [d["ratio"] for d in differing if d["ratio"] is not None]
        worst = f"; the exhaustive pass's time of those picks: at most {max(ratios):.3f}x its best" \
            if ratios else ""
        print(f"  {tag} pass: {same} of {entries} picks as exhaustive{worst}")
        for d in differing:
            print(f"    {d['key']} bs {d['bs']}: exhaustive {d['reference']}, plan {d['pick']} "
                  f"({d['ratio']}x)")
        out[f"compare_{tag}"] = {"same": same, "differing": differing}
    if args.out:
        with open(args.out, "w") as f:
            f.write(json_text(out) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
