"""Eviction traces compared: a real worker's (``harness start --trace-evictions``) against a
replay's (``replay --trace-evictions``), or any two of the same shape.

What this file owns: ``read_trace`` (a trace file, line by line) and ``compare`` (the
figures ``kvcadence evictions`` prints). The KV events say what was evicted; a trace says
why and for how much -- each line one eviction call with a shortfall: its ``cause``
(``prefill``, ``decode``, ``check_decode``, ``retract``; a real line the harness could not
place is ``other``), the tokens asked of the tree (``need``), the allocator's available
tokens before and after (``avail0``, ``avail1``), the tokens freed and the batch's ``rids``.

Per trace: calls and tokens freed by cause; the *demand* of each call (``need + avail0``,
what the allocation asked to have free) per request of its batch for the decode
allocations (SGLang 0.5.23 ``alloc_paged_token_slots_decode``: a page each); how many calls
stopped at their target (``avail1 >= avail0 + need``) and how many found nothing left to
evict (``freed == 0``: a decode check that then retracts); the calls that stopped short
(every unlocked leaf gone: harmless for a decode allocation, which asks for a page per
request whether it needs one or not). Between the two: the prefill
batches of the same requests (the same ``rids`` in the same order, the k-th time in each
trace) and how many of them asked for the same demand -- the allocation rule, independent
of when each ran.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvcadence.errors import InputError
from kvcadence.format.bundle import BundleReader
from kvcadence.format.jsonl import jsonl_raw_lines
from kvcadence.format.schema import EVICTION_CAUSES as CAUSES
from kvcadence.format.schema import EvictionTraceLine


def read_trace(path: str | Path) -> Iterator[EvictionTraceLine]:
    """The lines of trace ``path``, one at a time (``format.jsonl.jsonl_raw_lines``: blank
    lines skipped; ``InputError``, naming the file and the line, for one that is not a trace
    line; ``UsageError`` for a file that cannot be read)."""
    dec = msgspec.json.Decoder(EvictionTraceLine)
    for where, raw in jsonl_raw_lines(Path(path), "eviction trace"):
        try:
            line = dec.decode(raw)
        except msgspec.DecodeError as exc:
            raise InputError(f"{where}: not an eviction trace line ({exc})") from None
        if line.cause not in CAUSES:
            raise InputError(f"{where}: unknown cause {line.cause!r}")
        yield line


@dataclass
class TraceFigures:
    """One trace's figures (see module docstring)."""

    calls: Counter[str] = field(default_factory=Counter)
    freed: Counter[str] = field(default_factory=Counter)
    #: decode allocations by demand per request of the batch (tokens)
    decode_demand: Counter[int] = field(default_factory=Counter)
    at_target: int = 0
    #: calls below their target (the tree ran out of unlocked leaves), by cause
    short: Counter[str] = field(default_factory=Counter)
    nothing_left: int = 0
    #: (the batch's rids, its occurrence) -> the demand of its prefill eviction
    prefill: dict[tuple[tuple[str, ...], int], int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def figures(path: str | Path) -> TraceFigures:
    """``TraceFigures`` of trace ``path``, read once."""
    out = TraceFigures()
    seen: Counter[tuple[str, ...]] = Counter()
    for x in read_trace(path):
        out.calls[x.cause] += 1
        out.freed[x.cause] += x.freed
        demand = x.need + x.avail0
        if x.avail1 >= demand:
            out.at_target += 1
        else:
            out.short[x.cause] += 1
        out.nothing_left += x.freed == 0
        if x.cause == "decode" and x.rids:
            per, rest = divmod(demand, len(x.rids))
            out.decode_demand[per if not rest else -1] += 1  # -1: not a whole share each
        if x.cause == "prefill" and x.rids:
            key = tuple(x.rids)
            out.prefill[(key, seen[key])] = demand
            seen[key] += 1
    return out


def cached_by_rid(bundle: str | Path) -> dict[str, int | None]:
    """``rid -> cached_tokens`` of a bundle's request records, read one at a time; None for
    a retracted request (its ``cached_tokens`` is its first prefill's, while its re-prefill
    extends what it had decoded by the retraction: no batch of it is comparable)."""
    return {
        r.rid: None if (r.meta_info or {}).get("num_retractions") else r.cached_tokens
        for r in BundleReader(Path(bundle)).request_arrays()
    }


def compare(
    real: str | Path, sim: str | Path, bundles: tuple[str | Path, str | Path] | None = None
) -> dict[str, Any]:
    """The figures of both traces and of the prefill batches they share (a JSON document).
    ``bundles``: the capture and its replay; then the prefill batches in both traces whose
    every request found the same cached prefix in both (``cached_tokens``; no request
    retracted in either) are counted apart: there a different demand is a different
    allocation rule, elsewhere it is a different cache."""
    a, b = figures(real), figures(sim)
    both = [k for k in a.prefill if k in b.prefill]
    same = sum(a.prefill[k] == b.prefill[k] for k in both)
    shown = both
    agree: dict[str, int] = {}
    if bundles is not None:
        rc, sc = cached_by_rid(bundles[0]), cached_by_rid(bundles[1])
        shown = [
            k
            for k in both
            if all(rc.get(rid) is not None and rc.get(rid) == sc.get(rid) for rid in k[0])
        ]
        agree = {
            "batches": len(shown),
            "same_demand": sum(a.prefill[k] == b.prefill[k] for k in shown),
        }

    def side(f: TraceFigures) -> dict[str, Any]:
        return {
            "evictions": f.total,
            "by_cause": {c: f.calls[c] for c in CAUSES if f.calls[c]},
            "tokens_freed": {c: f.freed[c] for c in CAUSES if f.calls[c]},
            "decode_demand_per_request": {
                str(k): v for k, v in sorted(f.decode_demand.items()) if k >= 0
            },
            "decode_demand_uneven": f.decode_demand[-1],
            "at_target": f.at_target,
            "short_by_cause": {c: f.short[c] for c in CAUSES if f.short[c]},
            "nothing_left": f.nothing_left,
            "prefill_batches": len(f.prefill),
        }

    return {
        "real": side(a),
        "sim": side(b),
        "prefill_batches_in_both": len(both),
        "prefill_same_demand": same,
        "prefill_cached_agree": agree or None,
        "prefill_differing": [
            {"rids": list(k[0]), "real": a.prefill[k], "sim": b.prefill[k]}
            for k in shown
            if a.prefill[k] != b.prefill[k]
        ][:20],
    }


def render(doc: dict[str, Any]) -> str:
    """``compare``'s document as the command's text table."""
    r, s = doc["real"], doc["sim"]
    rows = [("evictions", r["evictions"], s["evictions"])]
    for c in CAUSES:
        if c in r["by_cause"] or c in s["by_cause"]:
            rows.append((f"  {c}", r["by_cause"].get(c, 0), s["by_cause"].get(c, 0)))
    rows.append(("tokens freed", sum(r["tokens_freed"].values()), sum(s["tokens_freed"].values())))
    rows.append(("stopped at the target", r["at_target"], s["at_target"]))
    for c in CAUSES:
        if c in r["short_by_cause"] or c in s["short_by_cause"]:
            short = (r["short_by_cause"].get(c, 0), s["short_by_cause"].get(c, 0))
            rows.append((f"  short of it: {c}", *short))
    rows.append(("found nothing to evict", r["nothing_left"], s["nothing_left"]))
    rows.append(("prefill batches", r["prefill_batches"], s["prefill_batches"]))
    lines = [f"{'':28s}{'real':>10s}{'sim':>10s}"]
    lines += [f"{k:28s}{a:>10}{b:>10}" for k, a, b in rows]
    for name, d in (("real", r), ("sim", s)):
        dem = ", ".join(f"{k} tokens: {v}" for k, v in d["decode_demand_per_request"].items())
        if dem or d["decode_demand_uneven"]:
            odd = f", uneven: {d['decode_demand_uneven']}" if d["decode_demand_uneven"] else ""
            lines.append(f"decode allocations by demand per request ({name}): {dem}{odd}")
    lines.append(
        f"prefill batches in both traces: {doc['prefill_batches_in_both']}, asking the same "
        f"demand: {doc['prefill_same_demand']}"
    )
    if doc["prefill_cached_agree"] is not None:
        ag = doc["prefill_cached_agree"]
        lines.append(
            f"  of them with the same cached prefixes in both bundles: {ag['batches']}, "
            f"asking the same demand: {ag['same_demand']}"
        )
    for d in doc["prefill_differing"][:5]:
        lines.append(f"  differs: {','.join(d['rids'])}: real {d['real']}, sim {d['sim']}")
    return "\n".join(lines)
