"""Output and session inference for records without output ids (``replay/outputs.py``,
``sessions.py``, ``production.py``) on hand-built event streams: a finish store merged
with the next request's prefill store (tail merging), published by another DP rank, at
page size 4 with a partial prompt page, a prompt the stream never saw, outputs that fill
no page, opaque rids, and a round trip through the simulator."""

from __future__ import annotations

import random
from array import array

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.format.hashes import block_hashes
from kvcadence.format.schema import BlockStored, RequestRecord
from kvcadence.replay.outputs import StoreIndex
from kvcadence.replay.production import WHY_NO_PAGE, complete_records, needs_completion
from kvcadence.replay.schedule import AFTER_KEY, build_schedule
from kvcadence.replay.sessions import Node, infer_clients, median_wait
from kvcadence.replay.storepass import WHY_NO_FINISH, WHY_NO_IDS, WHY_NO_PROMPT
from kvcadence.replay.tokens import CODE, compact
from tests.replay.helpers import config, lane_chain, run

S = 1_000_000_000


def rec(
    rid: str, prompt: list[int], n: int, recv_s: float, fin_s: float, cached: int | None = None
) -> RequestRecord:
    return RequestRecord(
        rid=rid,
        input_ids=prompt,
        cached_tokens=cached,
        completion_tokens=n,
        max_new_tokens=n,
        source="sglang-metrics",
        meta_info={"request_received_ts": recv_s, "request_finished_ts": fin_s},
    )


def store(seq: list[int], start: int, end: int, ps: int, salt: str | None = None) -> BlockStored:
    """The store of pages ``[start, end)`` of ``seq`` (page indices), chained from the root
    (from ``salt``'s seed, and carrying it, with a ``cache_salt``)."""
    hs = block_hashes(seq[: end * ps], ps, salt)
    return BlockStored(
        block_hashes=hs[start:end],
        parent_block_hash=hs[start - 1] if start else None,
        token_ids=seq[start * ps : end * ps],
        block_size=ps,
        lora_id=None,
        cache_salt=salt,
    )


def merged(a: BlockStored, b: BlockStored) -> BlockStored:
    assert b.parent_block_hash == a.block_hashes[-1]
    return msgspec.structs.replace(
        a, block_hashes=a.block_hashes + b.block_hashes, token_ids=a.token_ids + b.token_ids
    )


def write_payloads(path, payloads) -> None:
    """A bundle at ``path`` whose event frames are ``payloads``, msgpack-encoded as they are
    (one frame each, seq = position): the index's decode paths see exactly these bytes."""
    from kvcadence.format.bundle import BundleWriter
    from tests.analysis.helpers import T0, header

    with BundleWriter(path, header()) as w:
        for seq, pl in enumerate(payloads):
            w.write_event(
                endpoint=0,
                seq=seq,
                recv_ns=T0 + seq,
                topic="kv-events",
                payload=msgspec.msgpack.encode(pl),
                via=0,
                epoch=0,
            )


def test_finish_store_merged_with_next_prefill_on_another_rank():
    ps = 1
    a = list(range(10, 16))  # 6 prompt tokens
    out_a = [50, 51, 52]
    b = a + out_a + [60, 61]
    out_b = [70, 71]
    seq_b = b + out_b
    batches = [
        (int(1.0 * S), [store(a, 0, 6, ps)]),
        # rank 1: A's finish store (2 pages: the last output token is never stored) and B's
        # prefill store (its prompt from A's last output on) in one event
        (int(2.0 * S), [merged(store(a + out_a, 6, 8, ps), store(b, 8, 11, ps))]),
        (int(3.1 * S), [store(seq_b, 11, 12, ps)]),
    ]
    idx = StoreIndex.from_batches(batches, ps)
    recs = [
        rec("9f2c", a, 3, 0.5, 1.9, cached=0),
        rec("01ab", b, 2, 1.95, 3.0, cached=8),
        rec("77ee", [900, 901, 902], 2, 1.0, 1.5),  # never stored: capture started late
    ]
    assert needs_completion(recs)
    out, rep = complete_records(recs, idx)
    assert out[0].output_ids == out_a  # 2 from the merged event, 1 from B's prompt
    assert out[1].output_ids[:1] == out_b[:1] and len(out[1].output_ids) == 2
    assert len(out[2].output_ids) == 2
    assert (out[1].session, out[1].turn) == (out[0].session, 1) and out[0].turn == 0
    assert out[1].lane == out[0].lane
    assert out[2].session not in (out[0].session,)
    assert rep["outputs_from_events"] == 2 and rep["outputs_from_next_prompt"] == 1
    assert rep["finish_stores_in_merged_events"] == 1
    assert rep["outputs_synthetic"] == {WHY_NO_PROMPT: 1}
    assert rep["with_predecessor"] == 1 and rep["sessions"] == 2
    # rids are opaque: other rids, the same inference
    renamed = [msgspec.structs.replace(r, rid=f"x{i}") for i, r in enumerate(recs)]
    out2, rep2 = complete_records(renamed, idx)
    assert rep2 == rep
    assert [(r.session, r.turn) for r in out2] == [(r.session, r.turn) for r in out]
    assert out2[0].output_ids == out[0].output_ids
    # clients that reuse one rid for everything: still the same inference
    same = [msgspec.structs.replace(r, rid="req") for r in recs]
    out3, rep3 = complete_records(same, idx)
    assert rep3 == rep and out3[0].output_ids == out_a and out3[1].output_ids[0] == out_b[0]
    assert [(r.session, r.turn) for r in out3] == [(r.session, r.turn) for r in out]


def test_text_prompt_without_ids_is_reported_and_refused_in_one_line(tmp_path):
    from kvcadence.errors import InputError
    from kvcadence.replay.simulator import simulate

    recs = [rec("t", [], 4, 0.5, 0.9), rec("u", [5, 6, 7], 2, 0.5, 0.9, cached=0)]
    _, rep = complete_records(recs, StoreIndex.from_batches([], 1))
    assert rep["outputs_synthetic"][WHY_NO_IDS] == 1
    with pytest.raises(InputError, match="'t': no input_ids recorded .*text prompt"):
        simulate(recs, config())


