"""Phase 1: copy the state's tensors into reusable buffers, off the critical path.

The buffers are *arenas*: one contiguous byte buffer per shard, laid out exactly like the data
section of the shard's safetensors file, so phase 2 writes each arena with a few large
sequential writes and no re-packing. Arenas are allocated once and reused while the state's
layout (names, dtypes, shapes) stays the same; a changed layout re-plans them.

Backing memory, in order of preference:

* ``gpu``: spare GPU memory (``mode="gpu"`` and CUDA tensors), when the device has room for
  it (``torch.cuda.mem_get_info``; else the snapshot goes to host memory): the copy is
  device-to-device on a side stream (fastest gate); the device-to-host copy into the host
  arena happens later, in the background, as part of persisting;
* a file in ``/dev/shm`` when another process (writer process, node actor) must read it;
* pinned host memory when CUDA is present, else ordinary host memory.

With a host-memory budget (``host_memory``; :mod:`~cfdist.checkpoint.chunks`) there are no
full host arenas: each shard's bytes stream through a bounded pool of chunks into its persist,
window by window, and the gate waits until the last window was copied.

The copy runs on one long-lived background thread (``torch.Tensor.copy_`` releases the GIL),
overlapped with the next forward/backward. :meth:`Snapshotter.wait_copied` is the gate.

Tensors that the next forward mutates in place (module buffers: BatchNorm statistics, EMA
buffers kept as buffers, counters; the caller names them in ``first``) are copied before
:meth:`Snapshotter.start` returns, so the snapshot of step i never holds iteration i+1's
values: on the CPU synchronously (buffers are small); on CUDA on the copy stream, and the
training stream waits for that copy with an event before it runs the next forward.

CUDA ordering: every copy runs on the snapshotter's own stream (never the default stream).
An event recorded on the training stream right after the optimizer step orders the copy
after the update; completion is an event the copy thread waits for. Nothing synchronizes
the whole device.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from cfdist.checkpoint import idle
from cfdist.checkpoint import chunks as chunking
from cfdist.checkpoint.format import TensorEntry
from cfdist.storage.direct import ALIGN

log = logging.getLogger("cfdist.snapshot")

_SHM_DIR = "/dev/shm"

PREFAULT_CHUNK = 1 << 20
""":meth:`Snapshotter.prefault` writes the arenas this many bytes at a time, and a snapshot that
needs them stops it between two such writes (the rest it writes itself: no wait on an idle thread)."""


def plan_layout(tensors: dict[str, torch.Tensor], n_shards: int) -> list[list[TensorEntry]]:
    """Assign tensors to ``n_shards`` shards (balanced bytes), offsets aligned by element size.

    Pure: the same names, dtypes and shapes always give the same layout.
    """
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    loads = [0] * n_shards
    members: list[list[str]] = [[] for _ in range(n_shards)]
    for name in sorted(tensors, key=lambda n: (-sizes[n], n)):
        i = min(range(n_shards), key=lambda j: (loads[j], j))
        members[i].append(name)
        loads[i] += sizes[name]
    order = {n: i for i, n in enumerate(tensors)}
    layout = []
    for i, names in enumerate(members):
        names.sort(key=lambda n: (-tensors[n].element_size(), order[n]))
        off, entries = 0, []
        for n in names:
            t = tensors[n]
            entries.append(TensorEntry(n, i, t.dtype, tuple(t.shape), off, sizes[n]))
            off += sizes[n]
        layout.append(entries)
    return layout


def layout_signature(tensors: dict[str, torch.Tensor]) -> tuple:
    return tuple((n, t.dtype, tuple(t.shape), t.device.type) for n, t in tensors.items())


class Arena:
    """One contiguous byte buffer (host memory, pinned memory, /dev/shm file, or GPU memory).

    Host arenas start at a page boundary (:data:`~cfdist.storage.direct.ALIGN`; /dev/shm
    files are mapped, so page-aligned too)."""

    def __init__(self, nbytes: int, *, shared: bool = False, device: str | torch.device = "cpu",
                 pin: bool = False, shm_dir: str | None = None):
        self.nbytes = nbytes
        self.path: str | None = None
        n = max(nbytes, 1)
        if shared:
            d = shm_dir or (_SHM_DIR if os.path.isdir(_SHM_DIR) else None)
            if d is None:
                raise RuntimeError("shared-memory snapshots need /dev/shm (or shm_dir=...)")
            self.path = os.path.join(d, f"cfdist-{os.getpid()}-{uuid.uuid4().hex[:12]}.arena")
            self.buf = torch.from_file(self.path, shared=True, size=n, dtype=torch.uint8)
        elif torch.device(device).type != "cpu":
            self.buf = torch.empty(n, dtype=torch.uint8, device=device)
        else:
            # page-aligned, so that an O_DIRECT write sends the arena to the disk without a copy
            raw = torch.empty(n + ALIGN, dtype=torch.uint8, pin_memory=pin)
            skip = -raw.data_ptr() % ALIGN
            self.buf = raw[skip:skip + n]

    def view(self, e: TensorEntry) -> torch.Tensor:
        return self.buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)

    _views_of: list | None = None

    def views(self, entries: list[TensorEntry]) -> list[torch.Tensor]:
        """:meth:`view` of each entry, made once per layout (the same list object while the
        layout stays the same): three tensor ops per entry at every snapshot cost the training
        thread milliseconds on models with hundreds of tensors."""
        if self._views_of is not entries:
            self._views, self._views_of = [self.view(e) for e in entries], entries
        return self._views

    def close(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    def __del__(self):  # best effort: never leave /dev/shm files behind
        try:
            self.close()
        except Exception:
            pass


def attach_arena(path: str, nbytes: int) -> torch.Tensor:
    """Map an arena another process created (read by writer processes and node actors)."""
    return torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)


GPU_HEADROOM = 0.05
"""Fraction of the device's memory a GPU snapshot leaves free (allocator fragmentation)."""


