"""``RayWorkerGroup``: one attempt's ranks as Ray actors, placed node by node.

Ranks are laid out node-major: node ``i`` of the group hosts ranks ``i*w .. i*w+w-1`` with
local ranks ``0..w-1``; local rank 0 is the node's writer. Each actor is pinned to its node
(node-affinity, not soft). Rendezvous: rank 0 opens a ``TCPStore`` on its node's IP (the
loopback/host IP in local runs) on a port the OS picks, every rank joins it, and
``torch.distributed`` is initialised (gloo on CPU, NCCL on GPU).

Call from the driver, one thread.
"""

from __future__ import annotations

import logging
import threading
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cfdist.cluster.config import FitConfig
from cfdist.cluster.context import RankInfo
from cfdist.cluster.decisions import RestoreChoice
from cfdist.cluster import niceness
from cfdist.cluster.nodes import NodeInfo, exited, own_namespace, power_off
from cfdist.cluster.states import GroupStatus, RankError
from cfdist.cluster.worker import RankWorker

log = logging.getLogger("cfdist.group")

ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)
"""What a call to an actor whose process is gone raises: it crashed, its node was lost, Ray's
memory monitor killed it, or it was stopped as hung."""

_RemoteWorker = ray.remote(RankWorker)
_ASK_S = 0.2
"""Margin on top of :data:`_PEER_DIED_S` for a survivor's answer to travel back to the driver (a
rank on a lost node never answers)."""
_PEER_DIED_S = 1.5
"""After a failure, how long a surviving rank has to start writing its live state (a rank in a
collective starts within milliseconds; :meth:`RankWorker.peer_died` unblocks one at its run's
end); a rank that has not started by then is not waited for."""
_PROBE_EVERY_S = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2)
"""After a first error, when the nodes of the ranks still running are probed (seconds after
the previous probe; the last value repeats): at once, since the first error is often a
survivor's collective failing because its peer's node is gone (a lost node's ranks are reported
only after Ray's health checks, seconds later), then again, sooner than later, for a node whose
raylet outlived its workers by a moment. A probe costs a few milliseconds of the driver's time."""
_HUNG_ASK_S = 2.0
"""A group that made no progress: how long each rank has to say which step it is at (a live
process answers on another thread of its actor in milliseconds; a frozen one never does)."""
_SETTLE_S = 1.0
"""After a first error, how long to wait for the other ranks' outcomes (to classify the failure:
a surviving rank's collective error usually follows its peer's death within milliseconds)."""
_EXIT_EVERY_S = 0.002
"""After a first error, how often the driver looks in ``/proc`` for the processes of the ranks
still running that share its process namespace (:meth:`RayWorkerGroup._exited`): Ray reports a
rank's death 20-40 ms after its survivor's collective failed on this 2-core machine."""

_WATCH_EVERY_S = 0.005
"""While the group trains, how often a driver thread looks in ``/proc`` for its ranks'
processes (those in its process namespace, :attr:`RayWorkerGroup._here`): one seen exiting
(:func:`~cfdist.cluster.nodes.exited`), its peers' groups are broken at once
(:meth:`RankWorker.break_group`) instead of when its sockets close, tens of milliseconds later.
A look reads one small file per rank (tens of microseconds)."""
_WATCH_LEASE_S = 1.0
"""How long one question to a node actor about its ranks' processes runs (it is asked again
after an answer without an exit; the watch's end leaves at most one such question running)."""


