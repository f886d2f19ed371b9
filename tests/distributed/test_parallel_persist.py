"""``Checkpointer(writers="all")``: every gloo rank writes a slice, rank 0 commits once.

Real: 2 or 3 spawned processes, a gloo process group on a FileStore in tmp_path, DDP over a
small MLP (about 4 MB of parameters and Adam moments, so every slice is several MB), Adam,
``file://`` roots in tmp_path (ext4 or whatever the test machine has), SIGKILL of a writer.
Faked: nothing; the kill is the writer process killing itself (SIGKILL) from inside its own
write of a shard file, so it dies mid-write at a known point.
The points: each rank's filesystem writes (``/proc/self/io`` ``write_bytes``, bytes the
process caused to be written to storage, and ``wchar``) during one checkpoint are its share
of the checkpoint's bytes; every rank restores bit-exact; a writer killed mid-write leaves
that step uncommitted and the previous one intact and restorable; striping over 2 roots and
slicing over 3 writers together.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import cfdist
from cfdist.checkpoint import discovery
from cfdist.cluster.exits import ends_process, exit_process
from cfdist.storage import open_storage
from cfdist.testing import StorageWrapper


class DieMidWrite(StorageWrapper):
    """Writes the first chunks of a shard file of ``step``, then SIGKILLs its own process."""

    def __init__(self, inner, step: int):
        super().__init__(inner)
        self.step = step

    def write_file(self, rel, chunks, *, fsync=True):
        if f"step-{self.step:09d}" in rel and rel.endswith(".safetensors"):
            def die_after_two(it=iter(chunks)):
                yield next(it)
                yield next(it)
                os.kill(os.getpid(), signal.SIGKILL)
            return self.inner.write_file(rel, die_after_two(), fsync=fsync)
        return self.inner.write_file(rel, chunks, fsync=fsync)


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _save_measured(ckpt) -> dict[str, int]:
    """``ckpt.save(block=True)``; what this process wrote meanwhile (``/proc/self/io`` deltas)."""
    before = _io()
    ckpt.save(block=True)
    after = _io()
    return {k: after[k] - before[k] for k in ("write_bytes", "wchar")}


def _check_shares(dirs, step: int, io: list[dict]) -> None:
    """The manifest names each file's writer and root; each writer's files hold its share of
    the bytes, and its process wrote them (and nothing of the others')."""
    world, roots = len(io), len(dirs)
    d = f"step-{step:09d}"
    m = json.loads(open(dirs[0] / d / "MANIFEST.json").read())
    assert m["slicing"]["writers"] == world and len(m["shards"]) == world * roots
    assert sorted((s["writer"], s["root"]) for s in m["shards"]) == [(w, r) for w in range(world) for r in range(roots)]
    files = {w: sum(os.path.getsize(dirs[s["root"]] / d / s["file"]) for s in m["shards"] if s["writer"] == w)
             for w in range(world)}
    total = sum(files.values())
    for w in range(world):
        assert abs(files[w] - total / world) < 0.02 * total / world + 16384, files   # balanced by bytes
        assert abs(io[w]["write_bytes"] - files[w]) < 0.1 * files[w] + (1 << 20), (w, io[w], files)
        assert files[w] <= io[w]["wchar"] < files[w] + (1 << 20), (w, io[w], files)


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 80),
                            torch.nn.BatchNorm1d(80))
    ddp = DDP(m)
    return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-3)


def _train(ddp, opt, ckpt, rank, start, steps):
    for i in range(start, start + steps):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(100 * i + rank))
        ddp(x).pow(2).mean().backward()
        ckpt.step(opt)
        opt.zero_grad()


def _flat(ddp, opt) -> torch.Tensor:
    sd = ddp.state_dict()
    parts = [sd[k].reshape(-1).double() for k in sorted(sd)]
    parts += [opt.state[p][k].reshape(-1).double() for p in ddp.parameters() for k in ("exp_avg", "exp_avg_sq")]
    return torch.cat(parts)


def _init(rank, world, store_path):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    torch.set_num_threads(1)


