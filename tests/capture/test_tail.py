"""Tailing SGLang's request logs while capturing (``capture --sglang-metrics DIR``): real
files on disk, written the way SGLang writes them (hourly metrics files opened in append
mode, ``json.dump`` in pieces; ``TimedRotatingFileHandler`` renaming the request log), and
one capture end to end with the test publisher replaying the fixture's KV events while its
metrics file is appended."""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from pathlib import Path

import pytest

from kvcadence.capture.sglang_logs import read_metrics
from kvcadence.capture.tail import LogTail, match_requests
from kvcadence.cli import main
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import Annotation, RequestRecord, Trailer
from kvcadence.testing.publisher import TestPublisher


def metrics_line(rid: str, ids: list[int], n_out: int = 3, t: float = 1.8e9) -> str:
    params = {"rid": rid, "input_ids": ids, "sampling_params": {"max_new_tokens": n_out}}
    d = {
        "request_parameters": json.dumps(params),
        "id": rid,
        "prompt_tokens": len(ids),
        "cached_tokens": 0,
        "completion_tokens": n_out,
        "request_received_ts": t,
        "request_finished_ts": t + 0.5,
    }
    return json.dumps(d) + "\n"


def tail_of(tmp_path: Path, **kw):
    got: list = []
    t = LogTail(got.append, poll_s=0.05, **kw)
    return t, got


def recs(got: list) -> list[RequestRecord]:
    return [r for r in got if isinstance(r, RequestRecord)]


