"""Discrete-event simulator: what a failure schedule costs a job under a checkpoint policy.

Give it the costs measured in a real run (:class:`Costs`), a policy (:class:`EpochBoundary`,
:class:`FixedK`, :class:`Auto`, :class:`FailureAware`) and a schedule; it replays the whole
schedule in virtual time (hours of trace, hundreds of nodes: milliseconds) and returns a
:class:`SimResult` (goodput, wasted worker-seconds, lost iterations and recovery time per
failure, progress over time). Pure: no clock, no I/O.

The model
---------
- **Training** runs iterations of ``iter_s`` on all ``nodes``. After each step that is a
  multiple of ``k`` a checkpoint starts: training stalls ``stall_s``, the checkpoint commits
  ``snapshot_s + persist_s`` after it started. One checkpoint is in flight at a time: if the
  next is due before the previous committed, training waits (so a cycle of ``k`` steps takes
  ``max(k*iter_s + stall_s, snapshot_s + persist_s)``).
- **A failure** (a crash, or a preemption of a node the job holds; simultaneous events are one
  failure) rolls training back to the newest checkpoint committed by then. If a preemption came
  with notice while the job was training, it also checkpoints right after the current iteration
  (once any in-flight persist is done) and keeps training; if that checkpoint commits before the
  kill, only the iterations after it are lost. (It is modelled as one extra commit: its stall and
  its delay of the next regular checkpoint are ignored, an error of at most one checkpoint.)
- **Recovery**: detect (``detect_s``; ``notice_detect_s``, default 0, when a notice announced
  it), wait until all ``nodes``
  slots are up (a fixed-size job pauses; it does not run elastic), restart (``restart_s``, or
  ``preempt_restart_s`` when only preemptions caused it),
  restore (``restore_s``; ``scratch_restore_s``, default 0, when there is no checkpoint yet),
  then redo the lost iterations
  (catch-up, at the normal pace with its checkpoints). A failure during detect or wait joins the
  ongoing recovery; one during restart or restore sends it back to detect.
- **Goodput** = progress at the horizon x ``iter_s`` / horizon: 1 only for a run with neither
  failures nor checkpoint cost. Wasted worker-seconds = worker-seconds of the slots that were up
  (held by the job) - useful iterations x ``iter_s`` x workers.

The frequency helpers below (:func:`checkfreq_k`, :func:`expected_waste_fraction`,
:func:`failure_aware_k`) are deliberately tiny stand-ins for ``cfdist.policy.freq``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cfdist.chaos.events import FailureEvent, Schedule, sort_events
from cfdist.policy import freq
from cfdist.chaos.metrics import PHASES, FailureRecord, RunMetrics

_TOL = 1e-7  # fraction of an iteration / second treated as "exactly at"


def _ceil(x: float) -> int:
    return math.ceil(x - _TOL)


def _floor(x: float) -> int:
    return math.floor(x + _TOL)


# ---------------------------------------------------------------- frequency math (pure) ---


def checkfreq_k(*, iter_s: float, stall_s: float, snapshot_s: float, persist_s: float, overhead_budget: float) -> int:
    """CheckFreq's k: ``max(ceil((Tc+Ts-To)/Ti), ceil(To/(p*Ti)), 1)`` (cfdist.policy.freq's rule).

    The first term lets each checkpoint commit before the next is due; the second (kmin) keeps
    the stall overhead within the budget ``p``. (Tc=snapshot_s, Ts=persist_s, To=stall_s.)
    """
    return max(freq.k_persist(Ti=iter_s, Tsnap=snapshot_s, Ts=persist_s, To=stall_s),
               freq.k_budget(Ti=iter_s, To=stall_s, p=overhead_budget))


def expected_waste_fraction(k: int, *, iter_s: float, stall_s: float, mtbf_s: float) -> float:
    """Young/Daly waste per useful second: ``stall_s/(k*iter_s) + (k*iter_s/2)/mtbf_s``."""
    return freq.waste_rate(k=k, Ti=iter_s, To=stall_s, latency_s=0.0, mtbf_s=mtbf_s)


def failure_aware_k(
    *,
    iter_s: float,
    stall_s: float,
    snapshot_s: float,
    persist_s: float,
    overhead_budget: float,
    mtbf_s: float,
    k_max: int | None = None,
) -> int:
    """The k >= :func:`checkfreq_k` (the budget's floor) minimising :func:`expected_waste_fraction`
    (``cfdist.policy.freq.k_young``); ``k_max`` caps it (needed when ``mtbf_s`` is infinite)."""
    k_lo = checkfreq_k(iter_s=iter_s, stall_s=stall_s, snapshot_s=snapshot_s, persist_s=persist_s,
                       overhead_budget=overhead_budget)
    k_hi = math.inf if k_max is None else max(k_lo, k_max)
    if math.isinf(mtbf_s):
        if math.isinf(k_hi):
            raise ValueError("with no failures (mtbf_s=inf) the waste falls forever with k; pass k_max")
        return int(k_hi)
    k = freq.k_young(Ti=iter_s, To=stall_s, latency_s=0.0, mtbf_s=mtbf_s, k_lo=k_lo)
    return int(min(k, k_hi))


# ------------------------------------------------------------------------------ config ---


def check_number(owner: str, name: str, value: float, *, positive: bool = False, hint: str = "") -> None:
    """``owner.name`` is a finite number (not a bool) >= 0, or > 0 with ``positive``; else ValueError."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{owner}.{name} must be a finite number {'> 0' if positive else '>= 0'}{hint}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Seconds measured in a real run (``Checkpointer.stats`` and the driver's event log)."""

    iter_s: float
    """Ti: one training iteration without checkpointing."""
    stall_s: float
    """To: how long training is blocked per checkpoint."""
    snapshot_s: float = 0.0
    """Tc: checkpoint start until the snapshot copy is complete (persisting starts then)."""
    persist_s: float
    """Ts: writing the snapshot until it is committed."""
    restore_s: float
    """Loading a checkpoint into a restarted worker group."""
    restart_s: float
    """Starting the worker group again once its nodes are up."""
    detect_s: float
    """Failure until the controller notices (a preemption notice makes it 0)."""
    preempt_restart_s: float | None = None
    """``restart_s`` after losing a node, when it differs (the replacement must first get the
    checkpoint from a peer or shared storage); None: ``restart_s``."""
    scratch_restore_s: float | None = None
    """Restart until training when there is no checkpoint to load (rebuilding the model and
    the data pipeline still takes time); None: 0."""
    notice_detect_s: float | None = None
    """Detection time of preemptions that came with a notice, for a driver that still waits to
    see the node go (cfdist's controller does); None: 0, the notice is the detection."""

    def __post_init__(self) -> None:
        check_number("Costs", "iter_s", self.iter_s, positive=True, hint=" (seconds per iteration)")
        for name in ("stall_s", "snapshot_s", "persist_s", "restore_s", "restart_s", "detect_s"):
            check_number("Costs", name, getattr(self, name), hint=" seconds")
        for name in ("preempt_restart_s", "scratch_restore_s", "notice_detect_s"):
            if getattr(self, name) is not None:
                check_number("Costs", name, getattr(self, name), hint=" seconds, or None")

    @property
    def commit_s(self) -> float:
        """Checkpoint start to commit: ``snapshot_s + persist_s``."""
        return self.snapshot_s + self.persist_s


def _check_budget(owner: str, p: float) -> None:
    if not (isinstance(p, (int, float)) and 0 < p < 1):
        raise ValueError(f"{owner}.overhead_budget is a fraction of iteration time in (0, 1), e.g. 0.035; got {p!r}")


@dataclass(frozen=True, kw_only=True)
class EpochBoundary:
    """Baseline: checkpoint only at the end of each epoch of ``iters_per_epoch`` iterations."""

    iters_per_epoch: int
    """E: iterations per epoch."""

    def __post_init__(self) -> None:
        if not isinstance(self.iters_per_epoch, int) or self.iters_per_epoch < 1:
            raise ValueError(f"EpochBoundary.iters_per_epoch must be an int >= 1, got {self.iters_per_epoch!r}")

    @property
    def name(self) -> str:
        """Label for tables and legends."""
        return "epoch"


@dataclass(frozen=True, kw_only=True)
class FixedK:
    """Checkpoint every ``k`` iterations."""

    k: int
    """Iterations between checkpoints."""

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"FixedK.k must be an int >= 1, got {self.k!r}")

    @property
    def name(self) -> str:
        """Label for tables and legends."""
        return f"k={self.k}"


