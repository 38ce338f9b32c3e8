"""Shared fixtures: paths to the shared reference data (vectors, the real SGLang fixture)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def _shared(*parts: str) -> Path:
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared data not found: {path.relative_to(SHARED.parent)}")
    return path


@pytest.fixture(scope="session")
def vectors_path() -> Path:
    """``../shared/vectors/sglang_wire_vectors.json`` (golden wire and hash vectors)."""
    return _shared("vectors", "sglang_wire_vectors.json")


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    """``../shared/fixtures/sglang-0.5.23-agent-ps1`` (a real SGLang 0.5.23 capture)."""
    return _shared("fixtures", "sglang-0.5.23-agent-ps1")
