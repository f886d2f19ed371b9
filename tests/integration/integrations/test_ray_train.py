"""cfdist inside a real Ray Train ``TorchTrainer`` (``launch/ray_train_small.py``'s loop).

Real: a local Ray on loopback, Ray Train with 2 CPU workers (gloo), a worker SIGKILLing itself
mid-run and Ray Train restarting the group (``FailureConfig``), a second ``TorchTrainer``
resuming from the first one's ``Result.checkpoint``. Faked: nothing (one machine).
The points: ``Result.checkpoint`` is cfdist's committed step directory itself, inside the run
directory (reported by reference: Ray Train made no copy); the run with a failure ends
bit-identical to the one without; a new run given ``Result.checkpoint`` restores that step.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("ray.train.torch")

import ray  # noqa: E402
import ray.train  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

import ray.cloudpickle  # noqa: E402

import cfdist  # noqa: E402
import launch.ray_train_small  # noqa: E402
import launch.train_small  # noqa: E402
from launch.ray_train_small import train_func  # noqa: E402

for _m in (launch.ray_train_small, launch.train_small):   # workers need not import launch/
    ray.cloudpickle.register_pickle_by_value(_m)

STEPS = 16      # 512 samples, batch 32 on 2 workers: 8 steps an epoch


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False,
             runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}})
    yield
    ray.shutdown()


def _fit(tmp_path, name, steps=STEPS, resume=None, **config):
    trainer = TorchTrainer(
        train_func, train_loop_config={"steps": steps, "every": 4, "resume_from": resume, **config},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name=name, storage_path=str(tmp_path / "results"),
                                       failure_config=ray.train.FailureConfig(max_failures=2)))
    return trainer.fit()


def _model_of(checkpoint) -> dict:
    base, _, name = checkpoint.path.rstrip("/").rpartition("/")
    return cfdist.load(f"file://{base}", int(name.split("-")[1]))["state"]["model"]


def test_ray_train_restarts_resume_from_cfdist_and_results_point_at_its_checkpoints(tmp_path, local_ray):
    ref = _fit(tmp_path, "ref")
    run_dir = tmp_path / "results" / "ref" / "cfdist"
    got = os.path.realpath(ref.checkpoint.path)
    assert got == os.path.realpath(run_dir / "step-000000016"), (got, os.listdir(run_dir))   # the step dir itself
    # Ray Train holds no copy of it anywhere else in the run directory
    copies = [d for d, _, files in os.walk(tmp_path / "results" / "ref") if "MANIFEST.json" in files]
    assert all(d.startswith(str(run_dir)) for d in copies)

    crashed = _fit(tmp_path, "crashed", crash_at=11, crash_marker=str(tmp_path / "crashed-once"))
    assert os.path.exists(tmp_path / "crashed-once")                     # the worker did die
    assert crashed.metrics["restored"] == 8                              # Every(4): 8 committed, not 12
    a, b = _model_of(ref.checkpoint), _model_of(crashed.checkpoint)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    more = _fit(tmp_path, "resumed", steps=STEPS + 4, resume=crashed.checkpoint)
    assert more.metrics["restored"] == STEPS and more.metrics["step"] == STEPS + 4
    assert more.checkpoint.path.endswith("resumed/cfdist/step-000000020")
