"""Discrete-event simulator: tables with hand-computed answers, properties, and a full trace."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfdist.chaos import (
    Auto,
    Costs,
    EpochBoundary,
    Exponential,
    FailureAware,
    FailureEvent,
    FixedK,
    TraceReplay,
    bundled_trace,
    compare,
    event_log_from_metrics,
    metrics_from_log,
    simulate,
)
from cfdist.chaos.simulator import checkfreq_k, expected_waste_fraction, failure_aware_k, resolve_k

# Ti=1 s, no stall, commit 0.5 s after the checkpoint starts: easy arithmetic
SIMPLE = Costs(iter_s=1.0, stall_s=0.0, persist_s=0.5, restore_s=2.0, restart_s=3.0, detect_s=1.0)


def crash(t):
    return FailureEvent(time_s=t, kind="crash", rank=0, node=0)


def preempt(t, node=0, notice_s=0.0):
    return FailureEvent(time_s=t, kind="preempt", node=node, notice_s=notice_s)


def back(t, node=0):
    return FailureEvent(time_s=t, kind="return", node=node)


@pytest.mark.parametrize(
    "iter_s, stall_s, k, cycles",
    [(1.0, 0.5, 10, 10), (0.21, 0.04, 37, 100), (0.4, 0.05, 1, 1000), (2.0, 0.0, 5, 7)],
)
def test_no_failures_goodput_is_one_minus_checkpoint_overhead(iter_s, stall_s, k, cycles):
    costs = Costs(iter_s=iter_s, stall_s=stall_s, persist_s=0.0, restore_s=0.0, restart_s=0.0, detect_s=0.0)
    horizon = cycles * (k * iter_s + stall_s)
    r = simulate([], FixedK(k=k), costs=costs, nodes=2, horizon_s=horizon, workers_per_node=4)
    overhead = stall_s / (k * iter_s + stall_s)
    assert r.goodput == pytest.approx(1 - overhead, abs=1e-12)
    assert r.failure_free_goodput == pytest.approx(1 - overhead)
    assert r.useful_iters == cycles * k and r.num_failures == 0
    assert r.wasted_worker_s == pytest.approx(8 * cycles * stall_s)


def test_checkpoints_slower_than_k_iterations_gate_training():
    costs = Costs(iter_s=1.0, stall_s=0.0, persist_s=4.0, restore_s=0.0, restart_s=0.0, detect_s=0.0)
    r = simulate([], FixedK(k=2), costs=costs, nodes=1, horizon_s=4_000.0)
    assert r.failure_free_goodput == 0.5  # a cycle of 2 steps takes the 4 s persist
    assert r.goodput == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize(
    "t_fail, step, restored",
    [
        (25.2, 25, 20),  # checkpoint 20 committed at 20.5
        (20.3, 20, 10),  # checkpoint 20 still persisting: back to 10
        (20.5, 20, 20),  # committed exactly at the failure
        (9.9, 9, 0),  # no checkpoint yet: from scratch
        (39.99, 39, 30),
    ],
)
def test_single_failure_with_fixed_k_loses_exactly_the_expected_iterations(t_fail, step, restored):
    r = simulate([crash(t_fail)], FixedK(k=10), costs=SIMPLE, nodes=1, horizon_s=200.0)
    (f,) = r.failures
    assert (f.step, f.restored_step, f.lost_iters) == (step, restored, step - restored)
    assert (f.detect_s, f.wait_s, f.restart_s) == (1.0, 0.0, 3.0)
    assert f.restore_s == (2.0 if restored else 0.0)  # nothing to load without a checkpoint
    assert f.catchup_s == pytest.approx(step - restored)  # no stalls: one second per iteration
    assert f.caught_up and f.kind == "crash"
    resume = t_fail + 1.0 + 3.0 + f.restore_s
    assert r.useful_iters == restored + math.floor(200.0 - resume + 1e-9)


def test_recovery_waits_for_the_preempted_node_to_return():
    evs = [preempt(30.5, node=1), back(80.0, node=1)]  # checkpoint 30 commits at 30.5
    r = simulate(evs, FixedK(k=10), costs=SIMPLE, nodes=2, horizon_s=200.0)
    (f,) = r.failures
    assert (f.detect_s, f.wait_s, f.restart_s, f.restore_s) == (1.0, 48.5, 3.0, 2.0)
    assert f.lost_iters == 0 and f.recovery_s == pytest.approx(54.5)
    # node 1 was gone 30.5..80: 49.5 node-seconds not held
    held = 2 * 200.0 - 49.5
    assert r.worker_s == pytest.approx(held)
    assert r.wasted_worker_s == pytest.approx(held - 2 * r.useful_iters)


def test_a_node_that_never_returns_stalls_the_job_until_the_end():
    r = simulate([preempt(55.0)], FixedK(k=10), costs=SIMPLE, nodes=1, horizon_s=100.0)
    (f,) = r.failures
    assert not f.caught_up and f.wait_s == pytest.approx(44.0) and f.restart_s == 0.0
    assert r.useful_iters == 50  # the committed checkpoint
    assert r.progress[-1] == (100.0, 50)


def test_failures_during_recovery_join_it():
    # second crash during the restart (t=12..15 after detect 11): back to detect, one interruption
    r = simulate([crash(10.0), crash(13.0)], FixedK(k=5), costs=SIMPLE, nodes=1, horizon_s=100.0)
    (f,) = r.failures
    assert f.events == 2
    assert (f.detect_s, f.restart_s, f.restore_s) == (2.0, 2.0 + 3.0, 2.0)
    # a crash while waiting for nodes changes nothing (no workers to crash)
    r2 = simulate([preempt(10.0), crash(20.0), back(30.0)], FixedK(k=5), costs=SIMPLE, nodes=1, horizon_s=100.0)
    assert r2.failures[0].events == 1 and r2.failures[0].wait_s == pytest.approx(19.0)


def test_simultaneous_preemptions_are_one_failure():
    evs = [preempt(42.0, node=n) for n in range(4)] + [back(42.0, node=n) for n in range(4)]
    r = simulate(evs, FixedK(k=10), costs=SIMPLE, nodes=4, horizon_s=100.0)
    assert r.num_failures == 1 and r.failures[0].events == 4 and r.failures[0].lost_iters == 2


@pytest.mark.parametrize(
    "notice_s, step, restored",
    [
        (0.0, 25, 20),
        (0.2, 25, 20),  # notice at 25.5: step 26 would finish after the kill
        (2.0, 25, 24),  # notice at 23.7: checkpoint of step 24 commits at 24.5; training goes on
        (6.0, 25, 20),  # notice at 19.7: step 20 is the regular checkpoint anyway
        (5.2, 25, 21),  # notice at 20.5: step 21's checkpoint commits at 21.5
    ],
)
def test_preemption_notice_triggers_a_checkpoint_when_it_fits(notice_s, step, restored):
    r = simulate([preempt(25.7, notice_s=notice_s), back(25.7)], FixedK(k=10), costs=SIMPLE, nodes=1,
                 horizon_s=100.0)
    (f,) = r.failures
    assert (f.step, f.restored_step) == (step, restored)
    assert f.detect_s == (0.0 if notice_s else 1.0)


def test_emergency_checkpoint_waits_for_the_persist_in_flight():
    costs = Costs(iter_s=1.0, stall_s=0.0, persist_s=2.0, restore_s=0.0, restart_s=0.0, detect_s=0.0)
    # notice at 20.5: step 21 done at 21, waits for checkpoint 20 (commits 22), commits at 24
    ok = simulate([preempt(24.0, notice_s=3.5), back(24.0)], FixedK(k=10), costs=costs, nodes=1, horizon_s=50.0)
    late = simulate([preempt(23.9, notice_s=3.4), back(23.9)], FixedK(k=10), costs=costs, nodes=1, horizon_s=50.0)
    assert (ok.failures[0].step, ok.failures[0].restored_step) == (24, 21)
    assert (late.failures[0].step, late.failures[0].restored_step) == (23, 20)


def test_epoch_boundary_loses_more_than_a_small_fixed_k():
    costs = Costs(iter_s=0.4, stall_s=0.05, snapshot_s=0.6, persist_s=8.0, restore_s=20.0, restart_s=60.0,
                  detect_s=10.0)
    sched = Exponential(1_800.0, seed=5, kind="crash", ranks_per_node=8)
    epoch, small = compare(sched, [EpochBoundary(iters_per_epoch=5_000), FixedK(k=50)], costs=costs, nodes=4,
                           horizon_s=12 * 3600.0)
    assert epoch.num_failures == small.num_failures > 10
    assert epoch.lost_iters_mean > 10 * small.lost_iters_mean
    assert epoch.lost_iters_max > small.lost_iters_max
    assert epoch.goodput < small.goodput and epoch.wasted_worker_s > small.wasted_worker_s
    assert small.lost_iters_max <= 2 * 50  # invariant 2: at most 2k lost


@pytest.mark.parametrize(
    "iter_s, stall_s, snapshot_s, persist_s, p, want",
    [
        (1.0, 0.0, 0.0, 0.5, 0.035, 1),
        (0.4, 0.05, 0.6, 8.0, 0.035, 22),  # persist-bound: ceil(8.55/0.4)
        (0.21, 0.272, 0.04, 1.9, 0.035, 38),  # budget-bound: ceil(0.272/(0.035*0.21)) = ceil(37.007)
        (0.1, 0.02, 0.0, 0.3, 0.05, 4),  # budget ceil(0.02/0.005)=4 exactly, persist ceil(2.8)=3
        (1.0, 3.0, 0.0, 1.0, 0.5, 6),  # stall longer than the commit: budget decides
    ],
)
def test_checkfreq_k_table(iter_s, stall_s, snapshot_s, persist_s, p, want):
    assert checkfreq_k(iter_s=iter_s, stall_s=stall_s, snapshot_s=snapshot_s, persist_s=persist_s,
                       overhead_budget=p) == want


@settings(max_examples=200, deadline=None)
@given(
    iter_s=st.floats(0.01, 5.0),
    stall_s=st.floats(0.0, 5.0),
    commit_s=st.floats(0.0, 30.0),
    p=st.floats(0.005, 0.5),
    mtbf_s=st.floats(60.0, 1e6),
)
def test_failure_aware_k_is_the_brute_force_minimiser(iter_s, stall_s, commit_s, p, mtbf_s):
    args = dict(iter_s=iter_s, stall_s=stall_s, snapshot_s=0.0, persist_s=commit_s, overhead_budget=p)
    k_lo = checkfreq_k(**args)
    k = failure_aware_k(**args, mtbf_s=mtbf_s)
    young = math.sqrt(2 * stall_s * mtbf_s) / iter_s
    upper = max(k_lo, math.ceil(young)) + 50
    best = min(range(k_lo, upper + 1),
               key=lambda j: (expected_waste_fraction(j, iter_s=iter_s, stall_s=stall_s, mtbf_s=mtbf_s), j))
    assert k == best


def test_failure_aware_never_beats_the_budget_and_grows_when_failures_are_rare():
    costs = Costs(iter_s=0.4, stall_s=0.05, snapshot_s=0.6, persist_s=8.0, restore_s=20.0, restart_s=60.0,
                  detect_s=10.0)
    k_auto, why = resolve_k(Auto(), costs, mtbf_s=600.0)
    k_often, _ = resolve_k(FailureAware(mtbf_s=60.0), costs, mtbf_s=math.nan)
    k_rare, why_rare = resolve_k(FailureAware(mtbf_s=86_400.0), costs, mtbf_s=math.nan)
    assert k_auto == k_often == 22 < k_rare == round(math.sqrt(2 * 0.05 * 86_400) / 0.4)
    assert "Ti=0.4s" in why and "p=3.5%" in why and "MTBF=86400s" in why_rare
    # no failures at all: capped at the run length instead of growing forever
    r = simulate([], FailureAware(), costs=costs, nodes=1, horizon_s=400.0)
    assert r.k == 1_000
    with pytest.raises(ValueError, match="k_max"):
        failure_aware_k(iter_s=1.0, stall_s=1.0, snapshot_s=0.0, persist_s=0.0, overhead_budget=0.1, mtbf_s=math.inf)


def test_under_live_recovery_the_interval_answers_to_failures_that_take_every_replica():
    """A 2-node job: one node preempted every 100 s loses nothing with live recovery, so the
    oracle's MTBF counts only the instant both nodes went (once in 1000 s); Auto assumes its
    ``replica_loss_mtbf_s`` and lengthens the budget's interval, never shortens it."""
    from cfdist.chaos.simulator import estimate_mtbf

    costs = Costs(iter_s=0.4, stall_s=0.05, snapshot_s=0.6, persist_s=8.0, restore_s=20.0, restart_s=60.0,
                  detect_s=10.0)
    events = [e for t in range(100, 1000, 100) for e in (preempt(t, node=t // 100 % 2), back(t + 1, node=t // 100 % 2))]
    events += [preempt(950.0, node=0), preempt(950.0, node=1), crash(975.0)]
    events.sort(key=lambda e: e.time_s)
    assert estimate_mtbf(events, 1000.0) == pytest.approx(1000.0 / 11)
    assert estimate_mtbf(events, 1000.0, live=True, nodes=2) == pytest.approx(1000.0)
    assert estimate_mtbf(events, 1000.0, live=True, nodes=1) == pytest.approx(1000.0 / 11)
    assert estimate_mtbf([crash(5.0)], 10.0, live=True, nodes=1, workers_per_node=2) == math.inf
    k_budget, _ = resolve_k(Auto(), costs, mtbf_s=math.nan)
    k_live, why = resolve_k(Auto(), costs, mtbf_s=math.nan, live=True)
    assert k_budget == 22 and k_live == round(math.sqrt(2 * 0.05 * 3600) / 0.4) and "replica loss=3600s" in why
    k_costly, _ = resolve_k(Auto(replica_loss_mtbf_s=1.0), costs, mtbf_s=math.nan, live=True)
    assert k_costly == k_budget
    r_live = simulate(events, FailureAware(), costs=costs, nodes=2, horizon_s=1000.0, live=True)
    r_all = simulate(events, FailureAware(), costs=costs, nodes=2, horizon_s=1000.0)
    assert r_live.k > r_all.k and "MTBF=1000s" in r_live.k_reason


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Costs(iter_s=0.0, stall_s=0.0, persist_s=0.0, restore_s=0.0, restart_s=0.0, detect_s=0.0), "iter_s"),
        (lambda: Costs(iter_s=1.0, stall_s=-1.0, persist_s=0.0, restore_s=0.0, restart_s=0.0, detect_s=0.0), "stall_s"),
        (lambda: FixedK(k=0), "FixedK.k"),
        (lambda: EpochBoundary(iters_per_epoch=0), "iters_per_epoch"),
        (lambda: Auto(overhead_budget=3.5), "fraction"),
        (lambda: FailureAware(mtbf_s=0.0), "mtbf_s"),
        (lambda: simulate([], FixedK(k=1), costs=SIMPLE, nodes=1, horizon_s=math.inf), "finite"),
        (lambda: simulate([preempt(1.0, node=3)], FixedK(k=1), costs=SIMPLE, nodes=2, horizon_s=9.0), "num_nodes=2"),
    ],
)
def test_bad_inputs_are_refused_with_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(1, 200),
    mtbf=st.floats(20.0, 2_000.0),
    nodes=st.integers(1, 6),
    notice=st.sampled_from([0.0, 1.0, 30.0]),
    ret=st.sampled_from([0.0, 15.0, None]),
)
def test_properties_on_random_schedules(seed, k, mtbf, nodes, notice, ret):
    costs = Costs(iter_s=0.5, stall_s=0.1, snapshot_s=0.2, persist_s=2.0, restore_s=3.0, restart_s=5.0,
                  detect_s=2.0)
    sched = Exponential(mtbf, seed=seed, notice_s=notice, return_after_s=ret)
    r = simulate(sched, FixedK(k=k), costs=costs, nodes=nodes, horizon_s=5_000.0)
    assert r == simulate(sched, FixedK(k=k), costs=costs, nodes=nodes, horizon_s=5_000.0)
    calm = simulate([], FixedK(k=k), costs=costs, nodes=nodes, horizon_s=5_000.0)
    assert 0 <= r.goodput <= calm.goodput
    assert calm.goodput == pytest.approx(calm.failure_free_goodput, abs=0.01)  # long run: asymptote
    assert r.wasted_worker_s >= -1e-6
    committed_lag = math.ceil(costs.commit_s / costs.iter_s)
    for f in r.failures:
        assert 0 <= f.lost_iters <= k + max(k, committed_lag) + 1
        assert min(f.detect_s, f.wait_s, f.restart_s, f.restore_s, f.catchup_s) >= -1e-9
        assert f.time_s + f.recovery_s <= 5_000.0 + 1e-6
    times = [t for t, _ in r.progress]
    assert times == sorted(times) and r.progress[-1] == (5_000.0, r.useful_iters)


