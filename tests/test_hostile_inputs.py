"""Hostile flags and inputs: one error line and exit 2, never a traceback, a hang or an
allocation without bound (NaN/inf flags, huge counts, deep JSON, absurd timestamps,
non-numeric /server_info fields, an --out that cannot be created)."""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import pytest

from kvcadence import argtypes
from kvcadence.capture import discovery
from kvcadence.cli import build_parser, main, walk_parsers
from kvcadence.errors import CaptureError

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "data" / "fixtures" / "sglang-0.5.23-agent-ps1"
SAMPLE = REPO / "examples" / "sglang-0.5.23-agent-ps1.kvcb"
CHECKED_FLOATS = (argtypes.finite_float, argtypes.nonneg_float, argtypes.positive_float)


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcadence: error: ") and "Traceback" not in err, err
    return lines[0]


def _float_flags() -> list[tuple[str, str, argparse.Action]]:
    out = []
    for path, parser in walk_parsers(build_parser()):
        for action in parser._actions:
            if action.option_strings and action.type in (float, *CHECKED_FLOATS):
                out.append((" ".join(path[1:]), action.option_strings[0], action))
    return out


def test_no_flag_is_a_bare_float_or_a_bare_int_count():
    """Every float flag goes through one checked type (NaN/inf refused); --jobs is >= 1."""
    flags = _float_flags()
    assert len(flags) >= 20
    bare = [f"{cmd} {flag}" for cmd, flag, a in flags if a.type is float]
    assert bare == []
    jobs = [
        a
        for _, p in walk_parsers(build_parser())
        for a in p._actions
        if "--jobs" in a.option_strings
    ]
    assert jobs and all(a.type is argtypes.positive_int for a in jobs)


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_every_float_flag_refuses_non_finite_values(value):
    for cmd, flag, action in _float_flags():
        with pytest.raises(argparse.ArgumentTypeError):
            action.type(value)  # type: ignore[misc]
        assert action.type("1.5") == 1.5, f"{cmd} {flag}"  # type: ignore[misc]


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", str(SAMPLE), "--out", "x", "--prefill-base", "nan"],
        ["replay", str(SAMPLE), "--out", "x", "--transfer-base", "inf"],
        ["replay", str(SAMPLE), "--out", "x", "--schedule-conservativeness", "nan"],
        ["replay", str(SAMPLE), "--out", "x", "--decode-base", "-1"],
        ["replay", str(SAMPLE), "--out", "x", "--sweep", "route=recorded", "--jobs", "0"],
        ["replay", str(SAMPLE), "--out", "x", "--sweep", "route=recorded", "--jobs", "-1"],
        ["capture", "--endpoint", "tcp://127.0.0.1:5", "--out", "x", "--duration", "nan"],
        ["capture", "--endpoint", "tcp://127.0.0.1:5", "--out", "x", "--until-idle", "nan"],
        ["capture", "--endpoint", "tcp://127.0.0.1:5", "--out", "x", "--until-idle", "inf"],
        ["capture", "--endpoint", "tcp://127.0.0.1:5", "--out", "x", "--replay-timeout", "nan"],
        ["capture", "--endpoint", "tcp://127.0.0.1:5", "--out", "x", "--segment-mb", "nan"],
        ["admit", "--synthetic-grid", "--new-token-ratio", "nan"],
    ],
)
def test_bad_numeric_flags_exit_2_before_any_work(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"argument {argv[-2]}" in err
    assert not (tmp_path / "x").exists()


def test_window_nan_is_one_line(tmp_path, capsys):
    rc = main(["report", str(SAMPLE), "--out", str(tmp_path / "r"), "--window", "nan:"])
    assert rc == 2 and "--window" in one_error_line(capsys.readouterr().err)


def test_admit_repeat_is_bounded_before_anything_is_allocated(capsys):
    t0 = time.monotonic()
    rc = main(["admit", "--synthetic-grid", "--repeat", "100000000", "--available-tokens", "9"])
    assert rc == 2 and time.monotonic() - t0 < 5
    assert "--repeat 100000000" in one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------ /server_info, dp_size


def _import(tmp_path: Path, capsys, info: dict, reqs: Path | None = None) -> tuple[int, str]:
    si = tmp_path / "si.json"
    si.write_text(json.dumps(info))
    argv = ["import", "--frames", str(FIX / "events.jsonl"), "--server-info", str(si)]
    argv += ["--requests", str(reqs or FIX / "requests.jsonl"), "--out", str(tmp_path / "b")]
    rc = main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "info",
    [
        {"dp_size": 100_000_000},
        {"dp_size": "many"},
        {"kv_events": {"endpoint_port_base": 5557, "dp_size": 100_000_000}},
        {"kv_events": {"endpoint_port_base": 5557, "dp_size": 0}},
        {"kv_events": {"endpoint_port_base": 5557, "replay_endpoint_port_base": "x"}},
    ],
)
def test_import_refuses_absurd_dp_sizes_in_one_line(tmp_path, capsys, info):
    t0 = time.monotonic()
    rc, err = _import(tmp_path, capsys, info)
    assert rc == 2 and time.monotonic() - t0 < 20
    assert "si.json" in one_error_line(err)
    assert not (tmp_path / "b").exists()


