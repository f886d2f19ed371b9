"""What cfdist.codecs buy and cost, measured in one run.

    python bench/bench_codecs.py                     # defaults sized for a 2-core CPU machine (~2 min)
    python bench/bench_codecs.py --rows 1000000 --steps 600 --json codecs.json

Sections:

1. **throughput per core** (torch and zstd on one thread, CPU time of that thread): encode and
   decode MB/s of logical bytes for each codec on an embedding table (1% of its rows changed since the reference)
   and on a dense tensor;
2. **bytes written per checkpoint** by a DLRM-like model (``--tables`` embedding tables of
   ``--rows`` x ``--dim`` with SparseAdam, an MLP with Adam, synthetic clicks), measured as
   the sizes of the files on disk, for no codecs, ``Incremental``, ``Incremental +
   Quantize(8)``, ``+ Quantize(4)`` (and each with ``Zstd``): the mean over all checkpoints of
   a run (full ones included) and over the increments only, as ratios to the full checkpoint;
3. **overhead at k**: per iteration of the same training with checkpoints every ``--every``
   steps, with and without codecs, against no checkpointing: wall time (noisy on a shared
   machine), CPU time of the whole process (training + snapshot + persist + encoding: what the
   codecs add when cores are scarce), the stall at the gate, and the persist time;
4. **lossy resume**: the DLRM restored from 4- and 8-bit checkpoints (once, and at every
   ``--restore-every`` steps), its loss at the end against the uninterrupted run, and the
   extra iterations it needs to reach the uninterrupted run's final loss;
5. **LC-Checkpoint**: ``LCDelta(bits=3)`` on the checkpoints of a dense MLP over training:
   compression ratio per checkpoint (the paper reports up to 28x), and the loss after
   restoring from the newest one.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import tempfile
import time
import warnings

import numpy as np
import torch

import cfdist
from cfdist.checkpoint import reader
from cfdist.checkpoint.codecs import chain, pipeline
from cfdist.checkpoint.persist import PersistJob, ShardJob, write_checkpoint
from cfdist.checkpoint.snapshot import plan_layout
from cfdist.codecs import Incremental, LCDelta, LossyCheckpointWarning, Quantize, Zstd
from cfdist.storage import open_storages


# ---- 1. throughput ---------------------------------------------------------------------------------

def _job(step, tensors, codecs):
    layout = plan_layout(tensors, 1)
    buf = torch.empty(sum(e.nbytes for e in layout[0]), dtype=torch.uint8)
    for e in layout[0]:
        buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(tensors[e.name])
    return PersistJob(step=step, manifest={"skeleton": {k: {"__t__": k} for k in tensors}},
                      shards=[ShardJob(index=0, count=1, root=0, nbytes=buf.numel(), entries=layout[0])],
                      keep=10, arenas=[buf], codecs=tuple(codecs), codec_session="bench")


def throughput(rows: int, dim: int, reps: int = 2) -> list[dict]:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    table = torch.from_numpy(rng.standard_normal((rows, dim), dtype=np.float32) * 0.1)
    table2 = table.clone()
    idx = torch.from_numpy(rng.choice(rows, rows // 100, replace=False))
    table2[idx] += 0.01
    dense = torch.from_numpy(rng.standard_normal(rows * dim, dtype=np.float32))
    dense2 = dense - 1e-3 * torch.from_numpy(rng.standard_normal(rows * dim, dtype=np.float32))
    cases = [("Zstd(1)", [Zstd(level=1)], "table"), ("Zstd(3)", [Zstd(level=3)], "table"),
             ("Incremental, 1% rows", [Incremental()], "table"),
             ("Quantize(8)", [Quantize(bits=8)], "table"), ("Quantize(4)", [Quantize(bits=4)], "table"),
             ("Quantize(4, adaptive)", [Quantize(bits=4, method="adaptive")], "table"),
             ("LCDelta(3)", [LCDelta(bits=3)], "dense"), ("LCDelta(3)+Zstd(1)", [LCDelta(bits=3), Zstd(level=1)], "dense")]
    out = []
    for name, codecs, kind in cases:
        first, second = ({"t": table}, {"t": table2}) if kind == "table" else ({"t": dense}, {"t": dense2})
        best_e = best_d = float("inf")
        for _ in range(reps):
            root = f"memory://bench-codecs-{time.monotonic_ns()}"
            sts = open_storages(root)
            write_checkpoint(sts, _job(1, first, codecs))      # the reference (full)
            job = _job(2, second, codecs)
            sess = pipeline.begin(sts, 2, job.codecs, job.codec_session)
            t0 = time.thread_time()     # CPU time of this thread: per core, whatever else runs
            enc = pipeline.encode_shard(sess, job.shards[0].entries, job.arenas[0].numpy())
            best_e = min(best_e, time.thread_time() - t0)
            stored_bytes = enc.nbytes
            write_checkpoint(sts, job)
            m = reader.read_manifest(sts, 2)
            raw = reader.read_stored(sts, 2, m)
            t0 = time.thread_time()
            pipeline.decode_tensors(sts, 2, m, raw)
            best_d = min(best_d, time.thread_time() - t0)
            chain.forget(root)
            sts[0].remove("")
        mb = second["t"].numel() * 4 / 1e6
        out.append({"codec": name, "tensor": kind, "MB": mb, "encode_MBps": mb / best_e, "decode_MBps": mb / best_d,
                    "ratio": second["t"].numel() * 4 / stored_bytes})
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    return out


# ---- the DLRM-like workload -------------------------------------------------------------------------

class DLRM(torch.nn.Module):
    """``tables`` embedding tables (sparse gradients) feeding an MLP with 4 dense features."""

    def __init__(self, tables: int, rows: int, dim: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embedding = torch.nn.ModuleList(torch.nn.Embedding(rows, dim, sparse=True) for _ in range(tables))
        for e in self.embedding:
            torch.nn.init.normal_(e.weight, 0, 0.05, generator=g)
        torch.manual_seed(seed)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(tables * dim + 4, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, ids, dense):
        return self.mlp(torch.cat([e(ids[:, i]) for i, e in enumerate(self.embedding)] + [dense], 1)).squeeze(1)


class TwoOptim:
    def __init__(self, m: DLRM):
        self.sparse = torch.optim.SparseAdam([e.weight for e in m.embedding], lr=0.02)
        self.dense = torch.optim.Adam(m.mlp.parameters(), lr=0.003)

    def step(self):
        self.sparse.step()
        self.dense.step()

    def zero_grad(self):
        self.sparse.zero_grad()
        self.dense.zero_grad()


class Clicks:
    """Synthetic click data: a hidden per-row affinity decides the click (learnable, skewed ids)."""

    def __init__(self, tables: int, rows: int, batch: int):
        g = torch.Generator().manual_seed(1234)
        self.aff = torch.randn(tables, rows, generator=g)
        self.tables, self.rows, self.batch = tables, rows, batch

    def __call__(self, step: int):
        g = torch.Generator().manual_seed(step)
        ids = ((torch.rand(self.batch, self.tables, generator=g) ** 2) * self.rows).long()
        dense = torch.randn(self.batch, 4, generator=g)
        logit = sum(self.aff[t, ids[:, t]] for t in range(self.tables)) + dense[:, 0]
        y = (torch.rand(self.batch, generator=g) < torch.sigmoid(2 * logit)).float()
        return ids, dense, y


def dlrm_state(m, opt):
    return {"model": m, "sparse": opt.sparse, "dense": opt.dense}


def train_steps(m, opt, data, ckpt, start, n):
    losses = []
    for s in range(start, start + n):
        ids, dense, y = data(s)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(m(ids, dense), y)
        loss.backward()
        if ckpt is not None:
            ckpt.step(opt)
        else:
            opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def dir_bytes(d: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


CONFIGS = {
    "none": None,
    "Incremental": [Incremental(full_every=10)],
    "Incremental+Quantize(8)": [Incremental(full_every=10), Quantize(bits=8, match="*embedding*")],
    "Incremental+Quantize(4)": [Incremental(full_every=10), Quantize(bits=4, match="*embedding*")],
    "Zstd(3)": [Zstd(level=3)],
    "Incremental+Zstd(3)": [Incremental(full_every=10), Zstd(level=3)],
    "Incremental+Quantize(8)+Zstd(3)": [Incremental(full_every=10), Quantize(bits=8, match="*embedding*"), Zstd(level=3)],
    "Incremental+Quantize(4)+Zstd(3)": [Incremental(full_every=10), Quantize(bits=4, match="*embedding*"), Zstd(level=3)],
}


def bytes_and_overhead(a, tmp: pathlib.Path) -> tuple[list[dict], dict]:
    data = Clicks(a.tables, a.rows, a.batch)
    out, t_iter = [], {}
    for name in ["no checkpoints"] + list(CONFIGS):
        m, opt = DLRM(a.tables, a.rows, a.dim), None
        opt = TwoOptim(m)
        root = tmp / name.replace("+", "_").replace("(", "").replace(")", "").replace(" ", "_")
        ck = None
        if name != "no checkpoints":
            ck = cfdist.Checkpointer(dlrm_state(m, opt), f"file://{root}", cfdist.Every(a.every), keep=10_000,
                                     codecs=CONFIGS[name])
        train_steps(m, opt, data, None, 0, 3)          # warm-up, no checkpoints
        t0, c0 = time.perf_counter(), time.process_time()
        train_steps(m, opt, data, ck, 3, a.steps)
        if ck is not None:
            ck.close()
        t_iter[name] = (time.perf_counter() - t0) / a.steps
        cpu = (time.process_time() - c0) / a.steps
        if ck is None:
            cpu_none = cpu
        if ck is None:
            continue
        per = {int(d.name[5:]): dir_bytes(d) for d in sorted(root.glob("step-*"))}
        metas = {s: json.loads((root / f"step-{s:09d}" / "MANIFEST.json").read_text()) for s in per}
        incs = [b for s, b in per.items() if metas[s].get("depends_on")]
        out.append({"config": name, "checkpoints": len(per), "mean_bytes": float(np.mean(list(per.values()))),
                    "mean_increment_bytes": float(np.mean(incs)) if incs else None,
                    "logical_bytes": ck.stats["bytes_logical"] / max(ck.stats["checkpoints"], 1),
                    "iter_s": t_iter[name], "cpu_per_iter_s": cpu, "stall_s": ck.stats["mean_stall_s"],
                    "persist_s": ck.stats["mean_persist_s"]})
        shutil.rmtree(root)
        chain.forget(f"file://{root}")
    full = next(r for r in out if r["config"] == "none")["mean_bytes"]
    for r in out:
        r["x_less_all"] = full / r["mean_bytes"]
        r["x_less_increments"] = full / r["mean_increment_bytes"] if r["mean_increment_bytes"] else None
        r["overhead_vs_no_ckpt"] = r["iter_s"] / t_iter["no checkpoints"] - 1
        r["cpu_overhead_vs_no_ckpt"] = r["cpu_per_iter_s"] / cpu_none - 1
    return out, t_iter


# ---- 4. lossy resume ---------------------------------------------------------------------------------

def _smooth(x, w):
    return np.convolve(x, np.ones(w) / w, mode="valid")


def lossy_resume(a, tmp: pathlib.Path) -> list[dict]:
    data = Clicks(a.tables, a.rows, a.batch)
    n, extra_max, w = a.resume_steps, a.resume_steps, 50
    m, opt = DLRM(a.tables, a.rows, a.dim), None
    opt = TwoOptim(m)
    ref = train_steps(m, opt, data, None, 0, n + extra_max)
    target = _smooth(ref[:n], w)[-1]
    out = []
    for bits in (8, 4):
        for restores in ("once", "every"):
            points = [n // 2] if restores == "once" else list(range(a.restore_every, n, a.restore_every))
            root = tmp / f"resume{bits}{restores}"
            codecs = [Incremental(full_every=10), Quantize(bits=bits, match="*embedding*")]
            m, opt = DLRM(a.tables, a.rows, a.dim), None
            opt = TwoOptim(m)
            losses, s = [], 0
            for p in points + [n + extra_max]:
                ck = cfdist.Checkpointer(dlrm_state(m, opt), f"file://{root}", cfdist.Every(a.every), codecs=codecs)
                if s:
                    m, opt = DLRM(a.tables, a.rows, a.dim, seed=99), None     # a fresh process after a crash
                    opt = TwoOptim(m)
                    ck.close()
                    ck = cfdist.Checkpointer(dlrm_state(m, opt), f"file://{root}", cfdist.Every(a.every), codecs=codecs)
                    assert ck.restore() == s
                losses += train_steps(m, opt, data, ck, s, p - s)
                ck.close()
                chain.forget(f"file://{root}")
                s = p
            sm = _smooth(np.array(losses), w)
            reach = np.flatnonzero(sm[n - w:] <= target)
            out.append({"bits": bits, "restores": len(points), "final_loss": float(_smooth(losses[:n], w)[-1]),
                        "uninterrupted_final_loss": float(target),
                        "loss_gap": float(_smooth(losses[:n], w)[-1] - target),
                        "extra_iterations": int(reach[0] - 0) if len(reach) else f">{extra_max}"})
            shutil.rmtree(root)
    return out


# ---- 5. LC-Checkpoint on a dense model ----------------------------------------------------------------

def lc_checkpoint(a, tmp: pathlib.Path, bits: int) -> dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, a.hidden), torch.nn.ReLU(), torch.nn.Linear(a.hidden, a.hidden),
                              torch.nn.ReLU(), torch.nn.Linear(a.hidden, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(64, 10, generator=g)
    root = tmp / "lc"
    ck = cfdist.Checkpointer({"model": net}, f"file://{root}", cfdist.Every(a.every), keep=10_000,
                             codecs=[LCDelta(bits=bits, full_every=None)])
    losses = []
    for s in range(a.lc_steps):
        x = torch.randn(128, 64, generator=torch.Generator().manual_seed(s))
        loss = torch.nn.functional.cross_entropy(net(x), (x @ proj).argmax(1))
        loss.backward()
        ck.step(opt)
        opt.zero_grad()
        losses.append(float(loss.detach()))
    ck.close()
    logical = sum(p.numel() * 4 for p in net.state_dict().values())
    ratios = []
    for d in sorted(root.glob("step-*"))[1:]:
        shard = next(d.glob("*.safetensors"))
        ratios.append(logical / shard.stat().st_size)
    restored = cfdist.load(f"file://{root}")["state"]["model"]
    err = max(float((restored[k] - v).abs().max()) for k, v in net.state_dict().items())
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(10 ** 6))
    y = (x @ proj).argmax(1)
    with torch.no_grad():
        l_live = float(torch.nn.functional.cross_entropy(net(x), y))
        net.load_state_dict(restored)
        l_rest = float(torch.nn.functional.cross_entropy(net(x), y))
    shutil.rmtree(root)
    return {"bits": bits, "params": logical // 4, "checkpoints": len(ratios) + 1, "ratio_min": min(ratios),
            "ratio_median": float(np.median(ratios)), "ratio_max": max(ratios), "max_abs_error": err,
            "heldout_loss_live": l_live, "heldout_loss_restored": l_rest}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100, help="steps per config for the bytes/overhead runs")
    ap.add_argument("--every", type=int, default=10, help="checkpoint interval k")
    ap.add_argument("--resume-steps", type=int, default=300)
    ap.add_argument("--restore-every", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--lc-steps", type=int, default=200)
    ap.add_argument("--lc-bits", default="1,2,3", help="LCDelta bit widths to compare")
    ap.add_argument("--tp-rows", type=int, default=200_000, help="table rows for the throughput section")
    ap.add_argument("--sections", default="throughput,bytes,resume,lc")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore", LossyCheckpointWarning)   # every restore here is lossy on purpose
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="cfdist-bench-codecs-"))
    res: dict = {"args": vars(a)}
    try:
        if "throughput" in a.sections:
            res["throughput"] = throughput(a.tp_rows, 64)
            print(f"\n1. throughput per core ({a.tp_rows}x64 float32 = {a.tp_rows * 256 / 1e6:.0f} MB, 1 thread)")
            print(f"{'codec':28s} {'tensor':6s} {'encode MB/s':>12s} {'decode MB/s':>12s} {'ratio':>7s}")
            for r in res["throughput"]:
                print(f"{r['codec']:28s} {r['tensor']:6s} {r['encode_MBps']:12.0f} {r['decode_MBps']:12.0f} "
                      f"{r['ratio']:6.1f}x")
        if "bytes" in a.sections:
            rows, t = bytes_and_overhead(a, tmp)
            res["bytes"] = rows
            print(f"\n2-3. DLRM {a.tables}x{a.rows}x{a.dim} tables + SparseAdam, batch {a.batch}, k={a.every}, "
                  f"{a.steps} steps; bytes on disk per checkpoint (no-ckpt iteration "
                  f"{t['no checkpoints'] * 1e3:.1f} ms)")
            print(f"{'config':34s} {'mean bytes':>12s} {'x less':>7s} {'increment':>12s} {'x less':>7s} "
                  f"{'wall ovh':>9s} {'CPU ovh':>8s} {'stall ms':>9s} {'persist s':>9s}")
            for r in rows:
                inc = f"{r['mean_increment_bytes']:12,.0f} {r['x_less_increments']:6.1f}x" if r["mean_increment_bytes"] \
                    else f"{'-':>12s} {'-':>7s}"
                print(f"{r['config']:34s} {r['mean_bytes']:12,.0f} {r['x_less_all']:6.1f}x {inc} "
                      f"{100 * r['overhead_vs_no_ckpt']:8.1f}% {100 * r['cpu_overhead_vs_no_ckpt']:7.1f}% "
                      f"{1e3 * r['stall_s']:9.2f} {r['persist_s']:9.3f}")
        if "resume" in a.sections:
            res["resume"] = lossy_resume(a, tmp)
            print(f"\n4. lossy resume (loss = mean of 50 steps at step {a.resume_steps})")
            for r in res["resume"]:
                print(f"Quantize({r['bits']}) restored {r['restores']:2d}x: loss {r['final_loss']:.4f} vs "
                      f"{r['uninterrupted_final_loss']:.4f} uninterrupted (gap {r['loss_gap']:+.4f}), "
                      f"extra iterations to reach it: {r['extra_iterations']}")
        if "lc" in a.sections:
            res["lc"] = [lc_checkpoint(a, tmp, int(b)) for b in a.lc_bits.split(",")]
            r = res["lc"][0]
            print(f"\n5. LCDelta on a dense MLP ({r['params']:,} params, SGD momentum, k={a.every}, "
                  f"{r['checkpoints']} checkpoints, one chain)")
            for r in res["lc"]:
                print(f"bits={r['bits']}: ratio min {r['ratio_min']:.1f}x median {r['ratio_median']:.1f}x max "
                      f"{r['ratio_max']:.1f}x; max |error| {r['max_abs_error']:.2e}; held-out loss "
                      f"{r['heldout_loss_restored']:.4f} restored vs {r['heldout_loss_live']:.4f} live")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
