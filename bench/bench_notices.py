"""Preemption notices that name every node: does the last completed step reach disk before the kill?

::

    python bench/bench_notices.py                          # 50 notices, grace 2x the commit latency
    python bench/bench_notices.py --notices 60 --grace 2 1 0.5 --kill-noticed

On simulated Ray nodes on this machine (:class:`cfdist.cluster.local_cluster.LocalCluster`, one
raylet per node, each node its own "local disk" directory), one DDP job (an MLP, gloo, 2 nodes x
1 rank, ``Every(k)``) is first run without failures to measure its commit latency (a step's end
to its checkpoint on the local disk, median). Then, for each ``--grace`` factor ``g``, a run
meets ``--notices`` preemptions that take both nodes at once (a whole spot pool), each
announced ``g`` x that latency before the kill; the nodes are drained at the kill (memory tier
gone, disk kept) and come back at once. ``--kill-noticed`` also SIGKILLs rank 0 (node 0's
writer) as soon as every other notice reaches it: then only node 1's copy can commit.

For every notice the driver's event log says which step it had made durable and when
(``notice_commit``: the step's atomic rename on its node, logged by the deadline at the latest;
committed when that step is no older than the newest step a rank completed, before the kill);
the table gives, per grace: notices, how many committed before the kill, how many lost the step
the group was at (the newest step a rank completed, from the restore that followed: in this
simulation the kill waits for the driver, so a late copy still lands and is restored; a real
kill would leave the node's newest on-time commit), and the notice-to-commit seconds (median,
max). Everything runs in this
one program; results also go to ``bench/results/notices.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time

import ray.cloudpickle
import torch

import bench_recovery   # this directory: its training loop, shipped to the workers by value
from bench_recovery import train_loop

ray.cloudpickle.register_pickle_by_value(bench_recovery)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def notice_outcomes(records: list[dict]) -> list[dict]:
    """One row per pool notice of a run's event log: ``committed`` (before the kill), ``step``
    made durable, ``last_step`` the group was at, ``restored`` (the step the next group
    restored), ``after_s`` (notice to durable commit) and ``margin_s`` (commit to kill). Pure."""
    rows: list[dict] = []
    window = None
    for r in records:
        if r["event"] == "notice" and r.get("pool"):
            window = r["window_s"]
        elif r["event"] == "notice_commit":
            rows.append({"committed": r["committed"], "step": r.get("step"), "last_step": r.get("last_step"),
                         "margin_s": r.get("margin_s"), "restored": None,
                         "after_s": None if r.get("margin_s") is None or window is None else window - r["margin_s"]})
        elif r["event"] == "decision" and r.get("what") == "restore" and rows and rows[-1]["restored"] is None:
            rows[-1]["restored"] = r.get("step")
    return rows


def main(argv=None) -> int:
    from rich.console import Console
    from rich.table import Table

    import cfdist
    from cfdist.api import fit
    from cfdist.chaos.metrics import commit_latencies, read_event_log
    from cfdist.cluster import AtStep, StepSchedule
    from cfdist.cluster.local_cluster import LocalCluster

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--notices", type=int, default=50, help="pool notices per grace factor")
    p.add_argument("--grace", type=float, nargs="+", default=[2.0], help="notice = factor x the commit latency")
    p.add_argument("--gap", type=int, default=30, help="steps between notices")
    p.add_argument("--every", type=int, default=5, help="Every(k)")
    p.add_argument("--hidden", type=int, default=512, help="MLP width (state = ~2 x 4 B x params)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kill-noticed", action="store_true", help="rank 0 SIGKILLs itself after every other notice")
    p.add_argument("--out", default=None, help="working directory (default: a temp dir, removed)")
    a = p.parse_args(argv)

    work = a.out or tempfile.mkdtemp(prefix="cfdist-bench-notices-")
    os.makedirs(work, exist_ok=True)
    con = Console(width=150)
    params = sum(p.numel() for p in torch.nn.Sequential(
        torch.nn.Linear(64, a.hidden), *[torch.nn.Linear(a.hidden, a.hidden) for _ in range(a.layers - 1)],
        torch.nn.Linear(a.hidden, 8)).parameters())
    con.print(f"[bold]bench_notices[/]: MLP {a.layers}x{a.hidden} ({2 * 4 * params / 2**20:.1f} MiB state with "
              f"momentum), 2 nodes x 1 rank (gloo), Every({a.every}); {a.notices} pool notices per grace, "
              f"{a.gap} steps apart; work dir {work}; load {os.getloadavg()[0]:.1f}")
    lc = LocalCluster(num_nodes=2).start()

    def run(name, *, steps, schedule=None):
        log = os.path.join(work, f"{name}.jsonl")
        t0 = time.perf_counter()
        loop = functools.partial(train_loop, steps=steps, hidden=a.hidden, layers=a.layers, step_s=0.02,
                                 kill_noticed=a.kill_noticed and schedule is not None)
        res = fit(loop, num_nodes=2, workers_per_node=1, storage=f"file://{work}/{{node}}/local",
                  policy=cfdist.Every(a.every), preemption=schedule, run_name=name,
                  output=cfdist.OutputOptions(progress=False, event_log=log), max_failures=a.notices + 5)
        con.print(f"  {name}: {time.perf_counter() - t0:.1f}s wall, final step {res.final_step}, "
                  f"failures {res.failures}")
        return read_event_log(log)

    out: dict = {"config": vars(a), "params": params, "load_avg": os.getloadavg()[0], "grace": {}}
    try:
        recs = run("calibrate", steps=150)
        lat = commit_latencies(recs, tiers=("local",))
        latency = statistics.median(lat[2:] or lat)   # the first commits pay for opening the tiers
        out["commit_latency_s"] = latency
        con.print(f"  commit latency (step end -> local disk, median of {len(lat)}): {latency * 1e3:.0f} ms")
        for g in a.grace:
            notice_s = g * latency
            first = 20
            sched = StepSchedule([e for i in range(a.notices) for e in (
                *(AtStep(step=first + i * a.gap, kind="preempt", node=n, notice_s=notice_s) for n in (0, 1)),
                *(AtStep(step=first + i * a.gap, kind="return", node=n) for n in (0, 1)))])
            rows = notice_outcomes(run(f"grace-{g:g}", steps=first + a.notices * a.gap + 10, schedule=sched))
            after = [r["after_s"] for r in rows if r["after_s"] is not None]
            out["grace"][f"{g:g}"] = {
                "notice_s": notice_s, "notices": len(rows), "committed": sum(r["committed"] for r in rows),
                "lost_a_step": sum(1 for r in rows if r["restored"] is not None and r["last_step"] is not None
                                   and r["restored"] < r["last_step"]),
                "after_median_s": statistics.median(after) if after else None,
                "after_max_s": max(after) if after else None, "rows": rows}
    finally:
        lc.close()
    t = Table(title=f"pool notices (commit latency {latency * 1e3:.0f} ms; kill-noticed: {a.kill_noticed})")
    for c in ("grace", "notice", "notices", "committed before the kill", "rate", "restored < last step",
              "notice -> commit, median", "max"):
        t.add_column(c, justify="right")
    for g, r in out["grace"].items():
        n = max(r["notices"], 1)
        t.add_row(f"{g}x", f"{r['notice_s'] * 1e3:.0f} ms", str(r["notices"]), str(r["committed"]),
                  f"{r['committed'] / n:.0%}", str(r["lost_a_step"]),
                  "-" if r["after_median_s"] is None else f"{r['after_median_s'] * 1e3:.0f} ms",
                  "-" if r["after_max_s"] is None else f"{r['after_max_s'] * 1e3:.0f} ms")
    con.print(t)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "notices.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
