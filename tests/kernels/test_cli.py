"""``kvcadence collectives``: registration, the torchrun command line, bad input before launch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvcadence.cli import build_parser, main
from kvcadence.kernels.cli import launch_command

EXAMPLE = Path(__file__).with_name("prefixes_example.json")


def test_launch_command_keeps_the_flags(tmp_path: Path) -> None:
    args = build_parser(["kernels"]).parse_args(
        ["collectives", "--nproc-per-node", "3", "--prefixes", str(EXAMPLE),
         "--prefix-dist", "stored_run_tokens", "--payload", "index", "--dtype", "fp16",
         "--no-verify", "--paths", "dense_all_reduce", "packed_all_gather_rank_major",
         "--out", str(tmp_path / "r.jsonl"), "--repeat", "7"]
    )  # fmt: skip
    cmd = launch_command(args)
    assert cmd[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "3"]  # fmt: skip
    assert cmd[6:8] == ["-m", "kvcadence.kernels"]
    worker = cmd[8:]
    assert worker[worker.index("--prefixes") + 1] == str(EXAMPLE.resolve())
    assert worker[worker.index("--out") + 1] == str((tmp_path / "r.jsonl").resolve())
    assert "--no-verify" in worker and "--tokens" not in worker and "--page-size" not in worker
    assert worker[worker.index("--paths") + 1 :][:2] == [
        "dense_all_reduce", "packed_all_gather_rank_major"
    ]  # fmt: skip
    # the worker parses exactly what the launcher passes
    from kvcadence.kernels.options import build_parser as worker_parser
    from kvcadence.kernels.options import config_from_args

    cfg = config_from_args(worker_parser("w").parse_args(worker))
    assert cfg.payloads == ("index",) and cfg.dtype == "fp16" and cfg.repeat == 7
    assert cfg.prefix_dist == "stored_run_tokens" and cfg.verify is False
    assert cfg.tokens == (64, 128, 192, 448, 640, 705, 1024)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefixes", "missing.json"], "no such prefixes file"),
        (["--tokens", "64", "--prefixes", str(EXAMPLE)], "not both"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be in 1..64"),
    ],
)
def test_bad_input_fails_before_launch(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["collectives", *argv], stages=["kernels"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("kvcadence: error: ")


def test_workers_get_omp_threads_so_torchrun_prints_no_banner() -> None:
    from kvcadence.kernels.cli import launch_env

    env = launch_env({"PATH": "/bin"})
    # torchrun prints its OMP_NUM_THREADS banner only when the variable is unset
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == "/bin"
    root = str(Path(__file__).resolve().parents[2])
    assert env["PYTHONPATH"].split(":")[0] == root
    assert launch_env({"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"  # the user's wins


def test_repeat_is_left_to_the_worker_when_not_given() -> None:
    args = build_parser(["kernels"]).parse_args(["collectives", "--tokens", "64"])
    assert "--repeat" not in launch_command(args)
    from kvcadence.kernels.options import build_parser as worker_parser
    from kvcadence.kernels.options import config_from_args

    assert config_from_args(worker_parser("w").parse_args(["--tokens", "64"])).repeat is None


def test_more_ranks_than_gpus_is_one_line_before_launch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("torchrun launched"))
    argv = ["collectives", "--backend", "nccl", "--nproc-per-node", "2", "--tokens", "16"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "kvcadence: error: --backend nccl needs one GPU per rank: 2 ranks on this node "
        "but 1 GPU(s) visible (use fewer ranks, or gloo)\n"
    )


def test_a_run_that_cannot_fit_is_refused_before_launch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--tokens 100000000000`` (about 4 PB of buffers a rank): refused in one line before
    torchrun starts -- the workers allocated until the kernel killed them (12.7 GB resident
    on the 2-core box) before this check."""
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("torchrun launched"))
    argv = ["collectives", "--backend", "gloo", "--tokens", "100000000000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcadence: error: the 100000000000-token mla case needs ")
    assert "GiB is available" in err and err.count("\n") == 1


def test_the_preflight_counts_every_buffer_of_the_largest_case() -> None:
    from kvcadence.kernels.memory import case_bytes, memory_problem
    from kvcadence.kernels.options import Config
    from kvcadence.kernels.paths import payload_spec

    shape = {"page_size": 64, "kv_dim": 576, "index_page_bytes": 8448, "dtype": "bf16"}
    assert payload_spec("mla", **shape).page_bytes == 64 * 576 * 2
    assert payload_spec("index", **shape).page_bytes == 8448
    # 10 pages over 4 ranks: 3 a rank padded; pool 3 + 1, dense 10, packed 3, gathered 12
    assert case_bytes(10, 100, 4)[0] == 100 * (4 + 10 + 3 + 12)
    cfg = Config(payloads=("mla", "index"), tokens=(4096, 65536), page_size=64)
    page = 64 * 576 * 2
    need = case_bytes(1024, page, 2)[0]  # 65536 tokens: the largest case
    assert memory_problem(cfg, 2, False, host=10 * need) is None
    msg = memory_problem(cfg, 2, False, host=need)
    assert msg is not None and msg.startswith("the 65536-token mla case needs")
    assert memory_problem(cfg, 2, False, host=None) is None  # unknown: not checked
    # NCCL: the buffers on one GPU, only the indices on the host
    assert memory_problem(cfg, 2, True, host=need, device=10 * need) is None
    assert "one GPU has" in (memory_problem(cfg, 2, True, host=10 * need, device=need) or "")
