"""The worker loop on an in-process world of one (gloo): records, summaries, --out, errors.

Multi-rank runs are in test_torchrun.py (few launches); this covers the same code paths fast.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from kvcadence.errors import KernelsError
from kvcadence.kernels import bench, paths
from kvcadence.kernels.options import PATHS, build_parser, config_from_args

EXAMPLE = Path(__file__).with_name("prefixes_example.json")
SMALL = ["--kv-dim", "4", "--index-page-bytes", "32", "--warmup", "1", "--repeat", "2"]
RESULT_KEYS = {
    "payload", "prefix_tokens", "prefix_pages", "path", "full_mib", "packed_mib_per_rank",
    "gpu_ms_avg", "gpu_ms_p50", "gpu_ms_min", "gpu_ms_max_rank_avg", "cpu_ms_avg",
    "cpu_ms_p50", "cpu_ms_max_rank_avg", "time_source", "algbw_gbps", "busbw_gbps",
    "goodput_gbps", "world_size", "backend", "dtype", "verified",
}  # fmt: skip


def _run(argv: list[str]) -> str:
    # gloo pinned: on a CUDA box `auto` picks NCCL, whose repeat default and records differ
    cfg = config_from_args(build_parser("t").parse_args(["--backend", "gloo", *argv]))
    buf = io.StringIO()
    assert bench.run(cfg, stdout=buf) == 0
    return buf.getvalue()


def test_tokens_run_writes_records(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    out.write_text('{"earlier": "line kept"}\n')
    text = _run(["--tokens", "100", "64", "--page-size", "16", "--out", str(out), *SMALL])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0] == {"earlier": "line kept"}  # appended, nothing lost
    rows = lines[1:]
    assert len(rows) == 2 * 2 * 3  # payloads × sizes × paths
    for r in rows:
        assert RESULT_KEYS <= set(r)
        assert r["record"] == "result" and r["verified"] is True
        assert r["world_size"] == 1 and r["backend"] == "gloo" and r["time_source"] == "wall"
        assert r["gpu_ms_avg"] is None and r["gpu_ms_max_rank_avg"] is None
        assert r["cpu_ms_min"] <= r["cpu_ms_p50"] and r["cpu_ms_avg"] <= r["cpu_ms_max_rank_avg"]
        assert r["busbw_gbps"] == 0.0  # world 1: nothing crosses a link
        assert r["all_gather_api"] in ("all_gather_single", "all_gather_into_tensor")
    r = next(x for x in rows if x["payload"] == "mla" and x["prefix_tokens"] == 100)
    assert r["prefix_pages"] == 7 and r["dtype"] == "bf16" and r["page_bytes"] == 16 * 4 * 2
    assert r["full_mib"] == pytest.approx(7 * 128 / 2**20)
    i = next(x for x in rows if x["payload"] == "index")
    assert i["dtype"] == "uint8" and i["page_bytes"] == 32
    assert [x["path"] for x in rows[:3]] == list(PATHS)
    assert "packed_all_gather_rank_major" in text and "# results" not in text  # table only


def test_prefixes_run_adds_weighted_summaries(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    text = _run(["--prefixes", str(EXAMPLE), "--payload", "index", "--out", str(out), *SMALL])
    records = [json.loads(x) for x in out.read_text().splitlines()]
    results = [r for r in records if r["record"] == "result"]
    summaries = [r for r in records if r["record"] == "summary"]
    assert sorted({r["prefix_tokens"] for r in results}) == [
        64, 256, 640, 1280, 2048, 4096, 8000, 8192
    ]  # fmt: skip
    assert {r["page_size"] for r in results} == {64}  # taken from prefixes.json
    assert {r["prefix_tokens"]: r["weight"] for r in results if r["weight"]} == {
        256: 0.3, 1280: 0.3, 4096: 0.2
    }  # fmt: skip
    (s,) = summaries
    assert s["payload"] == "index" and s["prefix_dist"] == "cached_tokens"
    assert s["zero_prefix_weight"] == pytest.approx(0.2)
    t = {(r["prefix_tokens"], r["path"]): r["cpu_ms_avg"] for r in results}
    for path in PATHS:
        want = 0.3 * t[256, path] + 0.3 * t[1280, path] + 0.2 * t[4096, path]
        assert s["expected_ms"][path] == pytest.approx(want)
    # the leader has the lowest weighted median; it is the winner only outside the spread
    p50 = {(r["prefix_tokens"], r["path"]): r["cpu_ms_p50"] for r in results}
    med = {p: 0.3 * p50[256, p] + 0.3 * p50[1280, p] + 0.2 * p50[4096, p] for p in PATHS}
    assert s["expected_ms_p50"] == pytest.approx(med)
    assert s["leader"] == min(sorted(med), key=med.get)
    assert s["winner"] in (s["leader"], None) and (s["winner"] is None) == bool(s["within_spread"])
    covered = sorted(x for r in s["ranges"] for x in (r["from_tokens"], r["to_tokens"]))
    assert covered[0] == 64 and covered[-1] == 8192
    assert "== expected cost per prefix, payload index" in text
    assert "fastest path by size:" in text


def test_paths_subset_and_no_verify_to_stdout() -> None:
    text = _run(["--tokens", "32", "--payload", "mla", "--paths", "dense_all_reduce",
                 "--no-verify", "--page-size", "16", *SMALL])  # fmt: skip
    lines = text.splitlines()
    json_lines = [json.loads(x) for x in lines[lines.index("# results (JSON lines)") + 1 :]]
    assert [r["path"] for r in json_lines] == ["dense_all_reduce"]
    assert json_lines[0]["verified"] is False


def test_verification_mismatch_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    real_scatter = paths.RankCase.scatter

    def broken_scatter(self: paths.RankCase):  # type: ignore[no-untyped-def]
        dense = real_scatter(self)
        dense[[0, -1]] = dense[[-1, 0]]  # swap the first and the last page
        return dense

    monkeypatch.setattr(paths.RankCase, "scatter", broken_scatter)
    with pytest.raises(KernelsError, match=r"packed_all_gather_scatter on rank 0/1: .* 0 \(owner"):
        _run(["--tokens", "200", "--page-size", "16", "--payload", "mla", *SMALL])


def test_main_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--tokens", "64", "--prefixes", str(EXAMPLE)]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvcadence: error: give either --tokens or --prefixes, not both"
    )
    bad = tmp_path / "p.json"
    bad.write_text('{"schema": "other"}')
    assert bench.main(["--prefixes", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvcadence: error: ") and "field 'schema'" in err and "\n" not in err
    assert bench.main(["--tokens", "64", "--out", str(tmp_path / "no" / "r.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        bench.main(["--tokens", "0"])
    assert info.value.code == 2


def test_cpu_default_repeats_and_spread_fields(tmp_path: Path) -> None:
    from kvcadence.kernels.options import DEFAULT_REPEAT_CPU

    out = tmp_path / "r.jsonl"
    argv = ["--tokens", "64", "--page-size", "16", "--payload", "index", "--paths",
            "dense_all_reduce", "--kv-dim", "4", "--index-page-bytes", "32", "--warmup", "0"]  # fmt: skip
    _run([*argv, "--out", str(out)])
    (row,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert row["repeat"] == DEFAULT_REPEAT_CPU == 50  # no --repeat on CPU: more repeats
    assert row["cpu_ms_min"] <= row["cpu_ms_p25"] <= row["cpu_ms_p50"] <= row["cpu_ms_p75"]
    assert row["cpu_ms_p75"] <= row["cpu_ms_max"] and row["gpu_ms_p25"] is None


def _gpus(monkeypatch: pytest.MonkeyPatch, n: int, local_world: int | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))


def test_nccl_without_cuda_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _gpus(monkeypatch, 0, None)
    assert bench.main(["--backend", "nccl", "--tokens", "64"]) == 2
    assert capsys.readouterr().err == (
        "kvcadence: error: --backend nccl needs CUDA, and torch sees no GPU (use gloo)\n"
    )
    assert bench.pick_backend("auto") == ("gloo", torch.device("cpu"))


def test_more_ranks_than_gpus_fail_on_every_rank_and_rank_0_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # seen on one H200: two ranks, one GPU; rank 1 failed alone and rank 0 printed nothing
    _gpus(monkeypatch, 1, 2)
    monkeypatch.setenv("RANK", "0")
    assert bench.main(["--backend", "nccl", "--tokens", "64"]) == 2
    assert capsys.readouterr().err == (
        "kvcadence: error: --backend nccl needs one GPU per rank: 2 ranks on this node "
        "but 1 GPU(s) visible (use fewer ranks, or gloo)\n"
    )
    # auto runs such a node on gloo instead of failing
    assert bench.pick_backend("auto") == ("gloo", torch.device("cpu"))
