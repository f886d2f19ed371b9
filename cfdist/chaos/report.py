"""What a preemption experiment found, and how it is written: results.json, results.md, PNGs.

:class:`ExperimentResult` holds, per policy, the measured run (:class:`PolicyRun`) and the
simulator's prediction of it; :func:`write_report` writes the three kinds of output. Pure apart
from the files it writes (matplotlib is imported only to draw).

The markdown has the shape of CheckFreq's (FAST'21) tables at small scale: one end-to-end table
(goodput measured and simulated, lost work per failure), one recovery-time table that splits
each failure's recovery into detect, wait, restart, restore and catch-up, the lost work per
failure by kind and by where the run resumed from, and where each run's lost time went
(:class:`~cfdist.chaos.calibrate.TimeLost`: failures, their aftermath, checkpoint stalls, the rest).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from cfdist.chaos.calibrate import AFTER_FAILURE_S, CostSample, Prediction, TimeLost
from cfdist.chaos.metrics import PHASES, RunMetrics
from cfdist.chaos.simulator import Costs


@dataclass(frozen=True, kw_only=True)
class PolicyRun:
    """One policy's real run, measured over its training window, and its prediction."""

    policy: str
    """The policy as given in the config (``"epoch"``, ``"every:10"``, ``"auto"``, ``"auto-mtbf"``)."""
    k: int | None
    """Checkpoint interval the policy reported most often (epoch: steps per epoch)."""
    measured: RunMetrics
    """Goodput, failures, lost work and recovery phases from the event log."""
    k_at_failures: tuple[int | None, ...]
    """``k`` in force when each interruption hit (None while ``Auto`` was still profiling)."""
    prediction: Prediction
    """The simulator's run of the same policy, schedule and window, given this run's own costs."""
    cross_prediction: Prediction
    """The same, given the costs of the *other* policies' runs (a prediction for an unseen run)."""
    costs: Costs
    """This run's own costs (what ``prediction`` was given)."""
    sim_policy: str
    """What the simulator ran (``FixedK(k=12)``, ``EpochBoundary(...)``)."""
    event_log: str
    """Path of the run's JSONL event log."""
    fit_wall_s: float
    """Wall seconds of the whole ``cfdist.fit`` call (start-up and tear-down included)."""
    final_step: int
    """Steps of the final state (the run's target)."""
    time_lost: TimeLost | None = None
    """Where the window's time beyond its useful iterations went (:func:`~cfdist.chaos.calibrate.time_lost`)."""

    @property
    def label(self) -> str:
        return self.measured.label


@dataclass(frozen=True, kw_only=True)
class ExperimentResult:
    """Everything :func:`cfdist.experiments.experiment.run_experiment` measured and predicted."""

    config: dict
    """The experiment's config, as a dict."""
    iter_s: float
    """Goodput's yardstick: seconds per iteration of the failure-free run (or of the runs' median)."""
    baseline: RunMetrics | None
    """The failure-free run (None when skipped)."""
    costs: Costs
    """The costs measured over all runs pooled (each run's own are in its :class:`PolicyRun`)."""
    cost_sample: CostSample
    """How much data ``costs`` came from."""
    runs: tuple[PolicyRun, ...]
    """One per policy, in the config's order."""
    schedule: tuple[dict, ...]
    """The failure events (seconds from the first group's start)."""
    files: dict = dataclasses.field(default_factory=dict)
    """Paths written by :func:`write_report` (name -> path)."""
    baseline_time_lost: TimeLost | None = None
    """The failure-free run's lost time, split the same way (all of it its steps' spread)."""

    @property
    def max_abs_error(self) -> float:
        """Largest ``|predicted/measured - 1|`` over the policies (own costs)."""
        return max((abs(r.prediction.relative_error) for r in self.runs), default=0.0)

    @property
    def max_abs_cross_error(self) -> float:
        """Largest ``|predicted/measured - 1|`` over the policies (the other runs' costs)."""
        return max((abs(r.cross_prediction.relative_error) for r in self.runs), default=0.0)

    def run(self, policy: str) -> PolicyRun:
        """The run of ``policy`` (as spelled in the config)."""
        for r in self.runs:
            if r.policy == policy:
                return r
        raise KeyError(f"no run of policy {policy!r}; ran {[r.policy for r in self.runs]}")


