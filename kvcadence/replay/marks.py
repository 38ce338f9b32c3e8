"""Visibility bookkeeping of the simulated scheduler: which pass computed each stored page.

Methods of ``Scheduler`` (bound in its class body) (it reads the scheduler's state: ``prefill_marks`` per request, the
shared decode log, the visibility frames): prefill marks per request and one shared decode
log (a decoding request is in every decode pass, so its decoded positions map to consecutive
log entries) -- no per-request, per-pass bookkeeping. ``kvcadence.replay.visibility`` turns
the frames into bundle records.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvcadence.replay.request import Batch, SimReq

if TYPE_CHECKING:  # type-only: the mixin's methods run on a Scheduler
    from kvcadence.replay.scheduler import Scheduler


def computed_at(self: Scheduler, req: SimReq, pos: int) -> tuple[int, int, int]:
    """(pass, virtual end ns, phase 0 prefill / 1 decode) of the pass that computed the
    KV at sequence position ``pos`` of ``req`` (a position this request computed)."""
    dec0 = req.dec0
    if dec0 is not None and pos >= dec0[0]:
        g = dec0[1] + pos - dec0[0]
        return self._dec_pass[g], self._dec_end[g], 1
    _kv_end, batch = req.marks[self._mark_index(req.marks, pos)]
    return batch.index, batch.end_ns, 0


def _mark_index(marks: list[tuple[int, Batch]], pos: int) -> int:
    lo, hi = 0, len(marks) - 1
    while lo < hi:  # first mark with kv_end > pos
        mid = (lo + hi) // 2
        if marks[mid][0] > pos:
            hi = mid
        else:
            lo = mid + 1
    return lo


def visibility_frames(
    self: Scheduler,
) -> Iterator[tuple[int, int, int, str, array, array, array]]:
    """The visibility log with each page's computing pass joined to that pass's end ns and
    phase: ``(seq, publish pass, publish ns, reason, computed passes, computed ns,
    phases)`` per published batch that carried stores (built as read)."""
    ends, phases = self.pass_end, self.pass_phase
    for seq, publish_pass, t, reason, passes in self.vis_frames:
        yield (
            seq,
            publish_pass,
            t,
            reason,
            passes,
            array("q", [ends[p] for p in passes]),
            array("b", [phases[p] for p in passes]),
        )


def _record_store(self: Scheduler, req: SimReq, start: int, end: int) -> None:
    """A new node of ``req.seq[start:end]`` was inserted: note when each page was
    computed (the pass that wrote the KV of its last token; its end ns and phase are the
    pass's): whole runs per prefill mark, one strided slice of the decode log for the
    decoded pages."""
    marks = req.marks
    dec0 = req.dec0
    ps = self.ps
    pos = start + ps - 1  # last position of the first page
    # arrays all the way (repeats and decode-log slices are C copies; no int objects)
    passes = array("q")
    stop_pf = end if dec0 is None or dec0[0] > end else dec0[0]
    if pos < stop_pf and marks:
        i = self._mark_index(marks, pos)
        n_marks = len(marks)
        while pos < stop_pf and i < n_marks:
            kv_end, batch = marks[i]
            stop = kv_end if kv_end < stop_pf else stop_pf
            if pos < stop:
                cnt = (stop - 1 - pos) // ps + 1  # pages whose last position is here
                passes += array("q", (batch.index,)) * cnt
                pos += cnt * ps
            i += 1
    if dec0 is not None and pos < end:
        cnt = (end - 1 - pos) // ps + 1
        ga = dec0[1] + pos - dec0[0]
        gb = ga + (cnt - 1) * ps + 1
        passes += self._dec_pass[ga:gb:ps]
    if passes:
        self.vis_pending.append(passes)


def _mark_batch(self: Scheduler, batch: Batch) -> None:
    """Called once the batch's end time is known: a prefill marks its requests (and
    opens the decode run of those that go on decoding); a decode pass is one entry of
    the decode log, shared by every request in it."""
    if not self.track:
        return
    if len(self.pass_end) != batch.index:
        raise AssertionError(f"pass {batch.index} marked out of order")
    self.pass_end.append(batch.end_ns)
    if batch.kind == "prefill":
        self.pass_phase.append(0)
        if batch.mixed:  # its decoded rows: an entry of the decode log (they all run in it)
            self._dec_pass.append(batch.index)
            self._dec_end.append(batch.end_ns)
        g = len(self._dec_pass)
        for r, final in zip(batch.reqs, batch.finals, strict=True):
            r.marks.append((r.kv_len, batch))
            if final and r.decode_left > 0:
                r.dec0 = (r.kv_len, g)
        return
    self.pass_phase.append(1)
    self._dec_pass.append(batch.index)
    self._dec_end.append(batch.end_ns)
