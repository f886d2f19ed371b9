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
import os
import pathlib
import re
import signal
import threading
import time

import pytest
import ray
import ray.cloudpickle
import torch

import cluster_loops
import cfdist
from cluster_loops import check_exactly_once, train_loop, wait_for

from cfdist import Every, load
from cfdist.api import fit
from cfdist.cluster import AtStep, StepSchedule

ray.cloudpickle.register_pickle_by_value(cluster_loops)

STEPS = 24          # 3 epochs of 8 steps with 2 ranks
EVERY = 4


def _fit(fc, tmp, name, *, schedule=None, steps=STEPS, step_sleep_s=0.05, num_nodes=2, hold_small=None,
         freeze_at=None, ckpt_kwargs=None, workers_per_node=1, hold_end=False, spin_at=None, die_on_notice=None,
         hold_for_halt=None, kill_in=None, halt_in=None, **kw):
    out = tmp / f"{name}-samples"
    out.mkdir()
    loop = functools.partial(train_loop, steps=steps, out_dir=str(out), every=EVERY, step_sleep_s=step_sleep_s,
                             hold_small=hold_small, freeze_at=freeze_at, ckpt_kwargs=ckpt_kwargs,
                             hold_end=str(tmp / f"{name}.jsonl") if hold_end else None, spin_at=spin_at,
                             die_on_notice=die_on_notice, kill_in=kill_in, halt_in=halt_in,
                             hold_for_halt=(hold_for_halt, str(tmp / f"{name}.jsonl")) if hold_for_halt else None)
    result = fit(loop,
                 num_nodes=num_nodes, workers_per_node=workers_per_node, storage=f"file://{tmp}/{{node}}/local",
                 policy=Every(EVERY), preemption=schedule, run_name=name,
                 event_log=str(tmp / f"{name}.jsonl"), max_failures=3, **{"progress": False, **kw})
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


@pytest.mark.parametrize("live", [True, False], ids=["live", "rollback"])
def test_killed_worker_process_restores_from_memory(fake_cluster, reference, tmp_path, live):
    """Rank 1's process is SIGKILLed at step 10. With live recovery (the default) the surviving
    rank 0 keeps the live state of the last step it completed in its process when its all-reduce
    fails (nothing written), the next group is re-formed around that process and a warm spare,
    and rank 0 sends the step to the new rank 1 over the new group: no storage round trip, no
    stage copy; nothing is lost but the step in progress. Without it, the group restarts from
    the newest checkpoint (a multiple of k) in the node actors' memory tiers (its own node's,
    or - when the killed rank's node lacks the step - the other node's, copied actor to actor).
    Final parameters equal the reference."""
    fake_cluster.ensure_workers(2)
    result, out = _fit(fake_cluster, tmp_path, "crash", live_recovery=live,
                       schedule=StepSchedule([AtStep(step=10, kind="crash", rank=1)]))
    assert result.failures == 1
    (f,) = result.failure_stats
    assert f.kind == "crash" and f.tier == ("live" if live else "memory" if f.tier == "memory" else "peer"), f
    recs = _records(tmp_path / "crash.jsonl")
    if live:
        # rank 0 had completed step 10 at least (the driver saw it) when rank 1 died
        assert f.restored_step >= 10 and f.lost_iterations <= 1, f
        manifest = glob.glob(f"{tmp_path}/n*/local/**/step-{STEPS:09d}/MANIFEST.json", recursive=True)
        assert manifest, "the final checkpoint is missing"
        # the new group restored the survivor's step from its live state (every node's source
        # is "live": below), and no live state was written to a tier
        fail_i = next(i for i, r in enumerate(recs) if r["event"] == "failure")
        restored = [r for r in recs[fail_i:] if r["event"] == "restored"]
        assert [r["tier"] for r in restored] == ["live"] and restored[0]["step"] == f.restored_step, restored
        assert not [r for r in recs if r["event"] == "checkpoint_committed" and r.get("live")], \
            "a live state was written to a tier: the survivor should have kept it in process"
        assert not [p for p in glob.glob(f"{result.log_dir}/rank-worker-*.log") if "wrote the live state" in open(p).read()]
    else:
        assert 0 < f.restored_step <= f.step and f.restored_step % EVERY == 0, f
    (choice,) = [r for r in recs if r.get("what") == "restore" and r["step"]]
    assert {src for src, _ in choice["sources"].values()} <= ({"live"} if live else {"memory", "peer"}), choice
    # the recovery's phases are in the log, in order; the new group is made of warm spares, the
    # surviving rank 0 among them, re-formed in its own process (no process start)
    fail_i = next(i for i, r in enumerate(recs) if r["event"] == "failure")
    order = [next(i for i, r in enumerate(recs) if i > fail_i and r["event"] == ev)
             for ev in ("detected", "restarted", "restored", "resumed")]
    assert order == sorted(order), [recs[i]["event"] for i in order]
    restarted = recs[order[1]]
    assert restarted["reused"] == 2 and restarted["recycled"] == 1, restarted
    assert {"spawn_s", "rendezvous_s", "spare_wait_s"} <= restarted.keys()
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


def test_a_killed_writer_whose_survivor_writes_no_checkpoints_loses_at_most_the_step_in_progress(
        fake_cluster, reference, tmp_path):
    """One node, two ranks (``cfdist.fit`` on one machine, as the demo runs): rank 0, the node's
    only writer, is SIGKILLed at step 10. The survivor, rank 1, writes no checkpoints, yet it
    keeps its live state of the last step it completed in its process, and the next group
    restores that step from it over the group (tier ``live``): nothing is lost but the step in
    progress. (Before, only writers kept a live state: the group rolled back to step 8, the
    newest commit.) Final parameters equal the reference (the same two ranks' math on one node
    as on two); data exactly once."""
    fake_cluster.ensure_workers(2)
    result, out = _fit(fake_cluster, tmp_path, "writer", num_nodes=1, workers_per_node=2, cpus_per_worker=0.5,
                       schedule=StepSchedule([AtStep(step=10, kind="crash", rank=0)]))
    assert result.failures == 1 and result.final_step == STEPS
    (f,) = result.failure_stats
    assert f.kind == "crash" and f.tier == "live" and f.restored_step >= 10 and f.lost_iterations <= 1, f
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)


@pytest.mark.parametrize("seen_by", ["driver", "node actor"])
def test_a_dying_rank_whose_sockets_outlive_it_does_not_hold_its_survivor_until_the_collective_timeout(
        fake_cluster, reference, tmp_path, monkeypatch, seen_by):
    """Rank 1 forks a child that inherits its descriptors and SIGKILLs itself in the forward of
    step 10: its gloo connections stay open in the child (as when a data-loader worker forked
    after the group formed outlives its rank), so rank 0's all-reduce of step 10 would wait for
    torch.distributed's timeout (set to 10 minutes here, past the test's own timeout) and Ray
    never hears the process end. The exit watch sees rank 1's process exit and breaks rank 0's
    group (``RankWorker.break_group``): its all-reduce fails at once, it keeps step 9 in
    process, and the run ends bit-identical to the failure-free one, data exactly once. Seen by
    the driver in ``/proc`` (a one-machine run), or by the node's checkpoint actor (ranks on
    other machines than the driver's: here the driver is made to report another process
    namespace, so only the node actors can see the ranks' processes)."""
    from cfdist.cluster import worker_group
    from cfdist.cluster.config import RecoveryOptions

    if seen_by == "node actor":
        monkeypatch.setattr(worker_group, "own_namespace", lambda: "another-machine:1")
    fake_cluster.ensure_workers(2)
    try:
        result, out = _fit(fake_cluster, tmp_path, "orphan", kill_in=(1, 10, "orphaning"),
                           recovery=RecoveryOptions(rendezvous_timeout_s=600.0))
    finally:
        pidfile = tmp_path / "orphan-samples" / "orphan.pid"
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
    assert pidfile.exists(), "rank 1 did not fork the child that holds its sockets"
    assert result.failures == 1, result.failure_stats
    (f,) = result.failure_stats
    assert (f.tier, f.restored_step) == ("live", 9) and f.lost_iterations <= 1, f
    assert result.final_step == STEPS
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)


@pytest.mark.parametrize("phase", ["forward", "backward", "allreduce", "optimizer"])
def test_a_rank_killed_in_each_phase_of_a_step_loses_at_most_that_step(fake_cluster, reference, tmp_path, phase):
    """Rank 1 SIGKILLs itself inside step 10: in the forward, in the backward (before its
    gradient bucket's all-reduce), right after launching the all-reduce, or inside the
    optimizer step (its weight half updated). Rank 0 survives with the last step it completed:
    9 when rank 1 died before its gradient was sent, 10 when the all-reduce had delivered it (in
    the optimizer step always, in the all-reduce when the kill came late enough). That live
    state, kept in rank 0's process, is the restore point (sent to the new rank 1 over the new
    group), 1 step lost at most; the dead rank's torn state is never read. The run ends
    bit-identical to the failure-free one, data exactly once."""
    fake_cluster.ensure_workers(2)
    result, out = _fit(fake_cluster, tmp_path, phase, kill_in=(1, 10, phase))
    assert result.failures == 1, result.failure_stats
    (f,) = result.failure_stats
    assert f.tier == "live", f
    if phase == "allreduce":
        assert f.restored_step in (9, 10), f
    elif phase == "optimizer":   # the all-reduce of step 10 was done: rank 0 completes it
        assert f.restored_step == 10, f
    else:   # rank 0 cannot complete step 10 without rank 1's gradient
        assert f.restored_step == 9, f
    assert f.lost_iterations <= 1, f
    assert result.world_sizes == (2, 2) and result.final_step == STEPS
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)


