"""Pass-time model: maps scheduler passes to virtual time, calibrated from the capture.

What this file owns: ``PassTimer`` (prefill pass = base + per_token × extend tokens +
per_req × requests + per_prefix_token × the prefix tokens the batch's requests attend to +
per_seq_sq × each request's sequence length after the pass, squared; decode pass = base +
per_req × batch size + per_ctx_token × the batch's context, its requests' KV lengths
summed), ``is_retracted`` (a record's ``meta_info.num_retractions``:
retracted or preempted at least once), ``model_text`` / ``model_line`` (the model in one
line, with where it came from: what ``kvcadence replay`` prints) and ``calibrate(records)``,
which derives the parameters from the capture's own ``meta_info`` timings (bundles carry
no ``server.log``):

* prefill batches are the requests sharing one ``forward_entry_time`` (not those retracted
  or preempted, ``num_retractions`` > 0: their ``prefill_finished_time`` may come after a
  wait in the queue); their duration is
  ``prefill_finished_time − forward_entry_time``, fitted by least squares against the batch's
  uncached tokens (``prompt_tokens − cached_tokens``), with non-negative coefficients, and
  its base against the passes the batch spans: with ``chunk_tokens`` a prompt of ``u``
  uncached tokens runs ``ceil(u / chunk_tokens)`` passes between its first forward entry
  and its prefill's end, each paying the base (``prefillfit.passes``; a batch's count is its
  requests' median, as its end is their finishes'), where a fit with one base per batch
  put the later passes' bases on the tokens and the replay, paying a base a pass, ran
  chunked prompts up to twice as long as the worker; the
  attended prefix (``cached_tokens``, and with ``chunk_tokens`` each earlier chunk of a
  chunked prompt) joins the fit only when it passes a partial F test
  (``prefillfit.PREFIX_MIN_F``); so do, instead, the batch's sequences squared
  (``prefillfit.squared``: each request's length after each of its passes; SGLang's
  torch-native attention, a CPU worker's, pads an extend's queries to the whole sequence, so
  a pass costs its sequence squared however few of its tokens are new), when they lower the
  residuals of the model chosen so far by the same statistic. With ``sync_forward`` (a CPU
  worker runs each forward inside its launch, so under the overlap loop a prefill result
  is processed only after the *next* forward; the normal loop processes it right after its
  own) the duration is the next batch's
  ``forward_entry_time`` − this one's when that batch is a prefill, else
  ``prefill_finished_time − forward_entry_time`` − one decode pass; with ``overlap`` (a
  GPU worker's overlap loop forms a batch while the forward before it runs and records its
  result when its own forward ends) it starts at the previous prefill batch's result when
  that came after the entry, else one decode pass after the entry when requests were
  decoding then (``prefill_duration``);
* a decode pass is, per request, ``(request_finished_ts − prefill_finished_time −
  prefill time of other batches finishing inside that window) / (completion_tokens − 1)``
  (not for a request retracted or preempted on the way, ``num_retractions`` > 0: its window
  holds its wait in the queue);
  the median over requests is split into a base and a per-request part by regressing on the
  number of requests that overlapped the window (``decodefit.fit_decode``). A third term,
  per context token (``intervals.Context``: the context the requests alive in the window
  held, time-averaged), joins only where the contexts are long (``decodefit.CTX_MIN_TOKENS``
  a running request) and it passes the prefill fit's partial F test (docs/simulator.md, "A
  decode term per context token", says why not at short ones); where it is given
  (``--decode-per-ctx-token``), each request's share of it is taken off its passes first,
  and base and per request are fitted to the rest;
* without per-phase timings but with server-side receive / finish times
  (``request_received_ts``, else ``response_sent_to_client_ts − e2e_latency``; finish =
  ``request_finished_ts``, else ``response_sent_to_client_ts``) and at least 16 requests:
  one pass from each request's latency over the passes it spans (see
  ``_calibrate_from_latency``), the prefill costs scaled with it;
* the default client gap is the median server-side gap (previous finish → next receive).

When the capture has no usable timings the defaults of ``TimingParams`` stay.

The recorded pace of one rank (``--pace``) is ``replay.pace``'s. Pure arithmetic on the
records: deterministic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from statistics import median
from typing import Any

from kvcadence.format.schema import meta_duration, meta_seconds
from kvcadence.replay.config import TimingParams
from kvcadence.replay.decodefit import fit_decode
from kvcadence.replay.fitting import fit_line
from kvcadence.replay.intervals import Alive, Context, Inside, overlaps
from kvcadence.replay.prefillfit import attended, fit_prefill, passes, squared


class PassTimer:
    """Durations (ns) of simulated passes."""

    def __init__(self, p: TimingParams) -> None:
        self.p = p
        self._pb = p.prefill_base_s * 1e9
        self._pt = p.prefill_per_token_s * 1e9
        self._pr = p.prefill_per_req_s * 1e9
        self._pp = p.prefill_per_prefix_token_s * 1e9
        #: ns per squared sequence length (0: no term, and the scheduler does not sum the
        #: batch's squares)
        self.sq_ns = p.prefill_per_seq_sq_s * 1e9
        self._db = p.decode_base_s * 1e9
        self._dr = p.decode_per_req_s * 1e9
        #: ns per context token of a decode pass (0: the pass does not depend on it, and
        #: the scheduler does not sum its batch's KV lengths)
        self.ctx_ns = p.decode_per_ctx_token_s * 1e9
        self.wakeup_ns = int(p.wakeup_s * 1e9)

    def prefill_ns(
        self, extend_tokens: int, n_reqs: int, prefix_tokens: int = 0, seq_sq: int = 0
    ) -> int:
        """``prefix_tokens``: the prefix tokens the batch's requests attend to (each one's
        cached prefix plus its earlier chunks), summed over the batch; ``seq_sq``: each
        request's sequence length after the pass, squared, summed over the batch."""
        return max(
            1,
            int(
                self._pb
                + self._pt * extend_tokens
                + self._pr * n_reqs
                + self._pp * prefix_tokens
                + self.sq_ns * seq_sq
            ),
        )

    def decode_ns(self, batch_size: int, ctx_tokens: int = 0) -> int:
        """``ctx_tokens``: the positions each request of the batch attends to (its KV
        length: the prompt and the outputs before the one this pass computes), summed."""
        return max(1, int(self._db + self._dr * batch_size + self.ctx_ns * ctx_tokens))


