"""``cfdist plan`` checked against real runs: the plan's hours and goodput for a few candidates
next to ``cfdist experiment``'s measurement of the same candidates under the same trace.

::

    python bench/plan_vs_experiment.py                       # g4dn trace, window 3, x1/180
    python bench/plan_vs_experiment.py --trace bamboo-p3-trace.csv --seed 5 --time-scale 0.004

Real: ``cfdist experiment`` (a 2-node Ray cluster on this machine, ``cfdist.fit``, DDP on gloo,
each node's own checkpoint directory, the failure injector draining the preempted node) runs
each candidate policy under the preemptions of one window of a bundled spot trace,
time-compressed. Then, for each candidate, ``cfdist.plan`` is given a job measured from the event
log of a calibration run (``--calibrate every:20``: the job under the same failures with a
policy none of the candidates uses, as a user's short trial run; or ``cross``: the next
candidate's run), never from the run it predicts, and the same events, shifted onto the run's
training window, and predicts the
seconds from the first step to the last and the goodput (steps x failure-free step time /
those seconds). Checkpoint bytes and the tiers are the experiment's: local disks, a lost node's
replacement seeded from the survivor (``peer``), and live recovery as ``cfdist.fit`` runs it by
default (a preemption that leaves a node restores the survivor's live state; ``--no-live-recovery``:
every failure rolls back to the newest commit).

Diagnostics beside the prediction, none of them known before a run: the step time of the
calibration run and of each run (the mean step outside checkpoints; the failure-free run's is
goodput's yardstick), which shows the machine's speed drifting between runs (other work on a
shared machine); ``at run speed``: the same plan with the step time replaced by the run's own
(at a short interval part of the checkpoints' cost is in that step time, so it is charged
twice there); ``own``: ``cfdist experiment``'s simulation of the run from the run's own costs
(the replay's error alone); the load average when each run ended; and the ``k`` ``auto`` used
for most steps, with its changes (step:k).

Prints one row per candidate (predicted, measured, error) and whether the plan ranks the
candidates in the measured order; writes ``results.json`` beside the experiment's files.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import tempfile
import types

from cfdist.chaos.calibrate import measure_costs, training_window, window_metrics
from cfdist.chaos.metrics import parse_event_log
from cfdist.experiments.experiment import (
    ExperimentConfig,
    ScaledTrace,
    _run_name,
    analyse,
    build_schedule,
    run_experiment,
)
from cfdist.planner import Candidate, Job, plan


def _policy(spec: str) -> str:
    return spec   # every:K, auto and auto-mtbf are spelled alike in both


def _load() -> str:
    """The 1-minute load average now (other work beside the measurement), or '?'."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def _log_with_load(line: str, *, loads: dict[str, str], current: list) -> None:
    """Print the experiment's log line; note the load average when a run ends ("done in")."""
    print(line, file=sys.stderr)
    started = re.match(r"\[\d+/\d+\] (\S+):", line)
    if started:
        current[0] = started.group(1)
    elif line.strip().startswith("done in") and current[0] is not None:
        loads[current[0]] = _load()


