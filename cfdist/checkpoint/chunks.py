"""A host-memory budget for snapshots: a bounded pool of chunks, each shard streamed through it.

``Checkpointer(host_memory=B)`` gives a snapshot no full host copy of the state. Each shard's
data section (the arena layout of :mod:`~cfdist.checkpoint.snapshot`: the bytes exactly as the
shard file holds them) is cut into *windows* of :attr:`ChunkPool.chunk_bytes`. The snapshot's
copy thread copies window after window into free chunks of one :class:`ChunkPool` (``B`` bytes
in all) and hands each to its shard's :class:`ShardStream`; the persist writes a shard's windows
in order and gives each chunk back as soon as its write completed (the storage layer's
``on_written``), so the copy of the later windows runs while the earlier ones are written
(PCcheck, ASPLOS'25, pipelines GPU -> host -> SSD the same way).

Consistency is the gate's, unchanged: the next optimizer update waits until *every* window was
copied (:meth:`Snapshotter.wait_copied`), so no tensor is updated before its bytes are in a
chunk or on storage. With a budget ``B`` below the state's size ``S`` the copy can finish only
once ``S - B`` bytes reached storage: the stall's floor is ``(S - B) / write bandwidth``.

Who gives a chunk back, on every path:

- the writer, once the window's write completed (:meth:`ShardStream.written`);
- the persist's owner, when the persist ended for any reason (:meth:`ShardStream.close`: an
  error, a timeout, a job that never reached a writer); chunks a writer that was given up may
  still read are *retired* (never reused; the pool allocates fresh ones, so memory can exceed
  the budget by what a hung writer holds, as the full arenas' retirement does without a budget);
- the copy thread, for a window of a stream already closed (nothing will read it).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid

import numpy as np
import torch

from cfdist.storage.direct import ALIGN, writes_in_flight

log = logging.getLogger("cfdist.snapshot")

CHUNK_MAX = 16 << 20
"""Largest chunk: 16 MiB writes reach the disk's bandwidth (``bench/bench_persist.py``)."""
MIN_CHUNKS = 4
"""Chunks the budget is cut into at least: one being copied, one being hashed and written, and
room for the ``O_DIRECT`` writes in flight."""


def min_chunks(roots: int = 1, io_threads: int = 1) -> int:
    """Chunks a pool needs so that streaming cannot stall for good: each root's writer may hold
    the windows its writes in flight still read (:func:`~cfdist.storage.direct.writes_in_flight`)
    while it waits for the next one, and the copy needs one more."""
    return max(MIN_CHUNKS, roots * writes_in_flight(io_threads) + 1)


CODEC_MIN_CHUNK = 64 << 10
"""Smallest chunk when codecs encode a snapshot chunk by chunk: every chunk's part of a tensor
is a frame of its own (a record in the manifest, a call into each codec), so pages would
make the manifest larger than a small state and the encoding slower than the write."""


def codec_chunks(work: float, roots: int = 1, io_threads: int = 1) -> float:
    """Chunks' worth of host memory each root's writer holds beside the pool while codecs
    encode the snapshot (``work``: :func:`cfdist.checkpoint.codecs.pipeline.encode_work`, 0
    without codecs): the encoded frames its writes in flight still read, the window's frames
    being handed to the write, and the codecs' temporaries."""
    return roots * (writes_in_flight(io_threads) + 1 + work) if work else 0.0


def minimum_budget(roots: int = 1, work: float = 0.0) -> int:
    """The smallest ``host_memory`` that can work: :func:`min_chunks` chunks of one page, or
    with codecs (``work``), those and :func:`codec_chunks` of :data:`CODEC_MIN_CHUNK` each."""
    if not work:
        return min_chunks(roots) * ALIGN
    return math.ceil((min_chunks(roots) + codec_chunks(work, roots)) * CODEC_MIN_CHUNK)


def split_budget(budget: int, roots: int = 1, work: float = 0.0) -> tuple[int, int]:
    """``(chunk bytes, pool bytes)`` of ``budget`` bytes: with codecs (``work``) the pool gets
    what :func:`codec_chunks` of the same size leave; raises ``ValueError`` (naming the minimum)
    when the chunks would be smaller than :data:`CODEC_MIN_CHUNK`."""
    least = min_chunks(roots)
    if not work:
        return chunk_size(budget, least), budget
    extra = codec_chunks(work, roots)
    c = min(CHUNK_MAX, int(budget / (least + extra))) // ALIGN * ALIGN
    if c < CODEC_MIN_CHUNK:
        raise ValueError(f"a budget of {budget} bytes is too small for codecs: it needs {least} chunks for the "
                         f"snapshot and {extra:g} for encoding them ({roots} root(s)), each at least "
                         f"{CODEC_MIN_CHUNK} bytes ({minimum_budget(roots, work)} bytes)")
    return c, budget - math.ceil(extra * c)

