"""Mooncake-format traces: one line's checks and the hash id -> token ids mapping.

A Mooncake trace is JSONL, one request a line: ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` (one id per block of the prompt; two requests that share a
prefix of ids share that prefix of the prompt). It carries no token ids, so they are made up,
deterministically: hash id ``h`` always maps to the same ``block_tokens`` token ids
(``random.Random(f"{seed}-hash-{h}")``), a prompt is its blocks in order cut to
``input_length``, and a prompt longer than its blocks is padded with tokens unique to the
request (``f"{seed}-req-{idx}"``, ``idx`` = the request's 0-based index among the non-blank
lines). Token ids lie in ``[3, vocab - 1]`` (0/1/2 are pad/BOS/EOS on the harness model).

Shared by ``kvcadence drive --workload mooncake:...`` (``capture.workloads``, which sends
these prompts to a real worker) and ``kvcadence replay --trace`` (``replay.trace``, which
simulates them): the same trace gives both the same prompts, so their KV events are
comparable. Standard library only.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Any

from kvcadence.errors import InputError
from kvcadence.format.bounds import MAX_REQUEST_TOKENS

#: the latest trace timestamp (ms) an int64 of nanoseconds holds
MAX_TIMESTAMP_MS = (2**63 - 1) / 1e6

FIRST_TOKEN = 3


@functools.lru_cache(maxsize=8)
def _token_ints(vocab: int) -> tuple[int, ...]:
    """One int object per token id ``FIRST_TOKEN .. vocab - 1``: every prompt shares them (a
    10^5-request trace would otherwise hold ~10^7 int objects of its own)."""
    return tuple(range(FIRST_TOKEN, vocab))


def synthetic_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` token ids drawn from ``rng`` in ``[FIRST_TOKEN, vocab - 1]``: exactly
    ``[rng.randint(FIRST_TOKEN, vocab - 1) for _ in range(n)]`` (the values every drive and
    replay of a workload has used), without randint's per-call overhead: randint(a, b) is
    ``a + r`` for the first ``r = getrandbits(k) < b - a + 1``, ``k`` that width's bit length
    (CPython's ``_randbelow_with_getrandbits``; a test checks the two agree)."""
    ints = _token_ints(vocab)
    span = len(ints)
    if span < 1:
        raise ValueError(f"vocab {vocab} leaves no token ids above {FIRST_TOKEN - 1}")
    k = span.bit_length()
    bits = rng.getrandbits
    out = []
    for _ in range(n):
        r = bits(k)
        while r >= span:
            r = bits(k)
        out.append(ints[r])
    return out


def need_int(d: dict[str, Any], key: str, where: str, minimum: int = 0) -> int:
    """Field ``key`` of ``d`` as an int >= ``minimum``; ``InputError`` naming ``where``."""
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise InputError(f"{where}: field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


@dataclass(slots=True)
class MooncakeLine:
    """One validated trace line."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def parse_mooncake_line(d: dict[str, Any], where: str) -> MooncakeLine:
    """Validate one decoded trace line (``where`` = ``file:line`` for the error)."""
    ts = d.get("timestamp", 0)
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise InputError(f"{where}: field 'timestamp' must be a number")
    if not 0 <= ts < MAX_TIMESTAMP_MS:  # NaN and Infinity too: no offset in ns
        raise InputError(
            f"{where}: field 'timestamp' must be milliseconds in [0, {MAX_TIMESTAMP_MS:.0f}), "
            f"got {ts!r}"
        )
    n_in = need_int(d, "input_length", where, 1)
    n_out = need_int(d, "output_length", where, 1)
    if n_in + n_out > MAX_REQUEST_TOKENS:  # each token is made: a bound, not a guess
        raise InputError(
            f"{where}: input_length + output_length = {n_in + n_out}, more than a request can "
            f"hold ({MAX_REQUEST_TOKENS:,} token ids)"
        )
    hids = d.get("hash_ids", [])
    if not isinstance(hids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hids
    ):
        raise InputError(f"{where}: field 'hash_ids' must be a list of integers")
    return MooncakeLine(ts, n_in, n_out, hids)


@dataclass
class HashIdTokens:
    """Hash id -> token ids (see the module docstring). Blocks are cached: a trace reuses
    its ids, and a prompt built from cached blocks shares their int objects."""

    block_tokens: int = 16
    seed: int = 0
    vocab: int = 1024
    _cache: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        """Distinct hash ids mapped so far."""
        return len(self._cache)

    def block(self, h: int) -> list[int]:
        """The ``block_tokens`` token ids of hash id ``h``."""
        ids = self._cache.get(h)
        if ids is None:
            rng = random.Random(f"{self.seed}-hash-{h}")
            ids = self._cache[h] = synthetic_tokens(rng, self.block_tokens, self.vocab)
        return ids

    def prompt(self, hash_ids: list[int], n_in: int, idx: int) -> list[int]:
        """The ``n_in`` prompt token ids of request ``idx`` with blocks ``hash_ids``."""
        ids: list[int] = []
        for h in hash_ids:
            if len(ids) >= n_in:
                break
            ids.extend(self.block(h))
        if len(ids) < n_in:  # trace has fewer hash ids than input tokens: unique filler
            rng = random.Random(f"{self.seed}-req-{idx}")
            ids.extend(synthetic_tokens(rng, n_in - len(ids), self.vocab))
        del ids[n_in:]
        return ids


__all__ = [
    "FIRST_TOKEN",
    "HashIdTokens",
    "MooncakeLine",
    "need_int",
    "parse_mooncake_line",
    "synthetic_tokens",
]
