"""Recorded pace: one simulated rank kept on the pace its requests' outputs were recorded at.

What this file owns: ``recorded_token_times`` (when each output of a rank's requests was
recorded, from a pass rate fitted to all of them at once), ``PacedTimer`` (a
``timing.PassTimer`` whose passes aim at those times, clamped around the model) and
``queued`` (``--pace auto``'s rule for one rank: its requests waited in the queue) -- used
by ``--pace recorded`` and by ``auto`` for a multi-rank fleet under recorded routing and for
a rank whose requests queued (``replay.fleet``). Pure arithmetic on the records and the
scheduler's state: deterministic.

Why a queue decides (measured on the 81 corpus captures, both paths, docs/simulator.md
"Recorded pace"): where requests wait seconds between their receive and their first forward
(``QUEUE_PACE_S``: the median wait), which request is admitted when follows every earlier
finish, so the pass-time model's error compounds through the queue; kept on the recorded
pace, the admissions come in the worker's order. Without a queue the model's own passes
held as many bars or more, and the recorded pace is the noisier (a box's load in it).
"""

from __future__ import annotations

from collections.abc import Iterable
from statistics import median
from typing import Any

from kvcadence.format.schema import meta_seconds
from kvcadence.replay.config import TimingParams
from kvcadence.replay.timing import (
    PassTimer,
    finished_s,
    is_retracted,
    prefill_batches,
    prefill_duration,
)

#: a paced pass takes between these multiples of the pass-time model's duration
PACE_MIN_FACTOR = 0.5
PACE_MAX_FACTOR = 2.0
#: width (seconds) of one step of a rank's recorded pass-rate curve
PACE_STEP_S = 1.0
#: Kaczmarz sweeps fitting that curve
PACE_SWEEPS = 50
#: ``auto`` paces one rank on its records when their median wait (receive -> first
#: forward) is at least this (seconds): a queue (``queued``)
QUEUE_PACE_S = 1.0


def median_wait_s(records: Iterable[Any]) -> float | None:
    """The median scheduler-side wait of ``records``: ``forward_entry_time`` (the first
    forward) less ``request_received_ts``, over those with both (None: none has)."""
    waits = []
    for r in records:
        mi = getattr(r, "meta_info", None) or {}
        fe, rc = meta_seconds(mi, "forward_entry_time"), meta_seconds(mi, "request_received_ts")
        if fe is not None and rc is not None:
            waits.append(fe - rc)
    return median(waits) if waits else None


def queued(records: Iterable[Any]) -> bool:
    """``--pace auto`` for one rank: its requests queued (``median_wait_s`` at least
    ``QUEUE_PACE_S``)."""
    w = median_wait_s(records)
    return w is not None and w >= QUEUE_PACE_S


def recorded_token_times(
    records: Iterable[Any], p: TimingParams, *, sync_forward: bool = False
) -> dict[int, list[float]]:
    """Recorded wall time (seconds) of every output of one rank's requests: ``{index in
    records: [t_1, ..., t_n]}`` for those with per-phase timings (``t_1`` =
    ``prefill_finished_time``, ``t_n`` = ``request_finished_ts``) and never retracted or
    preempted (``timing.is_retracted``: such a request waited in the queue inside that
    window, so when its outputs came is not known; it neither gets times nor sets the
    rank's pace). ``sync_forward`` as in
    ``calibrate`` (a CPU worker recorded under the overlap loop: ``prefill_finished_time``
    is the end of the *next* forward): ``t_1`` is that next forward's recorded start when
    the records show it -- the next prefill batch's ``forward_entry_time``, when it entered
    before ``prefill_finished_time`` (where ``calibrate`` ends the batch too) --, else
    ``prefill_finished_time`` still (``calibrate`` takes one modelled decode pass off it;
    here that measured worse on the DP captures: docs/simulator.md, "Recorded pace").

    A decode pass gives every running request of the rank one token, so the rank's pass
    rate ``v(t)`` (passes per second) is fitted to all its requests at once: each request
    ran ``outputs − 1`` decode passes plus one pass per prefill batch entering the forward
    (``forward_entry_time``) inside its window, i.e. ``∫ v = that count`` over
    ``[prefill_finished_time, request_finished_ts]``. ``v`` is piecewise constant
    (``PACE_STEP_S``), fitted by Kaczmarz sweeps from the pass-time model's rate and kept
    within [0.2, 5] × it. Output ``j`` of a request lies where the integral of ``v`` from its
    prefill reaches the fraction ``(j − 1) / (outputs − 1)`` of its whole window's
    integral: exact at both ends, following the rank's speed in between."""
    recs = list(records)
    rows = []
    for i, r in enumerate(recs):
        mi = r.meta_info or {}
        fe, pf = meta_seconds(mi, "forward_entry_time"), meta_seconds(mi, "prefill_finished_time")
        fin = finished_s(mi)
        n = int(r.completion_tokens or len(r.output_ids) or 0)
        if fe is None or pf is None or fin is None or fin < pf or is_retracted(r):
            continue
        rows.append((i, fe, pf, fin, n))
    out: dict[int, list[float]] = {}
    if not rows:
        return out
    entries = sorted({round(fe, 6) for _i, fe, _pf, _fin, _n in rows})
    lo = min(pf for _i, _fe, pf, _fin, _n in rows)
    steps = int((max(fin for *_x, fin, _n in rows) - lo) / PACE_STEP_S) + 1
    base = 1.0 / max(p.decode_base_s + 2 * p.decode_per_req_s, 1e-6)
    v = [base] * steps

    def cover(a: float, b: float) -> list[tuple[int, float]]:
        c = []
        for k in range(int((a - lo) / PACE_STEP_S), min(int((b - lo) / PACE_STEP_S) + 1, steps)):
            ov = min(b, lo + (k + 1) * PACE_STEP_S) - max(a, lo + k * PACE_STEP_S)
            if ov > 0:
                c.append((k, ov))
        return c

    eqs = []
    for _i, _fe, pf, fin, n in rows:
        if n >= 2 and fin > pf:
            c = cover(pf, fin)
            norm = sum(ov * ov for _k, ov in c)
            if norm > 0:
                work = n - 1 + sum(1 for e in entries if pf < e < fin)
                eqs.append((work, c, norm))
    vlo, vhi = 0.2 * base, 5.0 * base
    for _ in range(PACE_SWEEPS if len(eqs) >= 2 else 0):
        for work, c, norm in eqs:
            d = (work - sum(v[k] * ov for k, ov in c)) / norm
            for k, ov in c:
                v[k] = min(max(v[k] + d * ov, vlo), vhi)
    for i, _fe, pf, fin, n in rows:
        if n < 2 or fin <= pf:
            out[i] = [pf] * max(n, 1)
            continue
        c = cover(pf, fin)
        total = sum(v[k] * ov for k, ov in c)
        times = [pf]
        acc = 0.0
        it = iter(c)
        k, ov = next(it, (0, 0.0))
        seg_start = pf
        for j in range(1, n - 1):
            goal = total * j / (n - 1)
            while acc + v[k] * ov < goal:
                nxt = next(it, None)
                if nxt is None:  # rounding at the window's end
                    break
                acc += v[k] * ov
                seg_start += ov
                k, ov = nxt
            times.append(seg_start + (goal - acc) / v[k])
        times.append(fin)
        out[i] = times
    if sync_forward:
        batches = prefill_batches((fe, pf, i) for i, fe, pf, _fin, _n in rows)
        groups = sorted(
            ((min(r[0] for r in g), median(r[1] for r in g), g) for g in batches),
            key=lambda x: x[:2],
        )
        for k, (e, f, grp) in enumerate(groups):
            nxt = groups[k + 1][0] if k + 1 < len(groups) else None
            end = e + prefill_duration(e, f, nxt, True, 0.0)  # no modelled decode pass
            for r in grp:
                out[r[2]][0] = end
    return out


