"""The controller stepped by hand with a fake cluster and a scripted worker group (no Ray).

Each test scripts what the group reports at each poll and checks the state sequence, the group
sizes started, the restore decisions and the events written - the Ray Train v2 way.
"""

from __future__ import annotations

import pytest

from cfdist.cluster.config import FitConfig
from cfdist.cluster.controller import Controller
from cfdist.cluster.decisions import Holding
from cfdist.cluster.events import EventLog
from cfdist.cluster.nodes import NodeInfo
from cfdist.cluster.result import FitError
from cfdist.cluster.states import FailedState, FinishedState, GroupStatus, RankError, RecoveringState, RunningState

N = [NodeInfo(f"node{i}" + "x" * 10, f"n{i}", "127.0.0.1", 2, 0) for i in range(3)]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


class FakeGroup:
    def __init__(self, nodes, script, wpn):
        self.nodes = nodes
        self.world_size = len(nodes) * wpn
        self.script = list(script)
        self.shut = False
        self.notified = []

    def poll(self, timeout_s):
        return self.script.pop(0) if self.script else GroupStatus()

    def current_step(self):
        return None

    def notify(self, nodes, *, save):
        self.notified.append((tuple(nodes), save))

    def halt(self):
        self.halted = True

    halted = False

    def pids(self):
        return [1, 2]

    def node_rank_of(self, node_id):
        return next((i for i, n in enumerate(self.nodes) if n.node_id == node_id), None)

    def shutdown(self):
        self.shut = True


class FakeBackend:
    """Nodes, holdings and per-attempt scripts set by the test."""

    def __init__(self, nodes, scripts, holdings=(), wpn=1):
        self.nodes = list(nodes)
        self.scripts = list(scripts)
        self.holdings_now = list(holdings)
        self.lost = set()
        self.commits = []
        self.groups = []
        self.staged = []
        self.wpn = wpn

    def usable_nodes(self):
        return [n for n in self.nodes if n.node_id not in self.lost]

    def lost_nodes(self, nodes):
        return {n.node_id for n in nodes} & self.lost

    def holdings(self, newest=None):
        return list(self.holdings_now)

    def stage(self, choice, nodes):
        self.staged.append(choice)
        return {}

    def start_group(self, nodes, choice, attempt, dead_pids):
        g = FakeGroup(nodes, self.scripts.pop(0), self.wpn)
        self.groups.append((g, choice))
        return g

    def drain_commits(self, final=False):
        self.drained_final = getattr(self, "drained_final", 0) + bool(final)
        out, self.commits = self.commits, []
        return out

    final_commits = ()   # what finish() leaves on the actors (the test sets it)

    def finish(self):
        self.commits += list(self.final_commits)
        return "file:///ckpt/step-000000010"

    durable = None   # what commit_durable answers (the test sets it)

    def commit_durable(self, nodes, deadline):
        self.durable_calls = getattr(self, "durable_calls", []) + [([n.node_id for n in nodes], deadline)]
        return self.durable


def step_rec(t, step):
    return {"type": "step", "t": t, "step": step, "stall_s": 0.0}


def make(backend, clock, **cfg):
    config = FitConfig(storage=("file:///tmp/x",), num_nodes=cfg.pop("num_nodes", 2), progress=False, **cfg)
    events = EventLog(None, clock=clock)
    return Controller(config, backend, events, clock=clock, sleep=clock.sleep), events


def drive(ctl, n=50):
    names = [ctl.state.name]
    for _ in range(n):
        if ctl.state.terminal:
            break
        ctl.step()
        names.append(ctl.state.name)
    return names


def test_fresh_start_runs_to_the_end():
    clock = Clock()
    be = FakeBackend(N[:2], [[GroupStatus(records=[step_rec(1001, 1), step_rec(1002, 2)]),
                              GroupStatus(finished=True, results={0: {"final_step": 2, "value": "v"}})]])
    ctl, ev = make(be, clock)
    assert drive(ctl) == ["recovering", "running", "running", "finished"]
    assert isinstance(ctl.state, FinishedState) and ctl.state.value == "v"
    g, choice = be.groups[0]
    assert len(g.nodes) == 2 and choice.step is None and g.shut
    r = ctl.result()
    assert (r.final_step, r.steps, r.failures, r.checkpoint) == (2, 2, 0, "file:///ckpt/step-000000010")
    assert [e["step"] for e in ev.of("step")] == [1, 2]
    assert ev.of("end")[0]["step"] == 2