def gpu_room(nbytes: int, device: torch.device, *, headroom: float = GPU_HEADROOM) -> bool:
    """Whether ``nbytes`` more fit on ``device`` now (``torch.cuda.mem_get_info``), leaving
    ``headroom`` of its memory free. Memory training already reserved is not counted as free:
    it is what the next forward/backward allocates from."""
    free, total = torch.cuda.mem_get_info(device)
    return nbytes <= free - headroom * total


class Snapshotter:
    """Owns the arenas and the copy thread of one Checkpointer. Not thread-safe: call from the
    training thread only (the copy itself runs on the internal thread).

    ``buffers``: sets of host arenas (double buffering: a snapshot copies into one set while a
    persist still reads another). Host memory is ``buffers`` times the state once every set was
    used; the GPU arenas (``mode="gpu"``) are one set, free again once :meth:`stage_to_host`
    returned. :meth:`select` picks the set the next :meth:`start` copies into; ``host`` and
    ``layout`` are that set's.
    """

    def __init__(self, *, n_shards: int = 1, shared: bool = False, shm_dir: str | None = None,
                 gpu_headroom: float = GPU_HEADROOM, buffers: int = 1, host_memory: int | float | None = None,
                 whole_bytes: int = 0, keeps_hung_writers: bool = False, codec_work: float = 0.0):
        self.buffers = buffers
        self.host_memory = host_memory
        self.codec_work = codec_work
        """What codecs encoding the chunks hold, per chunk (0: no codecs); the budget sets
        :func:`~cfdist.checkpoint.chunks.codec_chunks` aside for it."""
        """The budget (bytes, or a fraction of the state) that snapshots stream through, or None:
        full host arenas. Then ``host`` holds each set's :class:`~cfdist.checkpoint.chunks.ShardStream` s."""
        chunking.check_budget(host_memory, n_shards, whole_bytes, codec_work)
        self.pool: chunking.ChunkPool | None = None
        self._old_pools: list = []   # replaced for a new layout; their files go at close
        self.keeps_hung_writers = keeps_hung_writers
        self.on_wait = None
        """Called between the gate's polls while a budgeted copy waits (the Checkpointer gives up
        persists past their timeout there: their chunks are what the copy waits for)."""
        self._cancel = threading.Event()
        self.slot = 0
        self._stash: list[tuple] = [(None, None, []) for _ in range(buffers)]   # (sig, layout, host) per set
        self._gpu_sig: tuple | None = None
        self.n_shards = n_shards
        self.shared = shared
        self.shm_dir = shm_dir
        self.gpu_headroom = gpu_headroom
        self.layout: list[list[TensorEntry]] | None = None
        self.host: list[Arena] = []
        self.gpu: list[Arena] = []
        self._sig: tuple | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cfdist-snapshot")
        self._copy: Future | None = None
        self._streams: dict = {}       # device -> the copy stream (CUDA only)
        self._first_s = 0.0            # seconds start() spent copying ``first`` itself
        self.last_copy_s: float | None = None
        self.last_device: str = "cpu"
        self.copies = 0
        """Copies finished and collected so far (each one's duration is ``last_copy_s``)."""
        self.gpu_refused = 0
        """GPU snapshots asked for that went to host memory: the device had no room for them."""
        self._prefault: tuple[threading.Event, Future] | None = None   # (stop, done) of prefault()
        self.prefaulted = 0
        """Bytes of host arenas :meth:`prefault` wrote ahead of their first snapshot."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.host)

    @property
    def arena_bytes(self) -> int:
        """Bytes of host memory every arena set holds together (at most ``buffers`` x the state;
        under a budget, the chunks allocated)."""
        if self.host_memory is not None:
            return self.pool.allocated_bytes if self.pool is not None else 0
        return self.nbytes + sum(a.nbytes for i, (_, _, host) in enumerate(self._stash) if i != self.slot
                                 for a in host)

    def select(self, slot: int) -> None:
        """Copy the next snapshot into arena set ``slot`` (no persist may be reading it)."""
        if not 0 <= slot < self.buffers:
            raise ValueError(f"arena set {slot} does not exist (buffers={self.buffers})")
        self._join_prefault()
        self.wait_copied()
        if slot != self.slot:
            self._stash[self.slot] = (self._sig, self.layout, self.host)
            self._sig, self.layout, self.host = self._stash[slot]
            self.slot = slot

    def arenas(self, slot: int) -> tuple[list[list[TensorEntry]], list["Arena"]]:
        """``(layout, host arenas)`` of set ``slot``."""
        return (self.layout, self.host) if slot == self.slot else self._stash[slot][1:]

    @property
    def gpu_nbytes(self) -> int:
        """Bytes of GPU memory the snapshot arenas hold now (0 when snapshots go to the host)."""
        return sum(a.nbytes for a in self.gpu)

    def _ensure(self, tensors: dict[str, torch.Tensor], want_gpu: bool) -> bool:
        """Plan and allocate arenas for ``tensors``; returns whether they are in GPU memory."""
        sig = layout_signature(tensors)
        if want_gpu:
            dev = next(t.device for t in tensors.values() if t.is_cuda)
        if want_gpu and not (sig == self._gpu_sig and self.gpu):   # new GPU arenas: is there room?
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            if not gpu_room(nbytes, dev, headroom=self.gpu_headroom):
                free, total = torch.cuda.mem_get_info(dev)
                (log.warning if not self.gpu_refused else log.debug)(
                    "no room for a %d-byte GPU snapshot on %s (%d of %d bytes free, %.0f%% kept free); "
                    "snapshotting to host memory instead", nbytes, dev, free, total, 100 * self.gpu_headroom)
                self.gpu_refused += 1
                want_gpu = False
        self._plan_host(tensors, sig)
        if want_gpu != bool(self.gpu) or (want_gpu and self._gpu_sig != sig):
            for a in self.gpu:
                a.close()
            self.gpu = [Arena(sum(e.nbytes for e in es), device=dev) for es in self.layout] if want_gpu else []
            self._gpu_sig = sig if want_gpu else None
        return want_gpu

    def _plan_host(self, tensors: dict[str, torch.Tensor], sig: tuple) -> None:
        """This set's host arenas for ``tensors`` (layout signature ``sig``): (re)planned only
        for a new layout."""
        if sig == self._sig:
            return
        for a in self.host:
            a.close()
        self.layout = plan_layout(tensors, self.n_shards)
        pin = torch.cuda.is_available() and not self.shared
        self.host = [Arena(sum(e.nbytes for e in es), shared=self.shared, pin=pin, shm_dir=self.shm_dir)
                     for es in self.layout]
        self._sig = sig

    def prefault(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Make the current set's host arenas for ``tensors`` now, ahead of the snapshot that
        needs them, and write each of their pages once: on a helper thread under ``SCHED_IDLE``
        (:func:`cfdist.checkpoint.idle.idle_thread`), so the training beside it keeps its cores.

        A fresh arena costs its first snapshot a page fault per page, on the training thread
        for the tensors copied before :meth:`start` returns (module buffers: a 16 MiB buffer
        into a fresh ``/dev/shm`` arena takes ~10 ms there, ~1 ms into one written before).
        A process that restarts training (a recovery, a spare taking a rank's role) pays it
        at its first checkpoint; this moves it off the critical path.

        Returns whether it started (not under a host-memory budget, nor when the current set
        has arenas already, nor while one runs). The next call that uses the
        arenas (:meth:`start`, :meth:`select`, :meth:`retire_host_arenas`, :meth:`close`)
        stops it between two writes and takes the arenas as they are: the copy writes what it
        left. Call from the training thread."""
        sig = layout_signature(tensors)
        if self.host_memory is not None or self._prefault is not None or self.host:
            return False
        stop, done = threading.Event(), Future()

        def body() -> None:
            try:
                if idle.LINUX:
                    try:
                        idle.idle_thread()
                    except OSError as e:   # lowering oneself is always allowed; should it fail, go on
                        log.debug("could not lower the arenas' preparation: %s", e)
                self._plan_host(tensors, sig)
                for a in self.host:
                    for off in range(0, a.nbytes, PREFAULT_CHUNK):
                        if stop.is_set():
                            break
                        a.buf[off:off + PREFAULT_CHUNK].zero_()
                        self.prefaulted += min(PREFAULT_CHUNK, a.nbytes - off)
                done.set_result(None)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread (_join_prefault)
                done.set_exception(e)

        self._prefault = (stop, done)
        threading.Thread(target=body, name="cfdist-prefault", daemon=True).start()
        return True

    def _join_prefault(self) -> None:
        """Stop a :meth:`prefault` still writing and wait for it (one chunk at most). One that
        failed (e.g. ``/dev/shm`` full) is logged and forgotten: the snapshot makes its arenas
        itself, and raises there if it cannot."""
        if self._prefault is None:
            return
        stop, done = self._prefault
        stop.set()
        try:
            done.result()
        except Exception as e:  # noqa: BLE001 - logged; the snapshot allocates (and reports) itself
            log.warning("making the snapshot arenas ahead failed (%s: %s); the next snapshot makes them",
                        type(e).__name__, e)
            for a in self.host:
                a.close()
            self.host, self._sig, self.layout = [], None, None
        finally:
            self._prefault = None

    def _stream(self, device: torch.device):
        """This snapshotter's copy stream on ``device`` (created once; never the default stream)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _ensure_pool(self, tensors: dict[str, torch.Tensor], first_bytes: int) -> None:
        """The layout and the chunk pool of a budgeted snapshot (re-planned for a new layout)."""
        sig = layout_signature(tensors)
        if sig != self._sig:
            self.layout = plan_layout(tensors, self.n_shards)
            self._sig = sig
        state = sum(t.numel() * t.element_size() for t in tensors.values())
        total = chunking.resolve_budget(self.host_memory, state, self.n_shards, first_bytes, self.codec_work)
        budget = total - first_bytes
        least = chunking.min_chunks(self.n_shards)
        low = chunking.minimum_budget(self.n_shards, self.codec_work)
        if budget < low:
            raise ValueError(
                f"host_memory={self.host_memory!r} ({total} bytes) leaves {budget} bytes for the chunks once the "
                f"{first_bytes} bytes of tensors the next forward mutates (module buffers, bare tensors: copied "
                f"whole before step returns) are set aside; it needs at least {first_bytes + low}")
        chunk, pool_bytes = chunking.split_budget(budget, self.n_shards, self.codec_work)
        if self.pool is None or self.pool.budget != pool_bytes or self.pool.chunk_bytes != chunk:
            if self.pool is not None:   # persists in flight may still read it: closed with the rest
                self._old_pools.append(self.pool)
            self.pool = chunking.ChunkPool(pool_bytes, pin=torch.cuda.is_available() and not self.shared, least=least,
                                           shared=self.shared, shm_dir=self.shm_dir,
                                           keeps_hung_writers=self.keeps_hung_writers,
                                           chunk_bytes=chunk if self.codec_work else None)

    def _start_streaming(self, tensors: dict[str, torch.Tensor], first) -> None:
        """A budgeted snapshot: ``first`` copied whole now, the rest window by window through
        the chunk pool on the copy thread (see :mod:`~cfdist.checkpoint.chunks`)."""
        first = [n for n in tensors if n in first]
        first_bytes = sum(tensors[n].numel() * tensors[n].element_size() for n in first)
        self._ensure_pool(tensors, first_bytes)
        src = dict(tensors)
        t0 = time.perf_counter()
        with torch.no_grad():
            for n in first:   # what the next forward mutates: its own copy, before step returns
                src[n] = tensors[n].detach().clone()
        self._first_s = time.perf_counter() - t0
        self.host = [chunking.ShardStream(sum(e.nbytes for e in es), self.pool) for es in self.layout]
        self.last_device = "cpu"
        stream = None
        cuda = [t.device for t in src.values() if t.is_cuda]
        if cuda:
            stream = self._stream(cuda[0])
            updated = torch.cuda.Event()
            updated.record(torch.cuda.current_stream(cuda[0]))   # after the update and the clones
            stream.wait_event(updated)
        self._cancel = cancel = threading.Event()
        self._copy = self._pool.submit(self._stream_copy, self.host, self.layout, src, stream, cancel)

    @staticmethod
    def _stream_copy(streams, layout, src, stream, cancel) -> float:
        try:
            if stream is not None:
                with torch.cuda.stream(stream):
                    return chunking.copy_windows(streams, layout, src, cancelled=cancel.is_set, stream=stream)
            return chunking.copy_windows(streams, layout, src, cancelled=cancel.is_set)
        except chunking.Cancelled:
            return 0.0   # given up (cancel): the streams are closed, nothing waits for the rest
        except BaseException as e:
            for s in streams:
                s.fail(e)
            raise

    def cancel(self) -> None:
        """Give the budgeted copy in progress up (the snapshot is dropped: its persist will not
        run): it stops at its next chunk, and its streams are closed."""
        self._cancel.set()
        if self.host_memory is not None:
            for s in self.host:
                s.close()

    def start(self, tensors: dict[str, torch.Tensor], *, mode: str = "cpu", first=()) -> None:
        """Begin copying ``tensors`` (live references) into the arenas; returns once the tensors
        named in ``first`` are safe and the rest is copying in the background.

        Must be called right after the optimizer step, and the caller must not mutate the
        tensors until :meth:`wait_copied` returned (the gate before the next update), except
        those in ``first`` (what the next forward mutates: module buffers), which may change as
        soon as this returns. On CUDA the order is kept by events on the copy stream: the copy
        waits for the training stream's optimizer step, and the training stream waits for the
        copy of ``first`` before its next kernel; the host blocks for neither.
        """
        self._join_prefault()
        self.wait_copied()
        if self.host_memory is not None:
            self._start_streaming(tensors, set(first))
            return
        want_gpu = mode == "gpu" and any(t.is_cuda for t in tensors.values())
        want_gpu = self._ensure(tensors, want_gpu)
        early, rest = [], []
        targets = self.gpu if want_gpu else self.host
        for es, arena in zip(self.layout, targets):
            for e, view in zip(es, arena.views(es)):
                (early if e.name in first else rest).append((tensors[e.name], view))
        self.last_device = "gpu" if want_gpu else "cpu"
        t0 = time.perf_counter()
        stream = None
        cuda = [src.device for src, _ in early + rest if src.is_cuda]
        if cuda:
            stream = self._stream(cuda[0])
            updated = torch.cuda.Event()
            updated.record(torch.cuda.current_stream(cuda[0]))   # right after the optimizer step
            stream.wait_event(updated)
        with torch.no_grad():
            if stream is not None:
                with torch.cuda.stream(stream):
                    for src, dst in early:
                        dst.copy_(src, non_blocking=True)
                if early:
                    copied = torch.cuda.Event()
                    copied.record(stream)
                    torch.cuda.current_stream(cuda[0]).wait_event(copied)  # the next forward waits
            else:
                for src, dst in early:
                    dst.copy_(src)
        self._first_s = time.perf_counter() - t0
        self._copy = self._pool.submit(self._do_copy, rest, stream)

    @staticmethod
    def _do_copy(pairs, stream) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            if stream is not None:
                with torch.cuda.stream(stream):
                    for src, dst in pairs:
                        dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                done.synchronize()
            elif pairs:
                # one call for every tensor: the copy thread takes the GIL once, not once per
                # tensor, so on models of hundreds of tensors it neither spends its time in a
                # Python loop nor takes the GIL from the training thread between tensors
                torch._foreach_copy_([dst for _, dst in pairs], [src for src, _ in pairs])
        return time.perf_counter() - t0

    def copy_running(self) -> bool:
        return self._copy is not None and not self._copy.done()

    def wait_copied(self) -> float:
        """The gate: block until the current copy finished; returns seconds waited.

        Interrupted (``KeyboardInterrupt``, a signal handler's ``SystemExit``), the copy stays
        current: the next call waits for it again, so no update or new copy can touch the
        arenas or the tensors while it runs.
        """
        if self._copy is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            while True:
                try:   # budgeted: the copy waits for chunks that persists give back
                    background_s = self._copy.result(None if self.on_wait is None else chunking.POLL_S)
                    break
                except cf.TimeoutError:
                    self.on_wait()
        except Exception:
            self._copy = None   # the copy ended (with an error): nothing runs any more
            raise
        self._copy = None
        self.last_copy_s = self._first_s + background_s
        self.copies += 1
        return time.perf_counter() - t0

    def stage_to_host(self) -> None:
        """After a GPU-memory snapshot: copy the GPU arenas into the host arenas (background).

        On the copy stream, after the device-to-device copy; waits for its own event only."""
        if not self.gpu or self.last_device != "gpu":
            return
        stream = self._stream(self.gpu[0].buf.device)
        with torch.cuda.stream(stream):
            for g, h in zip(self.gpu, self.host):
                h.buf.copy_(g.buf, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()

    def retire_host_arenas(self, slot: int | None = None) -> None:
        """Never copy into the arenas of set ``slot`` (default: the current one) again (a writer
        given up may still read them): its next :meth:`start` allocates fresh ones. Their memory
        is freed once that writer drops its references (in-process), or stays mapped in its
        process (shared)."""
        if self.host_memory is not None:   # no arenas to retire: the chunks its writer took are
            for st_ in self.arenas(self.slot if slot is None else slot)[1]:
                st_.close(hung=True)
            return
        self._join_prefault()
        self.wait_copied()
        if slot is None or slot == self.slot:
            self._sig = None
        else:
            self._stash[slot] = (None,) + tuple(self._stash[slot][1:])

    def close_arenas(self) -> None:
        self._join_prefault()
        for a in self.host + self.gpu + [a for _, _, host in self._stash for a in host]:
            a.close()
        for pool in self._old_pools + ([self.pool] if self.pool is not None else []):
            pool.close()   # the current one's counters stay readable (stats after close)
        self._old_pools = []
        self.host, self.gpu, self._sig, self.layout, self._gpu_sig = [], [], None, None, None
        self._stash = [(None, None, []) for _ in range(self.buffers)]

    def close(self) -> None:
        try:
            self.wait_copied()
        finally:
            self.close_arenas()
            self._pool.shutdown(wait=True)
