"""Parallel persist: every writer rank writes a disjoint, balanced slice of each checkpoint.

``Checkpointer(..., writers="all" | N)``. In data parallelism every rank holds the same state
after the all-reduce, so rank ``w`` of the ``N`` writers can persist its own part of the state
from its own replica: no data moves between ranks and no collective touches the training group.

**The slice plan** (:func:`plan`, pure). The state's tensors, in their flattened order (the same
on every rank), are laid end to end; the byte stream is cut at ``T*w/N`` (``T``: total bytes),
each cut moved to the nearest multiple of :data:`ALIGN` bytes from the start of the tensor it
falls in. A tensor that a cut crosses is split into byte ranges ("pieces"); every other tensor
stays whole, with its dtype and shape. So slices differ by at most ``ALIGN`` bytes (4 KiB: a
page, a multiple of every element size, and the alignment O_DIRECT wants) whatever the mix of
tensor sizes -- balancing whole tensors instead would leave one writer with a large embedding.
Module buffers (BatchNorm statistics: each replica's forward updates them with its own batch,
so they are *not* identical across ranks) are pinned whole to writer 0, so the checkpoint holds
rank 0's, as a single-writer checkpoint does. A piece is stored as a 1-D ``U8`` tensor named ``<name>@bytes<start>`` (:func:`piece_name`);
the manifest's ``"split"`` maps each split tensor to its dtype, shape and pieces, and a reader
joins them (:func:`join`) after every piece passed its own checksum.

This module is the pure part (the plan, the pieces, joining them on load); the protocol by
which the writers' slices become one committed checkpoint is
:class:`cfdist.checkpoint.slice_commit.SliceCommit`, a stage of each writer's persist pipeline.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from cfdist.checkpoint.format import ST_DTYPES, ST_TO_TORCH, CheckpointError, TensorEntry

log = logging.getLogger("cfdist.slices")

ALIGN = 4096
"""Where a tensor may be cut, in bytes from its start (and so the largest imbalance per cut)."""

_PIECE = "@bytes"


def piece_name(name: str, start: int) -> str:
    return f"{name}{_PIECE}{start}"


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``[start, stop)`` of tensor ``name`` (``whole``: the entire tensor, kept as it is)."""

    name: str
    start: int
    stop: int
    whole: bool

    @property
    def key(self) -> str:
        return self.name if self.whole else piece_name(self.name, self.start)

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def plan(sizes: list[tuple[str, int]], writers: int, *, pinned: frozenset[str] = frozenset(),
         align: int = ALIGN) -> list[list[Piece]]:
    """The pieces each of ``writers`` writes, from ``(name, nbytes)`` in the state's order.

    Pure: the same arguments give the same plan on every rank. Each writer's bytes are within
    ``align`` of ``total / writers``, unless the ``pinned`` tensors (whole, on writer 0) alone
    exceed that share.
    """
    sizes = [s for s in sizes if s[0] in pinned] + [s for s in sizes if s[0] not in pinned]
    total, floor = sum(n for _, n in sizes), sum(n for name, n in sizes if name in pinned)
    cuts = [max(round(total * w / writers), floor) for w in range(1, writers)] + [None]
    out: list[list[Piece]] = [[] for _ in range(writers)]
    w, pos = 0, 0
    for name, n in sizes:
        a = 0
        while True:
            end = cuts[w]
            if end is None or end >= pos + n:
                if a < n or n == 0:
                    out[w].append(Piece(name, a, n, whole=a == 0))
                break
            c = min(max(round((end - pos) / align) * align, a), n)
            if c > a:
                if c == n:
                    out[w].append(Piece(name, a, n, whole=a == 0))
                    break
                out[w].append(Piece(name, a, c, whole=False))
                a = c
            w += 1
        pos += n
    return out


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 view (a copy only when ``t`` is not contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


class Slicer:
    """One writer's part of the state: which tensors and pieces it snapshots and persists."""

    def __init__(self, index: int, writers: int):
        self.index, self.writers = index, writers
        self._sig = None
        self._plan: list[list[Piece]] = []
        self.split: dict = {}

    def _replan(self, tensors: dict[str, torch.Tensor], first: set[str]) -> None:
        sig = (tuple((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), frozenset(first))
        if sig == self._sig:
            return
        sizes = [(n, t.numel() * t.element_size()) for n, t in tensors.items()]
        self._plan = plan(sizes, self.writers, pinned=frozenset(first))
        pieces: dict[str, list] = {}
        for mine in self._plan:
            for p in mine:
                if not p.whole:
                    if p.key in tensors:
                        raise ValueError(f"the state has a tensor named {p.key!r}, which is also the name of a "
                                         f"piece of {p.name!r} in a sliced checkpoint; rename it, or use writers='node'")
                    pieces.setdefault(p.name, []).append([p.key, p.start, p.stop])
        self.split = {n: {"dtype": ST_DTYPES[tensors[n].dtype], "shape": list(tensors[n].shape), "pieces": ps}
                      for n, ps in pieces.items()}
        self._sig = sig

    def select(self, tensors: dict[str, torch.Tensor], first: set[str]) -> tuple[dict[str, torch.Tensor], set[str]]:
        """This writer's tensors (whole ones as they are, pieces as uint8 views of the live
        tensors) and which of them the next forward may mutate (``first``).

        ``first`` (module buffers: BatchNorm statistics, ...) are written whole by writer 0:
        unlike parameters and optimizer state they are not identical across replicas (each
        rank's forward updates them with its own batch; DDP broadcasts rank 0's at the next
        forward), so the checkpoint holds rank 0's, as a single-writer checkpoint does."""
        self._replan(tensors, first)
        out, early = {}, set()
        for p in self._plan[self.index]:
            t = tensors[p.name]
            out[p.key] = t if p.whole else bytes_of(t)[p.start:p.stop]
            if p.name in first:
                early.add(p.key)
        return out, early

    def pieces(self, writer: int) -> list[Piece]:
        """The pieces ``writer`` writes in the current plan (after :meth:`select`)."""
        return list(self._plan[writer])

    def nbytes(self) -> list[int]:
        """Bytes per writer in the current plan."""
        return [sum(p.nbytes for p in mine) for mine in self._plan]


def check_split(m: dict, *, where: str) -> None:
    """Validate a manifest's ``"split"``: every piece exists as a U8 tensor, and the pieces
    tile the split tensor's bytes exactly (``CheckpointError`` otherwise)."""
    split = m.get("split")
    if split is None:
        return
    if not isinstance(split, dict):
        raise CheckpointError(f"{where}: manifest's split is not an object")
    tensors = m["tensors"]
    for name, s in split.items():
        dt, shape = (s.get("dtype"), s.get("shape")) if isinstance(s, dict) else (None, None)
        ps = s.get("pieces") if isinstance(s, dict) else None
        ok = (isinstance(dt, str) and dt in ST_TO_TORCH and isinstance(shape, list) and len(shape) <= 64
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
              and isinstance(ps, list) and ps and name not in tensors)
        pos = 0
        for p in ps if ok else ():
            if not (isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and p[1] == pos
                    and isinstance(p[2], int) and p[2] > pos and tensors.get(p[0], {}).get("dtype") == "U8"
                    and tensors[p[0]].get("nbytes") == p[2] - pos):
                ok = False
                break
            pos = p[2]
        if ok:
            n = ST_TO_TORCH[dt].itemsize
            for d in shape:
                n *= d
            ok = n == pos
        if not ok:
            raise CheckpointError(f"{where}: split tensor {name!r} is malformed (its pieces must be U8 tensors "
                                  f"of the manifest that tile its {dt!r} {shape!r} bytes from 0)")


def join(m: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace the pieces of each split tensor in ``tensors`` by the tensor they make up
    (pieces already checksummed). Tensors whose pieces were not all read are left out."""
    for name, s in (m.get("split") or {}).items():
        keys = [p[0] for p in s["pieces"]]
        if not all(k in tensors for k in keys):
            for k in keys:
                tensors.pop(k, None)
            continue
        buf = torch.cat([tensors.pop(k).reshape(-1) for k in keys])
        tensors[name] = buf.view(ST_TO_TORCH[s["dtype"]]).reshape(s["shape"])
    return tensors


# ---- the protocol --------------------------------------------------------------------------------

class SliceError(RuntimeError):
    """A sliced persist did not commit: a writer failed, died or timed out."""


def global_shards(index: int, layout: list[list[TensorEntry]], writers: int) -> list[tuple[int, list[TensorEntry]]]:
    """``(global shard index, entries)`` of writer ``index``'s shards: its shard ``j`` (root ``j``)
    is shard ``index * R + j`` of ``writers * R``, and the entries name that shard."""
    r = len(layout)
    return [(index * r + j, [dataclasses.replace(e, shard=index * r + j) for e in es]) for j, es in enumerate(layout)]
