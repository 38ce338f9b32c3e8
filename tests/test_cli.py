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

    def parse_known_args(self, argv: object) -> tuple[object, list[str]]:
        return self.parse_args(argv), []


# --- help on every flag, an example in every command's help ----------------------------------


def _example_commands(epilog: str) -> list[list[str]]:
    """The ``kvcadence ...`` command lines of an epilog's examples (continuations joined)."""
    import shlex

    text = epilog.replace("\\\n", " ")
    return [
        shlex.split(line.split(" | ")[0], comments=True)  # the kvcadence part of a pipeline
        for line in text.splitlines()
        if line.strip().startswith("kvcadence ")
    ]


def test_every_flag_has_help_and_every_command_an_example_that_parses() -> None:
    """Walks the whole argparse tree: a flag (or positional) without help text, or a command
    whose --help shows no example of itself, fails here; so does an example that no longer
    parses (a renamed or removed flag)."""
    import argparse

    from kvcadence.analysis import compare
    from kvcadence.capture.workloads import parse_spec, workload_keys
    from kvcadence.errors import UsageError

    parser = cli.build_parser()
    missing: list[str] = []
    checked = 0
    for path, p in cli.walk_parsers(parser):
        where = " ".join(path)
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            if isinstance(action, argparse._SubParsersAction):
                continue
            checked += 1
            if not action.help or action.help == argparse.SUPPRESS or len(action.help) < 8:
                missing.append(f"{where} {'/'.join(action.option_strings) or action.dest}: no help")
        commands = _example_commands(p.epilog or "")
        if not (p.epilog or "").startswith("examples:") or not any(
            argv[: len(path)] == list(path) for argv in commands
        ):
            missing.append(f"{where}: no example of itself in its epilog")
        for argv in commands:
            if "--help" in argv or "COMMAND" in argv:
                continue
            try:
                parsed = cli.build_parser().parse_args(argv[1:])
            except SystemExit:
                missing.append(f"{where}: example does not parse: {' '.join(argv)}")
                continue
            spec = getattr(parsed, "workload", None)  # drive: a real kind and real keys
            if spec and not spec.startswith("@"):
                kind, params = parse_spec(spec)
                valid = {k for k, _ in workload_keys().get(kind, [])}
                if not valid or set(params) - valid:
                    missing.append(f"{where}: example workload {spec!r} has unknown keys")
            for gate in getattr(parsed, "gate", None) or []:  # report: a real metric, too
                try:
                    compare.parse_gate(gate)
                except UsageError as exc:
                    missing.append(f"{where}: example gate: {exc}")
    assert checked > 150  # the walk really saw every command's flags
    assert not missing, "\n".join(missing)


def test_help_shows_the_exit_code_table_that_the_readme_repeats(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvcadence.errors import EXIT_CODES, GateFailed, NothingCaptured, UsageError

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    codes = {code for code, _ in EXIT_CODES}
    assert {0, 1, 2, 3, 4, 130} == codes
    assert {UsageError.exit_code, GateFailed.exit_code, NothingCaptured.exit_code} <= codes
    for code, text in EXIT_CODES:
        assert f"  {code:<4} {text}" in out  # kept on one line by the help formatter
        assert f"| {code} | {text} |" in readme, code


def test_help_formatter_fills_prose_and_keeps_examples() -> None:
    fmt = cli.HelpFormatter("prog")
    text = "one two three four five six seven\n\nexamples:\n  kvcadence x --a 1\n  kvcadence y"
    out = fmt._fill_text(text, 20, "")
    assert out.splitlines()[:2] == ["one two three four", "five six seven"]
    assert out.endswith("examples:\n  kvcadence x --a 1\n  kvcadence y")


def test_drive_with_an_unknown_workload_key_lists_the_valid_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "b"
    argv = ["drive", "--server", "http://127.0.0.1:1", "--workload", "agent:lane=4", "--out"]
    assert cli.main([*argv, str(out)]) == 2  # refused before the server is contacted
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "unknown key 'lane' (did you mean lanes?); valid keys: lanes, requests, seed" in err
    assert not out.exists()


@pytest.mark.parametrize("stage", ["capture", "replay", "admit", "analysis", "harness"])
def test_a_stage_entry_point_names_itself_and_only_its_commands(stage: str) -> None:
    """``python -m kvcadence.<stage> --help``: the usage line is that command line, and the
    examples name no command the stage does not have (they used to offer demo/report)."""
    from kvcadence.cli import build_parser

    text = build_parser(stages=(stage,)).format_help()
    assert text.startswith(f"usage: python -m kvcadence.{stage} ")
    examples = text.split("examples:", 1)[1].split("exit codes:", 1)[0]
    assert f"python -m kvcadence.{stage} COMMAND --help" in examples
    assert "kvcadence demo" not in examples and "kvcadence report" not in examples
    assert build_parser().format_help().startswith("usage: kvcadence ")


@pytest.mark.parametrize(
    ("argv", "needle", "helps"),
    [
        (["frobnicate"], "invalid choice: 'frobnicate'", "kvcadence --help"),
        (["replay", "x.kvcb", "--nope"], "unrecognized arguments: --nope", "kvcadence replay"),
        (["sql", "x.kvcb"], "required: query", "kvcadence sql --help"),
        (["capture", "import"], "required: BUNDLE", "kvcadence capture import --help"),
        (["report", "x.kvcb", "--out", "r", "--window"], "--window", "kvcadence report"),
    ],
)
def test_a_usage_error_is_one_line_naming_the_commands_help(
    argv: list[str], needle: str, helps: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse's own errors follow the project's shape: one ``kvcadence: error:`` line (no
    usage block; an unknown flag of a subcommand names that subcommand's --help), exit 2."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvcadence: error: "), err
    assert needle in err and helps in err, err
