"""Replay the bundled preemption traces against each checkpoint policy and print what they cost.

    python bench/simulate_traces.py                 # all traces, 8-node job, figure to docs/
    python bench/simulate_traces.py --nodes 16 --no-figure

Costs are representative of a ~1.3B-parameter GPT-style model in DDP on nodes of 8 V100s
(AWS p3.16xlarge), with weights + Adam state ~16 GB per checkpoint:

    Ti = 0.5 s per iteration
    To = 0.1 s stall per checkpoint (snapshot overlapped with the next forward/backward)
    Tc = 1.8 s snapshot GPU -> pinned CPU (~9 GB/s)
    Ts = 12 s persist to node-local NVMe (~1.3 GB/s)
    restore 30 s (from a surviving peer or shared storage: a preempted node's disk is gone)
    restart 60 s (Ray actors, NCCL init, data-loader warm-up), detect 10 s (Ray health checks)
    epoch = 7,200 iterations (an hour)

Node mapping (see cfdist/chaos/replay.py): the job needs all its nodes; it runs on the oldest VMs
of the pool, a removed VM is replaced at once by a spare if the pool has one, and the job pauses
while the pool is smaller than the job. No preemption notice unless --notice-s (AWS gives 120 s;
then a notice-triggered checkpoint usually saves all the work, whatever the policy).

Everything is simulated: the run time printed is the simulator's, not training's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from cfdist.chaos import (
    Auto,
    Costs,
    EpochBoundary,
    FailureAware,
    FixedK,
    TraceReplay,
    bundled_trace,
    compare,
)

COSTS = Costs(iter_s=0.5, stall_s=0.1, snapshot_s=1.8, persist_s=12.0, restore_s=30.0, restart_s=60.0,
              detect_s=10.0)
POLICIES = [EpochBoundary(iters_per_epoch=7_200), FixedK(k=1_000), FixedK(k=100), Auto(), FailureAware()]
GPUS_PER_NODE = 8
TRACES = [
    ("bamboo-p3-trace.csv", "AWS p3 spot, 11.4 h", {}),
    ("bamboo-g4dn-trace.csv", "AWS g4dn spot, 10.8 h", {}),
    ("bamboo-a100x1-east1b.txt", "GCP A100 spot pool, 26.6 h", {}),
    ("bamboo-v100x1-east1c.txt", "GCP V100 spot pool, 22.4 h", {}),
    ("gcp-preemptible-lifetimes.csv", "GCP preemptible lifetimes, 24 h sampled", {"replacement_delay_s": 120.0}),
]
FIGURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "sim_bamboo_p3.png")


def run_trace(name: str, nodes: int, notice_s: float, extra: dict):
    trace = TraceReplay(bundled_trace(name), notice_s=notice_s, **extra)
    horizon = trace.span_s(nodes) or 24 * 3600.0
    t = time.perf_counter()
    results = compare(trace, POLICIES, costs=COSTS, nodes=nodes, horizon_s=horizon, workers_per_node=GPUS_PER_NODE)
    took = time.perf_counter() - t
    named = [r if r.label.startswith("k=") else dataclasses.replace(r, label=f"{r.label} (k={r.k})") for r in results]
    return named, horizon, took


def print_table(title: str, results, horizon: float, took: float) -> None:
    print(f"\n{title}: {horizon / 3600:.1f} h simulated in {took * 1e3:.0f} ms")
    print(f"{'policy':<22}{'k':>6}{'goodput':>9}{'no-fail':>9}{'failures':>9}{'lost mean':>10}{'lost max':>9}"
          f"{'recovery s':>11}{'wasted GPU-h':>13}")
    for r in results:
        print(f"{r.label:<22}{r.k:>6}{r.goodput:>9.3f}{r.failure_free_goodput:>9.3f}{r.num_failures:>9}"
              f"{r.lost_iters_mean:>10.0f}{r.lost_iters_max:>9}{r.recovery_s_mean:>11.0f}{r.wasted_worker_s / 3600:>13.1f}")
    auto = next(r for r in results if r.label.startswith("auto"))
    print(f"  auto: {auto.k_reason}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=8, help="nodes the job needs (default 8, 64 GPUs)")
    ap.add_argument("--notice-s", type=float, default=0.0, help="preemption notice in seconds (default none)")
    ap.add_argument("--figure", default=FIGURE, help="PNG for the p3 trace (default docs/sim_bamboo_p3.png)")
    ap.add_argument("--no-figure", action="store_true", help="print the tables only")
    args = ap.parse_args()

    print(f"costs: {COSTS}")
    print(f"job: {args.nodes} nodes x {GPUS_PER_NODE} GPUs; notice {args.notice_s:g} s")
    p3 = None
    for name, what, extra in TRACES:
        results, horizon, took = run_trace(name, args.nodes, args.notice_s, extra)
        print_table(f"{name} ({what})", results, horizon, took)
        if name == "bamboo-p3-trace.csv":
            p3 = results
    if args.notice_s == 0:
        results, horizon, took = run_trace("bamboo-p3-trace.csv", args.nodes, 120.0, {})
        print_table("bamboo-p3-trace.csv with a 120 s notice (notice-triggered checkpoints)", results, horizon, took)

    if not args.no_figure:
        from cfdist.chaos.plots import plot_summary

        path = os.path.normpath(args.figure)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        plot_summary(p3, path, title=f"Bamboo AWS p3 spot trace (11.4 h), {args.nodes}-node job, "
                                     f"Ti={COSTS.iter_s:g}s, persist {COSTS.persist_s:g}s, no notice")
        print(f"\nwrote {path} ({os.path.getsize(path) / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
