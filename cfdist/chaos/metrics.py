"""Goodput, wasted worker-seconds, lost work and recovery time of a run, from its event log.

The same result type, :class:`RunMetrics`, comes out of a real run (:func:`metrics_from_log`)
and out of the simulator (:class:`cfdist.chaos.simulator.SimResult` extends it), so plots and
tables treat both alike.

Event log (JSONL)
-----------------
The driver (``cfdist.fit``) appends one JSON object per line, in the order things happen, as the
driver sees them (rank 0's steps). Every record has ``"t"`` (wall seconds, any fixed origin:
``time.time()`` is fine; only differences are used, and they must not decrease) and ``"event"``.
Records with an unknown ``"event"`` are ignored, so the log can grow.

=========================  =======================================  ===========================
event                      other keys (required / *optional*)       meaning
=========================  =======================================  ===========================
``start``                  *world_size*, *nodes*                    the job starts (first line)
``step``                   step                                     optimizer step ``step``
                                                                    (1-based) finished
``checkpoint_committed``   step, *tier*                             step's checkpoint is
                                                                    committed (loadable)
``failure``                kind (``crash``/``preempt``), step,      the job was interrupted;
                           *node*, *rank*, *notice_s*               ``step``: last step finished
``detected``                                                        the controller noticed it
``nodes_ready``                                                     enough nodes are up again
``restarted``              *world_size*                             worker group is up again
``restored``               step, tier (``memory``/``local``/        state of ``step`` loaded
                           ``shared``/``none``)                     (0 and ``none``: scratch)
``end``                    step                                     the job ends
=========================  =======================================  ===========================

Example::

    {"t": 0.0, "event": "start", "world_size": 8, "nodes": 2}
    {"t": 0.2, "event": "step", "step": 1}
    {"t": 2.1, "event": "step", "step": 10}
    {"t": 2.6, "event": "checkpoint_committed", "step": 10, "tier": "local"}
    {"t": 3.0, "event": "failure", "kind": "preempt", "step": 14, "node": 1}
    {"t": 4.0, "event": "detected"}
    {"t": 9.0, "event": "nodes_ready"}
    {"t": 12.0, "event": "restarted", "world_size": 8}
    {"t": 13.0, "event": "restored", "step": 10, "tier": "local"}
    {"t": 13.8, "event": "step", "step": 14}
    {"t": 20.0, "event": "end", "step": 45}

How records become numbers: a failure that arrives before the previous one's ``restored`` is
part of the same interruption (its ``events`` count grows). An interruption's recovery is split
at its last ``detected``, ``nodes_ready``, ``restarted`` and ``restored`` into detect, wait,
restart and restore (a missing mark makes its phase 0 and its time go to the next phase);
catch-up runs from ``restored`` until the first ``step`` >= the step at failure.

Lost work is defined here and nowhere else (:func:`lost_iterations`): the steps completed after
the restored checkpoint and before the failure, i.e. the work that must be redone (a crash at
step 93 restored from 90 loses 3; a crash during a restart, before the new group finished a
step, loses 0: its ``step`` is the restored one). A failure during a recovery joins that
interruption, so work is counted once. ``resume_s`` (``cfdist.FitResult.recovery_seconds``) is
the failure until the first ``step`` completed after the restore.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Collection, Iterable
from dataclasses import dataclass

PHASES: tuple[str, ...] = ("detect", "wait", "restart", "restore", "catchup")
"""Recovery phases in order: notice the failure, wait for nodes, restart workers, load the
checkpoint, redo the lost iterations."""

_REQUIRED: dict[str, tuple[str, ...]] = {
    "start": (),
    "step": ("step",),
    "checkpoint_committed": ("step",),
    "failure": ("kind", "step"),
    "detected": (),
    "nodes_ready": (),
    "restarted": (),
    "restored": ("step", "tier"),
    "end": ("step",),
}
_MARKS = ("detected", "nodes_ready", "restarted", "restored")


def lost_iterations(step: int, restored_step: int) -> int:
    """Iterations to redo after a failure: steps completed after ``restored_step`` and up to
    ``step`` (the last step completed before the failure). 0 when the restored step is as new
    (a failure before the new group finished a step) or newer (a step completed while the
    failure was being logged)."""
    return max(0, step - restored_step)


@dataclass(frozen=True, kw_only=True)
class FailureRecord:
    """One interruption of the job and its recovery (seconds are wall seconds)."""

    time_s: float
    """When the job was interrupted, seconds from the run's start."""
    kind: str
    """``"crash"`` or ``"preempt"`` (``"crash"`` if any merged event was a crash)."""
    step: int
    """Steps finished when it was interrupted."""
    restored_step: int
    """Step training resumed from (0: from scratch)."""
    detect_s: float = 0.0
    """Failure until the controller noticed it."""
    wait_s: float = 0.0
    """Noticed until enough nodes were up."""
    restart_s: float = 0.0
    """Nodes up until the worker group was running again."""
    restore_s: float = 0.0
    """Workers up until the checkpoint was loaded."""
    catchup_s: float = 0.0
    """Loaded until progress was back at ``step`` (or the next failure / end of run)."""
    caught_up: bool = True
    """False when the next failure or the end of the run came before catch-up finished."""
    events: int = 1
    """Failure events merged into this interruption (several nodes lost at once, or during recovery)."""
    tier: str | None = None
    """Where the restored checkpoint came from (the ``restored`` record's tier; None: not logged)."""
    world_size: int | None = None
    """Ranks of the group that resumed (the last ``restarted`` record's; None: not logged)."""
    resume_s: float | None = None
    """Failure until the first step completed after the restore (None: it never resumed)."""

    @property
    def lost_iters(self) -> int:
        """Iterations redone because of this interruption (:func:`lost_iterations`)."""
        return lost_iterations(self.step, self.restored_step)

    @property
    def recovery_s(self) -> float:
        """Interruption until progress is back where it was: the sum of the phases."""
        return self.detect_s + self.wait_s + self.restart_s + self.restore_s + self.catchup_s

    def phase_s(self, phase: str) -> float:
        """Duration of one of :data:`PHASES`."""
        return getattr(self, f"{phase}_s")


