"""From event logs to simulator costs and predictions (pure): windows, gaps, k, costs, prediction.

The logs are written here the way the driver writes them (one ``step`` record per step, commits,
failure marks), with round numbers, so every expected value can be worked out by hand.
"""

from __future__ import annotations

import pytest

from cfdist.chaos import Costs, FailureEvent, FixedK, Merged, commit_latencies, parse_event_log
from cfdist.chaos.calibrate import (
    iteration_time, k_at, measure_costs, predict, reported_k, step_gaps, time_lost, training_window,
    window_metrics,
)
from cfdist.chaos.schedules import Exponential, FixedInterval
from cfdist.chaos.simulator import simulate
from chaos_eventlog import started as _started


def test_training_window_starts_with_the_first_step_and_ends_with_the_last():
    log = _started(setup=1.0).run(20)
    log.at(0.3, "end", step=20)
    window, offset = training_window(parse_event_log(__import__("json").dumps(r) for r in log.recs))
    assert window[0]["event"] == "start" and window[-1] == {"t": window[-1]["t"], "event": "end", "step": 20}
    assert window[-1]["t"] == pytest.approx(0.5 + 1.0 + 19 * 0.1)   # last step, not the end record
    assert offset == pytest.approx(1.0 - 0.1)   # the first step began one iteration before its record
    m = window_metrics(window, iter_s=0.1, label="x")
    assert m.useful_iters == 20 and m.wall_s == pytest.approx(2.0) and m.goodput == pytest.approx(1.0)


def test_the_window_offset_counts_from_the_schedules_start_when_the_log_has_it():
    log = _started(setup=1.0).run(2)
    log.at(0.02, "schedule_started", step=2)   # the injector's clock starts after the first step(s)
    log.run(18)
    recs = parse_event_log(__import__("json").dumps(r) for r in log.recs)
    started = next(r["t"] for r in recs if r["event"] == "schedule_started")
    window, offset = training_window(recs)
    # the window starts one iteration before the first step record; the schedule's time 0 is
    # 0.02 s after the second step record: the offset is negative, and shifts events later
    assert window[0]["t"] - started == pytest.approx(offset) and offset == pytest.approx(-(0.1 + 0.1 + 0.02))


def test_a_run_that_never_trained_has_no_window():
    with pytest.raises(ValueError, match="never trained"):
        training_window([{"t": 0.0, "event": "start"}, {"t": 1.0, "event": "end", "step": 0}])


def test_step_gaps_skip_the_recovery_and_iteration_time_is_their_median():
    log = _started().run(12, extra_s=0.03).fail().run(6)
    gaps = step_gaps(log.recs)
    assert len(gaps) == 11 + 5   # no gap across the failure, nor from the restore to its first step
    assert iteration_time(log.recs) == pytest.approx(0.1)
    assert max(gaps) == pytest.approx(0.13)


def test_commit_latencies_count_each_execution_of_a_step():
    recs = [{"t": 1.0, "event": "step", "step": 5}, {"t": 1.2, "event": "checkpoint_committed", "step": 5},
            {"t": 1.3, "event": "checkpoint_committed", "step": 5},   # a second tier: same commit
            {"t": 3.0, "event": "step", "step": 5},                   # redone after a restore
            {"t": 3.5, "event": "checkpoint_committed", "step": 5},
            {"t": 4.0, "event": "checkpoint_committed", "step": 9}]   # no step record: skipped
    assert commit_latencies(recs) == pytest.approx([0.2, 0.5])


def test_reported_k_is_the_most_frequent_and_k_at_reads_the_last_step_before():
    recs = [{"t": 0.0, "event": "start"}] + [
        {"t": 0.1 * i, "event": "step", "step": i, "k": k} for i, k in enumerate([None] * 3 + [8] * 10 + [12] * 4, 1)]
    assert reported_k(recs) == 8
    assert k_at(recs, [0.25, 0.55, 1.65, 99.0]) == [None, 8, 12, 12]
    assert reported_k([{"t": 0.0, "event": "step", "step": 1}]) is None