def test_replay_refuses_a_bundle_claiming_a_huge_dp_rank(tmp_path, capsys):
    rows = [json.loads(ln) for ln in (FIX / "requests.jsonl").read_text().splitlines()]
    rows[0].setdefault("meta_info", {})["dp_rank"] = 100_000_000
    reqs = tmp_path / "r.jsonl"
    reqs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, err = _import(tmp_path, capsys, {"version": "0.5.23"}, reqs)
    assert rc == 0, err
    t0 = time.monotonic()
    rc = main(["replay", str(tmp_path / "b"), "--out", str(tmp_path / "s"), "--quiet"])
    assert rc == 2 and time.monotonic() - t0 < 20
    assert "100000001 DP ranks" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "kv",
    [
        {"endpoint_port_base": 5557, "dp_size": "two"},
        {"endpoint_port_base": 5557, "dp_size": 100_000_000},
        {"endpoint_port_base": 5557, "dp_size": 1.5},
        {"endpoint_port_base": 5557, "replay_endpoint_port_base": "x"},
        {"endpoint_port_base": 5557, "replay_endpoint_port_base": 1e300},
        {"endpoint_port_base": float("inf")},
        {"endpoint_port_base": "x"},
    ],
)
def test_discovery_refuses_hostile_kv_events_blocks(kv):
    t0 = time.monotonic()
    with pytest.raises(CaptureError):
        discovery.endpoints_from_server_info({"kv_events": kv}, "http://127.0.0.1:1")
    assert time.monotonic() - t0 < 5


def test_discovery_still_takes_a_numeric_string_dp_size():
    eps = discovery.endpoints_from_server_info(
        {"kv_events": {"endpoint_port_base": 5557, "dp_size": "2"}}, "http://127.0.0.1:1"
    )
    assert [e.url for e in eps] == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]


# ------------------------------------------------------------------ deep JSON, timestamps

DEEP = 20_000


def test_import_refuses_meta_info_nested_20000_deep(tmp_path, capsys):
    deep = '{"a":' * DEEP + "1" + "}" * DEEP
    reqs = tmp_path / "r.jsonl"
    reqs.write_text('{"rid":"a","input_ids":[1,2],"meta_info":' + deep + "}\n")
    rc, err = _import(tmp_path, capsys, {}, reqs)
    assert rc == 2 and "nested deeper" in one_error_line(err)


def test_import_refuses_server_info_nested_20000_deep(tmp_path, capsys):
    si = tmp_path / "si.json"
    si.write_text('{"x":' + "[" * DEEP + "]" * DEEP + "}")
    rc = main(["import", "--frames", str(FIX / "events.jsonl"), "--server-info", str(si)] + [
        "--out", str(tmp_path / "b")])  # fmt: skip
    assert rc == 2 and "nested deeper" in one_error_line(capsys.readouterr().err)


def _cimport(tmp_path: Path, flag: str, text: str) -> tuple[int, Path]:
    log = tmp_path / "in.log"
    log.write_text(text)
    out = tmp_path / "c"
    return main(["capture", "import", flag, str(log), "--quiet", str(out)]), out


@pytest.mark.parametrize(
    "text",
    [
        '{"a":' + "[" * DEEP + "]" * DEEP + "}\n",
        '{"request_parameters": "{\\"rid\\": \\"x\\", \\"a\\": '
        + "[" * DEEP
        + "]" * DEEP
        + '}"}\n',
    ],
)
def test_sglang_metrics_nested_20000_deep_is_one_line(tmp_path, capsys, text):
    rc, _ = _cimport(tmp_path, "--sglang-metrics", text)
    assert rc == 2 and "nested deeper" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("ts", ["Infinity", "-Infinity", "NaN", "1e300", "1e12"])
