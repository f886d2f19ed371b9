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

    def power_off(self, rank):
        """As RayWorkerGroup.power_off: Ray's kill (its SIGKILL of a process the driver sees:
        tests/unit/cluster/test_process_exit.py, tests/integration/cluster)."""
        import ray

        ray.kill(self.actor_of(rank), no_restart=True)


class Backend:
    def __init__(self):
        self.excluded, self.dead = set(), set()
        self.actors = {"id0": "node-actor-0", "id1": "node-actor-1"}
        self.tiers = {"id0": {}, "id1": {}}

    def drain(self, node_id):   # RayBackend.drain's bookkeeping (with Ray: tests/integration/cluster)
        import ray

        self.excluded.add(node_id)
        self.tiers.pop(node_id, None)
        ray.kill(self.actors.pop(node_id), no_restart=True)

    def undrain(self, node_id):   # RayBackend.undrain's bookkeeping (its standby's activation: tests/integration/cluster)
        self.excluded.discard(node_id)
        self.dead.discard(node_id)


class Controller:
    """The injector's view of the controller; notices are recorded (what the job does with
    them is the controller's, tested in tests/unit/cluster/test_cluster_controller.py)."""

    def __init__(self, group):
        self.state = RunningState(group)
        self.events = EventLog(None)
        self.step_now = 5
        self.notices = []
        self.pool = False   # what on_notice answers: whether the notices make a pool notice

    def on_notice(self, nodes, window_s, *, source, **detail):
        self.notices.append((list(nodes), round(window_s, 6), source, detail))
        return self.pool


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
    assert ctl.notices == []
    at(2.0)   # notice_s before the kill, to the controller
    assert ctl.notices == [([1], 1.0, "injected", {"notice_s": 1.0})]
    at(3.0)
    preempt = ctl.events.of("failure")[1]
    assert preempt["kind"] == "preempt" and preempt["node"] == 1 and preempt["notice_s"] == 1.0
    assert killed == ["rank-actor-1", "node-actor-1"]   # its ranks, then its node actor
    assert "id1" not in backend.actors and "id1" not in backend.tiers   # a fresh actor on return
    assert ctl.events.of("node_returned")[0]["node"] == 1
    assert backend.excluded == set() and backend.dead == set()   # returned in the same instant
    assert [c["t"] for c in (inj.claim(), inj.claim())] == [fail["t"], preempt["t"]]
    assert inj.claim() is None


def test_the_notices_of_one_instant_go_together_and_a_pool_notice_is_taken_on_time(killed):
    """Both nodes noticed at the same instant: one call to the controller; it answers that they
    make a pool notice (the job halts and recovers meanwhile), so both kills land at their time
    although no group runs, as ``node_taken`` (the controller logged the failure at the halt),
    and the nodes return as scheduled."""
    inj, ctl, group, backend, at = _setup([
        FailureEvent(time_s=3.0, kind="preempt", node=0, notice_s=1.0),
        FailureEvent(time_s=3.0, kind="preempt", node=1, notice_s=1.0),
        FailureEvent(time_s=4.0, kind="return", node=0),
        FailureEvent(time_s=4.0, kind="return", node=1),
    ])
    ctl.pool = True
    at(2.0)
    assert ctl.notices == [([0, 1], 1.0, "injected", {"notice_s": 1.0})]
    ctl.state = RecoveringState()   # halted, committed, waiting for the kill
    at(3.0)
    assert [r["node"] for r in ctl.events.of("node_taken")] == [0, 1]
    assert backend.excluded == {"id0", "id1"} and killed == ["node-actor-0", "node-actor-1"]
    assert ctl.events.of("failure") == [] and ctl.events.of("injection_deferred") == []
    assert inj.claim() is None   # nothing for the controller to match: it saw the halt itself
    at(4.0)
    assert backend.excluded == set() and len(ctl.events.of("node_returned")) == 2


def test_a_step_schedules_pool_notice_is_one_notice_and_its_kills_and_returns_need_no_group(killed):
    """Noticed preemptions of the same step make one notice, once that step is reached; the
    kills come ``notice_s`` later although the job halted, and the returns after them."""
    from cfdist.cluster.injector import AtStep, StepSchedule

    now = [100.0]
    group, backend = Group(), Backend()
    inj = FailureInjector(StepSchedule([AtStep(step=6, kind="preempt", node=n, notice_s=2.0) for n in (0, 1)]
                                       + [AtStep(step=6, kind="return", node=n) for n in (0, 1)]),
                          num_nodes=2, backend=backend, clock=lambda: now[0])
    ctl = Controller(group)
    ctl.pool = True
    inj.tick(ctl)                       # step 5: not yet
    assert ctl.notices == []
    ctl.step_now = 6
    inj.tick(ctl)
    assert ctl.notices == [([0, 1], 2.0, "injected", {"notice_s": 2.0})]
    ctl.state = RecoveringState()
    now[0] += 1.0
    for _ in range(4):
        inj.tick(ctl)
    assert ctl.events.of("node_taken") == []   # notice_s has not passed
    now[0] += 1.0
    for _ in range(4):
        inj.tick(ctl)
    assert [r["node"] for r in ctl.events.of("node_taken")] == [0, 1]
    assert [r["node"] for r in ctl.events.of("node_returned")] == [0, 1] and backend.excluded == set()


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
    inj.settle(10)                              # add_node runs on the injector's own thread
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
    inj.settle(10)
    assert added == [0]