def test_live_recovery_with_two_ranks_per_node_double_buffering_and_a_codec(fake_cluster, tmp_path):
    """2 nodes x 2 ranks, ``buffers=2`` and a ``Zstd`` codec: rank 3 (node 1's second rank, not
    a writer) is SIGKILLed at step 10. Node 1's writer survives on the same node and, like node
    0's, writes its live state to its memory tier (encoded by the codec, beside a double-buffered
    persist that may be in flight); the next group resumes from it. Final parameters equal the
    same job's failure-free run (to float rounding: four ranks add in an order DDP may change
    between groups); data exactly once."""
    fake_cluster.ensure_workers(2)
    kw = dict(workers_per_node=2, cpus_per_worker=0.5, ckpt_kwargs={"buffers": 2, "codecs": [cfdist.codecs.Zstd()]})
    ref, out = _fit(fake_cluster, tmp_path, "ref4", **kw)
    assert ref.failures == 0 and ref.final_step == STEPS
    check_exactly_once(str(out), STEPS)
    result, out = _fit(fake_cluster, tmp_path, "crash4", schedule=StepSchedule([AtStep(step=10, kind="crash", rank=3)]),
                       **kw)
    assert result.failures == 1 and result.world_sizes == (4, 4)
    (f,) = result.failure_stats
    assert f.kind == "crash" and f.restored_step >= 10 and f.lost_iterations <= 1, f
    assert result.final_step == STEPS
    # Four ranks: the sum of four gradients depends on the order gloo adds them in. One full-suite
    # run in this session ended 7e-8 away from the reference (two isolated runs were bit-exact);
    # our best explanation, not confirmed: DDP rebuilds its bucket layout from the order the
    # gradients became ready in each new group's first step. With two ranks (every other test)
    # a + b is exact and the comparison is bit for bit.
    assert result.value.keys() == ref.value.keys()
    for k in ref.value:
        assert torch.allclose(result.value[k], ref.value[k], rtol=0, atol=1e-6), f"{k} differs from the failure-free run"
    check_exactly_once(str(out), STEPS)


def test_fit_under_a_host_memory_budget_streams_into_the_node_tiers_and_recovers_bit_exact(
        fake_cluster, reference, tmp_path):
    """``ctx.checkpointer(..., host_memory=0.5)``: each writer rank streams its snapshots through
    a shared chunk pool into its node actor, which writes the memory tier from the windows and
    the local tier from the memory tier's files. Rank 1 SIGKILLs itself in step 10's forward
    (from inside, so the kill cannot land after the run's end on a loaded machine); the next
    group restores from the survivor. Final parameters equal the reference, every local-tier
    checkpoint loads (checksums verified) and no chunk pool file is left in /dev/shm."""
    fake_cluster.ensure_workers(2)
    result, out = _fit(fake_cluster, tmp_path, "budget", ckpt_kwargs={"host_memory": 0.5},
                       kill_in=(1, 10, "forward"))
    assert result.failures == 1 and result.final_step == STEPS
    (f,) = result.failure_stats
    assert f.tier == "live" and f.lost_iterations <= 1, f
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)
    for node in ("n0", "n1"):
        root = f"file://{tmp_path}/{node}/local/budget"
        steps = [c["step"] for c in cfdist.list_checkpoints(root)]
        assert steps and steps[-1] == STEPS, (node, steps)
        _assert_same(load(root)["state"]["model"], {"module." + k: v for k, v in reference.items()})
    pids = {p for logs in glob.glob(f"{result.log_dir}/rank-worker-*.log") for p in re.findall(r"pid (\d+)", open(logs).read())}
    assert not [p for p in glob.glob("/dev/shm/cfdist-*.arena") if p.split("-")[1] in pids], "a chunk pool outlived its rank"


def test_a_frozen_rank_is_killed_after_hang_timeout_and_the_run_recovers_from_the_survivors_live_state(
        fake_cluster, reference, tmp_path):
    """Rank 1's process freezes (SIGSTOP, from inside it) right after step 10; rank 0 then waits
    in step 11's all-reduce, and no step completes. After ``hang_timeout_s`` the driver asks both
    ranks for their step: rank 1 does not answer and its process is killed through its node's
    actor; rank 0's collective fails, it writes its live state of step 10, and the next group
    resumes from it. Final parameters equal the reference; data exactly once."""
    fake_cluster.ensure_workers(2)
    result, out = _fit(fake_cluster, tmp_path, "hang", freeze_at=(1, 10),
                       recovery=cfdist.RecoveryOptions(hang_timeout_s=5.0))
    assert result.failures == 1
    (f,) = result.failure_stats
    assert f.kind == "crash" and f.tier == "live", f
    assert f.restored_step >= 10 and f.lost_iterations <= 1, f
    recs = _records(tmp_path / "hang.jsonl")
    (hang,) = [r for r in recs if r["event"] == "hang"]
    assert hang["ranks"] == [1] and hang["frozen"] and hang["quiet_s"] >= 5.0, hang
    (failure,) = [r for r in recs if r["event"] == "failure"]
    assert failure["cause"] == "hang" and failure["rank"] == 1 and "hung" in failure["message"], failure
    (restored,) = [r for r in recs if r["event"] == "restored" and r.get("detect_s") is not None
                   and r["t"] > failure["t"]]
    assert restored["detect_s"] >= 5.0, restored   # the detect phase shows the timeout it took
    assert result.final_step == STEPS
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)


def test_a_hang_every_rank_shares_stops_the_group_and_rolls_back(fake_cluster, reference, tmp_path):
    """Rank 1 loops for ever in its own code after step 10 (its process answers; rank 0 waits
    in the next all-reduce). After ``hang_timeout_s`` both ranks answer the driver, so nothing
    tells the hung one apart: the whole group is stopped, and the run restores the newest
    checkpoint (no survivor wrote a live state). Final parameters equal the reference."""
    fake_cluster.ensure_workers(2)
    result, out = _fit(fake_cluster, tmp_path, "spin", spin_at=(1, 10),
                       recovery=cfdist.RecoveryOptions(hang_timeout_s=5.0))
    assert result.failures == 1 and result.final_step == STEPS
    recs = _records(tmp_path / "spin.jsonl")
    (hang,) = [r for r in recs if r["event"] == "hang"]
    assert sorted(hang["ranks"]) == [0, 1] and not hang["frozen"], hang
    (f,) = result.failure_stats
    assert f.restored_step % EVERY == 0 and f.restored_step <= 10, f   # a checkpoint, not a live state
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)


def test_lost_node_is_replaced_and_seeded_from_peer(fake_cluster, reference, tmp_path):
    """Node 1 is removed (every process on it dies); a spare node with an empty disk replaces
    it: the spare gets the checkpoint from the surviving node's actor (peer copy), not from
    shared storage; the run ends bit-exact at full size. (Live recovery off: with it the
    survivor's live state reaches the spare over the new group, as after a killed worker.)"""
    fake_cluster.ensure_workers(3)   # two in the group, one spare
    result, out = _fit(fake_cluster, tmp_path, "peer", remove_node=fake_cluster.remove_node, live_recovery=False,
                       schedule=StepSchedule([AtStep(step=10, kind="preempt", node=1)]),
                       shared_storage=f"file://{tmp_path}/shared", shared_every=100)
    assert result.failures == 1
    (f,) = result.failure_stats
    assert f.kind == "preempt" and f.tier == "peer" and f.restored_step > 0
    assert result.world_sizes == (2, 2)
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)


@pytest.mark.parametrize("lost", [1, 0], ids=["node1", "node0-with-the-store"])
def test_a_lost_node_is_replaced_and_its_ranks_receive_the_survivors_live_step(fake_cluster, reference, tmp_path,
                                                                             lost):
    """A whole node is removed at step 10 (its rank's process, its node actor and its memory
    tier die with it; node 0 also hosts rank 0 and the group's rendezvous store) and a spare
    node with an empty disk replaces it, under live recovery (the default). The surviving rank
    keeps the last step it completed in its process, the next group is re-formed around it on
    its node and the spare, and that step reaches the spare's rank over the new group (tier
    ``live``, every node's source the survivor's node): nothing is staged or copied between
    node actors, nothing lost but the step in progress. The lost rank's RNG is derived (seed,
    rank, step), which this loop does not draw from after its start, so the run still ends
    bit-identical to the failure-free one, on both nodes' final checkpoints (the spare's written
    from the state it received); data exactly once."""
    fake_cluster.ensure_workers(3)   # two in the group, one spare
    name = f"lost{lost}"
    result, out = _fit(fake_cluster, tmp_path, name, remove_node=fake_cluster.remove_node,
                       schedule=StepSchedule([AtStep(step=10, kind="preempt", node=lost)]))
    assert result.failures == 1, result.failure_stats
    (f,) = result.failure_stats
    assert f.kind == "preempt" and f.tier == "live", f
    # the survivor had completed step 10 at least (the driver saw it) when the node was lost
    assert f.restored_step >= 10 and f.lost_iterations <= 1, f
    recs = _records(tmp_path / f"{name}.jsonl")
    fail_i = next(i for i, r in enumerate(recs) if r["event"] == "failure")
    assert recs[fail_i]["kind"] == "preempt" and recs[fail_i].get("node") == lost, recs[fail_i]
    restored = [r for r in recs[fail_i:] if r["event"] == "restored"]
    assert [r["tier"] for r in restored] == ["live"] and restored[0]["step"] == f.restored_step, restored
    (choice,) = [r for r in recs if r.get("what") == "restore" and r["step"]]
    assert choice["step"] == f.restored_step, choice
    srcs = set(map(tuple, choice["sources"].values()))
    # one survivor's node is every node's source, the spare's included (no stage, no peer copy)
    assert len(choice["sources"]) == 2 and len(srcs) == 1 and next(iter(srcs))[0] == "live", choice
    first = next(r for r in recs if r.get("what") == "group_size")["nodes"]   # node names, by group rank
    survivor = first[1 - lost]
    assert fake_cluster.names[next(iter(srcs))[1]] == survivor and survivor in choice["sources"], (first, choice)
    assert "stage_wait_s" not in restored[0], "a rank waited for a copy of the step to its node"
    assert not [r for r in recs if r["event"] == "checkpoint_committed" and r.get("live")], \
        "a live state was written to a tier: the survivor should have kept it in process"
    assert result.world_sizes == (2, 2) and result.final_step == STEPS
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)
    # the survivor's node and the spare each wrote the final step from their own rank's state
    # (the spare's rank holds what it received over the group); the lost node's disk lacks it
    finals = sorted(glob.glob(f"{tmp_path}/n*/local/{name}/step-{STEPS:09d}/MANIFEST.json"))
    assert len(finals) == 2, finals
    want = {"module." + k: v for k, v in reference.items()}
    for m in finals:
        _assert_same(load(m.rsplit("/step-", 1)[0])["state"]["model"], want)


