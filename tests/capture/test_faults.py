"""Fault tests against a test publisher speaking SGLang's framing (no real worker needed):
restart (epoch), drops (replay recovery / Gap), malformed messages, disk full, SIGTERM."""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcadence.format.bundle import BundleReader, event_payload, list_segments
from kvcadence.format.schema import VIA_LIVE, VIA_REPLAY, Annotation, Epoch, Gap, Trailer
from kvcadence.testing.publisher import TestPublisher, payload_pool

POOL = payload_pool(64)


def _records(reader: BundleReader, cls: type) -> list:
    return [r for r in reader.records() if isinstance(r, cls)]


def _publish(pub: TestPublisher, n: int) -> list[int]:
    return [pub.publish(POOL[pub.seq % len(POOL)]) for _ in range(n)]


def test_publisher_restart_starts_a_new_epoch(run_capture, endpoint_info):
    with TestPublisher() as pub:
        cap = run_capture([endpoint_info(pub)])
        _publish(pub, 30)
        cap.wait_for(30)
        pub.restart()
        time.sleep(0.5)  # SUB reconnects to the rebound port
        _publish(pub, 20)
        cap.wait_for(50)
        r = cap.stop()
    frames = list(r.events())
    assert [(f.epoch, f.seq) for f in frames] == [(0, s) for s in range(30)] + [
        (1, s) for s in range(20)
    ]
    epochs = _records(r, Epoch)
    assert len(epochs) == 1 and epochs[0].epoch == 1 and epochs[0].first_seq == 0
    assert not _records(r, Gap)


def test_dropped_messages_are_recovered_by_replay(run_capture, endpoint_info):
    with TestPublisher() as pub:
        cap = run_capture([endpoint_info(pub)])
        _publish(pub, 10)
        pub.drop(25)  # consumed seqs that never reached the SUB (HWM drop), still in the ring
        _publish(pub, 10)
        cap.wait_for(45)
        r = cap.stop()
        ring = dict(pub.ring)
    frames = list(r.events())
    assert [f.seq for f in frames] == list(range(45))
    assert all(event_payload(f) == ring[f.seq] for f in frames)
    assert {f.seq for f in frames if f.via == VIA_REPLAY} == set(range(10, 35))
    (gap,) = _records(r, Gap)
    assert (gap.first_seq, gap.last_seq, gap.recovered) == (10, 34, 25)
    trailer = _records(r, Trailer)[-1]
    assert trailer.clean and trailer.stats["unrecovered"] == 0


def test_gap_without_replay_is_recorded(run_capture, endpoint_info):
    with TestPublisher(replay=False) as pub:
        cap = run_capture([endpoint_info(pub)])
        _publish(pub, 5)
        pub.drop(7)
        _publish(pub, 5)
        cap.wait_for(10)
        r = cap.stop()
    (gap,) = _records(r, Gap)
    assert (gap.first_seq, gap.last_seq, gap.recovered) == (5, 11, 0)
    assert "no replay" in gap.reason
    assert [f.seq for f in r.events()] == list(range(5)) + list(range(12, 17))


def test_gap_when_the_replay_ring_moved_on(run_capture, endpoint_info):
    with TestPublisher(buffer_steps=10) as pub:
        cap = run_capture([endpoint_info(pub)], initial_replay=False)
        _publish(pub, 3)
        pub.drop(50)  # seqs 3..52; the ring keeps only the last 10 published
        _publish(pub, 1)  # seq 53: ring = 44..53
        cap.wait_for(3 + 9 + 1)
        r = cap.stop()
    (gap,) = _records(r, Gap)
    assert (gap.first_seq, gap.last_seq, gap.recovered) == (3, 52, 9)
    assert [f.seq for f in r.events()] == [0, 1, 2, *range(44, 54)]
    assert _records(r, Trailer)[-1].stats["unrecovered"] == 41


