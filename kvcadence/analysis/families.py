"""Hash families: do two streams hash blocks the same way, and if not, match them anyway.

A simulator may publish block hashes of its own (Dynamo's mocker chains xxh3 hashes; vLLM
hashes differently again) while its pages hold the same tokens as the real worker's. Then no
block hash is shared, and hash-based attribution (``kvcadence.analysis.attribution``) finds
nothing: the report must say so rather than show empty attribution.

Per bundle (``bundle_family``):

* **family**, from a per-event recomputation: every ``BlockStored`` that carries
  ``token_ids`` gets SGLang's hashes recomputed (``kvcadence.format.wire.block_digests``,
  chained from its parent's recomputed digest, ``cache_salt`` honoured); ``sglang`` when at
  least 90 % of the checked events equal their published hashes, ``other`` when at most 10 %
  do, ``mixed`` in between, ``unknown`` when no event could be checked (no token ids, or
  parents never seen). The first ``SAMPLE_EVENTS`` checkable events decide, or fewer (at
  least ``MIN_SAMPLE_EVENTS``) once they hold ``SAMPLE_PAGES`` pages: long prompts store
  hundreds of pages an event (a 6,000-request capture of 32k-token contexts at page 16 took
  13 cpu-s to check 2,000 events, 0.5 s now); a bundle that is not ``sglang`` is translated
  whole.
* **translation** (not-``sglang`` bundles with token ids): published hash -> SGLang hash, for
  every block whose chain could be followed.

Across bundles (``compare_families``): distinct stored hashes shared with the first (real)
bundle, published and after translation; a **mismatch** when the families differ, or when no
hash is shared although both stored blocks. For a mismatched bundle the attribution rule is run
again on the translated hashes (``attribution.attribute_arrays``), so prompt/output blocks and
Stored events per request are compared anyway; everything hash-agnostic (counts, sizes,
timing, composition) is in the other report sections already.

The report hook is ``kvcadence.analysis.report_extras.families_extra``: JSON
``hash_families``; section "Hash families", placed right after "Data quality", whose text is
one sentence naming the mismatch (or saying the families agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcadence.analysis import attribution as attr
from kvcadence.analysis import pages as kpages
from kvcadence.analysis import sql
from kvcadence.analysis.formatting import fmt
from kvcadence.errors import KvcadenceError
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import BlockStored

SAMPLE_EVENTS = 2000
#: ... or fewer events, once they hold this many pages (each a SHA-256 to recompute)
SAMPLE_PAGES = 50_000
MIN_SAMPLE_EVENTS = 100
SGLANG, OTHER, MIXED, UNKNOWN = "sglang", "other", "mixed", "unknown"
_DESC = {
    SGLANG: "SGLang's chained SHA-256 block hashes",
    OTHER: "block hashes of another family (not SGLang's SHA-256 of the tokens)",
    MIXED: "a mix of SGLang and other block hashes",
    UNKNOWN: "block hashes that cannot be checked (no token_ids in its Stored events)",
}


@dataclass
class Family:
    """What the recomputation found in one bundle."""

    family: str = UNKNOWN
    checked_events: int = 0
    matching_events: int = 0
    unchecked_events: int = 0  # no token ids, or a parent never seen
    translated: dict[int, int] = field(default_factory=dict)  # published -> SGLang int64

    def as_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "checked_events": self.checked_events,
            "matching_events": self.matching_events,
            "unchecked_events": self.unchecked_events,
            "translated_blocks": len(self.translated),
        }


def _verdict(checked: int, matching: int) -> str:
    if checked == 0:
        return UNKNOWN
    share = matching / checked
    return SGLANG if share >= 0.9 else OTHER if share <= 0.1 else MIXED


def _frames(bundle: str | Path) -> Any:
    """The bundle's event frames; an unreadable bundle just ends them (the quality checks and
    ingest say why)."""
    try:
        yield from BundleReader(bundle).events()
    except (OSError, KvcadenceError):
        return


def bundle_family(bundle: str | Path, *, sample: int = SAMPLE_EVENTS) -> Family:
    """Recompute SGLang hashes from each Stored event's ``token_ids`` (see the module doc)."""
    fam = Family()
    digests: dict[int, bytes] = {}  # published hash -> recomputed SGLang digest
    full = False
    pages = 0  # pages of the checked events
    for frame in _frames(bundle):
        try:
            batch = wire.decode_batch(frame.payload)
        except Exception:  # undecodable payloads are counted by the quality checks
            continue
        for ev in batch.events:
            if type(ev) is not BlockStored:
                continue
            if not ev.token_ids or ev.block_size <= 0:
                fam.unchecked_events += 1
                continue
            parent = None
            if ev.parent_block_hash is not None:
                parent = digests.get(ev.parent_block_hash)
                if parent is None:
                    fam.unchecked_events += 1
                    continue
            try:
                ds = wire.block_digests(ev.token_ids, ev.block_size, ev.cache_salt, parent)
            except Exception:  # tokens SGLang could not hash either
                fam.unchecked_events += 1
                continue
            mine = [wire.digest_to_int64(d) for d in ds]
            fam.checked_events += 1
            pages += len(mine)
            if mine == ev.block_hashes:
                fam.matching_events += 1
            for h, d in zip(ev.block_hashes, ds, strict=False):
                digests.setdefault(h, d)
        enough = fam.checked_events >= sample or (
            pages >= SAMPLE_PAGES and fam.checked_events >= min(sample, MIN_SAMPLE_EVENTS)
        )
        if not full and enough:
            if _verdict(fam.checked_events, fam.matching_events) == SGLANG:
                break  # an SGLang stream: nothing to translate
            full = True
    fam.family = _verdict(fam.checked_events, fam.matching_events)
    if fam.family != SGLANG:
        fam.translated = {h: wire.digest_to_int64(d) for h, d in digests.items()}
    return fam


