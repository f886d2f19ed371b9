"""cfdist's import graph has no cycles and points downward through the layers of ARCHITECTURE.md.

The graph is built statically with ``ast`` from every module under ``cfdist/`` (nothing is
imported): every ``import`` and ``from ... import`` statement counts, module-level or inside a
function, and so does ``importlib.import_module("cfdist....")`` / ``__import__`` with a literal
name. ``from cfdist.x import y`` is an edge to the module ``cfdist.x.y`` when ``y`` is a module,
else to ``cfdist.x``. The implicit import of a parent package (importing ``cfdist.a.b`` runs
``cfdist/a/__init__.py`` first) is not an edge: every module would then depend on its own package
and the package on its members, and each ``__init__`` that re-exports would close a cycle.

``if TYPE_CHECKING:`` imports (there are none today) count against the layer map, since a module
that names a higher layer's type knows about that layer, but not towards cycles: they never run,
and they are Python's way for two modules to name each other's types.

A failure names the offending edge, or every edge of the cycle, with ``file:line`` so the import
can be found; the fix is to move the shared piece down into the module or layer that owns it,
not to hide the import inside a function (hidden imports are edges here too).
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
from dataclasses import dataclass

ROOT = pathlib.Path(importlib.util.find_spec("cfdist").submodule_search_locations[0])

# ARCHITECTURE.md's layer table, top to bottom, as data: a module may import modules of its own
# layer or of any layer below it. Keys are the first name under ``cfdist`` (a folder or a module).
ENTRY = ("__init__", "api", "cli", "demo", "lightning", "ray_train", "codecs", "experiments", "benchmarks", "planner")
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ENTRY),
    # Test support (fault-injecting storage) used by tests, benchmarks and experiments; product
    # layers below never import it.
    ("testing", ("testing",)),
    ("cluster", ("cluster",)),
    ("chaos", ("chaos",)),
    ("checkpoint", ("checkpoint",)),
    ("policy", ("policy",)),
    ("data", ("data",)),
    ("storage", ("storage",)),
]
RANK = {part: len(LAYERS) - i for i, (_, parts) in enumerate(LAYERS) for part in parts}
LAYER_OF = {part: name for name, parts in LAYERS for part in parts}

# Third-party packages a layer must not import (top-level names), on top of the downward rule.
PRODUCT_CORE = ("checkpoint", "policy", "data", "storage")
FORBIDDEN_THIRD_PARTY = {**{layer: ("ray", "matplotlib") for layer in PRODUCT_CORE}, "chaos": ("ray",)}


@dataclass(frozen=True)
class Edge:
    src: str          # importing module, e.g. "cfdist.checkpoint.discovery"
    dst: str          # imported module (a cfdist module or a third-party top-level name)
    where: str        # "cfdist/checkpoint/discovery.py:27"
    type_only: bool   # under ``if TYPE_CHECKING:``


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The cfdist module ``name`` refers to (its longest prefix that is a module), or ``name``."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.AST, module: str, is_pkg: bool) -> list[str]:
    """Absolute module names one import statement (or dynamic import call) brings in."""
    if isinstance(node, ast.Import):
        return [_resolve(a.name) for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module
        subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES]
        rest = len(subs) < len(node.names)
        return subs + ([_resolve(mod)] if rest or not subs else [])
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in ("import_module", "__import__") and node.args[0].value.startswith("cfdist"):
            return [_resolve(node.args[0].value)]
    return []


def _edges_of(module: str, path: pathlib.Path) -> list[Edge]:
    tree = ast.parse(path.read_text(), str(path))
    type_only_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            type_only_nodes |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        for dst in _targets(node, module, is_pkg):
            if dst != module:
                where = f"{path.relative_to(ROOT.parent)}:{node.lineno}"
                out.append(Edge(module, dst, where, id(node) in type_only_nodes))
    return out


EDGES = [e for m, p in MODULES.items() for e in _edges_of(m, p)]


def _part(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def _cycles(edges: list[Edge]) -> list[list[Edge]]:
    """Cycles (as their edges) that together pass through every module caught in a cycle."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        if e.dst in MODULES:
            graph.setdefault(e.src, {}).setdefault(e.dst, e)
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):   # Tarjan; the graph is ~150 modules, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    out = []
    for comp in comps:   # shortest cycles through the component's modules until each is on one
        left = set(comp)
        while left:
            cycle = _shortest_cycle(graph, comp, min(left))
            left -= {e.src for e in cycle}
            out.append(cycle)
    return out


