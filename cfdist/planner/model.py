"""The cost model: one candidate plan, one failure schedule -> hours, node-hours, dollars. Pure.

A :class:`Candidate` is one choice of settings. :func:`candidate_costs` turns the job's measured
costs into the simulator's :class:`~cfdist.chaos.simulator.Costs` for it, and :func:`run_once`
replays a schedule through :func:`cfdist.chaos.simulator.simulate` **until the job's last step
finishes** (the horizon grows until it does), then charges the node-hours held.

Assumptions (each one is also in ``docs/planning.md``):

- **Every failure is a preemption** (a node taken away). Crashes of a process on a node that
  stays up are not modelled, so the memory tier (``memory_every``), which survives only crashes,
  is not a dimension of the plan.
- **Tiers**: ``local`` commits each checkpoint to node-local disk (``persist_s``) and copies
  every ``shared_every``-th to shared storage; ``shared`` (``local_tier: false``) commits every
  checkpoint to shared storage (``state bytes / shared bandwidth``).
- **Peer copy** (``tiers.peer_copy``): a lost node's replacement copies the newest checkpoint
  from a survivor (``bytes / peer bandwidth``), so the job rolls back to it.
- **Live recovery** (``recovery.live_recovery``, with peer copy on two or more nodes): a
  preemption that leaves a node running loses only the step in progress (the survivors write
  their live state, the replacement copies it); one that takes every node rolls back to the
  newest checkpoint as without it. Without
  it, the replacement reads shared storage, so the job rolls back to the newest *shared*
  checkpoint: simulated as checkpoints every ``k * shared_every`` steps, the stalls of the
  other checkpoints spread over the steps (each step ``stall_s / k`` longer; the same stall per
  step, at most one interval's stalls off in total). A one-node job has no survivor
  to copy from, so it always restores from shared storage. A failure that takes every node
  leaves no survivor: with peer copy, each such failure is charged afterwards an extra rollback
  of ``(shared_every - 1) * k / 2`` steps (the mean distance to the newest shared checkpoint)
  plus the shared download.
- **Codecs** shrink the persisted bytes by ``codec_ratio``: persist, upload and download times
  and the storage bill scale by it; encoding and decoding time are not modelled.
- **Capacity**: ``spot`` nodes are preempted by the schedule and are billed only while up;
  ``on-demand`` nodes are never preempted and billed from start to finish;
  ``uniform-progress`` (after "Can't Be Late"'s Uniform Progress) runs on spot while the
  committed progress is on or above the straight line from 0 to ``steps`` at the deadline; when
  a preemption leaves it below the line before it could resume on spot, it moves to on-demand
  (restart + shared download + restore). It moves back to spot at the first checkpoint that
  commits while it would still be on the line after paying that switch again and every spot
  slot of the schedule is up (spot billed for the switch). The rule compares the line with the
  simulated rollback, so with peer copy it does not see the extra rollback of a failure that
  took every node (charged afterwards, as for spot).
- **Nodes**: ``iter_s`` scales with the node count as :meth:`Job.iter_s_on` says; a fixed-size
  job waits until all its nodes are up (no elastic shrinking).
- **Dollars** = spot node-hours x spot price + on-demand node-hours x on-demand price + shared
  storage (``keep`` = 2 checkpoints held for the run's hours, GB-month = 730 h) + egress (every
  restore from shared storage reads the checkpoint once per node). The final checkpoint's commit
  and the job's start-up before its first step are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cfdist.chaos.events import FailureEvent
from cfdist.chaos.simulator import Auto as SimAuto
from cfdist.chaos.simulator import Costs, FailureAware, FixedK, SimResult, resolve_k, simulate, step_time
from cfdist.planner.job import Job
from cfdist.planner.prices import InstancePrice, Prices

CAPACITIES = ("spot", "on-demand", "uniform-progress")
TIERS = ("local", "shared")
KEEP_SHARED = 2          # checkpoints the shared tier holds (TierOptions.keep's default)
HOURS_PER_MONTH = 730.0
MAX_STRETCH = 200.0      # give up when a run would take this many times its failure-free time


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One plan: the settings the planner compares."""

    policy: str
    """``"every:K"``, ``"auto"`` (CheckFreq's k) or ``"auto-mtbf"`` (Young/Daly with the MTBF)."""
    tiers: str = "local"
    """``"local"`` (node-local disk, shared copy every ``shared_every``) or ``"shared"``."""
    peer_copy: bool = True
    """A replacement node copies a survivor's checkpoint (``local`` tiers only)."""
    live: bool = False
    """Live recovery (``cfdist.fit``'s ``live_recovery``): a preemption that leaves a node loses
    only the step in progress. Needs peer copy and two or more nodes (the replacement copies
    the survivors' live state)."""
    shared_every: int = 10
    """Every n-th checkpoint goes to shared storage (``local`` tiers)."""
    codec: str = "none"
    """Codec label (``none``: raw bytes)."""
    codec_ratio: float = 1.0
    """Persisted bytes / raw bytes with that codec."""
    nodes: int = 1
    """Nodes of the job."""
    capacity: str = "spot"
    """``"spot"``, ``"on-demand"`` or ``"uniform-progress"`` (needs a deadline)."""

    def __post_init__(self) -> None:
        if not (self.policy in ("auto", "auto-mtbf") or
                (self.policy.startswith("every:") and self.policy[6:].isdigit() and int(self.policy[6:]) >= 1)):
            raise ValueError(f"policy must be every:K (K >= 1), auto or auto-mtbf, got {self.policy!r}")
        if self.tiers not in TIERS:
            raise ValueError(f"tiers must be one of {', '.join(TIERS)}, got {self.tiers!r}")
        if self.capacity not in CAPACITIES:
            raise ValueError(f"capacity must be one of {', '.join(CAPACITIES)}, got {self.capacity!r}")
        if not (0 < self.codec_ratio <= 1.0 or self.codec == "none"):
            raise ValueError(f"codec ratio of {self.codec!r} must be in (0, 1] (persisted / raw bytes), "
                             f"got {self.codec_ratio!r}")
        if not isinstance(self.shared_every, int) or self.shared_every < 1:
            raise ValueError(f"shared_every must be an int >= 1, got {self.shared_every!r}")
        if self.live and self.recovery != "peer":
            raise ValueError("live recovery needs a survivor to copy from: local tiers with peer copy on 2 or more "
                             f"nodes (got tiers={self.tiers!r}, peer_copy={self.peer_copy}, nodes={self.nodes})")

    @property
    def recovery(self) -> str:
        """How a lost node gets its checkpoint: ``peer`` or ``shared`` (a one-node job has no peer)."""
        return "peer" if self.tiers == "local" and self.peer_copy and self.nodes > 1 else "shared"

    @property
    def name(self) -> str:
        """Short unique label: ``spot n=4 every:200 local+peer``."""
        tiers = ("local+peer+live" if self.live else "local+peer") if self.recovery == "peer" else self.tiers
        codec = "" if self.codec == "none" else f" {self.codec}"
        return f"{self.capacity} n={self.nodes} {self.policy} {tiers}{codec}"