def test_sglang_metrics_absurd_timestamps_are_no_timestamps(tmp_path, capsys, ts):
    params = json.dumps({"rid": "x", "input_ids": [1, 2]})
    line = f'{{"request_parameters": {json.dumps(params)}, "request_received_ts": {ts}, '
    line += f'"first_token_latency": {ts}, "request_finished_ts": {ts}}}\n'
    rc, out = _cimport(tmp_path, "--sglang-metrics", line)
    assert rc == 0, capsys.readouterr().err
    from kvcadence.format.bundle import BundleReader

    (rec,) = BundleReader(out).requests()
    assert rec.send_ns is None and rec.finish_ns is None and rec.first_token_ns is None


@pytest.mark.parametrize("ts", ["Infinity", "NaN", "1e300", '"9999-01-01T00:00:00"', "-5"])
def test_request_log_absurd_timestamps_are_one_line(tmp_path, capsys, ts):
    line = f'{{"event": "request.finished", "rid": "x", "timestamp": {ts}, "obj": {{}}}}\n'
    rc, out = _cimport(tmp_path, "--sglang-request-log", line)
    assert rc == 2 and "timestamp" in one_error_line(capsys.readouterr().err)
    assert not out.exists()


def test_a_recursion_error_anywhere_is_one_line(monkeypatch, capsys):
    from kvcadence.analysis import cli as acli

    def deep(args):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(acli, "run_ingest", deep)
    assert main(["ingest", str(SAMPLE)]) == 2
    assert "nested too deeply" in one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------ --out that cannot be made


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", str(SAMPLE), "--quiet", "--out"],
        ["replay", str(SAMPLE), "--quiet", "--sweep", "route=recorded", "--out"],
        ["import", "--frames", str(FIX / "events.jsonl"), "--out"],
        ["capture", "--endpoint", "tcp://127.0.0.1:5", "--duration", "0.2", "--out"],
        ["capture", "import", "--sglang-metrics", str(FIX / "sglang-metrics")],
        ["report", str(SAMPLE), "--no-plots", "--quiet", "--out"],
        ["ingest", str(SAMPLE), "--out"],
    ],
)
def test_an_out_that_cannot_be_created_is_exit_2_everywhere(tmp_path, capsys, argv):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main([*argv, str(blocker / "out")]) == 2
    assert str(blocker) in one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------ report.md, collectives


