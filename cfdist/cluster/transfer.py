"""Move one committed checkpoint between tiers or nodes as frozen bytes.

A checkpoint is *frozen* by reading its files into memory (:func:`freeze`), which takes
milliseconds from /dev/shm; it can then be shipped to another node's actor through Ray and
committed there with the engine's own protocol (:func:`cfdist.checkpoint.discovery.copy_checkpoint`:
shards first, manifest last, atomic publish), while the source tier is free to move on.
Checksums are not re-computed here: the restore verifies every tensor.

Call from a node actor (any thread); nothing here talks to Ray.
"""

from __future__ import annotations

from cfdist.checkpoint import rejected, retention
from cfdist.checkpoint.discovery import copy_checkpoint
from cfdist.checkpoint.format import MANIFEST, CheckpointError, step_dir
from cfdist.checkpoint.reader import is_committed, read_manifest
from cfdist.storage import Storage

Frozen = list[dict[str, bytes]]
"""One ``{relative path: bytes}`` per root of the source storage list (picklable)."""


class FrozenRoot:
    """A read-only, in-memory stand-in for one :class:`Storage` root (what ``copy_checkpoint``
    and ``read_manifest`` read from)."""

    def __init__(self, files: dict[str, bytes], url: str):
        self.files = files
        self.url = url

    def read_bytes(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            data = self.files[rel.strip("/")]
        except KeyError:
            raise FileNotFoundError(f"{self.url}/{rel} is not part of the frozen checkpoint") from None
        return data[start or 0:end] if (start or end is not None) else data

    def exists(self, rel: str) -> bool:
        return rel.strip("/") in self.files

    def url_of(self, rel: str = "") -> str:
        return f"{self.url}/{rel.strip('/')}" if rel else self.url


def freeze(storages: list[Storage], step: int) -> Frozen:
    """Read the manifest and shards of committed ``step`` into memory (blocking).

    Raises ``CheckpointError``/``FileNotFoundError`` if the step is not (or no longer) committed.
    """
    out: Frozen = [{} for _ in storages]
    m = read_manifest(storages, step)
    for s in [step] + [d[0] for d in m.get("depends_on", ())]:   # a codec chain travels whole
        d = step_dir(s)
        out[0][f"{d}/{MANIFEST}"] = storages[0].read_bytes(f"{d}/{MANIFEST}")
        for sh in (m if s == step else read_manifest(storages, s))["shards"]:
            rel = f"{d}/{sh['file']}"
            out[sh["root"]][rel] = storages[sh["root"]].read_bytes(rel)
    return out


def nbytes(frozen: Frozen) -> int:
    return sum(len(b) for root in frozen for b in root.values())


def _sums(m: dict) -> dict:
    return {k: t.get("xxh3") for k, t in m["tensors"].items()}


def holds_same(dst: list[Storage], step: int, manifest: dict) -> bool:
    """Whether ``dst`` has committed this very checkpoint of ``step`` (``manifest``: the
    source's), as a whole copy or as slices uploaded by several nodes (same time and checksums,
    or, sliced, the same ``source_time``), or the same state written by another writer of the
    job (another node's copy: same lineage, tensor checksums and RNG states). A copy of the
    same state is not a different checkpoint: it is neither rewritten nor moved aside."""
    if not is_committed(dst[0], step):   # by key: a lagging listing may hide it
        return False
    try:
        here = read_manifest(dst, step)
    except CheckpointError:
        return False
    return ((here.get("time"), _sums(here)) == (manifest.get("time"), _sums(manifest))
            or (here.get("split") is not None and here.get("source_time") == manifest.get("time"))
            or _same_state(here, manifest))


def _same_state(a: dict, b: dict) -> bool:
    """Two manifests of one step that hold the same state: the same lineage (the same job's
    history), the same tensors and checksums, the same RNG states and data position."""
    keys = ("lineage", "rng", "rngs", "late", "epoch", "epoch_end")
    return (a.get("lineage") is not None and all(a.get(k) == b.get(k) for k in keys)
            and _sums(a) == _sums(b) and None not in _sums(a).values())


def commit_frozen(frozen: Frozen, step: int, dst: list[Storage], *, source: str, keep: int) -> bool:
    """Commit a frozen checkpoint into ``dst`` (blocking); then apply retention there.

    Returns False (and writes nothing) when ``dst`` already holds this very checkpoint, or the
    same state from another writer of the job (:func:`holds_same`). A
    different checkpoint of the same step there (from a run that rolled back past it) is moved
    aside to ``rejected/``; a leftover uncommitted directory of the same step is removed.
    """
    if holds_same(dst, step, read_manifest([FrozenRoot(f, f"{source}#root{i}") for i, f in enumerate(frozen)], step)):
        return False
    rejected.clear_for_commit(dst, step, why=f"a different checkpoint of step {step} arrived from {source} "
                                             f"(the run rolled back past this one)")
    copy_checkpoint([FrozenRoot(f, f"{source}#root{i}") for i, f in enumerate(frozen)], step, dst)
    retention.apply(dst, keep=keep, keep_epoch_ends=False, newest=step, newest_epoch_end=False)
    return True
