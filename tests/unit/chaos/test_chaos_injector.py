"""The failure injector executing chaos schedules' FailureEvents, with a scripted controller.

A fake controller (state, event log, step) and a fake worker group stand in for Ray; the clock
is a variable. ``ray.kill`` is replaced by a recorder. What is checked is what the injector does
with each kind of event and when: crash -> the rank dies; preempt with notice -> the notice (and
an emergency checkpoint only if it fits) ``notice_s`` early, then the node is drained; return ->
the node is usable again; events that cannot apply are skipped and logged, never guessed.
"""

from __future__ import annotations

import pytest
import ray

from cfdist.chaos import FailureEvent
from cfdist.cluster.events import EventLog
from cfdist.cluster.injector import FailureInjector, emergency_checkpoint_fits
from cfdist.cluster.nodes import NodeInfo
from cfdist.cluster.states import RecoveringState, RunningState


class Group:
    def __init__(self, n_nodes=2, per_node=1):
        self.nodes = [NodeInfo(f"id{i}", f"n{i}", "127.0.0.1", 1.0, 0.0) for i in range(n_nodes)]
        self.world_size = n_nodes * per_node
        self.crashed, self.notified = [], []

    def current_step(self):
        return 7

    def crash(self, rank):
        self.crashed.append(rank)

    def notify(self, nodes, *, save):
        self.notified.append((tuple(nodes), save))

    def actor_of(self, rank):
        return f"rank-actor-{rank}"


class Backend:
    def __init__(self):
        self.excluded, self.dead = set(), set()
        self.actors = {"id0": "node-actor-0", "id1": "node-actor-1"}
        self.tiers = {"id0": {}, "id1": {}}


class Controller:
    def __init__(self, group):
        self.state = RunningState(group)
        self.events = EventLog(None)
        self.step_now = 5


class Schedule:
    def __init__(self, events):
        self._events = events

    def events(self, num_nodes, horizon_s):
        return list(self._events)


@pytest.fixture
def killed(monkeypatch):
    out = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: out.append(actor))
    return out


def _setup(events, **kw):
    now = [100.0]
    group, backend = Group(), Backend()
    inj = FailureInjector(Schedule(events), num_nodes=2, backend=backend, clock=lambda: now[0], **kw)
    ctl = Controller(group)

    def at(t):
        now[0] = 100.0 + t
        inj.tick(ctl)

    at(0.0)   # t0: the first tick while a group runs and has trained a step
    assert [r["event"] for r in ctl.events.records] == ["schedule_started"]
    return inj, ctl, group, backend, at


def _kinds(ctl):
    return [r["event"] for r in ctl.events.records if r["event"] != "schedule_started"]


def test_crash_notice_preempt_and_return_happen_when_scheduled(killed):
    inj, ctl, group, backend, at = _setup([
        FailureEvent(time_s=1.0, kind="crash", rank=1, node=1),
        FailureEvent(time_s=3.0, kind="preempt", node=1, notice_s=1.0),
        FailureEvent(time_s=3.0, kind="return", node=1),
    ])
    at(0.9)
    assert group.crashed == [] and _kinds(ctl) == []
    at(1.0)
    assert group.crashed == [1]
    (fail,) = ctl.events.of("failure")
    assert fail["kind"] == "crash" and fail["rank"] == 1 and fail["step"] == 7 and fail["injected"]
    at(1.99)
    assert ctl.events.of("notice") == []
    at(2.0)   # notice_s before the kill; no commit measured yet: checkpoint now
    (notice,) = ctl.events.of("notice")
    assert notice["node"] == 1 and notice["save"] is True and notice["window_s"] == pytest.approx(1.0)
    assert group.notified == [((1,), True)]
    at(3.0)
    preempt = ctl.events.of("failure")[1]
    assert preempt["kind"] == "preempt" and preempt["node"] == 1 and preempt["notice_s"] == 1.0
    assert killed == ["rank-actor-1", "node-actor-1"]   # its ranks, then its node actor
    assert "id1" not in backend.actors and "id1" not in backend.tiers   # a fresh actor on return
    assert ctl.events.of("node_returned")[0]["node"] == 1
    assert backend.excluded == set() and backend.dead == set()   # returned in the same instant
    assert [c["t"] for c in (inj.claim(), inj.claim())] == [fail["t"], preempt["t"]]
    assert inj.claim() is None


