"""``cfdist.fit`` called again and again in one process: notebooks, sweeps, a reference run
beside a chaos run.

Real: Ray with token authentication (the simulated nodes ``fit`` starts itself, each call a
fresh ``ray.cluster_utils.Cluster`` with a fresh token; or the user's own ``ray.init()``), one
actor process per rank, gloo, DDP, files. Faked: the machines (the nodes share this host).
The point: the second and third calls run (on the main branch before the fix, the second
failed with ``Failed to start GCS ... InvalidAuthToken``: Ray kept the first cluster's token
cached in this process past ``ray.shutdown()``), every run ends with the same parameters bit
for bit, and a Ray the user started is used and left running.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time

import pytest
import ray
import ray.cloudpickle
import torch

import cluster_loops
from cluster_loops import check_exactly_once, train_loop

from cfdist import Every
from cfdist.api import fit

ray.cloudpickle.register_pickle_by_value(cluster_loops)

STEPS = 8   # one epoch of 8 steps with 2 ranks; checkpoints at 4 and 8


@pytest.fixture
def no_ray(tmp_path, monkeypatch):
    """No Ray in this process, no ``RAY_ADDRESS``, a private ``RAY_TMPDIR`` and ``HOME`` (Ray
    writes ``~/.ray/auth_token`` when a user's ``ray.init()`` starts a cluster); Ray is shut
    down afterwards whatever happened."""
    from cfdist.cluster.local_cluster import _refresh_ray_auth

    if ray.is_initialized():
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix="cfq-", dir="/tmp")   # short: Unix socket paths are limited
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", tmp)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    auth = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}   # ray.init() sets the mode
    try:
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for k, v in auth.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _refresh_ray_auth()
        shutil.rmtree(tmp, ignore_errors=True)


def _fit(tmp_path, name, **kw):
    out = tmp_path / f"{name}-samples"
    out.mkdir()
    loop = functools.partial(train_loop, steps=STEPS, out_dir=str(out), every=4, step_sleep_s=0.0)
    result = fit(loop, storage=f"file://{tmp_path}/{name}", policy=Every(4), run_name=name, progress=False,
                 event_log=str(tmp_path / f"{name}.jsonl"), max_failures=0, **kw)
    assert result.failures == 0 and result.final_step == STEPS, result
    check_exactly_once(str(out), STEPS)
    return result.value


def _assert_same(value, reference, what):
    assert value.keys() == reference.keys()
    for k in reference:
        assert torch.equal(value[k], reference[k]), f"{what}: {k} differs from the first run"


@pytest.mark.slow
@pytest.mark.timeout(600)   # three runs, each with its own cluster start (about 75 s each on 2 busy cores)
def test_fit_runs_three_times_in_one_process(no_ray, tmp_path, capfd):
    """Three ``fit(num_nodes=2)`` calls, each starting and stopping its own simulated nodes with
    a fresh auth token: all three run to the end with the same parameters, and each leaves no
    Ray and no token behind. Each cluster spills objects into its own session directory: Ray
    writes the first one's into the system config it is given, and before the fix the later
    clusters were given that same dict (they would spill into the first, removed, session, and
    Ray warned on the console that the spilling config came from an unstable API)."""
    from cfdist.cluster import local_cluster

    first = _fit(tmp_path, "a", num_nodes=2, workers_per_node=1)
    assert not ray.is_initialized() and "RAY_AUTH_TOKEN" not in os.environ   # fit undid what it set up
    assert "object_spilling_config" not in local_cluster._FAST_HEALTH, local_cluster._FAST_HEALTH
    for name in ("b", "c"):
        _assert_same(_fit(tmp_path, name, num_nodes=2, workers_per_node=1), first, f"run {name}")
        assert not ray.is_initialized()
    console = capfd.readouterr()
    assert "object spilling config" not in console.out + console.err


def _wait_for_cpus(n: float, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fit's actors did not give the user's {n:g} CPUs back within {timeout_s:g} s: "
                               f"available {ray.available_resources().get('CPU', 0)}")
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fit_uses_the_users_ray_leaves_it_running_and_starts_its_own_nodes_after_it(no_ray, tmp_path):
    """The user's ``ray.init()`` (token authentication on, as Ray now does by default, with the
    token in ``~/.ray``), a ``fit`` on it (1 node x 2 workers), which leaves it running with its
    CPUs free and able to run a task; then the user shuts it down and a ``fit(num_nodes=2)``
    starts its own simulated nodes (with the user's token, since Ray set ``RAY_AUTH_MODE``).
    Both end with the same parameters."""
    ray.init(num_cpus=3, include_dashboard=False, logging_level="WARNING")
    try:
        ours = ray.get_runtime_context().get_node_id()
        on_users = _fit(tmp_path, "user", num_nodes=1, workers_per_node=2)
        assert ray.is_initialized() and ray.get_runtime_context().get_node_id() == ours   # the user's, untouched
        _wait_for_cpus(3)
        assert ray.get(ray.remote(lambda: 42).remote(), timeout=120) == 42
    finally:
        ray.shutdown()
    _assert_same(_fit(tmp_path, "after", num_nodes=2, workers_per_node=1), on_users, "after the user's Ray")
    assert not ray.is_initialized()