def test_costs_from_one_run():
    log = _started().run(20, extra_s=0.02).fail(detect=0.1, restart=2.0, restore=1.0).run(10, extra_s=0.02)
    log.fail("preempt", detect=0.1, restart=3.0, restore=1.0).run(5)
    window, _ = training_window(log.recs)
    m = window_metrics(window, iter_s=0.1, label="x")
    costs, sample = measure_costs([window], [m])
    assert costs.iter_s == pytest.approx(0.1)
    assert costs.persist_s == pytest.approx(0.05) and costs.snapshot_s == 0.0
    # step 35's commit comes after the last step, outside the window
    assert sample.checkpoints == 6 and sample.recoveries == 2
    # 0.02 s extra after checkpoints 5, 10, 15 and 25 (the first step after a restart is no gap)
    assert sample.excess_s == pytest.approx(0.08) and costs.stall_s == pytest.approx(0.08 / 6)
    assert costs.detect_s == pytest.approx(0.1) and costs.notice_detect_s == pytest.approx(0.1)
    assert (costs.restart_s, costs.preempt_restart_s, costs.restore_s) == pytest.approx((2.0, 3.0, 1.0))
    assert costs.scratch_restore_s == costs.restore_s


def test_stall_is_measured_at_the_checkpoints_and_slow_iterations_stay_in_iter_s():
    """One checkpoint in a run whose first 40 iterations ran 20% slow (a shared machine): the
    checkpoint costs what its own gap took beyond an iteration, not the whole run's noise (the
    spread-out excess made an epoch policy's checkpoint look ten times dearer, and the simulator
    then decided a notice's emergency checkpoint could not fit); the slow iterations are time
    the run spent, so they are in ``iter_s``."""
    log = _started(k=50)
    log.ti = 0.12
    log.run(40)
    log.ti = 0.1
    log.run(60, extra_s=0.2)   # step 50 commits; its gap (50 -> 51) took 0.3 s
    window, _ = training_window(log.recs)
    m = window_metrics(window, iter_s=0.1, label="x")
    costs, sample = measure_costs([window], [m])
    # the checkpoint's gaps: into step 50 (0.1 s) and 50 -> 51 (0.3 s); the other 97 are outside
    outside = [0.12] * 39 + [0.1] * 58
    assert costs.iter_s == pytest.approx(sum(outside) / len(outside))
    assert sample.checkpoints == 1 and sample.gaps == 99
    assert costs.stall_s == pytest.approx(0.1 + 0.3 - 2 * costs.iter_s)
    assert sample.excess_s == pytest.approx(costs.stall_s)


@pytest.mark.parametrize("k, checkpoints", [(5, 20), (20, 5)])
def test_a_checkpoint_costs_the_same_measured_at_any_interval(k, checkpoints):
    """Steps of 0.1 s; each checkpoint adds 0.02 s to its own step's gap (the snapshot, taken in
    ``ckpt.step()`` before the step is recorded) and 0.03 s to the next (the gate, the persist
    on the same cores), committed 0.05 s after its step. 101 steps: checkpoints at k..100, all
    committed inside the window. Measured at k=5 or k=20, a checkpoint costs 0.05 s and a step
    0.1 s. (With the gap into the checkpointed step counted as a step, k=5 measured 0.105 s and
    0.025 s, k=20 0.10105 s and 0.0289 s: a plan calibrated at k=20 under-priced k=5's
    checkpoints, and the planner's Auto chose k=9 instead of 15.)"""
    log = _started(k=k, snap_s=0.02).run(101, extra_s=0.03)
    window, _ = training_window(log.recs)
    costs, sample = measure_costs([window], [window_metrics(window, iter_s=0.1, label="x")])
    assert sample.checkpoints == checkpoints and sample.gaps == 100
    assert costs.iter_s == pytest.approx(0.1)
    # inside: 20 gaps of 0.12 and 20 of 0.13 at k=5 (5 and 5 at k=20), 0.05 over 0.1 per checkpoint
    assert sample.excess_s == pytest.approx(checkpoints * 0.05)
    assert costs.stall_s == pytest.approx(0.05) and costs.persist_s == pytest.approx(0.05)


