"""``cfdist.Checkpointer`` under 2-rank DDP on gloo: one writer, one restored state everywhere.

Real: two spawned processes, a gloo process group initialised from a FileStore in tmp_path,
DDP over a small MLP, Adam, the Checkpointer with ``Every(3)`` on a shared ``file://``
directory (each rank opens it through a pass-through wrapper that counts writes).
Faked: nothing. The points: only rank 0 writes; a step issues exactly as many collectives with
the checkpointer as plain DDP does; after a restart both ranks restore the same step, and their
parameters and Adam moments are equal to each other and to what rank 0 held at that step.
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
from cfdist.cluster.exits import ends_process
from cfdist.storage import open_storage
from cfdist.testing import StorageWrapper

WORLD = 2
STEPS = 7   # checkpoints at 3 and 6


class CountingWrites(StorageWrapper):
    def __init__(self, inner):
        super().__init__(inner)
        self.writes = 0

    def _before(self, verb, rel):
        if verb in ("write_file", "write_atomic", "publish", "remove", "makedirs"):
            self.writes += 1


def _ddp(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ddp = DDP(model)
    return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-2)


def _train(ddp, opt, ckpt, rank, steps, start=0):
    """The ordinary loop; each rank sees its own batches. Returns collectives issued."""
    pg = dist.distributed_c10d._get_default_group()
    seq0 = pg._get_sequence_number_for_group()
    for i in range(start, start + steps):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * i + rank))
        ddp(x).pow(2).mean().backward()
        if ckpt is not None:
            ckpt.step(opt)
        else:
            opt.step()
        opt.zero_grad()
    return pg._get_sequence_number_for_group() - seq0


def _flat(ddp, opt):
    params = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    moments = torch.cat([opt.state[p][k].reshape(-1) for p in ddp.parameters() for k in ("exp_avg", "exp_avg_sq")])
    return params, moments


@ends_process
def _worker(rank, init_file, url, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    res = {}
    try:
        plain, plain_opt = _ddp(0)
        res["collectives_plain"] = _train(plain, plain_opt, None, rank, STEPS)

        st = CountingWrites(open_storage(url))
        ddp, opt = _ddp(0)
        ckpt = cfdist.Checkpointer({"model": ddp, "optim": opt}, st, cfdist.Every(3))
        assert ckpt.rank == rank and ckpt.writer == (rank == 0)
        res["collectives_ckpt"] = _train(ddp, opt, ckpt, rank, 6)
        at6 = _flat(ddp, opt)
        res["collectives_ckpt"] += _train(ddp, opt, ckpt, rank, 1, start=6)
        ckpt.close()
        res["writes"] = st.writes
        res["checkpoints"] = ckpt.stats["checkpoints"]
        dist.barrier()                                   # rank 0 committed before anyone restores

        ddp2, opt2 = _ddp(seed=1 + rank)                 # different initial weights on each rank
        st2 = CountingWrites(open_storage(url))
        ckpt2 = cfdist.Checkpointer({"model": ddp2, "optim": opt2}, st2, cfdist.Every(3))
        res["restored"] = ckpt2.restore()
        params, moments = _flat(ddp2, opt2)
        res["equal_to_step6_here"] = torch.equal(params, at6[0]) and torch.equal(moments, at6[1])
        gathered = [torch.empty_like(params) for _ in range(WORLD)]
        dist.all_gather(gathered, params)
        res["ranks_equal"] = all(torch.equal(g, gathered[0]) for g in gathered)
        _train(ddp2, opt2, ckpt2, rank, 3, start=6)      # and training continues, checkpointing 9
        ckpt2.close()
        res["writes_after_restore"] = st2.writes
        res["latest"] = ckpt2.latest_step
        dist.barrier()
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


def test_two_gloo_ranks_one_writer_same_restore(tmp_path):
    """Two gloo ranks checkpoint with ``Every(3)`` (see the module docstring for real/faked):
    only rank 0 writes, no collective is added, both restore step 6 with equal parameters."""
    url = f"file://{tmp_path / 'ckpt'}"
    mp.start_processes(_worker, args=(str(tmp_path / "store"), url, str(tmp_path)), nprocs=WORLD,
                       start_method="spawn", join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))

    assert r0["writes"] > 0 and r0["checkpoints"] == 2
    assert r1["writes"] == 0 and r1["writes_after_restore"] == 0
    assert r0["collectives_ckpt"] == r0["collectives_plain"] and r1["collectives_ckpt"] == r1["collectives_plain"]
    assert r0["restored"] == r1["restored"] == 6
    assert r0["equal_to_step6_here"] and r1["equal_to_step6_here"]
    assert r0["ranks_equal"] and r1["ranks_equal"]
    assert r0["latest"] == 9
    assert [c["step"] for c in cfdist.list_checkpoints(url)] == [6, 9]   # keep=2, the default
