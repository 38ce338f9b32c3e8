"""Helpers shared by the capture tests: a deadline for calls that could hang, the one-line
error check, a free loopback port, a small multi-segment bundle."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcadence.capture.discovery import make_header
from kvcadence.format.bundle import BundleWriter
from kvcadence.testing.publisher import payload_pool


def within(fn: Callable[[], Any], seconds: float = 10.0) -> Any:
    """``fn()`` on a daemon thread; fails (instead of hanging the suite) past ``seconds``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcadence: error: ") and "Traceback" not in err, err
    return lines[0]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_bundle(path: Path) -> Path:
    """A bundle of six small event frames in several 256-byte segments."""
    w = BundleWriter(path, make_header([], server_info=None, command=[]), segment_bytes=256)
    for i in range(6):
        w.write_event(
            endpoint=0, seq=i, recv_ns=i, topic="kv", payload=payload_pool(8)[0], via=0, epoch=0
        )
    w.close()
    return path