def test_page_four_partial_prompt_page_and_prefill_finish_merge():
    ps = 4
    a = list(range(100, 110))  # 10 tokens: 2 full pages + a 2-token tail
    out_a = list(range(200, 209))  # 9 outputs: (10 + 9 - 1) // 4 = 4 pages -> 2 new pages
    b = a + out_a + [300, 301, 302, 303, 304]
    # A's prefill store and its finish store in one event (nothing queued in between)
    ev = merged(store(a, 0, 2, ps), store(a + out_a, 2, 4, ps))
    idx = StoreIndex.from_batches([(int(1.0 * S), [ev]), (int(1.3 * S), [store(b, 4, 6, ps)])], ps)
    short = rec("c", list(range(400, 406)), 2, 0.1, 0.2)  # 6 + 2 - 1 = 7 tokens: no new page
    idx2 = StoreIndex.from_batches(
        [(int(1.0 * S), [ev]), (int(0.15 * S), [store(short.input_ids, 0, 1, ps)])], ps
    )
    recs = [rec("a", a, 9, 0.5, 0.99, cached=0), rec("b", b, 6, 1.2, 1.5, cached=16)]
    out, rep = complete_records(recs, idx)
    # pages 2..3 hold a's 2-token tail and its first 6 outputs; the rest from b's prompt
    assert out[0].output_ids == out_a
    assert out[1].turn == 1 and out[1].session == out[0].session
    assert rep["outputs_from_events"] == 1  # b's finish store (1 page) is not in the stream
    assert rep["outputs_synthetic"] == {WHY_NO_FINISH: 1}
    out, rep = complete_records([*recs, short], idx2)
    assert rep["unstored_tail_synthetic"] == {WHY_NO_PAGE: 1}


def test_finish_store_is_the_one_published_after_the_finish():
    """Two requests with the same prompt and different outputs (sampling): each gets the
    finish store published at or after its own finish."""
    ps = 1
    p = [5, 6, 7, 8]
    o1, o2 = [20, 21, 22], [30, 31, 32]
    batches = [
        (int(1.0 * S), [store(p, 0, 4, ps)]),
        (int(2.0 * S), [store(p + o1, 4, 6, ps)]),
        (int(4.0 * S), [store(p + o2, 4, 6, ps)]),
    ]
    idx = StoreIndex.from_batches(batches, ps)
    out, _ = complete_records([rec("r1", p, 3, 0.5, 1.99), rec("r2", p, 3, 3.0, 3.98)], idx)
    assert out[0].output_ids[:2] == o1[:2] and out[1].output_ids[:2] == o2[:2]


def _roundtrip(ps: int) -> None:
    base = list(range(3, 40))
    lanes = []
    for lane in range(3):
        p = base + [100 * (lane + 1) + i for i in range(5 + lane)]
        turns = []
        for t in range(4):
            turns.append((p, 6 + 3 * t + lane))
            p = p + [1000 + 7 * t + i for i in range(turns[-1][1])] + [2000 + lane, 2001 + t]
        lanes += lane_chain(lane, turns, gap_ms=0.0)
    # the next turn's prompt holds the real output
    by_lane: dict[int, list] = {}
    for r in lanes:
        by_lane.setdefault(r.lane, []).append(r)
    for rs in by_lane.values():
        for a, b in zip(rs, rs[1:], strict=False):
            a.output_ids = b.input_ids[len(a.input_ids) : len(a.input_ids) + len(a.output_ids)]
    res = run(lanes, config(page_size=ps, max_total_tokens=400))
    from kvcadence.format import wire

    decoded = [wire.decode_batch(b.payload) for b in res.batches]
    batches = [(int(d.ts * 1e9), d.events) for d in decoded]
    idx = StoreIndex.from_batches(batches, ps)
    stripped = [
        msgspec.structs.replace(
            s, rid=f"{i:x}", output_ids=[], lane=None, session=None, turn=None, think_ns=None
        )
        for i, s in enumerate(res.requests)
    ]
    out, rep = complete_records(stripped, idx)
    assert rep["outputs_synthetic"] == {}, rep
    assert rep["outputs_from_events"] == 12 and rep["finish_stores_in_merged_events"] > 0
    for o, s in zip(out, res.requests, strict=True):
        n_stored = (len(s.input_ids) + len(s.output_ids) - 1) // ps * ps - len(s.input_ids)
        assert o.output_ids[: max(n_stored, 0)] == s.output_ids[: max(n_stored, 0)]
    truth = {(s.lane, s.turn): o for o, s in zip(out, res.requests, strict=True)}
    for (lane, turn), o in truth.items():
        if turn:
            prev = truth[(lane, turn - 1)]
            assert (o.session, o.turn) == (prev.session, prev.turn + 1)
            assert o.output_ids == res.requests[out.index(o)].output_ids or turn == 3


def test_roundtrip_through_the_simulator_page_1():
    _roundtrip(1)


def test_roundtrip_through_the_simulator_page_4():
    _roundtrip(4)


def test_session_starts_join_a_client_only_within_the_gap_bound():
    """Two sessions one after the other: the second's first turn joins the first's client
    when it follows its last turn by about a think time, and arrives open loop when it
    comes much later (more than 10 median think times; the only-idle-client rule does not
    apply: that client never came back before)."""
    ps = 1
    p1 = list(range(10, 20))
    o1 = [50, 51, 52]
    p2 = p1 + o1 + [60, 61]
    q1 = list(range(200, 210))

    def stream(q_at: float) -> StoreIndex:
        return StoreIndex.from_batches(
            [
                (int(0.1 * S), [store(p1, 0, 10, ps)]),
                (int(0.21 * S), [store(p1 + o1, 10, 12, ps)]),
                (int(0.3 * S), [store(p2, 12, 15, ps)]),
                (int((q_at + 0.05) * S), [store(q1, 0, 10, ps)]),
            ],
            ps,
        )

    for q_at, joined in ((0.45, True), (3.0, False)):
        recs = [
            rec("a", p1, 3, 0.05, 0.2, cached=0),
            rec("b", p2, 2, 0.25, 0.4, cached=12),  # think time 50 ms
            rec("c", q1, 2, q_at, q_at + 0.2, cached=0),
        ]
        out, rep = complete_records(recs, stream(q_at))
        assert out[1].session == out[0].session and out[2].session != out[0].session
        assert (out[2].lane == out[0].lane) is joined
        assert rep["clients"] == (1 if joined else 2)


def _sessions(spans_ms: list[tuple[float, float]]) -> list[Node]:
    """One single-request session per ``(arrival, finish)`` in ms."""
    return [Node(int(a * 1e6), int(f * 1e6)) for a, f in spans_ms]


#: two closed-loop clients A and B (think 30 ms, bound 300 ms); A pauses ``pause`` ms
#: before its third session while B is in a session
def _two_clients(pause: float, first_joined: bool = True) -> list[Node]:
    a0 = (0, 1000) if first_joined else (0, 2000)
    spans = [a0, (10, 1500)]
    if first_joined:
        spans.append((1030, 2000))  # A's second session: joins A's first (30 ms)
    spans += [(1530, 3000), (2000 + pause, 3600), (3030, 4000)]
    return _sessions(spans)


