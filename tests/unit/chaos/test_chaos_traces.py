"""Trace formats (parse/write round trips of the bundled files) and TraceReplay's node mapping."""

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfdist.chaos import BUNDLED_TRACES, TraceReplay, bundled_trace
from cfdist.chaos.replay import membership_from_pool_sizes, pool_size_series, slot_events
from cfdist.chaos.trace_io import (
    LIFETIMES_HEADER,
    detect_format,
    format_lifetimes,
    format_node_events,
    format_pool_sizes,
    parse_lifetimes,
    parse_node_events,
    parse_pool_sizes,
    read_text,
)

FORMATS = {
    "events": (parse_node_events, format_node_events),
    "pool": (parse_pool_sizes, format_pool_sizes),
    "lifetimes": (parse_lifetimes, format_lifetimes),
}
EXPECTED_FORMAT = {
    "bamboo-p3-trace.csv": "events",
    "bamboo-g4dn-trace.csv": "events",
    "bamboo-a100x1-east1b.txt": "pool",
    "bamboo-v100x1-east1c.txt": "pool",
    "gcp-preemptible-lifetimes.csv": "lifetimes",
}


@pytest.mark.parametrize("name", BUNDLED_TRACES)
def test_bundled_trace_round_trips(name):
    text = read_text(bundled_trace(name))
    fmt = detect_format(text)
    assert fmt == EXPECTED_FORMAT[name]
    parse, fmt_text = FORMATS[fmt]
    records = parse(text)
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(records) == len(lines) - (1 if fmt == "lifetimes" else 0)
    written = fmt_text(records)
    assert parse(written) == records
    assert written == text  # the very same bytes


def test_known_counts_of_the_bamboo_p3_trace():
    evs = parse_node_events(read_text(bundled_trace("bamboo-p3-trace.csv")))
    assert Counter(e.action for e in evs) == {"add": 177, "remove": 167}
    assert max(e.time_ms for e in evs) == 40_920_000  # 11.4 h
    assert max(s for _, s in pool_size_series([(e.time_ms / 1e3, e.action, e.node) for e in evs])) == 32


@pytest.mark.parametrize(
    "parse, text, match",
    [
        (parse_node_events, "0,add,node1\n5,drop,node2\n", r":2: expected 'time_ms,add\|remove,nodeN'"),
        (parse_node_events, "x,add,node1\n", ":1:"),
        (parse_pool_sizes, "2021-12-11, 11:11:30, 55\n2021-12-11 11:13:10 55\n", ":2: expected 'YYYY-MM-DD"),
        (parse_lifetimes, "zone,lifetime\n", "header"),
        (parse_lifetimes, LIFETIMES_HEADER + "\nz,m,-3,Monday,1,True\n", ":2:"),
        (parse_lifetimes, LIFETIMES_HEADER + "\nz,m,3.0,Monday,1,yes\n", ":2:"),
    ],
)
def test_malformed_lines_name_the_line_and_the_shape(parse, text, match):
    with pytest.raises(ValueError, match=match):
        parse(text, source="t.csv")


def test_unknown_format_and_unknown_bundled_name_say_what_exists():
    with pytest.raises(ValueError, match="cannot tell the trace format"):
        detect_format("hello world\n")
    with pytest.raises(ValueError, match="bamboo-p3-trace.csv"):
        bundled_trace("nope.csv")
    with pytest.raises(ValueError, match="bundled_trace"):
        TraceReplay("/nonexistent/trace.csv")


def _up_slots_after_each_instant(evs, num_nodes):
    up, out = [True] * num_nodes, {}
    for e in evs:
        if e.kind == "preempt":
            assert up[e.node], f"{e}: slot already down"
            up[e.node] = False
        elif e.kind == "return":
            assert not up[e.node], f"{e}: slot already up"
            up[e.node] = True
        out[e.time_s] = sum(up)
    return out


def _check_mapping(membership, num_nodes, events, t_start=None):
    """up slots == min(num_nodes, pool size) after every instant with events."""
    pool = dict(pool_size_series(membership))
    if t_start is None:
        t_start = next(t for t, s in pool_size_series(membership) if s >= num_nodes)
    for t, up in _up_slots_after_each_instant(events, num_nodes).items():
        assert up == min(num_nodes, pool[t + t_start]), t


@pytest.mark.parametrize("num_nodes", [1, 8, 32])
def test_event_trace_maps_pool_to_slots(num_nodes):
    tr = TraceReplay(bundled_trace("bamboo-p3-trace.csv"))
    evs = tr.events(num_nodes, math.inf)
    _check_mapping(tr.membership(), num_nodes, evs)
    assert evs == sorted(evs, key=lambda e: e.time_s)
    # every removal of a VM the job holds is a preemption; with all 32 every removal is
    if num_nodes == 32:
        removes = [m for m in tr.membership() if m[1] == "remove"]
        assert sum(e.kind == "preempt" for e in evs) == len(removes)


def test_job_larger_than_the_pool_is_refused_with_the_largest_size():
    with pytest.raises(ValueError, match="at most 32"):
        TraceReplay(bundled_trace("bamboo-p3-trace.csv")).events(33, math.inf)


