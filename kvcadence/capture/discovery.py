"""Discovery: ``GET /server_info`` -> KV-event endpoints (one per DP rank) + a config snapshot.

SGLang's ``/server_info`` (0.5.23) carries a ``kv_events`` block (``endpoint_host``,
``endpoint_port_base``, ``dp_size``, ``topic``, ``replay_endpoint_port_base``) next to the
resolved server arguments and the scheduler info. Rank ``r`` publishes on ``base + r`` (and
replays on ``replay_base + r``). A wildcard host is replaced by the server's own host.
The snapshot keeps the fields the simulator needs; the whole JSON is stored as well.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlsplit

from kvcadence import __version__
from kvcadence.capture.schema import FORMAT_MAJOR, FORMAT_MINOR, EndpointInfo, Header
from kvcadence.errors import CaptureError, UsageError

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
    except (KeyError, TypeError, ValueError) as exc:
        raise CaptureError(f"{server_url}: kv_events has no endpoint_port_base") from exc
    host = str(kv.get("endpoint_host") or "")
    if host in WILDCARD_HOSTS:
        host = urlsplit(server_url).hostname or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    dp = int(kv.get("dp_size") or 1)
    topic = str(kv.get("topic") or "")
    rbase = kv.get("replay_endpoint_port_base")
    out = []
    for r in range(dp):
        replay = f"tcp://{host}:{int(rbase) + r}" if rbase is not None else None
        out.append(EndpointInfo(r, f"tcp://{host}:{base + r}", replay, r, topic))
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
        if "://" not in url:
            raise UsageError(f"--endpoint {url!r}: expected tcp://HOST:PORT (or ipc://...)")
        rp = replay_urls[i] if i < len(replay_urls) else None
        if rp is not None and rp.lower() in ("none", "-", ""):
            rp = None
        out.append(EndpointInfo(i, url, rp, i, topic))
    return out


def make_header(
    endpoints: list[EndpointInfo],
    *,
    server_info: dict[str, Any] | None,
    command: list[str],
) -> Header:
    """A real-capture ``Header`` (``server_info`` whole, plus ``kvcadence_snapshot``)."""
    info = dict(server_info or {})
    if server_info is not None:
        info["kvcadence_snapshot"] = snapshot(server_info)
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
