"""``RayBackend``: the controller's view of a Ray cluster (nodes, node actors, worker groups).

It keeps one ``NodeCheckpointer`` actor per node it has used (pinned by node affinity, zero
CPUs, kept across attempts so the memory tier survives crashed workers), with ``warm_spares``
a standby one beside it (started after a recovery, no tier opened) that replaces it without a
process start when it dies (a drained node, a crash), answers the
controller's questions by asking those actors, and builds :class:`RayWorkerGroup` attempts.
Call from the driver, one thread.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import shutil
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cfdist.checkpoint.reader import committed_steps
from cfdist.checkpoint.format import step_dir
from cfdist.cluster import nodes as nodes_mod
from cfdist.cluster.config import FitConfig
from cfdist.cluster.decisions import Holding, RestoreChoice
from cfdist.cluster.node_actor import NodeCheckpointer, memory_root
from cfdist.cluster.nodes import NodeInfo
from cfdist.cluster import niceness
from cfdist.cluster.worker_group import ACTOR_GONE, RayWorkerGroup, _read_in_background, new_rank_actor

log = logging.getLogger("cfdist.backend")

_RemoteNode = ray.remote(NodeCheckpointer)


class NodeLost(RuntimeError):
    """A node chosen for the group turned out to be gone; recovery picks nodes again."""


_CALL_S = 60.0
_EARLY_HOLDINGS_S = 1.0
"""How long after :meth:`RayBackend.lost_nodes` its early holdings questions stand for
:meth:`RayBackend.holdings` (a recovery asks within milliseconds; one that waited for nodes asks again)."""
_DRAIN_S = 0.1
_FINAL_DRAIN_S = 10.0   # the run's last drain (after finish()): a live actor answers in milliseconds
"""How long a poll waits for the node actors' answers to the commit records it asked for (they
answer in milliseconds; one of a node just lost answers only once Ray's health checks fail).
An answer still pending from an earlier poll is not waited for again."""


_URGENT_S = 60.0
"""Seconds after a failure during which preparations (replacement spares, standbys) start at
once instead of a few at a time per host (:meth:`RayBackend.pump_preparations`)."""

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
        """Node ids whose node actor died and could not be replaced: the node is gone even if Ray
        does not know yet."""
        self._actor_died: set[str] = set()   # actor seen dead, its node not checked yet
        self.actors: dict[str, object] = {}
        self.tiers: dict[str, dict] = {}
        self._warming: dict[str, tuple] = {}   # node id -> (actor, ready ref): spares, started ahead
        self._draining: dict[str, tuple] = {}  # node id -> (actor, drain_events ref) not answered yet
        self._standby: dict[str, object] = {}  # node id -> a standby NodeCheckpointer (no tier opened)
        self._activating: dict[str, tuple] = {}   # node id -> (standby, activate ref): see undrain
        self._killed_pids: dict[str, int] = {}    # node id -> pid of the actor drain killed there
        self._spares: dict[str, list[tuple]] = {}   # node id -> [(rank actor, warm ref)]: warm spare ranks
        self._spare_pids: dict[object, int] = {}
        self._recycled: set[int] = set()   # id() of spares that are a failed group's survivors
        self._live_held: dict[str, list[tuple]] = {}   # node id -> [(survivor actor, step it kept in process)]
        self._started_only: set[int] = set()   # id() of spares started but not warmed up yet
        self._prep: list[tuple] = []   # (kind, node id, launch, actor or None) waiting: see pump_preparations
        self._hosts: dict[str, tuple[str, float]] = {}   # node id -> (its host's address, the node's CPUs)
        self._failed_at = -math.inf   # time.monotonic() of the last failure (retire_group)
        self._prep_running: dict[str, list] = {}   # host -> refs of the preparations started there
        self._fn_ref = None
        self._staging: dict[str, object] = {}   # node id -> ref of the copy :meth:`stage` started, for the next group
        self._early_holdings: tuple[float, dict] | None = None   # (when, {node id: (actor, ref)}): see lost_nodes
        self._notices: list[dict] = []
        self.group: RayWorkerGroup | None = None
        self.last_restart_s = 0.0

    # ---- nodes and actors ------------------------------------------------------------------------
    def usable_nodes(self) -> list[NodeInfo]:
        nodes = nodes_mod.usable_nodes(self.config, excluded=frozenset(self.excluded | self.dead))
        if self.config.local_tier:
            nodes_mod.check_distinct_storage(self.config, nodes)
        starting = self._starting(nodes)
        return [dataclasses.replace(n, starting=True) if n.node_id in starting else n for n in nodes]

    def _starting(self, nodes: list[NodeInfo]) -> set[str]:
        """Ids of ``nodes`` whose checkpoint actor was started ahead and is not up yet."""
        refs = {self._warming[n.node_id][1]: n.node_id for n in nodes if n.node_id in self._warming}
        if not refs:
            return set()
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        return set(refs.values()) - {refs[r] for r in ready}

    def _spawn(self, n: NodeInfo, *, standby: bool = False, low: bool = True):
        """A checkpoint actor on ``n``; a standby starts at the lowest priority (a preparation:
        :mod:`cfdist.cluster.niceness`; ``low=False``: like any worker) and returns to the node's
        workers' when activated. One that is not a standby activates at once, after the actor
        :meth:`drain` last killed there is gone (:meth:`_after_kill`)."""
        here = self.tiers.get(n.node_id, {})
        low = standby and low
        role_nice = here.get("nice") if low else None
        actor = _RemoteNode.options(
            num_cpus=0, max_concurrency=8, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False),
            **(niceness.prepared_options(here) if low else {}),
        ).remote(config=self.config, run_id=self.run_id, node_id=n.node_id, node_name=n.name, notices=n.notices,
                 standby=standby, role_nice=role_nice, after_pids=[] if standby else self._after_kill(n.node_id))
        return actor, actor.ready.remote()

    def _after_kill(self, node_id: str) -> list[int]:
        """The pid of the checkpoint actor :meth:`drain` killed on ``node_id`` (the kill may not
        have landed), for the next activation there to wait for; once."""
        pid = self._killed_pids.pop(node_id, None)
        return [pid] if pid else []

    def _successor(self, n: NodeInfo) -> tuple:
        """``(actor, ready ref, is the standby)`` for a node without a live actor: one started
        ahead for a spare node, else the node's standby (activated now: no process start), else
        a new one."""
        if n.node_id in self._activating:
            return (*self._activating.pop(n.node_id), True)
        if n.node_id in self._warming:
            return (*self._warming.pop(n.node_id), False)
        standby = self._standby.pop(n.node_id, None)
        if standby is not None:
            return standby, standby.activate.remote(after_pids=self._after_kill(n.node_id)), True
        return (*self._spawn(n), False)

    def _refill_standby(self, nodes: list[NodeInfo]) -> None:
        """Start (non-blocking) a standby checkpoint actor on each of ``nodes`` that has a live
        actor and no standby: the next death of that actor (a drained node, a crash) activates
        it instead of waiting for a process to start. With ``warm_spares`` only (the same
        trade: an idle process per node for a faster recovery)."""
        if not self.config.warm_spares:
            return
        for n in nodes:
            if n.node_id in self.actors and n.node_id not in self._standby and not self._queued("standby", n.node_id):
                self._prepare("standby", n, functools.partial(self._start_standby, n))

    def _start_standby(self, n: NodeInfo, low: bool = True):
        if n.node_id in self._standby or n.node_id not in self.actors:   # one came meanwhile; or no actor to stand by
            return None
        actor, ready = self._spawn(n, standby=True, low=low)
        self._standby[n.node_id] = actor
        return ready

    def prewarm(self, nodes: list[NodeInfo]) -> None:
        """Start node actors on spare nodes now (non-blocking), so that a recovery onto them
        does not wait for a process to start."""
        for n in nodes:
            if n.node_id not in self.actors and n.node_id not in self._warming:
                self._warming[n.node_id] = self._spawn(n)

    def warm_spare_nodes(self) -> None:
        """Start node actors and warm spare ranks (non-blocking) on usable nodes outside the
        running group, e.g. a node that just joined, so a recovery onto it does not wait."""
        group = {n.node_id for n in self.group.nodes} if self.group is not None else set()
        try:
            spare = [n for n in self.usable_nodes() if n.node_id not in group]
            self.prewarm(spare)
            self._refill_spares(spare)
        except Exception as e:  # noqa: BLE001 - an optimisation only
            log.warning("could not warm spare nodes: %s", e)

    def _ensure_actors(self, nodes: list[NodeInfo]) -> None:
        new = {}
        for n in nodes:
            if n.node_id not in self.actors:
                new[n.node_id] = self._successor(n)
        lost = []
        by_id = {n.node_id: n for n in nodes}
        for nid, (actor, ready, standby) in new.items():
            try:
                try:
                    self.tiers[nid] = ray.get(ready, timeout=_CALL_S)
                except ray.exceptions.RayActorError:
                    if not standby:
                        raise
                    # the standby died (killed with the node's processes): start a new actor now
                    log.warning("node %s: its standby checkpoint actor is gone; starting a new one", nid[:8])
                    actor, ready = self._spawn(by_id[nid])
                    self.tiers[nid] = ray.get(ready, timeout=_CALL_S)
                self.actors[nid] = actor
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                # The node is lost only if Ray says so: an actor that died while starting (killed,
                # out of memory) gets a successor next time, one still starting is waited for again.
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
                if nid not in alive:
                    self.dead.add(nid)
                elif isinstance(e, ray.exceptions.GetTimeoutError):
                    self._warming[nid] = (actor, ready)
                lost.append(f"{nid[:8]}: {type(e).__name__}")
        if lost:
            raise NodeLost(f"node actor(s) could not start on {', '.join(lost)}; nodes Ray reports dead are "
                           f"excluded, the others are tried again")

    def unreachable(self, node_ids, *, ray_nodes: list[dict] | None = None) -> set[str]:
        """Of ``node_ids``, those whose raylet no longer accepts a connection
        (:func:`cfdist.cluster.nodes.unreachable`: milliseconds, where Ray takes seconds to
        declare the node dead). ``ray_nodes``: ``ray.nodes()`` just asked (default: ask now)."""
        want = set(node_ids)
        eps = {n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"])) for n in (ray_nodes or ray.nodes())
               if n["NodeID"] in want and n.get("Alive") and n.get("NodeManagerPort")}
        gone = {nid for nid in want if nid not in eps and nid not in self.excluded}   # Ray says dead already
        return gone | nodes_mod.unreachable(eps)

    def lost_nodes(self, nodes: list[NodeInfo], timeout_s: float = 10.0) -> set[str]:
        """Which of ``nodes`` are gone: Ray says dead, their raylet refuses connections (a
        node killed without notice looks alive to Ray until its health checks fail), or their
        node actor does not answer.

        Called after a failure: the recovery that follows asks every node actor what it holds
        (:meth:`holdings`), so that question is sent now, beside these probes, and its answers
        are read there (one round trip less on a recovery's critical path)."""
        self._ask_holdings_early()
        ray_nodes = ray.nodes()
        alive = {n["NodeID"] for n in ray_nodes if n.get("Alive")}
        lost = {n.node_id for n in nodes if n.node_id not in alive or n.node_id in self.excluded}
        lost |= self.unreachable([n.node_id for n in nodes if n.node_id not in lost], ray_nodes=ray_nodes)
        refs = {n.node_id: self.actors[n.node_id].ready.remote() for n in nodes
                if n.node_id not in lost and n.node_id in self.actors}
        by_id = {n.node_id: n for n in nodes}
        for nid in [n.node_id for n in nodes if n.node_id in self._actor_died and n.node_id not in lost]:
            self._actor_died.discard(nid)
            if nid not in self.actors and not self._replace_actor(by_id[nid]):
                lost.add(nid)
        for nid, ref in refs.items():
            try:
                ray.get(ref, timeout=timeout_s)
            except ray.exceptions.RayActorError:
                if not self._replace_actor(by_id[nid]):
                    lost.add(nid)
            except ray.exceptions.GetTimeoutError:
                lost.add(nid)
        for nid in lost - self.excluded:
            self.dead.add(nid)
            self._forget(nid)
        return lost

    def _replace_actor(self, n: NodeInfo) -> bool:
        """The node actor of ``n`` died: start a new one there. True unless the node itself is
        gone (only the actor died, e.g. killed or out of memory: the node and its local disk stay
        usable; its memory tier is gone). An actor still starting is kept for the next use."""
        self.actors.pop(n.node_id, None)   # dead: its successor (the standby, if any) takes over
        self.tiers.pop(n.node_id, None)
        try:
            self._ensure_actors([n])
        except NodeLost as e:
            log.warning("node %s: its checkpoint actor died; a new one is not ready (%s)", n.name, e)
            return n.node_id not in self.dead
        log.warning("node %s: its checkpoint actor died; started a new one (the node's memory tier is lost, "
                    "its local disk is kept)", n.name)
        return True

    def _forget(self, node_id: str) -> None:
        self._prep = [x for x in self._prep if x[1] != node_id]
        self.actors.pop(node_id, None)
        self.tiers.pop(node_id, None)
        standby = self._standby.pop(node_id, None) or self._activating.pop(node_id, (None,))[0]
        if standby is not None:
            try:
                ray.kill(standby, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        for actor, _ in self._spares.pop(node_id, []):
            self._kill_spare(actor)
        self._live_held.pop(node_id, None)

    def drain(self, node_id: str) -> None:
        """The failure injector takes ``node_id`` out of the cluster without removing it (a
        simulated preemption; it kills the running group's ranks there itself): excluded from
        scheduling until the injector returns it, its node actor killed (SIGKILLed at once where
        the driver sees its process, :func:`cfdist.cluster.nodes.power_off`) and forgotten (a fresh
        one, with an empty memory tier, serves it when it returns; its local disk stays), and
        the survivors of a failed group recycled there with the step they kept in process
        killed too, as :meth:`retire_group` kills those of a node excluded already (a pool
        notice's nodes are taken after its group failed: a restore must not count on a process
        the kill took)."""
        self.excluded.add(node_id)
        actor = self.actors.pop(node_id, None)
        tiers = self.tiers.pop(node_id, {})
        pid, ns = tiers.get("pid"), tiers.get("ns")
        if actor is None and node_id in self._activating:   # activated at a return, taken by no group yet
            actor, ref = self._activating.pop(node_id)
            answer = self._activated(ref)
            pid, ns = answer.get("pid"), answer.get("ns")
        if actor is not None:
            nodes_mod.power_off(pid, ns)   # at once where the driver sees it; Ray's kill lands later
            ray.kill(actor, no_restart=True)
            if pid:
                self._killed_pids[node_id] = pid
        held = {id(a) for a, _ in self._live_held.pop(node_id, [])}
        if held:
            pool = self._spares.pop(node_id, [])
            for a, _ in pool:
                if id(a) in held:
                    self._kill_spare(a)
            self._spares[node_id] = [x for x in pool if id(x[0]) not in held]

    def undrain(self, node_id: str) -> None:
        """The failure injector returns a node it drained (:meth:`drain`): usable again. Its
        standby checkpoint actor, if it has one, is activated now (non-blocking): the recovery
        that follows reads the answer instead of waiting ~20 ms for the activation (opening the
        tiers, sweeping the local disk) on its critical path (:meth:`_successor`). The actor
        :meth:`drain` killed may not be gone yet: the activation first waits for its process to
        be (``NodeCheckpointer.activate``'s ``after_pids``). Drained again before a group took
        it, the activated standby is killed as the node's actor would be."""
        self.excluded.discard(node_id)
        self.dead.discard(node_id)
        standby = self._standby.pop(node_id, None) if node_id not in self.actors else None
        if standby is not None:
            self._activating[node_id] = (standby, standby.activate.remote(after_pids=self._after_kill(node_id)))

    @staticmethod
    def _activated(ref) -> dict:
        """What an activation answered (:meth:`NodeCheckpointer.ready`: its ``pid`` and ``ns``
        among them), if it has answered; ``{}`` if not yet, or if it failed."""
        ready, _ = ray.wait([ref], num_returns=1, timeout=0)
        if not ready:
            _read_in_background([ref])
            return {}
        try:
            return ray.get(ref)
        except ray.exceptions.RayError:
            return {}

    # ---- warm spare ranks ------------------------------------------------------------------------
    def _refill_spares(self, nodes: list[NodeInfo], *, warm: bool = True) -> None:
        """Start (non-blocking) spare rank processes until each node has one per rank slot
        (queued: :meth:`pump_preparations`; the first group's, ``warm=False``, at once).

        ``warm=False``: the processes only start (Ray's worker, torch and cfdist imported:
        most of a spare's cost); a later call with ``warm=True`` has them finish warming up
        (the first DDP's imports, the training function's modules). The first group starts
        its spares that way beside its own ranks, so that a failure soon after the start does
        not wait for a spare's whole start under the training's load."""
        if not self.config.warm_spares or self.config.use_gpu:
            return
        if self._fn_ref is None:
            self._fn_ref = ray.put(self.train_fn)
        for n in nodes:
            pool = self._spares.setdefault(n.node_id, [])
            if warm:
                for actor, _ in pool:
                    if id(actor) in self._started_only and not self._queued("warm", n.node_id, actor):
                        self._prepare("warm", n, functools.partial(self._warm_spare, n.node_id, actor), actor)
            queued = sum(1 for k, nid, _, _ in self._prep if k == "spare" and nid == n.node_id)
            for _ in range(self.config.workers_per_node - len(pool) - queued):
                if warm:
                    self._prepare("spare", n, functools.partial(self._start_spare, n.node_id))
                else:   # the first group's: beside its ranks, at once (start-up pays their imports)
                    actor = new_rank_actor(self.config, n.node_id, None)
                    self._started_only.add(id(actor))
                    pool.append((actor, actor.pid.remote()))

    def _warm_spare(self, node_id: str, actor, low: bool = True):
        """Have a started spare warm up (its pool entry's ref becomes the warm-up's), at the
        lowest priority unless a recovery needs it now (``low=False``); None when a recovery
        took it meanwhile."""
        pool = self._spares.get(node_id, [])
        at = next((i for i, (a, _) in enumerate(pool) if a is actor), None)
        if at is None or id(actor) not in self._started_only:
            return None
        self._started_only.discard(id(actor))
        pool[at] = (actor, actor.warm.remote(self._fn_ref, background=low))
        return pool[at][1]

    def _start_spare(self, node_id: str, low: bool = True):
        """A new spare process; at the lowest priority where the node's checkpoint actor found
        that it may return to the workers' when it takes a rank's role (:mod:`cfdist.cluster.niceness`),
        unless a recovery needs it now (``low=False``: like any worker)."""
        here = self.tiers.get(node_id, {})
        actor = new_rank_actor(self.config, node_id, None, prepared=here if low and here.get("renice") else None)
        ref = actor.warm.remote(self._fn_ref, background=low)
        self._spares.setdefault(node_id, []).append((actor, ref))
        return ref

    # ---- preparations: processes started or warmed ahead, a few at a time per host ---------------
    def _prepare(self, kind: str, n: NodeInfo, launch, actor=None) -> None:
        self._prep.append((kind, n.node_id, launch, actor))
        self.pump_preparations()

    def _queued(self, kind: str, node_id: str, actor=None) -> bool:
        return any(k == kind and nid == node_id and (actor is None or a is actor) for k, nid, _, a in self._prep)

    def _launch(self, i: int, low: bool = True) -> None:
        """Start queued preparation ``i``; at the lowest priority, unless a recovery waits for
        it (``low=False``)."""
        kind, nid, launch, _ = self._prep.pop(i)
        if nid in self.dead or nid in self.excluded:
            return
        try:
            ref = launch(low=low)
        except Exception as e:  # noqa: BLE001 - an optimisation only: the recovery starts what it needs
            log.warning("could not start a %s on node %s ahead: %s", kind, nid[:8], e)
            return
        if ref is not None:
            self._prep_running.setdefault(self._host_of(nid), []).append(ref)

    def _host_of(self, node_id: str) -> str:
        if node_id not in self._hosts:
            self._hosts = {n["NodeID"]: (n.get("NodeManagerAddress", ""), float(n.get("Resources", {}).get("CPU", 0)))
                           for n in ray.nodes() if n.get("Alive")}
        return self._hosts.get(node_id, ("", 0.0))[0] or node_id

    def _prep_room(self, host: str) -> int:
        """Preparations that may run at once on ``host``: its CPUs (its Ray nodes' together)
        less the running group's ranks there, halved; at least two (one at a time left the
        first failures of a run with one every 5 s without a ready standby). Within :data:`_URGENT_S`
        of a failure, all of them: the next failure may come before a queue drains (at one
        node preemption every 5 s, one at a time left a drained node's standby or spare not
        started at the next one: 5 of 12 recoveries took 2 s instead of 0.2)."""
        if self._urgent():
            return len(self._prep) + sum(len(r) for r in self._prep_running.values()) + 1
        cpus = sum(c for h, c in self._hosts.values() if h == host)
        ranks = self.config.workers_per_node * sum(
            1 for n in (self.group.nodes if self.group is not None else []) if self._host_of(n.node_id) == host)
        return max(2, int(cpus - ranks) // 2)

    def _urgent(self) -> bool:
        """Within :data:`_URGENT_S` of a failure: the next one may come before the preparations
        are done, so they start at once (:meth:`_prep_room`)."""
        return time.monotonic() - self._failed_at < _URGENT_S

    def pump_preparations(self) -> None:
        """Start the queued preparations (warm spares' warm-ups, new spare processes, standby
        checkpoint actors) that their host has room for: each one imports torch and more for
        seconds on a core, and training's ranks need theirs when they wake. Room on a host:
        its CPUs less its ranks, halved, at least two (:meth:`_prep_room`; all of them within
        :data:`_URGENT_S` of a failure): on a 2-core machine that fakes two nodes, two run
        beside the ranks instead of four. Called by the controller's loop; a recovery takes
        what it needs at once (:meth:`_take_spares`)."""
        for host, refs in list(self._prep_running.items()):
            if refs:
                _, refs = ray.wait(refs, num_returns=len(refs), timeout=0)
            if refs:
                self._prep_running[host] = refs
            else:
                del self._prep_running[host]
        i = 0
        while i < len(self._prep):
            host = self._host_of(self._prep[i][1])
            if len(self._prep_running.get(host, ())) < self._prep_room(host):
                self._launch(i)
            else:
                i += 1

    def _take_spares(self, nodes: list[NodeInfo]) -> dict[str, list]:
        """Up to ``workers_per_node`` warm spares of each of ``nodes`` (removed from the pool),
        ready ones first (recycled survivors, spares done warming up); waits only for the ones
        still warming up that it needs (a process half-way through its imports beats a new
        one). A spare that died or does not get ready within the rendezvous timeout is replaced
        by a fresh rank."""
        w = self.config.workers_per_node
        want = {n.node_id for n in nodes}
        for i in reversed(range(len(self._prep))):   # spares still queued for these nodes: start them now
            if self._prep[i][0] in ("spare", "warm") and self._prep[i][1] in want:
                self._launch(i, low=False)   # the recovery waits for it: like any worker
        pools = {}
        for n in nodes:
            pool = self._spares.pop(n.node_id, [])
            if pool:
                done, _ = ray.wait([ref for _, ref in pool], num_returns=len(pool), timeout=0)
                pool.sort(key=lambda x: x[1] not in done)   # stable: ready ones first
            pools[n.node_id] = pool[:w]
            if pool[w:]:
                self._spares[n.node_id] = pool[w:]
        refs = [ref for pool in pools.values() for _, ref in pool]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self.config.rendezvous_timeout_s)
        out: dict[str, list] = {}
        for nid, pool in pools.items():
            for actor, ref in pool:
                try:
                    got = ray.get(ref, timeout=0)   # a pid, or a recycled survivor's {"pid", "live_step"}
                    self._spare_pids[actor] = got["pid"] if isinstance(got, dict) else got
                    out.setdefault(nid, []).append(actor)
                except (ray.exceptions.RayError, TimeoutError) as e:
                    log.warning("a warm spare on node %s is not usable (%s); starting a fresh rank", nid[:8], e)
                    self._kill_spare(actor)
        return out

    def begin_retire(self, group: RayWorkerGroup) -> None:
        """After a failure, before it is classified: the survivors that :meth:`retire_group`
        will recycle start dropping the attempt now (:meth:`RayWorkerGroup.begin_recycle`), so
        that the driver's probes of the nodes and their recycling overlap."""
        if self.config.warm_spares and not self.config.use_gpu:
            group.begin_recycle()

    def retire_group(self, group: RayWorkerGroup) -> None:
        """After a failure: stop ``group``; its ranks that survived (their process lives, on a
        node not lost) become warm spares of their node, ahead of the pool (no process start
        for them at the restart); the others are killed."""
        self._failed_at = time.monotonic()   # preparations start at once for a while (_prep_room)
        if not self.config.warm_spares or self.config.use_gpu:
            group.shutdown()
            return
        kept = group.recycle()
        self._live_held = {}
        for nid, pool in kept.items():
            if nid in self.dead or nid in self.excluded:
                for actor, _ in pool:
                    self._kill_spare(actor)
                continue
            self._spares[nid] = pool + self._spares.get(nid, [])
            self._recycled.update(id(actor) for actor, _ in pool)
        for nid, actor, step in group.live_held:
            if nid not in self.dead and nid not in self.excluded:
                self._live_held.setdefault(nid, []).append((actor, step))

    def _kill_spare(self, actor) -> None:
        from cfdist.cluster.quiet import expect_death

        expect_death(self._spare_pids.pop(actor, 0))
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone with its node
            pass

    def _actor_gone(self, nid: str, e: BaseException, actor=None) -> None:
        """A call to node ``nid``'s actor failed because the actor died (crashed, or killed by
        Ray's memory monitor): forget it, unless it is no longer the node's actor (``actor``, the
        one called, was replaced since). Whether its node died too, :meth:`lost_nodes` finds out
        (it tries a new actor there): an actor killed alone must not cost the run a healthy node."""
        log.warning("node actor %s is gone (%s)", nid[:8], type(e).__name__)
        if actor is None or self.actors.get(nid) is actor:
            self._actor_died.add(nid)
            self._forget(nid)

    def _ask_all(self, method: str, *args, timeout: float = _CALL_S, skip=frozenset(), reuse: dict | None = None,
                 **kwargs) -> dict[str, object]:
        """Call ``method`` on every known actor but those of the nodes in ``skip``; forget the
        ones that are gone. ``reuse``: ``{node_id: (actor, ref)}`` of the same call sent
        earlier; an actor still the node's reads that answer instead of being asked again."""
        reuse = reuse or {}
        refs = {nid: (reuse[nid][1] if nid in reuse and reuse[nid][0] is a else getattr(a, method).remote(*args, **kwargs))
                for nid, a in self.actors.items() if nid not in skip}
        out = {}
        for nid, ref in refs.items():
            try:
                out[nid] = ray.get(ref, timeout=timeout)
            except ACTOR_GONE as e:
                self._actor_gone(nid, e)
            except ray.exceptions.GetTimeoutError:
                log.warning("node actor %s did not answer %s within %.0fs; ignoring it", nid[:8], method, timeout)
        return out

    def _ask_holdings_early(self) -> None:
        """Send :meth:`NodeCheckpointer.holdings` to every node actor now, for the
        :meth:`holdings` that follows within :data:`_EARLY_HOLDINGS_S` (after a failure: the
        group is stopped and its live saves are in, so what the nodes hold changes only by a
        stage or a durable commit, which drop these answers)."""
        self._drop_early_holdings()
        self._early_holdings = (time.monotonic(), {nid: (a, a.holdings.remote(with_shared=False))
                                                   for nid, a in self.actors.items()})

    def _drop_early_holdings(self) -> None:
        """Forget the early holdings answers (what the nodes hold is about to change); they are
        read on a background thread, or Ray prints the errors of those whose actor died."""
        early, self._early_holdings = self._early_holdings, None
        if early is not None:
            _read_in_background([ref for _, ref in early[1].values()])

    # ---- the controller's questions ----------------------------------------------------------------
    def holdings(self, newest: int | None = None) -> list[Holding]:
        usable = self.usable_nodes()
        starting = [n for n in usable if n.starting]
        if newest is not None and starting:
            ready = [n for n in usable if not n.starting]
            out = self._holdings(ready)
            if any(max(h.live + h.memory + h.local + h.shared, default=-1) >= newest for h in out):
                log.info("holdings: node(s) %s still starting their checkpoint actor are not waited for: the "
                         "others hold step %d, the newest there is", [n.name for n in starting], newest)
                return out
        return self._holdings(usable)

    def _holdings(self, usable: list[NodeInfo]) -> list[Holding]:
        try:
            # A node without an actor yet (a fresh driver re-running a run_name) may hold that
            # run's checkpoints on its local disk: its actor must be asked too.
            self._ensure_actors(usable)
        except NodeLost as e:
            if any(n.node_id not in self.actors and n.node_id not in self.dead for n in usable):
                raise   # a live node's holdings are unknown: the controller asks again
            log.warning("%s", e)
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for nid in [n for n in self.actors if n not in alive]:
            self._forget(nid)
        early, self._early_holdings = self._early_holdings, None
        reuse = early[1] if early is not None and time.monotonic() - early[0] < _EARLY_HOLDINGS_S else None
        answers = self._ask_all("holdings", with_shared=False, reuse=reuse)
        if early is not None:   # answers not used (an actor gone or replaced since): read, or Ray prints their errors
            _read_in_background([ref for nid, (a, ref) in early[1].items()
                                 if reuse is None or self.actors.get(nid) is not a])
        out = [Holding(node_id=nid, memory=tuple(h["memory"]), local=tuple(h["local"]), live=self._live_steps(nid))
               for nid, h in answers.items()]
        if self.config.shared_url():
            out.append(Holding(node_id=None, shared=tuple(self._shared_steps())))
        return out

    def _live_steps(self, node_id: str) -> tuple[int, ...]:
        """Steps that survivors of the failed group on ``node_id`` keep in process (recycled as
        that node's spares: :meth:`retire_group`), for a restore over the next group."""
        pool = {id(a) for a, _ in self._spares.get(node_id, [])}
        return tuple(sorted({s for a, s in self._live_held.get(node_id, []) if id(a) in pool}))

    def _live_source(self, choice: RestoreChoice):
        """The survivor actor that holds ``choice``'s step in process (its tier is "live")."""
        if choice.tier != "live":
            return None
        nid = next(peer for t, peer in choice.sources.values() if t == "live")
        return next(a for a, s in self._live_held.get(nid, []) if s == choice.step)

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
        """Start copying ``choice``'s step to the nodes that lack it (from a peer's actor, or
        from shared storage) and return at once: ``{node_id: ObjectRef}`` of the copies. The
        next :meth:`start_group` hands each to its node's ranks, and ``ckpt.restore()`` waits
        for it: the copy runs while the group forms and the ranks build their model, not before
        (it was 30-60 ms of a killed rank's 0.2 s recovery). A copy that fails makes that
        attempt fail (its ranks raise, naming it), and the next recovery chooses again."""
        self._ensure_actors(nodes)
        self._drop_early_holdings()
        refs = {}
        for n in nodes:
            tier, peer = choice.sources.get(n.node_id, ("none", None))
            if tier == "peer":
                refs[n.node_id] = self.actors[n.node_id].stage.remote(choice.step, "peer", self.actors[peer])
            elif tier == "shared":
                refs[n.node_id] = self.actors[n.node_id].stage.remote(choice.step, "shared")
        if self._staging:   # copies started for a group that did not start: read, or Ray prints their errors
            _read_in_background(list(self._staging.values()))
        self._staging = refs
        return dict(refs)

    def start_group(self, nodes: list[NodeInfo], choice: RestoreChoice, attempt: int,
                    dead_pids: list[int]) -> RayWorkerGroup:
        self._ensure_actors(nodes)
        peers = [self.actors[n.node_id] for n in nodes[1:]]   # node 0 asks them for shared-upload slices
        # answered before the ranks run (the group waits for them), not before they rendezvous
        begun = [self.actors[n.node_id].begin_attempt.remote(attempt, shared_writer=(i == 0), dead_pids=dead_pids,
                                                             peers=peers if i == 0 else [])
                 for i, n in enumerate(nodes)]
        if self._fn_ref is None:
            self._fn_ref = ray.put(self.train_fn)
        t_wait = time.perf_counter()
        spares = self._take_spares(nodes)
        spare_wait_s = time.perf_counter() - t_wait
        recycled = sum(id(a) in self._recycled for pool in spares.values() for a in pool)
        self._recycled.clear()   # spares left in the pool are plain spares from now on
        if self.group is None:
            # the job's first group: its spares start beside its ranks (start-up, not training,
            # pays their imports); they warm up once it runs (refill_spares)
            self._refill_spares(nodes, warm=False)
        staged, self._staging = self._staging, {}
        live_source = self._live_source(choice)
        self._live_held = {}   # a survivor's kept state serves this group's restore only
        group = RayWorkerGroup(config=self.config, nodes=nodes, node_actors=[self.actors[n.node_id] for n in nodes],
                               tiers=[self.tiers[n.node_id] for n in nodes], attempt=attempt,
                               train_fn=self._fn_ref, policy=self.policy, choice=choice, spares=spares,
                               unreachable=self.unreachable, staged=staged, begun=begun, live_source=live_source)
        group.recycled = recycled
        try:
            self.last_restart_s = group.start()
        except Exception:
            group.shutdown()
            _read_in_background(list(staged.values()))   # no rank waits for these copies now
            raise
        group.phases["spare_wait"] = spare_wait_s   # spares still warming up (a failure soon after the last)
        self.group = group
        return group

    def refill_spares(self) -> None:
        """Start replacement warm spares for the running group's nodes and the spare nodes
        (non-blocking). The controller calls it once the group completed its first step: new
        processes importing torch compete for the CPUs with the restore and the first step,
        so they start only after the recovery (measured: setup 0.4 s with them, 0.05 s without).
        They are queued as preparations (:meth:`pump_preparations`): the spares first, a failure
        of any rank needs one; the standbys after them."""
        if self.group is not None:
            self._refill_spares(self.group.nodes)
            self._refill_standby(self.group.nodes)
        self.warm_spare_nodes()

    def drain_commits(self, final: bool = False) -> list[dict]:
        """Commit records of the node actors since the previous call. Each actor is asked once
        at a time; the answers asked for now get up to ``_DRAIN_S``, and one still pending from
        an earlier call (its node was just lost, and Ray answers for it only once its health
        checks fail: seconds) is only looked at: it is read at a later call. After the group
        failed nothing is waited for: the failure's detection must not wait for a dead node's
        actor (it made a lost node's detection 1.3 s instead of 0.2 s in 4 of 10 recoveries).
        ``final``: the run's last call, after :meth:`finish` (whose shared upload's record is
        still on the actor): every answer, earlier ones included, gets up to ``_FINAL_DRAIN_S``."""
        out = []
        # not the actors of a node the group found gone: a call to one waits for Ray to give up
        gone = getattr(self.group, "_gone", set()) if self.group is not None else set()
        failed = bool(getattr(self.group, "_errors", None)) if self.group is not None else False
        fresh = []
        for nid, actor in self.actors.items():
            if nid not in gone and nid not in self._draining:
                self._draining[nid] = (actor, actor.drain_events.remote())
                fresh.append(self._draining[nid][1])
        asked = {nid: a_ref for nid, a_ref in self._draining.items() if nid not in gone}
        ready = []
        if final:
            refs = [ref for _, ref in asked.values()]
            ready = ray.wait(refs, num_returns=len(refs), timeout=_FINAL_DRAIN_S)[0] if refs else []
        elif fresh and not failed:
            ready, _ = ray.wait(fresh, num_returns=len(fresh), timeout=_DRAIN_S)
        earlier = [ref for _, ref in asked.values() if ref not in set(ready)]
        if earlier and not final:
            ready += ray.wait(earlier, num_returns=len(earlier), timeout=0)[0]
        ready = set(ready)
        for nid, (actor, ref) in asked.items():
            if ref not in ready:
                continue
            del self._draining[nid]
            try:
                evs = ray.get(ref)
            except ACTOR_GONE as e:
                self._actor_gone(nid, e, actor)
                continue
            out += [e for e in evs if e["event"] == "checkpoint_committed"]
            self._notices += [e for e in evs if e["event"] == "preemption_notice"]
        for nid in [n for n, (a, _) in self._draining.items() if self.actors.get(n) is not a]:
            del self._draining[nid]   # the actor was replaced or forgotten: its answer no longer counts
        return sorted(out, key=lambda e: e["t"])

    def drain_notices(self) -> list[dict]:
        """Cloud preemption notices the node actors saw since the previous call (after
        :meth:`drain_commits`, which collects them)."""
        out, self._notices = self._notices, []
        return out

    def commit_durable(self, nodes: list[NodeInfo], deadline: float) -> dict | None:
        """Before a preemption that takes every node of the group: each node's newest step
        (a halted group's live state lands in the memory tier) into its local tier, at once on
        every node, then the newest of them into shared storage when the run has it, from the
        node that holds it; all within ``deadline`` (wall time). Returns ``{"step", "tier",
        "t"}`` of the newest durable commit (``"shared"`` or ``"local"``), or None when no node
        holds one (memory tier only, or nothing committed)."""
        self._drop_early_holdings()   # the local tiers change now
        actors = [(n, self.actors[n.node_id]) for n in nodes if n.node_id in self.actors]
        refs = {a.make_durable.remote(): n for n, a in actors}
        # Not past the kill (plus a moment: a halted group's live saves went to disk already,
        # and the answer that says when is what is waited for here).
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=max(0.0, deadline - time.time()) + 2.0)
        for r in late:
            ray.cancel(r, force=False)
        best = None   # (step, when it was durable first, node)
        for r in ready:
            try:
                got = ray.get(r)
            except ray.exceptions.RayError as e:
                log.warning("node %s could not make its newest step durable: %s", refs[r].name, e)
                continue
            if got is not None and (best is None or (got["step"], -got["t"]) > (best[0], -best[1])):
                best = (got["step"], got["t"], refs[r])
        if best is None:
            return None
        out = {"step": best[0], "tier": "local", "t": best[1]}
        if self.config.shared_url():
            left = deadline - time.time()
            try:
                got = ray.get(self.actors[best[2].node_id].flush_shared.remote(best[0], timeout_s=max(0.0, left)),
                              timeout=max(0.0, left) + 1.0)
                if got == best[0]:
                    out.update(tier="shared", t=time.time())
            except Exception as e:  # noqa: BLE001 - the local copies stay; reported by the caller's event
                log.warning("step %d did not reach shared storage before the preemption: %s", best[0], e)
        return out

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
        step = ray.get(actor.flush_local.remote(), timeout=3600)
        if step is not None and tiers.get("local"):
            return f"{tiers['local'][0]}/{step_dir(step)}"
        return None   # memory only: freed with the run

    def close(self) -> None:
        """Kill the group and the node actors; free the memory tiers on this machine too."""
        pids = []
        if self.group is not None:
            pids = self.group.pids()
            self.group.shutdown()
        refs = []
        for a in [*self.actors.values(), *(w[0] for w in [*self._warming.values(), *self._activating.values()])]:
            try:
                refs.append(a.close.remote(dead_pids=pids))
            except Exception:  # noqa: BLE001
                pass
        try:
            ray.wait(refs, num_returns=len(refs), timeout=30)
        except Exception:  # noqa: BLE001
            pass
        for a in [*self.actors.values(), *(w[0] for w in [*self._warming.values(), *self._activating.values()]),
                  *self._standby.values()]:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self._standby.clear()
        self._activating.clear()
        self._prep.clear()
        for pool in self._spares.values():
            for actor, _ in pool:
                self._kill_spare(actor)
        self._spares.clear()
        self.actors.clear()
        self._warming.clear()
        root = memory_root(self.run_id)
        if root and os.path.isdir(root):   # fake nodes of this machine that were removed
            shutil.rmtree(root, ignore_errors=True)

    # ---- for the failure injector --------------------------------------------------------------------
    def node_actor_pid(self, node_id: str) -> int | None:
        return self.tiers.get(node_id, {}).get("pid")
