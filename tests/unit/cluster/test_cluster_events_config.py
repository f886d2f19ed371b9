"""Event log (schema shared with ``cfdist.chaos.metrics``), FitConfig validation, node choice."""

from __future__ import annotations

import json

import pytest

from cfdist.chaos.metrics import metrics_from_log, read_event_log
from cfdist.cluster.config import FitConfig
from cfdist.cluster.events import EventLog
from cfdist.cluster.nodes import check_distinct_storage, fits, usable_nodes


def test_event_log_is_monotonic_jsonl_that_chaos_metrics_reads(tmp_path):
    path = tmp_path / "sub" / "events.jsonl"
    clock = iter([100.0, 101.0, 100.5, 103.0, 104.0, 106.0, 107.0, 108.0, 109.0, 110.0]).__next__
    log = EventLog(str(path), clock=clock)
    seen = []
    log.subscribe(seen.append)
    log.subscribe(lambda r: 1 / 0)           # a broken listener does not break logging
    log.emit("start", world_size=2, nodes=2)
    log.emit("step", step=1)
    log.emit("checkpoint_committed", step=1, tier="memory")   # clock went back: clamped
    log.emit("step", step=2)
    log.emit("failure", kind="crash", step=2, rank=1)
    log.emit("detected")
    log.emit("restarted", world_size=2)
    log.emit("restored", step=1, tier="memory", detect_s=1.0, restart_s=1.0, restore_s=1.0)
    log.emit("step", step=2)
    log.emit("end", step=2)
    log.close()
    recs = read_event_log(str(path))
    assert [r["event"] for r in recs] == [r["event"] for r in seen]
    assert recs[2]["t"] == 101.0
    m = metrics_from_log(recs, iter_s=1.0)
    assert m.num_failures == 1 and m.lost_iters == [1] and m.useful_iters == 2
    (f,) = m.failures
    assert f.detect_s == pytest.approx(2.0) and f.restart_s == pytest.approx(1.0)
    assert json.loads(path.read_text().splitlines()[0])["event"] == "start"


def test_event_log_in_memory_only():
    log = EventLog(None)
    log.emit("step", step=3)
    assert log.of("step")[0]["step"] == 3 and log.path is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(storage="s3://b/x"), "node-local"),
    (dict(storage="relative/dir"), "absolute"),
    (dict(storage=[]), "non-empty list"),
    (dict(storage="/x", run_name="a/b"), "run_name"),
    (dict(storage="/x", num_nodes=0), "num_nodes"),
    (dict(storage="/x", num_nodes=2, min_nodes=3), "min_nodes=3 exceeds num_nodes=2"),
    (dict(storage="/x", max_failures=-1), "max_failures"),
    (dict(storage="/x", poll_s=0), "poll_s"),
    (dict(storage="/x", memory_tier=False, local_tier=False), "no tier"),
    (dict(storage="/x", shared_writers=0), r"shared_writers must be 'all' or an int >= 1.*got 0"),
    (dict(storage="/x", shared_writers="node"), "shared_writers.*pass 1"),
    (dict(storage="/x", shared_slice_timeout_s=-1), "shared_slice_timeout_s"),
])
def test_fit_config_rejects_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FitConfig(**kwargs)


def test_fit_config_urls():
    c = FitConfig(storage=["/ssd0/{node}", "file:///ssd1/{node}/"], shared_storage="s3://b/runs/",
                  run_name="r1", num_nodes=2, workers_per_node=3)
    assert c.local_urls("n7") == ["file:///ssd0/n7/r1", "file:///ssd1/n7/r1"]
    assert c.shared_url() == "s3://b/runs/r1" and c.world_size == 6
    assert FitConfig(storage="/x").shared_url() is None


def _ray_node(nid, cpus, alive=True, label=None, host="h"):
    return {"NodeID": nid, "Alive": alive, "Resources": {"CPU": cpus}, "NodeManagerAddress": "10.0.0.1",
            "NodeManagerHostname": host, "Labels": {"cfdist-node": label} if label else {}}


def test_usable_nodes_need_room_for_a_whole_node_of_ranks():
    c = FitConfig(storage="/x/{node}", workers_per_node=2)
    nodes = [_ray_node("z", 2, label="b"), _ray_node("y", 1, label="c"), _ray_node("x", 4, alive=False),
             _ray_node("w", 0), _ray_node("v", 8, label="a")]
    got = usable_nodes(c, nodes=nodes)
    assert [(n.node_id, n.name) for n in got] == [("v", "a"), ("z", "b")]
    assert [n.node_id for n in usable_nodes(c, nodes=nodes, excluded=frozenset({"v"}))] == ["z"]
    assert fits(FitConfig(storage="/x", use_gpu=True), cpus=8, gpus=0) is False


def test_two_fake_nodes_may_not_share_a_local_directory():
    c = FitConfig(storage="/x")
    nodes = usable_nodes(c, nodes=[_ray_node("a", 1, host="h"), _ray_node("b", 1, host="h")])
    with pytest.raises(ValueError, match=r"\{node\}.*cfdist-node"):
        check_distinct_storage(c, nodes)
    c2 = FitConfig(storage="/x/{node}")
    ok = usable_nodes(c2, nodes=[_ray_node("a", 1, label="p"), _ray_node("b", 1, label="q")])
    check_distinct_storage(c2, ok)
