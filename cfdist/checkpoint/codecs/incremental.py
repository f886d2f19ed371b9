"""``Incremental``: Check-N-Run's incremental checkpoints of embedding tables (lossless).

Only the rows of a tensor that differ from the reference are written, with their indices;
every ``full_every``-th checkpoint is full. Rows are dimension 0 (a ``(rows, ...)`` tensor is
compared as ``(rows, -1)``); every tensor with at least two dimensions is selected unless
``match`` narrows it, so embedding tables *and their optimizer state* (Adagrad sums,
SparseAdam moments: also touched row by row) shrink; a dense weight whose rows all changed
costs its full size plus nothing (no index is written when every row changed).

Changed rows are found by comparing the snapshot with the reference row by row, bit for bit
(``-0.0`` vs ``0.0`` and NaN payloads count as changes). That needs no help from the user and
no hook in the training loop, works for any optimizer, dense or sparse gradients, and runs in
the persist path, never at the gate; its cost is one extra copy of the selected tensors in the
persisting process (see :mod:`.chain`) and one read of both copies per checkpoint (memory
bandwidth: ``bench/bench_codecs.py`` measures it). Sparse-gradient or optimizer-touch tracking
would need the training process's cooperation and would miss in-place edits.

Variants (Check-N-Run §4.2):

* ``variant="intermittent"`` (default): each increment holds the rows changed since the last
  full checkpoint, so a restore reads two checkpoints; a full one every ``full_every``;
* ``full_every=None``: one-shot, a single full checkpoint and increments against it forever;
* ``variant="consecutive"``: each increment holds the rows changed since the previous
  checkpoint (the smallest increments); a restore reads the whole chain back to the full one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from cfdist.checkpoint.codecs.base import Codec, _patterns, matches, register
from cfdist.checkpoint.format import CheckpointError

VARIANTS = ("intermittent", "consecutive")


def bits_view(a: np.ndarray) -> np.ndarray:
    """``a`` reinterpreted as unsigned ints of its item size (compare bits, not values)."""
    if a.dtype.kind == "u":
        return a
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def changed_rows(cur: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Indices of the rows (dimension 0) where ``cur`` and ``ref`` differ in any bit."""
    n = cur.shape[0]
    if cur.size == 0:
        return np.zeros(0, dtype=np.int64)
    c, r = bits_view(cur).reshape(n, -1), bits_view(ref).reshape(n, -1)
    if c.shape[1] == 0:
        return np.zeros(0, dtype=np.int64)
    out = []
    step = max(1, (8 << 20) // max(c.shape[1] * c.itemsize, 1))   # bounded temporaries
    for a in range(0, n, step):
        out.append(np.flatnonzero((c[a:a + step] != r[a:a + step]).any(axis=1)) + a)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


@register
@dataclass(frozen=True)
class Incremental(Codec):
    """Write only the rows changed since the reference checkpoint; a full one every ``full_every``."""

    full_every: int | None = 10
    """A full checkpoint every this many checkpoints (None: only the first, Check-N-Run's one-shot)."""
    match: str | tuple[str, ...] | None = None
    """Glob(s) on tensor names; None selects every tensor with two or more dimensions."""
    variant: str = "intermittent"
    """``"intermittent"`` (against the last full one) or ``"consecutive"`` (against the previous one)."""

    kind: ClassVar[str] = "chain"
    name: ClassVar[str] = "incremental"
    lossy: ClassVar[bool] = False
    work: ClassVar[float] = 2.0   # the changed rows and their indices (row comparisons are bounded)

    def __post_init__(self):
        if self.full_every is not None and not (isinstance(self.full_every, int) and self.full_every >= 1):
            raise ValueError(f"Incremental(full_every={self.full_every!r}): must be an int >= 1 "
                             f"(a full checkpoint every N) or None (one-shot: only the first is full)")
        if self.variant not in VARIANTS:
            raise ValueError(f"Incremental(variant={self.variant!r}): must be one of {VARIANTS}")
        object.__setattr__(self, "_pats", _patterns(self.match))

    @property
    def consecutive(self) -> bool:
        return self.variant == "consecutive"

    def selects(self, name, dtype, shape) -> bool:
        return len(shape) >= 2 and matches(self._pats, name)

    def encode(self, name: str, parts: dict, plan) -> tuple[dict, dict | None]:
        cur = parts["data"]
        ref = plan.reference(name, cur)
        if ref is None:
            plan.remember(name, cur)
            return parts, None
        rows = changed_rows(cur, ref)
        meta = {"name": self.name, "ref": plan.ref[0], "ref_id": plan.ref[1], "variant": self.variant}
        if len(rows) == cur.shape[0]:
            if self.consecutive and len(rows):
                new = plan.keep(cur)   # a chunk of a budgeted snapshot is reused before the commit
                plan.after_commit(lambda refs: refs[name].__setitem__(slice(None), new))
            meta["all_rows"] = True
            return parts, meta
        data = cur[rows]   # a copy (fancy indexing): the increment, and the reference's new rows
        if self.consecutive and len(rows):
            plan.after_commit(lambda refs: refs[name].__setitem__(rows, data))
        idx = rows.astype(np.int32 if cur.shape[0] < 2 ** 31 else np.int64)
        return {"rows": idx, "data": data}, meta

    @staticmethod
    def decode(parts: dict, meta: dict, ctx) -> dict:
        if meta.get("all_rows"):
            return parts
        ref = ctx.load_ref(meta["ref"], meta["ref_id"])
        out = np.array(ref, copy=True)
        rows, data = parts.get("rows"), parts["data"]
        n = out.shape[0]
        if rows is None or rows.ndim != 1 or data.shape[0] != len(rows) or data.shape[1:] != out.shape[1:] \
                or (len(rows) and (rows.min() < 0 or rows.max() >= n)):
            raise CheckpointError(f"{ctx.where}: tensor {ctx.name!r}: increment rows do not fit a "
                                  f"{out.shape} tensor")
        out[rows] = data
        return {"data": out}
