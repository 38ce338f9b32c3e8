"""The torchrun worker: run every (payload, size, path) case, time it, verify it, report it.

Per case and path, every rank runs ``--warmup`` untimed iterations, then ``--repeat`` timed
ones, each preceded by a barrier (a 1-element all-reduce + device sync). On CUDA a timed
iteration is measured with CUDA events on the current stream (``gpu_ms``) and with the host
clock around enqueue + event sync (``cpu_ms``); on CPU only the host wall clock exists
(``gpu_ms_*`` are null, ``time_source`` is ``"wall"``). The per-rank samples are gathered
as a float64 tensor (no pickling) and rank 0 summarises them (``kvcadence.kernels.bw``),
prints a table row and appends one JSON line to ``--out``. After the timed loop every rank
checks its merged prefix against the reference; a mismatch on any rank makes every rank raise
``KernelsError`` (so no rank hangs in the next collective).

Without torchrun's environment (``WORLD_SIZE`` unset) it runs as a world of one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import torch
import torch.distributed as dist

from kvcadence.errors import KernelsError, KvcadenceError, UsageError
from kvcadence.kernels import layout, report
from kvcadence.kernels.bw import MIB, algbw_gbps, busbw_gbps, gbps, summarize
from kvcadence.kernels.compat import resolve_all_gather
from kvcadence.kernels.options import (
    DEFAULT_REPEAT_CPU,
    DEFAULT_REPEAT_CUDA,
    Config,
    build_parser,
    config_from_args,
    nccl_problem,
)
from kvcadence.kernels.paths import (
    RankCase,
    collective_of,
    describe_mismatch,
    payload_spec,
    run_path,
    verify,
)
from kvcadence.kernels.summary import prefix_summary

PROG = "python -m kvcadence.kernels"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of ``torchrun ... -m kvcadence.kernels``; returns the exit code."""
    args = build_parser(PROG).parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        return run(config_from_args(args))
    except KvcadenceError as exc:
        if rank == 0 or not isinstance(exc, UsageError):
            tag = f"[rank {rank}] " if "WORLD_SIZE" in os.environ and rank else ""
            print(f"kvcadence: error: {tag}{exc}", file=sys.stderr, flush=True)
        return exc.exit_code


def run(cfg: Config, *, stdout: IO[str] | None = None) -> int:
    """Initialise the process group if needed, run every case, tear down what it set up."""
    backend, device = pick_backend(cfg.backend)
    owns_group = not dist.is_initialized()
    if owns_group:
        init_group(backend, device)
    try:
        Runner(cfg, dist.get_backend(), device, stdout or sys.stdout).run_all()
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def pick_backend(requested: str) -> tuple[str, Any]:
    """``(backend, device)``: NCCL on this rank's GPU, gloo on CPU.

    NCCL needs a GPU of its own for every rank on the node (two ranks on one GPU do not
    run), so ``auto`` picks NCCL only when each of the node's ranks (torchrun's
    ``LOCAL_WORLD_SIZE``) has one, and ``nccl`` with too few GPUs is a usage error. The
    check reads the node's rank count, the same on every rank, so rank 0 (the one that
    prints usage errors) fails with the same line as the rank that has no GPU.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if requested == "auto":
        backend = "gloo" if nccl_problem(gpus, local_world) else "nccl"
    else:
        backend = requested
    if backend == "nccl":
        problem = nccl_problem(gpus, local_world)
        if problem:
            raise UsageError(problem)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return backend, torch.device("cuda", local)
    if backend != "gloo":
        raise UsageError(f"unknown backend {backend!r}")
    return backend, torch.device("cpu")


def init_group(backend: str, device: Any) -> None:
    """torchrun's env:// rendezvous, or an in-process world of one."""
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


class DistCollectives:
    """The real collectives (all-gather resolved through the torch-version shim)."""

    def __init__(self) -> None:
        self._dist = dist
        self._all_gather = resolve_all_gather(dist)
        self.all_gather_api = self._all_gather.__name__

    def all_reduce_sum(self, tensor: Any) -> None:
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.SUM)

    def all_gather(self, output: Any, input: Any) -> None:
        self._all_gather(output, input)


