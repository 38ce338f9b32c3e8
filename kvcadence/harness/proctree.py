"""Stopping a real SGLang worker: its whole process tree, by PID, never by name.

What this file owns: ``ProcessTree`` -- every worker is started as the leader of its own
session and process group, and the tree is that group plus any descendant seen in
``/proc`` that left it (SGLang's tokenizer, detokenizer and one scheduler per DP rank);
each pid recorded with its start time, so a pid reused after ours died is never signalled
-- and ``stop_pid``: SIGTERM, ``STOP_GRACE_S`` of grace, then SIGKILL; without the
launcher's ``Popen`` (a worker recorded by ``harness start``) only an
``sglang.launch_server`` process is stopped.

Only the standard library is imported here (Linux ``/proc``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

#: SIGTERM -> SIGKILL grace when a worker's process tree is stopped
STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class _Stat:
    """The fields of ``/proc/PID/stat`` the process-tree walk needs."""

    state: str
    ppid: int
    pgrp: int
    session: int
    start: int  # clock ticks after boot: with the pid, identifies one process


def _proc_stat(pid: int) -> _Stat | None:
    """``/proc/PID/stat`` of a process, or None when there is none (Linux)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
        rest = data[data.rindex(b")") + 2 :].split()  # comm may hold spaces and parentheses
        return _Stat(rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19]))
    except (OSError, ValueError, IndexError):
        return None


def _all_stats() -> dict[int, _Stat]:
    out: dict[int, _Stat] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit() and (st := _proc_stat(int(name))) is not None:
            out[int(name)] = st
    return out


class ProcessTree:
    """The processes one worker launch started, stopped together.

    The harness starts every worker as the leader of a new session (``start_new_session``),
    so its process group is the worker and everything it forks (SGLang's tokenizer/detokenizer
    and one scheduler per DP rank). ``scan()`` records the members of that group and session,
    and every descendant of a recorded process (one that left the group is still caught while
    its parent chain is alive). A pid is recorded with its start time, so a pid reused by
    another process after ours died is never signalled.
    """

    def __init__(self, root: int) -> None:
        self.root = root
        st = _proc_stat(root)
        # a session/group leader (how the harness starts workers): the group can be signalled
        self.group: int | None = root if st is not None and st.pgrp == root else None
        self.known: dict[int, int] = {} if st is None else {root: st.start}

    def scan(self) -> None:
        """Record the processes of the tree that exist now."""
        table = _all_stats()
        grew = True
        while grew:
            grew = False
            for pid, st in table.items():
                if pid in self.known:
                    continue
                in_group = self.group is not None and st.pgrp == st.session == self.group
                parent = table.get(st.ppid)
                child = parent is not None and self.known.get(st.ppid) == parent.start
                if in_group or child:
                    self.known[pid] = st.start
                    grew = True

    def alive(self) -> list[int]:
        """Recorded pids still running (zombies count as gone)."""
        out = []
        for pid, start in self.known.items():
            st = _proc_stat(pid)
            if st is not None and st.start == start and st.state not in ("Z", "X", "x"):
                out.append(pid)
        return sorted(out)

    def signal(self, sig: int) -> None:
        """``sig`` to the process group and to every recorded pid still running."""
        if self.group is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, sig)
        for pid in self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def stop(self, grace: float, proc: subprocess.Popen | None = None) -> int | None:
        """SIGTERM the tree, wait up to ``grace`` s, then SIGKILL what is left (and wait for
        it to go). Returns the root's exit code when ``proc`` (the root's ``Popen``) is
        given, else 0 (it went on SIGTERM) or -9 (it needed SIGKILL). Never raises."""
        killed = False
        self.scan()
        if self.alive():
            self.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while True:
                if proc is not None:
                    proc.poll()  # reap the root (it is our child)
                self.scan()  # processes forked while shutting down
                if not self.alive():
                    break
                if time.monotonic() >= deadline:
                    killed = True
                    self.signal(signal.SIGKILL)
                    end = time.monotonic() + 10.0
                    while self.alive() and time.monotonic() < end:
                        if proc is not None:
                            proc.poll()
                        time.sleep(0.05)
                    break
                time.sleep(0.1)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            return proc.returncode
        return -9 if killed else 0


def pid_is_our_server(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"sglang.launch_server" in cmdline


def stop_pid(
    pid: int,
    *,
    timeout: float | None = None,
    proc: subprocess.Popen | None = None,
    tree: ProcessTree | None = None,
) -> int | None:
    """Stop the worker whose launcher is ``pid`` and its whole process tree (SIGTERM, then
    SIGKILL after ``timeout`` s, default ``STOP_GRACE_S``). Without ``proc`` (a worker
    recorded by ``harness start``) ``pid`` must be an ``sglang.launch_server``: anything else
    is left alone (None)."""
    grace = STOP_GRACE_S if timeout is None else timeout
    if proc is None and not pid_is_our_server(pid):
        return None
    return (tree or ProcessTree(pid)).stop(grace, proc)
