"""The package layout's import rule, checked on the source (AST, no imports executed).

* ``format/`` is the contract every stage shares: it imports nothing of kvcadence but
  ``errors``; capture, replay, admit and analysis may import it.
* ``kernels/`` imports only the standard library, torch and ``kvcadence.errors`` (stdlib only).
* the stages do not import each other except where listed in ``ALLOWED``.
* no import circles between kvcadence modules, counting function-level imports too.
* function-level imports of kvcadence's own modules only in command modules (``cli*.py``,
  ``demo.py``, ``__main__.py``), where they keep ``kvcadence --help`` fast.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "kvcadence"

# package -> the kvcadence packages it may import (besides itself, ``errors`` and the version).
ALLOWED: dict[str, set[str]] = {
    "format": set(),
    "capture": {"format", "harness"},
    "replay": {"format"},
    "admit": {"format", "replay", "harness"},
    "analysis": {"format"},
    "kernels": set(),
    "harness": set(),
    "testing": {"format"},
}
COMMAND_FILES = ("cli", "demo", "__main__")
# stdlib-only modules at the package root that every stage may use
SHARED_ROOT = ("argtypes", "errors", "gcpause", "outguard", "progress", "suggest")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        if "sglang_cpu" in path.parts or path.name == "sglang_adder_driver.py":
            continue  # runs inside SGLang's venv, never imports kvcadence
        parts = ("kvcadence", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside module-level ``if TYPE_CHECKING:`` blocks."""
    out: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return out


def _imports(path: Path, runtime_only: bool = False) -> list[tuple[str, bool]]:
    """(imported kvcadence module, at module level?) for every import in ``path``;
    ``runtime_only``: without the type-only ones (``if TYPE_CHECKING:``), which can form no
    import circle at run time."""
    tree = ast.parse(path.read_text())
    top_level = {id(n) for n in tree.body}
    for node in tree.body:  # ``if TYPE_CHECKING:`` blocks count as module level
        if isinstance(node, ast.If):
            top_level.update(id(n) for n in node.body)
    skip = _type_only(tree) if runtime_only else set()
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvcadence"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.append(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("kvcadence")]
        out.extend((n, id(node) in top_level) for n in names)
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_stages_import_only_what_the_layout_allows() -> None:
    bad = []
    for mod, path in MODULES.items():
        pkg = _package(mod)
        if pkg not in ALLOWED:
            continue
        for target, _ in _imports(path):
            tpkg = _package(target)
            if tpkg in ("", pkg, *SHARED_ROOT) or (tpkg == "cli" and path.name == "__main__.py"):
                continue
            if tpkg not in ALLOWED[pkg]:
                bad.append(f"{mod} imports {target}")
    assert not bad, "\n".join(bad)


def test_format_layer_imports_no_stage() -> None:
    for mod, path in MODULES.items():
        if _package(mod) == "format":
            stages = {_package(t) for t, _ in _imports(path)} - {"format", "", *SHARED_ROOT}
            assert not stages, f"{mod} imports {stages}"


def test_no_import_circles() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in MODULES.items():
        graph[mod] |= {t for t, _ in _imports(path, True) if t in MODULES and t != mod}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert not circles, circles


# Every package is held to the rule.
LAZY_FREE = tuple(ALLOWED)


@pytest.mark.parametrize("pkg", LAZY_FREE)
def test_function_level_imports_only_in_command_modules(pkg: str) -> None:
    bad = [
        f"{mod} imports {target} inside a function"
        for mod, path in MODULES.items()
        if _package(mod) == pkg and not path.stem.startswith(COMMAND_FILES)
        for target, top in _imports(path)
        if not top
    ]
    assert not bad, "\n".join(bad)


def test_the_rule_sees_a_circle() -> None:
    """The checker is not vacuous: the parser finds real imports in a known module."""
    found = {t for t, _ in _imports(MODULES["kvcadence.replay.fleet"])}
    assert "kvcadence.replay.scheduler" in found and "kvcadence.format.schema" in found


def test_a_module_over_500_lines_says_why_in_its_docstring() -> None:
    """Small modules with one concern; a longer one is one coherent piece and says so
    (a paragraph starting "Why" in its module docstring)."""
    bad = []
    for mod, path in MODULES.items():
        text = path.read_text()
        if len(text.splitlines()) > 500:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "\nWhy " not in "\n" + doc:
                bad.append(f"{mod}: {len(text.splitlines())} lines, no reason given")
    assert not bad, "\n".join(bad)
