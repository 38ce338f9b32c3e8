"""The offset between a capture's two clocks: its event stream's and its request records'.

What this file owns: ``records_offset(index, records)``, the same as a step function over
the capture (``records_clock``, a ``ClockMap``: where the wall clock stepped during it),
``scheduler_stamps_on_records_clock`` (the records' own scheduler stamps moved with the
events), and ``outside_stores(index, records)`` (the records that lie outside the span of
the capture's stores, on the records' clock: they published nothing the capture holds). A
production capture times its events by the capture host's receive clock (``recv_ns``) and
the scheduler's payload ``ts``, and its requests by SGLang's request log
(``request_received_ts`` / ``request_finished_ts`` of the tokenizer manager). The two agree
within milliseconds on one healthy host, but not always: a capture host other than the
worker's, or a wall-clock step (an NTP correction) after the tokenizer manager started:
SGLang 0.5.23 converts its monotonic stamps to wall time with the difference it read last,
which its scheduler re-reads at every request it receives and its tokenizer manager only at
its start (``tests/replay/data/clock-offset-touch``: the records 54.9 s behind both event
clocks; corpus ``p16-tight-bench-serving-gsp``: two steps during the capture).
The replay compares them directly -- recorded flushes are placed among the requests by
time, the production inference searches a request's stores between its receive and its
finish -- so with an offset every flush lands after every request and no store is found.

The offset is read from content, not from time: a request's prefill store holds the first
page of its prompt past its cached prefix, and it is published between the request's
receive and its finish. Each request whose first uncached page is stored by exactly one
event gives an interval of offsets that put that store inside its window, ``[t - finish,
t - receive]``; the offset is the middle of the range covered by the most intervals. It is
0 -- nothing changed -- when 0 is covered by nearly as many as that (the clocks agree:
every capture of the corpus), or when fewer than ``MIN_SAMPLES`` requests give an interval.
Nearly: within ``OUTLIER_SHARE`` of the intervals (at least one), which may miss the true
offset -- a first page matched to another request's store, a publish late under load: on
`p1-lanes8-quiet`, recorded while the box ran replays, one such interval (a store 16.7 ms
after its request's finish) made a range of 90 against 89 at 0 and an offset of 22.8 ms
where the clocks agree. A real offset leaves few intervals at 0 (the touch capture: none).
At most ``MAX_LOOKED`` requests, evenly spaced, are looked at. A request that finished at
its prefill (one output or none) has its window end ``PREFILL_FINISH_SLACK_NS`` after its
finish: SGLang stamps that finish when the prefill's result is processed, and the store
goes out at the publish after it, a few milliseconds later
(`p4-chunk512-parallel-http-clients-cancel`: the 45 prefill-only lines of its parallel
samples, 0.3-1.6 ms after their finish, read as a 4.6 ms offset without it). A request
that asked for its prompt's logprobs is not looked at: its match was capped
(``schedule._logprob_cap``), so its first uncached page may be one another request stored
long before (a scoring request's first page is its system prompt's).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvcadence.format.schema import UNRECORDED_SOURCE, meta_seconds
from kvcadence.replay.schedule import _arrival, _finish, _logprob_cap
from kvcadence.replay.tokens import same_ids, span

#: fewer uniquely stored first pages than this: the offset is not estimated (0)
MIN_SAMPLES = 5
#: the share of the intervals that may miss the true offset: 0 stays the offset unless the
#: best-covered range holds more than this share (at least one) more intervals than 0 does
OUTLIER_SHARE = 0.05
#: a request that finished at its prefill: its store may be published this long after its
#: recorded finish (0.3-2.9 ms on the corpus; the production index's finish slack)
PREFILL_FINISH_SLACK_NS = 50_000_000
#: at most this many requests are looked at, evenly spaced (one offset for the capture: a
#: long capture costs no more than this)
MAX_LOOKED = 2000
#: ``outside_stores``' slack either side of the stores' span (``capture.window``'s)
OUTSIDE_SLACK_NS = 1_000_000_000
#: this many requests in a row (publish order) that agree among themselves on an offset the
#: stretch before them does not share start a new stretch (``records_clock``)
STEP_CONFIRM = 5


def records_offset(index: Any, records: Sequence[Any]) -> int:
    """Nanoseconds to subtract from the event stream's times to put them on the records'
    clock (see module); 0 when the clocks agree or the capture cannot tell."""
    return _offset([s for _, s in _spans(index, records)])


def _offset(spans: Sequence[tuple[int, int]]) -> int:
    """The offset ``spans`` (ranges of offsets, one a request) agree on (see module)."""
    if len(spans) < MIN_SAMPLES:
        return 0
    lo, hi, best = best_covered(spans)
    at_zero = sum(1 for a, b in spans if a <= 0 <= b)
    margin = max(1, math.ceil(OUTLIER_SHARE * len(spans)))
    return 0 if at_zero + margin > best else (lo + hi) // 2


@dataclass(frozen=True, slots=True)
class ClockMap:
    """The offset between the two clocks over the capture, a step function: ``offsets[k]``
    (ns, to subtract from an event-clock time) from event ``firsts[k]`` on (``firsts[0]``
    is 0), and for a time on the event clock from ``starts[k]`` on (the publish time of
    event ``firsts[k]``, as recorded)."""

    firsts: tuple[int, ...] = (0,)
    starts: tuple[int, ...] = (0,)
    offsets: tuple[int, ...] = (0,)

    def __bool__(self) -> bool:
        return any(self.offsets)

    def of_event(self, ei: int) -> int:
        """The offset of event ``ei`` (by its position in the stream)."""
        return self.offsets[bisect_right(self.firsts, ei) - 1]

    def of_time(self, t: int) -> int:
        """The offset of a time ``t`` on the event clock (a flush's receive time)."""
        return self.offsets[max(0, bisect_right(self.starts, t) - 1)]

    def report(self) -> list[dict[str, float]]:
        """One ``{at_event, offset_s}`` a stretch after the first (the report's key
        ``clock_steps``): the event from which the offset changed, and to what."""
        return [
            {"at_event": f, "offset_s": round(o / 1e9, 3)}
            for f, o in zip(self.firsts[1:], self.offsets[1:], strict=True)
        ]


#: the fields of a metrics record stamped by the scheduler (on the event stream's clock, as
#: its payload ``ts``), where the others (``request_received_ts``, ``request_finished_ts``)
#: are the tokenizer manager's: ``clock-offset-touch``'s are 55.5 s ahead of its receives,
#: as its events are
SCHEDULER_STAMPS = ("forward_entry_time", "prefill_finished_time")


def scheduler_stamps_on_records_clock(records: Sequence[Any], clock: ClockMap) -> list[Any]:
    """``records`` with their scheduler's stamps (``SCHEDULER_STAMPS``, s) put on the
    records' clock by ``clock`` (the calibration, the recorded pace and the queue order read
    them against the receives and finishes); a request rebuilt from the events has its
    times on that clock already."""
    out = list(records)
    if not clock:
        return out
    for i, r in enumerate(records):
        mi = r.meta_info
        if r.source == UNRECORDED_SOURCE or not mi:
            continue
        moved = {
            k: mi[k] - clock.of_time(int(mi[k] * 1e9)) / 1e9
            for k in SCHEDULER_STAMPS
            if meta_seconds(mi, k) is not None
        }
        if moved:
            out[i] = msgspec.structs.replace(r, meta_info={**mi, **moved})
    return out


def records_clock(index: Any, records: Sequence[Any]) -> ClockMap:
    """The offset between the event stream's clock and the records' as a step function
    (``ClockMap``): one offset for the capture (``records_offset``) unless the requests'
    ranges, in publish order, fall into stretches that agree on different offsets -- the
    wall clock stepped during the capture (an NTP correction: SGLang's tokenizer manager
    converts its monotonic stamps with the wall-clock difference read at its start, its
    scheduler re-reads it at every request it receives, so after a step the two disagree by
    it; ``p16-tight-bench-serving-gsp``: +1.2 s from 5 s in, +16.7 s from 16 s in). A stretch
    is ``STEP_CONFIRM`` consecutive ranges that agree among themselves and not with the
    stretch before (fewer: outliers, left in it)."""
    spans = _spans(index, records)
    if len(spans) < MIN_SAMPLES:
        return ClockMap()
    spans.sort()
    stretches = _stretches(spans)
    if len(stretches) == 1:
        off = _offset([s for _, s in spans])
        return ClockMap(offsets=(off,))
    offs = [_offset([s for _, s in st]) for st in stretches]
    ts = index._ts
    firsts, starts, offsets = [0], [0], [offs[0]]
    for prev, nxt, off in zip(stretches, stretches[1:], offs[1:], strict=False):
        if off == offsets[-1]:
            continue
        # the step: between the last store of one stretch and the first of the next, the
        # event after which the publish times jump by the change (a forward step leaves a
        # gap that long, a backward one goes back by it). The messages went out in order,
        # so the step lies where the mapped times stay in order -- a jump at least the
        # change -- where there is one: ``p16-tight-bench-serving-gsp``'s +1.207 s step went
        # at a 0.963 s jump (the nearest) and put a request's prefill store 1.2 s before its
        # receive, its outputs unfound; its 1.52 s jump two events on keeps them in order
        lo, hi = prev[-1][0] + 1, nxt[0][0]
        step = off - offsets[-1]
        cands = [j for j in range(lo, hi + 1) if ts[j] - ts[j - 1] >= step]
        at = min(cands or range(lo, hi + 1), key=lambda j: abs(ts[j] - ts[j - 1] - step))
        firsts.append(at)
        starts.append(ts[at])
        offsets.append(off)
    return ClockMap(tuple(firsts), tuple(starts), tuple(offsets))


def _stretches(spans: list[tuple[int, tuple[int, int]]]) -> list[list[tuple[int, tuple[int, int]]]]:
    """``spans`` (``(event, range)`` in publish order) cut where ``STEP_CONFIRM`` ranges in
    a row share no offset with the stretch so far but one among themselves."""
    out: list[list[tuple[int, tuple[int, int]]]] = [[]]
    lo, hi = -(1 << 62), 1 << 62  # the offsets the current stretch's ranges share
    pending: list[tuple[int, tuple[int, int]]] = []
    plo, phi = lo, hi
    for e, (a, b) in spans:
        if a <= hi and b >= lo:  # fits the stretch: the ones that did not were outliers
            lo, hi = max(lo, a), min(hi, b)
            out[-1].extend(pending)
            out[-1].append((e, (a, b)))
            pending, plo, phi = [], -(1 << 62), 1 << 62
            continue
        if pending and not (a <= phi and b >= plo):  # agrees with neither: start over
            out[-1].extend(pending)
            pending, plo, phi = [], -(1 << 62), 1 << 62
        pending.append((e, (a, b)))
        plo, phi = max(plo, a), min(phi, b)
        if len(pending) >= STEP_CONFIRM:  # a new stretch
            out.append(pending)
            lo, hi = plo, phi
            pending, plo, phi = [], -(1 << 62), 1 << 62
    out[-1].extend(pending)
    return [st for st in out if st]


def _spans(index: Any, records: Sequence[Any]) -> list[tuple[int, tuple[int, int]]]:
    """``(event, (lo, hi))`` of each request looked at whose first uncached page one event
    stored: that event and the offsets that put its publish within the request's window."""
    ps = index.page_size
    tokens, ts, by_first = index.tokens, index._ts, index._by_first
    spans: list[tuple[int, tuple[int, int]]] = []
    step = -(-len(records) // MAX_LOOKED) or 1
    for r in records[::step]:
        a, f, c = _arrival(r), _finish(r), r.cached_tokens
        if a is None or f is None or c is None or f < a or c < 0:
            continue
        if _logprob_cap(r.meta_info or {}) is not None:
            continue  # its match was capped: what it found stored tells nothing of its store
        n = r.completion_tokens if r.completion_tokens is not None else len(r.output_ids)
        if n <= 1:  # finished at its prefill: the store's publish may follow the finish
            f += PREFILL_FINISH_SLACK_NS
        start = c // ps * ps
        if start + ps > len(r.input_ids):
            continue
        want = span(r.input_ids, start, start + ps)
        found = by_first.get(want[0], ())  # every event whose first page starts so
        if ps > 1 and found:  # (a page of one token: that is the whole page)
            found = [e for e in found if same_ids(tokens.span(e, 0, ps), want)]
        if len(found) == 1:
            t = ts[found[0]]
            spans.append((found[0], (t - f, t - a)))
    return spans


def outside_stores(index: Any, times: Sequence[tuple[int | None, int | None]]) -> tuple[int, int]:
    """``(before, after)``: of the records whose ``(arrival, finish)`` are ``times``, how
    many finished more than ``OUTSIDE_SLACK_NS`` before the capture's first store, and how
    many were received more than that after its last (``index``'s publish times, already on
    the records' clock): records of another stretch of the worker's life, e.g. a metrics
    directory imported whole with ``capture import --all-records`` or ``kvcadence import
    --requests``. (0, 0) for an index without stores."""
    ts = index._ts
    if not ts:
        return 0, 0
    first, last = ts[0] - OUTSIDE_SLACK_NS, ts[-1] + OUTSIDE_SLACK_NS
    before = sum(1 for _, f in times if f is not None and f < first)
    after = sum(1 for a, f in times if a is not None and a > last and (f is None or f >= first))
    return before, after


def best_covered(spans: Sequence[tuple[int, int]]) -> tuple[int, int, int]:
    """``(lo, hi, n)``: the first range ``[lo, hi]`` covered by the most of the closed
    intervals ``spans`` (``n`` of them), by a sweep over their ends."""
    points = sorted([(a, 0) for a, _ in spans] + [(b, 1) for _, b in spans])
    n = best = 0
    lo = hi = points[0][0]
    opened = False
    for x, kind in points:  # at one x, openings (0) come before closings (1)
        if kind == 0:
            n += 1
            if n > best:
                best, lo, opened = n, x, True
        else:
            if opened:
                hi, opened = x, False
            n -= 1
    return lo, hi, best


__all__ = [
    "SCHEDULER_STAMPS",
    "STEP_CONFIRM",
    "scheduler_stamps_on_records_clock",
    "ClockMap",
    "records_clock",
    "MAX_LOOKED",
    "MIN_SAMPLES",
    "OUTLIER_SHARE",
    "OUTSIDE_SLACK_NS",
    "best_covered",
    "outside_stores",
    "records_offset",
]
