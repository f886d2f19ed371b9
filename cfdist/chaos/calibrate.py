"""From real runs' event logs to simulator costs, and the simulator's prediction of each run. Pure.

A preemption experiment (:mod:`cfdist.experiments.experiment`) runs one job per policy under the same
failure schedule and keeps each run's JSONL event log. This module turns those logs into:

- **the training window** of a run (:func:`training_window`): from the start of its first step
  to its last step. Start-up (Ray actors, building the model) and tear-down are per-job
  constants, not what failures cost; leaving them out of both the measurement and the
  prediction keeps the comparison about failures. The window's offset from the failure
  injector's time 0 (its ``schedule_started`` record: the first group trained its first step;
  the first ``restarted`` in logs from before it) shifts the schedule onto the window;
- **the costs** the simulator needs (:func:`measure_costs`) from one run or pooled over several:
  iteration time, stall per checkpoint, commit latency, detect, restart and restore seconds;
- **the prediction** of each run (:func:`predict`): the simulator replays the same schedule for
  the same policy (the ``k`` the real policy reported) over the same window. Given the run's
  own costs, the error measures the simulator's model (which failures hit training or a
  recovery, what they lose, what checkpoints cost); given the other runs' costs, it also
  includes how much the machine's speed drifted between runs.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from cfdist.chaos.events import FailureEvent
from cfdist.chaos.metrics import RunMetrics, commit_spans, metrics_from_log
from cfdist.chaos.simulator import Costs, SimPolicy, SimResult, simulate


def training_window(records: Sequence[dict]) -> tuple[list[dict], float]:
    """``(window, offset_s)``: the records from the start of the first step to the last ``step``.

    The first step starts one iteration (the median step gap) before its record. A ``start``
    record at that instant and an ``end`` record at the last step are added, so
    :func:`~cfdist.chaos.metrics.metrics_from_log` measures exactly this window. ``offset_s``:
    seconds from the injector's time 0 to the window's start; subtract
    it from the schedule's times. Raises ValueError when the run never trained.

    The injector's time 0 is its ``schedule_started`` record (logs written before it existed:
    the first ``restarted``); it comes just after the first step, so the offset is then a
    fraction of a step below zero.
    """
    zero = next((i for i, r in enumerate(records) if r["event"] == "restarted"), None)
    started = next((r["t"] for r in records if r["event"] == "schedule_started"), None)
    first = next((i for i, r in enumerate(records) if r["event"] == "step"), None)
    last = max((i for i, r in enumerate(records) if r["event"] == "step"), default=None)
    if zero is None or first is None or first < zero:
        raise ValueError("the event log has no 'restarted' record followed by a 'step': the run never trained; "
                         "check its end record for the error")
    gaps = step_gaps(records)
    t0 = max(records[zero]["t"], records[first]["t"] - (statistics.median(gaps) if gaps else 0.0))
    world = next((r.get("world_size") for r in records if r["event"] == "start"), None)
    start = {"t": t0, "event": "start", **({"world_size": world} if world else {})}
    body = [r for r in records[zero:last + 1] if r["event"] not in ("start", "end") and r["t"] >= t0]
    end = {"t": records[last]["t"], "event": "end", "step": records[last]["step"]}
    return [start, *body, end], t0 - (records[zero]["t"] if started is None else started)


def step_gap_spans(records: Sequence[dict]) -> list[tuple[float, float]]:
    """``(start, end)`` of each gap between consecutive steps (``n`` then ``n+1``) of one
    attempt (no failure between): the times of the two ``step`` records."""
    spans, prev = [], None
    for r in records:
        if r["event"] in ("failure", "restarted"):
            prev = None
        elif r["event"] == "step":
            if prev is not None and r["step"] == prev["step"] + 1:
                spans.append((prev["t"], r["t"]))
            prev = r
    return spans


AFTER_FAILURE_S = 4.0
"""Seconds after a resume that :func:`time_lost` counts as a failure's aftermath: on one machine
the process that replaces a used warm spare starts then (Ray's worker, torch, the first DDP:
~3 CPU-seconds), and the ranks' steps run slower until it is done."""