@pytest.mark.parametrize(
    ("pause", "first_joined", "joined"),
    [
        (350, True, True),  # the only idle client, 350 ms < the median wait (377 ms)
        (400, True, False),  # past the median wait (377 ms; the median interval is 630)
        (700, True, False),  # past the median wait (392 ms)
        (350, False, False),  # A never came back before: no evidence of a closed loop
    ],
)
def test_a_long_pause_joins_only_the_only_idle_client(pause, first_joined, joined):
    """A session start past the think-time bound joins the client whose session ended
    last only when that client is the only idle one (every other session end joined), has
    come back before, and the gap is at most the median wait from a given moment to the
    next session start (``median_wait``); else it arrives open loop (the old rule: always
    open loop past the bound)."""
    nodes = _two_clients(pause, first_joined)
    late = 4 if first_joined else 3
    links, idle = infer_clients(nodes, 300 * 1_000_000)
    assert links[late] == ((late - 2) if joined else None)
    assert idle == int(joined)
    assert links[-1] == late - 1  # B's next session: within the bound, as before


@pytest.mark.parametrize(
    ("flush_ms", "joined"),
    [
        (None, False),  # 5 s after the last session end: past the bound, a new client
        (4900, True),  # a flush 100 ms before it: the pause is counted from the flush
        (4500, False),  # 500 ms after the flush: past the bound either way
        (500, False),  # the flush came before the session end: counted from the end
    ],
)
def test_a_pause_across_a_flush_is_counted_from_the_flush(flush_ms, joined):
    """SGLang flushes only an idle worker, and the replay releases a turn that crosses a
    flush at its recorded offset from it: a session start after a recorded flush joins the
    client whose session ended before the flush when it came within the think-time bound
    of the flush (``flush2``: the driver's 7.0 s flush pause, a 5th client before)."""
    nodes = _sessions([(0, 1000), (10, 1500), (1530, 2000), (5000, 5600)])
    flushes = () if flush_ms is None else (int(flush_ms * 1e6),)
    links, idle = infer_clients(nodes, 300 * 1_000_000, flushes_ns=flushes)
    assert links[2] == 1  # B's next session: within the bound, as before
    assert links[3] == (2 if joined else None) and idle == 0


def test_median_wait_is_the_forward_wait_not_the_median_interval():
    """The median wait from a moment independent of the arrivals to the next one: half an
    interval for regular arrivals, far more than the median interval for bunched ones (a
    moment falls into a long interval more often)."""
    assert median_wait([]) == 0
    assert median_wait([100, 100, 100, 100]) == 50
    assert median_wait([10, 10, 980]) == 480  # the median interval: 10
    assert median_wait([0, 0]) == 0


@pytest.mark.parametrize(("pause", "joined"), [(400, True), (500, True), (600, False)])
def test_a_long_pause_among_bunched_session_starts_joins_the_only_idle_client(pause, joined):
    """Three closed-loop clients start their sessions in bursts (10 ms apart, a burst a
    second): the median interval between session starts is 10 ms, but a moment independent
    of the starts waits a median 524-549 ms for the next one. Client A, the only idle one,
    comes back ``pause`` ms after its session (past the 300 ms think-time bound) while B and
    C are in long sessions: it joins A up to the median wait (the median interval alone kept
    every such pause open loop: ``p1-retract-noeos-nooverlap``'s 9.3 s pause against a
    6.0 s median interval and a 9.4 s median wait)."""
    spans: list[tuple[float, float]] = []
    for burst in range(4):
        for k in range(3):
            a = burst * 1000 + 10 * k
            spans.append((a, 10_000 if burst == 3 and k else a + 950))
    spans.append((3950 + pause, 4450 + pause))
    links, idle = infer_clients(_sessions(spans), 300 * 1_000_000)
    assert links[:12] == [None, None, None, 2, 1, 0, 5, 4, 3, 8, 7, 6]  # the think-time joins
    assert links[12] == (9 if joined else None) and idle == int(joined)


@pytest.mark.parametrize("flush", [True, False])
def test_a_session_start_within_the_clients_pause_across_a_flush_joins_a_client(flush):
    """A flush at 2.1 s; A's next turn came 500 ms after it (past the 300 ms think-time
    bound: the clients paused across the flush). A session start 480 ms after the flush
    joins the client whose session ended last before it, as A's turn resumed its session
    (``dp2-p4-flush``: two open-loop clients more before); one 600 ms after it, past that
    pause, arrives open loop. Without the flush both are past every bound."""
    nodes = _sessions([(0, 1000), (2600, 3000), (10, 1500), (20, 1600), (2580, 3100), (2700, 3200)])
    nodes[1].pred = 0
    nodes[0].has_successor = True
    flushes = (int(2.1 * S),) if flush else ()
    links, idle = infer_clients(nodes, 300 * 1_000_000, flushes_ns=flushes)
    assert links[4] == (3 if flush else None) and links[5] is None and idle == 0


def test_an_unjoined_session_end_keeps_a_long_pause_open_loop():
    """An open-loop session (nobody follows it) leaves its end unjoined: from then on no
    client is the *only* idle one, so a long pause is a new client, as before."""
    nodes = _two_clients(400) + _sessions([(100, 700)])
    links, idle = infer_clients(nodes, 300 * 1_000_000)
    assert links[4] is None and idle == 0
    assert links[2] == 0 and links[5] == 3  # the think-time joins stay


def _open_loop(rate: float, seed: int, n: int = 200) -> list[Node]:
    """``n`` open-loop sessions (Poisson arrivals at ``rate`` per second) of 1-3 turns,
    each turn 0.5-3 s, ~30 ms think time between turns: nobody waits on another session."""
    rng = random.Random(seed)
    nodes: list[Node] = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        a, prev = t, None
        for _ in range(rng.randint(1, 3)):
            f = a + rng.uniform(0.5, 3.0)
            nodes.append(Node(int(a * S), int(f * S), pred=prev))
            if prev is not None:
                nodes[prev].has_successor = True
            prev = len(nodes) - 1
            a = f + rng.expovariate(1 / 0.03)
    return nodes


