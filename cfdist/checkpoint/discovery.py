"""Finding, verifying and reading committed checkpoints; sweeping leftovers; copying between tiers.

A step counts only if ``step-XXXXXXXXX/MANIFEST.json`` exists on root 0. Reading never unpickles:
shards are parsed as safetensors (header JSON + raw bytes), every tensor's xxh3-64 is checked
against the manifest, and every path comes from a validated manifest.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from cfdist.checkpoint import codecs, roots
from cfdist.checkpoint.format import MANIFEST, TMP_MARK, CheckpointError, parse_step_dir, seal_manifest, step_dir
from cfdist.checkpoint.flatten import unflatten
from cfdist.checkpoint.reader import committed_steps, read_manifest, read_stored
from cfdist.checkpoint.retry import RetryPolicy, retrying
from cfdist.storage import Storage, open_storages

log = logging.getLogger("cfdist.discovery")


def sweep(storages: list[Storage]) -> list[str]:
    """Remove what crashed persists left: staging dirs, and step dirs provably never committed.

    First the roots are checked against their striping-set identity (:mod:`cfdist.checkpoint.roots`;
    a reordered list, or an empty/unmounted root 0 whose siblings hold data, raises
    ``StripeSetError`` and nothing is removed). Then ``.tmp-`` staging directories go, and a step
    directory goes only when root 0 holds no manifest for it (asked directly, not from a listing
    that may lag), and so does a crashed run's reuse pool (:data:`cfdist.storage.direct.REUSE_DIR`).
    Committed checkpoints are never touched. Storage errors propagate.
    Call once at start, from the single writer of these storages, before its first persist.
    """
    roots.check(storages, create=True)
    removed = []
    for st in storages:
        st.drop_reuse_pool()   # a crashed run's retired files (part of no checkpoint)
        for name in st.listdir(""):
            step = parse_step_dir(name)
            if TMP_MARK in name and (parse_step_dir(name.split(TMP_MARK)[0]) is not None
                                     or name.split(TMP_MARK)[0].endswith(".json")):
                st.remove(name)   # a staging dir, or the tmp file of a small write_atomic (hint, history)
                removed.append(st.url_of(name))
            elif step is not None and not storages[0].exists(f"{name}/{MANIFEST}"):
                st.remove(name)
                removed.append(st.url_of(name))
    if removed:
        log.info("swept %d uncommitted leftovers: %s", len(removed), ", ".join(removed))
    return removed


def read_tensors(storages: list[Storage], step: int, manifest: dict, *, verify: bool = True,
                 names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Read, checksum and decode the tensors of a committed checkpoint into fresh CPU tensors
    (:func:`~cfdist.checkpoint.reader.read_stored`, then the codecs that encoded them)."""
    out = read_stored(storages, step, manifest, verify=verify, names=names)
    return codecs.decode_tensors(storages, step, manifest, out, verify=verify)


def decode_state(manifest: dict, tensors: dict[str, torch.Tensor], *, where: str) -> tuple[dict, dict]:
    """``(state, rng)`` of a verified checkpoint: the skeleton filled with its tensors, plus the
    late state; ``CheckpointError`` if the skeleton is malformed (names a missing tensor, ...)."""
    try:
        state = unflatten(manifest["skeleton"], tensors)
        if not isinstance(state, dict):
            raise TypeError(f"the state is a {type(state).__name__}, not a dict")
        state.update(unflatten(manifest.get("late", {}), {}))
        rng = unflatten(manifest.get("rng", {}), {})
    except (LookupError, ValueError, TypeError, AttributeError, OverflowError, RuntimeError) as e:
        # RuntimeError includes RecursionError (a skeleton nested too deeply)
        raise CheckpointError(f"{where}: the manifest's state skeleton is malformed "
                              f"({type(e).__name__}: {e})") from None
    return state, rng


def load_verified(storages: list[Storage], step: int, *, verify: bool = True) -> tuple[dict, dict]:
    """(manifest, tensors) of one committed checkpoint; CheckpointError if anything is off."""
    m = read_manifest(storages, step)
    return m, read_tensors(storages, step, m, verify=verify)


@dataclass(frozen=True)
class Candidate:
    step: int
    tier: int
    storages: list
    rejected: str | None = None
    """Set for a checkpoint that was moved aside: its folder under ``rejected/``."""


def candidates(tiers: list[list[Storage]], *, retry: RetryPolicy | None = None) -> list[Candidate]:
    """Every committed step of every tier, newest first; ties go to the earlier (faster) tier.

    Every tier is required: a tier whose listing keeps failing (after ``retry``) raises
    :class:`~cfdist.checkpoint.retry.StorageUnavailable` naming it, because skipping it could
    roll back past its newer checkpoints. Drop a tier that is gone for good from the list.
    """
    out = []
    for i, sts in enumerate(tiers):
        steps = retrying(lambda sts=sts: committed_steps(sts[0]), policy=retry,
                         what=f"listing the checkpoints of tier {i} ({sts[0].url})")
        out += [Candidate(s, i, sts) for s in steps]
    return sorted(out, key=lambda c: (-c.step, c.tier))


