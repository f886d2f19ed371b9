"""Run ``train_small.py`` under a simulated preemption schedule and print its recovery metrics.

A thin placeholder for the chaos experiments (schedules, policies compared side by side, plots
come from ``cfdist.chaos``); it already runs end to end::

    ray job submit --address http://127.0.0.1:8265 --working-dir launch -- \
        python preemption_experiment.py --storage file:///tmp/cfdist-launch \
        --schedule fixed --every-s 20 --kind crash --steps 300

``--schedule fixed|exponential`` with ``--every-s`` (the interval or the MTBF) and ``--kind
crash|preempt``; ``--notice-s`` for preemptions. Preempted nodes are taken out of scheduling and
given back ``--return-after-s`` later (the run continues smaller meanwhile). It prints one JSON
line: the run's result and the per-failure recovery breakdown read back from the event log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_small  # noqa: E402  (the script's directory is the job's working dir)


def build_schedule(a, ranks_per_node: int):
    from cfdist.chaos import Exponential, FixedInterval

    common = dict(seed=a.seed, kind=a.kind, ranks_per_node=ranks_per_node)
    if a.kind == "preempt":
        common.update(notice_s=a.notice_s, return_after_s=a.return_after_s)
    if a.schedule == "fixed":
        return FixedInterval(a.every_s, first_s=a.first_s, **common)
    return Exponential(a.every_s, **common)


def main(argv=None) -> dict:
    import ray.cloudpickle

    from cfdist.chaos import metrics_from_log, read_event_log

    ray.cloudpickle.register_pickle_by_value(train_small)   # workers need not import it
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", choices=["fixed", "exponential"], default="fixed")
    p.add_argument("--every-s", type=float, default=20.0, help="interval (fixed) or MTBF (exponential)")
    p.add_argument("--first-s", type=float, default=None, help="first failure (fixed; default --every-s)")
    p.add_argument("--kind", choices=["crash", "preempt"], default="crash")
    p.add_argument("--notice-s", type=float, default=0.0)
    p.add_argument("--return-after-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    args, rest = p.parse_known_args(argv)
    wpn = 2
    if "--workers-per-node" in rest:
        wpn = int(rest[rest.index("--workers-per-node") + 1])
    out = train_small.main(rest, preemption=build_schedule(args, wpn))
    recs = read_event_log(out["event_log"])
    m = metrics_from_log(recs)
    out["recovery_breakdown"] = [
        {"kind": f.kind, "lost_iters": f.lost_iters, **{ph: round(f.phase_s(ph), 3) for ph in
                                                        ("detect", "wait", "restart", "restore", "catchup")}}
        for f in m.failures]
    out["goodput"] = round(m.goodput, 4)
    print(json.dumps({"experiment": out}))
    return out


if __name__ == "__main__":
    main()
