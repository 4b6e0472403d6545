"""The package's layering, as the README states it, checked on every import: at module level, inside functions,
relative ones, and the ``"metainfer_gen.x.y"`` strings that lazy-export tables and registries import later.

    apps -> serve -> pipelines -> video, llm -> kernels, collectives -> platform

The shared core (platform, kernels, collectives) imports no front end; video and llm never import each other;
nothing below imports what is above it; and no two modules of the package import each other, directly or through
others (a cycle hidden in a function-level import is still a cycle).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = "metainfer_gen"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
CORE = {"platform", "kernels", "collectives"}
FRONT_ENDS = {"video", "llm"}
ABOVE = ["pipelines", "serve", "apps"]  # in order: each may import the ones before it, never those after
MODULE_STRING = re.compile(rf"^{PACKAGE}(\.\w+)+(:\w+)?$")
STRING = "<string>"  # the name part of a module named by a string without ":function"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path) -> set[tuple[str, str]]:
    """``(module, name)`` for every import of the package in ``path``, anywhere in the file: ``import a.b`` is
    ``("a.b", "")``, ``from a import b`` is ``("a", "b")``, a string ``"a.b:c"`` is ``("a.b", "c")``."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update((alias.name, "") for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.update((source, alias.name) for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.match(node.value):
            module, _, attr = node.value.partition(":")
            found.add((module, attr or STRING))
    return {(m, n) for m, n in found if m == root.name or m.startswith(root.name + ".")}


def lazy_exports(path: Path) -> dict[str, str]:
    """A package's ``_EXPORTS = {name: module}`` table (see ``metainfer_gen._lazy``), or {}."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> modules of the package it imports. ``from pkg import name`` resolves to the submodule ``name``,
    or to the module ``pkg`` lazily exports ``name`` from, else to ``pkg`` itself; an unknown dotted name maps to
    its closest module. A package's own lazy-export strings are its edges to its submodules."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    exports = {name: lazy_exports(p) for name, p in modules.items() if p.name == "__init__.py"}

    def resolve(module: str, attr: str) -> str | None:
        if attr == STRING:  # "metainfer_gen.x.y" counts when it names a module ("metainfer_gen.json" is a file)
            return module if module in modules else None
        if attr and f"{module}.{attr}" in modules:
            return f"{module}.{attr}"
        if attr in exports.get(module, {}):
            return exports[module][attr]
        while module not in modules and "." in module:
            module = module.rpartition(".")[0]
        return module if module in modules else None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {resolve(module, attr) for module, attr in imports_of(path, root)}
        # A package is loaded before any of its modules: a plain attribute read from it (``__version__``) adds no
        # dependency; what it exports lazily resolved above to the defining module.
        graph[name] = {t for t in targets if t is not None and t != name and not name.startswith(t + ".")}
    return graph


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for source, targets in sorted(graph.items()):
        a = layer(source)
        for target in sorted(targets):
            b = layer(target)
            if a == b or b in ("", "_lazy", "assets") or a == "":
                continue
            why = None
            if a in CORE and (b in FRONT_ENDS or b in ABOVE):
                why = "the shared core imports no front end and nothing above it"
            elif a == "platform" and b in CORE:
                why = "platform is the bottom layer"
            elif a in FRONT_ENDS and b in FRONT_ENDS:
                why = "video and llm never import each other"
            elif a in FRONT_ENDS and b in ABOVE:
                why = f"{a} is below {b}"
            elif a in ABOVE and b in ABOVE and ABOVE.index(b) > ABOVE.index(a):
                why = f"{a} is below {b}"
            if why:
                bad.append(f"{source} imports {target}: {why}")
    return bad


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # the graph has a few hundred nodes: recursion depth stays small
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_every_import_follows_the_layering():
    assert layering_violations(import_graph(ROOT)) == []


def test_no_import_cycles_in_the_package():
    assert import_cycles(import_graph(ROOT)) == []


def test_the_demo_models_and_their_training_are_outside_the_package():
    assert not list(ROOT.rglob("demo_model*")) and not (ROOT / "training.py").exists()
    assert not any(p.name.startswith("fuse_wan") for p in (ROOT / "kernels").iterdir())


def test_the_checks_see_function_level_relative_and_string_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    for sub in ("kernels", "video", "llm", "pipelines"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "ops.py").write_text("def f():\n    from metainfer_gen.video import lora\n")
    (pkg / "video" / "lora.py").write_text("from ..llm import engine\n")
    (pkg / "llm" / "engine.py").write_text("TABLE = {'x': 'metainfer_gen.pipelines.text:Pipe'}\n")
    (pkg / "pipelines" / "text.py").write_text("from metainfer_gen.kernels.ops import f\n")
    graph = import_graph(pkg)
    assert layering_violations(graph) == [
        "metainfer_gen.kernels.ops imports metainfer_gen.video.lora: the shared core imports no front end and "
        "nothing above it",
        "metainfer_gen.llm.engine imports metainfer_gen.pipelines.text: llm is below pipelines",
        "metainfer_gen.video.lora imports metainfer_gen.llm.engine: video and llm never import each other",
    ]
    assert import_cycles(graph) == [["metainfer_gen.kernels.ops", "metainfer_gen.llm.engine",
                                     "metainfer_gen.pipelines.text", "metainfer_gen.video.lora"]]
