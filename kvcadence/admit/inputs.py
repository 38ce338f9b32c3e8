"""Inputs of ``kvcadence admit``: the waiting queue as a list of ``QueuedRequest``.

Three sources, one result type (``kvcadence.admit.ticks.QueuedRequest``):

* ``synthetic_grid`` -- the Cartesian product of comma lists of L1 / L2 / extend token counts,
  repeated ``repeat`` times (rids ``g<index>``);
* ``read_requests_jsonl`` -- one JSON object per line (``rid``, ``l1_cached_tokens``,
  ``l2_cached_tokens``, ``extend_tokens``, optional ``max_new_tokens`` and ``priority``); a bad
  line raises ``InputError`` naming the file, the line and the field;
* ``requests_from_bundle`` -- each captured request's cached tokens at admission, read through
  ``kvcadence.format.bundle.BundleReader``: L1 = ``cached_tokens`` (or the device part of
  ``meta_info.cached_tokens_details`` when SGLang reported a device/host split), L2 = the host
  part (0 without HiCache), extend = ``prompt_tokens - cached``.

Only the standard library is imported at module level.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvcadence.admit.ticks import DEFAULT_MAX_NEW_TOKENS, QueuedRequest
from kvcadence.errors import InputError, UsageError
from kvcadence.format.bounds import json_loads
from kvcadence.format.bundle import BundleReader

REQUEST_FIELDS = (
    "rid",
    "l1_cached_tokens",
    "l2_cached_tokens",
    "extend_tokens",
    "max_new_tokens",
    "priority",
)
_REQUIRED_INT = ("l1_cached_tokens", "l2_cached_tokens", "extend_tokens")


def parse_int_list(text: str, flag: str) -> list[int]:
    """``"0,4096"`` -> ``[0, 4096]``; a bad item is a ``UsageError`` naming the flag."""
    values: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            value = int(item)
        except ValueError:
            raise UsageError(f"{flag}: {item!r} is not an integer") from None
        if value < 0:
            raise UsageError(f"{flag}: {value} is negative")
        values.append(value)
    if not values:
        raise UsageError(f"{flag}: empty list")
    return values


#: the most requests ``--synthetic-grid`` (values x ``--repeat``) may make
MAX_GRID_REQUESTS = 100_000


def synthetic_grid(
    l1: Sequence[int],
    l2: Sequence[int],
    extend: Sequence[int],
    *,
    repeat: int = 1,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> list[QueuedRequest]:
    """The Cartesian product ``l1 x l2 x extend`` (in that nesting order), ``repeat`` times."""
    if repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {repeat}")
    total = repeat * len(l1) * len(l2) * len(extend)
    if total > MAX_GRID_REQUESTS:  # checked before a single request is made
        raise UsageError(
            f"the synthetic grid would hold {total:,} requests (--repeat {repeat} x "
            f"{len(l1)}x{len(l2)}x{len(extend)} values); at most {MAX_GRID_REQUESTS:,}"
        )
    specs: list[QueuedRequest] = []
    for _ in range(repeat):
        for a in l1:
            for b in l2:
                for c in extend:
                    if c < 1:
                        raise UsageError("--extend-tokens: every value must be >= 1")
                    specs.append(
                        QueuedRequest(
                            rid=f"g{len(specs)}",
                            l1=a,
                            l2=b,
                            extend=c,
                            max_new_tokens=max_new_tokens,
                        )
                    )
    return specs


def _int_field(obj: dict[str, Any], key: str, where: str, *, minimum: int) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: field {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise InputError(f"{where}: field {key!r} must be >= {minimum}, got {value}")
    return value


def parse_request_obj(
    obj: Any, where: str, index: int, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
) -> QueuedRequest:
    """Validate one decoded JSON request (``where`` names file and line in errors)."""
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in _REQUIRED_INT:
        if key not in obj:
            raise InputError(f"{where}: missing field {key!r}")
    unknown = sorted(set(obj) - set(REQUEST_FIELDS))
    if unknown:
        raise InputError(f"{where}: unknown field {unknown[0]!r}")
    rid = obj.get("rid", f"r{index}")
    if not isinstance(rid, str) or not rid:
        raise InputError(f"{where}: field 'rid' must be a non-empty string, got {rid!r}")
    l1 = _int_field(obj, "l1_cached_tokens", where, minimum=0)
    l2 = _int_field(obj, "l2_cached_tokens", where, minimum=0)
    ext = _int_field(obj, "extend_tokens", where, minimum=1)
    mnt = max_new_tokens
    if obj.get("max_new_tokens") is not None:
        mnt = _int_field(obj, "max_new_tokens", where, minimum=0)
    priority = None
    if obj.get("priority") is not None:
        priority = _int_field(obj, "priority", where, minimum=-(2**62))
    return QueuedRequest(rid=rid, l1=l1, l2=l2, extend=ext, max_new_tokens=mnt, priority=priority)


def parse_request_lines(
    lines: Iterable[str], name: str, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
) -> list[QueuedRequest]:
    """Parse JSONL text lines (blank lines skipped); rids must be unique."""
    specs: list[QueuedRequest] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json_loads(line)  # deep nesting refused, never a RecursionError
        except ValueError as exc:
            raise InputError(f"{where}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
        spec = parse_request_obj(obj, where, len(specs), max_new_tokens=max_new_tokens)
        if spec.rid in seen:
            raise InputError(f"{where}: field 'rid' {spec.rid!r} repeats line {seen[spec.rid]}")
        seen[spec.rid] = lineno
        specs.append(spec)
    if not specs:
        raise InputError(f"{name}: no requests")
    return specs


def read_requests_jsonl(
    path: str | Path, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
) -> list[QueuedRequest]:
    """Read a requests JSONL file (``InputError`` naming line and field on bad content)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        bundle = path if path.is_dir() else path.parent
        if any(bundle.glob("seg-*.kvcb")):  # a bundle, or one of its segments
            raise UsageError(
                f"{path}: a kvcadence bundle, not an admission JSONL file (--bundle {bundle} "
                "queues a capture's requests)"
            ) from None
        raise UsageError(f"{path}: cannot read ({exc})") from None
    return parse_request_lines(text.splitlines(), str(path), max_new_tokens=max_new_tokens)