@dataclass(frozen=True, kw_only=True)
class RunMetrics:
    """What a run achieved and what failures cost it."""

    label: str
    """Name of the run or policy, for tables and legends."""
    wall_s: float
    """Wall seconds from start to end."""
    iter_s: float
    """Failure-free, checkpoint-free seconds per iteration (the yardstick of goodput)."""
    workers: int
    """Ranks of the full job."""
    useful_iters: int
    """Training progress at the end (steps)."""
    failures: tuple[FailureRecord, ...] = ()
    """Interruptions, in order."""
    progress: tuple[tuple[float, int], ...] = ()
    """``(seconds from start, step)`` at each change of course (piecewise linear between)."""
    worker_s: float | None = None
    """Worker-seconds held (None: ``wall_s * workers``, the job always held all its workers)."""

    @property
    def goodput(self) -> float:
        """Useful iterations per wall second relative to a failure-free, checkpoint-free run."""
        return self.useful_iters * self.iter_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def wasted_worker_s(self) -> float:
        """Worker-seconds held but not spent on iterations that count."""
        held = self.wall_s * self.workers if self.worker_s is None else self.worker_s
        return held - self.useful_iters * self.iter_s * self.workers

    @property
    def num_failures(self) -> int:
        """Number of interruptions."""
        return len(self.failures)

    @property
    def lost_iters(self) -> list[int]:
        """Iterations lost per interruption."""
        return [f.lost_iters for f in self.failures]

    @property
    def lost_iters_mean(self) -> float:
        """Mean iterations lost per interruption (0 without failures)."""
        return statistics.fmean(self.lost_iters) if self.failures else 0.0

    @property
    def lost_iters_max(self) -> int:
        """Most iterations lost in one interruption (0 without failures)."""
        return max(self.lost_iters, default=0)

    def lost_by_kind(self) -> list[dict]:
        """Lost work per interruption by what failed and where the run resumed from: one row per
        ``(kind, tier)`` (``tier``: the restore's source, e.g. ``memory``/``peer`` for the
        survivors' live state, ``local``/``shared`` when no replica survived), with
        ``failures``, ``lost_iters_mean`` and ``lost_iters_max``; in order of first occurrence."""
        rows: dict[tuple, list[int]] = {}
        for f in self.failures:
            rows.setdefault((f.kind, f.tier), []).append(f.lost_iters)
        return [{"kind": k, "tier": t, "failures": len(v), "lost_iters_mean": statistics.fmean(v),
                 "lost_iters_max": max(v)} for (k, t), v in rows.items()]

    @property
    def recovery_s_mean(self) -> float:
        """Mean recovery time per interruption (0 without failures)."""
        return statistics.fmean(f.recovery_s for f in self.failures) if self.failures else 0.0

    def phase_means(self) -> dict[str, float]:
        """Mean seconds per interruption spent in each of :data:`PHASES`."""
        n = max(1, len(self.failures))
        return {p: sum(f.phase_s(p) for f in self.failures) / n for p in PHASES}


