"""The flags of one ``graphrt bench`` run, checked against this machine and each other
before any work (``plan(args) -> Plan``): a flag the run cannot honour raises ``Refusal``,
one line for stderr (exit 2). Nothing here runs a benchmark or creates a file.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

import torch

from graphrt.bench.ep import EP_BACKENDS
from graphrt.bench.output import OutDirError, check_out_dir

SUITES = ("runtime", "modes", "moe", "ep", "loop", "eplb")
_SINGLE_GPU = ("runtime", "moe")          # no expert-parallel form
_NEEDS_GPU = ("runtime", "moe", "loop")    # refused on the CPU


class Refusal(Exception):
    """A flag this run cannot honour: one line on stderr, exit 2."""


@dataclass(frozen=True)
class Plan:
    """What one ``graphrt bench`` run does, every flag checked (``plan(args)``)."""
    suites: list
    cfg: object          # graphrt.moe.MoEConfig
    sizes: list
    modes: list
    comms: list          # ["local"] or EP backend names
    ranks: int
    torchrun: bool
    device: str          # "cpu", "cuda" or "cuda:N"
    out: str             # absolute folder
    fp8: bool
    max_tokens: int
    redundant: tuple = (0, 4, 8)   # eplb: redundant slots per rank, one run each

    @property
    def ep(self) -> bool:
        return self.comms != ["local"]


def plan(args) -> Plan:
    """Check every flag against this machine and each other; ``Refusal`` names the first one
    that cannot be honoured. Does no work and creates nothing."""
    from graphrt.bench.modes import _NEEDS_CUDA, MODES, parse_modes
    from graphrt.moe import preset
    arg = lambda name: getattr(args, name, None)  # noqa: E731 - tolerate partial namespaces
    comms = list(dict.fromkeys(arg("comm") or ["local"]))
    ep = comms != ["local"]
    if ep and "local" in comms:
        raise Refusal("--comm local is one GPU (EP=1) and cannot run with "
                      f"{', '.join(c for c in comms if c != 'local')}: run it separately")
    ranks, launch = arg("ranks"), torchrun_env()
    torchrun, world = launch is not None, launch[1] if launch else 1
    started = ("torchrun started" if {"LOCAL_RANK", "MASTER_ADDR"} & set(os.environ)
               else "RANK and WORLD_SIZE (set by hand) say")
    if torchrun and ep:
        if ranks is not None and ranks != world:
            raise Refusal(f"--ranks {ranks}, but {started} {world} processes: drop --ranks")
        if len(comms) > 1:
            raise Refusal(f"under torchrun one --comm per run, got {','.join(comms)}: run "
                          f"`graphrt bench --ranks {world} --comm {','.join(comms)}` instead")
        if missing := [v for v in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]:
            raise Refusal(f"RANK and WORLD_SIZE are set but not {', '.join(missing)}: start EP "
                          "runs with torchrun or with graphrt bench --ranks N")
        ranks = world
    if torchrun and not ep and world > 1:
        raise Refusal(f"{started} {world} processes, but --comm local "
                      f"is one GPU: pass an expert-parallel --comm ({', '.join(EP_BACKENDS)})")
    ranks = ranks or (2 if ep else 1)
    if ep and ranks < 2:
        raise Refusal(f"--comm {','.join(comms)} splits the experts over ranks: it needs "
                      f"--ranks 2 or more, got {ranks}")
    if not ep and ranks > 1:
        raise Refusal(f"--ranks {ranks} needs an expert-parallel --comm "
                      f"({', '.join(EP_BACKENDS)}); --comm local is one GPU")
    device = _device(arg("device"), comms if ep else None, ranks, torchrun)
    suites = list(dict.fromkeys(arg("suite") or (
        ["ep"] if ep else ["runtime", "modes"] if device != "cpu" else ["modes"])))
    if bad := [s for s in suites if s not in SUITES]:
        raise Refusal(f"unknown suite(s) {bad}; expected some of {', '.join(SUITES)}")
    if ep and (bad := [s for s in suites if s in _SINGLE_GPU]):
        raise Refusal(f"suite {bad[0]} is single-GPU: run it without --comm/--ranks, or pick "
                      "from --suite ep,modes,loop,eplb for an expert-parallel run")
    for s in ("ep", "eplb"):
        if not ep and s in suites:
            raise Refusal(f"suite {s} needs an expert-parallel --comm ({', '.join(EP_BACKENDS)}), "
                          "e.g. graphrt bench --ranks 2 --comm nccl")
    if device == "cpu" and (bad := [s for s in suites if s in _NEEDS_GPU]):
        raise Refusal(f"suite {bad[0]} needs a CUDA GPU; on CPU only the modes smoke run "
                      "works: graphrt bench --device cpu")
    name = arg("config") or ("tiny" if device == "cpu" else "dsv3-like")
    if device == "cpu" and name != "tiny":
        raise Refusal(f"no GPU in use: on CPU only the smoke mode runs (--config tiny, kernels "
                      f"on the Triton interpreter), not {name}: graphrt bench --device cpu")
    try:
        cfg = preset(name, layers=arg("layers"), experts=arg("experts"))
    except ValueError as exc:
        raise Refusal(f"{str(exc).splitlines()[0]}: change --layers/--experts")
    try:
        modes = parse_modes(arg("modes") or list(MODES))
    except ValueError as exc:
        raise Refusal(str(exc).splitlines()[0])
    _check_applies(arg, suites, device, ep)
    if device == "cpu" and "modes" in suites and arg("modes") and set(modes) <= set(_NEEDS_CUDA):
        raise Refusal(f"--modes {','.join(modes)}: each needs a CUDA GPU (CUDA graphs), and "
                      "torch uses none here; on CPU the smoke run measures eager and naive: "
                      "graphrt bench --device cpu --modes eager,naive")
    if "modes" in suites and arg("modes"):  # every asked mode one the suite would skip
        why = {m: ("single-GPU only (the naive peer needs every expert's weights; DeepEP and "
                   "NCCL calls are no custom ops for torch.compile)"
                   if ep and (m.startswith("naive") or m == "compile") else
                   "the naive peer needs bf16 expert weights, and --fp8 keeps fp8 copies only"
                   if arg("fp8") and m.startswith("naive") else None) for m in modes}
        if all(why.values()):
            raise Refusal(f"--modes {','.join(modes)}: {why[modes[0]]}; nothing would be "
                          "measured: pick other modes")
    default = [1, 8, 32, 128] if ep else [1, 8, 64, 256]
    sizes = sorted(set(arg("sizes") or [s for s in default if s <= cfg.num_slots]))
    if max(sizes) > cfg.num_slots:
        raise Refusal(f"--sizes up to {max(sizes)} exceed {cfg.name}'s {cfg.num_slots} KV-cache "
                      "slots (one request a row)")
    max_tokens = arg("max_tokens") or max(sizes)
    if max_tokens < max(sizes):
        raise Refusal(f"--max-tokens {max_tokens} is below the largest --sizes {max(sizes)}: "
                      "the EP buffers must hold every row of a step")
    if ep:
        _check_ep_shape(cfg, comms, ranks, max_tokens)
    from graphrt.bench.plots import plot_names
    names = ["results.json", "results.md"] + [
        n for tag in (comms if ep else [""]) for n in plot_names(tag).values()]
    try:
        out = check_out_dir("bench-out" if arg("out") is None else arg("out"), names)
    except OutDirError as exc:
        raise Refusal(str(exc))
    if "eplb" in suites and torchrun:
        raise Refusal("suite eplb starts one process group per redundancy setting: run it with "
                      "graphrt bench --ranks N, not under torchrun")
    redundant = tuple(dict.fromkeys(arg("redundant") or (0, 4, 8)))
    return Plan(suites, cfg, sizes, modes, comms, ranks, torchrun, device, out,
                bool(arg("fp8")), max_tokens, redundant)


def torchrun_env() -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` when both are set (torchrun sets them), else None. ``Refusal``
    for values torchrun never sets (``int()`` of them raised a traceback)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    fix = "fix it, or unset RANK and WORLD_SIZE to run without torchrun"
    if not (world.isascii() and world.isdigit() and int(world) >= 1):
        raise Refusal(f"WORLD_SIZE={world!r}: expected a process count (an int >= 1, as "
                      f"torchrun sets it); {fix}")
    if not (rank.isascii() and rank.isdigit() and int(rank) < int(world)):
        raise Refusal(f"RANK={rank!r}: expected this process's rank, an int from 0 to "
                      f"{int(world) - 1} (WORLD_SIZE={world}); {fix}")
    return int(rank), int(world)


def _device(want, ep_comms, ranks: int, torchrun: bool) -> str:
    """The device of a one-GPU run, or "cuda" for EP once the backends import and the GPUs
    are there."""
    cuda = torch.cuda.is_available()
    if ep_comms is None:
        device = want or ("cuda" if cuda else "cpu")
        if device.startswith("cuda") and not cuda:
            raise Refusal(f"--device {device}, but torch sees no CUDA GPU here; on CPU run the "
                          "smoke mode: graphrt bench --device cpu")
        if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
            raise Refusal(f"--device {device}, but torch sees {torch.cuda.device_count()} GPU(s)")
        return device
    for name in ep_comms:
        _check_backend(name)
    if not cuda:
        raise Refusal(f"--comm {','.join(ep_comms)} runs one process per CUDA GPU; torch sees "
                      "none here")
    if want is not None:
        raise Refusal(f"--device {want}: expert-parallel runs put rank r on cuda:r: drop --device")
    if not torchrun and torch.cuda.device_count() < ranks:
        raise Refusal(f"--ranks {ranks} needs {ranks} CUDA GPUs; torch sees "
                      f"{torch.cuda.device_count()}")
    return "cuda"


def _check_ep_shape(cfg, comms: list, ranks: int, max_tokens: int) -> None:
    """Refuse a model shape the expert-parallel backends reject, before any rank starts:
    experts that do not split over the ranks, and DeepEP's hidden sizes, top-k and tokens
    per rank (``deepep_ll.check_shape``)."""
    if cfg.num_experts % ranks:
        raise Refusal(f"{cfg.name}: {cfg.num_experts} experts do not split over {ranks} ranks: "
                      "change --experts or --ranks")
    if any(c.startswith("deepep") for c in comms):
        from graphrt.comm.deepep_ll import check_shape
        try:
            check_shape(cfg.hidden, cfg.num_topk, max_tokens)
        except ValueError as exc:
            raise Refusal(f"--comm {','.join(c for c in comms if c.startswith('deepep'))} with "
                          f"{cfg.name} and --max-tokens {max_tokens}: {exc}")


def _check_backend(name: str) -> None:
    """Refuse a backend whose module (or DeepEP itself) cannot be imported here."""
    module, cls_name = (("graphrt.comm.deepep_ll", "DeepEPLowLatencyComm")
                        if name.startswith("deepep") else ("graphrt.comm.nccl", "NCCLComm"))
    try:
        getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise Refusal(f"--comm {name} needs {module}.{cls_name}, which cannot be imported here "
                      f"({type(exc).__name__}: {first})")
    if name.startswith("deepep") and importlib.util.find_spec("deep_ep") is None:
        raise Refusal(f"--comm {name} needs DeepEP (the deep_ep module), which is not installed "
                      "here: pip install -e '.[gpu]' on the GPU machine")


def _check_applies(arg, suites: list, device: str, ep: bool) -> None:
    """Refuse flags that no selected suite uses."""
    sized = ("modes", "moe", "ep", "loop", "eplb")
    uses = {"modes": ("modes",), "fp8": ("modes", "moe"), "sizes": sized, "layers": sized,
            "experts": sized, "config": sized, "redundant": ("eplb",)}
    for flag, by in uses.items():
        if arg(flag) and not set(by) & set(suites):
            raise Refusal(f"--{flag} applies to the {' or '.join(by)} suite, which this run does "
                          f"not include (--suite {','.join(suites)}): add one or drop --{flag}")
    if arg("fp8") and device == "cpu":
        raise Refusal("--fp8 needs DeepGEMM on a CUDA GPU; the CPU smoke run is bf16: drop --fp8")
    if arg("max_tokens") is not None and not ep:
        raise Refusal("--max-tokens sizes the expert-parallel buffers: it needs an EP --comm "
                      f"({', '.join(EP_BACKENDS)})")
