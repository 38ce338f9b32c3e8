"""The capture loop: one thread polls every endpoint's sockets and writes the bundle.

``Recorder.run(stop)`` runs one ``zmq.Poller`` over all SUB sockets (and replay DEALERs while
a replay is outstanding), drains each ready socket with ``NOBLOCK`` (up to 5000 messages per
poll), and writes each message in seq order. The receive path is kept lean: frames are read
with ``copy=False`` (their more-flag saves ``recv_multipart``'s per-frame option lookup), the
next expected seq is compared against a local counter and the message joins the burst, which
is written with one ``BundleWriter.write_event_batch`` (one file write; same bytes as one
``write_event`` per message) when the burst ends or before anything else is written; counters
are added once per burst; anything else (gaps, replays, epochs) goes through the endpoint's
``SeqTracker``, whose runs of frames are batched the same way. The stats decode of written
payloads (events, blocks, undecodable ones) is deferred (``capture.backlog``): it runs for a
few ms when the stream pauses for a millisecond, down to half its cap whenever its backlog
passes ``max_backlog_bytes`` (so a stream that never pauses cannot make it grow), and at
shutdown.
Other threads (the request driver) hand records in with ``submit()``; only this thread
touches the writer. Stops when ``stop`` is set (SIGINT/SIGTERM handlers set it), after
``duration_s``, or after ``until_idle_s`` seconds without messages (counted from the last
message, or from start-up when nothing arrived yet, so a wrong endpoint still ends); then it
drains what is pending, ends outstanding replays, and closes the writer (``Trailer`` +
fsync). With ``warn_idle_s`` set (the CLI: 10 s unless ``--quiet``), one warning line goes
to ``warn_stream`` (stderr) when nothing at all arrived that long after start-up.

The sockets are made (and connected) in ``__init__``, before the caller opens the bundle:
``Recorder(None, endpoints)`` then ``attach(writer)``, so a socket error leaves no bundle
behind (``close()`` releases the sockets of a recorder that never ran). Whatever exception
ends ``run``, the writer is closed with ``clean=False`` first.

Malformed ZMQ messages (wrong frame count, short seq, a seq above ``seqtrack.MAX_SEQ``) are
counted and kept raw in an ``Annotation``; payloads that do not decode are counted,
annotated, and still written (the bundle writer keeps non-msgpack bytes as a bin payload).
A write failure (disk full) stops the capture with a ``CaptureError``; segments already
written stay intact.

Why ~660 lines: one poll loop with its fast path, replay handling, idle flush and stats; the
sockets are ``capture.source``, seq logic ``capture.seqtrack``.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from kvcadence.capture.backlog import StatsBacklog
from kvcadence.capture.seqtrack import MAX_SEQ, Out, Output
from kvcadence.capture.source import EndpointSource
from kvcadence.errors import BundleError, CaptureError, WireError
from kvcadence.format import wire
from kvcadence.format.schema import (
    VIA_LIVE,
    Annotation,
    BlockRemoved,
    BlockStored,
    EndpointInfo,
    Epoch,
    Gap,
)

#: the CLI's "no traffic yet" warning delay (seconds after start-up)
NO_TRAFFIC_WARN_S = 10.0

# A drain burst is written once this many payload bytes are pending: small enough that the
# payloads are still in the CPU cache when the writer checks, copies and CRCs them (measured
# on the capture benchmark's stream: 256 KiB ~6.2 us/msg, 8 MiB ~6.6-7.6 us/msg), and it
# bounds the burst's memory.
_BURST_BYTES = 256 << 10
# Received data is handed to the OS (what a SIGKILL cannot take) at the first quiet poll, and
# while messages keep coming once the oldest unflushed record is this old: with the idle poll
# below, nothing received waits more than ~150 ms (docs/format.md section 4: <= 200 ms).
_FLUSH_AGE_S = 0.1
_IDLE_POLL_MS = 50


@dataclass
class CaptureStats:
    """Counters of one capture (``as_dict()`` goes into the Trailer)."""

    messages: int = 0  # live messages received
    written: int = 0  # event frames written (live + recovered)
    bytes: int = 0  # payload bytes written
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    malformed: int = 0
    undecodable: int = 0
    requests: int = 0
    started_ns: int = 0
    first_msg_ns: int = 0
    last_msg_ns: int = 0
    last_write_ns: int = 0
    cpu_s: float = 0.0  # CPU time of the capture loop's thread (receive, write, decode)
    decode_cpu_s: float = 0.0  # of which the deferred stats decode
    stop_reason: str = ""
    per_endpoint: dict[int, dict[str, int]] = field(default_factory=dict)
    sglang_logs: dict[str, int] = field(default_factory=dict)  # capture.tail's counters

    def totals(self) -> dict[str, int]:
        keys = ("gaps", "missed", "recovered", "unrecovered", "epochs", "replays")
        return {k: sum(d.get(k, 0) for d in self.per_endpoint.values()) for k in keys}

    def as_dict(self) -> dict[str, Any]:
        d = {
            k: getattr(self, k)
            for k in (
                "messages",
                "written",
                "bytes",
                "events",
                "blocks_stored",
                "blocks_removed",
                "malformed",
                "undecodable",
                "requests",
                "stop_reason",
            )
        }
        d["cpu_s"] = round(self.cpu_s, 4)
        d["decode_cpu_s"] = round(self.decode_cpu_s, 4)
        d.update(self.totals())
        d["per_endpoint"] = {str(k): v for k, v in self.per_endpoint.items()}
        if self.sglang_logs:
            d["sglang_logs"] = dict(self.sglang_logs)
        return d


class StatusLine:
    """A one-line live status on a TTY (``\\r``-rewritten), a summary at the end."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self._last_t = time.monotonic()
        self._last_n = 0
        self._width = 0

    def update(self, st: CaptureStats, force: bool = False) -> None:
        if not self.live:
            return
        now = time.monotonic()
        if not force and now - self._last_t < 0.5:
            return
        rate = (st.messages - self._last_n) / max(now - self._last_t, 1e-9)
        self._last_t, self._last_n = now, st.messages
        t = st.totals()
        line = (
            f"capture: {rate:8.0f} msg/s  msgs {st.messages}  events {st.events}  "
            f"blocks +{st.blocks_stored}/-{st.blocks_removed}  gaps {t['gaps']} "
            f"(unrecovered {t['unrecovered']})  recovered {t['recovered']}  "
            f"{st.bytes / 1e6:.1f} MB"
        )
        pad = max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()

    def finish(self) -> None:
        if self.live and self._width:
            self.stream.write("\n")
            self.stream.flush()