def test_explicit_start_needs_enough_vms():
    tr = TraceReplay(bundled_trace("bamboo-g4dn-trace.csv"), start_s=500.0)
    with pytest.raises(ValueError, match="pass start_s=None"):
        tr.events(4, math.inf)
    late = TraceReplay(bundled_trace("bamboo-g4dn-trace.csv"), start_s=3_600.0).events(4, math.inf)
    assert late and late[0].time_s >= 0


def test_time_scale_and_notice_are_applied_to_trace_seconds():
    path = bundled_trace("bamboo-g4dn-trace.csv")
    real = TraceReplay(path, notice_s=120.0).events(8, math.inf)
    fast = TraceReplay(path, notice_s=120.0, time_scale=1 / 3600).events(8, math.inf)
    assert [(e.kind, e.node) for e in real] == [(e.kind, e.node) for e in fast]
    assert all(f.time_s == pytest.approx(r.time_s / 3600) for r, f in zip(real, fast))
    assert all(e.notice_s == pytest.approx(120 / 3600) for e in fast if e.kind == "preempt")
    # the horizon cuts in schedule seconds
    assert TraceReplay(path, notice_s=120.0, time_scale=1 / 3600).events(8, 2.0) == [e for e in fast if e.time_s < 2.0]


@pytest.mark.parametrize("name", ["bamboo-a100x1-east1b.txt", "bamboo-v100x1-east1c.txt"])
def test_pool_trace_is_seeded_and_keeps_its_sizes(name):
    path = bundled_trace(name)
    a, b = TraceReplay(path, seed=1).events(16, math.inf), TraceReplay(path, seed=1).events(16, math.inf)
    c = TraceReplay(path, seed=2).events(16, math.inf)
    assert a == b and a != c
    membership = TraceReplay(path, seed=1).membership()
    times = [t for t, _, _ in membership]
    assert times == sorted(times)  # backwards timestamps in the v100 file are clamped
    samples = parse_pool_sizes(read_text(path))
    assert pool_size_series(membership)[-1][1] == samples[-1].size
    _check_mapping(membership, 16, a)


def test_pool_changes_follow_file_order_even_when_timestamps_go_back():
    samples = parse_pool_sizes(
        "2021-12-10, 13:07:45, 3\n2021-12-10, 13:09:45, 3\n2021-12-10, 13:08:45, 2\n2021-12-10, 13:10:45, 4\n"
    )
    m = membership_from_pool_sizes(samples, seed=0)
    assert [(t, a) for t, a, _ in m] == [(0.0, "add")] * 3 + [(60.0, "remove"), (180.0, "add"), (180.0, "add")]


def test_lifetimes_renew_each_slot_with_sampled_lives():
    path = bundled_trace("gcp-preemptible-lifetimes.csv")
    tr = TraceReplay(path, seed=3, replacement_delay_s=90.0, time_scale=0.5, notice_s=30.0)
    evs = tr.events(6, 500_000.0)
    assert evs == tr.events(6, 500_000.0) != TraceReplay(path, seed=4).events(6, 500_000.0)
    lives = {round(x * 0.5, 6) for x in tr.lifetimes_s()}
    for slot in range(6):
        mine = [e for e in evs if e.node == slot]
        assert [e.kind for e in mine] == ["preempt", "return"] * (len(mine) // 2) + ["preempt"] * (len(mine) % 2)
        starts = [0.0] + [e.time_s for e in mine if e.kind == "return"]
        for start, e in zip(starts, [e for e in mine if e.kind == "preempt"]):
            assert round(e.time_s - start, 6) in lives and e.notice_s == 15.0
        for p, r in zip(mine[0::2], mine[1::2]):
            assert r.time_s - p.time_s == pytest.approx(45.0)
    assert len(TraceReplay(path, zone="us-east1-b", preempted=True).lifetimes_s()) < len(tr.lifetimes_s())
    with pytest.raises(ValueError, match="finite horizon_s"):
        tr.events(2, math.inf)
    with pytest.raises(ValueError, match="loosen"):
        TraceReplay(path, zone="mars-north1-a").events(2, 10.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.booleans(), st.integers(0, 11)), min_size=1, max_size=80),
    st.integers(1, 5),
)
def test_slot_mapping_invariant_on_random_membership(raw, num_nodes):
    present, membership = set(), []
    for t, add, vm in sorted(raw, key=lambda x: x[0]):
        name = f"vm{vm}"
        if add and name not in present:
            present.add(name)
            membership.append((float(t), "add", name))
        elif not add and name in present:
            present.discard(name)
            membership.append((float(t), "remove", name))
    series = pool_size_series(membership)
    if max((s for _, s in series), default=0) < num_nodes:
        with pytest.raises(ValueError, match="never holds"):
            slot_events(membership, num_nodes=num_nodes, start_s=None, time_scale=1.0, notice_s=0.0,
                        horizon_s=math.inf)
        return
    evs = slot_events(membership, num_nodes=num_nodes, start_s=None, time_scale=1.0, notice_s=0.0,
                      horizon_s=math.inf)
    _check_mapping(membership, num_nodes, evs)