def _round(x, nd: int = 4):
    return round(x, nd) if isinstance(x, float) and math.isfinite(x) else x


def _failure_dict(f, k) -> dict:
    return {"time_s": _round(f.time_s, 3), "kind": f.kind, "step": f.step, "restored_step": f.restored_step,
            "lost_iters": f.lost_iters, "k": k, "events": f.events, "caught_up": f.caught_up,
            **{f"{p}_s": _round(f.phase_s(p), 3) for p in PHASES}, "recovery_s": _round(f.recovery_s, 3)}


def _lost_dict(t: TimeLost | None) -> dict | None:
    return None if t is None else {k: _round(v, 4) for k, v in t.as_dict().items()}


def run_dict(r: PolicyRun) -> dict:
    """A JSON-able summary of one policy's run."""
    m, p, x = r.measured, r.prediction, r.cross_prediction
    return {
        "policy": r.policy, "label": r.label, "k": r.k, "final_step": r.final_step,
        "window_s": _round(m.wall_s, 3), "fit_wall_s": _round(r.fit_wall_s, 3),
        "goodput": _round(m.goodput), "predicted_goodput": _round(p.goodput), "relative_error": _round(p.relative_error),
        "cross_predicted_goodput": _round(x.goodput), "cross_relative_error": _round(x.relative_error),
        "costs": {k: _round(v, 5) for k, v in dataclasses.asdict(r.costs).items()},
        "failures": len(m.failures), "lost_iters_mean": _round(m.lost_iters_mean, 2), "lost_iters_max": m.lost_iters_max,
        "lost_by_kind": [{**row, "lost_iters_mean": _round(row["lost_iters_mean"], 2)} for row in m.lost_by_kind()],
        "recovery_s_mean": _round(m.recovery_s_mean, 3),
        "phase_means_s": {k: _round(v, 3) for k, v in m.phase_means().items()},
        "wasted_worker_s": _round(m.wasted_worker_s, 2),
        "per_failure": [_failure_dict(f, k) for f, k in zip(m.failures, r.k_at_failures)],
        "time_lost": _lost_dict(r.time_lost),
        "simulated": {"policy": r.sim_policy, "k": p.sim.k, "useful_iters": p.sim.useful_iters,
                      "failures": p.sim.num_failures, "lost_iters_mean": _round(p.sim.lost_iters_mean, 2),
                      "recovery_s_mean": _round(p.sim.recovery_s_mean, 3)},
        "event_log": r.event_log,
    }


def results_dict(res: ExperimentResult) -> dict:
    """The whole experiment as a JSON-able dict (what results.json holds)."""
    return {
        "config": res.config,
        "iter_s": _round(res.iter_s, 5),
        "baseline": None if res.baseline is None else {
            "label": res.baseline.label, "steps": res.baseline.useful_iters, "window_s": _round(res.baseline.wall_s, 3),
            "goodput": _round(res.baseline.goodput), "time_lost": _lost_dict(res.baseline_time_lost)},
        "costs": {k: _round(v, 5) for k, v in dataclasses.asdict(res.costs).items()},
        "cost_sample": dataclasses.asdict(res.cost_sample),
        "schedule": list(res.schedule),
        "runs": [run_dict(r) for r in res.runs],
        "max_abs_relative_error": _round(res.max_abs_error),
        "max_abs_cross_relative_error": _round(res.max_abs_cross_error),
    }


def _fmt_k(k) -> str:
    return "-" if k is None else str(k)