def test_crash_recovers_from_memory_and_counts_lost_iterations():
    clock = Clock()
    died = GroupStatus(records=[step_rec(1001, 7)], errors=[RankError(1, N[1].node_id, True, "ActorDiedError")])
    be = FakeBackend(N[:2], [
        [died],
        [GroupStatus(records=[{"type": "restored", "t": 1003, "step": 4, "restore_s": 0.01}, step_rec(1004, 5)]),
         GroupStatus(finished=True, results={0: {"final_step": 5}})],
    ])
    ctl, ev = make(be, clock)
    ctl.step()                                  # fresh start: nothing committed yet
    be.holdings_now = [Holding(node_id=N[0].node_id, memory=(4,)), Holding(node_id=N[1].node_id, memory=(4,))]
    states = drive(ctl)
    assert states == ["running", "recovering", "running", "running", "finished"]
    assert be.groups[0][0].shut
    choice = be.groups[1][1]
    assert choice.step == 4 and choice.tier == "memory"
    r = ctl.result()
    assert r.failures == 1 and r.lost_iterations == [3]
    (f,) = r.failure_stats
    assert f.kind == "crash" and f.tier == "memory" and f.restored_step == 4
    (fail,) = ev.of("failure")
    assert fail["kind"] == "crash" and fail["step"] == 7 and fail["rank"] == 1 and fail["node"] == 1
    (rest,) = ev.of("restored")
    assert rest["step"] == 4 and rest["tier"] == "memory" and rest["restore_s"] >= 0
    decisions = [d["what"] for d in ev.of("decision")]
    assert decisions.count("restore") == 2 and "failure" in decisions


def test_lost_node_without_spare_shrinks_the_group():
    clock = Clock()
    be = FakeBackend(N[:2], [
        [GroupStatus(errors=[RankError(0, N[0].node_id, False, "gloo: connection closed")])],
        [GroupStatus(finished=True, results={0: {"final_step": 3}})],
    ])
    ctl, ev = make(be, clock)
    ctl.step()                          # start
    be.lost.add(N[1].node_id)           # node 1 vanishes; the survivor's collective fails
    ctl.step()
    assert isinstance(ctl.state, RecoveringState) and ctl.state.failure.kind == "preempt"
    drive(ctl)
    assert isinstance(ctl.state, FinishedState)
    assert [len(g.nodes) for g, _ in be.groups] == [2, 1]
    assert ctl.result().world_sizes == (2, 1)


def test_a_lost_node_is_replaced_by_a_ready_spare_before_one_still_starting_and_holdings_know_the_newest_step():
    """Node 1 of the group is lost; two spares: n2's checkpoint actor is still starting (a node
    that just joined), n3's is up. The new group is n0 + n3 (not n2, which would make the
    group wait for its actor), and the holdings are asked knowing the run's newest step (7),
    so a starting actor need not be waited for when the survivor holds it."""
    import dataclasses

    clock = Clock()
    n3 = NodeInfo("node3" + "x" * 10, "n3", "127.0.0.1", 2, 0)
    nodes = [N[0], N[1], dataclasses.replace(N[2], starting=True), n3]
    be = FakeBackend(nodes, [
        [GroupStatus(records=[step_rec(1001, 7)], errors=[RankError(0, N[0].node_id, False, "gloo: connection reset")])],
        [GroupStatus(finished=True, results={0: {"final_step": 7}})],
    ], holdings=[Holding(node_id=N[0].node_id, memory=(7,))])
    asked = []
    real = be.holdings
    be.holdings = lambda newest=None: asked.append(newest) or real()
    ctl, ev = make(be, clock)
    ctl.step()                          # start on n0 + n1
    assert [n.name for n in be.groups[0][0].nodes] == ["n0", "n1"]
    be.lost.add(N[1].node_id)
    drive(ctl)
    assert isinstance(ctl.state, FinishedState)
    assert [n.name for n in be.groups[1][0].nodes] == ["n0", "n3"]
    assert asked == [None, 7]           # the fresh start knows no step; the recovery does


def test_recovery_waits_for_a_node_the_injector_is_bringing_back_instead_of_shrinking():
    """A 2-node run, node 1 lost; the failure injector's add_node for its return is still
    running (seconds): recovery waits (``wait_for_nodes``) instead of shrinking to one node,
    and starts the 2-node group once the node joined."""
    clock = Clock()
    be = FakeBackend(N[:2], [
        [GroupStatus(records=[step_rec(1001, 7)], errors=[RankError(0, N[0].node_id, False, "gloo: connection reset")])],
        [GroupStatus(finished=True, results={0: {"final_step": 7}})],
    ], holdings=[Holding(node_id=N[0].node_id, memory=(7,))])

    class Injector:
        joining = 0

        def tick(self, ctl):
            pass

        def claim(self, kind=None):
            return None

    inj = Injector()
    ctl, ev = make(be, clock)
    ctl.injector = inj
    ctl.step()                          # start on n0 + n1
    be.lost.add(N[1].node_id)
    inj.joining = 1                     # its replacement is starting
    ctl.step()                          # the failure
    ctl.step()
    ctl.step()
    assert isinstance(ctl.state, RecoveringState) and len(be.groups) == 1
    (wait,) = [d for d in ev.of("decision") if d["what"] == "wait_for_nodes"]
    assert "1 node(s) joining" in wait["reason"]
    be.nodes.append(N[2])               # it joined
    inj.joining = 0
    drive(ctl)
    assert isinstance(ctl.state, FinishedState)
    assert [len(g.nodes) for g, _ in be.groups] == [2, 2]


