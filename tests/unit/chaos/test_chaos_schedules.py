"""Failure events and synthetic schedules: validation, determinism, and sampled statistics."""

import math
import statistics
from collections import Counter

import pytest

from cfdist.chaos import Exponential, FailureEvent, FixedInterval, Schedule, Weibull
from cfdist.chaos.events import pick_distinct, rng_for, uniform_index


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(time_s=-1.0, kind="crash", rank=0), "time_s"),
        (dict(time_s=math.nan, kind="crash", rank=0), "time_s"),
        (dict(time_s=1.0, kind="explode", node=0), "kind"),
        (dict(time_s=1.0, kind="crash"), "needs rank"),
        (dict(time_s=1.0, kind="crash", rank=0, notice_s=5.0), "without notice"),
        (dict(time_s=1.0, kind="preempt"), "needs node"),
        (dict(time_s=1.0, kind="preempt", node=0, rank=1), "crashes only"),
        (dict(time_s=1.0, kind="preempt", node=-1), "node"),
        (dict(time_s=1.0, kind="preempt", node=0, notice_s=-1.0), "notice_s"),
        (dict(time_s=1.0, kind="return", node=0, notice_s=1.0), "preemptions only"),
    ],
)
def test_failure_event_rejects_bad_fields_with_a_reason(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FailureEvent(**kwargs)


def test_failure_event_is_frozen_and_keyword_only():
    e = FailureEvent(time_s=1.5, kind="preempt", node=2, notice_s=30.0)
    with pytest.raises(AttributeError):
        e.time_s = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        FailureEvent(1.5, "preempt")  # type: ignore[misc]
    assert e.is_failure and not FailureEvent(time_s=1.0, kind="return", node=2).is_failure


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Exponential(0.0), "mtbf_s"),
        (lambda: Exponential(math.inf), "mtbf_s"),
        (lambda: Weibull(-1.0, 10.0), "shape"),
        (lambda: Weibull(1.0, 0.0), "scale_s"),
        (lambda: FixedInterval(0.0), "every_s"),
        (lambda: FixedInterval(10.0, first_s=-1.0), "first_s"),
        (lambda: Exponential(10.0, kind="crash", notice_s=5.0), "without notice"),
        (lambda: Exponential(10.0, kind="meteor"), "kind"),
        (lambda: Exponential(10.0, return_after_s=-1.0), "return_after_s"),
        (lambda: Exponential(10.0, ranks_per_node=0), "ranks_per_node"),
        (lambda: FixedInterval(10.0, kind="crash", pool=True), "pool=True"),
    ],
)
def test_schedule_configs_validate(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_schedules_follow_the_protocol_and_reject_bad_job_args():
    for s in (Exponential(10.0), Weibull(2.0, 10.0), FixedInterval(10.0)):
        assert isinstance(s, Schedule)
        with pytest.raises(ValueError, match="num_nodes"):
            s.events(0, 100.0)
        with pytest.raises(ValueError, match="horizon_s"):
            s.events(2, -1.0)


def _gaps(schedule, seeds, horizon_s):
    out = []
    for seed in seeds:
        times = [e.time_s for e in schedule(seed).events(4, horizon_s)]
        out += [b - a for a, b in zip([0.0] + times, times)]
    return out


def test_exponential_gaps_have_the_model_mean_and_cv():
    gaps = _gaps(lambda s: Exponential(100.0, seed=s, kind="crash"), range(50), 20_000.0)
    assert len(gaps) > 9_000
    assert statistics.fmean(gaps) == pytest.approx(100.0, rel=0.03)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("shape", [0.7, 1.5, 3.0])
def test_weibull_gaps_have_the_model_mean_and_shape(shape):
    scale = 100.0
    sched = Weibull(shape, scale, kind="crash")
    mean = scale * math.gamma(1 + 1 / shape)
    cv = math.sqrt(math.gamma(1 + 2 / shape) / math.gamma(1 + 1 / shape) ** 2 - 1)
    gaps = _gaps(lambda s: Weibull(shape, scale, seed=s, kind="crash"), range(40), 250 * mean)
    assert sched.mean_gap_s == pytest.approx(mean)
    assert statistics.fmean(gaps) == pytest.approx(mean, rel=0.03)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.06)
    # the median pins the shape too: median = scale * ln2^(1/shape)
    assert statistics.median(gaps) == pytest.approx(scale * math.log(2) ** (1 / shape), rel=0.04)


