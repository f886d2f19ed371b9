"""Per-rank RNG states on 3 gloo ranks: each rank resumes its own dropout and noise streams.

Real: 3 spawned processes, a gloo group over a TCPStore on 127.0.0.1, DDP over a model with
dropout, each rank seeding torch, numpy and python differently and drawing from all three every
step, the Checkpointer (rank 0 writes, every rank's RNG handed over through the job's store),
files in a ``file://`` directory. Faked: the interruption (the first run's objects are
abandoned after its checkpoint committed, as a killed job leaves them). The points: the resumed
run ends with the uninterrupted run's parameters bit for bit; each rank's restored RNG equals
the state it had at the checkpoint, and the ranks' states differ; the manifest holds every
rank's; a rank that never hands its RNG over stops the checkpoint from committing, with an error
naming the missing key; a save requested on one rank only is taken by every rank at the same
step.
"""

from __future__ import annotations

import json
import os
import random
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import cfdist
from cfdist.checkpoint.format import MANIFEST, step_dir
from cfdist.cluster.exits import ends_process

WORLD = 3
STEPS, CUT, EVERY = 12, 7, 4


def _seed_rank(rank):
    torch.manual_seed(10 + rank)
    np.random.seed(20 + rank)
    random.seed(30 + rank)


def _setup(rank, url, every=EVERY, **kw):
    torch.manual_seed(0)   # the same initial weights everywhere (DDP broadcasts them anyway)
    # find_unused_parameters=True keeps DDP's construction-time bucket layout: by default DDP
    # re-lays its flat gradient buffer after its first backward, and on 3 ranks gloo's ring then
    # sums some elements in another order, so a DDP built at a resume (first backward at step 5)
    # differs in the last bit from one that kept running -- with or without cfdist.
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 2)),
                find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _seed_rank(rank)
    return model, opt, cfdist.Checkpointer({"model": model, "opt": opt}, url, cfdist.Every(every), keep=2, **kw)


def _train(model, opt, ckpt, rank, until, on_step=None):
    while ckpt.step_count < until:
        i = ckpt.step_count
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * i + rank))
        x = x + float(np.random.randn()) + random.random()   # numpy and python streams too
        model(x).square().mean().backward()                  # dropout: the torch stream
        ckpt.step(opt)
        opt.zero_grad()
        if on_step is not None:
            on_step(ckpt.step_count)


def _rng_now():
    return {"torch": torch.get_rng_state().tolist(), "numpy": np.random.get_state()[1].tolist(),
            "python": list(random.getstate()[1])}


@ends_process
def _worker(rank, port, root, out):
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    res = {}
    try:
        model, opt, ckpt = _setup(rank, f"file://{root}/whole")
        _train(model, opt, ckpt, rank, STEPS)
        ckpt.close()
        res["whole"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]

        # ---- interrupted at step 7 (checkpoint 4 committed), then resumed -----------------------
        saved = {}
        model, opt, ckpt = _setup(rank, f"file://{root}/cut")
        _train(model, opt, ckpt, rank, CUT, on_step=lambda s: saved.setdefault(s, _rng_now()) if s == 4 else None)
        ckpt.wait()
        del model, opt, ckpt                                  # abandoned, never closed
        torch.manual_seed(999), np.random.seed(999), random.seed(999)   # a new process's own seeds
        model, opt, ckpt = _setup(rank, f"file://{root}/cut")
        res["restored"] = ckpt.restore()
        res["rng_equal_to_saved"] = _rng_now() == saved[4]
        res["rng_torch_head"] = saved[4]["torch"][:64]
        _train(model, opt, ckpt, rank, STEPS)
        ckpt.close()
        res["resumed"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]

        # ---- rank 2 never hands its RNG over: the checkpoint must not commit --------------------
        model, opt, ckpt = _setup(rank, f"file://{root}/missing", agree_timeout_s=3)
        _train(model, opt, ckpt, rank, 2)
        dist.barrier()
        if rank != 2:
            ckpt.save()
        try:
            ckpt.wait()
            res["missing_error"] = None
        except cfdist.AgreementError as e:
            res["missing_error"] = str(e)
        ckpt.close()

        # ---- a notice reaching rank 2 only: every rank checkpoints the same step --------------
        model, opt, ckpt = _setup(rank, f"file://{root}/notice", every=1000, lookahead=2)
        _train(model, opt, ckpt, rank, 10, on_step=lambda s: ckpt.request_save() if rank == 2 and s == 2 else None)
        ckpt.close()
        res["notice_checkpoints"] = ckpt.stats["checkpoints"] if rank == 0 else None
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


@pytest.mark.slow
def test_each_rank_resumes_its_own_rng_and_the_run_ends_bit_exact(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    mp.spawn(_worker, args=(store.port, str(tmp_path), str(tmp_path)), nprocs=WORLD, join=True)
    rs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    for r, res in enumerate(rs):
        assert res["restored"] == 4
        assert res["rng_equal_to_saved"], f"rank {r} did not resume its own RNG states"
        assert res["resumed"] == res["whole"], f"rank {r}: the resumed run diverged from the uninterrupted one"
    assert len({json.dumps(res["rng_torch_head"]) for res in rs}) == WORLD   # per-rank streams differ
    m = json.loads((tmp_path / "cut" / step_dir(12) / MANIFEST).read_text())
    assert len(m["rngs"]) == WORLD and m["rng"] == m["rngs"][0]

    err = rs[0]["missing_error"]
    assert err is not None and "rank 0 waited 3 s for the RNG states of step 2" in err and "rng/2/2" in err
    assert "call ckpt.save() on every rank" in err
    assert cfdist.list_checkpoints(f"file://{tmp_path}/missing") == []   # nothing committed

    # requested after step 2 on rank 2; rank 0 cannot finish step 3's backward before that, so at
    # its window start 3 it sees the request and schedules the next window's first step, 5
    (notice,) = cfdist.list_checkpoints(f"file://{tmp_path}/notice")
    assert notice["step"] == 5 and rs[0]["notice_checkpoints"] == 1
    m = json.loads((tmp_path / "notice" / step_dir(5) / MANIFEST).read_text())
    assert len(m["rngs"]) == WORLD   # every rank took it: every rank's RNG is in it
