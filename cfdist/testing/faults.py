"""Fault injection over a real Storage, for tests and benchmarks: slow, full, flaky, hung, torn, lagging, denied.

    slow = throttle(open_storage(url))           # pass-through until told otherwise
    ...                                          # train, checkpoint
    slow.set_factor(5.0)                         # from now on every write takes 5x as long
    disk = throttle(st, bytes_per_s=50e6)        # a 50 MB/s disk
    full = faulty(st, fail_after_bytes=1 << 20)  # ENOSPC once 1 MiB went through, partial file left
    flaky = faulty(st, fail_every_n_writes=3, errno=errno.EIO)   # every 3rd write fails
    full.heal()                                  # writes succeed again

Both wrappers are :class:`~cfdist.storage.base.Storage` objects: hand them to anything that takes
a Storage. Every verb goes to the wrapped storage, so the bytes really land on the real backend;
only ``write_file`` is altered (``write_atomic`` writes through ``write_file``, so it is altered
too). Wrappers nest: ``throttle(faulty(st), factor=3)``.

Injected errors surface exactly like real ones: the wrapped Storage raises its
:class:`~cfdist.storage.base.StorageError` (an ``OSError`` with the chosen errno, the URL and the
bytes written), and a failed write leaves what the backend leaves (a partial local or
``memory://`` file, no object on S3).

Scope: one process. Settings, switches (``set_factor``, ``heal``, ``arm``) and counters live in
this object and are thread-safe within its process. A pickled copy (sent to a writer process or
a Ray actor) starts with the settings and counters it had when pickled and then lives on its
own: switching the original does not reach it. Create the wrapper in the process that writes.
"""

from __future__ import annotations

import collections
import errno as _errno
import os
import threading
import time
from typing import Callable, Iterable, Iterator

from cfdist.storage.base import Storage

__all__ = ["StorageWrapper", "ThrottledStorage", "FaultyStorage", "FlakyStorage", "throttle", "faulty", "flaky",
           "HangingStorage", "hang", "TornStorage", "torn", "LaggingStorage", "lagging", "DeniedStorage", "denied"]


