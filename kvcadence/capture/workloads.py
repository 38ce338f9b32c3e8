"""Request workloads for ``kvcadence drive``: agent sessions, Mooncake traces, admission mixes.

A workload produces ``Req``s; token ids are deterministic (seeded) and stay inside the
model's vocabulary (``[3, vocab - 1]``: 0/1/2 are pad/BOS/EOS on the harness model).

* ``agent`` -- N closed-loop lanes of multi-turn coding-agent sessions: a shared system prefix
  (one of ``workloads``), turn 0 = prefix + a user chunk, turn k = previous prompt + previous
  output + a new user chunk; a session ends after ``turns`` turns or when the next prompt would
  exceed ``max_prompt``. Pauses between turns / sessions are exponential (``think_ms``,
  ``session_gap_ms``). Mirrors the shared fixture's ``workload.json`` parameters.
* ``mooncake`` -- Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``): hash id ``h`` always maps to the same ``block_tokens`` token ids, so prefix
  sharing is preserved (the mapping is ``format.mooncake``'s, shared with ``replay --trace``);
  open loop by timestamp (``speedup``) or closed loop with ``lanes``.
* ``admission`` -- the admission benchmark's JSONL (``rid``, ``l1_cached_tokens``,
  ``l2_cached_tokens``, ``extend_tokens``): each line becomes a priming request that caches the
  ``l1`` prefix, then the measured request = that prefix + ``l2`` + ``extend_tokens`` new
  tokens (the same total input as the benchmark's request), so the worker really reports
  ``l1`` cached tokens (in whole pages: set ``page_size``). A worker without HiCache has no
  host tier, so by default the L2 part is computed (``l2=extend``); ``l2=device`` primes
  ``l1 + l2`` instead. Each record notes the split and ``expected_cached_tokens``.

SPEC syntax: ``KIND[:key=value,key=value...]``, e.g. ``agent:lanes=4,requests=120,seed=101``,
``mooncake:path=trace.jsonl,speedup=4``, ``admission:path=mix.jsonl``; or ``@FILE.json``
holding ``{"kind": ..., ...}``.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvcadence.errors import InputError, UsageError
from kvcadence.format.mooncake import FIRST_TOKEN, HashIdTokens, parse_mooncake_line
from kvcadence.format.mooncake import need_int as _need_int
from kvcadence.format.mooncake import synthetic_tokens as _tokens
from kvcadence.suggest import did_you_mean


@dataclass
class Req:
    """One request to send (``input_ids`` as is; temperature 0, ``ignore_eos``)."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    lane: int | None = None
    session: int | None = None
    turn: int | None = None
    think_ns: int | None = None  # pause before sending (closed loop)
    arrival_ns: int | None = None  # trace offset from the start (open loop)
    note: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------ spec parsing


