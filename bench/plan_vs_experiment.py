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
replacement seeded from the survivor (``peer``).

Prints one row per candidate (predicted, measured, error) and whether the plan ranks the
candidates in the measured order; writes ``results.json`` beside the experiment's files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import types

from cfdist.chaos.calibrate import training_window
from cfdist.chaos.metrics import parse_event_log
from cfdist.experiments.experiment import (
    ExperimentConfig, ScaledTrace, _run_name, analyse, build_schedule, run_experiment,
)
from cfdist.planner import Candidate, Job, plan


def _policy(spec: str) -> str:
    return spec   # every:K, auto and auto-mtbf are spelled alike in both


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
    a = p.parse_args(argv)
    out = a.out or tempfile.mkdtemp(prefix="plan-vs-experiment-")
    runs = tuple(a.policies) + ((a.calibrate,) if a.calibrate != "cross" and a.calibrate not in a.policies else ())
    config = ExperimentConfig(out_dir=out, policies=runs, steps=a.steps, epoch_steps=a.steps,
                              step_s=a.step_s, state_mb=a.state_mb, schedule="trace", trace=a.trace,
                              time_scale=a.time_scale, failures="preempt", notice_s=0.0, seed=a.seed,
                              baseline_steps=60, live_recovery=False)   # the plan rolls back to a commit
    if a.reuse:   # the runs' event logs of an earlier invocation with the same options
        logs = {}
        for name in ("baseline", *config.policies):
            path = os.path.join(out, "logs", f"{_run_name(name)}.jsonl")
            with open(path) as f:
                recs = parse_event_log(f, source=path)
            logs[name] = (recs, types.SimpleNamespace(event_log=path, final_step=a.steps), 0.0)
        res = analyse(config, build_schedule(config), logs, out)
    else:
        res = run_experiment(config, log=lambda line: print(line, file=sys.stderr))
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
                         capacity="spot")
        result = plan(job, failures=trace, instance=a.instance, candidates=[cand], seeds=1, events_for=lambda n, h, s, evs=evs: [
            e for e in evs if e.time_s < h])
        row = result.rows[0]
        pred_s = row.hours * 3600.0
        meas_s = r.measured.wall_s
        pred_g, meas_g = a.steps * iter_ref / pred_s, a.steps * iter_ref / meas_s
        rows.append(dict(policy=r.policy, calibrated_on=other, k_plan=row.k, k_run=r.k,
                         failures_measured=len(r.measured.failures), predicted_s=round(pred_s, 2),
                         measured_s=round(meas_s, 2), predicted_goodput=round(pred_g, 4),
                         measured_goodput=round(meas_g, 4), goodput_error=round(pred_g / meas_g - 1, 4)))
    print(f"\n{a.steps} steps on {config.num_nodes} nodes, preemptions of {a.trace} window {a.seed % 8}/8 "
          f"x{a.time_scale:.4g}; failure-free step {iter_ref * 1000:.1f} ms")
    print(f"{'candidate':<12} {'calibrated on':<14} {'k plan/run':>10} {'failures':>8} {'pred s':>8} "
          f"{'meas s':>8} {'pred goodput':>12} {'meas goodput':>12} {'error':>7}")
    for x in rows:
        print(f"{x['policy']:<12} {x['calibrated_on']:<14} {str(x['k_plan']) + '/' + str(x['k_run']):>10} "
              f"{x['failures_measured']:>8} {x['predicted_s']:>8.2f} {x['measured_s']:>8.2f} "
              f"{x['predicted_goodput']:>12.3f} {x['measured_goodput']:>12.3f} {x['goodput_error']:>+7.1%}")
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
