"""``RayBackend``'s preparations: processes started or warmed ahead (warm spares' warm-ups, new
spare processes, standby checkpoint actors) run a few at a time per host, so that training's
ranks keep a core when they wake (on a 2-core machine faking two nodes, four preparations at
once cost the failure-free run ~0.45 s of its window; two at a time, ~0.3 s); within a while
of a failure, all at once (the next failure may come before a queue drains).

Ray is faked here (``ray.nodes`` and ``ray.wait``, the only Ray calls of the queue): the
preparations are plain callables that record their start and return a token for the fake
``ray.wait``. The real paths (spares taken by a recovery, standbys activated) run in
``tests/integration/cluster/test_cluster_fit.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cfdist.cluster import ray_backend
from cfdist.cluster.config import FitConfig
from cfdist.cluster.nodes import NodeInfo
from cfdist.cluster.ray_backend import RayBackend

# host "a": two fake nodes of 1 CPU each (one machine, 2 cores); host "b": one node of 8 CPUs
RAY_NODES = [{"NodeID": "n0", "NodeManagerAddress": "a", "Resources": {"CPU": 1.0}, "Alive": True},
             {"NodeID": "n1", "NodeManagerAddress": "a", "Resources": {"CPU": 1.0}, "Alive": True},
             {"NodeID": "n2", "NodeManagerAddress": "b", "Resources": {"CPU": 8.0}, "Alive": True}]
N = {n["NodeID"]: NodeInfo(n["NodeID"], n["NodeID"], n["NodeManagerAddress"], n["Resources"]["CPU"], 0)
     for n in RAY_NODES}


@pytest.fixture
def backend(monkeypatch):
    finished: set[str] = set()

    def wait(refs, num_returns=1, timeout=None):
        return [r for r in refs if r in finished], [r for r in refs if r not in finished]

    monkeypatch.setattr(ray_backend.ray, "nodes", lambda: RAY_NODES)
    monkeypatch.setattr(ray_backend.ray, "wait", wait)
    be = RayBackend(FitConfig(storage=("file:///tmp/x",), num_nodes=3, progress=False), run_id="r",
                    train_fn=None, policy=None)
    be.group = SimpleNamespace(nodes=[N["n0"], N["n1"]])   # one rank on each node of host "a"
    started: list[str] = []

    def prepare(name: str, node: str, kind: str = "standby"):
        def launch(low=True):
            started.append(name if low else f"{name} (now)")
            return name
        be._prepare(kind, N[node], launch)

    return be, prepare, started, finished


def test_two_preparations_at_a_time_on_a_host_whose_cores_the_ranks_fill(backend):
    """Host "a": 2 CPUs, 2 ranks: room for two (the least); the next starts only once one
    finished, in the order they were queued, whichever of the host's nodes each is for."""
    be, prepare, started, finished = backend
    prepare("warm-n0", "n0", "warm")
    prepare("warm-n1", "n1", "warm")
    prepare("standby-n0", "n0")
    prepare("standby-n1", "n1")
    assert started == ["warm-n0", "warm-n1"]
    be.pump_preparations()
    assert started == ["warm-n0", "warm-n1"], "a third preparation started while two still ran"
    finished.add("warm-n1")
    be.pump_preparations()
    assert started == ["warm-n0", "warm-n1", "standby-n0"]
    finished.update({"warm-n0", "standby-n0"})
    be.pump_preparations()
    assert started == ["warm-n0", "warm-n1", "standby-n0", "standby-n1"] and not be._prep


def test_a_host_with_spare_cores_runs_more_at_once_and_hosts_do_not_wait_for_each_other(backend):
    """Host "b": 8 CPUs, no rank: room for (8 - 0) // 2 = 4; host "a"'s queue does not hold
    back host "b"'s, nor "b"'s "a"'s."""
    be, prepare, started, finished = backend
    prepare("a1", "n0")
    for i in range(6):
        prepare(f"b{i}", "n2", "spare")
    prepare("a2", "n1")
    prepare("a3", "n1")
    assert started == ["a1", "b0", "b1", "b2", "b3", "a2"]
    finished.update({"b0", "b1"})
    be.pump_preparations()
    assert started == ["a1", "b0", "b1", "b2", "b3", "a2", "b4", "b5"]
    assert [p[1] for p in be._prep] == ["n1"]


def test_a_queued_preparation_for_a_node_that_went_away_is_dropped(backend):
    """A node the injector excluded, or one found dead, gets nothing started; a node forgotten
    (lost) loses its queued preparations."""
    be, prepare, started, finished = backend
    prepare("first", "n0")
    prepare("second", "n0")
    prepare("for-excluded", "n1")
    prepare("for-forgotten", "n0", "spare")
    prepare("last", "n0")
    be.excluded.add("n1")
    finished.add("first")
    be.pump_preparations()
    assert started == ["first", "second", "for-forgotten"]
    be._forget("n0")
    finished.update({"second", "for-forgotten"})
    be.pump_preparations()
    assert started == ["first", "second", "for-forgotten"] and not be._prep


