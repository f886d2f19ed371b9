"""Run training jobs under each checkpointing method: real gloo processes, timed from outside.

A :class:`Block` is one set of ranks (spawned processes, one gloo group) training one workload
under several methods, one run after another, ``repeats`` rounds over the methods in the same
order (interleaved: a drift in machine load hits every method alike). Each rank times every
iteration's optimizer phase and the run's wall time and CPU time; the parent merges the ranks.
"""

from __future__ import annotations

import gc
import os
import queue as queue_mod
import shutil
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from cfdist.benchmarks import measure
from cfdist.cluster.exits import ends_process


@dataclass(kw_only=True)
class Block:
    """One spawned group of ranks and the runs it does. Picklable (sent to the ranks)."""

    name: str
    """What the block measures: ``main``, ``workload``, ``size``, ``ranks``, ``auto``."""
    workload: str
    state_mb: float
    world: int
    methods: list[str]
    k: int = 5
    """Checkpoint interval of the fixed-interval methods (steps)."""
    warmup: int = 5
    """Steps before the measured window, a multiple of k: fixed-interval methods checkpoint at
    steps 1, k+1, ..., so the warm-up holds a checkpoint (buffers exist before timing) and the
    window opens on a checkpoint step."""
    steps: int = 10
    """Measured steps (a multiple of k: every checkpoint's aftermath is inside the window)."""
    repeats: int = 1
    tags: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.k < 1 or self.steps < self.k or self.world < 1 or self.repeats < 1 or self.warmup < 1:
            raise ValueError(f"block {self.name}: need k >= 1, steps >= k, world >= 1, repeats >= 1; got "
                             f"k={self.k} steps={self.steps} world={self.world} repeats={self.repeats}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_run(block: Block, method: str, w, model, pg, root: str, rank: int, rep: int) -> dict:
    import torch.distributed as dist

    from cfdist.benchmarks.methods import make

    outdir = os.path.join(root, f"{method}-{rep}")
    if rank == 0:
        os.makedirs(outdir, exist_ok=True)
    dist.barrier()
    m = make(method, model=model, opt=w.optimizer, outdir=outdir, rank=rank, world=block.world,
             k=block.k, pg=pg)
    phases, flags = [], []
    t_start = cpu0 = train0 = None
    phase_cpu = 0.0   # the training thread's CPU inside the optimizer phase (step + checkpoint calls)
    try:
        for i in range(1, block.warmup + block.steps + 1):
            if i == block.warmup + 1:
                dist.barrier()
                t_start, cpu0, train0 = time.perf_counter(), measure.cpu_reading(), time.thread_time()
            w.optimizer.zero_grad(set_to_none=False)
            w.loss(model, w.batch(i)).backward()
            t0, c0 = time.perf_counter(), time.thread_time()
            took = m.phase(i)
            if i > block.warmup:
                phases.append(time.perf_counter() - t0)
                flags.append(bool(took))
                phase_cpu += time.thread_time() - c0
        t_end = time.perf_counter()
        c0 = time.thread_time()
        m.drain()
        phase_cpu += time.thread_time() - c0
        t_drained = time.perf_counter()
        cpu = measure.cpu_delta(cpu0, measure.cpu_reading())
        # what the training thread spent outside the optimizer phases (forward, backward): the
        # same work for every method, and most of the process's CPU, so it is left out of the
        # checkpoint's CPU (its run-to-run noise swamped a checkpoint's share in the difference)
        outside = (time.thread_time() - train0) - phase_cpu
        stats = m.stats()
    finally:
        m.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(outdir, ignore_errors=True)
    return {"block": block.name, "method": method, "repeat": rep, "rank": rank, "phases": phases,
            "checkpoint_steps": flags, "wall_s": t_end - t_start, "drain_s": t_drained - t_end,
            "cpu_s": cpu, "cpu_phase_s": cpu - outside, "stats": stats}


def _die_with_parent() -> None:
    """Linux: a rank gets SIGTERM when the benchmark process dies (no orphans on a shared machine)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


@ends_process
def _rank_main(rank: int, block: Block, port: int, root: str, q) -> None:
    _die_with_parent()
    try:
        import warnings

        import torch.distributed as dist

        from cfdist.benchmarks.workloads import build

        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")   # DCP's no_dist note

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=block.world)
        pg = dist.new_group(backend="gloo")   # DCP's collectives never interleave with DDP's
        w = build(block.workload, block.state_mb, rank=rank)
        model = torch.nn.parallel.DistributedDataParallel(w.model)
        if rank == 0:
            q.put({"info": {"describe": w.describe, "params": w.params}})
        for rep in range(block.repeats):
            for method in block.methods:
                r = _one_run(block, method, w, model, pg, root, rank, rep)
                if method == "none" and rep == 0 and rank == 0:
                    r["state_bytes"] = w.state_bytes
                q.put(r)
                gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        q.put({"done": rank})
        q.close()
        q.join_thread()   # the queue's feeder thread has sent "done" before the process ends
    except BaseException:
        q.put({"error": rank, "traceback": traceback.format_exc()})
        raise


def run_block(block: Block, *, root: str | None = None, timeout_s: float = 3600, log=print) -> dict:
    """Spawn the block's ranks, collect every run; returns ``{"block": ..., "runs": [...]}``.

    Each run merges its ranks: phases per iteration are the slowest rank's, wall time the
    longest rank's, CPU seconds the sum over ranks.
    """
    import torch.multiprocessing as mp

    work = tempfile.mkdtemp(prefix=f"cfdist-bench-{block.name}-", dir=root)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, block, port, work, q))
             for r in range(block.world)]
    for p in procs:
        p.start()
    per_run: dict[tuple, list[dict]] = {}
    info, done = {}, set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < block.world:
            try:
                msg = q.get(timeout=5)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"benchmark block {block.name}: ranks {[procs.index(p) for p in dead]} "
                                       f"died (exit codes {[p.exitcode for p in dead]}) or it ran past "
                                       f"{timeout_s:.0f}s")
                continue
            if "error" in msg:
                raise RuntimeError(f"benchmark block {block.name}, rank {msg['error']} failed:\n{msg['traceback']}")
            if "done" in msg:
                done.add(msg["done"])
            elif "info" in msg:
                info = msg["info"]
            else:
                key = (msg["method"], msg["repeat"])
                per_run.setdefault(key, []).append(msg)
                if len(per_run[key]) == block.world:
                    r0 = next(m for m in per_run[key] if m["rank"] == 0)
                    log(f"  {block.name:9s} {block.workload}:{block.state_mb:g}MB x{block.world} "
                        f"{msg['method']:16s} rep {msg['repeat']}: wall {max(m['wall_s'] for m in per_run[key]):6.2f}s "
                        f"ckpts {sum(r0['checkpoint_steps'])}")
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(work, ignore_errors=True)
    runs = [merge_run(v) for _, v in sorted(per_run.items(), key=lambda kv: (kv[0][1], block.methods.index(kv[0][0])))]
    return {"block": asdict(block), "info": info, "runs": runs}


def merge_run(ranks: list[dict]) -> dict:
    """One run's record from its ranks' records (see :func:`run_block`)."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    r0 = ranks[0]
    phases = measure.merge_ranks([r["phases"] for r in ranks])
    flags = [any(f) for f in zip(*[r["checkpoint_steps"] for r in ranks])]
    out = {"method": r0["method"], "repeat": r0["repeat"], "phases": phases, "checkpoint_steps": flags,
           "checkpoints": sum(flags), "wall_s": max(r["wall_s"] for r in ranks),
           "drain_s": max(r["drain_s"] for r in ranks), "cpu_s": sum(r["cpu_s"] for r in ranks),
           **({"cpu_phase_s": sum(r["cpu_phase_s"] for r in ranks)} if all("cpu_phase_s" in r for r in ranks) else {}),
           "cpu_s_per_rank": [r["cpu_s"] for r in ranks], "phases_per_rank": [r["phases"] for r in ranks],
           "stats": r0["stats"]}
    if "state_bytes" in r0:
        out["state_bytes"] = r0["state_bytes"]
    return out