def test_a_node_that_takes_seconds_to_start_does_not_hold_up_the_controller(killed):
    """``add_node`` blocks (a raylet starting: seconds) until the test lets it return; the
    controller's ticks go on meanwhile (a crash due then lands on time), and the first tick after
    it returned logs ``node_joined`` and warms the node (actor, spare ranks)."""
    import threading

    release, entered, added = threading.Event(), threading.Event(), []

    def slow_add(slot):
        entered.set()
        assert release.wait(30), "the test never released add_node"
        added.append(slot)

    inj, ctl, group, backend, at = _setup(
        [FailureEvent(time_s=1.0, kind="preempt", node=1), FailureEvent(time_s=2.0, kind="return", node=1),
         FailureEvent(time_s=3.0, kind="crash", rank=0, node=0)],
        remove_node=lambda nid: None, add_node=slow_add)
    warmed = []
    backend.warm_spare_nodes = lambda: warmed.append(True)
    at(1.0)
    at(2.0)
    assert entered.wait(10), "add_node was never called"
    at(3.0)                                    # add_node still blocked: the tick returned anyway
    assert group.crashed == [0] and added == [] and ctl.events.of("node_joined") == []
    release.set()
    inj.settle(10)
    assert added == [1] and warmed == []       # warmed on the controller's thread, at its next tick
    at(3.1)
    (joined,) = ctl.events.of("node_joined")
    assert joined["node"] == 1 and warmed == [True]
    inj.close()


def test_a_node_taken_already_is_not_taken_again_while_the_group_still_lists_it(killed):
    """Node slot 1 is preempted and returns at once; the next preemption of slot 1 comes before
    the controller replaced the group, which still lists the node taken: skipped with the
    reason (it would remove a node that is gone), and so is the return that follows it."""
    removed = []
    inj, ctl, group, backend, at = _setup(
        [FailureEvent(time_s=1.0, kind="preempt", node=1), FailureEvent(time_s=1.5, kind="return", node=1),
         FailureEvent(time_s=2.0, kind="preempt", node=1), FailureEvent(time_s=2.5, kind="return", node=1)],
        remove_node=removed.append, add_node=lambda slot: None)
    for t in (1.0, 1.5, 2.0, 2.5):
        at(t)
    inj.close()
    assert removed == ["id1"] and len(ctl.events.of("failure")) == 1
    skipped = ctl.events.of("injection_skipped")
    assert [r["kind"] for r in skipped] == ["preempt", "return"]
    assert "was taken already" in skipped[0]["reason"]


def test_the_return_of_a_skipped_preemption_is_skipped_even_while_an_earlier_one_of_its_slot_is_held(killed):
    """While recovering: slot 0's preemption P1 is held, its return R1 waits for it; P2 (same
    slot) is skipped (one is held already), so its return R2 is skipped as well, and is not
    taken for a second return of P1. A later preemption P3 of slot 0 then gets its own return
    (the run used to lose the slot for good: R3 was eaten as P2's)."""
    inj, ctl, group, backend, at = _setup(
        [FailureEvent(time_s=1.0, kind="preempt", node=0), FailureEvent(time_s=1.0, kind="return", node=0),
         FailureEvent(time_s=2.0, kind="preempt", node=0), FailureEvent(time_s=2.0, kind="return", node=0),
         FailureEvent(time_s=5.0, kind="preempt", node=0), FailureEvent(time_s=5.0, kind="return", node=0)])
    ctl.state = RecoveringState()
    at(1.0)
    at(2.0)
    ctl.state = RunningState(group)
    at(3.0)                                         # the held P1 lands, then R1
    assert len(ctl.events.of("failure")) == 1 and len(ctl.events.of("node_returned")) == 1
    skipped = ctl.events.of("injection_skipped")
    assert [(r["kind"], r["reason"]) for r in skipped] == [
        ("preempt", skipped[0]["reason"]), ("return", "its preemption was skipped")]
    at(5.0)                                         # P3 and its own return
    assert len(ctl.events.of("failure")) == 2 and len(ctl.events.of("node_returned")) == 2
    assert backend.excluded == set()


def test_a_failed_add_node_is_logged_as_an_injection_failure(killed):
    def broken_add(slot):
        raise RuntimeError("no capacity in the zone")

    inj, ctl, group, backend, at = _setup(
        [FailureEvent(time_s=1.0, kind="preempt", node=1), FailureEvent(time_s=2.0, kind="return", node=1)],
        remove_node=lambda nid: None, add_node=broken_add)
    at(1.0)
    at(2.0)
    inj.settle(10)
    at(2.1)
    (failed,) = ctl.events.of("injection_failed")
    assert failed["kind"] == "return" and "no capacity in the zone" in failed["error"]
    assert ctl.events.of("node_joined") == []
    inj.close()


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
