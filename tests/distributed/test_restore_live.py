"""A survivor's live state, kept in its process, restores a new group over that group.

Real: 2 spawned processes in a gloo process group (FileStore in tmp_path), DDP over a small MLP
under SGD with momentum and a step LR scheduler, the Checkpointer with
``GroupOptions(live=True)`` (as ``cfdist.fit`` builds it) over ``file://`` storage.

An embedding and a buffer are large enough (``peer.DIRECT_MIN``) to travel on their own, into
the replacement's own tensors. Rank 0 trains 6 steps beside rank 1 and keeps its live state (``Checkpointer.keep_live``, as
after its group failed); then both ranks build fresh objects (rank 1's from another seed, as a
replacement process would, with nothing of the run) and a fresh Checkpointer, and
``restore_live(6, src=0, ...)`` gives both rank 0's step 6: no file is read or written. Both
then train on to step 10 and end bit-identical to an uninterrupted run of 10 steps. A source
without a kept state makes every rank raise ``CheckpointError`` (not hang); a state torn by a
failure inside the optimizer update is not kept.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import cfdist
from cfdist.checkpoint import peer
from cfdist.checkpoint.format import CheckpointError
from cfdist.cluster.exits import ends_process
from tests.distributed.ranks import gloo_cases, run_ranks

KEPT_AT, END = 6, 10


class _Net(torch.nn.Module):
    """A small MLP beside an embedding and a buffer of >= ``peer.DIRECT_MIN`` bytes each (the
    embedding's momentum too): those travel on their own, the embedding and the buffer straight
    into a replacement's own tensors."""

    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        self.emb = torch.nn.Embedding(65536, 4)
        self.register_buffer("table", torch.randn(300_000))

    def forward(self, x):
        return self.mlp(x) + 0.01 * self.emb.weight[:4].sum()


def _objects(seed: int):
    torch.manual_seed(seed)
    ddp = DDP(_Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return {"model": ddp, "optim": opt, "sched": sched}


def _train(objs, ckpt, rank: int, first: int, last: int) -> None:
    for i in range(first, last + 1):   # each rank's batch of step i depends on (i, rank) only
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * i + rank))
        objs["model"](x).pow(2).mean().backward()
        ckpt.step(objs["optim"])
        objs["sched"].step()
        objs["optim"].zero_grad()


def _values(t: torch.Tensor):
    return t.tolist() if t.numel() < 10_000 else hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _state(objs) -> dict:
    return {"model": {k: _values(v) for k, v in objs["model"].module.state_dict().items()},
            "momentum": [_values(objs["optim"].state[p]["momentum_buffer"]) for p in objs["model"].parameters()],
            "lr": objs["sched"].get_last_lr()}


def _ckpt(objs, url: str, name: str):
    return cfdist.Checkpointer(objs, f"{url}/{name}", cfdist.Every(1000), group=cfdist.GroupOptions(live=True))


