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

A sliced checkpoint (``writers="all"``, :mod:`cfdist.checkpoint.slice_commit`) runs the same
function in parts: step 0 alone (rank 0), step 1 for each writer's slice (``commit=False``: its
entries come back in ``CommitInfo.slice``), then steps 2-4 by rank 0 with every slice's entries
(``slices=``), after checking each file is in place.

**Hung writes.** Every job carries a :class:`CommitGate` that the writer claims right before its
commit point; the persist pipeline (:mod:`cfdist.checkpoint.pipeline`), which owns the job, may
:meth:`CommitGate.abandon` it once ``persist_timeout_s`` ran out, and exactly one of them wins. A
writer that wakes up after it was given up finds the gate taken and raises
:class:`PersistAbandoned` instead of committing (nor does it run retention), so a checkpoint
declared failed can never appear later, nor delete newer ones. The backend then writes the next
job on a fresh thread (or a fresh writer process; the hung one is killed), and the Checkpointer
snapshots into fresh arenas, because the hung writer may still read the old ones: each hung
write pins one set of arenas (the state's size in host memory) until it returns.

Backends decide *where* that function runs. ``ThreadBackend`` (default) runs it on one
background thread of the training process. It was measured against ``ProcessBackend`` (a spawned
writer process reading the arenas from /dev/shm) with ``cfdist bench``: the
hashing (xxhash) and the writes both release the GIL, so the thread costs training no more
than the process does, while the process needs shared-memory arenas, a second interpreter
with torch imported and cannot reach ``memory://``. ``ProcessBackend`` stays available for
stores whose client holds the GIL while uploading.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import glob
import json
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch
import xxhash

from cfdist.checkpoint import codecs, rejected, retention
from cfdist.checkpoint.format import (
    FORMAT, MANIFEST, TMP_MARK, TensorEntry, safetensors_header, seal_manifest, shard_name, step_dir,
)
from cfdist.checkpoint.slices import SliceError
from cfdist.checkpoint.snapshot import attach_arena
from cfdist.storage import Storage, open_storages
from cfdist.storage import direct as direct_io
from cfdist.storage.direct import ALIGN, io_mode, writes_in_flight

log = logging.getLogger("cfdist.persist")

_CHUNK = 16 << 20
_HASH_STEP = 16 << 20
"""Bytes per xxh3 update. xxhash releases the GIL for inputs over 100 KB, so the hashing thread
runs beside the writes (and the training thread) on another core."""


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


def shard_jobs(indexed: list[tuple[int, list[TensorEntry]]], arenas: list, *, count: int, roots: int) -> list[ShardJob]:
    """One :class:`ShardJob` per ``(global shard index, entries)`` of a snapshot, the i-th held
    by ``arenas[i]`` (an arena or a stream: ``nbytes``, ``path``), on root ``i % roots``."""
    return [ShardJob(index=g, count=count, root=i % roots, nbytes=arenas[i].nbytes, entries=es,
                     arena_path=arenas[i].path) for i, (g, es) in enumerate(indexed)]


@dataclass(kw_only=True)
class PersistJob:
    """Everything needed to persist one snapshot. Picklable (a few KB) when arenas are shared."""

    step: int
    manifest: dict
    """Manifest fields known at snapshot time (skeleton, small state, epoch, ...)."""
    shards: list[ShardJob]
    keep: int = 2
    keep_epoch_ends: int | bool = 0
    """How many of the most recent epoch-end checkpoints retention keeps (True: all)."""
    arenas: list[torch.Tensor] | None = field(default=None, repr=False)
    """In-process arenas (uint8 tensors); dropped when pickled."""
    streams: list | None = field(default=None, repr=False)
    """Instead of arenas, under a host-memory budget: one
    :class:`~cfdist.checkpoint.chunks.ShardStream` per shard, whose windows the snapshot is
    still copying while this job writes the first ones; pickled as
    :class:`~cfdist.checkpoint.chunks.RemoteStream` s (a shared pool's)."""
    gate: "CommitGate | None" = None
    """Set by a backend that can give the write up: claimed by the writer before it commits."""
    rolled_back: dict[int, str] | None = None
    """Why restore rolled back past some committed steps (recorded when they are moved aside)."""
    codecs: tuple = ()
    """``cfdist.codecs`` to encode with (empty: the plain format)."""
    codec_session: str | None = None
    """Id of the Checkpointer: chain codecs keep references per storage and session."""
    io: str = "buffered"
    """How shard files are written on local roots (:mod:`cfdist.storage.direct`): ``"auto"``
    (``O_DIRECT`` where the filesystem takes it), ``"direct"`` or ``"buffered"``."""
    io_threads: int = 1
    """Writer threads per shard file for ``O_DIRECT`` writes (the device's queue depth). One
    thread already overlaps the checksums with the writes; more were slower on ext4 over a
    virtio disk (extending writes to one file serialize; ``bench/bench_persist.py --threads``),
    and may help on NVMe."""
    commit: bool = True
    """False (a slice of a sliced checkpoint): write and fsync the shards only, into the shared
    staging directory, and return their manifest entries as ``CommitInfo.slice``; another
    writer commits (:mod:`cfdist.checkpoint.slices`)."""
    slices: list[dict] | None = None
    """Committing a sliced checkpoint: every writer's ``CommitInfo.slice``, already durable in
    the shared staging directory; they make up the manifest's shards and tensors."""
    staging_tag: str | None = None
    """Sliced checkpoints: the staging directory every writer shares, ``<step dir>.tmp-<tag>``."""
    writer: int | None = None
    """Sliced checkpoints: the writer index recorded with each shard in the manifest."""
    clear: bool = True
    """First make room for the step (a committed step directory of the same number is moved
    aside, an uncommitted one removed). Sliced checkpoints do it once, in a job of their own
    (``commit=False``, no shards) before any writer starts: on object stores the slices are
    written under the final prefix, which a later clearing would delete."""

    def __getstate__(self):
        d = dict(self.__dict__)
        d["arenas"] = None
        if self.streams is not None:   # what the writer process reads them through (TypeError: in-process only)
            d["streams"] = [s.handle() for s in self.streams]
        return d

    def close_streams(self, *, hung: bool = False) -> None:
        """The persist ended: every chunk of its streams goes back to the pool (``hung``: a
        writer given up may still read some; those are retired). No-op without streams."""
        for s in self.streams or ():
            s.close(hung=hung)

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
    io: str | None = None
    """How the shards were written: ``"direct"``, ``"buffered"``, ``"plain"`` (no I/O mode
    asked), ``"fsspec"`` (a remote backend), or several joined by ``+`` (roots differed)."""
    slice: dict | None = None
    """A job with ``commit=False``: its shards' and tensors' manifest entries (JSON-able)."""
    reused: int = 0
    """Shard files written over the file of a checkpoint retention deleted (local roots:
    :func:`cfdist.storage.direct.take_reusable`) instead of new ones."""
    committed_at: float | None = None
    """Wall time (``time.time()``) at which the checkpoint became durable and visible: its
    atomic rename (its manifest's PUT on object stores), before the ``LATEST.json`` hint and
    retention. None: nothing was committed (a slice, only the clearing)."""


# ---- who decides a persist's fate: the writer (commit) or the waiter (abandon) ------------------

class PersistAbandoned(RuntimeError):
    """Raised by a writer that reached its commit point after its persist was given up."""


class CommitGate:
    """A persist's one-time decision: its writer commits, or its waiter abandons it; never both.

    The writer calls :meth:`claim` right before its commit point and commits only if it
    returns True; the waiter calls :meth:`abandon` when the persist timed out, and may declare
    it failed only if that returns True. Whichever comes first wins, atomically; both calls
    are idempotent for their own side. ``path=None``: within one process (a lock). With a
    ``path`` (a file that must not exist yet, on a local filesystem both processes see): across
    processes, through an atomic ``link``; the gate pickles. :meth:`close` removes the file.
    """

    COMMIT, ABANDON = "commit", "abandon"

    def __init__(self, path: str | None = None):
        self.path = path
        self._lock = threading.Lock() if path is None else None
        self._owner: str | None = None

    def __getstate__(self):
        if self.path is None:
            raise TypeError("an in-process CommitGate cannot be pickled; give it a path to cross processes")
        return {"path": self.path, "_lock": None, "_owner": None}

    def _take(self, who: str) -> bool:
        if self.path is None:
            with self._lock:
                if self._owner is None:
                    self._owner = who
                return self._owner == who
        tmp = f"{self.path}.{who}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            f.write(who)
        try:
            os.link(tmp, self.path)   # atomic: fails if the other side got there first
            return True
        except FileExistsError:
            with open(self.path) as f:
                return f.read() == who
        finally:
            os.unlink(tmp)

    def claim(self) -> bool:
        """Writer, right before committing: True = go ahead; False = given up, do not commit."""
        return self._take(self.COMMIT)

    def abandon(self) -> bool:
        """Waiter, on timeout: True = the writer can never commit; False = it is committing."""
        return self._take(self.ABANDON)

    def claimed_for_commit(self) -> bool:
        """Whether the writer claimed the gate to commit (it may have died right after)."""
        return self._owner_now() == self.COMMIT

    def abandoned(self) -> bool:
        """Whether the waiter gave up already (a hint for the writer; :meth:`claim` decides)."""
        return self._owner_now() == self.ABANDON

    def _owner_now(self) -> str | None:
        """Who took the gate so far (None: nobody yet)."""
        if self.path is None:
            return self._owner
        try:
            with open(self.path) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def close(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class GateDir:
    """A folder of file gates (:class:`CommitGate`) that a writer in another process on this node
    (a writer process, a node actor) can claim: ``/dev/shm/cfdist-gates-<pid>-*``. Folders left
    by killed processes are removed when the next one is made; :meth:`close` removes this one."""

    def __init__(self):
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        for old in glob.glob(os.path.join(shm, "cfdist-gates-*-*")):
            pid = os.path.basename(old).split("-")[2]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        self.path = tempfile.mkdtemp(prefix=f"cfdist-gates-{os.getpid()}-", dir=shm)

    def new(self, step: int) -> CommitGate:
        return CommitGate(os.path.join(self.path, f"step-{step}-{uuid.uuid4().hex[:8]}"))

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _claim_commit(job: PersistJob) -> None:
    if job.gate is not None and not job.gate.claim():
        raise PersistAbandoned(f"persist of step {job.step} was given up (timed out) before it could "
                               f"commit; not committing it")


def _until_given_up(chunks, check: Callable[[], None]):
    """``chunks``, with ``check()`` (raises once the persist was given up) before each: a write
    given up stops at its next chunk instead of finishing a checkpoint that cannot commit (a
    node actor's next write, a live state that supersedes it, waits for it)."""
    try:
        for c in chunks:
            check()
            yield c
    finally:
        chunks.close()   # its own cleanup (the hashing thread) now, not at garbage collection


def _shard_chunks(header: bytes, arena: np.ndarray | None, entries: list[TensorEntry], sums: dict,
                  buffers: list | None = None):
    """The shard's bytes in chunks: each entry's slice of ``arena``, or its buffer in ``buffers``.

    From an arena whose entries lie back to back from 0 (the plain format), the chunks are
    ``_CHUNK``-sized windows of the arena itself, across tensor boundaries: aligned memory at
    aligned file offsets (after a header padded to :data:`~cfdist.storage.direct.ALIGN`), which
    an ``O_DIRECT`` write sends to the disk without a copy. The tensors' xxh3 are then computed
    on a thread of their own while the windows are written (:class:`_ArenaHasher`): the first
    write does not wait for any hashing, and the last only for what hashing is left; ``sums``
    is filled when the generator ends.
    """
    yield header
    if buffers is None and _back_to_back(entries):
        hasher = _ArenaHasher(arena, entries)
        try:
            end = entries[-1].offset + entries[-1].nbytes
            for w in range(0, end, _CHUNK):
                yield memoryview(arena[w:min(w + _CHUNK, end)])
            sums.update(hasher.result())
        finally:
            hasher.stop()   # the arena must not be read after the persist ends (error or not)
        return
    for k, e in enumerate(entries):
        mv = memoryview(arena[e.offset:e.offset + e.nbytes]) if buffers is None else buffers[k]
        h = xxhash.xxh3_64()
        for i in range(0, e.nbytes, _CHUNK):
            c = mv[i:i + _CHUNK]
            h.update(c)
            yield c
        sums[e.name] = h.hexdigest()


def _stream_chunks(header: bytes, stream, entries: list[TensorEntry], sums: dict, *, lag: int, check):
    """The shard's bytes from a :class:`~cfdist.checkpoint.chunks.ShardStream`: each window as
    soon as the snapshot copied it, hashed on the way (xxh3 releases the GIL). A window's chunk
    goes back to the pool once the consumer asked for ``lag`` + 1 more items (the writes a
    consumer keeps in flight: :func:`cfdist.storage.direct.writes_in_flight`); the caller
    gives back the rest once ``write_file`` returned."""
    yield header
    hashes: dict[str, "xxhash.xxh3_64"] = {}
    k = 0
    for w in range(stream.windows):
        if w - 1 - lag >= 0:
            stream.written(w - 1 - lag)
        mv = stream.get(w, check)
        a, b = stream.window(w)
        while k < len(entries) and entries[k].offset < b:
            e = entries[k]
            lo, hi = max(a, e.offset), min(b, e.offset + e.nbytes)
            h = hashes.setdefault(e.name, xxhash.xxh3_64())
            h.update(mv[lo - a:hi - a])
            if hi < e.offset + e.nbytes:
                break
            sums[e.name] = hashes.pop(e.name).hexdigest()
            k += 1
        yield mv
    for e in entries[k:]:   # empty tensors at the shard's end
        sums[e.name] = hashes.pop(e.name, xxhash.xxh3_64()).hexdigest()


def _stream_frames(stream, entries: list[TensorEntry], session, sums: dict, shard: codecs.EncodedShard, *,
                   check):
    """A framed shard (codecs under a host-memory budget; :mod:`cfdist.checkpoint.format`) from a
    :class:`~cfdist.checkpoint.chunks.ShardStream`: each window encoded as soon as the snapshot
    copied it (:class:`~cfdist.checkpoint.codecs.pipeline.TensorFrames`), every tensor's stored
    bytes hashed on the way; ``shard`` gets each tensor's entry and manifest fields once it
    ended. No header: the encoded sizes are known only once written, and the manifest says
    where everything is.

    Every window's chunk goes back to the pool as soon as it was encoded: what is handed to the
    write is the frames' own memory, and the bytes stored as they are (tensors no codec selects,
    frames a codec left alone) are copied out of the chunk. The items written vary in size, so
    an ``O_DIRECT`` write may still read an item many items back (it copies small ones through
    its bounce buffer and sends large aligned ones from their own memory): only a copy is safe
    to hand over. The memory in flight is then those writes' frames, which the budget sets
    aside (:func:`~cfdist.checkpoint.chunks.codec_chunks`)."""
    pos = 0
    cur = None   # (entry, TensorFrames or None, hasher, start) of the tensor being written
    k = 0

    def finish(e, frames, h, start) -> None:
        if frames is None:
            shard.entries.append(TensorEntry(e.name, e.shard, e.dtype, e.shape, start, pos - start))
        else:
            shard.entries.append(TensorEntry(e.name, e.shard, torch.uint8, (pos - start,), start, pos - start))
            shard.extra[e.name] = frames.extra()
        sums[e.name] = h.hexdigest()

    for w in range(stream.windows):
        check()   # a persist given up stops encoding at its next window
        mv = stream.get(w, check)
        a, b = stream.window(w)
        chunk = np.frombuffer(mv, dtype=np.uint8)
        outs: list[memoryview] = []
        while k < len(entries) and entries[k].offset < b:
            e = entries[k]
            if cur is None:   # the tensor starts here
                frames = codecs.TensorFrames(session, e)
                frames = frames if frames.encoded else None
                if frames is None and pos % 8:   # as stored, at its dtype's alignment
                    pad = 8 - pos % 8
                    outs.append(memoryview(bytes(pad)))
                    pos += pad
                cur = (e, frames, xxhash.xxh3_64(), pos)
            e, frames, h, start = cur
            lo, hi = max(a, e.offset), min(b, e.offset + e.nbytes)
            piece = chunk[lo - a:hi - a]
            for buf, view in ([(piece, True)] if frames is None else frames.encode(lo - e.offset, piece)):
                if not len(buf):
                    continue
                buf = memoryview(np.array(buf, copy=True) if view else buf)   # see above
                h.update(buf)
                pos += len(buf)
                outs.append(buf)
            if hi < e.offset + e.nbytes:
                break   # continues in the next window
            finish(e, frames, h, start)
            cur, k = None, k + 1
        stream.written(w)   # nothing handed to the write points into it
        yield from outs
    for e in entries[k:]:   # empty tensors at the shard's end
        finish(e, None, xxhash.xxh3_64(), pos)


def _back_to_back(entries: list[TensorEntry]) -> bool:
    off = 0
    for e in entries:
        if e.offset != off:
            return False
        off += e.nbytes
    return bool(entries)


class _ArenaHasher:
    """xxh3-64 of each entry of ``arena``, computed on a background thread from construction.

    :meth:`result` waits for it (and re-raises its error); :meth:`stop` asks it to quit early
    and waits until it no longer reads the arena. Measured (``bench/bench_persist.py``): hashing
    inline before each window's write cost 0.19-0.37 s for 200 MB where the writes alone took
    0.14 s; on a thread of its own the hashing hides behind the writes.
    """

    def __init__(self, arena: np.ndarray, entries: list[TensorEntry]):
        self._arena, self._entries = arena, entries
        self._sums: dict[str, str] = {}
        self._error: BaseException | None = None
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cfdist-xxh3", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for e in self._entries:
                h = xxhash.xxh3_64()
                for i in range(e.offset, e.offset + e.nbytes, _HASH_STEP):
                    if self._quit.is_set():
                        return
                    h.update(memoryview(self._arena[i:min(i + _HASH_STEP, e.offset + e.nbytes)]))
                self._sums[e.name] = h.hexdigest()
        except BaseException as e:  # noqa: BLE001 - re-raised by result() in the writer's thread
            self._error = e

    def result(self) -> dict[str, str]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._sums

    def stop(self) -> None:
        self._quit.set()
        self._thread.join()


def _write_hint(storage: Storage, step: int) -> None:
    """Record the step just committed for discovery behind a lagging listing (best effort)."""
    from cfdist.checkpoint.reader import LATEST_HINT

    try:
        storage.write_atomic(LATEST_HINT, json.dumps({"step": step}).encode())
    except OSError as e:
        log.warning("could not write %s in %s after committing step %d: %s (only a hint)",
                    LATEST_HINT, storage.url, step, e)


def write_checkpoint(storages: list[Storage], job: PersistJob) -> CommitInfo:
    """Persist ``job`` striped over ``storages`` (root 0 holds the manifest) and commit it.

    Blocking; call it from a background thread or process. Raises on any storage error, in
    which case nothing was committed (leftovers are swept at the next start).
    """
    t0 = time.perf_counter()
    final = step_dir(job.step)
    if job.gate is not None and job.gate.abandoned():
        raise PersistAbandoned(f"persist of step {job.step} was given up before it started")
    # Left by a run that rolled back past this step: it would block the publish, and on object
    # stores new shards would land under its manifest. Moved aside, never deleted.
    if job.clear:
        rejected.clear_for_commit(storages, job.step, why=(job.rolled_back or {}).get(
            job.step, f"a new checkpoint of step {job.step} replaced it (the run rolled back past it)"))
    if not (job.commit or job.shards):   # only the clearing
        return CommitInfo(step=job.step, url=storages[0].url_of(final), bytes=0, seconds=time.perf_counter() - t0)
    arenas = job.arenas if job.streams is None else job.streams
    if arenas is None:
        arenas = [attach_arena(s.arena_path, s.nbytes) for s in job.shards]
    arenas = {s.index: a for s, a in zip(job.shards, arenas)}

    def check() -> None:   # before each chunk (and a streamed write's wait for the next window)
        if job.gate is not None and job.gate.abandoned():
            raise PersistAbandoned(f"persist of step {job.step} was given up while it was written")
    parts = job.slices or []
    staging = {r: (f"{final}{TMP_MARK}{job.staging_tag}" if job.staging_tag and storages[r].atomic_rename
                   else storages[r].staging_dir(final))
               for r in {s.root for s in job.shards} | {0} | {sh["root"] for p in parts for sh in p["shards"]}}
    sums: dict[str, str] = {}
    enc = codecs.begin(storages, job.step, job.codecs, job.codec_session)
    written: dict[int, codecs.EncodedShard] = {}
    modes: dict[int, str] = {}
    reused: list[int] = []   # shards written over a deleted checkpoint's file (list.append: thread-safe)

    def write_root(r: int) -> int:
        n = 0
        local = storages[r].is_local
        for s in job.shards:
            if s.root != r:
                continue
            stream = arenas[s.index] if job.streams is not None else None
            framed = stream is not None and enc is not None
            if framed:   # codecs under a budget: encoded window by window, entries known once written
                sh = written[s.index] = codecs.EncodedShard([], [], {})
            elif stream is not None:   # no codecs under a budget: the entries as they are
                sh = written[s.index] = codecs.EncodedShard(s.entries, [], {})
            else:
                arena = arenas[s.index].numpy()
                sh = written[s.index] = codecs.encode_shard(enc, s.entries, arena)
            # data at a page boundary on local roots: O_DIRECT needs it, and a buffered write
            # over a reused file then replaces whole pages (no read of the old ones first)
            hdr = None if framed else safetensors_header(sh.entries, {"format": "pt", "step": str(job.step)},
                                                         align=ALIGN if local else 8)
            if framed:
                chunks = _stream_frames(stream, s.entries, enc, sums, sh, check=check)
            elif stream is not None:
                chunks = _stream_chunks(hdr, stream, sh.entries, sums, lag=writes_in_flight(job.io_threads),
                                        check=check)
            elif enc is None:
                chunks = _until_given_up(_shard_chunks(hdr, arena, sh.entries, sums), check)
            else:
                chunks = _until_given_up(_shard_chunks(hdr, None, sh.entries, sums, sh.buffers), check)
            try:
                with io_mode(job.io, threads=job.io_threads, reuse=True):
                    n += storages[r].write_file(f"{staging[r]}/{shard_name(s.index, s.count, framed=framed)}",
                                                chunks)
            finally:
                if stream is not None:   # every write of it ended: no chunk is read any more
                    stream.release_taken()
            modes[r] = getattr(direct_io.last_mode, "value", None) if local else "fsspec"
            if local and getattr(direct_io.last_mode, "reused", False):
                reused.append(s.index)
        storages[r].fsync_dir(staging[r])
        return n

    roots = sorted({s.root for s in job.shards} | {0})
    if len(roots) == 1:
        total = write_root(roots[0])
    else:
        with cf.ThreadPoolExecutor(len(roots), thread_name_prefix="cfdist-stripe") as ex:
            total = sum(ex.map(write_root, roots))
    framed = job.streams is not None and enc is not None
    shards = [{"file": shard_name(s.index, s.count, framed=framed), "root": s.root, "bytes": written[s.index].nbytes,
               **({"writer": job.writer} if job.writer is not None else {})} for s in job.shards]
    tensors = {e.name: {**e.to_json(sums[e.name]), **written[s.index].extra.get(e.name, {})}
               for s in job.shards for e in written[s.index].entries}
    nbytes = job.nbytes
    if not job.commit:
        return CommitInfo(step=job.step, url=storages[0].url_of(final), bytes=total,
                          seconds=time.perf_counter() - t0, bytes_logical=nbytes, reused=len(reused),
                          slice={"shards": [dict(sh, index=s.index) for sh, s in zip(shards, job.shards)],
                                 "tensors": tensors, "nbytes": nbytes, "written": total})
    if parts:
        shards, tensors, nbytes, total = _join_slices(storages, staging, parts, job.step)
    for r in sorted(staging):
        if r != 0:
            storages[r].publish(staging[r], final)
    manifest = dict(job.manifest)
    manifest.update(
        format=FORMAT, step=job.step, time=time.time(), bytes=nbytes, roots=len(storages),
        shards=shards, tensors=tensors,
    )
    if enc is not None:
        manifest.update(enc.manifest_fields())
    if storages[0].atomic_rename:
        storages[0].write_file(f"{staging[0]}/{MANIFEST}", [seal_manifest(manifest)])
        storages[0].fsync_dir(staging[0])
        _claim_commit(job)
        storages[0].publish(staging[0], final)  # == COMMIT
    else:
        _claim_commit(job)
        storages[0].write_file(f"{staging[0]}/{MANIFEST}", [seal_manifest(manifest)])  # == COMMIT
    committed_at = time.time()
    if enc is not None:
        enc.commit()   # chain codecs' references now point at this checkpoint
    seconds = time.perf_counter() - t0
    _write_hint(storages[0], job.step)
    deleted = retention.apply(storages, keep=job.keep, keep_epoch_ends=job.keep_epoch_ends,
                              newest=job.step, newest_epoch_end=bool(job.manifest.get("epoch_end")),
                              reasons=job.rolled_back)
    log.debug("committed step %d to %s: %d bytes in %.3fs", job.step, storages[0].url, total, seconds)
    return CommitInfo(step=job.step, url=storages[0].url_of(final), bytes=total, seconds=seconds,
                      deleted=tuple(deleted), bytes_logical=nbytes, reused=len(reused),
                      io="+".join(sorted({m for m in modes.values() if m})) or None, committed_at=committed_at)


def _join_slices(storages: list[Storage], staging: dict[int, str], parts: list[dict], step: int):
    """The manifest's shards and tensors from every writer's slice, once each file is in place."""
    shards = sorted((sh for p in parts for sh in p["shards"]), key=lambda sh: sh["index"])
    if [sh["index"] for sh in shards] != list(range(len(shards))):
        raise SliceError(f"the slices of step {step} do not make up a checkpoint: shards "
                           f"{[sh['index'] for sh in shards]} (a writer used another writers= or roots)")
    for sh in shards:
        if not storages[sh["root"]].exists(f"{staging[sh['root']]}/{sh['file']}"):
            raise SliceError(f"{storages[sh['root']].url_of(staging[sh['root']])}/{sh['file']}, written by "
                               f"writer {sh.get('writer')} for step {step}, is gone (swept by a restart?); "
                               f"not committing")
    tensors = {k: v for p in parts for k, v in p["tensors"].items()}
    return ([{k: v for k, v in sh.items() if k != "index"} for sh in shards], tensors,
            sum(p["nbytes"] for p in parts), sum(p["written"] for p in parts))


# ---- backends ----------------------------------------------------------------------------------

class Pending(Protocol):
    """A backend's handle on one write."""

    step: int

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> CommitInfo:
        """The CommitInfo, or the write's error; ``TimeoutError`` if still running after ``timeout``."""

    def abandon(self) -> bool:
        """The write was given up (its gate is taken): let the next job run on a fresh writer.
        Idempotent."""


class PersistTimeout(TimeoutError):
    """A persist did not finish within ``persist_timeout_s`` and was declared failed."""


class FuturePending:
    """A pending persist: ``wait()`` returns its CommitInfo or re-raises its error.

    ``wait(timeout)`` raises ``TimeoutError`` when the persist is still running after
    ``timeout`` seconds. With a ``gate`` the persist can be given up (:meth:`abandon`);
    ``on_abandon`` then lets the backend move the next job to a fresh writer.
    """

    def __init__(self, fut: cf.Future, step: int, gate: CommitGate | None = None, on_abandon=None):
        self._fut = fut
        self.step = step
        self._gate = gate
        self._on_abandon = on_abandon
        self._abandoned = False
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._fut.done()

    def wait(self, timeout: float | None = None) -> CommitInfo:
        return self._fut.result(timeout)

    def abandon(self) -> bool:
        """Give the persist up: True when its writer can no longer commit (it was not
        committing yet); False when it already passed its commit point (wait for it), or when
        this backend cannot give writes up."""
        if self._gate is None or not self._gate.abandon():
            return False
        # The waiter and the pipeline may both give it up: the backend is told once, and neither
        # returns before it reacted (a fresh writer in place). Otherwise the pipeline, returning
        # first, hands its next job to the writer being replaced, which then dies with it.
        with self._lock:
            first, self._abandoned = not self._abandoned, True
            if first and self._on_abandon is not None:
                self._on_abandon(self)
        return True


def _run_into(fut: cf.Future, fn, *args) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to the waiter, which re-raises it
        fut.set_exception(e)


class PersistBackend(Protocol):
    """Where :func:`write_checkpoint` runs, for the persist pipeline
    (:mod:`cfdist.checkpoint.pipeline`). ``submit`` must not block on the write itself."""

    needs_shared_memory: bool

    def new_gate(self, step: int) -> CommitGate:
        """A gate the writer of this backend can claim (in its own process)."""

    def ready_at(self) -> float | None:
        """``time.monotonic()`` since which its writer is ready (None: still starting); a
        persist's timeout counts from then at the earliest."""

    def submit(self, job: PersistJob) -> Pending:
        """Start writing ``job``; its writer claims ``job.gate`` right before committing."""

    def close(self) -> None: ...


_LIVE_THREAD_BACKENDS: "weakref.WeakSet[ThreadBackend]" = weakref.WeakSet()


@atexit.register
def _drain_thread_backends() -> None:
    # Writer threads are daemons (a hung one must not block exit), so at exit wait for the
    # writes still wanted, as a pool's non-daemon thread would have been waited for.
    for b in list(_LIVE_THREAD_BACKENDS):
        b.close()


class ThreadBackend:
    """Persist on a background thread of this process (the default).

    One job at a time in practice (the Checkpointer waits for a persist before submitting the
    next); each job gets its own daemon thread, so a write given up as hung never delays the
    next one. ``close()`` (and interpreter exit) wait for the jobs not given up.
    """

    needs_shared_memory = False
    streams = True
    """Writes snapshots streamed through a host-memory budget (:mod:`cfdist.checkpoint.chunks`)."""
    streams_codecs = True
    """... and encodes them with codecs as they stream (framed shards)."""

    def __init__(self, storages: list[Storage]):
        self.storages = storages
        self._live: set[cf.Future] = set()
        self._lock = threading.Lock()
        _LIVE_THREAD_BACKENDS.add(self)

    def new_gate(self, step: int) -> CommitGate:
        return CommitGate()

    def ready_at(self) -> float | None:
        return 0.0   # a thread is ready at once

    def submit(self, job: PersistJob) -> Pending:
        if job.gate is None:
            job.gate = self.new_gate(job.step)
        fut: cf.Future = cf.Future()
        with self._lock:
            self._live.add(fut)
        fut.add_done_callback(self._forget)
        threading.Thread(target=_run_into, args=(fut, write_checkpoint, self.storages, job),
                         name=f"cfdist-persist-{job.step}", daemon=True).start()
        return FuturePending(fut, job.step, job.gate, on_abandon=lambda p: self._forget(p._fut))

    def _forget(self, fut: cf.Future) -> None:
        with self._lock:
            self._live.discard(fut)

    def close(self) -> None:
        with self._lock:
            live = list(self._live)
        cf.wait(live)
        _LIVE_THREAD_BACKENDS.discard(self)


def _child_write(urls: list[str], options: dict, job: PersistJob) -> CommitInfo:
    return write_checkpoint(_child_storages(tuple(urls), json.dumps(options, sort_keys=True)), job)


_CHILD_CACHE: dict = {}


def _child_storages(urls: tuple, options_json: str) -> list[Storage]:
    key = (urls, options_json)
    if key not in _CHILD_CACHE:
        _CHILD_CACHE[key] = open_storages(list(urls), **json.loads(options_json))
    return _CHILD_CACHE[key]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (someone else's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ready() -> None:
    """A writer process's first job: nothing (importing this module is the warm-up)."""


def _die_with_parent(parent: int) -> None:
    """In a writer process: be SIGKILLed when the training process dies (Linux).

    Otherwise a writer orphaned by a killed training process would finish its write and could
    commit it after a new training process started and swept (a late, unexpected commit). The
    pool spawns its process from the thread that submits (the training or snapshot thread, both
    alive as long as the Checkpointer), as the signal follows the thread that spawned.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    if os.getppid() != parent:   # it died before the prctl
        os._exit(1)


class ProcessBackend:
    """Persist in a spawned writer process that maps the arenas from /dev/shm.

    A writer process that died (killed, out of memory) fails the persist it was running with
    ``BrokenProcessPool`` (unless it died right after committing: then the persist is
    committed); the next job gets a new writer process. A write given up as hung
    has its writer process killed, and the next job a new one.
    """

    needs_shared_memory = True
    streams = True
    """Reads snapshots streamed through a host-memory budget from a shared chunk pool."""
    streams_codecs = True
    """... and encodes them with codecs as they stream (framed shards)."""

    def __init__(self, storages: list[Storage], storage_options: dict | None = None):
        for s in storages:
            if s.protocol == "memory":
                raise ValueError(f"the process backend cannot write to {s.url}: memory:// lives in "
                                 f"this process only; use backend='thread'")
        self.urls = [s.url for s in storages]
        self.options = dict(storage_options or {})
        self._gates = GateDir()
        self.new_gate = self._gates.new
        self._ex = self._new_pool()
        self.restarts = 0
        """Writer processes replaced (died, or killed after a hung write)."""

    def _new_pool(self) -> cf.ProcessPoolExecutor:
        pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"),
                                      initializer=_die_with_parent, initargs=(os.getpid(),))
        # Start the writer now (seconds: it imports torch); a persist's timeout counts from then.
        self._started = started = pool.submit(_ready)
        self._ready_at: float | None = None

        def ready(f: cf.Future) -> None:
            if self._started is started:   # not a pool replaced since
                self._ready_at = time.monotonic()

        started.add_done_callback(ready)
        return pool

    def ready_at(self) -> float | None:
        """``time.monotonic()`` since which the current writer process runs (None: starting;
        it imports torch, seconds): a persist's timeout does not count the start."""
        return self._ready_at

    def _replace_pool(self, kill: bool) -> None:
        old, self._ex = self._ex, self._new_pool()
        self.restarts += 1
        if kill:
            for p in list((getattr(old, "_processes", None) or {}).values()):
                p.kill()
        old.shutdown(wait=False, cancel_futures=True)

    def submit(self, job: PersistJob) -> Pending:
        if job.gate is None:
            job.gate = self.new_gate(job.step)
        try:
            fut = self._ex.submit(_child_write, self.urls, self.options, job)
        except cf.process.BrokenProcessPool:
            log.warning("the persist writer process died; starting a new one for step %d", job.step)
            self._replace_pool(kill=False)
            fut = self._ex.submit(_child_write, self.urls, self.options, job)
        return FuturePending(self._settled(fut, job), job.step, job.gate, on_abandon=self._on_abandon)

    def _on_abandon(self, pending: FuturePending) -> None:
        """A write given up: kill its writer process and start a fresh one -- unless the writer
        is still starting. Then it has not begun the job (it will find the gate taken and skip
        it), and killing it would only make the next job wait for yet another start."""
        if self._ready_at is not None:
            self._replace_pool(kill=True)

    def _settled(self, fut: cf.Future, job: PersistJob) -> cf.Future:
        """``fut``, except that a writer process that died *after* committing its step (it
        claimed the gate for the commit, and the manifest is in place) is a commit, not a failure:
        the step is there, and reporting it failed would tell the user the previous checkpoint
        is the newest. Its retention did not run; the next commit's does."""
        out: cf.Future = cf.Future()
        t0 = time.monotonic()

        def done(f: cf.Future) -> None:
            if f.cancelled():
                out.cancel()
                return
            e = f.exception()
            if isinstance(e, BrokenProcessPool):
                try:
                    info = self._committed_anyway(job, time.monotonic() - t0)
                except Exception as e2:  # noqa: BLE001 - the writer's death stays the error; this is logged
                    log.warning("could not check whether step %d committed before its writer died: %s",
                                job.step, e2)
                    info = None
                if info is not None:
                    out.set_running_or_notify_cancel()
                    out.set_result(info)
                    return
            out.set_running_or_notify_cancel()
            if e is not None:
                out.set_exception(e)
            else:
                out.set_result(f.result())

        fut.add_done_callback(done)
        return out

    def _committed_anyway(self, job: PersistJob, seconds: float) -> CommitInfo | None:
        from cfdist.checkpoint.reader import is_committed, read_manifest

        if job.gate is None or not job.gate.claimed_for_commit():
            return None
        sts = _child_storages(tuple(self.urls), json.dumps(self.options, sort_keys=True))
        if not is_committed(sts[0], job.step):
            return None
        m = read_manifest(sts, job.step)
        log.warning("the persist writer process died right after committing step %d to %s: the step is "
                    "committed (its retention runs with the next commit)", job.step, sts[0].url)
        return CommitInfo(step=job.step, url=sts[0].url_of(step_dir(job.step)), bytes=int(m.get("bytes", 0)),
                          seconds=seconds)

    def writer_pids(self) -> list[int]:
        """Pids of the live writer processes (for tests that kill them)."""
        return [p.pid for p in (getattr(self._ex, "_processes", None) or {}).values() if p.is_alive()]

    def close(self) -> None:
        try:
            self._ex.shutdown(wait=True)
        finally:
            self._gates.close()
