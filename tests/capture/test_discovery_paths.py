"""No machine paths in bundle headers: capture and drive scrub /server_info and command
lines; ``redact_paths`` replaces whole path components only."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvcadence.capture import discovery
from kvcadence.cli import main
from kvcadence.format.bundle import (
    BundleReader,
    list_segments,
)
from kvcadence.format.schema import (
    Annotation,
)
from kvcadence.testing.publisher import TestPublisher, payload_pool

POOL = payload_pool(8)
BIG = 1 << 40


# ------------------------------------------------------------------ 7. machine paths


def leaks(data: bytes, *extra: Path) -> list[str]:
    """Machine paths found in ``data`` (raw bytes of a segment)."""
    needles = [str(Path.home()), os.path.realpath(tempfile.gettempdir()) + "/"]
    needles += [tempfile.gettempdir() + "/", *(str(p) for p in extra)]
    return [n for n in needles if n.encode() in data]


def server_info_with_paths(pub: TestPublisher | None, workdir: Path) -> dict:
    home = Path.home()
    info: dict[str, Any] = {
        "version": "0.5.23",
        "page_size": 1,
        "model_path": str(home / ".cache" / "kvcadence" / "tinyllama-1024v-128h-2l"),
        "tokenizer_path": str(home / ".cache" / "kvcadence" / "tinyllama-1024v-128h-2l"),
        "export_metrics_to_file_dir": str(workdir / "sglang-metrics"),
        "launch_command": f"{home}/.cache/kvcadence/venv/bin/python -m sglang.launch_server "
        f"--export-metrics-to-file-dir={workdir}/sglang-metrics",
        "log_dir": str(workdir / "logs"),
        "internal_states": [{"max_total_num_tokens": 600, "tmp": tempfile.gettempdir()}],
    }
    if pub is not None:
        info["kv_events"] = {
            "publisher": "zmq",
            "endpoint_host": "127.0.0.1",
            "endpoint_port_base": pub.port,
            "topic": pub.topic,
            "dp_size": 1,
            "replay_endpoint_port_base": pub.replay_port,
        }
    return info


@pytest.fixture
def http_server():
    state: dict[str, Any] = {"info": {}}

    class Handler(BaseHTTPRequestHandler):
        def _send(self, obj: Any, code: int = 200) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/server_info":
                self._send(state["info"])
            else:
                self.send_error(404)

        def do_POST(self) -> None:  # noqa: N802
            n = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(n))
            k = body["sampling_params"]["max_new_tokens"]
            ids = body["input_ids"]
            meta = {"prompt_tokens": len(ids), "cached_tokens": 0, "completion_tokens": k}
            self._send({"output_ids": [5] * k, "meta_info": meta})

        def log_message(self, *a: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield state, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def run_as_process(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> int:
    """``main(argv)`` with ``sys.argv`` as a real process would have it: the script path
    first (a machine path that must not reach the header), then ``argv``."""
    import sys

    script = str(Path(tempfile.gettempdir()) / "venv" / "bin" / "kvcadence")
    monkeypatch.setattr(sys, "argv", [script, *argv])
    return main(argv)


def test_capture_header_has_no_machine_paths(tmp_path, http_server, monkeypatch):
    state, url = http_server
    work = tmp_path / "harness-work"
    out = tmp_path / "b"
    with TestPublisher() as pub:
        state["info"] = server_info_with_paths(pub, work)
        pub.publish(POOL[0])
        argv = ["capture", "--server", url, "--out", str(out), "--duration", "1", "--quiet"]
        assert run_as_process(monkeypatch, argv) == 0
    r = BundleReader(out)
    h = r.header
    assert h.command[0] == "kvcadence" and h.command[1] == "capture"
    assert leaks(list_segments(out)[0].read_bytes(), tmp_path, work) == []
    si = h.server_info
    assert si["model_path"] == "~/.cache/kvcadence/tinyllama-1024v-128h-2l"
    assert si["export_metrics_to_file_dir"] == "<harness-workdir>/sglang-metrics"
    assert si["log_dir"] == "<harness-workdir>/logs"
    assert "--export-metrics-to-file-dir=<harness-workdir>/sglang-metrics" in si["launch_command"]
    assert si["internal_states"][0]["tmp"] == "<tmp>"
    assert si["kvcadence_snapshot"]["max_total_num_tokens"] == 600
    assert [f.seq for f in r.events()] == [0]  # the real endpoint was still used


def _drive_three(tmp_path, url, monkeypatch):
    """``drive --no-capture`` of a 3-request Mooncake trace against ``url``; the bundle."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": i * 10, "input_length": 20, "output_length": 2,
                        "hash_ids": [i, i + 1]}) + "\n"
            for i in range(3)
        )
    )  # fmt: skip
    out = tmp_path / "b"
    argv = ["drive", "--server", url, "--workload", f"mooncake:path={trace}", "--out", str(out)]
    assert run_as_process(monkeypatch, [*argv, "--no-capture", "--quiet"]) == 0
    return out


def test_drive_header_has_no_machine_paths(tmp_path, http_server, monkeypatch):
    state, url = http_server
    work = tmp_path / "w"
    state["info"] = server_info_with_paths(None, work)
    out = _drive_three(tmp_path, url, monkeypatch)
    r = BundleReader(out)
    data = b"".join(p.read_bytes() for p in list_segments(out))
    assert leaks(data, tmp_path, work) == []
    assert r.header.command[:2] == ["kvcadence", "drive"]
    assert any("<tmp>" in a for a in r.header.command)  # --out and the spec, scrubbed
    assert r.header.server_info["model_path"].startswith("~/")
    note = next(x for x in r.records() if isinstance(x, Annotation) and x.kind == "workload")
    assert str(note.data["path"]).startswith("<tmp>/")
    assert len(r.requests()) == 3