def test_a_start_from_scratch_and_a_restore_of_a_checkpoint_are_measured_apart():
    """The crash before the first checkpoint restarts from step 0 (2 s: the group's set-up);
    the later one restores step 10 (0.5 s): each its own cost, not their mean for both."""
    log = _started().run(3).fail(restore=2.0).run(10).fail("preempt", restore=0.5).run(5)
    window, _ = training_window(log.recs)
    m = window_metrics(window, iter_s=0.1, label="x")
    assert [f.restored_step for f in m.failures] == [0, 10]
    costs, sample = measure_costs([window], [m])
    assert sample.recoveries == 2
    assert (costs.restore_s, costs.scratch_restore_s) == pytest.approx((0.5, 2.0))
    # a run without a start from scratch takes that cost from the pooled runs
    only_ckpt = _started().run(12).fail(restore=0.5).run(5)
    w2, _ = training_window(only_ckpt.recs)
    c2, _ = measure_costs([w2], [window_metrics(w2, iter_s=0.1, label="y")], fallback=costs)
    assert (c2.restore_s, c2.scratch_restore_s) == pytest.approx((0.5, 2.0))


def test_a_failure_during_a_recovery_is_left_out_of_the_phase_means_and_fallbacks_fill_gaps():
    log = _started().run(10)
    log.at(0.01, "failure", kind="crash", step=10)
    log.at(0.1, "detected")
    log.at(0.5, "failure", kind="crash", step=10)   # during the restart: one interruption, 2 events
    log.at(0.1, "detected")
    log.at(2.0, "restarted")
    log.at(1.0, "restored", step=10, tier="memory")
    log.step = 10
    log.run(3)
    window, _ = training_window(log.recs)
    m = window_metrics(window, iter_s=0.1, label="x")
    assert [f.events for f in m.failures] == [2]
    fallback = Costs(iter_s=9.0, stall_s=0.5, persist_s=0.7, restore_s=4.0, restart_s=5.0, detect_s=6.0,
                     preempt_restart_s=7.0)
    costs, sample = measure_costs([window], [m], fallback=fallback)
    assert sample.recoveries == 0
    assert (costs.detect_s, costs.restart_s, costs.preempt_restart_s, costs.restore_s) == (6.0, 5.0, 7.0, 4.0)
    assert costs.notice_detect_s == 6.0   # the fallback has none: the crashes' detection
    assert costs.iter_s == pytest.approx(0.1) and costs.persist_s == pytest.approx(0.05)


def test_prediction_replays_the_schedule_over_the_window_on_the_measured_yardstick():
    costs = Costs(iter_s=0.1, stall_s=0.0, persist_s=0.05, restore_s=1.0, restart_s=2.0, detect_s=0.1)
    events = [FailureEvent(time_s=3.0, kind="crash", rank=0, node=0)]
    truth = simulate(events, FixedK(k=5), costs=costs, nodes=2, horizon_s=10.0)
    measured = window_metrics([{"t": 0.0, "event": "start"}, {"t": 10.0, "event": "step", "step": truth.useful_iters},
                               {"t": 10.0, "event": "end", "step": truth.useful_iters}], iter_s=0.08, label="m")
    p = predict(events, FixedK(k=5), costs=costs, nodes=2, workers_per_node=1, measured=measured, label="m")
    assert p.sim.useful_iters == truth.useful_iters and p.sim.num_failures == 1
    assert p.goodput == pytest.approx(measured.goodput) and p.relative_error == pytest.approx(0.0)
    slow = dataclass_replace(costs, restart_s=4.0)
    q = predict(events, FixedK(k=5), costs=slow, nodes=2, workers_per_node=1, measured=measured, label="m")
    assert q.relative_error == pytest.approx(-20 / truth.useful_iters, abs=1e-9)   # 2 s more restart: 20 steps


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_preempt_and_scratch_costs_change_the_simulated_recovery():
    base = Costs(iter_s=1.0, stall_s=0.0, persist_s=0.0, restore_s=2.0, restart_s=3.0, detect_s=0.0)
    crash = [FailureEvent(time_s=2.5, kind="crash", rank=0, node=0)]
    preempt = [FailureEvent(time_s=12.5, kind="preempt", node=0), FailureEvent(time_s=12.5, kind="return", node=0)]
    plain = simulate(crash + preempt, FixedK(k=5), costs=base, nodes=1, horizon_s=40.0)
    split = simulate(crash + preempt, FixedK(k=5), costs=dataclass_replace(base, preempt_restart_s=7.0,
                                                                           scratch_restore_s=1.5),
                     nodes=1, horizon_s=40.0)
    f0, f1 = plain.failures
    g0, g1 = split.failures
    assert (f0.restored_step, f0.restore_s, g0.restore_s) == (0, 0.0, 1.5)   # nothing to load, still a setup
    assert (f1.restart_s, g1.restart_s) == (3.0, 7.0)
    # plain resumes from scratch at 5.5 s and is at step 7 when preempted (2 lost); split resumes
    # at 7.0 s and is at step 5 (none lost): the setup cost nothing in the end, the restart 4 steps
    assert (f1.step, g1.step, f1.restored_step, g1.restored_step) == (7, 5, 5, 5)
    assert split.useful_iters == plain.useful_iters - 4


