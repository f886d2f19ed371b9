"""The driver's controller: an explicit state machine with a ``step()`` tests can drive.

Each :meth:`Controller.step` handles the current state once and returns the next one:

* ``RecoveringState``: pick the group size (:class:`ScalingPolicy`), wait for nodes if too few,
  ask the node actors and shared storage what they hold, choose the newest step every node can
  obtain (:func:`choose_restore`), stage it (peer copy / shared download), start the group.
* ``RunningState``: poll the group; turn rank 0's records and the actors' commits into events;
  on errors classify the failure and ask the :class:`FailurePolicy`; on success finish; when
  running smaller than wanted and capacity returned, restart larger at the next commit.

Every decision is written to the event log with its inputs (``{"event": "decision", ...}``).
The controller never touches tensors or files: the backend moves handles and bytes.
Call from the driver, one thread.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from cfdist.cluster.config import FitConfig
from cfdist.cluster.decisions import Failure, FailurePolicy, ScalingPolicy, choose_restore
from cfdist.cluster.events import EventLog
from cfdist.cluster.result import FitError, FitResult, failure_stats
from cfdist.cluster.states import (
    ClusterBackend, ControllerState, FailedState, FinishedState, GroupStatus, RecoveringState, RunningState,
)

log = logging.getLogger("cfdist.controller")

NOTICE_GRACE_S = 30.0
"""After a pool notice's deadline, how long recovery waits for a cloud to take the noticed nodes."""


_COLD_SPARES_S = 5.0
"""A run from scratch whose first commit has not come this long after its first step past the
policy's profile warms its spares anyway (see ``Controller._refill_spares``)."""


