"""Expert plans kept on disk between processes: a size measured once is read back later.

A model that measures its expert plan (``MoEModel(backend="auto")``, ``plan_size``) times
every candidate kernel of both expert GEMMs at each captured size: about 5 s of the demo's
14-s capture once the compilers' caches are warm (BENCHMARKS.md §53). With a cache, every
size a process measures is written to disk, and a later process that builds the same
experts on the same GPU and software reads those sizes instead of timing them again::

    cache = PlanCache.default()      # $GRAPHRT_CACHE_DIR, else $XDG_CACHE_HOME/graphrt or
                                     # ~/.cache/graphrt; None where GRAPHRT_CACHE_DIR=off
    model = MoEModel(cfg, "cuda", plan_cache=cache)     # or plan_cache="/some/dir"
    ...capture...
    model.plan_origin                # {padded_bs: "measured" | "cache" | "given"}

One JSON file per ``fingerprint`` (``expert_plan-<16 hex digits>.json``): the versions of
graphrt, its kernels' source, torch, Triton, CUDA and DeepGEMM; the GPU (name, SMs,
compute capability); the experts (GEMM shapes, local experts, dtype, the kernels a plan may
pick, the epilogue switches, the kernels' own switches: TMA weights, fp8 MMA, the
compact activation grid, PDL); the routing the plan assumes (top-k, experts, ranks) and the
plan's own timing settings. Change any of them and the file is another one. Inside it, a
size is read back only when its rows per local expert (``cap``) match too::

    {"format": 1, "fingerprint": {...},
     "sizes": {"16": {"cap": 16, "plan": {"bf16:64x1536x2048": {"kernel": "triton", ...}}}}}

Writes go to a temporary file that replaces the cache file (``os.replace``), after merging
the sizes another process wrote meanwhile; a store holds an exclusive lock on the ``.lock``
file beside it (``fcntl.flock``) from its read to its replace, so two writers (EP ranks of
one host share the file) lose no size. A file that cannot be read, or that holds
another fingerprint, is ignored with a ``PlanCacheWarning`` and rewritten at the next
store; a directory that cannot be written warns and the plan stays in memory (each kind of
warning once a cache). A
cached pick can cost speed but not correctness: every candidate is a whole implementation
of the same GEMM, and eager runs the same pick as the replay.

Graph safety: host-only (file I/O in ``MoEModel.prepare``, before capture). Importing this
module imports no CUDA library; ``fingerprint`` reads the device and imports Triton.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

from graphrt.env import OFF
from graphrt.errors import InputError
from graphrt.moe.expert_plan import PLAN_VERSION, ExpertPlan

FORMAT = 1
_OFF = ("", "none", *OFF)  # graphrt's off words, and an empty or "none" directory


class PlanCacheWarning(UserWarning):
    """A plan cache file or directory that could not be used; the plan is measured instead."""


class PlanCache:
    """A directory of expert plan files (module docstring). Host-only plain file I/O."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory).expanduser()
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"PlanCache({str(self.dir)!r})"

    @classmethod
    def from_setting(cls, setting: str | None) -> PlanCache | None:
        """A cache from a user's setting (``GRAPHRT_CACHE_DIR``, ``graphrt demo
        --plan-cache``): a directory; ``off``, ``0``, ``false``, ``no``, ``none`` or empty:
        None (no cache); None: ``default()``."""
        if setting is None:
            return cls.default()
        return None if setting.strip().lower() in _OFF else cls(setting)

    @classmethod
    def default(cls) -> PlanCache | None:
        """``$GRAPHRT_CACHE_DIR`` (``off``, ``0`` or empty: None, no cache), else
        ``$XDG_CACHE_HOME/graphrt``, else ``~/.cache/graphrt``."""
        env = os.environ.get("GRAPHRT_CACHE_DIR")
        if env is not None:
            return cls.from_setting(env)
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return cls(os.path.join(base, "graphrt"))

    def path(self, fingerprint: dict) -> Path:
        """The file that holds the plans of ``fingerprint``."""
        blob = json.dumps(fingerprint, sort_keys=True, separators=(",", ":")).encode()
        return self.dir / f"expert_plan-{hashlib.sha256(blob).hexdigest()[:16]}.json"

    def load(self, plan: ExpertPlan, fingerprint: dict, padded_bs: int, cap: int,
             keys: list[str]) -> bool:
        """Record into ``plan`` the cached entries of ``padded_bs`` when the file holds every
        one of ``keys`` (plan shape keys) at that size with this ``cap``. Returns whether it
        did (False: the caller measures)."""
        entry = self._read(fingerprint).get(str(int(padded_bs)))
        if not isinstance(entry, dict) or entry.get("cap") != int(cap):
            return False
        table = entry.get("plan")
        if not isinstance(table, dict) or any(not isinstance(table.get(k), dict) for k in keys):
            return False
        try:
            loaded = ExpertPlan({"version": PLAN_VERSION,
                                 "plan": {k: {str(int(padded_bs)): table[k]} for k in keys}})
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
            self._warn("read", f"{self.path(fingerprint)}: size {padded_bs} is not a plan entry "
                       f"({exc}); measuring it again")
            return False
        for key in keys:
            plan.record(key, padded_bs, loaded.choices(padded_bs)[key],
                        loaded.timings(key, padded_bs))
        return True

    def store(self, plan: ExpertPlan, fingerprint: dict, padded_bs: int, cap: int,
              keys: list[str]) -> Path | None:
        """Write ``plan``'s entries of ``padded_bs`` for ``keys`` (merged with the sizes on
        disk). Returns the file, or None when it could not be written (warned once)."""
        table = plan.to_json()["plan"]
        size = str(int(padded_bs))
        if any(size not in table.get(k, {}) for k in keys):
            raise InputError(f"plan cache: the plan has no entry for batch {padded_bs} of "
                             f"every key {keys}: measure the size (plan_size) first")
        entry = {"cap": int(cap), "plan": {k: table[k][size] for k in keys}}
        path = self.path(fingerprint)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with _locked(path):  # another process's read-merge-write waits: no size lost
                sizes = self._read(fingerprint)
                sizes[size] = entry
                fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=self.dir)
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump({"format": FORMAT, "fingerprint": fingerprint, "sizes": sizes},
                                  f, indent=1, sort_keys=True)
                    os.replace(tmp, path)
                except BaseException:
                    os.unlink(tmp)
                    raise
        except OSError as exc:
            self._warn("write", f"cannot write the expert plan cache in {self.dir} ({exc}); "
                       f"the plan stays in memory: set GRAPHRT_CACHE_DIR to a writable "
                       f"directory, or to off")
            return None
        return path

    def _read(self, fingerprint: dict) -> dict:
        """``sizes`` of ``fingerprint``'s file; {} when it is missing or unusable (warned)."""
        path = self.path(fingerprint)
        try:
            with open(path) as f:
                data = json.load(f)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except (OSError, ValueError, RecursionError) as exc:
            self._warn("read", f"{path}: unreadable expert plan cache ({exc}); measuring "
                       f"instead, and it is rewritten at the next store")
            return {}
        if (not isinstance(data, dict) or data.get("format") != FORMAT
                or data.get("fingerprint") != fingerprint
                or not isinstance(data.get("sizes"), dict)):
            self._warn("read", f"{path}: not an expert plan cache of format {FORMAT} for this "
                       f"fingerprint; measuring instead, and it is rewritten at the next store")
            return {}
        return data["sizes"]

    def _warn(self, kind: str, msg: str) -> None:
        """Warn once a cache for each ``kind`` (``read``, ``write``)."""
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(PlanCacheWarning(msg), stacklevel=4)


