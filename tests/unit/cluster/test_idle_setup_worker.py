"""The setup script of the simulated nodes' workers (``cfdist/cluster/idle_setup_worker.py``):
a preparation's setup (its ``runtime_env`` runs the worker under ``chrt --idle``) runs under
``SCHED_IDLE`` from its first instruction, then Ray's own script with the same arguments; any
other worker's setup keeps its priority.

Run as the raylet runs it (``python <path> <args>``), in a child process, with
``CFDIST_SETUP_WORKER`` naming a stand-in for Ray's script that records its scheduling policy,
its arguments and its ``sys.path[0]``. With Ray (every prepared actor of
``tests/integration/cluster`` starts through it): ``test_cluster_fit.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cfdist.cluster import idle_setup_worker
from cfdist.cluster.local_cluster import IDLE_SETUP_WORKER

CHRT = {"py_executable": "/usr/bin/chrt --idle 0 /usr/bin/python3", "env_vars": {"RAY_worker_niceness": "19"}}
NICE_ONLY = {"py_executable": "/usr/bin/python3", "env_vars": {"RAY_worker_niceness": "19"}}


@pytest.mark.parametrize("argv,want", [
    (["s", f"--serialized-runtime-env-context={json.dumps(CHRT)}", "--language=PYTHON"], True),
    (["s", "--serialized-runtime-env-context", json.dumps(CHRT), "--language=PYTHON"], True),
    (["s", f"--serialized-runtime-env-context={json.dumps(NICE_ONLY)}"], False),   # stays at 19, not idle
    (["s", "--serialized-runtime-env-context={}"], False),
    (["s", "--serialized-runtime-env-context={not json"], False),
    (["s", "--language=PYTHON"], False),
])
def test_only_a_setup_whose_worker_runs_under_chrt_idle_is_a_preparations(argv, want):
    assert idle_setup_worker.prepared(argv) is want


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("ctx,policy", [(CHRT, os.SCHED_IDLE), (NICE_ONLY, os.SCHED_OTHER)])
def test_the_setup_runs_rays_script_with_its_arguments_idle_for_a_preparation_only(tmp_path, ctx, policy):
    out = tmp_path / "seen.json"
    stand_in = tmp_path / "workers" / "setup_worker.py"
    stand_in.parent.mkdir()
    stand_in.write_text(
        "import json, os, sys\n"
        f"json.dump({{'policy': os.sched_getscheduler(0), 'argv': sys.argv, 'path0': sys.path[0],"
        f" 'main': __name__}}, open({str(out)!r}, 'w'))\n")
    args = [f"--serialized-runtime-env-context={json.dumps(ctx)}", "--language=PYTHON", "--worker-arg", "7"]
    env = {**os.environ, "CFDIST_SETUP_WORKER": str(stand_in)}
    subprocess.run([sys.executable, IDLE_SETUP_WORKER, *args], env=env, check=True, timeout=60)
    seen = json.loads(out.read_text())
    assert seen["policy"] == policy
    assert seen["argv"] == [str(stand_in), *args] and seen["main"] == "__main__"
    assert seen["path0"] == str(stand_in.parent), "Ray's script would see cfdist/cluster first on sys.path"


def test_the_script_the_raylet_runs_is_this_module():
    assert os.path.samefile(IDLE_SETUP_WORKER, idle_setup_worker.__file__)
    assert idle_setup_worker.ray_setup_worker().endswith(os.path.join("ray", "_private", "workers", "setup_worker.py"))