#: the latency-only fit (a median over whole request lifetimes) needs more requests than the
#: per-phase one; smaller captures keep the defaults
_MIN_LATENCY_SPANS = 16
#: "at" a time, for the requests decoding then (``Alive`` counts those alive in a window)
_INSTANT_S = 1e-9


def _received_s(mi: dict[str, Any]) -> float | None:
    """``request_received_ts``, else ``response_sent_to_client_ts − e2e_latency``."""
    v = meta_seconds(mi, "request_received_ts")
    if v is not None:
        return v
    sent, e2e = meta_seconds(mi, "response_sent_to_client_ts"), meta_duration(mi, "e2e_latency")
    if sent is not None and e2e is not None and sent > e2e:
        return sent - e2e
    return None


def is_retracted(r: Any) -> bool:
    """``r`` (a request record) was retracted at least once (``meta_info.num_retractions``)."""
    nr = (r.meta_info or {}).get("num_retractions")
    return isinstance(nr, int) and not isinstance(nr, bool) and nr > 0


def model_text(p: TimingParams) -> str:
    """The pass-time model in one line (what ``kvcadence replay`` prints): each term that is
    not 0."""
    pre = [f"{p.prefill_base_s * 1e3:.2f} ms"]
    if p.prefill_per_token_s:
        pre.append(f"{p.prefill_per_token_s * 1e6:.1f} us/token")
    if p.prefill_per_req_s:
        pre.append(f"{p.prefill_per_req_s * 1e3:.2f} ms/request")
    if p.prefill_per_prefix_token_s:
        pre.append(f"{p.prefill_per_prefix_token_s * 1e6:.2f} us/prefix token")
    if p.prefill_per_seq_sq_s:
        pre.append(f"{p.prefill_per_seq_sq_s * 1e12:.3f} ps/squared sequence token")
    dec = [f"{p.decode_base_s * 1e3:.2f} ms"]
    if p.decode_per_req_s:
        dec.append(f"{p.decode_per_req_s * 1e3:.3f} ms/request")
    if p.decode_per_ctx_token_s:
        dec.append(f"{p.decode_per_ctx_token_s * 1e9:.1f} ns/context token")
    return "prefill " + " + ".join(pre) + "; decode " + " + ".join(dec)