def test_notice_skips_the_emergency_checkpoint_that_cannot_commit_before_the_kill(killed):
    inj, ctl, group, backend, at = _setup([FailureEvent(time_s=5.0, kind="preempt", node=0, notice_s=0.5)])
    for s, t, commit in ((10, 1.0, 3.0), (20, 2.0, 4.0)):   # commits take 2 s after their step
        ctl.events.emit("step", t=100 + t, step=s)
        ctl.events.emit("checkpoint_committed", t=100 + commit, step=s, tier="memory")
    at(4.5)
    (notice,) = ctl.events.of("notice")
    assert notice["save"] is False and "exceeds the 0.50s window" in notice["reason"]
    assert group.notified == [((0,), False)]   # the node still learns it is going away
    at(5.0)
    assert backend.excluded == {"id0"} and killed == ["rank-actor-0", "node-actor-0"]


def test_a_slot_that_is_down_is_not_preempted_again_and_returns_once(killed):
    inj, ctl, group, backend, at = _setup([
        FailureEvent(time_s=1.0, kind="preempt", node=1),
        FailureEvent(time_s=2.0, kind="preempt", node=1),
        FailureEvent(time_s=4.0, kind="return", node=1),
        FailureEvent(time_s=5.0, kind="return", node=1),
    ])
    at(2.0)
    assert len(ctl.events.of("failure")) == 1 and backend.excluded == {"id1"}
    (skip,) = ctl.events.of("injection_skipped")
    assert skip["kind"] == "preempt" and "already down" in skip["reason"]
    backend.dead.add("id1")   # the controller saw its node actor gone meanwhile
    at(4.0)
    assert backend.excluded == set() and backend.dead == set()
    at(5.0)
    assert len(ctl.events.of("node_returned")) == 1
    assert ctl.events.of("injection_skipped")[-1]["kind"] == "return"


def test_preempt_due_while_recovering_lands_when_the_next_group_runs(killed):
    added, removed = [], []
    inj, ctl, group, backend, at = _setup(
        [FailureEvent(time_s=1.0, kind="preempt", node=1), FailureEvent(time_s=1.5, kind="return", node=1)],
        remove_node=removed.append, add_node=added.append)
    ctl.state = RecoveringState()
    at(1.0)
    at(1.2)
    assert removed == [] and len(ctl.events.of("injection_deferred")) == 1   # logged once
    ctl.state = RunningState(group)
    at(1.5)
    assert removed == ["id1"] and added == [1]   # it landed, then its return came
    assert ctl.events.of("injection_skipped") == []


def test_remove_and_add_hooks_replace_the_node(killed):
    added, removed = [], []
    inj, ctl, group, backend, at = _setup(
        [FailureEvent(time_s=1.0, kind="preempt", node=0), FailureEvent(time_s=2.0, kind="return", node=0)],
        remove_node=removed.append, add_node=added.append)
    at(1.0)
    assert removed == ["id0"] and killed == [] and backend.excluded == set()
    at(2.0)
    assert added == [0]


@pytest.mark.parametrize("window, latencies, take, phrase", [
    (1.0, [], True, "no commit latency measured"),
    (1.0, [0.2, 0.3, 0.25], True, "fits"),
    (0.1, [0.2, 0.3, 0.25], False, "exceeds"),
    (1.0, [5.0] * 10 + [0.1] * 3, True, "fits"),   # the median of the last five
    (0.0, [0.1], False, "no time left"),
    (-0.3, [], False, "no time left"),
])
def test_emergency_checkpoint_fits(window, latencies, take, phrase):
    got, reason = emergency_checkpoint_fits(window, latencies)
    assert got is take and phrase in reason
