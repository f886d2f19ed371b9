"""The failure injector against a fake controller and group (no Ray): what each event kind does."""

from __future__ import annotations

import pytest

from cfdist.chaos import FixedInterval
from cfdist.cluster.events import EventLog
from cfdist.cluster.injector import AtStep, FailureInjector, StepSchedule
from cfdist.cluster.nodes import NodeInfo
from cfdist.cluster.states import RecoveringState, RunningState

NODES = [NodeInfo(f"id{i}", f"n{i}", "127.0.0.1", 1, 0) for i in range(2)]


class Group:
    def __init__(self):
        self.nodes, self.world_size = list(NODES), 2
        self.crashed, self.notified = [], []

    def crash(self, rank):
        self.crashed.append(rank)

    def notify(self, nodes, *, save):
        self.notified.append(tuple(nodes))

    def current_step(self):
        return None

    def actor_of(self, rank):
        return f"actor{rank}"

    def power_off(self, rank):
        """As RayWorkerGroup.power_off: Ray's kill (its SIGKILL of a process the driver sees:
        tests/unit/cluster/test_process_exit.py, tests/integration/cluster)."""
        import ray

        ray.kill(self.actor_of(rank), no_restart=True)


class Backend:
    def __init__(self):
        self.excluded, self.dead, self.actors, self.tiers = set(), set(), {"id1": "node-actor1"}, {"id1": {}}

    def drain(self, node_id):
        """As RayBackend.drain does it (Ray's part: tests/integration/cluster)."""
        import ray

        self.excluded.add(node_id)
        self.tiers.pop(node_id, None)
        actor = self.actors.pop(node_id, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    def undrain(self, node_id):   # RayBackend.undrain's bookkeeping (its standby's activation: tests/integration/cluster)
        self.excluded.discard(node_id)
        self.dead.discard(node_id)


class Ctl:
    def __init__(self, clock):
        self.group = Group()
        self.state = RunningState(self.group)
        self.events = EventLog(None, clock=clock)
        self.step_now = 0


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def killed(monkeypatch):
    import ray

    out = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: out.append(actor))
    return out


def test_at_step_crash_kills_that_rank_once_and_logs_the_failure():
    clock = Clock()
    ctl = Ctl(clock)
    inj = FailureInjector(StepSchedule([AtStep(step=5, kind="crash", rank=1)]), num_nodes=2, backend=Backend(),
                          clock=clock)
    ctl.step_now = 4
    inj.tick(ctl)
    assert ctl.group.crashed == []
    ctl.step_now = 6
    inj.tick(ctl)
    inj.tick(ctl)
    assert ctl.group.crashed == [1]
    (f,) = ctl.events.of("failure")
    assert f["kind"] == "crash" and f["rank"] == 1 and f["step"] == 6 and f["injected"]
    assert inj.claim()["t"] == f["t"] and inj.claim() is None


def test_preempt_without_callbacks_drains_the_node_and_return_gives_it_back(killed):
    clock = Clock()
    ctl, be = Ctl(clock), Backend()
    inj = FailureInjector(StepSchedule([AtStep(step=2, kind="preempt", node=1),
                                        AtStep(step=3, kind="return", node=1)]),
                          num_nodes=2, backend=be, clock=clock)
    ctl.step_now = 2
    inj.tick(ctl)
    assert be.excluded == {"id1"}
    assert "actor1" in killed and "node-actor1" in killed          # its rank and its node actor
    assert ctl.events.of("failure")[0]["kind"] == "preempt"
    ctl.state = RecoveringState()
    ctl.step_now = 3
    inj.tick(ctl)                                                    # step events wait for a running group
    assert be.excluded == {"id1"}
    ctl.state = RunningState(ctl.group)
    inj.tick(ctl)
    assert be.excluded == set() and len(ctl.events.of("node_returned")) == 1


def test_preempt_uses_the_callbacks_when_given():
    clock = Clock()
    ctl = Ctl(clock)
    removed, added = [], []
    inj = FailureInjector(StepSchedule([AtStep(step=1, kind="preempt", node=0), AtStep(step=1, kind="return", node=0)]),
                          num_nodes=2, backend=Backend(), remove_node=removed.append, add_node=added.append,
                          clock=clock)
    ctl.step_now = 1
    inj.tick(ctl)
    inj.tick(ctl)
    inj.settle(10)
    assert removed == ["id0"] and added == [0]


def test_time_schedule_starts_at_the_first_trained_step_and_holds_crashes_until_a_group_runs():
    clock = Clock()
    ctl = Ctl(clock)
    ctl._attempt_base = 0
    ctl.state = RecoveringState()
    inj = FailureInjector(FixedInterval(10.0, kind="crash", ranks_per_node=1, seed=0), num_nodes=2,
                          backend=Backend(), clock=clock, horizon_s=35)
    clock.t = 80.0
    inj.tick(ctl)                  # not running yet: the clock has not started
    ctl.state = RunningState(ctl.group)
    clock.t = 95.0
    inj.tick(ctl)                  # running, no step trained yet (a slow start): still not started
    assert inj.t0 is None and not ctl.events.of("schedule_started")
    ctl.step_now = 1
    clock.t = 100.0
    inj.tick(ctl)                  # t0 = 100: the first step
    (started,) = ctl.events.of("schedule_started")
    assert inj.t0 == 100.0 and started["t"] == 100.0 and started["step"] == 1
    clock.t = 109.0
    inj.tick(ctl)
    assert ctl.group.crashed == []
    clock.t = 110.5
    inj.tick(ctl)
    assert len(ctl.group.crashed) == 1
    ctl.state = RecoveringState()
    clock.t = 121.0
    inj.tick(ctl)                  # due while recovering: held
    assert len(ctl.group.crashed) == 1 and ctl.events.of("injection_deferred")
    ctl.state = RunningState(ctl.group)
    clock.t = 121.5
    inj.tick(ctl)                  # lands once a group runs again
    assert len(ctl.group.crashed) == 2 and not ctl.events.of("injection_skipped")