@ends_process
def _share_worker(rank, world, store_path, urls, out):
    """Checkpoint step 3 (sliced), measure this process's writes; restore into fresh models."""
    _init(rank, world, store_path)
    res = {}
    try:
        ddp, opt = _model()
        ckpt = cfdist.Checkpointer({"model": ddp, "optim": opt}, urls, cfdist.Every(1000), writers="all")
        _train(ddp, opt, ckpt, rank, 0, 3)
        # each rank's own state: BatchNorm statistics differ between replicas, and each rank
        # restores its own (they travel with its RNG states)
        torch.save(_flat(ddp, opt), os.path.join(out, f"ref-{rank}.pt"))
        res["io"] = _save_measured(ckpt)
        res["latest"] = ckpt.latest_step
        ckpt.close()
        dist.barrier()

        torch.manual_seed(1 + rank)                       # different weights on each rank
        ddp2, opt2 = _model()
        with torch.no_grad():
            for p in ddp2.parameters():
                p.add_(torch.randn_like(p))
        ckpt2 = cfdist.Checkpointer({"model": ddp2, "optim": opt2}, urls, cfdist.Every(1000), writers="all")
        res["restored"] = ckpt2.restore()
        res["bitexact"] = torch.equal(_flat(ddp2, opt2), torch.load(os.path.join(out, f"ref-{rank}.pt")))
        _train(ddp2, opt2, ckpt2, rank, 3, 2)             # and it goes on, writing slices again
        # The committing rank (0) has not collected step 5's commit yet when the others read
        # latest_step: they know it from their own persist's outcome (they read the store's
        # stale 3 before, whenever rank 0 was slower to collect than they were to read)
        h = ckpt2.save(block=rank != 0)
        if rank != 0:
            res["latest2"] = ckpt2.latest_step
        dist.barrier()
        if rank == 0:
            h.wait()
            res["latest2"] = ckpt2.latest_step
        ckpt2.close()
        dist.barrier()
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


def test_three_ranks_two_roots_write_their_shares_and_restore_bitexact(tmp_path):
    """See the module docstring (all real): slicing over 3 writers and striping over 2 roots.
    Each rank's ``write_bytes`` during the checkpoint is its files' size (within 10 %), each
    about a third; the manifest names each file's writer and root; every rank restores step 3
    bit-exact and goes on to commit step 5. (2 ranks: the kill test below measures the same.)"""
    world, roots = 3, 2
    urls = [f"file://{tmp_path / f'root{r}'}" for r in range(roots)]
    mp.start_processes(_share_worker, args=(world, str(tmp_path / "store"), urls, str(tmp_path)),
                       nprocs=world, start_method="spawn", join=True)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["restored"] for r in res] == [3] * world and all(r["bitexact"] for r in res)
    assert [r["latest"] for r in res] == [3] * world and [r["latest2"] for r in res] == [5] * world

    _check_shares([tmp_path / f"root{r}" for r in range(roots)], 3, [r["io"] for r in res])
    assert [c["step"] for c in cfdist.list_checkpoints(urls)] == [3, 5]


