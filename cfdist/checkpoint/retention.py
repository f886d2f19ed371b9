"""Which committed checkpoints to delete. The choice is pure; :func:`apply` is its thin shell.

Rules: keep the newest ``keep`` committed checkpoints; also keep the ``keep_epoch_ends`` most
recent epoch-boundary checkpoints (``True``: all of them, ``False``/0: none); never delete the
newest committed one. Called only right after a
commit, so nothing is deleted before a newer checkpoint is safe (invariant 2). Steps numbered
above the one just committed were left by a run that rolled back past them (restore rejected
or skipped them): they are deleted too, or the next restore would pick them over newer work.
"""

from __future__ import annotations

import json
import logging
import threading

from cfdist.checkpoint.format import MANIFEST, step_dir

log = logging.getLogger("cfdist.retention")


def choose_deletions(committed: list[tuple[int, bool]], *, keep: int, keep_epoch_ends: int | bool,
                     newest: int | None = None) -> list[int]:
    """Steps to delete, given ``(step, is_epoch_end)`` of every committed checkpoint.

    ``keep_epoch_ends``: how many of the most recent epoch-end checkpoints to keep besides the
    ``keep`` newest (``True``: all). ``newest``: the step just committed; committed steps above
    it are from a rolled-back run.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    stale = [s for s, _ in committed if newest is not None and s > newest]
    steps = sorted((c for c in committed if c[0] not in stale), reverse=True)
    kept = {s for s, _ in steps[:keep]}
    ends = [s for s, ee in steps if ee]
    kept.update(ends if keep_epoch_ends is True else ends[:int(keep_epoch_ends)])
    return sorted(stale + [s for s, _ in steps if s not in kept])


# step -> is_epoch_end, per storage URL: manifests are read once per process, not at every commit.
_EPOCH_END: dict[str, dict[int, bool]] = {}
_LOCK = threading.Lock()


def _is_epoch_end(storage, step: int) -> bool:
    with _LOCK:
        known = _EPOCH_END.setdefault(storage.url, {})
        if step in known:
            return known[step]
    try:
        ee = bool(json.loads(storage.read_bytes(f"{step_dir(step)}/{MANIFEST}")).get("epoch_end"))
    except (OSError, ValueError):
        ee = False
    with _LOCK:
        known[step] = ee
    return ee


def delete_checkpoint(storages, step: int) -> None:
    """Un-commit first (the manifest goes), then the files on every root."""
    d = step_dir(step)
    storages[0].remove(f"{d}/{MANIFEST}")
    for st in storages:
        st.remove(d)
    with _LOCK:
        _EPOCH_END.get(storages[0].url, {}).pop(step, None)


def apply(storages, *, keep: int, keep_epoch_ends: int | bool, newest: int, newest_epoch_end: bool) -> list[int]:
    from cfdist.checkpoint.discovery import committed_steps

    with _LOCK:
        _EPOCH_END.setdefault(storages[0].url, {})[newest] = newest_epoch_end
    committed = [(s, _is_epoch_end(storages[0], s)) for s in committed_steps(storages[0])]
    doomed = [s for s in choose_deletions(committed, keep=keep, keep_epoch_ends=keep_epoch_ends, newest=newest)
              if s != newest]
    for s in doomed:
        try:
            delete_checkpoint(storages, s)
        except OSError as e:  # retention failing must not fail the commit that just succeeded
            log.warning("retention could not delete step %d in %s: %s", s, storages[0].url, e)
    return doomed
