"""One small storage protocol over fsspec.

A :class:`Storage` is a root URL plus an fsspec filesystem. Every path the rest of cfdist hands it
is a ``str`` relative to the root, with ``/`` separators (never a ``pathlib.Path``: it would
collapse the ``//`` of ``s3://``). The checkpoint layer needs only these verbs:

* ``write_file(rel, chunks)`` - stream bytes into a new file, fsync it (local) before returning;
* ``write_atomic(rel, data)`` - small file, all-or-nothing (tmp + fsync + rename locally, a
  single PUT on object stores, which is atomic there);
* ``read_bytes(rel, start, end)``, ``open_read(rel)``, ``exists``, ``listdir``, ``size``;
* ``staging_dir(final)`` / ``publish(staging, final)`` - the atomic commit of a directory:
  a rename locally (``atomic_rename=True``), and on object stores the files are written under
  their final prefix and the manifest PUT written last is the commit marker;
* ``remove(rel)`` - recursive, tolerant of missing paths.

Thread-safety: one Storage may be used from several threads at once (each call opens its own
file handle); fsspec filesystems are instance-cached and thread-safe for these calls.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from typing import Iterable

import fsspec

# Object stores on which "directories" are prefixes: rename is copy + delete, not atomic.
_NO_ATOMIC_RENAME = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}


class StorageError(OSError):
    """A storage operation failed; the message names the URL and the reason."""


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

    @staticmethod
    def _is_object_like(fs: fsspec.AbstractFileSystem) -> bool:
        protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        return any(p in _NO_ATOMIC_RENAME for p in protos)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    # ---- paths -------------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        """The filesystem path of ``rel`` (relative to the root); rejects escapes from the root."""
        rel = rel.strip("/")
        if not rel:
            return self.root
        norm = posixpath.normpath(rel)
        if norm.startswith("..") or norm.startswith("/"):
            raise ValueError(f"path {rel!r} escapes the storage root {self.url}")
        return f"{self.root}/{norm}" if self.root not in ("", "/") else f"{self.root}{norm}"

    def url_of(self, rel: str = "") -> str:
        """A full URL for ``rel`` (for messages and for users)."""
        base = self.url.rstrip("/")
        return f"{base}/{rel.strip('/')}" if rel else base

    # ---- writing -----------------------------------------------------------------------------
    def write_file(self, rel: str, chunks: Iterable[bytes | memoryview], *, fsync: bool = True) -> int:
        """Write ``chunks`` to a new file ``rel`` and return the byte count.

        Locally the file is written with plain ``os`` calls and fsynced before return (when
        ``fsync``); elsewhere through fsspec, whose close() uploads the object. Blocks; call it
        from a background thread or process.
        """
        path = self.path(rel)
        n = 0
        try:
            if self.is_local:
                parent = os.path.dirname(path)
                if parent:
                    os.makedirs(parent, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    for c in chunks:
                        mv = memoryview(c).cast("B")
                        while mv:
                            w = os.write(fd, mv)
                            n += w
                            mv = mv[w:]
                    if fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            else:
                with self.fs.open(path, "wb") as f:
                    for c in chunks:
                        f.write(c)
                        n += len(memoryview(c).cast("B"))
        except OSError as e:
            raise StorageError(e.errno, f"writing {self.url_of(rel)} failed after {n} bytes: {e}") from e
        return n

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write a small file all-or-nothing: readers see the old content or the new, never half."""
        if self.is_local:
            tmp = f"{rel}.tmp-{uuid.uuid4().hex[:8]}"
            self.write_file(tmp, [data])
            try:
                os.replace(self.path(tmp), self.path(rel))
            except OSError as e:
                raise StorageError(e.errno, f"committing {self.url_of(rel)} failed: {e}") from e
            self.fsync_dir(posixpath.dirname(rel))
        else:
            self.write_file(rel, [data])

    def makedirs(self, rel: str = "") -> None:
        path = self.path(rel)
        try:
            if self.is_local:
                os.makedirs(path, exist_ok=True)
            elif self.atomic_rename:  # memory://, other hierarchical filesystems
                self.fs.makedirs(path, exist_ok=True)
            # object stores have no directories: nothing to make
        except OSError as e:
            raise StorageError(e.errno, f"creating {self.url_of(rel)} failed: {e}") from e

    def fsync_dir(self, rel: str = "") -> None:
        """Make a directory's entries (new files, renames) durable. No-op off local disks."""
        if not self.is_local:
            return
        try:
            fd = os.open(self.path(rel), os.O_RDONLY)
        except FileNotFoundError:
            return
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
        """Commit ``staging`` as ``final``: one rename, then fsync of the parent directory."""
        if staging == final:
            return
        try:
            if self.is_local:
                os.rename(self.path(staging), self.path(final))
            else:
                self.fs.mv(self.path(staging), self.path(final), recursive=True)
        except OSError as e:
            raise StorageError(e.errno, f"publishing {self.url_of(final)} failed: {e}") from e
        self.fsync_dir(posixpath.dirname(final))

    # ---- reading -----------------------------------------------------------------------------
    def read_bytes(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        path = self.path(rel)
        try:
            if self.is_local:
                with open(path, "rb") as f:
                    if start:
                        f.seek(start)
                    return f.read() if end is None else f.read(end - (start or 0))
            return self.fs.cat_file(path, start=start, end=end)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StorageError(e.errno, f"reading {self.url_of(rel)} failed: {e}") from e

    def open_read(self, rel: str):
        """A binary file object for ``rel`` (seekable)."""
        path = self.path(rel)
        if self.is_local:
            return open(path, "rb")
        return self.fs.open(path, "rb")

    def exists(self, rel: str) -> bool:
        try:
            return self.fs.exists(self.path(rel))
        except FileNotFoundError:
            return False

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) of the entries directly under ``rel``; [] if it does not exist."""
        path = self.path(rel)
        try:
            if self.is_local:
                return sorted(os.listdir(path))
            self.fs.invalidate_cache(path)
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = []
        for e in entries:
            name = e.rstrip("/").rsplit("/", 1)[-1]
            if name and name != path.rstrip("/").rsplit("/", 1)[-1] or e.rstrip("/") != path.rstrip("/"):
                names.append(name)
        return sorted(set(n for n in names if n))

    def remove(self, rel: str) -> None:
        """Delete a file or a directory tree; a missing path is not an error."""
        path = self.path(rel)
        try:
            if self.is_local:
                import shutil

                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
            else:
                if self.fs.exists(path):
                    self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(e.errno, f"removing {self.url_of(rel)} failed: {e}") from e
