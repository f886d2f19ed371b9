"""Rolling back never deletes: committed checkpoints a run rolled back past are moved aside.

::

    <root>/rejected/step-000000040-3fa2c1d9e0b4a761/
      REASON.json                  # {"step", "why", "when", "when_utc", "replaced_by", "roots"} (root 0)
      step-000000040/              # the checkpoint as it was committed: MANIFEST.json, shards
    <root i>/rejected/step-000000040-3fa2c1d9e0b4a761/step-000000040/   # its shards on root i

A committed checkpoint leaves its live place only (a) through retention, when a newer checkpoint
of the same lineage committed (:mod:`cfdist.checkpoint.retention`), or (b) through this module,
when the run no longer descends from it: restore rejected it as corrupt, the user restored an
older step, or a new run committed in the same directory. In case (b) it is moved here, never
deleted; ``cfdist ls --all`` lists it and ``restore(step=...)`` / ``cfdist.load(url, step=...)``
read it when no live checkpoint has that step.

The folder name is the step and its manifest's seal, so moving the same checkpoint again after a
crash finds the same place. Order: secondary roots first, root 0 (which holds the commit) last;
locally each move is one rename, on object stores a copy (manifest last) and then the deletion
of the source (manifest first). A crash at any instant leaves every byte either in its live place
or here (or, on object stores, in both).
"""

from __future__ import annotations

import json
import logging
import time

from cfdist.checkpoint.format import MANIFEST, SEAL, step_dir
from cfdist.storage import Storage

log = logging.getLogger("cfdist.rejected")

REJECTED = "rejected"
REASON = "REASON.json"


def _tag(st: Storage, step: int) -> str:
    try:
        seal = json.loads(st.read_bytes(f"{step_dir(step)}/{MANIFEST}")).get(SEAL)
    except (ValueError, RecursionError, AttributeError):
        seal = None
    except FileNotFoundError:
        seal = None
    if not isinstance(seal, str) or not seal.isalnum():
        seal = f"unsealed{int(time.time() * 1000)}"
    return f"{step_dir(step)}-{seal[:24]}"


def _move_dir(st: Storage, src: str, dst: str) -> None:
    if not st.exists(src):
        return   # this root's part was moved by an earlier attempt (or it never held any)
    if st.atomic_rename:
        if st.exists(dst):
            raise FileExistsError(f"cannot move {st.url_of(src)} aside: {st.url_of(dst)} already exists")
        st.move(src, dst)
        return
    names = st.listdir(src)
    for n in sorted(names, key=lambda n: n == MANIFEST):   # the copy's commit last
        st.copy(f"{src}/{n}", f"{dst}/{n}")
    if MANIFEST in names:
        st.remove(f"{src}/{MANIFEST}")                    # un-commit the source first
    st.remove(src)


def move_aside(storages: list[Storage], step: int, *, why: str, replaced_by: int | None) -> str:
    """Move committed ``step`` (all its roots) to ``rejected/``; returns the new URL on root 0.

    Blocking; call from the single writer of these storages. Raises ``OSError`` if the storage
    fails (the checkpoint then stays where it was, or partly moved: still nothing deleted).
    """
    d = step_dir(step)
    dest = f"{REJECTED}/{_tag(storages[0], step)}"
    reason = {"step": step, "why": why, "when": time.time(),
              "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "replaced_by": replaced_by,
              "roots": [st.url for st in storages]}
    storages[0].write_atomic(f"{dest}/{REASON}", json.dumps(reason, indent=1).encode())
    for st in reversed(storages):    # root 0, with the commit, last
        _move_dir(st, d, f"{dest}/{d}")
    log.warning("moved step %d of %s aside to %s (not deleted): %s", step, storages[0].url,
                storages[0].url_of(dest), why)
    return storages[0].url_of(dest)


def clear_for_commit(storages: list[Storage], step: int, *, why: str) -> None:
    """Make room for a new commit of ``step``: a committed one there is moved aside, an
    uncommitted leftover (no manifest on root 0) is removed. Call from the writer, before writing."""
    d = step_dir(step)
    if not any(st.exists(d) for st in storages):
        return
    if storages[0].exists(f"{d}/{MANIFEST}"):
        move_aside(storages, step, why=why, replaced_by=step)
        return
    for st in storages:
        if st.exists(d):
            log.info("removing %s: never committed (no manifest on root 0)", st.url_of(d))
            st.remove(d)


def reason(st: Storage, tag: str) -> dict:
    """The REASON.json of a folder under ``rejected/`` (``{}`` when absent or unreadable)."""
    try:
        r = json.loads(st.read_bytes(f"{REJECTED}/{tag}/{REASON}"))
    except (OSError, ValueError, RecursionError):
        return {}
    return r if isinstance(r, dict) else {}


def find(storages: list[Storage], step: int | None = None) -> list[tuple[str, list[Storage], dict]]:
    """``(tag, storages rooted at the folder, reason)`` of each checkpoint moved aside here,
    newest step first, then most recently moved first; only ``step`` when given."""
    out = []
    for tag in storages[0].listdir(REJECTED):
        s = tag.rsplit("-", 1)[0]
        if not s.startswith("step-") or (step is not None and s != step_dir(step)):
            continue
        r = reason(storages[0], tag)
        when = r.get("when") if isinstance(r.get("when"), (int, float)) else 0.0
        out.append((s, -when, tag, [st.child(f"{REJECTED}/{tag}") for st in storages], r))
    out.sort(key=lambda x: (x[0], x[1]), reverse=False)
    out.sort(key=lambda x: x[0], reverse=True)
    return [(tag, view, r) for _, _, tag, view, r in out]
