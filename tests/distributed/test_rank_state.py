"""What each rank of a 2-rank gloo job sees of the checkpoints: ``latest_step`` and its own
BatchNorm statistics.

Real: two spawned processes, a gloo process group from a FileStore in tmp_path, DDP over
Linear + BatchNorm1d (each rank normalises its own batches, so the running statistics differ
between the ranks after every forward), SGD, the Checkpointer with ``Every(2)`` on a shared
``file://`` directory, rank 0 the only writer. Faked: nothing; "re-running the job" builds a
fresh model and Checkpointer in the same processes (the checkpoint is all they share).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import cfdist

WORLD = 2


def _model(seed: int):
    torch.manual_seed(seed)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5)))
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)


def _train(ddp, opt, ckpt, rank: int, until: int) -> None:
    """The user's loop: train until ``until`` steps are done (nothing when already there)."""
    while ckpt.step_count < until:
        g = torch.Generator().manual_seed(1000 * ckpt.step_count + rank)
        ddp(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
        ckpt.step(opt)
        opt.zero_grad()


def _buffers(ddp) -> dict:
    return {n: b.clone() for n, b in ddp.module.named_buffers()}


def _run(rank: int, body, init_file: str, url: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        res = body(rank, url)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _latest_body(rank: int, url: str) -> dict:
    res = {}
    ddp, opt = _model(0)
    ckpt = cfdist.Checkpointer({"model": ddp, "optim": opt}, url, cfdist.Every(2))
    res["fresh"] = ckpt.latest_step
    _train(ddp, opt, ckpt, rank, 6)
    ckpt.wait()                       # rank 0: its persists collected (6 committed)
    dist.barrier()
    res["after_6"] = ckpt.latest_step
    res["stats_after_6"] = ckpt.stats["latest_step"]
    ckpt.close()
    dist.barrier()

    ddp, opt = _model(1)              # the job again: restore 6, train to 10
    ckpt = cfdist.Checkpointer({"model": ddp, "optim": opt}, url, cfdist.Every(2))
    res["restored"] = ckpt.restore()
    dist.barrier()
    res["after_restore"] = ckpt.latest_step
    _train(ddp, opt, ckpt, rank, 10)
    handle = ckpt.save()              # 10 was a checkpoint step already: the same step's handle
    ckpt.wait()
    dist.barrier()
    res["after_10"] = ckpt.latest_step
    res["handle_done"] = handle.done()
    ckpt.close()
    return res


def test_latest_step_is_the_newest_commit_on_every_rank(tmp_path):
    """Rank 1 (not a writer) reports the newest committed step like rank 0: None before any
    commit, 6 after the first run, 6 after restoring it, 10 after training on. (On the main
    branch before the fix rank 1 said None, then stayed frozen at 6.)"""
    url = f"file://{tmp_path / 'ckpt'}"
    mp.start_processes(_run, args=(_latest_body, str(tmp_path / "store"), url, str(tmp_path)), nprocs=WORLD,
                       start_method="spawn", join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))
    for r in (r0, r1):
        assert (r["fresh"], r["after_6"], r["stats_after_6"]) == (None, 6, 6), r
        assert (r["restored"], r["after_restore"], r["after_10"], r["handle_done"]) == (6, 6, 10, True), r


def _batchnorm_body(rank: int, url: str) -> dict:
    ddp, opt = _model(0)
    ckpt = cfdist.Checkpointer({"model": ddp, "optim": opt}, url, cfdist.Every(2))
    ckpt.restore()
    _train(ddp, opt, ckpt, rank, 4)   # ends on a checkpoint step
    final = _buffers(ddp)
    params = [p.detach().clone() for p in ddp.parameters()]
    ckpt.close()
    dist.barrier()

    ddp, opt = _model(7 + rank)       # re-run the finished job: restore, nothing left to train
    ckpt = cfdist.Checkpointer({"model": ddp, "optim": opt}, url, cfdist.Every(2))
    restored = ckpt.restore()
    _train(ddp, opt, ckpt, rank, 4)
    ckpt.close()
    again = _buffers(ddp)
    return {"restored": restored, "trained": ckpt.step_count,
            "final": {n: t.tolist() for n, t in final.items()},
            "own_buffers_back": {n: torch.equal(again[n], final[n]) for n in final},
            "params_back": all(torch.equal(a, b) for a, b in zip(ddp.parameters(), params))}


def test_rerunning_a_finished_job_gives_each_rank_its_own_batchnorm_statistics(tmp_path):
    """A job that ended on a checkpoint (step 4) is run again: both ranks restore step 4 and
    train nothing; each ends with its own running mean, variance and batch count of step 4, as
    the uninterrupted run did (on the main branch before the fix, rank 1 held rank 0's)."""
    url = f"file://{tmp_path / 'ckpt'}"
    mp.start_processes(_run, args=(_batchnorm_body, str(tmp_path / "store"), url, str(tmp_path)), nprocs=WORLD,
                       start_method="spawn", join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))
    assert r0["final"]["1.running_mean"] != r1["final"]["1.running_mean"]   # the ranks' statistics differ
    for r in (r0, r1):
        assert (r["restored"], r["trained"]) == (4, 4)
        assert all(r["own_buffers_back"].values()), r["own_buffers_back"]
        assert r["params_back"]