def test_replay_that_never_ends_times_out_and_capture_goes_on(run_capture, endpoint_info):
    with TestPublisher() as pub:
        pub.replay_mode = "stall"  # SGLang PR #38945: no replies, no end marker
        cap = run_capture([endpoint_info(pub)], replay_timeout_s=0.5)
        _publish(pub, 2)
        pub.drop(3)
        _publish(pub, 4)
        cap.wait_for(6)
        r = cap.stop()
    gaps = _records(r, Gap)
    assert [(g.first_seq, g.last_seq, g.recovered) for g in gaps] == [(2, 4, 0)]
    assert [f.seq for f in r.events()] == [0, 1, 5, 6, 7, 8]
    assert _records(r, Trailer)[-1].stats["per_endpoint"]["0"]["replay_timeouts"] >= 1
    # reported as what happened: the replay timed out (the ring was never asked to the end)
    assert "replay timeout" in gaps[0].reason and "not in the replay ring" not in gaps[0].reason


def test_late_start_recovers_from_seq_zero_with_old_reply_layout(run_capture, endpoint_info):
    with TestPublisher(reply_topic=False) as pub:  # SGLang <= 0.5.20 replies: no topic frame
        _publish(pub, 40)  # before the capture exists: only the replay ring has them
        cap = run_capture([endpoint_info(pub)])
        cap.wait_for(40)
        _publish(pub, 5)
        cap.wait_for(45)
        r = cap.stop()
    frames = list(r.events())
    assert [f.seq for f in frames] == list(range(45))
    assert [f.via for f in frames] == [VIA_REPLAY] * 40 + [VIA_LIVE] * 5


def test_malformed_messages_are_counted_kept_raw_and_capture_goes_on(run_capture, endpoint_info):
    with TestPublisher() as pub:
        cap = run_capture([endpoint_info(pub)])
        _publish(pub, 3)
        pub.send_raw([b"kv-events", b"\x00" * 8])  # wrong frame count
        pub.send_raw([b"kv-events", b"\x00\x01\x02", POOL[0]])  # short seq
        junk = b"\xc1 not msgpack"
        pub.publish(junk)  # seq 3: undecodable payload (valid frames)
        _publish(pub, 3)
        cap.wait_for(7)
        r = cap.stop()
    frames = list(r.events())
    assert [f.seq for f in frames] == list(range(7))
    bad = next(f for f in frames if f.seq == 3)
    assert bad.payload_is_bin and event_payload(bad) == junk
    notes = _records(r, Annotation)
    malformed = [n for n in notes if n.kind == "malformed_message"]
    assert len(malformed) == 2
    assert malformed[0].data["frames"] == [b"kv-events", b"\x00" * 8]
    assert "3 frames" in malformed[0].data["error"]
    assert malformed[1].data["frames"][1] == b"\x00\x01\x02"
    undec = [n for n in notes if n.kind == "undecodable_payload"]
    assert [n.data["seq"] for n in undec] == [3]
    st = _records(r, Trailer)[-1].stats
    assert (st["malformed"], st["undecodable"], st["written"]) == (2, 1, 7)


def test_two_endpoints_are_tracked_separately(run_capture, endpoint_info):
    with TestPublisher() as a, TestPublisher(topic="") as b:
        cap = run_capture([endpoint_info(a, 0), endpoint_info(b, 1)])
        _publish(a, 10)
        _publish(b, 5)
        b.drop(2)
        _publish(b, 5)
        cap.wait_for(22)
        r = cap.stop()
    by = {0: [], 1: []}
    for f in r.events():
        by[f.endpoint].append(f.seq)
    assert by == {0: list(range(10)), 1: list(range(12))}
    (gap,) = _records(r, Gap)
    assert gap.endpoint == 1 and gap.recovered == 2


# ------------------------------------------------------------ subprocess captures

