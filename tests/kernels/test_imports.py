"""Import hygiene: kernels needs only stdlib + torch; the CLI module needs not even torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kvcadence.kernels

KERNELS = Path(kvcadence.kernels.__file__).parent
MODULES = sorted(
    f"kvcadence.kernels.{p.stem}" for p in KERNELS.glob("*.py") if p.stem not in ("__main__",)
)
BLOCKED = ["msgspec", "zmq", "polars", "duckdb", "pyarrow", "numpy", "httpx", "matplotlib",
           "tqdm", "hypothesis"]  # fmt: skip

# torch itself warns once when numpy is absent; every other warning is an error
NUMPY_WARNING = "ignore:Failed to initialize NumPy:UserWarning"

BLOCKER = """
import importlib, importlib.abc, sys
BLOCKED = {blocked!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError("blocked in this test: " + name, name=name)
        return None
sys.meta_path.insert(0, Blocker())
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error", "-W", NUMPY_WARNING, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_kernels_module_imports_with_only_stdlib_and_torch() -> None:
    assert "kvcadence.kernels.bench" in MODULES and "kvcadence.kernels.paths" in MODULES
    code = BLOCKER.format(blocked=BLOCKED) + "\n".join(
        [f"import {m}" for m in MODULES]
        + [
            # exercise torch-using code too, not just the imports
            "from kvcadence.kernels.emulate import emulate, make_world",
            "from kvcadence.kernels.paths import payload_spec, verify",
            "s = payload_spec('mla', page_size=2, kv_dim=2, index_page_bytes=2, dtype='bf16')",
            "cs = make_world(s, 5, 2)",
            "emulate('packed_all_gather_scatter', cs)",
            "assert verify('packed_all_gather_scatter', cs[1]) == []",
            "bad = [m for m in sys.modules if m.split('.')[0] in BLOCKED]",
            "assert not bad, bad",
            "print('ok')",
        ]
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_cli_module_and_help_do_not_import_torch() -> None:
    code = (
        "import sys, kvcadence.kernels.cli, kvcadence.kernels.options\n"
        "from kvcadence.cli import build_parser\n"
        "build_parser(['kernels'])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print('ok')"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
