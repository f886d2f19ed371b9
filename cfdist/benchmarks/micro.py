"""Single-process references: what the disk and memory can do, and cfdist's phases against them.

Measured in the parent process, interleaved (one of each per round, so a drift in machine load
hits all alike), on the same filesystem as the training runs:

* ``raw``: ``os.write`` of the bytes in 16 MiB chunks + ``fsync`` (the disk's write bandwidth);
* ``direct``: the same with ``O_DIRECT`` (skips the page cache), where the filesystem allows;
* ``memcpy``: one flat tensor copy of the bytes into a preallocated buffer;
* ``xxh3``: xxh3-64 of every tensor of the snapshot (the checksum cfdist's persist computes);
* ``snapshot``: cfdist's phase 1 (:class:`~cfdist.checkpoint.snapshot.Snapshotter`) of a
  workload's model + Adam tensors;
* ``persist``: cfdist's phase 2 (:func:`~cfdist.checkpoint.persist.write_checkpoint`) of that
  snapshot with the Checkpointer's default ``io="auto"`` (``O_DIRECT`` where the filesystem
  takes it): write, per-tensor xxh3, fsync, manifest, atomic commit;
* restore from a cold page cache (each file evicted with ``posix_fadvise(DONTNEED)``):
  ``torch.load`` + ``load_state_dict``, DCP ``load`` + ``load_state_dict``, cfdist
  ``Checkpointer.restore`` (checksums verified).

Each figure keeps every round's value; CPU seconds are this process's (all threads).
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import time

import torch
import xxhash

from cfdist.benchmarks import measure

_CHUNK = 16 << 20


def _timed(fn) -> dict:
    c0, t0 = measure.cpu_reading(), time.perf_counter()
    fn()
    return {"s": time.perf_counter() - t0, "cpu_s": measure.cpu_delta(c0, measure.cpu_reading())}


def _aligned(n: int) -> mmap.mmap:
    buf = mmap.mmap(-1, n)   # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(min(n, 1 << 20)) * (n // min(n, 1 << 20)))
    return buf


def raw_write(path: str, nbytes: int, buf: mmap.mmap, *, direct: bool = False) -> dict | None:
    """Write ``nbytes`` to a new file in 16 MiB chunks and fsync; None if O_DIRECT is refused."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0)
    if direct and not getattr(os, "O_DIRECT", 0):
        return None
    mv = memoryview(buf)

    def go():
        fd = os.open(path, flags, 0o644)
        try:
            left = nbytes
            while left > 0:
                n = min(left, len(mv))
                if direct and n % 4096:
                    n = (n + 4095) // 4096 * 4096   # O_DIRECT writes whole blocks
                left -= os.write(fd, mv[:n])
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        r = _timed(go)
    except OSError as e:
        if direct:
            return {"unsupported": f"{type(e).__name__}: {e}"}
        raise
    finally:
        if os.path.exists(path):
            os.remove(path)
    return r


