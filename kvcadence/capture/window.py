"""The time window of a capture's KV events, and the request records that fall outside it.

What this file owns: ``event_window(bundle)`` (the first and last publish time of the
bundle's KV-event messages) and ``RecordWindow`` (which request records ``capture import``
leaves out of a bundle that holds KV events).

SGLang's ``--export-metrics-to-file`` directory keeps every hour the worker served (one file
an hour, old ones compressed by logrotate), and ``capture import --sglang-metrics DIR`` reads
every file in it. A capture records only its own stretch of the worker's life; a request that
finished before its first message, or was received after its last, published nothing the
capture holds. Imported anyway, the replay would run it and publish its stores -- events the
real capture cannot have -- and every per-request figure of the report would count it on
the real side (a day of records for an hour's capture: 24 requests counted for each one the
events saw). So an import into a bundle with KV events keeps the records that overlap its
window and says how many it left out (``--all-records`` keeps every one).

The times compared: each message's payload ``ts`` (the scheduler's wall clock; the
capture's ``recv_ns`` where a payload has none) against a record's receive (``send_ns``)
and finish (``finish_ns``), both SGLang's own wall-clock stamps. ``SLACK_NS`` of either side
is kept too (a store is published a few milliseconds after its request's finish; SGLang's
stamps come from other processes). Two clocks that disagree by more than that
(``tests/replay/data/clock-offset-touch``: the records 54.9 s behind the events) would leave
records out that ran during the capture -- the replay rebuilds such a request from its
stores (``replay.unrecorded``), so little is lost; and where *no* record falls inside the
window the import refuses rather than guess (exit 2, naming both spans: ``--all-records``
imports them, the replay reads the offset from the stores, ``replay.clocks``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvcadence.format.bundle import BundleReader, event_payload_view
from kvcadence.format.schema import KVEventBatchTsView, seconds

#: records this close to the window (either side) are kept: publish lags, the stamps of
#: SGLang's other processes
SLACK_NS = 1_000_000_000

_TS = msgspec.msgpack.Decoder(KVEventBatchTsView)


def event_window(bundle: Path | str) -> tuple[int, int] | None:
    """``(first, last)`` publish time (ns) of the bundle's KV-event messages: each payload's
    ``ts``, its frame's ``recv_ns`` where the payload has none (or cannot be decoded); None
    when the bundle holds no message. One pass over the frames, only ``ts`` decoded."""
    lo: int | None = None
    hi: int | None = None
    for frame in BundleReader(bundle).events():
        try:
            ts = _TS.decode(event_payload_view(frame)).ts
        except (msgspec.DecodeError, TypeError, ValueError):
            ts = None
        s = seconds(ts)
        t = frame.recv_ns if s is None else round(s * 1e9)
        if lo is None or t < lo:
            lo = t
        if hi is None or t > hi:
            hi = t
    return None if lo is None or hi is None else (lo, hi)


@dataclass
class RecordWindow:
    """The records ``capture import`` keeps: those overlapping ``[first - SLACK_NS, last +
    SLACK_NS]`` (``event_window``), and those without the time that would place them
    outside. ``keep(record)`` counts the others."""

    first_ns: int
    last_ns: int
    before: int = 0  # finished before the window
    after: int = 0  # received after it
    kept: int = 0
    #: the least receive and the most finish of the records left out (for the refusal)
    span: tuple[int, int] | None = None

    def keep(self, rec: Any) -> bool:
        fin, recv = rec.finish_ns, rec.send_ns
        if fin is not None and fin < self.first_ns - SLACK_NS:
            self.before += 1
        elif recv is not None and recv > self.last_ns + SLACK_NS:
            self.after += 1
        else:
            self.kept += 1
            return True
        lo = recv if recv is not None else fin
        hi = fin if fin is not None else recv
        if lo is not None and hi is not None:
            self.span = (
                (lo, hi) if self.span is None else (min(self.span[0], lo), max(self.span[1], hi))
            )
        return False

    @property
    def left_out(self) -> int:
        return self.before + self.after

    def said(self) -> str:
        """What was left out, for the import's summary line ("" when nothing)."""
        if not self.left_out:
            return ""
        parts = []
        if self.before:
            parts.append(f"{self.before} that finished before its first KV event")
        if self.after:
            parts.append(f"{self.after} received after its last")
        return (
            f"; {self.left_out} outside the capture left out ({' and '.join(parts)}; "
            "--all-records keeps them)"
        )

    def refusal(self, total: int) -> str:
        """The one line when every record fell outside (a clock offset, or the wrong logs)."""
        span = ""
        if self.span is not None:
            span = f", the records {_clock(self.span[0])} .. {_clock(self.span[1])}"
        return (
            f"none of the {total} request records falls within the capture's KV events "
            f"({_clock(self.first_ns)} .. {_clock(self.last_ns)}{span}): the logs of another "
            "run, or the worker's clocks disagree? --all-records imports them anyway (the "
            "replay reads a clock offset from the stores)"
        )


def _clock(ns: int) -> str:
    """A wall-clock time in UTC, to the second."""
    return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
