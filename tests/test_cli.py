"""The top-level CLI: error lines and exit codes that every command shares."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvcadence import cli

SAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sglang-0.5.23-agent-ps1.kvcb"


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "capture" in capsys.readouterr().out


def test_help_lists_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in (
        "inspect",
        "import",
        "capture",
        "drive",
        "replay",
        "admit",
        "report",
        "sql",
        "prefixes",
        "collectives",
        "demo",
    ):
        assert f"    {command}" in out, command


def test_unwritable_output_path_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tmp_path / "b.kvcb"
    shutil.copytree(SAMPLE, bundle)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    rc = cli.main(["ingest", str(bundle), "--out", str(blocker / "sub")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("kvcadence: error: ")
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_os_error_without_a_path_is_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom(args: object) -> int:
        raise OSError(28, "No space left on device")

    parser = cli.build_parser()
    args = parser.parse_args(["inspect", "x"])
    monkeypatch.setattr(cli, "build_parser", lambda stages=None: _Fixed(args, boom))
    assert cli.main(["inspect", "x"]) == 1
    assert capsys.readouterr().err.strip() == "kvcadence: error: No space left on device"


class _Fixed:
    def __init__(self, args: object, run: object) -> None:
        self.args, self.run = args, run

    def parse_args(self, argv: object) -> object:
        self.args._run = self.run  # type: ignore[attr-defined]
        return self.args
