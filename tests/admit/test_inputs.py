"""``kvcadence admit`` inputs (grid, requests JSONL, bundle) and the command line end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcadence.admit.inputs import (
    parse_int_list,
    parse_request_lines,
    read_requests_jsonl,
    requests_from_bundle,
    synthetic_grid,
)
from kvcadence.admit.ticks import QueuedRequest
from kvcadence.cli import main
from kvcadence.errors import InputError, UsageError

GRID_ARGS = [
    "admit",
    "--synthetic-grid",
    "--l1-cached-tokens",
    "0,4096",
    "--l2-cached-tokens",
    "0,4096",
    "--extend-tokens",
    "128,2048",
    "--available-tokens",
    "20000",
    "--max-prefill-tokens",
    "16384",
    "--cp-max-total-extend-tokens",
    "65536",
    "--cp-max-batch-requests",
    "8",
]


def test_grid_is_the_cartesian_product_repeated():
    specs = synthetic_grid([0, 4096], [0, 64], [128, 2048, 7], repeat=2, max_new_tokens=3)
    assert len(specs) == 2 * 2 * 3 * 2
    assert specs[0] == QueuedRequest("g0", 0, 0, 128, 3)
    assert specs[5] == QueuedRequest("g5", 0, 64, 7, 3)
    assert specs[12].rid == "g12" and (specs[12].l1, specs[12].l2, specs[12].extend) == (0, 0, 128)
    assert len({s.rid for s in specs}) == len(specs)


def test_int_list_errors_name_the_flag():
    assert parse_int_list("0, 4096,", "--x") == [0, 4096]
    with pytest.raises(UsageError, match="--l1-cached-tokens: 'a' is not an integer"):
        parse_int_list("0,a", "--l1-cached-tokens")
    with pytest.raises(UsageError, match="negative"):
        parse_int_list("-1", "--x")


def test_requests_jsonl_parses_optional_fields():
    lines = [
        '{"rid":"r0","l1_cached_tokens":40320,"l2_cached_tokens":0,"extend_tokens":128}',
        "",
        '{"l1_cached_tokens":0,"l2_cached_tokens":64,"extend_tokens":1,"max_new_tokens":7,'
        '"priority":2}',
    ]
    a, b = parse_request_lines(lines, "q.jsonl", max_new_tokens=99)
    assert a == QueuedRequest("r0", 40320, 0, 128, 99)
    assert b == QueuedRequest("r1", 0, 64, 1, 7, 2)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "q.jsonl:2: not valid JSON"),
        ("[1,2]", "q.jsonl:2: expected a JSON object"),
        ('{"l1_cached_tokens":0,"extend_tokens":5}', "q.jsonl:2: missing field 'l2_cached_tokens'"),
        (
            '{"l1_cached_tokens":"5","l2_cached_tokens":0,"extend_tokens":5}',
            "q.jsonl:2: field 'l1_cached_tokens' must be an integer",
        ),
        (
            '{"l1_cached_tokens":0,"l2_cached_tokens":-1,"extend_tokens":5}',
            "q.jsonl:2: field 'l2_cached_tokens' must be >= 0",
        ),
        (
            '{"l1_cached_tokens":0,"l2_cached_tokens":0,"extend_tokens":0}',
            "q.jsonl:2: field 'extend_tokens' must be >= 1",
        ),
        (
            '{"l1_cached_tokens":0,"l2_cached_tokens":0,"extend_tokens":true}',
            "q.jsonl:2: field 'extend_tokens' must be an integer",
        ),
        (
            '{"rid":"a","l1_cached_tokens":0,"l2_cached_tokens":0,"extend_tokens":1}',
            "q.jsonl:2: field 'rid' 'a' repeats line 1",
        ),
        (
            '{"rid":"b","l1_cached_tokens":0,"l2_cached_tokens":0,"extend_tokens":1,"x":1}',
            "q.jsonl:2: unknown field 'x'",
        ),
        (
            '{"rid":5,"l1_cached_tokens":0,"l2_cached_tokens":0,"extend_tokens":1}',
            "q.jsonl:2: field 'rid' must be a non-empty string",
        ),
    ],
)
def test_bad_request_lines_name_line_and_field(line, message):
    good = '{"rid":"a","l1_cached_tokens":0,"l2_cached_tokens":0,"extend_tokens":1}'
    with pytest.raises(InputError) as info:
        parse_request_lines([good, line], "q.jsonl")
    assert str(info.value).startswith(message)


def test_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        read_requests_jsonl(tmp_path / "nope.jsonl")


# --- the command line ----------------------------------------------------------------------


def test_cli_grid_text(capsys):
    assert main([*GRID_ARGS, "--output", "text"]) == 0
    out = capsys.readouterr().out
    assert "stopped_result" in out and "ticks stopped by:" in out
    assert "NO_TOKEN" in out and "not end-to-end latency" in out


def test_cli_json_document(capsys):
    assert main([*GRID_ARGS, "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["requests"] == 8
    t0 = doc["ticks"][0]
    for key in (
        "accepted",
        "stopped_on_rid",
        "stopped_result",
        "log_hit_tokens",
        "log_input_tokens",
        "cp_total_extend_tokens",
        "cp_total_cached_tokens",
        "allocator_available_after_tick",
        "load_back_events",
        "duration_us",
    ):
        assert key in t0
    assert set(t0["accepted"][0]) >= {"rid", "l1", "l2", "extend", "loaded"}
    assert doc["config"]["cp_max_batch_requests"] == 8


def test_cli_jsonl_one_line_per_tick(tmp_path):
    out = tmp_path / "ticks.jsonl"
    assert main([*GRID_ARGS, "--output", "jsonl", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    ticks = [json.loads(line) for line in lines]
    assert [t["tick"] for t in ticks] == list(range(len(ticks)))


def test_cli_requests_jsonl(tmp_path, capsys):
    q = tmp_path / "requests.jsonl"
    q.write_text(
        '{"rid":"r0","l1_cached_tokens":40320,"l2_cached_tokens":0,"extend_tokens":128}\n'
        '{"rid":"r1","l1_cached_tokens":0,"l2_cached_tokens":40320,"extend_tokens":128}\n'
    )
    argv = [
        "admit",
        "--requests-jsonl",
        str(q),
        "--available-tokens",
        "200000",
        "--cp-max-total-extend-tokens",
        "65536",
        "--cp-max-total-cached-tokens",
        "65536",
        "--output",
        "json",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    t0 = doc["ticks"][0]
    assert [a["rid"] for a in t0["accepted"]] == ["r0"]
    assert t0["stopped_result"] == "OTHER:cp_total_cached" and t0["stopped_on_rid"] == "r1"


def test_cli_bad_line_exits_2_naming_line_and_field(tmp_path, capsys):
    q = tmp_path / "requests.jsonl"
    q.write_text(
        '{"rid":"r0","l1_cached_tokens":0,"l2_cached_tokens":0,"extend_tokens":1}\n'
        '{"rid":"r1","l1_cached_tokens":0,"l2_cached_tokens":0}\n'
    )
    assert main(["admit", "--requests-jsonl", str(q), "--available-tokens", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvcadence: error: {q}:2: missing field 'extend_tokens'"]


def test_cli_usage_errors_exit_2(capsys):
    assert (
        main(["admit", "--synthetic-grid", "--l1-cached-tokens", "x", "--available-tokens", "10"])
        == 2
    )
    assert "--l1-cached-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # argparse: a source is required
        main(["admit", "--available-tokens", "10"])
    assert info.value.code == 2


def test_help_labels_cp_limits_as_kvcadence_model():
    proc = subprocess.run(
        [sys.executable, "-m", "kvcadence", "admit", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    text = " ".join(proc.stdout.split())
    assert "kvcadence's model of the CP shared-KV branch's scheduler rules" in text
    assert "NOT upstream SGLang" in text


def test_cli_module_imports_only_stdlib():
    code = (
        "import sys, kvcadence.admit.cli; "
        "heavy = {'zmq','polars','duckdb','pyarrow','matplotlib','torch','httpx','msgspec'}; "
        "print(sorted(heavy & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- bundle input ---------------------------------------------------------------------------


def _write_bundle(path: Path, records, server_info: dict | None = None) -> None:
    from kvcadence.format.bundle import BundleWriter
    from kvcadence.format.schema import Header

    header = Header(format_major=0, format_minor=0, source="real", kvcadence_version="test")
    header.server_info = server_info or {}
    with BundleWriter(path, header) as w:
        for rec in records:
            w.write(rec)


def test_bundle_requests_give_cached_tokens_at_admission(tmp_path, capsys):
    from kvcadence.format.schema import RequestRecord

    recs = [
        RequestRecord(
            rid="late",
            input_ids=[1] * 300,
            send_ns=20,
            prompt_tokens=300,
            cached_tokens=256,
            max_new_tokens=4,
        ),
        RequestRecord(
            rid="early",
            input_ids=[1] * 200,
            send_ns=10,
            prompt_tokens=200,
            cached_tokens=0,
            max_new_tokens=8,
        ),
        RequestRecord(
            rid="hicache",
            input_ids=[1] * 500,
            send_ns=30,
            prompt_tokens=500,
            cached_tokens=448,
            meta_info={"cached_tokens_details": {"device": 128, "host": 320}},
        ),
        RequestRecord(
            rid="full", input_ids=[1] * 64, send_ns=40, prompt_tokens=64, cached_tokens=64
        ),
    ]
    b = tmp_path / "bundle"
    _write_bundle(b, recs)
    specs = requests_from_bundle(b)
    assert [s.rid for s in specs] == ["early", "late", "hicache", "full"]  # arrival order
    assert specs[0] == QueuedRequest("early", 0, 0, 200, 8)
    assert specs[1] == QueuedRequest("late", 256, 0, 44, 4)
    assert (specs[2].l1, specs[2].l2, specs[2].extend) == (128, 320, 52)
    assert (specs[3].l1, specs[3].extend) == (63, 1)  # at least one token is computed
    assert (
        main(
            [
                "admit",
                "--bundle",
                str(b),
                "--available-tokens",
                "5000",
                "--page-size",
                "1",
                "--output",
                "json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["admitted_requests"] == 4


def test_bundle_request_without_cached_tokens_is_an_input_error(tmp_path):
    from kvcadence.format.schema import RequestRecord

    b = tmp_path / "bundle"
    _write_bundle(b, [RequestRecord(rid="x", input_ids=[1, 2, 3])])
    with pytest.raises(InputError, match="request 'x': field 'cached_tokens' is missing"):
        requests_from_bundle(b)


def test_missing_bundle_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such bundle"):
        requests_from_bundle(tmp_path / "nope")


def _admit_json(capsys, argv: list[str]) -> dict:
    assert main(["admit", *argv, "--output", "json"]) == 0
    return json.loads(capsys.readouterr().out)["config"]


def test_bundle_budgets_come_from_its_server_info_and_flags_override(tmp_path, capsys):
    from kvcadence.format.schema import RequestRecord

    recs = [
        RequestRecord(rid=f"r{i}", input_ids=[1] * 300, send_ns=i, prompt_tokens=300,
                      cached_tokens=0, max_new_tokens=4)
        for i in range(3)
    ]  # fmt: skip
    info = {
        "page_size": 1,
        "chunked_prefill_size": 4096,
        "max_prefill_tokens": 8000,
        "max_running_requests": None,
        "internal_states": [{"max_total_num_tokens": 2000}],
    }
    b = tmp_path / "b"
    _write_bundle(b, recs, info)
    cfg = _admit_json(capsys, ["--bundle", str(b)])
    assert (cfg["page_size"], cfg["chunked_prefill_size"]) == (1, 4096)
    assert (cfg["available_tokens"], cfg["max_prefill_tokens"]) == (2000, 8000)
    assert cfg["max_running_requests"] is None  # not recorded: admit's own default
    argv = ["--bundle", str(b), "--page-size", "16", "--available-tokens", "500"]
    cfg = _admit_json(capsys, argv + ["--chunked-prefill-size", "256"])
    assert (cfg["page_size"], cfg["available_tokens"], cfg["chunked_prefill_size"]) == (
        16,
        500,
        256,
    )
    assert cfg["max_prefill_tokens"] == 8000  # the flags override only what they name
    # the text output says where each setting came from
    assert main(["admit", "--bundle", str(b), "--page-size", "16"]) == 0
    err = capsys.readouterr().err
    assert "page 16 (flag), chunk 4096 (bundle), pool 2000 (bundle)" in err
    # a worker that ran without chunked prefill: chunking off, not admit's 8192
    nochunk = tmp_path / "nochunk"
    _write_bundle(nochunk, recs, {**info, "chunked_prefill_size": None})
    assert _admit_json(capsys, ["--bundle", str(nochunk)])["chunked_prefill_size"] is None


def test_bundle_without_a_pool_needs_available_tokens(tmp_path, capsys):
    from kvcadence.format.schema import RequestRecord

    b = tmp_path / "b"
    _write_bundle(b, [RequestRecord(rid="x", input_ids=[1] * 8, prompt_tokens=8, cached_tokens=0)])
    assert main(["admit", "--bundle", str(b)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvcadence: error: admit needs --available-tokens N ({b} records no KV pool "
                   "(max_total_num_tokens))"]  # fmt: skip
    cfg = _admit_json(capsys, ["--bundle", str(b), "--available-tokens", "100"])
    assert (cfg["available_tokens"], cfg["page_size"], cfg["chunked_prefill_size"]) == (
        100,
        64,
        8192,
    )
    assert main(["admit", "--synthetic-grid"]) == 2
    assert "admit needs --available-tokens N (no --bundle)" in capsys.readouterr().err