@dataclass(frozen=True, kw_only=True)
class Auto:
    """CheckFreq: the most frequent k whose checkpoints fit the overhead budget (:func:`checkfreq_k`).

    Under live recovery (``simulate(live=True)``) what :class:`cfdist.Auto` does before it has
    seen a failure that took every replica: Young/Daly's interval for ``replica_loss_mtbf_s``,
    never shorter than the budget's (:func:`failure_aware_k`). (The real policy then measures
    that rate from its restarts; the simulated one keeps the assumption.)"""

    overhead_budget: float = 0.035
    """p: largest stall overhead allowed, as a fraction of iteration time."""
    replica_loss_mtbf_s: float = 3600.0
    """With live recovery: the MTBF assumed for failures that take every replica
    (``cfdist.Auto``'s ``replica_loss_mtbf_s``)."""

    def __post_init__(self) -> None:
        _check_budget("Auto", self.overhead_budget)
        check_number("Auto", "replica_loss_mtbf_s", self.replica_loss_mtbf_s, positive=True, hint=" seconds")

    @property
    def name(self) -> str:
        """Label for tables and legends."""
        return "auto"


@dataclass(frozen=True, kw_only=True)
class FailureAware:
    """The k minimising expected waste given the MTBF, within the budget (:func:`failure_aware_k`).

    Never more frequent than :class:`Auto`; less frequent when failures are rare.
    """

    overhead_budget: float = 0.035
    """p: largest stall overhead allowed, as a fraction of iteration time."""
    mtbf_s: float | None = None
    """Mean seconds between the job's failures; None: the replayed schedule's own (an oracle)."""

    def __post_init__(self) -> None:
        _check_budget("FailureAware", self.overhead_budget)
        if self.mtbf_s is not None:
            check_number("FailureAware", "mtbf_s", self.mtbf_s, positive=True, hint=" seconds, or None")

    @property
    def name(self) -> str:
        """Label for tables and legends."""
        return "failure-aware"


