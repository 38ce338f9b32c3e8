"""Flags of the collective benchmark (shared by ``-m kvcadence.kernels`` and
``kvcadence collectives``) and their validation into a :class:`Config`. Standard library only.

Flags keep the upstream SGLang ``benchmark/hicache`` CP shared-KV benchmark's names and
defaults (``--payload``, ``--tokens``, ``--page-size``, ``--kv-dim``, ``--index-page-bytes``,
``--dtype``, ``--warmup``, ``--repeat``) and add ``--prefixes``/``--prefix-dist``,
``--backend``, ``--out``, ``--verify/--no-verify`` and ``--paths``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvcadence.errors import UsageError
from kvcadence.kernels.prefixes import load_prefixes

DENSE = "dense_all_reduce"
SCATTER = "packed_all_gather_scatter"
RANK_MAJOR = "packed_all_gather_rank_major"
PATHS: tuple[str, ...] = (DENSE, SCATTER, RANK_MAJOR)
PAYLOADS: tuple[str, ...] = ("mla", "index")
DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
BACKENDS: tuple[str, ...] = ("auto", "nccl", "gloo")
DEFAULT_TOKENS: tuple[int, ...] = (4096, 8192, 16384, 32768, 40320, 65536)
DEFAULT_PAGE_SIZE = 64
#: timed iterations per case when --repeat is not given: host wall times on CPU (gloo) are
#: much noisier than CUDA events, so more repeats there (the spread decides the winner)
DEFAULT_REPEAT_CUDA = 20
DEFAULT_REPEAT_CPU = 50


@dataclass(frozen=True)
class Config:
    """A validated benchmark request. ``weights`` is set only with ``--prefixes``."""

    payloads: tuple[str, ...]
    tokens: tuple[int, ...]
    page_size: int
    kv_dim: int = 576
    index_page_bytes: int = 8448
    dtype: str = "bf16"
    warmup: int = 5
    repeat: int | None = None  # None: DEFAULT_REPEAT_CUDA or _CPU, by the device (bench)
    backend: str = "auto"
    out: str | None = None
    verify: bool = True
    paths: tuple[str, ...] = PATHS
    prefixes: str | None = None
    prefix_dist: str = "cached_tokens"
    weights: dict[int, float] | None = None
    prefix_info: dict[str, object] = field(default_factory=dict)


def _positive(text: str) -> int:
    return _int_at_least(text, 1)


def _non_negative(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the benchmark flags to ``p``."""
    p.add_argument(
        "--payload",
        choices=("mla", "index", "both"),
        default="both",
        help="page payload: mla (page_size x kv_dim of --dtype), index (uint8 "
        "pages of --index-page-bytes) or both (default)",
    )
    p.add_argument(
        "--tokens",
        type=_positive,
        nargs="+",
        metavar="T",
        help=f"prefix sizes in tokens (default: {' '.join(map(str, DEFAULT_TOKENS))})",
    )
    p.add_argument(
        "--prefixes",
        metavar="PREFIXES_JSON",
        help="take sizes from an analysis prefixes.json (quantiles + histogram "
        "bins) and weight the results; excludes --tokens",
    )
    p.add_argument(
        "--prefix-dist",
        choices=("cached_tokens", "stored_run_tokens"),
        default="cached_tokens",
        help="which distribution of --prefixes (default cached_tokens)",
    )
    p.add_argument(
        "--page-size",
        type=_positive,
        default=None,
        help="tokens per page (default 64, or the page_size of --prefixes)",
    )
    p.add_argument(
        "--kv-dim", type=_positive, default=576, help="MLA elements per token (default 576)"
    )
    p.add_argument(
        "--index-page-bytes",
        type=_positive,
        default=8448,
        help="bytes per index page (default 8448)",
    )
    p.add_argument(
        "--dtype", choices=DTYPES, default="bf16", help="MLA payload dtype (default bf16)"
    )
    p.add_argument(
        "--warmup", type=_non_negative, default=5, help="untimed iterations per case (default 5)"
    )
    p.add_argument(
        "--repeat",
        type=_positive,
        default=None,
        help=f"timed iterations per case (default {DEFAULT_REPEAT_CUDA} on CUDA, "
        f"{DEFAULT_REPEAT_CPU} on CPU, whose wall times are noisier)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="auto (nccl when every rank on the node has a GPU of its own, else gloo), nccl "
        "or gloo (default auto)",
    )
    p.add_argument(
        "--out",
        metavar="RESULTS_JSONL",
        help="append one JSON line per result (and summaries) to this file",
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check every rank's merged prefix against the reference after the "
        "timed loop (default on)",
    )
    p.add_argument(
        "--paths",
        nargs="+",
        choices=PATHS,
        default=list(PATHS),
        metavar="PATH",
        help=f"subset of paths: {', '.join(PATHS)} (default all)",
    )