def test_lost_node_without_peer_copy_restores_from_shared(fake_cluster, reference, tmp_path):
    """As above with ``peer_copy=False``: the spare is seeded from shared storage (written at
    every checkpoint here), still bit-exact; the final checkpoint is in shared storage."""
    fake_cluster.ensure_workers(3)
    result, out = _fit(fake_cluster, tmp_path, "shared", remove_node=fake_cluster.remove_node, peer_copy=False,
                       live_recovery=False,
                       schedule=StepSchedule([AtStep(step=10, kind="preempt", node=1)]),
                       shared_storage=f"file://{tmp_path}/shared", shared_every=1)
    (f,) = result.failure_stats
    assert f.tier == "shared" and f.restored_step > 0
    _assert_same(result.value, reference)
    assert result.checkpoint.startswith(f"file://{tmp_path}/shared/shared/step-")
    check_exactly_once(str(out), STEPS)


@pytest.mark.parametrize("die", [None, (0, 2)], ids=["halt", "noticed-rank-killed"])
def test_a_notice_naming_every_node_commits_the_last_completed_step_to_disk_before_the_kill(
        fake_cluster, reference, tmp_path, die):
    """Both nodes are noticed at step 2 (a whole spot pool reclaimed, 3 s of notice) and
    drained at the deadline (their memory tiers die, their disks stay), then return. Real:
    everything; the notice comes from the injector instead of a cloud's metadata server.
    The point: no replica survives, yet the step the group had completed when it halted is on
    a node's disk before the kill (``notice_commit``), the next group restores exactly that
    step from disk (nothing lost), and the run ends bit-exact with each sample used once. With
    ``die=(0, 2)`` rank 0 (node 0's writer) waits after step 2 for the notice and SIGKILLs
    itself as soon as it arrives: node 1's copy commits, and node 0 gets it from node 1's disk. (The group trains on until the margin of
    twice its commit latency is left, the controller's decision, tested with a clock in
    tests/unit/cluster/test_cluster_controller.py; here the ranks wait after step 8 until the
    halt, so that the run does not end first.)"""
    fake_cluster.ensure_workers(2)
    sched = StepSchedule([AtStep(step=2, kind="preempt", node=n, notice_s=3.0) for n in (0, 1)]
                         + [AtStep(step=2, kind="return", node=n) for n in (0, 1)])
    result, out = _fit(fake_cluster, tmp_path, "pool", schedule=sched, die_on_notice=die,
                       hold_for_halt=None if die is not None else 8)
    recs = _records(tmp_path / "pool.jsonl")
    (d,) = [r for r in recs if r.get("what") == "pool_notice"]
    assert len([r for r in recs if r["event"] == "halt"]) == 1 or die is not None
    (nc,) = [r for r in recs if r["event"] == "notice_commit"]
    assert nc["committed"] and nc["tier"] == "local" and nc["margin_s"] >= 0, nc
    taken = [r for r in recs if r["event"] == "node_taken"]
    assert [r["node"] for r in taken] == [0, 1] and taken[0]["t"] >= nc["t"]
    (f,) = result.failure_stats
    assert f.kind == ("preempt" if die is None else "crash")
    # the step restored is the newest any rank completed: nothing lost to the preemption
    assert f.restored_step == nc["step"] and f.lost_iterations == 0, (f, nc)
    assert f.tier in ("local", "peer"), f
    (choice,) = [r for r in recs if r.get("what") == "restore" and r["step"]]
    assert choice["step"] == nc["step"] and {src for src, _ in choice["sources"].values()} <= {"local", "peer"}
    if die is not None:   # node 0's writer died: node 0 gets node 1's copy
        assert sorted(src for src, _ in choice["sources"].values()) == ["local", "peer"], choice
    assert result.final_step == STEPS
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)


@pytest.mark.parametrize("where", ["update", "mixed"])
def test_a_halt_that_comes_before_the_update_writes_the_step_before_it_and_skips_the_update(
        fake_cluster, reference, tmp_path, where):
    """Both nodes are noticed at step 10 (a whole pool, 4 s of notice; the commits of steps 4
    and 8 gave the driver a commit latency, so the group trains on to its margin) and the ranks
    wait in step 11 until the halt reaches them. ``"update"``: both ranks heard it after step
    11's backward, before its update: neither applies step 11, both nodes write step 10 from
    the notice thread, and the next group restores 10 from each node's own disk. ``"mixed"``:
    rank 1 heard it before its update (holds 10), rank 0 after its update (holds 11, halts at
    the next fetch): the group's newest step is 11, node 0's copy commits it, and node 1 gets
    it from node 0 (a peer). Either way nothing completed is lost, every sample is used once
    and the run ends bit-exact. Real: everything as in the test above."""
    fake_cluster.ensure_workers(2)
    sched = StepSchedule([AtStep(step=10, kind="preempt", node=n, notice_s=4.0) for n in (0, 1)]
                         + [AtStep(step=10, kind="return", node=n) for n in (0, 1)])
    ranks = {0: "update", 1: "update"} if where == "update" else {0: "boundary", 1: "update"}
    result, out = _fit(fake_cluster, tmp_path, "halt-" + where, schedule=sched, halt_in=(11, ranks))
    recs = _records(tmp_path / f"halt-{where}.jsonl")
    (nc,) = [r for r in recs if r["event"] == "notice_commit"]
    newest = 10 if where == "update" else 11
    assert nc["committed"] and nc["step"] == newest and nc["last_step"] == newest, nc
    (f,) = result.failure_stats
    assert f.restored_step == newest and f.lost_iterations == 0, (f, nc)
    (choice,) = [r for r in recs if r.get("what") == "restore" and r["step"]]
    want = ["local", "local"] if where == "update" else ["local", "peer"]
    assert sorted(src for src, _ in choice["sources"].values()) == want, choice
    assert result.final_step == STEPS
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)


@pytest.mark.parametrize("kept", ["in-process", "memory-tier"])
def test_a_survivor_that_failed_before_the_halt_reached_it_still_commits_the_pool_notices_step(
        fake_cluster, reference, tmp_path, kept):
    """Both nodes are noticed at step 10 (a whole pool, 6 s of notice; the commits of steps 4
    and 8 gave the driver a commit latency, so the group trains on and the halt comes seconds
    later), and rank 0 (node 0's writer) SIGKILLs itself the moment its notice arrives. Rank 1
    goes on into step 11, whose all-reduce fails with rank 0's death long before any halt: to
    rank 1 this is an ordinary failure. ``"in-process"`` (warm spares, the default): it keeps
    step 10 in its process for the next group; ``"memory-tier"`` (no warm spares): it writes
    step 10 to its node's memory tier. Both die with the pool. The driver, which received the
    notice, has the survivor's step written to its node's disk before the kill (the survivor's
    own ``save_live(durable=True)``, or the node actor's copy of its memory tier), so
    ``notice_commit`` says step 10 committed, the next group restores 10 (node 1's disk, node 0
    copies it as a peer), nothing is lost, and the run ends bit-exact with each sample used
    once. The event log shows the race was the one exercised: the group failed and no halt was
    ever sent. Real: everything as in the tests above."""
    fake_cluster.ensure_workers(2)
    sched = StepSchedule([AtStep(step=10, kind="preempt", node=n, notice_s=6.0) for n in (0, 1)]
                         + [AtStep(step=10, kind="return", node=n) for n in (0, 1)])
    name = f"race-{kept}"
    result, out = _fit(fake_cluster, tmp_path, name, schedule=sched, die_on_notice=(0, 10),
                       warm_spares=kept == "in-process")
    recs = _records(tmp_path / f"{name}.jsonl")
    (d,) = [r for r in recs if r.get("what") == "pool_notice"]
    assert d["halt_in_s"] > 0, f"the halt was not deferred, so the race was not set up: {d}"
    fail_i = next(i for i, r in enumerate(recs) if r["event"] == "failure")
    assert not [r for r in recs[:fail_i] if r["event"] == "halt"], "a halt reached the group before it failed"
    (nc,) = [r for r in recs if r["event"] == "notice_commit"]
    assert nc["last_step"] == 10 and nc["step"] == 10 and nc["tier"] == "local", nc
    assert nc["committed"] and nc["margin_s"] >= 0, nc
    if kept == "in-process":   # the survivor wrote what it kept, on the driver's request
        assert [(r["rank"], r["step"], r.get("written")) for r in recs if r["event"] == "live_durable"] == [(1, 10, 10)]
    taken = [r for r in recs if r["event"] == "node_taken"]
    assert [r["node"] for r in taken] == [0, 1] and taken[0]["t"] >= nc["t"]
    (f,) = result.failure_stats
    assert f.restored_step == 10 and f.lost_iterations == 0, (f, nc)
    (choice,) = [r for r in recs if r.get("what") == "restore" and r["step"]]
    assert choice["step"] == 10 and sorted(src for src, _ in choice["sources"].values()) == ["local", "peer"], choice
    assert result.final_step == STEPS
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)