class RayWorkerGroup:
    """The ranks of one attempt. ``start()`` blocks until every rank runs the training function."""

    def __init__(self, *, config: FitConfig, nodes: list[NodeInfo], node_actors: list, tiers: list[dict],
                 attempt: int, train_fn, policy, choice: RestoreChoice, spares: dict | None = None,
                 unreachable=None, staged: dict | None = None, begun: list | None = None,
                 live_source=None):
        self.config = config
        self._unreachable = unreachable
        self._gone: set[str] = set()   # nodes whose raylet was found gone after a failure
        """``node_ids -> the gone ones`` (the backend's raylet probe), or None: after a failure
        the poll stops waiting for ranks of a node already gone."""
        self.nodes = nodes
        self.world_size = len(nodes) * config.workers_per_node
        self._node_actors = node_actors
        self._tiers = tiers
        self.attempt = attempt
        self._train_fn = train_fn
        self._policy = policy
        self._choice = choice
        self._begun = begun or []
        """Refs of the node actors' ``begin_attempt`` calls: answered before any rank runs (a
        persist of this attempt must not reach an actor still in the previous one)."""
        self._staged = staged or {}
        self._live_source = live_source
        """``choice``'s tier is "live": the actor (a recycled survivor among ``spares``) whose
        process holds the restore step; its rank sends it to the others."""
        """``{node_id: ObjectRef}`` of the copies of the restore step still running (the ranks of
        that node wait for it before restoring)."""
        self._spares = spares or {}
        """``{node_id: [warm spare actors]}`` to take ranks from before creating new ones."""
        self.reused = 0
        """Ranks of this group that are warm spares (no process started for them)."""
        self.recycled = 0
        """Of those, ranks of the failed previous group re-formed in process (set by the backend)."""
        self.phases: dict[str, float] = {}
        """Seconds of each start phase: ``spawn`` (actors created / spares taken, endpoints
        answered) and ``rendezvous`` (``torch.distributed`` initialised on every rank)."""
        self.workers: list = []
        self._endpoints: list[dict] = []
        self._here: dict[int, int] = {}
        """rank -> pid of the ranks whose process the driver can see in ``/proc`` (same namespace)."""
        self._there: dict[int, int] = {}
        """rank -> pid of the other ranks whose node actor can see their process (same namespace)."""
        self._recycling: dict | None = None   # rank -> ref of its recycle() answer (begin_recycle)
        self._refs: dict[int, ray.ObjectRef] = {}
        self._results: dict[int, dict] = {}
        self._errors: list[RankError] = []
        self._read_later: list = []   # run() outcomes handed to _read_in_background
        self._hung: dict[int, str] = {}   # rank -> why it was stopped as hung
        self._watch_stop = threading.Event()
        self._watch: threading.Thread | None = None
        self.live_held: list[tuple] = []
        """After :meth:`recycle`: ``(node_id, actor, step)`` of each survivor that kept the live
        state of ``step`` in process (:meth:`RankWorker.recycle`)."""

    # ---- start --------------------------------------------------------------------------------
    def start(self) -> float:
        """Create the actors, rendezvous, launch ``run``; returns the seconds it took."""
        t0 = time.perf_counter()
        w = self.config.workers_per_node
        infos = []
        for i, node in enumerate(self.nodes):
            spares = self._spares.get(node.node_id, [])
            for j in range(w):
                info = RankInfo(rank=i * w + j, world_size=self.world_size, local_rank=j, local_world_size=w,
                                node_rank=i, num_nodes=len(self.nodes), attempt=self.attempt)
                if spares:
                    self.workers.append(spares.pop(0))
                    infos.append(info)   # a spare learns its role with endpoint()
                    self.reused += 1
                    continue
                self.workers.append(new_rank_actor(self.config, node.node_id, info))
                infos.append(None)
        timeout = self.config.rendezvous_timeout_s
        self._endpoints = ray.get([wk.endpoint.remote(info) for wk, info in zip(self.workers, infos)],
                                  timeout=timeout)
        here = own_namespace()
        self._here = {r: e["pid"] for r, e in enumerate(self._endpoints) if here is not None and e.get("ns") == here}
        self._there = {r: e["pid"] for r, e in enumerate(self._endpoints) if r not in self._here and e.get("ns")
                       and e.get("ns") == self._tiers[r // w].get("ns")}
        t1 = time.perf_counter()
        host, port = self._endpoints[0]["ip"], self._endpoints[0]["port"]
        ray.get([wk.join.remote(host, port) for wk in self.workers], timeout=timeout)
        self.phases = {"spawn": t1 - t0, "rendezvous": time.perf_counter() - t1}
        fn_ref = self._train_fn if isinstance(self._train_fn, ray.ObjectRef) else ray.put(self._train_fn)
        if self._begun:
            ray.get(self._begun, timeout=timeout)
        src = None
        if self._live_source is not None:
            src = next((r for r, wk in enumerate(self.workers) if wk is self._live_source), None)
            if src is None:
                raise RuntimeError(f"the survivor holding step {self._choice.step} in process is not one of the "
                                   f"group's ranks")
        for rank, wk in enumerate(self.workers):
            node_rank = rank // w
            staged = self._staged.get(self.nodes[node_rank].node_id)
            self._refs[rank] = wk.run.remote(
                fn_ref, tiers=self._tiers[node_rank], node_actor=self._node_actors[node_rank],
                policy=self._policy, keep=self.config.keep, restore_step=self._choice.step,
                restore_tier=self._choice.sources.get(self.nodes[node_rank].node_id, ("none", None))[0],
                staged=None if staged is None else [staged], live_source=src)
        if (self._here or self._there) and self.world_size > 1:
            self._watch = threading.Thread(target=self._watch_exits, name="cfdist-exit-watch", daemon=True)
            self._watch.start()
        return time.perf_counter() - t0

    def _watch_exits(self) -> None:
        """Driver thread, while the group trains: watch the ranks' processes for one that exits
        (crashed, killed, its node preempted), and at the first break every other rank's process
        group (:meth:`RankWorker.break_group`): their collectives fail at once instead of
        blocking until the dying process's sockets close (its memory is freed first: tens of
        milliseconds). The ranks the driver sees (:attr:`_here`) it looks for in ``/proc`` every
        :data:`_WATCH_EVERY_S`; for the others it asks their node actor where that sees them
        (:attr:`_there`; :meth:`NodeCheckpointer.await_exit`, looking as often, answering at
        the first exit or after :data:`_WATCH_LEASE_S`, then asked again; an actor that cannot
        answer leaves its ranks to the usual detection). The failure then takes its usual path:
        the survivors' ``run`` raise, :meth:`poll` sees them, :meth:`_settle` records the exited
        rank. Once per group; stopped by :meth:`shutdown` (before the driver kills ranks on
        purpose)."""
        w = self.config.workers_per_node
        there: dict[int, dict[int, int]] = {}   # node rank -> {pid: rank}
        for r, pid in self._there.items():
            there.setdefault(r // w, {})[pid] = r
        asks: dict = {}   # ref of a node actor's await_exit -> its node rank
        dead: list[int] = []
        try:
            while not dead:
                if not there and not self._here:   # nobody left to watch: the usual detection decides
                    return
                for nr in there.keys() - set(asks.values()):
                    asks[self._node_actors[nr].await_exit.remote(sorted(there[nr]), _WATCH_LEASE_S,
                                                                 _WATCH_EVERY_S)] = nr
                ready = ray.wait(list(asks), num_returns=1, timeout=_WATCH_EVERY_S)[0] if asks else []
                if self._watch_stop.wait(0 if asks else _WATCH_EVERY_S):
                    return
                gone = exited(self._here.values(), exiting=True) if self._here else set()
                dead = [r for r, p in self._here.items() if p in gone]
                for ref in ready:
                    nr = asks.pop(ref)
                    try:
                        dead += [there[nr][p] for p in ray.get(ref) if p in there[nr]]
                    except ray.exceptions.RayError as e:   # gone with its node: Ray's report decides
                        log.debug("node %d's actor cannot watch its ranks: %s", nr, e)
                        there.pop(nr)
        except Exception as e:  # noqa: BLE001 - an optimisation: the usual detection stands
            log.warning("the exit watch of attempt %d stopped: %s", self.attempt, e)
            return
        finally:
            if asks:   # answered within a lease: read then, or Ray prints them unread
                _read_in_background(list(asks))
        dead = sorted(dead)
        gone = {p for r, p in {**self._here, **self._there}.items() if r in dead}
        log.info("attempt %d: rank(s) %s exiting (pid %s): breaking the other ranks' process group",
                 self.attempt, dead, sorted(gone))
        refs = []
        for r, wk in enumerate(self.workers):
            if r in dead or self._watch_stop.is_set():
                continue
            try:
                refs.append(wk.break_group.remote(self.attempt))
            except Exception as e:  # noqa: BLE001 - that rank fails when the sockets close instead
                log.info("could not ask rank %d to break its group: %s", r, e)
        if refs:
            _read_in_background(refs)

    # ---- while running ------------------------------------------------------------------------
    def poll(self, timeout_s: float) -> GroupStatus:
        """Wait up to ``timeout_s`` for ranks to finish or fail; drain rank 0's records."""
        pending = [r for r in self._refs if r not in self._results and not any(e.rank == r for e in self._errors)]
        refs = [self._refs[r] for r in pending]
        if refs:
            # the first outcome ends the wait (a failure is seen at once, not at the poll's end)
            ready, rest = ray.wait(refs, num_returns=1, timeout=timeout_s)
            if ready and rest:
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                ready = ready + more
            self._collect(ready)
            if self._errors:
                left = [self._refs[r] for r in pending if r not in self._results
                        and not any(e.rank == r for e in self._errors)]
                if left:
                    self._settle(left)
                self._wait_live_saves(pending)
        records = self._drain(0)
        return GroupStatus(finished=len(self._results) == len(self.workers), errors=list(self._errors),
                           results=dict(self._results), records=records)

    def _settle(self, left: list) -> None:
        """After a first error: wait up to ``_SETTLE_S`` for the other ranks' outcomes (a
        survivor's collective error follows its peer's death within milliseconds), but not for
        ranks of a node whose raylet is gone: Ray reports them dead only once its health checks
        fail, seconds later. Their nodes are probed at once and then at :data:`_PROBE_EVERY_S`
        while some ranks have not answered. Nor for Ray's report of a rank whose process exited:
        the driver looks in ``/proc`` every :data:`_EXIT_EVERY_S` for the ranks that share its
        process namespace (:attr:`_here`), and asks the node actor of the others
        (:meth:`NodeCheckpointer.await_exit`: it answers when one exits) where it shares theirs
        (:attr:`_there`); :meth:`_record_exit`."""
        deadline = time.monotonic() + _SETTLE_S
        by_ref = {ref: r for r, ref in self._refs.items()}
        probes = iter(_PROBE_EVERY_S)
        gap = next(probes)
        probe_at = time.monotonic() + gap if self._unreachable is not None else float("inf")
        asks: dict = {}          # ref of a node actor's await_exit -> its node rank
        mute: set[int] = set()   # node ranks whose actor cannot be asked (gone)
        try:
            while left:
                left = self._exited(left, by_ref)
                if not left:
                    break
                self._ask_exits(left, by_ref, asks, mute, deadline)
                look_at = time.monotonic() + _EXIT_EVERY_S if any(by_ref[ref] in self._here for ref in left) \
                    else float("inf")
                now = time.monotonic()
                if now >= probe_at:
                    try:
                        gone = self._unreachable({self._node_of(by_ref[ref]) for ref in left})
                    except Exception as e:  # noqa: BLE001 - an optimisation: fall back on waiting
                        log.info("could not probe the nodes' raylets (%s); waiting for the ranks instead", e)
                        gone, probe_at = set(), float("inf")
                    else:
                        gap = next(probes, gap)
                        probe_at = time.monotonic() + gap
                    self._gone |= gone
                    left = [ref for ref in left if self._node_of(by_ref[ref]) not in gone]
                    if not left:
                        break
                now = time.monotonic()
                if now >= deadline:
                    break
                # the first outcome or answer ends the wait (the loop picks up any others at once)
                ready, _ = ray.wait(left + list(asks), num_returns=1,
                                    timeout=max(0.0, min(deadline, probe_at, look_at) - now))
                self._collect([x for x in ready if x in by_ref])
                left = [ref for ref in left if ref not in ready]
                for ref in [x for x in ready if x in asks]:
                    # one question per node: it answers at the first exit there or at the deadline
                    mute.add(asks.pop(ref))
                    try:
                        gone = set(ray.get(ref))
                    except ray.exceptions.RayError as e:   # its actor went with its node: Ray's report decides
                        log.debug("a node actor could not say which ranks exited: %s", e)
                        continue
                    left = self._drop_exited(left, by_ref, self._there, gone)
        finally:
            if asks:   # questions still open: read their answers later, or Ray prints them unread
                _read_in_background(list(asks))

    def _ask_exits(self, left: list, by_ref: dict, asks: dict, mute: set, deadline: float) -> None:
        """Ask the node actor of each node that has ranks in ``left`` the driver cannot see
        itself (:attr:`_there`), and no question pending, to answer when one of them exits."""
        asked = set(asks.values())
        todo: dict[int, list[int]] = {}
        for ref in left:
            r = by_ref[ref]
            node_rank = r // self.config.workers_per_node
            if r in self._there and node_rank not in asked and node_rank not in mute \
                    and self.nodes[node_rank].node_id not in self._gone:
                todo.setdefault(node_rank, []).append(self._there[r])
        for node_rank, pids in todo.items():
            try:
                ref = self._node_actors[node_rank].await_exit.remote(pids, max(0.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - an optimisation: Ray's report of the ranks decides
                log.debug("could not ask node %d's actor about its ranks' processes: %s", node_rank, e)
                mute.add(node_rank)
                continue
            asks[ref] = node_rank

    def _exited(self, left: list, by_ref: dict) -> list:
        """Of the ``run`` references ``left``, record the ranks whose process exited as the
        driver sees it in ``/proc`` (ranks in its process namespace: a rank's process killed or
        crashed on a node that lives); returns the rest."""
        mine = {self._here[by_ref[ref]] for ref in left if by_ref[ref] in self._here}
        return self._drop_exited(left, by_ref, self._here, exited(mine, exiting=True)) if mine else left

    def _drop_exited(self, left: list, by_ref: dict, pids: dict[int, int], gone: set[int]) -> list:
        """``left`` less the ranks whose process (``pids``: rank -> pid) is in ``gone``, each
        recorded as dead (:meth:`_record_exit`)."""
        rest = []
        for ref in left:
            r = by_ref[ref]
            if r in pids and pids[r] in gone:
                self._record_exit(r, pids[r])
            else:
                rest.append(ref)
        return rest

    def _record_exit(self, rank: int, pid: int) -> None:
        """Rank ``rank``'s process ``pid`` exited (seen in ``/proc``, by the driver or by its node
        actor): it failed as if Ray had reported its death, which comes later and is read in
        the background."""
        ref = self._refs[rank]
        self._errors.append(RankError(rank, self._node_of(rank), True, self._hung.get(rank) or
                                      f"rank {rank}'s process (pid {pid}) exited"))
        self._read_later.append(ref)
        _read_in_background([ref])

    def _wait_live_saves(self, pending: list[int]) -> None:
        """After a failure: the ranks still running are told (:meth:`RankWorker.peer_died`), and
        those writing their live state are waited for, up to ``live_timeout_s``: the restore
        decision must see the step they write. The others (hung, or on a lost node) are not."""
        if not self.config.live_recovery:
            return
        left = [r for r in pending if r not in self._results and not any(e.rank == r for e in self._errors)
                and self._node_of(r) not in self._gone]
        if not left:
            return
        asks = {r: self.workers[r].peer_died.remote(_PEER_DIED_S) for r in left}
        ready, unanswered = ray.wait(list(asks.values()), num_returns=len(asks), timeout=_PEER_DIED_S + _ASK_S)
        if unanswered:   # a rank that died: read its answer later, or Ray prints the error unread
            _read_in_background(unanswered)
        saving = []
        for r, ref in asks.items():
            try:
                if ref in ready and ray.get(ref):
                    saving.append(r)
            except ray.exceptions.RayError:
                pass   # gone: its outcome tells
        if saving:
            refs = [self._refs[r] for r in saving]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.live_timeout_s + _SETTLE_S)
            self._collect(ready)

    def _collect(self, ready) -> None:
        by_ref = {ref: r for r, ref in self._refs.items()}
        for ref in ready:
            rank = by_ref[ref]
            try:
                self._results[rank] = ray.get(ref)
            except ACTOR_GONE as e:
                # the process is gone (crashed, its node lost, killed by Ray's memory monitor, or
                # stopped as hung)
                self._errors.append(RankError(rank, self._node_of(rank), True, self._hung.get(rank) or _short(e)))
            except ray.exceptions.RayTaskError as e:
                self._errors.append(RankError(rank, self._node_of(rank), False, _short(e)))

    def _node_of(self, rank: int) -> str:
        return self.nodes[rank // self.config.workers_per_node].node_id

    def _drain(self, rank: int) -> list[dict]:
        if self._node_of(rank) in self._gone or any(e.rank == rank and e.actor_died for e in self._errors):
            return []   # its records went with its process or node; asking would wait for Ray to tell
        try:
            return ray.get(self.workers[rank].drain.remote(), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            return []

    def current_step(self) -> int | None:
        """Newest step any live rank finished (asks every rank not known to have failed or to be
        on a node found gone, 2 s at most: a rank of a lost node would not answer until Ray
        declares its node dead)."""
        failed = {e.rank for e in self._errors}
        refs = [wk.current_step.remote() for r, wk in enumerate(self.workers)
                if r not in failed and self._node_of(r) not in self._gone]
        if not refs:
            return None
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=2.0)
        steps = []
        for ref in ready:
            try:
                steps.append(ray.get(ref))
            except ray.exceptions.RayError:
                pass
        return max(steps) if steps else None

    def notify(self, preempted_nodes: list[int], *, save: bool = True) -> None:
        """Preemption notice: ranks of ``preempted_nodes`` see ``ctx.preempted``; with ``save``,
        every node's writer checkpoints at its next step (the survivors' copies cover the lost node)."""
        w = self.config.workers_per_node
        for rank, wk in enumerate(self.workers):
            hit = rank // w in preempted_nodes
            if hit or (save and rank % w == 0):
                wk.notify.remote(preempted=hit, save=save and rank % w == 0)

    def halt(self) -> None:
        """Every rank stops at its next iteration boundary (a notice named every node of the
        group): the node writers save that step from their live state, to disk (non-blocking;
        the ranks' ``run`` then fail with :class:`~cfdist.cluster.context.PreemptionHalt`)."""
        for wk in self.workers:
            wk.notify.remote(preempted=True, save=False, halt=True)

    def node_rank_of(self, node_id: str | None) -> int | None:
        for i, n in enumerate(self.nodes):
            if n.node_id == node_id:
                return i
        return None

    def pids(self) -> list[int]:
        return [e["pid"] for e in self._endpoints]

    def actor_of(self, rank: int):
        return self.workers[rank]

    def power_off(self, rank: int) -> None:
        """Kill the rank's process as a machine's power-off does (a simulated node's preemption):
        SIGKILL at once where the driver sees it (:attr:`_here`,
        :func:`cfdist.cluster.nodes.power_off`), and Ray's kill in any case (alone, it lands 8-50
        ms after it is asked for)."""
        power_off(self._here.get(rank), own_namespace())
        ray.kill(self.workers[rank], no_restart=True)

    def crash(self, rank: int, timeout_s: float = 10.0) -> None:
        """SIGKILL the rank's process (from inside it: works on any node); returns once the
        process is gone: as the driver sees it in ``/proc`` where it can (:attr:`_here`), else
        once Ray saw it die (or after ``timeout_s``)."""
        from cfdist.cluster.quiet import expect_death

        if rank < len(self._endpoints):
            expect_death(self._endpoints[rank]["pid"])
        ref = self.workers[rank].crash.remote()
        pid = self._here.get(rank)
        if pid is None:
            ready, _ = ray.wait([ref], timeout=timeout_s)
        else:
            deadline = time.monotonic() + timeout_s
            ready = []
            while not ready and not exited([pid], exiting=True) and time.monotonic() < deadline:
                ready, _ = ray.wait([ref], timeout=_EXIT_EVERY_S)
        if ready:
            try:
                ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, TimeoutError):
                pass   # RayActorError: it died, as asked
        else:
            _read_in_background([ref])   # Ray's report of the death comes later

    def stop_hung(self, quiet_s: float) -> tuple[list[int], bool]:
        """The group completed no step for ``quiet_s``: ask every running rank where it is; the
        ranks that do not answer within :data:`_HUNG_ASK_S` are frozen and are killed (their
        peers' collectives then fail, and the survivors write their live state, as after a
        crash). When every rank answers and one is at the run's end (its final checkpoint: no
        steps come), nothing is done. Otherwise nothing tells the hung one apart: all are
        killed. Returns ``(killed ranks, whether they were frozen)``; the next polls report them."""
        from cfdist.cluster.quiet import expect_death

        running = [r for r in range(len(self.workers)) if r not in self._results
                   and not any(e.rank == r for e in self._errors)]
        asks = {r: self.workers[r].finishing.remote() for r in running}
        ready, unanswered = ray.wait(list(asks.values()), num_returns=len(asks), timeout=_HUNG_ASK_S)
        if unanswered:
            _read_in_background(unanswered)
        frozen = [r for r, ref in asks.items() if ref not in ready]
        if not frozen and any(_answer(asks[r]) for r in running):
            return [], False   # the run's end (a long final checkpoint): no steps, and no hang
        targets = frozen or running
        why = (f"did not answer within {_HUNG_ASK_S:g} s" if frozen else "the whole group made no progress")
        for r in targets:
            self._hung[r] = f"hung: no step completed for {quiet_s:.1f} s and it {why}; its process was killed"
            log.warning("rank %d is hung (no step for %.1f s; %s): killing its process", r, quiet_s, why)
        pids = {r: self._endpoints[r]["pid"] for r in targets if r < len(self._endpoints)}
        expect_death(*pids.values())
        w = self.config.workers_per_node
        kills = [self._node_actors[r // w].kill_workers.remote([pid]) for r, pid in pids.items()
                 if r // w < len(self._node_actors)]
        try:   # by the node's actor: a frozen process never answers Ray's request to exit
            ray.get(kills, timeout=10)
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.warning("killing the hung ranks through their nodes' actors failed (%s); asking Ray", _short(e))
        for r in targets:
            try:
                ray.kill(self.workers[r], no_restart=True)
            except Exception:  # noqa: BLE001 - already dead: its outcome tells
                pass
        return targets, bool(frozen)

    def save_kept(self, deadline: float) -> list[dict]:
        """After a failure, while a notice that names every node is pending (before
        :meth:`recycle`): the survivors that kept their live state in process write it to their
        node's durable tier (:meth:`RankWorker.save_kept`; one writer per node, so one commit of
        the step per node), all at once; waits until ``deadline`` (wall time) plus a moment.
        Returns one ``{"rank", "node_id", "step", "written", "why"}`` per survivor that kept a
        step, ``"error"`` instead of ``"written"`` for one whose write failed or did not end in time."""
        died = {e.rank for e in self._errors if e.actor_died}
        raised = [r for r in range(len(self.workers)) if r not in died and self._node_of(r) not in self._gone
                  and any(e.rank == r for e in self._errors)]
        timeout = max(0.0, deadline - time.time()) + 2.0
        refs = {r: self.workers[r].save_kept.remote(timeout) for r in raised}
        ready, late = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout + _ASK_S) if refs \
            else ([], [])
        if late:
            _read_in_background(late)
        out = []
        for r, ref in refs.items():
            row = {"rank": r, "node_id": self._node_of(r)}
            if ref not in ready:
                out.append(dict(row, step=None, error=f"no answer within {timeout + _ASK_S:.1f} s"))
                continue
            try:
                got = ray.get(ref)
            except ray.exceptions.RayError as e:
                out.append(dict(row, step=None, error=_short(e)))
                continue
            if got is not None:
                out.append(dict(row, **got))
        return out

    def begin_recycle(self) -> None:
        """Send :meth:`recycle`'s questions now (the ranks whose ``run`` raised drop the attempt
        while the driver classifies the failure); :meth:`recycle` reads the answers. Not while
        a survivor still has to write what it kept (a notice that names every node:
        :meth:`save_kept` needs the attempt)."""
        if self._recycling is None:
            self._recycling = self._ask_recycle()

    def _ask_recycle(self) -> dict:
        died = {e.rank for e in self._errors if e.actor_died}
        raised = [r for r in range(len(self.workers)) if r not in died and any(e.rank == r for e in self._errors)]
        return {r: self.workers[r].recycle.remote() for r in raised}

    def recycle(self, timeout_s: float = 2.0) -> dict[str, list[tuple]]:
        """After a failure: the ranks whose ``run`` raised (their process lives, a peer died)
        drop the attempt in process (:meth:`RankWorker.recycle`); returns ``{node_id: [(actor,
        ref of its answer)]}`` of those that did within ``timeout_s``, and kills every other
        rank. The returned actors are warm spares of the next attempt (no process start, torch
        loaded); :attr:`live_held` says which of them kept their live state, of which step."""
        refs = self._recycling if self._recycling is not None else self._ask_recycle()
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        kept: dict[str, list[tuple]] = {}
        for r, ref in refs.items():
            if ref not in ready:
                continue
            try:
                got = ray.get(ref)
            except ray.exceptions.RayError as e:
                log.info("rank %d cannot be reused (%s); its process is killed", r, _short(e))
                continue
            kept.setdefault(self._node_of(r), []).append((self.workers[r], ref))
            if got.get("live_step"):
                self.live_held.append((self._node_of(r), self.workers[r], got["live_step"]))
        self.shutdown(keep={id(a) for pool in kept.values() for a, _ in pool})
        return kept

    def shutdown(self, keep=frozenset()) -> None:
        """Kill every rank's process (no restart) but those whose actor's ``id()`` is in
        ``keep`` (recycled as spares). Safe to call twice."""
        from cfdist.cluster.quiet import expect_death

        self._watch_stop.set()   # the kills below are no failure to break the survivors for
        unread = [ref for r, ref in self._refs.items() if r not in self._results
                  and not any(e.rank == r for e in self._errors) and ref not in self._read_later]
        if unread:
            self._read_later.extend(unread)
            _read_in_background(unread)
        expect_death(*[p for wk, p in zip(self.workers, self.pids()) if id(wk) not in keep])
        for wk in self.workers:
            if id(wk) in keep:
                continue
            try:
                ray.kill(wk, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass


def new_rank_actor(config: FitConfig, node_id: str, info: RankInfo | None, *, prepared: dict | None = None):
    """A rank's actor pinned to ``node_id``; ``info=None``: a warm spare (no CPUs reserved, no
    GPU: it holds nothing while it waits for a role). ``prepared``: what the node's checkpoint
    actor reported (its ``ready()``): the spare starts at the lowest priority and returns to the
    workers' (``prepared["nice"]``) when it takes a role (:mod:`cfdist.cluster.niceness`)."""
    spare = info is None
    nice = prepared.get("nice") if spare and prepared else None
    return _RemoteWorker.options(
        num_cpus=0 if spare else config.cpus_per_worker,
        num_gpus=1 if config.use_gpu and not spare else 0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        max_concurrency=4, max_restarts=0, name=None,
        **(niceness.prepared_options(prepared) if nice is not None else {}),
    ).remote(info, use_gpu=config.use_gpu, timeout_s=config.rendezvous_timeout_s, cpus=config.cpus_per_worker,
             sigterm_grace_s=config.sigterm_grace_s, log_dir=config.log_dir,
             live_timeout_s=config.live_timeout_s if config.live_recovery else None,
             keep_live=keep_live(config), role_nice=nice)


def keep_live(config: FitConfig) -> bool:
    """Whether a survivor of a failed group keeps its live state in process for the next one
    (live recovery on, and the driver recycles survivors into the next group: warm spares on
    CPU); otherwise it writes it to its node's memory tier."""
    return config.live_recovery and config.warm_spares and not config.use_gpu


def _answer(ref) -> bool:
    try:
        return bool(ray.get(ref, timeout=1.0))
    except (ray.exceptions.RayError, TimeoutError):
        return False


def _read_in_background(refs: list, timeout_s: float = 60.0) -> None:
    """Fetch, on a daemon thread, the outcomes of ``run`` calls of a group that is being shut
    down that nobody read: Ray prints an error nobody fetched ("Unhandled error ...", with the
    rank's whole traceback) on the driver's console when its reference is dropped. The failure
    was recorded from the first error already; the details are in the rank's log file."""
    def read() -> None:
        try:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            for ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except (ray.exceptions.RayError, TimeoutError):
                    pass   # the expected outcome of a failed group: read so Ray does not print it
        except Exception as e:  # noqa: BLE001 - Ray shut down meanwhile: nothing left to print
            log.debug("outcomes of a stopped group left unread: %s", e)

    threading.Thread(target=read, name="cfdist-read-outcomes", daemon=True).start()


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    tail = [ln for ln in text if ln.strip()][-3:]
    return f"{type(e).__name__}: " + " | ".join(tail)
