"""Ray's worker setup script for :class:`~cfdist.cluster.local_cluster.LocalCluster`'s simulated
nodes: a preparation runs it at the lowest CPU priority from its first instruction.

A worker whose actor has a ``runtime_env`` starts as ``python setup_worker.py ...``: Ray's
script reads the environment's context, then ``exec``s the worker (through ``chrt --idle 0`` for
a preparation, :func:`cfdist.cluster.niceness.prepared_options`). That script runs at the
raylet's priority and costs ~0.3 CPU-seconds (its interpreter and Ray's imports). On a machine
that simulates several nodes it took that from the other simulated nodes' ranks: a new spare
after each recovery added 2-4 ms to every 44-ms step for about a second (separate machines
would not share those cores). Here the same script runs under ``SCHED_IDLE`` first when the
context is a preparation's (its ``py_executable`` runs the worker under ``chrt --idle``): what
``chrt`` would do anyway, a moment earlier. Any other worker's setup is untouched.

The raylet runs this file by its path (``RayParams.setup_worker_path``, set by
:func:`~cfdist.cluster.local_cluster.add_worker_node`), not as part of the package: it imports
only the standard library before it lowers itself, then runs Ray's own script unchanged.
``CFDIST_SETUP_WORKER`` names another script to run instead of Ray's (for tests).
"""

from __future__ import annotations

import json
import os
import sys

_CONTEXT = "--serialized-runtime-env-context"


def prepared(argv: list[str]) -> bool:
    """Whether ``argv`` (the setup script's) is for a preparation that runs under ``SCHED_IDLE``:
    its runtime env context's ``py_executable`` is ``chrt --idle ...``."""
    for i, a in enumerate(argv):
        if a == _CONTEXT and i + 1 < len(argv):
            raw = argv[i + 1]
        elif a.startswith(_CONTEXT + "="):
            raw = a.split("=", 1)[1]
        else:
            continue
        try:
            ctx = json.loads(raw)
        except ValueError:
            return False
        exe = ctx.get("py_executable") if isinstance(ctx, dict) else None
        return isinstance(exe, str) and "chrt" in exe.split()[0] and "--idle" in exe.split()
    return False


def ray_setup_worker() -> str:
    """The path of Ray's own setup script (or ``CFDIST_SETUP_WORKER``'s)."""
    override = os.environ.get("CFDIST_SETUP_WORKER")
    if override:
        return override
    import importlib.util

    return importlib.util.find_spec("ray._private.workers.setup_worker").origin


def main(argv: list[str]) -> None:
    if prepared(argv) and sys.platform.startswith("linux"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:   # as Ray's own script would run: at the raylet's priority
            pass
    import runpy

    script = ray_setup_worker()
    sys.argv = [script] + argv[1:]
    sys.path[0] = os.path.dirname(script)   # as when the raylet runs Ray's script itself
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv)
