"""``ray job submit`` runs the ``launch/`` scripts to the end against a Ray head started here.

Real: a Ray head node with its dashboard (the job server) started by this module, the ``ray``
command line as a user types it (the docstring's command with a test storage directory and a
short run), the job's driver calling ``cfdist.fit`` on that cluster, gloo ranks, checkpoints on
local disk, injected crashes in the experiment script. Faked: nothing but the size of the run.
The point: both jobs end SUCCEEDED and print their result line (the checkpoint, the recovery
breakdown).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def job_head():
    """A Ray head with 2 CPUs and its job server; yields the dashboard URL. Only its own
    processes are stopped at the end (never ``ray stop``, which would stop every Ray here)."""
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="cfj-", dir="/tmp")
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_TMPDIR", tmp)
    mp.setenv("RAY_AUTH_MODE", "disabled")
    port = _free_port()
    # The job agent's default port (52365) may be taken by another Ray on this machine.
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
        dashboard_agent_listen_port=_free_port(),
        object_store_memory=100 * 1024 * 1024))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        cluster.shutdown()
        mp.undo()
        shutil.rmtree(tmp, ignore_errors=True)


def _submit(address: str, script_args: list[str], timeout: float = 240) -> str:
    cmd = [RAY, "job", "submit", "--address", address, "--working-dir", os.path.join(REPO, "launch"),
           "--", sys.executable, *script_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    deadline = time.monotonic() + 90
    while True:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        out = p.stdout + p.stderr
        # the head's job agent registers a few seconds after the head is up
        if "No available agent" not in out or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert p.returncode == 0, f"ray job submit failed ({p.returncode}):\n{out[-4000:]}"
    assert "succeeded" in out.lower(), out[-4000:]
    return out


def _result_line(out: str, key: str | None = None) -> dict:
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            rec = json.loads(line)
            return rec[key] if key else rec
    raise AssertionError(f"no JSON result line in:\n{out[-3000:]}")


def test_docstring_command_is_a_real_ray_job_submit():
    import importlib.util

    for name in ("train_small.py", "preemption_experiment.py"):
        path = os.path.join(REPO, "launch", name)
        spec = importlib.util.spec_from_file_location(name[:-3], path)
        doc = open(path).read().split('"""')[1]
        assert "ray job submit --address" in doc and f"python {name}" in doc, name
        assert spec is not None


def test_train_small_runs_to_the_end_as_a_ray_job(job_head, tmp_path):
    out = _submit(job_head, ["train_small.py", "--num-nodes", "1", "--workers-per-node", "2",
                             "--steps", "30", "--policy", "every:10", "--no-progress",
                             "--storage", f"file://{tmp_path}/ckpt", "--run-name", "job"])
    res = _result_line(out)
    assert res["final_step"] == 30 and res["failures"] == 0
    assert res["checkpoint"] == f"file://{tmp_path}/ckpt/job/step-000000030"
    assert os.path.exists(f"{tmp_path}/ckpt/job/step-000000030/MANIFEST.json")


def test_preemption_experiment_runs_to_the_end_as_a_ray_job(job_head, tmp_path):
    """The experiment script as a Ray job: one policy, one injected crash, results written."""
    out = _submit(job_head, ["preemption_experiment.py", "--out", str(tmp_path / "exp"), "--nodes", "1",
                             "--workers-per-node", "2", "--steps", "160", "--epoch-steps", "80",
                             "--mtbf-s", "3", "--failures", "crash", "--max-scheduled", "1",
                             "--baseline-steps", "20", "--policies", "every:10"])
    res = _result_line(out, "experiment")
    assert os.path.exists(res["results"]) and os.path.exists(res["summary_png"])
    results = json.loads(open(res["results"]).read())
    assert "every:10" in res["goodput"] and 0 < res["goodput"]["every:10"] <= 1.05, res
    assert results, "results.json is empty"
