"""Column-wise attribution (``attribute_arrays``) equals the reference loop (``attribute``),
and request page hashes (``pages``) equal ``wire.block_hashes`` of each request's chain."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.analysis import chainsrc
from kvcadence.analysis import pages as kpages
from kvcadence.analysis.attribution import Request, attribute_arrays
from kvcadence.format import wire
from tests.analysis.attribution_oracle import StoredEvent, attribute, columns_from_objects

FIELDS = (
    "stored_blocks",
    "matched_blocks",
    "unmatched_blocks",
    "unmatched_events",
    "prompt_blocks",
    "output_blocks",
    "expected_output_blocks",
    "event_kinds",
    "events_spanning_same_session",
    "events_spanning_other",
    "req_prompt_blocks",
    "req_output_blocks",
    "req_stored_events",
    "req_prefill_events",
    "req_finish_events",
)


def _u64_chain(tokens: list[int], ps: int) -> list[int]:
    return [wire.u64(h) for h in wire.block_hashes(tokens, ps)]


def _check(requests: list[Request], events: list[StoredEvent], ps: int) -> Any:
    ref = attribute(requests, events, ps)
    for cut in (False, True):  # every page, or each request's from its cached prefix on
        got = attribute_arrays(*columns_from_objects(requests, events, ps, cut), ps)
        for f in FIELDS:
            assert getattr(got, f) == getattr(ref, f), (f, cut)
    return ref


@st.composite
def scenario(draw: Any) -> tuple[list[Request], list[StoredEvent], int]:
    ps = draw(st.sampled_from([1, 2, 4]))
    tok = st.integers(3, 9)  # a tiny alphabet: equal pages, shared prefixes, collisions
    requests: list[Request] = []
    n_sessions = draw(st.integers(1, 3))
    t = 0
    for s in range(n_sessions):
        ctx: list[int] = draw(st.lists(tok, max_size=6))
        for _turn in range(draw(st.integers(1, 3))):
            prompt = ctx + draw(st.lists(tok, min_size=1, max_size=8))
            out = draw(st.lists(tok, max_size=5))
            cached = draw(st.integers(0, len(prompt)))
            lane, session = draw(st.sampled_from([(0, s), (None, None), (1, None), (0, s % 2)]))
            send = draw(st.none() | st.integers(t, t + 50))
            finish = draw(st.none() | st.integers(t + 20, t + 90))
            requests.append(
                Request(f"r{len(requests)}", prompt, out, cached, send, finish, lane, session)
            )
            ctx = prompt + out[:-1]
            t += 40
    chains = [_u64_chain(r.input_ids + r.output_ids[:-1], ps) for r in requests]
    pieces: list[list[int]] = []
    for c in chains:
        i = 0
        while i < len(c):
            k = draw(st.integers(1, max(1, len(c) - i)))
            pieces.append(c[i : i + k])
            i += k
    pieces += [c[: draw(st.integers(0, len(c)))] for c in chains if draw(st.booleans())]
    pieces += draw(st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=2), max_size=2))
    order = draw(st.permutations(range(len(pieces))))
    events: list[StoredEvent] = []
    j = 0
    while j < len(order):
        take = draw(st.integers(1, 2))  # sometimes merge two pieces into one event
        hs = [h for k in order[j : j + take] for h in pieces[k]]
        events.append(StoredEvent(len(events), draw(st.integers(0, 150)), hs))
        j += take
    return requests, events, ps


@settings(max_examples=250, deadline=None)
@given(scenario())
def test_property_arrays_equal_reference(
    case: tuple[list[Request], list[StoredEvent], int],
) -> None:
    _check(*case)


def test_golden_split_page2_and_restore_after_eviction() -> None:
    a_in = [11, 12, 13, 14, 15, 16, 17, 18]
    a_out = [21, 22, 23, 24, 25]
    b_in = a_in + a_out[:4] + [31, 32, 33, 34]
    a = Request("a", a_in, a_out, 0, 0, 100, 0, 0)
    b = Request("b", b_in, [41, 42, 43], 12, 150, 300, 0, 0)
    ca = _u64_chain(a_in + a_out[:-1], 2)
    cb = _u64_chain(b_in + [41, 42], 2)
    events = [
        StoredEvent(0, 50, ca[:4]),
        StoredEvent(1, 160, ca[4:6] + cb[6:8]),
        StoredEvent(2, 290, cb[8:9]),
        StoredEvent(3, 295, [123456789]),
    ]
    res = _check([a, b], events, 2)
    assert res.event_kinds["finish | prefill (same session)"] == 1
    # the same prefix stored twice: the second store belongs to the request in flight
    x = Request("x", [1, 2, 3], [9], 0, 0, 10)
    y = Request("y", [1, 2, 3], [9], 0, 100, 110)
    c = _u64_chain([1, 2, 3], 1)
    res = _check([x, y], [StoredEvent(0, 5, c), StoredEvent(1, 105, c)], 1)
    assert res.req_prompt_blocks == [3, 3]


def test_no_requests_or_no_events() -> None:
    _check([], [StoredEvent(0, 0, [1, 2])], 4)
    _check([Request("a", [1, 2, 3, 4], [5], 0, 0, 1)], [], 4)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 2**33), max_size=30),
            st.lists(st.integers(0, 50), max_size=6),
            st.sampled_from([None, 0, 1]),
        ),
        max_size=6,
    ),
    st.sampled_from([1, 2, 3, 16]),
)
def test_page_hashes_equal_wire(rows: list[tuple[list[int], list[int], Any]], ps: int) -> None:
    # consecutive rows of one session that extend each other exercise digest reuse
    inp: list[list[int]] = []
    for i, (p, _, s) in enumerate(rows):
        if i and s is not None and rows[i - 1][2] == s:
            prev = inp[-1] + rows[i - 1][1][:-1]
            p = prev + p
        inp.append(p)
    out = [r[1] for r in rows]
    lane = [0 if r[2] is not None else None for r in rows]
    session = [r[2] for r in rows]
    chains = [(p + o[:-1])[: len(p + o[:-1]) // ps * ps] for p, o in zip(inp, out, strict=True)]
    cv, co = chainsrc.flat_lists(pa.chunked_array([pa.array(chains, type=pa.list_(pa.int64()))]))
    page_off, hashes = kpages.hash_requests(cv, co, ps, lane, session)
    for r in range(len(rows)):
        want = wire.block_hashes(inp[r] + out[r][:-1], ps)
        assert hashes[page_off[r] : page_off[r + 1]].tolist() == want
    assert hashes.dtype == np.int64
