"""Simulated Ray nodes on this machine (``ray.cluster_utils.Cluster``), for local runs and experiments.

A head node with no CPUs (the driver lives there; no rank is placed on it) and ``num_nodes``
worker nodes with ``cpus_per_node`` CPUs each, every one labelled ``cfdist-node=<name>`` so that
``storage="file://<dir>/{node}"`` gives each node its own "local disk". Names never repeat: a
node added to replace a removed one starts with an empty disk and an empty memory tier, as a
fresh VM would. ``cfdist.fit`` starts one when it runs on one machine without ``RAY_ADDRESS``;
``cfdist experiment`` starts one for all its runs.

Ray's sockets and logs go under a short private ``RAY_TMPDIR``, so this cluster never attaches to
another Ray instance on the machine (nor it to this one); gloo talks over the loopback interface
(``GLOO_SOCKET_IFNAME=lo``), as every rank is on this machine. Every process of a worker node
runs at Ray's worker niceness from its start (:func:`add_worker_node`), so that one simulated
node's start-up does not take the CPU from another's ranks. Unless ``RAY_AUTH_MODE`` is set,
the cluster uses token authentication with a fresh random token (in the environment of this
process and its children only): nothing else on the machine can submit work to it, and Ray
has nothing to warn about. Ray caches the auth mode and token in the process, past
``ray.shutdown()``; ``start`` and ``close`` refresh both, so clusters may follow one another in
one process (``cfdist.fit`` called again and again), and a user's ``ray.init()`` after them. A lost node is declared dead after ~3 s of failed health checks.
Call from the driver process, one thread (``add_node`` may also run on another one)::

    with LocalCluster(num_nodes=2) as lc:          # ray.init() done, torn down at exit
        cfdist.fit(..., remove_node=lc.remove_node, add_node=lc.add_node)
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid

from cfdist.cluster.niceness import on_thread

log = logging.getLogger(__name__)

_OBJECT_STORE = 80 * 1024 * 1024
_FAST_HEALTH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000,
                "health_check_failure_threshold": 3}
"""A lost node is declared dead after ~3 s of failed health checks (Ray's default: ~15 s); a
check may take 2 s, so a busy machine's raylet is not declared dead by mistake."""


class LocalCluster:
    """Start with ``start()`` (or ``with``); ``close()`` stops only this cluster's processes."""

    def __init__(self, *, num_nodes: int = 2, cpus_per_node: int = 1, log_to_driver: bool = False):
        if not (isinstance(num_nodes, int) and num_nodes >= 1):
            raise ValueError(f"LocalCluster(num_nodes={num_nodes!r}) needs an int >= 1")
        if not (isinstance(cpus_per_node, int) and cpus_per_node >= 1):
            raise ValueError(f"LocalCluster(cpus_per_node={cpus_per_node!r}) needs an int >= 1 (ranks need a CPU)")
        self.num_nodes = num_nodes
        self.cpus_per_node = cpus_per_node
        self.log_to_driver = log_to_driver
        self.cluster = None
        self.nodes: dict[str, object] = {}   # node id -> ray._private.node.Node
        self.names: dict[str, str] = {}      # node id -> cfdist-node label
        self._counter = itertools.count()
        self._tmp: str | None = None
        self._env: dict[str, str | None] = {}

    def _setenv(self, key: str, value: str) -> None:
        self._env.setdefault(key, os.environ.get(key))
        os.environ[key] = value

    def start(self) -> "LocalCluster":
        """Start the head and the worker nodes, then ``ray.init`` this process into the cluster."""
        import ray
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            raise RuntimeError("ray is already initialised in this process; shut it down (ray.shutdown()) "
                               "or run on that cluster instead of a LocalCluster")
        self._tmp = tempfile.mkdtemp(prefix="cfx-", dir="/tmp")   # short: Unix socket paths are limited
        for key, value in (("RAY_TMPDIR", self._tmp), ("GLOO_SOCKET_IFNAME", "lo"), ("RAY_DEDUP_LOGS", "0")):
            self._setenv(key, value)
        if "RAY_AUTH_MODE" not in os.environ:
            self._setenv("RAY_AUTH_TOKEN", uuid.uuid4().hex)
            self._setenv("RAY_AUTH_MODE", "token")
        _refresh_ray_auth()   # a token cached by an earlier cluster of this process would be refused
        try:
            self.cluster = Cluster(initialize_head=True, head_node_args=dict(
                num_cpus=0, include_dashboard=False, object_store_memory=_OBJECT_STORE,
                _system_config=dict(_FAST_HEALTH)))   # a copy: Ray writes its spilling directory into it
            for _ in range(self.num_nodes):
                self.add_node()
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, include_dashboard=False, log_to_driver=self.log_to_driver,
                     logging_level=logging.WARNING)
        except BaseException:
            self.close()
            raise
        return self

    def add_node(self, slot: int | None = None) -> str:
        """Start a worker node with a fresh name (``slot`` is ignored: any slot fits); returns its id."""
        name = f"n{next(self._counter)}"
        node = add_worker_node(self.cluster, num_cpus=self.cpus_per_node, labels={"cfdist-node": name},
                               object_store_memory=_OBJECT_STORE)
        self.nodes[node.node_id] = node
        self.names[node.node_id] = name
        return node.node_id

    def remove_node(self, node_id: str) -> None:
        """SIGKILL every process of a worker node at once (its workers and actors first, then its
        raylet and agents): a machine that vanished, not one shutting down."""
        node = self.nodes.pop(node_id, None)
        if node is None:
            raise KeyError(f"node {node_id[:8]} is not a live worker node of this LocalCluster "
                           f"(live: {[n[:8] for n in self.nodes]})")
        from cfdist.cluster.quiet import expect_node_death

        expect_node_death(node_id)
        kill_node(self.cluster, node)

    def close(self) -> None:
        """``ray.shutdown()``, stop every node of this cluster, remove its temp dir. Safe twice."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._env = {}
        _refresh_ray_auth()   # the next Ray of this process (a user's, another cluster) reads its own
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _refresh_ray_auth() -> None:
    """Make this process's Ray read ``RAY_AUTH_MODE`` and the auth token afresh.

    Ray caches both for the life of the process, past ``ray.shutdown()``: its config, and the
    token it first read (a C++ singleton, ``AuthenticationTokenLoader``). A second cluster in
    the same process has a fresh token; with the first one still cached, this process's calls
    to the new GCS are refused (``Failed to start GCS ... InvalidAuthToken``). Same order as
    Ray's own test reset: the config first, then the token cache (a core-worker thread still
    draining could otherwise reload a token the config no longer asks for)."""
    from ray._raylet import Config

    Config.initialize("")
    try:
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:   # a Ray without token authentication caches no token
        return
    AuthenticationTokenLoader.instance().reset_cache()


_ADD_LOCK = threading.Lock()


def add_worker_node(cluster, **node_args):
    """``cluster.add_node(**node_args)`` (a ``ray.cluster_utils.Cluster``) from any thread, the
    node's processes at Ray's worker niceness from their start.

    Ray runs its workers at nice 15 (``RAY_worker_niceness``), but a worker sets that itself
    once its core worker is up: the ~0.7 CPU-seconds before (Ray's worker setup, its imports)
    run at the raylet's niceness, and a raylet started from this process runs at this
    process's (0, as a rule). A nice-0 process outweighs a nice-15 one 28 to 1, so on this machine a fake
    node starting a process (a warm spare, a standby checkpoint actor, a replacement node's
    actor) took the CPU from the other fake nodes' ranks: their steps took 4-6 times as long
    until it was done (0.5-0.7 s of training lost at each such start). On real machines those
    processes start on their own node's CPUs; here a fake node's raylet, its agents and every
    worker they start run at the workers' niceness, so that one node's start-up competes with
    another node's ranks as an equal. The node is started on a thread of its own (the nice
    value of a Linux thread is inherited by the processes it starts; raising it needs no
    privilege, and this process's other threads keep theirs). A preparation's setup (the
    script Ray runs before a worker with a ``runtime_env``) runs under ``SCHED_IDLE`` from its
    start (:data:`IDLE_SETUP_WORKER`), as the worker it starts does.

    Ray's ``Node`` registers a SIGTERM handler and an atexit hook when it is to shut down with
    this process, and Python lets only the main thread set signal handlers: a worker node starts
    without them (``Cluster._shutdown_at_exit``, Ray's own switch for it). The cluster's
    ``shutdown()`` still stops it (``LocalCluster.close``); should this process die first, its
    raylet exits once it loses the head node's GCS (whose own hook stops it at exit)."""
    node_args.setdefault("setup_worker_path", IDLE_SETUP_WORKER)

    def start():
        _nice_this_thread(_worker_niceness())
        with _ADD_LOCK:
            saved = cluster._shutdown_at_exit, os.environ.get(_NICENESS)
            cluster._shutdown_at_exit = False
            # a worker adds Ray's niceness to the one it was started with (15 + 15 = 19):
            # it starts at the raylet's 15 already, so it is told to add nothing
            os.environ[_NICENESS] = "0"
            try:
                return cluster.add_node(**node_args)
            finally:
                cluster._shutdown_at_exit = saved[0]
                if saved[1] is None:
                    os.environ.pop(_NICENESS, None)
                else:
                    os.environ[_NICENESS] = saved[1]

    return on_thread(start, name="cfdist-add-node")   # its exception is re-raised here


_NICENESS = "RAY_worker_niceness"

IDLE_SETUP_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "idle_setup_worker.py")
"""The setup script of the simulated nodes' workers: Ray's, run under ``SCHED_IDLE`` from its
first instruction for a preparation (:mod:`cfdist.cluster.idle_setup_worker`)."""


def _worker_niceness() -> int:
    """The niceness Ray gives its worker processes (``RAY_worker_niceness``, default 15)."""
    try:
        return int(os.environ.get(_NICENESS, "15"))
    except ValueError:
        return 15


def _nice_this_thread(nice: int) -> None:
    """Raise the calling thread's nice value to ``nice`` (never lowers it: that needs privilege).
    Linux only: there a thread's nice value is its own and ``setpriority`` takes a thread id;
    elsewhere (macOS) it would renice a whole process, maybe another one, so the node's
    processes keep Ray's own niceness handling (logged)."""
    if not sys.platform.startswith("linux"):
        log.info("simulated nodes start at this process's niceness on %s (per-thread nice is Linux's)",
                 sys.platform)
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:   # the simulation still runs, as before this existed
        log.warning("could not start a simulated node at nice %d (%s): its start-up processes may take "
                    "the CPU from the other nodes' ranks", nice, e)


def kill_node(cluster, node) -> None:
    """SIGKILL every process of ``node`` of a ``ray.cluster_utils.Cluster`` at once (its workers
    and actors first, then its raylet and agents) and drop it from ``cluster``."""
    from ray._private import ray_constants

    raylets = [p.process.pid for p in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])]
    for pid in descendants(raylets):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    cluster.remove_node(node, allow_graceful=False)


def descendants(roots: list[int]) -> list[int]:
    """Pids of all descendants of ``roots`` (from /proc; no psutil needed)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], list(roots)
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out
