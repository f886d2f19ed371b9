"""Which nodes upload what of a shared-tier checkpoint (``plan_shared_slices``, pure): a table.

Node 0's manifest entries and each peer's checksums are made up here (what ``step_sums``
returns); no Ray, no files. The points: ``shared_writers=N`` gives N writers (node 0 and the
first N-1 peers that hold the step, skipping those that do not), ``"all"`` every holder, 1 or
no holder none; the slices are byte-balanced; a tensor whose checksum differs on a helper is
node 0's, written whole by node 0; every byte is written exactly once.
"""

from __future__ import annotations

import pytest

from cfdist.checkpoint.slices import ALIGN
from cfdist.cluster.node_actor import plan_shared_slices

# node 0's copy: 3 large parameters and a small BatchNorm statistic (F32, 4 bytes each)
TENSORS = {
    "model/0.weight": {"dtype": "F32", "shape": [256, 1024], "xxh3": "a"},
    "model/1.running_mean": {"dtype": "F32", "shape": [1024], "xxh3": "bn0"},
    "model/2.weight": {"dtype": "F32", "shape": [1024, 256], "xxh3": "b"},
    "optim/state/0/momentum_buffer": {"dtype": "F32", "shape": [256, 1024], "xxh3": "c"},
}
SAME = {k: t["xxh3"] for k, t in TENSORS.items()}
OTHER_BN = {**SAME, "model/1.running_mean": "bn1"}   # another replica's statistics
TOTAL = sum(4 * t["shape"][0] * (t["shape"][1] if len(t["shape"]) > 1 else 1) for t in TENSORS.values())


@pytest.mark.parametrize("theirs, n, helpers", [
    ([SAME, SAME], 2, (0,)),                  # 3 nodes, shared_writers=2: node 0 and the first peer
    ([None, SAME], 2, (1,)),                  # the first peer lacks the step: the next holder helps
    ([SAME, SAME], "all", (0, 1)),
    ([SAME, None, SAME], "all", (0, 2)),
    ([SAME, SAME, SAME], 3, (0, 1)),          # 4 nodes, N=3
    ([None, SAME], 3, (1,)),                  # fewer holders than asked: as many as there are
    ([SAME, SAME], 1, None),                  # node 0 uploads whole
    ([None, None], "all", None),              # nobody else holds it: whole
    ([], "all", None),                        # one node
])
def test_writers_are_node_0_and_the_first_holders(theirs, n, helpers):
    plan = plan_shared_slices(TENSORS, theirs, n)
    if helpers is None:
        assert plan is None
        return
    assert plan.helpers == helpers and plan.writers == 1 + len(helpers) == len(plan.pieces)
    per_writer = [sum(p.nbytes for p in ps) for ps in plan.pieces]
    assert sum(per_writer) == TOTAL
    assert max(per_writer) - min(per_writer) <= 2 * ALIGN, per_writer   # balanced by bytes
    covered = {}
    for ps in plan.pieces:
        for p in ps:
            covered.setdefault(p.name, []).append((p.start, p.stop))
    for name, ranges in covered.items():   # each tensor's bytes exactly once
        ranges.sort()
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (name, ranges)
    assert covered.keys() == TENSORS.keys()
    assert set(plan.split) == {k for k, r in covered.items() if len(r) > 1}


def test_what_differs_on_a_helper_is_node_0s_written_whole():
    """Another replica's BatchNorm statistics (a different checksum) are pinned to node 0; a
    peer that is not among the writers does not pin anything."""
    plan = plan_shared_slices(TENSORS, [OTHER_BN, SAME], 2)
    assert plan.pinned == {"model/1.running_mean"}
    bn = [p for ps in plan.pieces for p in ps if p.name == "model/1.running_mean"]
    assert len(bn) == 1 and bn[0].whole and bn[0] in plan.pieces[0]

    plan = plan_shared_slices(TENSORS, [SAME, OTHER_BN], 2)   # the odd copy is on the third node
    assert plan.helpers == (0,) and plan.pinned == frozenset()


def test_a_tensor_without_a_checksum_is_pinned():
    tensors = {**TENSORS, "model/1.running_mean": {**TENSORS["model/1.running_mean"], "xxh3": None}}
    plan = plan_shared_slices(tensors, [SAME], "all")
    assert plan.pinned == {"model/1.running_mean"}
