"""A stand-in for ``python -m sglang.launch_server`` in the harness's process-tree tests.

``python fake_worker.py MODE PIDDIR PORT [sglang.launch_server]`` forks a tree shaped like a
``--dp-size 2`` SGLang worker, and writes ``PIDDIR/<role>.pid`` for every process once it runs:

* ``launcher`` -- this process (the one ``start_server`` starts);
* ``sched0`` -- a child that ignores SIGTERM (only SIGKILL stops it);
* ``sched1`` -- a child, parent of ``escaped``;
* ``escaped`` -- a grandchild that calls ``setsid()``: it has left the worker's process group.

MODE says what the launcher does then:

* ``hang`` -- nothing, forever (never becomes ready);
* ``exit`` -- prints a last line and exits with 3 at once, its children left running;
* ``usage`` -- the same with an argparse-style error line and exit status 2;
* ``badargs`` -- the same with the traceback of SGLang's argument checks refusing the
  configuration, exit status 1;
* ``ready`` -- answers ``GET /health`` on ``127.0.0.1:PORT`` with 200, forever.

The trailing ``sglang.launch_server`` word only makes ``/proc/PID/cmdline`` look like a real
worker's to ``harness stop`` (it stops a recorded PID only when it is one). Standard library
only; no kvcadence import (it runs as a plain script).
"""

from __future__ import annotations

import http.server
import os
import signal
import sys
import time
from pathlib import Path

#: the end of a real SGLang 0.5.23 worker's log when its argument checks refuse the
#: configuration (``--page-size 16 --chunked-prefill-size 200``; paths shortened)
BADARGS = """\
[2026-12-06 19:10:17] kill_process_tree called: parent_pid=28940, include_parent=False
Traceback (most recent call last):
  File "sglang/launch_server.py", line 84, in <module>
    run_server(server_args)
  File "sglang/srt/entrypoints/engine.py", line 1165, in _launch_subprocesses
    server_args.check_server_args()
  File "sglang/srt/server_args.py", line 511, in check_server_args
    check_server_args(self)
  File "sglang/srt/arg_groups/validation_hook.py", line 244, in check_server_args
    assert cfg.chunked_prefill_size % cfg.page_size == 0, (
AssertionError: chunked_prefill_size must be divisible by page_size
"""


def _write_pid(piddir: Path, role: str) -> None:
    tmp = piddir / f".{role}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(piddir / f"{role}.pid")  # whole file or none: the test reads complete pids


def _idle() -> None:
    while True:
        signal.pause()


def _fork(piddir: Path, role: str, body=None) -> None:
    if os.fork() == 0:
        try:
            if body is not None:
                body()
            _write_pid(piddir, role)
            _idle()
        finally:
            os._exit(0)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    mode, piddir, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    _fork(piddir, "sched0", lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))

    def sched1() -> None:
        _fork(piddir, "escaped", os.setsid)

    _fork(piddir, "sched1", sched1)
    _write_pid(piddir, "launcher")
    print("fake worker: launcher up", flush=True)
    if mode == "exit":
        while len(list(piddir.glob("*.pid"))) < 4:  # the whole tree runs before we exit
            time.sleep(0.01)
        print("fake worker: boom, exiting before ready", flush=True)
        sys.exit(3)
    if mode == "usage":
        while len(list(piddir.glob("*.pid"))) < 4:
            time.sleep(0.01)
        print("launch_server.py: error: unrecognized arguments: --bogus", flush=True)
        sys.exit(2)
    if mode == "badargs":
        while len(list(piddir.glob("*.pid"))) < 4:
            time.sleep(0.01)
        print(BADARGS, end="", flush=True)
        sys.exit(1)
    if mode == "ready":
        http.server.HTTPServer(("127.0.0.1", port), _Health).serve_forever()
    _idle()


if __name__ == "__main__":
    main()
