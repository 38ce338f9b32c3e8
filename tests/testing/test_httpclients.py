"""``python -m kvcadence.testing.httpclients`` (the plain HTTP clients' recording entry
point) on bad input: one line, an exit code from the exception tree, no bundle."""

from __future__ import annotations

import socket

import pytest

from kvcadence.testing.httpclients import main


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: nothing listens there


def test_out_without_metrics_dir_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--server", "http://127.0.0.1:1", "--out", str(tmp_path / "b")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--out needs --sglang-metrics" in err[-1]
    assert not (tmp_path / "b").exists()


def test_unreachable_worker_is_one_line_not_a_traceback(tmp_path, capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    out = tmp_path / "b"
    rc = main(["--server", url, "--out", str(out), "--sglang-metrics", str(tmp_path / "m")])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m kvcadence.testing.httpclients: error: capture did not")
    assert "Traceback" not in "\n".join(err) and "cannot reach" in err[-1]
