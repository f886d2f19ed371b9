"""ResumableLoader in real gloo process groups: 2 ranks interrupted mid-epoch, resumed on 3.

Real: torch.distributed (gloo, a FileStore), one process per rank, a collective per step like
DDP's gradient all-reduce (a rank with an extra or a missing step would hang or fail it).
Faked: the dataset (sample i is the integer i) and the training step. The point: the union of
the indices all ranks consumed across the interruption is each epoch's dataset, exactly once.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cfdist.cluster.exits import ends_process
from cfdist.data import ResumableLoader

N, BATCH, SEED = 50, 4, 7


@ends_process
def _rank_main(rank: int, world: int, store_path: str, out_dir: str, state: dict | None, steps: int):
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    try:
        loader = ResumableLoader(list(range(N)), BATCH, seed=SEED)  # rank/world from the group
        if state is not None:
            loader.load_state_dict(state)
        used: dict[int, list[int]] = {}
        done = 0
        while done < steps:
            n_before = done
            for batch in loader:
                step = torch.ones(1)
                dist.all_reduce(step)  # every rank must be in every step
                assert step.item() == world
                if not loader.last_batch_is_padding:
                    used.setdefault(loader.epoch, []).extend(batch.tolist())
                done += 1
                if done == steps:
                    break
            if done == n_before:
                break
        out = {"used": used, "state": loader.state_dict(), "steps": done, "len": len(loader)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(tmp_path, phase: str, world: int, state: dict | None, steps: int) -> list[dict]:
    out_dir = tmp_path / phase
    out_dir.mkdir()
    store = str(tmp_path / f"{phase}.store")
    # fork: the children skip re-importing torch (seconds each on a busy machine); CPU only
    mp.start_processes(
        _rank_main, args=(world, store, str(out_dir), state, steps), nprocs=world, start_method="fork"
    )
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(120)
def test_two_ranks_interrupted_then_three_ranks_consume_each_epoch_exactly_once(tmp_path):
    first = _run(tmp_path, "w2", 2, None, steps=3)
    states = [r["state"] for r in first]
    assert states[0] == states[1]  # the position is the same on every rank
    assert states[0]["consumed"] == 3 * 2 * BATCH and not states[0]["epoch_done"]

    # resume on 3 ranks: the rest of epoch 0 (26 samples: 12 + 7 + 7), then all of epoch 1
    second = _run(tmp_path, "w3", 3, states[0], steps=3 + 5)
    assert {r["steps"] for r in second} == {8} and {r["len"] for r in second} == {5}
    final = second[0]["state"]
    assert final["epoch"] == 1 and final["epoch_done"] and final["consumed"] == N
    assert final["epoch_world_size"] == 3 and final["world_size"] == 3

    epoch0 = [i for r in first + second for i in r["used"].get("0", [])]
    epoch1 = [i for r in second for i in r["used"].get("1", [])]
    assert sorted(epoch0) == list(range(N))
    assert sorted(epoch1) == list(range(N))
