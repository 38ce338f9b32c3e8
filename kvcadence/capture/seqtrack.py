"""Per-endpoint sequence tracking: gaps, epochs and replay recovery, as a pure state machine.

One ``SeqTracker`` per publisher endpoint (one per DP rank). It is fed what the sockets
deliver -- live messages, replay replies, "replay finished" -- and returns what must be
written, in order: ``Out`` event frames (in seq order within an epoch), ``Gap`` records and
``Epoch`` records. It never touches a socket, so the seq logic is testable on its own;
``kvcadence.capture.source`` wires it to ZMQ.

Rules (SGLang's publisher: seq starts at 0 per publisher instance, +1 per batch):

* first seq of an epoch != 0, or a jump ``seq > last + 1`` -> the missing range is asked from
  the replay endpoint (``replay_wanted``); live messages are buffered until the replay ends
  (end marker, timeout, or buffer full); recovered frames are written in seq order, then the
  buffered live ones. Each missing range becomes one ``Gap`` with its ``recovered`` count.
* without a replay endpoint, or for seqs a finished replay did not return (ring moved on,
  replay dropped), the ``Gap`` says how many were recovered (possibly 0).
* A publisher restart is seq going back to a small number after a pause: ``seq <= last``
  (the last message itself sent again, same payload, is a duplicate however late it comes),
  ``seq < ring_size`` (a restarted publisher counts from 0 again, and its replay ring can
  bring back what was missed of it) and at least ``restart_gap_ns`` (default 100 ms, ZMQ's
  reconnect interval: a restarted publisher cannot be heard sooner) since the previous live
  message -> a new ``Epoch``; never a gap. Any other ``seq <= last`` (a duplicated message, a
  swapped pair, a stale seq) is dropped and counted (``stats.duplicates``): it never starts an
  epoch, so one stray seq cannot make the replay ring be written again.
* ``begin_initial_replay()`` asks for everything from seq 0 before any live message, so a late
  subscriber recovers the publisher's history even when no new traffic arrives.
* ``from_now``: attaching to a worker that already serves traffic (a production capture that
  records requests from now on): the first live message starts the recording
  (``stats.attached_at_seq``), its lower seqs are neither a gap nor recovered. Later gaps and
  restarts are handled as always.
* Large jumps cost nothing: a missing range is handled as bounds ``[lo, hi)`` plus the frames
  actually buffered from replay (work is O(frames received), never O(seqs missed)). A forward
  jump of any size below ``MAX_SEQ`` is an ordinary gap (one ``Gap`` with the exact bounds;
  replay is still asked, and can bring back at most the publisher's ring, ``ring_size``
  batches, SGLang's ``buffer_steps``; a longer jump says so in the ``Gap`` reason).
* A seq above ``MAX_SEQ`` (2**63 - 1) is not a publisher's seq (SGLang counts up from 0 in
  an int64; ``ff`` x 8 is the replay end marker): ``valid_seq`` is False, the recorder keeps
  such a message as a ``malformed_message`` annotation without feeding it here, and the
  tracker itself ignores it (``stats.rejected``) so it can never move ``last``. A replay reply
  with such a seq is ignored the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvcadence.format.schema import VIA_LIVE, VIA_REPLAY, Epoch, Gap


class Out(NamedTuple):
    """One event frame to write."""

    seq: int
    recv_ns: int
    topic: str
    payload: bytes
    via: int
    epoch: int


class Live(NamedTuple):
    seq: int
    topic: str
    payload: bytes
    recv_ns: int


Output = Out | Gap | Epoch

#: highest seq a publisher can send (SGLang's counter is a Python int sent as u64, but it
#: starts at 0 and bundles store seqs as int64); anything above is a malformed message.
MAX_SEQ = (1 << 63) - 1
#: SGLang's default replay ring (``buffer_steps``), in batches.
DEFAULT_RING_SIZE = 10_000
#: the least pause before a seq that went back is taken for a restarted publisher (ZMQ's
#: default reconnect interval: a SUB cannot hear a new publisher sooner)
DEFAULT_RESTART_GAP_NS = 100_000_000


def valid_seq(seq: int) -> bool:
    """True if ``seq`` can be a publisher's seq (0 <= seq <= ``MAX_SEQ``)."""
    return 0 <= seq <= MAX_SEQ


@dataclass
class ReplaySession:
    """One outstanding replay request: ``[from_seq, until)`` (``until`` None = everything)."""

    from_seq: int
    until: int | None
    reason: str
    started_ns: int
    buffer: list[Live] = field(default_factory=list)
    got: dict[int, tuple[str, bytes, int]] = field(default_factory=dict)
    ended: bool = False


