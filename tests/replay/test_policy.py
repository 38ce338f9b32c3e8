"""Waiting-queue policies: lpm (longest prefix, in-batch de-prioritisation, fcfs beyond 128),
lof, dfs-weight (heaviest subtree first, post-order), hrrn (response ratio with token
aging), fcfs; the waiting-prefix refresh."""

from __future__ import annotations

from kvcadence.replay.policy import (
    order_waiting,
    refreshes_waiting_prefixes,
    spf_chunk_limit,
    touch_waiting_prefixes,
)
from kvcadence.replay.radix import RadixTree, wire_hasher


class R:
    def __init__(self, name, fill, max_new=10, entered=0, key=None, entry=None, ns=None):
        self.name = self.rid = name
        self.routing_key = key
        self.ns = ns
        self.recorded_entry_s = entry
        self.fill = tuple(fill)
        self.input_len = self.fill_len = len(self.fill)
        self.max_new_tokens = max_new
        self.prefix_len = 0
        self.last_node = None
        self.arrival_processed = entered


def matcher(tree):
    """Admission's match against ``tree`` (len - 1, from the request's namespace root)."""

    def match(r):
        r.prefix_len, r.last_node = tree.match_prefix(r.fill, len(r.fill) - 1, tree.root_of(r.ns))

    return match


def setup():
    tree = RadixTree(1, wire_hasher())
    tree.insert(tuple(range(100, 200)))  # a cached 100-token prefix
    tree.insert(tuple(range(100, 150)) + (7,) * 30)
    return tree, matcher(tree)


def names(rs):
    return [r.name for r in rs]


def test_lpm_longest_prefix_first_stable():
    tree, match = setup()
    q = [
        R("none", range(1000, 1010)),
        R("p50", list(range(100, 150)) + [1, 2]),
        R("p100", list(range(100, 200)) + [3]),
        R("p50b", list(range(100, 150)) + [5, 5]),
    ]
    assert names(order_waiting("lpm", q, tree, match)) == ["p100", "p50", "p50b", "none"]


def test_lpm_in_batch_dedup_sends_shared_uncached_prefixes_to_the_end():
    tree, match = setup()
    shared = list(range(500, 540))
    q = [R("a", shared + [1]), R("b", shared + [2]), R("c", range(900, 905)), R("d", shared + [3])]
    assert names(order_waiting("lpm", q, tree, match)) == ["a", "c", "b", "d"]


def test_lpm_in_batch_probe_is_a_page_1_tree_matched_on_the_whole_prompt():
    """0.5.23's in-batch probe tree is ``RadixCache.create_simulated()`` -- page size 1
    whatever the worker's -- matched on the whole prompt: at page 64, two uncached prompts
    sharing 40 tokens are duplicates (a page-64 probe floors the 40 to 0), and two
    identical 32-token prompts share all 32 (a ``len - 1`` cap finds 31, under the
    threshold)."""
    tree = RadixTree(64, wire_hasher())
    shared = list(range(500, 540))
    q = [R("a", shared + [1] * 30), R("b", shared + [2] * 30), R("c", range(900, 905))]
    assert names(order_waiting("lpm", q, tree, matcher(tree))) == ["a", "c", "b"]
    tree1, match1 = setup()
    same = list(range(600, 632))
    q = [R("a", same), R("b", same), R("c", range(900, 905))]
    assert names(order_waiting("lpm", q, tree1, match1)) == ["a", "c", "b"]


def test_hrrn_orders_by_prefilled_tokens_waited_over_uncached_tokens():
    """0.5.23 ``_sort_by_hrrn``: ratio = (processed − the request's value at entry) / its
    uncached prompt tokens, highest first; a fully cached prompt first; ties by rid."""
    tree, match = setup()
    q = [
        R("old-long", range(1000, 1400), entered=0),  # waited 800 over 400 uncached: 2
        R("new-short", range(2000, 2040), entered=700),  # waited 100 over 40: 2.5
        R("cached", list(range(100, 200)) + [7], entered=790),  # 1 uncached, waited 10: 10
        R("young", range(3000, 3100), entered=800),  # waited 0: ratio 0
        R("b-tie", range(4000, 4200), entered=400),  # 400 / 200: 2, rid after old-long
    ]
    got = names(order_waiting("hrrn", q, tree, match, processed_tokens=800))
    assert got == ["cached", "new-short", "b-tie", "old-long", "young"]
    # no token prefilled since any entered: every ratio 0, rid order
    got = names(order_waiting("hrrn", q, tree, match, processed_tokens=0))
    assert got == ["b-tie", "cached", "new-short", "old-long", "young"]


