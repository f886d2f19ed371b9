"""The newest committed step, known on every rank through the c10d Store.

Only the committing rank (the writer; rank 0 with ``writers="all"``/N; each node's writer under
``cfdist.fit``) sees its persists finish. It publishes the newest step it committed under the
Checkpointer's namespace (``cfdist/<n>/latest``); any other rank reads that key when it asks
for ``ckpt.latest_step`` -- one Store round trip per read, none per training step, no
collective (invariant 4).

The value is ``"none"`` (the committer found nothing committed) or a decimal step. Commits
only raise it (:func:`publish` with ``newer_only``: with one writer per node, it is the newest
step any of them committed); a restore sets it (it may roll back past newer steps). Call from the
training thread; c10d Store clients are thread-safe.
"""

from __future__ import annotations

KEY = "latest"
_NONE = b"none"
_UNSET = object()


def _encode(step: int | None) -> bytes:
    return _NONE if step is None else str(int(step)).encode()


def _decode(raw: bytes):
    """``_UNSET`` (nothing published yet), None (published: nothing committed) or the step."""
    if not raw:
        return _UNSET
    return None if raw == _NONE else int(raw)


def publish(channel, step: int | None, *, newer_only: bool) -> None:
    """Publish ``step`` as the newest committed step (committing rank only).

    ``newer_only=True`` (construction, a commit): leave a newer value another writer published
    in place (a compare-and-set loop); ``False`` (restore): overwrite. Non-blocking."""
    key, store, want = channel.key(KEY), channel.store, _encode(step)
    if not newer_only:
        store.set(key, want)
        return
    expected = b""
    while True:
        now = bytes(store.compare_set(key, expected, want))
        if now == want:
            return
        got = _decode(now)
        if got is not _UNSET and (step is None or (got is not None and got >= step)):
            return
        expected = now


def _read(channel) -> bytes:
    # compare_set with an empty expected value reads without waiting: a missing key is created
    # empty ("not published yet"), an existing one is returned unchanged
    return bytes(channel.store.compare_set(channel.key(KEY), b"", b""))


def read(channel, default: int | None) -> int | None:
    """The newest committed step the committing rank published, or ``default`` when it has
    published nothing yet (it has not finished constructing its Checkpointer). Non-blocking."""
    got = _decode(_read(channel))
    return default if got is _UNSET else got