def given_terms(p: TimingParams, overrides: dict[str, Any]) -> list[str]:
    """The pass-time parameters of ``p`` that ``overrides`` set (not fitted), sorted."""
    names = {f.name for f in dataclasses.fields(p)}
    return sorted(k for k, v in overrides.items() if v is not None and k in names)


def model_line(
    p: TimingParams, calibration: dict[str, Any], given: list[str], *, calibrated: bool = True
) -> str:
    """One line: the pass-time model (``model_text``) and where it came from
    (``calibration``: ``calibrate``'s report; empty: not known, or ``calibrated`` False
    under ``--no-calibrate``; ``given``: the terms an option set)."""
    src = calibration.get("source")
    n = calibration.get("requests", 0)
    if not calibrated:
        where = "built-in defaults, --no-calibrate"
    elif src == "phases":
        where = f"calibrated from {n} requests' per-phase timings"
        if calibration.get("left_out"):
            where += (
                f"; {calibration['left_out']} retracted or preempted on the way left out, "
                "their windows holding waits in the queue"
            )
    elif src == "latency":
        where = f"calibrated from {n} requests' receive and finish times"
    elif src == "none":
        where = "built-in defaults: the capture has too few request timings"
    else:
        where = ""
    if given:
        where += ("; " if where else "") + "set by option: " + ", ".join(given)
    return f"pass-time model: {model_text(p)}" + (f" ({where})" if where else "")


def finished_s(mi: dict[str, Any]) -> float | None:
    v = meta_seconds(mi, "request_finished_ts")
    return v if v is not None else meta_seconds(mi, "response_sent_to_client_ts")


