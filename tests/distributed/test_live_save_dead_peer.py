"""A survivor's live save does not wait for a checkpoint that waits for a dead rank.

Real: 2 spawned processes in a gloo process group (FileStore in tmp_path), DDP over a small MLP
under SGD with momentum, the Checkpointer with ``GroupOptions(live=True)`` (as ``cfdist.fit``
builds it), its persist pipeline and thread backend, ``file://`` storage with fsync and
renames. The death is real: rank 1 leaves with ``os._exit`` after step 4's all-reduce and
before its ``ckpt.step`` (so it never sends its RNG states of step 4), and rank 0's all-reduce
of step 5 fails on the closed connection, as after a SIGKILL.

The points: rank 0's persist of step 4 waits in its RNG stage for rank 1 (which never answers);
``save_live`` gives it up after a short wait instead of the 2 s it gives a persist that is
writing (logged, with the stage), writes step 4 from the live state, and that step restores on
one rank, bit for bit to rank 0's state after step 4.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import cfdist
from cfdist.checkpoint.discovery import committed_steps
from cfdist.cluster.exits import ends_process
from cfdist.storage import open_storage
from tests.distributed.ranks import run_ranks

EVERY, DIES_AFTER = 4, 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


@ends_process
def _worker(rank: int, store_path: str, url: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    log_path = os.path.join(out, f"rank{rank}.log")
    handler = logging.FileHandler(log_path)
    logging.getLogger("cfdist").addHandler(handler)
    logging.getLogger("cfdist").setLevel(logging.INFO)
    ddp = DDP(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ckpt = cfdist.Checkpointer({"model": ddp, "optim": opt}, url, cfdist.Every(EVERY), keep=100,
                               group=cfdist.GroupOptions(live=True, agree_timeout_s=60))
    res: dict = {"failed_at": None}
    try:
        for i in range(1, 10):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * i + rank))
            ddp(x).pow(2).mean().backward()                 # step i's all-reduce
            if rank == 1 and i == DIES_AFTER:
                os._exit(0)                                 # dead before sending its RNG states of step 4
            ckpt.step(opt)
            opt.zero_grad()
            if i == DIES_AFTER:
                res["state_after"] = {k: v.tolist() for k, v in ddp.module.state_dict().items()}
    except RuntimeError as e:                               # the collective's error: the peer is gone
        res["failed_at"] = ckpt.step_count + 1
        res["error"] = str(e)[:200]
    res["saved"] = ckpt.save_live(timeout_s=30)
    ckpt.abandon()
    handler.flush()
    with open(os.path.join(out, "rank0.json"), "w") as f:
        json.dump(res, f)


def test_a_live_save_gives_up_a_persist_waiting_for_a_dead_ranks_rng_and_writes_that_step(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    url = f"file://{tmp_path}/ckpt"
    codes = run_ranks(_worker, lambda r: (r, str(tmp_path / "store"), url, str(out)), 2, 180)
    assert codes == [0, 0]
    res = json.loads((out / "rank0.json").read_text())
    assert res["failed_at"] == DIES_AFTER + 1, res
    assert res["saved"] == DIES_AFTER, res
    text = (out / "rank0.log").read_text()
    assert f"the persist of step {DIES_AFTER} still waited for other ranks (rng)" in text, text
    assert "did not finish before the live save" not in text, text
    assert committed_steps(open_storage(url)) == [DIES_AFTER]

    model = _model()
    wrapped = torch.nn.Module()
    wrapped.module = model                                  # the DDP module's key layout, on one process
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = cfdist.Checkpointer({"model": wrapped, "optim": opt}, url, cfdist.Every(EVERY))
    try:
        assert ckpt.restore() == DIES_AFTER
    finally:
        ckpt.close()
    for k, v in model.state_dict().items():
        assert torch.equal(v, torch.tensor(res["state_after"][k])), k
