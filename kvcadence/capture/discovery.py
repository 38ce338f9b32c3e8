"""Discovery: ``GET /server_info`` -> KV-event endpoints (one per DP rank) + a config snapshot.

SGLang's ``/server_info`` (0.5.23) carries a ``kv_events`` block (``endpoint_host``,
``endpoint_port_base``, ``dp_size``, ``topic``, ``replay_endpoint_port_base``) next to the
resolved server arguments and the scheduler info. Rank ``r`` publishes on ``base + r`` (and
replays on ``replay_base + r``). A wildcard host is replaced by the server's own host.
The snapshot keeps the fields the simulator needs; the whole JSON is stored as well.

Also owned here: the check of endpoint URLs (``check_endpoint``: ``tcp://HOST:PORT`` with a
host name, IPv4 or ``[IPv6]`` address and a port 1-65535, ``ipc://PATH``, ``inproc://NAME``),
done before any socket or file exists, and the scrubbing of machine paths from what goes
into a bundle header (``redact_paths``): the home directory becomes ``~``, a harness work
directory ``<harness-workdir>`` (and its worker's ``--tokenizer`` directory
``<harness-tokenizer>``), the system temp directory ``<tmp>``, and each ``--redact PATH``
``<redacted>`` (``header_redactions``). Only the header copy is scrubbed; the program keeps
using the real paths.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvcadence import __version__
from kvcadence.errors import CaptureError, UsageError
from kvcadence.format.bounds import dp_size_problem
from kvcadence.format.schema import FORMAT_MAJOR, FORMAT_MINOR, EndpointInfo, Header
from kvcadence.harness import worker as harness

SNAPSHOT_FIELDS = (
    "version",
    "page_size",
    "max_total_num_tokens",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "decode_log_interval",
    "schedule_policy",
    "max_running_requests",
    "dp_size",
    "tp_size",
    "disable_overlap_schedule",
    "radix_eviction_policy",
    "schedule_conservativeness",
    "enable_mixed_chunk",
    "disable_radix_cache",
)
WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]", ""}
ENDPOINT_SCHEMES = ("tcp", "ipc", "inproc")
IPC_PATH_MAX = 107  # sun_path is 108 bytes with its NUL
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)
HARNESS_PLACEHOLDER = "<harness-workdir>"
HARNESS_TOKENIZER_PLACEHOLDER = "<harness-tokenizer>"
TMP_PLACEHOLDER = "<tmp>"
REDACTED_PLACEHOLDER = "<redacted>"


def endpoint_problem(url: str) -> str | None:
    """What is wrong with a ZMQ endpoint URL to connect to, or None if its form is valid:
    ``tcp://HOST:PORT`` (host name, IPv4, or ``[IPv6]``; port 1-65535), ``ipc://PATH``,
    ``inproc://NAME``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "expected tcp://HOST:PORT (or ipc://PATH, inproc://NAME)"
    if scheme not in ENDPOINT_SCHEMES:
        return f"unknown scheme {scheme!r} (expected tcp, ipc or inproc)"
    if scheme != "tcp":
        if not rest or any(c.isspace() or not c.isprintable() for c in rest):
            return f"{scheme}:// needs a non-empty name without spaces"
        if scheme == "ipc" and len(rest.encode()) > IPC_PATH_MAX:
            return f"ipc path longer than {IPC_PATH_MAX} bytes (the Unix socket limit)"
        return None
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        return "expected tcp://HOST:PORT"
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        return f"port {port!r} is not a number 1-65535"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"host {host!r} is not an IPv6 address"
        return None
    if ":" in host:
        return f"host {host!r}: an IPv6 address must be in brackets, e.g. tcp://[::1]:{port}"
    if host.replace(".", "").isdigit():
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"host {host!r} is not an IPv4 address"
        return None
    if not _HOSTNAME.match(host):
        return f"host {host!r} is not a valid host name"
    return None


def check_endpoint(url: str, what: str = "--endpoint") -> str:
    """``url`` unchanged if its form is valid; else ``UsageError`` naming it (exit 2)."""
    problem = endpoint_problem(url)
    if problem is not None:
        raise UsageError(f"{what} {url!r}: {problem}")
    return url


