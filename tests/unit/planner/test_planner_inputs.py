"""The planner's inputs: price YAML (and its errors), SkyPilot traces, failure schedules, the job."""

from __future__ import annotations

import json
import math

import pytest

from cfdist.planner import Candidate, Job, RateFailures, TraceFailures, load_prices, parse_prices, parse_skypilot, resolve_trace
from cfdist.planner.failures import skypilot_membership
from cfdist.planner.model import candidate_costs
from cfdist.planner.prices import example_prices_path

GOOD = {"currency": "USD", "instances": {"a": {"on_demand_per_hour": 3.0, "spot_per_hour": 1.0}},
        "storage": {"shared_per_gb_month": 0.02, "egress_per_gb": 0.01}}


def test_example_prices_ship_dated_and_parse():
    path = example_prices_path()
    with open(path, encoding="utf-8") as f:
        head = f.read(300)
    assert "2026-12" in head and "not a quote" in head
    prices = load_prices()
    assert prices.instances and all(p.spot_per_hour < p.on_demand_per_hour for p in prices.instances.values())


def test_prices_parse():
    p = parse_prices(GOOD, source="p.yaml")
    assert p.instance(None).spot_per_hour == 1.0
    assert (p.shared_per_gb_month, p.egress_per_gb) == (0.02, 0.01)


@pytest.mark.parametrize("data,match", [
    ({**GOOD, "region": "x"}, r"unknown key\(s\) 'region'"),
    ({"instances": {"a": {"on_demand_per_hour": 3.0, "spot_per_hour": -1}}}, "spot_per_hour must be a number >= 0"),
    ({"instances": {"a": {"on_demand_per_hour": 3.0}}}, "missing spot_per_hour"),
    ({"instances": {"a": {"on_demand_per_hour": 3.0, "spot_per_hour": 1, "gpus": 8}}}, "unknown key.*'gpus'"),
    ({"instances": {}}, "'instances' must map"),
    ({**GOOD, "storage": {"shared_per_gb": 1}}, "unknown key.*'shared_per_gb'"),
    ([1, 2], "expected a mapping"),
])
def test_price_errors_name_the_key(data, match):
    with pytest.raises(ValueError, match=match):
        parse_prices(data, source="p.yaml")


def test_missing_instance_type_names_the_ones_there():
    p = parse_prices({"instances": {"a": GOOD["instances"]["a"], "b": GOOD["instances"]["a"]}}, source="p.yaml")
    with pytest.raises(ValueError, match="no instance type 'c'; it has a, b"):
        p.instance("c")
    with pytest.raises(ValueError, match="choose one with --instance"):
        p.instance(None)