def test_hrrn_sends_in_batch_duplicates_last_and_falls_back_to_fcfs_beyond_128():
    tree, match = setup()
    shared = list(range(500, 540))
    q = [R("a", shared + [1]), R("b", shared + [2], entered=-1000), R("c", range(900, 905))]
    assert names(order_waiting("hrrn", q, tree, match, processed_tokens=10)) == ["c", "a", "b"]
    big = [R(f"r{i}", [1000 + i, 2], entered=i) for i in range(129)]
    assert names(order_waiting("hrrn", big, tree, match, processed_tokens=500)) == names(big)
    assert refreshes_waiting_prefixes("hrrn", 129) and not refreshes_waiting_prefixes("hrrn", 5)


def test_shortest_prefill_first_orders_by_uncached_work_and_never_falls_back():
    tree, match = setup()
    q = [
        R("long", range(1000, 1300)),  # 300 uncached
        R("hit", list(range(100, 200)) + list(range(7, 27))),  # 120 tokens, 100 cached: 20
        R("short", range(2000, 2050)),  # 50
        R("short2", range(3000, 3050)),  # 50: after "short" (queue order)
    ]
    spf = "shortest-prefill-first"
    assert names(order_waiting(spf, q, tree, match)) == ["hit", "short", "short2", "long"]
    big = [R(f"r{i}", range(10_000 * i + 1, 10_000 * i + 200 - i)) for i in range(1, 131)]
    assert names(order_waiting(spf, big, tree, match)) == names(big[::-1])  # no fcfs fallback
    assert not refreshes_waiting_prefixes(spf, 500)


def test_spf_chunk_limit_leaves_room_for_the_shorter_waiting_requests():
    """0.5.23 ``shortest_prefill_chunk_limit`` at page 4, a 256-token chunk budget."""
    tree, match = setup()
    chunked = R("chunked", range(5000, 5900))
    chunked.prefix_len = 256  # 644 tokens still to prefill
    q = [R("a", range(6000, 6030)), R("b", range(7000, 7061)), R("c", range(8000, 8400))]
    for r in q:
        match(r)
    # a: 30 -> 32 and b: 61 -> 64 tokens reserved; c (400) does not fit beside them
    assert spf_chunk_limit(chunked, q, 256, 4) == 256 - 96
    assert spf_chunk_limit(chunked, q, 4, 4) is None  # under two pages
    assert spf_chunk_limit(chunked, [q[2]], 256, 4) is None  # nothing reserved
    chunked.prefix_len = 880  # 20 left: no waiting request is shorter
    assert spf_chunk_limit(chunked, q, 256, 4) is None


def test_lpm_falls_back_to_fcfs_beyond_128():
    tree, match = setup()
    q = [R(f"r{i}", [1000 + i, 2]) for i in range(129)] + [R("hit", list(range(100, 200)) + [1])]
    assert names(order_waiting("lpm", q, tree, match)) == names(q)
    assert names(order_waiting("lpm", q[-128:], tree, match))[0] == "hit"


def test_lof_and_fcfs():
    tree, match = setup()
    q = [R("a", [1, 2], 5), R("b", [3, 4], 50), R("c", [5, 6], 50)]
    assert names(order_waiting("lof", q, tree, match)) == ["b", "c", "a"]
    assert names(order_waiting("fcfs", q, tree, match)) == ["a", "b", "c"]


def test_dfs_weight_heaviest_subtree_first_post_order():
    tree, match = setup()
    q = [
        R("x", range(1000, 1010)),
        R("deep1", list(range(100, 200)) + [1]),
        R("seven", list(range(100, 150)) + [7] * 30 + [1]),
        R("deep2", list(range(100, 200)) + [2]),
    ]
    order = names(order_waiting("dfs-weight", q, tree, match))
    assert order.index("deep1") < order.index("seven") and order.index("deep2") < order.index(
        "seven"
    )
    assert order[-1] == "x"  # the root's own requests come after its children's


def test_refresh_runs_only_under_a_cache_agnostic_active_policy():
    assert refreshes_waiting_prefixes("fcfs", 1) and refreshes_waiting_prefixes("lof", 1)
    assert not refreshes_waiting_prefixes("lpm", 128)
    assert refreshes_waiting_prefixes("lpm", 129)  # lpm's fcfs fallback
    assert not refreshes_waiting_prefixes("dfs-weight", 1000)  # never falls back
    # only under LRU eviction (0.5.23 checks ``radix_eviction_policy``): not counted either
    for eviction in ("lfu", "slru", "priority"):
        assert not refreshes_waiting_prefixes("fcfs", 1, eviction)
        assert not refreshes_waiting_prefixes("lpm", 129, eviction)


def test_refresh_touches_the_queue_head_last_over_the_whole_fill():
    tree = RadixTree(1, wire_hasher())
    x, y, z = tuple(range(10, 20)), tuple(range(30, 40)), tuple(range(50, 60))
    for p in (x, y, z):
        tree.insert(p)
    head, second = R("head", x), R("second", y + (1, 2))
    for r in (head, second):
        r.fill_len = len(r.fill)
    nodes = tree.num_nodes
    touch_waiting_prefixes([head, second], tree)
    # the whole fill, not len - 1: the head's exact 10-token match splits nothing
    assert tree.num_nodes == nodes
    evicted = []
    for _ in range(3):
        tree.evict(1)
        evicted += [
            n
            for n, p in (("x", x), ("y", y), ("z", z))
            if n not in evicted and not tree.peek_prefix_len(p)
        ]
    assert evicted == ["z", "y", "x"]  # untouched first, the head last


