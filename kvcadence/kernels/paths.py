"""The three ways to merge a shared prefix, split into the phases around the collective.

Per rank and case (a payload and a prefix of ``pages`` pages over ``world`` ranks) a
:class:`RankCase` holds the local source pool and every buffer; each path is::

    dense_all_reduce:              dense.zero_(); dense[owned] = pool[slots]  →  all_reduce(dense, SUM)
    packed_all_gather_scatter:     packed[:n] = pool[slots]  →  all_gather(gathered, packed)
                                   →  dense = gathered[gather_positions]       (scatter to slot order)
    packed_all_gather_rank_major:  packed[:n] = pool[slots]  →  all_gather(gathered, packed)
                                   (the consumer reads page p at row gather_positions[p])

:func:`materialise` is the part before the collective (returns the buffer to send),
:func:`finish` the part after it; :func:`run_path` chains them around a :class:`Collectives`
implementation (the real one is in ``kvcadence.kernels.bench``; tests emulate it in one
process). Source contents are deterministic and page-distinct (:func:`page_content`), so a
misplaced, missing or sentinel page is caught by :func:`verify`. Index math is in
``kvcadence.kernels.layout``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvcadence.kernels import layout
from kvcadence.kernels.options import DENSE, PATHS, RANK_MAJOR, SCATTER

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "uint8": torch.uint8,
}
PATTERN_MOD = 251  # content values stay in [0, 250]: exact in bf16/fp16/uint8
DIGIT_BASE = 128  # the first 3 elements of a page spell (page + 1) in base 128
DIGITS = 3
SENTINEL = {torch.uint8: 255}  # any other dtype: -1 (never a content value)
CHUNK_BYTES = 8 << 20  # build/verify contents this many bytes at a time


@dataclass(frozen=True)
class PayloadSpec:
    """One page's shape: ``page_elems`` elements of ``dtype``."""

    name: str
    page_elems: int
    dtype_name: str

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.dtype.itemsize


def payload_spec(
    name: str, *, page_size: int, kv_dim: int, index_page_bytes: int, dtype: str
) -> PayloadSpec:
    """``mla``: page_size × kv_dim elements of ``dtype``; ``index``: index_page_bytes uint8."""
    if name == "mla":
        return PayloadSpec("mla", page_size * kv_dim, dtype)
    if name == "index":
        return PayloadSpec("index", index_page_bytes, "uint8")
    raise ValueError(f"unknown payload {name!r}")


