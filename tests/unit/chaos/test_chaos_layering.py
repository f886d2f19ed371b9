"""``cfdist.chaos`` sits below the cluster layer and the entry points: it must load neither.

The static rule (no chaos module imports the cluster layer, an entry point or Ray, lazy imports
included) is part of the layer map checked for every module in ``tests/unit/test_layers.py``.
Here, at run time: importing every chaos module in a fresh interpreter loads neither Ray nor
``cfdist.experiments`` (``import cfdist`` itself loads the public ``cfdist.fit``, so the cluster
layer cannot be checked that way).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import cfdist.chaos

CHAOS = pathlib.Path(cfdist.chaos.__file__).parent


def test_importing_every_chaos_module_loads_neither_ray_nor_the_experiments():
    mods = sorted(f"cfdist.chaos.{p.stem}" for p in CHAOS.glob("*.py") if p.stem not in ("__init__", "plots"))
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print([m for m in sys.modules if m.split('.')[0] == 'ray' or m.startswith('cfdist.experiments')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
