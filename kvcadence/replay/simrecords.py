"""The sim ``RequestRecord``s of a run, built one at a time when read.

What this file owns: ``SimRecords``, the read-only sequence a replay returns as its
``requests``. A sim record holds its request's full prompt as a list of ints (``arrays``:
as an array, for the sim bundle's writer); building every
one when the run ends would hold the whole history's prompts at once (what the compact
tokens of ``replay.tokens`` avoid during the run). So each record is made by ``make(i)``
when it is read -- the sim bundle writer streams them, one alive at a time -- and is a new,
equal object on every read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload


class SimRecords(Sequence[Any]):
    """``n`` records, record ``i`` built by ``make(i)`` on each read; ``make_arrays(i)``
    (default ``make``): the same record with its ids as ``array('I')``, for a writer that
    packs them (``arrays``: a 100k-token prompt is not made 100k int objects to be packed
    back into 400 KB)."""

    __slots__ = ("_n", "_make", "_make_arrays")

    def __init__(
        self,
        n: int,
        make: Callable[[int], Any],
        make_arrays: Callable[[int], Any] | None = None,
    ) -> None:
        self._n = n
        self._make = make
        self._make_arrays = make if make_arrays is None else make_arrays

    def array_record(self, i: int) -> Any:
        """Record ``i`` with its ids as arrays (``make_arrays``)."""
        return self._make_arrays(i)

    def arrays(self) -> Iterator[Any]:
        """Every record in order, its ids as arrays (``make_arrays``)."""
        make = self._make_arrays
        return (make(i) for i in range(self._n))

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Any: ...

    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self._make(j) for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("sim record index out of range")
        return self._make(i)

    def __iter__(self) -> Iterator[Any]:
        make = self._make
        return (make(i) for i in range(self._n))

    def __eq__(self, other: object) -> bool:
        """Equal to another ``SimRecords`` or list with equal records, in order (as the
        list of records it stands for)."""
        if isinstance(other, (SimRecords, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-list semantics: unhashable

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"SimRecords({self._n})"
