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

from graphrt.errors import GraphrtError, InputError, InputTypeError


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
    ``num_experts`` experts (None: ``cfg.num_experts``; EPLB: the physical slot count, an
    int >= 1). ``kw`` goes to the backend's constructor (``fp8=`` for DeepEP, ``group=``,
    ``cap_align=`` for local, ...); a keyword it does not take is an ``InputTypeError``,
    an unknown ``name`` or a ``num_experts`` < 1 an ``InputError``. Host-only."""
    E = cfg.num_experts if num_experts is None else num_experts
    if isinstance(E, bool) or not isinstance(E, int):
        raise InputTypeError(f"make_comm: num_experts must be an int >= 1 (or None for "
                             f"cfg.num_experts); got {E!r} ({type(E).__name__})")
    if E < 1:
        raise InputError(f"make_comm: num_experts must be an int >= 1 (or None for "
                         f"cfg.num_experts); got {E}")
    extra = {}
    deepep = {"deepep": "hook", "deepep-hook": "hook", "deepep-event": "event"}
    if name in deepep:  # exact names: 'deepep_event' is no way to ask for hook mode
        from graphrt.comm.deepep_ll import DeepEPLowLatencyComm as cls
        extra["mode"] = deepep[name]
    elif name == "nccl":
        from graphrt.comm.nccl import NCCLComm as cls
    elif name == "local":
        from graphrt.comm.local import LocalComm as cls
    else:
        raise InputError(f"unknown comm {name!r}; expected deepep[-hook|-event], nccl or local")
    _check_keywords(cls, name, kw, taken=("max_tokens", *extra))
    return cls(E, cfg.hidden, cfg.num_topk, device, max_tokens=max_tokens, **extra, **kw)


def _check_keywords(cls, name: str, kw: dict, taken: tuple) -> None:
    """``InputTypeError`` for keywords ``cls(...)`` does not take (or ``make_comm`` sets)."""
    import inspect
    params = inspect.signature(cls).parameters
    accepted = sorted(p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY
                      and p not in taken)
    unknown = sorted(set(kw) - set(accepted))
    if unknown:
        raise InputTypeError(f"make_comm({name!r}): {cls.__name__} takes no keyword "
                             f"{', '.join(map(repr, unknown))}; it takes {accepted} (max_tokens and "
                             "num_experts are make_comm's own arguments)")


def _entry(rank, world, port, out_dir, fn, args, setup=None):
    result = {"rank": rank}
    try:
        (setup or init)(rank, world, port)
        result.update(fn(rank, world, *args) or {})
        result.setdefault("ok", True)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}",
                      traceback=traceback.format_exc())
    finally:
        _report(out_dir, rank, result)
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _report(out_dir: str, rank: int, result: dict) -> None:
    """Write ``result`` as the rank's JSON file, whole or not at all (a temporary file
    renamed into place). A result json cannot encode (a dict keyed by tuples) becomes a
    failure saying so: raised here, it escaped ``_entry`` and torch's spawn error replaced
    every rank's result."""
    try:
        text = json.dumps(result, default=str)
    except Exception as exc:  # noqa: BLE001 - TypeError (keys), ValueError (a cycle), ...
        text = json.dumps({"rank": rank, "ok": False, "error": (
            f"result not JSON-encodable ({type(exc).__name__}: {exc}); return a dict with "
            "str keys (values other than JSON types are written as str)"
            + (f"; the rank's own error: {result['error']}" if result.get("error") else ""))})
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _exit_status(code: int | None) -> str:
    """``exit code N`` or ``signal NAME`` of a process's ``exitcode``."""
    if code is not None and code < 0:
        import signal
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class RanksTimeout(GraphrtError, TimeoutError):
    """``spawn``'s ranks did not all finish within ``timeout_s`` and none failed."""


