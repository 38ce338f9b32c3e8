"""Waiting-queue ordering: SGLang's ``SchedulePolicy.calc_priority`` (docs/sglang-sources.md).

* ``fcfs``: arrival order.
* ``lpm``: longest device prefix first (stable), with in-batch de-prioritisation: a request
  whose device match is ≤ 32 tokens is matched against a temporary tree of the waiting
  requests seen so far; sharing ≥ 32 tokens with one of them sends it to the end, otherwise
  it is inserted. Falls back to fcfs beyond 128 waiting requests.
* ``dfs-weight``: group by matched last node; weight = requests in the subtree; DFS heaviest
  child first, a node's own requests after its children's (post-order). Never falls back.
* ``lof``: longest output first (``-max_new_tokens``, stable).
* ``hrrn``: highest response ratio next, with token-based aging (0.5.23
  ``_sort_by_hrrn``): the prefix matches and in-batch de-prioritisation of ``lpm``, then by
  the scheduler's token clock since the request entered the queue (``processed_tokens``:
  the scheduler counts it, decode launches included) over its uncached prompt tokens,
  highest first (a fully cached prompt first of all, a de-prioritised one last; ties by
  rid). Falls back to fcfs beyond 128 waiting requests.
* ``random`` (``_sort_randomly``): the worker's draws are not reproducible (they depend on
  every earlier call), but a capture's records say which request won them when: replaying
  the capture's own policy (``as_recorded``), the waiting requests go in the order of their
  recorded first forward (``forward_entry_time``), those without one after them in a shuffle
  from the replay's generator (seeded with the worker's ``--random-seed``); a what-if
  ``random`` shuffles them all.
* ``routing-key`` (``_sort_by_routing_key``): when running requests carry routing keys, the
  waiting requests whose key runs go first, the most running first (ties by key), then the
  others by key (none: ""); stable, no reordering while no running request has a key.
* ``shortest-prefill-first`` (0.5.23's experimental ``_sort_by_shortest_prefill``): the
  same matches and de-prioritisation, then the fewest uncached tokens (prompt + outputs so
  far less the match, at least 1) first, queue order among equals; never falls back. A
  chunked prefill in progress leaves room in its chunk for the shorter waiting requests
  (``spf_chunk_limit``).

The scheduler keeps the returned order as its queue (0.5.23 sorts ``waiting_queue`` in place):
the next call starts from it, which only lpm / dfs-weight ties and the fcfs fallback beyond
128 waiting requests can tell from the arrival order.

Waiting-prefix refresh (0.5.23 ``SchedulePolicy._touch_waiting_prefixes``, called at the end
of ``calc_priority``; ``SGLANG_ENABLE_WAITING_PREFIX_REFRESH`` defaults to on): when the
active policy (``_determine_active_policy``) is cache-agnostic (``fcfs``, ``lof``, ``random``,
``routing-key``, ``lpm`` and ``hrrn`` beyond 128 waiting requests) the cache-aware matches above
do not run, so the scheduler
counts its ``calc_priority`` calls made under such a policy with a non-empty queue, and on
every 32nd (the first included) touches the tree path of each of the first 128 waiting
requests in the order just computed, head last (``touch_waiting_prefix``: prompt + outputs
so far, page floored, not capped at ``len − 1``; ``touch_prefix`` is the match walk, split
and stamps included, with no request fields set), so LRU eviction spares what the queue
head will match. Not on a decode worker (``disaggregation_mode == "decode"``) and only under
the ``lru`` eviction policy (``radix_eviction_policy``: the other policies order by hits or
priority first, and the refresh does not run, nor count, for them); the other condition (a
tree without ``supports_fast_match_prefix``) always holds here.

Requests are runtime objects with ``fill`` (token tuple), ``max_new_tokens``, ``routing_key``,
``ns`` (the cache namespace: walks start at its root, ``RadixTree.root_of``)
and the matching fields the scheduler fills through ``match`` (``prefix_len``, ``last_node``).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from kvcadence.replay.config import CACHE_AGNOSTIC_POLICIES
from kvcadence.replay.radix import RadixTree

WAITING_QUEUE_PREFIX_MATCH_MAX = 128
IN_BATCH_CHECK_THRESHOLD = 32
IN_BATCH_DEPRIORITIZE_THRESHOLD = 32
#: ``WAITING_PREFIX_REFRESH_INTERVAL``: calc_priority calls between waiting-prefix refreshes
WAITING_PREFIX_REFRESH_INTERVAL = 32
#: the shortest-prefill-first policy's name
SPF = "shortest-prefill-first"


def _null_hasher(parent: bytes | None, tokens: Any, page_size: int) -> tuple[bytes, list]:
    """No digests (an in-batch probe tree publishes nothing): zero hashes."""
    return b"", [0] * (len(tokens) // page_size)


def order_waiting(
    policy: str,
    waiting: list[Any],
    tree: RadixTree,
    match: Callable[[Any], None],
    processed_tokens: int = 0,
    running_keys: Iterable[str | None] = (),
    rng: random.Random | None = None,
    as_recorded: bool = False,
    priority: Callable[[Any], int] | None = None,
) -> list[Any]:
    """Return the waiting queue in the order the adder walks it.

    ``match(req)`` re-matches a request against ``tree`` (setting ``prefix_len`` and
    ``last_node``); cache-aware policies call it for every waiting request.
    ``processed_tokens``: the scheduler's token clock (``hrrn``'s; a request's
    ``arrival_processed`` is its value when the request entered the queue).
    ``running_keys``: the running requests' routing keys (``routing-key``'s); ``rng``: the
    generator ``random`` shuffles with; ``as_recorded``: ``random`` as the capture's worker
    drew it (the requests with a recorded first forward in that order, first).
    ``priority``: priority scheduling's sort key of a request (its priority, signed so the
    most important sorts first; None: priority scheduling off): ``fcfs`` then orders by it
    and by when each request entered the queue (``wait_seq``), ``lof`` by it first
    (0.5.23 ``_sort_by_priority_and_fcfs``, ``_sort_by_longest_output``).
    """
    if priority is not None and policy in ("fcfs", "lof") and len(waiting) > 1:
        if policy == "fcfs":
            return sorted(waiting, key=lambda r: (priority(r), r.wait_seq))
        return sorted(waiting, key=lambda r: (priority(r), -r.max_new_tokens))
    if policy == "fcfs" or len(waiting) <= 1:
        return list(waiting)
    if policy == "lof":
        return sorted(waiting, key=lambda r: -r.max_new_tokens)
    if policy == "random":
        out = list(waiting)
        (rng or random.Random(0)).shuffle(out)
        if as_recorded:  # stable: the shuffle orders those without a recorded entry
            out.sort(key=_recorded_entry)
        return out
    if policy == "routing-key":
        return _routing_key(waiting, Counter(k for k in running_keys if k))
    if policy in ("lpm", "hrrn"):
        if len(waiting) > WAITING_QUEUE_PREFIX_MATCH_MAX:
            return list(waiting)
        if policy == "hrrn":
            return _hrrn(waiting, tree, match, processed_tokens)
        return _lpm(waiting, tree, match)
    if policy == "dfs-weight":
        return _dfs_weight(waiting, tree, match)
    if policy == SPF:
        return _shortest_prefill(waiting, tree, match)
    raise ValueError(f"unknown schedule policy {policy!r}")


def refreshes_waiting_prefixes(policy: str, n_waiting: int, eviction: str = "lru") -> bool:
    """Whether ``calc_priority`` with ``n_waiting`` (> 0) requests counts towards the
    waiting-prefix refresh: its active policy is cache-agnostic and the tree evicts by
    ``lru``."""
    if eviction != "lru":
        return False
    if policy in ("lpm", "hrrn"):
        return n_waiting > WAITING_QUEUE_PREFIX_MATCH_MAX
    return policy in CACHE_AGNOSTIC_POLICIES


def _recorded_entry(r: Any) -> tuple[bool, float]:
    """``random`` as recorded: a request's recorded first forward, none last."""
    e = r.recorded_entry_s
    return e is None, e or 0.0


