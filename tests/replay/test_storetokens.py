"""``replay.storetokens.StoredTokens``: the stored events' tokens in one buffer, against the
per-event arrays it replaces (hypothesis), wide ids included."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.replay import storetokens
from kvcadence.replay.storetokens import StoredTokens
from kvcadence.replay.tokens import CODE, WIDE, compact, same_ids

# a few distinct token values, so that heads repeat (searches find several pages)
_TOKEN = st.integers(0, 5)
_WIDE_TOKEN = st.sampled_from([1, 3, 1 << 40])


@st.composite
def _events(draw: st.DrawFn) -> tuple[int, list[array]]:
    ps = draw(st.sampled_from([1, 2, 4]))
    events = []
    for _ in range(draw(st.integers(0, 12))):
        pages = draw(st.integers(1, 6))
        wide = draw(st.booleans()) and draw(st.booleans())
        ids = draw(
            st.lists(_WIDE_TOKEN if wide else _TOKEN, min_size=pages * ps, max_size=pages * ps)
        )
        events.append(compact(ids))
    return ps, events


def _append(col: StoredTokens, events: list[array]) -> None:
    """``events`` (each one's tokens) appended as ``StoreIndex._extend`` hands them over: end
    to end in one buffer, zeros where an event's ids are not uint32 (kept as its own)."""
    ps = col.page_size
    flat = bytearray()
    wide = {}
    for k, toks in enumerate(events):
        if toks.typecode == CODE:
            flat += toks
        else:
            wide[k] = toks
            flat += bytes(array(CODE).itemsize * len(toks))
    col.extend_flat(flat, [len(t) // ps for t in events], wide)


def _built(ps: int, events: list[array]) -> tuple[StoredTokens, list[int]]:
    col = StoredTokens(ps)
    starts = []
    at = 0
    for toks in events:
        starts.append(at)
        at += len(toks) // ps
    # a few events at a time: the first call's buffer taken over, the later ones appended
    for c in range(0, len(events), 2):
        _append(col, events[c : c + 2])
    return col, starts


@settings(max_examples=300, deadline=None)
@given(_events(), st.data())
def test_column_answers_as_the_per_event_arrays(
    built: tuple[int, list[array]], data: st.DataObject
) -> None:
    ps, events = built
    col, starts = _built(ps, events)
    assert len(col) == len(events)
    assert col.firsts(0) == [t[0] for t in events]
    assert col.firsts(len(events) // 3) == [t[0] for t in events[len(events) // 3 :]]
    assert [list(t) for t in col] == [list(t) for t in events]
    total = sum(len(t) // ps for t in events)
    for e, toks in enumerate(events):
        assert col.is_wide(e) == (toks.typecode == WIDE)
        a = data.draw(st.integers(0, len(toks)))
        b = data.draw(st.integers(a, len(toks) + 3))
        assert list(col.span(e, a, b)) == list(toks[a:b])
        probe = compact(data.draw(st.lists(_TOKEN, max_size=b - a)))
        if data.draw(st.booleans()):
            probe = toks[a:b]  # the same ids: equal
        assert col.same(e, a, b, probe) == same_ids(toks[a:b], probe)
    # every page whose first token is ``want``, in a window of pages, ascending
    lo = data.draw(st.integers(0, total))
    hi = data.draw(st.integers(lo, total))
    for want in (0, 1, 3, 1 << 40):
        expect = [
            s + j
            for s, toks in zip(starts, events, strict=True)
            for j in range(len(toks) // ps)
            if lo <= s + j < hi and toks[j * ps] == want
        ]
        assert col.heads(want, lo, hi) == expect
        saved = storetokens._FIND_PAGES
        storetokens._FIND_PAGES = -1  # every window by numpy
        try:
            assert col.heads(want, lo, hi) == expect
        finally:
            storetokens._FIND_PAGES = saved


@pytest.mark.parametrize("find_pages", [0, 1 << 30])
def test_heads_by_bytes_and_by_numpy_agree(
    find_pages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Narrow windows are searched as bytes, wide ones with numpy: both answer the same,
    and a byte-aligned false hit (``want``'s bytes straddling two ids) is no page."""
    monkeypatch.setattr(storetokens, "_FIND_PAGES", find_pages)
    # 0x0100 then 0x0000: bytes 00 01 00 00 00 00 00 00 hold 0x00000100 at offset 1 too
    toks = array(CODE, [0x0100, 0, 0x0100, 7])
    col = StoredTokens(1)
    _append(col, [toks[:2], toks[2:]])
    assert col.heads(0x0100, 0, 4) == [0, 2]
    assert col.heads(0x0100, 1, 4) == [2]
    assert col.heads(0, 0, 4) == [1]
    assert col.heads(0, 0, 1) == []
    # the buffer grows after a search (the numpy view is dropped first)
    _append(col, [array(CODE, [0x0100])])
    assert col.heads(0x0100, 0, 5) == [0, 2, 4]
