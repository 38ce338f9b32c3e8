"""The real-SGLang CPU harness: run an unmodified SGLang 0.5.23 worker on a CPU-only box.

What this file owns (the recipe's launch; examples/README.md shows the command it runs):

* ``start_server()`` / ``ServerHandle.stop()`` -- launch on loopback with free ports
  (``harness.ports``), KV events bound with a replay ROUTER, ``--export-metrics-to-file``
  and ``--enable-metrics`` (the ``meta_info`` timings replay calibrates from); readiness by
  polling ``/health`` for up to ``ready_timeout`` s (``DEFAULT_READY_TIMEOUT_S``; ``harness
  start --ready-timeout``). The venv and the tiny model come from ``harness.venv``.
* Every worker is started as the leader of its own session and process group, and
  ``start_server`` stops the whole tree it started (``harness.proctree``) on every failure
  path -- ready timeout, the worker exiting early, Ctrl-C, SIGTERM/SIGHUP of the caller --
  so a failed start leaves no process behind (e.g. the DP scheduler processes of a
  ``--dp-size 2`` worker). A worker that exits before it is ready is started once more on
  fresh ports (``START_ATTEMPTS``; a port found free may be taken before SGLang binds it),
  and the error names the exception line of its log (``exit_cause``), not its last line.
* The command line and environment (``build_command``, ``server_env``,
  ``worker_env_extra``): with ``ServerConfig.dp_size > 1``, ``--dp-size N`` (rank ``r``
  publishes on ``events_port + r`` and replays on ``replay_port + r``) and, unless given, a
  ``SGLANG_CPU_OMP_THREADS_BIND`` that splits this process's CPUs between the ranks
  (``harness.ports.omp_threads_bind``).
* ``status()`` and the state file of the worker ``harness start`` recorded.

Only the standard library is imported here (httpx is not needed for a readiness probe).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from kvcadence.errors import HarnessError, UsageError
from kvcadence.harness.ports import omp_threads_bind, reserve_ports
from kvcadence.harness.proctree import ProcessTree, pid_is_our_server, stop_pid
from kvcadence.harness.venv import (
    ASSET_DIR,
    cache_dir,
    ensure_model,
    ensure_venv,
    model_dir,
    venv_dir,
    venv_python,
    venv_ready,
)

DEFAULT_TOPIC = "kv-events"
#: how long ``start_server`` waits for ``/health`` by default (a real CPU worker on a loaded
#: 2-core box needed 362 s; ``harness start --ready-timeout`` changes it)
DEFAULT_READY_TIMEOUT_S = 600.0
#: starts of a worker that exits before it is ready (``start_server``'s ``attempts``)
START_ATTEMPTS = 2
#: how much of a worker's log ``log_tail`` reads (its end)
LOG_TAIL_BYTES = 1 << 16
#: log lines searched for the exception that stopped a worker
LOG_CAUSE_LINES = 200


@dataclass
class ServerConfig:
    """What to launch. ``max_total_tokens`` is the KV pool in tokens (small = evictions)."""

    page_size: int = 1
    max_total_tokens: int = 20000
    chunked_prefill_size: int | None = None
    topic: str = DEFAULT_TOPIC
    replay: bool = True
    buffer_steps: int | None = None
    extra_args: list[str] = field(default_factory=list)
    dp_size: int = 1  # --dp-size: one scheduler, KV cache and event publisher per rank
    enable_metrics: bool = True  # --enable-metrics: meta_info request_received_ts etc.
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the worker
    #: a file the worker appends its tree evictions to (``sglang_cpu/sitecustomize.py``;
    #: ``harness start --trace-evictions``); None: no trace
    trace_evictions: str | None = None
    #: a tokenizer directory (``--tokenizer-path``): the worker tokenizes text prompts and
    #: serves ``/v1/chat/completions`` with its chat template; None: ``--skip-tokenizer-init``
    #: (token-id prompts only; the tiny model ships no tokenizer)
    tokenizer: str | None = None


#: the variable ``sglang_cpu/sitecustomize.py`` reads: where the worker traces its evictions
EVICTION_TRACE_ENV = "KVCADENCE_EVICTION_TRACE"


@dataclass
class ServerHandle:
    """A running (or stopped) SGLang worker started by this harness."""

    pid: int
    port: int
    events_port: int
    replay_port: int | None
    workdir: str
    metrics_dir: str
    log_path: str
    command: list[str]
    kv_events_config: str
    dp_size: int = 1
    env: dict[str, str] = field(default_factory=dict)  # what was added to the environment
    _proc: subprocess.Popen | None = field(default=None, repr=False, compare=False)
    _tree: ProcessTree | None = field(default=None, repr=False, compare=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        """Rank 0's replay ROUTER endpoint."""
        return None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def events_endpoints(self) -> list[str]:
        """One PUB endpoint per DP rank (``events_port + rank``)."""
        return [f"tcp://127.0.0.1:{self.events_port + r}" for r in range(self.dp_size)]

    @property
    def replay_endpoints(self) -> list[str | None]:
        """One replay ROUTER endpoint per DP rank (``replay_port + rank``), or Nones."""
        if self.replay_port is None:
            return [None] * self.dp_size
        return [f"tcp://127.0.0.1:{self.replay_port + r}" for r in range(self.dp_size)]

    def alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return pid_is_our_server(self.pid)

    def log_tail(self, n: int = 30) -> str:
        """The log's last ``n`` lines (read from its last ``LOG_TAIL_BYTES`` only)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-n:])

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop the worker's whole process tree (SIGTERM, SIGKILL after ``timeout`` s, default
        ``STOP_GRACE_S``). Returns the launcher's exit code."""
        return stop_pid(self.pid, timeout=timeout, proc=self._proc, tree=self._tree)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


