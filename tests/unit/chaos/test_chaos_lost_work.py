"""Lost work and recovery time, defined once (``cfdist.chaos.metrics``), checked on event-log tables.

Each case is a compact script of driver records; the expected per-interruption numbers are
``(step at failure, restored step, lost iterations, resume_s, merged events)``. The same
records go through ``cfdist.cluster.result.failure_stats`` (what ``FitResult`` reports), which
must agree with ``metrics_from_log``.
"""

from __future__ import annotations

import pytest

from cfdist.chaos.metrics import lost_iterations, metrics_from_log
from cfdist.cluster.result import FailureStats, FitResult, failure_stats


def script(*items):
    """``("step", 93)``, ``("commit", 90)``, ``("fail", 93)``, ``("detected",)``, ``("restarted",)``,
    ``("restored", 90)``, ``("end", 100)``: one record per second from t=0."""
    recs = [{"t": 0.0, "event": "start", "world_size": 2}]
    for i, it in enumerate(items, 1):
        kind, *arg = it
        rec = {"t": float(i)}
        if kind == "step":
            rec.update(event="step", step=arg[0])
        elif kind == "commit":
            rec.update(event="checkpoint_committed", step=arg[0], tier="memory")
        elif kind == "fail":
            rec.update(event="failure", kind="crash", step=arg[0])
        elif kind == "restarted":
            rec.update(event="restarted", world_size=2)
        elif kind == "restored":
            rec.update(event="restored", step=arg[0], tier="memory" if arg[0] else "none")
        elif kind == "end":
            rec.update(event="end", step=arg[0])
        else:
            rec.update(event=kind)
        recs.append(rec)
    return recs


RESTART = (("detected",), ("restarted",))
CASES = {
    # the first example: a crash at 93 restored from 90 redoes 3 steps
    "crash at 93 from 90": (
        [("step", 90), ("commit", 90), ("step", 93), ("fail", 93), *RESTART, ("restored", 90), ("step", 91),
         ("step", 93), ("end", 93)],
        [(93, 90, 3, 4.0, 1)]),
    # the second: a crash during a restart, after the restore, before any step ran, loses nothing
    "crash before the first step of a restart": (
        [("step", 90), ("commit", 90), ("step", 93), ("fail", 93), *RESTART, ("restored", 90),
         ("fail", 90), *RESTART, ("restored", 90), ("step", 91), ("end", 91)],
        [(93, 90, 3, None, 1), (90, 90, 0, 4.0, 1)]),
    # a failure before the restore joins the interruption: the 3 steps count once
    "crash during recovery joins it": (
        [("step", 90), ("commit", 90), ("step", 93), ("fail", 93), ("detected",), ("fail", 93), *RESTART,
         ("restored", 90), ("step", 91), ("end", 91)],
        [(93, 90, 3, 6.0, 2)]),
    # a checkpoint of the failing step itself committed: nothing to redo
    "restored the step that failed": (
        [("step", 95), ("commit", 95), ("fail", 95), *RESTART, ("restored", 95), ("step", 96), ("end", 96)],
        [(95, 95, 0, 4.0, 1)]),
    # nothing committed: from scratch, every step is redone
    "from scratch": (
        [("step", 4), ("fail", 4), *RESTART, ("restored", 0), ("step", 1), ("end", 1)],
        [(4, 0, 4, 4.0, 1)]),
    # the run ended while recovering: it never resumed
    "never resumed": (
        [("step", 90), ("commit", 90), ("step", 92), ("fail", 92), ("detected",), ("end", 90)],
        [(92, 90, 2, None, 1)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_lost_iterations_and_resume_time_from_the_event_log(name):
    items, want = CASES[name]
    recs = script(*items)
    got = [(f.step, f.restored_step, f.lost_iters, f.resume_s, f.events)
           for f in metrics_from_log(recs, iter_s=1.0).failures]
    assert got == want
    stats = failure_stats(recs)
    assert [(f.step, f.restored_step, f.lost_iterations, f.recovery_s, f.events) for f in stats] == want
    result = FitResult(final_step=0, steps=0, failures=sum(w[4] for w in want), failure_stats=stats)
    assert result.lost_iterations == [w[2] for w in want]
    assert result.recovery_seconds == [w[3] for w in want]


def test_fit_result_phases_come_from_the_same_records():
    recs = script(("step", 90), ("commit", 90), ("step", 93), ("fail", 93), *RESTART, ("restored", 90),
                  ("step", 91), ("end", 91))
    (f,) = failure_stats(recs)
    assert isinstance(f, FailureStats)
    assert (f.detect_s, f.restart_s, f.restore_s, f.resume_s) == (1.0, 1.0, 1.0, 4.0)
    assert (f.tier, f.world_size, f.kind) == ("memory", 2, "crash")


@pytest.mark.parametrize("step, restored, lost", [(93, 90, 3), (90, 90, 0), (89, 90, 0), (4, 0, 4)])
def test_lost_iterations_table(step, restored, lost):
    assert lost_iterations(step, restored) == lost


def test_recovery_phases_split_a_resumed_recovery_and_skip_one_interrupted():
    from cfdist.chaos.metrics import recovery_phases

    recs = [
        {"t": 0.0, "event": "start"},
        {"t": 10.0, "event": "failure", "kind": "crash", "step": 93},
        {"t": 10.2, "event": "detected"},
        {"t": 10.5, "event": "restarted", "reused": 2, "spawn_s": 0.01, "rendezvous_s": 0.02},
        {"t": 11.0, "event": "restored", "step": 90, "tier": "memory", "setup_s": 0.3, "load_s": 0.01},
        {"t": 11.1, "event": "step", "step": 91},
        {"t": 11.1, "event": "resumed", "step": 91, "first_step_s": 0.1, "recovery_s": 1.1},
        {"t": 20.0, "event": "failure", "kind": "preempt", "step": 100},
        {"t": 20.5, "event": "detected"},
        {"t": 21.0, "event": "failure", "kind": "crash", "step": 100},   # during the recovery
        {"t": 21.5, "event": "detected"},
        {"t": 22.0, "event": "restarted", "reused": 0},
        {"t": 23.0, "event": "restored", "step": 100, "tier": "peer"},
        {"t": 23.5, "event": "resumed", "step": 101},
    ]
    first, second = recovery_phases(recs)
    assert first["tier"] == "memory" and first["reused"] == 2
    assert [round(first[k], 6) for k in ("detect", "restart", "restore", "first_step", "total")] == [0.2, 0.3, 0.5, 0.1, 1.1]
    assert (first["spawn"], first["rendezvous"], first["setup"], first["load"]) == (0.01, 0.02, 0.3, 0.01)
    assert second["kind"] == "crash" and second["tier"] == "peer" and second["total"] == 2.5
