"""Shared fixtures: paths to the vendored reference data (golden vectors, a real SGLang capture),
and ``harness_starts`` (``kvcadence harness start`` with a stand-in for the worker); and
``quiet_phases``, for every test: a command run in-process says no phase line (``replay:
loading ...``) unless the test asks for them, so its stderr does not depend on how loaded
the machine is (a phase line is said once a phase has run ``progress.SAY_AFTER_S``).

Both live in ``tests/data`` (copied from the project's shared reference set; see
``tests/data/README.md``), so every test runs on a plain clone. A missing file is a broken
checkout and fails the test; nothing is skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"


def data_path(*parts: str) -> Path:
    """A vendored file or folder under ``tests/data`` (fails the test when missing)."""
    path = DATA.joinpath(*parts)
    if not path.exists():
        pytest.fail(f"vendored test data missing: {path.relative_to(REPO)}")
    return path


@pytest.fixture(autouse=True)
def quiet_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    """No phase line from an in-process command unless the test lowers ``SAY_AFTER_S``
    itself: under the parallel suite a load took over its half second and a test asserting
    one error line read the ``loading`` line first."""
    from kvcadence import progress

    monkeypatch.setattr(progress, "SAY_AFTER_S", 3600.0)


@pytest.fixture(scope="session")
def vectors_path() -> Path:
    """``tests/data/vectors/sglang_wire_vectors.json`` (golden wire and hash vectors)."""
    return data_path("vectors", "sglang_wire_vectors.json")


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    """``tests/data/fixtures/sglang-0.5.23-agent-ps1`` (a real SGLang 0.5.23 capture)."""
    return data_path("fixtures", "sglang-0.5.23-agent-ps1")


@pytest.fixture(scope="session")
def sglang_harness():
    """The real-SGLang harness, set up once per run (venv + tiny model; built on first use).

    Tests that need it are marked ``sglang_worker`` or ``sglang_adder`` (``make test-fast``
    deselects them); when they run and the harness cannot be built, they fail with the reason.
    """
    from kvcadence.errors import HarnessError
    from kvcadence.harness import worker as harness

    try:
        harness.ensure_venv(quiet=True)
        harness.ensure_model(quiet=True)
    except (HarnessError, OSError) as exc:
        pytest.fail(f"real-SGLang harness cannot be set up here: {exc}")
    return harness


@pytest.fixture(scope="session")
def mocker_recording() -> Path:
    """``tests/data/peers/mocker-dynamo-1.6.1``: Dynamo's mocker run on the fixture's workload,
    recorded live (see its README)."""
    return data_path("peers", "mocker-dynamo-1.6.1")


@pytest.fixture(scope="session")
def mocker_frames(mocker_recording) -> list[dict]:
    """The recording's frames JSONL lines (gunzipped)."""
    import gzip
    import json

    with gzip.open(mocker_recording / "frames.jsonl.gz", "rt") as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="session")
def mocker_bundles(
    tmp_path_factory, fixture_dir, mocker_recording, mocker_frames
) -> tuple[Path, Path]:
    """(real, mocker) bundles: the fixture imported, and the mocker's recording imported with
    its requests joined to the fixture's token ids by rid."""
    import json

    from kvcadence.cli import main

    tmp = tmp_path_factory.mktemp("peers")
    real = tmp / "real.kvcb"
    args = ["import", "--frames", str(fixture_dir / "events.jsonl")]
    args += ["--requests", str(fixture_dir / "requests.jsonl")]
    args += ["--server-info", str(fixture_dir / "server_info.json"), "--out", str(real)]
    assert main(args) == 0
    tokens = {}
    with open(fixture_dir / "requests.jsonl") as fh:
        for line in fh:
            r = json.loads(line)
            tokens[r["rid"]] = (r["input_ids"], r["output_ids"])
    frames = tmp / "mocker-frames.jsonl"
    frames.write_text("".join(json.dumps(f) + "\n" for f in mocker_frames))
    reqs = tmp / "mocker-requests.jsonl"
    with open(mocker_recording / "requests.jsonl") as fh, open(reqs, "w") as out:
        for line in fh:
            r = json.loads(line)
            r["input_ids"], r["output_ids"] = tokens[r["rid"]]
            assert r.pop("n_output") == len(r["output_ids"])  # the outputs came back as recorded
            out.write(json.dumps(r) + "\n")
    mocker = tmp / "mocker.kvcb"
    assert (
        main(["import", "--frames", str(frames), "--requests", str(reqs), "--out", str(mocker)])
        == 0
    )
    return real, mocker


@pytest.fixture
def harness_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list:
    """``kvcadence harness start`` without a worker: ``HOME`` in ``tmp_path`` (no recorded
    worker), ``start_server`` replaced by one that records the ``ServerConfig`` it is given
    and returns a handle; returns that list."""
    from kvcadence.harness import worker as harness

    monkeypatch.setenv("HOME", str(tmp_path))
    harness.cache_dir().mkdir(parents=True)
    seen: list = []

    def fake_start(cfg, workdir, **kw):
        seen.append(cfg)
        return harness.ServerHandle(1, 2, 20, 30, str(workdir), "m", "l", [], "{}")

    monkeypatch.setattr(harness, "start_server", fake_start)
    return seen
