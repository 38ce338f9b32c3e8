"""The fake tree cache and allocator the admission benchmark drives the PrefillAdder with.

They follow the upstream benchmark's conventions (``docs/admit.md``): one radix node per
waiting request holding its L1 prefix, all-or-nothing L2 load-back above a threshold, whole-node
eviction from the back of the queue, page-aligned allocation. The same fakes are kept, by hand,
in ``kvcadence/harness/sglang_adder_driver.py`` (which must not import kvcadence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcadence.errors import ReplayError
from kvcadence.replay.admission import ceil_paged

LOAD_BACK_THRESHOLD = 10


class FakeAllocator:
    """A token pool with a free count; ``available_size()`` as SGLang's allocator."""

    def __init__(self, page_size: int, available: int) -> None:
        self.page_size = page_size
        self.free = available

    def available_size(self) -> int:
        return self.free


@dataclass
class FakeNode:
    """One request's own L1 path in the fake radix tree."""

    rid: str
    size: int
    lock_ref: int = 0
    evicted: bool = False


@dataclass
class LoadBackEvent:
    rid: str
    requested: int  # host_hit_length asked for
    page_aligned: int  # device slots it needs
    loaded: int  # tokens that joined the prefix (0 on failure)
    quota: int  # free + evictable when asked (what the fake could make room from)
    available_before: int
    available_after: int
    evicted_tokens: int
    success: bool
    reason: str  # "ok" | "threshold" | "no_space"


class FakeTreeCache:
    """Per-request L1 nodes, whole-node eviction from the back of the queue, L2 load-back."""

    disable = False

    def __init__(self, allocator: FakeAllocator, *, load_back_threshold: int = LOAD_BACK_THRESHOLD):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.nodes: dict[str, FakeNode] = {}
        self._evictable = 0
        self.load_back_threshold = load_back_threshold
        self.events: list[LoadBackEvent] = []
        self.evictions: list[tuple[str, int]] = []

    # -- tree state -----------------------------------------------------------------------
    def add_node(self, rid: str, size: int) -> FakeNode:
        node = FakeNode(rid, size)
        self.nodes[rid] = node
        self._evictable += size
        return node

    def remove_node(self, rid: str) -> int:
        """Drop a finished request's node; returns the device tokens it held."""
        node = self.nodes.pop(rid)
        if node.lock_ref == 0 and not node.evicted:
            self._evictable -= node.size
        return 0 if node.evicted else node.size

    def evictable_size(self) -> int:
        return self._evictable

    def full_evictable_size(self) -> int:
        return self._evictable

    def lock(self, node: FakeNode) -> FakeNode:
        if node.lock_ref == 0 and not node.evicted:
            self._evictable -= node.size
        node.lock_ref += 1
        return node

    def unlock(self, node: FakeNode) -> None:
        if node.lock_ref <= 0:
            raise ReplayError(f"admit: unlock of unlocked node {node.rid}")
        node.lock_ref -= 1
        if node.lock_ref == 0 and not node.evicted:
            self._evictable += node.size

    inc_lock_ref = lock
    dec_lock_ref = unlock

    def evict(self, need: int) -> int:
        """Evict whole unlocked nodes (back of the queue first) until ``need`` tokens freed."""
        freed = 0
        for node in reversed(list(self.nodes.values())):
            if freed >= need:
                break
            if node.lock_ref or node.evicted or node.size == 0:
                continue
            node.evicted = True
            self._evictable -= node.size
            self.allocator.free += node.size
            freed += node.size
            self.evictions.append((node.rid, node.size))
        return freed

    def current_l1(self, rid: str) -> int:
        node = self.nodes[rid]
        return 0 if node.evicted else node.size

    # -- load-back ------------------------------------------------------------------------
    def load_back(self, rid: str, host_hit_length: int) -> int:
        """All-or-nothing L2 load-back for ``rid``; returns tokens loaded (0 = recompute)."""
        # Kept in sync by hand with ``sglang_adder_driver.FakeTreeCache.init_load_back`` (the copy
        # run inside real SGLang, which must not import kvcadence): change both together.
        paged = ceil_paged(host_hit_length, self.page_size)
        before = self.allocator.free
        quota = before + self._evictable
        evicted = 0
        if host_hit_length < max(1, self.load_back_threshold):
            ok, reason = False, "threshold"
        elif paged > quota:
            ok, reason = False, "no_space"
        else:
            if before < paged:
                evicted = self.evict(paged - before)
            self.allocator.free -= paged
            ok, reason = True, "ok"
        self.events.append(
            LoadBackEvent(
                rid=rid,
                requested=host_hit_length,
                page_aligned=paged,
                loaded=host_hit_length if ok else 0,
                quota=quota,
                available_before=before,
                available_after=self.allocator.free,
                evicted_tokens=evicted,
                success=ok,
                reason=reason,
            )
        )
        return host_hit_length if ok else 0

    def init_load_back(self, req: Any, host_hit_length: int) -> int:
        """``kvcadence.replay.admission`` protocol. The adder keeps the candidate's own L1
        pinned through load-back (as SGLang 0.5.23 does), so it never evicts itself here."""
        return self.load_back(req.rid, host_hit_length)
