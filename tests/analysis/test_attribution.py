"""Prompt vs output attribution: golden split at page size 2, and invariants (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.analysis.attribution import Request
from kvcadence.format import wire
from tests.analysis.attribution_oracle import StoredEvent, any_prompt_split, attribute


def chain(tokens: list[int], ps: int) -> list[int]:
    return [wire.u64(h) for h in wire.block_hashes(tokens, ps)]


A_IN = [11, 12, 13, 14, 15, 16, 17, 18]
A_OUT = [21, 22, 23, 24, 25]
B_IN = A_IN + A_OUT[:4] + [31, 32, 33, 34]  # next turn: prompt + output + new chunk
B_OUT = [41, 42, 43]


def test_golden_split_page2() -> None:
    ps = 2
    a = Request("a", A_IN, A_OUT, cached_tokens=0, send_ns=0, finish_ns=100, lane=0, session=0)
    b = Request("b", B_IN, B_OUT, cached_tokens=12, send_ns=150, finish_ns=300, lane=0, session=0)
    ca = chain(A_IN + A_OUT[:-1], ps)  # 12 tokens -> 6 pages, 4 of them prompt
    cb = chain(B_IN + B_OUT[:-1], ps)  # 18 tokens -> 9 pages, 8 of them prompt
    assert ca == cb[:6]
    events = [
        StoredEvent(0, 50, ca[:4]),  # a's prefill
        StoredEvent(1, 160, ca[4:6] + cb[6:8]),  # a's finish merged with b's prefill
        StoredEvent(2, 290, cb[8:9]),  # b's finish
        StoredEvent(3, 295, [123456789]),  # matches nobody
    ]
    res = attribute([a, b], events, ps)
    assert res.stored_blocks == 10
    assert res.matched_blocks == 9 and res.unmatched_blocks == 1 and res.unmatched_events == 1
    assert res.prompt_blocks == 6 and res.output_blocks == 3
    assert res.expected_output_blocks == (6 - 4) + (9 - 8)
    assert res.event_kinds == {
        "prefill": 1,
        "finish | prefill (same session)": 1,
        "finish": 1,
        "unmatched": 1,
    }
    assert res.events_spanning_same_session == 1 and res.events_spanning_other == 0
    assert res.req_stored_events == [2, 2]
    assert res.req_prefill_events == [1, 1] and res.req_finish_events == [1, 1]
    assert res.req_prompt_blocks == [4, 2] and res.req_output_blocks == [2, 1]
    assert res.requests_without_prefill_store == 0
    # peer definition: a's output pages are inside b's prompt -> counted as prompt
    assert any_prompt_split([a, b], events[:3], ps) == {"prompt_blocks": 8, "output_blocks": 1}


def test_restore_after_eviction_goes_to_request_in_flight() -> None:
    ps = 1
    a = Request("a", [1, 2, 3], [9], cached_tokens=0, send_ns=0, finish_ns=10)
    b = Request("b", [1, 2, 3], [9], cached_tokens=0, send_ns=100, finish_ns=110)
    ca = chain([1, 2, 3], ps)
    res = attribute([a, b], [StoredEvent(0, 5, ca), StoredEvent(1, 105, ca)], ps)
    assert res.req_prompt_blocks == [3, 3]
    assert res.req_stored_events == [1, 1]


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.lists(st.integers(3, 50), min_size=1, max_size=24),
    out=st.lists(st.integers(3, 50), min_size=0, max_size=10),
    ps=st.sampled_from([1, 2, 4]),
    cut=st.integers(0, 12),
    junk=st.lists(st.integers(0, 2**63 - 1), max_size=3),
)
def test_blocks_are_conserved(prompt, out, ps, cut, junk) -> None:  # noqa: ANN001
    req = Request("r", prompt, out, cached_tokens=0, send_ns=0, finish_ns=1)
    c = chain(prompt + out[:-1], ps)
    cut = min(cut, len(c))
    events = [StoredEvent(0, 0, c[:cut]), StoredEvent(1, 1, c[cut:] + junk)]
    res = attribute([req], events, ps)
    assert res.prompt_blocks + res.output_blocks + res.unmatched_blocks == res.stored_blocks
    assert res.unmatched_blocks == len([h for h in junk if h not in c])
    assert res.prompt_blocks == min(len(prompt) // ps, len(c))
    assert res.output_blocks == len(c) - res.prompt_blocks
