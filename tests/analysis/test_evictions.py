"""``kvcadence evictions``: two eviction traces compared (``analysis.evictions``)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from kvcadence.analysis.evictions import compare
from kvcadence.cli import main


def _line(cause, need, avail0, freed, rids, **extra):
    return {"t": 0.0, "cause": cause, "need": need, "avail0": avail0,
            "avail1": avail0 + freed, "freed": freed, "rids": rids, **extra}  # fmt: skip


def _write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


REAL = [
    _line("prefill", 58, 80, 64, ["a"], call="evict_for_alloc", stack=["x"]),
    _line("decode", 80, 16, 144, ["a", "b", "c", "d", "e", "f"]),
    _line("prefill", 200, 100, 300, ["b", "c"]),
    _line("check_decode", 2, 1, 0, ["a", "b", "c"]),  # nothing left: a retraction follows
    _line("retract", 40, 20, 50, ["a"]),
    _line("prefill", 10, 6, 16, ["a"]),  # "a" again: its second prefill batch
]
SIM = [
    _line("prefill", 50, 88, 64, ["a"]),  # the same demand (138), another split
    _line("decode", 64, 32, 96, ["a", "b", "c", "d", "e", "f"]),
    _line("prefill", 150, 100, 160, ["b", "c"]),  # another demand
    _line("prefill", 20, 6, 32, ["a"]),
]


def test_figures_and_the_batches_in_both(tmp_path, capsys):
    real, sim = _write(tmp_path / "r.jsonl", REAL), _write(tmp_path / "s.jsonl", SIM)
    doc = compare(real, sim)
    assert doc["real"]["by_cause"] == {"prefill": 3, "decode": 1, "check_decode": 1, "retract": 1}
    assert doc["real"]["tokens_freed"]["prefill"] == 64 + 300 + 16
    assert doc["real"]["decode_demand_per_request"] == {"16": 1}
    assert doc["sim"]["decode_demand_per_request"] == {"16": 1}
    assert doc["real"]["nothing_left"] == 1 and doc["real"]["at_target"] == 5
    assert doc["real"]["short_by_cause"] == {"check_decode": 1}
    # ("a", 0), ("b", "c") and ("a", 1): the first the same demand, the others not
    assert doc["prefill_batches_in_both"] == 3 and doc["prefill_same_demand"] == 1
    assert {tuple(d["rids"]) for d in doc["prefill_differing"]} == {("b", "c"), ("a",)}
    assert main(["evictions", str(real), str(sim)]) == 0
    out = capsys.readouterr().out
    assert "prefill batches in both traces: 3, asking the same demand: 1" in out
    assert "differs: b,c: real 300, sim 250" in out
    assert main(["evictions", str(real), str(sim), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(doc))


def test_bundles_split_the_batches_whose_caches_agree(tmp_path, capsys):
    """``--bundles``: ``("b", "c")`` found other cached prefixes in the replay (its other
    demand is a different cache), ``("a",)``'s first batch the same (its demand the rule's):
    the differences listed are those of batches whose caches agree."""
    from kvcadence.format.schema import RequestRecord
    from tests.analysis.helpers import write_bundle

    def bundle(path, cached, retracted=()):
        recs = [
            RequestRecord(
                rid=k,
                input_ids=[1, 2, 3],
                cached_tokens=v,
                meta_info={"num_retractions": int(k in retracted)},
            )
            for k, v in cached
        ]
        return write_bundle(path, [], recs)

    real = _write(tmp_path / "r.jsonl", REAL)
    sim = _write(tmp_path / "s.jsonl", SIM)
    cap = bundle(tmp_path / "cap", [("a", 64), ("b", 0), ("c", 16)])
    rep = bundle(tmp_path / "rep", [("a", 64), ("b", 0), ("c", 48)])
    doc = compare(real, sim, (cap, rep))
    # ("a", 0) and ("a", 1) agree (a's cached prefix is recorded once: both batches count)
    assert doc["prefill_cached_agree"] == {"batches": 2, "same_demand": 1}
    assert [tuple(d["rids"]) for d in doc["prefill_differing"]] == [("a",)]
    assert compare(real, sim)["prefill_cached_agree"] is None
    # a retracted request's cached_tokens is its first prefill's: none of its batches count
    again = bundle(tmp_path / "rep2", [("a", 64), ("b", 0), ("c", 48)], retracted=("a",))
    assert compare(real, sim, (cap, again))["prefill_cached_agree"] == {
        "batches": 0,
        "same_demand": 0,
    }
    assert main(["evictions", str(real), str(sim), "--bundles", str(cap), str(rep)]) == 0
    out = capsys.readouterr().out
    assert "with the same cached prefixes in both bundles: 2, asking the same demand: 1" in out
    assert (
        main(["evictions", str(real), str(sim), "--bundles", str(tmp_path / "no"), str(rep)]) == 2
    )
    assert "no such bundle" in capsys.readouterr().err


def test_bad_traces_are_one_line_and_exit_2(tmp_path, capsys):
    good = _write(tmp_path / "g.jsonl", SIM)
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps(REAL[0]) + "\n\n{not json\n")
    assert main(["evictions", str(bad), str(good)]) == 2
    assert main(["evictions", str(tmp_path / "none.jsonl"), str(good)]) == 2
    _write(tmp_path / "c.jsonl", [{**REAL[0], "cause": "flush"}])
    assert main(["evictions", str(tmp_path / "c.jsonl"), str(good)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(x.startswith("kvcadence: error: ") for x in err)
    assert f"{bad}:3: not an eviction trace line" in err[0]
    assert "eviction trace file not found" in err[1] and "unknown cause 'flush'" in err[2]


_lines = st.lists(
    st.builds(
        _line,
        st.sampled_from(["prefill", "decode", "check_decode", "retract"]),
        st.integers(1, 500),
        st.integers(0, 500),
        st.integers(0, 800),
        st.lists(st.sampled_from("abcdef"), min_size=1, max_size=4),
    ),
    max_size=30,
)


@given(_lines)
def test_a_trace_against_itself_agrees_everywhere(tmp_path_factory, lines):
    path = _write(tmp_path_factory.mktemp("t") / "t.jsonl", lines)
    doc = compare(path, path)
    assert doc["real"] == doc["sim"]
    n = sum(x["cause"] == "prefill" for x in lines)
    assert doc["prefill_batches_in_both"] == doc["prefill_same_demand"] == n
    assert doc["real"]["evictions"] == len(lines) and not doc["prefill_differing"]
    assert doc["real"]["at_target"] == sum(x["freed"] >= x["need"] for x in lines)
    assert doc["real"]["nothing_left"] == sum(x["freed"] == 0 for x in lines)
