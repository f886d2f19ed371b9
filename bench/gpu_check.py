"""The CUDA paths, checked on a GPU machine in under 5 minutes, against DCP async_save (pinned).

    python bench/gpu_check.py                 # JSON into $OUT (or ./gpu_check) ; --mb 512 for a bigger state
    python bench/gpu_check.py /some/dir --mb 256

What it runs (each figure next to its peer, same state, same moment):

1. cfdist snapshot into spare GPU memory (``Auto``'s ``gpu`` mode: device-to-device copy on a
   side stream) and into pinned host memory (``cpu`` mode: device-to-host on a side stream):
   seconds to the gate, against DCP ``async_save`` with a ``DefaultStager`` using pinned
   memory, non-blocking copies and background staging (DCP's best GPU configuration), and
   against a plain ``tensor.to("cpu")`` of the bytes;
2. ``torch.save`` + fsync of the same state, for scale;
3. with 2+ GPUs: DDP over NCCL on every GPU (one process each, ``cpu:gloo,cuda:nccl`` so DCP can
   save), a ``cfdist.Checkpointer`` every 5 steps vs DCP ``async_save`` vs none: outside stall
   per checkpoint (:func:`cfdist.benchmarks.measure.outside_stall`) and wall time;
4. DALI: a GPU pipeline (JPEG decode + random augmentations, ``device_id=0``) through
   ``cfdist.DALIResumableIterator``: batches/s, and a resumed iterator's batches compared with
   the uninterrupted run's;
5. ``host_memory=`` on CUDA tensors (pinned chunks, the side stream): the gate and the whole
   checkpoint under budgets of 100 %, 50 %, 25 % and 10 % of the state, and bit-exactness.

Without CUDA it exits with status 2 and says so; nothing here runs on a CPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default=os.environ.get("OUT", "gpu_check"),
                   help="directory for gpu_check.json (default $OUT, else ./gpu_check)")
    p.add_argument("--mb", type=int, default=512, help="model + Adam state in MB (default 512)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per figure (default 5)")
    p.add_argument("--steps", type=int, default=30, help="DDP steps per method (default 30)")
    p.add_argument("--budget-s", type=float, default=270, help="skip remaining parts past this (default 270)")
    return p.parse_args(argv)


def _sync():
    import torch

    torch.cuda.synchronize()


def snapshot_vs_dcp(mb: int, rounds: int, root: str) -> dict:
    """Seconds until the state is safe from the next update, per method, every round kept."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from cfdist.benchmarks.methods import state_dict
    from cfdist.benchmarks.workloads import build
    from cfdist.checkpoint.flatten import flatten
    from cfdist.checkpoint.snapshot import Snapshotter

    w = build("mlp", mb)
    w.model.cuda()
    w.optimizer = torch.optim.Adam(w.model.parameters(), lr=1e-4)
    w.loss(w.model, tuple(t.cuda() for t in w.batch(0))).backward()
    w.optimizer.step()
    _, tensors = flatten(state_dict(w.model, w.optimizer))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                          use_async_staging=True, use_non_blocking_copy=True))
    snaps = {"gpu": Snapshotter(), "cpu": Snapshotter()}
    out = {k: [] for k in ("cfdist.gpu", "cfdist.cpu", "dcp.async_pinned.staging", "dcp.async_pinned.upload",
                           "to_cpu", "torch.save")}
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for mode, s in snaps.items():   # allocate arenas (not timed)
        s.start(tensors, mode=mode)
        s.wait_copied()
    for i in range(rounds):
        for mode, s in snaps.items():
            _sync()
            t = time.perf_counter()
            s.start(tensors, mode=mode)
            s.wait_copied()
            out[f"cfdist.{mode}"].append(time.perf_counter() - t)
        _sync()
        t = time.perf_counter()
        resp = dcp.async_save(state_dict(w.model, w.optimizer), checkpoint_id=os.path.join(root, f"dcp-{i}"),
                              async_stager=stager, no_dist=True)
        resp.staging_completion.result()
        out["dcp.async_pinned.staging"].append(time.perf_counter() - t)
        resp.upload_completion.result()
        out["dcp.async_pinned.upload"].append(time.perf_counter() - t)
        _sync()
        t = time.perf_counter()
        flat.to("cpu")
        out["to_cpu"].append(time.perf_counter() - t)
        t = time.perf_counter()
        path = os.path.join(root, "ckpt.pt")
        torch.save(state_dict(w.model, w.optimizer), path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        out["torch.save"].append(time.perf_counter() - t)
    stager.close()
    for s in snaps.values():
        s.close()
    med = {k: statistics.median(v) for k, v in out.items()}
    return {"bytes": nbytes, "rounds": out, "median_s": med,
            "cfdist.gpu_vs_dcp_staging": med["cfdist.gpu"] / med["dcp.async_pinned.staging"],
            "cfdist.cpu_vs_dcp_staging": med["cfdist.cpu"] / med["dcp.async_pinned.staging"]}


def _ddp_rank(rank: int, world: int, port: int, mb: int, steps: int, root: str, q) -> None:
    import torch
    import torch.distributed as dist

    from cfdist.benchmarks import methods
    from cfdist.benchmarks.workloads import build

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
    pg = dist.new_group(backend="gloo")
    w = build("mlp", mb, rank=rank)
    w.model.cuda()
    w.optimizer = torch.optim.Adam(w.model.parameters(), lr=1e-4)
    model = torch.nn.parallel.DistributedDataParallel(w.model, device_ids=[rank])
    res = {}
    for name in ("none", "dcp.async", "cfdist"):
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        m = methods.make(name, model=model, opt=w.optimizer, outdir=d, rank=rank, world=world, k=5, pg=pg)
        if name == "dcp.async":   # on a GPU: pinned memory and non-blocking copies (DCP's best)
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            m.stager.close()
            m.stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                    use_async_staging=True, use_non_blocking_copy=True))
        phases, taken = [], 0
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            w.optimizer.zero_grad()
            w.loss(model, tuple(t.cuda() for t in w.batch(i))).backward()
            torch.cuda.synchronize()
            t = time.perf_counter()
            taken += m.phase(i)
            torch.cuda.synchronize()
            phases.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        m.drain()
        m.close()
        res[name] = {"phases": phases, "checkpoints": taken, "wall_s": wall}
    q.put((rank, res))
    dist.destroy_process_group()


