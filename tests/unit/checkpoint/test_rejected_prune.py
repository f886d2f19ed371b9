"""Bounding ``rejected/`` (issue 19, item 6): the pure choice as tables, and one run on files."""

from __future__ import annotations

import json

import pytest
import torch

from cfdist.checkpoint import rejected
from cfdist.checkpoint.discovery import committed_steps
from cfdist.checkpoint.persist import PersistJob, ShardJob, write_checkpoint
from cfdist.checkpoint.rejected import REASON, REJECTED, Entry, choose_prune
from cfdist.checkpoint.snapshot import plan_layout
from cfdist.storage import open_storages


def E(step, when, nbytes=0):
    return Entry(f"step-{step:09d}-t{when}", step, float(when), nbytes)


def tags(*entries):
    return [e.tag for e in entries]


TABLE = [
    # entries (step, moved at)                      live          keep  max_bytes  -> deleted
    ([],                                             [10],         2,    None,      []),
    ([E(4, 1), E(8, 2)],                             [10],         2,    None,      []),
    # beyond the 2 most recently moved: deleted, the run is past them (live 10)
    ([E(4, 1), E(8, 2), E(6, 3), E(9, 4)],          [10],         2,    None,      tags(E(8, 2), E(4, 1))),
    # ...unless an entry is the only copy of a step still ahead of the run (12 > 10)
    ([E(12, 1), E(8, 2), E(6, 3), E(9, 4)],         [10],         2,    None,      tags(E(8, 2))),
    # two copies of 12 ahead of the run: the most recently moved stays
    ([E(12, 1), E(12, 2), E(6, 3), E(9, 4)],        [10],         2,    None,      tags(E(12, 1))),
    # a copy of 12 within the bound: the older copy beyond it goes
    ([E(12, 1), E(12, 4), E(6, 3)],                 [10],         1,    None,      tags(E(6, 3), E(12, 1))),
    # no live checkpoint at all: every step is ahead, one copy each stays
    ([E(4, 1), E(4, 2), E(8, 3)],                   [],           0,    None,      tags(E(4, 1))),
    # keep=0: only what is ahead of the run stays
    ([E(4, 1), E(14, 2), E(8, 3)],                  [10],         0,    None,      tags(E(8, 3), E(4, 1))),
    # a byte bound: the newest 100 bytes; the bound is a prefix (an older small one goes too)
    ([E(4, 1, 10), E(6, 2, 60), E(8, 3, 50)],       [10],         5,    100,       tags(E(6, 2, 60), E(4, 1, 10))),
    ([E(4, 1, 10), E(6, 2, 40), E(8, 3, 50)],       [10],         5,    100,       []),
    # an entry ahead of the run beyond the byte bound stays, and counts
    ([E(14, 1, 500), E(6, 2, 60), E(8, 3, 50)],     [10],         5,    100,       tags(E(6, 2, 60))),
    # unknown move times (0.0) are the oldest
    ([E(4, 0), E(6, 0), E(8, 5)],                   [10],         1,    None,      tags(E(6, 0), E(4, 0))),
]


@pytest.mark.parametrize("entries, live, keep, max_bytes, deleted", TABLE)
def test_choose_prune(entries, live, keep, max_bytes, deleted):
    assert choose_prune(entries, live=live, keep=keep, max_bytes=max_bytes) == deleted


@pytest.mark.parametrize("entries, live, keep, max_bytes, deleted", TABLE)
def test_never_deletes_the_only_copy_of_a_step_ahead_of_the_run(entries, live, keep, max_bytes, deleted):
    """The property behind the table: every step above the live ones keeps one entry, and what
    stays beyond the bound is only that."""
    gone = set(choose_prune(entries, live=live, keep=keep, max_bytes=max_bytes))
    staying = [e for e in entries if e.tag not in gone]
    ahead = {e.step for e in entries if e.step > max(live, default=-1)}
    assert ahead <= {e.step for e in staying}
    assert len(staying) <= keep + len(ahead)


def test_keep_below_zero_is_refused():
    with pytest.raises(ValueError, match="keep must be >= 0"):
        choose_prune([], live=[], keep=-1)