@pytest.mark.parametrize("rate", [0.1, 0.3, 1.0, 3.0])
def test_open_loop_arrivals_never_join_as_the_only_idle_client(rate):
    """Open-loop traffic leaves session ends nobody joins, so no client is ever the only
    idle one: the only joins are the think-time bound's (arrivals landing within 10 think
    times of a session end, as before)."""
    for seed in range(5):
        nodes = _open_loop(rate, seed)
        links, idle = infer_clients(nodes, 300 * 1_000_000)
        assert idle == 0
        for q, c in enumerate(links):
            if c is not None:
                assert nodes[q].arrival_ns - nodes[c].finish_ns <= 300 * 1_000_000


def test_a_prompt_anchor_inside_a_shared_system_prompt_links_no_other_session():
    """Page 4, a 10-token system prompt every session shares: a first turn of 11 tokens has
    its last full page (its prompt anchor, tokens 0..7) inside the system prompt, and its
    1-token output stores nothing (the end anchor is that page too). Another session's
    start passes through that page but does not hold the first turn's whole prompt (token
    10 differs): no predecessor (the anchor alone linked it). The first turn's real next
    turn, which repeats its prompt, is linked."""
    ps = 4
    system = list(range(100, 110))
    a = [*system, 500]  # 11 tokens: 2 full pages, both inside the system prompt
    out_a = [600]
    a2 = [*a, *out_a, 700, 701, 702, 703]  # a's next turn: 16 tokens
    b = [*system, 800, 801, 802]  # another session's start: 13 tokens
    index = StoreIndex.from_batches(
        [
            (int(0.1 * S), [store(a, 0, 2, ps)]),
            (int(0.45 * S), [store(b, 2, 3, ps)]),
            (int(0.65 * S), [store(a2, 2, 4, ps)]),
        ],
        ps,
    )
    recs = [
        rec("a", a, 1, 0.05, 0.2, cached=0),
        rec("b", b, 1, 0.4, 0.5, cached=8),
        rec("a2", a2, 1, 0.6, 0.7, cached=8),
    ]
    out, rep = complete_records(recs, index)
    assert out[1].turn == 0 and out[1].session != out[0].session
    assert (out[2].session, out[2].turn) == (out[0].session, 1)
    assert rep["with_predecessor"] == 1


def test_ambiguous_predecessor_is_counted():
    """Two finished requests with the same stored sequence (same prompt, one output token:
    nothing of it stored) both lie at the deepest anchor of a later prompt: the tie rule
    picks one (the later finish) and the report counts the pick as ambiguous; a later
    prompt with a single candidate is no tie."""
    ps = 1
    p1 = list(range(10, 20))
    p2 = p1 + [70, 71]
    p3 = p2 + [80]
    index = StoreIndex.from_batches(
        [
            (int(0.1 * S), [store(p1, 0, 10, ps)]),
            (int(0.45 * S), [store(p2, 10, 12, ps)]),
        ],
        ps,
    )
    recs = [
        rec("a", p1, 1, 0.05, 0.2, cached=0),
        rec("a2", p1, 1, 0.15, 0.3, cached=10),  # fully cached: stored nothing
        rec("b", p2, 1, 0.4, 0.5, cached=10),
        rec("c", p3, 1, 0.6, 0.7, cached=12),  # only b ends at its deepest anchor
    ]
    out, rep = complete_records(recs, index)
    assert rep["with_predecessor"] == 2 and rep["predecessor_ties"] == 1
    assert (out[2].session, out[2].turn) == (out[1].session, 1)  # a2: the later finish
    assert (out[3].session, out[3].turn) == (out[1].session, 2)


def test_index_skips_what_the_checked_decode_refuses(tmp_path):
    """Stored token ids are decoded once (``decode_batch_raw(check_tokens=False)``); where
    they are not int arrays the frame gets the checked decode's verdict, as before: bigram
    keys and another page size's store are skipped (the frame's other stores kept, the
    frame scanned for flushes), ids that are no array refuse the whole frame; a uint64
    hash is read as the int64 of the same bits; hashes of 9 bytes that are not ints
    (float64: their type bytes are checked for all events at once) skip their store."""
    from kvcadence.format.bundle import BundleReader
    from kvcadence.replay.flushes import FlushScan

    def ev(h: float, toks: object, size: int = 1) -> dict:
        return {
            "type": "BlockStored",
            "block_hashes": [h],
            "parent_block_hash": None,
            "token_ids": toks,
            "block_size": size,
            "lora_id": None,
        }

    frames = [
        [ev(1, [5])],
        [ev(2, [[1, 2]]), ev(3, [7])],  # bigram keys
        [ev(4, [1, 2, 3, 4], size=4), ev(5, [8])],  # another page size
        [ev(6, "not an array"), ev(7, [9])],  # refused by decode_batch: nothing of it
        [ev(2**64 - 5, [6])],  # a uint64 wire hash: the int64 of the same bits
        [ev(1.5, [4]), ev(8, [3])],  # a float64 hash (9 bytes, as an int64's)
    ]
    write_payloads(tmp_path / "b", [[1.0 + seq, evs, None] for seq, evs in enumerate(frames)])
    rd = BundleReader(tmp_path / "b")
    scan = FlushScan(rd.header)
    index = StoreIndex.from_reader(rd, 1, scan)
    got = [(index.hashes_of(i), e.tokens) for i, e in enumerate(index.events)]
    assert got == [([1], [5]), ([3], [7]), ([5], [8]), ([-5], [6]), ([8], [3])]
    assert len(scan.lag[0]) == 5  # the refused frame is not scanned either