def worker_env_extra(cfg: ServerConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """What ``cfg`` adds to the worker's environment: ``cfg.env``, plus
    ``SGLANG_CPU_OMP_THREADS_BIND`` (``omp_threads_bind``) when ``dp_size > 1`` and neither
    ``cfg.env`` nor ``base`` (default: this process's environment) sets it, plus
    ``EVICTION_TRACE_ENV`` (an absolute path) for ``cfg.trace_evictions``."""
    env: Mapping[str, str] = os.environ if base is None else base
    extra = dict(cfg.env)
    if cfg.trace_evictions:
        extra[EVICTION_TRACE_ENV] = str(Path(cfg.trace_evictions).resolve())
    key = "SGLANG_CPU_OMP_THREADS_BIND"
    if cfg.dp_size > 1 and not extra.get(key) and not env.get(key):
        extra[key] = omp_threads_bind(cfg.dp_size)
    return extra


def server_env(venv: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The recipe's environment: CPU engine, no health generation, the stand-in first;
    then ``extra`` (``worker_env_extra``) on top."""
    env = dict(os.environ)
    env.update(extra or {})
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ASSET_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    return env


def build_command(
    cfg: ServerConfig, model: Path, venv: Path, ports: Sequence[int], metrics_dir: Path
) -> tuple[list[str], str]:
    """The launch command and its ``--kv-events-config`` JSON; ``ports`` = ``(http,
    events_base, replay_base)`` (rank r: base + r)."""
    if cfg.dp_size < 1:
        raise UsageError(f"dp_size must be >= 1, got {cfg.dp_size}")
    if any(a == "--dp-size" or a.startswith("--dp-size=") for a in cfg.extra_args):
        raise UsageError("give the DP size as ServerConfig.dp_size, not in extra_args")
    port, ev_port, rp_port = ports
    kv_cfg: dict[str, object] = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{ev_port}",
        "bind": True,
        "topic": cfg.topic,
    }
    if cfg.replay:
        kv_cfg["replay_endpoint"] = f"tcp://127.0.0.1:{rp_port}"
    if cfg.buffer_steps is not None:
        kv_cfg["buffer_steps"] = cfg.buffer_steps
    kv_json = json.dumps(kv_cfg, separators=(",", ":"))
    cmd = [
        str(venv_python(venv)),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        *(["--tokenizer-path", cfg.tokenizer] if cfg.tokenizer else ["--skip-tokenizer-init"]),
        "--page-size",
        str(cfg.page_size),
        "--max-total-tokens",
        str(cfg.max_total_tokens),
        "--mem-fraction-static",
        "0.05",
        "--skip-server-warmup",
        "--sleep-on-idle",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-events-config",
        kv_json,
        "--export-metrics-to-file",
        "--export-metrics-to-file-dir",
        str(metrics_dir),
    ]
    if cfg.enable_metrics and "--enable-metrics" not in cfg.extra_args:
        cmd.append("--enable-metrics")
    if cfg.dp_size > 1:
        cmd += ["--dp-size", str(cfg.dp_size)]
    if cfg.chunked_prefill_size is not None:
        cmd += ["--chunked-prefill-size", str(cfg.chunked_prefill_size)]
    cmd += list(cfg.extra_args)
    return cmd, kv_json


def _health(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start_server(
    cfg: ServerConfig,
    workdir: Path,
    *,
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
    detach: bool = False,
    quiet: bool = True,
    attempts: int = START_ATTEMPTS,
) -> ServerHandle:
    """Launch a worker (venv + model built first if needed) and wait up to ``ready_timeout``
    s for ``/health``. The worker leads its own session and process group; when the start
    fails (not ready in time, the worker exits first, Ctrl-C or SIGTERM/SIGHUP of this
    process) its whole process tree is stopped before the error propagates. A worker that
    exits before it is ready is started again on fresh ports, up to ``attempts`` starts in
    all (a port chosen free can be taken by another process before the worker binds it);
    each earlier attempt's log is kept as ``server.attempt<N>.log``. A usage error of
    SGLang's own parser (exit 2) is never retried, nor is a configuration SGLang's argument
    checks refused (``rejected_args``: e.g. a chunked prefill size that is no multiple of
    the page size): the same arguments fail the same way on any port. A returned worker runs until
    ``ServerHandle.stop()`` (``detach`` only says it outlives this process, as ``harness
    start`` needs)."""
    if not (0 < ready_timeout < float("inf")):
        raise UsageError(f"ready_timeout must be a positive number of seconds, got {ready_timeout}")
    if attempts < 1:
        raise UsageError(f"attempts must be >= 1, got {attempts}")
    venv = ensure_venv(quiet=quiet)
    model = ensure_model(quiet=quiet)
    # absolute: the worker runs in ``workdir`` (``cwd``), so a relative metrics dir handed
    # to it would resolve one level deeper than the one ``harness start`` reports
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    metrics_dir = workdir / "sglang-metrics"
    metrics_dir.mkdir(exist_ok=True)
    log_path = workdir / "server.log"
    for attempt in range(1, attempts + 1):
        try:
            return _launch(cfg, venv, model, metrics_dir, log_path, ready_timeout, quiet=quiet)
        except _ExitedEarly as e:
            if attempt == attempts or e.returncode == 2 or e.rejected_args:
                raise HarnessError(
                    str(e) + (f" (start {attempt} of {attempts})" if attempt > 1 else "")
                ) from None
            kept = log_path.with_name(f"server.attempt{attempt}.log")
            log_path.replace(kept)
            print(
                f"harness: {e}; starting it again on fresh ports (start {attempt + 1} of "
                f"{attempts}; that log kept as {kept})",
                file=sys.stderr,
                flush=True,
            )
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


class _ExitedEarly(HarnessError):
    """The worker exited before ``/health`` answered (``start_server`` may start it again)."""

    def __init__(self, message: str, returncode: int, rejected_args: bool = False) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.rejected_args = rejected_args


def _launch(
    cfg: ServerConfig,
    venv: Path,
    model: Path,
    metrics_dir: Path,
    log_path: Path,
    ready_timeout: float,
    *,
    quiet: bool,
) -> ServerHandle:
    """One start: fresh ports, the worker's process, readiness; its tree stopped on failure."""
    ports = reserve_ports(cfg.dp_size)
    cmd, kv_json = build_command(cfg, model, venv, ports, metrics_dir)
    extra_env = worker_env_extra(cfg)
    with _signals_interrupt():  # from here on a SIGTERM unwinds through the cleanup below
        log = open(log_path, "wb")
        try:
            proc = subprocess.Popen(
                cmd,
                env=server_env(venv, extra_env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=log_path.parent,
                start_new_session=True,  # its own process group: stopped as one tree
            )
        finally:
            log.close()
        handle = ServerHandle(
            pid=proc.pid,
            port=ports[0],
            events_port=ports[1],
            replay_port=ports[2] if cfg.replay else None,
            workdir=str(log_path.parent),
            metrics_dir=str(metrics_dir),
            log_path=str(log_path),
            command=cmd,
            kv_events_config=kv_json,
            dp_size=cfg.dp_size,
            env=extra_env,
            _proc=proc,
            _tree=(tree := ProcessTree(proc.pid)),
        )
        try:
            _wait_ready(handle, proc, ready_timeout, quiet=quiet)
        except BaseException:
            try:
                handle.stop()
            except KeyboardInterrupt:  # interrupted again while stopping: no more grace
                tree.signal(signal.SIGKILL)
            raise
    return handle


_CAUSE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception)(?::|$)")


#: a traceback frame of SGLang's checks of its own arguments (``ServerArgs.__post_init__``
#: and ``check_server_args``, ``srt/server_args.py`` and ``srt/arg_groups/``; 0.5.23)
_ARG_CHECK = re.compile(r"in check_server_args$|server_args\.py\", line \d+, in __post_init__$")
_TRACEBACK = "Traceback (most recent call last)"


def rejected_args(log_text: str) -> bool:
    """Whether the last traceback of a worker's log passes through SGLang's checks of its
    arguments (``_ARG_CHECK``): the worker refused its configuration (``AssertionError:
    chunked_prefill_size must be divisible by page_size``), which no fresh port changes."""
    lines = [ln.strip() for ln in log_text.splitlines()]
    # (a scheduler's traceback follows a log prefix: "... Scheduler hit an exception: Traceback")
    start = max((i for i, ln in enumerate(lines) if _TRACEBACK in ln), default=None)
    if start is None:
        return False
    return any(_ARG_CHECK.search(ln) for ln in lines[start:] if ln.startswith("File "))


def exit_cause(log_text: str) -> str:
    """The line of a worker's log that says why it stopped: the last exception line of a
    Python traceback (SGLang's scheduler prints one, then its launcher logs
    ``kill_process_tree called`` and kills itself), else the last non-empty line."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _CAUSE.match(ln):
            return ln
    return lines[-1] if lines else ""


def _wait_ready(
    handle: ServerHandle, proc: subprocess.Popen, ready_timeout: float, *, quiet: bool
) -> None:
    """Poll ``/health`` until it answers; HarnessError (one line, naming the log) when the
    worker exits first or ``ready_timeout`` passes (the caller stops the tree)."""
    if not quiet:
        print(
            f"harness: worker pid {proc.pid} started; waiting up to {ready_timeout:g} s for "
            f"{handle.url}/health (--ready-timeout); log: {handle.log_path}",
            file=sys.stderr,
            flush=True,
        )
    deadline = time.monotonic() + ready_timeout
    while True:
        if handle._tree is not None:
            handle._tree.scan()  # record the tree while its parent links still exist
        if _health(handle.url):
            return
        if proc.poll() is not None:
            tail = handle.log_tail(LOG_CAUSE_LINES)
            cause = exit_cause(tail)
            raise _ExitedEarly(
                f"SGLang worker exited with {proc.returncode} before it was ready"
                + (f" ({cause})" if cause else "")
                + f"; its process tree was stopped; log: {handle.log_path}",
                proc.returncode,
                rejected_args(tail),
            )
        if time.monotonic() > deadline:
            raise HarnessError(
                f"SGLang worker not ready after {ready_timeout:g} s; its process tree was "
                "stopped; give it longer with --ready-timeout SECONDS (default "
                f"{DEFAULT_READY_TIMEOUT_S:g}); log: {handle.log_path}"
            )
        time.sleep(0.5)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """While a worker is being started: SIGTERM and SIGHUP raise ``KeyboardInterrupt`` (like
    Ctrl-C) so the start's cleanup runs instead of this process dying with the worker left
    behind. Main thread only (elsewhere signal handlers cannot be set; nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGTERM, signal.SIGHUP)
    old = {sig: signal.signal(sig, _raise_interrupt) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def state_path() -> Path:
    """Where ``kvcadence harness start`` records the detached worker it started."""
    return cache_dir() / "harness-server.json"


def status() -> dict:
    """What the harness has: venv, model, a recorded detached server."""
    out: dict[str, object] = {
        "venv": str(venv_dir()),
        "venv_ready": venv_ready(),
        "model": str(model_dir()),
        "model_ready": (model_dir() / "config.json").is_file(),
    }
    sp = state_path()
    if sp.is_file():
        try:
            st = json.loads(sp.read_text())
            st["alive"] = pid_is_our_server(int(st["pid"]))
            out["server"] = st
        except (OSError, ValueError, KeyError):
            out["server"] = None
    return out


if __name__ == "__main__":  # python -m kvcadence.harness.worker setup
    if sys.argv[1:] == ["setup"]:
        print(ensure_venv(), ensure_model())
    else:
        print(json.dumps(status(), indent=2))