def _shortest_cycle(graph: dict[str, dict[str, Edge]], comp: set[str], start: str) -> list[Edge]:
    """The edges of a shortest cycle from ``start`` back to it inside ``comp`` (breadth first)."""
    prev, frontier = {start: None}, [start]
    while not any(start in graph.get(v, {}) for v in frontier):
        nxt = []
        for v in frontier:
            for w in graph.get(v, {}):
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    path = [next(v for v in frontier if start in graph.get(v, {}))]
    while prev[path[-1]] is not None:
        path.append(prev[path[-1]])
    path.reverse()
    return [graph[a][b] for a, b in zip(path, path[1:] + [start])]


def _fmt(edges: list[Edge]) -> str:
    return "\n".join(f"  {e.src} -> {e.dst}   ({e.where})" for e in edges)


def test_every_module_belongs_to_a_layer():
    unknown = sorted({_part(m) for m in MODULES} - set(RANK))
    assert unknown == [], (f"cfdist/{unknown} is in no layer: add it to LAYERS in {__file__} "
                           f"(and to the layer table of ARCHITECTURE.md)")


def test_no_import_cycles():
    cycles = _cycles([e for e in EDGES if not e.type_only])
    msg = "\n".join(f"import cycle {i + 1}:\n{_fmt(c)}" for i, c in enumerate(cycles))
    assert cycles == [], (f"{len(cycles)} import cycle(s); move the shared piece down into the module "
                          f"that owns it (an import inside a function still counts):\n{msg}")


def _upward(edges: list[Edge]) -> list[Edge]:
    """The edges from a module to one of a higher layer."""
    return [e for e in edges if e.dst in MODULES and RANK[_part(e.dst)] > RANK[_part(e.src)]]


def test_imports_point_down_the_layers():
    bad = _upward(EDGES)
    lines = [f"  {e.src} ({LAYER_OF[_part(e.src)]}) -> {e.dst} ({LAYER_OF[_part(e.dst)]})   ({e.where})"
             for e in bad]
    assert bad == [], "imports against the layer map of ARCHITECTURE.md (a layer imports only itself and below):\n" \
        + "\n".join(lines)


def test_product_layers_import_neither_ray_nor_matplotlib():
    bad = [e for e in EDGES if e.dst.split(".")[0] in FORBIDDEN_THIRD_PARTY.get(_part(e.src), ())]
    assert bad == [], "checkpoint, policy, data and storage run without Ray or matplotlib (chaos without Ray):\n" \
        + _fmt(bad)


def test_product_layers_never_import_the_test_support():
    product = ("cluster", "chaos", *PRODUCT_CORE)
    bad = [e for e in EDGES if _part(e.src) in product and _part(e.dst) == "testing" and e.dst in MODULES]
    assert bad == [], "cfdist.testing is test support, not product code:\n" + _fmt(bad)


# ---- the checker itself, on small made-up graphs --------------------------------------------------

def test_the_cycle_finder_reports_every_edge_of_a_cycle_with_its_line():
    a, b, c = "cfdist.storage.base", "cfdist.storage.url", "cfdist.storage.direct"
    edges = [Edge(a, b, "a.py:1", False), Edge(b, c, "b.py:2", False), Edge(c, a, "c.py:3", False),
             Edge(a, "cfdist.storage", "a.py:4", False)]
    (cycle,) = _cycles(edges)
    assert [(e.src, e.dst, e.where) for e in cycle] == [(a, b, "a.py:1"), (b, c, "b.py:2"), (c, a, "c.py:3")]
    assert _cycles(edges[:2]) == []


def test_an_import_up_the_layers_is_caught_and_one_down_or_across_is_not():
    e = lambda src, dst: Edge(src, dst, "x.py:1", False)   # noqa: E731
    up = [e("cfdist.storage.base", "cfdist.checkpoint.format"), e("cfdist.checkpoint.persist", "cfdist.cluster.worker"),
          e("cfdist.chaos.events", "cfdist.api"), e("cfdist.cluster.worker", "cfdist")]
    ok = [e("cfdist.checkpoint.persist", "cfdist.storage.base"), e("cfdist.cluster.worker", "cfdist.chaos.events"),
          e("cfdist.checkpoint.persist", "cfdist.checkpoint.format"), e("cfdist.api", "cfdist.cluster.worker")]
    assert _upward(up + ok) == up


def test_relative_and_function_level_imports_are_edges():
    src = ("from . import base\nfrom .url import open_storage\n"
           "def f():\n    import cfdist.checkpoint.format\n    from cfdist.cluster import controller\n")
    tree = ast.parse(src)
    got = sorted(t for n in ast.walk(tree) for t in _targets(n, "cfdist.storage.direct", False))
    assert got == ["cfdist.checkpoint.format", "cfdist.cluster.controller", "cfdist.storage.base",
                   "cfdist.storage.url"]