def redact_paths(
    value: Any,
    workdirs: Iterable[str | os.PathLike[str]] = (),
    more: Mapping[str, str] | None = None,
) -> Any:
    """A copy of ``value`` (JSON-like: dicts, lists, strings) with machine paths scrubbed:
    inside every string, a ``workdirs`` entry becomes ``<harness-workdir>``, a ``more`` path
    its placeholder (``header_redactions``), the home directory ``~`` and the system temp
    directory ``<tmp>`` (longest prefix first, whole path components only). Dict keys are
    kept; non-strings are returned as they are."""
    subs: list[tuple[str, str]] = []
    for w in workdirs:
        subs.append((os.path.normpath(os.fspath(w)), HARNESS_PLACEHOLDER))
    for path, placeholder in (more or {}).items():
        subs.append((os.path.normpath(path), placeholder))
    home = str(Path.home())
    if home not in ("", "/"):
        subs.append((os.path.normpath(home), "~"))
    tmp = os.path.normpath(tempfile.gettempdir())
    if tmp != "/":
        subs.append((tmp, TMP_PLACEHOLDER))
        real = os.path.realpath(tmp)
        if real != tmp and real != "/":
            subs.append((real, TMP_PLACEHOLDER))
    subs = [(a, b) for a, b in subs if a not in ("", "/", ".")]
    subs.sort(key=lambda ab: len(ab[0]), reverse=True)
    if not subs:
        return value
    # whole path components only: not inside a longer name on either side
    head = r"(?<![\w.~-])"
    tail = f"(?=$|[{re.escape(os.sep)}\\s\"',;:=)\\]}}])"
    pattern = re.compile("|".join(head + re.escape(a) + tail for a, _ in subs))
    table = dict(subs)

    def fix(v: Any) -> Any:
        if isinstance(v, str):
            return pattern.sub(lambda m: table[m.group(0)], v) if v else v
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [fix(x) for x in v]
        return v

    return fix(value)


def harness_workdirs(server_url: str | None, info: dict[str, Any] | None) -> list[str]:
    """Work directories of a kvcadence harness worker behind ``server_url``: the one recorded
    by ``kvcadence harness start`` (same port), and the parent of ``/server_info``'s
    ``export_metrics_to_file_dir`` when it is the harness layout (``<workdir>/sglang-metrics``)."""
    out: list[str] = []
    if info:
        mdir = _lookup(info, "export_metrics_to_file_dir")
        if isinstance(mdir, str) and os.path.isabs(mdir):
            p = Path(mdir)
            if p.name == "sglang-metrics":
                out.append(str(p.parent))
    wd = _harness_path(server_url, "workdir")
    if wd is not None:
        out.append(wd)
    return out


def _harness_path(server_url: str | None, key: str) -> str | None:
    """The absolute path ``key`` (``workdir``, ``tokenizer``) that ``kvcadence harness
    start`` recorded for its worker, when that worker is the one on ``server_url``'s port."""
    if not server_url:
        return None
    try:
        st = json.loads(harness.state_path().read_text())
        port = urlsplit(server_url).port
        if isinstance(st, dict) and port is not None and int(st.get("port", -1)) == port:
            v = st.get(key)
            return v if isinstance(v, str) and os.path.isabs(v) else None
    except (OSError, ValueError, TypeError):
        pass
    return None


def header_redactions(
    redact: Iterable[str] | None, server_url: str | None = None
) -> dict[str, str]:
    """The paths a capture's header must not name beyond home, temp and harness workdirs:
    each ``--redact PATH`` (as given and made absolute, symlinks resolved too) ->
    ``<redacted>``, and the ``--tokenizer`` directory of the harness worker recorded on
    ``server_url``'s port -> ``<harness-tokenizer>``. ``UsageError`` for an empty PATH or
    the root directory (it would scrub every absolute path)."""
    out: dict[str, str] = {}
    tok = _harness_path(server_url, "tokenizer")
    if tok is not None:
        out[tok] = HARNESS_TOKENIZER_PLACEHOLDER
    for raw in redact or ():
        if not raw.strip() or os.path.realpath(raw) == "/":
            raise UsageError(f"--redact {raw!r}: not a path to scrub (it would match every path)")
        for form in (raw, os.path.abspath(raw), os.path.realpath(raw)):
            out[os.path.normpath(form)] = REDACTED_PLACEHOLDER
    return out


