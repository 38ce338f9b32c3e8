"""Bounds on what a hostile or damaged input may make kvcadence allocate or recurse into.

What this file owns:

* ``MAX_DP_SIZE``: the most data-parallel ranks a ``/server_info`` (or a bundle's recorded
  ``dp_rank``s) may claim. A worker's ranks are one publisher port each, so a larger
  ``dp_size`` is a damaged or hostile input, not a worker (``dp_size: 100000000`` used to
  allocate one endpoint/config per rank until MemoryError). ``dp_size_problem`` says why a
  value is not usable.
* ``MAX_JSON_DEPTH``: the deepest nesting of a JSON value kvcadence takes in (SGLang's
  ``meta_info``, ``/server_info``, request parameters nest a handful of levels). Deeper
  values would overflow the recursion of the JSON decoders, the msgpack encoder or the
  integer range check (RecursionError tracebacks); ``too_deep`` measures the depth without
  recursion, ``json_loads`` decodes (msgspec, else the stdlib) and turns both into one
  ``json.JSONDecodeError``.
* ``MAX_REQUEST_TOKENS``: the most token ids (``input_ids`` + ``output_ids``) a format 2.0
  ``PackedRequest`` may expand to. A packed request names an earlier block chain of its
  segment as its prompt's prefix, so a few bytes can stand for every token the segment
  stored before them: without a limit, a crafted segment of many tiny records each naming
  a long chain expands into gigabytes of ids per record. 2^22 (4,194,304) ids is four times
  the longest context windows served today (~1M tokens); a writer stores a longer request
  whole (``RequestRecord``: its ids are its bytes), so every bundle kvcadence writes reads.

The standard library and msgspec only (part of the shared format package: capture, replay,
admit and analysis import it).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

#: the most DP ranks (publisher ports) one worker may claim
MAX_DP_SIZE = 1024
#: the deepest JSON nesting accepted in an input (objects and arrays count one level each)
MAX_JSON_DEPTH = 64
#: the most token ids (input + output) a packed (format 2.0) request may expand to
MAX_REQUEST_TOKENS = 1 << 22


def dp_size_problem(value: object) -> str | None:
    """Why ``value`` is no usable ``dp_size`` (None when it is an int in 1..MAX_DP_SIZE)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"expected an integer, got {value!r}"[:120]
    if not 1 <= value <= MAX_DP_SIZE:
        return f"{value} is outside 1..{MAX_DP_SIZE}"
    return None


def too_deep(obj: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``obj`` (decoded JSON: dicts, lists, scalars) nests deeper than ``limit``."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        if depth > limit:
            return True
        if _CONTAINERS.isdisjoint(map(type, children)):
            continue  # scalars only (e.g. a prompt's token ids): nothing deeper, looked at in C
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return False


_CONTAINERS = frozenset((dict, list, tuple))
_MISSING = object()


def json_loads(text: str | bytes) -> Any:
    """``json.loads`` that raises ``json.JSONDecodeError`` (a ``ValueError``; never a
    RecursionError) for a value nested deeper than ``MAX_JSON_DEPTH``.

    Decoded by msgspec first (the same values for every document both take; ~4x faster on a
    metrics line holding a 100k-token prompt, what ``capture import`` reads by the million),
    by the stdlib where msgspec refuses (what only the stdlib takes, ``NaN``, ``1e400``, a
    lone surrogate; or malformed input: the stdlib's error message). The depth is measured
    (``too_deep``) only when the text opens more than ``MAX_JSON_DEPTH`` brackets."""
    deep = f"nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        obj = msgspec.json.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError):
        obj = _MISSING
    except RecursionError:
        raise json.JSONDecodeError(deep, "", 0) from None
    if obj is _MISSING:
        try:
            obj = json.loads(text)
        except RecursionError:
            raise json.JSONDecodeError(deep, "", 0) from None
    if may_nest_deeper(text) and too_deep(obj):
        raise json.JSONDecodeError(deep, "", 0)
    return obj


def may_nest_deeper(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON ``text`` opens more than ``limit`` ``[`` and ``{`` characters, an
    upper bound of its nesting depth (each level opens with one; inside strings they only
    add to the count): when not, its decoded value need not be walked by ``too_deep``.
    Counted in C: a metrics line with a 100k-token prompt holds a few dozen."""
    if isinstance(text, str):
        return text.count("[") + text.count("{") > limit
    return text.count(b"[") + text.count(b"{") > limit


__all__ = [
    "MAX_DP_SIZE",
    "MAX_JSON_DEPTH",
    "MAX_REQUEST_TOKENS",
    "dp_size_problem",
    "json_loads",
    "may_nest_deeper",
    "too_deep",
]
