"""A fake multi-node Ray cluster for the ``cfdist.fit`` tests, shared by a whole test module.

``fake_cluster`` (module scope) starts a ``ray.cluster_utils.Cluster``: a head node with no CPUs
(the driver lives there; no rank is placed on it) and two worker nodes with 1 CPU each, labelled
``cfdist-node=<name>`` so that ``storage="file://<tmp>/{node}/local"`` gives each its own
"local disk". Tests add and remove nodes through :class:`FakeCluster` (names never repeat, so a
replacement node starts with an empty disk and empty memory tier).

Ray's files (sockets, logs, the ``ray_current_cluster`` address file) go under a short private
``RAY_TMPDIR``, so a ``ray.init()`` of another test session on the same machine never attaches
to this cluster, and this cluster never to theirs.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import tempfile

import pytest

from cfdist.cluster.local_cluster import add_worker_node, descendants as _descendants, kill_node

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


class FakeCluster:
    """A ``ray.cluster_utils.Cluster`` plus helpers to add/remove named worker nodes."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.nodes: dict[str, object] = {}      # node_id -> ray._private.node.Node
        self.names: dict[str, str] = {}         # node_id -> label name
        self._counter = itertools.count()

    def add_node(self, cpus: int = 1) -> str:
        """Start a worker node with a fresh name; returns its node id."""
        name = f"n{next(self._counter)}"
        node = add_worker_node(self.cluster, num_cpus=cpus, labels={"cfdist-node": name},
                               object_store_memory=80 * 1024 * 1024)
        self.nodes[node.node_id] = node
        self.names[node.node_id] = name
        return node.node_id

    def remove_node(self, node_id: str) -> None:
        """SIGKILL every process of a worker node at once (its workers and actors first, then its
        raylet and agents): a machine that vanished, not one shutting down."""
        kill_node(self.cluster, self.nodes.pop(node_id))

    def pids_titled(self, title: str) -> dict[str, list[int]]:
        """``{node name: pids}`` of the processes on each worker node whose command line
        contains ``title`` (Ray names an actor's process ``ray::<Class>``)."""
        from ray._private import ray_constants

        out = {}
        for nid, node in self.nodes.items():
            raylets = [p.process.pid for p in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])]
            pids = []
            for pid in _descendants(raylets):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if title.encode() in f.read():
                            pids.append(pid)
                except OSError:
                    pass
            out[self.names[nid]] = pids
        return out

    def ensure_workers(self, n: int) -> list[str]:
        """Exactly ``n`` worker nodes alive (adds or removes); returns their ids."""
        while len(self.nodes) < n:
            self.add_node()
        while len(self.nodes) > n:
            self.remove_node(next(iter(self.nodes)))
        self.cluster.wait_for_nodes()
        return list(self.nodes)


@pytest.fixture(scope="module")
def fake_cluster():
    """Head (0 CPUs) + 2 worker nodes, connected; torn down (only its own processes) at the end."""
    import ray
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="cfr-", dir="/tmp")   # short: Unix socket paths are limited
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_TMPDIR", tmp)
    mp.setenv("RAY_AUTH_MODE", "disabled")
    mp.setenv("RAY_DEDUP_LOGS", "0")
    # A lost node is declared dead after ~1.5 s of missed health checks (default: ~15 s).
    fast_health = {"health_check_period_ms": 500, "health_check_timeout_ms": 500,
                   "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, include_dashboard=False, object_store_memory=80 * 1024 * 1024,
        _system_config=fast_health))
    fc = FakeCluster(cluster)
    try:
        fc.ensure_workers(2)
        ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING",
                 runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "0"}})
        yield fc
    finally:
        ray.shutdown()
        cluster.shutdown()
        mp.undo()
        shutil.rmtree(tmp, ignore_errors=True)