def calibrate(
    records: Iterable[Any],
    base: TimingParams | None = None,
    *,
    sync_forward: bool = False,
    overlap: bool = False,
    chunk_tokens: int | None = None,
    report: dict[str, Any] | None = None,
) -> TimingParams:
    """Fit ``TimingParams`` from ``RequestRecord.meta_info`` timings (see module docstring).

    ``report``: where given, filled with what the fit read: ``source`` ``"phases"`` (the
    per-phase timings of ``requests`` requests; ``left_out``: those retracted or preempted
    on the way, not fitted), ``"latency"`` (receive and finish times of ``requests``) or
    ``"none"`` (too few timings: ``base`` stands).

    ``sync_forward``: the worker ran each forward inside its launch (``--device cpu``), so a
    prefill batch's ``prefill_finished_time`` is the end of the *next* forward: the batch's
    own duration is the next batch's ``forward_entry_time`` minus its own when the next batch
    is a prefill, else ``prefill_finished_time − forward_entry_time − one decode pass``."""
    records = list(records)
    p = TimingParams() if base is None else TimingParams(**_asdict(base))
    rows = []
    # rows[i]'s request was retracted or preempted: it waited again mid-run, so its window
    # is no decode time, and its prefill time may be none either (below)
    retracted = []
    spans = []  # (received, finished, completion tokens) from server-side times
    for r in records:
        mi = r.meta_info or {}
        n = r.completion_tokens or len(r.output_ids) or 0
        rx, fin = _received_s(mi), finished_s(mi)
        uncached = (r.prompt_tokens or len(r.input_ids)) - (r.cached_tokens or 0)
        if rx is not None and fin is not None and fin > rx:
            spans.append((rx, fin, int(n), max(uncached, 0)))
        fe, pf = meta_seconds(mi, "forward_entry_time"), meta_seconds(mi, "prefill_finished_time")
        if fe is None or pf is None or rx is None or fin is None:
            continue
        prompt = r.prompt_tokens or len(r.input_ids)
        cached = r.cached_tokens or 0
        rows.append(
            (
                fe,
                pf,
                rx,
                fin,
                int(n),
                prompt - cached,
                attended(cached, prompt - cached, chunk_tokens),
                prompt,
                passes(prompt - cached, chunk_tokens),
                squared(cached, prompt - cached, chunk_tokens),
            )
        )
        retracted.append(is_retracted(r))
    if len(rows) < 4:
        latency = len(spans) >= _MIN_LATENCY_SPANS
        if latency:
            _calibrate_from_latency(p, spans, sync_forward)
        if report is not None:
            report.update(source="latency" if latency else "none", requests=len(spans))
        p.default_gap_s = _median_gap(records, p.default_gap_s)
        return p
    if report is not None:
        n_back = sum(retracted)
        report.update(source="phases", requests=len(rows) - n_back, left_out=n_back)
    # prefill batches: (entry, finished, uncached tokens, attended prefix tokens, passes), of the
    # requests never retracted: SGLang keeps a request's first ``forward_entry_time`` and its
    # first ``prefill_finished_time``, and those of a preempted request may span a wait in
    # the queue (``p16-lof-lowprio-mrr4-http-clients``: 90th percentile 1.75 s, the others'
    # 34 ms)
    groups = sorted(
        (
            min(g[0] for g in grp),
            median(g[1] for g in grp),
            sum(g[5] for g in grp),
            sum(g[6] for g in grp),
            median(g[8] for g in grp),
            sum(g[9] for g in grp),
        )
        for grp in prefill_batches(r for r, back in zip(rows, retracted, strict=True) if not back)
    )
    entries = [g[0] for g in groups]

    prefix_xs: list[float] = []
    passes_xs: list[float] = []
    sq_xs: list[float] = []

    alive = Alive([r[1] for r in rows], [r[3] for r in rows])

    def prefill_durations(decode_s: float) -> tuple[list[float], list[float], list[tuple]]:
        xs, ys, ends = [], [], []
        prefix_xs.clear()
        passes_xs.clear()
        sq_xs.clear()
        for i, (e, f, toks, prefix, npass, sq) in enumerate(groups):
            nxt = entries[i + 1] if i + 1 < len(entries) else None
            prev = groups[i - 1][1] if i > 0 else None
            busy = overlap and alive(e, e + _INSTANT_S) > 0  # a decode forward ran at entry
            dur = prefill_duration(
                e, f, nxt, sync_forward, decode_s, overlap=overlap, prev=prev, busy=busy
            )
            if dur > 0:
                xs.append(float(toks))
                prefix_xs.append(float(prefix))
                passes_xs.append(float(npass))
                sq_xs.append(float(sq))
                ys.append(dur)
                ends.append((e + dur if sync_forward else f, dur))
        return xs, ys, ends

    per_ctx = p.decode_per_ctx_token_s  # given (> 0): kept, the rest fitted around it
    context = Context(
        [r[1] for r in rows], [r[3] for r in rows], [r[7] for r in rows], [r[4] for r in rows]
    )

    def decode_fit(ends: list[tuple[Any, ...]]) -> tuple[float, float, float, float] | None:
        """``(base, per request, a typical pass, per context token)``: the typical pass's
        context part in; the context term the given one, else fitted where the contexts are
        long (``decodefit.fit_decode``)."""
        per_pass, conc, ctx = [], [], []
        inside_of = Inside(ends)
        for (_fe, pf, _rx, fin, n, _u, _c, _p, _k, _q), back in zip(rows, retracted, strict=True):
            if n < 2 or fin <= pf or back:
                continue
            inside = inside_of(pf, fin)
            t = (fin - pf - inside) / (n - 1)
            if t <= 0:
                continue
            per_pass.append(t)
            conc.append(float(alive(pf, fin)))
            ctx.append(context(pf, fin))
        if len(per_pass) < 3:
            return None
        a, b, c = fit_decode(conc, ctx, per_pass, per_ctx)
        return a, b, a + b * median(conc) + c * median(ctx), c

    xs, ys, ends = prefill_durations(0.0)
    fit = decode_fit(ends)
    refits = 1 if sync_forward else 2 if overlap else 0
    for _ in range(refits):
        if fit is None:
            break
        # the decode pass a prefill batch's recorded time spans (the one after it, with
        # ``sync_forward``; the one before it, with ``overlap``), then refit decode without it
        xs, ys, ends = prefill_durations(fit[2])
        fit = decode_fit(ends) or fit
    if len(xs) >= 3:
        a, b, c, q = fit_prefill(passes_xs, xs, prefix_xs, sq_xs, ys)
        p.prefill_base_s, p.prefill_per_token_s, p.prefill_per_prefix_token_s = a, b, c
        p.prefill_per_seq_sq_s = q
    if fit is not None:
        p.decode_base_s, p.decode_per_req_s, p.decode_per_ctx_token_s = fit[0], fit[1], fit[3]
    p.default_gap_s = _median_gap(records, p.default_gap_s)
    return p


