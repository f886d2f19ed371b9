"""Recovery time per tier and per phase (medians over many failures), and checkpoint overhead.

::

    python bench/bench_recovery.py                          # 10 failures per tier
    python bench/bench_recovery.py --failures 10 --tiers memory peer --sections recovery
    python bench/bench_recovery.py --hidden 2048 --steps 200 --sections overhead
    python bench/bench_recovery.py --sections live --reps 3

On simulated Ray nodes on this machine (:class:`cfdist.cluster.local_cluster.LocalCluster`: one
raylet per node, a spare third node for replacements, each node its own "local disk"
directory), one DDP job (an MLP, gloo, 1 rank per node) runs:

1. ``overhead``: without checkpoints, then with ``Every(k)`` and ``Auto()`` and no failure:
   seconds per step side by side, and the checkpoint overhead as their ratio;
2. ``memory-every``: ``Auto()`` with ``memory_every=1`` (a memory-tier snapshot every step)
   and without, interleaved: seconds per step and fit's wall time;
3. ``live``: ``Every(k)`` with live recovery on (the live state kept at every step) and off,
   no failure, interleaved: seconds per step (the cost of keeping it);
4. ``recovery``: once per tier, with ``--failures`` failures injected ``--gap`` steps apart:
   ``memory`` (a rank's process SIGKILLed), ``local`` (same, memory tier off), ``peer`` (a node
   lost - every process of it SIGKILLed - and the spare node seeded from the survivor's actor;
   a fresh node joins after each), ``shared`` (the same with peer copies off). Each recovery is
   split from the event log by :func:`cfdist.chaos.metrics.recovery_phases` into detect,
   restart (spawn: starting or taking warm spare processes; rendezvous), restore (setup: the
   training function until its ``restore()``; load) and first step; the table shows medians.
   ``cfdist.fit``'s default live recovery is on (a failure with a survivor restores the
   survivor's last step); ``--rollback`` also runs every tier with it off, in the same program.

Everything runs in this one program at the same moment, so the ratios compare like with like.
Results also go to ``bench/results/recovery.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class Never:
    """A policy that never checkpoints (the no-checkpoint baseline)."""

    k = None
    mode = "cpu"

    def should_checkpoint(self, step, *, epoch_end=False):
        return False

    def observe(self, m):
        pass


def train_loop(ctx, *, steps: int, hidden: int, layers: int, batch: int = 64, step_s: float = 0.0,
               kill_noticed: bool = False):
    """An MLP regression under DDP; rank 0 returns nothing (the event log is the output). With
    ``kill_noticed``, rank 0 SIGKILLs itself as soon as its node's preemption notice arrives
    (a thread that watches ``ctx.preempted``: wherever the training thread is, and before the
    halt that comes with the notice can do anything on this rank), in every other attempt
    (``bench_notices.py``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cfdist

    torch.manual_seed(0)
    mods = [torch.nn.Linear(64, hidden), torch.nn.ReLU()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 64, generator=g), torch.randn(4096, 8, generator=g))
    loader = cfdist.ResumableLoader(data, batch, seed=0)
    ckpt = ctx.checkpointer({"model": model, "optim": opt, "data": loader})
    ckpt.restore()
    if kill_noticed and ctx.rank == 0 and ctx.attempt % 2 == 0:
        import threading

        def kill_on_notice():
            while not ctx.preempted:
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill_on_notice, daemon=True).start()
    while ckpt.step_count < steps:
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            ckpt.step(opt)
            opt.zero_grad()
            time.sleep(step_s)   # stands in for a bigger model's compute
            if ckpt.step_count >= steps:
                break


def seconds_per_step(records: list[dict], skip: int = 10) -> float:
    """Steady-state seconds per step of a failure-free run (the first ``skip`` steps warm up)."""
    steps = [r for r in records if r["event"] == "step" and r["step"] > skip]
    return (steps[-1]["t"] - steps[0]["t"]) / max(1, steps[-1]["step"] - steps[0]["step"])