@dataclass(frozen=True, kw_only=True)
class Model:
    """What a candidate costs the simulator: the costs, the interval simulated, the extras."""

    costs: Costs
    """Costs of the checkpoints the job rolls back to."""
    k: int
    """Steps between checkpoints as configured (the policy's k)."""
    k_sim: int
    """Steps between the checkpoints a preemption rolls back to (``k`` or ``k * shared_every``)."""
    iter_s: float
    """Seconds per step on this many nodes, without checkpoint stalls (the goodput's yardstick)."""
    shared_read_s: float
    """Downloading one checkpoint from shared storage."""
    checkpoint_gb: float
    """Persisted size of one checkpoint, GB (1e9 bytes)."""
    k_reason: str
    """Why that k."""
    live: bool = False
    """Live recovery: a failure that leaves a node restores the last completed step."""


def candidate_costs(job: Job, cand: Candidate, *, mtbf_s: float) -> Model:
    """The simulator's view of ``cand`` for ``job`` (rules in the module docstring)."""
    ratio = cand.codec_ratio
    nbytes = job.state_bytes * ratio
    up = nbytes / job.shared_bytes_per_s
    iter_s = job.iter_s_on(cand.nodes)
    local_persist = job.persist_s * ratio
    persist = local_persist if cand.tiers == "local" else up
    base = Costs(iter_s=iter_s, stall_s=job.stall_s, persist_s=persist, restore_s=job.restore_s,
                 restart_s=job.restart_s, detect_s=job.detect_s)
    if cand.policy.startswith("every:"):
        k, reason = resolve_k(FixedK(k=int(cand.policy[6:])), base, mtbf_s=mtbf_s)
    elif cand.policy == "auto":
        k, reason = resolve_k(SimAuto(), base, mtbf_s=mtbf_s, live=cand.live, k_max=job.steps)
    else:
        k, reason = resolve_k(FailureAware(mtbf_s=mtbf_s if math.isfinite(mtbf_s) else None), base,
                              mtbf_s=mtbf_s, k_max=job.steps)
    k = min(k, job.steps)
    if cand.recovery == "peer":
        costs = Costs(iter_s=iter_s, stall_s=job.stall_s, persist_s=persist, restore_s=job.restore_s,
                      restart_s=job.restart_s, detect_s=job.detect_s,
                      preempt_restart_s=job.restart_s + nbytes / job.peer_bytes_per_s)
        k_sim = k
    else:
        every = cand.shared_every if cand.tiers == "local" else 1
        # rolling back to every `every`-th checkpoint: simulate those only, and spread the stalls
        # of the others over the steps (each step takes stall_s / k longer)
        spread = every > 1
        costs = Costs(iter_s=iter_s + job.stall_s / k if spread else iter_s,
                      stall_s=0.0 if spread else job.stall_s,
                      persist_s=local_persist + up if cand.tiers == "local" else up,
                      restore_s=job.restore_s, restart_s=job.restart_s, detect_s=job.detect_s,
                      preempt_restart_s=job.restart_s + up)
        k_sim = k * every
    return Model(costs=costs, k=k, k_sim=k_sim, iter_s=iter_s, shared_read_s=up, checkpoint_gb=nbytes / 1e9,
                 k_reason=reason, live=cand.live)


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One candidate under one failure schedule."""

    hours: float
    """Start to the last step, hours."""
    spot_node_hours: float
    """Node-hours billed at the spot price."""
    on_demand_node_hours: float
    """Node-hours billed at the on-demand price."""
    dollars: float
    """Compute + storage + egress."""
    goodput: float
    """Failure-free compute time of the steps / hours taken (1: no failure, no checkpoint cost)."""
    lost_hours: float
    """Training time redone after rollbacks, hours."""
    failures: int
    """Interruptions the job went through."""
    switched_at_h: float | None = None
    """uniform-progress: when it moved to on-demand (None: it never did)."""


def finish_time(r: SimResult, *, costs: Costs, k: int, target: int) -> float | None:
    """When step ``target`` first finished in the simulated run ``r`` (None: not by its horizon).

    The run is a sequence of uninterrupted segments: from time 0 at step 0, and from each
    recovery's end at its restored step; a segment ends at the next failure (its ``step``)."""
    t0, s0 = 0.0, 0
    for f in sorted(r.failures, key=lambda f: f.time_s):
        if f.step >= target:
            return step_time(costs=costs, k=k, t0=t0, s0=s0, step=target)
        t0, s0 = f.time_s + f.detect_s + f.wait_s + f.restart_s + f.restore_s, f.restored_step
    if r.useful_iters >= target and s0 < target:
        return step_time(costs=costs, k=k, t0=t0, s0=s0, step=target)
    return None


