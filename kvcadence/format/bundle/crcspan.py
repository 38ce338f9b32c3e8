"""CRC-32 of many overlapping spans of one buffer in linear time (the reader's resync).

What this file owns: ``SpanCrc(data)``, whose ``crc(a, b)`` equals ``zlib.crc32(data[a:b])``.
Resynchronising past damage checks the CRC of every candidate frame, and a candidate's cost
was its *claimed* length: a crafted span (frames nested inside each other's bodies, every
one well-formed but for its CRC) made that quadratic in the span. Here a long span costs
O(log length): with prefix CRCs ``P(i) = crc32(data[:i])`` (kept at checkpoints every
``STEP`` bytes, built once, lazily, from the first position asked),
``crc32(data[a:b]) = P(b) ^ shift(P(a), b - a)``, where ``shift(c, n)`` -- appending ``n`` zero
bytes to a CRC, zlib's ``crc32_combine`` operator -- is linear in ``c`` and is applied as
byte-sliced tables of the operators for ``2**k`` bytes. Short spans use ``zlib.crc32``
directly. Standard library only.
"""

from __future__ import annotations

import zlib

STEP = 256  # checkpoint spacing: a prefix CRC costs at most this many bytes of zlib.crc32
SHORT = 4096  # spans up to this long are CRC'd directly


def _apply(tables: tuple[list[int], list[int], list[int], list[int]], c: int) -> int:
    t0, t1, t2, t3 = tables
    return t0[c & 0xFF] ^ t1[(c >> 8) & 0xFF] ^ t2[(c >> 16) & 0xFF] ^ t3[c >> 24]


def _tables_of(basis: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Byte-sliced lookup tables of the linear map whose image of bit ``i`` is
    ``basis[i]``."""
    out = []
    for byte in range(4):
        t = [0] * 256
        for v in range(1, 256):
            low = v & -v
            t[v] = t[v ^ low] ^ basis[byte * 8 + low.bit_length() - 1]
        out.append(t)
    return out[0], out[1], out[2], out[3]


def _build() -> list[tuple[list[int], list[int], list[int], list[int]]]:
    """Tables of ``shift(., 2**k)`` for k = 0..31 (shift by one byte from zlib itself:
    ``zlib.crc32(b"\\0", c) ^ zlib.crc32(b"\\0")`` is linear in ``c``)."""
    zero = zlib.crc32(b"\0")
    basis = [zlib.crc32(b"\0", 1 << i) ^ zero for i in range(32)]
    levels = []
    for _ in range(32):
        tables = _tables_of(basis)
        levels.append(tables)
        basis = [_apply(tables, b) for b in basis]  # the operator squared: 2**(k+1) bytes
    return levels


_LEVELS: list[tuple[list[int], list[int], list[int], list[int]]] | None = None


def shift(c: int, n: int) -> int:
    """The CRC of ``A + n zero bytes`` given ``c = crc32(A)``, minus ``crc32(n zeros)``."""
    global _LEVELS
    if _LEVELS is None:
        _LEVELS = _build()
    k = 0
    while n:
        if n & 1:
            c = _apply(_LEVELS[k], c)
        n >>= 1
        k += 1
    return c


class SpanCrc:
    """``crc(a, b) == zlib.crc32(data[a:b])`` for many spans, linear overall."""

    def __init__(self, data: bytes | memoryview, start: int = 0) -> None:
        self._mv = memoryview(data)
        self._base = start - start % STEP  # checkpoints from here on
        self._ck: list[int] = [zlib.crc32(self._mv[: self._base])] if self._base else [0]

    def _prefix(self, i: int) -> int:
        """``crc32(data[:i])`` for ``i >= self._base``."""
        mv, ck, base = self._mv, self._ck, self._base
        j = (i - base) // STEP
        while len(ck) <= j:  # extend the checkpoints (each STEP bytes once)
            at = base + (len(ck) - 1) * STEP
            ck.append(zlib.crc32(mv[at : at + STEP], ck[-1]))
        at = base + j * STEP
        return zlib.crc32(mv[at:i], ck[j])

    def crc(self, a: int, b: int) -> int:
        if b - a <= SHORT or a < self._base:
            return zlib.crc32(self._mv[a:b])
        return self._prefix(b) ^ shift(self._prefix(a), b - a)


__all__ = ["SpanCrc", "shift"]