def test_a_preparation_that_fails_to_start_is_logged_and_the_next_one_runs(backend, caplog):
    """An optimisation only: a launch that raises (the node's raylet just went away) is logged
    and takes no room."""
    be, prepare, started, finished = backend

    def broken():
        raise RuntimeError("raylet gone")

    be._prepare("standby", N["n0"], broken)
    prepare("next", "n1")
    prepare("after", "n1")
    assert started == ["next", "after"]
    assert any("could not start a standby on node n0" in r.getMessage() for r in caplog.records)


def test_after_a_failure_preparations_start_at_once_then_a_few_at_a_time_again(backend, monkeypatch):
    """Within ``_URGENT_S`` of a failure the replacement spares and standbys all start: the next
    failure may come before a queue drains (at one node preemption every 5 s, a queue of one at
    a time left the drained node's standby not started at the next one). Past it, the host's
    room applies again."""
    import dataclasses

    be, prepare, started, finished = backend
    now = [1000.0]
    monkeypatch.setattr(ray_backend.time, "monotonic", lambda: now[0])
    be.config = dataclasses.replace(be.config, warm_spares=False)   # retire_group then only stops the group
    be.retire_group(SimpleNamespace(shutdown=lambda: None))
    for name in ("spare-n1", "standby-n1", "warm-n0"):
        prepare(name, "n1" if name.endswith("n1") else "n0")
    assert started == ["spare-n1", "standby-n1", "warm-n0"]
    now[0] += ray_backend._URGENT_S
    prepare("later-a", "n0")
    assert started == ["spare-n1", "standby-n1", "warm-n0"], "past the urgent window, a busy host takes no more"
    finished.update({"spare-n1", "standby-n1", "warm-n0"})
    be.pump_preparations()
    prepare("later-b", "n0")
    prepare("later-c", "n0")
    assert started == ["spare-n1", "standby-n1", "warm-n0", "later-a", "later-b"]


def test_preparations_start_at_the_lowest_priority_unless_a_recovery_waits_for_them(backend, monkeypatch):
    """A new spare (where its node may return from the lowest priority), its warm-up, a
    standby: at the lowest priority (:mod:`cfdist.cluster.niceness`), also right after a
    failure (with the queue, a node preempted every 5 s cost 0.38-0.41 s per failure so, 0.50
    at the workers' priority); a spare or warm-up a recovery takes from the queue
    (``_take_spares``: ``_launch(low=False)``) starts like any worker, since the recovery waits
    for it. Faked: the actor classes (the options and arguments they get are what is checked)."""
    be, prepare, started, _ = backend
    made = []

    class FakeActor:
        def __init__(self, **kw):
            self.kw = kw
            self.warm = SimpleNamespace(remote=lambda fn, background: made.append(("warm", background)) or "ref")
            self.ready = SimpleNamespace(remote=lambda: "ready")

    def new_rank_actor(config, node_id, info, *, prepared=None):
        made.append(("spare", prepared))
        return FakeActor()

    class FakeNode:
        @staticmethod
        def options(**opts):
            return SimpleNamespace(remote=lambda **kw: made.append(("standby", opts.get("runtime_env"),
                                                                    kw["role_nice"])) or FakeActor())

    monkeypatch.setattr(ray_backend, "new_rank_actor", new_rank_actor)
    monkeypatch.setattr(ray_backend, "_RemoteNode", FakeNode)
    monkeypatch.setattr(ray_backend, "NodeAffinitySchedulingStrategy", lambda node_id, soft: node_id)
    facts = {"nice": 15, "renice": True, "python": "/usr/bin/python3", "chrt": "/usr/bin/chrt"}
    be.tiers["n0"] = facts
    be.actors["n0"] = object()
    env = ray_backend.niceness.prepared_options(facts)["runtime_env"]
    low = [("spare", facts), ("warm", True), ("standby", env, 15)]

    be._start_spare("n0")
    be._start_standby(N["n0"])
    assert made == low

    made.clear()
    be._standby.clear()
    be._failed_at = ray_backend.time.monotonic()   # a failure just now: still the lowest
    be._start_spare("n0")
    be._start_standby(N["n0"])
    assert made == low

    made.clear()
    be._start_spare("n0", low=False)   # a recovery waits for it
    assert made == [("spare", None), ("warm", False)]

    made.clear()
    be.tiers["n0"] = {**facts, "renice": False}   # a node where the way back is not allowed
    be._start_spare("n0")
    assert made == [("spare", None), ("warm", True)]

    be._prep_running.clear()
    prepare("queued-spare", "n1", "spare")   # room now (within _URGENT_S): starts low at once
    assert started == ["queued-spare"]
    be._prep.append(("spare", "n1", lambda low=True: started.append(f"taken low={low}"), None))
    be._launch(len(be._prep) - 1, low=False)
    assert started == ["queued-spare", "taken low=False"]
