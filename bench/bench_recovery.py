"""Recovery time per tier, broken down, and the checkpoint overhead of a 2-node run.

::

    python bench/bench_recovery.py                 # ~4 minutes on 2 cores
    python bench/bench_recovery.py --hidden 2048 --steps 200

On a fake 2-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, one raylet per
node, a spare third node for replacements, each node its own "local disk" directory), one
DDP job (an MLP, gloo, 1 rank per node) runs:

1. without checkpoints, then with ``Every(k)`` and no failure: seconds per step side by side,
   and the checkpoint overhead as their ratio (and rank 0's measured stall);
2. once per recovery path, with one failure injected at a fixed step:
   ``memory`` (a rank's process SIGKILLed), ``local`` (same, memory tier off), ``peer`` (a node
   lost, the spare seeded from the survivor's actor), ``shared`` (a node lost, peer copy off,
   the spare seeded from shared storage). Each recovery is split from the event log by
   :func:`cfdist.chaos.metrics.metrics_from_log` into detect, restart, restore and catch-up.

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


def train_loop(ctx, *, steps: int, hidden: int, layers: int, batch: int = 64):
    """An MLP regression under DDP; rank 0 returns nothing (the event log is the output)."""
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
    while ckpt.step_count < steps:
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            ckpt.step(opt)
            opt.zero_grad()
            if ckpt.step_count >= steps:
                break


class FakeCluster:
    """Head (0 CPUs) + worker nodes labelled ``cfdist-node``; removing a node SIGKILLs all of
    its processes at once (a vanished VM)."""

    def __init__(self, workers: int):
        import ray
        from ray.cluster_utils import Cluster

        self.tmp = tempfile.mkdtemp(prefix="cfb-", dir="/tmp")
        os.environ["RAY_TMPDIR"] = self.tmp
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=0, include_dashboard=False, object_store_memory=200 << 20,
            _system_config={"health_check_period_ms": 500, "health_check_timeout_ms": 500,
                            "health_check_failure_threshold": 3}))
        self.nodes, self.n = {}, 0
        for _ in range(workers):
            self.add_node()
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")

    def add_node(self, slot=None) -> str:
        node = self.cluster.add_node(num_cpus=1, labels={"cfdist-node": f"n{self.n}"}, object_store_memory=200 << 20)
        self.n += 1
        self.nodes[node.node_id] = node
        return node.node_id

    def remove_node(self, node_id: str) -> None:
        from ray._private import ray_constants

        node = self.nodes.pop(node_id)
        roots = [p.process.pid for p in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])]
        children: dict[int, list[int]] = {}
        for d in filter(str.isdigit, os.listdir("/proc")):
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
        todo = list(roots)
        while todo:
            for c in children.get(todo.pop(), []):
                todo.append(c)
                try:
                    os.kill(c, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.cluster.remove_node(node, allow_graceful=False)

    def ensure(self, n: int) -> None:
        while len(self.nodes) < n:
            self.add_node()
        self.cluster.wait_for_nodes()

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(self.tmp, ignore_errors=True)


def seconds_per_step(records: list[dict], skip: int = 10) -> float:
    """Steady-state seconds per step of a failure-free run (the first ``skip`` steps warm up)."""
    steps = [r for r in records if r["event"] == "step" and r["step"] > skip]
    return (steps[-1]["t"] - steps[0]["t"]) / max(1, steps[-1]["step"] - steps[0]["step"])


def main(argv=None) -> int:
    from rich.console import Console
    from rich.table import Table

    import cfdist
    from cfdist.api import fit
    from cfdist.chaos.metrics import metrics_from_log, read_event_log
    from cfdist.cluster import AtStep, StepSchedule

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024, help="MLP width (state = ~2 x 4 B x params)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--reps", type=int, default=2, help="alternating repetitions of the overhead pair")
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--fail-at", type=int, default=45)
    p.add_argument("--out", default=None, help="working directory (default: a temp dir, removed)")
    a = p.parse_args(argv)

    work = a.out or tempfile.mkdtemp(prefix="cfdist-bench-")
    os.makedirs(work, exist_ok=True)
    fc = FakeCluster(workers=3)
    loop = functools.partial(train_loop, steps=a.steps, hidden=a.hidden, layers=a.layers)
    params = sum(p.numel() for p in torch.nn.Sequential(
        torch.nn.Linear(64, a.hidden), *[torch.nn.Linear(a.hidden, a.hidden) for _ in range(a.layers - 1)],
        torch.nn.Linear(a.hidden, 8)).parameters())
    con = Console(width=150)
    con.print(f"[bold]bench_recovery[/]: MLP {a.layers}x{a.hidden} ({params / 1e6:.1f} M params, "
              f"{2 * 4 * params / 2**20:.0f} MiB state with momentum), {a.steps} steps, 2 nodes x 1 rank (gloo), "
              f"Every({a.every}), failure at step {a.fail_at}; work dir {work}")

    def run(name, *, policy, schedule=None, **kw):
        fc.ensure(3)
        log = os.path.join(work, f"{name}.jsonl")
        t0 = time.perf_counter()
        res = fit(loop, num_nodes=2, workers_per_node=1, storage=f"file://{work}/{{node}}/local",
                  policy=policy, preemption=schedule, run_name=name, progress=False, event_log=log,
                  remove_node=fc.remove_node, add_node=fc.add_node, max_failures=3, **kw)
        con.print(f"  {name}: {time.perf_counter() - t0:.1f}s wall, final step {res.final_step}, "
                  f"failures {res.failures}")
        return res, read_event_log(log)

    out = {"config": vars(a), "params": params}
    try:
        policies = {"no checkpoints": Never, f"Every({a.every})": lambda: cfdist.Every(a.every),
                    "Auto()": cfdist.Auto}
        sps: dict[str, list[float]] = {n: [] for n in policies}
        stall: dict[str, list[float]] = {n: [] for n in policies}
        ks: dict[str, list] = {n: [] for n in policies}
        for i in range(a.reps):          # A B C A B C: drifting machine load hits all alike
            for name, make in policies.items():
                res, recs = run(f"{name.split('(')[0].replace(' ', '-').lower()}-{i}", policy=make())
                sps[name].append(seconds_per_step(recs))
                stall[name].append(res.stall_share)
                ks[name].append(sorted({r["step"] for r in recs if r["event"] == "checkpoint_committed"})[:6])
        base = statistics.median(sps["no checkpoints"])
        out["overhead"] = {n: {"s_per_step": statistics.median(v), "all": v,
                               "ratio": statistics.median(v) / base,
                               "rank0_stall_fraction": statistics.fmean(stall[n]),
                               "first_checkpoints": ks[n][0]} for n, v in sps.items()}
        sps_ck = out["overhead"][f"Every({a.every})"]["s_per_step"]
        paths = {
            "memory": dict(schedule=StepSchedule([AtStep(step=a.fail_at, kind="crash", rank=1)])),
            "local": dict(schedule=StepSchedule([AtStep(step=a.fail_at, kind="crash", rank=1)]), memory_tier=False),
            "peer": dict(schedule=StepSchedule([AtStep(step=a.fail_at, kind="preempt", node=1)])),
            "shared": dict(schedule=StepSchedule([AtStep(step=a.fail_at, kind="preempt", node=1)]),
                           peer_copy=False, shared_storage=f"file://{work}/shared", shared_every=1),
        }
        out["recovery"] = {}
        for tier, kw in paths.items():
            res, recs = run(f"fail-{tier}", policy=cfdist.Every(a.every), **kw)
            m = metrics_from_log(recs, iter_s=sps_ck)
            for f, fs in zip(m.failures, res.failure_stats):
                out["recovery"][tier] = {
                    "restored_from": fs.tier, "lost_iters": fs.lost_iterations, "detect_s": f.detect_s,
                    "wait_s": f.wait_s, "restart_s": f.restart_s, "restore_s": f.restore_s,
                    "catchup_s": f.catchup_s, "total_s": f.recovery_s,
                    "load_s": next((r.get("load_s") for r in recs if r["event"] == "restored"), None),
                    "stage_s": next((r.get("stage_s") for r in recs if r["event"] == "restored"), None)}
    finally:
        fc.close()
        if a.out is None:
            shutil.rmtree(work, ignore_errors=True)

    t = Table(title="checkpoint overhead, 2 nodes x 1 rank (same job, same moment)")
    for c in ("policy", "s/step", "vs no checkpoints", "rank 0 stall", "first checkpoints at"):
        t.add_column(c, justify="right")
    for name, o in out["overhead"].items():
        t.add_row(name, f"{o['s_per_step']:.4f}", f"{o['ratio']:.3f}", f"{100 * o['rank0_stall_fraction']:.2f}%",
                  ", ".join(map(str, o["first_checkpoints"])) or "-")
    t.caption = (f"median of {a.reps} interleaved runs each, steady state (steps > 10); all nodes share "
                 f"this machine's cores, so the persist (hashing, fsync) competes with training here")
    con.print(t)
    t = Table(title=f"recovery after one failure at step {a.fail_at} (seconds)")
    for c in ("failure / tier", "restored from", "lost iters", "detect", "restart", "(stage)", "restore",
              "(load)", "catch-up", "total"):
        t.add_column(c, justify="right")
    for tier, r in out["recovery"].items():
        t.add_row(tier, r["restored_from"], str(r["lost_iters"]), f"{r['detect_s']:.2f}",
                  f"{r['wait_s'] + r['restart_s']:.2f}", f"{r['stage_s'] or 0:.2f}", f"{r['restore_s']:.2f}",
                  f"{r['load_s'] or 0:.3f}", f"{r['catchup_s']:.2f}", f"{r['total_s']:.2f}")
    con.print(t)
    con.print("restart = new worker processes + torch.distributed rendezvous (+ stage: copying the "
              "checkpoint to a new node); restore = training function start until the state is loaded "
              "(load: reading + verifying the checkpoint itself)")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "recovery.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
