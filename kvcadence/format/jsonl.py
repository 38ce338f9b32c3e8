"""The JSON inputs that kvcadence validates line by line: a JSONL reader, the requests-JSONL
line (``RequestRecord``) and the ``/server_info`` JSON.

Shared by ``kvcadence import`` (``capture.importer``) and ``kvcadence replay --trace``
(``replay.trace``): one parser, one set of checks, one error style -- a bad line is one
``InputError`` naming ``file:line`` and the field. The formats are described in
``capture.importer``'s docstring and docs/format.md. Integers are range-checked so that every
record encodes and every table ingests: token ids 0..2**63-1, the optional request ints
-2**63..2**63-1, every int inside ``meta_info`` or the server info JSON -2**63..2**64-1.
Files are read one line at a time (``jsonl_lines``), never whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import msgspec

from kvcadence.errors import InputError, UsageError
from kvcadence.format.bounds import MAX_DP_SIZE, MAX_JSON_DEPTH, may_nest_deeper, too_deep
from kvcadence.format.bundle.segments import MAGIC as BUNDLE_SEGMENT_MAGIC
from kvcadence.format.schema import RequestRecord

U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    return {
        bool: "bool",
        int: "int",
        float: "float",
        str: "str",
        list: "array",
        dict: "object",
    }.get(type(v), type(v).__name__)


def _is_int(v: Any) -> bool:
    return type(v) is int


#: a list of ints (bools refused), checked in C: 100k-token prompts were ~0.3 s a request of
#: per-token Python checks (``capture import`` of a production worker's metrics files)
_INTS = list[int]
#: ... each a token id (0 .. 2**63-1)
_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]]


def _all(ids: Any, kind: Any) -> bool:
    """``ids`` converts to ``kind`` (msgspec, strict: a bool is no int); the slow paths
    below name the first value that does not."""
    try:
        msgspec.convert(ids, kind)
    except msgspec.ValidationError:
        return False
    return True


def get_field(
    obj: dict[str, Any], key: str, where: str, kind: str, *, required: bool, default: Any = None
) -> Any:
    """Field ``key`` of ``obj`` checked against ``kind`` (int, str, int?, str?, ints, dict)."""
    if key not in obj:
        if required:
            raise InputError(f"{where}: field `{key}` is missing")
        return default
    v = obj[key]
    checks = {
        "int": lambda: _is_int(v),
        "int?": lambda: v is None or _is_int(v),
        "str": lambda: type(v) is str,
        "str?": lambda: v is None or type(v) is str,
        "dict": lambda: type(v) is dict,
        "ints": lambda: type(v) is list and _all(v, _INTS),
    }
    ok = checks[kind]()
    if not ok:
        want = {
            "int": "an int",
            "int?": "an int or null",
            "str": "a string",
            "str?": "a string or null",
            "dict": "an object",
            "ints": "an array of ints",
        }[kind]
        got = _kind(v)
        if kind == "ints" and type(v) is list:
            bad = next(i for i, x in enumerate(v) if not _is_int(x))
            got = f"{_kind(v[bad])} at index {bad}"
        raise InputError(f"{where}: field `{key}`: expected {want}, got {got}")
    return v


def _check_ints(value: Any, where: str, field_name: str) -> None:
    """Every int anywhere inside ``value`` (dicts, lists) fits msgpack (-2**63..2**64-1);
    ``InputError`` naming the path of the first one that does not. Iterative: a deeply
    nested object cannot exhaust the stack."""
    stack: list[tuple[str, Any]] = [(field_name, value)]
    while stack:
        path, v = stack.pop()
        t = type(v)
        if t is int:
            if not I64_MIN <= v <= U64_MAX:
                raise InputError(
                    f"{where}: field `{path}`: {v} is outside the 64-bit integer range "
                    f"[-2**63, 2**64-1]"
                )
        elif t is dict:
            stack.extend((f"{path}.{k}", x) for k, x in reversed(v.items()))
        elif t is list:
            stack.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))))


def check_range(v: int | None, lo: int, hi: int, where: str, name: str, what: str) -> None:
    if v is not None and not lo <= v <= hi:
        raise InputError(f"{where}: field `{name}`: {v} is not {what}")


def _check_ids(ids: list[int], where: str, name: str) -> None:
    """Token ids are 0..2**63-1."""
    if _all(ids, _TOKEN_IDS):
        return
    for i, x in enumerate(ids):
        if not 0 <= x <= I64_MAX:
            raise InputError(
                f"{where}: field `{name}`: {x} at index {i} is not a token id (0 .. 2**63-1)"
            )


_OPTIONAL_INTS = (
    "send_ns",
    "first_token_ns",
    "finish_ns",
    "arrival_ns",
    "think_ns",
    "lane",
    "session",
    "turn",
    "max_new_tokens",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "dp_rank",
)


def check_request_record(rec: RequestRecord, where: str) -> None:
    """The checks ``parse_request_line`` makes, on a ``RequestRecord`` built elsewhere
    (``capture import`` from SGLang logs): a string rid, token ids that are ints (not bools)
    in 0 .. 2**63-1, optional ints in the signed 64-bit range, every int of ``meta_info`` in
    -2**63 .. 2**64-1. ``InputError`` naming the record and field; a record that passes reads
    back as it was written."""
    if type(rec.rid) is not str:
        raise InputError(f"{where}: field `rid`: expected a string, got {_kind(rec.rid)}")
    for name in ("input_ids", "output_ids"):
        ids = getattr(rec, name)
        if type(ids) is not list:
            raise InputError(f"{where}: field `{name}`: expected an array of ints")
        if _all(ids, _TOKEN_IDS):
            continue  # the usual record: ints, each a token id (checked in C)
        bad = next((i for i, x in enumerate(ids) if not _is_int(x)), None)
        if bad is not None:
            raise InputError(
                f"{where}: field `{name}`: expected an array of ints, got "
                f"{_kind(ids[bad])} at index {bad}"
            )
        _check_ids(ids, where, name)
    for name in _OPTIONAL_INTS:
        v = getattr(rec, name)
        if v is not None and not _is_int(v):
            raise InputError(f"{where}: field `{name}`: expected an int or null, got {_kind(v)}")
        check_range(v, I64_MIN, I64_MAX, where, name, "a signed 64-bit int")
    _check_ints(rec.meta_info, where, "meta_info")


_TOO_DEEP = object()  # a JSON value the decoder's recursion limit refused


def jsonl_raw_lines(path: Path, what: str) -> Iterator[tuple[str, bytes]]:
    """``(where, line bytes)`` for each non-blank line of a JSONL file, read one at a time
    (``where`` = ``path:lineno``); a file that cannot be opened is a ``UsageError``."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise UsageError(f"{what} file not found: {path}") from None
    except OSError as exc:
        if Path(path).is_dir() and any(Path(path).glob("seg-*.kvcb")):
            raise UsageError(
                f"{path}: a kvcadence bundle, not a {what} JSONL file (a bundle goes where "
                "a command takes BUNDLE)"
            ) from None
        raise UsageError(f"cannot read {what} file {path}: {exc.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if lineno == 1 and line.startswith(BUNDLE_SEGMENT_MAGIC):
                raise InputError(
                    f"{path}: a kvcadence bundle segment, not a {what} JSONL file (give "
                    "its bundle directory where a command takes BUNDLE)"
                )
            if line.strip():
                yield f"{path}:{lineno}", line


def decode_object(text: str | bytes, where: str) -> dict[str, Any]:
    """One JSON object from ``text``; anything else (bad JSON, nested deeper than
    ``MAX_JSON_DEPTH``, not an object) is an ``InputError`` naming ``where``."""
    try:
        obj = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        obj = _TOO_DEEP  # too deep for the decoder: refused just below
    if obj is _TOO_DEEP or (may_nest_deeper(text) and too_deep(obj)):
        raise InputError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    if type(obj) is not dict:
        raise InputError(f"{where}: expected a JSON object, got {_kind(obj)}")
    return obj


def jsonl_lines(path: Path, what: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, object)`` for each non-blank line of a JSONL file."""
    for where, line in jsonl_raw_lines(path, what):
        yield where, decode_object(line, where)


def _finish_reason(v: Any, where: str) -> str | None:
    if v is None or type(v) is str:
        return v
    if type(v) is dict:
        t = v.get("type")
        if t is None or type(t) is str:
            return t
    raise InputError(
        f"{where}: field `meta_info.finish_reason`: expected an object with a string `type`, "
        f"a string or null, got {_kind(v)}"
    )


def parse_request_line(obj: dict[str, Any], where: str) -> RequestRecord:
    """Validate one requests-JSONL object into a ``RequestRecord`` (``think_ns`` as given)."""
    rid = get_field(obj, "rid", where, "str", required=True)
    input_ids = get_field(obj, "input_ids", where, "ints", required=True)
    output_ids = get_field(obj, "output_ids", where, "ints", required=False, default=[])
    meta = get_field(obj, "meta_info", where, "dict", required=False, default={})
    opt = {
        k: get_field(obj, k, where, "int?", required=False)
        for k in (
            "send_ns",
            "finish_ns",
            "first_token_ns",
            "arrival_ns",
            "think_ns",
            "lane",
            "session",
            "turn",
            "max_new_tokens",
        )
    }
    error = get_field(obj, "error", where, "str?", required=False)
    _check_ids(input_ids, where, "input_ids")
    _check_ids(output_ids, where, "output_ids")
    for k, v in opt.items():
        check_range(v, I64_MIN, I64_MAX, where, k, "a signed 64-bit int")
    _check_ints(meta, where, "meta_info")

    def meta_int(key: str) -> int | None:
        v = meta.get(key)
        if v is None:
            return None
        if _is_int(v):
            return int(v)
        raise InputError(f"{where}: field `meta_info.{key}`: expected an int, got {_kind(v)}")

    completion = meta_int("completion_tokens")
    max_new = opt["max_new_tokens"]
    if max_new is None:
        max_new = completion if completion is not None else len(output_ids)
    return RequestRecord(
        rid=rid,
        input_ids=input_ids,
        output_ids=output_ids,
        send_ns=opt["send_ns"],
        first_token_ns=opt["first_token_ns"],
        finish_ns=opt["finish_ns"],
        lane=opt["lane"],
        session=opt["session"],
        turn=opt["turn"],
        max_new_tokens=max_new,
        prompt_tokens=meta_int("prompt_tokens"),
        cached_tokens=meta_int("cached_tokens"),
        completion_tokens=completion,
        finish_reason=_finish_reason(meta.get("finish_reason"), where),
        error=error,
        dp_rank=meta_int("dp_rank"),
        source="import",
        think_ns=opt["think_ns"],
        arrival_ns=opt["arrival_ns"],
        meta_info=meta,
    )


def read_server_info(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"server info file not found: {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read server info file {path}: {exc.strerror}") from None
    where = str(path)
    info = decode_object(text, where)
    get_field(info, "version", where, "str?", required=False)
    _check_ints(info, where, "server_info")
    if "kv_events_config" in info and type(info["kv_events_config"]) not in (str, dict):
        raise InputError(f"{where}: field `kv_events_config`: expected a string or an object")
    if info.get("kv_events") is not None:
        kv = get_field(info, "kv_events", where, "dict", required=False)
        for key in ("endpoint_port_base", "dp_size", "replay_endpoint_port_base"):
            v = kv.get(key)
            if v is not None and not _is_int(v):
                raise InputError(
                    f"{where}: field `kv_events.{key}`: expected an int, got {_kind(v)}"
                )
        dp = kv.get("dp_size")
        if dp is not None and not 1 <= dp <= MAX_DP_SIZE:  # one endpoint per rank is made
            raise InputError(
                f"{where}: field `kv_events.dp_size`: {dp} is outside 1..{MAX_DP_SIZE}"
            )
    v = info.get("dp_size")
    if v is not None and (not _is_int(v) or not 1 <= v <= MAX_DP_SIZE):
        raise InputError(
            f"{where}: field `dp_size`: expected an int in 1..{MAX_DP_SIZE}, got {v!r}"[:300]
        )
    return info


__all__ = [
    "I64_MAX",
    "I64_MIN",
    "U64_MAX",
    "check_range",
    "check_request_record",
    "get_field",
    "jsonl_lines",
    "parse_request_line",
    "read_server_info",
]
