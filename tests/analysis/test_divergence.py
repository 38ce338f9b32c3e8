"""Where a replay parts from its capture (``analysis.divergence``), on real captures of the
corpus with one message taken out or one ``cached_tokens`` changed on purpose."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from kvcadence.analysis import divergence, report
from kvcadence.analysis.cache import ingest
from kvcadence.format.bundle import BundleReader, BundleWriter
from kvcadence.format.schema import EventFrame, Header, RequestRecord, Trailer

CORPUS = Path(__file__).parent.parent / "replay" / "data" / "corpus"


def _copy(src: Path, dst: Path, drop: dict[int, int] | None = None, cached: str = "") -> Path:
    """``src``'s records into ``dst``; ``drop``: rank -> index of the rank's event frame to
    leave out; ``cached``: the rid whose ``cached_tokens`` gets one more."""
    rd = BundleReader(src)
    rank_of = {e.id: int(e.dp_rank) for e in rd.header.endpoints}
    seen: dict[int, int] = {}
    with BundleWriter(dst, rd.header) as w:
        for rec in rd.records():
            if isinstance(rec, (Header, Trailer)):
                continue
            if isinstance(rec, EventFrame):
                rank = rank_of.get(rec.endpoint, 0)
                k = seen.get(rank, 0)
                seen[rank] = k + 1
                if drop and drop.get(rank) == k:
                    continue
            if isinstance(rec, RequestRecord) and rec.rid == cached:
                rec = msgspec.structs.replace(rec, cached_tokens=(rec.cached_tokens or 0) + 1)
            w.write(rec)
    return dst


def test_a_bundle_against_itself_agrees_everywhere(tmp_path: Path) -> None:
    src = CORPUS / "p4-mrr3" / "bundle"
    a, b = ingest(src), ingest(_copy(src, tmp_path / "same"))
    d = divergence.compare("real", a, "sim", b, 4)
    (p,) = d.ranks
    assert p.same == p.real_messages == p.sim_messages > 200
    assert p.real is None and p.sim is None and d.first_cached is None
    assert "(none: the streams agree)" in divergence.section(d)[2]["real message"]


def test_the_first_differing_message_and_request(tmp_path: Path) -> None:
    """Frame 40 left out (frame 0 is the start-up clear, skipped): 39 messages equal, then
    message 41 of the capture against message 42; each block run named by its request."""
    src = CORPUS / "p4-mrr3" / "bundle"
    rid = "l3-s2-t1"
    got = _copy(src, tmp_path / "cut", drop={0: 40}, cached=rid)
    d = divergence.compare("real", ingest(src), "sim", ingest(got), 4)
    (p,) = d.ranks
    assert (p.same, p.real_messages - p.sim_messages) == (39, 1)
    assert p.real is not None and p.sim is not None and p.real != p.sim
    # every block of a real capture is some request's page: named, prompt or output, runs
    # of consecutive pages whose lengths add up to the event's blocks
    for head, runs in p.real + p.sim:
        assert head in ("S", "R") and runs
        assert all(rid is not None and b - a + 1 == n for rid, a, b, _, n in runs)
    text = divergence.message_text(p.real)
    assert text[0].startswith(("S ", "R ")) and " p" in " ".join(text)
    assert d.first_cached is not None and d.first_cached["rid"] == rid
    assert d.first_cached["sim"] == d.first_cached["real"] + 1


def test_dp_ranks_part_separately(tmp_path: Path) -> None:
    src = CORPUS / "dp2-p8-lpm" / "bundle"
    got = _copy(src, tmp_path / "cut", drop={1: 20})
    d = divergence.compare("real", ingest(src), "sim", ingest(got), 8)
    r0, r1 = d.ranks
    assert (r0.rank, r1.rank) == (0, 1)
    assert r0.same == r0.real_messages == r0.sim_messages and r0.real is None
    assert r1.same == 19 and r1.real_messages == r1.sim_messages + 1
    assert d.first_cached is None


def test_the_report_has_the_section(tmp_path: Path) -> None:
    src = CORPUS / "p4-mrr3" / "bundle"
    got = _copy(src, tmp_path / "cut", drop={0: 40})
    out = tmp_path / "rep"
    report.make_report([str(src), str(got)], out, default_gates=False, plots=False)
    doc = json.loads((out / "report.json").read_text())
    (entry,) = doc["divergence"]
    assert entry["ranks"][0]["same_messages"] == 39
    md = (out / "report.md").read_text()
    assert "## Divergence (" in md
    # the events of a message are joined with ';' (a '|' would split the table's cells)
    row = next(line for line in md.splitlines() if line.startswith("| 0 "))
    assert row.count("|") == 5


def test_rids_are_escaped_in_the_section() -> None:
    """Rids are the clients' text: Markdown-escaped in the section (as the report's other
    rid columns), raw in the JSON."""
    p = divergence.Parting(0, 3, 9, 9, real=[("S", [("a|b[x](y)", 0, 1, True, 2)])], sim=[])
    d = divergence.Divergence(
        "real", "sim", [p], {"rid": "<i>", "arrival_index": 1, "real": 0, "sim": 4}
    )
    title, text, table = divergence.section(d)
    assert "\\<i\\>" in text and "<i>" not in text
    assert table["real message"] == ["S 2: a\\|b\\[x\\]\\(y\\) p0-1"]
    assert table["sim message"] == ["(no events)"]
    assert d.as_dict()["ranks"][0]["real_message"] == ["S 2: a|b[x](y) p0-1"]
