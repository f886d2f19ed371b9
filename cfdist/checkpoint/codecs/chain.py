"""What chain codecs remember between checkpoints, and the per-persist plan built from it.

A chain codec (``Incremental``, ``LCDelta``) encodes a tensor against a *reference*: the same
tensor as an earlier committed checkpoint of the same storage holds it. The encoder keeps that
reference in host memory (a :class:`ChainState` per codec, per storage, in the process that
persists: the writer thread, the writer process, or the node actor), because reading it back
from storage at every checkpoint would cost more than writing the full tensor. Memory cost:
one copy of every tensor the codec selects (for ``LCDelta`` up to two while a persist runs).

A node actor writes its memory and local tiers as two chains (each tier's references are its
own), so it encodes twice. The state is updated only after the checkpoint committed, so a failed persist leaves the
reference pointing at the newest committed checkpoint. A checkpoint is encoded against
a reference only when that reference is older than it and still committed; otherwise it is
written in full (the first checkpoint of every process, after a layout change, after a
rollback, every ``full_every``-th).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from cfdist.checkpoint.format import MANIFEST, step_dir


@dataclass
class ChainState:
    """One chain codec's memory of its chain on one storage (lives in the persisting process)."""

    base: tuple[int, str] | None = None
    """(step, checkpoint id) of the chain's last full checkpoint."""
    links: list[tuple[int, str]] = field(default_factory=list)
    """Committed checkpoints of the chain, base first (what the newest one depends on)."""
    since_full: int = 0
    refs: dict[str, np.ndarray] = field(default_factory=dict)


# (storage URL) -> (session id, {codec name: ChainState}). One session per storage: a new
# Checkpointer (a restart) replaces the previous one's references instead of leaking them.
_STATES: dict[str, tuple[str, dict[str, ChainState]]] = {}
_LOCK = threading.Lock()


def states_for(url: str, session: str) -> dict[str, ChainState]:
    with _LOCK:
        cur = _STATES.get(url)
        if cur is None or cur[0] != session:
            cur = _STATES[url] = (session, {})
        return cur[1]


def forget(url: str) -> None:
    """Drop the references kept for ``url`` (tests, or to free memory)."""
    with _LOCK:
        _STATES.pop(url, None)


class ChainPlan:
    """One chain codec's decision for one persist: full, or encode against ``ref``.

    Built once per persist (thread-safe: shards are encoded on one thread per root).
    Encoders call :meth:`reference` per tensor and queue what the state becomes after the
    commit with :meth:`after_commit`.
    """

    def __init__(self, codec, state: ChainState, storage, step: int, consecutive: bool):
        self.codec, self.state, self.step = codec, state, step
        self.consecutive = consecutive
        ref = (state.links[-1] if consecutive else state.base) if state.links else None
        full_every = getattr(codec, "full_every", None)
        due = full_every is not None and state.since_full + 1 >= full_every
        self.reason = ("no reference yet" if ref is None else
                       f"every {full_every}" if due else
                       f"reference step {ref[0]} is not older than {step}" if ref[0] >= step else None)
        if self.reason is None and not storage.exists(f"{step_dir(ref[0])}/{MANIFEST}"):
            self.reason = f"reference step {ref[0]} is no longer committed"
        self.full = self.reason is not None
        self.ref = None if self.full else ref
        self._lock = threading.Lock()
        self._updates: list = []
        self.used = False
        self.staged: dict[str, np.ndarray] = {}
        """Frames (:class:`FramePlan`) of a full checkpoint: each tensor's next reference, filled
        frame by frame, in place of the old one at the commit."""

    def reference(self, name: str, arr: np.ndarray) -> np.ndarray | None:
        """The reference of tensor ``name`` when it can be encoded against one, else None."""
        self.used = True
        if self.full:
            return None
        r = self.state.refs.get(name)
        return r if r is not None and r.shape == arr.shape and r.dtype == arr.dtype else None

    def remember(self, name: str, arr: np.ndarray) -> None:
        """``arr`` (written whole) becomes the reference of ``name`` once committed, when later
        checkpoints will encode against this one."""
        if self.full or self.consecutive:
            self.after_commit(lambda refs: refs.__setitem__(name, np.array(arr, copy=True)))

    @staticmethod
    def keep(arr: np.ndarray) -> np.ndarray:
        """``arr`` (a view of the snapshot) as it will still be at the commit, for an
        :meth:`after_commit` update: itself, since the arenas hold their bytes until then."""
        return arr

    def after_commit(self, fn) -> None:
        with self._lock:
            self._updates.append(fn)

    def depends_on(self) -> list[tuple[int, str]]:
        if self.full or not self.used:
            return []
        return list(self.state.links) if self.consecutive else [self.state.base]

    def commit(self, step: int, ckpt_id: str) -> None:
        """Apply the queued updates: called once the checkpoint is committed."""
        if not self.used:
            return
        st = self.state
        if self.full:
            st.refs.clear()
        for fn in self._updates:
            fn(st.refs)
        if self.full:
            st.base, st.links, st.since_full = (step, ckpt_id), [(step, ckpt_id)], 0
        else:
            st.since_full += 1
            st.links.append((step, ckpt_id))