def _source_digest() -> str:
    """sha256 (16 hex digits) of the source of graphrt's kernels and of the expert modules
    that time and run them: an edited kernel is another fingerprint."""
    import graphrt.kernels
    from graphrt.moe import expert_plan, experts
    files = sorted(Path(graphrt.kernels.__file__).parent.glob("*.py"))
    files += [Path(expert_plan.__file__), Path(experts.__file__)]
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _deep_gemm_version() -> str | None:
    """The importable ``deep_gemm``'s version (None without one). Read from the module: the
    wheels we test are distributed as ``tokenspeed-deepgemm``, so no distribution named
    ``deep_gemm`` exists to ask."""
    from graphrt.moe.experts import deep_gemm_available
    if not deep_gemm_available():
        return None
    import deep_gemm
    return getattr(deep_gemm, "__version__", None)


def fingerprint(experts, *, num_topk: int, num_experts: int, num_ranks: int) -> dict:
    """What ``experts``' plan measurements depend on (module docstring), as JSON-ready data.
    Host-only; reads the CUDA device's properties (``experts.device`` must be CUDA)."""
    import torch
    import triton

    import graphrt
    from graphrt.kernels import _util, activation, grouped_gemm, grouped_gemm_decode
    from graphrt.moe import expert_plan as ep
    props = torch.cuda.get_device_properties(experts.device)
    cls = type(experts)
    return {
        "plan_version": PLAN_VERSION, "graphrt": graphrt.__version__,
        "kernels_source": _source_digest(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "triton": triton.__version__,
        "deep_gemm": _deep_gemm_version(),
        "gpu": props.name, "sms": props.multi_processor_count,
        "capability": [props.major, props.minor],
        "shapes": sorted(key for key, _, _ in experts.gemm_shapes().values()),
        "local_experts": experts.E, "fp8": bool(experts.fp8), "kernels": list(experts.kernels),
        "switches": {"fuse_act": bool(cls.fuse_act), "act_epilogue": bool(cls.act_epilogue),
                     "decode_epilogue": str(cls.decode_epilogue),
                     "triton_epilogue": bool(cls.triton_epilogue),
                     "epilogue_max_bs": cls.EPILOGUE_MAX_BS,
                     # the kernels' own switches: another weight path, MMA, grid or launch
                     "expert_tma": bool(grouped_gemm.TMA),
                     "fp8_mma": bool(grouped_gemm_decode.FP8_MMA),
                     "act_compact": bool(activation.COMPACT), "pdl": bool(_util.pdl_enabled())},
        "routing": {"num_topk": num_topk, "num_experts": num_experts, "num_ranks": num_ranks},
        "timing": {"give_up": ep.GIVE_UP, "sample_us": ep.SAMPLE_US,
                   "unrotated_l2": ep.UNROTATED_L2, "near_tie": ep.NEAR_TIE,
                   "retimes": ep.RETIMES},
    }


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path``'s ``.lock`` file beside it (``fcntl.flock``; released
    when its holder exits, even killed), for one process's read-merge-write of ``path``.
    Without ``fcntl`` (not POSIX) there is no lock: a size written at the same moment by
    another process can be lost and is measured again. Raises ``OSError`` where the lock
    file cannot be made (the caller warns)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
