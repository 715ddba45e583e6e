"""The package's layering: which top-level folder may import which, counting imports inside functions.

``core`` imports nothing of draftsmith; ``data`` only ``core``; ``drafters`` only ``core``; ``inference``
``core``, ``data`` and ``drafters``; ``train`` any of them. So there is no cycle, and decoding with a
trained drafter never imports training code.

``python tests/test_layers.py [REPO_ROOT]`` prints the folder-level import graph of a checkout (e.g.
an older one, to compare) with the imports that break the layering.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

FOLDERS = ("core", "data", "drafters", "inference", "train")
ALLOWED = {
    "core": set(),
    "data": {"core"},
    "drafters": {"core"},
    "inference": {"core", "data", "drafters"},
    "train": {"core", "data", "drafters", "inference"},
}
ROOT = Path(__file__).resolve().parents[1]


def imported_folders(path: Path) -> set[str]:
    """The draftsmith folders a module imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "draftsmith" and len(parts) > 1 and parts[1] in FOLDERS:
                found.add(parts[1])
    return found


def import_graph(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importer folder, imported folder) -> the importing files, for imports across folders."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")) if (root / folder).is_dir() else []:
            for other in imported_folders(path) - {folder}:
                edges[folder, other].append(str(path.relative_to(root)))
    return dict(edges)


def violations(graph: dict[tuple[str, str], list[str]]) -> list[str]:
    return [
        f"{source} -> {target}: {', '.join(files)}"
        for (source, target), files in sorted(graph.items())
        if target not in ALLOWED[source]
    ]


def test_every_import_follows_the_layering() -> None:
    assert violations(import_graph()) == []


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "late.py").write_text("def f():\n    from draftsmith.train.recipe_loader import RecipeError\n")
    assert violations(import_graph(tmp_path)) == ["data -> train: data/late.py"]


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    graph = import_graph(root)
    for (source, target), files in sorted(graph.items()):
        print(f"{source:>9} -> {target:<9} {len(files):2} file(s)")
    broken = violations(graph)
    print(f"{len(broken)} import(s) against the layering" + (":" if broken else ""))
    for line in broken:
        print("  " + line)