def test_failures_beyond_max_failures_fail_the_run_with_the_reason():
    clock = Clock()
    boom = [GroupStatus(errors=[RankError(0, N[0].node_id, False, "ValueError: bad batch")])]
    be = FakeBackend(N[:2], [boom, boom, boom])
    ctl, ev = make(be, clock, max_failures=1)
    states = drive(ctl)
    assert states[-1] == "failed" and states.count("running") == 2
    err = ctl.state.error
    assert isinstance(err, FitError)
    assert "max_failures=1" in str(err) and "bad batch" in str(err)
    with pytest.raises(FitError):
        ctl.state = RecoveringState()   # run() raises the terminal error
        be.scripts = [boom, boom, boom]
        ctl.num_failures = 0
        ctl.run()


def test_too_few_nodes_waits_then_fails_after_the_deadline():
    clock = Clock()
    be = FakeBackend([], [])
    ctl, ev = make(be, clock, wait_for_nodes_s=2.0, poll_s=0.5)
    states = drive(ctl, n=20)
    assert states[-1] == "failed" and "min_nodes=1" in str(ctl.state.error)
    assert 2.0 < clock.t - 1000.0 < 3.5
    assert ev.of("decision")[0]["what"] == "wait_for_nodes"


def test_waiting_for_nodes_logs_nodes_ready_when_they_come():
    clock = Clock()
    be = FakeBackend([], [[GroupStatus(finished=True, results={0: {"final_step": 0}})]])
    ctl, ev = make(be, clock, wait_for_nodes_s=60.0, num_nodes=1)
    ctl.step()
    ctl.step()
    assert isinstance(ctl.state, RecoveringState) and ctl.state.since is not None
    be.nodes = N[:1]
    ctl.step()
    assert isinstance(ctl.state, RunningState)
    assert len(ev.of("nodes_ready")) == 1


def test_capacity_return_grows_the_group_at_the_next_commit():
    clock = Clock()
    be = FakeBackend(N[:1], [
        [GroupStatus(records=[step_rec(1001, 5)])] * 3 + [GroupStatus(records=[step_rec(1010, 8)])],
        [GroupStatus(finished=True, results={0: {"final_step": 9}})],
    ])
    ctl, ev = make(be, clock, poll_s=0.5)
    ctl.step()                                  # 1 node: elastic start
    be.nodes = N[:2]                            # a node returns
    clock.t += 10
    ctl.step()                                  # running: capacity check decides to grow
    assert any(d["what"] == "grow_at_next_checkpoint" for d in ev.of("decision"))
    assert isinstance(ctl.state, RunningState)
    be.commits = [{"t": clock.t, "step": 8, "tier": "memory", "node_id": N[0].node_id}]
    be.holdings_now = [Holding(node_id=N[0].node_id, memory=(8,))]
    ctl.step()
    assert isinstance(ctl.state, RecoveringState) and ctl.state.resize
    drive(ctl)
    assert [len(g.nodes) for g, _ in be.groups] == [1, 2]
    grown = be.groups[1][1]
    assert grown.step == 8 and grown.sources[N[1].node_id] == ("peer", N[0].node_id)
    assert ctl.result().failures == 0 and len(ev.of("resize")) == 1


def test_commits_are_logged_once_per_step_and_tier_in_time_order():
    clock = Clock()
    be = FakeBackend(N[:2], [[GroupStatus(records=[step_rec(1001.0, 4), step_rec(1003.0, 5)]),
                              GroupStatus(finished=True, results={0: {"final_step": 5}})]])
    ctl, ev = make(be, clock)
    ctl.step()
    be.commits = [{"t": 1002.0, "step": 4, "tier": "memory", "node_id": N[0].node_id, "committed_at": 1001.9},
                  {"t": 1002.5, "step": 4, "tier": "memory", "node_id": N[1].node_id}]
    ctl.step()
    order = [(r["event"], r["step"]) for r in ev.records if r["event"] in ("step", "checkpoint_committed")]
    assert order == [("step", 4), ("checkpoint_committed", 4), ("step", 5)]
    assert ev.of("checkpoint_committed")[0]["committed_at"] == 1001.9   # its atomic rename, before the report
    ts = [r["t"] for r in ev.records]
    assert ts == sorted(ts)


