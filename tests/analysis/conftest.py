"""Analysis fixtures: the real SGLang fixture as a bundle, and its truth.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.analysis.helpers import fixture_to_bundle


@pytest.fixture(scope="session")
def fixture_bundle(fixture_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fixture_to_bundle(fixture_dir, tmp_path_factory.mktemp("fx") / "bundle")


@pytest.fixture(scope="session")
def truth(fixture_dir: Path) -> dict[str, Any]:
    return json.loads((fixture_dir / "truth.json").read_text())
