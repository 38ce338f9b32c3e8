"""Capture-test fixtures: a recorder running against a test publisher, and the real worker.

* ``run_capture`` -- start a ``Recorder`` (thread) on the given endpoints writing a bundle in
  ``tmp_path``; returns a handle with ``wait_for(n)``, ``stop()`` and the bundle path.
* ``sglang_worker_factory`` (session) -- starts real SGLang 0.5.23 CPU workers through the
  harness, one at a time; fails when the harness cannot be set up (the
  ``sglang_harness`` fixture in ``tests/conftest.py``); a worker that misbehaves fails too.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvcadence.capture.discovery import make_header
from kvcadence.capture.recorder import Recorder
from kvcadence.format.bundle import BundleReader, BundleWriter
from kvcadence.format.schema import EndpointInfo


class CaptureRun:
    def __init__(self, path: Path, endpoints: list[EndpointInfo], **kw: Any) -> None:
        self.path = path
        self.writer = BundleWriter(path, make_header(endpoints, server_info=None, command=[]))
        self.rec = Recorder(self.writer, endpoints, **kw)
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.rec.ready.wait(10)
        time.sleep(0.3)  # SUB subscription reaches the PUB (slow joiner)

    def _run(self) -> None:
        try:
            self.rec.run(self.stop_event)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.error = exc

    def wait_for(self, written: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.rec.stats.written < written:
            if self.error is not None or not self.thread.is_alive():
                raise AssertionError(f"recorder stopped early: {self.error!r}")
            if time.monotonic() > deadline:
                raise AssertionError(f"only {self.rec.stats.written} of {written} written")
            time.sleep(0.02)

    def stop(self) -> BundleReader:
        self.stop_event.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return BundleReader(self.path)


@pytest.fixture
def run_capture(tmp_path: Path):
    runs: list[CaptureRun] = []

    def start(endpoints: list[EndpointInfo], name: str = "b", **kw: Any) -> CaptureRun:
        kw.setdefault("replay_timeout_s", 1.0)
        r = CaptureRun(tmp_path / name, endpoints, **kw)
        runs.append(r)
        return r

    yield start
    for r in runs:
        if r.thread.is_alive():
            r.stop_event.set()
            r.thread.join(30)


def endpoint_of(pub: Any, ident: int = 0) -> EndpointInfo:
    return EndpointInfo(ident, pub.endpoint, pub.replay_endpoint, ident, pub.topic)


@pytest.fixture
def endpoint_info():
    return endpoint_of


# ---------------------------------------------------------------------- real worker


@pytest.fixture(scope="session")
def sglang_worker_factory(sglang_harness, tmp_path_factory):
    """``start(name, **ServerConfig fields)`` -> a running worker. Scenarios with the same
    configuration share one worker (started once, for CI time); a different configuration
    stops the previous worker first (never two at once: ~2.4 GB each)."""
    current: list[tuple[dict[str, Any], Any]] = []

    def start(name: str, **cfg: Any) -> Any:
        if current and current[0][0] == cfg and current[0][1].alive():
            return current[0][1]
        for _, h in current:
            h.stop()
        current.clear()
        workdir = tmp_path_factory.mktemp(f"sglang-{name}")
        # a loaded box (other workers, test runs) can take minutes to import SGLang
        h = sglang_harness.start_server(
            sglang_harness.ServerConfig(**cfg), workdir, ready_timeout=600.0
        )
        current.append((dict(cfg), h))
        return h

    yield start
    for _, h in current:
        h.stop()