SimPolicy = EpochBoundary | FixedK | Auto | FailureAware


def estimate_mtbf(events: Sequence[FailureEvent], horizon_s: float, *, live: bool = False,
                  nodes: int = 1, workers_per_node: int = 1) -> float:
    """Horizon / number of distinct instants with a crash or preemption (inf if none).

    ``live``: only the instants whose failures leave no rank of a ``nodes`` x
    ``workers_per_node`` job running (every node preempted, or the crashes take every rank left)
    count: with live recovery the others roll nothing back."""
    at: dict[float, list[FailureEvent]] = {}
    for e in events:
        if e.is_failure and e.time_s < horizon_s:
            at.setdefault(e.time_s, []).append(e)
    if live:
        def every_replica(hits: list[FailureEvent]) -> bool:
            gone = {e.node for e in hits if e.kind == "preempt"}
            return (nodes - len(gone)) * workers_per_node - sum(e.kind == "crash" for e in hits) <= 0
        at = {t: hits for t, hits in at.items() if every_replica(hits)}
    return horizon_s / len(at) if at else math.inf


def resolve_k(policy: SimPolicy, costs: Costs, *, mtbf_s: float, k_max: int | None = None,
              live: bool = False) -> tuple[int, str]:
    """``(k, reason)``: the interval the policy checkpoints at, and the inputs that decided it.
    ``live``: the job recovers single failures from live replicas (see :class:`Auto`)."""
    c = costs
    given = f"Ti={c.iter_s:g}s To={c.stall_s:g}s Tc={c.snapshot_s:g}s Ts={c.persist_s:g}s"
    if isinstance(policy, EpochBoundary):
        return policy.iters_per_epoch, f"k=E={policy.iters_per_epoch} (epoch boundaries)"
    if isinstance(policy, FixedK):
        return policy.k, f"k={policy.k} (fixed)"
    args = dict(iter_s=c.iter_s, stall_s=c.stall_s, snapshot_s=c.snapshot_s, persist_s=c.persist_s,
                overhead_budget=policy.overhead_budget)
    if isinstance(policy, Auto) and live:
        mtbf = policy.replica_loss_mtbf_s
        k = failure_aware_k(**args, mtbf_s=mtbf, k_max=k_max)
        return k, (f"k={k} because {given} p={policy.overhead_budget:.1%} live recovery: "
                   f"assumed MTBF of replica loss={mtbf:.0f}s")
    if isinstance(policy, Auto):
        k = checkfreq_k(**args)
        return k, f"k={k} because {given} p={policy.overhead_budget:.1%}"
    if isinstance(policy, FailureAware):
        mtbf = policy.mtbf_s if policy.mtbf_s is not None else mtbf_s
        k = failure_aware_k(**args, mtbf_s=mtbf, k_max=k_max)
        return k, f"k={k} because {given} p={policy.overhead_budget:.1%} MTBF={mtbf:.0f}s"
    raise TypeError(f"unknown policy {policy!r}; use EpochBoundary, FixedK, Auto or FailureAware")