def nccl_problem(gpus: int, local_world: int) -> str | None:
    """Why NCCL cannot run ``local_world`` ranks on a node with ``gpus`` visible GPUs
    (0: torch sees none), or None. NCCL needs a GPU of its own for every rank."""
    if gpus == 0:
        return "--backend nccl needs CUDA, and torch sees no GPU (use gloo)"
    if local_world > gpus:
        return (
            f"--backend nccl needs one GPU per rank: {local_world} ranks on this node "
            f"but {gpus} GPU(s) visible (use fewer ranks, or gloo)"
        )
    return None


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The parser of ``python -m kvcadence.kernels`` (the torchrun entry)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Merge a context-parallel shared KV prefix three ways (dense all-reduce, "
        "packed all-gather + scatter, packed all-gather rank-major) and time them.",
    )
    add_arguments(p)
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    """Validate parsed flags (and read ``--prefixes``); raise ``UsageError``/``InputError``."""
    payloads = PAYLOADS if args.payload == "both" else (args.payload,)
    paths = tuple(p for p in PATHS if p in set(args.paths))
    weights = None
    info: dict[str, object] = {}
    if args.prefixes is not None:
        if args.tokens:
            raise UsageError("give either --tokens or --prefixes, not both")
        dist = load_prefixes(args.prefixes, args.prefix_dist)
        tokens = tuple(dist.case_tokens())
        if not tokens:
            raise UsageError(
                f"{args.prefixes}: distribution '{dist.dist}' has no prefix "
                "larger than 0 tokens; nothing to run"
            )
        weights = dist.weights()
        page_size = args.page_size or dist.page_size
        info = {
            "prefixes_file": str(args.prefixes),
            "prefix_dist": dist.dist,
            "prefix_n": dist.n,
            "prefix_page_size": dist.page_size,
            "quantiles": dict(dist.quantiles),
            "source": dist.source,
        }
    else:
        tokens = tuple(dict.fromkeys(args.tokens or DEFAULT_TOKENS))
        page_size = args.page_size or DEFAULT_PAGE_SIZE
    if args.out is not None:
        parent = Path(args.out).resolve().parent
        if not parent.is_dir():
            raise UsageError(f"--out {args.out}: directory {parent} does not exist")
        if Path(args.out).is_dir():
            raise UsageError(f"--out {args.out}: is a directory")
        if not os.access(parent, os.W_OK):
            raise UsageError(f"--out {args.out}: directory {parent} is not writable")
    return Config(
        payloads=payloads,
        tokens=tokens,
        page_size=page_size,
        kv_dim=args.kv_dim,
        index_page_bytes=args.index_page_bytes,
        dtype=args.dtype,
        warmup=args.warmup,
        repeat=args.repeat,
        backend=args.backend,
        out=args.out,
        verify=args.verify,
        paths=paths,
        prefixes=args.prefixes,
        prefix_dist=args.prefix_dist,
        weights=weights,
        prefix_info=info,
    )


def worker_argv(args: argparse.Namespace) -> list[str]:
    """Rebuild the flags for ``-m kvcadence.kernels`` from parsed ``args`` (for the launcher)."""
    argv = ["--payload", args.payload]
    if args.prefixes is not None:
        argv += [
            "--prefixes",
            str(Path(args.prefixes).resolve()),
            "--prefix-dist",
            args.prefix_dist,
        ]
    if args.tokens:
        argv += ["--tokens", *map(str, args.tokens)]
    if args.page_size is not None:
        argv += ["--page-size", str(args.page_size)]
    argv += [
        "--kv-dim",
        str(args.kv_dim),
        "--index-page-bytes",
        str(args.index_page_bytes),
        "--dtype",
        args.dtype,
        "--warmup",
        str(args.warmup),
        *(["--repeat", str(args.repeat)] if args.repeat is not None else []),
        "--backend",
        args.backend,
        "--verify" if args.verify else "--no-verify",
        "--paths",
        *args.paths,
    ]
    if args.out is not None:
        argv += ["--out", str(Path(args.out).resolve())]
    return argv