def markdown(res: ExperimentResult) -> str:
    """Two markdown tables (end to end; recovery time per failure) and the costs they rest on."""
    c = res.costs
    lines = [
        "End to end (goodput = useful iterations x failure-free iteration time / wall time of the training window):",
        "",
        "| policy | k | failures | goodput measured | simulated (own costs) | simulated (other runs' costs) "
        "| lost it./failure mean (max) | wasted worker-s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res.runs:
        m, p, x = r.measured, r.prediction, r.cross_prediction
        lines.append(f"| {r.policy} | {_fmt_k(r.k)} | {m.num_failures} | {m.goodput:.2f} | "
                     f"{p.goodput:.2f} ({p.relative_error:+.0%}) | {x.goodput:.2f} ({x.relative_error:+.0%}) | "
                     f"{m.lost_iters_mean:.1f} ({m.lost_iters_max}) | {m.wasted_worker_s:.1f} |")
    if res.baseline is not None:
        lines += ["", baseline_text(res.baseline)]
    lines += [
        "",
        "Recovery time per failure, mean seconds (CheckFreq's recovery-time table at small scale):",
        "",
        "| policy | detect | wait | restart | restore | catch-up | total |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res.runs:
        ph = r.measured.phase_means()
        lines.append(f"| {r.policy} | " + " | ".join(f"{ph[p]:.2f}" for p in PHASES)
                     + f" | {r.measured.recovery_s_mean:.2f} |")
    lines += [
        "",
        "Lost work per failure by kind and by where the run resumed from (memory / peer: the "
        "survivors' live state or a node's copy; local / shared: no replica survived):",
        "",
        "| policy | kind | resumed from | failures | lost it. mean (max) |",
        "|---|---|---|---:|---:|",
    ]
    for r in res.runs:
        for row in r.measured.lost_by_kind():
            lines.append(f"| {r.policy} | {row['kind']} | {row['tier'] or '-'} | {row['failures']} | "
                         f"{row['lost_iters_mean']:.1f} ({row['lost_iters_max']}) |")
    lines += time_lost_lines([(r.policy, r.time_lost) for r in res.runs], res.baseline_time_lost)
    s = res.cost_sample
    lines += [
        "",
        f"Costs over all runs ({s.gaps} step gaps, {s.checkpoints} checkpoints, {s.recoveries} clean "
        f"recoveries): iteration {c.iter_s * 1e3:.1f} ms, stall/checkpoint {c.stall_s * 1e3:.1f} ms, "
        f"commit latency {c.commit_s * 1e3:.0f} ms, detect + restart {c.detect_s:.2f} + {c.restart_s:.2f} s "
        f"after a crash, {c.notice_detect_s or 0.0:.2f} + {c.preempt_restart_s or c.restart_s:.2f} s after a "
        f"preemption, restore "
        f"{c.restore_s:.2f} s; each run's own are in results.json. Largest |simulated/measured - 1|: "
        f"{res.max_abs_error:.0%} with each run's own costs, {res.max_abs_cross_error:.0%} with the other runs'.",
    ]
    return "\n".join(lines) + "\n"


_LOST_PARTS = ("failures_s", "after_failures_s", "checkpoint_stalls_s", "other_s")


def _num(x: float, nd: int) -> str:
    """``x`` to ``nd`` decimals, never "-0.00" (a sum's rounding noise)."""
    out = f"{x:.{nd}f}"
    return out[1:] if out.startswith("-") and float(out) == 0 else out


def time_lost_lines(rows: Sequence[tuple[str, TimeLost | None]], baseline: TimeLost | None = None, *,
                    what: str = "") -> list[str]:
    """A markdown table of where each run's lost time went (:class:`TimeLost`), the failure-free
    run's last; nothing when no run has it. ``what``: the table's subject (e.g. medians)."""
    rows = [(name, t) for name, t in rows if t is not None] + ([("no failures", baseline)] if baseline else [])
    if not rows:
        return []
    out = ["", f"Where the time went{what}: seconds of the training window beyond its useful iterations x "
               f"iteration time (the 1 - goodput share), split over the step gaps. Failures: the gaps that span "
               f"one (detect, restart, restore; a rollback's iterations to redo). After failures: the steps of "
               f"the {AFTER_FAILURE_S:g} s after each resume beyond the iteration time (a replacement warm "
               f"spare starts then). Checkpoint stalls: what rank 0's checkpointer waited. Other: the rest, "
               f"the steps' own spread (all the failure-free run loses).", "",
           "| run | window s | lost s | failures | after failures | checkpoint stalls | other |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for name, t in rows:
        out.append(f"| {name} | {t.window_s:.2f} | {_num(t.lost_s, 3)} | "
                   + " | ".join(_num(getattr(t, p), 3) for p in _LOST_PARTS) + " |")
    return out


def write_report(res: ExperimentResult, out_dir: str, *, title: str = "") -> dict[str, str]:
    """Write results.json, results.md and the PNGs into ``out_dir``; returns ``{name: path}``."""
    from cfdist.chaos import plots

    os.makedirs(out_dir, exist_ok=True)
    files = {name: os.path.join(out_dir, name) for name in (
        "results.json", "results.md", "summary.png", "progress.png", "goodput.png", "lost_work.png", "recovery.png")}
    measured = [r.measured for r in res.runs]
    simulated = [r.prediction.sim for r in res.runs]
    predicted = [r.prediction.goodput for r in res.runs]
    plots.plot_summary(measured, files["summary.png"], title=title or None, simulated=simulated, predicted=predicted)
    plots.plot_progress(measured, files["progress.png"], simulated=simulated)
    plots.plot_goodput(measured, files["goodput.png"], predicted=predicted)
    plots.plot_lost_work(measured, files["lost_work.png"])
    plots.plot_recovery(measured, files["recovery.png"])
    with open(files["results.md"], "w", encoding="utf-8") as f:
        f.write(markdown(res))
    data = results_dict(res)
    data["files"] = files
    with open(files["results.json"], "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    return files


_YARDSTICK = ("its iteration time is that run's median step, so what the failure-free run itself lacks of 1 is "
              "its steps' spread and the warm spare processes it starts like every run, not failures or checkpoints")
"""Why the failure-free run scores below 1 by goodput's own measure (every report says it once)."""


def baseline_text(baseline: RunMetrics) -> str:
    """What the failure-free run scores by goodput's own measure, for comparison: goodput's
    yardstick is that run's *median* step, so the run itself stays below 1 by its steps' spread
    and by the warm spare processes it starts like every run (see docs/experiments.md)."""
    return (f"For comparison, the failure-free run ({baseline.useful_iters} steps) scores "
            f"{baseline.goodput:.3f} by the same measure: {_YARDSTICK}.")


def summary_lines(runs: Sequence[PolicyRun], baseline: RunMetrics | None = None) -> list[str]:
    """One line per run for the console (policy, goodput measured/simulated, failures, lost work);
    with ``baseline``, first a line with the failure-free run's own goodput (:func:`baseline_text`)."""
    out = []
    if baseline is not None:
        out.append(f"{'no failures':<22} goodput {baseline.goodput:.3f} (the failure-free run by the same measure: "
                   f"{_YARDSTICK})")
    for r in runs:
        m, p, x = r.measured, r.prediction, r.cross_prediction
        out.append(f"{r.label:<22} goodput {m.goodput:.2f} (sim {p.goodput:.2f} {p.relative_error:+.0%}, "
                   f"from other runs {x.goodput:.2f} {x.relative_error:+.0%})  "
                   f"failures {m.num_failures}  lost it. {m.lost_iters}  recovery {m.recovery_s_mean:.1f}s")
    return out


# ------------------------------------------------------------------------- repetitions ---


@dataclass(frozen=True)
class RepeatedPolicy:
    """One policy over the repetitions of an experiment (``cfdist experiment --repeat N``): the
    same config run N times, each repetition with its own failure-free baseline, so that a
    goodput is quoted with its spread instead of from one run's one or two failures."""

    policy: str
    goodputs: tuple[float, ...]
    """Measured goodput of each repetition, in order."""
    ks: tuple[int | None, ...]
    """The k each repetition's run reported most often."""
    lost_iters: tuple[int, ...]
    """Every interruption's lost iterations, all repetitions pooled."""
    recovery_s: tuple[float, ...]
    """Every interruption's recovery seconds (failure to resumed progress), pooled."""
    time_lost: tuple[TimeLost, ...] = ()
    """Each repetition's :class:`TimeLost` (those that have one)."""

    def time_lost_median(self) -> TimeLost | None:
        """Each part's median over the repetitions (so the parts need not add up to ``lost_s``'s
        median exactly); None without any."""
        return median_time_lost(self.time_lost)

    @property
    def failures(self) -> int:
        return len(self.lost_iters)

    @property
    def goodput_median(self) -> float:
        return _median(self.goodputs)

    @property
    def recovery_s_median(self) -> float:
        """Median over every interruption of every repetition (nan without failures)."""
        return _median(self.recovery_s)


def _median(xs) -> float:
    return statistics.median(xs) if xs else math.nan


def median_time_lost(ts: Sequence[TimeLost]) -> TimeLost | None:
    """A :class:`TimeLost` of each field's median over ``ts`` (None when empty)."""
    if not ts:
        return None
    return TimeLost(window_s=_median([t.window_s for t in ts]), useful_iters=int(_median([t.useful_iters for t in ts])),
                    iter_s=_median([t.iter_s for t in ts]),
                    **{p: _median([getattr(t, p) for t in ts]) for p in _LOST_PARTS})


def baseline_time_lost(results: Sequence[ExperimentResult]) -> TimeLost | None:
    """The failure-free runs' :class:`TimeLost`, each field's median over the repetitions."""
    return median_time_lost([res.baseline_time_lost for res in results if res.baseline_time_lost is not None])


def repeated(results: Sequence[ExperimentResult]) -> list[RepeatedPolicy]:
    """Each policy's figures over ``results`` (the repetitions, in order), in the config's
    order. Raises ``ValueError`` when the repetitions did not run the same policies."""
    if not results:
        raise ValueError("no repetitions to summarise")
    names = [r.policy for r in results[0].runs]
    for i, res in enumerate(results[1:], 2):
        if [r.policy for r in res.runs] != names:
            raise ValueError(f"repetition {i} ran {[r.policy for r in res.runs]}, the first ran {names}")
    out = []
    for name in names:
        runs = [res.run(name) for res in results]
        out.append(RepeatedPolicy(
            policy=name, goodputs=tuple(r.measured.goodput for r in runs), ks=tuple(r.k for r in runs),
            lost_iters=tuple(f.lost_iters for r in runs for f in r.measured.failures),
            recovery_s=tuple(f.recovery_s for r in runs for f in r.measured.failures),
            time_lost=tuple(r.time_lost for r in runs if r.time_lost is not None)))
    return out


def baseline_goodputs(results: Sequence[ExperimentResult]) -> tuple[float, ...]:
    """The failure-free run's own goodput of each repetition that ran one (:func:`baseline_text`)."""
    return tuple(res.baseline.goodput for res in results if res.baseline is not None)


def ideal_iterations(results: Sequence[ExperimentResult]) -> tuple[float, ...]:
    """Each repetition's ideal iteration time (seconds: its failure-free run's median step),
    of the repetitions that ran one."""
    return tuple(res.iter_s for res in results if res.baseline is not None)


def _ideal_text(iters: Sequence[float]) -> str:
    """How far the repetitions' yardsticks lie apart: a repetition's goodput moves with its
    failure-free run's median step as much as with anything the policy did."""
    mid = _median(iters)
    half = (max(iters) - min(iters)) / 2 / mid * 100 if mid else 0.0
    return (f"Each repetition's ideal iteration time (its failure-free run's median step): "
            f"{min(iters) * 1e3:.2f} - {max(iters) * 1e3:.2f} ms (median {mid * 1e3:.2f} ms, +-{half:.1f} %): "
            f"a repetition's goodput moves with its yardstick by as much, whatever the policy did.")


def _baseline_range(goodputs: Sequence[float]) -> str:
    return (f"median {_median(goodputs):.3f} ({min(goodputs):.3f} - {max(goodputs):.3f}; "
            f"{', '.join(f'{g:.3f}' for g in goodputs)})")


def repeats_markdown(rows: Sequence[RepeatedPolicy], baseline: Sequence[float] = (),
                     iters: Sequence[float] = (), baseline_lost: TimeLost | None = None) -> str:
    """The repetitions' table: goodput median and range, k per repetition, pooled failures;
    ``baseline``: the failure-free runs' own goodputs (:func:`baseline_goodputs`), for comparison;
    ``iters``: each repetition's ideal iteration time (:func:`ideal_iterations`), the yardstick's spread."""
    n = len(rows[0].goodputs) if rows else 0
    lines = [f"Over {n} repetitions of the same experiment (each against its own failure-free run):", "",
             "| policy | goodput median | min - max | each repetition | k per repetition | failures "
             "| lost it./failure max | recovery s median |",
             "|---|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        each = ", ".join(f"{g:.3f}" for g in r.goodputs)
        ks = ", ".join(_fmt_k(k) for k in r.ks)
        lost = max(r.lost_iters) if r.lost_iters else "-"
        rec = f"{r.recovery_s_median:.2f}" if r.recovery_s else "-"
        lines.append(f"| {r.policy} | {r.goodput_median:.3f} | {min(r.goodputs):.3f} - {max(r.goodputs):.3f} | "
                     f"{each} | {ks} | {r.failures} | {lost} | {rec} |")
    if baseline:
        lines += ["", f"The failure-free runs by the same measure: {_baseline_range(baseline)} ({_YARDSTICK})."]
    if len(iters) > 1:
        lines += ["", _ideal_text(iters)]
    lines += time_lost_lines([(r.policy, r.time_lost_median()) for r in rows], baseline_lost,
                             what=" (each figure's median over the repetitions)")
    return "\n".join(lines) + "\n"


def write_repeats(results: Sequence[ExperimentResult], out_dir: str) -> dict[str, str]:
    """Write repeats.md and repeats.json (the :func:`repeated` rows, each repetition's
    directory) into ``out_dir``; returns ``{name: path}``."""
    rows = repeated(results)
    base = baseline_goodputs(results)
    iters = ideal_iterations(results)
    os.makedirs(out_dir, exist_ok=True)
    files = {name: os.path.join(out_dir, name) for name in ("repeats.md", "repeats.json")}
    with open(files["repeats.md"], "w", encoding="utf-8") as f:
        f.write(repeats_markdown(rows, base, iters, baseline_time_lost(results)))
    data = {"repetitions": [res.files.get("results.json") for res in results],
            "baseline_goodputs": [_round(g) for g in base],
            "ideal_iteration_s": [_round(x, 6) for x in iters],
            "policies": [{"policy": r.policy, "goodput_median": _round(r.goodput_median),
                          "goodputs": [_round(g) for g in r.goodputs], "ks": list(r.ks), "failures": r.failures,
                          "lost_iters": list(r.lost_iters), "recovery_s_median": _round(r.recovery_s_median),
                          "recovery_s": [_round(x) for x in r.recovery_s],
                          "time_lost_median": _lost_dict(r.time_lost_median())} for r in rows],
            "baseline_time_lost_median": _lost_dict(baseline_time_lost(results))}
    with open(files["repeats.json"], "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    return files


def _lost_text(t: TimeLost) -> str:
    return (f"time lost median {_num(t.lost_s, 2)}s: failures {_num(t.failures_s, 2)}, after failures "
            f"{_num(t.after_failures_s, 2)}, checkpoint stalls {_num(t.checkpoint_stalls_s, 2)}, other {_num(t.other_s, 2)}")


def repeat_lines(rows: Sequence[RepeatedPolicy], baseline: Sequence[float] = (),
                 iters: Sequence[float] = (), baseline_lost: TimeLost | None = None) -> list[str]:
    """One console line per policy over the repetitions (and one of where its lost time went,
    :class:`TimeLost` medians, where known); with ``baseline`` (the failure-free runs' own
    goodputs), first a line for them (``baseline_lost``: their lost time); with two or more
    ``iters``, last the spread of the repetitions' ideal iteration times (:func:`ideal_iterations`)."""
    first = [f"{'no failures':<12} goodput {_baseline_range(baseline)} (the failure-free runs by the same measure)"
             + (f"; {_lost_text(baseline_lost)}" if baseline_lost is not None else "")] if baseline else []
    last = [_ideal_text(iters)] if len(iters) > 1 else []
    out = []
    for r in rows:
        out.append(f"{r.policy:<12} goodput median {r.goodput_median:.3f} ({min(r.goodputs):.3f}-{max(r.goodputs):.3f} "
                   f"over {len(r.goodputs)} runs)  failures {r.failures}  lost it. max "
                   f"{max(r.lost_iters) if r.lost_iters else '-'}  recovery median {r.recovery_s_median:.2f}s")
        t = r.time_lost_median()
        if t is not None:
            out.append(f"{'':<12} {_lost_text(t)}")
    return first + out + last
