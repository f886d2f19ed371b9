"""Retention's pure choice: which committed checkpoints to delete right after a commit."""

from __future__ import annotations

import pytest

from cfdist.checkpoint.retention import choose_deletions

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
    # a run restored step 20 (30 and 40 were rejected or skipped), then committed 25:
    ([(10, _), (20, _), (25, _), (30, _), (40, E)], 2,  True,   25,     [10, 30, 40]),
    ([(20, _), (25, _), (30, _)],                  1,   True,   25,     [20, 30]),
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
