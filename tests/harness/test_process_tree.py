"""The harness stops every process a worker start created, on every path -- without SGLang.

``fake_worker.py`` stands in for ``sglang.launch_server`` (a launcher, two "DP scheduler"
children, one of them ignoring SIGTERM, and a grandchild that left the process group); it is
started through ``harness start`` / ``start_server`` themselves (only the venv, the model and
the command line are replaced). Checked:

* ready timeout (``--ready-timeout 2``): exit 1, one error line naming ``--ready-timeout``, and
  no process of the tree alive afterwards (by pid);
* the worker exits before it is ready: exit 1 at once (no waiting for the timeout), the
  worker's last log line in the error, no process left;
* SIGTERM or Ctrl-C (SIGINT) of the ``harness start`` process while it waits: exit 130, no
  process left;
* a worker that did come up: ``harness stop`` stops its whole tree, SIGTERM-deaf child too;
* ``--ready-timeout`` refuses 0 / nan before anything starts; its default is the worker
  module's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcadence.cli import build_parser, main
from kvcadence.harness import cli as harness_cli
from kvcadence.harness import worker as harness

FAKE = Path(__file__).resolve().parent / "fake_worker.py"
REPO = Path(__file__).resolve().parents[2]
ROLES = ("launcher", "sched0", "sched1", "escaped")


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie may wait for init)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZXx"


def _pids(piddir: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in piddir.glob("*.pid")}


def _wait_pids(piddir: Path, timeout: float = 60.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while len(pids := _pids(piddir)) < len(ROLES):
        assert time.monotonic() < deadline, f"fake worker tree never came up: {pids}"
        time.sleep(0.05)
    return pids


def _assert_all_gone(pids: dict[str, int], timeout: float = 5.0) -> None:
    """Every pid stops running within ``timeout`` s; any that does not is SIGKILLed here (so a
    failing test leaks nothing) and the test fails naming it."""
    deadline = time.monotonic() + timeout
    while (left := {r: p for r, p in pids.items() if _running(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left.values():  # do not leak them into the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the harness gave up: {left}"


def _fake_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str) -> Path:
    """``harness start`` launches ``fake_worker.py MODE`` (venv/model/command replaced)."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # state file + cache in tmp
    harness.cache_dir().mkdir(parents=True)
    monkeypatch.setattr(harness, "ensure_venv", lambda **kw: tmp_path / "venv")
    monkeypatch.setattr(harness, "ensure_model", lambda **kw: tmp_path / "model")
    monkeypatch.setattr(harness, "STOP_GRACE_S", 1.0)  # sched0 ignores SIGTERM: SIGKILL after 1 s

    def command(cfg, model, venv, ports, metrics_dir):
        argv = [sys.executable, "-S", str(FAKE), mode, str(piddir), str(ports[0])]
        return [*argv, "sglang.launch_server"], "{}"

    monkeypatch.setattr(harness, "build_command", command)
    return piddir


def _start_argv(tmp_path: Path, ready_timeout: str) -> list[str]:
    workdir = str(tmp_path / "w")
    return [
        "harness",
        "start",
        "--dp-size",
        "2",
        "--workdir",
        workdir,
        "--ready-timeout",
        ready_timeout,
    ]


def _error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("kvcadence:")]
    assert len(lines) == 1, err
    return lines[0]


def test_ready_timeout_stops_the_whole_tree_and_names_the_flag(tmp_path, monkeypatch, capsys):
    piddir = _fake_cli(monkeypatch, tmp_path, "hang")
    t0 = time.monotonic()
    rc = main(_start_argv(tmp_path, "2"))
    took = time.monotonic() - t0
    line = _error_line(capsys.readouterr().err)
    assert rc == 1  # HarnessError
    assert line.startswith("kvcadence: error: SGLang worker not ready after 2 s")
    assert "--ready-timeout SECONDS" in line and "process tree was stopped" in line
    assert str(tmp_path / "w" / "server.log") in line
    pids = _pids(piddir)
    assert set(pids) == set(ROLES)  # the whole tree was up when the harness gave up
    _assert_all_gone(pids, timeout=0.5)  # by pid: launcher, both schedulers, the escaped one
    assert took < 2 + harness.STOP_GRACE_S + 15  # SIGKILL after the grace, not STOP_GRACE_S=30
    assert not harness.state_path().exists()  # nothing recorded for 'harness stop'


