"""Two-phase checkpointing: snapshot (phase 1), persist (phase 2), format, retention, discovery.

Knows nothing about Ray: runs in a plain script, under torchrun, or inside a Ray actor.
"""

from cfdist.checkpoint.agreement import AgreementError
from cfdist.checkpoint.checkpointer import Checkpointer
from cfdist.checkpoint.discovery import list_checkpoints, load
from cfdist.checkpoint.format import CheckpointError
from cfdist.checkpoint.options import CheckpointerConfig, GroupOptions, LoadOptions, PersistOptions
from cfdist.checkpoint.persist import CommitInfo, PersistBackend, PersistJob, write_checkpoint
from cfdist.checkpoint.retry import RetryPolicy, StorageUnavailable
from cfdist.checkpoint.roots import StripeSetError

__all__ = ["AgreementError", "Checkpointer", "CheckpointerConfig", "CheckpointError", "CommitInfo", "GroupOptions",
           "LoadOptions", "PersistBackend", "PersistJob", "PersistOptions", "RetryPolicy", "StorageUnavailable",
           "StripeSetError", "list_checkpoints", "load", "write_checkpoint"]