def test_merged_schedules_add_their_rates_and_keep_every_event():
    a = Exponential(20.0, kind="crash", seed=1)
    b = FixedInterval(15.0, seed=2, notice_s=1.0)
    m = Merged((a, b))
    assert m.mean_gap_s == pytest.approx(1 / (1 / 20 + 1 / 15))
    evs = m.events(2, 200.0)
    assert evs == sorted(a.events(2, 200.0) + b.events(2, 200.0), key=lambda e: e.time_s)
    assert m.events(2, 200.0) == evs
    with pytest.raises(ValueError, match="non-empty tuple"):
        Merged(())
    with pytest.raises(ValueError, match="events"):
        Merged((a, "not a schedule"))


def test_records_of_unknown_events_pass_unchecked_but_known_ones_are_checked():
    import json

    ok = parse_event_log([json.dumps({"t": 1.0, "event": "decision", "what": "restore", "step": None})])
    assert ok[0]["step"] is None   # the controller's decisions carry step=None before any checkpoint
    with pytest.raises(ValueError, match="int >= 0"):
        parse_event_log([json.dumps({"t": 1.0, "event": "restored", "step": None, "tier": "none"})])


def test_a_noticed_preemption_is_detected_after_notice_detect_s():
    costs = Costs(iter_s=1.0, stall_s=0.0, persist_s=0.0, restore_s=1.0, restart_s=2.0, detect_s=5.0)
    events = [FailureEvent(time_s=10.5, kind="preempt", node=0, notice_s=3.0),
              FailureEvent(time_s=10.5, kind="return", node=0)]
    (instant,) = simulate(events, FixedK(k=4), costs=costs, nodes=1, horizon_s=30.0).failures
    (seen,) = simulate(events, FixedK(k=4), costs=dataclass_replace(costs, notice_detect_s=1.5), nodes=1,
                       horizon_s=30.0).failures
    assert (instant.detect_s, seen.detect_s) == (0.0, 1.5)   # never the crashes' 5 s


def _window(gaps, *, iter_s=0.1, stalls=None, between=None, steps=None):
    """A training window as :func:`training_window` makes it: a start one ``iter_s`` before step
    1, a step record after each of ``gaps`` (step numbers ``steps``, default 1, 2, ...),
    ``stalls[i]``: rank 0's cumulative stall at step i, ``between[i]``: records (event, dt)
    written after step i (dt seconds after it), an end at the last step."""
    recs = [{"t": 0.0, "event": "start"}]
    t = 0.0
    steps = steps or list(range(1, len(gaps) + 1))
    for i, (g, s) in enumerate(zip(gaps, steps)):
        t += g
        recs.append({"t": round(t, 6), "event": "step", "step": s, "stall_s": (stalls or {}).get(i, 0.0)})
        for ev, dt, kw in (between or {}).get(i, ()):
            recs.append({"t": round(t + dt, 6), "event": ev, **kw})
    recs.append({"t": round(t, 6), "event": "end", "step": steps[-1]})
    return recs


def _parts_add_up(tl, window, iter_s=0.1):
    m = window_metrics(window, iter_s=iter_s, label="x")
    assert tl.window_s == pytest.approx(m.wall_s) and tl.useful_iters == m.useful_iters
    assert tl.lost_s == pytest.approx(m.wall_s - m.useful_iters * iter_s)
    assert 1 - tl.lost_s / tl.window_s == pytest.approx(m.goodput)