def test_elastic_shrink_then_grow_keeps_data_exactly_once(fake_cluster, tmp_path):
    """Node 1 is lost and no replacement comes: training continues on one node (world size 1);
    when a node returns, the group grows back to 2 at the next checkpoint. Every sample is used
    exactly once per epoch across both world-size changes."""
    fake_cluster.ensure_workers(2)
    # The one-node group waits at step 16 for the driver's decision to grow (the returned node
    # starts in seconds, more on a loaded machine), then grows at its next checkpoint.
    result, out = _fit(fake_cluster, tmp_path, "elastic", remove_node=fake_cluster.remove_node,
                       steps=40, step_sleep_s=0.05, hold_small=(1, 16, str(tmp_path / "elastic.jsonl")),
                       add_node=lambda slot: fake_cluster.add_node(),
                       schedule=StepSchedule([AtStep(step=6, kind="preempt", node=1),
                                              AtStep(step=12, kind="return", node=1)]))
    assert result.world_sizes == (2, 1, 2), result.world_sizes
    assert result.failures == 1 and result.failure_stats[0].world_size == 1
    assert result.final_step == 40
    used = check_exactly_once(str(out), 40)
    assert len(used) >= 2


@pytest.fixture
def no_ray(fake_cluster):
    """This test's driver is not connected to Ray (the module's fake cluster keeps running and
    is reconnected afterwards), as in a fresh ``python train.py`` without ``RAY_ADDRESS``."""
    ray.shutdown()
    try:
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        ray.init(address=fake_cluster.cluster.address, include_dashboard=False, logging_level="WARNING")


def test_fit_on_one_machine_starts_simulated_nodes_and_every_failure_lands(no_ray, reference, tmp_path, monkeypatch):
    """``cfdist.fit(num_nodes=2, ...)`` with no Ray and no ``RAY_ADDRESS``: it starts two simulated
    Ray nodes (``ray.cluster_utils.Cluster``; each its own local-disk directory, ``/{node}``
    appended to ``storage``) and says so in the event log. A time-based schedule (a crash, then
    a preemption that removes a whole simulated node and brings a fresh one) lands in full: no
    injection is skipped. The point: the run ends bit-identical to the failure-free run, with at
    most k iterations lost per failure. Real: Ray, processes, SIGKILL, gloo, files. Faked: the
    machines (simulated nodes on this host)."""
    from cfdist.chaos import FixedInterval, Merged

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    sched = Merged((FixedInterval(3600.0, first_s=1.5, kind="crash", ranks_per_node=1, seed=1),
                    FixedInterval(3600.0, first_s=3.0, kind="preempt", seed=2)))   # one of each
    out = tmp_path / "sim-samples"
    out.mkdir()
    loop = functools.partial(train_loop, steps=STEPS, out_dir=str(out), every=EVERY, step_sleep_s=0.25)
    result = fit(loop, num_nodes=2, workers_per_node=1, storage=f"file://{tmp_path}/disk",
                 policy=Every(EVERY), preemption=sched, run_name="sim",
                 output=cfdist.OutputOptions(progress=False, event_log=str(tmp_path / "sim.jsonl")), max_failures=6)
    recs = _records(tmp_path / "sim.jsonl")
    (cl,) = [r for r in recs if r["event"] == "cluster"]
    assert cl["simulated"] and cl["nodes"] == 2 and cl["storage"] == [f"file://{tmp_path}/disk/{{node}}"]
    assert sorted(p.name for p in (tmp_path / "disk").iterdir())[:2] == ["n0", "n1"]
    assert [r["kind"] for r in recs if r["event"] == "failure" and r.get("injected")] == ["crash", "preempt"]
    assert result.skipped_injections == () and result.failures >= 2
    assert all(n <= EVERY for n in result.lost_iterations), result.lost_iterations
    assert all(s is not None and s > 0 for s in result.recovery_seconds)
    assert set(result.world_sizes) == {2}
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)
    assert not ray.is_initialized()   # fit stopped the nodes it started


@pytest.mark.parametrize("kind", ["crash", "preempt"])
def test_a_recovered_failure_is_one_console_line_and_its_details_are_in_the_rank_logs(fake_cluster, tmp_path,
                                                                                     capfd, kind):
    """Rank 1's process is SIGKILLed at step 10 (crash), or node 0 - rank 0 and the rendezvous
    store - is removed (preempt), with the progress display on. Real: Ray's log forwarding (Ray
    copies each worker's stderr into its ``worker-*.err`` file, and the driver prints what lands
    there), the survivors' gloo and TCPStore errors and tracebacks. The point: the driver's
    console has exactly one line for the recovery (what failed, where it resumed) and none of
    the ranks' tracebacks or C++ stack frames, not even in Ray's copies of the processes'
    stderr; the log directory, named by the result and by the console's last line, holds the
    surviving rank's traceback."""
    import ray._private.worker

    if kind == "crash":
        fake_cluster.ensure_workers(2)
        where, extra = "rank 1", {"schedule": StepSchedule([AtStep(step=10, kind="crash", rank=1)])}
    else:
        fake_cluster.ensure_workers(3)   # two in the group, one to replace node 0
        where, extra = "node 0", {"schedule": StepSchedule([AtStep(step=10, kind="preempt", node=0)]),
                                  "remove_node": fake_cluster.remove_node}
    result, _ = _fit(fake_cluster, tmp_path, "quiet", progress=True, **extra)
    assert result.failures == 1 and result.final_step == STEPS
    console = capfd.readouterr()
    lines = [ln for ln in console.err.splitlines() if ln.startswith("cfdist:")]
    recovery = [ln for ln in lines if "resumed from" in ln]
    assert len(recovery) == 1 and re.fullmatch(
        rf"cfdist: {kind} of {where} at step \d+ \(injected\): resumed from step \d+ \((live|memory|peer)\)",
        recovery[0]), lines
    assert lines[-1] == f"cfdist: 1 failure(s); details in the rank logs: {result.log_dir}", lines
    noise = ("Traceback", "frame #", "TCPStore", "Connection reset", "Unhandled error", "(RankWorker")
    assert not [n for n in noise if n in console.out + console.err], console.out + console.err

    assert result.log_dir == str(tmp_path / f"logs-{result.log_dir[-8:]}")
    files = sorted(pathlib.Path(result.log_dir).glob("*.log"))   # ranks' and spares', node actors'
    logs = {int(p.stem.rsplit("-", 1)[1]): p.read_text() for p in files}
    assert sum(p.name.startswith("rank-worker-") for p in files) >= 2, files
    assert sum(p.name.startswith("node-actor-") for p in files) >= 2, files
    failed = [text for text in logs.values() if "the training function failed" in text]
    assert failed and "Traceback" in failed[0], logs
    # what Ray would forward to the console: its copies of the ranks' stderr hold none of it
    ray_logs = ray._private.worker._global_node.get_logs_dir_path()
    copies = {pid: glob.glob(f"{ray_logs}/worker-*-{pid}.err") for pid in logs}
    assert all(copies.values()), (ray_logs, copies)
    for pid, paths in copies.items():
        text = "".join(open(p).read() for p in paths)
        assert not [n for n in noise if n in text], f"Ray's log of process {pid}:\n{text[-3000:]}"


# ---- killing the other processes: the node actor, the driver ------------------------------------

def _newest_step(out) -> int:
    """Rank 0's newest finished step in any attempt's log under ``out`` (0 if none yet)."""
    steps = [0]
    for p in out.glob("a*-r0.jsonl") if out.exists() else []:
        steps += [json.loads(line).get("step", 0) for line in p.read_text().splitlines() if line.strip()]
    return max(steps)


def test_killed_node_actor_is_replaced_and_the_run_completes(fake_cluster, reference, tmp_path):
    """A node's ``NodeCheckpointer`` process is SIGKILLed mid-run (its node stays up): the
    writer rank on that node (rank 0) stops at its next step instead of training on without
    checkpoints (the failed persist is in the event log as ``checkpoint_failed``), the controller starts a new node actor on the same node (the node is not
    excluded: the group stays at 2 nodes), restores the newest commit and finishes bit-exact,
    every sample once per epoch. The failure's message in the event log names the cause."""
    fake_cluster.ensure_workers(2)
    victim = {}

    def kill_when_running():
        wait_for(lambda: _newest_step(tmp_path / "nodeactor-samples") >= 9, timeout_s=180)
        pids = fake_cluster.pids_titled("NodeCheckpointer")
        name = sorted(n for n, p in pids.items() if p)[0]   # rank 0's node (nodes are taken by name)
        victim.update(node=name, pids=pids[name])
        for pid in pids[name]:
            os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_running, daemon=True)
    killer.start()
    result, out = _fit(fake_cluster, tmp_path, "nodeactor")
    killer.join(timeout=10)
    assert victim, "the node actor was never killed"
    assert result.failures == 1 and result.world_sizes == (2, 2)
    events = _records(tmp_path / "nodeactor.jsonl")
    (failure,) = [r for r in events if r.get("event") == "failure"]
    assert "checkpoint actor died" in failure["message"]
    failed = [r for r in events if r.get("event") == "checkpoint_failed"]   # the persist error, logged
    assert failed and "NodeCheckpointer" in failed[0]["error"] and failed[0]["t"] <= failure["t"]
    assert result.final_step == STEPS
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)
    assert not set(victim["pids"]) & set(fake_cluster.pids_titled("NodeCheckpointer")[victim["node"]])


_DRIVER = """
import functools, json, sys
import ray.cloudpickle
import cluster_loops
from cfdist import Every
from cfdist.api import fit
ray.cloudpickle.register_pickle_by_value(cluster_loops)
a = json.loads(sys.argv[1])
loop = functools.partial(cluster_loops.train_loop, steps=a["steps"], out_dir=a["out"], every=a["every"],
                         step_sleep_s=0.1)
fit(loop, num_nodes=2, workers_per_node=1, storage=a["storage"], policy=Every(a["every"]), run_name=a["name"],
    progress=False, event_log=a["log"], max_failures=3, ray_address=a["address"])
"""


