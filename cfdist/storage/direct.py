"""How a local file is written: ``O_DIRECT`` from aligned memory, or buffered and dropped from cache.

A bulk writer (the persist path) picks the mode for a stretch of code with :func:`io_mode`::

    with io_mode("auto"):               # "auto" | "direct" | "buffered"
        storage.write_file(rel, chunks)  # local roots: the mode below; other backends: unchanged

Modes (local ``file://`` roots only; fsspec backends always write through fsspec):

* ``direct``: ``O_DIRECT``, so the bytes go from the caller's memory to the disk without the
  page cache (no copy, no dirty pages to write back, no cache pollution). A chunk whose address
  and file offset are multiples of :data:`ALIGN` (4 KiB) is written as it is, by a writer thread
  (so the caller's next chunk, e.g. its checksum, overlaps the device's write); anything else
  (the header, a tail, unaligned memory) goes through an aligned bounce buffer. The last block is
  padded and the file truncated to its real length. A filesystem that refuses ``O_DIRECT``
  (tmpfs, some FUSE and network filesystems) raises :class:`DirectIOUnsupported`.
* ``auto``: ``direct`` where the filesystem takes it (probed once per filesystem and process:
  one aligned block written and removed), else ``buffered``, with one log line per filesystem.
* ``buffered``: ``write`` through the page cache, ``fsync``, then
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` so a checkpoint does not push training data out of
  the cache.

Outside :func:`io_mode` (``None``: every other write) a local write is the plain buffered write
it always was. The mode is a context variable, so it reaches the innermost Storage through any
wrapper (fault injection, throttling) in the same thread. Pure ``os`` calls; Linux semantics.

**Reusing the files of deleted checkpoints** (``io_mode(..., reuse=True)``, the persist path): when
retention deletes a checkpoint from a local root, its shard files are moved into the root's
:data:`REUSE_DIR` (:func:`retire_dir`) instead of being unlinked, and the next shard written there
takes one of them over (:func:`take_reusable`: a rename into the staging directory) and is written
over it in place, then truncated to its length. The disk then neither frees nor allocates the
blocks of a checkpoint every persist: no extent allocation (O_DIRECT writes into unwritten
extents must convert them), and no freed ranges for the journal to discard on filesystems mounted
with ``discard``. Measured on ext4 over one virtio disk with ``discard``, 200 MB: writing a new
file and deleting the previous one took 0.155 s, writing over the old file in place 0.105 s
(median of 4, ``O_DIRECT``). The pool holds at most :data:`REUSE_MAX` files per root; a
Checkpointer's start (sweep) and ``close()`` empty it, so a finished run leaves only its
checkpoints. A file in the pool is part of no checkpoint (its step was un-committed first).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import contextvars
import errno as _errno
import logging
import mmap
import os
import shutil
import threading
import uuid

import numpy as np

log = logging.getLogger("cfdist.storage")

ALIGN = 4096
"""Alignment of memory addresses, file offsets and lengths for ``O_DIRECT`` (a page; every
logical block size in use divides it)."""

MODES = ("auto", "direct", "buffered")
_BOUNCE = 4 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)

REUSE_DIR = ".cfdist-reuse"
"""Directory of a local root holding the shard files of deleted checkpoints, for reuse."""
REUSE_MAX = 16
"""At most this many files wait in one root's pool; retiring more deletes them."""

_mode: contextvars.ContextVar[str | None] = contextvars.ContextVar("cfdist_io_mode", default=None)
_threads: contextvars.ContextVar[int] = contextvars.ContextVar("cfdist_io_threads", default=1)
_reuse: contextvars.ContextVar[bool] = contextvars.ContextVar("cfdist_io_reuse", default=False)


class DirectIOUnsupported(OSError):
    """The filesystem refuses ``O_DIRECT`` (``io="direct"`` was asked for there)."""


def check_mode(io: str) -> str:
    if io not in MODES:
        raise ValueError(f"io must be one of {', '.join(repr(m) for m in MODES)}, got {io!r}: 'auto' uses "
                         f"O_DIRECT where the filesystem supports it, 'buffered' the page cache")
    return io


@contextlib.contextmanager
def io_mode(io: str | None, *, threads: int = 1, reuse: bool = False):
    """Local writes in this block (this thread) use ``io`` with ``threads`` writer threads per file;
    ``reuse``: a new file takes over one of the root's retired files when there is one."""
    if io is not None:
        check_mode(io)
    if not (isinstance(threads, int) and threads >= 1):
        raise ValueError(f"io threads must be an int >= 1, got {threads!r}")
    t1, t2, t3 = _mode.set(io), _threads.set(threads), _reuse.set(bool(reuse))
    try:
        yield
    finally:
        _mode.reset(t1)
        _threads.reset(t2)
        _reuse.reset(t3)


