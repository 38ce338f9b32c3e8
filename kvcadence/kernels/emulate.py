"""Single-process emulation of a world of ranks: what all_reduce / all_gather would produce.

Used by the tests (world sizes 1–8 without torchrun) and handy for checking a path's index
math on any machine: every rank's :func:`~kvcadence.kernels.paths.materialise` runs, the
collective is computed from all send buffers (sum, or rank-major concatenation), then every
rank's :func:`~kvcadence.kernels.paths.finish` runs.
"""

from __future__ import annotations

import torch

from kvcadence.kernels.options import DENSE
from kvcadence.kernels.paths import PayloadSpec, RankCase, finish, materialise


def make_world(spec: PayloadSpec, pages: int, world: int) -> list[RankCase]:
    """One :class:`RankCase` per rank, on CPU."""
    cpu = torch.device("cpu")
    return [RankCase(spec, pages, world, r, cpu) for r in range(world)]


def emulate(path: str, cases: list[RankCase]) -> None:
    """Run one iteration of ``path`` on every rank of ``cases`` with an emulated collective."""
    sends = [materialise(path, c) for c in cases]
    if path == DENSE:
        total = torch.zeros_like(sends[0], dtype=torch.float64)
        for s in sends:
            total += s.to(torch.float64)
        for c in cases:
            c.dense.copy_(total.to(c.dense.dtype))
    else:
        gathered = torch.cat(sends, dim=0)
        for c in cases:
            c.gathered.copy_(gathered)
    for c in cases:
        finish(path, c)
