"""``kvcadence capture`` end to end in-process: /server_info discovery (fake HTTP server +
test publisher), header snapshot, --until-idle / --duration, status line, usage errors."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvcadence.capture.discovery import endpoints_from_server_info, explicit_endpoints
from kvcadence.capture.recorder import CaptureStats, StatusLine
from kvcadence.cli import main
from kvcadence.errors import CaptureError, UsageError
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import Trailer
from kvcadence.testing.publisher import TestPublisher, payload_pool

POOL = payload_pool(16)


def server_info_for(pub: TestPublisher) -> dict:
    return {
        "version": "0.5.23",
        "page_size": 1,
        "chunked_prefill_size": 4096,
        "max_prefill_tokens": 16384,
        "decode_log_interval": 40,
        "schedule_policy": "fcfs",
        "max_running_requests": None,
        "dp_size": 1,
        "tp_size": 1,
        "kv_events_config": '{"publisher":"zmq"}',
        "internal_states": [{"max_total_num_tokens": 600}],
        "kv_events": {
            "publisher": "zmq",
            "endpoint_host": "*",
            "endpoint_port_base": pub.port,
            "topic": pub.topic,
            "block_size": 1,
            "dp_size": 1,
            "replay_endpoint_port_base": pub.replay_port,
        },
    }


@pytest.fixture
def fake_server():
    state: dict = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path != "/server_info":
                self.send_error(404)
                return
            body = json.dumps(state["info"]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield state, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_capture_with_discovery_records_history_and_snapshot(tmp_path, fake_server):
    state, url = fake_server
    with TestPublisher() as pub:
        state["info"] = server_info_for(pub)
        for i in range(25):  # published before the capture: recovered from seq 0 by replay
            pub.publish(POOL[i % 16])
        out = tmp_path / "b"
        rc = main(["capture", "--server", url, "--out", str(out), "--until-idle", "1", "--quiet"])
    assert rc == 0
    r = BundleReader(out)
    assert [f.seq for f in r.events()] == list(range(25))
    h = r.header
    assert h.sglang_version == "0.5.23" and h.source == "real"
    assert h.server_info["kvcadence_snapshot"]["max_total_num_tokens"] == 600
    assert h.server_info["kvcadence_snapshot"]["page_size"] == 1
    assert h.kv_events_config == '{"publisher":"zmq"}'
    assert [e.url for e in h.endpoints] == [pub.endpoint]  # wildcard host -> server host
    assert h.endpoints[0].replay_url == pub.replay_endpoint
    trailer = [x for x in r.records() if isinstance(x, Trailer)][-1]
    assert trailer.stats["stop_reason"] == "idle for 1 s"


def test_duration_stops_and_summary_is_printed(tmp_path, capsys):
    with TestPublisher() as pub:
        out = tmp_path / "b"
        args = ["capture", "--endpoint", pub.endpoint, "--replay-endpoint", "none"]
        pub.publish(POOL[0])  # before the SUB connects and no replay: never received
        assert main([*args, "--out", str(out), "--duration", "0.5"]) == 4
    err = capsys.readouterr().err
    assert "capture: 0 event frames" in err and "duration 0.5 s reached" in err
    # zero messages is an error with its own exit code, said on stderr even with --quiet
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"kvcadence: error: capture recorded 0 KV-event messages from {pub.endpoint}")
    )
    assert BundleReader(out).header is not None  # the (empty) bundle is still written
    with TestPublisher() as pub:
        out = tmp_path / "q"
        args = ["capture", "--endpoint", pub.endpoint, "--replay-endpoint", "none", "--quiet"]
        assert main([*args, "--out", str(out), "--until-idle", "0.3"]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "recorded 0 KV-event messages" in err[0], err


def test_dp_ranks_get_one_endpoint_each():
    info = {
        "kv_events": {
            "endpoint_host": "0.0.0.0",
            "endpoint_port_base": 7000,
            "dp_size": 3,
            "topic": "kv",
            "replay_endpoint_port_base": 8000,
        }
    }
    eps = endpoints_from_server_info(info, "http://10.1.2.3:30000")
    assert [(e.id, e.url, e.replay_url, e.topic) for e in eps] == [
        (r, f"tcp://10.1.2.3:{7000 + r}", f"tcp://10.1.2.3:{8000 + r}", "kv") for r in range(3)
    ]
    with pytest.raises(CaptureError, match="no kv_events"):
        endpoints_from_server_info({}, "http://x")
    with pytest.raises(UsageError, match="twice"):
        explicit_endpoints(["tcp://a:1", "tcp://a:1"], None)


def test_usage_errors_exit_2_with_one_line(tmp_path, capsys):
    assert main(["capture", "--endpoint", "tcp://127.0.0.1:1"]) == 2
    assert main(["capture", "--out", str(tmp_path / "x")]) == 2
    assert main(["capture", "--endpoint", "localhost:5557", "--out", str(tmp_path / "y")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(ln.startswith("kvcadence: error:") for ln in lines)
    assert main(["capture", "--server", "http://127.0.0.1:1", "--out", str(tmp_path / "z")]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_status_line_on_a_tty_only():
    st = CaptureStats(messages=10, events=20, blocks_stored=5)
    buf = io.StringIO()
    line = StatusLine(buf, live=True)
    line.update(st, force=True)
    line.finish()
    assert buf.getvalue().startswith("\rcapture:") and "msgs 10" in buf.getvalue()
    quiet = io.StringIO()
    StatusLine(quiet).update(st, force=True)  # StringIO is not a TTY
    assert quiet.getvalue() == ""


def test_capture_discovers_every_dp_rank(tmp_path, fake_server):
    """/server_info with ``dp_size`` 2: one endpoint per rank on ``base + r`` (replay on
    ``replay_base + r``, the ranges ``harness.ports.reserve_ports`` keeps free), each recorded from
    its own seq 0 through the initial replay, byte-exact."""
    from kvcadence.format.bundle import event_payload
    from kvcadence.harness.ports import reserve_ports

    state, url = fake_server
    _, ev, rp = reserve_ports(2)
    with (
        TestPublisher(port=ev, replay_port=rp) as p0,
        TestPublisher(port=ev + 1, replay_port=rp + 1) as p1,
    ):
        info = server_info_for(p0)
        info["dp_size"] = info["kv_events"]["dp_size"] = 2
        state["info"] = info
        for i in range(7):
            p0.publish(POOL[i])
        for i in range(4):
            p1.publish(POOL[8 + i])
        out = tmp_path / "b"
        rc = main(["capture", "--server", url, "--out", str(out), "--until-idle", "3", "--quiet"])
    assert rc == 0
    r = BundleReader(out)
    assert [(e.id, e.url, e.replay_url, e.dp_rank) for e in r.header.endpoints] == [
        (0, p0.endpoint, p0.replay_endpoint, 0),
        (1, p1.endpoint, p1.replay_endpoint, 1),
    ]
    got: dict[int, list[tuple[int, bytes]]] = {0: [], 1: []}
    for f in r.events():
        got[f.endpoint].append((f.seq, event_payload(f)))
    assert got == {0: [(i, POOL[i]) for i in range(7)], 1: [(i, POOL[8 + i]) for i in range(4)]}


def test_malformed_messages_keep_their_place_between_burst_writes(
    tmp_path, run_capture, endpoint_info
):
    """A malformed message inside a drain burst is annotated where it arrived: the frames
    before it are written first (the burst is cut), the ones after it follow."""
    from kvcadence.format.schema import Annotation, EventFrame
    from kvcadence.testing.publisher import TestPublisher as Pub

    with Pub() as pub:
        cap = run_capture([endpoint_info(pub)], initial_replay=False, decode_stats=False, name="m")
        for i in range(5):
            pub.publish(POOL[i])
        pub.send_raw([b"kv-events", b"\x00\x01"])  # short seq frame: malformed
        for i in range(5, 10):
            pub.publish(POOL[i])
        cap.wait_for(10)
        r = cap.stop()
    kinds = [
        ("e", x.seq) if isinstance(x, EventFrame) else ("n", x.kind)
        for x in r.records()
        if isinstance(x, (EventFrame, Annotation))
    ]
    assert kinds == [("e", i) for i in range(5)] + [("n", "malformed_message")] + [
        ("e", i) for i in range(5, 10)
    ]
