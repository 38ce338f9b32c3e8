"""``inspect`` on a bundle without a header says so and exits 1; docs/format.md lists every
annotation kind the code writes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvcadence.capture.discovery import make_header
from kvcadence.cli import main
from kvcadence.format.bundle import (
    BundleWriter,
    list_segments,
)
from kvcadence.format.schema import (
    RequestRecord,
)
from kvcadence.testing.publisher import payload_pool
from tests.capture.helpers import one_error_line

REPO = Path(__file__).resolve().parents[2]
POOL = payload_pool(8)
BIG = 1 << 40


# ------------------------------------------------------------------ 8. header-less bundles


def test_inspect_without_header_says_so_and_exits_1(tmp_path, capsys):
    b = tmp_path / "b"
    b.mkdir()
    # a segment with the magic but whose first frame is not a header
    w = BundleWriter(tmp_path / "donor", make_header([], server_info=None, command=[]))
    w.write(RequestRecord(rid="r", input_ids=[1]))
    w.close()
    donor = list_segments(tmp_path / "donor")[0].read_bytes()
    # drop the header frame: segment header (8) + first frame
    n = int.from_bytes(donor[8:12], "little")
    (b / "seg-000000.kvcb").write_bytes(donor[:8] + donor[16 + n :])
    assert main(["inspect", str(b)]) == 1
    cap = capsys.readouterr()
    assert "None.0" not in cap.out and "no header (damaged or not a kvcadence bundle)" in cap.out
    assert one_error_line(cap.err).endswith("no header (damaged or not a kvcadence bundle)")
    assert main(["inspect", "--json", str(b)]) == 1
    assert json.loads(capsys.readouterr().out)["header_ok"] is False
    (b / "seg-000000.kvcb").write_bytes(b"")  # torn at birth
    assert main(["inspect", str(b)]) == 1
    capsys.readouterr()
    not_bundle = tmp_path / "nb"
    not_bundle.mkdir()
    (not_bundle / "seg-000000.kvcb").write_bytes(b"garbage!" * 4)
    assert main(["inspect", str(not_bundle)]) == 2
    one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------ 9. docs


def test_format_doc_lists_every_annotation_kind():
    kinds: set[str] = set()
    for py in (REPO / "kvcadence").rglob("*.py"):
        text = py.read_text()
        for m in re.finditer(r"Annotation\(\s*kind=\"([a-z_]+)\"", text):
            kinds.add(m.group(1))
        for m in re.finditer(r"\n\s+kind=\"([a-z_]+)\",\n", text):
            if "Annotation(" in text:
                kinds.add(m.group(1))
    from kvcadence.replay.visibility import VISIBILITY_KIND

    kinds.add(VISIBILITY_KIND)
    assert {
        "append",
        "malformed_message",
        "undecodable_payload",
        "workload",
        "flush_cache",
    } <= kinds
    doc = (REPO / "docs" / "format.md").read_text()
    section = doc[doc.index("### `Annotation`") : doc.index("### `Trailer`")]
    for kind in sorted(kinds):
        assert f"| `{kind}` |" in section, kind
