"""Request ids are unique within a bundle: the duplicate-rid checks of the request importers.

What this file owns: ``refuse_duplicate_rids(records, what)`` (a batch of records about to be
written names a rid twice; ``UniqueRids``: the same check fed one rid at a time, for a file
read as a stream) and ``refuse_known_rids(bundle, records)`` (a rid the bundle
already holds), both ``InputError`` -- one line, exit 2 -- raised before anything is written.
A request recorded twice is counted twice by every per-request metric (importing every
request twice made Stored events/request 0.975 instead of 1.95), and nothing downstream can
tell which copy is right, so ``import``, ``import --append`` and ``capture import`` refuse
instead of merging. Bundles that already hold duplicates are read as they are; the report
counts them (``quality.duplicate_rids``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from kvcadence.errors import InputError
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import RequestRecord

_HINT = "rids must be unique in a bundle (a request recorded twice is counted twice)"


class UniqueRids:
    """The rids seen so far, each with where it was: ``add`` raises ``InputError`` at the
    first rid seen twice (memory: one entry per rid, no record kept)."""

    __slots__ = ("_first", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self._first: dict[str, str | None] = {}

    def add(self, rid: str, where: str | None = None) -> None:
        """Record ``rid``, read at ``where`` (e.g. ``file:line``; None: unnamed)."""
        if rid in self._first:
            first = self._first[rid]
            if where is not None and first is not None:
                raise InputError(
                    f"{where}: field `rid`: {rid!r} is already the rid of {first}; " + _HINT
                )
            raise InputError(f"{self.what}: rid {rid!r} appears twice; {_HINT}")
        self._first[rid] = where


def refuse_duplicate_rids(
    records: Sequence[RequestRecord], what: str, wheres: Sequence[str] | None = None
) -> None:
    """``InputError`` at the first rid that repeats in ``records`` (``wheres[i]``: where
    record ``i`` came from, e.g. ``file:line``)."""
    seen = UniqueRids(what)
    for i, r in enumerate(records):
        seen.add(r.rid, None if wheres is None else wheres[i])


def bundle_rids(bundle: str | os.PathLike[str]) -> set[str]:
    """The rids of every request record of ``bundle`` (read for their rids only:
    ``BundleReader.request_rids``)."""
    return set(BundleReader(bundle).request_rids())


def known_rid(bundle: str | os.PathLike[str], rid: str) -> InputError:
    """The error for a record whose rid ``bundle`` already holds."""
    return InputError(f"{bundle}: already holds a request with rid {rid!r}; {_HINT}")


def refuse_known_rids(bundle: str | os.PathLike[str], records: Iterable[RequestRecord]) -> None:
    """``InputError`` at the first record whose rid ``bundle`` already holds."""
    known = bundle_rids(bundle)
    for r in records:
        if r.rid in known:
            raise known_rid(bundle, r.rid)


__all__ = [
    "UniqueRids",
    "bundle_rids",
    "known_rid",
    "refuse_duplicate_rids",
    "refuse_known_rids",
]