WRAPPER = """
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)  # a CI shell may start us with SIGINT ignored
from kvcadence.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _capture_proc(pub: TestPublisher, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", WRAPPER, "capture", "--endpoint", pub.endpoint]
    cmd += ["--replay-endpoint", pub.replay_endpoint or "none", "--out", str(out), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_ready(out: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not list_segments(out) if out.exists() else True:
        assert time.monotonic() < deadline, "capture subprocess did not start"
        time.sleep(0.05)
    time.sleep(1.0)  # imports done, SUB connected


def test_sigterm_drains_writes_trailer_and_exits_0(tmp_path):
    out = tmp_path / "b"
    with TestPublisher() as pub:
        proc = _capture_proc(pub, out, "--quiet")
        try:
            _wait_ready(out)
            _publish(pub, 200)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    r = BundleReader(out)
    assert [f.seq for f in r.events()] == list(range(200))
    trailer = _records(r, Trailer)[-1]
    assert trailer.clean and trailer.stats["stop_reason"].startswith("signal")
    assert r.report.torn_bytes == 0


def test_sigint_also_stops_cleanly_with_a_summary(tmp_path):
    out = tmp_path / "b"
    with TestPublisher() as pub:
        proc = _capture_proc(pub, out)
        try:
            _wait_ready(out)
            _publish(pub, 20)
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    assert "capture: 20 event frames" in err
    assert len(list(BundleReader(out).events())) == 20


def _unshare_ok() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux mount namespaces")
def test_disk_full_gives_one_clear_error_and_keeps_earlier_segments(tmp_path):
    """A real full filesystem: a 256 KiB tmpfs mounted in a private user+mount namespace
    (no root needed); the bundle is copied out before the namespace goes away."""
    if not _unshare_ok():
        pytest.skip("unprivileged user namespaces (unshare -rm) are not available here")
    mnt, copy = tmp_path / "mnt", tmp_path / "copy"
    mnt.mkdir()
    with TestPublisher() as pub:
        inner = [sys.executable, "-c", WRAPPER, "capture", "--endpoint", pub.endpoint]
        inner += ["--replay-endpoint", str(pub.replay_endpoint), "--out", str(mnt / "b")]
        inner += ["--quiet", "--segment-mb", "0.0625"]
        script = (
            f"mount -t tmpfs -o size=256k tmpfs {mnt} || exit 99; "
            f"{' '.join(shlex.quote(c) for c in inner)}; rc=$?; "
            f"cp -a {mnt}/b {copy}; exit $rc"
        )
        proc = subprocess.Popen(
            ["unshare", "-rm", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(3.0)  # interpreter start + SUB connect (cannot see inside the mount)
            for _ in range(200):
                _publish(pub, 50)
                time.sleep(0.02)
                if proc.poll() is not None:
                    break
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode != 99, f"tmpfs mount failed: {err}"
    assert proc.returncode == 1, err
    lines = [ln for ln in err.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("kvcadence: error:"), err
    assert "disk full" in lines[0] and "intact" in lines[0]
    segs = list_segments(copy)
    assert len(segs) >= 2
    r = BundleReader(copy)
    seqs = [f.seq for f in r.events()]
    assert len(seqs) > 100 and seqs == list(range(len(seqs)))
    assert r.report.corrupt_bytes == 0  # at most a torn tail in the last segment
    for seg in segs[:-1]:  # closed segments read back whole
        assert BundleReader(copy).scan_segment(seg).good_end == seg.stat().st_size


def _expected_counts(payloads: list[bytes]) -> tuple[int, int, int]:
    from kvcadence.format import wire
    from kvcadence.format.schema import BlockRemoved, BlockStored

    events = stored = removed = 0
    for p in payloads:
        for ev in wire.decode_batch(p).events:
            events += 1
            if isinstance(ev, BlockStored):
                stored += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                removed += len(ev.block_hashes)
    return events, stored, removed


@pytest.mark.parametrize("cap", [0, 64 << 20])
def test_deferred_stats_decode_counts_every_written_frame(run_capture, endpoint_info, cap):
    # cap 0: the decode runs while messages keep coming (backlog over its cap); the default
    # cap: it runs when the stream pauses / at shutdown. Same counts either way.
    pool = payload_pool(40, seed=3)
    with TestPublisher() as pub:
        cap_run = run_capture([endpoint_info(pub)], max_backlog_bytes=cap)
        for p in pool:
            pub.publish(p)
        cap_run.wait_for(len(pool))
        r = cap_run.stop()
    st = cap_run.rec.stats
    assert (st.events, st.blocks_stored, st.blocks_removed) == _expected_counts(pool)
    assert st.undecodable == 0 and cap_run.rec._backlog.held_bytes == 0
    trailer = [t for t in r.records() if isinstance(t, Trailer)][-1]
    assert trailer.stats["events"] == st.events
    assert 0 < trailer.stats["decode_cpu_s"] <= trailer.stats["cpu_s"]


def test_shallow_payload_checked_without_padding_reads_back_from_a_deep_stack(tmp_path):
    from kvcadence.capture.discovery import make_header
    from kvcadence.format import bundle
    from kvcadence.format.bundle import BundleWriter, frames

    n = frames._SHALLOW_BYTES
    payload = b"\x91" * (n - 1) + b"\x01"  # as deep as a payload of that length can nest
    assert len(payload) == n and bundle.is_single_msgpack(payload)
    w = BundleWriter(tmp_path / "b", make_header([], server_info=None, command=[]))
    w.write_event(endpoint=0, seq=0, recv_ns=1, topic="t", payload=payload, via=0, epoch=0)
    w.close()

    def read_deeper(k: int) -> list:
        if k:
            return read_deeper(k - 1)
        return list(BundleReader(tmp_path / "b").events())

    for depth in (0, 400):  # 400 frames deeper: msgspec's limit, then the fresh-thread retry
        (ev,) = read_deeper(depth)
        assert not ev.payload_is_bin and event_payload(ev) == payload


def _seen_on_disk(out: Path) -> int:
    """Event frames a concurrent reader finds in the bundle right now."""
    return sum(1 for _ in BundleReader(out).events())


def test_sigkill_while_idle_loses_nothing_received_200ms_before(tmp_path):
    """docs/format.md section 4: a SIGKILL loses at most the last flush interval (200 ms) of
    received data, idle or busy. 300 messages, then silence: a concurrent reader sees all
    of them within the interval, and so does the bundle after a SIGKILL."""
    out = tmp_path / "b"
    with TestPublisher() as pub:
        proc = _capture_proc(pub, out, "--quiet")
        try:
            _wait_ready(out)
            _publish(pub, 300)
            t0 = time.monotonic()
            while _seen_on_disk(out) < 300 and time.monotonic() - t0 < 5.0:
                time.sleep(0.01)
            visible_after = time.monotonic() - t0
            time.sleep(0.3)  # idle: nothing arrives that could trigger a write-time flush
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    r = BundleReader(out)
    assert [f.seq for f in r.events()] == list(range(300))
    assert not r.report.clean_shutdown  # killed: no trailer
    # generous for a loaded 2-core CI box; measured ~0.1 s quiet
    assert visible_after < 1.0, visible_after


def test_busy_capture_hands_data_to_the_os_within_the_flush_interval(run_capture, endpoint_info):
    """While messages keep coming (one every 30 ms: the loop never sees a quiet poll), each
    received message is visible to a concurrent reader ~200 ms after it was received at
    most (without the age check it waits for the write-time check of a later write)."""
    import threading

    with TestPublisher() as pub:
        cap = run_capture([endpoint_info(pub)])
        done = threading.Event()

        def publish() -> None:
            for _ in range(60):
                _publish(pub, 1)
                time.sleep(0.03)
            done.set()

        th = threading.Thread(target=publish)
        th.start()
        received: dict[int, float] = {}  # message count -> first time the recorder had it
        visible: dict[int, float] = {}  # message count -> first time a reader saw it
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = time.monotonic()
            received.setdefault(cap.rec.stats.written, now)
            n = _seen_on_disk(cap.path)
            visible.setdefault(n, now)
            if done.is_set() and n >= 60:
                break
            time.sleep(0.005)
        th.join()
        cap.stop()
    lag = [visible[n] - received[n] for n in visible if n in received and n > 0]
    assert lag, (received, visible)
    # a quiet box measures ~0.1 s; the bound leaves room for a loaded 2-core CI box
    assert max(lag) < 0.45, sorted(lag)[-5:]


def test_one_duplicated_seq_is_dropped_not_a_restart(run_capture, endpoint_info):
    """Regression: one duplicated seq used to start a false epoch and write the whole
    replay ring again (99 duplicate frames)."""
    with TestPublisher() as pub:
        cap = run_capture([endpoint_info(pub)])
        _publish(pub, 100)
        cap.wait_for(100)
        pub.send_raw([pub.topic.encode(), (99).to_bytes(8, "big"), POOL[99 % len(POOL)]])
        _publish(pub, 10)
        cap.wait_for(110)
        time.sleep(0.3)  # anything a false restart would have asked the ring for
        r = cap.stop()
    assert [(f.epoch, f.seq) for f in r.events()] == [(0, s) for s in range(110)]
    assert not _records(r, Epoch) and not _records(r, Gap)
    ep = _records(r, Trailer)[-1].stats["per_endpoint"]["0"]
    assert ep["duplicates"] == 1 and ep["epochs"] == 0
