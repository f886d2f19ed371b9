"""The planner's cost model against hand-computed cases (tables), on fixed failure schedules.

Job: 1000 steps of 1 s on two nodes (one survives a preemption), no bytes to move, restart 10 s, detect 5 s, restore 2 s;
spot $1/node-hour, on-demand $3/node-hour, storage free. Every number below is worked out in
the comment beside it, not read back from the code.
"""

from __future__ import annotations

import math

import pytest

from cfdist.chaos import FailureEvent
from cfdist.planner import Candidate, Job, Prices, RateFailures, plan
from cfdist.planner.model import candidate_costs, run_once
from cfdist.planner.prices import InstancePrice

PRICE = InstancePrice(name="node", on_demand_per_hour=3.0, spot_per_hour=1.0)
PRICES = Prices(instances={"node": PRICE})


def job(**kw) -> Job:
    base = dict(iter_s=1.0, steps=1000, state_bytes=0, nodes=(2,), scaling=0.0, stall_s=0.0, persist_s=0.0, restore_s=2.0,
                restart_s=10.0, detect_s=5.0)
    return Job(**{**base, **kw})


def preempt(t: float, node: int = 0, back: float | None = None) -> list[FailureEvent]:
    out = [FailureEvent(time_s=t, kind="preempt", node=node)]
    out.append(FailureEvent(time_s=t if back is None else back, kind="return", node=node))
    return out


def outcome(j: Job, cand: Candidate, events: list[FailureEvent], deadline_s: float | None = None):
    m = candidate_costs(j, cand, mtbf_s=math.inf)
    return run_once(j, cand, m, PRICE, PRICES, lambda h: [e for e in events if e.time_s < h], deadline_s=deadline_s)


CASES = [
    # name, job changes, candidate, events, (seconds to finish, spot node-s, on-demand node-s, lost s)
    # no failures: 1000 steps + 9 stalls of 2 s (checkpoints after steps 100..900; the one of step
    # 1000 comes after the end)
    # (two nodes held: twice the seconds)
    ("no failure", dict(stall_s=2.0), Candidate(policy="every:100", nodes=2), [], (1018.0, 2036.0, 0.0, 0.0)),
    # one node, no speed-up (scaling 0): half the node-seconds
    ("no failure, 1 node", dict(nodes=(1,)), Candidate(policy="every:100", nodes=1), [], (1000.0, 1000.0, 0.0, 0.0)),
    # rolling back to shared checkpoints (every 10th) only: the stalls of the other checkpoints
    # are spread over the steps, 2 s / 100 steps each: 1000 x 1.02 s
    ("no failure, stalls spread", dict(stall_s=2.0), Candidate(policy="every:100", nodes=2, peer_copy=False), [],
     (1020.0, 2040.0, 0.0, 0.0)),
    # one preemption at 550 s, the node back at once. Step 500 ends at 508 (4 stalls) and commits;
    # at 550 the job is at step 540 (40 steps lost). Detect 5 + restart 10 + restore 2: resumes at
    # 567 from 500; 500 steps + 4 stalls later: 567 + 508 = 1075.
    ("one failure", dict(stall_s=2.0), Candidate(policy="every:100", nodes=2), preempt(550.0),
     (1075.0, 2150.0, 0.0, 40.0)),
    # without peer copy the replacement reads shared storage, which holds every 10th checkpoint:
    # none before step 1000, so the job starts again from step 0 (nothing to load: no restore
    # time) at 550 + 5 + 10 = 565 s and ends 1000 s later
    ("no peer copy: back to the shared checkpoint", {}, Candidate(policy="every:100", nodes=2, peer_copy=False),
     preempt(550.0), (1565.0, 3130.0, 0.0, 550.0)),
    # a one-node job has no peer to copy from: the same as without peer copy
    ("one node: back to the shared checkpoint", dict(nodes=(1,)), Candidate(policy="every:100", nodes=1),
     preempt(550.0), (1565.0, 1565.0, 0.0, 550.0)),
    # on-demand: nothing fails, billed at the on-demand price
    ("on-demand", {}, Candidate(policy="every:100", nodes=2, capacity="on-demand"), preempt(550.0),
     (1000.0, 0.0, 2000.0, 0.0)),
    # live recovery: node 1 survives the preemption at 550 s with step 550 done (1 s steps, no
    # stall); detect 5 + restart 10 + restore 2: resumes at 567 from 550, ends at 1017; nothing lost
    ("live: only the step in progress", {}, Candidate(policy="every:100", nodes=2, live=True), preempt(550.0),
     (1017.0, 2034.0, 0.0, 0.0)),
    # live recovery, but both nodes go at 550 s: no survivor, back to the step-500 checkpoint
    # (resume 567, end 1067, 50 steps lost), plus the rollback a failure of every node costs with
    # peer copy: (shared_every 10 - 1) x k 100 / 2 = 450 s (nothing to download): ends at 1517
    ("live, every node lost: back to the commit", {}, Candidate(policy="every:100", nodes=2, live=True),
     preempt(550.0, node=0) + preempt(550.0, node=1), (1517.0, 3034.0, 0.0, 500.0)),
    # node 0 is gone for 300 s: detect 5, wait until 850, restart 10, restore 2: resumes at 862
    # from 500, ends at 1362; billed while up: node 1 1362 s, node 0 550 s + (1362 - 850) s
    ("slow return", {}, Candidate(policy="every:100", nodes=2), preempt(550.0, back=850.0),
     (1362.0, 1362.0 + 1062.0, 0.0, 50.0)),
]


