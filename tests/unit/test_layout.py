"""The package layout shows the pipeline, and imports flow one way along it.

capture -> planner -> plan -> lowering -> runtime, with the base modules (errors, options,
placement, mesh, resharding/, models, presets, version, comm/) and strategies/ below everything and the
entry points (api, parallelize, optim, tools/) on top. A module may import its own level or a
lower one; ``solver/`` and ``cost_models/`` import neither torch nor autopar. Lazy imports inside
functions count too (a lazy back edge is still a cycle); ``if TYPE_CHECKING:`` blocks do not.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

LEVELS = [
    (
        "base",
        (
            "errors",
            "options",
            "placement",
            "mesh",
            "resharding",
            "models",
            "presets",
            "version",
            "comm",
        ),
    ),
    ("strategies", ("strategies",)),
    ("capture", ("capture",)),
    ("planner", ("planner",)),
    ("plan", ("plan",)),
    ("lowering", ("lowering",)),
    ("runtime", ("runtime",)),
    (
        "top",
        ("__init__", "__main__", "api", "parallelize", "parallelize_pipeline", "optim", "tools"),
    ),
]
RANK = {part: k for k, (_, parts) in enumerate(LEVELS) for part in parts}


def _level(module: str) -> int:
    """Level of an ``autopar.X...`` module name (``autopar`` alone is the top)."""
    parts = module.split(".")
    if len(parts) == 1:
        return RANK["__init__"]
    if parts[1] not in RANK:
        raise AssertionError(f"{module} is in no level of tests/unit/test_layout.py: place it")
    return RANK[parts[1]]


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else parts
    return ".".join(parts)


def _is_module(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import in the file, TYPE_CHECKING blocks excluded."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "autopar":  # from autopar import X: X may be a submodule
                out.extend((node.lineno, f"autopar.{alias.name}") for alias in node.names)
            else:
                out.append((node.lineno, module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _back_edges(package_dir: pathlib.Path) -> list[str]:
    bad = []
    for path in sorted(package_dir.rglob("*.py")):
        here = _module_name(path)
        mine = _level(here)
        for line, module in _imports(path):
            if not module.startswith("autopar"):
                continue
            if module.count(".") == 1 and not _is_module(module):
                module = "autopar"  # from autopar import <a public name>: the top level
            theirs = _level(module)
            if theirs > mine:
                bad.append(
                    f"{path.relative_to(ROOT)}:{line} ({LEVELS[mine][0]}) imports {module} "
                    f"({LEVELS[theirs][0]})"
                )
    return bad


def test_every_autopar_module_imports_only_its_level_or_below():
    bad = _back_edges(ROOT / "autopar")
    assert not bad, "back edges in the import graph:\n" + "\n".join(bad)


def test_a_back_edge_is_caught(tmp_path):
    # The check itself can fail: a planner module that imports the runtime is a back edge.
    fake = tmp_path / "autopar" / "planner"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text(
        "def f():\n    from autopar.runtime.module import ParallelModule\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        bad = _back_edges(tmp_path / "autopar")
    finally:
        ROOT = saved
    assert bad == ["autopar/planner/bad.py:2 (planner) imports autopar.runtime.module (runtime)"]


@pytest.mark.parametrize("package", ["solver", "cost_models"])
def test_torch_free_packages_import_neither_torch_nor_autopar(package):
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, module in _imports(path)
        if module.split(".")[0] in ("torch", "autopar")
    ]
    assert not bad, "\n".join(bad)


def test_every_package_says_what_it_owns():
    for init in sorted((ROOT / "autopar").rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, (
            f"{init.relative_to(ROOT)} needs a docstring saying what it owns"
        )