def spawn(fn, world: int, *args, timeout_s: float = 600, grace_s: float = 30,
          setup=None) -> list[dict]:
    """Run ``fn(rank, world, *args)`` on ``world`` GPUs (each rank first runs ``setup(rank,
    world, port)``, default ``init``); return each rank's result dict, in rank order.

    A rank that raises reports ``ok: False`` with its error and traceback. Its peers are
    usually blocked in a collective waiting for it: ``grace_s`` after the first reported
    failure the ranks still running are killed (``killed: True``, ``ok: False``), so the
    real error comes back at once instead of after ``timeout_s``. A rank that dies without
    reporting (a segfault, an OOM kill, ``os._exit``, even ``os._exit(0)``) is a failure too:
    ``ok: False`` with its exit code or signal. A result JSON cannot encode (a dict keyed by
    tuples) comes back as ``ok: False`` saying so. Raises ``RanksTimeout`` (a ``TimeoutError``) only when no rank failed and they
    did not all finish within ``timeout_s`` (they are killed). ``first_failure`` picks the
    error to report. ``world`` must be an int >= 1 (``InputError``: no ranks is no result)."""
    if isinstance(world, bool) or not isinstance(world, int):
        raise InputTypeError(f"spawn: world must be an int >= 1 (processes to start); got "
                             f"{world!r} ({type(world).__name__})")
    if world < 1:
        raise InputError(f"spawn: world must be an int >= 1 (processes to start); got {world}: "
                         "no rank would run, and an empty result list reads as success")
    import shutil
    import time

    import torch.multiprocessing as mp
    out_dir = tempfile.mkdtemp(prefix="graphrt-ranks-")
    try:
        ctx = mp.start_processes(_entry, args=(world, free_port(), out_dir, fn, args, setup),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        failed_at, died, killed = None, {}, set()
        while True:
            try:
                if ctx.join(timeout=1):
                    break
            except mp.ProcessExitedException as exc:  # torch has terminated the others
                died[exc.error_index] = (f"exit code {exc.exit_code}" if not exc.signal_name
                                         else f"signal {exc.signal_name}")
                killed = {r for r, p in enumerate(ctx.processes) if r != exc.error_index}
                break
            now = time.monotonic()
            # liveness before the files: a rank writes its file before it exits
            gone = [r for r, p in enumerate(ctx.processes) if not p.is_alive()]
            results = _read(out_dir, world)
            for r in gone:  # ended without reporting, even with status 0 (os._exit(0))
                if not results[r] and r not in died:
                    died[r] = _exit_status(ctx.processes[r].exitcode)
            if failed_at is None and (died or any(not r.get("ok", True) for r in results)):
                failed_at = now
            if (failed_at is not None and now - failed_at > grace_s) or now > deadline:
                killed = {r for r, p in enumerate(ctx.processes) if p.is_alive()}
                for r in killed:
                    ctx.processes[r].kill()
                for p in ctx.processes:  # reap them: no zombies left behind
                    p.join(timeout=5)
                if failed_at is None:
                    raise RanksTimeout(f"ranks did not finish within {timeout_s} s")
                break
        results = []
        for r, res in enumerate(_read(out_dir, world)):
            if not res and r not in died and r not in killed and not ctx.processes[r].is_alive():
                died[r] = _exit_status(ctx.processes[r].exitcode)  # all exited, this one silent
            if res:
                results.append(res)
            elif r in died:
                results.append({"rank": r, "ok": False,
                                "error": f"the rank died without reporting ({died[r]}): a crash "
                                         "in native code, an out-of-memory kill or an exit"})
            elif r in killed:
                results.append({"rank": r, "ok": False, "killed": True,
                                "error": "killed after another rank failed (it was still "
                                         "running, likely waiting for that rank)"})
            else:
                results.append({"rank": r, "ok": False, "error": "no result (crashed)"})
        return results
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _read(out_dir: str, world: int) -> list[dict]:
    """Each rank's result file as written so far ({} for a rank that has not written)."""
    out = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError):  # not written yet, or being written
            out.append({})
    return out


def first_failure(results: list[dict]) -> dict | None:
    """The failure to report from ``spawn``'s results: a rank's own error before a rank
    killed because of it; None when every rank succeeded."""
    bad = [r for r in results if not r.get("ok")]
    return min(bad, key=lambda r: (bool(r.get("killed")), r.get("rank", 0))) if bad else None
