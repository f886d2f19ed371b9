"""Where the CPU-seconds of one checkpoint go: a per-stage profile against memcpy + raw write.

    python bench/profile_cpu.py                      # MLP ~200 MB + Adam, 40 steps, k=5 (~30 s)
    python bench/profile_cpu.py --workload gpt --mb 50 --steps 20 --out cfdist-runs/profile-cpu

One process trains a ``cfdist bench`` workload (``--workload``, the MLP by default; Adam) with a ``Checkpointer`` (writer thread, the
default ``io="auto"``) checkpointing every ``--k`` steps, and charges the CPU time
(``time.thread_time``, user + system, of the thread doing it) of each stage of a checkpoint:

* ``step bookkeeping``: the training thread's time in ``Checkpointer.step`` minus the optimizer
  step itself (state capture, flatten, RNG states, starting the copy, policy, harvest);
* ``snapshot copy``: the snapshot thread's copy into the arenas;
* ``checksums``: the per-tensor xxh3 thread of each persist;
* ``shard writes``: the ``pwrite`` calls of the shard files (``O_DIRECT`` writer threads and the
  bounce-buffer writes), on whichever thread made them;
* ``fsync``: the ``fsync`` calls;
* ``persist, the rest``: the writer thread's time in ``write_checkpoint`` outside the above
  (headers, manifest JSON, directory operations, commit, retention, LATEST hint).

The stages are found by wrapping their functions (this script's instrumentation, not the
library's); CPU the kernel's own threads spend (writeback, block layer) is no thread's here.
Alongside, the same process's reference: a ``torch`` copy of the same bytes into a preallocated
buffer and a raw buffered ``os.write`` + ``fsync`` of them (``cfdist bench``'s CPU reference),
interleaved with the training run's checkpoints. The whole process's CPU per checkpoint step
against a no-checkpoint run is printed as well: it holds what the stages cost training indirectly
(caches and memory bandwidth shared with the copy, the checksums and the writes) plus noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

STAGES = ("step bookkeeping", "snapshot copy", "checksums", "shard writes", "fsync", "persist, the rest")


class _Charges:
    """CPU seconds per stage, and per thread the seconds already charged to an inner stage."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stage = dict.fromkeys(STAGES, 0.0)
        self.inner: dict[int, float] = {}

    def add(self, stage: str, s: float, *, inner: bool = False) -> None:
        with self.lock:
            self.stage[stage] += s
            if inner:
                tid = threading.get_native_id()
                self.inner[tid] = self.inner.get(tid, 0.0) + s

    def inner_of_this_thread(self) -> float:
        with self.lock:
            return self.inner.get(threading.get_native_id(), 0.0)

    def reset(self) -> None:
        with self.lock:
            self.stage = dict.fromkeys(STAGES, 0.0)


def _instrument(ch: _Charges) -> None:
    """Wrap the stages' functions (see the module docstring)."""
    from cfdist.checkpoint import persist, snapshot
    from cfdist.storage import direct

    def timed(stage, fn, *, inner=False):
        def wrapper(*a, **k):
            c = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                ch.add(stage, time.thread_time() - c, inner=inner)
        return wrapper

    snapshot.Snapshotter._do_copy = staticmethod(timed("snapshot copy", snapshot.Snapshotter._do_copy))
    persist._ArenaHasher._run = timed("checksums", persist._ArenaHasher._run)
    direct._pwrite_all = timed("shard writes", direct._pwrite_all, inner=True)
    real_fsync = os.fsync
    os.fsync = timed("fsync", real_fsync, inner=True)
    real_write = persist.write_checkpoint

    def write_checkpoint(*a, **k):
        c, before = time.thread_time(), ch.inner_of_this_thread()
        try:
            return real_write(*a, **k)
        finally:
            ch.add("persist, the rest", time.thread_time() - c - (ch.inner_of_this_thread() - before))
    persist.write_checkpoint = write_checkpoint


def _reference(nbytes: int, d: str) -> dict:
    """CPU of a memcpy and of a raw buffered write + fsync of ``nbytes`` (``cfdist bench``'s reference)."""
    from cfdist.benchmarks import micro

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)   # first touch, not timed
    c = time.thread_time()
    dst.copy_(src)
    memcpy = time.thread_time() - c
    buf = micro._aligned(micro._CHUNK)
    raw = micro.raw_write(os.path.join(d, "raw.bin"), nbytes, buf)["cpu_s"]
    buf.close()
    return {"memcpy": memcpy, "raw write + fsync": raw}


