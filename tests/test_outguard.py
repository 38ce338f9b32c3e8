"""The one overwrite guard: single-file --out never replaces a file without
--force and never writes inside a bundle directory; directory outputs refuse non-empty ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcadence import progress
from kvcadence.cli import main
from kvcadence.format.bundle import BundleReader, copy_bundle, list_segments
from kvcadence.outguard import enclosing_bundle

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sglang-0.5.23-agent-ps1.kvcb"


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    b = tmp_path / "B"
    copy_bundle(SAMPLE, b)
    return b


def _one_line(capsys, rc: int, *needles: str) -> None:
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("kvcadence: error:"), err
    for n in needles:
        assert n in err, err


def _snapshot(b: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in list_segments(b)}


@pytest.mark.parametrize(
    "argv",
    [
        ["prefixes", "{B}", "--out", "{B}/seg-000000.kvcb", "--force"],
        ["prefixes", "{B}", "--out", "{B}/prefixes.json"],
        ["sql", "{B}", "SELECT 1 AS x", "--out", "{B}/seg-000000.kvcb", "--force"],
        ["sql", "{B}", "SELECT 1 AS x", "--format", "csv", "--out", "{B}/sub/x.csv"],
        [
            "admit",
            "--bundle",
            "{B}",
            "--available-tokens",
            "100000",
            "--out",
            "{B}/seg-000000.kvcb",
            "--force",
        ],
        ["report", "{B}", "--out", "{B}", "--no-plots"],
        ["replay", "{B}", "--out", "{B}/sim"],
    ],
)
def test_never_writes_inside_a_bundle(bundle: Path, capsys, monkeypatch, argv: list[str]) -> None:
    # every phase line is said at once: a command that reads its input before refusing the
    # output would print one (a slow, loaded box did so for `replay`)
    monkeypatch.setattr(progress, "SAY_AFTER_S", 0.0)
    before = _snapshot(bundle)
    rc = main([a.replace("{B}", str(bundle)) for a in argv])
    _one_line(capsys, rc, "inside the bundle directory", "refusing to write into a bundle")
    assert _snapshot(bundle) == before
    assert sorted(p.name for p in bundle.iterdir()) == sorted(before)  # nothing added
    assert len(list(BundleReader(bundle).events())) > 0


def test_through_a_symlink_too(bundle: Path, tmp_path: Path, capsys) -> None:
    link = tmp_path / "link"
    link.symlink_to(bundle)
    assert enclosing_bundle(link / "seg-000000.kvcb") == bundle.resolve()
    rc = main(["prefixes", str(bundle), "--out", str(link / "seg-000000.kvcb"), "--force"])
    _one_line(capsys, rc, "inside the bundle directory")


@pytest.mark.parametrize(
    "argv",
    [
        ["prefixes", "{B}", "--out", "{F}"],
        ["sql", "{B}", "SELECT 1 AS x", "--format", "csv", "--out", "{F}"],
        [
            "admit",
            "--bundle",
            "{B}",
            "--available-tokens",
            "100000",
            "--output",
            "json",
            "--out",
            "{F}",
        ],
    ],
)
def test_existing_file_needs_force(bundle: Path, tmp_path: Path, capsys, argv) -> None:
    f = tmp_path / "out.txt"
    f.write_text("keep me")
    args = [a.replace("{B}", str(bundle)).replace("{F}", str(f)) for a in argv]
    rc = main(args)
    _one_line(capsys, rc, "already exists; refusing to overwrite it", "--force")
    assert f.read_text() == "keep me"
    assert main([*args, "--force"]) == 0
    capsys.readouterr()
    assert f.read_text() != "keep me" and f.stat().st_size > 0


def test_new_file_needs_no_force(bundle: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "p.json"
    assert main(["prefixes", str(bundle), "--out", str(out)]) == 0
    assert out.stat().st_size > 0
