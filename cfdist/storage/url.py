"""URL -> :class:`~cfdist.storage.base.Storage`, with errors that say what to install or fix.

    st = open_storage("file:///mnt/ssd/ckpt")             # or the bare absolute path
    st = open_storage("s3://bucket/run1", client_kwargs={"endpoint_url": "http://127.0.0.1:9000"})
    roots = open_storages(["file:///mnt/ssd0/ckpt", "file:///mnt/ssd1/ckpt"])   # striping
    st = open_storage("memory://test-1234")                 # tests; one process only

Local paths must be absolute: a relative path would resolve against each process's working
directory, which differs between a driver and its Ray workers.
"""

from __future__ import annotations

import os
import posixpath

import fsspec
from fsspec.registry import known_implementations, registry

from cfdist.storage import redact as _redact
from cfdist.storage.base import Storage, StorageError

# scheme -> the pip package that provides it (for the error message)
_PACKAGES = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
    "abfss": "adlfs", "adl": "adlfs", "hdfs": "pyarrow", "sftp": "paramiko", "oss": "ossfs",
}

_EXAMPLES = "'file:///abs/dir' (or '/abs/dir'), 's3://bucket/prefix' or 'memory://name'"


def _split(url: str) -> tuple[str, str]:
    """(scheme, rest) of ``url``; local paths come back absolute and normalized."""
    if "://" not in url:
        path = os.path.expanduser(url)
        if not path.startswith("/"):
            raise ValueError(
                f"storage {_redact.redact_url(url)!r} is a relative path: it would resolve differently in each "
                f"process's working directory; give an absolute path or a URL such as {_EXAMPLES}"
            )
        return "file", posixpath.normpath(path)
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme in ("file", "local"):
        if not rest.startswith("/"):
            raise ValueError(
                f"storage {_redact.redact_url(url)!r} names a relative local path: write it with three "
                f"slashes and an absolute path, e.g. 'file:///abs/{_redact.redact(rest)}'"
            )
        return "file", posixpath.normpath(rest)
    return scheme, rest


def _filesystem_class(url: str, scheme: str) -> type:
    if scheme not in known_implementations and scheme not in registry:
        raise ValueError(
            f"storage URL {url!r} has an unknown scheme {scheme!r}; use one of file, memory, s3, "
            f"gs, az, hdfs, … (fsspec.available_protocols() lists all)"
        )
    try:
        return fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        pkg = _PACKAGES.get(scheme)
        if pkg:
            need, fix = f"the package {pkg!r}", f"pip install {pkg}"
        else:
            need = f"an fsspec implementation for {scheme!r}"
            fix = known_implementations.get(scheme, {}).get("err") or "install it"
        cause = "" if str(e) == fix else f"  ({e})"
        raise ImportError(f"storage URL {url!r} needs {need}, which is not installed: {fix}{cause}") from e


def open_storage(url: str | Storage, **storage_options) -> Storage:
    """Open the storage at ``url`` (``file://``, ``memory://``, ``s3://``, ``gs://`` …).

    Creates the root directory where the filesystem has directories (so a local root that
    cannot be created fails here, with :class:`StorageError`); object stores are checked on
    first use. Raises ``ValueError`` for an unknown scheme or a relative path, and
    ``ImportError`` naming the package to install when the scheme's fsspec implementation is
    missing. ``storage_options`` go to the fsspec filesystem (credentials, ``client_kwargs``,
    …); they are never written anywhere. Credentials may also come from the environment
    (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL_S3``, …), or from the URL
    (``s3://KEY:SECRET@bucket/run``: moved into ``key``/``secret``); ``Storage.url`` never holds
    them, and every secret is scrubbed from messages (:mod:`cfdist.storage.redact`). A
    :class:`Storage` passes through.
    """
    if isinstance(url, Storage):
        return url
    if not isinstance(url, str):
        raise TypeError(f"storage must be a URL string, got {type(url).__name__}: {_redact.redact_url(repr(url))}")
    secrets = _redact.secrets_in(storage_options)
    scheme, rest = _split(url)
    url, from_url = _redact.split_credentials(scheme, url)
    if from_url:
        secrets |= {from_url["secret"], from_url["key"]}
        storage_options = {**from_url, **storage_options}
        scheme, rest = _split(url)
    _redact.register(secrets)
    shown = _redact.redact_url(url)
    cls = _filesystem_class(shown, scheme)
    try:
        fs = cls(**storage_options)
    except Exception as e:  # noqa: BLE001 - option errors come in each backend's own types
        raise ValueError(
            f"could not open the filesystem for {shown!r} with options {sorted(storage_options)}: "
            f"{type(e).__name__}: {_redact.redact(e)}; check storage_options"
        ) from None
    if scheme == "file":
        root = rest
        canon = f"file://{root}"
    else:
        root = cls._strip_protocol(url)
        if scheme == "memory" and not root.startswith("/"):
            root = "/" + root
        canon = shown.rstrip("/")
    st = Storage(canon, fs, root, scheme)
    st._secrets = frozenset(secrets)
    try:
        st.makedirs("")
    except StorageError as e:
        raise StorageError(
            e.errno, f"storage {shown!r} cannot be used: its root cannot be created ({e.strerror or e})"
        ) from e
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
