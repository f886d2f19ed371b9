"""``cfdist.lightning.CheckpointCallback``: cfdist's two-phase checkpoints inside ``trainer.fit``.

::

    from cfdist.lightning import CheckpointCallback

    trainer = L.Trainer(max_epochs=10, callbacks=[CheckpointCallback("file:///mnt/ssd/run1")])
    trainer.fit(model, train_dataloaders=cfdist.ResumableLoader(ds, 32, seed=0))
    # killed? run the same two lines again: fit resumes from the newest committed checkpoint

What is checkpointed, at the end of each optimizer step the policy picks: the LightningModule's
``state_dict``, every optimizer and LR scheduler, the fit loop's position (global step, epoch,
batch index: Lightning's own loop state) and, through it, the position of every train
dataloader that has ``state_dict``/``load_state_dict`` (``cfdist.ResumableLoader``, torchdata's
``StatefulDataLoader``), and the RNG states. When it happens (CheckFreq's two phases):

* ``on_before_optimizer_step``: the gate, i.e. wait until the previous snapshot's copy finished
  (the only stall);
* ``on_train_batch_end`` (after the optimizer and the step-interval schedulers, before the next
  batch is fetched): count the step, snapshot it if the policy says so, capture the small state;
  the copy overlaps the next forward/backward, the write runs in the background.

``trainer.fit`` resumes by itself from the newest committed checkpoint in ``storage`` (unless
``fit`` is given a ``ckpt_path``: Lightning's own checkpoint then wins). A SIGTERM (preemption
notice) makes the step in progress checkpoint and commit before Lightning stops the run.
In DDP every rank runs the callback; rank 0 writes (replicas are identical), no rank issues an
extra collective. Lightning's ``ModelCheckpoint`` may run alongside (it writes its own files).
"""

from __future__ import annotations

import dataclasses
import logging

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("cfdist.lightning needs Lightning: pip install 'cfdist[lightning]'") from e

from lightning.pytorch.utilities.exceptions import SIGTERMException

from cfdist.checkpoint import Checkpointer, GroupOptions
from cfdist.checkpoint.state import rng_state, set_rng_state

log = logging.getLogger("cfdist.lightning")


class _FitLoopState:
    """The fit loop's position as a state entry (Lightning's loop ``state_dict``: progress
    counters, and the train dataloaders' own states when they have one).

    It reads the position recorded by :meth:`record` at the last ``on_train_batch_end``: the
    instant Lightning's own restart logic expects, still right when a SIGTERM ends the run a
    few hooks later (the counters have moved on by then, nothing else has).
    """

    def __init__(self, trainer: "pl.Trainer"):
        self.trainer = trainer
        self.recorded: dict | None = None

    def record(self) -> None:
        self.recorded = self.trainer.fit_loop.state_dict()

    def state_dict(self) -> dict:
        return self.recorded if self.recorded is not None else self.trainer.fit_loop.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trainer.fit_loop.load_state_dict(state)