def test_index_frames_decoded_with_their_payload_index_as_the_checked_path(tmp_path):
    """``from_reader`` decodes the common event frame with its payload in one pass
    (``events_and_notes(events_as=...)``); a frame that struct refuses (a clear, a 2-element
    batch, ids that are no ints) comes as ``EventFrame``. Either way the index and the
    flushes are what every frame through ``stored.payload_stores`` gives."""
    from kvcadence.format.bundle import BundleReader
    from kvcadence.format.schema import EventFrame, EventFrameIdsView
    from kvcadence.replay.flushes import FlushScan

    def ev(h: int, toks: object, parent: int | None = None, size: int = 1) -> dict:
        return {
            "type": "BlockStored",
            "block_hashes": [h],
            "parent_block_hash": parent,
            "token_ids": toks,
            "block_size": size,
            "lora_id": None,
        }

    removed = {"type": "BlockRemoved", "block_hashes": [2**40 + 1]}
    payloads = [
        [1.0, [ev(2**40 + 1, [5]), removed], None],  # typed: a 64-bit hash
        [2.0, [ev(3, [6], 2**40 + 1), ev(-(2**50), [7], 3)], 0],  # a small hash, then 64-bit
        [3.0, [ev(4, [1, 2, 3, 4], size=4), ev(5, [8])], None],  # another page size: skipped
        [4.0, [{"type": "AllBlocksCleared"}, ev(6, [9])], None],  # a clear: EventFrame
        [5.0, [ev(7, [10])]],  # no attn_dp_rank: EventFrame, refused by the wire layer
        [6.0, [ev(8, [[1, 2]]), ev(9, [11])], None],  # bigram keys: EventFrame
    ]
    write_payloads(tmp_path / "b", payloads)
    got = list(BundleReader(tmp_path / "b").events_and_notes((), events_as=EventFrameIdsView))
    assert [type(f) for f in got] == [EventFrameIdsView] * 3 + [EventFrame] * 3

    class Plain:  # the same reader, every frame as EventFrame
        def __init__(self, rd):
            self.rd, self.header = rd, rd.header

        def events_and_notes(self, kinds, events_as=None):
            return self.rd.events_and_notes(kinds)

    def content(rd):
        scan = FlushScan(rd.header)
        idx = StoreIndex.from_reader(rd, 1, scan)
        evs = [(e.ts_ns, e.parent, idx.hashes_of(i), e.tokens) for i, e in enumerate(idx.events)]
        return evs, scan.result(), scan.lag

    typed = content(BundleReader(tmp_path / "b"))
    assert typed == content(Plain(BundleReader(tmp_path / "b")))
    assert [(e[2], e[3]) for e in typed[0]] == [
        ([2**40 + 1], [5]),
        ([3], [6]),
        ([-(2**50)], [7]),
        ([5], [8]),
        ([6], [9]),
        ([9], [11]),
    ]


def test_index_pass_reads_notes_raw_and_finds_the_same_flushes(tmp_path):
    """The production pass reads notes with their data undecoded
    (``BundleReader.events_and_notes``); the flush scan decodes only the flush kinds' data
    and finds what ``recorded_flushes`` finds: a failed ``flush_cache`` is no flush, a
    successful one is at its ``finish_ns``, other notes are ignored."""
    from kvcadence.format.bundle import BundleReader, BundleWriter
    from kvcadence.format.schema import Annotation, AnnotationRawView, EventFrame
    from kvcadence.replay.flushes import FlushScan, RecordedFlush, recorded_flushes
    from tests.analysis.helpers import T0, header

    stored = {
        "type": "BlockStored",
        "block_hashes": [11],
        "parent_block_hash": None,
        "token_ids": [5],
        "block_size": 1,
        "lora_id": None,
    }
    notes = [
        Annotation(kind="visibility", recv_ns=T0 + 1, data={"computed_pass": [0] * 50}),
        Annotation(kind="flush_cache", recv_ns=T0 + 2, data={"ok": False, "finish_ns": T0 + 3}),
        Annotation(kind="flush_cache", recv_ns=T0 + 4, data={"ok": True, "finish_ns": T0 + 5}),
        Annotation(kind="k" * 40, recv_ns=T0 + 6, data={"x": 1}),  # a str8 kind
    ]
    with BundleWriter(tmp_path / "b", header()) as w:
        w.write_event(
            endpoint=0,
            seq=0,
            recv_ns=T0,
            topic="kv-events",
            payload=msgspec.msgpack.encode([1.0, [stored], None]),
            via=0,
            epoch=0,
        )
        for n in notes:
            w.write(n)
    got = list(BundleReader(tmp_path / "b").events_and_notes())
    assert [type(r) for r in got] == [EventFrame] + [AnnotationRawView] * 4
    assert [(r.kind, r.recv_ns, msgspec.msgpack.decode(r.data)) for r in got[1:]] == [
        (n.kind, n.recv_ns, n.data) for n in notes
    ]
    # only some kinds: the others are skipped by their first bytes, in order otherwise
    for kinds, want_notes in (
        (("flush_cache",), notes[1:3]),
        (("k" * 40, "visibility"), [notes[0], notes[3]]),
        ((), []),
    ):
        some = list(BundleReader(tmp_path / "b").events_and_notes(kinds))
        assert type(some[0]) is EventFrame
        assert [(r.kind, r.recv_ns) for r in some[1:]] == [(n.kind, n.recv_ns) for n in want_notes]
    rd = BundleReader(tmp_path / "b")
    scan = FlushScan(rd.header)
    index = StoreIndex.from_reader(rd, 1, scan)
    assert [(index.hashes_of(i), e.tokens) for i, e in enumerate(index.events)] == [([11], [5])]
    want = [RecordedFlush(T0 + 5)]
    assert scan.result() == want == recorded_flushes(BundleReader(tmp_path / "b"))


def test_a_prompt_that_parts_inside_an_answer_follows_it():
    """A next turn whose cached prefix ends inside its predecessor's answer (the client sent
    back text that tokenizes otherwise a few tokens in) attaches its prefill to a middle page
    of that request's finish store, on neither of its anchors: that request is its
    predecessor while it has no next turn yet and was finished when it arrived."""
    import numpy as np

    from kvcadence.replay.sessions import infer_predecessors

    P, O1, O2, E, X1, X2, Y1 = (101, 102, 103, 104, 105, 106, 107)
    # event 0: R's finish store (its prompt's last page P, then three answer pages), event
    # 1: Q's prefill past O1, event 2: another prefill past O1
    hashes = np.array([P, O1, O2, E, X1, X2, Y1], np.int64)
    offs = [0, 4, 6]

    def nodes(q_arrival: int, second: bool = False) -> list[Node]:
        r = Node(0, 10, prompt_anchor=P, end_anchor=E, out_run=(0, 1, 3))
        q = Node(q_arrival, 40, segs=[(0, 1, 0, 2)], base=O1)
        out = [r, q]
        if second:  # a later prompt through the same part of R's answer
            out.append(Node(q_arrival + 5, 50, segs=[(0, 2, 0, 1)], base=O1))
        return out

    ns = nodes(20)
    infer_predecessors(ns, hashes, offs)
    assert ns[1].pred == 0 and ns[0].has_successor
    ns = nodes(5)  # R not finished yet when Q arrived
    infer_predecessors(ns, hashes, offs)
    assert ns[1].pred is None
    ns = nodes(20, second=True)  # R's next turn is Q: the later one continues another answer
    infer_predecessors(ns, hashes, offs)
    assert (ns[1].pred, ns[2].pred) == (0, None)
    ns = nodes(20)
    infer_predecessors(ns, hashes, offs, extends=lambda q, r: False)  # Q lacks R's prompt
    assert ns[1].pred is None
    ns = nodes(20)
    ns[0].out_run = None  # no finish store found for R: nothing to attach inside
    infer_predecessors(ns, hashes, offs)
    assert ns[1].pred is None