@pytest.mark.parametrize("name,changes,cand,events,want", CASES, ids=[c[0] for c in CASES])
def test_hours_and_dollars_by_hand(name, changes, cand, events, want):
    j = job(**changes)
    o = outcome(j, cand, events)
    end_s, spot_s, od_s, lost_s = want
    assert o.hours == pytest.approx(end_s / 3600)
    assert o.spot_node_hours == pytest.approx(spot_s / 3600)
    assert o.on_demand_node_hours == pytest.approx(od_s / 3600)
    assert o.lost_hours == pytest.approx(lost_s / 3600)
    assert o.dollars == pytest.approx(spot_s / 3600 * 1.0 + od_s / 3600 * 3.0)
    assert o.goodput == pytest.approx(1000.0 / end_s)


def test_a_deadline_that_forces_on_demand():
    """Deadline 1200 s: the uniform line is at step 500 at 600 s. The preemption at 550 s leaves
    the job at its step-500 checkpoint with node 0 gone for good: it falls below the line at
    600 s, before it could ever resume on spot, so it switches then. Restart 10 + restore 2:
    trains from 612 s, ends at 1112 s (in time) on on-demand (spot never has both nodes again).
    Spot billed: both nodes 0-550 s, node 1 550-600 s (1150 node-s); on-demand: two nodes
    600-1112 s (1024 node-s). Plain spot on the same schedule never finishes."""
    j, events = job(), [FailureEvent(time_s=550.0, kind="preempt", node=0)]
    up = outcome(j, Candidate(policy="every:100", nodes=2, capacity="uniform-progress"), events, deadline_s=1200.0)
    assert up.switched_at_h == pytest.approx(600.0 / 3600)
    assert up.hours == pytest.approx(1112.0 / 3600)
    assert up.spot_node_hours == pytest.approx(1150.0 / 3600)
    assert up.on_demand_node_hours == pytest.approx(1024.0 / 3600)
    assert up.dollars == pytest.approx(1150.0 / 3600 * 1.0 + 1024.0 / 3600 * 3.0)
    assert up.lost_hours == pytest.approx(50.0 / 3600)
    with pytest.raises(ValueError, match="does not finish"):
        outcome(j, Candidate(policy="every:100", nodes=2), events)


