"""Train a small CNN on generated shape images with ``cfdist.fit`` (a Ray job).

Submit it to a running Ray cluster (``ray up cluster_configs/<cloud>.yaml``, or a local head
from ``ray start --head``)::

    ray job submit --address http://127.0.0.1:8265 --working-dir launch -- \
        python train_small.py --num-nodes 1 --workers-per-node 2 --steps 200 \
        --storage file:///tmp/cfdist-launch --run-name shapes

On a cloud cluster add ``--gpu`` and ``--shared-storage s3://bucket/prefix``. The data (4 classes
of noisy 16x16 shapes: square, disc, cross, bar) is generated from ``--seed`` on every rank, so
nothing is downloaded. The script parses its arguments, builds the config and calls
``cfdist.fit``; it prints one JSON line with the result at the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F


def make_shapes(n: int = 2048, size: int = 16, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``n`` noisy images of 4 shape classes (deterministic in ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    x = torch.zeros(n, 1, size, size)
    centers = torch.randint(5, size - 5, (n, 2), generator=g)
    for i in range(n):
        cy, cx = centers[i].tolist()
        if y[i] == 0:
            m = ((yy - cy).abs() <= 3) & ((xx - cx).abs() <= 3)
        elif y[i] == 1:
            m = (yy - cy) ** 2 + (xx - cx) ** 2 <= 12
        elif y[i] == 2:
            m = (((yy - cy).abs() <= 1) & ((xx - cx).abs() <= 4)) | (((xx - cx).abs() <= 1) & ((yy - cy).abs() <= 4))
        else:
            m = ((yy - cy).abs() <= 1) & ((xx - cx).abs() <= 5)
        x[i, 0][m] = 1.0
    x += 0.3 * torch.randn(x.shape, generator=g)
    return torch.utils.data.TensorDataset(x, y)


class SmallCNN(torch.nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.c1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32 * 4 * 4, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(x.flatten(1))


def train_loop(ctx, *, steps: int, batch_size: int = 32, lr: float = 0.05, seed: int = 0,
               step_sleep_s: float = 0.0):
    """Runs on every rank (inside its Ray actor)."""
    import cfdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    model = SmallCNN().to(ctx.device)
    model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    loader = cfdist.ResumableLoader(make_shapes(seed=seed), batch_size, seed=seed)
    ckpt = ctx.checkpointer({"model": model, "optim": opt, "sched": sched, "data": loader})
    ckpt.restore()
    correct = seen = 0
    while ckpt.step_count < steps:
        for x, y in loader:
            x, y = x.to(ctx.device), y.to(ctx.device)
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            ckpt.step(opt)
            opt.zero_grad()
            sched.step()
            correct += (out.argmax(1) == y).sum().item()
            seen += len(y)
            ctx.report(loss=loss.item(), acc=correct / seen)
            if step_sleep_s:
                time.sleep(step_sleep_s)
            if ckpt.step_count >= steps:
                break
    return {"loss": loss.item(), "train_acc": correct / max(seen, 1)}


def parse_policy(text: str):
    import cfdist

    if text == "auto":
        return cfdist.Auto()
    if text.startswith("every:"):
        return cfdist.Every(int(text.split(":", 1)[1]))
    if text == "epoch":
        return cfdist.EveryEpoch()
    raise argparse.ArgumentTypeError(f"--policy must be auto, every:K or epoch, got {text!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--workers-per-node", type=int, default=2)
    p.add_argument("--gpu", action="store_true", help="one GPU per rank, NCCL")
    p.add_argument("--storage", required=True, help="node-local checkpoint directory (file://...)")
    p.add_argument("--shared-storage", default=None, help="durable tier (s3://..., gs://..., NFS)")
    p.add_argument("--run-name", default="shapes")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--policy", type=parse_policy, default="every:20", help="auto, every:K or epoch")
    p.add_argument("--max-failures", type=int, default=10)
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--step-sleep-s", type=float, default=0.0, help="pad each step (demos)")
    p.add_argument("--no-progress", action="store_true")


def main(argv=None, *, preemption=None) -> dict:
    import cfdist
    from cfdist.api import fit

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    a = p.parse_args(argv)
    policy = a.policy if not isinstance(a.policy, str) else parse_policy(a.policy)
    result = fit(
        functools.partial(train_loop, steps=a.steps, batch_size=a.batch_size, step_sleep_s=a.step_sleep_s),
        num_nodes=a.num_nodes, workers_per_node=a.workers_per_node, use_gpu=a.gpu, storage=a.storage,
        shared_storage=a.shared_storage, policy=policy, preemption=preemption, max_failures=a.max_failures,
        run_name=a.run_name, total_steps=a.steps, cpus_per_worker=a.cpus_per_worker,
        output=cfdist.OutputOptions(progress=not a.no_progress),
    )
    out = {"final_step": result.final_step, "failures": result.failures,
           "lost_iterations": result.lost_iterations, "recovery_seconds": result.recovery_seconds,
           "stall_share": result.stall_share, "checkpoint": result.checkpoint, "event_log": result.event_log,
           **(result.value or {})}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