@ends_process
def _kill_worker(rank, world, store_path, url, out, phase):
    _init(rank, world, store_path)
    res = {}
    try:
        ddp, opt = _model()
        st = open_storage(url)
        if phase == 1 and rank == 1:
            st = DieMidWrite(st, step=5)
        ckpt = cfdist.Checkpointer({"model": ddp, "optim": opt}, st, cfdist.Every(1000), writers="all",
                                   group=cfdist.GroupOptions(agree_timeout_s=8))
        if phase == 1:
            _train(ddp, opt, ckpt, rank, 0, 3)
            with open(os.path.join(out, f"io-rank{rank}.json"), "w") as f:
                json.dump(_save_measured(ckpt), f)
            torch.save(_flat(ddp, opt), os.path.join(out, f"ref-{rank}.pt"))   # each rank's own
            _train(ddp, opt, ckpt, rank, 3, 2)
            ckpt.save()                                   # rank 1 dies writing its slice of step 5
            try:
                ckpt.wait()
                res["error"] = None
            except Exception as e:  # noqa: BLE001 - the test asserts which
                res["error"] = f"{type(e).__name__}: {e}"
            res["latest"] = ckpt.latest_step
            res["committed"] = [c["step"] for c in cfdist.list_checkpoints(url)]
            res["staging"] = sorted(os.listdir(url[len("file://"):]))
            with open(os.path.join(out, f"phase1-rank{rank}.json"), "w") as f:
                json.dump(res, f)
            exit_process(0)   # its peer is dead: no clean shutdown of the group
        res["restored"] = ckpt.restore()
        res["bitexact"] = torch.equal(_flat(ddp, opt), torch.load(os.path.join(out, f"ref-{rank}.pt")))
        _train(ddp, opt, ckpt, rank, 3, 2)
        ckpt.save(block=True)
        ckpt.close()
        res["committed"] = [c["step"] for c in cfdist.list_checkpoints(url)]
        dist.barrier()
    finally:
        with open(os.path.join(out, f"phase{phase}-rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


def test_writer_killed_mid_write_leaves_step_uncommitted(tmp_path, capsys):
    """See the module docstring (all real). Two ranks commit step 3 (each wrote its share:
    ``/proc/self/io``), then rank 1 is SIGKILLed in the middle of writing its slice of step 5:
    rank 0 does not commit step 5 (its wait fails naming the missing slices), step 3 stays; a
    restarted pair of ranks sweeps the leftover, restores step 3 bit-exact on both and commits
    step 5; ``cfdist ls`` and ``cfdist inspect --verify`` read the sliced checkpoint."""
    url = f"file://{tmp_path / 'ckpt'}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_kill_worker, args=(r, 2, str(tmp_path / "store1"), url, str(tmp_path), 1))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert procs[1].exitcode == -signal.SIGKILL and procs[0].exitcode == 0
    r0 = json.loads((tmp_path / "phase1-rank0.json").read_text())
    assert r0["error"] and "slices of step 5" in r0["error"], r0
    assert r0["latest"] == 3 and r0["committed"] == [3]
    assert any(n.startswith("step-000000005.tmp-") for n in r0["staging"]), r0   # the partial slice

    mp.start_processes(_kill_worker, args=(2, str(tmp_path / "store2"), url, str(tmp_path), 2), nprocs=2,
                       start_method="spawn", join=True)
    res = [json.loads((tmp_path / f"phase2-rank{r}.json").read_text()) for r in range(2)]
    assert [r["restored"] for r in res] == [3, 3] and all(r["bitexact"] for r in res)
    assert res[0]["committed"] == [3, 5]
    assert not any(".tmp-" in n for n in os.listdir(tmp_path / "ckpt"))   # swept, then committed
    _check_shares([tmp_path / "ckpt"], 3, [json.loads((tmp_path / f"io-rank{r}.json").read_text()) for r in range(2)])

    from cfdist.cli import main

    assert main(["ls", url]) == 0
    capsys.readouterr()
    assert main(["inspect", f"{url}/step-000000003", "--verify", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["writers"] == 2 and shown["verified"] and shown["state"]["model"]["tensors"] == 9


def _two_writers(urls, steps, restore=None, world=2, writers="all", stats=None, buffers=1, every=2):
    """Train identical models on ``world`` threads (ranks 0, 1, ...) with ``writers``, Every(2).
    Returns the state_dicts at each checkpoint step (the same on every rank); ``stats``: a
    dict that receives each rank's ``ckpt.stats``."""
    store = torch.distributed.HashStore()
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 128))   # 3 x 33 KB with Adam: the cut splits exp_avg
    at: dict[int, dict] = {}
    errors = []

    def rank(r):
        try:
            model = copy.deepcopy(base)
            opt = torch.optim.Adam(model.parameters(), lr=0.1)
            ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, urls, cfdist.Every(every),
                                       writers=writers,
                                       group=cfdist.GroupOptions(rank=r, world_size=world, store=store, agree_timeout_s=60),
                                       buffers=buffers, keep=steps)
            if restore is not None:
                assert ckpt.restore(step=restore) == restore
            for i in range(steps):
                model(torch.randn(4, 64, generator=torch.Generator().manual_seed(i))).sum().backward()
                ckpt.step(opt)
                opt.zero_grad()
                if r == 0 and ckpt.step_count % every == 0:
                    at[ckpt.step_count] = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.close()
            if stats is not None:
                stats[r] = ckpt.stats
        except BaseException as e:  # noqa: BLE001 - re-raised by the test thread
            errors.append(e)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    if errors:
        raise errors[0]
    return at


def test_a_corrupted_piece_falls_back_to_the_previous_checkpoint(tmp_path):
    """Two Checkpointers (ranks 0 and 1 of a world of 2) on two threads of this process, agreeing
    through an in-process HashStore instead of gloo processes (the protocol does not care; it
    keeps this test at a second); real files, striped over 2 roots. Writer 1's file of step 4 gets a
    flipped byte inside a split tensor's piece: ``cfdist.load`` warns and loads step 2, equal
    to the model at step 2; step 4 before the damage loads equal to the model at step 4."""
    urls = [f"file://{tmp_path / 'r0'}", f"file://{tmp_path / 'r1'}"]   # striped and sliced
    at = _two_writers(urls, steps=4)
    assert [c["step"] for c in cfdist.list_checkpoints(urls)] == [2, 4]
    good = cfdist.load(urls)
    assert good["step"] == 4
    assert all(torch.equal(good["state"]["model"][k], v) for k, v in at[4].items())

    m = json.loads((tmp_path / "r0" / "step-000000004" / "MANIFEST.json").read_text())
    assert m["split"], "the test model is meant to have a tensor split between the writers"
    piece = next(p for s in m["split"].values() for p in s["pieces"]
                 if m["shards"][m["tensors"][p[0]]["shard"]]["writer"] == 1)
    t = m["tensors"][piece[0]]
    sh = m["shards"][t["shard"]]
    path = tmp_path / f"r{sh['root']}" / "step-000000004" / sh["file"]
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[start + t["offset"] + t["nbytes"] // 2] ^= 0xFF
    path.write_bytes(bytes(raw))

    sts = discovery._open_checked([str(u) for u in urls], {})
    with pytest.warns(RuntimeWarning, match=rf"step 4 .*{piece[0]}.*failed its checksum"):
        found = discovery.load_newest([sts])
    assert found.candidate.step == 2
    assert all(torch.equal(found.state["model"][k], v) for k, v in at[2].items())


def test_sliced_checkpoints_on_every_backend_and_after_a_rollback(storage_url):
    """Two Checkpointers on two threads (a HashStore, as above) on ``file://``, ``memory://`` and
    ``s3://`` (a real local S3 server: no rename, the slices are written under the final prefix
    and the manifest is the commit). Steps 2 and 4 commit and load equal to the model; then the
    run restores step 2 and commits a new step 4: the old one is moved aside first (never
    mixed with the new slices), and the new one loads equal to the new model."""
    first = _two_writers([storage_url], steps=4)
    assert [c["step"] for c in cfdist.list_checkpoints(storage_url)] == [2, 4]
    got = cfdist.load(storage_url)["state"]["model"]
    assert all(torch.equal(got[k], v) for k, v in first[4].items())

    again = _two_writers([storage_url], steps=2, restore=2)
    assert [c["step"] for c in cfdist.list_checkpoints(storage_url)] == [2, 4]
    assert [c["step"] for c in cfdist.list_checkpoints(storage_url, include_rejected=True)] == [2, 4, 4]
    got = cfdist.load(storage_url)["state"]["model"]
    assert all(torch.equal(got[k], v) for k, v in again[4].items())
    assert not all(torch.equal(got[k], v) for k, v in first[4].items())   # other data: another state


def test_writers_n_lets_the_first_n_ranks_write(tmp_path):
    """``writers=2`` in a world of 3 (threads and a HashStore, as above): ranks 0 and 1 write a
    half each, rank 2 writes nothing; the checkpoint loads equal to the model."""
    url = f"file://{tmp_path / 'ckpt'}"
    stats: dict = {}
    at = _two_writers([url], steps=2, world=3, writers=2, stats=stats)
    m = json.loads((tmp_path / "ckpt" / "step-000000002" / "MANIFEST.json").read_text())
    assert m["slicing"]["writers"] == 2 and sorted(s["writer"] for s in m["shards"]) == [0, 1]
    assert stats[2]["bytes"] == 0 and stats[0]["bytes"] > 0 and stats[1]["bytes"] > 0
    assert [stats[r]["checkpoints"] for r in range(3)] == [1, 1, 0]
    got = cfdist.load(url)["state"]["model"]
    assert all(torch.equal(got[k], v) for k, v in at[2].items())


def test_sliced_and_double_buffered_checkpoints_commit_every_step_in_order(tmp_path):
    """``writers="all"`` with ``buffers=2`` at k = 1 (threads and a HashStore, as above), striped
    over 2 roots: every step commits, in order, and each loads equal to the model at that step
    (a slice written from the other buffer set would show as another step's values)."""
    urls = [f"file://{tmp_path / 'r0'}", f"file://{tmp_path / 'r1'}"]
    stats: dict = {}
    at = _two_writers(urls, steps=6, buffers=2, every=1, stats=stats)
    assert [c["step"] for c in cfdist.list_checkpoints(urls)] == [1, 2, 3, 4, 5, 6]
    assert stats[0]["buffers"] == 2 and stats[0]["checkpoints"] == 6
    for step in range(1, 7):
        got = cfdist.load(urls, step=step)["state"]["model"]
        assert all(torch.equal(got[k], v) for k, v in at[step].items()), step


# ---- the shapes users train: BatchNorm, per-rank dropout, a scheduler, AMP; SIGKILL; resume ---------

RESUME_TOTAL, RESUME_EVERY, RESUME_DIE = 14, 3, 10


def _amp_setup(rank):
    """DDP over BatchNorm + dropout, AdamW, an LR schedule, a CPU GradScaler; per-rank RNG seeds."""
    import random

    import numpy as np

    torch.manual_seed(0)   # the same initial weights everywhere
    m = torch.nn.Sequential(torch.nn.Linear(64, 200), torch.nn.BatchNorm1d(200), torch.nn.ReLU(),
                            torch.nn.Dropout(0.3), torch.nn.Linear(200, 64))
    # find_unused_parameters=True keeps DDP's construction-time bucket layout (see test_rank_rng.py)
    ddp = DDP(m, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    # growth every 2 steps: the scale itself changes between checkpoints
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    torch.manual_seed(10 + rank)
    np.random.seed(20 + rank)
    random.seed(30 + rank)
    return ddp, opt, sched, scaler


def _amp_train(ddp, opt, sched, scaler, ckpt, rank, start, until, die=None):
    import random

    import numpy as np

    for i in range(start, until):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * i + rank))
        x = x + 0.1 * torch.randn(8, 64) + float(np.random.randn()) + random.random()   # every RNG stream
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = ddp(x).float().square().mean()   # dropout draws from this rank's torch stream
        scaler.scale(loss).backward()
        if ckpt is None:
            scaler.step(opt)
            scaler.update()
        else:
            ckpt.step(opt, scaler=scaler)
        opt.zero_grad()
        sched.step()
        if die is not None and i + 1 == die:
            os.kill(os.getpid(), signal.SIGKILL)   # a checkpoint may be persisting right now


def _amp_final(ddp, opt, sched, scaler) -> dict:
    import random

    import numpy as np

    return {"model": {k: v.clone() for k, v in ddp.module.state_dict().items()},
            "optim": copy.deepcopy(opt.state_dict()), "sched": sched.state_dict(), "scaler": scaler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np.random.get_state()[1].copy()),
                    "python": list(random.getstate()[1])}}