@ends_process
def _worker(rank: int, store_path: str, url: str, out: str) -> None:
    def uninterrupted():
        objs = _objects(0)
        ckpt = _ckpt(objs, url, "ref")
        _train(objs, ckpt, rank, 1, END)
        ckpt.close()
        return _state(objs)

    def restored():
        objs = _objects(0)
        ckpt = _ckpt(objs, url, "live")
        _train(objs, ckpt, rank, 1, KEPT_AT)
        kept = ckpt.keep_live() if rank == 0 else None
        before = _state(objs)
        ckpt.abandon()
        fresh = _objects(1 + rank)   # a replacement's objects: nothing of the run
        ckpt2 = _ckpt(fresh, url, "live2")
        got = ckpt2.restore_live(KEPT_AT, 0, kept[1] if kept else None)
        after_restore = _state(fresh)
        step_count = ckpt2.step_count
        _train(fresh, ckpt2, rank, KEPT_AT + 1, END)
        ckpt2.close()
        return {"kept_step": kept[0] if kept else None, "got": got, "step_count": step_count,
                "before": before, "after_restore": after_restore, "end": _state(fresh)}

    def missing():
        objs = _objects(0)
        ckpt = _ckpt(objs, url, "missing")
        try:
            ckpt.restore_live(3, 0, None)
        except CheckpointError as e:
            return str(e)
        finally:
            ckpt.abandon()
        return None

    def torn():
        objs = _objects(0)
        ckpt = _ckpt(objs, url, "torn")
        _train(objs, ckpt, rank, 1, 2)
        live = ckpt._live is not None   # every rank keeps one, the writer (rank 0) and the other
        if live:
            ckpt._live.in_update = True   # as after optimizer.step() raised inside ckpt.step
        kept = ckpt.keep_live()
        ckpt.abandon()
        return {"writer": ckpt.writer, "live": live, "kept": kept is not None}

    def sliced():
        """``writers="all"`` (each rank persists a slice): the run that kept step 6 in rank 0's
        process and the fresh replacement restore it live, then train on into the same root;
        the next checkpoint (8) must commit sliced again. Beside it, the same sliced run
        without a failure (root ``sref``), whose step 8 the restored run's must equal."""
        def ckpt(objs, name):
            return cfdist.Checkpointer(objs, f"{url}/{name}", cfdist.Every(4), writers="all",
                                       group=cfdist.GroupOptions(live=True))

        objs = _objects(0)
        ref = ckpt(objs, "sref")
        _train(objs, ref, rank, 1, END)
        ref.close()
        objs = _objects(0)
        first = ckpt(objs, "sliced")
        _train(objs, first, rank, 1, KEPT_AT)   # step 4 commits, in slices
        first.wait()
        kept = first.keep_live() if rank == 0 else None
        first.abandon()
        fresh = _objects(1 + rank)
        again = ckpt(fresh, "sliced")
        got = again.restore_live(KEPT_AT, 0, kept[1] if kept else None)
        _train(fresh, again, rank, KEPT_AT + 1, END)   # step 8 is the next checkpoint
        again.wait()
        latest = again.latest_step
        again.close()
        return {"got": got, "latest": latest, "writer": again.writer, "end": _state(fresh)}

    def into():
        """``peer.broadcast_state(..., into=...)`` on its own: which destinations a receiver's
        tensors are, and that every value arrives."""
        big = peer.DIRECT_MIN // 4
        sent = {"in_place": torch.arange(big, dtype=torch.float32),
                "fresh_dtype": torch.arange(big, dtype=torch.float32),
                "strided": torch.arange(2 * big, dtype=torch.float32).reshape(2, big),
                "absent": torch.full((big,), 7.0),
                "small": torch.arange(10, dtype=torch.int64), "small_too": torch.ones(3, dtype=torch.bool)}
        if rank == 0:
            peer.broadcast_state(({"step": 1}, sent), 0)
            return None
        dest = {"in_place": torch.zeros(big), "fresh_dtype": torch.zeros(big, dtype=torch.float64),
                "strided": torch.zeros(big, 2).t(), "small": torch.zeros(10, dtype=torch.int64)}
        manifest, got = peer.broadcast_state(None, 0, into=dest)
        return {"manifest": manifest,
                "equal": {n: torch.equal(got[n], t) for n, t in sent.items()},
                "same": {n: got[n].data_ptr() == dest[n].data_ptr() for n in dest}}

    gloo_cases(rank, 2, store_path, out, [("uninterrupted", uninterrupted), ("restored", restored),
                                          ("missing", missing), ("torn", torn), ("sliced", sliced),
                                          ("into", into)])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restore-live")
    out = tmp / "out"
    out.mkdir()
    codes = run_ranks(_worker, lambda r: (r, str(tmp / "store"), f"file://{tmp}/ckpt", str(out)), 2, 240)
    assert codes == [0, 0]
    res = [json.load(open(out / f"rank{r}.json")) for r in range(2)]
    return res, tmp


