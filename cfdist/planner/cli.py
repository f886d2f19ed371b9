"""``cfdist plan``: the command-line shell around :func:`cfdist.planner.plan`.

Mistakes (a missing file, a bad YAML, an unknown trace, an impossible deadline) are raised as
ValueError or :class:`cfdist.cli.UsageError`; :func:`cfdist.cli.main` prints them as one line
and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

EXAMPLES = """\
examples:
  # a job measured by hand, the bundled AWS p3 spot trace, the example prices
  cfdist plan --iter-s 0.5 --steps 40000 --state-gb 20 --nodes 2 4 8 --ref-nodes 4 \\
      --persist-s 20 --restore-s 15 --trace bamboo-p3-trace.csv --notice-s 120 \\
      --instance gpu-8x-a100 --deadline-h 8

  # costs measured from a cfdist.fit event log, 0.1 preemptions per node-hour, 5% take all nodes
  cfdist plan --event-log cfdist-runs/shapes/events.jsonl --steps 100000 --state-gb 40 \\
      --rate 0.1 --p-all 0.05 --prices my-prices.yaml --instance gpu-8x-h100 --json > plan.json

  # a SkyPilot spot-traces availability file, codecs measured to shrink checkpoints to 60%
  cfdist plan --bench cfdist-runs/bench/results.json --steps 50000 --trace us-east-2b_v100_1.json \\
      --codec zstd=0.6 --instance gpu-1x-v100

The bundled traces are bamboo-p3-trace.csv, bamboo-g4dn-trace.csv, bamboo-a100x1-east1b.txt,
bamboo-v100x1-east1c.txt and gcp-preemptible-lifetimes.csv. The example prices
(cfdist/planner/prices-example.yaml) are dated 2026-12 and are an example, not a quote.
The cost model and its assumptions: docs/planning.md.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``cfdist plan``'s options."""
    job = p.add_argument_group("the job (measured: --event-log or --bench; or given: --iter-s)")
    job.add_argument("--steps", type=int, required=True, help="steps to train")
    job.add_argument("--event-log", metavar="PATH", help="a cfdist.fit JSONL event log of a short run")
    job.add_argument("--bench", metavar="PATH", help="a cfdist bench results.json")
    job.add_argument("--iter-s", type=float, help="seconds per step on --ref-nodes nodes")
    job.add_argument("--state-gb", type=float, help="checkpoint size, GB (1e9 bytes); --bench measures it")
    job.add_argument("--nodes", type=int, nargs="+", help="node counts to consider (default: --ref-nodes)")
    job.add_argument("--ref-nodes", type=int, help="nodes --iter-s was measured on (default 1; the log's)")
    job.add_argument("--ranks-per-node", type=int, help="ranks per node (default 1; the log's)")
    job.add_argument("--scaling", type=float, help="iter_s(n) = iter_s * (ref/n) ** scaling (default 1)")
    for name, what in (("stall-s", "training blocked per checkpoint (default 0)"),
                       ("persist-s", "commit to node-local disk (default: state / --local-mbps)"),
                       ("restore-s", "loading a checkpoint (default: state / --local-mbps)"),
                       ("restart-s", "restarting the group (default 60)"),
                       ("detect-s", "noticing a failure (default 10)")):
        job.add_argument(f"--{name}", type=float, help=f"seconds: {what}")
    job.add_argument("--local-mbps", type=float, help="node-local disk bandwidth, MB/s (default 2000)")
    job.add_argument("--shared-mbps", type=float, help="shared storage bandwidth, MB/s (default 200)")
    job.add_argument("--peer-mbps", type=float, help="node-to-node copy bandwidth, MB/s (default 1000)")
    f = p.add_argument_group("failures (one of --trace, --rate)")
    f.add_argument("--trace", metavar="NAME|PATH", help="a bundled trace's name or a trace file (also SkyPilot JSON)")
    f.add_argument("--rate", type=float, metavar="R", help="preemptions per node-hour")
    f.add_argument("--notice-s", type=float, default=0.0, help="preemption notice, s (default 0)")
    f.add_argument("--p-all", type=float, default=0.0, help="--rate: chance a preemption takes every node (default 0)")
    f.add_argument("--return-after-s", type=float, default=0.0, help="--rate: seconds until a replacement is up")
    f.add_argument("--seeds", type=int, default=8, help="schedules per spot candidate: trace windows or seeds (default 8)")
    c = p.add_argument_group("prices and candidates")
    c.add_argument("--prices", metavar="PATH", help="price YAML (default: the shipped, dated example)")
    c.add_argument("--instance", help="instance type in the price file (needed when it lists several)")
    c.add_argument("--deadline-h", type=float, help="deadline, hours: adds the uniform-progress candidates")
    c.add_argument("--every", type=int, nargs="+", default=[100, 500, 2000], help="Every(k) grid (default 100 500 2000)")
    c.add_argument("--codec", action="append", default=[], metavar="NAME=RATIO",
                   help="a codec and its measured persisted/raw size ratio, e.g. zstd=0.6 (repeatable)")
    c.add_argument("--shared-every", type=int, default=10, help="shared copy every n checkpoints (default 10)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object per candidate instead of the table")
    o.add_argument("--out", default="cfdist-runs/plan", help="where plan.json, plan.png and fit.yaml go "
                   "(default cfdist-runs/plan)")
    o.add_argument("--all", action="store_true", help="show every candidate in the table")


