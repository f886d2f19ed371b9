"""The identity of a striping set: which root is which, so that a sweep never deletes real shards.

A checkpoint striped over N roots has its manifest (the commit) on root 0 and shards on the
others. The start-up sweep removes step directories that root 0 does not commit; if root 0 were
an empty, unmounted mount point, or the URL list reordered, that would remove every shard on the
other roots. So each root carries ``STRIPE.json``::

    {"format": "cfdist-stripe/1", "set": "<uuid>", "index": 2, "count": 3, "created": 1767225600.0}

written by the writer at first use, and :func:`check` compares it with the list given: a root
without its file while its siblings have theirs (and hold data), a root from another set, a root
at another position, or another number of roots is refused with :class:`StripeSetError`, which
names each URL, its identity and what it holds, and the fix. Roots from before identity files
(none has one) are checked against the newest manifest (every shard it names must be where the
list says) before the files are written.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from cfdist.checkpoint.format import MANIFEST, TMP_MARK, parse_step_dir, step_dir
from cfdist.checkpoint.reader import committed_steps
from cfdist.storage import Storage

log = logging.getLogger("cfdist.roots")

IDENTITY = "STRIPE.json"
FORMAT = "cfdist-stripe/1"


class StripeSetError(ValueError):
    """The storage URLs given do not match the striping set found on them; nothing was touched."""


def _read(st: Storage) -> dict | str | None:
    """The identity of ``st``: a dict, None when absent, or a string saying why it is unusable."""
    try:
        raw = st.read_bytes(IDENTITY)
    except FileNotFoundError:
        return None
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return f"unreadable {IDENTITY} ({type(e).__name__})"
    if not (isinstance(d, dict) and d.get("format") == FORMAT and isinstance(d.get("set"), str)
            and all(isinstance(d.get(k), int) and not isinstance(d.get(k), bool) for k in ("index", "count"))):
        return f"malformed {IDENTITY}"
    return d


def _step_dirs(st: Storage) -> list[str]:
    return [n for n in st.listdir("") if parse_step_dir(n.split(TMP_MARK)[0]) is not None]


def _holds(st: Storage, dirs: list[str], *, root0: bool) -> str:
    steps = sorted(parse_step_dir(n) for n in dirs if TMP_MARK not in n)
    if not dirs:
        return "holds no step directory"
    what = f"holds {len(dirs)} step director{'y' if len(dirs) == 1 else 'ies'}"
    if steps:
        what += f" (steps {steps[0]}..{steps[-1]})" if len(steps) > 1 else f" (step {steps[0]})"
    if root0:
        n = sum(1 for s in steps if st.exists(f"{step_dir(s)}/{MANIFEST}"))
        what += f", {n} committed"
    return what


def _refuse(storages: list[Storage], ids: list, dirs: list[list[str]], problem: str, fix: str) -> StripeSetError:
    lines = []
    for i, st in enumerate(storages):
        x = ids[i]
        who = (f"root {x['index']} of {x['count']} of set {x['set'][:8]}" if isinstance(x, dict)
               else x if isinstance(x, str) else f"no {IDENTITY}")
        lines.append(f"  [{i}] {st.url}: {who}; {_holds(st, dirs[i], root0=i == 0)}")
    return StripeSetError(f"refusing to use these {len(storages)} storage root(s): {problem}; nothing was "
                          f"swept or written.\n" + "\n".join(lines) + f"\nFix: {fix}")


def _legacy_check(storages: list[Storage], ids: list, dirs: list[list[str]]) -> None:
    """Roots without identity files: root 0 must commit what the others hold, where they hold it."""
    if len(storages) == 1:
        return
    committed = committed_steps(storages[0])
    if not committed:
        if any(dirs[1:]):
            raise _refuse(storages, ids, dirs, "root 0 commits no checkpoint while other roots hold step "
                          "directories: root 0 may be an empty or unmounted mount point, or the list is reordered",
                          "mount root 0 / give the URLs in their original order (root 0 is the one with "
                          "MANIFEST.json files)")
        return
    newest = committed[-1]
    try:
        m = json.loads(storages[0].read_bytes(f"{step_dir(newest)}/{MANIFEST}"))
        shards = [(int(s["root"]), str(s["file"])) for s in m["shards"]]
    except (ValueError, KeyError, TypeError, RecursionError):
        return   # a damaged manifest says nothing about the order; restore will judge it
    for r, f in shards:
        if r >= len(storages) or not storages[r].exists(f"{step_dir(newest)}/{f}"):
            raise _refuse(storages, ids, dirs, f"step {newest}, committed on root 0, has its shard {f} on "
                          f"root {r}, which is not where this list says (reordered, missing or changed roots)",
                          f"give the URLs in their original order ({m.get('roots', '?')} roots)")


def _write(storages: list[Storage], ids: list, set_id: str) -> None:
    for i in reversed(range(len(storages))):   # root 0 last
        if ids[i] is None:
            storages[i].write_atomic(IDENTITY, json.dumps({"format": FORMAT, "set": set_id, "index": i,
                                                           "count": len(storages), "created": time.time()}).encode())
    log.info("striping set %s: identity files written on %s", set_id[:8], [st.url for st in storages])


def check(storages: list[Storage], *, create: bool) -> None:
    """Refuse a URL list that does not match the striping set on storage (:class:`StripeSetError`).

    ``create``: write the identity files when none exists yet (the writer, at its start). Reads
    a few small files; storage errors propagate (``OSError``). Call before sweeping or writing.
    """
    n = len(storages)
    ids = [_read(st) for st in storages]
    dirs = [_step_dirs(st) for st in storages]
    present = [x for x in ids if x is not None]
    if len(present) < n and not any(dirs):
        # Nothing here yet (or a first start cut short while writing the files): harmless.
        if create:
            set_id = next((x["set"] for x in present if isinstance(x, dict)), uuid.uuid4().hex)
            _write(storages, ids, set_id)
        return
    if not present:
        _legacy_check(storages, ids, dirs)
        if create:
            _write(storages, ids, uuid.uuid4().hex)
        return
    bad = [x for x in ids if isinstance(x, str)]
    if bad:
        raise _refuse(storages, ids, dirs, f"{len(bad)} root(s) have an unusable {IDENTITY}",
                      "restore the file from a sibling's (same set, its own index) or move that root's data away")
    sets = {x["set"] for x in ids if x is not None}
    if ids[0] is None:
        raise _refuse(storages, ids, dirs, f"root 0 has no {IDENTITY} while its siblings do: it may be an empty "
                      f"or unmounted mount point, or a wrong URL",
                      "mount the disk of root 0 (or fix its URL); if the list is reordered, give the URLs in "
                      "the order of their index")
    if len(sets) > 1:
        raise _refuse(storages, ids, dirs, "the roots belong to different striping sets",
                      "give the roots of one set (those with the same set id), in the order of their index")
    counts = {x["count"] for x in ids if x is not None}
    if any(x is None for x in ids):
        raise _refuse(storages, ids, dirs, f"root(s) {[i for i, x in enumerate(ids) if x is None]} have no "
                      f"{IDENTITY} while their siblings do (an unmounted disk? a root added to the list?)",
                      f"mount the missing disk(s), or give exactly the {counts.pop()} roots of the set")
    if counts != {n}:
        raise _refuse(storages, ids, dirs, f"the set has {counts.pop()} roots but {n} URL(s) were given",
                      "give every root of the set, in the order of their index")
    if [x["index"] for x in ids] != list(range(n)):
        order = [storages[j].url for j in sorted(range(n), key=lambda j: ids[j]["index"])]
        raise _refuse(storages, ids, dirs, "the URL list is reordered", f"pass the URLs in this order: {order}")