def _simulate(events: list[FailureEvent], m: Model, nodes: int, horizon_s: float) -> SimResult:
    return simulate(events, FixedK(k=m.k_sim), costs=m.costs, nodes=nodes, horizon_s=horizon_s, live=m.live)


def _grow(events_for, m: Model, nodes: int, target: int, decide):
    """Simulate with a growing horizon until ``decide(result)`` returns a time (not None)."""
    ff = step_time(costs=m.costs, k=m.k_sim, t0=0.0, s0=0, step=target)
    horizon = 2.0 * ff
    while True:
        events = events_for(horizon)
        r = _simulate(events, m, nodes, horizon)
        got = decide(r)
        if got is not None:
            return got, events
        if horizon > MAX_STRETCH * ff:
            raise ValueError(f"does not finish within {MAX_STRETCH:g}x its failure-free time ({ff / 3600:.3g} h) "
                             f"under this failure schedule: its nodes stay down, or failures come faster than it "
                             f"redoes the up to {m.k_sim} steps ({m.k_sim * m.costs.iter_s:.0f} s) it rolls back "
                             f"per failure; checkpoint more often or use peer copy")
        horizon *= 2.0


def _extra_all_nodes(r: SimResult, m: Model, cand: Candidate) -> tuple[float, int]:
    """Seconds added for failures that took every node while relying on peer copy, and their count."""
    if cand.recovery != "peer":
        return 0.0, 0
    n = sum(1 for f in r.failures if f.events >= cand.nodes)
    extra = n * ((cand.shared_every - 1) * m.k / 2.0 * m.iter_s + m.shared_read_s)
    return extra, n


