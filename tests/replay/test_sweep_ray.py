"""``replay --sweep --executor ray``: the same hive-partitioned Parquet dataset as the
process pool, on a real Ray head started here on 127.0.0.1 (``RAY_ADDRESS``) and on the
private local instance the command starts itself when ``RAY_ADDRESS`` is unset.

Ray runs only in subprocesses (the head, the ``kvcadence`` commands): this process never
imports it. Everything listens on 127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's
single-machine switch), with token authentication (a random token for this module), no
dashboard, 2 CPUs; the head is stopped (SIGTERM to the ``ray start --block`` process we
started, which stops its children) and its temp dir removed at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvcadence.replay.sweep import run_sweep
from kvcadence.replay.sweeppoints import parse_sweep
from tests.replay.test_fleet import _write_source, two_rank_records

RAY_BIN = Path(sys.executable).with_name("ray")
SWEEP = ["--sweep", "route=recorded,cache_aware", "--sweep", "max_total_tokens=150,300"]


def _ray_env(**extra: str) -> dict[str, str]:
    """The environment without any RAY_* variable of the caller's, plus ``extra``. The
    commands get no loopback switch: ``replay.executors`` sets it itself (for a loopback
    RAY_ADDRESS and for its private instance)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    """A real Ray head on 127.0.0.1 (2 CPUs, no dashboard); yields the env that reaches it."""
    assert RAY_BIN.exists(), f"{RAY_BIN}: Ray is not installed (make test installs .[ray])"
    token = secrets.token_hex(32)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="kvc-ray-")  # short: Ray's socket paths live under it
    log = open(Path(temp) / "head.log", "w")  # noqa: SIM115 (closed below)
    head = subprocess.Popen(
        [
            str(RAY_BIN),
            "start",
            "--head",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-cpus",
            "2",
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
            "--object-store-memory",
            str(100 * 2**20),
            "--temp-dir",
            temp,
        ],  # fmt: skip
        env=_ray_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", **auth),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # the GCS port accepts once the head is up
            assert head.poll() is None, (Path(temp) / "head.log").read_text()[-2000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the Ray head did not start in 60 s"
                time.sleep(0.2)
        yield _ray_env(RAY_ADDRESS=address, **auth)
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=40)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-sweep")
    recs = two_rank_records()
    _write_source(tmp / "w0", recs, 2, pool=300)
    _write_source(tmp / "w1", recs[::2], 2, pool=200)
    return tmp


def _replay(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcadence", "replay", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=180,
    )


def _dataset(path: Path) -> tuple[list[str], list[dict]]:
    """(relative file paths, every row with its hive partition columns, sorted)."""
    import pyarrow.dataset as pads

    files = sorted(str(p.relative_to(path)) for p in path.rglob("*.parquet"))
    table = pads.dataset(str(path), format="parquet", partitioning="hive").to_table()
    rows = table.to_pylist()
    return files, sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str))


def _summaries(path: Path) -> list[dict]:
    out = json.loads((path / "_sweep.json").read_text())
    for s in out:
        s.pop("job_wall_s")
        s.pop("wall_s", None)
    return out


def test_sweep_on_a_ray_head_writes_the_process_pool_dataset(ray_head, sources):
    """A two-worker fleet swept over 4 points: Ray (RAY_ADDRESS) and the process pool give
    the same files, the same rows and the same job summaries."""
    pool = sources / "pool"
    run_sweep([sources / "w0", sources / "w1"], parse_sweep(SWEEP[1::2]), pool, jobs=2)
    # relative bundle paths: the driver makes them absolute for the cluster's workers
    r = _replay(["w0", "w1", *SWEEP, "--executor", "ray", "--out", "ray", "--json"],
                ray_head, sources)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [j["point"] for j in out["jobs"]] == [
        {"route": "recorded", "max_total_tokens": 150},
        {"route": "recorded", "max_total_tokens": 300},
        {"route": "cache_aware", "max_total_tokens": 150},
        {"route": "cache_aware", "max_total_tokens": 300},
    ]
    pool_files, pool_rows = _dataset(pool)
    ray_files, ray_rows = _dataset(sources / "ray")
    assert len(pool_files) > 4 and ray_files == pool_files
    assert len(pool_rows) > 100 and ray_rows == pool_rows
    assert {r["worker"] for r in ray_rows} == {"w0", "w1"}
    ray_sum, pool_sum = _summaries(sources / "ray"), _summaries(pool)
    assert [s["bundles"] for s in ray_sum] == [["w0", "w1"]] * 4  # as given on the command line
    for a, b in zip(ray_sum, pool_sum, strict=True):
        a.pop("bundles"), b.pop("bundles")
        assert a == b


def test_sweep_each_on_a_private_local_ray(sources):
    """RAY_ADDRESS unset: the command starts its own Ray on 127.0.0.1 and stops it; --each
    (one job per bundle) gives the process pool's dataset."""
    env = _ray_env()  # no RAY_ADDRESS, no token: the command makes its own
    args = ["w0", "w1", "--each", "--sweep", "route=round_robin", "--jobs", "2"]
    r = _replay([*args, "--executor", "ray", "--out", "each-ray"], env, sources)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 job(s)" in r.stdout
    r = _replay([*args, "--out", "each-pool"], env, sources)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _dataset(sources / "each-ray") == _dataset(sources / "each-pool")


def test_executor_ray_without_ray_is_one_line_and_exit_2(sources, tmp_path):
    stub = tmp_path / "noray"
    stub.mkdir()
    (stub / "ray.py").write_text("raise ModuleNotFoundError(\"No module named 'ray'\")\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(stub), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = _replay(["w0", *SWEEP, "--executor", "ray", "--out", str(tmp_path / "o")], env, sources)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "Ray is not installed" in r.stderr and "kvcadence[ray]" in r.stderr
    assert not (tmp_path / "o").exists()


def test_executor_ray_unreachable_address_is_one_line_and_exit_2(sources, tmp_path):
    env = _ray_env(RAY_ADDRESS=f"127.0.0.1:{_free_port()}")  # nothing listens there
    r = _replay(["w0", *SWEEP, "--executor", "ray", "--out", str(tmp_path / "o")], env, sources)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "no Ray head answers there" in r.stderr
    assert not (tmp_path / "o").exists()


def test_executor_ray_needs_a_sweep(sources, tmp_path):
    r = _replay(["w0", "--executor", "ray", "--out", str(tmp_path / "o")], dict(os.environ),
                sources)  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "runs --sweep jobs" in r.stderr
    assert not (tmp_path / "o").exists()