def _commit(sts, step: int, lineage: dict | None = None) -> None:
    """Commit a two-tensor checkpoint of ``step`` striped over ``sts`` (what every backend runs)."""
    tensors = {"a": torch.full((64,), float(step)), "b": torch.full((32,), -float(step))}
    layout = plan_layout(tensors, len(sts))
    arenas = []
    for es in layout:
        buf = torch.empty(max(sum(e.nbytes for e in es), 1), dtype=torch.uint8)
        for e in es:
            buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(tensors[e.name])
        arenas.append(buf)
    shards = [ShardJob(index=i, count=len(layout), root=i, nbytes=sum(e.nbytes for e in es), entries=es)
              for i, es in enumerate(layout)]
    manifest = {"skeleton": {k: {"__t__": k} for k in tensors}, **({"lineage": lineage} if lineage else {})}
    write_checkpoint(sts, PersistJob(step=step, manifest=manifest, shards=shards, keep=100, arenas=arenas))


def test_moving_aside_on_files_prunes_to_the_bound_and_keeps_the_steps_ahead(tmp_path, monkeypatch):
    """Real ``file://`` storage striped over two roots, real moves: steps 1..12 committed, then
    12, 11, 10, 9 and 7 .. 1 moved aside in that order (the run is left at step 8). With
    ``KEEP=3`` each move prunes ``rejected/`` to the 3 most recently moved entries (1, 2, 3) plus
    the only copies of the steps ahead of the run (9 .. 12). The point: 4 .. 7 are gone on both
    roots; what stays still loads (step 12 from rejected/, bit for bit)."""
    import cfdist

    monkeypatch.setattr(rejected, "KEEP", 3)
    urls = [f"file://{tmp_path}/r0", f"file://{tmp_path}/r1"]
    sts = open_storages(urls)
    for s in range(1, 13):
        _commit(sts, s)
    for s in (12, 11, 10, 9, 7, 6, 5, 4, 3, 2, 1):
        rejected.move_aside(sts, s, why=f"a test rollback past {s}", replaced_by=None)
    assert committed_steps(sts[0]) == [8]
    left = {t: json.loads((tmp_path / "r0" / REJECTED / t / REASON).read_text())["step"]
            for t in sts[0].listdir(REJECTED)}
    assert sorted(left.values()) == [1, 2, 3, 9, 10, 11, 12]
    assert sts[1].listdir(REJECTED) == sorted(left)                # the second root pruned alike
    got = cfdist.load(urls, step=12)["state"]
    assert torch.equal(got["a"], torch.full((64,), 12.0)) and torch.equal(got["b"], torch.full((32,), -12.0))


def test_another_nodes_copy_of_the_same_state_is_not_moved_aside(tmp_path):
    """Two writers of one job (two nodes) commit step 5: the same lineage, tensors and RNG
    states, at different times. Node a's copy is in the shared tier; node b's arrives (a new
    uploader after a recovery, a flush). Real: ``transfer.freeze``/``commit_frozen`` on
    ``file://``. The point: nothing is rewritten and nothing lands in ``rejected/`` (before the
    fix the copies differed by their time and node b's replaced node a's, which was moved aside);
    a different state of step 5 (another lineage) is still moved aside."""
    from cfdist.cluster import transfer

    job = {"run": "j", "restores": []}
    a, b, shared = (open_storages(f"file://{tmp_path}/{n}") for n in ("a", "b", "shared"))
    _commit(a, 5, job)
    _commit(b, 5, job)
    assert transfer.commit_frozen(transfer.freeze(a, 5), 5, shared, source="node a", keep=2)
    assert not transfer.commit_frozen(transfer.freeze(b, 5), 5, shared, source="node b", keep=2)
    assert shared[0].listdir(REJECTED) == []
    other = open_storages(f"file://{tmp_path}/other")
    _commit(other, 5, {"run": "another", "restores": []})
    assert transfer.commit_frozen(transfer.freeze(other, 5), 5, shared, source="node c", keep=2)
    assert len(shared[0].listdir(REJECTED)) == 1