def summary_text(st: CaptureStats, path: str) -> str:
    t = st.totals()
    attached = sorted(
        (int(k), d["attached_at_seq"]) for k, d in st.per_endpoint.items() if "attached_at_seq" in d
    )
    joined = (
        "; attached mid-run at seq "
        + ", ".join(f"{s} (endpoint {e})" for e, s in attached)
        + ", earlier history not recorded"
        if attached
        else ""
    )
    return (
        f"capture: {st.written} event frames ({st.messages} live, {t['recovered']} recovered "
        f"by replay), {st.events} events, blocks +{st.blocks_stored}/-{st.blocks_removed}, "
        f"{t['gaps']} gaps ({t['missed']} seqs missed, {t['unrecovered']} unrecovered), "
        f"{t['epochs']} new epochs, {st.malformed} malformed, {st.undecodable} undecodable, "
        f"{st.requests} requests, {st.bytes / 1e6:.2f} MB -> {path} ({st.stop_reason}){joined}"
    )


class Recorder:
    """Polls endpoints and writes a bundle (see the module docstring)."""

    def __init__(
        self,
        writer: Any,
        endpoints: list[EndpointInfo],
        *,
        replay_timeout_s: float = 2.0,
        initial_replay: bool = True,
        from_now: bool = False,
        duration_s: float | None = None,
        until_idle_s: float | None = None,
        decode_stats: bool = True,
        status: StatusLine | None = None,
        ctx: Any = None,
        max_buffer: int = 1_000_000,
        on_ready: Callable[[], None] | None = None,
        max_backlog_bytes: int = 64 << 20,
        warn_idle_s: float | None = None,
        warn_stream: TextIO | None = None,
    ) -> None:
        import zmq

        if not endpoints:
            raise CaptureError("no KV-event endpoint to capture")
        self._zmq = zmq
        self.writer = writer
        self.ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.sources: list[EndpointSource] = []
        try:
            for e in endpoints:
                self.sources.append(
                    EndpointSource(
                        self.ctx,
                        e,
                        replay_timeout_s=replay_timeout_s,
                        max_buffer=max_buffer,
                        from_now=from_now,
                    )
                )
        except zmq.ZMQError as exc:
            self._close_sockets(None)
            raise CaptureError(f"cannot connect to endpoint {e.url!r}: {exc}") from exc
        except BaseException:
            self._close_sockets(None)
            raise
        self.warn_idle_s = warn_idle_s
        self.warn_stream = warn_stream
        self._warned_idle = False
        self._start_ns = 0
        self._closed = False
        self.initial_replay = initial_replay and not from_now
        self.duration_s = duration_s
        self.until_idle_s = until_idle_s
        self.decode_stats = decode_stats
        self.status = status
        self.on_ready = on_ready
        self.stats = CaptureStats(started_ns=time.time_ns())
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # written frames awaiting the stats decode (write_event_batch tuples), bounded
        self._backlog = StatsBacklog(self._count, max_backlog_bytes)
        self._write_failed = False
        self.max_backlog_bytes = max_backlog_bytes
        self.ready = threading.Event()
        self._cpu0 = time.thread_time()
        #: called by the capture thread once the sockets are drained, before the last inbox
        #: drain and the Trailer (the log tail's last read: its records still get written)
        self.before_close: Callable[[], None] | None = None

    # -------------------------------------------------------------- public

    def attach(self, writer: Any) -> None:
        """Give a recorder built with ``writer=None`` the ``BundleWriter`` to fill."""
        self.writer = writer

    def close(self) -> None:
        """Release the sockets of a recorder that will not ``run`` (``run`` closes its own)."""
        self._close_sockets(None)

    def submit(self, record: Any) -> None:
        """Queue a record (RequestRecord, Annotation) for writing; thread-safe."""
        self._inbox.put(record)

    def run(self, stop: threading.Event) -> CaptureStats:
        """Capture until ``stop`` is set or a stop condition hits; close the writer."""
        if self.writer is None:
            self._close_sockets(None)
            raise CaptureError("Recorder.run: no bundle writer attached")
        zmq = self._zmq
        poller = zmq.Poller()
        subs = {}
        reason = "stopped"
        try:
            for src in self.sources:
                poller.register(src.sub, zmq.POLLIN)
                subs[src.sub] = src
                if self.initial_replay:
                    src.tracker.begin_initial_replay(time.time_ns())
                    src.start_replay_if_wanted(poller)
            t0 = time.monotonic()
            self._start_ns = time.time_ns()
            self._cpu0 = time.thread_time()
            self.ready.set()
            if self.on_ready is not None:
                self.on_ready()
            while True:
                if stop.is_set():
                    reason = "signal/stop requested"
                    break
                now = time.monotonic()
                if self.duration_s is not None and now - t0 >= self.duration_s:
                    reason = f"duration {self.duration_s:g} s reached"
                    break
                if self.until_idle_s is not None and self._idle_for(self.until_idle_s):
                    reason = f"idle for {self.until_idle_s:g} s"
                    break
                if self.warn_idle_s is not None and not self._warned_idle:
                    self._warn_if_no_traffic()
                # with stats left to decode, wait only briefly: a quiet millisecond means the
                # stream paused, and the decode runs then (or when its backlog is too big)
                ready = poller.poll(1 if self._backlog else _IDLE_POLL_MS)
                self._service(ready, subs, poller)
                if not self._inbox.empty():
                    self._drain_inbox()
                # what was written reaches the OS (survives a SIGKILL, a reader sees it) when
                # the stream pauses, and while busy once it is _FLUSH_AGE_S old
                self.writer.flush_pending(_FLUSH_AGE_S if ready else 0.0)
                if self._backlog and not ready:
                    self._decode_backlog(0.005)
                if self.status is not None and self.status.live:
                    self._refresh()
                    self.status.update(self.stats)
            self._shutdown_drain(subs, poller)
        except (OSError, BundleError) as exc:
            self.stats.stop_reason = f"write failed: {exc}"
            self._refresh()
            self._close_sockets(poller)
            try:
                self.writer.close(clean=False, stats=self.stats.as_dict())
            except Exception:  # noqa: BLE001 - the disk is full: the first error is the one
                pass
            raise CaptureError(
                f"cannot write the bundle ({exc}); capture stopped -- everything written "
                "before this point is intact"
            ) from exc
        except BaseException as exc:
            # anything else (a bug, a socket error, an interrupt): the bundle still gets its
            # Trailer (clean=False) and the sockets are released, then the error goes on
            self.stats.stop_reason = f"error: {type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                self._refresh()
            self._close_sockets(poller)
            with contextlib.suppress(Exception):
                self.writer.close(clean=False, stats=self.stats.as_dict())
            raise
        self.stats.stop_reason = reason
        self._refresh()
        self._close_sockets(poller)
        if self.status is not None:
            self.status.update(self.stats, force=True)
            self.status.finish()
        try:
            self.writer.close(clean=True, stats=self.stats.as_dict())
        except (OSError, BundleError) as exc:
            raise CaptureError(f"cannot finish the bundle ({exc})") from exc
        return self.stats

    # ------------------------------------------------------------ internals

    def _refresh(self) -> None:
        self.stats.cpu_s = time.thread_time() - self._cpu0
        for src in self.sources:
            self.stats.per_endpoint[src.info.id] = _tracker_dict(src)

    def _idle_for(self, seconds: float) -> bool:
        """No message for ``seconds``: since the last one, or since start-up if none came
        (never while a replay is outstanding)."""
        last = max(self.stats.last_msg_ns, self.stats.last_write_ns) or self._start_ns
        return (time.time_ns() - last) / 1e9 >= seconds and not any(
            s.tracker.session for s in self.sources
        )

    def _warn_if_no_traffic(self) -> None:
        """One stderr line when nothing arrived ``warn_idle_s`` after start-up."""
        st = self.stats
        if st.messages or st.written:
            self._warned_idle = True
            return
        assert self.warn_idle_s is not None
        if (time.time_ns() - self._start_ns) / 1e9 < self.warn_idle_s:
            return
        self._warned_idle = True
        urls = ", ".join(s.info.url for s in self.sources)
        stream = self.warn_stream or sys.stderr
        if self.status is not None and self.status.live:
            stream.write("\n")
        stream.write(
            f"kvcadence: warning: no KV-event message from {urls} in "
            f"{self.warn_idle_s:g} s -- is the endpoint right and the worker publishing?\n"
        )
        stream.flush()

    def _service(self, ready: list, subs: dict, poller: Any) -> int:
        """Drain the ready SUBs and replay DEALERs; end replays that timed out."""
        n = 0
        for sock, _ in ready:
            src = subs.get(sock)
            if src is not None:
                n += self._drain_sub(src, poller)
                continue
            for src in self.sources:
                if src.dealer is sock:
                    self._apply(src, src.drain_replay(poller))
                    src.start_replay_if_wanted(poller)
                    break
        for src in self.sources:
            if src.tracker.session is not None:
                self._apply(src, src.check_replay_timeout(poller, time.monotonic_ns()))
                src.start_replay_if_wanted(poller)
        return n

    def _drain_sub(self, src: EndpointSource, poller: Any, max_msgs: int = 5000) -> int:
        """Read up to ``max_msgs`` queued messages of one SUB (NOBLOCK) and write them.

        The hot path: per message one ``recv`` per frame (``copy=False`` frames carry the
        more-flag, which saves the per-frame RCVMORE option lookup of ``recv_multipart``),
        the frame parse, a seq compare against a local counter and one tuple appended to the
        burst; the burst is written with one ``write_event_batch`` (one file write) when it
        ends, when a message needs the ``SeqTracker`` (anything but the next seq) or a
        malformed one is annotated (so the bundle keeps receive order), or past
        ``_BURST_BYTES`` of payload. Counters are added once per burst; the same tuples feed
        the deferred stats decode.
        """
        zmq = self._zmq
        recv = src.sub.recv
        nonblock = zmq.NOBLOCK
        again = zmq.Again
        parse = wire.parse_live_message
        time_ns = time.time_ns
        eid = src.info.id
        tr = src.tracker
        queue_decode = self._backlog.items.append if self.decode_stats else None
        expect = tr.expected()
        epoch = tr.epoch
        burst: list[tuple[int, int, int, str, bytes, int, int]] = []
        put = burst.append
        n = nbytes = 0
        recv_ns = 0
        try:
            while n < max_msgs:
                try:
                    f = recv(nonblock, copy=False)
                except again:
                    break
                frames = [f.bytes]
                while f.more:
                    f = recv(nonblock, copy=False)
                    frames.append(f.bytes)
                recv_ns = time_ns()
                n += 1
                try:
                    topic, seq, payload = parse(frames)
                except WireError as exc:
                    if burst:
                        burst, nbytes = self._write_burst(tr, burst, nbytes, expect - 1)
                        put = burst.append
                    self._malformed(src, frames, recv_ns, str(exc))
                    continue
                if seq == expect:  # the common case: next seq, no replay outstanding
                    # (expect is -1 or <= MAX_SEQ: a seq above MAX_SEQ never takes this path)
                    item = (eid, seq, recv_ns, topic, payload, VIA_LIVE, epoch)
                    put(item)
                    expect += 1
                    nbytes += len(payload)
                    if queue_decode is not None:
                        queue_decode(item)
                    if nbytes >= _BURST_BYTES:
                        burst, nbytes = self._write_burst(tr, burst, nbytes, expect - 1)
                        put = burst.append
                    continue
                if burst:
                    burst, nbytes = self._write_burst(tr, burst, nbytes, expect - 1)
                    put = burst.append
                if seq > MAX_SEQ:
                    self._malformed(
                        src,
                        frames,
                        recv_ns,
                        f"seq {seq} is above {MAX_SEQ} (not a publisher seq; ff x 8 is the "
                        "replay end marker)",
                    )
                    continue
                outs = tr.on_live(seq, topic, payload, recv_ns)
                if outs:
                    self._apply(src, outs)
                if tr.replay_wanted is not None:
                    src.start_replay_if_wanted(poller)
                expect = tr.expected()
                epoch = tr.epoch
            if burst:
                burst, nbytes = self._write_burst(tr, burst, nbytes, expect - 1)
        finally:
            if burst and not self._write_failed:
                # an exception left the loop: what was received is still written (unless
                # the writer is what failed: the exception in flight is the one to report)
                with contextlib.suppress(OSError, BundleError):
                    self._write_burst(tr, burst, nbytes, expect - 1)
            if n:
                st = self.stats
                st.messages += n
                st.last_msg_ns = recv_ns
                if not st.first_msg_ns:
                    st.first_msg_ns = recv_ns
        return n

    def _write_burst(
        self, tr: Any, burst: list[tuple[Any, ...]], nbytes: int, last_seq: int
    ) -> tuple[list[tuple[Any, ...]], int]:
        """Write the fast-path frames of ``burst`` (``.. last_seq``) in one batch and account
        them; returns a fresh empty burst and byte count."""
        try:
            self.writer.write_event_batch(burst)
        except BaseException:
            self._write_failed = True
            raise
        n = len(burst)
        tr.take_in_order(last_seq, n, burst[-1][2], burst[-1][4])
        st = self.stats
        st.written += n
        st.bytes += nbytes
        st.last_write_ns = burst[-1][2]
        if self.decode_stats:
            self._account_backlog(nbytes, n)
        return [], 0

    def _account_backlog(self, nbytes: int, n: int) -> None:
        """``n`` written frames (``nbytes`` of payloads) joined the stats backlog; past its cap
        it is decoded down to half at once (what was written is handed to the OS first, so
        the pause never holds received data back)."""
        bl = self._backlog
        bl.add_bytes(nbytes, n)
        if bl.over_cap:
            cpu0 = bl.cpu_s
            try:
                self.writer.flush_pending(0.0)
                bl.relieve()  # may write Annotations (undecodable payloads)
            except BaseException:
                self._write_failed = True  # the burst is written: never again on the way out
                raise
            finally:
                self.stats.decode_cpu_s += bl.cpu_s - cpu0

    def _malformed(self, src: EndpointSource, frames: list[bytes], recv_ns: int, err: str) -> None:
        self.stats.malformed += 1
        self.writer.write(
            Annotation(
                kind="malformed_message",
                recv_ns=recv_ns,
                data={"endpoint": src.info.id, "error": err, "frames": [bytes(f) for f in frames]},
            )
        )

    def _apply(self, src: EndpointSource, outs: list[Output]) -> None:
        """Write a tracker's outputs in order: runs of ``Out`` frames as one batch each,
        ``Gap`` / ``Epoch`` records between them."""
        w = self.writer
        st = self.stats
        eid = src.info.id
        run: list[tuple[int, int, int, str, bytes, int, int]] = []
        queued = n = 0
        for o in outs:
            if isinstance(o, Out):
                item = (eid, o.seq, o.recv_ns, o.topic, o.payload, o.via, o.epoch)
                run.append(item)
                st.written += 1
                st.bytes += len(o.payload)
                st.last_write_ns = o.recv_ns
                if self.decode_stats:
                    self._backlog.items.append(item)
                    queued += len(o.payload)
                    n += 1
            else:
                assert isinstance(o, (Gap, Epoch))
                if run:
                    w.write_event_batch(run)
                    run = []
                w.write(o)
        if run:
            w.write_event_batch(run)
        if n:  # after the writes: what the decode may annotate comes after its frames
            self._account_backlog(queued, n)

    def _decode_backlog(self, budget_s: float | None) -> None:
        """Decode written payloads for the event/block counts (and to find undecodable
        ones) when the loop has time: never on the receive path, all of it at shutdown."""
        bl = self._backlog
        cpu0 = bl.cpu_s
        try:
            bl.decode(budget_s)
        finally:
            self.stats.decode_cpu_s += bl.cpu_s - cpu0

    def _count(
        self,
        endpoint: int,
        seq: int,
        recv_ns: int,
        topic: str,
        payload: bytes,
        via: int,
        epoch: int,
    ) -> None:
        try:
            batch = wire.decode_batch(payload)
        except WireError as exc:
            self.stats.undecodable += 1
            self.writer.write(
                Annotation(
                    kind="undecodable_payload",
                    recv_ns=recv_ns,
                    data={"endpoint": endpoint, "seq": seq, "error": str(exc)},
                )
            )
            return
        st = self.stats
        for ev in batch.events:
            st.events += 1
            if isinstance(ev, BlockStored):
                st.blocks_stored += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                st.blocks_removed += len(ev.block_hashes)

    def _drain_inbox(self) -> None:
        while True:
            try:
                rec = self._inbox.get_nowait()
            except queue.Empty:
                return
            self.writer.write(rec)
            if type(rec).__name__ == "RequestRecord":
                self.stats.requests += 1

    def _shutdown_drain(self, subs: dict, poller: Any) -> None:
        """Read what is already queued, let outstanding replays finish (bounded), flush."""
        for src in self.sources:
            self._drain_sub(src, poller, max_msgs=1_000_000)
        deadline = time.monotonic() + max(
            (s.replay_timeout_ns / 1e9 for s in self.sources if s.tracker.session), default=0.0
        )
        while any(s.tracker.session for s in self.sources) and time.monotonic() < deadline:
            self._service(poller.poll(50), subs, poller)
        for src in self.sources:
            src.close_dealer(poller)
            self._apply(src, src.tracker.flush())
        if self.before_close is not None:
            self.before_close()
        self._drain_inbox()
        self._decode_backlog(None)

    def _close_sockets(self, poller: Any) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for src in self.sources:
            try:
                src.close(poller)
            except Exception:  # noqa: BLE001 - closing best effort
                pass
        if self._own_ctx:
            self.ctx.term()


def _tracker_dict(src: EndpointSource) -> dict[str, int]:
    s = src.tracker.stats
    attached = {} if s.attached_at_seq is None else {"attached_at_seq": s.attached_at_seq}
    return attached | {
        "live": s.live,
        "written": s.written,
        "gaps": s.gaps,
        "missed": s.missed,
        "recovered": s.recovered,
        "unrecovered": s.unrecovered,
        "epochs": s.epochs,
        "replays": s.replays,
        "replay_timeouts": s.replay_timeouts,
        "duplicates": s.duplicates,
        "malformed_replies": src.malformed_replies,
    }