def page_content(pages: torch.Tensor, spec: PayloadSpec, device: torch.device) -> torch.Tensor:
    """Reference content of logical ``pages`` (1-D int64): ``[len(pages), page_elems]``.

    Element e of page p is ``(31·p + e) mod 251``, except that the first three elements spell
    ``p + 1`` in base 128 — so any two pages below 2**21 differ and no page is all zero.
    """
    pages = pages.to(device=device, dtype=torch.int64)
    e = torch.arange(spec.page_elems, device=device, dtype=torch.int64)
    vals = (pages[:, None] * 31 + e[None, :]) % PATTERN_MOD
    nd = min(DIGITS, spec.page_elems)
    p1 = pages + 1
    for i in range(nd):
        vals[:, i] = (p1 // DIGIT_BASE**i) % DIGIT_BASE
    return vals.to(spec.dtype)


def _chunk_pages(spec: PayloadSpec) -> int:
    return max(1, CHUNK_BYTES // max(1, spec.page_elems * 8))


class RankCase:
    """One rank's pool and buffers for one (payload, pages, world) case."""

    def __init__(
        self, spec: PayloadSpec, pages: int, world: int, rank: int, device: torch.device
    ) -> None:
        if pages < 1:
            raise ValueError(f"a case needs at least one page, got {pages}")
        self.spec, self.pages, self.world, self.rank, self.device = spec, pages, world, rank, device
        owned = layout.owned_pages(pages, world, rank)
        self.n_owned = len(owned)
        self.per_rank = layout.padded_per_rank(pages, world)
        i64 = torch.int64
        self.owned_idx = torch.tensor(owned, dtype=i64, device=device)
        self.slot_idx = torch.tensor(layout.source_slots(self.n_owned), dtype=i64, device=device)
        self.gather_pos = torch.tensor(
            layout.gather_positions(pages, world), dtype=i64, device=device
        )
        e = spec.page_elems
        self.pool = torch.empty((1 + self.n_owned, e), dtype=spec.dtype, device=device)
        self.pool[0].fill_(SENTINEL.get(spec.dtype, -1))
        step = _chunk_pages(spec)
        for lo in range(0, self.n_owned, step):
            hi = min(self.n_owned, lo + step)
            self.pool[self.slot_idx[lo:hi]] = page_content(self.owned_idx[lo:hi], spec, device)
        self._dense: torch.Tensor | None = None
        self._packed: torch.Tensor | None = None
        self._gathered: torch.Tensor | None = None

    # buffers are allocated on first use so a case holds only what its paths need
    @property
    def dense(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = torch.zeros(
                (self.pages, self.spec.page_elems), dtype=self.spec.dtype, device=self.device
            )
        return self._dense

    @property
    def packed(self) -> torch.Tensor:
        if self._packed is None:  # padding rows stay zero: only rows [0, n_owned) are written
            self._packed = torch.zeros(
                (self.per_rank, self.spec.page_elems), dtype=self.spec.dtype, device=self.device
            )
        return self._packed

    @property
    def gathered(self) -> torch.Tensor:
        if self._gathered is None:
            self._gathered = torch.zeros(
                (self.world * self.per_rank, self.spec.page_elems),
                dtype=self.spec.dtype,
                device=self.device,
            )
        return self._gathered

    def release(self) -> None:
        """Drop the big buffers (between cases)."""
        self._dense = self._packed = self._gathered = None

    # --- sizes -------------------------------------------------------------------------
    @property
    def full_bytes(self) -> int:
        """The dense prefix (useful bytes; all-reduce S)."""
        return self.pages * self.spec.page_bytes

    @property
    def packed_bytes_per_rank(self) -> int:
        """One rank's packed buffer, padding included."""
        return self.per_rank * self.spec.page_bytes

    @property
    def gathered_bytes(self) -> int:
        """The whole gathered buffer, padding included (all-gather S)."""
        return self.world * self.packed_bytes_per_rank

    # --- phases ------------------------------------------------------------------------
    def materialise_dense(self) -> torch.Tensor:
        dense = self.dense
        dense.zero_()
        dense.index_copy_(0, self.owned_idx, self.pool.index_select(0, self.slot_idx))
        return dense

    def pack(self) -> torch.Tensor:
        packed = self.packed
        torch.index_select(self.pool, 0, self.slot_idx, out=packed[: self.n_owned])
        return packed

    def scatter(self) -> torch.Tensor:
        torch.index_select(self.gathered, 0, self.gather_pos, out=self.dense)
        return self.dense

    def result(self, path: str) -> torch.Tensor:
        """The merged prefix in dense slot order (rank-major: after applying the remap)."""
        if path in (DENSE, SCATTER):
            return self.dense
        if path == RANK_MAJOR:
            return self.gathered.index_select(0, self.gather_pos)
        raise ValueError(f"unknown path {path!r}")


class Collectives(Protocol):
    """What a path needs from the process group."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> None: ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None: ...


def collective_of(path: str) -> str:
    """``all_reduce`` or ``all_gather`` (for the nccl-tests bus factor)."""
    if path == DENSE:
        return "all_reduce"
    if path in (SCATTER, RANK_MAJOR):
        return "all_gather"
    raise ValueError(f"unknown path {path!r}")


def materialise(path: str, case: RankCase) -> torch.Tensor:
    """Everything before the collective; returns the buffer the collective consumes."""
    if path == DENSE:
        return case.materialise_dense()
    if path in (SCATTER, RANK_MAJOR):
        return case.pack()
    raise ValueError(f"unknown path {path!r}")


def finish(path: str, case: RankCase) -> None:
    """Everything after the collective (only the scatter path has work here)."""
    if path == SCATTER:
        case.scatter()


def run_path(path: str, case: RankCase, coll: Collectives) -> None:
    """One full iteration of ``path`` on this rank."""
    buf = materialise(path, case)
    if path == DENSE:
        coll.all_reduce_sum(buf)
    else:
        coll.all_gather(case.gathered, buf)
    finish(path, case)


def verify(path: str, case: RankCase, limit: int = 5) -> list[int]:
    """Logical pages whose merged content differs from the reference (at most ``limit``)."""
    res = case.result(path)
    if tuple(res.shape) != (case.pages, case.spec.page_elems):
        return list(range(min(limit, case.pages)))
    bad: list[int] = []
    step = _chunk_pages(case.spec)
    for lo in range(0, case.pages, step):
        hi = min(case.pages, lo + step)
        ids = torch.arange(lo, hi, dtype=torch.int64, device=case.device)
        ok = (res[lo:hi] == page_content(ids, case.spec, case.device)).all(dim=1)
        if not bool(ok.all()):
            bad.extend(lo + int(i) for i in torch.nonzero(~ok).flatten()[: limit - len(bad)])
            if len(bad) >= limit:
                break
    return bad


def describe_mismatch(path: str, case: RankCase, bad: list[int]) -> str:
    """One line naming the case and the first wrong pages (with their owners)."""
    pages = ", ".join(f"{p} (owner rank {layout.owner(p, case.world)})" for p in bad)
    return (
        f"{path} on rank {case.rank}/{case.world}: {case.spec.name} prefix of {case.pages} pages "
        f"does not match the reference; first wrong pages: {pages}"
    )


__all__ = [
    "PATHS",
    "Collectives",
    "PayloadSpec",
    "RankCase",
    "collective_of",
    "describe_mismatch",
    "finish",
    "materialise",
    "page_content",
    "payload_spec",
    "run_path",
    "verify",
]
