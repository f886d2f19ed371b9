"""Compare checkpoint policies under injected failures on a Ray cluster (``cfdist experiment`` as a job).

Submit it to a running cluster (``ray up cluster_configs/<cloud>.yaml``, or a local head from
``ray start --head``; every node needs one CPU per rank)::

    ray job submit --address http://127.0.0.1:8265 --working-dir launch -- \
        python preemption_experiment.py --out /tmp/cfdist-experiment --nodes 2 --mtbf-s 20 --steps 1000

The job's driver runs the small job of ``cfdist.experiments.workload`` once without failures, then once
per policy (epoch baseline, ``Every(10)``, ``Auto``, failure-aware ``Auto(mtbf_s)``; ``--policies``)
while the failure injector crashes ranks and preempts nodes of the job on the schedule's clock (a
preempted node is drained: its ranks and node actor are killed and it is excluded until it
returns). It writes results.json, results.md and the PNGs to ``--out`` on the driver's node and
prints one JSON line at the end; with ``--repeat N`` it runs the whole experiment N times and the
line gives each policy's median goodput (``repeats.md``/``repeats.json`` in ``--out``). Every
option: ``python preemption_experiment.py --help``.
"""

from __future__ import annotations

import argparse
import json
import os


def main(argv=None) -> dict:
    from cfdist.chaos.report import repeated
    from cfdist.experiments.experiment import add_arguments, config_from_args, run_experiment, run_repeated

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    a = p.parse_args(argv)
    config = config_from_args(a)
    if a.repeat != 1:   # --repeat N: every repetition in <out>/repeat-<i>, the medians in <out>/repeats.json
        rows = repeated(run_repeated(config, a.repeat))
        out = {"repeats": os.path.join(config.out_dir, "repeats.json"), "repetitions": a.repeat,
               "goodput_median": {r.policy: round(r.goodput_median, 4) for r in rows}}
        print(json.dumps({"experiment": out}))
        return out
    res = run_experiment(config)
    out = {"results": res.files["results.json"], "summary_png": res.files["summary.png"],
           "goodput": {r.policy: round(r.measured.goodput, 4) for r in res.runs},
           "max_abs_relative_error": round(res.max_abs_error, 4)}
    print(json.dumps({"experiment": out}))
    return out


if __name__ == "__main__":
    main()