def test_report_md_escapes_request_ids(tmp_path, capsys):
    rows = [json.loads(ln) for ln in (FIX / "requests.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        r["rid"] = f"[r{i}](javascript:alert(1))|<img src=x>_{i}"
    reqs = tmp_path / "r.jsonl"
    reqs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, err = _import(tmp_path, capsys, json.loads((FIX / "server_info.json").read_text()), reqs)
    assert rc == 0, err
    sim = tmp_path / "s"
    assert (
        main(["replay", str(tmp_path / "b"), "--out", str(sim), "--quiet", "--page-size", "16"])
        == 0
    )
    out = tmp_path / "rep"
    main(["report", str(tmp_path / "b"), str(sim), "--out", str(out), "--no-plots", "--quiet"])
    md = (out / "report.md").read_text()
    assert "Differing requests" in md
    assert not re.search(r"(?<!\\)\]\(javascript:", md) and not re.search(r"(?<!\\)<img", md)
    assert r"\[r" in md and r"\<img src=x\>" in md


def test_md_escape_leaves_plain_text_alone():
    from kvcadence.analysis.report import md_escape

    assert md_escape("l1-s0-t0") == "l1-s0-t0"
    assert md_escape("a|b\nc") == r"a\|b c"


def test_collectives_nccl_without_a_gpu_is_the_line_alone(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU box
    t0 = time.monotonic()
    assert main(["collectives", "--backend", "nccl", "--tokens", "16"]) == 2
    assert "needs CUDA" in one_error_line(capsys.readouterr().err)
    assert time.monotonic() - t0 < 30  # no torchrun launched


def test_admit_requests_nested_20000_deep_is_one_line_naming_the_line(tmp_path, capsys):
    f = tmp_path / "q.jsonl"
    f.write_text('{"rid": "a", "x": ' + "[" * DEEP + "]" * DEEP + "}\n")
    assert main(["admit", "--requests-jsonl", str(f), "--available-tokens", "9"]) == 2
    assert "q.jsonl:1: not valid JSON (nested deeper" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_a_sweep_refuses_non_finite_pass_times(tmp_path, capsys, value):
    argv = ["replay", str(SAMPLE), "--sweep", f"prefill_base_s={value},0.01", "--jobs", "1"]
    assert main([*argv, "--out", str(tmp_path / "sw"), "--quiet"]) == 2
    assert f"{value!r} is not a valid value" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "sw").exists()


# ------------------------------------------------------------------ found following the README


def _cut_in_half(tmp_path: Path) -> Path:
    """The sample with its segment file cut in half (a copy interrupted half-way)."""
    import shutil

    b = tmp_path / "cut.kvcb"
    shutil.copytree(SAMPLE, b)
    seg = b / "seg-000000.kvcb"
    data = seg.read_bytes()
    seg.write_bytes(data[: len(data) // 2])
    return b


def test_report_checks_every_bundle_before_any_work(tmp_path, capsys):
    """A mistyped second bundle fails at once (not after the first one's ingest) and no
    report directory is left."""
    out = tmp_path / "r"
    rc = main(["report", str(SAMPLE), str(tmp_path / "nope.kvcb"), "--out", str(out)])
    assert rc == 2
    line = one_error_line(capsys.readouterr().err)
    assert "nope.kvcb" in line and "not found" in line
    assert not out.exists()
    (tmp_path / "file").write_text("x")
    assert main(["report", str(SAMPLE), str(tmp_path / "file"), "--out", str(out)]) == 2
    assert "not a bundle directory" in one_error_line(capsys.readouterr().err)


def test_replay_of_a_cut_bundle_says_what_it_replays(tmp_path, capsys):
    """Half a capture replays (read around the damage) but never passes for the whole one:
    one warning line names the damage and the requests it could read; a whole bundle has none."""
    cut = _cut_in_half(tmp_path)
    assert main(["replay", str(cut), "--out", str(tmp_path / "s.kvcb"), "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("replay: warning: "), err
    assert "torn tail" in err[0] and "no clean end" in err[0]
    n = int(re.search(r"replaying the (\d+) requests", err[0]).group(1))  # type: ignore[union-attr]
    assert 0 < n < 120
    assert main(["replay", str(SAMPLE), "--out", str(tmp_path / "w.kvcb"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_capture_import_into_a_new_bundle_says_it_is_new(tmp_path, capsys):
    """`capture import` creates a missing bundle (documented); a mistyped capture name shows
    in its summary line instead of passing silently."""
    metrics = str(FIX / "sglang-metrics")
    assert main(["capture", "import", "--sglang-metrics", metrics, str(tmp_path / "n.kvcb")]) == 0
    assert "a new bundle: no KV events" in capsys.readouterr().err
    b = tmp_path / "b.kvcb"
    argv = ["import", "--frames", str(FIX / "events.jsonl"), "--out", str(b)]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["capture", "import", "--sglang-metrics", metrics, str(b)]) == 0
    err = capsys.readouterr().err
    assert "120 request records" in err and "new bundle" not in err


def test_an_interrupted_replay_output_is_removed_unless_complete(tmp_path, monkeypatch, capsys):
    """Ctrl-C half-way through a replay or sweep removes the output it began (a sweep
    dataset without its _sweep.json would read as a whole one): one line, exit 130. An
    output the command marked complete (a sim bundle written before --publish) is kept."""
    from kvcadence.replay import cli as replay_cli

    def half_then_interrupt(args: argparse.Namespace) -> int:
        part = Path(args.out) / "worker=x" / "job0000-0.parquet"
        part.parent.mkdir(parents=True)
        part.write_bytes(b"PAR1")
        args._out_complete = "complete" in args.out
        raise KeyboardInterrupt

    monkeypatch.setattr(replay_cli, "run", half_then_interrupt)
    out = tmp_path / "sweep"
    assert main(["replay", str(SAMPLE), "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvcadence: interrupted; the unfinished output {out} was removed"]
    assert not out.exists()
    kept = tmp_path / "complete"
    assert main(["replay", str(SAMPLE), "--out", str(kept)]) == 130
    assert capsys.readouterr().err.strip() == "kvcadence: interrupted"
    assert (kept / "worker=x" / "job0000-0.parquet").exists()


@pytest.mark.parametrize(
    "bundle",
    [SAMPLE, REPO / "tests" / "replay" / "data" / "sglang-0.5.23-dp2-agent-ps1"],
    ids=["one-rank", "dp2-fleet"],
)
def test_a_replay_into_a_closed_pipe_keeps_its_finished_output(tmp_path, bundle):
    """``kvcadence replay B --out X | head`` (the reader gone before the summary is printed):
    the sim bundle was written whole before the summary, so it stays, exit 0 -- it was
    removed as an "unfinished output" (exit 1) until 2026-12-04."""
    import subprocess
    import sys

    from kvcadence.format.bundle import BundleReader

    out = tmp_path / "sim"
    cmd = [sys.executable, "-m", "kvcadence", "replay", str(bundle), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone: every print to stdout is EPIPE
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait() == 0, err
    assert "removed" not in err
    sims = [out] if (out / "seg-000000.kvcb").exists() else sorted(out.iterdir())
    assert sims and all(len(BundleReader(s).requests()) > 0 for s in sims)


def test_replay_takes_sigterm_as_ctrl_c():
    """SIGTERM (kill, a job scheduler) during a replay raises KeyboardInterrupt, so the
    output is cleaned up as on Ctrl-C instead of the process dying mid-write; the previous
    handler is back afterwards."""
    import os
    import signal

    from kvcadence.outguard import term_as_interrupt

    before = signal.getsignal(signal.SIGTERM)

    def killed(args: argparse.Namespace) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        return 0

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        term_as_interrupt(killed)(argparse.Namespace())
    assert time.monotonic() - t0 < 4
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_bundle_directory_the_file_system_refuses_is_exit_2(tmp_path, monkeypatch, capsys):
    """mkdir refused even though the up-front check passed (root on /sys: os.access says
    yes): one line naming the path, exit 2 (it was exit 1 as a 'bundle error')."""
    import errno

    real_mkdir = Path.mkdir

    def refuse(self: Path, *a: object, **k: object) -> None:
        if self.name == "x.kvcb":
            raise PermissionError(errno.EPERM, "Operation not permitted", str(self))
        real_mkdir(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", refuse)
    assert main(["replay", str(SAMPLE), "--out", str(tmp_path / "x.kvcb"), "--quiet"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "x.kvcb: cannot create the bundle directory (Operation not permitted)" in line


SEG = SAMPLE / "seg-000000.kvcb"


@pytest.mark.parametrize(
    "argv",
    [
        ["import", "--frames", str(SAMPLE), "--out"],
        ["import", "--frames", str(SEG), "--out"],
        ["import", "--frames", str(FIX / "events.jsonl"), "--requests", str(SAMPLE), "--out"],
        ["replay", "--trace", str(SEG), "--page-size", "1", "--max-total-tokens", "99", "--out"],
        ["admit", "--requests-jsonl", str(SAMPLE), "--available-tokens", "99", "--out"],
        ["admit", "--requests-jsonl", str(SEG), "--available-tokens", "99", "--out"],
    ],
)
def test_a_bundle_where_jsonl_is_expected_is_named_a_bundle(tmp_path, capsys, argv):
    """A bundle (or one of its segment files) given for a JSONL input: one line that says it
    is a bundle, not 'Is a directory' or a JSON/UTF-8 decoding error at byte 0."""
    assert main([*argv, str(tmp_path / "o")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "a kvcadence bundle" in line and "not a" in line, line
    assert not (tmp_path / "o").exists()


def test_import_names_the_out_it_was_given_when_the_file_system_refuses(
    tmp_path, monkeypatch, capsys
):
    """`import` writes into a hidden staging directory; when even that cannot be made (root
    on /sys), the one line names the --out the user gave, not the hidden name, exit 2."""
    import errno

    real_mkdir = Path.mkdir

    def refuse(self: Path, *a: object, **k: object) -> None:
        if self.name.startswith(".y.kvcb.partial"):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(self))
        real_mkdir(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", refuse)
    out = tmp_path / "y.kvcb"
    assert main(["import", "--frames", str(FIX / "events.jsonl"), "--out", str(out)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert (
        line
        == f"kvcadence: error: {out}: cannot create the bundle directory (Operation not permitted)"
    )
    assert not out.exists() and not list(tmp_path.iterdir())
