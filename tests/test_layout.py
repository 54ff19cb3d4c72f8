"""analysis/'s rooms keep their order (docs/development.md): a module imports only from its own room or the rooms
above it, and no modules import each other in a circle; transformers and open_clip are imported in their adapter
only."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

ORDER = ["families", "engine", "estimators", "measures", "results", "sources", "reports", "frontends", "studies"]


def _modules() -> dict[str, set[str]]:
    """{module: the analysis modules it imports (at any depth of the file)}."""
    out = {}
    for f in (ROOT / "analysis").rglob("*.py"):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("analysis"):
                for a in node.names:  # `from pkg import module` imports the module
                    sub = f"{node.module}.{a.name}"
                    is_mod = (ROOT / Path(*sub.split("."))).with_suffix(".py").is_file()
                    deps.add(sub if is_mod or (ROOT / Path(*sub.split("."))).is_dir() else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("analysis")}
        out[name] = deps
    return out


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ORDER else None


def test_no_import_runs_back_up():
    up = [
        (m, d)
        for m, deps in _modules().items()
        for d in deps
        if _room(m) and _room(d) and ORDER.index(_room(d)) > ORDER.index(_room(m))
    ]
    assert not up, up


def test_no_circle_of_top_level_imports():
    """Imports at the top of a module (not those deferred into functions) form no cycle."""
    graph = {}
    for f in (ROOT / "analysis").rglob("*.py"):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("analysis"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    ok = (ROOT / Path(*sub.split("."))).with_suffix(".py").is_file()
                    deps.add(sub if ok or (ROOT / Path(*sub.split("."))).is_dir() else node.module)
        graph[name] = deps
    seen, stack = {}, []

    def visit(v):
        seen[v] = "open"
        stack.append(v)
        for w in graph.get(v, ()):
            if seen.get(w) == "open":
                raise AssertionError(" -> ".join([*stack[stack.index(w) :], w]))
            if w not in seen:
                visit(w)
        seen[v] = "done"
        stack.pop()

    for v in sorted(graph):
        if v not in seen:
            visit(v)


def test_other_libraries_are_imported_in_their_adapter_only():
    for lib, home in (("transformers", "huggingface.py"), ("open_clip", "openclip.py")):
        users = []
        for f in [*(ROOT / "analysis").rglob("*.py"), *(ROOT / "train").rglob("*.py")]:
            for node in ast.walk(ast.parse(f.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                if any(n == lib or n.startswith(lib + ".") for n in names):
                    users.append(f.relative_to(ROOT).as_posix())
        assert sorted(set(users)) == [f"analysis/families/{home}"], (lib, users)


# Public modules at analysis/'s top, outside the rooms: each re-exports one room's names (its public place, whatever
# the layout of the rooms becomes) and no room imports it.
PUBLIC = {"analysis.similarity": "estimators"}


def test_public_modules_re_export_their_room_only():
    modules = _modules()
    for public, room in PUBLIC.items():
        assert public in modules, public
        assert modules[public] and all(_room(d) == room for d in modules[public]), (public, modules[public])
        users = [m for m, deps in modules.items() if public in deps and _room(m)]
        assert not users, (public, users)