def test_drive_records_the_box_load_at_the_start_and_the_end(tmp_path, http_server, monkeypatch):
    """``drive`` keeps the box's CPUs and load average with the capture (a ``host`` note
    before the first request and one after the last finish): a loaded box is what a CPU
    worker's capture cannot be replayed past (docs/drive.md, "A quiet box")."""
    state, url = http_server
    state["info"] = server_info_with_paths(None, tmp_path / "w")
    out = _drive_three(tmp_path, url, monkeypatch)
    records = list(BundleReader(out).records())
    notes = [x for x in records if isinstance(x, Annotation) and x.kind == "host"]
    assert [n.data["at"] for n in notes] == ["start", "end"]
    cpus = len(os.sched_getaffinity(0))
    for n in notes:
        assert n.data["cpus"] == cpus
        assert len(n.data["load_avg"]) == 3 and all(v >= 0 for v in n.data["load_avg"])
    # the start note comes before every request record, the end note after them
    kinds = ["host" if x in notes else type(x).__name__ for x in records]
    reqs = [i for i, k in enumerate(kinds) if k == "RequestRecord"]
    assert kinds.index("host") < reqs[0] and len(kinds) - 1 - kinds[::-1].index("host") > reqs[-1]


def test_redact_paths_only_replaces_whole_components():
    home = str(Path.home())
    got = discovery.redact_paths(
        {"k": [f"{home}/x", f"{home}x", f"/data{home}", f"a={home}", 7, None]}, ["/w/run"]
    )
    assert got == {"k": ["~/x", f"{home}x", f"/data{home}", "a=~", 7, None]}
    assert discovery.redact_paths("/w/run/m /w/running", ["/w/run"]) == (
        "<harness-workdir>/m /w/running"
    )


def test_redact_scrubs_more_paths_from_the_capture_header(tmp_path, http_server, monkeypatch):
    """``--redact PATH``: a directory the user names (a model kept outside home and temp,
    say) is scrubbed from the header as ``<redacted>``, in ``/server_info`` and in the
    recorded command line; the worker recorded by ``harness start`` on the same port has its
    ``--tokenizer`` directory scrubbed as ``<harness-tokenizer>`` without being asked."""
    from kvcadence.harness import worker as harness

    state, url = http_server
    models = "/srv/models/acme-70b"
    tok = "/srv/tokenizers/acme-words"
    sp = tmp_path / "harness-server.json"
    port = int(url.rsplit(":", 1)[1])
    sp.write_text(json.dumps({"port": port, "workdir": str(tmp_path / "w"), "tokenizer": tok}))
    monkeypatch.setattr(harness, "state_path", lambda: sp)
    out = tmp_path / "b"
    with TestPublisher() as pub:
        info = server_info_with_paths(pub, tmp_path / "w")
        info["model_path"] = f"{models}/snapshot"
        info["tokenizer_path"] = tok
        info["launch_command"] = f"python -m sglang.launch_server --model-path {models}/snapshot"
        state["info"] = info
        pub.publish(POOL[0])
        argv = ["capture", "--server", url, "--out", str(out), "--duration", "1", "--quiet"]
        assert run_as_process(monkeypatch, [*argv, "--redact", models]) == 0
    h = BundleReader(out).header
    si = h.server_info
    assert si["model_path"] == "<redacted>/snapshot"
    assert si["tokenizer_path"] == "<harness-tokenizer>"
    assert si["launch_command"].endswith("--model-path <redacted>/snapshot")
    assert h.command[-2:] == ["--redact", "<redacted>"]
    data = b"".join(p.read_bytes() for p in list_segments(out))
    assert models.encode() not in data and tok.encode() not in data
    # another port's worker: its tokenizer is not this capture's to scrub
    sp.write_text(json.dumps({"port": port + 1, "tokenizer": tok}))
    assert discovery.header_redactions(None, url) == {}


def test_redact_refuses_the_root_and_empty_paths(tmp_path, capsys):
    """A ``--redact`` that would scrub every absolute path is refused: exit 2, one line,
    nothing created."""
    for bad in ("/", "", "/.."):
        out = tmp_path / "b"
        rc = main(["capture", "import", "--sglang-metrics", str(tmp_path), str(out),
                   "--redact", bad])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "--redact" in err[0], err
        assert not out.exists()


def test_import_redacts_the_server_info_it_is_given(tmp_path, fixture_dir, monkeypatch):
    """``kvcadence import --redact PATH`` scrubs the ``--server-info`` JSON it stores."""
    si = json.loads((fixture_dir / "server_info.json").read_text())
    si["model_path"] = "/srv/models/acme-70b"
    (tmp_path / "si.json").write_text(json.dumps(si))
    out = tmp_path / "b"
    argv = ["import", "--frames", str(fixture_dir / "events.jsonl"), "--server-info"]
    argv += [str(tmp_path / "si.json"), "--out", str(out), "--redact", "/srv/models"]
    assert run_as_process(monkeypatch, argv) == 0
    h = BundleReader(out).header
    assert h.server_info["model_path"] == "<redacted>/acme-70b"
    assert h.command[-2:] == ["--redact", "<redacted>"]
