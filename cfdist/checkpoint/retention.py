"""Which committed checkpoints to delete. The choice is pure; :func:`apply` is its thin shell.

Rules: keep the newest ``keep`` committed checkpoints; keep epoch-boundary checkpoints unless
``keep_epoch_ends=False``; never delete the newest committed one. Called only right after a
commit, so nothing is deleted before a newer checkpoint is safe (invariant 2). Steps numbered
above the one just committed were left by a run that rolled back past them (restore rejected
or skipped them): they are deleted too, or the next restore would pick them over newer work.
A checkpoint that a kept one depends on (the base and increments of a ``cfdist.codecs`` chain,
listed in its manifest's ``depends_on``) is kept as long as that one is.
"""

from __future__ import annotations

import json
import logging
import threading

from cfdist.checkpoint.format import MANIFEST, step_dir

log = logging.getLogger("cfdist.retention")


def choose_deletions(committed: list[tuple[int, bool]], *, keep: int, keep_epoch_ends: bool,
                     newest: int | None = None, depends: dict[int, list[int]] | None = None) -> list[int]:
    """Steps to delete, given ``(step, is_epoch_end)`` of every committed checkpoint.

    ``newest``: the step just committed; committed steps above it are from a rolled-back run.
    ``depends``: step -> the steps it needs to be restored (never deleted while it is kept).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    stale = [s for s, _ in committed if newest is not None and s > newest]
    steps = sorted((c for c in committed if c[0] not in stale), reverse=True)
    kept_newest = {s for s, _ in steps[:keep]}
    doomed = [s for s, ee in steps if s not in kept_newest and not (keep_epoch_ends and ee)]
    kept = {s for s, _ in steps} - set(doomed)
    needed = {d for s in kept for d in (depends or {}).get(s, ())}
    return sorted(stale + [s for s in doomed if s not in needed])


# step -> (is_epoch_end, steps it depends on), per storage URL: manifests are read once per
# process, not at every commit.
_EPOCH_END: dict[str, dict[int, tuple[bool, list[int]]]] = {}
_LOCK = threading.Lock()


def _facts(storage, step: int) -> tuple[bool, list[int]]:
    with _LOCK:
        known = _EPOCH_END.setdefault(storage.url, {})
        if step in known:
            return known[step]
    try:
        m = json.loads(storage.read_bytes(f"{step_dir(step)}/{MANIFEST}"))
        facts = bool(m.get("epoch_end")), [int(d[0]) for d in m.get("depends_on", ())]
    except (OSError, ValueError, TypeError, IndexError):
        facts = False, []
    with _LOCK:
        known[step] = facts
    return facts


def delete_checkpoint(storages, step: int) -> None:
    """Un-commit first (the manifest goes), then the files on every root."""
    d = step_dir(step)
    storages[0].remove(f"{d}/{MANIFEST}")
    for st in storages:
        st.remove(d)
    with _LOCK:
        _EPOCH_END.get(storages[0].url, {}).pop(step, None)


def apply(storages, *, keep: int, keep_epoch_ends: bool, newest: int, newest_epoch_end: bool) -> list[int]:
    from cfdist.checkpoint.discovery import committed_steps

    facts = {s: _facts(storages[0], s) for s in committed_steps(storages[0])}
    if newest in facts:
        facts[newest] = (newest_epoch_end, facts[newest][1])
    committed = [(s, ee) for s, (ee, _) in facts.items()]
    doomed = [s for s in choose_deletions(committed, keep=keep, keep_epoch_ends=keep_epoch_ends, newest=newest,
                                          depends={s: deps for s, (_, deps) in facts.items()})
              if s != newest]
    for s in doomed:
        try:
            delete_checkpoint(storages, s)
        except OSError as e:  # retention failing must not fail the commit that just succeeded
            log.warning("retention could not delete step %d in %s: %s", s, storages[0].url, e)
    return doomed
