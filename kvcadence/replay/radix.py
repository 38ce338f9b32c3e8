"""The simulated radix cache: page-granular radix tree with SGLang's chained block hashes.

What this file owns (SGLang 0.5.23 ``UnifiedRadixCache`` semantics,
docs/sglang-sources.md):

* Nodes hold a page-aligned run of token ids (an ``array('I')``, ``replay.tokens``: 4 bytes a
  token; keys given as lists are converted once at the call, and arrays compare slice to
  slice in C), one SHA-256 digest (all of them
  concatenated in one ``bytes``, 32 per page) and one int64 block hash per page (an
  ``array('q')`` from the wire hasher: 8 bytes a page, nothing for the cyclic GC to walk),
  chained from the parent node's last page (hashes come from
  ``kvcadence.format.wire`` through an injected ``Hasher``, so a simulated hash equals the
  real one for the same tokens).
* ``match_prefix`` walks from the root, splits a node on a partial (page-aligned) match
  (no event), and touches every node on the path (LRU access stamp, deeper = newer).
* ``insert`` walks the existing path and creates **at most one** new node for the rest;
  a new node records one ``BlockStored`` (all its pages, parent = the parent node's last
  page hash, None at the root) through the ``EventSink``.
* Cache namespaces (``format.namespace``: ``extra_key``, ``cache_salt``): each has a root of
  its own under the root (``root_of``; holds no tokens, never evicted), where its requests'
  walks start, so no prefix is shared across namespaces; a salt seeds the chain of its pages
  and rides on their events, and a store or a removal carries its namespace to the sink.
* ``lock`` / ``unlock`` count references along the path to the root (SGLang's
  ``inc_lock_ref`` / ``dec_lock_ref``) and keep ``evictable_size`` / ``protected_size``.
* ``evict(n)`` removes **whole unlocked leaves** in the eviction policy's order until at
  least ``n`` tokens were freed (overshoot up to one node); a parent becomes a candidate when
  its last child goes; each evicted node records one ``BlockRemoved`` with all its pages.
* The eviction policy (SGLang ``--radix-eviction-policy``, ``EVICTION_POLICIES``; the tree
  core's ``eviction_strategy.get_priority``): ``lru`` (last access), ``lfu`` (hit count,
  then last access), ``slru`` (protected once hit ``SLRU_PROTECTED`` times, then last
  access), ``priority`` (the node's priority, then last access). A node's hit count goes up
  once per insert that walks it past what the inserting request had inserted before
  (``inserted_len``: its earlier checkpoints; match does not count), a new node starts at
  one; its priority is the highest priority of the inserts that walked it (a finished
  request's prompt is inserted again one above its own: SGLang's prompt-boundary split). A
  split's new parent takes the child's count and priority.

Token counts only: the tree knows how many KV slots it owns (``total_size``), not where.
Candidates live in a lazy heap (stale entries are skipped on pop), so an eviction costs
O(evicted · log n) instead of SGLang's collect-all-leaves O(n). Nodes that become candidates
(touched or unlocked leaves) are only noted, and enter the heap at the next ``evict`` if they
are still candidates then, with their policy key of then: the pop order is the total order
(policy key, node id) over the current candidates either way (every change of a key --
an access, a hit, a priority -- comes with an access, which notes the node), and a leaf
touched or locked again in between costs no heap entry.

Why ~680 lines: one data structure (match, insert, split, lock, evict) whose walks are inlined
hot paths.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any, Protocol

from kvcadence.format import wire
from kvcadence.format.namespace import Namespace
from kvcadence.replay.tokens import CODE, compact

#: 32 bytes per page: a node's page digests, concatenated (one object per node, not per page)
DIGEST_SIZE = 32

#: the eviction policies simulated (SGLang 0.5.23 ``--radix-eviction-policy`` choices but
#: ``tlru``, which needs its per-deployment thresholds)
EVICTION_POLICIES = ("lru", "lfu", "slru", "priority")
#: ``slru``: hits that make a node protected (``SLRUStrategy``'s default threshold)
SLRU_PROTECTED = 2
#: the priority of a finished request's second insert of its prompt (SGLang: the request's
#: priority + 1; a request's own priority is not recorded, taken as 0)
PROMPT_PRIORITY = 1

_last_access = attrgetter("last_access")


def _lfu_key(n: Node) -> tuple[int, int]:
    return n.hits, n.last_access


def _slru_key(protected: int) -> Callable[[Node], tuple[bool, int]]:
    def key(n: Node) -> tuple[bool, int]:
        return n.hits >= protected, n.last_access

    return key


def _priority_key(n: Node) -> tuple[int, int]:
    return n.prio, n.last_access


#: policy -> a node's eviction key (lower goes first), SGLang's ``get_priority``
_POLICY_KEYS: dict[str, Callable[[Node], Any]] = {
    "lru": _last_access,
    "lfu": _lfu_key,
    "slru": _slru_key(SLRU_PROTECTED),
    "priority": _priority_key,
}

# (parent_digest or None, page-aligned token ids, page_size)
#   -> (the pages' 32-byte digests concatenated, their int64 hashes: a list or an array)
Hasher = Callable[[bytes | None, Sequence[int], int], tuple[bytes, Sequence[int]]]


class EventSink(Protocol):
    """Where the tree records its events (``replay.events.EventQueue`` in the simulator)."""

    def record_store(
        self,
        hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        page_size: int,
        ns: Namespace | None = None,
    ) -> None: ...

    def record_remove(self, hashes: Sequence[int], ns: Namespace | None = None) -> None: ...


class NullSink:
    """An ``EventSink`` that drops everything (policy probes, tests of pure accounting)."""

    def record_store(
        self,
        hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        page_size: int,
        ns: Namespace | None = None,
    ) -> None:
        return None

    def record_remove(self, hashes: Sequence[int], ns: Namespace | None = None) -> None:
        return None


def wire_hasher() -> Hasher:
    """The production hasher: ``kvcadence.format.wire`` (SGLang's chained SHA-256); the
    hashes come as an ``array('q')`` (a node keeps them: no int object per page)."""
    block_digests = wire.block_digests
    to_int64 = wire.joined_digests_to_int64

    def hasher(
        parent: bytes | None, tokens: Sequence[int], page_size: int
    ) -> tuple[bytes, array[int]]:
        joined = b"".join(block_digests(tokens, page_size, parent_digest=parent))
        return joined, to_int64(joined)

    return hasher


class Node:
    """One radix node: a page-aligned token run with its page digests and hashes
    (``digests``: ``DIGEST_SIZE`` bytes per page, concatenated; ``hashes``: what the
    ``Hasher`` gave, an ``array('q')`` from the wire hasher)."""

    __slots__ = (
        "key",
        "children",
        "parent",
        "lock_ref",
        "last_access",
        "digests",
        "hashes",
        "nid",
        "alive",
        "hits",
        "prio",
        "ns",
    )

    def __init__(
        self,
        key: array,
        parent: Node | None,
        digests: bytes,
        hashes: Sequence[int],
        nid: int,
    ) -> None:
        self.key = key
        self.children: dict[object, Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.digests = digests
        self.hashes = hashes
        self.nid = nid
        self.alive = True
        self.hits = 0  # inserts that walked it (``lfu``, ``slru``)
        self.prio = 0  # the highest priority of those inserts (``priority``)
        #: the cache namespace of its subtree (``format.namespace``; None: the default one)
        self.ns: Namespace | None = None

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Node(id={self.nid}, len={len(self.key)}, lock={self.lock_ref})"


class RadixTree:
    """Page-granular radix tree (see the module docstring for the rules)."""

    def __init__(
        self,
        page_size: int,
        hasher: Hasher,
        sink: EventSink | None = None,
        policy: str = "lru",
        slru_protected: int = SLRU_PROTECTED,
    ) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        if policy not in _POLICY_KEYS:
            raise ValueError(f"eviction policy {policy!r} not simulated")
        self.page_size = page_size
        self.policy = policy
        self._key = _POLICY_KEYS[policy]
        if policy == "slru" and slru_protected != SLRU_PROTECTED:
            self._key = _slru_key(slru_protected)
        #: the policy reads hit counts (kept only then: a walk up the path per insert)
        self.counts_hits = policy in ("lfu", "slru")
        self.hasher = hasher
        self.sink: EventSink = sink if sink is not None else NullSink()
        self._next_id = 1
        self._tick = 0
        self.root = Node(array(CODE), None, b"", [], 0)
        self.root.lock_ref = 1  # the root is never evicted
        self.total_size = 0
        self.evictable_size = 0
        self.protected_size = 0
        self.num_nodes = 0
        self._heap: list[tuple[int, int, Node]] = []
        #: leaves that became candidates since the last ``evict`` (pushed there if still so)
        self._noted: list[Node] = []
        #: the root of each non-default cache namespace (``root_of``)
        self._ns_roots: dict[Namespace, Node] = {}

    # ------------------------------------------------------------------ namespaces
    def root_of(self, ns: Namespace | None) -> Node:
        """Where the walks of a request in cache namespace ``ns`` start: the root for the
        default one, else the namespace's own root -- a child of the root holding no tokens,
        locked for good (never evicted), keyed by the namespace (no page key equals it), its
        digest the salt's seed (its first pages chain from it, as SGLang's salted chain;
        none with an extra key alone: the plain chain) and no hash (a first page's parent is
        None, as under the root). Requests of two namespaces never share a node, and the
        eviction order is the one tree's (SGLang keys one tree's children by namespace)."""
        if ns is None:
            return self.root
        node = self._ns_roots.get(ns)
        if node is None:
            seed = b"" if ns.cache_salt is None else wire.cache_salt_seed(ns.cache_salt)
            node = Node(array(CODE), self.root, seed, [], self._next_id)
            self._next_id += 1
            node.lock_ref = 1
            node.ns = ns
            self.root.children[ns] = node
            self._ns_roots[ns] = node
        return node

    # ------------------------------------------------------------------ helpers
    def _child_key(self, key: Sequence[int], pos: int) -> object:
        if self.page_size == 1:
            return key[pos]
        return tuple(key[pos : pos + self.page_size])

    def _push(self, node: Node) -> None:
        noted = self._noted
        noted.append(node)
        if len(noted) > 64 + 4 * self.num_nodes:
            self._rebuild_heap()  # bound the notes (and the dead nodes they keep)

    def _push_noted(self) -> None:
        """Push the noted nodes that are still eviction candidates, at their stamp now."""
        heap = self._heap
        root = self.root
        key = self._key
        seen: set[int] = set()
        for node in self._noted:
            if (
                node.alive
                and not node.children
                and node.lock_ref == 0
                and node is not root
                and node.nid not in seen
            ):
                seen.add(node.nid)
                heapq.heappush(heap, (key(node), node.nid, node))
        self._noted = []
        if len(heap) > 64 + 4 * self.num_nodes:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap = []
        key = self._key
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n.lock_ref == 0 and n is not self.root:
                heap.append((key(n), n.nid, n))
        heapq.heapify(heap)
        self._heap = heap
        self._noted = []

    def _touch(self, node: Node) -> None:
        self._tick += 1
        node.last_access = self._tick
        if not node.children and node.lock_ref == 0:
            noted = self._noted
            noted.append(node)
            if len(noted) > 64 + 4 * self.num_nodes:
                self._rebuild_heap()

    def _common_len(self, ckey: array, key: array, pos: int, limit: int) -> int:
        """Largest l <= limit with key[pos:pos+l] == ckey[:l] (binary search on slices)."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key[pos : pos + mid] == ckey[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, child: Node, length: int) -> Node:
        """Split ``child`` so its first ``length`` tokens become a new parent (no event)."""
        ps = self.page_size
        npages = length // ps
        parent = child.parent
        assert parent is not None
        cut = npages * DIGEST_SIZE
        new = Node(
            child.key[:length], parent, child.digests[:cut], child.hashes[:npages], self._next_id
        )
        self._next_id += 1
        self.num_nodes += 1
        new.lock_ref = child.lock_ref
        new.last_access = child.last_access
        new.hits = child.hits
        new.prio = child.prio
        new.ns = child.ns
        parent.children[self._child_key(child.key, 0)] = new
        child.key = child.key[length:]
        child.digests = child.digests[cut:]
        child.hashes = child.hashes[npages:]
        child.parent = new
        new.children[self._child_key(child.key, 0)] = child
        return new

    # ------------------------------------------------------------------ queries
    def match_prefix(
        self, key: Sequence[int], limit: int | None = None, root: Node | None = None
    ) -> tuple[int, Node]:
        """Device match of ``key[:limit]`` floored to a page; touches and splits as SGLang.

        Returns ``(matched_tokens, last_node)``. Callers cap ``limit`` at ``len(prompt) - 1``.
        ``root``: the walk's start (``root_of`` a namespace; the root when None).
        """
        if type(key) is not array:
            key = compact(key)
        ps = self.page_size
        n = len(key) if limit is None else min(limit, len(key))
        n -= n % ps
        node = self.root if root is None else root
        pos = 0
        while pos < n:
            child = node.children.get(key[pos] if ps == 1 else tuple(key[pos : pos + ps]))
            if child is None:
                break
            # ``_touch`` inlined
            tick = self._tick = self._tick + 1
            child.last_access = tick
            if not child.children and child.lock_ref == 0:
                noted = self._noted
                noted.append(child)
                if len(noted) > 64 + 4 * self.num_nodes:
                    self._rebuild_heap()
            ckey = child.key
            m = len(ckey)
            if pos + m <= n and key[pos : pos + m] == ckey:
                pos += m
                node = child
                continue
            common = self._common_len(ckey, key, pos, min(m, n - pos))
            common -= common % ps
            if common > 0:
                node = self._split(child, common)
                pos += common
            break
        return pos, node

    def peek_prefix_len(
        self, key: Sequence[int], limit: int | None = None, root: Node | None = None
    ) -> int:
        """Matched length without touching or splitting (for policies and probes); ``root``
        as ``match_prefix``'s."""
        if type(key) is not array:
            key = compact(key)
        ps = self.page_size
        n = len(key) if limit is None else min(limit, len(key))
        n -= n % ps
        node = self.root if root is None else root
        pos = 0
        while pos < n:
            child = node.children.get(key[pos] if ps == 1 else tuple(key[pos : pos + ps]))
            if child is None:
                break
            ckey = child.key
            m = len(ckey)
            if pos + m <= n and key[pos : pos + m] == ckey:
                pos += m
                node = child
                continue
            common = self._common_len(ckey, key, pos, min(m, n - pos))
            pos += common - common % ps
            break
        return pos

    # ------------------------------------------------------------------ updates
    def insert(
        self,
        key: Sequence[int],
        start_node: Node | None = None,
        start_pos: int = 0,
        end: int | None = None,
        root: Node | None = None,
    ) -> tuple[int, Node, Node | None]:
        """Insert page-aligned ``key`` from the root (``root``: a namespace's, ``root_of``).

        ``start_node``/``start_pos`` is a shortcut for callers that hold a lock on the node
        whose path is exactly ``key[:start_pos]`` (a request's locked prefix): the walk then
        starts there (``insert_below``). Returns ``(existing_tokens, last_node,
        new_node_or_None)``: ``existing_tokens`` were already in the tree (their KV in the
        request is a duplicate and gets freed), and the new node (if any) recorded one
        ``BlockStored``.
        """
        n = len(key) if end is None else min(end, len(key))
        n -= n % self.page_size
        if start_node is not None and start_node is not self.root and start_pos <= n:
            return self.insert_below(start_node, start_pos, key[start_pos:n])
        return self.insert_below(self.root if root is None else root, 0, key[:n])

    def insert_below(
        self,
        node: Node,
        depth: int,
        run: Sequence[int],
        inserted_len: int = 0,
        priority: int = 0,
    ) -> tuple[int, Node, Node | None]:
        """Insert ``path(node) + run`` (page floored), where ``node`` is the root (``depth``
        0) or a node the caller holds locked whose path is ``depth`` tokens long: its
        ancestors are touched top-down as the walk from the root would, then the walk goes
        on from ``node`` over ``run`` only, so a caller passes just the tokens past its
        locked prefix. Returns what ``insert`` does (positions counted from the root).

        ``inserted_len``: what the inserting request inserted before (its earlier
        checkpoints): a walked node ending past it gains a hit; ``priority``: the insert's,
        raised onto every walked node (both read only by the policies that use them)."""
        ps = self.page_size
        root = self.root
        if self.counts_hits or self.policy == "priority":
            self._count_path(node, depth, inserted_len, priority)
        if node is not root:
            # ``_touch`` of the path top-down (root side first), inlined: count the nodes,
            # then stamp them bottom-up with the ticks a top-down walk would give
            depth_nodes = 0
            cur: Node | None = node
            while cur is not root and cur is not None:
                depth_nodes += 1
                cur = cur.parent
            tick = self._tick + depth_nodes
            self._tick = tick
            cur = node
            for _ in range(depth_nodes):
                cur.last_access = tick  # type: ignore[union-attr]
                tick -= 1
                cur = cur.parent  # type: ignore[union-attr]
            # only ``node`` can be a leaf (each ancestor has the path's next node as a
            # child): the one candidate note
            if not node.children and node.lock_ref == 0:
                self._push(node)
        if type(run) is not array:
            run = compact(run)
        n = len(run)
        n -= n % ps
        pos = 0
        counts = self.counts_hits
        while pos < n:
            child = node.children.get(run[pos] if ps == 1 else tuple(run[pos : pos + ps]))
            if child is None:
                break
            self._touch(child)
            ckey = child.key
            m = len(ckey)
            if pos + m <= n and run[pos : pos + m] == ckey:
                pos += m
                node = child
                if counts and depth + pos > inserted_len:
                    child.hits += 1
                if priority > child.prio:
                    child.prio = priority
                continue
            common = self._common_len(ckey, run, pos, min(m, n - pos))
            common -= common % ps
            node = self._split(child, common)
            pos += common
            if counts and depth + pos > inserted_len:
                node.hits += 1
            if priority > node.prio:
                node.prio = priority
            break
        if pos >= n:
            return depth + pos, node, None
        rest = run[pos:n]
        digests = node.digests
        digests, hashes = self.hasher(digests[-DIGEST_SIZE:] if digests else None, rest, ps)
        new = Node(rest, node, digests, hashes, self._next_id)
        new.hits = 1  # a new node ends past anything its request inserted before
        new.prio = priority
        ns = new.ns = node.ns
        self._next_id += 1
        self.num_nodes += 1
        node.children[rest[0] if ps == 1 else tuple(rest[:ps])] = new
        self.total_size += len(rest)
        self.evictable_size += len(rest)
        self._touch(new)
        parent_hash = node.hashes[-1] if node.hashes else None
        self.sink.record_store(hashes, parent_hash, rest, ps, ns)
        return depth + pos, new, new

    def _count_path(self, node: Node, depth: int, inserted_len: int, priority: int) -> None:
        """The hits and priority an insert walking from the root gives ``node`` (path
        ``depth`` tokens long) and its ancestors (``insert_below`` goes on below it)."""
        counts = self.counts_hits
        root = self.root
        end = depth
        cur: Node | None = node
        while cur is not root and cur is not None:
            if counts and end > inserted_len:
                cur.hits += 1
            if priority > cur.prio:
                cur.prio = priority
            end -= len(cur.key)
            cur = cur.parent

    def lock(self, node: Node) -> None:
        """``inc_lock_ref``: protect ``node`` and its ancestors from eviction."""
        root = self.root
        while node is not root:
            ref = node.lock_ref  # one attribute read per node (the hot walk)
            if ref == 0:
                k = len(node.key)
                self.evictable_size -= k
                self.protected_size += k
            node.lock_ref = ref + 1
            node = node.parent  # type: ignore[assignment]

    def relock(self, old: Node, node: Node) -> None:
        """``lock(node)`` then ``unlock(old)`` (a request's lock moving down its path).

        When ``old`` is ``node`` or one of its ancestors, only the nodes below ``old`` gain a
        reference: ``old`` and its ancestors are locked throughout (+1 then -1 never crosses
        zero), so the result is the same with no walk above ``old``."""
        root = self.root
        cur = node
        while cur is not old and cur is not root:
            cur = cur.parent  # type: ignore[assignment]
        if cur is not old or old.lock_ref <= 0:
            self.lock(node)
            self.unlock(old)
            return
        cur = node
        while cur is not old:
            ref = cur.lock_ref
            if ref == 0:
                k = len(cur.key)
                self.evictable_size -= k
                self.protected_size += k
            cur.lock_ref = ref + 1
            cur = cur.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        """``dec_lock_ref``: release one reference on ``node`` and its ancestors."""
        root = self.root
        while node is not root:
            ref = node.lock_ref - 1  # one attribute read per node (the hot walk)
            if ref < 0:
                raise RuntimeError("unlock of an unlocked radix node")
            node.lock_ref = ref
            if ref == 0:
                k = len(node.key)
                self.evictable_size += k
                self.protected_size -= k
                if not node.children:
                    self._push(node)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> int:
        """Evict whole unlocked leaves (the policy's order) until ``num_tokens`` are freed;
        return freed."""
        if self._noted:
            self._push_noted()
        freed = 0
        heap = self._heap
        root = self.root
        sink = self.sink
        ps = self.page_size
        key_of = self._key
        while freed < num_tokens and heap:
            stamp, _nid, node = heapq.heappop(heap)
            if (
                not node.alive
                or node.children
                or node.lock_ref != 0
                or key_of(node) != stamp
                or node is root
            ):
                continue
            parent = node.parent
            assert parent is not None
            key = node.key
            del parent.children[key[0] if ps == 1 else tuple(key[:ps])]
            node.alive = False
            k = len(node.key)
            freed += k
            self.total_size -= k
            self.evictable_size -= k
            self.num_nodes -= 1
            sink.record_remove(node.hashes, node.ns)
            if parent is not root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (key_of(parent), parent.nid, parent))
        return freed

    def reset(self) -> None:
        """Drop every node (``/flush_cache``); the caller records ``AllBlocksCleared``."""
        self.root = Node(array(CODE), None, b"", [], 0)
        self.root.lock_ref = 1
        self.total_size = self.evictable_size = self.protected_size = 0
        self.num_nodes = 0
        self._heap = []
        self._noted = []
        self._ns_roots = {}

    # ------------------------------------------------------------------ introspection
    def resident_hashes(self) -> set[int]:
        """Every block hash currently in the tree (tests and invariants)."""
        out: set[int] = set()
        stack = [self.root]
        while stack:
            n = stack.pop()
            out.update(n.hashes)
            stack.extend(n.children.values())
        return out

    def check_invariants(self) -> None:
        """Recompute sizes from scratch and compare (tests)."""
        total = evictable = 0
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            k = len(n.key)
            if n.parent is self.root and n.ns is not None and self._ns_roots.get(n.ns) is n:
                if k or n.hashes or n.lock_ref < 1:  # a namespace's root (``root_of``)
                    raise AssertionError(f"bad namespace root {n!r}")
                stack.extend(n.children.values())
                continue
            if k == 0 or k % self.page_size or len(n.hashes) != k // self.page_size:
                raise AssertionError(f"bad node {n!r}")
            total += k
            if n.lock_ref == 0:
                evictable += k
            for c in n.children.values():
                if c.parent is not n:
                    raise AssertionError("broken parent link")
                if c.lock_ref > n.lock_ref:
                    raise AssertionError("child locked more than parent")
            stack.extend(n.children.values())
        if total != self.total_size or evictable != self.evictable_size:
            raise AssertionError(
                f"sizes drifted: total {total} vs {self.total_size}, "
                f"evictable {evictable} vs {self.evictable_size}"
            )
        if self.protected_size != total - evictable:
            raise AssertionError("protected size drifted")
