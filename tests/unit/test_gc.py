"""``cfdist._gc``: a cfdist process's imports run without garbage collections, then freeze.

Real: fresh Python processes importing the real cfdist (torch included), as a Ray worker does.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest

from cfdist import _gc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(body: str, env: dict | None = None) -> dict:
    code = "import gc, json\nout = {}\n" + textwrap.dedent(body) + "\nprint(json.dumps(out))"
    e = {k: v for k, v in os.environ.items() if k != _gc.ENV}
    e.update(env or {})
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_preparation_imports_cfdist_and_torch_without_a_collection_then_settles_frozen_and_its_children_collect():
    out = _child("""
        counts = []
        gc.callbacks.append(lambda phase, info: counts.append(info["generation"]) if phase == "start" else None)
        import cfdist, torch  # noqa: F401
        out["enabled_after_import"] = gc.isenabled()
        out["collections_during_import"] = counts
        from cfdist import _gc
        out["settled"] = _gc.settle()
        out["enabled"] = gc.isenabled()
        out["frozen"] = gc.get_freeze_count()
        out["settled_again"] = _gc.settle()
        import os, subprocess, sys
        out["env_left"] = os.environ.get(_gc.ENV)
        out["child_enabled"] = subprocess.run(   # a process it starts (a spawned data loader worker)
            [sys.executable, "-c", "import gc, cfdist; print(gc.isenabled())"],
            capture_output=True, text=True, check=True).stdout.strip()
    """, env={_gc.ENV: "1"})
    # at most a young-generation one before cfdist's first line runs; no full one
    assert out["enabled_after_import"] is False and out["collections_during_import"] in ([], [0]), out
    assert out["settled"] is True and out["enabled"] is True, out
    assert out["frozen"] > 100_000, out   # torch's and cfdist's objects: later collections skip them
    assert out["settled_again"] is False, out
    assert out["env_left"] is None and out["child_enabled"] == "True", out


def test_any_other_process_collects_as_usual():
    out = _child("""
        counts = []
        gc.callbacks.append(lambda phase, info: counts.append(info["generation"]) if phase == "start" else None)
        import cfdist  # noqa: F401
        from cfdist import _gc
        out["enabled"] = gc.isenabled()
        out["full_collections_during_import"] = counts.count(2)
        out["settled"] = _gc.settle()
        out["frozen"] = gc.get_freeze_count()
    """)
    assert out["enabled"] is True and out["full_collections_during_import"] > 0, out
    assert out["settled"] is False and out["frozen"] == 0, out


@pytest.mark.parametrize("raises", [False, True])
def test_imports_block_collects_nothing_then_freezes_and_resumes_also_when_it_raises(raises):
    assert gc.isenabled()
    before = gc.get_freeze_count()
    seen = {}
    try:
        try:
            with _gc.imports():
                seen["enabled_inside"] = gc.isenabled()
                junk = [[] for _ in range(1000)]   # noqa: F841 - objects the freeze takes
                if raises:
                    raise KeyError("an import failed")
        except KeyError:
            assert raises
        assert seen["enabled_inside"] is False
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + 1000
    finally:
        gc.unfreeze()   # this test process's objects go back to the collector


def test_imports_block_leaves_a_disabled_collector_disabled():
    gc.disable()
    try:
        with _gc.imports():
            pass
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
