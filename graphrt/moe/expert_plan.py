"""Per-size expert-kernel plan: which grouped GEMM each captured size bakes in.

The routed experts' GEMMs have four implementations with different sweet spots: the
decode kernel (``kernels.grouped_gemm_decode``: live experts' weights streamed once, best
at a few rows an expert), its CUDA-core sibling for 1-4 rows an expert (``rows``:
``kernels.grouped_gemv_rows``, bf16; timed only when the synthetic routing has at most
``ROWS_MAX`` rows on every live expert), the row-tiled Triton masked GEMM
(``kernels.grouped_gemm``) and DeepGEMM's masked GEMM (many rows an expert). Which is fastest
depends on the padded batch (rows per live expert, live experts), the GEMM's shape and the
GPU, so it is *measured*:

    plan = ExpertPlan()                          # or ExpertPlan.load("plan.json")
    plan_size(plan, experts, padded_bs, ...)     # once per size, host-side (CUDA events)
    plan.select(padded_bs)                       # before every replay: one dict lookup
    plan.choices(padded_bs)["bf16:64x1536x2048"] # -> Choice(kernel="decode", block_n=16, ...)

``MoEModel.prepare`` (the step's ``before_replay`` hook) drives this; each captured graph
then holds the kernels chosen for its size. A table can be saved (``to_json``) and passed
back (``MoEModel(expert_plan=...)``) so a run skips measuring.

Table keys: ``"<dtype>:<num_local_experts>x<n>x<k>"`` (``dtype`` is ``bf16`` or ``fp8``), then
the padded batch size. JSON::

    {"version": 1, "plan": {"bf16:64x1536x2048": {"1": {"kernel": "decode", "block_n": 16,
      "split_k": 1, "us": 14.2, "candidates": {"decode/bn16": 14.2, "triton": 25.0, ...}}}}}

Synthetic batch for a padded size (``routed_rows``): ``padded_bs * num_ranks`` tokens pick
``num_topk`` experts each; the expected number of distinct local experts hit is
``E_local * (1 - (1 - 1/num_experts) ** (tokens * num_topk))`` (at least 1) and the expected
routed rows ``tokens * num_topk * E_local / num_experts`` are spread evenly over them.

Graph safety: host-only (``select`` and the lookups are plain Python; ``plan_size`` times
kernels with CUDA events and synchronizes, and refuses to run while a stream captures).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from graphrt.errors import BackendError, InputError, InputTypeError, is_int

PLAN_VERSION = 1
KERNELS = ("decode", "swap", "rows", "triton", "deepgemm")
DECODE_BLOCK_NS = (16, 32, 64, 128)  # the decode kernel's block_n (its BLOCK_NS)
SWAP_BLOCK_NS = (64, 128)  # the swapped decode kernel's block_n: the MMA's M side
NUM_WARPS = (1, 2, 4, 8, 16)  # a launch's warps (Triton takes powers of two)
ROWS_MAX = 4  # the rows kernel is a candidate while no live expert has more rows than this
ROWS_BLOCK_NS = (0, 1, 2, 4, 8, 16, 32, 64)  # the rows kernel's block_n (0: its config's pick)
SPLIT_ROWS = 256  # split-K workspace rows (compacted live rows); larger routings run unsplit
MAX_SPLIT = 4


@dataclass(frozen=True)
class Choice:
    """One expert-GEMM implementation: ``kernel`` (``decode`` | ``rows`` | ``triton`` |
    ``deepgemm``); the decode kernel's ``block_n``, ``split_k`` and ``num_warps``, or the rows
    kernel's ``block_n`` (0: ``expert_gemv_rows_config``'s pick; no split-K) and
    ``num_warps``; ``us`` as measured (None: not timed)."""

    kernel: str
    block_n: int = 32
    split_k: int = 1
    us: float | None = field(default=None, compare=False)
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_n", "split_k", "num_warps"):
            v = getattr(self, name)                # 32.0 and True compare equal to ints:
            if not is_int(v):                      # accepted, then a slice or a kernel failed
                raise InputTypeError(f"Choice.{name} must be an int; got {v!r} "
                                     f"({type(v).__name__})")
            object.__setattr__(self, name, int(v))  # a numpy integer as a plain int
        if self.kernel not in KERNELS:
            raise InputError(f"Choice.kernel: expected one of {KERNELS}, got {self.kernel!r}")
        if self.num_warps not in NUM_WARPS:
            raise InputError(f"Choice.num_warps: expected one of {NUM_WARPS}, got {self.num_warps}")
        if self.kernel in ("decode", "swap") and not (1 <= self.split_k <= MAX_SPLIT):
            raise InputError(f"Choice.split_k: expected 1..{MAX_SPLIT}, got {self.split_k}")
        if self.kernel == "decode" and self.block_n not in DECODE_BLOCK_NS:
            raise InputError(f"Choice.block_n with kernel 'decode': expected one of "
                             f"{DECODE_BLOCK_NS}, got {self.block_n}")
        if self.kernel == "swap" and self.block_n not in SWAP_BLOCK_NS:
            raise InputError(f"Choice.block_n with kernel 'swap': expected one of "
                             f"{SWAP_BLOCK_NS}, got {self.block_n}")
        if self.kernel == "rows":
            if self.block_n not in ROWS_BLOCK_NS:
                raise InputError(f"Choice.block_n with kernel 'rows': expected one of "
                                 f"{ROWS_BLOCK_NS}, got {self.block_n}")
            if self.split_k != 1:
                raise InputError(f"Choice.split_k with kernel 'rows': expected 1 (no split-K), "
                                 f"got {self.split_k}")

    @property
    def name(self) -> str:
        """``decode/bn32`` (``/sk2`` when split, ``/w8`` at other than 4 warps), ``rows/bn4``
        (``rows`` with the config's block_n; ``/w8`` likewise), ``triton`` or ``deepgemm``."""
        warps = f"/w{self.num_warps}" if self.num_warps != 4 else ""
        if self.kernel == "rows":
            return "rows" + (f"/bn{self.block_n}" if self.block_n else "") + warps
        if self.kernel not in ("decode", "swap"):
            return self.kernel
        return (f"{self.kernel}/bn{self.block_n}"
                + (f"/sk{self.split_k}" if self.split_k > 1 else "") + warps)


def shape_key(num_local_experts: int, n: int, k: int, fp8: bool) -> str:
    """The plan's key of one GEMM shape, e.g. ``bf16:64x1536x2048``."""
    return f"{'fp8' if fp8 else 'bf16'}:{num_local_experts}x{n}x{k}"


def routed_rows(padded_bs: int, num_topk: int, num_experts: int, num_local_experts: int,
                num_ranks: int = 1) -> list[int]:
    """Rows of each live local expert in a typical routing of ``padded_bs`` rows per rank
    (module docstring): a list of ``live`` positive ints summing to the expected routed rows."""
    picks = padded_bs * num_ranks * num_topk
    hit = num_local_experts * (1.0 - (1.0 - 1.0 / num_experts) ** picks)
    live = max(1, min(num_local_experts, round(hit)))
    rows = max(live, round(picks * num_local_experts / num_experts))
    return [rows // live + (1 if i < rows % live else 0) for i in range(live)]


def synthetic_masked_m(rows: list[int], num_local_experts: int, rotate: int = 0) -> torch.Tensor:
    """int32 ``[num_local_experts]`` (CPU): ``rows`` on live experts spread evenly, the spread
    shifted by ``rotate`` experts (different rotations touch different weights)."""
    m = torch.zeros(num_local_experts, dtype=torch.int32)
    for i, r in enumerate(rows):
        m[(i * num_local_experts // len(rows) + rotate) % num_local_experts] = r
    return m


def decode_candidates(n: int, k: int, live: int, num_sms: int, fp8: bool = False) -> list[Choice]:
    """Decode-kernel configurations worth timing: column tiles 16/32/64 at 4 warps, 32/64 at
    8 and 16 at 2, plus split-K (2, 4) when fewer than two work items per SM would run
    unsplit. Pure Python."""
    out = [Choice("decode", block_n=bn) for bn in (16, 32, 64)]
    out += [Choice("decode", block_n=bn, num_warps=w) for bn, w in ((32, 8), (64, 8), (16, 2))]
    if live * -(-n // 32) < 2 * num_sms:
        out += [Choice("decode", block_n=32, split_k=s) for s in (2, MAX_SPLIT)
                if k // s >= (128 if fp8 else 256)]
    return out


def swap_candidates(n: int, k: int, live: int, num_sms: int, fp8: bool = False) -> list[Choice]:
    """The decode kernel with the weights as the MMA's M side (``swap=True``) worth timing:
    column tiles 64 and 128 (fp8: 128 on 8 warps too, 0.91x the 4-warp tiles' best at a
    dsv3-like W13 with 8 live experts; BENCHMARKS.md §33), plus 64 split 2 and 4 ways when
    fewer than one work item per SM would run unsplit. Pure Python."""
    out = [Choice("swap", block_n=bn) for bn in SWAP_BLOCK_NS]
    if fp8:
        out.append(Choice("swap", block_n=128, num_warps=8))
    if live * -(-n // 64) < num_sms:
        out += [Choice("swap", block_n=64, split_k=s) for s in (2, MAX_SPLIT)
                if k // s >= (128 if fp8 else 256)]
    return out


def rows_candidates(n: int, k: int) -> list[Choice]:
    """Rows-kernel configurations worth timing: ``expert_gemv_rows_config``'s ``block_n``
    (the whole K up to 4096 a round, 8192 weights a program), half and twice it (1-64, at
    most ``next_power_of_2(n)``). Pure Python (the config is host arithmetic)."""
    import triton
    from graphrt.kernels.grouped_gemv_rows import expert_gemv_rows_config
    cfg = expert_gemv_rows_config(n, k)
    top = min(64, triton.next_power_of_2(n))
    bns = sorted({max(1, min(top, bn)) for bn in (cfg["block_n"] // 2, cfg["block_n"],
                                                  2 * cfg["block_n"])})
    return [Choice("rows", block_n=bn) for bn in bns]


def rows_eligible(kernels, rows: list[int], fp8: bool) -> bool:
    """Whether the rows kernel is timed: it belongs to the decode family (``"decode"`` in
    ``kernels``), bf16 only, and the routing has 1..``ROWS_MAX`` rows on every live expert
    (``rows`` as ``routed_rows`` gives them). Pure Python."""
    return "decode" in kernels and not fp8 and bool(rows) and max(rows) <= ROWS_MAX


def plan_candidates(kernels, n: int, k: int, rows: list[int], num_sms: int,
                    fp8: bool = False) -> list[Choice]:
    """Every configuration ``plan_size`` times for one GEMM shape: with ``"decode"`` in
    ``kernels`` the decode kernel's (``decode_candidates``, ``swap_candidates``) and, when
    ``rows_eligible``,
    the rows kernel's (``rows_candidates``); then each other kernel of ``kernels``
    (``triton``, ``deepgemm``) once. Pure Python."""
    out = []
    if "decode" in kernels:
        out += decode_candidates(n, k, len(rows), num_sms, fp8)
        out += swap_candidates(n, k, len(rows), num_sms, fp8)
        if rows_eligible(kernels, rows, fp8):
            out += rows_candidates(n, k)
    return out + [Choice(kname) for kname in kernels if kname not in ("decode", "swap", "rows")]


def default_choice(n: int, live: int, num_sms: int = 132) -> Choice:
    """The decode kernel without timing (CPU, or a size not measured): ``block_n`` 32 when
    that still gives two work items per SM, else 16; no split."""
    return Choice("decode", block_n=32 if live * -(-n // 32) >= 2 * num_sms else 16)


class ExpertPlan:
    """``{shape key: {padded_bs: Choice}}`` plus the candidates' timings, and the selection
    of the current size. Host-only plain data.

    ``exclude`` (a class attribute; ``graphrt.bench.ab``'s ``expert-rows`` switch): kernels
    read as the fastest other candidate measured for the same entry (``fallback``; an entry
    loaded from JSON has none and keeps its choice)."""

    exclude: frozenset = frozenset()

    def __init__(self, table: dict | None = None):
        self._by_size: dict[int, dict[str, Choice]] = {}
        self._fallback: dict[tuple[str, int], Choice] = {}
        self._timings: dict[tuple[str, int], dict[str, float | str]] = {}
        self.current: dict[str, Choice] | None = None
        # {padded_bs: (builds submitted, builds failed, seconds)} of plan_size's compile-ahead
        # pass (kernels.compile_ahead); not saved with the table
        self.compiled_ahead: dict[int, tuple[int, int, float]] = {}
        if table:
            self._load(table)

    # -- lookups (per replay) ------------------------------------------------------------
    def select(self, padded_bs: int) -> dict[str, Choice] | None:
        """Make ``padded_bs``'s choices current (what a step without its size reads)."""
        self.current = self.choices(padded_bs)
        return self.current

    def choices(self, padded_bs: int) -> dict[str, Choice] | None:
        """``{shape key: Choice}`` of ``padded_bs``, or None when that size has no entry."""
        table = self._by_size.get(padded_bs)
        if not self.exclude or table is None:
            return table
        return {k: self._fallback.get((k, padded_bs), c) if c.kernel in self.exclude else c
                for k, c in table.items()}

    def has(self, key: str, padded_bs: int) -> bool:
        return key in self._by_size.get(padded_bs, ())

    def timings(self, key: str, padded_bs: int) -> dict[str, float | str] | None:
        """The candidates' µs (or errors) recorded for (``key``, ``padded_bs``), or None."""
        t = self._timings.get((key, int(padded_bs)))
        return None if t is None else dict(t)

    def nearest(self, key: str, padded_bs: int) -> Choice | None:
        """The choice recorded for ``key`` at the size nearest ``padded_bs`` (the smaller on a
        tie; exclusions not applied), or None when ``key`` has none. ``plan_size`` times it
        first: a neighbouring size's winner usually wins again."""
        sizes = [bs for bs, table in self._by_size.items() if key in table]
        if not sizes:
            return None
        return self._by_size[min(sizes, key=lambda bs: (abs(bs - padded_bs), bs))][key]

    # -- recording -----------------------------------------------------------------------
    def record(self, key: str, padded_bs: int, choice: Choice,
               timings: dict[str, float | str] | None = None,
               fallback: Choice | None = None) -> None:
        """Store ``choice`` for (``key``, ``padded_bs``) with the candidates' ``timings``
        (µs, or an error string for a candidate that failed) and the fastest candidate of
        another kernel (``fallback``, read instead while ``choice.kernel`` is excluded)."""
        self._by_size.setdefault(int(padded_bs), {})[key] = choice
        if fallback is not None:
            self._fallback[(key, int(padded_bs))] = fallback
        if timings is not None:
            self._timings[(key, int(padded_bs))] = dict(timings)

    def summary(self) -> str:
        """One line: how often each kernel was picked over the (shape, size) entries, most
        picked first, e.g. ``swap 20, deepgemm 10, triton 8 of 38 (shape, size) entries``."""
        picks = Counter(c.kernel for table in self._by_size.values() for c in table.values())
        if not picks:
            return "no (shape, size) entry yet"
        return (", ".join(f"{k} {n}" for k, n in picks.most_common())
                + f" of {picks.total()} (shape, size) entries")

    # -- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict:
        """The table as JSON-ready data (see the module docstring)."""
        plan: dict[str, dict[str, dict]] = {}
        for bs in sorted(self._by_size):
            for key, c in sorted(self._by_size[bs].items()):
                entry = {k: v for k, v in asdict(c).items() if v is not None}
                if (key, bs) in self._timings:
                    entry["candidates"] = self._timings[(key, bs)]
                plan.setdefault(key, {})[str(bs)] = entry
        return {"version": PLAN_VERSION, "plan": plan}

    @classmethod
    def load(cls, path: str) -> ExpertPlan:
        """Read a table written by ``save`` (or a JSON holding ``{"expert_plan": table}``);
        ``InputError`` for a file that is no JSON object or no such table."""
        try:
            with open(path) as f:
                data = json.load(f)
        except (ValueError, RecursionError) as exc:
            raise InputError(f"expert plan {path!r}: expected a JSON table written by "
                             f"ExpertPlan.save, got unreadable JSON ({exc})") from None
        if not isinstance(data, dict):
            raise InputError(f"expert plan {path!r}: expected a JSON object, got "
                             f"{type(data).__name__}")
        table = data.get("expert_plan", data)
        if not isinstance(table, dict) or not table:   # ({} or null loaded as an empty plan)
            raise InputError(f"expert plan {path!r}: expected a table written by "
                             f"ExpertPlan.save ({{'version': {PLAN_VERSION}, 'plan': ...}}), "
                             f"got {table!r:.60}")
        return cls(table)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    def _load(self, table: dict) -> None:
        if not isinstance(table, dict):
            raise InputError(f"expert plan: expected {{'version': {PLAN_VERSION}, 'plan': "
                             f"{{key: {{padded_bs: choice}}}}}}, got {type(table).__name__}")
        if table.get("version") != PLAN_VERSION or not isinstance(table.get("plan"), dict):
            raise InputError(f"expert plan: expected {{'version': {PLAN_VERSION}, 'plan': "
                             f"{{key: {{padded_bs: choice}}}}}}, got keys {sorted(table)}")
        for key, sizes in table["plan"].items():
            if not isinstance(sizes, dict):
                raise InputError(f"expert plan entry {key!r}: expected {{padded_bs: choice}}, "
                                 f"got {type(sizes).__name__}")
            for bs, entry in sizes.items():
                try:
                    size = int(bs)
                    us, candidates = entry.get("us"), entry.get("candidates")
                    # as written (Choice checks the ints: int() made 16.9 a 16, true a 1)
                    c = Choice(entry["kernel"], entry.get("block_n", 32),
                               entry.get("split_k", 1), us, entry.get("num_warps", 4))
                    if not (us is None or _number(us)):
                        raise InputError(f"'us' must be a number of µs or null, got {us!r:.40}")
                    if candidates is not None and not (isinstance(candidates, dict) and all(
                            isinstance(k, str) and (_number(v) or isinstance(v, str))
                            for k, v in candidates.items())):
                        raise InputError("'candidates' must map each candidate's name to its "
                                         f"µs or an error string, got {candidates!r:.60}")
                except InputError as exc:
                    raise InputError(f"expert plan entry {key!r} at batch {bs!r}: {exc}") from None
                except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as exc:
                    raise InputError(
                        f"expert plan entry {key!r} at batch {bs!r}: expected an int batch and "
                        f"{{'kernel': one of {KERNELS}, 'block_n': int, 'split_k': int, "
                        f"'num_warps': int}}, got {entry!r:.120} ({type(exc).__name__}: {exc})"
                    ) from None
                self.record(key, size, c, candidates)


def _number(v) -> bool:
    """A JSON number (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ----------------------------------------------------------------------- measurement (CUDA)
SAMPLE_US = 400.0  # a timing sample replays the graph until it lasts about this long


def replays_for(one_replay_us: float, replays: int) -> int:
    """Back-to-back replays a timing sample takes: enough for ``SAMPLE_US`` of device time,
    at least 1 and at most ``replays``. A graph of large GEMMs (dsv3-like W13 at 256 rows:
    about 4 ms for its 4 calls) needs one, where a fixed 5 spent most of the demo's capture
    timing candidates (BENCHMARKS.md §52). Pure Python."""
    if not one_replay_us > 0:
        return replays
    return max(1, math.ceil(min(replays, SAMPLE_US / one_replay_us)))


def _graph_us(fns, samples: int = 7, replays: int = 5, give_up_us: float | None = None) -> float:
    """Device µs per call: the calls ``fns`` captured back to back in one CUDA graph (after an
    eager warm-up, which also compiles); median over ``samples`` of back-to-back replays
    (``replays_for`` a probe replay's time: up to ``replays``), divided by the calls. When
    the probe already exceeds ``give_up_us`` per call, that probe is returned unsampled (a
    candidate far behind the best so far, ``choose_timed``). Captured on a side stream
    without ``torch.cuda.graph``'s gc/empty_cache on entry."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            for fn in fns:
                fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)

    def sample(n: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / n
    graph.replay()  # the first replay uploads the graph: not timed
    probe = sample(1)
    if give_up_us is not None and probe / len(fns) > give_up_us:
        return probe / len(fns)
    n = replays_for(probe, replays)
    return statistics.median(sample(n) for _ in range(samples)) / len(fns)


NEAR_TIE = 0.03  # candidates within this fraction of the first round's best are timed again
RETIMES = 4  # the near-tied candidates' extra rounds, interleaved; each one's median decides
GIVE_UP = 1.5  # a first-round candidate this much slower than the best so far is not sampled
NEAREST_FIRST = True  # plan_size times the nearest measured size's winner first


def choose_timed(cands: list[Choice], time_one, on_error=None) -> tuple[list, dict]:
    """Time every candidate once (``time_one(c, give_up_us)`` -> µs), then the ones within
    ``NEAR_TIE`` of the best ``RETIMES`` more times, interleaved, so a near-tie is decided by
    medians rather than one sample's noise (a single timing once chose a W13 kernel that made
    the step 1.2x slower, BENCHMARKS.md §27). In the first round ``give_up_us`` is ``GIVE_UP``
    times the best so far (None for the first candidate and the retimes): ``time_one`` may
    then return one probe's time instead of a median (``_graph_us``), so a candidate far
    behind costs one replay; put the likely winner first. Returns ``(timed, timings)``:
    ``(median µs, candidate)`` of those that ran, and ``{name: median µs rounded, or the
    error}`` in candidate order. A candidate that raises is recorded with its error
    (``on_error()`` runs first) and never chosen. Host-only."""
    samples: dict[str, list[float]] = {}
    errors: dict[str, str] = {}

    def sample(c: Choice, give_up_us: float | None = None) -> None:
        try:
            samples.setdefault(c.name, []).append(time_one(c, give_up_us))
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is skipped
            if on_error is not None:
                on_error()
            samples.pop(c.name, None)
            errors[c.name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    for c in cands:
        firsts = [v[0] for v in samples.values()]
        sample(c, min(firsts) * GIVE_UP if firsts else None)
    if samples:
        best = min(v[0] for v in samples.values())
        near = [c for c in cands
                if c.name in samples and samples[c.name][0] <= best * (1 + NEAR_TIE)]
        if len(near) > 1:
            for _ in range(RETIMES):
                for c in near:
                    if c.name in samples:
                        sample(c)
    timed = [(statistics.median(samples[c.name]), c) for c in cands if c.name in samples]
    timings = {c.name: round(statistics.median(samples[c.name]), 2) if c.name in samples
               else errors[c.name] for c in cands if c.name in samples or c.name in errors}
    return timed, timings


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (132 on an H200); 132 elsewhere."""
    if device.type != "cuda":
        return 132
    from graphrt.kernels._util import cuda_index, sm_count
    return sm_count(cuda_index(device))


def _measured(us: float, c: Choice) -> Choice:
    """``c`` with its measured µs."""
    return Choice(c.kernel, c.block_n, c.split_k, round(us, 2), c.num_warps)


UNROTATED_L2 = 8  # a call reading this many L2 sizes of weights is timed without rotations


def rotations_for(weight_bytes: int, l2_bytes: int, rotations: int) -> int:
    """Calls of different expert rotations a timing graph holds (``plan_size``): ``rotations``,
    so that no call finds the previous one's weights in L2, or 1 where one call streams at
    least ``UNROTATED_L2`` times the L2 (at most an eighth of a call's weights can still be
    in L2 when its next replay starts). dsv3-like W13 at batch 1: 8 experts x 4096 x 7168
    bf16 = 470 MB against 50 MB; those graphs of 4 large GEMMs took most of the plan's time
    (BENCHMARKS.md §53). Pure Python."""
    return 1 if weight_bytes >= UNROTATED_L2 * l2_bytes else rotations


@contextlib.contextmanager
def exhaustive_timing():
    """Within it, ``plan_size`` times as it did before its shortcuts (the reference
    ``graphrt.bench.plan_check`` compares them with): every candidate ``samples`` samples of
    ``replays`` replays, none given up (``GIVE_UP``), in listed order (``NEAREST_FIRST``),
    every graph of ``rotations`` calls (``UNROTATED_L2``). Sets module settings: one plan at
    a time in a process. Host-only."""
    global GIVE_UP, SAMPLE_US, UNROTATED_L2, NEAREST_FIRST
    saved = GIVE_UP, SAMPLE_US, UNROTATED_L2, NEAREST_FIRST
    GIVE_UP, SAMPLE_US, UNROTATED_L2, NEAREST_FIRST = math.inf, math.inf, math.inf, False
    try:
        yield
    finally:
        GIVE_UP, SAMPLE_US, UNROTATED_L2, NEAREST_FIRST = saved


def _timed_call(experts, which: str, cap: int, expected_m: int, padded_bs: int):
    """``call(choice, masked_m)``: one call of a candidate of ``which`` as ``plan_size`` times
    it, on operands ``experts.synthetic_io`` fills now. Where W13 may carry the activation as
    its epilogue (``Experts.act_in_w13``), every W13 candidate runs with the activation, as
    the step runs it (``Experts.w13_act``): fused for the kernels that take it
    (``Experts.takes_epilogue``), a launch after the others. Host-only (launches fills)."""
    a, a_scale, out = experts.synthetic_io(which, cap)
    if which == "w13" and experts.act_in_w13(padded_bs):
        act_out = experts.ws.view("a", (experts.E, cap, out.shape[-1] // 2))
        return lambda c, m: experts.w13_act(a, m, expected_m, out, act_out, c, padded_bs)
    return lambda c, m: experts.gemm(which, a, m, expected_m, out, c, a_scale)


def _compile_candidates(shapes: dict, make_call, masked_m) -> tuple[int, int, float]:
    """Build every Triton candidate of ``shapes`` (``plan_size``'s; ``make_call(which)`` as
    ``_timed_call``) on a thread pool before
    any is timed (``kernels.compile_ahead``: each candidate's call once, its launches
    compile-only), so that a fresh machine's builds overlap instead of running one after
    another inside the timing. DeepGEMM's candidates are not Triton kernels: their JIT runs
    at their first timing. A candidate that fails here fails again when timed, where the plan
    records it. Returns ``(builds submitted, builds failed, seconds)``. Host-only."""
    from graphrt.kernels.compile_ahead import compile_ahead
    t0 = time.perf_counter()
    with compile_ahead() as ahead:
        for which, (_key, cands, _calls) in shapes.items():
            call = make_call(which) if ahead.enabled else None
            for c in cands:
                if c.kernel != "deepgemm":
                    ahead.run(call, c, masked_m)
    return ahead.submitted, ahead.failed, time.perf_counter() - t0


def plan_size(plan: ExpertPlan, experts, padded_bs: int, *, cap: int, num_topk: int,
              num_experts: int, num_ranks: int = 1, rotations: int = 4) -> None:
    """Fill ``plan`` for ``padded_bs`` with the fastest kernel of each of ``experts``' GEMMs
    (``experts.gemm_shapes()``), timed on a synthetic routing (``routed_rows``) in the
    experts' own workspace (W13 with its activation where ``experts.act_in_w13(padded_bs)``:
    the step then runs one or the other, see ``Experts.w13_act``; near-ties timed again and
    far-behind candidates given up after one replay, ``choose_timed``; the nearest measured
    size's winner first, ``ExpertPlan.nearest``; ``rotations`` expert rotations a graph,
    ``rotations_for``; every Triton candidate built first, on a thread pool,
    ``_compile_candidates``, its figures in ``plan.compiled_ahead``); shapes already in the
    plan are skipped. On a CPU device the decode
    kernel is recorded without timing. A candidate that fails (e.g. does not compile) is
    recorded with its error and never chosen. Host-only: synchronizes the device."""
    from graphrt.kernels.dispatch import expected_m as expected_m_of
    todo = {w: s for w, s in experts.gemm_shapes().items() if not plan.has(s[0], padded_bs)}
    if not todo:
        return
    E = experts.E
    rows = routed_rows(padded_bs, num_topk, num_experts, E, num_ranks)
    device = experts.device
    if device.type != "cuda":
        for key, n, _ in todo.values():
            plan.record(key, padded_bs, default_choice(n, len(rows)))
        return
    if torch.cuda.is_current_stream_capturing():
        raise BackendError(f"expert plan for batch {padded_bs}: measuring needs the device "
                           "synchronized, but a stream is capturing; call the model's "
                           "prepare(padded_bs) before capture (graphrt does, via before_replay)")
    em = expected_m_of(padded_bs, num_topk, E, cap=cap)
    masked = [synthetic_masked_m(rows, E, r * max(1, E // (len(rows) * rotations))).to(device)
              for r in range(rotations)]
    from graphrt.kernels._util import cuda_index, l2_bytes as l2_of
    l2_bytes = l2_of(cuda_index(device))
    torch.cuda.synchronize(device)
    shapes = {}  # which -> (key, candidates, the routings a timing graph calls)
    for which, (key, n, k) in todo.items():
        weight_bytes = len(rows) * n * k * (1 if experts.fp8 else 2)
        cands = plan_candidates(experts.kernels, n, k, rows, num_sms(device), experts.fp8)
        near = plan.nearest(key, padded_bs) if NEAREST_FIRST else None  # sets the give-up
        cands.sort(key=lambda c: near is None or c.name != near.name)
        shapes[which] = (key, cands, masked[:rotations_for(weight_bytes, l2_bytes, rotations)])
    make_call = functools.partial(_timed_call, experts, cap=cap, expected_m=em,
                                  padded_bs=padded_bs)
    plan.compiled_ahead[padded_bs] = _compile_candidates(shapes, make_call, masked[0])
    for which, (key, cands, calls) in shapes.items():
        call = make_call(which)  # operands filled again: the other shape's timing may write them

        def time_one(c: Choice, give_up_us: float | None) -> float:
            return _graph_us([functools.partial(call, c, m) for m in calls],
                             give_up_us=give_up_us)
        timed, timings = choose_timed(cands, time_one,
                                      on_error=lambda: torch.cuda.synchronize(device))
        if not timed:
            raise BackendError(f"expert plan for {key} at batch {padded_bs}: every candidate "
                               f"failed: {timings}")
        best = min(timed, key=lambda t: t[0])
        others = [t for t in timed if t[1].kernel != best[1].kernel]  # the fallback's pool
        plan.record(key, padded_bs, _measured(*best), timings,
                    fallback=_measured(*min(others, key=lambda t: t[0])) if others else None)
    torch.cuda.synchronize(device)