def _coerce(value: str) -> Any:
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            pass
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``KIND[:k=v,...]`` or ``@file.json`` -> ``(kind, params)``."""
    if spec.startswith("@"):
        path = Path(spec[1:])
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"{path}: cannot read workload JSON ({exc})") from exc
        if not isinstance(d, dict) or "kind" not in d:
            raise InputError(f'{path}: a workload file is a JSON object with "kind"')
        d = dict(d)
        return str(d.pop("kind")), d
    kind, _, rest = spec.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise UsageError(f"--workload {spec!r}: expected key=value, got {item!r}")
        params[k.strip()] = _coerce(v.strip())
    return kind, params


def workload_classes() -> dict[str, type[Workload]]:
    """Workload kind -> class (the ``KIND`` of a ``--workload`` SPEC)."""
    return {"agent": AgentWorkload, "mooncake": MooncakeWorkload, "admission": AdmissionWorkload}


def workload_keys() -> dict[str, list[tuple[str, Any]]]:
    """Workload kind -> its SPEC keys with their defaults (``drive --help`` lists them)."""
    return {
        kind: [(f.name, f.default) for f in fields(cls)]  # type: ignore[arg-type]
        for kind, cls in workload_classes().items()
    }


def build_workload(spec: str, **overrides: Any) -> Workload:

    kind, params = parse_spec(spec)
    params.update({k: v for k, v in overrides.items() if v is not None})
    classes = workload_classes()
    cls: Any = classes.get(kind)  # a dataclass subclass of Workload
    if cls is None:
        raise UsageError(
            f"unknown workload {kind!r}{did_you_mean(kind, classes)}; valid: {', '.join(classes)}"
        )
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(params) - set(names))
    if unknown:
        what = ", ".join(f"{k!r}{did_you_mean(k, names)}" for k in unknown)
        raise UsageError(f"workload {kind}: unknown key {what}; valid keys: {', '.join(names)}")
    wl = cls(**params)
    wl.validate()
    return wl


class Workload:
    """Base: ``lanes`` closed-loop lanes calling ``next_request(lane, prev)``; or, when
    ``open_loop()``, a fixed list of requests with arrival offsets."""

    lanes: int = 1

    def validate(self) -> None:  # pragma: no cover - overridden
        pass

    def open_loop(self) -> bool:
        return False

    def next_request(self, lane: int, prev: Req | None, prev_output: list[int]) -> Req | None:
        raise NotImplementedError

    def all_requests(self) -> list[Req]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        d["kind"] = self.kind  # type: ignore[attr-defined]
        return d


# ------------------------------------------------------------------------ agent


@dataclass
class AgentWorkload(Workload):
    kind = "agent"
    lanes: int = 4
    requests: int = 120
    seed: int = 101
    workloads: int = 2
    sys_min: int = 64
    sys_max: int = 160
    first_min: int = 40
    first_max: int = 240
    user_min: int = 16
    user_max: int = 120
    turns_min: int = 2
    turns_max: int = 8
    max_prompt: int = 800
    out_min: int = 8
    out_max: int = 64
    think_ms: float = 30.0
    session_gap_ms: float = 50.0
    vocab: int = 1024

    def validate(self) -> None:
        for lo, hi in (
            ("sys_min", "sys_max"),
            ("first_min", "first_max"),
            ("user_min", "user_max"),
            ("turns_min", "turns_max"),
            ("out_min", "out_max"),
        ):
            if not 0 < getattr(self, lo) <= getattr(self, hi):
                raise UsageError(f"agent workload: need 0 < {lo} <= {hi}")
        if self.lanes < 1 or self.requests < 1:
            raise UsageError("agent workload: lanes and requests must be >= 1")
        if self.vocab <= FIRST_TOKEN + 1:
            raise UsageError("agent workload: vocab too small")
        rng = random.Random(f"{self.seed}-sys")
        self._prefixes = [
            _tokens(rng, rng.randint(self.sys_min, self.sys_max), self.vocab)
            for _ in range(self.workloads)
        ]
        self._lock = threading.Lock()
        self._issued = 0
        self._state: dict[int, dict[str, Any]] = {}

    def _take(self, lane: int) -> bool:
        """Spend one request of ``lane``'s quota. Each lane owns a fixed share of
        ``requests`` (``requests // lanes``, the first ``requests % lanes`` lanes one more),
        so the set of requests a seed produces does not depend on which lane runs faster."""
        quota = self.requests // self.lanes + (1 if lane < self.requests % self.lanes else 0)
        with self._lock:
            st = self._state[lane]
            if st.get("issued", 0) >= quota:
                return False
            st["issued"] = st.get("issued", 0) + 1
            self._issued += 1
            return True

    def next_request(self, lane: int, prev: Req | None, prev_output: list[int]) -> Req | None:
        st = self._state.setdefault(
            lane, {"rng": random.Random(f"{self.seed}-lane{lane}"), "session": -1, "turns": 0}
        )
        rng: random.Random = st["rng"]
        new_session = prev is None or prev.turn is None or prev.turn + 1 >= st["turns"]
        if not new_session:
            assert prev is not None
            user = _tokens(rng, rng.randint(self.user_min, self.user_max), self.vocab)
            prompt = prev.input_ids + list(prev_output) + user
            if len(prompt) > self.max_prompt:
                new_session = True
        if new_session:
            st["session"] += 1
            st["turns"] = rng.randint(self.turns_min, self.turns_max)
            w = rng.randrange(self.workloads)
            first = _tokens(rng, rng.randint(self.first_min, self.first_max), self.vocab)
            prompt = self._prefixes[w] + first
            turn = 0
            pause_ms = rng.expovariate(1.0 / self.session_gap_ms) if self.session_gap_ms else 0
            st["workload"] = w
        else:
            assert prev is not None and prev.turn is not None
            turn = prev.turn + 1
            pause_ms = rng.expovariate(1.0 / self.think_ms) if self.think_ms else 0
        out_len = rng.randint(self.out_min, self.out_max)
        if prev is None:
            pause_ms = 0.0
        if not self._take(lane):
            return None
        return Req(
            rid=f"l{lane}-s{st['session']}-t{turn}",
            input_ids=prompt,
            max_new_tokens=out_len,
            lane=lane,
            session=st["session"],
            turn=turn,
            think_ns=int(pause_ms * 1e6),
            note={"workload": st["workload"]},
        )


# ------------------------------------------------------------------------ mooncake


def _read_jsonl(path: Path, what: str) -> list[dict[str, Any]]:
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what} ({exc})") from exc
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{i}: not JSON ({exc.msg})") from exc
        if not isinstance(d, dict):
            raise InputError(f"{path}:{i}: expected a JSON object")
        out.append(d)
    return out


@dataclass
class MooncakeWorkload(Workload):
    kind = "mooncake"
    path: str = ""
    block_tokens: int = 16
    speedup: float = 1.0
    lanes: int = 0  # 0 = open loop by timestamp; N = closed loop with N lanes
    max_concurrency: int = 64
    seed: int = 0
    vocab: int = 1024
    limit: int = 0
    max_output: int = 0  # cap output_length (0 = as in the trace)

    def validate(self) -> None:
        if not self.path:
            raise UsageError("mooncake workload needs path=FILE")
        if self.block_tokens < 1 or self.speedup <= 0:
            raise UsageError("mooncake workload: block_tokens >= 1 and speedup > 0")
        rows = _read_jsonl(Path(self.path), "Mooncake trace")
        if self.limit:
            rows = rows[: self.limit]
        self._reqs: list[Req] = []
        self._map = HashIdTokens(self.block_tokens, self.seed, self.vocab)  # shared with replay
        t0: float | None = None
        for i, d in enumerate(rows):
            where = f"{self.path}:{i + 1}"
            line = parse_mooncake_line(d, where)
            ts, n_in, n_out, hids = (
                line.timestamp_ms,
                line.input_length,
                line.output_length,
                line.hash_ids,
            )
            if self.max_output:
                n_out = min(n_out, self.max_output)
            t0 = ts if t0 is None else t0
            ids = self.prompt_for(hids, n_in, i)
            self._reqs.append(
                Req(
                    rid=f"mc-{i}",
                    input_ids=ids,
                    max_new_tokens=n_out,
                    arrival_ns=int((ts - t0) * 1e6 / self.speedup),
                    note={"hash_ids": len(hids)},
                )
            )
        self._next = 0
        self._lock = threading.Lock()

    def block(self, h: int) -> list[int]:
        return list(self._map.block(h))

    def prompt_for(self, hash_ids: list[int], n_in: int, idx: int) -> list[int]:
        return self._map.prompt(hash_ids, n_in, idx)

    def open_loop(self) -> bool:
        return self.lanes == 0

    def all_requests(self) -> list[Req]:
        return list(self._reqs)

    def next_request(self, lane: int, prev: Req | None, prev_output: list[int]) -> Req | None:
        with self._lock:
            if self._next >= len(self._reqs):
                return None
            r = self._reqs[self._next]
            self._next += 1
        r.lane = lane
        return r


# ------------------------------------------------------------------------ admission


@dataclass
class AdmissionWorkload(Workload):
    kind = "admission"
    path: str = ""
    lanes: int = 1
    out_tokens: int = 1
    seed: int = 0
    vocab: int = 1024
    page_size: int = 1
    l2: str = "extend"  # where the L2 part goes: "extend" (computed) or "device" (primed)

    def validate(self) -> None:
        if not self.path:
            raise UsageError("admission workload needs path=FILE")
        if self.l2 not in ("extend", "device"):
            raise UsageError(f"admission workload: l2 must be extend or device, got {self.l2!r}")
        if self.page_size < 1:
            raise UsageError("admission workload: page_size must be >= 1")
        rows = _read_jsonl(Path(self.path), "admission requests")
        self._pairs: list[tuple[Req | None, Req]] = []
        for i, d in enumerate(rows):
            where = f"{self.path}:{i + 1}"
            rid = str(d.get("rid", f"r{i}"))
            l1 = _need_int(d, "l1_cached_tokens", where)
            l2 = _need_int(d, "l2_cached_tokens", where)
            ext = _need_int(d, "extend_tokens", where, 1)
            rng = random.Random(f"{self.seed}-adm-{rid}")
            l1_ids = _tokens(rng, l1, self.vocab)
            l2_ids = _tokens(rng, l2, self.vocab)
            extend = _tokens(rng, ext, self.vocab)
            primed = l1_ids + l2_ids if self.l2 == "device" else l1_ids
            note = {
                "l1_cached_tokens": l1,
                "l2_cached_tokens": l2,
                "extend_tokens": ext,
                "l2_served_as": self.l2,
                # what the worker should report: the primed prefix in whole pages (the
                # prompt is longer than the prefix: extend_tokens >= 1)
                "expected_cached_tokens": len(primed) // self.page_size * self.page_size,
            }
            prime = Req(f"{rid}-prime", primed, 1, session=i, turn=0, note=note)
            main = Req(rid, l1_ids + l2_ids + extend, self.out_tokens, session=i, turn=1, note=note)
            self._pairs.append((prime if primed else None, main))
        self._next = 0
        self._lock = threading.Lock()

    def next_request(self, lane: int, prev: Req | None, prev_output: list[int]) -> Req | None:
        # a lane sends a pair's prime, then its measured request, then takes the next pair
        if prev is not None and prev.turn == 0 and prev.session is not None:
            main = self._pairs[prev.session][1]
            main.lane = lane
            return main
        with self._lock:
            if self._next >= len(self._pairs):
                return None
            prime, main = self._pairs[self._next]
            self._next += 1
        first = prime if prime is not None else main
        first.lane = lane
        return first
