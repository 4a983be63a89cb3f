"""The data pipeline flows one way: sources -> work units -> tokenizing workers -> stored shards ->
mixture and loader. Each module of `ds_optimus/data/` imports only modules before it in `ORDER` (read
from the source with `ast`, imports inside functions included): no circle, and no earlier stage
that reaches into a later one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "ds_optimus" / "data"

# The stages in the order data flows through them, and each stage's modules in the order they may
# import each other: a module imports only modules listed before it.
STAGES = [
    ("the package's error", ["errors"]),
    ("source specs", ["sources", "token_files"]),
    ("work units", ["compressed", "documents", "tokenizer", "units"]),
    ("tokenizing workers", ["tokenize_workers"]),
    ("stored shards", ["shards"]),
    ("mixture and loader", ["mixture", "loader"]),
    ("the preparation (plan, tokenize, open) and its command", ["prepare"]),
]
ORDER = [module for _, modules in STAGES for module in modules]
STAGE = {module: stage for stage, modules in STAGES for module in modules}
# what the data package may import of the rest of ds_optimus: leaves that import nothing of it
OUTSIDE = {"_lazy", "schema", "command_line", "progress", "launch"}  # launch: its environment module


def package_imports(folder: Path, package: str = "ds_optimus.data") -> dict[str, set[str]]:
    """{module: the modules of the same package it imports}, anywhere in its file (a function's
    body too), relative (`from .x import y`, `from . import x`) or absolute (`ds_optimus.data.x`).
    Imports of the parent package are given as "..name"."""
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    parent = package.rsplit(".", 1)[0]
    found: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        if path.stem == "__init__":
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    targets = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                    names.update(t for t in targets if t in modules)
                elif node.level == 2:
                    top = node.module.split(".")[0] if node.module else None
                    if top == package.rsplit(".", 1)[1]:  # `from ..data.x import y`
                        rest = node.module.split(".")[1:]
                        names.update([rest[0]] if rest else [a.name for a in node.names])
                    else:
                        names.add(f"..{top or node.names[0].name}")
                elif node.module and node.module.startswith(package + "."):
                    names.add(node.module[len(package) + 1 :].split(".")[0])
                elif node.module and node.module.startswith(parent + "."):
                    names.add(f"..{node.module[len(parent) + 1 :].split('.')[0]}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(package + "."):
                        names.add(alias.name[len(package) + 1 :].split(".")[0])
                    elif alias.name.startswith(parent + "."):
                        names.add(f"..{alias.name[len(parent) + 1 :].split('.')[0]}")
        names.discard(path.stem)
        found[path.stem] = names
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle of imports found by a depth-first walk, as the modules along it (first = last)."""
    found, state = [], {}  # state: 1 on the walk's path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state and nxt in graph:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def problems(graph: dict[str, set[str]], order: list[str], stage: dict[str, str]) -> list[str]:
    """One line for each circle, each module not placed in `order`, and each import of a module that
    does not come before the importer in `order`."""
    lines = [f"import circle: {' -> '.join(circle)}" for circle in circles(graph)]
    lines += [f"{module}.py is in no stage of the order: place it" for module in sorted(set(graph) - set(order))]
    rank = {module: i for i, module in enumerate(order)}
    for module in sorted(graph, key=lambda m: rank.get(m, len(order))):
        for target in sorted(t for t in graph[module] if not t.startswith("..")):
            if module in rank and target in rank and rank[target] >= rank[module]:
                where = "a later stage" if stage[target] != stage[module] else "a module after it in its stage"
                lines.append(f"{module}.py ({stage[module]}) imports {target}.py ({stage[target]}): {where}")
    return lines


def test_the_data_modules_import_only_modules_before_them():
    graph = package_imports(DATA)
    assert set(graph) == set(ORDER), f"modules not in ORDER: {set(graph) ^ set(ORDER)}"
    assert problems(graph, ORDER, STAGE) == []
    outside = {t[2:] for targets in graph.values() for t in targets if t.startswith("..")}
    assert outside <= OUTSIDE, f"the data package imports {sorted(outside - OUTSIDE)} of ds_optimus"
    # the chain is real: each stage uses the one before it
    assert {"sources"} <= graph["token_files"] and {"sources", "documents", "tokenizer"} <= graph["units"]
    assert "units" in graph["tokenize_workers"] and "tokenize_workers" in graph["shards"]
    assert {"shards", "mixture"} <= graph["loader"]


def test_the_public_names_come_from_the_modules_the_export_table_names():
    import importlib

    import ds_optimus.data as data

    for name, module in data._EXPORTS.items():
        assert module.lstrip(".") in ORDER, (name, module)
        assert hasattr(importlib.import_module(f"ds_optimus.data{module}"), name), (name, module)
        assert getattr(data, name) is getattr(importlib.import_module(f"ds_optimus.data{module}"), name)


def _package(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir()
    for name, text in {"__init__": "", **files}.items():
        (folder / f"{name}.py").write_text(text)
    return folder


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # a circle made by an import inside a function (as corpus <-> tokens and pack <-> workers were)
        (
            {"a": "from .b import x\n", "b": "def f():\n    from .a import y\n"},
            ["import circle: a -> b -> a", "a.py (early) imports b.py (early): a module after it in its stage"],
        ),
        # an earlier stage that reaches into a later one, by every spelling of an import
        (
            {"a": "def f():\n    import ds_optimus.data.c\n", "b": "from . import c\n", "c": ""},
            ["a.py (early) imports c.py (late): a later stage", "b.py (early) imports c.py (late): a later stage"],
        ),
        (
            {"a": "", "b": "from ..data.c import z\n", "c": "from .a import x\n"},
            ["b.py (early) imports c.py (late): a later stage"],
        ),
        (
            {"a": "", "b": "from .a import x\n", "c": "from .b import y\nfrom .a import z\n", "d": ""},
            ["d.py is in no stage of the order: place it"],
        ),
    ],
)
def test_the_check_finds_circles_and_imports_of_later_stages(tmp_path, files, expected):
    folder = _package(tmp_path / "data", files)
    order, stage = ["a", "b", "c"], {"a": "early", "b": "early", "c": "late"}
    assert problems(package_imports(folder), order, stage) == expected
