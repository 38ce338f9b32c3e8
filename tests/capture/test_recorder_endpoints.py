"""Capture endpoints and the idle clock: a bad endpoint is one line and no bundle, a socket
error closes everything, --until-idle fires with no traffic, the no-traffic warning."""

from __future__ import annotations

import io
import threading
import time
from typing import Any

import pytest

from kvcadence.capture import discovery
from kvcadence.capture.discovery import make_header
from kvcadence.capture.recorder import Recorder
from kvcadence.cli import main
from kvcadence.errors import CaptureError
from kvcadence.format.bundle import (
    BundleReader,
    BundleWriter,
)
from kvcadence.format.schema import (
    EndpointInfo,
    Trailer,
)
from kvcadence.testing.publisher import TestPublisher, payload_pool
from tests.capture.helpers import free_port, one_error_line, within

POOL = payload_pool(8)
BIG = 1 << 40


# ------------------------------------------------------------------ 3. bad endpoints


@pytest.mark.parametrize(
    "url",
    [
        "tcp://no such host:5",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:65536",
        "tcp://127.0.0.1:x",
        "tcp://:5557",
        "tcp://::1:5557",
        "udp://127.0.0.1:5557",
        "ipc://",
        "ipc:///tmp/" + "x" * 200,
        "localhost:5557",
    ],
)
def test_bad_endpoint_is_one_line_exit_2_and_no_bundle(tmp_path, capsys, url):
    out = tmp_path / "b"
    assert main(["capture", "--endpoint", url, "--out", str(out), "--duration", "0.1"]) == 2
    assert url.split("://")[-1][:20] in one_error_line(capsys.readouterr().err)
    assert not out.exists()


def test_bad_replay_endpoint_is_refused_too(tmp_path, capsys):
    argv = ["capture", "--endpoint", "tcp://127.0.0.1:5557", "--replay-endpoint", "tcp://h:0"]
    assert main([*argv, "--out", str(tmp_path / "b")]) == 2
    assert "--replay-endpoint" in one_error_line(capsys.readouterr().err)


def test_good_endpoint_forms_pass():
    for url in ("tcp://127.0.0.1:5557", "tcp://[::1]:1", "tcp://host-1.example:65535"):
        assert discovery.endpoint_problem(url) is None, url
    assert discovery.endpoint_problem("ipc:///tmp/kv.sock") is None
    assert discovery.endpoint_problem("inproc://kv") is None


def test_socket_error_leaves_no_bundle_and_closes_the_sockets(tmp_path, capsys, monkeypatch):
    import zmq

    from kvcadence.capture import recorder as recorder_mod

    made: list[Any] = []
    real = recorder_mod.EndpointSource

    def flaky(ctx: Any, info: EndpointInfo, **kw: Any) -> Any:
        if info.id == 1:
            raise zmq.ZMQError(zmq.EINVAL, "simulated connect failure")
        src = real(ctx, info, **kw)
        made.append(src)
        return src

    monkeypatch.setattr(recorder_mod, "EndpointSource", flaky)
    out = tmp_path / "b"
    argv = ["capture", "--endpoint", f"tcp://127.0.0.1:{free_port()}"]
    argv += ["--endpoint", f"tcp://127.0.0.1:{free_port()}", "--out", str(out)]
    assert main([*argv, "--duration", "0.1"]) == 1
    assert "simulated connect failure" in one_error_line(capsys.readouterr().err)
    assert not out.exists()
    assert made and all(s.sub.closed for s in made)


def test_any_exception_in_the_loop_closes_the_writer_unclean(tmp_path, monkeypatch):
    port = free_port()
    eps = [EndpointInfo(0, f"tcp://127.0.0.1:{port}", None, 0, "")]
    w = BundleWriter(tmp_path / "b", make_header(eps, server_info=None, command=[]))
    rec = Recorder(w, eps, initial_replay=False)

    def boom(*a: Any, **k: Any) -> int:
        raise RuntimeError("bug in the loop")

    monkeypatch.setattr(rec, "_service", boom)
    with pytest.raises(RuntimeError, match="bug in the loop"):
        within(lambda: rec.run(threading.Event()), 10)
    assert w.closed and all(s.sub.closed for s in rec.sources)
    r = BundleReader(tmp_path / "b")
    last = list(r.records())[-1]
    assert isinstance(last, Trailer) and not last.clean
    assert "RuntimeError" in last.stats["stop_reason"]


# ------------------------------------------------------------------ 4. idle clock


def test_until_idle_fires_when_nothing_ever_arrives(tmp_path, capsys):
    out = tmp_path / "b"
    argv = ["capture", "--endpoint", f"tcp://127.0.0.1:{free_port()}"]
    argv += ["--replay-endpoint", "none", "--out", str(out), "--until-idle", "0.5", "--quiet"]
    assert within(lambda: main(argv), 15) == 4  # NothingCaptured: the bundle is still written
    assert "capture recorded 0 KV-event messages" in capsys.readouterr().err
    last = list(BundleReader(out).records())[-1]
    assert (
        isinstance(last, Trailer) and last.clean and last.stats["stop_reason"] == "idle for 0.5 s"
    )


def test_no_traffic_warning_once_on_stderr(tmp_path):
    eps = [EndpointInfo(0, f"tcp://127.0.0.1:{free_port()}", None, 0, "")]
    w = BundleWriter(tmp_path / "b", make_header(eps, server_info=None, command=[]))
    buf = io.StringIO()
    rec = Recorder(w, eps, until_idle_s=0.8, warn_idle_s=0.2, warn_stream=buf)
    within(lambda: rec.run(threading.Event()), 15)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcadence: warning: no KV-event message")
    assert eps[0].url in lines[0]


@pytest.mark.parametrize("quiet", [False, True])
def test_cli_warns_about_no_traffic_unless_quiet(tmp_path, capsys, monkeypatch, quiet):
    from kvcadence.capture import recorder as recorder_mod

    monkeypatch.setattr(recorder_mod, "NO_TRAFFIC_WARN_S", 0.2)
    argv = ["capture", "--endpoint", f"tcp://127.0.0.1:{free_port()}", "--replay-endpoint"]
    argv += ["none", "--out", str(tmp_path / "b"), "--until-idle", "0.7"]
    assert within(lambda: main(argv + (["--quiet"] if quiet else [])), 15) == 4  # nothing came
    err = capsys.readouterr().err
    assert ("no KV-event message" in err) is not quiet  # the early warning, not with --quiet
    assert err.strip().splitlines()[-1].startswith("kvcadence: error: capture recorded 0 KV-event")


def test_warning_is_not_printed_when_traffic_flows(tmp_path, run_capture, endpoint_info):
    buf = io.StringIO()
    with TestPublisher() as pub:
        cap = run_capture([endpoint_info(pub)], warn_idle_s=0.5, warn_stream=buf)
        pub.publish(POOL[0])
        cap.wait_for(1)
        time.sleep(0.8)
        cap.stop()
    assert buf.getvalue() == ""


def test_capture_error_for_discovered_bad_endpoint():
    info = {"kv_events": {"endpoint_host": "bad host", "endpoint_port_base": 5557}}
    with pytest.raises(CaptureError, match="advertises endpoint"):
        discovery.endpoints_from_server_info(info, "http://127.0.0.1:1")
