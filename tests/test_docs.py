"""The documentation says only what exists: every ``--flag`` it names is a kvcadence flag (or
one of the listed SGLang/torchrun flags), every drive workload key and every sweep-table
column is documented, and nothing points at a file outside the repository or an issue
number."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcadence import cli
from kvcadence.replay.config import UNMODELLED

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", REPO / "examples" / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: flags of other programs the docs mention (SGLang's server, torchrun, bench/run)
OTHER_FLAGS = {
    "--device",
    "--enable-dynamic-chunking",
    "--sleep-on-idle",
    "--enable-dp-attention",
    "--kv-events-config",
    "--export-metrics-to-file",
    "--export-metrics-to-file-dir",
    "--log-requests",
    "--log-requests-format",
    "--log-requests-level",
    "--log-requests-target",
    "--model-path",
    "--standalone",
    "--quick",
    # bench/run and bench/bench_memory.py (named by the generated docs/performance.md and
    # docs/performance-at-size.md)
    "--runs",
    "--full",
    "--args",
    "--only",
    "--replay-requests",
    "--report-events",
    # the SGLang launch command of examples/README.md
    "--attention-backend",
    "--enable-metrics",
    "--host",
    "--mem-fraction-static",
    "--port",
    "--sampling-backend",
    "--skip-server-warmup",
    "--skip-tokenizer-init",
    # the SGLang flag ``harness start --tokenizer`` passes (docs/production.md)
    "--tokenizer-path",
    # Dynamo's mocker command and bench/peers/run_mocker.py (docs/peers.md)
    "--block-size",
    "--discovery-backend",
    "--engine-type",
    "--kv-bytes-per-token",
    "--num-gpu-blocks-override",
    "--response-replay-trace-path",
    "--sglang-chunked-prefill-size",
    "--sglang-max-prefill-tokens",
    "--sglang-schedule-conservativeness",
    "--sglang-schedule-policy",
    "--speedup-ratio",
    "--zmq-kv-events-ports",
    "--zmq-replay-ports",
    "--input",
    "--speedup",
    "--update-doc",
    # SGLang settings docs/simulator.md and docs/production.md name: the tokenizer's default
    # priority (in the metrics line already) and the queue limit (not modelled)
    "--default-priority-value",
    "--max-queued-requests",
    # SGLang settings the replay does not model, named where it warns of them
    *("--" + k.replace("_", "-") for k in UNMODELLED),
    # declared by SGLang 0.5.23 and never read (docs/simulator.md says so)
    "--num-continuous-decode-steps",
}
OUTSIDE = re.compile(
    r"\.\./shared|\.\./fixtures|shared/reference|sglang-scheduler-model|sglang-kv-events"
    r"|cadence-metrics\.md|engineering-notes|upstream-benchmarks|sglang-cpu-worker"
    r"|reference/peers\.md|dynamo-mocker|\bissues? ?#?\d|issue-\d|the issue\b|issue's",
    re.IGNORECASE,
)


def _kvcadence_flags() -> set[str]:
    flags: set[str] = set()
    for _, p in cli.walk_parsers(cli.build_parser()):
        for action in p._actions:
            flags.update(action.option_strings)
    return flags


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_flag_a_document_names_exists(doc: Path) -> None:
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", doc.read_text()))
    unknown = named - _kvcadence_flags() - OTHER_FLAGS
    assert not unknown, f"{doc.name} names flags no command has: {sorted(unknown)}"


def test_nothing_points_outside_the_repository_or_at_an_issue_number() -> None:
    texts = {str(p.relative_to(REPO)): p.read_text() for p in DOCS}
    for sub in ("kvcadence", "bench", "tests"):
        for p in sorted((REPO / sub).rglob("*.py")):
            texts[str(p.relative_to(REPO))] = p.read_text()
    # this test's own patterns, and the conftest that says where the optional outside data
    # (golden vectors, a second capture) are looked for
    del texts["tests/test_docs.py"], texts["tests/conftest.py"]
    texts["bench/run"] = (REPO / "bench" / "run").read_text()
    for path, p in cli.walk_parsers(cli.build_parser()):
        texts[" ".join(path) + " --help"] = p.format_help()
    hits = [
        f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for name, text in texts.items()
        for m in OUTSIDE.finditer(text)
    ]
    assert not hits, "\n".join(hits)


def test_simulator_doc_is_consistent_about_dp_ranks() -> None:
    text = (REPO / "docs" / "simulator.md").read_text()
    not_modelled = text.split("## What is not modelled", 1)[1].split("\n## ", 1)[0]
    assert "several DP ranks *are* replayed" in not_modelled and "fleet.md" in not_modelled


def test_drive_doc_lists_every_workload_key() -> None:
    from kvcadence.capture.workloads import workload_keys

    text = (REPO / "docs" / "drive.md").read_text()
    for kind, keys in workload_keys().items():
        section = text.split(f"## `{kind}`", 1)[1].split("\n## ", 1)[0]
        for key, _default in keys:
            assert re.search(rf"^\| [^|]*`{key}`", section, re.MULTILINE), (kind, key)


def test_fleet_doc_explains_every_what_if_column() -> None:
    from kvcadence.replay.cli_fleet import what_if_row

    totals = dict.fromkeys(
        ("requests", "prompt_tokens", "cached_tokens", "recorded_cached_tokens", "events",
         "stored_events", "removed_events", "stored_blocks", "removed_blocks", "messages",
         "off_recorded_rank"),
        1,
    )  # fmt: skip
    row = what_if_row({"job": 0, "point": {}, "bundles": [], "totals": totals, "evictions": 0})
    text = (REPO / "docs" / "fleet.md").read_text()
    table = text.split("### The what-if table a sweep prints", 1)[1].split("\n## ", 1)[0]
    for column in set(row) - {"job", "point", "bundles", "messages"}:
        assert f"`{column}`" in table, column


def _tables(text: str) -> list[list[str]]:
    """The Markdown tables of ``text``: each a list of its lines (header, rule, rows)."""
    out: list[list[str]] = []
    cur: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            out.append(cur)
            cur = []
    return out


@pytest.mark.parametrize(
    "doc",
    [*DOCS, REPO / "tests" / "replay" / "data" / "corpus" / "README.md"],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_every_table_row_has_its_header_s_columns(doc: Path) -> None:
    """A row with more or fewer cells than its table's header is a row of another table
    pasted in (a corpus table regenerated by name once replaced the quiet recordings' rows
    with their score rows)."""
    bad = [
        f"{doc.name}: {row[:60]}"
        for table in _tables(doc.read_text(encoding="utf-8"))
        for row in table[2:]
        if _cells(row) != _cells(table[0])
    ]
    assert not bad, bad


def _cells(row: str) -> int:
    """Cells of a table row: its unescaped pipes less one (code spans may hold ``\\|``)."""
    return row.replace("\\|", "").count("|") - 1


#: numbers as the READMEs spell them (``_spelled``)
_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty")


def _spelled(n: int) -> str:
    """``n`` (below 70) as the READMEs spell it: "forty-four"."""
    if n < 20:
        return _ONES[n]
    return _TENS[n // 10] + (f"-{_ONES[n % 10]}" if n % 10 else "")


def test_the_readmes_count_the_corpus_as_it_is() -> None:
    """The README's and the corpus README's counts of real captures (all of them, those
    ``kvcadence drive`` drove, those of plain HTTP clients, those whose clients hang up) are
    the corpus's own: a capture added without them kept the old numbers once. (Compared
    with the prose's line breaks as spaces: a reflow changes nothing.)"""
    from tests.replay import test_corpus as corpus

    n_all, n_driven = len(corpus.CAPTURES), len(corpus.DRIVEN)
    http, cancel = _spelled(len(corpus.PRODUCTION_ONLY)), _spelled(len(corpus.CANCEL_CAPTURES))
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    assert f"A corpus of {n_all} more real captures" in readme
    assert f"{n_driven} were driven by `kvcadence drive`" in readme
    assert f"{http.capitalize()} are not the driver's traffic" in readme
    assert f"and {cancel} of clients that hang up mid-stream" in readme
    corpus_readme = REPO / "tests" / "replay" / "data" / "corpus" / "README.md"
    text = " ".join(corpus_readme.read_text(encoding="utf-8").split())
    assert f"all but {http} driven by `kvcadence drive`" in text
    assert f"(the {http} of HTTP clients included)" in text
    assert f"{cancel} of them with clients that hang up mid-stream" in text
    assert f"(the {cancel} `-cancel` captures)" in text