def _distinct_stored(ing: Any) -> Any:
    import pyarrow.parquet as pq

    # the stored blocks' hashes only, filtered as each row group is read (reading ``kind``
    # whole and filtering the table after: 6x the time and ~2x the memory at 7.5M blocks)
    t = pq.read_table(ing.path("blocks"), columns=["hash"], filters=[("kind", "=", "stored")])
    return _unique(t.column("hash").to_numpy().view("int64"))


def _unique(x: Any) -> Any:
    """The distinct values of ``x``, sorted: a sort and a compare (``np.unique`` of numpy 2.3+
    takes a hash table for plain int arrays, ~1 us a value on random 64-bit hashes: 4.5 s
    for a production capture's 4.2M stored blocks, against 0.1 s sorted)."""
    import numpy as np

    s = np.sort(x)
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if len(s) else s


def _shared(a: Any, b: Any) -> int:
    """How many of the distinct sorted values ``a`` are in the distinct sorted ``b``: a
    binary search each (``np.isin`` sorts both together again: 2 s at 4M hashes)."""
    import numpy as np

    if not len(a) or not len(b):
        return 0
    at = np.searchsorted(b, a).clip(max=len(b) - 1)
    return int((b[at] == a).sum())


def _translate(hashes: Any, table: dict[int, int]) -> Any:
    import numpy as np

    if not table:
        return hashes
    keys = np.fromiter(table.keys(), dtype=np.int64, count=len(table))
    vals = np.fromiter(table.values(), dtype=np.int64, count=len(table))
    order = np.argsort(keys)
    keys, vals = keys[order], vals[order]
    pos = np.minimum(np.searchsorted(keys, hashes), len(keys) - 1)
    hit = keys[pos] == hashes
    return np.where(hit, vals[pos], hashes)


