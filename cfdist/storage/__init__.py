"""Storage: URL -> fsspec filesystem, atomic commit, fsync, striping, O_DIRECT. Knows nothing of checkpoints.

Fault-injecting wrappers for tests live in :mod:`cfdist.testing`.
"""

from cfdist.storage.base import Storage, StorageError
from cfdist.storage.url import open_storage, open_storages

__all__ = ["Storage", "StorageError", "open_storage", "open_storages"]