@dataclass(frozen=True, kw_only=True)
class TimeLost:
    """Where a training window's time went beyond its useful iterations
    (``window_s - useful_iters * iter_s``, the ``1 - goodput`` share), split over the step gaps:

    - ``failures_s``: the gaps that span a failure (detect, restart, restore, the step made
      after it), less the progress they made; a rollback's iterations to redo count here;
    - ``after_failures_s``: the time the steps of the :data:`AFTER_FAILURE_S` after each resume
      took beyond ``iter_s`` each (the replacement warm spare's start slows them on a shared
      machine), less their checkpoint stalls;
    - ``checkpoint_stalls_s``: what rank 0's checkpointer reported as stall (its ``stall_s``
      grew by it: the wait for a snapshot's copy or a persist), wherever the step was;
    - ``other_s``: the rest, the steps' own spread around the median (``iter_s``) and anything
      else; a failure-free run loses this much too.
    """

    window_s: float
    useful_iters: int
    iter_s: float
    failures_s: float
    after_failures_s: float
    checkpoint_stalls_s: float
    other_s: float

    @property
    def lost_s(self) -> float:
        """Seconds of the window beyond its useful iterations (the four parts' sum)."""
        return self.failures_s + self.after_failures_s + self.checkpoint_stalls_s + self.other_s

    def as_dict(self) -> dict:
        return {"window_s": self.window_s, "useful_iters": self.useful_iters, "iter_s": self.iter_s,
                "lost_s": self.lost_s, "failures_s": self.failures_s, "after_failures_s": self.after_failures_s,
                "checkpoint_stalls_s": self.checkpoint_stalls_s, "other_s": self.other_s}


_RECOVERY_EVENTS = frozenset({"failure", "detected", "restarted", "restored", "resumed"})
"""A step gap with one of these between its two steps (in the log's order) spans a failure: the
failure's record can follow the next step's (the step completed as the failure struck)."""


def time_lost(window: Sequence[dict], iter_s: float, *, after_s: float = AFTER_FAILURE_S,
              metrics: RunMetrics | None = None) -> TimeLost:
    """Split a training window's lost time (:func:`training_window`'s records; goodput's
    ``iter_s``) into :class:`TimeLost`'s parts. Each gap between consecutive ``step`` records
    loses ``gap - (its steps' progress) * iter_s``: a gap with a failure's or a recovery's
    record between its steps (:data:`_RECOVERY_EVENTS`), or whose step numbers do not follow
    on, is the failure's; otherwise its ``stall_s`` growth is the
    checkpoint's, and the rest is the aftermath's when it starts within ``after_s`` of the last
    ``resumed``, else other. What precedes the first step beyond one ``iter_s`` counts as other,
    so the parts add up to ``window_s - useful_iters * iter_s`` exactly. ``metrics``: the same
    window's :func:`window_metrics` at the same ``iter_s``, when the caller has built it already
    (else built here). Pure."""
    if not window:
        raise ValueError("empty training window: nothing to split")
    if not (iter_s > 0):
        raise ValueError(f"iter_s must be positive seconds, got {iter_s!r}")
    if metrics is None:
        m = metrics_from_log(list(window), iter_s=iter_s)
    elif metrics.iter_s != iter_s:
        raise ValueError(f"metrics were measured against iter_s={metrics.iter_s!r}, not {iter_s!r}")
    else:
        m = metrics
    failures = after = stalls = 0.0
    prev = None
    failed = False
    resumed_t = None
    for r in window:
        ev = r["event"]
        if ev in _RECOVERY_EVENTS:
            failed = True
            if ev == "resumed":
                resumed_t = r["t"]
        elif ev == "step":
            if prev is not None:
                loss = (r["t"] - prev["t"]) - (r["step"] - prev["step"]) * iter_s
                if failed or r["step"] != prev["step"] + 1:
                    failures += loss
                else:
                    stall = max(0.0, float(r.get("stall_s") or 0.0) - float(prev.get("stall_s") or 0.0))
                    stalls += stall
                    if resumed_t is not None and prev["t"] - resumed_t < after_s:
                        after += loss - stall   # else the rest is other's (computed as the remainder)
            prev, failed = r, False
    other = (m.wall_s - m.useful_iters * iter_s) - failures - after - stalls
    return TimeLost(window_s=m.wall_s, useful_iters=m.useful_iters, iter_s=iter_s, failures_s=failures,
                    after_failures_s=after, checkpoint_stalls_s=stalls, other_s=other)


def step_gaps(records: Sequence[dict]) -> list[float]:
    """Seconds between consecutive steps (``n`` then ``n+1``) of one attempt (no failure between)."""
    return [b - a for a, b in step_gap_spans(records)]