def run(*, mb: float, steps: int, k: int, root: str, workload: str = "mlp") -> dict:
    import cfdist
    from cfdist.benchmarks.workloads import build

    torch.set_num_threads(1)
    ch = _Charges()
    _instrument(ch)
    w = build(workload, mb)
    d = tempfile.mkdtemp(prefix="profile-cpu-", dir=root)
    opt_cpu = [0.0]
    real_step = w.optimizer.step

    def opt_step(*a, **kw):
        c = time.thread_time()
        try:
            return real_step(*a, **kw)
        finally:
            opt_cpu[0] += time.thread_time() - c
    w.optimizer.step = opt_step

    def train(ck, first: int, n: int) -> float:
        """``n`` steps; returns the process CPU seconds they took (with the persists' drain)."""
        c = time.process_time()
        for i in range(first, first + n):
            w.optimizer.zero_grad(set_to_none=False)
            w.loss(w.model, w.batch(i)).backward()
            if ck is None:
                w.optimizer.step()
                continue
            t, o = time.thread_time(), opt_cpu[0]
            ck.step(w.optimizer)
            ch.add("step bookkeeping", time.thread_time() - t - (opt_cpu[0] - o))
        if ck is not None:
            ck.wait()
        return time.process_time() - c

    refs = []
    try:
        ck = cfdist.Checkpointer({"model": w.model, "optim": w.optimizer}, f"file://{d}/ckpt",
                                 policy=cfdist.Every(k))
        try:
            train(ck, 1, 2 * k)   # warm-up: arenas allocated, files to reuse exist
            ch.reset()
            n0 = ck.stats["checkpoints"]
            with_ck = train(ck, 2 * k + 1, steps)
            taken = ck.stats["checkpoints"] - n0
            nbytes = ck.stats["bytes"]
            io = ck.stats.get("io")
        finally:
            ck.close()
        without = train(None, 1, steps)
        for _ in range(3):
            refs.append(_reference(nbytes, d))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    ref = {key: statistics.median(r[key] for r in refs) for key in refs[0]}
    per = {s: v / taken for s, v in ch.stage.items()}
    return {"workload": workload, "state_bytes": nbytes, "checkpoints": taken, "steps": steps, "k": k, "io": io,
            "stages_cpu_s": per, "direct_cpu_s": sum(per.values()),
            "reference_cpu_s": ref, "reference_total_s": sum(ref.values()),
            "outside_cpu_s": (with_ck - without) / taken,
            "load_avg": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="mlp", help="a cfdist bench workload: mlp, cnn, gpt, dlrm (default mlp)")
    ap.add_argument("--mb", type=float, default=200, help="model + Adam state, MB (default 200)")
    ap.add_argument("--steps", type=int, default=40, help="measured steps (default 40)")
    ap.add_argument("--k", type=int, default=5, help="steps between checkpoints (default 5)")
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    ap.add_argument("--out", default=None, help="also write profile-cpu.json there")
    a = ap.parse_args()
    r = run(mb=a.mb, steps=a.steps, k=a.k, root=a.dir or tempfile.gettempdir(), workload=a.workload)
    ref = r["reference_total_s"]
    print(f"{r['workload']}, {r['state_bytes'] / 1e6:.0f} MB, {r['checkpoints']} checkpoints (k={r['k']}, io={r['io']}), "
          f"load average {r['load_avg'][0]:.1f}")
    print(f"{'stage':22s} {'CPU s/checkpoint':>16s} {'/ reference':>12s}")
    for s, v in r["stages_cpu_s"].items():
        print(f"{s:22s} {v:16.4f} {v / ref:11.2f}x")
    print(f"{'all stages':22s} {r['direct_cpu_s']:16.4f} {r['direct_cpu_s'] / ref:11.2f}x")
    for s, v in r["reference_cpu_s"].items():
        print(f"reference: {s:11s} {v:16.4f}")
    print(f"whole process, checkpointing run - no-checkpoint run: {r['outside_cpu_s']:.4f} s per checkpoint "
          f"({r['outside_cpu_s'] / ref:.2f}x; indirect costs and noise included)")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "profile-cpu.json"), "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
