"""One small storage protocol over fsspec.

A :class:`Storage` is a root URL plus an fsspec filesystem. Every path the rest of cfdist hands it
is a ``str`` relative to the root, with ``/`` separators (never a ``pathlib.Path``: it would
collapse the ``//`` of ``s3://``). The checkpoint layer needs only these verbs:

* ``write_file(rel, chunks)`` - stream bytes into a new file, fsync it (local) before returning;
* ``write_atomic(rel, data)`` - small file, all-or-nothing (tmp + fsync + rename where rename
  is atomic, a single PUT on object stores, which is atomic there);
* ``read_bytes(rel, start, end)``, ``open_read(rel)``, ``exists``, ``listdir``, ``size``;
* ``staging_dir(final)`` / ``publish(staging, final)`` - the atomic commit of a directory:
  a rename locally (``atomic_rename=True``), and on object stores the files are written under
  their final prefix and the manifest PUT written last is the commit marker;
* ``remove(rel)`` - recursive, tolerant of missing paths;
* ``move(src, dst)`` / ``copy(src, dst)`` - set a directory (a file) aside under another name;
* ``child(rel)`` - the Storage rooted at a subdirectory (same filesystem, same options).

Errors: a path that escapes the root raises ``ValueError``; a missing file raises
``FileNotFoundError``; every other failure raises :class:`StorageError` (an ``OSError`` that keeps
the errno) whose message names the URL, the reason and, where known, the fix. On object stores
the first call checks that the bucket answers, so a wrong endpoint or a missing bucket fails
loudly instead of looking like an empty listing.

Thread-safety: one Storage may be used from several threads at once (each call opens its own
file handle); fsspec filesystems are instance-cached and thread-safe for these calls. A Storage
pickles (to a writer process, a Ray actor); ``memory://`` contents do not cross processes.
"""

from __future__ import annotations

import errno as _errno
import os
import posixpath
import shutil
import sys
import uuid
from typing import Iterable

import fsspec
from fsspec.spec import AbstractBufferedFile

from cfdist.storage import direct

# Object stores on which "directories" are prefixes: rename is copy + delete, not atomic.
_NO_ATOMIC_RENAME = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}

_HINTS = {
    _errno.ENOSPC: "free space on that disk or point the storage at another root",
    _errno.EDQUOT: "the disk quota is exhausted: free space or use another root",
    _errno.EACCES: "check the permissions of the directory (or the credentials)",
    _errno.EPERM: "check the permissions of the directory (or the credentials)",
    _errno.EROFS: "the filesystem is read-only: pick a writable root",
    _errno.ENOTDIR: "a regular file is in the way of that directory: fix the URL",
    _errno.EEXIST: "something already exists there: remove it first",
}


class StorageError(OSError):
    """A storage operation failed; the message names the URL, the reason and the fix."""


def _backend_errors() -> tuple[type[BaseException], ...]:
    """The exception types a backend raises for I/O failures (botocore's are not OSErrors).

    Looked up in ``sys.modules`` at call time so that importing cfdist imports no SDK.
    """
    errs: list[type[BaseException]] = [OSError]
    boto = sys.modules.get("botocore.exceptions")
    if boto is not None:
        errs += [boto.BotoCoreError, boto.ClientError]
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        errs.append(aiohttp.ClientError)
    return tuple(errs)


def _abandon(f) -> None:
    """Drop a half-written fsspec file without committing it where the backend allows.

    Object stores abort the upload (no truncated object appears under the final name); a file
    on a hierarchical filesystem (``memory://``) keeps what was written, like a local file.
    """
    try:
        f.discard()  # S3File: abort the multipart upload and drop the buffer
    except Exception:  # noqa: BLE001 - best effort; the original error is what matters
        pass
    if isinstance(f, AbstractBufferedFile):
        f.closed = True  # close() would flush, i.e. upload, the partial buffer
    else:
        f.close()