def prefill_batches(rows: Iterable[tuple[Any, ...]]) -> list[list[tuple[Any, ...]]]:
    """``rows`` (``forward_entry_time`` first) grouped into prefill batches: the requests
    sharing one ``forward_entry_time`` (to the microsecond)."""
    batches: dict[int, list[tuple[Any, ...]]] = {}
    for row in rows:
        batches.setdefault(round(row[0] * 1e6), []).append(row)
    return list(batches.values())


def prefill_duration(
    entry: float,
    finished: float,
    nxt: float | None,
    sync_forward: bool,
    decode_s: float,
    *,
    overlap: bool = False,
    prev: float | None = None,
    busy: bool = False,
) -> float:
    """The forward of a prefill batch entering at ``entry`` whose result was recorded at
    ``finished``: ``finished − entry``; with ``sync_forward`` (the result processed after
    the next forward) up to the next batch's entry ``nxt`` when that is a prefill entering
    before ``finished``, else ``finished − entry − decode_s`` (one decode pass). With
    ``overlap`` (the overlap loop on a GPU: a batch is formed, ``forward_entry_time``, while
    the forward before it runs, and runs after it) from the previous forward's end: the
    previous prefill batch's result ``prev`` when it came after ``entry``, else, when
    requests were decoding at ``entry`` (``busy``), one decode pass after ``entry``."""
    dur = finished - entry
    if sync_forward:
        dur = nxt - entry if nxt is not None and nxt < finished else dur - decode_s
    elif overlap:
        if prev is not None and entry < prev < finished:
            dur = finished - prev
        elif busy:
            dur -= decode_s
    return dur


def _calibrate_from_latency(
    p: TimingParams, spans: list[tuple[float, float, int, int]], sync_forward: bool
) -> None:
    """No per-phase timings (only receive and finish, e.g. a capture whose driver got no
    ``forward_entry_time``): a request's latency spans its own passes — ``outputs − 1 + k``
    decode-sized ones (``k`` = 2 under a synchronous forward: the prefill forward and the
    one after it, else 1) — plus one prefill pass per request received meanwhile, each
    worth ``rho`` decode passes (the default model's prefill / decode ratio at the median
    uncached prompt and concurrency). One pass = the median of ``latency / passes``, split
    into base + per request by the number of requests alive in the same window; the
    prefill costs are the defaults scaled by the measured / default decode pass ratio."""
    k = 2 if sync_forward else 1
    alive, arrivals_in = overlaps(spans)
    conc_all = [float(c) for c in alive]
    mc = median(conc_all)
    default_decode = p.decode_base_s + p.decode_per_req_s * mc
    if default_decode <= 0:
        return
    default_prefill = (
        p.prefill_base_s + p.prefill_per_token_s * median(s[3] for s in spans) + p.prefill_per_req_s
    )
    rho = default_prefill / default_decode
    per_pass, conc = [], []
    for (rx, fin, n, _u), c, arrivals in zip(spans, conc_all, arrivals_in, strict=True):
        if n < 2:
            continue
        per_pass.append((fin - rx) / (n - 1 + k + rho * arrivals))
        conc.append(c)
    if len(per_pass) < 3:
        return
    a, b = fit_line(conc, per_pass)
    if a + b * mc <= 0:
        a, b = median(per_pass), 0.0
    scale = (a + b * mc) / default_decode
    p.decode_base_s, p.decode_per_req_s = a, b
    p.prefill_base_s *= scale
    p.prefill_per_token_s *= scale
    p.prefill_per_req_s *= scale


def _median_gap(records: list[Any], default: float) -> float:
    """Median client gap (previous finish → next receive on a lane)."""
    by_lane: dict[Any, list[Any]] = {}
    for r in records:
        if r.lane is not None:
            by_lane.setdefault(r.lane, []).append(r)
    gaps = []
    for lane_recs in by_lane.values():
        lane_recs = sorted(lane_recs, key=lambda r: _received_s(r.meta_info or {}) or 0.0)
        for a_, b_ in zip(lane_recs, lane_recs[1:], strict=False):
            fa = finished_s(a_.meta_info or {})
            rb = _received_s(b_.meta_info or {})
            if fa is not None and rb is not None and rb > fa:
                gaps.append(rb - fa)
    return median(gaps) if gaps else default


def _asdict(p: TimingParams) -> dict[str, float]:
    import dataclasses

    return dataclasses.asdict(p)
