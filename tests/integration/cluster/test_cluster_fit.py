"""``cfdist.fit`` on a fake 2-node Ray cluster: crashes, lost nodes, elastic restarts.

Real: Ray (``ray.cluster_utils.Cluster``, one raylet per fake node), one actor process per rank
pinned to its node, torch.distributed on gloo with DDP, the NodeCheckpointer actors writing the
memory tier (/dev/shm) and each node's own "local disk" directory, shared storage on a local
directory, SIGKILL of a rank's process, removal of a whole node (its raylet and every process on
it). Faked: the machines (all nodes share this host's CPUs), the injector's timing (failures
fire at a step, not at a time).

The point of every test: the run ends with the parameters of the failure-free run *bit for
bit*, every sample was used exactly once per epoch, and the failure was recovered from the
tier the design promises (memory after a crash, a peer's memory after a lost node, shared
storage when peers may not help; a smaller group when no replacement node comes).
"""

from __future__ import annotations

import functools
import glob
import json

import pytest
import ray.cloudpickle
import torch

import cluster_loops
from cluster_loops import check_exactly_once, train_loop

from cfdist import Every, load
from cfdist.api import fit
from cfdist.cluster import AtStep, StepSchedule

ray.cloudpickle.register_pickle_by_value(cluster_loops)

STEPS = 24          # 3 epochs of 8 steps with 2 ranks
EVERY = 4


def _fit(fc, tmp, name, *, schedule=None, steps=STEPS, step_sleep_s=0.05, **kw):
    out = tmp / f"{name}-samples"
    out.mkdir()
    loop = functools.partial(train_loop, steps=steps, out_dir=str(out), every=EVERY, step_sleep_s=step_sleep_s)
    result = fit(loop,
                 num_nodes=2, workers_per_node=1, storage=f"file://{tmp}/{{node}}/local",
                 policy=Every(EVERY), preemption=schedule, run_name=name, progress=False,
                 event_log=str(tmp / f"{name}.jsonl"), max_failures=3, **kw)
    return result, out


@pytest.fixture(scope="module")
def reference(fake_cluster, tmp_path_factory):
    """The failure-free run's final parameters (2 nodes x 1 rank)."""
    tmp = tmp_path_factory.mktemp("ref")
    fake_cluster.ensure_workers(2)
    result, out = _fit(fake_cluster, tmp, "ref")
    assert result.failures == 0 and result.final_step == STEPS
    check_exactly_once(str(out), STEPS)
    return result.value


def _records(path):
    return [json.loads(line) for line in open(path)]


def _assert_same(value, reference):
    assert value.keys() == reference.keys()
    for k in reference:
        assert torch.equal(value[k], reference[k]), f"{k} differs from the failure-free run"


def test_killed_worker_process_restores_from_memory(fake_cluster, reference, tmp_path):
    """Rank 1's process is SIGKILLed at step 10: the group restarts at full size from the
    newest checkpoint in the node actors' memory tiers (its own node's, or - when the killed
    rank had not committed the newest step yet - the other node's, copied actor to actor); no
    disk is read. Final parameters equal the reference."""
    fake_cluster.ensure_workers(2)
    result, out = _fit(fake_cluster, tmp_path, "crash",
                       schedule=StepSchedule([AtStep(step=10, kind="crash", rank=1)]))
    assert result.failures == 1
    (f,) = result.failure_stats
    assert f.kind == "crash" and f.tier in ("memory", "peer")
    (choice,) = [r for r in _records(tmp_path / "crash.jsonl") if r.get("what") == "restore" and r["step"]]
    assert {src for src, _ in choice["sources"].values()} <= {"memory", "peer"}
    assert 0 < f.restored_step <= f.step and f.restored_step % EVERY == 0
    assert result.world_sizes == (2, 2)
    assert result.final_step == STEPS and result.steps >= STEPS
    _assert_same(result.value, reference)
    root, step = result.checkpoint.rsplit("/step-", 1)
    assert int(step) == STEPS
    _assert_same(load(root)["state"]["model"], {"module." + k: v for k, v in reference.items()})
    check_exactly_once(str(out), STEPS)
    # each node's writer persisted its own copy, every rank's RNG states in each
    manifests = glob.glob(f"{tmp_path}/*/local/**/step-{STEPS:09d}/MANIFEST.json", recursive=True)
    assert len(manifests) == 2 and all(len(json.load(open(m))["rngs"]) == 2 for m in manifests), manifests


def test_lost_node_is_replaced_and_seeded_from_peer(fake_cluster, reference, tmp_path):
    """Node 1 is removed (every process on it dies); a spare node with an empty disk replaces
    it: the spare gets the checkpoint from the surviving node's actor (peer copy), not from
    shared storage; the run ends bit-exact at full size."""
    fake_cluster.ensure_workers(3)   # two in the group, one spare
    result, out = _fit(fake_cluster, tmp_path, "peer", remove_node=fake_cluster.remove_node,
                       schedule=StepSchedule([AtStep(step=10, kind="preempt", node=1)]),
                       shared_storage=f"file://{tmp_path}/shared", shared_every=100)
    assert result.failures == 1
    (f,) = result.failure_stats
    assert f.kind == "preempt" and f.tier == "peer" and f.restored_step > 0
    assert result.world_sizes == (2, 2)
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)


def test_lost_node_without_peer_copy_restores_from_shared(fake_cluster, reference, tmp_path):
    """As above with ``peer_copy=False``: the spare is seeded from shared storage (written at
    every checkpoint here), still bit-exact; the final checkpoint is in shared storage."""
    fake_cluster.ensure_workers(3)
    result, out = _fit(fake_cluster, tmp_path, "shared", remove_node=fake_cluster.remove_node, peer_copy=False,
                       schedule=StepSchedule([AtStep(step=10, kind="preempt", node=1)]),
                       shared_storage=f"file://{tmp_path}/shared", shared_every=1)
    (f,) = result.failure_stats
    assert f.tier == "shared" and f.restored_step > 0
    _assert_same(result.value, reference)
    assert result.checkpoint.startswith(f"file://{tmp_path}/shared/shared/step-")
    check_exactly_once(str(out), STEPS)


def test_elastic_shrink_then_grow_keeps_data_exactly_once(fake_cluster, tmp_path):
    """Node 1 is lost and no replacement comes: training continues on one node (world size 1);
    when a node returns, the group grows back to 2 at the next checkpoint. Every sample is used
    exactly once per epoch across both world-size changes."""
    fake_cluster.ensure_workers(2)
    result, out = _fit(fake_cluster, tmp_path, "elastic", remove_node=fake_cluster.remove_node,
                       steps=40, step_sleep_s=0.15,
                       add_node=lambda slot: fake_cluster.add_node(),
                       schedule=StepSchedule([AtStep(step=6, kind="preempt", node=1),
                                              AtStep(step=12, kind="return", node=1)]))
    assert result.world_sizes == (2, 1, 2), result.world_sizes
    assert result.failures == 1 and result.failure_stats[0].world_size == 1
    assert result.final_step == 40
    used = check_exactly_once(str(out), 40)
    assert len(used) >= 2
