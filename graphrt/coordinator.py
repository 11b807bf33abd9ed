"""Cross-rank agreement for expert-parallel replays (host side, over a CPU/gloo group).

Backends whose collectives need the same shapes on every rank (``NCCLComm``) need every
rank to replay the same padded size: ``agree_batch(n)`` returns the largest live batch of
all ranks, and each rank picks its graph from that. DeepEP low-latency ranks pick from
their own live batch and need no agreement.

``check_replay`` (opt-in debug) gathers what every rank is about to run and raises,
naming both ranks and their sizes, when they are incompatible; a rank that never arrives
turns into a timeout error instead of a hang (the gloo group has a timeout).

Graph safety: host-only (a CPU collective per step; never inside a capture).
"""
from __future__ import annotations

from datetime import timedelta

import torch

from graphrt.errors import GraphrtError, InputError, check_seconds


class RankMismatch(GraphrtError):
    """Ranks are about to replay incompatible graphs."""


# timeout_s bounds: gloo counts whole milliseconds (less than 1 ms becomes 0 and every
# collective fails at once) and its deadline in int64 nanoseconds overflows past ~292 years
# (1e10 s timed out at once on CPU); a week is far beyond any step.
_MIN_TIMEOUT_S, _MAX_TIMEOUT_S = 0.001, 7 * 24 * 3600.0
# How long the constructor's group creation waits for the other ranks (torch's default for
# gloo): ranks reach the constructor as far apart as their model loading makes them.
_SETUP_TIMEOUT = timedelta(minutes=30)


# What gloo (RuntimeError) and torch's DistError say when a peer does not arrive or went away.
_PEER_MISSING = ("timed out", "timeout", "connection", "closed by peer", "reset by peer")


def _peer_missing(exc: RuntimeError) -> bool:
    """True when a collective failed because a peer never arrived or left (a timeout, a
    closed connection), not because of its arguments."""
    import torch.distributed as dist
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    msg = str(exc).lower()
    return any(m in msg for m in _PEER_MISSING)


def _new_group(dist, timeout: timedelta):
    """A gloo group whose creation waits ``_SETUP_TIMEOUT`` for the other ranks and whose
    collectives then wait ``timeout``. A torch without ``_set_pg_timeout`` gets the group
    made with ``timeout`` itself (its creation then waits only that long)."""
    from torch.distributed import distributed_c10d
    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return dist.new_group(backend="gloo", timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=max(timeout, _SETUP_TIMEOUT))
    set_timeout(timeout, group)
    return group


class RankCoordinator:
    """Args:
        uniform: every rank must replay the same padded size (the comm's ``uniform_batch``).
        debug_check: gather and compare every rank's choice before each replay.
        timeout_s: how long a CPU collective waits for the other ranks before raising
            (default 60; from 0.001 to 604800, a week): the per-collective timeout of the gloo
            group the coordinator makes. The constructor itself (the group's creation) waits
            up to 30 minutes for the other ranks, so ranks may reach it far apart (one loads
            its weights slower).
        group: a CPU group of your own instead; it keeps its own timeout, so ``timeout_s``
            is refused with it (set it in ``new_group(timeout=...)``). ``rank`` and ``world``
            are this process's rank and the rank count in it (a subgroup's, not WORLD's).

    ``close()`` destroys the group the coordinator made (not one passed in).
    """

    def __init__(self, *, uniform: bool, debug_check: bool = False,
                 timeout_s: float | None = None, group=None):
        import torch.distributed as dist
        if timeout_s is not None:  # before any collective: every rank refuses alike
            check_seconds("RankCoordinator timeout_s", timeout_s, "expected a finite number "
                          "of seconds > 0 (or None for the default 60)")
            if not _MIN_TIMEOUT_S <= timeout_s <= _MAX_TIMEOUT_S:
                raise InputError(f"RankCoordinator timeout_s: expected {_MIN_TIMEOUT_S} to "
                                 f"{_MAX_TIMEOUT_S:.0f} seconds (1 ms to a week), got "
                                 f"{timeout_s!r}: gloo counts whole milliseconds and its deadline "
                                 "overflows for huge values; pass a timeout in that range")
        if not dist.is_initialized():
            raise GraphrtError("RankCoordinator needs torch.distributed initialised on every rank")
        if group is not None and timeout_s is not None:
            raise GraphrtError("RankCoordinator: timeout_s applies to the gloo group it makes; "
                               "the group= you passed keeps its own timeout (set it with "
                               "dist.new_group(..., timeout=...)), so pass one or the other")
        self._dist = dist
        self.uniform, self.debug_check = uniform, debug_check
        self._owns_group = group is None
        self.group = group if group is not None else _new_group(
            dist, timedelta(seconds=60.0 if timeout_s is None else timeout_s))
        # this process's rank and the rank count *in the group* (a subgroup's, not WORLD's)
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.rank < 0:  # torch answers -1 for a group this process is not a member of
            raise InputError(f"RankCoordinator: this process (rank {dist.get_rank()} of WORLD) is "
                             "not a member of the group= it was given; pass the group that holds "
                             "this rank (each rank its own EP group)")
        self._buf = torch.zeros(1, dtype=torch.int64)

    def close(self) -> None:
        """Destroy the gloo group this coordinator made (collective: every rank calls it).
        Idempotent; a group passed in is left to its owner."""
        if self._owns_group and self.group is not None:
            self._dist.destroy_process_group(self.group)
        self.group = None

    def _group(self):
        if self.group is None:  # None would mean the default group: the wrong ranks
            raise GraphrtError("RankCoordinator is closed: make a new one")
        return self.group

    def agree_batch(self, n: int) -> int:
        """The largest live batch over all ranks (``n`` itself for non-uniform backends)."""
        if not self.uniform:
            return n
        group = self._group()
        self._buf[0] = n
        self._dist.all_reduce(self._buf, op=self._dist.ReduceOp.MAX, group=group)
        return int(self._buf[0])

    def check_replay(self, size: int, mode: str) -> None:
        """Raise ``RankMismatch`` if ranks are about to run incompatible steps.

        ``size``: the padded size (or the live batch for an eager step); ``mode``: ``graph``
        or ``eager``. Uniform backends need equal sizes and modes on every rank.
        """
        group = self._group()
        mine = torch.tensor([size, 1 if mode == "graph" else 0], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world)]
        try:
            self._dist.all_gather(everyone, mine, group=group)
        except RuntimeError as exc:
            if not _peer_missing(exc):  # e.g. a gloo argument error: not a missing rank
                raise
            raise RankMismatch(f"rank {self.rank}: not every rank reached this step's replay "
                               f"check ({exc}); a rank skipped a step or hung") from exc
        if not self.uniform:
            return
        for r, t in enumerate(everyone):
            if not torch.equal(t, mine):
                raise RankMismatch(
                    f"rank {self.rank} is about to run a {mode} step of batch {size} but rank {r} "
                    f"a {'graph' if int(t[1]) else 'eager'} step of batch {int(t[0])}; this "
                    "backend needs the same padded size on every rank (use agree_batch)")

    def all_ok(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank."""
        group = self._group()
        self._buf[0] = 1 if ok else 0
        self._dist.all_reduce(self._buf, op=self._dist.ReduceOp.MIN, group=group)
        return bool(int(self._buf[0]))

    def agree_ok(self, ok: bool, what: str) -> None:
        """Raise on every rank if any rank is not ok (e.g. capture failed on one rank)."""
        if not self.all_ok(ok):
            raise GraphrtError(f"rank {self.rank}: {what} failed on at least one rank; every "
                               "rank stops so that no rank waits in a collective forever")
