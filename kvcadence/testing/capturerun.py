"""Recording a worker's run beside the clients that drive it: ``kvcadence capture --server URL
--sglang-metrics DIR --out OUT`` as its own process, started once it listens and stopped
(SIGINT, a settle time first) with its summary read back.

What this file owns: ``start_capture``, ``stop_capture`` and ``capture_log`` -- what
``testing.httpclients --out`` and the real-worker tests record with.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvcadence.errors import CaptureError


def start_capture(url: str, metrics_dir: str | Path, out: Path) -> subprocess.Popen:
    """``kvcadence capture --server URL --sglang-metrics DIR --out OUT`` as its own
    process, once it is listening (its log: ``OUT`` + ``.stderr``)."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "kvcadence", "capture", "--server", url]
    cmd += ["--sglang-metrics", str(metrics_dir), "--out", str(out)]
    with open(out.with_suffix(".stderr"), "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while not out.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise CaptureError(f"capture did not start: {capture_log(out).strip()}")
        time.sleep(0.1)
    time.sleep(1.5)  # SUB subscription (the initial replay covers seq 0 anyway)
    return proc


def capture_log(out: Path) -> str:
    log = out.with_suffix(".stderr")
    return log.read_text() if log.exists() else ""


def stop_capture(proc: subprocess.Popen, out: Path, settle_s: float = 3.0) -> str:
    """Let the last finish stores (published on idle) and metrics lines arrive, stop the
    capture with SIGINT; its log."""
    time.sleep(settle_s)
    proc.send_signal(signal.SIGINT)
    if proc.wait(60) != 0:
        raise CaptureError(f"capture exited {proc.returncode}: {capture_log(out).strip()}")
    return capture_log(out)