class Controller:
    """Drives one ``fit`` run. ``run()`` loops ``step()`` until FINISHED or FAILED."""

    def __init__(self, config: FitConfig, backend: ClusterBackend, events: EventLog, *,
                 injector=None, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep):
        self.config = config
        self.backend = backend
        self.events = events
        self.injector = injector
        self.clock = clock
        self.sleep = sleep
        self.failure_policy = FailurePolicy(max_failures=config.max_failures)
        self.scaling = ScalingPolicy(num_nodes=config.num_nodes, min_nodes=config.min_nodes)
        self.state: ControllerState = RecoveringState()
        self.attempt = -1
        self.num_failures = 0                      # failures tolerated so far
        self.step_now = 0            # rank 0's newest finished step
        self.executed = 0            # steps executed by finished attempts
        self._attempt_base = 0       # step the current attempt started from
        self._recovery: dict | None = None
        self._resuming: tuple[float, float] | None = None   # (failed at, restored at) until the first step
        self._dead_pids: list[int] = []
        self._committed: set[tuple[int, str]] = set()
        self._grow_to: int | None = None
        self._grow_step = 0
        self._last_capacity_check = 0.0
        self._last_nodes: list[str] = []
        self._world_sizes: list[int] = []
        self._stall_s = 0.0
        self._attempt_stall = 0.0
        self._running_s = 0.0
        self._refilled = True        # warm spares replaced since the attempt started
        self._past_profile_at: float | None = None   # a fresh run's first step past its profile
        self._running_since: float | None = None
        self._final_url: str | None = None
        self._progress_at: float | None = None   # when the attempt last completed a step (None: none yet)
        self._hang: dict | None = None           # the ranks stopped as hung, until the failure they cause
        self._noticed: dict[str, float] = {}     # node id -> the kill a preemption notice announced
        self._pool: dict | None = None           # a notice named every node of the group (see on_notice)
        self._t0 = clock()

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> ControllerState:
        """Handle the current state once; returns (and keeps) the next state."""
        if self.injector is not None and not self.state.terminal:
            self.injector.tick(self)
        if isinstance(self.state, RecoveringState):
            nxt = self._recover(self.state)
        elif isinstance(self.state, RunningState):
            nxt = self._run(self.state)
        else:
            return self.state
        if type(nxt) is not type(self.state):
            log.info("controller: %s -> %s", self.state.name, nxt.name)
        self.state = nxt
        return nxt

    def run(self) -> FitResult:
        """Step until a terminal state; return the result or raise :class:`FitError`."""
        self.events.emit("start", world_size=self.config.world_size, nodes=self.config.num_nodes,
                         run=self.config.run_name, logs=self.config.log_dir)
        while not self.state.terminal:
            self.step()
        if isinstance(self.state, FailedState):
            self.events.emit("end", step=self.step_now, error=str(self.state.error))
            raise self.state.error
        return self.result()

    def decide(self, what: str, reason: str, **inputs) -> None:
        """Log a decision with its inputs (event log + logger)."""
        self.events.emit("decision", what=what, reason=reason, **inputs)
        log.info("decision %s: %s", what, reason)

    # ---- RECOVERING ---------------------------------------------------------------------------
    def _recover(self, st: RecoveringState) -> ControllerState:
        """Choose the nodes and the checkpoint, stage it, start the group (or wait / give up)."""
        if self._pool is not None and not self._pool_gone(st):
            return st
        nodes = self.backend.usable_nodes()
        joining = getattr(self.injector, "joining", 0)
        if joining and len(nodes) < self.config.num_nodes:
            # the failure injector is bringing nodes back (seconds): wait for them, as the same
            # injection did when it blocked, rather than shrink the group and grow it again
            return self._wait_for_nodes(st, f"{joining} node(s) joining; {len(nodes)} usable < "
                                            f"num_nodes={self.config.num_nodes}", len(nodes))
        size = self.scaling.size_for(len(nodes))
        if size.num_nodes is None:
            return self._wait_for_nodes(st, size.reason, len(nodes))
        if st.since is not None:
            self.events.emit("nodes_ready", nodes=len(nodes))
        chosen = self._pick_nodes(nodes, size.num_nodes)
        self.decide("group_size", size.reason, nodes=[n.name for n in chosen])
        try:
            holdings = self.backend.holdings(newest=self.step_now if self._recovery is not None else None)
        except Exception as e:  # noqa: BLE001 - a node's holdings unknown (its actor is starting):
            # choosing without them could restart from scratch over its newer checkpoints
            return self._try_again(st, "holdings_failed", "asking the nodes what they hold", "asking again",
                                   f"learn which checkpoints {[n.name for n in chosen]} hold", e)
        choice = choose_restore(holdings, [n.node_id for n in chosen], peer_copy=self.config.peer_copy)
        self.decide("restore", choice.reason, step=choice.step, tier=choice.tier,
                    sources={n.name: choice.sources.get(n.node_id) for n in chosen})
        t_stage = self.clock()
        try:
            self.backend.stage(choice, chosen)
        except Exception as e:  # noqa: BLE001 - e.g. a chosen node is gone: choose again
            return self._try_again(st, "stage_failed", f"staging step {choice.step}",
                                   "choosing nodes and checkpoint again",
                                   f"stage step {choice.step} on {[n.name for n in chosen]}", e)
        return self._start(chosen, choice, stage_s=self.clock() - t_stage)

    def _try_again(self, st: RecoveringState, what: str, doing: str, then: str, goal: str,
                   e: Exception) -> ControllerState:
        """A recovery step failed: log it and recover again, or give up after 3 retries."""
        st.stage_failures += 1
        self.decide(what, f"{doing} failed ({type(e).__name__}: {e}); {then}", tries=st.stage_failures)
        if st.stage_failures > 3:
            return FailedState(FitError(f"could not {goal} after {st.stage_failures} tries: {e}"))
        return st

    def _wait_for_nodes(self, st: RecoveringState, reason: str, usable: int) -> ControllerState:
        now = self.clock()
        if st.since is None:
            self.decide("wait_for_nodes", reason, usable=usable)
            st.since = now
        if now - st.since > self.config.wait_for_nodes_s:
            return FailedState(FitError(
                f"only {usable} usable node(s) for {now - st.since:.0f}s, need min_nodes="
                f"{self.config.min_nodes} (each with {self.config.workers_per_node} rank(s)); add "
                f"nodes, lower min_nodes, or raise wait_for_nodes_s={self.config.wait_for_nodes_s}"))
        self.sleep(self.config.poll_s)
        return st

    def _start(self, chosen, choice, *, stage_s: float) -> ControllerState:
        """Start the next attempt's group on ``chosen``, restoring ``choice``."""
        self.attempt += 1
        try:
            group = self.backend.start_group(chosen, choice, self.attempt, self._dead_pids)
        except Exception as e:  # noqa: BLE001 - a group that cannot start is a failure like any other
            log.warning("attempt %d: starting the group failed", self.attempt, exc_info=e)
            cause = e.__cause__ or e.__context__   # e.g. SystemError "... returned a result with an exception set"
            why = f"{type(e).__name__}: {e}" + (f" (from {type(cause).__name__}: {cause})" if cause is not None else "")
            failure = Failure(kind="error", step=self.step_now, message=f"starting the group failed: {why}",
                              failed_at=self.clock(), detected_at=self.clock())
            return self._tolerate(failure, None)
        now = self.clock()
        self._dead_pids = []
        self._last_nodes = [n.node_id for n in chosen]
        self._world_sizes.append(group.world_size)
        phases = {f"{k}_s": round(v, 6) for k, v in (getattr(group, "phases", None) or {}).items()}
        self.events.emit("restarted", world_size=group.world_size, nodes=len(chosen), attempt=self.attempt,
                         reused=getattr(group, "reused", 0), recycled=getattr(group, "recycled", 0), **phases)
        self._attempt_base = choice.step or 0
        self._committed = {k for k in self._committed if k[0] <= self._attempt_base}
        self.step_now = self._attempt_base
        self._attempt_stall = 0.0
        self._running_since = now
        self._refilled = False
        self._past_profile_at = None
        self._progress_at, self._hang = None, None
        if self._recovery is not None:
            self._recovery.update(restarted_at=now, stage_s=stage_s, tier=choice.tier, world_size=group.world_size)
        elif choice.step is not None:   # a resumed run: log how its restore went
            self._recovery = {"resume": True, "tier": choice.tier, "restarted_at": now,
                              "detected_at": now, "failed_at": now}
        return RunningState(group)

    def _pick_nodes(self, nodes, n):
        """Nodes of the previous group first (their memory tiers are warm), in their order; then
        those whose checkpoint actor is up before those where it is still starting."""
        prev = {nid: i for i, nid in enumerate(self._last_nodes)}
        return sorted(nodes, key=lambda x: (prev.get(x.node_id, len(prev)), x.starting))[:n]

    # ---- RUNNING ------------------------------------------------------------------------------
    def _run(self, st: RunningState) -> ControllerState:
        wait = self.config.poll_s
        pool = self._pool
        if pool is not None and pool["halted_at"] is None:   # not past a pool notice's halt
            wait = min(wait, max(0.0, pool["halt_at"] - self.clock()))
        elif pool is not None and not pool.get("accounted"):   # halted: account for it by the kill
            wait = min(wait, max(0.0, pool["deadline"] - self.clock()))
        status = st.group.poll(wait)
        getattr(self.backend, "pump_preparations", lambda: None)()
        resize = self._absorb(st, status.records, self.backend.drain_commits())
        for n in getattr(self.backend, "drain_notices", list)():
            node = st.group.node_rank_of(n.get("node_id")) if hasattr(st.group, "node_rank_of") else None
            self.on_notice([] if node is None else [node], n["deadline"] - self.clock(), source=n.get("source"),
                           detail=n.get("detail", ""))
        if self._pool is not None and self._pool["halted_at"] is None and self.clock() >= self._pool["halt_at"]:
            self._halt(st)
        if status.errors:
            return self._on_failure(st, status)
        if (pool is not None and pool["halted_at"] is not None and not pool.get("accounted")
                and self.clock() >= pool["deadline"]):
            # the group halted but has not failed yet (a rank still saves, or its death is not
            # reported yet): what is durable now is what the kill leaves
            self._commit_noticed(st.group)
        if status.finished:
            return self._finish(st, status)
        if resize is not None:
            return resize
        self._check_hang(st)
        self._check_capacity(st)
        return st

    def _check_hang(self, st: RunningState) -> None:
        """No step completed for ``hang_timeout_s`` (once the attempt completed one): stop the
        hung ranks (:meth:`RayWorkerGroup.stop_hung`); the next polls see them fail."""
        h = self.config.hang_timeout_s
        stop = getattr(st.group, "stop_hung", None)
        if h is None or stop is None or self._progress_at is None or self._hang is not None:
            return
        quiet = self.clock() - self._progress_at
        if quiet < h:
            return
        ranks, frozen = stop(quiet)
        if not ranks:   # the ranks are at the run's end (a long final checkpoint): look again later
            self._progress_at = self.clock()
            return
        self._hang = {"since": self._progress_at, "ranks": ranks, "frozen": frozen, "quiet_s": quiet}
        why = (f"rank(s) {ranks} did not answer within 2 s: frozen, killed" if frozen else
               "every rank answered but none completed a step: the whole group is stopped")
        self.events.emit("hang", step=self.step_now, ranks=ranks, frozen=frozen, quiet_s=round(quiet, 3),
                         reason=f"no step completed for {quiet:.1f} s (hang_timeout_s={h}); {why}")

    def _absorb(self, st: RunningState, records: list[dict], commits: list[dict]) -> ControllerState | None:
        """Log rank 0's records and the actors' commits in time order; a planned resize
        (capacity returned) happens at the first commit after it was decided."""
        resize = None
        items = sorted([(r["t"], 0, r) for r in records] + [(c["t"], 1, c) for c in commits],
                       key=lambda x: (x[0], x[1]))
        for _, is_commit, r in items:
            if is_commit:
                if not r.get("live"):   # a survivor's live save comes with a failure: no spare starts then
                    self._refill_spares()
                resize = self._on_commit(st, r) or resize
                continue
            kind = r.get("type")
            fields = {k: v for k, v in r.items() if k not in ("type", "t", "rank")}
            if kind == "step":
                if self._attempt_base > 0 or self.attempt > 0:   # a restart: at its first step
                    self._refill_spares()
                elif not r.get("profiling"):   # a fresh run: see _refill_spares
                    if self._past_profile_at is None:
                        self._past_profile_at = self.clock()
                    elif self.clock() - self._past_profile_at >= _COLD_SPARES_S:
                        self._refill_spares()
                if self._recovery is not None and "restarted_at" in self._recovery:
                    # the loop never called ckpt.restore(): it resumed from its own state
                    self._on_restored({"step": self._attempt_base, "restore_s": None, "t": r["t"]})
                if self._resuming is not None:
                    failed_at, restored_at = self._resuming
                    self._resuming = None
                    self.events.emit("resumed", t=r["t"], step=r["step"],
                                     first_step_s=round(max(0.0, r["t"] - restored_at), 6),
                                     recovery_s=round(max(0.0, r["t"] - failed_at), 6))
                self.step_now = r["step"]
                self._progress_at = self.clock()
                self._attempt_stall = r.get("stall_s", self._attempt_stall)
                self.events.emit("step", t=r["t"], **fields)
            elif kind == "metrics":
                self.events.emit("metrics", t=r["t"], **fields)
            elif kind == "restored":
                self._on_restored(r)
            elif kind == "checkpoint_error":   # rank 0's persist failed; training went on
                self.events.emit("checkpoint_failed", t=r["t"], **fields)
        return resize

    def _refill_spares(self) -> None:
        """Replace the spare processes the attempt took, once it runs: after its first step
        (not while it restores), or, for a run starting from scratch, at its first commit, or
        ``_COLD_SPARES_S`` after its first step past the policy's profile (rank 0's step records
        say ``profiling`` until then) when no commit came by then. Not while ``Auto`` profiles
        its first steps (processes importing torch beside them made a checkpoint look several
        times dearer than it is), nor before the first commit when it comes soon (a job has
        nothing durable until then: warming at the first step delayed a shared upload past an
        early preemption), but not an epoch later either (``EveryEpoch``'s first commit came 250
        steps in, and a crash before it waited 1.3 s for a spare's imports)."""
        if not self._refilled:
            self._refilled = True
            getattr(self.backend, "refill_spares", lambda: None)()

    def _on_restored(self, r: dict) -> None:
        rec, self._recovery = self._recovery, None
        if rec is None:
            return
        t = r.get("t", self.clock())
        if rec.get("failure") is not None:
            self._resuming = (rec["failed_at"], t)
        detect_s = rec["detected_at"] - rec["failed_at"]
        restart_s = rec["restarted_at"] - rec["detected_at"]
        restore_s = max(0.0, t - rec["restarted_at"])
        tier = rec["tier"] if r.get("step") else "none"
        self.events.emit("restored", t=t, step=r["step"], tier=tier, detect_s=round(detect_s, 6),
                         restart_s=round(restart_s, 6), restore_s=round(restore_s, 6),
                         load_s=r.get("restore_s"), setup_s=r.get("setup_s"), stage_s=round(rec.get("stage_s", 0.0), 6),
                         **({"stage_wait_s": r["stage_wait_s"]} if r.get("stage_wait_s") is not None else {}))

    def _on_commit(self, st: RunningState, c: dict) -> ControllerState | None:
        if not self._log_commit(st, c):
            return None
        live = c.get("live")
        if self._grow_to is None or c["step"] < self._grow_step or live:
            return None
        self.events.emit("resize", step=c["step"], world_size=st.group.world_size,
                         nodes=len(st.group.nodes), to_nodes=self._grow_to)
        self._end_attempt(st)
        self._dead_pids = st.group.pids()
        st.group.shutdown()
        self._grow_to = None
        self._recovery = {"resume": True, "failed_at": self.clock(), "detected_at": self.clock()}
        return RecoveringState(resize=True)

    def _log_commit(self, st: RunningState, c: dict) -> bool:
        """The event log's ``checkpoint_committed`` record of an actor's commit; False when that
        step and tier were logged already."""
        key = (c["step"], c["tier"])
        if key in self._committed:
            return False   # every node commits the same step: log the first
        self._committed.add(key)
        node = st.group.node_rank_of(c.get("node_id")) if hasattr(st.group, "node_rank_of") else None
        who = {"writers": c["writers"], "writer_nodes": c.get("nodes")} if "writers" in c else {}   # shared tier
        live = {"live": True} if c.get("live") else {}
        at = {"committed_at": round(c["committed_at"], 6)} if c.get("committed_at") else {}   # its atomic rename
        self.events.emit("checkpoint_committed", t=c["t"], step=c["step"], tier=c["tier"], node=node,
                         bytes=c.get("bytes"), persist_s=c.get("persist_s"), **who, **live, **at)
        return True

    # ---- preemption notices ---------------------------------------------------------------------
    def on_notice(self, nodes: list[int], window_s: float, *, source: str | None, **detail) -> bool:
        """Preemption notices for node slots ``nodes`` of the running group: the cloud takes them
        ``window_s`` from now. Called on the controller's thread, for the node actors' cloud
        notices and by the failure injector (``source="injected"``); returns whether they
        complete a *pool notice*.

        Their ranks see ``ctx.preempted``. When the nodes noticed so far are every node of the
        group (a whole spot pool reclaimed), no replica will survive the kill: the group trains
        on until :func:`~cfdist.cluster.decisions.pool_halt` says, then halts (every rank stops
        at its next iteration boundary, the node writers save that step from their live state,
        to disk), and the failure that follows makes the newest step durable on every node
        before the first kill (``notice_commit`` in the event log) and waits for the kill before
        recovering. Otherwise (some node survives, or live recovery is off) every node's
        writer checkpoints at a step the ranks agree on, when that can commit before the kill
        (:func:`~cfdist.cluster.injector.emergency_checkpoint_fits`)."""
        from cfdist.chaos.metrics import commit_latencies, estimate_iter_s
        from cfdist.cluster.decisions import pool_halt
        from cfdist.cluster.injector import emergency_checkpoint_fits

        st, now = self.state, self.clock()
        group = st.group if isinstance(st, RunningState) else None
        ids = [group.nodes[n].node_id for n in nodes if group is not None and n < len(group.nodes)]
        for nid in ids:
            self._noticed[nid] = now + window_s
        records = list(self.events.records)
        pool = (group is not None and bool(ids) and self.config.live_recovery
                and all(self._noticed.get(n.node_id, 0.0) > now for n in group.nodes))
        if pool and self._pool is None:
            durable = commit_latencies(records, tiers=("local", "shared")) or commit_latencies(records)
            try:
                step_s = estimate_iter_s(records[-200:])
            except ValueError:
                step_s = None
            deadline = min(self._noticed[n.node_id] for n in group.nodes)   # the first node taken
            plan = pool_halt(deadline - now, durable, step_s, slack_s=self.config.poll_s)
            self._pool = {"deadline": deadline, "halt_at": now + plan.halt_in_s, "halted_at": None,
                          "nodes": list(group.nodes), "cloud": source != "injected", "noticed_at": now}
            save, reason = False, plan.reason
            self.decide("pool_notice", f"the preemption notices name every node of the group: {plan.reason}",
                        step=self.step_now, window_s=round(deadline - now, 3), halt_in_s=round(plan.halt_in_s, 3))
        elif pool:   # a late duplicate of a pool notice already in hand
            save, reason = False, "part of the pool notice already in hand"
        else:
            save, reason = emergency_checkpoint_fits(window_s, commit_latencies(records))
        for n in nodes or [None]:
            self.events.emit("notice", node=n, source=source, window_s=round(window_s, 3), save=save,
                             reason=reason, pool=pool, **detail)
        if group is not None and nodes:
            group.notify(list(nodes), save=save)
            if self._pool is not None and self._pool["halted_at"] is None and now >= self._pool["halt_at"]:
                self._halt(st)
        return pool

    def _halt(self, st: RunningState) -> None:
        """The pool notice's halt: every rank stops at its next iteration boundary (the ranks
        then fail with ``PreemptionHalt``, and ``_on_failure`` makes the newest step durable)."""
        self._pool["halted_at"] = self.clock()
        self.events.emit("halt", step=self.step_now, deadline_in_s=round(self._pool["deadline"] - self.clock(), 3),
                         reason="every node of the group will be taken: saving the last completed step")
        st.group.halt()

    def _group_step(self, group) -> int:
        """The newest step a rank of ``group`` completed (the ranks' own count: ``step_now``
        comes from rank 0's records, up to a poll behind)."""
        try:
            return max(self.step_now, group.current_step() or 0)
        except Exception:  # noqa: BLE001 - survivors may be going down too
            return self.step_now

    def _commit_noticed(self, group, last_step: int | None = None) -> None:
        """After the group of a pool notice stopped (halted, or failed meanwhile), or at the
        notice's deadline, whichever comes first: the steps survivors kept in process
        (:meth:`_save_kept`) and every node's newest step into its durable tiers before the
        kill; logged once as ``notice_commit``: whether a step no older than
        ``last_step`` (the newest step a rank completed) was durable by the deadline, counted
        from the commit's atomic rename on the node (not from when the driver heard of it)."""
        pool = self._pool
        pool["accounted"] = True
        t0 = self.clock()
        self._save_kept(group, pool["deadline"])
        try:
            got = self.backend.commit_durable(group.nodes, pool["deadline"])
        except Exception as e:  # noqa: BLE001 - reported; recovery goes on from what is committed
            log.warning("making the newest step durable before the preemption failed: %s", e)
            got = None
        if last_step is None:
            last_step = self._group_step(group)
        fields = {"last_step": last_step, "seconds": round(self.clock() - t0, 6),
                  "since_notice_s": round(self.clock() - pool["noticed_at"], 6)}
        if got is None:
            self.events.emit("notice_commit", committed=False, step=None, tier=None, **fields,
                             reason="no node holds a step on a durable tier (local disk or shared storage)")
            return
        margin = pool["deadline"] - got["t"]
        self.events.emit("notice_commit", committed=margin >= 0 and got["step"] >= last_step, step=got["step"],
                         tier=got["tier"], margin_s=round(margin, 6), **fields)

    def _save_kept(self, group, deadline: float) -> None:
        """The group of a pool notice failed: a survivor whose collective failed before the halt
        reached it (a noticed rank killed at its notice) took that for an ordinary failure and
        kept its last step in process, which dies with its node. The driver, which has the
        notice, has those survivors write it to their nodes' durable tiers now
        (:meth:`RayWorkerGroup.save_kept`), before :meth:`commit_durable` collects the nodes'
        newest steps; each outcome is logged (``live_durable``), a failed write too."""
        save = getattr(group, "save_kept", None)
        if save is None:
            return
        try:
            rows = save(deadline)
        except Exception as e:  # noqa: BLE001 - reported; the nodes' own commits still count
            log.warning("asking the survivors to write the step they kept to disk failed: %s", e)
            self.events.emit("live_durable", rank=None, node=None, step=None, written=None,
                             error=f"{type(e).__name__}: {e}"[:300])
            return
        for r in rows:
            node = group.node_rank_of(r["node_id"]) if hasattr(group, "node_rank_of") else None
            fields = {"error": r["error"][:300]} if "error" in r else {"written": r.get("written"), "why": r.get("why")}
            if "error" in r:
                log.warning("rank %d could not write the step it kept to disk before the preemption: %s",
                            r["rank"], r["error"])
            self.events.emit("live_durable", rank=r["rank"], node=node, step=r.get("step"), **fields)

    def _pool_gone(self, st: RecoveringState) -> bool:
        """Recovery after a pool notice waits for the kill (a group started before it would be
        killed with the nodes): True once the deadline passed and, for a cloud's notice, the
        noticed nodes are gone (the kill takes a moment; a node still up
        :data:`NOTICE_GRACE_S` after the deadline was a false notice and is used again). The
        failure injector takes its nodes at the deadline itself."""
        pool, now = self._pool, self.clock()
        if now < pool["deadline"]:
            if not pool.get("waiting"):
                pool["waiting"] = True
                self.decide("wait_for_preemption", f"every node of the group is taken in "
                            f"{pool['deadline'] - now:.2f}s: recovering after that", step=self.step_now)
            self.sleep(min(self.config.poll_s, max(0.0, pool["deadline"] - now)))
            return False
        if pool["cloud"]:
            lost = self.backend.lost_nodes(pool["nodes"])
            up = [n.name for n in pool["nodes"] if n.node_id not in lost]
            if up and now < pool["deadline"] + NOTICE_GRACE_S:
                self.sleep(self.config.poll_s)
                return False
            if up:
                self.decide("notice_without_preemption", f"{up} still up {NOTICE_GRACE_S:g}s after the notices' "
                            f"deadline: recovering on them", nodes=up)
        self._pool = None
        self._noticed.clear()
        return True

    def _check_capacity(self, st: RunningState) -> None:
        if len(st.group.nodes) >= self.config.num_nodes or self._grow_to is not None:
            return
        now = self.clock()
        if now - self._last_capacity_check < max(1.0, 5 * self.config.poll_s):
            return
        self._last_capacity_check = now
        grow = self.scaling.should_grow(len(st.group.nodes), len(self.backend.usable_nodes()))
        if grow.num_nodes is not None:
            self._grow_to = grow.num_nodes
            self._grow_step = self.step_now + 1
            self.decide("grow_at_next_checkpoint", grow.reason, step=self.step_now)

    def _end_attempt(self, st: RunningState) -> None:
        self.executed += max(0, self.step_now - self._attempt_base)
        self._stall_s += self._attempt_stall
        if self._running_since is not None:
            self._running_s += self.clock() - self._running_since
            self._running_since = None

    # ---- failures -----------------------------------------------------------------------------
    def _on_failure(self, st: RunningState, status: GroupStatus) -> ControllerState:
        """Classify the failure (lost node / crashed process / error), log it, stop the group."""
        detected = self.clock()
        group = st.group
        begin = getattr(self.backend, "begin_retire", None)
        if begin is not None and self._pool is None:   # a pool notice's survivors write what they kept first
            begin(group)
        lost_ids = self.backend.lost_nodes(group.nodes)
        lost = [n for n in group.nodes if n.node_id in lost_ids]
        died = [e for e in status.errors if e.actor_died]
        first = (died or status.errors)[0]
        halted = self._pool is not None and self._pool["halted_at"] is not None
        kind = "preempt" if lost or (halted and not died) else ("crash" if died else "error")
        hang, self._hang = self._hang, None
        claimed = (self.injector.claim(kind=kind) if self.injector is not None and hang is None
                   and not (halted and not died) else None)
        step_at = self._group_step(group)
        node = next((i for i, n in enumerate(group.nodes) if n.node_id in lost_ids),
                    first.rank // max(1, group.world_size // max(1, len(group.nodes))))
        failure = Failure(kind=kind, step=step_at, rank=None if lost else first.rank, node=node,
                          node_id=lost[0].node_id if lost else first.node_id,
                          message=first.message[:500],
                          failed_at=claimed["t"] if claimed else (hang["since"] if hang else
                                                                  self._pool["halted_at"] if halted and not died
                                                                  else detected),
                          detected_at=detected)
        if claimed is None:   # a hang failed when progress stopped: its detection took the timeout
            cause = "hang" if hang else "notice" if halted and not died else kind
            self.events.emit("failure", t=detected, kind="crash" if kind == "error" else kind, step=step_at,
                             rank=failure.rank, node=node, cause=cause, message=failure.message[:200],
                             **({"stalled_since": round(hang["since"], 6)} if hang else {}))
        # "detected" is when the poll saw the errors; classifying (probing the nodes) is recovery work
        self.events.emit("detected", t=detected, kind=kind, ranks_failed=len(status.errors),
                         classify_s=round(self.clock() - detected, 6))
        self._end_attempt(st)
        if self._pool is not None and not self._pool.get("accounted"):
            # before the survivors are recycled: one that kept its step in process writes it
            self._commit_noticed(group, step_at)
        retire = getattr(self.backend, "retire_group", None)
        if retire is not None:   # survivors become the next group's spares, in process
            retire(group)
        else:
            group.shutdown()
        self._dead_pids = group.pids()
        return self._tolerate(failure, st)

    def _tolerate(self, failure: Failure, st) -> ControllerState:
        decision = self.failure_policy.make_decision(self.num_failures, failure)
        self.decide("failure", decision.reason, action=decision.action, kind=failure.kind,
                    step=failure.step, message=failure.message[:200])
        self.num_failures += 1
        if decision.action == "raise":
            return FailedState(FitError(
                f"giving up: {decision.reason}. Last error: {failure.message or failure.kind}. Fix the "
                f"error, or raise max_failures"))
        self._recovery = {"failure": failure, "failed_at": failure.failed_at, "detected_at": failure.detected_at}
        return RecoveringState(failure)

    # ---- the end ------------------------------------------------------------------------------
    def _finish(self, st: RunningState, status: GroupStatus) -> ControllerState:
        self._end_attempt(st)
        r0 = status.results.get(0, {})
        final = r0.get("final_step", self.step_now)
        self.step_now = final
        try:
            self._final_url = self.backend.finish()
            for c in self.backend.drain_commits(final=True):   # finish()'s upload is recorded on its actor
                self._log_commit(st, c)
        finally:
            st.group.shutdown()
        self.events.emit("end", step=final, checkpoint=self._final_url)
        return FinishedState(r0.get("value"))

    def result(self) -> FitResult:
        """The run's outcome (after FINISHED)."""
        value = self.state.value if isinstance(self.state, FinishedState) else None
        return FitResult(
            final_step=self.step_now, steps=self.executed, failures=self.num_failures,
            failure_stats=failure_stats(self.events.records),
            stall_share=self._stall_s / self._running_s if self._running_s > 0 else 0.0,
            checkpoint=self._final_url, value=value, wall_s=self.clock() - self._t0,
            event_log=self.events.path, log_dir=self.config.log_dir, world_sizes=tuple(self._world_sizes),
            skipped_injections=tuple(r for r in self.events.records
                                     if r["event"] in ("injection_skipped", "injection_failed")),
        )