def parse_event_log(lines: Iterable[str], *, source: str = "<log>") -> list[dict]:
    """Records of a JSONL event log, checked against the schema in this module's docstring.

    Blank lines are skipped; unknown events pass through unchecked. Raises ValueError naming the
    line and the missing or wrong key.
    """
    out: list[dict] = []
    last_t = -math.inf
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e}): {line.strip()[:80]!r}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
            raise ValueError(f'{where}: a record must be an object with a string "event", got {line.strip()[:80]!r}')
        t = rec.get("t")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
            raise ValueError(f'{where}: "t" must be wall seconds (a number), got {t!r}')
        if t < last_t:
            raise ValueError(f"{where}: t={t} is earlier than the previous record's {last_t}; write records in order")
        last_t = t
        for key in _REQUIRED.get(rec["event"], ()):
            if key not in rec:
                raise ValueError(f"{where}: a {rec['event']!r} record needs {key!r}: {line.strip()[:80]!r}")
        known = rec["event"] in _REQUIRED  # unknown events (decision, notice, ...) are not checked
        if known and "step" in rec and (not isinstance(rec["step"], int) or isinstance(rec["step"], bool)
                                        or rec["step"] < 0):
            raise ValueError(f'{where}: "step" must be an int >= 0, got {rec["step"]!r}')
        if rec["event"] == "failure" and rec["kind"] not in ("crash", "preempt"):
            raise ValueError(f"{where}: failure kind must be 'crash' or 'preempt', got {rec['kind']!r}")
        out.append(rec)
    return out


def read_event_log(path: str) -> list[dict]:
    """Records of the JSONL event log at ``path`` (see :func:`parse_event_log`)."""
    with open(path, encoding="utf-8") as f:
        return parse_event_log(f, source=path)


def commit_spans(records: Iterable[dict], tiers: Collection[str] | None = None) -> list[tuple[float, float]]:
    """``(t of the step record, t of its first checkpoint_committed)`` per commit, in log order.

    A step executed again after a restore counts again (measured from its new ``step`` record).
    Commits of steps without a ``step`` record (e.g. before the log started) are skipped, and so
    are a survivor's live saves after a failure (``live``: not a checkpoint the policy took).
    ``tiers``: only commits to these tiers count (None: any tier).
    """
    step_t: dict[int, float] = {}
    done: set[tuple[int, float]] = set()
    out: list[tuple[float, float]] = []
    for r in records:
        if r.get("event") == "step":
            step_t[r["step"]] = r["t"]
        elif r.get("event") == "checkpoint_committed" and r.get("step") in step_t and not r.get("live") \
                and (tiers is None or r.get("tier") in tiers):
            key = (r["step"], step_t[r["step"]])
            if key not in done:
                done.add(key)
                out.append((key[1], max(key[1], r["t"])))
    return out


def commit_latencies(records: Iterable[dict], tiers: Collection[str] | None = None) -> list[float]:
    """Seconds from each step's ``step`` record to its first ``checkpoint_committed`` (on one
    of ``tiers``; None: any), in log order (see :func:`commit_spans`)."""
    return [c - s for s, c in commit_spans(records, tiers)]


RESTART_PHASES: tuple[str, ...] = ("detect", "restart", "rendezvous", "restore", "first_step")
"""The phases of one recovery as ``cfdist.fit`` logs them (see :func:`recovery_phases`)."""