def _lost_s(r: SimResult) -> float:
    return sum(f.step - f.restored_step for f in r.failures) * r.iter_s


def run_once(job: Job, cand: Candidate, m: Model, price: InstancePrice, prices: Prices, events_for,
             *, deadline_s: float | None = None) -> Outcome:
    """``cand`` under the schedule ``events_for(horizon_s) -> events`` (spot only; on-demand
    ignores it): run to the last step and charge it."""
    target, n = job.steps, cand.nodes
    if cand.capacity == "on-demand":
        t = step_time(costs=m.costs, k=m.k_sim, t0=0.0, s0=0, step=target)
        return _outcome(job, cand, m, prices, price, hours_s=t, spot_s=0.0, od_s=n * t, lost_s=0.0,
                        failures=0, shared_reads=0)
    if cand.capacity == "spot":
        t, events = _grow(events_for, m, n, target, lambda r: finish_time(r, costs=m.costs, k=m.k_sim, target=target))
        r = _simulate(events, m, n, t)
        extra, wide = _extra_all_nodes(r, m, cand)
        reads = _shared_reads(r, cand)
        return _outcome(job, cand, m, prices, price, hours_s=t + extra, spot_s=r.worker_s + n * extra,
                        od_s=0.0, lost_s=_lost_s(r) + extra, failures=len(r.failures), shared_reads=reads + wide)
    if deadline_s is None:
        raise ValueError("the uniform-progress candidate needs a deadline (--deadline-h)")
    return _uniform_progress(job, cand, m, price, prices, events_for, deadline_s)


def _shared_reads(r: SimResult, cand: Candidate) -> int:
    """Checkpoint downloads from shared storage (one per node per restore from shared)."""
    return _shared_reads_before(r.failures, cand)


def _shared_reads_before(failures, cand: Candidate) -> int:
    return 0 if cand.recovery == "peer" else len(failures) * cand.nodes


MAX_SWITCHES = 200   # moves between spot and on-demand in one uniform-progress run


def _all_up_series(events: list[FailureEvent], nodes: int) -> tuple[list[float], list[bool]]:
    """``(times, all_up)``: from each time on (until the next), whether every spot slot is up."""
    up, times, flags = [True] * nodes, [0.0], [True]
    for i, e in enumerate(events):
        if e.kind == "preempt":
            up[e.node] = False
        elif e.kind == "return":
            up[e.node] = True
        if i + 1 == len(events) or events[i + 1].time_s != e.time_s:
            times.append(e.time_s)
            flags.append(all(up))
    return times, flags


