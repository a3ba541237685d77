"""Imports go one way (DESIGN.md): runtime -> models, attention, cache; models -> attention,
cache; attention -> cache; cache -> nothing of ours; everyone may import `zooinfer_kernels`, a leaf
package whose C++ sources all live in zooinfer_kernels/cpu."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


OURS = ("runtime", "models", "attention", "cache", "zooinfer_kernels")
ALLOWED = {"runtime": set(OURS), "models": {"models", "attention", "cache", "zooinfer_kernels"},
           "attention": {"attention", "cache", "zooinfer_kernels"}, "cache": {"cache", "zooinfer_kernels"},
           "zooinfer_kernels": {"zooinfer_kernels"}}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


def test_imports_point_one_way():
    bad = [f"{path.relative_to(REPO)} imports {name}"
           for package, allowed in ALLOWED.items() for path in (REPO / package).rglob("*.py")
           for name in _imports(path) if name.split(".")[0] in OURS and name.split(".")[0] not in allowed]
    assert not bad


def test_all_cpp_sources_live_in_kernels():
    skip = {".venv", "build", ".git"}
    stray = [p for p in REPO.rglob("*.cpp") if not skip & set(p.parts) and p.parent != REPO / "zooinfer_kernels" / "cpu"]
    assert not stray