def evict(path: str) -> None:
    """Drop a file's (or a directory tree's) clean pages from the page cache."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _workload_tensors(name: str, state_mb: float):
    from cfdist.benchmarks.workloads import build
    from cfdist.checkpoint.flatten import flatten

    w = build(name, state_mb)
    w.loss(w.model, w.batch(0)).backward()
    w.optimizer.step()   # Adam's state exists from the first step
    _, tensors = flatten({"model": w.model.state_dict(), "optim": w.optimizer.state_dict()})
    return w, tensors


def disk_and_phases(root: str, *, workload: str = "mlp", state_mb: float = 200, rounds: int = 5,
                    log=print) -> dict:
    """Interleaved rounds of raw / O_DIRECT / memcpy / snapshot / persist on ``root``'s filesystem."""
    from cfdist.checkpoint.persist import PersistJob, ShardJob, write_checkpoint
    from cfdist.checkpoint.snapshot import Snapshotter
    from cfdist.storage import open_storages

    _, tensors = _workload_tensors(workload, state_mb)
    snap = Snapshotter()
    d = tempfile.mkdtemp(prefix="micro-", dir=root)
    sts = open_storages(f"file://{d}/ckpt")
    out = {k: [] for k in ("raw", "direct", "memcpy", "xxh3", "snapshot", "persist")}
    try:
        snap.start(tensors)
        snap.wait_copied()                      # allocates the arenas; not timed
        nbytes = snap.nbytes
        buf = _aligned(_CHUNK)
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        dst.copy_(src)                          # first touch of the pages, not timed
        for i in range(rounds):
            out["raw"].append(raw_write(os.path.join(d, "raw.bin"), nbytes, buf))
            out["direct"].append(raw_write(os.path.join(d, "direct.bin"), nbytes, buf, direct=True))
            out["memcpy"].append(_timed(lambda: dst.copy_(src)))
            arena = snap.host[0].buf.numpy()
            out["xxh3"].append(_timed(lambda: [xxhash.xxh3_64(memoryview(arena[e.offset:e.offset + e.nbytes])).digest()
                                               for e in snap.layout[0]]))
            out["snapshot"].append(_timed(lambda: (snap.start(tensors), snap.wait_copied())))
            job = PersistJob(step=i + 1, manifest={"skeleton": {}}, arenas=[a.buf for a in snap.host], io="auto",
                             shards=[ShardJob(index=0, count=1, root=0, nbytes=snap.nbytes, entries=snap.layout[0])])
            info = {}
            r = _timed(lambda: info.setdefault("i", write_checkpoint(sts, job)))
            r["commit_s"] = info["i"].seconds   # write + checksum + fsync + commit, without retention
            out["persist"].append(r)
            log(f"  micro round {i + 1}/{rounds}: raw {nbytes / out['raw'][-1]['s'] / 1e6:.0f} MB/s, "
                f"cfdist persist {nbytes / r['s'] / 1e6:.0f} MB/s, memcpy {out['memcpy'][-1]['s']:.3f}s, "
                f"snapshot {out['snapshot'][-1]['s']:.3f}s")
        buf.close()
    finally:
        snap.close()
        shutil.rmtree(d, ignore_errors=True)
    out["bytes"] = nbytes
    out["workload"] = workload
    return out


def restore(root: str, *, workload: str = "mlp", state_mb: float = 200, rounds: int = 3, log=print) -> dict:
    """Cold-cache restore of the same state: torch.load, DCP load, cfdist restore (interleaved)."""
    import torch.distributed.checkpoint as dcp

    import cfdist
    from cfdist.benchmarks.methods import state_dict

    w, _ = _workload_tensors(workload, state_mb)
    d = tempfile.mkdtemp(prefix="restore-", dir=root)
    out = {k: [] for k in ("torch.load", "dcp.load", "cfdist")}
    try:
        pt = os.path.join(d, "ckpt.pt")
        torch.save(state_dict(w.model, w.optimizer), pt)
        dcp_dir = os.path.join(d, "dcp")
        dcp.save(state_dict(w.model, w.optimizer), checkpoint_id=dcp_dir, no_dist=True)
        url = f"file://{d}/cfdist"
        with cfdist.Checkpointer({"model": w.model, "optim": w.optimizer}, url, policy=cfdist.Every(1)) as ck:
            ck.step(w.optimizer)
        nbytes = os.path.getsize(pt)

        def torch_load():
            sd = torch.load(pt)
            w.model.load_state_dict(sd["model"])
            w.optimizer.load_state_dict(sd["optim"])

        def dcp_load():
            sd = state_dict(w.model, w.optimizer)
            dcp.load(sd, checkpoint_id=dcp_dir, no_dist=True)
            w.model.load_state_dict(sd["model"])
            w.optimizer.load_state_dict(sd["optim"])

        def cfdist_load():
            ck = cfdist.Checkpointer({"model": w.model, "optim": w.optimizer}, url, policy=cfdist.Every(10 ** 9))
            try:
                ck.restore()
            finally:
                ck.close()

        for i in range(rounds):
            for name, fn, path in (("torch.load", torch_load, pt), ("dcp.load", dcp_load, dcp_dir),
                                   ("cfdist", cfdist_load, f"{d}/cfdist")):
                evict(path)
                out[name].append(_timed(fn))
            log(f"  restore round {i + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]['s']:.3f}s" for k, v in out.items()
                                                                   if isinstance(v, list)))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out["bytes"] = nbytes
    out["workload"] = workload
    return out