def test_the_final_upload_s_commit_recorded_by_finish_reaches_the_event_log_before_the_end():
    clock = Clock()
    be = FakeBackend(N[:2], [[GroupStatus(records=[step_rec(1001.0, 10)]),
                              GroupStatus(finished=True, results={0: {"final_step": 10}})]])
    be.final_commits = [{"t": 1002.0, "step": 10, "tier": "shared", "node_id": N[0].node_id, "writers": 2,
                         "nodes": ["n0", "n1"]},
                        {"t": 1002.1, "step": 10, "tier": "shared", "node_id": N[1].node_id}]   # logged once
    ctl, ev = make(be, clock)
    assert drive(ctl) == ["recovering", "running", "running", "finished"]
    assert be.drained_final == 1
    shared = [r for r in ev.records if r["event"] == "checkpoint_committed" and r["tier"] == "shared"]
    assert [(r["step"], r["writers"], r["writer_nodes"]) for r in shared] == [(10, 2, ["n0", "n1"])], shared
    assert [r["event"] for r in ev.records][-2:] == ["checkpoint_committed", "end"]


def test_a_cloud_notice_flags_the_node_and_takes_an_emergency_checkpoint_when_it_fits():
    clock = Clock()
    be = FakeBackend(N[:2], [[GroupStatus(records=[step_rec(1001, 1)]), GroupStatus(records=[step_rec(1002, 2)]),
                              GroupStatus(finished=True, results={0: {"final_step": 2}})]])
    notices = [[], [{"node_id": N[1].node_id, "source": "aws", "deadline": clock.t + 120.0, "detail": "x"}]]
    be.drain_notices = lambda: notices.pop(0) if notices else []
    ctl, ev = make(be, clock)
    drive(ctl)
    (n,) = ev.of("notice")
    assert n["node"] == 1 and n["source"] == "aws" and n["save"] and 119 < n["window_s"] <= 120
    assert be.groups[0][0].notified == [((1,), True)]


def test_unknown_holdings_are_asked_again_not_taken_for_an_empty_disk():
    """A node whose actor is still starting cannot say what its disk holds: the controller asks
    again instead of starting from scratch over that node's checkpoints (which a later commit's
    retention could then delete); after too many tries the run fails with the reason."""
    clock = Clock()
    be = FakeBackend(N[:1], [[GroupStatus(finished=True, results={0: {"final_step": 8}})]],
                     holdings=[Holding(node_id=N[0].node_id, local=(8,))])
    answers = [RuntimeError("node actor still starting"), None]
    real = be.holdings

    def holdings(newest=None):
        e = answers.pop(0) if answers else None
        if e is not None:
            raise e
        return real()

    be.holdings = holdings
    ctl, ev = make(be, clock, num_nodes=1)
    assert drive(ctl) == ["recovering", "recovering", "running", "finished"]
    assert be.groups[0][1].step == 8
    assert [d["what"] for d in ev.of("decision")].count("holdings_failed") == 1

    be2 = FakeBackend(N[:1], [])
    be2.holdings = lambda newest=None: (_ for _ in ()).throw(RuntimeError("never answers"))
    ctl2, _ = make(be2, clock, num_nodes=1)
    drive(ctl2)
    assert isinstance(ctl2.state, FailedState) and "never answers" in str(ctl2.state.error)
    assert be2.groups == []


def test_a_group_that_cannot_start_is_a_failure_named_with_its_cause_and_the_run_goes_on(caplog):
    """start_group raises an error chained to another (a C call's SystemError "returned a result
    with an exception set" carries the real one as its cause): the failure's message names both,
    the traceback is logged, and the next attempt starts."""
    clock = Clock()

    class FailsOnce(FakeBackend):
        def start_group(self, nodes, choice, attempt, dead_pids):
            if attempt == 0:   # the first attempt
                try:
                    raise ConnectionError("the raylet refused the lease")
                except ConnectionError as cause:
                    raise SystemError("<built-in method __new__> returned a result with an exception set") from cause
            return super().start_group(nodes, choice, attempt, dead_pids)

    be = FailsOnce(N[:2], [[GroupStatus(finished=True, results={0: {"final_step": 0, "value": "v"}})]])
    ctl, ev = make(be, clock)
    with caplog.at_level("WARNING", logger="cfdist.controller"):
        drive(ctl)
    assert isinstance(ctl.state, FinishedState) and ctl.num_failures == 1
    (d,) = [e for e in ev.of("decision") if e["what"] == "failure"]
    assert "SystemError" in d["message"] and "ConnectionError: the raylet refused the lease" in d["message"], d
    assert any(r.exc_info and r.exc_info[0] is SystemError for r in caplog.records), caplog.records


