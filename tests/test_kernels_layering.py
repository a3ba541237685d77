"""`kernels` is a leaf package: it imports nothing from runtime, models, attention or cache
(everyone may import it), and its C++ sources all live in kernels/cpu."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_kernels_import_no_other_package_of_the_project():
    for path in (REPO / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in ("runtime", "models", "attention", "cache"), f"{path}: {name}"


def test_all_cpp_sources_live_in_kernels():
    skip = {".venv", "build", ".git"}
    stray = [p for p in REPO.rglob("*.cpp") if not skip & set(p.parts) and p.parent != REPO / "kernels" / "cpu"]
    assert not stray
