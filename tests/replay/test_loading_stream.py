"""A replay reads a bundle's request records one at a time, production captures included.

* ``load_for_replay`` never lists every record as plain lists (``BundleReader.requests``):
  a production capture's inference runs on the compact records and completes them exactly
  as it completes the plain ones;
* the sweep's up-front check and the fleet dispatch count ranks from a streamed pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcadence.format.bundle import BundleReader
from kvcadence.replay.loading import load_for_replay
from kvcadence.replay.production import records_for_replay
from kvcadence.replay.sweep import validate_jobs
from kvcadence.replay.tokens import as_list
from kvcadence.replay.worker import bundle_dp_size, dp_size_of
from tests.replay.test_production_path import production_copy

DATA = Path(__file__).parent / "data"
DP2 = DATA / "sglang-0.5.23-dp2-agent-ps1"


@pytest.fixture(scope="module")
def prod(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prod") / "prod"
    production_copy(DP2, p)
    return p


def _plain(rec):
    return (
        rec.rid,
        as_list(rec.input_ids),
        as_list(rec.output_ids),
        rec.lane,
        rec.session,
        rec.turn,
        rec.error,
    )


def test_production_records_are_completed_from_the_streamed_compact_records(prod, monkeypatch):
    whole, whole_rep, whole_fl = records_for_replay(BundleReader(prod))  # plain records

    def refused(self):
        raise AssertionError("BundleReader.requests(): every record read as plain lists")

    monkeypatch.setattr(BundleReader, "requests", refused)
    recs, rep, flushes = load_for_replay(BundleReader(prod))
    assert rep == whole_rep and rep["outputs_from_events"] == 100
    assert flushes == whole_fl
    assert not isinstance(recs[0].input_ids, list)  # compact prompts, kept compact
    assert [_plain(r) for r in recs] == [_plain(r) for r in whole]


def test_a_packed_request_s_ids_never_become_a_list_of_ints(prod, monkeypatch):
    """The replay reads a format 2.0 bundle's packed requests with their ids as the arrays
    the reader rebuilds (``BundleReader.request_arrays``): no prompt is made a list of ints
    on the way (``PrefixResolver.record``, ``array.tolist``) and made an array again; the
    records are the same."""
    from kvcadence.format.bundle.compact import PrefixResolver

    whole = load_for_replay(BundleReader(prod))

    def listed(self, rec):
        raise AssertionError("a packed request's ids made a list of ints")

    monkeypatch.setattr(PrefixResolver, "record", listed)
    recs, rep, flushes = load_for_replay(BundleReader(prod))
    rd = BundleReader(prod)
    assert sum(1 for _ in rd.request_arrays()) == rd.report.packed_requests == len(recs) == 100
    assert (rep, flushes) == whole[1:]
    assert [_plain(r) for r in recs] == [_plain(r) for r in whole[0]]


def test_rank_count_is_streamed(prod, monkeypatch):
    reader = BundleReader(DP2)
    expected = dp_size_of(reader.header, reader.requests())
    monkeypatch.setattr(
        BundleReader, "requests", lambda self: (_ for _ in ()).throw(AssertionError("whole"))
    )
    assert bundle_dp_size(BundleReader(DP2)) == (expected, 100)
    validate_jobs([{"bundles": [str(DP2), str(prod)], "point": {"page_size": 1}}])
