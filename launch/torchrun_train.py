"""Multi-node DDP under ``torchrun`` with cfdist, no Ray: node-local checkpoints, an optional
shared tier, and torchrun's ``--max-restarts`` for recovery.

Run the same line on every node (here 2 nodes with 8 GPUs each)::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1     # needed with --max-restarts, see below
    torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=3 \
        --rdzv-backend=c10d --rdzv-endpoint=HEAD_HOST:29400 --rdzv-id=shapes-1 \
        launch/torchrun_train.py --local-storage file:///mnt/local-ssd/cfdist/shapes-1 \
        --shared-storage s3://my-bucket/cfdist/shapes-1 --steps 2000

Each node's local rank 0 writes every checkpoint to that node's own disk (``--local-storage``; the
replicas are identical after the all-reduce, so each node holds a full copy and restarts
read at local-disk speed); global rank 0 also copies every ``--shared-every``-th committed
checkpoint to ``--shared-storage`` in the background, for a restart on new machines. When a worker
dies, torchrun restarts the whole group (up to ``--max-restarts`` times); every rank then
restores the same step (the newest every rank can load; ranks agree once per start) and the
loader resumes at the exact sample. Add ``--backend nccl`` (the default on GPUs).

Live recovery (``--live``, the default): torchrun restarts *every* worker on every node when one
fails (its elastic agent stops the local group and re-rendezvous; the other nodes' agents follow),
so nothing of the survivors' memory outlives the restart. What it allows is this: a survivor's
next collective fails within milliseconds of its peer's death (before the agents react), and the
survivor writes the state of the last step it completed (``Checkpointer.save_live``, no
collective, to its node's disk) before it exits. The restarted group restores the newest step
every rank can load: a node whose worker died receives it from a survivor over the new process
group. So a worker's death loses at most the step in progress, not everything since the last
checkpoint. A failure inside the optimizer update, or SIGTERM (the agent stopping a worker that
had not failed yet), writes nothing; the run then restarts from the last checkpoint.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: by default torchrun's c10d rendezvous shares one
TCPStore with the workers for the whole job, and a restarted group finds the previous group's
keys in it (torchrun's per-attempt prefix uses a restart count each node keeps for itself). The
restarted workers can then read a dead peer's address and fail or hang in
``init_process_group`` (pytorch/pytorch#135712, #167288). With the variable set, each group gets
a fresh store. This script warns when it runs under ``--max-restarts`` without it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cfdist
from cfdist.checkpoint import CheckpointError
from cfdist.checkpoint.discovery import committed_steps, copy_checkpoint
from cfdist.cluster.exits import exit_process
from cfdist.storage import open_storages

try:                                       # the dataset and model of the Ray example
    from train_small import SmallCNN, make_shapes
except ImportError:                        # imported as launch.torchrun_train
    from launch.train_small import SmallCNN, make_shapes


def copy_to_shared(local: str, shared: str, every: int, stop: threading.Event) -> None:
    """Global rank 0's background thread: copy every ``every``-th newly committed node-local
    checkpoint to the shared tier (manifest last: a crash mid-copy leaves nothing visible)."""
    src, dst = open_storages(local), open_storages(shared)
    done = set(committed_steps(dst[0]))
    while not stop.wait(1.0):
        for step in committed_steps(src[0]):
            if step not in done and step % every == 0:
                try:
                    copy_checkpoint(src, step, dst)
                except (FileNotFoundError, CheckpointError):   # retention removed it meanwhile
                    continue
                done.add(step)


def warn_shared_store() -> bool:
    """Warn when torchrun restarts groups on a shared rendezvous store (see the module docstring)."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        logging.getLogger("cfdist.launch").warning(
            "torchrun --max-restarts with a shared rendezvous store: a restarted group can read the "
            "previous group's keys and fail or hang in init_process_group (pytorch#135712); "
            "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node before torchrun")
        return True
    return False


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local-storage", required=True, help="node-local checkpoint URL (file:///mnt/local-ssd/...)")
    p.add_argument("--shared-storage", default=None, help="optional shared tier (s3://..., NFS file://...)")
    p.add_argument("--shared-every", type=int, default=50, help="copy checkpoints whose step is a multiple of this")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=0, help="checkpoint every K steps (0: cfdist.Auto)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    p.add_argument("--record", default=None, help="directory for per-rank JSON lines (tests)")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--live", action=argparse.BooleanOptionalAction, default=True,
                   help="after a peer's death, write the live state of the last step before exiting (default)")
    a = p.parse_args(argv)

    warn_shared_store()
    dist.init_process_group(a.backend)
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if a.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        SmallCNN().to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = cfdist.ResumableLoader(make_shapes(n=512), a.batch_size, seed=0)
    ckpt = cfdist.Checkpointer(
        {"model": model, "optim": opt, "data": loader}, a.local_storage,
        cfdist.Every(a.every) if a.every else cfdist.Auto(), keep=2,
        writers=local_rank == 0,                   # one copy per node, on the node's own disk
        restore_from=[a.shared_storage] if a.shared_storage else None,
        group=cfdist.GroupOptions(live=a.live))
    restored = ckpt.restore()
    stop = threading.Event()
    if rank == 0 and a.shared_storage:
        threading.Thread(target=copy_to_shared, args=(a.local_storage, a.shared_storage, a.shared_every, stop), daemon=True).start()
    rec = open(os.path.join(a.record, f"rank{rank}.jsonl"), "a") if a.record else None
    if rec:
        rec.write(json.dumps({"restored": restored, "pid": os.getpid()}) + "\n")
        rec.flush()
    try:
        while ckpt.step_count < a.steps:
            for x, y in loader:
                F.cross_entropy(model(x.to(device)), y.to(device)).backward()
                ckpt.step(opt)
                opt.zero_grad()
                if rec:
                    rec.write(json.dumps({"step": ckpt.step_count, "epoch": loader.epoch, "xs": x.flatten(1).sum(1).tolist(), "pid": os.getpid()}) + "\n")
                    rec.flush()
                time.sleep(a.step_sleep)
                if ckpt.step_count >= a.steps:
                    break
    except Exception:   # a collective failed (a peer died): keep the last completed step, then fail
        if a.live:
            try:
                live = ckpt.save_live(timeout_s=30.0)
            except Exception as e:  # noqa: BLE001 - the restart falls back on the last checkpoint
                logging.getLogger("cfdist.launch").warning("rank %d: the live state could not be written (%s: %s)",
                                                           rank, type(e).__name__, e)
            else:
                if rec and live is not None:
                    rec.write(json.dumps({"live_saved": live, "pid": os.getpid()}) + "\n")
                    rec.flush()
        raise
    ckpt.close()
    stop.set()
    if rank == 0:
        print(json.dumps({"steps": ckpt.step_count, "restored_from": restored, **ckpt.stats}))
        if a.record:
            torch.save({k: v.clone() for k, v in model.module.state_dict().items()},
                       os.path.join(a.record, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)   # no gloo thread racing the interpreter's shutdown (cfdist.cluster.exits)
