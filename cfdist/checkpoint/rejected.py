"""Rolling back never deletes: committed checkpoints a run rolled back past are moved aside.

``rejected/`` is bounded: the newest few entries stay, and any entry that is the only copy of a
step the run has not reached again.

::

    <root>/rejected/step-000000040-3fa2c1d9e0b4a761/
      REASON.json                  # {"step", "why", "when", "when_utc", "replaced_by", "roots"} (root 0)
      step-000000040/              # the checkpoint as it was committed: MANIFEST.json, shards
    <root i>/rejected/step-000000040-3fa2c1d9e0b4a761/step-000000040/   # its shards on root i

A committed checkpoint leaves its live place only (a) through retention, when a newer checkpoint
of the same lineage committed (:mod:`cfdist.checkpoint.retention`), or (b) through this module,
when the run no longer descends from it: restore rejected it as corrupt, the user restored an
older step, or a new run committed in the same directory. In case (b) it is moved here, not
deleted (only :func:`prune` deletes here, see below); ``cfdist ls --all`` lists it and
``restore(step=...)`` / ``cfdist.load(url, step=...)`` read it when no live checkpoint has that
step.

**Under** ``cfdist.fit``. A recovery moves nothing aside when every node restores the step
the controller chose: the newest step some node holds, copied to the others (peer copy or
shared tier). What still lands here is a real rollback: a checkpoint committed after the
controller chose an older step (a persist that finished late on one node), or one that
failed verification. Until issue 19 each recovery moved 2-3 checkpoints per node here: every
writer (one per node) drew its own lineage, so a node that restored another node's copy took
that node's lineage and its own older checkpoints looked like another run's (moved aside at its
next commit, in its memory and its local tier), and the shared tier moved aside each upload of
the previous uploading node. One lineage per job
(:func:`cfdist.checkpoint.retention.job_lineage`) ended that.

**Bounded.** After each move, :func:`prune` keeps the :data:`KEEP` most recently moved
entries of the storage (and, given ``max_bytes``, no more bytes than that), and deletes older
ones unless an entry is the only copy of its step that is still ahead of the run: no live
checkpoint there reaches its step and no other entry staying holds it (:func:`choose_prune`).

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
from dataclasses import dataclass
from typing import Iterable

from cfdist.checkpoint.format import MANIFEST, SEAL, parse_step_dir, step_dir
from cfdist.checkpoint.reader import committed_steps
from cfdist.storage import Storage

log = logging.getLogger("cfdist.rejected")

REJECTED = "rejected"
REASON = "REASON.json"
KEEP = 8
"""How many of the most recently moved entries of ``rejected/`` (per storage) :func:`prune`
keeps in any case; older ones stay only as the only copy of a step ahead of the run."""


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
    prune(storages, keep=KEEP)
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


# ---- bounding rejected/ ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Entry:
    """One checkpoint under ``rejected/``, as :func:`choose_prune` sees it."""

    tag: str
    step: int
    when: float
    """When it was moved aside (its REASON.json; 0.0 when unknown: the oldest)."""
    nbytes: int = 0
    """Its size (the manifest's ``bytes_stored`` or ``bytes``); only read when a byte bound is set."""


def choose_prune(entries: Iterable[Entry], *, live: Iterable[int], keep: int = KEEP,
                 max_bytes: int | None = None) -> list[str]:
    """The tags of ``entries`` to delete (pure), most recently moved first.

    Walking from the most recently moved: the first ``keep`` entries stay while their total
    stays within ``max_bytes`` (None: no byte bound); from the first one past either bound on,
    an entry is deleted unless it is **the only copy of a step still ahead of the run**: its
    step is above every step in ``live`` (the storage's committed steps: the run has not reached
    it again) and no entry staying (newer, or within the bound) holds that step. Such an entry
    stays whatever the bounds: deleting it would lose the furthest state anyone committed.
    """
    if keep < 0:
        raise ValueError(f"keep must be >= 0 rejected entries, got {keep}")
    live = set(live)
    ahead_of = max(live, default=-1)
    held: set[int] = set()
    total, full, out = 0, False, []
    for e in sorted(entries, key=lambda e: (e.when, e.step, e.tag), reverse=True):
        full = full or len(held) >= keep or (max_bytes is not None and total + e.nbytes > max_bytes)
        if not full:
            held.add(e.step)
        elif e.step > ahead_of and e.step not in held:
            held.add(e.step)         # the only copy of a step ahead of the run: kept beyond the bound
        else:
            out.append(e.tag)
            continue
        total += e.nbytes
    return out


def _entries(st: Storage, *, sizes: bool) -> list[Entry]:
    out = []
    for tag in st.listdir(REJECTED):
        step = parse_step_dir(tag.rsplit("-", 1)[0])
        if step is None:
            continue
        when = reason(st, tag).get("when")
        nbytes = 0
        if sizes:
            try:
                m = json.loads(st.read_bytes(f"{REJECTED}/{tag}/{step_dir(step)}/{MANIFEST}"))
                nbytes = int(m.get("bytes_stored") or m.get("bytes") or 0)
            except (OSError, ValueError, TypeError, AttributeError, RecursionError):
                nbytes = 0
        out.append(Entry(tag, step, float(when) if isinstance(when, (int, float)) else 0.0, nbytes))
    return out


def prune(storages: list[Storage], *, keep: int = KEEP, max_bytes: int | None = None) -> list[str]:
    """Delete what :func:`choose_prune` chooses under ``rejected/`` of these storages; returns the
    tags deleted. Each entry goes manifest first (un-committed), then its files on every root.

    Blocking; call from the single writer of these storages (:func:`move_aside` calls it after
    each move). Storage errors are logged, never raised: a move that succeeded stands, and what
    could not be deleted is chosen again after the next move.
    """
    try:
        entries = _entries(storages[0], sizes=max_bytes is not None)
        if len(entries) <= keep:
            return []
        doomed = choose_prune(entries, live=committed_steps(storages[0]), keep=keep, max_bytes=max_bytes)
    except OSError as e:
        log.warning("could not list %s to bound it: %s", storages[0].url_of(REJECTED), e)
        return []
    done = []
    for tag in doomed:
        step = parse_step_dir(tag.rsplit("-", 1)[0])
        try:
            storages[0].remove(f"{REJECTED}/{tag}/{step_dir(step)}/{MANIFEST}")
            for st in reversed(storages):     # root 0, with REASON.json, last
                st.remove(f"{REJECTED}/{tag}")
        except OSError as e:
            log.warning("could not delete %s: %s (tried again after the next move)",
                        storages[0].url_of(f"{REJECTED}/{tag}"), e)
            continue
        done.append(tag)
    if done:
        log.info("deleted %d older entries of %s beyond the newest %d: %s", len(done),
                 storages[0].url_of(REJECTED), keep, ", ".join(done))
    return done