@dataclass(frozen=True, kw_only=True)
class SimResult(RunMetrics):
    """:class:`~cfdist.chaos.metrics.RunMetrics` of one simulated policy, plus its decision."""

    k: int
    """Checkpoint interval the policy used."""
    k_reason: str
    """Why that k (the inputs)."""
    failure_free_goodput: float
    """Goodput the same policy gets without failures: ``1 - checkpoint overhead``."""


# ------------------------------------------------------------------------------ engine ---


@dataclass(frozen=True)
class _Segment:
    """Uninterrupted training from step ``s0`` (a committed checkpoint) at time ``t0``."""

    t0: float
    s0: int
    k: int
    costs: Costs
    c1: int = field(init=False)  # first checkpoint step
    start0: float = field(init=False)  # when checkpoint c1 starts
    cycle: float = field(init=False)  # seconds between checkpoint starts

    def __post_init__(self) -> None:
        c, k = self.costs, self.k
        object.__setattr__(self, "c1", (self.s0 // k + 1) * k)
        object.__setattr__(self, "start0", self.t0 + (self.c1 - self.s0) * c.iter_s)
        object.__setattr__(self, "cycle", max(k * c.iter_s + c.stall_s, c.commit_s))

    def _ckpt(self, j: int) -> tuple[int, float]:
        """Step and start time of this segment's j-th checkpoint (j >= 0)."""
        return self.c1 + j * self.k, self.start0 + j * self.cycle

    def steps_at(self, t: float) -> int:
        """Steps finished at time ``t``."""
        c = self.costs
        if t < self.start0:
            return self.s0 + max(0, min(self.c1 - self.s0, _floor((t - self.t0) / c.iter_s)))
        j = _floor((t - self.start0) / self.cycle)
        u = t - self.start0 - j * self.cycle
        return self.c1 + j * self.k + max(0, min(self.k, _floor((u - c.stall_s) / c.iter_s)))

    def time_of_step(self, n: int) -> float:
        """When step ``n`` (> s0) finishes."""
        c = self.costs
        if n <= self.c1:
            return self.t0 + (n - self.s0) * c.iter_s
        j, m = divmod(n - self.c1 - 1, self.k)
        return self.start0 + j * self.cycle + c.stall_s + (m + 1) * c.iter_s

    def committed_at(self, t: float) -> int:
        """Newest step whose checkpoint is committed at time ``t`` (``s0`` if none yet)."""
        x = (t - self.start0 - self.costs.commit_s) / self.cycle
        return self.s0 if x < -_TOL else self._ckpt(_floor(x))[0]

    def emergency(self, t_notice: float, t_kill: float) -> int | None:
        """Step of a notice-triggered checkpoint that commits by ``t_kill``, else None."""
        e = self.steps_at(max(t_notice, self.t0)) + 1
        done = self.time_of_step(e)
        if e >= self.c1 and (e - self.c1) % self.k == 0:  # the regular checkpoint of step e
            commit = self._ckpt((e - self.c1) // self.k)[1] + self.costs.commit_s
        else:
            begin = done
            if done >= self.start0:  # wait for the regular checkpoint in flight
                begin = max(done, self._ckpt(_floor((done - self.start0) / self.cycle))[1] + self.costs.commit_s)
            commit = begin + self.costs.commit_s
        return e if commit <= t_kill + _TOL else None


def step_time(*, costs: Costs, k: int, t0: float, s0: int, step: int) -> float:
    """When step ``step`` (> ``s0``) finishes in an uninterrupted segment that started training at
    ``t0`` from the committed step ``s0`` and checkpoints every ``k`` steps (the simulator's own
    timing: stalls, and waits for the previous commit)."""
    if step <= s0:
        raise ValueError(f"step {step} must come after the segment's start step {s0}")
    return _Segment(t0=t0, s0=s0, k=k, costs=costs).time_of_step(step)


class _Incident:
    def __init__(self, t: float, kind: str, step: int, restored: int, events: int) -> None:
        self.t, self.kind, self.step, self.restored, self.events = t, kind, step, restored, events
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self.resume_t = math.nan
        self.catchup_end = math.nan

    def record(self, *, catchup_s: float, caught_up: bool) -> FailureRecord:
        p = self.phase_s
        return FailureRecord(
            time_s=self.t, kind=self.kind, step=self.step, restored_step=self.restored,
            detect_s=p["detect"], wait_s=p["wait"], restart_s=p["restart"], restore_s=p["restore"],
            catchup_s=catchup_s, caught_up=caught_up, events=self.events,
        )


class _Run:
    """Mutable state of one simulated run; driven by :func:`simulate`."""

    def __init__(self, *, k: int, costs: Costs, nodes: int, replicas: int = 1, live: bool = False) -> None:
        self.k, self.c, self.nodes = k, costs, nodes
        self.replicas, self.live = replicas, live
        self.up = [True] * nodes
        self.node_s, self.last_t = 0.0, 0.0
        self.phase, self.phase_t, self.phase_end = "running", 0.0, math.inf
        self.seg = _Segment(t0=0.0, s0=0, k=k, costs=costs)
        self.restored = 0
        self.open: _Incident | None = None  # recovering
        self.catching: _Incident | None = None  # caught up at catching.catchup_end
        self.done: list[FailureRecord] = []
        self.progress: list[tuple[float, int]] = [(0.0, 0)]

    def _to(self, t: float, phase: str, end: float) -> None:
        if self.open is not None and self.phase in PHASES:
            self.open.phase_s[self.phase] += t - self.phase_t
        self.phase, self.phase_t, self.phase_end = phase, t, end

    def _advance(self, until: float) -> None:
        while self.phase_end <= until:
            t = self.phase_end
            if self.phase == "detect":
                ready = all(self.up)
                self._to(t, "restart" if ready else "wait", t + self._restart_s() if ready else math.inf)
            elif self.phase == "restart":
                scratch = self.c.scratch_restore_s or 0.0
                self._to(t, "restore", t + (self.c.restore_s if self.restored > 0 else scratch))
            else:
                self._resume(t)
        self.node_s += sum(self.up) * (until - self.last_t)
        self.last_t = until
        inc = self.catching
        if inc is not None and inc.catchup_end <= until:
            self.done.append(inc.record(catchup_s=inc.catchup_end - inc.resume_t, caught_up=True))
            self.catching = None

    def _resume(self, t: float) -> None:
        self._to(t, "running", math.inf)
        self.seg = _Segment(t0=t, s0=self.restored, k=self.k, costs=self.c)
        self.progress.append((t, self.restored))
        inc, self.open = self.open, None
        inc.resume_t = t
        if inc.step <= self.restored:
            self.done.append(inc.record(catchup_s=0.0, caught_up=True))
        else:
            inc.catchup_end = self.seg.time_of_step(inc.step)
            self.catching = inc

    def apply(self, t: float, group: list[FailureEvent]) -> None:
        """All events of one instant ``t``."""
        self._advance(t)
        self._up_before = list(self.up)   # a return in the same instant does not undo a preemption's loss
        hits = []
        for e in group:
            if e.kind == "return":
                self.up[e.node] = True
            elif e.kind == "preempt":
                if self.up[e.node]:
                    self.up[e.node] = False
                    hits.append(e)
            elif self.phase in ("running", "restart", "restore"):  # a crash needs live workers
                hits.append(e)
        if hits:
            self._fail(t, hits)
        if self.phase == "wait" and all(self.up):
            self._to(t, "restart", t + self._restart_s())

    def _restart_s(self) -> float:
        lost_node = self.open is not None and self.open.kind == "preempt"
        if lost_node and self.c.preempt_restart_s is not None:
            return self.c.preempt_restart_s
        return self.c.restart_s

    def _fail(self, t: float, hits: list[FailureEvent]) -> None:
        kind = "crash" if any(e.kind == "crash" for e in hits) else "preempt"
        notices = [e.notice_s for e in hits if e.kind == "preempt" and e.notice_s > 0]
        detect = (self.c.notice_detect_s or 0.0) if len(notices) == len(hits) else self.c.detect_s
        if self.phase != "running":
            self.open.events += len(hits)
            if kind == "crash":
                self.open.kind = "crash"
            if self.phase in ("restart", "restore"):
                self._to(t, "detect", t + detect)
            return
        if self.catching is not None:
            inc, self.catching = self.catching, None
            self.done.append(inc.record(catchup_s=t - inc.resume_t, caught_up=False))
        step, committed = self.seg.steps_at(t), self.seg.committed_at(t)
        if notices:
            e = self.seg.emergency(t - max(notices), t)
            if e is not None:
                committed = max(committed, e)
        if self.live and self._replica_survives(hits):
            committed = step   # a survivor writes the last step it completed: only the one in progress is lost
        self.progress += [(t, step), (t, committed)]
        self.restored = committed
        self.open = _Incident(t, kind, step, committed, len(hits))
        self._to(t, "detect", t + detect)

    def _replica_survives(self, hits: list[FailureEvent]) -> bool:
        """Whether a rank holding the live state is left after ``hits`` (a crash takes one rank;
        a preemption its node, already marked down in ``up``)."""
        per_node = self.replicas // self.nodes
        taken = {e.node for e in hits if e.kind == "preempt"}
        running = sum(1 for i, u in enumerate(self._up_before) if u and i not in taken)
        return running * per_node - sum(1 for e in hits if e.kind == "crash") > 0

    def finish(self, horizon: float) -> int:
        """Close the books at ``horizon``; returns the progress then."""
        self._advance(horizon)
        if self.catching is not None:
            inc = self.catching
            self.done.append(inc.record(catchup_s=horizon - inc.resume_t, caught_up=False))
        if self.open is not None:
            self._to(horizon, "ended", math.inf)
            self.done.append(self.open.record(catchup_s=0.0, caught_up=False))
        useful = self.seg.steps_at(horizon) if self.phase == "running" else self.restored
        self.progress.append((horizon, useful))
        return useful


def _check_events(events: Sequence[FailureEvent], nodes: int) -> None:
    for e in events:
        if e.node is not None and e.node >= nodes:
            raise ValueError(
                f"{e} names node {e.node} but the job has nodes 0..{nodes - 1}; "
                f"build the events with schedule.events(num_nodes={nodes}, ...)"
            )


def simulate(
    schedule: Schedule | Sequence[FailureEvent],
    policy: SimPolicy,
    *,
    costs: Costs,
    nodes: int,
    horizon_s: float,
    workers_per_node: int = 1,
    label: str | None = None,
    live: bool = False,
) -> SimResult:
    """Replay ``schedule`` (or a ready list of events) for a ``nodes``-node job until ``horizon_s``.

    Pure and deterministic. ``workers_per_node`` scales worker-seconds and counts the replicas
    a crash leaves. ``live``: recovery from the survivors' live state (``cfdist.fit``'s
    ``live_recovery``): a failure that leaves a rank running (a crash of one rank of several, a
    preemption that leaves a node) restores the last step completed before it, so only the
    step in progress is lost; one that takes every rank rolls back to the newest commit.
    """
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an int >= 1, got {nodes!r}")
    if not (isinstance(workers_per_node, int) and workers_per_node >= 1):
        raise ValueError(f"workers_per_node must be an int >= 1, got {workers_per_node!r}")
    if not (math.isfinite(horizon_s) and horizon_s > 0):
        raise ValueError(f"horizon_s must be finite seconds > 0 (a trace's span: TraceReplay.span_s), got {horizon_s!r}")
    events = schedule.events(nodes, horizon_s) if hasattr(schedule, "events") else sort_events(list(schedule))
    _check_events(events, nodes)
    k_max = max(1, _ceil(horizon_s / costs.iter_s))
    mtbf = estimate_mtbf(events, horizon_s, live=live, nodes=nodes, workers_per_node=workers_per_node)
    k, reason = resolve_k(policy, costs, mtbf_s=mtbf, k_max=k_max, live=live)
    run = _Run(k=k, costs=costs, nodes=nodes, replicas=nodes * workers_per_node, live=live)
    i = 0
    while i < len(events) and events[i].time_s < horizon_s:
        j = i
        while j < len(events) and events[j].time_s == events[i].time_s:
            j += 1
        run.apply(events[i].time_s, list(events[i:j]))
        i = j
    useful = run.finish(horizon_s)
    return SimResult(
        label=label or policy.name, wall_s=horizon_s, iter_s=costs.iter_s, workers=nodes * workers_per_node,
        useful_iters=useful, failures=tuple(run.done), progress=tuple(run.progress),
        worker_s=run.node_s * workers_per_node, k=k, k_reason=reason,
        failure_free_goodput=k * costs.iter_s / max(k * costs.iter_s + costs.stall_s, costs.commit_s),
    )


def compare(
    schedule: Schedule | Sequence[FailureEvent],
    policies: Sequence[SimPolicy],
    *,
    costs: Costs,
    nodes: int,
    horizon_s: float,
    workers_per_node: int = 1,
) -> list[SimResult]:
    """:func:`simulate` each policy against the same events (computed once)."""
    events = schedule.events(nodes, horizon_s) if hasattr(schedule, "events") else list(schedule)
    return [
        simulate(events, p, costs=costs, nodes=nodes, horizon_s=horizon_s, workers_per_node=workers_per_node)
        for p in policies
    ]
