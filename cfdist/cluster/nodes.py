"""Which Ray nodes can host a node's worth of ranks, and what each is called.

A node is *usable* when it is alive, not excluded (taken away by the failure injector), and its
total resources fit ``workers_per_node`` ranks (CPUs, GPUs). Its *name* fills ``{node}`` in
the storage URL: the node label ``cfdist-node`` when set (fake nodes of a test cluster), else
its hostname. Call from the driver.
"""

from __future__ import annotations

import functools
import os
import signal
from dataclasses import dataclass, field

from cfdist.cluster.config import NODE_PLACEHOLDER, FitConfig

NOTICES_LABEL = "cfdist-notices"
"""Ray node label: ``aws`` or ``gcp`` makes the node poll that cloud's preemption notices."""
NAME_LABEL = "cfdist-node"
"""Ray node label that names a node for ``{node}`` (``ray start --labels='{"cfdist-node":"a"}'``)."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    name: str
    ip: str
    cpus: float
    gpus: float
    notices: str | None = None
    """Cloud whose preemption notices the node polls (label ``cfdist-notices``), or None."""
    starting: bool = field(default=False, compare=False)
    """Its checkpoint actor is still starting (a node that just joined): a group placed there
    waits for it, so recovery picks ready nodes first."""


def unreachable(endpoints: dict[str, tuple[str, int]], timeout_s: float = 0.5) -> set[str]:
    """Which nodes' raylets refuse or do not answer a TCP connection within ``timeout_s``:
    ``{node_id: (address, port)}`` -> the node ids that are gone.

    A lost node is seen here in milliseconds (its port refuses, or its host is gone), while Ray
    marks it dead only after its health checks fail (seconds; 15 s with Ray's defaults). A live
    raylet's kernel accepts the connection however busy the process is. Probes run in parallel."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    def gone(addr: tuple[str, int]) -> bool:
        try:
            socket.create_connection(addr, timeout=timeout_s).close()
            return False
        except OSError:   # refused, unreachable, or no answer in time
            return True

    if not endpoints:
        return set()
    with ThreadPoolExecutor(max_workers=min(16, len(endpoints))) as pool:
        verdicts = dict(zip(endpoints, pool.map(gone, endpoints.values())))
    return {nid for nid, dead in verdicts.items() if dead}


def process_namespace() -> str | None:
    """This process's kernel boot and process-id namespace (``"<boot id>:<pid namespace
    inode>"``), or None where it cannot be told (no ``/proc``). Two processes that report the
    same one see each other's pids: the driver can then tell whether a rank's process still
    lives from ``/proc`` (:func:`exited`) instead of waiting for Ray to report it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


_PF_EXITING = 0x4
"""The kernel's per-task flag "getting shut down" (``/proc/<pid>/stat``'s ninth field): set as a
task starts to exit (a SIGKILL delivered, ``exit()``), before its memory is freed and long
before its sockets are closed (tens of milliseconds for a rank's process)."""


@functools.lru_cache(maxsize=1)
def own_namespace() -> str | None:
    """:func:`process_namespace` of this process (read once)."""
    return process_namespace()


def power_off(pid: int | None, ns: str | None) -> bool:
    """SIGKILL the process ``pid`` at once when it shares this process's namespace (``ns``: what
    it reported, :func:`process_namespace`), as a machine's power-off kills what runs on it; its
    death is expected (Ray's report of it is dropped, :func:`cfdist.cluster.quiet.expect_death`).
    Returns whether it was signalled (False: another namespace, or no such process). For the
    failure injector: Ray's own kill of an actor lands 8-50 ms after it is asked for."""
    from cfdist.cluster.quiet import expect_death

    if not pid or ns is None or ns != own_namespace():
        return False
    expect_death(pid)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def exited(pids, *, exiting: bool = False) -> set[int]:
    """Of ``pids`` (of this process's namespace, :func:`process_namespace`), those whose process
    is gone or has exited and waits to be reaped (a zombie; for a threaded process, its main
    thread exited while the last threads tear the process down). With ``exiting``, also those
    being shut down (:data:`_PF_EXITING`: a SIGKILLed process shows it within milliseconds, while
    its sockets close only once its memory is freed, tens of milliseconds later): none of them
    comes back, but such a process may still hold its files and sockets."""
    from cfdist.checkpoint.persist import pid_alive

    out = set()
    for pid in pids:
        if not pid_alive(pid):
            out.add(pid)
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] in ("Z", "X") or (exiting and int(fields[6]) & _PF_EXITING):
                out.add(pid)
        except (OSError, IndexError, ValueError):
            pass   # gone meanwhile (the next look tells), or no /proc: as alive as kill() said
    return out


def fits(config: FitConfig, cpus: float, gpus: float) -> bool:
    """Whether a node with these total resources can host one node's ranks. Pure."""
    need_cpu = config.workers_per_node * config.cpus_per_worker
    need_gpu = config.workers_per_node if config.use_gpu else 0
    return cpus >= need_cpu and gpus >= need_gpu and (need_cpu > 0 or cpus > 0 or need_gpu > 0)


def usable_nodes(config: FitConfig, *, excluded: frozenset[str] = frozenset(), nodes=None) -> list[NodeInfo]:
    """Alive, not excluded nodes that fit one node's ranks, in a stable order (by name, id).

    ``nodes``: ``ray.nodes()`` output (default: asked now).
    """
    if nodes is None:
        import ray

        nodes = ray.nodes()
    out = []
    for n in nodes:
        if not n.get("Alive") or n["NodeID"] in excluded:
            continue
        res = n.get("Resources", {})
        cpus, gpus = float(res.get("CPU", 0)), float(res.get("GPU", 0))
        if not fits(config, cpus, gpus):
            continue
        labels = n.get("Labels") or {}
        name = labels.get(NAME_LABEL) or n.get("NodeManagerHostname") or n["NodeManagerAddress"]
        out.append(NodeInfo(n["NodeID"], name, n["NodeManagerAddress"], cpus, gpus, labels.get(NOTICES_LABEL)))
    return sorted(out, key=lambda x: (x.name, x.node_id))


def check_distinct_storage(config: FitConfig, nodes: list[NodeInfo]) -> None:
    """Refuse two nodes on one machine that would share a node-local directory.

    On a real cluster every node is its own machine and the same path is fine; fake nodes of a
    one-machine test cluster need ``{node}`` in ``storage`` and distinct ``cfdist-node`` labels.
    """
    seen: dict[tuple[str, str], str] = {}
    for n in nodes:
        for url in config.local_urls(n.name):
            key = (n.ip, url)
            if key in seen and seen[key] != n.node_id:
                raise ValueError(
                    f"nodes {seen[key][:8]} and {n.node_id[:8]} on {n.ip} would both write {url}: put "
                    f"{NODE_PLACEHOLDER!r} in storage= and give each Ray node a distinct "
                    f"{NAME_LABEL!r} label (ray start --labels='{{\"{NAME_LABEL}\": \"a\"}}')")
            seen[key] = n.node_id