def test_rerun_after_the_driver_was_killed_continues_from_the_newest_commit(fake_cluster, reference, tmp_path):
    """``cfdist.fit`` runs in a driver subprocess attached to the cluster and is SIGKILLed
    mid-run (Ray then kills the run's actors). Running ``cfdist.fit`` again with the same
    ``run_name`` and storage restores the newest step committed on the nodes' local disks, not
    step 0, and ends bit-exact; across both drivers every sample is used once per epoch; the
    memory tiers the killed run left in /dev/shm are freed by the new run's node actors."""
    import glob
    import shutil
    import subprocess
    import sys

    from cfdist.checkpoint.discovery import committed_steps
    from cfdist.storage import open_storage

    fake_cluster.ensure_workers(2)
    shm_before = set(glob.glob("/dev/shm/cfdist-driver-*"))   # another run's leftovers are not this test's
    first = tmp_path / "first-samples"
    first.mkdir()
    storage = f"file://{tmp_path}/{{node}}/local"
    args = dict(steps=STEPS, out=str(first), every=EVERY, storage=storage, name="driver",
                log=str(tmp_path / "first.jsonl"), address=fake_cluster.cluster.address)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([cluster_loops.__file__.rsplit("/", 1)[0],
                                                         os.environ.get("PYTHONPATH", "")]))
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, json.dumps(args)], env=env)
    try:
        wait_for(lambda: _newest_step(first) >= 10 or driver.poll() is not None, timeout_s=240)
        assert driver.poll() is None, "the first driver ended before it could be killed"
        driver.send_signal(signal.SIGKILL)
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.wait(timeout=30)
    wait_for(lambda: not any(fake_cluster.pids_titled("NodeCheckpointer").values()), timeout_s=60)
    names = [fake_cluster.names[nid] for nid in fake_cluster.nodes]
    newest = max(max(committed_steps(open_storage(f"file://{tmp_path}/{n}/local/driver")), default=0)
                 for n in names)
    assert newest >= EVERY
    left = set(glob.glob("/dev/shm/cfdist-driver-*")) - shm_before
    assert left, "the killed run left no memory tier to free (test premise)"

    result, out = _fit(fake_cluster, tmp_path, "driver")
    first_record = json.loads((out / "a0-r0.jsonl").read_text().splitlines()[0])
    assert first_record["restored"] == newest, f"re-run restored {first_record['restored']}, newest commit {newest}"
    assert result.failures == 0 and result.final_step == STEPS
    _assert_same(result.value, reference)
    for p in out.glob("a*-r*.jsonl"):              # the re-run's attempts come after the first run's
        a, r = p.name[1:-6].split("-r")
        p.rename(out / f"a{100 + int(a)}-r{r}.jsonl")
    for p in first.glob("a*-r*.jsonl"):
        shutil.copy(p, out / p.name)
    check_exactly_once(str(out), STEPS)
    assert not left & set(glob.glob("/dev/shm/cfdist-driver-*")), "the re-run did not free the killed run's memory tier"


# ---- the shared tier uploaded in slices by every node's actor ----------------------------------------

def _loaded(url, step, **opts):
    from cfdist.checkpoint.discovery import load_verified
    from cfdist.storage import open_storages

    return load_verified(open_storages(url, **opts), step)


def test_shared_upload_is_sliced_between_the_node_actors(fake_cluster, tmp_path):
    """A 2-node fit with a shared tier at every checkpoint (``shared_writers="all"``, the
    default): the final shared checkpoint has shard files written by both node actors (the
    manifest's ``writer`` fields), and loads bit-exact equal to node 0's full node-local copy
    of that step, which is what node 0 alone would have uploaded (tensors, RNG, data state)."""
    fake_cluster.ensure_workers(2)
    result, out = _fit(fake_cluster, tmp_path, "sliced", shared_storage=f"file://{tmp_path}/shared", shared_every=1)
    assert result.failures == 0 and result.final_step == STEPS
    check_exactly_once(str(out), STEPS)
    m, tensors = _loaded(f"file://{tmp_path}/shared/sliced", STEPS)
    assert {sh["writer"] for sh in m["shards"]} == {0, 1} and m["slicing"]["writers"] == 2
    copies = [_loaded(f"file://{d}/sliced", STEPS) for d in sorted(glob.glob(str(tmp_path / "*" / "local")))]
    assert len(copies) == 2
    storage_fields = {"format", "step", "time", "bytes", "roots", "shards", "tensors", "manifest_xxh3"}
    node0 = [(cm, ct) for cm, ct in copies if all(m.get(k) == v for k, v in cm.items() if k not in storage_fields)]
    assert node0, "the shared checkpoint's per-rank state (RNG, data, late state) must be node 0's"
    cm, ct = node0[0]
    assert ct.keys() == tensors.keys() and all(torch.equal(ct[k], tensors[k]) for k in ct)
    commits = [r for r in _records(tmp_path / "sliced.jsonl") if r.get("event") == "checkpoint_committed"
               and r.get("tier") == "shared"]
    assert EVERY in {r["step"] for r in commits}


@pytest.mark.parametrize("rank", [1, 0], ids=["rank1", "rank0-node0-writer"])
def test_a_killed_rank_recovered_live_with_shared_uploads_in_slices_commits_its_next_checkpoint_sliced(
        fake_cluster, reference, tmp_path, rank):
    """``writers="all"`` under ``cfdist.fit``: a 2-node run whose every checkpoint goes to the
    shared tier in slices, one per node, written from each node's own copy
    (``shared_writers="all"``, the default; ``ctx.checkpointer`` decides the ranks' writers
    itself, so this is the job's every-node-writes-a-slice path). A rank's process SIGKILLs
    itself in the forward of step 10 (rank 1, or rank 0: node 0's writer, whose node actor
    coordinates the slices, and the host of the group's store). The survivor keeps step 9 in
    process, a step on no storage, and the next group restores it over the group (tier
    ``live``, 1 step lost). The point: the slicing is re-formed for the new group after that
    in-process restore, so the first regular checkpoint after it (12) commits on the shared
    tier sliced between both nodes (two writers, both nodes named; its manifest, its shards),
    loads bit-exact equal to node 0's own copy of that step and continues the restore's
    lineage; so does every later one, and the final one equals the failure-free run; data
    exactly once."""
    fake_cluster.ensure_workers(2)
    name = f"slk{rank}"
    shared = f"file://{tmp_path}/shared/{name}"
    result, out = _fit(fake_cluster, tmp_path, name, shared_storage=f"file://{tmp_path}/shared", shared_every=1,
                       keep=STEPS, kill_in=(rank, 10, "forward"))
    assert result.failures == 1, result.failure_stats
    (f,) = result.failure_stats
    assert f.kind == "crash" and f.tier == "live" and f.restored_step == 9 and f.lost_iterations <= 1, f
    recs = _records(tmp_path / f"{name}.jsonl")
    fail_i = next(i for i, r in enumerate(recs) if r["event"] == "failure")
    assert [r["tier"] for r in recs[fail_i:] if r["event"] == "restored"] == ["live"]
    assert result.world_sizes == (2, 2) and result.final_step == STEPS
    _assert_same(result.value, reference)
    check_exactly_once(str(out), STEPS)

    groups = [r["nodes"] for r in recs if r.get("what") == "group_size"]
    assert len(groups) == 2 and sorted(groups[0]) == sorted(groups[1]), groups
    # the shared commits in the event log (the final one is flushed at the run's end: the
    # run's last drain of the node actors' records, after it, logs it)
    shared_commits = {r["step"]: r for r in recs if r["event"] == "checkpoint_committed" and r["tier"] == "shared"}
    assert sorted(shared_commits) == [4, 8, 12, 16, 20, STEPS], sorted(shared_commits)
    failed_at = recs[fail_i]["t"]
    for s, c in shared_commits.items():
        if s <= f.restored_step and c["t"] > failed_at:
            # a step whose sliced upload was still in flight when the attempt ended (8, when the
            # uploads are slow): the peer's slice of the old attempt is refused, and node 0
            # uploads the step whole, as after any peer failure; sliced if it finished first
            assert c["writers"] == 2 or c["writer_nodes"] == [groups[0][0]], (s, c)
        else:
            assert c["writers"] == 2 and sorted(c["writer_nodes"]) == sorted(groups[1]), (s, c)
    for s in (12, 16, 20, STEPS):
        m, tensors = _loaded(shared, s)
        assert m["slicing"]["writers"] == 2 and sorted(m["slicing"]["nodes"]) == sorted(groups[1]), (s, m["slicing"])
        assert sorted({sh["writer"] for sh in m["shards"]}) == [0, 1], (s, m["shards"])
        _, own = _loaded(f"file://{tmp_path}/{m['slicing']['nodes'][0]}/local/{name}", s)
        assert own.keys() == tensors.keys() and all(torch.equal(own[k], tensors[k]) for k in own), s
        assert m["lineage"]["restores"][-1] == f.restored_step, (s, m["lineage"])   # it continues the live restore
    _assert_same(load(shared)["state"]["model"], {"module." + k: v for k, v in reference.items()})


@pytest.mark.heavy
def test_three_node_fit_with_shared_writers_2_uploads_each_shared_step_from_two_nodes(fake_cluster, tmp_path):
    """``cfdist.fit`` on 3 fake nodes with a shared tier at every checkpoint and
    ``shared_writers=2`` (real: Ray, 3 rank processes, gloo, node actors, files). The points:
    every sliced shared commit in the event log was written by exactly 2 distinct nodes of the
    group (``writers``, ``writer_nodes``); the final shared checkpoint's manifest names the
    same 2 nodes, has shards of writers 0 and 1 only, and loads bit-exact equal to node 0's
    node-local copy and to the run's final parameters; every sample once per epoch."""
    fake_cluster.ensure_workers(3)
    result, out = _fit(fake_cluster, tmp_path, "sw2", num_nodes=3, shared_storage=f"file://{tmp_path}/shared",
                       shared_every=1, shared_writers=2)
    assert result.failures == 0 and result.final_step == STEPS
    check_exactly_once(str(out), STEPS)
    names = {fake_cluster.names[nid] for nid in fake_cluster.nodes}
    commits = [r for r in _records(tmp_path / "sw2.jsonl") if r.get("event") == "checkpoint_committed"
               and r.get("tier") == "shared"]
    sliced = [r for r in commits if r["writers"] > 1]
    assert sliced and all(r["writers"] == 2 and len(set(r["writer_nodes"])) == 2 and set(r["writer_nodes"]) <= names
                          for r in sliced), commits
    m, tensors = _loaded(f"file://{tmp_path}/shared/sw2", STEPS)
    assert m["slicing"]["writers"] == 2 and len(set(m["slicing"]["nodes"])) == 2 and set(m["slicing"]["nodes"]) <= names
    assert sorted({sh["writer"] for sh in m["shards"]}) == [0, 1]
    node0 = m["slicing"]["nodes"][0]
    _, local = _loaded(f"file://{tmp_path}/{node0}/local/sw2", STEPS)
    assert local.keys() == tensors.keys() and all(torch.equal(local[k], tensors[k]) for k in local)
    _assert_same(load(f"file://{tmp_path}/shared/sw2")["state"]["model"],
                 {"module." + k: v for k, v in result.value.items()})


