"""cfdist inside a Ray Train ``TorchTrainer``: the shapes CNN with iteration-level checkpoints
reported to Ray Train by reference (no copy, no blocking upload).

    ray job submit --address http://127.0.0.1:8265 --working-dir launch -- \
        python ray_train_small.py --workers 2 --steps 200 --storage-path /mnt/shared/ray-results

``--storage-path`` is Ray Train's ``RunConfig(storage_path=...)`` (a shared directory or
``s3://bucket/prefix``); cfdist writes into the run's directory there and reports each committed
step directory. Ray Train restarts failed workers (``--max-failures``) and they resume from the
newest committed step; ``train_loop_config={"resume_from": result.checkpoint}`` continues a
finished run from its ``Result.checkpoint``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.nn.functional as F

try:
    from train_small import SmallCNN, make_shapes
except ImportError:
    from launch.train_small import SmallCNN, make_shapes


def train_func(config: dict) -> None:
    """Runs on every Ray Train worker (torch.distributed already initialised by Ray Train)."""
    import ray.train
    import ray.train.torch

    import cfdist
    from cfdist.ray_train import RayTrainReporter, run_storage

    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = cfdist.ResumableLoader(make_shapes(n=config.get("samples", 512)), config.get("batch_size", 32), seed=0)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "data": loader}, run_storage(),
                               cfdist.Every(config["every"]), keep=2)
    reporter = RayTrainReporter(ckpt, every=config["every"])
    restored = reporter.restore(config.get("resume_from"))   # an earlier run's Result.checkpoint
    rank = ray.train.get_context().get_world_rank()
    crash_at = config.get("crash_at")
    marker = config.get("crash_marker")
    while ckpt.step_count < config["steps"]:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            ckpt.step(opt)
            opt.zero_grad()
            if crash_at and ckpt.step_count == crash_at and rank == 1 and marker and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)      # a worker dies (tests, measurements)
            reporter.maybe_report({"loss": loss.item(), "restored": restored})
            if ckpt.step_count >= config["steps"]:
                break
    reporter.close({"loss": loss.item(), "restored": restored})


def main(argv=None):
    import ray.train
    from ray.train.torch import TorchTrainer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--storage-path", required=True)
    p.add_argument("--name", default="cfdist-shapes")
    p.add_argument("--max-failures", type=int, default=3)
    a = p.parse_args(argv)
    trainer = TorchTrainer(
        train_func, train_loop_config={"steps": a.steps, "every": a.every},
        scaling_config=ray.train.ScalingConfig(num_workers=a.workers),
        run_config=ray.train.RunConfig(name=a.name, storage_path=a.storage_path,
                                       failure_config=ray.train.FailureConfig(max_failures=a.max_failures)),
    )
    result = trainer.fit()
    print(json.dumps({"checkpoint": result.checkpoint.path if result.checkpoint else None,
                      "metrics": result.metrics}))


if __name__ == "__main__":
    main()