class CheckpointCallback(pl.Callback):
    """Iteration-level, two-phase checkpoints of a Lightning fit into ``storage``.

    Args:
        storage: fsspec URL (or list of URLs to stripe over) of this run's checkpoints; the
            newest committed one there is restored when ``fit`` starts.
        policy: ``cfdist.Every(k)``, ``cfdist.EveryEpoch()``, ``cfdist.Auto()`` (default).
        keep: newest committed checkpoints kept.
        save_on_sigterm: on SIGTERM, checkpoint the step in progress and wait for its commit
            before Lightning ends the run.
        **checkpointer_kwargs: further :class:`cfdist.Checkpointer` arguments (``restore_from``,
            ``storage_options``, ``backend``, ``keep_epoch_ends``, ``verify``).
    """

    def __init__(self, storage, policy=None, keep: int = 2, *, save_on_sigterm: bool = True,
                 **checkpointer_kwargs):
        self.storage = storage
        self.policy = policy
        self.keep = keep
        self.save_on_sigterm = save_on_sigterm
        self.checkpointer_kwargs = checkpointer_kwargs
        self.ckpt: Checkpointer | None = None
        self.restored_step: int | None = None
        self._stepped = False
        self._loop: _FitLoopState | None = None
        self._rng_after_restore: dict | None = None

    @property
    def state_key(self) -> str:
        return f"cfdist.CheckpointCallback[{self.storage!r}]"

    # ---- start: build the checkpointer over the live objects and restore ----------------------
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        state: dict = {"model": pl_module}
        for i, opt in enumerate(trainer.optimizers):
            state[f"optimizer{i}"] = opt
        for i, cfg in enumerate(trainer.lr_scheduler_configs):
            state[f"scheduler{i}"] = cfg.scheduler
        state["fit_loop"] = self._loop = _FitLoopState(trainer)
        kwargs = dict(self.checkpointer_kwargs)
        group = dataclasses.replace(kwargs.pop("group", None) or GroupOptions(), rank=trainer.global_rank,
                                    world_size=trainer.world_size)
        self.ckpt = Checkpointer(state, self.storage, self.policy, keep=self.keep, group=group, **kwargs)
        if trainer.ckpt_path is not None:
            log.info("fit(ckpt_path=%s) given: Lightning restores it; cfdist does not restore from %s",
                     trainer.ckpt_path, self.storage)
            return
        self.restored_step = self.ckpt.restore()
        self._rng_after_restore = rng_state() if self.restored_step is not None else None
        if self.restored_step is not None:
            log.info("resumed from cfdist step %d (global step %d, epoch %d) in %s", self.restored_step,
                     trainer.global_step, trainer.current_epoch, self.storage)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rng, self._rng_after_restore = self._rng_after_restore, None
        if rng is not None and batch_idx > 0:
            # Resumed mid-epoch: Lightning re-created the loader's iterator since the restore,
            # which may have drawn from the global RNG (torch's DataLoader draws a base seed);
            # the uninterrupted run drew nothing between the two batches. At an epoch start
            # (batch_idx 0) both runs create the next epoch's iterator, so the draws stay.
            set_rng_state(rng)

    # ---- each step: gate before the update, snapshot after it ---------------------------------
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.ckpt is not None:
            self.ckpt.gate()
            self._stepped = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.ckpt is None or not self._stepped:    # accumulating gradients: no update yet
            return
        self._stepped = False
        self._loop.record()
        self.ckpt.step()
        self.ckpt.boundary()          # the loop state, schedulers and RNG as of the end of this batch
        # One process: save as soon as the notice is seen. Several: every rank must save the same
        # step, so wait for the SIGTERMException Lightning raises on all ranks at the same batch
        # (it broadcasts rank 0's notice before each batch) and save in on_exception.
        if self.save_on_sigterm and trainer.received_sigterm and trainer.world_size == 1:
            self._emergency_save()

    def _emergency_save(self) -> None:
        """Checkpoint the last finished step (if not yet) and wait for its commit."""
        log.warning("SIGTERM received: checkpointing step %d before Lightning stops", self.ckpt.step_count)
        self.ckpt.save(block=True)

    # ---- end --------------------------------------------------------------------------------
    def on_fit_end(self, trainer, pl_module) -> None:
        self._close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Lightning raises SIGTERMException between batches: the notice came after this
        # callback's last on_train_batch_end, so that step is the one to save now.
        if self.ckpt is not None and self.save_on_sigterm and isinstance(exception, SIGTERMException):
            self._emergency_save()
        self._close()                 # a snapshot already taken still commits

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self.ckpt is not None:
            ckpt, self.ckpt = self.ckpt, None
            ckpt.close()

    def state_dict(self) -> dict:
        """What Lightning's own checkpoint (``ModelCheckpoint``) records about this callback."""
        return {"storage": str(self.storage), "restored_step": self.restored_step}
