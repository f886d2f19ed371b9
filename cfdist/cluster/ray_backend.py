"""``RayBackend``: the controller's view of a Ray cluster (nodes, node actors, worker groups).

It keeps one ``NodeCheckpointer`` actor per node it has used (pinned by node affinity, zero
CPUs, kept across attempts so the memory tier survives crashed workers), answers the
controller's questions by asking those actors, and builds :class:`RayWorkerGroup` attempts.
Call from the driver, one thread.
"""

from __future__ import annotations

import logging
import os
import shutil

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cfdist.checkpoint.discovery import committed_steps
from cfdist.checkpoint.format import step_dir
from cfdist.cluster import nodes as nodes_mod
from cfdist.cluster.config import FitConfig
from cfdist.cluster.decisions import Holding, RestoreChoice
from cfdist.cluster.node_actor import NodeCheckpointer, memory_root
from cfdist.cluster.nodes import NodeInfo
from cfdist.cluster.worker_group import RayWorkerGroup

log = logging.getLogger("cfdist.backend")

_RemoteNode = ray.remote(NodeCheckpointer)


class NodeLost(RuntimeError):
    """A node chosen for the group turned out to be gone; recovery picks nodes again."""
_CALL_S = 60.0


class RayBackend:
    """Implements :class:`cfdist.cluster.states.ClusterBackend` on Ray."""

    def __init__(self, config: FitConfig, *, run_id: str, train_fn, policy):
        self.config = config
        self.run_id = run_id
        self.train_fn = train_fn
        self.policy = policy
        self.excluded: set[str] = set()
        """Node ids the failure injector took away (not usable until it returns them)."""
        self.dead: set[str] = set()
        """Node ids whose node actor died: the node is gone even if Ray does not know yet."""
        self.actors: dict[str, object] = {}
        self.tiers: dict[str, dict] = {}
        self._warming: dict[str, tuple] = {}   # node id -> (actor, ready ref): spares, started ahead
        self.group: RayWorkerGroup | None = None
        self.last_restart_s = 0.0

    # ---- nodes and actors ------------------------------------------------------------------------
    def usable_nodes(self) -> list[NodeInfo]:
        nodes = nodes_mod.usable_nodes(self.config, excluded=frozenset(self.excluded | self.dead))
        if self.config.local_tier:
            nodes_mod.check_distinct_storage(self.config, nodes)
        return nodes

    def _spawn(self, n: NodeInfo):
        actor = _RemoteNode.options(
            num_cpus=0, max_concurrency=8, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False),
        ).remote(config=self.config, run_id=self.run_id, node_id=n.node_id, node_name=n.name)
        return actor, actor.ready.remote()

    def prewarm(self, nodes: list[NodeInfo]) -> None:
        """Start node actors on spare nodes now (non-blocking), so that a recovery onto them
        does not wait for a process to start."""
        for n in nodes:
            if n.node_id not in self.actors and n.node_id not in self._warming:
                self._warming[n.node_id] = self._spawn(n)

    def _ensure_actors(self, nodes: list[NodeInfo]) -> None:
        new = {}
        for n in nodes:
            if n.node_id not in self.actors:
                new[n.node_id] = self._warming.pop(n.node_id, None) or self._spawn(n)
        lost = []
        for nid, (actor, ready) in new.items():
            try:
                self.tiers[nid] = ray.get(ready, timeout=_CALL_S)
                self.actors[nid] = actor
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                self.dead.add(nid)
                lost.append(f"{nid[:8]}: {type(e).__name__}")
        if lost:
            raise NodeLost(f"node actor(s) could not start on {', '.join(lost)}; those nodes are excluded")

    def lost_nodes(self, nodes: list[NodeInfo], timeout_s: float = 10.0) -> set[str]:
        """Which of ``nodes`` are gone: Ray says dead, or their node actor does not answer
        (a node killed without notice looks alive to Ray until its heartbeats time out)."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        lost = {n.node_id for n in nodes if n.node_id not in alive or n.node_id in self.excluded}
        refs = {n.node_id: self.actors[n.node_id].ready.remote() for n in nodes
                if n.node_id not in lost and n.node_id in self.actors}
        for nid, ref in refs.items():
            try:
                ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                lost.add(nid)
        for nid in lost - self.excluded:
            self.dead.add(nid)
            self._forget(nid)
        return lost

    def _forget(self, node_id: str) -> None:
        self.actors.pop(node_id, None)
        self.tiers.pop(node_id, None)

    def _ask_all(self, method: str, *args, timeout: float = _CALL_S, **kwargs) -> dict[str, object]:
        """Call ``method`` on every known actor; forget the ones that are gone."""
        refs = {nid: getattr(a, method).remote(*args, **kwargs) for nid, a in self.actors.items()}
        out = {}
        for nid, ref in refs.items():
            try:
                out[nid] = ray.get(ref, timeout=timeout)
            except ray.exceptions.RayActorError:
                self.dead.add(nid)
                self._forget(nid)
            except ray.exceptions.GetTimeoutError:
                log.warning("node actor %s did not answer %s within %.0fs; ignoring it", nid[:8], method, timeout)
        return out

    # ---- the controller's questions ----------------------------------------------------------------
    def holdings(self) -> list[Holding]:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for nid in [n for n in self.actors if n not in alive]:
            self._forget(nid)
        answers = self._ask_all("holdings", with_shared=False)
        out = [Holding(node_id=nid, memory=tuple(h["memory"]), local=tuple(h["local"]))
               for nid, h in answers.items()]
        if self.config.shared_url():
            out.append(Holding(node_id=None, shared=tuple(self._shared_steps())))
        return out

    def _shared_steps(self) -> list[int]:
        for nid, actor in list(self.actors.items()):
            try:
                return ray.get(actor.holdings.remote(with_shared=True), timeout=_CALL_S).get("shared", [])
            except ray.exceptions.RayError:
                self._forget(nid)
        from cfdist.storage import open_storages   # no actor left: the driver lists it itself
        from cfdist.storage.redact import redact, redact_url

        try:
            return committed_steps(open_storages(self.config.shared_url(), **(self.config.storage_options or {}))[0])
        except OSError as e:
            log.warning("cannot list the shared tier %s: %s", redact_url(self.config.shared_url()), redact(e))
            return []

    def stage(self, choice: RestoreChoice, nodes: list[NodeInfo]) -> dict:
        self._ensure_actors(nodes)
        refs = {}
        for n in nodes:
            tier, peer = choice.sources.get(n.node_id, ("none", None))
            if tier == "peer":
                refs[n.node_id] = self.actors[n.node_id].stage.remote(choice.step, "peer", self.actors[peer])
            elif tier == "shared":
                refs[n.node_id] = self.actors[n.node_id].stage.remote(choice.step, "shared")
        return {nid: ray.get(ref, timeout=600) for nid, ref in refs.items()}

    def start_group(self, nodes: list[NodeInfo], choice: RestoreChoice, attempt: int,
                    dead_pids: list[int]) -> RayWorkerGroup:
        self._ensure_actors(nodes)
        ray.get([self.actors[n.node_id].begin_attempt.remote(attempt, shared_writer=(i == 0), dead_pids=dead_pids)
                 for i, n in enumerate(nodes)], timeout=_CALL_S)
        group = RayWorkerGroup(config=self.config, nodes=nodes, node_actors=[self.actors[n.node_id] for n in nodes],
                               tiers=[self.tiers[n.node_id] for n in nodes], attempt=attempt,
                               train_fn=self.train_fn, policy=self.policy, choice=choice)
        try:
            self.last_restart_s = group.start()
        except Exception:
            group.shutdown()
            raise
        self.group = group
        chosen = {n.node_id for n in nodes}
        try:
            self.prewarm([n for n in self.usable_nodes() if n.node_id not in chosen])
        except Exception as e:  # noqa: BLE001 - an optimisation only
            log.warning("could not start node actors on spare nodes: %s", e)
        return group

    def drain_commits(self) -> list[dict]:
        out = []
        for evs in self._ask_all("drain_events", timeout=10).values():
            out += evs
        return sorted(out, key=lambda e: e["t"])

    def finish(self) -> str | None:
        """Make the final checkpoint durable in shared storage (if any); return its URL."""
        if self.group is None or not self.group.nodes:
            return None
        nid = self.group.nodes[0].node_id
        actor, tiers = self.actors.get(nid), self.tiers.get(nid, {})
        if actor is None:
            return None
        if self.config.shared_url():
            step = ray.get(actor.flush_shared.remote(), timeout=3600)
            if step is not None:
                return f"{tiers['shared']}/{step_dir(step)}"
        h = ray.get(actor.holdings.remote(), timeout=_CALL_S)
        if h["local"] and tiers.get("local"):
            return f"{tiers['local'][0]}/{step_dir(max(h['local']))}"
        return None   # memory only: freed with the run

    def close(self) -> None:
        """Kill the group and the node actors; free the memory tiers on this machine too."""
        pids = []
        if self.group is not None:
            pids = self.group.pids()
            self.group.shutdown()
        refs = []
        for a in [*self.actors.values(), *(w[0] for w in self._warming.values())]:
            try:
                refs.append(a.close.remote(dead_pids=pids))
            except Exception:  # noqa: BLE001
                pass
        try:
            ray.wait(refs, num_returns=len(refs), timeout=30)
        except Exception:  # noqa: BLE001
            pass
        for a in [*self.actors.values(), *(w[0] for w in self._warming.values())]:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.actors.clear()
        self._warming.clear()
        root = memory_root(self.run_id)
        if root and os.path.isdir(root):   # fake nodes of this machine that were removed
            shutil.rmtree(root, ignore_errors=True)

    # ---- for the failure injector --------------------------------------------------------------------
    def node_actor_pid(self, node_id: str) -> int | None:
        return self.tiers.get(node_id, {}).get("pid")