def iteration_time(records: Sequence[dict]) -> float:
    """Median step gap: a checkpoint-free iteration, when most steps do not checkpoint."""
    gaps = step_gaps(records)
    if not gaps:
        raise ValueError("no two consecutive steps in the log: cannot measure the iteration time")
    return statistics.median(gaps)


def reported_k(records: Sequence[dict]) -> int | None:
    """The ``k`` the policy reported most often over the run's steps (None if it never did)."""
    ks = Counter(r["k"] for r in records if r["event"] == "step" and isinstance(r.get("k"), int))
    return ks.most_common(1)[0][0] if ks else None


def k_at(records: Sequence[dict], times_s: Sequence[float]) -> list[int | None]:
    """The ``k`` in force at each of ``times_s`` (seconds from the first record): the last step's."""
    t0 = records[0]["t"]
    steps = [(r["t"] - t0, r.get("k")) for r in records if r["event"] == "step"]
    out = []
    for t in times_s:
        before = [k for ts, k in steps if ts <= t + 1e-9]
        out.append(before[-1] if before and isinstance(before[-1], int) else None)
    return out


@dataclass(frozen=True, kw_only=True)
class CostSample:
    """What :func:`measure_costs` pooled, for the report (counts and totals)."""

    gaps: int
    """Step gaps measured (within attempts)."""
    checkpoints: int
    """Commits seen (one per checkpointed step execution)."""
    excess_s: float
    """Seconds the gaps during checkpoints (from a checkpointed step to its commit) took beyond
    ``iter_s`` each: what checkpointing cost training."""
    recoveries: int
    """Clean interruptions (one failure, resumed) whose detect/restart/restore are in the means."""


def measure_costs(windows: Sequence[list[dict]], metrics: Sequence[RunMetrics], *,
                  fallback: Costs | None = None) -> tuple[Costs, CostSample]:
    """Simulator costs from training windows and their metrics (one run, or pooled over several).

    - ``iter_s``: the mean of the step gaps outside checkpoints; the median of all gaps when
      every gap is inside one. A gap is inside a checkpoint when it ends at a checkpointed step
      (``ckpt.step()`` takes the snapshot before the step is recorded: the gap carries the
      snapshot) or starts between a checkpointed step and that checkpoint's commit (the gate
      waits for the snapshot copy; the persist competes for the cores). Counted in ``iter_s``,
      the snapshot's share would be charged per step instead of per checkpoint: a plan
      calibrated at ``every:20`` would under-price ``every:5``'s checkpoints and over-price its
      steps. The mean, not the median: the slow iterations of a shared
      machine are time the run spent, and the simulator must spend it too;
    - ``stall_s`` (To): the excess over ``iter_s`` of the gaps inside checkpoints, per
      checkpoint (it carries the stall and the contention a persist causes on shared cores,
      which a stall-only measure would miss). Measured where the checkpoints are, not as all
      gaps' excess spread over the checkpoints: a run with one or two checkpoints (an epoch
      policy) would otherwise charge each with the whole run's noise (seconds where the
      checkpoint cost a tenth), and the simulator would decide that a notice's emergency
      checkpoint cannot fit;
    - ``persist_s``: the median step-to-commit latency (``snapshot_s`` is 0; only the sum matters
      to the simulator);
    - ``detect_s``, ``restart_s``, ``restore_s``: means over the *clean* interruptions (one
      failure that resumed). A failure during a recovery stretches that recovery's phases; the
      simulator replays such overlaps itself, so it needs the phases of an undisturbed recovery.
      ``restart_s`` and ``detect_s`` are the crashes', ``preempt_restart_s`` and
      ``notice_detect_s`` the preemptions' (a lost node's replacement first fetches the
      checkpoint from a peer; the controller notices a lost node by itself, notice or not); each
      falls back on the other.
      ``scratch_restore_s`` is the mean over the recoveries that found no checkpoint (restored
      step 0: the group starts from scratch, and its first step pays the model's and the data
      pipeline's set-up), ``restore_s`` over the others (measured: 2.2 s against 0.1 s on this
      test machine); each falls back on the other.

    ``fallback`` supplies what these runs could not measure (no checkpoint, no clean recovery).
    """
    if not windows:
        raise ValueError("no runs to measure costs from")
    inside, outside, lat = [], [], []
    for w in windows:
        commits = commit_spans(w)
        lat += [c - s for s, c in commits]
        taken = {s for s, _ in commits}   # the step records of checkpointed steps
        for a, b in step_gap_spans(w):
            (inside if b in taken or any(s <= a < c for s, c in commits) else outside).append(b - a)
    if not inside and not outside:
        raise ValueError("no consecutive steps in any run: cannot measure the iteration time")
    iter_s = statistics.fmean(outside) if outside else statistics.median(inside)
    gaps = inside + outside
    excess = max(0.0, sum(inside) - len(inside) * iter_s)
    clean = [f for m in metrics for f in m.failures if f.events == 1 and (f.caught_up or f.catchup_s > 0)]

    def pick(values, name):
        if values:
            return values
        return [getattr(fallback, name)] if fallback is not None else [0.0]

    persist = statistics.median(pick(lat, "persist_s"))
    stall = max(0.0, excess / len(lat)) if lat else (fallback.stall_s if fallback is not None else 0.0)
    def by_kind(phase: str, kind: str) -> list[float]:
        return [f.phase_s(phase) for f in clean if f.kind == kind]

    def split(phase: str, fb_crash: str, fb_preempt: str) -> tuple[float, float | None]:
        crash, preempt = by_kind(phase, "crash"), by_kind(phase, "preempt")
        c = statistics.fmean(crash or pick(preempt, fb_crash))
        fb = getattr(fallback, fb_preempt) if fallback is not None else None
        p = statistics.fmean(preempt) if preempt else (fb if fb is not None else c)
        return c, p

    detect, notice_detect = split("detect", "detect_s", "notice_detect_s")
    restart, preempt_restart = split("restart", "restart_s", "preempt_restart_s")
    restore, scratch = _restores(clean, fallback)
    costs = Costs(iter_s=iter_s, stall_s=stall, snapshot_s=0.0, persist_s=persist, detect_s=detect,
                  notice_detect_s=notice_detect, restart_s=restart, preempt_restart_s=preempt_restart,
                  restore_s=restore, scratch_restore_s=scratch)
    return costs, CostSample(gaps=len(gaps), checkpoints=len(lat), excess_s=excess, recoveries=len(clean))


