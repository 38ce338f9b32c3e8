"""``capture import`` into a bundle with KV events keeps the records of the capture's own
stretch of the worker's life (``capture.window``): the real fixture's frames cut in half, its
metrics directory whole (as a metrics directory holds every hour the worker served)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgspec
import pytest

from kvcadence.capture.sglang_logs import read_metrics
from kvcadence.capture.window import SLACK_NS, RecordWindow, event_window
from kvcadence.cli import main
from kvcadence.format.bundle import BundleReader
from kvcadence.format.bundle.segments import list_segments


def _frames(fixture_dir: Path, tmp_path: Path, part: str) -> tuple[Path, list[int]]:
    """The fixture's frames, the first or the second half, as a JSONL file; and their
    payloads' publish times (ns), read here with no kvcadence code."""
    lines = (fixture_dir / "events.jsonl").read_text().splitlines()
    half = lines[: len(lines) // 2] if part == "first" else lines[len(lines) // 2 :]
    out = tmp_path / f"{part}.jsonl"
    out.write_text("\n".join(half) + "\n")
    ts = [
        round(msgspec.msgpack.decode(base64.b64decode(json.loads(ln)["payload_b64"]))[0] * 1e9)
        for ln in half
    ]
    return out, ts


def _bundle(fixture_dir: Path, tmp_path: Path, part: str) -> tuple[Path, list[int]]:
    frames, ts = _frames(fixture_dir, tmp_path, part)
    b = tmp_path / f"{part}.kvcb"
    info = str(fixture_dir / "server_info.json")
    argv = ["import", "--frames", str(frames), "--server-info", info, "--out", str(b)]
    assert main(argv) == 0
    return b, ts


def test_event_window_is_the_first_and_last_publish(fixture_dir, tmp_path):
    b, ts = _bundle(fixture_dir, tmp_path, "first")
    assert event_window(b) == (min(ts), max(ts))
    empty = tmp_path / "empty"
    assert (
        main(
            [
                "capture",
                "import",
                "--quiet",
                "--sglang-metrics",
                str(fixture_dir / "sglang-metrics"),
                str(empty),
            ]
        )
        == 0
    )
    assert event_window(empty) is None  # requests only


@pytest.mark.parametrize("part", ["first", "second"])
def test_capture_import_leaves_out_the_records_outside_the_capture(
    fixture_dir, tmp_path, capsys, part
):
    """The first half of the frames (a capture stopped while the worker served on): the
    requests received after its last message are left out; the second half (attached
    late): those that finished before its first. Counted in the summary line; the rest
    imported; ``--all-records`` imports every one."""
    b, ts = _bundle(fixture_dir, tmp_path, part)
    capsys.readouterr()
    metrics = read_metrics(fixture_dir / "sglang-metrics")
    lo, hi = min(ts), max(ts)
    inside = {r.rid for r in metrics if r.finish_ns >= lo - SLACK_NS and r.send_ns <= hi + SLACK_NS}
    assert 20 < len(inside) < len(metrics)  # the cut leaves some out either way
    argv = ["capture", "import", "--sglang-metrics", str(fixture_dir / "sglang-metrics")]
    assert main([*argv, str(b)]) == 0
    assert {r.rid for r in BundleReader(b).requests()} == inside
    err = capsys.readouterr().err
    n_out = len(metrics) - len(inside)
    side = "received after its last" if part == "first" else "finished before its first KV event"
    assert f"capture import: {len(inside)} request records -> {b}; {n_out} outside" in err
    assert f"{n_out} {side}" in err or f"{n_out} that {side}" in err, err
    assert "--all-records keeps them" in err
    # every record, asked for
    (tmp_path / "all").mkdir()
    b2, _ = _bundle(fixture_dir, tmp_path / "all", part)
    assert main([*argv, "--all-records", "--quiet", str(b2)]) == 0
    assert len(BundleReader(b2).requests()) == len(metrics)
    # ... which the replay runs all the same, and says so
    capsys.readouterr()
    assert main(["replay", str(b2), "--out", str(tmp_path / "sim")]) == 0
    said = capsys.readouterr()
    before, after = (0, n_out) if part == "first" else (n_out, 0)
    assert (
        f"{n_out} records outside the capture's stores ({before} finished before its first, "
        f"{after} received after its last;"
    ) in said.out + said.err


def test_a_new_bundle_takes_every_record(fixture_dir, tmp_path):
    b = tmp_path / "new"
    argv = ["capture", "import", "--quiet", "--sglang-metrics", str(fixture_dir / "sglang-metrics")]
    assert main([*argv, str(b)]) == 0
    assert len(BundleReader(b).requests()) == 120


def test_no_record_inside_the_capture_is_refused_and_nothing_written(fixture_dir, tmp_path, capsys):
    """Records of another run (or clocks far apart): one line, exit 2, the bundle as it
    was -- never a bundle whose requests published nothing it holds."""
    b, _ = _bundle(fixture_dir, tmp_path, "first")
    other = tmp_path / "sglang-request-metrics-20261129_14.log"
    day = 86_400.0
    lines = []
    for ln in next((fixture_dir / "sglang-metrics").glob("*.log")).read_text().splitlines()[:5]:
        d = json.loads(ln)
        for k in ("request_received_ts", "request_finished_ts", "response_sent_to_client_ts"):
            if isinstance(d.get(k), float):
                d[k] -= day  # the day before
        lines.append(json.dumps(d))
    other.write_text("\n".join(lines) + "\n")
    before = sorted(p.name for p in list_segments(b))
    capsys.readouterr()
    assert main(["capture", "import", "--sglang-metrics", str(other), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none of the 5 request records falls within" in err, err
    assert "--all-records" in err
    assert sorted(p.name for p in list_segments(b)) == before
    assert BundleReader(b).requests() == []
    assert (
        main(
            [
                "capture",
                "import",
                "--quiet",
                "--all-records",
                "--sglang-metrics",
                str(other),
                str(b),
            ]
        )
        == 0
    )
    assert len(BundleReader(b).requests()) == 5


def test_record_window_counts_each_side_and_keeps_untimed_records():
    from kvcadence.format.schema import RequestRecord

    w = RecordWindow(100 * 10**9, 200 * 10**9)
    s = 10**9
    recs = [
        RequestRecord(rid="early", input_ids=[1], send_ns=50 * s, finish_ns=98 * s),
        RequestRecord(rid="edge", input_ids=[1], send_ns=50 * s, finish_ns=99 * s + 1),
        RequestRecord(rid="across", input_ids=[1], send_ns=90 * s, finish_ns=150 * s),
        RequestRecord(rid="late", input_ids=[1], send_ns=202 * s, finish_ns=210 * s),
        RequestRecord(rid="untimed", input_ids=[1]),
        RequestRecord(rid="unfinished", input_ids=[1], send_ns=120 * s),
    ]
    kept = [r.rid for r in recs if w.keep(r)]
    assert kept == ["edge", "across", "untimed", "unfinished"]
    assert (w.before, w.after, w.kept, w.left_out) == (1, 1, 4, 2)
    assert w.span == (50 * s, 210 * s)
    assert w.said() == (
        "; 2 outside the capture left out (1 that finished before its first KV event and "
        "1 received after its last; --all-records keeps them)"
    )