def _quartiles(xs: list[float]) -> tuple[float, float]:
    """(first, third) quartile of ``xs`` (nan when fewer than 2)."""
    if len(xs) < 2:
        return (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4)
    return (q[0], q[2])


def _schedule(tier: str, failures: int, gap: int, first: int):
    from cfdist.cluster import AtStep, StepSchedule

    at = [first + i * gap for i in range(failures)]
    if tier in ("memory", "local"):
        return StepSchedule([AtStep(step=s, kind="crash", rank=i % 2) for i, s in enumerate(at)])
    # a lost node, then (once the group runs on the spare) a fresh node joins as the next spare
    return StepSchedule([e for s in at for e in (AtStep(step=s, kind="preempt", node=1),
                                                 AtStep(step=s + 1, kind="return", node=1))])


def main(argv=None) -> int:
    from rich.console import Console
    from rich.table import Table

    import cfdist
    from cfdist.api import fit
    from cfdist.chaos.metrics import RESTART_PHASES, read_event_log, recovery_phases
    from cfdist.cluster.local_cluster import LocalCluster

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", nargs="+", default=["overhead", "recovery"],
                   choices=["overhead", "memory-every", "live", "recovery"])
    p.add_argument("--hidden", type=int, default=256, help="MLP width (state = ~2 x 4 B x params)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=150, help="steps of the overhead runs")
    p.add_argument("--reps", type=int, default=2, help="alternating repetitions of the overhead runs")
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--failures", type=int, default=10, help="failures per tier (medians over them)")
    p.add_argument("--gap", type=int, default=100, help="steps between failures")
    p.add_argument("--step-s", type=float, default=0.05,
                   help="sleep per step (compute stand-in): gap x step_s is the time between failures, "
                        "in which the replaced spares warm up again")
    p.add_argument("--tiers", nargs="+", default=["memory", "peer"], choices=["memory", "local", "peer", "shared"])
    p.add_argument("--memory-every", type=int, default=None, help="memory snapshot every n steps (fit option)")
    p.add_argument("--rollback", action="store_true",
                   help="also run each tier with live recovery off (every failure rolls back to the newest commit)")
    p.add_argument("--out", default=None, help="working directory (default: a temp dir, removed)")
    a = p.parse_args(argv)

    work = a.out or tempfile.mkdtemp(prefix="cfdist-bench-")
    os.makedirs(work, exist_ok=True)
    params = sum(p.numel() for p in torch.nn.Sequential(
        torch.nn.Linear(64, a.hidden), *[torch.nn.Linear(a.hidden, a.hidden) for _ in range(a.layers - 1)],
        torch.nn.Linear(a.hidden, 8)).parameters())
    con = Console(width=150)
    con.print(f"[bold]bench_recovery[/]: MLP {a.layers}x{a.hidden} ({params / 1e6:.2f} M params, "
              f"{2 * 4 * params / 2**20:.1f} MiB state with momentum), 2 nodes x 1 rank (gloo), Every({a.every}); "
              f"{a.failures} failures per tier, {a.gap} steps apart; work dir {work}; load {os.getloadavg()[0]:.1f}")
    lc = LocalCluster(num_nodes=3).start()

    walls: dict[str, float] = {}

    def run(name, *, policy, steps, schedule=None, **kw):
        while len(lc.nodes) < 3:
            lc.add_node()
        log = os.path.join(work, f"{name}.jsonl")
        t0 = time.perf_counter()
        loop = functools.partial(train_loop, steps=steps, hidden=a.hidden, layers=a.layers,
                                 step_s=a.step_s if name.startswith("fail-") else 0.0)
        res = fit(loop, num_nodes=2, workers_per_node=1, storage=f"file://{work}/{{node}}/local",
                  policy=policy, preemption=schedule, run_name=name,
                  output=cfdist.OutputOptions(progress=False, event_log=log),
                  remove_node=lc.remove_node, add_node=lc.add_node, max_failures=a.failures + 3, **kw)
        wall = time.perf_counter() - t0
        con.print(f"  {name}: {wall:.1f}s wall, final step {res.final_step}, "
                  f"failures {res.failures}, skipped injections {len(res.skipped_injections)}")
        walls[name] = wall
        return res, read_event_log(log)

    out = {"config": vars(a), "params": params, "load_avg": os.getloadavg()[0]}
    try:
        if "overhead" in a.sections:
            policies = {"no checkpoints": Never, f"Every({a.every})": lambda: cfdist.Every(a.every),
                        "Auto()": cfdist.Auto}
            sps: dict[str, list[float]] = {n: [] for n in policies}
            stall: dict[str, list[float]] = {n: [] for n in policies}
            for i in range(a.reps):          # A B C A B C: drifting machine load hits all alike
                for name, make in policies.items():
                    res, recs = run(f"{name.split('(')[0].replace(' ', '-').lower()}-{i}", policy=make(),
                                    steps=a.steps)
                    sps[name].append(seconds_per_step(recs))
                    stall[name].append(res.stall_share)
            base = statistics.median(sps["no checkpoints"])
            out["overhead"] = {n: {"s_per_step": statistics.median(v), "all": v,
                                   "ratio": statistics.median(v) / base,
                                   "rank0_stall_fraction": statistics.fmean(stall[n])} for n, v in sps.items()}
        if "memory-every" in a.sections:
            # Auto with and without a memory snapshot every step, interleaved (A B A B ...): the
            # training loop's steady-state seconds per step, and fit's wall time from outside
            runs: dict[str, dict[str, list[float]]] = {n: {"s_per_step": [], "wall_s": []} for n in ("off", "1")}
            for i in range(a.reps):
                for n in runs:
                    res, recs = run(f"memory-every-{n}-{i}", policy=cfdist.Auto(), steps=a.steps,
                                    tiers=cfdist.TierOptions(memory_every=None if n == "off" else 1))
                    runs[n]["s_per_step"].append(seconds_per_step(recs))
                    runs[n]["wall_s"].append(walls[f"memory-every-{n}-{i}"])
            base = statistics.median(runs["off"]["s_per_step"])
            out["memory_every"] = {n: {**v, "median_s_per_step": statistics.median(v["s_per_step"]),
                                       "median_wall_s": statistics.median(v["wall_s"]),
                                       "ratio": statistics.median(v["s_per_step"]) / base} for n, v in runs.items()}
        if "live" in a.sections:
            # what keeping the live state at every step costs (RecoveryOptions.live_recovery):
            # failure-free runs with it on and off, interleaved (A B A B ...), Every(k)
            runs = {n: {"s_per_step": [], "wall_s": []} for n in ("off", "on")}
            for i in range(a.reps):
                for n in runs:
                    res, recs = run(f"live-{n}-{i}", policy=cfdist.Every(a.every), steps=a.steps,
                                    recovery=cfdist.RecoveryOptions(live_recovery=n == "on"))
                    runs[n]["s_per_step"].append(seconds_per_step(recs))
                    runs[n]["wall_s"].append(walls[f"live-{n}-{i}"])
            base = statistics.median(runs["off"]["s_per_step"])
            out["live"] = {n: {**v, "median_s_per_step": statistics.median(v["s_per_step"]),
                               "ratio": statistics.median(v["s_per_step"]) / base} for n, v in runs.items()}
            con.print(f"  live state kept at every step: {out['live']['on']['ratio']:.3f}x the seconds per step "
                      f"without it")
        if "recovery" in a.sections:
            extra = {"memory": {}, "local": {"memory_tier": False}, "peer": {},
                     "shared": {"peer_copy": False, "shared_storage": f"file://{work}/shared", "shared_every": 1}}
            if a.memory_every:
                extra = {t: {**kw, "memory_every": a.memory_every} for t, kw in extra.items()}
            out["recovery"] = {}
            modes = [(t, True) for t in a.tiers] + ([(t, False) for t in a.tiers] if a.rollback else [])
            for tier, live in modes:
                first = a.gap
                steps = first + a.failures * a.gap + 5
                label = tier if live else f"{tier} (rollback)"
                res, recs = run(f"fail-{tier}{'' if live else '-rollback'}", policy=cfdist.Every(a.every), steps=steps,
                                schedule=_schedule(tier, a.failures, a.gap, first),
                                recovery=cfdist.RecoveryOptions(live_recovery=live), **extra[tier])
                phases = recovery_phases(recs)
                out["recovery"][label] = {
                    "n": len(phases), "restored_from": sorted({ph["tier"] for ph in phases}),
                    "lost_iters": res.lost_iterations, "reused": [ph["reused"] for ph in phases],
                    "recycled": [ph["recycled"] for ph in phases],
                    "median": {k: statistics.median([ph[k] for ph in phases if ph[k] is not None] or [float("nan")])
                               for k in (*RESTART_PHASES, "spare_wait", "spawn", "setup", "load", "total")},
                    "total_quartiles": _quartiles([ph["total"] for ph in phases]),
                    "all": phases}
    finally:
        out["load_avg_end"] = os.getloadavg()[0]
        lc.close()
        if a.out is None:
            shutil.rmtree(work, ignore_errors=True)

    if "overhead" in out:
        t = Table(title="checkpoint overhead, 2 nodes x 1 rank (same job, same moment)")
        for c in ("policy", "s/step", "vs no checkpoints", "rank 0 stall"):
            t.add_column(c, justify="right")
        for name, o in out["overhead"].items():
            t.add_row(name, f"{o['s_per_step']:.4f}", f"{o['ratio']:.3f}", f"{100 * o['rank0_stall_fraction']:.2f}%")
        t.caption = f"median of {a.reps} interleaved runs each, steady state (steps > 10)"
        con.print(t)
    if "memory_every" in out:
        t = Table(title="Auto() with memory_every=1 (a memory-tier snapshot every step) vs off")
        for c in ("memory_every", "s/step (median)", "all runs", "vs off", "fit wall s (median)"):
            t.add_column(c, justify="right")
        for n, o in out["memory_every"].items():
            t.add_row(n, f"{o['median_s_per_step']:.4f}", " ".join(f"{x:.4f}" for x in o["s_per_step"]),
                      f"{o['ratio']:.3f}", f"{o['median_wall_s']:.1f}")
        t.caption = f"{a.reps} interleaved runs each, {a.steps} steps, steady state (steps > 10)"
        con.print(t)
    if "recovery" in out:
        t = Table(title=f"recovery, medians over the failures of each tier (seconds; load avg "
                  f"{out['load_avg']:.1f} at start, {out['load_avg_end']:.1f} at end)")
        for c in ("tier", "n", "restored from", "spares (in process)", "detect", "restart", "(spare wait)", "(spawn)",
                  "(rendezvous)", "restore", "(setup)", "(load)", "first step", "total", "total q1-q3", "lost iters (max)"):
            t.add_column(c, justify="right")
        for tier, r in out["recovery"].items():
            m = r["median"]
            q = r["total_quartiles"]
            t.add_row(tier, str(r["n"]), ",".join(map(str, r["restored_from"])),
                      f"{statistics.median(r['reused'] or [0]):g} ({statistics.median([x or 0 for x in r['recycled']] or [0]):g})",
                      *(f"{m[k]:.3f}" for k in ("detect", "restart", "spare_wait", "spawn", "rendezvous", "restore", "setup",
                                                 "load", "first_step", "total")),
                      f"{q[0]:.2f}-{q[1]:.2f}", str(max(r["lost_iters"], default=0)))
        con.print(t)
        con.print("spares: ranks of the new group that were warm spares (in process: the failed group's "
                  "survivors, re-formed without a process start); "
                  "detect: failure -> seen by the driver; restart: -> new group running (spawn: warm spares "
                  "taken or processes started; rendezvous: torch.distributed init); restore: -> state loaded "
                  "(setup: training function start until restore(); load: reading it); first step: -> the "
                  "first step after it completed; total: failure -> that step")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "recovery.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