def test_anchors_are_looked_up_a_slice_at_a_time(monkeypatch):
    """``anchors.anchor_positions`` (looked up a slice at a time) gives what one pass over
    all of them gives, whatever the slice."""
    import numpy as np

    from kvcadence.format.hashes import norm_hash
    from kvcadence.replay import anchors, sieve

    rng = random.Random(5)
    hashes = [rng.getrandbits(64) - (1 << 63) * rng.getrandbits(1) for _ in range(200)]
    want = [norm_hash(h) for h in hashes]
    arr = np.array(want, np.int64)
    nodes = [Node(0, 1, end_anchor=want[i], prompt_anchor=want[i + 1]) for i in (3, 50, 51, 198)]
    whole = anchors.anchor_positions(nodes, arr)
    assert whole[0] == [3, 4, 50, 51, 52, 198, 199]
    for size in (1, 3, 64, 1 << 15):
        monkeypatch.setattr(sieve, "SLICE", size)
        assert anchors.anchor_positions(nodes, arr) == whole


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_index_columns_are_the_stores_in_publish_order(data):
    """``StoreIndex._extend`` over ``stored.StoreRows`` (every store's hashes and tokens end
    to end in two buffers): the stores in publish order (stable within a time), gathered
    when the pass met them out of order, a store with a hash that is not a 64-bit int left
    out, wide ids kept as their own -- as sorting and filtering the stores one by one
    gives, whatever the gather's chunk."""
    import numpy as np

    from kvcadence.format.hashes import norm_hash
    from kvcadence.replay import outputs, stored
    from kvcadence.replay.stored import StoreRows

    ps = data.draw(st.sampled_from([1, 2, 4]))
    rows = StoreRows()
    expect = []
    for k in range(data.draw(st.integers(0, 14))):
        pages = data.draw(st.integers(1, 4))
        hs = data.draw(
            st.lists(st.integers(-(1 << 63), (1 << 64) - 1), min_size=pages, max_size=pages)
        )
        wide = data.draw(st.integers(0, 5)) == 0
        toks = data.draw(
            st.lists(
                st.sampled_from([1, 7, 1 << 40]) if wide else st.integers(0, 9),
                min_size=pages * ps,
                max_size=pages * ps,
            )
        )
        ts = data.draw(st.integers(0, 5))
        blob = bytearray(stored.packed(hs))
        bad = data.draw(st.integers(0, 6)) == 0
        if bad:  # one hash a float64: 0xcb and 8 bytes, as 9-byte wide as an int's
            blob[9 * data.draw(st.integers(0, pages - 1))] = 0xCB
        rows.add(
            ts, k, k, bytes(blob), pages, toks if data.draw(st.booleans()) else compact(toks), None
        )
        if not bad:
            expect.append((ts, k, [norm_hash(h) for h in hs], toks))
    expect.sort(key=lambda e: e[0])  # stable: the order added within a time
    saved = outputs._GATHER_ROWS
    outputs._GATHER_ROWS = data.draw(st.sampled_from([1, 2, 4096]))
    try:
        idx = StoreIndex(ps)
        idx._extend(rows)
    finally:
        outputs._GATHER_ROWS = saved
    got = [
        (idx.ts_of(i), idx.frame_of[i], idx.hashes_of(i), list(idx.tokens[i]))
        for i in range(len(idx.offs))
    ]
    assert got == [(ts, k, hs, toks) for ts, k, hs, toks in expect]
    assert idx.parents == [k for _, k, _, _ in expect]
    assert idx.hashes.dtype == np.int64 and len(idx.hashes) == sum(len(e[2]) for e in expect)


def test_request_windows_are_each_lookups_bisections(monkeypatch):
    """``StoreIndex.windows`` (every request's publish-time bounds in one vectorised search)
    and ``_until`` (a bound capped at ``FINISH_MAX_EVENTS`` events) give what bisecting the
    publish times per lookup gives, ties and the ends of the stream included."""
    from bisect import bisect_left, bisect_right

    from kvcadence.replay import outputs

    monkeypatch.setattr(outputs, "FINISH_MAX_EVENTS", 7)
    slack, horizon = outputs.FINISH_SLACK_NS, outputs.FINISH_WINDOW_NS
    rng = random.Random(8)
    idx = StoreIndex(1)
    idx._ts = sorted(rng.randrange(0, 40) * slack // 2 for _ in range(120))
    ts = idx._ts
    arrs = [rng.randrange(-2, 45) * slack // 2 for _ in range(200)]
    fins = [a + rng.randrange(0, 6) * slack // 2 for a in arrs]
    wins = idx.windows(arrs, fins)
    assert idx.windows([], []) == []
    for a, f, (lo, hi, lo_f, hi_h) in zip(arrs, fins, wins, strict=True):
        assert lo == bisect_left(ts, a - slack)
        assert lo_f == bisect_left(ts, f - slack)
        for i in {lo, lo_f, min(len(ts), lo + 3), len(ts)}:
            cap = min(len(ts), i + 7)
            assert idx._until(i, hi) == bisect_right(ts, f + slack, i, cap)
            assert idx._until(i, hi_h) == bisect_right(ts, f + horizon, i, cap)


def test_index_drops_a_store_whose_nine_byte_hashes_are_not_ints(tmp_path):
    """A stored event whose hashes take 9 bytes each but are not 64-bit ints (float64s)
    is dropped when the index checks every hash's type byte at once (``unpacked_all``),
    as decoding it as ints drops it on the checked path; the frame's other stores stay."""
    from kvcadence.format.bundle import BundleReader
    from kvcadence.replay.flushes import FlushScan

    def ev(hs: list, toks: list[int]) -> dict:
        return {
            "type": "BlockStored",
            "block_hashes": hs,
            "parent_block_hash": None,
            "token_ids": toks,
            "block_size": 1,
            "lora_id": None,
        }

    payloads = [
        [1.0, [ev([2**40 + 1, 2**41], [5, 6]), ev([1.5, 2.5], [7, 8])], None],
        [2.0, [ev([2**42, 2.5], [9, 10]), ev([2**43], [11])], None],  # one float of two
        [3.0, [ev([3, 2**44], [12, 13])], None],  # a small hash: decoded as ints, kept
    ]
    write_payloads(tmp_path / "b", payloads)
    rd = BundleReader(tmp_path / "b")
    index = StoreIndex.from_reader(rd, 1, FlushScan(rd.header))
    got = [(index.hashes_of(i), e.tokens) for i, e in enumerate(index.events)]
    assert got == [([2**40 + 1, 2**41], [5, 6]), ([2**43], [11]), ([3, 2**44], [12, 13])]
    assert index.offs == [0, 2, 3]


def test_a_start_past_the_bound_takes_an_earlier_starts_end_when_that_start_has_another():
    """Corpus ``p4-dfs-mrr4``: one client's session ends at 1000 ms, another's at 1270;
    two sessions start at 1285 and 1300. Joining each start to the latest free end gives
    the first start the 1270 end (15 ms) and leaves the second none (its only free end,
    1000, is 300 ms back, past a 290 ms bound): one open-loop client more. The second takes
    the 1270 end (30 ms) from the first, which moves to the 1000 end (285 ms, within its
    bound); with a 280 ms bound the first cannot move, and the second stays open loop."""
    spans = [(0, 1000), (5, 1270), (1285, 2000), (1300, 2100)]
    links, idle = infer_clients(_sessions(spans), 290 * 1_000_000)
    assert links[2:] == [0, 1] and idle == 0  # both closed loop (their own clients here)
    # an earlier start with no other end in its bound keeps its end: the later one is open loop
    links, _ = infer_clients(_sessions(spans), 280 * 1_000_000)
    assert links[2:] == [1, None]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 3000)), min_size=1, max_size=30),
    st.integers(1, 2000),
)
def test_client_links_are_a_matching_of_starts_to_earlier_ends(spans, bound_ms):
    """Every link joins a start to a session end that finished before it, each end at most
    once, and no more starts are left open loop than without the augmenting step."""
    import kvcadence.replay.sessions as sessions

    nodes = _sessions([(a, a + d) for a, d in spans])
    links, _ = infer_clients(nodes, bound_ms * 1_000_000)
    used = [e for e in links if e is not None]
    assert len(used) == len(set(used))
    for q, e in enumerate(links):
        if e is not None:
            assert nodes[e].finish_ns <= nodes[q].arrival_ns and e != q
    saved = sessions.AUGMENT_LOOKBACK
    sessions.AUGMENT_LOOKBACK = 0
    try:
        plain, _ = infer_clients(nodes, bound_ms * 1_000_000)
    finally:
        sessions.AUGMENT_LOOKBACK = saved
    assert links.count(None) <= plain.count(None)


