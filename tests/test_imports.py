"""Import hygiene of the library (pallas_attn/, models/, decoding/), read from the source:
imports point down (no cycle among module-level imports, and no function-level import that would
close one: a cycle dodged, not removed), and no module imports or reads another module's
``_private`` name."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_attn", "models", "decoding")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _targets(node: ast.ImportFrom | ast.Import, here: str) -> list[str]:
    """The project modules an import statement loads (``from pkg import sub``: pkg.sub only when
    sub is a module, else pkg)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        pkg = here.split(".")
        if not MODULES[here].name == "__init__.py":
            pkg = pkg[:-1]
        pkg = pkg[: len(pkg) - node.level + 1]
        base = ".".join([*pkg, base] if base else pkg)
    if base not in MODULES:
        return []
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    return subs if len(subs) == len(node.names) else [base, *subs]


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(name: str):
    """(module-level targets, [(line, target) of imports inside functions]) of module ``name``."""
    tree = ast.parse(MODULES[name].read_text())
    top: set[str] = set()
    inner: list[tuple[int, str]] = []

    def walk(nodes, in_function: bool):
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                continue  # annotations only: never executed
            if isinstance(node, ast.Import | ast.ImportFrom):
                for t in _targets(node, name):
                    if in_function:
                        inner.append((node.lineno, t))
                    else:
                        top.add(t)
            fn = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            walk(ast.iter_child_nodes(node), in_function or fn)

    walk(tree.body, False)
    return top, inner


GRAPH = {name: _imports(name) for name in MODULES}


def _reaches(start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m == goal:
            return True
        if m not in seen:
            seen.add(m)
            todo.extend(GRAPH[m][0])
    return False


def test_the_scan_sees_the_library():
    assert {"models.transformer", "models.linear", "decoding.speculative"} <= set(MODULES)
    assert "models.linear" in GRAPH["models.quant"][0]  # a module-level edge is read


def test_no_function_level_import_dodges_a_cycle():
    dodges = [
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}, which imports {m} back"
        for m, (_, inner) in GRAPH.items()
        for line, t in inner
        if t != m and _reaches(t, m)
    ]
    assert not dodges, "\n".join(dodges)


def test_no_private_name_is_imported_across_modules():
    bad = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private and not node.module.startswith("__"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {private}")
    assert not bad, "\n".join(bad)


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> modules it imports) as a path, or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return [*path[path.index(t) :], t]
            if t not in state and (found := visit(t)):
                return found
        path.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_module_level_imports_have_no_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []
    cycle = _cycle({m: top for m, (top, _) in GRAPH.items()})
    assert not cycle, " -> ".join(cycle)


def _private_attributes(source: str, here: str) -> list[str]:
    """``line: mod._name`` for each use in ``source`` (module ``here``) of a ``_private``
    attribute of a project module bound by an import (``from decoding import engine_steps``;
    ``import models.rows_matmul as rm``)."""
    tree, bound = ast.parse(source), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname: a.name for a in node.names if a.asname and a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                target = f"{node.module}.{a.name}"
                if target in MODULES and target != here:
                    bound[a.asname or a.name] = target
    return [
        f"{node.lineno}: {node.value.id}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in bound
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]


def test_no_private_attribute_of_another_module_is_used():
    probe = "from decoding import engine_steps\nimport models.rows_matmul as rm\n"
    probe += "engine_steps._x, rm._y, engine_steps.TRACES, rm.__name__\n"
    assert _private_attributes(probe, "decoding.engine") == ["3: engine_steps._x", "3: rm._y"]
    bad = [
        f"{path.relative_to(ROOT)}:{use}"
        for name, path in MODULES.items()
        for use in _private_attributes(path.read_text(), name)
    ]
    assert not bad, "\n".join(bad)


def test_only_decoding_packing_packs_weights_for_the_decode_paths():
    """The CPU packing (``models.transformer.pack_decode_weights`` / ``attach_decode_weights``)
    is reached through one module, ``decoding.packing``; the decode paths (generate,
    speculative, the drafts, the engine's runner) call that."""
    names = {"pack_decode_weights", "attach_decode_weights"}
    users = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            imported = isinstance(node, ast.ImportFrom) and {a.name for a in node.names} & names
            read = isinstance(node, ast.Attribute) and node.attr in names
            if imported or read:
                users.add(name)
    assert users == {"decoding.packing"}