class Runner:
    """Runs the cases of one :class:`Config` on an initialised process group."""

    def __init__(self, cfg: Config, backend: str, device: Any, stdout: IO[str]) -> None:
        self.torch, self.dist = torch, dist
        self.cuda = device.type == "cuda"
        if cfg.repeat is None:  # more repeats where times are noisier (options.DEFAULT_REPEAT_*)
            cfg = dataclasses.replace(
                cfg, repeat=DEFAULT_REPEAT_CUDA if self.cuda else DEFAULT_REPEAT_CPU
            )
        self.cfg, self.backend, self.device, self.stdout = cfg, backend, device, stdout
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.time_source = "cuda_event" if self.cuda else "wall"
        self.coll = DistCollectives()
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.rows: list[dict[str, Any]] = []
        self.device_name = (
            torch.cuda.get_device_name(device)
            if self.cuda
            else (platform.processor() or platform.machine())
        )

    # --- plumbing ----------------------------------------------------------------------
    def barrier(self) -> None:
        self.dist.all_reduce(self._flag)
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def emit(self, text: str) -> None:
        if self.rank == 0:
            print(text, file=self.stdout, flush=True)

    def time_once(self, fn: Callable[[], None]) -> tuple[float, float]:
        """``(gpu_ms or nan, cpu_ms)`` of one call."""
        self.barrier()
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fn()
            end.record()
            end.synchronize()
            cpu = (time.perf_counter() - t0) * 1e3
            return float(start.elapsed_time(end)), cpu
        t0 = time.perf_counter()
        fn()
        return float("nan"), (time.perf_counter() - t0) * 1e3

    def gather_samples(self, samples: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
        """Every rank's samples (rank-major), via an all-gather of a float64 tensor."""
        torch = self.torch
        local = torch.tensor(samples, dtype=torch.float64, device=self.device)
        out = torch.empty((self.world * len(samples), 2), dtype=torch.float64, device=self.device)
        self.coll.all_gather(out, local)
        flat = out.cpu().tolist()
        n = len(samples)
        return [[(g, c) for g, c in flat[r * n : (r + 1) * n]] for r in range(self.world)]

    def check(self, path: str, case: Any) -> None:
        """Verify on every rank; if any rank is wrong, every rank raises."""
        torch = self.torch
        bad = verify(path, case)
        flags = torch.zeros(self.world, dtype=torch.int32, device=self.device)
        mine = torch.tensor([1 if bad else 0], dtype=torch.int32, device=self.device)
        self.coll.all_gather(flags, mine)
        failed = [r for r, f in enumerate(flags.cpu().tolist()) if f]
        if bad:
            raise KernelsError("verification failed: " + describe_mismatch(path, case, bad))
        if failed:
            raise KernelsError(
                f"verification failed: {path} produced a wrong prefix on rank(s) "
                f"{', '.join(map(str, failed))} (see their error lines)"
            )

    # --- the loop ----------------------------------------------------------------------
    def run_all(self) -> None:
        cfg = self.cfg
        out = self._open_out()
        try:
            self.emit(report.table_header(self.time_source, self.world, self.backend))
            for payload in cfg.payloads:
                spec = payload_spec(
                    payload,
                    page_size=cfg.page_size,
                    kv_dim=cfg.kv_dim,
                    index_page_bytes=cfg.index_page_bytes,
                    dtype=cfg.dtype,
                )
                rows = []
                for tokens in cfg.tokens:
                    for row in self.run_case(spec, tokens):
                        rows.append(row)
                        self.emit(report.table_row(row))
                        self._write(out, row)
                self.rows.extend(rows)
                if cfg.weights is not None:
                    self.summarise(rows, out)
            if out is None and self.rank == 0:
                print("# results (JSON lines)", file=self.stdout)
                for row in self.rows:
                    print(json.dumps(row), file=self.stdout)
                self.stdout.flush()
        finally:
            if out is not None:
                out.close()

    def summarise(self, rows: list[dict[str, Any]], out: IO[str] | None) -> None:
        assert self.cfg.weights is not None
        summary = prefix_summary(
            rows,
            self.cfg.weights,
            self.cfg.paths,
            extra={**self.cfg.prefix_info, "page_size": self.cfg.page_size},
        )
        self.emit(report.summary_text(summary))
        self._write(out, summary)
        self.rows.append(summary)

    def run_case(self, spec: Any, tokens: int) -> Iterator[dict[str, Any]]:
        """Yield one record per path as soon as it is measured and verified."""
        cfg = self.cfg
        repeat = cfg.repeat
        assert repeat is not None  # set from the device in __init__
        pages = layout.prefix_pages(tokens, cfg.page_size)
        case = RankCase(spec, pages, self.world, self.rank, self.device)
        try:
            for path in cfg.paths:

                def step(path: str = path) -> None:
                    run_path(path, case, self.coll)

                for _ in range(cfg.warmup):
                    step()
                samples = [self.time_once(step) for _ in range(repeat)]
                if cfg.verify:
                    self.check(path, case)
                per_rank = self.gather_samples(samples)
                yield self.record(spec, tokens, case, path, collective_of(path), per_rank)
        finally:
            case.release()

    def record(
        self,
        spec: Any,
        tokens: int,
        case: Any,
        path: str,
        collective: str,
        per_rank: list[list[tuple[float, float]]],
    ) -> dict[str, Any]:
        cpu = summarize([[c for _g, c in r] for r in per_rank])
        gpu = summarize([[g for g, _c in r] for r in per_rank]) if self.cuda else None
        t = gpu["avg"] if gpu else cpu["avg"]
        s_bytes = case.full_bytes if collective == "all_reduce" else case.gathered_bytes
        weights = self.cfg.weights
        return {
            "record": "result",
            "payload": spec.name,
            "prefix_tokens": tokens,
            "prefix_pages": case.pages,
            "path": path,
            "full_mib": case.full_bytes / MIB,
            "packed_mib_per_rank": case.packed_bytes_per_rank / MIB,
            "gpu_ms_avg": gpu["avg"] if gpu else None,
            "gpu_ms_p50": gpu["p50"] if gpu else None,
            "gpu_ms_min": gpu["min"] if gpu else None,
            "gpu_ms_max_rank_avg": gpu["max_rank_avg"] if gpu else None,
            "gpu_ms_p25": gpu["p25"] if gpu else None,
            "gpu_ms_p75": gpu["p75"] if gpu else None,
            "gpu_ms_max": gpu["max"] if gpu else None,
            "cpu_ms_avg": cpu["avg"],
            "cpu_ms_p50": cpu["p50"],
            "cpu_ms_min": cpu["min"],
            "cpu_ms_max_rank_avg": cpu["max_rank_avg"],
            "cpu_ms_p25": cpu["p25"],
            "cpu_ms_p75": cpu["p75"],
            "cpu_ms_max": cpu["max"],
            "time_source": self.time_source,
            "collective": collective,
            "bw_bytes": s_bytes,
            "algbw_gbps": algbw_gbps(s_bytes, t),
            "busbw_gbps": busbw_gbps(s_bytes, t, collective, self.world),
            "goodput_gbps": gbps(case.full_bytes, t),
            "padding_pages": layout.padding_pages(case.pages, self.world),
            "world_size": self.world,
            "backend": self.backend,
            "dtype": spec.dtype_name,
            "page_size": self.cfg.page_size,
            "page_bytes": spec.page_bytes,
            "warmup": self.cfg.warmup,
            "repeat": self.cfg.repeat,
            "verified": bool(self.cfg.verify),
            "weight": None if weights is None else weights.get(tokens, 0.0),
            "torch": self.torch.__version__,
            "all_gather_api": self.coll.all_gather_api,
            "device": self.device_name,
        }

    def _open_out(self) -> IO[str] | None:
        if self.rank != 0 or self.cfg.out is None:
            return None
        try:
            return open(self.cfg.out, "a", encoding="utf-8")  # noqa: SIM115 (closed in run_all)
        except OSError as exc:
            raise UsageError(f"--out {self.cfg.out}: cannot open for appending: {exc}") from None

    @staticmethod
    def _write(out: IO[str] | None, record: dict[str, Any]) -> None:
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()
