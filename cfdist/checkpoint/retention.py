"""Which committed checkpoints to delete or move aside. The choice is pure; :func:`apply` is its shell.

Rules (invariant 2), applied only right after a commit of ``newest``:

* retention **deletes** only *ancestors* of ``newest`` (same lineage, older), beyond the ``keep``
  newest of them, and never one of the ``keep_epoch_ends`` most recent epoch ends (an int;
  ``True``: all of them, ``False``/0: none);
* a committed checkpoint that is **not an ancestor** (numbered above ``newest``: a run rolled
  back past it; or from another run or another branch) is **moved aside** to ``rejected/``
  (:mod:`cfdist.checkpoint.rejected`), never deleted;
* **unknown** (its manifest could not be read or says nothing usable): neither. It stays;
* a checkpoint that one staying depends on (the base and increments of a ``cfdist.codecs``
  chain, listed in its manifest's ``depends_on``) stays as long as that one does;
* **an independent fallback** (``keep >= 2``): when every one of the ``keep`` newest restore
  points needs one same checkpoint (with codecs: they all sit on one chain, whose base a single
  flipped byte would make unusable), the newest older ancestor that needs none of those shared
  checkpoints also stays, with its chain (typically the last checkpoint of the previous chain).
  Then no single corrupt checkpoint leaves restore without a usable one. Without codecs every
  checkpoint stands alone and this keeps nothing more; ``keep=1`` keeps one restore point and no
  fallback, codecs or not.

**Lineage.** Every manifest records ``"lineage": {"run": id, "restores": [s1, s2, ...]}``: ``run``
is drawn when a Checkpointer starts without restoring, and inherited by restore, which appends the
restored step. Checkpoint ``c`` is an ancestor of ``n`` when both have the same ``run``, ``c``'s
restores are a prefix of ``n``'s, and ``c.step`` is at most the restore that followed that prefix
(or, with the same restores, ``c.step < n.step``): ``n``'s state was computed from ``c``'s. A
manifest without ``lineage`` (written by a bare ``write_checkpoint`` job) belongs to one anonymous
lineage with no restores.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from dataclasses import dataclass

from cfdist.checkpoint.format import MANIFEST, step_dir
from cfdist.checkpoint.reader import committed_steps

log = logging.getLogger("cfdist.retention")

UNKNOWN = object()
"""The lineage (or epoch end) of a checkpoint whose manifest could not be read."""

ANONYMOUS = {"run": None, "restores": []}


def new_lineage() -> dict:
    """The lineage of a run that starts without restoring."""
    return {"run": uuid.uuid4().hex, "restores": []}


def job_lineage(channel=None) -> dict:
    """The lineage of a job's fresh start, the same on every rank: the first one proposed.

    ``channel``: the Checkpointer's :class:`~cfdist.checkpoint.agreement.Channel` (None: one
    process, a new lineage). Every rank proposes a new lineage with one atomic ``compare_set``
    on the Store and keeps whichever landed first: one round trip, no waiting for another rank.
    Call once per Checkpointer, at construction, on every rank.

    Why one per job and not one per writer: the writers of one job (one per node under
    ``cfdist.fit``, each to its node's disk) write copies of the same state. With a lineage each,
    a node that restored another node's copy (a peer copy, the shared tier) inherited that
    node's lineage, so its own older checkpoints looked like "another run" to retention and were
    moved aside to ``rejected/`` at its next commit (two per node per such recovery with
    ``keep=2``, in its memory and its local tier), and the shared tier moved aside every
    upload of the previous uploading node.
    """
    mine = new_lineage()
    if channel is None:
        return mine
    got = channel.store.compare_set(channel.key("lineage"), "", json.dumps(mine))
    lin = lineage_of({"lineage": json.loads(got)})
    return mine if lin is UNKNOWN else lin


def after_restore(manifest: dict, step: int) -> dict:
    """The lineage of a run that restored ``step`` from ``manifest``."""
    lin = lineage_of(manifest)
    if lin is UNKNOWN:
        lin = new_lineage()
    return {"run": lin["run"], "restores": [*lin["restores"], step]}


def lineage_of(manifest: object) -> dict | object:
    """A manifest's lineage (``ANONYMOUS`` if it has none, ``UNKNOWN`` if it is malformed)."""
    if not isinstance(manifest, dict):
        return UNKNOWN
    lin = manifest.get("lineage", ANONYMOUS)
    if (isinstance(lin, dict) and (lin.get("run") is None or isinstance(lin.get("run"), str))
            and isinstance(lin.get("restores"), list)
            and all(isinstance(s, int) and not isinstance(s, bool) for s in lin["restores"])):
        return {"run": lin.get("run"), "restores": list(lin["restores"])}
    return UNKNOWN


def is_ancestor(step: int, lineage, newest: int, newest_lineage) -> bool | None:
    """Whether checkpoint ``(step, lineage)`` is an ancestor of ``(newest, newest_lineage)``;
    None when either lineage is ``UNKNOWN``."""
    if lineage is UNKNOWN or newest_lineage is UNKNOWN:
        return None
    if step >= newest or lineage["run"] != newest_lineage["run"]:
        return False
    mine, theirs = lineage["restores"], newest_lineage["restores"]
    k = len(mine)
    if theirs[:k] != mine:
        return False
    return k == len(theirs) or step <= theirs[k]


@dataclass(frozen=True, slots=True)
class Committed:
    """What retention knows of one committed checkpoint."""

    step: int
    epoch_end: bool | None = False
    """None: unknown (unreadable manifest)."""
    lineage: object = None
    """A lineage dict, or ``UNKNOWN``; None means ``ANONYMOUS``."""
    depends: tuple[int, ...] = ()
    """Steps it needs to be restored (``depends_on``: a codec chain)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Retention's decision after one commit (data: logged, tested by tables)."""

    delete: list[int]
    move_aside: list[tuple[int, str]]
    """``(step, why)``."""
    fallback: int | None = None
    """The independent restore point kept beyond the ``keep`` newest (None: not needed, or no
    ancestor offers one yet)."""
    shared: tuple[int, ...] = ()
    """The checkpoints that every one of the ``keep`` newest restore points needs: one flipped
    byte in any of them would leave those restore points unusable (empty without codecs)."""


def needs(step: int, by_step: dict[int, Committed]) -> frozenset[int]:
    """The checkpoints a restore of ``step`` reads (pure): itself and its ``depends`` (the
    manifest's ``depends_on``, which already lists every link a decode reads: the base of an
    intermittent increment, the whole chain of a consecutive one, the union over several chain
    codecs). Not followed further: a reference is read only for the tensors encoded against it,
    and those it holds whole or lists in its own chain, which ``step``'s list includes."""
    c = by_step.get(step)
    return frozenset((step, *(c.depends if c is not None else ())))


def independent_fallback(points: list[int], older: list[int],
                         by_step: dict[int, Committed]) -> tuple[int | None, frozenset[int]]:
    """``(fallback, shared)``: ``shared`` is what every restore point in ``points`` needs (the
    intersection of their :func:`needs`); when it is not empty, ``fallback`` is the first step of
    ``older`` (newest first) whose needs avoid ``shared`` and is wholly committed and readable,
    else None. Pure. With fewer than two points there is nothing to fall back from: ``(None, {})``.
    """
    if len(points) < 2:
        return None, frozenset()
    shared = frozenset.intersection(*(needs(p, by_step) for p in points))
    if not shared:
        return None, shared
    for s in older:
        need = needs(s, by_step)
        if not need & shared and all(d in by_step and by_step[d].epoch_end is not None for d in need):
            return s, shared
    return None, shared


def choose(committed: list[Committed], *, keep: int, keep_epoch_ends: int | bool, newest: int) -> Plan:
    """What to do with each committed checkpoint right after ``newest`` committed (pure).

    Kept restore points: the ``keep`` newest ancestors (``newest`` counts), the
    ``keep_epoch_ends`` most recent epoch ends, and (``keep >= 2``) the independent fallback of
    :func:`independent_fallback`; then every checkpoint that a staying one needs (its chain).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    by_step = {c.step: c for c in committed}
    top = by_step.get(newest, Committed(newest))
    by_step.setdefault(newest, top)
    top_lin = ANONYMOUS if top.lineage is None else top.lineage
    ancestors, aside = [], []
    for c in sorted(committed, key=lambda c: c.step, reverse=True):
        if c.step == newest:
            continue
        anc = is_ancestor(c.step, ANONYMOUS if c.lineage is None else c.lineage, newest, top_lin)
        if c.step > newest:
            aside.append((c.step, f"numbered above step {newest}, which was just committed by a run that "
                                  f"does not descend from it (it restored an older step, or started afresh)"))
        elif anc is False:
            aside.append((c.step, f"not an ancestor of step {newest}, which was just committed (another run, "
                                  f"or a branch that was rolled back)"))
        elif anc:
            ancestors.append(c)
    # the keep newest (the one just committed counts), plus the keep_epoch_ends most recent epoch
    # ends (the newest counts if it is one); a checkpoint may be both
    points = [top.step, *(c.step for c in ancestors[:keep - 1])]
    fallback, shared = independent_fallback(points, [c.step for c in ancestors[keep - 1:]], by_step)
    kept = set(points) | ({fallback} if fallback is not None else set())
    ends = [c.step for c in [top, *ancestors] if c.epoch_end]
    kept.update(ends if keep_epoch_ends is True else ends[:int(keep_epoch_ends)])
    delete = [c.step for c in ancestors if c.epoch_end is not None and c.step not in kept]  # unknown stays
    gone = set(delete) | {s for s, _ in aside}
    needed = set().union(*(needs(s, by_step) for s in by_step if s not in gone))
    return Plan(delete=sorted(s for s in delete if s not in needed),
                move_aside=sorted((s, why) for s, why in aside if s not in needed),
                fallback=fallback, shared=tuple(sorted(shared)))


def choose_deletions(committed: list[tuple[int, bool]], *, keep: int, keep_epoch_ends: int | bool,
                     newest: int | None = None, depends: dict[int, list[int]] | None = None) -> list[int]:
    """Steps to delete among ``(step, is_epoch_end)`` of one lineage, ``newest`` just committed
    (default: the highest). Steps above ``newest`` are never deleted (they are moved aside).
    ``depends``: step -> the steps it needs to be restored (never deleted while it stays)."""
    if not committed:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        return []
    newest = max(s for s, _ in committed) if newest is None else newest
    return choose([Committed(s, ee, None, tuple((depends or {}).get(s, ()))) for s, ee in committed],
                  keep=keep, keep_epoch_ends=keep_epoch_ends, newest=newest).delete


# (epoch_end, lineage, depends) per storage URL and step: manifests are read once per process. Only
# successful reads are cached; a step's entry goes when it is deleted, moved or re-committed.
_INFO: dict[str, dict[int, tuple[bool, object, tuple[int, ...]]]] = {}
_LOCK = threading.Lock()


def _info(storage, step: int, *, cached: bool = True) -> Committed:
    with _LOCK:
        known = _INFO.setdefault(storage.url, {})
        if cached and step in known:
            return Committed(step, *known[step])
    try:
        m = json.loads(storage.read_bytes(f"{step_dir(step)}/{MANIFEST}"))
    except (OSError, ValueError, RecursionError) as e:
        log.warning("retention cannot read the manifest of step %d in %s (%s); keeping it", step, storage.url, e)
        return Committed(step, None, UNKNOWN)
    lin = lineage_of(m)
    ee = bool(m.get("epoch_end")) if isinstance(m, dict) else None
    try:
        deps = tuple(int(d[0]) for d in (m.get("depends_on") or ())) if isinstance(m, dict) else ()
    except (TypeError, ValueError, IndexError, KeyError):
        return Committed(step, None, UNKNOWN)   # a chain it cannot read: keep everything
    if lin is UNKNOWN or ee is None:
        return Committed(step, ee, lin, deps)
    with _LOCK:
        known[step] = (ee, lin, deps)
    return Committed(step, ee, lin, deps)


def _forget(storage, step: int) -> None:
    with _LOCK:
        _INFO.get(storage.url, {}).pop(step, None)


def _is_epoch_end(storage, step: int) -> bool | None:
    """Whether ``step`` is an epoch end; None when its manifest cannot be read (never cached)."""
    return _info(storage, step).epoch_end


def delete_checkpoint(storages, step: int) -> None:
    """Un-commit first (the manifest goes), then the files on every root (local roots keep them
    in their reuse pool for the next persist to write over: :meth:`Storage.retire`)."""
    d = step_dir(step)
    storages[0].remove(f"{d}/{MANIFEST}")
    for st in storages:
        st.retire(d)
    _forget(storages[0], step)


def apply(storages, *, keep: int, keep_epoch_ends: int | bool, newest: int, newest_epoch_end: bool,
          reasons: dict[int, str] | None = None) -> list[int]:
    """Apply :func:`choose` right after ``newest`` committed; returns the steps deleted.

    ``reasons``: why the run rolled back past some steps (restore's verdicts), recorded in the
    REASON.json of those moved aside. Storage errors are logged, never raised: retention failing
    must not fail the commit that just succeeded (what it could not do stays for the next commit).
    """
    from cfdist.checkpoint import rejected

    _forget(storages[0], newest)
    committed = [_info(storages[0], s, cached=s != newest) for s in committed_steps(storages[0])]
    plan = choose(committed, keep=keep, keep_epoch_ends=keep_epoch_ends, newest=newest)
    if plan.shared:
        log.debug("retention in %s after step %d: the %d newest restore points all need step(s) %s; %s",
                  storages[0].url, newest, keep, list(plan.shared),
                  f"keeping step {plan.fallback} (and its chain) as the independent fallback"
                  if plan.fallback is not None else "no older independent restore point exists yet")
    for s, why in plan.move_aside:
        why = f"{(reasons or {})[s]}; then {why}" if s in (reasons or {}) else why
        try:
            rejected.move_aside(storages, s, why=why, replaced_by=newest)
        except OSError as e:
            log.warning("could not move step %d of %s aside: %s; it stays in place", s, storages[0].url, e)
        _forget(storages[0], s)
    for s in plan.delete:
        try:
            delete_checkpoint(storages, s)
        except OSError as e:
            log.warning("retention could not delete step %d in %s: %s", s, storages[0].url, e)
    return plan.delete
