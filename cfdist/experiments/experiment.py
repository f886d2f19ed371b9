"""Preemption experiments: the same job under the same failure schedule, once per checkpoint policy.

::

    cfdist experiment --out cfdist-runs/experiment            # or: python -m cfdist.experiments.experiment

    from cfdist.experiments.experiment import ExperimentConfig, run_experiment
    res = run_experiment(ExperimentConfig(out_dir="cfdist-runs/exp", mtbf_s=8.0))
    print(res.run("auto").measured.goodput, res.run("auto").prediction.relative_error)

For each policy (default: the epoch-boundary baseline ``EveryEpoch``, ``Every(10)``, ``Auto`` and
the failure-aware ``Auto(mtbf_s=...)``) the small job of :mod:`cfdist.experiments.workload` runs under
``cfdist.fit`` on Ray while the failure injector executes the schedule (rank crashes, node
preemptions with notice and their return), after one failure-free run that sets goodput's
yardstick. Each run's event log is then measured (:mod:`cfdist.chaos.metrics`), the simulator is
given the costs measured over all runs and replays every policy under the same schedule
(:mod:`cfdist.chaos.calibrate`), and :mod:`cfdist.chaos.report` writes ``results.json``,
``results.md`` and PNG figures (progress vs wall time with failures marked, goodput measured vs
simulated, lost work per failure, recovery time by phase).

One run of a policy sees one or two failures with the defaults, so its goodput moves by a few
hundredths from one run to the next on a shared machine. ``--repeat N``
(:func:`run_repeated`) runs the whole experiment N times, each repetition into its own
``repeat-<i>`` directory against its own failure-free run, and writes ``repeats.md`` and
``repeats.json``: each policy's goodput median and range, and the failures of every repetition
pooled.

Without ``ray_address`` (and with no Ray initialised in the process) the runs use a fake
``num_nodes``-node cluster on this machine (:class:`~cfdist.cluster.local_cluster.LocalCluster`),
started once for all runs. The schedule's clock starts when a run's first worker group has
trained its first step.

This module is an entry point: it imports :func:`cfdist.fit` (and so Ray) lazily, inside
:func:`run_experiment`; its pure parts live in :mod:`~cfdist.chaos.calibrate` and
:mod:`~cfdist.chaos.report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Callable, Literal

from cfdist.chaos.calibrate import (
    iteration_time, k_at, measure_costs, predict, reported_k, time_lost, training_window, window_metrics,
)
from cfdist.chaos.events import FailureEvent
from cfdist.chaos.metrics import read_event_log
from cfdist.chaos.report import (
    ExperimentResult, PolicyRun, baseline_goodputs, baseline_time_lost, ideal_iterations, repeat_lines, repeated,
    summary_lines,
    write_repeats, write_report,
)
from cfdist.chaos.schedules import Exponential, FixedInterval, Merged
from cfdist.chaos.simulator import EpochBoundary, FixedK, SimPolicy

_POLICY = re.compile(r"^(epoch|auto|every:[1-9][0-9]*|auto-mtbf(:[0-9]+(\.[0-9]+)?)?)$")
DEFAULT_POLICIES = ("epoch", "every:10", "auto", "auto-mtbf")


class ExperimentError(RuntimeError):
    """A run of the experiment did not finish (the message says which, why, and what to change)."""


def _number(name: str, v, *, minimum: float = 0.0, strict: bool = True, hint: str = "") -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (
        v > minimum if strict else v >= minimum)
    if not ok:
        raise ValueError(f"ExperimentConfig.{name} must be a finite number {'>' if strict else '>='} {minimum:g}"
                         f"{hint}, got {v!r}")


def _int(name: str, v, *, minimum: int = 1, hint: str = "") -> None:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= minimum):
        raise ValueError(f"ExperimentConfig.{name} must be an int >= {minimum}{hint}, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """One preemption experiment: the job, the failure schedule, the policies, where results go."""

    out_dir: str = os.path.join("cfdist-runs", "experiment")
    """Directory for results.json, results.md, the PNGs, the runs' event logs and checkpoints."""
    policies: tuple[str, ...] = DEFAULT_POLICIES
    """Policies to compare, in order: ``"epoch"`` (``EveryEpoch``), ``"every:K"`` (``Every(K)``),
    ``"auto"`` (``Auto``), ``"auto-mtbf"`` (``Auto(mtbf_s=<this config's mtbf_s>)``) or
    ``"auto-mtbf:S"`` (``Auto(mtbf_s=S)``)."""
    steps: int = 500
    """Optimizer steps each run trains (its end)."""
    epoch_steps: int = 250
    """Optimizer steps per epoch (the dataset is sized to it): the epoch baseline's interval. The
    default, half a run, makes an epoch about as long as the time between failures, as real
    epochs (hours) compare with spot VMs' lifetimes."""
    step_s: float = 0.04
    """Sleep per step, standing in for a bigger model's compute (seconds)."""
    state_mb: float = 16.0
    """Extra checkpointed state per rank, MiB (a buffer in the model): makes checkpoints cost."""
    batch_size: int = 8
    """Samples per rank per step."""
    num_nodes: int = 2
    """Nodes of the job (fixed size: a lost node's return is waited for, as in the simulator)."""
    workers_per_node: int = 1
    """Ranks per node (each needs one CPU of its node)."""
    mtbf_s: float = 10.0
    """Mean seconds between failures of the job (the schedule's; ``auto-mtbf`` is told it). Keep
    it well above a recovery (restart + restore: 3-7 s on a laptop), or most failures hit a
    recovery and every policy crawls."""
    schedule: Literal["fixed", "exponential", "trace"] = "fixed"
    """Gaps between failures: exactly ``mtbf_s`` (a run of a few dozen seconds then sees a few
    failures, whatever the seed), exponential with mean ``mtbf_s``, or the preemptions of
    ``trace`` (time-compressed by ``time_scale``; ``failures`` must then be ``"preempt"``)."""
    trace: str | None = None
    """With ``schedule="trace"``: a bundled trace's name (``bamboo-p3-trace.csv``) or a trace
    file in any format ``cfdist plan`` reads; seed ``i`` starts ``i/8`` of the way through it
    (:class:`cfdist.planner.failures.TraceFailures`), with every node up."""
    time_scale: float = 1.0
    """With a trace: schedule seconds per trace second (1/240: four trace minutes become a
    second). ``notice_s`` stays in schedule seconds."""
    failures: Literal["mixed", "crash", "preempt"] = "mixed"
    """What fails: rank crashes, node preemptions, or both (each at half the rate)."""
    notice_s: float = 1.0
    """Preemption notice in seconds (0: none); an emergency checkpoint is taken if it fits."""
    return_after_s: float = 0.0
    """Seconds until a preempted node's replacement is up (0: at once)."""
    max_scheduled: int | None = None
    """Only the first this many failures of the schedule (None: all). Every run then meets the
    same few failures at the same times, whatever its length: comparable runs at small scale."""
    seed: int = 0
    """Seed of the failure schedule (and of the data)."""
    overhead_budget: float = 0.035
    """``Auto``'s budget p: largest fraction of training time checkpointing may cost."""
    baseline: bool = True
    """Run the job once without failures first; its iteration time is goodput's yardstick
    (without it: the median step time of the policies' runs)."""
    baseline_steps: int | None = None
    """Steps of that failure-free run (None: ``steps``); a hundred measure the iteration time."""
    node_loss: Literal["drain", "remove"] = "drain"
    """How a preemption takes a node: ``"drain"`` kills its ranks and node actor and excludes the
    node until it returns (fast); ``"remove"`` stops the fake Ray node and starts a fresh one on
    return (local cluster only; Ray notices the lost node more slowly)."""
    ray_address: str | None = None
    """Ray cluster to run on (``ray job submit`` sets ``RAY_ADDRESS``); None: a local fake cluster."""
    max_failures: int = 40
    """Failures a run tolerates before it gives up (then the experiment stops with an error)."""
    progress: bool = False
    """Show ``cfdist.fit``'s progress bar during each run (the experiment prints one line per run anyway)."""
    keep_checkpoints: bool = False
    """Keep each run's checkpoint directories (default: deleted after the run; logs are kept)."""
    memory_every: int | None = None
    """``cfdist.fit(tiers=TierOptions(memory_every=...))`` for every policy's run: a memory snapshot every n steps
    (a crash loses at most n iterations), disk at the policy's interval. None: off."""
    live_recovery: bool = True
    """``cfdist.fit(recovery=RecoveryOptions(live_recovery=...))`` for every run: a failure that leaves a
    rank running restores the survivors' live state (the step in progress is lost), and the
    simulator models it; False: every failure rolls back to the newest commit."""

    def __post_init__(self) -> None:
        if not (isinstance(self.out_dir, str) and self.out_dir):
            raise ValueError(f"ExperimentConfig.out_dir must be a directory path, got {self.out_dir!r}")
        if not (isinstance(self.policies, tuple) and self.policies):
            raise ValueError(f"ExperimentConfig.policies must be a non-empty tuple such as {DEFAULT_POLICIES}, "
                             f"got {self.policies!r}")
        for p in self.policies:
            if not (isinstance(p, str) and _POLICY.match(p)):
                raise ValueError(f"ExperimentConfig.policies: {p!r} is not a policy; use 'epoch', 'every:K', "
                                 f"'auto', 'auto-mtbf' or 'auto-mtbf:SECONDS'")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"ExperimentConfig.policies lists a policy twice: {self.policies!r}")
        for name in ("steps", "epoch_steps", "batch_size", "num_nodes", "workers_per_node"):
            _int(name, getattr(self, name))
        _int("max_failures", self.max_failures, minimum=0)
        if self.memory_every is not None:
            _int("memory_every", self.memory_every, hint=" or None")
        if self.baseline_steps is not None:
            _int("baseline_steps", self.baseline_steps, minimum=3, hint=" or None for steps")
        if self.max_scheduled is not None:
            _int("max_scheduled", self.max_scheduled, hint=" or None for the whole schedule")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"ExperimentConfig.seed must be an int, got {self.seed!r}")
        _number("step_s", self.step_s, strict=False, hint=" seconds")
        _number("state_mb", self.state_mb, strict=False, hint=" MiB")
        _number("mtbf_s", self.mtbf_s, hint=" seconds (failures every few seconds suit a laptop)")
        _number("notice_s", self.notice_s, strict=False, hint=" seconds (0: no notice)")
        _number("return_after_s", self.return_after_s, strict=False, hint=" seconds")
        if not (isinstance(self.overhead_budget, (int, float)) and 0 < self.overhead_budget < 1):
            raise ValueError(f"ExperimentConfig.overhead_budget is a fraction in (0, 1), e.g. 0.035; "
                             f"got {self.overhead_budget!r}")
        if self.schedule == "trace":
            if not (isinstance(self.trace, str) and self.trace):
                raise ValueError("ExperimentConfig.schedule='trace' needs trace= (a bundled trace's name, e.g. "
                                 "'bamboo-p3-trace.csv', or a trace file)")
            if self.failures != "preempt":
                raise ValueError(f"ExperimentConfig.schedule='trace' replays preemptions: set failures='preempt' "
                                 f"(got {self.failures!r})")
        elif self.trace is not None:
            raise ValueError(f"ExperimentConfig.trace={self.trace!r} is used only with schedule='trace' "
                             f"(got schedule={self.schedule!r})")
        _number("time_scale", self.time_scale, hint=" (schedule seconds per trace second)")
        for name, allowed in (("schedule", ("fixed", "exponential", "trace")), ("failures", ("mixed", "crash", "preempt")),
                              ("node_loss", ("drain", "remove"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ExperimentConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.node_loss == "remove" and self.ray_address:
            raise ValueError("ExperimentConfig.node_loss='remove' stops fake nodes of the local cluster; "
                             "on a real cluster (ray_address set) use node_loss='drain'")
        if self.steps < self.epoch_steps and "epoch" in self.policies:
            raise ValueError(f"ExperimentConfig: steps={self.steps} is less than one epoch ({self.epoch_steps}): "
                             f"the epoch baseline would never checkpoint; raise steps or lower epoch_steps")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.workers_per_node


# ------------------------------------------------------------------------- pure helpers ---


def build_schedule(config: ExperimentConfig):
    """The failure schedule of ``config`` (a :mod:`cfdist.chaos` schedule). Pure."""
    def part(kind: str, gap: float, seed: int, first: float | None):
        extra = ({"notice_s": config.notice_s, "return_after_s": config.return_after_s} if kind == "preempt"
                 else {"ranks_per_node": config.workers_per_node})
        if config.schedule == "fixed":
            return FixedInterval(gap, first_s=first, kind=kind, seed=seed, **extra)
        return Exponential(gap, kind=kind, seed=seed, **extra)

    m = config.mtbf_s
    if config.schedule == "trace":
        sched = ScaledTrace.of(config)
    elif config.failures != "mixed":
        sched = part(config.failures, m, config.seed, None)
    else:
        # Two independent halves: exponential rates add up to 1/mtbf; fixed ones alternate every mtbf.
        sched = Merged((part("crash", 2 * m, 2 * config.seed, m),
                        part("preempt", 2 * m, 2 * config.seed + 1, 2 * m)))
    return sched if config.max_scheduled is None else FirstFailures(sched, config.max_scheduled)


@dataclass(frozen=True)
class ScaledTrace:
    """A trace's preemptions and returns as read by ``cfdist plan``
    (:class:`~cfdist.planner.failures.TraceFailures`: one window of the trace per seed),
    time-compressed by ``time_scale``. Pure. ``cfdist plan``'s prediction of an experiment
    replays the same events (``bench/plan_vs_experiment.py``)."""

    failures: object
    """A :class:`~cfdist.planner.failures.TraceFailures` (notice in trace seconds)."""
    time_scale: float
    """Schedule seconds per trace second."""
    seed: int = 0
    """The trace window."""

    @classmethod
    def of(cls, config: ExperimentConfig) -> "ScaledTrace":
        from cfdist.planner.failures import TraceFailures, resolve_trace

        failures = TraceFailures(path=resolve_trace(config.trace), notice_s=config.notice_s / config.time_scale)
        return cls(failures=failures, time_scale=config.time_scale, seed=config.seed)

    def events(self, num_nodes: int, horizon_s: float) -> list[FailureEvent]:
        c = self.time_scale
        return [dataclasses.replace(e, time_s=e.time_s * c, notice_s=e.notice_s * c)
                for e in self.failures.events(num_nodes, horizon_s / c, self.seed)]

    def mtbf_s(self, num_nodes: int) -> float:
        """Mean schedule seconds between the job's preemptions over the whole trace."""
        return self.failures.mtbf_s(num_nodes) * self.time_scale

    def max_nodes(self) -> int | None:
        """The most VMs the trace holds at once (as ``cfdist plan``'s failures say it)."""
        return self.failures.max_nodes()

    @property
    def label(self) -> str:
        return f"{self.failures.label} x{self.time_scale:g}, window {self.seed % 8}/8"


@dataclass(frozen=True)
class FirstFailures:
    """The first ``count`` failures (crash/preempt) of ``schedule``, with their returns. Pure."""

    schedule: object
    """Any schedule (``events(num_nodes, horizon_s)``)."""
    count: int
    """Failures kept."""

    def events(self, num_nodes: int, horizon_s: float) -> list[FailureEvent]:
        out, kept, down = [], 0, set()
        for e in self.schedule.events(num_nodes, horizon_s):
            if e.is_failure:
                if kept == self.count:
                    continue
                kept += 1
                if e.kind == "preempt":
                    down.add(e.node)
            elif e.node in down:   # the return of a kept preemption
                down.discard(e.node)
            else:
                continue
            out.append(e)
        return out


def make_policy(spec: str, config: ExperimentConfig):
    """The real policy object for a spec (``"every:10"`` -> ``cfdist.Every(10)``)."""
    from cfdist.policy import Auto, Every, EveryEpoch

    if spec == "epoch":
        return EveryEpoch()
    if spec.startswith("every:"):
        return Every(int(spec.split(":")[1]))
    if spec == "auto":
        return Auto(max_overhead=config.overhead_budget)
    return Auto(max_overhead=config.overhead_budget, mtbf_s=_spec_mtbf(spec, config))


def _spec_mtbf(spec: str, config: ExperimentConfig) -> float:
    if ":" in spec:
        return float(spec.split(":")[1])
    return ScaledTrace.of(config).mtbf_s(config.num_nodes) if config.schedule == "trace" else config.mtbf_s


def sim_policy(spec: str, config: ExperimentConfig, k: int | None) -> SimPolicy:
    """What the simulator runs for a spec: the interval the real policy reported.

    ``Auto`` tunes ``k`` from what it measures; the simulator replays the ``k`` it settled on
    (the most reported), so the comparison tests the cost model, not a second copy of the tuner.
    """
    if spec == "epoch":
        return EpochBoundary(iters_per_epoch=config.epoch_steps)
    if spec.startswith("every:"):
        return FixedK(k=int(spec.split(":")[1]))
    if k is None:
        raise ValueError(f"policy {spec!r} never reported its k (still profiling at the end?): "
                         f"raise steps so it finishes profiling")
    return FixedK(k=k)


def _run_name(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", spec)


# ------------------------------------------------------------------------------ the shell ---


def run_experiment(config: ExperimentConfig, *, cluster=None,
                   log: Callable[[str], None] = functools.partial(print, flush=True)) -> ExperimentResult:
    """Run the baseline and every policy, measure, simulate, write the report; return it all.

    Blocks for the whole experiment (about ``steps * step_s`` plus recoveries, per run). Call
    from a driver process. ``cluster``: a started :class:`~cfdist.cluster.local_cluster.LocalCluster`
    to reuse (needed for ``node_loss="remove"`` when Ray is already initialised); otherwise one is
    started and stopped here unless ``ray_address`` is set or Ray is already initialised.
    Raises :class:`ExperimentError` if a run gives up.
    """
    import ray

    from cfdist.cluster.local_cluster import LocalCluster

    out = os.path.abspath(config.out_dir)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    schedule = build_schedule(config)
    own = None
    if cluster is None and not ray.is_initialized():
        if config.ray_address:
            ray.init(address=config.ray_address, log_to_driver=False)
        else:
            log(f"starting a local Ray cluster: {config.num_nodes} fake nodes x {config.workers_per_node} CPU")
            own = cluster = LocalCluster(num_nodes=config.num_nodes, cpus_per_node=config.workers_per_node).start()
    if config.node_loss == "remove" and cluster is None:
        raise ValueError("node_loss='remove' needs the LocalCluster the runs use: pass cluster=, or let "
                         "run_experiment start one (no ray.init() before it)")
    plan = ([("baseline", None)] if config.baseline else []) + [(p, p) for p in config.policies]
    logs: dict[str, tuple[list[dict], object, float]] = {}
    try:
        for i, (name, spec) in enumerate(plan, 1):
            cap = f", the first {config.max_scheduled}" if config.max_scheduled else ""
            what = "no failures" if spec is None else f"{_failures_text(config)}{cap}"
            steps = config.steps if spec is not None else (config.baseline_steps or config.steps)
            log(f"[{i}/{len(plan)}] {name}: {steps} steps, {what}")
            t = time.perf_counter()
            result = _run_one(config, name, spec, None if spec is None else schedule, cluster, out)
            took = time.perf_counter() - t
            records = read_event_log(result.event_log)
            logs[name] = (records, result, took)
            lost = window_metrics(training_window(records)[0], iter_s=1.0, label=name).lost_iters
            log(f"      done in {took:.0f}s: {len(lost)} interruption(s), lost iterations {lost or '-'}")
    finally:
        if own is not None:
            own.close()
    res = analyse(config, schedule, logs, out)
    files = write_report(res, out, title=_title(config))
    res = dataclasses.replace(res, files=files)
    for line in summary_lines(res.runs, res.baseline):
        log(line)
    log(f"wrote {files['results.md']}, {files['results.json']} and {files['summary.png']}")
    return res


def run_repeated(config: ExperimentConfig, repeat: int, *,
                 log: Callable[[str], None] = functools.partial(print, flush=True)) -> list[ExperimentResult]:
    """Run the whole experiment ``repeat`` times (:func:`run_experiment`, the same config, each
    repetition in ``<out_dir>/repeat-<i>`` against its own failure-free run, on its own fake
    cluster unless Ray is initialised), then write ``repeats.md`` and ``repeats.json`` into
    ``out_dir`` (:func:`cfdist.chaos.report.write_repeats`). Returns the repetitions' results.
    Raises ``ValueError`` for ``repeat < 1`` and :class:`ExperimentError` when a run gives up
    (the repetitions done so far keep their reports)."""
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise ValueError(f"repeat must be a whole number >= 1, got {repeat!r}")
    results = []
    for i in range(1, repeat + 1):
        log(f"=== repetition {i}/{repeat}")
        sub = dataclasses.replace(config, out_dir=os.path.join(config.out_dir, f"repeat-{i}"))
        results.append(run_experiment(sub, log=log))
    files = write_repeats(results, config.out_dir)
    log(f"over {repeat} repetitions:")
    for line in repeat_lines(repeated(results), baseline_goodputs(results), ideal_iterations(results),
                             baseline_time_lost(results)):
        log(line)
    log(f"wrote {files['repeats.md']} and {files['repeats.json']}")
    return results


def _run_one(config: ExperimentConfig, name: str, spec: str | None, schedule, cluster, out: str):
    from cfdist.api import OutputOptions, RecoveryOptions, TierOptions, fit
    from cfdist.experiments.workload import train_loop
    from cfdist.cluster.result import FitError
    from cfdist.policy import Every

    run = _run_name(name)
    ckpt_dir = os.path.join(out, "ckpt", run)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    event_log = os.path.join(out, "logs", f"{run}.jsonl")
    if os.path.exists(event_log):
        os.remove(event_log)   # the event log appends
    steps = config.steps if spec is not None else (config.baseline_steps or config.steps)
    policy = Every(steps + 1) if spec is None else make_policy(spec, config)
    hooks = {}
    if config.node_loss == "remove":
        hooks = {"remove_node": cluster.remove_node, "add_node": cluster.add_node}
    loop = functools.partial(train_loop, steps=steps, epoch_steps=config.epoch_steps,
                             batch_size=config.batch_size, step_s=config.step_s, state_mb=config.state_mb,
                             seed=config.seed)
    try:
        return fit(loop, num_nodes=config.num_nodes, workers_per_node=config.workers_per_node,
                   storage=f"file://{ckpt_dir}/{{node}}", policy=policy, preemption=schedule,
                   max_failures=config.max_failures, run_name=run, total_steps=steps,
                   cpus_per_worker=1, output=OutputOptions(progress=config.progress, event_log=event_log),
                   recovery=RecoveryOptions(min_nodes=config.num_nodes, live_recovery=config.live_recovery,
                                            wait_for_nodes_s=max(120.0, 10 * config.return_after_s)),
                   tiers=TierOptions(memory_every=config.memory_every if spec is not None else None), **hooks)
    except FitError as e:
        raise ExperimentError(
            f"the {name!r} run did not finish: {e}. Its event log is {event_log}. Give it more room "
            f"(max_failures={config.max_failures}) or fewer failures (mtbf_s={config.mtbf_s})") from e
    finally:
        if not config.keep_checkpoints:
            shutil.rmtree(ckpt_dir, ignore_errors=True)


def analyse(config: ExperimentConfig, schedule, logs: dict, out: str) -> ExperimentResult:
    """Measure every run's window, pool the costs, predict every policy. Pure given the logs.

    ``logs``: ``{name: (event-log records, FitResult, seconds)}`` with ``"baseline"`` optional.
    """
    cut = {name: training_window(recs) for name, (recs, _, _) in logs.items()}
    windows = {name: w for name, (w, _) in cut.items()}
    names = list(config.policies)
    # Recovery phases do not depend on the yardstick: measure the costs first, then the goodputs.
    phases = {s: window_metrics(windows[s], iter_s=1.0, label=s) for s in names}
    costs, sample = measure_costs([windows[s] for s in names], [phases[s] for s in names])
    iter_s = iteration_time(windows["baseline"]) if "baseline" in windows else costs.iter_s
    ks = {}
    for spec in names:
        if spec == "epoch":
            ks[spec] = config.epoch_steps
        elif spec.startswith("every:"):
            ks[spec] = int(spec.split(":")[1])
        else:
            ks[spec] = reported_k(windows[spec])
    measured = {spec: window_metrics(windows[spec], iter_s=iter_s, label=f"{spec} (k={ks[spec] or '?'})")
                for spec in names}
    baseline = window_metrics(windows["baseline"], iter_s=iter_s, label="no failures") if "baseline" in windows else None
    horizon = max(m.wall_s + cut[s][1] for s, m in measured.items()) + 1.0
    events = schedule.events(config.num_nodes, horizon)
    runs = []
    for spec in names:
        m = measured[spec]
        recs, fit_result, took = logs[spec]
        sp = sim_policy(spec, config, ks[spec])
        own, _ = measure_costs([windows[spec]], [phases[spec]], fallback=costs)
        others = [s for s in names if s != spec]
        cross = measure_costs([windows[s] for s in others], [phases[s] for s in others], fallback=costs)[0] \
            if others else costs
        # The window starts when the first step started: shift the schedule onto it.
        shift = cut[spec][1]
        evs = [dataclasses.replace(e, time_s=e.time_s - shift) for e in events if 0 <= e.time_s - shift < m.wall_s]
        args = dict(nodes=config.num_nodes, workers_per_node=config.workers_per_node, measured=m, label=m.label,
                    live=config.live_recovery)
        pred, xpred = predict(evs, sp, costs=own, **args), predict(evs, sp, costs=cross, **args)
        if spec in ("epoch",) or spec.startswith("every:"):
            k_fail = tuple(ks[spec] for _ in m.failures)
        else:
            k_fail = tuple(k_at(windows[spec], [f.time_s for f in m.failures]))
        runs.append(PolicyRun(policy=spec, k=ks[spec], measured=m, k_at_failures=k_fail, prediction=pred,
                              cross_prediction=xpred, costs=own, sim_policy=repr(sp),
                              event_log=fit_result.event_log, fit_wall_s=took, final_step=fit_result.final_step,
                              time_lost=time_lost(windows[spec], iter_s, metrics=m)))
    sched = tuple({k: v for k, v in dataclasses.asdict(e).items() if v is not None} for e in events)
    return ExperimentResult(config=dataclasses.asdict(config), iter_s=iter_s, baseline=baseline, costs=costs,
                            cost_sample=sample, runs=tuple(runs), schedule=sched,
                            baseline_time_lost=time_lost(windows["baseline"], iter_s, metrics=baseline)
                            if baseline is not None else None)


def _title(c: ExperimentConfig) -> str:
    notice = f", {c.notice_s:g}s notice" if c.failures != "crash" and c.notice_s else ""
    return (f"{c.num_nodes} nodes x {c.workers_per_node} rank, {c.steps} steps ({c.epoch_steps}/epoch), "
            f"{_failures_text(c)}{notice}, {c.state_mb:g} MiB state per checkpoint")


def _failures_text(c: ExperimentConfig) -> str:
    if c.schedule == "trace":
        return (f"preemptions of {os.path.basename(c.trace)} x{c.time_scale:g} (every ~"
                f"{ScaledTrace.of(c).mtbf_s(c.num_nodes):.3g}s, window {c.seed % 8}/8)")
    return f"{c.failures} failures every ~{c.mtbf_s:g}s ({c.schedule})"


# ---------------------------------------------------------------------------------- CLI ---


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The experiment's command-line options (defaults from :class:`ExperimentConfig`)."""
    d = ExperimentConfig()
    p.add_argument("--out", default=d.out_dir, help=f"output directory (default {d.out_dir})")
    p.add_argument("--policies", nargs="+", default=list(d.policies),
                   help="epoch, every:K, auto, auto-mtbf[:S] (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="steps per run (default %(default)s)")
    p.add_argument("--epoch-steps", type=int, default=d.epoch_steps, help="steps per epoch (default %(default)s)")
    p.add_argument("--step-s", type=float, default=d.step_s, help="compute stand-in per step, s (default %(default)s)")
    p.add_argument("--state-mb", type=float, default=d.state_mb, help="checkpointed MiB per rank (default %(default)s)")
    p.add_argument("--nodes", type=int, default=d.num_nodes, help="nodes (default %(default)s)")
    p.add_argument("--workers-per-node", type=int, default=d.workers_per_node, help="ranks per node (default %(default)s)")
    p.add_argument("--mtbf-s", type=float, default=d.mtbf_s, help="mean seconds between failures (default %(default)s)")
    p.add_argument("--schedule", choices=["fixed", "exponential", "trace"], default=d.schedule,
                   help="failure gaps (trace: the preemptions of --trace)")
    p.add_argument("--trace", default=None, metavar="NAME|PATH",
                   help="with --schedule trace: a bundled trace (bamboo-p3-trace.csv, ...) or a trace file")
    p.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="with a trace: schedule seconds per trace second (default %(default)s)")
    p.add_argument("--failures", choices=["mixed", "crash", "preempt"], default=d.failures, help="what fails")
    p.add_argument("--notice-s", type=float, default=d.notice_s, help="preemption notice, s (default %(default)s)")
    p.add_argument("--return-after-s", type=float, default=d.return_after_s,
                   help="seconds until a preempted node is back (default %(default)s)")
    p.add_argument("--max-scheduled", type=int, default=None, help="only the first N failures of the schedule")
    p.add_argument("--seed", type=int, default=d.seed, help="schedule seed (default %(default)s)")
    p.add_argument("--budget", type=float, default=d.overhead_budget, help="Auto's overhead budget (default %(default)s)")
    p.add_argument("--no-baseline", action="store_true", help="skip the failure-free run")
    p.add_argument("--baseline-steps", type=int, default=None, help="steps of the failure-free run (default: --steps)")
    p.add_argument("--node-loss", choices=["drain", "remove"], default=d.node_loss, help="how preemption takes a node")
    p.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else a local fake cluster)")
    p.add_argument("--max-failures", type=int, default=d.max_failures, help="per run (default %(default)s)")
    p.add_argument("--progress", action="store_true", help="show each run's progress bar")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the runs' checkpoints")
    p.add_argument("--memory-every", type=int, default=None,
                   help="memory snapshot every N steps, disk at the policy's interval (default: off)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the whole experiment N times (each into <out>/repeat-<i>) and report each policy's "
                        "median goodput and range in <out>/repeats.md (default %(default)s: once, into <out>)")
    p.add_argument("--no-live-recovery", dest="live_recovery", action="store_false",
                   help="roll every failure back to the newest commit (default: a failure that leaves a rank "
                        "running restores the survivors' live state)")


def config_from_args(a: argparse.Namespace) -> ExperimentConfig:
    """The :class:`ExperimentConfig` of parsed :func:`add_arguments` options."""
    return ExperimentConfig(
        out_dir=a.out, policies=tuple(a.policies), steps=a.steps, epoch_steps=a.epoch_steps, step_s=a.step_s,
        state_mb=a.state_mb, num_nodes=a.nodes, workers_per_node=a.workers_per_node, mtbf_s=a.mtbf_s,
        schedule=a.schedule, trace=a.trace, time_scale=a.time_scale,
        failures="preempt" if a.schedule == "trace" else a.failures, notice_s=a.notice_s, return_after_s=a.return_after_s,
        seed=a.seed, max_scheduled=a.max_scheduled, overhead_budget=a.budget, baseline=not a.no_baseline,
        baseline_steps=a.baseline_steps, node_loss=a.node_loss,
        ray_address=a.address or os.environ.get("RAY_ADDRESS") or None, max_failures=a.max_failures,
        progress=a.progress, keep_checkpoints=a.keep_checkpoints, memory_every=a.memory_every,
        live_recovery=a.live_recovery)


def _cli(a: argparse.Namespace) -> int:
    try:
        config = config_from_args(a)
        repeat = getattr(a, "repeat", 1)
        if repeat < 1:
            raise ValueError(f"--repeat must be at least 1, got {repeat}")
    except ValueError as e:
        print(f"cfdist experiment: {e}", file=sys.stderr)
        return 2
    try:
        if repeat == 1:
            run_experiment(config)
        else:
            run_repeated(config, repeat)
    except ExperimentError as e:
        print(f"cfdist experiment: {e}", file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> None:
    """Add the ``experiment`` subcommand to ``cfdist``'s subparsers (calls ``args.func(args)``)."""
    p = subparsers.add_parser("experiment", help="compare checkpoint policies under injected failures",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=_cli)


def main(argv=None) -> int:
    """``python -m cfdist.experiments.experiment [options]``."""
    p = argparse.ArgumentParser(prog="cfdist experiment", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return _cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
