"""cfdist: iteration-level checkpointing and preemption-tolerant data-parallel training.

Everything users may import is listed in ``__all__``; anything else can change. Also public:
:mod:`cfdist.testing`, fault-injecting storage to test a training loop's recovery with (imported
on its own: ``import cfdist`` does not load it).
"""

from cfdist import codecs
from cfdist.api import OutputOptions, RecoveryOptions, TierOptions, fit
from cfdist.checkpoint import (
    AgreementError, CheckpointError, Checkpointer, GroupOptions, LoadOptions, PersistOptions, list_checkpoints, load,
)
from cfdist.checkpoint.retry import RetryPolicy, StorageUnavailable
from cfdist.cluster import FitError, FitResult, TrainContext
from cfdist.cluster.exits import exit_process
from cfdist.data import DALIResumableIterator, ResumableLoader, ResumableSampler
from cfdist.planner import plan
from cfdist.policy import Auto, Every, EveryEpoch

__version__ = "0.1.0"

__all__ = [
    "AgreementError", "Auto", "CheckpointError", "Checkpointer", "DALIResumableIterator", "Every", "EveryEpoch",
    "FitError", "FitResult", "GroupOptions", "LoadOptions", "OutputOptions", "PersistOptions",
    "RecoveryOptions", "ResumableLoader", "ResumableSampler", "RetryPolicy", "StorageUnavailable", "TierOptions", "TrainContext",
    "fit", "plan",
    "codecs", "exit_process", "list_checkpoints", "load", "__version__",
]
