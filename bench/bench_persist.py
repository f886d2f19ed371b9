"""Persist throughput against the disk's raw write + fsync, and a simulated multi-node curve.

    python bench/bench_persist.py                       # ~1-2 min on 2 cores -> cfdist-runs/persist/
    python bench/bench_persist.py --quick               # tiny sizes, one round (a smoke test)
    python bench/bench_persist.py --sizes 50,200,800 --roots 1,2,4 --rounds 3 --dir /mnt/nvme --out docs

What one run measures, on the filesystem of ``--dir``, in interleaved rounds (one of each per
round, so a drift in machine load hits every figure alike):

Each round runs every figure once, in an order rotated from round to round, after one untimed
warm-up round.

* ``raw buffered``: ``os.write`` of the bytes in 16 MiB chunks + ``fsync`` (the page cache path);
* ``raw direct``: the same with ``O_DIRECT`` from an aligned buffer (the disk's own speed);
* ``persist`` (:func:`cfdist.checkpoint.persist.write_checkpoint` of a snapshot taken right
  before it, untimed, as in training: shard files, per-tensor xxh3, fsync, manifest, atomic
  commit, the LATEST hint, and retention with ``keep=1``, which retires the previous step
  whose files the next persist writes over), timed around the call, for each ``--io`` mode
  on one root, for ``--roots`` striped roots (directories under ``--dir``: on one disk they
  share its bandwidth; on N disks pass ``--root-dirs``), and for ``--threads`` writer threads
  per file (``O_DIRECT``);
* the c10d Store's round trip (a ``TCPStore`` on loopback): the coordination a multi-writer
  commit needs.

Then a **simulation** (labelled so in the output): FastPersist's 8 -> 64 node curve with one disk
per node, from the measured per-disk persist bandwidth ``B`` and Store round trip ``t``: a
checkpoint of ``M`` bytes written by one node takes ``M / B``; split over ``N`` nodes it takes
``M / (N B) + t (2 + N)`` (every writer reports once, the committer waits and commits).
``--writers 1,2,4`` adds the writers axis: for each number of ranks N, N gloo processes holding
the same ``--writers-mb`` state checkpoint it once with one writer (``writers="node"``) and once
with every rank writing a slice (``writers="all"``), alternating round by round, timed from the
outside (rank 0's snapshot to the manifest visible on storage:
``bench/bench_parallel_persist.py``'s measurement). On one disk the writers share its bandwidth.

``--double-buffer MB`` adds a training loop at k = 1 (every step a checkpoint): an MLP of that
many MB with Adam, one process, ``buffers=1`` and ``buffers=2`` alternating round by round; per
run the loop's step time measured around each iteration, the persists the gate waited for
(``stats["persist_waits"]``) and their seconds, and the mean persist time (does persist keep up?).

Output: ``<out>/persist.json`` and ``<out>/persist.md`` (machine, filesystem, tables, ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

import torch

from cfdist.benchmarks import measure, micro, suite
from cfdist.checkpoint.persist import PersistJob, ShardJob, write_checkpoint
from cfdist.checkpoint.snapshot import Snapshotter
from cfdist.storage import open_storages
from cfdist.storage.direct import unsupported_reason

MB = 1_000_000


def state_of(mb: float) -> dict[str, torch.Tensor]:
    """``mb`` MB of float32 tensors of uneven sizes (like a model's), random content."""
    n = int(mb * MB) // 4
    sizes = [n // 3, n // 4, n // 6, n // 8, n // 12]
    sizes.append(n - sum(sizes))
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.rand(s, generator=g) for i, s in enumerate(sizes)}


class PersistCase:
    """One persist configuration: a snapshot in arenas striped over ``roots`` directories."""

    def __init__(self, tensors, base: str, *, io: str, roots: int, threads: int, root_dirs=None):
        self.io, self.roots, self.threads = io, roots, threads
        self.name = f"persist io={io} roots={roots} threads={threads}"
        dirs = root_dirs[:roots] if root_dirs else [os.path.join(base, f"root{i}") for i in range(roots)]
        self.dir = tempfile.mkdtemp(prefix="persist-", dir=base)
        self.storages = open_storages([f"file://{d}/{os.path.basename(self.dir)}" for d in dirs])
        self.snap = Snapshotter(n_shards=roots)
        self.tensors = tensors
        self.snap.start(tensors)
        self.snap.wait_copied()
        self.step = 0

    def run(self) -> dict:
        # A fresh snapshot right before each persist, not timed: in training persist i reads
        # arenas that snapshot i has just written. Arenas left idle for a second are much
        # slower to read on this VM (hashing 200 MB: 0.13-0.16 s after 0.5 s idle, 0.023 s
        # right after a copy), which made the first version of this bench read 0.63x.
        self.snap.start(self.tensors)
        self.snap.wait_copied()
        self.step += 1
        shards = [ShardJob(index=i, count=len(self.snap.layout), root=i, nbytes=a.nbytes, entries=es)
                  for i, (es, a) in enumerate(zip(self.snap.layout, self.snap.host))]
        job = PersistJob(step=self.step, manifest={"skeleton": {}}, shards=shards, keep=1,
                         arenas=[a.buf for a in self.snap.host], io=self.io, io_threads=self.threads)
        c0, t0 = measure.cpu_reading(), time.perf_counter()
        info = write_checkpoint(self.storages, job)
        s = time.perf_counter() - t0   # timed around the call, not the CommitInfo's own account
        return {"s": s, "cpu_s": measure.cpu_delta(c0, measure.cpu_reading()), "io": info.io}

    def close(self) -> None:
        self.snap.close()
        for st in self.storages:
            shutil.rmtree(st.root, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def store_round_trip(n: int = 200) -> dict:
    """Median seconds of one ``add`` on a loopback TCPStore (the commit coordination's unit)."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, 1, False)
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        client.add("bench/commit", 1)
        ts.append(time.perf_counter() - t0)
    del client, server
    return measure.spread(ts)


def simulate(bw: float, rt: float, sizes_gb=(10, 100), nodes=(1, 8, 16, 32, 64)) -> list[dict]:
    """SIMULATION: one disk per node at ``bw`` bytes/s, a Store round trip of ``rt`` seconds."""
    rows = []
    for gb in sizes_gb:
        m = gb * 1e9
        single = m / bw
        for n in nodes:
            t = m / (n * bw) + rt * (2 + n) if n > 1 else single
            rows.append({"checkpoint_gb": gb, "nodes": n, "single_writer_s": single, "sliced_s": t,
                         "speedup": single / t, "aggregate_gb_s": m / t / 1e9})
    return rows


def writers_axis(a, base: str) -> dict:
    """Snapshot-to-commit seconds, one writer vs every rank, for each N in ``a.writers``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_parallel_persist import one

    out: dict = {"mb": a.writers_mb, "rows": {}}
    for n in a.writers:
        modes = [("node", "node")] + ([("all", "all")] if n > 1 else [])
        rows: dict[str, list[float]] = {m: [] for m, _ in modes}
        for r in range(a.rounds):
            for name, mode in (modes if r % 2 == 0 else modes[::-1]):
                s, out["bytes"] = one(n, a.writers_mb, mode, base)
                rows[name].append(s)
            print(f"  writers axis, {n} rank(s), round {r + 1}/{a.rounds}: " + ", ".join(
                f"writers={k} {v[-1]:.3f} s" for k, v in rows.items()), flush=True)
        out["rows"][str(n)] = rows
    return out


def double_buffer(a, base: str, steps: int = 20, warmup: int = 3) -> dict:
    """k = 1 on an MLP with ``buffers`` 1 and 2: step time from the outside, the gate's waits."""
    import cfdist

    width = int((a.double_buffer * MB / 3 / 4 / 4) ** 0.5)   # 4 width^2 layers, params + 2 Adam moments
    out: dict = {"mb": a.double_buffer, "width": width, "batch": a.db_batch, "runs": {"1": [], "2": []}}
    for r in range(a.rounds):
        for b in ((1, 2) if r % 2 == 0 else (2, 1)):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
            d = tempfile.mkdtemp(prefix="dbuf-", dir=base)
            ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, f"file://{d}", cfdist.Every(1),
                                       buffers=b, keep=2)
            x = torch.randn(a.db_batch, width)
            times = []
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                model(x).square().mean().backward()
                ckpt.step(opt)
                opt.zero_grad()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            st0 = ckpt.stats
            ckpt.close()
            st = ckpt.stats
            out["runs"][str(b)].append({"step_s": statistics.median(times), "steps": steps,
                                        "persist_waits": st0["persist_waits"], "persist_wait_s": st0["persist_wait_s"],
                                        "mean_persist_s": st["mean_persist_s"], "checkpoints": st["checkpoints"],
                                        "arena_bytes": st0["arena_bytes"]})
            shutil.rmtree(d, ignore_errors=True)
            print(f"  double buffer round {r + 1}/{a.rounds}: buffers={b} step {out['runs'][str(b)][-1]['step_s']:.3f} s, "
                  f"waits {st0['persist_waits']}, persist {st['mean_persist_s']:.3f} s", flush=True)
    return out


def run(a) -> dict:
    torch.set_num_threads(1)
    base = os.path.abspath(a.dir or tempfile.gettempdir())
    os.makedirs(base, exist_ok=True)
    t0 = time.time()
    res = {"command": "python bench/bench_persist.py " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
           "machine": suite.machine(), "filesystem": suite.filesystem(base),
           "o_direct": unsupported_reason(base) or "supported", "sizes": {}}
    buf = micro._aligned(16 << 20)
    for mb in a.sizes:
        tensors = state_of(mb)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        cases = [PersistCase(tensors, base, io=io, roots=1, threads=a.threads[0]) for io in a.io]
        if mb == max(a.sizes):   # the other axes at the largest size only (time budget)
            cases += [PersistCase(tensors, base, io=a.io[0], roots=r, threads=a.threads[0], root_dirs=a.root_dirs)
                      for r in a.roots if r != 1]
            cases += [PersistCase(tensors, base, io="direct", roots=1, threads=t) for t in a.threads[1:]
                      if res["o_direct"] == "supported"]
        out = {"bytes": nbytes, "raw buffered": [], "raw direct": [], **{c.name: [] for c in cases}}
        try:
            todo = [("raw buffered", lambda: micro.raw_write(os.path.join(base, "raw.bin"), nbytes, buf)),
                    ("raw direct", lambda: micro.raw_write(os.path.join(base, "raw.bin"), nbytes, buf, direct=True))]
            todo += [(c.name, c.run) for c in cases]
            for _, fn in todo:   # warm-up, not kept: directories, the O_DIRECT probe, first writes
                fn()
            for r in range(a.rounds):
                # rotated each round: no figure always follows the same one (a big delete, a flush)
                for name, fn in todo[r % len(todo):] + todo[:r % len(todo)]:
                    out[name].append(fn())
                print(f"  {mb:g} MB round {r + 1}/{a.rounds}: " + ", ".join(
                    f"{k} {nbytes / v[-1]['s'] / MB:.0f} MB/s" for k, v in out.items()
                    if isinstance(v, list) and v and "s" in v[-1]), flush=True)
        finally:
            for c in cases:
                c.close()
        res["sizes"][str(mb)] = out
        del tensors
    buf.close()
    res["store_add_s"] = store_round_trip()
    if a.writers != [1]:
        res["writers"] = writers_axis(a, base)
    if a.double_buffer:
        res["double_buffer"] = double_buffer(a, base)
    big = res["sizes"][str(max(a.sizes))]
    best = max((k for k in big if k.startswith("persist") and "roots=1 " in k),
               key=lambda k: big["bytes"] / statistics.median(x["s"] for x in big[k]))
    bw = big["bytes"] / statistics.median(x["s"] for x in big[best])
    res["simulation"] = {"label": "SIMULATION (model, not measured)", "per_disk_bytes_s": bw, "from": best,
                         "rows": simulate(bw, res["store_add_s"]["median"])}
    res["seconds"] = time.time() - t0
    return res


def _mbs(nbytes: int, runs: list[dict]) -> str:
    ok = [r for r in runs if "s" in r]
    if not ok:
        return runs[0].get("unsupported", "n/a") if runs else "n/a"
    v = sorted(nbytes / r["s"] / MB for r in ok)
    return f"{statistics.median(v):.0f} [{v[0]:.0f}, {v[-1]:.0f}]"


def _ratio(runs: list[dict], ref: list[dict]) -> float | None:
    """Median over rounds of (throughput / the reference's in the same round)."""
    pairs = [r2["s"] / r["s"] for r, r2 in zip(runs, ref) if "s" in r and "s" in r2]
    return statistics.median(pairs) if pairs else None


def markdown(res: dict) -> str:
    mc, fs = res["machine"], res["filesystem"]
    out = ["# cfdist persist: throughput against the disk", "",
           f"Reproduce: `{res['command']}`, started {res['started']}, took {res['seconds']:.0f} s.", "",
           f"Machine: {mc['cpu_count']} cores ({mc['cpu_model']}), {mc['memory_gb']} GB RAM, python {mc['python']}, "
           f"torch {mc['torch']}; {mc['platform']}. Load average at start "
           f"{'/'.join(f'{x:.1f}' for x in mc['load_avg_start'] or [])}.",
           f"Checkpoints on {fs.get('type')} ({fs.get('device')}, {fs.get('size_gb')} GB); O_DIRECT: {res['o_direct']}. "
           f"All roots are directories on this one disk unless `--root-dirs` named others.", "",
           *([res["note"], ""] if res.get("note") else []),
           "Figures are MB/s, median [min, max] over interleaved rounds; a ratio is the median over rounds of "
           "(that round's throughput / the reference's in the same round). `persist` = "
           "`write_checkpoint` of a snapshot taken right before it (untimed, as in training): shard files, "
           "per-tensor xxh3 (on a thread beside the writes), fsync, manifest, atomic commit, the LATEST hint "
           "and retention (`keep=1`: the previous step is retired and its files written over by the next "
           "persist), timed around the call. `raw` writes a new file of the same bytes and fsyncs it (its "
           "delete, after the timing, is not counted).", ""]
    for mb, d in res["sizes"].items():
        n = d["bytes"]
        out += [f"## {mb} MB", "", "| what | MB/s | / raw buffered | / raw direct | CPU s per GB |",
                "|---|---:|---:|---:|---:|"]
        for k, v in d.items():
            if not isinstance(v, list):
                continue
            rb, rd = _ratio(v, d["raw buffered"]), _ratio(v, d["raw direct"])
            io = f" (wrote {v[0]['io']})" if v and v[0].get("io") else ""
            cpu = [r["cpu_s"] for r in v if r.get("cpu_s") is not None]
            cpu = f"{statistics.median(cpu) / (n / 1e9):.2f}" if cpu else ""
            out.append(f"| {k}{io} | {_mbs(n, v)} | {f'{rb:.2f}x' if rb else ''} | {f'{rd:.2f}x' if rd else ''} | {cpu} |")
        out.append("")
    if res.get("writers"):
        w = res["writers"]
        out += [f"## Writers: one writer vs every rank writing a slice ({w['bytes'] / MB:.0f} MB state)", "",
                "Seconds from rank 0's snapshot to the manifest visible on storage, median [min, max] over "
                "alternating rounds; N gloo ranks on this machine, all writing to the one disk.", "",
                "| ranks | writers=node (one writer) | writers=all | one / all |", "|---:|---:|---:|---:|"]
        for n, rows in w["rows"].items():
            one_ = sorted(rows["node"])
            all_ = sorted(rows.get("all", []))
            cell = lambda v: f"{statistics.median(v):.3f} [{v[0]:.3f}, {v[-1]:.3f}]" if v else "-"   # noqa: E731
            ratio = f"{statistics.median(one_) / statistics.median(all_):.2f}x" if all_ else ""
            out.append(f"| {n} | {cell(one_)} | {cell(all_)} | {ratio} |")
        out.append("")
    if res.get("double_buffer"):
        db = res["double_buffer"]
        out += [f"## Double buffering at k = 1 ({db['mb']:g} MB MLP + Adam, batch {db.get('batch')}, one process)", "",
                "Every step is a checkpoint. Step time measured around each iteration (forward, backward, "
                "`ckpt.step`), median per run; `waits` = snapshots that had to wait for a persist to free a "
                "buffer set (`stats['persist_waits']`), over the timed steps and the warm-up.", "",
                "| buffers | step s (median of runs) | waits per run | wait s per run | mean persist s | host arena MB |",
                "|---:|---:|---:|---:|---:|---:|"]
        for b, runs in db["runs"].items():
            if runs:
                med = lambda k: statistics.median(r[k] for r in runs)   # noqa: E731
                out.append(f"| {b} | {med('step_s'):.3f} | {', '.join(str(r['persist_waits']) for r in runs)} | "
                           f"{med('persist_wait_s'):.2f} | {med('mean_persist_s'):.3f} | {runs[0]['arena_bytes'] / MB:.0f} |")
        out.append("")
    st = res["store_add_s"]
    sim = res["simulation"]
    out += [f"c10d Store round trip (TCPStore on loopback, `add`): median {st['median'] * 1e6:.0f} us "
            f"[{st['min'] * 1e6:.0f}, {st['max'] * 1e6:.0f}].", "",
            f"## {sim['label']}: one disk per node, 8 -> 64 nodes", "",
            f"Per-disk bandwidth B = {sim['per_disk_bytes_s'] / MB:.0f} MB/s (measured above: {sim['from']}), "
            f"coordination t = the Store round trip. One writer: M / B. Sliced over N nodes: "
            f"M / (N B) + t (2 + N). Not measured: no network, stragglers or shared-tier uploads are modelled.", "",
            "| checkpoint | nodes | one writer (s) | sliced (s) | speedup | aggregate GB/s |",
            "|---:|---:|---:|---:|---:|---:|"]
    for r in sim["rows"]:
        out.append(f"| {r['checkpoint_gb']} GB | {r['nodes']} | {r['single_writer_s']:.1f} | {r['sliced_s']:.2f} | "
                   f"{r['speedup']:.1f}x | {r['aggregate_gb_s']:.1f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]   # noqa: E731
    p.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")], default=[50, 200, 800],
                   help="state sizes in MB (default 50,200,800)")
    p.add_argument("--roots", type=ints, default=[1, 2, 4], help="striped roots at the largest size (default 1,2,4)")
    p.add_argument("--root-dirs", type=lambda s: s.split(","), default=None,
                   help="comma-separated directories, one per root (separate disks); default: under --dir")
    p.add_argument("--io", type=lambda s: s.split(","), default=["auto", "buffered"],
                   help="io modes on one root (default auto,buffered)")
    p.add_argument("--threads", type=ints, default=[1, 2, 4],
                   help="O_DIRECT writer threads per file; the first is used everywhere, the others at the "
                        "largest size (default 1,2,4)")
    p.add_argument("--writers", type=ints, default=[1],
                   help="ranks for the writers axis, e.g. 1,2,4 (default 1: no writers axis)")
    p.add_argument("--writers-mb", type=float, default=200.0, help="state size of the writers axis (MB)")
    p.add_argument("--double-buffer", type=float, default=0.0, metavar="MB",
                   help="also a k=1 training loop of an MLP of this many MB, buffers 1 vs 2 (0: off)")
    p.add_argument("--db-batch", type=int, default=2048,
                   help="batch of the double-buffer loop (sets its compute time against the persist)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the files are written (default: the temp dir)")
    p.add_argument("--out", default=os.path.join("cfdist-runs", "persist"))
    p.add_argument("--note", default=None, help="a paragraph for the report (e.g. how loaded the machine was)")
    p.add_argument("--quick", action="store_true", help="4 and 16 MB, one round (a smoke test)")
    p.add_argument("--render", metavar="JSON", default=None, help="only write the markdown of an earlier persist.json")
    a = p.parse_args(argv)
    if a.render:
        with open(a.render) as f:
            res = json.load(f)
        if a.note:
            res["note"] = a.note
        _write_md(a.out, markdown(res))
        return 0
    if a.quick:
        a.sizes, a.rounds, a.roots, a.threads, a.writers_mb = [4, 16], 1, [1, 2], [1, 2], 8.0
    res = run(a)
    if a.note:
        res["note"] = a.note
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "persist.json"), "w") as f:
        json.dump(res, f, indent=1)
    _write_md(a.out, markdown(res))
    print(f"wrote {a.out}/persist.md and persist.json")
    return 0


def _write_md(out: str, text: str) -> None:
    """Write ``out/persist.md``, keeping the section ``bench/bench_shared_upload.py`` put there."""
    from bench_shared_upload import BEGIN, END

    path = os.path.join(out, "persist.md")
    try:
        with open(path) as f:
            old = f.read()
    except FileNotFoundError:
        old = ""
    if BEGIN in old and END in old:
        text = text.rstrip("\n") + "\n\n" + old[old.index(BEGIN):old.index(END) + len(END)] + "\n"
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