def test_time_lost_of_a_failure_free_run_is_its_steps_spread_and_its_stalls():
    # step 1 begins at the window's start; steps 4 and 7 run slow, step 9 fast; step 6 stalls 0.02 s
    gaps = [0.1, 0.1, 0.1, 0.13, 0.1, 0.1, 0.125, 0.1, 0.09, 0.1]
    w = _window(gaps, stalls={i: (0.02 if i >= 6 else 0.0) for i in range(10)})
    tl = time_lost(w, 0.1)
    assert tl.failures_s == 0.0 and tl.after_failures_s == 0.0
    assert tl.checkpoint_stalls_s == pytest.approx(0.02)   # counted once, at the step it grew
    assert tl.other_s == pytest.approx(0.03 + 0.005 - 0.01)
    _parts_add_up(tl, w)


def test_time_lost_splits_a_live_recovery_its_aftermath_and_the_rest():
    # steps 1-10 of 0.1 s; a failure after step 10; step 11 comes 0.35 s after step 10 (recovery);
    # the three steps that start within 0.25 s of the resume take 0.11 s; then 0.1 s, one 0.12
    rec = [("failure", 0.05, {"kind": "crash", "step": 10}), ("detected", 0.09, {}),
           ("restarted", 0.15, {}), ("restored", 0.3, {"step": 10}), ("resumed", 0.35, {"step": 11})]
    gaps = [0.1] * 10 + [0.35, 0.11, 0.11, 0.11, 0.1, 0.12, 0.1]
    w = _window(gaps, between={9: rec}, stalls={i: 0.004 for i in range(10)})   # a new process: stall from 0
    tl = time_lost(w, 0.1, after_s=0.25)
    assert tl.failures_s == pytest.approx(0.25)
    assert tl.after_failures_s == pytest.approx(0.03)
    assert tl.checkpoint_stalls_s == pytest.approx(0.0)   # the stall counter restarted: no growth, none counted
    assert tl.other_s == pytest.approx(0.02)
    _parts_add_up(tl, w)
    # the window's metrics, built already by the caller (the experiment's analysis), give the same split
    assert time_lost(w, 0.1, after_s=0.25, metrics=window_metrics(w, iter_s=0.1, label="x")) == tl


def test_time_lost_counts_both_gaps_of_a_failure_that_struck_as_a_step_completed_and_a_rollback():
    # As in a real log: the failure struck just before step 5 completed (its record lies between
    # steps 4 and 5), the recovery's records lie between step 5 and the next step, which
    # restored step 3 (a rollback: steps 4 and 5 are done again).
    gaps = [0.1, 0.1, 0.1, 0.1, 0.12, 0.3, 0.1, 0.1, 0.1]
    w = _window(gaps, steps=[1, 2, 3, 4, 5, 4, 5, 6, 7], between={
        3: [("failure", 0.119, {"kind": "crash", "step": 4})],
        4: [("detected", 0.05, {}), ("restarted", 0.1, {}), ("restored", 0.2, {"step": 3}),
            ("resumed", 0.3, {"step": 4})]})
    tl = time_lost(w, 0.1, after_s=0.0)
    # step 5's gap ran 0.02 s late; the recovery's gap: 0.3 s, going back from step 5 to step 4
    # (0.2 s of recovery, then the redone step 4, and step 5 to do again: 0.1 s more)
    assert tl.failures_s == pytest.approx(0.02 + 0.3 + 0.1)
    assert tl.other_s == pytest.approx(0.0) and tl.after_failures_s == 0.0
    _parts_add_up(tl, w)


def test_time_lost_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="empty training window"):
        time_lost([], 0.1)
    with pytest.raises(ValueError, match="iter_s must be positive"):
        time_lost(_window([0.1, 0.1]), 0.0)
    w = _window([0.1, 0.1])
    with pytest.raises(ValueError, match="measured against iter_s=0.2, not 0.1"):
        time_lost(w, 0.1, metrics=window_metrics(w, iter_s=0.2, label="x"))