def test_a_live_save_commit_starts_no_spare_and_triggers_no_resize():
    """A survivor's live save commits while its group fails: logged (``live``), but it does not
    start the replacement spares (they would compete with the restart for the CPUs) the way a
    regular commit does, nor count as the checkpoint a planned grow waits for. (A fresh run
    whose policy still profiles: its spares start at the first regular commit.)"""
    clock = Clock()
    refills = []
    prof = {"profiling": True}
    be = FakeBackend(N[:2], [[GroupStatus(records=[{**step_rec(1001, 1), **prof}]),
                              GroupStatus(records=[{**step_rec(1002, 2), **prof}]),
                              GroupStatus(records=[{**step_rec(1003, 3), **prof}]),
                              GroupStatus(finished=True, results={0: {"final_step": 3}})]])
    be.refill_spares = lambda: refills.append(clock())
    ctl, ev = make(be, clock)
    ctl.step()                                                    # the group starts
    ctl.step()                                                    # step 1
    ctl._grow_to, ctl._grow_step = 3, 2                           # a grow planned at the next commit
    be.commits = [{"t": 1002.5, "step": 2, "tier": "memory", "node_id": N[0].node_id, "live": True}]
    ctl.step()
    assert refills == [] and ev.of("checkpoint_committed")[-1]["live"] is True and not ev.of("resize")
    be.commits = [{"t": 1003.5, "step": 3, "tier": "memory", "node_id": N[0].node_id}]
    ctl.step()
    assert len(refills) == 1 and "live" not in ev.of("checkpoint_committed")[-1] and ev.of("resize")


@pytest.mark.parametrize("profiled_until,gap_s,commit_at,warmed_at", [
    (0, 0.05, 3, 3), (1, 3.0, None, 4), (4, 3.0, 3, 3)],
    ids=["a-commit-soon", "no-commit-5s-past-the-profile", "a-profile-past-the-commit"])
def test_a_fresh_runs_spares_warm_at_its_first_commit_or_5s_past_the_policys_profile(profiled_until, gap_s,
                                                                                     commit_at, warmed_at):
    """A run from scratch warms its spare processes at its first commit, or, when none came
    5 s after its first step past the policy's profile (``Every``, ``EveryEpoch``: the first
    step; ``Auto``: once its profile is done), then; never during the profile; once per
    attempt. (Before, only at the first commit: ``EveryEpoch``'s came 250 steps in, and a crash
    before it waited for a spare's imports.)"""
    clock = Clock()
    refills = []
    recs = [dict(step_rec(1000 + s, s), **({"profiling": True} if s <= profiled_until else {}))
            for s in (1, 2, 3, 4)]
    be = FakeBackend(N[:2], [[*(GroupStatus(records=[r]) for r in recs),
                              GroupStatus(finished=True, results={0: {"final_step": 4}})]])
    polled = []   # the step whose record the controller's current poll reads
    be.refill_spares = lambda: refills.append(polled[-1])
    ctl, ev = make(be, clock)
    ctl.step()                                                    # the group starts
    for s in (1, 2, 3, 4):
        polled.append(s)
        clock.t += gap_s
        if s == commit_at:   # the first commit, read with that step's record
            be.commits = [{"t": clock.t, "step": s, "tier": "memory", "node_id": N[0].node_id}]
        ctl.step()
    assert refills == [warmed_at], refills


class HangingGroup(FakeGroup):
    """Reports one step, then nothing, until ``stop_hung`` kills rank 1: then its death."""

    def __init__(self, nodes, script, wpn):
        super().__init__(nodes, script, wpn)
        self.stopped = []

    def stop_hung(self, quiet_s):
        self.stopped.append(quiet_s)
        self.script = [GroupStatus(errors=[RankError(1, self.nodes[1].node_id, True, "hung: killed")])]
        return [1], True


@pytest.mark.parametrize("timeout", [5.0, None])
def test_a_group_without_progress_for_hang_timeout_s_is_stopped_and_the_failure_is_a_hang(timeout):
    clock = Clock()
    be = FakeBackend(N[:2], [[GroupStatus(records=[step_rec(1000, 1)])] + [GroupStatus()] * 3, []])
    be.start_group = lambda nodes, choice, attempt, dead: be.groups.append(
        (HangingGroup(nodes, be.scripts.pop(0), 1), choice)) or be.groups[-1][0]
    ctl, ev = make(be, clock, hang_timeout_s=timeout)
    ctl.step()                      # recovering -> running (a long start-up is no hang: no step yet)
    clock.t += 100
    ctl.step()                      # the first step: progress from now
    g = be.groups[0][0]
    for _ in range(4):
        clock.t += 1.5
        ctl.step()
    if timeout is None:
        assert g.stopped == [] and ev.of("hang") == [] and isinstance(ctl.state, RunningState)
        return
    assert len(g.stopped) == 1 and g.stopped[0] >= 5.0
    (hang,) = ev.of("hang")
    assert hang["ranks"] == [1] and hang["frozen"] and hang["step"] == 1
    ctl.step()                      # the killed rank's death: a failure caused by the hang
    (failure,) = ev.of("failure")
    assert failure["cause"] == "hang" and failure["rank"] == 1 and failure["stalled_since"] == 1100.0
    assert ctl._recovery["failed_at"] == 1100.0 and ctl._recovery["detected_at"] == clock.t


