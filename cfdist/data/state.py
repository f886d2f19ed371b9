"""The resume state of a data iterator, its layout, and the rules for resuming one from the other.

Pure data and pure checks: JSON-able plain values only (the state goes into checkpoint
manifests, which are never unpickled). Torch appears only in :func:`resolve_world`, which reads
the default rank/world size from ``torch.distributed`` when it is initialised.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, fields

log = logging.getLogger(__name__)

FORMAT = "cfdist.data/1"
"""Tag of the state format; a state with another tag is refused (it is not ours or not this version)."""


class IncompatibleDataState(ValueError):
    """A checkpointed data position cannot be resumed exactly with this iterator's layout."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``; each ``None`` is taken from torch.distributed, else ``(0, 1)``."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        live = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if live else 0
        if world_size is None:
            world_size = dist.get_world_size() if live else 1
    return rank, world_size


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """How one rank's iterator is configured: what it reads and how samples are shared out."""

    num_samples: int
    """Samples in the dataset (``len(dataset)``); >= 1."""
    batch_size: int
    """Samples per batch on each rank; >= 1 (1 for a sample-level :class:`ResumableSampler`)."""
    seed: int = 0
    """Seed of the per-epoch permutation; >= 0. Same on every rank."""
    shuffle: bool = True
    """Permute each epoch; ``False`` reads ``0..num_samples-1`` in order."""
    drop_last: bool = False
    """Drop the tail shorter than one global batch (``batch_size * world_size``)."""
    rank: int = 0
    """This process's rank, ``0 <= rank < world_size``."""
    world_size: int = 1
    """Number of ranks sharing each global batch."""
    fingerprint: str | None = None
    """Optional identity of the dataset's content (e.g. a hash of file names and sizes); a
    checkpoint with another fingerprint is refused."""

    def __post_init__(self) -> None:
        for name in ("num_samples", "batch_size", "world_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if not _is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be an integer in [0, world_size={self.world_size}), got {self.rank!r}; "
                "pass rank/world_size explicitly or initialise torch.distributed first"
            )
        if self.fingerprint is not None and not isinstance(self.fingerprint, str):
            raise ValueError(f"fingerprint must be a str or None, got {type(self.fingerprint).__name__}")


@dataclass(kw_only=True, slots=True)
class DataState:
    """Where an iterator stands. Identical on every rank (the DALI part aside)."""

    epoch: int
    """Epoch of the last batch yielded (0-based)."""
    consumed: int
    """Samples of this epoch's permutation used by yielded batches, summed over ranks."""
    epoch_done: bool
    """The last batch yielded was the epoch's last: the next iteration starts ``epoch + 1``."""
    seed: int
    shuffle: bool
    drop_last: bool
    batch_size: int
    """Per-rank batch size when saved (informational: a new batch size is allowed)."""
    num_samples: int
    fingerprint: str | None
    world_size: int
    """World size when saved."""
    epoch_world_size: int
    """World size when this epoch started (differs from ``world_size`` after an elastic resume)."""

    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, d: object) -> DataState:
        """Validate and parse a state produced by :meth:`to_dict` (possibly via JSON)."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise IncompatibleDataState(
                f"not a cfdist data state (format {got!r}, expected {FORMAT!r}); pass the dict "
                "returned by state_dict() of a cfdist data iterator"
            )
        kinds = {"epoch_done": bool, "shuffle": bool, "drop_last": bool}
        values = {}
        for f in fields(cls):
            if f.name not in d:
                raise IncompatibleDataState(f"data state lacks {f.name!r}: {sorted(d)}")
            v = d[f.name]
            if f.name == "fingerprint":
                ok = v is None or isinstance(v, str)
            elif f.name in kinds:
                ok = isinstance(v, bool)
            else:
                ok = _is_int(v) and v >= 0
            if not ok:
                raise IncompatibleDataState(f"data state field {f.name}={v!r} has the wrong type/value")
            values[f.name] = v
        state = cls(**values)
        if state.consumed > state.num_samples:
            raise IncompatibleDataState(
                f"data state says {state.consumed} samples consumed of a {state.num_samples}-sample "
                "epoch; the state is corrupt"
            )
        return state


def check_resume(saved: DataState, layout: Layout) -> list[str]:
    """What makes resuming ``saved`` with ``layout`` break exactly-once (empty: safe). Pure."""
    problems = []
    mid_epoch = not saved.epoch_done and saved.consumed > 0
    where = f"epoch {saved.epoch}, {saved.consumed}/{saved.num_samples} samples consumed"
    if saved.num_samples != layout.num_samples:
        problems.append(
            f"the dataset has {layout.num_samples} samples but the checkpoint was taken with "
            f"{saved.num_samples}: the permutation and the position ({where}) do not carry over"
        )
    if (
        saved.fingerprint is not None
        and layout.fingerprint is not None
        and saved.fingerprint != layout.fingerprint
    ):
        problems.append(
            f"the dataset's fingerprint is {layout.fingerprint!r} but the checkpoint's is "
            f"{saved.fingerprint!r}: it is not the same data"
        )
    if mid_epoch and saved.shuffle != layout.shuffle:
        problems.append(
            f"shuffle={layout.shuffle} but the checkpoint was taken with shuffle={saved.shuffle} "
            f"mid-epoch ({where}): the rest of the epoch would repeat or skip samples; construct "
            f"the iterator with shuffle={saved.shuffle} (it may change at the next epoch)"
        )
    elif mid_epoch and saved.shuffle and saved.seed != layout.seed:
        problems.append(
            f"seed={layout.seed} but the checkpoint was taken with seed={saved.seed} mid-epoch "
            f"({where}): the rest of the epoch would repeat or skip samples; construct the "
            f"iterator with seed={saved.seed} (it may change at the next epoch)"
        )
    return problems


def resume_position(saved: DataState, layout: Layout, *, strict: bool = True) -> tuple[int, int, bool]:
    """``(epoch, consumed, epoch_done)`` to continue from, or :class:`IncompatibleDataState`.

    ``strict=False`` turns the refusal into a warning: the position is kept (``consumed``
    clamped to the dataset), and the iterator's own seed/shuffle apply from there on, so that
    epoch may repeat or skip samples. Later epochs are exact again.
    """
    problems = check_resume(saved, layout)
    if problems and strict:
        raise IncompatibleDataState(
            "cannot resume the data iterator exactly: "
            + "; ".join(problems)
            + ". To accept this knowingly, call load_state_dict(state, strict=False)."
        )
    if problems:
        log.warning("resuming the data iterator inexactly (strict=False): %s", "; ".join(problems))
    consumed = min(saved.consumed, layout.num_samples)
    if saved.world_size != layout.world_size and not saved.epoch_done and consumed:
        log.info(
            "elastic resume: epoch %d at %d/%d samples, world size %d (was %d when saved, %d at "
            "the epoch's start); the %d remaining samples are re-partitioned",
            saved.epoch, consumed, layout.num_samples, layout.world_size, saved.world_size,
            saved.epoch_world_size, layout.num_samples - consumed,
        )
    return saved.epoch, consumed, saved.epoch_done


def batches_per_epoch(layout: Layout) -> int:
    """Steps (batches per rank) in a whole epoch under ``layout``.

    Without ``drop_last`` it is ``ceil(num_samples / (batch_size * world_size))``: splitting
    the last full step and a short tail into two steps does not add a step.
    """
    full = layout.batch_size * layout.world_size
    if layout.drop_last:
        return layout.num_samples // full
    return math.ceil(layout.num_samples / full)