def current_mode() -> str | None:
    return _mode.get()


def current_reuse() -> bool:
    return _reuse.get()


# ---- the files of deleted checkpoints, written over by new ones -----------------------------------

def retire_dir(directory: str, pool: str, *, limit: int = REUSE_MAX) -> int:
    """Remove ``directory`` (a tree), moving its regular files into ``pool`` (same filesystem)
    while the pool holds fewer than ``limit``; the rest is deleted. Returns the files moved.
    A missing ``directory`` is not an error."""
    moved = 0
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return 0
    try:
        room = limit - len(os.listdir(pool))
    except FileNotFoundError:
        room = limit
    for name in names:
        src = os.path.join(directory, name)
        if room <= 0 or not os.path.isfile(src) or os.path.islink(src):
            continue
        os.makedirs(pool, exist_ok=True)
        try:
            os.rename(src, os.path.join(pool, f"{name}.{uuid.uuid4().hex[:8]}"))
        except FileNotFoundError:
            continue
        moved += 1
        room -= 1
    if os.path.isdir(directory) and not os.path.islink(directory):
        shutil.rmtree(directory)
    return moved


def take_reusable(pool: str, path: str) -> bool:
    """Move one file of ``pool`` to ``path`` (which must not exist); True when one was taken.
    A file retired under the same name (the same shard of an older step) is preferred: its
    length is likely the same. Writers racing for one file: each gets another, or none."""
    try:
        names = os.listdir(pool)
    except FileNotFoundError:
        return False
    base = os.path.basename(path) + "."
    for name in sorted(names, key=lambda n: (not n.startswith(base), n)):
        try:
            os.rename(os.path.join(pool, name), path)
            return True
        except FileNotFoundError:
            continue   # another writer took it
    return False


# ---- which filesystems take O_DIRECT ------------------------------------------------------------

_probed: dict[int, str | None] = {}      # st_dev -> None (supported) or why not
_probe_lock = threading.Lock()


def unsupported_reason(directory: str) -> str | None:
    """None when ``directory``'s filesystem takes aligned ``O_DIRECT`` writes, else why not.

    Probed once per filesystem (``st_dev``) and process: a 4 KiB aligned block is written to a
    temporary file there and removed. ``directory`` must exist.
    """
    if not _O_DIRECT:
        return "this platform has no O_DIRECT"
    dev = os.stat(directory).st_dev
    with _probe_lock:
        if dev in _probed:
            return _probed[dev]
        path = os.path.join(directory, f".cfdist-odirect-probe-{uuid.uuid4().hex[:8]}")
        why = None
        buf = mmap.mmap(-1, ALIGN)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o600)
            try:
                os.write(fd, buf)
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno not in (_errno.EINVAL, _errno.EOPNOTSUPP, _errno.ENOTSUP):
                raise   # a real error of that directory (permissions, full disk): the caller's to report
            why = f"{os.strerror(e.errno)} (errno {e.errno})"
        finally:
            buf.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        _probed[dev] = why
        return why


def resolve(io: str, directory: str) -> str:
    """``"direct"`` or ``"buffered"``: what mode ``io`` means for a file in ``directory``."""
    if io == "buffered":
        return "buffered"
    why = unsupported_reason(directory)
    if why is None:
        return "direct"
    if io == "direct":
        raise DirectIOUnsupported(_errno.EINVAL, f"io='direct' but the filesystem of {directory} refuses O_DIRECT "
                                                 f"({why}); use io='auto' (falls back to buffered writes) or "
                                                 f"put the checkpoints on a disk filesystem (ext4, xfs)")
    dev = os.stat(directory).st_dev
    with _probe_lock:
        first = dev not in _logged
        _logged.setdefault(dev, directory)
    if first:
        log.info("O_DIRECT is not supported on the filesystem of %s (%s): checkpoint files there are written "
                 "through the page cache (fsync, then posix_fadvise DONTNEED)", directory, why)
    return "buffered"


_logged: dict[int, str] = {}


# ---- writing ------------------------------------------------------------------------------------

def aligned_buffer(nbytes: int) -> mmap.mmap:
    """``nbytes`` of page-aligned anonymous memory (zero-filled)."""
    return mmap.mmap(-1, max(nbytes, 1))