def test_hang_timeout_s_is_validated():
    with pytest.raises(ValueError, match="hang_timeout_s must be a number of seconds > 0, or None"):
        make(FakeBackend(N[:2], []), Clock(), hang_timeout_s=0)


def test_a_group_at_the_end_of_its_run_is_not_a_hang():
    """No step for longer than ``hang_timeout_s`` while the ranks write the final checkpoint:
    ``stop_hung`` finds them finishing and kills nobody; the controller looks again a timeout
    later instead of recording a hang."""
    clock = Clock()

    class Finishing(FakeGroup):
        calls = 0

        def stop_hung(self, quiet_s):
            Finishing.calls += 1
            return [], False

    be = FakeBackend(N[:2], [[GroupStatus(records=[step_rec(1000, 1)])] + [GroupStatus()] * 6])
    be.start_group = lambda nodes, choice, attempt, dead: be.groups.append(
        (Finishing(nodes, be.scripts.pop(0), 1), choice)) or be.groups[-1][0]
    ctl, ev = make(be, clock, hang_timeout_s=5.0)
    ctl.step()
    ctl.step()
    for _ in range(4):
        clock.t += 2.0
        ctl.step()
    assert Finishing.calls == 1 and ev.of("hang") == [] and isinstance(ctl.state, RunningState)
    assert ctl._progress_at == 1006.0   # the next look comes a timeout after this one


def test_an_injected_notice_skips_the_emergency_checkpoint_that_cannot_commit_before_the_kill():
    """One node of two noticed (a replica survives): an emergency checkpoint on every node,
    unless the recent commit latency says it cannot commit before the kill."""
    clock = Clock()
    be = FakeBackend(N[:2], [[GroupStatus(records=[step_rec(1001, 1)])] * 3])
    ctl, ev = make(be, clock)
    ctl.step()
    for s_, t, commit in ((10, 1.0, 3.0), (20, 2.0, 4.0)):   # commits take 2 s after their step
        ev.emit("step", t=1000 + t, step=s_)
        ev.emit("checkpoint_committed", t=1000 + commit, step=s_, tier="memory")
    assert ctl.on_notice([0], 0.5, source="injected", notice_s=0.5) is False
    (notice,) = ev.of("notice")
    assert notice["save"] is False and "exceeds the 0.50s window" in notice["reason"] and notice["notice_s"] == 0.5
    assert be.groups[0][0].notified == [((0,), False)]   # the node still learns it is going away
    assert not be.groups[0][0].halted


def _pool_run(clock, durable, *, cloud=False, **cfg):
    """Two nodes running; the test delivers notices. The halted ranks fail at the next poll."""
    halted = [GroupStatus(errors=[RankError(r, N[r].node_id, False, "PreemptionHalt: rank halted")
                                  for r in (0, 1)])]
    be = FakeBackend(N[:2], [[GroupStatus(records=[step_rec(1001, 1)])] * 40 + halted,
                             [GroupStatus(finished=True, results={0: {"final_step": 9}})]])
    be.durable = durable
    ctl, ev = make(be, clock, **cfg)
    ctl.step()
    ctl.step()
    return be, ctl, ev