def _codecs(items: list[str]) -> dict[str, float]:
    out = {"none": 1.0}
    for item in items:
        name, _, ratio = item.partition("=")
        try:
            value = float(ratio)
        except ValueError:
            value = -1.0
        if not name or not 0 < value <= 1:
            raise ValueError(f"--codec {item!r}: write NAME=RATIO with RATIO the persisted/raw bytes in (0, 1], "
                             f"e.g. --codec zstd=0.6")
        out[name] = value
    return out


def _file(flag: str, path: str) -> str:
    from cfdist.cli import UsageError

    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path}: no such file (relative to {os.getcwd()}); give the path of an existing file")
    return path


def job_from_args(a: argparse.Namespace):
    """The :class:`~cfdist.planner.Job` the options describe."""
    from cfdist.cli import UsageError
    from cfdist.planner.job import Job

    sources = [x for x in ("event_log", "bench", "iter_s") if getattr(a, x) is not None]
    if len(sources) != 1:
        raise UsageError("give exactly one of --event-log PATH, --bench PATH or --iter-s SECONDS "
                         f"(got {', '.join('--' + s.replace('_', '-') for s in sources) or 'none'})")
    given = {k: v for k, v in dict(
        ref_nodes=a.ref_nodes, ranks_per_node=a.ranks_per_node, scaling=a.scaling, stall_s=a.stall_s,
        persist_s=a.persist_s, restore_s=a.restore_s, restart_s=a.restart_s, detect_s=a.detect_s,
        shared_bytes_per_s=a.shared_mbps * 1e6 if a.shared_mbps is not None else None,
        local_bytes_per_s=a.local_mbps * 1e6 if a.local_mbps is not None else None,
        peer_bytes_per_s=a.peer_mbps * 1e6 if a.peer_mbps is not None else None).items() if v is not None}
    if a.nodes:
        given["nodes"] = tuple(a.nodes)
    state = None if a.state_gb is None else int(a.state_gb * 1e9)
    if a.bench is not None:
        if state is not None:
            given["state_bytes"] = state
        return Job.from_bench(_file("--bench", a.bench), steps=a.steps, **given)
    if state is None:
        raise UsageError("give --state-gb (the checkpoint size in GB): it sets the persist, download and storage costs")
    if a.event_log is not None:
        return Job.from_event_log(_file("--event-log", a.event_log), steps=a.steps, state_bytes=state, **given)
    if "nodes" not in given:
        given["nodes"] = (given.get("ref_nodes", 1),)
    return Job(iter_s=a.iter_s, steps=a.steps, state_bytes=state, **given)


def failures_from_args(a: argparse.Namespace):
    """The failure source the options describe."""
    from cfdist.cli import UsageError
    from cfdist.planner.failures import RateFailures, TraceFailures, resolve_trace

    if (a.trace is None) == (a.rate is None):
        raise UsageError("give exactly one of --trace NAME|PATH (a bundled trace or a file) or --rate R "
                         "(preemptions per node-hour)")
    if a.trace is not None:
        return TraceFailures(path=resolve_trace(a.trace), notice_s=a.notice_s, windows=a.seeds)
    return RateFailures(per_node_hour=a.rate, notice_s=a.notice_s, p_all=a.p_all, return_after_s=a.return_after_s)


def run(a: argparse.Namespace) -> int:
    """``cfdist plan``: evaluate, print the table (or JSON), write the files; 0."""
    from cfdist.planner import output
    from cfdist.planner.evaluate import plan
    from cfdist.planner.prices import load_prices

    job = job_from_args(a)
    failures = failures_from_args(a)
    prices = load_prices(_file("--prices", a.prices) if a.prices else None)
    t0 = time.monotonic()
    result = plan(job, failures=failures, prices=prices, instance=a.instance, deadline_h=a.deadline_h,
                  seeds=a.seeds, every=a.every, codecs=_codecs(a.codec),
                  progress=sys.stderr if sys.stderr.isatty() else None)
    took = time.monotonic() - t0
    os.makedirs(a.out, exist_ok=True)
    paths = {name: os.path.join(a.out, name) for name in ("plan.json", "plan.png", "fit.yaml")}
    with open(paths["plan.json"], "w", encoding="utf-8") as f:
        f.write(output.to_json(result) + "\n")
    with open(paths["fit.yaml"], "w", encoding="utf-8") as f:
        f.write(output.fit_yaml(result.best))
    output.plot(result, paths["plan.png"])
    if a.json:
        print(output.to_json(result))
    else:
        print(output.table(result, limit=None if a.all else 20))
        print()
        print(output.summary(result))
        print("\nas Python:\n" + output.python_snippet(result.best))
        print("\nas a cfdist fit YAML (also in " + paths["fit.yaml"] + "):\n" + output.fit_yaml(result.best))
    runs = sum(len(r.outcomes) for r in result.rows)
    print(f"cfdist plan: {len(result.rows)} candidates, {runs} simulated runs in {took:.1f} s; "
          f"wrote {paths['plan.json']}, {paths['plan.png']}, {paths['fit.yaml']}", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    """Add ``plan`` to ``cfdist``'s subcommands."""
    p = subparsers.add_parser("plan", help="what a run will cost on spot machines, and which settings make it cheapest",
                              description="Evaluate checkpoint policy, tiers, peer copy, codecs, node count and\n"
                                          "spot / on-demand / deadline-driven capacity with the failure simulator;\n"
                                          "print a table sorted by dollars and the recommended settings.",
                              epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(run=run)
