"""Real multi-process runs: torchrun + gloo on CPU (three launches, ~5 s each).

1. ``kvcadence collectives`` at world 2 over the example prefixes.json: both payloads, all
   three paths, verification on, the results file schema and the weighted summary.
2. torchrun at world 3 with page counts not divisible by 3 (uneven ownership, padding).
3. A worker with a broken scatter on rank 1: every rank fails loudly, nobody hangs.

Workers run with ``PYTHONWARNINGS=error::FutureWarning`` so the deprecated all-gather name
(or any other FutureWarning) fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcadence.cli import main
from kvcadence.kernels.options import PATHS

pytestmark = pytest.mark.torchrun

HERE = Path(__file__).parent
EXAMPLE = HERE / "prefixes_example.json"
SMALL = ["--kv-dim", "8", "--index-page-bytes", "96", "--warmup", "1", "--repeat", "3"]
RESULT_KEYS = {
    "payload", "prefix_tokens", "prefix_pages", "path", "full_mib", "packed_mib_per_rank",
    "gpu_ms_avg", "gpu_ms_p50", "gpu_ms_min", "gpu_ms_max_rank_avg", "cpu_ms_avg",
    "cpu_ms_p50", "cpu_ms_max_rank_avg", "time_source", "algbw_gbps", "busbw_gbps",
    "goodput_gbps", "world_size", "backend", "dtype", "verified",
}  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONWARNINGS"] = "error::FutureWarning"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _torchrun(nproc: int, target: list[str], argv: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), *target, *argv]  # fmt: skip
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_collectives_world2_prefixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    for k, v in _env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # torchrun's banner case
    out = tmp_path / "results.jsonl"
    rc = main(
        ["collectives", "--nproc-per-node", "2", "--prefixes", str(EXAMPLE), "--payload", "both",
         "--out", str(out), *SMALL],
        stages=["kernels"],
    )  # fmt: skip
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    assert "FutureWarning" not in captured.err
    assert "OMP_NUM_THREADS" not in captured.err and "*****" not in captured.err  # no banner
    records = _records(out)
    results = [r for r in records if r["record"] == "result"]
    summaries = [r for r in records if r["record"] == "summary"]
    sizes = [64, 256, 640, 1280, 2048, 4096, 8000, 8192]
    assert len(results) == 2 * len(sizes) * 3
    assert {(r["payload"], r["prefix_tokens"], r["path"]) for r in results} == {
        (p, t, path) for p in ("mla", "index") for t in sizes for path in PATHS
    }
    for r in results:
        assert RESULT_KEYS <= set(r)
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["verified"] is True
        assert r["time_source"] == "wall" and r["gpu_ms_avg"] is None
        assert r["prefix_pages"] == -(-r["prefix_tokens"] // 64)
        assert r["all_gather_api"] == "all_gather_single" or not hasattr(
            __import__("torch.distributed").distributed, "all_gather_single"
        )
        factor = 1.0 if r["path"] == "dense_all_reduce" else 0.5  # 2(n-1)/n, (n-1)/n at n=2
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
        assert r["cpu_ms_max_rank_avg"] >= r["cpu_ms_avg"] * (1 - 1e-9)
    # 8000 tokens = 125 pages: odd, so world 2 pads one page
    odd = next(r for r in results if r["prefix_tokens"] == 8000 and r["payload"] == "index")
    assert odd["padding_pages"] == 1
    assert odd["packed_mib_per_rank"] == pytest.approx(63 * 96 / 2**20)
    assert [s["payload"] for s in summaries] == ["mla", "index"]
    for s in summaries:
        assert set(s["expected_ms"]) == set(PATHS) and s["leader"] in PATHS
        # a winner only outside the spread; else the paths within it are named
        assert s["winner"] in (s["leader"], None) and bool(s["winner"]) != bool(s["within_spread"])
        assert s["prefix_dist"] == "cached_tokens" and s["world_size"] == 2
    assert "== expected cost per prefix, payload mla" in captured.out
    assert "fastest path by size:" in captured.out


def test_torchrun_world3_uneven(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    # 1 page (< world), 5 pages (uneven), 6 pages (even), 7 pages (uneven)
    proc = _torchrun(
        3,
        ["-m", "kvcadence.kernels"],
        ["--tokens", "10", "80", "96", "112", "--page-size", "16", "--dtype", "fp32",
         "--out", str(out), *SMALL],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FutureWarning" not in proc.stderr
    results = _records(out)
    assert len(results) == 2 * 4 * 3 and all(r["verified"] for r in results)
    pad = {r["prefix_pages"]: r["padding_pages"] for r in results}
    assert pad == {1: 2, 5: 1, 6: 0, 7: 2}
    r = next(x for x in results if x["prefix_pages"] == 7 and x["payload"] == "mla")
    assert r["dtype"] == "fp32" and r["page_bytes"] == 16 * 8 * 4
    assert r["packed_mib_per_rank"] == pytest.approx(3 * 512 / 2**20)
    ag = next(x for x in results if x["prefix_pages"] == 7 and x["path"] != "dense_all_reduce")
    assert ag["bw_bytes"] == 9 * ag["page_bytes"]  # all-gather S: total gathered, padding incl.
    assert ag["busbw_gbps"] == pytest.approx(ag["algbw_gbps"] * 2 / 3)
    assert ag["goodput_gbps"] == pytest.approx(ag["algbw_gbps"] * 7 / 9)
    ar = next(x for x in results if x["prefix_pages"] == 7 and x["path"] == "dense_all_reduce")
    assert ar["bw_bytes"] == 7 * ar["page_bytes"]
    assert ar["busbw_gbps"] == pytest.approx(ar["algbw_gbps"] * 4 / 3)
    assert "packed_all_gather_rank_major" in proc.stdout  # rank 0 printed the table


def test_torchrun_broken_scatter_fails_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    proc = _torchrun(
        2,
        [str(HERE / "broken_scatter_worker.py")],
        ["--tokens", "64", "--page-size", "16", "--payload", "mla", "--out", str(out), *SMALL],
    )
    assert proc.returncode != 0
    err = proc.stderr
    assert (
        "kvcadence: error: [rank 1] verification failed: packed_all_gather_scatter on rank 1/2"
        in err
    )
    assert "first wrong pages: 0 (owner rank 0), 1 (owner rank 1)" in err
    assert "kvcadence: error: verification failed: packed_all_gather_scatter produced a wrong " \
        "prefix on rank(s) 1" in err  # fmt: skip
    # the dense path ran (and was verified) before the broken one: its record is kept
    assert [r["path"] for r in _records(out)] == ["dense_all_reduce"]
