"""After a first error, the driver does not wait for Ray's report of a rank whose process
exited when a node actor that shares the rank's process namespace can see it exit
(``RayWorkerGroup._settle`` asking ``NodeCheckpointer.await_exit``): the path that serves ranks
on machines other than the driver's. Real Ray (the module's fake cluster), a real node actor
on a worker node, a real process killed.

The rank's ``run`` outcome is stood in for by a Ray task that sleeps through the test (Ray
never reports it, as for a rank whose death Ray has not noticed yet), so the node actor's answer
is the only way the settle can end before its deadline: the test cannot pass through Ray's
report instead. Its "rank" is a plain process of this machine, killed by the test."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from cfdist.cluster import worker_group  # noqa: E402
from cfdist.cluster.config import FitConfig  # noqa: E402
from cfdist.cluster.nodes import NodeInfo, process_namespace  # noqa: E402
from cfdist.cluster.ray_backend import _RemoteNode  # noqa: E402
from cfdist.cluster.worker_group import RayWorkerGroup  # noqa: E402


def test_a_node_actor_sees_a_ranks_process_exit_before_ray_reports_it(fake_cluster, tmp_path, monkeypatch):
    monkeypatch.setattr(worker_group, "_SETTLE_S", 20.0)   # room for a loaded machine; the sleeper outlasts it
    node_id = next(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0)
    config = FitConfig(storage=f"file://{tmp_path}/{{node}}", run_name="exitwatch", progress=False)
    actor = _RemoteNode.options(num_cpus=0, max_concurrency=8, max_restarts=0,
                                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
        config=config, run_id="exitwatch", node_id=node_id, node_name="n0", notices=None)
    sleeper = ray.remote(num_cpus=0)(lambda: time.sleep(60)).remote()   # never reported during the test
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        ready = ray.get(actor.ready.remote(), timeout=60)
        assert ready["ns"] == process_namespace(), "the node actor does not share this machine's namespace"
        g = object.__new__(RayWorkerGroup)
        g.config = config
        g.nodes = [NodeInfo(node_id, "n0", "127.0.0.1", 1.0, 0)]
        g._node_actors = [actor]
        g._refs = {0: sleeper}
        g._results, g._errors, g._hung, g._gone, g._read_later = {}, [], {}, set(), []
        g._unreachable = None
        g._here, g._there = {}, {0: rank.pid}
        rank.kill()   # not reaped: a zombie, as a rank's process is until its raylet reaps it
        g._settle([sleeper])
        [err] = g._errors   # none: the settle ran to its deadline, the node actor never answered
        assert (err.rank, err.actor_died) == (0, True), err
        assert f"rank 0's process (pid {rank.pid}) exited" in err.message
        assert g._read_later == [sleeper]   # Ray's own report, whenever it comes, is read then
    finally:
        rank.kill()
        rank.wait()
        ray.cancel(sleeper, force=True)
        ray.kill(actor, no_restart=True)
        # the driver reads Ray's report of the "rank" in the background: once the sleeper is
        # cancelled that reader ends, before this module's cluster is shut down under it
        for t in [t for t in threading.enumerate() if t.name == "cfdist-read-outcomes"]:
            t.join(30)
            assert not t.is_alive(), "the background reader of the sleeper's outcome did not end after its cancel"



@ray.remote(num_cpus=0)
class _Watcher:
    """Stands in for a node actor: answers ``await_exit`` at its lease's end, nothing exited."""

    def await_exit(self, pids, wait_s, every_s=0.002):
        time.sleep(wait_s)
        return []


def test_the_exit_watch_ends_when_no_rank_is_left_to_watch(fake_cluster, tmp_path, monkeypatch):
    """Every rank is on another machine and its node actor is gone: the watch thread has
    nothing left to look at and ends, instead of waking every few milliseconds until the group
    ends; it breaks no one's group (no rank was seen exiting)."""
    monkeypatch.setattr(worker_group, "_WATCH_LEASE_S", 0.2)
    watcher = _Watcher.remote()
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    broken = []

    class _Rank:   # a survivor would be asked to break its group: count the asks
        class break_group:   # noqa: N801 - mimics an actor method's .remote
            @staticmethod
            def remote(attempt):
                broken.append(attempt)

    try:
        g = object.__new__(RayWorkerGroup)
        g.config = FitConfig(storage=f"file://{tmp_path}/{{node}}", run_name="exitwatch", progress=False)
        g.attempt = 3
        g.workers = [_Rank()]
        g._node_actors = [watcher]
        g._here, g._there = {}, {0: rank.pid}
        g._watch_stop = threading.Event()
        t = threading.Thread(target=g._watch_exits, daemon=True)
        t.start()
        ray.get(watcher.await_exit.remote([], 0.0), timeout=60)   # up and answering: the watch asks it
        ray.kill(watcher, no_restart=True)   # its node is gone
        t.join(30)
        alive = t.is_alive()
        g._watch_stop.set()   # ends a watch that did not end by itself
        t.join(10)
        assert not alive, "the exit watch kept running with no rank left to watch (its only node actor is gone)"
        assert broken == [], "the watch broke a group though no rank exited"
        assert rank.poll() is None
    finally:
        rank.kill()
        rank.wait()
