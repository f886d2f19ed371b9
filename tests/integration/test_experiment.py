"""A preemption experiment on a local 2-node Ray cluster: every policy, the same failures, measured and simulated.

Real: Ray (a ``ray.cluster_utils.Cluster`` of two fake nodes, started once for this module by
``run_experiment`` and shared by all its runs), ``cfdist.fit`` with one actor process per rank
and a ``NodeCheckpointer`` per node, DDP on gloo, checkpoints in the memory tier (/dev/shm) and
each node's own directory, the failure injector executing a chaos schedule on its clock (from
the first trained step, so a slow start on a loaded machine moves no failure in training; a
rank's process SIGKILLed; a node drained after a 1 s notice, with an emergency checkpoint when
it fits, then given back), the JSONL event logs, the simulator replaying the same schedule with
the costs measured from those logs. Faked: the machines (both nodes share this host's cores),
the model's size and compute (a zero buffer and a sleep stand in), the preempted VM (its node
is drained and returned, not replaced).

The points, one test each: every policy runs to its last step through the same two failures;
with recovery from the survivors' live state (``cfdist.fit``'s default) each failure loses at
most the step in progress, whatever the policy (the rollback to a commit, and its bound of 2k,
is tested at the ``cfdist.fit`` level and in the simulator's tables); and the simulator, given
each run's measured costs and told about live recovery, predicts that run's goodput within
``TOLERANCE``.
"""

from __future__ import annotations

import json
import os

import pytest

from cfdist.chaos.calibrate import training_window
from cfdist.chaos.metrics import read_event_log
from cfdist.experiments.experiment import ExperimentConfig, run_experiment

# The module's fixture runs five fits (the failure-free yardstick and four policies), each
# starting its rank processes: ~3 min on this idle 2-core machine, ~8 min beside one CPU hog
# (a first spawn took 76 s there). The suite's 300 s per test would cut it on a loaded machine.
pytestmark = pytest.mark.timeout(1200)

STEPS = 240
MTBF_S = 6.5

TOLERANCE = 0.30
"""|simulated / measured goodput - 1| per policy, the simulator given the run's own costs.

Measured on this 2-core machine: 0-6% over the policies of each run of this module (idle to
load average 6) and 2-3% for the full-size runs in docs/experiments.md. The epoch baseline was
the outlier (26% and 30% in two CI runs) while the calibration spread the whole run's step-time
noise over its one or two checkpoints (a 1.3 s "stall" where the checkpoint cost 0.1 s) and
charged a start from scratch (2.2 s) and a peer restore (0.1 s) their mean; measured apart
(``measure_costs``), the same logs give 4% where they gave 29% (cross-run prediction). 30%
without hiding a broken model: a simulator that ignored recovery or lost work would be off by
40% or more here (recovery is a third to a half of each window)."""


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    out = tmp_path_factory.mktemp("experiment")
    config = ExperimentConfig(
        out_dir=str(out), steps=STEPS, epoch_steps=STEPS, step_s=0.04, state_mb=8.0, mtbf_s=MTBF_S,
        max_scheduled=2, failures="mixed", notice_s=1.0, baseline_steps=60, seed=0)
    return run_experiment(config, log=lambda line: None)


def test_every_policy_finishes_through_the_same_failures(experiment):
    """Each policy reaches its last step; the failures it met are the schedule's, in order; the
    report's files are written."""
    res = experiment
    assert [r.policy for r in res.runs] == ["epoch", "every:10", "auto", "auto-mtbf"]
    assert res.baseline is not None and res.baseline.num_failures == 0
    for r in res.runs:
        assert r.final_step == STEPS and r.measured.useful_iters == STEPS, r.policy
        # the crash hits every run; the preemption 6.5 s later those still training then (a
        # slow recovery can still be under way: then both are one interruption, of kind crash)
        kinds = [f.kind for f in r.measured.failures]
        assert kinds in (["crash", "preempt"], ["crash"]), (r.policy, kinds)
        # The first failure lands when the schedule says, counted from the first trained step
        # (the injector's time 0), however long the start took: never early, at most a
        # controller tick or two late.
        due = MTBF_S - training_window(read_event_log(r.event_log))[1]
        assert due - 0.01 <= r.measured.failures[0].time_s < due + 3.0, (
            f"{r.policy}: first failure at {r.measured.failures[0].time_s:.2f}s of the window, due at {due:.2f}s")
    data = json.load(open(res.files["results.json"]))
    assert [run["policy"] for run in data["runs"]] == ["epoch", "every:10", "auto", "auto-mtbf"]
    for name in ("summary.png", "progress.png", "goodput.png", "lost_work.png", "recovery.png", "results.md"):
        assert os.path.getsize(res.files[name]) > 1000, name


def test_with_a_survivor_every_failure_loses_at_most_the_step_in_progress(experiment):
    """Both failures leave a rank running (a crash of one of two ranks, a preemption of one of
    two nodes): the survivor writes its live state, so every policy, the epoch baseline with
    one checkpoint per run included, loses at most the step in progress per failure."""
    for r in experiment.runs:
        for f in r.measured.failures:
            assert f.lost_iters <= 1, (r.policy, f)


def test_simulator_predicts_each_runs_goodput_within_tolerance(experiment):
    """The simulator, given the costs measured in a run, replays its schedule and policy and lands
    within TOLERANCE of the goodput measured over the same window."""
    for r in experiment.runs:
        err = r.prediction.relative_error
        assert abs(err) <= TOLERANCE, (
            f"{r.policy}: simulated {r.prediction.goodput:.3f} vs measured {r.measured.goodput:.3f} ({err:+.0%}) "
            f"over {r.measured.wall_s:.2f} s; costs {r.costs}; measured failures {list(r.measured.failures)}; "
            f"simulated failures {list(r.prediction.sim.failures)}; event log {r.event_log}")
        assert r.prediction.sim.num_failures >= 1