def _attribution_translated(ing: Any, page_size: int, table: dict[int, int]) -> dict[str, Any]:
    """The attribution rule on translated hashes: totals and per-request means."""
    import numpy as np

    con = sql.connect(ing)
    try:
        _, req, ev = attr.load_columns(ing, con)
        if len(req.n_input) == 0:
            return {}
        ev.hashes = np.ascontiguousarray(_translate(ev.hashes, table))
        pages = kpages.load(ing, con, page_size)
        a = attr.attribute_arrays(pages, req, ev, page_size)
    finally:
        con.close()

    def mean(xs: list[int]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    return {
        "stored_blocks": a.stored_blocks,
        "matched_blocks": a.matched_blocks,
        "prompt_blocks": a.prompt_blocks,
        "output_blocks": a.output_blocks,
        "unmatched_blocks": a.unmatched_blocks,
        "stored_events_per_request": mean(a.req_stored_events),
        "prefill_store_events_per_request": mean(a.req_prefill_events),
        "finish_store_events_per_request": mean(a.req_finish_events),
        "event_kinds": dict(sorted(a.event_kinds.items())),
    }


def compare_families(labelled: list[tuple[str, Any]], ings: list[Any]) -> dict[str, Any]:
    """Per bundle: family, shared hashes with the first bundle, and for a mismatched bundle
    attribution on translated hashes; plus ``mismatches`` (labels) and ``sentence``."""

    fams = [bundle_family(ing.bundle) for ing in ings]
    real_label = labelled[0][0]
    real_hashes = _distinct_stored(ings[0])
    real_t = _unique(_translate(real_hashes, fams[0].translated)) if fams[0].translated else None
    real_sg = real_t if real_t is not None else real_hashes
    out: dict[str, Any] = {"bundles": {}, "mismatches": []}
    for i, ((label, m), ing, fam) in enumerate(zip(labelled, ings, fams, strict=True)):
        d = fam.as_dict()
        mine = _distinct_stored(ing) if i else real_hashes
        d["distinct_stored_hashes"] = int(len(mine))
        if i:
            shared = _shared(mine, real_hashes)
            d["shared_with_real_blocks"] = shared
            mismatch = (
                fam.family != fams[0].family and UNKNOWN not in (fam.family, fams[0].family)
            ) or (shared == 0 and len(mine) and len(real_hashes))
            d["mismatch"] = bool(mismatch)
            if mismatch:
                out["mismatches"].append(label)
                mine_sg = _unique(_translate(mine, fam.translated))
                d["recomputed_shared_with_real_blocks"] = _shared(mine_sg, real_sg)
        if fam.translated:
            page = int(m.inputs.get("page_size") or 1)
            d["attribution_recomputed"] = _attribution_translated(ing, page, fam.translated)
        out["bundles"][label] = d
    out["sentence"] = _sentence(real_label, out)
    return out


def _sentence(real_label: str, out: dict[str, Any]) -> str:
    b = out["bundles"]
    real = b[real_label]
    if not out["mismatches"]:
        return (
            f"Hash families agree: every bundle publishes {_DESC[real['family']]}, so "
            "block-hash attribution and shared-block counts are comparable."
        )
    parts = []
    for label in out["mismatches"]:
        d = b[label]
        parts.append(
            f"{label} publishes {_DESC[d['family']]} ({d['matching_events']} of "
            f"{d['checked_events']} checked Stored events match SGLang's hashes recomputed from "
            f"their token_ids; {d['shared_with_real_blocks']} of {d['distinct_stored_hashes']} "
            f"block hashes shared with {real_label})"
        )
    return (
        f"Hash-family mismatch: {real_label} publishes {_DESC[real['family']]}, but "
        + "; ".join(parts)
        + ", so hash-based attribution is empty for "
        + ", ".join(out["mismatches"])
        + " and is recomputed below on SGLang hashes rebuilt from token_ids; every "
        "hash-agnostic figure (counts, sizes, timing, composition) compares as usual."
    )


_ROWS = (
    ("family", "family"),
    ("checked Stored events", "checked_events"),
    ("… matching SGLang's recomputed hashes", "matching_events"),
    ("Stored events not checkable", "unchecked_events"),
    ("distinct stored hashes", "distinct_stored_hashes"),
    ("… shared with the first bundle", "shared_with_real_blocks"),
    ("… shared after recomputing SGLang hashes", "recomputed_shared_with_real_blocks"),
)
_ATTR_ROWS = (
    "matched_blocks",
    "prompt_blocks",
    "output_blocks",
    "unmatched_blocks",
    "stored_events_per_request",
    "prefill_store_events_per_request",
    "finish_store_events_per_request",
)


def families_section(data: dict[str, Any]) -> tuple[str, str, dict[str, list[str]]]:
    labels = list(data["bundles"])
    t: dict[str, list[str]] = {"check": []}
    for label in labels:
        t[label] = []
    for title, key in _ROWS:
        t["check"].append(title)
        for label in labels:
            v = data["bundles"][label].get(key)
            t[label].append(v if isinstance(v, str) else fmt(v))
    if any("attribution_recomputed" in d for d in data["bundles"].values()):
        for key in _ATTR_ROWS:
            t["check"].append(f"recomputed attribution: {key}")
            for label in labels:
                v = data["bundles"][label].get("attribution_recomputed", {}).get(key)
                t[label].append(fmt(v))
    return "Hash families", data["sentence"], t
