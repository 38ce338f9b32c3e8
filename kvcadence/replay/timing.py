"""Pass-time model: maps scheduler passes to virtual time, calibrated from the capture.

What this file owns: ``PassTimer`` (prefill pass = base + per_token × extend tokens +
per_req × requests; decode pass = base + per_req × batch size) and ``calibrate(records)``,
which derives the parameters from the capture's own ``meta_info`` timings (bundles carry no
``server.log``):

* prefill batches are the requests sharing one ``forward_entry_time``; their duration is
  ``prefill_finished_time − forward_entry_time``, fitted by least squares against the batch's
  uncached tokens (``prompt_tokens − cached_tokens``), with non-negative coefficients;
* a decode pass is, per request, ``(request_finished_ts − prefill_finished_time −
  prefill time of other batches finishing inside that window) / (completion_tokens − 1)``;
  the median over requests is split into a base and a per-request part by regressing on the
  number of requests that overlapped the window.

When the capture has no usable timings the defaults of ``TimingParams`` stay. Pure
arithmetic on the records: deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable
from statistics import median
from typing import Any

from kvcadence.replay.config import TimingParams


class PassTimer:
    """Durations (ns) of simulated passes."""

    def __init__(self, p: TimingParams) -> None:
        self.p = p
        self._pb = p.prefill_base_s * 1e9
        self._pt = p.prefill_per_token_s * 1e9
        self._pr = p.prefill_per_req_s * 1e9
        self._db = p.decode_base_s * 1e9
        self._dr = p.decode_per_req_s * 1e9
        self.wakeup_ns = int(p.wakeup_s * 1e9)

    def prefill_ns(self, extend_tokens: int, n_reqs: int) -> int:
        return max(1, int(self._pb + self._pt * extend_tokens + self._pr * n_reqs))

    def decode_ns(self, batch_size: int) -> int:
        return max(1, int(self._db + self._dr * batch_size))


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x with a, b >= 0."""
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return max(my, 0.0), 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=False)) / sxx
    a = my - b * mx
    if b < 0:
        return max(my, 0.0), 0.0
    if a < 0:
        b = sum(x * y for x, y in zip(xs, ys, strict=False)) / max(sum(x * x for x in xs), 1e-12)
        return 0.0, max(b, 0.0)
    return a, b


def calibrate(records: Iterable[Any], base: TimingParams | None = None) -> TimingParams:
    """Fit ``TimingParams`` from ``RequestRecord.meta_info`` timings (see module docstring)."""
    p = TimingParams() if base is None else TimingParams(**_asdict(base))
    rows = []
    for r in records:
        mi = r.meta_info or {}
        fe, pf = mi.get("forward_entry_time"), mi.get("prefill_finished_time")
        rx, fin = mi.get("request_received_ts"), mi.get("request_finished_ts")
        if not all(isinstance(v, (int, float)) for v in (fe, pf, rx, fin)):
            continue
        n = r.completion_tokens or len(r.output_ids) or 0
        prompt = r.prompt_tokens or len(r.input_ids)
        cached = r.cached_tokens or 0
        rows.append((float(fe), float(pf), float(rx), float(fin), int(n), prompt - cached))
    if len(rows) < 4:
        return p
    # prefill batches grouped by forward entry time
    batches: dict[int, list[tuple]] = {}
    for row in rows:
        batches.setdefault(round(row[0] * 1e6), []).append(row)
    xs, ys, ends = [], [], []
    for group in batches.values():
        dur = median(g[1] - g[0] for g in group)
        toks = sum(g[5] for g in group)
        if dur > 0:
            xs.append(float(toks))
            ys.append(dur)
            ends.append((max(g[1] for g in group), dur))
    if len(xs) >= 3:
        a, b = _fit_line(xs, ys)
        p.prefill_base_s, p.prefill_per_token_s = a, b
    # decode pass time
    per_pass, conc = [], []
    for _fe, pf, _rx, fin, n, _u in rows:
        if n < 2 or fin <= pf:
            continue
        inside = sum(d for e, d in ends if pf < e <= fin)
        t = (fin - pf - inside) / (n - 1)
        if t <= 0:
            continue
        overlap = sum(1 for r in rows if r[1] < fin and r[3] > pf)
        per_pass.append(t)
        conc.append(float(overlap))
    if len(per_pass) >= 3:
        a, b = _fit_line(conc, per_pass)
        if a + b * median(conc) <= 0:
            a, b = median(per_pass), 0.0
        p.decode_base_s, p.decode_per_req_s = a, b
    # default client gap (used only when a request has no recorded gap)
    by_lane: dict[Any, list[Any]] = {}
    for r in records if isinstance(records, list) else []:
        if r.lane is not None:
            by_lane.setdefault(r.lane, []).append(r)
    gaps = []
    for lane_recs in by_lane.values():
        lane_recs = sorted(
            lane_recs, key=lambda r: (r.meta_info or {}).get("request_received_ts", 0)
        )
        for a_, b_ in zip(lane_recs, lane_recs[1:], strict=False):
            fa = (a_.meta_info or {}).get("request_finished_ts")
            rb = (b_.meta_info or {}).get("request_received_ts")
            if isinstance(fa, (int, float)) and isinstance(rb, (int, float)) and rb > fa:
                gaps.append(rb - fa)
    if gaps:
        p.default_gap_s = median(gaps)
    return p


def _asdict(p: TimingParams) -> dict[str, float]:
    import dataclasses

    return dataclasses.asdict(p)
