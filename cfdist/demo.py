"""The README's main job: ``python -m cfdist.demo`` (or ``cfdist demo``, ``./run demo``).

A local ``cfdist.fit`` run on an embedded Ray: a small MLP on a synthetic classification task
(generated here), 1 node x 2 workers (gloo), checkpoints on local disk under ``./cfdist-runs``
(plus the in-memory tier in /dev/shm), two simulated worker crashes (SIGKILL of a rank's
process at fixed steps), a progress bar, and a summary table at the end. About a minute on
2 cores. Options: ``--steps``, ``--crash-at 40 90``, ``--every K``, ``--workers``,
``--out DIR``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch


def make_dataset(n: int = 4096, dim: int = 32, classes: int = 4, seed: int = 0):
    """A synthetic, learnable classification set (a fixed random linear teacher)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    teacher = torch.randn(dim, classes, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y)


def train_loop(ctx, *, steps: int = 150, batch_size: int = 32, lr: float = 0.05, step_sleep_s: float = 0.02):
    """The per-rank training function (what a user writes). Runs inside each rank's actor."""
    import time

    import cfdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = cfdist.ResumableLoader(make_dataset(), batch_size, seed=0)
    ckpt = ctx.checkpointer({"model": model, "optim": opt, "data": loader})
    ckpt.restore()
    loss_fn = torch.nn.CrossEntropyLoss()
    while ckpt.step_count < steps:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            ckpt.step(opt)
            opt.zero_grad()
            ctx.report(loss=loss.item(), epoch=loader.epoch)
            time.sleep(step_sleep_s)   # stands in for a bigger model's compute
            if ckpt.step_count >= steps:
                break
    return {"final_loss": loss.item()}


def summary_table(result, title: str = "cfdist.fit summary"):
    """A rich Table of a :class:`~cfdist.FitResult` (steps, failures, lost work, recovery, rank 0's stall).

    The stall share is cfdist's own account of rank 0's waits; the runtime overhead measured from
    the outside is what ``cfdist bench`` reports."""
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("final step", str(result.final_step))
    t.add_row("steps executed (incl. redone)", str(result.steps))
    t.add_row("failures", str(result.failures))
    t.add_row("lost iterations", ", ".join(map(str, result.lost_iterations)) or "-")
    t.add_row("recovery seconds", ", ".join("-" if s is None else f"{s:.2f}" for s in result.recovery_seconds) or "-")
    t.add_row("restored from", ", ".join(f.tier for f in result.failure_stats) or "-")
    t.add_row("world sizes", " -> ".join(map(str, result.world_sizes)) or "-")
    t.add_row("injections skipped", "; ".join(r.get("reason", "?") for r in result.skipped_injections) or "none")
    t.add_row("rank 0 checkpoint stall (share of run time)", f"{100 * result.stall_share:.2f}%")
    t.add_row("wall seconds", f"{result.wall_s:.1f}")
    t.add_row("final checkpoint", str(result.checkpoint))
    t.add_row("event log", str(result.event_log))
    t.add_row("rank logs (failure details)", str(result.log_dir))
    return t


def main(argv=None) -> int:
    import functools

    from rich.console import Console

    import cfdist
    from cfdist.api import fit
    from cfdist.cluster.injector import AtStep, StepSchedule

    p = argparse.ArgumentParser(
        prog="cfdist demo", description="Train a small model with cfdist.fit on a local Ray, kill worker "
        "processes at fixed steps, and print how the run recovered (about a minute on 2 cores).")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps to train (default 150)")
    p.add_argument("--crash-at", type=int, nargs="*", default=[45, 100],
                   help="steps at which a worker process is killed (default 45 100)")
    p.add_argument("--every", type=int, default=10, help="checkpoint every K steps (default 10)")
    p.add_argument("--workers", type=int, default=2, help="ranks on the local node (default 2)")
    p.add_argument("--out", default=os.path.join(os.getcwd(), "cfdist-runs"),
                   help="where checkpoints and the event log go (default ./cfdist-runs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    out = os.path.abspath(args.out)
    shutil.rmtree(os.path.join(out, "demo"), ignore_errors=True)   # the demo starts from scratch
    if os.path.exists(os.path.join(out, "events", "demo.jsonl")):
        os.remove(os.path.join(out, "events", "demo.jsonl"))
    kills = StepSchedule([AtStep(step=s, kind="crash", rank=(i + 1) % args.workers)
                          for i, s in enumerate(args.crash_at)])
    console = Console()
    console.print(f"[bold]cfdist demo[/]: {args.workers} ranks on a local Ray, checkpoint every "
                  f"{args.every} steps to {out}, worker kills at steps {args.crash_at}")
    result = fit(
        functools.partial(train_loop, steps=args.steps),
        num_nodes=1, workers_per_node=args.workers, storage=f"file://{out}",
        policy=cfdist.Every(args.every), preemption=kills, max_failures=len(args.crash_at) + 2,
        run_name="demo", total_steps=args.steps, cpus_per_worker=1,
        output=cfdist.OutputOptions(progress=not args.no_progress, event_log=os.path.join(out, "events", "demo.jsonl")),
    )
    console.print(summary_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
