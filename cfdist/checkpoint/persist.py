"""Phase 2: write a snapshot to storage, checksum it, fsync it, commit it atomically.

:func:`write_checkpoint` is the whole protocol and runs in any process (the training process's
writer thread, a writer subprocess, a Ray node actor):

0. a committed step directory of the same number, left by a run that rolled back past it, is
   moved aside to ``rejected/`` (never deleted; an uncommitted leftover is removed);
1. every shard is streamed from its arena into ``<staging>/shard-i-of-n.safetensors`` on its
   root (roots in parallel), computing each tensor's xxh3-64 on the way; files are fsynced;
2. the secondary roots' step directories are published (a rename locally);
3. ``MANIFEST.json`` is written into root 0's staging directory and fsynced, and that directory
   is published: **this is the commit**. On object stores there is no rename: the manifest
   PUT, written last, is the commit marker;
4. only then retention deletes older checkpoints of the same lineage (never the one just
   committed) and moves the ones it does not descend from aside.

A crash at any instant leaves the previous committed checkpoint untouched and loadable.

Backends decide *where* that function runs. ``ThreadBackend`` (default) runs it on one
background thread of the training process. It was measured against ``ProcessBackend`` (a spawned
writer process reading the arenas from /dev/shm) with ``cfdist bench``: the
hashing (xxhash) and the writes both release the GIL, so the thread costs training no more
than the process does, while the process needs shared-memory arenas, a second interpreter
with torch imported and cannot reach ``memory://``. ``ProcessBackend`` stays available for
stores whose client holds the GIL while uploading.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import xxhash

from cfdist.checkpoint import codecs, rejected, retention
from cfdist.checkpoint.format import (
    FORMAT, MANIFEST, TensorEntry, safetensors_header, seal_manifest, shard_name, step_dir,
)
from cfdist.checkpoint.snapshot import attach_arena
from cfdist.storage import Storage, open_storages

log = logging.getLogger("cfdist.persist")

_CHUNK = 16 << 20


@dataclass(kw_only=True)
class ShardJob:
    """One shard: which root it goes to, which arena holds its bytes, what tensors are in it."""

    index: int
    count: int
    root: int
    nbytes: int
    entries: list[TensorEntry]
    arena_path: str | None = None
    """/dev/shm path of the arena when another process must read it; None in-process."""


@dataclass(kw_only=True)
class PersistJob:
    """Everything needed to persist one snapshot. Picklable (a few KB) when arenas are shared."""

    step: int
    manifest: dict
    """Manifest fields known at snapshot time (skeleton, small state, epoch, ...)."""
    shards: list[ShardJob]
    keep: int = 1
    keep_epoch_ends: bool = True
    arenas: list[torch.Tensor] | None = field(default=None, repr=False)
    """In-process arenas (uint8 tensors); dropped when pickled."""
    rolled_back: dict[int, str] | None = None
    """Why restore rolled back past some committed steps (recorded when they are moved aside)."""
    codecs: tuple = ()
    """``cfdist.codecs`` to encode with (empty: the plain format)."""
    codec_session: str | None = None
    """Id of the Checkpointer: chain codecs keep references per storage and session."""

    def __getstate__(self):
        d = dict(self.__dict__)
        d["arenas"] = None
        return d

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


@dataclass(frozen=True, kw_only=True)
class CommitInfo:
    step: int
    url: str
    bytes: int
    seconds: float
    deleted: tuple[int, ...] = ()
    bytes_logical: int | None = None
    """Bytes of the tensors before codecs (``bytes`` is what the shard files hold)."""


def _shard_chunks(header: bytes, arena: np.ndarray | None, entries: list[TensorEntry], sums: dict,
                  buffers: list | None = None):
    """The shard's bytes in chunks: each entry's slice of ``arena``, or its buffer in ``buffers``."""
    yield header
    for k, e in enumerate(entries):
        mv = memoryview(arena[e.offset:e.offset + e.nbytes]) if buffers is None else buffers[k]
        h = xxhash.xxh3_64()
        for i in range(0, e.nbytes, _CHUNK):
            c = mv[i:i + _CHUNK]
            h.update(c)
            yield c
        sums[e.name] = h.hexdigest()


def write_checkpoint(storages: list[Storage], job: PersistJob) -> CommitInfo:
    """Persist ``job`` striped over ``storages`` (root 0 holds the manifest) and commit it.

    Blocking; call it from a background thread or process. Raises on any storage error, in
    which case nothing was committed (leftovers are swept at the next start).
    """
    t0 = time.perf_counter()
    final = step_dir(job.step)
    # Left by a run that rolled back past this step: it would block the publish, and on object
    # stores new shards would land under its manifest. Moved aside, never deleted.
    rejected.clear_for_commit(storages, job.step, why=(job.rolled_back or {}).get(
        job.step, f"a new checkpoint of step {job.step} replaced it (the run rolled back past it)"))
    arenas = job.arenas
    if arenas is None:
        arenas = [attach_arena(s.arena_path, s.nbytes) for s in job.shards]
    staging = {r: storages[r].staging_dir(final) for r in {s.root for s in job.shards} | {0}}
    sums: dict[str, str] = {}
    enc = codecs.begin(storages, job.step, job.codecs, job.codec_session)
    written: dict[int, codecs.EncodedShard] = {}

    def write_root(r: int) -> int:
        n = 0
        for s in job.shards:
            if s.root != r:
                continue
            sh = written[s.index] = codecs.encode_shard(enc, s.entries, arenas[s.index].numpy())
            hdr = safetensors_header(sh.entries, {"format": "pt", "step": str(job.step)})
            n += storages[r].write_file(f"{staging[r]}/{shard_name(s.index, s.count)}",
                                        _shard_chunks(hdr, None, sh.entries, sums, sh.buffers))
        storages[r].fsync_dir(staging[r])
        return n

    roots = sorted(staging)
    if len(roots) == 1:
        total = write_root(roots[0])
    else:
        with cf.ThreadPoolExecutor(len(roots), thread_name_prefix="cfdist-stripe") as ex:
            total = sum(ex.map(write_root, roots))
    for r in roots:
        if r != 0:
            storages[r].publish(staging[r], final)
    manifest = dict(job.manifest)
    manifest.update(
        format=FORMAT, step=job.step, time=time.time(), bytes=job.nbytes, roots=len(storages),
        shards=[{"file": shard_name(s.index, s.count), "root": s.root, "bytes": written[s.index].nbytes}
                for s in job.shards],
        tensors={e.name: {**e.to_json(sums[e.name]), **written[s.index].extra.get(e.name, {})}
                 for s in job.shards for e in written[s.index].entries},
    )
    if enc is not None:
        manifest.update(enc.manifest_fields())
    storages[0].write_file(f"{staging[0]}/{MANIFEST}", [seal_manifest(manifest)])
    storages[0].fsync_dir(staging[0])
    storages[0].publish(staging[0], final)  # == COMMIT
    if enc is not None:
        enc.commit()   # chain codecs' references now point at this checkpoint
    seconds = time.perf_counter() - t0
    deleted = retention.apply(storages, keep=job.keep, keep_epoch_ends=job.keep_epoch_ends,
                              newest=job.step, newest_epoch_end=bool(job.manifest.get("epoch_end")),
                              reasons=job.rolled_back)
    log.debug("committed step %d to %s: %d bytes in %.3fs", job.step, storages[0].url, total, seconds)
    return CommitInfo(step=job.step, url=storages[0].url_of(final), bytes=total, seconds=seconds,
                      deleted=tuple(deleted), bytes_logical=job.nbytes)


# ---- backends ----------------------------------------------------------------------------------

class Pending(Protocol):
    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> CommitInfo: ...


class FuturePending:
    """A pending persist: ``wait()`` returns its CommitInfo or re-raises its error."""

    def __init__(self, fut: cf.Future, step: int):
        self._fut = fut
        self.step = step

    def done(self) -> bool:
        return self._fut.done()

    def wait(self, timeout: float | None = None) -> CommitInfo:
        return self._fut.result(timeout)


class PersistBackend(Protocol):
    """Where :func:`write_checkpoint` runs. ``submit`` must not block on the write itself."""

    needs_shared_memory: bool

    def submit(self, job: PersistJob) -> Pending: ...

    def close(self) -> None: ...


class ThreadBackend:
    """Persist on one background thread of this process (the default)."""

    needs_shared_memory = False

    def __init__(self, storages: list[Storage]):
        self.storages = storages
        self._ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cfdist-persist")

    def submit(self, job: PersistJob) -> Pending:
        return FuturePending(self._ex.submit(write_checkpoint, self.storages, job), job.step)

    def close(self) -> None:
        self._ex.shutdown(wait=True)


def _child_write(urls: list[str], options: dict, job: PersistJob) -> CommitInfo:
    return write_checkpoint(_child_storages(tuple(urls), json.dumps(options, sort_keys=True)), job)


_CHILD_CACHE: dict = {}


def _child_storages(urls: tuple, options_json: str) -> list[Storage]:
    key = (urls, options_json)
    if key not in _CHILD_CACHE:
        _CHILD_CACHE[key] = open_storages(list(urls), **json.loads(options_json))
    return _CHILD_CACHE[key]


class ProcessBackend:
    """Persist in a spawned writer process that maps the arenas from /dev/shm."""

    needs_shared_memory = True

    def __init__(self, storages: list[Storage], storage_options: dict | None = None):
        for s in storages:
            if s.protocol == "memory":
                raise ValueError(f"the process backend cannot write to {s.url}: memory:// lives in "
                                 f"this process only; use backend='thread'")
        self.urls = [s.url for s in storages]
        self.options = dict(storage_options or {})
        self._ex = cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))

    def submit(self, job: PersistJob) -> Pending:
        return FuturePending(self._ex.submit(_child_write, self.urls, self.options, job), job.step)

    def close(self) -> None:
        self._ex.shutdown(wait=True)