def find_latest(tiers: list[list[Storage]], *, retry: RetryPolicy | None = None) -> Candidate | None:
    """The newest committed step across tiers (not verified; see ``load_verified``)."""
    c = candidates(tiers, retry=retry)
    return c[0] if c else None


def rejected_candidates(tiers: list[list[Storage]], step: int | None = None) -> list[Candidate]:
    """Checkpoints moved aside (``rejected/``) in each tier, newest step first, then most
    recently moved first; only ``step`` when given."""
    from cfdist.checkpoint import rejected

    out = []
    for i, sts in enumerate(tiers):
        for tag, view, _reason in rejected.find(sts, step):
            out += [Candidate(s, i, view, rejected=tag) for s in committed_steps(view[0])]
    return out


@dataclass
class Loaded:
    """What :func:`load_newest` found: the checkpoint loaded and the ones rejected on the way."""

    candidate: Candidate
    manifest: dict
    state: dict
    rng: dict
    rejected: list[tuple[Candidate, str]] = field(default_factory=list)
    """``(candidate, why)`` of newer checkpoints whose content was unusable (CheckpointError)."""
    passed: list[int] = field(default_factory=list)
    """Newer steps committed in the first tier that were not tried (a ``step`` was asked for)."""
    extra: object = None
    """What ``load_first``'s ``extra`` check returned for this checkpoint."""


def _load_one(c: Candidate, verify: bool) -> tuple[dict, dict, dict]:
    m, tensors = load_verified(c.storages, c.step, verify=verify)
    state, rng = decode_state(m, tensors, where=c.storages[0].url_of(step_dir(c.step)))
    return m, state, rng


def _warn(c: Candidate, why: str) -> None:
    warnings.warn(f"checkpoint step {c.step} in {c.storages[0].url} is unusable ({why}); "
                  f"falling back to an older one", RuntimeWarning, stacklevel=4)


def load_first(cands: list[Candidate], *, verify: bool = True, retry: RetryPolicy | None = None,
               on_reject: Callable[[Candidate, str], None] = _warn,
               extra: Callable[[Candidate, dict], object] | None = None
               ) -> tuple[Loaded | None, list[tuple[Candidate, str]]]:
    """Load the first of ``cands`` whose content verifies: the candidate loop of every restore.

    A content error (``CheckpointError``, also from ``extra(candidate, manifest)``, a further
    check whose result lands in ``Loaded.extra``) rejects that candidate (``on_reject(candidate,
    why)``, by default a ``RuntimeWarning`` naming the file and checksums) and the next one is
    tried. A storage error (``OSError``) is retried per ``retry`` and then raised as
    :class:`~cfdist.checkpoint.retry.StorageUnavailable` naming the URL and the step: nothing is
    rolled back past a checkpoint that may be intact. Returns ``(loaded or None, rejected)``.
    """
    rejected: list[tuple[Candidate, str]] = []
    for c in cands:
        where = c.storages[0].url_of(step_dir(c.step))
        try:
            m, state, rng = retrying(lambda c=c: _load_one(c, verify), policy=retry,
                                     what=f"reading step {c.step} from {where}")
            more = extra(c, m) if extra is not None else None
        except CheckpointError as e:
            rejected.append((c, str(e)))
            on_reject(c, str(e))
            continue
        if c.rejected is not None:
            log.warning("loaded step %d from %s, a checkpoint moved aside earlier", c.step, where)
        return Loaded(c, m, state, rng, list(rejected), extra=more), rejected
    return None, rejected


def with_rejected(tiers: list[list[Storage]], cands: list[Candidate], step: int) -> list[Candidate]:
    """``cands`` plus, when no tier holds ``step`` live, its copies moved aside (``rejected/``)."""
    if any(c.step == step for c in cands):
        return cands
    return cands + rejected_candidates(tiers, step)


def load_newest(tiers: list[list[Storage]], *, step: int | None = None, verify: bool = True,
                retry: RetryPolicy | None = None,
                on_reject: Callable[[Candidate, str], None] = _warn) -> Loaded | None:
    """Load the newest committed checkpoint whose content verifies (or ``step``), into CPU tensors.

    One process's restore (``Checkpointer.restore`` adds the agreement between ranks): see
    :func:`load_first` for content errors (fall back) and storage errors (retry, then raise).
    ``step``: only that step (any tier holding it, ties to the earlier tier); when no tier holds
    it committed, its copies moved aside under ``rejected/`` are tried (most recent first).
    Returns None when there is no checkpoint at all; raises ``CheckpointError`` when there are
    some and none is usable. Reads only; call from any process.
    """
    cands = candidates(tiers, retry=retry)
    passed = []
    if step is not None:
        passed = sorted({c.step for c in cands if c.step > step and c.tier == 0})
        cands = [c for c in with_rejected(tiers, cands, step) if c.step == step]
        if not cands:
            raise CheckpointError(f"step {step} is not committed in any of {[t[0].url for t in tiers]}, "
                                  f"nor moved aside under their rejected/ folders")
    found, rejected = load_first(cands, verify=verify, retry=retry, on_reject=on_reject)
    if found is not None:
        found.passed = passed
        return found
    if not rejected:
        return None
    raise CheckpointError("no usable checkpoint; found and rejected:\n  " +
                          "\n  ".join(f"step {c.step} in {c.storages[0].url}: {why}" for c, why in rejected))


