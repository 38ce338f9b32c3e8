"""The request driver: send a workload to SGLang's ``POST /generate`` and record each request.

Requests carry ``input_ids`` (no tokenizer needed), ``temperature: 0``, ``ignore_eos: true``
(``ignore_eos=False``: off, so a request may stop at EOS and SGLang's admission reserves only
``new_token_ratio`` of its remaining output; with ``ignore_eos`` on it reserves all of it)
and the workload's ``max_new_tokens``; the workload's request id is sent as ``rid`` so the
server's own logs (``--export-metrics-to-file``) name the same request. Each response becomes
one ``RequestRecord`` (send / first-token / finish times, input and output token ids,
``meta_info`` prompt / cached / completion tokens, finish reason, or the HTTP error; the
sampling parameters sent are kept as ``meta_info["request_parameters"]["sampling_params"]``,
where the import of SGLang's metrics files keeps them).

Closed loop: one thread per lane, each sending its next request after the previous one
finished and the workload's pause. Open loop: requests start at their trace arrival offsets
(a thread pool bounded by ``max_concurrency``). HTTP through one shared ``httpx.Client``.

``flush_at=[N, ...]``: after N requests were sent, no further request starts until the ones in
flight finished; then (after ``flush_settle_s``, so the worker publishes its pending events
first) the driver calls ``POST /flush_cache`` (SGLang flushes only when idle), records an
``Annotation(kind="flush_cache")`` with the outcome, waits ``flush_settle_s`` again (the
``AllBlocksCleared`` goes out on its own) and lets the lanes go on. ``rid_prefix`` is put in
front of every request id (several drives against one worker keep distinct rids).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvcadence.capture.workloads import Req, Workload
from kvcadence.errors import CaptureError, UsageError
from kvcadence.format.schema import (
    MAX_SECONDS,
    Annotation,
    RequestRecord,
    meta_duration,
    meta_seconds,
)


@dataclass
class DriveStats:
    sent: int = 0
    ok: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    flushes: int = 0
    flush_failures: int = 0


def _finish_reason(meta: dict[str, Any]) -> str | None:
    fr = meta.get("finish_reason")
    if isinstance(fr, dict):
        return str(fr.get("type")) if fr.get("type") is not None else None
    return None if fr is None else str(fr)


def _first_token_ns(meta: dict[str, Any]) -> int | None:
    recv, ftl = (
        meta_seconds(meta, "request_received_ts"),
        meta_duration(meta, "first_token_latency"),
    )
    if recv is None or ftl is None or recv + ftl >= MAX_SECONDS:
        return None
    return int((recv + ftl) * 1e9)


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def record_from_response(
    req: Req,
    *,
    send_ns: int,
    finish_ns: int,
    status: int | None,
    body: Any,
    error: str | None = None,
    sampling_params: dict[str, Any] | None = None,
) -> RequestRecord:
    """Build a ``RequestRecord`` from one ``/generate`` exchange (or its failure);
    ``sampling_params`` (what was sent) go to ``meta_info["request_parameters"]``."""
    out_ids: list[int] = []
    meta: dict[str, Any] = {}
    if error is None and status != 200:
        text = body if isinstance(body, str) else str(body)
        error = f"HTTP {status}: {text[:300]}"
    if error is None:
        if not isinstance(body, dict):
            error = f"unexpected /generate response: {str(body)[:200]}"
        else:
            meta = body.get("meta_info") or {}
            ids = body.get("output_ids")
            out_ids = [int(t) for t in ids] if isinstance(ids, list) else []
    return RequestRecord(
        rid=req.rid,
        input_ids=list(req.input_ids),
        output_ids=out_ids,
        send_ns=send_ns,
        first_token_ns=_first_token_ns(meta),
        finish_ns=finish_ns,
        lane=req.lane,
        session=req.session,
        turn=req.turn,
        max_new_tokens=req.max_new_tokens,
        prompt_tokens=_opt_int(meta.get("prompt_tokens")),
        cached_tokens=_opt_int(meta.get("cached_tokens")),
        completion_tokens=_opt_int(meta.get("completion_tokens")),
        finish_reason=_finish_reason(meta),
        error=error,
        dp_rank=_opt_int(meta.get("dp_rank")),
        source="driver",
        think_ns=req.think_ns,
        arrival_ns=req.arrival_ns,
        meta_info={
            **meta,
            **({"workload": req.note} if req.note else {}),
            **(
                {"request_parameters": {"sampling_params": sampling_params}}
                if sampling_params
                else {}
            ),
        },
    )


class Driver:
    """Sends a workload to one server; ``sink`` receives every ``RequestRecord`` (and the
    ``Annotation`` of each cache flush)."""

    def __init__(
        self,
        server_url: str,
        workload: Workload,
        sink: Callable[[Any], None],
        *,
        timeout_s: float = 600.0,
        stop: threading.Event | None = None,
        progress: Callable[[RequestRecord], None] | None = None,
        transport: Any = None,
        flush_at: Sequence[int] = (),
        flush_settle_s: float = 0.5,
        rid_prefix: str = "",
        ignore_eos: bool = True,
    ) -> None:
        if any(n < 1 for n in flush_at):
            raise UsageError("--flush-at N needs N >= 1 (flush after the first N requests)")
        self.transport = transport  # an httpx transport (tests use httpx.MockTransport)
        self.base_url = server_url.rstrip("/")
        self.url = self.base_url + "/generate"
        self.flush_points = sorted(set(flush_at))
        self.flush_settle_s = flush_settle_s
        self.rid_prefix = rid_prefix
        self.ignore_eos = ignore_eos
        self._gate = threading.Condition()
        self._started = 0  # requests past the gate
        self._in_flight = 0
        self._flushing = False
        self.workload = workload
        self.sink = sink
        self.timeout_s = timeout_s
        self.stop = stop or threading.Event()
        self.progress = progress
        self.stats = DriveStats()
        self._lock = threading.Lock()
        self._client: Any = None

    # ------------------------------------------------------------ flush gate

    def _enter(self) -> None:
        """Wait for a due flush (performed by the last thread to arrive), then count this
        request as in flight."""
        while True:
            with self._gate:
                while True:
                    due = bool(self.flush_points) and self._started >= self.flush_points[0]
                    if not due:
                        self._started += 1
                        self._in_flight += 1
                        return
                    if self._in_flight == 0 and not self._flushing:
                        self._flushing = True
                        break
                    self._gate.wait(0.5)
            try:
                self._flush(self.flush_points[0])
            finally:
                with self._gate:
                    self.flush_points.pop(0)
                    self._flushing = False
                    self._gate.notify_all()

    def _leave(self) -> None:
        with self._gate:
            self._in_flight -= 1
            self._gate.notify_all()

    def _flush(self, after: int) -> None:
        """``POST /flush_cache`` with nothing in flight; the outcome becomes an Annotation."""
        import httpx

        if self.stop.wait(self.flush_settle_s):
            return
        t0 = time.time_ns()
        try:
            resp = self._client.post(self.base_url + "/flush_cache", params={"timeout": 10})
            status: int | None = resp.status_code
            text = resp.text
        except httpx.HTTPError as exc:
            status, text = None, f"{type(exc).__name__}: {exc}"
        ok = status == 200
        with self._lock:
            self.stats.flushes += ok
            self.stats.flush_failures += not ok
        self.sink(
            Annotation(
                kind="flush_cache",
                recv_ns=t0,
                data={
                    "after_requests": after,
                    "ok": ok,
                    "status": status,
                    "response": text[:300],
                    "send_ns": t0,
                    "finish_ns": time.time_ns(),
                },
            )
        )
        self.stop.wait(self.flush_settle_s)

    # ------------------------------------------------------------ requests

    def send(self, req: Req) -> RequestRecord:
        """Send one request (after any flush that is due) and record it."""
        self._enter()
        try:
            return self._send(req)
        finally:
            self._leave()

    def _send(self, req: Req) -> RequestRecord:
        import httpx

        if self.rid_prefix:
            req = dataclasses.replace(req, rid=self.rid_prefix + req.rid)
        sampling = {
            "max_new_tokens": req.max_new_tokens,
            "temperature": 0,
            "ignore_eos": self.ignore_eos,
        }
        body = {"rid": req.rid, "input_ids": req.input_ids, "sampling_params": sampling}
        send_ns = time.time_ns()
        try:
            resp = self._client.post(self.url, json=body)
        except httpx.HTTPError as exc:
            rec = record_from_response(
                req,
                send_ns=send_ns,
                finish_ns=time.time_ns(),
                status=None,
                body=None,
                error=f"{type(exc).__name__}: {exc}",
                sampling_params=sampling,
            )
        else:
            finish_ns = time.time_ns()
            try:
                payload: Any = resp.json()
            except ValueError:
                payload = resp.text
            rec = record_from_response(
                req,
                send_ns=send_ns,
                finish_ns=finish_ns,
                status=resp.status_code,
                body=payload,
                sampling_params=sampling,
            )
        self._account(rec)
        return rec

    def _account(self, rec: RequestRecord) -> None:
        with self._lock:
            st = self.stats
            st.sent += 1
            if rec.error is None:
                st.ok += 1
                st.prompt_tokens += rec.prompt_tokens or 0
                st.cached_tokens += rec.cached_tokens or 0
                st.completion_tokens += rec.completion_tokens or 0
            else:
                st.errors += 1
        self.sink(rec)
        if self.progress is not None:
            self.progress(rec)

    def _lane(self, lane: int) -> None:
        prev: Req | None = None
        prev_out: list[int] = []
        while not self.stop.is_set():
            req = self.workload.next_request(lane, prev, prev_out)
            if req is None:
                return
            if req.think_ns and self.stop.wait(req.think_ns / 1e9):
                return
            rec = self.send(req)
            prev, prev_out = req, rec.output_ids

    def run(self) -> DriveStats:
        """Run the whole workload (blocks); returns the counts."""
        import httpx

        wl = self.workload
        n_conc = max(1, getattr(wl, "max_concurrency", 0) if wl.open_loop() else wl.lanes)
        limits = httpx.Limits(max_connections=n_conc + 2, max_keepalive_connections=n_conc + 2)
        t0 = time.monotonic()
        with httpx.Client(
            timeout=self.timeout_s, limits=limits, transport=self.transport
        ) as client:
            self._client = client
            errors: list[BaseException] = []
            if wl.open_loop():
                self._open_loop(n_conc, errors)
            else:
                threads = [
                    threading.Thread(
                        target=self._guard, args=(self._lane, lane, errors), name=f"lane-{lane}"
                    )
                    for lane in range(wl.lanes)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            self._client = None
        self.stats.wall_s = time.monotonic() - t0
        if errors:
            raise CaptureError(f"driver failed: {errors[0]}") from errors[0]
        return self.stats

    def _guard(self, fn: Callable[..., object], arg: Any, errors: list[BaseException]) -> None:
        try:
            fn(arg)
        except BaseException as exc:  # noqa: BLE001 - surfaced by run()
            errors.append(exc)
            self.stop.set()

    def _open_loop(self, n_conc: int, errors: list[BaseException]) -> None:
        reqs = sorted(self.workload.all_requests(), key=lambda r: r.arrival_ns or 0)
        t0 = time.monotonic_ns()
        with ThreadPoolExecutor(max_workers=n_conc, thread_name_prefix="open-loop") as pool:
            futs = []
            for req in reqs:
                delay = ((req.arrival_ns or 0) - (time.monotonic_ns() - t0)) / 1e9
                if delay > 0 and self.stop.wait(delay):
                    break
                futs.append(pool.submit(self._guard, self.send, req, errors))
            for f in futs:
                f.result()