def test_both_ranks_restore_the_survivors_step_and_end_bit_identical_to_the_uninterrupted_run(results):
    res, tmp = results
    r0, r1 = res[0]["restored"], res[1]["restored"]
    assert r0["kept_step"] == KEPT_AT and r0["got"] == r1["got"] == KEPT_AT
    assert r0["step_count"] == r1["step_count"] == KEPT_AT
    # the replacement (rank 1, other initial weights) holds exactly rank 0's step 6: model,
    # momentum, scheduler
    assert r0["after_restore"] == r0["before"] and r1["after_restore"] == r0["before"]
    assert r0["end"] == r1["end"] == res[0]["uninterrupted"] == res[1]["uninterrupted"]
    # nothing went through storage: no step was written for the restored Checkpointer
    # (the roots' names: "live" is in the tmp path too)
    assert not [p for p in (tmp / "ckpt").rglob("step-*") if p.parent.name in ("live", "live2")]


def test_a_receiver_gets_large_tensors_in_place_where_they_fit_and_every_value_everywhere(results):
    """A destination of the same dtype, shape and a contiguous layout receives in place (a large
    one straight from the sender, a small one from the packed buffer); one of another dtype or a
    strided one is passed over for a fresh tensor, as is a name it lacks; every value arrives."""
    res, _ = results
    got = res[1]["into"]
    assert got["manifest"] == {"step": 1}
    assert all(got["equal"].values()), got["equal"]
    assert got["same"] == {"in_place": True, "fresh_dtype": False, "strided": False, "small": True}, got["same"]


def test_a_source_without_live_state_fails_every_rank_instead_of_hanging(results):
    res, _ = results
    for r in res:
        assert r["missing"] and "holds no live state" in r["missing"], r["missing"]


def test_a_state_torn_inside_the_optimizer_update_is_not_kept(results):
    res, _ = results
    assert res[0]["torn"] == {"writer": True, "live": True, "kept": False}
    assert res[1]["torn"] == {"writer": False, "live": True, "kept": False}


def test_sliced_writers_commit_the_next_checkpoint_after_a_live_restore(results):
    """``writers="all"``: after ``restore_live`` (rank 0 kept step 6, rank 1 is a fresh
    replacement) both ranks are writers again and the next checkpoint, step 8, commits in two
    slices (one per rank) into the run's root, loads, and holds exactly the state the same
    sliced run without a failure checkpointed at step 8; the run ends bit-identical to the
    uninterrupted one."""
    res, tmp = results
    for r in res:
        assert r["sliced"]["got"] == KEPT_AT and r["sliced"]["writer"], r["sliced"]
        assert r["sliced"]["end"] == res[0]["uninterrupted"]
    assert res[0]["sliced"]["latest"] == 8, res[0]["sliced"]   # writer 0 commits; it knows the step at once
    assert [c["step"] for c in cfdist.list_checkpoints(f"file://{tmp}/ckpt/sliced")] == [4, 8]
    m = json.load(open(tmp / "ckpt" / "sliced" / "step-000000008" / "MANIFEST.json"))
    assert m["slicing"]["writers"] == 2 and sorted({sh["writer"] for sh in m["shards"]}) == [0, 1], m["slicing"]
    assert m["lineage"]["restores"][-1] == KEPT_AT, m["lineage"]
    got, want = (cfdist.load(f"file://{tmp}/ckpt/{n}", step=8)["state"] for n in ("sliced", "sref"))
    for part in ("model", "optim"):
        flat_got, flat_want = _flat(got[part]), _flat(want[part])
        assert flat_got.keys() == flat_want.keys(), part
        for k in flat_want:
            assert torch.equal(flat_got[k], flat_want[k]) if isinstance(flat_want[k], torch.Tensor) \
                else flat_got[k] == flat_want[k], (part, k)


def _flat(tree, prefix=""):
    """``{path: leaf}`` of a nested dict/list of tensors and plain values."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
    if items is None:
        return {prefix: tree}
    out = {}
    for k, v in items:
        out.update(_flat(v, f"{prefix}/{k}"))
    return out