def copy_checkpoint(src: list[Storage], step: int, dst: list[Storage]) -> None:
    """Copy a committed checkpoint between tiers with the same commit protocol (manifest last).

    The steps a codec chain needs (``depends_on``) are copied first, unless ``dst`` has them."""
    m = read_manifest(src, step)
    have = set(committed_steps(dst[0])) if m.get("depends_on") else set()
    for dep, _ in m.get("depends_on", ()):
        if dep not in have:
            copy_checkpoint(src, dep, dst)
    final = step_dir(step)
    staging = {r: dst[r].staging_dir(final) for r in range(len(dst))}
    for sh in m["shards"]:
        r = sh["root"] % len(dst)
        data = src[sh["root"]].read_bytes(f"{final}/{sh['file']}")
        dst[r].write_file(f"{staging[r]}/{sh['file']}", [data])
        sh["root"] = r
    for r in range(1, len(dst)):
        if any(s["root"] == r for s in m["shards"]):
            dst[r].fsync_dir(staging[r])
            dst[r].publish(staging[r], final)
    m["roots"] = len(dst)
    dst[0].write_file(f"{staging[0]}/{MANIFEST}", [seal_manifest(m)])
    dst[0].fsync_dir(staging[0])
    dst[0].publish(staging[0], final)


# ---- public helpers ------------------------------------------------------------------------------

def _open_checked(storage, storage_options: dict) -> list[Storage]:
    sts = open_storages(storage, **storage_options)
    if len(sts) > 1:
        roots.check(sts, create=False)   # a reordered list would make intact checkpoints look corrupt
    return sts


def list_checkpoints(storage, *, include_rejected: bool = False, **storage_options) -> list[dict]:
    """Committed checkpoints in ``storage`` (URL or list of URLs), oldest first.

    Each: ``{"step", "epoch", "epoch_end", "time", "bytes", "url"}``. Reads only manifests; a
    manifest whose content is bad is left out with a warning, a storage error is retried and
    then raised (``StorageUnavailable``).
    ``include_rejected``: also the checkpoints moved aside under ``rejected/`` (a run rolled back
    past them), each with ``"rejected": {"why", "when", "replaced_by"}``; ``load(url, step=...)``
    still reads them.
    """
    sts = _open_checked(storage, storage_options)
    out = []
    found = candidates([sts])
    if include_rejected:
        found += retrying(lambda: rejected_candidates([sts]), what=f"listing {sts[0].url_of('rejected')}")
    for c in sorted(found, key=lambda c: (c.step, c.rejected is None)):
        try:
            m = retrying(lambda c=c: read_manifest(c.storages, c.step),
                         what=f"reading the manifest of step {c.step} in {c.storages[0].url}")
        except CheckpointError as e:
            log.warning("%s", e)
            continue
        row = {"step": c.step, "epoch": m.get("epoch"), "epoch_end": bool(m.get("epoch_end")),
               "time": m.get("time"), "bytes": m.get("bytes"), "url": c.storages[0].url_of(step_dir(c.step))}
        if c.rejected is not None:
            from cfdist.checkpoint import rejected

            row["rejected"] = rejected.reason(sts[0], c.rejected)
        out.append(row)
    return out


def load(storage, step: int | None = None, *, verify: bool = True, read_retry: RetryPolicy | None = None,
         **storage_options) -> dict:
    """A committed checkpoint as a plain nested dict (no live objects needed).

    ``{"step": ..., "epoch": ..., "state": {key: state_dict, ...}, "extra": {...}}`` where each
    state_dict holds CPU tensors: ``load(url)["state"]["model"]`` goes straight into
    ``model.load_state_dict``. ``step=None`` takes the newest that verifies; a given ``step``
    that is not committed is looked up among the checkpoints moved aside (``rejected/``).
    Storage errors are retried (``read_retry``) and then raised, never taken for corruption.
    """
    sts = _open_checked(storage, storage_options)
    found = load_newest([sts], step=step, verify=verify, retry=read_retry,
                        on_reject=lambda c, why: log.warning("%s; trying an older checkpoint", why))
    if found is None:
        raise CheckpointError(f"no committed checkpoint in {sts[0].url}")
    m = found.manifest
    return {"step": found.candidate.step, "epoch": m.get("epoch"), "time": m.get("time"),
            "state": found.state, "rng": found.rng}