def _address(mv: memoryview) -> int:
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data if mv.nbytes else 0


def _pwrite_all(fd: int, mv: memoryview, off: int) -> None:
    while mv:
        n = os.pwrite(fd, mv, off)
        mv, off = mv[n:], off + n


def writes_in_flight(threads: int) -> int:
    """Most chunks :func:`write_direct` still reads from when it asks for the next one: the
    ``2 * threads`` writes it keeps in flight. A producer may reuse the memory of every chunk
    older than that (:mod:`cfdist.checkpoint.chunks` relies on it)."""
    return 2 * threads


def write_direct(fd: int, chunks, *, threads: int = 1) -> int:
    """Write ``chunks`` to ``fd`` (opened with ``O_DIRECT``) from offset 0; returns the byte count.

    Aligned chunks go to the disk from their own memory on ``threads`` writer threads (at most
    :func:`writes_in_flight` writes in flight when the next chunk is asked for); the rest
    through a bounce buffer. The file is truncated to the exact count. The caller fsyncs and
    closes ``fd``.
    """
    bounce = aligned_buffer(_BOUNCE)
    bmv = memoryview(bounce)
    fill = off = 0
    pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="cfdist-odirect")
    inflight: list[cf.Future] = []

    def flush(n: int) -> None:   # the bounce's first n bytes (a multiple of ALIGN) at ``off``, inline:
        nonlocal fill, off          # the bounce is refilled right after
        _pwrite_all(fd, bmv[:n], off)
        off += n
        fill = 0

    try:
        for c in chunks:
            mv = memoryview(c).cast("B")
            while mv:
                if fill % ALIGN == 0 and mv.nbytes >= ALIGN and _address(mv) % ALIGN == 0:
                    if fill:
                        flush(fill)
                    n = mv.nbytes // ALIGN * ALIGN
                    inflight.append(pool.submit(_pwrite_all, fd, mv[:n], off))
                    off += n
                    mv = mv[n:]
                    if len(inflight) > writes_in_flight(threads):
                        inflight.pop(0).result()
                    continue
                take = min(mv.nbytes, _BOUNCE - fill)
                bmv[fill:fill + take] = mv[:take]
                fill += take
                mv = mv[take:]
                if fill == _BOUNCE:
                    flush(fill)
        size = off + fill
        if fill:
            pad = -fill % ALIGN
            bmv[fill:fill + pad] = bytes(pad)
            flush(fill + pad)
        for f in inflight:
            f.result()
        inflight.clear()
        if off != size:
            os.ftruncate(fd, size)
        return size
    finally:
        for f in inflight:   # an error: let the writes in flight end before the memory goes
            f.exception()
        pool.shutdown(wait=True)
        bmv.release()
        bounce.close()


def write_local(path: str, chunks, *, fsync: bool, io: str | None, threads: int | None = None,
                reuse: str | None = None) -> int:
    """Write ``chunks`` to the local file ``path`` (created or truncated) in mode ``io``
    (``None``: plain buffered, no cache advice). Returns the byte count. Raises ``OSError``.

    ``reuse``: a pool directory (:data:`REUSE_DIR`); when it holds a file, that file becomes
    ``path`` and is written over in place, then truncated to the byte count."""
    mode = "plain" if io is None else resolve(io, os.path.dirname(path) or ".")
    threads = threads or _threads.get()
    reused = reuse is not None and not os.path.exists(path) and take_reusable(reuse, path)
    flags = (os.O_WRONLY | os.O_CREAT | (0 if reused else os.O_TRUNC)
             | (_O_DIRECT if mode == "direct" else 0))
    fd = os.open(path, flags, 0o644)
    try:
        if mode == "direct":
            n = write_direct(fd, chunks, threads=threads)
        else:
            n = 0
            for c in chunks:
                mv = memoryview(c).cast("B")
                while mv:
                    w = os.write(fd, mv)
                    n += w
                    mv = mv[w:]
        if reused and os.fstat(fd).st_size != n:
            os.ftruncate(fd, n)   # the old file was longer
        if fsync:
            os.fsync(fd)
        if mode == "buffered" and hasattr(os, "posix_fadvise"):
            # after fsync the pages are clean: dropping them keeps training data in the cache
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    last_mode.value = mode
    last_mode.reused = reused
    return n


last_mode = threading.local()
"""``last_mode.value``: the mode of this thread's last :func:`write_local` (``direct``,
``buffered`` or ``plain``), for callers that report it; ``last_mode.reused``: whether it wrote
over a retired file."""
