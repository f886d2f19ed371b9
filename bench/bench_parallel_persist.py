"""Persist time of one checkpoint: one writer (``writers="node"``) vs every rank (``writers="all"``).

    python bench/bench_parallel_persist.py                    # 2 gloo ranks, ~150 MB, 3 rounds
    python bench/bench_parallel_persist.py --mb 400 --ranks 4 --rounds 5 --dir /mnt/nvme/bench

Each round spawns ``--ranks`` gloo processes that hold the same state (an MLP of ``--mb / 3``
MB of float32 parameters plus Adam's two moments, identical on every rank, as after the
all-reduce of data parallelism), then checkpoints it with ``cfdist.Checkpointer(writers=...)``
into a fresh ``file://`` directory under ``--dir``. The time is taken from the outside: rank 0
notes the wall clock right before ``save()`` (the snapshot), and this process polls (every
millisecond) for ``MANIFEST.json`` of that step to appear on storage: snapshot to commit
visible, fsyncs included. The two modes alternate, round by round (same machine, same moment);
the table shows the median and the spread. On a machine whose roots share one disk the
writers compete for the same bandwidth; the gain comes from parallel hashing, copying and
queue depth, not from more disks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cfdist

STEP = 1


def _rank(rank, world, store, url, mb, writers, out):
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        width = int((mb * 1e6 / 3 / 4 / 2) ** 0.5)   # two width x width layers, params + 2 moments
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.randn(2, width)).sum().backward()
        ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, url, cfdist.Every(10 ** 9),
                                   writers=writers, group=cfdist.GroupOptions(rank=rank, world_size=world))
        ckpt.step(opt)
        dist.barrier()
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"t0": time.time(), "bytes": sum(p.numel() * 12 for p in model.parameters())}, f)
        ckpt.save(block=True)
        ckpt.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def one(world: int, mb: float, writers, base: str) -> tuple[float, int]:
    """Seconds from rank 0's snapshot to the manifest visible on storage, and the bytes."""
    d = tempfile.mkdtemp(prefix="ppersist-", dir=base)
    url, out = f"file://{d}/ckpt", os.path.join(d, "t0.json")
    manifest = os.path.join(d, "ckpt", f"step-{STEP:09d}", "MANIFEST.json")
    ctx = mp.start_processes(_rank, args=(world, os.path.join(d, "store"), url, mb, writers, out),
                             nprocs=world, start_method="spawn", join=False)
    seen = None
    while seen is None:
        if os.path.exists(manifest):
            seen = time.time()
        elif ctx.join(timeout=0.001):
            break
    while not ctx.join():
        pass
    info = json.load(open(out))
    shutil.rmtree(d, ignore_errors=True)
    if seen is None:
        raise RuntimeError(f"step {STEP} never committed in {url}")
    return seen - info["t0"], info["bytes"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mb", type=float, default=150.0, help="state size in MB (parameters + Adam moments)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure")
    a = ap.parse_args(argv)
    modes = {"writers=1 (node)": "node", f"writers=all ({a.ranks})": "all"}
    times: dict[str, list[float]] = {m: [] for m in modes}
    nbytes = 0
    for r in range(a.rounds):
        for name, w in (modes.items() if r % 2 == 0 else reversed(list(modes.items()))):
            s, nbytes = one(a.ranks, a.mb, w, a.dir)
            times[name].append(s)
            print(f"round {r + 1}: {name:<18} {s:7.3f} s", file=sys.stderr)
    print(f"\npersist of one checkpoint, {nbytes / 1e6:.0f} MB, {a.ranks} gloo ranks, {a.rounds} rounds, "
          f"root {a.dir} (snapshot to commit visible on storage)")
    print(f"{'mode':<20} {'median s':>9} {'min s':>7} {'max s':>7} {'MB/s':>8} {'vs 1':>6}")
    base = statistics.median(times[next(iter(modes))])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<20} {med:9.3f} {min(ts):7.3f} {max(ts):7.3f} {nbytes / 1e6 / med:8.0f} {base / med:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