def test_the_command_line_offers_every_simulated_schedule_policy():
    from kvcadence.replay.config import POLICIES
    from tests.replay.helpers import replay_choices

    assert replay_choices("schedule_policy")[0] == POLICIES


def test_random_shuffles_with_the_schedulers_generator():
    """``random`` (0.5.23 ``_sort_randomly``): a shuffle of the queue drawn from the
    generator given (the replay's, seeded): the same seed, the same order."""
    import random

    tree, match = setup()
    q = [R(f"r{i}", [1000 + i, 2]) for i in range(8)]
    a = names(order_waiting("random", q, tree, match, rng=random.Random(7)))
    assert a == names(order_waiting("random", q, tree, match, rng=random.Random(7)))
    assert sorted(a) == sorted(names(q)) and a != names(q)
    assert refreshes_waiting_prefixes("random", 3)


def test_routing_key_puts_the_keys_running_most_first_then_the_others_by_key():
    """``routing-key`` (0.5.23 ``_sort_by_routing_key``): the waiting requests whose key a
    running request has first, the most running first (ties by key), then the others by
    key (none sorts as ""), stable; while no running request has a key, the queue is left
    as it is."""
    tree, match = setup()
    q = [
        R("n1", [1, 1]),
        R("z", [2, 2], key="zeta"),
        R("b1", [3, 3], key="beta"),
        R("a1", [4, 4], key="alpha"),
        R("b2", [5, 5], key="beta"),
        R("o", [6, 6], key="omega"),
        R("n2", [7, 7]),
    ]
    running = ["alpha", "beta", "beta", None]
    got = names(order_waiting("routing-key", q, tree, match, running_keys=running))
    assert got == ["b1", "b2", "a1", "n1", "n2", "o", "z"]
    assert names(order_waiting("routing-key", q, tree, match, running_keys=[None])) == names(q)
    assert refreshes_waiting_prefixes("routing-key", 3)


def test_random_as_recorded_follows_the_first_forwards_the_records_show():
    """The capture's own ``random`` policy: the worker's draws cannot be reproduced, but the
    records say in which order the requests won them (their first forward), so the waiting
    requests go in that order, those without a recorded entry last, shuffled."""
    import random

    tree, match = setup()
    q = [R("a", [1, 1], entry=5.0), R("b", [2, 2]), R("c", [3, 3], entry=2.0)]
    q += [R("d", [4, 4], entry=3.5), R("e", [5, 5])]
    got = names(order_waiting("random", q, tree, match, rng=random.Random(1), as_recorded=True))
    assert got[:3] == ["c", "d", "a"] and sorted(got[3:]) == ["b", "e"]


def test_namespaces_match_apart_and_dfs_weight_sees_their_nodes_under_the_root():
    """Requests in a cache namespace (``ns``) match only their namespace's subtree; lpm's
    in-batch probe tree is keyed by namespace too (two requests sharing an uncached prefix
    in different namespaces are not de-prioritised); dfs-weight orders the namespaces' first
    nodes as the root's children, and a request that matched nothing in its namespace
    comes with the root's own, last (SGLang's one root)."""
    from kvcadence.format.namespace import Namespace

    tree, _ = setup()
    a, b = Namespace(cache_salt="a"), Namespace(extra_key="b")
    tree.insert(tuple(range(300, 340)), root=tree.root_of(a))

    match = matcher(tree)

    q = [
        R("x", range(1000, 1010)),  # matches nothing: the root's own
        R("b-none", list(range(100, 200)) + [9], ns=b),  # the default's prefix: not b's
        R("a1", list(range(300, 340)) + [1], ns=a),
        R("plain", list(range(100, 200)) + [3]),
        R("a2", list(range(300, 340)) + [2], ns=a),
    ]
    assert names(order_waiting("lpm", q, tree, match)) == ["plain", "a1", "a2", "x", "b-none"]
    assert [r.prefix_len for r in q] == [0, 0, 40, 100, 40]
    order = names(order_waiting("dfs-weight", q, tree, match))
    assert order[:2] == ["a1", "a2"] and order[-2:] == ["x", "b-none"]  # with the root's own
    shared = list(range(500, 540))
    dup = [R("s1", shared + [1], ns=a), R("s2", shared + [2], ns=a), R("s3", shared + [3], ns=b)]
    # s2 shares s1's uncached prefix in its namespace (de-prioritised), s3 in another (kept)
    assert names(order_waiting("lpm", dup, tree, match)) == ["s1", "s3", "s2"]
