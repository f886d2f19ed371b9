"""URL -> :class:`~cfdist.storage.base.Storage`, with errors that say what to install or fix."""

from __future__ import annotations

import os

import fsspec
from fsspec.registry import known_implementations

from cfdist.storage.base import Storage, StorageError

# scheme -> the pip package that provides it (for the error message)
_PACKAGES = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
    "abfss": "adlfs", "hdfs": "pyarrow", "sftp": "paramiko", "oss": "ossfs",
}


def _split(url: str) -> tuple[str, str]:
    if "://" not in url:
        if url.startswith("/") or url.startswith("."):
            return "file", os.path.abspath(url)
        raise ValueError(
            f"storage {url!r} is not a URL: use an fsspec URL such as 'file:///abs/dir', "
            f"'s3://bucket/prefix' or 'memory://name', or an absolute local path"
        )
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme in ("file", "local"):
        if not rest.startswith("/"):
            rest = os.path.abspath(rest)
        return "file", rest
    return scheme, rest


def open_storage(url: str | Storage, **storage_options) -> Storage:
    """Open the storage at ``url`` (``file://``, ``memory://``, ``s3://``, ``gs://`` …).

    Creates the root directory where the filesystem has directories. Raises ``ValueError`` for
    an unknown scheme and ``ImportError`` naming the package to install when the scheme's
    fsspec implementation is missing. ``storage_options`` go to the fsspec filesystem
    (credentials, endpoint_url, …); they are never written anywhere.
    """
    if isinstance(url, Storage):
        return url
    if not isinstance(url, str):
        raise TypeError(f"storage must be a URL string, got {type(url).__name__}: {url!r}")
    scheme, rest = _split(url)
    if scheme not in known_implementations and scheme not in fsspec.available_protocols():
        raise ValueError(
            f"storage URL {url!r} has an unknown scheme {scheme!r}; known: file, memory, s3, gs, "
            f"az, hdfs, … (see fsspec.available_protocols())"
        )
    try:
        cls = fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        pkg = _PACKAGES.get(scheme, f"the fsspec implementation for {scheme!r}")
        raise ImportError(
            f"storage URL {url!r} needs the package {pkg!r}: pip install {pkg}  ({e})"
        ) from e
    try:
        fs = cls(**storage_options)
    except Exception as e:  # credential / option errors from the backend
        raise ValueError(f"could not open the filesystem for {url!r}: {e}") from e
    root = rest if scheme == "file" else cls._strip_protocol(url)
    if scheme == "memory" and not root.startswith("/"):
        root = "/" + root
    canon = f"file://{root}" if scheme == "file" else url.rstrip("/")
    st = Storage(canon, fs, root, scheme)
    try:
        st.makedirs("")
    except StorageError as e:
        raise StorageError(e.errno, f"storage {url!r} is not writable: {e}") from e
    return st


def open_storages(urls: str | Storage | list | tuple, **storage_options) -> list[Storage]:
    """One URL or several (striping over disks): always a non-empty list of Storage."""
    if isinstance(urls, (str, Storage)):
        urls = [urls]
    urls = list(urls)
    if not urls:
        raise ValueError("storage must name at least one URL")
    out = [open_storage(u, **storage_options) for u in urls]
    seen = set()
    for s in out:
        if s.url in seen:
            raise ValueError(f"storage URL {s.url!r} is listed twice; give each disk once")
        seen.add(s.url)
    return out