class StorageWrapper(Storage):
    """A Storage that forwards every verb to ``inner``; subclasses override what they alter.

    ``_before(verb, rel)`` runs first in every forwarded verb (a hook for counting or failing).
    """

    def __init__(self, inner: Storage):
        # Same identity as the wrapped storage; the inner one does its own first-use check.
        self.__dict__.update(url=inner.url, fs=inner.fs, root=inner.root, protocol=inner.protocol,
                             is_local=inner.is_local, atomic_rename=inner.atomic_rename,
                             _root_checked=True)
        self.inner = inner
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def _before(self, verb: str, rel: str) -> None:
        pass

    def write_file(self, rel: str, chunks: Iterable[bytes | memoryview], *, fsync: bool = True) -> int:
        self._before("write_file", rel)
        return self.inner.write_file(rel, chunks, fsync=fsync)

    def write_atomic(self, rel: str, data: bytes) -> None:
        self._before("write_atomic", rel)
        super().write_atomic(rel, data)  # through self.write_file, so wrappers apply

    def makedirs(self, rel: str = "") -> None:
        self._before("makedirs", rel)
        self.inner.makedirs(rel)

    def fsync_dir(self, rel: str = "") -> None:
        self._before("fsync_dir", rel)
        self.inner.fsync_dir(rel)

    def staging_dir(self, final: str) -> str:
        return self.inner.staging_dir(final)

    def publish(self, staging: str, final: str) -> None:
        self._before("publish", final)
        self.inner.publish(staging, final)

    def read_bytes(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        self._before("read_bytes", rel)
        return self.inner.read_bytes(rel, start, end)

    def read_private(self, rel: str) -> memoryview:
        return memoryview(bytearray(self.read_bytes(rel)))   # through read_bytes: wrappers apply

    def open_read(self, rel: str):
        self._before("open_read", rel)
        return self.inner.open_read(rel)

    def exists(self, rel: str) -> bool:
        self._before("exists", rel)
        return self.inner.exists(rel)

    def size(self, rel: str) -> int:
        self._before("size", rel)
        return self.inner.size(rel)

    def listdir(self, rel: str = "") -> list[str]:
        self._before("listdir", rel)
        return self.inner.listdir(rel)

    def remove(self, rel: str) -> None:
        self._before("remove", rel)
        self.inner.remove(rel)

    def retire(self, rel: str) -> None:
        self._before("remove", rel)
        self.inner.retire(rel)

    def drop_reuse_pool(self) -> None:
        self.inner.drop_reuse_pool()


# ---- slow disks ---------------------------------------------------------------------------------
class ThrottledStorage(StorageWrapper):
    """``write_file`` slowed by sleeping between chunks and after the last one.

    Slowdown (whichever asks for more time wins):

    * ``factor`` - each chunk (and the final fsync/upload) takes ``factor`` times what the real
      backend took: sleeps ``(factor - 1) * measured``. ``None`` or 1: no slowdown.
    * ``bytes_per_s`` - writes proceed no faster than this rate, all threads together (one
      disk's bandwidth; wrap each disk of a striped set separately).
    * ``after_bytes`` - the first ``after_bytes`` bytes written through this wrapper (over its
      whole life, all files) go at full speed, like a write cache that then fills up.

    Change either at runtime with :meth:`set_factor` / :meth:`set_bytes_per_s` (any thread);
    a write in progress picks the new value up at its next chunk. ``bytes_written`` and
    ``slept_s`` count what happened. ``clock`` and ``sleep`` are injectable for tests.
    """

    def __init__(self, inner: Storage, *, bytes_per_s: float | None = None, factor: float | None = None,
                 after_bytes: int = 0, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        super().__init__(inner)
        if after_bytes < 0:
            raise ValueError(f"throttle(after_bytes={after_bytes}): must be >= 0 (0 = from the first byte)")
        self.after_bytes = after_bytes
        self._factor: float | None = None
        self._bytes_per_s: float | None = None
        self.set_factor(factor)
        self.set_bytes_per_s(bytes_per_s)
        self._clock, self._sleep = clock, sleep
        self._free_at = float("-inf")  # when the simulated disk can take the next byte
        self.bytes_written = 0
        self.slept_s = 0.0

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        if state["_clock"] is time.perf_counter and state["_sleep"] is time.sleep:
            return state
        raise TypeError("a ThrottledStorage with an injected clock/sleep cannot be pickled")

    @property
    def factor(self) -> float | None:
        return self._factor

    @property
    def bytes_per_s(self) -> float | None:
        return self._bytes_per_s

    def set_factor(self, factor: float | None) -> None:
        """Make writes ``factor`` times slower from now on (``None`` or 1: full speed)."""
        if factor is not None and not factor >= 1:
            raise ValueError(
                f"throttle factor={factor} would speed the disk up; use a factor >= 1, or None for full speed"
            )
        with self._lock:
            self._factor = factor

    def set_bytes_per_s(self, bytes_per_s: float | None) -> None:
        """Cap the write rate from now on (``None``: no cap)."""
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"throttle bytes_per_s={bytes_per_s} must be > 0, or None for no cap")
        with self._lock:
            self._bytes_per_s = bytes_per_s

    def _extra(self, nbytes: int, seconds: float, *, tail: bool = False) -> float:
        """Seconds to sleep after the backend took ``seconds`` for ``nbytes`` (counted here).

        The rate cap is shared by all threads writing through this wrapper, like a disk's
        bandwidth: each chunk books its transfer time on one timeline (``_free_at``).
        """
        with self._lock:
            before = self.bytes_written
            if not tail:
                self.bytes_written += nbytes
            after = self.bytes_written
            factor, bps = self._factor, self._bytes_per_s
            if tail:  # fsync/upload after the last chunk: slowed once past the burst
                share = 1.0 if self.after_bytes == 0 or after > self.after_bytes else 0.0
                slow = 0
            else:
                slow = max(0, after - max(before, self.after_bytes))
                share = slow / nbytes if nbytes else 0.0
            extra = (factor - 1) * seconds * share if factor and share else 0.0
            if bps and slow:
                now = self._clock()
                start = max(self._free_at, now - seconds * share)  # when this transfer began
                self._free_at = start + slow / bps
                extra = max(extra, self._free_at - now)
        return extra

    def _pause(self, seconds: float) -> None:
        if seconds > 0:
            self._sleep(seconds)
            with self._lock:
                self.slept_s += seconds

    def _paced(self, chunks: Iterable[bytes | memoryview]) -> Iterator[memoryview]:
        for c in chunks:
            mv = memoryview(c).cast("B")
            t = self._clock()
            yield mv
            self._pause(self._extra(mv.nbytes, self._clock() - t))  # the backend took that chunk

    def write_file(self, rel: str, chunks: Iterable[bytes | memoryview], *, fsync: bool = True) -> int:
        """The wrapped ``write_file``, slowed as configured. Blocks for the extra time."""
        done: list[float | None] = [None]

        def paced() -> Iterator[memoryview]:
            yield from self._paced(chunks)
            done[0] = self._clock()

        n = self.inner.write_file(rel, paced(), fsync=fsync)
        if done[0] is not None:
            self._pause(self._extra(0, self._clock() - done[0], tail=True))
        return n


def throttle(storage: Storage, *, bytes_per_s: float | None = None, factor: float | None = None,
             after_bytes: int = 0) -> ThrottledStorage:
    """``storage`` with slowed writes; see :class:`ThrottledStorage`. One process only."""
    return ThrottledStorage(storage, bytes_per_s=bytes_per_s, factor=factor, after_bytes=after_bytes)


# ---- failing disks and links --------------------------------------------------------------------
_READS = ("read_bytes", "open_read")


class FaultyStorage(StorageWrapper):
    """Writes (and optionally reads) that fail with ``OSError(errno)`` while armed.

    * ``fail_after_bytes`` - a disk that fills up: bytes written through this wrapper since
      :meth:`arm` (all files, all threads) pass until the budget is spent; the write that
      crosses it writes up to the budget (a partial file) and fails; later writes fail at
      their first byte until :meth:`heal`. Removing files does not free the budget.
    * ``fail_every_n_writes`` - every n-th ``write_file`` call since :meth:`arm` fails before
      its first byte (a dropped connection): locally an empty file is left, on S3 nothing.
    * ``fail_every_n_reads`` - every n-th ``read_bytes``/``open_read`` call fails.

    ``calls`` counts each verb called (``write_atomic`` counts once as itself and once as the
    ``write_file`` it does), ``failures`` the injected failures, ``bytes_written`` the bytes let
    through. Thread-safe within one process.
    """

    def __init__(self, inner: Storage, *, fail_after_bytes: int | None = None,
                 fail_every_n_writes: int | None = None, fail_every_n_reads: int | None = None,
                 errno: int = _errno.ENOSPC):
        super().__init__(inner)
        self.errno = errno
        self.calls: collections.Counter[str] = collections.Counter()
        self.failures = 0
        self.bytes_written = 0
        self.arm(fail_after_bytes=fail_after_bytes, fail_every_n_writes=fail_every_n_writes,
                 fail_every_n_reads=fail_every_n_reads)

    def arm(self, *, fail_after_bytes: int | None = None, fail_every_n_writes: int | None = None,
            fail_every_n_reads: int | None = None) -> None:
        """(Re)start injecting with these settings; budgets and periods count from now."""
        if fail_after_bytes is not None and fail_after_bytes < 0:
            raise ValueError(f"faulty(fail_after_bytes={fail_after_bytes}): must be >= 0 (0 = full now)")
        for name, n in (("fail_every_n_writes", fail_every_n_writes), ("fail_every_n_reads", fail_every_n_reads)):
            if n is not None and n < 1:
                raise ValueError(f"faulty({name}={n}): must be >= 1 (1 = every call fails), or None")
        with self._lock:
            self.fail_after_bytes = fail_after_bytes
            self.fail_every_n_writes = fail_every_n_writes
            self.fail_every_n_reads = fail_every_n_reads
            self._budget = fail_after_bytes
            self._writes = 0
            self._reads = 0
            self.healed = False

    def heal(self) -> None:
        """Stop injecting failures (until the next :meth:`arm`)."""
        with self._lock:
            self.healed = True

    def _injected(self, why: str) -> OSError:
        with self._lock:
            self.failures += 1
        return OSError(self.errno, f"{os.strerror(self.errno)} (injected by cfdist.testing: {why})")

    def _before(self, verb: str, rel: str) -> None:
        with self._lock:
            self.calls[verb] += 1
            n = self.fail_every_n_reads
            if verb not in _READS or self.healed or not n:
                return
            self._reads += 1
            k = self._reads
        if k % n == 0:
            e = self._injected(f"read number {k} since arm(), fail_every_n_reads={n}")
            raise self._error("reading", rel, e) from e

    def _take(self, want: int) -> int:
        """How many of ``want`` bytes the simulated disk still accepts (reserves them)."""
        with self._lock:
            if self.healed or self._budget is None:
                allow = want
            else:
                allow = min(want, self._budget)
                self._budget -= allow
            self.bytes_written += allow
            return allow

    def _guarded(self, chunks: Iterable[bytes | memoryview], drop: int) -> Iterator[memoryview]:
        if drop:
            raise self._injected(
                f"write number {drop} since arm(), fail_every_n_writes={self.fail_every_n_writes}")
        for c in chunks:
            mv = memoryview(c).cast("B")
            allow = self._take(mv.nbytes)
            if allow:
                yield mv[:allow]
            if allow < mv.nbytes:
                raise self._injected(f"disk full after fail_after_bytes={self.fail_after_bytes}")

    def write_file(self, rel: str, chunks: Iterable[bytes | memoryview], *, fsync: bool = True) -> int:
        """The wrapped ``write_file``; raises StorageError(errno) where a fault is due."""
        self._before("write_file", rel)
        with self._lock:
            n = self.fail_every_n_writes
            drop = 0  # the number of this write when it is to fail
            if n and not self.healed:
                self._writes += 1
                drop = self._writes if self._writes % n == 0 else 0
        return self.inner.write_file(rel, self._guarded(chunks, drop), fsync=fsync)


def faulty(storage: Storage, *, fail_after_bytes: int | None = None, fail_every_n_writes: int | None = None,
           fail_every_n_reads: int | None = None, errno: int = _errno.ENOSPC) -> FaultyStorage:
    """``storage`` with injected failures; see :class:`FaultyStorage`. One process only."""
    return FaultyStorage(storage, fail_after_bytes=fail_after_bytes, fail_every_n_writes=fail_every_n_writes,
                         fail_every_n_reads=fail_every_n_reads, errno=errno)


# ---- transient read errors (a flaky NFS mount, an object store's 503) ----------------------------
class FlakyStorage(StorageWrapper):
    """The first ``failures`` calls of ``verbs`` on paths matching ``match`` fail, then all pass.

    ``match`` is an ``fnmatch`` pattern on the path relative to the root (``"step-000000040/*"``,
    ``"*.safetensors"``, ``""`` for the root's own listing). ``verbs`` default to the reads
    (``read_bytes``, ``open_read``); add ``"listdir"``/``"exists"`` for listings. Each failure is a
    :class:`~cfdist.storage.base.StorageError` with ``errno`` (default EIO), like a real one.
    ``failures=None`` fails forever (until :meth:`heal`). ``injected`` counts the failures;
    ``calls`` every matching call. Thread-safe within one process.
    """

    def __init__(self, inner: Storage, *, match: str = "*", failures: int | None = 1,
                 verbs: tuple[str, ...] = _READS, errno: int = _errno.EIO):
        super().__init__(inner)
        if failures is not None and failures < 0:
            raise ValueError(f"flaky(failures={failures}): must be >= 0, or None for every call")
        self.match, self.failures, self.verbs, self.errno = match, failures, tuple(verbs), errno
        self.injected = 0
        self.calls = 0
        self.healed = False

    def heal(self) -> None:
        """Every later call passes."""
        with self._lock:
            self.healed = True

    def _before(self, verb: str, rel: str) -> None:
        import fnmatch

        if verb not in self.verbs or not fnmatch.fnmatchcase(rel.strip("/"), self.match):
            return
        with self._lock:
            self.calls += 1
            fail = not self.healed and (self.failures is None or self.injected < self.failures)
            if fail:
                self.injected += 1
                k = self.injected
        if fail:
            e = OSError(self.errno, f"{os.strerror(self.errno)} (injected by cfdist.testing.flaky: "
                                    f"failure {k} of {self.failures} on {self.match!r})")
            raise self._error(verb.replace("_", " "), rel, e) from e


def flaky(storage: Storage, *, match: str = "*", failures: int | None = 1, verbs: tuple[str, ...] = _READS,
          errno: int = _errno.EIO) -> FlakyStorage:
    """``storage`` whose first ``failures`` matching calls fail; see :class:`FlakyStorage`."""
    return FlakyStorage(storage, match=match, failures=failures, verbs=verbs, errno=errno)


# ---- hung writes, lying disks, lagging listings, refused permissions -----------------------------
# (Storage-level faults of the write path and of listings; each class is a separate wrapper.)

class HangingStorage(StorageWrapper):
    """``write_file`` that blocks (a dead NFS server, an object store that stops answering).

    While armed, the write that carries byte ``hang_after_bytes`` (counted over all files since
    :meth:`arm`) writes up to it and then blocks until :meth:`release` - possibly forever.
    ``hung`` counts the writes blocked now, ``entered`` is set when the first one blocks;
    ``released`` writes continue where they stopped, so a test can watch what a writer that
    wakes up late does. ``only`` (a substring of the path) restricts the hang to some files.
    """

    def __init__(self, inner: Storage, *, hang_after_bytes: int | None = None, only: str | None = None):
        super().__init__(inner)
        self.entered = threading.Event()
        self._go = threading.Event()
        self.hung = 0
        self.arm(hang_after_bytes=hang_after_bytes, only=only)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        del state["entered"], state["_go"]
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.entered, self._go = threading.Event(), threading.Event()

    def arm(self, *, hang_after_bytes: int | None = 0, only: str | None = None) -> None:
        """Hang the write that reaches ``hang_after_bytes`` from now on (None: never)."""
        if hang_after_bytes is not None and hang_after_bytes < 0:
            raise ValueError(f"hang(hang_after_bytes={hang_after_bytes}): must be >= 0 (0 = the first byte)")
        with self._lock:
            self.hang_after_bytes, self.only = hang_after_bytes, only
            self._budget = hang_after_bytes
        self._go.clear()

    def release(self) -> None:
        """Let every blocked write (and later ones) proceed."""
        with self._lock:
            self._budget = None
        self._go.set()

    def _gated(self, chunks: Iterable[bytes | memoryview]) -> Iterator[memoryview]:
        for c in chunks:
            mv = memoryview(c).cast("B")
            with self._lock:
                b = self._budget
                allow = mv.nbytes if b is None else min(mv.nbytes, b)
                if b is not None:
                    self._budget = b - allow
                due = b is not None and allow < mv.nbytes   # this chunk crosses the hang point
            if allow:
                yield mv[:allow]
            if due:
                with self._lock:
                    self.hung += 1
                self.entered.set()
                self._go.wait()
                with self._lock:
                    self.hung -= 1
                yield mv[allow:]

    def write_file(self, rel: str, chunks: Iterable[bytes | memoryview], *, fsync: bool = True) -> int:
        """The wrapped ``write_file``; blocks where the hang is due (until :meth:`release`)."""
        self._before("write_file", rel)
        if self._budget is None or (self.only is not None and self.only not in rel):
            return self.inner.write_file(rel, chunks, fsync=fsync)
        return self.inner.write_file(rel, self._gated(chunks), fsync=fsync)


def hang(storage: Storage, *, hang_after_bytes: int | None = None, only: str | None = None) -> HangingStorage:
    """``storage`` whose writes block once armed; see :class:`HangingStorage`. One process only."""
    return HangingStorage(storage, hang_after_bytes=hang_after_bytes, only=only)


class TornStorage(StorageWrapper):
    """A disk that loses the tail of a file but reports the whole write (a torn write).

    While armed, the next ``writes`` ``write_file`` calls whose path contains ``only`` store only
    their first ``keep_fraction`` of bytes (at least ``keep_bytes``) and still return the full
    count, like a device whose volatile cache lost the end after a power cut. ``torn`` lists
    the paths cut. Nothing fails at write time: only a checksum or size check finds it.
    """

    def __init__(self, inner: Storage, *, writes: int = 0, keep_fraction: float = 0.5, only: str | None = None):
        super().__init__(inner)
        self.torn: list[str] = []
        self.arm(writes=writes, keep_fraction=keep_fraction, only=only)

    def arm(self, *, writes: int = 1, keep_fraction: float = 0.5, only: str | None = None) -> None:
        if writes < 0 or not 0 <= keep_fraction < 1:
            raise ValueError(f"torn(writes={writes}, keep_fraction={keep_fraction}): need writes >= 0 and "
                             f"0 <= keep_fraction < 1")
        with self._lock:
            self._left, self.keep_fraction, self.only = writes, keep_fraction, only

    def write_file(self, rel: str, chunks: Iterable[bytes | memoryview], *, fsync: bool = True) -> int:
        """The wrapped ``write_file``; a torn one stores a prefix and returns the full length."""
        self._before("write_file", rel)
        with self._lock:
            tear = self._left > 0 and (self.only is None or self.only in rel)
            if tear:
                self._left -= 1
                self.torn.append(rel)
        if not tear:
            return self.inner.write_file(rel, chunks, fsync=fsync)
        data = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
        self.inner.write_file(rel, [data[:int(len(data) * self.keep_fraction)]], fsync=fsync)
        return len(data)


def torn(storage: Storage, *, writes: int = 1, keep_fraction: float = 0.5, only: str | None = None) -> TornStorage:
    """``storage`` that silently truncates the next ``writes`` files; see :class:`TornStorage`."""
    return TornStorage(storage, writes=writes, keep_fraction=keep_fraction, only=only)


class LaggingStorage(StorageWrapper):
    """Listings that lag behind writes, as on eventually consistent object stores.

    ``listdir`` hides every entry first created through this wrapper (a file written, a
    directory published) less than ``lag_s`` seconds ago; reading, sizing and ``exists`` of a
    key see it at once (read-after-write). Entries created by others are not tracked.
    """

    def __init__(self, inner: Storage, *, lag_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__(inner)
        if not lag_s >= 0:
            raise ValueError(f"lagging(lag_s={lag_s}): must be >= 0 seconds")
        self.lag_s, self._clock = lag_s, clock
        self._born: dict[str, float] = {}
        self.hidden = 0
        """Entries a listing left out so far."""

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        if state["_clock"] is not time.monotonic:
            raise TypeError("a LaggingStorage with an injected clock cannot be pickled")
        return state

    def _note(self, rel: str) -> None:
        parts = [p for p in rel.strip("/").split("/") if p]
        now = self._clock()
        with self._lock:
            for i in range(1, len(parts) + 1):
                self._born.setdefault("/".join(parts[:i]), now)

    def write_file(self, rel: str, chunks: Iterable[bytes | memoryview], *, fsync: bool = True) -> int:
        self._note(rel)
        return super().write_file(rel, chunks, fsync=fsync)

    def publish(self, staging: str, final: str) -> None:
        super().publish(staging, final)
        self._note(final)
        with self._lock:   # what was under staging is now under final: newly listed there
            now = self._clock()
            pre = staging.strip("/") + "/"
            for k in [k for k in self._born if k.startswith(pre)]:
                self._born.setdefault(final.strip("/") + "/" + k[len(pre):], now)

    def listdir(self, rel: str = "") -> list[str]:
        names = super().listdir(rel)
        base = rel.strip("/")
        now = self._clock()
        with self._lock:
            keep = [n for n in names if now - self._born.get(f"{base}/{n}" if base else n, -1e18) >= self.lag_s]
            self.hidden += len(names) - len(keep)
        return keep


def lagging(storage: Storage, *, lag_s: float = 60.0) -> LaggingStorage:
    """``storage`` whose listings hide entries younger than ``lag_s``; see :class:`LaggingStorage`."""
    return LaggingStorage(storage, lag_s=lag_s)


class DeniedStorage(StorageWrapper):
    """Writes refused with ``EACCES`` while armed, whoever runs the process (root included,
    where ``chmod`` would not stop it): a read-only mount, a revoked credential.

    ``verbs`` (default: every writing verb) are refused before touching the backend; reads
    pass. ``denied`` counts the refusals.
    """

    WRITES = ("write_file", "write_atomic", "makedirs", "publish", "remove")

    def __init__(self, inner: Storage, *, armed: bool = False, verbs: tuple[str, ...] = WRITES,
                 errno: int = _errno.EACCES):
        super().__init__(inner)
        self.verbs, self.errno, self.armed, self.denied = tuple(verbs), errno, armed, 0

    def arm(self) -> None:
        with self._lock:
            self.armed = True

    def heal(self) -> None:
        with self._lock:
            self.armed = False

    def _before(self, verb: str, rel: str) -> None:
        with self._lock:
            if not (self.armed and verb in self.verbs):
                return
            self.denied += 1
        e = OSError(self.errno, f"{os.strerror(self.errno)} (injected by cfdist.testing)")
        raise self._error(f"{verb} of", rel, e) from e

    def write_file(self, rel: str, chunks: Iterable[bytes | memoryview], *, fsync: bool = True) -> int:
        self._before("write_file", rel)
        return self.inner.write_file(rel, chunks, fsync=fsync)


def denied(storage: Storage, *, armed: bool = True, errno: int = _errno.EACCES) -> DeniedStorage:
    """``storage`` whose writes fail with ``EACCES`` (root too); see :class:`DeniedStorage`."""
    return DeniedStorage(storage, armed=armed, errno=errno)