class Storage:
    """A root URL and its fsspec filesystem.

    Build one with :func:`cfdist.storage.open_storage`; do not call this constructor with a
    filesystem you made yourself unless you know its root is already created.
    """

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, root: str, protocol: str):
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.protocol = protocol
        self.is_local = protocol in ("file", "local")
        self.atomic_rename = protocol not in _NO_ATOMIC_RENAME and not self._is_object_like(fs)
        self._secrets: frozenset[str] = frozenset()   # set by open_storage; scrubbed from messages
        # Object stores create nothing at open time: check the bucket on first use instead.
        self._root_checked = self.atomic_rename

    @staticmethod
    def _is_object_like(fs: fsspec.AbstractFileSystem) -> bool:
        protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        return any(p in _NO_ATOMIC_RENAME for p in protos)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    # ---- paths and errors --------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        """The filesystem path of ``rel`` (relative to the root); rejects escapes from the root."""
        rel = rel.strip("/")
        if not rel:
            return self.root
        norm = posixpath.normpath(rel)
        if norm == ".." or norm.startswith("../"):
            raise ValueError(
                f"path {rel!r} escapes the storage root {self.url}; give a path inside the root"
            )
        if norm == ".":
            return self.root
        return f"{self.root}/{norm}" if self.root not in ("", "/") else f"{self.root}{norm}"

    def url_of(self, rel: str = "") -> str:
        """A full URL for ``rel`` (for messages and for users)."""
        base = self.url.rstrip("/")
        return f"{base}/{rel.strip('/')}" if rel.strip("/") else base

    def _error(self, doing: str, rel: str, e: BaseException, *, after: int | None = None) -> StorageError:
        code = getattr(e, "errno", None)
        reason = str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        done = f" after {after} bytes" if after is not None else ""
        hint = _HINTS.get(code) if isinstance(code, int) else None
        msg = f"{doing} {self.url_of(rel)} failed{done}: {reason}" + (f"; {hint}" if hint else "")
        if getattr(self, "_secrets", None) or "@" in msg:
            from cfdist.storage.redact import redact

            msg = redact(msg, getattr(self, "_secrets", frozenset()))   # a backend's message may quote one
        return StorageError(code, msg) if isinstance(code, int) else StorageError(msg)

    def _ready(self) -> None:
        """Object stores: on first use, check that the bucket answers (once per instance)."""
        if self._root_checked:
            return
        bucket = self.root.split("/", 1)[0]
        where = f"storage {self.url}"
        try:
            self.fs.info(bucket)
        except FileNotFoundError as e:
            raise StorageError(
                _errno.ENOENT, f"{where}: bucket {bucket!r} does not exist ({e}); create it or fix the URL"
            ) from e
        except PermissionError as e:
            raise StorageError(
                _errno.EACCES, f"{where}: access to bucket {bucket!r} denied ({e}); check the credentials "
                f"(storage_options key/secret, or the AWS_* environment variables)"
            ) from e
        except Exception as e:  # noqa: BLE001 - connection refused, DNS, timeouts: SDK-specific types
            raise StorageError(
                f"{where} is unreachable ({type(e).__name__}: {e}); check the endpoint "
                f"(storage_options client_kwargs={{'endpoint_url': ...}} or AWS_ENDPOINT_URL_S3), "
                f"the network and the credentials"
            ) from e
        self._root_checked = True

    def _remote(self, rel: str) -> str:
        """Path of ``rel`` on a non-local backend, after the first-use check, with a fresh cache.

        s3fs caches listings per filesystem instance; another process may have written since.
        """
        path = self.path(rel)
        self._ready()
        self.fs.invalidate_cache(path)
        return path

    # ---- writing -----------------------------------------------------------------------------
    def write_file(self, rel: str, chunks: Iterable[bytes | memoryview], *, fsync: bool = True) -> int:
        """Write ``chunks`` to a new file ``rel`` (replacing any) and return the byte count.

        Locally the file is written with plain ``os`` calls and fsynced before return (when
        ``fsync``); parent directories are created; inside :func:`cfdist.storage.direct.io_mode`
        with ``O_DIRECT`` or with the pages dropped from the cache after fsync. Elsewhere through fsspec, whose close()
        uploads the object; if writing fails midway, an object store gets no object at all,
        a local or ``memory://`` file keeps the bytes written so far. Blocks; call it from a
        background thread or process. Errors raised by ``chunks`` itself propagate unchanged
        unless they are OSErrors.
        """
        path = self.path(rel) if self.is_local else self._remote(rel)
        n = 0
        try:
            if self.is_local:
                parent = os.path.dirname(path)
                if parent:
                    os.makedirs(parent, exist_ok=True)
                done = [0]   # bytes handed to the file so far (for the error message)

                def counted():
                    for c in chunks:
                        mv = memoryview(c).cast("B")
                        yield mv
                        done[0] += mv.nbytes

                try:
                    n = direct.write_local(path, counted(), fsync=fsync, io=direct.current_mode(),
                                           reuse=self.path(direct.REUSE_DIR) if direct.current_reuse() else None)
                except BaseException:
                    n = done[0]
                    raise
            else:
                f = self.fs.open(path, "wb")
                try:
                    for c in chunks:
                        mv = memoryview(c).cast("B")
                        f.write(mv)
                        n += mv.nbytes
                except BaseException:
                    _abandon(f)
                    raise
                f.close()
        except _backend_errors() as e:
            raise self._error("writing", rel, e, after=n) from e
        return n

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write a small file all-or-nothing: readers see the old content or the new, never half.

        With atomic rename (local, ``memory://``): a unique tmp sibling, fsync, rename, fsync of
        the directory; the tmp file is removed if anything fails. Object stores: one PUT.
        """
        if not self.atomic_rename:
            self.write_file(rel, [data])
            return
        tmp = f"{rel.strip('/')}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.write_file(tmp, [data])
            try:
                if self.is_local:
                    os.replace(self.path(tmp), self.path(rel))
                else:
                    self.fs.mv(self.path(tmp), self.path(rel))
            except _backend_errors() as e:
                raise self._error("committing", rel, e) from e
        except BaseException:
            try:
                if self.is_local:
                    os.remove(self.path(tmp))
                else:
                    self.fs.rm(self.path(tmp))
            except Exception:  # noqa: BLE001 - best effort; the original error is what matters
                pass
            raise
        self.fsync_dir(posixpath.dirname(rel.strip("/")))

    def makedirs(self, rel: str = "") -> None:
        """Create directory ``rel`` and its parents; nothing to do on object stores."""
        path = self.path(rel)
        try:
            if self.is_local:
                os.makedirs(path, exist_ok=True)
            elif self.atomic_rename:  # memory://, other hierarchical filesystems
                self.fs.makedirs(path, exist_ok=True)
        except _backend_errors() as e:
            raise self._error("creating", rel, e) from e

    def fsync_dir(self, rel: str = "") -> None:
        """Make a directory's entries (new files, renames) durable. No-op off local disks."""
        if not self.is_local:
            return
        try:
            fd = os.open(self.path(rel), os.O_RDONLY)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._error("syncing", rel, e) from e
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def staging_dir(self, final: str) -> str:
        """Where to write the files of directory ``final`` before :meth:`publish`.

        With atomic rename: a unique ``<final>.tmp-<id>`` sibling, invisible to discovery. On
        object stores: ``final`` itself (the manifest written last is the commit marker).
        """
        if self.atomic_rename:
            return f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        return final

    def publish(self, staging: str, final: str) -> None:
        """Commit ``staging`` (from :meth:`staging_dir`) as ``final``.

        Locally: fsync of ``staging`` (its new entries), one rename, fsync of the parent.
        ``final`` must not exist yet (StorageError with EEXIST otherwise: remove the leftover
        first). A no-op when ``staging == final`` (object stores). Blocks.
        """
        if staging == final:
            return
        self.path(final)  # reject escapes before touching anything
        if self.exists(final):
            raise self._error(
                "publishing", final, FileExistsError(_errno.EEXIST, f"{self.url_of(final)} already exists")
            )
        try:
            if self.is_local:
                self.fsync_dir(staging)
                os.rename(self.path(staging), self.path(final))
            else:
                self.fs.mv(self._remote(staging), self._remote(final), recursive=True)
        except _backend_errors() as e:
            raise self._error("publishing", final, e) from e
        self.fsync_dir(posixpath.dirname(final.strip("/")))

    # ---- reading -----------------------------------------------------------------------------
    def read_bytes(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of file ``rel``, clamped to the file like a slice.

        ``start``/``end`` are non-negative offsets (``None``: from the beginning / to the end).
        Raises ``FileNotFoundError`` for a missing file, ``StorageError`` otherwise.
        """
        for name, v in (("start", start), ("end", end)):
            if v is not None and v < 0:
                raise ValueError(f"read_bytes({rel!r}) got {name}={v}; offsets must be >= 0")
        lo = start or 0
        if end is not None and end <= lo:
            return b""
        path = self.path(rel) if self.is_local else self._remote(rel)
        try:
            if self.is_local:
                with open(path, "rb") as f:
                    f.seek(lo)
                    return f.read() if end is None else f.read(end - lo)
            try:
                return self.fs.cat_file(path, start=start, end=end)
            except FileNotFoundError:
                raise
            except OSError:
                # S3 answers 416 for a range starting past the end; a slice gives b"" there.
                if lo and self.fs.size(path) <= lo:
                    return b""
                raise
        except FileNotFoundError:
            raise
        except _backend_errors() as e:
            raise self._error("reading", rel, e) from e

    def read_private(self, rel: str) -> memoryview:
        """The whole of file ``rel`` in a writable buffer of this process's own memory, read with
        one copy (``readinto`` locally; elsewhere :meth:`read_bytes` in a ``bytearray``).

        Restore's read. Never a memory map of the file: retention hands a deleted checkpoint's
        files to the next persist, which writes over them in place (:meth:`retire`); tensors
        built on a map would change under the training state, or fault (SIGBUS) once the file
        shrank. Errors as :meth:`read_bytes`."""
        if not self.is_local:
            return memoryview(bytearray(self.read_bytes(rel)))
        try:
            with open(self.path(rel), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)
                mv, got = memoryview(buf), 0
                while got < size:
                    n = f.readinto(mv[got:])
                    if not n:
                        break   # shrank while read: the caller's size checks report it
                    got += n
                return mv[:got]
        except FileNotFoundError:
            raise
        except _backend_errors() as e:
            raise self._error("reading", rel, e) from e

    def open_read(self, rel: str):
        """A binary, seekable file object for ``rel``; close it (use ``with``)."""
        path = self.path(rel) if self.is_local else self._remote(rel)
        try:
            return open(path, "rb") if self.is_local else self.fs.open(path, "rb")
        except FileNotFoundError:
            raise
        except _backend_errors() as e:
            raise self._error("opening", rel, e) from e

    def exists(self, rel: str) -> bool:
        """Whether a file or directory ``rel`` exists (never stale from a listing cache)."""
        if self.is_local:
            return os.path.exists(self.path(rel))
        path = self._remote(rel)
        try:
            return bool(self.fs.exists(path))
        except FileNotFoundError:
            return False
        except _backend_errors() as e:
            raise self._error("checking", rel, e) from e

    def size(self, rel: str) -> int:
        """Size in bytes of file ``rel``; ``FileNotFoundError`` if missing."""
        path = self.path(rel) if self.is_local else self._remote(rel)
        try:
            return os.path.getsize(path) if self.is_local else int(self.fs.size(path))
        except FileNotFoundError:
            raise
        except _backend_errors() as e:
            raise self._error("sizing", rel, e) from e

    def listdir(self, rel: str = "") -> list[str]:
        """Sorted names (not paths) of the entries directly under ``rel``.

        ``[]`` when ``rel`` does not exist or is a file.
        """
        path = self.path(rel) if self.is_local else self._remote(rel)
        try:
            if self.is_local:
                return sorted(os.listdir(path))
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except _backend_errors() as e:
            raise self._error("listing", rel, e) from e
        # fsspec returns full paths ("bucket/prefix/name", "/root/name"); a file lists itself.
        prefix = path.rstrip("/") + "/"
        names = {e.rstrip("/")[len(prefix):] for e in entries if e.startswith(prefix)}
        return sorted(n for n in names if n and "/" not in n)

    def move(self, src: str, dst: str) -> None:
        """Rename file or directory ``src`` to ``dst`` (parents created; ``dst`` must not exist).

        Atomic where rename is (local, ``memory://``): a rename, then fsync of both parents. On
        object stores every object is copied, then the source deleted (not atomic: a crash can
        leave both; callers order their moves so that either is safe). Blocks.
        """
        self.path(src), self.path(dst)  # reject escapes before touching anything
        if self.exists(dst):
            raise self._error("moving to", dst, FileExistsError(_errno.EEXIST, f"{self.url_of(dst)} already exists"))
        parent = posixpath.dirname(dst.strip("/"))
        try:
            if self.is_local:
                os.makedirs(self.path(parent), exist_ok=True)
                os.rename(self.path(src), self.path(dst))
            elif self.atomic_rename:
                self.fs.makedirs(self.path(parent), exist_ok=True)
                self.fs.mv(self.path(src), self.path(dst), recursive=True)
            else:
                self.fs.copy(self._remote(src), self._remote(dst), recursive=True)
                self.fs.rm(self._remote(src), recursive=True)
        except FileNotFoundError:
            raise
        except _backend_errors() as e:
            raise self._error("moving", f"{src} to {self.url_of(dst)}", e) from e
        self.fsync_dir(parent)
        self.fsync_dir(posixpath.dirname(src.strip("/")))

    def copy(self, src: str, dst: str) -> None:
        """Copy file ``src`` to ``dst`` (replacing it) on the same storage, server-side where the
        backend can. For setting checkpoints aside on object stores; blocks."""
        try:
            if self.is_local:
                os.makedirs(os.path.dirname(self.path(dst)), exist_ok=True)
                shutil.copyfile(self.path(src), self.path(dst))
            else:
                self.fs.copy(self._remote(src), self._remote(dst))
        except FileNotFoundError:
            raise
        except _backend_errors() as e:
            raise self._error("copying", f"{src} to {self.url_of(dst)}", e) from e

    def child(self, rel: str) -> "Storage":
        """The Storage rooted at directory ``rel`` of this one (same filesystem and options).

        Wrappers (faults, throttling) do not carry over to the child.
        """
        st = Storage(self.url_of(rel), self.fs, self.path(rel), self.protocol)
        st.__dict__.update({k: v for k, v in self.__dict__.items() if k == "_secrets"})
        return st

    def retire(self, rel: str) -> None:
        """Delete directory ``rel`` (a deleted checkpoint's files); on a local root its files go
        to the root's reuse pool (:func:`cfdist.storage.direct.retire_dir`) for the next persist
        to write over. Elsewhere, or for a missing path: :meth:`remove`."""
        if not self.is_local:
            return self.remove(rel)
        try:
            direct.retire_dir(self.path(rel), self.path(direct.REUSE_DIR))
        except OSError as e:
            raise self._error("removing", rel, e) from e

    def drop_reuse_pool(self) -> None:
        """Delete the root's reuse pool (a Checkpointer's start and close)."""
        if self.is_local:
            self.remove(direct.REUSE_DIR)

    def remove(self, rel: str) -> None:
        """Delete a file or a directory tree; a missing path is not an error."""
        path = self.path(rel) if self.is_local else self._remote(rel)
        try:
            if self.is_local:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            elif self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        except _backend_errors() as e:
            raise self._error("removing", rel, e) from e
