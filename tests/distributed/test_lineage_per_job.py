"""One lineage per job: a writer that restores another writer's copy keeps its own history
(issue 19, item 6: each recovery under ``cfdist.fit`` moved 2-3 checkpoints per node aside).

Real: 2 spawned processes, a gloo group over a TCPStore on 127.0.0.1, two writers (one per
"node", as ``cfdist.fit`` has: each rank writes its own ``file://`` directory), retention,
restore with the peer copy over the gloo group. Faked: the machines (two directories on one
disk) and the failure (rank 1's newest checkpoint is removed, as if its node had not committed
it yet when the job failed).

The point: after the restart restores step 8 (rank 1 receives it from rank 0) and commits 12,
rank 1's own step 4 is still live (an ancestor, within ``keep=2``) and nothing is under
``rejected/`` on either rank. Before the fix each writer drew its own lineage, so rank 1's
step 4 was "another run" and was moved aside at its next commit.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cfdist
from cfdist.checkpoint.format import step_dir

WORLD = 2


def _train(ckpt, model, opt, until: int) -> None:
    while ckpt.step_count < until:
        model(torch.full((2, 6), float(ckpt.step_count))).sum().backward()
        ckpt.step(opt)
        opt.zero_grad()


def _worker(rank, port, root, out):
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    mine = os.path.join(root, f"node{rank}")
    res = {}
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = {"model": model, "opt": opt}
        ckpt = cfdist.Checkpointer(state, f"file://{mine}", cfdist.Every(4), keep=2, writers=True,
                                   group=cfdist.GroupOptions(agree_timeout_s=60))
        _train(ckpt, model, opt, 8)
        ckpt.close()
        res["lineages"] = [json.load(open(os.path.join(mine, step_dir(s), "MANIFEST.json")))["lineage"]["run"]
                           for s in (4, 8)]
        if rank == 1:   # the job fails before node 1 committed step 8
            shutil.rmtree(os.path.join(mine, step_dir(8)))
        dist.barrier()
        # the restart: a new Checkpointer on every rank restores the newest step one rank holds
        ckpt = cfdist.Checkpointer(state, f"file://{mine}", cfdist.Every(4), keep=2, writers=True,
                                   group=cfdist.GroupOptions(agree_timeout_s=60))
        res["restored"] = ckpt.restore()
        _train(ckpt, model, opt, 12)
        ckpt.close()
        res["live"] = [c["step"] for c in cfdist.list_checkpoints(f"file://{mine}")]
        res["aside"] = [(c["step"], c["rejected"].get("why")) for c in
                        cfdist.list_checkpoints(f"file://{mine}", include_rejected=True) if "rejected" in c]
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


def test_a_writer_that_restored_a_peers_copy_keeps_its_own_history(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    mp.spawn(_worker, args=(store.port, str(tmp_path / "nodes"), str(tmp_path)), nprocs=WORLD, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))
    assert r0["restored"] == r1["restored"] == 8
    assert (r1["aside"], r0["aside"]) == ([], [])
    assert r1["live"] == [4, 12] and r0["live"] == [8, 12]
    (run,) = {*r0["lineages"], *r1["lineages"]}   # one lineage, drawn for this job
    assert isinstance(run, str) and len(run) == 32, run