def ddp_nccl(mb: int, steps: int, root: str) -> dict:
    import socket

    import torch
    import torch.multiprocessing as mp

    from cfdist.benchmarks import measure

    world = torch.cuda.device_count()
    if world < 2:
        return {"skipped": f"{world} GPU(s): NCCL DDP needs 2 or more"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_ddp_rank, args=(r, world, port, mb, steps, root, q)) for r in range(world)]
    for p in ps:
        p.start()
    got = dict(q.get(timeout=240) for _ in ps)
    for p in ps:
        p.join()
    out = {"world": world}
    for name in got[0]:
        ph = measure.merge_ranks([got[r][name]["phases"] for r in range(world)])
        n = got[0][name]["checkpoints"]
        out[name] = {"wall_s": max(got[r][name]["wall_s"] for r in range(world)),
                     "stall_s": measure.outside_stall(ph, n) if n and name != "none" else None}
    return out


def dali_gpu(root: str) -> dict:
    """A DALI GPU pipeline (decode + random augmentations on device 0) through cfdist's
    resumable iterator: batches/s, and whether a restored iterator repeats the same batches."""
    try:
        import nvidia.dali  # noqa: F401
        from PIL import Image
    except ImportError as e:
        return {"skipped": f"DALI or Pillow not importable: {e}"}
    import numpy as np
    import torch

    from cfdist.data import DALIResumableIterator, ImageFileSource, image_augment_graph

    rng = np.random.default_rng(0)
    files = []
    for i in range(64):
        path = os.path.join(root, f"img{i:03d}.jpg")
        Image.fromarray(rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)).save(path, quality=90)
        files.append(path)
    src = ImageFileSource(files, list(range(len(files))))

    def make():
        return DALIResumableIterator(src, image_augment_graph((32, 32), device="gpu"), ("images", "labels"),
                                     batch_size=8, seed=1, rank=0, world_size=1, device_id=0)

    def take(it, n):
        out, gen = [], iter(it)
        while len(out) < n:
            (b,) = next(gen)
            out.append(b["images"].clone())
        return out

    t = time.perf_counter()
    ref = take(make(), 6)
    per_s = 6 / (time.perf_counter() - t)
    first = make()
    take(first, 3)
    second = make()
    second.load_state_dict(first.state_dict())
    same = all(torch.equal(a, b) for a, b in zip(take(second, 3), ref[3:]))
    return {"on_gpu": bool(ref[0].is_cuda), "batches_per_s_incl_build": per_s, "resumed_batches_identical": same}