class PacedTimer(PassTimer):
    """``PassTimer`` that keeps one simulated rank on its recorded pace (``pace =
    "recorded"``, see ``replay.fleet``).

    ``times``: request idx -> the recorded wall time of each of its outputs
    (``recorded_token_times``; ``origin_ns`` is scheduler time 0). A decode pass launched now should end when the
    running requests' tokens it produces were recorded: its duration is the median over
    them of ``T(j) − launch``, where ``j`` counts the outputs already processed, the one
    in flight (the previous batch's) and this one. A prefill pass aims at its requests'
    first output ``T(1)`` (``prefill_finished_time``, or on a CPU worker recorded under the
    overlap loop the next recorded forward's start: ``recorded_token_times``). Either is
    clamped to ``clamp`` (default [``PACE_MIN_FACTOR``, ``PACE_MAX_FACTOR``]) × the model's
    duration, so a drifted rank catches up over several passes; with no recorded target the
    model's duration stands. Pure function of the scheduler's state at the call:
    deterministic."""

    def __init__(
        self,
        p: TimingParams,
        sched: Any,
        times: dict[int, list[float]],
        origin_ns: int,
        clamp: tuple[float, float] | None = None,
    ) -> None:
        super().__init__(p)
        self.sched = sched
        lo, hi = (PACE_MIN_FACTOR, PACE_MAX_FACTOR) if clamp is None else clamp
        if not 0 < lo <= 1 <= hi:
            raise ValueError(f"pace clamp ({lo}, {hi}): need 0 < low <= 1 <= high")
        #: a paced pass takes between these multiples of the model's duration
        self.clamp = (lo, hi)
        # request idx -> scheduler time (ns) of each output
        self.times = {i: [int(x * 1e9) - origin_ns for x in ts] for i, ts in times.items()}

    def _paced(self, model_ns: int, targets: list[int]) -> int:
        if not targets:
            return model_ns
        sched = self.sched
        start = max(sched.t, sched.gpu_free)
        targets.sort()
        want = targets[len(targets) // 2] - start
        lo, hi = int(model_ns * self.clamp[0]), int(model_ns * self.clamp[1])
        return max(1, min(max(want, lo), hi))

    def prefill_ns(
        self, extend_tokens: int, n_reqs: int, prefix_tokens: int = 0, seq_sq: int = 0
    ) -> int:
        model = super().prefill_ns(extend_tokens, n_reqs, prefix_tokens, seq_sq)
        times = self.times
        targets = [times[r.idx][0] for r in self.sched.pending_merge if r.idx in times]
        return self._paced(model, targets)

    def decode_ns(self, batch_size: int, ctx_tokens: int = 0) -> int:
        model = super().decode_ns(batch_size, ctx_tokens)
        sched = self.sched
        times = self.times
        last = sched.last
        flying = set(map(id, last.reqs)) if last is not None else ()
        targets = []
        for r in sched.running:
            tt = times.get(r.idx)
            if tt is None:
                continue
            j = r.output_len + (2 if id(r) in flying else 1)
            targets.append(tt[min(j, len(tt)) - 1])
        return self._paced(model, targets)
