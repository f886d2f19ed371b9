"""The settings of a :class:`~cfdist.Checkpointer`, grouped the way users look for them.

What a newcomer needs is a plain keyword of the constructor (``keep``, ``writers``,
``buffers``, ``codecs``, ``restore_from``); the rest comes in three groups, each a frozen
dataclass with defaults that work (as Orbax's ``CheckpointManagerOptions``)::

    cfdist.Checkpointer(state, "file:///mnt/ssd/run", cfdist.Every(50), keep=3, writers="all",
                        persist=cfdist.PersistOptions(timeout_s=120),
                        load=cfdist.LoadOptions(verify=False),
                        group=cfdist.GroupOptions(agree_timeout_s=600))

- :class:`PersistOptions`: how a checkpoint is written (backend, timeout, file I/O);
- :class:`LoadOptions`: how a checkpoint is read back (checksums, retries);
- :class:`GroupOptions`: the job's ranks (rank, world size, the store they agree through).

:class:`CheckpointerConfig` is the whole, validated (``ckpt.config``). The constructor's old flat
keywords (``persist_timeout_s=``, ``backend=``, ``io=``, ``verify=``, ``read_retry=``,
``rank=``, ``world_size=``, ``store=``, ``lookahead=``, ``agree_timeout_s=``, ``writer=``) still
work and warn (:func:`from_legacy`). Pure: no I/O, no torch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from cfdist.checkpoint.retry import RetryPolicy
from cfdist.storage.direct import check_mode as check_io


def _seconds(name: str, t, *, none_ok: bool) -> None:
    if t is None and none_ok:
        return
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        raise ValueError(f"{name} must be a number of seconds > 0{', or None to wait forever' if none_ok else ''}; "
                         f"got {t!r}")


@dataclass(frozen=True, kw_only=True)
class PersistOptions:
    """How a checkpoint is written (the background phase, after the snapshot)."""

    backend: Any = "thread"
    """Where persist runs: ``"thread"`` (default, measured best), ``"process"`` (a writer
    process; snapshots in shared memory), or a :class:`~cfdist.checkpoint.persist.PersistBackend`
    object (``cfdist.fit`` passes its node actor's)."""
    timeout_s: float | None = None
    """Give a persist up after this many seconds (a hung disk or object store): it counts as
    failed (``stats``, log, ``wait()``), its writer can no longer commit it, training goes on,
    and the next checkpoint is written by a fresh writer into fresh snapshot buffers (the hung
    writer keeps the old ones: one state's size of host memory per hung write). None: wait
    forever. Holds on any world size, with any ``writers`` and ``buffers`` and on every backend
    (thread, process, node actor): a sliced step that one writer gives up is given up by every
    writer, and rank 0 can no longer commit it (:mod:`cfdist.checkpoint.slice_commit`). The
    timeout counts from when the persist starts (not while it waits behind an earlier one)."""
    io: str = "auto"
    """How shard files are written on local ``file://`` roots: ``"auto"`` (``O_DIRECT`` from the
    page-aligned arenas where the filesystem supports it, else buffered, one log line per
    filesystem), ``"direct"`` (refuse a root whose filesystem does not) or ``"buffered"`` (page
    cache; the pages are dropped after fsync either way). Remote roots always write through
    fsspec. See :mod:`cfdist.storage.direct`."""

    def __post_init__(self):
        if isinstance(self.backend, str) and self.backend not in ("thread", "process"):
            raise ValueError(f"PersistOptions.backend must be 'thread', 'process' or a PersistBackend object, "
                             f"got {self.backend!r}")
        _seconds("PersistOptions.timeout_s", self.timeout_s, none_ok=True)
        check_io(self.io)


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How ``restore`` reads a checkpoint back."""

    verify: bool = True
    """Check every tensor's checksum on restore (a mismatch rolls back to an older checkpoint)."""
    read_retry: RetryPolicy = field(default_factory=RetryPolicy)
    """How storage errors while listing or reading checkpoints are retried before restore raises
    (they never make it fall back to an older checkpoint; see :mod:`cfdist.checkpoint.retry`)."""

    def __post_init__(self):
        if not isinstance(self.verify, bool):
            raise TypeError(f"LoadOptions.verify must be True or False, got {self.verify!r}")
        if not isinstance(self.read_retry, RetryPolicy):
            raise TypeError(f"LoadOptions.read_retry must be a cfdist.RetryPolicy, got {self.read_retry!r}")


@dataclass(frozen=True, kw_only=True)
class GroupOptions:
    """The job's ranks: who this process is and how ranks agree (never a collective on the
    training group: a c10d Store)."""

    rank: int | None = None
    """This process's rank; default torch.distributed's when initialised, else 0."""
    world_size: int | None = None
    """Ranks in the job; default torch.distributed's when initialised, else 1."""
    store: Any = None
    """The c10d Store ranks agree through (checkpoint steps, RNG states, restore step, slices);
    default torch.distributed's when initialised. Needed when ``world_size > 1``."""
    lookahead: int = 8
    """Steps per agreement window. Rank 0's decisions (k, save requests) apply ``lookahead`` to
    ``2 * lookahead`` steps after it made them; other ranks read the store once per window."""
    agree_timeout_s: float = 1800.0
    """How long a rank waits for the others through the store (the agreed k, every rank's RNG
    states, restore, the other writers' slices) before raising ``AgreementError`` naming the
    missing keys."""
    live: bool = False
    """Keep, on a writer, the small state of the last completed step (data position,
    schedulers, RNG, module buffers: a few ``state_dict()`` calls per step), so that after the
    group failed (a peer died, the next collective raised) :meth:`Checkpointer.save_live` can
    write the live state of that step without the group or the store
    (:mod:`cfdist.checkpoint.live`). ``cfdist.fit`` turns it on."""

    def __post_init__(self):
        for name in ("rank", "world_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "rank" else 1)):
                raise ValueError(f"GroupOptions.{name} must be an int {'>= 0' if name == 'rank' else '>= 1'} "
                                 f"(or None: torch.distributed's), got {v!r}")
        if not isinstance(self.lookahead, int) or isinstance(self.lookahead, bool) or self.lookahead < 1:
            raise ValueError(f"GroupOptions.lookahead must be an int >= 1 (steps per agreement window), "
                             f"got {self.lookahead!r}")
        _seconds("GroupOptions.agree_timeout_s", self.agree_timeout_s, none_ok=False)
        if not isinstance(self.live, bool):
            raise TypeError(f"GroupOptions.live must be True or False, got {self.live!r}")


@dataclass(frozen=True, kw_only=True)
class CheckpointerConfig:
    """Every setting of a :class:`~cfdist.Checkpointer`, validated (``ckpt.config``): its plain
    keywords and its three groups."""

    keep: int = 2
    """Newest committed checkpoints to keep (the one in flight comes on top). Two, so that a
    restore that finds the newest one corrupt falls back to the previous one."""
    keep_epoch_ends: int = 0
    """Also keep the ``N`` most recent checkpoints taken at an epoch boundary (0 or False: none
    beyond the ``keep`` newest; True: all of them, unbounded: storage grows with every epoch).
    A node's in-memory tier under ``cfdist.fit`` never keeps them."""
    writers: str | int | bool = "node"
    """Who persists each checkpoint (the one parameter for it): ``"node"`` (default) rank 0
    writes the full state; ``True``/``False`` this rank writes the full state / nothing;
    ``"all"`` every rank writes a slice; an int ``N`` ranks ``0..N-1`` write a slice each.

    ``True``/``False`` is how each node gets its own full copy on its own disk
    (``writers=local_rank == 0``; ``cfdist.fit`` and ``launch/torchrun_train.py`` do that).
    With ``"all"``/``N``, each writer writes a disjoint slice of about ``1/N`` of the bytes
    from its own replica, and rank 0 commits once every slice is durable
    (:mod:`cfdist.checkpoint.slices`); the storage must be one every writer sees."""
    buffers: int = 1
    """Sets of snapshot buffers. 1: a snapshot waits until the previous checkpoint's persist
    ended. 2 (double buffering): snapshot i+1 copies into the second set while persist i still
    writes, and waits only when both sets are held by persists; persists still run one at a
    time, in step order. Host memory for snapshots: ``buffers`` x the state's tensor bytes
    (``stats["arena_bytes"]``); GPU snapshot memory stays 1 x. A failure can then lose the
    checkpoints of up to ``buffers`` intervals in flight: lost work <= (buffers + 1) x k."""
    host_memory: int | float | None = None
    """A host-memory budget for snapshots: bytes (int), or a fraction of the state's tensor
    bytes (float in (0, 1]); None (default): full host copies, ``buffers`` x the state.
    Under a budget a snapshot streams through a bounded pool of chunks into its persist
    (:mod:`cfdist.checkpoint.chunks`): the copy of the later bytes waits for the writes of the
    earlier ones, so with a budget ``B`` below the state's ``S`` bytes the next update waits
    until ``S - B`` bytes reached storage (the stall's floor is ``(S - B) /`` write bandwidth).
    The budget holds whatever ``buffers`` says (the persists in flight share it) and is per
    writer process. Every backend (the process one and ``cfdist.fit``'s node actors through a
    shared pool in ``/dev/shm``; a node's memory tier is not counted), no codecs; the tensors
    the next forward mutates (module buffers) are copied whole and count against it."""
    persist: PersistOptions = field(default_factory=PersistOptions)
    """How checkpoints are written: :class:`PersistOptions`."""
    load: LoadOptions = field(default_factory=LoadOptions)
    """How ``restore`` reads them: :class:`LoadOptions`."""
    group: GroupOptions = field(default_factory=GroupOptions)
    """The job's ranks: :class:`GroupOptions`."""

    def __post_init__(self):
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise ValueError(f"keep must be an int >= 1 (newest checkpoints to keep), got {self.keep!r}")
        if not isinstance(self.keep_epoch_ends, int) or self.keep_epoch_ends < 0:
            raise ValueError(f"keep_epoch_ends must be an int >= 0 (how many of the most recent epoch-end "
                             f"checkpoints to keep; True keeps all, False none), got {self.keep_epoch_ends!r}")
        if not isinstance(self.buffers, int) or isinstance(self.buffers, bool) or not 1 <= self.buffers <= 4:
            raise ValueError(f"buffers must be an int in [1, 4] (sets of snapshot buffers: 2 lets a snapshot "
                             f"start while the previous persist still writes), got {self.buffers!r}")
        from cfdist.checkpoint.chunks import check_budget
        check_budget(self.host_memory)
        w = self.writers
        if not (w in ("node", "all") or isinstance(w, bool) or (isinstance(w, int) and w >= 1)):
            raise ValueError(f"writers must be 'node' (rank 0 writes the full state), True/False (this rank "
                             f"writes the full state / nothing), 'all' (every rank writes a slice) or an int "
                             f"N >= 1 (ranks 0..N-1 write a slice each); got {w!r}")
        for name, cls in (("persist", PersistOptions), ("load", LoadOptions), ("group", GroupOptions)):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"{name}= must be a cfdist.{cls.__name__}, got {getattr(self, name)!r}")


LEGACY: dict[str, tuple[str, str]] = {
    "backend": ("persist", "backend"), "persist_timeout_s": ("persist", "timeout_s"), "io": ("persist", "io"),
    "verify": ("load", "verify"), "read_retry": ("load", "read_retry"),
    "rank": ("group", "rank"), "world_size": ("group", "world_size"), "store": ("group", "store"),
    "lookahead": ("group", "lookahead"), "agree_timeout_s": ("group", "agree_timeout_s"),
}
"""The constructor's flat keywords before the groups: old name -> (group, field)."""

_GROUPS = {"persist": PersistOptions, "load": LoadOptions, "group": GroupOptions}


def route_settings(flat: dict[str, Any], routes: dict[str, tuple[str, str]], given: dict[str, Any],
                   classes: dict[str, type], *, owner: str) -> dict[str, dict[str, Any]]:
    """Settings given one by one, sorted into their groups: ``{group: {field: value}}``.

    ``routes``: setting name -> (group, field); ``given``: the groups passed as objects (or
    None); ``classes``: group -> its options class. A name without a route is a TypeError
    naming the groups (as Python's own for a wrong keyword); a setting given beside its group a
    ValueError (two ways of saying one thing could disagree). The one place both the
    Checkpointer's and ``cfdist.fit``'s flat spellings go through."""
    moved: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        route = routes.get(name)
        if route is None:
            groups = ", ".join(f"{g}=cfdist.{c.__name__}(...)" for g, c in classes.items())
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}; the grouped settings are {groups}")
        group, fld = route
        if given.get(group) is not None:
            raise ValueError(f"{owner}: {name}= and {group}= both given; pass {name} as "
                             f"{group}=cfdist.{classes[group].__name__}({fld}=...) only")
        moved.setdefault(group, {})[fld] = value
    return moved


def from_legacy(groups: dict[str, Any], legacy: dict[str, Any], *, owner: str = "Checkpointer",
                stacklevel: int = 3) -> dict[str, Any]:
    """``groups`` with the old flat keywords of ``legacy`` moved into their groups (a
    ``DeprecationWarning`` naming the new spelling each; ``writer=`` is the constructor's to
    map, onto ``writers=``). Errors as :func:`route_settings`."""
    moved = route_settings(legacy, LEGACY, groups, _GROUPS, owner=owner)
    for name in legacy:
        group, fld = LEGACY[name]
        warnings.warn(f"{owner}({name}=...) is deprecated: pass {group}=cfdist.{_GROUPS[group].__name__}({fld}=...)",
                      DeprecationWarning, stacklevel=stacklevel)   # at the caller's line
    out = dict(groups)
    for group, fields in moved.items():
        out[group] = _GROUPS[group](**fields)
    return out
