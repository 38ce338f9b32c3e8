"""What a collectives run needs in memory, and whether this machine has it: the launcher's
preflight (``kvcadence collectives`` runs it before torchrun). A page's bytes are
``kernels.paths.payload_spec``'s (torch's item sizes), the rest standard library.

A case (a payload of ``B`` bytes a page, a prefix of ``P`` pages, ``W`` ranks) holds on each
rank its source pool (its ``ceil(P / W)`` owned pages and a sentinel), the dense prefix
(``P`` pages), the packed buffer (``ceil(P / W)``) and the gathered one (``W * ceil(P /
W)``) -- ``kernels.paths.RankCase``: allocated on first use, released between cases, so a
run's peak is its largest case's -- and the page indices it is built from (owned pages,
gather positions, source slots: Python lists of ints and int64 tensors, ``INDEX_BYTES`` a
page at most). On gloo every rank is a process of this host; on NCCL the buffers are on
each rank's GPU and the indices are built on the host first.

``--tokens 100000000000`` asked for about 4 PB a rank: the workers allocated until the
kernel killed them (12.7 GB resident, then SIGKILL, on the 2-core box), where this refuses
it in one line before anything is launched.
"""

from __future__ import annotations

from kvcadence.kernels.options import Config
from kvcadence.kernels.paths import payload_spec

#: host bytes a prefix page's indices may take on a rank (Python ints in lists: 28 + 8
#: bytes each; the same as int64 tensors: 8), a bound
INDEX_BYTES = 3 * (36 + 8)
#: the share of the free memory a run may plan to take
USABLE = 0.9


def case_bytes(pages: int, page: int, world: int) -> tuple[int, int]:
    """``(buffer bytes, host index bytes)`` one rank holds for a case of ``pages`` pages of
    ``page`` bytes over ``world`` ranks (see the module docstring)."""
    per_rank = -(-pages // world)
    buffers = page * ((per_rank + 1) + pages + per_rank + world * per_rank)
    return buffers, INDEX_BYTES * pages


def host_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none: the check
    is then not made)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_problem(
    cfg: Config,
    world: int,
    on_gpu: bool,
    host: int | None,
    device: int | None = None,
) -> str | None:
    """Why the run of ``cfg`` (a ``kernels.options.Config``) on ``world`` ranks does not fit
    (None when it does, or when the free memory is unknown): its largest case against the
    host's free memory (``host``: every rank's buffers on gloo, their indices either way)
    and, on NCCL (``on_gpu``), one GPU's memory (``device``)."""
    worst: tuple[int, int, int, str] | None = None  # (need a rank, host need, tokens, payload)
    for payload in cfg.payloads:
        page = payload_spec(
            payload,
            page_size=cfg.page_size,
            kv_dim=cfg.kv_dim,
            index_page_bytes=cfg.index_page_bytes,
            dtype=cfg.dtype,
        ).page_bytes
        for tokens in cfg.tokens:
            pages = -(-tokens // cfg.page_size)
            buffers, index = case_bytes(pages, page, world)
            on_host = world * (index + (0 if on_gpu else buffers))
            if worst is None or (buffers, on_host) > worst[:2]:
                worst = (buffers, on_host, tokens, payload)
    if worst is None:
        return None
    buffers, on_host, tokens, payload = worst
    what = f"the {tokens}-token {payload} case needs {_gib(buffers)} of buffers a rank"
    if host is not None and on_host > USABLE * host:
        where = f"{_gib(on_host)} for {world} ranks on this host"
        return (
            f"{what} ({where}); {_gib(host)} is available: give smaller --tokens (or "
            "--kv-dim), or fewer ranks"
        )
    if on_gpu and device is not None and buffers > USABLE * device:
        return f"{what}; one GPU has {_gib(device)}: give smaller --tokens (or --kv-dim)"
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"
