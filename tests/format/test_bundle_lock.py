"""One writer per bundle: a second writer is refused with one line and the
running one is never disturbed; the lock is the kernel's (gone with the process)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from kvcadence.cli import main
from kvcadence.errors import UsageError
from kvcadence.format.bundle import BundleReader, BundleWriter, list_segments
from kvcadence.format.schema import FORMAT_MAJOR, VIA_LIVE, EventFrame, Header, RequestRecord

BATCH = msgspec.msgpack.encode([1.5, [{"type": "AllBlocksCleared"}], 0])


def _header() -> Header:
    return Header(format_major=FORMAT_MAJOR, format_minor=0, source="real", kvcadence_version="x")


def _event(seq: int) -> EventFrame:
    return EventFrame(0, seq, 1000 + seq, "kv", VIA_LIVE, 0, False, msgspec.Raw(BATCH), -1)


def _requests_jsonl(path: Path, n: int) -> Path:
    path.write_text(
        "".join(json.dumps({"rid": f"q{i}", "input_ids": [1, 2]}) + "\n" for i in range(n))
    )
    return path


def test_second_writer_is_refused_and_the_first_goes_on(tmp_path: Path, capsys) -> None:
    b = tmp_path / "b"
    w = BundleWriter(b, _header(), segment_bytes=1024)
    for i in range(50):
        w.write(_event(i))
    w.flush()
    segs_before = list_segments(b)
    with pytest.raises(UsageError, match="another process is writing this bundle"):
        BundleWriter.append(b)
    with pytest.raises(UsageError, match="not empty; refusing to overwrite"):
        BundleWriter(b, _header())
    # the CLI writers: one line, exit 2, nothing touched
    reqs = _requests_jsonl(tmp_path / "r.jsonl", 3)
    assert main(["import", "--append", "--requests", str(reqs), "--out", str(b)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another process is writing" in err
    assert list_segments(b) == segs_before
    for i in range(50, 100):  # the running writer never notices
        w.write(_event(i))
    w.close()
    assert [e.seq for e in BundleReader(b).events()] == list(range(100))
    # once it is done, appending works
    assert main(["import", "--append", "--requests", str(reqs), "--out", str(b)]) == 0
    r = BundleReader(b)
    assert len(r.requests()) == 3 and r.report.clean_shutdown and not r.report.damaged


def test_a_failed_open_releases_the_lock(tmp_path: Path) -> None:
    b = tmp_path / "b"
    BundleWriter(b, _header()).close()
    with pytest.raises(UsageError, match="not empty"):
        BundleWriter(b, _header())
    w = BundleWriter.append(b)  # not locked by the refused writer
    w.write(RequestRecord(rid="a", input_ids=[1]))
    w.close()
    BundleWriter.append(b).close()  # nor by a closed one


LOCK_HOLDER = """
import sys, time
from kvcadence.format.bundle import BundleWriter
from kvcadence.format.schema import FORMAT_MAJOR, Header
w = BundleWriter(sys.argv[1], Header(format_major=FORMAT_MAJOR, format_minor=0, source="real",
                 kvcadence_version="x"))
w.flush()
print("ready", flush=True)
time.sleep(60)
"""


def test_lock_held_by_another_process_and_gone_after_sigkill(tmp_path: Path) -> None:
    b = tmp_path / "b"
    with subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(b)], stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            with pytest.raises(UsageError, match="another process is writing"):
                BundleWriter.append(b)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    t0 = time.monotonic()
    w = BundleWriter.append(b)  # no stale lock to clean up
    w.close()
    assert time.monotonic() - t0 < 5
    assert BundleReader(b).header.source == "real"