def test_worker_exiting_early_fails_at_once_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    piddir = _fake_cli(monkeypatch, tmp_path, "exit")
    t0 = time.monotonic()
    rc = main(_start_argv(tmp_path, "120"))
    took = time.monotonic() - t0
    line = _error_line(capsys.readouterr().err)
    assert rc == 1
    assert "SGLang worker exited with 3 before it was ready" in line
    assert "(fake worker: boom, exiting before ready)" in line  # the log's last line
    assert "process tree was stopped" in line
    pids = _pids(piddir)
    assert set(pids) == set(ROLES)
    _assert_all_gone(pids, timeout=0.5)
    assert took < 60  # did not sit out the 120 s ready timeout


DRIVER = """
import sys
from pathlib import Path
from kvcadence.cli import build_parser, main
from kvcadence.harness import worker as h
tmp, fake = Path(sys.argv[1]), sys.argv[2]
h.ensure_venv = lambda **kw: tmp / "venv"
h.ensure_model = lambda **kw: tmp / "model"
h.STOP_GRACE_S = 1.0
h.build_command = lambda cfg, m, v, ports, md: (
    [sys.executable, "-S", fake, "hang", str(tmp / "pids"), str(ports[0])], "{}")
sys.exit(main(["harness", "start", "--dp-size", "2", "--workdir", str(tmp / "w"),
               "--ready-timeout", "300"]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_harness_start_stops_the_whole_tree(tmp_path, sig):
    (tmp_path / "pids").mkdir()
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path), str(FAKE)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = _wait_pids(tmp_path / "pids")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "kvcadence: interrupted"
    _assert_all_gone(pids, timeout=0.5)


def test_harness_stop_stops_a_ready_workers_whole_tree(tmp_path, monkeypatch, capsys):
    piddir = _fake_cli(monkeypatch, tmp_path, "ready")
    started: list[harness.ServerHandle] = []  # the Popen stays referenced (reaped below)
    real_start = harness.start_server
    monkeypatch.setattr(
        harness, "start_server", lambda *a, **k: started.append(real_start(*a, **k)) or started[0]
    )
    assert main(_start_argv(tmp_path, "60")) == 0
    try:
        pids = _wait_pids(piddir)
        assert all(_running(p) for p in pids.values())  # started detached: it keeps running
        assert harness.status()["server"]["alive"]
        capsys.readouterr()
        assert main(["harness", "stop"]) == 0
        assert '"stopped": true' in capsys.readouterr().out
        _assert_all_gone(pids, timeout=0.5)  # incl. sched0 (SIGTERM-deaf) and the escaped one
    finally:
        started[0].stop(timeout=1.0)  # a no-op when 'harness stop' did its job; reaps the pid
    assert started[0]._proc is not None and started[0]._proc.returncode is not None


def test_ready_timeout_flag_is_checked_and_its_default_is_the_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(harness, "start_server", lambda *a, **k: pytest.fail("started"))
    for bad in ("0", "-5", "nan", "soon"):
        with pytest.raises(SystemExit) as exc:  # argparse: usage + one error line, exit 2
            main(["harness", "start", "--ready-timeout", bad])
        assert exc.value.code == 2
    assert harness_cli.DEFAULT_READY_TIMEOUT_S == harness.DEFAULT_READY_TIMEOUT_S
    args = build_parser().parse_args(["harness", "start"])
    assert args.ready_timeout == harness.DEFAULT_READY_TIMEOUT_S


def test_start_server_refuses_a_nonsense_ready_timeout(tmp_path):
    from kvcadence.errors import UsageError

    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="ready_timeout"):
            harness.start_server(harness.ServerConfig(), tmp_path, ready_timeout=bad)
