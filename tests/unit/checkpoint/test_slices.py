"""Sliced checkpoints (``writers="all"``): the slice plan (pure, tables) and ``writers=`` validation.

The points: the plan tiles every tensor exactly and balances bytes within ``ALIGN``; module
buffers stay whole on writer 0; bad ``writers=`` values and contradictions with ``writer=`` are
refused naming the value. The protocol itself: tests/distributed/test_parallel_persist.py.
"""

from __future__ import annotations

import pytest
import torch

import cfdist
from cfdist.checkpoint.slices import ALIGN, Piece, plan

MiB = 1 << 20


@pytest.mark.parametrize("sizes,writers", [
    ([("a", 10 * MiB)], 2),                                    # one big tensor: split
    ([("a", 3 * MiB), ("b", 5 * MiB), ("c", 100), ("d", 0)], 3),
    ([("e", 7 * MiB)] + [(f"s{i}", 4000) for i in range(50)], 4),
    ([(f"s{i}", 1000) for i in range(100)], 3),                # only small tensors: none split
    ([("a", 100)], 3),                                         # fewer bytes than writers need
])
def test_plan_tiles_every_tensor_and_balances_bytes(sizes, writers):
    p = plan(sizes, writers)
    assert len(p) == writers
    total = sum(n for _, n in sizes)
    for name, n in sizes:
        ranges = sorted((q.start, q.stop) for ps in p for q in ps if q.name == name)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        for ps in p:
            for q in ps:
                if q.name == name and not q.whole:
                    assert q.start % ALIGN == 0 and (q.stop % ALIGN == 0 or q.stop == n)
    if total >= writers * ALIGN:
        assert max(abs(sum(q.nbytes for q in ps) - total / writers) for ps in p) <= ALIGN


def test_plan_keeps_small_tensors_whole_and_is_deterministic():
    sizes = [(f"s{i}", 1000) for i in range(100)]
    assert all(q.whole for ps in plan(sizes, 3) for q in ps)
    assert plan(sizes, 3) == plan(list(sizes), 3)


def test_plan_puts_pinned_tensors_whole_on_writer_0():
    """Module buffers (``first``) differ between replicas: writer 0 (rank 0) writes them."""
    sizes = [("w", 8 * MiB), ("bn.mean", 2 * ALIGN + 4), ("v", 4 * MiB)]
    p = plan(sizes, 2, pinned=frozenset({"bn.mean"}))
    assert Piece("bn.mean", 0, 2 * ALIGN + 4, True) in p[0]
    assert all(q.name != "bn.mean" for q in p[1])


@pytest.mark.parametrize("bad", ["some", "ALL", 0, -1, 1.5, None])   # True/False: this rank writes or not
def test_bad_writers_values_are_refused_naming_the_value(tmp_path, bad):
    with pytest.raises(ValueError, match=r"writers must be 'node'.*got " + repr(bad).replace("(", r"\(")):
        cfdist.Checkpointer({"w": torch.zeros(3)}, f"file://{tmp_path}", writers=bad)


def test_more_writers_than_ranks_and_writer_contradictions_are_refused(tmp_path):
    url = f"file://{tmp_path}"
    with pytest.raises(ValueError, match=r"writers=3 but the job has world_size=2"):
        cfdist.Checkpointer({"w": torch.zeros(3)}, url, writers=3, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"writer=True contradicts writers=1 on rank 1"):
        cfdist.Checkpointer({"w": torch.zeros(3)}, url, writers=1, writer=True, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"writer=False contradicts writers='all' on rank 0"):
        cfdist.Checkpointer({"w": torch.zeros(3)}, url, writers="all", writer=False, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"cannot be combined with codecs"):
        cfdist.Checkpointer({"w": torch.zeros(3)}, url, writers="all", rank=0, world_size=2,
                            codecs=[cfdist.codecs.Zstd()])