def fetch_server_info(server_url: str, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """``GET {server}/server_info`` (falls back to the deprecated ``/get_server_info``)."""
    import httpx

    base = server_url.rstrip("/")
    last: Exception | None = None
    for path in ("/server_info", "/get_server_info"):
        try:
            resp = httpx.get(base + path, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise CaptureError(f"cannot reach {base}{path}: {exc}") from exc
        if resp.status_code == 404:
            last = CaptureError(f"{base}{path}: 404")
            continue
        if resp.status_code != 200:
            raise CaptureError(f"{base}{path}: HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            info = resp.json()
        except json.JSONDecodeError as exc:
            raise CaptureError(f"{base}{path}: not JSON ({exc})") from exc
        if not isinstance(info, dict):
            raise CaptureError(f"{base}{path}: expected a JSON object")
        return info
    raise CaptureError(f"{base}: no /server_info endpoint ({last})")


def _lookup(info: dict[str, Any], key: str) -> Any:
    if key in info:
        return info[key]
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        return states[0].get(key)
    return None


def snapshot(info: dict[str, Any]) -> dict[str, Any]:
    """The replay-relevant settings, flat (top level first, then ``internal_states[0]``)."""
    return {k: _lookup(info, k) for k in SNAPSHOT_FIELDS}


def endpoints_from_server_info(info: dict[str, Any], server_url: str) -> list[EndpointInfo]:
    """One ``EndpointInfo`` per DP rank from the ``kv_events`` block."""
    kv = info.get("kv_events")
    if not isinstance(kv, dict):
        raise CaptureError(
            f"{server_url}: /server_info has no kv_events block -- start the worker with "
            '--kv-events-config \'{"publisher":"zmq",...}\' (tcp endpoint, page_size > 0)'
        )
    if kv.get("publisher") not in (None, "zmq"):
        raise CaptureError(f"{server_url}: KV-event publisher is {kv.get('publisher')!r}, not zmq")
    try:
        base = int(kv["endpoint_port_base"])
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise CaptureError(f"{server_url}: kv_events has no endpoint_port_base") from exc
    host = str(kv.get("endpoint_host") or "")
    if host in WILDCARD_HOSTS:
        host = urlsplit(server_url).hostname or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    dp = kv.get("dp_size") or 1
    if isinstance(dp, str) and dp.strip().isdigit():
        dp = int(dp)
    problem = dp_size_problem(dp)
    if problem is not None:  # hostile or damaged: never one endpoint per claimed rank
        raise CaptureError(f"{server_url}: kv_events.dp_size: {problem}")
    topic = str(kv.get("topic") or "")
    rbase = kv.get("replay_endpoint_port_base")
    if rbase is not None and (isinstance(rbase, bool) or not isinstance(rbase, int)):
        raise CaptureError(
            f"{server_url}: kv_events.replay_endpoint_port_base is not an integer: {rbase!r}"[:300]
        )
    out = []
    for r in range(dp):
        replay = f"tcp://{host}:{int(rbase) + r}" if rbase is not None else None
        url = f"tcp://{host}:{base + r}"
        for u in (url, replay):
            problem = None if u is None else endpoint_problem(u)
            if problem is not None:
                raise CaptureError(f"{server_url}: kv_events advertises endpoint {u!r}: {problem}")
        out.append(EndpointInfo(r, url, replay, r, topic))
    return out


def explicit_endpoints(
    urls: list[str], replay_urls: list[str] | None, topic: str = ""
) -> list[EndpointInfo]:
    """``--endpoint`` i pairs with ``--replay-endpoint`` i (``none`` = no replay)."""
    replay_urls = replay_urls or []
    if len(replay_urls) > len(urls):
        raise UsageError("more --replay-endpoint than --endpoint options")
    if len(set(urls)) != len(urls):
        raise UsageError("an --endpoint is given twice (one socket per publisher)")
    out = []
    for i, url in enumerate(urls):
        check_endpoint(url, "--endpoint")
        rp = replay_urls[i] if i < len(replay_urls) else None
        if rp is not None and rp.lower() in ("none", "-", ""):
            rp = None
        if rp is not None:
            check_endpoint(rp, "--replay-endpoint")
        out.append(EndpointInfo(i, url, rp, i, topic))
    return out


def make_header(
    endpoints: list[EndpointInfo],
    *,
    server_info: dict[str, Any] | None,
    command: list[str],
    workdirs: Iterable[str | os.PathLike[str]] = (),
    more: Mapping[str, str] | None = None,
) -> Header:
    """A real-capture ``Header`` (``server_info`` whole, plus ``kvcadence_snapshot``), with
    machine paths in ``server_info`` and ``command`` scrubbed (``redact_paths``; harness
    ``workdirs`` given, or found from ``export_metrics_to_file_dir``; ``more``: the paths of
    ``header_redactions``)."""
    dirs = [*workdirs, *harness_workdirs(None, server_info)]
    info = redact_paths(dict(server_info or {}), dirs, more)
    if server_info is not None:
        info["kvcadence_snapshot"] = snapshot(info)
    command = redact_paths(list(command), dirs, more)
    kv_cfg = info.get("kv_events_config")
    return Header(
        format_major=FORMAT_MAJOR,
        format_minor=FORMAT_MINOR,
        source="real",
        kvcadence_version=__version__,
        sglang_version=str(info["version"]) if info.get("version") is not None else None,
        server_info=info,
        kv_events_config=kv_cfg if isinstance(kv_cfg, str) else None,
        command=list(command),
        start_ns=time.time_ns(),
        endpoints=list(endpoints),
    )