def test_a_notice_naming_every_node_halts_the_group_commits_its_last_step_durably_then_waits_for_the_kill():
    """Notices for node 1, then node 0: together every node of the group (no replica survives).
    No commit latency measured yet: the group halts at once; its ranks fail with
    PreemptionHalt; the failure is a preemption caused by the notice, dated at the halt; the
    newest step is made durable on every node before the deadline (``notice_commit``), and
    recovery starts only once the deadline passed (then on the replacement nodes)."""
    clock = Clock()
    be, ctl, ev = _pool_run(clock, None)
    group = be.groups[0][0]
    assert ctl.on_notice([1], 5.0, source="aws") is False and not group.halted
    deadline = clock.t + 4.0
    be.durable = {"step": 7, "tier": "local", "t": clock.t + 1.0}
    assert ctl.on_notice([0], 4.0, source="aws") is True
    assert group.halted and [d["what"] for d in ev.of("decision")][-1] == "pool_notice"
    assert [n["pool"] for n in ev.of("notice")] == [False, True]
    assert len(ev.of("halt")) == 1
    halted_at = clock.t
    be.groups[0][0].script = be.groups[0][0].script[-1:]   # the ranks' PreemptionHalt
    ctl.step()
    assert isinstance(ctl.state, RecoveringState)
    (fail,) = ev.of("failure")
    assert fail["kind"] == "preempt" and fail["cause"] == "notice" and ctl.state.failure.failed_at == halted_at
    assert be.durable_calls == [([N[0].node_id, N[1].node_id], deadline)]
    (nc,) = ev.of("notice_commit")
    assert nc["committed"] is True and nc["step"] == 7 and nc["tier"] == "local" and nc["margin_s"] == 3.0
    while clock.t < deadline + 5.0:     # the cloud takes its time: the nodes are still up
        ctl.step()
        assert isinstance(ctl.state, RecoveringState) and len(be.groups) == 1, "a group started before the kill"
    assert [d["what"] for d in ev.of("decision")].count("wait_for_preemption") == 1
    be.lost |= {N[0].node_id, N[1].node_id}   # gone
    be.nodes.append(N[2])               # and the replacement VM joins
    ctl.step()
    assert len(be.groups) == 2 and [n.node_id for n in be.groups[1][0].nodes] == [N[2].node_id]


def test_a_halted_group_that_has_not_failed_by_the_deadline_is_accounted_for_at_the_deadline():
    """The group halted for a pool notice, but its failure is not in by the deadline (a rank
    still writes its live state, or a noticed rank's death is not reported yet). The kill
    comes at the deadline, and with it the node actors that say what is durable: the
    controller polls no later than the deadline and logs ``notice_commit`` then, once, from
    the nodes' answer (the commit's own time: 0.1 s after the deadline is late), against the
    newest step a rank completed (the ranks' count, 8: rank 0's records said 1). The failure
    that follows does not log it again. (On the old code nothing was logged before the
    failure, when the killed nodes' actors could no longer answer.)"""
    clock = Clock()
    be, ctl, ev = _pool_run(clock, None)
    group = be.groups[0][0]
    group.current_step = lambda: 8
    deadline = clock.t + 2.0
    ctl.on_notice([0, 1], 2.0, source="injected")
    assert group.halted
    be.durable = {"step": 8, "tier": "local", "t": deadline + 0.1}
    waits = []
    poll = group.poll
    group.poll = lambda timeout_s: waits.append(timeout_s) or poll(timeout_s)
    while clock.t < deadline:
        ctl.step()   # no failure reported yet
        assert all(w <= deadline - clock.t + 1e-9 for w in waits[-1:]), "a poll would have outlived the deadline"
        assert not ev.of("notice_commit") and isinstance(ctl.state, RunningState)
        clock.t += min(0.15, waits[-1])
    ctl.step()
    (nc,) = ev.of("notice_commit")
    assert isinstance(ctl.state, RunningState) and abs(nc["t"] - deadline) < 1e-6
    assert nc["committed"] is False and nc["step"] == 8 and nc["last_step"] == 8 and nc["margin_s"] == -0.1, nc
    group.script = group.script[-1:]   # the ranks' PreemptionHalt, late
    ctl.step()
    assert isinstance(ctl.state, RecoveringState) and len(ev.of("notice_commit")) == 1
    assert len(be.durable_calls) == 1


def test_nodes_still_up_long_after_a_pool_notices_deadline_are_used_again():
    """A false notice: the nodes are still up 30 s after the deadline; recovery goes on with
    them (logged), instead of waiting for nodes that were never taken."""
    from cfdist.cluster.controller import NOTICE_GRACE_S

    clock = Clock()
    be, ctl, ev = _pool_run(clock, {"step": 3, "tier": "local", "t": clock.t})
    deadline = clock.t + 2.0
    ctl.on_notice([0, 1], 2.0, source="gcp")
    be.groups[0][0].script = be.groups[0][0].script[-1:]
    ctl.step()
    while clock.t < deadline + NOTICE_GRACE_S:
        ctl.step()
        assert len(be.groups) == 1
    ctl.step()
    (d,) = [d for d in ev.of("decision") if d["what"] == "notice_without_preemption"]
    assert d["nodes"] == ["n0", "n1"] and len(be.groups) == 2


