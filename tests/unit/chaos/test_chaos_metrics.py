"""Metrics from the JSONL event log: the documented example, merging rules, schema errors."""

import json

import pytest

from cfdist.chaos import metrics_from_log, parse_event_log, read_event_log
from cfdist.chaos.metrics import estimate_iter_s

DOC_EXAMPLE = [
    {"t": 100.0, "event": "start", "world_size": 8, "nodes": 2},
    {"t": 100.2, "event": "step", "step": 1},
    {"t": 102.1, "event": "step", "step": 10},
    {"t": 102.6, "event": "checkpoint_committed", "step": 10, "tier": "local"},
    {"t": 103.0, "event": "failure", "kind": "preempt", "step": 14, "node": 1},
    {"t": 104.0, "event": "detected"},
    {"t": 109.0, "event": "nodes_ready"},
    {"t": 112.0, "event": "restarted", "world_size": 8},
    {"t": 113.0, "event": "restored", "step": 10, "tier": "local"},
    {"t": 113.8, "event": "step", "step": 14},
    {"t": 120.0, "event": "end", "step": 45},
]


def _lines(records):
    return [json.dumps(r) + "\n" for r in records]


def test_the_documented_example(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text("".join(_lines(DOC_EXAMPLE)) + "\n")  # a trailing blank line is fine
    m = metrics_from_log(read_event_log(str(path)), iter_s=0.2)
    assert (m.wall_s, m.workers, m.useful_iters) == (20.0, 8, 45)
    assert m.goodput == pytest.approx(45 * 0.2 / 20.0)
    assert m.wasted_worker_s == pytest.approx(8 * 20.0 - 8 * 45 * 0.2)
    (f,) = m.failures
    assert (f.time_s, f.kind, f.step, f.restored_step, f.lost_iters) == (3.0, "preempt", 14, 10, 4)
    assert [f.detect_s, f.wait_s, f.restart_s, f.restore_s] == pytest.approx([1.0, 5.0, 3.0, 1.0])
    assert f.catchup_s == pytest.approx(0.8) and f.caught_up
    assert f.recovery_s == pytest.approx(10.8)
    assert (m.num_failures, m.lost_iters_mean, m.lost_iters_max) == (1, 4.0, 4)


def test_missing_marks_fold_into_the_next_phase_and_failures_in_recovery_merge():
    recs = [
        {"t": 0.0, "event": "step", "step": 5},
        {"t": 0.0, "event": "checkpoint_committed", "step": 5},
        {"t": 1.0, "event": "failure", "kind": "preempt", "step": 7},
        {"t": 2.0, "event": "failure", "kind": "crash", "step": 7},
        {"t": 4.0, "event": "restarted"},
        {"t": 6.0, "event": "restored", "step": 5, "tier": "local"},
        {"t": 7.0, "event": "step", "step": 6},
        {"t": 8.0, "event": "failure", "kind": "crash", "step": 6},
        {"t": 9.0, "event": "restored", "step": 5, "tier": "memory"},
        {"t": 10.0, "event": "step", "step": 9},
        {"t": 10.0, "event": "end", "step": 9},
    ]
    m = metrics_from_log(recs, iter_s=1.0)
    first, second = m.failures
    assert (first.events, first.kind, first.lost_iters) == (2, "crash", 2)
    assert [first.detect_s, first.wait_s, first.restart_s, first.restore_s] == [0.0, 0.0, 3.0, 2.0]
    assert first.catchup_s == 2.0 and not first.caught_up  # interrupted at t=8 before reaching 7
    assert (second.lost_iters, second.restore_s, second.catchup_s, second.caught_up) == (1, 1.0, 1.0, True)
    assert m.useful_iters == 9


def test_a_run_that_ends_while_recovering_counts_the_committed_step():
    recs = [
        {"t": 0.0, "event": "start"},
        {"t": 5.0, "event": "checkpoint_committed", "step": 40},
        {"t": 6.0, "event": "step", "step": 50},
        {"t": 6.5, "event": "failure", "kind": "preempt", "step": 50},
        {"t": 7.0, "event": "detected"},
        {"t": 20.0, "event": "end", "step": 50},
    ]
    m = metrics_from_log(recs, iter_s=0.1)
    (f,) = m.failures
    assert m.useful_iters == 40 and f.restored_step == 40 and not f.caught_up
    assert (f.detect_s, f.wait_s) == (0.5, 13.0)  # after "detected", the time is spent waiting


def test_a_failure_as_the_run_finishes_loses_nothing():
    """A node taken just after its ranks returned the last step (the injector logs the failure
    at the kill; the group had finished and nothing detected it): the run's end stands, no
    rollback to the last commit (an integration run under load counted 230 of 240 steps)."""
    recs = [
        {"t": 0.0, "event": "start"},
        {"t": 10.0, "event": "checkpoint_committed", "step": 230},
        {"t": 13.1, "event": "step", "step": 239},
        {"t": 13.2, "event": "failure", "kind": "preempt", "step": 239},
        {"t": 13.22, "event": "end", "step": 240},
    ]
    m = metrics_from_log(recs, iter_s=0.05)
    (f,) = m.failures
    assert m.useful_iters == 240 and f.lost_iters == 0 and f.caught_up, (m.useful_iters, f)


def test_iteration_time_is_estimated_from_consecutive_steps():
    recs = [{"t": 0.3 * i + (2.0 if i > 10 else 0.0), "event": "step", "step": i} for i in range(1, 21)]
    assert estimate_iter_s(recs) == pytest.approx(0.3)
    assert metrics_from_log(recs).iter_s == pytest.approx(0.3)
    with pytest.raises(ValueError, match="pass iter_s"):
        estimate_iter_s([{"t": 0.0, "event": "step", "step": 1}])


@pytest.mark.parametrize(
    "line, match",
    [
        ("not json", "not JSON"),
        ('{"t": 1.0}', 'string "event"'),
        ('{"event": "step", "step": 1}', '"t" must be'),
        ('{"t": 1.0, "event": "step"}', "needs 'step'"),
        ('{"t": 1.0, "event": "step", "step": -1}', "int >= 0"),
        ('{"t": 1.0, "event": "failure", "kind": "meteor", "step": 1}', "crash' or 'preempt"),
        ('{"t": 1.0, "event": "restored", "step": 3}', "needs 'tier'"),
        ('{"t": 0.5, "event": "detected"}', "earlier than"),
    ],
)
def test_schema_errors_name_the_line(line, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_event_log(['{"t": 1.0, "event": "start"}\n', line], source="run.jsonl")
    assert "run.jsonl:2" in str(info.value)


def test_unknown_events_pass_through_and_an_empty_log_is_refused():
    recs = parse_event_log(['{"t": 1.0, "event": "lr_changed", "lr": 0.1}', '{"t": 2.0, "event": "step", "step": 1}'])
    assert len(recs) == 2 and metrics_from_log(recs, iter_s=1.0).useful_iters == 1
    with pytest.raises(ValueError, match="empty"):
        metrics_from_log([])


def test_lost_work_is_reported_per_kind_and_per_source_of_the_restore():
    from cfdist.chaos.metrics import FailureRecord, RunMetrics

    fails = (FailureRecord(time_s=1.0, kind="crash", step=12, restored_step=12, tier="memory"),
             FailureRecord(time_s=2.0, kind="preempt", step=30, restored_step=29, tier="peer"),
             FailureRecord(time_s=3.0, kind="preempt", step=47, restored_step=40, tier="local"),
             FailureRecord(time_s=4.0, kind="crash", step=60, restored_step=59, tier="memory"),
             FailureRecord(time_s=5.0, kind="preempt", step=77, restored_step=70, tier="local"))
    m = RunMetrics(label="x", wall_s=10.0, iter_s=0.1, workers=2, useful_iters=80, failures=fails)
    assert m.lost_by_kind() == [
        {"kind": "crash", "tier": "memory", "failures": 2, "lost_iters_mean": 0.5, "lost_iters_max": 1},
        {"kind": "preempt", "tier": "peer", "failures": 1, "lost_iters_mean": 1.0, "lost_iters_max": 1},
        {"kind": "preempt", "tier": "local", "failures": 2, "lost_iters_mean": 7.0, "lost_iters_max": 7}]
    assert RunMetrics(label="y", wall_s=1.0, iter_s=0.1, workers=1, useful_iters=10).lost_by_kind() == []
