"""report.html rendered in headless Chromium (Debian's ``chromium``; ``make browser`` installs
it): the page loads without a console message, the verdict is on the first screen, every plot
decodes, and the screenshot shows the page (not a blank one). Fails, never skips, when
chromium is missing."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvcadence.analysis import report
from kvcadence.format.schema import RequestRecord
from tests.analysis.helpers import T0, cleared, header, removed, stored, write_bundle

pytestmark = pytest.mark.browser

MS = 1_000_000
WIDTH, HEIGHT = 1280, 900

#: injected into a copy of the page: what the page looks like once loaded, as JSON in the DOM
PROBE = """<script>
window.addEventListener('load', () => {
  const v = document.getElementById('verdict');
  const r = v ? v.getBoundingClientRect() : null;
  const out = {
    images: [...document.images].map(i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight]),
    verdict: v ? {text: v.textContent, cls: v.className, top: r.top, bottom: r.bottom} : null,
    first_p: document.querySelector('p') === v,
    viewport: [window.innerWidth, window.innerHeight],
  };
  const pre = document.createElement('pre');
  pre.id = 'kvc-probe';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.access("/usr/bin/chromium", os.X_OK):
        found = "/usr/bin/chromium"
    if found is None:
        pytest.fail("chromium not found: run `make browser` (installs Debian's chromium)")
    return found


def _run(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        chromium(),
        "--headless",
        "--no-sandbox",  # root in CI containers
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--host-resolver-rules=MAP * ~NOTFOUND",  # nothing may come from the network
        "--hide-scrollbars",
        f"--window-size={WIDTH},{HEIGHT}",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=5000",
        *args,
        page.as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]
    assert console == [], console  # no error, warning or log line of the page
    return proc


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    d = tmp_path_factory.mktemp("browser")
    reqs = [
        RequestRecord(
            rid=r, input_ids=[1, 2, 3], output_ids=[4], cached_tokens=0, send_ns=T0 + t * MS
        )
        for r, t in (("a", 0), ("b", 1600))
    ]
    real = write_bundle(
        d / "real",
        [(0, [cleared()]), (1000, [stored([1, 2, 3])]), (2000, [removed([1]), stored([4])])],
        reqs,
    )
    sim = write_bundle(  # twice the stores: the default gates fail, the verdict is red
        d / "sim",
        [
            (0, [cleared()]),
            (1000, [stored([1, 2, 3]), stored([7])]),
            (2500, [removed([1]), stored([4]), stored([8])]),
        ],
        reqs,
        hdr=header(source="sim"),
    )
    res = report.make_report([str(real), str(sim)], d / "out")
    assert not res.passed
    return d, res.doc


@pytest.fixture(scope="module")
def probed(rendered: tuple[Path, dict[str, object]]) -> dict[str, Any]:
    """The page's state once loaded in Chromium (the probe's JSON)."""
    d, _ = rendered
    page = (d / "out" / "report.html").read_text()
    probe = d / "probe.html"
    probe.write_text(page.replace("</body>", PROBE + "</body>"))
    dom = _run(probe, d / "prof1", "--dump-dom").stdout
    got = re.search(r'<pre id="kvc-probe">(.*?)</pre>', dom)
    assert got is not None, dom[-2000:]
    state: dict[str, Any] = json.loads(html.unescape(got.group(1)))
    return state


def test_page_loads_verdict_on_first_screen_images_decode(
    rendered: tuple[Path, dict[str, object]], probed: dict[str, Any]
) -> None:
    _, doc = rendered
    plots = doc["plots"]
    assert isinstance(plots, list) and len(plots) >= 6
    assert [i[0] for i in probed["images"]] == plots
    for alt, complete, w, h in probed["images"]:
        assert complete and w > 0 and h > 0, alt  # every PNG decoded
    v = probed["verdict"]
    assert v["text"].startswith("FAILED") and v["cls"] == "fail" and probed["first_p"]
    # the layout width of the screenshot; --dump-dom's window has less height for content
    assert probed["viewport"][0] == WIDTH and probed["viewport"][1] <= HEIGHT
    assert 0 <= v["top"] < v["bottom"] <= probed["viewport"][1] / 2  # top half, first screen


def test_screenshot_shows_the_red_verdict(
    rendered: tuple[Path, dict[str, object]], probed: dict[str, Any]
) -> None:
    import numpy as np
    from matplotlib import image

    d, _ = rendered
    shot = d / "shot.png"
    _run(d / "out" / "report.html", d / "prof2", f"--screenshot={shot}")
    px = (np.asarray(image.imread(shot))[..., :3] * 255).round().astype(np.int32)
    assert px.shape == (HEIGHT, WIDTH, 3)
    white = int((px.min(axis=2) > 245).sum())
    assert white < 0.97 * HEIGHT * WIDTH  # text, tables, plots: not a blank page
    assert len(np.unique(px.reshape(-1, 3), axis=0)) > 50
    v = probed["verdict"]
    band = px[int(v["top"]) : int(v["bottom"]) + 1]
    red = int(((band[..., 0] > 140) & (band[..., 1] < 90) & (band[..., 2] < 90)).sum())
    assert red > 500  # the FAILED verdict (#b00) is drawn where the page put it
