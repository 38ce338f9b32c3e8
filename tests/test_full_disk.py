"""A full disk and a read-only bundle, for real: a small tmpfs (or a read-only bind mount)
in a private user+mount namespace (``unshare -rm``, no root needed). Every command fails in
one line and leaves nothing half-written behind: no truncated ``--out`` file, no
``.parquet.tmp-PID`` directory, no partial sim bundle or sweep directory. A read-only bundle
still answers ``sql`` and ``report`` (the Parquet cache goes to a private temp directory)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "examples" / "sglang-0.5.23-agent-ps1.kvcb"


def _unshare_ok() -> bool:
    if sys.platform != "linux" or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(
    not _unshare_ok(), reason="unprivileged mount namespaces (unshare -rm) are not available"
)


def _kv(*argv: str) -> str:
    return " ".join(shlex.quote(a) for a in [sys.executable, "-m", "kvcadence", *argv])


def _in_namespace(setup: str, cmd: str, listing: Path) -> tuple[int, str]:
    """Run ``setup`` then ``cmd`` in a private mount namespace; ``listing`` gets every path
    left under the mount (``find``) before the namespace goes away."""
    script = f"{setup} || exit 99; {cmd}; rc=$?; find {shlex.quote(str(listing.parent / 'mnt'))} -mindepth 1 > {shlex.quote(str(listing))}; exit $rc"
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "TMPDIR": str(listing.parent)}
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode != 99, proc.stderr
    return proc.returncode, proc.stderr


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("  job ")]
    assert len(lines) == 1 and lines[0].startswith("kvcadence: error: "), err
    assert "Traceback" not in err
    return lines[0]


FULL_CASES = {
    "sql-csv": ("sql", str(SAMPLE), "SELECT * FROM events", "--format", "csv", "--out", "M/x.csv"),
    "sql-parquet": ("sql", str(SAMPLE), "SELECT * FROM blocks", "--format", "parquet", "--out", "M/x.pq"),
    "sql-cache": ("sql", str(SAMPLE), "SELECT 1", "--cache", "M/cache"),
    "ingest-out": ("ingest", str(SAMPLE), "--out", "M/cache"),
    "replay": ("replay", str(SAMPLE), "--quiet", "--out", "M/sim"),
    "sweep": ("replay", str(SAMPLE), "--quiet", "--sweep", "page-size=1,2", "--jobs", "1", "--out", "M/sw"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(FULL_CASES))
def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path, case):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    # only an argument that starts with the placeholder (a clone in ``/tmp/ci.A0yM``
    # holds ``M/`` in the sample's own path)
    argv = [f"{mnt}/{a[2:]}" if a.startswith("M/") else a for a in FULL_CASES[case]]
    # a copy of the sample: ``sql`` caches its tables next to the bundle (``.parquet``),
    # which must not land in the repository's examples/
    src = tmp_path / "sample.kvcb"
    shutil.copytree(SAMPLE, src, ignore=shutil.ignore_patterns(".parquet"))
    argv = [str(src) if a == str(SAMPLE) else a for a in argv]
    size = "4k" if case == "sql-csv" else "16k"
    listing = tmp_path / "left.txt"
    rc, err = _in_namespace(f"mount -t tmpfs -o size={size} tmpfs {mnt}", _kv(*argv), listing)
    assert rc == 1, err
    line = _one_line(err)
    assert "No space left on device" in line or "disk full" in line, line
    left = listing.read_text().split()
    assert left == [], f"left behind on the full disk: {left}"


def test_a_read_only_bundle_answers_sql_and_report_from_a_private_cache(tmp_path):
    b = tmp_path / "ro.kvcb"
    shutil.copytree(SAMPLE, b, ignore=shutil.ignore_patterns(".parquet"))
    (tmp_path / "mnt").mkdir()  # (listed, stays empty)
    setup = f"mount --bind {b} {b} && mount -o remount,ro,bind {b}"
    cmd = _kv("sql", str(b), "SELECT count(*) AS n FROM events", "--format", "csv")
    cmd += " && " + _kv("report", str(b), "--out", str(tmp_path / "rep"), "--no-plots", "--quiet")
    rc, err = _in_namespace(setup, cmd, tmp_path / "left.txt")
    assert rc == 0, err
    assert not (b / ".parquet").exists()
    assert (tmp_path / "rep" / "report.md").exists()


def test_a_read_only_bundle_without_a_usable_temp_dir_names_the_cache_flag(tmp_path):
    b = tmp_path / "ro.kvcb"
    shutil.copytree(SAMPLE, b, ignore=shutil.ignore_patterns(".parquet"))
    (tmp_path / "mnt").mkdir()
    setup = f"mount --bind {b} {b} && mount -o remount,ro,bind {b}"
    code = (  # no private temp cache either (another user's temp dir, say)
        "import sys; import kvcadence.analysis.cachedir as c; c.fallback_cache = lambda b: None; "
        f"from kvcadence.cli import main; sys.exit(main(['sql', {str(b)!r}, 'SELECT 1']))"
    )
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, "-c", code])
    rc, err = _in_namespace(setup, cmd, tmp_path / "left.txt")
    assert rc == 2, err
    line = _one_line(err)
    assert "--cache DIR" in line and "Read-only file system" in line