def test_rotation_new_hourly_files_and_the_old_one_still_growing(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    t, got = tail_of(tmp_path, metrics=[d])
    a = d / "sglang-request-metrics-20261201_19.log"
    a.write_text(metrics_line("a1", [1, 2, 3]))
    assert t.poll() == 1
    b = d / "sglang-request-metrics-20261201_20.log"  # the next hour's file appears
    b.write_text(metrics_line("b1", [4, 5]) + metrics_line("b2", [6]))
    with open(a, "a") as fh:  # a request that finished in the old hour, written late
        fh.write(metrics_line("a2", [7, 8]))
    (d / "unrelated.txt").write_text("not a metrics file\n")
    assert t.poll() == 3
    assert t.poll() == 0  # nothing new: nothing read twice
    st = t.stop()
    assert sorted(r.rid for r in recs(got)) == ["a1", "a2", "b1", "b2"]
    assert (st.files, st.new_files, st.records, st.bad_lines) == (2, 2, 4, 0)
    # the same records as `capture import` reads from the files afterwards
    assert {r.rid: r for r in recs(got)} == {r.rid: r for r in read_metrics(d)}


def test_partial_last_line_waits_for_its_rest(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    f = d / "sglang-request-metrics-20261201_19.log"
    t, got = tail_of(tmp_path, metrics=[d])
    line = metrics_line("r1", list(range(3000)))
    with open(f, "a") as fh:  # json.dump writes a record in pieces; flush only at the end
        for cut in (100, 5000, len(line) - 1):
            fh.write(line[fh.tell() : cut])
            fh.flush()
            assert t.poll() == 0, f"parsed half a line (first {cut} bytes)"
        fh.write(line[-1:])
    assert t.poll() == 1
    assert recs(got)[0].input_ids == list(range(3000))
    with open(f, "a") as fh:
        fh.write(metrics_line("r2", [9])[:20])
    st = t.stop()
    assert st.partial_bytes_at_stop == 20 and st.records == 1 and st.bad_lines == 0


def test_truncation_and_a_restart_that_tore_a_line(tmp_path):
    log = tmp_path / "server.log"
    t, got = tail_of(tmp_path, metrics=[log])  # a single file given, created late
    log.write_text(metrics_line("x1", [1]) + metrics_line("x2", [2])[:30])
    assert t.poll() == 1
    # the worker restarts with `> server.log`: the file starts again, shorter
    log.write_text(metrics_line("y1", [3]))
    assert t.poll() == 1 and t.stats.truncations == 1 and t.stats.torn_lines == 1
    # killed mid-line, restarted, appending to the same (hourly) file: the torn line is
    # followed by a whole record on the same line; the record is kept, the tear counted
    with open(log, "a") as fh:
        fh.write(metrics_line("y2", [4])[:40] + metrics_line("y3", [5]))
    assert t.poll() == 1
    t.stop()
    assert [r.rid for r in recs(got)] == ["x1", "y1", "y3"]
    assert t.stats.torn_lines == 2 and t.stats.bad_lines == 0


def test_request_log_renamed_by_rotation_is_read_to_its_end(tmp_path):
    """--log-requests-target DIR: TimedRotatingFileHandler renames host_0.log to
    host_0.log.<date_hour> and opens a new host_0.log; the '[date time] ' prefix and
    other server output are skipped."""
    d = tmp_path / "reqlog"
    d.mkdir()
    cur = d / "host_0.log"

    def line(event: str, rid: str, **kw) -> str:
        body = {"timestamp": "2026-12-01T19:59:59.5+00:00", "event": event, "rid": rid, **kw}
        return f"[2026-12-01 19:59:59] {json.dumps(body)}\n"

    out = {"output_ids": [7, 8], "meta_info": {"prompt_tokens": 2, "completion_tokens": 2}}
    cur.write_text(line("request.received", "q1", obj={"input_ids": [1, 2]}))
    t, got = tail_of(tmp_path, request_logs=[d])
    assert t.stats.skipped_bytes > 0  # there before the capture: not read
    with open(cur, "a") as fh:
        fh.write("INFO some other server output\n")
        fh.write(line("request.received", "q2", obj={"input_ids": [3, 4]}))
    assert t.poll() == 0
    with open(cur, "a") as fh:  # written after our last read, just before the rotation
        fh.write(line("request.finished", "q2", obj={"input_ids": [3, 4]}, out=out))
    cur.rename(d / "host_0.log.2026-12-01_19")
    cur.write_text(line("request.received", "q3", obj={"input_ids": [5, 6]}))
    assert t.poll() == 1
    t.stop()  # q3 never finished: an error record
    by = {r.rid: r for r in recs(got)}
    assert set(by) == {"q2", "q3"}
    assert by["q2"].output_ids == [7, 8] and by["q2"].input_ids == [3, 4]
    assert by["q3"].error == "no request.finished line"
    assert t.stats.other_lines == 1 and t.stats.unfinished == 1


def test_backlog_skipped_from_mid_line_or_read_with_from_start(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    f = d / "sglang-request-metrics-20261201_19.log"
    f.write_text(metrics_line("old", [1]) + metrics_line("half", [2])[:25])
    t, got = tail_of(tmp_path, metrics=[d])
    with open(f, "a") as fh:
        fh.write(metrics_line("half", [2])[25:] + metrics_line("new", [3]))
    t.poll()
    t.stop()
    assert [r.rid for r in recs(got)] == ["new"]
    t2, got2 = tail_of(tmp_path, metrics=[d], from_start=True)
    t2.stop()
    assert [r.rid for r in recs(got2)] == ["old", "half", "new"]


def test_bad_lines_and_reused_rids_never_stop_the_tail(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    t, got = tail_of(tmp_path, metrics=[d])
    (d / "sglang-request-metrics-20261201_19.log").write_text(
        metrics_line("r", [1])
        + "{oops\n"
        + json.dumps({"id": "no-params"})
        + "\n"
        + metrics_line("t", [True])  # a bool is no token id
        + metrics_line("r", [2])  # the client reused rid r
    )
    t.stop()
    rs = recs(got)
    assert [r.rid for r in rs] == ["r", "r~2"]
    assert rs[1].meta_info["sglang_rid"] == "r" and rs[1].input_ids == [2]
    notes = [a for a in got if isinstance(a, Annotation)]
    assert [a.data["where"] for a in notes] == [
        "sglang-request-metrics-20261201_19.log:2",
        "sglang-request-metrics-20261201_19.log:3",
        "sglang-request-metrics-20261201_19.log:4",
    ]
    assert t.stats.bad_lines == 3 and t.stats.rids_reused == 1


def test_bad_paths_are_refused_in_one_line(tmp_path, capsys):
    argv = ["capture", "--endpoint", "tcp://127.0.0.1:1", "--out", str(tmp_path / "b")]
    assert main([*argv, "--sglang-metrics", str(tmp_path / "no" / "such")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither it nor its directory" in err
    m = tmp_path / "m"
    m.mkdir()
    assert main([*argv, "--sglang-metrics", str(m), "--sglang-request-log", str(m)]) == 2
    assert "not both" in capsys.readouterr().err
    assert main([*argv, "--sglang-backlog"]) == 2
    assert not (tmp_path / "b").exists()


def test_capture_with_the_metrics_dir_appended_while_it_runs(tmp_path, fixture_dir, capsys):
    """End to end: the test publisher sends the fixture's KV events while its metrics lines
    are appended, in pieces, to a directory that does not exist when the capture starts
    (and to a second hourly file); the bundle holds the events and every request; the
    summary says all 120 matched the event stream; the production replay recovers them."""
    frames = [json.loads(x) for x in (fixture_dir / "events.jsonl").read_text().splitlines()]
    lines = (fixture_dir / "sglang-metrics").glob("*.log")
    text = "".join(p.read_text() for p in lines)
    out = tmp_path / "prod.kvcb"
    mdir = tmp_path / "metrics"
    rc: list[int] = []
    with TestPublisher() as pub:
        argv = [
            "capture",
            "--endpoint",
            pub.endpoint,
            "--replay-endpoint",
            pub.replay_endpoint,
            "--sglang-metrics",
            str(mdir),
            "--out",
            str(out),
            "--duration",
            "8",
        ]
        th = threading.Thread(target=lambda: rc.append(main(argv)))
        th.start()
        deadline = time.monotonic() + 30
        while not out.exists():
            assert time.monotonic() < deadline, "capture did not start"
            time.sleep(0.05)
        time.sleep(1.0)  # the tail's first scan saw no directory
        mdir.mkdir()
        half = len(text) // 2
        cut = text.index("\n", half) + 1
        files = [
            (mdir / "sglang-request-metrics-20261129_14.log", text[:cut]),
            (mdir / "sglang-request-metrics-20261129_15.log", text[cut:]),
        ]
        k = 0
        for i, f in enumerate(frames):
            pub.publish(base64.b64decode(f["payload_b64"]))
            if i % 10 == 9 and k < len(files):
                path, body = files[k]
                with open(path, "a") as fh:  # a third of a file, ending mid-line
                    n = os.path.getsize(path) if path.exists() else 0
                    step = len(body) // 3 + 1
                    fh.write(body[n : n + step])
                if path.stat().st_size >= len(body):
                    k += 1
            time.sleep(0.01)
        for path, body in files:
            n = path.stat().st_size if path.exists() else 0
            with open(path, "a") as fh:
                fh.write(body[n:])
        th.join(60)
    assert rc == [0]
    err = capsys.readouterr().err
    rd = BundleReader(out)
    reqs = rd.requests()
    assert len(reqs) == 120 and len(list(rd.events())) == len(frames)
    trailer = [r for r in rd.records() if isinstance(r, Trailer)][-1]
    st = trailer.stats["sglang_logs"]
    assert st["records"] == 120 and st["files"] == 2 and st["new_files"] == 2
    assert st["bad_lines"] == 0 and st["skipped_bytes"] == 0
    assert "120 request records from 2 files" in err
    assert "120 of 120 requests matched to the event stream" in err
    assert main(["replay", str(out), "--out", str(tmp_path / "sim")]) == 0
    assert "120 from KV events" in capsys.readouterr().out


def test_a_capture_whose_metrics_dir_never_gets_a_file_warns(tmp_path, fixture_dir, capsys):
    """The request side missing from a capture (a metrics dir the worker never wrote to: a
    relative ``--export-metrics-to-file-dir`` lands under the worker's own working
    directory) is said in one warning line with the fix, not left to a "0 request
    records" count; the events are still recorded and the capture exits 0."""
    frames = [json.loads(x) for x in (fixture_dir / "events.jsonl").read_text().splitlines()]
    out = tmp_path / "prod.kvcb"
    mdir = tmp_path / "metrics"
    mdir.mkdir()
    rc: list[int] = []
    with TestPublisher() as pub:
        argv = ["capture", "--endpoint", pub.endpoint, "--sglang-metrics", str(mdir)]
        th = threading.Thread(
            target=lambda: rc.append(main([*argv, "--out", str(out), "--duration", "3"]))
        )
        th.start()
        deadline = time.monotonic() + 30
        while not out.exists():
            assert time.monotonic() < deadline, "capture did not start"
            time.sleep(0.05)
        time.sleep(0.5)
        for f in frames[:20]:
            pub.publish(base64.b64decode(f["payload_b64"]))
        th.join(60)
    assert rc == [0]
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("warning:")]
    assert f"no SGLang log file was found in {mdir.resolve()}" in line
    assert "capture import --sglang-metrics" in line
    rd = BundleReader(out)
    assert not rd.requests() and len(list(rd.events())) > 0


def test_match_requests_counts_short_and_unmatched_prompts(fixture_dir, tmp_path):
    from kvcadence.capture.importer import import_bundle
    from kvcadence.capture.tail import TailStats, prompt_anchor, summary_text

    b = tmp_path / "b"
    import_bundle(
        b,
        frames=fixture_dir / "events.jsonl",
        server_info=fixture_dir / "server_info.json",
        command=["t"],
    )
    prompts = [r.input_ids for r in read_metrics(fixture_dir / "sglang-metrics")][:5]
    anchors = [prompt_anchor(p, 1) for p in prompts]
    anchors += [prompt_anchor([1000, 1001, 1002], 1), prompt_anchor([], 1)]
    anchors += [prompt_anchor([1, 2], 16)]
    got = match_requests(BundleReader(b), anchors)
    assert got == {"requests": 8, "matched": 5, "short": 1, "no_ids": 1}
    assert match_requests(BundleReader(b), anchors, 1) == got
    # the summary says what a request without token ids may be, and that it is lost
    text = summary_text(TailStats(records=8), got)
    assert "1 without token ids: text prompts -- give --tokenizer DIR" in text
    assert "or a worker run with --log-requests" in text
    ok = summary_text(TailStats(records=5), {**got, "no_ids": 0})
    assert "0 without token ids)" in ok and "log-requests" not in ok


def test_match_requests_says_when_the_events_have_another_page_size(tmp_path):
    """A capture without a /server_info page size hashes the prompts at page size 1: on a
    page-16 stream nothing matches, and the summary says why instead of '0 of N'."""
    from kvcadence.capture.tail import TailStats, prompt_anchor, summary_text

    corpus = Path(__file__).parents[1] / "replay" / "data" / "corpus" / "p16-chunk256-evict"
    prompts = [r.input_ids for r in read_metrics(corpus / "sglang-metrics")][:20]
    reader = BundleReader(corpus / "bundle")
    got = match_requests(reader, [prompt_anchor(p, 1) for p in prompts], 1)
    assert got["matched"] == 0 and got["page_mismatch"] == 16
    text = summary_text(TailStats(), got)
    assert "its pages are 16 tokens" in text and "0 of 20" not in text
    right = match_requests(reader, [prompt_anchor(p, 16) for p in prompts], 16)
    assert right["matched"] == 20 and "page_mismatch" not in right


def test_the_summary_rehashes_at_the_events_page_size(tmp_path):
    """The capture's summary does not stop at the mismatch: the checked requests' prompts,
    read back from the bundle, are hashed at the events' block size and matched (a real
    production capture, ``http-clients-p16``: its records are the tailed metrics)."""
    from kvcadence.capture.tail import (
        TailStats,
        anchored,
        prompt_anchor,
        rematch_at_events_page,
        summary_text,
    )

    corpus = Path(__file__).parents[1] / "replay" / "data" / "corpus" / "http-clients-p16"
    reader = BundleReader(corpus / "bundle")
    recs = reader.requests()
    anchors = [prompt_anchor(r.input_ids, 1) for i, r in enumerate(recs) if anchored(i)]
    got = match_requests(reader, anchors, 1)
    assert got["matched"] == 0 and got["page_mismatch"] == 16
    again = rematch_at_events_page(reader, got)
    truth = match_requests(
        reader, [prompt_anchor(r.input_ids, 16) for i, r in enumerate(recs) if anchored(i)], 16
    )
    assert again == {**truth, "rehashed_at": 16} and again["matched"] > 0.9 * len(recs)
    text = summary_text(TailStats(records=len(recs)), again)
    assert f"{again['matched']} of {len(recs)} requests" in text and "page size, 16 tokens" in text
    assert rematch_at_events_page(reader, truth) is truth  # nothing to redo


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_small_reads_give_the_same_records(tmp_path, chunk):
    d = tmp_path / "m"
    d.mkdir()
    body = "".join(metrics_line(f"r{i}", list(range(i, i + 50))) for i in range(40))
    (d / "sglang-request-metrics-20261201_19.log").write_text(body)
    got: list = []
    t = LogTail(got.append, metrics=[d], from_start=True, read_bytes=chunk)
    t.stop()
    assert [r.rid for r in recs(got)] == [f"r{i}" for i in range(40)]


def test_a_long_capture_checks_a_sample_of_its_requests(tmp_path):
    """Checking a request against the event stream hashes its whole prompt in the tail's
    thread: past the first ``ANCHOR_ALL`` only every ``ANCHOR_STRIDE``-th is checked, and the
    summary says so (every record is still written)."""
    from kvcadence.capture.tail import ANCHOR_ALL, ANCHOR_STRIDE, TailStats, summary_text

    d = tmp_path / "m"
    d.mkdir()
    n = ANCHOR_ALL + 3 * ANCHOR_STRIDE + 1
    body = "".join(metrics_line(f"r{i}", [i % 50_000, 7, 8]) for i in range(n))
    (d / "sglang-request-metrics-20261201_19.log").write_text(body)
    got: list = []
    t = LogTail(got.append, metrics=[d], from_start=True)
    st = t.stop()
    assert len(recs(got)) == st.records == n
    assert len(t.anchors) == ANCHOR_ALL + 4  # records 1000, 1020, 1040, 1060
    match = {"requests": len(t.anchors), "matched": 1000, "short": 0, "no_ids": 0}
    text = summary_text(st, match)
    assert f"1000 of {ANCHOR_ALL + 4} requests checked (of {n}: the first 1000" in text
    small = summary_text(TailStats(records=len(t.anchors)), match)
    assert f"1000 of {ANCHOR_ALL + 4} requests matched to the event stream" in small