def _uniform_progress(job, cand, m, price, prices, events_for, deadline_s) -> Outcome:
    """Spot while on or above the uniform line, on-demand while below it (module docstring)."""
    import bisect

    target, n = job.steps, cand.nodes
    slope = target / deadline_s      # steps per second of the uniform line
    switch_s = m.costs.restart_s + m.shared_read_s + m.costs.restore_s
    commit_s = m.costs.commit_s
    t, c = 0.0, 0                    # the current phase starts at time t from committed step c
    spot_s = od_s = lost = extra_s = 0.0
    fails = reads = 0
    switched_at = None
    for _ in range(MAX_SWITCHES):
        def shifted(h, t=t):
            return [replace(e, time_s=e.time_s - t) for e in events_for(t + h) if e.time_s >= t]

        def decide(r: SimResult, t=t, c=c):
            t0, s0 = 0.0, 0
            for f in sorted(r.failures, key=lambda f: f.time_s):
                if c + f.step >= target:
                    return ("finish", step_time(costs=m.costs, k=m.k_sim, t0=t0, s0=s0, step=target - c), None, r)
                resume = f.time_s + f.detect_s + f.wait_s + f.restart_s + f.restore_s
                behind_at = max(f.time_s, (c + f.restored_step) / slope - t)
                if behind_at < resume:
                    return ("switch", behind_at, f.restored_step, r)
                t0, s0 = resume, f.restored_step
            if r.useful_iters >= target - c and s0 < target - c:
                return ("finish", step_time(costs=m.costs, k=m.k_sim, t0=t0, s0=s0, step=target - c), None, r)
            return None

        (what, dt, step, first), events = _grow(shifted, m, n, target - c, decide)
        r = _simulate(events, m, n, dt)
        if what == "finish":
            extra, wide = _extra_all_nodes(r, m, cand)
            spot_s += r.worker_s + n * extra
            lost += _lost_s(r) + extra
            extra_s += extra
            fails += len(r.failures)
            reads += _shared_reads(r, cand) + wide
            end = t + dt + extra_s
            break
        # the failures up to the switch, the one that made it fall behind included (it may be at the
        # switch itself; its restore happens on the on-demand nodes: n downloads from shared storage)
        before = [f for f in first.failures if f.time_s <= dt]
        spot_s += r.worker_s
        lost += sum(f.step - f.restored_step for f in before) * m.costs.iter_s
        fails += len(before)
        reads += _shared_reads_before(before[:-1], cand) + n
        t_sw, c = t + dt, c + step
        switched_at = t_sw if switched_at is None else switched_at
        # on-demand from t_sw: back to spot at the first checkpoint that commits with the job still on
        # the line after the switch back, and every spot slot up; else finish on on-demand
        start = t_sw + switch_s
        finish = step_time(costs=m.costs, k=m.k_sim, t0=start, s0=c, step=target) if c < target else start
        times, flags = _all_up_series(events_for(finish + 1.0), n)
        back = None
        s = (c // m.k_sim + 1) * m.k_sim
        while s < target:
            at = step_time(costs=m.costs, k=m.k_sim, t0=start, s0=c, step=s) + commit_s
            if s >= slope * (at + switch_s) and flags[bisect.bisect_right(times, at) - 1]:
                back = (s, at)
                break
            s += m.k_sim
        if back is None:
            od_s += n * (finish - t_sw)
            end = finish + extra_s
            break
        s, at = back
        od_s += n * (at - t_sw)
        spot_s += n * switch_s           # the spot nodes restart and restore before training
        reads += n
        t, c = at + switch_s, s
    else:
        raise ValueError(f"moved between spot and on-demand more than {MAX_SWITCHES} times; "
                         f"give a later deadline")
    return _outcome(job, cand, m, prices, price, hours_s=end, spot_s=spot_s, od_s=od_s, lost_s=lost,
                    failures=fails, shared_reads=reads, switched_at_s=switched_at)


def _outcome(job, cand, m, prices: Prices, price: InstancePrice, *, hours_s, spot_s, od_s, lost_s, failures,
             shared_reads, switched_at_s=None) -> Outcome:
    hours = hours_s / 3600.0
    compute = spot_s / 3600.0 * price.spot_per_hour + od_s / 3600.0 * price.on_demand_per_hour
    storage = KEEP_SHARED * m.checkpoint_gb * hours / HOURS_PER_MONTH * prices.shared_per_gb_month
    egress = shared_reads * m.checkpoint_gb * prices.egress_per_gb
    useful = job.steps * m.iter_s
    return Outcome(hours=hours, spot_node_hours=spot_s / 3600.0, on_demand_node_hours=od_s / 3600.0,
                   dollars=compute + storage + egress, goodput=useful / hours_s if hours_s > 0 else 1.0,
                   lost_hours=lost_s / 3600.0, failures=failures,
                   switched_at_h=None if switched_at_s is None else switched_at_s / 3600.0)