def test_simulated_run_survives_a_trip_through_the_event_log():
    costs = Costs(iter_s=0.5, stall_s=0.1, snapshot_s=0.2, persist_s=2.0, restore_s=3.0, restart_s=5.0,
                  detect_s=2.0)
    sched = Exponential(300.0, seed=11, notice_s=1.0, return_after_s=20.0)
    sim = simulate(sched, FixedK(k=30), costs=costs, nodes=3, horizon_s=6_000.0, workers_per_node=2)
    assert sim.num_failures > 5
    back_ = metrics_from_log(event_log_from_metrics(sim), iter_s=0.5, label=sim.label)
    assert back_.useful_iters == sim.useful_iters and back_.workers == 6
    assert back_.goodput == pytest.approx(sim.goodput)
    assert len(back_.failures) == len(sim.failures)
    for a, b in zip(back_.failures, sim.failures):
        assert (a.step, a.restored_step, a.kind, a.events, a.caught_up) == (b.step, b.restored_step, b.kind,
                                                                            b.events, b.caught_up)
        for p in ("detect_s", "wait_s", "restart_s", "restore_s", "catchup_s"):
            assert getattr(a, p) == pytest.approx(getattr(b, p), abs=1e-6)


def test_full_bamboo_p3_trace_replays_every_policy():
    costs = Costs(iter_s=0.5, stall_s=0.1, snapshot_s=1.8, persist_s=12.0, restore_s=30.0, restart_s=60.0,
                  detect_s=10.0)
    trace = TraceReplay(bundled_trace("bamboo-p3-trace.csv"))
    horizon = trace.span_s(16)
    policies = [EpochBoundary(iters_per_epoch=5_000), FixedK(k=100), Auto(), FailureAware()]
    results = compare(trace, policies, costs=costs, nodes=16, horizon_s=horizon)
    assert [r.label for r in results] == ["epoch", "k=100", "auto", "failure-aware"]
    assert len({r.num_failures for r in results}) == 1 and results[0].num_failures > 30
    assert any(f.wait_s > 0 for f in results[0].failures)  # the pool drops below 16 VMs
    epoch, _, auto, aware = results
    assert epoch.goodput < auto.goodput and epoch.lost_iters_mean > auto.lost_iters_mean
    assert aware.k >= auto.k
    assert all(0 < r.goodput < r.failure_free_goodput for r in results)