def _routing_key(waiting: list[Any], counts: Counter[str]) -> list[Any]:
    """0.5.23 ``_sort_by_routing_key``: no running request with a key, no change; else
    the waiting requests whose key runs first, the most running first (ties by key), then
    the others by key (none: ""), stable."""
    if not counts:
        return list(waiting)

    def key(r: Any) -> tuple[int, int, str]:
        k = r.routing_key
        if k and k in counts:
            return 0, -counts[k], k
        return 1, 0, k or ""

    return sorted(waiting, key=key)


def touch_waiting_prefixes(ordered: list[Any], tree: RadixTree) -> None:
    """``touch_waiting_prefix`` of the first 128 of ``ordered``, head last."""
    for r in reversed(ordered[:WAITING_QUEUE_PREFIX_MATCH_MAX]):
        tree.match_prefix(r.fill, r.fill_len, tree.root_of(r.ns))


def matched(r: Any) -> int:
    """What a policy ranks ``r`` by: 0.5.23 ``num_matched_prefix_tokens``, its last match
    capped at len - 1, unfloored (a cache-aware policy matches the whole prompt: at page 16
    a 160-token prompt cached whole ranks at 159; admission's match is capped already)."""
    return min(r.prefix_len, r.fill_len - 1)


def _prefix_matches(
    waiting: list[Any], tree: RadixTree, match: Callable[[Any], None]
) -> tuple[list[Any], list[Any]]:
    """``_compute_prefix_matches``: every waiting request matched, in queue order; those with
    a short match (<= 32 tokens) that share >= 32 tokens with an earlier such request are
    de-prioritised (in-batch prefix caching: one of them fills the cache for the others).
    Returns ``(kept, de-prioritised)``."""
    # SGLang's probe tree is ``RadixCache.create_simulated()``: page size 1 whatever the
    # worker's, and matched on the whole prompt (no ``len - 1`` cap)
    temp = RadixTree(1, _null_hasher)
    keep: list[Any] = []
    deprioritized: list[Any] = []
    for r in waiting:
        match(r)
        if r.prefix_len <= IN_BATCH_CHECK_THRESHOLD:
            key = r.fill
            home = temp.root_of(r.ns)  # the waiting-queue tree is keyed by namespace too
            shared = temp.peek_prefix_len(key, None, home)
            if shared >= IN_BATCH_DEPRIORITIZE_THRESHOLD:
                deprioritized.append(r)
                continue
            temp.insert(key, root=home)
        keep.append(r)
    return keep, deprioritized


