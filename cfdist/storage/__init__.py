"""Storage: URL -> fsspec filesystem, atomic commit, fsync, test wrappers. Knows nothing of checkpoints."""

from cfdist.storage.base import Storage, StorageError
from cfdist.storage.url import open_storage, open_storages

__all__ = ["Storage", "StorageError", "open_storage", "open_storages"]
