"""The watchdog's two-rank stall drill (the multigpu test in tests/test_watchdog.py drives it).

Graph safety: host-only (a test driver).
"""
from __future__ import annotations

import os
import time

import torch

from graphrt.watchdog import StallError, Watchdog, instrument


def drill(rank: int, world: int, out_dir: str, stall_step: int = 12, timeout_s: float = 5.0,
          max_bs: int = 16) -> dict:
    """Two ranks run a graph engine over DeepEP low-latency; rank 1 skips step ``stall_step``
    (and stops), so rank 0's dispatch waits forever. Rank 0's watchdog writes its report to
    ``out_dir/stall_rank0.txt`` and its engine raises ``StallError``; the parent kills both.
    Graph safety: host-only (a test driver; run under ``graphrt.testing.launch`` processes)."""
    import graphrt
    from graphrt.coordinator import RankCoordinator
    from graphrt.testing.launch import make_comm
    from graphrt.testing.engine import DecodeEngine, Workload, graph_step
    from graphrt.testing.ep_check import ep_config
    from graphrt.moe import MoEModel
    device = torch.device("cuda", rank)
    cfg = ep_config(layers=2)
    model = MoEModel(cfg, device, comm=make_comm("deepep-hook", cfg, device, max_bs))
    progress, step = instrument(model)
    rt = graphrt.GraphRuntime(model.spec(max_bs), coordinator=RankCoordinator(uniform=False),
                              progress=False, copy_outputs=False).capture()

    def report(err: StallError) -> None:  # on the watchdog thread: the main thread is waiting
        path = os.path.join(out_dir, f"stall_rank{rank}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(f"{err}\nstep={err.step} last_layer={err.last_layer}\n")
        os.replace(path + ".tmp", path)

    wd = Watchdog(progress, step, rank=rank, timeout_s=timeout_s, on_stall=report).start()
    engine = DecodeEngine(graph_step(rt), num_slots=cfg.num_slots, max_ctx=cfg.max_ctx,
                          max_batch_size=max_bs, device=device, keep_stepping=True, watchdog=wd)
    work = Workload(seed=100 + rank, vocab=cfg.vocab_size, max_ctx=cfg.max_ctx)
    for i in range(stall_step + 1):
        if rank == 1 and i == stall_step:
            time.sleep(20 * timeout_s)  # skip the step: rank 0 stalls; the parent kills us
            return {"skipped_step": i}
        engine.submit_all(work.arrivals(i))
        engine.step()
    return {"completed_steps": stall_step + 1}
