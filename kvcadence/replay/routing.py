"""Request routing across simulated ranks: ``recorded | round_robin | shortest_queue |
cache_aware``.

What this file owns: the routing policies ``replay.fleet`` calls with ``route(fleet, idx,
at_ns) -> slot index`` (a slot is one DP rank of one worker, in worker-then-rank order).

* ``recorded`` (static: decided when the arrival becomes known) -- the (worker, rank) that
  served the request in the capture (``dp_rank``; null = rank 0);
* ``round_robin`` -- strict alternation over all slots in arrival order (SGLang's DP
  controller default);
* ``shortest_queue`` -- fewest requests queued or running (routed-but-not-received,
  waiting, chunked, running); ties: the lowest slot;
* ``cache_aware`` -- a KV-aware router: the slot whose cache holds the longest prefix of
  the prompt (in full pages), ties: fewest waiting tokens, then the lowest slot. It sees the
  ranks' caches **only through their published KV events**: a router-side index of block
  hashes per slot, fed with each slot's published batches whose publish time is at or
  before the routing moment (``BlockStored`` adds, ``BlockRemoved`` drops,
  ``AllBlocksCleared`` empties). So event cadence changes routing, as in production.
  The prompt's block hashes are SGLang's chained SHA-256 (``format.wire`` through the
  fleet's hasher), computed once per request.

Routers keep counters of their decisions (``stats``) for the report.
"""

from __future__ import annotations

from typing import Any

from kvcadence.errors import UsageError
from kvcadence.replay.events import CLEAR, REMOVE, STORE

ROUTES = ("recorded", "round_robin", "shortest_queue", "cache_aware")


class Router:
    """Base: ``name``, ``static`` (routed when the arrival becomes known), ``reads_events``
    (reads the ranks' published events: the fleet keeps them) and ``route``."""

    name = "?"
    static = False
    reads_events = False

    def __init__(self) -> None:
        self.stats: dict[str, int] = {"routed": 0}

    def route(self, fleet: Any, idx: int, at_ns: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


class RecordedRouter(Router):
    name = "recorded"
    static = True

    def route(self, fleet: Any, idx: int, at_ns: int) -> int:
        self.stats["routed"] += 1
        return fleet.slot_of[fleet.home[idx]]


class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self.next = 0

    def route(self, fleet: Any, idx: int, at_ns: int) -> int:
        self.stats["routed"] += 1
        slot = self.next % len(fleet.slots)
        self.next += 1
        return slot


def queued_requests(sched: Any) -> int:
    """Requests a rank holds: routed but not received, waiting, chunked, running."""
    n = len(sched.arrivals) + len(sched.waiting) + len(sched.running)
    n += sum(1 for r in sched.pending_merge if r not in sched.running)
    if sched.chunked_req is not None and sched.chunked_req not in sched.running:
        n += 1
    return n


def waiting_tokens(sched: Any) -> int:
    """Prompt tokens not yet prefilled on a rank (routed-but-not-received + waiting +
    the rest of a chunked request)."""
    reqs = sched.reqs
    n = sum(reqs[i].fill_len for _t, i in sched.arrivals if i < len(reqs))
    n += sum(r.fill_len for r in sched.waiting)
    c = sched.chunked_req
    if c is not None:
        n += max(0, c.fill_len - c.kv_len)
    return n


class ShortestQueueRouter(Router):
    name = "shortest_queue"

    def route(self, fleet: Any, idx: int, at_ns: int) -> int:
        self.stats["routed"] += 1
        best, key = 0, None
        for sl in fleet.slots:
            k = (queued_requests(sl.sched), sl.index)
            if key is None or k < key:
                best, key = sl.index, k
        return best


class PublishedIndex:
    """Router-side view of one slot's cache: the block hashes its published events hold."""

    __slots__ = ("blocks", "cursor")

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.cursor = 0

    def advance(self, log: list[tuple[int, list[Any]]], upto_ns: int) -> int:
        """Apply published batches with publish time <= ``upto_ns``; returns how many."""

        n = 0
        blocks = self.blocks
        while self.cursor < len(log) and log[self.cursor][0] <= upto_ns:
            for e in log[self.cursor][1]:
                if e.kind == STORE:
                    blocks.update(e.hashes)
                elif e.kind == REMOVE:
                    blocks.difference_update(e.hashes)
                elif e.kind == CLEAR:
                    blocks.clear()
            self.cursor += 1
            n += 1
        return n

    def match(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` present in the index."""
        blocks = self.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n


class CacheAwareRouter(Router):
    name = "cache_aware"
    reads_events = True

    def __init__(self) -> None:
        super().__init__()
        self.indexes: list[PublishedIndex] = []
        self.stats.update({"prefix_routed": 0, "tie_routed": 0, "matched_tokens": 0})
        #: (request idx, chosen slot, matched tokens seen through published events)
        self.decisions: list[tuple[int, int, int]] = []

    @staticmethod
    def prompt_hashes(fleet: Any, idx: int, page_size: int) -> list[int]:
        """Block hashes of the prompt's full pages (SGLang's chain from the root)."""
        req = fleet.reqs[idx]
        toks = req.fill[: req.fill_len - req.fill_len % page_size]
        _digests, hashes = fleet.hasher(None, toks, page_size)
        return list(hashes)

    def route(self, fleet: Any, idx: int, at_ns: int) -> int:
        self.stats["routed"] += 1
        slots = fleet.slots
        while len(self.indexes) < len(slots):
            self.indexes.append(PublishedIndex())
        by_ps: dict[int, list[int]] = {}
        best, key = 0, None
        best_match = 0
        for sl in slots:
            ix = self.indexes[sl.index]
            ix.advance(sl.publisher.log, fleet.anchor_ns + at_ns)
            ps = sl.sched.cfg.page_size
            hashes = by_ps.get(ps)
            if hashes is None:
                hashes = by_ps[ps] = self.prompt_hashes(fleet, idx, ps)
            m = ix.match(hashes) * ps
            k = (-m, waiting_tokens(sl.sched), sl.index)
            if key is None or k < key:
                best, key, best_match = sl.index, k, m
        self.decisions.append((idx, best, best_match))
        if best_match > 0:
            self.stats["prefix_routed"] += 1
            self.stats["matched_tokens"] += best_match
        else:
            self.stats["tie_routed"] += 1
        return best


def make_router(name: str) -> Router:
    """A fresh router for policy ``name`` (``UsageError`` for unknown names)."""
    key = name.replace("-", "_")
    cls = {
        "recorded": RecordedRouter,
        "round_robin": RoundRobinRouter,
        "shortest_queue": ShortestQueueRouter,
        "cache_aware": CacheAwareRouter,
    }.get(key)
    if cls is None:
        raise UsageError(f"unknown routing policy {name!r} (choose from {', '.join(ROUTES)})")
    return cls()
