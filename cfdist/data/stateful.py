"""torchdata's ``StatefulDataLoader`` and cfdist's data position, converted where they mean the same.

A ``StatefulDataLoader`` placed in a :class:`~cfdist.Checkpointer` state needs nothing from
here: it has ``state_dict``/``load_state_dict``/``__iter__``, so it is captured like any data
iterator, right after the optimizer step of batch i (before the next fetch), and restored
before the next ``iter()``.

Converting positions between it and :class:`~cfdist.ResumableLoader` is possible only when both
hand out the same samples, i.e. when the ``StatefulDataLoader`` draws its indices from a
:class:`~cfdist.ResumableSampler` (:func:`stateful_loader` builds one). Both then consume a
prefix of the same per-epoch permutation, and cfdist's position (a :class:`DataState`) is the
same object in both. What carries over and what does not:

* exactly-once holds across the switch, in both directions, with any world size;
* with ``world_size == 1`` and ``drop_last=False`` the batches are the very same; with more
  ranks each rank's batches are made of other samples of the same global step (the sampler
  interleaves ranks sample by sample, the loader gives each rank a contiguous slice);
* ``drop_last=True`` drops a short tail per rank on one side and per global batch on the other:
  the epoch's last batches may differ;
* random augmentations in workers do not carry over: the loader seeds its workers from
  ``(seed, epoch, rank)``, the ``StatefulDataLoader`` from the global torch RNG;
* a ``StatefulDataLoader`` with its own sampler (``shuffle=True``'s ``RandomSampler``,
  ``DistributedSampler``, ...) orders samples by a torch generator, not by cfdist's
  permutation: :func:`data_state_of` refuses its state (a position in another order is no
  position in ours).
"""

from __future__ import annotations

from typing import Any

from cfdist.data.sampler import ResumableSampler
from cfdist.data.state import DataState

_NOT_CFDIST = ("the StatefulDataLoader state holds no cfdist sampler position: its indices come from "
               "its own sampler ({what}), whose order is not cfdist's permutation, so the position "
               "cannot be converted; build the loader with cfdist.data.stateful_loader(...) (or "
               "sampler=cfdist.ResumableSampler(...)) to convert positions")


def stateful_loader(dataset: Any, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                    rank: int | None = None, world_size: int | None = None, drop_last: bool = False,
                    fingerprint: str | None = None, **dataloader_kwargs: Any):
    """A ``torchdata.stateful_dataloader.StatefulDataLoader`` over a :class:`ResumableSampler`:
    the samples a :class:`~cfdist.ResumableLoader` with the same arguments would hand out, in
    batches of ``batch_size`` per rank, and a position :func:`data_state_of` can read."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    owned = sorted({"sampler", "batch_sampler", "shuffle"} & set(dataloader_kwargs))
    if owned:
        raise TypeError(f"stateful_loader decides {owned} itself (a ResumableSampler); use seed/shuffle")
    sampler = ResumableSampler(len(dataset), seed=seed, shuffle=shuffle, rank=rank, world_size=world_size,
                               drop_last=drop_last, fingerprint=fingerprint)
    return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                              **dataloader_kwargs)


def _sampler_iter_state(state: dict) -> dict | None:
    """The batch-sampler iterator's state of a single- or multi-process loader state."""
    main = state.get("_snapshot", {}).get("_main_snapshot", state) if "_snapshot" in state else state
    return main.get("_sampler_iter_state")


def data_state_of(state: dict) -> dict:
    """The cfdist position (``ResumableLoader.load_state_dict`` accepts it) held in a
    ``StatefulDataLoader.state_dict()`` of a loader built by :func:`stateful_loader`.

    Batches the ``StatefulDataLoader`` had prefetched but not yielded are not counted (its
    state already accounts for them). ``ValueError`` saying why for any other loader's state.
    """
    if not isinstance(state, dict):
        raise ValueError(f"expected a StatefulDataLoader.state_dict(), got {type(state).__name__}")
    it = _sampler_iter_state(state)
    if not isinstance(it, dict):
        raise ValueError(_NOT_CFDIST.format(what="no batch-sampler state at all"))
    inner = it.get("sampler_state")
    if not _is_data_state(inner):
        own = it.get("sampler_iter_state")
        what = "a RandomSampler" if isinstance(own, dict) and "generator" in own else "not a ResumableSampler"
        raise ValueError(_NOT_CFDIST.format(what=what))
    return dict(inner)


def _is_data_state(d: Any) -> bool:
    try:
        DataState.from_dict(d)
    except ValueError:
        return False
    return True


def load_data_state(loader, data_state: dict, *, strict: bool = True) -> None:
    """Position a :func:`stateful_loader` at a cfdist position (``ResumableLoader.state_dict()``):
    its next ``iter()`` yields the first batch not yet consumed. Call before iterating it.

    ``IncompatibleDataState`` as for ``ResumableLoader.load_state_dict`` (other dataset, seed or
    shuffle mid-epoch); ``TypeError`` if the loader's sampler is not a ``ResumableSampler``.
    """
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, ResumableSampler):
        raise TypeError(f"the loader's sampler is a {type(sampler).__name__}, not a cfdist.ResumableSampler: "
                        f"a cfdist position means nothing in its order; build it with "
                        f"cfdist.data.stateful_loader(...)")
    loader.load_state_dict({})           # drop its live iterator and any pending state
    sampler.load_state_dict(data_state, strict=strict)
