"""How a bulk read slows a latency-bound kernel beside it: a dependent load chain's hop latency
while a read with a given number of bytes in flight runs on the other SMs' share of HBM.

    python -m graphrt.bench.contention --out bench-out/contention.json

A decode step at one row alternates weight reads (GEMVs, expert GEMMs) with kernels that read
almost nothing but wait on chains of dependent loads (attention, top-k, dispatch, combine).
Overlapping the two, by loading a kernel's weights while the one before it runs, looks free:
HBM is idle during the chain. In the step it was not (BENCHMARKS.md §34): a one-row
o-projection that loaded its 16 MiB before its PDL wait saved ~3 µs a layer and made the
attention kernel beside it ~3 µs slower. This measures the memory-system part of that in
isolation:

- **flood**: ``programs_per_sm`` programs an SM, each reading its slice of a buffer in
  rounds, one round in flight at a time (a round's loads are masked by a test on the sum
  of the rounds before, which no compiler may fold), ``depth_kb`` KB an SM in flight in
  all, 8 passes over 1 GiB; GB/s from CUDA events;
- **chase**: one program (one warp) walking a random cycle of 128-byte-apart int32 ids,
  ``hops`` dependent loads, timed by ``%globaltimer`` inside the kernel: over a 512 MiB
  cycle (every hop from HBM) and over a 4 MiB one warmed first (every hop an L2 hit).

The chase runs on a second stream, launched just after the flood, and its window is checked
to lie inside the flood's (``inside``). Rows: no flood, then each in-flight depth. Reading:
where the flood's bandwidth stops growing with depth while the chase's hops keep getting
slower, the extra bytes in flight only queue. On an H200 (§34) full bandwidth comes at
~32 KB an SM; below it an HBM hop slows by at most 1.2x (an L2 hit by 1.4x), at and above
it by 1.3-2.6x (1.3-3.7x). The step's loss was
larger than this predicts: the preload in 8 fenced rounds (~16 KB an SM) cost the attention
kernel as much as one round of 128 KB, so being resident beside it costs more than queueing.

Prints a markdown table; writes JSON to ``--out`` (and the table beside it, ``.md``). GPU
only (``%globaltimer`` is inline PTX).

Tooling: synchronizes the device; nothing here runs inside a step.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

from graphrt.bench.output import int_list, save_doc
from graphrt.errors import InputError

SCHEMA = "graphrt.bench.contention/1"
DEPTHS_KB = (4, 16, 32, 64, 128)  # KB in flight an SM (o-proj preload: 128 KB an SM)
_LINE = 32  # int32 ids a 128-byte line: one chase id a line
MAX_ROUND = 16384  # fp32 a flood program reads a round (64 KB: 128 a thread at 4 warps)


def round_elems(depth_kb: int, programs_per_sm: int) -> int:
    """fp32 elements one flood program reads a round for ``depth_kb`` KB in flight an SM:
    ``depth_kb * 256 / programs_per_sm``, which must be a power of two from 32 (a Triton
    block) to ``MAX_ROUND`` (what 4 warps hold in registers); ValueError saying so
    otherwise. Host-only."""
    elems, rest = divmod(depth_kb * 256, max(programs_per_sm, 1))
    if programs_per_sm < 1 or rest or not 32 <= elems <= MAX_ROUND or elems & (elems - 1):
        raise InputError(f"--depths: expected KB an SM that give each of the {programs_per_sm} "
                         f"programs an SM a power-of-two round of 32 to {MAX_ROUND} fp32 "
                         f"(depth x 256 / programs; more programs an SM for deeper floods), "
                         f"got {depth_kb}")
    return elems


@functools.cache
def _kernels():
    """The chase and flood kernels, built on first use (``import triton`` only here)."""
    import triton
    import triton.language as tl

    from graphrt.bench.timing import globaltimer_jit
    globaltimer = globaltimer_jit()

    @triton.jit
    def chase_kernel(next_ptr, t_ptr, hops, start):
        i = start
        t0 = globaltimer()
        for _ in range(hops):
            i = tl.load(next_ptr + i)
        t1 = globaltimer()
        tl.store(t_ptr, t0)
        tl.store(t_ptr + 1, t1)
        tl.store(t_ptr + 2, i.to(tl.int64))  # keeps the chain

    @triton.jit
    def flood_kernel(src_ptr, sink_ptr, t_ptr, rounds, slice_elems, CHUNK: tl.constexpr):
        pid = tl.program_id(0)
        if pid == 0:
            tl.store(t_ptr, globaltimer())
        offs = tl.arange(0, CHUNK)
        base = pid.to(tl.int64) * slice_elems
        acc = tl.zeros((CHUNK,), dtype=tl.float32)
        for r in range(rounds):
            # a round's loads wait for the last round's data (acc == acc: no compiler may
            # fold it, NaN is possible), so one round is in flight at a time; evict_first
            # keeps the streamed lines from pushing the L2 chase's out
            v = tl.load(src_ptr + base + (r * CHUNK) % slice_elems + offs, mask=acc == acc,
                        other=0.0, eviction_policy="evict_first")
            acc += v
        tl.store(sink_ptr + pid * CHUNK + offs, acc)
        tl.debug_barrier()
        tl.atomic_max(t_ptr + 1, globaltimer())

    return chase_kernel, flood_kernel


def chase_cycle(lines: int, dev: torch.device, seed: int = 0) -> torch.Tensor:
    """int32 ``[lines * 32]``: entry ``32 * p[j]`` holds ``32 * p[j + 1]`` (a random cycle over
    ``lines`` 128-byte lines, ``p`` a permutation), the rest zero."""
    g = torch.Generator(device=dev).manual_seed(seed)
    p = torch.randperm(lines, generator=g, device=dev, dtype=torch.int64) * _LINE
    nxt = torch.zeros(lines * _LINE, dtype=torch.int32, device=dev)
    nxt[p] = torch.roll(p, -1).to(torch.int32)
    return nxt


def _chase(nxt: torch.Tensor, hops: int, t: torch.Tensor, start: int = 0, stream=None):
    """``hops`` dependent loads along ``nxt`` from id ``start``: ``t`` (int64 [3], allocated
    by the caller before any other stream's work, so no later fill overwrites it) gets the
    start and end ``%globaltimer`` and the id reached."""
    chase, _ = _kernels()
    with torch.cuda.stream(stream or torch.cuda.current_stream(nxt.device)):
        chase[(1,)](nxt, t, hops, start, num_warps=1)


def measure(dev: torch.device, *, depth_kb: int | None, programs_per_sm: int, hops: int,
            src: torch.Tensor, cycles: dict, reps: int,
            resume: dict, passes: int = 8) -> dict:
    """One row: with a flood of ``depth_kb`` KB in flight an SM (None: no flood; ``passes``
    reads of ``src``) beside each chase of ``cycles`` (name -> cycle), ``reps`` times; an
    HBM cycle's chase starts where its last one ended (``resume``: name -> id, updated), so
    it never reads a line an earlier chase left in L2:
    ``{"depth_kb", "in_flight_mib", "flood_gbs", name + "_ns": ns a hop, "inside": every
    chase inside its flood's window}``, medians."""
    from graphrt.kernels._util import cuda_index, sm_count
    _, flood = _kernels()
    programs = sm_count(cuda_index(dev)) * programs_per_sm
    row = {"depth_kb": depth_kb, "in_flight_mib": None, "flood_gbs": None, "inside": True}
    if depth_kb is not None:
        chunk = round_elems(depth_kb, programs_per_sm)  # fp32 a round a program
        slice_elems = src.numel() // programs // chunk * chunk
        rounds = passes * slice_elems // chunk
        row["in_flight_mib"] = round(programs * chunk * 4 / 2**20, 2)
        sink = torch.empty(programs * chunk, device=dev)  # each program's sum, kept
    side = torch.cuda.Stream(dev)
    gbs, ns = [], {name: [] for name in cycles}
    for _ in range(reps):
        for name, nxt in cycles.items():
            t = torch.zeros(3, dtype=torch.int64, device=dev)
            tf = torch.zeros(2, dtype=torch.int64, device=dev)
            if name.startswith("l2"):  # warm: every line of the cycle into L2; start at 0
                _chase(nxt, nxt.numel() // _LINE, torch.zeros_like(t))
                start_id = 0
            else:  # where the last chase of this cycle ended: lines no chase has read yet
                start_id = resume.get(name, 0)
            torch.cuda.synchronize(dev)  # the chase's stream then needs no wait
            if depth_kb is not None:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                flood[(programs,)](src, sink, tf, rounds, slice_elems, CHUNK=chunk,
                                   num_warps=4, num_stages=1)
                end.record()
            _chase(nxt, hops, t, start_id, side)
            torch.cuda.synchronize(dev)
            t0, t1 = t[0].item(), t[1].item()
            resume[name] = t[2].item()
            ns[name].append((t1 - t0) / hops)
            if depth_kb is not None:
                gbs.append(programs * rounds * chunk * 4 / (start.elapsed_time(end) * 1e-3) / 1e9)
                row["inside"] &= bool(tf[0].item() <= t0 and t1 <= tf[1].item())
    if gbs:
        row["flood_gbs"] = round(statistics.median(gbs), 1)
    for name, v in ns.items():
        row[f"{name}_ns"] = round(statistics.median(v), 1)
    return row


def bench(dev: torch.device, *, depths_kb: list[int], programs_per_sm: int = 4,
          hops: int = 200, reps: int = 5, log=print) -> dict:
    """``{"schema", "device", "hbm_gbs", "programs_per_sm", "hops", "results": [rows]}``:
    the no-flood row first, then one per depth (``measure``)."""
    from graphrt.bench.timing import hbm_bandwidth_gbs
    hbm = hbm_bandwidth_gbs(dev)
    cycles = {"hbm_chase": chase_cycle((512 << 20) // 128, dev),
              "l2_chase": chase_cycle((4 << 20) // 128, dev, seed=1)}
    src = torch.rand((1 << 30) // 4, device=dev)  # 1 GiB of fp32 in [0, 1)
    doc = {"schema": SCHEMA, "device": torch.cuda.get_device_name(dev), "hbm_gbs": round(hbm, 1),
           "programs_per_sm": programs_per_sm, "hops": hops, "results": []}
    resume = {}
    for depth in [None, *depths_kb]:
        row = measure(dev, depth_kb=depth, programs_per_sm=programs_per_sm, hops=hops, src=src,
                      cycles=cycles, reps=reps, resume=resume)
        doc["results"].append(row)
        log(_row(row, doc))
    return doc


HEADER = ("| KB in flight an SM | MiB in flight | flood GB/s | flood / 4 GB copy | "
          "HBM chase ns a hop | L2 chase ns a hop | chases inside the flood |\n"
          "|---|---|---|---|---|---|---|")


def _row(r: dict, doc: dict) -> str:
    if r["depth_kb"] is None:
        return (f"| no flood | 0 | — | — | {r['hbm_chase_ns']} | {r['l2_chase_ns']} | — |")
    frac = r["flood_gbs"] / doc["hbm_gbs"]
    return (f"| {r['depth_kb']} | {r['in_flight_mib']} | {r['flood_gbs']:.0f} | {frac:.0%} | "
            f"{r['hbm_chase_ns']} | {r['l2_chase_ns']} | {'yes' if r['inside'] else 'NO'} |")


def markdown(doc: dict) -> str:
    """The results as a markdown table under a line naming the device and the setup."""
    head = (f"Device {doc['device']}, 4 GB copy bandwidth {doc['hbm_gbs']:.0f} GB/s; flood of "
            f"{doc['programs_per_sm']} programs an SM (one round in flight each), chase of "
            f"{doc['hops']} dependent hops on a second stream; medians.\n\n")
    return head + "\n".join([HEADER] + [_row(r, doc) for r in doc["results"]]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphrt.bench.contention",
                                description=__doc__.split("\n")[0])
    p.add_argument("--depths", default=",".join(map(str, DEPTHS_KB)),
                   help="KB in flight an SM, comma-separated (each >= 1)")
    p.add_argument("--programs-per-sm", type=int, default=4, help="flood programs an SM (>= 1)")
    p.add_argument("--hops", type=int, default=200, help="dependent loads a chase (>= 1)")
    p.add_argument("--reps", type=int, default=5, help="runs a row, medians (>= 1)")
    p.add_argument("--out", required=True, help="JSON results path (the table goes to .md beside it)")
    a = p.parse_args(argv)
    try:
        depths = int_list(a.depths)
    except ValueError:
        depths = [0]
    why = (f"--depths needs comma-separated KB >= 1, got {a.depths!r}"
           if any(d < 1 for d in depths) or not depths else
           f"--programs-per-sm needs >= 1, got {a.programs_per_sm}" if a.programs_per_sm < 1 else
           f"--hops needs >= 1, got {a.hops}" if a.hops < 1 else
           f"--reps needs >= 1, got {a.reps}" if a.reps < 1 else None)
    for d in depths if why is None else []:
        try:
            round_elems(d, a.programs_per_sm)
        except ValueError as e:
            why = str(e)
            break
    if why is None and not torch.cuda.is_available():
        why = "needs a CUDA GPU"
    if why:
        print(f"graphrt.bench.contention: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(HEADER, flush=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    doc = bench(dev, depths_kb=depths, programs_per_sm=a.programs_per_sm, hops=a.hops,
                reps=a.reps, log=lambda s: print(s, flush=True))
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    save_doc(a.out, doc, markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