def test_fixed_interval_is_exact_without_drift():
    evs = FixedInterval(0.1, first_s=0.05, kind="crash").events(2, 1000.0)
    assert len(evs) == 10_000
    assert evs[-1].time_s == 0.05 + 9_999 * 0.1
    assert [e.time_s for e in FixedInterval(10.0, kind="crash").events(1, 35.0)] == [10.0, 20.0, 30.0]


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: Exponential(50.0, seed=seed, notice_s=10.0, return_after_s=30.0),
        lambda seed: Weibull(0.8, 50.0, seed=seed, kind="crash", ranks_per_node=4),
        lambda seed: FixedInterval(20.0, seed=seed),
    ],
)
def test_same_seed_same_events_different_seed_different_events(make):
    a, b, c = make(1).events(8, 5_000.0), make(1).events(8, 5_000.0), make(2).events(8, 5_000.0)
    assert a == b and len(a) > 20
    assert a != c


def test_times_do_not_depend_on_node_count():
    t4 = [e.time_s for e in Exponential(50.0, seed=3, kind="crash").events(4, 2_000.0)]
    t64 = [e.time_s for e in Exponential(50.0, seed=3, kind="crash").events(64, 2_000.0)]
    assert t4 == t64


def test_crash_targets_are_uniform_ranks_on_their_nodes():
    evs = Exponential(1.0, seed=0, kind="crash", ranks_per_node=4).events(3, 6_000.0)
    counts = Counter(e.rank for e in evs)
    assert set(counts) == set(range(12))
    assert all(e.node == e.rank // 4 and e.notice_s == 0 for e in evs)
    expected = len(evs) / 12
    assert all(abs(n - expected) < 5 * math.sqrt(expected) for n in counts.values())


def _replay_states(evs, num_nodes):
    """Apply events to node states; fail if a down node is preempted or an up node returns."""
    up = [True] * num_nodes
    for e in evs:
        if e.kind == "preempt":
            assert up[e.node], f"{e} preempts a node that is down"
            up[e.node] = False
        elif e.kind == "return":
            assert not up[e.node], f"{e} returns a node that is up"
            up[e.node] = True
    return up


def test_preemptions_return_after_the_delay_and_never_hit_a_down_node():
    evs = Exponential(5.0, seed=4, notice_s=2.0, return_after_s=12.0).events(3, 3_000.0)
    _replay_states(evs, 3)
    pre = [e for e in evs if e.kind == "preempt"]
    ret = {(e.node, round(e.time_s, 9)) for e in evs if e.kind == "return"}
    assert all(e.notice_s == 2.0 for e in pre)
    assert all((e.node, round(e.time_s + 12.0, 9)) in ret for e in pre if e.time_s + 12.0 < 3_000.0)
    assert evs == sorted(evs, key=lambda e: e.time_s) and all(e.time_s < 3_000.0 for e in evs)


def test_nodes_that_never_return_stop_the_arrivals():
    evs = Exponential(5.0, seed=0, return_after_s=None).events(4, 10_000.0)
    assert [e.kind for e in evs] == ["preempt"] * 4
    assert sorted(e.node for e in evs) == [0, 1, 2, 3]
    assert _replay_states(evs, 4) == [False] * 4


def test_a_pool_preemption_takes_every_node_that_is_up_at_one_instant():
    """``pool=True``: each arrival preempts every node that is up, with one notice, and each
    returns ``return_after_s`` later; an arrival while they are all down is dropped."""
    evs = FixedInterval(10.0, pool=True, notice_s=2.0, return_after_s=15.0).events(3, 45.0)
    pre = [(e.time_s, e.node) for e in evs if e.kind == "preempt"]
    assert pre == [(10.0, 0), (10.0, 1), (10.0, 2), (30.0, 0), (30.0, 1), (30.0, 2)]   # 20.0: all down
    assert all(e.notice_s == 2.0 for e in evs if e.kind == "preempt")
    assert [(e.time_s, e.node) for e in evs if e.kind == "return"] == [(25.0, 0), (25.0, 1), (25.0, 2)]
    _replay_states(evs, 3)


def test_seeded_pickers_are_reproducible_and_in_range():
    r1, r2 = rng_for(7, "x"), rng_for(7, "x")
    assert [uniform_index(r1, 5) for _ in range(50)] == [uniform_index(r2, 5) for _ in range(50)]
    assert [rng_for(7, "x").random()] != [rng_for(7, "y").random()]
    picked = pick_distinct(rng_for(1, "p"), list(range(10)), 4)
    assert len(set(picked)) == 4 and set(picked) <= set(range(10))
    with pytest.raises(ValueError):
        pick_distinct(rng_for(1, "p"), [1, 2], 3)
