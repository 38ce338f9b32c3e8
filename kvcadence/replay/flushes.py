"""Recorded cache flushes, replayed in request order.

What this file owns:

* ``RecordedFlush`` / ``recorded_flushes(reader)`` (``FlushScan``: the same, fed frame by
  frame) -- the mid-run flushes of a bundle: every ``AllBlocksCleared`` after the first
  seq of an epoch of an endpoint (seq 0 is the publisher's startup clear), with its
  receive time, seq and the endpoint's DP rank; an ``Annotation`` of kind ``flush``
  (every rank); without any such clear in the event stream
  (a requests-only capture), the driver's successful ``flush_cache`` annotations. A clear
  recovered through the replay socket (``VIA_REPLAY``) was received late (when the gap was
  noticed, after later messages): its time is its batch's publish ``ts`` moved onto the
  receive clock by the endpoint's median ``recv_ns − ts`` over the messages received live;
* ``FlushLedger`` (one per worker) and ``FlushPlan`` (one per simulated rank) -- where each
  flush sits in the simulated schedule.

The rule (SGLang's ``flush_cache`` refuses unless nothing is running or waiting): a recorded
flush at receive time ``t`` sits **after every request that finished before ``t``**
(recorded finish ≤ ``t``, or within ``FLUSH_FINISH_SLACK_NS`` after it for a request
received before ``t``; a request without a recorded finish: arrival < ``t``) and
**before every other request** (they arrived after it: a request in the scheduler at ``t``
would have made the flush fail). Replayed:

* the flush becomes *due* once all its "before" requests have finished in the simulation
  (whichever rank served them), ``delay`` after the last of them, ``delay`` = recorded
  clear − latest recorded finish of those requests (the client's wait before it asked); it
  is performed when the rank is fully idle (``Scheduler._maybe_flush``: the queue goes out
  first, then the ``AllBlocksCleared`` alone, decode counter reset);
* the flush is a synchronisation point (the worker was idle): the recorded timeline after
  it is replayed anchored at the simulated flush ``T``, whether the simulation reaches it
  later or earlier than the recording did. Every "after" request whose arrival does not
  follow another "after" request of its lane -- an open-loop request, a lane's first, a
  lane's turn that crosses the flush (its predecessor is before it) -- arrives at exactly
  ``T + offset`` (``offset`` = recorded arrival − recorded clear), not at its own time;
  a lane's later turns keep their closed-loop timing (``max(own arrival, T)``). Such an
  anchored request is held by the plan until the flush was performed (``hold``; an
  open-loop one from the start: the scheduler and the fleet's static routing hand it over
  when it becomes known, the fleet's dynamic routing holds it in its recorded rank's
  plan), then released through the holder's ``sink`` (``performed``);
* several flushes go in recorded order (flush ``k + 1`` only after ``k``); a DP capture has
  one clear per rank: each rank's plan holds its own clears, the "before" sets span the
  worker's requests on every rank;
* a flush whose "before" requests can never finish (inconsistent records) is performed when
  its rank would otherwise stop (``Scheduler``, ``replay.fleet``), not never.

Times: recorded ones are absolute ns; simulated ones virtual ns of the scheduler clock
(``origin_ns`` = the absolute time of virtual 0).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvcadence.format import wire
from kvcadence.format.bundle import event_payload
from kvcadence.format.schema import (
    VIA_REPLAY,
    AllBlocksCleared,
    EventFrame,
    KVEventBatchTsView,
    seconds,
)
from kvcadence.replay.schedule import RequestSpec, _arrival, _finish


@dataclass(frozen=True, slots=True)
class RecordedFlush:
    """One recorded cache flush: the clear's receive time (absolute ns), the DP rank whose
    stream carried it (None: every rank) and its seq there (None: from an annotation)."""

    recv_ns: int
    rank: int | None = None
    seq: int | None = None


def recorded_flushes(reader: Any) -> list[RecordedFlush]:
    """The mid-run flushes recorded in a bundle (see module docstring), by time then rank.

    Reads only the event frames and the flush notes (``events_and_notes``: request records
    and other notes are stepped over). A payload without the bytes of the
    ``AllBlocksCleared`` tag (every msgpack shape spells it as that string) cannot hold a
    clear: only its ``ts`` is decoded (``KVEventBatchTsView``; it counts towards the
    endpoint's receive lag); the others are decoded whole. A payload that does not decode
    is not a flush."""
    scan = FlushScan(reader.header)
    for rec in reader.events_and_notes(NOTE_KINDS):
        if not isinstance(rec, EventFrame):
            scan.note(rec)
            continue
        payload = event_payload(rec)
        if _CLEARED_TAG not in payload:
            try:
                scan.frame(rec, _TS_ONLY.decode(payload).ts, ())
                continue
            except msgspec.DecodeError:  # another envelope shape: decoded whole below
                pass
        try:
            batch = wire.decode_batch(payload)
        except Exception:  # a malformed payload is not a flush
            continue
        scan.frame(rec, batch.ts, batch.events)
    return scan.result()


#: the bytes of the clear's tag: every wire shape carries it as this msgpack str
_CLEARED_TAG = b"AllBlocksCleared"
_TS_ONLY = msgspec.msgpack.Decoder(KVEventBatchTsView)


#: the note kinds ``FlushScan.note`` reads (a pass may skip every other note)
NOTE_KINDS = ("flush", "flush_cache")
#: an ``Annotation``'s data, as the reader decodes it (a map)
_NOTE_DATA = msgspec.msgpack.Decoder(dict[str, Any])


class FlushScan:
    """``recorded_flushes`` fed one record at a time: ``frame`` (an ``EventFrame`` with its
    decoded batch ``ts`` and events) and ``note`` (an ``Annotation``), in bundle order, then
    ``result``. Lets a caller that decodes the frames anyway find the flushes in the same
    pass (``replay.production``)."""

    def __init__(self, header: Any) -> None:
        self.rank_of_ep = {e.id: int(e.dp_rank) for e in (getattr(header, "endpoints", None) or [])}
        self.first_seq: dict[tuple[int, int], int] = {}
        #: (endpoint, epoch, seq) -> (recv_ns, publish ts in ns or None, recovered late)
        self.clears: dict[tuple[int, int, int], tuple[int, int | None, bool]] = {}
        #: endpoint -> recv_ns - ts of its live messages (8 bytes a message, no int object)
        self.lag: dict[int, array] = {}
        self.notes: list[RecordedFlush] = []
        self.driver_notes: list[RecordedFlush] = []

    def frame(self, rec: Any, ts: Any, events: Sequence[Any]) -> None:
        ep, seq = rec.endpoint, rec.seq
        seq0 = self.first_seq.setdefault((ep, rec.epoch), seq)
        s = seconds(ts)
        ts_ns = None if s is None else round(s * 1e9)
        late = rec.via == VIA_REPLAY
        if ts_ns is not None and not late:
            lags = self.lag.get(ep)
            if lags is None:
                self.lag[ep] = lags = array("q")
            lags.append(rec.recv_ns - ts_ns)
        if events and seq0 != seq and any(isinstance(e, AllBlocksCleared) for e in events):
            # a frame recorded twice (live and through the replay socket) counts once,
            # live first
            ck = (rec.endpoint, rec.epoch, rec.seq)
            if ck not in self.clears or self.clears[ck][2]:
                self.clears[ck] = (rec.recv_ns, ts_ns, late)

    def note(self, rec: Any) -> None:
        """An ``Annotation`` (or an ``AnnotationRawView``: its data decoded here, only for
        the two kinds read; a note whose data is not a map is skipped, as a reader skips it
        as undecodable)."""
        kind = rec.kind
        if kind != "flush" and kind != "flush_cache":
            return
        data = rec.data
        if type(data) is msgspec.Raw:
            try:
                data = _NOTE_DATA.decode(data)
            except msgspec.DecodeError:
                return
        if kind == "flush":
            self.notes.append(RecordedFlush(rec.recv_ns))
        elif (data or {}).get("ok") is True:
            at = (data or {}).get("finish_ns", rec.recv_ns)
            self.driver_notes.append(RecordedFlush(int(at)))

    def result(self) -> list[RecordedFlush]:
        out = list(self.notes)
        lag = self.lag
        for (ep, _epoch, seq), (recv_ns, ts_ns, late) in self.clears.items():
            at = recv_ns
            if late and ts_ns is not None:
                lags = sorted(lag.get(ep) or [x for v in lag.values() for x in v])
                if lags:
                    at = min(recv_ns, ts_ns + lags[len(lags) // 2])
            out.append(RecordedFlush(at, self.rank_of_ep.get(ep, ep), seq))
        if not self.clears:
            out += self.driver_notes
        out.sort(key=lambda f: (f.recv_ns, -1 if f.rank is None else f.rank, f.seq or 0))
        return out


#: a request received before a recorded flush and recorded finished at most this long after
#: it was over before it (``FlushLedger.before``): the records' finish stamps and the
#: events' clock (moved by ``clocks``' offset, estimated to the millisecond) disagree by a
#: few ms; measured on a CI run of the real worker: a request finished 6 ms before the
#: clear, put 1 ms after it by a 7 ms offset estimate, and the replay flushed before it
FLUSH_FINISH_SLACK_NS = 50_000_000


class FlushLedger:
    """One worker's requests as the flushes see them: recorded arrival / finish of each
    spec, which have finished in the simulation, and the rank plans to tell."""

    def __init__(self, specs: Sequence[RequestSpec]) -> None:
        self.specs: dict[int, RequestSpec] = {s.idx: s for s in specs}
        self.arrival: dict[int, int] = {}
        self.finish: dict[int, int | None] = {}
        for s in specs:
            rec = s.source
            arr = _arrival(rec) if rec is not None else None
            self.arrival[s.idx] = int(arr) if arr is not None else 0
            fin = _finish(rec) if rec is not None else None
            self.finish[s.idx] = int(fin) if fin is not None else None
        self.plans: list[FlushPlan] = []
        self.done: set[int] = set()

    def before(self, idx: int, t: int) -> bool:
        """Whether request ``idx`` was over before a flush recorded at ``t``: finished by
        ``t``, or received before it and finished within ``FLUSH_FINISH_SLACK_NS`` after
        it (the two clocks' noise: the worker was idle at the flush, so a request it had
        received was over). Monotone in ``t``."""
        fin = self.finish[idx]
        if fin is not None:
            return fin <= t or (self.arrival[idx] < t and fin <= t + FLUSH_FINISH_SLACK_NS)
        return self.arrival[idx] < t

    def finished(self, idx: int, t: int) -> None:
        """Request ``idx`` finished (or was aborted) at virtual ``t`` on some rank."""
        if idx not in self.specs or idx in self.done:
            return
        self.done.add(idx)
        for plan in self.plans:
            plan._finished(idx, t)


class FlushPlan:
    """The recorded flushes of one simulated rank (see module docstring).

    The scheduler calls ``attach(on_due)`` (``on_due(t)``: the next flush may be performed
    from virtual ``t`` on; may be called at once), ``holds(idx)`` / ``hold(at, idx, sink)``
    for an arriving request (``sink(at, idx)``: where it goes once released; a driver may
    hold a request it has not routed yet), ``performed(t)`` after each flush (releases the
    requests it held, in arrival order) and ``force(t)`` when the rank would stop with a
    flush still pending."""

    def __init__(self, times_abs: Iterable[int], ledger: FlushLedger, origin_ns: int) -> None:
        self.ledger = ledger
        self.origin_ns = origin_ns
        self.times = sorted(int(t) for t in times_abs)
        n = len(self.times)
        #: per request: how many of this rank's flushes it comes after
        self.need: dict[int, int] = {}
        remaining = [0] * n
        rec_last: list[int | None] = [None] * n
        for idx in ledger.specs:
            # "before" is monotone in the flush time: idx is before flushes need.. only
            need = sum(1 for t in self.times if not ledger.before(idx, t))
            if need:
                self.need[idx] = need
            fin = ledger.finish[idx]
            for j in range(need, n):
                if idx not in ledger.done:
                    remaining[j] += 1
                last = rec_last[j]
                if fin is not None and (last is None or fin > last):
                    rec_last[j] = fin
        self.remaining = remaining
        self.rec_last = rec_last
        self.sim_last = [0] * n
        self.performed_n = 0
        self.performed_at: list[int] = []
        self._due_sent = -1
        self._held: list[tuple[int, int, Callable[[int, int], None]]] = []
        self._on_due: Callable[[int], None] | None = None
        ledger.plans.append(self)

    # ------------------------------------------------------------------ state
    @property
    def pending(self) -> bool:
        """A flush is still to be performed."""
        return self.performed_n < len(self.times)

    def attach(self, on_due: Callable[[int], None]) -> None:
        self._on_due = on_due
        self._check_due()

    def due_ns(self, k: int) -> int:
        """Virtual time from which flush ``k`` may be performed (its "before" requests
        all finished)."""
        t_rec = self.times[k]
        last = self.rec_last[k]
        if last is not None:
            return self.sim_last[k] + max(0, t_rec - last)
        return max(t_rec - self.origin_ns, self.sim_last[k])

    def _check_due(self) -> None:
        k = self.performed_n
        if k < len(self.times) and self._due_sent < k and self.remaining[k] <= 0:
            self._due_sent = k
            if self._on_due is not None:
                self._on_due(self.due_ns(k))

    def _finished(self, idx: int, t: int) -> None:
        need = self.need.get(idx, 0)
        for j in range(need, len(self.times)):
            self.remaining[j] -= 1
            if t > self.sim_last[j]:
                self.sim_last[j] = t
        self._check_due()

    # ------------------------------------------------------------------ requests
    def holds(self, idx: int) -> bool:
        """Request ``idx`` must wait for a flush this rank has not performed yet."""
        return self.need.get(idx, 0) > self.performed_n

    def hold(self, at: int, idx: int, sink: Callable[[int, int], None]) -> None:
        """Hold request ``idx`` (its own arrival ``at``) until the flush it needs was
        performed; then ``sink(arrival, idx)``."""
        self._held.append((at, idx, sink))

    def _release_time(self, at: int, idx: int) -> int:
        need = self.need.get(idx, 0)
        if need == 0:
            return at
        k = need - 1
        t_flush = self.performed_at[k]
        pred = self.ledger.specs[idx].pred
        if pred is None or self.need.get(pred, 0) < need:
            # the first arrival after the flush (open loop, a lane's first, a turn crossing
            # it): the recorded timeline anchored at the simulated flush
            return t_flush + max(0, self.ledger.arrival[idx] - self.times[k])
        return max(at, t_flush)

    def performed(self, t: int) -> None:
        """The next flush was performed at virtual ``t``: release the held requests that
        needed only it (and the flushes before), in arrival order, to their sinks."""
        self.performed_at.append(t)
        self.performed_n += 1
        out: list[tuple[int, int, Callable[[int, int], None]]] = []
        keep: list[tuple[int, int, Callable[[int, int], None]]] = []
        for at, idx, sink in self._held:
            if self.holds(idx):
                keep.append((at, idx, sink))
            else:
                out.append((self._release_time(at, idx), idx, sink))
        self._held = keep
        self._check_due()
        out.sort(key=lambda x: (x[0], x[1]))
        for at, idx, sink in out:
            sink(at, idx)

    def force(self, t: int) -> None:
        """Make the next flush due at ``t`` whatever is left of its "before" requests."""
        k = self.performed_n
        if k < len(self.times):
            self._due_sent = k
            if self._on_due is not None:
                self._on_due(t)