def test_uniform_progress_goes_back_to_spot_when_ahead_again():
    """As above, but node 0 is back at 850 s. On on-demand from 612 s at step 500, checkpoints
    commit at 712 s (step 600), 812 s (700), 912 s (800). Going back costs 12 s, so a checkpoint
    qualifies when its step >= 1000/1200 x (commit + 12): 600 < 603 no; 700 >= 687 but node 0 is
    still down at 812 s; 800 >= 770 and both up: back to spot at 912 s, training from 924 s, ends
    at 1124 s. On-demand: two nodes 600-912 s (624 node-s). Spot: 1150 node-s before, 2 x 12 for
    the switch, 2 x 200 after: 1574 node-s. Plain spot ends at 1362 s, too late."""
    j, events = job(), preempt(550.0, back=850.0)
    up = outcome(j, Candidate(policy="every:100", nodes=2, capacity="uniform-progress"), events, deadline_s=1200.0)
    assert up.switched_at_h == pytest.approx(600.0 / 3600)
    assert up.hours == pytest.approx(1124.0 / 3600)
    assert up.on_demand_node_hours == pytest.approx(624.0 / 3600)
    assert up.spot_node_hours == pytest.approx(1574.0 / 3600)
    assert up.dollars == pytest.approx(1574.0 / 3600 * 1.0 + 624.0 / 3600 * 3.0)
    spot = outcome(j, Candidate(policy="every:100", nodes=2), events)
    assert spot.hours == pytest.approx(1362.0 / 3600) and spot.hours > 1200.0 / 3600


def test_uniform_progress_stays_on_spot_when_on_the_line():
    """A lax deadline (3000 s): at 550 s the line is at step 183, the checkpoint at 500 is above
    it, so the job resumes on spot and ends as plain spot does (567 + 500 = 1067 s)."""
    up = outcome(job(), Candidate(policy="every:100", nodes=2, capacity="uniform-progress"), preempt(550.0),
                 deadline_s=3000.0)
    assert up.switched_at_h is None
    assert up.hours == pytest.approx(1067.0 / 3600)
    assert up.on_demand_node_hours == 0.0


def test_a_failure_of_every_node_is_charged_the_rollback_to_shared_storage():
    """Two nodes lost at once, peer copy on: no survivor holds the step-500 checkpoint, so the
    model adds the mean distance to the newest shared one, (shared_every - 1) * k / 2 = 450 steps,
    on top of the simulated run (567 + 500 = 1067 s): 1517 s, and 2 x 450 node-s more."""
    j = job()
    events = preempt(550.0, node=0) + preempt(550.0, node=1)
    o = outcome(j, Candidate(policy="every:100", nodes=2), events)
    assert o.hours == pytest.approx(1517.0 / 3600)
    assert o.spot_node_hours == pytest.approx((2 * 1067.0 + 2 * 450.0) / 3600)


def test_codec_ratio_scales_persist_and_shared_transfers():
    j = job(state_bytes=10**9, persist_s=8.0, shared_bytes_per_s=1e8)
    raw = candidate_costs(j, Candidate(policy="every:100", tiers="shared"), mtbf_s=math.inf)
    half = candidate_costs(j, Candidate(policy="every:100", tiers="shared", codec="zstd", codec_ratio=0.5),
                           mtbf_s=math.inf)
    assert raw.costs.persist_s == pytest.approx(10.0) and half.costs.persist_s == pytest.approx(5.0)
    assert half.checkpoint_gb == pytest.approx(0.5)
    local = candidate_costs(j, Candidate(policy="every:100", nodes=2, codec="zstd", codec_ratio=0.5),
                            mtbf_s=math.inf)
    assert local.costs.persist_s == pytest.approx(4.0)


def test_plan_sorts_by_dollars_and_refuses_an_impossible_deadline():
    j = job()
    none = RateFailures(per_node_hour=0.0)
    cands = [Candidate(policy="every:100", nodes=2, capacity=c) for c in ("spot", "on-demand")]
    result = plan(j, failures=none, prices=PRICES, candidates=cands, seeds=3,
                  events_for=lambda n, h, s: [e for e in preempt(550.0) if e.time_s < h])
    assert [r.candidate.capacity for r in result.rows] == ["spot", "on-demand"]
    assert [r.dollars for r in result.rows] == sorted(r.dollars for r in result.rows)
    assert result.rows[0].to_json()["p90_hours"] == pytest.approx(1067.0 / 3600)
    with pytest.raises(ValueError, match="impossible deadline"):
        plan(j, failures=none, prices=PRICES, candidates=cands, deadline_h=0.1)


def test_live_recovery_needs_a_survivor_to_copy_from():
    for cand in (dict(nodes=1), dict(nodes=2, peer_copy=False), dict(nodes=2, tiers="shared")):
        with pytest.raises(ValueError, match="live recovery needs a survivor"):
            Candidate(policy="every:100", live=True, **cand)