def test_bad_yaml_is_one_clear_error(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("instances: {a: [\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_prices(str(bad))


SKY = '{"metadata": {"gap_seconds": 300}, "data": [2, 2, 1, 1, 2, 0, 2]}'


def test_skypilot_parser_and_events(tmp_path):
    gap, counts = parse_skypilot(SKY)
    assert gap == 300.0 and counts == [2, 2, 1, 1, 2, 0, 2]
    m = skypilot_membership(gap, counts, seed=0)
    assert [(t, a) for t, a, _ in m] == [(0.0, "add"), (0.0, "add"), (600.0, "remove"), (1200.0, "add"),
                                          (1500.0, "remove"), (1500.0, "remove"), (1800.0, "add"), (1800.0, "add")]
    path = tmp_path / "us-east-2b_v100_1.json"
    path.write_text(SKY)
    tf = TraceFailures(path=str(path), windows=1)
    assert tf.max_nodes() == 2
    evs = tf.events(2, 1800.0, seed=0)
    # one of the two VMs leaves at 600 s and comes back at 1200 s; both leave at 1500 s
    assert [(e.time_s, e.kind) for e in evs] == [(600.0, "preempt"), (1200.0, "return"), (1500.0, "preempt"),
                                                  (1500.0, "preempt")]
    # the trace is 1800 s long: a longer horizon replays it from its start (every slot up again
    # at 1800 s), so the preemption at 600 s comes again at 2400 s
    longer = [(e.time_s, e.kind) for e in tf.events(2, 2500.0, seed=0) if e.time_s >= 1800.0]
    assert {k for t, k in longer if t == 1800.0} == {"return"}
    assert [x for x in longer if x[0] > 1800.0] == [(2400.0, "preempt")]


@pytest.mark.parametrize("text,match", [
    ("[1, 2]", "expected"),
    ('{"metadata": {"gap_seconds": 0}, "data": [1]}', "gap_seconds must be seconds > 0"),
    ('{"data": [1, -2]}', r"data\[1\] must be an int >= 0"),
    ('{"data": []}', "data is empty"),
    ("{not json", "is not JSON"),
])
def test_skypilot_parser_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_skypilot(text, source="t.json")


def test_unknown_trace_names_the_bundled_ones():
    with pytest.raises(ValueError, match="bamboo-p3-trace.csv"):
        resolve_trace("no-such-trace.csv")


def test_bundled_trace_windows_differ_and_tile():
    tf = TraceFailures(path=resolve_trace("bamboo-p3-trace.csv"), windows=4)
    a, b = tf.events(4, 86400.0, seed=0), tf.events(4, 86400.0, seed=1)
    assert a != b
    assert max(e.time_s for e in a) > 11.4 * 3600     # longer than one pass of the 11.4 h trace
    assert all(0 <= e.node < 4 for e in a)
    assert 0 < tf.mtbf_s(4) < 86400


def test_rate_failures_take_every_node_with_p_all():
    r = RateFailures(per_node_hour=1.0, p_all=1.0, return_after_s=60.0)
    evs = r.events(3, 36000.0, seed=2)
    preempts = [e for e in evs if e.kind == "preempt"]
    assert preempts and len(preempts) % 3 == 0
    by_t = {}
    for e in preempts:
        by_t.setdefault(e.time_s, set()).add(e.node)
    assert all(nodes == {0, 1, 2} for nodes in by_t.values())
    assert r.mtbf_s(3) == pytest.approx(1200.0)
    single = RateFailures(per_node_hour=1.0).events(3, 36000.0, seed=2)
    assert len({e.time_s for e in single if e.kind == "preempt"}) == len([e for e in single if e.kind == "preempt"])
    assert RateFailures(per_node_hour=0.0).events(3, 1e6, seed=0) == [] and math.isinf(RateFailures(per_node_hour=0.0).mtbf_s(3))


def test_job_validation_and_scaling():
    j = Job(iter_s=2.0, steps=10, state_bytes=0, nodes=(1, 2, 4), ref_nodes=2)
    assert [j.iter_s_on(n) for n in (1, 2, 4)] == [4.0, 2.0, 1.0]
    assert Job(iter_s=2.0, steps=10, state_bytes=0, ref_nodes=2, scaling=0.0).iter_s_on(4) == 2.0
    with pytest.raises(ValueError, match="Job.steps must be an int >= 1"):
        Job(iter_s=1.0, steps=0, state_bytes=0)
    with pytest.raises(ValueError, match="Job.iter_s must be a finite number > 0"):
        Job(iter_s=-1.0, steps=1, state_bytes=0)


def _log(path):
    """A 2-node run: steps of 0.5 s, a checkpoint every 10 steps (0.2 s of stall, committed 1 s
    after its step), a preemption at step 25, back at its step-20 checkpoint."""
    recs, t = [{"t": 0.0, "event": "start", "world_size": 4, "nodes": 2}, {"t": 0.1, "event": "restarted"}], 0.6
    step = 0

    def steps(n):
        nonlocal t, step
        for _ in range(n):
            step += 1
            t += 0.5 + (0.2 if step % 10 == 1 and step > 1 else 0.0)
            recs.append({"t": round(t, 6), "event": "step", "step": step})
            if step % 10 == 0:
                recs.append({"t": round(t + 1.0, 6), "event": "checkpoint_committed", "step": step, "tier": "local"})
    steps(25)
    for dt, ev, kw in ((0.1, "failure", {"kind": "preempt", "step": 25, "node": 1}), (2.0, "detected", {}),
                       (3.0, "restarted", {}), (4.0, "restored", {"step": 20, "tier": "local"})):
        t += dt
        recs.append({"t": round(t, 6), "event": ev, **kw})
    step = 20
    steps(20)
    recs.append({"t": round(t, 6), "event": "end", "step": step})
    recs.sort(key=lambda r: r["t"])
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_job_from_event_log(tmp_path):
    path = tmp_path / "events.jsonl"
    _log(path)
    j = Job.from_event_log(str(path), steps=1000, state_bytes=10**9)
    assert j.iter_s == pytest.approx(0.5, rel=0.01)
    assert j.persist_s == pytest.approx(1.0, rel=0.01)
    assert j.stall_s == pytest.approx(0.2, abs=0.05)
    assert (j.ref_nodes, j.ranks_per_node, j.nodes) == (2, 2, (2,))
    assert j.detect_s == pytest.approx(2.0, rel=0.01) and j.restore_s == pytest.approx(4.0, rel=0.01)


def test_the_plans_auto_sizes_its_interval_with_the_whole_cost_per_checkpoint(tmp_path):
    """A 1-node run of 101 steps of 0.1 s, a checkpoint every 20 steps that adds 0.02 s to its
    own step's gap (the snapshot) and 0.03 s to the next, committed 0.05 s after its step. The
    job: step 0.1 s, 0.05 s per checkpoint, so the planner's Auto (CheckFreq's rule, budget
    3.5%, as ``cfdist.Auto`` decides it): k = max(k_persist = ceil((0.05 - 0.05) / 0.1) -> 1,
    k_budget = ceil(0.05 / (0.035 x 0.1)) = ceil(14.29) = 15) = 15."""
    recs, t = [{"t": 0.0, "event": "start", "world_size": 1, "nodes": 1}, {"t": 0.1, "event": "restarted"}], 0.6
    for step in range(1, 102):
        t += 0.1 + (0.02 if step % 20 == 0 else 0.0) + (0.03 if step % 20 == 1 and step > 1 else 0.0)
        recs.append({"t": round(t, 6), "event": "step", "step": step})
        if step % 20 == 0:
            recs.append({"t": round(t + 0.05, 6), "event": "checkpoint_committed", "step": step, "tier": "local"})
    recs.sort(key=lambda r: r["t"])
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    j = Job.from_event_log(str(path), steps=1000, state_bytes=0)
    assert (j.iter_s, j.stall_s, j.persist_s) == pytest.approx((0.1, 0.05, 0.05))
    m = candidate_costs(j, Candidate(policy="auto", nodes=1), mtbf_s=math.inf)
    assert m.k == 15


def test_job_from_bench(tmp_path):
    runs = [{"method": "none", "phases": [0.1, 0.1, 0.12]},
            {"method": "cfdist", "phases": [0.1], "stats": {"mean_stall_s": 0.01, "mean_snapshot_s": 0.1,
                                                            "mean_persist_s": 0.2, "bytes": 2 * 10**8}}]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"blocks": [{"runs": runs}], "restore": {"cfdist": [{"s": 0.5}, {"s": 0.7}]}}))
    j = Job.from_bench(str(path), steps=100)
    assert (j.iter_s, j.stall_s, j.state_bytes) == (0.1, 0.01, 2 * 10**8)
    assert j.persist_s == pytest.approx(0.3) and j.restore_s == pytest.approx(0.6)
    with pytest.raises(ValueError, match="no 'none' runs or no 'dcp' runs"):
        Job.from_bench(str(path), steps=100, method="dcp")


def test_a_job_given_by_hand_pays_for_its_checkpoint_bytes():
    """Without a measurement, persist and restore follow the state size and the local disk's
    bandwidth (a 20 GB state at 2 GB/s: 10 s each), so ``auto`` does not checkpoint a 20 GB
    state every step; what is given or measured wins."""
    j = Job(iter_s=1.0, steps=100, state_bytes=20 * 10**9)
    assert (j.persist_s, j.restore_s) == (pytest.approx(10.0), pytest.approx(10.0))
    slow = Job(iter_s=1.0, steps=100, state_bytes=20 * 10**9, local_bytes_per_s=500e6, restore_s=3.0)
    assert (slow.persist_s, slow.restore_s) == (pytest.approx(40.0), 3.0)
    with pytest.raises(ValueError, match="local_bytes_per_s must be a finite number > 0"):
        Job(iter_s=1.0, steps=100, state_bytes=1, local_bytes_per_s=0)
