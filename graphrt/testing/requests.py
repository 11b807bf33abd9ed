"""The host side of requests in the example engine: ``Request``, the paged-KV ``BlockPool``,
the deterministic ``Workload`` and ``long_requests`` (a fixed live batch for the ``loop``
bench); ``graphrt.testing.engine`` and ``graphrt.testing.async_engine`` drive them.

Graph safety: host-only (plain Python bookkeeping).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from graphrt.errors import GraphrtError, check_int


@dataclass
class Request:
    """One request: ``prompt`` token ids, ``max_new`` tokens to generate, its ``arrival`` step.
    ``pos`` is the position of the next token fed (= the context length before it); ``blocks``
    the KV blocks it holds (position ``p`` in ``blocks[p // block_size]``); ``reserved`` the
    blocks promised to it at admission and not taken yet."""

    rid: int
    prompt: list
    max_new: int
    arrival: int = 0
    pos: int = 0
    output: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    reserved: int = 0

    @property
    def next_token(self) -> int:
        return self.prompt[self.pos] if self.pos < len(self.prompt) else self.output[-1]

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new

    @property
    def positions_needed(self) -> int:
        """KV positions it writes over its life: prompt + outputs but the last (never fed)."""
        return len(self.prompt) + self.max_new - 1

    def advance(self, sampled: int) -> int:
        """The step fed ``next_token`` at ``pos`` and sampled ``sampled`` after it; returns
        the tokens generated (0 while the prompt is still being fed, else 1)."""
        if self.done:
            raise GraphrtError(f"request {self.rid} already has its {self.max_new} tokens: a "
                               "finished request was fed again (retire it first)")
        self.pos += 1
        if self.pos < len(self.prompt):
            return 0
        self.output.append(sampled)
        return 1

    def advance_unread(self) -> int | None:
        """``advance`` before the sampled id is on the host (the asynchronous loop): the
        output gets a ``None`` placeholder, filled one step later; returns its index in
        ``output`` (None while the prompt is still being fed). ``done`` counts placeholders,
        so a request whose length is known finishes without reading its tokens."""
        if self.done:
            raise GraphrtError(f"request {self.rid} already has its {self.max_new} tokens: a "
                               "finished request was fed again (retire it first)")
        self.pos += 1
        if self.pos < len(self.prompt):
            return None
        self.output.append(None)
        return len(self.output) - 1


class BlockPool:
    """Free KV-cache blocks ``0 .. num_blocks-1`` (the scratch block is not among them), LIFO (a
    freed block is reused first), with reservations: admission reserves every block a request
    will need and the request takes them one at a time as its context grows, so a running
    request always gets its next block; a request that cannot reserve waits in the queue (no
    preemption)."""

    def __init__(self, num_blocks: int):
        self.num_blocks, self._free = num_blocks, list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()
        self.reserved = 0

    def __len__(self) -> int:
        return len(self._free)

    @property
    def available(self) -> int:
        """Free blocks not promised to an admitted request."""
        return len(self._free) - self.reserved

    def reserve(self, k: int) -> bool:
        if k > self.available:
            return False
        self.reserved += k
        return True

    def take(self) -> int:
        """One reserved block."""
        if self.reserved < 1:
            raise GraphrtError("BlockPool.take() without a reservation (reserve at admission)")
        b = self._free.pop()
        self._used.add(b)
        self.reserved -= 1
        return b

    def give(self, blocks, unreserve: int = 0) -> None:
        """Return ``blocks`` and drop ``unreserve`` promised-but-untaken blocks."""
        for b in blocks:
            if b not in self._used:
                raise GraphrtError(f"block {b} returned but not in use (double free?)")
            self._used.remove(b)
            self._free.append(b)
        self.reserved -= unreserve


class Workload:
    """Deterministic arrivals from ``seed``: per step ``rate`` requests on average (the rate
    is redrawn in ``[0, 2 * rate]`` every ``phase`` steps so live batches swing), plus a
    burst of up to ``burst`` requests with probability ``burst_p``. Lengths are uniform in
    ``prompt`` / ``output`` (inclusive), capped so prompt + output <= ``max_ctx`` with at
    least one token of each (the prompt first, at ``max_ctx - 1``)."""

    def __init__(self, seed: int, *, vocab: int, max_ctx: int, prompt=(1, 16), output=(1, 48),
                 rate: float = 1.0, phase: int = 64, burst_p: float = 0.02, burst: int = 32):
        check_int("Workload: max_ctx", max_ctx, 2, " (a prompt token and an output token)")
        self.rng, self.vocab, self.max_ctx = random.Random(seed), vocab, max_ctx
        self.prompt, self.output, self.rate, self.phase = prompt, output, rate, phase
        self.burst_p, self.burst, self._rid, self._now = burst_p, burst, 0, rate

    def arrivals(self, step: int) -> list[Request]:
        rng = self.rng
        if step % self.phase == 0:
            self._now = rng.uniform(0, 2 * self.rate)
        k = int(self._now) + (rng.random() < self._now - int(self._now))
        if rng.random() < self.burst_p:
            k += rng.randint(1, self.burst)
        out = []
        for _ in range(k):
            p = min(rng.randint(*self.prompt), self.max_ctx - 1)
            o = max(1, min(rng.randint(*self.output), self.max_ctx - p))
            toks = [rng.randrange(1, self.vocab) for _ in range(p)]
            out.append(Request(self._rid, toks, o, step))
            self._rid += 1
        return out


def long_requests(count: int, seed: int, *, vocab: int, max_ctx: int, prompt=(1, 16),
                  output=(256, 1024)) -> list[Request]:
    """``count`` requests arriving at step 0 (deterministic from ``seed``), outputs uniform in
    ``output`` (capped so prompt + output <= ``max_ctx``, the prompt first at
    ``max_ctx - 1``): queued behind a batch limit of
    ``bs`` rows they keep the live batch at ``bs``; a finished request's row is taken by the
    next in the queue (a composition change)."""
    check_int("long_requests: max_ctx", max_ctx, 2, " (a prompt token and an output token)")
    rng, out = random.Random(seed), []
    for rid in range(count):
        p = min(rng.randint(*prompt), max_ctx - 1)
        o = max(1, min(rng.randint(*output), max_ctx - p))
        out.append(Request(rid, [rng.randrange(1, vocab) for _ in range(p)], o, 0))
    return out