def _bn_state():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 256))
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _wait_event(actor, event, step, timeout_s=60.0):
    got = []

    def seen():
        got.extend(ray.get(actor.drain_events.remote()))
        return any(e["event"] == event and e["step"] == step for e in got)

    wait_for(seen, timeout_s)
    return got


@pytest.mark.parametrize("where", ["file", "s3"])
def test_a_failed_or_dead_peer_leaves_the_step_uncommitted_and_node_0_uploads_whole(fake_cluster, tmp_path, where,
                                                                                   request):
    """Two NodeCheckpointer actors (Ray actors on the fake cluster's nodes) whose node-local
    tiers hold the same steps written by a real Checkpointer; node B's copy has other
    BatchNorm statistics (as a replica's would), so node 0 (A) writes those itself.

    1. a sliced upload: both actors write a slice, the result is bit-exact A's copy;
    2. B's shared storage made to fail (``cfdist.testing.faulty``, injected into the live actor):
       that step is not committed on the shared tier, the previous one still loads, and A
       uploads the step whole when flushed;
    3. B's actor SIGKILLed mid-upload (new attempt, B named as peer again; its writes slowed
       so the kill lands while its shard file is being written): not committed, the previous
       step stays, then uploaded whole (local shared tier only: an S3 upload shows no partial
       object to time the kill on).

    The shared tier is a local directory, or a bucket on the local S3 server (moto), where the
    slices sit under the step's final prefix until the manifest commits them."""
    from cfdist.cluster.config import FitConfig
    from cfdist.cluster.node_actor import NodeCheckpointer

    m, opt = _bn_state()
    mb, optb = _bn_state()
    cks = [cfdist.Checkpointer({"model": mm, "optim": oo}, f"file://{tmp_path}/{n}/r", cfdist.Every(1), keep=5)
           for n, mm, oo in (("A", m, opt), ("B", mb, optb))]

    def step(i):
        for (mm, oo), ck in zip(((m, opt), (mb, optb)), cks):
            mm(torch.randn(16, 256, generator=torch.Generator().manual_seed(i))).square().mean().backward()
            if mm is mb:
                mm[1].running_mean.add_(1.0)   # another replica's statistics; parameters stay equal
            ck.step(oo)
            oo.zero_grad()
            ck.wait()

    for i in range(3):
        step(i)
    if where == "s3":
        pytest.importorskip("s3fs")
        base, opts = request.getfixturevalue("s3_url"), request.getfixturevalue("s3_storage_options")
    else:
        base, opts = f"file://{tmp_path}/shared", {}
    cfg = FitConfig(storage=f"file://{tmp_path}/{{node}}", shared_storage=base, storage_options=opts,
                    run_name="r", memory_tier=False, shared_every=1, keep=5, shared_slice_timeout_s=60)
    remote = ray.remote(NodeCheckpointer)
    a, b = (remote.options(num_cpus=0).remote(config=cfg, run_id="sl", node_id=n * 16, node_name=n) for n in "AB")
    ray.get([a.begin_attempt.remote(1, shared_writer=True, peers=[b]), b.begin_attempt.remote(1, shared_writer=False)])
    shared = f"{base}/r"
    from cfdist.checkpoint.reader import is_committed
    from cfdist.storage import open_storages

    def committed(step):
        return is_committed(open_storages(shared, **opts)[0], step)

    try:
        assert ray.get(a.flush_shared.remote(2)) == 2
        sm, st = _loaded(shared, 2, **opts)
        am, at = _loaded(f"file://{tmp_path}/A/r", 2)
        assert {sh["writer"] for sh in sm["shards"]} == {0, 1} and sm["split"], "both nodes write, a tensor is cut"
        assert at.keys() == st.keys() and all(torch.equal(at[k], st[k]) for k in at)
        bn = [k for k in sm["tensors"] if "running_mean" in k]
        assert bn and all(sm["shards"][sm["tensors"][k]["shard"]]["writer"] == 0 for k in bn)
        assert any(e["event"] == "shared_slice_written" for e in ray.get(b.drain_events.remote()))

        def break_shared(self):
            from cfdist.testing import faulty
            self.shared = [faulty(self.shared[0], fail_after_bytes=0)]

        ray.get(b.__ray_call__.remote(break_shared))
        ray.get(a.__ray_call__.remote(lambda self: self._want_shared(3)))
        _wait_event(a, "shared_slices_failed", 3)
        assert not committed(3)
        assert not [n for n in open_storages(shared, **opts)[0].listdir("") if n.startswith("step-000000003")], \
            "its slices are removed"
        prev = _loaded(shared, 2, **opts)[1]
        assert all(torch.equal(at[k], prev[k]) for k in at), "the previous one stays"
        assert ray.get(a.flush_shared.remote(3)) == 3   # whole, by A alone
        sm3, st3 = _loaded(shared, 3, **opts)
        rm, = [k for k in st3 if k.endswith("running_mean")]
        assert "slicing" not in sm3 and torch.equal(st3[rm], m[1].running_mean)

        if where == "s3":
            return
        step(3)   # B's actor killed mid-upload: its storage slowed, killed once its shard file appears
        ray.get(a.begin_attempt.remote(2, shared_writer=True, peers=[b]))

        def slow_shared(self):
            from cfdist.testing import throttle
            self.shared = [throttle(self.shared[0].inner, bytes_per_s=200_000)]

        ray.get(b.__ray_call__.remote(slow_shared))
        ray.get(a.__ray_call__.remote(lambda self: self._want_shared(4)))
        wait_for(lambda: glob.glob(str(tmp_path / "shared" / "r" / "step-000000004.tmp-*" / "shard-00001-*")))
        ray.kill(b)
        _wait_event(a, "shared_slices_failed", 4)
        assert not committed(4) and committed(3)
        assert ray.get(a.flush_shared.remote(4)) == 4 and "slicing" not in _loaded(shared, 4, **opts)[0]
        st4 = _loaded(shared, 4, **opts)[1]
        assert all(torch.equal(st4[k], v) for k, v in _loaded(f"file://{tmp_path}/A/r", 4)[1].items())
    finally:
        for ck in cks:
            ck.close()
        ray.get(a.close.remote())
        ray.kill(a)


def test_shared_writers_n_uploads_from_exactly_n_nodes(fake_cluster, tmp_path):
    """Three NodeCheckpointer actors (Ray actors on the fake cluster) with
    ``shared_writers=2``, whose node-local tiers hold the same steps written by real
    Checkpointers (node C's with other BatchNorm statistics, as a replica's would be). Faked:
    the training (three Checkpointers on the driver stand in for the nodes' writer ranks).

    1. node A (node 0) flushes step 2: the shared checkpoint has exactly 2 writers, A and B
       (the manifest's ``slicing.nodes``, its shards' ``writer`` fields, the actors' own
       ``shared_slice_written`` events: none from C), and loads bit-exact equal to A's copy;
    2. B's tier lacks step 3 (its writer stopped at step 2): the helper is C, the next node
       holding it; C's different BatchNorm statistics are A's, written by A; bit-exact again.
    """
    from cfdist.checkpoint.reader import is_committed
    from cfdist.cluster.config import FitConfig
    from cfdist.cluster.node_actor import NodeCheckpointer
    from cfdist.storage import open_storages

    states = {n: _bn_state() for n in "ABC"}
    cks = {n: cfdist.Checkpointer({"model": m, "optim": o}, f"file://{tmp_path}/{n}/r", cfdist.Every(1), keep=5)
           for n, (m, o) in states.items()}

    def step(i, nodes):
        for n in nodes:
            m, o = states[n]
            m(torch.randn(16, 256, generator=torch.Generator().manual_seed(i))).square().mean().backward()
            if n == "C":
                m[1].running_mean.add_(1.0)   # another replica's statistics; parameters stay equal
            cks[n].step(o)
            o.zero_grad()
            cks[n].wait()

    for i in range(2):
        step(i, "ABC")
    cfg = FitConfig(storage=f"file://{tmp_path}/{{node}}", shared_storage=f"file://{tmp_path}/shared",
                    run_name="r", memory_tier=False, shared_every=1, keep=5, shared_slice_timeout_s=60,
                    shared_writers=2)
    remote = ray.remote(NodeCheckpointer)
    a, b, c = (remote.options(num_cpus=0).remote(config=cfg, run_id="sw", node_id=n * 16, node_name=n) for n in "ABC")
    shared = f"file://{tmp_path}/shared/r"
    try:
        ray.get([a.begin_attempt.remote(1, shared_writer=True, peers=[b, c]),
                 b.begin_attempt.remote(1, shared_writer=False), c.begin_attempt.remote(1, shared_writer=False)])
        assert ray.get(a.flush_shared.remote(2)) == 2
        sm, st = _loaded(shared, 2)
        assert sm["slicing"]["writers"] == 2 and sm["slicing"]["nodes"] == ["A", "B"]
        assert sorted({sh["writer"] for sh in sm["shards"]}) == [0, 1] and sm["split"]
        events = {n: ray.get(x.drain_events.remote()) for n, x in zip("ABC", (a, b, c))}
        wrote = {n: [e["writer"] for e in evs if e["event"] == "shared_slice_written" and e["step"] == 2]
                 for n, evs in events.items()}
        assert wrote == {"A": [0], "B": [1], "C": []}, wrote
        (commit,) = [e for e in events["A"] if e["event"] == "checkpoint_committed" and e["tier"] == "shared"]
        assert commit["writers"] == 2 and commit["nodes"] == ["A", "B"]
        at = _loaded(f"file://{tmp_path}/A/r", 2)[1]
        assert at.keys() == st.keys() and all(torch.equal(at[k], st[k]) for k in at)

        cks["B"].close()
        step(2, "AC")
        assert ray.get(a.flush_shared.remote(3)) == 3
        sm3, st3 = _loaded(shared, 3)
        assert sm3["slicing"]["nodes"] == ["A", "C"] and sorted({sh["writer"] for sh in sm3["shards"]}) == [0, 1]
        bn = [k for k in sm3["tensors"] if "running_mean" in k]
        assert bn and all(sm3["shards"][sm3["tensors"][k]["shard"]]["writer"] == 0 for k in bn)
        at3 = _loaded(f"file://{tmp_path}/A/r", 3)[1]
        assert at3.keys() == st3.keys() and all(torch.equal(at3[k], st3[k]) for k in at3)
        assert is_committed(open_storages(shared)[0], 2)
    finally:
        for ck in cks.values():
            ck.close()
        ray.get([x.close.remote() for x in (a, b, c)])
        for x in (a, b, c):
            ray.kill(x)