def test_schedule_arguments_are_checked():
    with pytest.raises(TypeError, match="events"):
        FailureInjector(object(), num_nodes=1, backend=Backend())
    with pytest.raises(ValueError, match="rank"):
        AtStep(step=3, kind="crash")
    with pytest.raises(ValueError, match="step"):
        AtStep(step=0, kind="crash", rank=0)


def test_a_target_missing_from_a_smaller_group_is_retargeted_and_logged(killed):
    """Elastic group of one node: a crash of rank 1 hits rank 0, a preemption of slot 1 takes
    slot 0; both say so in the event log; nothing is skipped silently."""
    clock = Clock()
    ctl = Ctl(clock)
    ctl.group.nodes, ctl.group.world_size = [NODES[0]], 1
    backend = Backend()
    backend.actors, backend.tiers = {"id0": "node-actor0"}, {"id0": {}}
    inj = FailureInjector(StepSchedule([AtStep(step=1, kind="crash", rank=1), AtStep(step=2, kind="preempt", node=1)]),
                          num_nodes=2, backend=backend, clock=clock)
    ctl.step_now = 1
    inj.tick(ctl)
    assert ctl.group.crashed == [0]
    ctl.step_now = 2
    inj.tick(ctl)
    assert killed == ["actor0", "node-actor0"] and backend.excluded == {"id0"}
    moved = ctl.events.of("injection_retargeted")
    assert [(r["kind"], r.get("rank", r.get("node"))) for r in moved] == [("crash", 0), ("preempt", 0)]
    assert "rank 1 is not in the running group (1 ranks)" in moved[0]["reason"]
    assert [f["kind"] for f in ctl.events.of("failure")] == ["crash", "preempt"]
    assert ctl.events.of("injection_skipped") == []


def test_one_failure_is_held_for_the_next_group_until_it_trains_and_more_are_skipped():
    """Recovery slower than the schedule: the first failure due meanwhile waits for the next group
    to train a step (no livelock of groups killed at birth); the second is skipped with a reason."""
    clock = Clock()
    ctl = Ctl(clock)
    inj = FailureInjector(FixedInterval(10.0, kind="crash", ranks_per_node=1, seed=0), num_nodes=2,
                          backend=Backend(), clock=clock, horizon_s=35)
    clock.t = 100.0
    inj.tick(ctl)                          # t0 = 100
    ctl.state = RecoveringState()
    for t in (110.5, 120.5):               # both due while recovering
        clock.t = t
        inj.tick(ctl)
    assert len(ctl.events.of("injection_deferred")) == 1
    (skip,) = ctl.events.of("injection_skipped")
    assert "already held for the next group" in skip["reason"]
    ctl.state, ctl._attempt_base, ctl.step_now = RunningState(ctl.group), 40, 40
    clock.t = 121.0
    inj.tick(ctl)
    assert ctl.group.crashed == []         # the new group has not trained yet
    ctl.step_now = 41
    inj.tick(ctl)
    assert len(ctl.group.crashed) == 1


def test_a_failure_due_during_a_recovery_that_blocked_the_controller_waits_for_the_new_group_to_train():
    """The controller's recovery blocks its thread (no tick while it restarts): its first tick
    after one sees the new group running but untrained, with the failures that fell due
    meanwhile. They are held (one) and skipped (the rest), not landed on a group killed at birth
    (seen under load: a failure every 5 s, restarts of 5 s, 40 failures at the same step)."""
    clock = Clock()
    ctl = Ctl(clock)
    inj = FailureInjector(FixedInterval(5.0, kind="crash", ranks_per_node=1, seed=0), num_nodes=2,
                          backend=Backend(), clock=clock, horizon_s=40)
    ctl.step_now = 1
    clock.t = 100.0
    inj.tick(ctl)                          # t0 = 100
    ctl.step_now = 90
    clock.t = 105.1
    inj.tick(ctl)                          # the first failure lands on a trained group
    assert len(ctl.group.crashed) == 1
    # the recovery blocked the controller for 10 s; it restored step 90, no step trained yet
    ctl.group = Group()
    ctl.state, ctl._attempt_base = RunningState(ctl.group), 90
    clock.t = 115.2
    inj.tick(ctl)
    assert ctl.group.crashed == [], "a failure landed on a group that had not trained a step"
    assert len(ctl.events.of("injection_deferred")) == 1
    (skip,) = ctl.events.of("injection_skipped")
    assert "already held for the next group" in skip["reason"]
    ctl.step_now = 91
    clock.t = 115.3
    inj.tick(ctl)
    assert len(ctl.group.crashed) == 1     # trained a step: the held failure lands
