"""Replay-vs-eager verification of a captured ``GraphRuntime`` (``rt.check_replay()``).

Per captured size, on fresh random inputs with NaN-poisoned outputs: padding is inert,
graph equals eager on the same padded buffers bitwise, the step leaves its padded inputs
alone, and the live rows match eager on the unpadded batch within a per-row tolerance.

"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphrt.errors import GraphrtError, ReplayMismatch, check_int
from graphrt.outputs import OutputLayout
from graphrt.spec import sentinel
from graphrt.state import StateGuard


@dataclass(frozen=True)
class ReplayCheck:
    """One comparison made by ``check_replay``; ``ok`` False means a mismatch."""

    size: int
    n: int
    output: Any
    what: str  # padding-inert | graph-vs-eager | inputs-untouched | live-rows-vs-unpadded-eager
    #            | state-graph-vs-eager
    max_abs_err: float
    ok: bool

    def __str__(self):
        status = "ok" if self.ok else "MISMATCH"
        return (f"batch {self.size} (live {self.n}), output {self.output!r}, {self.what}: "
                f"max |diff| {self.max_abs_err:.3g} {status}")


def check_replay(rt, *, trials: int = 2, rtol: float | None = None,
                 max_off_rows: float = 0.05, seed: int = 1234,
                 raise_on_mismatch: bool = True) -> list[ReplayCheck]:
    """Replay every captured size on fresh random inputs and compare with eager.

    Per size and trial, ``n`` live rows (the full size on the first trial, a random ``n``
    in ``(previous size, size]`` after), outputs NaN-poisoned before every replay:

    0. ``inputs-staged``: staged as ``run()`` stages them (through the graph's staging
       table or nodes where it has them), the static inputs' live rows hold the inputs;
       ``outputs-written``: two replays of the same inputs, outputs poisoned with two
       different values (NaN then the largest value for floats, the smallest then the
       largest for integers, True then False), give bitwise-equal live rows: the graph
       writes every live row of every output;
    1. ``padding-inert`` (trials with padded rows): a replay with pad rows at ``pad_value``
       and one with pad rows poisoned (NaN for floats, random valid values otherwise; an
       integer input whose ``pad_value`` lies outside ``[low, high)`` keeps that sentinel) give
       bitwise-equal live rows (on these trials a ``unique`` input whose ``pad_value`` is
       one of its valid values has a live row at that value: a padded row that writes by it
       lands on that live row, unlike poisoned padding (free values));
    2. ``graph-vs-eager``: that replay equals eager execution on the same padded buffers,
       bitwise (a graph replays the same kernels on the same data);
    3. ``inputs-untouched``: the step left its padded input rows at their padding;
    4. ``live-rows-vs-unpadded-eager``: eager on the live rows alone (a different batch
       size, so cuBLAS may pick other GEMM kernels): integer outputs equal; floating rows
       within relative error ``rtol`` (2e-2 bf16/fp16, 1e-4 fp32) except at most
       ``max_off_rows`` of the rows (an MoE router may flip a near-tie expert choice when a
       different GEMM kernel changes the last bit; those rows are counted, not hidden).

    5. ``state-graph-vs-eager``: the declared ``spec.state`` after the replay equals the
       state after the eager run, bitwise.

    Every run starts from the same declared state (snapshot and restore around each), and
    the state is put back at the end. Equal values (equal infinities, NaN in both) count
    as equal in every comparison. Fixed-shape outputs are compared whole.

    Host-only (synchronises). Returns every check; raises ``ReplayMismatch`` on failures.
    """
    if not rt.graphs:
        raise GraphrtError("check_replay() needs captured graphs: call capture() first")
    trials = check_int("check_replay: trials", trials)  # 0 checked nothing and returned []
    gen = torch.Generator().manual_seed(seed)
    results: list[ReplayCheck] = []
    sizes = sorted(rt.graphs)
    with torch.inference_mode(), StateGuard(rt.spec) as state:
        for i, size in enumerate(sizes):
            lo = sizes[i - 1] + 1 if i else 1
            hi = size - 1 if lo < size else size  # later trials have padding whenever one can
            for t in range(trials):
                n = size if t == 0 else int(torch.randint(lo, hi + 1, (1,), generator=gen))
                inputs = rt.spec.random_inputs(n, rt.device, gen)
                if n < size and rt.spec.example_inputs is None:
                    _live_row_holds_the_pad(rt.spec, inputs)
                results += _check_one(rt, rt.graphs[size], inputs, n, gen, rtol, max_off_rows, state)
    bad = [r for r in results if not r.ok]
    if bad and raise_on_mismatch:
        raise ReplayMismatch(bad)
    return results


def _live_row_holds_the_pad(spec, inputs: dict) -> None:
    """A ``unique`` input (KV slots) whose ``pad_value`` is one of its valid values: one live
    row takes that value, as a live request may own it. A padded row that writes by it (a
    KV-cache append) then lands on a live row's slot, and the replay differs from eager; with
    draws that avoid it the collision went unseen (``run()`` pads with ``pad_value``)."""
    for k, inp in spec.inputs.items():
        t = inputs[k]
        if inp.unique and not sentinel(inp) and t.numel() \
                and not bool((t == inp.pad_value).any()):
            t[0] = inp.pad_value                  # distinct still: no live row held it


def _replay_poisoned_outputs(rt, g, n, which: int = 0) -> list[torch.Tensor]:
    for o in g.outputs:
        _poison(o, which)
    rt._launch(g, n)
    return [o.clone() for o in g.signature.live(g.outputs, n)]


def _eager(rt, g, inputs, live_n: int, padded_bs: int) -> list[torch.Tensor]:
    """The step eagerly on ``inputs`` (``padded_bs`` rows, ``live_n`` live), outputs as a
    replay hands them back."""
    if rt.spec.before_replay is not None:
        rt.spec.before_replay(padded_bs, live_n)
    flat = OutputLayout.flatten(rt.spec.call(inputs, rt.spec.live_count_tensor(live_n, rt.device)),
                                rt.spec.name)[1]
    # copies: an output may be a state tensor itself, which the next restore rewrites
    return [t.clone() for t in g.signature.live(flat, live_n)]


def _check_one(rt, g, inputs, n, gen, rtol, max_off_rows, state) -> list[ReplayCheck]:
    """One size and live batch; every run starts from the same declared state."""
    st, size, out = rt.stager, g.size, []
    state.restore()
    st.stage(inputs, n, size, eager=False)  # as run() stages (the table, at the replay)
    clean = _replay_poisoned_outputs(rt, g, n)
    live = st.live_views(n)
    wrong = [k for k, t in inputs.items() if not bool(same_values(live[k], t).all())]
    out.append(ReplayCheck(size, n, ",".join(wrong) or "-", "inputs-staged", 0.0, not wrong))
    dirty = st.pad_rows_intact(n, size)
    out.append(ReplayCheck(size, n, ",".join(dirty) or "-", "inputs-untouched", 0.0, not dirty))
    state.restore()
    st.stage(inputs, n, size)
    other = _replay_poisoned_outputs(rt, g, n, 1)
    state.restore()
    st.stage(inputs, n, size)
    st.poison(n, size, gen)
    poisoned = _replay_poisoned_outputs(rt, g, n)
    after_graph = state.current()
    state.restore()
    same = _eager(rt, g, st.views(size), n, size)
    state_errs = [_max_err(a, b) for a, b in zip(after_graph, state.tensors)]
    del after_graph
    state.restore()
    unpadded = _eager(rt, g, inputs, n, n)
    for i, (key, c, w, p, e, u) in enumerate(zip(g.layout.names, clean, other, poisoned, same,
                                                 unpadded)):
        err = _max_err(w, c)
        out.append(ReplayCheck(size, n, key, "outputs-written", err, err == 0.0))
        if n < size:
            err = _max_err(p, c)
            out.append(ReplayCheck(size, n, key, "padding-inert", err, err == 0.0))
        err = _max_err(p, e)
        out.append(ReplayCheck(size, n, key, "graph-vs-eager", err, err == 0.0))
        err = _max_err(p, u)
        if p.is_floating_point() or p.is_complex():
            rows = g.signature.rows[i] == "batch"
            pr, ur = (p, u) if rows and p.dim() else (p.reshape(1, -1), u.reshape(1, -1))
            off = _rows_off(pr, ur, _tolerance(p.dtype, rtol))
            ok = off <= int(max_off_rows * pr.shape[0])
            what = f"live-rows-vs-unpadded-eager ({off}/{pr.shape[0]} rows off)"
        else:
            ok, what = bool(torch.equal(p, u)), "live-rows-vs-unpadded-eager"
        out.append(ReplayCheck(size, n, key, what, err, ok))
    for j, err in enumerate(state_errs):
        out.append(ReplayCheck(size, n, f"state[{j}]", "state-graph-vs-eager", err, err == 0.0))
    state.restore()
    st.stage(inputs, n, size)  # leave clean padding behind
    return out


def _poison(t: torch.Tensor, which: int = 0) -> None:
    """Fill ``t`` with poison ``which`` (0 or 1): two values no output is likely to hold
    everywhere, and unequal to each other, so a row the graph leaves unwritten differs."""
    if t.is_floating_point() or t.is_complex():
        big = torch.finfo(t.dtype if t.is_floating_point() else t.real.dtype).max
        t.fill_(float("nan") if which == 0 else big)
    elif t.dtype == torch.bool:
        t.fill_(which == 0)
    else:
        info = torch.iinfo(t.dtype)
        t.fill_(info.min if which == 0 else info.max)


def same_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise "the same value": equal, or NaN in both (so equal infinities, e.g. -inf
    logit masks, and NaN in both count as equal). Bool tensor of the common shape."""
    eq = a == b
    if a.is_floating_point() or a.is_complex():
        eq |= torch.isnan(a) & torch.isnan(b)
    return eq


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference of two tensors, 0 where they hold the same value (see
    ``same_values``); inf when the shapes differ or a non-finite value is not matched."""
    if a.shape != b.shape:
        return float("inf")
    if not (a.is_floating_point() or a.is_complex()):
        return 0.0 if torch.equal(a, b) else float((a.long() - b.long()).abs().max())
    same = same_values(a, b)
    if bool(same.all()):
        return 0.0
    d = (_wide(a) - _wide(b)).abs()
    d = torch.where(same, torch.zeros_like(d), torch.nan_to_num(d, nan=float("inf"), posinf=float("inf")))
    return float(d.max())


def row_rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row relative error ``||a_i - b_i|| / ||b_i||`` of two ``[rows, ...]`` floating
    tensors, in their dtype: ``[rows]``. Entries holding the same value (``same_values``:
    equal infinities, NaN in both) count as equal and the norms use the finite entries;
    a row with a non-finite entry the other side does not share is ``inf``. Host-only
    helper for checks."""
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    same = same_values(a, b)
    finite = torch.isfinite(a) & torch.isfinite(b)
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    diff = torch.where(same | ~finite, zero, a - b)
    ref = torch.where(finite, b, zero)
    rel = diff.norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
    unmatched = (~same & ~finite).any(dim=1)
    return torch.where(unmatched, torch.full_like(rel, float("inf")), rel)


def _rows_off(a: torch.Tensor, b: torch.Tensor, rtol: float) -> int:
    """Rows whose relative error exceeds ``rtol`` (unmatched non-finite counts as off), in float64."""
    return int((~(row_rel_err(_wide(a), _wide(b)) <= rtol)).sum())


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float64, or complex128 for a complex tensor (``.double()`` drops the imaginary part)."""
    return t.to(torch.complex128) if t.is_complex() else t.double()


def _tolerance(dtype: torch.dtype, rtol) -> float:
    """Relative-norm tolerance of the unpadded comparison: padded and unpadded batches may
    take different GEMM kernels (cuBLAS picks by M), so low precision is not bitwise."""
    if rtol is not None:
        return rtol
    return 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