@ends_process
def _amp_worker(rank, world, store_path, url, out, phase):
    _init(rank, world, store_path)
    torch.use_deterministic_algorithms(True)
    try:
        if phase == 1:
            state = _amp_setup(rank)   # the uninterrupted run, no cfdist
            _amp_train(*state, None, rank, 0, RESUME_TOTAL)
            torch.save(_amp_final(*state), os.path.join(out, f"ref-rank{rank}.pt"))
            dist.barrier()
            ddp, opt, sched, scaler = _amp_setup(rank)
            ckpt = cfdist.Checkpointer({"model": ddp, "optim": opt, "sched": sched, "scaler": scaler}, url,
                                       cfdist.Every(RESUME_EVERY), writers="all",
                                       group=cfdist.GroupOptions(agree_timeout_s=60))
            _amp_train(ddp, opt, sched, scaler, ckpt, rank, 0, RESUME_TOTAL, die=RESUME_DIE if rank == 1 else None)
            raise AssertionError("rank 1 was killed: its peers must have been terminated by the launcher")
        ddp, opt, sched, scaler = _amp_setup(rank)
        torch.manual_seed(999 + rank)   # a new process's own seeds: the restore must replace them
        ckpt = cfdist.Checkpointer({"model": ddp, "optim": opt, "sched": sched, "scaler": scaler}, url,
                                   cfdist.Every(RESUME_EVERY), writers="all",
                                   group=cfdist.GroupOptions(agree_timeout_s=60))
        start = ckpt.restore()
        with open(os.path.join(out, f"restored-rank{rank}.json"), "w") as f:
            json.dump({"restored": start}, f)
        _amp_train(ddp, opt, sched, scaler, ckpt, rank, start, RESUME_TOTAL)
        ckpt.close()
        torch.save(_amp_final(ddp, opt, sched, scaler), os.path.join(out, f"final-rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _assert_equal_state(got, want, where):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            _assert_equal_state(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_equal_state(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def test_sliced_checkpoints_of_an_amp_batchnorm_dropout_run_resume_bit_identical_after_a_sigkill(tmp_path):
    """Real: 3 spawned gloo ranks with deterministic algorithms, DDP over Linear + BatchNorm1d +
    dropout (each rank seeds torch, numpy and python differently and draws from all three every
    step), AdamW, an ``ExponentialLR`` stepped after ``ckpt.step``, bfloat16 autocast on the CPU
    with a CPU ``torch.amp.GradScaler`` (growth every 2 steps, so its scale changes between
    checkpoints), ``writers="all"`` with ``Every(3)`` to a ``file://`` directory, a SIGKILL
    that rank 1 sends itself right after step 10 (its slice or rank 0's commit of step 9 may
    be in flight), and the launcher terminating the other ranks (as torchrun does).
    Faked: nothing; the reference is the same program with ``scaler.step(opt)`` and no cfdist,
    run in the same processes first.
    The point: restarted ranks restore a sliced checkpoint written by all three (it holds rank
    0's BatchNorm statistics, the others' forwards overwrite theirs from rank 0's at the next
    step, as DDP broadcasts them), train to step 14 and end with the uninterrupted run's
    parameters, BatchNorm buffers, AdamW state, param groups, scheduler, scaler and RNG states
    (torch, numpy, python), bit for bit, on every rank."""
    world = 3
    url = f"file://{tmp_path / 'ckpt'}"
    with pytest.raises(mp.ProcessExitedException) as died:
        mp.start_processes(_amp_worker, args=(world, str(tmp_path / "store1"), url, str(tmp_path), 1),
                           nprocs=world, start_method="spawn", join=True)
    assert died.value.error_index == 1 and died.value.exit_code == -signal.SIGKILL, died.value
    committed = [c["step"] for c in cfdist.list_checkpoints(url)]
    assert committed and committed[-1] in (6, 9), committed
    m = json.loads((tmp_path / "ckpt" / f"step-{committed[-1]:09d}" / "MANIFEST.json").read_text())
    assert m["slicing"]["writers"] == world and {s["writer"] for s in m["shards"]} == set(range(world))
    assert m["split"], "the model is meant to have a tensor cut between writers"

    mp.start_processes(_amp_worker, args=(world, str(tmp_path / "store2"), url, str(tmp_path), 2),
                       nprocs=world, start_method="spawn", join=True)
    for r in range(world):
        assert json.loads((tmp_path / f"restored-rank{r}.json").read_text())["restored"] == committed[-1]
        want = torch.load(tmp_path / f"ref-rank{r}.pt", weights_only=False)
        got = torch.load(tmp_path / f"final-rank{r}.pt", weights_only=False)
        _assert_equal_state(got, want, f"rank {r}")
    finals = [torch.load(tmp_path / f"final-rank{r}.pt", weights_only=False) for r in range(world)]
    assert not torch.equal(finals[0]["model"]["1.running_mean"], finals[1]["model"]["1.running_mean"])
    assert not torch.equal(finals[0]["rng"]["torch"], finals[1]["rng"]["torch"])
