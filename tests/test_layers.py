"""The package's layering: which folder may import which, counting imports inside functions.

``core`` imports nothing of draftsmith; ``data`` only ``core``; ``drafters`` only ``core``; ``inference``
``core``, ``data`` and ``drafters``; ``train`` any of them; ``cli`` (the command shell: the command
table, the quickstart, curves, the GPU pipeline) everything. So there is no cycle, and decoding with a
trained drafter never imports training code. Inside ``inference`` the jobs are layered too: the
``kernels`` and the ``methods`` know nothing of each other or of the loop; the loop (``runtime``,
its verification backends, the context check) uses both; ``measure`` (bench, bench-tree, tune) sits
on the loop; the CLI on top of everything.

``python tests/test_layers.py [REPO_ROOT]`` prints the import graph of a checkout (e.g. an older
one, to compare) with the imports that break the layering.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

FOLDERS = ("core", "data", "drafters", "inference", "train", "cli")
_OUTSIDE = {"core", "data", "drafters"}  # what every part of inference may import
ALLOWED = {
    "core": set(),
    "data": {"core"},
    "drafters": {"core"},
    "inference.kernels": {"core"},
    "inference.methods": _OUTSIDE,
    "inference": _OUTSIDE | {"inference.kernels", "inference.methods"},
    "inference.measure": _OUTSIDE | {"inference", "inference.kernels", "inference.methods"},
    "inference.cli": _OUTSIDE | {"inference", "inference.kernels", "inference.methods", "inference.measure"},
    "train": {
        "core",
        "data",
        "drafters",
        "inference",
        "inference.kernels",
        "inference.methods",
        "inference.measure",
        "inference.cli",
    },
}
ALLOWED["cli"] = set(ALLOWED) - {"cli"}  # the shell on top of every layer
ROOT = Path(__file__).resolve().parents[1]


def part_of(module: list[str]) -> str | None:
    """The layer of a module path inside the package (``["inference", "kernels", "native"]`` ->
    ``inference.kernels``): a top-level folder, or for ``inference`` its sub-package, its CLI or the loop."""
    if not module or module[0] not in FOLDERS:
        return None
    if module[0] != "inference" or len(module) == 1:
        return module[0]
    if module[1] in ("kernels", "methods", "measure", "cli"):
        return f"inference.{module[1]}"
    return "inference"


def imported_folders(path: Path) -> set[str]:
    """The layers (:func:`part_of`) a module imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "draftsmith" and part_of(parts[1:]) is not None:
                found.add(part_of(parts[1:]))
    return found


def import_graph(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importer layer, imported layer) -> the importing files, for imports across layers."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")) if (root / folder).is_dir() else []:
            relative = path.relative_to(root)
            importer = part_of([*relative.parts[:-1], relative.stem])
            for other in imported_folders(path) - {importer}:
                edges[importer, other].append(str(relative))
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


def test_the_checker_sees_the_jobs_inside_inference(tmp_path: Path) -> None:
    (tmp_path / "inference" / "kernels").mkdir(parents=True)
    (tmp_path / "inference" / "kernels" / "fast.py").write_text("from draftsmith.inference.runtime import generate\n")
    (tmp_path / "inference" / "runtime.py").write_text("from draftsmith.inference.kernels.fast import f\n")
    assert violations(import_graph(tmp_path)) == ["inference.kernels -> inference: inference/kernels/fast.py"]


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    graph = import_graph(root)
    for (source, target), files in sorted(graph.items()):
        print(f"{source:>17} -> {target:<17} {len(files):2} file(s)")
    broken = violations(graph)
    print(f"{len(broken)} import(s) against the layering" + (":" if broken else ""))
    for line in broken:
        print("  " + line)