def test_a_pool_notice_with_time_to_spare_trains_on_until_its_margin():
    """Durable commits took 0.5 s after their step, a step takes 1 s and the controller polls
    every 0.5 s: the margin is 2 x 0.5 + 1 + 0.5 = 2.5 s, so with a 10 s window the group trains
    7.5 s more, then halts."""
    clock = Clock()
    be, ctl, ev = _pool_run(clock, {"step": 12, "tier": "shared", "t": 0.0}, poll_s=0.5)
    for s_ in range(1, 8):
        ev.emit("step", t=1002.0 + s_, step=s_)
        ev.emit("checkpoint_committed", t=1002.5 + s_, step=s_, tier="local")
    ctl.on_notice([0, 1], 10.0, source="injected")
    group = be.groups[0][0]
    (d,) = [d for d in ev.of("decision") if d["what"] == "pool_notice"]
    assert d["halt_in_s"] == 7.5 and "margin 2.5s" in d["reason"]
    t_notice = clock.t
    while clock.t < t_notice + 7.5:
        assert not group.halted, f"halted {clock.t - t_notice:.1f}s after the notice, 7.5s wanted"
        ctl.step()
        clock.t += 0.5
    ctl.step()
    assert group.halted


@pytest.mark.parametrize("outcome", ["written", "error"])
def test_a_group_that_fails_before_a_pool_notices_halt_has_its_survivors_write_what_they_kept(outcome):
    """A pool notice whose halt is seconds away (durable commits measured), and rank 0 (a
    noticed rank) dies at once: rank 1's collective fails before any halt, so it kept its last
    step (7) in process, where the pool's kill takes it. At the failure the controller asks the
    group's survivors to write what they kept to disk (``save_kept``, with the notice's
    deadline) before it asks the nodes what is durable and before it retires the group (which
    drops the survivors' checkpointers), logs each outcome (``live_durable``, a failed write
    with its error), accounts for the notice once, and sends no halt to the failed group."""
    clock = Clock()
    be, ctl, ev = _pool_run(clock, None)
    for s_ in range(1, 6):
        ev.emit("step", t=1000.1 + s_ * 0.1, step=s_)
        ev.emit("checkpoint_committed", t=1000.15 + s_ * 0.1, step=s_, tier="local")
    group = be.groups[0][0]
    calls = []
    rows = ([{"rank": 1, "node_id": N[1].node_id, "step": 7, "written": 7, "why": "written"}] if outcome == "written"
            else [{"rank": 1, "node_id": N[1].node_id, "step": 7, "error": "TimeoutError: the write took 9 s"}])
    group.save_kept = lambda deadline: calls.append(("save_kept", deadline)) or rows
    commit_durable = be.commit_durable
    be.commit_durable = lambda nodes, deadline: calls.append(("commit_durable", deadline)) or commit_durable(
        nodes, deadline)
    be.retire_group = lambda g: calls.append(("retire", None))
    be.durable = {"step": 7, "tier": "local", "t": clock.t + 0.5} if outcome == "written" else \
        {"step": 5, "tier": "local", "t": clock.t}
    deadline = clock.t + 6.0
    assert ctl.on_notice([0, 1], 6.0, source="injected") is True
    (d,) = [d for d in ev.of("decision") if d["what"] == "pool_notice"]
    assert d["halt_in_s"] > 0 and not group.halted
    group.script = [GroupStatus(errors=[RankError(0, N[0].node_id, True, "ActorDiedError"),
                                        RankError(1, N[1].node_id, False, "RuntimeError: Connection reset by peer")])]
    group.current_step = lambda: 7
    ctl.step()
    assert isinstance(ctl.state, RecoveringState)
    assert calls == [("save_kept", deadline), ("commit_durable", deadline), ("retire", None)], calls
    (ld,) = ev.of("live_durable")
    assert (ld["rank"], ld["node"], ld["step"]) == (1, 1, 7)
    if outcome == "written":
        assert ld["written"] == 7 and "error" not in ld
    else:
        assert ld["error"] == "TimeoutError: the write took 9 s" and "written" not in ld
    (nc,) = ev.of("notice_commit")
    assert nc["committed"] is (outcome == "written") and nc["last_step"] == 7, nc
    for _ in range(100):   # the halt's time passes while recovery waits for the kill
        ctl.step()
        if len(be.groups) == 2:
            break
    assert len(be.groups) == 2 and clock.t >= deadline, "recovery did not wait for the kill"
    assert not group.halted and ev.of("halt") == [] and len(ev.of("notice_commit")) == 1


def test_without_live_recovery_a_pool_notice_is_an_emergency_checkpoint():
    """Live recovery off: no live state to save at a halt, so every node noticed is the plain
    emergency checkpoint (the ranks checkpoint at a step they agree on)."""
    clock = Clock()
    be, ctl, ev = _pool_run(clock, None, live_recovery=False)
    assert ctl.on_notice([0, 1], 30.0, source="gcp") is False
    assert not be.groups[0][0].halted and be.groups[0][0].notified == [((0, 1), True)]
    assert ev.of("halt") == [] and all(not n["pool"] for n in ev.of("notice"))