@pytest.mark.parametrize(
    "events, nodes, wpn, step, restored",
    [
        ([crash(25.2)], 2, 1, 25, 25),                    # the other rank's live state: nothing lost
        ([crash(20.3)], 2, 1, 20, 20),                    # checkpoint 20 still persisting: live is newer anyway
        ([preempt(25.2, node=1)], 2, 1, 25, 25),          # node 0 survives
        ([preempt(25.2, node=0), preempt(25.2, node=1)], 2, 1, 25, 20),   # the whole pool: the last commit
        ([crash(25.2)], 1, 1, 25, 20),                    # the only rank: no survivor
        ([crash(25.2)], 1, 2, 25, 25),                    # one node, two ranks: its peer survives
    ],
)
def test_live_recovery_loses_only_the_step_in_progress_while_a_replica_survives(events, nodes, wpn, step, restored):
    """With ``live=True`` a failure that leaves a rank running restores the last step it
    completed (CheckFreq's rollback only when every rank is gone); without, the newest commit."""
    evs = events + [back(60.0, node=e.node) for e in events if e.kind == "preempt"]
    r = simulate(evs, FixedK(k=10), costs=SIMPLE, nodes=nodes, workers_per_node=wpn, horizon_s=200.0, live=True)
    (f,) = r.failures
    assert (f.step, f.restored_step) == (step, restored)
    rollback = simulate(evs, FixedK(k=10), costs=SIMPLE, nodes=nodes, workers_per_node=wpn, horizon_s=200.0)
    assert rollback.failures[0].restored_step == (20 if step == 25 else 10)
    assert r.useful_iters >= rollback.useful_iters
