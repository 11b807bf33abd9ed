"""Multi-GPU plumbing shared by the EP tests, benchmarks and examples.

``spawn(fn, world, *args)`` starts one process per GPU (``torch.multiprocessing``), each
calling ``fn(rank, world, port, *args)`` after ``init(rank, world, port)`` set the device and
the NCCL process group. Results come back through a file per rank (JSON), so a failing rank
reports its traceback instead of hanging the parent. ``make_comm`` builds a backend by name.

Graph safety: host-only.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
import traceback

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def multicast_off() -> None:
    """NVLink multicast off for NCCL, torch symmetric memory and NVSHMEM (the machines need
    it; a value already in the environment wins). Call before the process group starts."""
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)


def init(rank: int, world: int, port: int) -> torch.device:
    """Set this process's GPU and initialise NCCL (multicast off, as the machines require)."""
    import torch.distributed as dist
    multicast_off()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    return device


def make_comm(name: str, cfg, device, max_tokens: int, *, num_experts: int | None = None, **kw):
    """``deepep`` / ``deepep-hook`` / ``deepep-event`` / ``nccl`` / ``local``, for
    ``num_experts`` experts (default ``cfg.num_experts``; EPLB: the physical slot count)."""
    E = num_experts or cfg.num_experts
    if name.startswith("deepep"):
        from graphrt.comm.deepep_ll import DeepEPLowLatencyComm
        mode = name.split("-", 1)[1] if "-" in name else "hook"
        return DeepEPLowLatencyComm(E, cfg.hidden, cfg.num_topk, device,
                                    max_tokens=max_tokens, mode=mode, **kw)
    if name == "nccl":
        from graphrt.comm.nccl import NCCLComm
        return NCCLComm(E, cfg.hidden, cfg.num_topk, device, max_tokens=max_tokens)
    if name == "local":
        from graphrt.comm.local import LocalComm
        return LocalComm(E, cfg.hidden, cfg.num_topk, device, max_tokens=max_tokens)
    raise ValueError(f"unknown comm {name!r}; expected deepep[-hook|-event], nccl or local")


def _entry(rank, world, port, out_dir, fn, args):
    result = {"rank": rank}
    try:
        init(rank, world, port)
        result.update(fn(rank, world, *args) or {})
        result.setdefault("ok", True)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}",
                      traceback=traceback.format_exc())
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f, default=str)
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def spawn(fn, world: int, *args, timeout_s: float = 600) -> list[dict]:
    """Run ``fn(rank, world, *args)`` on ``world`` GPUs; return each rank's result dict."""
    import torch.multiprocessing as mp
    out_dir = tempfile.mkdtemp(prefix="graphrt-ranks-")
    ctx = mp.start_processes(_entry, args=(world, free_port(), out_dir, fn, args), nprocs=world,
                             join=False, start_method="spawn")
    import time
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"ranks did not finish within {timeout_s} s")
    results = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else
                       {"rank": r, "ok": False, "error": "no result (crashed)"})
    return results