def _lpm(waiting: list[Any], tree: RadixTree, match: Callable[[Any], None]) -> list[Any]:
    keep, deprioritized = _prefix_matches(waiting, tree, match)
    keep.sort(key=lambda r: -matched(r))
    return keep + deprioritized


def _hrrn(
    waiting: list[Any], tree: RadixTree, match: Callable[[Any], None], processed: int
) -> list[Any]:
    """0.5.23 ``_sort_by_hrrn``: ratio = the token clock's advance since the request entered
    the queue / its uncached prompt tokens, highest first; no uncached token: first; the
    de-prioritised: last; ties by rid (the sort is over the whole queue, stable)."""
    _, deprioritized = _prefix_matches(waiting, tree, match)
    low = {id(r) for r in deprioritized}
    inf = float("inf")

    def key(r: Any) -> tuple[float, str]:
        if id(r) in low:
            return inf, r.rid
        uncached = r.input_len - matched(r)
        if uncached <= 0:
            return -inf, r.rid
        return -max(0, processed - r.arrival_processed) / uncached, r.rid

    return sorted(waiting, key=key)


def _prefill_work(r: Any) -> int:
    """``_shortest_prefill_work``: the tokens ``r``'s prefill computes (at least 1)."""
    return max(1, r.fill_len - matched(r))


def _shortest_prefill(
    waiting: list[Any], tree: RadixTree, match: Callable[[Any], None]
) -> list[Any]:
    """0.5.23 ``_sort_by_shortest_prefill``: de-prioritised last, then the least prefill
    work first, queue order (entry time) among equals."""
    _, deprioritized = _prefix_matches(waiting, tree, match)
    low = {id(r) for r in deprioritized}
    return sorted(waiting, key=lambda r: (id(r) in low, _prefill_work(r)))


def spf_chunk_limit(chunked: Any, ordered: list[Any], budget: int, page_size: int) -> int | None:
    """0.5.23 ``shortest_prefill_chunk_limit``: the tokens the chunked prefill in progress
    may take this pass so that the shorter waiting requests (``ordered``: the queue in
    shortest-prefill-first order) fit beside it, each charged its work page-rounded, while
    their sum leaves a page of ``budget`` (the adder's chunk tokens); None when no request
    is reserved for, or the budget is under two pages."""
    if budget < 2 * page_size:
        return None
    remaining = chunked.fill_len - chunked.prefix_len
    reserved = 0
    for r in ordered:
        work = _prefill_work(r)
        charge = -(-work // page_size) * page_size
        if work >= remaining or reserved + charge > budget - page_size:
            break
        reserved += charge
    if not reserved:
        return None
    return (budget - reserved) // page_size * page_size


def _flat(node: Any, root: Any) -> Any:
    """``node``, or the root for a cache namespace's root (``RadixTree.root_of``): SGLang
    keys the namespaces' first nodes as children of the one root, so its walks see them as
    the root's children, and an unmatched request's node as the root."""
    return root if node.parent is root and not node.key else node


def _dfs_weight(waiting: list[Any], tree: RadixTree, match: Callable[[Any], None]) -> list[Any]:
    groups: dict[int, list[Any]] = {}
    nodes: dict[int, Any] = {}
    root = tree.root
    for r in waiting:
        match(r)
        node = _flat(r.last_node, root)
        groups.setdefault(id(node), []).append(r)
        nodes[id(node)] = node
    # weights: number of waiting requests in each node's subtree (walk up from each group)
    weight: dict[int, int] = {}
    children: dict[int, list[Any]] = {}
    for key, reqs in groups.items():
        node = nodes[key]
        w = len(reqs)
        cur = node
        while cur is not None:
            k = id(cur)
            if k not in weight:
                weight[k] = 0
                parent = cur.parent
                if parent is not None:
                    children.setdefault(id(_flat(parent, root)), []).append(cur)
            weight[k] += w
            cur = None if cur.parent is None else _flat(cur.parent, root)
    out: list[Any] = []

    def visit(node: Any) -> None:
        kids = children.get(id(node), [])
        kids.sort(key=lambda c: (-weight[id(c)], c.nid))
        for c in kids:
            visit(c)
        out.extend(groups.get(id(node), []))

    visit(root)
    return out
