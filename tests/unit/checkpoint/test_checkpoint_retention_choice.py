"""Retention's pure choice: which committed checkpoints to delete or move aside after a commit."""

from __future__ import annotations

import errno

import pytest

from cfdist.checkpoint import retention
from cfdist.checkpoint.retention import UNKNOWN, Committed, choose, choose_deletions, is_ancestor

E = True    # an epoch-end checkpoint
_ = False

CASES = [
    # committed (step, epoch_end)                 keep  keep_ee newest  -> deleted
    ([],                                           1,   True,   None,   []),
    ([(10, _)],                                    1,   True,   10,     []),
    ([(10, _), (20, _)],                           1,   True,   20,     [10]),
    ([(10, _), (20, _), (30, _)],                  2,   True,   30,     [10]),
    ([(10, _), (20, _), (30, _)],                  5,   True,   30,     []),
    ([(10, E), (20, _), (30, _)],                  1,   True,   30,     [20]),
    ([(10, E), (20, _), (30, _)],                  1,   False,  30,     [10, 20]),
    ([(10, E), (20, E), (30, E)],                  1,   True,   30,     []),
    ([(30, _), (10, _), (20, _)],                  1,   True,   30,     [10, 20]),   # any order in
    # a run restored step 20 (30 and 40 were rejected or skipped), then committed 25: the
    # steps above 25 are moved aside (see the lineage table below), never deleted
    ([(10, _), (20, _), (25, _), (30, _), (40, E)], 2,  True,   25,     [10]),
    ([(20, _), (25, _), (30, _)],                  1,   True,   25,     [20]),
    # keep_epoch_ends=N: the N most recent epoch ends (0/False: none)
    ([(10, E), (20, E), (30, _), (40, _)],         1,   1,      40,     [10, 30]),
    ([(10, E), (20, E), (30, _), (40, _)],         1,   2,      40,     [30]),
    ([(10, E), (20, E), (30, _), (40, _)],         1,   0,      40,     [10, 20, 30]),
    ([(10, E), (20, E), (30, E), (40, _)],         2,   1,      40,     [10, 20]),    # 30 is both
]


@pytest.mark.parametrize("committed, keep, keep_ee, newest, deleted", CASES)
def test_choose_deletions(committed, keep, keep_ee, newest, deleted):
    assert choose_deletions(committed, keep=keep, keep_epoch_ends=keep_ee, newest=newest) == deleted


@pytest.mark.parametrize("committed, keep, keep_ee, newest, deleted", CASES)
def test_never_deletes_the_newest_commit_nor_leaves_fewer_than_keep(committed, keep, keep_ee, newest, deleted):
    """Invariant 2 as a property of the table: the checkpoint just committed always survives,
    and the ``keep`` newest at or below it survive, so a failure rolls back at most one step."""
    gone = set(choose_deletions(committed, keep=keep, keep_epoch_ends=keep_ee, newest=newest))
    live = sorted(s for s, _e in committed if newest is None or s <= newest)
    assert newest not in gone
    assert not gone & set(live[-keep:])


def test_keep_below_one_is_refused():
    with pytest.raises(ValueError, match="keep must be >= 1"):
        choose_deletions([(1, False)], keep=0, keep_epoch_ends=True)


A = {"run": "a", "restores": []}
A35 = {"run": "a", "restores": [35]}
A35_50 = {"run": "a", "restores": [35, 50]}
B = {"run": "b", "restores": []}

ANCESTRY = [
    # checkpoint          newest               -> ancestor?
    ((30, A),              (40, A),              True),
    ((40, A),              (37, A35),            False),   # rolled back past 40 (restored 35)
    ((35, A),              (37, A35),            True),    # the restored step itself
    ((30, A),              (37, A35),            True),
    ((36, A35),            (55, A35_50),         True),
    ((52, A35),            (55, A35_50),         False),   # rolled back past 52 (restored 50)
    ((40, A),              (55, A35_50),         False),   # rolled back past it twice over
    ((30, B),              (40, A),              False),   # another run in the same directory
    ((30, A35),            (40, A),              False),   # a branch the newest does not contain
    ((30, UNKNOWN),        (40, A),              None),    # unreadable: unknown
]


@pytest.mark.parametrize("ckpt, newest, want", ANCESTRY)
def test_ancestry_follows_the_restores_of_the_lineage(ckpt, newest, want):
    assert is_ancestor(*ckpt, *newest) is want


def test_issue_scenario_the_rolled_back_step_is_moved_aside_and_ancestors_are_kept():
    """Steps 35 and 40 committed (keep=2); a run restored 35 and committed 37: 40 is moved aside
    (with a reason), nothing of the new lineage's history is deleted beyond ``keep``."""
    plan = choose([Committed(30, False, A), Committed(35, False, A), Committed(40, False, A),
                   Committed(37, False, A35)], keep=2, keep_epoch_ends=True, newest=37)
    assert plan.delete == [30]
    assert [s for s, _ in plan.move_aside] == [40]
    assert "numbered above step 37" in plan.move_aside[0][1]


@pytest.mark.parametrize("bad", [Committed(30, None, A), Committed(30, None, UNKNOWN), Committed(30, False, UNKNOWN)])
def test_unknown_is_never_deleted_nor_moved(bad):
    plan = choose([Committed(10, False, A), bad, Committed(40, False, A)], keep=1, keep_epoch_ends=True, newest=40)
    assert plan.delete == [10] and plan.move_aside == []


def test_another_runs_checkpoints_are_moved_aside_not_deleted():
    plan = choose([Committed(5, False, B), Committed(8, False, B), Committed(3, False, A)], keep=1,
                  keep_epoch_ends=True, newest=3)
    assert plan.delete == [] and [s for s, _ in plan.move_aside] == [5, 8]


class _Flaky:
    """A storage whose first manifest read fails with EIO (a pure fake: only ``read_bytes``)."""

    url = "memory://retention-unit-flaky"

    def __init__(self):
        self.reads = 0

    def read_bytes(self, rel):
        self.reads += 1
        if self.reads == 1:
            raise OSError(errno.EIO, "injected")
        return b'{"epoch_end": true}'


def test_an_unreadable_manifest_is_unknown_and_not_cached():
    """The bug: ``_is_epoch_end`` cached False after a read error, so a kept epoch end could be
    deleted at a later commit. Now a failed read answers None (unknown) and is retried next time."""
    st = _Flaky()
    assert retention._is_epoch_end(st, 8) is None
    assert retention._is_epoch_end(st, 8) is True
    assert st.reads == 2


def test_every_rank_of_a_job_starts_with_the_same_lineage():
    """``job_lineage`` through a real c10d HashStore: the ranks' Channels (built in any order)
    get the lineage proposed first; without a channel (one process) each call draws a new one.
    The point: the writers of one job (one per node under ``cfdist.fit``) write one lineage, so
    a node that restores another node's copy keeps its own history (issue 19, item 6)."""
    import torch.distributed as dist

    from cfdist.checkpoint.agreement import Channel
    from cfdist.checkpoint.retention import job_lineage

    store = dist.HashStore()
    chans = [Channel(store, rank=r, world_size=3, timeout_s=5.0) for r in (2, 0, 1)]
    got = [job_lineage(c) for c in chans]
    assert got[0] == got[1] == got[2] and got[0]["restores"] == [] and isinstance(got[0]["run"], str)
    second = [job_lineage(Channel(store, rank=r, world_size=3, timeout_s=5.0)) for r in (0, 1, 2)]
    assert second[0] == second[1] == second[2] != got[0]   # a second Checkpointer: a new job lineage
    assert job_lineage(None) != job_lineage(None)
