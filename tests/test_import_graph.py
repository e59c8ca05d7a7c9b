"""The package's import graph has no cycle, counting imports inside functions
and the package `__init__` that importing a submodule runs first."""

from __future__ import annotations

import ast
import os
import re

import jaxfuse

ROOT = os.path.dirname(os.path.abspath(jaxfuse.__file__))


def _modules(root: str = ROOT) -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                name = "jaxfuse" if rel == "__init__" else "jaxfuse." + rel
                found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: str, modules: dict) -> set[str]:
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    out.add(sub)
                elif base in modules and not (modules[base].endswith("__init__.py") and not re.search(
                        rf"^(\w+ = |from .* import .*\b){re.escape(a.name)}\b|^{re.escape(a.name)}\b",
                        open(modules[base]).read(), re.M)):
                    out.add(base)  # a module, or a name its package defines (not a built file)
    # importing a.b.c runs a.b's (and a's) __init__ first, unless it encloses the importer
    for target in list(out):
        parts = target.split(".")
        out.update(".".join(parts[:k]) for k in range(1, len(parts))
                   if not (name + ".").startswith(".".join(parts[:k]) + "."))
    return {m for m in out if m in modules and m != name}


def cycles(root: str = ROOT) -> list[list[str]]:
    """One import cycle through each module that lies on one."""
    modules = _modules(root)
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    return [c for c in map(cycle_from, sorted(graph)) if c]


def test_no_import_cycles():
    found = cycles()
    assert not found, " ; ".join(" -> ".join(c) for c in found[:3])
    assert "jaxfuse.fusion.tuning.autotuner" in _imports(  # the graph sees function-level imports
        "jaxfuse.fusion.policy.probe", os.path.join(ROOT, "fusion", "policy", "probe.py"), _modules(ROOT))


def test_the_public_tuning_module_hands_out_the_tuners_own_objects():
    import jaxfuse.fusion.tuning.autotuner as autotuner
    import jaxfuse.tuning

    assert jaxfuse.tuning.cache is autotuner.cache and jaxfuse.tuning.DEFAULT is autotuner.DEFAULT
    assert jaxfuse.tuning.Autotuner is autotuner.Autotuner
    assert set(jaxfuse.tuning.__all__) <= set(dir(jaxfuse.tuning))
