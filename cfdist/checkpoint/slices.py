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

**The protocol** (:class:`SliceBackend`, one per writer, on its persist thread):

1. rank 0 (which swept the roots when its Checkpointer started) makes room for the step (a
   stale step directory of that number is moved aside or removed), then publishes
   ``slices/<step>/go`` with a staging tag; only then every writer writes its shard files (one
   per root: striping and slicing together) into the shared staging directory
   ``step-XXXXXXXXX.tmp-<tag>`` of each root (on object stores: the final prefix), and fsyncs them;
2. writers 1..N-1 publish their part of the manifest (``slices/<step>/<w>``: files, roots,
   tensor entries) through the c10d Store, or the error that stopped them;
3. rank 0 writes its own slice, waits (``agree_timeout_s``) for every other part, checks every
   file is in place, and commits once: the manifest, naming each file's writer, is the last
   write, as for one writer (:func:`cfdist.checkpoint.persist.write_checkpoint`);
4. rank 0 publishes the outcome (``slices/<step>/outcome``); the other writers wait for it, so
   ``wait()``/``latest_step`` mean "committed" on every writer.

Every writer must see the same storage roots (rank 0 checks each file is in its staging
directory before committing). A writer that dies mid-write never publishes its part: rank 0's wait times out, nothing is
committed, the previous checkpoint stays, and the staging directory is swept at the next start.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import logging
import time
import uuid
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


class SliceBackend:
    """A writer's persist backend in a sliced checkpoint (see the module docstring).

    Wraps the real backend (thread or process): ``submit`` returns at once; a background
    thread writes this writer's slice through the inner backend, then reports it (writers
    1..N-1) or collects every slice and commits (writer 0). The pending result fails with
    :class:`SliceError` when the step was not committed.
    """

    def __init__(self, inner, channel, *, index: int, writers: int):
        from cfdist.checkpoint.persist import FuturePending

        self.inner, self.ch, self.index, self.writers = inner, channel, index, writers
        self.needs_shared_memory = inner.needs_shared_memory
        self._pending = FuturePending
        self._tag = uuid.uuid4().hex[:8]
        self._outcomes: list[int] = []   # writer 0: outcome keys that every writer read already
        self._ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cfdist-slice")

    def _go(self, job) -> str:
        """The step's staging tag, once rank 0 made room for the step (rank 0: does it)."""
        step = job.step
        if self.index == 0:
            try:
                self.inner.submit(dataclasses.replace(job, shards=[], arenas=[], commit=False)).wait()
            except BaseException as e:
                self._report(step, {"error": f"rank 0 could not prepare step {step}: {type(e).__name__}: {e}"})
                self.ch.set(f"slices/{step}/go", json.dumps({"error": "see outcome"}).encode())
                raise
            self.ch.set(f"slices/{step}/go", json.dumps({"tag": self._tag}).encode())
            return self._tag
        raw, = self.ch.get_all([f"slices/{step}/go"], what=f"rank 0's go for writing step {step}",
                               fix="rank 0 may have died or stalled, or it was built with another writers=")
        go = json.loads(raw)
        if "tag" not in go:
            raise SliceError(f"step {step} is not written: rank 0 could not prepare it")
        return go["tag"]

    def _run(self, job):
        step = job.step
        t0 = time.perf_counter()
        job.staging_tag = self._go(job)
        own = dataclasses.replace(job, commit=False, writer=self.index, clear=False)
        self._t = [t0, time.perf_counter()]
        try:
            mine = self.inner.submit(own).wait()
            self._t.append(time.perf_counter())
        except BaseException as e:
            self._report(step, {"error": f"writer {self.index} failed: {type(e).__name__}: {e}"})
            raise
        if self.index != 0:
            self._report(step, mine.slice)
            raw, = self.ch.get_all([f"slices/{step}/outcome"], what=f"rank 0's commit of step {step}",
                                   fix="rank 0 may have died; the step is not committed, the previous "
                                       "checkpoint stays")
            out = json.loads(raw)
            if "error" in out:
                raise SliceError(f"step {step} was not committed: {out['error']}")
            return mine
        return self._commit(job, mine)

    def _report(self, step: int, part: dict) -> None:
        if self.index != 0:
            self.ch.set(f"slices/{step}/{self.index}", json.dumps(part).encode())
        else:
            self.ch.set(f"slices/{step}/outcome", json.dumps(part).encode())

    def _commit(self, job, mine):
        step = job.step
        others = [f"slices/{step}/{w}" for w in range(1, self.writers)]
        try:
            parts = [json.loads(r) for r in self.ch.get_all(
                others, what=f"the other writers' slices of step {step}",
                fix="a writer rank died or stalled while writing; the step is not committed, the "
                    "previous checkpoint stays (raise agree_timeout_s if the storage is just slow)")]
            bad = [p["error"] for p in parts if "error" in p]
            if bad:
                raise SliceError(f"step {step} is not committed: " + "; ".join(bad))
            final = dataclasses.replace(job, shards=[], arenas=[], commit=True, clear=False,
                                        slices=[mine.slice] + parts)
            self._t.append(time.perf_counter())
            info = self.inner.submit(final).wait()
        except BaseException as e:
            self._report(step, {"error": f"{type(e).__name__}: {e}"})
            raise
        finally:
            self.ch.delete(others + [f"slices/{step}/go"])   # every writer read its go before its slice
        self._report(step, {"ok": True})
        t = self._t + [time.perf_counter()]
        log.debug("step %d committed by %d writers: go %.3fs, own slice %.3fs (%d bytes), others %.3fs, "
                  "commit %.3fs", step, self.writers, t[1] - t[0], t[2] - t[1], mine.bytes, t[3] - t[2], t[4] - t[3])
        for s in self._outcomes:   # every writer read it before writing the step just committed
            self.ch.delete([f"slices/{s}/outcome"])
        self._outcomes = [step]
        return dataclasses.replace(info, bytes=mine.bytes, bytes_logical=mine.bytes_logical)

    def submit(self, job):
        return self._pending(self._ex.submit(self._run, job), job.step)

    def close(self) -> None:
        self._ex.shutdown(wait=True)
        self.inner.close()