@dataclass
class TrackerStats:
    live: int = 0
    written: int = 0
    recovered: int = 0
    replay_replies: int = 0
    gaps: int = 0
    missed: int = 0
    unrecovered: int = 0
    epochs: int = 0
    replays: int = 0
    replay_timeouts: int = 0
    rejected: int = 0  # live messages / replay replies with a seq above MAX_SEQ (ignored)
    duplicates: int = 0  # live messages with seq <= last that are not a restart (dropped)
    attached_at_seq: int | None = None  # from_now: the seq the recording started at


class SeqTracker:
    """Seq bookkeeping for one endpoint (see the module docstring)."""

    def __init__(
        self,
        endpoint: int,
        *,
        has_replay: bool,
        max_buffer: int = 1_000_000,
        ring_size: int = DEFAULT_RING_SIZE,
        restart_gap_ns: int = DEFAULT_RESTART_GAP_NS,
        from_now: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.from_now = from_now
        self.has_replay = has_replay
        self.max_buffer = max_buffer
        self.ring_size = ring_size
        self.restart_gap_ns = restart_gap_ns
        self._last_ns: int | None = None  # recv_ns of the last live message written
        self.epoch = 0
        self.last: int | None = None
        self._last_payload: bytes | None = None  # the last written live message's payload
        self.session: ReplaySession | None = None
        self.replay_wanted: int | None = None  # from_seq the caller must request, then clear
        self._fill: dict[int, tuple[str, bytes, int]] = {}
        self._attempted: tuple[int, int] | None = None  # [lo, hi) a finished replay covered
        self._attempt_end = "end marker"  # why that replay ended (finish_replay's ``why``)
        self.stats = TrackerStats()

    # ---------------------------------------------------------------- inputs

    def begin_initial_replay(self, now_ns: int) -> None:
        """Ask for the publisher's whole ring (from seq 0) before any live message."""
        if self.has_replay and self.session is None and self.last is None:
            self._start(0, None, "initial sync", now_ns)

    def on_live(self, seq: int, topic: str, payload: bytes, recv_ns: int) -> list[Output]:
        if not valid_seq(seq):  # the caller should have annotated it as malformed
            self.stats.rejected += 1
            return []
        self.stats.live += 1
        msg = Live(seq, topic, payload, recv_ns)
        if self.session is not None:
            self.session.buffer.append(msg)
            return []
        out: list[Output] = []
        self._process(msg, out)
        return out

    def expected(self) -> int:
        """The seq the caller may write itself (fast path: no replay outstanding, the next
        after ``last``); -1 when every live message must go through ``on_live``."""
        if self.session is None and self.last is not None and self.last < MAX_SEQ:
            return self.last + 1
        return -1

    def take_in_order(
        self,
        last_seq: int,
        n: int = 1,
        last_recv_ns: int | None = None,
        last_payload: bytes | None = None,
    ) -> None:
        """Fast path: the caller wrote the ``n`` live messages ``expected() .. last_seq`` itself
        (no replay outstanding, the last received at ``last_recv_ns`` with ``last_payload``);
        the same bookkeeping as ``on_live`` for them."""
        s = self.stats
        s.live += n
        s.written += n
        self.last = last_seq
        self._last_payload = last_payload
        if last_recv_ns is not None:
            self._last_ns = last_recv_ns

    def on_replay(self, seq: int, topic: str | None, payload: bytes, recv_ns: int) -> None:
        """A replay reply (not the end marker)."""
        s = self.session
        self.stats.replay_replies += 1
        if not valid_seq(seq):
            self.stats.rejected += 1
            return
        if s is None or seq < s.from_seq:
            return
        s.got[seq] = (topic if topic is not None else "", payload, recv_ns)

    def buffer_full(self) -> bool:
        """The live messages held back plus the replies kept reach ``max_buffer``."""
        s = self.session
        return s is not None and len(s.buffer) + len(s.got) >= self.max_buffer

    def finish_replay(self, why: str = "end marker") -> list[Output]:
        """The replay ended (end marker / timeout / buffer full): write what it brought."""
        s = self.session
        if s is None:
            return []
        self.session = None
        if why != "end marker":
            self.stats.replay_timeouts += 1
        hi = s.until if s.until is not None else 0
        if s.got:
            hi = max(hi, max(s.got) + 1)
        if s.until is None and s.buffer:
            hi = max(hi, s.buffer[0].seq)
        self._attempted = (s.from_seq, hi)
        self._attempt_end = why  # how it ended: a Gap after a timeout must not blame the ring
        self._fill = s.got
        out: list[Output] = []
        if s.until is None and not s.buffer and s.got:
            # initial sync with no live traffic yet: everything the ring had
            top = max(s.got)
            self._fill_range(0, top + 1, "late start (" + why + ")", out)
            self.last = top
        self._drain(s.buffer, out)
        return out

    def flush(self) -> list[Output]:
        """At shutdown: end an outstanding replay with what it has."""
        return self.finish_replay("shutdown") if self.session is not None else []

    # ---------------------------------------------------------------- internals

    def _drain(self, msgs: list[Live], out: list[Output]) -> None:
        for i, m in enumerate(msgs):
            self._process(m, out)
            if self.session is not None:  # a new gap started another replay
                self.session.buffer.extend(msgs[i + 1 :])
                return
        if self.last is not None:
            self._fill = {k: v for k, v in self._fill.items() if k > self.last}

    def _start(self, from_seq: int, until: int | None, reason: str, now_ns: int) -> None:
        self.session = ReplaySession(from_seq, until, reason, now_ns)
        self.replay_wanted = from_seq
        self.stats.replays += 1

    def _emit(self, m: Live, out: list[Output]) -> None:
        out.append(Out(m.seq, m.recv_ns, m.topic, m.payload, VIA_LIVE, self.epoch))
        self.stats.written += 1
        self.last = m.seq
        self._last_ns = m.recv_ns
        self._last_payload = m.payload

    def _is_restart(self, m: Live) -> bool:
        """``m.seq <= last``: a restarted publisher (seq back to a small number after a
        pause), or else a duplicate / swapped / stale seq (see the module docstring)."""
        if m.seq >= self.ring_size:
            return False
        if m.seq == self.last and m.payload == self._last_payload:
            return False  # the last message again, however late: a duplicate
        return self._last_ns is None or m.recv_ns - self._last_ns >= self.restart_gap_ns

    def _process(self, m: Live, out: list[Output]) -> None:
        seq = m.seq
        last = self.last
        if last is not None and seq == last + 1:
            self._emit(m, out)
            return
        if last is not None and seq <= last:
            if not self._is_restart(m):
                self.stats.duplicates += 1  # dropped: never a new epoch
                return
            self.epoch += 1
            self.stats.epochs += 1
            out.append(
                Epoch(
                    endpoint=self.endpoint,
                    epoch=self.epoch,
                    first_seq=seq,
                    recv_ns=m.recv_ns,
                    reason=f"seq went back from {last} to {seq} (publisher restarted)",
                )
            )
            self.last = last = None
            self._fill = {}
            self._attempted = None
        if last is None:
            if seq == 0:
                self._emit(m, out)
                return
            if self.from_now and self.epoch == 0:
                # attached to a worker already serving: the recording starts here (what it
                # published before has no request records in this capture), not a gap
                self.stats.attached_at_seq = seq
                self._emit(m, out)
                return
            self._missing(0, seq, m, "late start" if self.epoch == 0 else "restart", out)
            return
        self._missing(last + 1, seq, m, "seq gap", out)

    def _have_all(self, lo: int, hi: int) -> bool:
        """Every seq of ``[lo, hi)`` is buffered in ``_fill``: O(min(hi - lo, buffer))."""
        n = hi - lo
        fill = self._fill
        if n > len(fill):
            return False  # cannot hold them all: no walk over the (maybe huge) range
        return all(s in fill for s in range(lo, hi))

    def _missing(self, lo: int, hi: int, m: Live, reason: str, out: list[Output]) -> None:
        if self._have_all(lo, hi):
            self._fill_range(lo, hi, reason, out)
            self._emit(m, out)
            return
        if hi - lo > self.ring_size:
            reason = (
                f"{reason}; {hi - lo} seqs missing, more than the replay ring holds "
                f"({self.ring_size})"
            )
        att = self._attempted
        tried = att is not None and att[0] <= lo and hi <= att[1]
        if self.has_replay and not tried:
            self._start(lo, hi, reason, m.recv_ns)
            self.session.buffer.append(m)  # type: ignore[union-attr]
            return
        if tried and self._attempt_end != "end marker":
            why = f"not recovered: the replay ended early ({self._attempt_end})"
        elif not self.has_replay:
            why = "no replay endpoint"
        else:
            why = "not in the replay ring"
        self._fill_range(lo, hi, f"{reason}; {why}", out)
        self._emit(m, out)

    def _fill_range(self, lo: int, hi: int, reason: str, out: list[Output]) -> None:
        """Write the recovered frames of [lo, hi) in seq order, preceded by their Gap."""
        fill = self._fill
        if hi - lo <= len(fill):  # walk the shorter of the range and the buffer
            got = [s for s in range(lo, hi) if s in fill]
        else:
            got = sorted(k for k in fill if lo <= k < hi)
        n = hi - lo
        self.stats.gaps += 1
        self.stats.missed += n
        self.stats.recovered += len(got)
        self.stats.unrecovered += n - len(got)
        first_ns = self._fill[got[0]][2] if got else 0
        out.append(
            Gap(
                endpoint=self.endpoint,
                epoch=self.epoch,
                first_seq=lo,
                last_seq=hi - 1,
                recovered=len(got),
                reason=reason,
                recv_ns=first_ns,
            )
        )
        for s in got:
            topic, payload, recv_ns = self._fill.pop(s)
            out.append(Out(s, recv_ns, topic, payload, VIA_REPLAY, self.epoch))
            self.stats.written += 1
            self.last = s
