"""The package's import graph: no cycle, and the layers of the house plan.

Imports inside functions count, and so does the package `__init__` that
importing a submodule runs first. Layers, bottom up (a module imports only
from its own layer and those listed below it as allowed):

  base      jaxfuse._compat, _reasons, _version, _build_info, _cache
  ops       jaxfuse.ops: primitives, lowering, kernels (never the pass)
  ir        jaxfuse.fusion.ir: the program as the pass reads it
  safety    jaxfuse.fusion.safety
  match     jaxfuse.fusion.match
  patterns  jaxfuse.fusion.patterns
  tuning    jaxfuse.fusion.tuning
  report    jaxfuse.fusion.report (reads the ir; never the policy)
  policy    jaxfuse.fusion.policy (never the report)
  api       jaxfuse.fusion.api and the fusion package
  rules     jaxfuse.rules (shipped rules: through the rule engine)
  top       jaxfuse, jaxfuse.tuning, jaxfuse.cli
"""

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


def _imports(name: str, path: str, modules: dict, parents: bool = True) -> set[str]:
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
    for target in list(out) if parents else ():
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


LAYERS = {  # layer -> (module prefixes, layers it may import)
    "base": (("jaxfuse._compat", "jaxfuse._reasons", "jaxfuse._version", "jaxfuse._build_info",
              "jaxfuse._cache"),
             ()),
    "ops": (("jaxfuse.ops",), ("base",)),
    "ir": (("jaxfuse.fusion.ir",), ("base",)),
    "safety": (("jaxfuse.fusion.safety",), ("base", "ops", "ir")),
    "match": (("jaxfuse.fusion.match",), ("base", "ir")),
    "patterns": (("jaxfuse.fusion.patterns",), ("base", "ops", "ir", "safety", "match")),
    "tuning": (("jaxfuse.fusion.tuning",), ("base", "ops", "ir")),
    "report": (("jaxfuse.fusion.report",), ("base", "ops", "ir", "tuning")),
    "policy": (("jaxfuse.fusion.policy",), ("base", "ops", "ir", "match", "tuning")),
    "api": (("jaxfuse.fusion.api", "jaxfuse.fusion"),
            ("base", "ops", "ir", "safety", "match", "patterns", "tuning", "report", "policy")),
    "rules": (("jaxfuse.rules",), ("base", "ir", "match")),
    "top": (("jaxfuse.tuning", "jaxfuse.cli", "jaxfuse"),
            ("base", "ops", "ir", "safety", "match", "patterns", "tuning", "report", "policy", "api",
             "rules")),
}


def layer_of(module: str) -> str:
    """The layer of a module: the one whose prefix is longest."""
    best = max(((p, layer) for layer, (prefixes, _) in LAYERS.items() for p in prefixes
                if module == p or module.startswith(p + ".")), key=lambda t: len(t[0]))
    return best[1]


def violations(modules: dict) -> list[str]:
    """Every import of `modules` (name -> path) that leaves its layer."""
    wrong = []
    for name, path in sorted(modules.items()):
        mine = layer_of(name)
        allowed = {mine, *LAYERS[mine][1]}
        # What a module names itself; the packages Python initializes on the way
        # (jaxfuse.fusion for any of its submodules) are not its choice.
        for target in _imports(name, path, modules, parents=False):
            if layer_of(target) not in allowed and not name.startswith(target + "."):
                wrong.append(f"{name} ({mine}) imports {target} ({layer_of(target)})")
    return wrong


def test_every_module_keeps_to_its_layer():
    wrong = violations(_modules(ROOT))
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_sees_a_wrong_import(tmp_path):
    # An op module that reaches up into the pass, a report that reads the
    # policy, and a function-level import: each is named.
    modules = _modules(ROOT)
    fakes = {"jaxfuse.ops.fake": "from ..fusion.policy import cost\n",
             "jaxfuse.fusion.report.fake": "def f():\n    from ..policy.plan import Plan\n"}
    for name, text in fakes.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        modules[name] = str(path)
    wrong = violations(modules)
    assert "jaxfuse.ops.fake (ops) imports jaxfuse.fusion.policy.cost (policy)" in wrong
    assert "jaxfuse.fusion.report.fake (report) imports jaxfuse.fusion.policy.plan (policy)" in wrong
    assert len(wrong) == 2, wrong


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