def _cached_split(record: Any) -> tuple[int, int] | None:
    """(L1, L2) of one captured request, or None when it reported no cached tokens."""
    details = (record.meta_info or {}).get("cached_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("device"), int):
        host = details.get("host") or 0
        storage = details.get("storage") or 0
        host_total = (host if isinstance(host, int) else 0) + (
            storage if isinstance(storage, int) else 0
        )
        return details["device"], host_total
    cached = record.cached_tokens
    if cached is None:
        cached = (record.meta_info or {}).get("cached_tokens")
    if not isinstance(cached, int):
        return None
    return cached, 0


def specs_from_request_records(
    records: Sequence[Any], name: str, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
) -> list[QueuedRequest]:
    """Turn captured ``RequestRecord``s into specs, in arrival order (``send_ns`` when known)."""
    indexed = list(enumerate(records))
    indexed.sort(
        key=lambda ir: (
            ir[1].arrival_ns if ir[1].arrival_ns is not None else (ir[1].send_ns or 0),
            ir[0],
        )
    )
    specs: list[QueuedRequest] = []
    for _, rec in indexed:
        where = f"{name}: request {rec.rid!r}"
        split = _cached_split(rec)
        if split is None:
            raise InputError(f"{where}: field 'cached_tokens' is missing")
        l1, l2 = split
        prompt = rec.prompt_tokens
        if prompt is None:
            prompt = (rec.meta_info or {}).get("prompt_tokens")
        if not isinstance(prompt, int):
            prompt = len(rec.input_ids)
        extend = prompt - l1 - l2
        if prompt <= 0:
            raise InputError(f"{where}: field 'prompt_tokens' is {prompt}")
        if extend < 1:
            # SGLang caps a match at len - 1: at least one token is always computed.
            extend = 1
            l1 = min(l1, prompt - 1)
            l2 = max(0, prompt - 1 - l1)
        mnt = rec.max_new_tokens if rec.max_new_tokens is not None else max_new_tokens
        specs.append(QueuedRequest(rid=rec.rid, l1=l1, l2=l2, extend=extend, max_new_tokens=mnt))
    if not specs:
        raise InputError(f"{name}: the bundle has no request records")
    return specs


def requests_from_bundle(
    path: str | Path, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
) -> list[QueuedRequest]:
    """The waiting queue built from a capture bundle's request records."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such bundle")
    reader = BundleReader(path)
    return specs_from_request_records(reader.requests(), str(path), max_new_tokens=max_new_tokens)


#: ``admit`` flag (dest) -> the ``/server_info`` setting it defaults to under ``--bundle``
BUNDLE_SETTINGS = (
    ("page_size", "page_size"),
    ("chunked_prefill_size", "chunked_prefill_size"),
    ("available_tokens", "max_total_num_tokens"),
    ("max_prefill_tokens", "max_prefill_tokens"),
    ("max_running_requests", "max_running_requests"),
)


def bundle_settings(path: str | Path) -> dict[str, int]:
    """The worker settings of a capture bundle's ``/server_info`` snapshot as ``admit``
    options (``BUNDLE_SETTINGS``): only those recorded as integers. A recorded chunked prefill
    size of none or <= 0 (chunking off) becomes -1; the KV pool becomes ``available_tokens``."""
    info = BundleReader(Path(path)).header.server_info
    if not isinstance(info, dict) or not info:
        return {}
    # top level first, then internal_states[0] (where SGLang puts max_total_num_tokens)
    states = info.get("internal_states")
    inner = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    snap = {key: info[key] if key in info else inner.get(key) for _, key in BUNDLE_SETTINGS}
    stored = info.get("kvcadence_snapshot")
    if isinstance(stored, dict):
        snap.update({k: v for k, v in stored.items() if v is not None})
    out: dict[str, int] = {}
    for dest, key in BUNDLE_SETTINGS:
        v = snap.get(key)
        if dest == "chunked_prefill_size" and (v is None or (isinstance(v, int) and v <= 0)):
            recorded = key in info or (isinstance(stored, dict) and key in stored)
            if recorded:
                out[dest] = -1  # the worker ran without chunked prefill
            continue
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[dest] = v
    return out