def budget_chunks(mb: int, rounds: int, root: str, device: str = "cuda") -> dict:
    """The chunked pipeline of ``host_memory=`` on CUDA tensors (pinned chunks, the side stream):
    per budget, the gate (seconds until the next update may run) and the whole checkpoint (to
    its commit), every round kept; and whether the last committed step equals the live state."""
    import torch

    import cfdist
    from cfdist.benchmarks.workloads import build

    w = build("mlp", mb)
    w.model.to(device)
    w.optimizer = torch.optim.Adam(w.model.parameters(), lr=1e-4)
    w.loss(w.model, tuple(t.to(device) for t in w.batch(0))).backward()
    w.optimizer.step()
    out = {}
    sync = _sync if device == "cuda" else (lambda: None)
    for budget in (None, 0.5, 0.25, 0.1):
        url = f"file://{root}/budget-{budget}"
        ck = cfdist.Checkpointer({"model": w.model, "optim": w.optimizer}, url, cfdist.Every(10 ** 9),
                                 host_memory=budget, keep=1)
        gate, total = [], []
        for _ in range(rounds + 1):   # the first one allocates (not kept)
            sync()
            t = time.perf_counter()
            ck.save()
            ck.gate()
            g = time.perf_counter() - t
            ck.wait()
            gate.append(g)
            total.append(time.perf_counter() - t)
            w.optimizer.step()        # a new state for the next round (after the gate)
            ck.step()
        live = {k: v.detach().cpu() for k, v in w.model.state_dict().items()}
        ck.save(block=True)
        got = cfdist.load(url)["state"]["model"]
        ck.close()
        out[str(budget)] = {"gate_s": gate[1:], "checkpoint_s": total[1:], "bit_exact": all(
            torch.equal(got[k], v) for k, v in live.items()), "chunk_bytes": ck.stats.get("chunk_bytes"),
            "chunk_waits": ck.stats.get("chunk_waits")}
    return out


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: this script needs a CUDA device (torch.cuda.is_available() is False); run it on a "
              "GPU machine. CPU paths are measured by `cfdist bench`.", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    res = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
           "torch": torch.__version__, "mb": a.mb}
    parts = [("snapshot", lambda d: snapshot_vs_dcp(a.mb, a.rounds, d)),
             ("ddp_nccl", lambda d: ddp_nccl(min(a.mb, 256), a.steps, d)),
             ("dali_gpu", dali_gpu),
             ("budget_chunks", lambda d: budget_chunks(min(a.mb, 256), a.rounds, d))]
    for name, fn_ in parts:
        if time.perf_counter() - t0 > a.budget_s:
            res[name] = {"skipped": f"past the {a.budget_s:.0f}s budget"}
            continue
        with tempfile.TemporaryDirectory(prefix=f"gpu-{name}-") as d:
            try:
                res[name] = fn_(d)
            except Exception as e:   # noqa: BLE001 - recorded in the JSON: one part failing must not hide the others
                import traceback

                res[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(f"{name}: {json.dumps(res[name])[:400]}", flush=True)
    res["seconds"] = time.perf_counter() - t0
    path = os.path.join(a.out, "gpu_check.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")
    return 0 if not any("error" in v for v in res.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
