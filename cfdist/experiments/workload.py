"""The small training job the preemption experiments run on every rank (``cfdist.fit``).

A two-layer MLP on a generated classification set, in DDP, checkpointed by the run's policy.
Two knobs stand in for a bigger model, so that the costs the experiment compares have a
realistic shape on a laptop: ``step_s`` of sleep per step (compute) and a ``state_mb`` buffer in
the model (checkpoint bytes: snapshot and persist take time, the policy has something to weigh).
Everything is deterministic in the seed; nothing is downloaded.

Each step reports the policy's current ``k`` (``ctx.report(k=...)``), so the event log records
which interval was in force when a failure hit (``null`` while ``cfdist.Auto`` profiles).
"""

from __future__ import annotations

import time

import torch

IN_DIM, HIDDEN, CLASSES = 32, 64, 4


def make_dataset(n: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``n`` samples of a learnable task: a fixed random linear teacher's argmax."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_DIM, generator=g)
    y = (x @ torch.randn(IN_DIM, CLASSES, generator=g)).argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y)


def make_model(state_mb: float) -> torch.nn.Module:
    """The MLP plus a zero buffer of ``state_mb`` MiB (checkpointed like weights, never computed on)."""
    net = torch.nn.Sequential(torch.nn.Linear(IN_DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    net.register_buffer("ballast", torch.zeros(int(state_mb * 2**20) // 4))
    return net


def train_loop(ctx, *, steps: int, epoch_steps: int, batch_size: int = 8, step_s: float = 0.04,
               state_mb: float = 16.0, seed: int = 0) -> dict:
    """Train for ``steps`` optimizer steps, ``epoch_steps`` per epoch; runs in each rank's actor.

    Call through ``cfdist.fit`` (``functools.partial(train_loop, steps=..., ...)``); the policy is
    the run's. Returns rank 0's ``{"final_step", "checkpoints", "k"}``.
    """
    import cfdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    model = DDP(make_model(state_mb), broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = make_dataset(epoch_steps * batch_size * ctx.world_size, seed)
    loader = cfdist.ResumableLoader(data, batch_size, seed=seed)
    ckpt = ctx.checkpointer({"model": model, "optim": opt, "data": loader})
    ckpt.restore()
    loss_fn = torch.nn.CrossEntropyLoss()
    while ckpt.step_count < steps:
        for x, y in loader:
            loss_fn(model(x), y).backward()
            ckpt.step(opt)
            opt.zero_grad()
            ctx.report(k=ckpt.policy.k)
            time.sleep(step_s)   # stands in for a bigger model's forward/backward
            if ckpt.step_count >= steps:
                break
    stats = ckpt.stats
    return {"final_step": ckpt.step_count, "checkpoints": stats["checkpoints"], "k": stats["k"]}