POLL_S = 0.05
"""How often a wait for a chunk or a window checks whether it should give up."""


class Cancelled(Exception):
    """The wait for a chunk or a window was given up (the persist or the snapshot ended)."""


def resolve_budget(host_memory: int | float, state_bytes: int, roots: int = 1, whole_bytes: int = 0,
                   work: float = 0.0) -> int:
    """Bytes of the budget ``host_memory`` (bytes, or a fraction of a state of ``state_bytes``;
    a fraction of a tiny state is raised to the least that works: ``whole_bytes`` copied whole
    plus :func:`minimum_budget`)."""
    if isinstance(host_memory, float):
        return max(whole_bytes + minimum_budget(roots, work), int(host_memory * state_bytes))
    return int(host_memory)


def check_budget(host_memory, roots: int = 1, whole_bytes: int = 0, work: float = 0.0) -> None:
    """Refuse a ``host_memory`` that cannot work (at construction), naming the minimum;
    ``whole_bytes``: what a snapshot copies whole beside the chunks (module buffers); ``work``:
    what codecs encoding the chunks hold (:func:`codec_chunks`)."""
    if host_memory is None:
        return
    if isinstance(host_memory, bool) or not isinstance(host_memory, (int, float)):
        raise TypeError(f"host_memory must be a number of bytes (int) or a fraction of the state (float in "
                        f"(0, 1]), got {host_memory!r}")
    if isinstance(host_memory, float):
        if not 0.0 < host_memory <= 1.0:
            raise ValueError(f"host_memory={host_memory!r}: a float is a fraction of the state's bytes, in (0, 1]; "
                             f"pass an int for a number of bytes")
        return
    low = minimum_budget(roots, work) + whole_bytes
    if host_memory < low:
        whole = (f" plus the {whole_bytes} bytes of module buffers and bare tensors, copied whole before step "
                 f"returns (the next forward mutates them)" if whole_bytes else "")
        if work:
            raise ValueError(
                f"host_memory={host_memory} bytes cannot work with these codecs: snapshots stream through at least "
                f"{min_chunks(roots)} chunks and the writer encodes them chunk by chunk, which holds "
                f"{codec_chunks(work, roots):g} chunks' worth more (encoded frames in flight and the codecs' "
                f"temporaries, {roots} root(s)), each chunk at least {CODEC_MIN_CHUNK} bytes{whole}, so the minimum "
                f"is {low} bytes (faster from tens of MiB: chunks of up to {CHUNK_MAX >> 20} MiB); chain codecs' "
                f"references (Incremental, LCDelta) are host memory outside this budget")
        raise ValueError(f"host_memory={host_memory} bytes cannot work: snapshots stream through at least "
                         f"{min_chunks(roots)} chunks of one {ALIGN}-byte page ({roots} root(s)){whole}, so the "
                         f"minimum is {low} bytes (faster from a few MiB: chunks of up to {CHUNK_MAX >> 20} MiB)")


