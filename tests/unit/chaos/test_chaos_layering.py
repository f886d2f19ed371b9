"""``cfdist.chaos`` sits below the cluster layer and the entry points: it must import neither.

Checked statically (every ``import`` statement, lazy ones inside functions included, of every
module under ``cfdist/chaos``) and at run time (importing every chaos module in a fresh
interpreter loads neither Ray nor ``cfdist.experiments``; ``import cfdist`` itself loads the
public ``cfdist.fit``, so the cluster layer cannot be checked that way).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import cfdist.chaos

CHAOS = pathlib.Path(cfdist.chaos.__file__).parent
FORBIDDEN = ("cfdist.cluster", "cfdist.api", "cfdist.experiments", "ray")


def _imports(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
            if node.module == "cfdist":   # from cfdist import fit / cluster / experiments
                out += [f"cfdist.{a.name}" for a in node.names]
    return out


def _bad(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN) or name in ("cfdist.fit",)


def test_no_chaos_module_imports_the_cluster_layer_or_entry_points():
    offenders = {str(p.relative_to(CHAOS)): [m for m in _imports(p) if _bad(m)] for p in CHAOS.rglob("*.py")}
    offenders = {k: v for k, v in offenders.items() if v}
    assert offenders == {}, f"cfdist/chaos must stay pure; move these to cfdist/experiments: {offenders}"


def test_importing_every_chaos_module_loads_neither_ray_nor_the_experiments():
    mods = sorted(f"cfdist.chaos.{p.stem}" for p in CHAOS.glob("*.py") if p.stem not in ("__init__", "plots"))
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print([m for m in sys.modules if m.split('.')[0] == 'ray' or m.startswith('cfdist.experiments')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