class _FrameRefs:
    """What an :meth:`ChainPlan.after_commit` update of one frame sees as ``refs``: the frame's
    elements of each reference (a view of the same shape as the frame), so a codec written for
    whole tensors updates its frame's part of the reference and nothing else."""

    def __init__(self, refs: dict, frame: FramePlan):
        self._refs, self._f = refs, frame

    def __getitem__(self, name: str) -> np.ndarray:
        f = self._f
        return self._refs[name].reshape(-1)[f.start:f.stop].reshape(f.shape)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        f = self._f
        r = self._refs.get(name)
        if r is None or r.shape != f.full_shape or r.dtype != value.dtype:
            # the first frame of a tensor written whole: its reference is filled frame by frame
            r = self._refs[name] = np.empty(f.full_shape, dtype=value.dtype)
        r.reshape(-1)[f.start:f.stop] = value.reshape(-1)


class FramePlan:
    """A :class:`ChainPlan` as one *frame* of a tensor sees it: elements ``[start, stop)`` of the
    flattened tensor (``full_shape``), encoded as an array of ``shape``. Under a host-memory budget
    the persist encodes a snapshot chunk by chunk (:func:`cfdist.checkpoint.codecs.pipeline.encode_frames`),
    so chain codecs see frames: their reference is the same elements of the tensor's reference,
    and what they queue for after the commit changes only those (:class:`_FrameRefs`)."""

    def __init__(self, plan: ChainPlan, full_shape: tuple[int, ...], start: int, stop: int, shape: tuple[int, ...]):
        self.plan, self.full_shape, self.start, self.stop, self.shape = plan, tuple(full_shape), start, stop, shape

    @property
    def ref(self):
        return self.plan.ref

    def reference(self, name: str, arr: np.ndarray) -> np.ndarray | None:
        p = self.plan
        p.used = True
        if p.full:
            return None
        r = p.state.refs.get(name)
        if r is None or r.shape != self.full_shape or r.dtype != arr.dtype:
            return None
        return r.reshape(-1)[self.start:self.stop].reshape(arr.shape)

    def remember(self, name: str, arr: np.ndarray) -> None:
        p = self.plan
        if p.full:
            # every frame of every tensor is remembered: straight into the next reference, and
            # the old one (which this checkpoint does not read) goes now, so the references
            # stay one copy of the selected tensors, not two. Should this persist fail, the
            # next one finds no reference for the tensor and writes it whole: never wrong.
            with p._lock:
                buf, new = p.staged.get(name), False
                if buf is None:
                    p.state.refs.pop(name, None)
                    buf, new = p.staged.setdefault(name, np.empty(self.full_shape, dtype=arr.dtype)), True
            if new:
                p.after_commit(lambda refs: refs.__setitem__(name, buf))
            buf.reshape(-1)[self.start:self.stop] = arr.reshape(-1)
        elif p.consecutive:
            copy = self.keep(arr)
            self.after_commit(lambda refs: refs.__setitem__(name, copy))

    @staticmethod
    def keep(arr: np.ndarray) -> np.ndarray:
        """A copy: ``arr`` is a chunk of the snapshot, reused as soon as the frame was written."""
        return np.array(arr, copy=True)

    def after_commit(self, fn) -> None:
        self.plan.after_commit(lambda refs: fn(_FrameRefs(refs, self)))
