"""Decode-stretch skipping: the simulated scheduler's fast path through quiet decode passes.

Methods of ``Scheduler`` (bound in its class body). When only decoding requests run and nothing can arrive, finish,
publish or be admitted for ``m`` passes, the stretch is booked at once (token counts, ratio
decay, pass times, visibility) instead of stepping pass by pass; passes short of free slots
evict inside the stretch exactly as they would stepped, and a pass that would retract ends
the stretch before it. Output is identical to stepping every pass (property-tested).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from typing import TYPE_CHECKING, Any

from kvcadence.replay.request import Batch

if TYPE_CHECKING:  # type-only: the mixin's methods run on a Scheduler
    from kvcadence.replay.scheduler import Scheduler

_INF = float("inf")
_DECODE_PHASES = array("b", (1,))


def _skip_decode_stretch(  # noqa: C901 - the stretch bound: every condition that ends a decode stretch, in one hot function
    self: Scheduler, t: int, last: Batch | None, horizon: float = _INF
) -> tuple[int, Batch | None] | None:
    """Advance M > 1 pure-decode iterations at once when nothing can happen in them.

    ``horizon``: no arrival will be added before it (``step``'s); the stretch stops
    there as at a known arrival."""
    if self.waiting or self.chunked_req is not None or self.pending_merge:
        return None
    running = self.running
    if not running:
        return None
    if self._aborts or self._pauses or self.held:
        return None
    interval = self.cfg.decode_log_interval
    # the cheap bounds first (next publish point, next arrival); the per-request one
    # (next finish) only when they allow a stretch
    m = interval - 1 - (self.decode_ct % interval)
    if m < 2:
        return None  # every bound below only lowers m
    overlap = self.overlap
    if overlap and (last is None or last.kind != "decode" or last.reqs != running):
        return None
    next_arr = self.arrivals[0][0] if self.arrivals else None
    if horizon < _INF and (next_arr is None or horizon < next_arr):
        next_arr = int(horizon)
    if next_arr is not None and next_arr <= t:
        return None  # an arrival to receive now
    # the next finish (a running request with fewer than 2 passes left ends any stretch:
    # the commonest refusal, so checked before the pass time is computed)
    left = min([r.decode_left for r in running])
    if not overlap:
        left -= 1
    if left < 2:
        return None
    ps = self.ps
    timer = self.timer
    # the passes' ends after the stretch's start: ``cum[j]`` (j passes), or ``j * d``
    cum: list[int] | None = None
    if timer.ctx_ns:  # a pass grows with the context: a token a request a pass
        cum = _pass_ends(timer, running, min(m, left))
        d = cum[1]
    else:
        d = timer.decode_ns(len(running))
    if overlap:
        assert last is not None
        e = last.end_ns
        if next_arr is not None:
            jmax = _fits(cum, d, next_arr - e)
            # GPU overlap: iteration j receives at e + (j-2)d (j >= 2); synchronous
            # forward (CPU): at e + (j-1)d, after the previous forward ended
            m = min(m, jmax if self.sync else jmax + 1)
        if m < 2:
            return None
        m = min(m, left)
    else:
        if last is not None:
            return None
        if next_arr is not None:
            m = min(m, _fits(cum, d, next_arr - t))
        if m < 2:
            return None
        m = min(m, left)
    if m < 2:
        return None
    # memory: the stretch's allocations fit, or fit after each pass evicts its own
    # shortfall first (as ``_update_running_batch`` does)
    if ps == 1:
        need = m * len(running)
    else:
        need = 0
        for r in running:
            k = r.kv_len
            need += ps * ((k + m - 1) // ps - (k - 1) // ps)
    stepped = 0  # leading passes booked as stepped one at a time
    # page > 1: every pass's allocation evicts unless a page per request is free
    if self.available() < need + (len(running) * ps if ps > 1 else 0):
        m, stepped = self._evict_through_stretch(m)
        if m < 2:
            return None
        need = sum(self._stretch_needs(m))
    # apply m iterations
    start = max(t, self.gpu_free) if not self.overlap else self.gpu_free
    first_pass = self.pass_index + 1
    base = start if self.overlap else t
    if self.track:
        self._dec_pass.extend(range(first_pass, first_pass + m))
        ends = (
            range(base + d, base + (m + 1) * d, d)
            if cum is None
            else [base + c for c in cum[1 : m + 1]]
        )
        self._dec_end.extend(ends)
        self.pass_end.extend(ends)
        self.pass_phase.extend(_DECODE_PHASES * m)
    span = m * d if cum is None else cum[m]  # the m passes' time
    span1 = span - d if cum is None else cum[m - 1]  # ... the first m - 1's
    if ps == 1:
        for r in running:
            r.kv_len += m
            r.decode_left -= m
            r.output_len += m
            r.alloc += m
        self.private_total += need
    else:
        for r in running:
            k = r.kv_len
            self._alloc(r, ps * ((k + m - 1) // ps - (k - 1) // ps))
            r.kv_len = k + m
            r.decode_left -= m
            r.output_len += m
    tracker = self.tracker
    for _ in range(stepped):
        tracker.on_decode_steps(1)
    if m > stepped:
        tracker.on_decode_steps(m - stepped)
    self.decode_ct += m
    self.stats.decode_passes += m
    self.stats.skipped_passes += m - stepped
    self.pass_index += m
    self.processed_tokens += m * self.decode_extend_tokens  # ``hrrn``'s clock, as each launch
    if self.overlap:
        # results processed: last + the first m-1 new batches; the m-th is in flight
        new_last = Batch("decode", list(running), [], self.pass_index)
        new_last.end_ns = start + span
        self.gpu_free = new_last.end_ns
        return (new_last.end_ns if self.sync else start + span1), new_last
    self.gpu_free = t + span
    return t + span, None


def _pass_ends(timer: Any, running: list[Any], m: int) -> list[int]:
    """``[0, d_0, d_0 + d_1, ...]`` (``m + 1`` of them): the ends of the next ``m`` decode
    passes of ``running`` after their start, each as stepping times it (``decode_ns`` of
    the batch's KV lengths after that pass's token)."""
    n = len(running)
    ctx = sum([r.kv_len for r in running])
    out = [0]
    acc = 0
    for _ in range(m):
        ctx += n
        acc += timer.decode_ns(n, ctx)
        out.append(acc)
    return out


def _fits(cum: list[int] | None, d: int, room: int) -> int:
    """How many of ``0, 1, 2, ...`` passes end before ``room`` (``j`` such that the end of
    ``j`` passes ``< room``; ``cum``: those ends, else ``j * d``). With ``cum``, at most
    ``len(cum)`` (the caller's bound is below it)."""
    if room <= 0:
        return 0
    if cum is None:
        return (room - 1) // d + 1
    return bisect_left(cum, room)


def _stretch_needs(self: Scheduler, m: int) -> list[int]:
    """KV slots each of the next ``m`` decode passes allocates (page size > 1: a page
    per request whose KV length is page aligned at that pass)."""
    running = self.running
    ps = self.ps
    if ps == 1:
        return [len(running)] * m
    needs = [0] * m
    for r in running:
        for j in range((-r.kv_len) % ps, m, ps):
            needs[j] += ps
    return needs


def _evict_through_stretch(self: Scheduler, m: int) -> tuple[int, int]:
    """A decode stretch of up to ``m`` passes whose allocations do not fit in the free
    slots: evict, pass by pass, what each pass's ``check_decode_mem`` would (its
    shortfall, whole LRU leaves; the same calls in the same order as stepping).

    Returns ``(kept, stepped)``: the passes that fit (at the first that does not, which
    would retract, the stretch ends; stepping it again evicts nothing more, since
    nothing is left to evict), and how many of them stepping one pass at a time would
    have run before the rest fitted without eviction and were skipped at once (all
    ``kept`` when never). The caller books the ratio decay and the skipped-pass count
    as that stepping would, so the run's output is the same."""
    tree = self.tree
    cap = self.cfg.max_total_tokens
    private = self.private_total
    needs = self._stretch_needs(m)
    left = sum(needs)  # allocations of this pass and the ones after it
    ps = self.ps
    page_each = len(self.running) * ps if ps > 1 else 0  # the allocation's own target
    stepped = -1
    for j, need in enumerate(needs):
        avail = cap - tree.total_size - private
        if stepped < 0 and j > 0 and m - j >= 2 and avail >= left + page_each:
            stepped = j  # from here the step's own stretch check would have passed
        if avail < need:
            if tree.evict(need - avail):
                self.stats.evictions += 1
            if cap - tree.total_size - private < need:
                return j, j
        if page_each:
            avail = cap - tree.total_size - private
            if avail < page_each and tree.evict(page_each - avail):
                self.stats.evictions += 1
        private += need
        left -= need
    return m, (m if stepped < 0 else stepped)
