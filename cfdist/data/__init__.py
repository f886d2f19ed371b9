"""Resumable, exactly-once, elastic data iterators.

* :func:`partition` (in :mod:`cfdist.data.partition`): the pure core, ``(seed, epoch,
  num_samples, consumed, world_size, rank, batch_size) -> indices``.
* :class:`ResumableSampler`: a rank-sharded ``Sampler`` over it.
* :class:`ResumableLoader`: a ``DataLoader`` wrapper whose position counts batches the training
  loop received (``state_dict``/``load_state_dict``, ``at_epoch_end``, before-next hooks).
* :func:`stateful_loader`, :func:`data_state_of`, :func:`load_data_state`: torchdata's
  ``StatefulDataLoader`` over a ``ResumableSampler``, and its position converted to and from
  a ``ResumableLoader``'s (:mod:`cfdist.data.stateful` says where that holds).
* :class:`DALIResumableIterator`: the same plan feeding a DALI pipeline whose random operators
  are checkpointed too; :func:`image_classification_iterator` is a ready image pipeline.

The checkpoint engine sees only ``state_dict()`` (plain JSON values) and ``load_state_dict()``.
"""

from cfdist.data.dali import DALIResumableIterator
from cfdist.data.dali_image import ImageFileSource, image_augment_graph, image_classification_iterator
from cfdist.data.loader import ResumableLoader
from cfdist.data.partition import epoch_permutation, partition, step_sizes
from cfdist.data.sampler import ResumableSampler
from cfdist.data.state import DataState, IncompatibleDataState
from cfdist.data.stateful import data_state_of, load_data_state, stateful_loader

__all__ = [
    "DALIResumableIterator",
    "DataState",
    "ImageFileSource",
    "IncompatibleDataState",
    "ResumableLoader",
    "ResumableSampler",
    "epoch_permutation",
    "image_augment_graph",
    "data_state_of",
    "image_classification_iterator",
    "load_data_state",
    "partition",
    "stateful_loader",
    "step_sizes",
]
