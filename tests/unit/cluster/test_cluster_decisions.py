"""The controller's pure decisions, as tables: restore choice, group size, failure budget."""

from __future__ import annotations

import pytest

from cfdist.cluster.decisions import Failure, FailurePolicy, Holding, ScalingPolicy, choose_restore, pool_halt

A, B, C = "a" * 16, "b" * 16, "c" * 16


@pytest.mark.parametrize("holdings, group, peer_copy, want_step, want_sources", [
    # nothing anywhere: scratch
    ([], [A, B], True, None, {}),
    # both nodes hold 8 in memory
    ([Holding(node_id=A, memory=(8,), local=(8,)), Holding(node_id=B, memory=(8,), local=(8,))],
     [A, B], True, 8, {A: ("memory", None), B: ("memory", None)}),
    # B's writer died before committing 12: B gets 12 from A's actor (newest wins)
    ([Holding(node_id=A, memory=(12,), local=(12,)), Holding(node_id=B, memory=(8,), local=(8,))],
     [A, B], True, 12, {A: ("memory", None), B: ("peer", A)}),
    # ...without peer copy, 8 is the newest both have (A keeps two)
    ([Holding(node_id=A, memory=(8, 12), local=(12,)), Holding(node_id=B, memory=(8,), local=(8,))],
     [A, B], False, 8, {A: ("memory", None), B: ("memory", None)}),
    # B lost: replacement C is empty; peer copy from A
    ([Holding(node_id=A, memory=(12,), local=(8, 12))], [A, C], True, 12, {A: ("memory", None), C: ("peer", A)}),
    # no peer copy: C can only use shared storage, which has 8 (A has 8 on disk)
    ([Holding(node_id=A, memory=(12,), local=(8, 12)), Holding(node_id=None, shared=(4, 8))],
     [A, C], False, 8, {A: ("local", None), C: ("shared", None)}),
    # only shared survives
    ([Holding(node_id=None, shared=(20,))], [C], True, 20, {C: ("shared", None)}),
    # memory newer than local: memory wins; local-only step older
    ([Holding(node_id=A, memory=(16,), local=(12,))], [A], True, 16, {A: ("memory", None)}),
    # a survivor on A keeps step 13 in process: every node receives it from there, over the group
    ([Holding(node_id=A, live=(13,), memory=(12,), local=(12,)), Holding(node_id=B, memory=(12,))],
     [A, B], True, 13, {A: ("live", A), B: ("live", A)}),
    # ...also a replacement node, and without peer copy (nothing goes actor to actor)
    ([Holding(node_id=A, live=(13,), memory=(12,))], [A, C], False, 13, {A: ("live", A), C: ("live", A)}),
    # a survivor whose node is not in the new group is no source: the newest committed step
    ([Holding(node_id=A, live=(13,), memory=(12,)), Holding(node_id=B, memory=(12,))],
     [B], True, 12, {B: ("memory", None)}),
    # a committed step newer than the kept one wins (the kept one is not used)
    ([Holding(node_id=A, live=(13,), memory=(14,)), Holding(node_id=B, memory=(14,))],
     [A, B], True, 14, {A: ("memory", None), B: ("memory", None)}),
])
def test_choose_restore(holdings, group, peer_copy, want_step, want_sources):
    c = choose_restore(holdings, group, peer_copy=peer_copy)
    assert c.step == want_step
    assert c.sources == want_sources
    assert ("from scratch" in c.reason) == (want_step is None)


def test_choose_restore_skips_excluded_steps_and_reports_the_slowest_tier():
    h = [Holding(node_id=A, memory=(12,), local=(8, 12)), Holding(node_id=None, shared=(8,))]
    c = choose_restore(h, [A, C], exclude=frozenset({12}))
    assert c.step == 8 and c.sources == {A: ("local", None), C: ("peer", A)}
    assert c.tier == "peer"
    assert choose_restore([], [A]).tier == "none"
    live = choose_restore([Holding(node_id=A, live=(13,), memory=(12,))], [A, C])
    assert live.tier == "live" and "kept in process by a survivor" in live.reason
    assert choose_restore([Holding(node_id=A, live=(13,), memory=(12,))], [A, C], exclude=frozenset({13})).step == 12


@pytest.mark.parametrize("usable, want, reason", [
    (3, 2, "full size"), (2, 2, "full size"), (1, 1, "elastic"), (0, None, "min_nodes=1"),
])
def test_scaling_size_for(usable, want, reason):
    d = ScalingPolicy(num_nodes=2, min_nodes=1).size_for(usable)
    assert d.num_nodes == want and reason in d.reason


@pytest.mark.parametrize("current, usable, want", [(1, 1, None), (1, 2, 2), (1, 5, 2), (2, 3, None)])
def test_scaling_should_grow(current, usable, want):
    assert ScalingPolicy(num_nodes=2, min_nodes=1).should_grow(current, usable).num_nodes == want


@pytest.mark.parametrize("so_far, max_failures, action", [(0, 2, "retry"), (1, 2, "retry"), (2, 2, "raise"), (0, 0, "raise")])
def test_failure_policy(so_far, max_failures, action):
    f = Failure(kind="crash", step=7)
    d = FailurePolicy(max_failures=max_failures).make_decision(so_far, f)
    assert d.action == action
    assert f"max_failures={max_failures}" in d.reason or action == "retry"
    assert "step 7" in d.reason


def test_failure_kind_is_validated():
    with pytest.raises(ValueError, match="kind"):
        Failure(kind="boom", step=1)


@pytest.mark.parametrize("window, latencies, step_s, halt_in, phrase", [
    (30.0, [], 0.5, 0.0, "no durable commit latency measured yet"),        # nothing known: at once
    (30.0, [1.0, 2.0, 1.5], 0.5, 30.0 - (2 * 1.5 + 0.5), "train"),        # margin 2 x median + a step
    (3.0, [1.0, 2.0, 1.5], 0.5, 0.0, "halt now"),                           # window within the margin
    (3.5, [1.0, 2.0, 1.5], 0.5, 0.0, "halt now"),                           # exactly the margin
    (10.0, [9.0] * 10 + [1.0] * 5, None, 8.0, "train"),                     # median of the last five
])
def test_pool_halt_leaves_twice_the_commit_latency_and_a_step_before_the_kill(window, latencies, step_s, halt_in,
                                                                              phrase):
    d = pool_halt(window, latencies, step_s, floor_s=0.0)
    assert d.halt_in_s == pytest.approx(halt_in) and phrase in d.reason


def test_pool_halt_adds_the_delivery_slack_to_its_margin_and_leaves_at_least_its_floor():
    assert pool_halt(10.0, [1.0], 0.5, slack_s=0.2).halt_in_s == pytest.approx(10.0 - 2.7)
    d = pool_halt(30.0, [0.05], 0.02)   # 2 x 0.05 + 0.02 = 0.12 s: the floor of 1 s instead
    assert d.halt_in_s == pytest.approx(29.0) and "margin 1s (at least 1s)" in d.reason
    assert pool_halt(0.8, [0.05], 0.02).halt_in_s == 0.0   # within the floor: at once