def _k_changes(records) -> list[tuple[int, int]]:
    """``(step, k)`` at each change of the k the run's steps reported (Auto's interval over the run)."""
    out = []
    for r in records:
        if r["event"] == "step" and isinstance(r.get("k"), int) and (not out or out[-1][1] != r["k"]):
            out.append((r["step"], r["k"]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="bamboo-g4dn-trace.csv")
    p.add_argument("--seed", type=int, default=3, help="trace window (seed i starts i/8 of the way in)")
    p.add_argument("--time-scale", type=float, default=1 / 180, help="schedule s per trace s")
    p.add_argument("--policies", nargs="+", default=["every:5", "every:50", "auto"])
    p.add_argument("--calibrate", default="every:20",
                   help="the short run the plans are calibrated on (its event log), run under the same "
                        "failures; 'cross': each candidate's plan calibrated on the next candidate's run")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-s", type=float, default=0.04)
    p.add_argument("--state-mb", type=float, default=8.0)
    p.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    p.add_argument("--reuse", action="store_true", help="compare again from the event logs of a run in --out")
    p.add_argument("--instance", default="gpu-8x-a100", help="instance type of the example price file")
    p.add_argument("--no-live-recovery", dest="live", action="store_false",
                   help="every failure rolls back to the newest commit (cfdist.fit's default is live recovery)")
    a = p.parse_args(argv)
    out = a.out or tempfile.mkdtemp(prefix="plan-vs-experiment-")
    runs = tuple(a.policies) + ((a.calibrate,) if a.calibrate != "cross" and a.calibrate not in a.policies else ())
    config = ExperimentConfig(out_dir=out, policies=runs, steps=a.steps, epoch_steps=a.steps,
                              step_s=a.step_s, state_mb=a.state_mb, schedule="trace", trace=a.trace,
                              time_scale=a.time_scale, failures="preempt", notice_s=0.0, seed=a.seed,
                              baseline_steps=60, live_recovery=a.live)
    loads: dict[str, str] = {}   # run name -> the load average when it ended
    if a.reuse:   # the runs' event logs of an earlier invocation with the same options
        logs = {}
        for name in ("baseline", *config.policies):
            path = os.path.join(out, "logs", f"{_run_name(name)}.jsonl")
            with open(path) as f:
                recs = parse_event_log(f, source=path)
            logs[name] = (recs, types.SimpleNamespace(event_log=path, final_step=a.steps), 0.0)
        res = analyse(config, build_schedule(config), logs, out)
    else:
        res = run_experiment(config, log=functools.partial(_log_with_load, loads=loads, current=[None]))
    trace = ScaledTrace.of(config)
    logs = {r.policy: r.event_log for r in res.runs}
    iter_ref = res.iter_s
    rows = []
    specs = list(a.policies)
    for i, r in enumerate(x for x in res.runs if x.policy in specs):
        other = specs[(i + 1) % len(specs)] if a.calibrate == "cross" else a.calibrate
        job = Job.from_event_log(logs[other], steps=a.steps, state_bytes=int(a.state_mb * 2**20),
                                 nodes=(config.num_nodes,))
        with open(r.event_log) as f:
            recs = parse_event_log(f, source=r.event_log)
        _, shift = training_window(recs)
        horizon = r.measured.wall_s + shift + 3600.0
        evs = [dataclasses.replace(e, time_s=e.time_s - shift)
               for e in trace.events(config.num_nodes, horizon) if e.time_s - shift >= 0]
        cand = Candidate(policy=_policy(r.policy), tiers="local", peer_copy=True, nodes=config.num_nodes,
                         capacity="spot", live=a.live)

        def plan_s(job, cand=cand, evs=evs):
            result = plan(job, failures=trace, instance=a.instance, candidates=[cand], seeds=1,
                          events_for=lambda n, h, s: [e for e in evs if e.time_s < h])
            return result.rows[0].hours * 3600.0, result.rows[0]

        pred_s, row = plan_s(job)
        window, _ = training_window(recs)
        run_iter = measure_costs([window], [window_metrics(window, iter_s=1.0, label=r.policy)])[0].iter_s
        at_speed_s, _ = plan_s(dataclasses.replace(job, iter_s=run_iter))
        meas_s = r.measured.wall_s
        ended = loads.get(r.policy, "?")
        pred_g, meas_g = a.steps * iter_ref / pred_s, a.steps * iter_ref / meas_s
        rows.append({"policy": r.policy, "calibrated_on": other, "k_plan": row.k, "k_run": r.k,
                     "k_changes": _k_changes(recs), "failures_measured": len(r.measured.failures),
                     "lost_iters": [f.step - f.restored_step for f in r.measured.failures],
                     "iter_ms_calibration": round(job.iter_s * 1e3, 1), "iter_ms_run": round(run_iter * 1e3, 1),
                     "predicted_s": round(pred_s, 2), "measured_s": round(meas_s, 2),
                     "predicted_goodput": round(pred_g, 4), "measured_goodput": round(meas_g, 4),
                     "goodput_error": round(pred_g / meas_g - 1, 4),
                     "at_run_speed_s": round(at_speed_s, 2), "at_run_speed_error": round(meas_s / at_speed_s - 1, 4),
                     "own_costs_error": round(r.prediction.relative_error, 4), "load_at_end": ended})
    print(f"\n{a.steps} steps on {config.num_nodes} nodes, preemptions of {a.trace} window {a.seed % 8}/8 "
          f"x{a.time_scale:.4g}, live recovery {'on' if a.live else 'off'}; failure-free step {iter_ref * 1000:.1f} ms")
    print(f"{'candidate':<10} {'calib.':<9} {'k plan/run':>10} {'fail':>4} {'step ms cal/run':>15} {'pred s':>7} "
          f"{'meas s':>7} {'pred gp':>7} {'meas gp':>7} {'error':>7} {'at run speed':>12} {'own':>6} {'load':>5}")
    for x in rows:
        print(f"{x['policy']:<10} {x['calibrated_on']:<9} {str(x['k_plan']) + '/' + str(x['k_run']):>10} "
              f"{x['failures_measured']:>4} {str(x['iter_ms_calibration']) + '/' + str(x['iter_ms_run']):>15} "
              f"{x['predicted_s']:>7.2f} {x['measured_s']:>7.2f} {x['predicted_goodput']:>7.3f} "
              f"{x['measured_goodput']:>7.3f} {x['goodput_error']:>+7.1%} {x['at_run_speed_error']:>+12.1%} "
              f"{x['own_costs_error']:>+6.1%} {x['load_at_end']:>5}")
        if x["k_changes"] and len(x["k_changes"]) > 1:
            print(f"{'':<10} k over the run (step:k): {' '.join(f'{s}:{k}' for s, k in x['k_changes'])}")
    by_pred = [x["policy"] for x in sorted(rows, key=lambda x: x["predicted_s"])]
    by_meas = [x["policy"] for x in sorted(rows, key=lambda x: x["measured_s"])]
    print(f"ranking (fastest first): plan {by_pred}, measured {by_meas}: "
          f"{'same order' if by_pred == by_meas else 'DIFFERENT order'}")
    path = os.path.join(out, "plan_vs_experiment.json")
    with open(path, "w") as f:
        json.dump({"config": dataclasses.asdict(config), "rows": rows, "same_order": by_pred == by_meas}, f, indent=1)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
