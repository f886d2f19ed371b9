"""The code has no syntax errors, undefined names, unused imports or variables (ruff's E9 and F
rules) in ``cfdist/``, ``tests/``, ``bench/`` and ``launch/``.

Why in the suite: an unused import or a dead variable is often a half-finished change (a name
that was meant to be used), and an undefined name in a rarely taken error path only fails when
that path runs. ``ruff`` comes with the ``test`` extras, so CI's one test command checks it.
A failure prints ruff's own findings (``file:line:col code message``); ``ruff check --fix``
fixes most of them.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_ruff_finds_no_errors_or_unused_names():
    dirs = [d for d in ("cfdist", "tests", "bench", "launch") if (REPO / d).is_dir()]
    assert "cfdist" in dirs and "tests" in dirs, f"not a cfdist checkout: {REPO}"
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "E9,F",
                          "--output-format", "concise", *dirs],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"ruff found problems (rc {out.returncode}):\n{out.stdout}{out.stderr}"
