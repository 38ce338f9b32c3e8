"""``kvcadence import`` reads a requests JSONL as a stream (``importer.RequestLog``).

* the records, think times included, are those of the whole-file read for any lanes,
  times and given think times;
* a file that changes between the validating pass and the writing pass is one error line,
  and a new import then leaves nothing behind;
* a duplicate rid names both lines, before anything is written.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.capture import importer
from kvcadence.capture.think import think_times
from kvcadence.cli import main
from kvcadence.errors import InputError
from kvcadence.format.jsonl import jsonl_lines, parse_request_line
from tests.test_hostile_inputs import one_error_line


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _whole(path: Path) -> list:
    """The records as a whole-file read derives them (every record in a list)."""
    recs = [parse_request_line(obj, where) for where, obj in jsonl_lines(path, "requests")]
    derived = think_times([(r.lane, r.send_ns, r.finish_ns) for r in recs])
    return [
        r if r.think_ns is not None or t is None else msgspec.structs.replace(r, think_ns=t)
        for r, t in zip(recs, derived, strict=True)
    ]


_ROW = st.fixed_dictionaries(
    {
        "lane": st.none() | st.integers(0, 3),
        "send_ns": st.none() | st.integers(0, 10_000),
        "dur": st.none() | st.integers(0, 3_000),
        "think_ns": st.none() | st.integers(0, 50),
    }
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_ROW, max_size=25))
def test_streamed_records_are_the_whole_file_records(rows):
    lines = []
    for i, r in enumerate(rows):
        line = {"rid": f"r{i}", "input_ids": [i, i + 1], "output_ids": [7]}
        if r["lane"] is not None:
            line["lane"] = r["lane"]
        if r["send_ns"] is not None:
            line["send_ns"] = r["send_ns"]
            if r["dur"] is not None:
                line["finish_ns"] = r["send_ns"] + r["dur"]
        if r["think_ns"] is not None:
            line["think_ns"] = r["think_ns"]
        lines.append(line)
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp) / "r.jsonl", lines)
        log = importer.read_requests(path)
        sends = [r["send_ns"] for r in rows if r["send_ns"] is not None]
        assert len(log) == len(rows) and log.first_send_ns == (min(sends) if sends else None)
        assert list(log) == _whole(path) and list(log) == _whole(path)  # any number of passes


def test_a_file_changed_between_the_passes_is_one_line_and_leaves_nothing(
    tmp_path, capsys, monkeypatch
):
    frames = _write(tmp_path / "f.jsonl", [])
    reqs = _write(tmp_path / "r.jsonl", [{"rid": f"r{i}", "input_ids": [i]} for i in range(4)])
    real = importer.RequestLog.__init__

    def then_change(self, path):
        real(self, path)
        _write(path, [{"rid": "other", "input_ids": [1]}])

    monkeypatch.setattr(importer.RequestLog, "__init__", then_change)
    out = tmp_path / "out"
    argv = ["import", "--frames", str(frames), "--requests", str(reqs), "--out", str(out)]
    assert main(argv) == 2
    assert "changed while it was being imported" in one_error_line(capsys.readouterr().err)
    assert not out.exists()


def test_a_duplicate_rid_names_both_lines(tmp_path):
    path = _write(
        tmp_path / "r.jsonl",
        [
            {"rid": "a", "input_ids": [1]},
            {"rid": "b", "input_ids": [2]},
            {"rid": "a", "input_ids": [3]},
        ],
    )
    with pytest.raises(
        InputError, match=r"r\.jsonl:3: field `rid`: 'a' is already the rid of .*r\.jsonl:1"
    ):
        importer.read_requests(path)
