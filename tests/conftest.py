"""Shared fixtures: paths to the vendored reference data (golden vectors, a real SGLang capture).

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