def recovery_phases(records: Iterable[dict]) -> list[dict]:
    """Seconds per phase of every recovery that resumed, from a ``cfdist.fit`` event log. Pure.

    For each ``failure`` followed (before any other failure) by ``detected``, ``restarted``,
    ``restored`` and ``resumed``: ``detect`` (failure to detected), ``restart`` (detected to
    restarted, of which ``spare_wait`` waiting for warm spares still starting, ``spawn``
    starting or taking processes and ``rendezvous`` the process group, from the ``restarted``
    record), ``restore`` (restarted to restored, of which
    ``setup``: the training function until its ``ckpt.restore()``, and ``load``), ``first_step``
    (restored to the first step completed) and ``total`` (failure to that step); plus ``tier``,
    ``kind``, ``reused`` (warm spares in the new group) and ``recycled`` (of those, ranks of the
    failed group re-formed in process). A failure during a recovery
    discards that recovery (it has no clean phases).
    """
    out: list[dict] = []
    cur: dict | None = None
    for r in records:
        ev = r.get("event")
        if ev == "failure":
            cur = {"kind": r.get("kind"), "t": r["t"]}
        elif cur is None:
            continue
        elif ev in ("detected", "restarted", "restored") and ev not in cur:
            cur[ev] = r
        elif ev == "resumed" and {"detected", "restarted", "restored"} <= cur.keys():
            d, s_, rs = cur["detected"], cur["restarted"], cur["restored"]
            out.append({
                "kind": cur["kind"], "tier": rs.get("tier"), "reused": s_.get("reused"),
                "recycled": s_.get("recycled"),
                "detect": d["t"] - cur["t"], "restart": s_["t"] - d["t"], "spare_wait": s_.get("spare_wait_s"),
                "spawn": s_.get("spawn_s"),
                "rendezvous": s_.get("rendezvous_s"), "restore": rs["t"] - s_["t"], "setup": rs.get("setup_s"),
                "load": rs.get("load_s"), "first_step": r["t"] - rs["t"], "total": r["t"] - cur["t"]})
            cur = None
    return out


def estimate_iter_s(records: list[dict]) -> float:
    """Median seconds between consecutive ``step`` records one step apart."""
    steps = [r for r in records if r["event"] == "step"]
    gaps = [b["t"] - a["t"] for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1]
    if not gaps:
        raise ValueError("cannot estimate the iteration time: no two step records one step apart; pass iter_s")
    return statistics.median(gaps)


class _Open:
    """An interruption being assembled from records."""

    def __init__(self, t: float, kind: str, step: int) -> None:
        self.t, self.kind, self.step, self.events = t, kind, step, 1
        self.marks: dict[str, float] = {}
        self.restored_step = 0
        self.resume_t = math.nan
        self.first_step_t = math.nan
        self.tier: str | None = None
        self.world_size: int | None = None

    def catchup_s(self, t: float) -> float:
        """Catch-up until ``t`` (0 when nothing was lost)."""
        return 0.0 if self.restored_step >= self.step else t - self.resume_t

    def record(self, *, catchup_s: float, caught_up: bool, end_t: float | None = None) -> FailureRecord:
        points, prev = [], self.t
        for m in _MARKS:
            prev = max(prev, self.marks.get(m, prev))
            points.append(prev)
        if end_t is not None:  # never restored: the phase after the last mark lasts until the end
            after = 1 + max((i for i, m in enumerate(_MARKS) if m in self.marks), default=-1)
            points[after:] = [end_t] * (len(points) - after)
        durations = [b - a for a, b in zip([self.t] + points, points)]
        return FailureRecord(
            time_s=self.t, kind=self.kind, step=self.step, restored_step=self.restored_step,
            detect_s=durations[0], wait_s=durations[1], restart_s=durations[2], restore_s=durations[3],
            catchup_s=catchup_s, caught_up=caught_up, events=self.events, tier=self.tier,
            world_size=self.world_size,
            resume_s=None if math.isnan(self.first_step_t) else self.first_step_t - self.t,
        )


