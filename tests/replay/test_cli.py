"""``kvcadence replay`` end to end: a bundle in, a sim bundle out; overrides land in the
header; bad input is one error line with exit 2; live publishing over real loopback ZMQ
(SUB receives every batch in SGLang framing, a DEALER replays from seq 0)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvcadence.cli import main
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader, BundleWriter
from kvcadence.format.schema import FORMAT_MAJOR, FORMAT_MINOR, Header
from kvcadence.replay.publish import publish_batches

from .helpers import config, lane_chain, run


def make_bundle(path: Path) -> None:
    chain = lane_chain(0, [(list(range(3, 40)), 12), (list(range(3, 40)) + [1] * 30, 9)])
    header = Header(
        format_major=FORMAT_MAJOR,
        format_minor=FORMAT_MINOR,
        source="real",
        kvcadence_version="test",
        sglang_version="0.5.23",
        server_info={"page_size": 1, "max_total_num_tokens": 300, "decode_log_interval": 40},
    )
    with BundleWriter(path, header) as w:
        for r in chain:
            w.write(r)


def test_replay_command_writes_a_sim_bundle_with_overrides(tmp_path, capsys):
    src = tmp_path / "src"
    make_bundle(src)
    out = tmp_path / "sim"
    rc = main(
        [
            "replay",
            str(src),
            "--out",
            str(out),
            "--page-size",
            "4",
            "--sglang-version",
            "0.5.17",
            "--disable-overlap-schedule",
            "--decode-base",
            "0.002",
            "--prefill-per-prefix-token",
            "0.00002",
            "--prefill-per-seq-sq",
            "0.000000001",
            "--decode-per-ctx-token",
            "0.000001",
            "--json",
        ]  # fmt: skip
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert '"requests": 2' in text and '"messages"' in text
    h = BundleReader(out).header
    assert h.source == "sim" and h.sglang_version == "0.5.17"
    cfg = h.sim_config
    assert cfg["page_size"] == 4 and cfg["disable_overlap_schedule"] is True
    assert cfg["timing"]["decode_base_s"] == 0.002 and cfg["max_total_tokens"] == 300
    assert cfg["timing"]["prefill_per_prefix_token_s"] == 0.00002
    assert cfg["timing"]["prefill_per_seq_sq_s"] == 1e-9
    assert cfg["timing"]["decode_per_ctx_token_s"] == 0.000001  # given: kept, not fitted
    frames = list(BundleReader(out).events())
    assert frames and all(f.pass_index >= -1 for f in frames)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    src = tmp_path / "src"
    make_bundle(src)
    cases = [
        ["replay", str(tmp_path / "missing"), "--out", str(tmp_path / "o1")],
        ["replay", str(src), "--out", str(tmp_path / "o2"), "--page-size", "0"],
        ["replay", str(src), "--out", str(tmp_path / "o3"), "--sglang-version", "0.5.5"],
        ["replay", str(src), "--out", str(tmp_path / "o4"), "--decode-per-ctx-token", "-1"],
        ["replay", str(src), "--out", str(tmp_path / "o4b"), "--prefill-per-seq-sq", "nan"],
        ["replay", str(src)],
        # the scheduling settings: a bad value, or priority retraction without priorities
        ["replay", str(src), "--out", str(tmp_path / "o5"), "--prefill-decode-interval", "-1"],
        ["replay", str(src), "--out", str(tmp_path / "o6"), "--scheduler-recv-interval", "0"],
        ["replay", str(src), "--out", str(tmp_path / "o7"), "--min-free-slots-delay", "x"],
        ["replay", str(src), "--out", str(tmp_path / "o8"), "--retraction-policy", "priority"],
        [
            "replay",
            str(src),
            "--out",
            str(tmp_path / "o9"),
            "--priority-scheduling-preemption-threshold",
            "high",
        ],
    ]
    for argv in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "kvcadence", *argv], capture_output=True, text=True
        )
        assert proc.returncode == 2, (argv, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvcadence: error:"), proc.stderr
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep")
    assert main(["replay", str(src), "--out", str(tmp_path / "busy")]) == 2
    assert (tmp_path / "busy" / "x").read_text() == "keep"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_live_publish_and_replay_socket():
    import zmq

    result = run(lane_chain(0, [(list(range(3, 30)), 6), (list(range(3, 30)) + [2] * 9, 4)]),
                 config())  # fmt: skip
    batches = result.batches
    pub_ep = f"tcp://127.0.0.1:{_free_port()}"
    rep_ep = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub_ep)
    sent: list[int] = []
    th = threading.Thread(
        target=lambda: sent.append(
            publish_batches(
                batches, pub_ep, topic="kv", replay_endpoint=rep_ep, linger_s=1.5, settle_s=2.0
            )  # fmt: skip
        )
    )
    th.start()
    got = []
    try:
        while len(got) < len(batches) and sub.poll(3000):
            got.append(wire.parse_live_message(sub.recv_multipart()))
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(rep_ep)
        dealer.send_multipart(wire.replay_request(0))
        replayed = []
        while dealer.poll(3000):
            frames = dealer.recv_multipart()
            parsed = wire.parse_replay_reply(frames[1:])
            if parsed is None:
                break
            replayed.append(parsed)
        dealer.close()
    finally:
        th.join()
        sub.close()
    assert sent == [len(batches)]
    assert [(t, s, p) for t, s, p in got] == [("kv", b.seq, b.payload) for b in batches]
    assert [(s, p) for _t, s, p in replayed] == [(b.seq, b.payload) for b in batches]


def test_publish_refuses_non_loopback():
    from kvcadence.errors import UsageError

    with pytest.raises(UsageError, match="loopback"):
        publish_batches([], "tcp://0.0.0.0:5557")


def test_no_request_ran_is_exit_1_with_the_aborted_count(tmp_path, capsys):
    src = tmp_path / "src"
    make_bundle(src)
    out = tmp_path / "sim"
    assert main(["replay", str(src), "--out", str(out), "--max-total-tokens", "10"]) == 1
    cap = capsys.readouterr()
    assert "2 aborted" in cap.out
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvcadence: error: replay: no request ran")
    assert "does not fit in the KV pool" in err[0]
    # the sim bundle was written all the same: every record says why
    recs = BundleReader(out).requests()
    assert [r.finish_reason for r in recs] == ["abort", "abort"]
    # a run where requests ran reports 0 aborted and exits 0
    assert main(["replay", str(src), "--out", str(tmp_path / "ok")]) == 0
    assert "0 aborted" in capsys.readouterr().out


def test_unknown_version_and_bad_sweep_point_write_nothing(tmp_path, capsys):
    src = tmp_path / "src"
    make_bundle(src)
    out = tmp_path / "o"
    assert main(["replay", str(src), "--out", str(out), "--sglang-version", "0.5.21"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "0.5.21" in err[0]
    assert not out.exists()
    argv = ["replay", str(src), "--out", str(out), "--sweep", "page-size=0,1", "--jobs", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "page_size=0" in err[0] and "page size must be >= 1" in err[0]
    assert not out.exists()  # validated before --out is created


def test_wall_is_the_whole_command_and_slow_phases_are_said_on_stderr(
    tmp_path, capsys, monkeypatch
):
    import json
    import time

    from kvcadence import progress
    from kvcadence.replay import simulator

    src = tmp_path / "src"
    make_bundle(src)
    real_write = simulator.write_sim_bundle
    monkeypatch.setattr(progress, "SAY_AFTER_S", 1.0)  # (the suite's default: an hour)

    def slow_write(*a, **k):  # a write phase the simulation time cannot contain
        time.sleep(1.5)
        return real_write(*a, **k)

    monkeypatch.setattr(simulator, "write_sim_bundle", slow_write)
    assert main(["replay", str(src), "--out", str(tmp_path / "sim"), "--json"]) == 0
    cap = capsys.readouterr()
    s = json.loads(cap.out)
    assert s["phases_s"]["write"] >= 1.5 and s["simulate_s"] < s["phases_s"]["write"]
    assert s["wall_s"] >= sum(s["phases_s"].values()) >= 1.5
    # only the phase that ran longer than SAY_AFTER_S (1 s here) was said
    assert cap.err == f"replay: writing {tmp_path / 'sim'} ...\n"
    monkeypatch.setattr(progress, "SAY_AFTER_S", 0.0)
    assert main(["replay", str(src), "--out", str(tmp_path / "sim2")]) == 0
    cap = capsys.readouterr()
    assert cap.err.splitlines() == [
        f"replay: loading {src} ...",
        f"replay: scanning {src} for cache flushes ...",
        "replay: simulating 2 requests ...",
        f"replay: writing {tmp_path / 'sim2'} ...",
    ]
    line = cap.out.strip()
    assert ", wall " in line and "(load " in line
    said = re.search(r"write (\d+\.\d+)", line)  # the slowed phase, however loaded the box
    assert said is not None and float(said.group(1)) >= 1.5, line
    assert main(["replay", str(src), "--out", str(tmp_path / "sim3"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_single_rank_replay_pace_flag(tmp_path, capsys):
    """``--pace`` on a single-rank replay: ``recorded`` keeps the rank on its recorded pace
    (the summary and trailer say ``"pace": "recorded"``; other events than the model's),
    ``auto`` (default) and ``model`` are the pass-time model alone: the same bytes."""
    import json

    src = Path(__file__).parent / "data" / "corpus" / "p1-lanes8" / "bundle"
    summaries, frames = {}, {}
    for pace in ("auto", "model", "recorded"):
        out = tmp_path / pace
        assert main(["replay", str(src), "--out", str(out), "--pace", pace, "--json"]) == 0
        summaries[pace] = json.loads(capsys.readouterr().out)
        reader = BundleReader(out)
        frames[pace] = [f.payload for f in reader.events()]
        (trailer,) = [r for r in reader.records() if type(r).__name__ == "Trailer"]
        assert trailer.stats["replay"].get("pace") == summaries[pace].get("pace")
    assert "pace" not in summaries["auto"] and "pace" not in summaries["model"]
    assert summaries["recorded"]["pace"] == "recorded"
    assert frames["auto"] == frames["model"] != frames["recorded"]
    assert summaries["recorded"]["skipped_decode_passes"] == 0  # a paced pass at a time


def test_single_rank_auto_pace_is_recorded_where_requests_queued(tmp_path, capsys):
    """``--pace auto`` (the default) on one rank whose requests queued (``p4-mrr3``:
    ``--max-running-requests 3`` under 8 lanes, a median wait of 1.3 s from receive to first
    forward) is the recorded pace: the same bytes as ``--pace recorded``, not the model's;
    under ``--no-calibrate`` it is the model (the built-in pass times are no base for it)."""
    import json

    from kvcadence.replay.pace import QUEUE_PACE_S, median_wait_s

    src = Path(__file__).parent / "data" / "corpus" / "p4-mrr3" / "bundle"
    wait = median_wait_s(BundleReader(src).requests())
    assert wait is not None and QUEUE_PACE_S <= wait < 1.5
    summaries, frames = {}, {}
    for pace, extra in (
        ("auto", []),
        ("recorded", []),
        ("model", []),
        ("nocal", ["--no-calibrate"]),
    ):
        out = tmp_path / pace
        flag = ["--pace", "auto" if pace == "nocal" else pace]
        assert main(["replay", str(src), "--out", str(out), *flag, *extra, "--json"]) == 0
        summaries[pace] = json.loads(capsys.readouterr().out)
        frames[pace] = [f.payload for f in BundleReader(out).events()]
    assert summaries["auto"]["pace"] == summaries["recorded"]["pace"] == "recorded"
    # why auto chose it: the records' median wait, said in the summary (and the trailer)
    assert summaries["auto"]["queue_wait_s"] == round(wait, 3)
    assert "queue_wait_s" not in summaries["recorded"]
    assert "pace" not in summaries["model"] and "pace" not in summaries["nocal"]
    assert frames["auto"] == frames["recorded"] != frames["model"]


@pytest.mark.parametrize(("waits", "want"), [((0.2, 0.9, 3.0), False), ((0.2, 1.0, 3.0), True)])
def test_queued_is_a_median_wait_of_a_second(waits, want):
    """``pace.queued``: the median of ``forward_entry_time - request_received_ts`` over the
    records with both (a record without them is not counted) against ``QUEUE_PACE_S``."""
    from types import SimpleNamespace

    from kvcadence.replay.pace import median_wait_s, queued

    recs = [
        SimpleNamespace(meta_info={"request_received_ts": 100.0, "forward_entry_time": 100.0 + w})
        for w in waits
    ]
    recs.append(SimpleNamespace(meta_info={"request_received_ts": 100.0}))
    recs.append(SimpleNamespace(meta_info=None))
    assert queued(recs) is want
    assert median_wait_s(recs) == pytest.approx(waits[1])
    assert median_wait_s(recs[-2:]) is None and not queued(recs[-2:])


def test_a_production_capture_s_inference_is_a_phase_of_its_own(tmp_path, capsys, monkeypatch):
    """Records from SGLang's metrics files are completed (outputs, sessions) before the
    simulation: that time is the replay's ``infer`` phase, said and summed like the others,
    apart from reading the records (``load``); a bundle with driver records has none."""
    import json

    from kvcadence import progress

    from .test_corpus import production_bundle

    src = production_bundle("p16-http-clients-cancel", tmp_path / "real")
    assert main(["replay", str(src), "--out", str(tmp_path / "sim"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["phases_s"]["infer"] > 0 and s["phases_s"]["load"] > 0
    assert s["wall_s"] >= sum(s["phases_s"].values())
    monkeypatch.setattr(progress, "SAY_AFTER_S", 0.0)
    assert main(["replay", str(src), "--out", str(tmp_path / "sim2")]) == 0
    cap = capsys.readouterr()
    assert "replay: inferring outputs and sessions of 212 records ..." in cap.err.splitlines()
    assert re.search(r"\(load \d+\.\d+ s, infer \d+\.\d+ s, ", cap.out), cap.out
    driver = tmp_path / "driver"
    make_bundle(driver)
    assert main(["replay", str(driver), "--out", str(tmp_path / "sim3"), "--json"]) == 0
    assert "infer" not in json.loads(capsys.readouterr().out)["phases_s"]


def test_replay_says_its_pass_time_model_and_where_it_came_from(tmp_path, capsys):
    """The summary's second line: the pass-time model's terms and what calibrated them --
    how many requests' per-phase timings, and how many retracted or preempted ones the fits
    left out (``p1-retract-noeos``: 6); ``--no-calibrate`` and an option that sets a term
    say so; ``--json`` carries the parameters and the report; a fleet says it per rank."""
    import json

    corpus = Path(__file__).parent / "data" / "corpus"
    src = corpus / "p1-retract-noeos" / "bundle"
    assert main(["replay", str(src), "--out", str(tmp_path / "a")]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert re.fullmatch(
        r"pass-time model: prefill [\d.]+ ms \+ [\d.]+ us/token; decode [\d.]+ ms \+ [\d.]+ "
        r"ms/request \(calibrated from 194 requests' per-phase timings; 6 retracted or "
        r"preempted on the way left out, their windows holding waits in the queue\)",
        line,
    ), line
    argv = ["replay", str(src), "--no-calibrate", "--decode-base", "0.004"]
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("pass-time model: prefill 10.00 ms + 30.0 us/token; decode 4.00 ms")
    assert line.endswith("(built-in defaults, --no-calibrate; set by option: decode_base_s)")
    assert main([*argv, "--out", str(tmp_path / "c"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["timing"]["decode_base_s"] == 0.004
    assert summary["calibration"] == {"given": ["decode_base_s"]}
    dp = corpus / "dp2-p4-flush" / "bundle"
    assert main(["replay", str(dp), "--out", str(tmp_path / "d")]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "pass-time model" in x]
    assert [x.split(":")[0] for x in lines] == ["  bundle rank 0", "  bundle rank 1"]
    assert all("(calibrated from 100 requests' per-phase timings)" in x for x in lines)
    assert main(["replay", str(dp), "--out", str(tmp_path / "e"), "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["timing"]
    assert [(t["rank"], t["calibration"]["source"]) for t in ranks] == [
        (0, "phases"),
        (1, "phases"),
    ]
    assert all(t["timing"]["decode_base_s"] > 0 for t in ranks)


def _sim_settings(out: Path) -> dict:
    cfg = BundleReader(out).header.sim_config
    assert cfg is not None
    return cfg


def _no_aside(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if ".replaced-" in p.name]


def test_force_replaces_a_replays_own_output_and_gives_it_back_on_failure(
    tmp_path, capsys, monkeypatch
):
    src = tmp_path / "src"
    make_bundle(src)
    out = tmp_path / "sim"
    assert main(["replay", str(src), "--out", str(out), "--quiet"]) == 0
    assert _sim_settings(out)["max_total_tokens"] == 300
    capsys.readouterr()
    # without --force: refused, and the refusal says how to replace it
    assert main(["replay", str(src), "--out", str(out), "--max-total-tokens", "200"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refusing to overwrite" in err[0] and "--force" in err[0]
    assert _sim_settings(out)["max_total_tokens"] == 300
    # --force: the new sim bundle in its place, nothing of the old one left beside it
    argv = ["replay", str(src), "--out", str(out), "--max-total-tokens", "200", "--force"]
    assert main([*argv, "--quiet"]) == 0
    assert _sim_settings(out)["max_total_tokens"] == 200
    assert len(BundleReader(out).requests()) == 2
    _no_aside(tmp_path)
    capsys.readouterr()
    # a run that fails after the old output was set aside gets it back as it was
    before = sorted((p.name, p.read_bytes()) for p in out.iterdir())
    assert (
        main(["replay", str(src), "--out", str(out), "--force", "--sglang-version", "0.5.21"]) == 2
    )
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert sorted((p.name, p.read_bytes()) for p in out.iterdir()) == before
    _no_aside(tmp_path)
    # ... and so does an interrupted one (Ctrl-C, SIGTERM) that had begun writing the new one
    import kvcadence.replay.simulator as simulator

    real_replay = simulator.replay_bundle

    def interrupted(src_, out_, *a, **kw):
        Path(out_).mkdir()
        (Path(out_) / "seg-000000.kvcb").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(simulator, "replay_bundle", interrupted)
    assert main(["replay", str(src), "--out", str(out), "--force", "--quiet"]) == 130
    assert sorted((p.name, p.read_bytes()) for p in out.iterdir()) == before
    _no_aside(tmp_path)
    monkeypatch.setattr(simulator, "replay_bundle", real_replay)


def test_force_never_replaces_a_capture_the_input_or_a_foreign_directory(tmp_path, capsys):
    src = tmp_path / "src"
    make_bundle(src)
    capture = tmp_path / "capture"
    make_bundle(capture)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    kept = {d: sorted((p.name, p.read_bytes()) for p in d.iterdir()) for d in (src, capture, mine)}
    for out, why in (
        (src, "holds this replay's input"),
        (tmp_path, "holds this replay's input"),
        (capture, "not a sim bundle"),
        (mine, "not a sim bundle"),
    ):
        assert main(["replay", str(src), "--out", str(out), "--force"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0] and "--force replaces only" in err[0], err
    for d, files in kept.items():
        assert sorted((p.name, p.read_bytes()) for p in d.iterdir()) == files
    # a file is no replay output either
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["replay", str(src), "--out", str(f), "--force"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert f.read_text() == "x"