def _restores(clean: Sequence, fallback: Costs | None) -> tuple[float, float]:
    """``(restore_s, scratch_restore_s)``: the means over the clean recoveries that restored a
    checkpoint and over those that started from scratch. A kind these runs did not measure
    comes from ``fallback`` (the pooled runs), else from the other kind."""
    ckpt = [f.restore_s for f in clean if f.restored_step > 0]
    scratch = [f.restore_s for f in clean if f.restored_step == 0]
    if ckpt:
        restore = statistics.fmean(ckpt)
    elif fallback is not None:
        restore = fallback.restore_s
    else:
        restore = statistics.fmean(scratch) if scratch else 0.0
    if scratch:
        return restore, statistics.fmean(scratch)
    fb = fallback.scratch_restore_s if fallback is not None else None
    return restore, (fb if fb is not None else restore)


def window_metrics(window: list[dict], *, iter_s: float, label: str) -> RunMetrics:
    """:class:`RunMetrics` of a training window, goodput measured against ``iter_s``."""
    return metrics_from_log(window, iter_s=iter_s, label=label)


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The simulator's run of one policy over a real run's window, next to the measurement."""

    sim: SimResult
    """The simulated run (its ``goodput`` uses the costs' ``iter_s``)."""
    goodput: float
    """Predicted goodput against the same yardstick as the measured one."""
    measured: float
    """Measured goodput."""

    @property
    def relative_error(self) -> float:
        """``predicted / measured - 1`` (+0.10: the simulator is 10% optimistic)."""
        return self.goodput / self.measured - 1.0 if self.measured > 0 else math.inf


def predict(events: Sequence[FailureEvent], policy: SimPolicy, *, costs: Costs, nodes: int,
            workers_per_node: int, measured: RunMetrics, label: str, live: bool = False) -> Prediction:
    """Simulate ``policy`` under ``events`` over ``measured``'s window; goodput on its yardstick.

    ``events`` are the schedule's (times from the injector's time 0, as in the window); ``live``:
    the run recovered from its survivors' live state (:func:`~cfdist.chaos.simulator.simulate`).
    """
    horizon = measured.wall_s
    if not horizon > 0:
        raise ValueError(f"run {measured.label!r} has an empty training window ({horizon}s)")
    sim = simulate(list(events), policy, costs=costs, nodes=nodes, horizon_s=horizon,
                   workers_per_node=workers_per_node, label=label, live=live)
    goodput = sim.useful_iters * measured.iter_s / horizon
    return Prediction(sim=sim, goodput=goodput, measured=measured.goodput)