def chunk_size(budget: int, chunks: int = MIN_CHUNKS) -> int:
    """The chunk size for ``budget`` bytes: at most :data:`CHUNK_MAX`, at least ``chunks``
    chunks, a whole number of pages."""
    return max(ALIGN, min(CHUNK_MAX, budget // chunks) // ALIGN * ALIGN)


FREE, READY, TAKEN, DONE = 0, 1, 2, 3
"""States of a chunk in a shared pool's mailbox (one row ``[token, window, state, seq]`` per chunk)."""
TOKEN, WINDOW, STATE, SEQ = range(4)
"""Columns of a mailbox row. ``seq`` is the row's sequence lock: the pool makes it odd while it
rewrites the row for a new window and even again after, so a writer process, which reads the
row's words one at a time, never takes a window from a row half rewritten (another stream's
window with this stream's token, or the other way round)."""
_RING = 16
"""Tokens of the streams closed most recently, after the mailbox rows: a writer process
waiting for a window of one of them stops."""


def _mailbox(path: str, count: int):
    """The mailbox of a shared pool (int64, mapped): ``(rows [count, 4], closed-token ring)``."""
    m = torch.from_file(path, shared=True, size=4 * count + _RING, dtype=torch.int64).numpy()
    return m[:4 * count].reshape(count, 4), m[4 * count:]


class ChunkPool:
    """``budget`` bytes of host memory as chunks of ``chunk_bytes`` (page-aligned; pinned when
    ``pin``: the GPU path copies into them with ``non_blocking``). Chunks are allocated when
    first needed and reused; any thread.

    ``shared``: the chunks live in one ``/dev/shm`` file, so a writer process reads them
    (:class:`RemoteStream`); who holds which chunk is then told through a mailbox file beside
    it: the copy marks a window READY, the writer TAKEN while it writes, DONE once written, and
    the pool takes DONE chunks back when it needs one (x86's store order: a chunk's bytes are
    written before its state, and a row's words in the order its sequence lock relies on)."""

    def __init__(self, budget: int, *, pin: bool = False, least: int = MIN_CHUNKS, shared: bool = False,
                 shm_dir: str | None = None, keeps_hung_writers: bool = False, chunk_bytes: int | None = None):
        if budget < least * max(ALIGN, chunk_bytes or 0):
            raise ValueError(f"a chunk pool of {budget} bytes is too small: it needs {least} chunks of at least "
                             f"{max(ALIGN, chunk_bytes or 0)} bytes ({least * max(ALIGN, chunk_bytes or 0)} bytes)")
        self.budget = budget
        self.chunk_bytes = chunk_bytes or chunk_size(budget, least)
        self.count = budget // self.chunk_bytes
        self.pin = pin
        self.path: str | None = None
        self.mail_path: str | None = None
        self.keeps_hung_writers = keeps_hung_writers
        """A writer given up lives on (a node actor; a writer process is killed): in a shared pool
        the chunks it took are then retired, and the pool has that many fewer."""
        if shared:
            d = shm_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
            if d is None:
                raise RuntimeError("a shared chunk pool needs /dev/shm (or shm_dir=...)")
            stem = os.path.join(d, f"cfdist-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            self.path, self.mail_path = f"{stem}.arena", f"{stem}.mailbox.arena"   # swept like arenas
            self._shm = torch.from_file(self.path, shared=True, size=self.count * self.chunk_bytes,
                                        dtype=torch.uint8)
            self._rows, self._ring = _mailbox(self.mail_path, self.count)
            self._ring_at = 0
            self._owner: dict[int, tuple] = {}   # slot -> (stream, window) while READY/TAKEN/DONE
        self._free: list[torch.Tensor] = []
        self._allocated = 0          # chunks that exist and are not retired
        self._cv = threading.Condition()
        self.retired = 0
        """Chunks given up to a writer that may still read them (replaced by fresh ones)."""
        self.waits = 0
        """Times the copy waited for a chunk (the budget was the limit)."""
        self.peak = 0
        """Most chunks held at once."""

    @property
    def allocated_bytes(self) -> int:
        """Host memory the pool holds now (chunks allocated and not retired)."""
        return self._allocated * self.chunk_bytes

    @property
    def held(self) -> int:
        return self._allocated - len(self._free)

    @property
    def shared(self) -> bool:
        return self.path is not None

    def slot(self, chunk: torch.Tensor) -> int:
        """Index of ``chunk`` in a shared pool's file."""
        return (chunk.data_ptr() - self._shm.data_ptr()) // self.chunk_bytes

    def _new(self) -> torch.Tensor:
        if self.shared:
            c = self._allocated   # slots are handed out in order, once each
            return self._shm[c * self.chunk_bytes:(c + 1) * self.chunk_bytes]
        raw = torch.empty(self.chunk_bytes + ALIGN, dtype=torch.uint8, pin_memory=self.pin)
        skip = -raw.data_ptr() % ALIGN   # O_DIRECT writes send an aligned chunk without a copy
        return raw[skip:skip + self.chunk_bytes]

    def acquire(self, cancelled=lambda: False) -> torch.Tensor:
        """A free chunk, waiting while all :attr:`count` are held; raises :class:`Cancelled`
        once ``cancelled()`` says so."""
        with self._cv:
            waited = False
            while not self._free and self._allocated >= self.count:
                if self.shared and self._reclaim():
                    break
                if cancelled():
                    raise Cancelled("no chunk: the snapshot was given up")
                waited = True
                self._cv.wait(POLL_S / 10 if self.shared else POLL_S)   # a writer process does not notify
            self.waits += waited
            if self._free:
                c = self._free.pop()
            else:
                c = self._new()
                self._allocated += 1
            self.peak = max(self.peak, self.held)
            return c

    def release(self, chunk: torch.Tensor, *, posted: bool = True, owner: tuple | None = None) -> None:
        """``chunk`` is free again. In a shared pool a posted chunk comes back once: by this
        call or by :meth:`_reclaim` (the writer marked it DONE), whichever comes first.
        ``owner``: the ``(stream, window)`` the caller posted in it; when the chunk holds
        another window by now (reclaimed and posted again since), the call does nothing."""
        with self._cv:
            if self.shared and posted:
                c = self.slot(chunk)
                if not self._owns(c, owner):
                    return   # reclaimed already (and maybe handed out again: not twice)
                del self._owner[c]
                self._rows[c, STATE] = FREE
            self._free.append(chunk)
            self._cv.notify()

    # ---- shared pools: the mailbox ---------------------------------------------------------------
    def post(self, stream: "ShardStream", w: int, chunk: torch.Tensor) -> None:
        """Window ``w`` of ``stream`` is in ``chunk``: tell the writer process."""
        c = self.slot(chunk)
        with self._cv:
            self._owner[c] = (stream, w)
            row = self._rows[c]
            row[SEQ] += 1   # odd: being rewritten
            row[TOKEN], row[WINDOW] = stream.token, w
            row[STATE] = READY
            row[SEQ] += 1   # even: the writer may take it

    def _owns(self, c: int, owner: tuple | None) -> bool:
        """Whether slot ``c`` is posted (for ``owner``'s window, when given). Under the lock."""
        cur = self._owner.get(c)
        return cur is not None and (owner is None or (cur[0] is owner[0] and cur[1] == owner[1]))

    def _reclaim(self) -> bool:
        """Take back the chunks writer processes marked DONE (under the lock); whether any."""
        done = np.nonzero(self._rows[:, STATE] == DONE)[0]
        back = 0
        for c in done.tolist():
            owner = self._owner.pop(int(c), None)
            self._rows[c, STATE] = FREE
            if owner is None:   # released already (its stream was closed), or retired: not twice
                continue
            owner[0]._forget(owner[1])
            self._free.append(self._shm[c * self.chunk_bytes:(c + 1) * self.chunk_bytes])
            back += 1
        return back > 0

    def taken(self, chunk: torch.Tensor) -> bool:
        """Whether a writer has taken ``chunk`` and not said it is done with it."""
        return int(self._rows[self.slot(chunk), STATE]) == TAKEN

    def retire_shared(self, chunk: torch.Tensor, owner: tuple) -> None:
        """A writer given up that lives on may still read ``chunk`` (posted for ``owner``, a
        ``(stream, window)``): never hand it out again."""
        with self._cv:
            c = self.slot(chunk)
            if not self._owns(c, owner):
                return   # reclaimed since: the writer was done with it
            del self._owner[c]
            self._rows[c, TOKEN] = 0
            self.count -= 1
            self.retired += 1
        log.warning("a persist given up still holds a chunk of %d bytes in its writer: it is retired; the shared "
                    "pool has %d chunks left", self.chunk_bytes, self.count)

    def closed(self, token: int) -> None:
        """Stream ``token`` was closed: a writer process waiting for one of its windows stops."""
        with self._cv:
            self._ring[self._ring_at % _RING] = token
            self._ring_at += 1

    def retire(self, n: int = 1) -> None:
        """``n`` held chunks will never come back (a writer given up may still read them)."""
        with self._cv:
            self._allocated -= n
            self.retired += n
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._free.clear()
            self._allocated = 0
            self._cv.notify_all()
        for p in (self.path, self.mail_path):
            if p:
                try:
                    os.unlink(p)   # a writer process that still maps it keeps its pages until it ends
                except FileNotFoundError:
                    pass


class ShardStream:
    """One shard's bytes of one snapshot, window by window through a :class:`ChunkPool`.

    Stands where a full arena stands in a :class:`~cfdist.checkpoint.persist.PersistJob`
    (``nbytes``, ``path``): the copy thread :meth:`put` s windows in order, the writer
    :meth:`get` s them in order and calls :meth:`written` once each write completed."""

    path = None   # in-process only: a writer process or a node actor cannot map it

    def __init__(self, nbytes: int, pool: ChunkPool):
        self.nbytes = nbytes
        self.pool = pool
        self.token = int.from_bytes(os.urandom(7), "little") + 1   # > 0: a mailbox row of 0 is unused
        self.chunk_bytes = pool.chunk_bytes
        self.windows = math.ceil(nbytes / self.chunk_bytes)
        self._ready: dict[int, torch.Tensor] = {}    # copied, not yet taken by the writer
        self._reading: dict[int, torch.Tensor] = {}  # taken by the writer, write not completed
        self._cv = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None

    def window(self, w: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of window ``w`` in the shard's data section."""
        a = w * self.chunk_bytes
        return a, min(a + self.chunk_bytes, self.nbytes)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- the copy thread ------------------------------------------------------------------------
    def put(self, w: int, chunk: torch.Tensor) -> bool:
        """Window ``w`` is copied into ``chunk``. False (and the chunk goes back) when the stream
        was closed: nothing will read it."""
        with self._cv:
            if not self._closed:
                self._ready[w] = chunk
                if self.pool.shared:
                    self.pool.post(self, w, chunk)
                self._cv.notify_all()
                return True
        self.pool.release(chunk, posted=False)
        return False

    def handle(self) -> "RemoteStream":
        """What a writer process reads this stream through (pickles: paths and numbers)."""
        if not self.pool.shared:
            raise TypeError("a stream of an in-process chunk pool cannot be read by another process")
        return RemoteStream(self.pool.path, self.pool.mail_path, self.pool.count, self.chunk_bytes, self.token,
                            self.nbytes)

    def _forget(self, w: int) -> None:
        """A shared pool took window ``w``'s chunk back (its writer process wrote it). Called
        under the pool's lock, so not under this stream's (the copy takes them the other way
        round); a dict pop is atomic."""
        self._ready.pop(w, None)

    def fail(self, error: BaseException) -> None:
        """The copy failed: the writer's :meth:`get` raises ``error``."""
        with self._cv:
            self._error = error
            self._cv.notify_all()

    # ---- the writer -----------------------------------------------------------------------------
    def get(self, w: int, check=lambda: None) -> memoryview:
        """Window ``w``'s bytes (blocks until copied); ``check()`` runs between polls and may
        raise to give up."""
        with self._cv:
            while w not in self._ready:
                if self._error is not None:
                    raise RuntimeError(f"the snapshot copy failed: {self._error}") from self._error
                if self._closed:
                    raise Cancelled(f"window {w} of a closed stream")
                self._cv.wait(POLL_S)
                check()
            c = self._reading[w] = self._ready.pop(w)
        a, b = self.window(w)
        return memoryview(c[:b - a].numpy())

    def written(self, w: int) -> None:
        """Window ``w``'s write completed: its chunk goes back to the pool."""
        with self._cv:
            c = self._reading.pop(w, None)
        if c is not None:
            self.pool.release(c)

    def release_taken(self) -> None:
        """The writer's ``write_file`` returned (or raised): every window it took is written
        or will never be, and no write reads one any more."""
        with self._cv:
            taken = list(self._reading.values())
            self._reading.clear()
        for c in taken:
            self.pool.release(c)

    def close(self, *, hung: bool = False) -> None:
        """The persist ended: give every chunk back; ``hung``: a writer that was given up may
        still read the ones it took, so those are retired instead (never reused). Idempotent."""
        with self._cv:
            was, self._closed = self._closed, True
            ready, reading = list(self._ready.items()), list(self._reading.values())
            self._ready.clear()
            self._reading.clear()
            self._cv.notify_all()
        if self.pool.shared:
            if not was:
                self.pool.closed(self.token)
            # A chunk in ``ready`` may have been reclaimed (its writer marked it DONE) and
            # posted for another stream's window since this list was taken: the pool checks
            # that it still holds this stream's window before it frees or retires it.
            for w, c in ready:
                if hung and self.pool.keeps_hung_writers and self.pool.taken(c):
                    self.pool.retire_shared(c, (self, w))   # the writer lives on and may still read it
                else:   # a writer process given up is killed (ProcessBackend): every chunk comes back
                    self.pool.release(c, owner=(self, w))
            return
        for _, c in ready:
            self.pool.release(c)
        if hung and reading:
            log.warning("a persist given up still holds %d chunk(s) of %d bytes: they are retired, and the "
                        "snapshot budget is exceeded by that much until the process ends", len(reading),
                        self.chunk_bytes)
            self.pool.retire(len(reading))
        else:
            for c in reading:
                self.pool.release(c)


class RemoteStream:
    """A writer process's side of a :class:`ShardStream` of a shared pool (what the stream's
    :meth:`~ShardStream.handle` pickles into): the same ``get``/``written``/``release_taken``,
    through the pool's file and mailbox, polled (a window is copied in microseconds to
    milliseconds; the poll backs off from 0.2 ms to 5 ms)."""

    path = None

    def __init__(self, pool_path: str, mail_path: str, count: int, chunk_bytes: int, token: int, nbytes: int):
        self.pool_path, self.mail_path, self.count = pool_path, mail_path, count
        self.chunk_bytes, self.token, self.nbytes = chunk_bytes, token, nbytes
        self.windows = math.ceil(nbytes / chunk_bytes)
        self._taken: dict[int, int] = {}
        self._maps = None

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_maps"], d["_taken"] = None, {}
        return d

    window = ShardStream.window

    def _attach(self):
        if self._maps is None:
            buf = torch.from_file(self.pool_path, shared=True, size=self.count * self.chunk_bytes,
                                  dtype=torch.uint8).numpy()
            self._maps = (buf,) + _mailbox(self.mail_path, self.count)
        return self._maps

    def get(self, w: int, check=lambda: None) -> memoryview:
        buf, rows, ring = self._attach()
        pause = 0.0002
        while True:
            c = self._find(rows, w)
            if c is not None:
                rows[c, STATE] = TAKEN
                self._taken[w] = c
                a, b = self.window(w)
                return memoryview(buf[c * self.chunk_bytes:c * self.chunk_bytes + (b - a)])
            if (ring == self.token).any():
                raise Cancelled(f"window {w} of a closed stream")
            check()
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def _find(self, rows, w: int) -> int | None:
        """The slot holding window ``w`` READY, read under each row's sequence lock: one scan
        of the table reads its columns at different moments, so its hits are only candidates
        (a row being rewritten may show this stream's token beside another stream's window)."""
        for c in np.nonzero(rows[:, TOKEN] == self.token)[0].tolist():
            seq = int(rows[c, SEQ])
            if (seq % 2 == 0 and int(rows[c, TOKEN]) == self.token and int(rows[c, WINDOW]) == w
                    and int(rows[c, STATE]) == READY and int(rows[c, SEQ]) == seq):
                return c
        return None

    def written(self, w: int) -> None:
        c = self._taken.pop(w, None)
        if c is not None:
            self._attach()[1][c, STATE] = DONE

    def release_taken(self) -> None:
        for w in list(self._taken):
            self.written(w)


def copy_windows(streams: list[ShardStream], layout, tensors: dict[str, torch.Tensor], *,
                 cancelled=lambda: False, stream=None) -> float:
    """The copy thread's work for one snapshot: every shard's windows, round robin over the
    shards (their roots are written in parallel), each into a chunk of the pool. Returns the
    seconds it took; :class:`Cancelled` ends it early (the snapshot was given up).

    ``stream``: the CUDA copy stream; CUDA sources are copied with ``non_blocking`` into the
    pinned chunk and the window is handed over once the stream reached it."""
    t0 = time.perf_counter()
    flat: dict[str, torch.Tensor] = {}

    def bytes_of(name: str) -> torch.Tensor:
        if name not in flat:
            t = tensors[name].detach()
            if not t.is_contiguous():   # a byte range needs contiguous memory (a transient copy)
                t = t.contiguous()
            flat[name] = t.reshape(-1).view(torch.uint8)
        return flat[name]

    cursors = [0] * len(streams)   # per shard: index of the first entry not fully copied
    live = [i for i, s in enumerate(streams) if s.windows]
    w = 0
    with torch.no_grad():
        while live:
            for i in list(live):
                s, entries = streams[i], layout[i]
                if w >= s.windows:
                    live.remove(i)
                    continue
                if s.closed:   # its persist ended: nothing reads the rest
                    live.remove(i)
                    continue
                chunk = s.pool.acquire(cancelled)
                a, b = s.window(w)
                k = cursors[i]
                while k < len(entries) and entries[k].offset + entries[k].nbytes <= a:
                    k += 1
                cursors[i] = k
                while k < len(entries) and entries[k].offset < b:
                    e = entries[k]
                    lo, hi = max(a, e.offset), min(b, e.offset + e.nbytes)
                    src = bytes_of(e.name)[lo - e.offset:hi - e.offset]
                    chunk[lo - a:hi - a].copy_(src, non_blocking=stream is not None and src.is_cuda)
                    if hi == e.offset + e.nbytes:
                        flat.pop(e.name, None)
                    k += 1
                if stream is not None:
                    done = torch.cuda.Event()
                    done.record(stream)
                    done.synchronize()
                s.put(w, chunk)
            w += 1
    return time.perf_counter() - t0
