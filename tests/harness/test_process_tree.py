"""The harness stops every process a worker start created, on every path -- without SGLang.

``fake_worker.py`` stands in for ``sglang.launch_server`` (a launcher, two "DP scheduler"
children, one of them ignoring SIGTERM, and a grandchild that left the process group); it is
started through ``harness start`` / ``start_server`` themselves (only the venv, the model and
the command line are replaced). Checked:

* ready timeout (``--ready-timeout 2``): exit 1, one error line naming ``--ready-timeout``, and
  no process of the tree alive afterwards (by pid);
* the worker exits before it is ready: started once more on fresh ports (the first tree
  stopped, its log kept); when that start exits too: exit 1 at once (no waiting for the
  timeout), the worker's last log line in the error, no process of either start left; a
  usage error (exit 2) is not retried, nor a configuration SGLang's argument checks refuse
  (a traceback through ``check_server_args``); the error names a traceback's exception line, not
  SGLang's closing ``kill_process_tree`` line;
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
from kvcadence.harness import proctree
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


def _fake_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str, *later: str) -> Path:
    """``harness start`` launches ``fake_worker.py MODE`` (venv/model/command replaced); a
    start after the first runs the next of ``later`` (else MODE again) and writes its pids
    into ``pids/start<N>/`` (the first start's stay in ``pids/``)."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    starts: list[int] = []
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # state file + cache in tmp
    harness.cache_dir().mkdir(parents=True)
    monkeypatch.setattr(harness, "ensure_venv", lambda **kw: tmp_path / "venv")
    monkeypatch.setattr(harness, "ensure_model", lambda **kw: tmp_path / "model")
    monkeypatch.setattr(proctree, "STOP_GRACE_S", 1.0)  # sched0 ignores SIGTERM: SIGKILL after 1 s

    def command(cfg, model, venv, ports, metrics_dir):
        starts.append(ports[0])
        n = len(starts)
        seq = [mode, *later]
        this_mode = seq[min(n, len(seq)) - 1]
        pids = piddir if n == 1 else piddir / f"start{n}"
        pids.mkdir(exist_ok=True)
        argv = [sys.executable, "-S", str(FAKE), this_mode, str(pids), str(ports[0])]
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
    assert took < 2 + proctree.STOP_GRACE_S + 15  # SIGKILL after the grace, not STOP_GRACE_S=30
    assert not harness.state_path().exists()  # nothing recorded for 'harness stop'


def test_worker_exiting_early_twice_fails_at_once_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    piddir = _fake_cli(monkeypatch, tmp_path, "exit")
    t0 = time.monotonic()
    rc = main(_start_argv(tmp_path, "120"))
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    line = _error_line(err)
    assert rc == 1
    assert "SGLang worker exited with 3 before it was ready" in line
    assert "(fake worker: boom, exiting before ready)" in line  # the log's last line
    assert "process tree was stopped" in line and "(start 2 of 2)" in line
    assert "starting it again on fresh ports (start 2 of 2" in err  # the one retry, said
    first, second = _pids(piddir), _pids(piddir / "start2")
    assert set(first) == set(second) == set(ROLES)
    _assert_all_gone(first, timeout=0.5)
    _assert_all_gone(second, timeout=0.5)
    kept = tmp_path / "w" / "server.attempt1.log"
    assert "boom" in kept.read_text()  # the first start's log is kept beside the last one's
    assert took < 60  # did not sit out the 120 s ready timeout


def test_worker_exiting_early_once_is_started_again_on_fresh_ports(tmp_path, monkeypatch, capsys):
    """A start that dies before it is ready (e.g. a port found free was taken before SGLang
    bound it) costs one more start, not the caller's run: the first tree is stopped, the
    second start gets fresh ports and is the worker returned."""
    piddir = _fake_cli(monkeypatch, tmp_path, "exit", "ready")
    h = harness.start_server(harness.ServerConfig(), tmp_path / "w", ready_timeout=60)
    try:
        err = capsys.readouterr().err
        assert "exited with 3 before it was ready (fake worker: boom" in err
        assert "starting it again on fresh ports (start 2 of 2" in err
        _assert_all_gone(_pids(piddir), timeout=0.5)  # the first start's whole tree
        second = _wait_pids(piddir / "start2")
        assert all(_running(p) for p in second.values())
        assert h.pid == second["launcher"] and h.alive()
        assert (tmp_path / "w" / "server.attempt1.log").exists()
        assert "boom" not in Path(h.log_path).read_text()  # its own log, not the first's
    finally:
        h.stop(timeout=1.0)
    _assert_all_gone(second, timeout=0.5)


def test_a_usage_error_of_the_worker_is_not_retried(tmp_path, monkeypatch, capsys):
    piddir = _fake_cli(monkeypatch, tmp_path, "usage")
    rc = main(_start_argv(tmp_path, "120"))
    line = _error_line(capsys.readouterr().err)
    assert rc == 1
    assert "exited with 2 before it was ready" in line and "(start" not in line
    assert "unrecognized arguments: --bogus" in line
    assert not (piddir / "start2").exists()
    _assert_all_gone(_pids(piddir), timeout=0.5)


def test_a_configuration_sglang_refuses_is_not_retried(tmp_path, monkeypatch, capsys):
    """SGLang's argument checks refusing the configuration (a traceback through
    ``check_server_args``, exit 1) fail the same way on any port: one start, its cause in
    the error line."""
    piddir = _fake_cli(monkeypatch, tmp_path, "badargs")
    rc = main(_start_argv(tmp_path, "120"))
    err = capsys.readouterr().err
    line = _error_line(err)
    assert rc == 1
    assert "exited with 1 before it was ready" in line and "(start" not in line
    assert "(AssertionError: chunked_prefill_size must be divisible by page_size)" in line
    assert "starting it again" not in err
    assert not (piddir / "start2").exists()
    _assert_all_gone(_pids(piddir), timeout=0.5)


def test_only_sglangs_argument_checks_count_as_a_refused_configuration():
    from tests.harness.fake_worker import BADARGS

    assert harness.rejected_args(BADARGS)
    assert not harness.rejected_args(SGLANG_DEATH)  # a port taken: worth a fresh start
    assert not harness.rejected_args("fake worker: boom, exiting before ready\n")
    # an earlier traceback through the checks does not make a later death one
    assert not harness.rejected_args(BADARGS + SGLANG_DEATH)
    # ServerArgs' own __post_init__ refusing, yes; another class's __post_init__, no
    post = 'Traceback (most recent call last):\n  File "sglang/srt/{}", line 9, in __post_init__\n'
    assert harness.rejected_args(post.format("server_args.py") + "ValueError: bad\n")
    assert not harness.rejected_args(post.format("managers/io_struct.py") + "ValueError: x\n")


SGLANG_DEATH = """\
[2026-12-03 16:48:20] Init torch distributed begin.
[2026-12-03 16:48:26] Scheduler hit an exception: Traceback (most recent call last):
  File "sglang/srt/managers/scheduler.py", line 2940, in run_scheduler_process
    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)
zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:36259')

[2026-12-03 16:48:27] Received sigquit from a child process. It usually means the child failed.
[2026-12-03 16:48:27] kill_process_tree called: parent_pid=30973, include_parent=True
"""


def test_exit_cause_is_the_exception_line_not_the_last_line():
    assert harness.exit_cause(SGLANG_DEATH) == (
        "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:36259')"
    )
    assert harness.exit_cause("starting\nKilled\n\n") == "Killed"  # none: the last line
    assert harness.exit_cause("") == ""
    assert harness.exit_cause("RuntimeError\n[x] done\n") == "RuntimeError"


def test_log_tail_reads_only_the_end_of_a_large_log(tmp_path, monkeypatch):
    log = tmp_path / "server.log"
    log.write_text("x" * 200 + "\n" + "first\n" + "y\n" * 10 + "last\n")
    h = harness.ServerHandle(
        pid=1,
        port=1,
        events_port=2,
        replay_port=None,
        workdir=str(tmp_path),
        metrics_dir=str(tmp_path),
        log_path=str(log),
        command=[],
        kv_events_config="{}",
    )
    assert h.log_tail(2) == "y\nlast"
    monkeypatch.setattr(harness, "LOG_TAIL_BYTES", 30)
    assert h.log_tail(100).splitlines()[-1] == "last" and "first" not in h.log_tail(100)


DRIVER = """
import sys
from pathlib import Path
from kvcadence.cli import build_parser, main
from kvcadence.harness import proctree
from kvcadence.harness import worker as h
tmp, fake = Path(sys.argv[1]), sys.argv[2]
h.ensure_venv = lambda **kw: tmp / "venv"
h.ensure_model = lambda **kw: tmp / "model"
proctree.STOP_GRACE_S = 1.0
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
    # (a context manager: its pipes are closed however the test ends -- left open, a pipe
    # of a driver that timed out failed the next test, at garbage collection, as a
    # ResourceWarning)
    with subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path), str(FAKE)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        pids: dict[str, int] = {}
        try:
            pids = _wait_pids(tmp_path / "pids")
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            for pid in pids.values():  # the fake workers: killed, not leaked
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)
            pytest.fail(f"harness start still running 60 s after {sig.name}; its stderr: {err}")
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


def test_buffer_steps_reaches_the_workers_kv_events_config(tmp_path, monkeypatch, capsys):
    """``harness start --buffer-steps N`` sets the publisher's replay ring (a capture attached
    mid-run then misses the history: how a long-running worker looks); 0 is refused."""
    from kvcadence.errors import UsageError

    monkeypatch.setenv("HOME", str(tmp_path))
    got: list = []

    def fake_start(cfg, *a, **k):
        got.append(cfg)
        raise UsageError("stop here")  # nothing started

    monkeypatch.setattr(harness, "start_server", fake_start)
    assert main(["harness", "start", "--buffer-steps", "0"]) == 2
    assert not got and "--buffer-steps" in capsys.readouterr().err
    assert main(["harness", "start", "--buffer-steps", "5", "--workdir", str(tmp_path / "w")]) == 2
    assert got[0].buffer_steps == 5
    assert main(["harness", "start", "--workdir", str(tmp_path / "w")]) == 2
    assert got[1].buffer_steps is None  # SGLang's default ring


def test_a_relative_workdir_is_made_absolute_before_the_worker_runs_in_it(tmp_path, monkeypatch):
    """The worker runs with its workdir as cwd: a relative ``--workdir w`` handed on as is
    made SGLang write its metrics files to ``w/w/sglang-metrics``, not the ``w/sglang-metrics``
    that ``harness start`` reports (a capture then tails an empty directory)."""
    _fake_cli(monkeypatch, tmp_path, "ready")
    fake = harness.build_command
    seen: list[Path] = []

    def command(cfg, model, venv, ports, metrics_dir):
        seen.append(metrics_dir)
        return fake(cfg, model, venv, ports, metrics_dir)

    monkeypatch.setattr(harness, "build_command", command)
    monkeypatch.chdir(tmp_path)
    h = harness.start_server(harness.ServerConfig(), Path("w"), ready_timeout=60)
    try:
        want = tmp_path.resolve() / "w" / "sglang-metrics"
        assert seen == [want]
        assert h.metrics_dir == str(want) and h.workdir == str(want.parent)
    finally:
        h.stop(timeout=1.0)