def test_a_node_lost_at_the_last_step_loses_nothing(fake_cluster, reference, tmp_path):
    """Node 1 is lost after both ranks' last step, while rank 0 is at the end of its run: its
    final checkpoint waits for rank 1's RNG states of that step, which rank 1 (holding in its
    loop until the driver logged the failure) never publishes. The driver tells rank 0 a peer
    died; rank 0 gives that persist up, its run's end fails, it keeps its live state of the
    last step in process, and the next group (one node, re-formed around it) restores it:
    nothing is lost. (Before the driver made rank 0 wait for that outcome, a rank that kept its
    state within milliseconds was not waited for, was killed instead of recycled, and the run
    rolled back 4 iterations.) (Before, nothing
    was written after the loop and the run rolled back to the last checkpoint, 4 iterations; a
    ``cfdist experiment`` run failed its at-most-one-step check that way.)"""
    fake_cluster.ensure_workers(2)
    result, out = _fit(fake_cluster, tmp_path, "end", hold_end=True,
                       schedule=StepSchedule([AtStep(step=STEPS, kind="preempt", node=1)]))
    assert result.failures == 1 and result.final_step == STEPS
    (f,) = result.failure_stats
    # from rank 0's process ("live"), or "memory" when its final checkpoint committed after all
    assert f.kind == "preempt" and f.restored_step == STEPS and f.lost_iterations == 0 and f.tier in ("live", "memory"), f
    check_exactly_once(str(out), STEPS)


@ray.remote
class _DrainEvents:
    """A node actor's ``drain_events``: one commit record, at once or (``hold``) only once
    released, as a lost node's actor answers only when Ray gives up on it."""

    def __init__(self, step: int, hold: bool):
        self.rec = {"t": float(step), "event": "checkpoint_committed", "step": step, "tier": "local"}
        self.go = threading.Event()
        if not hold:
            self.go.set()

    def drain_events(self):
        self.go.wait()
        rec, self.rec = self.rec, None
        return [rec] if rec else []

    def release(self):
        self.go.set()

    def ping(self):
        return True


def test_drain_commits_waits_once_for_an_actor_that_does_not_answer_and_not_after_the_group_failed(
        fake_cluster, tmp_path, monkeypatch):
    """Real Ray actors standing for two nodes' checkpoint actors; one answers only when
    released. A poll asks both and waits a moment for the answers; the next polls do not wait
    on the silent one again (its answer is only looked at), and once the group failed no poll
    waits at all (a lost node's actor held every poll for 1 s, the failure's detection too).
    Its answer, once given, arrives at a later poll."""
    from cfdist.cluster import ray_backend
    from cfdist.cluster.config import FitConfig

    be = ray_backend.RayBackend(FitConfig(storage=(f"file://{tmp_path}/x",), num_nodes=2, progress=False),
                                run_id="drain", train_fn=None, policy=None)
    silent, quick = _DrainEvents.options(max_concurrency=2).remote(7, True), \
        _DrainEvents.options(max_concurrency=2).remote(8, False)
    ray.get([silent.ping.remote(), quick.ping.remote()], timeout=60)   # both actors up
    be.actors = {"silent": silent, "quick": quick}
    waits = []
    real_wait = ray.wait

    def spy(refs, *args, **kwargs):
        waits.append((list(refs), kwargs.get("timeout")))
        return real_wait(refs, *args, **kwargs)

    monkeypatch.setattr(ray_backend.ray, "wait", spy)
    got, deadline = be.drain_commits(), time.monotonic() + 60
    held = be._draining["silent"][1]   # asked once, not answered
    while not got:   # the quick actor's answer (a loaded machine may miss one poll's moment)
        assert time.monotonic() < deadline, "the answering actor's commit record never arrived"
        got = be.drain_commits()
    assert [r["step"] for r in got] == [8] and be._draining["silent"][1] is held
    assert all(t == 0 for refs, t in waits[1:] if held in refs), waits   # never waited for again
    waits.clear()
    assert be.drain_commits() == []
    assert waits and all(t == 0 for refs, t in waits if held in refs), waits

    class Failed:   # the group's poll saw a rank's error
        _errors = ["rank 1 died"]
        _gone: set = set()

    be.group = Failed()
    waits.clear()
    assert be.drain_commits() == []
    assert waits and all(t == 0 for _, t in waits), waits
    ray.get(silent.release.remote())
    ray.wait([held], timeout=60)
    assert [r["step"] for r in be.drain_commits()] == [7], "the silent actor's answer was not read once given"


@ray.remote(num_cpus=0, max_concurrency=2)
class _Gate:
    """Opened by the test; a staging copy waits for it (a copy that is still running). Two
    threads: ``open`` must run while ``wait`` blocks (with one, an ``open`` sent after the
    copy's ``wait`` had started ran only once the wait timed out, 120 s later)."""

    def __init__(self):
        self._open = threading.Event()

    def open(self) -> None:
        self._open.set()

    def wait(self) -> bool:
        return self._open.wait(120)


@ray.remote(num_cpus=0)
def _copy_when_open(gate, src: str, dst: str, step: int, fail: bool) -> dict:
    """What ``NodeCheckpointer.stage`` does (freeze a peer's committed step, commit it here),
    once the gate opens."""
    from cfdist.cluster import transfer
    from cfdist.storage import open_storages

    if not ray.get(gate.wait.remote()):
        raise TimeoutError("the test did not open the gate within 120 s")
    if fail:
        raise ConnectionError("the peer's node actor died during the copy")
    frozen = transfer.freeze(open_storages(src), step)
    transfer.commit_frozen(frozen, step, open_storages(dst), source="peer", keep=2)
    return {"bytes": transfer.nbytes(frozen), "seconds": 0.0}