@pytest.mark.parametrize(
    ("params", "said"),
    [
        ({"text": "You are a helpful assistant. Hi"}, "a text prompt -- SGLang's metrics line"),
        ({}, "--log-requests-level 0 or 1"),
    ],
    ids=["text-prompt", "log-level-0-or-1"],
)
def test_a_metrics_line_without_ids_is_refused_with_its_cause(tmp_path, capsys, params, said):
    """SGLang's metrics line has no ``input_ids`` for a string prompt (it holds the text) and
    none for any request when the worker runs with ``--log-requests`` at level 0 or 1 (both
    fields dropped from ``--export-metrics-to-file``): ``replay`` says which, in one line,
    exit 2, and what to change."""
    import json

    from kvcadence.cli import main

    good = {"rid": "a", "input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3}}
    bad = {"rid": "b", "sampling_params": {"max_new_tokens": 3}, **params}
    lines = []
    for k, p in enumerate((good, bad)):
        lines.append(
            json.dumps(
                {
                    "request_parameters": json.dumps(p),
                    "id": p["rid"],
                    "prompt_tokens": 4,
                    "cached_tokens": 0,
                    "completion_tokens": 3,
                    "request_received_ts": 1.8e9 + k,
                    "request_finished_ts": 1.8e9 + k + 0.5,
                }
            )
        )
    logs = tmp_path / "sglang-metrics"
    logs.mkdir()
    (logs / "sglang-request-metrics-20261204_19.log").write_text("\n".join(lines) + "\n")
    bundle = tmp_path / "b"
    assert main(["capture", "import", "--quiet", "--sglang-metrics", str(logs), str(bundle)]) == 0
    capsys.readouterr()
    assert main(["replay", str(bundle), "--out", str(tmp_path / "sim")]) == 2
    err = capsys.readouterr().err.strip()
    *warnings, line = err.splitlines()  # (a warning: the import has no /server_info snapshot)
    assert all(w.startswith("replay: warning:") for w in warnings) and "Traceback" not in err
    assert "'b': no input_ids recorded" in line and said in line
    assert not (tmp_path / "sim").exists()


def test_a_lora_adapter_is_said_not_modelled_a_salt_or_extra_key_is_modelled(tmp_path, capsys):
    """Requests naming a LoRA adapter get one warning line with the count (SGLang appends
    the adapter's id to ``extra_key`` and post-maps its hashes; the replay does not);
    ``cache_salt`` and ``extra_key`` are modelled (their own namespace, a salt's chain), so
    they get no line, and a plain capture none either."""
    import json

    from kvcadence.cli import main

    def line(k: int, **extra: object) -> str:
        p = {"rid": f"r{k}", "input_ids": [5, 6, 7, 8, k], "sampling_params": {"max_new_tokens": 3}}
        return json.dumps(
            {
                "request_parameters": json.dumps({**p, **extra}),
                "id": p["rid"],
                "prompt_tokens": 5,
                "cached_tokens": 0,
                "completion_tokens": 3,
                "request_received_ts": 1.8e9 + k,
                "request_finished_ts": 1.8e9 + k + 0.5,
            }
        )

    for name, lines in (
        ("lora", [line(0), line(1, cache_salt="tenant-a"), line(2, lora_path="ad")]),
        ("salted", [line(0), line(1, cache_salt="tenant-a"), line(2, extra_key="x")]),
        ("plain", [line(0), line(1)]),
    ):
        logs = tmp_path / name / "sglang-metrics"
        logs.mkdir(parents=True)
        (logs / "sglang-request-metrics-20261204_19.log").write_text("\n".join(lines) + "\n")
        b = tmp_path / name / "b"
        assert main(["capture", "import", "--quiet", "--sglang-metrics", str(logs), str(b)]) == 0
        capsys.readouterr()
        assert main(["replay", str(b), "--out", str(tmp_path / name / "sim")]) == 0
        err = capsys.readouterr().err
        said = [x for x in err.splitlines() if "cache namespace" in x]
        if name != "lora":
            assert not said, said
        else:
            (w,) = said
            assert w.startswith("replay: warning:")
            assert "a LoRA adapter (lora_path) on 1 of the requests" in w


def test_a_repeated_prompt_is_no_next_turn_but_parallel_samples_follow_their_prefill():
    """Page 4: ``s1`` (13 tokens, 2 outputs: its finish stores no page) and, 5 s later,
    ``s2`` with the same prompt (another client's single shot, or a retry): ``s2``'s prompt
    holds ``s1``'s but nothing after it -- a next turn holds at least the answer --, so it
    has no predecessor and arrives open loop (``p16-attach-midrun-http-clients``: such
    repeats were replayed as next turns). SGLang's prefill-only line of a parallel request
    (``p``: no output) is followed by its samples, the same prompt (``q``)."""
    ps = 4
    s = list(range(100, 113))
    p = list(range(200, 213))
    index = StoreIndex.from_batches(
        [(int(0.1 * S), [store(s, 0, 3, ps)]), (int(6.1 * S), [store(p, 0, 3, ps)])], ps
    )
    prefill_only = msgspec.structs.replace(
        rec("p", p, 0, 6.0, 6.15, cached=0), finish_reason="length"
    )
    recs = [
        rec("s1", s, 2, 0.05, 0.3, cached=0),
        rec("s2", s, 2, 5.0, 5.3, cached=12),
        prefill_only,
        rec("q", p, 3, 6.2, 6.5, cached=12),
        rec("q2", p, 3, 6.2, 6.6, cached=12),
    ]
    out, rep = complete_records(recs, index)
    by = {r.rid: r for r in out}
    assert by["s2"].turn == 0 and by["s2"].session != by["s1"].session
    assert (by["q"].session, by["q"].turn) == (by["p"].session, 1)
    assert rep["with_predecessor"] == 2
    # the second sample starts a session of its own, released after the prefill-only
    # request all the same (SGLang sends the samples once it has finished); the first
    # sample follows it as its session's next turn, no mark needed
    assert by["q2"].turn == 0 and by["q2"].session != by["p"].session
    assert by["q2"].meta_info[AFTER_KEY] == [by["p"].session, by["p"].turn]
    assert all(AFTER_KEY not in (by[k].meta_info or {}) for k in ("s1", "s2", "p", "q"))
    sched = build_schedule(out)
    spec = {x.rid: x for x in sched.requests}
    assert spec["q2"].pred == spec["p"].idx == spec["q"].pred
    assert spec["q2"].arrival_ns is None and spec["q2"].gap_ns == int(0.05 * S)


def test_a_request_that_never_ran_beside_a_rebuilt_one_keeps_every_record():
    """An errored request that never ran (no output, no finish reason: left out of the
    inference) and a store no record claims (a request SGLang's metrics file lacks, rebuilt)
    in one capture: every record comes back in its place, the rebuilt one after them (the
    two paths once met in a ``zip(strict=True)`` and the replay stopped with a traceback)."""
    ps = 4
    a = list(range(100, 113))
    lost = list(range(300, 313))
    index = StoreIndex.from_batches(
        [(int(0.1 * S), [store(a, 0, 3, ps)]), (int(1.1 * S), [store(lost, 0, 3, ps)])], ps
    )
    recs = [rec("a", a, 2, 0.05, 0.3, cached=0), rec("e", list(range(500, 510)), 0, 0.5, 0.6)]
    out, rep = complete_records(recs, index)
    assert [r.rid for r in out] == ["a", "e", "kv-events-0"]
    assert out[1].error and rep["errored_not_run"] == 1 and rep["unrecorded_rebuilt"] == 1


@pytest.mark.parametrize("ps", [1, 4])
def test_a_prefill_run_merged_after_another_store_is_found_at_a_page_start(ps):
    """A prefill store merged after another request's finish store (tail merging): the
    run is looked for at each page's first token (``StoreIndex._first_chunk``), so a
    token equal to the prompt's first inside the other store's page (position 2 of 4) is
    stepped over and the run found at the next page; at page 1 that earlier position is
    a page of its own, its next token differs, and the run is found after it all the same."""
    a = [100 + k for k in range(12)]
    a_full = [*a, 50, 51, 7, 53]  # a's finish page holds 7 inside it
    b = [*a_full, 7, 8, 9, 10, 11, 12, 13, 14]  # b's own pages start with 7
    p0, p1 = len(a) // ps, len(a_full) // ps
    ev = merged(store(a_full, p0, p1, ps), store(b, p1, len(b) // ps, ps))
    idx = StoreIndex.from_batches([(2_000_000_000, [ev])], ps)
    got = idx.prefill_run(b, len(a_full), 1_900_000_000, 3_000_000_000)
    assert got is not None
    last, segs, base = got
    assert segs == [(p1, 0, p1 - p0, len(b) // ps - p1)]
    assert last == ev.block_hashes[-1] and base == ev.block_hashes[p1 - p0 - 1]
    # a prompt whose next page differs from the stored one: no run
    other = [*a_full, 7, 8, 9, 99, 11, 12, 13, 14]
    assert idx.prefill_run(other, len(a_full), 1_900_000_000, 3_000_000_000) is None


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("wide", [False, True])
def test_a_merged_prefill_run_is_found_past_earlier_events_of_its_window(ps, wide):
    """The merged search looks past an event's start in every event of the window: a false hit
    in an earlier event (the prompt's first token at a page start, the next page different)
    is stepped over, the run found in the later event holding another request's finish
    store before it, at the right event and position -- the same with an event of ids that
    are not uint32 in the window (kept as a wide array: searched token by token)."""
    a = [100 + k for k in range(12)]
    a_full = [*a, 50, 51, 52, 53]
    b = [*a_full, 7, 8, 9, 10, 11, 12, 13, 14]
    decoy = [7, 60, 61, 62] * 2  # page starts with 7 (page 1: every token is a page)
    p0, p1 = len(a) // ps, len(a_full) // ps
    evs = [store(decoy, 0, len(decoy) // ps, ps)]
    if wide:
        big = [1 << 40, *range(200, 200 + ps - 1)]
        evs.append(
            msgspec.structs.replace(store(list(range(300, 300 + ps)), 0, 1, ps), token_ids=big)
        )
    evs.append(merged(store(a_full, p0, p1, ps), store(b, p1, len(b) // ps, ps)))
    idx = StoreIndex.from_batches([(2_000_000_000 + k, [e]) for k, e in enumerate(evs)], ps)
    assert [t.typecode for t in idx.tokens].count("q") == int(wide)
    got = idx.prefill_run(b, len(a_full), 1_900_000_000, 3_000_000_000)
    assert got is not None
    last, segs, base = got
    ei = len(evs) - 1
    assert segs == [(p1, ei, p1 - p0, len(b) // ps - p1)]
    assert last == evs[-1].block_hashes[-1] and base == evs[-1].block_hashes[p1 - p0 - 1]
    assert idx.tokens[ei][(p1 - p0) * ps :] == array(CODE, b[p1 * ps :])