def metrics_from_log(
    records: list[dict], *, iter_s: float | None = None, workers: int | None = None, label: str = "run"
) -> RunMetrics:
    """:class:`RunMetrics` of a run from its event-log records (rules in the module docstring).

    ``iter_s``: failure-free seconds per iteration (default: :func:`estimate_iter_s`, which
    includes checkpoint stalls only when they are a majority of steps). ``workers``: default the
    ``start`` record's ``world_size``, else 1.
    """
    if not records:
        raise ValueError("empty event log: nothing to measure")
    t0 = records[0]["t"]
    iter_s = estimate_iter_s(records) if iter_s is None else iter_s
    if workers is None:
        workers = next((r["world_size"] for r in records if r["event"] == "start" and "world_size" in r), 1)
    step, committed = 0, 0
    progress: list[tuple[float, int]] = [(0.0, 0)]
    done: list[FailureRecord] = []
    open_: _Open | None = None
    catching: _Open | None = None
    for r in records:
        ev, t = r["event"], r["t"] - t0
        if ev == "step" and open_ is None:
            step = r["step"]
            progress.append((t, step))
            if catching is not None and math.isnan(catching.first_step_t):
                catching.first_step_t = t
            if catching is not None and step >= catching.step:
                done.append(catching.record(catchup_s=catching.catchup_s(t), caught_up=True))
                catching = None
        elif ev == "checkpoint_committed":
            committed = max(committed, r["step"]) if open_ is None else committed
        elif ev == "failure":
            if open_ is not None:
                open_.events += 1
                if r["kind"] == "crash":
                    open_.kind = "crash"
                continue
            if catching is not None:
                done.append(catching.record(catchup_s=catching.catchup_s(t),
                                            caught_up=catching.restored_step >= catching.step))
                catching = None
            open_ = _Open(t, r["kind"], r["step"])
            open_.restored_step = committed
            progress.append((t, r["step"]))
        elif ev in _MARKS and open_ is not None:
            open_.marks[ev] = t
            if ev == "restarted" and "world_size" in r:
                open_.world_size = r["world_size"]
            if ev == "restored":
                open_.restored_step = step = committed = r["step"]
                open_.resume_t = t
                open_.tier = r.get("tier")
                progress += [(open_.t, step), (t, step)]
                catching, open_ = open_, None   # recorded at its first step (resume_s) / catch-up
        elif ev == "end":
            if open_ is not None and not open_.marks and "error" not in r and r.get("step", -1) >= open_.step:
                # the failure came as the group finished its last step (a node taken after its
                # ranks returned): nothing detected, nothing rolled back, the run's end stands
                open_.restored_step = open_.step
                done.append(open_.record(catchup_s=0.0, caught_up=True, end_t=t))
                open_ = None
            step = r["step"] if open_ is None else step
    t_end = records[-1]["t"] - t0
    if catching is not None:
        done.append(catching.record(catchup_s=catching.catchup_s(t_end),
                                    caught_up=catching.restored_step >= catching.step))
    if open_ is not None:
        done.append(open_.record(catchup_s=0.0, caught_up=False, end_t=t_end))
        step = open_.restored_step
        progress.append((open_.t, step))
    progress.append((t_end, step))
    return RunMetrics(
        label=label, wall_s=t_end, iter_s=iter_s, workers=workers, useful_iters=step,
        failures=tuple(done), progress=tuple(progress),
    )


def event_log_from_metrics(m: RunMetrics, *, tier: str = "local") -> list[dict]:
    """A schema-conforming event log that :func:`metrics_from_log` maps back to ``m``'s numbers.

    For tests, for plotting simulated runs like real ones, and as a reference for emitters: it
    shows which records a driver writes around a failure. Only the steps that matter are
    written (at each failure and at the end of each catch-up); a real log has one per step.
    """
    recs: list[dict] = [{"t": 0.0, "event": "start", "world_size": m.workers}]
    for f in m.failures:
        recs.append({"t": f.time_s, "event": "step", "step": f.step})
        recs.append({"t": f.time_s, "event": "checkpoint_committed", "step": f.restored_step, "tier": tier})
        recs += [{"t": f.time_s, "event": "failure", "kind": f.kind, "step": f.step}] * f.events
        recovered = f.caught_up or f.catchup_s > 0
        durations = [f.phase_s(p) for p in PHASES[:-1]]
        if not recovered:  # marks only for the phases that finished before the run ended
            durations = durations[: max((i for i, d in enumerate(durations) if d > 0), default=0)]
        mark = f.time_s
        for ev, d in zip(_MARKS, durations):
            mark += d
            rec = {"t": mark, "event": ev}
            if ev == "restored":
                rec.update(step=f.restored_step, tier=tier if f.restored_step else "none")
            recs.append(rec)
        if f.caught_up and f.lost_iters > 0:
            recs.append({"t": mark + f.catchup_s, "event": "step", "step": f.step})
    recs.append({"t": m.wall_s, "event": "step", "step": m.useful_iters})
    recs.append({"t": m.wall_s, "event": "end", "step": m.useful_iters})
    return recs
