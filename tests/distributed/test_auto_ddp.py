"""``cfdist.Auto`` under 2-rank DDP on gloo: same checkpoint steps everywhere, no extra collective.

Real: two spawned processes, a gloo process group over a TCPStore on 127.0.0.1 (port 0, chosen
by the parent's store), DDP, the Checkpointer and the carrier comm hook; rank 0 persists to a
``file://`` directory through a throttling wrapper that is cut 25x mid-run so that k changes.
Faked: nothing else. The points: both ranks take exactly the same checkpoint steps and apply
every change of k at the same step; a step issues exactly as many torch.distributed collectives
with cfdist as without it (counted by the process group's collective sequence number); the hook
leaves the averaged gradients bit-identical to DDP's default all-reduce.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from cfdist.checkpoint import Checkpointer
from cfdist.checkpoint.sync import SyncHookError, attach_sync_hook
from cfdist.policy import Auto, TunerConfig
from cfdist.storage import open_storage
from cfdist.storage.faults import throttle

WORLD = 2
STEPS_FAST, STEPS_SLOW = 50, 90


class Carry:
    """The smallest carrier policy: sends ``value`` from every rank (only rank 0's travels)."""

    sync_width = 1

    def __init__(self, value):
        self.value, self.fetch = value, None

    def sync_payload(self):
        return (self.value,)

    def sync_attached(self, fetch):
        self.fetch = fetch


class RecordingAuto(Auto):
    """Auto that remembers which steps it answered True for."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.took: list[int] = []

    def should_checkpoint(self, step, *, epoch_end=False):
        t = super().should_checkpoint(step, epoch_end=epoch_end)
        if t:
            self.took.append(step)
        return t


def _collectives(pg) -> int:
    """Collectives this process issued on ``pg`` so far (gloo's sequence number counts each)."""
    return pg._get_sequence_number_for_group()


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Tanh(), torch.nn.Linear(256, 128))


def _batch(rank, i):
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(4, 128, generator=g)


def _worker(rank, port, root, out):
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    pg = dist.distributed_c10d._get_default_group()
    res = {}
    try:
        # ---- 1. the hook keeps DDP's averaged gradients bit for bit ----------------------------
        plain, hooked = DDP(_model()), DDP(_model())
        carrier_policy = Carry(123457 if rank == 0 else 999)  # only rank 0's value travels
        assert attach_sync_hook(hooked, carrier_policy) is True
        assert attach_sync_hook(hooked, carrier_policy) is True  # idempotent
        assert carrier_policy.fetch() is None  # nothing carried before the first backward
        for i in range(3):
            x = _batch(rank, i)
            plain(x).square().mean().backward()
            hooked(x).square().mean().backward()
            for a, b in zip(plain.parameters(), hooked.parameters()):
                assert torch.equal(a.grad, b.grad), "the carrier hook changed a gradient"
        res["carried"] = list(carrier_policy.fetch())

        # ---- 2. another comm hook is refused with a fix ----------------------------------------
        def users_own_hook(state, bucket):
            return torch.futures.Future()

        other = DDP(_model())
        other.register_comm_hook(None, users_own_hook)
        try:
            attach_sync_hook(other, Auto())
            res["conflict"] = None
        except SyncHookError as e:
            res["conflict"] = str(e)

        # ---- 3. baseline: collectives per step without cfdist -------------------------------
        base = DDP(_model())
        opt = torch.optim.SGD(base.parameters(), lr=1e-3)
        res["base_counts"] = []
        for i in range(STEPS_FAST + STEPS_SLOW):
            c0 = _collectives(pg)
            base(_batch(rank, i)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            res["base_counts"].append(_collectives(pg) - c0)

        # ---- 4. Auto with the checkpointer ------------------------------------------------------
        ddp = DDP(_model())
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        storage = open_storage(f"file://{root}")
        if rank == 0:
            storage = throttle(storage, bytes_per_s=4 << 20)
        policy = RecordingAuto(profile_steps=10, tuning=TunerConfig(window_steps=10))
        ckpt = Checkpointer({"model": ddp, "opt": opt}, storage=storage, policy=policy)
        if not policy.stats()["synced"]:  # until the checkpointer attaches it itself
            attach_sync_hook(ddp, policy)
        res["counts"] = []
        for i in range(STEPS_FAST + STEPS_SLOW):
            if i == STEPS_FAST and rank == 0:
                # 25x slower: a persist (~1.6 s) then outlasts any interval the profile can pick
                # (k <= ~31 steps of ~20 ms), so the tuner must raise k on every machine load.
                storage.set_bytes_per_s((4 << 20) / 25)
            c0 = _collectives(pg)
            ddp(_batch(rank, i)).square().mean().backward()
            ckpt.step(opt)
            opt.zero_grad()
            res["counts"].append(_collectives(pg) - c0)
            time.sleep(0.01)
        ckpt.close()
        st = policy.stats()
        res.update(took=policy.took, k=policy.k, synced=st["synced"], phase=st["phase"],
                   changes=[(c["step"], c["k_old"], c["k_new"]) for c in st["changes"]],
                   reasons=[c["reason"] for c in st["changes"]])
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_checkpoint_the_same_steps_with_no_extra_collective(tmp_path):
    # the collective counter this test relies on (present in the torch CI installs)
    assert hasattr(dist.ProcessGroup, "_get_sequence_number_for_group")
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_worker, args=(store.port, (tmp_path / "ck").as_posix(), str(out)), nprocs=WORLD, join=True)
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD))

    assert r0["carried"] == r1["carried"] == [123457]
    assert "Auto(sync=False)" in r0["conflict"] and "Every(k)" in r0["conflict"]

    # no extra collective: per step, exactly the all-reduces plain DDP issues
    assert r0["counts"] == r0["base_counts"] and r1["counts"] == r1["base_counts"]
    assert min(r0["base_counts"]) >= 1  # the counter does see DDP's all-reduce

    # the same steps on both ranks, and every change of k applied at the same step
    assert r0["synced"] and r1["synced"] and r0["phase"] == r1["phase"] == "tuning"
    assert r0["took"] == r1["took"] and len(r0["took"]) >= 4
    assert r0["changes"] == r1["changes"] and len(r0["changes"]) >= 2, r0["reasons"]
    assert r0["k"] == r1["k"]
    assert all(" because " in r for r in r0["reasons"])
    assert all("carried from rank 0" in r for r in r1["reasons"])
    assert r0["took"][0] == 10  # the planned profiling snapshot, on both ranks
