"""Restore agreement on 3 gloo ranks whose node-local directories disagree.

Real: 3 spawned processes, a gloo group over a TCPStore on 127.0.0.1, each rank's own
``file://`` directory (as node-local disks on three machines), committed checkpoints written
by a real Checkpointer, a corrupted shard. Faked: the machines (three directories on one disk).
The points: every rank restores the same step -- the newest some rank can load; ranks that
lack it or hold a corrupted copy receive it from that rank over the gloo group -- or every
rank raises the same ``CheckpointError`` naming what each rank holds; never training on
diverged state. ``restore(step=N)`` is agreed as well (the path ``cfdist.fit`` takes).
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cfdist
from cfdist.checkpoint.format import step_dir
from cfdist.cluster.exits import ends_process

WORLD = 3
# scenario -> (steps each rank's directory keeps, rank whose step-8 shard is corrupted, restore arg)
SCENARIOS = {
    "all_hold": ([[4, 8], [4, 8], [4, 8]], None, None),
    "one_empty": ([[4, 8], [4, 8], []], None, None),
    "one_older_only": ([[4, 8], [4, 8], [4]], None, None),
    "newest_corrupt_on_one": ([[4, 8], [4, 8], [4, 8]], 1, None),
    "step_8_asked_one_lacks_it": ([[4, 8], [4, 8], [4]], None, 8),
    "step_4_asked": ([[4, 8], [4, 8], [4]], None, 4),
    "none_anywhere": ([[], [], []], None, None),
    "only_copy_corrupt": ([[], [8], []], 1, None),
    "step_4_asked_nobody_has_it": ([[8], [8], []], None, 4),
}


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(6, 3)


def _make_checkpoints(src: str) -> None:
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = cfdist.Checkpointer({"model": model, "opt": opt}, f"file://{src}", cfdist.Every(4), keep=2)
    for i in range(8):
        model(torch.full((2, 6), float(i))).sum().backward()
        ckpt.step(opt)
        opt.zero_grad()
    ckpt.close()


def _lay_out(src: str, root: str) -> None:
    for name, (held, corrupt, _) in SCENARIOS.items():
        for rank, steps in enumerate(held):
            d = os.path.join(root, name, f"rank{rank}")
            os.makedirs(d)
            for s in steps:
                shutil.copytree(os.path.join(src, step_dir(s)), os.path.join(d, step_dir(s)))
            if corrupt == rank:
                (shard,) = [f for f in os.listdir(os.path.join(d, step_dir(8))) if f.endswith(".safetensors")]
                path = os.path.join(d, step_dir(8), shard)
                raw = bytearray(open(path, "rb").read())
                raw[-4] ^= 0xFF
                open(path, "wb").write(bytes(raw))


@ends_process
def _worker(rank, port, root, out):
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    res = {}
    try:
        for name, (_, _, want) in SCENARIOS.items():
            model = _model(100 + rank)   # different weights on every rank before the restore
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ckpt = cfdist.Checkpointer({"model": model, "opt": opt}, f"file://{root}/{name}/rank{rank}",
                                       cfdist.Every(4), group=cfdist.GroupOptions(agree_timeout_s=60))
            try:
                got, err = ckpt.restore(want), None
            except cfdist.CheckpointError as e:
                got, err = None, str(e)
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            every = [torch.empty_like(flat) for _ in range(WORLD)]
            dist.all_gather(every, flat)   # the test's own check, after the restore
            res[name] = {"step": got, "error": err, "step_count": ckpt.step_count,
                         "same_weights": all(torch.equal(w, every[0]) for w in every)}
            ckpt.close()
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restore-agreement")
    _make_checkpoints(str(tmp / "src"))
    _lay_out(str(tmp / "src"), str(tmp / "nodes"))
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    mp.spawn(_worker, args=(store.port, str(tmp / "nodes"), str(tmp)), nprocs=WORLD, join=True)
    rs = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {name: [r[name] for r in rs] for name in SCENARIOS}


@pytest.mark.parametrize("name, step", [("all_hold", 8), ("one_empty", 8), ("one_older_only", 8),
                                        ("newest_corrupt_on_one", 8), ("step_8_asked_one_lacks_it", 8),
                                        ("step_4_asked", 4)])
def test_every_rank_restores_the_newest_step_one_can_load(outcomes, name, step):
    for r, o in enumerate(outcomes[name]):
        assert o["error"] is None and o["step"] == step and o["step_count"] == step, (r, o)
        assert o["same_weights"], f"rank {r} trains on weights that differ from the others'"


@pytest.mark.parametrize("name, wants, held", [
    ("only_copy_corrupt", "a checkpoint", ["rank 0 holds nothing", "rank 1 holds [8]", "rank 2 holds nothing"]),
    ("step_4_asked_nobody_has_it", "step 4", ["rank 0 holds [8]", "rank 1 holds [8]", "rank 2 holds nothing"]),
])
def test_when_no_rank_can_load_every_rank_stops_with_what_each_holds(outcomes, name, wants, held):
    errors = {o["error"] for o in outcomes[name]}
    assert len(errors) == 1 and None not in errors, errors   # every rank raised, the same words
    (msg,) = errors
    assert "no usable checkpoint that every rank can load" in msg and f"({wants} wanted)" in msg
    assert all(h in msg for h in held), msg
    if name == "only_copy_corrupt":
        assert "step 8 failed on rank 1" in msg and "failed its checksum" in msg
    assert all(o["step_count"] == 0 for o in outcomes[name])   # nobody moved on


def test_nothing_anywhere_starts_every_rank_fresh(outcomes):
    assert all(o["step"] is None and o["error"] is None and o["step_count"] == 0 for o in outcomes["none_anywhere"])