@pytest.mark.parametrize("fail", [False, True], ids=["copied", "copy-failed"])
def test_restore_waits_for_the_copy_of_the_step_to_its_node_that_runs_beside_the_start(fake_cluster, tmp_path,
                                                                                        fail):
    """The driver no longer waits for the copy of the restore step to a node that lacks it
    (``RayBackend.stage``): the group starts beside it, and ``ckpt.restore()`` on that node
    waits for the copy (the step is not there before), then loads it; a copy that failed
    makes the rank raise, naming the step, instead of restoring something else."""
    from cfdist.cluster.context import RankInfo, TrainContext

    torch.manual_seed(0)
    src, dst = f"file://{tmp_path}/peer", f"file://{tmp_path}/here"
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = cfdist.Checkpointer({"model": model, "optim": opt}, src, Every(3))
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        ck.step(opt)
        opt.zero_grad()
    ck.close()
    want = {k: v.clone() for k, v in model.state_dict().items()}

    gate = _Gate.remote()
    staged = _copy_when_open.remote(gate, src, dst, 3, fail)
    info = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1, attempt=1)
    ctx = TrainContext(info=info, device=torch.device("cpu"), tiers={"memory": [dst]}, node_actor=None,
                       policy=Every(3), keep=2, restore_step=3, restore_tier="peer", staged=[staged])
    fresh = torch.nn.Linear(4, 2)
    ck2 = ctx.checkpointer({"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=0.1)})
    out: dict = {}

    def restore():
        try:
            out["step"] = ck2.restore()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e

    t = threading.Thread(target=restore, daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive(), f"restore() returned before the copy to its node ran: {out}"
    assert not os.path.exists(f"{tmp_path}/here/step-000000003")
    ray.get(gate.open.remote())
    t.join(60)
    assert not t.is_alive(), "restore() did not return after the copy finished"
    if fail:
        assert "step" not in out
        assert isinstance(out["error"], RuntimeError) and "step 3 could not be copied" in str(out["error"])
        assert "ConnectionError" in str(out["error"])
    else:
        assert out == {"step": 3}
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
        rec = [r for r in ctx._drain() if r["type"] == "restored"]
        assert rec and rec[0]["step"] == 3 and rec[0]["stage_wait_s"] > 0
    ck2.close()


def test_holdings_after_a_failure_reads_the_answers_lost_nodes_asked_for_until_the_tiers_change(fake_cluster,
                                                                                                  tmp_path):
    """After a failure ``RayBackend.lost_nodes`` sends the node actors' ``holdings`` question
    beside its probes, and the recovery's ``holdings()`` reads those answers (one round trip
    less); a durable commit (or a stage) changes the tiers, so after one ``holdings()`` asks
    again. Real node actors on the fake cluster's nodes, real checkpoints on their local disks."""
    from cfdist.cluster.config import FitConfig
    from cfdist.cluster.ray_backend import RayBackend

    cfg = FitConfig(storage=f"file://{tmp_path}/{{node}}", run_name="eh", memory_tier=False, num_nodes=2)
    backend = RayBackend(cfg, run_id="eh", train_fn=None, policy=None)
    try:
        nodes = backend.usable_nodes()[:2]
        backend._ensure_actors(nodes)
        url = cfg.local_urls(nodes[0].name)[0]
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ck = cfdist.Checkpointer({"model": model, "optim": opt}, url, Every(2), keep=5)

        def steps(n):
            for _ in range(n):
                model(torch.ones(1, 2)).sum().backward()
                ck.step(opt)
                opt.zero_grad()
            ck.wait()

        def held():
            return {h.node_id: h.local for h in backend.holdings()}

        steps(2)
        assert backend.lost_nodes(nodes) == set()
        steps(2)   # step 4 commits after the question was sent
        assert held()[nodes[0].node_id] == (2,)   # the answer lost_nodes asked for
        assert held()[nodes[0].node_id] == (2, 4)   # read once: asked again
        assert backend.lost_nodes(nodes) == set()
        steps(2)
        backend.commit_durable(nodes, time.time() + 30)   # the tiers change: the early answers are dropped
        assert held()[nodes[0].node_id] == (2, 4, 6)
        ck.close()
    finally:
        backend.close()


def test_every_process_of_a_fake_node_runs_at_the_workers_niceness_from_its_start(fake_cluster):
    """A fake node's raylet, its agents and every process it starts (each thread of each) run at
    Ray's worker niceness, 15, from their start; an actor on it stays at 15 (Ray's own renice
    adds nothing on top); the thread that added the node keeps its niceness, and
    ``RAY_worker_niceness`` is as it was. Before, a process started on one fake node ran its
    first ~0.7 CPU-seconds at nice 0 and took the CPU from the other nodes' ranks (nice 15)."""
    from ray._private import ray_constants
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cfdist.cluster.local_cluster import descendants

    me = threading.get_native_id()
    nice_before, env_before = os.getpriority(os.PRIO_PROCESS, me), os.environ.get("RAY_worker_niceness")
    nid = fake_cluster.add_node()
    try:
        assert os.getpriority(os.PRIO_PROCESS, me) == nice_before
        assert os.environ.get("RAY_worker_niceness") == env_before

        @ray.remote(num_cpus=0)
        class Probe:
            def nice(self) -> tuple[int, int]:
                return os.getpid(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        pid, nice = ray.get(Probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False))
                            .remote().nice.remote(), timeout=120)
        assert nice == 15, f"an actor on the fake node runs at nice {nice}"
        node = fake_cluster.nodes[nid]
        raylets = [p.process.pid for p in node.all_processes[ray_constants.PROCESS_TYPE_RAYLET]]
        procs = raylets + descendants(raylets)
        assert pid in procs
        seen = {}
        for p in procs:
            try:
                for tid in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{tid}/stat") as f:
                        seen[(p, int(tid))] = int(f.read().rsplit(")", 1)[1].split()[16])
            except FileNotFoundError:   # a thread or process that ended meanwhile
                pass
        assert len({p for p, _ in seen}) >= 3, f"the raylet and its agents and the actor: {seen}"
        assert set(seen.values()) == {15}, {k: v for k, v in seen.items() if v != 15}
    finally:
        fake_cluster.remove_node(nid)


def _main_thread_priority(pid: int) -> tuple[int, str]:
    """(nice value, "idle" or "normal") of process ``pid``'s main thread."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[16]), {0: "normal", 5: "idle"}.get(int(fields[38]), fields[38])


def test_standbys_and_new_spares_prepare_at_the_lowest_priority_and_return_to_the_workers_for_their_role(
        fake_cluster, tmp_path):
    """A standby checkpoint actor and a spare started after a failure run at nice 19 from their
    start (Ray's ``RAY_worker_niceness`` in their ``runtime_env``) and under ``SCHED_IDLE`` from
    their constructor, so the ranks beside them keep the cores; the standby returns to the
    workers' priority (nice 15, normal policy) when it is activated, the spare when it takes a
    rank's role (``endpoint``). All of this only where the node's checkpoint actor found the
    return allowed (root here, as in CI); elsewhere the standby stays at 19 (not idle: it will
    persist) and spares start like any worker. Real actors on the fake cluster's nodes."""
    from cfdist.cluster.config import FitConfig
    from cfdist.cluster.context import RankInfo
    from cfdist.cluster.ray_backend import RayBackend

    fake_cluster.ensure_workers(2)
    cfg = FitConfig(storage=f"file://{tmp_path}/{{node}}", run_name="nice", memory_tier=False, num_nodes=2,
                    warm_spares=True)
    backend = RayBackend(cfg, run_id="nice", train_fn=None, policy=None)
    try:
        node = backend.usable_nodes()[0]
        backend._ensure_actors([node])
        here = backend.tiers[node.node_id]
        assert here["nice"] == 15
        assert here["renice"] is (os.geteuid() == 0)
        worker, prepared = (15, "normal"), ((19, "idle") if here["renice"] else (19, "normal"))

        ready = backend._start_standby(node)
        standby = backend._standby[node.node_id]
        pid = ray.get(ready, timeout=120)["pid"]
        assert _main_thread_priority(pid) == prepared, "the standby did not start at the lowest priority"
        ray.get(standby.activate.remote(), timeout=60)
        assert _main_thread_priority(pid) == (worker if here["renice"] else (19, "normal"))

        ref = backend._start_spare(node.node_id)
        (spare, _), = [x for x in backend._spares[node.node_id] if x[1] is ref]
        spid = ray.get(ref, timeout=180)
        assert _main_thread_priority(spid) == (prepared if here["renice"] else worker)
        ray.get(spare.endpoint.remote(RankInfo(rank=1, world_size=2, local_rank=0, local_world_size=1, node_rank=1,
                                                num_nodes=2, attempt=1)), timeout=60)
        assert _main_thread_priority(spid) == worker, "the spare kept the lowest priority as a rank"
        ray.kill(spare)
        ray.kill(standby)
    finally:
        backend.close()


def test_a_drained_node_that_returns_has_its_standby_activated_at_once_once_its_old_actor_is_gone(
        fake_cluster, tmp_path, monkeypatch):
    """The failure injector's simulated preemption drains a node (its checkpoint actor killed)
    and returns it, in the experiment in the same instant. ``RayBackend.undrain`` activates the
    node's standby right then, without waiting for it, so that the recovery's ``holdings`` finds
    an actor ready instead of activating one on its critical path (~20 ms: opening the tiers,
    sweeping the local disk). The activation opens the tiers only once the killed actor is gone
    (its memory directory is removed, not left to a process still writing there); the next
    ``_ensure_actors`` takes the activated standby as the node's actor. Drained again before a
    group took it, the activated standby is killed like the node's actor (SIGKILLed at once:
    Ray's own kill lands tens of milliseconds later, and a call that reached the actor before it
    would still be answered), and a fresh one serves the node at its next return. Real actors."""
    from cfdist.cluster.nodes import exited
    from cfdist.cluster.config import FitConfig
    from cfdist.cluster.node_actor import memory_root
    from cfdist.cluster.ray_backend import RayBackend

    fake_cluster.ensure_workers(2)
    cfg = FitConfig(storage=f"file://{tmp_path}/{{node}}", run_name="undrain", num_nodes=2, warm_spares=True)
    backend = RayBackend(cfg, run_id="undrain", train_fn=None, policy=None)
    try:
        node = backend.usable_nodes()[0]
        nid = node.node_id
        backend._ensure_actors([node])
        old_pid = backend.tiers[nid]["pid"]
        old_mem = os.path.join(memory_root("undrain"), f"{nid[:16]}-{old_pid}")
        assert os.path.isdir(old_mem)
        ray.get(backend._start_standby(node), timeout=120)
        standby = backend._standby[nid]
        backend.drain(nid)
        assert nid in backend.excluded and nid not in backend.actors
        assert nid not in [n.node_id for n in backend.usable_nodes()]
        backend.undrain(nid)
        assert nid not in backend.excluded and nid in [n.node_id for n in backend.usable_nodes()]
        assert nid not in backend._standby and backend._activating[nid][0] is standby, \
            "the returned node's standby was not activated at its return"
        tiers = ray.get(backend._activating[nid][1], timeout=60)
        assert tiers["pid"] != old_pid and tiers["memory"], tiers
        assert not os.path.exists(old_mem), "the killed actor's memory tier was left behind"
        backend._ensure_actors([node])
        assert backend.actors[nid] is standby and backend.tiers[nid] == tiers and nid not in backend._activating
        (h,) = [h for h in backend.holdings() if h.node_id == nid]
        assert h.memory == () and h.local == ()

        # drained again before any group took the activated standby: it is killed as the
        # node's actor would be, and the node's next actor is a fresh one
        ray.get(backend._start_standby(node), timeout=120)
        second = backend._standby[nid]
        backend.drain(nid)
        backend.undrain(nid)
        _, ref = backend._activating[nid]
        spid = ray.get(ref, timeout=60)["pid"]
        with monkeypatch.context() as m:   # Ray's kill held back: only the drain's own SIGKILL can end it
            m.setattr(ray, "kill", lambda *a, **k: None)
            backend.drain(nid)
        assert nid not in backend._activating and nid not in backend.actors
        assert backend._killed_pids[nid] == spid, "the killed standby's process would not be waited for"
        try:
            wait_for(lambda: spid in exited([spid]), timeout_s=30)
        except TimeoutError:
            pytest.fail(f"the activated standby (pid {spid}) was not SIGKILLed by the drain itself")
        ray.kill(second, no_restart=True)   # the kill the drain asked of Ray, held back above
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(second.ready.remote(), timeout=60)
        backend.undrain(nid)
        backend._ensure_actors([node])   # no standby left: a new actor, activated after spid is gone
        assert backend.tiers[nid]["pid"] not in (old_pid, tiers["pid"], spid) and nid not in backend._killed_pids
    finally:
        backend.close()

